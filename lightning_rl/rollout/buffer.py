"""Asynchronous rollout production with bounded staleness, and a queue that survives checkpoints.

Batch `i` is trained at optimizer step `i`, when the trainer's weights are version `i`. A batch
generated with weights of version `v` is `i - v` versions stale. The producer starts batch `i`
only once the engine holds version `i - max_staleness` or newer, so no trained batch is ever
staler than `max_staleness`; with `max_staleness=0` it waits for every update, which is exactly
the synchronous loop run on another thread.

With an engine that serves several callers at once (`RolloutEngine.concurrent_batches`), the producer starts a batch
as soon as the bound allows, while earlier ones are still generating: their last long completions then share the
engine with the next batch's first tokens, instead of the engine waiting on one straggler. Batches still arrive in
order (`take`), each within the bound.

A stop signal that finds a batch half generated saves it as far as it got, where the engine can cut its generation
(`RolloutEngine.interrupt`, the vLLM server engine): `state_dict` has the engine cut it, the collector hands the samples
back (`BatchInterrupted`), and the resumed run samples each cut one on to the end (`RolloutEngine.continue_rollouts`),
every token keeping the version it was sampled with. Elsewhere the batch in the making is sampled again after the resume.

A batch that is staler all the same (a resume whose recipe lowered `max_staleness` finds the checkpointed queue
too old for the new bound) is never trained and never dropped: `take` has the producer sample the same prompt
batch again under the current weights, and the batch counts it (`ScoredBatch.stale_regenerations`).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_rl.errors import UserError
from lightning_rl.rollout.base import Rollout
from lightning_rl.stopping import POLL_S, StepAbandoned, discard_on_stop, signalled, wait_unless_stopping

INTERRUPT_WAIT_S = 30.0  # how long a stopping run's save waits for the batches its engine cut
GIVE_UP_WAIT_S = 4 * POLL_S  # ... and, with an engine that cannot cut, for those the stop finds scored


@dataclass
class ScoredBatch:
    """The rollouts of one prompt batch with their rewards: what one optimizer step trains on.

    Everything is plain Python data so that it can go into a checkpoint as is.
    """

    index: int
    records: list[dict[str, Any]]
    rollouts: list[Rollout]
    rewards: list[float]
    reward_terms: dict[str, list[float]]
    reward_errors: list[dict[str, Any]] = field(default_factory=list)
    generation_seconds: float = 0.0
    # Tool calls made for it (each once, though forked histories share it) and their failures by kind, over every
    # rollout sampled: those dynamic sampling dropped or an infrastructure failure left out too.
    tool_calls: int = 0
    tool_failures: dict[str, int] = field(default_factory=dict)
    sampled_rollouts: int = 0  # ... and how many rollouts those are
    sampling_rounds: int = 1  # dynamic sampling: how many rounds of prompts this batch took,
    sampled_groups: int = 0  # ... how many groups they sampled,
    filtered_groups: int = 0  # ... and how many of those it dropped for tied rewards
    # Per reward function, how many of the `sampled_rollouts` it failed on, and its first failure's text: whether one
    # failed on every sample of the step is judged on these, summed over the ranks (`RewardScorer.stop_if_failed_on_all`).
    reward_failures: dict[str, int] = field(default_factory=dict)
    first_reward_failures: dict[str, str] = field(default_factory=dict)
    # ... and by kind (``NAME/raised``, ``NAME/non_finite``, ``NAME/timeout``), over every attempt at the batch: what
    # its step logs. A sample a timeout failed is left out of the batch, so its rollouts' own errors cannot count it.
    reward_failure_kinds: dict[str, int] = field(default_factory=dict)
    # Rollouts left out for infrastructure failures, by reason (`Rollout.infra_failure`), and groups left out with
    # fewer than two valid samples (`rollout/collector.py:without_infra_failures`).
    excluded_rollouts: dict[str, int] = field(default_factory=dict)
    excluded_groups: int = 0
    logged_columns: dict[str, list[Any]] = field(default_factory=dict)  # the reward functions' log_extra, per rollout
    logged_metrics: dict[str, list[float]] = field(default_factory=dict)  # ... and log_metric, every value logged
    stale_regenerations: int = 0  # how many times its prompts were sampled again, an earlier sample being too stale

    @property
    def weight_version(self) -> int:
        """The oldest weights any of its rollouts was sampled with."""
        return min(r.weight_version for r in self.rollouts)

    def state(self) -> dict[str, Any]:
        state = asdict(self)
        state["rollouts"] = [asdict(r) for r in self.rollouts]
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ScoredBatch:
        return cls(**{**state, "rollouts": [Rollout(**r) for r in state["rollouts"]]})


class BatchInterrupted(StepAbandoned):
    """Batch ``index`` given up by a stopping run: ``rollouts``, its samples as far as they got (those whose generation
    was cut with finish reason ``interrupted``), for the resumed run to finish and score (`RolloutCollector.collect`'s
    ``partial``). The producer saves them; on the trainer's thread (a synchronous run) it is the step given up."""

    def __init__(self, index: int, rollouts: list[Rollout], why: str | None = None) -> None:
        super().__init__(why or f"rollout batch {index} had not returned")
        self.index, self.rollouts = index, rollouts


