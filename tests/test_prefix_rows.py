"""One prefix, many rows: a group too large for one row forwards the prefix it shares once, its rows attend to the
captured keys and values, and one backward runs through the prefix after the last row. Log-probs and gradients
equal each sequence run alone (random trees, random row budgets), on three attention styles, in fp32 and fp64;
the family matrix's attention styles in fp64; what it cannot compute is refused in one line, and the probe checks
the path before a model's first span."""

import copy
import os
import random
from unittest import mock

import lightning as L
import pytest
import torch
import torch.distributed as dist
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lightning_rl.attention.tree_attention import PackingRefused
from lightning_rl.ops.packed_forward import across_rows_exact, packed_logprobs, probe_across_rows, probe_sequences, verify_row
from lightning_rl.ops.prefix_rows import PrefixedRow, cut_prefix, finish_prefix, plan_step_rows, rows_on_every_rank, share_prefixes
from lightning_rl.packing import count_unique_tokens, pack_sequences, plan_rows
from lightning_rl.rollout.vllm_server_process import free_port
from support import tiny_models
from support.distributed import leave_worker
from support.grpo import LENGTH_REWARD, GradientRecorder, fit

from lightning_rl.losses import GRPOLoss
from support import packing_families
from support.packing_families import GRAD_FLOOR, TOLERANCE, reference_logprobs, tolerance

MODELS = {name: tiny_models.build(name) for name in ("qwen3", "llama", "mistral_sliding")}  # windows of 3 reach into the prefix
MODELS_FP64 = {name: copy.deepcopy(model).double() for name, model in MODELS.items()}


@st.composite
def groups(draw):
    """A prompt and G completions forking at random depths (nested forks included), and a row budget that the
    whole group does not fit."""
    token = st.integers(3, tiny_models.VOCAB - 1)
    prompt = draw(st.lists(token, min_size=2, max_size=9))
    completions: list[list[int]] = []
    for _ in range(draw(st.integers(2, 5))):
        stem = completions[draw(st.integers(0, len(completions) - 1))][: draw(st.integers(0, 3))] if completions else []
        completions.append(stem + draw(st.lists(token, min_size=1, max_size=6)))
    seqs = [prompt + c for c in completions]
    longest, whole = max(len(c) for c in completions) + 1, count_unique_tokens(seqs)  # a row holds the prompt's last token
    assume(longest < whole)
    return seqs, len(prompt), draw(st.integers(longest, whole - 1))


def _grads(model):
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def _grad_error(ours, theirs, dtype=torch.float32):
    total = float(torch.stack([t.norm() for t in theirs]).norm())
    return max(float((o - t).norm() / (t.norm() + GRAD_FLOOR[dtype] * total)) for o, t in zip(ours, theirs))


def _cross_row(model, seqs, prompt_len, budget, backend, recompute=False):
    """Log-probs of every trained token (in sequence order) and the gradient of their weighted sum, run as the
    planner's span. ``prompt_len``: where training starts, in every sequence or per sequence."""
    starts = _starts(prompt_len, seqs)
    masks = [[t >= start for t in range(len(s))] for s, start in zip(seqs, starts)]
    plan = plan_rows(seqs, budget, groups=[0] * len(seqs), prefix_across_rows="always", prefix_limits=[start - 1 for start in starts])
    rows, prefixes = plan.ranks[0], plan.prefixes[0]
    assert all(p is not None for p in prefixes) and len(rows) >= 1
    packed = share_prefixes([pack_sequences([seqs[i] for i in row], [masks[i] for i in row]) for row in rows], prefixes, recompute=recompute)
    assert all(isinstance(p, PrefixedRow) for p in packed) and len({id(_root(p.prefix)) for p in packed}) == 1
    model.zero_grad()
    out: dict[int, torch.Tensor] = {}
    for row, batch in zip(rows, packed):
        lp = packed_logprobs(model, batch, chunk_size=5, attention_backend=backend)
        weights = torch.linspace(0.5, 1.5, lp.numel())
        (lp * weights).sum().backward()
        finish_prefix(batch)
        for k, i in enumerate(row):
            out[i] = (lp.detach()[batch.loss_seq == k], weights[batch.loss_seq == k])
    return out, _grads(model), packed


