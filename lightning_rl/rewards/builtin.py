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
from fractions import Fraction
from typing import Any

from lightning_rl.rewards.model import RewardModel

# A number: thousands separated by commas or not (GSM8K's answers above 999 are often written "1,234"), a decimal, a
# power of ten (`1e3`), `.5`; a fraction `a/b` or `\frac{a}{b}` is one. Its minus is a sign only where no letter or
# digit comes right before it (`10-15` holds 10 and 15), and an exponent (`10^6`, `2^{10}`) or a number after `/` is
# no number of its own. Letters may touch it: `12km`, `答案是18`.
_DECIMAL = r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d{1,3}(?!\d))?"
_FRACTION = rf"\\frac\{{(-?{_DECIMAL})\}}\{{(-?{_DECIMAL})\}}|({_DECIMAL})(?:\s*/\s*({_DECIMAL}))?"
_NUMBER = re.compile(rf"(?:(?<![\w.])-)?(?<![\d.^/])(?<!\^\{{)(?:{_FRACTION})")
# A whole answer that is one number: a decimal or fraction, signed, `%` at most after it; not a number among words
# or an expression (`5 million`, `2x`, `x+10`, `n-1`, `3!`, `Option 2`).
_ONE_NUMBER = re.compile(rf"(-?)(?:{_FRACTION})\s*%?\.?")
_BRACES = re.compile(r"\\(?:boxed|fbox)\{|[{}]")
# Text written differently that means the same: LaTeX's spacing, \left and \right, \text{...}, `{,}`, dollar signs,
# inline-math delimiters, the unicode minus, a leading "the final answer is".
_NORMALISE = (
    (re.compile(r"\\(?:text\w*|math\w+|mbox|displaystyle)\{([^{}]*)\}"), r"\1"),
    (re.compile(r"\^\s*\{?\\circ\}?|°"), ""),
    (re.compile(r"\\[dt]frac(?![a-zA-Z])"), r"\\frac"),
    (re.compile(r"\\[,!;:()\[\]]|\\(?:left|right)(?![a-zA-Z])|\\?\$"), ""),
    (re.compile(r"\{,\}"), ","),
    (re.compile(r"\\%"), "%"),
    (re.compile("\u2212"), "-"),
    (re.compile(r"\\ |\s+"), " "),
    (re.compile(r" ?, ?"), ","),
    (re.compile(r"^\s*\{([^{}]*)\}\s*$"), r"\1"),
    (re.compile(r"^\s*(?:the\s+)?(?:final\s+)?answer\s*(?:is|:)\s*", re.IGNORECASE), ""),
)
_ASSIGNMENT = re.compile(r"[a-zA-Z]\s*=\s*")  # `x = 3`: the answer is 3


def _normalised(text: str) -> str:
    """A text as it is compared: `_NORMALISE`d, stripped, and without a leading single-variable assignment."""
    for pattern, replacement in _NORMALISE:
        text = pattern.sub(replacement, text)
    text = text.strip()
    return text[assigned.end():].strip() if (assigned := _ASSIGNMENT.match(text)) else text


def _boxed(completion: str) -> str | None:
    """The inside of the last `\\boxed{...}` or `\\fbox{...}` whose braces close and which holds something, read in
    one pass over the braces."""
    opened: list[int | None] = []  # where each open brace's box starts, None for a brace of no box
    last = None
    for brace in _BRACES.finditer(completion):
        if brace.group() != "}":
            opened.append(None if brace.group() == "{" else brace.end())
        elif opened and (start := opened.pop()) is not None and (last is None or start > last[0]) and completion[start:brace.start()].strip():
            last = (start, brace.start())
    return None if last is None else completion[last[0] : last[1]]


def _enclosed(completion: str) -> str | None:
    """The inside of the last box, else of the last closed `<answer>...</answer>` pair; None where there is neither."""
    if (boxed := _boxed(completion)) is not None:
        return boxed.strip()
    close = completion.rfind("</answer>")
    open_ = completion.rfind("<answer>", 0, max(close, 0))
    return completion[open_ + len("<answer>") : close].strip() if close >= 0 and open_ >= 0 else None


