"""Tree-packed forward/backward equals running every sequence on its own (fp32), on several model families."""

import copy
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.tiny_models import VOCAB, build
from support.trees import BRANCHY, NESTED, attention_and_grads, reference_logprobs
from transformers import AutoModelForCausalLM

from lightning_rl.attention import tree_attention
from lightning_rl.attention.tree_attention import TreeAttentionMeta, attend_tree, choose_backend, enable_tree_attention, tree_blocks
from lightning_rl.ops.logprobs import LogitTransform, token_logprobs
from lightning_rl.ops.packed_forward import packed_logprobs
from lightning_rl.packing import pack_sequences


def assert_exact(model, seqs, masks=None, tol=1e-5):
    masks = masks or [[1] * len(s) for s in seqs]
    ref_model = copy.deepcopy(model)
    batch = pack_sequences(seqs, masks)
    packed = packed_logprobs(model, batch, chunk_size=7)  # a chunk size that does not divide the tokens
    ref = reference_logprobs(ref_model, seqs, masks)
    torch.testing.assert_close(packed, ref, atol=tol, rtol=0)
    torch.testing.assert_close(packed.sum(), ref.sum(), atol=tol * len(ref), rtol=0)
    (packed.sum() * 0.5).backward()
    (ref.sum() * 0.5).backward()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        ours = p.grad if p.grad is not None else torch.zeros_like(p)
        ref_grad = q.grad if q.grad is not None else torch.zeros_like(q)
        # relative error, with a floor for gradients that are zero in exact arithmetic (fp32 noise ~1e-7)
        err = (ours - ref_grad).norm()
        assert err <= tol * ref_grad.norm() + 1e-6, f"{name}: gradient error {err:.2e} (norm {ref_grad.norm():.2e})"
    return batch


@st.composite
def forests(draw):
    tok = st.integers(3, VOCAB - 1)
    seqs = [draw(st.lists(tok, min_size=2, max_size=10))]
    for _ in range(draw(st.integers(0, 5))):
        base = draw(st.sampled_from(seqs))
        cut = draw(st.integers(0, len(base)))  # 0: a new root; len(base): extends or repeats it
        seqs.append(base[:cut] + draw(st.lists(tok, min_size=0 if cut >= 2 else 2 - cut, max_size=6)))
    masks = [[draw(st.booleans()) for _ in s] for s in seqs]
    return seqs, masks


@pytest.fixture(scope="module")
def qwen3():
    return build("qwen3")


@settings(max_examples=40, deadline=None)
@given(forests())
def test_random_forests_exact_qwen3(qwen3, forest):
    seqs, masks = forest
    qwen3.zero_grad(set_to_none=True)
    assert_exact(qwen3, seqs, masks)


# Muse Spark scales q.k by 5.47 and routes through grouped expert matmuls (no fp64 kernel to check against):
# its fp32 gradients differ from the unpacked ones by ~1.3e-5 relative, the summation-order noise of those ops.
@pytest.mark.parametrize("family,tol", [("qwen3", 1e-5), ("llama", 1e-5), ("mistral_sliding", 1e-5), ("muse_spark", 3e-5)])
def test_nested_forks_exact(family, tol):
    model = build(family)
    batch = assert_exact(model, NESTED, tol=tol)
    assert batch.num_unique_tokens < batch.num_flat_tokens


def test_sliding_window_counts_distance_along_the_path():
    # Window 3 on branches of 10+ tokens: the self blocks get a band, and the subtrees below segments see only
    # suffixes of them (queries grouped by depth), so both kinds of block are cut by the window.
    model = build("mistral_sliding")
    meta = TreeAttentionMeta.from_batch(pack_sequences(NESTED))
    assert any(call.mask is not None for call in meta.plan(3, torch.float32) if not call.merge)
    spans, levels = tree_blocks(meta.segments, meta.depth, 3)
    assert any(ks not in {s for s, _ in spans} for blocks in levels for _, ks, _ in blocks)
    assert_exact(model, NESTED)


