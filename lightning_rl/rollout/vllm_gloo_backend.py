"""The server side of the weight sync: a vLLM weight-transfer backend named "gloo", and the read-back of what is held.

vLLM's RL routes (`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`) drive whichever backend `--weight-transfer-config` names; its built-in
ones need CUDA. This one receives over `gloo_transport` and loads through vLLM's layerwise reload,
the same lifecycle its NCCL backend uses. It is imported only inside a vLLM server process.

Start the server with `--worker-extension-cls lightning_rl.rollout.vllm_gloo_backend.WeightSyncWorker`
(as `VLLMServer` does, over either transport): vLLM imports that class in each worker before the model loads,
importing this module is what registers the backend, and the class's method (`/collective_rpc`) reads the
worker's weights back for the trainer's verification, whichever transport brought them.
"""

from __future__ import annotations

import tempfile
import threading
from dataclasses import dataclass
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from lightning_rl.rollout import gloo_transport
from lightning_rl.rollout.checkpoint_layout import CheckpointLayout
from lightning_rl.models.weights import AdapterSpec
from lightning_rl.rollout.vllm_engine import write_adapter
from lightning_rl.rollout.vllm_held import (
    held_adapter, held_aliases, held_digests, lora_dtype, lora_refusal, lora_targets, prepack_on_reload, ties_of,
)

