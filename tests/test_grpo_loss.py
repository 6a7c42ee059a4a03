"""The GRPO loss pieces on plain tensors: advantages, clipping, and step-wide normalisation."""

from __future__ import annotations

import math

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
def test_a_float64_loss_is_weighted_in_float64(loss_type):
    """At ``precision: 64-true`` (the noise-free reference) the step's loss is each variant's normaliser applied in
    float64: weights such as 1/3 were rounded to float32 first (a relative error near 1e-7 against TRL in float64)."""
    from lightning_rl.losses.grpo import TokenLoss

    lengths = torch.tensor([3, 7, 5])
    loss_seq = torch.repeat_interleave(torch.arange(3), lengths)
    terms = torch.randn(int(lengths.sum()), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    needs = {"luspo": {"importance_sampling_level": "sequence"}, "cispo": {"epsilon_high": 5.0}}
    counts = StepCounts(num_sequences=3, num_tokens=15, rank_tokens=15, max_completion_length=9)
    zeros = torch.zeros_like(terms)
    reduced = GRPOLoss(loss_type, **needs.get(loss_type, {})).reduce(TokenLoss(terms, zeros, zeros, zeros, None), loss_seq, lengths, counts)
    per_sequence_mean = sum(terms[loss_seq == i].sum() / lengths[i].item() for i in range(3)) / 3
    expected = {"grpo": per_sequence_mean, "sapo": per_sequence_mean, "dr_grpo": terms.sum() / 27, "luspo": terms.sum() / 3}
    assert reduced.dtype == torch.float64
    torch.testing.assert_close(reduced, expected.get(loss_type, terms.sum() / 15), rtol=1e-15, atol=0)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_weights_summed_over_any_split_give_the_unsplit_loss(loss_type):
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 1, 3, 7, 2, 4])
    loss_seq = torch.repeat_interleave(torch.arange(6), lengths)
    terms = torch.randn(int(lengths.sum()), generator=gen)
    needs = {"luspo": {"importance_sampling_level": "sequence"}, "cispo": {"epsilon_high": 5.0}}
    loss = GRPOLoss(loss_type, **needs.get(loss_type, {}))
    counts = StepCounts(num_sequences=6, num_tokens=int(lengths.sum()), rank_tokens=int(lengths.sum()),
                        max_completion_length=8)
    whole = (terms * loss.token_weights(loss_seq, lengths, counts)).sum()
    split = 0.0
    for rows in ([0, 1], [2], [3, 4, 5]):
        mask = torch.isin(loss_seq, torch.tensor(rows))
        local = torch.searchsorted(torch.tensor(rows), loss_seq[mask])  # sequence index within the row
        split = split + (terms[mask] * loss.token_weights(local, lengths[rows], counts)).sum()
    torch.testing.assert_close(split, whole)
    per_sequence_mean = sum(terms[loss_seq == i].mean() for i in range(6)) / 6
    expected = {
        "grpo": per_sequence_mean,
        "sapo": per_sequence_mean,
        "dapo": terms.mean(),
        "cispo": terms.mean(),
        "vespo": terms.mean(),
        "bnpo": terms.mean(),
        "dr_grpo": terms.sum() / (6 * 8),
        "luspo": terms.sum() / 6,
    }[loss_type]
    torch.testing.assert_close(whole, expected)


