"""Asynchronous GRPO: bounded staleness, k=0 equal to the synchronous loop, and a rollout queue
that survives checkpoint and resume without losing or repeating a prompt."""

from __future__ import annotations

import threading
import time

import lightning as L
import pytest
import torch
from support.grpo import FAST, LENGTH_REWARD, SaveWithBatchesAhead, TrainedRollouts, fit
from transformers import AutoModelForCausalLM

from lightning_rl.data.prompts import PromptDataModule
from lightning_rl.errors import RecipeError
from lightning_rl.models.policy_sync import pushes_in_background
from lightning_rl.models.weights import WeightMismatchError
from lightning_rl.modules.grpo import GRPOModule
from lightning_rl.rollout.base import Rollout
from lightning_rl.rollout.buffer import RolloutProducer, ScoredBatch


def _batch(index: int, version: int) -> ScoredBatch:
    rollout = Rollout([1, 2], [3, 4], [-0.5, -0.25], weight_version=version, group_id=0)
    return ScoredBatch(index, [{"prompt": f"p{index}"}], [rollout], [1.0], {"r": [1.0]})


class _Engine:
    """Stands in for the weight version an engine holds (the producer only reads that number)."""

    def __init__(self) -> None:
        self.version = 0


@pytest.mark.parametrize("concurrent", [False, True])
@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_producer_never_hands_out_a_batch_staler_than_the_bound(max_staleness, concurrent):
    engine = _Engine()
    producer = RolloutProducer(lambda i: _batch(i, engine.version), lambda: engine.version, max_staleness, concurrent=concurrent)
    producer.start()
    seen = []
    for step in range(8):
        batch = producer.take(step)
        seen.append(step - batch.weight_version)
        time.sleep(0.01)  # "training": the producer runs ahead as far as it may
        engine.version = step + 1
        producer.weights_updated()
    producer.close()
    assert max(seen) == max_staleness, seen
    assert min(seen) >= 0


@pytest.mark.parametrize("concurrent", [True, False])
def test_a_concurrent_producer_starts_the_next_batch_beside_a_straggling_one(concurrent):
    """Batch 1's last completion runs long. Once the step-0 weights are pushed, the bound allows batch 2: a concurrent
    producer starts it at once, beside batch 1 (a sequential one waits for batch 1); batches still arrive in order."""
    engine, started, release = _Engine(), {i: threading.Event() for i in range(4)}, threading.Event()

    def produce(index: int) -> ScoredBatch:
        version = engine.version
        started[index].set()
        if index == 1:
            assert release.wait(60)
        return _batch(index, version)

    producer = RolloutProducer(produce, lambda: engine.version, max_staleness=1, concurrent=concurrent)
    producer.start()
    assert producer.take(0).index == 0 and started[1].wait(10)
    engine.version = 1
    producer.weights_updated()
    assert started[2].wait(10 if concurrent else 0.5) is concurrent
    assert not started[3].is_set()  # version 1 allows batches up to 2 (max_staleness=1)
    release.set()
    taken = [producer.take(i) for i in (1, 2)]
    producer.close()
    assert [b.index for b in taken] == [1, 2]
    assert [i - b.weight_version for i, b in zip((1, 2), taken)] == [1, 1]  # within max_staleness=1


def test_a_failure_on_the_producer_thread_reaches_the_trainer():
    def produce(index: int) -> ScoredBatch:
        raise OSError("engine went away")

    producer = RolloutProducer(produce, lambda: 0, max_staleness=1)
    producer.start()
    with pytest.raises(RuntimeError, match="rollout generation failed") as error:
        producer.take(0)
    assert isinstance(error.value.__cause__, OSError)
    producer.close()


@pytest.mark.parametrize("concurrent", [False, True])
def test_a_failure_reading_the_engines_version_reaches_the_trainer(concurrent):
    def version() -> int:
        raise ConnectionError("engine went away")

    producer = RolloutProducer(lambda i: _batch(i, 0), version, max_staleness=1, concurrent=concurrent)
    producer.start()
    with pytest.raises(RuntimeError, match="rollout generation failed") as error:
        producer.take(0)
    assert isinstance(error.value.__cause__, ConnectionError)
    producer.close()


def test_producer_never_samples_a_batch_past_the_runs_last_step():
    """A run of two batches samples and scores two: a batch no step trains would still call the reward functions (a
    paid API, a sandbox) and print its dynamic-sampling lines. The bound alone would let it run three ahead."""
    produced = []
    producer = RolloutProducer(lambda i: produced.append(i) or _batch(i, 10), lambda: 10, max_staleness=3, end_index=2)
    producer.start()
    assert [producer.take(i).index for i in range(2)] == [0, 1]
    time.sleep(0.1)  # time the producer would take to start a third
    assert not producer._may_start() and produced == [0, 1]
    producer.close()
    # A resume that lowered max_steps: batches saved past its last step are neither trained nor finished.
    cut = {"index": 2, "rollouts": [vars(r) for r in _batch(2, 1).rollouts]}
    resumed = RolloutProducer(lambda i: produced.append(i) or _batch(i, 10), lambda: 10, max_staleness=3, end_index=2)
    resumed.load_state_dict({"ready": [_batch(1, 0).state(), _batch(3, 1).state()], "partial": [cut]}, next_step=1)
    resumed.start()
    assert resumed.take(1).weight_version == 0  # the saved one
    time.sleep(0.1)
    assert not resumed._may_start() and produced == [0, 1] and list(resumed._ready) == [] and not resumed._partial
    resumed.close()


