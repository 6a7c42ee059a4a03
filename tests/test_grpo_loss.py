"""The GRPO loss pieces on plain tensors: advantages, clipping, and step-wide normalisation."""

from __future__ import annotations

import pytest
import torch

from lightning_rl.losses import LOSS_TYPES, GRPOLoss, StepCounts, group_advantages


def test_group_advantages_centre_and_scale_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 5.0, 5.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    scaled = group_advantages(rewards, groups, "std")
    first = rewards[:3] - rewards[:3].mean()
    torch.testing.assert_close(scaled[:3], first / (rewards[:3].std() + 1e-4))
    torch.testing.assert_close(scaled[3:], torch.zeros(4))  # tied groups carry no signal
    torch.testing.assert_close(group_advantages(rewards, groups, "none")[:3], first)


def test_a_group_of_one_gets_no_advantage():
    advantages = group_advantages(torch.tensor([3.0, 1.0, 2.0]), torch.tensor([0, 1, 1]))
    assert advantages[0] == 0 and advantages[1] < 0 < advantages[2]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_weights_summed_over_any_split_give_the_unsplit_loss(loss_type):
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 1, 3, 7, 2, 4])
    loss_seq = torch.repeat_interleave(torch.arange(6), lengths)
    terms = torch.randn(int(lengths.sum()), generator=gen)
    loss = GRPOLoss(loss_type)
    counts = StepCounts(num_sequences=6, num_tokens=int(lengths.sum()), rank_tokens=int(lengths.sum()),
                        max_completion_length=8)
    whole = (terms * loss.token_weights(loss_seq, lengths, counts)).sum()
    split = 0.0
    for rows in ([0, 1], [2], [3, 4, 5]):
        mask = torch.isin(loss_seq, torch.tensor(rows))
        local = torch.searchsorted(torch.tensor(rows), loss_seq[mask])  # sequence index within the row
        split = split + (terms[mask] * loss.token_weights(local, lengths[rows], counts)).sum()
    torch.testing.assert_close(split, whole)
    expected = {
        "grpo": sum(terms[loss_seq == i].mean() for i in range(6)) / 6,
        "dapo": terms.mean(),
        "bnpo": terms.mean(),
        "dr_grpo": terms.sum() / (6 * 8),
    }[loss_type]
    torch.testing.assert_close(whole, expected)


def test_clipping_follows_the_sign_of_the_advantage():
    loss = GRPOLoss("dapo", epsilon_low=0.2, epsilon_high=0.3)
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5])).requires_grad_()
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    out = loss.token_loss(new, old, advantages)
    # r=1.5, A>0: clipped at 1.3, no gradient; r=1.5, A<0: unclipped; r=0.5, A>0: unclipped; r=0.5, A<0: clipped at 0.8.
    torch.testing.assert_close(out.loss, torch.tensor([-1.3, 1.5, -0.5, 0.8]))
    assert out.high_clipped.tolist() == [True, False, False, False]
    assert out.low_clipped.tolist() == [False, False, False, True]
    out.loss.sum().backward()
    assert new.grad[0] == 0 and new.grad[3] == 0 and new.grad[1] != 0 and new.grad[2] != 0


def test_truncated_importance_sampling_caps_the_engine_correction():
    loss = GRPOLoss("dapo", importance_sampling_cap=2.0)
    logprobs = torch.zeros(2)
    engine = torch.log(torch.tensor([0.25, 2.0]))  # trainer/engine ratios 4 (capped at 2) and 0.5
    out = loss.token_loss(logprobs, logprobs, torch.ones(2), engine_logprobs=engine)
    torch.testing.assert_close(out.loss, torch.tensor([-2.0, -0.5]))


def test_bad_loss_settings_are_refused():
    with pytest.raises(ValueError, match="loss_type must be one of"):
        GRPOLoss("ppo")
    with pytest.raises(ValueError, match="beta != 0 needs reference log-probs"):
        GRPOLoss(beta=0.1).token_loss(torch.zeros(1), torch.zeros(1), torch.ones(1))
