"""What a reward function is called with: TRL's arguments, the text form some functions read, the run's progress.

TRL 1.16's `GRPOTrainer` calls a reward function by keyword with `prompts`, `completions`, `completion_ids`,
`trainer_state`, `log_extra`, `log_metric` and the dataset's other columns. For conversational prompts `prompts[i]`
is the prompt's list of messages and `completions[i]` the messages the model's turns added (`[{"role": "assistant",
"content": ...}]`; with tools, each assistant turn followed by its tool results); for plain-text prompts both are
strings. A function that annotates `prompts` or `completions` as strings (`list[str]`, `Sequence[str]`; every
built-in does) gets strings either way: the prompt as the model read it (chat template applied) and the model's
last reply.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Messages = list[dict[str, Any]]
_TEXT_ANNOTATION = re.compile(r"(?:typing\.|collections\.abc\.)?(?:list|List|Sequence|Iterable)\[str\]")


@dataclass(frozen=True)
class TrainerState:
    """The run's progress at the optimizer step that trains on the scored batch, under the names of transformers'
    `TrainerState` (which TRL passes as `trainer_state`).

    global_step: optimizer steps taken before that step (TRL scores a batch right before training on it, so an
        asynchronous run says the step its batch will train at, not how far the trainer has got).
    max_steps: the steps the run trains for (-1: not known).
    epoch: passes over the prompts before that step, fractional (None: not known).
    is_world_process_zero, is_local_process_zero: whether this rank is the first of the run, of its node.
    Another field of transformers' (``log_history``, ...) is an AttributeError naming those given.
    """

    global_step: int = 0
    max_steps: int = -1
    epoch: float | None = None
    is_world_process_zero: bool = True
    is_local_process_zero: bool = True

    def __getattr__(self, name: str) -> Any:  # only for names it does not have
        if name.startswith("__"):
            raise AttributeError(name)
        given = ", ".join(field.name for field in dataclasses.fields(self))
        raise AttributeError(f"trainer_state has {given}; transformers' TrainerState.{name} is not given to rewards here")


def reads_text(parameters: typing.Iterable[inspect.Parameter]) -> bool:
    """Whether a reward function's parameters say it reads text: `prompts` or `completions` annotated as strings."""
    return any(p.name in ("prompts", "completions") and _is_text(p.annotation) for p in parameters)


def _is_text(annotation: Any) -> bool:
    if isinstance(annotation, str):  # postponed (`from __future__ import annotations`)
        return _TEXT_ANNOTATION.fullmatch(annotation.replace(" ", "")) is not None
    origin = typing.get_origin(annotation)
    return typing.get_args(annotation) == (str,) and origin in (list, collections.abc.Sequence, collections.abc.Iterable)


@dataclass
class RewardBatch:
    """The per-completion arguments of N scored completions.

    prompts, completions: the text forms (the rendered prompt, the last reply), which failure reports quote.
    columns: the data's columns and the rollout's extras (`tool_calls`, `transcripts`, `completion_ids`, ...).
    chat_prompts, chat_completions: for conversational prompts, TRL's message lists (None for plain-text prompts).
    """

    prompts: list[str]
    completions: list[str]
    columns: dict[str, list[Any]] = field(default_factory=dict)
    chat_prompts: list[Messages] | None = None
    chat_completions: list[Messages] | None = None

    def __post_init__(self) -> None:
        if (self.chat_prompts is None) != (self.chat_completions is None):
            raise ValueError("chat_prompts and chat_completions come together")
        sizes = {len(self.prompts), len(self.completions), *(len(c) for c in self.columns.values())}
        if self.chat_prompts is not None:
            sizes |= {len(self.chat_prompts), len(self.chat_completions or [])}
        if len(sizes) > 1:
            raise ValueError(f"a reward batch's arguments differ in length: {sorted(sizes)}")

    def __len__(self) -> int:
        return len(self.completions)

    def part(self, samples: list[int]) -> RewardBatch:
        """The batch of these completions alone, in this order."""
        chat = self.chat_prompts is not None
        return RewardBatch(
            [self.prompts[i] for i in samples], [self.completions[i] for i in samples],
            {key: [column[i] for i in samples] for key, column in self.columns.items()},
            [self.chat_prompts[i] for i in samples] if chat else None,  # type: ignore[index]
            [self.chat_completions[i] for i in samples] if chat else None,  # type: ignore[index]
        )

    def groups(self) -> list[list[int]]:
        """The completions of each prompt: runs of consecutive completions of one prompt, as a step scores them."""
        runs: list[list[int]] = []
        for i, prompt in enumerate(self.prompts):
            if runs and self.prompts[runs[-1][0]] == prompt and (self.chat_prompts is None or self.chat_prompts[runs[-1][0]] == self.chat_prompts[i]):
                runs[-1].append(i)
            else:
                runs.append([i])
        return runs

    def arguments(self, text: bool) -> dict[str, Any]:
        """``prompts``, ``completions`` (as text when ``text``, else in TRL's shape) and the columns."""
        if text or self.chat_prompts is None:
            return {"prompts": self.prompts, "completions": self.completions, **self.columns}
        return {"prompts": self.chat_prompts, "completions": self.chat_completions, **self.columns}


class RewardLogs:
    """What reward functions log through `log_extra` (a column of the rollout table, one value per completion) and
    `log_metric` (a scalar, averaged over the step's calls)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.columns: dict[str, list[Any]] = {}
        self.metrics: dict[str, list[float]] = {}

    def for_samples(self, samples: list[int]) -> tuple[Callable[[str, list[Any]], None], Callable[[str, float], None]]:
        """``log_extra`` and ``log_metric`` for a call given these samples of the batch."""

        def log_extra(column: str, values: list[Any]) -> None:
            values = list(values)
            if len(values) != len(samples):
                raise ValueError(f"log_extra({column!r}): {len(values)} values for {len(samples)} completions")
            logged = self.columns.setdefault(str(column), [None] * self.size)
            for i, value in zip(samples, values, strict=True):
                logged[i] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)  # plain data

        def log_metric(name: str, value: float) -> None:
            self.metrics.setdefault(str(name), []).append(float(value))

        return log_extra, log_metric
