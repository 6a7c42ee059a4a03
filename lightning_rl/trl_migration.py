"""docs/migrating_from_trl.md: each field of TRL's ``SFTConfig`` and ``GRPOConfig`` and each ``trl sft`` flag, with the
recipe key that does its work, generated from the schema's own docstrings so it cannot drift.

A key's docstring entry ends ``TRL: `name`, `other`.`` (or ``TRL: the same name(s).``) when it does the work of those
TRL fields; an entry documenting several keys gives each TRL name to the key of the same name, and the rest to the
keys left. Lightning's ``Trainer`` arguments, which have no docstrings of ours, and the fields we have no key for
(with why) are the two small tables below.
Run: ``python -m lightning_rl.trl_migration`` writes the file; ``--check`` says whether it is up to date (a test runs it).
"""

from __future__ import annotations

import fnmatch
import re
import sys
from collections import defaultdict

from lightning_rl.recipe_reference import REPO, rows, write_or_check

OUTPUT = REPO / "docs" / "migrating_from_trl.md"
# The TrainingArguments fields a TRL user sets, beside those the config classes define themselves (transformers 5 has
# no warmup_ratio: a warmup_steps below 1 is the ratio, and ours counts steps).
COMMON = ("learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size", "gradient_accumulation_steps",
          "max_grad_norm", "warmup_steps", "lr_scheduler_type", "weight_decay", "seed", "output_dir", "bf16",
          "gradient_checkpointing", "save_steps", "logging_steps", "report_to", "resume_from_checkpoint")  # fmt: skip
# Lightning's Trainer arguments doing a TRL field's work, per task ("*": both).
TRAINER = {
    ("*", "max_steps"): "trainer.max_steps",
    ("*", "num_train_epochs"): "trainer.max_epochs",
    ("*", "bf16"): "trainer.precision (`bf16-mixed`, or `bf16-true`)",
    ("*", "logging_steps"): "trainer.log_every_n_steps",
    ("sft", "gradient_accumulation_steps"): "trainer.accumulate_grad_batches",
    ("sft", "max_grad_norm"): "trainer.gradient_clip_val",
    ("grpo", "gradient_accumulation_steps"): "model.max_tokens_per_row (a step is data.batch_size prompts, forwarded in "
    "micro-batches of at most this many tokens whose gradients add up)",
}
# TRL fields with no key here, and why (fnmatch patterns: the first that matches).
NO_EQUIVALENT = {
    "model_init_kwargs": "models load from model.model_name_or_path in the precision of trainer.precision; a recipe "
    "holds typed keys, not a bag of keyword arguments",
    "trust_remote_code": "only model classes transformers ships are loaded: no code runs from a model folder",
    "router_aux_loss_coef": "the router's auxiliary loss is not added (MoE policies train with model.router_replay)",
    "chat_template_path": "the tokenizer's own chat template renders rows (data.tokenizer picks another tokenizer)",
    "dataset_text_field": "rows are `messages` or `prompt`/`completion`; plain text rows are not trained",
    "dataset_kwargs": "a recipe holds typed keys, not a bag of keyword arguments",
    "dataset_num_proc": "rows are tokenized once, in the main process",
    "eos_token": "the chat template ends each turn with the tokenizer's own tokens",
    "pad_token": "packed rows hold no padding to fill",
    "truncation_mode": "an example longer than data.max_length is an error, never cut",
    "eval_packing": "held-out rows are packed as the training ones are",
    "pad_to_multiple_of": "GRPO's packed rows take the step's shape (model.max_tokens_per_row bounds them)",
    "completion_only_loss": "always: the loss covers the completion (or the assistant turns) only",
    "assistant_only_loss": "always: the loss covers the assistant turns (or the completion) only",
    "loss_type": "SFT's loss is the negative log-likelihood only",
    "disable_dropout": "models are trained with the dropout their config sets",
    "cast_lm_head_to_fp32": "log-probs come from a chunked LM head computed in float32 (model.chunk_size)",
    "num_generations_eval": "held-out scoring decodes greedily, once per prompt (model.eval_generations)",
    "ds3_gather_for_generation": "DeepSpeed is not used: the engine gets whole weights from the trainer's sync",
    "shuffle_dataset": "prompts are shuffled every pass, seeded by seed",
    "generation_batch_size": "a step generates for data.batch_size prompts (times model.num_generations)",
    "steps_per_generation": "model.num_iterations optimizer steps are taken on each batch of rollouts",
    "generation_kwargs": "sampling takes the typed keys of model.sampling",
    "chat_template_kwargs": "prompts are rendered by the tokenizer's chat template as it is",
    "cache_implementation": "the hf engine uses transformers' default cache",
    "use_vllm": "give model.engine: vllm (in this process) or vllm_server (a server of its own)",
    "vllm_mode": "model.engine: vllm is TRL's colocate mode, vllm_server its server mode",
    "vllm_importance_sampling_correction": "on when model.loss.importance_sampling_cap or _floor is set",
    "vllm_importance_sampling_cap": "model.loss.importance_sampling_cap",
    "vllm_*": "vLLM's own options are the engine's init_args (model.engine.init_args; docs/recipe_reference.md)",
    "log_*": "rollouts are logged every model.log_rollouts_every_n_steps steps",
    "num_completions_to_print": "rollouts are logged every model.log_rollouts_every_n_steps steps",
    "use_transformers_*": "the hf engine generates with transformers' generate",
    "transformers_continuous_batching_config": "the hf engine generates with transformers' generate",
    # trl sft's model and script flags
    "model_revision": "name a local folder or a hub id: a revision is not chosen",
    "dtype": "weights load in the dtype trainer.precision implies",
    "attn_implementation": "packed rows need the tree attention: model.attention_backend",
    "use_peft": "a model.lora block turns LoRA on",
    "lora_target_parameters": "LoRA adapts modules (model.lora.target_modules), not parameters",
    "lora_modules_to_save": "only the adapters train under LoRA (and model.towers: train for image-text towers)",
    "lora_task_type": "always a causal language model",
    "use_rslora": "LoRA's scale is alpha / r",
    "use_dora": "plain LoRA only",
    "load_in_*": "quantized base models are not trained",
    "bnb_*": "quantized base models are not trained",
    "use_bnb_nested_quant": "quantized base models are not trained",
    "dataset_config": "data files and saved datasets are read (data.train_data); no hub dataset is downloaded",
    "dataset_train_split": "data.train_data is the training split",
    "dataset_test_split": "SFT's held-out split is data.val_data (GRPO's: model.eval_data)",
    "dataset_streaming": "rows are read whole",
    "ignore_bias_buffers": "not needed: no distributed wrapper syncs buffers",
}
_TRL = re.compile(r"TRL: (.*?)\.?\s*$")


