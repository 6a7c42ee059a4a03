"""A `PromptSource` over lists of records, for collector tests without a data file."""

from __future__ import annotations

from typing import Any


class PromptList:
    """A `PromptSource` over lists of records: the step's, then those dynamic sampling's rounds draw, one after another
    (given as one list per round)."""

    path = "prompts.jsonl"
    image_folder = None

    def __init__(self, records: list[dict[str, Any]], *rounds: list[dict[str, Any]]) -> None:
        self.records, self.rounds = records, rounds

    def prompt_batch(self, index: int) -> list[dict[str, Any]]:
        return self.records

    def extra_prompts(self, index: int, drawn: int, count: int) -> list[dict[str, Any]]:
        return [r for records in self.rounds for r in records][drawn : drawn + count]

    def location(self, record: dict[str, Any]) -> str:
        return f"prompts.jsonl: line {self.records.index(record) + 1}"

    def columns(self) -> set[str]:
        return set().union(*(set(r) for r in self.records))

    def epoch_of(self, index: int) -> float:
        return float(index)
