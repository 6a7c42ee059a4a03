"""What a run prints: the progress bar counts optimizer steps across epochs, under short names; Lightning's tips
are dropped."""

import json
import logging

from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from support.paths import TOY_HELDOUT, TOY_TRAIN

from lightning_rl.callbacks import RunSummary
from lightning_rl.console import StepProgressBar, quiet_third_party_noise
from support.paths import REPO
from lightning_rl.data.sft import SFTDataModule
from lightning_rl.modules.sft import SFTModule


def _fit_sft(tmp_path, bar, **trainer_args):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(TOY_TRAIN.read_text().splitlines(keepends=True)[:8]))  # a few rows: several epochs
    trainer = Trainer(accelerator="cpu", max_steps=5, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                      enable_model_summary=False, callbacks=[bar, RunSummary(tmp_path, task="sft")],
                      **{"limit_val_batches": 0, **trainer_args})  # fmt: skip
    trainer.fit(SFTModule(learning_rate=1e-3, eval_generations=0), datamodule=SFTDataModule(rows, TOY_HELDOUT, max_tokens=128))
    return trainer


def test_the_bar_counts_optimizer_steps_across_epochs(tmp_path, tiny_path):
    bar = StepProgressBar(terminal=True)
    trainer = _fit_sft(tmp_path, bar)
    assert trainer.current_epoch > 1
    assert (bar.train_progress_bar.n, bar.train_progress_bar.total) == (5, 5)
    assert bar.train_progress_bar.desc.startswith("step")
    shown = bar.get_metrics(trainer, trainer.lightning_module)
    assert {"loss", "lr", "tok/s"} <= set(shown) and "v_num" not in shown and not any(k.startswith("train/") for k in shown)


def test_without_a_terminal_progress_is_a_plain_line_every_few_steps(tmp_path, tiny_path, capsys):
    """A SLURM log or a pipe gets lines, not carriage returns: one every log_every_n_steps steps and at the last."""
    _fit_sft(tmp_path, StepProgressBar(terminal=False), log_every_n_steps=2)
    out = capsys.readouterr().out
    assert "\r" not in out
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/5", "4/5", "5/5"], out
    assert all(" loss " in line and " lr " in line and " tok/s " in line for line in lines), lines
    # summary.json's names do not depend on the run's length: 5 steps give a window of 2 under the same names.
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["loss_window"] == 2 and {"loss_first_window_mean", "loss_last_window_mean"} <= set(summary)


def test_without_a_terminal_each_validation_says_its_figures_at_its_step(tmp_path, tiny_path, capsys):
    """The last step's line is printed before that step's validation: the validation's own line gives its loss."""
    trainer = _fit_sft(tmp_path, StepProgressBar(terminal=False), limit_val_batches=1, log_every_n_steps=2)
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines() if line.startswith("validation at step ")]
    assert len(lines) >= 2 and [int(line[3]) for line in lines] == sorted({int(line[3]) for line in lines}), lines
    assert lines[-1][3:6] == ["5", "val_loss", f"{float(trainer.callback_metrics['val/loss']):.4g}"], lines
    # A step's line does not carry an earlier validation's loss over, as if that step had been validated.
    assert not [line for line in out.splitlines() if line.startswith("step ") and "val_" in line], out


def test_lightning_tips_are_dropped(caplog):
    quiet_third_party_noise()
    with caplog.at_level(logging.INFO):
        rank_zero_info("💡 Tip: For seamless cloud logging, try installing something")
        rank_zero_info("GPU available: False")
    assert "Tip" not in caplog.text and "GPU available" in caplog.text


def test_a_grpo_run_with_a_reference_model_says_nothing_about_lightnings_defaults(tmp_path):
    """The frozen reference (eval mode) and checkpoints after a manual optimizer step are by design, and a rerun
    with --overwrite replaces the folder the CLI has ruled on: no warning about any of it."""
    import warnings

    from lightning_rl.cli import main

    args = ["run", str(REPO / "recipes" / "tiny" / "grpo.yaml"), f"--output_dir={tmp_path}", "--trainer.max_steps=2",
            "--checkpoint_every_n_steps=1", "--model.loss.beta=0.05", "--trainer.enable_progress_bar=false"]  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(args) == 0
        assert main([*args, "--overwrite"]) == 0
    said = [str(w.message) for w in caught]
    assert not [m for m in said if "in eval mode" in m or "ModelCheckpoint with manual optimization" in m or "is not empty" in m], said
