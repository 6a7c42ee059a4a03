"""Policy-gradient losses for GRPO and its normalisation variants."""

from lightning_rl.losses.advantages import group_advantages
from lightning_rl.losses.grpo import LOSS_TYPES, GRPOLoss, StepCounts, TokenLoss

__all__ = ["LOSS_TYPES", "GRPOLoss", "StepCounts", "TokenLoss", "group_advantages"]
