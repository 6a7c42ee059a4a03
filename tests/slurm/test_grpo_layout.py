"""The GRPO launch on a real two-node SLURM cluster: vLLM serves on the second node, the first trains.

The rendered script starts the engine's own server command on node n2, waits for it to be healthy,
then trains on n1, pushing the new weights to the server after every step.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from lightning_rl.launch import slurm
from lightning_rl.toy.model import build_tiny
from slurm.cluster import PARTITION, LocalSlurmCluster, slurm_installed

STEPS = 2


def grpo_recipe(path: Path, model_dir: Path, output_dir: Path) -> Path:
    recipe = {
        "task": "grpo",
        "output_dir": str(output_dir),
        "logger": {"kind": "csv"},
        "model": {
            "model_name_or_path": str(model_dir),
            "num_generations": 4,
            "sampling": {"max_new_tokens": 12},
            "learning_rate": 1.0e-3,
            "engine": {
                "class_path": "VLLMServerEngine",
                "init_args": {
                    "server_options": {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 64 * 2**20, "enforce_eager": True}
                },
            },
        },
        "data": {"path": "toy", "batch_size": 2},
        "trainer": {"accelerator": "cpu", "devices": "auto", "max_steps": STEPS},
    }
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_trainer_node_pushes_weights_to_the_server_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert slurm_installed(), "SLURM is not installed: `make slurm` installs slurmctld, slurmd and the client"
    recipe = grpo_recipe(tmp_path / "grpo.yaml", build_tiny(tmp_path / "model"), tmp_path / "out")
    cluster = LocalSlurmCluster(tmp_path / "cluster")
    try:
        cluster.start()
        monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
        monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
        code = slurm.main([
            "slurm", str(recipe), "--nodes", "2", "--inference-nodes", "1", "--gpus-per-node", "1",
            "--partition", PARTITION, "--log-dir", str(tmp_path / "logs"), "--script", str(tmp_path / "job.sbatch"),
        ])  # fmt: skip
        assert code == 0
        (job_id,) = cluster.run("squeue", "-h", "-o", "%i").stdout.split()
        state = cluster.wait_for(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=600)
    finally:
        cluster.stop()
    logs = tmp_path / "logs" / f"lrl-grpo-{job_id}"
    server_log = (logs / "vllm-server.log").read_text()
    assert state == "COMPLETED", (logs / "rank-0.log").read_text()[-3000:] + server_log[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["task"] == "grpo" and summary["steps"] == STEPS
    assert "POST /inference/v1/generate" in server_log
    assert server_log.count("POST /update_weights") >= STEPS, "the trainer did not push every step's weights"
