"""How the policy reaches the rollout engine after each step: the sync mode (``weight_sync``), and what a sync cost.

- ``full``: every weight, every sync (full-weight training).
- ``merged``: every weight, the LoRA adapter merged into a copy of each base weight it touches.
- ``adapter``: the LoRA adapter alone, as a new adapter version; the engine keeps serving the base weights it loaded
  (the trainer never changes them) and applies the adapter to every generation after the sync.
- ``delta``: only the tensors that changed since the version the engine holds, written in place. A tensor is skipped
  only when it equals, bit for bit, the copy of it last sent, kept in host memory (one more copy of the model: why
  it is asked for, not the default). A full sync is sent instead on the first sync (and so after a resume), when the
  engine does not hold the version last sent (it restarted, or another sync reached it), and after a failed push or
  verification. With a LoRA, the merged weights are compared.
- ``auto``: ``adapter`` with a LoRA where the engine serves it, else ``merged``; ``full`` without a LoRA.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn

from lightning_rl.errors import RecipeError
from lightning_rl.models.weights import (
    AdapterReceiver, DeltaReceiver, SyncReport, WeightMismatchError, WeightReceiver, adapter_spec, cast_lora_tensors, iter_adapter_weights,
    iter_full_weights, push_stream,
)

WeightSync = Literal["auto", "full", "merged", "adapter", "delta"]
WEIGHT_SYNC_MODES: tuple[str, ...] = get_args(WeightSync)


def check_weight_sync(mode: str, lora: bool) -> None:
    """Refuse a mode that does not go with the training (LoRA or full), before anything loads."""
    if mode not in WEIGHT_SYNC_MODES:
        raise RecipeError(f"weight_sync must be one of {', '.join(WEIGHT_SYNC_MODES)}, got {mode!r}", "weight_sync")
    if mode in ("adapter", "merged") and not lora:
        raise RecipeError(f"weight_sync: {mode} sends a LoRA adapter{' merged' if mode == 'merged' else ''}, and the "
                          "recipe trains no model.lora; full-weight training syncs full or delta", "weight_sync")
    if mode == "full" and lora:
        raise RecipeError("weight_sync: full with model.lora sends the adapter merged into the weights: say merged "
                          "(or adapter, delta)", "weight_sync")


def engine_options_for(engine_class: type, options: Mapping[str, Any], mode: str, lora_rank: int | None) -> dict[str, Any]:
    """The engine's options, with LoRA serving on (``max_lora_rank``: the adapter's rank) where the mode may send the
    adapter alone and the engine takes that option, unless the recipe set it."""
    options = dict(options)
    if lora_rank is not None and mode in ("auto", "adapter") and "max_lora_rank" in inspect.signature(engine_class).parameters:
        options.setdefault("max_lora_rank", lora_rank)
    return options


def resolve_weight_sync(mode: str, policy: nn.Module, engine: object, lora: bool) -> str:
    """The mode a run syncs with, once its engine is built: ``auto`` decided, an engine that cannot do what was asked
    refused in one line naming the key."""
    check_weight_sync(mode, lora)
    if mode in ("adapter", "auto") and lora:
        refusal = engine.adapter_refusal(adapter_spec(policy)) if isinstance(engine, AdapterReceiver) else (
            f"{type(engine).__name__} applies no adapter sent alone")
        if refusal is None:
            return "adapter"
        if mode == "adapter":
            raise RecipeError(f"weight_sync: adapter: {refusal}; sync merged (or auto)", "weight_sync")
        return "merged"
    if mode == "auto":
        return "merged" if lora else "full"
    if mode == "delta" and not isinstance(engine, DeltaReceiver):
        raise RecipeError(f"weight_sync: delta: {type(engine).__name__} cannot write some tensors in place and keep the "
                          "others; sync full", "weight_sync")
    return mode


class DeltaTracker:
    """The copy of each tensor last sent, in host memory, and the engine version it went out as.

    ``changed`` filters a full stream down to what differs from that copy (bitwise: -0.0 and +0.0 differ, and so
    do two NaNs of other bits), plus the other members of a written group any member of which is sent.
    """

    def __init__(self) -> None:
        self.copies: dict[str, Tensor] = {}
        self.version: int | None = None  # None: nothing sent yet, or the last send failed

    def holds(self, engine: DeltaReceiver) -> bool:
        return self.version is not None and engine.weight_version == self.version

    def changed(self, stream: Iterator[tuple[str, Tensor]], groups: Mapping[str, str]) -> Iterator[tuple[str, Tensor]]:
        skipped: dict[str, list[str]] = {}  # per group, the names held back so far because they had not changed
        sent_groups: set[str] = set()
        for name, tensor in stream:
            group = groups.get(name, name)
            kept = self.copies.get(name)
            if kept is not None and kept.shape == tensor.shape and kept.dtype == tensor.dtype and _same_bits(kept, tensor):
                if group in sent_groups:
                    yield name, tensor
                else:
                    skipped.setdefault(group, []).append(name)
                continue
            self.copies[name] = tensor.detach().to("cpu", copy=True)
            for earlier in skipped.pop(group, ()):
                yield earlier, self.copies[earlier]  # bitwise what the trainer holds now: it did not change
            sent_groups.add(group)
            yield name, tensor

    def record_full(self, stream: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        self.copies = {}
        for name, tensor in stream:
            self.copies[name] = tensor.detach().to("cpu", copy=True)
            yield name, tensor


_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(kept: Tensor, tensor: Tensor) -> bool:
    word = _WORDS[kept.element_size()]
    return torch.equal(kept.reshape(-1).view(word), tensor.detach().to(kept.device).reshape(-1).view(word))


class PolicySync:
    """Syncs the policy to one engine in a run's mode (`resolve_weight_sync`); call `sync` on every rank (the engine
    is None on ranks that only help gather)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.delta = DeltaTracker() if mode == "delta" else None

    def sync(self, policy: nn.Module, engine: WeightReceiver | None, version: int) -> SyncReport:
        if self.mode == "adapter":
            spec = adapter_spec(policy)
            push = None if engine is None else (lambda named: engine.push_adapter(named, spec, version))
            stream = cast_lora_tensors(iter_adapter_weights(policy), None if engine is None else engine.adapter_dtype())
            return push_stream(stream, push, SyncReport(version, "adapter"))
        if self.delta is None or engine is None:
            push = None if engine is None else (lambda named: engine.push_weights(named, version))
            return push_stream(iter_full_weights(policy), push, SyncReport(version, self.mode))
        tracker = self.delta
        if tracker.holds(engine):
            tracker.version = None  # set again once the engine has taken (and verified) the push
            try:
                report = push_stream(tracker.changed(iter_full_weights(policy), engine.write_groups()),
                                     lambda named: engine.push_changed(named, version), SyncReport(version, "delta"))
                tracker.version = version
                return report
            except WeightMismatchError:
                pass  # the engine's state is not the trainer's: send it all, verified again (a second failure stops the run)
        tracker.version = None
        report = push_stream(tracker.record_full(iter_full_weights(policy)),
                             lambda named: engine.push_weights(named, version), SyncReport(version, "full"))
        tracker.version = version
        return report
