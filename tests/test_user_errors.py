"""Every mistake is one line. Each class of mistake, made on a tiny recipe through the real `lightning-rl` command in
this process, ends with exit code 2 and exactly one `error:` line that names the key (or the file and line), without
a traceback, and writes nothing into output_dir. A negative control shows the same run without the mistake gets
past every check."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from pathlib import Path

import lightning
import pytest
import torch
import yaml

from lightning_rl import cli
from support.paths import REPO, TOY_HELDOUT, TOY_TRAIN

SFT, SFT_LORA, GRPO = (str(REPO / "recipes" / "tiny" / name) for name in ("sft.yaml", "sft_lora.yaml", "grpo.yaml"))
MUSE = str(REPO / "recipes" / "muse_spark_open" / "lora_sft_8x8.yaml")
SHORT = ["--trainer.max_steps=1", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
SHORT_SFT = [*SHORT, "--data.val_data=null", "--data.max_tokens=256", "--model.eval_generations=0",
             "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0"]  # fmt: skip
SHORT_GRPO = [*SHORT, "--model.num_generations=2", "--data.batch_size=1"]
VALIDATED = [f"--data.val_data={TOY_HELDOUT}", "--trainer.limit_val_batches=1"]  # SHORT_SFT validates nothing
GOOD_ROW = {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}


def always_raises(completions: list[str], **_) -> list[float]:
    raise KeyError("score")


def recipe_with(tmp_path: Path, recipe: str, **model: object) -> str:
    """A copy of ``recipe`` with ``model`` keys set as YAML values (for what an override cannot spell, like NaN)."""
    config = yaml.safe_load(Path(recipe).read_text())
    config["model"].update(model)
    for key in ("train_data", "val_data"):
        if key in config.get("data", {}):
            config["data"][key] = str(REPO / config["data"][key])
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def written(tmp_path: Path, text: str) -> str:
    path = tmp_path / "written.yaml"
    path.write_text(text)
    return str(path)


SFT_LINES = Path(SFT).read_text().splitlines()
MODEL_LINE = SFT_LINES.index("model:") + 1  # the tiny SFT recipe's model block
# A second model block after the recipe's, and a key repeated inside the model block.
TWO_MODEL_BLOCKS = "\n".join([*SFT_LINES, "model:", "  learning_rate: 1.0"]) + "\n"
LR_TWICE = "\n".join([*SFT_LINES[:MODEL_LINE], "  warmup_steps: 3", "  warmup_steps: 1", *SFT_LINES[MODEL_LINE:]]) + "\n"


def checkpoint(path: Path, state_dict: dict[str, torch.Tensor]) -> str:
    torch.save({"epoch": 0, "global_step": 1, "pytorch-lightning_version": lightning.__version__, "state_dict": state_dict,
                "loops": {}, "callbacks": {}, "optimizer_states": [], "lr_schedulers": []}, path)  # fmt: skip
    return str(path)


def lora_checkpoint(path: Path, r: int) -> str:
    from lightning_rl.modules.sft import SFTModule

    module = SFTModule(lora={"r": r})
    module.configure_model()
    return checkpoint(path, module.state_dict())


def data_file(tmp_path: Path, name: str, content: bytes) -> str:
    (tmp_path / name).write_bytes(content)
    return str(tmp_path / name)


def adapter_folder(tmp_path: Path) -> str:
    """A folder as a run's ``model.export: adapter`` writes it: peft's adapter files, no config.json."""
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "Qwen/Qwen3-0.6B", "peft_type": "LORA"}))
    return str(tmp_path / "adapter")


GOOD = json.dumps(GOOD_ROW).encode() + b"\n"
USER_LAST = json.dumps({"messages": [*GOOD_ROW["messages"], {"role": "user", "content": "thanks"}]}).encode() + b"\n"
EMPTY_TURN = json.dumps({"messages": [GOOD_ROW["messages"][0], {"role": "assistant", "content": ""}]}).encode() + b"\n"
# name -> (recipe, overrides given the test's tmp_path, what the error line starts with after "error: "; {t} is
# tmp_path, {r} the recipe, which a mistake the parser finds in it is said in; one typed on the command line is said to be there)
def sharded_checkpoint(folder) -> str:
    """A folder as FSDP2 saves a checkpoint (its metadata and shards), under a name that is no checkpoint's."""
    (folder / "last.ckpt").mkdir()
    (folder / "last.ckpt" / "meta.pt").write_bytes(b"")
    (folder / "last.ckpt" / "__0_0.distcp").write_bytes(b"")
    return str(folder / "last.ckpt")


