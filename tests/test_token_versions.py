"""Per-token weight versions (`Rollout.token_versions`): checked against the completion, kept through a multi-turn
history and through a checkpoint (plain data, read back with ``weights_only=True``)."""

from __future__ import annotations

import io

import pytest
import torch

from lightning_rl.rollout.base import Rollout
from lightning_rl.rollout.buffer import ScoredBatch
from lightning_rl.rollout.conversation import _append


def spanning(versions: list[int]) -> Rollout:
    return Rollout(prompt_ids=[1, 2], completion_ids=list(range(10, 10 + len(versions))), logprobs=[-0.5] * len(versions),
                   weight_version=min(versions), group_id=0, token_versions=versions)


def test_token_versions_must_cover_the_completion_and_start_at_its_weight_version():
    assert spanning([3, 3, 4]).versions == [3, 3, 4]
    assert Rollout([1], [5, 6], [-1.0, -1.0], weight_version=2, group_id=0).versions == [2, 2]
    with pytest.raises(ValueError, match="2 token versions for 3 completion tokens"):
        Rollout([1], [5, 6, 7], [-1.0] * 3, weight_version=3, group_id=0, token_versions=[3, 4])
    with pytest.raises(ValueError, match=r"oldest 3 \(want weight_version=4\)"):
        Rollout([1], [5, 6], [-1.0] * 2, weight_version=4, group_id=0, token_versions=[3, 4])


def test_a_history_keeps_each_turns_versions_and_gives_a_tool_output_its_turns():
    history = Rollout([1], [5, 6], [-1.0, -1.0], weight_version=2, group_id=0)
    _append(history, [7, 8], sampled=False)  # a tool's output: the version of the turn it answers
    assert history.token_versions is None and history.versions == [2] * 4
    _append(history, [9, 10, 11], sampled=True, logprobs=[-0.1] * 3, versions=[2, 3, 3])  # a turn across a push
    assert history.token_versions == [2, 2, 2, 2, 2, 3, 3]
    _append(history, [12], sampled=False)
    assert history.token_versions == [2, 2, 2, 2, 2, 3, 3, 3]


def test_token_versions_survive_a_checkpoint_read_with_weights_only():
    batch = ScoredBatch(index=4, records=[{"prompt": "p"}], rollouts=[spanning([3, 3, 4, 5]), spanning([4, 4])],
                        rewards=[1.0, 0.0], reward_terms={"r": [1.0, 0.0]})
    buffer = io.BytesIO()
    torch.save({"ready": [batch.state()]}, buffer)
    buffer.seek(0)
    back = ScoredBatch.from_state(torch.load(buffer, weights_only=True)["ready"][0])
    assert [r.token_versions for r in back.rollouts] == [[3, 3, 4, 5], [4, 4]]
    assert back.weight_version == 3  # the oldest token of any rollout bounds the batch's staleness
