"""A run folder belongs to one run, and a broken step never reaches it.

`lightning-rl run` refuses a folder that holds an earlier run unless it resumes it or is told `--overwrite`, keeps a
concurrent run out with a lock (a lock left by a killed run is taken over), writes nothing before the model and
data are set up, and stops on a non-finite loss or gradient norm with one line, before the optimizer step, so the
newest checkpoint stays the last good one. Real runs of the tiny SFT recipe, in this process unless noted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Callback

from lightning_rl import cli, run_folder
from lightning_rl.checkpoints import checkpoint_step, newest_complete
from support.paths import REPO, TOY_HELDOUT, TOY_TRAIN
from support.run_outputs import not_known_as_the_runs

TINY_SFT = [
    str(REPO / "recipes" / "tiny" / "sft.yaml"), "--data.val_data=null", "--data.max_tokens=256",
    "--model.eval_generations=0", "--model.warmup_steps=1", "--trainer.val_check_interval=null",
    "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
]  # fmt: skip


class PoisonAtStep(Callback):
    """Makes step ``step`` (1-based) non-finite: NaN weights, so a NaN loss; or an infinite gradient, finite loss."""

    def __init__(self, step: int, what: str = "loss") -> None:
        self.step, self.what = step, what

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.what == "loss" and trainer.global_step + 1 == self.step:
            with torch.no_grad():
                next(pl_module.parameters()).fill_(float("nan"))

    def on_after_backward(self, trainer, pl_module) -> None:
        if self.what == "gradient" and trainer.global_step + 1 == self.step:
            next(p for p in pl_module.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")


def run(capsys, out: Path, *extra: str) -> tuple[int, list[str]]:
    """`lightning-rl run` in this process; its exit code and its `error:` lines."""
    code = cli.main(["run", *TINY_SFT, f"--output_dir={out}", *extra])
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.startswith("error:")]


@pytest.fixture
def rows(tmp_path: Path) -> Path:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(TOY_TRAIN.read_text().splitlines(keepends=True)[:60]))
    return data


@pytest.mark.parametrize("what, expected", [("loss", "loss is nan"), ("gradient", "gradient norm is inf")])
def test_non_finite_step_stops_with_one_line_and_keeps_the_last_good_checkpoint(tmp_path, capsys, rows, what, expected):
    out = tmp_path / "run"
    code, errors = run(
        capsys, out, f"--data.train_data={rows}", "--trainer.max_steps=8", "--checkpoint_every_n_steps=1",
        "--trainer.callbacks+=test_run_folder.PoisonAtStep", "--trainer.callbacks.step=5", f"--trainer.callbacks.what={what}",
    )  # fmt: skip
    assert code == 1
    assert errors == [f"error: step 5: {expected}; stopped before the optimizer step, no checkpoint written for it"]
    # save_top_k=1 used to replace step 4 with a NaN step 5; now step 5 never happened.
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints == ["last.ckpt", "step=4.ckpt"]
    for name in checkpoints:
        state = torch.load(out / "checkpoints" / name, weights_only=True)
        assert state["global_step"] == 4
        assert all(torch.isfinite(t).all() for t in state["state_dict"].values())
    assert not (out / "hf").exists() and not (out / "summary.json").exists()


class SignalDuringStep(Callback):
    """Sends this process SIGTERM as step ``step`` (1-based) starts: the run stops at that step's end."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step + 1 == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def logged(out: Path, key: str) -> list[tuple[int, float]]:
    """(step, value) of every row of the run's CSV logs (every resume's too) that holds ``key``."""
    import csv

    rows = [row for path in sorted(out.glob("csv/version_*/metrics.csv")) for row in csv.DictReader(path.open())]
    return [(int(row["step"]), float(row[key])) for row in rows if row.get(key)]


