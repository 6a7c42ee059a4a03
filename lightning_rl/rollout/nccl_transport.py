"""Tensors from the trainer to vLLM server workers over NCCL, sent by vLLM's own trainer-side NCCL engine.

vLLM ships both ends. The server runs its built-in "nccl" weight-transfer backend (`VLLMServer(transport="nccl")`,
no worker extension), and `NCCLTrainerWeightTransferEngine` drives it from here: it opens the group as rank 0
(the server's workers join as ranks 1..N, `rank_offset` 1), posts `/init_weight_transfer_engine`, and each round
posts `/start_weight_update`, `/update_weights` (the names, dtypes and shapes of the whole round) while it
broadcasts the bytes in packed buffers, then `/finish_weight_update`. This module gives that engine what it takes:
a client for the server's routes and the round's tensors as a `WeightSource`.

vLLM's worker loads the names it is sent as they are, so the checkpoint mapping that the gloo backend applies in
the server (`CheckpointLayout`: names and shapes checked, tied names sent again under their own names) is applied
here, before the round: NCCL cannot drop out of a broadcast half-way, so a refused name must be refused before
the first byte moves.

Untested on a GPU: this machine has none, so no NCCL transfer has run. The tests check the payloads and the call
sequence with vLLM's two CUDA-only calls stood in for. This module imports vLLM; `vllm_server` imports it only
when the transport is NCCL, so a gloo trainer needs no vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Container, Iterable, Iterator
from typing import Any

import torch
from transformers import AutoConfig
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

from lightning_rl.rollout.checkpoint_layout import CheckpointLayout
from lightning_rl.rollout.vllm_server_process import free_port

Post = Callable[..., Any]  # post(route, body=None): one of the server's routes, its JSON answer back


class RouteClient:
    """vLLM's `VLLMWeightSyncClient` over this engine's HTTP calls.

    Not vLLM's `HTTPVLLMWeightSyncClient`: `post` reports the server's answer when it refuses (that client raises
    the status alone), and the finish commits the round's `version`, which vLLM's engine does not pass.
    """

    def __init__(self, post: Post) -> None:
        self.post = post
        self.version: str | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.post("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.post("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.post("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.post("finish_weight_update", {"weight_version": weight_version or self.version})


class RoundSource(WeightSource):
    """The tensors of the round being sent: vLLM declares their metadata to the workers, then iterates them."""

    def __init__(self) -> None:
        self.tensors: list[tuple[str, torch.Tensor]] = []

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in self.tensors]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors)


class NCCLSender:
    """Rank 0 of an NCCL group with the workers of the server whose routes `post` reaches; joins it on creation.

    `model` is the checkpoint the server serves (its config gives the `CheckpointLayout`), `world_size` is 1 +
    the server's workers, `device` the GPU the tensors are sent from, `buffer_bytes` the size of each of vLLM's
    two packed buffers (fixed for the group: the workers learn it at init).
    """

    def __init__(
        self,
        post: Post,
        model: str | os.PathLike,
        *,
        address: str,
        world_size: int,
        device: torch.device,
        buffer_bytes: int,
        held_aliases: Container[str] | None = None,
    ) -> None:
        self.layout = CheckpointLayout(AutoConfig.from_pretrained(model))
        self.held_aliases = held_aliases  # the tied names the server's model has a parameter under (None: all)
        self.device = device
        self.client = RouteClient(post)
        self.source = RoundSource()
        init_info = NCCLTrainerInitInfo(
            master_address=address, master_port=free_port(address), world_size=world_size, rank=0,
            packed=True, packed_buffer_size_bytes=buffer_bytes,
        )
        self.engine = NCCLTrainerWeightTransferEngine.trainer_init(init_info, client=self.client, source=self.source)

    def round(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The whole stream, checked and mapped to checkpoint names, on `device`; a refused name raises here.

        vLLM declares every tensor of a round before its first byte, so the round is held whole: the tensors of a
        plain model are its own parameters, but gathered (FSDP) or merged (LoRA) ones are copies, and this GPU
        then needs room for one full copy of the weights.
        """
        checked = self.layout.checked_with_ties(named_tensors, held_aliases=self.held_aliases)
        return [(name, tensor.detach().to(self.device)) for name, tensor in checked]

    def send(self, tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
        """One round of vLLM's engine over `tensors` (from `round`), committed on the server as `version`."""
        self.source.tensors, self.client.version = tensors, str(version)
        try:
            self.engine.send_weights()
        finally:
            self.source.tensors = []

    def close(self) -> None:
        self.engine.shutdown()
