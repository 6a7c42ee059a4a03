"""The in-process vLLM engine under the sync modes: only the changed tensors, and the LoRA adapter sent alone.

One engine serves LoRA (max_lora_rank) for the whole file; the delta test runs first, while no adapter is loaded.
"""

from __future__ import annotations

import pytest
import torch

from engine_checks import (
    KV_CACHE_BYTES, LOGPROB_ATOL, LORA_TARGETS, check_adapter_refused_on_another_base, load_trainer_model, lora_trainer, max_logprob_error, merged_copy, nudge_,
)
from lightning_rl.models.policy_sync import PolicySync, resolve_weight_sync
from lightning_rl.models.weights import AdapterSpec, WeightMismatchError, adapter_spec, iter_adapter_weights, iter_full_weights
from lightning_rl.rollout.base import SamplingConfig

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
SAMPLING = SamplingConfig(max_new_tokens=10, seed=4)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from lightning_rl.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(tiny_model_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=KV_CACHE_BYTES,
                        enforce_eager=True, max_lora_rank=16)
    yield engine
    engine.close()


def test_a_delta_sends_whole_fused_modules_and_keeps_the_engine_on_the_trainers_weights(engine, tiny_model_dir):
    trainer = load_trainer_model(tiny_model_dir)
    sync = PolicySync("delta")
    assert sync.sync(trainer, engine, 1).mode == "full"
    nudge_(trainer, seed=1, only="layers.0.self_attn.q_proj")
    nudge_(trainer, seed=2, only="model.norm")
    report = sync.sync(trainer, engine, 2)
    # q changed; vLLM reloads q, k and v as one module, so k and v travel with it (from the copy kept: unchanged).
    assert report.mode == "delta" and sorted(report.names) == sorted(
        [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"] + ["model.norm.weight"])
    assert report.num_bytes < sum(t.numel() * 4 for _, t in iter_full_weights(trainer)) / 4
    batch = engine.generate(PROMPTS, n=2, sampling=SAMPLING)
    assert all(r.weight_version == 2 for r in batch.rollouts)
    assert max_logprob_error(trainer, batch.rollouts) < LOGPROB_ATOL


def test_a_delta_without_the_fused_parts_is_caught(engine, tiny_model_dir):
    # Sending q without k and v leaves vLLM's qkv module rebuilt from q alone: the check over every tensor sees it.
    trainer = load_trainer_model(tiny_model_dir)
    sync = PolicySync("delta")
    sync.sync(trainer, engine, 3)
    nudge_(trainer, seed=3, only="layers.1.self_attn.q_proj")
    with pytest.raises(WeightMismatchError, match="layers.1.self_attn.k_proj"):
        engine.push_changed(iter([(n, t) for n, t in iter_full_weights(trainer) if "layers.1.self_attn.q_proj" in n]), 4)
    assert sync.sync(trainer, engine, 4).mode == "full"  # the engine no longer holds version 3
    assert max_logprob_error(trainer, engine.generate(PROMPTS, n=1, sampling=SAMPLING).rollouts) < LOGPROB_ATOL


def test_an_adapter_sync_gives_the_trainers_logprobs_and_a_merged_syncs(engine, tiny_model_dir):
    policy = lora_trainer(tiny_model_dir, seed=5)
    base = load_trainer_model(tiny_model_dir)
    check_adapter_refused_on_another_base(engine, policy, tiny_model_dir, 5)
    assert resolve_weight_sync("auto", policy, engine, lora=True) == "adapter"
    sync = PolicySync("adapter")
    for version in (6, 7):
        nudge_(policy, seed=version, only="lora_B")
        report = sync.sync(policy, engine, version)
        assert report.mode == "adapter" and report.num_tensors == 2 * 2 * len(LORA_TARGETS)
        batch = engine.generate(PROMPTS, n=2, sampling=SAMPLING)
        assert all(r.weight_version == version for r in batch.rollouts)
        assert max_logprob_error(policy, batch.rollouts) < LOGPROB_ATOL
        assert max_logprob_error(merged_copy(policy, tiny_model_dir), batch.rollouts) < LOGPROB_ATOL
        assert max_logprob_error(base, batch.rollouts) > 1e-2  # negative control: the adapter is applied
    # Full weights after an adapter: generation is theirs alone (the adapter was still applied on top of them).
    PolicySync("full").sync(base, engine, 8)
    assert max_logprob_error(base, engine.generate(PROMPTS, n=2, sampling=SAMPLING).rollouts) < LOGPROB_ATOL


def test_an_adapter_the_engine_does_not_hold_is_caught(engine, tiny_model_dir, monkeypatch):
    from lightning_rl.rollout import vllm_engine

    policy = lora_trainer(tiny_model_dir, seed=8)
    real = vllm_engine.write_adapter

    def drops_a_layer(named_tensors, adapter, folder):
        received = real(named_tensors, adapter, folder)
        real(((n, torch.zeros_like(t) if "layers.1.mlp.up_proj.lora_B" in n else t) for n, t in received.items()), adapter, folder)
        return received

    monkeypatch.setattr(vllm_engine, "write_adapter", drops_a_layer)
    with pytest.raises(WeightMismatchError, match=r"version 9 .*'base_model.model.model.layers.1.mlp.up_proj.lora_B.weight'"):
        PolicySync("adapter").sync(policy, engine, 9)
    assert engine.weight_version == 8  # the full push that ended the adapter test


def test_adapters_vllm_cannot_serve_are_refused_naming_the_module(engine):
    plain = dict(config={"r": 8, "lora_alpha": 16}, layers={"model.layers.0.self_attn.q_proj": "Linear"})
    assert engine.adapter_refusal(AdapterSpec(**plain)) is None
    assert "modules_to_save: lm_head" in engine.adapter_refusal(AdapterSpec(**plain, modules_to_save=("lm_head",)))
    assert "not on model.embed_tokens (Embedding)" in engine.adapter_refusal(
        AdapterSpec(plain["config"], {"model.embed_tokens": "Embedding"}))
    assert "LoRA variant or LoRA bias (on model.layers.0.self_attn.q_proj)" in engine.adapter_refusal(
        AdapterSpec(**plain, unmergeable=("model.layers.0.self_attn.q_proj",)))
    assert "lora.r 32 is above the engine's max_lora_rank 16" in engine.adapter_refusal(
        AdapterSpec({"r": 32, "lora_alpha": 16}, plain["layers"]))


def test_an_adapter_travels_in_the_dtype_the_engine_holds_it_in_and_loses_nothing(tiny_model_dir):
    """A bf16 engine holds adapters in bf16 (vLLM casts each tensor as it loads it): the fp32 adapter is sent cast,
    half the bytes, and the engine then holds exactly what it held when the fp32 adapter was sent as trained."""
    from lightning_rl.rollout.vllm_engine import VLLMEngine
    from lightning_rl.rollout.vllm_held import held_adapter

    engine = VLLMEngine(tiny_model_dir, dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=KV_CACHE_BYTES,
                        enforce_eager=True, max_lora_rank=16)
    try:
        assert engine.adapter_dtype() == torch.bfloat16
        policy = lora_trainer(tiny_model_dir, seed=5)
        held = lambda: engine._llm.collective_rpc(held_adapter, kwargs={"lora_id": 1, "rank": 16})[0]  # noqa: E731
        engine.push_adapter(iter_adapter_weights(policy), adapter_spec(policy), 1)  # as trained, fp32
        as_trained = held()
        report = PolicySync("adapter").sync(policy, engine, 2)
        assert held() == as_trained and {dtype for dtype, _ in as_trained.values()} == {"bfloat16"}
        trained_bytes = sum(t.numel() * t.element_size() for _, t in iter_adapter_weights(policy))
        assert report.num_bytes * 2 == trained_bytes  # every tensor of this adapter is a LoRA tensor, fp32 as trained
        assert all(r.weight_version == 2 for r in engine.generate(PROMPTS, n=1, sampling=SAMPLING).rollouts)
    finally:
        engine.close()