MISTAKES = {
    "train_data a folder": (SFT, lambda t: [f"--data.train_data={t}"], "data.train_data: "),
    "train_data a Hub dataset": (SFT, lambda t: ["--data.train_data=trl-lib/no-such-data"], "data.train_data: no such file or folder: "
                                 "trl-lib/no-such-data (a relative path, read from the working directory {cwd}); a Hub dataset is not downloaded here"),
    "val_data a share of the training data": (SFT, lambda t: ["--data.val_data=0.1"], "data.val_data: no such file or folder: 0.1 (a "
                                              "relative path, read from the working directory {cwd}); a share of the training data is not split off here"),
    "GRPO eval_data without a reply to compare": (GRPO, lambda t: [f"--model.eval_data={data_file(t, 'h.jsonl', USER_LAST)}", "--model.eval_generations=2"],
                                                  "model.eval_data ({t}/h.jsonl) has no conversation ending in a reply"),
    "unknown model folder": (SFT, lambda t: [f"--model.model_name_or_path={t / 'no-model'}"], "model.model_name_or_path: no model folder"),
    "a checkpoint given as the model": (SFT, lambda t: [f"--model.model_name_or_path={data_file(t, 'step=3.ckpt', b'PK')}"],
                                        "model.model_name_or_path: {t}/step=3.ckpt is a training checkpoint, not a model folder: resume"),
    "a sharded checkpoint given as the model": (SFT, lambda t: [f"--model.model_name_or_path={sharded_checkpoint(t)}"],
                                                "model.model_name_or_path: {t}/last.ckpt is a training checkpoint, not a model folder"),
    "a LoRA adapter given as the model": (SFT, lambda t: [f"--model.model_name_or_path={adapter_folder(t)}"],
                                          "model.model_name_or_path: {t}/adapter is a PEFT adapter of Qwen/Qwen3-0.6B, not a model folder: start from"),
    "unknown hub id": (SFT, lambda t: ["--model.model_name_or_path=nobody-at-all/no-such-model"], "model.model_name_or_path: nobody-at-all/no-such-model is neither"),
    "learning_rate NaN": (lambda t: recipe_with(t, SFT, learning_rate=float("nan")), lambda t: [], "model.learning_rate must be a finite number > 0, got nan"),
    "learning_rate negative": (SFT, lambda t: ["--model.learning_rate=-1e-3"], "model.learning_rate must be > 0, got -0.001"),
    "unknown lr_schedule": (SFT, lambda t: ["--model.lr_schedule=cosin"], "command line: model.lr_schedule must be one of constant,"),
    "warmup_steps negative": (SFT, lambda t: ["--model.warmup_steps=-5"], "model.warmup_steps must be >= 0, got -5"),
    "betas one value": (SFT, lambda t: ["--model.betas=[0.9]"], "command line: model.betas must be a list of 2 values, got [0.9]"),
    "loss block null": (GRPO, lambda t: ["--model.loss=null"], "command line: model.loss is a block of keys (model.loss.NAME=VALUE, or a mapping), got null"),
    "flex attention on a CPU": (SFT, lambda t: ["--model.attention_backend=flex"], "model.attention_backend: 'flex' has no backward on a CPU"),
    "loss block a word": (GRPO, lambda t: ["--model.loss=dapo"], "command line: model.loss is a block of keys (model.loss.NAME=VALUE, or a mapping), got dapo"),
    "lora block true": (SFT, lambda t: ["--model.lora=true"], "command line: model.lora is a block of keys (model.lora.NAME=VALUE, or a mapping) or null, got true"),
    "flag without a value": (SFT, lambda t: ["--trainer.max_steps"], "command line: trainer.max_steps: no value given (--trainer.max_steps=VALUE)"),
    "accumulate_grad_batches 0": (SFT, lambda t: ["--trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches must be >= 1, got 0"),
    "recipe a list": (lambda t: written(t, "- task: sft\n- model: {}\n"), lambda t: [], "{r}: a recipe is a mapping of keys (task:, model:, data:, ...), not a list"),
    "task in another case": (lambda t: written(t, "Task: sft\n"), lambda t: [], "{r}: missing key 'task' (one of sft, grpo); the recipe has 'Task': did you mean 'task'?"),
    "tab indentation in a recipe": (lambda t: written(t, "task: sft\nmodel:\n  learning_rate: 1.0e-3\n\tchunk_size: 4\n"), lambda t: [],
                                    "{r}: line 4, column 1: not valid YAML (found character '\\t' that cannot start any token)"),
    "shell variable in a recipe": (lambda t: written(t, "task: sft\ndata:\n  train_data: ${SCRATCH}/rows.jsonl\n"), lambda t: [],
                                   "{r}: data.train_data: '${{SCRATCH}}/rows.jsonl' names the variable SCRATCH, which a recipe does not expand"),
    "train_data a list of files": (SFT, lambda t: ["--data.train_data=[a.jsonl, b.jsonl]"],
                                   "data.train_data must be one data file or folder (JSONL, JSON, Parquet or a saved dataset), got list ['a.jsonl', 'b.jsonl']"),
    "train_data a number": (lambda t: written(t, "task: sft\ndata:\n  train_data: 2024\n"), lambda t: [],
                            "data.train_data must be one data file or folder (JSONL, JSON, Parquet or a saved dataset), got int 2024 (quote it, '2024', "),
    "logger not a block": (lambda t: written(t, "task: sft\nlogger: wandb\n"), lambda t: [], "{r}: logger is a block of keys (logger: {{kind: wandb}}), got 'wandb'"),
    "logger key typo": (SFT, lambda t: ["--logger.projct=x"], "command line: unknown key 'logger.projct' (did you mean 'logger.project'?)"),
    "devices negative": (SFT, lambda t: ["--trainer.devices=-3"], "trainer.devices must be auto, -1 (every device), a count >= 1 or a list"),
    "devices indices on a CPU": (SFT, lambda t: ["--trainer.devices=[0, 1]"], "trainer.devices: a CPU run takes a number of processes"),
    "val_check_interval 0": (SFT, lambda t: ["--trainer.val_check_interval=0"], "trainer.val_check_interval must be null, a number of"),
    "val_check_interval past an epoch": (SFT, lambda t: ["--trainer.check_val_every_n_epoch=1", "--trainer.val_check_interval=1000"],
                                         "trainer.val_check_interval=1000 training batches, but an epoch of data.train_data is "),
    "limit_train_batches keeps no batch": (SFT, lambda t: ["--trainer.limit_train_batches=0.0001"], "trainer.limit_train_batches=0.0001 keeps no batch of data.train_data's "),
    "val_check_interval past a limited epoch": (SFT, lambda t: ["--trainer.check_val_every_n_epoch=1", "--trainer.limit_train_batches=0.5", "--trainer.val_check_interval=40"],
                                                "trainer.val_check_interval=40 training batches, but an epoch of data.train_data is "),
    "check_val_every_n_epoch 0": (SFT, lambda t: ["--trainer.check_val_every_n_epoch=0"], "trainer.check_val_every_n_epoch must be >= 1, got 0"),
    "chunk_size 0": (SFT, lambda t: ["--model.chunk_size=0"], "model.chunk_size must be >= 1, got 0"),
    "max_new_tokens 0 (sft)": (SFT, lambda t: ["--model.max_new_tokens=0"], "model.max_new_tokens must be >= 1, got 0"),
    "SFT rows on two processes under FSDP2": (SFT, lambda t: ["--trainer.devices=2", "--trainer.strategy=fsdp2", "--data.max_tokens_per_row=128"],
                                              "data.max_tokens_per_row=128 cuts each batch into rows, which 2 processes run under DDP (without static_graph) alone, not FSDP2Strategy"),
    "a rollout longer than a row": (GRPO, lambda t: ["--model.max_tokens_per_row=10", "--model.prefix_across_rows=never"],
                                    "model.max_tokens_per_row=10: a rollout of "),
    "polynomial ending above the rate": (SFT, lambda t: ["--model.lr_schedule=polynomial", "--model.learning_rate=1e-7"],
                                         "model.learning_rate=1e-07 is at or below 1e-07, where lr_schedule polynomial ends"),
    "warmup under constant (grpo)": (GRPO, lambda t: ["--model.lr_schedule=constant", "--model.warmup_steps=2"],
                                     "model.warmup_steps=2, but lr_schedule constant applies no warmup: use constant_with_warmup"),
    "max_new_tokens 0 (grpo)": (GRPO, lambda t: ["--model.sampling.max_new_tokens=0"], "model.sampling.max_new_tokens must be >= 1, got 0"),
    "max_turns 0": (GRPO, lambda t: ["--model.max_turns=0"], "model.max_turns must be >= 1, got 0"),
    "unknown engine": (GRPO, lambda t: ["--model.engine=vlm"], "command line: model.engine must be one of hf, vllm, vllm_server or an engine's class_path, got vlm"),
    "engine class_path typo": (GRPO, lambda t: ["--model.engine=lightning_rl.rollout.vllm_engine.VLLMEngin", "--model.engine.init_args.dtype=float32"],
                               "command line: model.engine.class_path: rollout engine 'lightning_rl.rollout.vllm_engine.VLLMEngin': module "
                               "'lightning_rl.rollout.vllm_engine' has no 'VLLMEngin' (did you mean lightning_rl.rollout.vllm_engine.VLLMEngine?)"),
    "engine option typo": (GRPO, lambda t: ["--model.engine=VLLMEngine", "--model.engine.init_args.gpu_memory_utilisation=0.5"], "command line: unknown key 'model.engine.init_args.gpu_memory_utilisation' (did you mean 'model.engine.init_args.gpu_memory_utilization'?)"),
    "engine option of the wrong type": (GRPO, lambda t: ["--model.engine=VLLMServerEngine", "--model.engine.init_args.transport=mpi"], "command line: model.engine.transport must be one of auto, gloo, nccl, got mpi"),
    "server engine restarts -1": (GRPO, lambda t: ["--model.engine=VLLMServerEngine", "--model.engine.init_args.engine_max_restarts=-1"],
                                  "model.engine: engine_max_restarts must be an integer >= 0, got -1"),
    "server engine timeout 0": (GRPO, lambda t: ["--model.engine=VLLMServerEngine", "--model.engine.init_args.request_timeout=0"],
                                "model.engine: request_timeout must be > 0 (seconds), got 0.0"),
    "float16 mixed precision on a CPU": (SFT, lambda t: ["--trainer.precision=16-mixed"],
                                         "trainer.precision=16-mixed: float16 mixed precision does not run on a CPU (Lightning would run bf16-mixed"),
    "a validation inside an optimizer step": (SFT, lambda t: [*VALIDATED, "--trainer.accumulate_grad_batches=2", "--trainer.val_check_interval=3", "--trainer.max_steps=2"],
                                              "trainer.val_check_interval=3 validates every 3 training batches, and at batch 3 (batch 3 of an "
                                              "epoch of 56, counted across epochs) inside an optimizer step of trainer.accumulate_grad_batches=2"),
    # A multiple of the accumulation, counted across epochs of an odd number of batches: the second epoch's steps start one later.
    "a validation inside a later epoch's step": (SFT, lambda t: [*VALIDATED, "--trainer.accumulate_grad_batches=2", "--trainer.val_check_interval=6",
                                                                "--trainer.limit_train_batches=5", "--trainer.max_steps=4"],
                                                 "trainer.val_check_interval=6 validates every 6 training batches, and at batch 6 (batch 1 of an "
                                                 "epoch of 5, counted across epochs) inside an optimizer step of trainer.accumulate_grad_batches=2 "
                                                 "(its figures would be logged a step late, beside the next step's): give a multiple of an epoch's 5 batches"),
    "validation batches of a GRPO run": (GRPO, lambda t: ["--trainer.limit_val_batches=5"], "trainer.limit_val_batches=5 is not taken by GRPO: it runs no validation batches"),
    "TRL's min_p None": (GRPO, lambda t: ["--model.sampling.min_p=null"], "command line: model.sampling.min_p must be a number, got None (0 is off, as TRL's None)"),
    "a warmup given as a share": (SFT, lambda t: ["--model.warmup_steps=0.1"], "command line: model.warmup_steps must be an integer, got 0.1 "
                                  "(a share of the run, TRL's warmup_ratio, is given as its steps: the ratio x trainer.max_steps)"),
    "SFT's clipping asked of GRPO's key": (SFT, lambda t: ["--model.max_grad_norm=1"], "command line: unknown key 'model.max_grad_norm' (a GRPO "
                                          "key; SFT clips the gradient norm with trainer.gradient_clip_val)"),
    "a required key cleared": (SFT, lambda t: ["--data.train_data=null"], "command line: data.train_data must be given a value (it is missing, or null)"),
    "server engine url with the OpenAI path": (GRPO, lambda t: ["--model.engine=VLLMServerEngine", "--model.engine.init_args.url=http://127.0.0.1:8000/v1"],
                                                "model.engine: url must be a server's http(s)://HOST:PORT, without a path, got 'http://127.0.0.1:8000/v1' (drop '/v1')"),
    "server engine url": (GRPO, lambda t: ["--model.engine=VLLMServerEngine", "--model.engine.init_args.url=localhost:8000"],
                          "model.engine: url must be a server's http(s)://HOST:PORT, got 'localhost:8000'"),
    "server chunked prefill on a CPU": (GRPO, lambda t: ["--model.engine=VLLMServerEngine", "--model.engine.init_args.server_options={whole_prefills: false}"],
                                        "model.engine: server_options.whole_prefills: false is refused on a CPU: vLLM's CPU build dies"),
    "server flag the engine sets": (GRPO, lambda t: ["--model.engine=VLLMServerEngine",
                                                     "--model.engine.init_args.server_options={extra_args: [--logprobs-mode=raw_logprobs]}"],
                                    "model.engine: server_options.extra_args --logprobs-mode: the engine starts the server with its own"),
    "server option typo": (GRPO, lambda t: ["--model.engine=VLLMServerEngine", "--model.engine.init_args.server_options={max_len: 256}"],
                           "model.engine.init_args.server_options: unknown 'max_len' (it takes dtype,"),
    "engine options without class_path": (GRPO, lambda t: ["--model.engine.init_args.device=cpu"], "command line: model.engine: init_args given without a class_path: name the engine"),
    "engine options without class_path (recipe)": (lambda t: recipe_with(t, GRPO, engine={"init_args": {"device": "cpu"}}), lambda t: [],
                                                   "{r}: model.engine: init_args given without a class_path: name the engine"),
    "engine dtype unknown": (GRPO, lambda t: ["--model.engine=HFRolloutEngine", "--model.engine.init_args.dtype=bfloat"],
                             "model.engine.init_args.dtype: must be one of float32, float, bfloat16, float16, half, float64, double, got 'bfloat'"),
    "engine device not a device": (GRPO, lambda t: ["--model.engine=HFRolloutEngine", "--model.engine.init_args.device=gpu"], "model.engine.init_args.device: 'gpu' is not a torch device"),
    "engine device this machine lacks": (GRPO, lambda t: ["--model.engine=HFRolloutEngine", "--model.engine.init_args.device=cuda:99"], "model.engine.init_args.device: 'cuda:99', but this machine has "),
    "key written twice: a second block": (lambda t: written(t, TWO_MODEL_BLOCKS), lambda t: [],
                                          f"{{r}}: model is written twice (lines {MODEL_LINE} and {len(SFT_LINES) + 1}); YAML would keep only the second"),
    "key written twice: inside a block": (lambda t: written(t, LR_TWICE), lambda t: [],
                                          f"{{r}}: model.warmup_steps is written twice (lines {MODEL_LINE + 1} and {MODEL_LINE + 2})"),
    "short engine name given options": (GRPO, lambda t: ["--model.engine=hf", "--model.engine.init_args.device=cpu"], "command line: model.engine: a short name (hf, vllm, vllm_server) takes no options"),
    "grpo without an end": (GRPO, lambda t: ["--trainer.max_steps=-1"], "trainer.max_steps: a GRPO run draws prompt batches without end: give trainer.max_steps, or trainer.max_epochs"),
    "duplicate tool": (GRPO, lambda t: ["--model.tools=[lightning_rl.tools.builtin:calculator, lightning_rl.tools.builtin.calculator]"], "model.tools must not repeat a name, got calculator"),
    "lora r 0": (SFT_LORA, lambda t: ["--model.lora.r=0"], "model.lora.r must be >= 1, got 0"),
    "lora targets none exist": (SFT_LORA, lambda t: ["--model.lora.target_modules=[qproj]"], "model.lora.target_modules: 'qproj' matches no module of Qwen3ForCausalLM"),
    "lora targets some exist": (SFT_LORA, lambda t: ["--model.lora.target_modules=[q_proj, vproj, o_prj]"], "model.lora.target_modules: 'vproj', 'o_prj' match no module"),
    "lora target one name": (SFT_LORA, lambda t: ["--model.lora.target_modules=qproj"], "model.lora.target_modules: 'qproj' matches no module of Qwen3ForCausalLM"),
    "lora key unknown": (SFT_LORA, lambda t: ["--model.lora.use_rslora=true"], "command line: unknown key 'model.lora.use_rslora'"),
    "merged export of a tied embedding's adapter": (SFT_LORA, lambda t: ["--model.lora.target_modules=[embed_tokens, q_proj]"],
                                                    "model.export: merged: merging LoRA into "),
    "unsupported precision": (SFT, lambda t: ["--trainer.precision=transformer-engine"], "trainer.precision must be one of 32-true, bf16-mixed, 16-mixed, bf16-true, 64-true, got 'transformer-engine'"),
    "unknown precision": (SFT, lambda t: ["--trainer.precision=8-mixed"], "command line: trainer.precision must be one of"),
    "abbreviated key": (SFT, lambda t: ["--model.learning_rat=1e-3"], "command line: unknown key 'model.learning_rat'"),
    "output_dir unwritable": (SFT, lambda t: [f"--output_dir={data_file(t, 'a-file', b'')}/run"], "output_dir: cannot write into"),
    "output_dir empty": (SFT, lambda t: ["--output_dir="], "output_dir must name a folder, got ''"),
    "overwrite with ckpt_path": (SFT, lambda t: ["--overwrite", "--ckpt_path=last"], "overwrite: --overwrite starts the run in output_dir over, --ckpt_path=last resumes a run: give one of them"),
    "ckpt_path empty": (SFT, lambda t: ["--ckpt_path="], "ckpt_path is empty: give a checkpoint (a file, or a sharded checkpoint's folder), or last"),
    "ckpt_path missing": (SFT, lambda t: [f"--ckpt_path={t / 'none.ckpt'}"], "ckpt_path: no such checkpoint"),
    "ckpt_path a folder": (SFT, lambda t: [f"--ckpt_path={t}"], "ckpt_path: {t} is not a checkpoint (a folder without the parts of a sharded checkpoint)"),
    "ckpt_path corrupt": (SFT, lambda t: ["--ckpt_path=" + data_file(t, "bad.ckpt", b"PK not a zip")], "ckpt_path: {t}/bad.ckpt is incomplete (unreadable"),
    "ckpt_path of another task": (SFT, lambda t: ["--trainer.max_steps=2", "--ckpt_path=" + checkpoint(t / "grpo.ckpt", {"policy.model.norm.weight": torch.ones(128)})],
                                  "ckpt_path: {t}/grpo.ckpt holds another module's weights"),
    "ckpt_path of another lora layout": (SFT_LORA, lambda t: ["--trainer.max_steps=2", "--model.lora.r=8", "--ckpt_path=" + lora_checkpoint(t / "r16.ckpt", 16)],
                                         "ckpt_path: {t}/r16.ckpt holds another module's weights (28 of another shape"),
    "data not UTF-8": (SFT, lambda t: ["--data.train_data=" + data_file(t, "d.jsonl", GOOD + GOOD + b'{"prompt": "caf\xe9"}')],
                       "{t}/d.jsonl: line 3: not valid UTF-8"),
    "data a corrupt Parquet file": (SFT, lambda t: ["--data.train_data=" + data_file(t, "d.parquet", b"PAR1 truncated")], "{t}/d.parquet: cannot be read"),
    "data a corrupt JSON file": (SFT, lambda t: ["--data.train_data=" + data_file(t, "d.json", b"[" + GOOD + b"," + GOOD)], "{t}/d.json: line 3: invalid JSON"),
    "data row named by its line": (SFT, lambda t: ["--data.train_data=" + data_file(t, "d.jsonl", GOOD + b"\n" + EMPTY_TURN)],
                                   "{t}/d.jsonl: line 3: `messages[1]`: the assistant turn is empty"),
    "reward module with a syntax error": (GRPO, lambda t: ['--model.rewards=[{"function": "broken_reward:score"}]'], "reward function 'broken_reward:score': {t}/broken_reward.py:1: "),
    "reward given by its name alone": (GRPO, lambda t: ["--model.rewards+=format"],
                                       "command line: model.rewards: each reward is a block (function, weight, kwargs), got format: write {{function: format}}"),
    "reward given by a dotted path alone": (GRPO, lambda t: ["--model.rewards=[support.grpo:text_length]"],
                                            "command line: model.rewards: each reward is a block (function, weight, kwargs), got support.grpo:text_length"),
}


def run(capsys, recipe: str, overrides: list[str], out: Path) -> tuple[int, str]:
    fast = SHORT_GRPO if "task: grpo" in Path(recipe).read_text() else SHORT_SFT
    code = cli.main(["run", recipe, *fast, f"--output_dir={out}", *overrides])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case", list(MISTAKES))
def test_a_mistake_is_one_error_line_naming_it(case, tmp_path, capsys, caplog, monkeypatch):
    recipe, overrides, expected = MISTAKES[case]
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "broken_reward.py").write_text("def score(completions:\n    return [0.0]\n")
    recipe = recipe(tmp_path) if callable(recipe) else recipe
    out = tmp_path / "out"
    started = time.monotonic()
    code, err = run(capsys, recipe, overrides(tmp_path), out)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith("error: " + expected.format(t=tmp_path, r=recipe, cwd=os.getcwd())), lines[0]
    assert "Traceback" not in err
    # No line of Lightning's before the error, and no process started (each would say it again).
    assert not [r for r in caplog.records if r.getMessage().startswith(("Seed set", "Initializing distributed"))]
    assert not out.exists()  # no lock, no logger folder, no recipe.yaml
    assert time.monotonic() - started < 30  # a hub id is looked up once, not retried for a minute


