"""A checkpoint a run cannot take is refused in one line, and a checkpoint that cannot be written loses nothing.

Real runs of the tiny recipes in this process: a GRPO checkpoint in an SFT run and the reverse, another LoRA layout,
a checkpoint already past `max_steps`, and a disk that fills up while a checkpoint is written (a real small tmpfs,
so a real ENOSPC; where mounting is not allowed, a real file size limit, EFBIG)."""

from __future__ import annotations

import contextlib
import csv
import json
import errno
import os
import pickle
import resource
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from traceback import StackSummary

import pytest
import yaml
import torch
from lightning.pytorch import Callback
from torch.distributed.checkpoint.api import CheckpointException

from lightning_rl import cli
from lightning_rl.checkpoints import checkpoint_step
from lightning_rl.data.prompts import PromptDataModule
from lightning_rl.data.sft import DataError
from lightning_rl.disk_space import no_room, tensor_bytes
from lightning_rl.modules.policy import WRITER
from support.paths import REPO, TOY_TRAIN
from support.recipe_runs import run_on_two

QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--logger.kind=none"]
SFT = [str(REPO / "recipes" / "tiny" / "sft.yaml"), *QUIET, "--data.val_data=null", "--data.max_tokens=256",
       "--model.eval_generations=0", "--model.warmup_steps=1", "--trainer.val_check_interval=null",
       "--trainer.limit_val_batches=0"]  # fmt: skip
GRPO = [str(REPO / "recipes" / "tiny" / "grpo.yaml"), *QUIET, "--model.num_generations=2", "--data.batch_size=1"]


def run(capsys, recipe: list[str], out: Path, *extra: str) -> tuple[int, list[str], str]:
    """`lightning-rl run` in this process: exit code, its `error:` lines, all of stderr."""
    rows = out.parent / "rows.jsonl"
    if not rows.exists():
        rows.write_text("".join(TOY_TRAIN.read_text().splitlines(keepends=True)[:20]))
    data = [f"--data.train_data={rows}"] if recipe is SFT else []
    code = cli.main(["run", *recipe, f"--output_dir={out}", *data, *extra])
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.startswith("error:")], err


def one_step(capsys, recipe: list[str], out: Path, *extra: str) -> Path:
    code, errors, err = run(capsys, recipe, out, "--trainer.max_steps=1", *extra)
    assert code == 0 and errors == [], err[-3000:]
    return out / "checkpoints" / "last.ckpt"


def test_a_checkpoint_of_another_task_is_refused_both_ways(tmp_path, capsys):
    sft = one_step(capsys, SFT, tmp_path / "sft")
    grpo = one_step(capsys, GRPO, tmp_path / "grpo")
    assert torch.load(sft, weights_only=True)[WRITER]["task"] == "SFTModule"

    code, errors, _ = run(capsys, GRPO, tmp_path / "grpo-from-sft", f"--ckpt_path={sft}", "--trainer.max_steps=2")
    assert code == 2 and len(errors) == 1
    assert errors[0].startswith(f"error: ckpt_path: {sft} was written by another kind of run (task 'SFTModule' there, 'GRPOModule' here")
    # The weights fit (same model, no LoRA): before, the run trained on with the other task's optimizer and schedule.
    code, errors, _ = run(capsys, SFT, tmp_path / "sft-from-grpo", f"--ckpt_path={grpo}", "--trainer.max_steps=2")
    assert code == 2 and len(errors) == 1
    assert errors[0].startswith(f"error: ckpt_path: {grpo} was written by another kind of run (")
    assert not (tmp_path / "sft-from-grpo" / "hf").exists() and not (tmp_path / "grpo-from-sft" / "hf").exists()


def test_a_checkpoint_of_another_lora_layout_names_both(tmp_path, capsys):
    r4 = one_step(capsys, SFT, tmp_path / "r4", "--model.lora={r: 4, alpha: 8}")
    code, errors, _ = run(capsys, SFT, tmp_path / "r8", f"--ckpt_path={r4}", "--trainer.max_steps=2", "--model.lora={r: 8, alpha: 8}")
    assert code == 2 and errors == [
        f"error: ckpt_path: {r4} was written by another kind of run (lora {{'r': 4, 'alpha': 8, 'target_modules': "
        "'all-linear'} there, {'r': 8, 'alpha': 8, 'target_modules': 'all-linear'} here)"
    ]
    # Negative control: the same layout resumes.
    code, errors, _ = run(capsys, SFT, tmp_path / "r4-again", f"--ckpt_path={r4}", "--trainer.max_steps=2", "--model.lora={r: 4, alpha: 8}")
    assert code == 0 and errors == []


