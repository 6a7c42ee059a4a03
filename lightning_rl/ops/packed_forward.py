"""A model run on a packed row, and the checks that prove, on that very model, that it equals each sequence alone.

Guards in the attention refuse every mechanism known to break packing, but a guard list is never complete and
some kernels only run on hardware the tests do not have. So the model checks itself where it runs:

- the **probe**: when tree attention is first used on a model (per backend, device and dtype), a few short random
  sequences forming nested forks and a separate root are scored packed and one by one, without gradients, in
  eval mode; every decoder layer must have applied the row's tree, and the log-probs must agree within a
  dtype-aware tolerance, or the model is refused with the measured error; a row continuing a prefix forwarded
  apart (``ops/prefix_rows.py``) first has the probe's sequences run that way too, as a span of two rows;
- ``verify_row``: the real row of a training step against per-sequence runs of a sample of its sequences.

Both run the same number of forwards on every rank and agree on the error across ranks, so a sharded run checks
in step and either goes on or stops everywhere.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_rl.attention.tree_attention import PackingRefused, TreeAttentionMeta, check_row, enable_tree_attention, packed_forward
from lightning_rl.models.structure import find_decoder_layers
from lightning_rl.models.routing import RouteAgreement, RouteReplay, replaying
from lightning_rl.ops.logprobs import lm_head_of, match_head_scaling, max_abs_logit, token_entropy, token_logprobs, token_stats
from lightning_rl.models.multimodal import (
    attends_within_images_both_ways, image_block_rule, image_token_id, image_token_types, transformers_model, uses_multi_axis_positions,
)
from lightning_rl.packing.images import image_runs, images_on_path, placeholder_blocks, split_images, stack_images
from lightning_rl.packing.tree import PackedBatch, pack_sequences
from lightning_rl.ops.prefix_rows import PrefixedRow, share_prefixes

# Max |packed - per-sequence| log-prob accepted, by the dtype the model computes in. fp32 noise is ~1e-6, fp64 ~1e-13;
# bf16 and fp16 kernels that sum in another order differ by ~1e-2. A leak across sequences moves log-probs by far more.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 2e-2}


def head_inputs(model: nn.Module, input_ids: Tensor, position_ids: Tensor | None, **forward_kwargs) -> Tensor:
    """The hidden states [T, hidden] that ``model`` feeds its LM head for one row of tokens.

    The top-level ``forward`` runs, so wrappers (FSDP, peft) see an ordinary call, with only arguments whose meaning
    is the same for every model. A pre-hook on the output embeddings takes the head's input, which is by definition
    what the logits are computed from whatever module produced it, and hands the head a single position, so the
    [tokens x vocab] logits are never built. Without ``position_ids`` the model places the tokens itself."""
    head = model.get_output_embeddings()
    if head is None:
        raise PackingRefused(f"{type(model).__name__} has no output embeddings module to read its final hidden states from")
    captured: list[Tensor] = []

    def take(module, args):
        captured.append(args[0])
        return (args[0][:, -1:], *args[1:])

    handle = head.register_forward_pre_hook(take)
    try:
        if position_ids is not None:
            forward_kwargs["position_ids"] = position_ids[None] if position_ids.dim() == 1 else position_ids  # [1, T], or [axes, 1, T]
        model(input_ids=input_ids[None], use_cache=False, **forward_kwargs)
    finally:
        handle.remove()
    name, n = type(model).__name__, input_ids.shape[0]
    if len(captured) != 1:
        raise PackingRefused(f"{name} called its output embeddings {len(captured)} times in one forward; its logits cannot be read as one head over hidden states")
    hidden = captured[0]
    if hidden.dim() != 3 or hidden.shape[:2] != (1, n):
        raise PackingRefused(f"{name} feeds its LM head a tensor of shape {tuple(hidden.shape)} for a row of {n} tokens")
    return hidden[0]


def _compute_dtype(hidden: Tensor) -> torch.dtype:
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


def _tolerance(dtype: torch.dtype, logit_scale: float = 0.0) -> float:
    """The largest log-prob error packing may show in ``dtype``. In 16 bits it grows with the largest |logit| past 4:
    the hidden states round at 16-bit precision, packed or not, and the head multiplies that noise by the logits'
    size (a tiny bf16 Qwen3 measures about 0.006 per unit of logit; a leak across sequences moves them far more)."""
    base = TOLERANCE.get(dtype, TOLERANCE[torch.float16])
    return base * max(1.0, logit_scale / 4.0) if dtype in (torch.bfloat16, torch.float16) else base


def _agree(error: float, model: nn.Module, device: torch.device) -> float:
    """The largest error of all ranks for a sharded model, whose forwards are collectives that every rank runs in
    step, so every rank takes the same decision. A model each rank holds whole may be checked on one rank alone
    (a reference kept on rank 0): its probe is deterministic, and callers that need agreement on real rows reduce
    themselves."""
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    if not sharded or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return error
    value = torch.tensor([error], dtype=torch.float64, device=device if torch.distributed.get_backend() != "gloo" else "cpu")
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return float(value)


def packed_hidden_states(
    model: nn.Module, batch: PackedBatch, *, attention_backend: str = "auto", route_agreement: RouteAgreement | None = None,
    replay_routes: bool = True, capture: list | None = None,
) -> Tensor:
    """Final hidden states [N, hidden] of a packed row, each token attending only to its ancestors. A row with
    ``batch.routes`` sends each token to the experts they name (``replay_routes``; else the model routes it and the
    routes are only compared), and adds to ``route_agreement`` how often the model would have chosen them itself.
    A `PrefixedRow` attends to its prefix too (forwarded once per model, ``ops/prefix_rows.py``); ``capture``: the
    list a prefix's own forward records each attention call's keys and values in. An ``unpacked`` row (one sequence,
    ``data.packing: none``) runs as the model runs that sequence alone: its own attention and positions, no tree."""
    if batch.unpacked:
        check_alone_once(model, batch.input_ids.device)
        positions, inputs = _alone_inputs(model, batch)
        return _routed(model, batch, route_agreement, replay_routes, lambda: head_inputs(model, batch.input_ids, positions, **inputs))
    enable_tree_attention(model)
    prefix = batch.prefix if isinstance(batch, PrefixedRow) else None
    if prefix is not None:
        prefix.check(model)
    check_row(model, int(batch.position_ids.max()) if batch.num_tokens else 0, batch.num_tokens + (prefix.length if prefix else 0),
              num_sequences=batch.num_sequences if prefix is None else 2)  # a span's row: its sequences are the span's
    device = batch.input_ids.device
    # A model whose image tokens attend to each other both ways sees each image's placeholders as one block.
    token = image_token_id(model.config)
    both_ways = placeholder_blocks(batch.input_ids, token) if batch.image_inputs and token is not None and attends_within_images_both_ways(model) else None
    meta = TreeAttentionMeta.from_batch(batch, backend=attention_backend, device=device, model_name=type(model).__name__, both_ways=both_ways)
    _probe_once(model, meta.backend, device, batch.pad_to_multiple_of, across_rows=prefix is not None)
    if batch.image_inputs and image_block_rule(type(transformers_model(model))) == "other":
        raise PackingRefused(
            f"{type(model).__name__} groups its image tokens into blocks that attend both ways by a rule of its own "
            "(block_sequence_ids); a packed row makes each image's placeholders one block, so its image rows are refused"
        )
    if batch.image_inputs and batch.rope_position_ids is None and uses_multi_axis_positions(model):
        raise PackingRefused(
            f"{type(model).__name__} places image tokens on multi-axis rotary positions; this row of images carries no "
            "such positions (pack it with rope_positions from the model's own rule)"
        )
    # Multi-axis rotary positions go in as the model's own [axes, batch, tokens]; images as its own inputs, which
    # its forward encodes once each and writes into the row's placeholders.
    positions = batch.position_ids if batch.rope_position_ids is None else batch.rope_position_ids[:, None]
    if prefix is not None:
        options = dict(attention_backend=attention_backend, route_agreement=route_agreement, replay_routes=replay_routes)
        meta = meta.after_prefix(prefix.length, prefix.keys_values(model, lambda into: packed_hidden_states(model, prefix.batch, **options, capture=into)))
    meta.shared.capture = capture

    def run() -> Tensor:
        with packed_forward(meta):
            return head_inputs(model, batch.input_ids, positions, tree_attention=meta, **batch.image_inputs)

    hidden = _routed(model, batch, route_agreement, replay_routes, run)
    _check_every_layer_applied(model, meta)
    if prefix is not None and meta.shared.prefix_taken != set(meta.prefix_kv):
        raise PackingRefused(f"{type(model).__name__}: {len(meta.shared.prefix_taken)} attention modules of a row took keys and values of its prefix's {len(meta.prefix_kv)}")
    return hidden


def _routed(model: nn.Module, batch: PackedBatch, route_agreement: RouteAgreement | None, replay_routes: bool, run) -> Tensor:
    """``run()``'s forward with each token of a row that carries ``routes`` sent to the experts they name (or only
    compared, without ``replay_routes``), and how often the model agreed added to ``route_agreement``."""
    replay = None if batch.routes is None else RouteReplay(batch.routes, force=replay_routes)
    if replay is not None:
        replay.check(model, batch.num_tokens)
    with replaying(model, replay):
        hidden = run()
    if replay is not None and route_agreement is not None:
        route_agreement.merge(replay.agreement)
    return hidden


def _alone_inputs(model: nn.Module, batch: PackedBatch) -> tuple[Tensor | None, dict[str, Tensor]]:
    """An unpacked row's positions and inputs, as the model's own processing gives them: its images with the token
    types its processor marks them by (both-ways image blocks, multi-axis positions), the row's multi-axis positions;
    else the model's own positions, but in a padded row the padding placed at 0, not past the sequence (where a learned
    table ends, and a rope that depends on the longest position would change the sequence's)."""
    inputs = dict(batch.image_inputs)
    if inputs:
        inputs.update(image_token_types(model, batch.input_ids[None]))
    if batch.rope_position_ids is not None:
        return batch.rope_position_ids[:, None], inputs
    if batch.num_tokens == batch.num_unique_tokens:
        return None, inputs
    positions = batch.position_ids.clone()
    positions[batch.num_unique_tokens :] = 0
    return positions, inputs


