"""`lightning-rl run` of the tiny Muse Spark LoRA recipe on two FSDP2 processes, as the tests start it."""

import os
import subprocess
import sys
from pathlib import Path

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
