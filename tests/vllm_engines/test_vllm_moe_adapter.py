"""A LoRA adapter on the tiny MoE model and the in-process vLLM engine: refused in one line before a run starts.

vLLM (0.32) serves LoRA on Qwen3-MoE, experts included (one 2D adapter per expert), but its CPU build runs every MoE
layer of a LoRA-serving model through Triton kernels it has no CPU backend for, so generation fails even with an
adapter on attention alone (the first test shows it, and that the engine says so beforehand). Targets vLLM cannot
serve on any build (the router; peft's adapter on the fused experts' 3D weights) are refused naming the module.
``auto`` falls back to a merged sync. Every push is verified (``verify_weights``, the default): the digest read-back
(`vllm_held`) maps vLLM's fused experts to the checkpoint's, and a fault in one expert is caught naming its tensor.
"""

from __future__ import annotations

import re

import pytest
import torch
from engine_checks import KV_CACHE_BYTES, LOGPROB_ATOL, load_trainer_model, max_logprob_error
from peft import LoraConfig, get_peft_model

from lightning_rl.errors import RecipeError
from lightning_rl.models.weights import WeightMismatchError, iter_full_weights
from lightning_rl.models.policy_sync import PolicySync, resolve_weight_sync
from lightning_rl.models.weights import AdapterSpec, adapter_spec
from lightning_rl.rollout.base import SamplingConfig

ATTENTION = {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from lightning_rl.toy.model import build_tiny_moe

    return build_tiny_moe(tmp_path_factory.mktemp("tiny-moe"))


@pytest.fixture(scope="module")
def engine(moe_dir):
    from lightning_rl.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(moe_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=KV_CACHE_BYTES,
                        enforce_eager=True, max_lora_rank=16)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def plain_engine(moe_dir):
    """Without LoRA serving: on the CPU build, a LoRA-serving engine runs its MoE layers through Triton (see above)."""
    from lightning_rl.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(moe_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=KV_CACHE_BYTES, enforce_eager=True)
    yield engine
    engine.close()


def lora(moe_dir, **targets):
    return get_peft_model(load_trainer_model(moe_dir), LoraConfig(r=16, lora_alpha=32, **targets)).eval()


def test_an_adapter_on_the_moe_model_is_refused_on_the_cpu_build_which_cannot_generate_with_it(engine, moe_dir):
    policy = lora(moe_dir, **ATTENTION)
    with pytest.raises(RecipeError, match=r"^weight_sync: adapter: vLLM's CPU build applies LoRA on a MoE model's "
                       r"expert layers \(model.layers.0.mlp.experts\) with Triton kernels"):
        resolve_weight_sync("adapter", policy, engine, lora=True)
    assert resolve_weight_sync("auto", policy, engine, lora=True) == "merged"
    # Negative control: sent anyway, the adapter loads, and generation with it fails in vLLM's Triton MoE kernel.
    PolicySync("adapter").sync(policy, engine, 1)
    with pytest.raises(AttributeError, match="triton"):
        engine.generate([[5, 6, 7]], n=1, sampling=SamplingConfig(max_new_tokens=2, seed=1))


def test_an_adapter_neither_sent_alone_nor_merged_is_refused_before_a_sync_naming_the_key(engine, moe_dir):
    """peft's ``all-linear`` adapts the fused experts too, which no sync takes on the CPU build: neither alone (above)
    nor merged (no merge into a 3D experts weight). Refused naming model.lora, before any weight is gathered."""
    with pytest.raises(RecipeError, match=r"^weight_sync: auto: merging LoRA into Qwen3MoeExperts at "
                       r"model.layers.0.mlp.experts is not supported for a sync and the adapter alone: .*; leave that "
                       r"module out of model.lora.target_modules \(a list of the modules to adapt: all-linear takes every linear layer\)$") as refused:
        resolve_weight_sync("auto", lora(moe_dir, target_modules="all-linear"), engine, lora=True)
    assert refused.value.key == "lora"


@pytest.mark.parametrize(("targets", "module"), [
    pytest.param({"target_modules": ["gate"]}, "model.layers.0.mlp.gate (Qwen3MoeTopKRouter)", id="router"),
    pytest.param({"target_modules": [], "target_parameters": ["mlp.experts.gate_up_proj"]},
                 "model.layers.0.mlp.experts (Qwen3MoeExperts)", id="fused-experts"),
])
def test_moe_targets_vllm_serves_on_no_build_are_refused_naming_the_module(engine, moe_dir, targets, module):
    from lightning_rl.rollout.vllm_engine import vllm_adapter_refusal

    spec: AdapterSpec = adapter_spec(lora(moe_dir, **targets))
    refusal = vllm_adapter_refusal(spec, engine.max_lora_rank, engine._lora_targets, "Qwen3MoeForCausalLM")
    assert re.fullmatch(rf"vLLM's Qwen3MoeForCausalLM serves LoRA on .*experts\.0\.gate_proj.*, not on {re.escape(module)}", refusal)


def test_auto_builds_the_engine_without_lora_serving_and_syncs_merged(plain_engine, moe_dir):
    """``auto`` turned LoRA serving on before the engine existed; on the CPU build that engine then failed its first
    generation in a Triton kernel (or the server's, restarted until it gave up). It builds the engine without it
    (the plain engine here), syncs merged, and the engine samples what the merged policy computes."""
    from lightning_rl.models.policy_sync import engine_options_for
    from lightning_rl.models.routing import is_moe
    from lightning_rl.rollout.vllm_engine import VLLMEngine
    from lightning_rl.rollout.vllm_server import VLLMServerEngine

    policy = lora(moe_dir, **ATTENTION)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)  # an adapter that changes the model
    for engine_class in (VLLMEngine, VLLMServerEngine):
        assert "max_lora_rank" not in engine_options_for(engine_class, {}, "auto", 16, moe=is_moe(policy))
        assert engine_options_for(engine_class, {}, "adapter", 16, moe=True)["max_lora_rank"] == 16  # asked for: refused once built
    assert resolve_weight_sync("auto", policy, plain_engine, lora=True) == "merged"
    PolicySync("merged").sync(policy, plain_engine, plain_engine.weight_version + 1)
    sampled = plain_engine.generate([[5, 6, 7, 8]], n=2, sampling=SamplingConfig(max_new_tokens=8, seed=3))
    assert max_logprob_error(policy.merge_and_unload(), sampled.rollouts) < LOGPROB_ATOL