_ALONE_CHECKED: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


@torch.no_grad()
def check_alone_once(model: nn.Module, device: torch.device) -> None:
    """Before a model's first unpacked row, in eval mode, on two of `probe_sequences` that differ in their last two
    tokens only: read which logit scale its own forward applies (`match_head_scaling`, as the probe does), and refuse a
    model whose earlier outputs change with later tokens (bidirectional): a next-token loss would read the answer."""
    if model in _ALONE_CHECKED:
        return
    seqs = probe_sequences(model.config)
    first, second = (torch.tensor(seqs[k], device=device) for k in (1, 2))
    shared = next(i for i, (a, b) in enumerate(zip(seqs[1], seqs[2])) if a != b)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        hidden = head_inputs(model, first, None)
        logits = [model(input_ids=ids[None], use_cache=False).logits[0, :shared] for ids in (first, second)]
        match_head_scaling(model, hidden[:shared], logits[0])
    finally:
        for module, training in modes:
            module.training = training
    earlier, later = (x.double().log_softmax(-1) for x in logits)
    leak = _agree(float((earlier - later).abs().max()), model, device)
    if leak > _tolerance(_compute_dtype(hidden)) * 1e-2:
        raise PackingRefused(f"{type(model).__name__} is not causal: its outputs at a token change with the tokens after it (by "
                             f"{leak:.2e}), so a next-token loss would read the answer; it is not trained here")
    _ALONE_CHECKED[model] = True