def _starts(prompt_len, seqs):
    return list(prompt_len) if isinstance(prompt_len, list) else [prompt_len] * len(seqs)


def _root(prefix):
    return prefix if prefix.parent is None else _root(prefix.parent)


def _check_against_each_alone(model, seqs, prompt_len, budget, backend, lp_tol, grad_tol, recompute=False):
    out, grads, _ = _cross_row(model, seqs, prompt_len, budget, backend, recompute)
    reference = copy.deepcopy(model)
    reference.zero_grad()
    total = torch.zeros(())
    lp_error = 0.0
    for i, s in enumerate(seqs):
        ref = reference_logprobs(reference, [s])[_starts(prompt_len, seqs)[i] - 1 :]  # the completion's tokens
        ours, weights = out[i]
        lp_error = max(lp_error, float((ours - ref.detach()).abs().max()))
        total = total + (ref * weights).sum()
    total.backward()
    dtype = next(model.parameters()).dtype
    assert lp_error <= lp_tol
    assert _grad_error(grads, _grads(reference), dtype) <= grad_tol


@settings(max_examples=6, deadline=None)
@given(groups(), st.sampled_from(sorted(MODELS)), st.sampled_from(["blocks", "dense"]), st.sampled_from([torch.float32, torch.float64]), st.booleans())
def test_cross_row_equals_each_sequence_alone(group, name, backend, dtype, recompute):
    model = (MODELS if dtype == torch.float32 else MODELS_FP64)[name]
    _check_against_each_alone(model, *group, backend, *TOLERANCE[dtype], recompute=recompute)


