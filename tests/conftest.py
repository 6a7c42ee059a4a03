"""Shared test setup: an isolated cache for the embedded tiny model, W&B offline, quiet progress bars."""

import os
import tempfile
from pathlib import Path

import pytest


# Set before anything imports lightning_rl, so subprocesses started by tests share the same build.
os.environ.setdefault("LIGHTNING_RL_CACHE", tempfile.mkdtemp(prefix="lightning-rl-test-cache-"))
os.environ["WANDB_MODE"] = "offline"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    """Folder of the embedded tiny model and tokenizer (built once per pytest run)."""
    from lightning_rl.toy.model import tiny_model_path

    return tiny_model_path()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)


@pytest.fixture(scope="session")
def tiny_muse_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of a tiny Muse Spark Open (the classes of the 816B model at toy size), built once per pytest run."""
    from slurm.tiny_muse import build_tiny_muse

    return build_tiny_muse(tmp_path_factory.mktemp("tiny-muse") / "model")
