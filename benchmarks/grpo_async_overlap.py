"""Throughput of GRPO's loop, synchronous and asynchronous, on the vLLM server engine with long-tail completions.

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/grpo_async_overlap.py \
        --out benchmarks/results/grpo_async_overlap.json

Modes, each a real Lightning Trainer run of the embedded tiny model on the bundled digit prompts from the same seed,
against one `vllm serve` process (the CPU build) started here:

- ``sync``: generate a batch, train on it, push the weights, and again;
- ``async``: the next batch is generated on the rollout thread while this one trains (``max_staleness`` ahead), and a
  weight push lets the completions in flight finish on the old weights first (engine ``pause: wait``);
- ``async_keep``: as ``async``, but a push freezes the completions in flight and they continue under the new weights
  (``pause: keep``: generation across updates, several weight versions in one completion), and each batch starts as
  soon as the bound allows, beside the straggling completions of the one before (`RolloutEngine.concurrent_batches`).

On a CPU the server prefills each prompt in one step (`vllm_server_process.vllm_on_cpu`), which also made every mode
about three times faster than with vLLM's default chunked prefill (sync: 379 tokens/s before, about 1,050 after).

The trainer waits for each push (``push_in_background: auto`` is off on a CPU); ``async_keep_background`` is
``async_keep`` with the push sent from a thread of its own while the trainer trains its next step (``always``).

Long tail: the untrained tiny model samples near-uniformly from its 512-token vocabulary, so making a seeded set of
``--stop-tokens`` of its tokens stop tokens (`SamplingConfig.stop_token_ids`) ends each completion after every token
with probability about stop_tokens/512: lengths are geometric, most completions short, and about
(1 - stop_tokens/512) ** max_new_tokens of them run to ``max_new_tokens`` (measured: ``completion_lengths``). A batch of
``prompts * generations`` completions then usually holds one such straggler that the others wait for.

Every figure is over the steps after ``--warmup``, from the first measured step's start to the last one's end:

- ``tokens_per_s``: completion tokens trained per second of the whole loop;
- ``trainer_idle_fraction``: the share of that time the trainer computes nothing (not in forward, backward or the
  optimizer step): waiting for a batch, or in its part of a weight push (the whole push in the foreground, which
  under ``pause: wait`` waits for the completions in flight; staging the weights in the background);
  ``trainer_idle_parts`` splits it into those two, the step's bookkeeping (advantages, packing, logging) and the
  time between steps (Lightning's loop, callbacks); ``push_s_mean`` is a push's own time, on whichever thread;
- ``engine_idle_fraction``: the share with no generate request of ours in flight at the server;
- ``cores_busy``: CPU seconds per second of that time, of the trainer's process and of the server's (its API process
  and engine core together), and their sum: on a machine of ``machine.cpus`` cores, a sum near that number means the
  loop is bound by the cores, and overlapping its parts can only share them out differently;
- ``max_staleness_trained`` and ``token_fraction_by_staleness``: a token's staleness is the batch's index (the
  trainer's weight version when it trains it) minus the version that sampled that token (`Rollout.versions`).

Every process runs single-threaded (the trainer through torch, the server through OMP_NUM_THREADS and an unbound
vLLM CPU thread mask), so that on a small machine the modes measure overlap, not thread oversubscription.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import random
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import lightning as L
import psutil  # a dependency of vLLM, which this benchmark runs
import torch
from transformers import AutoTokenizer

from lightning_rl.data.prompts import PromptDataModule
from lightning_rl.modules.grpo import GRPOModule
from lightning_rl.rewards import RewardSpec
from lightning_rl.rollout.vllm_server_process import VLLMServer
from lightning_rl.toy.model import build_tiny

# mode: (async_mode, the server's pause, push_in_background)
MODES = {"sync": (False, "wait", "auto"), "async": (True, "wait", "auto"), "async_keep": (True, "keep", "auto"),
         "async_keep_background": (True, "keep", "always")}
COMPARED = ("sync", "async", "async_keep")  # the ratios and the goal
ENGINE = "lightning_rl.rollout.vllm_server.VLLMServerEngine"
SINGLE_THREADED = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def cpu_seconds(process: psutil.Process, children: bool) -> float:
    """User and system CPU time of ``process`` (and its children: those that already ended not counted), so far."""
    total = 0.0
    for proc in (process, *(process.children(recursive=True) if children else ())):
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


class LoopClock(L.Callback):
    """Times each step, the trainer's pushes and the engine's generate calls (as intervals, to measure overlap), and
    at each step's start and end the CPU time of the trainer's process and the server's."""

    def __init__(self, server_pid: int) -> None:
        self.processes = {"trainer": psutil.Process(), "server": psutil.Process(server_pid)}
        self.cpu_at_starts: list[dict[str, float]] = []
        self.cpu_at_end: dict[str, float] = {}
        self.step_starts: list[float] = []
        self.step_ends: list[float] = []
        self.train_s: list[float] = []
        self.wait_s: list[float] = []
        self.push_s: list[float] = []  # the engine's push, on whichever thread
        self.trainer_push_s: list[float] = []  # the trainer's part: the whole push, or its staging in the background
        self.pushed_off_trainer: list[bool] = []  # whether each push ran on a thread other than the trainer's
        self.generating: list[tuple[float, float]] = []
        self.batches: list[Any] = []
        self._lock = threading.Lock()

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        engine = pl_module.engine  # built by now; wrapped before the module's own on_train_start uses it
        generate, push = engine.generate, engine.push_weights

        def timed_generate(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return generate(*args, **kwargs)
            finally:
                with self._lock:
                    self.generating.append((started, time.perf_counter()))

        def timed_push(*args: Any, **kwargs: Any) -> Any:
            self.pushed_off_trainer.append(threading.current_thread() is not threading.main_thread())
            started = time.perf_counter()
            try:
                return push(*args, **kwargs)
            finally:
                self.push_s.append(time.perf_counter() - started)

        engine.generate, engine.push_weights = timed_generate, timed_push
        module_push = pl_module._push_weights

        def timed_module_push(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return module_push(*args, **kwargs)
            finally:
                self.trainer_push_s.append(time.perf_counter() - started)

        pl_module._push_weights = timed_module_push

    def _cpu(self) -> dict[str, float]:
        # The server is a child of this process: the trainer's own time is its process's alone.
        return {name: cpu_seconds(process, children=name == "server") for name, process in self.processes.items()}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.cpu_at_starts.append(self._cpu())
        self.step_starts.append(time.perf_counter())

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.step_ends.append(time.perf_counter())
        self.cpu_at_end = self._cpu()
        self.train_s.append(float(trainer.callback_metrics["train/time/train_s"]))
        self.wait_s.append(float(trainer.callback_metrics["train/time/wait_for_rollouts_s"]))
        self.batches.append(pl_module.last_trained)


def busy_seconds(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """The length of the union of `intervals` clipped to [start, end]."""
    total, reach = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            total += b - a
            reach = b
    return total


def run(mode: str, server: VLLMServer, model: Path, stop_ids: tuple[int, ...], args: argparse.Namespace) -> dict[str, Any]:
    async_mode, pause, background = MODES[mode]
    L.seed_everything(0, verbose=False)
    module = GRPOModule(
        model_name_or_path=str(model),
        rewards=[RewardSpec("math_answer"), RewardSpec("format", weight=0.5, kwargs={"pattern": r"\s*\d"})],
        num_generations=args.generations, sampling={"max_new_tokens": args.max_new_tokens}, learning_rate=1e-3,
        async_mode=async_mode, max_staleness=args.max_staleness, push_in_background=background, log_rollouts_every_n_steps=0,
        engine={"class_path": ENGINE, "init_args": {"url": server.url, "pause": pause}},
    )
    module.sampling = dataclasses.replace(module.sampling, stop_token_ids=stop_ids)  # the long tail (module docstring)
    clock = LoopClock(server.pid)
    trainer = L.Trainer(
        max_steps=args.warmup + args.steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[clock],
    )
    trainer.fit(module, PromptDataModule(batch_size=args.prompts))
    measured = slice(args.warmup, None)
    start, end = clock.step_starts[measured][0], clock.step_ends[-1]
    wall = end - start
    pushes = clock.trainer_push_s[1:]  # the first push is on_train_start's, before any step
    compute = sum(t - p for t, p in zip(clock.train_s[measured], pushes[measured]))
    engine_pushes = clock.push_s[1:]
    in_steps = sum(b - a for a, b in zip(clock.step_starts[measured], clock.step_ends[measured]))
    staleness: Counter[int] = Counter()
    lengths = []
    for scored in clock.batches[measured]:
        for rollout in scored.rollouts:
            lengths.append(len(rollout.completion_ids))
            staleness.update(scored.index - v for v in rollout.versions)
    tokens = sum(staleness.values())
    cores = {name: (clock.cpu_at_end[name] - clock.cpu_at_starts[args.warmup][name]) / wall for name in clock.processes}
    return {
        "steps_measured": len(clock.batches[measured]),
        "wall_s": wall,
        "tokens_trained": tokens,
        "tokens_per_s": tokens / wall,
        "trainer_idle_fraction": 1 - compute / wall,
        "trainer_idle_parts": {  # of the whole loop's time: where the trainer's idle time goes
            "waiting_for_rollouts": sum(clock.wait_s[measured]) / wall,
            "pushing_weights": sum(pushes[measured]) / wall,
            # in the step, besides (advantages, packing, logging), and between steps (Lightning's loop, callbacks)
            "step_bookkeeping": (in_steps - sum(clock.wait_s[measured]) - sum(clock.train_s[measured])) / wall,
            "between_steps": 1 - in_steps / wall,
        },
        "push_s_mean": sum(engine_pushes[measured]) / max(len(engine_pushes[measured]), 1),
        "trainer_push_s_mean": sum(pushes[measured]) / max(len(pushes[measured]), 1),
        "push_in_background": all(clock.pushed_off_trainer[1:]),
        "engine_idle_fraction": 1 - busy_seconds(clock.generating, start, end) / wall,
        "cores_busy": {**cores, "sum": sum(cores.values())},
        "max_staleness_trained": max(staleness),
        "token_fraction_by_staleness": {str(k): staleness[k] / tokens for k in sorted(staleness)},
        "completion_lengths": {
            "mean": sum(lengths) / len(lengths), "max": max(lengths),
            "fraction_at_max_new_tokens": sum(n == args.max_new_tokens for n in lengths) / len(lengths),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="measured steps per mode")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out at the start of each mode")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--stop-tokens", type=int, default=16, help="of the 512-token vocabulary: the long tail's rate")
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                        help=f"the modes to run; the ratios and the goal need {', '.join(COMPARED)}")
    parser.add_argument("--machine-note", default=None, help="what the machine was doing, written as given")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="grpo-async-overlap-") as folder:
        model = build_tiny(Path(folder) / "tiny")
        tokenizer = AutoTokenizer.from_pretrained(model)
        ordinary = [t for t in range(len(tokenizer)) if t not in set(tokenizer.all_special_ids)]
        stop_ids = tuple(sorted(random.Random(0).sample(ordinary, args.stop_tokens)))
        server = VLLMServer(
            model, dtype="float32", max_model_len=512, kv_cache_memory_bytes=64 * 2**20, enforce_eager=True,
            env=SINGLE_THREADED,
        ).start()
        try:
            modes = {mode: run(mode, server, model, stop_ids, args) for mode in args.modes}
        finally:
            server.stop()
    result = {
        "benchmark": "grpo_async_overlap",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_average_1min": [load_before, os.getloadavg()[0]],
        },
        **({"machine_note": args.machine_note} if args.machine_note else {}),
        "engine": "vllm_server (CPU build), one server process; trainer and server single-threaded",
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "machine_note", "modes")},
        "stop_token_ids": list(stop_ids),
        **modes,
    }
    if set(COMPARED) <= set(modes):  # the ratios and the goal compare these three
        result["partial_over_sync_tokens_per_s"] = modes["async_keep"]["tokens_per_s"] / modes["sync"]["tokens_per_s"]
        result["async_over_sync_tokens_per_s"] = modes["async"]["tokens_per_s"] / modes["sync"]["tokens_per_s"]
        result["goal"] = "partial_over_sync_tokens_per_s >= 1.5 with async_keep trainer_idle_fraction < 0.10"
        keep = modes["async_keep"]
        result["goal_met"] = result["partial_over_sync_tokens_per_s"] >= 1.5 and keep["trainer_idle_fraction"] < 0.10
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
