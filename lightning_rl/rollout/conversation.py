"""Multi-turn rollouts: the model writes, its tool calls run, their results are appended, repeat.

Tool results are rendered by the tokenizer's chat template and appended as tokens the model did
not sample (not trained). With `samples_per_turn=[4, 2]`, each of the 4 first replies that calls
a tool continues as 2 samples, so the histories of one prompt form a tree that forks, and forks
again: tree packing forwards each shared turn once.

The calls of a turn run together (`ToolExecutor.run_all`). Each is recorded once in its history's
`metadata["tool_calls"]` with a `call_id` unique in the batch: the histories forked from it share the
record, and `distinct_tool_calls` counts it once. A history whose tool results and next reply would not
fit in `max_context_tokens` ends with its reply (`metadata["ended"] = "context_length"`).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from typing import Any, get_args

from transformers import PreTrainedTokenizerBase

import torch

from lightning_rl.rollout.base import ImagesArg, Rollout, RolloutBatch, RolloutEngine, SamplingConfig, extend_support
from lightning_rl.errors import RecipeError
from lightning_rl.models.loading import template_end_of_turn
from lightning_rl.tools.calls import TOOL_CALL_START, ToolCall, parse_tool_calls
from lightning_rl.tools.executor import FailureKind, ToolExecutor


def visible_text(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int]) -> str:
    """Decoded tokens, keeping tool-call markup (special tokens) but not end or padding tokens: what tool calls are
    parsed from, and what transcripts and logs show."""
    hidden = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    return tokenizer.decode([t for t in token_ids if t not in hidden])


def completion_text(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int]) -> str:
    """What reward functions read as a reply: every special token skipped, as TRL's GRPOTrainer decodes completions,
    so a reward scores the same text under both. Tool-call tags that a tokenizer marks special are skipped too; the
    calls themselves are parsed from `visible_text` and handed over as `tool_calls`."""
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def tool_response_ids(tokenizer: PreTrainedTokenizerBase, tool_messages: list[dict[str, Any]], **context: Any) -> list[int]:
    """Tokens the chat template puts after an assistant turn's end token to show tool results and
    open the next assistant turn; ``context``: the row's template variables (its ``chat_template_kwargs``)."""
    base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    prefix = tokenizer.apply_chat_template(base, tokenize=True, return_dict=False, **context)
    full = tokenizer.apply_chat_template(
        base + tool_messages, tokenize=True, return_dict=False, add_generation_prompt=True, **context
    )
    # After the assistant turn's end token: as many end tokens in, whatever the template writes inside the turns (Qwen3
    # writes an empty <think></think> into the last assistant turn only, so the turn itself differs once tools follow).
    # The end token is the template's own (a base tokenizer's eos, <|endoftext|>, ends no turn of a ChatML template).
    end = template_end_of_turn(tokenizer)
    end = tokenizer.eos_token_id if end is None else end
    turns = sum(token == end for token in prefix)
    ends = [i for i, token in enumerate(full) if token == end]
    if turns and len(ends) >= turns:
        return list(full[ends[turns - 1] + 1 :])
    if full[: len(prefix)] != prefix:
        raise ValueError("the chat template renders tool messages in a way that changes the earlier turns")
    return list(full[len(prefix) :])


def check_tool_call_format(tokenizer: PreTrainedTokenizerBase, model_name: str) -> None:
    """Refuse a chat template that writes tool calls otherwise than the ``<tool_call>{...}</tool_call>`` blocks replies
    are parsed for (Llama 3's bare JSON with "parameters"): its model's calls would never run, silently."""
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, call], tokenize=False)
    except Exception as error:  # a template that cannot render a call at all
        raise RecipeError(f"tools: the chat template of {model_name} cannot render a tool call ({type(error).__name__}: {error})", "tools") from None
    if TOOL_CALL_START not in text:
        raise RecipeError(
            f"tools: the chat template of {model_name} writes tool calls without {TOOL_CALL_START} blocks, which are what "
            "replies are parsed for, so its model's calls would never run: use a model whose template writes them "
            "(Qwen's, Hermes-style)", "tools",
        )