def test_a_run_stopped_at_a_step_that_validates_runs_that_validation_on_resume(tmp_path, capsys, rows):
    """Lightning resumes a checkpoint written at a step's end past the validation due after that step: a run stopped
    by a signal there logged no ``val/loss`` for it. The resumed run validates first, at the same logged step."""
    validating = [f"--data.train_data={rows}", f"--data.val_data={TOY_HELDOUT}", "--trainer.val_check_interval=3",
                  "--trainer.check_val_every_n_epoch=null", "--trainer.limit_val_batches=1", "--trainer.max_steps=7", "--trainer.log_every_n_steps=1"]  # fmt: skip
    assert run(capsys, tmp_path / "whole", *validating)[0] == 0
    stopped = tmp_path / "stopped"
    code, _ = run(capsys, stopped, *validating, "--trainer.callbacks+=test_run_folder.SignalDuringStep", "--trainer.callbacks.step=3")
    assert code == 143 and checkpoint_step(next(stopped.glob("hpc_ckpt_*.ckpt"))) == 3
    assert [step for step, _ in logged(stopped, "val/loss")] == []  # validation was due after the last step trained
    assert run(capsys, stopped, *validating, "--ckpt_path=last")[0] == 0
    whole = logged(tmp_path / "whole", "val/loss")
    assert [step for step, _ in whole] == [2, 5]
    assert logged(stopped, "val/loss") == whole
    assert logged(stopped, "train/loss") == logged(tmp_path / "whole", "train/loss")


def weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "hf" / "model.safetensors")


@pytest.mark.parametrize("case", ["past max_steps into max_epochs", "max_steps at a validation", "max_epochs into more epochs"])
def test_a_finished_run_resumed_further_trains_as_an_uninterrupted_one(tmp_path, capsys, rows, case):
    """The last step's checkpoint was written at the end of training, with its epoch counted as finished: a resume to
    max_epochs stopped an epoch early (56 steps of 112), and one past a last step that validated logged every step one
    late. It is written at the step's end now (after its validation), as a periodic one is."""
    constant = [f"--data.train_data={rows}", "--model.lr_schedule=constant", "--model.warmup_steps=0", "--trainer.log_every_n_steps=1"]
    if case == "past max_steps into max_epochs":
        first, then = ["--trainer.max_steps=3", "--trainer.max_epochs=2"], ["--trainer.max_steps=-1", "--trainer.max_epochs=2"]
    elif case == "max_epochs into more epochs":
        first, then = ["--trainer.max_steps=-1", "--trainer.max_epochs=1"], ["--trainer.max_steps=-1", "--trainer.max_epochs=3"]
    else:
        constant += [f"--data.val_data={TOY_HELDOUT}", "--trainer.val_check_interval=10", "--trainer.check_val_every_n_epoch=null",
                     "--trainer.limit_val_batches=1", "--trainer.accumulate_grad_batches=2"]
        first, then = ["--trainer.max_steps=5"], ["--trainer.max_steps=8"]
    assert run(capsys, tmp_path / "whole", *constant, *then)[0] == 0
    assert run(capsys, tmp_path / "split", *constant, *first)[0] == 0
    assert run(capsys, tmp_path / "split", *constant, *then, "--ckpt_path=last")[0] == 0
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert json.loads((split / "summary.json").read_text())["steps"] == json.loads((whole / "summary.json").read_text())["steps"]
    for key in ("train/loss", "val/loss", "epoch"):
        assert logged(split, key) == logged(whole, key), key
    assert all(torch.equal(weights(split)[name], tensor) for name, tensor in weights(whole).items())


def test_a_signal_during_the_last_step_lets_the_run_finish(tmp_path, capsys, rows):
    """A signal during the last step saved that step and stopped (143): its resume was refused, nothing left to train,
    and the run never exported. The run finishes instead, whole, and says so."""
    out = tmp_path / "run"
    code, errors = run(capsys, out, f"--data.train_data={rows}", "--trainer.max_steps=3",
                       "--trainer.callbacks+=test_run_folder.SignalDuringStep", "--trainer.callbacks.step=3")  # fmt: skip
    assert code == 0 and errors == []
    assert json.loads((out / "summary.json").read_text())["steps"] == 3 and (out / "hf" / "model.safetensors").is_file()
    assert not list(out.glob("hpc_ckpt_*.ckpt")) and torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 3


