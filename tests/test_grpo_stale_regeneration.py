"""Too-stale work is sampled again and counted, never trained, dropped or raised: an asynchronous run at
max_staleness 1 checkpoints a queue generated ahead (batch 3 at weights of version 2, so one version stale when
it is trained), and the resume lowers the bound to 0. Every prompt batch is trained exactly once, none staler
than the new bound, and each regenerated batch says so in ``train/rollouts/regenerated_stale``."""

from __future__ import annotations

from collections import Counter
from typing import Any

import lightning as L
import torch
from support.grpo import SaveWithBatchesAhead, TrainedRollouts, fit

from lightning_rl.data.prompts import PromptDataModule


class RegeneratedCounts(L.Callback):
    """The logged count of each step, by batch index."""

    def __init__(self) -> None:
        self.by_index: dict[int, float] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        count = trainer.callback_metrics["train/rollouts/regenerated_stale"]
        self.by_index[pl_module.last_trained.index] = float(count)


def test_a_queue_too_stale_for_the_resumed_bound_is_sampled_again_and_counted(tmp_path):
    first = TrainedRollouts()
    checkpoint = tmp_path / "step2.ckpt"
    fit(4, [first, SaveWithBatchesAhead(checkpoint, 2, {2, 3})], async_mode=True, max_staleness=1)
    queued = torch.load(checkpoint, weights_only=True)["grpo"]["per_rank"][0]["rollout_queue"]["ready"]
    versions = {b["index"]: min(r["weight_version"] for r in b["rollouts"]) for b in queued}
    # The queue holds what version 2 allows at max_staleness 1; batch 3 could only start once version 2 was there.
    assert sorted(versions) == [2, 3] and versions[3] == 2, versions
    too_stale = {i for i, v in versions.items() if i - v > 0}
    assert 3 in too_stale

    second, counts = TrainedRollouts(), RegeneratedCounts()
    resumed, _ = fit(5, [second, counts], async_mode=True, max_staleness=0, ckpt_path=str(checkpoint))
    batches = first.batches[:2] + second.batches
    assert Counter(b["index"] for b in batches) == Counter(range(5))  # nothing lost, nothing repeated
    assert [b["index"] for b in resumed.trained_batches] == [0, 1, 2, 3, 4]
    datamodule = PromptDataModule(batch_size=2)
    assert [b["prompts"] for b in batches] == [[r["prompt"] for r in datamodule.prompt_batch(i)] for i in range(5)]
    assert all(b["index"] == b["weight_version"] for b in second.batches)  # within the new bound: sampled at version i
    assert counts.by_index == {i: float(i in too_stale) for i in range(2, 5)}
    # A batch the new bound still allows is the checkpointed one, not a new sample.
    kept = [b for b in second.batches if b["index"] in versions and b["index"] not in too_stale]
    for batch in kept:
        queued_batch = next(q for q in queued if q["index"] == batch["index"])
        assert batch["completions"] == [r["completion_ids"] for r in queued_batch["rollouts"]]
