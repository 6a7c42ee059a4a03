"""A family matrix for tree packing: tiny configs of the decoder families transformers ships, of every attention
style (rotary and its length-dependent variants, ALiBi, learned absolute positions, local attention, MoE, MLA,
soft-capped, sliding windows by keyword and by mask, hybrids with recurrent layers), random weights.

Each family is exact (packed log-probs and gradients equal each sequence alone) or refused with one line; never
silently wrong. ``tests/test_packing_families.py`` asserts it; ``python tests/support/packing_families.py`` prints the
matrix with the measured errors.
"""

from __future__ import annotations

import copy
import re
import sys

import torch
import transformers
from transformers import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from lightning_rl.attention.tree_attention import PackingRefused
from lightning_rl.ops.packed_forward import packed_logprobs
from lightning_rl.packing import pack_sequences

NESTED = [
    [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],  # a shared prompt, forks, a nested fork, a repeat, another root
    [3, 4, 5, 6, 7, 8, 9, 10, 20, 21, 22, 23],
    [3, 4, 5, 6, 7, 8, 30, 31, 32, 33, 34],
    [3, 4, 5, 6, 7, 8, 30, 31, 40, 41],
    [3, 4, 5, 6, 7, 8, 30, 31, 40, 41],
    [50, 51],
    [3, 60],
]
# (log-prob, gradient) tolerances. fp32: 1e-5 and 1e-4 relative. fp64: log-probs within 1e-10; gradients within 1e-6,
# because most families round to fp32 inside their own layers even in fp64 (Llama-style RMSNorm casts its input to
# float32), so rounding-boundary noise of ~1e-7 reaches the gradients of packed and unpacked runs alike.
TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.float64: (1e-10, 1e-6)}
# Families that round to fp32 inside their layers even in fp64 (Gemma's and Gemma 3n's RMSNorm compute in float32,
# DeepSeek-V3 also routes in float32): their fp64 log-probs carry fp32 rounding, in packed and unpacked runs alike,
# and so do their gradients, which the norms' weights sum over tokens in float32, in another order once packed.
FP32_INSIDE = {"gemma2", "gemma2_nosoftcap", "vaultgemma", "vaultgemma_nosoftcap", "deepseek_v3", "deepseek_v3_samedim",
               "gemma3n_text", "gemma3n_text_kvshare"}  # fmt: skip
FP32_INSIDE_TOLERANCE = (1e-7, 1e-5)


def tolerance(family: str, dtype: torch.dtype) -> tuple[float, float]:
    """(log-prob, gradient) tolerance of a family at a dtype: ``TOLERANCE``'s, or fp32's rounding inside in fp64."""
    return FP32_INSIDE_TOLERANCE if family in FP32_INSIDE and dtype == torch.float64 else TOLERANCE[dtype]


# Gradients that are zero in exact arithmetic (a key bias under softmax) are noise: each parameter's error is
# measured against its own gradient norm plus this fraction of the whole gradient's norm.
GRAD_FLOOR = {torch.float32: 1e-2, torch.float64: 1e-6}

VOCAB = 64
# Generic tiny values, applied to whichever of these keys a family's config has.
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32, n_embd=32, d_model=32, dim=32, embed_dim=32,
    intermediate_size=64, n_inner=64, ffn_dim=64, dff=64, ffn_hidden_size=64, inner_hidden_size=64,
    num_hidden_layers=2, n_layer=2, n_layers=2, num_layers=2,
    num_attention_heads=4, n_head=4, n_heads=4, attention_heads=4, num_heads=4,
    num_key_value_heads=2, num_kv_heads=2, n_kv_heads=2, num_key_value_groups=None,
    head_dim=8,
    max_position_embeddings=64, n_positions=64, n_ctx=64, max_seq_len=64, max_sequence_length=64,
    # MoE
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4,
    num_experts_per_tok=2, moe_topk=2, moe_k=2,
    moe_intermediate_size=16, shared_expert_intermediate_size=16, moe_shared_expert_intermediate_size=16,
    n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
    # MLA (qk head dim 16 = 8 nope + 8 rope, v head dim 8: the DeepSeek shape, v narrower than q/k)
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    sliding_window=3,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
    use_cache=False,
)