def test_queue_state_round_trips_and_resumes_after_the_queued_batches():
    producer = RolloutProducer(lambda i: _batch(i, i), lambda: 10, max_staleness=1)
    producer.start()
    producer.take(0)
    time.sleep(0.05)
    producer.close()
    state = producer.state_dict()
    assert [b["index"] for b in state["ready"]] == list(range(1, 1 + len(state["ready"])))
    restored = RolloutProducer(lambda i: _batch(i, 10), lambda: 10, max_staleness=1)
    restored.load_state_dict(state, next_step=1)
    restored.start()
    taken = [restored.take(i) for i in range(1, 1 + len(state["ready"]) + 1)]
    restored.close()
    queued = list(range(1, 1 + len(state["ready"])))
    assert [b.weight_version for b in taken] == queued + [10]  # queued first, then new
    # A batch missing below the queued ones (in the making when a stopped run saved) is sampled anew, before them.
    gap = RolloutProducer(lambda i: _batch(i, 10), lambda: 10, max_staleness=len(state["ready"]) + 1)
    gap.load_state_dict(state, next_step=0)
    gap.start()
    taken = [gap.take(i) for i in range(2 + len(state["ready"]))]
    gap.close()
    assert [b.weight_version for b in taken] == [10] + queued + [10]


def test_max_staleness_zero_equals_the_synchronous_run(tiny_path):
    runs = []
    for async_mode in (False, True):
        trained = TrainedRollouts()
        module, _ = fit(3, [trained], async_mode=async_mode, max_staleness=0, rewards=LENGTH_REWARD)
        runs.append((trained.batches, {k: v.clone() for k, v in module.policy.state_dict().items()}))
    (sync_batches, sync_weights), (async_batches, async_weights) = runs
    assert async_batches == sync_batches
    assert [b["weight_version"] for b in async_batches] == [0, 1, 2]
    initial = AutoModelForCausalLM.from_pretrained(tiny_path).state_dict()
    assert any(not torch.equal(initial[name], tensor) for name, tensor in sync_weights.items())  # it trained
    for name, tensor in sync_weights.items():
        torch.testing.assert_close(async_weights[name], tensor, rtol=0, atol=0)


def test_staleness_one_overlaps_and_never_trains_older_rollouts():
    trained = TrainedRollouts()
    module, trainer = fit(4, [trained], async_mode=True, max_staleness=1)
    staleness = [b["index"] - b["weight_version"] for b in trained.batches]
    assert [b["index"] for b in trained.batches] == [0, 1, 2, 3]
    assert max(staleness) <= 1 and 1 in staleness, staleness  # generated ahead, on older weights
    assert module.summary_metrics()["max_staleness_seen"] <= 1
    assert float(trainer.callback_metrics["train/rollout/staleness"]) <= 1


def test_resume_trains_the_checkpointed_queue_without_losing_or_repeating_prompts(tmp_path):
    first = TrainedRollouts()
    checkpoint = tmp_path / "step2.ckpt"
    fit(3, [first, SaveWithBatchesAhead(checkpoint, 2, {2})], async_mode=True, max_staleness=1)
    queued = torch.load(checkpoint, weights_only=True)["grpo"]["per_rank"][0]["rollout_queue"]["ready"]  # plain data only
    assert queued and queued[0]["index"] == 2  # generated ahead, before the save

    second = TrainedRollouts()
    resumed, _ = fit(4, [second], async_mode=True, max_staleness=1, ckpt_path=str(checkpoint))
    batches = first.batches[:2] + second.batches
    assert [b["index"] for b in batches] == [0, 1, 2, 3]
    datamodule = PromptDataModule(batch_size=2)
    assert [b["prompts"] for b in batches] == [[r["prompt"] for r in datamodule.prompt_batch(i)] for i in range(4)]
    # Batch 2 is the one from the checkpoint, not a fresh sample from the resumed weights (version 2).
    queued_version = min(r["weight_version"] for r in queued[0]["rollouts"])
    assert second.batches[0]["weight_version"] == queued_version < 2
    assert second.batches[0]["completions"] == [r["completion_ids"] for r in queued[0]["rollouts"]]
    assert [b["index"] for b in resumed.trained_batches] == [0, 1, 2, 3]


def test_a_batch_staler_than_the_bound_is_sampled_again_once_and_counted():
    engine = _Engine()
    engine.version = 3
    produced = []

    def produce(index: int) -> ScoredBatch:
        produced.append(index)
        return _batch(index, engine.version)

    producer = RolloutProducer(produce, lambda: engine.version, max_staleness=1)
    producer.load_state_dict({"ready": [_batch(3, 1).state(), _batch(4, 3).state()]}, next_step=3)
    producer.start()
    taken = [producer.take(3), producer.take(4)]
    producer.close()
    assert produced == [3]  # batch 3 (two versions stale) again, under version 3; batch 4 as queued
    assert [(b.weight_version, b.stale_regenerations) for b in taken] == [(3, 1), (3, 0)]


