"""SFT data: read and check rows, render them with the tokenizer's chat template, pack them into rows.

Three row shapes are accepted:
- ``{"messages": [{"role": ..., "content": ...}, ...]}``: every assistant turn is trained;
- ``{"prompt": ..., "completion": ...}``: both strings, or both lists of messages; only the completion
  is trained;
- ``{"text": ...}``: plain text (TRL's language-modelling rows), every token trained, the end token appended.

Every row is checked and tokenized in ``setup`` before any training step runs, so a bad row stops
the run with one message naming the file and line (or row), before anything is written.
"""

from __future__ import annotations

import array
import codecs
import dataclasses
import hashlib
import heapq
import importlib
import inspect
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, Sampler
from transformers import AutoTokenizer, PreTrainedTokenizerBase, ProcessorMixin

from lightning_rl import validation
from lightning_rl.errors import BatchingChanged, DataError, RecipeError, RowsChanged
from lightning_rl.models.loading import end_of_turn_ids, saved_generation_config
from lightning_rl.models.multimodal import load_processor, position_rule
from lightning_rl.models.paths import learned_positions, resolve_model_path
from lightning_rl.toy.shapes import toy_source
from lightning_rl.data.images import (
    ImageRenderer, check_no_image_tokens, image_key, image_source, images_of, keyed_image_ids, load_images, row_has_images,
    with_image_column,
)
from lightning_rl.data.templates import rendering_row
from lightning_rl.data.workers import WorkerLoader
from lightning_rl.packing.images import pack_with_images
from lightning_rl.packing.planner import PrefixAcrossRows, RowPrefix, plan_batch_rows, plan_ordered_rows
from lightning_rl.packing.tree import PackedBatch, common_prefix, count_unique_tokens, pack_sequences
from lightning_rl.device_policy import ddp_static_graph, resolve_pad_to_multiple_of, wraps_in_ddp

ROLES = ("system", "user", "assistant", "tool")
_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
Packing = Literal["auto", "tree", "flat", "none"]




def check_same_batching(saved: dict[str, Any] | None, here: dict[str, Any]) -> None:
    """Refuse a resume whose data settings (``data.KEY`` by key) would cut other batches than the run's (``saved``;
    None: an older checkpoint, which kept none)."""
    if changed := [key for key in saved or {} if key in here and saved[key] != here[key]]:
        raise BatchingChanged(
            "; ".join(f"data.{key}={here[key]!r} here, {saved[key]!r} in the run" for key in changed) + ": the run being resumed "
            "cut its rows into other batches, so it would resume at other rows; give the run's values, or start a new run")


def limited_batches(trainer: Any, batches: int) -> int:
    """An epoch's training batches once ``trainer.limit_train_batches`` applies, as Lightning counts them: a number of
    batches caps the epoch, a fraction scales it (rounded down)."""
    limit = trainer.limit_train_batches
    return min(batches, limit) if isinstance(limit, int) and not isinstance(limit, bool) else int(batches * limit)


def rows_digest(rows: Iterator[Any]) -> str:
    """A digest of the rows a run trains on, which a checkpoint keeps: a resume on other rows under the same path (a
    data file replaced, a tokenizer or template changed in place) is told from the run's own."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, default=_digestible).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def _digestible(value: Any) -> Any:
    """A value JSON does not hold, as its content: bytes, an image or array by its bytes, a tensor by its values."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().contiguous().numpy()
    if isinstance(value, (bytes, bytearray)) or hasattr(value, "tobytes"):
        raw = bytes(value) if isinstance(value, (bytes, bytearray)) else value.tobytes()
        return [type(value).__name__, str(getattr(value, "shape", getattr(value, "size", ""))), hashlib.sha256(raw).hexdigest()]
    if isinstance(value, (set, frozenset)):
        return sorted(map(str, value))
    return str(value)


def check_same_rows(key: str, source: Any, saved: str | None, here: str) -> None:
    """Refuse a resume whose data holds other rows than those the run trained on (``saved``; None: an older
    checkpoint, which kept no digest)."""
    if saved is not None and saved != here:
        raise RowsChanged(
            f"{key}: {source} holds other rows than the run being resumed trained on (the file was changed or replaced, "
            "or the tokenizer or its template was): resume with the run's data, or start a new run (another output_dir, or --overwrite)"
        )


@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[bool]
    # Each image of the row, in order: (a key naming its pixels, its processor inputs).
    images: list[tuple[str, dict[str, torch.Tensor]]] = field(default_factory=list)
    image_token_id: int | None = None

    @property
    def packing_ids(self) -> list[int]:
        """The ids the row planner counts: each image's placeholders apart from any other image's."""
        return keyed_image_ids(self.input_ids, [key for key, _ in self.images], self.image_token_id) if self.images else self.input_ids


@dataclass
class GenerationCase:
    """A held-out prompt and the completion a greedy decode should reproduce exactly."""

    prompt_ids: list[int]
    reference: str
    images: list[dict[str, torch.Tensor]] = field(default_factory=list)  # the prompt's images' processor inputs
    where: str = ""  # the row it comes from (``FILE: line N``), for error lines


# A file, a `datasets.save_to_disk` folder, or (from Python) a `datasets.Dataset` or a list of rows. Typed so that a
# command line's `2024` stays a file's name, and Any so recipes may give null.
DataSource = Union[str, Any]


# Files of formats that are not read (every other suffix is read as JSON Lines), by what they are.
_UNREAD_FORMATS = {
    ".csv": "a CSV file", ".tsv": "a TSV file", ".gz": "a compressed file", ".bz2": "a compressed file", ".xz": "a compressed file",
    ".zst": "a compressed file", ".zip": "a zip archive", ".tar": "a tar archive", ".arrow": "an Arrow file", ".feather": "an Arrow file",
}  # fmt: skip


def _source_problem(path: Path, key: str | None = None) -> str | None:
    """Why a file or folder is not one ``read_rows`` reads, or None: a file of a format it does not read, or a folder
    ``datasets.save_to_disk`` did not write for a single split (for ``key``, the split meant: train, or held out)."""
    if not path.is_dir() and not path.is_file():
        return "not a regular file (a pipe or a device, which can be read only once); save the rows to a file first"
    if not path.is_dir():
        what = _UNREAD_FORMATS.get(path.suffix.lower())
        return f"{what} is not read; give a .jsonl, .json or .parquet file, or a folder `datasets.save_to_disk` wrote" if what else None
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        held_out = key is not None and key.endswith(("val_data", "eval_data"))
        meant = [s for s in (("validation", "valid", "val", "test", "eval") if held_out else ("train",)) if s in splits]
        shown = f" ({path / meant[0]})" if meant else f": {', '.join(str(path / s) for s in splits)}"
        return f"a dataset of splits ({', '.join(splits)}), not one split; give one split's folder{shown}" if splits else \
            "a dataset of splits, none saved in it"
    if not (path / "dataset_info.json").is_file():
        return "a folder, but not one `datasets.save_to_disk` wrote (no dataset_info.json); give a .jsonl, .json or .parquet file, or such a folder"
    return None


# TRL's eval split given as a share of the training data (a number, or a file name that reads as one).
_SHARE_HINT = "; a share of the training data is not split off here: give the held-out rows as a file of their own"


