"""How the policy reaches the rollout engine after each step: the sync mode (``weight_sync``), and what a sync cost.

- ``full``: every weight, every sync (full-weight training).
- ``merged``: every weight, the LoRA adapter merged into a copy of each base weight it touches.
- ``adapter``: the LoRA adapter alone, as a new adapter version; the engine keeps serving the base weights it loaded
  (the trainer never changes them) and applies the adapter to every generation after the sync. The first sync
  proves those base weights the trainer's, digest against digest, where the engine verifies what it holds (a
  server given by ``url`` may hold another checkpoint's, or weights another run pushed; a float32 engine holds
  other values than a bfloat16 trainer); where they differ, ``auto`` syncs merged instead, ``adapter`` stops.
- ``delta``: only the tensors that changed since the version the engine holds, written in place. A tensor is skipped
  only when it equals, bit for bit, the copy of it last sent, kept in host memory (one more copy of the model: why
  it is asked for, not the default). A full sync is sent instead on the first sync (and so after a resume), when the
  engine does not hold the version last sent (it restarted, or another sync reached it), and after a failed push or
  verification. With a LoRA, the merged weights are compared. Of a changed tensor only its changed elements are
  sent (flat indices and values, `SparseChange`) where they take at most half its bytes and the engine writes them:
  the vLLM server over gloo (its worker keeps a copy of each tensor it was sent, one more copy of the model on the
  engine's host) and the transformers engine; a bf16 step at a small learning rate changes about 1% of the values.
  The in-process vLLM engine is handed whole tensors (nothing travels).
- ``auto``: ``adapter`` with a LoRA where the engine serves it, else ``merged``; ``full`` without a LoRA.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn

from lightning_rl.errors import RecipeError
from lightning_rl.models.weights import (
    AdapterReceiver, AdapterSpec, DeltaReceiver, SentDigests, SparseChange, SyncReport, WeightMismatchError, WeightReceiver, adapter_spec, cast_lora_tensors,
    as_words, held_problems, iter_adapter_weights, iter_full_weights, merge_refusal, push_stream,
)

log = logging.getLogger(__name__)

WeightSync = Literal["auto", "full", "merged", "adapter", "delta"]
WEIGHT_SYNC_MODES: tuple[str, ...] = get_args(WeightSync)
PushInBackground = Literal["auto", "always", "never"]


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


def engine_options_for(engine_class: type, options: Mapping[str, Any], mode: str, lora_rank: int | None, moe: bool = False) -> dict[str, Any]:
    """The engine's options, with LoRA serving on (``max_lora_rank``: the adapter's rank) where the mode may send the
    adapter alone and the engine takes that option, unless the recipe set it. Under ``auto``, not for a mixture of
    experts (``moe``) on an engine whose LoRA serving needs a GPU for one (``MOE_LORA_NEEDS_CUDA``: vLLM's CPU build
    wraps every expert layer in kernels it cannot run, so that engine would not generate at all): it syncs merged."""
    options = dict(options)
    if lora_rank is not None and mode in ("auto", "adapter") and "max_lora_rank" in inspect.signature(engine_class).parameters:
        if mode == "auto" and moe and getattr(engine_class, "MOE_LORA_NEEDS_CUDA", False) and not torch.cuda.is_available():
            return options
        if options.get("max_lora_rank") is None:  # a class_path's init_args hold every default, None included
            options["max_lora_rank"] = lora_rank
    return options


def resolve_weight_sync(mode: str, policy: nn.Module, engine: object, lora: bool) -> str:
    """The mode a run syncs with, once its engine is built: ``auto`` decided, an engine that cannot do what was asked
    refused in one line naming the key."""
    check_weight_sync(mode, lora)
    refusal = None
    if mode in ("adapter", "auto") and lora:
        refusal = engine.adapter_refusal(adapter_spec(policy)) if isinstance(engine, AdapterReceiver) else (
            f"{type(engine).__name__} applies no adapter sent alone")
        if refusal is None:
            return "adapter"
    merging = merge_refusal(policy) if lora else None  # every mode left with a LoRA merges it (check_weight_sync)
    if merging is not None:  # neither the adapter alone nor merged: what the adapter targets is the fix
        alone = f" and the adapter alone: {refusal}" if refusal else ""
        raise RecipeError(f"weight_sync: {mode}: {merging} for a sync{alone}; leave that module out of "
                          "model.lora.target_modules (a list of the modules to adapt: all-linear takes every linear layer)", "lora")
    if mode == "adapter":
        raise RecipeError(f"weight_sync: adapter: {refusal}; sync merged (or auto)", "weight_sync")
    if mode == "auto":
        return "merged" if lora else "full"
    if mode == "delta" and not isinstance(engine, DeltaReceiver):
        raise RecipeError(f"weight_sync: delta: {type(engine).__name__} cannot write some tensors in place and keep the "
                          "others; sync full", "weight_sync")
    return mode


class DeltaTracker:
    """The copy of each tensor last sent, in host memory, and the engine version it went out as.

    ``changed`` filters a full stream down to what differs from that copy (bitwise: -0.0 and +0.0 differ, and so
    do two NaNs of other bits), plus the other members of a written group any member of which is sent. Given a
    ``changes`` dict (for an engine that takes them), it also fills it, before each tensor is yielded, with the
    `SparseChange` of each sent tensor whose changed elements take at most half its bytes (an empty one, for a
    member sent only with its group): the engine is sent those elements alone.
    """

    def __init__(self) -> None:
        self.copies: dict[str, Tensor] = {}
        self.version: int | None = None  # None: nothing sent yet, or the last send failed

    def holds(self, engine: DeltaReceiver) -> bool:
        return self.version is not None and engine.weight_version == self.version

    def changed(self, stream: Iterator[tuple[str, Tensor]], groups: Mapping[str, str],
                changes: dict[str, SparseChange] | None = None) -> Iterator[tuple[str, Tensor]]:
        skipped: dict[str, list[str]] = {}  # per group, the names held back so far because they had not changed
        sent_groups: set[str] = set()
        for name, tensor in stream:
            group = groups.get(name, name)
            kept = self.copies.get(name)
            same = kept is not None and kept.shape == tensor.shape and kept.dtype == tensor.dtype
            host = tensor.detach().to("cpu")  # read off an accelerator once (on the CPU: the tensor itself)
            if same and torch.equal(as_words(kept), as_words(host)):
                if group in sent_groups:
                    if changes is not None:
                        changes[name] = SparseChange.none(host)
                    yield name, tensor
                else:
                    skipped.setdefault(group, []).append(name)
                continue
            self.copies[name] = host.clone() if host.data_ptr() == tensor.data_ptr() else host
            if same and changes is not None:
                change = SparseChange.between(kept, self.copies[name])
                if change is not None:
                    changes[name] = change
            for earlier in skipped.pop(group, ()):
                if changes is not None:
                    changes[earlier] = SparseChange.none(self.copies[earlier])
                yield earlier, self.copies[earlier]  # bitwise what the trainer holds now: it did not change
            sent_groups.add(group)
            yield name, tensor

    def record_full(self, stream: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        self.copies = {}
        for name, tensor in stream:
            self.copies[name] = tensor.detach().to("cpu", copy=True)
            yield name, tensor


class PolicySync:
    """Syncs the policy to one engine in a run's mode (`resolve_weight_sync`); call `sync` (or `stage`) on every rank
    (the engine is None on ranks that only help gather)."""

    def __init__(self, mode: str, requested: str | None = None) -> None:
        self.mode, self.requested = mode, requested or mode  # the mode `resolve_weight_sync` chose for the one asked
        self.delta = DeltaTracker() if mode == "delta" else None
        self.base_checked = mode != "adapter"  # the engine's base weights proven the trainer's (`check_base`)

    def sync(self, policy: nn.Module, engine: WeightReceiver | None, version: int) -> SyncReport:
        self.check_base(policy, engine)
        return self.send(self._weights(policy, engine), engine, version, adapter_spec(policy) if self.mode == "adapter" else None)

    def stage(self, policy: nn.Module, engine: WeightReceiver | None) -> Callable[[int], SyncReport] | None:
        """What the next sync sends, gathered now (on every rank) and copied to host memory: returns the send of that
        copy as a version (``send``), to run on another thread while the trainer goes on; None on ranks without the
        engine. Gathered in full even for a delta, which is filtered as it is sent."""
        self.check_base(policy, engine)
        spec = adapter_spec(policy) if self.mode == "adapter" else None
        stream = self._weights(policy, engine)
        if engine is None:
            for _ in stream:
                pass
            return None
        staged = [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in stream]
        return lambda version: self.send(iter(staged), engine, version, spec)

    def check_base(self, policy: nn.Module, engine: WeightReceiver | None) -> None:
        """Once, before the first adapter sync (on every rank: the base is gathered like a merged sync's weights):
        the base weights the engine holds must be the trainer's, or the adapter sent alone would be applied to
        weights the trainer never trained it on. Not for the modules the adapter trains whole (sent with it). Where
        they differ, ``auto`` syncs merged from then on (every rank), and ``adapter`` stops in one line."""
        if self.base_checked:
            return
        self.base_checked = True
        held = getattr(engine, "held_base", lambda: None)()
        several = torch.distributed.is_available() and torch.distributed.is_initialized()
        if held is None and not several:
            return  # nothing to compare with, and no other rank gathering
        whole = adapter_spec(policy).modules_to_save
        apart = lambda name: any(name.startswith(f"{module}.") for module in whole)  # noqa: E731
        sent = SentDigests(((n, t) for n, t in iter_full_weights(policy, merge_lora=False) if not apart(n)),
                           lambda name: None if held is None else held.dtypes.get(name))
        trained_in = {name: tensor.dtype for name, tensor in sent}  # every rank gathers; only the engine's compares
        problems = [] if held is None else held_problems(
            sent, {name: digest for name, digest in held.digests.items() if not apart(held.ties.get(name, name))}, held.ties)
        if not (_on_any_rank(bool(problems)) if several else problems):
            return
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            cast = sorted({(str(trained_in[n]), str(held.dtypes[n])) for n in trained_in.keys() & held.dtypes.keys()
                           if trained_in[n] != held.dtypes[n] and trained_in[n].itemsize < held.dtypes[n].itemsize})
            why = f"the base weights the engine holds are not the trainer's: {problems[0]}{more}" + (
                f" (the trainer holds the base in {cast[0][0]}, the engine in {cast[0][1]})" if cast else "")
        else:
            why = "the base weights another rank's engine holds are not the trainer's (that rank says which)"
        merging = merge_refusal(policy)
        if self.requested == "auto" and merging is None:
            if problems:
                print(f"note: weight_sync: auto syncs merged, not the adapter alone: {why}", file=sys.stderr, flush=True)
            self.mode = "merged"
            return
        fix = ("load the engine in the trainer's dtype (model.engine.init_args.dtype)" if problems and cast else
               "start the engine from model.model_name_or_path (a server given by url may serve another checkpoint, or "
               "weights another run pushed)") + (", or sync merged" if merging is None else "")
        raise WeightMismatchError(f"weight_sync: {self.requested}: the LoRA adapter would be sent alone, onto the base the engine "
                                  f"holds, and {why}; {fix}")

    def _weights(self, policy: nn.Module, engine: WeightReceiver | None) -> Iterator[tuple[str, Tensor]]:
        if self.mode == "adapter":
            return cast_lora_tensors(iter_adapter_weights(policy), None if engine is None else engine.adapter_dtype())
        return iter_full_weights(policy)

    def send(self, stream: Iterator[tuple[str, Tensor]], engine: WeightReceiver | None, version: int,
             adapter: AdapterSpec | None = None) -> SyncReport:
        """Push ``stream`` (every weight, or the adapter) as ``version``; a delta sends only what changed in it."""
        if self.mode == "adapter":
            push = None if engine is None else (lambda named: engine.push_adapter(named, adapter, version))
            return push_stream(stream, push, SyncReport(version, "adapter"))
        if self.delta is None or engine is None:
            push = None if engine is None else (lambda named: engine.push_weights(named, version))
            return push_stream(stream, push, SyncReport(version, self.mode))
        tracker, full = self.delta, None
        sparse = _takes_sparse_deltas(engine)  # asked before every push: from the first on, it keeps what deltas need
        if tracker.holds(engine):
            tracker.version = None  # set again once the engine has taken (and verified) the push
            changes: dict[str, SparseChange] | None = {} if sparse else None
            push = (lambda named: engine.push_changed(named, version)) if changes is None else (
                lambda named: engine.push_changed(named, version, changes))
            try:
                report = push_stream(tracker.changed(stream, engine.write_groups(), changes), push, SyncReport(version, "delta"))
                report.num_bytes -= sum(change.dense_bytes - change.nbytes for change in (changes or {}).values())
                tracker.version = version
                return report
            except WeightMismatchError as error:
                log.warning("weight_sync: delta: the engine does not hold what the syncs before this one sent (%s): "
                            "every weight is sent again, and verified", str(error).splitlines()[0][:300])
                # The engine's state is not the trainer's: send it all, verified again (a second failure stops the
                # run). The delta's stream was read to its end, so the copies are every weight as it is now: sent
                # from them, not gathered again, which the other ranks (they gathered once) would not join.
                full = iter(list(tracker.copies.items()))
        tracker.version = None
        full = full if full is not None else tracker.record_full(stream)
        report = push_stream(full, lambda named: engine.push_weights(named, version), SyncReport(version, "full"))
        tracker.version = version
        return report


def _takes_sparse_deltas(engine: DeltaReceiver) -> bool:
    """Whether ``engine`` takes a delta's changed elements alone (`SparseChange`); asked before every push of a delta
    sync, the first (full) one included, so that it keeps from then on what it needs to write them (the server's
    worker: a copy of each tensor it is sent)."""
    take = getattr(engine, "take_sparse_deltas", None)
    return bool(take()) if take is not None else False


def _on_any_rank(flag: bool) -> bool:
    """``flag`` or'ed over the ranks of the default process group."""
    accelerator = torch.accelerator.current_accelerator(check_available=True) if "gloo" not in torch.distributed.get_backend() else None
    device = torch.device("cpu") if accelerator is None else torch.device(accelerator.type, torch.accelerator.current_device_index())
    total = torch.tensor([float(flag)], device=device)
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.MAX)
    return bool(total.item())


