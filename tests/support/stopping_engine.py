"""The vLLM server engine, and a stop signal sent from inside it while the server samples: for a test that needs a
SIGTERM to find a batch half sampled, whose timing the tiny model's fast sampling leaves no room to aim from outside."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from typing import Any

from lightning_rl.rollout.vllm_server import VLLMServerEngine


def sampled_tokens(url: str) -> float:
    """The tokens the server at ``url`` has sampled so far (its Prometheus counter)."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:generation_tokens_total"))


class StopsMidGeneration(VLLMServerEngine):
    """At its $STOP_AT_CALL-th `generate` call, SIGTERM to this run's process group once the server has sampled 20 of
    the call's tokens."""

    calls = 0

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        type(self).calls += 1
        if str(self.calls) == os.environ.get("STOP_AT_CALL"):
            threading.Thread(target=self._stop_once_sampling, args=(sampled_tokens(self.url),), daemon=True).start()
        return super().generate(*args, **kwargs)

    def _stop_once_sampling(self, before: float) -> None:
        while sampled_tokens(self.url) < before + 20:
            time.sleep(0.005)
        os.killpg(os.getpgid(0), signal.SIGTERM)
