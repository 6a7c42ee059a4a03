"""The command line explains itself: `--help` lists the keys with types, defaults and docs; a run needs no recipe file;
every unknown key is named in one line, where it was written, with the key meant; Trainer arguments a task cannot take
are one line naming what it takes instead (every Trainer argument is tried under both tasks); the recipe's own
modules are found beside it; data keys, columns and relative paths say what they are."""

from __future__ import annotations

import inspect
import json
import re
import sys
from pathlib import Path

import pytest
import yaml
from lightning.pytorch import Trainer
from lightning.pytorch.trainer.configuration_validator import _verify_loop_configurations
from lightning.pytorch.trainer.states import TrainerFn

from lightning_rl import cli
from lightning_rl.errors import UserError
from lightning_rl.recipe import build
from support.paths import REPO, TOY_TRAIN

SFT, GRPO = (str(REPO / "recipes" / "tiny" / name) for name in ("sft.yaml", "grpo.yaml"))
SHORT = ["--trainer.max_steps=1", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
SHORT_SFT = [*SHORT, "--data.val_data=null", "--data.max_tokens=256", "--model.eval_generations=0",
             "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0"]  # fmt: skip


def error_lines(capsys, argv: list[str]) -> list[str]:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("error:")]


def test_help_lists_each_tasks_keys_with_type_default_and_doc(capsys):
    for argv, keys in ((["run", "--task=sft", "--help"], ["--data.max_tokens", "--model.lora.help"]),
                       (["run", GRPO, "--help"], ["--model.loss.beta", "--data.train_data", "--model.max_grad_norm"])):  # fmt: skip
        with pytest.raises(SystemExit) as done:
            cli.main(argv)
        assert done.value.code == 0
        out = " ".join(capsys.readouterr().out.split())
        for key in keys:
            assert key in out
        # A docstring entry naming several keys ("learning_rate, weight_decay: AdamW ...") documents each of them.
        assert "--model.learning_rate LEARNING_RATE AdamW" in out and "(type: float, default:" in out
    assert cli.main(["run", "--help"]) == 0  # no task yet: how to ask for each task's keys
    assert "lightning-rl run --task=grpo --help" in capsys.readouterr().out
    assert cli.main(["--help"]) == 0  # each command, and where its own help is
    out = capsys.readouterr().out
    assert all(f"\n  {command} " in out for command in cli.SUBCOMMANDS) and "lightning-rl run --help" in out


