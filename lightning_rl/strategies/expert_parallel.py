"""Expert parallelism under FSDP2: each rank owns a slice of every routed-expert layer, tokens travel to it.

A mixture-of-experts layer of a transformers model keeps its experts as 3-D weights ``[num_experts, ...]`` in
one module (the classes transformers decorates with ``use_experts_implementation``). With expert parallel size
``ep`` the ranks form a 2-D mesh ``(expert_data_parallel, expert_parallel)``; consecutive ranks (one node, when
``ep`` divides the GPUs per node) make one expert-parallel group, and each of them owns ``num_experts / ep`` of
the experts of every layer. FSDP2 then shards that slice further over the ranks that own the same experts.

In forward every rank routes its own tokens, sends each (token, expert) pair to the rank owning the expert
(one all-to-all), runs its local experts through the model's own experts implementation (eager, grouped_mm,
...), and gets the outputs back (a second all-to-all). Both all-to-alls are differentiable, so backward sends
the gradients the same way. A norm the experts apply to their outputs (Muse Spark's ``post_expert_norm``)
runs on the sending rank, where it is an ordinary data-parallel parameter.

The expert weights are DTensors over the 2-D mesh with their full shape, so distributed checkpoints,
``full_tensor()`` weight sync and the Hugging Face export see the model as it is on disk.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from lightning_rl.errors import UserError

EXPERT_MESH_DIMS = ("expert_data_parallel", "expert_parallel")
# Submodules of an experts module that act on each expert output row and so can run on the sending rank.
_ROW_NORMS = ("post_expert_norm",)


class ExpertParallelError(UserError, ValueError):
    """A model or layout that expert parallelism cannot split; the message names the module or size."""

    key = "trainer.strategy"


def is_experts_module(module: nn.Module) -> bool:
    """A transformers routed-experts module: grouped 3-D weights behind ``use_experts_implementation``."""
    return hasattr(module, "_is_expert_parallel") and isinstance(getattr(module, "num_experts", None), int)


def find_experts_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, sub) for name, sub in module.named_modules() if is_experts_module(sub)]


def expert_mesh(device_type: str, world_size: int, expert_parallel_size: int) -> DeviceMesh:
    """The ``(expert_data_parallel, expert_parallel)`` mesh; consecutive ranks share one expert group."""
    if expert_parallel_size < 1 or world_size % expert_parallel_size:
        raise ExpertParallelError(
            f"expert_parallel_size {expert_parallel_size} must be a positive divisor of the {world_size} processes"
        )
    return init_device_mesh(
        device_type, (world_size // expert_parallel_size, expert_parallel_size), mesh_dim_names=EXPERT_MESH_DIMS
    )


def _expert_weights(name: str, module: nn.Module) -> tuple[list[str], list[nn.Module]]:
    """The experts' own 3-D weights (split over experts) and the row norms kept on the sending rank."""
    weights = [n for n, p in module.named_parameters(recurse=False) if p.dim() >= 1 and p.shape[0] == module.num_experts]
    norms = [getattr(module, n) for n in _ROW_NORMS if isinstance(getattr(module, n, None), nn.Module)]
    in_norms = {id(p) for norm in norms for p in norm.parameters()}
    other = [n for n, p in module.named_parameters() if n.split(".")[0] not in weights and id(p) not in in_norms]
    if not weights or other:
        raise ExpertParallelError(
            f"{name} ({type(module).__name__}): expert parallelism splits weights shaped [num_experts, ...]; "
            f"{'it has none' if not weights else f'parameter {other[0]!r} is not one'}"
        )
    return weights, norms


