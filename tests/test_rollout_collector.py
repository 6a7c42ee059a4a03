"""The rollout side on its own: `RolloutCollector` with a scripted engine (our `RolloutEngine` with fixed replies and
log-probs), a list of prompts and real reward functions and tools; no model, no Trainer."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import pytest

from lightning_rl import stopping
from lightning_rl.data.prompts import PromptRenderer, PromptSource
from lightning_rl.data.sft import DataError
from lightning_rl.rewards import RewardScorer, RewardSpec
from lightning_rl.rollout.base import INTERRUPTED, GenerationInterrupted, ImagesArg, Rollout, RolloutBatch, RolloutEngine, SamplingConfig
from lightning_rl.rollout.buffer import BatchInterrupted
from lightning_rl.rollout.collector import RolloutCollector, RolloutSettings
from support.prompt_sources import PromptList

LOGPROB = -0.25


class ScriptedEngine(RolloutEngine):
    """Replies to each prompt with the texts of `script(prompt_text)`, one per sample (the last one repeated), each
    ended by the end token; a reply longer than ``max_new_tokens`` is cut there (finish reason ``length``)."""

    def __init__(self, tokenizer: Any, script: Any) -> None:
        super().__init__(seed=0)
        self.tokenizer, self.script = tokenizer, script
        self.requests: list[tuple[int, int, SamplingConfig]] = []  # (prompts, n, sampling) of every call

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingConfig, images: ImagesArg = None) -> RolloutBatch:
        self.requests.append((len(prompts), n, sampling))
        groups = []
        for g, prompt in enumerate(prompts):
            replies = self.script(self.tokenizer.decode(prompt))
            group = []
            for k in range(n):
                ids = self.tokenizer.encode(replies[min(k, len(replies) - 1)], add_special_tokens=False) + [self.tokenizer.eos_token_id]
                cut = len(ids) > sampling.max_new_tokens
                ids = ids[: sampling.max_new_tokens]
                group.append(Rollout(list(prompt), ids, [LOGPROB] * len(ids), self.weight_version, g, finish_reason="length" if cut else "stop"))
            groups.append(group)
        return RolloutBatch(groups)

    def push_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        self._version = version

    def close(self) -> None:
        pass


def last_digit_unless_tied(completions: list[str], tied: list[bool], **_: Any) -> list[float]:
    """The digit a reply ends with, or 0 for every reply of a prompt marked ``tied`` (a group without signal)."""
    return [0.0 if t else float(c.strip()[-1]) for c, t in zip(completions, tied, strict=True)]


def starts_with_digit(completions: list[str], **_: Any) -> list[float]:
    return [float(c[:1].isdigit()) for c in completions]


def failed_calls(completions: list[str], tool_calls: list[list[dict]], **_: Any) -> list[float]:
    return [float(sum(call["failure"] is not None for call in calls)) for calls in tool_calls]


def collector(tokenizer: Any, script: Any, prompts: PromptList, reward: str, max_new_tokens: int = 16,
              model_context: int | None = None, rank: int = 0, steps_per_batch: int = 1, **settings: Any) -> RolloutCollector:
    settings = RolloutSettings(**{"num_generations": 2, **settings})
    scorer = RewardScorer([RewardSpec(f"test_rollout_collector:{reward}")])
    renderer = PromptRenderer(tokenizer, tools=settings.tool_specs)
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=1.0)
    return RolloutCollector(ScriptedEngine(tokenizer, script), prompts, renderer, scorer, sampling, settings, model_context,
                            steps_per_batch=steps_per_batch, rank=rank)


def numbered(prompt: str) -> list[str]:
    return ["answer 1", "answer 2"]


def test_dynamic_sampling_replaces_groups_without_signal_round_by_round(tiny_tokenizer, caplog):
    a, b = {"prompt": "a?", "tied": True}, {"prompt": "b?", "tied": False}
    c, d = {"prompt": "c?", "tied": True}, {"prompt": "d?", "tied": False}
    prompts = PromptList([a, b], [c], [d])
    assert isinstance(prompts, PromptSource)
    rollouts = collector(tiny_tokenizer, numbered, prompts, "last_digit_unless_tied", dynamic_sampling=True, dynamic_sampling_max_rounds=3)
    scored = rollouts.collect(4)
    assert scored.records == [b, d]  # a and c tied; round 1 drew c, round 2 drew d
    assert [r.group_id for r in scored.rollouts] == [0, 0, 1, 1]
    assert scored.rewards == [1.0, 2.0, 1.0, 2.0]
    assert (scored.sampling_rounds, scored.sampled_groups, scored.filtered_groups) == (3, 4, 2)
    assert all(r.logprobs == [LOGPROB] * len(r.completion_ids) for r in scored.rollouts)
    seeds = [sampling.seed for _, _, sampling in rollouts.engine.requests]
    assert len(set(seeds)) == 3 and seeds[0] == rollouts.sampling_for(4, 0, 0).seed  # one seed per round
    # Without dynamic sampling the tied group stays, and one request is made.
    plain = collector(tiny_tokenizer, numbered, PromptList([a, b]), "last_digit_unless_tied")
    scored = plain.collect(4)
    assert scored.records == [a, b] and scored.rewards == [0.0, 0.0, 1.0, 2.0] and len(plain.engine.requests) == 1
    # Rounds that never find signal: the first round's batch is trained (its advantages are all 0), counted as filtered,
    # with the samples of every round counted (a reward failing on all of them is judged over those).
    none = collector(tiny_tokenizer, numbered, PromptList([a], [c]), "last_digit_unless_tied", dynamic_sampling=True, dynamic_sampling_max_rounds=2)
    scored = none.collect(0)
    assert scored.records == [a] and (scored.sampling_rounds, scored.sampled_groups, scored.filtered_groups) == (2, 2, 2)
    assert len(scored.rollouts) == 2 and scored.sampled_rollouts == 4
    # Its line names the step that first trains the batch: batch 1 at num_iterations 2 is step 3.
    later = collector(tiny_tokenizer, numbered, PromptList([c], [a]), "last_digit_unless_tied", steps_per_batch=2,
                      dynamic_sampling=True, dynamic_sampling_max_rounds=2)  # fmt: skip
    with caplog.at_level("WARNING"):
        later.collect(1)
    assert "step 3: dynamic sampling found 0 of 1 groups with differing rewards after 2 rounds" in caplog.text
    # A source with no other prompts left ends the rounds there (an empty round crashed deep in the scorer).
    dry = collector(tiny_tokenizer, numbered, PromptList([a], [c]), "last_digit_unless_tied", dynamic_sampling=True, dynamic_sampling_max_rounds=4)
    with caplog.at_level("WARNING"):
        scored = dry.collect(0)
    assert (scored.sampling_rounds, scored.sampled_groups, len(dry.engine.requests)) == (2, 2, 2)
    assert "found 0 of 1 groups with differing rewards after 2 rounds (the prompt source has no more prompts)" in caplog.text
    empty = RewardScorer([RewardSpec("test_rollout_collector:starts_with_digit")]).score([], [], {})
    assert empty.total.shape == (0,) and empty.errors == []


def test_a_datamodule_not_yet_set_up_has_its_prompts_checked_when_the_collector_is_built(tiny_tokenizer, tmp_path):
    """The check of every prompt against the context read no records from a datamodule before its setup, so a
    prompt too long was refused only at the step that drew it."""
    from lightning_rl.data.prompts import PromptDataModule

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in ["a?", "b?", "a question " * 40]))
    with pytest.raises(DataError, match=r"prompts.jsonl: line 3: the prompt is \d+ tokens"):
        collector(tiny_tokenizer, numbered, PromptDataModule(str(data), batch_size=1), "starts_with_digit", max_new_tokens=3, model_context=64)


def test_completions_cut_at_max_new_tokens_and_prompts_that_leave_no_room(tiny_tokenizer):
    records = [{"prompt": "a?", "tied": True}, {"prompt": "a much longer question, with many words in it?", "tied": True}]
    long_replies = lambda prompt: ["the answer is 1", "2"]  # noqa: E731
    scored = collector(tiny_tokenizer, long_replies, PromptList(records[:1]), "last_digit_unless_tied", max_new_tokens=3).collect(0)
    assert [r.finish_reason for r in scored.rollouts] == ["length", "stop"]
    assert [len(r.completion_ids) for r in scored.rollouts] == [3, 2]
    short = len(tiny_tokenizer.apply_chat_template([{"role": "user", "content": records[0]["prompt"]}], add_generation_prompt=True, return_dict=False))
    # The second prompt does not fit beside max_new_tokens: refused, naming its line and what set the limit.
    with pytest.raises(DataError, match=r"^prompts.jsonl: line 2: the prompt is \d+ tokens; with sampling.max_new_tokens=3 it does not fit "
                       rf"the context of {short + 3} tokens \(the model's max_position_embeddings\)"):
        collector(tiny_tokenizer, long_replies, PromptList(records), "last_digit_unless_tied", max_new_tokens=3, model_context=short + 3).collect(0)
    with pytest.raises(DataError, match=rf"context of {short + 3} tokens \(max_context_tokens\)"):
        collector(tiny_tokenizer, long_replies, PromptList(records), "last_digit_unless_tied", max_new_tokens=3, max_context_tokens=short + 3,
                  model_context=10_000).collect(0)
    # A history cap past the model's context does not lift it (it did: prompts ran past the positions the model has).
    with pytest.raises(DataError, match=rf"context of {short + 3} tokens \(the model's max_position_embeddings\)"):
        collector(tiny_tokenizer, long_replies, PromptList(records), "last_digit_unless_tied", max_new_tokens=3, max_context_tokens=10_000,
                  model_context=short + 3).collect(0)


def test_the_models_context_is_its_positions_as_a_scaled_rope_stretches_them():
    from transformers import LlamaConfig, Qwen3Config

    from lightning_rl.models.paths import model_context

    assert model_context(Qwen3Config(max_position_embeddings=40960)) == 40960
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}
    assert model_context(Qwen3Config(max_position_embeddings=40960, rope_parameters=yarn)) == 131072  # Qwen's YaRN recipe
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "rope_theta": 5e5}  # fmt: skip
    assert model_context(LlamaConfig(max_position_embeddings=131072, rope_parameters=llama3)) == 131072  # already the long one


def call(name: str, arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def failing_calls(prompt: str) -> list[str]:
    if "<tool_response>" in prompt:
        return ["done 1"]
    if "divide 1 by 0" in prompt:
        return [call("calculator", {"operation": "divide", "a": 1, "b": 0}), call("search", {"q": "x"})]
    return [call("calculator", {"operation": "add", "a": "seven", "b": 1}), "<tool_call>{not json</tool_call>"]


def test_tool_failures_are_answered_counted_and_reach_the_rewards(tiny_tokenizer):
    prompts = PromptList([{"prompt": "divide 1 by 0"}, {"prompt": "add seven and 1"}])
    rollouts = collector(tiny_tokenizer, failing_calls, prompts, "failed_calls", max_new_tokens=64,
                         tools=("lightning_rl.tools.builtin:calculator",), max_turns=2)
    try:
        scored = rollouts.collect(0)
    finally:
        rollouts.close()
    assert scored.tool_failures == {"raised": 1, "unknown_tool": 1, "invalid_arguments": 1, "malformed": 1}
    assert scored.rewards == [1.0, 1.0, 1.0, 1.0]  # each history made one failed call, as its tool_calls column says
    contents = [r.metadata["tool_calls"][0]["content"] for r in scored.rollouts]
    assert "ZeroDivisionError" in contents[0] and "unknown tool 'search'" in contents[1] and "'seven'" in contents[2]
    assert all(r.metadata["final_reply"] == "done 1" for r in scored.rollouts)  # the model answered each failure
    # Tool responses are in the history but untrained, with log-prob 0; the sampled tokens keep the engine's.
    first = scored.rollouts[0]
    assert not all(first.completion_mask) and all(lp == (LOGPROB if m else 0.0) for lp, m in zip(first.logprobs, first.completion_mask))


def test_a_history_that_would_outgrow_the_context_ends_with_its_reply(tiny_tokenizer):
    prompts = PromptList([{"prompt": "search"}])
    calls_again = lambda prompt: [call("search", {})]  # noqa: E731
    prompt = len(tiny_tokenizer.apply_chat_template([{"role": "user", "content": "search"}], tools=RolloutSettings(
        tools=("lightning_rl.tools.builtin:calculator",)).tool_specs, add_generation_prompt=True, return_dict=False))
    limit = prompt + 24 + 1  # room for the first reply, not for a tool response and another reply
    rollouts = collector(tiny_tokenizer, calls_again, prompts, "failed_calls", max_new_tokens=24,
                         tools=("lightning_rl.tools.builtin:calculator",), max_turns=3, max_context_tokens=limit)
    scored = rollouts.collect(0)
    rollouts.close()
    assert [r.metadata.get("ended") for r in scored.rollouts] == ["context_length", "context_length"]
    assert all(len(r.sequence) <= limit for r in scored.rollouts)
    assert scored.tool_failures == {"unknown_tool": 2} and scored.rewards == [1.0, 1.0]


def test_rewards_read_replies_as_trl_decodes_them_and_calls_tagged_by_special_tokens_still_run(tiny_tokenizer):
    # TRL decodes completions with every special token skipped: a reward scores "<|im_start|>7" as "7" there, so here.
    marked = lambda prompt: ["<|im_start|>7", "x7"]  # noqa: E731
    scored = collector(tiny_tokenizer, marked, PromptList([{"prompt": "a?"}]), "starts_with_digit").collect(0)
    assert scored.rewards == [1.0, 0.0]
    # A string prompt reaches rewards as the model read it, every token of its template kept (its <|im_end|> were cut).
    SEEN.clear()
    collector(tiny_tokenizer, marked, PromptList([{"prompt": "a?"}]), "prompt_seen").collect(0)
    assert SEEN == [{"prompts": ["<|im_start|>user\na?<|im_end|>\n<|im_start|>assistant\n"] * 2}]
    # The tiny tokenizer's <tool_call> tags are special tokens: the call is parsed from the text that keeps them, run,
    # and shown to rewards as TRL shows it (the reply's text without special tokens, the call under tool_calls).
    adds = {"operation": "add", "a": 3, "b": 4}
    replies = lambda prompt: ["7"] if "<tool_response>" in prompt else [call("calculator", adds)]  # noqa: E731
    rollouts = collector(tiny_tokenizer, replies, PromptList([{"prompt": "add 3 and 4"}]), "starts_with_digit", max_new_tokens=64,
                         tools=("lightning_rl.tools.builtin:calculator",), max_turns=2)
    try:
        scored = rollouts.collect(0)
    finally:
        rollouts.close()
    first = scored.rollouts[0]
    assert first.metadata["tool_calls"][0]["content"] == "7" and first.metadata["final_reply"] == "7" and scored.rewards == [1.0, 1.0]
    assert first.messages[0]["content"] == json.dumps({"name": "calculator", "arguments": adds})
    assert first.messages[0]["tool_calls"] == [{"type": "function", "function": {"name": "calculator", "arguments": adds}}]


SEEN: list[dict[str, Any]] = []


def prompt_seen(completions, prompts, **_):
    SEEN.append({"prompts": list(prompts)})
    return [0.0] * len(completions)


def meddling(completions, prompts, hint, meta, **_):
    """Records what it got, then changes it in place, as a careless reward might."""
    SEEN.append({"hint": list(hint), "seen": [m["seen"] if m else None for m in meta]})
    for m, p in zip(meta, prompts):
        if m:
            m["seen"] += 1
        p[-1]["content"] += "!"
    return [1.0] * len(completions)


def test_a_column_some_rows_lack_reaches_every_row_and_each_rollout_gets_its_own_copy(tiny_tokenizer):
    """A column was read from the batch's first record: a batch whose first row lacked it gave no row its value.
    And the G rollouts of a prompt shared its record's objects (and the data's), so a reward that changed them
    changed the next rollout's arguments and the next pass's prompt."""
    def row(k: int, hint: str | None) -> dict[str, Any]:
        return {"prompt": [{"role": "user", "content": f"{k}+{k}="}], **({"hint": hint, "meta": {"seen": 0}} if hint else {})}

    prompts = PromptList([row(4, None), row(1, "add ones")])
    SEEN.clear()
    collect = collector(tiny_tokenizer, numbered, prompts, "meddling", num_generations=3).collect
    prompt_ids = [[r.prompt_ids for r in collect(index).rollouts] for index in (0, 1, 0)]
    assert prompt_ids[0] == prompt_ids[2]
    assert SEEN[0] == {"hint": [None] * 3 + ["add ones"] * 3, "seen": [None] * 3 + [0] * 3}
    assert all(seen == SEEN[0] for seen in SEEN) and prompts.records[1]["prompt"][-1]["content"] == "1+1="


def test_a_base_model_without_a_chat_template_reads_string_prompts_as_they_are(tiny_tokenizer):
    """As TRL tokenizes a string prompt; it was a chat-template error at the first step, blamed on the data's row."""
    import copy

    base = copy.deepcopy(tiny_tokenizer)
    base.chat_template = None
    prompts = PromptList([{"prompt": "2+2="}, {"prompt": [{"role": "user", "content": "2+2="}]}])
    rendered = PromptRenderer(base).render(prompts.records[0], prompts)
    assert rendered.ids == base("2+2=")["input_ids"]
    with pytest.raises(DataError, match=r"^prompts.jsonl: line 2: a conversational prompt needs a chat template, and the tokenizer"):
        PromptRenderer(base).render(prompts.records[1], prompts)
    with pytest.raises(DataError, match="a system_prompt needs a chat template"):
        PromptRenderer(base, system_prompt="Be brief.").render(prompts.records[0], prompts)


