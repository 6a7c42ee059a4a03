"""Tiny mixture-of-experts decoders of the families router replay knows, each routing by its own rule: softmax then
top-k, normalised (Qwen3-MoE), not (OLMoE) or always with fp32 weights (Mixtral); sigmoid with a selection bias,
expert groups and a shared expert (DeepSeek-V3); sigmoid with a selection bias and an output multiplier (Muse Spark)."""

import torch
from transformers import DeepseekV3Config, OlmoeConfig, MixtralConfig, Qwen3MoeConfig
from transformers import AutoModelForCausalLM

from support import tiny_models

VOCAB = tiny_models.VOCAB
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               bos_token_id=0, eos_token_id=1, pad_token_id=2)  # fmt: skip


def _configs():
    return {
        "qwen3_moe": Qwen3MoeConfig(**_COMMON, intermediate_size=64, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True),
        "mixtral": MixtralConfig(**_COMMON, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
        "olmoe": OlmoeConfig(**_COMMON, intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False),
        "deepseek_v3": DeepseekV3Config(
            **{k: v for k, v in _COMMON.items() if k not in ("head_dim", "num_hidden_layers", "num_key_value_heads")}, num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8,
            num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_hidden_layers=3,
        ),
    }


FAMILIES = ["qwen3_moe", "olmoe", "mixtral", "deepseek_v3", "muse_spark"]


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """Random weights from ``seed``; routers drawn wide enough that tokens do go to different experts."""
    torch.manual_seed(seed)
    if name == "muse_spark":
        model = tiny_models.muse_spark()
    else:
        config = _configs()[name]
        config._attn_implementation = "sdpa"
        model = AutoModelForCausalLM.from_config(config)
    for module in model.modules():
        if hasattr(module, "top_k") and isinstance(getattr(module, "weight", None), torch.nn.Parameter):
            torch.nn.init.normal_(module.weight, std=1.0)
    return model.float().eval()
