"""The shape policy of a device, read by data, modules and strategies alike (a leaf: it imports nothing of ours).

XLA and Neuron compile one graph per input shape, so there every row is padded to a fixed multiple
(``pad_to_multiple_of: auto``) and the tree attention takes the shape-only dense path; elsewhere nothing is padded.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, XLAStrategy

#: Neuron and XLA compile one graph per input shape; 128 matches the Neuron tiling of the sequence axis.
STATIC_SHAPE_MULTIPLE = 128
STATIC_SHAPE_DEVICE_TYPES = frozenset({"xla", "neuron"})

PadToMultipleOf = int | Literal["auto"] | None


def _device_type_of(trainer_or_device: Any) -> str:
    """The device type ("cpu", "cuda", "xla", "neuron", ...) a trainer, strategy, accelerator or device runs on."""
    if isinstance(trainer_or_device, str):
        # Not torch.device(): "neuron" is only a device type once the Neuron runtime has registered it.
        return trainer_or_device.split(":", 1)[0]
    if isinstance(trainer_or_device, torch.device):
        return trainer_or_device.type
    strategy = getattr(trainer_or_device, "strategy", trainer_or_device)
    if getattr(strategy, "requires_static_shapes", False):
        return strategy.static_shape_device_type
    root_device = getattr(strategy, "root_device", None)
    if isinstance(root_device, torch.device):
        return root_device.type
    raise TypeError(
        f"cannot tell the device of {type(trainer_or_device).__name__}; pass a Trainer, a Strategy or a torch.device"
    )


def requires_static_shapes(trainer_or_device: Any) -> bool:
    """Whether every new input shape costs a compile (XLA, Neuron, or a strategy that rehearses them)."""
    return _device_type_of(trainer_or_device) in STATIC_SHAPE_DEVICE_TYPES


def resolve_pad_to_multiple_of(value: PadToMultipleOf, trainer_or_device: Any) -> int | None:
    """Turn a recipe's ``pad_to_multiple_of`` into a number: ``"auto"`` is 128 on XLA/Neuron, None elsewhere."""
    if value == "auto":
        return STATIC_SHAPE_MULTIPLE if requires_static_shapes(trainer_or_device) else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"pad_to_multiple_of must be a positive int, 'auto' or None, got {value!r}")
    return value


def wraps_in_ddp(strategy: Any) -> bool:
    """Whether ``strategy`` is Lightning's DDP reducing what the gradients hold at its next synchronised backward, so
    that rows and spans may backpropagate without its reduction and be reduced once after them: not with
    ``static_graph`` (which fixes how often each gradient is reduced from the first iteration), nor its XLA and
    DeepSpeed subclasses (which reduce their own way, untried)."""
    ddp = isinstance(strategy, DDPStrategy) and not isinstance(strategy, (XLAStrategy, DeepSpeedStrategy))
    return ddp and not ddp_static_graph(strategy)


def ddp_static_graph(strategy: Any) -> bool:
    """Whether ``strategy`` hands DDP ``static_graph=True``."""
    return bool(getattr(strategy, "_ddp_kwargs", {}).get("static_graph", False))