def test_a_resume_with_another_learning_rate_is_refused_not_ignored(tmp_path, capsys):
    """The optimizer's parameter groups come back whole from the checkpoint: a new learning rate, weight decay or
    betas was silently ignored while recipe.yaml recorded it. Refused, naming both values."""
    saved = one_step(capsys, SFT, tmp_path / "run", "--model.learning_rate=0.005")
    for override, message in (("--model.learning_rate=0.5", "learning_rate=0.5, but ckpt_path: {} resumes the optimizer with learning_rate=0.005"),
                              ("--model.betas=[0.5, 0.6]", "betas=[0.5, 0.6], but ckpt_path: {} resumes the optimizer with betas=[0.9, 0.95]"),
                              # from 0 it groups the parameters otherwise (norms and biases without decay): was "another
                              # kind of run (optimizer groups [24] there, [15, 9] here)"
                              ("--model.weight_decay=0.01", "weight_decay=0.01, but ckpt_path: {} resumes the optimizer with weight_decay=0.0")):  # fmt: skip
        code, errors, _ = run(capsys, SFT, tmp_path / "run", "--ckpt_path=last", "--trainer.max_steps=2", "--model.learning_rate=0.005", override)
        assert code == 2 and errors == [f"error: model.{message.format(saved)} (its state holds it): give that, or start a new run"], errors
    code, errors, _ = run(capsys, SFT, tmp_path / "run", "--ckpt_path=last", "--trainer.max_steps=2", "--model.learning_rate=0.005")
    assert code == 0 and errors == []  # negative control: the saved values resume


def test_a_resume_that_changes_what_the_run_trains_is_refused_and_one_that_runs_longer_is_not(tmp_path, capsys):
    """A new seed, batch or gradient clip on resume trained a different run than either, silently, and recipe.yaml
    was rewritten with the new values. Refused naming every changed key; the run folder is left as it was."""
    out = tmp_path / "run"
    one_step(capsys, SFT, out, "--trainer.gradient_clip_val=0.5")
    recipe = (out / "recipe.yaml").read_text()
    code, errors, _ = run(capsys, SFT, out, "--ckpt_path=last", "--trainer.max_steps=2", "--seed=7", "--data.max_tokens=128")
    assert code == 2 and len(errors) == 1, errors
    assert errors[0].startswith("error: trainer.gradient_clip_val=1.0 here, 0.5 in the run; data.max_tokens=128 here, 256 in "
                                "the run; seed=7 here, 0 in the run: ckpt_path: "), errors
    assert (out / "recipe.yaml").read_text() == recipe and checkpoint_step(out / "checkpoints" / "last.ckpt") == 1
    # A key that trains other tokens of the same rows is named too (it was blamed on the data file).
    code, errors, _ = run(capsys, SFT, out, "--ckpt_path=last", "--trainer.max_steps=2", "--trainer.gradient_clip_val=0.5",
                          "--data.assistant_only_loss=false")
    assert code == 2 and errors[0].startswith("error: data.assistant_only_loss=false here, true in the run: ckpt_path: "), errors
    # What only says how long the run goes, what it logs and where it saves may change.
    code, errors, err = run(capsys, SFT, out, "--ckpt_path=last", "--trainer.max_steps=2", "--trainer.gradient_clip_val=0.5",
                            "--trainer.log_every_n_steps=1", "--checkpoint_every_n_steps=5", "--logger.kind=csv")
    assert code == 0 and errors == [], err[-3000:]
    assert checkpoint_step(out / "checkpoints" / "last.ckpt") == 2


def test_a_resume_on_other_rows_at_the_same_path_is_refused(tmp_path, capsys):
    """The recipe keeps the data's path only: a data file replaced between the runs resumed at the saved batch of
    other data, silently. The checkpoint keeps a digest of the rows (as tokenized) and a resume on others is refused."""
    out, rows = tmp_path / "run", tmp_path / "rows.jsonl"
    one_step(capsys, SFT, out)
    saved = rows.read_text()
    rows.write_text("".join(TOY_TRAIN.read_text().splitlines(keepends=True)[20:40]))
    code, errors, _ = run(capsys, SFT, out, "--ckpt_path=last", "--trainer.max_steps=2")
    assert code == 2 and errors == [
        f"error: data.train_data: {rows} holds other rows than the run being resumed trained on (the file was changed or "
        "replaced, or the tokenizer or its template was): resume with the run's data, or start a new run (another "
        "output_dir, or --overwrite)"
    ]
    assert checkpoint_step(out / "checkpoints" / "last.ckpt") == 1
    rows.write_text(saved)  # negative control: the run's own rows resume
    code, errors, err = run(capsys, SFT, out, "--ckpt_path=last", "--trainer.max_steps=2")
    assert code == 0 and errors == [], err[-3000:]