def test_a_sample_still_too_stale_after_regenerating_is_an_error_naming_the_versions():
    producer = RolloutProducer(lambda i: _batch(i, 0), lambda: 5, max_staleness=1)
    producer.load_state_dict({"ready": [_batch(5, 0).state()]}, next_step=5)
    producer.start()
    with pytest.raises(RuntimeError, match="batch 5 sampled again came back at weight version 0"):
        producer.take(5)
    producer.close()


class PushWatch(L.Callback):
    """Records whether each push ran on the trainer's thread; drops ``skip`` from the push of version ``broken`` (a real
    tensor the engine never gets); keeps the engine's weights as they are once the run has joined its last push."""

    def __init__(self, broken: int | None = None, skip: str = "model.norm.weight") -> None:
        self.broken, self.skip = broken, skip
        self.on_trainer_thread: dict[int, bool] = {}
        self.engine_weights: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, module) -> None:  # before the module's own: its first push is watched too
        push = module.engine.push_weights

        def watched(named, version):
            self.on_trainer_thread[version] = threading.current_thread() is threading.main_thread()
            return push((item for item in named if item[0] != self.skip) if version == self.broken else named, version)

        module.engine.push_weights = watched

    def on_fit_end(self, trainer, module) -> None:  # after on_train_end joined the last push, before the engine closes
        self.engine_weights = {k: v.clone() for k, v in module.engine.model.state_dict().items()}


def test_pushes_in_background_leave_the_trainer_and_end_on_its_weights():
    """Async GRPO (k=1): every push after the first runs on its own thread while the next step trains; the run still
    trains every batch once within the bound and ends with the engine holding the trainer's weights, verified."""
    trained, watch = TrainedRollouts(), PushWatch()
    module, _ = fit(4, [trained, watch], async_mode=True, max_staleness=1, push_in_background="always")
    assert watch.on_trainer_thread == {0: True, 1: False, 2: False, 3: False, 4: False}
    assert [b["index"] for b in trained.batches] == [0, 1, 2, 3]
    assert all(b["index"] - b["weight_version"] <= 1 for b in trained.batches)
    policy = module.policy.state_dict()
    assert watch.engine_weights.keys() == policy.keys()
    for name, tensor in policy.items():
        torch.testing.assert_close(watch.engine_weights[name], tensor, rtol=0, atol=0, msg=name)


def test_a_push_in_background_that_fails_its_check_stops_the_run_a_step_later():
    """A tensor left out of the push of version 2 (sent after step 1) is caught by the engine's check on the push's
    thread, and raised on the trainer's at the next push: the run stops naming the tensor and the version."""
    watch = PushWatch(broken=2)
    with pytest.raises(WeightMismatchError, match="version 2 failed verification: 'model.norm.weight' was not sent"):
        fit(4, [watch], async_mode=True, max_staleness=1, push_in_background="always")
    assert max(watch.on_trainer_thread) == 2  # the push after step 2 met the failure first, and sent nothing


def test_push_in_background_is_refused_where_the_trainer_would_wait_for_it_anyway():
    for kwargs in ({}, {"async_mode": True, "max_staleness": 0}):
        with pytest.raises(RecipeError, match="push_in_background: always needs async_mode with max_staleness >= 1"):
            GRPOModule(**FAST, rewards=LENGTH_REWARD, push_in_background="always", **kwargs)


def test_the_async_settings_check_themselves_as_they_are_made():
    from lightning_rl.modules.grpo_options import AsyncSettings

    assert AsyncSettings(True, 2, "always").max_staleness == 2
    with pytest.raises(RecipeError, match="max_staleness must be >= 0, got -1") as caught:
        AsyncSettings(True, -1)
    assert caught.value.key == "max_staleness"
    with pytest.raises(RecipeError, match="push_in_background: always needs async_mode"):
        AsyncSettings(False, 1, "always")
    with pytest.raises(RecipeError, match="push_in_background must be one of auto, always, never, got 'sometimes'"):
        AsyncSettings(True, 1, "sometimes")


def test_auto_pushes_in_background_only_where_it_frees_the_trainer(tiny_path):
    """``auto``: async at ``max_staleness >= 1`` on an accelerator; not on a CPU (the push there takes the cores the
    step and the engine need), not at k=0 (the next batch needs the pushed weights), never in a synchronous run."""
    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert pushes_in_background("auto", True, 1, model, "full", cuda)
    assert not pushes_in_background("auto", True, 1, model, "full", cpu)
    assert not pushes_in_background("auto", True, 0, model, "full", cuda)
    assert not pushes_in_background("auto", False, 1, model, "full", cuda)
    assert pushes_in_background("always", True, 1, model, "full", cpu) and not pushes_in_background("never", True, 1, model, "full", cuda)