def check_source(key: str, source: DataSource) -> None:
    """A data file or folder that exists and is one ``read_rows`` reads, or a dataset or rows given from Python (checked
    before anything loads)."""
    if source is None:
        return
    if not isinstance(source, (str, os.PathLike)):
        if type(source).__name__ == "DataFrame":  # iterated, it gives its column names
            raise DataError(f"{key}: a pandas DataFrame: give datasets.Dataset.from_pandas(frame), or frame.to_dict('records')", key)
        if type(source).__name__ in ("DatasetDict", "IterableDatasetDict"):
            raise DataError(f"{key}: a {type(source).__name__} of splits ({', '.join(source)}), not one split: give one of them, "
                            f"e.g. dataset[{next(iter(source), 'train')!r}]", key)
        rows = isinstance(source, (list, tuple)) and all(isinstance(row, dict) for row in source)
        if isinstance(source, (bool, int, float, dict)) or (isinstance(source, (list, tuple)) and not rows) or not hasattr(source, "__iter__"):
            quote = f" (quote it, '{source}', for a file of that name)" if isinstance(source, (int, float)) and not isinstance(source, bool) else ""
            if isinstance(source, float) and 0 < source < 1:
                quote += _SHARE_HINT
            raise DataError(
                f"{key} must be one data file or folder (JSONL, JSON, Parquet or a saved dataset), got {type(source).__name__} "
                f"{_shown(source)}{quote}; several files are one file or one saved dataset joined", key,
            )
        return
    path = Path(source).expanduser()
    if not path.exists():
        hub = ("; a Hub dataset is not downloaded here: save one split of it with datasets' save_to_disk and give that folder"
               if re.fullmatch(r"[\w.-]+/[\w.-]+", str(source)) and not path.suffix else "")  # trl-lib/Capybara
        if re.fullmatch(r"0?\.\d+", str(source)):
            hub = _SHARE_HINT
        raise DataError(f"{key}: no such file or folder: {source}{validation.resolved_against(path)}{hub}", key)
    if (problem := _source_problem(path, key)):
        raise DataError(f"{key}: {source}: {problem}", key)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _read_jsonl(path: Path) -> list[tuple[str, Any]]:
    rows = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")  # a leading byte-order mark (Notepad's) is no text
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: line {line_no}: not valid UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})") from None
            if not line.strip():
                continue
            try:
                rows.append((f"line {line_no}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {line_no}: invalid JSON ({e.msg})") from None
            if "\\ud" in line.lower():
                _refuse_lone_surrogate(path, f"line {line_no}", rows[-1][1])
    return rows


def _refuse_lone_surrogate(path: Path, where: str, row: Any) -> None:
    if field := _lone_surrogate(row):
        raise DataError(f"{path}: {where}: {field} holds a lone surrogate escape (\\ud800 to \\udfff alone), which is no character")


def _lone_surrogate(value: Any, field: str = "") -> str | None:
    """Where in a row read from JSON a string holds half of a surrogate pair (``"\\ud800"`` is valid JSON, but no
    character: no tokenizer takes it), as `messages[1].content`; None if nowhere."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"`{field}`" if field else "the row"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, member in items:
        if where := _lone_surrogate(member, f"{field}[{key}]" if isinstance(key, int) else f"{field}.{key}" if field else str(key)):
            return where
    return None


def _opens_with(path: Path, start: bytes) -> bool:
    """Whether the file's first character other than white space is ``start``."""
    with open(path, "rb") as f:
        first = True
        while chunk := f.read(1 << 16):
            if first:
                chunk, first = chunk.removeprefix(codecs.BOM_UTF8), False
            if stripped := chunk.lstrip():
                return stripped.startswith(start)
    return False


def _read_json(path: Path) -> list[Any] | None:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line_no = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}: line {line_no}: not valid UTF-8") from None
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data" and text.lstrip().startswith("{"):  # one object after another: JSON Lines
            return None
        raise DataError(f"{path}: line {e.lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: a .json data file must hold a list of rows")
    if "\\ud" in text.lower():
        for i, row in enumerate(rows, start=1):
            _refuse_lone_surrogate(path, f"row {i}", row)
    return rows


def _without_filled_arguments(row: Any) -> Any:
    """A row read from Arrow (Parquet, ``datasets``) with the keys each of its objects gave: Arrow stores the objects
    of a column as one struct, so a tool-call's arguments get every other call's argument names, a tool's schema
    every other tool's parameters, and ``chat_template_kwargs`` every other row's, as null (a null a row really gave
    is indistinguishable, and left out as well)."""
    if not isinstance(row, dict):
        return row
    for column in ("messages", "prompt", "completion"):
        messages = row.get(column)
        for message in messages if isinstance(messages, list) else ():
            for call in (message.get("tool_calls") or ()) if isinstance(message, dict) else ():
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict) and isinstance(function.get("arguments"), dict):
                    function["arguments"] = _without_nulls(function["arguments"])
    for column in ("tools", "chat_template_kwargs"):
        if isinstance(row.get(column), (dict, list)):
            row[column] = _without_nulls(row[column])
    return row


def _without_nulls(value: Any) -> Any:
    """``value`` with every null member of its objects left out, at any depth."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def source_name(source: DataSource) -> str:
    """A data source as error lines name it: a file or folder by its path, a dataset given from Python by its name
    (else its type: ``Dataset``, ``list``)."""
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    return getattr(getattr(source, "info", None), "dataset_name", None) or type(source).__name__


def read_rows(source: DataSource, key: str | None = None) -> tuple[str, list[tuple[str, Any]]]:
    """(name used in error messages, rows) from JSONL, JSON, Parquet, a saved dataset folder or a Dataset (named by the
    ``key`` it was given as too: a path says which it is, a ``Dataset`` does not). Each row comes with where it is, for
    messages: its line in a JSONL file, else ``row N`` counted from 1."""
    if not isinstance(source, (str, os.PathLike)):
        arrow = type(source).__module__.split(".")[0] == "datasets"  # a Dataset; not the caller's own rows, left as given
        rows = [_without_filled_arguments(row) if arrow else row for row in source]
        name = f"{key} ({source_name(source)})" if key else source_name(source)
        return name, [(f"row {i}", row) for i, row in enumerate(rows, start=1)]
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(f"{path}: no such file or folder{validation.resolved_against(path)}")
    if (problem := _source_problem(path, key)):
        raise DataError(f"{path}: {problem}")
    suffix = path.suffix.lower()  # train.JSON, train.Parquet
    if path.is_file() and _opens_with(path, b"PAR1"):  # Parquet by its magic bytes, whatever its name (train.pq)
        suffix = ".parquet"
    lines = suffix == ".jsonl" or (path.is_file() and suffix not in (".json", ".parquet"))
    if lines and not _opens_with(path, b"["):
        return str(path), _read_jsonl(path)
    try:
        if lines:  # a JSON array under a JSON Lines name, as `datasets` reads it too
            rows = _read_json(path)
        elif path.is_dir():
            datasets = _data_package("datasets", path)
            state = json.loads((path / "state.json").read_text()) if (path / "state.json").is_file() else {}
            # A saved dataset of no rows has no data file, which `load_from_disk` fails on (an IndexError).
            rows = [] if state.get("_data_files") == [] else [_without_filled_arguments(row) for row in datasets.load_from_disk(str(path))]
        elif suffix == ".parquet":
            datasets = _data_package("datasets", path)
            pyarrow = _data_package("pyarrow.parquet", path)

            # Through `datasets`, in memory: the file's own schema (a column `datasets` stores as JSON text, tools of
            # several shapes, say) comes back as the objects it wrote, as `load_dataset("parquet")` gives them. A
            # column type `datasets` has no feature for (Spark's maps) leaves the file to pyarrow alone.
            table = pyarrow.read_table(path)
            try:
                read = datasets.Dataset(table)
            except (ValueError, TypeError, NotImplementedError):
                read = table.to_pylist()
            rows = [_without_filled_arguments(row) for row in read]
        elif (rows := _read_json(path)) is None:  # JSON Lines in a .json file, as many datasets are saved
            return str(path), _read_jsonl(path)
    except (OSError, ValueError) as e:  # a damaged Parquet or Arrow file (pyarrow's errors are ValueErrors)
        if isinstance(e, DataError):
            raise
        raise DataError(f"{path}: cannot be read ({type(e).__name__}: {_first_line(e)})") from None
    return str(path), [(f"row {i}", row) for i, row in enumerate(rows, start=1)]


def _data_package(name: str, path: Path) -> Any:
    """``datasets`` or ``pyarrow.parquet``, which Parquet files and saved datasets need: one line without them."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise DataError(f"{path}: reading it needs the {name.split('.')[0]} package: pip install 'lightning-rl[data]'") from None


def _check_messages(messages: Any, field: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"`{field}` must be a non-empty list of messages")
    messages = list(messages)
    for k, message in enumerate(messages):
        where = f"`{field}[{k}]`"
        if not isinstance(message, dict):
            raise ValueError(f"{where} must be an object with `role` and `content`")
        role = message.get("role")
        if role not in ROLES:
            sharegpt = {"human": "user", "gpt": "assistant"}.get(role)  # the chat template knows no other names
            raise ValueError(f"{where}: unknown role {role!r} (expected one of {', '.join(ROLES)})" + (f"; ShareGPT's {role!r} is {sharegpt!r}" if sharegpt else ""))
        calls = message.get("tool_calls")
        if calls == "" or (isinstance(calls, float) and math.isnan(calls)):  # none, as a table stores it
            messages[k] = message = {key: value for key, value in message.items() if key != "tool_calls"}
            calls = None
        if isinstance(calls, str):  # a JSON string of them, as some datasets store them (`tools` too)
            try:
                calls = json.loads(calls)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: `tool_calls` is a string but not JSON ({e.msg})") from None
            messages[k] = message = {**message, "tool_calls": calls}
        if calls is not None and (not isinstance(calls, list) or not all(isinstance(call, dict) for call in calls)):
            raise ValueError(f"{where}: `tool_calls` must be a list of calls (objects)")
        weight = message.get("weight")
        if weight is None or (isinstance(weight, float) and math.isnan(weight)):  # none, as a table fills a turn without it
            messages[k] = message = {key: value for key, value in message.items() if key != "weight"}
        else:  # OpenAI's per-turn training flag: 0 leaves the reply out of the loss
            if role != "assistant" or isinstance(weight, bool) or weight not in (0, 1):
                raise ValueError(f"{where}: `weight` is an assistant turn's 0 (not trained) or 1 (trained), got {weight!r}"
                                 + ("" if role == "assistant" else f" on a {role} turn"))
        content = message.get("content")
        if role == "assistant" and message.get("tool_calls") and content in (None, ""):
            continue
        if isinstance(content, list) and role in ("user", "system"):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    continue
                if kind == "image" and image_source(part) is not None:
                    continue
                raise ValueError(f"{where}.content[{j}] must be {{\"type\": \"text\", \"text\": ...}} or {{\"type\": \"image\", \"image\": PATH_OR_URL}}")
            continue
        if isinstance(content, list) and any(isinstance(part, dict) and part.get("type") == "image" for part in content):
            raise ValueError(f"{where}: an image in {'an' if role[0] in 'aeiou' else 'a'} {role} turn; images go in user (or system) turns")
        if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content):
            # Text parts (how Parquet and `datasets` store every turn of an image conversation): the turn's text.
            content = "".join(part["text"] for part in content)
            messages[k] = message = {**message, "content": content}
        if not isinstance(content, str):
            raise ValueError(f"{where}: `content` must be a string, got {type(content).__name__}")
        if role == "assistant" and not content.strip():
            raise ValueError(f"{where}: the assistant turn is empty")
    if not any(isinstance(m.get("content"), list) and any(p["type"] == "image" for p in m["content"]) for m in messages):
        # A conversation without images: a user or system turn of text parts is its text (a text-only template
        # renders strings); an image conversation keeps them, as its processor's template reads them.
        messages = [{**m, "content": "".join(p["text"] for p in m["content"])} if isinstance(m.get("content"), list) else m
                    for m in messages]  # fmt: skip
    return messages