def test_branch_isolation_is_bit_exact(qwen3):
    # Changing the tokens of one branch (same lengths, same place in the layout) leaves the others untouched.
    seqs = [s[:] for s in NESTED]
    base = packed_logprobs(qwen3, pack_sequences(seqs)).detach()
    seqs[2] = seqs[2][:7] + [v + 1 for v in seqs[2][7:]]  # branch B after its fork: 31,32,.. -> 32,33,..
    changed = pack_sequences(seqs)
    other = changed.loss_seq != 2
    again = packed_logprobs(qwen3, changed).detach()
    assert torch.equal(again[other], base[other])
    assert not torch.equal(again[~other], base[~other])


def assert_matches_dense(batch, meta, windows=(None, 3)):
    """Output and q/k/v gradients of ``meta``'s backend against the dense mask, grouped-query heads."""
    torch.manual_seed(0)
    dense = TreeAttentionMeta.from_batch(batch, backend="dense")
    n = batch.num_tokens
    q, k, v, grad_out = (torch.randn(1, n, h, 8).transpose(1, 2) for h in (4, 2, 2, 4))  # the projections' layout
    for window in windows:
        ours, ref = attention_and_grads(meta, q, k, v, grad_out, window), attention_and_grads(dense, q, k, v, grad_out, window)
        for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=lambda m: f"window {window}, {name}: {m}")




@pytest.mark.parametrize("seqs,pad", [(NESTED, None), (NESTED, 16), (BRANCHY, None)])
def test_blocks_backend_matches_dense(seqs, pad):
    # Segments of different lengths share padded kernel calls, equal ones are read as strided views.
    batch = pack_sequences(seqs, pad_to_multiple_of=pad)
    assert_matches_dense(batch, TreeAttentionMeta.from_batch(batch, backend="blocks"), windows=(None, 2, 3, 6))


def emulated_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False):
    """torch's ``varlen_attn`` on CPU: one call of the CPU SDPA kernel per sequence. Same signature and outputs
    (lse [H, T]); the window is bottom-right aligned, as the flash kernel does."""
    outs, lses = [], []
    for q, k, v, mask in _sequences(query, key, value, cu_seq_q, cu_seq_k, window_size):
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    out, lse = torch.cat(outs), torch.cat(lses, dim=1)
    return (out, lse) if return_aux is not None and return_aux.lse else out


def emulated_varlen_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, rng_state, scale=None, window_size=None):
    """The backward op of ``varlen_attn`` on CPU, with the signature of ``torch.ops.torch_attn._varlen_attn_backward``."""
    grads = ([], [], [])
    per_query = list(zip(_split(grad_out, cu_seq_q), _split(out, cu_seq_q), lse.split(cu_seq_q.diff().tolist(), dim=1)))
    for (q, k, v, mask), (g, o, l) in zip(_sequences(query, key, value, cu_seq_q, cu_seq_k, window_size), per_query):
        parts = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, o, l[None], 0.0, False, attn_mask=mask, scale=scale)
        for acc, part in zip(grads, parts):
            acc.append(part[0].transpose(0, 1))
    return tuple(torch.cat(acc) for acc in grads)


def _split(x, cu):
    return [part.transpose(0, 1)[None] for part in x.split(cu.diff().tolist())]


def _sequences(query, key, value, cu_q, cu_k, window_size):
    left, right = window_size
    for q, k, v in zip(_split(query, cu_q), _split(key, cu_k), _split(value, cu_k)):
        i, j = torch.arange(q.shape[2])[:, None] + k.shape[2] - q.shape[2], torch.arange(k.shape[2])[None, :]
        visible = ((j <= i + right) if right >= 0 else True) & ((j >= i - left) if left >= 0 else True)
        mask = None if visible is True else torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
        yield q, k, v, mask


def varlen_meta(batch):
    """A ``varlen`` meta on CPU (``from_batch`` refuses it there: the real kernel is CUDA-only)."""
    return TreeAttentionMeta([tuple(s) for s in batch.segments.tolist()], batch.position_ids, batch.subtree_end, backend="varlen")


def emulated_varlen():
    return mock.patch.object(tree_attention, "_varlen_kernels", lambda: (emulated_varlen_attn, emulated_varlen_backward))


