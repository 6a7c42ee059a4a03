"""Tensors from the trainer to vLLM server workers over a private gloo group: the CPU stand-in for NCCL.

The trainer is rank 0 of a group of its own (its own TCPStore, never the trainer's default process
group), the server's workers join as ranks 1..N. Weights travel in chunks: the workers first learn
each chunk's names, dtypes and shapes (the control message, sent over HTTP by the caller), then the
bytes follow as one broadcast per tensor. Only torch is needed here, so the trainer side runs in an
environment without vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_CHUNK_BYTES = 64 * 2**20


class WeightTransferError(RuntimeError):
    """A weight transfer failed or timed out; the message names the tensor."""


@dataclass(frozen=True)
class ChunkManifest:
    """What the receiving side must allocate before the bytes of one chunk arrive. ``keep``: the receiver keeps a
    copy of every tensor of the push (the copies later changes are written into: `decode_changes`); ``reset``: the
    chunk starts a push of every tensor, and the copies kept before it are dropped."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    keep: bool = False
    reset: bool = False

    @classmethod
    def of(cls, chunk: list[tuple[str, torch.Tensor]], keep: bool = False, reset: bool = False) -> ChunkManifest:
        return cls(
            names=[name for name, _ in chunk],
            dtype_names=[str(t.dtype).removeprefix("torch.") for _, t in chunk],
            shapes=[list(t.shape) for _, t in chunk],
            keep=keep, reset=reset,
        )

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> ChunkManifest:
        manifest = cls(names=list(fields["names"]), dtype_names=list(fields["dtype_names"]),
                       shapes=[list(s) for s in fields["shapes"]], keep=bool(fields.get("keep")), reset=bool(fields.get("reset")))
        if not len(manifest.names) == len(manifest.dtype_names) == len(manifest.shapes):
            raise ValueError(
                f"chunk manifest: {len(manifest.names)} names, {len(manifest.dtype_names)} dtypes, "
                f"{len(manifest.shapes)} shapes"
            )
        return manifest

    def to_dict(self) -> dict[str, Any]:
        return {"names": self.names, "dtype_names": self.dtype_names, "shapes": self.shapes, "keep": self.keep, "reset": self.reset}


CHANGED_INDEX, CHANGED_VALUES = "#changed.index", "#changed.values"  # never in a parameter's name


def encode_changes(named_tensors: Iterable[tuple[str, torch.Tensor]], changes: Mapping[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream, each tensor named in ``changes`` (read as each tensor passes) replaced by its changed elements
    (``.index``, flat, and ``.values``), sent as two tensors the receiver's `decode_changes` writes into its copy."""
    for name, tensor in named_tensors:
        change = changes.get(name)
        if change is not None:
            yield name + CHANGED_INDEX, change.index
            yield name + CHANGED_VALUES, change.values
        else:
            yield name, tensor


def decode_changes(received: list[tuple[str, torch.Tensor]], kept: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """`encode_changes` undone: each tensor sent as its changed elements, written into a copy of the one ``kept``."""
    decoded: list[tuple[str, torch.Tensor]] = []
    pending: tuple[str, torch.Tensor] | None = None
    for name, tensor in received:
        if name.endswith(CHANGED_INDEX):
            pending = (name.removesuffix(CHANGED_INDEX), tensor)
            continue
        if not name.endswith(CHANGED_VALUES):
            decoded.append((name, tensor))
            continue
        base, index = pending if pending is not None else (None, None)
        pending = None
        held = kept.get(base) if base == name.removesuffix(CHANGED_VALUES) else None
        if held is None:
            raise WeightTransferError(f"'{name.removesuffix(CHANGED_VALUES)}': its changed elements arrived, and this "
                                      "worker keeps no copy of it to write them into (it was restarted, or the push "
                                      "before was not kept): push every weight again")
        if tensor.dtype != held.dtype or index.numel() != tensor.numel() or (
                index.numel() and not 0 <= int(index.min()) <= int(index.max()) < held.numel()):
            raise WeightTransferError(f"'{base}': a change of {index.numel()} elements ({tensor.dtype}) does not fit the "
                                      f"copy kept ({held.dtype}, {held.numel()} elements)")
        written = held.reshape(-1).clone()
        written[index.long()] = tensor
        decoded.append((base, written.reshape(held.shape)))
    if pending is not None:
        raise WeightTransferError(f"'{pending[0]}': its changed elements' indices arrived without their values")
    return decoded


def host_store(address: str, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """Rank 0's rendezvous store, on a free port (`.port`), made before the workers are told where to join."""
    return dist.TCPStore(address, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)


def worker_store(address: str, port: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    return dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)


def join_group(store: dist.TCPStore, rank: int, world_size: int, timeout: timedelta) -> dist.ProcessGroupGloo:
    """Returns once all `world_size` ranks have joined through `store`."""
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def chunks(
    named_tensors: Iterable[tuple[str, torch.Tensor]], chunk_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group the stream into chunks of about `chunk_bytes`, so at most one chunk is held at a time; a tensor's changed
    elements' indices and values (`encode_changes`) always in the same chunk."""
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        tensor = tensor.detach().to("cpu").contiguous()
        chunk.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= chunk_bytes and not name.endswith(CHANGED_INDEX):
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _broadcast(group: dist.ProcessGroupGloo, buffer: torch.Tensor, what: str) -> None:
    try:
        group.broadcast(buffer, 0).wait()
    except RuntimeError as err:
        raise WeightTransferError(f"weight transfer of {what} failed: {err}") from err


def send_chunk(group: dist.ProcessGroupGloo, chunk: list[tuple[str, torch.Tensor]]) -> None:
    """Rank 0: broadcast the bytes of every tensor of `chunk`, in order."""
    for index, (name, tensor) in enumerate(chunk):
        if tensor.numel():
            _broadcast(group, _as_bytes(tensor), f"'{name}' (#{index + 1} of {len(chunk)} in this chunk)")


def receive_chunk(group: dist.ProcessGroupGloo, manifest: ChunkManifest) -> list[tuple[str, torch.Tensor]]:
    """A worker: receive every tensor the manifest lists, before any is loaded (a bad name never desyncs the stream)."""
    received = []
    for index, (name, dtype_name, shape) in enumerate(zip(manifest.names, manifest.dtype_names, manifest.shapes)):
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise WeightTransferError(f"'{name}': unknown dtype {dtype_name!r}")
        tensor = torch.empty(shape, dtype=dtype)
        if tensor.numel():
            _broadcast(group, _as_bytes(tensor), f"'{name}' (#{index + 1} of {len(manifest.names)} in this chunk)")
        received.append((name, tensor))
    return received
