"""Families whose vLLM implementation holds its weights unlike the tiny Qwen3 take a verified push on the in-process
engine, and sample with the trainer's weights.

- Gemma 2 has no LM head of its own (its logits come from the tied embedding). The trainer's checkpoint names the head
  ``lm_head.weight``, tied to ``model.embed_tokens.weight``; vLLM's Gemma loads no tensor of that name, so a push that
  sends the tied name as well (as one to a model holding a head of its own must) failed inside vLLM's loader. The
  engine sends a tied name only where the model has a parameter under it (`vllm_held.held_aliases`).
- StableLM fuses q, k and v into ``qkv_proj`` without listing it in its ``packed_modules_mapping``: the weight check
  refused the model before its first push. It now cuts the fused weight by vLLM's usual names.
"""

from __future__ import annotations

import pytest
import torch
from engine_checks import KV_CACHE_BYTES, load_trainer_model, max_logprob_error, perturb_
from transformers import AutoModelForCausalLM, Gemma2Config, StableLmConfig

from lightning_rl.models.weights import iter_full_weights
from lightning_rl.rollout.base import SamplingConfig
from lightning_rl.toy.model import build_tokenizer, save_from_any_process, seeded_model

# head size 64: vLLM's CPU attention has no kernel for the smallest head sizes
SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             max_position_embeddings=256)
FAMILIES = {"gemma2": lambda **ids: Gemma2Config(head_dim=64, tie_word_embeddings=True, **SHAPE, **ids),
            "stablelm": lambda **ids: StableLmConfig(**SHAPE, **ids)}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    tokenizer = build_tokenizer()
    config = FAMILIES[request.param](vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    save_from_any_process(seeded_model(AutoModelForCausalLM, config, tokenizer, seed=0), path)
    tokenizer.save_pretrained(path)
    return path


def test_a_push_is_verified_and_sampled_from(family_dir):
    from lightning_rl.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(family_dir, dtype="float32", max_model_len=128, kv_cache_memory_bytes=KV_CACHE_BYTES, enforce_eager=True)
    try:
        trainer = load_trainer_model(family_dir)
        perturb_(trainer, seed=1)
        engine.push_weights(iter_full_weights(trainer), version=1)  # verified: every tensor read back equal
        assert engine.weight_version == 1
        rollouts = engine.generate([[5, 6, 7, 8]], n=2, sampling=SamplingConfig(max_new_tokens=6, seed=3)).rollouts
        assert max_logprob_error(trainer, rollouts) < 1e-4  # Gemma 2: the new embedding is also the head it samples with
        with torch.no_grad():
            trainer.model.embed_tokens.weight.mul_(0)
        assert max_logprob_error(trainer, rollouts) > 1e-2  # negative control: the check sees the head
    finally:
        engine.close()


def test_a_model_whose_weights_cannot_be_read_back_is_refused_in_one_line_naming_the_key(tmp_path):
    """vLLM's Mixtral names its router ``block_sparse_moe.gate``, which transformers 5 does not: refused before a run
    starts, its engine shut down (left to the interpreter's exit, its teardown failed on closed process groups)."""
    from transformers import MixtralConfig

    from lightning_rl.errors import RecipeError
    from lightning_rl.rollout.vllm_engine import VLLMEngine

    tokenizer = build_tokenizer()
    config = MixtralConfig(num_local_experts=4, num_experts_per_tok=2, vocab_size=len(tokenizer), **SHAPE)
    save_from_any_process(seeded_model(AutoModelForCausalLM, config, tokenizer, seed=0), tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(RecipeError) as refused:
        VLLMEngine(tmp_path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=KV_CACHE_BYTES, enforce_eager=True)
    assert refused.value.key == "engine" and "\n" not in str(refused.value)
    assert "'model.layers.0.block_sparse_moe.gate.weight' (4, 128) maps to no tensor of the MixtralForCausalLM" in str(refused.value)


@pytest.mark.parametrize("engine", ["vllm", "vllm_server"])
def test_a_head_size_the_cpu_attention_has_no_kernel_for_is_refused_before_the_engine_starts(tmp_path, engine):
    """vLLM's CPU attention serves some head sizes only: head size 16 died at the first rollout, deep in a traceback.
    Refused in one line naming the key, before vLLM loads anything; a served head size starts (the tests above)."""
    from transformers import LlamaConfig

    from lightning_rl.errors import RecipeError
    from lightning_rl.rollout.base import EngineSpec

    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         max_position_embeddings=256)
    save_from_any_process(seeded_model(AutoModelForCausalLM, config, tokenizer, seed=0), tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(RecipeError) as refused:
        EngineSpec.of(engine).build(tmp_path)
    assert refused.value.key == "engine" and "\n" not in str(refused.value)
    assert "attention head size is 16, and vLLM's CPU attention has kernels for head sizes 32, 64," in str(refused.value)