@pytest.mark.parametrize("seqs,pad", [(NESTED, None), (NESTED, 16), (BRANCHY, None)])
def test_varlen_backend_plan_against_an_emulated_kernel(seqs, pad):
    # The real varlen kernel is CUDA-only and is NOT run here. What runs is everything around it: the cu_seqlens and
    # gathered rows of each call, the log-sum-exp merge and the backward through it, with a CPU emulation of
    # varlen_attn and of its backward op in place of the kernel.
    batch = pack_sequences(seqs, pad_to_multiple_of=pad)
    meta = varlen_meta(batch)
    with emulated_varlen():
        assert_matches_dense(batch, meta, windows=(None, 2, 3, 6))
    calls = meta.plan(None, torch.float32)
    assert len(calls) == 1 + len(tree_blocks(meta.segments, meta.depth, None)[1])  # one self call, one per level


@settings(max_examples=30, deadline=None)
@given(forests(), st.sampled_from([None, 1, 2, 4]))
def test_kernel_backends_match_dense_on_random_forests(forest, window):
    batch = pack_sequences(forest[0])
    assert_matches_dense(batch, TreeAttentionMeta.from_batch(batch, backend="blocks"), windows=(window,))
    with emulated_varlen():  # the CPU emulation again: the varlen kernel itself is not run here
        assert_matches_dense(batch, varlen_meta(batch), windows=(window,))


def test_varlen_is_chosen_only_when_asked_and_only_on_cuda():
    assert choose_backend("auto", torch.device("cuda")) == "flex"
    assert choose_backend("varlen", torch.device("cuda")) == "varlen"
    with pytest.raises(ValueError, match="CUDA"):
        choose_backend("varlen", torch.device("cpu"))
    # A run asking for a kernel its device has none of was a traceback (flex at 64-true: Inductor's, deep in the forward).
    from lightning_rl.errors import RecipeError

    # flex on a CPU trains in no dtype (no backward: a 200-line traceback at the first step, at 32-true too).
    for dtype, training in ((torch.float64, False), (torch.float32, True)):
        with pytest.raises(RecipeError, match=r"^attention_backend: 'flex' has no backward on a CPU .* use 'blocks'$") as refused:
            choose_backend("flex", torch.device("cpu"), dtype=dtype, training=training)
        assert refused.value.key == "attention_backend"
    assert choose_backend("flex", torch.device("cpu"), dtype=torch.float32) == "flex"  # a forward alone runs (the next test)
    # Where shapes must be static, a kernel whose shapes follow each row's tree compiled a graph per row: refused.
    for backend, device in (("blocks", "cpu"), ("blocks", "xla"), ("flex", "xla")):
        with pytest.raises(RecipeError, match=rf"^attention_backend: '{backend}' takes data-dependent shapes .* use 'auto'"):
            choose_backend(backend, torch.device(device), static_shapes=device == "cpu")
    assert choose_backend("dense", torch.device("cpu"), static_shapes=True) == choose_backend("auto", torch.device("cpu"), static_shapes=True) == "dense"


def test_flex_backend_forward_matches_on_cpu():
    # FlexAttention's CPU build has no backward; its compiled forward checks the block-sparse mask used on CUDA.
    torch.manual_seed(0)
    batch = pack_sequences(NESTED, pad_to_multiple_of=128)
    n = batch.num_tokens
    q, k, v = torch.randn(1, 4, n, 16), torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
    flex = attend_tree(q, k, v, TreeAttentionMeta.from_batch(batch, backend="flex"))
    dense = attend_tree(q, k, v, TreeAttentionMeta.from_batch(batch, backend="dense"))
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=0)


def test_loaded_through_from_pretrained(tmp_path):
    build("qwen3").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa", dtype=torch.float32)
    assert_exact(model, NESTED)
    assert model.config._attn_implementation == "tree"
    # Generation still works: without packed metadata the attention is plain causal SDPA.
    out = model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)


def test_unpackable_layers_are_refused():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, layer_types=["linear_attention", "full_attention"],
                             num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16)  # fmt: skip
    with pytest.raises(ValueError, match="linear_attention layers"):
        enable_tree_attention(Qwen3NextForCausalLM(config))