@st.composite
def nested_groups(draw):
    """A prompt, untrained turns below it (a tool's output; random lengths, some sharing a stem), trained answers
    below each turn: the shared parts beyond the prompt may be nested spans' prefixes. A row budget the whole group
    does not fit and every sequence does; where training starts in each sequence."""
    token = st.integers(3, tiny_models.VOCAB - 1)
    prompt = draw(st.lists(token, min_size=1, max_size=5))
    seqs, starts, turns = [], [], []
    for _ in range(draw(st.integers(2, 3))):
        stem = turns[draw(st.integers(0, len(turns) - 1))][: draw(st.integers(0, 3))] if turns else []
        turns.append(stem + draw(st.lists(token, min_size=2, max_size=10)))
        for _ in range(draw(st.integers(2, 4))):
            seqs.append(prompt + turns[-1] + draw(st.lists(token, min_size=1, max_size=4)))
            starts.append(len(prompt) + len(turns[-1]))
    for _ in range(draw(st.integers(0, 2)) if len(prompt) > 1 else 0):  # answers trained right after the prompt (whose last token they read), beside the turns' subtrees
        seqs.append(prompt + draw(st.lists(token, min_size=1, max_size=4)))
        starts.append(len(prompt))
    longest, whole = max(map(len, seqs)), count_unique_tokens(seqs)
    assume(longest < whole)
    return seqs, starts, draw(st.integers(longest, (longest + whole) // 2))  # the lower half: turns' subtrees span rows


@settings(max_examples=8, deadline=None)
@given(nested_groups(), st.sampled_from(sorted(MODELS)), st.sampled_from([torch.float32, torch.float64]), st.booleans())
def test_nested_spans_equal_each_sequence_alone(group, name, dtype, recompute):
    """Random trees with untrained parts below the prompt, random budgets; a nested span wherever it forwards fewer
    tokens at all (no cost counted for a prefix's own forward, so that small trees nest too)."""
    model = (MODELS if dtype == torch.float32 else MODELS_FP64)[name]
    with mock.patch("lightning_rl.packing.planner.PREFIX_OVERHEAD_TOKENS", 0):
        _check_against_each_alone(model, *group, "blocks", *TOLERANCE[dtype], recompute=recompute)


def test_an_answer_trained_right_after_the_prompt_leaves_the_others_their_nested_prefix():
    """One completion trained from the prompt's end, two sharing a long untrained tool output: the group's prefix stops
    at the prompt (the first one's limit), and all three rests began with its last token, so no nested prefix could
    form and a budget below the tool output refused the group. The two now share a nested prefix, exact."""
    tool = [20 + k % 40 for k in range(20)]
    seqs = [[3, 4, 5, 6, 7, 8, 9] + answer for answer in ([50, 51, 52], tool + [60, 61], tool + [62, 63])]
    starts = [7, 27, 27]
    plan = plan_rows(seqs, 12, groups=[0] * 3, prefix_across_rows="always", prefix_limits=[start - 1 for start in starts])
    assert plan.ranks[0] == [[0], [1, 2]] and plan.prefixes[0] == [(0, 6), ((0, 6), (1, 26))]
    _check_against_each_alone(MODELS_FP64["llama"], seqs, starts, 12, "blocks", *TOLERANCE[torch.float64])


def test_a_recomputed_prefix_keeps_no_graph_across_its_rows_and_gives_the_same_gradients():
    """With recompute (gradient checkpointing), the prefix's first forward saves nothing for backward; it runs again,
    with dropout drawing the same masks, for its one backward after the last row: the same gradients as kept."""
    model = copy.deepcopy(MODELS["llama"]).train()
    drop = {"p": 0.0}
    for layer in model.model.layers:  # dropout after each MLP: the rerun must draw the masks the first forward drew
        layer.mlp.register_forward_hook(lambda module, args, out: torch.nn.functional.dropout(out, drop["p"], training=True))
    prompt = list(range(3, 23))
    seqs = [prompt + [30 + k, 40 + k, 50 + k, 60] for k in range(6)]
    _cross_row(model, seqs, len(prompt), budget=9, backend="blocks")  # the packing probe first (it refuses a random forward)
    drop["p"] = 0.3
    grads, saved, calls = {}, {}, {}
    for recompute in (False, True):
        hook = model.model.embed_tokens.register_forward_hook(lambda m, args, out: calls.setdefault(recompute, []).append(args[0].shape[1]))
        saved[recompute] = []  # (forwards begun so far, elements) of each tensor saved for backward
        pack = lambda t: saved[recompute].append((len(calls.get(recompute, [])), t.numel())) or t  # noqa: E731
        try:
            torch.manual_seed(0)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                _, grads[recompute], packed = _cross_row(model, seqs, len(prompt), budget=9, backend="blocks", recompute=recompute)
        finally:
            hook.remove()
        assert packed[0].prefix.finished == 3
    # Kept: the prefix once, then 3 rows. Recomputed: the prefix, 3 rows, the prefix again in its backward.
    assert calls[False] == [19, 9, 9, 9] and calls[True] == [19, 9, 9, 9, 19]
    by_prefix = {}  # saved from the prefix's first forward until the first row's (the row's own inputs included)
    for recompute in (False, True):
        first = 1
        by_prefix[recompute] = sum(n for k, n in saved[recompute] if k == first)
    assert by_prefix[True] * 50 < by_prefix[False], by_prefix
    for ours, kept in zip(grads[True], grads[False]):
        torch.testing.assert_close(ours, kept, rtol=1e-5, atol=1e-7)


def _nested_group(answer_len=6):
    """A prompt of 8 tokens, two untrained turns of 100 below it (a tool's output), four answers of each: a turn's
    subtree (124 tokens) does not fit a row of 120 either."""
    rng = random.Random(0)
    tok = lambda n: [rng.randrange(3, tiny_models.VOCAB) for _ in range(n)]  # noqa: E731
    prompt = tok(8)
    turns = [[10 + k] + tok(99) for k in range(2)]
    return [prompt + turn + tok(answer_len) for turn in turns for _ in range(4)]


@pytest.mark.parametrize("recompute", [False, True])
def test_a_nested_span_forwards_each_shared_part_once_and_equals_each_sequence_alone(recompute):
    """Spans nest: the prompt forwarded once, each turn once after it (attending to its keys and values; its last token
    stays in the rows, whose first output it gives), each turn's answers in a row attending to both; the turn's backward adds to the prompt's, which runs once after both turns'.
    fp64, against each sequence alone, with the prefixes' forwards kept or recomputed."""
    model, seqs = MODELS_FP64["qwen3"], _nested_group()
    plan = plan_rows(seqs, 120, groups=[0] * 8, prefix_across_rows="auto", prefix_limits=[107] * 8)
    assert plan.prefixes[0] == [((0, 8), (1, 107)), ((0, 8), (2, 107))] and plan.ranks[0] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert plan.num_unique_tokens == count_unique_tokens(seqs) == 8 + 2 * (99 + 1 + 4 * 6)
    # Turns of 12: a nested span would forward more than rows that each repeat the turn (its own forward's cost counted).
    short = [s[:20] + s[-6:] for s in seqs]
    assert plan_rows(short, 30, groups=[0] * 8, prefix_across_rows="auto", prefix_limits=[19] * 8).prefixes[0] == [(0, 8)] * 4
    _cross_row(model, seqs, 108, budget=120, backend="blocks")  # the packing probes first
    calls = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[1]))
    try:
        _check_against_each_alone(model, seqs, 108, 120, "blocks", *TOLERANCE[torch.float64], recompute=recompute)
    finally:
        hook.remove()
    cross_row = calls[: len(calls) - len(seqs)]  # then each sequence alone
    if recompute:  # each prefix forwarded again for its backward: a turn's after its row, the prompt's after both turns'
        assert cross_row == [8, 99, 25, 99, 99, 25, 99, 8]
    else:
        assert cross_row == [8, 99, 25, 99, 25]