ROPE = dict(rope_type="default", rope_theta=10000.0)


def rope(**kw):
    return dict(ROPE, **kw)


# family -> (model_type, config overrides); an override of None removes a generic key.
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "llama_dynamic": ("llama", dict(max_position_embeddings=8, rope_parameters=rope(rope_type="dynamic", factor=2.0))),
    # longrope switches factors when max(position_ids)+1 > original_max_position_embeddings: with 10, the packed row
    # (max depth 12) takes the long factors, while sequences of 10 and 2 tokens alone take the short ones
    "llama_longrope": ("llama", dict(max_position_embeddings=40, rope_parameters=rope(
        rope_type="longrope", original_max_position_embeddings=10, short_factor=[1.0] * 4, long_factor=[4.0] * 4))),
    "llama_dynamic_noop": ("llama", dict(max_position_embeddings=64, rope_parameters=rope(rope_type="dynamic", factor=2.0))),
    "llama_yarn": ("llama", dict(rope_parameters=rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=8))),
    "llama_linear": ("llama", dict(rope_parameters=rope(rope_type="linear", factor=2.0))),
    "llama_llama3": ("llama", dict(rope_parameters=rope(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                         high_freq_factor=4.0, original_max_position_embeddings=8))),
    "mistral": ("mistral", {}),
    "mistral_nowindow": ("mistral", dict(sliding_window=None)),
    "ministral": ("ministral", {}),
    "ministral3": ("ministral3", {}),
    "mixtral": ("mixtral", {}),
    "qwen2": ("qwen2", {}),
    "qwen2_sliding": ("qwen2", dict(use_sliding_window=True, max_window_layers=1)),
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_sliding": ("qwen3", dict(use_sliding_window=True, max_window_layers=1)),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_next": ("qwen3_next", {}),
    "gemma": ("gemma", {}),
    "gemma2": ("gemma2", {}),
    "gemma2_nosoftcap": ("gemma2", dict(attn_logit_softcapping=None)),
    "gemma3_text": ("gemma3_text", {}),
    "gemma3n_text": ("gemma3n_text", dict(num_kv_shared_layers=0, hidden_size_per_layer_input=8, vocab_size_per_layer_input=64,
                                          laurel_rank=4, altup_num_inputs=2, activation_sparsity_pattern=[0.0, 0.0])),
    "gemma3n_text_kvshare": ("gemma3n_text", dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                                                  num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=64,
                                                  laurel_rank=4, altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 4)),
    "vaultgemma": ("vaultgemma", {}),
    "vaultgemma_nosoftcap": ("vaultgemma", dict(attn_logit_softcapping=None)),
    "cohere": ("cohere", {}),
    "cohere2": ("cohere2", {}),
    "phi": ("phi", {}),
    "phi3": ("phi3", {}),
    "phi3_longrope": ("phi3", dict(max_position_embeddings=40, original_max_position_embeddings=10, rope_parameters=rope(
        rope_type="longrope", original_max_position_embeddings=10, short_factor=[1.0] * 4, long_factor=[4.0] * 4))),
    "phi3_nowindow": ("phi3", dict(sliding_window=None)),
    "phimoe": ("phimoe", {}),
    "phimoe_nowindow": ("phimoe", dict(sliding_window=None)),
    "gpt2": ("gpt2", {}),
    "gpt_bigcode": ("gpt_bigcode", {}),
    "gpt_neo": ("gpt_neo", dict(window_size=3, attention_types=[[["global", "local"], 1]])),
    "gpt_neox": ("gpt_neox", {}),
    "gptj": ("gptj", dict(rotary_dim=4)),
    "codegen": ("codegen", dict(rotary_dim=4)),
    "opt": ("opt", dict(word_embed_proj_dim=32)),
    "bloom": ("bloom", {}),
    "falcon_alibi": ("falcon", dict(alibi=True, new_decoder_architecture=False, multi_query=True)),
    "falcon_rotary": ("falcon", dict(alibi=False, new_decoder_architecture=True, num_kv_heads=2)),
    "mpt": ("mpt", dict(expansion_ratio=2)),
    "olmo": ("olmo", {}),
    "olmo2": ("olmo2", {}),
    "olmo3": ("olmo3", {}),
    "olmoe": ("olmoe", {}),
    "flex_olmo": ("flex_olmo", {}),
    "starcoder2": ("starcoder2", {}),
    "stablelm": ("stablelm", {}),
    "granite": ("granite", {}),
    # HyperCLOVAX multiplies its logits by logits_scaling, where Granite divides by it: told apart by the model's own logits.
    "hyperclovax_scaled": ("hyperclovax", dict(logits_scaling=0.25)),
    "granitemoe": ("granitemoe", {}),
    "granitemoeshared": ("granitemoeshared", {}),
    "granitemoehybrid": ("granitemoehybrid", dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
                                                  layer_types=["mamba", "attention"])),
    "granitemoehybrid_attn": ("granitemoehybrid", dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
                                                       layer_types=["attention", "attention"])),
    "deepseek_v2": ("deepseek_v2", dict(num_key_value_heads=4)),  # MLA: k/v have every head
    "deepseek_v3": ("deepseek_v3", dict(num_key_value_heads=4)),
    "deepseek_v3_samedim": ("deepseek_v3", dict(num_key_value_heads=4, v_head_dim=16)),  # v as wide as q/k
    "jamba": ("jamba", dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                            mamba_d_state=4, mamba_d_conv=2, mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False)),
    "llama4_text": ("llama4_text", dict(intermediate_size_mlp=64, no_rope_layers=[1, 0], floor_scale=2,
                                        attn_temperature_tuning=True, attention_chunk_size=3, interleave_moe_layer_step=1)),
    # no chunked layers: layer 1 is NoPE with attention temperature tuning (floor_scale 2 so it varies along a path)
    "llama4_text_nochunk": ("llama4_text", dict(intermediate_size_mlp=64, no_rope_layers=[1, 0], floor_scale=2,
                                                attn_temperature_tuning=True, attention_chunk_size=None, interleave_moe_layer_step=1)),
    "llama4_text_notemp": ("llama4_text", dict(intermediate_size_mlp=64, no_rope_layers=[1, 0], floor_scale=2,
                                               attn_temperature_tuning=False, attention_chunk_size=None, interleave_moe_layer_step=1)),
    "gpt_oss": ("gpt_oss", {}),
    "exaone4": ("exaone4", {}),
    "smollm3": ("smollm3", dict(no_rope_layer_interval=2)),
    "glm": ("glm", {}),
    "glm4": ("glm4", {}),
    "glm4_moe": ("glm4_moe", {}),
    "helium": ("helium", {}),
    "minimax": ("minimax", {}),
    "ernie4_5": ("ernie4_5", {}),
    "ernie4_5_moe": ("ernie4_5_moe", {}),
    "hunyuan_v1_dense": ("hunyuan_v1_dense", {}),
    "hunyuan_v1_moe": ("hunyuan_v1_moe", {}),
    "seed_oss": ("seed_oss", {}),
    "apertus": ("apertus", {}),
    "arcee": ("arcee", {}),
    "dots1": ("dots1", {}),
    "bitnet": ("bitnet", {}),
    "nemotron": ("nemotron", {}),
    "persimmon": ("persimmon", {}),
    "xglm": ("xglm", {}),
    "biogpt": ("biogpt", {}),
    "diffllama": ("diffllama", {}),
    "dbrx": ("dbrx", dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                          ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2))),
    "jetmoe": ("jetmoe", {}),
    "cwm": ("cwm", {}),
    "minimax_m2": ("minimax_m2", {}),
    "mamba": ("mamba", {}),
    "rwkv": ("rwkv", {}),
    "bamba": ("bamba", dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, attn_layer_indices=[1])),
    "zamba2": ("zamba2", dict(layers_block_type=["mamba", "hybrid"], n_mamba_heads=4, mamba_d_state=8, mamba_ngroups=1)),
    "lfm2": ("lfm2", {}),
    "lfm2_conv": ("lfm2", dict(layer_types=["conv", "full_attention"])),
    "falcon_h1": ("falcon_h1", {}),
    "gemma4_text": ("gemma4_text", {}),
    "modernbert-decoder": ("modernbert-decoder", {}),
    "openai-gpt": ("openai-gpt", {}),
    "ctrl": ("ctrl", {}),
    "hrm_text": ("hrm_text", {}),  # layers reused across cycles: num_hidden_layers counts the reuses
    "gemma4_unified_text": ("gemma4_unified_text", {}),  # bidirectional for image tokens only
    "moshi": ("moshi", {}),
    "bart": ("bart", {}),  # positions from the row index, not position_ids
    "bert": ("bert", {}),  # is_decoder False (the default): bidirectional
    "bert_decoder": ("bert", dict(is_decoder=True)),
    "electra": ("electra", dict(embedding_size=32, is_decoder=True)),  # a projection between decoder and LM head
    "doge": ("doge", {}),  # a dynamic score bias in the attention mask
    "dory": ("dory", {}),  # an LM head with a learned per-vocabulary scale
    "qwen3_5_text": ("qwen3_5_text", {}),  # gated delta-net layers beside full attention
    "nemotron_h": ("nemotron_h", {}),  # mamba, MoE and MLP-only blocks beside attention
    "granite_swa": ("granite_swa", {}),  # attention sinks on sliding layers
    "exaone_moe": ("exaone_moe", {}),
    "nanochat": ("nanochat", {}),
    "cohere2_moe": ("cohere2_moe", {}),
    "blenderbot": ("blenderbot", {}),  # learned positions from the row index
}


