"""`lightning-rl run` of the tiny Muse Spark LoRA recipe on two FSDP2 processes, as the tests start it.

Also: its exported weights, and the same run stopped by SIGTERM and resumed beside an uninterrupted one."""

import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def run_tiny_muse(base: Path, out: Path, port: int, *extra: str) -> subprocess.CompletedProcess:
    """Run recipes/tiny/muse_lora_sft.yaml on ``base`` into ``out``; tests/ is importable for test callbacks."""
    cmd = [
        str(Path(sys.executable).parent / "lightning-rl"), "run", "recipes/tiny/muse_lora_sft.yaml",
        "--trainer.devices=2", f"--model.model_name_or_path={base}", f"--output_dir={out}", *extra,
    ]  # fmt: skip
    env = {**os.environ, "MASTER_PORT": str(port), "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)


def exported(out: Path) -> dict[str, torch.Tensor]:
    """The final Hugging Face export of a run into ``out``."""
    return load_file(out / "hf" / "model.safetensors")


def stopped_and_resumed(base: Path, root: Path, ports: tuple[int, int, int], stop_after: int, *extra: str) -> tuple[Path, Path]:
    """An uninterrupted run, and one sent SIGTERM after step ``stop_after`` then resumed with ``--ckpt_path=last``.

    Returns their output folders (``root/reference``, ``root/killed``). The stopped run must exit 143 without an
    export, and the resumed one must restore its checkpoint.
    """
    reference, killed_dir = root / "reference", root / "killed"
    done = run_tiny_muse(base, reference, ports[0], *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    sigterm = ("--trainer.callbacks+=test_sft_resume.SigtermAtStep", f"--trainer.callbacks.step={stop_after}")
    killed = run_tiny_muse(base, killed_dir, ports[1], *extra, *sigterm)
    assert killed.returncode == 143, killed.stderr[-3000:]
    assert not (killed_dir / "hf").exists()
    resumed = run_tiny_muse(base, killed_dir, ports[2], *extra, "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Restored all states from the checkpoint" in resumed.stdout + resumed.stderr
    return reference, killed_dir
