"""Tests of the vLLM engines against the real CPU build; they run in `.venv-vllm` (`make test-vllm`).

vLLM cannot share an environment with the main test suite (it pins an older transformers), so in an
environment without it this folder is not collected at all rather than reported as skipped.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# Not named tests/vllm: with tests/ on sys.path such a folder passes for the vllm package itself.
if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny Qwen3 (head_dim 64) and its tokenizer, saved for `from_pretrained`."""
    from lightning_rl.toy.model import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny-qwen3"))


def process_group_exists(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="session")
def server_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """An engine that starts its own `vllm serve` process (shared by the server tests) and stops it, by PID, on close.

    Tests that connect their own client to it run after the ones using this client: a new client takes
    over the server's transfer group.
    """
    from engine_checks import KV_CACHE_BYTES

    from lightning_rl.rollout.vllm_server import VLLMServerEngine

    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    engine = VLLMServerEngine(tiny_model_dir, server_options={
        "dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": KV_CACHE_BYTES, "enforce_eager": True,
        "log_path": log,
    })
    assert engine.url.startswith("http://127.0.0.1:")
    pid = engine.server.pid
    yield engine
    engine.close()
    assert not process_group_exists(pid)  # the server and its engine processes