def build_config(model_type: str, overrides: dict):
    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class().to_dict()
    kwargs = {k: v for k, v in TINY.items() if k in defaults and v is not None}
    for k, v in defaults.items():  # no dropout anywhere: the comparison is of the computation
        if ("dropout" in k or "pdrop" in k or k.endswith("_drop")) and isinstance(v, (int, float)) and not isinstance(v, bool):
            kwargs[k] = 0.0
    for k, v in overrides.items():
        if v is None:
            kwargs.pop(k, None)
            if k in defaults:
                kwargs[k] = None
        else:
            kwargs[k] = v
    kwargs.setdefault("attn_implementation", "sdpa")
    return config_class(**kwargs)


def build(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    model_type, overrides = FAMILIES[name]
    if dtype == torch.float64:  # transformers' grouped expert matmuls have no fp64 kernel
        overrides = dict(overrides, experts_implementation="eager")
    model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    torch.manual_seed(0)
    try:
        model = model_class(build_config(model_type, overrides))
    except ValueError as e:  # families without an sdpa path are built eager
        if "sdpa" not in str(e) and "scaled_dot_product_attention" not in str(e):
            raise
        torch.manual_seed(0)
        model = model_class(build_config(model_type, dict(overrides, attn_implementation="eager")))
    return model.to(dtype).eval()


def reference_logprobs(model, seqs):
    out = []
    for s in seqs:
        logits = model(input_ids=torch.tensor([s])).logits[0]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        out.append(torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(s[1:])[:, None]).squeeze(1))
    return torch.cat(out)


