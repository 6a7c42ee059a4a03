"""DataLoader worker processes that leave the stop signals to the main process.

A scheduler signals every process of a job at once (SLURM: the whole process group). A worker killed by that
signal takes the main process down with a traceback before it reaches the step boundary where ``RequeueOnSignal``
saves. So workers ignore the signals the run stops on; they end with the main process, as they always do.
The signals are held back in the main thread while it forks the workers, and let through in each worker only once
they are ignored: one that comes in between is then neither fatal to a worker nor lost to the main process.
"""

from __future__ import annotations

import functools
import signal
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader

# SIGTERM (what schedulers stop a job with), SIGUSR1 (SLURM's requeue warning), SIGINT (Ctrl-C reaches the whole
# foreground group): the main process handles each.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def _init_worker(worker_id: int, then: Callable[[int], None] | None) -> None:
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    if then is not None:
        then(worker_id)


class WorkerLoader(DataLoader):
    """A DataLoader whose worker processes ignore the stop signals; a ``worker_init_fn`` given runs after that."""

    def __init__(self, *args: Any, worker_init_fn: Callable[[int], None] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, worker_init_fn=functools.partial(_init_worker, then=worker_init_fn), **kwargs)

    def __iter__(self) -> Iterator[Any]:
        # The workers are forked here; they inherit the signal mask of the thread that forks them (a signal meanwhile
        # goes to another thread of this process, or waits until the mask is put back).
        if self.num_workers == 0:
            return super().__iter__()
        held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            return super().__iter__()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