@contextmanager
def unpacked_hint(key: str, unit: str, packed: bool = True) -> Iterator[None]:
    """A refusal of a ``packed`` row says that the model still trains one ``unit`` a row, as it runs alone (``key``:
    none); a refusal of an unpacked row is left as it is."""
    try:
        yield
    except PackingRefused as refused:
        if not packed or "packing: none" in str(refused):
            raise
        raise PackingRefused(f"{refused}; {key}: none trains it one {unit} a row, as the model runs each alone") from None


def _check_every_layer_applied(model: nn.Module, meta: TreeAttentionMeta) -> None:
    """As many attention modules applied the row as in the model's probe (which checked them layer by layer)."""
    called, expected = len(meta.layers_called), _ATTENTION_MODULES.get(model, 0)
    if called < expected:
        raise PackingRefused(
            f"{type(model).__name__}: {called} of its {expected} attention modules applied the tree attention in this "
            "forward; the others ran without the packed row's structure"
        )


def _outermost_layers_run(model: nn.Module, run) -> list[nn.Module]:
    """The decoder layers (outermost ``_no_split_modules`` blocks kept in a ``ModuleList``, so not an embedding
    block) that ran during ``run()``; a vision tower that a text row never runs does not count."""
    ran: set[int] = set()
    stacked = {id(child) for module in model.modules() if isinstance(module, nn.ModuleList) for child in module}
    layers = [layer for layer in find_decoder_layers(model) if id(layer) in stacked]
    hooks = [layer.register_forward_pre_hook(lambda module, args: ran.add(id(module))) for layer in layers]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    inner = {id(sub) for layer in layers for sub in layer.modules() if sub is not layer}
    return [layer for layer in layers if id(layer) in ran and id(layer) not in inner]


