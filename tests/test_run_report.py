"""A run says what it did: its closing line, the held-out score in the logs at each evaluation, GRPO's gradient norm
and rollout samples, the checkpoints it keeps, how a resume with another max_steps changes the schedule, a model card
and a portable base model in the export, and no noise from libraries a text run does not use."""

from __future__ import annotations

import csv
import importlib.util
import json
import logging
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from lightning_rl import cli, run_folder
from lightning_rl.launch import slurm
from lightning_rl.modules.grpo_metrics import append_rows
from support.paths import REPO

SFT, GRPO, SFT_LORA = (str(REPO / "recipes" / "tiny" / name) for name in ("sft.yaml", "grpo.yaml", "sft_lora.yaml"))
QUIET = ["--trainer.enable_model_summary=false", "--trainer.log_every_n_steps=1"]


def logged(out: Path, name: str) -> dict[int, float]:
    """``name`` by step, from the run's CSV logs (the last version: a resumed run writes a new one)."""
    *_, metrics = sorted(out.glob("csv/version_*/metrics.csv"))
    return {int(row["step"]): float(row[name]) for row in csv.DictReader(metrics.open()) if row.get(name)}


def test_an_sft_run_logs_each_evaluation_keeps_its_checkpoints_and_says_how_a_resume_changes_the_schedule(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["run", SFT, f"--output_dir={out}", *QUIET, "--data.max_tokens=256", "--model.eval_generations=4",
            "--model.warmup_steps=0", "--model.learning_rate=1e-3", "--trainer.val_check_interval=3",
            "--checkpoint_every_n_steps=2", "--keep_checkpoints=2"]  # fmt: skip
    assert cli.main([*args, "--trainer.max_steps=6"]) == 0
    said = capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    closing = said.out.strip().splitlines()[-1]
    assert closing.startswith(f"done: 6 steps in {summary['wall_seconds']:.1f} s; held-out exact match ")
    assert closing.endswith(f"of 4; summary {out / 'summary.json'}; model {out / 'hf'}")
    # Each validation's exact match is in the logs, at its val/loss's step (Lightning's: after 3 steps, step 2), the
    # last one the summary's (evaluated once at that step).
    exact = logged(out, "val/exact_match")
    assert sorted(exact) == sorted(logged(out, "val/loss")) == [2, 5] and exact[5] == summary["heldout_exact_match"]
    # The newest two periodic checkpoints, and last.ckpt.
    assert sorted(path.name for path in (out / "checkpoints").iterdir()) == ["last.ckpt", "step=4.ckpt", "step=6.ckpt"]
    card = (out / "hf" / "README.md").read_text()
    assert "Trained with lightning-rl: SFT of `tiny` for 6 optimizer steps on `train.jsonl`" in card
    assert "| `learning_rate` | `0.001` |" in card and "library_name: transformers" in card

    # Resumed to 8 steps: the cosine schedule (no warmup) spans 8 steps from the resumed step on, not 6.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main([*args, "--trainer.max_steps=8", "--ckpt_path=last"]) == 0
    said = capsys.readouterr()
    new, old = 1e-3 * 0.5 * (1 + math.cos(math.pi * 6 / 8)), 0.0
    assert (f"resume at step 6: trainer.max_steps is 8, the checkpoint's run had 6: the learning-rate schedule now spans 8 "
            f"steps (it spanned 6), so the learning rate at this step is {new:.3g}, not {old:.3g}") in said.err  # fmt: skip
    assert logged(out, "train/lr")[6] == pytest.approx(new, rel=1e-6)  # the step after the resume trains at it
    # The data position comes back with the datamodule's state: Lightning's warning about the DataLoader is not said.
    assert not [w for w in caught if "dataloader is not resumable" in str(w.message)]
    assert said.out.strip().splitlines()[-1].startswith("done: 8 steps in ")


def test_a_resume_at_the_end_of_the_warmup_does_not_call_a_cosine_schedule_length_free(tmp_path, capsys):
    """There both schedules give the peak rate: the line says the span changed, and the next step follows the new one."""
    out = tmp_path / "run"
    args = ["run", SFT, f"--output_dir={out}", *QUIET, "--data.val_data=null", "--data.max_tokens=256", "--model.eval_generations=0",
            "--model.warmup_steps=2", "--model.learning_rate=1e-3", "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0"]  # fmt: skip
    assert cli.main([*args, "--trainer.max_steps=2"]) == 0
    capsys.readouterr()
    assert cli.main([*args, "--trainer.max_steps=6", "--ckpt_path=last"]) == 0
    said = capsys.readouterr().err
    assert ("resume at step 2: trainer.max_steps is 6, the checkpoint's run had 2: the learning-rate schedule now spans 6 steps "
            "(it spanned 2); the learning rate at this step stays 0.001, the next ones follow the new span") in said
    assert logged(out, "train/lr")[3] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 1 / 4)), rel=1e-6)
    # Which schedules are built over the run's length (only those are said to span it).
    from transformers import get_scheduler

    from lightning_rl.callbacks import _spans_the_run

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    spans = {name: _spans_the_run(get_scheduler(name, optimizer, num_warmup_steps=2, num_training_steps=10))
             for name in ("constant", "constant_with_warmup", "inverse_sqrt", "linear", "cosine", "cosine_with_restarts", "polynomial")}
    assert [name for name, over in spans.items() if over] == ["linear", "cosine", "cosine_with_restarts", "polynomial"]


