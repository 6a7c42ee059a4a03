"""Every decoder family of the matrix in ``support/packing_families.py`` is exact under tree packing or refused with one
line naming the model class and the mechanism; none is silently wrong. fp32 and fp64, ``blocks`` and ``dense``."""

import re

import pytest
import torch

from support.packing_families import FAMILIES, TOLERANCE, measure, tolerance

from lightning_rl.attention.tree_attention import PackingRefused

NOT_ROUTED = r"0 of its 2 decoder layers applied the tree attention \(the others(, \w+ first,)? do not route their attention through transformers' attention interface\)"
STATEFUL = r"layers; tree packing needs every layer to be full or sliding-window attention"
# What each refused family is refused for: the mechanism, not only the fact.
REFUSED = {
    "llama_dynamic": r"LlamaForCausalLM: a packed row with positions up to 11 reaches 8, and its dynamic rope",
    "llama_longrope": r"LlamaForCausalLM: a packed row with positions up to 11 reaches 11, and its longrope rope",
    "phi3_longrope": r"Phi3ForCausalLM: a packed row with positions up to 11 reaches 11, and its longrope rope",
    "llama4_text": r"Llama4ForCausalLM has chunked_attention layers",
    "llama4_text_nochunk": r"Llama4ForCausalLM: a packed row with 25 tokens reaches 2, and its query temperature grows with the row index",
    "phimoe": r"PhimoeAttention is a sliding-window layer that passes no sliding_window to its attention \(the window lives in its mask only\)",
    "stablelm": r"StableLmAttention is called without the packed row's metadata \(its decoder layer does not pass keyword arguments on",
    "nemotron": r"NemotronAttention is called without the packed row's metadata",
    "gpt_oss": r"GptOssForCausalLM uses attention sinks",
    "moshi": r"MoshiAttention is a sliding-window layer that passes no sliding_window",  # it builds no window: over-cautious
    "bart": r"BartForCausalLM: the packing self-check measured packed log-probs \d\.\d\de-\d\d away from each sequence run alone",
    "bert": r"BertSelfAttention is bidirectional \(not causal\)",
    "doge": r"DogeAttention passes an attention mask in a packed forward",
    "dory": r"DoryForCausalLM: the output head is a DoryLMHead with its own logit_scale",
    "granite_swa": r"GraniteSWAForCausalLM uses attention sinks",
    "blenderbot": r"BlenderbotForCausalLM: the packing self-check measured packed log-probs \d\.\d\de-\d\d away from each sequence run alone",
    **{f: NOT_ROUTED for f in ("gpt_neo", "bloom", "falcon_alibi", "falcon_rotary", "mpt", "xglm", "rwkv", "openai-gpt")},
    **{f: STATEFUL for f in ("qwen3_next", "qwen3_5_text", "nemotron_h", "granitemoehybrid", "jamba", "minimax", "mamba", "bamba", "zamba2", "lfm2_conv", "falcon_h1")},
}
# Families whose own code has no fp64 path (the model fails on one sequence alone, packing aside).
NO_FP64 = {"xglm"}


