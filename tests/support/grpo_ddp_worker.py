"""One GRPO step on two gloo ranks (Lightning DDP on CPU, with its static graph under ``"strategy": "ddp_static"``, or
FSDP2 with ``"strategy": "fsdp2"``); each rank saves its
rollouts and gradients.

Run by test_grpo_ranks.py as `python tests/support/grpo_ddp_worker.py OUT_DIR OPTIONS_JSON` (tests/ on PYTHONPATH).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import lightning as L
import torch
from support.grpo import FAST, LENGTH_REWARD, GradientRecorder
from support.distributed import leave_worker

from lightning_rl.callbacks import RunSummary
from lightning_rl.data.prompts import PromptDataModule
from lightning_rl.modules.grpo import GRPOModule
from lightning_rl.strategies import FSDP2Strategy
from lightning.pytorch.strategies import DDPStrategy


def main(out: Path, options: str) -> None:
    L.seed_everything(0, verbose=False)
    settings = json.loads(options)
    strategy = {"fsdp2": FSDP2Strategy(), "ddp": "ddp", "ddp_static": DDPStrategy(static_graph=True)}[settings.pop("strategy", "ddp")]
    module = GRPOModule(**{**FAST, "rewards": LENGTH_REWARD, "max_grad_norm": None, **settings})
    recorder, summary = GradientRecorder(), RunSummary(out, task="grpo")
    trainer = L.Trainer(
        max_steps=1, accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder, summary], use_distributed_sampler=False,
    )
    trainer.fit(module, PromptDataModule(batch_size=2))
    scored = module.last_trained
    torch.save(
        {
            "grads": recorder.steps[0],
            "rollouts": [asdict(r) for r in scored.rollouts],
            "rewards": scored.rewards,
            "reward_terms": scored.reward_terms,
            "prompts": [r["prompt"] for r in scored.records],
            "logged": {key: float(value) for key, value in trainer.logged_metrics.items()},
            "summary_losses": summary.losses,
        },
        out / f"rank{trainer.global_rank}.pt",
    )
    leave_worker()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
