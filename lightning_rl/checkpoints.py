"""Checkpoints that are whole or absent: staged beside their final name, renamed into place, verified on resume.

Every checkpoint, a single file or a sharded folder, is written as ``NAME.staging`` and renamed to ``NAME`` once
complete, so a kill at any moment leaves the previous ``NAME`` (or none) plus a staging leftover, which the next run
promotes if it is complete and removes if not (``clean_staging``). A folder gets ``manifest.json`` last: its global
step and the size of every file in it. A checkpoint is complete when its manifest matches its files or, for a single
file, when ``torch.load(weights_only=True)`` reads it.

``newest_complete`` is what ``--ckpt_path=last`` resumes from: the complete checkpoint of the run with the highest
global step, whatever its name (``last.ckpt``, ``last-v1.ckpt``, ``step=N.ckpt``, ``hpc_ckpt_N.ckpt``).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.plugins.io.xla import XLACheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from lightning_rl.errors import UserError

STAGING = ".staging"  # being written
TRASH = ".trash"  # being replaced or removed
MANIFEST = "manifest.json"


class IncompleteCheckpointError(ValueError):
    """A checkpoint that was not written completely (or was damaged since)."""


class ForeignCheckpointError(UserError, ValueError):
    """A checkpoint to resume from that holds another module's weights (another task, model or LoRA layout)."""

    key = "ckpt_path"
    on_every_rank = True  # every rank reads the same checkpoint and finds the same mismatch


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int


