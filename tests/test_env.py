"""`lightning-rl env`: versions, devices, and which strategies can run, for this machine and described ones.

This machine is real: a CPU one in CI, or a CUDA GPU machine when the suite runs there (the report must then
name its GPU). ROCm and Neuron machines, and a multi-GPU CUDA one, are described through DeviceInventory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lightning_rl import env_report
from lightning_rl.cli import main as cli_main
from support.machines import CPU, CUDA, NEURON, NEURONX, ROCM, WITHOUT_THEM
from support.paths import REPO

GPU = torch.cuda.is_available()

def usable(report: dict) -> dict[str, bool]:
    return {s["name"]: s["usable"] for s in report["strategies"]}


def env_command(argv: list[str]) -> int:
    """`lightning-rl env` through the CLI."""
    return cli_main(["env", *argv])


def test_env_command_reports_this_machine(capsys: pytest.CaptureFixture[str]) -> None:
    assert env_command([]) == 0
    text = capsys.readouterr().out
    assert f"torch         {torch.__version__}" in text
    for line in ("rocm          absent", "neuron        absent", "xla           absent"):
        assert line in text
    assert "no   neuron      no Neuron runtime" in text
    if GPU:
        count, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
        assert f"cuda          {count} x {name}" in text
        assert f"yes  fsdp2       {count} CUDA GPU(s) over NCCL" in text
        assert f"yes  fsdp        {count} GPU(s)" in text
    else:
        assert "cuda          absent" in text
        assert "yes  fsdp2       CPU" in text and "over gloo" in text
        assert "no   fsdp        FSDP1 runs on CUDA/ROCm GPUs only" in text


def test_env_runs_without_jsonargparse_jsonschema_and_wandb(tmp_path) -> None:
    """As on the GPU machine, which lacks them: `run` needs jsonargparse, `env` must not."""
    (tmp_path / "sitecustomize.py").write_text(WITHOUT_THEM)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "lightning_rl.cli", "env"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"torch         {torch.__version__}" in done.stdout
    hidden = subprocess.run([sys.executable, "-c", "import jsonargparse"], env=env, capture_output=True, text=True, timeout=300)
    assert hidden.returncode != 0 and "ModuleNotFoundError" in hidden.stderr  # the finder did hide it


def test_env_json_is_machine_readable(capsys: pytest.CaptureFixture[str]) -> None:
    assert env_report.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["packages"]["lightning"] != env_report.ABSENT
    assert report["optional"]["torch-xla"] == env_report.ABSENT
    assert usable(report) == {
        "fsdp2": True, "fsdp2_rocm": False, "fsdp": GPU, "xla_static": False, "neuron": False, "cpu_static": True,
    }
    if GPU:
        assert torch.cuda.get_device_name(0) in report["devices"]["cuda"]
    else:
        assert report["devices"]["cuda"].startswith(env_report.ABSENT)


def test_described_machines() -> None:
    cuda = env_report.collect(CUDA)
    assert cuda["devices"]["cuda"] == "8 x NVIDIA H100 80GB HBM3 (CUDA 12.8)"
    assert usable(cuda)["fsdp"] and not usable(cuda)["fsdp2_rocm"]
    assert "CUDA 12.8 build" in next(s["reason"] for s in cuda["strategies"] if s["name"] == "fsdp2_rocm")

    rocm = env_report.collect(ROCM)
    assert rocm["devices"]["rocm"] == "HIP 6.4.1, 8 AMD GPU(s): AMD Instinct MI300X"
    assert rocm["devices"]["cuda"] == env_report.ABSENT
    assert usable(rocm)["fsdp2_rocm"]
    assert "8 AMD GPU(s) over RCCL" in env_report.render(rocm)
    assert "HIP_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in env_report.render(rocm)

    neuron = env_report.collect(NEURON)
    assert neuron["devices"]["neuron"] == "native 'neuron' device x 32"
    assert usable(neuron)["neuron"] and not usable(neuron)["xla_static"]

    neuronx = env_report.collect(NEURONX)
    assert neuronx["devices"]["neuron"] == "torch-neuronx (as XLA devices)"
    assert usable(neuronx)["xla_static"] and not usable(neuronx)["neuron"]
    assert "use 'xla_static'" in next(s["reason"] for s in neuronx["strategies"] if s["name"] == "neuron")

    cpu = env_report.collect(CPU)
    assert all(v == env_report.ABSENT for k, v in cpu["devices"].items() if k in ("cuda", "rocm", "neuron", "xla"))


def test_env_warns_when_the_load_exceeds_the_cores(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_rl.env_report import threads_and_load

    quiet, loaded = threads_and_load(load=0.5, cores=2), threads_and_load(load=3.5, cores=2)
    assert "warning" not in quiet and quiet["intra_op_threads"] == torch.get_num_threads()
    assert "load 3.5 exceeds the 2 usable cores" in loaded["warning"] and "OMP_NUM_THREADS=1" in loaded["warning"]
    assert env_command([]) == 0
    assert f"{torch.get_num_threads()} intra-op (OMP_NUM_THREADS=" in capsys.readouterr().out
