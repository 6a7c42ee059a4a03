"""What a Hugging Face checkpoint of a given config holds: tensor names, shapes and ties.

Engines check pushed tensors against it before loading anything (a wrong name or shape is refused
with its name, not discovered half-way through a reload), and re-expand tied weights: trainers send
a tied tensor once, under its source name, but vLLM's in-place reload restores the old values of
any module that received nothing, so a tied output embedding must be sent again under its own name.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator

import torch
from transformers import PretrainedConfig

from lightning_rl.models.structure import auto_model_class


class WeightNameError(ValueError):
    """A pushed tensor has a name or shape the engine's model does not have."""


class CheckpointLayout:
    """Names, shapes and tied names of the checkpoint `config` describes (read off a meta-device model)."""

    def __init__(self, config: PretrainedConfig) -> None:
        with torch.device("meta"):
            model = auto_model_class(config).from_config(config)
        self.architecture = type(model).__name__
        self.shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
        self.aliases: dict[str, list[str]] = {}
        for target, source in model.get_expanded_tied_weights_keys(all_submodels=True).items():
            self.aliases.setdefault(source, []).append(target)

    def check(self, name: str, tensor: torch.Tensor) -> None:
        expected = self.shapes.get(name)
        if expected is None:
            example = next(iter(self.shapes), "")
            raise WeightNameError(f"'{name}' is not a tensor of {self.architecture} (its names look like '{example}')")
        if tuple(tensor.shape) != expected:
            raise WeightNameError(f"'{name}': shape {tuple(tensor.shape)} sent, {self.architecture} holds {expected}")

    def checked_with_ties(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], sent: set[str] | None = None,
        held_aliases: Container[str] | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Check each pair, yield it, then the same tensor under each name tied to it; names in `sent` are skipped.
        ``held_aliases``: the tied names the receiving model holds a tensor of its own under (vLLM's `held_aliases`);
        the others are not sent, since that model ties them itself or has no such tensor (vLLM's Gemma computes
        its logits with the embedding and loads no ``lm_head``). None: every tied name.

        Pass one `sent` set to consecutive calls that stream parts of the same update.
        """
        sent = set() if sent is None else sent
        for name, tensor in named_tensors:
            self.check(name, tensor)
            aliases = [a for a in self.aliases.get(name, ()) if held_aliases is None or a in held_aliases]
            for out_name in [name, *aliases]:
                if out_name not in sent:
                    sent.add(out_name)
                    yield out_name, tensor