def staging_path(path: Path) -> Path:
    return path.with_name(path.name + STAGING)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _delete(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def remove(path: Path) -> None:
    """Remove a checkpoint: renamed aside first, so a kill midway never leaves a half-deleted ``NAME``."""
    if not (path.exists() or path.is_symlink()):
        return
    trash = path.with_name(path.name + TRASH)
    _delete(trash)
    os.replace(path, trash)
    _delete(trash)


def commit(staging: Path, final: Path) -> None:
    """Rename a complete staged checkpoint to ``final``, replacing what was there."""
    if final.is_dir() or (staging.is_dir() and final.exists()):
        # One rename cannot replace a folder: move the old one aside. A kill between the two renames leaves a
        # complete staging folder and no ``final``, which ``clean_staging`` promotes.
        trash = final.with_name(final.name + TRASH)
        _delete(trash)
        os.replace(final, trash)
        os.replace(staging, final)
        _delete(trash)
    else:
        os.replace(staging, final)
    _fsync(final.parent)


def write_manifest(folder: Path, global_step: int) -> None:
    """The completeness marker of a sharded checkpoint, written once every shard is on disk."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        _fsync(path)
        files[path.relative_to(folder).as_posix()] = path.stat().st_size
    manifest = folder / MANIFEST
    with open(manifest, "w") as f:
        json.dump({"global_step": int(global_step), "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync(folder)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def checkpoint_step(path: Path) -> int:
    """The global step of a complete checkpoint; ``IncompleteCheckpointError`` saying why when it is not complete."""
    if path.is_dir():
        manifest = path / MANIFEST
        if not manifest.is_file():
            raise IncompleteCheckpointError(f"no {MANIFEST}: the write did not finish")
        try:
            recorded = json.loads(manifest.read_text())
            files, step = dict(recorded["files"]), int(recorded["global_step"])
        except (ValueError, KeyError, TypeError) as error:
            raise IncompleteCheckpointError(f"unreadable {MANIFEST} ({_first_line(error)})") from None
        for name, size in files.items():
            file = path / name
            if not file.is_file():
                raise IncompleteCheckpointError(f"{name} is missing")
            if file.stat().st_size != size:
                raise IncompleteCheckpointError(f"{name} has {file.stat().st_size} bytes, the manifest says {size}")
        return step
    try:
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError:  # readable, but holds objects weights_only refuses: the run's own file
            checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as error:  # a truncated zip, an empty file, anything torch cannot read
        raise IncompleteCheckpointError(f"unreadable ({_first_line(error)})") from None
    if not isinstance(checkpoint, dict) or "global_step" not in checkpoint:
        raise IncompleteCheckpointError("not a Lightning checkpoint (no global_step)")
    return int(checkpoint["global_step"])


def check_weights_fit(checkpoint: dict[str, Any], module: torch.nn.Module, path: Any) -> None:
    """Refuse, before anything is loaded, a checkpoint whose weights are not exactly ``module``'s: the same names and
    shapes, as only a checkpoint of the same task, model and LoRA layout has. (A sharded checkpoint is read by its
    strategy, which names what it misses itself.)"""
    found = checkpoint.get("state_dict")
    if not isinstance(found, dict):
        return
    expected = module.state_dict()
    missing = [name for name in expected if name not in found]
    unexpected = [name for name in found if name not in expected]
    reshaped = [name for name in expected if name in found and tuple(found[name].shape) != tuple(expected[name].shape)]
    if not (missing or unexpected or reshaped):
        return
    said = [f"{len(names)} {what} (first: {names[0]})" for what, names in
            (("of the model's weights missing", missing), ("weights the model does not have", unexpected)) if names]  # fmt: skip
    if reshaped:
        name = reshaped[0]
        said.append(f"{len(reshaped)} of another shape (first: {name}, {list(found[name].shape)} there, {list(expected[name].shape)} here)")
    raise ForeignCheckpointError(
        f"ckpt_path: {path} holds another module's weights ({'; '.join(said)}): it was written by another task, model "
        "or LoRA layout than this recipe's"
    )


def checkpoint_folders(output_dir: Path) -> list[Path]:
    """Where a run keeps checkpoints: ``checkpoints/`` (periodic, ``last``) and the run folder (signal checkpoints)."""
    return [output_dir / "checkpoints", output_dir]


def clean_staging(output_dir: Path) -> list[str]:
    """Promote complete staged checkpoints whose final name is missing, remove every other leftover of a kill.

    Only one process may call this: the one that holds the run folder's lock. Returns what it did, one phrase each.
    """
    done = []
    for folder in checkpoint_folders(output_dir):
        if not folder.is_dir():
            continue
        for staged in sorted(folder.glob(f"*.ckpt{STAGING}")):
            final = staged.with_name(staged.name.removesuffix(STAGING))
            try:
                checkpoint_step(staged)
                complete = True
            except IncompleteCheckpointError:
                complete = False
            if complete and not (final.exists() or final.is_symlink()):
                commit(staged, final)
                done.append(f"renamed the complete {staged.relative_to(output_dir)} into place")
            else:
                _delete(staged)
                done.append(f"removed {staged.relative_to(output_dir)}, left by a killed write")
        for trash in sorted(folder.glob(f"*.ckpt{TRASH}")):
            _delete(trash)
            done.append(f"removed {trash.relative_to(output_dir)}, left by a killed write")
    return done


def newest_complete(output_dir: Path) -> tuple[Checkpoint | None, list[tuple[Path, str]]]:
    """The complete checkpoint of the run with the highest global step (the newer file on a tie), and the
    incomplete ones found beside it that are newer than it, each with the reason."""
    complete: list[tuple[int, int, Path]] = []
    incomplete: list[tuple[int, Path, str]] = []
    for folder in checkpoint_folders(output_dir):
        for path in sorted(folder.glob("*.ckpt")) if folder.is_dir() else ():
            mtime = path.stat().st_mtime_ns
            try:
                complete.append((checkpoint_step(path), mtime, path))
            except IncompleteCheckpointError as error:
                incomplete.append((mtime, path, str(error)))
    if not complete:
        return None, [(path, reason) for _, path, reason in sorted(incomplete, reverse=True)]
    step, mtime, path = max(complete)
    return Checkpoint(path, step), [(p, reason) for m, p, reason in sorted(incomplete, reverse=True) if m >= mtime]


def write_staged(checkpoint: dict[str, Any], final: Path) -> None:
    """Write a single-file checkpoint as ``final.staging``, flush it to disk, then rename it to ``final``."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_path(final)
    _delete(staging)
    with open(staging, "wb") as f:
        torch.save(checkpoint, f)
        f.flush()
        os.fsync(f.fileno())
    commit(staging, final)


def _local(path: Any, storage_options: Any | None = None) -> bool:
    return storage_options is None and "://" not in str(path)


class StagedCheckpointIO(TorchCheckpointIO):
    """Lightning's default writer, staged: single-file checkpoints written by ``write_staged`` and removed through a
    rename. Local paths only; other URLs go through Lightning's own writer."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if not _local(path, storage_options):
            return super().save_checkpoint(checkpoint, path, storage_options)
        write_staged(checkpoint, Path(path))

    @override
    def remove_checkpoint(self, path: Any) -> None:
        if not _local(path):
            return super().remove_checkpoint(path)
        remove(Path(path))


class StagedXLACheckpointIO(XLACheckpointIO):
    """Lightning's XLA writer, staged: every tensor copied to the host (an XLA tensor is not serialised from the
    device), then written by ``write_staged``. Needs torch_xla, like the writer it replaces; untested here."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if not _local(path, storage_options):
            return super().save_checkpoint(checkpoint, path, storage_options)
        write_staged(apply_to_collection(checkpoint, torch.Tensor, lambda t: t.detach().cpu()), Path(path))

    @override
    def remove_checkpoint(self, path: Any) -> None:
        if not _local(path):
            return super().remove_checkpoint(path)
        remove(Path(path))


def staged_checkpoint_io(current: CheckpointIO) -> CheckpointIO:
    """The staged writer that replaces a strategy's stock one (Lightning's default, or its XLA writer). A writer the
    user chose is kept as it is."""
    if type(current) is TorchCheckpointIO:
        return StagedCheckpointIO()
    if type(current) is XLACheckpointIO:
        return StagedXLACheckpointIO()
    return current