def measure(name: str, dtype: torch.dtype = torch.float32, backend: str = "blocks") -> dict:
    """``{"status": "exact" | "WRONG" | "refused" | "crash" | "model fails", "logprob_error", "grad_error",
    "message"}`` for one family; "model fails" when the model cannot even run one sequence on its own."""
    model = build(name, dtype)
    reference = copy.deepcopy(model)
    try:
        ref = reference_logprobs(reference, NESTED)
    except Exception as e:  # e.g. a family whose own code has no fp64 path
        return {"status": "model fails", "message": f"{type(e).__name__}: {e}"}
    try:
        packed = packed_logprobs(model, pack_sequences(NESTED), chunk_size=7, attention_backend=backend)
    except PackingRefused as e:
        return {"status": "refused", "message": str(e)}
    except Exception as e:
        return {"status": "crash", "message": f"{type(e).__name__}: {e}"}
    packed.sum().backward()
    ref.sum().backward()
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p), q.grad if q.grad is not None else torch.zeros_like(q))
             for p, q in zip(model.parameters(), reference.parameters())]  # fmt: skip
    total = float(torch.stack([theirs.norm() for _, theirs in grads]).norm())
    grad_error = max(float((ours - theirs).norm() / (theirs.norm() + GRAD_FLOOR[dtype] * total)) for ours, theirs in grads)
    logprob_error = float((packed.detach() - ref.detach()).abs().max())
    lp_tol, grad_tol = tolerance(name, dtype)
    exact = logprob_error <= lp_tol and grad_error <= grad_tol
    return {"status": "exact" if exact else "WRONG", "logprob_error": logprob_error, "grad_error": grad_error}


