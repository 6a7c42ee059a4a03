"""What a run writes into its ``output_dir``, known by name, so that ``--overwrite`` removes that and nothing else.

A folder is a run's when its ``recipe.yaml`` starts with ``MARKER``: the run writes that file first, once its model
and data are set up. In a run's folder the run's own files follow a strict rule of names (``RUN_NAMES``: checkpoints
as ``ModelCheckpoint`` and the signal handler name them, the loggers' folders, ``summary.json``, ``rollouts.jsonl``), except ``hf/``,
whose files the model decides: the run lists them in ``HF_LISTING`` once its export is written. Anything else
(a user's notes, a file dropped into ``checkpoints/`` or ``hf/``) is never removed.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

RECIPE = "recipe.yaml"
MARKER = "# lightning-rl run: this folder holds the run of the recipe below (--overwrite removes only its files)"
HF = "hf"
HF_LISTING = ".hf-files"  # the files of hf/ the run's export wrote, one relative path a line
SUMMARY = "summary.json"

_CHECKPOINT = r"(?:\.staging|\.trash)?"  # a checkpoint being written, or being replaced (lightning_rl/checkpoints.py)
# Per folder of the run (relative to output_dir), the names the run gives what it writes there; a match is removed
# whole (a sharded checkpoint and a logger's run are folders). csv/version_N holds only the CSV logger's two files.
# While --overwrite's new run has not trained its first step: the earlier run's files, renamed in place with PREFIX,
# and listed (by their own names) in ASIDE.
ASIDE = ".overwritten-files"
PREFIX = ".overwritten-"
RUN_NAMES = {
    ".": re.compile(
        rf"recipe\.yaml|\.recipe\.yaml\.tmp|summary\.json(?:\.tmp)?|rollouts\.jsonl(?:\.tmp)?|hpc_ckpt_\d+\.ckpt{_CHECKPOINT}|hf\.tmp|hf\.old|{re.escape(HF_LISTING)}(?:\.tmp)?"
    ),
    "checkpoints": re.compile(rf"(?:step=\d+|last)(?:-v\d+)?\.ckpt{_CHECKPOINT}"),
    "csv/version_*": re.compile(r"metrics\.csv|hparams\.yaml"),
    "wandb": re.compile(r"(?:offline-)?run-\d{8}_\d{6}-\w+|latest-run|debug(?:-internal)?\.log|settings|wandb-resume\.json"),
}


def is_run_folder(output_dir: Path) -> bool:
    """Whether ``output_dir`` holds a run: its ``recipe.yaml`` is one a run wrote."""
    try:
        with open(output_dir / RECIPE, encoding="utf-8") as f:
            return f.readline().rstrip("\n") == MARKER
    except (OSError, UnicodeDecodeError):
        return False


def run_ended(output_dir: Path) -> bool:
    """Whether ``output_dir`` holds a run's end (``summary.json``, or ``hf/`` as its export wrote it), which a run
    writes once it has trained and never before: a run killed before its first checkpoint leaves neither, one that
    trained to its end both (an earlier run's, set aside by ``--overwrite``, is not this run's)."""
    return (output_dir / SUMMARY).exists() or bool(_exported(output_dir))


def marked(recipe_text: str) -> str:
    """The text of a run's ``recipe.yaml``: the recipe under the marker (a YAML comment, so it still runs)."""
    return f"{MARKER}\n{recipe_text}"


def _files(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if not path.is_dir())


def _exported(output_dir: Path) -> list[str]:
    """The files now in ``hf/`` that the run's listing names (a name outside hf/ is never one of them)."""
    try:
        listed = set((output_dir / HF_LISTING).read_text(encoding="utf-8").splitlines())
    except (OSError, UnicodeDecodeError):
        listed = set()
    folder = output_dir / HF
    return [name for name in _files(folder) if name in listed] if folder.is_dir() else []


def record_export(output_dir: Path) -> None:
    """List the files of ``hf/`` as the run's, right after its export wrote them (the export replaces hf/ whole)."""
    folder = output_dir / HF
    listing = output_dir / HF_LISTING
    tmp = listing.with_name(listing.name + ".tmp")
    tmp.write_text("".join(f"{name}\n" for name in _files(folder)) if folder.is_dir() else "", encoding="utf-8")
    tmp.replace(listing)


