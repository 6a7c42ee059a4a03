"""Stream a (possibly sharded) model's weights, by Hugging Face name, to a rollout engine.

Each parameter is gathered on its own with ``DTensor.full_tensor()``, so the extra memory a sync needs is one
full parameter, never the whole model. Every rank walks the same list in the same order (checked up front),
and the gathers run on a process group with their own timeout, so a rank that stalls turns into an error
naming the parameter rather than a hang. LoRA is merged into a copy of each gathered base weight: the
trainer's own weights are never written to, so "unmerge" is exact by construction.

Engines receive ``(hf_name, tensor)`` pairs through ``push_weights(named_tensors, version)``, and by default prove
after each push that they hold what was sent: `SentDigests` takes a digest of each tensor as it passes (cast to the
dtype the engine holds it in), the engine takes the same digest of its live weights per Hugging Face name, and
`verify_held` compares the two, stopping the run with `WeightMismatchError` on the first difference.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_rl.errors import UserError
from lightning_rl.models.structure import find_model_roots

DEFAULT_SYNC_TIMEOUT = timedelta(minutes=5)

# Module-name segments that wrappers insert and Hugging Face names do not have.
_WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "base_layer"})


class WeightSyncError(RuntimeError):
    """The ranks disagree on what to send, or a model part cannot be sent as asked."""


class WeightSyncTimeoutError(WeightSyncError):
    """A collective of the sync did not complete in time: some rank stalled or diverged."""


class WeightMismatchError(UserError, WeightSyncError):
    """After a sync the engine does not hold the trainer's weights; the line names the tensor and the version.

    The run ends with exit code 1, as a diverged one does: the recipe ran, and sampling on would train on rollouts
    of weights the trainer never had. ``model.engine``'s ``verify_weights: false`` skips the check.
    """

    key = "engine"
    exit_code = 1


@runtime_checkable
class WeightReceiver(Protocol):
    """Anything that loads weights by Hugging Face name (the rollout engines). A push may return the seconds the
    engine stopped generating for it (None: not measured)."""

    def push_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> float | None: ...


@dataclass(frozen=True)
class AdapterSpec:
    """A LoRA adapter as an engine needs to judge and load it: peft's config (``adapter_config.json``), each adapted
    module's Hugging Face name and base layer class, the modules it trains whole, and those it cannot merge."""

    config: dict[str, Any]
    layers: dict[str, str]
    modules_to_save: tuple[str, ...] = ()
    unmergeable: tuple[str, ...] = ()  # a LoRA variant (DoRA, ...) or a LoRA bias

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    @property
    def scaling(self) -> float:
        """What each module's ``B @ A`` is multiplied by (peft's: alpha / r, or alpha / sqrt(r) with rsLoRA)."""
        root = self.rank ** 0.5 if self.config.get("use_rslora") else self.rank
        return self.config["lora_alpha"] / root


@dataclass(frozen=True)
class HeldWeights:
    """What an engine holds, by Hugging Face name: each tensor's `tensor_digest` and dtype, and each tied name's
    source (``lm_head.weight`` -> ``model.embed_tokens.weight``)."""

    digests: dict[str, int]
    dtypes: dict[str, torch.dtype]
    ties: dict[str, str]


@runtime_checkable
class AdapterReceiver(Protocol):
    """An engine that serves the base weights it loaded and applies a LoRA adapter sent alone."""

    def adapter_refusal(self, adapter: AdapterSpec) -> str | None:
        """Why this engine cannot serve ``adapter`` (naming the module), or None if it can."""

    def adapter_dtype(self) -> torch.dtype | None:
        """The dtype the engine casts an adapter's LoRA tensors to as it loads them, or None if it keeps them as
        trained: the adapter is sent in it, which loses nothing the engine would keep and sends fewer bytes."""

    def push_adapter(self, named_tensors: Iterable[tuple[str, Tensor]], adapter: AdapterSpec, version: int) -> float | None:
        """Load the adapter's tensors (peft's names) as ``version``; generation after it uses them.

        An engine may also give ``held_base() -> HeldWeights | None``: the base weights it holds (None where it does
        not check what it holds, ``verify_weights: false``). The first adapter sync proves them the trainer's.
        """


