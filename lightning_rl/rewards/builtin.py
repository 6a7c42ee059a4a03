"""Built-in reward functions.

A reward function names the arguments it needs (`prompts`, `completions`, a data column such as
`answer`, `tool_calls`, ...; see `scoring.py`), gets each as a list with one entry per completion, and
returns one float per completion. The built-ins name exactly what they read, so a recipe kwarg they
do not take is refused, and each runs on an empty batch (which is how their kwargs are checked). They read
completions as text (their annotations say so: `Sequence[str]`), whatever the shape of the prompts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from lightning_rl.rewards.model import RewardModel

# A number, thousands separated by commas or not (GSM8K's answers above 999 are often written "1,234").
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")
_SEPARATED = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(completion: str) -> str | None:
    """The answer a completion gives: inside `\\boxed{}`, else `<answer>` tags, else the last number."""
    for pattern in (_BOXED, _ANSWER_TAG):
        found = pattern.findall(completion)
        if found:
            return found[-1].strip()
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def _number(text: Any) -> float | None:
    """The value of a number (``1,234`` read as 1234), None for anything else."""
    if isinstance(text, str) and _SEPARATED.fullmatch(text.strip()):
        text = text.replace(",", "")
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def _matches(completion: str, expected: Any) -> bool:
    if (wanted := _number(expected)) is None:  # a textual answer ("1 7 0 4") must be the whole reply
        return " ".join(completion.split()) == " ".join(str(expected).split())
    given = _number(extract_answer(completion))
    return given is not None and math.isclose(given, wanted, rel_tol=1e-6, abs_tol=1e-9)


def math_answer(completions: Sequence[str], answer: Sequence[Any]) -> list[float | None]:
    """1.0 where the completion's answer equals the `answer` column: numerically for a numeric
    answer, as the whole (whitespace-normalised) reply otherwise. None (no score) where the row's answer is null
    (a Parquet file's missing value): a reply is not checked against the text "None"."""
    return [None if a is None else 1.0 if _matches(c, a) else 0.0 for c, a in zip(completions, answer, strict=True)]


def format_match(completions: Sequence[str], pattern: str = r"<answer>.*?</answer>") -> list[float]:
    """1.0 where the regular expression `pattern` matches at the start of the completion."""
    regex = re.compile(pattern, re.DOTALL)
    return [1.0 if regex.match(c) else 0.0 for c in completions]


def tool_call_validity(
    completions: Sequence[str], tool_calls: Sequence[Sequence[Any]], no_call_score: float = 0.0
) -> list[float]:
    """Fraction of a rollout's tool calls that parsed, validated and ran; `no_call_score` if none.

    `tool_calls` holds, per completion, the outcome records of the tool-call loop (dicts whose
    `failure` is None for a call that succeeded)."""
    scores = []
    for calls in tool_calls:
        if not calls:
            scores.append(no_call_score)
        else:
            scores.append(sum(1.0 for call in calls if call["failure"] is None) / len(calls))
    return scores


def overlong_penalty(completion_ids: Sequence[Sequence[int]], max_length: int, cache: int) -> list[float]:
    """DAPO's soft overlong punishment: 0 up to ``max_length - cache`` completion tokens, then falling linearly to
    -1 at ``max_length``, and -1 beyond (set ``max_length`` to the run's ``max_new_tokens``). With tools, a
    completion's ids hold every turn and the tools' answers between them (as TRL's do), while ``max_new_tokens``
    bounds each reply: set ``max_length`` to the length a whole conversation may reach. TRL:
    ``get_soft_overlong_punishment(max_completion_len, soft_punish_cache)``."""
    if not (isinstance(max_length, int) and isinstance(cache, int)):
        raise ValueError(f"max_length and cache must be integers (kwargs), got {max_length!r} and {cache!r}")
    if not 0 < cache <= max_length:
        raise ValueError(f"cache must be in [1, max_length={max_length}], got {cache}")
    scores = []
    for ids in completion_ids:
        free = max_length - cache
        scores.append(0.0 if len(ids) <= free else -1.0 if len(ids) > max_length else (free - len(ids)) / cache)
    return scores


BUILTIN_REWARDS = {
    "math_answer": math_answer,
    "format": format_match,
    "tool_call_validity": tool_call_validity,
    "overlong_penalty": overlong_penalty,
    "reward_model": RewardModel,
}