# The family matrix's attention styles (support/packing_families.py) in fp64: exact across rows, or refused in one line.
STYLES = {
    "llama": None, "qwen3": None, "phi": None,  # rotary, q/k norms, partial rotary
    "mistral": None, "cohere2": None,  # a sliding window reaching into the prefix; sliding and full layers
    "gpt2": None,  # learned positions, continued at the prefix's depth
    "gemma3n_text_kvshare": None,  # later layers reuse earlier layers' keys and values
    "qwen3_moe": None, "deepseek_v3": None,  # experts; latent attention (rounds to fp32 inside)
    "gemma2": None,  # soft-capped scores (rounds to fp32 inside)
    "diffllama": r"an attention module runs twice in one forward",
    "llama_dynamic": r"its dynamic rope picks frequencies from the longest position",
}  # fmt: skip
FORKS = [[3, 4, 5, 6, 7, 8] + tail for tail in ([10, 11, 12], [10, 11, 13, 14], [20, 21], [22, 23, 24, 25], [10, 30])]
# Two untrained turns of 4 below the prompt, answers below each (trained from token 10): a turn's subtree spans rows of 5.
NESTED_FORKS = [[3, 4, 5, 6, 7, 8] + turn + answer for turn, answers in (([10, 11, 12, 13], ([20, 21], [22, 23, 24], [25])),
                                                                         ([30, 31, 32, 33], ([40, 41], [42, 43]))) for answer in answers]  # fmt: skip


def test_auto_keeps_sub_groups_where_the_model_or_its_kernel_cannot_continue_a_prefix():
    """`auto` (the default) planned a span for a model the cross-row path refuses (DiffLlama), or for the varlen kernel,
    and the run stopped at the first group too large for a row, hours in; it now asks first and keeps sub-groups,
    which pack such a model exactly. A refusal that only `auto` can avoid says so."""
    group = [list(range(3, 43)) + [43 + k, 52 + k, 60 - k, 44 + k] for k in range(8)]  # a prompt of 40, answers of 4
    masks = [[t >= 40 for t in range(len(s))] for s in group]
    llama, diffllama = (packing_families.build(name, torch.float32) for name in ("llama", "diffllama"))

    def spans(model, backend):
        plan = plan_step_rows(48, "auto", model, group, masks, [0] * len(group), False, lambda: across_rows_exact(model, backend))
        return [p for rank in plan.prefixes for p in rank if p is not None]

    assert spans(llama, "blocks"), "a span is planned where the model continues a prefix exactly"
    assert across_rows_exact(llama, "blocks") and not across_rows_exact(llama, "varlen") and not across_rows_exact(diffllama, "blocks")
    assert spans(llama, "varlen") == [] and spans(diffllama, "blocks") == []
    always = plan_step_rows(48, "always", diffllama, group, masks, [0] * len(group), False, lambda: False)
    assert any(p is not None for rank in always.prefixes for p in rank)  # `always` leaves the refusal to the row
    with pytest.raises(PackingRefused, match=r"\(model.prefix_across_rows: never\) leaves it within one: set model.prefix_across_rows: auto"):
        plan_step_rows(40, "never", llama, group, masks, [0] * len(group), False)