def test_a_rows_chat_template_kwargs_reach_the_template_of_its_prompt_as_in_trl(tiny_tokenizer, tmp_path):
    """Qwen3's ``enable_thinking: false``, given in a row's ``chat_template_kwargs`` (as SFT reads it), was dropped:
    the prompt was rendered without it, so a run could not turn thinking off. A bad one is refused naming its row."""
    import copy

    from lightning_rl.data.prompts import read_prompt_records

    thinking = copy.deepcopy(tiny_tokenizer)
    thinking.chat_template = tiny_tokenizer.chat_template.replace(
        "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is false %}{{ '<think></think>' }}{% endif %}{% endif %}",
    )
    prompts = PromptList([{"prompt": "2+2=", "chat_template_kwargs": {"enable_thinking": False}}, {"prompt": "2+2="}])
    quiet, plain = (PromptRenderer(thinking).render(record, prompts) for record in prompts.records)
    assert thinking.decode(quiet.ids).endswith("<|im_start|>assistant\n<think></think>")
    assert quiet.ids[: len(plain.ids)] == plain.ids and plain.ids == PromptRenderer(tiny_tokenizer).render(prompts.records[1], prompts).ids
    base = copy.deepcopy(tiny_tokenizer)
    base.chat_template = None
    with pytest.raises(DataError, match=r"^prompts.jsonl: line 1: chat_template_kwargs needs a chat template"):
        PromptRenderer(base).render(prompts.records[0], prompts)
    # Every turn of a tool conversation renders with them, not the first alone.
    seen = []
    adds = {"operation": "add", "a": 3, "b": 4}
    replies = lambda prompt: seen.append(prompt) or (["7"] if "<tool_response>" in prompt else [call("calculator", adds)])  # noqa: E731
    rows = PromptList([{"prompt": "add 3 and 4", "chat_template_kwargs": {"enable_thinking": False}}])
    rollouts = collector(thinking, replies, rows, "failed_calls", max_new_tokens=64, tools=("lightning_rl.tools.builtin:calculator",), max_turns=2)
    try:
        rollouts.collect(0)
    finally:
        rollouts.close()
    assert seen[-1].endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n<think></think>")
    bad = tmp_path / "p.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1="}) + "\n" + json.dumps({"prompt": "1+1=", "chat_template_kwargs": {"tokenize": False}}) + "\n")
    with pytest.raises(DataError, match=r"p.jsonl: line 2: `chat_template_kwargs` must be an object of the template's variables"):
        read_prompt_records(str(bad), "prompt")


