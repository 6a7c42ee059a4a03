"""Prompts for GRPO: records read from a data file, served one batch per optimizer step.

Batch `i` is a pure function of the seed and `i` (a fresh shuffle per pass over the data), so a
resumed run continues with exactly the prompts it would have seen, and the asynchronous rollout
producer can look batches up ahead of the trainer.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, IterableDataset

from lightning_rl import validation
from lightning_rl.data.images import check_prompt_images
from lightning_rl.toy.shapes import toy_source
from lightning_rl.data.sft import DataError, DataSource, check_source, read_rows
from lightning_rl.toy.task import PROBLEMS_FILE

TOY_DATASET = "toy"


def read_prompt_records(source: DataSource, prompt_field: str) -> list[tuple[str, dict[str, Any]]]:
    """Every row of a data file (JSONL, JSON, Parquet or a saved dataset, read as for SFT), with where it is (``FILE:
    line N`` or ``FILE: row N``); each must hold a non-empty `prompt_field` (a string, or a list of chat messages
    whose trailing assistant turns are dropped)."""
    name, rows = read_rows(source)
    records = []
    for where, row in rows:
        if not isinstance(row, dict) or row.get(prompt_field) is None:
            keys = sorted(k for k, v in row.items() if v is not None) if isinstance(row, dict) else type(row).__name__
            raise DataError(f"{name}: {where}: no field {prompt_field!r} (row has {keys})")
        prompt = row[prompt_field]
        if isinstance(prompt, list):
            while prompt and isinstance(prompt[-1], dict) and prompt[-1].get("role") == "assistant":
                prompt = prompt[:-1]
        if not prompt or not isinstance(prompt, (str, list)):
            raise DataError(f"{name}: {where}: field {prompt_field!r} must be a non-empty string or message list")
        records.append((f"{name}: {where}", {**row, "prompt": prompt}))
    if not records:
        raise DataError(f"{name}: no rows")
    return records


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
        path: a data file (JSONL, JSON, Parquet) or saved dataset folder; ``toy``: the embedded task's problems.
        prompt_field: the column holding the prompt: a string, or chat messages (trailing assistant turns dropped);
            every other column reaches the reward functions.
        batch_size: prompts per optimizer step and rank.
        seed: the order of the prompts, a fresh shuffle per pass (a recipe's top-level ``seed``).
    """

    def __init__(
        self, path: str = TOY_DATASET, prompt_field: str = "prompt", batch_size: int = 8, seed: int = 0
    ) -> None:
        super().__init__()
        validation.positive_int("batch_size", batch_size)
        path = toy_source(path)  # toy_shapes: the embedded image task's prompts
        if path != TOY_DATASET:
            check_source("path", path)
        self.path = str(PROBLEMS_FILE) if path == TOY_DATASET else path
        self.prompt_field = "messages" if path == TOY_DATASET else prompt_field
        self.batch_size = batch_size
        self.seed = seed
        self.records: list[dict[str, Any]] = []
        self._locations: dict[int, str] = {}  # id of a record -> where it is in the data
        self._orders: dict[int, list[int]] = {}

    def setup(self, stage: str | None = None) -> None:
        if not self.records:
            located = read_prompt_records(self.path, self.prompt_field)
            folder = Path(self.path).parent if Path(self.path).is_file() else None
            for where, record in located:  # every prompt's images now (cheaply), rather than a broken one mid-run
                try:
                    check_prompt_images(record, folder)
                except ValueError as error:
                    raise DataError(f"{where}: {error}") from None
            self.records = [record for _, record in located]
            self._locations = {id(record): where for where, record in located}

    def location(self, record: dict[str, Any]) -> str:
        """Where a record of ``prompt_batch`` is in the data: ``FILE: line N`` (JSONL) or ``FILE: row N``."""
        return self._locations.get(id(record), self.path)

    @property
    def _rank_and_world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def prompt_batch(self, index: int) -> list[dict[str, Any]]:
        """This rank's prompt records of step `index`."""
        self.setup()
        rank, world = self._rank_and_world
        per_step = self.batch_size * world
        first = index * per_step + rank * self.batch_size
        picked = []
        for position in range(first, first + self.batch_size):
            epoch, offset = divmod(position, len(self.records))
            picked.append(self.records[self._epoch_order(epoch)[offset]])
        return picked

    def extra_prompts(self, index: int, round: int, count: int) -> list[dict[str, Any]]:
        """``count`` more records for step `index` (dynamic sampling's round ``round``, from 1): drawn without
        replacement by a generator seeded by the step, the round and this rank, so a resumed run draws the same."""
        self.setup()
        rank, _ = self._rank_and_world
        rng = random.Random(((self.seed * 100_003 + index) * 1_009 + round) * 65_537 + rank)
        return [self.records[i] for i in rng.sample(range(len(self.records)), min(count, len(self.records)))]

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.records)))
            random.Random(self.seed * 100_003 + epoch).shuffle(order)
            self._orders = {epoch: order}  # only the current pass is kept
        return self._orders[epoch]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_StepIndices(self), batch_size=None, num_workers=0)
