"""The bundled toy task: short, verifiable digit problems in chat form.

Two kinds of problem, each with exactly one correct answer so a run can be scored by exact match:
``add`` ("37+8=" -> "45") and ``max`` ("max 4 0 7 1 3" -> "7"). Every conversation starts with the same
system prompt, so a batch shares a prefix that tree packing forwards once.

Three files, as a post-training project has them:

- ``problems.jsonl``: every training problem with its answer, 900 of each kind: GRPO's prompts (the answer is the
  reward's reference) and the tokenizer's corpus.
- ``train.jsonl``: the demonstrations SFT learns from: every ``add`` problem, but only the first
  ``MAX_DEMONSTRATIONS`` ``max`` problems. Demonstrations are scarce where verifiable prompts are not, so SFT leaves
  ``max`` half learnt and GRPO, from the SFT model, learns it from the reward (``recipes/tiny/grpo_from_sft.yaml``).
- ``heldout.jsonl``: 100 problems of each kind that are in neither, for the one evaluator both recipes use (greedy
  decoding, exact match).

Regenerate the bundled files with ``python -m lightning_rl.toy.task``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

SYSTEM_PROMPT = "You are a careful calculator. Reply with the answer only, nothing else."
ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets" / "toy"
PROBLEMS_FILE = ASSETS_DIR / "problems.jsonl"
TRAIN_FILE = ASSETS_DIR / "train.jsonl"
HELDOUT_FILE = ASSETS_DIR / "heldout.jsonl"
MAX_DEMONSTRATIONS = 40


def _add_problem(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(100), rng.randrange(10)
    return f"{a}+{b}=", str(a + b)


def _max_problem(rng: random.Random) -> tuple[str, str]:
    digits = [rng.randrange(10) for _ in range(5)]
    return "max " + " ".join(map(str, digits)), str(max(digits))


PROBLEMS = {"add": _add_problem, "max": _max_problem}


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


def generate(per_kind_train: int, per_kind_heldout: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Distinct problems of each kind split into train and held-out; no held-out question is in train."""
    rng = random.Random(seed)
    train: list[dict] = []
    heldout: list[dict] = []
    for kind, problem in sorted(PROBLEMS.items()):
        seen: dict[str, str] = {}
        while len(seen) < per_kind_train + per_kind_heldout:
            question, answer = problem(rng)
            seen.setdefault(question, answer)
        rows = [toy_example(kind, q, a) for q, a in seen.items()]
        rng.shuffle(rows)
        heldout += rows[:per_kind_heldout]
        train += rows[per_kind_heldout:]
    rng.shuffle(train)
    rng.shuffle(heldout)
    return train, heldout


def demonstrations(problems: list[dict], max_demonstrations: int = MAX_DEMONSTRATIONS) -> list[dict]:
    """The SFT split: every ``add`` problem and the first ``max_demonstrations`` ``max`` ones, in their order."""
    kept, seen_max = [], 0
    for row in problems:
        if row["kind"] == "max":
            seen_max += 1
            if seen_max > max_demonstrations:
                continue
        kept.append(row)
    return kept


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
    problems, heldout = generate(per_kind_train=900, per_kind_heldout=100)  # `add` has 1000 problems in all
    train = demonstrations(problems)
    write_jsonl(problems, PROBLEMS_FILE)
    write_jsonl(train, TRAIN_FILE)
    write_jsonl(heldout, HELDOUT_FILE)
    print(f"wrote {len(problems)} problems to {PROBLEMS_FILE}, {len(train)} demonstrations to {TRAIN_FILE} and "
          f"{len(heldout)} held-out rows to {HELDOUT_FILE}")


if __name__ == "__main__":
    main()