def test_the_negative_control_gets_past_every_check(tmp_path, capsys):
    """The tiny recipe with none of the mistakes above trains its step: the checks refuse mistakes only."""
    code, err = run(capsys, SFT_LORA, [f"--data.train_data={data_file(tmp_path, 'd.jsonl', GOOD * 4)}", "--model.lora.target_modules=q_proj"], tmp_path / "out")
    assert code == 0, err[-3000:]
    assert (tmp_path / "out" / "summary.json").exists()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
@pytest.mark.parametrize("engine", ["vllm", "VLLMEngine"])
def test_a_vllm_engine_without_vllm_is_one_line_before_any_model_loads(engine, tmp_path, capsys):
    code, err = run(capsys, GRPO, [f"--model.engine={engine}", "--model.model_name_or_path=" + str(tmp_path / "no-model")], tmp_path / "out")
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and "Traceback" not in err and not (tmp_path / "out").exists()
    # Refused ahead of the model folder the run would load first.
    assert lines == ["error: model.engine: VLLMEngine needs vLLM, which is not installed in this Python environment "
                     "(pip install 'lightning-rl[vllm]'; on a CPU, `make vllm-venv`)"]  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_cuda_engine_on_a_machine_without_cuda_is_one_line(tmp_path, capsys):
    code, err = run(capsys, GRPO, ["--model.engine=HFRolloutEngine", "--model.engine.init_args.device=cuda"], tmp_path / "out")
    assert code == 2 and "Traceback" not in err and not (tmp_path / "out").exists()
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: model.engine.init_args.device: 'cuda', but this machine has no cuda device (cuda is not available to torch)"
    ]


