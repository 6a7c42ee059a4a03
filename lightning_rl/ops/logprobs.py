"""Per-token log-probabilities without ever building the full [tokens x vocab] logits.

The LM head runs in chunks of tokens. The forward keeps only each token's log-sum-exp; the backward recomputes
one chunk of logits at a time, so peak memory is one [chunk x vocab] block whatever the number of tokens.

With a per-token ``support`` (the token ids a sampling filter kept: top-k, top-p, min-p) a token's log-prob is that
of the distribution the sampler drew from, renormalised over its support: ``z[target] - logsumexp(z[support])``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint
from torch import Tensor, nn

from lightning_rl.attention.tree_attention import PackingRefused



@dataclass(frozen=True)
class LogitTransform:
    """What turns ``z = h @ W.T`` into the logits sampled from: ``cap * tanh(scale * z / cap) / temperature``
    (without a soft-cap, ``scale * z / temperature``)."""

    scale: float = 1.0
    softcap: float | None = None
    temperature: float = 1.0
    suppressed: tuple[int, ...] = ()  # tokens that are never sampled: out of the distribution altogether

    @classmethod
    def of(cls, config, temperature: float = 1.0, suppressed: tuple[int, ...] = ()) -> LogitTransform:
        if temperature <= 0:
            raise ValueError(f"temperature must be positive to score tokens, got {temperature}")
        text = config.get_text_config()
        scale = float(getattr(text, "output_multiplier", None) or getattr(text, "logit_scale", None) or 1.0)
        if getattr(text, "logits_scaling", None):
            scale /= float(text.logits_scaling)
        return cls(scale=scale, softcap=getattr(text, "final_logit_softcapping", None), temperature=temperature, suppressed=tuple(suppressed))


def _logit_dtype(dtype: torch.dtype) -> torch.dtype:
    """Logits and log-probs are fp32, or fp64 for fp64 hidden states (the noise-free references of the tests)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_FP32_OUT: dict[str, bool] = {}  # per device type: whether 16-bit matmuls there can write float32 (``out_dtype``)


def _head_matmul(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``h @ weight.T + bias`` in fp32 (fp64 for fp64 inputs), whatever autocast is on, in the forward and in the
    backward's recomputation alike: 16-bit inputs multiply at their precision with a float32 result on CUDA (the
    accumulator is never rounded to 16 bits: a logit of 20 would be off by up to 0.06), and are upcast elsewhere, and
    wherever autograd records the product (a differentiable entropy bonus)."""
    dtype = _logit_dtype(h.dtype)
    device = h.device.type
    with torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device) else contextlib.nullcontext():
        low = {h.dtype, weight.dtype} & {torch.bfloat16, torch.float16}
        graph = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)  # mm's out_dtype has no backward
        if low and device == "cuda" and not graph and _FP32_OUT.get(device, True):
            half = low.pop()
            try:
                z = torch.mm(h.to(half), weight.to(half).t(), out_dtype=torch.float32)
                return z if bias is None else z + bias.to(torch.float32)
            except (RuntimeError, NotImplementedError, TypeError):  # a torch without it: upcast from now on
                _FP32_OUT[device] = False
        return nn.functional.linear(h.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, transform: LogitTransform) -> tuple[Tensor, Tensor | None]:
    """Logits of one chunk in fp32 (fp64 for fp64 inputs; `_head_matmul`), and tanh(.) when a soft-cap applies (its
    gradient needs it)."""
    z = _head_matmul(h, weight, bias)
    if transform.scale != 1.0:
        z = z * transform.scale
    if transform.softcap is None:
        return _suppress(z / transform.temperature if transform.temperature != 1.0 else z, transform), None
    t = torch.tanh(z / transform.softcap)
    return _suppress(t * (transform.softcap / transform.temperature), transform), t


# A logit no token of the vocabulary reaches: exp() of it (less any log-sum-exp) is 0, and it stays finite.
_NEVER = -1e30


def _suppress(logits: Tensor, transform: LogitTransform) -> Tensor:
    if transform.suppressed:
        logits = logits.index_fill(1, torch.tensor(transform.suppressed, device=logits.device), _NEVER)
    return logits


def _normaliser(logits: Tensor, support: Tensor | None) -> Tensor:
    """Each row's log-sum-exp over its support, or over the whole row where it has none (padding only)."""
    full = torch.logsumexp(logits, dim=-1)
    if support is None:
        return full
    kept, restricted = _kept(support)
    within = torch.logsumexp(_support_logits(logits, support, kept), dim=-1)
    return torch.where(restricted, within, full)