def check_push_in_background(setting: str, async_mode: bool, max_staleness: int) -> None:
    if setting not in get_args(PushInBackground):
        raise RecipeError(f"push_in_background must be one of {', '.join(get_args(PushInBackground))}, got {setting!r}", "push_in_background")
    if setting == "always" and not (async_mode and max_staleness >= 1):
        raise RecipeError("push_in_background: always needs async_mode with max_staleness >= 1: otherwise the next batch "
                          "is sampled by the weights being pushed, and the trainer waits for them all the same", "push_in_background")


def pushes_in_background(setting: str, async_mode: bool, max_staleness: int, policy: nn.Module, mode: str, device: torch.device) -> bool:
    """Whether a run's pushes go through `BackgroundPush`: ``always``, ``never``, or ``auto``: in async mode with
    ``max_staleness >= 1``, training on an accelerator, where the host copy it stages (the adapter, or every weight)
    takes at most a quarter of the host memory free now (a model too large for it is streamed to the engine tensor by
    tensor, as before). Not on a CPU: there the push's own work takes the cores the step and the engine compute on,
    and measured on 2 cores it gained nothing (``benchmarks/grpo_async_overlap.py``, ``async_keep_background``)."""
    if setting != "auto":
        return setting == "always"
    if not (async_mode and max_staleness >= 1) or device.type == "cpu":
        return False
    staged = sum(p.numel() * p.element_size() for n, p in policy.named_parameters() if mode != "adapter" or "lora_" in n)
    return staged <= os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4


