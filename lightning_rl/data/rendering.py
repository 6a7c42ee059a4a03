"""Prompt rendering: what the rollout side reads of GRPO's prompt data (`PromptSource`) and the tokens (and
images) one record becomes for an engine (`PromptRenderer`). No Lightning here: the rollout side runs without it.
`lightning_rl.data.prompts.PromptDataModule` is the `PromptSource` a run reads its data file through.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from lightning_rl.data.images import ImageRenderer, check_no_image_tokens, image_key, images_of, load_images, with_image_column
from lightning_rl.data.templates import rendering_row
from lightning_rl.errors import DataError


@runtime_checkable
class PromptSource(Protocol):
    """What GRPO reads of its prompt data: the records of a step, more of them for dynamic sampling, where each
    record is (for error lines), and where a record's relative image paths start. `PromptDataModule` is one."""

    path: str  # the data, as error lines name it
    records: list[dict[str, Any]]  # every prompt record of the data

    def prompt_batch(self, index: int) -> list[dict[str, Any]]:
        """This rank's prompt records of step ``index``."""

    def extra_prompts(self, index: int, drawn: int, count: int) -> list[dict[str, Any]]:
        """``count`` more records for step ``index``'s dynamic sampling, after the ``drawn`` its earlier rounds took,
        reproducibly: new prompts, not the step's own nor an earlier round's, while the data has others."""

    def location(self, record: dict[str, Any]) -> str:
        """Where a record is in the data (``FILE: line N``), for error lines."""

    def columns(self) -> set[str]:
        """The columns any record holds (the reward functions read them; a record without one gives None)."""

    def epoch_of(self, index: int) -> float:
        """Passes over the prompts before step ``index``, fractional (the reward functions' ``trainer_state.epoch``)."""

    @property
    def image_folder(self) -> Path | None:
        """The folder relative image paths of the prompts start from (None: the working directory)."""


@dataclass(frozen=True)
class RenderedPrompt:
    """One prompt as the policy reads it: its chat messages, its tokens under the chat template, and (an image
    prompt) each image's processor inputs, the images themselves, and the template's tokens before the processor
    expanded the image placeholders."""

    messages: list[dict[str, Any]]
    ids: list[int]
    image_inputs: list[dict[str, torch.Tensor]] = field(default_factory=list)
    pictures: list[Any] = field(default_factory=list)
    template_ids: list[int] = field(default_factory=list)
    # An image prompt as the reward functions read it, as TRL gives it: every turn's content a list of parts, each
    # image part holding its opened image (an `images` column's placed in). None: ``messages`` as they are.
    with_images: list[dict[str, Any]] | None = None

    @property
    def for_rewards(self) -> list[dict[str, Any]]:
        return self.messages if self.with_images is None else self.with_images

    @property
    def keyed_images(self) -> list[tuple[str, dict[str, torch.Tensor]]]:
        """(key, processor inputs) per image: how packing shares an image between the completions of its prompt."""
        return list(zip([image_key(picture) for picture in self.pictures], self.image_inputs))


class PromptRenderer:
    """Renders prompt records with the policy's tokenizer (or, for prompts with images, its processor).

    Args:
        tokenizer: the policy's tokenizer; its chat template renders the prompt (without one, a string prompt is
            tokenized as it is, as TRL does).
        processor, image_token_id: an image-text model's processor and image token (None for a text model).
        system_prompt: put in front of string prompts.
        tools: the tools as the chat template shows them to the model (None without tools).
        model_name: the model, as the recipe names it (for the line that refuses images to a text model).
    """

    def __init__(
        self, tokenizer: Any, processor: Any = None, image_token_id: int | None = None, system_prompt: str | None = None,
        tools: list[dict[str, Any]] | None = None, model_name: str = "the model",
    ) -> None:
        self.tokenizer = tokenizer
        self.processor = processor
        self.image_token_id = image_token_id
        self.system_prompt = system_prompt
        self.tools = tools
        self.model_name = model_name

    def messages(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        """The chat messages of a record's prompt (``system_prompt`` in front of a string prompt)."""
        prompt = record["prompt"]
        if not isinstance(prompt, str):
            return list(prompt)
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": prompt}]

    def render(self, record: dict[str, Any], source: PromptSource) -> RenderedPrompt:
        """A record's prompt, rendered by the processor when it has images; a bad image or image column is a
        `DataError` naming the record's line."""
        messages = self.messages(record)
        try:  # the images of an `images` (`image`) column, placed into the prompt's turns
            placed = with_image_column({"prompt": messages, "images": record.get("images"), "image": record.get("image")})["prompt"]
        except ValueError as error:
            raise DataError(f"{source.location(record)}: {error}") from None
        context = record.get("chat_template_kwargs") or {}  # the row's variables of the template (TRL's column)
        if not (getattr(self.tokenizer, "chat_template", None) or getattr(self.processor, "chat_template", None)):
            # A base model: a string prompt is its text, as TRL takes it.
            if not isinstance(record["prompt"], str) or self.system_prompt or self.tools or context:
                what = ("a system_prompt" if self.system_prompt else "tools" if self.tools else
                        "a conversational prompt" if not isinstance(record["prompt"], str) else "chat_template_kwargs")  # fmt: skip
                raise DataError(f"{source.location(record)}: {what} needs a chat template, and the tokenizer of {self.model_name} "
                                "has none: give string prompts (tokenized as they are), or a model with a chat template")
            ids = self.tokenizer(record["prompt"])["input_ids"]
            check_no_image_tokens(list(ids), self.image_token_id, self.tokenizer)
            return RenderedPrompt(messages, list(ids))
        if not any(isinstance(m.get("content"), list) for m in placed):
            try:
                with rendering_row():
                    ids = self.tokenizer.apply_chat_template(
                        messages, tools=self.tools, add_generation_prompt=True, tokenize=True, return_dict=False, **context
                    )
                check_no_image_tokens(list(ids), self.image_token_id, self.tokenizer)
            except ValueError as error:
                raise DataError(f"{source.location(record)}: {error}") from None
            return RenderedPrompt(messages, list(ids))
        where = source.location(record)
        if self.processor is None:
            raise DataError(f"{where}: the prompt has images, but {self.model_name} is a text-only model (it has no image processor)")
        if context:  # as for SFT's rows with images
            raise DataError(f"{where}: `chat_template_kwargs` in a prompt with images: the image processor's template is not given them here")
        renderer = ImageRenderer(self.processor, self.image_token_id)
        try:
            loaded = load_images({"prompt": placed}, source.image_folder)["prompt"]
            ids, _, inputs = renderer.render(loaded, add_generation_prompt=True, tools=self.tools)
            template_ids = renderer.template_ids(loaded, add_generation_prompt=True, tools=self.tools)
        except ValueError as error:
            raise DataError(f"{where}: {error}") from None
        as_parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str) else m for m in loaded]
        return RenderedPrompt(messages, ids, list(inputs), images_of(loaded), template_ids, with_images=as_parts)