def test_a_reply_that_ends_the_text_rather_than_its_turn_runs_no_tool(tiny_tokenizer):
    """A base tokenizer's eos (<|endoftext|>) stops a reply too, but the ChatML template writes tool results only after
    <|im_end|>: the history went on with a context the template never writes. It ends there, its call kept unrun."""
    import copy

    base = copy.deepcopy(tiny_tokenizer)
    base.eos_token = "<|endoftext|>"  # the scripted engine ends each reply with it
    adds = {"operation": "add", "a": 3, "b": 4}
    replies = lambda prompt: ["7"] if "<tool_response>" in prompt else [call("calculator", adds)]  # noqa: E731
    for tokenizer, ran in ((base, False), (tiny_tokenizer, True)):
        rollouts = collector(tokenizer, replies, PromptList([{"prompt": "add 3 and 4"}]), "failed_calls", max_new_tokens=64,
                             tools=("lightning_rl.tools.builtin:calculator",), max_turns=2)
        try:
            first = rollouts.collect(0).rollouts[0]
        finally:
            rollouts.close()
        assert bool(first.metadata["tool_calls"]) == ran and len(first.messages) == (3 if ran else 1)
        assert first.messages[0]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": adds}


def test_each_rank_batch_and_turn_samples_with_seeds_of_its_own(tiny_tokenizer, tiny_path):
    """Every rank's collector seeded its requests alike (batch, turn, round): two ranks drawing the same prompt trained
    the same completions twice, and on other prompts shared their random draws. The rank is part of each seed now."""
    from lightning_rl.rollout.hf import HFRolloutEngine

    prompts = PromptList([{"prompt": "1+1="}])
    ranks = [collector(tiny_tokenizer, numbered, prompts, "starts_with_digit", rank=rank) for rank in (0, 0, 1)]
    seeds = [c.sampling_for(index=3, turn=0).seed for c in ranks]
    assert seeds[0] == seeds[1] != seeds[2]
    # vLLM seeds a call's samples from its seed upwards (seed + k): seeds a few apart (batches were 101, turns 1) let a
    # call of more samples draw what the next batch or turn drew. Every batch, turn and round is far from the others.
    spread = sorted(ranks[0].sampling_for(i, t, r).seed for i in range(40) for t in range(3) for r in range(2))
    assert min(b - a for a, b in zip(spread, spread[1:])) > 2**16 and spread[-1] < 2**62
    engine = HFRolloutEngine(str(tiny_path))
    prompt = tiny_tokenizer("1+1=")["input_ids"]
    drawn = [[r.completion_ids for r in engine.generate([prompt], 4, c.sampling_for(index=3, turn=0)).rollouts] for c in ranks]
    assert drawn[0] == drawn[1] and drawn[0] != drawn[2]