def test_a_reward_failing_on_every_sample_is_one_line_naming_the_reward(tmp_path, capsys):
    code, err = run(capsys, GRPO, ['--model.rewards=[{"function": "test_user_errors:always_raises"}]'], tmp_path / "out")
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith("error: model.rewards: step 1: reward 'always_raises' failed on all 2 samples, first: KeyError: 'score'")
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--nodes", "0"], "--nodes must be >= 1, got 0"),
        (["--gpu-memory-gb", "nan"], "--gpu-memory-gb must be a finite number > 0, got nan"),
        (["--gpu-memory-gb", "0"], "--gpu-memory-gb must be > 0, got 0.0"),
        (["--mfu", "0"], "--mfu must be > 0, got 0.0"),
        (["--peak-tflops", "inf"], "--peak-tflops must be a finite number > 0, got inf"),
        (["--network-gbps", "nan"], "--network-gbps must be a finite number > 0, got nan"),
        (["--gpus-per-node", "x"], "argument --gpus-per-node: invalid int value: 'x'"),
    ],
)
def test_plan_refuses_a_zero_or_non_finite_figure_in_one_line(flags, expected, capsys):
    base = {"--nodes": "8", "--gpus-per-node": "8", "--gpu-memory-gb": "80"}
    base.update(dict(zip(flags[::2], flags[1::2])))
    assert cli.main(["plan", MUSE, *[part for item in base.items() for part in item]]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"error: {expected}"] and captured.out == ""


