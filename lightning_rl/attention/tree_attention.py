"""Tree attention: each token of a packed prefix tree attends exactly to its ancestors.

Registered as ``"tree"`` in transformers' public attention interface, so any decoder that routes its attention
through ``ALL_ATTENTION_FUNCTIONS`` runs packed trees unchanged. The packed row's metadata arrives as the
``tree_attention`` keyword of ``model(...)``; without it the function is plain causal SDPA, so the same model
still generates.

Backends (``TreeAttentionMeta.backend``):

- ``"blocks"`` (CPU): the tree is cut into chain segments (``tree_blocks``). A segment's queries attend causally
  to the segment itself, and the whole subtree below a segment (a contiguous interval in depth-first order)
  attends to that segment's keys with no mask at all. Blocks of about one shape share one call of the CPU flash
  kernel, right-padded into a [blocks, H, length, D] batch: self blocks of about one length in one causal call
  (valid queries never see the padded keys), the ancestor blocks of one level (their queries are disjoint) in
  one call with padded keys masked. Each call merges into the output through its log-sum-exp, and the backward
  reuses the kernel's own backward with the merged output and log-sum-exp (as ring attention does). The index
  tensors are built once per row and shared by every layer; evenly spaced rows are read as strided views,
  others gathered. Under a sliding window a query sees a suffix of each ancestor segment, so queries are
  grouped by that suffix and still no ancestor block needs a mask. Work grows with (query, ancestor key) pairs,
  saved memory with unique tokens: K/V are never gathered per path.
- ``"varlen"`` (CUDA, fp16/bf16, chosen only when asked): the same blocks through torch's varlen flash kernel
  (``torch.nn.attention.varlen``), with nothing padded: one causal call whose sequences are the segments
  (cu_seqlens at the segment starts, a sliding window as the kernel's own), then one call per level over the
  (subtree queries gathered, segment keys) pairs, merged by log-sum-exp as above. ``varlen_attn``'s autograd drops
  the gradient of the lse it returns, so its registered backward op is called directly with the merged output
  and lse. Gathered queries live for one call only, at most one copy of each row per level. The planning runs on
  CPU in tests against an emulation of the kernel; the kernel itself is not run or measured here, so ``auto`` keeps
  FlexAttention on CUDA.
- ``"flex"`` (CUDA): FlexAttention with a block-sparse mask built from ``subtree_end``; the same pairs, fused.
- ``"dense"``: one SDPA call with an N x N boolean mask built from ``subtree_end`` by tensor ops only. The
  reference in tests, and the path for XLA / Neuron, where a kernel call per segment would give every new row
  a new graph; there, rows are padded to fixed lengths and the mask costs N^2 memory.
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from lightning_rl.device_policy import STATIC_SHAPE_DEVICE_TYPES
from lightning_rl.errors import RecipeError, UserError
from lightning_rl.packing.tree import PackedBatch

ATTENTION_NAME = "tree"
AttentionBackend = Literal["auto", "blocks", "varlen", "flex", "dense"]
BACKENDS = ("auto", "blocks", "varlen", "flex", "dense")
# Layer kinds a packed row computes exactly: attention (full or windowed) and layers that work token by token.
_PACKABLE_LAYER_TYPES = {"full_attention", "sliding_attention", "mlp", "moe"}

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def choose_backend(
    requested: str, device: torch.device, *, static_shapes: bool = False, dtype: torch.dtype | None = None, training: bool = False,
) -> str:
    """``auto``: FlexAttention on CUDA, the shape-only dense path where shapes must be static (XLA, Neuron, or a
    strategy that rehearses them), the block path elsewhere. Anything else is taken as given, where it runs: a kernel
    the device (or the weights' ``dtype`` there, or ``training``: its backward) has none of is one line naming
    ``attention_backend``."""
    if requested not in BACKENDS:
        raise RecipeError(f"attention_backend {requested!r} is not one of {', '.join(BACKENDS)}", "attention_backend")
    if requested == "varlen" and device.type != "cuda":
        raise RecipeError(f"attention_backend: 'varlen' runs torch's CUDA varlen kernel; on {device.type} use 'blocks'", "attention_backend")
    if requested == "flex" and device.type == "cpu" and (training or dtype == torch.float64):
        raise RecipeError("attention_backend: 'flex' has no backward on a CPU (torch's FlexAttention) and computes in float32, float16 "
                          "and bfloat16 only there, so it cannot train on one; use 'blocks'", "attention_backend")
    if requested not in ("auto", "dense") and (static_shapes or device.type in STATIC_SHAPE_DEVICE_TYPES):
        raise RecipeError(f"attention_backend: {requested!r} takes data-dependent shapes (a new compiled graph per row's tree) where "
                          "shapes must be static (XLA, Neuron, cpu_static); use 'auto' (the shape-only 'dense')", "attention_backend")
    if requested != "auto":
        return requested
    if static_shapes or device.type in STATIC_SHAPE_DEVICE_TYPES:
        return "dense"
    return "flex" if device.type == "cuda" else "blocks"


class _RowState:
    """What every layer of one row shares: kernel plans, block masks, and which attention modules applied the row.
    A plain object on purpose: FSDP's input casting rebuilds dataclasses, dicts and sets field by field, so state
    kept in them directly would be copied per layer, and what one layer records would be lost to the others."""

    def __init__(self) -> None:
        self.plans: dict = {}
        self.block_masks: dict = {}
        self.layers_called: set[int] = set()
        self.prefix_taken: set[int] = set()  # attention modules that took their prefix keys and values
        # A prefix's own forward: each attention call appends (module id, key, value) here, those of the prefixes it
        # continues (a nested one's) joined in front.
        self.capture: list[tuple[int, Tensor, Tensor]] | None = None


@dataclass
class TreeAttentionMeta:
    """What the attention needs to know about a packed row (built once per row, shared by every layer)."""

    segments: list[tuple[int, int, int]]
    depth: Tensor  # [N] position ids (depth along the path)
    subtree_end: Tensor  # [N]
    backend: str = "blocks"
    model_name: str = "the model"  # for refusals
    shared: _RowState = field(default_factory=lambda: _RowState(), repr=False)
    # [N] per token: the block of tokens it also attends to ahead of it (an image's tokens in a model whose image
    # tokens attend to each other both ways), -1 outside any. A block lies on one path, so every branch sees it whole.
    both_ways: Tensor | None = None
    # A row that continues a prefix forwarded on its own (``ops/prefix_rows.py``): the first ``prefix_len`` tokens of
    # this tree are that prefix, one chain above every other token, present only as the keys and values its forward
    # captured (``prefix_kv``: attention module id -> (key, value)); queries are the row's own.
    prefix_len: int = 0
    prefix_kv: dict[int, tuple[Tensor, Tensor]] | None = None

    @classmethod
    def from_batch(
        cls, batch: PackedBatch, *, backend: str = "auto", device: torch.device | None = None, model_name: str = "the model",
        both_ways: Tensor | None = None,
    ) -> TreeAttentionMeta:
        """``both_ways``: see the field; its rows run on the masked backends (``flex`` on CUDA, ``dense`` elsewhere)."""
        device = device or batch.input_ids.device
        chosen = choose_backend(backend, device)
        if both_ways is not None and chosen in ("blocks", "varlen"):
            chosen = "flex" if device.type == "cuda" else "dense"  # the block kernels compute causal attention only
        return cls(
            segments=[tuple(s) for s in batch.segments.tolist()],
            depth=batch.position_ids.to(device),
            subtree_end=batch.subtree_end.to(device),
            backend=chosen,
            model_name=model_name,
            both_ways=None if both_ways is None else both_ways.to(device),
        )

    def after_prefix(self, prefix_len: int, prefix_kv: dict[int, tuple[Tensor, Tensor]]) -> TreeAttentionMeta:
        """This row's tree below a chain of ``prefix_len`` tokens whose keys and values are ``prefix_kv``: the same
        ancestor relation as the whole tree packed in one row, the prefix's queries left out."""
        if self.backend == "varlen" or self.both_ways is not None:
            raise PackingRefused(f"{self.model_name}: a row continuing a prefix forwarded apart runs the blocks, flex or dense tree attention only, "
                                 "without image blocks; set model.prefix_across_rows: never")
        p, n, device = prefix_len, self.num_tokens, self.depth.device
        segments = [(0, p, p + n)] + [(s + p, e + p, se + p) for s, e, se in self.segments]
        return TreeAttentionMeta(
            segments=segments,
            depth=torch.cat([torch.arange(p, device=device), self.depth]),
            subtree_end=torch.cat([torch.full((p,), p + n, device=device), self.subtree_end + p]),
            backend=self.backend,
            model_name=self.model_name,
            prefix_len=p,
            prefix_kv=prefix_kv,
        )

    def prefix_keys_values(self, module: nn.Module, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """The prefix's keys and values of this attention module joined in front of the row's own (by module, so a
        layer recomputed in backward takes them again)."""
        if id(module) not in self.prefix_kv:
            raise PackingRefused(f"{self.model_name}: {type(module).__name__} attends in a row but did not in its prefix's forward; it has no prefix keys and values")
        self.shared.prefix_taken.add(id(module))
        pk, pv = self.prefix_kv[id(module)]
        return torch.cat([pk.to(key.dtype), key], dim=2), torch.cat([pv.to(value.dtype), value], dim=2)

    @property
    def layers_called(self) -> set[int]:
        return self.shared.layers_called

    @property
    def num_tokens(self) -> int:
        return int(self.depth.numel())

    def plan(self, window: int | None, dtype: torch.dtype) -> list[_PaddedCall] | list[_VarlenCall]:
        """The kernel calls of the ``blocks`` or ``varlen`` backend for one sliding window, in order."""
        key = (window, dtype)
        if key not in self.shared.plans:
            spans, levels = tree_blocks(self.segments, self.depth.cpu(), window)
            spans = spans[1:] if self.prefix_len else spans  # the prefix's queries are not computed here
            n, device = self.num_tokens, self.depth.device
            if self.backend == "varlen":
                self.shared.plans[key] = _varlen_calls(spans, levels, n, window, device)
            else:
                self.shared.plans[key] = _padded_calls(spans, levels, n, window, dtype, device)
        return self.shared.plans[key]

    def dense_mask(self, window: int | None) -> Tensor:
        i = torch.arange(self.num_tokens, device=self.depth.device)
        mask = (i[None, :] <= i[:, None]) & (i[:, None] < self.subtree_end[None, :])
        if window is not None:
            mask &= (self.depth[:, None] - self.depth[None, :]) < window
        if self.both_ways is not None:
            mask |= (self.both_ways[:, None] == self.both_ways[None, :]) & (self.both_ways[:, None] >= 0)
        return mask


AncestorBlock = tuple[Tensor, int, int]  # (query rows, first key row, end of the keys)


def tree_blocks(segments, depth: Tensor, window: int | None) -> tuple[list[tuple[int, int]], list[list[AncestorBlock]]]:
    """The block decomposition of the kernel backends. Every segment attends causally to itself (its span, within
    which depth grows by one per token, so a window is a band there); the subtree below a segment attends to the
    segment's keys with no mask. Ancestor blocks are grouped by level (the number of segments above the key
    segment): blocks of one level have disjoint queries, so one kernel call can merge them all. Under a window a
    query at depth d sees the keys deeper than d - window, a suffix of the segment: queries are grouped by the
    suffix they see, so no block needs a mask."""
    spans, levels, open_ends = [], [], []
    for start, end, sub_end in segments:
        spans.append((start, end))
        while open_ends and open_ends[-1] <= start:
            open_ends.pop()
        if sub_end == end:
            continue
        if len(open_ends) == len(levels):
            levels.append([])
        blocks = levels[len(open_ends)]
        open_ends.append(sub_end)
        queries = torch.arange(end, sub_end)
        if window is None:
            blocks.append((queries, start, end))
            continue
        first = (depth[end:sub_end] - depth[start] - window + 1).clamp_(min=0)
        for f in first.unique().tolist():
            if start + f < end:
                blocks.append((queries[first == f], start + f, end))
    return spans, levels


@dataclass
class _Rows:
    """The rows of the packed row behind a kernel call's [batch, length] query (or key) positions. Evenly spaced runs
    of rows (equal-length segments side by side, or at a fixed distance) are read and written as strided views;
    anything else is gathered, with padding read as zeros and written to the scratch row N."""

    batch: int
    length: int
    put: Tensor  # [batch * length] row written from each position
    take: Tensor | None  # row read at each position (padding reads row 0); None for evenly spaced runs
    pad: Tensor | None  # padded positions
    first: int  # evenly spaced runs: the first row and the distance between runs
    stride: int

    @classmethod
    def build(cls, blocks: list[Tensor], scratch: int, device) -> _Rows:
        """The rows of each block (on the host), right-padded to the longest."""
        batch, length = len(blocks), max(len(r) for r in blocks)
        valid = torch.arange(length) < torch.tensor([len(r) for r in blocks])[:, None]
        runs = torch.zeros(batch, length, dtype=torch.long)
        runs[valid] = torch.cat(blocks)
        rows, valid = runs.flatten().to(device), valid.flatten().to(device)
        if not bool(valid.all()):
            pad = torch.nonzero(~valid).flatten()
            return cls(batch, length, rows.masked_fill(~valid, scratch), rows.masked_fill(~valid, 0), pad, 0, 0)
        first, stride = int(runs[0, 0]), (int(runs[1, 0] - runs[0, 0]) if batch > 1 else length)
        if stride >= length and torch.equal(runs, first + stride * torch.arange(batch)[:, None] + torch.arange(length)):
            return cls(batch, length, rows, None, None, first, stride)
        return cls(batch, length, rows, rows, None, 0, 0)

    def _view(self, x: Tensor) -> Tensor:
        span = (self.batch - 1) * self.stride + self.length
        return x.narrow(0, self.first, span).unfold(0, self.length, self.stride).movedim(-1, 1)

    def gather(self, x: Tensor) -> Tensor:
        """``x`` [rows, ...] -> [batch, length, ...], padding zeroed."""
        if self.take is None:
            return self._view(x)
        picked = x.index_select(0, self.take)
        if self.pad is not None:
            picked.index_fill_(0, self.pad, 0)
        return picked.unflatten(0, (self.batch, self.length))

    def read(self, x: Tensor) -> Tensor:
        """Like ``gather``, from a buffer with the scratch row (which padding reads)."""
        return self._view(x) if self.take is None else x.index_select(0, self.put).unflatten(0, (self.batch, self.length))

    def write(self, x: Tensor, values: Tensor) -> None:
        if self.take is not None:
            x.index_copy_(0, self.put, values.flatten(0, 1))
        elif values.data_ptr() != (view := self._view(x)).data_ptr():  # values read as a view of x are in place
            view.copy_(values)

    def accumulate(self, x: Tensor, values: Tensor) -> None:
        if self.take is None:
            self._view(x).add_(values)
        else:
            x.index_add_(0, self.put, values.flatten(0, 1))


class _TreeAttention(torch.autograd.Function):
    """Kernel calls over (query rows, key rows) blocks, merged by log-sum-exp; the backward runs each call's kernel
    backward with the merged output and log-sum-exp (as ring attention does).

    Works on rows: q [1, Hq, N, D] is read as [N, Hq, D], the layout the model's projections produce, and the
    output is returned in it, so the caller's transpose back is free. K/V heads are never repeated: the kernels
    take grouped-query heads as they are, and what is saved for the backward is the row's own q, k, v.
    Self calls come first and tile the row (keys included), so they initialise every row of the output and of
    the gradients; ancestor calls merge into the rows they cover. Buffers have one scratch row, N, for padding.
    """

    @staticmethod
    def forward(ctx, q, k, v, calls, scale, uncovered):
        n, hq, d = q.shape[2], q.shape[1], q.shape[3]
        qr, kr, vr = _rows(q), _rows(k), _rows(v)
        acc = _accumulation_dtype(q.dtype)
        out = q.new_empty(n + 1, hq, d, dtype=acc)
        lse = q.new_empty(n + 1, hq, dtype=acc)
        for call in calls:
            rq, rk = call.q, call.k
            o, l = call.forward(rq.gather(qr), rk.gather(kr), rk.gather(vr), scale)
            o, l = o.to(acc), l.to(acc)
            if not call.merge:
                rq.write(out, o)
                rq.write(lse, l)
                continue
            prev = rq.read(lse)
            new = torch.logaddexp(prev, l)
            merged = rq.read(out).mul_((prev - new).exp_().unsqueeze(-1)).addcmul_(o, (l - new).exp_().unsqueeze(-1))
            rq.write(out, merged)
            rq.write(lse, new)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.calls, ctx.scale, ctx.uncovered = calls, scale, uncovered
        return out[:n].unsqueeze(0).transpose(1, 2)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        n = q.shape[2]
        gr, qr, kr, vr = _rows(grad_out), _rows(q), _rows(k), _rows(v)
        acc = _accumulation_dtype(q.dtype)
        # Rows no self call covers (a prefix's, whose queries are not computed) are only added to: they start at 0.
        new = torch.zeros if ctx.uncovered else torch.empty
        dq = new(n + 1, *qr.shape[1:], dtype=acc, device=q.device)
        dk = new(n + 1, *kr.shape[1:], dtype=acc, device=k.device)
        dv = new(n + 1, *vr.shape[1:], dtype=acc, device=v.device)
        for call in ctx.calls:
            rq, rk = call.q, call.k
            inputs = (rq.gather(gr), rq.gather(qr), rk.gather(kr), rk.gather(vr), rq.gather(out), rq.gather(lse))
            gq, gk, gv = call.backward(*inputs, ctx.scale)
            for rows, buf, g in ((rq, dq, gq), (rk, dk, gk), (rk, dv, gv)):
                (rows.accumulate if call.merge else rows.write)(buf, g.to(acc))
        grads = [g[:n].to(x.dtype).unsqueeze(0).transpose(1, 2) for g, x in ((dq, q), (dk, k), (dv, v))]
        return *grads, None, None, None


def _rows(x: Tensor) -> Tensor:
    return x[0].transpose(0, 1)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Partial results merge in fp32, or in fp64 for fp64 inputs (the noise-free reference of the tests)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class _PaddedCall:
    """Blocks of about one shape, right-padded to a common number of queries and keys: one call of the CPU flash
    kernel on [blocks, H, length, D]. A self call is causal, so its valid queries never see padded keys; padded
    queries read zeros (so their gradient is zero) and are written to the scratch row."""

    q: _Rows
    k: _Rows
    causal: bool
    mask: Tensor | None  # additive: a window band [L, L] for self calls, padded keys [B, 1, 1, Lk] otherwise
    merge: bool

    def forward(self, q, k, v, scale):
        o, lse = _flash_cpu(*(x.transpose(1, 2) for x in (q, k, v)), 0.0, self.causal, attn_mask=self.mask, scale=scale)
        return o.transpose(1, 2), lse.transpose(1, 2)

    def backward(self, grad_out, q, k, v, out, lse, scale):
        inputs = (x.transpose(1, 2) for x in (grad_out, q, k, v, out, lse))
        grads = _flash_cpu_backward(*inputs, 0.0, self.causal, attn_mask=self.mask, scale=scale)
        return tuple(g.transpose(1, 2) for g in grads)


# A block joins a padded call while the padding adds no more (query, key) pairs than this: about what the overhead
# of one more call costs in the kernel (its own calls, gathers and merges). Batching pays for small blocks; big ones
# of different lengths keep their own calls.
_PAD_FREE_PAIRS = 64 * 64


def _buckets(shapes: list[tuple[int, int]]) -> list[list[int]]:
    """Indices of ``shapes`` (query length, key length) grouped into padded calls, largest first."""
    groups: list[list[int]] = []
    order = sorted(range(len(shapes)), key=lambda i: -shapes[i][0] * shapes[i][1])
    lq = lk = work = 0
    for i in order:
        sq, sk = shapes[i]
        if groups and (len(groups[-1]) + 1) * max(lq, sq) * max(lk, sk) - work - sq * sk <= _PAD_FREE_PAIRS:
            groups[-1].append(i)
            lq, lk, work = max(lq, sq), max(lk, sk), work + sq * sk
        else:
            groups.append([i])
            lq, lk, work = sq, sk, sq * sk
    return groups


def _padded_calls(spans, levels, n: int, window: int | None, dtype, device) -> list[_PaddedCall]:
    calls = []
    for group in _buckets([(e - s, e - s) for s, e in spans]):
        rows = _Rows.build([torch.arange(*spans[i]) for i in group], n, device)
        band = None
        if window is not None and rows.length > window:
            i = torch.arange(rows.length)
            band = _additive((i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window), dtype, device)
        calls.append(_PaddedCall(rows, rows, band is None, band, merge=False))
    for blocks in levels:
        for group in _buckets([(len(qr), ke - ks) for qr, ks, ke in blocks]):
            keys = [torch.arange(*blocks[i][1:]) for i in group]
            rq, rk = _Rows.build([blocks[i][0] for i in group], n, device), _Rows.build(keys, n, device)
            mask = None
            if rk.pad is not None:
                lens = torch.tensor([len(r) for r in keys])
                mask = _additive((torch.arange(rk.length) < lens[:, None]).view(len(keys), 1, 1, -1), dtype, device)
            calls.append(_PaddedCall(rq, rk, False, mask, merge=True))
    return calls


@dataclass
class _VarlenCall:
    """One call of torch's varlen flash kernel (CUDA): sequence b is queries ``cu_q[b]:cu_q[b+1]`` of the call's
    gathered query rows over keys ``cu_k[b]:cu_k[b+1]`` of its key rows; nothing is padded."""

    q: _Rows
    k: _Rows
    cu_q: Tensor  # [sequences + 1] int32
    cu_k: Tensor
    max_q: int
    max_k: int
    window: tuple[int, int]  # the kernel's (left, right): (-1, 0) causal, (w - 1, 0) causal sliding, (-1, -1) full
    merge: bool

    def forward(self, q, k, v, scale):
        from torch.nn.attention.varlen import AuxRequest

        attend, _ = _varlen_kernels()
        o, lse = attend(q[0], k[0], v[0], self.cu_q, self.cu_k, self.max_q, self.max_k, return_aux=AuxRequest(lse=True),
                        scale=scale, window_size=self.window, enable_gqa=q.shape[2] != k.shape[2])  # fmt: skip
        return o.unsqueeze(0), lse.t().unsqueeze(0)  # the kernel's lse is [H, T]

    def backward(self, grad_out, q, k, v, out, lse, scale):
        _, attend_backward = _varlen_kernels()
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout
        grads = attend_backward(grad_out[0], q[0], k[0], v[0], out[0], lse[0].t().contiguous(), self.cu_q, self.cu_k,
                                self.max_q, self.max_k, self.window == (-1, 0), rng_state, scale, list(self.window))  # fmt: skip
        return tuple(g.unsqueeze(0) for g in grads)


def _varlen_kernels():
    """torch's varlen flash kernel and its registered backward (tests substitute a CPU emulation of both). The
    backward is called directly, with the merged output and log-sum-exp: ``varlen_attn``'s own autograd drops the
    gradient of the lse it returns, so a log-sum-exp merge cannot be differentiated through it."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn, torch.ops.torch_attn._varlen_attn_backward


def _varlen_calls(spans, levels, n: int, window: int | None, device) -> list[_VarlenCall]:
    """One causal call over every segment (segments tile the row, so its queries and keys are the row itself), then
    one call per level over the (subtree queries, segment keys) pairs of that level, queries gathered."""

    def cu_seqlens(lengths: list[int]) -> Tensor:
        return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)

    row = _Rows.build([torch.arange(n)], n, device)
    lengths = [e - s for s, e in spans]
    cu, causal = cu_seqlens(lengths), (-1 if window is None else window - 1, 0)
    calls = [_VarlenCall(row, row, cu, cu, max(lengths), max(lengths), causal, merge=False)]
    for blocks in levels:
        if not blocks:
            continue
        queries, keys = [qr for qr, _, _ in blocks], [torch.arange(ks, ke) for _, ks, ke in blocks]
        rq, rk = _Rows.build([torch.cat(queries)], n, device), _Rows.build([torch.cat(keys)], n, device)
        q_lens, k_lens = [len(r) for r in queries], [len(r) for r in keys]
        cu_q, cu_k = cu_seqlens(q_lens), cu_seqlens(k_lens)
        calls.append(_VarlenCall(rq, rk, cu_q, cu_k, max(q_lens), max(k_lens), (-1, -1), merge=True))
    return calls


def _additive(visible: Tensor, dtype: torch.dtype, device) -> Tensor:
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf")).to(device)


def _repeat_kv(x: Tensor, groups: int) -> Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _flex(q: Tensor, k: Tensor, v: Tensor, meta: TreeAttentionMeta, scale: float, window: int | None) -> Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if window not in meta.shared.block_masks:
        sub_end, depth, blocks, offset = meta.subtree_end, meta.depth, meta.both_ways, meta.prefix_len

        def visible(b, h, qi, ki):
            qi = qi + offset  # the row's queries follow the prefix's keys
            seen = (ki <= qi) & (qi < sub_end[ki])
            seen = seen & (depth[qi] - depth[ki] < window) if window is not None else seen
            return seen | ((blocks[qi] == blocks[ki]) & (blocks[qi] >= 0)) if blocks is not None else seen

        n = meta.num_tokens
        meta.shared.block_masks[window] = create_block_mask(visible, None, None, n - offset, n, device=q.device)
    return _compiled_flex()(q, k, v, block_mask=meta.shared.block_masks[window], scale=scale, enable_gqa=q.shape[1] != k.shape[1])


_FLEX = None


def _compiled_flex():
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def attend_tree(q: Tensor, k: Tensor, v: Tensor, meta: TreeAttentionMeta, *, scale: float | None = None, window: int | None = None,
                softcap: float | None = None) -> Tensor:
    """Attention of a packed tree: q [1, Hq, N, D], k/v [1, Hkv, N, D] (v may have its own head dim) -> [1, Hq, N, Dv].
    ``softcap``: scores capped at +-softcap (``softcap * tanh(score / softcap)``, Gemma 2) before the mask and softmax."""
    if q.shape[0] != 1:
        raise ValueError(f"a packed tree is one row; got a batch of {q.shape[0]}")
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    # One dtype for the kernels, as SDPA would see them: autocast's, else the common one (a model may hand over
    # fp32 queries after a rotary embedding beside bf16 values).
    dtype = torch.get_autocast_dtype(q.device.type) if torch.is_autocast_enabled(q.device.type) else torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    if softcap is not None:  # no fused kernel here caps scores: they are computed whole, with the row's ancestor mask
        groups = q.shape[1] // k.shape[1]
        k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
        scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scale / softcap) * softcap
        scores = scores.masked_fill(~meta.dense_mask(window)[meta.prefix_len :], float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype), v)
    if meta.backend == "dense":
        groups = q.shape[1] // k.shape[1]
        k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=meta.dense_mask(window)[meta.prefix_len :], scale=scale)
    if meta.backend == "blocks" and q.device.type != "cpu":
        raise ValueError(f"the 'blocks' tree attention runs on CPU tensors; on {q.device.type} use 'flex' or 'varlen'")
    dv = v.shape[-1]
    if q.shape[-1] != dv:
        # The flash kernels take one head dim: zero columns add nothing to q.k (the scale is already fixed), and
        # the output's extra columns are dropped.
        d = max(q.shape[-1], dv)
        q, k, v = (nn.functional.pad(x, (0, d - x.shape[-1])) for x in (q, k, v))
    out = _kernel_attention(q, k, v, meta, scale, window)
    return out if out.shape[-1] == dv else out[..., :dv]


@torch.compiler.disable  # a compiled model compiles around the kernels: a row's plan is data (segments), not a graph
def _kernel_attention(q: Tensor, k: Tensor, v: Tensor, meta: TreeAttentionMeta, scale: float, window: int | None) -> Tensor:
    if meta.backend == "flex":
        return _flex(q, k, v, meta, scale, window)
    p = meta.prefix_len
    if p:  # the block kernels index one row for queries and keys: the prefix's query rows are zeros no call reads
        q = nn.functional.pad(q, (0, 0, p, 0))
    out = _TreeAttention.apply(q, k, v, meta.plan(window, q.dtype), scale, p > 0)
    return out[:, :, p:] if p else out


def _causal_window_mask(q_len: int, kv_len: int, window: int, device) -> Tensor:
    """Causal sliding-window mask for an unpadded call without a mask (queries are the last ``q_len`` keys)."""
    q = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k = torch.arange(kv_len, device=device)[None, :]
    return ((k <= q) & (q - k < window))[None, None]


class PackingRefused(UserError, ValueError):
    """A model, setting or row that tree packing cannot compute exactly. The message is one line: the model class
    and the reason."""


# Keyword arguments that attention layers pass along and that carry nothing the tree attention must apply.
_BOOKKEEPING = {"position_ids", "cache_position", "position_embeddings", "past_key_values", "past_key_value", "use_cache",
                "output_attentions", "layer_idx", "is_causal", "target_dtype"}  # fmt: skip

_PACKED = threading.local()  # the row being forwarded by this thread, if any (generation may run on another thread)


@contextmanager
def packed_forward(meta: TreeAttentionMeta):
    """Marks a packed forward: inside it, an attention call that does not carry ``meta`` is an error, never a
    causal fallback over the whole row (which would let every sequence attend to the others)."""
    previous = getattr(_PACKED, "meta", None)
    _PACKED.meta = meta
    try:
        yield meta
    finally:
        _PACKED.meta = previous


def _is_sliding_layer(module: nn.Module) -> bool:
    """Whether the config makes this layer sliding-window: by its entry in ``layer_types``, or, for configs without
    layer types, by a ``sliding_window`` that applies to every layer."""
    config, layer_idx = getattr(module, "config", None), getattr(module, "layer_idx", None)
    if config is None or not getattr(config, "sliding_window", None):
        return False
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return True
    return isinstance(layer_idx, int) and layer_idx < len(layer_types) and layer_types[layer_idx] == "sliding_attention"


def _refuse_packed_call(module: nn.Module, meta: TreeAttentionMeta, attention_mask, sliding_window, dropout, kwargs) -> None:
    """Everything a layer hands its attention that the tree attention would not apply is refused, never dropped."""
    layer = f"{meta.model_name}: {type(module).__name__}"
    if attention_mask is not None:
        raise PackingRefused(f"{layer} passes an attention mask in a packed forward (a score bias, window or key mask built into the mask); tree packing cannot apply it")
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        raise PackingRefused(f"{layer} is bidirectional (not causal); tree packing computes causal attention only")
    for name, value in kwargs.items():
        if value is None or name in _BOOKKEEPING:
            continue
        if name in ("s_aux", "sinks") or isinstance(value, Tensor):
            raise PackingRefused(f"{layer} passes {name!r} to its attention; tree packing cannot apply it")
    if sliding_window is None and _is_sliding_layer(module):
        raise PackingRefused(f"{layer} is a sliding-window layer that passes no sliding_window to its attention (the window lives in its mask only)")
    if dropout and module.training:
        raise PackingRefused(f"{layer} applies attention dropout {dropout}; tree attention does not: set the model's "
                             f"{_dropout_key(getattr(module, 'config', None), dropout)} to 0 (its config.json)")


def _dropout_key(config: Any, dropout: float) -> str:
    """The config key that holds a layer's attention dropout (GPT-2's ``attn_pdrop``, Llama's ``attention_dropout``)."""
    keys = [key for key, value in (config.to_dict() if config is not None else {}).items()
            if "drop" in key and ("att" in key or "pdrop" in key) and value == dropout]  # fmt: skip
    keys.sort(key=lambda key: "att" not in key)  # GPT-2's attn_pdrop, not resid_pdrop of the same value
    return keys[0] if keys else "attention dropout"


def tree_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    tree_attention: TreeAttentionMeta | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """The function transformers calls from each attention layer (``attn_implementation="tree"``)."""
    if tree_attention is None:
        active = getattr(_PACKED, "meta", None)
        if active is not None:
            raise PackingRefused(
                f"{active.model_name}: {type(module).__name__} is called without the packed row's metadata (its decoder "
                "layer does not pass keyword arguments on to its attention); packed, its sequences would attend to each other"
            )
        if attention_mask is None and sliding_window is not None and query.shape[2] > 1:
            attention_mask = _causal_window_mask(query.shape[2], key.shape[2], sliding_window, query.device)
        if kwargs.get("softcap") is not None:  # SDPA cannot cap scores: the layer's own (eager) computation
            return _capped_attention(module, query, key, value, attention_mask, dropout, scaling, kwargs["softcap"])
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    softcap = kwargs.pop("softcap", None)
    _refuse_packed_call(module, tree_attention, attention_mask, sliding_window, dropout, kwargs)
    tree_attention.layers_called.add(id(module))
    if tree_attention.prefix_kv is not None:
        key, value = tree_attention.prefix_keys_values(module, key, value)
    if tree_attention.shared.capture is not None:  # after the join: a nested prefix captures its whole chain's
        tree_attention.shared.capture.append((id(module), key, value))
    capped = {} if softcap is None else {"softcap": softcap}
    out = attend_tree(query, key, value, tree_attention, scale=scaling, window=sliding_window, **capped)
    return out.transpose(1, 2).contiguous(), None


def _capped_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      dropout: float, scaling: float | None, softcap: float) -> tuple[Tensor, Tensor]:
    """Attention with capped scores outside a packed row (generation, a sequence alone), as an eager layer computes
    it: scores, ``softcap * tanh(score / softcap)``, the mask (or causal), softmax in float32 at least, dropout."""
    groups = query.shape[1] // key.shape[1]
    key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    scores = torch.tanh(torch.matmul(query, key.transpose(2, 3)) * scale / softcap) * softcap
    if attention_mask is None and query.shape[2] > 1:
        attention_mask = _causal_window_mask(query.shape[2], key.shape[2], key.shape[2], query.device)
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[2]]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def tree_mask(*args, attention_mask: Tensor | None = None, **kwargs) -> Tensor | None:
    """The mask transformers builds before the layers run. A packed row carries no mask (its structure travels
    in ``tree_attention``), so none is built for it, never an N x N one; outside a packed forward (generation, the
    unpacked references) the model gets SDPA's own mask, so the same model generates and scores padded batches, and
    attends within an image both ways where it does, exactly as it would without tree attention."""
    if getattr(_PACKED, "meta", None) is not None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(ATTENTION_NAME, tree_attention_forward)
