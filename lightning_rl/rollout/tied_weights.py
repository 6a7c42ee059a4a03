"""Re-expand tied weights for engines that load every module on its own.

Trainers send a tied tensor once (`named_parameters()` lists it under its source name only). vLLM's
in-place reload restores, for any module that received nothing, the values it held before the reload,
so a tied output embedding would keep serving the old weights. Sending the tensor again under each
tied name fixes that; transformers says which names are tied.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig


def tied_aliases(config: PretrainedConfig) -> dict[str, list[str]]:
    """`{source name: [names tied to it]}` for the causal LM that `config` describes (built on the meta device)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    aliases: dict[str, list[str]] = {}
    for target, source in model.get_expanded_tied_weights_keys(all_submodels=True).items():
        aliases.setdefault(source, []).append(target)
    return aliases


def with_tied_copies(
    named_tensors: Iterable[tuple[str, torch.Tensor]], aliases: dict[str, list[str]], sent: set[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield each pair, then the same tensor under every name tied to it; a name already in `sent` is skipped.

    Pass the same `sent` set to consecutive calls that stream parts of one update.
    """
    sent = set() if sent is None else sent
    for name, tensor in named_tensors:
        for out_name in [name, *aliases.get(name, ())]:
            if out_name not in sent:
                sent.add(out_name)
                yield out_name, tensor
