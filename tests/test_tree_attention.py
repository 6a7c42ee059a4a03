"""Tree-packed forward/backward equals running every sequence on its own (fp32), on several model families."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import VOCAB, build
from transformers import AutoModelForCausalLM

from lightning_rl.attention.tree_attention import TreeAttentionMeta, attend_tree, enable_tree_attention
from lightning_rl.ops.logprobs import LogitTransform, packed_logprobs, token_logprobs
from lightning_rl.packing import pack_sequences


def reference_logprobs(model, seqs, masks):
    """Each sequence alone, through the model's own forward and logits."""
    out = []
    for s, m in zip(seqs, masks):
        logits = model(input_ids=torch.tensor([s])).logits[0].float()
        logp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(s[1:])[:, None]).squeeze(1)
        out.append(logp[torch.tensor(m[1:], dtype=torch.bool)])
    return torch.cat(out)


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


NESTED = [
    [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],  # system + user turn, answer A, then a tool turn ...
    [3, 4, 5, 6, 7, 8, 9, 10, 20, 21, 22, 23],  # ... that forks
    [3, 4, 5, 6, 7, 8, 30, 31, 32, 33, 34],  # answer B forks earlier
    [3, 4, 5, 6, 7, 8, 30, 31, 40, 41],  # and forks again (nested fork)
    [3, 4, 5, 6, 7, 8, 30, 31, 40, 41],  # identical rollout
    [50, 51],  # another prompt, no sharing
    [3, 60],  # single-token branch right after the root
]


# Muse Spark scales q.k by 5.47 and routes through grouped expert matmuls (no fp64 kernel to check against):
# its fp32 gradients differ from the unpacked ones by ~1.3e-5 relative, the summation-order noise of those ops.
@pytest.mark.parametrize("family,tol", [("qwen3", 1e-5), ("llama", 1e-5), ("mistral_sliding", 1e-5), ("muse_spark", 3e-5)])
def test_nested_forks_exact(family, tol):
    model = build(family)
    batch = assert_exact(model, NESTED, tol=tol)
    assert batch.num_unique_tokens < batch.num_flat_tokens


def test_sliding_window_counts_distance_along_the_path():
    # Window 3 on branches of 10+ tokens: both the self blocks and the ancestor blocks are cut by the window.
    model = build("mistral_sliding")
    meta = TreeAttentionMeta.from_batch(pack_sequences(NESTED))
    plan = meta.plan(3, torch.float32)
    assert any(mask is not None for *_, mask in plan)
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


def test_backends_agree_on_forward():
    torch.manual_seed(0)
    batch = pack_sequences(NESTED)
    meta = {b: TreeAttentionMeta.from_batch(batch, backend=b) for b in ("blocks", "dense")}
    n = batch.num_tokens
    q, k, v = torch.randn(1, 4, n, 8), torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)
    for window in (None, 3):
        torch.testing.assert_close(attend_tree(q, k, v, meta["blocks"], window=window), attend_tree(q, k, v, meta["dense"], window=window), atol=1e-6, rtol=0)


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
