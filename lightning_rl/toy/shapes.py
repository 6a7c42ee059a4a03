"""The embedded image task: a coloured square on a plain background, and the question "What colour is the square?".
Images are drawn here (Pillow), deterministically from a seed, into PNG files beside a JSONL of conversations whose
user turn holds the image part (a path relative to the JSONL file). Four colours: chance is 0.25."""

from __future__ import annotations

import json
import random
from pathlib import Path

from lightning_rl.toy.model import cached_build, default_cache_dir

SHAPES_NAMES = {"toy_shapes": "train", "toy_shapes_heldout": "heldout"}
SHAPES_VERSION = 1
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 60, 220), "yellow": (230, 210, 20)}
BACKGROUNDS = [(0, 0, 0), (255, 255, 255), (128, 128, 128)]
QUESTION = "What colour is the square?"
SIZES = {"train": (400, 0), "heldout": (100, 1)}  # (rows, seed)


def write_shapes(folder: str | Path, count: int, seed: int, side: int = 16) -> Path:
    """``count`` rows into ``folder`` (images/NNNN.png and rows.jsonl); the JSONL's path."""
    from PIL import Image, ImageDraw

    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for i in range(count):
        colour = rng.choice(sorted(COLOURS))
        image = Image.new("RGB", (side, side), rng.choice(BACKGROUNDS))
        size = rng.randint(side // 3, side // 2)
        x, y = rng.randint(0, side - size), rng.randint(0, side - size)
        ImageDraw.Draw(image).rectangle([x, y, x + size - 1, y + size - 1], fill=COLOURS[colour])
        name = f"images/{i:04d}.png"
        image.save(folder / name)
        user = [{"type": "image", "image": name}, {"type": "text", "text": QUESTION}]
        lines.append(json.dumps({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": colour}], "answer": colour}))
    path = folder / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def shapes_path(name: str, cache_dir: str | Path | None = None) -> Path:
    """The cached JSONL of ``toy_shapes`` (train) or ``toy_shapes_heldout``, drawn on first use."""
    split = SHAPES_NAMES[name]
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    count, seed = SIZES[split]
    folder = cached_build(cache / f"shapes-v{SHAPES_VERSION}" / split, "rows.jsonl", lambda staging: write_shapes(staging, count, seed))
    return folder / "rows.jsonl"


def toy_source(source):
    """A data source as given, or the JSONL file of an embedded image split named ``toy_shapes`` / ``toy_shapes_heldout``."""
    return str(shapes_path(source)) if isinstance(source, str) and source in SHAPES_NAMES else source
