"""The tiny Muse Spark Open recipe: LoRA SFT with FSDP2 on two CPU processes, exported merged."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent / "slurm"))
from tiny_muse import build_tiny_muse  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def test_muse_lora_sft_on_two_fsdp2_processes(tmp_path):
    base = build_tiny_muse(tmp_path / "tiny-muse")
    out = tmp_path / "run"
    cmd = [
        str(Path(sys.executable).parent / "lightning-rl"), "run", "recipes/tiny/muse_lora_sft.yaml",
        "--trainer.devices=2", "--trainer.max_steps=3", f"--model.model_name_or_path={base}", f"--output_dir={out}",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "MASTER_PORT": "29731"})
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3

    # Gathered from the shards and merged: only the LoRA-targeted projections moved, and they did.
    before, after = load_file(base / "model.safetensors"), load_file(out / "hf" / "model.safetensors")
    assert set(after) <= set(before)
    moved = {name for name in after if not torch.equal(after[name], before[name])}
    assert moved and all(any(t in name for t in TARGETS) for name in moved), sorted(moved)[:5]
