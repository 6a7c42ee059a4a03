"""A resume trains on the run it resumes: the recipe it was trained with, not another one; a leaf.

Each checkpoint keeps the resolved recipe of the run that wrote it. A resume compares its own recipe with that one,
key by key, and refuses a changed key unless the key is one of ``SAFE``: what a run may change without changing what
it trains (how long it runs, what it logs, saves and evaluates, where its engine lives, and memory or speed settings
that compute the same numbers up to rounding: a chunk size, an attention backend or compilation sums in another order,
and can change a weight's last bits). A changed seed, batch, data file, sampling setting or gradient clip would make the
resumed run a different one, silently; it is one line naming every changed key instead. A checkpoint written before
checkpoints kept their recipe is compared by its optimizer keys alone (``PolicyModule.on_load_checkpoint``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

from lightning_rl import validation
from lightning_rl.errors import RecipeError

# Keys (dotted from the recipe's top; a block's name covers every key inside it) that a resume may change.
SAFE = re.compile(
    r"(?:output_dir|ckpt_path|overwrite|checkpoint_every_n_steps|keep_checkpoints|logger"
    r"|trainer\.(?:max_steps|max_epochs|max_time|min_steps|min_epochs|accelerator|enable_progress_bar|enable_model_summary|detect_anomaly"
    r"|enable_checkpointing|log_every_n_steps|val_check_interval|check_val_every_n_epoch|limit_val_batches"
    r"|num_sanity_val_steps|default_root_dir|callbacks|profiler|logger)"
    r"|model\.(?:eval_data|eval_generations|eval_max_new_tokens|max_new_tokens|log_rollouts_every_n_steps|summary_window"
    r"|export|verify_packing|verify_packing_every|mismatch_alarm_kl|attention_backend|chunk_size|compile"
    r"|gradient_checkpointing|offload_activations|engine|push_in_background|reward_timeout_s|tool_timeout_s)"
    r"|data\.(?:val_data|num_workers))(?:\..*)?"
)


def leaves(recipe: Any, key: str = "") -> dict[str, Any]:
    """The recipe's values by dotted key; a list, and an empty block, is one value."""
    if not isinstance(recipe, dict) or not recipe:
        return {key: recipe}
    found: dict[str, Any] = {}
    for name, value in recipe.items():
        found.update(leaves(value, f"{key}.{name}" if key else str(name)))
    return found


def changed(saved: str, here: str) -> list[tuple[str, Any, Any]]:
    """(key, saved value, value here) for each key that both recipes hold, with another value here, that a resume
    may not change."""
    theirs, ours = (leaves(yaml.safe_load(text) or {}) for text in (saved, here))
    return [(key, theirs[key], value) for key, value in ours.items() if key in theirs and not SAFE.fullmatch(key) and not _same(key, theirs[key], value)]


def _same(key: str, before: Any, now: Any) -> bool:
    """Whether two values of ``key`` mean the same: equal once typed (the command line gives ``devices`` as the
    string "1", a recipe as the number), the same precision by another of its names, or the same file by another path
    (relative or absolute, from another working directory: a path that no longer exists was moved to the new one; not
    a Hub id or the embedded model's name, which a local folder does not replace)."""
    if _typed(before) == _typed(now):
        return True
    if key == "trainer.precision":
        try:
            return validation.precision(before) == validation.precision(now)
        except RecipeError:
            return False
    if isinstance(before, str) and isinstance(now, str) and os.path.exists(now):
        if os.path.exists(before):
            return os.path.samefile(before, now)
        # Moved (a data file's rows are compared apart: `data.sft.rows_digest`), where it was a path: an absolute or
        # explicitly relative one, or one of several parts the new path ends with (the same folder, from another
        # working directory; a bare name, ``tiny`` or ``gpt2``, is a model's name as much as a folder's).
        # A Hub id (``Qwen/Qwen3-0.6B``) or the embedded model (``tiny``) is another model than a local folder.
        old = Path(before)
        return (key.startswith("data.") or old.is_absolute() or before.startswith(("./", "../", "~"))
                or (len(old.parts) > 1 and Path(now).resolve().parts[-len(old.parts):] == old.parts))
    return False


