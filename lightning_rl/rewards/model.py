"""A reward given by a trained reward model: a ``from_pretrained`` sequence-classification model with one output.

Each completion is scored as the reward model's own tokenizer and chat template present it: the prompt's messages
(as the policy saw them, `prompt_messages`) followed by the completion's (a conversational prompt's, with its tool
calls and results, as TRL renders them), or a text completion as the assistant's reply. Batches of
``batch_size`` go through the model on the trainer's device (``to``), without gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from lightning_rl.models.paths import model_context, resolve_model_path


class RewardModel:
    """The built-in reward ``reward_model``: ``kwargs: {path: FOLDER_OR_HUB_ID, batch_size: 16, max_length: null}``.

    Args:
        path: the reward model; its config must have ``num_labels: 1`` (one score per sequence).
        batch_size: sequences per forward.
        max_length: longer texts are cut from the left (the completion is kept); None: the model's limit (its
            positions, ``model_context``), where its config gives one.
    """

    def __init__(self, path: str, batch_size: int = 16, max_length: int | None = None) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        folder = resolve_model_path(path, key="path")
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForSequenceClassification.from_pretrained(folder).eval().requires_grad_(False)
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward model {path}: it has {self.model.config.num_labels} labels; a reward model has 1")
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
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
        """What the reward model reads for each completion: the prompt's messages, then the completion's (its tool
        calls and the tools' results too, as TRL renders them), or a text completion as the assistant's reply."""
        out = []
        for messages, completion in zip(prompt_messages, completions, strict=True):
            reply = list(completion) if isinstance(completion, (list, tuple)) else [{"role": "assistant", "content": completion}]
            conversation = [*messages, *reply]
            if self.tokenizer.chat_template is not None:
                out.append(self.tokenizer.apply_chat_template(conversation, tokenize=False))
            else:  # no template: the turns' text, one after the other
                out.append("\n".join(str(m.get("content", "")) for m in conversation))
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
