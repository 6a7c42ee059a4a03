"""Checkpoints that are whole or absent: staged beside their final name, renamed into place, verified on resume.

Every checkpoint, a single file or a sharded folder, is written as ``NAME.staging`` and renamed to ``NAME`` once
complete, so a kill at any moment leaves the previous ``NAME`` (or none) plus a staging leftover, which the next run
removes (``clean_staging``; a staged folder it promotes if it is complete). A folder gets ``manifest.json`` last: its
global step and the size of every file in it. A checkpoint is complete when its manifest matches its files or, for a
single file, when ``torch.load(weights_only=True)`` reads it and it holds what Lightning resumes from (``RESUME_KEYS``).

No code runs from a checkpoint: nothing on disk is unpickled beyond what ``torch.load(weights_only=True)`` admits.
A file it refuses is not a checkpoint of this run (``ForeignFileError``), never read another way; a sharded folder's
pickled parts (torch.distributed.checkpoint's ``.metadata`` and the plain values among its shards, which that library
itself unpickles without restriction) are read here first by safe readers, and refused the same way.

``newest_complete`` is what ``--ckpt_path=last`` resumes from: the complete checkpoint of the run with the highest
global step, whatever its name (``last.ckpt``, ``last-v1.ckpt``, ``step=N.ckpt``, ``hpc_ckpt_N.ckpt``).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.plugins.io.xla import XLACheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from lightning_rl.disk_space import no_room, space_error, tensor_bytes
from lightning_rl.errors import UserError

# What Lightning reads of a single-file checkpoint to resume a run from it: what every checkpoint of a run holds.
RESUME_KEYS = ("pytorch-lightning_version", "global_step", "state_dict", "optimizer_states", "lr_schedulers", "loops")
STAGING = ".staging"  # being written
TRASH = ".trash"  # being replaced or removed
MANIFEST = "manifest.json"


class IncompleteCheckpointError(ValueError):
    """A checkpoint that was not written completely (or was damaged since)."""

    what = "incomplete"


class NotACheckpointError(IncompleteCheckpointError):
    """A folder that holds no part of a sharded checkpoint (a run's folder, its ``hf/``), or a file that is no
    ``torch.save`` file (a recipe, a log): no write of a checkpoint ever began there."""

    what = "not a checkpoint"


class NotALightningCheckpointError(IncompleteCheckpointError):
    """A ``torch.save`` file without every key of ``RESUME_KEYS`` (saved with weights only, or by hand): Lightning
    would fail on it with a KeyError, after the run had started."""

    what = "not a Lightning checkpoint"


class ForeignFileError(IncompleteCheckpointError):
    """A file holding objects our checkpoints never hold, which the safe readers refuse: never read another way."""

    what = "not a checkpoint of this run"


class ForeignCheckpointError(UserError, ValueError):
    """A checkpoint this run cannot resume: none complete, one another kind of run wrote (another task, model, LoRA
    or optimizer layout, other weights) or one already past the run's end."""

    key = "ckpt_path"
    on_every_rank = True  # every rank reads the same checkpoint and finds the same mismatch


class ForeignWeightsError(ForeignCheckpointError):
    """A checkpoint whose weights are not this module's (other names or shapes): what a changed recipe key that adds or
    removes weights gives too (``loss.beta`` and the reference model), and then that key is named instead."""


def every_ranks(state: dict[str, Any]) -> dict[str, Any]:
    """A module's own resume state as its checkpoint keeps it: every rank's, in rank order (one rank writes the file,
    and a rank's state can be its own, such as the batch it is training). A collective: every rank saves together."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {"per_rank": [state]}
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return {"per_rank": states}


def this_ranks(saved: dict[str, Any], trainer: Any, holds_work: Any) -> dict[str, Any]:
    """This rank's state of a checkpoint ``every_ranks`` wrote (an older one holds one state for all). Another number
    of ranks may resume only where no rank's state holds work of its own (``holds_work``: a batch being trained, or
    rollouts queued), which could not be dealt to the ranks now."""
    rank, world_size, path = trainer.global_rank, trainer.world_size, trainer.ckpt_path
    per_rank = saved.get("per_rank")
    if per_rank is None:
        return saved
    if len(per_rank) != world_size:
        if any(holds_work(state) for state in per_rank):
            raise ForeignCheckpointError(
                f"ckpt_path: {path} was written by {len(per_rank)} ranks, in the middle of their own rollouts; this run has "
                f"{world_size}: resume with {len(per_rank)}, or from a checkpoint between batches"
            )
        return per_rank[0]
    return per_rank[rank]


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


def _refused(error: pickle.UnpicklingError, reader: str = "torch.load(weights_only=True)") -> ForeignFileError:
    """What the safe reader refused, in a few words (each names the global it would have had to import)."""
    found = re.search(r"GLOBAL (\S+)", str(error)) or re.search(r"global '([\w.]+)'", str(error))
    held = found[1] if found else _first_line(error)
    return ForeignFileError(f"it holds {held}, which {reader} refuses")


def load_safely(source: Any) -> Any:
    """``torch.load(weights_only=True)`` of a file or buffer: tensors and plain data only, never code.
    ``ForeignFileError`` when the file holds anything else."""
    try:
        return torch.load(source, map_location="cpu", weights_only=True, mmap=not isinstance(source, io.BytesIO))
    except pickle.UnpicklingError as error:
        raise _refused(error) from None


# The classes torch.distributed.checkpoint pickles into a sharded checkpoint's ``.metadata``: plain records of names,
# shapes, dtypes and byte ranges. Nothing else is admitted when it is read (``_DCPMetadataUnpickler``).
_DCP_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata", "ChunkStorageMetadata",
        "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # the checkpoint_id it was saved under
}


class _DCPMetadataUnpickler(pickle.Unpickler):
    """Reads DCP's ``.metadata`` admitting only the record classes above and torch dtypes (the pickle module's own
    way of restricting globals): a crafted one is refused, its code never imported."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_METADATA_GLOBALS.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}'")