def _typed(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return yaml.safe_load(value)
        except yaml.YAMLError:
            return value
    return value


def check_same_run(saved: str | None, here: str, ckpt_path: Any) -> None:
    """Refuse a resume whose recipe changes a key the run it resumes was trained with (``saved``; None: an older
    checkpoint, which kept no recipe)."""
    if saved is None:
        return
    if differences := changed(saved, here):
        said = "; ".join(_said(*found) for difference in differences for found in _narrowed_or_whole(*difference))
        raise RecipeError(
            f"{said}: ckpt_path: {ckpt_path} resumes a run that another value would make a different run; give the "
            "run's values, or start a new run (another output_dir, or --overwrite)",
        )  # no key: each is named from the recipe's top already (a module's key would be read from inside its block)


# What a list or mapping here, or in the run, does not hold at a place the other one does.
_ABSENT = object()


def _narrowed(key: str, before: Any, now: Any) -> list[tuple[str, Any, Any]]:
    """(key, saved value, value here) of the items that differ, where a list or mapping changed in part
    (``model.rewards[1].weight``): both whole values, cut to a line, may read the same. A list that grew or shrank
    keeps its alike items at both ends; those between are compared in pairs, and those left over are the ones added
    here or removed (``_ABSENT`` on the other side), named by their place in the list that holds them."""
    if isinstance(before, list) and isinstance(now, list):
        head = 0
        while head < min(len(before), len(now)) and _typed(before[head]) == _typed(now[head]):
            head += 1
        tail = 0
        while tail < min(len(before), len(now)) - head and _typed(before[-1 - tail]) == _typed(now[-1 - tail]):
            tail += 1
        old, new = before[head:len(before) - tail], now[head:len(now) - tail]
        pairs = [(old[i] if i < len(old) else _ABSENT, new[i] if i < len(new) else _ABSENT) for i in range(max(len(old), len(new)))]
        return [found for i, (then, later) in enumerate(pairs) if _typed(then) != _typed(later) for found in _narrowed(f"{key}[{head + i}]", then, later)]
    if isinstance(before, dict) and isinstance(now, dict):
        return [found for name in dict.fromkeys([*before, *now]) if _typed(before.get(name, _ABSENT)) != _typed(now.get(name, _ABSENT))
                for found in _narrowed(f"{key}.{name}", before.get(name, _ABSENT), now.get(name, _ABSENT))]
    return [(key, before, now)]


def _narrowed_or_whole(key: str, before: Any, now: Any) -> list[tuple[str, Any, Any]]:
    return _narrowed(key, before, now) or [(key, before, now)]  # items alike once typed: the whole values, as found


def _said(key: str, before: Any, now: Any) -> str:
    """One changed key, as the refusal names it: both values, or the one value of an item added or removed."""
    if before is _ABSENT:
        return f"{key}={_shown(now)} here, not in the run"
    if now is _ABSENT:
        return f"{key}={_shown(before)} in the run, not here"
    shown_now, shown_before = _shown_apart(now, before)
    return f"{key}={shown_now} here, {shown_before} in the run"


def _shown_apart(one: Any, other: Any) -> tuple[str, str]:
    """Two values shown as ``_shown`` shows each, where that reads differently; where both would be cut to the same
    text, each is shown from the word some 20 to 40 characters before the first one where they differ, the common
    start elided."""
    texts = [_dumped(one), _dumped(other)]
    shown = [_cut(text) for text in texts]
    if shown[0] != shown[1]:
        return shown[0], shown[1]
    common = len(os.path.commonprefix(texts))
    start = max(texts[0].rfind(" ", 0, common - 20) + 1, common - 40)  # both cut alike: at least 77 alike
    return _cut("..." + texts[0][start:]), _cut("..." + texts[1][start:])


def _shown(value: Any) -> str:
    return _cut(_dumped(value))


def _dumped(value: Any) -> str:
    """A value as YAML writes it; a number recorded as text (``'2'``, as the command line gives it) as the number,
    as the comparison reads it."""
    if isinstance(value, str) and re.fullmatch(r"-?(0|[1-9]\d*)(\.\d+)?", value):  # not YAML 1.1's octal or 1:30
        value = _typed(value)
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def _cut(text: str) -> str:
    return text if len(text) <= 80 else text[:77] + "..."