def _kept(support: Tensor) -> tuple[Tensor, Tensor]:
    """Which entries of ``support`` are token ids (the rest is -1 padding), and which rows hold any."""
    kept = support >= 0
    return kept, kept.any(dim=1)


def _support_logits(logits: Tensor, support: Tensor, kept: Tensor) -> Tensor:
    return logits.gather(1, support.clamp(min=0)).masked_fill_(~kept, float("-inf"))


def _check_support(support: Tensor, targets: Tensor, start: int) -> None:
    kept, restricted = _kept(support)
    ordered = support.sort(dim=1).values  # an id twice would count its probability twice in the normaliser
    repeated = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(dim=1)
    if bool(repeated.any()):
        row = int(repeated.nonzero()[0, 0])
        raise ValueError(f"token {start + row}: its sampling support names a token id twice ({support[row].tolist()})")
    outside = restricted & ~((support == targets[:, None]) & kept).any(dim=1)
    if bool(outside.any()):
        row = start + int(outside.nonzero()[0, 0])
        raise ValueError(f"token {row}: target {int(targets[row - start])} is not in its sampling support (the sampler cannot have drawn it)")


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, transform, support):
        logprobs = torch.empty(targets.shape, dtype=_logit_dtype(hidden.dtype), device=hidden.device)
        lse = torch.empty_like(logprobs)
        with torch.no_grad():
            for s in range(0, hidden.shape[0], chunk_size):
                rows = slice(s, s + chunk_size)
                sup = None if support is None else support[rows].long()
                if sup is not None:
                    _check_support(sup, targets[rows], s)
                logits, _ = _chunk_logits(hidden[rows], weight, bias, transform)
                lse[rows] = _normaliser(logits, sup)
                picked = logits.gather(1, targets[rows, None]).squeeze(1)
                logprobs[rows] = picked - lse[rows]
        ctx.save_for_backward(hidden, weight, bias, targets, lse, support)
        ctx.chunk_size, ctx.transform = chunk_size, transform
        return logprobs

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets, lse, support = ctx.saved_tensors
        transform = ctx.transform
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        acc = _logit_dtype(hidden.dtype)
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if bias is not None and ctx.needs_input_grad[2] else None
        for s in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(s, s + ctx.chunk_size)
            h, go = hidden[rows], grad_out[rows].to(acc)
            logits, t = _chunk_logits(h, weight, bias, transform)
            # d logp(target) / d logits = onehot(target) - p, p the distribution normalised by lse (its support's, or
            # the whole row's), scaled by the upstream gradient
            sup = None if support is None else support[rows].long()
            within = None if sup is None else _support_logits(logits, sup, _kept(sup)[0]).sub_(lse[rows, None]).exp_()
            g = logits.sub_(lse[rows, None]).exp_()
            if sup is not None:
                g.masked_fill_(_kept(sup)[1][:, None], 0.0).scatter_add_(1, sup.clamp(min=0), within)
            g.mul_(-go[:, None])
            g.scatter_add_(1, targets[rows, None], go[:, None])
            if t is not None:
                g.mul_(t.mul_(t).neg_().add_(1))
            if transform.scale != 1.0 or transform.temperature != 1.0:
                g.mul_(transform.scale / transform.temperature)
            g = g.to(h.dtype)
            if grad_hidden is not None:
                torch.mm(g, weight, out=grad_hidden[rows])
            if grad_weight is not None:
                grad_weight.addmm_(g.t(), h) if h.dtype == acc else grad_weight.add_((g.t() @ h).to(acc))
            if grad_bias is not None:
                grad_bias += g.to(acc).sum(0)
        to = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
        return grad_hidden, to(grad_weight, weight), to(grad_bias, bias) if bias is not None else None, None, None, None, None


