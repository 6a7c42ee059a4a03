"""What GRPO's options cost per optimizer step on the embedded default (recipes/tiny/grpo.yaml's model and prompts).

Each configuration trains ``--steps`` steps in one process (a real Trainer, the transformers engine); the figure is
the median of the ``train/time/train_s`` (the packed forward, backward and optimizer step) and of the whole step's
wall time over the steps after the first. The defaults log every metric there is, so their row is also the cost of
the metrics: they are sums over the step's rollouts, with no extra forward.
Run: python benchmarks/grpo_step_cost.py [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import lightning as L
import torch

from lightning_rl.data.prompts import PromptDataModule
from lightning_rl.modules.grpo import GRPOModule
from lightning_rl.rewards import RewardSpec

RESULTS = Path(__file__).resolve().parent / "results" / "grpo_step_cost.json"
REWARDS = [RewardSpec("math_answer"), RewardSpec("format", weight=0.5, kwargs={"pattern": r"\s*\d"})]
CONFIGS = {
    "defaults (every metric logged)": {},
    "loss.top_entropy_quantile=0.5": {"loss": {"top_entropy_quantile": 0.5}},
    "loss.entropy_coef=0.01": {"loss": {"entropy_coef": 0.01}},
    "loss.adaptive_entropy": {"loss": {"adaptive_entropy": True}},
    "loss.beta=0.05 (a reference model)": {"loss": {"beta": 0.05}},
    "num_iterations=2": {"num_iterations": 2},
    "dynamic_sampling": {"dynamic_sampling": True},
}


class StepTimes(L.Callback):
    def __init__(self) -> None:
        self.train, self.wall, self._started = [], [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.wall.append(time.perf_counter() - self._started)
        self.train.append(float(trainer.callback_metrics["train/time/train_s"]))


def measure(options: dict, steps: int) -> dict[str, float]:
    L.seed_everything(0, verbose=False)
    module = GRPOModule(num_generations=8, sampling={"max_new_tokens": 4}, learning_rate=2e-3, rewards=REWARDS, log_rollouts_every_n_steps=0, **options)
    times = StepTimes()
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[times])  # fmt: skip
    trainer.fit(module, PromptDataModule(batch_size=4))
    return {"train_s": statistics.median(times.train[1:]), "step_s": statistics.median(times.wall[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    rows = {name: measure(options, args.steps) for name, options in CONFIGS.items()}
    base = rows["defaults (every metric logged)"]
    for row in rows.values():
        row["train_vs_defaults"] = round(row["train_s"] / base["train_s"], 2)
    result = {"steps": args.steps, "configs": rows,
              "machine": {"threads": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__}}  # fmt: skip
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    for name, row in rows.items():
        print(f"{name:40s} train {row['train_s'] * 1e3:7.1f} ms ({row['train_vs_defaults']:.2f}x)  step {row['step_s'] * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