def test_rows_of_prompts_are_named_by_their_line(tmp_path, capsys):
    prompts = data_file(tmp_path, "p.jsonl", b'{"prompt": "1+1=", "answer": "2"}\n\n{"question": "2+2="}\n')
    code, err = run(capsys, GRPO, [f"--data.path={prompts}"], tmp_path / "out")
    assert code == 2 and f"error: {prompts}: line 3: no field 'prompt' (row has ['question'])" in err.splitlines()



def test_a_model_tree_packing_cannot_compute_exactly_is_one_line(tmp_path, capsys, monkeypatch):
    from lightning_rl.attention import tree_attention
    from support.trees import leaky_beyond

    monkeypatch.setattr(tree_attention, "attend_tree", leaky_beyond(0))  # attention that leaks across packed sequences
    code, err = run(capsys, SFT, ["--data.train_data=" + data_file(tmp_path, "d.jsonl", GOOD * 4)], tmp_path / "out")
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith("error: Qwen3ForCausalLM: the packing self-check measured packed log-probs") and "Traceback" not in err


def test_a_sharded_checkpoint_of_another_lora_layout_is_one_line(tmp_path):
    """Two FSDP2 ranks save a sharded checkpoint of full fine-tuning; resuming it with LoRA is one line, said once."""
    import os
    import subprocess
    import sys

    from lightning_rl.rollout.vllm_server_process import free_port

    def lightning_rl_run(*extra: str) -> subprocess.CompletedProcess:
        cmd = [str(Path(sys.executable).parent / "lightning-rl"), "run", SFT, f"--output_dir={tmp_path / 'run'}", *SHORT_SFT,
               "--checkpoint_every_n_steps=1", "--trainer.devices=2", "--trainer.strategy=fsdp2", "--logger.kind=none", *extra]  # fmt: skip
        env = {**os.environ, "MASTER_PORT": str(free_port())}
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)

    assert lightning_rl_run().returncode == 0
    resumed = lightning_rl_run("--trainer.max_steps=2", "--ckpt_path=last", "--model.lora={r: 4, alpha: 8, target_modules: [q_proj]}")
    errors = [line for line in resumed.stderr.splitlines() if line.startswith("error:")]
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    assert errors[0].startswith("error: ckpt_path: ") and "does not fit this recipe's model (Missing key" in errors[0]