@pytest.mark.parametrize(
    "transform", [LogitTransform(), LogitTransform(softcap=5.0), LogitTransform(scale=0.3, softcap=2.0, temperature=0.7), LogitTransform(temperature=1.5)]
)
def test_chunked_logprobs_equal_plain(transform):
    torch.manual_seed(0)
    h = torch.randn(50, 16, requires_grad=True)
    w = torch.randn(300, 16, requires_grad=True)
    targets = torch.randint(0, 300, (50,))
    chunked = token_logprobs(h, w, targets, chunk_size=8, transform=transform)
    z = (h @ w.t()) * transform.scale
    if transform.softcap:
        z = transform.softcap * torch.tanh(z / transform.softcap)
    z = z / transform.temperature
    plain = torch.log_softmax(z, -1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(chunked, plain, atol=1e-5, rtol=0)
    g = torch.randn(50)
    gh, gw = torch.autograd.grad(chunked, (h, w), g)
    ph, pw = torch.autograd.grad(plain, (h, w), g)
    torch.testing.assert_close(gh, ph, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gw, pw, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("autocast", [False, True])
def test_16_bit_hidden_states_and_head_give_float32_logits_in_forward_and_backward(autocast):
    """bf16 weights and hidden states (bf16-true), or float32 ones under bf16 autocast (bf16-mixed): the logits were
    rounded to bf16 (2e-2 off in log-prob at logits past 20), and under autocast the backward recomputed them otherwise
    than the forward had. Both are now the float32 product of the inputs as given, forward and backward alike."""
    torch.manual_seed(0)
    dtype = torch.float32 if autocast else torch.bfloat16
    h = (torch.randn(40, 32) * 4).to(dtype).requires_grad_()
    w = torch.randn(500, 32).to(dtype).requires_grad_()
    targets = torch.randint(0, 500, (40,))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        chunked = token_logprobs(h, w, targets, chunk_size=8)
    logits = h.double() @ w.double().t()
    assert float(logits.abs().max()) > 20
    exact = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(chunked.double(), exact, atol=2e-4, rtol=0)
    g = torch.randn(40, dtype=torch.float64)
    got, want = torch.autograd.grad(chunked, (h, w), g.float()), torch.autograd.grad(exact, (h, w), g)
    tolerance = 1e-4 if autocast else 1e-2  # bf16 gradients hold 8 bits
    for mine, theirs in zip(got, want):
        torch.testing.assert_close(mine.double(), theirs.to(mine.dtype).double(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("family", ["qwen3", "mistral_sliding"])
def test_plain_calls_after_enabling_match_sdpa(family):
    # The same model keeps generating and scoring padded batches once tree attention is enabled.
    model = build(family)
    reference = copy.deepcopy(model)
    enable_tree_attention(model)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 10], [3, 4, 5, 6, 7, 8, 9, 10]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, reference(input_ids=ids, attention_mask=mask).logits)
        torch.testing.assert_close(model(input_ids=ids[1:]).logits, reference(input_ids=ids[1:]).logits)  # no mask at all


def test_temperature_divides_the_final_logits():
    model = build("qwen3")
    batch = pack_sequences(NESTED)
    with torch.no_grad():
        hot = packed_logprobs(model, batch, temperature=0.7)
        logits = [model(input_ids=torch.tensor([s])).logits[0] / 0.7 for s in NESTED]
    ref = torch.cat([torch.log_softmax(z[:-1], -1).gather(1, torch.tensor(s[1:])[:, None]).squeeze(1) for z, s in zip(logits, NESTED)])
    torch.testing.assert_close(hot, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["blocks", "dense"])
@pytest.mark.parametrize("dtype,mixed", [(torch.bfloat16, True), (torch.float16, True), (torch.bfloat16, False), (torch.float16, False)])
def test_low_precision_runs_on_every_cpu_backend(backend, dtype, mixed):
    # Under autocast (bf16-mixed, 16-mixed) a model may hand the attention fp32 queries beside low-precision values;
    # the kernels take one dtype. Low precision against the fp32 reference: close, and every gradient finite.
    model = build("mistral_sliding")
    ref = reference_logprobs(copy.deepcopy(model), NESTED, [[1] * len(s) for s in NESTED]).detach()
    batch = pack_sequences(NESTED)
    if mixed:
        with torch.autocast("cpu", dtype=dtype):
            packed = packed_logprobs(model, batch, attention_backend=backend)
    else:
        packed = packed_logprobs(model.to(dtype), batch, attention_backend=backend)
    torch.testing.assert_close(packed, ref, atol=1e-2, rtol=0)
    packed.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
