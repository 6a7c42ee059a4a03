"""The first-pass check of an engine against the trainer over the grid of sampling filters (benchmarks/sampling_filters.py
measures it), shared by the transformers engine's test and the vLLM engines' tests."""

from __future__ import annotations

from typing import Any

import torch

from support.benchmarks import load_benchmark


def check_first_pass(engine: Any, trainer: torch.nn.Module, temperature: float, n: int = 2) -> None:
    """Every cell of the grid at ``temperature``: scored over each token's support, the trainer's log-probs equal the
    engine's (mean ratio within 1e-3 of 1, k3 KL below 1e-4); scored over the full softmax, as before the support
    travelled, they are off by each token's kept mass."""
    grid = load_benchmark("sampling_filters")
    for cell in [c for c in grid.GRID if c[0] == temperature]:
        _, top_p, top_k, min_p = cell
        measured = grid.first_pass(engine, trainer, grid.sampling_of(*cell), n=n)
        after, before = measured["after"], measured["before"]
        assert abs(after.ratio_mean - 1) < 1e-3 and after.kl < 1e-4, (cell, after)
        # The kept mass is never above 1, and far below wherever top-p or top-k cut (min-p alone keeps nearly all of
        # the tiny model's flat distribution).
        assert before.ratio_mean <= 1 + 1e-6, (cell, before)
        if top_p < 1 or top_k:
            assert before.ratio_mean < 0.95 and before.kl > 1e-3, (cell, before)
        else:
            assert (measured["widest_support"] > 0) == bool(min_p), (cell, measured)  # no filter: no support travels