class ToolConversation:
    """Runs the generate / call tools / append loop for a batch of prompts up to `max_turns`."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: PreTrainedTokenizerBase,
        executor: ToolExecutor,
        max_turns: int,
        max_context_tokens: int | None = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if max_context_tokens is not None and max_context_tokens < 1:
            raise ValueError(f"max_context_tokens must be >= 1, got {max_context_tokens}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.executor = executor
        self.max_turns = max_turns
        self.max_context_tokens = max_context_tokens
        self.turn_end = template_end_of_turn(tokenizer)  # what ends a turn the template continues after (None: any stop)

    def generate(
        self, prompts: Sequence[Sequence[int]], samples_per_turn: Sequence[int],
        sampling_for_turn: Callable[[int], SamplingConfig], images: ImagesArg = None, template_kwargs: Sequence[dict[str, Any]] | None = None,
    ) -> RolloutBatch:
        """The rollouts of every prompt: each sampled reply that calls tools gets their responses and is continued,
        up to ``max_turns``. ``images[i]``: prompt ``i``'s images, which every later turn of its histories keeps;
        ``template_kwargs[i]``: the variables prompt ``i``'s chat template renders with (its row's), in every turn."""
        if not samples_per_turn or any(n < 1 for n in samples_per_turn):
            raise ValueError(f"samples per turn must be >= 1, got {list(samples_per_turn)}")
        first = self.engine.generate(prompts, samples_per_turn[0], sampling_for_turn(0), images=images)
        # Each live history with the token ids of its latest reply.
        live = [(self._start(r), r.completion_ids) for r in first.rollouts]
        finished: list[Rollout] = []
        call_ids = itertools.count()
        for turn in range(1, self.max_turns + 1):
            calling = []
            for history, reply in live:
                text = completion_text(self.tokenizer, reply)
                history.messages.append({"role": "assistant", "content": text})
                calls = parse_tool_calls(visible_text(self.tokenizer, reply))
                # A reply that stopped at another end token (a base tokenizer's eos, not the template's <|im_end|>)
                # ended the text: the template never writes a tool result after it.
                ended_text = self.turn_end is not None and list(reply[-1:]) != [self.turn_end]
                if not calls or turn == self.max_turns or history.finish_reason != "stop" or ended_text:
                    if written := _as_written(calls):  # not run (the last turn, or a cut reply), yet the reply holds them, as TRL's messages do
                        history.messages[-1]["tool_calls"] = written
                    history.metadata["final_reply"] = text
                    finished.append(history)
                else:
                    calling.append((history, text, calls))
            outcomes = iter(self.executor.run_all([call for _, _, calls in calling for call in calls]))
            continuing = []
            budget = sampling_for_turn(turn).max_new_tokens
            for history, text, calls in calling:
                ran = [next(outcomes) for _ in calls]
                # The assistant turn as TRL's reward functions read it: the calls as the model wrote them (arguments a
                # schema refused too; the run's are in `tool_calls`).
                if written := _as_written([o.call for o in ran]):
                    history.messages[-1]["tool_calls"] = written
                history.metadata["tool_calls"].extend(
                    {"call_id": next(call_ids), "name": o.call.name, "arguments": o.arguments, "content": o.content,
                     "failure": o.failure}
                    for o in ran
                )  # fmt: skip
                results = [{"role": "tool", "name": o.call.name or "", "content": o.content} for o in ran]
                response = tool_response_ids(self.tokenizer, results, **(template_kwargs[history.group_id] if template_kwargs else {}))
                if self.max_context_tokens is not None and len(history.sequence) + len(response) + budget > self.max_context_tokens:
                    history.metadata.update(final_reply=text, ended="context_length")
                    finished.append(history)
                    continue
                history.messages.extend(results)
                _append(history, response, sampled=False)
                continuing.append(history)
            if not continuing:
                break
            n = samples_per_turn[turn] if turn < len(samples_per_turn) else 1
            later = None if images is None else [own.followed_by(h.completion_ids) if (own := images[h.group_id]) else None for h in continuing]
            batch = self.engine.generate([h.sequence for h in continuing], n, sampling_for_turn(turn), images=later)
            live = []
            for parent, children in zip(continuing, batch.groups, strict=True):
                for child in children:
                    history = copy.deepcopy(parent) if n > 1 else parent
                    _append(history, child.completion_ids, sampled=True, logprobs=child.logprobs, support=child.support,
                            versions=child.versions)
                    history.weight_version = min(history.weight_version, child.weight_version)
                    history.finish_reason = child.finish_reason
                    history.infra_failure = history.infra_failure or child.infra_failure  # an engine that died in any turn
                    history.routes = child.routes  # the engine's routes of the whole history, as this turn ran it
                    live.append((history, child.completion_ids))
        groups: list[list[Rollout]] = [[] for _ in prompts]
        for history in finished:
            groups[history.group_id].append(history)
        return RolloutBatch(groups)

    @staticmethod
    def _start(rollout: Rollout) -> Rollout:
        fresh = Rollout(**asdict(rollout))
        fresh.metadata.setdefault("tool_calls", [])
        return fresh


TOOL_FAILURE_KINDS: tuple[str, ...] = get_args(FailureKind)  # every kind a step logs (0 where none)


def distinct_tool_calls(rollouts: Iterable[Rollout]) -> list[dict[str, Any]]:
    """Every tool call of a batch's rollouts once, though forked histories share those made before the fork."""
    calls: dict[Any, dict[str, Any]] = {}
    for rollout in rollouts:
        for call in rollout.metadata.get("tool_calls", []):
            calls.setdefault(call.get("call_id", id(call)), call)
    return list(calls.values())


def _append(
    history: Rollout, token_ids: Sequence[int], *, sampled: bool, logprobs: Sequence[float] | None = None, support: torch.Tensor | None = None,
    versions: Sequence[int] | None = None,
) -> None:
    """`versions`: the weight version that sampled each token (None: a tool's output, given its turn's version)."""
    held = history.versions
    added = list(versions) if versions is not None else [held[-1] if held else history.weight_version] * len(token_ids)
    if history.token_versions is not None or any(v != history.weight_version for v in added):
        history.token_versions = held + added
    extend_support(history, support, len(token_ids))  # first: it reads where the new tokens start
    history.completion_ids.extend(token_ids)
    history.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(token_ids))
    assert history.completion_mask is not None
    history.completion_mask.extend([sampled] * len(token_ids))


def _as_written(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``: each call's name and arguments as the model wrote them; not a call that
    could not be read (bad JSON, cut off), which stays in the message's content alone, as TRL's parsing leaves it."""
    return [{"type": "function", "function": {"name": call.name, "arguments": call.arguments}} for call in calls if call.error is None]
