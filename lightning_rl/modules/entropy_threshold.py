"""GRPO's ``loss.top_entropy_quantile``: the entropy a token must reach to be trained, taken over every trained token
of the step on every rank (as TRL takes it) from a forward of each row before the training forwards.

Each row's forward is replayable: under dropout (a LoRA's, a model's own) the training forward of a row restores the
random state its threshold forward began with, so it draws the same masks and keeps exactly the tokens counted here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_rl.losses import StepCounts
from lightning_rl.ops.random_state import RandomState, replayable


@torch.no_grad()
def step_entropy_threshold(
    entropy_of: Callable[[Any], torch.Tensor], rows: Sequence[Any], quantile: float, counts: StepCounts, strategy: Any,
    device: torch.device,
) -> tuple[torch.Tensor, StepCounts, list[RandomState]]:
    """The threshold (the ``1 - quantile`` quantile of the trained tokens' entropies, ``entropy_of(row)`` each), the
    step's counts with the tokens it keeps, and the random state each row's forward began with (`RandomState`)."""
    entropies, draws = replayable(lambda row: entropy_of(row).float(), rows, device)
    local = torch.cat(entropies)
    longest = int(strategy.reduce(torch.tensor(local.numel(), device=device), reduce_op="max"))
    padded = torch.full((max(longest, 1),), float("nan"), device=device)
    padded[: local.numel()] = local
    every = strategy.all_gather(padded).reshape(-1)
    every = every[~torch.isnan(every)]
    if every.numel() == 0:
        return local.new_tensor(float("inf")), dataclasses.replace(counts, entropy_tokens=0), draws
    threshold = torch.quantile(every, 1 - quantile)
    return threshold, dataclasses.replace(counts, entropy_tokens=int((every >= threshold).sum())), draws