def test_a_run_needs_no_recipe_file(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["run", "--task=sft", "--model.model_name_or_path=tiny", f"--data.train_data={TOY_TRAIN}", f"--output_dir={out}", *SHORT_SFT]
    assert cli.main(argv) == 0, capsys.readouterr().err[-2000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == 1
    assert yaml.safe_load((out / "recipe.yaml").read_text())["data"]["train_data"] == str(TOY_TRAIN)
    assert error_lines(capsys, ["run", "--model.learning_rate=1e-3"]) == ["error: `run` needs a recipe file or --task=sft|grpo"]


def test_every_unknown_key_is_named_at_once_where_it_was_written_with_the_key_meant(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(Path(SFT).read_text().replace("model:\n", "model:\n  learnin_rate: 0.1\n  beta: 0.1\n", 1))
    line = next(n for n, text in enumerate(recipe.read_text().splitlines(), 1) if "learnin_rate" in text)
    [error] = error_lines(capsys, ["run", str(recipe), "--trainer.max_stpes=2", "--data.batch_size=4", "--lora.r=8"])
    assert error == (
        f"error: {recipe}: line {line}: unknown key 'model.learnin_rate' (did you mean 'model.learning_rate'?); "
        f"{recipe}: line {line + 1}: unknown key 'model.beta' (did you mean 'model.betas'?); "
        "command line: unknown key 'trainer.max_stpes' (did you mean 'trainer.max_steps'?); "
        "command line: unknown key 'data.batch_size' (a GRPO key; SFT batches by tokens: data.max_tokens); "
        "command line: unknown key 'lora.r' (did you mean 'model.lora.r'?)"
    )
    [error] = error_lines(capsys, ["run", GRPO, "--data.max_tokens=512", "--model.beta=0.1"])
    assert error.startswith("error: command line: unknown key 'data.max_tokens' (an SFT key; a GRPO step is data.batch_size prompts")
    assert error.endswith("command line: unknown key 'model.beta' (did you mean 'model.loss.beta'?)")
    # A wrong value typed on the command line is blamed on it; a key set from another one names that one.
    assert error_lines(capsys, ["run", SFT, "--model.learning_rate=fast"]) == ["error: command line: model.learning_rate must be a number, got fast"]
    assert error_lines(capsys, ["run", SFT, "--trainer.default_root_dir=x"]) == ["error: command line: trainer.default_root_dir is set from output_dir: give output_dir"]


def test_an_engines_unknown_options_are_named_at_once_where_they_were_written(tmp_path, capsys):
    """The options under model.engine.init_args are checked against the engine class's own, as every other key is."""
    recipe = tmp_path / "recipe.yaml"
    engine = "  engine:\n    class_path: HFRolloutEngine\n    init_args:\n      verify_weight: false\n      dtype: float32\n      zzz: 1\n"
    recipe.write_text(Path(GRPO).read_text().replace("model:\n", "model:\n" + engine + "  learnin_rate: 0.1\n", 1))
    line = next(n for n, text in enumerate(recipe.read_text().splitlines(), 1) if "verify_weight" in text)
    [error] = error_lines(capsys, ["run", str(recipe), "--model.engine.init_args.devce=cpu"])
    assert error == (
        f"error: {recipe}: line {line}: unknown key 'model.engine.init_args.verify_weight' (did you mean 'model.engine.init_args.verify_weights'?); "
        f"{recipe}: line {line + 2}: unknown key 'model.engine.init_args.zzz' (HFRolloutEngine takes device, dtype, pad_token_id, eos_token_id, verify_weights); "
        f"{recipe}: line {line + 3}: unknown key 'model.learnin_rate' (did you mean 'model.learning_rate'?); "
        "command line: unknown key 'model.engine.init_args.devce' (did you mean 'model.engine.init_args.device'?)"
    )


def test_a_trl_field_given_as_a_key_names_the_key_doing_its_work(capsys):
    """From the same table as docs/migrating_from_trl.md; a key of ours with that very name still comes first."""
    [error] = error_lines(capsys, ["run", GRPO, "--max_completion_length=8", "--model.epsilon=0.3", "--use_vllm=true", "--model.temperature=0.5"])
    assert error == (
        "error: command line: unknown key 'max_completion_length' (for TRL's max_completion_length, set model.sampling.max_new_tokens); "
        "command line: unknown key 'model.epsilon' (for TRL's epsilon, set model.loss.epsilon_low); "
        "command line: unknown key 'use_vllm' (TRL's use_vllm has no key here: give model.engine: vllm (in this process) or "
        "vllm_server (a server of its own)); "
        "command line: unknown key 'model.temperature' (did you mean 'model.sampling.temperature'?)"
    )
    [error] = error_lines(capsys, ["run", SFT, "--gradient_accumulation_steps=2"])
    assert error == "error: command line: unknown key 'gradient_accumulation_steps' (for TRL's gradient_accumulation_steps, set trainer.accumulate_grad_batches)"
    # A field the table explains by a pattern (vllm_*) is explained too; a name no TRL field has is not.
    [error] = error_lines(capsys, ["run", GRPO, "--vllm_gpu_memory_utilization=0.5", "--vllm_speed=2"])
    assert error.startswith("error: command line: unknown key 'vllm_gpu_memory_utilization' (TRL's vllm_gpu_memory_utilization has no key here: ")
    assert error.endswith("command line: unknown key 'vllm_speed'"), error


@pytest.mark.parametrize("key, names", [("accumulate_grad_batches=4", "model.max_tokens_per_row"), ("gradient_clip_val=1.0", "model.max_grad_norm"),
                                        ("gradient_clip_algorithm=norm", "model.max_grad_norm"), ("limit_val_batches=5", "model.eval_generations"),
                                        ("check_val_every_n_epoch=2", "trainer.val_check_interval")])  # fmt: skip
def test_trainer_arguments_grpo_cannot_take_name_its_own_key(key, names, capsys):
    [error] = error_lines(capsys, ["run", GRPO, f"--trainer.{key}"])
    assert error.startswith(f"error: trainer.{key.split('=')[0]}=") and "is not taken by GRPO" in error and names in error


# A plausible value other than the default for every argument of Trainer.__init__.
TRAINER_VALUES = {
    "accelerator": "cpu", "strategy": "ddp", "devices": "1", "num_nodes": "2", "precision": "bf16-mixed", "logger": "true",
    "callbacks": '[{"class_path": "lightning.pytorch.callbacks.LearningRateMonitor"}]', "fast_dev_run": "1",
    "max_epochs": "2", "min_epochs": "1", "max_steps": "5", "min_steps": "2", "max_time": "00:00:10:00",
    "limit_train_batches": "5", "limit_val_batches": "0", "limit_test_batches": "2", "limit_predict_batches": "2",
    "overfit_batches": "2", "val_check_interval": "10", "check_val_every_n_epoch": "2", "num_sanity_val_steps": "0",
    "log_every_n_steps": "5", "enable_checkpointing": "false", "enable_progress_bar": "false", "enable_model_summary": "false",
    "accumulate_grad_batches": "2", "gradient_clip_val": "1.0", "gradient_clip_algorithm": "value", "deterministic": "true",
    "benchmark": "true", "inference_mode": "false", "use_distributed_sampler": "true", "profiler": "simple",
    "detect_anomaly": "true", "barebones": "true", "sync_batchnorm": "true", "reload_dataloaders_every_n_epochs": "1",
    "plugins": '{"class_path": "lightning.pytorch.plugins.environments.LightningEnvironment"}',
    "default_root_dir": "elsewhere", "enable_autolog_hparams": "false", "model_registry": "my-model",
}  # fmt: skip


@pytest.mark.parametrize("recipe", [SFT, GRPO], ids=["sft", "grpo"])
def test_every_trainer_argument_is_taken_or_one_line(recipe, tmp_path, capsys):
    """Each Trainer argument, through the parser, the build and Lightning's own checks of a fit's configuration (what
    it refuses only once `fit` starts): it is taken, or refused as a UserError (one `error:` line), never a crash."""
    assert set(TRAINER_VALUES) == set(inspect.signature(Trainer.__init__).parameters) - {"self"}, "a new Trainer argument"
    outcomes = {}
    for name, value in TRAINER_VALUES.items():
        try:
            run = build(recipe, [f"--output_dir={tmp_path / 'out'}", f"--trainer.{name}={value}"])
            run.trainer.strategy.connect(run.model)
            run.trainer.state.fn = TrainerFn.FITTING
            _verify_loop_configurations(run.trainer)
            outcomes[name] = "taken"
        except UserError as error:
            assert f"trainer.{name}" in error.line(), error.line()
            outcomes[name] = "refused"
    capsys.readouterr()
    refused = {name for name, outcome in outcomes.items() if outcome == "refused"}
    grpo_only = {"accumulate_grad_batches", "gradient_clip_val", "gradient_clip_algorithm", "check_val_every_n_epoch"}  # limit_val_batches=0 is taken
    always = {"logger", "fast_dev_run", "enable_checkpointing", "use_distributed_sampler", "barebones", "default_root_dir"}
    assert refused == always | (grpo_only if recipe == GRPO else set())


def test_reward_modules_beside_the_recipe_are_found_and_a_missing_one_names_the_folders(tmp_path, monkeypatch, capsys):
    folder, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    folder.mkdir(), elsewhere.mkdir()
    (folder / "beside_recipe_rewards.py").write_text("def short(completions, **kwargs):\n    return [-len(c) / 10 for c in completions]\n")
    config = yaml.safe_load(Path(GRPO).read_text())
    config["model"]["rewards"] = [{"function": "beside_recipe_rewards:short"}]
    recipe = folder / "grpo.yaml"
    recipe.write_text(yaml.safe_dump(config))
    monkeypatch.chdir(elsewhere)  # neither the working directory nor the installed packages hold it
    monkeypatch.setattr(sys, "path", list(sys.path))  # the folders a run adds go with the test
    run = build(str(recipe), [f"--output_dir={tmp_path / 'out'}"])
    assert run.model.hparams.rewards[0]["function"] == "beside_recipe_rewards:short"
    config["model"]["rewards"] = [{"function": "nowhere_rewards:short"}]
    recipe.write_text(yaml.safe_dump(config))
    [error] = error_lines(capsys, ["run", str(recipe), f"--output_dir={tmp_path / 'out'}"])
    assert "no module 'nowhere_rewards' in the recipe's folder " + str(folder) in error
    assert "the working directory " + str(elsewhere) in error and "the installed packages" in error


def test_grpo_reads_its_data_file_as_train_data_and_path_as_its_earlier_name(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    assert build(GRPO, [f"--data.train_data={prompts}"]).datamodule.path == str(prompts)
    assert build(GRPO, [f"--data.path={prompts}"]).datamodule.path == str(prompts)  # over the recipe's train_data
    assert "note: data.path is the earlier name of data.train_data" in capsys.readouterr().err
    recipe = tmp_path / "old.yaml"
    recipe.write_text(Path(GRPO).read_text().replace("  train_data: toy", f"  path: {prompts}"))
    assert build(str(recipe), []).datamodule.path == str(prompts)
    assert "note: data.path is the earlier name of data.train_data" in capsys.readouterr().err
    recipe.write_text(Path(GRPO).read_text().replace("  train_data: toy", f"  path: {prompts}\n  train_data: {prompts}"))
    [error] = error_lines(capsys, ["run", str(recipe)])
    assert error.startswith("error: data.path is the earlier name of train_data: give only train_data")


def test_a_row_with_the_wrong_columns_lists_the_columns_it_has(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    [error] = error_lines(capsys, ["run", SFT, f"--data.train_data={rows}", f"--output_dir={tmp_path / 'out'}", *SHORT_SFT])
    assert error == f"error: {rows}: line 1: missing `messages` (or both `prompt` and `completion`, or `text`); the row has 'answer', 'question'"
    [error] = error_lines(capsys, ["run", GRPO, f"--data.train_data={rows}", f"--output_dir={tmp_path / 'out'}", *SHORT])
    assert error == f"error: {rows}: line 1: no field 'prompt' (row has ['answer', 'question'])"


def test_a_relative_path_not_found_says_what_it_was_read_from(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    [error] = error_lines(capsys, ["run", SFT, "--data.train_data=data/train.jsonl"])
    assert error == f"error: data.train_data: no such file or folder: data/train.jsonl (a relative path, read from the working directory {tmp_path})"
    [error] = error_lines(capsys, ["run", SFT, "--model.model_name_or_path=./outputs/sft/hf"])
    assert error.endswith(f"(a relative path, read from the working directory {tmp_path})")


def test_the_runs_seed_is_grpos_sampling_seed(capsys):
    """The top-level seed reached the weights and the data order, but GRPO sampled with model.seed (0) whatever it was:
    runs meant to differ drew the same completions."""
    assert build(GRPO, ["--seed=5"]).model.hparams.seed == 5
    [error] = error_lines(capsys, ["run", GRPO, "--model.seed=5"])
    assert "model.seed is set from seed: give seed" in error


def test_overwrite_takes_a_value_as_every_flag_does():
    """`--overwrite=true` was refused (every other boolean key takes one); `--overwrite` alone still says yes."""
    for args, expected in ((["--overwrite"], True), (["--overwrite=true"], True), (["--overwrite=false"], False), ([], False)):
        assert build(SFT, args).config["overwrite"] is expected


def test_a_trainer_argument_lightning_refuses_is_named_with_its_value(capsys):
    """Lightning's own words came alone (`Timer(duration='abc')` is not a valid duration), naming no key."""
    [error] = error_lines(capsys, ["run", SFT, "--trainer.max_time=abc"])
    assert error.startswith("error: trainer.max_time=abc: `Timer(duration='abc')` is not a valid duration"), error


def test_a_mapping_written_without_spaces_after_its_colons_says_how_yaml_reads_it(capsys):
    """`{dtype:float32}` is one YAML key, 'dtype:float32': the line said only that the key "must be null"."""
    [error] = error_lines(capsys, ["run", GRPO, "--model.engine.class_path=VLLMServerEngine", "--model.engine.init_args.server_options={dtype:float32}"])
    assert error.endswith("got {dtype:float32} (YAML reads {key:value} as one key, 'key:value': write {key: value}, a space after each colon)"), error


def test_an_option_of_a_strategy_given_by_name_says_to_name_its_class(tmp_path, capsys):
    """jsonargparse's words were 'must be a string or a Strategy, got NestedArg(...)'; the class takes the option."""
    [error] = error_lines(capsys, ["run", SFT, f"--output_dir={tmp_path}", "--trainer.strategy=cpu_static",
                                   "--trainer.strategy.init_args.compile_backend=eager"])  # fmt: skip
    assert error == ("error: command line: trainer.strategy: a strategy given by its registered name takes no options "
                     "(compile_backend=eager): name its class (fsdp2: FSDP2Strategy, fsdp2_rocm: ROCmFSDP2Strategy, xla_static: "
                     "XLAStaticStrategy, neuron: NeuronStrategy, cpu_static: StaticShapeCPUStrategy; Lightning's, e.g. DDPStrategy), "
                     "then its options: --trainer.strategy=CLASS --trainer.strategy.compile_backend=eager")


def test_an_unknown_key_inside_a_list_item_is_named_with_its_item_line_and_the_key_meant(tmp_path, capsys):
    """``- functon: math_answer`` under model.rewards was named without its line, and the next item's typo not at all."""
    recipe = tmp_path / "recipe.yaml"
    text = Path(GRPO).read_text()
    recipe.write_text(text.replace("- function: math_answer", "- functon: math_answer").replace("weight: 0.5", "xyz: 0.5"))
    lines = {word: next(n for n, t in enumerate(recipe.read_text().splitlines(), 1) if word in t) for word in ("functon", "xyz")}
    [error] = error_lines(capsys, ["run", str(recipe)])
    assert error == (f"error: {recipe}: line {lines['functon']}: unknown key 'model.rewards[0].functon' (did you mean 'model.rewards[0].function'?); "
                     f"{recipe}: line {lines['xyz']}: unknown key 'model.rewards[1].xyz' (each item takes function, weight, kwargs, name)")
    # A field of a list's items on the command line set the last item's alone, silently; after += it is that item's.
    [error] = error_lines(capsys, ["run", GRPO, "--model.rewards.weight=3"])
    assert error.startswith("error: command line: --model.rewards.weight would set the field of the last item of model.rewards alone")


def test_a_file_laid_over_the_recipe_is_read_and_checked_as_the_recipe_is(tmp_path, capsys):
    """``run base.yaml --config over.yaml``: the overlay's task was ignored (an SFT run recorded as GRPO), its reward
    list merged item by item into the base's (a new reward inherited the old one's weight and kwargs), its typo blamed
    on the base file, and its shell variables and keys let through unchecked."""
    from lightning_rl.recipe import parse

    over = tmp_path / "over.yaml"
    over.write_text("model:\n  rewards:\n    - function: math_answer\n    - function: support.grpo:text_length\n")
    config = parse(GRPO, [f"--config={over}"])
    assert config["model"]["rewards"][1] == {"function": "support.grpo:text_length", "weight": 1.0, "kwargs": {}, "name": None}
    assert "config" not in config
    over.write_text("task: grpo\n")  # the run is a GRPO run: the SFT recipe's own keys are not GRPO's
    [error] = error_lines(capsys, ["run", SFT, "--config", str(over)])
    assert error.startswith(f"error: {SFT}: line ") and "unknown key 'data.max_tokens' (an SFT key" in error
    over.write_text("model:\n  learnin_rate: 0.1\n")
    [error] = error_lines(capsys, ["run", SFT, "--config", str(over)])
    assert error == f"error: {over}: line 2: unknown key 'model.learnin_rate' (did you mean 'model.learning_rate'?)"
    over.write_text("output_dir: $HOME/x\n")
    [error] = error_lines(capsys, ["run", SFT, "--config", str(over)])
    assert error.startswith(f"error: {over}: output_dir: '$HOME/x' names the variable HOME")
    # As launch and plan pass them on (-c FILE), an overlay of comments alone, a block cleared by null, and an error in
    # the recipe not blamed on an overlay that writes another key of its block.
    over.write_text("model:\n  learnin_rate: 0.1\n")
    with pytest.raises(UserError, match=re.escape(f"{over}: line 2: unknown key 'model.learnin_rate'")):
        parse(GRPO, ["-c", str(over)])
    over.write_text("# nothing yet\n")
    assert parse(GRPO, [f"--config={over}"])["model"]["num_generations"] == 8
    over.write_text("model: null\n")
    with pytest.raises(UserError, match=re.escape(f"{over}: model: null would clear the recipe's whole model block")):
        parse(GRPO, [f"--config={over}"])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(Path(GRPO).read_text().replace("num_generations: 8", "num_generations: abc"))
    over.write_text("model:\n  learning_rate: 0.001\n")
    with pytest.raises(UserError, match=re.escape(f"{recipe}: model.num_generations must be an integer, got abc")):
        parse(str(recipe), [f"--config={over}"])


@pytest.mark.parametrize("recipe, override, said", [
    (SFT, "--data.max_tokens=0", "data.max_tokens must be >= 1, got 0"),
    (SFT, "--data.num_workers=-1", "data.num_workers must be >= 0, got -1"),
    (GRPO, "--data.batch_size=0", "data.batch_size must be >= 1, got 0"),
])
def test_launch_and_plan_check_the_datas_values_as_run_does(recipe, override, said):
    """A launch wrote the job's script for a data value `run` refuses at once (plan sized data.batch_size=0)."""
    from lightning_rl.recipe import parse

    with pytest.raises(UserError, match=re.escape(said)):
        parse(recipe, [override])


def test_launch_and_plan_read_a_grpo_recipe_that_still_names_its_data_path(tmp_path, capsys):
    from lightning_rl.recipe import parse

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(Path(GRPO).read_text().replace("  train_data: toy", "  path: toy"))
    assert parse(str(recipe), [])["data"]["path"] == "toy"
