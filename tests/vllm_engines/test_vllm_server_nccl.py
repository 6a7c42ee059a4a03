"""The NCCL transport without a GPU: what reaches the server's weight routes, read back with vLLM's own dataclasses.

No NCCL transfer can run here (no GPU). vLLM's trainer engine runs for real except its two CUDA-only calls,
which are stood in for: opening the NCCL communicator (`open_trainer_endpoint`) and the packed broadcast
(`packed_nccl_broadcast_producer`, replaced by a recorder of what it would send). The HTTP posts are recorded
(through JSON, as they travel) because no server with the NCCL backend can run here either. The worker side
parses the posted dicts into `NCCLWeightTransferInitInfo` / `NCCLWeightTransferUpdateInfo`, so the test does
the same: a field vLLM does not take fails there.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from engine_checks import load_trainer_model
from vllm.distributed.weight_transfer import nccl_engine
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferInitInfo, NCCLWeightTransferUpdateInfo

from lightning_rl.rollout.checkpoint_layout import WeightNameError
from lightning_rl.rollout.nccl_transport import NCCLSender
from lightning_rl.rollout.vllm_server import VLLMServerEngine, resolve_transport
from lightning_rl.models.weights import iter_full_weights

BUFFER_BYTES = 4096


class StandInCommunicator:
    destroyed = False

    def destroy(self) -> None:
        self.destroyed = True


@pytest.fixture
def broadcasts(monkeypatch: pytest.MonkeyPatch) -> list[list[tuple[str, torch.Tensor]]]:
    """The tensors vLLM's trainer engine hands its packed broadcast (which packs them as bytes), one list per round."""
    rounds: list[list[tuple[str, torch.Tensor]]] = []

    def record(iterator, group, src, post_iter_func, buffer_size_bytes, num_buffers):
        assert isinstance(group, StandInCommunicator) and src == 0 and buffer_size_bytes == BUFFER_BYTES
        rounds.append([(name, post_iter_func((name, tensor))) for name, tensor in iterator])

    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", lambda init_info: StandInCommunicator())
    monkeypatch.setattr(nccl_engine, "packed_nccl_broadcast_producer", record)
    return rounds


def recording_post(posts: list[tuple[str, Any]]):
    def post(route: str, body: Any | None = None) -> None:
        posts.append((route, json.loads(json.dumps(body))))

    return post


def test_nccl_without_cuda_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^transport 'nccl' needs CUDA") as err:
        resolve_transport("nccl")
    assert "\n" not in str(err.value)


def test_the_routes_get_what_vllms_nccl_backend_parses(tiny_model_dir, broadcasts):
    posts: list[tuple[str, Any]] = []
    sender = NCCLSender(recording_post(posts), tiny_model_dir, address="127.0.0.1", world_size=3,
                        device=torch.device("cpu"), buffer_bytes=BUFFER_BYTES)
    [(route, body)] = posts
    assert route == "init_weight_transfer_engine"
    init = NCCLWeightTransferInitInfo(**body["init_info"])
    # The trainer is rank 0, the server's two workers ranks 1 and 2; they decode packed buffers of our size.
    assert (init.master_address, init.rank_offset, init.world_size) == ("127.0.0.1", 1, 3)
    assert init.master_port > 0 and init.nccl_unique_id_b64 is None
    assert (init.packed, init.packed_buffer_size_bytes) == (True, BUFFER_BYTES)

    trainer = load_trainer_model(tiny_model_dir)
    assert trainer.config.tie_word_embeddings
    sent = list(iter_full_weights(trainer))
    assert "lm_head.weight" not in dict(sent)  # a tied tensor leaves the trainer once
    posts.clear()
    sender.send(sender.round(iter(sent)), version=7)

    assert [route for route, _ in posts] == [
        "start_weight_update", "update_weights", "finish_weight_update"]  # fmt: skip
    update = NCCLWeightTransferUpdateInfo(**posts[1][1]["update_info"])
    # The same names as the gloo backend loads: the checkpoint's, the tied output embedding under its own name.
    expected = list(sender.layout.checked_with_ties(sent))
    names = [name for name, _ in sent]
    names.insert(names.index("model.embed_tokens.weight") + 1, "lm_head.weight")
    assert update.names == [name for name, _ in expected] == names
    assert update.shapes == [list(tensor.shape) for _, tensor in expected]
    assert update.dtype_names == ["float32"] * len(expected)  # as the worker reads them: getattr(torch, name)
    assert posts[2] == ("finish_weight_update", {"weight_version": "7"})

    (round_,) = broadcasts
    assert [name for name, _ in round_] == update.names
    assert all(torch.equal(out, tensor) for (_, out), (_, tensor) in zip(round_, expected, strict=True))
    sender.close()
    assert sender.engine.model_update_group is None


def test_a_name_the_checkpoint_lacks_is_refused_before_anything_is_posted(tiny_model_dir, broadcasts):
    posts: list[tuple[str, Any]] = []
    sender = NCCLSender(recording_post(posts), tiny_model_dir, address="127.0.0.1", world_size=2,
                        device=torch.device("cpu"), buffer_bytes=BUFFER_BYTES)
    posts.clear()
    with pytest.raises(WeightNameError, match="no_such_weight"):
        sender.round(iter([("model.layers.0.no_such_weight", torch.zeros(3))]))
    assert posts == [] and broadcasts == []


def test_a_server_at_url_is_used_over_the_backend_it_was_started_with(server_engine):
    assert server_engine.transport == "gloo"  # no CUDA here: auto started it with gloo
    observer = VLLMServerEngine(url=server_engine.url)  # asks the server, reads its --weight-transfer-config
    assert observer.transport == "gloo"
    observer.close()
