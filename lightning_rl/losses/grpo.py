"""The policy-gradient loss of GRPO and its variants: the clipped ratio of GRPO, DAPO, Dr.GRPO, BNPO and
LUSPO, CISPO's clipped weight on log p, SAPO's soft gate and VESPO's Gamma weight, with token- or
sequence-level (GSPO) ratios, a KL term, engine-vs-trainer importance sampling and entropy terms.

Every trained token gets a loss term; the variants differ in the term and in the weight each term gets
when summed. Those weights come from counts over the whole optimizer step (all micro-batches, all
ranks), so the gradient does not depend on how a step is split into micro-batches. What is computed per
sequence (GSPO's ratio, VESPO's weight, the off-policy mask) only needs each token's sequence, because a
sequence is never split across micro-batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from lightning_rl.errors import UserError

LossType = Literal["grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo"]
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
KLEstimator = Literal["k1", "k2", "k3"]
RatioLevel = Literal["token", "sequence"]
EngineCorrection = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]

CLIPPED = ("grpo", "dapo", "dr_grpo", "bnpo", "luspo")  # the loss types whose term is PPO's clipped ratio
_LOG_FLOOR = math.log(1e-8)  # VESPO works in log space; its weights are bounded below by 1e-8 (and above by e^20)


@dataclass(frozen=True)
class StepCounts:
    """What the normaliser of one optimizer step is computed from.

    `num_sequences` and `num_tokens` are summed over all ranks; `rank_tokens` is this rank's token
    count (BNPO normalises per rank). `world_size` undoes the gradient mean data parallelism takes.
    `entropy_tokens` is what the entropy bonus averages over, summed over ranks: the tokens kept by
    the top-entropy mask (None: every trained token, `num_tokens`).
    """

    num_sequences: int
    num_tokens: int
    rank_tokens: int
    world_size: int = 1
    max_completion_length: int = 1
    entropy_tokens: int | None = None


@dataclass
class TokenLoss:
    """Per trained token: the loss term and what is logged about it. `entropy_bonus` (the entropy where
    the bonus applies, differentiable) and `entropy_mask` (the tokens the top-entropy mask kept) are None
    when those options are off."""

    loss: torch.Tensor
    ratio: torch.Tensor
    low_clipped: torch.Tensor
    high_clipped: torch.Tensor
    kl: torch.Tensor | None  # the KL term as the loss weighs it (times the ratio under kl_bias_correction), as TRL logs it
    entropy_bonus: torch.Tensor | None = None
    entropy_mask: torch.Tensor | None = None
    corrected: torch.Tensor | None = None  # the tokens the engine-vs-trainer correction truncated or masked
    # The engine-vs-trainer weight each term took, as bounded (None: no correction); in the ``sequence_*`` modes one
    # per sequence, repeated over its terms (``engine_weight_seq``: each term's sequence, then).
    engine_weight: torch.Tensor | None = None
    engine_weight_seq: torch.Tensor | None = None
    vespo_phi: torch.Tensor | None = None  # vespo's phi of each term's sequence (TRL logs its mean over the sequences)
    # What each term counts for in the clip fractions: 1 at token level; at sequence level, 1/(its sequence's terms),
    # so a sequence (one ratio) counts once, as TRL counts it.
    clip_weight: torch.Tensor | float = 1.0


@dataclass(frozen=True)
class _Sequences:
    """Which sequence each of M terms belongs to (`index` [M]) and how many terms each of B has (`num_tokens` [B])."""

    index: torch.Tensor
    num_tokens: torch.Tensor

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Per-sequence sum of `values` [M], given back at each term [M]."""
        per_seq = values.new_zeros(self.num_tokens.numel()).index_add(0, self.index, values)
        return per_seq[self.index]

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        return self.sum(values) / self.num_tokens.clamp(min=1).to(values)[self.index]