def token_logprobs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    targets: Tensor,
    *,
    chunk_size: int = 1024,
    transform: LogitTransform = LogitTransform(),
    bias: Tensor | None = None,
    support: Tensor | None = None,
) -> Tensor:
    """log p(targets[i] | hidden[i]) under the LM head, in fp32 (fp64 for fp64 inputs), ``chunk_size`` tokens at a time.

    ``support`` ([tokens, K] token ids, -1 as padding): row ``i`` holds the tokens the sampler could draw at token
    ``i``, and its log-prob is renormalised over them; a row of padding only scores the whole distribution.
    """
    if hidden.shape[0] == 0:  # still a function of every weight: a rank with nothing to train backpropagates as the others
        head = 0 * lm_head_weight.sum() + (0 if bias is None else 0 * bias.sum())
        return (hidden.sum(-1) * 0).to(_logit_dtype(hidden.dtype)) + head
    if support is not None and (support.dim() != 2 or support.shape[0] != targets.shape[0]):
        raise ValueError(f"support of shape {tuple(support.shape)} for {targets.shape[0]} tokens (want [tokens, K])")
    if transform.suppressed:
        never = torch.isin(targets, torch.tensor(transform.suppressed, device=targets.device))
        if bool(never.any()):
            row = int(never.nonzero()[0, 0])
            raise ValueError(f"token {row}: target {int(targets[row])} is a suppressed token (never sampled), so it has no log-prob")
    return _ChunkedLogProbs.apply(hidden, lm_head_weight, bias, targets, chunk_size, transform, support)


def _entropy(logits: Tensor) -> Tensor:
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def token_entropy(
    hidden: Tensor, lm_head_weight: Tensor, *, chunk_size: int = 1024, transform: LogitTransform = LogitTransform(),
    bias: Tensor | None = None,
) -> Tensor:
    """Entropy of the next-token distribution at each row of ``hidden``, ``chunk_size`` rows at a time.

    Differentiable when its inputs require grad (an entropy bonus): each chunk is recomputed in backward
    (activation checkpointing), so no [tokens x vocab] logits outlive their chunk, as in the log-prob head.
    """
    def chunk_entropy(h: Tensor, weight: Tensor, b: Tensor | None) -> Tensor:
        return _entropy(_chunk_logits(h, weight, b, transform)[0])

    grad = torch.is_grad_enabled() and (hidden.requires_grad or lm_head_weight.requires_grad)
    out = []
    for s in range(0, hidden.shape[0], chunk_size):
        h = hidden[s : s + chunk_size]
        out.append(checkpoint(chunk_entropy, h, lm_head_weight, bias, use_reentrant=False) if grad else chunk_entropy(h, lm_head_weight, bias))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=_logit_dtype(hidden.dtype))


@torch.no_grad()
def max_abs_logit(
    hidden: Tensor, lm_head_weight: Tensor, *, chunk_size: int = 1024, transform: LogitTransform = LogitTransform(), bias: Tensor | None = None,
) -> float:
    """The largest |logit| the head gives ``hidden`` (suppressed tokens aside): what 16-bit noise in the hidden states
    is multiplied by in the log-probs."""
    largest = 0.0
    for s in range(0, hidden.shape[0], chunk_size):
        logits, _ = _chunk_logits(hidden[s : s + chunk_size], lm_head_weight, bias, transform)
        kept = logits[logits > _NEVER / 2]
        largest = max(largest, float(kept.abs().max()) if kept.numel() else 0.0)
    return largest


