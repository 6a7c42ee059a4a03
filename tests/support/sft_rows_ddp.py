"""One SFT step on two gloo ranks (Lightning DDP on CPU) with each batch cut into rows that share the toy data's system
prompt, forwarded once across them; each rank saves its gradients (before SFT's rescaling by the step's tokens) and
its rows.

Run by test_sft_rows.py as `python tests/support/sft_rows_ddp.py OUT_DIR` (tests/ on PYTHONPATH).
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from support.distributed import leave_worker
from support.paths import TOY_HELDOUT, TOY_TRAIN

from lightning_rl.data.sft import BatchRows, SFTDataModule
from lightning_rl.modules.sft import SFTModule


class Recorder(L.Callback):
    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}
        self.rows: list[int] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.rows.append(len(batch.rows) if isinstance(batch, BatchRows) else 1)

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        self.grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def main(out: Path) -> None:
    L.seed_everything(0, verbose=False)
    recorder = Recorder()
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[recorder])  # fmt: skip
    data = SFTDataModule(TOY_TRAIN, TOY_HELDOUT, max_tokens=256, max_tokens_per_row=80, prefix_across_rows="always", shuffle=False)
    trainer.fit(SFTModule(learning_rate=1e-2), data)
    torch.save({"grads": recorder.grads, "rows": recorder.rows, "loss": float(trainer.callback_metrics["train/loss"])},
               out / f"rank{trainer.global_rank}.pt")
    leave_worker()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
