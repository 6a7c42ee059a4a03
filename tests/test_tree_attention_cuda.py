"""The CUDA tree-attention kernels (FlexAttention, torch's varlen flash kernels) against the dense reference.

These need a CUDA GPU and are skipped without one: on a CPU machine they have never run, and nothing here counts
for the CPU suite. On a GPU machine, run them first: ``python -m pytest -q tests/test_tree_attention_cuda.py``.
The CPU suite checks the same plans with the dense mask (``flex`` forward on the CPU, ``varlen`` with an emulated
kernel: ``tests/test_tree_attention.py``).
"""

import copy

import pytest
import torch

from lightning_rl.attention.tree_attention import TreeAttentionMeta
from lightning_rl.ops.packed_forward import packed_logprobs
from lightning_rl.packing import pack_sequences
from support.trees import BRANCHY, NESTED, attention_and_grads, reference_logprobs
from support.tiny_models import build

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA kernels: needs a CUDA GPU")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("backend,dtype,tol", [("flex", torch.float32, 1e-4), ("flex", torch.bfloat16, 3e-2), ("varlen", torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("seqs", [NESTED, BRANCHY])
@pytest.mark.parametrize("window", [None, 3])
def test_kernel_forward_and_backward_match_dense(backend, dtype, tol, seqs, window):
    batch = pack_sequences(seqs, pad_to_multiple_of=128 if backend == "flex" else None)
    n = batch.num_tokens
    torch.manual_seed(0)
    # Grouped-query heads, head dim 64, in the projections' layout [batch, heads, tokens, dim].
    q, k, v, grad_out = (torch.randn(1, h, n, 64, device=CUDA, dtype=dtype) for h in (8, 2, 2, 8))
    meta = TreeAttentionMeta.from_batch(batch, backend=backend, device=CUDA)
    dense = TreeAttentionMeta.from_batch(batch, backend="dense", device=CUDA)
    ours = attention_and_grads(meta, q, k, v, grad_out, window)
    ref = attention_and_grads(dense, *(x.float() for x in (q, k, v, grad_out)), window)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        torch.testing.assert_close(a.float(), b, atol=tol, rtol=tol, msg=lambda m: f"{backend} {name}: {m}")


@pytest.mark.parametrize("backend", ["flex", "varlen"])
def test_packed_model_matches_unpacked_on_cuda(backend):
    base = build("qwen3")
    with torch.no_grad():
        ref = reference_logprobs(base, NESTED, [[1] * len(s) for s in NESTED])  # fp32 on the CPU, each sequence alone
    model = copy.deepcopy(base).to(CUDA, torch.bfloat16)
    packed = packed_logprobs(model, pack_sequences(NESTED).to(CUDA), attention_backend=backend)
    torch.testing.assert_close(packed.float().cpu(), ref, atol=5e-2, rtol=0)
    packed.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