def _check_tools(tools: Any) -> list[dict]:
    """A row's ``tools`` column: the JSON schemas of the functions its conversation may call (a JSON string of them
    too, as some datasets store it), which the chat template renders, as TRL's SFT does."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise ValueError(f"`tools` is a string but not JSON ({e.msg})") from None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise ValueError("`tools` must be a list of function schemas (objects)")
    return tools


# Arguments of apply_chat_template itself, which a row's chat_template_kwargs may not set.
# What a row's template variables may not be named: the arguments of the tokenizer's and processor's
# apply_chat_template, as the installed transformers has them (a row's kwargs go beside them).
_RESERVED_TEMPLATE_KEYS = {"messages"} | {
    name for call in (PreTrainedTokenizerBase.apply_chat_template, ProcessorMixin.apply_chat_template)
    for name, p in inspect.signature(call).parameters.items() if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
}


def check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """A row's ``chat_template_kwargs``, checked: an object of the variables its chat template reads."""
    if not isinstance(kwargs, dict) or not all(isinstance(key, str) for key in kwargs) or _RESERVED_TEMPLATE_KEYS & set(kwargs):
        raise ValueError(f"`chat_template_kwargs` must be an object of the template's variables (not {', '.join(sorted(_RESERVED_TEMPLATE_KEYS))})")
    return kwargs


def _check_row(row: Any) -> dict:
    """The row with its shape checked; raises ValueError with a message naming the field."""
    if not isinstance(row, dict):
        raise ValueError(f"a row must be an object, got {type(row).__name__}")
    nulls = sorted(key for key, value in row.items() if value is None)
    row = {key: value for key, value in row.items() if value is not None}  # a column another row shape fills (Parquet)
    if "text" in row and not any(key in row for key in ("messages", "conversations", "prompt", "completion")):
        if any(key in row for key in ("images", "image")):
            raise ValueError("a plain `text` row cannot hold images: they go in a conversation's user turn (`messages`, "
                             "or conversational `prompt` and `completion`)")
    field = "conversations" if "conversations" in row and "messages" not in row else "messages"  # as the file names it
    row = with_image_column(_as_chatml(row))
    tools = _check_tools(row["tools"]) if "tools" in row else None
    if tools and not ("messages" in row or isinstance(row.get("prompt"), list)):
        raise ValueError("`tools` are rendered by the chat template: give the row as `messages` (or as conversational `prompt` and `completion`)")
    kwargs = check_template_kwargs(row.get("chat_template_kwargs", {}))
    if kwargs and not ("messages" in row or isinstance(row.get("prompt"), list)):
        raise ValueError("`chat_template_kwargs` are read by the chat template: give the row as `messages` (or as conversational `prompt` and `completion`)")
    extra = {**({"tools": tools} if tools else {}), **({"chat_template_kwargs": kwargs} if kwargs else {})}
    if "messages" in row and "completion" in row:  # two conversations to train: which one is not ours to guess
        raise ValueError("the row has both `messages` and `completion`: give one shape, `messages` or `prompt` and `completion`")
    if "messages" in row:
        messages = _check_messages(row["messages"], field)
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"`{field}` has no assistant turn to train on")
        return {"messages": messages, **extra}
    if "text" in row and "prompt" not in row and "completion" not in row:
        if not isinstance(row["text"], str):
            raise ValueError(f"`text` must be a string, got {type(row['text']).__name__}")
        if not row["text"].strip():
            raise ValueError("`text` is empty" if not row["text"] else "`text` holds only whitespace")
        return {"text": row["text"]}
    if "text" in row and ("prompt" in row) != ("completion" in row):
        given = "prompt" if "prompt" in row else "completion"
        raise ValueError(f"the row has `text` and `{given}` but no `{'completion' if given == 'prompt' else 'prompt'}`: give one shape, "
                         "`text` alone or `prompt` and `completion`")
    if "prompt" not in row or "completion" not in row:
        null = [key for key in nulls if key in ("messages", "prompt", "completion") or key == "text" and "prompt" not in row and "completion" not in row]
        raise ValueError(f"`{null[0]}` is null" if null and ("messages" in null or "prompt" in row or "completion" in row or "text" in null) else
                         f"missing `messages` (or both `prompt` and `completion`, or `text`); the row has {', '.join(map(repr, sorted(row))) or 'no columns'}")
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion.strip():
            raise ValueError("`completion` is empty")
        return {"prompt": prompt, "completion": completion}
    if isinstance(prompt, list) and isinstance(completion, list):
        prompt, completion = _check_messages(prompt, "prompt"), _check_messages(completion, "completion")
        if not any(m["role"] == "assistant" for m in completion):
            raise ValueError("`completion` has no assistant turn to train on")
        return {"prompt": prompt, "completion": completion, **extra}
    raise ValueError("`prompt` and `completion` must both be strings or both be lists of messages")


def _as_chatml(row: dict) -> dict:
    """ShareGPT-style rows read as TRL reads them: messages of ``from`` and ``value`` as ``role`` and ``content``, and
    a ``conversations`` column as ``messages``. The roles stay as written (``human``, ``gpt`` are refused by name)."""
    renamed = {"from": "role", "value": "content"}
    row = {key: [{renamed.get(name, name): part for name, part in m.items()} if isinstance(m, dict) else m for m in value]
           if key in ("prompt", "completion", "messages", "conversations") and isinstance(value, list) else value
           for key, value in row.items()}  # fmt: skip
    if "conversations" in row and "messages" not in row:
        row["messages"] = row.pop("conversations")
    return row


def _template_context(row: dict) -> dict[str, Any]:
    """What the chat template renders a row's messages with besides them: its ``tools`` and its own
    ``chat_template_kwargs`` (TRL's per-row column: variables the template reads, such as ``enable_thinking``)."""
    return {"tools": row.get("tools"), **row.get("chat_template_kwargs", {})}


def _runs(mask: list[bool]) -> list[tuple[int, int]]:
    """(start, end) of each run of True in ``mask``."""
    runs, start = [], None
    for k, on in enumerate([*mask, False]):
        if on and start is None:
            start = k
        elif not on and start is not None:
            runs.append((start, k))
            start = None
    return runs


