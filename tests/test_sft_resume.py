"""A run stopped by SIGTERM and resumed from its last checkpoint ends with the same weights as an
uninterrupted run of the same seed (the data order, optimizer and LR schedule all pick up exactly)."""

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from safetensors.torch import load_file

from support.paths import REPO, TOY_TRAIN

TESTS = Path(__file__).resolve().parent


class SigtermAtStep(Callback):
    """Sends this process a real SIGTERM once ``step`` optimizer steps are done (what a scheduler does)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def run_cli(output_dir: Path, data: Path, *extra: str, max_steps: int = 8) -> subprocess.CompletedProcess:
    args = [
        sys.executable, "-m", "lightning_rl.cli", "run", str(REPO / "recipes" / "tiny" / "sft.yaml"),
        f"--output_dir={output_dir}", f"--data.train_data={data}", "--data.val_data=null",
        "--data.max_tokens=256", "--model.eval_generations=0", "--model.warmup_steps=2",
        f"--trainer.max_steps={max_steps}", "--checkpoint_every_n_steps=3", "--trainer.val_check_interval=null",
        "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--trainer.log_every_n_steps=1", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


# Dropout draws from the global random generator, whose state the checkpoint keeps: without it the resumed run drew
# other masks (LoRA's dropout here), and ended 4e-3 away.
@pytest.mark.parametrize("options", [(), ("--model.lora={r: 4, alpha: 8, dropout: 0.1}",)], ids=["full", "lora-dropout"])
def test_sigterm_then_resume_matches_uninterrupted_run(tmp_path, tiny_path, options):
    data = tmp_path / "rows.jsonl"  # small enough that 8 steps cross an epoch boundary
    data.write_text("".join(TOY_TRAIN.read_text().splitlines(keepends=True)[:60]))

    reference = run_cli(tmp_path / "reference", data, *options)
    assert reference.returncode == 0, reference.stderr[-3000:]

    killed_dir = tmp_path / "killed"
    killed = run_cli(killed_dir, data, *options, "--trainer.callbacks+=test_sft_resume.SigtermAtStep", "--trainer.callbacks.step=5")
    assert killed.returncode == 143
    assert "stopped by SIGTERM after step 5; resume with --ckpt_path=last" in killed.stderr
    assert not (killed_dir / "hf").exists() and not (killed_dir / "summary.json").exists()
    signal_checkpoint = killed_dir / "hpc_ckpt_5.ckpt"  # saved where the signal found it, not at step 3
    assert torch.load(signal_checkpoint, weights_only=True)["global_step"] == 5

    resumed = run_cli(killed_dir, data, *options, "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Restored all states from the checkpoint at {signal_checkpoint}" in resumed.stdout + resumed.stderr
    # summary.json describes the whole run, as the uninterrupted one does, not only the 3 steps after the resume.
    summary = json.loads((killed_dir / "summary.json").read_text())
    want_summary = json.loads((tmp_path / "reference" / "summary.json").read_text())
    for key in ("steps", "micro_batches", "first_loss", "last_loss", "tokens", "flat_tokens"):
        assert summary[key] == want_summary[key], key
    assert summary["micro_batches"] == 8

    want = load_file(tmp_path / "reference" / "hf" / "model.safetensors")
    got = load_file(killed_dir / "hf" / "model.safetensors")
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=0, rtol=0, msg=name)
    initial = load_file(tiny_path / "model.safetensors")  # training moved the weights: equality is not trivial
    assert any(not torch.equal(initial[name], got[name]) for name in initial)

    # The logged curve: the stopped run's log ends with the step it saved (Lightning logs a step after the hook the
    # stop is raised in), and with the resumed run's it holds every step once, as the uninterrupted run logs them.
    def losses(run: Path, version: int) -> dict[int, str]:
        rows = csv.DictReader((run / "csv" / f"version_{version}" / "metrics.csv").open())
        return {int(row["step"]): row["train/loss"] for row in rows if row.get("train/loss")}

    before, after = losses(killed_dir, 0), losses(killed_dir, 1)
    assert sorted(before) == list(range(5)) and sorted(after) == list(range(5, 8))
    assert {**before, **after} == losses(tmp_path / "reference", 0)


def test_a_stopped_run_logs_only_the_steps_its_logging_interval_takes(tmp_path):
    """Every third step logged, as an uninterrupted run logs steps 2, 5 (0-based): the stop after step 5 logged its
    step 4 as well."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(TOY_TRAIN.read_text().splitlines(keepends=True)[:60]))
    killed = run_cli(tmp_path / "killed", data, "--trainer.log_every_n_steps=3", "--trainer.callbacks+=test_sft_resume.SigtermAtStep",
                     "--trainer.callbacks.step=5")  # fmt: skip
    assert killed.returncode == 143, killed.stderr[-3000:]
    rows = csv.DictReader((tmp_path / "killed" / "csv" / "version_0" / "metrics.csv").open())
    assert [int(row["step"]) for row in rows if row.get("train/loss")] == [2]


def test_a_finished_run_extended_from_its_last_checkpoint_trains_what_one_longer_run_does(tmp_path):
    """A run that stopped at its max_steps inside an epoch saved its last checkpoint after Lightning closed that
    epoch: extended (another max_steps, --ckpt_path=last), it goes on with the rest of the epoch's rows, not the next
    epoch's (which skipped them, and trained other weights than one run of the longer length)."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(TOY_TRAIN.read_text().splitlines(keepends=True)[:60]))
    constant = "--model.lr_schedule=constant_with_warmup"  # the same rate at a step, whatever the run's length
    reference = run_cli(tmp_path / "reference", data, constant)
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert run_cli(tmp_path / "extended", data, constant, max_steps=2).returncode == 0  # saved at its end, not every 3
    extended = run_cli(tmp_path / "extended", data, constant, "--ckpt_path=last")
    assert extended.returncode == 0 and "resume: step 2 from checkpoints/last.ckpt" in extended.stderr, extended.stderr[-3000:]
    want = load_file(tmp_path / "reference" / "hf" / "model.safetensors")
    got = load_file(tmp_path / "extended" / "hf" / "model.safetensors")
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_periodic_checkpoint_at_an_epochs_last_step_is_written_there(tmp_path, accumulate):
    """With validation every n steps (not every epoch), Lightning put off a save due at an epoch's last batch until a
    validation that did not come: it was written one micro-batch into the next step (without that micro-batch's
    gradient, so a resume from it trained another step 5), or, without accumulation, never."""
    data, val = tmp_path / "rows.jsonl", tmp_path / "val.jsonl"
    lines = TOY_TRAIN.read_text().splitlines(keepends=True)
    data.write_text("".join(lines[:60]))  # 4 micro-batches an epoch at 256 tokens
    val.write_text("".join(lines[60:70]))
    run = run_cli(tmp_path / "run", data, f"--data.val_data={val}", "--trainer.val_check_interval=6", "--trainer.limit_val_batches=1",
                  f"--trainer.accumulate_grad_batches={accumulate}", "--checkpoint_every_n_steps=2", "--keep_checkpoints=10")  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    saved = sorted((tmp_path / "run" / "checkpoints").glob("step=*.ckpt"), key=lambda path: int(path.stem.split("=")[1]))
    assert [path.name for path in saved] == [f"step={step}.ckpt" for step in (2, 4, 6, 8)]
    for path in saved:
        state = torch.load(path, weights_only=True)
        progress = state["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]
        assert progress["ready"] == state["global_step"] * accumulate, (path.name, progress)  # at its step's end, no micro-batch after
