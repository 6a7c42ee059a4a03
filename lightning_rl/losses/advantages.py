"""Group-normalised advantages: each completion is scored against the other samples of its prompt."""

from __future__ import annotations

from typing import Literal

import torch

RewardScaling = Literal["std", "none"]

# Keeps the division finite when every sample of a group got the same reward.
STD_EPSILON = 1e-4


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, scale: RewardScaling = "std") -> torch.Tensor:
    """Advantage of each of N completions: its reward minus its group's mean, divided by the group's
    (unbiased) standard deviation when `scale="std"`. `groups` [N] gives each completion's group;
    groups may differ in size (forked multi-turn rollouts), and a group of one gets advantage 0."""
    if scale not in ("std", "none"):
        raise ValueError(f"scale_rewards must be 'std' or 'none', got {scale!r}")
    if rewards.shape != groups.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and groups {tuple(groups.shape)} must both be [N]")
    advantages = torch.zeros_like(rewards, dtype=torch.float32)
    for group in torch.unique(groups):
        members = groups == group
        values = rewards[members].float()
        if values.numel() < 2:
            continue
        centred = values - values.mean()
        advantages[members] = centred / (values.std() + STD_EPSILON) if scale == "std" else centred
    return advantages