class CutOnceEngine(ScriptedEngine):
    """Its first call is cut after ``cut_after`` tokens of each sample, as `interrupt` cuts a stopping run's
    generation; every later call replies as `ScriptedEngine`, at weight version 1."""

    def __init__(self, tokenizer: Any, script: Any, cut_after: int) -> None:
        super().__init__(tokenizer, script)
        self.cut_after = cut_after

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingConfig, images: ImagesArg = None) -> RolloutBatch:
        batch = super().generate(prompts, n, sampling, images)
        if self.cut_after is None:
            return batch
        cut = [[dataclasses.replace(r, completion_ids=r.completion_ids[: self.cut_after], logprobs=[-0.5] * min(self.cut_after, len(r.logprobs)),
                                    completion_mask=None, finish_reason=INTERRUPTED) for r in group] for group in batch.groups]
        self.cut_after, self._version = None, 1
        raise GenerationInterrupted(RolloutBatch(cut))


def test_a_batch_cut_by_a_stop_comes_back_and_its_samples_finish_as_one_completion_each(tiny_tokenizer, caplog):
    records = [{"prompt": "a?", "tied": False}, {"prompt": "b?", "tied": False}]
    rollouts = collector(tiny_tokenizer, lambda prompt: ["answer 12", "2"], PromptList(records), "last_digit_unless_tied", max_new_tokens=12)
    engine = rollouts.engine = CutOnceEngine(tiny_tokenizer, rollouts.engine.script, cut_after=2)
    with pytest.raises(BatchInterrupted) as stopped:
        rollouts.collect(3)
    cut = stopped.value.rollouts
    assert stopped.value.index == 3 and [len(r.completion_ids) for r in cut] == [2, 2, 2, 2]
    reply = tiny_tokenizer.encode("answer 12", add_special_tokens=False) + [tiny_tokenizer.eos_token_id]
    assert len(reply) + 2 <= 12

    engine.cut_after = 1  # stopped again while it finishes them: each is saved as far as it got now, on its own prompt
    with pytest.raises(BatchInterrupted) as again:
        rollouts.collect(3, partial=cut)
    assert [(r.prompt_ids, r.completion_ids[:2], len(r.completion_ids), r.finish_reason) for r in again.value.rollouts] == [
        (r.prompt_ids, r.completion_ids, 3, INTERRUPTED) for r in cut]

    scored = rollouts.collect(3, partial=cut)  # the resumed run: each cut sample sampled on from where it stopped
    (_, n, sampling) = engine.requests[-1]
    assert (n, sampling.max_new_tokens, sampling.seed) == (1, 10, rollouts.sampling_for(3, -1, 0).seed)
    for before, after in zip(cut, scored.rollouts, strict=True):
        assert after.prompt_ids == before.prompt_ids and after.group_id == before.group_id
        assert after.completion_ids[:2] == before.completion_ids and after.logprobs[:2] == [-0.5, -0.5]
        assert after.logprobs[2:] == [LOGPROB] * (len(after.completion_ids) - 2) and after.finish_reason == "stop"
        assert after.versions == [0, 0] + [1] * (len(after.completion_ids) - 2) and after.weight_version == 0
    texts = [tiny_tokenizer.decode(r.completion_ids, skip_special_tokens=True) for r in scored.rollouts]
    assert scored.rewards == [float(text.strip()[-1]) for text in texts]  # scored on the whole completion

    # A sample cut at the cap is finished as it is; cut samples of prompts this run does not render are not continued.
    full = dataclasses.replace(cut[0], completion_ids=list(range(8)), logprobs=[-1.0] * 8, completion_mask=None)
    calls = len(engine.requests)
    assert [r.finish_reason for r in engine.continue_rollouts([full], SamplingConfig(max_new_tokens=8))] == ["length"]
    assert len(engine.requests) == calls
    other = [dataclasses.replace(r, prompt_ids=r.prompt_ids + [5]) for r in cut]
    with caplog.at_level("WARNING"):
        fresh = rollouts.collect(3, partial=other)
    assert "sampled from other prompts than this run renders" in caplog.text
    assert engine.requests[-1][1] == 2 and all(r.completion_ids == reply for r in fresh.rollouts[::2])