def _refuse_layers_without_tree(model: nn.Module, meta: TreeAttentionMeta, layers: list[nn.Module]) -> None:
    """Every decoder layer that ran must have applied the tree through one of its modules (a layer whose attention
    does not go through transformers' attention interface, or a recurrent layer, runs without it)."""
    name = type(model).__name__
    if not layers:  # no decoder-layer classes declared: count against the config instead
        expected = int(getattr(model.config.get_text_config(), "num_hidden_layers", 0) or 0)
        if len(meta.layers_called) < expected:
            raise PackingRefused(
                f"{name}: {len(meta.layers_called)} of its {expected} decoder layers applied the tree attention (the others "
                "do not route their attention through transformers' attention interface)"
            )
        return
    missing = [layer for layer in layers if not any(id(sub) in meta.layers_called for sub in layer.modules())]
    if missing:
        raise PackingRefused(
            f"{name}: {len(layers) - len(missing)} of its {len(layers)} decoder layers applied the tree attention (the "
            f"others, {type(missing[0]).__name__} first, do not route their attention through transformers' attention interface)"
        )


def packed_logprobs(
    model: nn.Module,
    batch: PackedBatch,
    *,
    chunk_size: int = 1024,
    return_entropy: bool = False,
    temperature: float = 1.0,
    attention_backend: str = "auto",
    entropy_grad: bool = False,
    suppressed: tuple[int, ...] = (),
    route_agreement: RouteAgreement | None = None,
    replay_routes: bool = True,
    return_stats: bool = False,
) -> Tensor | tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """log p(target) for every loss term of a packed row (and the entropy there when asked, differentiable with
    ``entropy_grad``), shape [M], under the sampling ``temperature``, without the ``suppressed`` tokens, and
    renormalised over each term's sampling support where the row carries one (``batch.token_support``).
    ``return_stats``: with the entropy and whether the likeliest token is the target (`token_stats`), no gradient."""
    hidden = packed_hidden_states(model, batch, attention_backend=attention_backend, route_agreement=route_agreement, replay_routes=replay_routes)
    h = hidden.index_select(0, batch.loss_positions)
    weight, bias, transform = lm_head_of(model, temperature, suppressed)
    logprobs = token_logprobs(h, weight, batch.loss_targets, chunk_size=chunk_size, transform=transform, bias=bias, support=batch.token_support)
    if return_stats:
        return logprobs, *token_stats(h.detach(), weight.detach(), batch.loss_targets, chunk_size=chunk_size, transform=transform,
                                      bias=None if bias is None else bias.detach())  # fmt: skip
    if not return_entropy:
        return logprobs
    if entropy_grad:
        return logprobs, token_entropy(h, weight, chunk_size=chunk_size, transform=transform, bias=bias)
    with torch.no_grad():
        return logprobs, token_entropy(h, weight, chunk_size=chunk_size, transform=transform, bias=bias)