def annotations(task: str) -> dict[str, list[str]]:
    """TRL name -> the recipe keys of ``task`` whose docstrings name it."""
    entries: dict[str, list[str]] = defaultdict(list)  # an entry's text -> its keys (one docstring line, several keys)
    for key, _, _, text in rows(task):
        if match := _TRL.search(text):
            entries[match[1]].append(key)
    found: dict[str, list[str]] = defaultdict(list)
    for annotation, keys in entries.items():
        if annotation.startswith("none"):
            continue
        if annotation.startswith("the same name"):
            for key in keys:
                found[key.rpartition(".")[2]].append(key)
            continue
        names = re.findall(r"`(\w+)`", annotation)
        fields = {key.rpartition(".")[2]: key for key in keys}
        rest = [key for key in keys if key.rpartition(".")[2] not in names] or keys
        for name in names:
            found[name] += [fields[name]] if name in fields else rest
    return found


def trl_fields() -> dict[str, list[str]]:
    """Each TRL class (and ``trl sft``'s flags) with the fields a migrating user sets: those it defines itself, and
    for the configs the common TrainingArguments."""
    import dataclasses

    import trl
    from transformers import TrainingArguments

    inherited = {field.name for field in dataclasses.fields(TrainingArguments)}
    own = {cls.__name__: [f.name for f in dataclasses.fields(cls) if f.name not in inherited]
           for cls in (trl.SFTConfig, trl.GRPOConfig, trl.ModelConfig, trl.ScriptArguments)}  # fmt: skip
    return {
        "SFTConfig": [*own["SFTConfig"], *COMMON],
        "GRPOConfig": [*own["GRPOConfig"], *COMMON],
        "trl sft": [*own["ModelConfig"], *own["ScriptArguments"]],
    }


def mapping(task: str, name: str, found: dict[str, list[str]]) -> tuple[str, str]:
    """(our key or keys, why none) for one TRL field under ``task``."""
    if name in found:
        return ", ".join(f"`{key}`" for key in dict.fromkeys(found[name])), ""
    for where in (task, "*"):
        if (where, name) in TRAINER:
            key, _, note = TRAINER[(where, name)].partition(" ")
            return f"`{key}` {note}".strip(), ""
    for pattern, why in NO_EQUIVALENT.items():
        if fnmatch.fnmatchcase(name, pattern):
            return "", why
    return "", ""


def render() -> str:
    lines = [
        "# Migrating from TRL",
        "",
        "Generated by `python -m lightning_rl.trl_migration` from the TRL names the recipe keys' docstrings give",
        "(`docs/recipe_reference.md` has every key; a test fails when this file is out of date, or when it names a",
        "field TRL 1.16 does not have). A recipe is YAML; any key is also a flag: `--model.learning_rate=1e-5`.",
        "`trl sft --flag` becomes `lightning-rl run --task=sft --key=...` (or a recipe file).",
        "",
    ]
    found = {task: annotations(task) for task in ("sft", "grpo")}
    for title, fields in trl_fields().items():
        task = "grpo" if title == "GRPOConfig" else "sft"
        lines += [f"## {'`trl sft` flags (ModelConfig, ScriptArguments)' if title == 'trl sft' else f'`{title}`'}", "",
                  "| TRL | ours | no equivalent: why |", "|---|---|---|"]  # fmt: skip
        for name in dict.fromkeys(fields):
            ours, why = mapping(task, name, found[task])
            lines.append(f"| `{'--' if title == 'trl sft' else ''}{name}` | {ours or 'none'} | {why} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return write_or_check(render(), OUTPUT, "lightning_rl.trl_migration", argv, __doc__.splitlines()[0])

if __name__ == "__main__":
    sys.exit(main())