def matrix(names, backends=("blocks", "dense")) -> list[str]:
    """The table, then what it comes to: families exact in every case, refused, or neither; the largest errors of
    the exact cases."""
    results: dict[str, list[dict]] = {}
    lines = ["| family | backend | fp32 | fp32 log-prob err | fp32 grad rel err | fp64 | fp64 log-prob err | fp64 grad rel err | refusal |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    fmt = lambda r, k: f"{r[k]:.1e}" if k in r else "-"  # noqa: E731
    for name in names:
        for backend in backends:
            r32, r64 = measure(name, torch.float32, backend), measure(name, torch.float64, backend)
            results.setdefault(name, []).extend([r32 | {"dtype": "fp32"}, r64 | {"dtype": "fp64"}])
            refusal = re.sub(r"\s+", " ", r32.get("message") or r64.get("message") or "")[:160]
            lines.append(f"| {name} | {backend} | {r32['status']} | {fmt(r32, 'logprob_error')} | {fmt(r32, 'grad_error')} | "
                         f"{r64['status']} | {fmt(r64, 'logprob_error')} | {fmt(r64, 'grad_error')} | {refusal} |")  # fmt: skip
            print(lines[-1], flush=True)
    statuses = {name: {r["status"] for r in rs} for name, rs in results.items()}
    exact = [n for n, s in statuses.items() if s == {"exact"}]
    refused = [n for n, s in statuses.items() if "refused" in s]
    lines.append(f"families: {len(statuses)}; exact in every case: {len(exact)}; refused: {len(refused)}; "
                 f"other: {sorted(set(statuses) - set(exact) - set(refused))}")  # fmt: skip
    for dtype, which, names_in in (("fp32", "every family", set(results)), ("fp64", "every family but those rounding to fp32 inside", set(results) - FP32_INSIDE),
                                   ("fp64", f"the families rounding to fp32 inside ({', '.join(sorted(FP32_INSIDE))})", FP32_INSIDE)):  # fmt: skip
        cases = [r for n, rs in results.items() if n in names_in for r in rs if r["dtype"] == dtype and "logprob_error" in r]
        if cases:
            lines.append(f"{dtype}, {which}: largest log-prob error {max(r['logprob_error'] for r in cases):.1e}, largest "
                         f"gradient error {max(r['grad_error'] for r in cases):.1e} (over every case that ran to the end)")  # fmt: skip
    print("\n".join(lines[-4:]), flush=True)
    return lines


if __name__ == "__main__":
    torch.set_num_threads(1)
    matrix(sys.argv[1:] or list(FAMILIES))