def test_a_model_that_is_no_causal_lm_is_refused_in_one_line():
    """An encoder-decoder (T5) or encoder-only (BERT without is_decoder) config fell through to the image-text class
    and crashed deep in transformers; it is named, with why."""
    from transformers import BertConfig, T5Config

    from lightning_rl.errors import RecipeError
    from lightning_rl.models.structure import auto_model_class

    with pytest.raises(RecipeError, match=r"^T5ForConditionalGeneration \(t5\) is not a causal language model") as caught:
        auto_model_class(T5Config(architectures=["T5ForConditionalGeneration"]))
    assert caught.value.key == "model_name_or_path"
    assert auto_model_class(BertConfig()).__name__ == "AutoModelForCausalLM"  # BertLMHeadModel: a decoder when asked


@pytest.mark.parametrize("text,why", [('{"model_type": "no-such-model"}', "`no-such-model`"), ("{broken", "not a valid JSON file")])
def test_a_model_config_transformers_cannot_read_is_one_line_in_run_and_plan(tmp_path, capsys, text, why):
    from lightning_rl.errors import RecipeError
    from lightning_rl.models.paths import check_model_source
    from lightning_rl.planner import plan

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(text)
    with pytest.raises(RecipeError, match=rf"^model_name_or_path: {tmp_path / 'model'}/config.json cannot be read by transformers \(.*{why}"):
        check_model_source(str(tmp_path / "model"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("task: sft\nmodel: {model_name_or_path: tiny}\ndata: {train_data: rows.jsonl, max_tokens: 256}\n")
    assert plan.main([str(recipe), "--nodes", "1", "--gpus-per-node", "1", "--gpu-memory-gb", "80", "--model-config", str(tmp_path / "model")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: --model-config {tmp_path / 'model'}: ") and why in line


def test_a_model_folder_the_run_cannot_load_is_one_line_before_the_run_writes(tmp_path, tiny_path, capsys):
    """A folder without weights, or without a tokenizer, ended in transformers' traceback (naming sentencepiece); a
    tokenizer with more ids than the model's embedding has rows crashed in the first forward, leaving the run folder."""
    import shutil

    cases = {
        "no weights": ("model.safetensors", r"holds no weights \(no \*.safetensors or pytorch_model\*.bin\)"),
        "no tokenizer": ("tokenizer.json", r"holds no tokenizer \(no tokenizer.json, tokenizer_config.json"),
        "tokenizer past the embedding": (None, ""),  # the line names the model's vocab_size (below)
    }
    for name, (removed, message) in cases.items():
        folder = tmp_path / name.replace(" ", "_")
        shutil.copytree(tiny_path, folder)
        if removed:
            for file in [folder / removed, *([folder / "tokenizer_config.json"] if removed == "tokenizer.json" else [])]:
                file.unlink()
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(folder)
            rows = json.loads((folder / "config.json").read_text())["vocab_size"]
            tokenizer.add_tokens([f"<extra_{k}>" for k in range(rows + 8 - len(tokenizer))])
            tokenizer.save_pretrained(folder)
            message = rf"its tokenizer has {rows + 8} tokens, but the model's embedding {rows} rows"
        for task, recipe in (("sft", SFT), ("grpo", GRPO)):
            out = tmp_path / f"{task}-{folder.name}"
            assert cli.main(["run", recipe, f"--output_dir={out}", f"--model.model_name_or_path={folder}"]) == 2, name
            (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
            assert re.match(rf"error: model.model_name_or_path: {re.escape(str(folder))}:? {message}", line), (name, line)
            assert not out.exists()  # refused before the run wrote anything


@pytest.mark.parametrize("module, key, value", [
    ("grpo", "scale_rewards", False),  # TRL's Dr. GRPO spelling: failed at the first step, deep in the advantages
    ("grpo", "reward_aggregation", "normalise_then_sum"),  # was trained as sum_then_normalize
    ("grpo", "weight_sync", "delt"), ("sft", "towers", "froze"), ("sft", "lr_schedule", True), ("data", "packing", "tre"),
])  # fmt: skip
def test_a_named_choice_given_from_python_is_one_of_its_names(module, key, value):
    """The recipe's parser refuses a value its annotation does not list; a module built from Python refuses it alike."""
    from lightning_rl.data.sft import SFTDataModule
    from lightning_rl.errors import RecipeError
    from lightning_rl.modules.grpo import GRPOModule
    from lightning_rl.modules.sft import SFTModule

    build = {"grpo": GRPOModule, "sft": SFTModule, "data": lambda **kw: SFTDataModule(str(TOY_TRAIN), **kw)}[module]
    trl = re.escape(" (TRL's True is group, its False none)") if key == "scale_rewards" else ""  # said in TRL's terms too
    with pytest.raises(RecipeError, match=rf"^{key} must be one of .*, got {re.escape(repr(value))}{trl}$") as refused:
        build(**{key: value})
    assert refused.value.key == key
    build(**{key: {"scale_rewards": "none", "reward_aggregation": "normalize_then_sum", "weight_sync": "auto", "towers": "frozen",
                   "lr_schedule": "cosine", "packing": "tree"}[key]})  # a listed name passes