def _refused_on_one_rank(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        def plan():
            if rank == 1:
                raise PackingRefused("model.max_tokens_per_row=25: a rollout of 79 tokens fits no row")
            return [[0], [1]], [None, None]

        def reduce(tensor, reduce_op):
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
            return tensor

        with pytest.raises(PackingRefused, match=r"^model.max_tokens_per_row=25: a rollout of 79 tokens fits no row$") as refused:
            rows_on_every_rank(plan, reduce, torch.device("cpu"))
        assert refused.value.on_every_rank  # said once, by the first process
        assert rows_on_every_rank(lambda: ([[0]] * (1 + rank), [None] * (1 + rank)), reduce, torch.device("cpu")) == ([[0]] * (1 + rank) + [[]] * (1 - rank), [None, None])
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_worker()


def test_a_row_refused_on_one_rank_is_raised_on_every_rank_in_its_words():
    """Over DDP, a rollout too long for any row on one rank raised there alone; the other rank waited in the row-count
    reduce until its peer's exit broke it: a gloo traceback after the clear line, exit 1."""
    torch.multiprocessing.spawn(_refused_on_one_rank, args=(free_port(),), nprocs=2)


@pytest.mark.parametrize("backend", ["blocks", "dense"])
@pytest.mark.parametrize("family", sorted(STYLES))
def test_cross_row_in_fp64_is_exact_or_refused_on_each_attention_style(family, backend):
    model = packing_families.build(family, torch.float64)
    lp_tol, grad_tol = tolerance(family, torch.float64)
    if STYLES[family] is None:  # rows of 6 tokens after the prefix: 3 rows, one a nested fork
        _check_against_each_alone(model, FORKS, 6, 6, backend, lp_tol, grad_tol)
        # Nested spans: each turn's prefix forwarded once after the prompt's, attending to its keys and values.
        plan = plan_rows(NESTED_FORKS, 5, groups=[0] * 5, prefix_across_rows="always", prefix_limits=[9] * 5)
        assert plan.prefixes[0] == [((0, 6), (1, 9))] * 2 + [((0, 6), (2, 9))]
        _check_against_each_alone(model, NESTED_FORKS, 10, 5, backend, lp_tol, grad_tol)
    else:
        with pytest.raises(PackingRefused, match=STYLES[family]):
            _check_against_each_alone(model, FORKS, 6, 6, backend, lp_tol, grad_tol)


def test_the_prefix_is_forwarded_once_and_verify_row_checks_the_span():
    model = MODELS["qwen3"]
    prompt = list(range(3, 23))
    seqs = [prompt + [30 + k, 40 + k, 50 + k, 60] for k in range(6)]
    calls = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[1]))
    try:
        _, _, packed = _cross_row(model, seqs, len(prompt), budget=9, backend="blocks")
    finally:
        hook.remove()
    # The prefix once (the prompt but its last token), then 3 rows (before them: the model's packing probe, if not yet run).
    assert len(packed) == 3 and calls[-4:] == [19, 9, 9, 9] and calls.count(19) == 1
    assert packed[0].prefix.finished == 3
    error, *_ = verify_row(model, packed[1])
    assert error < 1e-5


