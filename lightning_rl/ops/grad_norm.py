"""Gradient norms over parameters that live on different device meshes.

Under expert parallelism the experts are DTensors on the expert mesh and the other weights on the data-parallel
mesh, and torch's ``get_total_norm`` / ``clip_grad_norm_`` stack the per-tensor norms into one tensor, which
DTensor refuses across meshes. Here each mesh's norm is reduced on its own mesh first, then the few results are
combined as plain tensors. With a single mesh (or none) this is the same number torch computes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor


def total_grad_norm(parameters: Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
    """The ``norm_type`` norm of all gradients together, as a plain tensor equal on every rank."""
    by_mesh: dict[object, list[Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    if not by_mesh:
        return torch.zeros(())
    norms = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return torch.nn.utils.get_total_norm(norms, norm_type)


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0) -> Tensor:
    """Scale all gradients so their total norm is at most ``max_norm``; returns the norm before clipping."""
    params = [p for p in parameters if p.grad is not None]
    total = total_grad_norm(params, norm_type)
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:  # one tensor at a time: a foreach over grads of several meshes is refused
        p.grad.mul_(scale.to(p.grad.device))
    return total
