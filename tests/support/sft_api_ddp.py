"""SFT through the Python API on two gloo ranks, with Lightning's defaults (its distributed sampler on); rank 0 writes
the steps and the last loss to OUT_DIR/result.json.

Run by test_sft_module.py as `python tests/support/sft_api_ddp.py OUT_DIR` (tests/ on PYTHONPATH).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
from support.distributed import leave_worker
from support.paths import TOY_HELDOUT, TOY_TRAIN

from lightning_rl.data.sft import SFTDataModule
from lightning_rl.modules.sft import SFTModule


def main(out: Path) -> None:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    trainer.fit(SFTModule(learning_rate=1e-3), SFTDataModule(TOY_TRAIN, TOY_HELDOUT, max_tokens=256))
    if trainer.is_global_zero:
        (out / "result.json").write_text(json.dumps({"steps": trainer.global_step, "loss": float(trainer.callback_metrics["train/loss"])}))
    leave_worker()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