class LossSettingError(UserError, ValueError):
    """A `GRPOLoss` field that cannot be used as given; the message and key name it as the recipe does
    (``loss.FIELD``, inside the module's block)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"loss.{field} {problem}", f"loss.{field}")


@dataclass(frozen=True)
class GRPOLoss:
    """Per token: a policy term weighted by the engine-vs-trainer correction, masked by the off-policy and
    top-entropy masks, plus `beta` times a KL estimate to a reference model; minus `entropy_coef` times
    the mean entropy over the step. Each field ends with the name TRL 1.16's `GRPOConfig` gives it.

    Args:
        loss_type: the term and its normalisation. ``grpo``, ``dapo``, ``bnpo``, ``dr_grpo``, ``luspo``:
            `-min(r A, clip(r, 1-epsilon_low, 1+epsilon_high) A)`, averaged per sequence then over sequences
            (grpo), over the step's tokens (dapo), over this rank's tokens (bnpo), divided by sequences times
            `max_completion_length` (dr_grpo), or summed per sequence and averaged over sequences (luspo).
            ``cispo``: `-min(r, epsilon_high) A log p`, the weight detached; over the step's tokens.
            ``sapo``: `-4/tau sigmoid(tau (r-1)) A`; as grpo. ``vespo``: `-phi(w) A log p` with the detached
            Gamma weight `phi(w) = e^lambda w^k e^(-lambda w)` of the sequence ratio w; as dapo. TRL: `loss_type`.
        epsilon_low: lower clip range, `r >= 1 - epsilon_low`. TRL: `epsilon`.
        epsilon_high: upper clip range, `r <= 1 + epsilon_high`; for cispo the cap on r itself; None: ``epsilon_low``,
            as TRL's. TRL: `epsilon_high`.
        beta: weight of the KL term; 0 needs no reference model. TRL: `beta`.
        importance_sampling_cap: upper bound of the engine-vs-trainer ratio (None: none; with
            `importance_sampling_floor` None too, no correction). TRL: `vllm_importance_sampling_clip_max`.
        kl_bias_correction: multiply the KL term by the (differentiable) ratio r, which makes its gradient the
            unbiased reverse-KL gradient (DeepSeek-V3.2). TRL: `use_bias_correction_kl`.
        kl_estimator: the KL estimate from `d = log p_ref - log p`: k1 `-d`, k2 `d^2 / 2`, k3 `e^d - d - 1`.
            TRL: none, its estimate is k3.
        importance_sampling_level: ``token`` ratios, or ``sequence``: one ratio per sequence, the exp of its
            mean log-ratio (GSPO). TRL: `importance_sampling_level`.
        delta: two-sided clipping: the unclipped ratio is capped at delta too (INTELLECT-2). TRL: `delta`.
        sapo_temperature_pos: SAPO's gate temperature tau for tokens with A > 0. TRL: `sapo_temperature_pos`.
        sapo_temperature_neg: SAPO's tau for tokens with A <= 0. TRL: `sapo_temperature_neg`.
        vespo_k_pos: VESPO's power k for A >= 0 (down-weights w < 1). TRL: `vespo_k_pos`.
        vespo_lambda_pos: VESPO's decay lambda for A >= 0 (down-weights w > 1). TRL: `vespo_lambda_pos`.
        vespo_k_neg: VESPO's k for A < 0. TRL: `vespo_k_neg`.
        vespo_lambda_neg: VESPO's lambda for A < 0. TRL: `vespo_lambda_neg`.
        importance_sampling_mode: which engine-vs-trainer ratio `exp(log p_old - log p_engine)` (``token_*``, or
            ``sequence_*``: the exp of the sequence's summed log-ratio) and how it is bounded (``*_truncate``
            clamps it to the bounds, ``*_mask`` zeroes it outside them); ``sequence_mask`` by default, as TRL's.
            TRL: `vllm_importance_sampling_mode`.
        importance_sampling_floor: lower bound of that ratio (None: none). TRL: `vllm_importance_sampling_clip_min`.
        off_policy_mask_threshold: drop the sequences with A < 0 whose mean `log p_engine - log p` exceeds it
            (DeepSeek-V3.2; None: off). TRL: `off_policy_mask_threshold`.
        top_entropy_quantile: train only the tokens whose entropy is in this top quantile (1: all). TRL:
            `top_entropy_quantile`.
        entropy_coef: weight of the entropy bonus, the mean entropy of the tokens trained. TRL: `entropy_coef`.
        adaptive_entropy: adaptive entropy control (Skywork-OR1): after each optimizer step the coefficient moves
            by `entropy_coef_delta` (up while the step's mean entropy is at or below `entropy_target`, down
            otherwise, within `entropy_coef_min`/`entropy_coef_max`), and the bonus applies only while the last
            step's entropy was at or below the target (`EntropyControl`). TRL: `use_adaptive_entropy`.
        entropy_coef_min, entropy_coef_max, entropy_coef_delta, entropy_target: its bounds, step and target (nats).
            TRL: the same names.
    """

    # The first six keep their order: GRPOModule passes them by position.
    loss_type: LossType = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    importance_sampling_cap: float | None = None
    kl_bias_correction: bool = True
    kl_estimator: KLEstimator = "k3"
    importance_sampling_level: RatioLevel = "token"
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    importance_sampling_mode: EngineCorrection = "sequence_mask"
    importance_sampling_floor: float | None = None
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    adaptive_entropy: bool = False
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    entropy_target: float = 0.2

    @property
    def upper_clip(self) -> float:
        """``epsilon_high``, or ``epsilon_low`` where it is None (TRL's rule). Read here, not filled into the field as
        the settings are made: the recipe parser merges a recipe's ``loss:`` keys into the default instance, which
        would then hold 0.2 from the default ``epsilon_low`` whatever ``epsilon_low`` the recipe gives."""
        return self.epsilon_low if self.epsilon_high is None else self.epsilon_high

    def __post_init__(self) -> None:
        for name, allowed in (
            ("loss_type", LOSS_TYPES),
            ("kl_estimator", get_args(KLEstimator)),
            ("importance_sampling_level", get_args(RatioLevel)),
            ("importance_sampling_mode", get_args(EngineCorrection)),
        ):
            if getattr(self, name) not in allowed:
                raise LossSettingError(name, f"must be one of {allowed}, got {getattr(self, name)!r}")
        bounds = (  # each checked when set
            ("epsilon_low", lambda v: 0 <= v <= 1, "in [0, 1]"),
            ("epsilon_high", lambda v: v >= 0, ">= 0"),
            ("beta", lambda v: v >= 0, ">= 0"),
            # Above 1 + epsilon_high it caps the ratio of negative advantages; at or below, it caps positive ones
            # tighter than the clip: both as TRL computes them (which recommends > 1 + epsilon_high, and takes any).
            ("delta", lambda v: v > 0, "> 0"),
            ("sapo_temperature_pos", lambda v: v > 0, "> 0"),
            ("sapo_temperature_neg", lambda v: v > 0, "> 0"),
            ("vespo_k_pos", lambda v: v >= 0, ">= 0"),
            ("vespo_lambda_pos", lambda v: v > 0, "> 0"),
            ("vespo_k_neg", lambda v: v >= 0, ">= 0"),
            ("vespo_lambda_neg", lambda v: v > 0, "> 0"),
            # A bound that excludes 1 would reweight the tokens on which engine and trainer agree.
            ("importance_sampling_cap", lambda v: v >= 1, ">= 1"),
            ("importance_sampling_floor", lambda v: 0 <= v <= 1, "in [0, 1]"),
            ("off_policy_mask_threshold", lambda v: v >= 0, ">= 0"),
            ("top_entropy_quantile", lambda v: 0 <= v <= 1, "in [0, 1]"),
            ("entropy_coef_delta", lambda v: v >= 0, ">= 0"),
            ("entropy_target", lambda v: v >= 0, ">= 0"),
            ("entropy_coef_max", lambda v: v >= self.entropy_coef_min, f">= entropy_coef_min ({self.entropy_coef_min})"),
        )
        for name, ok, bound in bounds:
            value = getattr(self, name)
            if value is not None and not ok(value):
                raise LossSettingError(name, f"must be {bound}, got {value}")
        if self.importance_sampling_floor == self.importance_sampling_cap == 1:
            raise LossSettingError("importance_sampling_floor", "must be below importance_sampling_cap, both are 1")
        if self.loss_type == "cispo" and self.upper_clip < 1:
            raise LossSettingError(
                "epsilon_high", f"must be >= 1 for loss_type='cispo', got {self.upper_clip}: it caps the ratio itself, "
                "and below 1 it caps every on-policy token (ScaleRL uses 5)"
            )
        if self.delta is not None and self.loss_type not in CLIPPED:
            raise LossSettingError("delta", f"caps the clipped ratio of {CLIPPED}; loss_type={self.loss_type!r} has none")
        if self.loss_type == "luspo" and self.importance_sampling_level != "sequence":
            raise LossSettingError("importance_sampling_level", "must be 'sequence' for loss_type='luspo' (a length-scaled GSPO loss)")
        if self.loss_type == "vespo" and self.importance_sampling_level != "token":
            raise LossSettingError("importance_sampling_level", "must be 'token' for loss_type='vespo' (it builds its own sequence weight)")
        if self.loss_type == "vespo" and self.corrects_engine and self.importance_sampling_mode.startswith("sequence"):
            raise LossSettingError(
                "importance_sampling_mode", "must be 'token_truncate' or 'token_mask' for loss_type='vespo' "
                "(the per-token ratios enter its sequence weight)"
            )

    @property
    def corrects_engine(self) -> bool:
        """Whether the terms are weighted by the engine-vs-trainer ratio (a bound on it is set)."""
        return self.importance_sampling_cap is not None or self.importance_sampling_floor is not None

    @property
    def clips(self) -> bool:
        """Whether the term clips its ratio, so that clip fractions mean something (sapo's and vespo's do not)."""
        return self.loss_type not in ("sapo", "vespo")

    @property
    def needs_sequences(self) -> bool:
        """Whether `token_loss` needs each term's sequence (`loss_seq`, `seq_num_tokens`)."""
        return (
            self.importance_sampling_level == "sequence"
            or self.loss_type == "vespo"
            or self.off_policy_mask_threshold is not None
            or (self.corrects_engine and self.importance_sampling_mode.startswith("sequence"))
        )

    @property
    def needs_entropy(self) -> bool:
        """Whether `token_loss` needs the per-token entropy (differentiable when `entropy_coef != 0`)."""
        return self.top_entropy_quantile < 1 or self.entropy_coef != 0 or self.adaptive_entropy

    def token_loss(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        *,
        ref_logprobs: torch.Tensor | None = None,
        engine_logprobs: torch.Tensor | None = None,
        loss_seq: torch.Tensor | None = None,
        seq_num_tokens: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
        entropy_threshold: torch.Tensor | float | None = None,
    ) -> TokenLoss:
        """Loss terms of M trained tokens (all tensors [M] but `seq_num_tokens` [B]; `advantages` already per
        token). `loss_seq` and `seq_num_tokens` are as for `token_weights`. `entropy_threshold` is the
        entropy a token must reach to be trained when `top_entropy_quantile < 1`; by default the quantile
        of these M tokens (see `entropy_threshold`)."""
        seqs = None
        if loss_seq is not None and seq_num_tokens is not None:
            seqs = _Sequences(loss_seq, seq_num_tokens)
        elif self.needs_sequences:
            raise ValueError(
                "sequence-level terms (importance_sampling_level='sequence', vespo, off_policy_mask_threshold, "
                "sequence_* importance_sampling_mode) need each term's sequence: pass loss_seq and seq_num_tokens"
            )
        if self.needs_entropy and entropy is None:
            raise ValueError("top_entropy_quantile < 1 or entropy_coef != 0 needs the per-token entropy")

        log_ratio = logprobs - old_logprobs
        ratio = torch.exp(seqs.mean(log_ratio) if self.importance_sampling_level == "sequence" else log_ratio)
        engine_weight, corrected = self._engine_weight(old_logprobs, engine_logprobs, seqs)
        low = high = torch.zeros_like(advantages, dtype=torch.bool)
        if self.loss_type == "cispo":
            loss = -ratio.detach().clamp(max=self.upper_clip) * advantages * logprobs
            high = (ratio > self.upper_clip) & (advantages > 0)
        elif self.loss_type == "sapo":
            tau = torch.where(advantages > 0, self.sapo_temperature_pos, self.sapo_temperature_neg)
            loss = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages
        elif self.loss_type == "vespo":
            phi = self._vespo_weight(log_ratio, advantages, engine_weight, seqs)
            loss = -phi * advantages * logprobs
        else:
            clipped = torch.clamp(ratio, 1 - self.epsilon_low, 1 + self.upper_clip)
            unclipped = ratio if self.delta is None else ratio.clamp(max=self.delta)
            loss = -torch.min(unclipped * advantages, clipped * advantages)
            low = (unclipped < 1 - self.epsilon_low) & (advantages < 0)
            high = (unclipped > 1 + self.upper_clip) & (advantages > 0)
        if engine_weight is not None and self.loss_type != "vespo":
            loss = loss * engine_weight
        if self.off_policy_mask_threshold is not None:
            sampled = engine_logprobs if engine_logprobs is not None else old_logprobs
            drift = seqs.mean(sampled - logprobs.detach())  # forward KL estimate of sampler vs policy, per sequence
            loss = loss * ((advantages >= 0) | (drift <= self.off_policy_mask_threshold))

        entropy_mask = entropy_bonus = None
        if self.top_entropy_quantile < 1:
            threshold = self.entropy_threshold(entropy) if entropy_threshold is None else entropy_threshold
            entropy_mask = entropy.detach() >= threshold
            loss = loss * entropy_mask
        if self.entropy_coef != 0:
            entropy_bonus = entropy if entropy_mask is None else entropy * entropy_mask

        kl = None
        if self.beta != 0.0:
            if ref_logprobs is None:
                raise ValueError("beta != 0 needs reference log-probs")
            kl = _kl(ref_logprobs - logprobs, self.kl_estimator)
            kl = kl * ratio if self.kl_bias_correction else kl
            loss = loss + self.beta * kl
        return TokenLoss(
            loss=loss,
            ratio=ratio.detach(),
            low_clipped=low,
            high_clipped=high,
            kl=None if kl is None else kl.detach(),
            entropy_bonus=entropy_bonus,
            entropy_mask=entropy_mask,
            corrected=corrected,
            engine_weight=None if engine_weight is None else engine_weight.detach(),
            vespo_phi=phi if self.loss_type == "vespo" else None,
            engine_weight_seq=seqs.index if engine_weight is not None and self.importance_sampling_mode.startswith("sequence") else None,
            clip_weight=1 / seqs.num_tokens.clamp(min=1).to(ratio)[seqs.index] if self.importance_sampling_level == "sequence" else 1.0,
        )

    def entropy_threshold(self, entropy: torch.Tensor) -> torch.Tensor:
        """The entropy at the `1 - top_entropy_quantile` quantile of `entropy` (the trained tokens the mask
        chooses from: the whole step's, for a threshold that does not depend on the micro-batches)."""
        if entropy.numel() == 0:
            return entropy.new_tensor(math.inf)
        return torch.quantile(entropy.detach().float(), 1 - self.top_entropy_quantile)

    def token_weights(
        self, loss_seq: torch.Tensor, seq_num_tokens: torch.Tensor, counts: StepCounts, dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """Weight of each term so that summing `loss * weight` over every micro-batch of the step
        (and averaging over ranks) gives the variant's loss. `loss_seq` [M] maps a term to its
        sequence, `seq_num_tokens` [B] counts each sequence's trained tokens. Computed in ``dtype``: float64 for a
        float64 loss (a float32 weight such as 1/3 would round its terms at float32's precision)."""
        world = float(counts.world_size)
        ones = torch.ones_like(loss_seq, dtype=dtype)
        if self.loss_type in ("grpo", "sapo"):
            per_seq = seq_num_tokens.clamp(min=1).to(dtype)[loss_seq]
            return world / (counts.num_sequences * per_seq)
        if self.loss_type in ("dapo", "cispo", "vespo"):
            return ones * (world / max(counts.num_tokens, 1))
        if self.loss_type == "bnpo":
            return ones / max(counts.rank_tokens, 1)
        if self.loss_type == "luspo":
            return ones * (world / counts.num_sequences)
        return ones * (world / (counts.num_sequences * counts.max_completion_length))

    def reduce(
        self, terms: TokenLoss, loss_seq: torch.Tensor, seq_num_tokens: torch.Tensor, counts: StepCounts
    ) -> torch.Tensor:
        """This micro-batch's share of the step's loss: the weighted terms, less its share of the entropy
        bonus (a mean over the step's `counts.entropy_tokens`, whatever the loss type)."""
        dtype = torch.float64 if terms.loss.dtype == torch.float64 else torch.float32
        total = (terms.loss * self.token_weights(loss_seq, seq_num_tokens, counts, dtype).to(terms.loss)).sum()
        return total if terms.entropy_bonus is None else total - self.bonus(terms, counts)

    def bonus(self, terms: TokenLoss, counts: StepCounts) -> torch.Tensor:
        """This micro-batch's share of the step's entropy bonus, as `reduce` subtracts it (0 without a bonus):
        `reduce(...) + bonus(...)` is the policy's loss alone, TRL's `policy_loss`."""
        if terms.entropy_bonus is None:
            return terms.loss.new_zeros(())
        if counts.entropy_tokens is None and terms.entropy_mask is not None:
            raise ValueError("entropy_coef with top_entropy_quantile < 1 needs counts.entropy_tokens (the tokens kept)")
        tokens = counts.num_tokens if counts.entropy_tokens is None else counts.entropy_tokens
        return self.entropy_coef * terms.entropy_bonus.sum() * (counts.world_size / max(tokens, 1))

    def _engine_weight(
        self, old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor | None, seqs: _Sequences | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The detached engine-vs-trainer ratio each term is weighted by, bounded as `importance_sampling_mode` says,
        and the tokens whose ratio was out of bounds (truncated or masked)."""
        if not self.corrects_engine:
            return None, None
        if engine_logprobs is None:
            raise ValueError("importance_sampling_cap or importance_sampling_floor is set but no engine log-probs were given")
        log_ratio = (old_logprobs - engine_logprobs).detach()
        token, bounding = self.importance_sampling_mode.split("_")
        weight = torch.exp(log_ratio if token == "token" else seqs.sum(log_ratio))
        floor = -math.inf if self.importance_sampling_floor is None else self.importance_sampling_floor
        cap = math.inf if self.importance_sampling_cap is None else self.importance_sampling_cap
        outside = (weight < floor) | (weight > cap)
        if bounding == "truncate":
            return weight.clamp(min=self.importance_sampling_floor, max=self.importance_sampling_cap), outside
        return weight.masked_fill(outside, 0.0), outside

    @torch.no_grad()
    def _vespo_weight(
        self, log_ratio: torch.Tensor, advantages: torch.Tensor, engine_weight: torch.Tensor | None, seqs: _Sequences
    ) -> torch.Tensor:
        """VESPO's `phi(w) = e^lambda w^k e^(-lambda w)` (phi(1) = 1) of the sequence ratio w, which includes the
        engine-vs-trainer ratios when they are corrected for; k and lambda by the sign of the advantage."""
        log_w = seqs.sum(log_ratio.clamp(-20.0, 20.0))
        if engine_weight is not None:
            log_w = log_w + seqs.sum(torch.log(engine_weight).clamp(_LOG_FLOOR, 20.0))
        log_w = log_w.clamp(_LOG_FLOOR, 20.0)
        non_negative = advantages >= 0
        k = torch.where(non_negative, self.vespo_k_pos, self.vespo_k_neg)
        lam = torch.where(non_negative, self.vespo_lambda_pos, self.vespo_lambda_neg)
        return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _kl(log_ratio: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """KL(policy || reference) estimated from `log_ratio = log p_ref - log p` of tokens sampled from the policy."""
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    return torch.exp(log_ratio) - log_ratio - 1


@dataclass
class EntropyControl:
    """The state of adaptive entropy control (`GRPOLoss.adaptive_entropy`): the coefficient, and the mean entropy
    of the last optimizer step (over every rank, of the tokens the bonus acts on)."""

    coef: float
    last_entropy: float = math.inf

    def applied(self, loss: GRPOLoss) -> float:
        """The coefficient this step's bonus uses: the current one while the last step's entropy was at or below
        the target, else none."""
        return self.coef if self.last_entropy <= loss.entropy_target else 0.0

    def update(self, loss: GRPOLoss, step_entropy: float) -> None:
        """After an optimizer step whose mean entropy was ``step_entropy``."""
        if step_entropy <= loss.entropy_target:
            self.coef = min(self.coef + loss.entropy_coef_delta, loss.entropy_coef_max)
        else:
            self.coef = max(self.coef - loss.entropy_coef_delta, loss.entropy_coef_min)
        self.last_entropy = step_entropy
