"""The embedded default model: a tiny Qwen3-style decoder and a byte-level BPE tokenizer.

Nothing comes from a model hub. The tokenizer is trained here from the bundled toy data, the
model is a transformers config with seeded random weights, and both are written with
``save_pretrained`` so every caller loads them through the real ``from_pretrained`` path.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast, Qwen3Config, Qwen3MoeConfig,
)

from lightning_rl.toy.task import PROBLEMS_FILE, read_jsonl

TINY_NAME = "tiny"
# Bump when the config, template or tokenizer recipe changes so cached builds are rebuilt.
TINY_VERSION = 2
TINY_MOE_NAME = "tiny-moe"
TINY_MOE_VERSION = 1
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, "<|im_start|>", EOS_TOKEN, "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# Qwen-style chat template. `{% generation %}` marks what the assistant says (content, tool calls
# and the closing <|im_end|>), which is what `return_assistant_tokens_mask=True` reports.
CHAT_TEMPLATE = (
    "{%- if messages and messages[0].role == 'system' %}{% set system = messages[0].content %}"
    "{% set rest = messages[1:] %}{% else %}{% set rest = messages %}{% endif %}"
    "{%- if tools %}"
    "{{ '<|im_start|>system\\n' }}{% if system is defined %}{{ system + '\\n\\n' }}{% endif %}"
    "{{ 'You may call these tools:\\n' }}{% for tool in tools %}{{ tool | tojson + '\\n' }}{% endfor %}"
    "{{ 'Call one as <tool_call>{\"name\": NAME, \"arguments\": {...}}</tool_call>.<|im_end|>\\n' }}"
    "{%- elif system is defined %}{{ '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}{% endif %}"
    "{%- for message in rest %}"
    "{%- if message.role == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}"
    "{% set fn = call.function if call.function is defined else call %}"
    "{{ '<tool_call>{\"name\": ' + fn.name | tojson + ', \"arguments\": ' }}"
    "{%- if fn.arguments is string %}{{ fn.arguments }}{% else %}{{ fn.arguments | tojson }}{% endif %}"
    "{{ '}</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{ '<|im_start|>tool\\n<tool_response>' + message.content + '</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _training_text() -> list[str]:
    # Role names and tool-call markup repeated so BPE learns them as whole tokens.
    texts = ["system\nuser\nassistant\ntool\n" * 50, '{"name": "calculator", "arguments": {"expression": "1+2"}}' * 50]
    for row in read_jsonl(PROBLEMS_FILE):
        texts.extend(m["content"] for m in row["messages"])
    return texts


def build_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on the bundled data; digits always stay single tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(vocab_size: int) -> Qwen3Config:
    """Small enough to train in minutes on two CPU cores; head_dim 64 because vLLM refuses 16."""
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        eos_token_id=None,
        pad_token_id=None,
        bos_token_id=None,
    )


def tiny_moe_config(vocab_size: int) -> Qwen3MoeConfig:
    """The tiny model's shape with routed experts in every layer (Qwen3-MoE: softmax, top 2 of 4, normalised)."""
    dense = tiny_config(vocab_size).to_dict()
    shape = {key: dense[key] for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                          "head_dim", "max_position_embeddings", "tie_word_embeddings")}  # fmt: skip
    return Qwen3MoeConfig(
        **shape, intermediate_size=384, moe_intermediate_size=96, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, eos_token_id=None, pad_token_id=None, bos_token_id=None,
    )


def seeded_model(auto_class: type, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> PreTrainedModel:
    """A model of ``config`` with random weights drawn from ``seed`` (the global generator left as it was), whose
    generation config ends and pads with the tokenizer's tokens."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto_class.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def build_tiny(path: str | os.PathLike, seed: int = 0) -> Path:
    """Write the tiny model and its tokenizer to ``path`` (a from_pretrained-loadable folder)."""
    return _build_with_tokenizer(path, tiny_config, seed)


def build_tiny_moe(path: str | os.PathLike, seed: int = 0) -> Path:
    """Write the tiny mixture-of-experts model and the tiny model's tokenizer to ``path``."""
    return _build_with_tokenizer(path, tiny_moe_config, seed)


def _build_with_tokenizer(path: str | os.PathLike, config_of: Callable[..., Any], seed: int) -> Path:
    """A model of ``config_of(vocab_size=...)`` with random weights from ``seed``, and the tiny tokenizer, in ``path``."""
    path = Path(path)
    tokenizer = build_tokenizer()
    config = config_of(vocab_size=len(tokenizer))
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    save_from_any_process(seeded_model(AutoModelForCausalLM, config, tokenizer, seed), path)
    tokenizer.save_pretrained(path)
    return path


def save_from_any_process(model: PreTrainedModel, path: Path) -> None:
    """``model.save_pretrained(path)``, written whole by whichever process calls it. transformers writes the config
    and weights only on rank 0 of an initialized process group; a cached model is built by whichever rank of a job
    takes the lock first (and on every machine of a multi-machine job), so that rule would leave a folder of
    tokenizer files alone."""
    model.should_save_on_this_rank = lambda is_main_process: True  # this instance only
    try:
        model.save_pretrained(path)
    finally:
        del model.should_save_on_this_rank


def default_cache_dir() -> Path:
    return Path(os.environ.get("LIGHTNING_RL_CACHE", Path.home() / ".cache" / "lightning_rl"))


def cached_build(target: Path, marker: str, build: Callable[[Path], object]) -> Path:
    """``target``, a folder of the cache, built by ``build(folder)`` on first use: into a temporary folder beside it,
    then renamed, so no reader ever sees half of it. ``marker`` is a file the complete folder holds. Processes that
    want it at once (the ranks of a job on one machine) take turns on a lock beside it: one builds, the rest find it
    built."""
    if (target / marker).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / marker).exists():  # built by the process that held the lock before
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            build(staging)
            if not (staging / marker).exists():
                raise RuntimeError(f"building {target.name} into {staging} wrote no {marker}")
            if target.exists():  # a folder left by an interrupted build, without its marker
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def tiny_model_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached tiny model folder, built on first use."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return cached_build(cache / f"tiny-v{TINY_VERSION}", "config.json", build_tiny)


def tiny_moe_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached tiny mixture-of-experts model folder, built on first use."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return cached_build(cache / f"tiny-moe-v{TINY_MOE_VERSION}", "config.json", build_tiny_moe)