# -- the probe -------------------------------------------------------------------------------------------------

_PROBED: weakref.WeakKeyDictionary[nn.Module, set] = weakref.WeakKeyDictionary()
_ACROSS_ROWS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, bool]] = weakref.WeakKeyDictionary()  # across_rows_exact's answers
_ATTENTION_MODULES: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()  # found by the probe


def _special_token_ids(config) -> set[int]:
    """Ids the probe must not use: image, audio and other placeholders make a model expect more than text."""
    ids: set[int] = set()
    for cfg in {id(c): c for c in (config, config.get_text_config())}.values():
        for key, value in cfg.to_dict().items():
            if key.endswith(("_token_id", "_token_index", "_token_ids")):
                ids.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    return ids


def check_packable(model: nn.Module, *, attention_backend: str = "auto", pad_to_multiple_of: int | None = None) -> None:
    """The packing self-check (`probe`) and one training-mode packed forward of its rows, now, without a gradient: what
    tree packing refuses in a model (an inexact family, attention dropout) is refused before a caller starts the work
    of a step (an engine built, rollouts generated and scored). The randomness a training-mode forward draws (dropout)
    comes from a copy of the generators, so the run draws as it would without this check."""
    device = next(model.parameters()).device
    batch = pack_sequences(probe_sequences(model.config), pad_to_multiple_of=pad_to_multiple_of).to(device)
    with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        packed_hidden_states(model, batch, attention_backend=attention_backend)


def probe_sequences(config, seed: int = 0) -> list[list[int]]:
    """A shared prefix, forks and a nested fork below it, and an unrelated root placed last in the row (so its row
    index is far from its depth), in ids of the model's own vocabulary. Seven tokens deep at most."""
    vocab = int(config.get_text_config().vocab_size)
    allowed = torch.tensor(sorted(set(range(min(vocab, 4096))) - _special_token_ids(config)))
    g = torch.Generator().manual_seed(seed)
    draw = lambda n: allowed[torch.randint(len(allowed), (n,), generator=g)].tolist()  # noqa: E731
    prefix, fork = draw(3), draw(2)
    return [prefix + draw(3), prefix + fork + draw(2), prefix + fork + draw(2), prefix + draw(1), draw(4)]


def _right_padded(ids: Tensor, multiple: int | None) -> Tensor:
    """A causal sequence padded at its end, as the row being trained is padded (static-shape devices compile once
    per shape, so the checks bring no new one): the padding changes nothing before it."""
    if multiple is None or len(ids) % multiple == 0:
        return ids
    return torch.nn.functional.pad(ids, (0, multiple - len(ids) % multiple))


def _probe_key(model: nn.Module, backend: str, device: torch.device) -> tuple:
    """What a probe's answer holds for: the kernel, the device, the autocast dtype and the weights' dtype (a model cast
    later is probed again)."""
    autocast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    return backend, device.type, autocast, next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def _probe_once(model: nn.Module, backend: str, device: torch.device, pad_to_multiple_of: int | None = None, across_rows: bool = False) -> None:
    key = _probe_key(model, backend, device)
    for way, run in ((key, lambda: probe(model, backend, device, pad_to_multiple_of)), ((*key, "across rows"), lambda: probe_across_rows(model, backend, device))):
        if way in _PROBED.setdefault(model, set()) or (not across_rows and way != key):
            continue
        _PROBED[model].add(way)  # the probe's own rows come through here
        try:
            error, dtype, scale = run()
        except BaseException:
            _PROBED[model].discard(way)
            raise
        tolerance = _tolerance(dtype, scale)
        if error > tolerance:
            _PROBED[model].discard(way)
            how = "a prefix forwarded once across rows (model.prefix_across_rows: never avoids it)" if way != key else "this model cannot be tree-packed exactly"
            raise PackingRefused(
                f"{type(model).__name__}: the packing self-check measured packed log-probs {error:.2e} away from each sequence "
                f"run alone ({backend} attention, {str(dtype).removeprefix('torch.')}, tolerance {tolerance:.0e}); {how}"
            )