def distribute_experts(module: nn.Module, mesh: DeviceMesh) -> list[nn.Module]:
    """Split every experts module of ``module`` over ``mesh['expert_parallel']``, in place.

    Works on meta-device models too (no communication: each rank keeps its own rows). Returns the experts
    modules; the norms each applies to its output rows, which stay data parallel, are in ``_expert_row_norms``.
    """
    ep_mesh = mesh[EXPERT_MESH_DIMS[1]]
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    found = []
    for name, experts in find_experts_modules(module):
        if experts.num_experts % ep:
            raise ExpertParallelError(
                f"{name}: {experts.num_experts} experts do not split evenly over expert_parallel_size {ep}"
            )
        weights, norms = _expert_weights(name, experts)
        local = experts.num_experts // ep
        for weight_name in weights:
            full = getattr(experts, weight_name)
            rows = full.detach()[rank * local : (rank + 1) * local].clone()  # its own storage: the rest can go
            shard = DTensor.from_local(rows, ep_mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())
            setattr(experts, weight_name, nn.Parameter(shard, requires_grad=full.requires_grad))
        experts._expert_weight_names = weights
        experts._expert_row_norms = norms
        experts._expert_group = ep_mesh.get_group()
        experts.forward = _ExpertParallelForward(experts)
        found.append(experts)
    return found


@contextmanager
def _local_view(experts: nn.Module, local_experts: int, group_size: int) -> Iterator[None]:
    """The module as its own implementation expects it, holding only this rank's experts (restored after)."""
    saved_params = {n: experts._parameters[n] for n in experts._expert_weight_names}
    saved_norms = {n: experts._modules[n] for n in _ROW_NORMS if n in experts._modules}
    saved_count = experts.num_experts
    try:
        for n, p in saved_params.items():
            experts._parameters[n] = _local_weight(p, group_size)
        for n in saved_norms:
            experts._modules[n] = nn.Identity()
        experts.num_experts = local_experts
        yield
    finally:
        experts._parameters.update(saved_params)
        experts._modules.update(saved_norms)
        experts.num_experts = saved_count


def _local_weight(weight: Tensor, group_size: int) -> Tensor:
    """This rank's experts, their gradient divided by the expert group's size.

    A slice's gradient sums the tokens of all ``group_size`` ranks of its group, and FSDP2 then averages it
    over the ranks holding the same slice only; the division makes it the mean over all ranks, as for the
    dense weights. (FSDP2's own ``set_gradient_divide_factor`` would do it in the reduction, but needs a
    PREMUL_SUM reduction that gloo lacks.)
    """
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    if local.requires_grad and group_size > 1:
        local = _ScaleGrad.apply(local, 1.0 / group_size)
    return local


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


class _ExpertParallelForward:
    """``forward(hidden_states [N, H], top_k_index [N, k], top_k_weights [N, k])`` across the expert group."""

    def __init__(self, experts: nn.Module) -> None:
        self.experts = experts
        self.implementation = type(experts).forward  # the model's own dispatch over experts implementations

    def __call__(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, **kwargs: Any) -> Tensor:
        experts = self.experts
        group = experts._expert_group
        ep = dist.get_world_size(group)
        local = experts.num_experts // ep
        tokens, top_k = top_k_index.shape
        # One row per (token, chosen expert), ordered by expert, so each destination gets one contiguous block.
        flat_experts = top_k_index.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        sorted_experts = flat_experts[order]
        send_counts = torch.bincount(sorted_experts // local, minlength=ep)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()

        local_ids = (sorted_experts % local).contiguous()
        recv_ids = local_ids.new_empty(sum(recv_splits))
        dist.all_to_all_single(recv_ids, local_ids, recv_splits, send_splits, group=group)
        rows = hidden_states[order // top_k]
        recv_rows = _all_to_all(rows, recv_splits, send_splits, group)

        with _local_view(experts, local, ep):
            ones = torch.ones(recv_ids.shape[0], 1, dtype=top_k_weights.dtype, device=top_k_weights.device)
            out = self.implementation(experts, recv_rows, recv_ids[:, None], ones, **kwargs)
        back = _all_to_all(out.to(hidden_states.dtype), send_splits, recv_splits, group)
        for norm in experts._expert_row_norms:
            back = norm(back)
        weighted = back * top_k_weights.reshape(-1)[order, None].to(back.dtype)
        unsorted = weighted[torch.argsort(order)]
        return unsorted.view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def _all_to_all(rows: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    """Differentiable variable-size all-to-all of rows; backward sends the gradients back the same way."""
    # torch points here from its deprecated torch.distributed.nn.functional.all_to_all_single.
    out = funcol.all_to_all_single_autograd(rows.contiguous(), out_splits, in_splits, group)
    return funcol.wait_tensor(out)
