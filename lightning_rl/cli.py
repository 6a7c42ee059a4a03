"""The ``lightning-rl`` command: ``run RECIPE.yaml [--dotted.key=value ...]`` (or ``run --task=sft|grpo --key=value
...`` without a file), and ``env`` / ``launch`` / ``plan``.

Every mistake in what the user gave (a recipe value, a data file or row, a checkpoint, a flag) is a ``UserError``
(``lightning_rl/errors.py``): ``main`` prints it as one ``error:`` line naming the key, or the file and line, and exits
with 2 (a non-finite step: 1), without a traceback. Anything else that escapes is a bug and keeps its traceback.

``run`` reads the recipe with ``lightning_rl/recipe.py``, imported only there: it needs jsonargparse, which
``lightning-rl env`` must run without. The run folder belongs to one run: a folder that already holds outputs is
refused unless the run resumes it (``--ckpt_path``) or replaces it (``--overwrite``), a lock keeps a concurrent run
out, and nothing is written into it before the model and data are set up.
"""

from __future__ import annotations

import fcntl
import gc
import importlib
import os
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_rl import stopping

if __name__ == "__main__" or os.path.basename(sys.argv[0]) == "lightning-rl":  # the command's own process
    stopping.exit_on_stop_signals()  # before the imports below, which take seconds

import torch  # noqa: E402
from lightning.pytorch.utilities.exceptions import SIGTERMException  # noqa: E402

from lightning_rl import run_folder  # noqa: E402
from lightning_rl.checkpoints import ForeignCheckpointError, ForeignWeightsError, IncompleteCheckpointError, checkpoint_step, clean_staging, newest_complete  # noqa: E402
from lightning_rl.errors import BatchingChanged, RecipeError, RowsChanged, UserError, report  # noqa: E402

if TYPE_CHECKING:
    from lightning_rl.recipe import RecipeCLI

SUBCOMMANDS = {
    "env": "lightning_rl.env_report",
    "launch": "lightning_rl.launch.slurm",
    "plan": "lightning_rl.planner.plan",
}
USAGE = "usage: lightning-rl {run [RECIPE.yaml] [--key=value ...] | env | launch ... | plan ...}"
RUN_HELP = """usage: lightning-rl run RECIPE.yaml [--key=value ...]
       lightning-rl run --task={sft,grpo} [--key=value ...]     (no recipe file: the keys on the command line)

The keys a run takes depend on its task; each task's keys, with their types, defaults and docs:
  lightning-rl run --task=sft --help
  lightning-rl run --task=grpo --help
  lightning-rl run RECIPE.yaml --help        (the recipe's task)
All of them, in one table: docs/recipe_reference.md. Reward and tool modules are imported from the recipe's
folder and the working directory too."""
COMMANDS_HELP = """  run      train a recipe (SFT or GRPO): lightning-rl run --help
  env      what this machine can run (devices, strategies, versions)
  launch   render and submit a SLURM job for a recipe: lightning-rl launch slurm --help
  plan     per-GPU memory and step time of a recipe before you spend: lightning-rl plan --help"""
EXIT_USAGE = 2
EXIT_SIGTERM = 128 + 15  # the shell's code for a process ended by SIGTERM
LOCK_FILE = ".lock"


def is_first_process() -> bool:
    """Whether this process is rank 0 of the job, read from what launchers set before any process group exists
    (Lightning's own launcher, torchrun, SLURM)."""
    return all(os.environ.get(key, "0") == "0" for key in ("RANK", "SLURM_PROCID", "GROUP_RANK", "NODE_RANK", "LOCAL_RANK"))


class RunFolderLock:
    """OUTPUT_DIR/.lock, held with ``flock`` by a run's first process and naming its pid: a second run into the same
    folder is refused while the first lives. The kernel drops the lock of a process that dies, so a lock file left
    by a killed run is simply taken over. Released (and the file removed) when the run ends."""

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = output_dir
        self.path = output_dir / LOCK_FILE
        self._fd: int | None = None
        self._created_dir = False

    def acquire(self) -> None:
        self._created_dir = not self.output_dir.exists()
        while True:
            try:
                self.output_dir.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise RecipeError(f"output_dir: cannot write into {self.output_dir} ({e.strerror})", "output_dir") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
                os.close(fd)
                raise RecipeError(f"output_dir: {self.output_dir} is in use by another run ({holder}); let it finish or choose another output_dir", "output_dir") from None
            try:
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # the holder removed the file as we opened it: lock the new one
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)  # while still holding it, so no one locks a file that is going away
        os.close(self._fd)
        self._fd = None
        if self._created_dir and not any(self.output_dir.iterdir()):
            self.output_dir.rmdir()  # a run that failed before writing anything leaves no folder either