def _replied(completion: str) -> str:
    """What a completion says after its reasoning: the text after its last `</think>` (a box among the thoughts is
    no answer), or all of it."""
    return completion.rpartition("</think>")[2]


def _last_number(text: str) -> str | None:
    numbers = list(_NUMBER.finditer(text.replace("\u2212", "-")))
    return numbers[-1].group() if numbers else None


def extract_answer(completion: str) -> str | None:
    """The answer a completion gives after its reasoning: inside `\\boxed{}`, else `<answer>` tags, else the last
    number."""
    completion = _replied(completion)
    enclosed = _enclosed(completion)
    return enclosed if enclosed is not None else _last_number(completion)


def _value(text: str) -> Fraction | str | None:
    """The number a whole answer is (`_ONE_NUMBER`, read exactly: `0.1` is 1/10), else its normalised text; None for
    `a/0` or a number longer than Python reads (4300 digits)."""
    text = _normalised(text)
    if not (found := _ONE_NUMBER.fullmatch(text)):
        return text
    sign, *parts = found.groups()
    top, bottom = (part.replace(",", "") for part in (parts[0] or parts[2], parts[1] or parts[3] or "1"))
    try:
        return (-1 if sign else 1) * Fraction(top) / Fraction(bottom)
    except (ValueError, ZeroDivisionError):
        return None


def _gold(answer: Any) -> tuple[Fraction | str, bool] | None:
    """A row's answer as compared, and whether it was a float (a computed value, matched to 1e-6); None for a missing
    one (null, NaN, empty). A bool is its text (`True`)."""
    if answer is None or (isinstance(answer, float) and math.isnan(answer)):
        return None
    if isinstance(answer, float) and math.isfinite(answer):
        return Fraction(answer), True
    answer = str(answer).rpartition("####")[2]  # GSM8K's answer column: the worked solution, then "#### 72"
    value = _value(answer)
    return None if value in ("", None) else (value, False)


def _equal(given: Fraction | str | None, gold: Fraction | str, approximate: bool) -> bool:
    if approximate and isinstance(given, Fraction) and isinstance(gold, Fraction) and not given.denominator == gold.denominator == 1:
        return math.isclose(given, gold, rel_tol=1e-6, abs_tol=1e-9)  # whole numbers exactly: 999999 is not 1e6
    return given == gold


def _matches(completion: str, gold: Fraction | str, approximate: bool) -> bool:
    completion = _replied(completion)
    if (given := _enclosed(completion)) is None:
        if isinstance(gold, str):
            return _normalised(completion) == gold  # a textual answer ("1 7 0 4") must be the whole reply
        given = _last_number(completion)
    return given is not None and _equal(_value(given), gold, approximate)


def math_answer(completions: Sequence[str], answer: Sequence[Any]) -> list[float | None]:
    """1.0 where the completion's answer equals the `answer` column, else 0.0. The completion's answer is the inside
    of its last `\\boxed{}` (or `\\fbox{}`, braces balanced), else of its last `<answer>...</answer>`, else its last
    number, read after its last `</think>`. An answer that is one number (`1,234`, `0.5`, `.5`, `1e3`, `1/2`,
    `\\frac{1}{2}`, signed, `%` at most after it) is compared as that number, exactly (a float answer, a computed
    value, to 1e-6, whole numbers exactly); any other (`5 million`, `2x`, `x+10`, `\\sqrt{2}`, `(3, 4)`) as its text,
    normalised (LaTeX spacing, `\\left`/`\\right`, `\\text{}` and `\\mathbf{}`, degrees, `{,}`, `$`, spaces by
    commas, a leading `x =` or "the final answer is", whitespace); the answer column's text after a `####` (GSM8K's);
    a textual answer with no boxed or tagged answer must be the whole reply. None (no score) where the row's answer
    is null, NaN or empty (a Parquet file's or pandas' missing value): a reply is not checked against the text "None".
    A bool answer is its text (`True`)."""
    golds = [_gold(a) for a in answer]
    return [None if g is None else 1.0 if _matches(c, *g) else 0.0 for c, g in zip(completions, golds, strict=True)]


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
