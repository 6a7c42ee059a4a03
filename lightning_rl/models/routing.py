"""Router replay for mixture-of-experts models: record which experts each token went to, and force those experts
in another forward while the gate's own probabilities still weigh them.

The engine and the trainer compute a router's logits equal up to rounding, and a near tie then sends a token to
other experts on each side: the trainer would score a computation the engine never ran. Replaying the engine's
selection removes that difference; the weights over the selected experts stay the trainer's own, so the gate gets
gradients as the model defines them.

Every family's router here is a module returning ``(router_logits, top_k_weights, top_k_indices)`` for the tokens
of a forward, flattened. ``ROUTERS`` says, per router class, how the weights follow from the logits for given
indices (the family's own rule: softmax then top-k, or sigmoid with a selection bias; normalised or not,
scaled); a forward hook recomputes them for the forced indices. On every call the rule is checked against the
router's own weights for its own choice, so a transformers version that changes a rule is refused, not replayed
wrong. Routes are ``[tokens, layers, top_k]`` small ints, one layer per router in module order; ``-1`` marks a
token the engine never routed (a sequence's last token, whose outputs nothing reads): it keeps its own choice.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from lightning_rl.errors import UserError

RouterReplaySetting = Literal["auto", True, False]
ROUTE_DTYPE = torch.int16  # expert ids of every family here fit; -1 marks an unrouted token


class RouterReplayError(UserError, ValueError):
    """Router replay asked of a model or engine that cannot do it (the module's ``router_replay``: the run names it
    ``model.router_replay``)."""

    key = "router_replay"


# -- the families ------------------------------------------------------------------------------------------------

Rule = Callable[[nn.Module, Tensor, Tensor], Tensor]  # (router, router_logits, indices [T, k]) -> weights [T, k]


def _softmax_then_top_k(normalise: Callable[[nn.Module], bool], back_to_logits_dtype: bool) -> Rule:
    """Qwen3-MoE, OLMoE (``norm_topk_prob``), Mixtral (always normalised, weights kept in fp32)."""

    def rule(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
        weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, indices)
        if normalise(router):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype) if back_to_logits_dtype else weights

    return rule


def _sigmoid_with_bias(normalise: Callable[[nn.Module], bool], eps: Callable[[nn.Module], float]) -> Rule:
    """DeepSeek-V3 and Muse Spark: sigmoid scores; the selection bias (``e_score_correction_bias``, and DeepSeek's
    expert groups) only chooses, so it is not in the weights; normalised, then scaled by ``routed_scaling_factor``."""

    def rule(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
        weights = logits.sigmoid().gather(1, indices)
        if normalise(router):
            weights = weights / (weights.sum(dim=-1, keepdim=True) + eps(router))
        return weights * router.routed_scaling_factor

    return rule


_norm_topk = lambda router: bool(router.norm_topk_prob)  # noqa: E731
ROUTERS: dict[str, Rule] = {
    "Qwen3MoeTopKRouter": _softmax_then_top_k(_norm_topk, back_to_logits_dtype=True),
    "OlmoeTopKRouter": _softmax_then_top_k(_norm_topk, back_to_logits_dtype=True),
    "MixtralTopKRouter": _softmax_then_top_k(lambda router: True, back_to_logits_dtype=False),
    "DeepseekV3TopkRouter": _sigmoid_with_bias(_norm_topk, lambda router: 1e-20),
    "MuseSparkTopkRouter": _sigmoid_with_bias(lambda router: True, lambda router: router.norm_topk_prob_eps),
}


def is_experts_module(module: nn.Module) -> bool:
    """A transformers routed-experts module: grouped 3-D weights behind ``use_experts_implementation``."""
    return hasattr(module, "_is_expert_parallel") and isinstance(getattr(module, "num_experts", None), int)


def is_moe(model: nn.Module) -> bool:
    return any(is_experts_module(m) or router_kind(m) in ROUTERS for m in model.modules())


def router_kind(module: nn.Module) -> str:
    """The class name ``ROUTERS`` knows a module by: its own, or its class's under a parametrization (peft's LoRA on
    the router's weight makes a ``Parametrized...`` subclass of it)."""
    cls = type(module)
    return cls.__bases__[0].__name__ if parametrize.is_parametrized(module) and cls.__name__.startswith("Parametrized") else cls.__name__


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The routers of ``model`` in module order (one route layer each); a mixture-of-experts model whose router
    this table does not know is refused, naming its experts' class."""
    routers = [m for m in model.modules() if router_kind(m) in ROUTERS]
    if not routers and is_moe(model):
        experts = next(type(m).__name__ for m in model.modules() if is_experts_module(m))
        raise RouterReplayError(
            f"{type(model).__name__} routes tokens to experts ({experts}) with a router lightning_rl.models.routing "
            f"does not know (it knows {', '.join(sorted(ROUTERS))}); set it to false to train without replay"
        )
    return routers


