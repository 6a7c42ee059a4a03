"""TRL's field names and the recipe keys that do their work: the tables `trl_migration` renders as
docs/migrating_from_trl.md, and the hint a recipe's unknown key gets when it is a TRL name (`recipe`).

A key's docstring entry ends ``TRL: `name`, `other`.`` (or ``TRL: the same name(s).``) when it does the work of those
TRL fields; Lightning's ``Trainer`` arguments doing a TRL field's work, and the fields with no key (with why), are the
two tables below.
"""

from __future__ import annotations

import fnmatch
import re
from collections import defaultdict
from collections.abc import Iterable

# The TrainingArguments fields a TRL user sets, beside those the config classes define themselves (transformers 5 has
# no warmup_ratio: a warmup_steps below 1 is the ratio, and ours counts steps).
COMMON = ("learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size", "gradient_accumulation_steps",
          "max_grad_norm", "warmup_steps", "lr_scheduler_type", "weight_decay", "seed", "output_dir", "bf16",
          "gradient_checkpointing", "save_steps", "logging_steps", "report_to", "resume_from_checkpoint", "adam_beta1",
          "adam_beta2", "adam_epsilon", "eval_strategy", "eval_steps", "save_total_limit", "dataloader_num_workers",
          "optim", "fp16", "run_name", "torch_compile", "lr_scheduler_kwargs", "per_device_eval_batch_size", "save_strategy",
          "logging_strategy", "push_to_hub", "hub_model_id", "neftune_noise_alpha", "use_liger_kernel", "load_best_model_at_end",
          "metric_for_best_model", "gradient_checkpointing_kwargs")  # fmt: skip