class RolloutProducer:
    """Runs `produce(index)` for index = start, start+1, ... on background threads (one at a time unless
    ``concurrent``: then each batch the bound allows starts at once, on a thread of its own).

    `current_version()` is the version of the weights generation uses now. `take(index)` blocks
    until that batch is ready; a failure on a producer thread is raised there (a `UserError` as it is).
    ``interrupt()`` cuts the generation in flight when a stopping run saves (`RolloutEngine.interrupt`); a batch
    saved cut is produced as ``produce(index, rollouts)``. ``end_index``: the first batch the run never trains (its
    last step's is the one before), which is never produced: no sampling or reward call for a step that never comes.
    """

    def __init__(
        self,
        produce: Callable[[int], ScoredBatch],
        current_version: Callable[[], int],
        max_staleness: int,
        start_index: int = 0,
        concurrent: bool = False,
        interrupt: Callable[[], bool] | None = None,
        end_index: int | None = None,
    ) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self._produce = produce
        self._current_version = current_version
        self.max_staleness = max_staleness
        self.concurrent = concurrent
        self._ready: dict[int, ScoredBatch] = {}
        self._next_index, self.end_index = start_index, end_index
        self._error: BaseException | None = None
        self._stopping = False
        self._generating: set[int] = set()  # the batches being produced now
        self._regenerate: int | None = None  # a batch index `take` found too stale: generated again, before the next
        # Batches below the next index still to produce after a resume: cut by the stop (their samples as far as they
        # got, to finish) or in the making when it came (None: sampled anew).
        self._partial: dict[int, list[Rollout] | None] = {}
        self._interrupt = interrupt
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._workers: list[threading.Thread] = []

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
            self._thread.start()

    def _may_generate(self, index: int) -> bool:
        # The queue bound only matters if versions run ahead of the steps (they never should).
        queue_has_room = len(self._ready) + len(self._generating) <= self.max_staleness
        trained = self.end_index is None or index < self.end_index
        return queue_has_room and trained and self._current_version() >= index - self.max_staleness

    def _resumed_partial(self) -> int | None:
        """The first batch still to produce below the next index (after a resume, or given up for a stop that was then
        withdrawn), if the weights let it start now: it holds no room of the queue, which the saved batches behind it
        fill (more of them than a lowered ``max_staleness`` leaves room for)."""
        index = min(self._partial, default=None)
        return index if index is not None and index not in self._generating and self._current_version() >= index - self.max_staleness else None

    def _may_start(self) -> bool:
        # Nothing starts while a stop signal stands: a stopped run keeps what it has, and one that goes on after all (a
        # requeue no scheduler took) starts again once it is withdrawn.
        return (self.concurrent or not self._generating) and self._error is None and not signalled() and (
            self._regenerate is not None or self._resumed_partial() is not None or self._may_generate(self._next_index))

    def _run(self) -> None:
        """Starts each batch once the bound allows it: on this thread, or with ``concurrent`` on a thread of its own."""
        discard_on_stop()  # a stopped run keeps the finished batches, and those it gave up as far as they got (`state_dict`)
        try:
            while True:
                with self._changed:  # polled: a stop signal withdrawn notifies nobody
                    while not self._changed.wait_for(lambda: self._stopping or self._error is not None or self._may_start(), POLL_S):
                        pass
                    if self._stopping or self._error is not None:
                        return
                    again = self._regenerate is not None
                    index = self._regenerate if again else self._resumed_partial()
                    if index is None:
                        index = self._next_index
                        self._next_index = index + 1
                    self._regenerate = None
                    self._generating.add(index)
                    if self.concurrent:
                        self._workers = [w for w in self._workers if w.is_alive()]
                        worker = threading.Thread(target=self._produce_one, args=(index,), name=f"rollout-batch-{index}", daemon=True)
                        self._workers.append(worker)
                        worker.start()
                        continue
                self._produce_one(index)
        except BaseException as error:  # reading the engine's version failed: handed to the trainer thread by `take`
            with self._changed:
                self._error = self._error or error
                self._changed.notify_all()

    def _produce_one(self, index: int) -> None:
        discard_on_stop()
        with self._changed:
            partial = self._partial.pop(index, None)
        try:
            batch = self._produce(index) if partial is None else self._produce(index, partial)
        except StepAbandoned as stopped:  # given up for a stop: saved as far as it got (`state_dict`), else sampled again
            with self._changed:
                self._generating.discard(index)
                self._partial[index] = stopped.rollouts if isinstance(stopped, BatchInterrupted) else partial
                self._changed.notify_all()
            return
        except BaseException as error:  # handed to the trainer thread by `take`
            with self._changed:
                self._generating.discard(index)
                if self._error is None:
                    self._error = error
                self._changed.notify_all()
            return
        with self._changed:
            self._ready[index] = batch
            self._generating.discard(index)
            self._changed.notify_all()

    def weights_updated(self) -> None:
        """Call after every weight push: it may unblock the next batch."""
        with self._changed:
            self._changed.notify_all()

    def take(self, index: int) -> ScoredBatch:
        """Batch `index`, to train at weights of version `index`: one staler than `max_staleness` is sampled again
        (the trainer holds version `index` until this step is done, so the new sample is not stale)."""
        regenerations, stale = 0, None

        def given_up() -> bool:  # a stop signal stands, and nothing is producing the batch (nor will: nothing starts)
            return signalled() and index not in self._generating

        def arrived(seconds: float) -> bool:
            return self._changed.wait_for(lambda: index in self._ready or self._error is not None or given_up(), seconds)

        with self._changed:
            while True:
                try:  # a stop signal does not wait for a batch that may never come (a reward that does not return)
                    wait_unless_stopping(arrived, None, f"rollout batch {index}")
                    if index not in self._ready and (given_up() or isinstance(self._error, StepAbandoned)):
                        # The producer gave the batch up for the stop (whichever thread saw the signal first): said
                        # as the trainer sees it, the batch it waited for.
                        raise StepAbandoned(f"rollout batch {index} had not returned")
                except StepAbandoned:
                    if stale is not None:  # it stays in the queue, for the resumed run to sample again
                        self._ready.setdefault(index, stale)
                    raise
                if index not in self._ready:
                    if isinstance(self._error, UserError):  # the user's mistake (a reward failing on every sample):
                        raise self._error  # its own line, as the synchronous run says it at the same step
                    raise RuntimeError("rollout generation failed on the producer thread") from self._error
                batch = self._ready.pop(index)
                self._changed.notify_all()  # room in the queue again
                if index - batch.weight_version <= self.max_staleness:
                    batch.stale_regenerations = regenerations
                    return batch
                if regenerations:  # sampled under the current weights and still too old: the engine's version is wrong
                    raise RuntimeError(
                        f"batch {index} sampled again came back at weight version {batch.weight_version} "
                        f"(max_staleness={self.max_staleness})"
                    )
                regenerations += 1
                self._regenerate, stale = index, batch

    def _settled(self) -> bool:
        """Nothing is being generated, and nothing may be until the weights change."""
        if self._thread is None or self._stopping or self._error is not None:
            return True
        return (not self._generating and self._regenerate is None and self._resumed_partial() is None
                and not self._may_generate(self._next_index))

    def state_dict(self) -> dict[str, Any]:
        """Finished batches not yet trained, once every batch the current weights allow is finished (at most
        ``max_staleness + 1`` generations away). So what a checkpoint holds does not depend on the producer's
        timing, and a resumed run finds its next batch in the queue (its engine reports version 0 until the first
        weight push after the resume, so the producer would not generate that batch).

        Once a stop signal came it does not wait for the batches in the making (they may never come): the engine cuts
        them where it can (``interrupt``) and they are saved as far as they got (``partial``), else the resumed run
        samples them again."""
        with self._changed:
            while not self._changed.wait_for(lambda: self._settled() or signalled(), POLL_S):
                pass
            cut = signalled() and bool(self._generating)
        if cut:  # the cut samples come back at once, as do those whose rewards the stop gave up (`BatchInterrupted`);
            # a batch still out after this (an engine that cannot cut its generation) is sampled again
            wait = INTERRUPT_WAIT_S if self._interrupt is not None and self._interrupt() else GIVE_UP_WAIT_S
            with self._changed:
                self._changed.wait_for(lambda: not self._generating, wait)
        with self._changed:  # a batch both queued too stale and cut while sampled again is saved as cut
            return {"ready": [self._ready[i].state() for i in sorted(self._ready) if self._partial.get(i) is None],
                    "partial": [{"index": i, "rollouts": [asdict(r) for r in rollouts]} for i, rollouts in sorted(self._partial.items()) if rollouts is not None]}

    def give_back(self, batch: ScoredBatch) -> None:
        """Put a batch taken for a step that was then given up back at the front of the queue."""
        with self._changed:
            self._ready[batch.index] = batch
            self._changed.notify_all()

    def load_state_dict(self, state: dict[str, Any], next_step: int) -> None:
        """Restore before `start()`; `next_step` is the first batch index still to train. A batch between the saved
        ones that was in the making when the run stopped is sampled again, before the next one. A batch saved past
        ``end_index`` (a resume that lowered max_steps) is left: no step trains it."""
        if self._thread is not None:
            raise RuntimeError("load_state_dict must be called before start()")
        trained = lambda index: next_step <= index < (self.end_index if self.end_index is not None else index + 1)  # noqa: E731
        ready = [ScoredBatch.from_state(s) for s in state.get("ready", [])]
        self._ready = {b.index: b for b in ready if trained(b.index)}
        self._partial = {p["index"]: [Rollout(**r) for r in p["rollouts"]] for p in state.get("partial", []) if trained(p["index"])}
        self._ready = {i: batch for i, batch in self._ready.items() if i not in self._partial}
        saved = self._ready.keys() | self._partial.keys()
        self._next_index = max(saved, default=next_step - 1) + 1
        if self._partial:
            print(f"resume: the rollouts of step(s) {', '.join(str(i + 1) for i in sorted(self._partial))} were saved as far as "
                  "the stop let them get: sampled on (and scored) from there", file=sys.stderr)
        self._partial.update({i: None for i in range(next_step, self._next_index) if i not in saved})

    def close(self) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for worker in self._workers:
            worker.join()
        self._workers = []
