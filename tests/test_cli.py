"""The `lightning-rl` command: recipe mistakes give one error line and exit 2 without touching earlier
outputs; sub-commands dispatch; the tiny recipe trains end to end and its summary.json shows learning."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from support.paths import REPO
from support.run_outputs import not_known_as_the_runs
from lightning_rl import cli, run_folder
from lightning_rl.checkpoints import RESUME_KEYS, ForeignCheckpointError, StagedCheckpointIO
from lightning_rl.errors import RecipeError
from lightning_rl.recipe import parse

TINY_RECIPE = REPO / "recipes" / "tiny" / "sft.yaml"


def recipe_with(tmp_path: Path, edit) -> Path:
    config = yaml.safe_load(TINY_RECIPE.read_text())
    config["data"]["train_data"] = str(REPO / config["data"]["train_data"])
    config["data"]["val_data"] = str(REPO / config["data"]["val_data"])
    config["output_dir"] = str(tmp_path / "out")
    edit(config)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def error_line(capsys, argv) -> str:
    assert cli.main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1, err
    return err[0]


def set_key(dotted: str, value):
    def edit(config):
        *parents, last = dotted.split(".")
        node = config
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value

    return edit


RECIPE_MISTAKES = {
    "typo in a model key": (set_key("model.learnin_rate", 1.0), "unknown key 'model.learnin_rate'"),
    "typo in a trainer key": (set_key("trainer.max_stepz", 3), "unknown key 'trainer.max_stepz'"),
    "unknown top-level block": (set_key("lora.r", 4), "unknown key 'lora' (did you mean 'model.lora'?)"),
    "wrong type": (set_key("model.learning_rate", "fast"), "model.learning_rate must be a number, got fast"),
    "wrong type of an optional key": (set_key("data.pad_to_multiple_of", "x"), "data.pad_to_multiple_of must be auto, an integer or null, got x"),
    "bad choice": (set_key("data.packing", "zip"), "data.packing must be one of auto, tree, flat, none, got zip"),
    "missing data file": (set_key("data.train_data", "no/such.jsonl"), "data.train_data: no such file or folder: no/such.jsonl"),
    "unknown task": (set_key("task", "dpo"), "task must be one of sft, grpo, got 'dpo'"),
    "export without lora": (set_key("model.export", "adapter"), "model.export='adapter' needs a model.lora block"),
}


@pytest.mark.parametrize("case", sorted(RECIPE_MISTAKES))
def test_recipe_mistake_is_one_clear_line(case, tmp_path, capsys):
    edit, expected = RECIPE_MISTAKES[case]
    line = error_line(capsys, ["run", str(recipe_with(tmp_path, edit))])
    assert expected in line
    assert not (tmp_path / "out").exists()


def test_command_line_override_typo_and_missing_recipe(tmp_path, capsys):
    assert "unknown key 'trainer.max_stpes'" in error_line(capsys, ["run", str(recipe_with(tmp_path, lambda c: None)), "--trainer.max_stpes=2"])
    assert error_line(capsys, ["run", str(tmp_path / "nope.yaml")]) == f"error: {tmp_path / 'nope.yaml'}: no such recipe file"
    (tmp_path / "recipes").mkdir(), (tmp_path / "recipes" / "sft.yaml").write_text("task: sft\n")
    assert error_line(capsys, ["run", str(tmp_path / "recipes")]) == f"error: {tmp_path / 'recipes'}: a folder, not a recipe file (it holds sft.yaml)"
    no_task = tmp_path / "no_task.yaml"
    no_task.write_text("model: {}\n")
    assert "missing key 'task'" in error_line(capsys, ["run", str(no_task)])


def test_bad_data_row_stops_before_anything_is_written_and_keeps_earlier_outputs(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    good = {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}
    bad.write_text(json.dumps(good) + "\n" + json.dumps({"messages": [{"role": "user", "content": ["x"]}]}) + "\n")
    recipe = recipe_with(tmp_path, set_key("data.train_data", str(bad)))
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    earlier = {out / "summary.json": '{"steps": 7}\n', out / "checkpoints" / "last.ckpt": "earlier run", out / "recipe.yaml": run_folder.marked("task: sft\n")}
    for path, text in earlier.items():
        path.write_text(text)
    # --overwrite: the earlier outputs would be replaced, but only once the data has been checked.
    line = error_line(capsys, ["run", str(recipe), "--overwrite"])
    assert line == f'error: {bad}: line 2: `messages[0]`.content[0] must be {{"type": "text", "text": ...}} or {{"type": "image", "image": PATH_OR_URL}}'
    assert {p: p.read_text() for p in earlier} == earlier
    assert {p for p in out.rglob("*") if p.is_file()} == set(earlier)  # no new file, none half-written


def test_a_list_on_the_command_line_replaces_the_recipes_list(tmp_path, capsys):
    """The GRPO recipe weighs `format` 0.5 with a pattern; two rewards given on the command line are exactly those two,
    not the recipe's entries under new names (jsonargparse merges lists of the same length element by element)."""
    out = tmp_path / "run"
    rewards = '[{"function": "format"}, {"function": "math_answer", "weight": 2.0}]'
    code = cli.main(["run", str(REPO / "recipes" / "tiny" / "grpo.yaml"), f"--output_dir={out}", "--trainer.max_steps=1", "--model.num_generations=2",
                     "--data.batch_size=1", "--trainer.enable_progress_bar=false", "--checkpoint_every_n_steps=1", f"--model.rewards={rewards}"])  # fmt: skip
    assert code == 0, capsys.readouterr().err[-3000:]
    expected = [{"function": "format", "weight": 1.0, "kwargs": {}, "name": None}, {"function": "math_answer", "weight": 2.0, "kwargs": {}, "name": None}]
    assert yaml.safe_load((out / "recipe.yaml").read_text())["model"]["rewards"] == expected
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["hyper_parameters"]["rewards"] == expected  # what the run scored with
    assert not_known_as_the_runs(out) == []  # a GRPO run's files are all known to --overwrite too
    # Appending (`+=`) still keeps the recipe's entries, and a list of plain values is replaced as before.
    config = parse(str(REPO / "recipes" / "tiny" / "grpo.yaml"), ['--model.rewards+={"function": "format", "name": "format_again"}', "--model.tools=[lightning_rl.tools.builtin:calculator]"])
    assert [r.get("weight") for r in config["model"]["rewards"]] == [1.0, 0.5, 1.0] and config["model"]["tools"] == ["lightning_rl.tools.builtin:calculator"]


