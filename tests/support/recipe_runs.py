"""`lightning-rl run` of a recipe (the tiny Muse Spark LoRA one mostly) on two FSDP2 processes, as the tests start it.

Also: its exported weights, the same run stopped by SIGTERM and resumed beside an uninterrupted one (its checkpoints
read by the safe readers), and a run with the sharded loader's check (support/sharded_load_check.py)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from lightning_rl.checkpoints import checkpoint_step
from lightning_rl.rollout.vllm_server_process import free_port

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]


def run_on_two(recipe: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """Run ``recipe`` on two processes into ``out`` (a free port of its own); tests/ is importable for test callbacks
    and rewards."""
    cmd = [str(Path(sys.executable).parent / "lightning-rl"), "run", recipe, "--trainer.devices=2", f"--output_dir={out}", *extra]
    env = {**os.environ, "MASTER_PORT": str(free_port()), "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)


def failure(done: subprocess.CompletedProcess) -> str:
    """What a failed two-process run said: each rank's first traceback (one rank's death shows on the other as a
    lost connection, after its own), and the end of its stderr."""
    err = done.stderr
    starts = [match.start() for match in re.finditer("Traceback", err)][:2]
    return "\n...\n".join([*(err[i : i + 2500] for i in starts), err[-2500:]])


def run_tiny_muse(base: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """Run recipes/tiny/muse_lora_sft.yaml on ``base`` into ``out``."""
    return run_on_two("recipes/tiny/muse_lora_sft.yaml", out, f"--model.model_name_or_path={base}", *extra)


def exported(out: Path) -> dict[str, torch.Tensor]:
    """The final Hugging Face export of a run into ``out``."""
    return load_file(out / "hf" / "model.safetensors")


def stopped_and_resumed(base: Path, root: Path, stop_after: int, *extra: str) -> tuple[Path, Path]:
    """An uninterrupted run, and one sent SIGTERM after step ``stop_after`` then resumed with ``--ckpt_path=last``.

    Returns their output folders (``root/reference``, ``root/killed``). The stopped run must exit 143 without an
    export, and the resumed one must restore its checkpoint.
    """
    reference, killed_dir = root / "reference", root / "killed"
    done = run_tiny_muse(base, reference, *extra)
    assert done.returncode == 0, failure(done)
    sigterm = ("--trainer.callbacks+=test_sft_resume.SigtermAtStep", f"--trainer.callbacks.step={stop_after}")
    killed = run_tiny_muse(base, killed_dir, *extra, *sigterm)
    assert killed.returncode == 143, failure(killed)
    assert not (killed_dir / "hf").exists()
    resumed = run_tiny_muse(base, killed_dir, *extra, "--ckpt_path=last")
    assert resumed.returncode == 0, failure(resumed)
    assert "Restored all states from the checkpoint" in resumed.stdout + resumed.stderr
    # Every checkpoint the runs wrote (sharded ones too) passes the safe readers: no pickle beyond weights_only.
    written = sorted(killed_dir.rglob("*.ckpt"))
    assert written and all(checkpoint_step(path) >= 0 for path in written)
    return reference, killed_dir


def run_with_check(base: Path, out: Path, *extra: str) -> dict:
    """One step with the check that every rank loaded exactly its shards; its findings."""
    check = ("--trainer.callbacks+=support.sharded_load_check.CompareWithFullLoad", f"--trainer.callbacks.out={out / 'check'}")
    done = run_tiny_muse(base, out / "run", "--trainer.max_steps=1", *check, *extra)
    assert done.returncode == 0, failure(done)
    return {
        "diff": json.loads((out / "check" / "load-diff.json").read_text()),
        "ranks": [json.loads((out / "check" / f"load-rank-{r}.json").read_text()) for r in (0, 1)],
    }


def checkpoint_elements(folder: Path) -> int:
    """How many numbers a from_pretrained folder's weights hold."""
    return sum(t.numel() for t in load_file(folder / "model.safetensors").values())
