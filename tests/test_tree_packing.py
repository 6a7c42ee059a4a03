"""The packing core against brute force: layout, ancestor relation, depth, loss terms, row planning."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_rl.packing import count_unique_tokens, pack_sequences, plan_ordered_rows, plan_rows
from lightning_rl.packing.tree import PrefixCounter


@st.composite
def forests(draw, max_sequences=8):
    """Sequences that fork, fork again (nested forks), repeat, branch at position 0 or after one token."""
    vocab = st.integers(1, 6)  # a small vocabulary makes accidental sharing common
    seqs = [draw(st.lists(vocab, min_size=1, max_size=8))]
    for _ in range(draw(st.integers(0, max_sequences - 1))):
        base = draw(st.sampled_from(seqs))
        cut = draw(st.integers(0, len(base)))
        seqs.append(base[:cut] + draw(st.lists(vocab, min_size=0 if cut else 1, max_size=6)))
    return seqs


@settings(max_examples=150, deadline=None)
@given(forests(), st.booleans())
def test_layout_matches_brute_force(seqs, share):
    batch = pack_sequences(seqs, share_prefixes=share)
    n = batch.num_unique_tokens
    expected_unique = count_unique_tokens(seqs) if share else sum(map(len, seqs))
    assert n == expected_unique == batch.num_tokens
    assert batch.num_flat_tokens == sum(map(len, seqs))

    # Every sequence reads back from the loss terms: its path, token by token.
    mask = batch.visibility_mask()
    for i, s in enumerate(seqs):
        sel = batch.loss_seq == i
        preds, targets = batch.loss_positions[sel], batch.loss_targets[sel]
        assert targets.tolist() == s[1:]
        if len(s) > 1:
            assert batch.input_ids[preds].tolist() == s[:-1]
            assert batch.position_ids[preds].tolist() == list(range(len(s) - 1))
            # The predictor of token t sees exactly the predictors of tokens < t (its ancestors) and itself.
            for t, p in enumerate(preds.tolist()):
                visible = torch.nonzero(mask[p]).flatten().tolist()
                assert visible == sorted(preds[: t + 1].tolist())

    # Depth equals the number of visible keys minus one: no token sees anything but its own path.
    assert torch.equal(mask.sum(1) - 1, batch.position_ids)
    # Segments tile the row and are chains.
    seg = batch.segments
    assert seg[0, 0] == 0 and seg[-1, 1] == n and torch.equal(seg[1:, 0], seg[:-1, 1])
    for start, end, sub in seg.tolist():
        assert end <= sub
        assert batch.position_ids[start:end].tolist() == list(range(int(batch.position_ids[start]), int(batch.position_ids[start]) + end - start))
        assert (batch.subtree_end[start:end] == sub).all()


def test_shared_token_predicts_each_branch_target():
    # The last prompt token predicts a different first answer token in every branch: three loss terms.
    batch = pack_sequences([[1, 2, 3, 7], [1, 2, 3, 8], [1, 2, 3, 9]], [[0, 0, 0, 1]] * 3)
    assert batch.num_unique_tokens == 6
    assert batch.loss_positions.tolist() == [2, 2, 2]
    assert batch.loss_targets.tolist() == [7, 8, 9]
    assert batch.loss_seq.tolist() == [0, 1, 2]
    assert batch.packing_ratio == 12 / 6


def test_shared_trained_token_feeds_every_sequence():
    # Identical sequences share every token, yet each keeps its own loss terms and carried values.
    batch = pack_sequences(
        [[4, 5, 6], [4, 5, 6]],
        token_values={"old_logprobs": [[0.0, -1.0, -2.0], [0.0, -3.0, -4.0]]},
        seq_values={"advantage": [1.0, -1.0]},
    )
    assert batch.num_unique_tokens == 3
    assert batch.loss_positions.tolist() == [0, 1, 0, 1]
    assert batch.token_values["old_logprobs"].tolist() == [-1.0, -2.0, -3.0, -4.0]
    assert batch.seq_values["advantage"].tolist() == [1.0, -1.0]


def test_flat_packing_is_the_no_sharing_case():
    seqs = [[1, 2, 3], [1, 2, 4]]
    flat = pack_sequences(seqs, share_prefixes=False)
    assert flat.input_ids.tolist() == [1, 2, 3, 1, 2, 4]
    assert flat.position_ids.tolist() == [0, 1, 2, 0, 1, 2]
    assert flat.segments.tolist() == [[0, 3, 3], [3, 6, 6]]
    block = torch.zeros(6, 6, dtype=torch.bool)
    block[:3, :3] = block[3:, 3:] = True
    assert torch.equal(flat.visibility_mask(), block & torch.ones(6, 6, dtype=torch.bool).tril())


def test_padding_is_an_isolated_chain_without_loss_terms():
    batch = pack_sequences([[1, 2, 3], [1, 2, 4, 5]], pad_to_multiple_of=8, pad_token_id=0)
    assert batch.num_tokens == 8 and batch.num_unique_tokens == 5
    assert batch.input_ids[5:].tolist() == [0, 0, 0]
    assert (batch.loss_positions < 5).all()
    assert not batch.visibility_mask()[:5, 5:].any() and not batch.visibility_mask()[5:, :5].any()


def test_loss_mask_selects_trained_tokens():
    batch = pack_sequences([[1, 2, 3, 4]], [[True, False, True, True]])
    assert batch.loss_targets.tolist() == [3, 4]  # token 0 is never trained, token 1 is masked out
    assert batch.loss_positions.tolist() == [1, 2]


def test_bad_input_names_the_sequence():
    import pytest

    with pytest.raises(ValueError, match="sequence 1 is empty"):
        pack_sequences([[1], []])
    with pytest.raises(ValueError, match="sequence 0: loss mask has 2 entries for 3 tokens"):
        pack_sequences([[1, 2, 3]], [[1, 1]])


def test_plan_rows_keeps_groups_together_and_balances_ranks():
    prompt = list(range(100, 140))
    seqs, groups = [], []
    for g in range(6):
        for k in range(4):
            seqs.append([g] + prompt + [200 + g, 300 + k] * (2 + g))
            groups.append(g)
    plan = plan_rows(seqs, max_tokens=256, num_ranks=2, groups=groups)
    assert len(plan.ranks) == 2 and len(plan.ranks[0]) == len(plan.ranks[1])
    placed = sorted(i for rank in plan.ranks for row in rank for i in row)
    assert placed == list(range(len(seqs)))
    for rank, toks in zip(plan.ranks, plan.unique_tokens):
        for row, n in zip(rank, toks):
            assert n == (count_unique_tokens([seqs[i] for i in row]) if row else 0) <= 256
    # No group is split: each fits in a row.
    for g in range(6):
        rows_with_g = [row for rank in plan.ranks for row in rank if any(groups[i] == g for i in row)]
        assert len(rows_with_g) == 1
    assert plan.packing_ratio > 2.5
    costs = plan.attention_cost
    assert max(costs) / min(costs) < 1.5


def test_plan_rows_splits_a_group_larger_than_a_row():
    seqs = [[1] * 10 + [k] * 20 for k in range(2, 8)]
    plan = plan_rows(seqs, max_tokens=60, groups=[0] * 6)
    rows = [row for row in plan.ranks[0] if row]
    assert len(rows) == 3 and all(n <= 60 for n in plan.unique_tokens[0])


@settings(max_examples=150, deadline=None)
@given(forests(), forests(max_sequences=4))
def test_prefix_counter_counts_what_a_set_of_sequences_adds_without_changing_the_tree(tree_seqs, added):
    tree = PrefixCounter()
    for seq in tree_seqs:
        tree.add(seq)
    size = tree.size
    assert tree.added_by_all(added) == count_unique_tokens(tree_seqs + added) - count_unique_tokens(tree_seqs)
    assert tree.size == size == count_unique_tokens(tree_seqs)


@settings(max_examples=100, deadline=None)
@given(forests(), st.integers(8, 40), st.sampled_from(["tree", "flat"]))
def test_both_planners_fill_rows_within_the_budget_counted_as_the_packed_row_counts(seqs, budget, packing):
    """Every sequence placed once; a row over budget only when it is one sequence longer than the budget."""
    ordered = plan_ordered_rows(seqs, budget, packing)
    assert [i for row in ordered for i in row] == list(range(len(seqs)))  # the order kept
    for row in ordered:
        cost = count_unique_tokens([seqs[i] for i in row]) if packing == "tree" else sum(len(seqs[i]) for i in row)
        assert cost <= budget or len(row) == 1
    fitting = [s for s in seqs if len(s) <= budget]
    plan = plan_rows(fitting, budget, num_ranks=2, groups=[len(s) % 3 for s in fitting])
    assert sorted(i for rank in plan.ranks for row in rank for i in row) == list(range(len(fitting)))
    for rank, tokens in zip(plan.ranks, plan.unique_tokens):
        for row, n in zip(rank, tokens):
            assert n == count_unique_tokens([fitting[i] for i in row]) <= budget