BACKEND = "gloo"


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    timeout_s: float = 300.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """The fields of `gloo_transport.ChunkManifest`, as the `/update_weights` route delivers them; ``staged``: no
    chunk follows, the update loads what was staged (`WeightSyncWorker.lightning_rl_stage`) while the engine ran."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    staged: bool = False
    keep: bool = False
    reset: bool = False


def worker_layout(model_config: Any) -> CheckpointLayout:
    """The checkpoint's layout, read off a meta-device transformers model under a stand-in vLLM config that compiles
    nothing: where vLLM serves the architecture through its Transformers backend, it has rewritten transformers'
    classes in this process, and their constructor reads the current config's compilation mode and model config (a
    stand-in, so that building a `VllmConfig` cannot touch the server's own)."""
    from vllm.config import CompilationConfig, set_current_vllm_config
    from vllm.config.compilation import CompilationMode

    stand_in = SimpleNamespace(compilation_config=CompilationConfig(mode=CompilationMode.NONE), model_config=model_config)
    with set_current_vllm_config(stand_in):
        return CheckpointLayout(model_config.hf_config)


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives checkpoint-format (Hugging Face named) tensors from trainer rank 0 over gloo."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: torch.distributed.ProcessGroupGloo | None = None
        self.layout = worker_layout(self.model_config)
        self.loaded: set[str] = set()
        self.aliases: set[str] | None = None  # `vllm_held.held_aliases`, read before any update
        self._staged: list[tuple[str, torch.Tensor]] = []  # received while the engine generates (`stage`)
        self._staging: threading.Thread | None = None
        self._staging_error: BaseException | None = None
        self.kept: dict[str, torch.Tensor] = {}  # each tensor as last sent, while pushes ask for it (`_received`)

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        timeout = timedelta(seconds=init_info.timeout_s)
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        store = gloo_transport.worker_store(
            init_info.master_address, init_info.master_port, init_info.world_size, timeout
        )
        self.group = gloo_transport.join_group(store, rank, init_info.world_size, timeout)
        self.aliases = held_aliases(self.model, self.layout)
        prepack_on_reload(self.model)  # the reloads' own post-load step prepacks what they write

    def start_weight_update(self) -> None:
        self.loaded = set()
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer: /init_weight_transfer_engine was not called")
        try:
            if update_info.staged:
                received = self.take_staged()
            else:  # the whole chunk is received before anything is checked, so the stream stays in step on a refusal
                manifest = gloo_transport.ChunkManifest.from_dict(vars(update_info))
                received = self._received(gloo_transport.receive_chunk(self.group, manifest), manifest)
            self.model.load_weights(list(self.layout.checked_with_ties(received, self.loaded, held_aliases=self.aliases)))
        except Exception:
            # Modules that got nothing yet take their old weights back, so the server goes on serving.
            self.finish_weight_update()
            raise

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)

    def stage(self, manifest: gloo_transport.ChunkManifest) -> None:
        """Receive one chunk on a thread of this worker, into host memory, while the engine goes on generating;
        returns at once (the previous chunk received first: they arrive one after the other)."""
        if self.group is None:
            raise RuntimeError("gloo weight transfer: /init_weight_transfer_engine was not called")
        self._staging_wait()

        def receive() -> None:
            try:
                self._staged.extend(self._received(gloo_transport.receive_chunk(self.group, manifest), manifest))
            except BaseException as error:  # raised again by the next call from the trainer
                self._staging_error = error

        self._staging = threading.Thread(target=receive, name="lightning-rl-stage", daemon=True)
        self._staging.start()

    def _received(self, received: list[tuple[str, torch.Tensor]], manifest: gloo_transport.ChunkManifest) -> list[tuple[str, torch.Tensor]]:
        """A chunk's tensors, those sent as their changed elements written into the copies kept; kept in turn where
        the push asks (a delta sync's: one more copy of the model in this host's memory), else the copies dropped."""
        if manifest.reset or not manifest.keep:
            self.kept = {}
        decoded = gloo_transport.decode_changes(received, self.kept)
        if manifest.keep:
            self.kept.update((name, tensor.clone()) for name, tensor in decoded)  # a loader may write into what it reads
        return decoded

    def take_staged(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor staged since the last take, once the last chunk is in."""
        self._staging_wait()
        staged, self._staged = self._staged, []
        return staged

    def _staging_wait(self) -> None:
        if self._staging is not None:
            self._staging.join()
            self._staging = None
        if self._staging_error is not None:
            error, self._staging_error, self._staged = self._staging_error, None, []
            raise RuntimeError(f"receiving a staged chunk failed: {error}") from error

    def shutdown(self) -> None:
        self.group = None


class WeightSyncWorker:
    """vLLM's worker extension: each server worker imports (and so registers) the backend, and gains these methods.

    A push is staged while the engine keeps generating: `lightning_rl_stage` returns at once and a thread of the
    worker receives the chunk over the transfer group (the engine's step loop goes on). Weights then load while the
    server is paused, through vLLM's update routes with a ``staged`` update; a LoRA adapter sent alone is written as
    a peft folder on the server's machine (`lightning_rl_write_adapter`), which vLLM's ``/v1/load_lora_adapter`` then
    loads while the server is paused.
    """

    def _lightning_rl_layout(self) -> CheckpointLayout:
        """`worker_layout` of this worker's model, built once."""
        if getattr(self, "_lightning_rl_cached_layout", None) is None:
            self._lightning_rl_cached_layout = worker_layout(self.model_config)
        return self._lightning_rl_cached_layout

    def lightning_rl_held_weights(self) -> dict[str, Any]:
        """``{"tensors": {hf_name: [dtype, digest]}, "ties": {tied name: source}}`` of the weights this worker holds."""
        layout = self._lightning_rl_layout()
        return {"tensors": held_digests(self.get_model(), layout), "ties": ties_of(layout)}

    def lightning_rl_model_info(self) -> dict[str, Any]:
        """What the trainer needs to judge a sync mode: the fused modules and their parts (written together by a
        delta), the layers this worker serves LoRA on, the architecture's name, the tied names to send
        (`vllm_held.held_aliases`), and its checkpoint's tensor shapes by name."""
        packed = getattr(type(self.get_model()), "packed_modules_mapping", {})
        layout = self._lightning_rl_layout()
        serves_lora = getattr(self.model_runner, "lora_manager", None) is not None
        return {"packed": {fused: list(parts) for fused, parts in packed.items()},
                "lora_targets": lora_targets(self) if serves_lora else [],
                "lora_refusal": lora_refusal(self) if serves_lora else None,
                "lora_dtype": lora_dtype(self) if serves_lora else None,
                "architecture": layout.architecture, "held_aliases": sorted(held_aliases(self.get_model(), layout)),
                "shapes": {name: list(shape) for name, shape in layout.shapes.items()}}

    def lightning_rl_stage(self, update_info: dict[str, Any]) -> None:
        """Receive one chunk of a push (weights or an adapter) on a thread of this worker; returns at once."""
        self._lightning_rl_transfer().stage(gloo_transport.ChunkManifest.from_dict(update_info))

    def lightning_rl_write_adapter(self, config: dict[str, Any]) -> str:
        """Once the staged chunks are in: write them as a peft adapter folder (``config``: its adapter_config.json,
        the same folder every time) and return the folder's path."""
        staged = self._lightning_rl_transfer().take_staged()
        folder = self.__dict__.get("_lightning_rl_adapter_folder") or tempfile.mkdtemp(prefix="lightning-rl-adapter-")
        self._lightning_rl_adapter_folder = folder
        write_adapter(staged, AdapterSpec(config, {}), folder)
        return folder

    def _lightning_rl_transfer(self) -> GlooWeightTransferEngine:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, GlooWeightTransferEngine) or engine.group is None:
            raise RuntimeError("gloo weight transfer: /init_weight_transfer_engine was not called")
        return engine

    def lightning_rl_held_adapter(self, lora_id: int, rank: int) -> dict[str, list]:
        """`vllm_held.held_adapter` of this worker: the adapter ``lora_id`` as its slot holds it."""
        return held_adapter(self, lora_id, rank)


WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
