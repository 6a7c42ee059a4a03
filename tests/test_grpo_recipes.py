"""The GRPO recipes through the `lightning-rl run` command: they train, write summary.json with the
reward windows, log to W&B offline with a rollout table, and refuse bad input with one error line."""

from __future__ import annotations

import csv
import json

import pytest
import yaml

from lightning_rl.cli import main


def _run(recipe: str, tmp_path, *overrides: str) -> int:
    return main(["run", recipe, f"--output_dir={tmp_path}", "--trainer.max_steps=2", "--checkpoint_every_n_steps=1000",
                 *overrides])


def test_tiny_grpo_recipe_trains_and_logs_a_rollout_table_to_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert _run("recipes/tiny/grpo.yaml", tmp_path, "--logger.kind=wandb", "--model.log_rollouts_every_n_steps=1",
                "--model.async_mode=true") == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["grpo_steps"] == 2 and summary["max_staleness_seen"] <= 1
    assert 0.0 <= summary["reward_first_window_mean"] <= 1.5 and "reward_last_window_mean" in summary
    tables = list(tmp_path.glob("wandb/offline-run-*/files/media/table/rollouts_*.table.json"))
    assert len(tables) == 2  # one per step
    table = json.loads(tables[0].read_text())
    assert table["columns"][:7] == ["step", "batch", "prompt", "completion", "reward", "advantage", "weight_version"]
    assert len(table["data"]) == 4 * 8  # prompts x G
    assert (tmp_path / "hf" / "config.json").exists()


def test_tool_recipe_runs_multi_turn_and_logs_tool_metrics(tmp_path):
    # --overwrite with the CSV logger: the recipe logged as hyperparameters at fit start was in the folder that
    # --overwrite then emptied of the earlier run's files, and Lightning found its logger's folder gone.
    assert _run("recipes/tiny/grpo_tools.yaml", tmp_path, "--model.sampling.max_new_tokens=8", "--data.batch_size=1", "--overwrite") == 0
    (metrics_file,) = tmp_path.glob("csv/version_*/metrics.csv")
    rows = list(csv.DictReader(metrics_file.open()))
    logged = {key for row in rows for key, value in row.items() if value}
    (hparams_file,) = tmp_path.glob("csv/version_*/hparams.yaml")
    hparams = yaml.safe_load(hparams_file.read_text())  # the resolved recipe, the loss and sampling keys included
    assert hparams["model.loss.beta"] == 0.0 and hparams["data.batch_size"] == 1 and hparams["trainer.max_steps"] == 2
    assert hparams["model.sampling.max_new_tokens"] == 8 and hparams["model.tools"]
    assert {"train/tools/calls", "train/reward/tool_call_validity/mean", "train/packing_ratio", "train/entropy",
            "train/rollout/staleness", "train/speed/generation_tokens_per_s", "train/clip/fraction"} <= logged
    # Every failure kind and exclusion reason at every step, 0 where none (a logger's summary keeps the last value).
    steps = [row for row in rows if row.get("train/tools/calls")]
    counts = [f"train/tools/failures/{kind}" for kind in ("malformed", "unknown_tool", "invalid_arguments", "raised", "timeout", "worker_lost")]
    counts += [f"train/rollouts/excluded/{reason}" for reason in ("engine", "tool_worker", "reward_timeout")]
    assert steps and all(float(row[key]) >= 0 for row in steps for key in counts)


@pytest.mark.parametrize(
    "override,message",
    [
        ("--model.num_generations=1", "num_generations=1: GRPO needs G >= 2"),
        ("--model.rewards=[{function: nowhere.module:score}]", "reward function 'nowhere.module:score': no module 'nowhere' in the recipe's folder"),
        ("--model.tools=[nowhere.tools:calc]", "tool 'nowhere.tools:calc': no module 'nowhere' in the recipe's folder"),
        ("--data.train_data=tests/missing.jsonl", "data.train_data: no such file or folder: tests/missing.jsonl"),
    ],
)
def test_bad_recipe_input_fails_before_training_with_one_error_line(tmp_path, capsys, override, message):
    assert _run("recipes/tiny/grpo.yaml", tmp_path, override) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: ") and message in error
    assert not (tmp_path / "summary.json").exists()


def test_grpo_from_sft_reports_held_out_accuracy_before_and_after_with_the_sft_evaluator(tmp_path, tiny_path, capsys):
    """Two steps from the embedded model (the recipe's own start is the SFT recipe's export: benchmarks/grpo_learns.py
    runs it whole); the figures are the SFT evaluator's, on the same held-out problems."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightning_rl.modules.evaluation import exact_match, heldout_cases
    from lightning_rl.toy.task import HELDOUT_FILE

    assert _run("recipes/tiny/grpo_from_sft.yaml", tmp_path / "run", "--model.model_name_or_path=tiny",
                "--model.eval_generations=16", "--data.batch_size=2") == 0  # fmt: skip
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    cases = heldout_cases(str(HELDOUT_FILE), tokenizer, str(tiny_path))[:16]
    before = exact_match(AutoModelForCausalLM.from_pretrained(tiny_path), tokenizer, cases, max_new_tokens=16)
    after = exact_match(AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf"), tokenizer, cases, max_new_tokens=16)
    assert summary["heldout_examples"] == 16
    assert summary["heldout_exact_match_before"] == before["heldout_exact_match"]
    assert summary["heldout_exact_match"] == after["heldout_exact_match"]
    capsys.readouterr()
    assert main(["run", "recipes/tiny/grpo_from_sft.yaml", f"--output_dir={tmp_path / 'bad'}", "--model.model_name_or_path=tiny",
                 "--model.eval_data=null"]) == 2  # fmt: skip
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: model.eval_generations needs model.eval_data (held-out conversations; toy: the embedded task's)"
    )
    # A held-out file with a row the evaluator cannot read: one line naming the row, before the run writes anything.
    unanswered = tmp_path / "unanswered.jsonl"
    unanswered.write_text(json.dumps({"messages": [{"role": "user", "content": "1+1="}]}) + "\n")
    assert main(["run", "recipes/tiny/grpo_from_sft.yaml", f"--output_dir={tmp_path / 'late'}", "--model.model_name_or_path=tiny",
                 f"--model.eval_data={unanswered}", "--model.eval_generations=2"]) == 2  # fmt: skip
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: {unanswered}: line 1: ")
    assert not (tmp_path / "late").exists() or not any((tmp_path / "late").iterdir())