def test_a_full_push_to_the_moe_model_is_verified_expert_by_expert(plain_engine, moe_dir, monkeypatch):
    """vLLM's CPU MoE kernel computes with experts it prepacked after the first load; a reload writes them back in the
    checkpoint's layout, and the engine prepacks them again (`prepack_on_reload`): the engine then computes
    what the trainer does, and the read-back undoes the prepack to compare the checkpoint's layout."""
    trainer = load_trainer_model(moe_dir)
    with torch.no_grad():
        for param in trainer.parameters():
            param.add_(torch.randn_like(param) * 1e-3)
    version = plain_engine.weight_version + 1
    plain_engine.push_weights(iter_full_weights(trainer), version=version)  # every expert's weights read back and equal
    assert plain_engine.weight_version == version
    sampled = plain_engine.generate([[5, 6, 7, 8], [9, 10, 11]], n=2, sampling=SamplingConfig(max_new_tokens=8, seed=4))
    assert max_logprob_error(trainer, sampled.rollouts) < LOGPROB_ATOL  # 0.05 when the experts were left unpacked
    # Negative control: one value of one expert's up projection (the second half of vLLM's w13) changed after loading.
    reload = plain_engine._reload

    def corrupt_one_expert(weights):
        reload(weights)

        def corrupt(model):
            model.model.layers[0].mlp.experts.routed_experts.w13_weight.data[1, -1, 0] += 1e-3

        plain_engine._llm.apply_model(corrupt)

    monkeypatch.setattr(plain_engine, "_reload", corrupt_one_expert)
    with pytest.raises(WeightMismatchError, match=rf"^weight sync to version {version + 1} failed verification: the engine's "
                       r"'model.layers.0.mlp.experts.gate_up_proj' differs"):
        plain_engine.push_weights(iter_full_weights(trainer), version=version + 1)



def test_a_push_to_experts_the_cpu_kernel_pads_is_exact(tmp_path):
    """An expert size off the CPU kernel's 32-row alignment (48) is padded as well as prepacked after loading: a
    reload's copy back into that storage failed on the shape before the reload prepacked what it wrote."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from lightning_rl.rollout.vllm_engine import VLLMEngine
    from lightning_rl.toy.model import build_tokenizer, save_from_any_process, seeded_model

    tokenizer = build_tokenizer()
    config = Qwen3MoeConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=64, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2, vocab_size=len(tokenizer))  # fmt: skip
    save_from_any_process(seeded_model(AutoModelForCausalLM, config, tokenizer, seed=0), tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = VLLMEngine(tmp_path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=KV_CACHE_BYTES, enforce_eager=True)
    try:
        trainer = load_trainer_model(tmp_path)
        with torch.no_grad():
            for param in trainer.parameters():
                param.add_(torch.randn_like(param) * 1e-3)
        engine.push_weights(iter_full_weights(trainer), version=1)  # verified: the read-back cuts the padding
        sampled = engine.generate([[5, 6, 7, 8]], n=2, sampling=SamplingConfig(max_new_tokens=8, seed=4))
        assert max_logprob_error(trainer, sampled.rollouts) < LOGPROB_ATOL
    finally:
        engine.close()
