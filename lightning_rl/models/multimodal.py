"""What packing needs to know about an image-text model: its image placeholder token and its own position rule."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor


def image_token_id(config: Any) -> int | None:
    """The token the model's processor repeats where an image's features go (None: a text-only model)."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def transformers_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (LoRA), whose class and methods say how it treats images; a
    model without one as it is."""
    return model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model


def _position_rule_owner(model: nn.Module) -> nn.Module | None:
    model = transformers_model(model)
    return next((m for m in (model, getattr(model, "model", None)) if m is not None and hasattr(m, "get_rope_index")), None)


def uses_multi_axis_positions(model: nn.Module) -> bool:
    """Whether the model places image tokens on rotary positions of several axes (Qwen-VL style)."""
    return _position_rule_owner(model) is not None


@functools.cache
def image_block_rule(cls: type) -> str | None:
    """How a transformers model class groups tokens into blocks that attend to each other both ways: ``"runs"`` (the
    Gemma family's ``get_block_sequence_ids_for_mask``: each run of image tokens is one block), ``"other"`` (it builds
    ``block_sequence_ids`` by a rule of its own: all images as one block, a fixed prefix, ...), or None (causal)."""
    rule = None
    for klass in cls.__mro__:
        module = sys.modules.get(klass.__module__)
        if module is None or not module.__name__.startswith("transformers.models."):
            continue
        if callable(getattr(module, "get_block_sequence_ids_for_mask", None)):
            return "runs"
        try:
            if "block_sequence_ids" in inspect.getsource(module):
                rule = "other"
        except (OSError, TypeError):
            continue
    return rule


def attends_within_images_both_ways(model: nn.Module) -> bool:
    """Whether each image's tokens attend to each other both ways, one block per run of them (Gemma 3 and 4), as
    transformers builds those masks from the token types the model's processor passes (1 on image tokens)."""
    return image_block_rule(type(transformers_model(model))) == "runs"


_TOKEN_TYPE_INPUTS = ("token_type_ids", "mm_token_type_ids")


def image_token_types(model: nn.Module, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The token-type input, as the model's processor makes it (1 on image tokens), for ``input_ids`` [batch, T]:
    what a model builds its both-ways image masks from (Gemma 3), or finds its image tokens by to put them on
    multi-axis positions (Qwen-VL); {} for a model without them. Given to the model's own forward and generation (the
    unpacked reference, the transformers engine, held-out decoding), it computes as it was trained to: without it a
    Qwen-VL generation put image tokens on 1-D positions."""
    token = image_token_id(model.config)
    if token is None or not (attends_within_images_both_ways(model) or uses_multi_axis_positions(model)):
        return {}
    forward = inspect.signature(type(transformers_model(model)).forward).parameters
    name = next((n for n in _TOKEN_TYPE_INPUTS if n in forward), None)
    return {name: (input_ids == token).long()} if name is not None else {}


def rope_positions(model: nn.Module, input_ids: Sequence[int], image_inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """A sequence's multi-axis rotary positions [axes, len] by the model's own rule (Qwen-VL style: image tokens
    on a (time, height, width) grid), or None for a model whose positions are the plain 1-D ones."""
    owner = _position_rule_owner(model)
    if owner is None:
        return None
    ids = torch.as_tensor(list(input_ids), dtype=torch.long)[None]
    token = image_token_id(model.config)
    kinds = (ids == token).int() if token is not None else torch.zeros_like(ids, dtype=torch.int)
    grid = image_inputs.get("image_grid_thw")
    positions, _ = owner.get_rope_index(ids, mm_token_type_ids=kinds, image_grid_thw=grid if grid is not None and len(grid) else None)
    return positions[:, 0]


# What a saved processor leaves in a model folder (one of them at least).
_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def load_processor(path: str) -> tuple[Any, int | None]:
    """The model's processor and image token, for an image-text model (one whose config names an image token and
    whose folder holds a processor); (None, None) for a text-only one, or one saved without its processor."""
    token = image_token_id(AutoConfig.from_pretrained(path))
    if token is None:
        return None, None
    folder = Path(path)
    if folder.is_dir() and not any((folder / name).is_file() for name in _PROCESSOR_FILES):
        return None, None  # a checkpoint saved without its processor: it trains on text only
    return AutoProcessor.from_pretrained(path), token


_MEDIA_WORDS = ("image", "video", "audio", "vision", "boi", "eoi", "boa", "eoa", "media")


def multimodal_token_ids(config: Any) -> tuple[int, ...]:
    """The ids of a model's multimodal special tokens (image, video and audio placeholders, vision start and end
    markers): tokens a processor writes and the model must never sample."""
    ids: set[int] = set()
    for cfg in {id(c): c for c in (config, config.get_text_config())}.values():
        for key, value in cfg.to_dict().items():
            if key.endswith(("_token_id", "_token_index", "_token_ids")) and any(word in key for word in _MEDIA_WORDS):
                ids.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    vocab = int(getattr(config.get_text_config(), "vocab_size", 0) or 0)
    return tuple(sorted(i for i in ids if 0 <= i < vocab))


def processor_token_ids(processor: Any, tokenizer: Any) -> tuple[int, ...]:
    """The ids of the multimodal tokens an image-text model's processor writes besides those its config names
    (Idefics3's ``<fake_token_around_image>`` and ``<global-img>``, ...): its string attributes named ``*_token`` or
    ``*_tag`` with a media word, each a single token of the vocabulary."""
    ids: set[int] = set()
    for owner in (processor, getattr(processor, "tokenizer", None)):
        for name, value in (vars(owner).items() if owner is not None else ()):
            if name.endswith(("_token", "_tag")) and isinstance(value, str) and any(word in name for word in _MEDIA_WORDS):
                token = tokenizer.convert_tokens_to_ids(value)
                if isinstance(token, int) and token != tokenizer.unk_token_id:
                    ids.add(token)
    return tuple(sorted(ids))


def position_rule(path: str) -> Callable[[Sequence[int], dict[str, torch.Tensor]], torch.Tensor] | None:
    """``rope_positions`` of the model at ``path`` without its weights (the model built on the meta device: its rule
    reads only the config and the tokens), for data code that packs rows before any model is loaded; None for a
    model with plain 1-D positions."""
    config = AutoConfig.from_pretrained(path)
    if image_token_id(config) is None:
        return None
    with torch.device("meta"):
        skeleton = AutoModelForImageTextToText.from_config(config)
    if not uses_multi_axis_positions(skeleton):
        return None
    return lambda input_ids, image_inputs: rope_positions(skeleton, input_ids, image_inputs)