def test_a_batch_whose_rewards_a_stop_gives_up_comes_back_whole_and_is_scored_after_the_resume(tiny_tokenizer):
    """On the rollout thread (whose work a stop discards) a stop signal gives up the rewards being computed; the
    samples are whole, so they come back as they are, and the resumed run scores them without sampling again."""
    rollouts = collector(tiny_tokenizer, numbered, PromptList([{"prompt": "a?", "tied": False}]), "last_digit_unless_tied")
    stopped: list[BaseException] = []

    def rollout_thread() -> None:
        stopping.discard_on_stop()
        try:
            rollouts.collect(0)
        except BaseException as error:
            stopped.append(error)

    stopping.signal_came()
    try:
        thread = threading.Thread(target=rollout_thread)
        thread.start()
        thread.join(30)
    finally:
        stopping.signal_came(False)
    [cut] = stopped
    assert isinstance(cut, BatchInterrupted) and cut.why == "the signal came before reward 'last_digit_unless_tied' was awaited" and cut.code == 143
    assert [r.finish_reason for r in cut.rollouts] == ["stop", "stop"] and len(rollouts.engine.requests) == 1
    scored = rollouts.collect(0, partial=cut.rollouts)
    assert len(rollouts.engine.requests) == 1 and scored.rollouts == cut.rollouts and scored.rewards == [1.0, 2.0]