def _check_sharded_parts(path: Path) -> None:
    """Read the pickled parts of a sharded checkpoint with safe readers: Lightning's ``meta.pt``, DCP's ``.metadata``,
    and every plain value among the shards (DCP loads those with ``weights_only=False``); ``ForeignFileError`` naming
    the part otherwise."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    part = "meta.pt"
    try:
        if (path / part).is_file():
            load_safely(path / part)
        part = ".metadata"
        if not (path / part).is_file():
            return
        with open(path / part, "rb") as f:
            metadata = _DCPMetadataUnpickler(f).load()
        for fqn, kind in metadata.state_dict_metadata.items():
            if not isinstance(kind, BytesStorageMetadata):
                continue
            part = fqn
            stored = metadata.storage_data[MetadataIndex(fqn)]
            if stored.transform_descriptors:  # compressed or otherwise transformed: not what our strategies write
                raise ForeignFileError("a transformed value, which this reader does not check")
            with open(path / Path(stored.relative_path).name, "rb") as f:
                f.seek(stored.offset)
                load_safely(io.BytesIO(f.read(stored.length)))
    except ForeignFileError as error:
        raise ForeignFileError(f"{part}: {error}") from None
    except pickle.UnpicklingError as error:
        raise ForeignFileError(f"{part}: {_refused(error, 'the reader of checkpoint records')}") from None
    except Exception as error:  # a record of another shape, a shard cut short: anything the readers cannot read
        raise IncompleteCheckpointError(f"{part} is unreadable ({_first_line(error)})") from None


def saved_value(path: str | os.PathLike, key: str) -> Any:
    """A plain value a complete checkpoint keeps under ``key`` (a sharded one: in its ``meta.pt``), read by the safe
    reader with its tensors left on disk (mapped, not read); None where it keeps none."""
    path = Path(path)
    part = path / "meta.pt" if path.is_dir() else path
    if not part.is_file():
        return None
    found = load_safely(part)
    return found.get(key) if isinstance(found, dict) else None


def checkpoint_step(path: Path, intact: bool = False) -> int:
    """The global step of a complete checkpoint; ``IncompleteCheckpointError`` saying why when it is not complete (a
    single file: without every key of ``RESUME_KEYS``, ``NotALightningCheckpointError``), ``ForeignFileError`` when
    the safe readers refuse it (it is never read another way). ``intact``: every record's checksum read too
    (`check_records`), for the one a run resumes from."""
    if path.is_dir():
        manifest = path / MANIFEST
        if not manifest.is_file():
            if not any((path / part).exists() for part in ("meta.pt", ".metadata")) and not any(path.glob("*.distcp")):
                raise NotACheckpointError("a folder without the parts of a sharded checkpoint")
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
        _check_sharded_parts(path)
        return step
    with open(path, "rb") as f:
        start = f.read(2)
    if start and start != b"PK" and start[:1] != b"\x80":  # neither torch.save's zip archive nor a pickle
        raise NotACheckpointError("a file torch.save did not write: a checkpoint is a zip archive")
    try:
        checkpoint = load_safely(path)
    except ForeignFileError:
        raise
    except Exception as error:  # a truncated zip, an empty file, anything torch cannot read
        raise IncompleteCheckpointError(f"unreadable ({_first_line(error)})") from None
    if lacking := [key for key in RESUME_KEYS if not isinstance(checkpoint, dict) or key not in checkpoint]:
        raise NotALightningCheckpointError(f"it lacks {', '.join(lacking)}, which a resume reads: saved with weights only, or by hand")
    if intact:
        check_records(path)
    return int(checkpoint["global_step"])


def check_records(path: Path) -> None:
    """A single-file checkpoint's tensors are mapped, not read, when its step is found: damage inside one (its zip
    record intact) shows in the record's checksum, read here (every byte: for the checkpoint a run resumes from). An
    archive written without checksums (``torch.utils.serialization.config.save.compute_crc32 = False``) is not read."""
    if path.is_dir():
        return
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip() if any(info.CRC for info in archive.infolist()) else None
    except zipfile.BadZipFile:
        return  # a pickle of an older torch.save, which `checkpoint_step` read whole
    except OSError as error:
        raise IncompleteCheckpointError(f"unreadable ({_first_line(error)})") from None
    if damaged is not None:
        raise IncompleteCheckpointError(f"damaged: its record {damaged} fails its checksum")


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
    raise ForeignWeightsError(
        f"ckpt_path: {path} holds another module's weights ({'; '.join(said)}): it was written by another task, model "
        "or LoRA layout than this recipe's"
    )


def checkpoint_folders(output_dir: Path) -> list[Path]:
    """Where a run keeps checkpoints: ``checkpoints/`` (periodic, ``last``) and the run folder (signal checkpoints)."""
    return [output_dir / "checkpoints", output_dir]


def clean_staging(output_dir: Path) -> list[str]:
    """Remove every leftover of a killed write; promote a complete staged folder whose final name is missing.

    A staged single file is removed by its name, never opened: its rename into place is one atomic step, so a staged
    file is only ever a write that was killed (at worst after its last byte, when the previous checkpoint stands).
    A staged folder's manifest says whether it is complete (a kill between the two renames of ``commit``).
    Only one process may call this: the one that holds the run folder's lock. Returns what it did, one phrase each.
    """
    done = []
    for folder in checkpoint_folders(output_dir):
        if not folder.is_dir():
            continue
        for staged in sorted(folder.glob(f"*.ckpt{STAGING}")):
            final = staged.with_name(staged.name.removesuffix(STAGING))
            complete = False
            if staged.is_dir() and not staged.is_symlink() and not (final.exists() or final.is_symlink()):
                try:
                    checkpoint_step(staged)
                    complete = True
                except IncompleteCheckpointError:
                    pass
            if complete:
                commit(staged, final)
                done.append(f"renamed the complete {staged.relative_to(output_dir)} into place")
            else:
                _delete(staged)
                done.append(f"removed {staged.relative_to(output_dir)}, left by a killed write")
        for trash in sorted(folder.glob(f"*.ckpt{TRASH}")):
            _delete(trash)
            done.append(f"removed {trash.relative_to(output_dir)}, left by a killed write")
    return done


def newest_complete(output_dir: Path, intact: bool = True) -> tuple[Checkpoint | None, list[tuple[Path, str, str]]]:
    """The complete checkpoint of the run with the highest global step (the newer file on a tie), and the
    checkpoints found beside it that it cannot take and that are newer than it (all, when none is complete), each
    with what it is (``incomplete``, ``not a checkpoint of this run``) and why. ``intact``: the one found has every
    record's checksum read (`check_records`), as the one a run resumes from; without, its step is read alone."""
    complete: list[tuple[int, int, Path]] = []
    unusable: list[tuple[int, Path, str, str]] = []
    for folder in checkpoint_folders(output_dir):
        for path in sorted(folder.glob("*.ckpt")) if folder.is_dir() else ():
            if path.name.startswith("."):  # never a checkpoint of this run: an earlier run's, set aside by --overwrite
                continue  # until this one's first step (run_folder.PREFIX), or a hidden file
            mtime = path.stat().st_mtime_ns
            try:
                complete.append((checkpoint_step(path), mtime, path))
            except IncompleteCheckpointError as error:
                unusable.append((mtime, path, error.what, str(error)))
    newest = None
    for step, mtime, path in sorted(complete, reverse=True):  # the newest whose records are intact
        try:
            if intact:
                check_records(path)
        except IncompleteCheckpointError as error:
            unusable.append((mtime, path, error.what, str(error)))
            continue
        newest = (step, mtime, path)
        break
    passed_over = [(p, what, reason) for m, p, what, reason in sorted(unusable, reverse=True) if newest is None or m >= newest[1]]
    return (None if newest is None else Checkpoint(newest[2], newest[0])), passed_over


def write_staged(checkpoint: dict[str, Any], final: Path) -> None:
    """Write a single-file checkpoint as ``final.staging``, flush it to disk, then rename it to ``final``.

    A disk without room for it (or a file size limit) is ``disk_space.NoRoomError``, naming the folder and the bytes
    needed; the partial staging file is removed and ``final`` (the previous checkpoint) is left as it was."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_path(final)
    _delete(staging)
    try:
        with open(staging, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as error:
        _delete(staging)
        full = no_room(error, final.parent, tensor_bytes(checkpoint))
        if full is None:
            raise
        raise space_error(final, tensor_bytes(checkpoint), full) from None
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