AttentionMaskInterface.register(ATTENTION_NAME, tree_mask)

# Rope types whose frequencies are chosen from the longest position of the forward: in a packed row a short
# sequence would get the longest one's frequencies, so they are exact only while every position stays below the
# length at which the choice changes.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _rope_settings(text) -> list[dict]:
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):  # one set per layer type
        return list(params.values())
    return [params] if isinstance(params, dict) else []


def row_limits(config) -> list[tuple[str, int, str]]:
    """What a packed row of this model must stay under to be exact: ``("depth" | "row", limit, why)``."""
    text, limits = config.get_text_config(), []
    for params in _rope_settings(text):
        rope_type = str(params.get("rope_type", params.get("type", "default")))
        if any(kind in rope_type for kind in _LENGTH_DEPENDENT_ROPE):
            # Longrope switches past its original length (a forward of exactly that length keeps the short factors);
            # dynamic grows past max_position_embeddings, and keeps grown frequencies at that length (transformers').
            longrope = params.get("original_max_position_embeddings") if "longrope" in rope_type else None
            bound = int(longrope) + 1 if longrope else getattr(text, "max_position_embeddings", None)
            if bound:
                limits.append(("depth", int(bound), f"its {rope_type} rope picks frequencies from the longest position of a forward"))
    if getattr(text, "attn_temperature_tuning", False) and getattr(text, "floor_scale", None):
        limits.append(("row", int(text.floor_scale), "its query temperature grows with the row index, not the position"))
    return limits


