"""Saved activations kept in host memory between a policy's forward and its backward (``offload_activations``).

Autograd keeps what each operation needs for its backward ("saved tensors"); at long rows they, not the weights,
fill an accelerator. Saved-tensor hooks let every one of them be copied to host memory as it is saved and copied
back when its backward runs, so the values, and the loss and gradients, are exactly those without offloading.
Weights (and views of them) stay where they are: they live on the device anyway, and a copy would only cost
transfers. An activation-checkpointed layer saves only its inputs this way (its checkpoint handles the inside), so
with both on, the host holds each layer's input and the device one layer's working set.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


def is_weight(tensor: Tensor) -> bool:
    base = tensor if tensor._base is None else tensor._base
    return isinstance(base, nn.Parameter)


class SavedInPlace(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes of the activations autograd keeps where they were made (weights aside): what offloading and
    checkpointing save. Offloaded tensors, and those inside a checkpointed layer, are packed by hooks nearer the
    operation and never reach this one."""

    def __init__(self) -> None:
        self.bytes = 0

        def pack(tensor: Tensor) -> Tensor:
            self.bytes += 0 if is_weight(tensor) else tensor.numel() * tensor.element_size()
            return tensor

        super().__init__(pack, lambda tensor: tensor)


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Inside this block, a tensor saved for backward is moved to host memory (pinned, where the device is CUDA,
    so the copy back runs asynchronously); ``host_bytes`` counts what was moved."""

    def __init__(self) -> None:
        self.host_bytes = 0
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: Tensor) -> Any:
        if is_weight(tensor) or type(tensor) is not Tensor or tensor.layout is not torch.strided:
            return tensor  # a weight, or a tensor subclass (a DTensor) whose placement is its own business
        pinned = tensor.device.type == "cuda"
        host = torch.empty(tensor.size(), dtype=tensor.dtype, pin_memory=pinned)
        host.copy_(tensor)
        self.host_bytes += host.numel() * host.element_size()
        return tensor.device, host, pinned

    @staticmethod
    def _unpack(packed: Any) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        device, host, pinned = packed
        return host.to(device, non_blocking=pinned)


class OffloadedForwards:
    """The hooks that make every forward of a model under autograd keep its saved activations in host memory until
    backward; ``host_bytes``: what the latest forward moved there."""

    def __init__(self, model: nn.Module) -> None:
        self.host_bytes = 0
        self._active: list[HostOffload] = []
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._leave, always_call=True)  # an exception in forward leaves no hook behind

    def _enter(self, module: nn.Module, args: Any) -> None:
        self._active.append(HostOffload())
        self._active[-1].__enter__()

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        hooks = self._active.pop()
        hooks.__exit__(None, None, None)
        if torch.is_grad_enabled():  # a forward without autograd saves nothing: it leaves the figure as it was
            self.host_bytes = hooks.host_bytes
