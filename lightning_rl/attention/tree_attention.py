"""Tree attention: each token of a packed prefix tree attends exactly to its ancestors.

Registered as ``"tree"`` in transformers' public attention interface, so any decoder that routes its attention
through ``ALL_ATTENTION_FUNCTIONS`` runs packed trees unchanged. The packed row's metadata arrives as the
``tree_attention`` keyword of ``model(...)``; without it the function is plain causal SDPA, so the same model
still generates.

Backends (``TreeAttentionMeta.backend``):

- ``"blocks"`` (CPU, any device): the tree is cut into chain segments. A segment's queries attend causally to
  the segment itself, and the whole subtree below a segment (a contiguous interval in depth-first order)
  attends to that segment's keys with no mask at all. Each block is one fused SDPA-kernel call; partial results
  merge through their log-sum-exp, and the backward reuses the kernel's own backward with the merged output and
  log-sum-exp (as ring attention does). Work grows with (query, ancestor key) pairs, saved memory with unique
  tokens: K/V are never gathered per path.
- ``"flex"`` (CUDA): FlexAttention with a block-sparse mask built from ``subtree_end``; the same pairs, fused.
- ``"dense"``: one SDPA call with an N x N boolean mask built from ``subtree_end`` by tensor ops only. The
  reference in tests, and the path for XLA / Neuron, where a kernel call per segment would give every new row
  a new graph; there, rows are padded to fixed lengths and the mask costs N^2 memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from lightning_rl.packing.tree import PackedBatch

ATTENTION_NAME = "tree"
AttentionBackend = Literal["auto", "blocks", "flex", "dense"]
BACKENDS = ("auto", "blocks", "flex", "dense")
_PACKABLE_LAYER_TYPES = {"full_attention", "sliding_attention"}
_STATIC_SHAPE_DEVICES = ("xla", "neuron")

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def choose_backend(requested: str, device: torch.device, *, static_shapes: bool = False) -> str:
    """``auto``: FlexAttention on CUDA, the shape-only dense path where shapes must be static (XLA, Neuron, or a
    strategy that rehearses them), the block path elsewhere. Anything else is taken as given."""
    if requested not in BACKENDS:
        raise ValueError(f"attention backend {requested!r} is not one of {', '.join(BACKENDS)}")
    if requested != "auto":
        return requested
    if static_shapes or device.type in _STATIC_SHAPE_DEVICES:
        return "dense"
    return "flex" if device.type == "cuda" else "blocks"


@dataclass
class TreeAttentionMeta:
    """What the attention needs to know about a packed row (built once per row, shared by every layer)."""

    segments: list[tuple[int, int, int]]
    depth: Tensor  # [N] position ids (depth along the path)
    subtree_end: Tensor  # [N]
    backend: str = "blocks"
    _plans: dict = field(default_factory=dict, repr=False)
    _block_masks: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_batch(cls, batch: PackedBatch, *, backend: str = "auto", device: torch.device | None = None) -> TreeAttentionMeta:
        device = device or batch.input_ids.device
        return cls(
            segments=[tuple(s) for s in batch.segments.tolist()],
            depth=batch.position_ids.to(device),
            subtree_end=batch.subtree_end.to(device),
            backend=choose_backend(backend, device),
        )

    @property
    def num_tokens(self) -> int:
        return int(self.depth.numel())

    def plan(self, window: int | None, dtype: torch.dtype) -> list[tuple[int, int, int, int, bool, Tensor | None]]:
        """Blocks (q_start, q_end, k_start, k_end, causal, additive mask or None) for one sliding window."""
        key = (window, dtype)
        if key not in self._plans:
            self._plans[key] = _plan_blocks(self.segments, self.depth.cpu(), window, dtype, self.depth.device)
        return self._plans[key]

    def dense_mask(self, window: int | None) -> Tensor:
        i = torch.arange(self.num_tokens, device=self.depth.device)
        mask = (i[None, :] <= i[:, None]) & (i[:, None] < self.subtree_end[None, :])
        if window is not None:
            mask &= (self.depth[:, None] - self.depth[None, :]) < window
        return mask


def _plan_blocks(segments, depth: Tensor, window, dtype, device):
    blocks = []
    for start, end, sub_end in segments:
        causal_mask = None
        if window is not None and end - start > window:
            d = torch.arange(end - start)
            visible = (d[None, :] <= d[:, None]) & (d[:, None] - d[None, :] < window)
            causal_mask = _additive(visible, dtype, device)
        blocks.append((start, end, start, end, causal_mask is None, causal_mask))
        if sub_end == end:
            continue
        mask = None
        if window is not None:
            dq, dk = depth[end:sub_end], depth[start:end]
            if int(dq.min()) - int(dk.max()) >= window:
                continue  # the whole subtree is out of this segment's window
            if int(dq.max()) - int(dk.min()) >= window:
                mask = _additive(dq[:, None] - dk[None, :] < window, dtype, device)
        blocks.append((end, sub_end, start, end, False, mask))
    return blocks


def _additive(visible: Tensor, dtype: torch.dtype, device) -> Tensor:
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf")).to(device)


class _BlockTreeAttention(torch.autograd.Function):
    """Attention over (query interval, key interval) blocks merged by log-sum-exp.

    q is [1, Hq, N, D], k/v [1, Hkv, N, D]; K/V heads are repeated per block only, so what is saved for the
    backward is the unrepeated K/V. Self blocks (a segment over itself) tile the row, so they are written
    first and the blocks of ancestor segments are merged into them.
    """

    @staticmethod
    def forward(ctx, q, k, v, blocks, scale):
        groups = q.shape[1] // k.shape[1]
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        for qs, qe, ks, ke, causal, mask in sorted(blocks, key=lambda b: b[0] != b[2]):
            kb, vb = _repeat_kv(k[:, :, ks:ke], groups), _repeat_kv(v[:, :, ks:ke], groups)
            o, l = _flash_cpu(q[:, :, qs:qe], kb, vb, 0.0, causal, attn_mask=mask, scale=scale)
            if qs == ks:  # a self block: every row sees at least itself
                out[:, :, qs:qe] = o
                lse[:, :, qs:qe] = l
                continue
            if mask is not None:  # the kernel reports lse 0 for rows that see no key of this block
                l = l.masked_fill(torch.isinf(mask).all(-1), float("-inf"))
            prev = lse[:, :, qs:qe]
            new = torch.logaddexp(prev, l)
            o = o.float().mul_((l - new).exp_().unsqueeze(-1))
            out[:, :, qs:qe].mul_((prev - new).exp_().unsqueeze(-1)).add_(o)
            lse[:, :, qs:qe] = new
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.scale = blocks, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        groups, hkv = q.shape[1] // k.shape[1], k.shape[1]
        grad_out = grad_out.contiguous()
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.empty(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        for qs, qe, ks, ke, causal, mask in sorted(ctx.blocks, key=lambda b: b[0] != b[2]):
            kb, vb = _repeat_kv(k[:, :, ks:ke], groups), _repeat_kv(v[:, :, ks:ke], groups)
            gq, gk, gv = _flash_cpu_backward(
                grad_out[:, :, qs:qe], q[:, :, qs:qe], kb, vb,
                out[:, :, qs:qe], lse[:, :, qs:qe], 0.0, causal, attn_mask=mask, scale=ctx.scale,
            )  # fmt: skip
            if groups > 1:
                gk, gv = gk.unflatten(1, (hkv, groups)).sum(2), gv.unflatten(1, (hkv, groups)).sum(2)
            if qs == ks:  # self blocks tile the row: they initialise every gradient row
                dq[:, :, qs:qe], dk[:, :, ks:ke], dv[:, :, ks:ke] = gq, gk, gv
            else:
                dq[:, :, qs:qe] += gq
                dk[:, :, ks:ke] += gk
                dv[:, :, ks:ke] += gv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _repeat_kv(x: Tensor, groups: int) -> Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _flex(q: Tensor, k: Tensor, v: Tensor, meta: TreeAttentionMeta, scale: float, window: int | None) -> Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if window not in meta._block_masks:
        sub_end, depth = meta.subtree_end, meta.depth

        def visible(b, h, qi, ki):
            seen = (ki <= qi) & (qi < sub_end[ki])
            return seen & (depth[qi] - depth[ki] < window) if window is not None else seen

        n = meta.num_tokens
        meta._block_masks[window] = create_block_mask(visible, None, None, n, n, device=q.device)
    return _compiled_flex()(q, k, v, block_mask=meta._block_masks[window], scale=scale, enable_gqa=q.shape[1] != k.shape[1])


_FLEX = None


def _compiled_flex():
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def attend_tree(q: Tensor, k: Tensor, v: Tensor, meta: TreeAttentionMeta, *, scale: float | None = None, window: int | None = None) -> Tensor:
    """Attention of a packed tree: q [1, Hq, N, D], k/v [1, Hkv, N, D] -> [1, Hq, N, D]."""
    if q.shape[0] != 1:
        raise ValueError(f"a packed tree is one row; got a batch of {q.shape[0]}")
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if meta.backend == "flex":
        return _flex(q, k, v, meta, scale, window)
    if meta.backend == "dense":
        groups = q.shape[1] // k.shape[1]
        k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=meta.dense_mask(window), scale=scale)
    if q.device.type != "cpu":
        raise ValueError(f"the 'blocks' tree attention runs on CPU tensors; on {q.device.type} use 'flex'")
    return _BlockTreeAttention.apply(q, k, v, meta.plan(window, q.dtype), scale)


def _causal_window_mask(q_len: int, kv_len: int, window: int, device) -> Tensor:
    """Causal sliding-window mask for an unpadded call without a mask (queries are the last ``q_len`` keys)."""
    q = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k = torch.arange(kv_len, device=device)[None, :]
    return ((k <= q) & (q - k < window))[None, None]


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
        if attention_mask is None and sliding_window is not None and query.shape[2] > 1:
            attention_mask = _causal_window_mask(query.shape[2], key.shape[2], sliding_window, query.device)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    for unsupported in ("s_aux", "sinks", "softcap"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"{type(module).__name__} passes {unsupported!r} to its attention; tree packing cannot apply it")
    if dropout and module.training:
        raise ValueError("tree attention does not apply attention dropout; set the model's attention_dropout to 0")
    out = attend_tree(query, key, value, tree_attention, scale=scaling, window=sliding_window)
    return out.transpose(1, 2).contiguous(), None


def tree_mask(*args, attention_mask: Tensor | None = None, **kwargs) -> Tensor | None:
    """The mask transformers builds before the layers run. A packed row carries no mask (its structure travels
    in ``tree_attention``), so none is built for it, never an N x N one; a padded batch outside packing gets
    SDPA's mask, so the same model generates and scores padded batches correctly."""
    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(ATTENTION_NAME, tree_attention_forward)
AttentionMaskInterface.register(ATTENTION_NAME, tree_mask)


def enable_tree_attention(model: nn.Module) -> None:
    """Route ``model``'s attention through tree attention, refusing layers that cannot be packed as a tree."""
    config = model.config
    if getattr(config, "_attn_implementation", None) == ATTENTION_NAME:
        return
    text = config.get_text_config()
    unpackable = sorted(set(getattr(text, "layer_types", None) or []) - _PACKABLE_LAYER_TYPES)
    if unpackable:
        raise ValueError(
            f"{type(model).__name__} has {', '.join(unpackable)} layers; tree packing needs every layer to be "
            "full or sliding-window attention (recurrent and linear-attention layers carry state across tokens)"
        )
    if any(hasattr(m, "sinks") for m in model.modules()):
        raise ValueError(f"{type(model).__name__} uses attention sinks, which tree packing cannot apply")
    model.set_attn_implementation(ATTENTION_NAME)
