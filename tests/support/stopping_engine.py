"""Engines that send a stop signal from inside while they sample: for a test that needs a SIGTERM to find a batch half
sampled, whose timing the tiny model's fast sampling leaves no room to aim from outside. The vLLM server engine, and
the transformers engine."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from typing import Any

from lightning_rl.rollout.hf import HFRolloutEngine
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


class HFStopsMidGeneration(HFRolloutEngine):
    """At its $STOP_AT_CALL-th `generate` call, SIGTERM to this run's process group after the model's 10th forward
    (its prompt's and nine sampling steps); each later step of that call then takes 50 ms, so that the save cuts it
    on its way rather than after its last token."""

    calls = 0

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        type(self).calls += 1
        if str(self.calls) != os.environ.get("STOP_AT_CALL"):
            return super().generate(*args, **kwargs)
        forwards = []

        def forward(*_: Any) -> None:
            forwards.append(1)
            if len(forwards) == 10:
                os.killpg(os.getpgid(0), signal.SIGTERM)
            elif len(forwards) > 10:
                time.sleep(0.05)

        hook = self.model.register_forward_hook(forward)
        try:
            return super().generate(*args, **kwargs)
        finally:
            hook.remove()
