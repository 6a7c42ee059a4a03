"""Group-normalised advantages: each completion is scored against the other samples of its prompt."""

from __future__ import annotations

from typing import Literal

import torch

RewardScaling = Literal["std", "none"]

# Keeps the division finite when every sample of a group got the same reward.
STD_EPSILON = 1e-4


def group_advantages(rewards: torch.Tensor, scale: RewardScaling = "std") -> torch.Tensor:
    """Advantages of `rewards` shaped [groups, G]: reward minus its group mean, divided by the
    group's (unbiased) standard deviation when `scale="std"`."""
    if rewards.dim() != 2 or rewards.size(1) < 2:
        raise ValueError(
            f"advantages need rewards shaped [groups, G] with G >= 2, got {tuple(rewards.shape)}"
        )
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "none":
        return centred
    if scale == "std":
        return centred / (rewards.std(dim=1, keepdim=True) + STD_EPSILON)
    raise ValueError(f"scale_rewards must be 'std' or 'none', got {scale!r}")
