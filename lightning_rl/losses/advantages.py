"""Group-normalised advantages: each completion is scored against the other samples of its prompt.

The statistics that span the whole step (``scale_rewards="batch"``, ``normalize_then_sum``) are taken over every
rank: ``reduce`` sums a tensor over the ranks (the identity in one process), so the result does not depend on how
the step's prompts are dealt out. A NaN reward (no reward function applied to the sample, or, per function, that
function did not) is left out of every statistic and gets advantage 0, as in TRL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

RewardScaling = Literal["group", "batch", "none", "std"]
"""``group`` (``std`` is the same, its earlier name): divide by the group's std; ``batch``: by the std of every
reward of the step; ``none``: centre only. TRL: ``scale_rewards``."""
RewardAggregation = Literal["sum_then_normalize", "normalize_then_sum"]
"""How several reward functions combine: weighted sum, then normalised per group; or each normalised per group,
then the weighted sum normalised over the step (GDPO). TRL: ``multi_objective_aggregation``."""

# Keeps the division finite when every sample of a group got the same reward.
STD_EPSILON = 1e-4

Reduce = Callable[[torch.Tensor], torch.Tensor]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def step_mean_and_std(values: torch.Tensor, reduce: Reduce = _identity) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased std of ``values`` over every rank (0 for the std of fewer than two values)."""
    v = values.double()
    n, total, squares = reduce(torch.stack([v.new_tensor(float(v.numel())), v.sum(), (v * v).sum()])).unbind()
    mean = total / n.clamp(min=1)
    variance = ((squares - n * mean * mean) / (n - 1)).clamp(min=0) if n > 1 else v.new_tensor(0.0)
    return mean.float(), variance.sqrt().float()


def _per_group(rewards: torch.Tensor, groups: torch.Tensor, scale: bool) -> torch.Tensor:
    out = torch.zeros_like(rewards, dtype=torch.float32)
    for group in torch.unique(groups):
        members = (groups == group) & ~rewards.isnan()
        values = rewards[members].float()
        if values.numel() < 2:
            continue
        centred = values - values.mean()
        out[members] = centred / (values.std() + STD_EPSILON) if scale else centred
    return out


def group_advantages(
    rewards: torch.Tensor, groups: torch.Tensor, scale: RewardScaling = "group", reduce: Reduce = _identity
) -> torch.Tensor:
    """Advantage of each of N completions: its reward minus its group's mean, divided by the group's (unbiased)
    standard deviation (``group``), by that of every reward of the step on every rank (``batch``), or not at all
    (``none``). `groups` [N] gives each completion's group; groups may differ in size (forked multi-turn rollouts),
    and a group of one gets advantage 0."""
    if scale not in ("group", "batch", "none", "std"):
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale!r}")
    _check_shapes(rewards, groups)
    if scale in ("group", "std"):
        return _per_group(rewards, groups, scale=True)
    centred = _per_group(rewards, groups, scale=False)
    if scale == "none":
        return centred
    _, std = step_mean_and_std(rewards[~rewards.isnan()], reduce)
    return centred / (std + STD_EPSILON)


def normalize_then_sum(
    per_function: torch.Tensor, weights: torch.Tensor, groups: torch.Tensor, reduce: Reduce = _identity
) -> torch.Tensor:
    """GDPO's advantages from K reward functions' raw scores [N, K]: each normalised per group, the weighted sum
    then centred and scaled by its mean and std over the step (every rank)."""
    if per_function.dim() != 2 or per_function.shape[1] != weights.numel():
        raise ValueError(f"per-function rewards {tuple(per_function.shape)} do not match {weights.numel()} weights")
    _check_shapes(per_function[:, 0], groups)
    normalised = torch.stack([_per_group(per_function[:, k], groups, scale=True) for k in range(weights.numel())], 1)
    combined = (normalised * weights.float()).sum(1)
    scored = ~per_function.isnan().all(1)
    mean, std = step_mean_and_std(combined[scored], reduce)
    return torch.where(scored, (combined - mean) / (std + STD_EPSILON), 0.0)


def step_advantages(
    rewards: list[float], reward_terms: dict[str, list[float]], weights: dict[str, float], groups: list[int],
    aggregation: RewardAggregation, scale: RewardScaling, reduce: Reduce = _identity,
) -> torch.Tensor:
    """Each rollout's advantage under the step's aggregation: the weighted sum ``rewards`` normalised
    (`group_advantages`), or each function's ``reward_terms`` normalised and weighted by ``weights`` (in that order)
    (`normalize_then_sum`); ``reduce`` sums the step's statistics over every rank."""
    group_ids = torch.tensor(groups)
    if aggregation == "normalize_then_sum":
        per_function = torch.tensor([reward_terms[name] for name in weights], dtype=torch.float32).T
        return normalize_then_sum(per_function.reshape(len(group_ids), len(weights)), torch.tensor(list(weights.values())), group_ids, reduce)
    return group_advantages(torch.tensor(rewards), group_ids, scale, reduce)


def _check_shapes(rewards: torch.Tensor, groups: torch.Tensor) -> None:
    if rewards.shape != groups.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and groups {tuple(groups.shape)} must both be [N]")