@pytest.mark.parametrize("backend", ["blocks", "dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_is_exact_or_refused(family, dtype, backend):
    result = measure(family, dtype, backend)
    if dtype == torch.float64 and family in NO_FP64:
        assert result["status"] == "model fails", result
        return
    if family in REFUSED:
        assert result["status"] == "refused", result
        assert re.search(REFUSED[family], result["message"]), result["message"]
        assert "\n" not in result["message"]
        return
    assert result["status"] in ("exact", "WRONG"), result  # never a crash
    logprob_tol, grad_tol = tolerance(family, dtype)
    assert result["logprob_error"] <= logprob_tol, result
    assert result["grad_error"] <= grad_tol, result


def test_the_matrix_covers_every_attention_style():
    model_types = {model_type for model_type, _ in FAMILIES.values()}
    styles = {
        "rotary": {"llama", "qwen3"}, "alibi": {"bloom", "mpt"}, "learned absolute positions": {"gpt2", "opt"},
        "local attention": {"gpt_neo"}, "moe": {"mixtral", "qwen3_moe"}, "mla": {"deepseek_v3"},
        "soft-capped": {"gemma2"}, "sliding window by keyword": {"mistral", "gemma3_text"}, "sliding window by mask": {"phimoe"},
        "recurrent hybrids": {"jamba", "mamba", "nemotron_h"}, "linear-attention hybrids": {"qwen3_next", "qwen3_5_text"},
        "attention sinks": {"gpt_oss", "granite_swa"}, "nope and temperature": {"llama4_text", "smollm3"},
    }  # fmt: skip
    for style, types in styles.items():
        assert types <= model_types, style
    assert len(FAMILIES) >= 90


@pytest.mark.parametrize("family", ["llama_dynamic", "llama_longrope", "phi3_longrope", "llama4_text_nochunk"])
def test_a_row_of_one_sequence_past_the_row_limit_is_that_sequence_alone(family):
    """A length-dependent rope (or Llama 4's row-indexed temperature) refuses rows of several sequences that reach its
    limit; a row of one sequence is that sequence as the model computes it alone (``packing: none``), so it runs."""
    from support.packing_families import build, reference_logprobs

    from lightning_rl.ops.packed_forward import packed_logprobs
    from lightning_rl.packing.tree import pack_sequences

    model = build(family)
    sequence = [[3 + (7 * i) % 50 for i in range(30)]]
    packed = packed_logprobs(model, pack_sequences(sequence), chunk_size=7, attention_backend="blocks")
    torch.testing.assert_close(packed.detach(), reference_logprobs(model, sequence).detach(), rtol=0, atol=TOLERANCE[torch.float32][0])
    with pytest.raises(PackingRefused, match="reaches"):
        packed_logprobs(model, pack_sequences([*sequence, sequence[0][:12]]), chunk_size=7, attention_backend="blocks")



@pytest.mark.parametrize("family", ["llama_longrope", "phi3_longrope"])
def test_a_longrope_row_whose_longest_path_is_the_original_length_is_packed_exactly(family):
    """Longrope keeps its short factors for a forward of exactly its original length (10 here): such a row was refused."""
    from support.packing_families import build, reference_logprobs

    from lightning_rl.ops.packed_forward import packed_logprobs
    from lightning_rl.packing.tree import pack_sequences

    model = build(family)
    sequences = [[3 + (7 * i) % 50 for i in range(10)], [5, 9, 11, 4, 2], [8, 1]]
    packed = packed_logprobs(model, pack_sequences(sequences), chunk_size=7, attention_backend="blocks")
    torch.testing.assert_close(packed.detach(), reference_logprobs(model, sequences).detach(), rtol=0, atol=TOLERANCE[torch.float32][0])
    with pytest.raises(PackingRefused, match="positions up to 10 reaches 11"):
        packed_logprobs(model, pack_sequences([[*sequences[0], 6], *sequences[1:]]), chunk_size=7, attention_backend="blocks")


@pytest.mark.parametrize("model_type,key,others", [("gpt2", "attn_pdrop", ()), ("gpt2", "attn_pdrop", ("resid_pdrop", "embd_pdrop")),
                                                   ("llama", "attention_dropout", ())])  # fmt: skip
def test_attention_dropout_is_refused_naming_the_config_key_that_holds_it(model_type, key, others):
    """GPT-2 keeps it in ``attn_pdrop``: the line told its users to set ``attention_dropout``, which changed nothing,
    and with its default config (every dropout 0.1) ``resid_pdrop``, which holds the same value."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from support.packing_families import build_config

    from lightning_rl.ops.packed_forward import packed_logprobs
    from lightning_rl.packing.tree import pack_sequences

    model = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])(build_config(model_type, dict.fromkeys((key, *others), 0.25))).train()
    with pytest.raises(PackingRefused, match=rf"applies attention dropout 0.25; tree attention does not: set the model's {key} to 0"):
        packed_logprobs(model, pack_sequences([[3, 4, 5, 6], [3, 4, 7]]), chunk_size=7, attention_backend="blocks")
