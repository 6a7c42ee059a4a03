"""A callback for `lightning-rl run` under FSDP2: after setup, compare the sharded-loaded model with from_pretrained.

Each rank writes what it read (``load-rank-N.json``); rank 0 also writes every tensor that differs from a plain
``from_pretrained`` of the same folder (``load-diff.json``). Used by tests/test_sharded_loading.py.
"""

import json
from dataclasses import asdict
from pathlib import Path

import torch
from lightning.pytorch import Callback

from lightning_rl.models.loading import load_causal_lm
from lightning_rl.models.weights import iter_full_weights, policy_model


class CompareWithFullLoad(Callback):
    def __init__(self, out: str) -> None:
        self.out = Path(out)

    def on_fit_start(self, trainer, pl_module) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        reports = [asdict(r) for r in trainer.strategy.load_reports]
        (self.out / f"load-rank-{trainer.global_rank}.json").write_text(json.dumps(reports))
        # LoRA B starts at zero, so the merged stream is the base weights as loaded.
        gathered = {name: t.detach().cpu().clone() for name, t in iter_full_weights(pl_module.model, merge_lora=True)}
        model = policy_model(pl_module.model)
        buffers = {name: b.detach().cpu().clone() for name, b in model.named_buffers()}
        lora = {name: p.full_tensor().detach().cpu() for name, p in pl_module.model.named_parameters() if "lora_A" in name}
        if trainer.global_rank != 0:
            return
        reference = load_causal_lm(pl_module.hparams.model_name_or_path)
        want = dict(reference.state_dict())
        want_buffers = dict(reference.named_buffers())
        diff = [name for name, t in gathered.items() if name not in want or not torch.equal(t, want[name])]
        diff += [f"buffer {name}" for name, b in buffers.items() if not torch.equal(b, want_buffers[name])]
        tied = set(reference.all_tied_weights_keys)  # sent once, under the name of the tensor they share
        missing = sorted(set(want) - set(gathered) - tied)
        lora_zero = [name for name, t in lora.items() if not t.abs().sum() > 0]
        result = {"compared": len(gathered), "differ": diff, "missing": missing, "lora_A": len(lora), "lora_A_zero": lora_zero}
        (self.out / "load-diff.json").write_text(json.dumps(result))