@torch.no_grad()
def probe(model: nn.Module, backend: str, device: torch.device, pad_to_multiple_of: int | None = None) -> tuple[float, torch.dtype, float]:
    """Max |packed - per-sequence| log-prob on ``probe_sequences`` (agreed across ranks), the compute dtype, and the
    largest |logit| (`_tolerance`).
    The reference is the model's own forward and logits, one sequence at a time. Rows are padded to
    ``pad_to_multiple_of`` as the training rows are, so a static-shape device compiles no new shape for them."""
    seqs = probe_sequences(model.config)
    batch = pack_sequences(seqs, pad_to_multiple_of=pad_to_multiple_of).to(device)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()  # dropout and router noise off: the comparison is of the computation, not of samples
    try:
        meta = TreeAttentionMeta.from_batch(batch, backend=backend, device=device, model_name=type(model).__name__)
        captured: list[Tensor] = []

        def run() -> None:
            with packed_forward(meta):
                captured.append(head_inputs(model, batch.input_ids, batch.position_ids, tree_attention=meta))

        _refuse_layers_without_tree(model, meta, _outermost_layers_run(model, run))
        _ATTENTION_MODULES[model] = len(meta.layers_called)
        hidden = captured[0]
        reference, scale = [], 0.0
        for k, s in enumerate(seqs):
            ids = _right_padded(torch.tensor(s, device=device), pad_to_multiple_of)[None]
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0, : len(s)]
            if k == 0:  # which logit scale the model's own forward applies, read off the first sequence's packed path
                rows, _ = sequence_paths(batch, [0])[0]
                match_head_scaling(model, hidden[rows], logits[: len(rows)])
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            scale = max(scale, float(logits.abs().max()))
            reference.append(torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1 : len(s), None]).squeeze(1))
        weight, bias, transform = lm_head_of(model)
        packed = token_logprobs(hidden.index_select(0, batch.loss_positions), weight, batch.loss_targets, transform=transform, bias=bias)
        error = float((packed - torch.cat(reference)).abs().max())
    finally:
        for module, training in modes:
            module.training = training
    return _agree(error, model, device), _compute_dtype(hidden), scale


def across_rows_exact(model: nn.Module, backend: str) -> bool:
    """Whether ``model`` continues a prefix forwarded apart exactly on ``backend`` (the self-check's nested span, once
    per model and backend): what ``prefix_across_rows: auto`` asks before it trains a span, so that a model or kernel
    the cross-row path refuses keeps the sub-groups, which it packs exactly, instead of stopping the run."""
    if backend == "varlen":  # no kernel for a row continuing a prefix (TreeAttentionMeta.after_prefix)
        return False
    device = next(model.parameters()).device
    key = _probe_key(model, backend, device)
    known = _ACROSS_ROWS.setdefault(model, {})
    if key not in known:  # a refusal is remembered too: auto asks at every step that plans a span
        try:
            enable_tree_attention(model)
            _probe_once(model, backend, device, across_rows=True)
            known[key] = True
        except PackingRefused:
            known[key] = False
    return known[key]


