"""The GRPO layout test needs vLLM, which lives in `.venv-vllm` (`make test-vllm`); elsewhere it is not collected."""

import importlib.util

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
