"""The TRL comparison benchmark compares like with like: at its quick sizes, on the same weights and batch,
our SFT and GRPO losses and gradients equal TRL 1.16's, and both tree packers fold the same rollouts.
TRL is a benchmark/test-only reference."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("trl", reason="TRL is the reference; install the dev extra")


@pytest.fixture(scope="module")
def compare_trl():
    from support.benchmarks import load_benchmark

    return load_benchmark("compare_trl")


@pytest.fixture(scope="module")
def model_path(compare_trl, tmp_path_factory):
    return compare_trl.build_model_folder(tmp_path_factory.mktemp("compare_trl") / "model", compare_trl.QUICK)


def test_sft_losses_and_gradients_agree(compare_trl, model_path, tmp_path):
    agreement = compare_trl.sft_agreement(compare_trl.SFTSides(model_path, compare_trl.QUICK, tmp_path))
    assert set(agreement) == {"ours_tree", "ours_flat"}
    for layout in agreement.values():
        assert layout["loss_trl"] > 0
        assert layout["abs_diff"] <= 1e-5 * layout["loss_trl"]
        assert layout["max_rel_grad_diff"] <= 1e-4


def test_grpo_losses_and_gradients_agree(compare_trl, model_path, tmp_path):
    agreement = compare_trl.grpo_agreement(compare_trl.GRPOSides(model_path, compare_trl.QUICK, tmp_path))
    assert agreement["loss_trl"] != 0
    assert agreement["abs_diff"] <= 1e-5 * abs(agreement["loss_trl"])
    assert agreement["max_rel_grad_diff"] <= 1e-4


def test_both_packers_fold_shared_prompts(compare_trl):
    sizes = compare_trl.QUICK
    rollouts, _ = compare_trl.grpo_rollouts(sizes, random.Random(0))
    seqs, masks = [r.sequence for r in rollouts], [r.loss_mask for r in rollouts]
    ours = compare_trl.pack_sequences(seqs, masks)
    theirs = compare_trl.trl_tree_row(seqs, masks, [r.group_id for r in rollouts])
    # Same loss terms; TRL keys a trie node on (token, next token), so it forks one token earlier per branch.
    assert theirs["token_index"].numel() == ours.loss_targets.numel()
    extra_branches = len(rollouts) - sizes.grpo_prompts
    assert int(theirs["input_ids"].numel()) == ours.num_unique_tokens + extra_branches
