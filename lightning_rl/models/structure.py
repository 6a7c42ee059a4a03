"""Where things are inside a transformers model: its roots (a policy, a reference model, peft wrappers) and its
decoder layers, found through each model's own ``_no_split_modules``."""

from __future__ import annotations

from collections.abc import Collection

from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig

from lightning_rl.errors import RecipeError
from lightning_rl.models.routing import checkpoint_contexts


def auto_model_class(config: PretrainedConfig) -> type:
    """The auto class a checkpoint of ``config`` loads with: its causal-LM class, else its image-text-to-text class
    (image-text models, Muse Spark Open), which is a causal LM over text when given only ``input_ids``."""
    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        if type(config) in auto._model_mapping:
            return auto
    names = ", ".join(getattr(config, "architectures", None) or [type(config).__name__])
    raise RecipeError(f"{names} ({config.model_type}) is not a causal language model: transformers has no causal-LM or "
                      "image-text-to-text class for it (an encoder-decoder or encoder-only model cannot be trained here)", "model_name_or_path")


def is_model_root(module: nn.Module) -> bool:
    """A transformers (or peft-wrapped) model: the unit whose ``forward`` a training step calls."""
    return hasattr(module, "_no_split_modules") and hasattr(module, "config")


def find_model_roots(module: nn.Module) -> list[nn.Module]:
    """The outermost transformers/peft models inside ``module`` (a policy, a reference model, ...)."""
    roots: list[nn.Module] = []

    def visit(node: nn.Module) -> None:
        for child in node.children():
            if is_model_root(child):
                roots.append(child)
            else:
                visit(child)

    if is_model_root(module):
        return [module]
    visit(module)
    return roots


def find_decoder_layers(module: nn.Module, layer_classes: Collection[str] | None = None) -> list[nn.Module]:
    """The repeated blocks of ``module``: ``layer_classes`` by class name, else the models' ``_no_split_modules``."""
    names = set(layer_classes or ())
    if not names:
        for sub in module.modules():
            names.update(getattr(sub, "_no_split_modules", None) or ())
    return [sub for sub in module.modules() if type(sub).__name__ in names]


def compile_decoder_layers(model: nn.Module) -> int:
    """``torch.compile`` each decoder layer in place (the module stays itself, so hooks, peft, FSDP and the LM-head
    read keep working); the tree attention inside stays eager, since a row's plan is data, not a graph. Returns
    the number of layers compiled."""
    layers = find_decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layers to compile (no _no_split_modules)")
    for layer in layers:
        layer.compile()
    return len(layers)


def enable_activation_checkpointing(model: nn.Module, **checkpoint_kwargs) -> None:
    """Recompute each decoder layer in backward. transformers 5.20 renamed ``gradient_checkpointing_enable`` to
    ``activation_checkpointing_enable``; the versions we support (5.16 on) have one or the other."""
    if not checkpoint_kwargs.get("use_reentrant", False):  # a layer recomputed in backward replays the routes it forced
        checkpoint_kwargs = {"use_reentrant": False, "context_fn": checkpoint_contexts, **checkpoint_kwargs}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=checkpoint_kwargs or None)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs or None)