def not_exported(output_dir: Path) -> list[str]:
    """The files in ``hf/`` that the run's export did not write (nor an earlier run's, set aside in place)."""
    folder = output_dir / HF
    if not folder.is_dir():
        return []
    exported = set(_exported(output_dir))  # and the earlier run's, set aside by --overwrite until the new one's first step
    exported |= {str(_aside(path).relative_to(folder)) for path in _set_aside(output_dir) if folder in path.parents}
    return [f"{HF}/{name}" for name in _files(folder) if name not in exported]


def run_files(output_dir: Path) -> list[Path]:
    """What the run in ``output_dir`` wrote there, by the rule of names and the export's listing."""
    found = []
    for place, names in RUN_NAMES.items():
        for folder in sorted(output_dir.glob(place)) if "*" in place else [output_dir / place]:
            if folder.is_dir():
                found += [path for path in sorted(folder.iterdir()) if names.fullmatch(path.name)]
    return found + [output_dir / HF / name for name in _exported(output_dir)]


def set_aside_run_files(output_dir: Path) -> None:
    """Rename what the run in ``output_dir`` wrote, each where it is (``PREFIX`` before its name: a checkpoints folder
    on another filesystem stays there, a symlink stays one), and list the renamed in ``ASIDE``: ``--overwrite``'s new
    run takes the folder, and the earlier run comes back should the new one end before its first step
    (`restore_set_aside`), or goes once it has trained one (`drop_set_aside`). An aside left by a run that stopped
    before its first step (killed, or crashed) is given back first, in place of that run's files."""
    if _set_aside(output_dir):
        remove_run_files(output_dir)
        restore_set_aside(output_dir)
    entries = run_files(output_dir)
    for folder in sorted(output_dir.glob("csv/version_*")):  # a log folder of the run's files alone goes whole: the
        inside = [path for path in entries if path.parent == folder]  # new log takes its version, as it did
        if inside and folder.is_dir() and not folder.is_symlink() and len(inside) == len(list(folder.iterdir())):
            entries = [path for path in entries if path.parent != folder] + [folder]
    if not entries:  # no earlier run (a new folder, or one of user files alone)
        return
    with open(output_dir / ASIDE, "w", encoding="utf-8") as listing:
        for path in entries:
            path.rename(_aside(path))
            listing.write(f"{path.relative_to(output_dir)}\n")
            listing.flush()
    remove_run_files(output_dir)  # the folders this left without a file of the run


def _aside(path: Path) -> Path:
    return path.with_name(PREFIX + path.name)


def _set_aside(output_dir: Path) -> list[Path]:
    """The files and folders ``ASIDE`` lists, by their own names."""
    try:
        return [output_dir / line for line in (output_dir / ASIDE).read_text(encoding="utf-8").splitlines() if line]
    except (OSError, UnicodeDecodeError):
        return []


def restore_set_aside(output_dir: Path) -> None:
    """Give the earlier run's files their names back (the new run's, removed by the caller, made room for them)."""
    for path in _set_aside(output_dir):
        if _aside(path).exists() or _aside(path).is_symlink():
            _aside(path).rename(path)
    (output_dir / ASIDE).unlink(missing_ok=True)


def drop_set_aside(output_dir: Path) -> None:
    """Remove the earlier run's files, once the new run has trained, and the folders that left empty (not the new
    run's: its log folder is empty until the logger's first write)."""
    if not (set_aside := _set_aside(output_dir)):
        return
    for aside in map(_aside, set_aside):
        shutil.rmtree(aside) if aside.is_dir() and not aside.is_symlink() else aside.unlink(missing_ok=True)
    (output_dir / ASIDE).unlink(missing_ok=True)
    _remove_emptied(output_dir)


def remove_run_files(output_dir: Path) -> None:
    """Remove what the run in ``output_dir`` wrote (``run_files``), then the run's folders that this left empty."""
    for path in run_files(output_dir):
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)
    _remove_emptied(output_dir)


def _remove_emptied(output_dir: Path) -> None:
    """The run's folders left empty."""
    hf = output_dir / HF
    emptied = sorted((p for p in hf.rglob("*") if p.is_dir()), reverse=True) if hf.is_dir() else []
    for folder in [*emptied, *sorted(output_dir.glob("csv/version_*")), *(output_dir / name for name in ("csv", "checkpoints", "wandb", HF))]:
        if folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir()):
            folder.rmdir()