def test_the_upper_clip_follows_the_lower_one_unless_given_as_trls_does(tmp_path):
    assert GRPOLoss(epsilon_low=0.1).upper_clip == 0.1 and GRPOLoss().upper_clip == 0.2
    assert GRPOLoss(epsilon_low=0.1, epsilon_high=0.28).upper_clip == 0.28
    # A recipe's loss keys are merged into the default instance: it kept epsilon_high at 0.2 for epsilon_low 0.05.
    from lightning_rl.recipe import build
    from support.paths import REPO

    recipe = tmp_path / "grpo.yaml"
    recipe.write_text((REPO / "recipes" / "tiny" / "grpo.yaml").read_text().replace("    epsilon_high: 0.28\n", ""))
    assert build(str(recipe), ["--model.loss.epsilon_low=0.05"]).model.loss.upper_clip == 0.05
    assert build(str(recipe), ["--model.loss.epsilon_low=0.05", "--model.loss.epsilon_high=0.28"]).model.loss.upper_clip == 0.28


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
    loss = GRPOLoss("dapo", importance_sampling_cap=2.0, importance_sampling_mode="token_truncate")
    logprobs = torch.zeros(2)
    engine = torch.log(torch.tensor([0.25, 2.0]))  # trainer/engine ratios 4 (capped at 2) and 0.5
    out = loss.token_loss(logprobs, logprobs, torch.ones(2), engine_logprobs=engine)
    torch.testing.assert_close(out.loss, torch.tensor([-2.0, -0.5]))