def files(folder: Path) -> dict[Path, bytes]:
    """Every file under ``folder`` and its bytes."""
    return {path: path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def test_a_folder_holding_a_run_is_refused_unless_resumed_or_overwritten(tmp_path, capsys, rows):
    out = tmp_path / "run"
    code, errors = run(capsys, out, f"--data.train_data={rows}", "--trainer.max_steps=3", "--checkpoint_every_n_steps=1")
    assert code == 0 and errors == []
    assert not_known_as_the_runs(out) == []  # --overwrite would take every file the run wrote
    earlier = files(out)
    # A user's files beside the run and inside its folders: not the run's, so --overwrite leaves them.
    mine = {out / "notes.txt": b"mine", out / "checkpoints" / "notes.txt": b"which step was best",
            out / "csv" / "version_0" / "plot.png": b"\x89PNG", out / "checkpoints" / "step=3.ckpt.bak": b"a copy of mine"}  # fmt: skip
    for path, data in mine.items():
        path.write_bytes(data)
    code, errors = run(capsys, out, f"--data.train_data={rows}", "--trainer.max_steps=2")
    assert code == 2
    assert errors == [f"error: output_dir: {out} already holds a run (checkpoints, csv, hf, notes.txt, ...); resume it with "
                      "--ckpt_path=last, or replace it with --overwrite (which removes only the files the run wrote)"]  # fmt: skip
    assert files(out) == {**earlier, **mine}

    code, errors = run(capsys, out, f"--data.train_data={rows}", "--trainer.max_steps=2", "--overwrite")
    assert code == 0 and errors == []
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    assert {p: p.read_bytes() for p in mine} == mine
    # step=3.ckpt went with the old run, and its CSV log (the user's plot keeps version_0, so the new log is version_1).
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["last.ckpt", "notes.txt", "step=3.ckpt.bak"]
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2
    assert sorted(p.name for p in (out / "csv" / "version_0").iterdir()) == ["plot.png"] and (out / "csv" / "version_1" / "hparams.yaml").exists()
    recipe = (out / "recipe.yaml").read_text()
    assert recipe.startswith(run_folder.MARKER + "\n") and "overwrite: false" in recipe  # rerunning it replaces nothing
    logged = yaml.safe_load((out / "csv" / "version_1" / "hparams.yaml").read_text())
    assert logged["overwrite"] is False and logged["trainer.max_steps"] == 2  # the logged hyperparameters are recipe.yaml's
    assert "model.learning_rate" in logged and "learning_rate" not in logged  # each once, by its recipe key
    assert not (out / ".lock").exists() and not list(out.rglob(run_folder.PREFIX + "*"))


class RefusedBeforeTheFirstStep(Callback):
    """A refusal after the run folder is taken and before the first step (a GRPO prompt too long for the engine's
    context is found there, once the engine is built)."""

    def on_train_start(self, trainer, pl_module) -> None:
        from lightning_rl.errors import RecipeError

        raise RecipeError("refused before the first step", "model.sampling")


def test_an_overwrite_refused_before_its_first_step_gives_the_earlier_run_back(tmp_path, capsys, rows):
    """--overwrite removed the earlier run's files, then the refusal the new run's: the folder was left empty."""
    out = tmp_path / "run"
    assert run(capsys, out, f"--data.train_data={rows}", "--trainer.max_steps=1") == (0, [])
    earlier = files(out)
    code, errors = run(capsys, out, f"--data.train_data={rows}", "--trainer.max_steps=2", "--overwrite",
                       "--trainer.callbacks=test_run_folder.RefusedBeforeTheFirstStep")
    assert code == 2 and errors == ["error: model.sampling: refused before the first step"]
    assert files(out) == earlier and not list(out.rglob(run_folder.PREFIX + "*"))
    assert run(capsys, tmp_path / "new", f"--data.train_data={rows}", "--trainer.max_steps=1", "--overwrite") == (0, [])  # nothing to set aside


def test_overwrite_on_a_folder_of_user_files_deletes_nothing(tmp_path, capsys, rows):
    """Files named as a run's outputs, but no recipe.yaml that a run wrote: the folder is not a run's."""
    out = tmp_path / "mine"
    user = {out / "recipe.yaml": b"task: sft\n", out / "summary.json": b"{}", out / "hpc_ckpt_3.ckpt": b"x",
            out / "checkpoints" / "last.ckpt": b"my model", out / "hf" / "config.json": b"{}", out / "csv" / "version_0" / "metrics.csv": b"a,b",
            out / "wandb" / "latest-run" / "f": b"", out / "thesis.tex": b"\\begin{document}"}  # fmt: skip
    for path, data in user.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    folders = sorted(p for p in out.rglob("*") if p.is_dir())
    for flags in (["--overwrite"], [], ["--ckpt_path=last"]):
        code, errors = run(capsys, out, f"--data.train_data={rows}", "--trainer.max_steps=1", *flags)
        assert code == 2
        assert errors == [f"error: output_dir: {out} holds files that are not a run's (checkpoints, csv, hf, hpc_ckpt_3.ckpt, ...; "
                          "no recipe.yaml written by a run): a run neither writes into it nor, with --overwrite, removes anything "
                          "from it; choose another output_dir"], flags  # fmt: skip
        assert files(out) == user and sorted(p for p in out.rglob("*") if p.is_dir()) == folders


def test_a_file_the_run_did_not_write_in_hf_is_refused_rather_than_replaced(tmp_path, capsys, rows):
    out = tmp_path / "run"
    assert run(capsys, out, f"--data.train_data={rows}", "--trainer.max_steps=1") == (0, [])
    (out / "hf" / "NOTES.md").write_text("my notes")
    earlier = files(out)
    for flags in (["--overwrite"], ["--ckpt_path=last", "--trainer.max_steps=2"]):  # both end in a new export
        code, errors = run(capsys, out, f"--data.train_data={rows}", "--trainer.max_steps=1", *flags)
        assert code == 2
        assert errors == [f"error: output_dir: {out}/hf holds files the run did not write (hf/NOTES.md), and the run's export "
                          "replaces hf/ whole: move them out first"]  # fmt: skip
        assert files(out) == earlier
    (out / "hf" / "NOTES.md").unlink()
    assert run(capsys, out, f"--data.train_data={rows}", "--trainer.max_steps=1", "--overwrite") == (0, [])
    assert not (out / "hf" / "NOTES.md").exists() and (out / "hf" / "model.safetensors").exists()


def test_an_empty_output_dir_is_refused_before_anything_is_written_where_it_points(tmp_path, capsys, monkeypatch, rows):
    monkeypatch.chdir(tmp_path)  # "" is the working folder to Path: a run and --overwrite would write and remove here
    for extra in ([], ["--overwrite"]):
        code = cli.main(["run", *TINY_SFT, "--output_dir=", f"--data.train_data={rows}", *extra])
        assert code == 2 and capsys.readouterr().err.splitlines()[-1] == "error: output_dir must name a folder, got ''"
        assert [p.name for p in tmp_path.iterdir()] == ["rows.jsonl"]


def test_a_run_that_fails_during_setup_writes_nothing(tmp_path, capsys, rows):
    fresh = tmp_path / "fresh"
    code, errors = run(capsys, fresh, f"--data.train_data={rows}", "--data.max_tokens=8")  # every row too long
    assert code == 2 and len(errors) == 1 and "longer than max_length=8 (raise data.max_tokens, which max_length may not exceed, or shorten the row)" in errors[0]
    assert not fresh.exists()  # no logger folder, no lock, no recipe.yaml

    resumed = tmp_path / "resumed"  # a resume whose model cannot be loaded leaves the earlier recipe.yaml alone
    resumed.mkdir()
    (resumed / "recipe.yaml").write_text(run_folder.marked("task: sft\n"))
    code, errors = run(capsys, resumed, f"--data.train_data={rows}", "--ckpt_path=last", f"--model.model_name_or_path={tmp_path / 'no-model'}")
    assert code == 2 and errors == [f"error: model.model_name_or_path: no model folder at {tmp_path / 'no-model'}"]
    assert sorted(p.name for p in resumed.iterdir()) == ["recipe.yaml"] and (resumed / "recipe.yaml").read_text() == run_folder.marked("task: sft\n")


def test_a_concurrent_run_is_refused_and_a_killed_runs_lock_is_taken_over(tmp_path, capsys, rows):
    out = tmp_path / "run"
    progress = tmp_path / "progress"
    env = {**os.environ, "PROGRESS_FILE": str(progress), "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    holder = subprocess.Popen(
        [sys.executable, "-m", "lightning_rl.cli", "run", *TINY_SFT, f"--output_dir={out}", f"--data.train_data={rows}",
         "--trainer.max_steps=100000", "--checkpoint_every_n_steps=2", "--trainer.callbacks+=support.signalled_runs.Progress"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not (progress.exists() and len(progress.read_text().split()) >= 6):  # a few steps in, checkpoints written
            assert holder.poll() is None and time.monotonic() < deadline, holder.stderr.read()[-3000:]
            time.sleep(0.05)
        code, errors = run(capsys, out, f"--data.train_data={rows}", "--ckpt_path=last")
        assert code == 2
        assert errors == [f"error: output_dir: {out} is in use by another run (pid {holder.pid} on {os.uname().nodename}); "
                          "let it finish or choose another output_dir"]  # fmt: skip
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # dies holding the lock: its lock file stays behind
        holder.wait()
    assert (out / ".lock").read_text().startswith(f"pid {holder.pid} ")
    saved = newest_complete(out)[0].step
    code, errors = run(capsys, out, f"--data.train_data={rows}", "--ckpt_path=last", f"--trainer.max_steps={saved + 2}")
    assert code == 0 and errors == []
    assert newest_complete(out)[0].step == saved + 2 and not (out / ".lock").exists()


def test_a_set_aside_run_comes_back_whole_after_a_new_run_that_never_trained(tmp_path):
    """Set aside in place (a checkpoints folder on another filesystem stays there; wandb's latest-run link stays a
    link), given back whole, and given back by the next --overwrite after a new run killed before its first step."""
    out = tmp_path / "run"
    for name, data in {"recipe.yaml": run_folder.marked("task: sft\n"), "summary.json": "{}", "checkpoints/last.ckpt": "w",
                       "csv/version_0/metrics.csv": "step\n", "wandb/run-20260101_000000-abc/files/x": "1"}.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(data)
    (out / "wandb" / "latest-run").symlink_to("run-20260101_000000-abc")
    earlier = files(out)
    run_folder.set_aside_run_files(out)
    assert run_folder.run_files(out) == [] and not run_folder.is_run_folder(out)
    (out / "recipe.yaml").write_text(run_folder.marked("task: sft\n# the new run, killed before its first step\n"))
    (out / "csv" / "version_0").mkdir(parents=True)  # the new log took version 0 again
    (out / "csv" / "version_0" / "hparams.yaml").write_text("new")
    run_folder.set_aside_run_files(out)  # the next --overwrite: the earlier run back first, then set aside again
    run_folder.restore_set_aside(out)
    assert files(out) == earlier and (out / "wandb" / "latest-run").is_symlink() and not (out / run_folder.ASIDE).exists()
    run_folder.set_aside_run_files(out)
    run_folder.drop_set_aside(out)
    assert run_folder.run_files(out) == [] and not list(out.rglob(run_folder.PREFIX + "*"))