def top_k(model: nn.Module) -> int:
    return int(find_routers(model)[0].top_k)


# -- recording (the engine) --------------------------------------------------------------------------------------


@dataclass
class RouteRecorder:
    """Each router's chosen experts, per forward call of the model: ``calls[c]`` is ``[tokens of call c, layers,
    top_k]`` (the tokens of a batch flattened in the model's order, batch first)."""

    layers: int
    calls: list[Tensor] = field(default_factory=list)
    _pending: list[Tensor] = field(default_factory=list)

    def _take(self, layer: int, indices: Tensor) -> None:
        if layer != len(self._pending):
            raise RuntimeError(f"router {layer} ran out of order (after {len(self._pending)} of {self.layers} in this forward)")
        self._pending.append(indices.detach().to("cpu", ROUTE_DTYPE))
        if len(self._pending) == self.layers:
            self.calls.append(torch.stack(self._pending, dim=1))
            self._pending = []


@contextlib.contextmanager
def record_routes(model: nn.Module) -> Iterator[RouteRecorder]:
    """Record the experts every router of ``model`` chooses while the block runs."""
    routers = find_routers(model)
    recorder = RouteRecorder(len(routers))
    hooks = [
        router.register_forward_hook(lambda module, args, output, layer=layer: recorder._take(layer, output[2]))
        for layer, router in enumerate(routers)
    ]
    try:
        yield recorder
    finally:
        for hook in hooks:
            hook.remove()
    if recorder._pending:
        raise RuntimeError(f"a forward ran {len(recorder._pending)} of the model's {len(routers)} routers")


# -- replay (the trainer) ----------------------------------------------------------------------------------------


@dataclass
class RouteAgreement:
    """Per route layer: tokens whose experts the model chose itself as the replayed routes say, and tokens compared.
    Adds up over the rows of a step; ``value`` is the fraction per layer, averaged over layers."""

    agreed: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    compared: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))

    def add(self, layer: int, agreed: int, compared: int, layers: int) -> None:
        if self.agreed.numel() < layers:
            grow = lambda t: torch.cat([t, t.new_zeros(layers - t.numel())])  # noqa: E731
            self.agreed, self.compared = grow(self.agreed), grow(self.compared)
        self.agreed[layer] += agreed
        self.compared[layer] += compared

    def merge(self, other: RouteAgreement) -> None:
        for layer in range(other.agreed.numel()):
            self.add(layer, float(other.agreed[layer]), float(other.compared[layer]), other.agreed.numel())

    @property
    def value(self) -> float | None:
        """None when no token was compared."""
        seen = self.compared > 0
        return float((self.agreed[seen] / self.compared[seen]).mean()) if bool(seen.any()) else None


@dataclass
class RouteReplay:
    """The routes of one forward's tokens, ``[tokens, layers, top_k]``; forced when ``force``, else only compared
    with the model's own choice (which is what ``agreement`` counts either way)."""

    routes: Tensor
    force: bool = True
    agreement: RouteAgreement = field(default_factory=RouteAgreement)

    def check(self, model: nn.Module, tokens: int) -> None:
        layers, k = len(find_routers(model)), top_k(model)
        want = (tokens, layers, k)
        if tuple(self.routes.shape) != want:
            raise ValueError(
                f"routes of shape {tuple(self.routes.shape)} for a forward of {tokens} tokens through {layers} routers "
                f"choosing {k} experts each (want {want})"
            )