@runtime_checkable
class DeltaReceiver(Protocol):
    """An engine that writes some of its tensors in place and keeps the others as they are."""

    @property
    def weight_version(self) -> int: ...

    def write_groups(self) -> Mapping[str, str]:
        """Tensor name -> the group it is written with: tensors of one group travel together (a fused module)."""

    def push_changed(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> float | None:
        """Write these tensors in place as ``version``; every tensor not sent keeps the value it holds. An engine
        with a ``take_sparse_deltas`` method that returns True takes a third argument, ``changes``: name ->
        `SparseChange`, the elements of that tensor that changed since the last push (the rest of it is not sent)."""


_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_words(tensor: Tensor) -> Tensor:
    """A tensor's elements as integers of the same width, flat: equal words are equal bits (-0.0 is not 0.0)."""
    return tensor.detach().reshape(-1).view(_WORDS[tensor.element_size()])


@dataclass(frozen=True)
class SparseChange:
    """The elements of one tensor that changed since the copy the engine holds: their flat ``index`` (int32 where
    the tensor has fewer than 2**31 elements) and their new ``values``, bit for bit; the others are the held copy's."""

    index: Tensor
    values: Tensor
    dense_bytes: int

    @property
    def nbytes(self) -> int:
        return self.index.numel() * self.index.element_size() + self.values.numel() * self.values.element_size()

    @classmethod
    def none(cls, tensor: Tensor) -> SparseChange:
        """No element of ``tensor`` changed: nothing of it travels."""
        index = torch.empty(0, dtype=torch.int32 if tensor.numel() < 2**31 else torch.int64)
        return cls(index, tensor.new_empty(0, device="cpu"), tensor.numel() * tensor.element_size())

    @classmethod
    def between(cls, held: Tensor, new: Tensor) -> SparseChange | None:
        """The change from ``held`` to ``new`` (same shape and dtype), or None where it would take more than half
        the bytes of ``new`` itself."""
        new = new.detach().to(held.device)
        dense = new.numel() * new.element_size()
        new_words = as_words(new)
        index = (as_words(held) != new_words).nonzero().reshape(-1)
        width = new.element_size() + (4 if new.numel() < 2**31 else 8)
        if index.numel() * width > dense // 2:
            return None
        index = index.to(torch.int32) if new.numel() < 2**31 else index
        return cls(index, new.detach().reshape(-1)[index.long()], dense)


@dataclass
class SyncReport:
    """What one sync moved and how long it took (``pause_seconds``: the engine's stop, where it measured one)."""

    version: int
    mode: str = "full"
    num_tensors: int = 0
    num_bytes: int = 0
    largest_tensor_bytes: int = 0
    seconds: float = 0.0
    pause_seconds: float = 0.0
    names: list[str] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        """Logged under ``train/``, summed over a step's syncs (the run's first with its first step's): ``sync/count``
        of them, of which ``sync/full`` sent every weight (a full or merged sync, or a delta's fall-back to one)."""
        return {"sync/bytes": float(self.num_bytes), "sync/pause_s": self.pause_seconds, "sync/seconds": self.seconds,
                "sync/count": 1.0, "sync/full": float(self.mode in ("full", "merged"))}


def hf_name(name: str) -> str:
    """Drop the name segments that peft and module wrappers add (``base_layer``, ``_orig_mod``, ...)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def _is_peft_model(module: nn.Module) -> bool:
    return callable(getattr(module, "get_base_model", None)) and hasattr(module, "peft_config")


def policy_model(module: nn.Module) -> nn.Module:
    """The Hugging Face model whose names an engine knows: unwraps peft, or finds it inside a LightningModule."""
    if _is_peft_model(module):
        return module.get_base_model()
    if hasattr(module, "config") and hasattr(module, "_no_split_modules"):
        return module
    trainable = [root for root in find_model_roots(module) if any(p.requires_grad for p in root.parameters())]
    if len(trainable) != 1:
        found = ", ".join(type(root).__name__ for root in trainable) or "none"
        raise WeightSyncError(
            f"cannot tell which model to sync inside {type(module).__name__} (trainable models found: {found}); "
            "pass the policy model itself"
        )
    return policy_model(trainable[0])


@dataclass
class _Entry:
    """One tensor to send: a parameter or persistent buffer, plus the LoRA factors to merge into it."""

    name: str
    tensor: Tensor
    lora: list[tuple[Tensor, Tensor, float, bool]] = field(default_factory=list)


def _merge_problem(module: nn.Module, module_name: str, adapter: str, tied: set[int]) -> str | None:
    """Why ``adapter`` of a peft LoRA layer cannot be merged into its base weight here (None: it can); ``tied``: the
    ids of the model's tensors that several modules share."""
    if module.lora_variant.get(adapter) is not None or module.lora_bias.get(adapter, False):
        return f"merging adapter '{adapter}' of {module_name} ({type(module).__name__} with a LoRA variant or bias) is not supported"
    if not isinstance(module.get_base_layer(), nn.Linear):
        return f"merging LoRA into {type(module.get_base_layer()).__name__} at {module_name} is not supported"
    if id(module.get_base_layer().weight) in tied:
        return (f"merging LoRA into {module_name} is not supported: another module shares its weight (tied embeddings), "
                "and the adapter adapts this one alone")
    return None


def _tied(model: nn.Module) -> set[int]:
    """The ids of the parameters that more than one module holds (a tied embedding and output head)."""
    seen: set[int] = set()
    tied: set[int] = set()
    for _, param in model.named_parameters(remove_duplicate=False):
        (tied if id(param) in seen else seen).add(id(param))
    return tied


def _adapters(layer: nn.Module) -> list[str]:
    """The active adapters a peft LoRA layer holds factors of: ``lora_A``/``lora_B`` (linear and convolution layers)
    or ``lora_embedding_A``/``_B`` (embeddings)."""
    return [a for a in layer.active_adapters if a in layer.lora_A or a in getattr(layer, "lora_embedding_A", {})]


def merge_refusal(module: nn.Module) -> str | None:
    """Why the policy's LoRA adapters cannot be merged into its weights for a sync (None: they can), read before any
    sync: the first layer that cannot."""
    from peft.tuners.lora import LoraLayer

    model = policy_model(module)
    tied = _tied(model)
    for module_name, layer in model.named_modules():
        if isinstance(layer, LoraLayer) and not (layer.disable_adapters or layer.merged):
            for adapter in _adapters(layer):
                problem = _merge_problem(layer, module_name, adapter, tied)
                if problem is not None:
                    return problem
    return _tied_and_trained_whole(model, tied)


def _tied_and_trained_whole(model: nn.Module, tied: set[int]) -> str | None:
    """Why a module peft trains whole (``modules_to_save``) cannot be sent under its own name, or None: its original
    weight is tied to another module's (an embedding and the output head), which keeps training on the original in
    the trainer while the engine would read the trained copy in both."""
    from peft.utils import ModulesToSaveWrapper

    for module_name, layer in model.named_modules():
        if isinstance(layer, ModulesToSaveWrapper) and any(id(p) in tied for p in layer.original_module.parameters()):
            return (f"{module_name} is trained whole (modules_to_save), but its weight is tied to another module's, which "
                    "goes on using the original: the engine would use the trained copy in both; untie the weights "
                    "(tie_word_embeddings: false) or leave it out of modules_to_save")
    return None


def export_merge_refusal(module: nn.Module, sharded: bool) -> str | None:
    """Why a merged export of the policy would not be the model trained (None: it would be). A sharded (FSDP2) export
    merges as a sync does (``merge_refusal``); otherwise peft's ``merge_and_unload`` merges in place, which writes an
    adapter of a weight that modules share (a tied embedding and head) into all of them."""
    if sharded:
        return merge_refusal(module)
    from peft.tuners.lora import LoraLayer

    model = policy_model(module)
    tied = _tied(model)
    for module_name, layer in model.named_modules():
        if isinstance(layer, LoraLayer) and id(getattr(layer.get_base_layer(), "weight", None)) in tied:
            return (f"merging LoRA into {module_name} would change every module sharing its weight (tied embeddings), "
                    "and the adapter adapts this one alone")
    return None


def _lora_factors(module: nn.Module, module_name: str, tied: set[int]) -> list[tuple[Tensor, Tensor, float, bool]]:
    """(A, B, scaling, fan_in_fan_out) of each active, unmerged adapter of a peft LoRA linear layer."""
    if module.disable_adapters or module.merged:
        return []
    factors = []
    for adapter in _adapters(module):
        problem = _merge_problem(module, module_name, adapter, tied)
        if problem is not None:
            raise WeightSyncError(f"{problem}; sync the adapter alone with iter_adapter_weights()")
        factors.append((
            module.lora_A[adapter].weight,
            module.lora_B[adapter].weight,
            float(module.scaling[adapter]),
            bool(getattr(module, "fan_in_fan_out", False)),
        ))
    return factors


def _reshard(model: nn.Module) -> None:
    """A model root may still hold gathered weights after a forward; shards are what the sync streams."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _plan(model: nn.Module, merge_lora: bool) -> list[_Entry]:
    """The tensors to send, in ``named_modules`` order, each shared (tied) tensor once."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    _reshard(model)
    if merge_lora and (problem := _tied_and_trained_whole(model, _tied(model))):
        raise WeightSyncError(problem)
    persistent = set(model.state_dict(keep_vars=True))
    seen: set[int] = set()
    entries: list[_Entry] = []
    tied = _tied(model) if merge_lora else set()
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            lora = _lora_factors(module, module_name, tied) if merge_lora else []
            for name, param in base.named_parameters(recurse=False):
                if id(param) not in seen:
                    entries.append(_Entry(hf_name(f"{module_name}.{name}"), param, lora if name == "weight" else []))
            seen.update(id(p) for p in module.parameters())  # adapter factors travel merged, or not at all
            continue
        if isinstance(module, ModulesToSaveWrapper):  # a module trained whole: its trained copy, under the module's name
            (active,) = module.active_adapters
            copy = module.modules_to_save[active]
            kept = set(copy.state_dict(keep_vars=True))
            for name, tensor in [*copy.named_parameters(), *copy.named_buffers()]:
                if id(tensor) not in seen and (isinstance(tensor, nn.Parameter) or name in kept):
                    entries.append(_Entry(hf_name(f"{module_name}.{name}"), tensor))
            seen.update(id(t) for t in [*module.parameters(), *module.buffers()])  # the frozen original is not sent
            continue
        owned = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        for name, tensor in owned:
            if id(tensor) in seen or (not isinstance(tensor, nn.Parameter) and f"{prefix}{name}" not in persistent):
                continue
            seen.add(id(tensor))
            entries.append(_Entry(hf_name(f"{prefix}{name}"), tensor))
    return entries


_SYNC_MESHES: dict[tuple[int, tuple[int, ...], float], tuple[object, DeviceMesh]] = {}


def _sync_mesh(mesh: DeviceMesh, timeout: timedelta) -> DeviceMesh:
    """The same ranks as ``mesh`` on a process group of their own, whose collectives time out after ``timeout``.

    Only a 1-D mesh that spans the whole world is rebuilt (every rank can join the group's creation);
    any other mesh keeps its group, and then the process group's own timeout applies.
    """
    ranks = tuple(mesh.mesh.flatten().tolist())
    if mesh.ndim != 1 or len(ranks) != dist.get_world_size():
        return mesh
    world = dist.group.WORLD
    key = (id(world), ranks, timeout.total_seconds())
    cached = _SYNC_MESHES.get(key)
    if cached is None or cached[0] is not world:
        group = dist.new_group(list(ranks), timeout=timeout, backend=dist.get_backend(mesh.get_group()))
        cached = (world, DeviceMesh.from_group(group, mesh.device_type))
        _SYNC_MESHES[key] = cached
    return cached[1]


class _Gatherer:
    """Full tensors from shards, on the sync's own group, with errors that name the tensor."""

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout

    def full(self, tensor: Tensor, what: str) -> Tensor:
        if not isinstance(tensor, DTensor):
            return tensor.detach()
        mesh = _sync_mesh(tensor.device_mesh, self.timeout)
        local = tensor.to_local().detach()
        if local.device.type != mesh.device_type:
            local = local.to(mesh.device_type)  # CPU-offloaded shards travel through the accelerator
        sharded = DTensor.from_local(
            local, mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
        )
        try:
            full = sharded.full_tensor()
            # The gather may complete lazily, on first use; wait here so a timeout is reported by name.
            return full.wait() if isinstance(full, AsyncCollectiveTensor) else full
        except RuntimeError as error:
            raise WeightSyncTimeoutError(
                f"rank {dist.get_rank()}: all-gather of {what} did not complete within "
                f"{self.timeout.total_seconds():g}s; another rank stalled or is syncing a different model "
                f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
            ) from error


def _check_same_plan(names: list[str], tensors: list[Tensor], gatherer: _Gatherer) -> None:
    """All ranks must send the same tensors in the same order, or the gathers would pair up wrongly."""
    probe = next((t for t in tensors if isinstance(t, DTensor)), None)
    if probe is None or not dist.is_initialized():
        return  # nothing sharded: no collective to pair up
    shapes = [tuple(t.shape) for t in tensors]
    mesh = _sync_mesh(probe.device_mesh, gatherer.timeout)
    group = mesh.get_group()
    manifest = list(zip(names, shapes))
    manifests: list[object] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(manifests, manifest, group=group)
    except RuntimeError as error:
        raise WeightSyncTimeoutError(
            f"rank {dist.get_rank()}: the ranks did not all start the weight sync within "
            f"{gatherer.timeout.total_seconds():g}s"
        ) from error
    for rank, other in enumerate(manifests):
        if other != manifest:
            mismatch = next(
                (f"#{i + 1}: {a} here vs {b} on rank {rank}" for i, (a, b) in enumerate(zip(manifest, other))
                 if a != b),
                f"{len(manifest)} tensors here vs {len(other)} on rank {rank}",
            )
            raise WeightSyncError(f"rank {dist.get_rank()}: ranks would sync different tensors ({mismatch})")


def iter_full_weights(
    module: nn.Module, *, merge_lora: bool = True, timeout: timedelta = DEFAULT_SYNC_TIMEOUT
) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for every parameter and persistent buffer, one at a time.

    Works for sharded (FSDP2) and plain models, peft-wrapped or not; ``module`` may be a LightningModule that
    holds one trainable model. With peft and ``merge_lora`` each base weight arrives with its adapters merged
    in (``W + scaling * B @ A``); without it the base weights arrive alone. All ranks must iterate to the end.
    """
    entries = _plan(policy_model(module), merge_lora)
    gatherer = _Gatherer(timeout)
    _check_same_plan([e.name for e in entries], [e.tensor for e in entries], gatherer)
    for index, entry in enumerate(entries):
        what = f"parameter '{entry.name}' (#{index + 1} of {len(entries)})"
        full = gatherer.full(entry.tensor, what)
        if entry.lora:
            merged = full.float()
            for lora_a, lora_b, scaling, fan_in_fan_out in entry.lora:
                b = gatherer.full(lora_b, f"LoRA B of {what}").float()
                delta = b @ gatherer.full(lora_a, f"LoRA A of {what}").float()
                merged = merged + (delta.T if fan_in_fan_out else delta) * scaling
            full = merged.to(full.dtype)
        yield entry.name, full
        del full  # let the consumer free it before the next gather: one full tensor alive at a time


def _peft_root(module: nn.Module) -> nn.Module:
    """The peft model inside ``module`` (itself, or one of the model roots of a LightningModule)."""
    peft_model = module if _is_peft_model(module) else None
    if peft_model is None:
        peft_model = next((root for root in find_model_roots(module) if _is_peft_model(root)), None)
    if peft_model is None:
        raise WeightSyncError(f"{type(module).__name__} holds no peft model, so it has no adapter to sync")
    return peft_model


def iter_adapter_weights(
    module: nn.Module, *, timeout: timedelta = DEFAULT_SYNC_TIMEOUT
) -> Iterator[tuple[str, Tensor]]:
    """Yield the active adapter's tensors, full, under the names peft saves them with (for adapter-serving engines)."""
    from peft import get_peft_model_state_dict

    peft_model = _peft_root(module)
    _reshard(peft_model)
    state = get_peft_model_state_dict(peft_model)
    gatherer = _Gatherer(timeout)
    names = list(state)
    _check_same_plan(names, [state[n] for n in names], gatherer)
    for index, name in enumerate(names):
        yield name, gatherer.full(state[name], f"adapter tensor '{name}' (#{index + 1} of {len(names)})")


def cast_lora_tensors(stream: Iterator[tuple[str, Tensor]], dtype: torch.dtype | None) -> Iterator[tuple[str, Tensor]]:
    """``stream`` with its LoRA tensors (peft's ``lora_A``/``lora_B``/``lora_embedding_*``) cast to ``dtype``; whole
    modules (``modules_to_save``) as they are."""
    for name, tensor in stream:
        yield name, (tensor.to(dtype) if dtype is not None and ".lora_" in name else tensor)


def adapter_spec(module: nn.Module) -> AdapterSpec:
    """What an engine needs to know of the active adapter before it is sent (`AdapterSpec`)."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    peft_model = _peft_root(module)
    name = peft_model.active_adapter
    # peft's config as its adapter_config.json holds it: sets become sorted lists.
    config = json.loads(json.dumps(peft_model.peft_config[name].to_dict(), default=sorted))
    layers, whole, unmergeable = {}, [], []
    for module_name, layer in peft_model.get_base_model().named_modules():
        if isinstance(layer, LoraLayer) and name in _adapters(layer):
            layers[hf_name(module_name)] = type(layer.get_base_layer()).__name__
            if layer.lora_variant.get(name) is not None or layer.lora_bias.get(name, False):
                unmergeable.append(hf_name(module_name))
        elif isinstance(layer, ModulesToSaveWrapper):
            whole.append(hf_name(module_name))
    return AdapterSpec(config, layers, tuple(whole), tuple(unmergeable))


class _CountingStream:
    """Wraps a weight stream, counts what passes, and remembers whether the stream itself failed."""

    def __init__(self, stream: Iterator[tuple[str, Tensor]], report: SyncReport) -> None:
        self.stream, self.report, self.failed = stream, report, False

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        return self

    def __next__(self) -> tuple[str, Tensor]:
        try:
            name, tensor = next(self.stream)
        except StopIteration:
            raise
        except BaseException:
            self.failed = True
            raise
        size = tensor.numel() * tensor.element_size()
        self.report.num_tensors += 1
        self.report.num_bytes += size
        self.report.largest_tensor_bytes = max(self.report.largest_tensor_bytes, size)
        self.report.names.append(name)
        return name, tensor


def push_stream(
    stream: Iterator[tuple[str, Tensor]], push: Callable[[Iterator[tuple[str, Tensor]]], float | None] | None,
    report: SyncReport,
) -> SyncReport:
    """Hand ``stream`` to ``push`` (None on ranks that only help gather), counting what passes into ``report``.

    If the push stops reading early, the rest of the stream is still gathered here, so the other ranks are not left
    waiting in a collective.
    """
    counted = _CountingStream(stream, report)
    start = time.perf_counter()
    try:
        if push is not None:
            report.pause_seconds = push(counted) or 0.0
    finally:
        if not counted.failed:
            for _ in counted:
                pass
    report.seconds = time.perf_counter() - start
    return report


def sync_weights(
    module: nn.Module,
    target: WeightReceiver | None,
    *,
    version: int,
    merge_lora: bool = True,
    adapter_only: bool = False,
    timeout: timedelta = DEFAULT_SYNC_TIMEOUT,
) -> SyncReport:
    """Push the weights (or, with ``adapter_only``, the LoRA adapter's tensors) to ``target``; call it on every rank.

    ``target`` is None on ranks that only help gather.
    """
    if adapter_only:
        stream = iter_adapter_weights(module, timeout=timeout)
    else:
        stream = iter_full_weights(module, merge_lora=merge_lora, timeout=timeout)
    push = None if target is None else (lambda named: target.push_weights(named, version))
    return push_stream(stream, push, SyncReport(version=version, mode="adapter" if adapter_only else "full"))


_DIGEST_CHUNK = 1 << 22  # elements per step (a multiple of 8): bounds the digest's scratch memory
_SIGNED_ZERO_FREE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_ODD: dict[torch.device, Tensor] = {}  # 1, 3, 5, ... per device, enough for a chunk of float64 (one word each)


def tensor_digest(tensor: Tensor) -> int:
    """An exact fingerprint of a tensor's values: its bytes read as int64 words ``w_i``, ``sum((2 i + 1) w_i)`` mod 2**64.

    Every weight is odd, so changing any one element changes the sum (an odd number times a non-zero word is
    non-zero mod 2**64); integer sums wrap the same in any order, so a GPU and a CPU, or a sharded and a whole
    tensor, agree to the bit. Floating -0.0 counts as +0.0 (an engine that reads its weights back through a
    kernel cannot tell them apart). Runs where the tensor lives, a few passes over its bytes, one sync at the end.
    """
    flat = tensor.detach().reshape(-1)
    odd = _ODD.get(flat.device)
    if odd is None:
        odd = _ODD[flat.device] = torch.arange(_DIGEST_CHUNK, device=flat.device, dtype=torch.int64) * 2 + 1
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    words_before = 0
    for start in range(0, flat.numel(), _DIGEST_CHUNK):
        part = flat[start : start + _DIGEST_CHUNK]
        part = part + 0 if part.dtype in _SIGNED_ZERO_FREE else part.clone()  # + 0 turns -0.0 into +0.0; both copy
        raw = part.view(torch.uint8)
        if raw.numel() % 8:
            raw = torch.cat([raw, raw.new_zeros(-raw.numel() % 8)])
        words = raw.view(torch.int64)
        # sum((2 (before + j) + 1) w_j) = sum((2 j + 1) w_j) + 2 before sum(w_j); int64 arithmetic wraps mod 2**64.
        total += (words * odd[: words.numel()]).sum() + words.sum() * (2 * words_before)
        words_before += words.numel()
    return int(total) % 2**64


class SentDigests:
    """A weight stream passed through, with the digest of each tensor taken as it passes.

    ``held_dtype(name)`` is the dtype the engine holds that tensor in (None: as sent); each tensor is digested
    cast to it, since the engine's copy is the cast one. Iterate it in place of the stream.
    """

    def __init__(self, named_tensors: Iterable[tuple[str, Tensor]], held_dtype: Callable[[str], torch.dtype | None]):
        self.stream, self.held_dtype = named_tensors, held_dtype
        self.digests: dict[str, int] = {}
        self.repeated: list[str] = []
        self.seconds = 0.0

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        for name, tensor in self.stream:
            start = time.perf_counter()
            dtype = self.held_dtype(name)
            if name in self.digests:
                self.repeated.append(name)
            self.digests[name] = tensor_digest(tensor if dtype in (None, tensor.dtype) else tensor.to(dtype))
            self.seconds += time.perf_counter() - start
            yield name, tensor
            del tensor


def verify_held(
    sent: SentDigests, held: Mapping[str, int], ties: Mapping[str, str], version: int,
    earlier: Mapping[str, int] | None = None,
) -> None:
    """Raise `WeightMismatchError` unless the engine holds, under every name, exactly what the sync sent.

    ``held`` is the digest of each tensor the engine holds, by Hugging Face name (a tied one under its own name,
    under its source's, or both); ``ties`` maps a tied name to the name it shares its tensor with
    (``lm_head.weight`` -> ``model.embed_tokens.weight``). A tied tensor must be sent once, under either name;
    every held tensor must have been sent, and hold the digest of what was. A push of only the changed tensors
    passes ``earlier``, the ``held`` of the last verified version: a tensor not sent must still hold that digest
    (the trainer proved it unchanged since, so it is still the trainer's).
    """
    problems = held_problems(sent, held, ties, earlier)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise WeightMismatchError(
            f"weight sync to version {version} failed verification: {problems[0]}{more}; "
            "the engine would sample from weights the trainer does not hold"
        )


def held_problems(sent: SentDigests, held: Mapping[str, int], ties: Mapping[str, str], earlier: Mapping[str, int] | None = None) -> list[str]:
    """What `verify_held` finds wrong, one line each (none: the engine holds what was sent)."""
    problems = [f"'{name}' was sent twice" for name in dict.fromkeys(sent.repeated)]
    expected = {ties.get(name, name): digest for name, digest in (earlier or {}).items()}
    sent_sources: set[str] = set()
    for name, digest in sent.digests.items():
        source = ties.get(name, name)
        if source in sent_sources:
            problems.append(f"'{name}' was sent besides '{source}', which it is tied to (a tied weight is sent once)")
        sent_sources.add(source)
        expected[source] = digest
    covered = set()
    for name, digest in held.items():
        source = ties.get(name, name)
        covered.add(source)
        if source not in expected:
            problems.append(f"'{name}' was not sent, so the engine still holds its earlier values")
        elif expected[source] != digest:
            problems.append(f"the engine's '{name}' differs from the trainer's")
    problems += [f"'{name}' was sent, but the engine holds no such tensor" for name in expected if name not in covered]
    return problems