def test_a_resume_given_more_epochs_follows_the_longer_schedule_and_one_with_none_left_is_refused(tmp_path, capsys):
    """Bounded by trainer.max_epochs (max_steps -1 both times), a resume with more epochs trained its first step at
    the old schedule's end rate (0) without a word; one with no epoch left re-exported the run as finished."""
    from lightning_rl.checkpoints import checkpoint_step

    out, rows = tmp_path / "run", tmp_path / "rows.jsonl"
    rows.write_text("".join((REPO / "lightning_rl" / "assets" / "toy" / "train.jsonl").read_text().splitlines(keepends=True)[:8]))
    args = ["run", SFT, f"--output_dir={out}", *QUIET, f"--data.train_data={rows}", "--data.val_data=null", "--data.max_tokens=128",
            "--model.eval_generations=0", "--model.warmup_steps=0", "--model.lr_schedule=cosine", "--model.learning_rate=1e-3",
            "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0", "--trainer.max_steps=-1"]  # fmt: skip
    assert cli.main([*args, "--trainer.max_epochs=1"]) == 0
    epoch = checkpoint_step(out / "checkpoints" / "last.ckpt")
    capsys.readouterr()
    assert cli.main([*args, "--trainer.max_epochs=2", "--ckpt_path=last"]) == 0
    assert (f"resume at step {epoch}: trainer.max_epochs is 2, the checkpoint's run had 1: the learning-rate schedule now spans "
            f"{2 * epoch} steps (it spanned {epoch}), so the learning rate at this step is 0.0005, not 0") in capsys.readouterr().err
    assert logged(out, "train/lr")[epoch] == pytest.approx(0.5e-3, rel=1e-6)  # the cosine's middle, where it was 0
    exported = (out / "hf" / "model.safetensors").read_bytes()
    last = out / "checkpoints" / "last.ckpt"
    for epochs, ckpt_path in ((2, last), (1, "last")):  # --ckpt_path=last at the run's own limit writes its end again
        assert cli.main([*args, f"--trainer.max_epochs={epochs}", f"--ckpt_path={ckpt_path}"]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"error: ckpt_path: {last} has trained 2 epochs (step {2 * epoch}), and trainer.max_epochs "
            f"is {epochs}: there is nothing left to train; raise trainer.max_epochs to train on from it")
    assert (out / "hf" / "model.safetensors").read_bytes() == exported
    # A checkpoint at the epoch's last batch (a periodic one there: the epoch's end saves no other), which Lightning
    # counts as a whole epoch on resume; and max_steps given too, beside the epochs that bind.
    again = tmp_path / "again"
    assert cli.main([*args, f"--output_dir={again}", "--trainer.max_epochs=1", f"--checkpoint_every_n_steps={epoch}"]) == 0
    (again / "checkpoints" / "last.ckpt").unlink()  # the periodic one is the newest
    capsys.readouterr()
    for limits in ([], ["--trainer.max_steps=100"]):
        assert cli.main([*args, f"--output_dir={again}", "--trainer.max_epochs=1", *limits, f"--ckpt_path={again / 'checkpoints' / f'step={epoch}.ckpt'}"]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
            f"has trained 1 epoch (step {epoch}), and trainer.max_epochs is 1: there is nothing left to train; raise trainer.max_epochs to train on from it")
    assert cli.main([*args, f"--output_dir={again}", "--trainer.max_epochs=1", "--ckpt_path=last"]) == 0
    assert f"resume: nothing is left to train at step {epoch} (trainer.max_epochs is 1)" in capsys.readouterr().err


