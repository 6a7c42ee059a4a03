"""docs/migrating_from_trl.md is what the schema's TRL annotations say today, and every TRL name it uses is a field of
TRL 1.16's own classes (so a renamed or invented field fails here)."""

import dataclasses
import fnmatch

import pytest
import trl

from lightning_rl import recipe, recipe_reference, trl_migration, trl_names
from lightning_rl.errors import RecipeError

TRL_CLASSES = (trl.SFTConfig, trl.GRPOConfig, trl.ModelConfig, trl.ScriptArguments)


def test_the_migration_guide_is_up_to_date(capsys):
    assert trl_migration.main(["--check"]) == 0, capsys.readouterr().err


def test_every_trl_name_is_a_field_of_trl_and_every_field_is_mapped_or_explained():
    fields = {field.name for cls in TRL_CLASSES for field in dataclasses.fields(cls)}
    named = {name for task in ("sft", "grpo") for name in trl_migration.annotations(task)}
    named |= {name for _, name in trl_names.TRAINER} | set(trl_names.COMMON)
    assert named - fields == set(), "annotations naming no TRL field"
    patterns = [pattern for pattern in trl_names.NO_EQUIVALENT if not any(c in pattern for c in "*?[")]
    assert set(patterns) - fields == set(), "reasons for fields TRL does not have"
    wild = [pattern for pattern in trl_names.NO_EQUIVALENT if any(c in pattern for c in "*?[")]
    listed = {name for names in trl_migration.trl_fields().values() for name in names}
    only_by_pattern = {name for name in listed if name not in trl_names.NO_EQUIVALENT and any(fnmatch.fnmatchcase(name, p) for p in wild)}
    assert trl_names.PATTERN_FIELDS == only_by_pattern  # the run's hint for them (`hint`) reads this list
    for title, names in trl_migration.trl_fields().items():
        task = "grpo" if title == "GRPOConfig" else "sft"
        found = trl_migration.annotations(task)
        unexplained = [name for name in names if trl_names.mapping(task, name, found) == ("", "")]
        assert unexplained == [], f"{title}: neither a key nor a reason"
    text = trl_migration.OUTPUT.read_text()
    for row in ("| `epsilon` | `model.loss.epsilon_low` |", "| `--lora_r` | `model.lora.r` |", "| `max_length` | `data.max_length` |",
                "| `gradient_accumulation_steps` | `trainer.accumulate_grad_batches` |", "| `trust_remote_code` | none | only model classes"):  # fmt: skip
        assert row in text


def test_an_unknown_key_is_hinted_from_the_same_table_the_guide_renders():
    """A run's unknown-key hint reads the TRL names from its own parser (`recipe._Schema.documented`), not from this
    module: both must find the same names for the same keys."""
    for task in ("sft", "grpo"):
        schema = recipe._Schema(recipe._cli(str(recipe_reference.REPO / recipe_reference.EXAMPLES[task]), [], build=False).parser)
        assert trl_names.annotations(schema.documented()) == trl_migration.annotations(task), task


def test_every_default_that_differs_from_trls_says_why_and_no_reason_is_stale():
    """Read from TRL's config classes and our schema: a default changed on either side needs its line in DEFAULTS."""
    from lightning_rl.trl_migration import default_differences
    from lightning_rl.trl_names import DEFAULTS

    found = {(task, name) for task, name, *_ in default_differences()}
    explained = {(task, name) for task, name in found if (task, name) in DEFAULTS or ("*", name) in DEFAULTS}
    assert found == explained, f"no reason for {sorted(found - explained)}"
    stale = {key for key in DEFAULTS if not any((task, name) in found for task in ("sft", "grpo") for name in [key[1]] if key[0] in (task, "*"))}
    assert not stale, f"no longer different: {sorted(stale)}"
    assert ("grpo", "lr_scheduler_type") in found and ("grpo", "vllm_importance_sampling_mode") not in found


def test_the_values_trl_sets_on_construction_are_trls(tmp_path, monkeypatch):
    """The guide's TRL defaults include what a config sets as it is built (bf16 on unless fp16 is), written down
    rather than built in the generator: held to TRL's own here."""
    import trl

    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):  # a config built under torchrun's variables waits for its peers
        monkeypatch.delenv(name, raising=False)
    for config in (trl.SFTConfig, trl.GRPOConfig):
        built = config(output_dir=str(tmp_path), use_cpu=True)
        for name, value in trl_migration.SET_ON_CONSTRUCTION.items():
            assert next(f.default for f in dataclasses.fields(config) if f.name == name) is None and getattr(built, name) == value


def test_trls_batch_size_is_converted_and_its_booleans_for_scale_rewards_are_named(capsys, tmp_path):
    """TRL's GRPO batch counts completions, ours prompts: the hint gives the conversion, not the bare key (a TRL user
    set 8x the batch). A deprecated TRL name maps to its key; TRL's ``scale_rewards: false`` is named in our words."""
    from lightning_rl import cli

    recipe_file = str(recipe_reference.REPO / recipe_reference.EXAMPLES["grpo"])
    documented = recipe._Schema(recipe._cli(recipe_file, [], build=False).parser).documented()
    said = trl_names.hint("grpo", "per_device_train_batch_size", documented)
    assert said.startswith("for TRL's per_device_train_batch_size, set data.batch_size (") and "gradient_accumulation_steps / num_generations" in said
    said = trl_names.hint("grpo", "vllm_importance_sampling_cap", documented)
    assert said.startswith("for TRL's vllm_importance_sampling_cap, set model.loss.importance_sampling_cap")
    assert cli.main(["run", recipe_file, f"--output_dir={tmp_path / 'run'}", "--model.scale_rewards=false"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("got false (TRL's True is group, its False none)")
    from lightning_rl.modules.grpo import GRPOModule

    with pytest.raises(RecipeError, match=r"^scale_rewards must be one of .*, got False \(TRL's True is group, its False none\)$"):
        GRPOModule(scale_rewards=False)  # from Python too



@pytest.mark.parametrize(("given", "said"), [("true", "TRL's packing: true, bfd, is flat"), ("bfd", "TRL's packing: true, bfd, is flat"),
                                             ("False", "TRL's packing: false is none"), ("wrapped", "TRL's wrapped cuts examples across rows")])
def test_trls_packing_values_are_named_in_our_layouts(capsys, tmp_path, given, said):
    from lightning_rl import cli

    recipe_file = str(recipe_reference.REPO / recipe_reference.EXAMPLES["sft"])
    assert cli.main(["run", recipe_file, f"--output_dir={tmp_path / 'run'}", f"--data.packing={given}"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"error: command line: data.packing must be one of auto, tree, flat, none, got {given} ({said}"), last
