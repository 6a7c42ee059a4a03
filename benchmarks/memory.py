"""Memory measurements that work on a CPU: peak allocated bytes of a call, and bytes autograd saves for backward."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile


def peak_memory_bytes(fn: Callable[[], object]) -> int:
    """Peak of bytes allocated (above what was live before) while ``fn`` runs, from the profiler's allocation events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


@contextmanager
def saved_for_backward(exclude: torch.nn.Module | None = None):
    """Distinct storage bytes autograd saves inside the block (``with saved_for_backward(model) as saved:``),
    not counting the parameters of ``exclude``: what a layout costs in activations."""
    params = {p.untyped_storage().data_ptr() for p in exclude.parameters()} if exclude is not None else set()
    seen: dict[int, int] = {}
    box = {"bytes": 0}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() in params:
            return t
        seen.setdefault(storage.data_ptr(), storage.nbytes())
        box["bytes"] = sum(seen.values())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield box