@torch.no_grad()
def probe_across_rows(model: nn.Module, backend: str, device: torch.device) -> tuple[float, torch.dtype, float]:
    """Max |cross-row - per-sequence| log-prob of ``probe_sequences``' four that share a prefix, run as a nested span:
    the first two tokens forwarded once; the two sequences that fork after them share two more, forwarded once as a
    nested prefix, each in a row of its own; the other two in a third row. No loss term reads a prefix's outputs."""
    seqs = probe_sequences(model.config)
    # (sequences, prefix or chain of nested prefixes, first scored token): one past the innermost prefix
    rows = [([seqs[1]], ((0, 2), (1, 4)), 5), ([seqs[2]], ((0, 2), (1, 4)), 5), ([seqs[0], seqs[3]], (0, 2), 3)]
    masks = [[[t >= first for t in range(len(s))] for s in row_seqs] for row_seqs, _, first in rows]
    packed_rows = share_prefixes([pack_sequences(row_seqs, m).to(device) for (row_seqs, _, _), m in zip(rows, masks)], [chain for _, chain, _ in rows])
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        error, dtype, scale = 0.0, torch.float32, 0.0
        for row, (row_seqs, _, f) in zip(packed_rows, rows):
            packed = packed_logprobs(model, row, attention_backend=backend)
            for k, s in enumerate(row_seqs):
                ids = torch.tensor(s, device=device)[None]
                logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0]
                dtype = _compute_dtype(logits)
                logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
                scale = max(scale, float(logits.abs().max()))
                alone = torch.log_softmax(logits[f - 1 : -1], -1).gather(1, ids[0, f:, None]).squeeze(1)
                error = max(error, float((packed[row.loss_seq == k] - alone).abs().max()))
    finally:
        for module, training in modes:
            module.training = training
    return _agree(error, model, device), dtype, scale


# -- the check of real rows ------------------------------------------------------------------------------------

VerifyPacking = Literal["first_step", "every_n_steps", "never"]


def sequence_paths(batch: PackedBatch, sequences: list[int]) -> list[tuple[Tensor, Tensor]]:
    """For each sequence: its packed rows from the root to its last scored token, and its loss terms."""
    out = []
    for s in sequences:
        terms = torch.nonzero(batch.loss_seq == s).flatten()
        last = batch.loss_positions[terms].max() if terms.numel() else torch.tensor(0, device=batch.input_ids.device)
        rows = torch.arange(batch.num_tokens, device=batch.input_ids.device)
        out.append((rows[(rows <= last) & (batch.subtree_end > last)], terms))
    return out


def _right_padded_routes(routes: Tensor, length: int) -> Tensor:
    """A sequence's routes for its right-padded run: the padding routes as the model chooses (-1)."""
    return torch.cat([routes, routes.new_full((length - len(routes), *routes.shape[1:]), -1)])