@torch.no_grad()
def token_stats(
    hidden: Tensor, lm_head_weight: Tensor, targets: Tensor, *, chunk_size: int = 1024, transform: LogitTransform = LogitTransform(),
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The entropy of the next-token distribution at each row of ``hidden`` and whether its likeliest token is the
    row's target (TRL's ``entropy`` and ``mean_token_accuracy``), from one pass over the LM head, ``chunk_size`` rows
    at a time; nothing here has a gradient."""
    entropy, hits = [], []
    for s in range(0, hidden.shape[0], chunk_size):
        logits, _ = _chunk_logits(hidden[s : s + chunk_size], lm_head_weight, bias, transform)
        entropy.append(_entropy(logits))
        hits.append(logits.argmax(-1) == targets[s : s + chunk_size])
    if not entropy:
        return hidden.new_zeros(0, dtype=_logit_dtype(hidden.dtype)), torch.zeros(0, dtype=torch.bool, device=hidden.device)
    return torch.cat(entropy), torch.cat(hits)


# Per model, the (scale, softcap) its own forward was seen to apply to ``h @ W.T``, where that is not what its text
# config names (an image-text wrapper whose forward skips its text model's logit scale).
_SEEN_SCALING: weakref.WeakKeyDictionary[nn.Module, tuple[float, float | None]] = weakref.WeakKeyDictionary()


def match_head_scaling(model: nn.Module, hidden: Tensor, logits: Tensor) -> None:
    """Compare the model's own ``logits`` for ``hidden`` (the head's inputs) with the transform its text config names
    and with none, and score with the one that matches: a logit scale or soft-cap the config names applies only if the
    model's forward applies it."""
    head = model.get_output_embeddings()
    named = LogitTransform.of(model.config)
    if (named.scale, named.softcap) == (1.0, None) or not isinstance(head, nn.Linear):
        return
    z = nn.functional.linear(hidden, head.weight, head.bias).to(_logit_dtype(hidden.dtype))
    target = logits.to(z.dtype)

    def error(scale: float, softcap: float | None) -> float:
        applied = z * scale if softcap is None else softcap * torch.tanh(z * scale / softcap)
        return float((applied - target).abs().max())

    others = [(1.0, None)]  # the bare logits
    if getattr(model.config.get_text_config(), "logits_scaling", None):  # a multiplier (HyperCLOVAX), not Granite's divisor
        others.append((named.scale * float(model.config.get_text_config().logits_scaling) ** 2, named.softcap))
    named_error = error(named.scale, named.softcap)
    best_error, best = min((error(*other), other) for other in others)
    # The named transform stands unless it is plainly not what the forward computes and another plainly is.
    if named_error > 1e-3 * (1.0 + float(target.abs().max())) and best_error * 100 < named_error:
        _SEEN_SCALING[model] = best
    else:
        _SEEN_SCALING.pop(model, None)


def lm_head_of(model: nn.Module, temperature: float = 1.0, suppressed: tuple[int, ...] = ()) -> tuple[Tensor, Tensor | None, LogitTransform]:
    """The output projection's weight and bias, and what the model (and sampling: its ``temperature``, the
    ``suppressed`` tokens it never samples) does to its logits: what its config names, unless its own forward was
    seen to do otherwise (`match_head_scaling`)."""
    head = model.get_output_embeddings()
    extra = sorted({name for name, _ in head.named_parameters()} - {"weight", "bias"}) if isinstance(head, nn.Module) else []
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward or extra:
        what = f" with its own {', '.join(extra)}" if extra else ""
        raise PackingRefused(
            f"{type(model).__name__}: the output head is a {type(head).__name__}{what}; the chunked LM head computes a plain linear layer only "
            "(do not adapt lm_head with LoRA)"
        )
    transform = LogitTransform.of(model.config, temperature, suppressed)
    if model in _SEEN_SCALING:
        scale, softcap = _SEEN_SCALING[model]
        transform = dataclasses.replace(transform, scale=scale, softcap=softcap)
    return head.weight, head.bias, transform
