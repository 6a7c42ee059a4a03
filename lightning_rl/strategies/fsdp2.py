"""FSDP2 (``fully_shard``) for any LightningModule that holds transformers models.

Lightning's ``ModelParallelStrategy`` leaves sharding to the module's ``configure_model``. This strategy
does it itself, so SFT, GRPO and user modules need no parallelism code: one shard unit per decoder layer
(found through each transformers model's ``_no_split_modules``) and one root unit per model. A module
that shards itself in ``configure_model`` is left as it is.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from typing_extensions import override

from lightning_rl.checkpoints import ForeignWeightsError, commit, no_room, remove, space_error, staging_path, tensor_bytes, write_manifest
from lightning_rl.errors import RecipeError
from lightning_rl.models.sharded_loading import ShardedLoadReport, load_deferred_weights, pending_checkpoint
from lightning_rl.models.structure import enable_activation_checkpointing, find_decoder_layers, find_model_roots
from lightning_rl.strategies.expert_parallel import EXPERT_MESH_DIMS, ExpertParallelError, distribute_experts, expert_mesh


MixedPrecision = Literal["bf16", "fp16", "fp32"] | MixedPrecisionPolicy | None

_PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def mixed_precision_policy(value: MixedPrecision) -> MixedPrecisionPolicy:
    """A policy from a recipe value: low-precision compute, but gradients always reduced in fp32."""
    if isinstance(value, MixedPrecisionPolicy):
        return value
    if value is None:
        return MixedPrecisionPolicy()
    if value not in _PARAM_DTYPES:
        raise ValueError(f"mixed_precision must be one of {sorted(_PARAM_DTYPES)} or None, got {value!r}")
    return MixedPrecisionPolicy(param_dtype=_PARAM_DTYPES[value], reduce_dtype=torch.float32)


def loads_weights_sharded(strategy: object) -> bool:
    """Whether models built under ``strategy`` should defer their weights until it has sharded them."""
    return isinstance(strategy, FSDP2Strategy) and strategy.sharded_loading


def _uncovered_parameters(module: nn.Module, covered: Iterable[nn.Module]) -> list[str]:
    inside = {id(p) for root in covered for p in root.parameters()}
    return [name for name, p in module.named_parameters() if id(p) not in inside]


def _shared_between_layers(layers: list[nn.Module]) -> tuple[str, int, int] | None:
    """A parameter two shard units own, where one exists: (its name in the first, and the two units' places). A unit
    owns its parameters but those of a unit inside it; a block a model reuses in several layers (Zamba's shared
    transformer) is owned by each, which ``fully_shard`` cannot take (the second unit finds it a DTensor already)."""
    units = {id(layer) for layer in layers}
    owner: dict[int, int] = {}
    for place, layer in enumerate(layers):
        inner = {id(p) for sub in layer.modules() if sub is not layer and id(sub) in units for p in sub.parameters()}
        for name, param in layer.named_parameters():
            if id(param) not in inner and owner.setdefault(id(param), place) != place:
                return name, owner[id(param)], place
    return None


# How torch's distributed checkpoint reader says that a checkpoint holds other tensors than the model.
_FOREIGN_CHECKPOINT = ("Missing key in checkpoint state_dict", "Size mismatch between saved", "Missing key:")


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 data parallelism with automatic per-layer sharding (registered as ``fsdp2``).

    Args:
        data_parallel_size: processes that shard the model: ``"auto"``, all of them (the only size: no tensor parallelism).
        mixed_precision: ``"bf16"``/``"fp16"`` compute with fp32 gradient reduction, ``"fp32"`` or None.
        activation_checkpointing: recompute each decoder layer in backward (transformers'
            ``activation_checkpointing_enable``, non-reentrant, so a frozen LoRA base works).
        cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory.
        reshard_after_forward: free each gathered decoder layer after forward (saves memory, costs a second
            gather in backward); the model roots always stay gathered until backward.
        layer_classes: class names of the shard units, when a model's ``_no_split_modules`` is not right.
        sharded_loading: SFT and GRPO build their models on the meta device and each rank reads only its own
            shards from the checkpoint after sharding, so no rank ever holds a whole model. Off: every rank
            loads the whole model first, then shards it.
        expert_parallel_size: ranks the routed experts of each mixture-of-experts layer are split over
            (``strategies/expert_parallel.py``): groups of consecutive ranks, so keep it within a node. Each
            rank holds ``1/expert_parallel_size`` of the experts, sharded further over the ranks holding the
            same experts; tokens reach their experts by all-to-all. 1: experts are sharded like any weight.
    """

    strategy_name = "fsdp2"

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        mixed_precision: MixedPrecision = None,
        activation_checkpointing: bool = False,
        cpu_offload: bool = False,
        reshard_after_forward: bool = True,
        layer_classes: Collection[str] | None = None,
        sharded_loading: bool = True,
        expert_parallel_size: int = 1,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.mp_policy = mixed_precision_policy(mixed_precision)
        self.activation_checkpointing = activation_checkpointing
        self.cpu_offload = cpu_offload
        self.reshard_after_forward = reshard_after_forward
        self.layer_classes = ((layer_classes,) if isinstance(layer_classes, str) else tuple(layer_classes)) if layer_classes else None  # one name, or several
        self.sharded_loading = sharded_loading
        if not isinstance(expert_parallel_size, int) or expert_parallel_size < 1:
            raise ExpertParallelError(f"expert_parallel_size must be a positive integer, got {expert_parallel_size!r}")
        self.expert_parallel_size = expert_parallel_size
        self.expert_mesh: DeviceMesh | None = None
        self.load_reports: list[ShardedLoadReport] = []

    @override
    def setup_environment(self) -> None:
        processes = self.num_nodes * self.num_processes
        if self._data_parallel_size == "auto":
            self._data_parallel_size = processes
        if self._data_parallel_size != processes:  # Lightning's own check is a traceback on every rank
            raise RecipeError(f"trainer.strategy.data_parallel_size={self._data_parallel_size}, but the run has {processes} "
                              "processes (trainer.devices x trainer.num_nodes), which all shard the model: give auto", "trainer.strategy")
        super().setup_environment()
        if self.expert_parallel_size > 1:
            self.expert_mesh = expert_mesh(self.root_device.type, self.world_size, self.expert_parallel_size)

    @property
    def offload_policy(self) -> OffloadPolicy:
        # Pinned memory needs a CUDA/ROCm runtime; on CPU-only machines the policy still moves optimizer work to CPU.
        return CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if self.cpu_offload else OffloadPolicy()

    def shard(self, module: nn.Module) -> None:
        """Apply ``fully_shard`` to every decoder layer, then to each model root, in place."""
        if any(isinstance(sub, FSDPModule) for sub in module.modules()):
            return  # the module sharded itself in configure_model
        roots = find_model_roots(module)
        if not roots:
            raise TypeError(
                f"{type(self).__name__} found no transformers model inside {type(module).__name__}; hold the model "
                "as a submodule, or shard it yourself in configure_model()"
            )
        if unmatched := sorted(set(self.layer_classes or ()) - {type(sub).__name__ for sub in module.modules()}):
            blocks = sorted({name for root in roots for sub in root.modules() for name in getattr(sub, "_no_split_modules", None) or ()})
            raise RecipeError(f"trainer.strategy.layer_classes: {', '.join(unmatched)} is no module class of the model, whose "
                              f"layers would go unsharded (its repeated blocks: {', '.join(blocks) or 'none named'})", "trainer.strategy")
        stray = _uncovered_parameters(module, roots)
        if stray:
            raise TypeError(
                f"{type(self).__name__}: parameter '{stray[0]}' lies outside every transformers model, so it would "
                "not be sharded or reduced; move it into a model, or shard it yourself in configure_model()"
            )
        for root in roots:
            layers = find_decoder_layers(root, self.layer_classes)
            if shared := _shared_between_layers(layers):
                names = {id(sub): name for name, sub in root.named_modules()}
                first, second = (names[id(layers[place])] for place in shared[1:])
                raise RecipeError(f"trainer.strategy: {type(root).__name__} uses parameter '{shared[0]}' in both {first} and "
                                  f"{second} (a block shared across layers), which FSDP2 cannot shard layer by layer: "
                                  "train it with one process, or ddp", "trainer.strategy")
        kwargs: dict[str, Any] = {
            "mesh": self.device_mesh["data_parallel"],
            "mp_policy": self.mp_policy,
            "offload_policy": self.offload_policy,
        }
        for root in roots:
            if self.activation_checkpointing:
                enable_activation_checkpointing(root, use_reentrant=False)
            if self.expert_mesh is not None:
                self._shard_experts(root, kwargs)
            # Children before parents: a unit owns only the parameters no inner unit has claimed.
            for layer in reversed(find_decoder_layers(root, self.layer_classes)):
                fully_shard(layer, reshard_after_forward=self.reshard_after_forward, **kwargs)
            # The root keeps embeddings, final norm and LM head gathered from forward to backward, so a chunked
            # LM head that runs after the model's forward (packed_logprobs) reads the full weight.
            fully_shard(root, reshard_after_forward=False, **kwargs)

    def _shard_experts(self, root: nn.Module, kwargs: dict[str, Any]) -> None:
        """Split the experts over the expert-parallel group; each slice is one unit over the ranks that hold it."""
        assert self.expert_mesh is not None
        experts_modules = distribute_experts(root, self.expert_mesh)
        if not experts_modules:
            raise ExpertParallelError(
                f"expert_parallel_size={self.expert_parallel_size}, but {type(root).__name__} has no routed-experts "
                "module to split; use expert_parallel_size=1 for a dense model"
            )
        experts_kwargs = {**kwargs, "mesh": self.expert_mesh[EXPERT_MESH_DIMS[0]]}
        for experts in experts_modules:
            for norm in experts._expert_row_norms:  # runs on the sending rank: data parallel like the layer
                fully_shard(norm, reshard_after_forward=self.reshard_after_forward, **kwargs)
            fully_shard(experts, reshard_after_forward=self.reshard_after_forward, **experts_kwargs)

    def load_deferred(self, module: nn.Module) -> None:
        """Allocate the shards of models built on the meta device and read them from their checkpoints."""

        for root in find_model_roots(module):
            if pending_checkpoint(root) is not None:
                root.to_empty(device=self.root_device)
                self.load_reports.append(load_deferred_weights(root, seed=torch.initial_seed() % 2**31))

    @override
    def setup(self, trainer: Trainer) -> None:
        """Shard, then place the model and build optimizers in the parent's order.

        The parent's ``setup`` is not called because it refuses modules without a sharding ``configure_model``.
        """
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert isinstance(module, LightningModule)
        self.shard(module)
        self.load_deferred(module)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """A sharded checkpoint whose tensors are not this model's (another task, model or LoRA layout) is one line:
        torch's distributed reader says which tensor it misses, or which has another size, on every rank alike."""
        try:
            return super().load_checkpoint(checkpoint_path, *args, **kwargs)
        except (RuntimeError, CheckpointException) as error:
            failures = getattr(error, "failures", None)  # the reader's per-rank errors, gathered on every rank
            cause = next(iter(failures.values()))[0] if failures else error
            said = str(cause).splitlines()[0] if str(cause) else ""
            if not said.startswith(_FOREIGN_CHECKPOINT):
                raise
            raise ForeignWeightsError(
                f"ckpt_path: {checkpoint_path} does not fit this recipe's model ({said.rstrip('.')}): it was written by "
                "another task, model or LoRA layout"
            ) from None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """A sharded checkpoint is staged like a single file (``lightning_rl/checkpoints.py``): every rank writes its
        shards into ``NAME.staging``, then rank 0 adds the manifest and renames the folder to ``NAME``."""
        if not self._save_distributed_checkpoint:  # one file, through the strategy's CheckpointIO
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        final = Path(self.broadcast(str(filepath)))
        staging = staging_path(final)
        step = checkpoint["global_step"]
        if self.is_global_zero:
            remove(staging)  # a partial one left by a kill
        self.barrier("stage-checkpoint")
        # Every rank's shards are about the size of this one's (counted now: the save takes the tensors out).
        needed = tensor_bytes(checkpoint) * self.world_size
        try:
            super().save_checkpoint(checkpoint, staging, storage_options)
        except BaseException as error:  # every rank gets the failure of any (the save gathers their results)
            # Every rank's verdict is the same: the error (the save gathers every rank's), and the disk's room (this
            # rank's shards may have been written, but the whole checkpoint needs ``needed``).
            full = no_room(error, final.parent, needed)
            if full is None:
                raise
            if self.is_global_zero:
                remove(staging)
            space = space_error(final, needed, full)
            space.on_every_rank = True
            raise space from None
        if self.is_global_zero:  # the save returns once every rank's shards are written
            write_manifest(staging, step)
            commit(staging, final)

    @override
    def model_to_device(self) -> None:
        # With CPU offload the shards must stay in host memory; FSDP2 moves each layer in when it runs.
        if not self.cpu_offload:
            super().model_to_device()
