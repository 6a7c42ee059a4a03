"""Scoring what the sampler drew from: log-probs renormalised over each token's sampling support.

The chunked LM head against a dense fp64 reference (forward and gradient), its refusals, and the support
travelling through tree packing with the token it was drawn for.
"""

from __future__ import annotations

import dataclasses
import re

import lightning as L
import pytest
import torch

from lightning_rl.ops.logprobs import LogitTransform, token_logprobs
from lightning_rl.packing import pack_sequences


def random_support(logits: torch.Tensor, targets: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Per row, a top-k support of a random size holding the target, padded with -1; every third row has none."""
    rows, vocab = logits.shape
    width = 9
    support = torch.full((rows, width), -1, dtype=torch.int32)
    for i in range(rows):
        if i % 3 == 2:
            continue  # padding only: the whole distribution
        k = int(torch.randint(1, width + 1, (), generator=generator))
        kept = [t for t in logits[i].topk(vocab).indices.tolist() if t != targets[i]][: k - 1] + [int(targets[i])]
        support[i, torch.randperm(width, generator=generator)[:k]] = torch.tensor(kept, dtype=torch.int32)
    return support


def dense_restricted(h, w, b, targets, support, transform):
    """z[target] - logsumexp(z[support]) on the full [tokens x vocab] logits, masking what the support leaves out."""
    z = torch.nn.functional.linear(h, w, b) * transform.scale
    if transform.softcap:
        z = transform.softcap * torch.tanh(z / transform.softcap)
    z = z / transform.temperature
    if support is not None:
        allowed = torch.zeros_like(z, dtype=torch.bool)
        for i, row in enumerate(support.tolist()):
            ids = [t for t in row if t >= 0]
            allowed[i, ids or slice(None)] = True
        z = z.masked_fill(~allowed, float("-inf"))
    return torch.log_softmax(z, -1).gather(1, targets[:, None]).squeeze(1)


@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(scale=0.5, softcap=3.0, temperature=0.7)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_restricted_logprobs_match_dense_reference_fp64(transform, with_bias):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(40, 16, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(97, 16, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(97, dtype=torch.float64, generator=g, requires_grad=True) if with_bias else None
    targets = torch.randint(0, 97, (40,), generator=g)
    with torch.no_grad():
        support = random_support(h @ w.t(), targets, g)
    chunked = token_logprobs(h, w, targets, chunk_size=7, transform=transform, bias=b, support=support)
    dense = dense_restricted(h, w, b, targets, support, transform)
    torch.testing.assert_close(chunked, dense, atol=1e-12, rtol=0)
    unrestricted = dense_restricted(h, w, b, targets, None, transform)
    restricted = (support >= 0).any(1)
    assert (chunked - unrestricted)[restricted].mean() > 0.1  # renormalising over the support raises the scores
    torch.testing.assert_close(chunked[~restricted], unrestricted[~restricted], atol=1e-12, rtol=0)
    up = torch.randn(40, dtype=torch.float64, generator=g)
    params = (h, w) + ((b,) if b is not None else ())
    for ours, ref in zip(torch.autograd.grad(chunked, params, up), torch.autograd.grad(dense, params, up)):
        torch.testing.assert_close(ours, ref, atol=1e-12, rtol=1e-10)


def test_without_support_scores_are_unchanged():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(20, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(50, 8, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (20,), generator=g)
    padding_only = torch.full((20, 4), -1)
    plain = token_logprobs(h, w, targets, chunk_size=6)
    padded = token_logprobs(h, w, targets, chunk_size=6, support=padding_only)
    dense = torch.log_softmax(h @ w.t(), -1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(plain, dense, atol=1e-12, rtol=0)
    assert torch.equal(plain, padded)
    up = torch.randn(20, dtype=torch.float64, generator=g)
    for a, c in zip(torch.autograd.grad(plain, (h, w), up), torch.autograd.grad(dense, (h, w), up)):
        torch.testing.assert_close(a, c, atol=1e-12, rtol=1e-10)


def test_a_target_outside_its_support_is_refused():
    h, w = torch.randn(3, 4), torch.randn(10, 4)
    support = torch.tensor([[1, 2], [3, -1], [-1, -1]])
    with pytest.raises(ValueError, match="token 1: target 4 is not in its sampling support"):
        token_logprobs(h, w, torch.tensor([2, 4, 7]), support=support)
    with pytest.raises(ValueError, match=r"support of shape \(3,\) for 3 tokens"):
        token_logprobs(h, w, torch.tensor([2, 3, 7]), support=torch.tensor([1, 2, 3]))
    # An id named twice would count its probability twice; padding may repeat. A row without repeats passes.
    with pytest.raises(ValueError, match=r"token 1: its sampling support names a token id twice \(\[3, 5, 3\]\)"):
        token_logprobs(h, w, torch.tensor([2, 3, 7]), support=torch.tensor([[1, 2, -1], [3, 5, 3], [-1, -1, -1]]))
    token_logprobs(h, w, torch.tensor([2, 3, 7]), support=torch.tensor([[1, 2, -1], [3, 5, -1], [-1, -1, -1]]))


def test_a_suppressed_target_is_refused():
    """A suppressed token is out of the distribution (never sampled): scoring it as a target is refused, not -1e30."""
    h, w = torch.randn(3, 4), torch.randn(10, 4)
    never = LogitTransform(suppressed=(5, 8))
    with pytest.raises(ValueError, match="token 2: target 8 is a suppressed token"):
        token_logprobs(h, w, torch.tensor([2, 3, 8]), transform=never)
    scored = token_logprobs(h, w, torch.tensor([2, 3, 7]), transform=never)
    dense = torch.log_softmax((h @ w.t()).index_fill(1, torch.tensor([5, 8]), float("-inf")), -1)[torch.arange(3), [2, 3, 7]]
    torch.testing.assert_close(scored, dense)


def test_supports_travel_with_their_tokens_through_tree_packing():
    # Two completions of one prompt share their first sampled token (one packed position, two loss terms) and fork.
    prompt, first = [1, 2, 3], [7]
    seqs = [prompt + first + [8, 9], prompt + first + [10], [4, 5]]
    masks = [[False] * 3 + [True] * 3, [False] * 3 + [True] * 2, [False, True]]
    supports = [
        torch.tensor([[-1, -1]] * 3 + [[7, 3], [8, -1], [9, 1]], dtype=torch.int32),
        torch.tensor([[-1, -1, -1]] * 3 + [[7, 3, -1], [10, 2, 6]], dtype=torch.int32),
        None,  # no filter on this one: the whole distribution
    ]
    packed = pack_sequences(seqs, masks, token_supports=supports)
    assert packed.num_unique_tokens == 3 + 1 + 2 + 1 + 2  # the prompt and the shared token stored once
    assert packed.token_support.shape == (len(packed.loss_targets), 3)
    for target, row in zip(packed.loss_targets.tolist(), packed.token_support.tolist()):
        kept = [t for t in row if t >= 0]
        assert target in kept or target == 5 and not kept
    shared = [row for pos, row in zip(packed.loss_positions.tolist(), packed.token_support.tolist()) if pos == 2]
    assert len(shared) == 2 and all(row[:2] == [7, 3] for row in shared)  # one support, carried by both terms
    assert pack_sequences(seqs, masks).token_support is None
    with pytest.raises(ValueError, match="sequence 1: token support of shape"):
        pack_sequences(seqs, masks, token_supports=[supports[0], supports[0], None])


def test_sampling_settings_check_themselves():
    from lightning_rl.errors import RecipeError
    from lightning_rl.rollout.base import SamplingSettings

    with pytest.raises(RecipeError, match=r"^sampling.max_support=8 is below sampling.top_k=50") as refused:
        SamplingSettings(top_k=50, max_support=8)
    assert refused.value.key == "sampling.max_support"
    for bad, key in [({"top_p": 0.0}, "sampling.top_p"), ({"min_p": 1.0}, "sampling.min_p"), ({"max_support": 0}, "sampling.max_support"),
                     ({"temperature": float("nan")}, "sampling.temperature"), ({"top_k": -1}, "sampling.top_k")]:
        with pytest.raises(RecipeError) as refused:
            SamplingSettings(**bad)
        assert refused.value.key == key
    assert SamplingSettings(top_k=50, max_support=50).filtered and not SamplingSettings(temperature=0, top_p=0.5).filtered


# -- the transformers engine against the trainer, over the whole grid of filters ---------------------------------


@pytest.fixture(scope="module")
def engine_and_trainer(tiny_path):
    from transformers import AutoModelForCausalLM

    from lightning_rl.rollout.hf import HFRolloutEngine

    trainer = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    return HFRolloutEngine(str(tiny_path)), trainer


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
def test_transformers_engine_first_pass_ratio_is_one_under_every_filter(engine_and_trainer, temperature):
    from support.sampling_grid import check_first_pass

    check_first_pass(*engine_and_trainer, temperature)


def test_a_support_wider_than_the_cap_is_refused_naming_the_key(engine_and_trainer):
    from lightning_rl.errors import RecipeError
    from lightning_rl.rollout.base import SamplingConfig

    engine, _ = engine_and_trainer
    with pytest.raises(RecipeError, match=r"^sampling.max_support=16: a sampled token's filters kept \d+ tokens") as refused:
        engine.generate([[5, 6, 7]], 2, SamplingConfig(max_new_tokens=4, top_p=0.9, max_support=16, seed=0))
    assert refused.value.key == "sampling.max_support"


def test_a_multi_turn_history_keeps_each_turns_support_in_place():
    from lightning_rl.rollout.base import Rollout, extend_support

    first = torch.tensor([[4, 5], [6, -1]], dtype=torch.int32)
    history = Rollout([1, 2], [4, 6], [-0.1, -0.2], 0, 0, support=first)
    for ids, support in [([9, 9, 9], None), ([7], torch.tensor([[7, 8, 3]], dtype=torch.int32))]:  # a tool's output, a reply
        extend_support(history, support, len(ids))
        history.completion_ids += ids
        history.logprobs += [0.0] * len(ids)
    assert history.support.tolist() == [[4, 5, -1], [6, -1, -1], [-1, -1, -1], [-1, -1, -1], [-1, -1, -1], [7, 8, 3]]
    assert history.sequence_support.tolist()[:2] == [[-1, -1, -1]] * 2 and history.sequence_support.shape == (8, 3)
    plain = Rollout([1], [4], [-0.1], 0, 0)
    extend_support(plain, None, 2)
    assert plain.support is None and plain.sequence_support is None


# -- GRPO: the support travels from the engine through packing into the loss's log-probs -----------------------------


class FirstPassAgreement(L.Callback):
    """At the first step, before its optimizer step (weights just synced, one pass): the trainer's log-probs of the
    step's rollouts, packed as the step packs them, against the engine's, with their supports and without."""

    def __init__(self) -> None:
        self.after = self.before = None

    @torch.no_grad()
    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        if self.after is not None:
            return
        from support.benchmarks import load_benchmark

        agreement = load_benchmark("sampling_filters").Agreement
        rollouts = module.current_batch.rollouts
        packed = module.pack_rollouts(rollouts, torch.zeros(len(rollouts)))
        engine = packed.token_values["engine_logprobs"]
        self.after = agreement.of(module.policy_logprobs(module.policy, packed)[0], engine)
        self.before = agreement.of(module.policy_logprobs(module.policy, dataclasses.replace(packed, token_support=None))[0], engine)


def test_grpo_with_top_p_scores_what_was_sampled():
    from support.grpo import fit

    agreement = FirstPassAgreement()
    fit(1, [agreement], sampling={"max_new_tokens": 6, "top_p": 0.9})
    assert abs(agreement.after.ratio_mean - 1) < 1e-3 and agreement.after.kl < 1e-4, agreement.after
    assert agreement.before.ratio_mean < 0.95, agreement.before  # the full softmax: off by the kept mass (about 0.9)


def test_a_repetition_penalty_with_a_correction_is_refused_naming_the_key():
    from lightning_rl.errors import RecipeError
    from lightning_rl.modules.grpo import GRPOModule

    engine = re.escape("old_logprobs=engine (given, or what `auto` takes where a batch can be stale: async_mode)")
    for options, named in [({"loss": {"importance_sampling_cap": 2.0}}, "loss.importance_sampling_cap"), ({"old_logprobs": "engine"}, engine),
                           ({"async_mode": True}, engine)]:  # auto, as an asynchronous run resolves it
        with pytest.raises(RecipeError, match=rf"^sampling.repetition_penalty=1.2 with {named}: ") as refused:
            GRPOModule(model_name_or_path="tiny", num_generations=2, sampling={"repetition_penalty": 1.2}, **options)
        assert refused.value.key == "sampling.repetition_penalty"
    GRPOModule(model_name_or_path="tiny", num_generations=2, sampling={"repetition_penalty": 1.2})  # no correction: allowed


def test_a_batch_with_supports_goes_through_a_checkpoint(tmp_path):
    # A resumed step (num_iterations > 1, the async queue) trains on the supports its rollouts were sampled with.
    from lightning_rl.rollout.base import Rollout
    from lightning_rl.rollout.buffer import ScoredBatch

    support = torch.tensor([[4, 5], [6, -1]], dtype=torch.int32)
    batch = ScoredBatch(0, [{"prompt": "p"}], [Rollout([1, 2], [4, 6], [-0.1, -0.2], 0, 0, support=support)], [1.0], {})
    torch.save(batch.state(), tmp_path / "state.pt")
    restored = ScoredBatch.from_state(torch.load(tmp_path / "state.pt", weights_only=True))
    assert torch.equal(restored.rollouts[0].support, support) and restored.rollouts[0].sequence_support.shape == (4, 2)


def test_the_vllm_engines_read_a_top_k_support_widened_by_ties():
    """vLLM's top-k keeps every token tied with the k-th logit (frequent in low precision): the engines read supports
    of up to 2 x top_k + 16 tokens, and a wider one is refused naming the ties, not the cap it is within."""
    from lightning_rl.errors import RecipeError
    from lightning_rl.rollout.base import SamplingConfig
    from lightning_rl.rollout.vllm_engine import support_of, support_request

    sampling = SamplingConfig(max_new_tokens=1, top_k=5)
    assert support_request(sampling, vocab_size=512) == 27
    removed = -float("inf")
    tied = [(token, -1.5 if token < 6 else removed) for token in range(27)]  # six kept: the 5th and 6th tie
    assert sorted(support_of([tied], sampling, 512)[0].tolist()) == list(range(6))
    with pytest.raises(RecipeError, match=r"kept at least 27 tokens, more than the 26 the engine reads for top_k .*; fewer ties"):
        support_of([[(token, -3.3) for token in range(27)]], sampling, 512)
    assert support_request(SamplingConfig(max_new_tokens=1, top_k=5, max_support=8), 512) == 9  # the cap still bounds it