class BackgroundPush:
    """Asynchronous GRPO's weight pushes off the trainer's thread: each is staged on the trainer's thread (gathered on
    every rank, copied to host memory: `PolicySync.stage`) and sent from a worker thread while the trainer trains its
    next step on a batch the previous weights sampled (``max_staleness >= 1``). One push at a time: the next one, and
    ``join``, wait for it and raise its failure (a weight mismatch stops the run a step later, never unseen)."""

    def __init__(self, sync: PolicySync, landed: Callable[[], None]) -> None:
        self.sync, self.landed = sync, landed
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="weight-push")
        self._pending: Future[SyncReport] | None = None

    def push(self, policy: nn.Module, engine: WeightReceiver | None, version: int) -> SyncReport | None:
        """Stage the weights as ``version`` and send them on the worker; returns the previous push's report."""
        previous = self.join()
        staged = self.sync.stage(policy, engine)
        if staged is not None:
            self._pending = self._worker.submit(self._send, staged, version)
        return previous

    def _send(self, staged: Callable[[int], SyncReport], version: int) -> SyncReport:
        report = staged(version)
        self.landed()
        return report

    def join(self) -> SyncReport | None:
        """Wait for the push in flight, if any: its report, or its failure raised here."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def close(self) -> None:
        """Wait for the push in flight (its failure is not raised: the run is ending by another error, or has joined)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            with contextlib.suppress(BaseException):
                pending.result()
        self._worker.shutdown(wait=True)