# Lightning's Trainer arguments doing a TRL field's work, per task ("*": both).
TRAINER = {
    ("*", "max_steps"): "trainer.max_steps",
    ("*", "num_train_epochs"): "trainer.max_epochs",
    ("*", "bf16"): "trainer.precision: `bf16-mixed` (float32 weights, as TRL keeps them); `bf16-true` keeps only "
    "16-bit weights, which lose updates below half a bf16 step (said at the start under learning rates below 1e-4)",
    ("*", "logging_steps"): "trainer.log_every_n_steps",
    ("*", "fp16"): "trainer.precision: `16-mixed`",
    ("*", "torch_compile"): "model.compile",
    ("*", "run_name"): "logger.name",
    ("sft", "gradient_accumulation_steps"): "trainer.accumulate_grad_batches",
    ("sft", "max_grad_norm"): "trainer.gradient_clip_val",
    ("sft", "eval_strategy"): "trainer.val_check_interval (training batches between validations; null: once per epoch)",
    ("sft", "eval_steps"): "trainer.val_check_interval (counted in training batches: optimizer steps times "
    "trainer.accumulate_grad_batches)",
    ("grpo", "eval_strategy"): "trainer.val_check_interval (steps between held-out evaluations of model.eval_data)",
    ("grpo", "eval_steps"): "trainer.val_check_interval (optimizer steps; model.eval_generations prompts decoded each time)",
    ("grpo", "per_device_train_batch_size"): "data.batch_size (prompts per step and rank, where TRL's counts "
    "completions: its per_device_train_batch_size x gradient_accumulation_steps / num_generations)",
    ("grpo", "gradient_accumulation_steps"): "data.batch_size (a step trains per_device_train_batch_size x "
    "gradient_accumulation_steps / num_generations prompts a rank, forwarded in micro-batches of at most "
    "model.max_tokens_per_row tokens whose gradients add up)",
    ("grpo", "vllm_importance_sampling_cap"): "model.loss.importance_sampling_cap (TRL's deprecated name of "
    "vllm_importance_sampling_clip_max)",
}
# The TRL fields whose default differs from the default of the one key doing their work, with why, by task ("*":
# both). The guide shows both defaults, read from TRL and from the recipe schema; a test keeps this table equal to
# the differences found there, so a default changed on either side needs its line here.
DEFAULTS = {
    ("*", "seed"): "any fixed seed does; set 42 for TRL's",
    ("*", "logging_steps"): "Lightning's default, every 50 steps; set 10 for TRL's",
    ("*", "num_train_epochs"): "a run is bounded by `trainer.max_steps` (or `trainer.max_epochs` where given); given "
    "both, it stops at whichever comes first (TRL's max_steps overrides the epochs); with neither, Lightning's 1000 epochs",
    ("sft", "max_grad_norm"): "Lightning clips nothing unless asked; set 1.0 for TRL's clipping (GRPO's "
    "`model.max_grad_norm` is 1.0)",
    ("sft", "eval_strategy"): "validation runs once an epoch wherever `data.val_data` is given; no held-out file, no "
    "validation",
    ("grpo", "eval_strategy"): "held-out prompts are evaluated before the first step and after the last wherever "
    "`model.eval_generations` is set; a whole `trainer.val_check_interval` adds evaluations between",
    ("*", "gradient_checkpointing"): "recomputing each layer in backward costs time where memory suffices; the loss "
    "and gradients are the same with it on (exact with packing)",
    ("*", "bf16"): "TRL turns it on unless fp16 is; here Lightning's default, float32 throughout; set "
    "`bf16-mixed` for TRL's",
    ("*", "output_dir"): "a run writes to a folder of its own from the start",
    ("*", "report_to"): "metrics.csv in the run folder; `logger.kind: wandb` for W&B",
    ("*", "save_steps"): "a checkpoint every 100 steps, and one at the end",
    ("*", "save_total_limit"): "the newest checkpoint (and `last`) is kept: a resume needs no more",
    ("sft", "learning_rate"): "the embedded tiny model's rate; set the model's own",
    ("sft", "lr_scheduler_type"): "see the SFT learning-rate schedule below",
    ("sft", "adam_beta1"): "see the SFT AdamW betas below",
    ("sft", "adam_beta2"): "see the SFT AdamW betas below",
    ("sft", "max_length"): "longer examples are refused, not cut: the limit defaults to a row's budget, `data.max_tokens`",
    ("sft", "assistant_only_loss"): "a conversation trains its replies, as a chat model learns them; false trains every "
    "token of the row, TRL's default",
    ("sft", "completion_only_loss"): "TRL's None trains the completion alone wherever rows have one, as true does",
    ("sft", "packing"): "rows are packed by default, exactly (tree or padding-free): the loss is each example's alone",
    ("sft", "packing_strategy"): "`data.packing` names the layout: tree, flat or none (TRL's bfd is flat; its wrapped, which "
    "cuts examples across rows, has no equivalent)",
    ("sft", "padding_free"): "`data.packing: flat` is padding-free; `auto` packs by default",
    ("sft", "per_device_train_batch_size"): "a batch is counted in tokens (`data.max_tokens` per row), not examples",
    ("grpo", "lr_scheduler_type"): "a constant rate after the warmup, as RL recipes run it; `model.lr_schedule: linear` "
    "(with `trainer.max_steps`) for TRL's",
    ("grpo", "max_completion_length"): "the embedded task's answers are a few tokens; set the model's own",
    ("grpo", "max_tool_calling_iterations"): "`model.max_turns` counts replies: TRL's unlimited default has no "
    "counterpart, set the turns a rollout may take",
    ("grpo", "min_p"): "0 is off, as TRL's None",
    ("grpo", "reward_weights"): "1 each, as TRL's None",
    ("grpo", "vllm_importance_sampling_clip_max"): "the correction is off until a bound is set (TRL: on with vLLM, "
    "capped at 3)",
}
# Where the same rows and settings train numbers that differ from TRL 1.16's, on purpose: (what, ours, TRL's, why).
DIFFERENCES = (
    ("SFT loss mask after a turn's end", "a chat template's separator after the end-of-turn token (Qwen's newline "
     "after `<|im_end|>`) is not trained", "trained in prompt/completion rows",
     "the model never has to predict it: generation stops at the end-of-turn token"),
    ("Where a reply ends", "at the model's end tokens and at the special token its chat template writes after a reply "
     "(a base model's ChatML `<|im_end|>`), in every engine and in held-out decoding",
     "at the tokenizer's eos, or the token `eos_token` names",
     "a model trained on the template ends its replies where the template does"),
    ("SFT loss mask at an assistant turn's start", "the loss starts after the model's own template's assistant "
     "header", "TRL 1.16 renders some families (Qwen2.5, Qwen3) with training templates of its own, which can put "
     "a header token (the newline after `<|im_start|>assistant`) in the loss",
     "the model is trained on the template it is served with"),
    ("SFT string prompt/completion rows", "the row is tokenized whole and the loss starts after the prompt's own "
     "tokens; where a token spans the boundary, the completion is tokenized apart, and the row is refused if that "
     "changes its text (a SentencePiece word marker before it)",
     "tokenized joined, the loss starting where the two tokenizations differ",
     "the completion's tokens are the ones the model generates after the prompt, never a token merged across the "
     "boundary"),
    ("SFT at 16-bit precision", "the LM head's logits are float32 whatever `trainer.precision` (the chunked head, "
     "`model.chunk_size`), in SFT as in GRPO", "in the model's dtype (GRPO's `cast_lm_head_to_fp32` aside)",
     "the loss and its gradient are not rounded to 16 bits over a vocabulary of 100K or more"),
    ("An SFT assistant turn with empty content and no tool calls, or an empty text `completion` (whitespace only "
     "counts as empty)", "refused in one line naming the row and turn",
     "trained: its end-of-turn token alone", "an empty reply in a dataset is far more often a lost answer than a "
     "lesson in saying nothing"),
    ("An SFT row whose tool calls, or a tool's result, the chat template does not render (Phi-3's drops both)",
     "refused in one line naming the row and turn", "trained without them: an empty reply where the model called a "
     "tool, an answer without the result it read", "the row would teach what it does not show"),
    ("SFT learning-rate schedule", "`model.lr_schedule` defaults to `cosine`", "`lr_scheduler_type` defaults to "
     "`linear`", "set `model.lr_schedule: linear` for TRL's"),
    ("SFT AdamW betas", "`model.betas` defaults to (0.9, 0.95)", "`adam_beta1`, `adam_beta2` default to 0.9, 0.999",
     "the default the embedded recipes were tuned with; set `model.betas: [0.9, 0.999]` for TRL's (GRPO uses TRL's)"),
    ("GRPO string prompts", "rendered as a user turn by the model's chat template (after `model.system_prompt`); "
     "tokenized as they are only where the tokenizer has no chat template", "tokenized as they are",
     "an instruction-tuned model is prompted as it is served; write the prompt as chat messages to choose the turns"),
    ("The logged `epoch`", "Lightning's: the whole passes over the data done (0 through the first)", "fractional (0.25 "
     "a quarter into the first pass)", "Lightning's loggers write it; the step numbers give the progress within a pass"),
    ("The logged step", "Lightning's: a step's figures are at the steps taken before it (the first step's at 0)",
     "the steps taken with it (the first step's at 1)", "Lightning's loggers count so; a curve laid over TRL's is one "
     "step to its left"),
    ("SFT's held-out loss", "`val/loss`: the mean over every held-out token", "`eval_loss`: the mean of the batches' means",
     "a short batch weighs as much as a long one there; here each token counts once"),
    ("A GRPO prompt whose messages end with assistant turns", "those turns are dropped: the prompt ends with the last "
     "user (or tool) turn, and the model writes the reply", "rendered, closed, and a new assistant turn opened after them",
     "a prompt column that holds whole conversations (the reference answer last) prompts for the answer, not after it"),
    ("Log-probs under `sampling.top_k`, `top_p` or `min_p`", "each sampled token is scored over the support the filters "
     "kept (its log-prob renormalised over it), by the trainer as by the engine", "scored over the whole vocabulary",
     "the policy gradient and the importance ratio are those of the distribution the tokens were sampled from"),
    ("A JSONL column's numbers", "read as written: `5` stays an int beside a `2.5` (Parquet and saved datasets keep their "
     "column's type)", "`load_dataset('json')` gives the column one type: `5.0`", "the value a reward compares is the one in "
     "the file; `float(x)` reads both"),
    ("Prompts written as text parts", "a text-only prompt's parts are joined into one string before rendering, and "
     "rewards get the joined text", "rewards get the parts as written",
     "the text-only chat template renders strings; a reward reading `content[0][\"text\"]` reads `content` instead"),
    ("Multi-turn rows with Qwen3's or gpt-oss's own template", "refused in one line (Qwen3's renders earlier turns "
     "without their reasoning once later turns follow; gpt-oss's ends the last reply with `<|return|>`, earlier ones with `<|end|>`)", "trained with a training template of TRL's",
     "the served template cannot locate the assistant turns exactly"),
    ("Tool turns, and user or system turns, inside a conversational completion", "only the assistant turns of the completion are trained",
     "the whole completion is trained, the other turns and their headers too",
     "a tool's output is the environment's, a user's turn the user's: not the model's to predict"),
    ("`train/loss` with `trainer.log_every_n_steps` > 1", "the loss of the step it is logged at",
     "the mean over the steps since the last log (`logging_steps`)", "each logged figure is one step's, as every "
     "other `train/` figure is"),
    ("Tool-calling turns", "`model.max_turns` counts replies: TRL's `max_tool_calling_iterations` + 1",
     "`max_tool_calling_iterations` counts the rounds of calls", "the same run takes max_turns = iterations + 1"),
    ("Completion budget with tools", "`sampling.max_new_tokens` is each reply's (a completion holds up to max_turns "
     "replies and the tools' results between them); Dr. GRPO's constant is max_new_tokens x max_turns",
     "`max_completion_length` caps the whole completion, tool results included", "a reply is sampled against its own "
     "budget, and a tool's result is not the model's to spend it on"),
    ("Clip fractions at `importance_sampling_level: sequence` with `mask_truncated_completions`", "of the sequences "
     "that train", "of every sequence, a masked one counted as not clipped", "a sequence that trains nothing is neither "
     "clipped nor kept"),
    ("`loss_type: bnpo`, and the entropy bonus and top-entropy threshold of every loss type, with "
     "`gradient_accumulation_steps` > 1", "normalised over the whole optimizer step's tokens on the rank (bnpo is "
     "dapo on one process), and the top-entropy quantile taken over the step's tokens", "normalised over each "
     "micro-batch's tokens, then divided by the accumulation steps, so one micro-batch's tokens weigh more than "
     "another's", "a step's loss does not depend on how it is split into micro-batches (`data.batch_size` replaces "
     "both TRL keys here)"),
    ("`train/vespo/phi_seq_mean` with `mask_truncated_completions`", "over the sequences that train",
     "every sequence, a masked one counted with phi 1", "the figure describes the weights the loss applied"),
    ("`train/mismatch/is_ratio_*` in the `sequence_*` modes with `mask_truncated_completions`", "over the sequences "
     "that train: a masked sequence has no weight applied", "every sequence, a masked one counted with weight 1 (its "
     "masked tokens sum to 0)", "the figure describes the weights the loss applied"),
    ("Two images side by side in a turn, with no text between them", "refused in one line naming the row: put text "
     "between them", "trained", "with a template that renders no separator the two images' placeholders make one run, "
     "which cannot be split between the images exactly"),
    ("`warmup_steps` below 1", "refused: it counts optimizer steps", "a fraction of the run's steps", "one meaning "
     "per key: give the fraction times `trainer.max_steps`"),
    ("What a reward model (`reward_model`) reads for a string prompt", "the prompt as the policy's user turn and the "
     "completion as the reply, rendered by the reward model's own chat template (without one, as TRL: the prompt and the "
     "completion as written, joined with nothing)", "the prompt and the completion as written, joined with nothing",
     "a chat reward model scores a conversation as it was trained to read one; a conversational prompt is rendered alike "
     "by both (without a template, refused by both)"),
    ("Held-out exact match of a chat row", "compared with the final reply as the template renders it for training (Qwen3's "
     "empty `<think></think>` included), up to its end of turn", "no such metric",
     "a greedy reply writes what it was trained to write; the message's content alone would never match"),
    ("A string prompt in a reward's `prompts`", "the text the policy was prompted with: the prompt rendered by the chat "
     "template (its raw text is the user turn of `prompt_messages`)", "the string as written", "string prompts are "
     "rendered for the model (GRPO string prompts, above), and a reward reads what the policy was given"),
    ("`train/reward/frac_zero_std` under `scale_rewards: batch` or `normalize_then_sum`", "the share of groups whose "
     "scored rewards all tie, whatever the scaling", "`frac_reward_zero_std` tests the std the advantages divide by: the "
     "step's under those settings, so 0 or 1", "a tied group gives no signal however the step is scaled: the figure "
     "counts them"),
    ("`scale_rewards` as a flag", "a name only (`group`, `batch`, `none`; `std` is `group`'s earlier name): a flag is refused in one line", "`True` "
     "(group) and `False` (none, Dr. GRPO's) too", "one spelling per setting: write TRL's True as group, False as none"),
    ("SFT's `mean_token_accuracy` and `entropy` under gradient accumulation or several ranks", "over every trained "
     "token of the step, on every rank (as `loss` is): `train/mean_token_accuracy`, `train/entropy`; held out, over "
     "every held-out token", "the mean of each micro-batch's figure (gathered over the ranks), and of each eval "
     "batch's", "a micro-batch of few tokens weighs as much as one of many there; here each token counts once, as in "
     "the loss"),
    ("`num_tokens`", "`train/trained_tokens` and `train/flat_tokens`: this step's (summary.json sums them over the run; with "
     "`model.num_iterations` > 1 each pass over a batch counts)", "the running total of the inputs' tokens, a batch counted once",
     "a step's figure reads alone; the total is the run's summary, of the tokens forwarded"),
    ("A reward that times itself with `signal.alarm` (math_verify's defaults)", "it fails on the thread of its own "
     "a plain function runs on, and is called on the main thread from then on, with a warning; under `async_mode`, "
     "which scores off the main thread, the run stops in one line", "called on the main thread",
     "a reward that does not return is left behind on its thread at `reward_timeout_s`, and the run goes on; on the "
     "main thread nothing can cut it"),
)
# TRL fields with no key here, and why (fnmatch patterns: the first that matches).
NO_EQUIVALENT = {
    "model_init_kwargs": "models load from model.model_name_or_path in the precision of trainer.precision; a recipe "
    "holds typed keys, not a bag of keyword arguments",
    "trust_remote_code": "only model classes transformers ships are loaded: no code runs from a model folder",
    "optim": "the optimizer is torch's AdamW; its betas and weight decay are model keys",
    "lr_scheduler_kwargs": "the schedules take no options beyond model.warmup_steps and model.lr_schedule",
    "per_device_eval_batch_size": "held-out rows are batched as the training ones are (SFT: data.max_tokens tokens a row)",
    "save_strategy": "checkpoints are taken every checkpoint_every_n_steps steps, and at the end",
    "logging_strategy": "figures are logged every trainer.log_every_n_steps steps",
    "push_to_hub": "the run writes a Hugging Face folder, OUTPUT_DIR/hf, with its model card: upload that folder",
    "hub_model_id": "the run writes a Hugging Face folder, OUTPUT_DIR/hf, with its model card: upload that folder",
    "neftune_noise_alpha": "NEFTune's noise on the input embeddings is not added",
    "use_liger_kernel": "the loss is taken in chunks of model.chunk_size tokens, never holding a row's whole logits (what "
    "Liger's fused cross-entropy saves)",
    "load_best_model_at_end": "the exported model is the last step's; checkpoints are kept by step (keep_checkpoints)",
    "metric_for_best_model": "the exported model is the last step's; checkpoints are kept by step (keep_checkpoints)",
    "gradient_checkpointing_kwargs": "model.gradient_checkpointing recomputes each decoder layer, non-reentrant; it takes "
    "no options",
    "router_aux_loss_coef": "the router's auxiliary loss is not added (GRPO's MoE policies train with model.router_replay)",
    "chat_template_path": "the model folder's tokenizer renders rows with its own chat template: put another one in "
    "that folder (chat_template.jinja)",
    "dataset_text_field": "a row's `text` column, TRL's default, is read as plain text and trained whole (the end token appended); another name is not read",
    "dataset_kwargs": "a recipe holds typed keys, not a bag of keyword arguments",
    "dataset_num_proc": "rows are tokenized once, in the main process",
    "eos_token": "each reply ends with the special token the chat template writes after it, read from the template; "
    "a `text` row and a string completion end with the tokenizer's own eos_token (once: a tokenizer that appends it "
    "itself is not given it twice, as TRL's appended text is)",
    "pad_token": "packed rows hold no padding to fill",
    "truncation_mode": "an example longer than data.max_length is an error, never cut",
    "eval_packing": "held-out rows are packed as the training ones are",
    "adam_epsilon": "AdamW's eps is torch's default, 1e-8, TRL's default too",
    "dataloader_num_workers": "GRPO's prompts are a few per step, read in the main process",
    "adam_beta*": "GRPO's AdamW takes torch's betas, (0.9, 0.999), TRL's defaults",
    "eval_*": "GRPO evaluates model.eval_data before the first step, every trainer.val_check_interval steps and after the last (model.eval_generations)",
    "pad_to_multiple_of": "GRPO's packed rows take the step's shape (model.max_tokens_per_row bounds them)",
    "loss_type": "SFT's loss is the negative log-likelihood only",
    "disable_dropout": "models are trained with the dropout their config sets; attention dropout, which tree "
    "attention does not apply, is refused in one line naming its config key (set it to 0)",
    "cast_lm_head_to_fp32": "log-probs come from a chunked LM head whose logits are float32 whatever the precision "
    "(16-bit weights and hidden states multiplied to a float32 result; model.chunk_size)",
    "num_generations_eval": "held-out scoring decodes greedily, once per prompt (model.eval_generations)",
    "ds3_gather_for_generation": "DeepSpeed is not used: the engine gets whole weights from the trainer's sync",
    "shuffle_dataset": "SFT's examples (data.shuffle, on by default) and GRPO's prompts are reshuffled every pass, "
    "seeded by seed, as TRL's sampler reshuffles every epoch; TRL's shuffle_dataset only shuffles once more while the "
    "data is prepared, and its false is not data.shuffle: false (the file's order)",
    "generation_batch_size": "a step generates for data.batch_size prompts (times model.num_generations)",
    "steps_per_generation": "each optimizer step trains on its own batch of rollouts, not on a slice of a larger "
    "generation batch (model.num_iterations, TRL's num_iterations, repeats a whole batch)",
    "generation_kwargs": "sampling takes the typed keys of model.sampling",
    "chat_template_kwargs": "no recipe-wide one: a row's own chat_template_kwargs column (SFT's and GRPO's) reaches "
    "the chat template",
    "cache_implementation": "the hf engine uses transformers' default cache",
    "use_vllm": "give model.engine: vllm (in this process) or vllm_server (a server of its own)",
    "vllm_mode": "model.engine: vllm is TRL's colocate mode, vllm_server its server mode",
    "vllm_importance_sampling_correction": "on when model.loss.importance_sampling_cap or _floor is set",
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
    "lora_modules_to_save": "only the adapters train under LoRA (an image-text model's towers too, with model.towers: lora)",
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
# What a TRL name given to one of our keys means otherwise here, shown beside the key.
MAPPED_NOTES = {"dataset_name": "a data file or one split's save_to_disk folder; a Hub dataset is not downloaded"}
_TRL = re.compile(r"TRL: (.*?)\.?\s*$")


def annotations(documented: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """TRL name -> the recipe keys whose docs (``documented``: (key, text) pairs) name it."""
    entries: dict[str, list[str]] = defaultdict(list)  # an entry's text -> its keys (one docstring line, several keys)
    for key, text in documented:
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


def mapping(task: str, name: str, found: dict[str, list[str]]) -> tuple[str, str]:
    """(our key or keys, why none) for one TRL field under ``task``."""
    if name in found:
        note = f" ({MAPPED_NOTES[name]})" if name in MAPPED_NOTES else ""
        return ", ".join(f"`{key}`" for key in dict.fromkeys(found[name])) + note, ""
    for where in (task, "*"):
        if (where, name) in TRAINER:
            key, _, note = TRAINER[(where, name)].partition(" ")
            return f"`{key}` {note}".strip(), ""
    for pattern, why in NO_EQUIVALENT.items():
        if fnmatch.fnmatchcase(name, pattern):
            return "", why
    return "", ""


# TRL 1.16's fields that only a pattern of NO_EQUIVALENT names (``vllm_*``): a pattern alone would match names that
# are no TRL field. A test keeps this equal to what trl's own config classes hold.
PATTERN_FIELDS = frozenset({
    "adam_beta1", "adam_beta2", "bnb_4bit_quant_storage", "bnb_4bit_quant_type", "eval_steps", "eval_strategy", "load_in_4bit",
    "load_in_8bit", "log_completions", "log_completions_hub_repo", "log_multimodal", "log_unique_prompts",
    "use_transformers_continuous_batching", "use_transformers_paged", "vllm_enable_sleep_mode", "vllm_gpu_memory_utilization",
    "vllm_group_port", "vllm_importance_sampling_cap", "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min", "vllm_importance_sampling_mode",
    "vllm_max_model_length", "vllm_model_impl", "vllm_server_base_url", "vllm_server_host", "vllm_server_port",
    "vllm_server_timeout", "vllm_structured_outputs_regex", "vllm_tensor_parallel_size",
})  # fmt: skip


def hint(task: str, name: str, documented: Iterable[tuple[str, str]]) -> str | None:
    """For a key a recipe of ``task`` does not take whose last part ``name`` is a TRL field: the recipe key doing that
    field's work, or why there is none (``documented``: the recipe's (key, doc) pairs); None for any other name."""
    found = annotations(documented)
    if not (name in found or any((where, name) in TRAINER for where in (task, "*")) or name in NO_EQUIVALENT or name in PATTERN_FIELDS):
        return None
    ours, why = mapping(task, name, found)
    return f"for TRL's {name}, set {ours.replace('`', '')}" if ours else f"TRL's {name} has no key here: {why}"
