"""Where the repository and its bundled toy data are, for tests (a module of its own: `conftest` is not
importable by name once several folders have one)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOY_TRAIN = REPO / "lightning_rl" / "assets" / "toy" / "train.jsonl"
TOY_HELDOUT = REPO / "lightning_rl" / "assets" / "toy" / "heldout.jsonl"
