"""The random state dropout draws its masks from: kept so a second forward of the same row draws the same, and kept in
a checkpoint so a resumed run draws what the uninterrupted one drew.

GRPO's ``top_entropy_quantile`` takes its threshold from a forward of every row of the step before the training
forwards: under dropout (a LoRA's, a model's own) the two forwards of a row would draw other masks, so the tokens
counted above the threshold would not be the tokens the training forward keeps (TRL takes both from one forward).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

Row = TypeVar("Row")
Out = TypeVar("Out")


@dataclass(frozen=True)
class RandomState:
    """The host generator's state and, on CUDA, the device's."""

    host: torch.Tensor
    device: torch.device
    accelerator: torch.Tensor | None

    @classmethod
    def now(cls, device: torch.device) -> RandomState:
        return cls(torch.get_rng_state(), device, torch.cuda.get_rng_state(device) if device.type == "cuda" else None)

    def restore(self) -> None:
        torch.set_rng_state(self.host)
        if self.accelerator is not None:
            torch.cuda.set_rng_state(self.accelerator, self.device)

    def plain(self) -> dict[str, torch.Tensor | None]:
        """As a checkpoint keeps it (tensors only: read back with ``torch.load(weights_only=True)``)."""
        return {"host": self.host, "accelerator": self.accelerator}

    @classmethod
    def from_plain(cls, state: dict[str, torch.Tensor | None], device: torch.device) -> RandomState:
        """A state ``plain`` gave; its accelerator's part only where this rank runs on CUDA too."""
        accelerator = state.get("accelerator") if device.type == "cuda" else None
        return cls(state["host"], device, accelerator)


def replayable(forward: Callable[[Row], Out], rows: Sequence[Row], device: torch.device) -> tuple[list[Out], list[RandomState]]:
    """``forward`` of each row, with the random state each started from (restore it to draw the same again)."""
    outputs, states = [], []
    for row in rows:
        states.append(RandomState.now(device))
        outputs.append(forward(row))
    return outputs, states