def test_a_grpo_resume_on_other_prompts_at_the_same_path_is_refused(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{k}+1=", "answer": str(k + 1)}) + "\n" for k in range(4)))
    state = PromptDataModule(str(prompts)).state_dict()
    PromptDataModule(str(prompts)).load_state_dict(state)  # the same rows
    prompts.write_text(prompts.read_text().replace('"answer": "2"', '"answer": "3"'))  # a column the rewards read
    with pytest.raises(DataError, match=f"^data.train_data: {prompts} holds other rows than the run being resumed"):
        PromptDataModule(str(prompts)).load_state_dict(state)
    PromptDataModule(str(prompts)).load_state_dict({})  # a checkpoint written before digests: nothing to compare


def test_a_checkpoint_without_optimizer_state_or_weights_is_one_line_and_writes_nothing(tmp_path, capsys):
    """Lightning's KeyError in a traceback, and the new output_dir kept its csv/ and recipe.yaml (a corrected rerun
    was refused)."""
    saved = torch.load(one_step(capsys, SFT, tmp_path / "run"), weights_only=True)
    for key in ("optimizer_states", "state_dict"):
        stripped = tmp_path / f"without_{key}.ckpt"
        torch.save({name: value for name, value in saved.items() if name != key}, stripped)
        out = tmp_path / f"from_{key}"
        code, errors, _ = run(capsys, SFT, out, f"--ckpt_path={stripped}", "--trainer.max_steps=2", "--logger.kind=csv")
        assert code == 2 and errors == [f"error: ckpt_path: {stripped} is not a Lightning checkpoint (it lacks {key}, which a "
                                        "resume reads: saved with weights only, or by hand)"]  # fmt: skip
        assert not out.exists()


def test_resuming_an_earlier_checkpoint_into_its_own_folder_is_refused_and_into_another_is_not(tmp_path, capsys):
    """Step 2 of a run that went on to step 4, resumed in the same folder: its checkpoints sat beside the first run's
    (last-v1.ckpt beside last.ckpt), and a later --ckpt_path=last resumed the abandoned step 4, silently."""
    out = tmp_path / "run"
    code, errors, err = run(capsys, SFT, out, "--trainer.max_steps=4", "--checkpoint_every_n_steps=2", "--keep_checkpoints=3")
    assert code == 0 and errors == [], err[-3000:]
    earlier, before = out / "checkpoints" / "step=2.ckpt", sorted(p.name for p in (out / "checkpoints").iterdir())
    code, errors, _ = run(capsys, SFT, out, f"--ckpt_path={earlier}", "--trainer.max_steps=3")
    assert code == 2 and errors == [
        f"error: ckpt_path: {earlier} is at step 2, but output_dir {out} holds checkpoints up to step 4 (checkpoints/last.ckpt): "
        "training on from step 2 there would leave two runs' checkpoints in one folder, and --ckpt_path=last would later "
        "take the other's; give another output_dir, or remove the checkpoints past step 2"
    ]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    code, errors, err = run(capsys, SFT, tmp_path / "branch", f"--ckpt_path={earlier}", "--trainer.max_steps=3")
    assert code == 0 and errors == [], err[-3000:]
    assert checkpoint_step(tmp_path / "branch" / "checkpoints" / "last.ckpt") == 3


def test_a_run_folder_moved_between_runs_keeps_pruning_and_replacing_its_checkpoints(tmp_path, capsys):
    """Lightning forgets the checkpoints of a folder whose path changed: the periodic ones were never pruned again
    and last.ckpt stayed at the old step, a last-v1.ckpt beside it."""
    first = tmp_path / "first"
    code, errors, err = run(capsys, SFT, first, "--trainer.max_steps=4", "--checkpoint_every_n_steps=2")
    assert code == 0 and errors == [], err[-3000:]
    moved = tmp_path / "moved"
    first.rename(moved)
    code, errors, err = run(capsys, SFT, moved, "--ckpt_path=last", "--trainer.max_steps=8", "--checkpoint_every_n_steps=2")
    assert code == 0 and errors == [], err[-3000:]
    assert sorted(p.name for p in (moved / "checkpoints").iterdir()) == ["last.ckpt", "step=8.ckpt"]
    assert checkpoint_step(moved / "checkpoints" / "last.ckpt") == 8


def test_a_resume_with_fewer_checkpoints_kept_prunes_to_the_new_limit(tmp_path, capsys):
    """keep_checkpoints lowered on resume: Lightning restored the run's checkpoints as they were, then failed at its
    next save with a KeyError deep in ModelCheckpoint (fewer kept than the old limit: 2 of 3 here), or never pruned
    again (as many as the old limit)."""
    out = tmp_path / "run"
    code, errors, err = run(capsys, SFT, out, "--trainer.max_steps=4", "--checkpoint_every_n_steps=2", "--keep_checkpoints=3")
    assert code == 0 and errors == [], err[-3000:]
    shutil.copy(out / "checkpoints" / "step=2.ckpt", tmp_path / "step=2.ckpt")
    code, errors, err = run(capsys, SFT, out, "--ckpt_path=last", "--trainer.max_steps=6", "--checkpoint_every_n_steps=1",
                            "--keep_checkpoints=1")
    assert code == 0 and errors == [], err[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["last.ckpt", "step=6.ckpt"]
    assert checkpoint_step(out / "checkpoints" / "last.ckpt") == 6
    # A periodic checkpoint a kill left behind, which the resumed run's record does not name (killed between a save
    # and the removal of the one it replaced), goes at the next save too; a file of the user's stays.
    shutil.copy(tmp_path / "step=2.ckpt", out / "checkpoints" / "step=2.ckpt")
    (out / "checkpoints" / "step=2.ckpt.bak").write_bytes(b"mine")
    code, errors, err = run(capsys, SFT, out, "--ckpt_path=last", "--trainer.max_steps=7", "--checkpoint_every_n_steps=1", "--keep_checkpoints=1")
    assert code == 0 and errors == [], err[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["last.ckpt", "step=2.ckpt.bak", "step=7.ckpt"]


def test_a_checkpoint_past_max_steps_is_one_line_not_a_silent_finish(tmp_path, capsys):
    out = tmp_path / "run"
    # The last step is no multiple of the checkpoints' period: the run still ends with a checkpoint of it.
    code, errors, _ = run(capsys, SFT, out, "--trainer.max_steps=3", "--checkpoint_every_n_steps=2")
    assert code == 0 and errors == [] and checkpoint_step(out / "checkpoints" / "last.ckpt") == 3
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["last.ckpt", "step=2.ckpt"]  # the periodic one
    exported = (out / "hf" / "model.safetensors").read_bytes()
    umask = os.umask(0)
    os.umask(umask)  # every file of the export as readable as a plain write makes it (the weights were 0600)
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in (out / "hf").iterdir()} == {f.name: oct(0o666 & ~umask) for f in (out / "hf").iterdir()}
    for max_steps, ckpt_path in ((2, "last"), (3, str(out / "checkpoints" / "last.ckpt"))):
        code, errors, _ = run(capsys, SFT, out, f"--ckpt_path={ckpt_path}", f"--trainer.max_steps={max_steps}")
        assert code == 2 and errors == [
            f"error: ckpt_path: {out / 'checkpoints' / 'last.ckpt'} is at step 3, and trainer.max_steps is {max_steps}: "
            "there is nothing left to train; raise trainer.max_steps to train on from it"
        ]
    assert (out / "hf" / "model.safetensors").read_bytes() == exported  # not exported again
    # The command a requeued job runs every time (--ckpt_path=last, the run's own limit), after a kill that cut the
    # run's end: that end is written again, the same, and nothing is trained.
    summary = json.loads((out / "summary.json").read_text())
    shutil.rmtree(out / "hf")
    (out / "summary.json").unlink()
    code, errors, err = run(capsys, SFT, out, "--ckpt_path=last", "--trainer.max_steps=3")
    assert code == 0 and errors == [] and (out / "hf" / "model.safetensors").read_bytes() == exported
    assert "resume: nothing is left to train at step 3 (trainer.max_steps is 3): the run's end is written again" in err
    again = json.loads((out / "summary.json").read_text())
    assert {k: v for k, v in again.items() if "seconds" not in k and "memory" not in k} == {k: v for k, v in summary.items() if "seconds" not in k and "memory" not in k}


@contextlib.contextmanager
def little_room(folder: Path, room: int) -> Iterator[str]:
    """``folder`` on a filesystem of ``room`` bytes (a tmpfs: a full disk gives ENOSPC); where mounting is not
    allowed, files in this process limited to ``room`` bytes instead (RLIMIT_FSIZE with SIGXFSZ ignored: EFBIG).
    Yields the error the write will meet."""
    folder.mkdir(parents=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={room}", "tmpfs", str(folder)]
    if shutil.which("mount") and subprocess.run(mount, capture_output=True).returncode == 0:
        try:
            yield "No space left on device"
        finally:
            subprocess.run(["umount", str(folder)], check=True)
        return
    with file_size_limit(room):
        yield "File too large"


def test_a_full_disk_while_checkpointing_is_one_line_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    disk = tmp_path / "disk"
    last = disk / "run" / "checkpoints" / "last.ckpt"
    with little_room(disk, 12 * 2**20) as failure:
        one_step(capsys, SFT, disk / "run")  # a checkpoint (about 6.5 MB) and the export fit
        saved = last.read_bytes()
        if failure == "No space left on device":  # fill the disk but for 1 MB: the next checkpoint cannot fit
            (disk / "filler").write_bytes(b"\0" * (shutil.disk_usage(disk).free - 2**20))
        code, errors, err = run(capsys, SFT, disk / "run", "--ckpt_path=last", "--trainer.max_steps=2")
        assert code == 2 and len(errors) == 1, err[-3000:]
        assert errors[0].startswith(f"error: output_dir: no room for the checkpoint last.ckpt in {last.parent} ({failure}): it needs about ")
        needed = int(errors[0].split("it needs about ")[1].split()[0])
        assert len(saved) * 0.9 < needed < len(saved) * 1.1  # the figure is the checkpoint's size
        assert errors[0].endswith("; the partial file was removed, earlier checkpoints are kept") and "Traceback" not in err
        assert last.read_bytes() == saved and checkpoint_step(last) == 1  # the last good checkpoint, untouched
        assert not list(disk.rglob("*.staging"))


def test_a_full_disk_while_a_sharded_checkpoint_is_written_is_one_line_and_keeps_the_last_good_one(tmp_path):
    """Two FSDP2 ranks write a sharded checkpoint onto a disk that fills up: one line (said once) naming the folder
    and the bytes, the partial folder removed, the step-1 checkpoint untouched."""
    disk = tmp_path / "disk"
    out, rows = disk / "run", tmp_path / "rows.jsonl"
    rows.write_text("".join(TOY_TRAIN.read_text().splitlines(keepends=True)[:20]))
    last = out / "checkpoints" / "last.ckpt"
    two_ranks = [*SFT, f"--data.train_data={rows}", "--trainer.strategy=fsdp2", "--checkpoint_every_n_steps=1"]
    with little_room(disk, 32 * 2**20) as failure:
        assert run_on_two(two_ranks[0], out, *two_ranks[1:], "--trainer.max_steps=1").returncode == 0
        manifest = (last / "manifest.json").read_bytes()
        limit = None
        if failure == "No space left on device":  # fill the disk but for 1 MB: the next checkpoint cannot fit
            (disk / "filler").write_bytes(b"\0" * (shutil.disk_usage(disk).free - 2**20))
        else:  # no tmpfs here: the ranks' files are limited to 1 MB instead (the limit passes to child processes)
            limit = 2**20
        with file_size_limit(limit):
            resumed = run_on_two(two_ranks[0], out, *two_ranks[1:], "--ckpt_path=last", "--trainer.max_steps=2")
        errors = [line for line in resumed.stderr.splitlines() if line.startswith("error:")]
        assert resumed.returncode == 2 and len(errors) == 1 and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
        assert errors[0].startswith(f"error: output_dir: no room for the checkpoint step=2.ckpt in {last.parent} ({failure}): it needs about ")
        needed = int(errors[0].split("it needs about ")[1].split()[0])
        assert 0.8 * folder_bytes(last) < needed < 1.2 * folder_bytes(last)  # the figure is the checkpoint's size
        assert checkpoint_step(last) == 1 and (last / "manifest.json").read_bytes() == manifest
        assert not list(disk.rglob("*.staging"))


def test_a_failed_write_whose_error_lost_its_code_is_still_no_room(tmp_path):
    """A sharded save gathers each rank's failure pickled, which drops the OSError that torch's zip writer chained to
    its own ("unexpected pos"): the write is still said to have had no room, from the room its folder has."""
    tensors = {"w": torch.zeros(2**19)}  # 2 MB
    with file_size_limit(2**20), pytest.raises(RuntimeError) as failed, open(tmp_path / "w.pt", "wb") as file:
        torch.save(tensors, file)  # as a sharded save writes each file
    gathered = CheckpointException("write", {0: (pickle.loads(pickle.dumps(failed.value)), StackSummary())})  # a BaseException
    assert no_room(failed.value).errno == errno.EFBIG and no_room(gathered) is None
    with file_size_limit(2**20):
        assert no_room(gathered, tmp_path, tensor_bytes(tensors)).errno == errno.EFBIG
        assert no_room(gathered, tmp_path, 2**19) is None  # it would have fit: another failure, raised as it is
    assert no_room(gathered, tmp_path, shutil.disk_usage(tmp_path).free + 2**30).errno == errno.ENOSPC


class NoRoomAfterTraining(Callback):
    """Leaves about 1 MB for what a run writes once its training and checkpoints are done (the final export, whose
    callback comes after the recipe's): fills the tmpfs ``disk`` or, where there is none (``fill`` false), limits this
    process's files to 1 MB (the test puts the limit back)."""

    def __init__(self, disk: str, fill: bool) -> None:
        self.disk, self.fill = Path(disk), fill

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.fill:
            (self.disk / "filler").write_bytes(b"\0" * (shutil.disk_usage(self.disk).free - 2**20))
        else:
            resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def test_a_full_disk_while_exporting_is_one_line_and_keeps_the_earlier_export(tmp_path, capsys):
    """The disk fills up after the last step: the export to hf/ is one line naming the folder and the bytes, its
    staging folder is removed, and the export of the run's earlier part stays as it was."""
    disk = tmp_path / "disk"
    out = disk / "run"
    with little_room(disk, 16 * 2**20) as failure:
        one_step(capsys, SFT, out)
        earlier = {path.name: path.read_bytes() for path in (out / "hf").iterdir()}
        no_room = ["--trainer.callbacks+=test_resume_refusals.NoRoomAfterTraining", f"--trainer.callbacks.disk={disk}",
                   f"--trainer.callbacks.fill={failure == 'No space left on device'}"]  # fmt: skip
        with file_size_limit(2**40):  # puts back the limit the callback lowers where no tmpfs can be mounted
            code, errors, err = run(capsys, SFT, out, "--ckpt_path=last", "--trainer.max_steps=2", *no_room)
        assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
        assert errors[0].startswith(f"error: output_dir: no room for the Hugging Face export hf in {out} ({failure}): it needs about ")
        needed = int(errors[0].split("it needs about ")[1].split()[0])
        assert 0.9 * len(earlier["model.safetensors"]) < needed < 1.1 * len(earlier["model.safetensors"])  # the weights' size
        assert errors[0].endswith("; the partial folder hf.tmp was removed, the earlier hf/ is kept")
        assert {path.name: path.read_bytes() for path in (out / "hf").iterdir()} == earlier and not (out / "hf.tmp").exists()
        assert checkpoint_step(out / "checkpoints" / "last.ckpt") == 2  # the run's last step is saved all the same
        assert json.loads((out / "summary.json").read_text())["steps"] == 1  # the finished part's: this one did not finish


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


@contextlib.contextmanager
def file_size_limit(limit: int | None) -> Iterator[None]:
    """Files written by this process and its children limited to ``limit`` bytes (EFBIG past it); None: no limit."""
    if limit is None:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_a_run_ended_on_an_epochs_last_batch_without_validation_data_logs_on_from_where_it_stopped(tmp_path, capsys):
    """Validation is due at an epoch's end, but without val_data it runs no batch and skips its end: the last
    checkpoint, put off until then, was written at the run's end with the epoch counted done, and the resumed run
    logged its steps and epoch one too high."""
    validating = [arg for arg in SFT if arg != "--trainer.limit_val_batches=0"]
    logged = ("--logger.kind=csv", "--trainer.limit_train_batches=3", "--trainer.log_every_n_steps=1")
    for steps, resume in ((3, ()), (5, ("--ckpt_path=last",))):
        code, errors, err = run(capsys, validating, tmp_path / "run", f"--trainer.max_steps={steps}", *logged, *resume)
        assert code == 0 and errors == [], err[-3000:]
    rows = [row for row in csv.DictReader((tmp_path / "run" / "csv" / "version_1" / "metrics.csv").open()) if row.get("train/loss")]
    assert [(row["epoch"], row["step"]) for row in rows] == [("1", "3"), ("1", "4")]


def test_a_run_given_max_epochs_resumes_on_the_batches_it_stopped_at(tmp_path, capsys):
    """With trainer.max_epochs set, counting the schedule's steps made Lightning build the training data before the
    checkpoint was restored: the resumed run trained other batches than an uninterrupted one (a GRPO resume stopped)."""
    from safetensors.torch import load_file

    common = ("--trainer.max_epochs=100", "--model.lr_schedule=constant", "--model.warmup_steps=0")
    code, errors, err = run(capsys, SFT, tmp_path / "whole", "--trainer.max_steps=7", *common)
    assert code == 0 and errors == [], err[-3000:]
    code, errors, err = run(capsys, SFT, tmp_path / "parts", "--trainer.max_steps=3", *common)
    assert code == 0 and errors == [], err[-3000:]
    code, errors, err = run(capsys, SFT, tmp_path / "parts", "--trainer.max_steps=7", "--ckpt_path=last", *common)
    assert code == 0 and errors == [], err[-3000:]
    whole, parts = (load_file(tmp_path / name / "hf" / "model.safetensors") for name in ("whole", "parts"))
    assert all(torch.equal(whole[name], parts[name]) for name in whole)


def test_a_grpo_run_given_max_epochs_resumes(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{k}+{k}=", "answer": str(2 * k)}) + "\n" for k in range(4)))
    grpo = [*GRPO, f"--data.train_data={prompts}", "--data.batch_size=2", "--trainer.max_steps=-1", "--model.eval_generations=0"]
    code, errors, err = run(capsys, grpo, tmp_path / "run", "--trainer.max_epochs=1")
    assert code == 0 and errors == [], err[-3000:]
    code, errors, err = run(capsys, grpo, tmp_path / "run", "--trainer.max_epochs=2", "--ckpt_path=last")
    assert code == 0 and errors == [], err[-3000:]
    assert checkpoint_step(tmp_path / "run" / "checkpoints" / "last.ckpt") == 4


def test_a_resume_is_not_refused_for_the_same_value_written_another_way(tmp_path, monkeypatch):
    """The comparison took the dumped values as they are: the same data file by a relative and an absolute path,
    devices "1" from the command line against 1 from a recipe, precision 32 against 32-true, a model folder moved."""
    from lightning_rl.same_run import changed

    monkeypatch.chdir(tmp_path)
    (tmp_path / "rows.jsonl").write_text("{}\n")
    (tmp_path / "other.jsonl").write_text("{}\n")
    (tmp_path / "moved-model").mkdir()
    saved = yaml.safe_dump({"seed": 0, "data": {"train_data": "rows.jsonl"}, "trainer": {"devices": 1, "precision": "32-true"},
                            "model": {"model_name_or_path": str(tmp_path / "gone-model")}})
    same = yaml.safe_dump({"seed": 0, "data": {"train_data": str(tmp_path / "rows.jsonl")}, "trainer": {"devices": "1", "precision": "32"},
                           "model": {"model_name_or_path": str(tmp_path / "moved-model")}})
    assert changed(saved, same) == []
    other = yaml.safe_dump({"seed": 3, "data": {"train_data": "other.jsonl"}, "trainer": {"devices": 2, "precision": "bf16-mixed"}})
    assert sorted(key for key, _, _ in changed(saved, other)) == ["data.train_data", "seed", "trainer.devices", "trainer.precision"]
    # A model named as on the Hub, or the embedded one, is not "moved" to a local folder: another base, which the
    # exported adapter and the model card would name (the resume trained on the checkpoint's weights).
    for name in ("tiny", "Qwen/Qwen3-0.6B"):
        here = yaml.safe_dump({"model": {"model_name_or_path": str(tmp_path / "moved-model")}})
        assert changed(yaml.safe_dump({"model": {"model_name_or_path": name}}), here) == [
            ("model.model_name_or_path", name, str(tmp_path / "moved-model"))]
    (tmp_path / "elsewhere" / "tiny").mkdir(parents=True)  # a folder named as the embedded model is not it
    here = yaml.safe_dump({"model": {"model_name_or_path": str(tmp_path / "elsewhere" / "tiny")}})
    assert [key for key, _, _ in changed(yaml.safe_dump({"model": {"model_name_or_path": "tiny"}}), here)] == ["model.model_name_or_path"]
    # A relative folder given from another working directory is the same folder.
    (tmp_path / "first" / "outputs" / "sft").mkdir(parents=True)  # the first run's working directory: first/
    here = yaml.safe_dump({"model": {"model_name_or_path": str(tmp_path / "first" / "outputs" / "sft")}})
    assert changed(yaml.safe_dump({"model": {"model_name_or_path": "outputs/sft"}}), here) == []


def test_a_changed_key_that_adds_the_reference_model_is_named_not_called_another_modules_weights(tmp_path, capsys):
    """A resume with loss.beta > 0 has a reference model the run did not: the module's weight check found it first and
    blamed another task, model or LoRA layout. The changed key is named with both values, as any other is."""
    one_step(capsys, GRPO, tmp_path / "run")
    code, errors, _ = run(capsys, GRPO, tmp_path / "run", "--ckpt_path=last", "--trainer.max_steps=2", "--model.loss.beta=0.1")
    assert code == 2 and len(errors) == 1 and errors[0].startswith("error: model.loss.beta=0.1 here, 0.0 in the run: ckpt_path: "), errors


def test_a_lora_checkpoint_resumed_under_fsdp2_names_the_strategy_before_torch_reads_it(tmp_path, capsys):
    """FSDP2 reads a checkpoint's optimizer state itself, before any hook of the run's: a LoRA run's file checkpoint
    failed there in torch's words (missing optimizer state), in a traceback. The changed key is named first."""
    lora = ["--model.lora.r=4", "--model.lora.target_modules=[q_proj]"]
    one_step(capsys, SFT, tmp_path / "run", *lora)
    environment = dict(os.environ)
    code, errors, err = run(capsys, SFT, tmp_path / "run", *lora, "--ckpt_path=last", "--trainer.max_steps=2", "--trainer.strategy=fsdp2")
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert len(errors) == 1 and errors[0].startswith("error: trainer.strategy=fsdp2 here, auto in the run: ckpt_path: "), errors
    # Lightning's rendezvous variables (MASTER_PORT, LOCAL_RANK, ...) left behind made the next two-rank run of this
    # process's children wait for a peer that never came.
    # (OMP_NUM_THREADS, which Lightning sets for a multi-process strategy where it is unset, stays: it is no rendezvous.)
    assert {k: v for k, v in os.environ.items() if environment.get(k) != v and k in cli._LAUNCH_ENV} == {}


def test_a_checkpoint_resumed_under_another_strategy_is_one_line_naming_it(tmp_path):
    """A sharded checkpoint (a folder) resumed by DDP ended in IsADirectoryError's traceback on every rank, and a DDP
    checkpoint resumed by FSDP2 was said to hold no weights. Both name the changed strategy, before anything trains."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(TOY_TRAIN.read_text().splitlines(keepends=True)[:20]))
    for wrote, resumes in (("fsdp2", "ddp"), ("ddp", "fsdp2")):
        out = tmp_path / wrote
        args = [*SFT[1:], f"--data.train_data={rows}", "--trainer.max_steps=1"]
        assert run_on_two(SFT[0], out, *args, f"--trainer.strategy={wrote}").returncode == 0
        resumed = run_on_two(SFT[0], out, *args, "--trainer.max_steps=2", f"--trainer.strategy={resumes}", "--ckpt_path=last")
        errors = sorted({line for line in resumed.stderr.splitlines() if line.startswith("error:")})
        assert resumed.returncode == 2 and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
        assert len(errors) == 1 and errors[0].startswith(f"error: trainer.strategy={resumes} here, {wrote} in the run: ckpt_path: "), errors


def test_a_list_changed_in_part_is_named_by_the_items_that_changed():
    """A resume changing one reward's weight showed the whole list twice, both cut at 80 characters to the same text."""
    from lightning_rl.errors import RecipeError
    from lightning_rl.same_run import check_same_run

    rewards = [{"function": "math_answer", "weight": 1.0, "kwargs": {}, "name": None},
               {"function": "my_long_module_name:my_reward", "weight": 0.5, "kwargs": {"pattern": "x"}, "name": None}]
    saved = yaml.safe_dump({"task": "grpo", "model": {"rewards": rewards}})
    rewards[1] = {**rewards[1], "weight": 0.7}
    with pytest.raises(RecipeError, match=r"^model\.rewards\[1\]\.weight=0\.7 here, 0\.5 in the run: ckpt_path: last\.ckpt resumes"):
        check_same_run(saved, yaml.safe_dump({"task": "grpo", "model": {"rewards": rewards}}), "last.ckpt")


def test_a_list_that_grew_or_shrank_is_named_by_the_items_added_or_removed():
    """A reward appended (or one removed) showed both whole lists, cut at 80 characters to the same text; and any two
    long values alike in their first 80 characters read the same."""
    from lightning_rl.errors import RecipeError
    from lightning_rl.same_run import check_same_run

    math, fmt, mine = ({"function": name, "weight": 1.0, "kwargs": {}, "name": None} for name in ("math_answer", "format", "mine:reward"))
    saved = yaml.safe_dump({"task": "grpo", "model": {"rewards": [math, fmt, mine]}})
    added = yaml.safe_dump({"task": "grpo", "model": {"rewards": [math, fmt, mine, {**fmt, "name": "f2"}]}})
    with pytest.raises(RecipeError) as refused:
        check_same_run(saved, added, "last.ckpt")
    assert str(refused.value).startswith(
        "model.rewards[3]={function: format, kwargs: {}, name: f2, weight: 1.0} here, not in the run: ckpt_path: last.ckpt resumes")
    with pytest.raises(RecipeError, match=r"^model\.rewards\[1\]=\{function: format, kwargs: \{\}, name: null, weight: 1\.0\} in the run, not here: "):
        check_same_run(saved, yaml.safe_dump({"task": "grpo", "model": {"rewards": [math, mine]}}), "last.ckpt")
    prompt = "You are a careful assistant. Think step by step, then give the final answer alone on the last line"
    with pytest.raises(RecipeError, match=r"^model\.system_prompt=\.\.\.alone on the last line! here, \.\.\.alone on the last line\. in the run: "):
        check_same_run(yaml.safe_dump({"model": {"system_prompt": prompt + "."}}), yaml.safe_dump({"model": {"system_prompt": prompt + "!"}}), "last.ckpt")


def test_a_number_recorded_as_text_is_shown_as_the_number():
    """The command line records ``--trainer.devices=2`` as the text '2'; the refusal quoted it so, beside a 1."""
    from lightning_rl.errors import RecipeError
    from lightning_rl.same_run import check_same_run

    with pytest.raises(RecipeError, match=r"^trainer\.devices=1 here, 2 in the run: ckpt_path: last\.ckpt resumes"):
        check_same_run(yaml.safe_dump({"trainer": {"devices": "2"}}), yaml.safe_dump({"trainer": {"devices": 1}}), "last.ckpt")
    with pytest.raises(RecipeError, match=r"^model\.system_prompt='011' here, '010' in the run: "):  # not YAML 1.1's octal 9 and 8
        check_same_run(yaml.safe_dump({"model": {"system_prompt": "010"}}), yaml.safe_dump({"model": {"system_prompt": "011"}}), "last.ckpt")
    with pytest.raises(RecipeError, match=r"^model\.system_prompt='yes' here, 'no' in the run: "):  # text stays text
        check_same_run(yaml.safe_dump({"model": {"system_prompt": "no"}}), yaml.safe_dump({"model": {"system_prompt": "yes"}}), "last.ckpt")
