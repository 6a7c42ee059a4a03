"""A reward given by a trained reward model: a ``from_pretrained`` sequence-classification model with one output.

Each completion is scored as the reward model's own tokenizer and chat template present it: the prompt's messages
(as the policy saw them, `prompt_messages`) followed by the completion's (a conversational prompt's, with its tool
calls and results, as TRL renders them), or a text completion as the assistant's reply. A reward model without a chat
template reads a string prompt as TRL does: the prompt as written (the user turn of `prompt_messages`) followed by the
completion, joined with nothing; a conversational prompt has no text without a template, and stops the run in one line
(TRL raises there too). Batches of ``batch_size`` go through the model on the trainer's device (``to``), without
gradients.

A folder that is not a one-label sequence-classification checkpoint (a causal LM's, whose score head would be newly
initialized, random), a tokenizer that cannot pad a batch, and a ``max_length`` that is not a positive integer are
refused when the reward is built, before training.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from lightning_rl.errors import RecipeError
from lightning_rl.models.paths import model_context, resolve_model_path


class RewardModel:
    """The built-in reward ``reward_model``: ``kwargs: {path: FOLDER_OR_HUB_ID, batch_size: 16, max_length: null}``.

    Args:
        path: the reward model: a sequence-classification checkpoint whose config has ``num_labels: 1`` (one score per
            sequence) and whose folder holds every weight, its score head included. Its chat template renders what
            it reads; without one it reads a string prompt and its completion joined, as TRL does, and refuses a
            conversational prompt.
        batch_size: sequences per forward.
        max_length: longer texts are cut from the left (the completion is kept); None: the model's limit (its
            positions, ``model_context``), where its config gives one.
    """

    def __init__(self, path: str, batch_size: int = 16, max_length: int | None = None) -> None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if max_length is not None and (not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1):
            raise ValueError(f"max_length must be an integer >= 1 or null, got {max_length!r}")
        self.path = path
        folder = resolve_model_path(path, key="path")
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        if self.tokenizer.pad_token_id is None and self.tokenizer.eos_token_id is None:
            raise ValueError(f"reward model {path}: its tokenizer has neither a pad token nor an eos token to pad a batch with")
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # What the config says is refused before the weights are loaded: a causal LM's folder loads as a classifier
        # whose score head is newly initialized (random), which transformers only warns about.
        config = AutoConfig.from_pretrained(folder)
        if (architectures := config.architectures or []) and not any(a.endswith("ForSequenceClassification") for a in architectures):
            raise ValueError(f"reward model {path}: it is not a sequence-classification checkpoint (its config's architectures: "
                             f"{', '.join(architectures)}); a reward model is one with 1 label")
        if config.num_labels != 1:
            raise ValueError(f"reward model {path}: it has {config.num_labels} labels; a reward model has 1")
        self.model, loaded = AutoModelForSequenceClassification.from_pretrained(folder, output_loading_info=True)
        if missing := sorted(loaded["missing_keys"]):
            raise ValueError(f"reward model {path}: its checkpoint lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                             f"({len(missing)} weights), which would be newly initialized (random): a reward model's folder holds them all")
        self.model.eval().requires_grad_(False)
        # Where each row's last real token is found: the head reads the text config's (Gemma 3's is nested). Rows are
        # padded on the right whatever the tokenizer's side, as TRL pads them: padded on the left, a model of learned
        # positions (GPT-2's) read a row at other positions, and its score changed with the batch it came in.
        for config in {id(c): c for c in (self.model.config, self.model.config.get_text_config())}.values():
            config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.padding_side, self.tokenizer.truncation_side = "right", "left"
        self.batch_size = batch_size
        self.max_length = max_length if max_length is not None else model_context(self.model.config)

    def to(self, device: torch.device | str) -> RewardModel:
        self.model.to(device)
        return self

    def texts(self, prompt_messages: Sequence[Sequence[dict[str, Any]]], completions: Sequence[Any]) -> list[str]:
        """What the reward model reads for each completion, rendered by its chat template: the prompt's messages, then
        the completion's (its tool calls and the tools' results too, as TRL renders them), or a text completion as the
        assistant's reply. Without a template, as TRL reads it: a text completion (a string prompt's) after the prompt
        as written, the user turn of ``prompt_messages``; a conversational one is a `RecipeError`, which stops the
        run."""
        out = []
        for messages, completion in zip(prompt_messages, completions, strict=True):
            conversational = isinstance(completion, (list, tuple))
            if self.tokenizer.chat_template is not None:
                reply = list(completion) if conversational else [{"role": "assistant", "content": completion}]
                out.append(self.tokenizer.apply_chat_template([*messages, *reply], tokenize=False))
            elif conversational:
                raise RecipeError(f"reward model {self.path}: its tokenizer has no chat template to render a conversational prompt "
                                  "with: give a reward model with a chat template, or string prompts", "rewards")
            else:
                out.append(f"{messages[-1]['content']}{completion}")
        return out

    @torch.no_grad()
    def __call__(self, prompt_messages: Sequence[Sequence[dict[str, Any]]], completions: Sequence[Any]) -> list[float]:
        texts = self.texts(prompt_messages, completions)
        device = next(self.model.parameters()).device
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                texts[start : start + self.batch_size], return_tensors="pt", padding=True, add_special_tokens=False,
                truncation=self.max_length is not None, max_length=self.max_length,
            )  # fmt: skip
            logits = self.model(**batch.to(device)).logits
            scores.extend(logits[:, 0].float().tolist())
        return scores
