"""What `--overwrite` would leave of a run: the files in its folder that the run's rule of names does not cover."""

from pathlib import Path

from lightning_rl import run_folder


def not_known_as_the_runs(out: Path) -> list[str]:
    """Files under ``out`` that ``run_folder.run_files`` does not name (nor a folder it names holds)."""
    known = run_folder.run_files(out)
    return sorted(
        str(path.relative_to(out)) for path in out.rglob("*")
        if path.is_file() and path.name != ".lock" and not any(path == k or k in path.parents for k in known)
    )  # fmt: skip