class Renderer:
    """Turns checked rows into token ids and a loss mask with the tokenizer's own chat template."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, name: str, processor: Any = None, image_token_id: int | None = None,
                 assistant_only_loss: bool = True, completion_only_loss: bool = True) -> None:
        self.tokenizer = tokenizer
        self.name = name
        self.assistant_only_loss, self.completion_only_loss = assistant_only_loss, completion_only_loss
        # What ends a reply (Gemma's <end_of_turn> besides its <eos>): a template's separator after it is not trained.
        self.end_ids = set(end_of_turn_ids(saved_generation_config(name) if Path(name).is_dir() else None, tokenizer))
        self.images = ImageRenderer(processor, image_token_id) if processor is not None and image_token_id is not None else None
        self.image_token_id = image_token_id
        self._said_no_end = False

    def _ending_at_turn_ends(self, ids: list[int], mask: list[bool]) -> list[bool]:
        """``mask`` with each trained run ending at its last end-of-turn token: a {% generation %} block that holds
        the separator after it (TRL's Qwen2.5 training template's newline) does not train the separator."""
        for start, end in _runs(mask):
            ends = [k for k in range(start, end) if ids[k] in self.end_ids]
            if ends:
                mask[ends[-1] + 1 : end] = [False] * (end - ends[-1] - 1)
        return mask

    @staticmethod
    def _without_unweighted_turns(messages: list[dict], mask: list[bool]) -> list[bool]:
        """``mask`` (from {% generation %} blocks) without the replies of assistant turns of ``weight: 0``: the
        blocks' runs are the assistant turns in order, one each; where they are not, the turns cannot be told apart
        and such a row is refused."""
        unweighted = [k for k, m in enumerate(messages) if m.get("weight") == 0]
        if not unweighted:
            return mask
        turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        runs = _runs(mask)
        if len(runs) != len(turns):
            raise ValueError(f"`messages[{unweighted[0]}]`: `weight: 0`, but the chat template's {{% generation %}} blocks mark "
                             f"{len(runs)} replies for {len(turns)} assistant turns, so the turn's tokens cannot be told apart")
        for k, (start, end) in zip(turns, runs):
            if k in unweighted:
                mask[start:end] = [False] * (end - start)
        return mask

    def _image_example(self, row: dict) -> Example:
        """A row with images, rendered by the processor (its template must mark assistant turns with
        ``{% generation %}``, the only way to find them among expanded image tokens)."""
        if self.images is None:
            raise ValueError(f"the row has images, but {self.name} is a text-only model (it has no image processor)")
        template = getattr(self.images.processor, "chat_template", None) or ""
        if not _GENERATION_BLOCK.search(template):
            raise ValueError(f"the processor of {self.name} has a chat template without {{% generation %}} blocks, which rows with images need to find the assistant turns")
        messages = row["messages"] if "messages" in row else row["prompt"] + row["completion"]
        ids, mask, inputs = self.images.render(messages, assistant_mask=True)
        mask = self._without_unweighted_turns(messages, mask)
        if "prompt" in row:
            prompt, _, _ = self.images.render(row["prompt"])
            mask[: len(prompt)] = [False] * len(prompt)
        mask = self._ending_at_turn_ends(ids, [m and t != self.image_token_id for m, t in zip(mask, ids)])
        keys = [image_key(image) for image in images_of(messages)]
        if not any(mask[1:]):
            raise ValueError("no trained tokens after rendering")
        return Example(ids, mask, images=list(zip(keys, inputs)), image_token_id=self.image_token_id)

    def _chat(self, messages: list[dict], add_generation_prompt: bool = False, context: dict | None = None) -> list[int]:
        with rendering_row():
            out = self.tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, add_generation_prompt=add_generation_prompt, **(context or {})
            )
        return list(out["input_ids"])

    def _require_template(self) -> None:
        if not self.tokenizer.chat_template:
            raise DataError(f"tokenizer {self.name} has no chat template; conversational rows need one (or use string prompt/completion rows)")

    def _assistant_mask(self, messages: list[dict], context: dict | None = None, first: int = 0) -> tuple[list[int], list[bool]]:
        """The conversation's ids and which are trained: each assistant turn from message ``first`` on (the turns of a
        prompt are not trained)."""
        if _GENERATION_BLOCK.search(self.tokenizer.chat_template):
            with rendering_row():
                out = self.tokenizer.apply_chat_template(
                    messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **(context or {})
                )
            ids = list(out["input_ids"])
            mask = self._without_unweighted_turns(messages, [bool(m) for m in out["assistant_masks"]])
            mask = self._ending_at_turn_ends(ids, mask)
            self._note_if_no_end(ids, mask, "the chat template's {% generation %} blocks leave out the end of turn, so no reply is "
                                 "trained to end; put the end-of-turn token inside the blocks")
            for k, message in enumerate(messages):  # each trained turn opens where the model is asked to reply
                if message["role"] == "assistant" and k >= max(first, 1) and message.get("weight") != 0:
                    before = self._chat(messages[:k], add_generation_prompt=True, context=context)
                    if ids[: len(before)] != before:
                        self._refuse_joined_header(before, ids, common_prefix(before, ids), f"turn {k}'s reply")
            return ids, mask
        # Templates without {% generation %} blocks: find each assistant turn by rendering the conversation up to it.
        # That rendering must agree with the full one through the turn's end-of-turn token; after it, only what a
        # template adds where a conversation ends (Phi-3's eos) may differ.
        ids = self._chat(messages, context=context)
        mask = [False] * len(ids)
        for k, message in enumerate(messages):
            if message["role"] != "assistant" or k < first or message.get("weight") == 0:
                continue
            if k == 0:  # nothing before it to render: where the template puts its header cannot be told from its text
                raise ValueError(f"`messages[0]`: a conversation that opens with an assistant turn: tokenizer {self.name}'s chat "
                                 "template has no {% generation %} blocks to locate it by; open with a system or user turn")
            before = self._chat(messages[:k], add_generation_prompt=True, context=context)
            through = self._chat(messages[: k + 1], context=context)
            start = len(before)
            if through[:start] != before:
                # A generation prompt that opens the turn otherwise than the finished turn renders (a reasoning
                # template's `<think>`, dropped once the reply is written): the turn is trained from where the two
                # part, as TRL trains it, provided the conversation before the turn renders the same.
                earlier = self._chat(messages[:k], context=context)
                start = common_prefix(before, through)
                self._refuse_joined_header(before, through, start, f"turn {k}'s reply")
                if through[: len(earlier)] != earlier or start < len(earlier):
                    raise ValueError(f"tokenizer {self.name}: the chat template renders the conversation before turn {k} otherwise "
                                     "once the turn follows, so assistant tokens cannot be located (add {% generation %} blocks to the template)")
            agree = common_prefix(ids, through)
            ends = [i for i, token in enumerate(through[start:agree]) if token in self.end_ids]
            closing = all(token in self.end_ids or not self.tokenizer.decode([token]).strip() for token in through[agree:])
            if agree < start or (agree < len(through) and not (ends and closing)):
                raise ValueError(f"tokenizer {self.name}: the chat template renders turn {k} differently once later turns follow, so assistant tokens cannot be located (add {{% generation %}} blocks to the template)")
            end = start + ends[-1] + 1 if ends else len(through)  # separators after the end-of-turn token are not trained
            if not ends and agree == len(through) < len(ids) and ids[agree] in self.end_ids:
                end += 1  # a template that ends a reply with the next turn's opening token (GLM's <|user|>), an end token
            elif not ends and agree == len(through) == len(ids) and (opener := self._next_turn_opener(messages[: k + 1], through, context)):
                ids, mask, end = [*ids, opener], [*mask, False], end + 1  # the last reply too, as TRL's training template ends it
            mask[start:end] = [True] * (end - start)
        self._note_if_no_end(ids, mask, "the chat template renders no end-of-turn token after a conversation's last reply, so "
                             "that reply is not trained to end; give it a template that does, or one with {% generation %} blocks")
        return ids, mask

    def _refuse_joined_header(self, asked: list[int], rendered: list[int], start: int, what: str) -> None:
        """Refuse a reply whose first characters the tokenizer joins with the end of the generation prompt (``asked``,
        whose tokens part from ``rendered``'s at ``start``) into one token: Qwen's ``\n\n`` of the header's newline
        and a reply opening with one. Its text follows the prompt, but in tokens the model is never asked with (the
        prompt's last token is not there): trained, it would learn a context inference never gives."""
        text = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)  # noqa: E731
        tail, after = text(asked[start:]), text(rendered[start:])
        if not (tail and after.startswith(tail)):
            return
        reply = after[len(tail):]
        if len(text(rendered[start : start + 1])) <= len(tail):  # the header's end cut otherwise, not joined to the reply
            raise ValueError(f"tokenizer {self.name}: the template's assistant header ends in {tail!r}, which the tokenizer cuts "
                             f"into other tokens once {what} follows, so it would be trained after other tokens than the "
                             "prompt the model is asked with; use a template whose assistant header ends where a token ends")
        fix = ("remove the reply's leading whitespace" if reply[:1].isspace() else
               "use a template whose assistant header ends where a token ends (no space after it)")
        raise ValueError(f"tokenizer {self.name}: {what} opens with {reply[:20]!r}, which the tokenizer joins with the end "
                         f"of the template's assistant header ({tail!r}) into one token, so it would be trained after other "
                         f"tokens than the prompt the model is asked with; {fix}")

    def _next_turn_opener(self, messages: list[dict], rendered: list[int], context: dict | None) -> int | None:
        """The token a next user turn would open with after ``messages`` (``rendered``), where it is one of the model's
        end tokens (GLM's ``<|user|>``): a template that renders nothing after a conversation's last reply ends each
        reply with it. None otherwise."""
        following = self._chat([*messages, {"role": "user", "content": "."}], context=context)
        if following[: len(rendered)] == rendered and len(following) > len(rendered) and following[len(rendered)] in self.end_ids:
            return following[len(rendered)]
        return None

    def _note_if_no_end(self, ids: list[int], mask: list[bool], why: str) -> None:
        """Said once: trained replies of which none ends with an end token (TRL warns too: a model never trained to end
        its reply does not stop)."""
        if any(mask) and not any(on and token in self.end_ids for token, on in zip(ids, mask)) and not self._said_no_end:
            self._said_no_end = True
            print(f"note: tokenizer {self.name}: {why}", file=sys.stderr)

    def example(self, row: dict) -> Example:
        """The row's tokens and which are trained: its assistant turns (a `messages` row), its completion (a `prompt`
        and `completion` row), or every token but the first (a `text` row, and a row of a shape whose flag,
        ``assistant_only_loss`` or ``completion_only_loss``, is off: TRL's language modelling of the whole row)."""
        # TRL trains a token where every mask it applies keeps it: the assistant turns' (assistant_only_loss), and a
        # prompt/completion row's completion (completion_only_loss); a string row has no turns.
        assistant = self.assistant_only_loss and ("messages" in row or isinstance(row.get("prompt"), list))
        whole = not assistant and ("messages" in row or "prompt" in row and not self.completion_only_loss)
        if row_has_images(row):
            for column in ("tools", "chat_template_kwargs"):
                if row.get(column):
                    raise ValueError(f"`{column}` in a row with images: the image processor's template is not given them here")
            if flag := next((name for name, on in (("assistant_only_loss", self.assistant_only_loss),
                                                    ("completion_only_loss", self.completion_only_loss or "messages" in row)) if not on), None):
                raise ValueError(f"data.{flag}: false with a row with images: an image row trains its replies alone "
                                 "(its placeholder tokens are not trained); keep it true for image rows")
            return self._image_example(row)
        context = _template_context(row)
        if "messages" in row or isinstance(row.get("prompt"), list):
            self._check_tools_rendered(row, context)
            # Turns whose tokens are trained where replies are not told apart (the completion's alone, under
            # completion_only_loss): a reply of weight 0 among them cannot be left out.
            turns = ([(f"messages[{k}]", m) for k, m in enumerate(row["messages"])] if "messages" in row else
                     [(f"{column}[{k}]", m) for column in (("completion",) if self.completion_only_loss else ("prompt", "completion"))
                      for k, m in enumerate(row[column])])  # fmt: skip
            if not assistant and (where := next((where for where, m in turns if m.get("weight") == 0), None)):
                raise ValueError(f"`{where}`: `weight: 0` leaves a reply out of the loss, which data.assistant_only_loss: false "
                                 "(replies not told apart from the rest) cannot; set it true, or drop the key")
        if whole and ("messages" in row or isinstance(row["prompt"], list)):  # the conversation as TRL renders it
            self._require_template()
            ids = self._chat(row["messages"] if "messages" in row else row["prompt"] + row["completion"], context=context)
            mask = [False] + [True] * (len(ids) - 1)
        elif "messages" in row:
            self._require_template()
            ids, mask = self._assistant_mask(row["messages"], context)
        elif "text" in row:  # every token is trained but the first, which no token before it predicts
            ids = self._ended(self.tokenizer(row["text"], add_special_tokens=True)["input_ids"])
            mask = [False] + [True] * (len(ids) - 1)
        elif isinstance(row["prompt"], str):
            prompt, completion = self._text_completion(row["prompt"], row["completion"])
            completion = self._ended(completion)
            ids, mask = prompt + completion, [False] * len(prompt) + [True] * len(completion)
        else:
            self._require_template()
            conversation = row["prompt"] + row["completion"]
            if assistant:  # the completion's replies, or (completion_only_loss false) the prompt's too
                ids, mask = self._assistant_mask(conversation, context, first=len(row["prompt"]) if self.completion_only_loss else 0)
            else:  # every token of the completion, as the prompt renders before it
                ids = self._chat(conversation, context=context)
                mask = [True] * len(ids)
            # The prompt as it is asked (with the template's generation prompt, where the completion opens with an
            # assistant turn; some templates end a conversation otherwise, Phi-3's with its eos), else as it ends. A
            # generation prompt that opens the turn otherwise than the written turn renders (a reasoning template's
            # `<think>`) asks up to where the two part, as for a conversation's turns (`_assistant_mask`) and in TRL.
            asked = row["completion"][0]["role"] == "assistant"
            said = self._chat(row["prompt"], context=context)
            cut = len(said) if ids[: len(said)] == said else None
            if asked:
                with_prompt = self._chat(row["prompt"], add_generation_prompt=True, context=context)
                if ids[: len(with_prompt)] != with_prompt:
                    self._refuse_joined_header(with_prompt, ids, common_prefix(with_prompt, ids), "the completion")
                cut = len(with_prompt) if ids[: len(with_prompt)] == with_prompt else None if cut is None else max(cut, common_prefix(with_prompt, ids))
            if cut is None:
                raise ValueError(f"tokenizer {self.name}: the rendered prompt is not a prefix of the rendered conversation")
            if self.completion_only_loss:
                mask[:cut] = [False] * cut
        if whole:
            mask = [False] + [True] * (len(ids) - 1)
        if not any(mask[1:]):
            unweighted = any(m.get("weight") == 0 for m in row.get("messages") or [*row.get("prompt", []), *row.get("completion", [])]
                             if isinstance(m, dict))  # fmt: skip
            raise ValueError("no trained tokens after rendering" + (" (every reply it would train has weight: 0)" if unweighted else ""))
        check_no_image_tokens(ids, self.image_token_id, self.tokenizer)
        return Example(ids, mask)

    def _check_tools_rendered(self, row: dict, context: dict) -> None:
        """A template that does not render a turn's tool calls (Phi-3's), or a tool's result, would train the row
        without them (an empty reply where the model called a tool, the answer without the result it read):
        refused, naming the turn. Each call's name and each result is rendered as a marker of its own (a template
        may escape a result, as Llama 3's ``tojson``), and every marker must be in the template's text; only rows
        with tool calls or results are rendered so."""
        turns = [(f"messages[{k}]", m) for k, m in enumerate(row["messages"])] if "messages" in row else [
            (f"{column}[{k}]", m) for column in ("prompt", "completion") for k, m in enumerate(row[column])]  # fmt: skip
        marked, checks = [], []
        for k, (where, message) in enumerate(turns):
            if message["role"] == "tool" and isinstance(message.get("content"), str) and message["content"].strip():
                checks.append((f"toolresult{k}marker", where, "this tool result, so the replies after it would be trained "
                               "without it; give a template that renders tool turns"))  # fmt: skip
                message = {**message, "content": checks[-1][0]}
            calls = []
            for j, call in enumerate(message.get("tool_calls") or ()):
                function = call.get("function", call) if isinstance(call, dict) else None
                if isinstance(function, dict) and isinstance(function.get("name"), str):
                    checks.append((f"toolcall{k}x{j}marker", where, f"the turn's tool call {function['name']!r}, so the turn "
                                   "would be trained without it; give a template that renders tool calls"))  # fmt: skip
                    renamed = {**function, "name": checks[-1][0]}
                    call = {**call, "function": renamed} if "function" in call else renamed
                calls.append(call)
            marked.append({**message, "tool_calls": calls} if calls else message)
        if not checks:
            return
        self._require_template()
        try:
            text = self.tokenizer.apply_chat_template(marked, tokenize=False, **context)
        except Exception:  # noqa: BLE001  # the row's own rendering says what is wrong with it
            return
        if lost := next(((where, what) for marker, where, what in checks if marker not in text), None):
            raise ValueError(f"`{lost[0]}`: tokenizer {self.name}'s chat template does not render {lost[1]}")

    def _ended(self, ids: list[int]) -> list[int]:
        """A text's ids with the end token after them, unless they end with it already (TRL's add_eos)."""
        eos = self.tokenizer.eos_token_id
        if eos is None and not self._said_no_end:
            self._said_no_end = True
            print(f"note: tokenizer {self.name} has no eos_token: text rows and string completions are trained without "
                  "an end token, so the model is not trained to stop after them", file=sys.stderr)
        return ids + [eos] if eos is not None and ids[-1:] != [eos] else ids

    def _text_completion(self, prompt: str, completion: str) -> tuple[list[int], list[int]]:
        """A text row's prompt ids and the completion's: the tokens that follow the prompt's in the row's text tokenized
        whole, where the prompt's own tokens start it (as TRL takes them). Where a token spans the boundary, the
        completion tokenized apart, unless that changes the text (a SentencePiece tokenizer opens every text it
        encodes with a word marker, a space the row does not have): that row is refused, never trained on another text."""
        tokenize = lambda text, special: self.tokenizer(text, add_special_tokens=special)["input_ids"]  # noqa: E731
        prompt_ids, whole = tokenize(prompt, True), tokenize(prompt + completion, True)
        if whole[: len(prompt_ids)] == prompt_ids and len(whole) > len(prompt_ids):
            return prompt_ids, whole[len(prompt_ids) :]
        apart = tokenize(completion, False)
        if prompt_ids[-1:] and prompt_ids[-1] in self.tokenizer.all_special_ids:  # the tokenizer ends every text with one
            return prompt_ids, apart  # (add_eos_token): the completion starts a text after it, as it always did
        text = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)  # noqa: E731
        said, asked = text(prompt_ids + apart), text(prompt_ids)
        if not said.startswith(asked) or said[len(asked) :] != text(apart):
            raise ValueError(f"tokenizer {self.name}: a token spans the end of `prompt` and the start of `completion` "
                             f"({prompt[-20:]!r} | {completion[:20]!r}), and the completion tokenized apart reads "
                             f"{said[len(asked) :][:20]!r} after the prompt: end the prompt where a token ends"
                             + (" (a space at its end belongs at the completion's start)" if prompt.endswith(" ") else ""))
        return prompt_ids, apart

    def _trained_reply(self, prompt: list[int], conversation: list[int], content: str) -> str:
        """The final reply as the model is trained to write it, up to its end of turn: what the template renders
        around the content too (Qwen3's empty ``<think></think>``, which a greedy reply writes and the content lacks).
        The content itself where the prompt does not start the conversation's rendering."""
        if conversation[: len(prompt)] != prompt:
            return content
        reply = conversation[len(prompt) :]
        end = next((k for k, token in enumerate(reply) if token in self.end_ids), len(reply))
        return self.tokenizer.decode(reply[:end], skip_special_tokens=True)

    def generation_case(self, row: dict) -> GenerationCase | None:
        """The prompt up to the final assistant turn and that turn's text; None if it has tool calls, is a reply not
        to learn (``weight: 0``), or asks nothing (a plain `text` row)."""
        if "text" in row:
            return None
        if "messages" in row or isinstance(row["prompt"], list):
            messages = row["messages"] if "messages" in row else row["prompt"] + row["completion"]
            last = messages[-1]
            if last["role"] != "assistant" or last.get("tool_calls") or last.get("weight") == 0 or len(messages) == 1:  # no case
                return None
            if row_has_images(row) and self.images is not None:
                ids, _, inputs = self.images.render(messages[:-1], add_generation_prompt=True)
                return GenerationCase(ids, last["content"], images=inputs)
            context = _template_context(row)
            prompt = self._chat(messages[:-1], add_generation_prompt=True, context=context)
            return GenerationCase(prompt, self._trained_reply(prompt, self._chat(messages, context=context), last["content"]))
        # The completion as trained, up to its end token: one written with its end token's text ("45<|im_end|>") is
        # what a greedy decode writes without it.
        completion = self._text_completion(row["prompt"], row["completion"])[1]
        end = next((k for k, token in enumerate(completion) if token in self.end_ids), len(completion))
        return GenerationCase(self.tokenizer(row["prompt"], add_special_tokens=True)["input_ids"],
                              self.tokenizer.decode(completion[:end], skip_special_tokens=True))