def test_subcommands_dispatch_lazily(capsys, monkeypatch):
    assert cli.main(["env"]) == 0
    assert "torch" in capsys.readouterr().out
    monkeypatch.setitem(cli.SUBCOMMANDS, "plan", "lightning_rl.not_written_yet")
    assert "`lightning-rl plan` is not available in this install" in error_line(capsys, ["plan"])
    assert "unknown command 'fit'" in error_line(capsys, ["fit"])


def test_run_takes_its_recipe_and_keys_as_users_write_them(capsys, tmp_path):
    """The usage line's `-c CONFIG`, a recipe after the overrides and `--task sft` (space-separated, as every other
    key) were each refused as 'run needs a recipe file'."""
    recipe = str(REPO / "recipes" / "tiny" / "sft.yaml")
    expected = (recipe, ["--trainer.max_steps=3", "--overwrite"])
    for args in (["-c", recipe, "--trainer.max_steps", "3", "--overwrite"], ["--config", recipe, "--trainer.max_steps=3", "--overwrite"],
                 [f"--config={recipe}", "--trainer.max_steps=3", "--overwrite"], ["--trainer.max_steps=3", recipe, "--overwrite"],
                 ["--trainer.max_steps", "3", "--overwrite", recipe]):  # fmt: skip
        assert cli.run_arguments(args) == expected, args
    assert cli.run_arguments(["--task", "sft", "--model.lora", "null", "--help"]) == (None, ["--task=sft", "--model.lora=null", "--help"])
    assert cli.run_arguments(["--overwrite", "true", recipe]) == (recipe, ["--overwrite=true"])  # a yes/no flag's optional value
    assert cli.run_arguments(["--print_config", recipe]) == (recipe, ["--print_config"])
    assert cli.run_arguments(["--overwrite", "--trainer.max_steps=3"]) == (None, ["--overwrite", "--trainer.max_steps=3"])
    # A later config file is laid over the recipe, as LightningCLI's -c files are.
    assert cli.run_arguments([recipe, "--config", "over.yaml"]) == cli.run_arguments(["-c", recipe, "-c", "over.yaml"]) == (recipe, ["--config=over.yaml"])
    assert "two.yaml (a key's value is written --key=value)" in error_line(capsys, ["run", recipe, "two.yaml"])
    with pytest.raises(SystemExit) as done:
        cli.main(["run", "--trainer.max_steps", "3", "-c", recipe, "--print_config"])
    assert done.value.code == 0 and "max_steps: 3" in capsys.readouterr().out
    over = tmp_path / "over.yaml"
    over.write_text("trainer:\n  max_steps: 7\n")
    with pytest.raises(SystemExit) as done:
        cli.main(["run", recipe, "--config", str(over), "--print_config"])
    assert done.value.code == 0 and "max_steps: 7" in capsys.readouterr().out


