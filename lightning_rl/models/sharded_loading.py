"""Weights read straight into FSDP2 shards: no rank ever holds the whole model, not even while loading.

``load_causal_lm(..., defer_weights=True)`` builds the model (and its LoRA adapter) on the meta device and
records where its checkpoint lies. The FSDP2 strategy shards it, allocates each rank's shards, and calls
``load_deferred_weights``: every rank opens the safetensors files (memory-mapped) and reads only the rows of
each parameter that its shard holds. Replicated tensors (persistent buffers) are read whole; they are small.
LoRA factors, which no checkpoint holds, are initialised as peft does, from a seed shared by every rank.
Non-persistent buffers (rotary frequencies) are rebuilt by transformers' own ``initialize_weights``.
"""

from __future__ import annotations

import json
import math
import time
import weakref
import zlib
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard  # FSDP2's dim 0 over an inner Shard(0)
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # the offsets DCP itself uses

from lightning_rl.errors import UserError
from lightning_rl.models.weights import hf_name, policy_model

# Models built on the meta device -> the folder their weights still have to come from. A registry beside the models,
# not an attribute on them: the strategy asks ``pending_checkpoint``, the loader answers.
_PENDING: weakref.WeakKeyDictionary[nn.Module, Path] = weakref.WeakKeyDictionary()
_RENAMED: weakref.WeakKeyDictionary[nn.Module, dict[str, str]] = weakref.WeakKeyDictionary()  # model name -> checkpoint key


class CheckpointMismatchError(UserError, RuntimeError):
    """The checkpoint on disk does not hold a tensor the model needs, or holds it in another shape."""

    key = "model_name_or_path"


@dataclass
class ShardedLoadReport:
    """What one rank read: the number of tensors, of elements, and the time it took."""

    tensors: int = 0
    elements_read: int = 0
    elements_in_model: int = 0
    seconds: float = 0.0


def defer_weights(model: nn.Module, checkpoint: Path) -> None:
    """Mark a meta-device model as waiting for the weights in ``checkpoint`` (a from_pretrained folder). The keys
    transformers renames as it loads are read now, while the model's classes are its own (FSDP2 renames them)."""
    _PENDING[model] = Path(checkpoint)
    _RENAMED[model] = _renamed_keys(model, {hf_name(name) for name, _ in _tensors(model)}, _checkpoint_files(Path(checkpoint)))


def pending_checkpoint(model: nn.Module) -> Path | None:
    """The folder a deferred model (a transformers or peft model) still has to load, or None."""
    return _PENDING.get(policy_model(model))


def _checkpoint_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, through the index of a sharded checkpoint when there is one."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.exists():
        raise CheckpointMismatchError(f"{folder}: no model.safetensors or model.safetensors.index.json to load sharded")
    with safe_open(single, "pt") as f:
        return {name: single for name in f.keys()}


def _local_rows(tensor: DTensor) -> tuple[int, int]:
    """The first row and row count of this rank's shard, for layouts that split dim 0 only.

    That is FSDP2's ``Shard(0)``, and FSDP2 over expert parallelism (``Shard(0)`` over the expert group inside
    the slice each FSDP rank holds); DTensor's own layout arithmetic gives the offset of either.
    """
    if any(not (isinstance(p, (Shard, _StridedShard)) and p.dim == 0) and not p.is_replicate() for p in tensor.placements):
        raise CheckpointMismatchError(f"sharded loading reads dim-0 shards only, got placements {tensor.placements}")
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if tuple(shape[1:]) != tuple(tensor.shape[1:]) or any(offset[1:]):
        raise CheckpointMismatchError(f"sharded loading reads whole rows only, got a {tuple(shape)} shard of {tuple(tensor.shape)}")
    return (offset[0] if shape[0] else 0), shape[0]


def lora_factor(name: str, shape: torch.Size, seed: int) -> Tensor:
    """peft's default init of a LoRA factor (A: Kaiming-uniform, B: zeros; an embedding's the other way round), drawn from ``seed`` and the factor's
    name alone: the same tensor on every rank, and in a run on one process (`init_lora_factors`) as in a sharded one.
    Drawn in float32 whatever the default dtype (a precision plugin sets it to float64 or bfloat16 around one process's
    `configure_model`, not around a sharded load), and cast by the parameter it is copied into."""
    if ".lora_B." in name or ".lora_embedding_A." in name:
        return torch.zeros(shape, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
    if ".lora_embedding_B." in name:  # an embedding's: A zeros, B standard normal
        return torch.empty(shape, dtype=torch.float32).normal_(generator=generator)
    bound = 1.0 / math.sqrt(math.prod(shape[1:]))  # kaiming_uniform_(a=sqrt(5)): 1 / sqrt(fan_in)
    return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)


