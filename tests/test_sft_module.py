"""SFTModule under a real Trainer: LoRA trains only the adapter and exports folders that from_pretrained
loads with the same outputs; accumulation and bf16 precision come from Lightning; summary figures."""

import json

import pytest
import torch
from lightning.pytorch import Trainer
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from toy_paths import TOY_HELDOUT, TOY_TRAIN
from lightning_rl.callbacks import ExportHuggingFace, RunSummary
from lightning_rl.data.sft import SFTDataModule
from lightning_rl.models.loading import LoraSettings
from lightning_rl.modules.sft import SFTModule


def fit(tmp_path, module, **trainer_kwargs):
    data = SFTDataModule(TOY_TRAIN, TOY_HELDOUT, max_tokens=256)
    trainer = Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[RunSummary(tmp_path, task="sft"), ExportHuggingFace(tmp_path)],
        **trainer_kwargs,
    )
    trainer.fit(module, datamodule=data)
    return trainer, json.loads((tmp_path / "summary.json").read_text())


def logits(model, ids):
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("export", ["adapter", "merged"])
def test_lora_trains_only_the_adapter_and_exports_a_loadable_folder(tmp_path, tiny_path, export):
    lora = LoraSettings(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    module = SFTModule(learning_rate=1e-2, lora=lora, export=export)
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    _, summary = fit(tmp_path, module, max_steps=3)
    assert summary["steps"] == 3
    if export == "adapter":
        changed = {n for n, p in module.model.named_parameters() if not torch.equal(p, before[n])}
        assert changed and all("lora_" in n for n in changed)
    else:  # merged: only the adapted projections differ from the base weights
        initial, merged = load_file(tiny_path / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
        assert initial.keys() == merged.keys()
        changed = {n for n in initial if not torch.equal(initial[n], merged[n])}
        assert changed and all(any(t in n for t in lora.target_modules) for n in changed)

    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    base = AutoModelForCausalLM.from_pretrained(tiny_path)
    if export == "adapter":
        assert (tmp_path / "hf" / "adapter_config.json").exists()
        loaded = PeftModel.from_pretrained(base, tmp_path / "hf")
    else:
        assert not (tmp_path / "hf" / "adapter_config.json").exists()
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    torch.testing.assert_close(logits(loaded.eval(), ids), logits(module.model.eval(), ids), atol=1e-5, rtol=1e-5)
    untouched = AutoModelForCausalLM.from_pretrained(tiny_path).eval()  # peft adapted `base` in place
    assert not torch.allclose(logits(loaded, ids), logits(untouched, ids), atol=1e-4)
    assert (tmp_path / "hf" / "tokenizer.json").exists()


def test_accumulation_and_bf16_precision_from_lightning(tmp_path):
    module = SFTModule(learning_rate=1e-3, eval_generations=8, max_new_tokens=8)
    trainer, summary = fit(tmp_path, module, max_steps=2, accumulate_grad_batches=2, precision="bf16-true", gradient_clip_val=1.0)
    assert summary["steps"] == 2 and summary["micro_batches"] == 4
    assert next(module.model.parameters()).dtype == torch.bfloat16
    assert all(k in trainer.callback_metrics for k in ("train/grad_norm", "train/lr", "train/packing_ratio", "train/tokens_per_s"))
    assert summary["packing"] == "tree" and summary["flat_tokens"] > summary["tokens"] > 0
    assert summary["heldout_examples"] == 8 and 0.0 <= summary["heldout_exact_match"] <= 1.0
    assert summary["peak_memory_mb"] > 0 and summary["tokens_per_s"] > 0
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").dtype == torch.bfloat16
