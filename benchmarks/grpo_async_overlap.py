"""Step time of GRPO with synchronous and asynchronous rollouts (generation overlapping training).

    python benchmarks/grpo_async_overlap.py --out benchmarks/results/grpo_async_overlap.json

Each mode trains the embedded tiny model on the bundled digit prompts with the transformers engine,
on a real Lightning Trainer, from the same seed. Rounds alternate the two modes so that a change in
the machine's load hits both; a step's time is measured from one training batch start to the next,
the first `--warmup` steps of each round left out, and the figures are medians over all rounds. In asynchronous mode the next batch is
generated on a background thread while the current one trains (`max_staleness` versions ahead), so
the step time falls from about generation + training towards the larger of the two, as far as the
cores allow. `--threads` sets torch's intra-op threads (default 1: generation and training each
get a core of a 2-core machine instead of both contending for the same two). The first round of
each process is slow while kernels warm up, so `--warmup` steps are dropped from every round.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_rl.data.prompts import PromptDataModule
from lightning_rl.modules.grpo import GRPOModule
from lightning_rl.rewards import RewardSpec


class StepClock(L.Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []
        self.generation: list[float] = []
        self.training: list[float] = []
        self.waiting: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        metrics = trainer.callback_metrics
        self.generation.append(pl_module.last_trained.generation_seconds)
        self.training.append(float(metrics["train/time/train_s"]))
        self.waiting.append(float(metrics["train/time/wait_for_rollouts_s"]))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.starts.append(time.perf_counter())


def run(async_mode: bool, args: argparse.Namespace) -> dict[str, list[float]]:
    L.seed_everything(0, verbose=False)
    module = GRPOModule(
        rewards=[RewardSpec("math_answer"), RewardSpec("format", weight=0.5, kwargs={"pattern": r"\s*\d"})],
        num_generations=args.generations, sampling={"max_new_tokens": args.max_new_tokens}, learning_rate=1e-3,
        async_mode=async_mode, max_staleness=args.max_staleness, log_rollouts_every_n_steps=0,
    )
    clock = StepClock()
    trainer = L.Trainer(
        max_steps=args.steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[clock],
    )
    trainer.fit(module, PromptDataModule(batch_size=args.prompts))
    keep = slice(args.warmup, None)
    return {
        "step_s": [b - a for a, b in zip(clock.starts, clock.starts[1:])][keep],
        "generation_s": clock.generation[keep],
        "train_s": clock.training[keep],
        "wait_for_rollouts_s": clock.waiting[keep],
        "staleness": [float(b["index"] - b["weight_version"]) for b in module.trained_batches],
    }


def summarise(rounds: list[dict[str, list[float]]]) -> dict[str, Any]:
    pooled = {key: [v for r in rounds for v in r[key]] for key in rounds[0]}
    summary = {f"median_{key}": statistics.median(values) for key, values in pooled.items() if key != "staleness"}
    summary["max_staleness_trained"] = max(pooled["staleness"])
    summary["steps_measured"] = len(pooled["step_s"])
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    rounds: dict[bool, list[dict[str, list[float]]]] = {False: [], True: []}
    for _ in range(args.rounds):
        for async_mode in (False, True):
            rounds[async_mode].append(run(async_mode, args))
    sync, asynchronous = summarise(rounds[False]), summarise(rounds[True])
    result = {
        "benchmark": "grpo_async_overlap",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_average_1min": [load_before, os.getloadavg()[0]],
        },
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "sync": sync,
        "async": asynchronous,
        "async_over_sync_step_time": asynchronous["median_step_s"] / sync["median_step_s"],
        "sync_step_over_generation_plus_train": sync["median_step_s"] / (sync["median_generation_s"] + sync["median_train_s"]),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
