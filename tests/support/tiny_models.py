"""Tiny decoders of several families, built from their transformers configs (random weights)."""

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MuseSparkConfig,
    MuseSparkForConditionalGeneration,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 64
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def qwen3() -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM(Qwen3Config(**_COMMON, attn_implementation="sdpa"))


def llama() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(**_COMMON, attn_implementation="sdpa"))


def mistral_sliding(window: int = 3) -> MistralForCausalLM:
    return MistralForCausalLM(MistralConfig(**_COMMON, sliding_window=window, attn_implementation="sdpa"))


def muse_spark(window: int = 4) -> MuseSparkForConditionalGeneration:
    """Muse Spark Open's classes at toy size: sliding and full layers, NoPE, MoE, logit soft-cap."""
    text = dict(_COMMON, num_hidden_layers=4, sliding_window=window, moe_intermediate_size=16, moe_hidden_size=16,
                num_local_experts=4, num_experts_per_tok=2, bos_token_id=0, eos_token_id=1, pad_token_id=2)  # fmt: skip
    config = MuseSparkConfig(
        text_config=text,
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, out_hidden_size=32),
        audio_config=dict(num_hidden_layers=1, out_hidden_size=32, patch_sizes=[4], hidden_sizes=[16], depths=[1]),
        out_hidden_size=32,
    )
    config._attn_implementation = "sdpa"
    return MuseSparkForConditionalGeneration(config)


FAMILIES = {"qwen3": qwen3, "llama": llama, "mistral_sliding": mistral_sliding, "muse_spark": muse_spark}


def build(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return FAMILIES[name]().float().eval()
