"""A vLLM server engine that heals: a server killed mid-run is restarted, re-synced and its requests sent again; past
``engine_max_restarts``, or on a hung server, the run stops with one line naming the server and its last log lines."""

from __future__ import annotations

import os
import signal

import lightning as L
import pytest
from engine_checks import KV_CACHE_BYTES

from lightning_rl.rollout.base import SamplingConfig
from lightning_rl.rollout.vllm_server import EngineFailedError

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
SAMPLING = SamplingConfig(max_new_tokens=10, seed=5)


class KillServer(L.Callback):
    """SIGKILLs the engine's server process (only it: its engine processes are left to the restart) before `step`."""

    def __init__(self, step: int) -> None:
        self.step, self.killed = step, []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module, batch, batch_idx: int) -> None:
        if batch_idx == self.step:
            pid = pl_module.engine.server.pid
            os.kill(pid, signal.SIGKILL)
            self.killed.append(pid)


def test_a_server_killed_mid_run_is_restarted_resynced_and_the_run_finishes(tiny_model_dir, tmp_path):
    from lightning_rl.data.prompts import PromptDataModule
    from lightning_rl.modules.grpo import GRPOModule

    log = tmp_path / "server.log"
    module = GRPOModule(
        model_name_or_path=str(tiny_model_dir), num_generations=4, sampling={"max_new_tokens": 12}, learning_rate=1e-3,
        engine={"class_path": "lightning_rl.rollout.vllm_server.VLLMServerEngine", "init_args": {
            "engine_max_restarts": 1, "server_options": {
                "dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": KV_CACHE_BYTES, "enforce_eager": True,
                "log_path": str(log)}}},
    )  # fmt: skip
    kill = KillServer(step=1)
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False, callbacks=[kill],
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, PromptDataModule(path="toy", batch_size=2))
    assert trainer.global_step == 3 and module.engine.restarts == 1 and len(kill.killed) == 1
    assert float(trainer.callback_metrics["train/engine/restarts"]) == 1.0  # counted, not only said in a warning
    # Step 1 was sampled by the restarted server, on the weights re-pushed to it (verified) after step 0.
    assert [b["weight_version"] for b in module.trained_batches] == [0, 1, 2]
    assert log.read_text().count("Starting vLLM server on") == 2


def test_a_hung_server_and_one_that_dies_once_too_often_stop_in_one_line_naming_it(server_engine):
    pid = server_engine.server.pid
    timeout, server_engine.request_timeout = server_engine.request_timeout, 2.0
    os.killpg(pid, signal.SIGSTOP)
    try:
        with pytest.raises(EngineFailedError) as hung:
            server_engine.generate(PROMPTS, n=1, sampling=SAMPLING)
    finally:
        os.killpg(pid, signal.SIGCONT)
        server_engine.request_timeout = timeout
    line = hung.value.line()
    assert line.startswith(f"engine: the vLLM server at {server_engine.url} (pid {pid}) left a request unanswered for "
                           "request_timeout=2 s (hung?); its last log lines: ") and "\n" not in line
    assert hung.value.exit_code == 1 and server_engine.restarts == 0
    # No restart left: a death stops at once, with the server's last words.
    server_engine.engine_max_restarts = 0
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(EngineFailedError, match=r"died \(.*\) after 0 restarts \(engine_max_restarts=0\); its last log lines: \S"):
        server_engine.generate(PROMPTS, n=1, sampling=SAMPLING)
    # With one, the same engine heals and answers (on the weights it was last pushed, verified).
    server_engine.engine_max_restarts = 1
    batch = server_engine.generate(PROMPTS, n=2, sampling=SAMPLING)
    assert server_engine.restarts == 1 and server_engine.server.pid != pid and len(batch.rollouts) == 4