def test_the_planner_chooses_spans_by_what_they_save():
    prompt = list(range(1000, 1200))
    seqs = [prompt + [50 + k] * 4 for k in range(8)]
    limits = [len(prompt) - 1] * 8
    auto = plan_rows(seqs, 220, groups=[0] * 8, prefix_across_rows="auto", prefix_limits=limits)
    never = plan_rows(seqs, 220, groups=[0] * 8, prefix_across_rows="never", prefix_limits=limits)
    assert all(p is not None for p in auto.prefixes[0]) and auto.num_unique_tokens < never.num_unique_tokens
    assert all(p is None for p in never.prefixes[0]) and len(never.ranks[0]) == 2
    # A short prompt saves less than the prefix's own forward costs: sub-groups.
    short = [[1, 2] + [50 + k] * 30 for k in range(4)]
    assert all(p is None for p in plan_rows(short, 70, groups=[0] * 4, prefix_across_rows="auto").prefixes[0])
    # A sequence longer than the row fits once its prefix is forwarded apart; never refuses it.
    long = [list(range(3, 80)) + [90 + k] for k in range(3)]
    span = plan_rows(long, 20, groups=[0] * 3, prefix_across_rows="auto")
    assert [row for row in span.ranks[0]] == [[0, 1, 2]] and span.prefixes[0] == [(0, 77)]
    with pytest.raises(ValueError, match="more than max_tokens=20"):
        plan_rows(long, 20, groups=[0] * 3)
    # Spans keep their rows on one rank, in order.
    ranked = plan_rows(seqs + long, 40, num_ranks=2, groups=[0] * 8 + [1] * 3, prefix_across_rows="always", prefix_limits=limits + [77] * 3)
    on_rank = [[p[0] for p in rank if p is not None] for rank in ranked.prefixes]
    assert sorted(set(on_rank[0]) | set(on_rank[1])) == [0, 1] and not set(on_rank[0]) & set(on_rank[1])
    assert all(spans == sorted(spans) for spans in on_rank)  # consecutive


def test_what_cannot_continue_a_prefix_is_refused_in_one_line():
    row = pack_sequences([[1, 2, 3, 4], [1, 2, 5]], [[0, 1, 1, 1], [0, 1, 1]])
    with pytest.raises(PackingRefused, match="a loss term reads an output of its first 2 tokens.*prefix_across_rows: never"):
        cut_prefix(row, 2)
    padded = pack_sequences([[1, 2, 3, 4], [1, 2, 5]], [[0, 0, 1, 1], [0, 0, 1]], pad_to_multiple_of=8)
    with pytest.raises(PackingRefused, match="padded to fixed lengths"):
        cut_prefix(padded, 1)
    apart = pack_sequences([[1, 2, 3], [7, 8, 9]], [[0, 0, 1], [0, 0, 1]])
    with pytest.raises(PackingRefused, match="not one chain every sequence starts with"):
        cut_prefix(apart, 1)


def test_the_probe_checks_the_cross_row_path_before_a_models_first_span():
    model = tiny_models.build("qwen3")
    error, dtype, _ = probe_across_rows(copy.deepcopy(model), "blocks", torch.device("cpu"))  # a copy: this probes it
    assert error < 1e-5 and dtype == torch.float32
    seqs = [list(range(3, 12)) + [20 + k, 30 + k] for k in range(4)]
    masks = [[t >= 9 for t in range(len(s))] for s in seqs]
    packed_logprobs(model, pack_sequences(seqs, masks))  # one row: the probe within a row only
    span = share_prefixes([pack_sequences(seqs[:2], masks[:2]), pack_sequences(seqs[2:], masks[2:])], [(0, 8), (0, 8)])
    # Stands for a model that computes a prefix forwarded on its own otherwise than the same tokens in a row: the
    # probe's prefix (2 tokens) has its embeddings moved. The probe across rows runs before the first span, and refuses.
    hook = model.model.embed_tokens.register_forward_hook(lambda module, args, out: out + 0.1 if args[0].shape[1] == 2 else None)
    try:
        with pytest.raises(PackingRefused, match=r"self-check measured .* away .*; a prefix forwarded once across rows \(model.prefix_across_rows: never"):
            packed_logprobs(model, span[0])
    finally:
        hook.remove()
    assert torch.isfinite(packed_logprobs(model, span[0])).all()  # probed again, and now agrees


