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

from dataclasses import dataclass
from datetime import timedelta
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
from lightning_rl.rollout.vllm_held import held_digests, ties_of

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
    """The fields of `gloo_transport.ChunkManifest`, as the `/update_weights` route delivers them."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives checkpoint-format (Hugging Face named) tensors from trainer rank 0 over gloo."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: torch.distributed.ProcessGroupGloo | None = None
        self.layout = CheckpointLayout(self.model_config.hf_config)
        self.loaded: set[str] = set()

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        timeout = timedelta(seconds=init_info.timeout_s)
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        store = gloo_transport.worker_store(
            init_info.master_address, init_info.master_port, init_info.world_size, timeout
        )
        self.group = gloo_transport.join_group(store, rank, init_info.world_size, timeout)

    def start_weight_update(self) -> None:
        self.loaded = set()
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer: /init_weight_transfer_engine was not called")
        manifest = gloo_transport.ChunkManifest.from_dict(vars(update_info))
        try:
            # The whole chunk is received before anything is checked, so the stream stays in step on a refusal.
            received = gloo_transport.receive_chunk(self.group, manifest)
            self.model.load_weights(list(self.layout.checked_with_ties(received, self.loaded)))
        except Exception:
            # Modules that got nothing yet take their old weights back, so the server goes on serving.
            finalize_layerwise_reload(self.model, self.model_config)
            raise

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self.group = None


class WeightSyncWorker:
    """vLLM's worker extension: each server worker imports (and so registers) the backend, and gains this method."""

    def lightning_rl_held_weights(self) -> dict[str, Any]:
        """``{"tensors": {hf_name: [dtype, digest]}, "ties": {tied name: source}}`` of the weights this worker holds."""
        layout = getattr(self, "_lightning_rl_layout", None)
        if layout is None:
            layout = self._lightning_rl_layout = CheckpointLayout(self.model_config.hf_config)
        return {"tensors": held_digests(self.get_model(), layout), "ties": ties_of(layout)}


WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
