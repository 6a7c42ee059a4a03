"""How a test's distributed worker ends."""

import os
import sys
from typing import NoReturn

import torch.distributed as dist


def leave_worker() -> NoReturn:
    """Destroy the process groups, then exit 0 without the interpreter's teardown.

    Call it once the worker's results are on disk. Now and then, after every collective has finished and
    the groups have been destroyed, gloo's threads abort the process while the interpreter tears down
    ("terminate called without an active exception", SIGABRT). The result is complete by then, so the exit
    code must not report a failure the checks never saw.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