# The replay of the forward running in this context; a checkpointed layer recomputed in backward gets the one its
# forward had (``checkpoint_contexts``), counted once.
_CURRENT: ContextVar[tuple[RouteReplay, bool] | None] = ContextVar("router_replay", default=None)
_INSTALLED: weakref.WeakKeyDictionary[nn.Module, list[nn.Module]] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def replaying(model: nn.Module, replay: RouteReplay | None) -> Iterator[None]:
    """Forwards of ``model`` in the block use ``replay`` (nothing when None)."""
    if replay is None:
        yield
        return
    _install(model)
    token = _CURRENT.set((replay, True))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def checkpoint_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``context_fn`` of a non-reentrant activation checkpoint: the recomputation in backward replays the routes its
    forward replayed (without counting them again), whatever thread runs it."""
    current = _CURRENT.get()
    return contextlib.nullcontext(), _recomputing(current)


@contextlib.contextmanager
def _recomputing(current: tuple[RouteReplay, bool] | None) -> Iterator[None]:
    token = _CURRENT.set(None if current is None else (current[0], False))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def _install(model: nn.Module) -> None:
    """One forward hook per router, once per model; each does nothing outside ``replaying``."""
    if model in _INSTALLED:
        return
    routers = find_routers(model)
    if not routers:
        raise RouterReplayError(f"{type(model).__name__} is not a mixture-of-experts model: it has no routed experts to replay")
    for layer, router in enumerate(routers):
        router.register_forward_hook(lambda module, args, output, layer=layer, layers=len(routers): _replay(module, output, layer, layers))
    _INSTALLED[model] = routers


def _same_experts(a: Tensor, b: Tensor) -> Tensor:
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)


def _replay(router: nn.Module, output: tuple[Tensor, Tensor, Tensor], layer: int, layers: int) -> tuple[Tensor, Tensor, Tensor] | None:
    current = _CURRENT.get()
    if current is None:
        return None
    replay, count = current
    logits, weights, own = output
    rule = ROUTERS[router_kind(router)]
    with torch.no_grad():
        ruled = rule(router, logits, own)
        if ruled.dtype != weights.dtype or not torch.allclose(ruled.float(), weights.float(), rtol=1e-5, atol=1e-6):
            raise RuntimeError(
                f"{type(router).__name__}: the routing rule lightning_rl.models.routing holds for it no longer gives the "
                "router's own weights (a transformers version that routes otherwise); its routes cannot be replayed"
            )
    routes = replay.routes[:, layer].to(own.device, own.dtype)
    if routes.shape != own.shape:
        raise ValueError(f"router {layer}: routes of shape {tuple(routes.shape)} for a choice of shape {tuple(own.shape)}")
    routed = routes[:, 0] >= 0
    forced = torch.where(routed[:, None], routes, own)
    if count:
        agreed = int((_same_experts(own, forced) & routed).sum())
        replay.agreement.add(layer, agreed, int(routed.sum()), layers)
    if not replay.force:
        return None
    return logits, rule(router, logits, forced), forced


# -- the recipe key ----------------------------------------------------------------------------------------------


def router_replay_on(setting: RouterReplaySetting, model: nn.Module, engine: str, engine_records_routes: bool) -> bool:
    """Whether a run replays routes: ``auto`` on a mixture-of-experts model whose routers are known and whose engine
    records routes; ``true`` refuses, in one line, a dense model, an unknown router or an engine that cannot record."""
    if setting not in ("auto", True, False):
        raise RouterReplayError(f"router_replay must be auto, true or false, got {setting!r}")
    if setting is False:
        return False
    moe = is_moe(model)
    if setting == "auto":
        known = moe and any(router_kind(m) in ROUTERS for m in model.modules())
        return known and engine_records_routes
    if not moe:
        raise RouterReplayError(
            f"router_replay: true, but {type(model).__name__} is a dense model (no routed experts to replay)"
        )
    find_routers(model)
    if not engine_records_routes:
        raise RouterReplayError(
            f"router_replay: true, but the {engine} engine cannot record the experts it routes each token to"
        )
    return True
