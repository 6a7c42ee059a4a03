"""The clipped importance-ratio loss of GRPO, with the normalisations of GRPO, DAPO, Dr.GRPO and BNPO.

Every trained token gets a loss term; the variants differ only in the weight each term gets when
summed. Those weights come from counts over the whole optimizer step (all micro-batches, all
ranks), so the gradient does not depend on how a step is split into micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

LossType = Literal["grpo", "dapo", "dr_grpo", "bnpo"]
LOSS_TYPES: tuple[str, ...] = get_args(LossType)


@dataclass(frozen=True)
class StepCounts:
    """What the normaliser of one optimizer step is computed from.

    `num_sequences` and `num_tokens` are summed over all ranks; `rank_tokens` is this rank's token
    count (BNPO normalises per rank). `world_size` undoes the gradient mean data parallelism takes.
    """

    num_sequences: int
    num_tokens: int
    rank_tokens: int
    world_size: int = 1
    max_completion_length: int = 1


@dataclass
class TokenLoss:
    """Per trained token: the loss term and what is logged about it."""

    loss: torch.Tensor
    ratio: torch.Tensor
    low_clipped: torch.Tensor
    high_clipped: torch.Tensor
    kl: torch.Tensor | None


@dataclass(frozen=True)
class GRPOLoss:
    """Clipped surrogate `-min(r A, clip(r, 1-eps_low, 1+eps_high) A)` plus `beta` times the k3 KL
    estimate to a reference model, each term optionally weighted by a truncated importance-sampling
    ratio that corrects for the engine sampling from slightly different log-probs than the trainer's.

    `kl_bias_correction` multiplies the KL term by the (differentiable) ratio r, which makes its
    gradient the unbiased reverse-KL gradient (DeepSeek-V3.2); TRL 1.16 does this by default too.
    """

    loss_type: LossType = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    importance_sampling_cap: float | None = None
    kl_bias_correction: bool = True

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.epsilon_low < 0 or self.epsilon_high < 0:
            raise ValueError("epsilon_low and epsilon_high must be >= 0")
        if self.importance_sampling_cap is not None and self.importance_sampling_cap <= 0:
            raise ValueError("importance_sampling_cap must be > 0")

    def token_loss(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        *,
        ref_logprobs: torch.Tensor | None = None,
        engine_logprobs: torch.Tensor | None = None,
    ) -> TokenLoss:
        """Loss terms of M trained tokens (all arguments [M]; `advantages` already per token)."""
        ratio = torch.exp(logprobs - old_logprobs)  # differentiable: it carries the policy gradient
        clipped = torch.clamp(ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)
        loss = -torch.min(ratio * advantages, clipped * advantages)
        if self.importance_sampling_cap is not None:
            if engine_logprobs is None:
                raise ValueError("importance_sampling_cap is set but no engine log-probs were given")
            weight = torch.exp(old_logprobs - engine_logprobs).clamp(max=self.importance_sampling_cap)
            loss = loss * weight.detach()
        kl = None
        if self.beta != 0.0:
            if ref_logprobs is None:
                raise ValueError("beta != 0 needs reference log-probs")
            delta = ref_logprobs - logprobs
            kl = torch.exp(delta) - delta - 1
            loss = loss + self.beta * (kl * ratio if self.kl_bias_correction else kl)
        return TokenLoss(
            loss=loss,
            ratio=ratio.detach(),
            low_clipped=(ratio < 1 - self.epsilon_low) & (advantages < 0),
            high_clipped=(ratio > 1 + self.epsilon_high) & (advantages > 0),
            kl=None if kl is None else kl.detach(),
        )

    def token_weights(
        self, loss_seq: torch.Tensor, seq_num_tokens: torch.Tensor, counts: StepCounts
    ) -> torch.Tensor:
        """Weight of each term so that summing `loss * weight` over every micro-batch of the step
        (and averaging over ranks) gives the variant's loss. `loss_seq` [M] maps a term to its
        sequence, `seq_num_tokens` [B] counts each sequence's trained tokens."""
        world = float(counts.world_size)
        ones = torch.ones_like(loss_seq, dtype=torch.float32)
        if self.loss_type == "grpo":
            per_seq = seq_num_tokens.clamp(min=1).to(torch.float32)[loss_seq]
            return world / (counts.num_sequences * per_seq)
        if self.loss_type == "dapo":
            return ones * (world / max(counts.num_tokens, 1))
        if self.loss_type == "bnpo":
            return ones / max(counts.rank_tokens, 1)
        return ones * (world / (counts.num_sequences * counts.max_completion_length))