def check_run_folder(output_dir: Path, resuming: bool, overwrite: bool) -> None:
    """A run writes only into an empty folder or one that holds a run (``lightning_rl/run_folder.py``), and into a
    run's folder only to resume that run or, explicitly, to replace it. A run's export replaces hf/ whole, so a file
    there that the run did not write is refused rather than lost."""
    if not output_dir.is_dir():
        return
    held = sorted(path.name for path in output_dir.iterdir() if path.name not in (LOCK_FILE, run_folder.HF_LISTING))
    if not held:
        return
    if not run_folder.is_run_folder(output_dir):
        raise RecipeError(
            f"output_dir: {output_dir} holds files that are not a run's ({_some(held)}; no {run_folder.RECIPE} written by a "
            "run): a run neither writes into it nor, with --overwrite, removes anything from it; choose another output_dir",
            "output_dir",
        )  # fmt: skip
    if not (resuming or overwrite):
        raise RecipeError(
            f"output_dir: {output_dir} already holds a run ({_some(held)}); resume it with --ckpt_path=last, or replace it "
            "with --overwrite (which removes only the files the run wrote)", "output_dir",
        )  # fmt: skip
    if foreign := run_folder.not_exported(output_dir):
        raise RecipeError(
            f"output_dir: {output_dir}/{run_folder.HF} holds files the run did not write ({_some(foreign)}), and the run's "
            f"export replaces {run_folder.HF}/ whole: move them out first", "output_dir",
        )  # fmt: skip


def _some(names: list[str]) -> str:
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def resume_path(output_dir: Path, ckpt_path: str | None, first: bool = True) -> str | None:
    """The checkpoint to resume from, verified complete and read only by safe readers (``lightning_rl/checkpoints.py``).

    ``last`` is the newest complete checkpoint of the run, whatever its name, and one line says which it is, with
    what was passed over (incomplete checkpoints, files that are not checkpoints of a run) or cleaned up (what a killed
    write left). A folder with none complete starts from step 0 only if it holds no checkpoint and no run's end
    (``run_folder.run_ended``: a new folder, or one whose run was killed before its first checkpoint): one whose
    checkpoints are all broken, or whose run ended and kept none, is refused, not trained over. A checkpoint named
    outright must be complete. Only the ``first`` process, which holds the run folder's lock, cleans up and speaks;
    every process refuses alike.
    """
    if ckpt_path is None:
        return None
    if not str(ckpt_path).strip():
        raise RecipeError("ckpt_path is empty: give a checkpoint (a file, or a sharded checkpoint's folder), or last", "ckpt_path")
    cleaned = clean_staging(output_dir) if first else []
    if ckpt_path != "last":
        path = Path(ckpt_path)
        if not path.exists():
            raise RecipeError(f"ckpt_path: no such checkpoint: {path}", "ckpt_path")
        try:
            step = checkpoint_step(path, intact=True)
        except IncompleteCheckpointError as e:
            hint = "; --ckpt_path=last takes the newest complete one" if type(e) is IncompleteCheckpointError else ""
            if (path / "checkpoints").is_dir():
                hint = f"; to resume the run in that folder: --output_dir={path} --ckpt_path=last"
            raise ForeignCheckpointError(f"ckpt_path: {path} is {e.what} ({e}){hint}") from None
        newest, _ = newest_complete(output_dir, intact=False)  # its step alone: the resume is from ckpt_path
        if newest is not None and newest.step > step:  # a run of two branches, whose `last` would be the other's
            raise ForeignCheckpointError(
                f"ckpt_path: {path} is at step {step}, but output_dir {output_dir} holds checkpoints up to step {newest.step} "
                f"({newest.path.relative_to(output_dir)}): training on from step {step} there would leave two runs' checkpoints "
                "in one folder, and --ckpt_path=last would later take the other's; give another output_dir, or remove the "
                f"checkpoints past step {step}"
            )
        return ckpt_path
    found, passed_over = newest_complete(output_dir)
    notes = [f"passed over {path.relative_to(output_dir)}: {what}, {reason}" for path, what, reason in passed_over] + cleaned
    said = "".join(f"; {note}" for note in notes)
    if found is None and (passed_over or run_folder.run_ended(output_dir)):
        raise ForeignCheckpointError(
            f"ckpt_path: last: no complete checkpoint in {output_dir}, so the run there cannot be resumed, and starting "
            f"again from step 0 would train over it{said}; start it over with --overwrite in place of --ckpt_path, or give "
            "another output_dir"
        )
    if first and found is None:
        print(f"resume: no complete checkpoint in {output_dir}, starting from step 0{said}", file=sys.stderr)
    elif first:
        print(f"resume: step {found.step} from {found.path.relative_to(output_dir)}, the newest complete checkpoint{said}", file=sys.stderr)
    return str(found.path) if found else None