def _is_lora_factor(name: str) -> bool:
    return any(f".{part}." in name for part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"))


@torch.no_grad()
def init_lora_factors(model: nn.Module, seed: int) -> None:
    """Draw every LoRA factor of a model loaded whole as `load_deferred_weights` draws a sharded one's."""
    for name, tensor in _tensors(policy_model(model)):
        if _is_lora_factor(name):
            tensor.copy_(lora_factor(name, tensor.shape, seed))


def _tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Parameters (each shared one once) and persistent buffers, by module name."""
    seen: set[int] = set()
    persistent = set(model.state_dict(keep_vars=True))
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if id(tensor) in seen or (not isinstance(tensor, nn.Parameter) and name not in persistent):
            continue
        seen.add(id(tensor))
        yield name, tensor


# A stacked experts tensor of the model, and the per-expert tensors a checkpoint may hold for it instead (in order).
_PER_EXPERT = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _per_expert_keys(key: str, experts: int, files: dict[str, Path]) -> list[list[str]] | None:
    """For ``PREFIX.experts.gate_up_proj`` (or ``down_proj``), each expert's keys ``PREFIX.experts.E.gate_proj.weight``
    and ``...up_proj.weight`` (``down_proj.weight``), when the checkpoint holds every one of them; else None."""
    prefix, _, fused = key.rpartition(".")
    if fused not in _PER_EXPERT or not prefix.endswith("experts"):
        return None
    keys = [[f"{prefix}.{e}.{part}.weight" for part in _PER_EXPERT[fused]] for e in range(experts)]
    return keys if all(k in files for group in keys for k in group) else None


def _renamed_keys(model: nn.Module, names: set[str], files: dict[str, Path]) -> dict[str, str]:
    """Model name -> checkpoint key, for the keys transformers renames as it loads (its conversion mapping: LLaVA's
    checkpoints hold ``vision_tower.*``, its model ``model.vision_tower.*``), as ``from_pretrained`` finds them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    renamings = [t for t in get_model_conversion_mapping(inner) if isinstance(t, WeightRenaming)]
    present = dict.fromkeys(names, True)
    renamed: dict[str, str] = {}
    for key in files:
        name, _ = rename_source_key(key, renamings, [], getattr(inner, "base_model_prefix", None), present)
        if name != key and name in present:
            renamed.setdefault(name, key)
    return renamed


@torch.no_grad()
def load_deferred_weights(model: nn.Module, *, seed: int = 0) -> ShardedLoadReport:
    """Fill a sharded, allocated model from the checkpoint ``defer_weights`` recorded; returns this rank's reads."""
    hf = policy_model(model)
    folder = _PENDING[hf]
    start = time.perf_counter()
    files = _checkpoint_files(folder)
    named = list(_tensors(hf))
    renamed = _RENAMED.pop(hf, {})
    report = ShardedLoadReport()
    with ExitStack() as stack:
        handles: dict[Path, object] = {}
        for name, tensor in named:
            sharded = isinstance(tensor, DTensor)
            local = tensor.to_local() if sharded else tensor
            rows = _local_rows(tensor) if sharded else (0, tensor.shape[0] if tensor.dim() else 0)
            report.elements_in_model += tensor.numel()
            if _is_lora_factor(name):
                local.copy_(lora_factor(name, tensor.shape, seed)[rows[0] : rows[0] + rows[1]])
            else:
                key = hf_name(name)
                key = key if key in files else renamed.get(key, key)

                def read(key: str) -> object:
                    if files[key] not in handles:
                        handles[files[key]] = stack.enter_context(safe_open(files[key], "pt"))
                    return handles[files[key]].get_slice(key)

                if key not in files and (per_expert := _per_expert_keys(key, tensor.shape[0], files)) is not None:
                    # Experts saved one tensor each (as save_pretrained writes them): this rank's rows of the stacked
                    # tensor are its experts' tensors, gate and up joined as the model's fused gate_up_proj holds them.
                    part = torch.stack([torch.cat([read(k)[...] for k in keys]) for keys in per_expert[rows[0] : rows[0] + rows[1]]])
                    if tuple(part.shape[1:]) != tuple(tensor.shape[1:]):
                        raise CheckpointMismatchError(f"{folder}: the experts of '{key}' stack to {tuple(part.shape[1:])} per expert, the model expects {tuple(tensor.shape[1:])}")
                    local.copy_(part)
                    report.elements_read += part.numel()
                    tensor._is_hf_initialized = True
                    report.tensors += 1
                    continue
                if key not in files:
                    raise CheckpointMismatchError(f"{folder}: the checkpoint has no tensor '{key}' (model parameter '{name}')")
                stored = read(key)
                if tuple(stored.get_shape()) != tuple(tensor.shape):
                    raise CheckpointMismatchError(
                        f"{files[key]}: '{key}' has shape {tuple(stored.get_shape())}, the model expects {tuple(tensor.shape)}"
                    )
                part = stored[rows[0] : rows[0] + rows[1]] if sharded else stored[...]
                local.copy_(part)
                report.elements_read += part.numel()
            tensor._is_hf_initialized = True
            report.tensors += 1
    hf.initialize_weights()  # only what is not marked above: the non-persistent buffers
    del _PENDING[hf]
    report.seconds = time.perf_counter() - start
    return report