def _grad(value: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(value, leaf, retain_graph=True)
    return grad


def test_cispo_weights_log_p_by_the_capped_detached_ratio():
    loss = GRPOLoss("cispo", epsilon_high=1.5)
    logprobs = torch.tensor([-1.0, -2.0, -1.0]).requires_grad_()
    ratios = torch.tensor([0.5, 2.0, 2.0])
    advantages = torch.tensor([1.0, 1.0, -1.0])
    out = loss.token_loss(logprobs, logprobs.detach() - ratios.log(), advantages)
    weights = torch.tensor([0.5, 1.5, 1.5])
    torch.testing.assert_close(out.loss, -weights * advantages * logprobs.detach())
    torch.testing.assert_close(_grad(out.loss.sum(), logprobs), -weights * advantages)  # no gradient through the weight
    assert out.high_clipped.tolist() == [False, True, False]


def test_sapo_gate_is_soft_and_its_temperature_follows_the_advantage_sign():
    loss = GRPOLoss("sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0)
    logprobs = torch.zeros(3, requires_grad=True)
    advantages = torch.tensor([1.0, -1.0, 0.0])
    out = loss.token_loss(logprobs, logprobs.detach(), advantages)
    # On-policy (r = 1) the gate is 4/tau * sigmoid(0) = 2/tau and its slope 1: the plain policy gradient.
    torch.testing.assert_close(out.loss, torch.tensor([-4.0, 1.0, 0.0]))
    torch.testing.assert_close(_grad(out.loss.sum(), logprobs), -advantages)
    far = loss.token_loss(torch.full((2,), 3.0), torch.zeros(2), torch.tensor([1.0, -1.0])).loss
    torch.testing.assert_close(far, torch.tensor([-4 / 0.5 * torch.sigmoid(torch.tensor(0.5 * (math.e**3 - 1))), 2.0]))


def test_sequence_level_ratio_is_the_geometric_mean_of_its_tokens():
    loss = GRPOLoss("grpo", importance_sampling_level="sequence", epsilon_low=1.0, epsilon_high=10.0)
    logprobs = torch.tensor([0.1, 0.3, -0.4]).requires_grad_()
    loss_seq, seq_tokens = torch.tensor([0, 0, 1]), torch.tensor([2, 1])
    out = loss.token_loss(logprobs, torch.zeros(3), torch.ones(3), loss_seq=loss_seq, seq_num_tokens=seq_tokens)
    ratios = torch.tensor([0.2, 0.2, -0.4]).exp()
    torch.testing.assert_close(out.ratio, ratios)
    # d r / d log p_t = r / n for each of the n tokens, and each of them carries -r A: the slope is -r A
    torch.testing.assert_close(_grad(out.loss.sum(), logprobs), -ratios)
    first_only = _grad(out.loss[0], logprobs)  # a token's term moves every token of its sequence
    torch.testing.assert_close(first_only, torch.tensor([-0.5, -0.5, 0.0]) * ratios[0])


def test_two_sided_clipping_caps_the_ratio_of_negative_advantages():
    new, old, advantage = torch.log(torch.tensor([3.0])), torch.zeros(1), torch.tensor([-1.0])
    torch.testing.assert_close(GRPOLoss("dapo").token_loss(new, old, advantage).loss, torch.tensor([3.0]))
    torch.testing.assert_close(GRPOLoss("dapo", delta=2.0).token_loss(new, old, advantage).loss, torch.tensor([2.0]))


@pytest.mark.parametrize(
    "mode,weights",
    [
        ("token_truncate", [1.5, 0.6, 1.2, 1.4, 1.4]),
        ("token_mask", [0.0, 0.0, 1.2, 1.4, 1.4]),
        ("sequence_truncate", [0.6, 0.6, 1.2, 1.5, 1.5]),  # sequence ratios 0.5, 1.2, 1.96
        ("sequence_mask", [0.0, 0.0, 1.2, 0.0, 0.0]),
    ],
)
def test_engine_correction_truncates_or_masks_token_or_sequence_ratios(mode, weights):
    loss = GRPOLoss("dapo", importance_sampling_cap=1.5, importance_sampling_floor=0.6, importance_sampling_mode=mode)
    trainer = torch.zeros(5)
    engine = -torch.log(torch.tensor([2.0, 0.25, 1.2, 1.4, 1.4]))
    loss_seq, seq_tokens = torch.tensor([0, 0, 1, 2, 2]), torch.tensor([2, 1, 2])
    out = loss.token_loss(trainer, trainer, torch.ones(5), engine_logprobs=engine, loss_seq=loss_seq, seq_num_tokens=seq_tokens)
    torch.testing.assert_close(out.loss, -torch.tensor(weights))


def test_off_policy_mask_drops_only_drifted_sequences_with_negative_advantage():
    loss = GRPOLoss("dapo", off_policy_mask_threshold=0.5)
    logprobs = torch.zeros(4)
    engine = torch.tensor([1.0, 0.2, 0.1, 1.0])  # mean drift per sequence: 0.6, 0.1, 1.0
    advantages = torch.tensor([-1.0, -1.0, -1.0, 1.0])
    loss_seq, seq_tokens = torch.tensor([0, 0, 1, 2]), torch.tensor([2, 1, 1])
    out = loss.token_loss(logprobs, logprobs, advantages, engine_logprobs=engine, loss_seq=loss_seq, seq_num_tokens=seq_tokens)
    torch.testing.assert_close(out.loss, torch.tensor([0.0, 0.0, 1.0, -1.0]))


def test_top_entropy_quantile_trains_only_high_entropy_tokens_and_the_bonus_averages_over_them():
    loss = GRPOLoss("dapo", top_entropy_quantile=0.4, entropy_coef=0.1)
    logprobs = torch.zeros(5)
    entropy = torch.tensor([0.1, 0.5, 0.9, 1.3, 2.0], requires_grad=True)
    torch.testing.assert_close(loss.entropy_threshold(entropy), torch.tensor(1.06))  # the 0.6 quantile
    out = loss.token_loss(logprobs, logprobs, torch.ones(5), entropy=entropy)
    assert out.entropy_mask.tolist() == [False, False, False, True, True]
    torch.testing.assert_close(out.loss, torch.tensor([0.0, 0.0, 0.0, -1.0, -1.0]))
    counts = StepCounts(num_sequences=1, num_tokens=5, rank_tokens=5, entropy_tokens=2)
    total = loss.reduce(out, torch.zeros(5, dtype=torch.long), torch.tensor([5]), counts)
    torch.testing.assert_close(total, torch.tensor(-2 / 5 - 0.1 * 3.3 / 2))
    torch.testing.assert_close(_grad(total, entropy), torch.tensor([0.0, 0.0, 0.0, -0.05, -0.05]))
    assert GRPOLoss(top_entropy_quantile=0.0).token_loss(logprobs, logprobs, torch.ones(5), entropy=entropy).entropy_mask.sum() == 1


@pytest.mark.parametrize(
    "estimator,value,slope",
    [  # of d = log p_ref - log p = -0.5; the slope is d(beta * kl) / d log p with beta = 1
        ("k1", 0.5, 1.0),
        ("k2", 0.125, 0.5),
        ("k3", math.exp(-0.5) - 0.5, 1 - math.exp(-0.5)),
    ],
)
def test_kl_estimators_and_their_gradients(estimator, value, slope):
    loss = GRPOLoss("dapo", beta=1.0, kl_estimator=estimator, kl_bias_correction=False)
    logprobs = torch.zeros(1, requires_grad=True)
    out = loss.token_loss(logprobs, logprobs.detach(), torch.zeros(1), ref_logprobs=torch.tensor([-0.5]))
    torch.testing.assert_close(out.kl, torch.tensor([value]))
    torch.testing.assert_close(_grad(out.loss.sum(), logprobs), torch.tensor([slope]))
    corrected = GRPOLoss("dapo", beta=1.0, kl_estimator=estimator)  # r = 1 on-policy, but its gradient adds kl
    out = corrected.token_loss(logprobs, logprobs.detach(), torch.zeros(1), ref_logprobs=torch.tensor([-0.5]))
    torch.testing.assert_close(_grad(out.loss.sum(), logprobs), torch.tensor([slope + value]))


VARIANTS = [
    dict(loss_type="cispo", epsilon_high=1.1),
    dict(loss_type="sapo", entropy_coef=0.05),
    dict(loss_type="luspo", importance_sampling_level="sequence", beta=0.1),
    dict(loss_type="vespo", importance_sampling_cap=1.3, importance_sampling_mode="token_mask"),
    dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.1, kl_estimator="k2"),
    dict(loss_type="dapo", delta=1.5, importance_sampling_floor=0.8, importance_sampling_cap=1.3,
         importance_sampling_mode="sequence_truncate"),
    dict(loss_type="bnpo", off_policy_mask_threshold=0.05, importance_sampling_cap=2.0, importance_sampling_mode="sequence_mask"),
    dict(loss_type="dr_grpo", top_entropy_quantile=0.4, entropy_coef=0.1, beta=0.1, kl_estimator="k1"),
]


@pytest.mark.parametrize("options", VARIANTS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_splitting_a_step_into_rows_keeps_every_gradient(options):
    """With step-wide counts (and a step-wide entropy threshold), the rows' shares add up to the whole step's
    loss and gradients, sequence-level terms included."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 1, 3, 7, 2, 4])
    loss_seq = torch.repeat_interleave(torch.arange(6), lengths)
    m = int(lengths.sum())
    logprobs = (-1 - torch.rand(m, generator=gen)).requires_grad_()
    entropy = (2 * torch.rand(m, generator=gen)).requires_grad_()
    noise = lambda: 0.3 * torch.randn(m, generator=gen)  # noqa: E731
    old, ref = logprobs.detach() + noise(), logprobs.detach() + noise()
    engine = old + noise()
    advantages = torch.randn(6, generator=gen)[loss_seq]
    loss = GRPOLoss(**options)
    threshold = loss.entropy_threshold(entropy)
    kept = int((entropy >= threshold).sum()) if loss.top_entropy_quantile < 1 else None
    counts = StepCounts(num_sequences=6, num_tokens=m, rank_tokens=m, max_completion_length=8, entropy_tokens=kept)

    def share(rows: list[int]) -> torch.Tensor:
        mask = torch.isin(loss_seq, torch.tensor(rows))
        local = torch.searchsorted(torch.tensor(rows), loss_seq[mask])
        terms = loss.token_loss(
            logprobs[mask], old[mask], advantages[mask], ref_logprobs=ref[mask], engine_logprobs=engine[mask],
            loss_seq=local, seq_num_tokens=lengths[rows], entropy=entropy[mask], entropy_threshold=threshold,
        )
        return loss.reduce(terms, local, lengths[rows], counts)

    leaves = [logprobs, entropy]
    whole = share(list(range(6)))
    whole_grads = torch.autograd.grad(whole, leaves, allow_unused=True, materialize_grads=True)
    split = share([0, 1]) + share([2]) + share([3, 4, 5])
    split_grads = torch.autograd.grad(split, leaves, allow_unused=True, materialize_grads=True)
    torch.testing.assert_close(split, whole)
    for got, want in zip(split_grads, whole_grads):
        torch.testing.assert_close(got, want)
    assert whole_grads[0].abs().sum() > 0
    assert (whole_grads[1].abs().sum() > 0) == (loss.entropy_coef != 0)


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(loss_type="ppo"), "loss_type must be one of"),
        (dict(kl_estimator="k4"), "kl_estimator must be one of"),
        (dict(importance_sampling_level="group"), "importance_sampling_level must be one of"),
        (dict(importance_sampling_mode="token"), "importance_sampling_mode must be one of"),
        (dict(epsilon_low=-0.1), "epsilon_low must be in"),
        (dict(epsilon_high=-0.1), "epsilon_high must be >= 0"),
        (dict(beta=-1.0), "beta must be >= 0"),
        (dict(sapo_temperature_neg=0.0), "sapo_temperature_neg must be > 0"),
        (dict(vespo_lambda_pos=0.0), "vespo_lambda_pos must be > 0"),
        (dict(vespo_k_neg=-1.0), "vespo_k_neg must be >= 0"),
        (dict(top_entropy_quantile=1.5), "top_entropy_quantile must be in"),
        (dict(importance_sampling_cap=0.5), "importance_sampling_cap must be >= 1"),
        (dict(importance_sampling_floor=1.5), "importance_sampling_floor must be in"),
        (dict(importance_sampling_floor=1.0, importance_sampling_cap=1.0), "importance_sampling_floor must be below"),
        (dict(off_policy_mask_threshold=-0.1), "off_policy_mask_threshold must be >= 0"),
        (dict(delta=0.0), "delta must be > 0"),
        (dict(loss_type="sapo", delta=2.0), "delta caps the clipped ratio"),
        (dict(loss_type="cispo"), "epsilon_high must be >= 1 for loss_type='cispo'"),
        (dict(loss_type="luspo"), "importance_sampling_level must be 'sequence' for loss_type='luspo'"),
        (dict(loss_type="vespo", importance_sampling_level="sequence"), "importance_sampling_level must be 'token'"),
        (dict(loss_type="vespo", importance_sampling_cap=2.0, importance_sampling_mode="sequence_mask"),
         "importance_sampling_mode must be 'token_truncate' or 'token_mask' for loss_type='vespo'"),
    ],
)
def test_bad_loss_settings_are_refused(options, message):
    with pytest.raises(ValueError, match="^loss." + message):  # named as the recipe names it, under `loss:`
        GRPOLoss(**options)


def test_missing_inputs_are_named():
    one = torch.zeros(1)
    with pytest.raises(ValueError, match="beta != 0 needs reference log-probs"):
        GRPOLoss(beta=0.1).token_loss(one, one, one)
    with pytest.raises(ValueError, match="sequence-level terms .* need each term's sequence"):
        GRPOLoss("grpo", importance_sampling_level="sequence").token_loss(one, one, one)
    with pytest.raises(ValueError, match="needs the per-token entropy"):
        GRPOLoss(entropy_coef=0.1).token_loss(one, one, one)
    with pytest.raises(ValueError, match="no engine log-probs"):
        GRPOLoss(importance_sampling_floor=0.5, importance_sampling_mode="token_truncate").token_loss(one, one, one)
    out = GRPOLoss(top_entropy_quantile=0.5, entropy_coef=0.1).token_loss(one, one, one, entropy=one)
    with pytest.raises(ValueError, match="needs counts.entropy_tokens"):
        GRPOLoss(top_entropy_quantile=0.5, entropy_coef=0.1).reduce(out, one.long(), one.long() + 1, StepCounts(1, 1, 1))