def load_examples(
    source: DataSource, renderer: Renderer, max_length: int, fix: str = "raise max_length", limit: str | None = None,
    as_chat: Callable[[dict], dict] | None = None, key: str | None = None,
) -> tuple[list[Example], list[GenerationCase]]:
    """Check and render every row of ``source``; the first bad row raises DataError naming it (a row longer than
    ``max_length``: with ``fix``, what lets it in; ``limit``: what ``max_length`` is, when not the key itself).
    ``as_chat``: each checked row's shape before it is rendered (GRPO's held-out string prompts as chat turns); ``key``:
    the recipe key the source was given as."""
    name, rows = read_rows(source, key)
    if not rows:  # named by its key too: one file may be given as two
        raise DataError(f"{name}: no rows" if key is None or name.startswith(key) else f"{key}: {name}: no rows")
    examples, cases = [], []
    base = Path(name).parent if Path(name).is_file() else None  # image paths are relative to the data file
    for where, raw in rows:
        try:
            row = _check_row(raw)
            if as_chat is not None:
                row = as_chat(row)
            if row_has_images(row):
                row = load_images(row, base)
            example = renderer.example(row)
            case = renderer.generation_case(row)
        except DataError:
            raise
        except ValueError as e:
            raise DataError(f"{name}: {where}: {e}") from None
        if len(example.input_ids) > max_length:
            hint = f"{fix}, or shorten the row" if fix else "shorten the row"
            raise DataError(f"{name}: {where}: {len(example.input_ids)} tokens, longer than {limit or f'max_length={max_length}'} ({hint})")
        examples.append(example)
        if case is not None:
            cases.append(dataclasses.replace(case, where=f"{name}: {where}"))
    return examples, cases


