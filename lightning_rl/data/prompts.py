"""Prompts for GRPO: records read from a data file, served one batch per optimizer step, and rendered into tokens.

Batch `i` is a pure function of the seed and `i` (a fresh shuffle per pass over the data), so a
resumed run continues with exactly the prompts it would have seen, and the asynchronous rollout
producer can look batches up ahead of the trainer. `PromptSource` is what the rollout side reads of
the prompts; `PromptRenderer` turns one record into the tokens (and images) an engine samples from. Both live in
`lightning_rl.data.rendering`, which the rollout side imports without Lightning, and are named here too.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_rl import validation
from lightning_rl.errors import RecipeError
from lightning_rl.data.images import check_prompt_images
from lightning_rl.data.rendering import PromptRenderer, PromptSource, RenderedPrompt
from lightning_rl.toy.shapes import toy_source
from lightning_rl.data.sft import (
    ROLES, DataError, DataSource, check_same_batching, check_same_rows, check_source, check_template_kwargs, read_rows, rows_digest,
    source_name,
)
from lightning_rl.toy.task import PROBLEMS_FILE

TOY_DATASET = "toy"
__all__ = ["TOY_DATASET", "PromptDataModule", "PromptRenderer", "PromptSource", "RenderedPrompt", "read_prompt_records"]


def read_prompt_records(source: DataSource, prompt_field: str) -> list[tuple[str, dict[str, Any]]]:
    """Every row of a data file (JSONL, JSON, Parquet or a saved dataset, read as for SFT), with where it is (``FILE:
    line N`` or ``FILE: row N``); each must hold a non-empty `prompt_field` (a string, or a list of chat messages
    whose trailing assistant turns are dropped)."""
    name, rows = read_rows(source, "data.train_data")
    records = []
    for where, row in rows:
        if not isinstance(row, dict) or row.get(prompt_field) is None:
            keys = sorted(k for k, v in row.items() if v is not None) if isinstance(row, dict) else type(row).__name__
            raise DataError(f"{name}: {where}: no field {prompt_field!r} (row has {keys})")
        prompt = row[prompt_field]
        if isinstance(prompt, list):
            while prompt and isinstance(prompt[-1], dict) and prompt[-1].get("role") == "assistant":
                prompt = prompt[:-1]
        if not isinstance(prompt, (str, list)) or not (prompt.strip() if isinstance(prompt, str) else prompt):  # whitespace: empty, as SFT reads it
            raise DataError(f"{name}: {where}: field {prompt_field!r} must be a non-empty string or message list")
        try:
            prompt = _text_parts_joined(prompt, prompt_field) if isinstance(prompt, list) else prompt
            check_template_kwargs(row.get("chat_template_kwargs") or {})
        except ValueError as error:
            raise DataError(f"{name}: {where}: {error}") from None
        if records and isinstance(prompt, str) != isinstance(records[0][1]["prompt"], str):
            kinds = ("chat messages", "a string") if isinstance(prompt, str) else ("a string", "chat messages")
            raise DataError(f"{name}: {where}: field {prompt_field!r} is {kinds[1]}, where {records[0][0]} gives {kinds[0]}: "
                            "rewards read the prompts and completions of a step as text or as messages, so give every row's one way")
        records.append((f"{name}: {where}", {**row, "prompt": prompt}))
    if not records:  # named by its key too: one file may be given as two
        raise DataError(f"{name}: no rows" if name.startswith("data.train_data") else f"data.train_data: {name}: no rows")
    return records


def _text_parts_joined(messages: list[Any], field: str) -> list[dict[str, Any]]:
    """A prompt's chat messages, checked as messages; in a prompt without images, a turn given as text parts (TRL's
    typed content, how Parquet and `datasets` store turns) is its text, as a text-only template renders it."""
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"`{field}[{k}]` must be an object with `role` and `content`, got {type(message).__name__}")
        if message["role"] not in ROLES:  # checked as SFT checks it, before the first step, not trained on as is
            raise ValueError(f"`{field}[{k}]`: unknown role {message['role']!r} (expected one of {', '.join(ROLES)})")
        content = message.get("content")
        if not isinstance(content, (str, list)) and not (message["role"] == "assistant" and message.get("tool_calls")):
            raise ValueError(f"`{field}[{k}]`: `content` must be a string or a list of parts, got {type(content).__name__}")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, dict) or part.get("type") not in ("text", "image") or (part["type"] == "text" and not isinstance(part.get("text"), str)):
                raise ValueError(f"`{field}[{k}].content[{j}]` must be {{\"type\": \"text\", \"text\": ...}} or an image part")
            if part["type"] == "image" and message["role"] == "assistant":
                raise ValueError(f"`{field}[{k}].content[{j}]`: an image in an assistant turn (the model reads images in user "
                                 "and system turns; its processor places none in its own)")
    if any(part.get("type") != "text" for m in messages if isinstance(m.get("content"), list) for part in m["content"]):
        return messages  # images: the processor's template reads the parts
    return [{**m, "content": "".join(p["text"] for p in m["content"])} if isinstance(m.get("content"), list) else m for m in messages]


class _StepIndices(IterableDataset):
    """Yields the batch index of every step from the trainer's current step on, without end."""

    def __init__(self, datamodule: PromptDataModule) -> None:
        self.datamodule = datamodule

    def __iter__(self) -> Iterator[int]:
        trainer = self.datamodule.trainer
        index = trainer.global_step if trainer is not None else 0
        while True:
            yield index
            index += 1