def test_the_probe_across_rows_checks_a_nested_prefix_too():
    model = tiny_models.build("qwen3")
    nested = probe_sequences(model.config)[1][2:4]  # the probe's nested prefix: two tokens below its outer one

    def moved(module, args, out):  # stands for a model whose nested prefix alone is computed otherwise
        return out + 0.1 if args[0].shape[1] == 2 and args[0][0].tolist() == nested else None

    seqs = [list(range(3, 12)) + [20 + k, 30 + k] for k in range(2)]
    masks = [[t >= 9 for t in range(len(s))] for s in seqs]
    span = share_prefixes([pack_sequences(seqs, masks)], [(0, 8)])
    hook = model.model.embed_tokens.register_forward_hook(moved)
    try:
        with pytest.raises(PackingRefused, match=r"self-check measured .* away .*; a prefix forwarded once across rows"):
            packed_logprobs(model, span[0])
    finally:
        hook.remove()


class PrefixForwards(L.Callback):
    """Tokens of every packed forward of the policy and the reference, in order."""

    def __init__(self) -> None:
        self.calls: dict[str, list[int]] = {"policy": [], "reference": []}

    def on_train_start(self, trainer, pl_module) -> None:
        for name in self.calls:
            def record(module, args, kwargs, name=name) -> None:
                if kwargs.get("tree_attention") is not None:
                    self.calls[name].append(int(kwargs["input_ids"].shape[1]))

            if getattr(pl_module, name) is not None:  # no reference without a KL term
                getattr(pl_module, name).register_forward_pre_hook(record, with_kwargs=True)


def test_a_grpo_step_across_rows_equals_its_sub_groups():
    """The same step (KL to the reference included) with each group's prompt forwarded once, or once per row."""
    grads, forwards, rows = {}, {}, {}
    for setting in ("always", "never"):
        recorder, forwards[setting] = GradientRecorder(), PrefixForwards()
        _, trainer = fit(1, [recorder, forwards[setting]], batch_size=2, loss=GRPOLoss(beta=0.04), rewards=LENGTH_REWARD,
                         max_grad_norm=None, num_generations=8, max_tokens_per_row=48, prefix_across_rows=setting)  # fmt: skip
        grads[setting], rows[setting] = recorder.steps[0], int(trainer.callback_metrics["train/rows"])
        assert float(trainer.callback_metrics["train/packing_error"]) < 1e-5  # verify_packing ran on the first row
    always, never = forwards["always"].calls, forwards["never"].calls
    # The reference (no backward) forwards each group's prefix once, then the rows: its probe (one row), its probe
    # across rows (a prefix, a nested prefix and three rows), 2 prefixes, the rows.
    assert len(always["reference"]) == 1 + 5 + 2 + rows["always"] and rows["always"] < rows["never"]
    assert len(never["reference"]) == 1 + rows["never"]  # no probe across rows where no row continues a prefix
    assert sum(always["reference"]) < sum(never["reference"]) and sum(always["policy"]) < sum(never["policy"])
    for name, grad in grads["never"].items():
        torch.testing.assert_close(grads["always"][name], grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_the_trainers_old_logprobs_forward_the_prefix_once_and_later_passes_reuse_them():
    """num_iterations=2 with the trainer's old log-probs: the sampling policy's log-probs of a span (no gradient)
    forward its prefix once too, and the batch's second pass reuses them without any forward."""
    forwards = PrefixForwards()
    _, trainer = fit(2, [forwards], batch_size=2, rewards=LENGTH_REWARD, num_generations=8, max_tokens_per_row=48, prefix_across_rows="always",
                     num_iterations=2, old_logprobs="trainer", verify_packing="never")  # fmt: skip
    rows, calls = int(trainer.callback_metrics["train/rows"]), forwards.calls["policy"]
    # The probe across rows (a prefix, a nested prefix, three rows; the probe itself ran as the fit started, before
    # this records); then 2 prefixes and the rows per pass: the first step's old log-probs and its loss, the second
    # step's loss.
    assert len(calls) == 5 + 3 * (2 + rows), calls