@pytest.mark.parametrize("recipe", sorted((REPO / "recipes").glob("*/*.yaml")), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_bundled_recipe_parses(recipe, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["run", str(recipe), "--print_config"])
    assert done.value.code == 0
    assert "task:" in capsys.readouterr().out


def test_tiny_recipe_end_to_end_learns(tmp_path):
    out = tmp_path / "run"
    # A shortened run (100 steps of 512-token rows); the full recipe learns further (see README).
    overrides = [f"--output_dir={out}", "--trainer.max_steps=100", "--data.max_tokens=512", "--trainer.val_check_interval=50", "--model.eval_generations=100"]
    done = subprocess.run(
        [sys.executable, "-m", "lightning_rl.cli", "run", str(TINY_RECIPE), *overrides],
        cwd=REPO, env=os.environ, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "sft" and summary["steps"] == 100 and summary["packing"] == "tree"
    assert summary["loss_last_window_mean"] < 0.4 * summary["loss_first_window_mean"], summary
    # Held-out answers decoded greedily from scratch; chance is about 1 in 10 for `max`, 1 in 100 for `add`, so
    # about 0.05 in all. (SFT sees only 40 `max` demonstrations: recipes/tiny/grpo_from_sft.yaml teaches the rest.)
    assert summary["heldout_exact_match"] >= 0.15, summary
    for key in ("tokens_per_s", "peak_memory_mb", "wall_seconds", "first_loss", "last_loss"):
        assert summary[key] > 0
    assert (out / "hf" / "model.safetensors").exists() and (out / "checkpoints" / "last.ckpt").exists()
    assert yaml.safe_load((out / "recipe.yaml").read_text())["trainer"]["max_steps"] == 100


def test_wandb_without_credentials_logs_offline_and_says_how_to_sync(tmp_path):
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "WANDB_MODE")}
    env["HOME"] = str(tmp_path)  # no stored `wandb login` either
    overrides = [f"--output_dir={out}", "--logger.kind=wandb", "--trainer.max_steps=2", "--trainer.log_every_n_steps=1",
                 "--data.val_data=null", "--trainer.limit_val_batches=0", "--trainer.val_check_interval=null", "--model.eval_generations=0"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "lightning_rl.cli", "run", str(TINY_RECIPE), *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"upload later with `wandb sync {out}/wandb/offline-run-*`" in done.stderr
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert not_known_as_the_runs(out) == []  # --overwrite would take every file the run and W&B wrote


def test_wandb_online_without_credentials_is_one_line_before_anything_is_written(tmp_path, capsys, monkeypatch):
    """logger.offline: false with no credentials was wandb's 21-frame traceback after the model loaded, and left
    recipe.yaml behind, so the corrected rerun was refused as a run already there."""
    from lightning_rl.recipe import LoggerSettings, build_logger

    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    out = tmp_path / "run"
    line = error_line(capsys, ["run", str(TINY_RECIPE), f"--output_dir={out}", "--logger.kind=wandb", "--logger.offline=false"])
    assert line.startswith("error: logger.offline: false logs to W&B online, but no credentials are set"), line
    assert not (out / "recipe.yaml").exists()
    # A self-hosted server's login (netrc under WANDB_BASE_URL's host), or a mode that sends nothing, passes.
    from lightning_rl.recipe import check_logger

    (tmp_path / "netrc").write_text("machine wandb.example.org login user password k\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    check_logger(LoggerSettings(kind="wandb", offline=False))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    check_logger(LoggerSettings(kind="wandb", offline=False))
    monkeypatch.delenv("WANDB_MODE")
    # Offline, a WANDB_RUN_ID set to resume an earlier run cannot: said, and the run logs under an id of its own (a
    # second offline folder under the same id lost one history on sync); the user's environment stays as it was.
    monkeypatch.setenv("WANDB_RUN_ID", "abc123")
    logger = build_logger(LoggerSettings(kind="wandb", offline=True), out)
    assert "WANDB_RUN_ID=abc123 cannot resume an offline run" in capsys.readouterr().err
    assert logger._wandb_init["id"] not in (None, "abc123") and os.environ["WANDB_RUN_ID"] == "abc123"
    monkeypatch.delenv("WANDB_RUN_ID")
    # WANDB_PROJECT and WANDB_NAME are read where the recipe leaves logger.project and logger.name unset, as wandb does.
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    monkeypatch.setenv("WANDB_NAME", "env-run")
    logger = build_logger(LoggerSettings(kind="wandb", offline=True), out)
    assert (logger._wandb_init["project"], logger._wandb_init["name"]) == ("from-env", "env-run")
    logger = build_logger(LoggerSettings(kind="wandb", project="mine", name="this-run", offline=True), out)
    assert (logger._wandb_init["project"], logger._wandb_init["name"]) == ("mine", "this-run")
    # WANDB_MODE=disabled logs nothing, said in one line (an offline run wrote its folder all the same).
    monkeypatch.setenv("WANDB_MODE", "disabled")
    capsys.readouterr()
    assert build_logger(LoggerSettings(kind="wandb", offline=True), out) is False
    assert capsys.readouterr().err.count("WANDB_MODE=disabled") == 1


def test_wandb_that_cannot_start_is_one_line_and_leaves_no_run(tmp_path, capsys, monkeypatch):
    """A W&B server out of reach (credentials set) was wandb's 60-line traceback at train start, and left recipe.yaml
    and wandb/ behind, so the same command run again was refused as a run already there. A W&B folder it cannot
    write is one line too, naming the folder."""
    import wandb

    from lightning_rl.recipe import LoggerSettings, build_logger

    def unreachable(**kwargs):
        raise wandb.errors.CommError('Post "http://127.0.0.1:9/graphql": connect: connection refused')

    monkeypatch.setattr(wandb, "init", unreachable)
    monkeypatch.setenv("WANDB_API_KEY", "local-" + "0" * 40)
    for name in ("WANDB_MODE", "WANDB_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "run"
    argv = ["run", str(TINY_RECIPE), f"--output_dir={out}", "--logger.kind=wandb", "--trainer.max_steps=1", "--data.val_data=null",
            "--trainer.limit_val_batches=0", "--trainer.val_check_interval=null", "--model.eval_generations=0"]  # fmt: skip
    line = error_line(capsys, argv)
    assert line.startswith("error: logger.offline: W&B could not start the run online (Post "), line
    assert line.endswith("log offline with logger.offline: true (or WANDB_MODE=offline) and `wandb sync` later"), line
    assert not out.exists()  # the rerun is not refused

    def unwritable(**kwargs):
        raise PermissionError(f"{out}/wandb/offline-run-x/logs is not writable")

    monkeypatch.setattr(wandb, "init", unwritable)
    with pytest.raises(RecipeError) as refused:
        build_logger(LoggerSettings(kind="wandb", offline=True), out).experiment
    assert str(refused.value) == f"output_dir: W&B cannot write its run folder in {out}/wandb ({out}/wandb/offline-run-x/logs is not writable)"


def test_resume_last_takes_the_highest_complete_step_of_last_and_the_requeue_checkpoint(tmp_path):
    assert cli.resume_path(tmp_path, "last") is None  # nothing saved yet: it starts fresh and says so
    assert cli.resume_path(tmp_path, None) is None
    last = tmp_path / "checkpoints" / "last.ckpt"
    StagedCheckpointIO().save_checkpoint({**dict.fromkeys(RESUME_KEYS, {}), "global_step": 4}, last)
    assert cli.resume_path(tmp_path, "last") == str(last)
    hpc = tmp_path / "hpc_ckpt_5.ckpt"  # written by RequeueOnSignal on SIGTERM or SIGUSR1, after last.ckpt
    StagedCheckpointIO().save_checkpoint({**dict.fromkeys(RESUME_KEYS, {}), "global_step": 5}, hpc)
    assert cli.resume_path(tmp_path, "last") == str(hpc)
    os.utime(hpc, ns=(1, 1))  # the higher step wins, not the newer file
    assert cli.resume_path(tmp_path, "last") == str(hpc)
    with pytest.raises(ForeignCheckpointError, match=r"last.ckpt is at step 4, but output_dir .* holds checkpoints up to step 5 \(hpc_ckpt_5.ckpt\)"):
        cli.resume_path(tmp_path, str(last))  # named, an older one: its run would sit beside the newer one's checkpoints
    hpc.unlink()
    assert cli.resume_path(tmp_path, str(last)) == str(last)


def test_periodic_checkpoints_turned_off_keep_the_last_steps_and_resume(tmp_path, capsys):
    out, recipe = tmp_path / "run", str(REPO / "recipes" / "tiny" / "sft.yaml")
    common = [f"--output_dir={out}", "--checkpoint_every_n_steps=null", "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=0"]
    assert cli.main(["run", recipe, "--trainer.max_steps=2", *common]) == 0, capsys.readouterr().err[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["last.ckpt"]
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2
    assert cli.main(["run", recipe, "--trainer.max_steps=3", "--ckpt_path=last", *common]) == 0, capsys.readouterr().err[-3000:]
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 3


def test_a_built_run_is_freed_once_its_caller_lets_it_go(tmp_path):
    """Parsing a recipe left its parser, and through it the run (model, trainer, process groups), in a context
    variable until the interpreter's exit, where gloo's threads freeing them aborted a two-rank run after its error."""
    import gc
    import weakref

    from lightning_rl.recipe import build

    run = build(str(TINY_RECIPE), [f"--output_dir={tmp_path / 'out'}"])
    trainer, model = weakref.ref(run.trainer), weakref.ref(run.model)
    del run
    gc.collect()
    assert trainer() is None and model() is None


def test_a_home_relative_output_dir_and_model_are_one_folder_each_and_a_run_resumes_there(tmp_path, monkeypatch, capsys, tiny_path):
    """``output_dir: ~/run`` put the run's own files in a folder named ~ under the working directory and Lightning's
    checkpoints in the home one, so ``--ckpt_path=last`` started over; ``~/model`` failed as a hub id. One callback
    given alone (not in a list) was a TypeError."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "model").symlink_to(tiny_path)
    recipe = recipe_with(tmp_path, set_key("output_dir", "~/run"))
    short = ["--model.model_name_or_path=~/model", "--data.val_data=null", "--model.eval_generations=0",
             "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
             "--trainer.callbacks=lightning.pytorch.callbacks.LearningRateMonitor"]
    assert cli.main(["run", str(recipe), "--trainer.max_steps=1", *short]) == 0, capsys.readouterr().err[-2000:]
    run = tmp_path / "home" / "run"
    assert (run / "summary.json").is_file() and (run / "checkpoints" / "last.ckpt").is_file() and not (tmp_path / "~").exists()
    assert cli.main(["run", str(recipe), "--trainer.max_steps=2", "--ckpt_path=last", *short]) == 0, capsys.readouterr().err[-2000:]
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    assert "resume: no complete checkpoint" not in capsys.readouterr().err


def test_a_strategy_named_by_its_class_is_built_and_an_unknown_one_blamed_on_its_key(tmp_path, capsys):
    """``--trainer.strategy=DDPStrategy`` (the form our own hint gives) was refused as an invalid name, and a dotted class
    path in a recipe was blamed on trainer.devices=auto, a word of Lightning's list of choices."""
    recipe = recipe_with(tmp_path, set_key("trainer.strategy", "lightning.pytorch.strategies.DDPStrategy"))
    short = ["--trainer.max_steps=1", "--data.val_data=null", "--model.eval_generations=0", "--trainer.val_check_interval=null",
             "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false"]
    assert cli.main(["run", str(recipe), *short]) == 0, capsys.readouterr().err[-2000:]
    line = error_line(capsys, ["run", str(recipe), *short, "--trainer.strategy=NoSuchStrategy", "--overwrite"])
    assert line == "error: trainer.strategy=NoSuchStrategy is neither a registered strategy name nor a Strategy class: give a " \
                   "registered name (ddp, fsdp2, cpu_static, ...; `lightning-rl env` lists ours)"
    line = error_line(capsys, ["run", str(recipe), *short, "--trainer.strategy=Strategy", "--overwrite"])
    assert line.startswith("error: trainer.strategy=Strategy is an abstract class: name a strategy that runs")