def check_row(model: nn.Module, max_depth: int, num_tokens: int, num_sequences: int = 2) -> None:
    """Refuse a packed row beyond what ``row_limits`` allows (each sequence alone would be computed differently). A row
    of one sequence is that sequence as the model computes it alone: nothing to refuse."""
    if num_sequences == 1:
        return
    for kind, limit, why in row_limits(model.config):
        reach = max_depth + 1 if kind == "depth" else num_tokens
        if reach >= limit:
            what = f"positions up to {max_depth}" if kind == "depth" else f"{num_tokens} tokens"
            fix = ("keep its sequences shorter (SFT: smaller rows, data.max_tokens, or data.packing: none; GRPO: shorter "
                   "prompts or sampling.max_new_tokens)" if kind == "depth" else
                   "pack smaller rows (SFT: data.max_tokens, or data.packing: none; GRPO: model.max_tokens_per_row)")  # fmt: skip
            raise PackingRefused(f"{type(model).__name__}: a packed row with {what} reaches {limit}, and {why}; {fix}")


def enable_tree_attention(model: nn.Module) -> None:
    """Route ``model``'s attention through tree attention, refusing what the config already shows cannot be packed
    as a tree. Whether every layer really calls it is proved by the self-check of the first packed forward."""
    config = model.config
    text, name = config.get_text_config(), type(model).__name__
    if getattr(text, "_attn_implementation", None) == ATTENTION_NAME:
        return
    unpackable = sorted(set(getattr(text, "layer_types", None) or []) - _PACKABLE_LAYER_TYPES)
    if unpackable:
        raise PackingRefused(
            f"{name} has {', '.join(unpackable)} layers; tree packing needs every layer to be "
            "full or sliding-window attention (recurrent and linear-attention layers carry state across tokens)"
        )
    if any(hasattr(m, "sinks") for m in model.modules()):
        raise PackingRefused(f"{name} uses attention sinks, which tree packing cannot apply")
    # (``use_bidirectional_attention: "vision"`` makes only image tokens bidirectional; text rows stay causal)
    if getattr(text, "use_bidirectional_attention", False) not in (False, None, "vision") or getattr(text, "is_causal", True) is False:
        raise PackingRefused(f"{name} is configured for bidirectional attention; tree packing computes causal attention only")
    if getattr(text, "attention_chunk_size", None):
        raise PackingRefused(f"{name} uses chunked attention (a query sees only its own chunk of row positions); tree packing cannot apply it")
    if getattr(text, "attn_temperature_tuning", False) and not getattr(text, "floor_scale", None):
        raise PackingRefused(f"{name} scales its queries by the row index; tree packing cannot apply it")
    model.set_attn_implementation(_tree_for_text_only(config, text))


def _tree_for_text_only(config: Any, text: Any) -> str | dict[str, str]:
    """The implementation to set: tree attention for the language model; a composite model's other towers (vision,
    audio) keep theirs, since they attend within one image or clip, not along the row's tree."""
    key = next((key for key in (getattr(config, "sub_configs", None) or {}) if getattr(config, key, None) is text), None)
    return ATTENTION_NAME if key is None or text is config else {key: ATTENTION_NAME}
