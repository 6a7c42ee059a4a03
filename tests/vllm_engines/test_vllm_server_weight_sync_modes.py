"""The vLLM server engine under the sync modes: only the changed tensors, and the LoRA adapter sent alone.

One server serving LoRA (max_lora_rank) for the whole file; the delta tests run first, while no adapter is loaded.
"""

from __future__ import annotations

import pytest
import torch
from engine_checks import (
    KV_CACHE_BYTES, LOGPROB_ATOL, LORA_TARGETS, check_adapter_refused_on_another_base, load_trainer_model, lora_trainer, max_logprob_error, merged_copy, nudge_,
)

from lightning_rl.models.policy_sync import PolicySync, resolve_weight_sync
from lightning_rl.models.weights import WeightMismatchError, iter_full_weights

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from lightning_rl.rollout.vllm_server import VLLMServerEngine

    engine = VLLMServerEngine(tiny_model_dir, max_lora_rank=16, server_options={
        "dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": KV_CACHE_BYTES, "enforce_eager": True})
    yield engine
    engine.close()


def sampling(seed: int):
    from lightning_rl.rollout.base import SamplingConfig

    return SamplingConfig(max_new_tokens=10, seed=seed)


def test_a_delta_writes_only_what_changed_and_keeps_the_server_on_the_trainers_weights(engine, tiny_model_dir):
    trainer = load_trainer_model(tiny_model_dir)
    sync = PolicySync(resolve_weight_sync("delta", trainer, engine, lora=False))
    assert sync.sync(trainer, engine, 1).mode == "full"
    nudge_(trainer, seed=1, only="layers.0.self_attn.q_proj")
    nudge_(trainer, seed=2, only="model.norm")
    report = sync.sync(trainer, engine, 2)
    # q changed; vLLM reloads q, k and v as one module, so k and v travel with it (from the copy kept: unchanged).
    assert report.mode == "delta" and sorted(report.names) == sorted(
        [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"] + ["model.norm.weight"])
    assert report.num_bytes < sum(t.numel() * 4 for _, t in iter_full_weights(trainer)) / 4
    assert 0 < report.pause_seconds <= report.seconds
    batch = engine.generate(PROMPTS, n=2, sampling=sampling(4))
    assert all(r.weight_version == 2 for r in batch.rollouts)
    assert max_logprob_error(trainer, batch.rollouts) < LOGPROB_ATOL
    # A restart of the server re-syncs it to everything it held (the weights kept, and the delta on top).
    engine.server.process.kill()
    engine.server.process.wait()
    batch = engine.generate(PROMPTS, n=1, sampling=sampling(5))
    assert engine.restarts == 1 and max_logprob_error(trainer, batch.rollouts) < LOGPROB_ATOL
    nudge_(trainer, seed=3, only="layers.1.mlp.down_proj")
    assert sync.sync(trainer, engine, 3).names == ["model.layers.1.mlp.down_proj.weight"]
    assert max_logprob_error(trainer, engine.generate(PROMPTS, n=1, sampling=sampling(6)).rollouts) < LOGPROB_ATOL


def test_a_delta_without_the_fused_parts_is_caught_and_the_next_sync_is_full(engine, tiny_model_dir):
    # Sending q without k and v leaves vLLM's qkv module rebuilt from q alone: the check over every tensor sees it.
    trainer = load_trainer_model(tiny_model_dir)
    sync = PolicySync("delta")
    sync.sync(trainer, engine, 4)
    nudge_(trainer, seed=3, only="layers.1.self_attn.q_proj")
    with pytest.raises(WeightMismatchError, match="layers.1.self_attn.k_proj"):
        engine.push_changed(iter([(n, t) for n, t in iter_full_weights(trainer) if "layers.1.self_attn.q_proj" in n]), 5)
    assert sync.sync(trainer, engine, 5).mode == "full"  # the engine no longer holds version 4
    assert max_logprob_error(trainer, engine.generate(PROMPTS, n=1, sampling=sampling(7)).rollouts) < LOGPROB_ATOL


def test_a_few_changed_elements_travel_alone_and_a_restarted_server_writes_them_exactly(engine, tiny_model_dir):
    trainer = load_trainer_model(tiny_model_dir)
    sync = PolicySync("delta")
    assert sync.sync(trainer, engine, 20).mode == "full"
    down = dict(trainer.named_parameters())["model.layers.0.mlp.down_proj.weight"]
    for version, (row, columns) in zip((21, 22), ((2, slice(0, 3)), (5, slice(7, 10)))):
        with torch.no_grad():
            down[row, columns] += 0.5
        report = sync.sync(trainer, engine, version)
        # Three float32 values and their int32 indices, of a tensor of 8 KiB; the worker writes them into its copy.
        assert report.mode == "delta" and report.names == ["model.layers.0.mlp.down_proj.weight"] and report.num_bytes == 3 * 8
        assert max_logprob_error(trainer, engine.generate(PROMPTS, n=1, sampling=sampling(version)).rollouts) < LOGPROB_ATOL
        if version == 21:  # the restarted server is sent every weight kept, and keeps copies of them again
            restarts = engine.restarts
            engine.server.process.kill()
            engine.server.process.wait()
            engine.generate(PROMPTS, n=1, sampling=sampling(30))
            assert engine.restarts == restarts + 1
    with torch.no_grad():
        down.mul_(1.5)  # every value changed: sent whole
    assert sync.sync(trainer, engine, 23).num_bytes == down.numel() * 4
    assert max_logprob_error(trainer, engine.generate(PROMPTS, n=1, sampling=sampling(31)).rollouts) < LOGPROB_ATOL


def test_an_adapter_sync_gives_the_trainers_logprobs_and_a_merged_syncs(engine, tiny_model_dir):
    policy = lora_trainer(tiny_model_dir, seed=5)
    base = load_trainer_model(tiny_model_dir)
    check_adapter_refused_on_another_base(engine, policy, tiny_model_dir, 6)
    assert resolve_weight_sync("auto", policy, engine, lora=True) == "adapter"
    sync = PolicySync("adapter")
    for version in (7, 8):
        nudge_(policy, seed=version, only="lora_B")
        report = sync.sync(policy, engine, version)
        assert report.mode == "adapter" and report.num_tensors == 2 * 2 * len(LORA_TARGETS)
        assert 0 < report.pause_seconds <= report.seconds
        batch = engine.generate(PROMPTS, n=2, sampling=sampling(version))
        # The version comes back from the server with every token.
        assert all(r.weight_version == version for r in batch.rollouts)
        assert max_logprob_error(policy, batch.rollouts) < LOGPROB_ATOL
        assert max_logprob_error(merged_copy(policy, tiny_model_dir), batch.rollouts) < LOGPROB_ATOL
        assert max_logprob_error(base, batch.rollouts) > 1e-2  # negative control: the adapter is applied
    # A restarted server loads the base from its files: the adapter kept is loaded on it again.
    restarts = engine.restarts
    engine.server.process.kill()
    engine.server.process.wait()
    batch = engine.generate(PROMPTS, n=2, sampling=sampling(9))
    assert engine.restarts == restarts + 1 and max_logprob_error(policy, batch.rollouts) < LOGPROB_ATOL


def test_an_adapter_the_server_does_not_hold_is_caught(engine, tiny_model_dir, monkeypatch):
    policy = lora_trainer(tiny_model_dir, seed=8)
    real = engine._rpc

    def drops_a_layer(method, **kwargs):  # the adapter's folder on the server loses one layer's B before it loads
        result = real(method, **kwargs)
        if method == "lightning_rl_write_adapter":
            from safetensors.torch import load_file, save_file

            tensors = load_file(f"{result}/adapter_model.safetensors")
            save_file({n: torch.zeros_like(t) if "layers.1.mlp.up_proj.lora_B" in n else t for n, t in tensors.items()},
                      f"{result}/adapter_model.safetensors")
        return result

    monkeypatch.setattr(engine, "_rpc", drops_a_layer)
    with pytest.raises(WeightMismatchError, match=r"version 10 .*'base_model.model.model.layers.1.mlp.up_proj.lora_B.weight'"):
        PolicySync("adapter").sync(policy, engine, 10)
    assert engine.weight_version == 8
