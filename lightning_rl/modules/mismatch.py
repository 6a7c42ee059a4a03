"""Trainer equals sampler, checked every step: how far the engine's log-probs of the tokens it sampled are from the
trainer's at the first pass over a batch (and, for a mixture-of-experts model, how often the trainer would have
routed them as the engine did), the alarm that stops a run when that is more than rounding explains, and which
log-probs the ratio is taken against when a batch can come from older weights.

With ``d = log p_trainer - log p_engine`` per sampled token, ``exp(d) - d - 1`` (k3) estimates KL(engine || trainer)
without bias and is never negative. A batch sampled by the weights the trainer holds (staleness 0) measures the
mismatch itself (``train/mismatch/kl``, judged by the alarm); a stale one measures the lag plus the mismatch, which
cannot be told apart without the older weights, and is logged apart (``train/offpolicy/kl``), never judged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_rl.errors import RecipeError, UserError
from lightning_rl.losses import GRPOLoss
from lightning_rl.losses.grpo import TokenLoss
from lightning_rl.models.routing import RouteAgreement, RouterReplaySetting, find_routers, router_replay_on
from lightning_rl.rollout.base import RolloutEngine

OldLogprobs = Literal["auto", "trainer", "engine"]
Reduce = Callable[..., Tensor]  # a strategy's reduce(tensor, reduce_op=...) over every rank


class MismatchAlarm(UserError):
    """The engine and the trainer disagree on the tokens the engine sampled with the trainer's own weights by more
    than ``mismatch_alarm_kl``. Exit code 1, as a diverged run: the recipe ran, and training on would follow a
    policy that is not the one sampling."""

    key = "mismatch_alarm_kl"
    exit_code = 1
    on_every_rank = True  # judged on figures summed over every rank


def alarm_bound(value: Any) -> float | None:
    """``mismatch_alarm_kl`` as given: a finite number > 0, or None (no alarm)."""
    if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0):
        raise RecipeError(f"mismatch_alarm_kl must be a finite number > 0 (or null: no alarm), got {value!r}", "mismatch_alarm_kl")
    return value


def old_logprobs_source(
    setting: OldLogprobs, loss: GRPOLoss, async_mode: bool, max_staleness: int, num_iterations: int, *, ignore_staleness: bool
) -> Literal["trainer", "engine"]:
    """What the ratio's old log-probs are. ``auto``: the engine's when a trained batch can be stale (``async_mode``
    with ``max_staleness >= 1``) and the engine-vs-trainer correction is off: they are the behaviour policy's, so
    the clipped ratio ``p_now / p_sampler`` corrects the lag and bounds it; else the trainer's. An explicit
    ``trainer`` on batches that can be stale without the correction (which weighs each token by ``p_trainer /
    p_sampler``, bounded) would train them as on-policy: refused unless ``ignore_staleness``."""
    stale = async_mode and max_staleness > 0
    source = ("engine" if stale and not loss.corrects_engine else "trainer") if setting == "auto" else setting
    if loss.corrects_engine and source == "engine":
        key = "importance_sampling_cap" if loss.importance_sampling_cap is not None else "importance_sampling_floor"
        raise RecipeError(
            f"loss.{key} corrects trainer vs engine log-probs; with old_logprobs='engine' the ratio already uses "
            "the engine's, so the correction would apply twice", f"loss.{key}",
        )
    if num_iterations > 1 and stale and source == "trainer":
        raise RecipeError(
            f"num_iterations={num_iterations} with async_mode and max_staleness={max_staleness}: a batch may come "
            "from weights older than the trainer's, whose log-probs only the engine has; set old_logprobs: engine "
            "or max_staleness: 0", "num_iterations",
        )
    if stale and source == "trainer" and not loss.corrects_engine and not ignore_staleness:
        raise RecipeError(
            f"old_logprobs: trainer with async_mode and max_staleness={max_staleness} and no loss.importance_sampling_cap "
            "trains a batch sampled by older weights as if on-policy (ratio 1, nothing clipped); leave old_logprobs: auto "
            "(the engine's), set loss.importance_sampling_cap, or ignore_staleness: true", "old_logprobs",
        )
    return source


def replay_routes(setting: RouterReplaySetting, policy: nn.Module, engine: RolloutEngine) -> int:
    """Switch the engine's route recording on where the run replays routes (`router_replay_on`); the number of
    route layers replayed (0: none)."""
    engine.record_routes = router_replay_on(setting, policy, type(engine).__name__, engine.can_record_routes)
    return len(find_routers(policy)) if engine.record_routes else 0


def unreplayed(sampling: Any, policy: nn.Module | None = None) -> str | None:
    """What the engine's sampling and the trainer's scoring do not share, named by its key: the repetition penalty
    (the engine applies it, the trainer does not replay it), or dropout (the trainer's forward in training applies
    it, the engine's does not: a LoRA's, or the model's own), or likewise a router's noise in training (Mixtral's
    and MiniMax's ``router_jitter_noise``, PhiMoE's ``input_jitter_noise`` and its sparsemixer's sampled routing)."""
    if sampling.repetition_penalty != 1.0:
        return f"model.sampling.repetition_penalty={sampling.repetition_penalty:g}, which the engine applies and the trainer does not replay"
    for name, module in (policy.named_modules() if policy is not None else ()):
        if isinstance(module, nn.Dropout) and module.p > 0:
            what = "model.lora.dropout" if "lora_dropout" in name else f"the model's own dropout ({name})"
            return f"{what}={module.p:g}, {_DROPOUT}"
    config = getattr(policy, "config", None)
    for sub in (config, config.get_text_config()) if config is not None else ():
        for key in ("router_jitter_noise", "input_jitter_noise"):
            if isinstance(noise := getattr(sub, key, None), (int, float)) and noise > 0:
                return f"the router's noise (the model's {key}={noise:g}), {_DROPOUT}"
        if getattr(sub, "model_type", None) == "phimoe":
            return f"PhiMoE's sparsemixer, which samples its routing weights in training, {_DROPOUT}"
    return None


# What an unreplayed dropout is said to be: the figure then measures the dropout, so the alarm does not judge it.
_DROPOUT = "which the trainer's forward applies and the engine's does not"


@dataclass
class MismatchStats:
    """Sums over the rows of one batch's first pass: k3, ratio, its extremes and the corrected tokens, ``|d|`` and
    its largest (TRL's ``sampling_logp_difference``), the engine-vs-trainer weights the loss applied where it corrects
    (TRL's ``importance_sampling_ratio``: per token, or per sequence in the ``sequence_*`` modes), and the route
    agreement of ``route_layers`` routers (0: no replay)."""

    route_layers: int = 0
    routes: RouteAgreement = field(default_factory=RouteAgreement)
    k3: float = 0.0
    ratio: float = 0.0
    ratio_min: float = math.inf
    ratio_max: float = -math.inf
    corrected: float = 0.0
    tokens: int = 0
    logp_diff: float = 0.0
    logp_diff_max: float = 0.0
    weight: float = 0.0
    weights: int = 0  # tokens, or sequences in the sequence_* modes
    weight_min: float = math.inf
    weight_max: float = -math.inf
    corrects: bool = False  # the loss weighs terms by the engine-vs-trainer ratio (every rank logs its weights then)
    unreplayed: str | None = None  # what the engine applies and the trainer does not: named first by an alarm

    def add(self, trainer_logprobs: Tensor, engine_logprobs: Tensor, terms: TokenLoss) -> None:
        """One row's trained tokens: the trainer's log-probs at the first pass, the engine's, and the loss's terms
        (which tokens the engine-vs-trainer correction truncated or masked, and the weights it applied)."""
        d = (trainer_logprobs.detach() - engine_logprobs).double()
        if d.numel() == 0:
            return
        ratio = d.exp()
        self.k3 += float((ratio - d - 1).sum())
        self.ratio += float(ratio.sum())
        self.ratio_min = min(self.ratio_min, float(ratio.min()))
        self.ratio_max = max(self.ratio_max, float(ratio.max()))
        self.corrected += 0.0 if terms.corrected is None else float(terms.corrected.sum())
        self.tokens += d.numel()
        self.logp_diff += float(d.abs().sum())
        self.logp_diff_max = max(self.logp_diff_max, float(d.abs().max()))
        if terms.engine_weight is not None:
            weight = terms.engine_weight.double()
            if terms.engine_weight_seq is not None:  # one per sequence, repeated over its terms: each sequence's once
                seq = terms.engine_weight_seq
                counts = torch.bincount(seq)
                weight = (torch.bincount(seq, weights=weight) / counts.clamp(min=1))[counts > 0]
            self.weight += float(weight.sum())
            self.weights += weight.numel()
            self.weight_min = min(self.weight_min, float(weight.min()))
            self.weight_max = max(self.weight_max, float(weight.max()))

    def metrics(self, reduce: Reduce, device: torch.device, staleness: int, alarm_kl: float | None) -> dict[str, float]:
        """The figures over every rank (``train/`` is put in front by the caller); raises `MismatchAlarm` when a batch
        of staleness 0 shows a KL above ``alarm_kl``."""
        sums = reduce(torch.tensor([self.k3, self.ratio, self.corrected, self.tokens, self.logp_diff, self.weight, self.weights],
                                   dtype=torch.float64, device=device), reduce_op="sum")  # fmt: skip
        extremes = reduce(torch.tensor([-self.ratio_min, self.ratio_max, self.logp_diff_max, -self.weight_min, self.weight_max],
                                       dtype=torch.float64, device=device), reduce_op="max")  # fmt: skip
        k3, ratio, corrected, tokens, logp_diff, weight, weights = sums.tolist()
        # A step that trains no token (every completion masked) logs 0 for each, as TRL does, not nothing: a logger's
        # summary (W&B's) would keep the last step's figure as the run's.
        kl = k3 / tokens if tokens else 0.0
        out = {"mismatch/ratio_mean": ratio / tokens if tokens else 0.0, "mismatch/ratio_min": -float(extremes[0]) if tokens else 0.0,
               "mismatch/ratio_max": float(extremes[1]) if tokens else 0.0, "mismatch/corrected_fraction": corrected / tokens if tokens else 0.0,
               "mismatch/logp_diff_mean": logp_diff / tokens if tokens else 0.0, "mismatch/logp_diff_max": float(extremes[2])}  # fmt: skip
        if self.corrects:
            out.update({"mismatch/is_ratio_mean": weight / weights if weights else 0.0, "mismatch/is_ratio_min": -float(extremes[3]) if weights else 0.0,
                        "mismatch/is_ratio_max": float(extremes[4]) if weights else 0.0})  # fmt: skip
        out.update({"mismatch/kl": kl, "offpolicy/kl": 0.0} if staleness == 0 else {"offpolicy/kl": kl})
        if tokens > 0:
            if staleness == 0 and alarm_kl is not None and kl > alarm_kl and not (self.unreplayed or "").endswith(_DROPOUT):
                cause = f"{self.unreplayed}; other " if self.unreplayed else ""
                raise MismatchAlarm(
                    f"train/mismatch/kl is {kl:.3g} (> {alarm_kl:g}) on a batch the engine sampled with the trainer's "
                    f"own weights: engine and trainer score those tokens differently; likely causes: {cause}weights not synced "
                    "to the engine, a chat template or tokenizer that differs between engine and trainer, a dtype "
                    "mismatch, or a sampling filter or expert route that is not replayed"
                )
        if self.route_layers:
            if self.routes.agreed.numel() < self.route_layers:  # a rank whose rows routed nothing sums zeros
                self.routes.add(self.route_layers - 1, 0, 0, self.route_layers)
            counts = reduce(torch.stack([self.routes.agreed, self.routes.compared]).to(device), reduce_op="sum").cpu()
            agreement = RouteAgreement(counts[0], counts[1]).value
            if agreement is not None:
                out["mismatch/route_agreement"] = agreement
        return out