def plan_batches(examples: Sequence[Example], order: Sequence[int], max_tokens: int, packing: Packing) -> list[list[int]]:
    """Example indices, in ``order``, grouped into rows that fit ``max_tokens`` forwarded tokens (the packing
    planner's ordered rows: a tree row counts shared prefixes once)."""
    order = list(order)
    rows = plan_ordered_rows([examples[i].packing_ids for i in order], max_tokens, packing)
    return [[order[k] for k in row] for row in rows]


_PLAN_DRAWS = 8  # orders an epoch tries before it takes the first epoch's rows (TokenBudgetBatchSampler)


def _run_batches(trainer: Any, batches: int) -> int | None:
    """The training batches a run of ``batches`` an epoch takes (None: no bound): an epoch's last step may take fewer
    than ``accumulate_grad_batches``."""
    accumulate, steps, epochs = trainer.accumulate_grad_batches, trainer.max_steps, trainer.max_epochs
    most = math.inf
    if steps is not None and steps > 0:
        full, left = divmod(steps, -(-batches // accumulate))  # whole epochs of steps, then steps of the next
        most = full * batches + left * accumulate
    if epochs is not None and epochs > 0:
        most = min(most, epochs * batches)
    return None if most == math.inf else int(most)


def _inside_a_step(every: int, batches: int, accumulate: int, across_epochs: bool, most: int | None = None) -> int | None:
    """The first training batch (counted from the run's start; at most ``most``, the run's) at which Lightning validates
    inside an optimizer step, None if none: it validates at every ``every``-th batch of an epoch (``across_epochs``: of
    the run), and a step ends at every ``accumulate``-th batch of an epoch and at its last. The pattern repeats every
    lcm(every, batches) batches."""
    horizon = min(math.lcm(every, batches) if across_epochs else batches, most or math.inf)
    for at in range(every, horizon + 1, every):
        place = (at - 1) % batches + 1
        if place != batches and place % accumulate:
            return at
    return None


def _split_to(batches: list[list[int]], count: int) -> list[list[int]]:
    """``batches`` as ``count`` rows: the row of the most examples (the first of those) split in halves, in its place,
    until there are as many (a half forwards no more tokens than its row, so it fits the budget too). Every example
    stays, once. A row's place is a path of halves from the row it came from, so the fullest row is a heap's top."""
    fullest = [(-len(row), (k,), list(row)) for k, row in enumerate(batches)]
    heapq.heapify(fullest)
    while len(fullest) < count:
        size, place, row = heapq.heappop(fullest)
        if -size < 2:  # every row holds one example: no plan has fewer rows than examples
            raise ValueError(f"{len(fullest) + 1} rows of one example each cannot make {count}")
        half = len(row) // 2
        heapq.heappush(fullest, (-half, (*place, 0), row[:half]))
        heapq.heappush(fullest, (half - len(row), (*place, 1), row[half:]))
    return [row for _, _, row in sorted(fullest, key=lambda entry: entry[1])]


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Seeded, resumable batches under a token budget: epoch ``e`` always yields the same batches.

    Each epoch plans its rows from its own seeded shuffle of the examples, in as many rows as the first epoch:
    Lightning reads that number once per run, and would end an epoch of more rows before its last, and run no
    validation at the end of an epoch of fewer (it validates at the batch whose count is the first epoch's). An order
    that packs into more is drawn again (seeded too), one that packs into fewer has its fullest rows split in two, and
    after a few draws the epoch takes the first epoch's rows in an order of its own. Every epoch trains every example
    once.

    Each of ``world_size`` ranks takes every ``world_size``-th batch, all ranks the same number (so
    collectives line up): a rank left one short takes an empty batch (``[]``: a row that trains no token, and the
    step's loss is a mean over the tokens of every rank), so no example is dropped. This replaces Lightning's
    distributed sampler, which the CLI turns off.
    ``skip_batches`` drops the first batches of an epoch, which is how a resumed run continues
    exactly where the checkpoint left off.
    """

    def __init__(
        self, examples: Sequence[Example], max_tokens: int, packing: Packing, *, shuffle: bool, seed: int, rank: int = 0, world_size: int = 1
    ) -> None:
        self.examples, self.max_tokens, self.packing = examples, max_tokens, packing
        self.shuffle, self.seed = shuffle, seed
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.skip: dict[int, int] = {}
        self._plan: list[list[int]] | None = None
        self._cache: tuple[int, list[list[int]]] | None = None
        self.sampler = self  # Lightning calls `set_epoch` on a batch sampler's `sampler`, never on the batch sampler
        self.epoch_offset = 0  # the data's epoch minus the one Lightning sets

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch + self.epoch_offset

    def skip_batches(self, epoch: int, count: int) -> None:
        self.skip[epoch] = count

    def _batches(self) -> list[list[int]]:
        if self._plan is None:
            self._plan = plan_batches(self.examples, self._order(len(self.examples), epoch=0), self.max_tokens, self.packing)
        if self._cache is None or self._cache[0] != self.epoch:
            batches = self._plan if self.epoch == 0 else self._plan_epoch(self.epoch)
            per_rank = -(-len(batches) // self.world_size)
            mine = batches[self.rank :: self.world_size]
            self._cache = (self.epoch, mine + [[]] * (per_rank - len(mine)))
        return self._cache[1]

    def _plan_epoch(self, epoch: int) -> list[list[int]]:
        first = self._plan
        for draw in range(_PLAN_DRAWS if self.shuffle else 1):
            batches = plan_batches(self.examples, self._order(len(self.examples), epoch, draw), self.max_tokens, self.packing)
            if len(batches) <= len(first):
                return _split_to(batches, len(first))
        return [first[i] for i in self._order(len(first), epoch)]

    def _order(self, n: int, epoch: int, draw: int = 0) -> list[int]:
        if not self.shuffle:
            return list(range(n))
        # Seeds far apart (seed + epoch made seed 1's first epoch seed 0's second); draw 0: the epoch's own order.
        seed = self.seed * 2_147_483_647 + epoch + draw * 1_000_003
        return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        yield from self._batches()[self.skip.pop(self.epoch, 0) :]

    def __len__(self) -> int:
        return len(self._batches())


@dataclass
class BatchRows:
    """A batch cut into rows (``data.max_tokens_per_row``): each row packs its examples whole; ``prefixes[k]`` is row
    ``k``'s span prefix (`packing.planner.RowPrefix`), which the module cuts off and forwards once for the span's rows
    (`ops.prefix_rows.share_prefixes`), or None."""

    rows: list[PackedBatch]
    prefixes: list[RowPrefix | None]
    apart: BatchRows | None = None  # under ``prefix_across_rows: auto``, the same batch without spans (sub-groups)

    def to(self, device: torch.device | str) -> BatchRows:
        return BatchRows([row.to(device) for row in self.rows], self.prefixes, None if self.apart is None else self.apart.to(device))


class PackedCollator:
    """Packs the examples of one batch into a single PackedBatch row (``unpacked``: one example a row, which the model
    runs as it runs that example alone), or with ``max_tokens_per_row`` into `BatchRows` of at most that many unique
    tokens each, a shared prefix forwarded once across them under ``prefix_across_rows`` (``auto``: where that
    forwards fewer tokens, never for padded rows, which a span refuses; the batch's sub-groups kept beside the spans
    for a model that cannot continue a prefix apart)."""

    def __init__(
        self, share_prefixes: bool, pad_to_multiple_of: int | None, pad_token_id: int, image_token_id: int | None = None,
        position_rule: Any = None, unpacked: bool = False, max_tokens_per_row: int | None = None, prefix_across_rows: PrefixAcrossRows = "auto",
    ) -> None:
        self.share_prefixes, self.pad_to_multiple_of, self.pad_token_id = share_prefixes, pad_to_multiple_of, pad_token_id
        self.image_token_id, self.position_rule, self.unpacked = image_token_id, position_rule, unpacked
        self.max_tokens_per_row, self.prefix_across_rows = max_tokens_per_row, prefix_across_rows

    def __call__(self, examples: list[Example]) -> PackedBatch | BatchRows:
        if self.max_tokens_per_row is not None and examples:
            return self._rows(examples)
        batch = self._pack(examples)
        batch.unpacked = self.unpacked
        return batch

    def _rows(self, examples: list[Example]) -> BatchRows:
        ids = [e.packing_ids for e in examples]
        if not self.share_prefixes:  # flat rows forward every token
            rows, prefixes = plan_ordered_rows(ids, self.max_tokens_per_row, "flat"), None
        else:
            setting = self.prefix_across_rows
            if setting == "auto" and self.pad_to_multiple_of:
                setting = "never"
            rows, prefixes = plan_batch_rows(ids, [e.loss_mask for e in examples], self.max_tokens_per_row, setting)
            if setting == "auto" and any(prefixes):  # for a model or kernel that cannot continue a prefix exactly
                apart = self._rows_of(examples, *plan_batch_rows(ids, [e.loss_mask for e in examples], self.max_tokens_per_row, "never"))
                return dataclasses.replace(self._rows_of(examples, rows, prefixes), apart=apart)
        return self._rows_of(examples, rows, prefixes or [None] * len(rows))

    def _rows_of(self, examples: list[Example], rows: list[list[int]], prefixes: list[RowPrefix | None]) -> BatchRows:
        return BatchRows([self._pack([examples[i] for i in row]) for row in rows], prefixes)

    def _pack(self, examples: list[Example]) -> PackedBatch:
        if not examples:  # a rank's empty batch (one short of the others): one token, not trained
            return pack_sequences([[self.pad_token_id]], [[False]], pad_to_multiple_of=self.pad_to_multiple_of, pad_token_id=self.pad_token_id)
        if any(e.images for e in examples):  # each image of a shared prefix once, its inputs in the row's order
            return pack_with_images(
                [e.input_ids for e in examples], [e.images for e in examples], self.image_token_id, [e.loss_mask for e in examples],
                position_rule=self.position_rule, share_prefixes=self.share_prefixes, pad_to_multiple_of=self.pad_to_multiple_of,
                pad_token_id=self.pad_token_id,
            )  # fmt: skip
        return pack_sequences(
            [e.input_ids for e in examples],
            [e.loss_mask for e in examples],
            share_prefixes=self.share_prefixes,
            pad_to_multiple_of=self.pad_to_multiple_of,
            pad_token_id=self.pad_token_id,
        )


class _ExampleDataset(Dataset):
    def __init__(self, examples: list[Example]) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> Example:
        return self.examples[i]


def prefix_sharing_ratio(examples: Sequence[Example], max_tokens: int) -> float:
    """Flat over unique tokens of the first tree-packed rows: how much tree packing would save."""
    rows = plan_batches(examples, range(min(len(examples), 256)), max_tokens, "tree")
    flat = sum(len(examples[i].input_ids) for row in rows for i in row)
    unique = sum(count_unique_tokens([examples[i].packing_ids for i in row]) for row in rows)
    return flat / max(unique, 1)


class SFTDataModule(LightningDataModule):
    """SFT rows from files or a ``datasets.Dataset``, packed into rows of at most ``max_tokens`` tokens.

    Args:
        train_data: JSONL / JSON / Parquet file, a ``save_to_disk`` folder, or a ``datasets.Dataset``; rows whose user turns
            hold image parts (``{"type": "image", "image": PATH_OR_URL}``, a path relative to the file, an http(s) or data URL, or bytes) need an image-text model.
            ``toy_shapes`` (and ``toy_shapes_heldout``): the embedded image task. TRL: `dataset_name`.
        val_data: the same for the held-out split (validation loss and exact-match generation).
        tokenizer: a tokenizer folder; by default the model's (``model.model_name_or_path`` in a recipe).
        max_tokens: tokens forwarded per packed row (unique tokens under tree packing): the batch size, in tokens. TRL:
            `per_device_train_batch_size` (rows, not tokens).
        max_length: longest example allowed; longer ones are an error. Defaults to ``max_tokens_per_row``. TRL: `max_length`.
        max_tokens_per_row: cut each batch into rows of at most this many unique tokens, run one after the other within
            the step (the memory of a row, the batch still ``max_tokens``); default: one row a batch. Several processes: DDP only.
        prefix_across_rows: with ``max_tokens_per_row``, examples sharing a prefix too large together for one row
            forward that prefix once, their rows attending to its keys and values (``always``), or each row forwards
            it again (``never``); ``auto``: where that forwards fewer tokens, on rows without padding (an image in the prefix
            encoded once for its rows).
        packing: ``tree`` (shared prefixes forwarded once), ``flat`` (padding-free, no sharing), ``none``
            (one example per row, run as the model runs it alone: a model packing refuses trains so), or ``auto``: tree when the data shares prefixes, else flat. TRL: `packing`,
            `packing_strategy`, `padding_free`.
        pad_to_multiple_of: pad each row to a multiple of this; ``"auto"`` is 128 on XLA/Neuron, else none.
            TRL: the same name.
        shuffle: a new order of the examples every epoch (seeded by ``seed``: a resume sees the same order), as TRL's
            sampler reshuffles every epoch; off, the file's order every epoch.
        seed: the shuffle's seed (a recipe's top-level ``seed``).
        num_workers: DataLoader worker processes (they leave the stop signals to the main process: ``data/workers.py``).
            TRL: `dataloader_num_workers`.
        assistant_only_loss: the loss of a conversation covers its assistant turns; false: every token of a
            ``messages`` row (its system and user turns and the template's tokens too, as TRL trains such rows by
            default), and of a conversational completion. TRL: the same name.
        completion_only_loss: the loss of a ``prompt``/``completion`` row covers its completion; false: the prompt's
            tokens too (its assistant turns alone under ``assistant_only_loss``). A token is trained where both keep
            it, as in TRL. TRL: the same name.
    """

    def __init__(
        self,
        train_data: DataSource,
        val_data: DataSource = None,
        tokenizer: str = "tiny",
        max_tokens: int = 2048,
        max_length: int | None = None,
        max_tokens_per_row: int | None = None,
        prefix_across_rows: PrefixAcrossRows = "auto",
        packing: Packing = "auto",
        pad_to_multiple_of: int | Literal["auto"] | None = "auto",
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        assistant_only_loss: bool = True,
        completion_only_loss: bool = True,
    ) -> None:
        super().__init__()
        self.assistant_only_loss, self.completion_only_loss = assistant_only_loss, completion_only_loss
        train_data, val_data = toy_source(train_data), toy_source(val_data)
        check_source("train_data", train_data)
        check_source("val_data", val_data)
        self.train_data, self.val_data = train_data, val_data
        self.tokenizer_name = tokenizer
        self.max_tokens = validation.positive_int("max_tokens", max_tokens)
        row = max_tokens if max_tokens_per_row is None else validation.positive_int("max_tokens_per_row", max_tokens_per_row)
        if row > max_tokens:
            raise RecipeError(f"max_tokens_per_row={row} is larger than max_tokens={max_tokens}, the tokens of a whole batch: "
                              "give at most max_tokens", "max_tokens_per_row")
        self.max_tokens_per_row = row if row < max_tokens else None  # None: a batch is one row
        self.max_length = row if max_length is None else validation.positive_int("max_length", max_length)
        if self.max_length > row:
            bound = "max_tokens" if self.max_tokens_per_row is None else f"max_tokens_per_row={row}"
            raise RecipeError(f"max_length={self.max_length} is larger than {bound}: such an example fits no row", "max_length")
        if isinstance(pad_to_multiple_of, int):
            validation.positive_int("pad_to_multiple_of", pad_to_multiple_of)
        validation.non_negative_int("num_workers", num_workers)
        validation.literal_arguments(SFTDataModule.__init__, {"packing": packing, "prefix_across_rows": prefix_across_rows})
        if packing == "none" and self.max_tokens_per_row is not None:
            raise RecipeError("max_tokens_per_row cuts a batch into rows, but packing: none makes each batch one example: leave it unset", "max_tokens_per_row")
        if prefix_across_rows == "always" and self.max_tokens_per_row is None:
            raise RecipeError(f"prefix_across_rows: always forwards a prefix apart from the rows of a batch, but a batch is one row of max_tokens={max_tokens}: "
                              "set max_tokens_per_row below it, or leave prefix_across_rows at auto", "prefix_across_rows")
        self.packing, self.prefix_across_rows = packing, prefix_across_rows
        self.pad_to_multiple_of = pad_to_multiple_of
        self.shuffle, self.seed, self.num_workers = shuffle, seed, num_workers
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.processor: Any = None  # an image-text model's (None for a text-only one)
        self.image_token_id: int | None = None
        self.position_rule: Any = None
        self.train_examples: list[Example] = []
        self.val_examples: list[Example] = []
        self.generation_cases: list[GenerationCase] = []
        self.resolved_packing: Packing = packing
        self._sampler: TokenBudgetBatchSampler | None = None
        self._epoch_batches: int | None = None  # batches_per_epoch, once counted
        self._position = (0, 0)  # (epoch, training batches already taken in it)
        self._resume: tuple[int, int] | None = None
        self._epoch_offset = 0  # the data's epoch minus Lightning's (train_dataloader)
        self._rows_digest: str | None = None

    def setup(self, stage: str) -> None:
        if self.trainer is not None and self.trainer._accelerator_connector.is_distributed:  # DDP, FSDP2 (one device too):
            self.trainer._accelerator_connector.use_distributed_sampler = False  # rows are dealt to the ranks here; Lightning's
            # own sampler could not wrap this batch sampler (a TypeError)
        if self.tokenizer is not None:
            return
        path = resolve_model_path(self.tokenizer_name)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.processor, self.image_token_id = load_processor(path)
        self.position_rule = position_rule(path) if self.processor is not None else None  # multi-axis rotary positions
        renderer = Renderer(self.tokenizer, path, self.processor, self.image_token_id, self.assistant_only_loss, self.completion_only_loss)
        row_key = "max_tokens" if self.max_tokens_per_row is None else "max_tokens_per_row"
        fix = "raise data.max_length" if self.max_length < (self.max_tokens_per_row or self.max_tokens) else f"raise data.{row_key}, which max_length may not exceed"
        max_length, limit = self.max_length, None
        positions = learned_positions(path)
        if positions is not None and positions[0] < max_length:  # a longer row would index past the model's table
            (max_length, key), fix = positions, ""
            limit = f"the {max_length} positions the model learned (its config's {key})"
        self.train_examples, _ = load_examples(self.train_data, renderer, max_length, fix, limit, key="data.train_data")
        if self.val_data is not None:
            self.val_examples, self.generation_cases = load_examples(self.val_data, renderer, max_length, fix, limit, key="data.val_data")
        if self.packing == "auto":
            self.resolved_packing = "tree" if prefix_sharing_ratio(self.train_examples, self.max_tokens) > 1.05 else "flat"
        if self.packing == "none" and (self.trainer is None or self.trainer.is_global_zero):
            print("note: data.packing: none trains one example per micro-batch (data.max_tokens bounds its length); "
                  "trainer.accumulate_grad_batches sets how many make a step", file=sys.stderr)
        self._check_rows()
        if self.trainer is not None and stage == "fit":
            self._check_val_interval()

    def check_strategy(self, trainer: Any) -> None:
        """Rows on several processes run under DDP alone (``run`` asks before it starts the processes, so it is said
        once): FSDP2 gathers and reduces shards in each row's forward and backward, in step with the other ranks, whose
        batches may be cut into more or fewer rows."""
        if self.max_tokens_per_row is not None and trainer.world_size > 1 and not wraps_in_ddp(trainer.strategy):
            static = " with static_graph" if ddp_static_graph(trainer.strategy) else ""
            raise RecipeError(
                f"max_tokens_per_row={self.max_tokens_per_row} cuts each batch into rows, which {trainer.world_size} processes run under DDP "
                f"(without static_graph) alone, not {type(trainer.strategy).__name__}{static} (whose forwards and backwards work in "
                "step with the other ranks, whose batches may hold more or fewer rows): set trainer.strategy: ddp, or leave it unset and lower "
                "max_tokens", "max_tokens_per_row")

    def _check_rows(self) -> None:
        """What ``max_tokens_per_row`` and ``prefix_across_rows: always`` cannot run, refused before a model loads."""
        if self.trainer is not None:
            self.check_strategy(self.trainer)
        if self.prefix_across_rows != "always" or self.max_tokens_per_row is None:
            return
        why = None
        if self.resolved_packing != "tree":
            why = f"packing: {self.resolved_packing} shares no prefix"
        elif self._row_padding():
            why = "rows are padded to fixed lengths (pad_to_multiple_of)"
        if why is not None:
            raise RecipeError(f"prefix_across_rows: always forwards a shared prefix apart from its rows, but {why}: set it to auto or never", "prefix_across_rows")

    def batches_per_epoch(self) -> int:
        """This rank's batches in an epoch (every epoch has the first's), counted without a data loader."""
        if self._epoch_batches is None:
            self._epoch_batches = len(self._loader(self.train_examples, self.shuffle, self.seed)[1])
        return self._epoch_batches

    def batches_of_epochs(self, epochs: int) -> list[int]:
        """This rank's batches in each of the first ``epochs`` epochs: as many in each as in the first
        (``TokenBudgetBatchSampler``)."""
        return [self.batches_per_epoch()] * epochs

    def _check_val_interval(self) -> None:
        """What Lightning refuses only once fitting, after the run has written its folder (a corrected rerun was
        refused): a ``limit_train_batches`` fraction that keeps no batch, and a ``val_check_interval`` (training batches)
        longer than an epoch under ``check_val_every_n_epoch``."""
        trainer, interval = self.trainer, getattr(self.trainer, "val_check_interval", None)
        limit, batches = trainer.limit_train_batches, limited_batches(trainer, self.batches_per_epoch())
        if batches == 0 and isinstance(limit, float) and limit > 0:
            raise DataError(
                f"trainer.limit_train_batches={limit} keeps no batch of data.train_data's {self.batches_per_epoch()} per "
                f"epoch (data.max_tokens {self.max_tokens}): give at least {1 / self.batches_per_epoch():.4g}, or a number of batches"
            )
        whole = isinstance(interval, int) and not isinstance(interval, bool)
        every = interval if whole else max(int(batches * interval), 1) if isinstance(interval, float) else None
        accumulate, across = trainer.accumulate_grad_batches, whole and trainer.check_val_every_n_epoch is None
        validates = bool(self.val_examples) and trainer.limit_val_batches != 0
        if every is not None and batches and validates and (inside := _inside_a_step(every, batches, accumulate, across, _run_batches(trainer, batches))) is not None:
            shown = "" if whole else f" ({every} of an epoch's {batches})"
            where = f" (batch {(inside - 1) % batches + 1} of an epoch of {batches}, counted across epochs)" if across else ""
            fix = f"a multiple of {accumulate}" if not across or batches % accumulate == 0 else f"a multiple of an epoch's {batches} batches"
            raise RecipeError(
                f"trainer.val_check_interval={interval} validates every {every} training batches{shown}, and at batch "
                f"{inside}{where} inside an optimizer step of trainer.accumulate_grad_batches={accumulate} (its figures would "
                f"be logged a step late, beside the next step's): give {fix}", "trainer.val_check_interval")
        if not whole or across:
            return
        if interval > batches:
            raise DataError(
                f"trainer.val_check_interval={interval} training batches, but an epoch of data.train_data is {batches} "
                f"(data.max_tokens {self.max_tokens}): give at most {batches}, or trainer.check_val_every_n_epoch: null "
                "to count batches across epochs"
            )

    def _row_padding(self) -> int | None:
        """``pad_to_multiple_of`` as the rows are padded on this run's device (``auto``: 128 on XLA/Neuron, else none)."""
        return resolve_pad_to_multiple_of(self.pad_to_multiple_of, self.trainer if self.trainer is not None else torch.device("cpu"))

    def _loader(self, examples: list[Example], shuffle: bool, seed: int) -> tuple[DataLoader, TokenBudgetBatchSampler]:
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer is not None else (0, 1)
        sampler = TokenBudgetBatchSampler(examples, self.max_tokens, self.resolved_packing, shuffle=shuffle, seed=seed, rank=rank, world_size=world)
        collate = PackedCollator(
            share_prefixes=self.resolved_packing == "tree",
            pad_to_multiple_of=self._row_padding(),
            pad_token_id=self.tokenizer.pad_token_id or 0,
            image_token_id=self.image_token_id,
            position_rule=self.position_rule,
            unpacked=self.resolved_packing == "none",
            max_tokens_per_row=self.max_tokens_per_row,
            prefix_across_rows=self.prefix_across_rows,
        )
        # A generator of its own: a loader's iterator otherwise draws its base seed from the global generator, which
        # dropout draws from too (a resumed run restores that one at its first step, see PolicyModule).
        loader = WorkerLoader(_ExampleDataset(examples), batch_sampler=sampler, collate_fn=collate, num_workers=self.num_workers,
                              generator=torch.Generator().manual_seed(seed))
        return loader, sampler

    def train_dataloader(self) -> DataLoader:
        loader, self._sampler = self._loader(self.train_examples, self.shuffle, self.seed)
        if self._resume is not None:
            # A run stopped at its last step (max_steps) saved its last checkpoint after Lightning closed the epoch: an
            # extended run resumes in Lightning's next epoch, and the data goes on with the rest of its own (offset).
            self._epoch_offset = self._resume[0] - (self.trainer.current_epoch if self.trainer is not None else self._resume[0])
        self._sampler.epoch_offset = self._epoch_offset
        if self._resume is not None:
            self._sampler.epoch = self._resume[0]  # Lightning draws a resumed run's first batch before it sets the epoch
            self._sampler.skip_batches(*self._resume)
            self._resume = None
        return loader

    def val_dataloader(self) -> DataLoader | list:
        return self._loader(self.val_examples, False, self.seed)[0] if self.val_examples else []

    def on_before_batch_transfer(self, batch: PackedBatch, dataloader_idx: int) -> PackedBatch:
        if self.trainer is not None and self.trainer.training:
            epoch, taken = self._position
            current = self.trainer.current_epoch + self._epoch_offset
            self._position = (current, taken + 1 if epoch == current else 1)
        return batch

    def state_dict(self) -> dict[str, Any]:
        epoch, taken = self._position
        return {"epoch": epoch, "batches_taken": taken, "rows_digest": self.rows_digest(), "batching": self._batching()}

    def _batching(self) -> dict[str, Any]:
        """What cuts the rows into batches (`TokenBudgetBatchSampler`), by key."""
        shuffled = {"seed": self.seed, **({"epoch_rows": "as_first"} if self.resolved_packing != "none" else {})} if self.shuffle else {}
        return {"max_tokens": self.max_tokens, "packing": self.resolved_packing, "shuffle": self.shuffle, **shuffled}

    def rows_digest(self) -> str:
        """The digest of the training examples as tokenized (each once: the run's data does not change)."""
        if self._rows_digest is None:
            self._rows_digest = rows_digest(
                (array.array("q", e.input_ids).tobytes(), array.array("b", e.loss_mask).tobytes(), [key for key, _ in e.images])
                for e in self.train_examples
            )
        return self._rows_digest

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_same_rows("data.train_data", self.train_data, state.get("rows_digest"), self.rows_digest())
        saved, here = state.get("batching"), self._batching()
        check_same_batching(saved, here)
        if saved is not None and "epoch_rows" in here and "epoch_rows" not in saved and state["epoch"] >= 1:
            raise BatchingChanged(
                f"ckpt_path: the run being resumed (in its data epoch {state['epoch']}) was written by an earlier lightning-rl, whose later "
                "epochs could pack into fewer rows than the first; this one plans every epoch as the first, so it would resume at "
                "other rows: finish the run with that version, or start a new run", "ckpt_path")
        self._position = (state["epoch"], state["batches_taken"])
        self._resume = self._position
        # Lightning warns of a resume inside an epoch when the DataLoader itself keeps no state; the sampler resumes
        # at the batch recorded here, so the warning does not apply to this run.
        warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not resumable")