class PromptDataModule(L.LightningDataModule):
    """Serves `batch_size` prompt records per step and rank (each expanded into `num_generations` rollouts by the
    GRPO module).

    Args:
        train_data: a data file (JSONL, JSON, Parquet) or saved dataset folder; ``toy``: the embedded task's problems.
            TRL: `dataset_name`.
        prompt_field: the column holding the prompt: a string, or chat messages (trailing assistant turns dropped);
            every other column reaches the reward functions.
        batch_size: prompts per optimizer step and rank (times ``model.num_generations`` completions). TRL's
            per_device_train_batch_size counts completions: its per_device_train_batch_size x
            gradient_accumulation_steps / num_generations.
        seed: the order of the prompts, a fresh shuffle per pass (a recipe's top-level ``seed``).
        path: the earlier name of ``train_data`` (the name SFT gives its data file too); still read, and said so.
    """

    def __init__(
        self, train_data: str = TOY_DATASET, prompt_field: str = "prompt", batch_size: int = 8, seed: int = 0,
        path: str | None = None,
    ) -> None:
        super().__init__()
        validation.positive_int("batch_size", batch_size)
        key = "train_data"
        if path is not None:
            if train_data != TOY_DATASET:
                raise RecipeError(f"path is the earlier name of train_data: give only train_data, got both ({path!r}, {train_data!r})", "path")
            print("note: data.path is the earlier name of data.train_data; write data.train_data", file=sys.stderr)
            key, train_data = "path", path
        path = toy_source(train_data)  # toy_shapes: the embedded image task's prompts
        if path != TOY_DATASET:
            check_source(key, path)
        self.train_data: DataSource = str(PROBLEMS_FILE) if path == TOY_DATASET else path  # a file, or rows from Python
        self.path = source_name(self.train_data)
        self.prompt_field = "messages" if path == TOY_DATASET else prompt_field
        self.batch_size = batch_size
        self.seed = seed
        self._records: list[dict[str, Any]] = []  # read at setup, or when first asked for (a collector built before it)
        self._locations: dict[int, str] = {}  # id of a record -> where it is in the data
        self._orders: dict[int, list[int]] = {}
        self._rows_digest: str | None = None

    @property
    def records(self) -> list[dict[str, Any]]:
        """Every prompt record of the data."""
        self.setup()
        return self._records

    def setup(self, stage: str | None = None) -> None:
        if not self._records:
            located = read_prompt_records(self.train_data, self.prompt_field)
            folder = self.image_folder
            for where, record in located:  # every prompt's images now (cheaply), rather than a broken one mid-run
                try:
                    check_prompt_images(record, folder)
                except ValueError as error:
                    raise DataError(f"{where}: {error}") from None
            self._records = [record for _, record in located]
            self._locations = {id(record): where for where, record in located}

    def state_dict(self) -> dict[str, Any]:
        return {"rows_digest": self.rows_digest(), "batching": {"batch_size": self.batch_size, "seed": self.seed}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_same_rows("data.train_data", self.path, state.get("rows_digest"), self.rows_digest())
        check_same_batching(state.get("batching"), {"batch_size": self.batch_size, "seed": self.seed})  # which prompts a step takes

    def rows_digest(self) -> str:
        """The digest of the prompt records (once: the run's data does not change)."""
        if self._rows_digest is None:
            self._rows_digest = rows_digest(iter(self.records))
        return self._rows_digest

    def location(self, record: dict[str, Any]) -> str:
        """Where a record of ``prompt_batch`` is in the data: ``FILE: line N`` (JSONL) or ``FILE: row N``."""
        return self._locations.get(id(record), self.path)

    def batches_per_epoch(self) -> None:
        """None: the prompt batches come without end (a run stops at trainer.max_steps)."""
        return None

    def columns(self) -> set[str]:
        return set().union(*(set(record) for record in self.records))

    def epoch_of(self, index: int) -> float:
        return index * self.batch_size * self._rank_and_world[1] / len(self.records)

    @property
    def image_folder(self) -> Path | None:
        """The data file's folder (a saved dataset's images, and those of rows given from Python, are in its rows or
        relative to the working directory)."""
        if not isinstance(self.train_data, (str, os.PathLike)):
            return None
        return Path(self.train_data).expanduser().parent if Path(self.train_data).expanduser().is_file() else None

    @property
    def _rank_and_world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def prompt_batch(self, index: int) -> list[dict[str, Any]]:
        """This rank's prompt records of step `index`."""
        records, (rank, world) = self.records, self._rank_and_world
        per_step = self.batch_size * world
        first = index * per_step + rank * self.batch_size
        return [records[self._record_at(position)] for position in range(first, first + self.batch_size)]

    def _record_at(self, position: int) -> int:
        """The record at ``position`` of the passes over the prompts, one shuffled order per pass."""
        epoch, offset = divmod(position, len(self.records))
        return self._epoch_order(epoch)[offset]

    def extra_prompts(self, index: int, drawn: int, count: int) -> list[dict[str, Any]]:
        """``count`` more records for step `index`'s dynamic sampling, after the ``drawn`` its earlier rounds took:
        places ``drawn`` on of this rank's share of one order of the prompts that are not the step's (on any rank),
        drawn by a generator seeded by the step: every ``world``-th place from the rank's. Within one pass of that order
        over the other prompts no round draws a prompt of the step, of an earlier round or of another rank; a rank that
        draws past the pass (the others drawing fewer) may meet one another rank took. A resumed run draws the same."""
        records, (rank, world) = self.records, self._rank_and_world
        n, first = len(records), index * self.batch_size * world
        steps = {self._record_at(p) for p in range(first, first + self.batch_size * world)}
        excluded = steps if len(steps) < n else set()  # a step holding every prompt: its own are drawn again
        rng = random.Random((self.seed * 100_003 + index) * 65_537)
        order: list[int] = []
        seen: set[int] = set()
        while len(order) < (drawn + count) * world:
            if len(seen) == n - len(excluded):  # every other prompt drawn: another pass over them
                seen = set()
            i = rng.randrange(n)
            if i not in excluded and i not in seen:
                seen.add(i)
                order.append(i)
        return [records[i] for i in order[rank::world][drawn:]]

    def _epoch_order(self, epoch: int) -> list[int]:
        orders = self._orders  # read once: another producer thread may replace it meanwhile
        if epoch not in orders:
            order = list(range(len(self.records)))
            random.Random(self.seed * 100_003 + epoch).shuffle(order)
            orders = self._orders = {epoch: order}  # only the current pass is kept
        return orders[epoch]

    def train_dataloader(self) -> DataLoader:
        # Its own generator: an iterator draws a base seed, which from the global generator would move dropout's.
        return DataLoader(_StepIndices(self), batch_size=None, num_workers=0, generator=torch.Generator())
