"""The trainer-to-server tensor transport on its own: two real gloo ranks on loopback, in two threads."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch

from lightning_rl.rollout import gloo_transport
from lightning_rl.rollout.gloo_transport import ChunkManifest, WeightTransferError

TIMEOUT = timedelta(seconds=20)
Group = torch.distributed.ProcessGroupGloo


def connected_pair(timeout: timedelta = TIMEOUT) -> tuple[Group, Group]:
    store = gloo_transport.host_store("127.0.0.1", 2, timeout)
    worker: dict[str, Group] = {}
    joining = threading.Thread(target=lambda: worker.update(group=gloo_transport.join_group(
        gloo_transport.worker_store("127.0.0.1", store.port, 2, timeout), 1, 2, timeout)))
    joining.start()
    trainer = gloo_transport.join_group(store, 0, 2, timeout)
    joining.join()
    return trainer, worker["group"]


def test_every_dtype_and_shape_arrives_bit_exact():
    trainer, worker = connected_pair()
    chunk = [
        ("bf16", torch.randn(3, 5).to(torch.bfloat16)),
        ("f32", torch.randn(7)),
        ("scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("empty", torch.empty(0, 4)),
        ("mask", torch.tensor([True, False, True])),
        ("ids", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
    ]
    manifest = ChunkManifest.from_dict(ChunkManifest.of(chunk).to_dict())  # as it travels: JSON-safe fields
    received: list[tuple[str, torch.Tensor]] = []
    receiving = threading.Thread(target=lambda: received.extend(gloo_transport.receive_chunk(worker, manifest)))
    receiving.start()
    gloo_transport.send_chunk(trainer, chunk)
    receiving.join()
    assert [name for name, _ in received] == [name for name, _ in chunk]
    for (_, sent), (_, got) in zip(chunk, received):
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent)


def test_chunks_bound_what_is_held_at_once():
    tensors = [(f"t{i}", torch.zeros(256)) for i in range(10)]  # 1 KiB each
    sizes = [[name for name, _ in chunk] for chunk in gloo_transport.chunks(iter(tensors), chunk_bytes=3000)]
    assert sizes == [["t0", "t1", "t2"], ["t3", "t4", "t5"], ["t6", "t7", "t8"], ["t9"]]
    assert [len(c) for c in gloo_transport.chunks(iter(tensors), chunk_bytes=1)] == [1] * 10
    # A tensor's changed elements are decoded within one chunk: their indices never end a chunk without their values.
    index, values = torch.arange(300, dtype=torch.int32), torch.zeros(300)
    changed = [("a#changed.index", index), ("a#changed.values", values), ("b#changed.index", index), ("b#changed.values", values)]
    assert [[n for n, _ in c] for c in gloo_transport.chunks(iter(changed), chunk_bytes=1)] == [
        ["a#changed.index", "a#changed.values"], ["b#changed.index", "b#changed.values"]]


def test_a_receiver_that_stops_listening_gives_an_error_naming_the_tensor():
    trainer, _idle_worker = connected_pair(timeout=timedelta(seconds=5))
    with pytest.raises(WeightTransferError, match=r"'model.embed_tokens.weight' \(#1 of 1"):
        gloo_transport.send_chunk(trainer, [("model.embed_tokens.weight", torch.zeros(2**24))])


def test_a_manifest_with_mismatched_fields_is_refused():
    with pytest.raises(ValueError, match="2 names, 1 dtypes, 2 shapes"):
        ChunkManifest.from_dict({"names": ["a", "b"], "dtype_names": ["float32"], "shapes": [[1], [2]]})


def test_a_tensors_changed_elements_travel_alone_and_are_written_into_the_copy_kept():
    from lightning_rl.models.weights import SparseChange

    trainer, worker = connected_pair()
    held = {"w": torch.randn(6, 4).to(torch.bfloat16), "b": torch.randn(3)}
    new = held["w"].clone()
    new[1, 2], new[5, 0] = 7.0, -0.0 if new[5, 0] == 0 else new[5, 0] * -1  # a sign flip is a change of bits too
    changes = {"w": SparseChange.between(held["w"], new)}
    stream = list(gloo_transport.encode_changes([("w", new), ("b", held["b"] + 1)], changes))
    assert [name for name, _ in stream] == ["w#changed.index", "w#changed.values", "b"] and stream[0][1].numel() == 2
    manifest = ChunkManifest.from_dict(ChunkManifest.of(stream, keep=True).to_dict())
    assert manifest.keep and not manifest.reset
    received: list[tuple[str, torch.Tensor]] = []
    receiving = threading.Thread(target=lambda: received.extend(gloo_transport.receive_chunk(worker, manifest)))
    receiving.start()
    gloo_transport.send_chunk(trainer, stream)
    receiving.join()
    decoded = dict(gloo_transport.decode_changes(received, held))
    assert decoded["w"].view(torch.int16).equal(new.view(torch.int16)) and decoded["b"].equal(held["b"] + 1)
    assert held["w"].view(torch.int16).ne(new.view(torch.int16)).sum() == 2  # the copy kept is written into a clone
    with pytest.raises(WeightTransferError, match="'w': its changed elements arrived, and this worker keeps no copy"):
        gloo_transport.decode_changes(received, {})
    with pytest.raises(WeightTransferError, match="does not fit the copy kept"):
        gloo_transport.decode_changes(received, {"w": torch.zeros(2, dtype=torch.bfloat16)})