@torch.no_grad()
def verify_row(
    model: nn.Module, batch: PackedBatch, *, attention_backend: str = "auto", temperature: float = 1.0, chunk_size: int = 1024, samples: int = 2, seed: int = 0,
    suppressed: tuple[int, ...] = (),
) -> tuple[float, torch.dtype, float]:
    """Max |packed - per-sequence| log-prob of a real row, over ``samples`` of its sequences (the one ending the row,
    furthest from the row's start, and one drawn with ``seed``), the compute dtype, and the largest |logit| there
    (`_tolerance`). In eval mode, so dropout does not count as a difference; the same number of forwards on every
    rank, the error agreed across ranks."""
    scored = torch.unique(batch.loss_seq).tolist()
    g = torch.Generator().manual_seed(seed)
    chosen = [int(batch.loss_seq[-1])] if scored else [0]
    while len(chosen) < samples:
        chosen.append(scored[int(torch.randint(len(scored), (1,), generator=g))] if scored else 0)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        packed = packed_logprobs(model, batch, chunk_size=chunk_size, temperature=temperature, attention_backend=attention_backend, suppressed=suppressed)
        weight, bias, transform = lm_head_of(model, temperature, suppressed)
        error, dtype, scale = 0.0, torch.float32, 0.0
        token = image_token_id(model.config)
        images = split_images(batch.image_inputs, image_runs(batch.input_ids.tolist(), token) if token is not None else None)
        head = batch.prefix if isinstance(batch, PrefixedRow) else None  # a span's row: its prefix (chain) leads each path
        ahead = split_images(head.image_inputs, image_runs(head.input_ids.tolist(), token)) if head is not None and head.image_inputs else []
        for rows, terms in sequence_paths(batch, chosen):
            ids = batch.input_ids[rows] if head is None else torch.cat([head.input_ids, batch.input_ids[rows]])
            routes = None if batch.routes is None else (batch.routes[rows] if head is None else torch.cat([head.routes, batch.routes[rows]]))
            real = len(ids)
            ids = _right_padded(ids, batch.pad_to_multiple_of)
            positions = torch.arange(len(ids), device=ids.device)
            positions[real:] = 0  # the padding placed at 0, not past the sequence (a learned table's end)
            if batch.rope_position_ids is not None:  # its own multi-axis positions (after its prefix's), padded on as the row pads
                rope = batch.rope_position_ids[:, rows] if head is None else torch.cat([head.rope_position_ids, batch.rope_position_ids[:, rows]], 1)
                positions = torch.cat([rope, positions[rope.shape[1] :].expand(rope.shape[0], -1)], 1)[:, None]
            own = stack_images(ahead + [images[k] for k in images_on_path(batch.input_ids, rows, token)]) if ahead or images else {}
            with replaying(model, None if routes is None else RouteReplay(_right_padded_routes(routes, len(ids)))):
                hidden = head_inputs(model, ids, positions, **own, **(image_token_types(model, ids[None]) if own else {}))
            dtype = _compute_dtype(hidden)
            if terms.numel():
                depth = batch.position_ids[batch.loss_positions[terms]]
                support = None if batch.token_support is None else batch.token_support[terms]  # as the row scores them
                alone = token_logprobs(hidden.index_select(0, depth), weight, batch.loss_targets[terms], chunk_size=chunk_size, transform=transform, bias=bias,
                                       support=support)
                error = max(error, float((packed[terms] - alone).abs().max()))
                scale = max(scale, max_abs_logit(hidden.index_select(0, depth), weight, chunk_size=chunk_size, transform=transform, bias=bias))
    finally:
        for module, training in modes:
            module.training = training
    return _agree(error, model, batch.input_ids.device), dtype, scale


@dataclass
class PackingVerifier:
    """When a module checks its packed rows (recipe keys ``verify_packing``, ``verify_packing_every``)."""

    mode: VerifyPacking = "first_step"
    every: int = 100
    last_step: int | None = None  # the step last checked (once per step, whatever the accumulation)

    def __post_init__(self) -> None:
        if self.mode not in ("first_step", "every_n_steps", "never"):
            raise ValueError(f"verify_packing must be first_step, every_n_steps or never, got {self.mode!r}")
        if self.every < 1:
            raise ValueError(f"verify_packing_every must be a positive number of steps, got {self.every}")

    def due(self, step: int) -> bool:
        if self.mode == "never" or self.last_step == step:
            return False
        return self.last_step is None or (self.mode == "every_n_steps" and step % self.every == 0)

    def check(self, model: nn.Module, batch: PackedBatch, *, step: int, backend: str, strategy=None, **kwargs) -> float:
        """The row's error, the largest over ranks when a Lightning ``strategy`` is given (so all ranks stop or none);
        refuses the run, before any weight changes, beyond the tolerance of the compute dtype."""
        self.last_step = step
        error, dtype, scale = verify_row(model, batch, attention_backend=backend, seed=step, **kwargs)
        if strategy is not None:
            error, scale = strategy.reduce(torch.tensor([error, scale], device=batch.input_ids.device), reduce_op="max").tolist()
        tolerance = _tolerance(dtype, scale)
        if error > tolerance:
            raise PackingRefused(
                f"{type(model).__name__}: verify_packing at step {step}: packed log-probs are {error:.2e} away from each "
                f"sequence run alone ({backend} attention, {str(dtype).removeprefix('torch.')}, tolerance {tolerance:.0e}); stopped before any weight changed"
            )
        return error

