"""The bundled toy task: short, verifiable digit problems in chat form.

Two kinds of problem, each with exactly one correct answer so a run can be scored by exact match:
``add`` ("37+48=" -> "85") and ``reverse`` ("reverse 4 0 7 1" -> "1 7 0 4"). Every conversation
starts with the same system prompt, so a batch shares a prefix that tree packing forwards once.

Regenerate the bundled files with ``python -m lightning_rl.data.toy``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

SYSTEM_PROMPT = "You are a careful calculator. Reply with the answer only, nothing else."
ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets" / "toy"
TRAIN_FILE = ASSETS_DIR / "train.jsonl"
HELDOUT_FILE = ASSETS_DIR / "heldout.jsonl"


def _add_problem(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(100), rng.randrange(100)
    return f"{a}+{b}=", str(a + b)


def _reverse_problem(rng: random.Random) -> tuple[str, str]:
    digits = [str(rng.randrange(10)) for _ in range(rng.randint(3, 6))]
    return "reverse " + " ".join(digits), " ".join(reversed(digits))


PROBLEMS = {"add": _add_problem, "reverse": _reverse_problem}


def toy_example(kind: str, question: str, answer: str) -> dict:
    """One row in the SFT ``messages`` shape, with the reference ``answer`` kept beside it."""
    return {
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ],
        "answer": answer,
        "kind": kind,
    }


def generate(num_train: int, num_heldout: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Distinct problems split into train and held-out; no held-out question appears in train."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    kinds = sorted(PROBLEMS)
    while len(rows) < num_train + num_heldout:
        kind = kinds[len(rows) % len(kinds)]
        question, answer = PROBLEMS[kind](rng)
        if question in seen:
            continue
        seen.add(question)
        rows.append(toy_example(kind, question, answer))
    rng.shuffle(rows)
    return rows[num_heldout:], rows[:num_heldout]


def write_jsonl(rows: list[dict], path: Path) -> None:
    """Write rows atomically: a reader never sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.replace(path)


def read_jsonl(path: Path) -> Iterator[dict]:
    with open(path) as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def main() -> None:
    train, heldout = generate(num_train=4000, num_heldout=200)
    write_jsonl(train, TRAIN_FILE)
    write_jsonl(heldout, HELDOUT_FILE)
    print(f"wrote {len(train)} train rows to {TRAIN_FILE} and {len(heldout)} held-out rows to {HELDOUT_FILE}")


if __name__ == "__main__":
    main()