def test_held_out_generations_without_held_out_data_are_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    code = cli.main(["run", SFT, f"--output_dir={out}", "--trainer.max_steps=1", "--data.val_data=null",
                     "--model.eval_generations=4", "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0"])  # fmt: skip
    assert code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error[-1] == "error: model.eval_generations=4 needs held-out conversations to decode, but data.val_data is not set"
    assert "Traceback" not in "\n".join(error) and not out.exists()


def test_keep_checkpoints_must_be_positive(tmp_path, capsys):
    assert cli.main(["run", SFT, f"--output_dir={tmp_path / 'run'}", "--keep_checkpoints=0"]) == 2
    assert capsys.readouterr().err == "error: keep_checkpoints must be >= 1, got 0\n"


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_a_seed_numpy_cannot_take_is_one_line_in_run_and_plan(tmp_path, capsys, seed):
    assert cli.main(["run", SFT, f"--output_dir={tmp_path / 'run'}", f"--seed={seed}"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"error: seed must be in [0, 2**32 - 1], got {seed}"
    assert cli.main(["plan", SFT, "--nodes", "1", "--gpus-per-node", "1", "--gpu-memory-gb", "80", "--", f"--seed={seed}"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"error: seed must be in [0, 2**32 - 1], got {seed}"


def test_a_grpo_run_logs_its_gradient_norm_held_out_score_and_rollouts_without_wandb(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["run", GRPO, f"--output_dir={out}", *QUIET, "--trainer.max_steps=3", "--model.log_rollouts_every_n_steps=2",
                     "--model.eval_data=toy", "--model.eval_generations=4", "--model.num_generations=4", "--data.batch_size=2"]) == 0  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    norms = logged(out, "train/grad_norm")
    assert sorted(norms) == [0, 1, 2] and all(math.isfinite(norm) and norm >= 0 for norm in norms.values())
    # After the last step: at that step's row, 2, as validations are (it was at 3, a row of its own after the last
    # training row); before the first, under a name of its own at 0 (under one name, W&B kept either it or step 1's).
    exact, before = logged(out, "val/exact_match"), logged(out, "val/exact_match_before")
    assert sorted(exact) == [2] and exact[2] == summary["heldout_exact_match"] and before == {0: summary["heldout_exact_match_before"]}
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0] * 8 + [2] * 8  # 2 prompts x 4 completions, every 2 steps
    assert {"prompt", "completion", "reward", "weight_version", "math_answer", "format"} <= set(rows[0])
    tied = logged(out, "train/reward/frac_zero_std")  # TRL's frac_reward_zero_std: groups whose rewards all tie
    for step in (0, 2):
        groups = {}
        for row in rows:
            if row["step"] == step:
                groups.setdefault(row["prompt"], []).append(row["reward"])
        assert len(groups) == 2 and tied[step] == sum(len(set(g)) == 1 for g in groups.values()) / 2
        for row in (row for row in rows if row["step"] == step):  # TRL's table's advantage: against its group's rewards
            group = torch.tensor(groups[row["prompt"]], dtype=torch.float64)
            assert row["advantage"] == pytest.approx(float((row["reward"] - group.mean()) / (group.std() + 1e-4)), abs=1e-6)
    longest, shortest = logged(out, "train/completions/max_length"), logged(out, "train/completions/min_length")
    assert sorted(longest) == [0, 1, 2] and all(1 <= shortest[s] <= logged(out, "train/completions/mean_length")[s] <= longest[s] for s in longest)
    closing = capsys.readouterr().out.strip().splitlines()[-1]
    assert "held-out exact match" in closing and "(before training: " in closing
    assert out / "rollouts.jsonl" in run_folder.run_files(out)  # --overwrite removes it with the run
    # Two optimizer steps per batch: a batch's rows once, under the step that first trained it (as the logged figures).
    again = tmp_path / "iterations"
    assert cli.main(["run", GRPO, f"--output_dir={again}", *QUIET, "--trainer.max_steps=4", "--model.log_rollouts_every_n_steps=1",
                     "--model.num_iterations=2", "--model.num_generations=4", "--data.batch_size=2"]) == 0  # fmt: skip
    rows = [json.loads(line) for line in (again / "rollouts.jsonl").read_text().splitlines()]
    assert [(row["step"], row["batch"]) for row in rows] == [(0, 0)] * 8 + [(2, 1)] * 8
    rewards = logged(again, "train/reward")
    assert sum(row["reward"] for row in rows[8:]) / 8 == pytest.approx(rewards[2], abs=1e-5)


def test_under_a_trainer_of_ones_own_each_experiment_keeps_its_rollout_rows(tmp_path):
    """Not in the working directory, where a second experiment replaced the first one's rows from its first step on:
    in the logger's folder of each experiment, as its metrics.csv."""
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from lightning_rl.data.prompts import PromptDataModule
    from lightning_rl.modules.grpo import GRPOModule
    from support.grpo import DIGIT_REWARDS, FAST

    for seed in (0, 1):
        L.seed_everything(seed, verbose=False)
        module = GRPOModule(**{**FAST, "rewards": DIGIT_REWARDS, "log_rollouts_every_n_steps": 1})
        L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=CSVLogger(tmp_path), default_root_dir=tmp_path / "root",
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(module, PromptDataModule(batch_size=2))  # fmt: skip
    assert not (tmp_path / "root").exists() or not list((tmp_path / "root").glob("**/rollouts.jsonl"))
    for version in (0, 1):
        rows = [json.loads(line) for line in (tmp_path / "lightning_logs" / f"version_{version}" / "rollouts.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows] == [0] * 8


def test_rollout_rows_of_a_step_written_again_replace_the_earlier_ones(tmp_path):
    """A resumed run redoes the steps after its checkpoint: their rows are replaced, the earlier ones kept."""
    path = tmp_path / "rollouts.jsonl"
    for step in (0, 10, 20):
        append_rows(path, [{"step": step, "completion": f"first {step}"}] * 2)
    append_rows(path, [{"step": 10, "completion": "again"}])
    assert [(row["step"], row["completion"]) for row in map(json.loads, path.read_text().splitlines())] == [
        (0, "first 0"), (0, "first 0"), (10, "again")]  # fmt: skip
    append_rows(path, [{"step": 20, "completion": "next"}])
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 0, 10, 20]


def test_a_reward_none_gave_is_null_in_the_rollouts_and_leaves_the_summary_means_alone(tmp_path):
    """JSON has no NaN (strict readers refuse it); a step whose every reward was None scores nothing to average."""
    from lightning_rl.modules.grpo_metrics import run_summary

    path = tmp_path / "rollouts.jsonl"
    append_rows(path, [{"step": 0, "rewards": {"r": float("nan")}, "reward": float("inf")}])
    (row,) = [json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in JSON")) for line in path.read_text().splitlines()]
    assert row == {"step": 0, "rewards": {"r": None}, "reward": None}
    summary = run_summary([1.0, float("nan"), 2.0, 3.0], 2, [])
    assert summary["reward_first_window_mean"] == 1.0 and summary["reward_last_window_mean"] == 2.5


def test_a_lora_adapter_names_its_base_model_as_the_recipe_does(tmp_path):
    out = tmp_path / "run"
    assert cli.main(["run", SFT_LORA, f"--output_dir={out}", "--trainer.max_steps=1", "--model.export=adapter",
                     "--model.eval_generations=0", "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0"]) == 0  # fmt: skip
    assert json.loads((out / "hf" / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny"
    card = (out / "hf" / "README.md").read_text()
    assert card.startswith("---\nbase_model: tiny\nlibrary_name: peft\n") and "| `lora.r` | `16` |" in card
    assert str(Path.home()) not in card
    # The card's code loads the adapter onto its base ('tiny' is no hub id: lightning-rl builds it).
    loaded = _run_card_code(card, out / "hf")
    assert type(loaded["model"]).__name__ == "PeftModelForCausalLM" and loaded["tokenizer"] is not None


def _run_card_code(card: str, folder: Path) -> dict:
    code = card.split("```python\n", 1)[1].split("```", 1)[0]
    scope = {"FOLDER": str(folder)}
    exec(code, scope)
    return scope


def test_an_image_text_models_card_loads_it_with_the_image_text_classes_and_its_processor():
    """AutoModelForCausalLM does not load a Llava folder (an unrecognized configuration class)."""
    from lightning_rl.modules.model_card import model_card
    from lightning_rl.toy.vlm import tiny_vlm_path

    card = model_card(task="SFT", base_model="tiny-vlm", export="model", steps=1, data=None, settings={}, image_text=True, embedded_base=True)
    loaded = _run_card_code(card, tiny_vlm_path())
    assert type(loaded["model"]).__name__ == "LlavaForConditionalGeneration" and hasattr(loaded["processor"], "image_processor")


def test_a_model_that_loads_only_as_image_text_gets_that_class_beside_its_tokenizer(tiny_muse_path):
    """Muse Spark Open's folder holds a tokenizer, no processor, and its config loads only with the image-text auto
    class: the card named AutoModelForCausalLM, whose code failed (an unrecognized configuration class)."""
    from transformers import AutoConfig

    from lightning_rl.models.structure import auto_model_class
    from lightning_rl.modules.model_card import model_card

    model_class = auto_model_class(AutoConfig.from_pretrained(tiny_muse_path)).__name__
    card = model_card(task="SFT", base_model="muse", export="model", steps=1, data=None, settings={}, model_class=model_class)
    loaded = _run_card_code(card, tiny_muse_path)
    assert type(loaded["model"]).__name__ == "MuseSparkForConditionalGeneration" and loaded.get("tokenizer") is not None


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="transformers warns only without torchvision")
def test_a_text_run_imports_nothing_that_warns_about_torchvision():
    imports = "import lightning_rl.cli, lightning_rl.recipe, lightning_rl.modules.sft, lightning_rl.modules.grpo"
    done = subprocess.run([sys.executable, "-c", imports], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0 and "torchvision" not in done.stderr, done.stderr


@pytest.mark.parametrize("mode,shared", [(("--model.async_mode=true",), True), ((), False),
                                         (("--model.async_mode=true", "--model.max_staleness=0"), False)])  # fmt: skip
def test_an_async_grpo_run_on_the_cpu_gives_the_rollout_thread_its_share_of_the_cores(tmp_path, monkeypatch, mode, shared):
    """Without OMP_NUM_THREADS, a rollout thread sampling on the CPU beside the trainer halves torch's intra-op threads
    (process-wide: each side then runs teams of half the cores); a sync run, and an async one at staleness 0 (whose
    rollout thread samples only between steps, and which trains as the sync run does), keep them."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        assert cli.main(["run", GRPO, f"--output_dir={tmp_path / 'run'}", "--trainer.max_steps=1", "--logger.kind=none",
                         "--model.num_generations=2", "--data.batch_size=1", *mode]) == 0  # fmt: skip
        assert torch.get_num_threads() == (max(1, len(os.sched_getaffinity(0)) // 2) if shared else 8)
        assert not (tmp_path / "run" / "rollouts.jsonl").exists()  # a run that logs nowhere writes no rollout rows
    finally:
        torch.set_num_threads(before)


def test_launch_checks_a_recipe_without_seeding_or_saying_so(capsys, caplog):
    with caplog.at_level(logging.INFO):
        assert slurm.main(["slurm", SFT, "--nodes", "1", "--gpus-per-node", "1", "--partition", "p", "--dry-run"]) == 0
    said = capsys.readouterr()
    assert said.out.startswith("#!/bin/bash") and "Seed set" not in caplog.text + said.err + said.out


def test_a_grpo_steps_figures_of_every_rank_make_the_steps_by_their_kind():
    """Counts add up over the ranks, extremes are the ranks' extremes, the rest are averaged (each rank's alone was
    rank 0's in the logs)."""

    from lightning_rl.modules.grpo_metrics import _reduction as reduction

    assert {key: reduction(key) for key in (
        "reward/unscored", "reward/math_answer/errors", "rollouts/excluded", "rollouts/excluded/engine", "tools/failures/raised",
        "tools/calls", "trained_tokens", "completions/max_length", "mismatch/ratio_min", "reward/mean", "loss", "kl",
        "completions/mean_length", "reward/frac_zero_std", "flat_tokens", "completions/min_terminated_length", "clip/high_max",
        "mismatch/is_ratio_min")} == {  # fmt: skip
        **dict.fromkeys(("reward/unscored", "reward/math_answer/errors", "rollouts/excluded", "rollouts/excluded/engine",
                         "tools/failures/raised", "tools/calls", "trained_tokens", "flat_tokens"), "sum"),
        "completions/max_length": "max", "mismatch/ratio_min": "min", "completions/min_terminated_length": "min", "clip/high_max": "max",
        "mismatch/is_ratio_min": "min",
        **dict.fromkeys(("reward/mean", "loss", "kl", "completions/mean_length", "reward/frac_zero_std"), "mean"),
    }


def test_a_group_of_equal_rewards_counts_as_tied_though_its_float32_std_is_not_zero():
    from lightning_rl.modules.grpo_metrics import _frac_tied_groups

    rewards = torch.tensor([0.1] * 8 + [0.0, 1.0] * 4)
    assert float(rewards[:8].std()) != 0.0  # the rounding TRL's isclose absorbs
    assert _frac_tied_groups(rewards, [0] * 8 + [1] * 8) == 0.5
    # A group with fewer than two scored rewards has no std: not tied (TRL's nanstd is NaN there), but counted.
    nan = float("nan")
    assert _frac_tied_groups(torch.tensor([nan, nan, 1.0, 1.0, 0.5, nan]), [0, 0, 1, 1, 2, 2]) == pytest.approx(1 / 3)


def test_terminated_lengths_are_trls_and_no_extreme_is_logged_as_an_infinity():
    """TRL's completions/*_terminated_length: over the completions that ended, 0 where none did. A smallest or largest
    that a step has none of (no completion ended, no token trained) is 0 in the logs, never an infinity."""
    from lightning_rl.modules.grpo_metrics import StepStats, _extremes, batch_metrics
    from lightning_rl.rollout.base import Rollout
    from lightning_rl.rollout.buffer import ScoredBatch
    from support.grpo import fit

    module, _ = fit(1)

    def batch(*ends: str) -> dict:
        rollouts = [Rollout([1], [5] * (2 + k), [-0.5] * (2 + k), weight_version=0, group_id=0, finish_reason=end) for k, end in enumerate(ends)]
        metrics = batch_metrics(ScoredBatch(0, [{"prompt": "p"}], rollouts, [1.0] * len(ends), {"r": [1.0] * len(ends)}), with_tools=False)
        return metrics | _extremes(module, metrics | StepStats().metrics())

    ended = batch("stop", "length", "stop")  # 2, 3 and 4 tokens, the second ran out
    assert (ended["completions/mean_terminated_length"], ended["completions/min_terminated_length"], ended["completions/max_terminated_length"]) == (3.0, 2.0, 4.0)
    assert (ended["completions/min_length"], ended["completions/max_length"]) == (2.0, 4.0)
    truncated = batch("length", "length")
    assert [truncated[f"completions/{kind}_terminated_length"] for kind in ("mean", "min", "max")] == [0.0, 0.0, 0.0]
    assert math.isnan(truncated["clip/low_min"]) and math.isnan(truncated["clip/high_max"])  # no sequence trained: TRL's NaN
    alone = batch("stop")  # one scored sample: TRL's nanstd is NaN (a 0 read as every sample tied)
    assert math.isnan(float(alone["reward/std"])) and math.isnan(float(alone["reward/r/std"])) and float(ended["reward/std"]) == 0.0


def test_rollout_rows_under_a_logger_without_a_folder_go_under_its_name_and_version(tmp_path):
    """A logger that keeps no folder of its own (MLflow's: a save_dir shared by every experiment) has the rows under
    its name and version there, one experiment's apart from another's."""
    import lightning as L
    from lightning.pytorch.loggers import Logger

    from lightning_rl.data.prompts import PromptDataModule
    from lightning_rl.modules.grpo import GRPOModule
    from support.grpo import DIGIT_REWARDS, FAST

    class Tracking(Logger):  # a tracking server's logger: metrics leave the machine, nothing in a folder of its own
        name, version, save_dir = "experiment", "run-7", str(tmp_path / "tracking")

        def log_metrics(self, metrics, step=None):
            pass

        def log_hyperparams(self, params, *args, **kwargs):
            pass

    L.seed_everything(0, verbose=False)
    module = GRPOModule(**{**FAST, "rewards": DIGIT_REWARDS, "log_rollouts_every_n_steps": 1})
    L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=Tracking(), default_root_dir=tmp_path / "root", enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(module, PromptDataModule(batch_size=2))  # fmt: skip
    rows = (tmp_path / "tracking" / "experiment" / "run-7" / "rollouts.jsonl").read_text().splitlines()
    assert len(rows) == 8 and not (tmp_path / "tracking" / "rollouts.jsonl").exists()