def _destroy_process_groups() -> None:
    # Lightning leaves the process groups to the interpreter's exit, where gloo's worker threads can abort the
    # process (SIGABRT) while a peer is still writing the export. Called once every collective is done.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# What Lightning writes into this process's environment for its ranks to find each other. Left set after a run, they
# made the next run of the same process (a notebook, a test, a sweep from Python) take itself for one rank of a job
# launched elsewhere: two devices then waited for a peer that never came.
_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "GLOBAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def run(recipe: str | None, overrides: list[str]) -> int:
    """`lightning-rl run`; the process's environment is left as the run found it (`_LAUNCH_ENV`)."""
    found = {key: os.environ.get(key) for key in _LAUNCH_ENV}
    try:
        return _run(recipe, overrides)
    finally:
        for key, value in found.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _run(recipe: str | None, overrides: list[str]) -> int:
    try:
        from lightning_rl.recipe import build  # needs jsonargparse, which `lightning-rl env` runs without
    except ImportError as e:
        raise RecipeError(f"`lightning-rl run` is not available in this install ({e})") from None
    cli = build(recipe, overrides)
    output_dir, ckpt_path = Path(cli.config["output_dir"]), cli.config["ckpt_path"]
    first = is_first_process()
    lock = RunFolderLock(output_dir) if first else None
    cli.requeue.install()  # from here on a SIGTERM is recorded, and acted on at a step boundary
    try:
        if lock is not None:
            lock.acquire()
        check_run_folder(output_dir, resuming=ckpt_path is not None, overwrite=cli.config["overwrite"])
        cli.model.finish_when_trained = ckpt_path == "last"
        return _fit(cli, resume_path(output_dir, ckpt_path, first))
    except UserError as error:  # one found once the run started (a data row, a checkpoint, a reward, a step)
        if first and ckpt_path is None and cli.trainer.global_step == 0 and cli.wrote_run_folder():
            # A fresh run refused before its first step (an engine it cannot build, ...) takes back what it wrote,
            # so that the corrected rerun starts there: nothing was trained, and the run --overwrite replaces is back.
            run_folder.remove_run_files(output_dir)
            run_folder.restore_set_aside(output_dir)
        raise cli.keyed(error) from None
    finally:
        if lock is not None:  # first: a signal from here on finds the folder free
            lock.release()
        cli.requeue.restore()
        stopping.signal_came(False)  # the stop request was this run's: a later run in this process starts without it


def _fit(cli: RecipeCLI, ckpt_path: str | None) -> int:
    from lightning.pytorch.strategies import ModelParallelStrategy

    trainer = cli.trainer
    if ckpt_path is not None and Path(ckpt_path).is_dir() and not isinstance(trainer.strategy, ModelParallelStrategy):
        cli.check_resume(ckpt_path)  # the strategy or devices changed: named with both values
        raise ForeignCheckpointError(f"ckpt_path: {ckpt_path} is a sharded checkpoint (a folder), which trainer.strategy "
                                     f"{type(trainer.strategy).__name__} cannot read: resume it with the strategy that wrote it")
    try:
        # weights_only: every load Lightning does for us (the file, a sharded folder's meta.pt) admits no code.
        trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path, weights_only=True)
    except SIGTERMException:
        # Every rank stopped at the same step boundary (RequeueOnSignal); a stopped run must not look finished.
        if trainer.is_global_zero:
            print(f"stopped by {cli.requeue.stopped_by or 'SIGTERM'} after step {trainer.global_step}; resume with --ckpt_path=last", file=sys.stderr)
        return EXIT_SIGTERM
    except Exception as error:
        # Weights or rows that did not fit (a changed key that adds or removes weights, or rebatches the rows), or a
        # checkpoint a strategy's own reader failed on before any check of ours (FSDP2 reading a LoRA run's optimizer
        # state, in torch's words): a changed recipe key explains it, named with both values.
        if ckpt_path is not None and (isinstance(error, (ForeignWeightsError, BatchingChanged, RowsChanged)) or not isinstance(error, UserError)):
            cli.check_resume(ckpt_path)
        raise
    finally:
        _destroy_process_groups()
    if cli.requeue.received and trainer.is_global_zero:
        # After the last step's boundary nothing is left to save but the final checkpoint and hf/, both staged and
        # bounded like any checkpoint: they are finished rather than cut, so the run ends finished.
        names = " and ".join(sorted(signal.Signals(s).name for s in cli.requeue.received))
        print(f"{names} arrived after the last step: the final checkpoint and hf/ were written whole; the run is finished", file=sys.stderr)
    return 0


