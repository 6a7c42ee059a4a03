"""`launch/torchrun.sh`, the launch for clusters without SLURM, run for real: two processes on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from lightning_rl.rollout.vllm_server_process import free_port

SCRIPT = "launch/torchrun.sh"
RECIPE = "recipes/tiny/muse_lora_sft.yaml"


def _env(**values: str) -> dict[str, str]:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **values}


def test_two_processes_train_one_run(tmp_path: Path, tiny_muse_path: Path) -> None:
    env = _env(NNODES="1", NODE_RANK="0", GPUS_PER_NODE="2", MASTER_PORT=str(free_port()), LOG_DIR=str(tmp_path / "logs"))
    args = [f"--output_dir={tmp_path / 'out'}", f"--model.model_name_or_path={tiny_muse_path}", "--trainer.max_steps=2"]
    done = subprocess.run(["bash", SCRIPT, RECIPE, *args], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["world_size"] == 2
    rank_logs = sorted(p.parent.name for p in (tmp_path / "logs").rglob("stderr.log"))
    assert rank_logs == ["0", "1"], "one log folder per rank"


def test_bad_node_rank_and_missing_recipe_are_refused(tmp_path: Path) -> None:
    done = subprocess.run(["bash", SCRIPT, RECIPE], env=_env(NNODES="2", NODE_RANK="2", GPUS_PER_NODE="1"), capture_output=True, text=True)
    assert done.returncode == 2 and "NODE_RANK=2 must be below NNODES=2" in done.stderr
    done = subprocess.run(["bash", SCRIPT], env=_env(), capture_output=True, text=True)
    assert done.returncode == 2 and "usage:" in done.stderr
    # No nvidia-smi here (a CPU, ROCm or Neuron node): the script's own line, not a silent exit 127 under pipefail.
    env = {key: value for key, value in _env().items() if key != "GPUS_PER_NODE"}
    done = subprocess.run(["bash", SCRIPT, RECIPE], env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "no GPUs found; set GPUS_PER_NODE" in done.stderr, (done.returncode, done.stderr)
    done = subprocess.run(["bash", SCRIPT, RECIPE], env=_env(NNODES="2", NODE_RANK="1", GPUS_PER_NODE="1"), capture_output=True, text=True)
    assert done.returncode == 2 and "NNODES=2 needs MASTER_ADDR" in done.stderr
