"""Tests of the vLLM engines against the real CPU build; they run in `.venv-vllm` (`make test-vllm`).

vLLM cannot share an environment with the main test suite (it pins an older transformers), so in an
environment without it this folder is not collected at all rather than reported as skipped.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# Not named tests/vllm: with tests/ on sys.path such a folder passes for the vllm package itself.
if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny Qwen3 (head_dim 64) and its tokenizer, saved for `from_pretrained`."""
    from lightning_rl.models.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny-qwen3"))
