"""A write that found no room on its disk: the error behind a failure, the bytes a write needs, and the one line that
says so; a leaf, for checkpoints (``checkpoints.py``, ``strategies/fsdp2.py``) and the final Hugging Face export
(``models/loading.py``) alike."""

from __future__ import annotations

import errno
import os
import re
import resource
import shutil
from pathlib import Path
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch.distributed.tensor import DTensor

from lightning_rl.errors import UserError


class NoRoomError(UserError):
    """The disk (or the file size limit) had no room for a checkpoint or the export: its partial write is removed,
    the previous one kept."""

    key = "output_dir"


def no_room(error: BaseException | None, folder: Path | None = None, needed: int = 0) -> OSError | None:
    """The disk-full (or file-too-large) error behind ``error``: torch's writer wraps the OSError in its own, a
    sharded write's ``CheckpointException`` holds each failed rank's, and safetensors' writer (in Rust) gives its
    code only in its message.

    Some failures lose the code: torch's zip writer chains the OSError to its own ("unexpected pos"), but a sharded
    save gathers each rank's failure pickled, which drops the chain. So a write into ``folder`` that failed for a
    reason not named (a stop excepted) is also one without room when ``folder``'s disk, or the file size limit,
    has fewer than the ``needed`` bytes."""
    found = _named(error)
    if found is not None or folder is None or error is None or isinstance(error, (KeyboardInterrupt, SystemExit)):
        return found
    if shutil.disk_usage(_existing(folder)).free < needed:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and limit < needed:
        return OSError(errno.EFBIG, os.strerror(errno.EFBIG))
    return None


def _existing(folder: Path) -> Path:
    """``folder``, or its nearest parent that exists (a failed write may have left none)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def _named(error: BaseException | None) -> OSError | None:
    """The ENOSPC, EDQUOT or EFBIG error in ``error``'s chain, if one is there."""
    while error is not None:
        said = None if isinstance(error, OSError) else re.search(r"\(os error (\d+)\)", str(error))
        os_error = OSError(int(said[1]), os.strerror(int(said[1]))) if said else error
        if isinstance(os_error, OSError) and os_error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return os_error
        for failure in getattr(error, "failures", {}).values():  # CheckpointException: rank -> (its error, traceback)
            if (found := _named(failure[0] if isinstance(failure, tuple) else failure)) is not None:
                return found
        error = error.__cause__ or error.__context__
    return None


def tensor_bytes(tensors: Any) -> int:
    """The bytes of every tensor in ``tensors`` (each storage once; a sharded tensor's local shard): about what
    their file takes, or this rank's part of a sharded checkpoint."""
    storages: dict[int, int] = {}

    def count(tensor: torch.Tensor) -> None:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storages.setdefault(local.untyped_storage().data_ptr(), local.untyped_storage().nbytes())

    apply_to_collection(tensors, torch.Tensor, count)
    return sum(storages.values())


def space_error(
    final: Path, needed: int, full: OSError, what: str = "the checkpoint",
    kept: str = "the partial file was removed, earlier checkpoints are kept",
) -> NoRoomError:
    """The one line for ``what`` (``final``) that did not fit: the folder, the bytes it needs, those free, and what
    was removed and kept."""
    free = shutil.disk_usage(_existing(final.parent)).free
    return NoRoomError(
        f"output_dir: no room for {what} {final.name} in {final.parent} ({full.strerror}): it needs about "
        f"{needed} bytes, {free} are free; {kept}"
    )