_FLAG_WORDS = {"true", "false", "yes", "no", "skip_null", "skip_default", "comments"}  # an optional-value flag's values


def run_arguments(args: list[str]) -> tuple[str | None, list[str]]:
    """``run``'s recipe file and its overrides, as a user may write them: the recipe first, after the overrides, or
    as ``-c``/``--config FILE`` (the usage line's); ``--task sft`` as ``--task=sft``, every ``--key value`` as
    ``--key=value``."""
    recipes, configs, overrides, k = [], [], [], 0
    while k < len(args):
        arg = args[k]
        value = args[k + 1] if k + 1 < len(args) and not args[k + 1].startswith("-") else None
        if arg in ("-c", "--config") and value is not None:
            configs.append(value)
            k += 2
        elif arg.startswith("--config="):
            configs.append(arg.split("=", 1)[1])
            k += 1
        elif arg.startswith("--") and "=" not in arg and value is not None and arg != "--help" and (
                arg not in ("--overwrite", "--no_overwrite", "--print_config") or value.lower() in _FLAG_WORDS):
            overrides.append(f"{arg}={value}")  # a flag whose value is optional takes the next word unless it is the recipe
            k += 2
        elif not arg.startswith("-"):
            recipes.append(arg)
            k += 1
        else:
            overrides.append(arg)
            k += 1
    if len(recipes) > 1:
        raise RecipeError(f"`run` takes one recipe file, got {len(recipes)}: {', '.join(recipes)} (a key's value is written --key=value)")
    if not recipes and configs:  # the first config file is the recipe; later ones are laid over it, as LightningCLI's are
        recipes.append(configs.pop(0))
    return (recipes[0] if recipes else None), [*(f"--config={config}" for config in configs), *overrides]


def _command(command: str, rest: list[str]) -> int:
    if command in SUBCOMMANDS:
        try:
            module = importlib.import_module(SUBCOMMANDS[command])
        except ImportError as e:
            raise RecipeError(f"`lightning-rl {command}` is not available in this install ({e})") from None
        return int(module.main(rest) or 0)
    if command != "run":
        print(f"error: unknown command {command!r}\n{USAGE}", file=sys.stderr)
        return EXIT_USAGE
    recipe, overrides = run_arguments(rest)
    if recipe is None and not any(arg.startswith("--task=") for arg in overrides):
        if any(arg in ("-h", "--help") for arg in overrides):
            print(RUN_HELP)
            return 0
        print(f"error: `run` needs a recipe file or --task=sft|grpo\n{RUN_HELP}", file=sys.stderr)
        return EXIT_USAGE
    return run(recipe, overrides)


def main(argv: list[str] | None = None) -> int:
    command_line = argv is None  # the `lightning-rl` command's own process, not a caller's
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{COMMANDS_HELP}" if argv else USAGE)
        return 0 if argv else EXIT_USAGE
    try:
        return _command(argv[0], argv[1:])
    except UserError as error:
        # An error every rank raised together (a non-finite step) is said once, by the first process.
        return report(error, say=is_first_process() or not error.on_every_rank)
    finally:
        if command_line:  # the process ends now: a scheduler's SIGTERM after the run's end does not turn it into a kill
            for signum in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(signum, _after_the_end)
            # The run's objects (model, trainer, process groups) are freed while the interpreter is whole: freed by its
            # exit instead, gloo's worker threads can abort the process (SIGABRT) after an error was said.
            gc.collect()


def _after_the_end(signum: int, _frame: object) -> None:
    print(f"{signal.Signals(signum).name} arrived after the run ended: it exits as it ended", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
