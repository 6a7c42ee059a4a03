"""The tiny Muse Spark Open recipe: LoRA SFT with FSDP2 on two CPU processes, exported merged, resumed exactly."""

import json

import torch
from safetensors.torch import load_file

from lightning_rl.models.loading import LoraSettings, load_causal_lm
from support.recipe_runs import exported, run_tiny_muse, stopped_and_resumed

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def test_lora_adapts_the_text_model_only(tiny_muse_path):
    # The towers never see a gradient in text SFT: adapters there would be dead weight with no optimizer state.
    model = load_causal_lm(str(tiny_muse_path), lora=LoraSettings(target_modules=list(TARGETS)))
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".language_model." in name and "lora_" in name for name in trainable), trainable[:5]
    assert any("vision_tower" in name and name.endswith("q_proj.weight") for name, _ in model.named_parameters())


def test_full_fine_tuning_trains_the_text_model_only(tiny_muse_path):
    model = load_causal_lm(str(tiny_muse_path))
    # Text SFT never reaches the towers; frozen, they get no optimizer state a checkpoint would lack.
    frozen = {name.split(".")[1] for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"audio_tower", "vision_adapter", "vision_projection", "vision_tower"}, frozen
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert all(name.startswith(("model.language_model.", "lm_head.")) for name in trainable)
    assert any(".language_model.layers.0.mlp.experts." in name for name in trainable)


def test_muse_lora_sft_on_two_fsdp2_processes(tiny_muse_path, tmp_path):
    out = tmp_path / "run"
    done = run_tiny_muse(tiny_muse_path, out, "--trainer.max_steps=3")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3

    # Gathered from the shards and merged: only the LoRA-targeted projections moved, and they did.
    before, after = load_file(tiny_muse_path / "model.safetensors"), exported(out)
    assert set(after) <= set(before)
    moved = {name for name in after if not torch.equal(after[name], before[name])}
    assert moved and all(any(t in name for t in TARGETS) for name in moved), sorted(moved)[:5]


def test_fsdp2_lora_resume_matches_uninterrupted_run(tiny_muse_path, tmp_path):
    """SIGTERM after step 5 of 8 on both ranks, resume from the sharded checkpoint saved on it: bit-identical weights."""
    steps = ("--trainer.max_steps=8", "--checkpoint_every_n_steps=4")
    reference, killed_dir = stopped_and_resumed(tiny_muse_path, tmp_path, 5, *steps)
    assert json.loads((killed_dir / "summary.json").read_text())["micro_batches"] == 8  # the whole run, across the resume

    want, got = exported(reference), exported(killed_dir)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=0, rtol=0, msg=name)
    initial = load_file(tiny_muse_path / "model.safetensors")
    assert any(not torch.equal(initial[name], got[name]) for name in initial)
