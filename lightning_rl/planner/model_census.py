"""Parameter and activation counts of a transformers model, read from its real classes on the meta device.

Nothing is allocated: the model is built under `torch.device("meta")` from its config, so an 816B
model is counted in seconds, and every figure follows the architecture the config class defines.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from peft import LoraConfig
from transformers import PreTrainedConfig

from lightning_rl.models.loading import _check_lora_targets, outside_text_model, with_adapters
from lightning_rl.models.structure import auto_model_class

_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "moe_top_k", "moe_topk")  # the last: Aria's, which maps none
# A module of the experts together (DBRX's experts.mlp), not one expert of a list of them (experts.0).
_EXPERTS_MODULE = re.compile(r"(^|\.)experts(\.[^.\d][^.]*)+$")


def build_on_meta(config: PreTrainedConfig) -> nn.Module:
    """The model a run trains for ``config`` (its causal-LM or image-text class; any other is refused as the run
    refuses it), on the meta device."""
    auto = auto_model_class(config)
    with torch.device("meta"):
        return auto.from_config(config)


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    return re.compile(r"(^|\.)" + re.escape(pattern).replace(r"\*", r"\d+") + r"$")


@dataclass(frozen=True)
class LayerCensus:
    """One shard unit (a class listed in the model's `_no_split_modules`). Its ``params`` are those it gathers: every
    parameter it holds, a block it shares with other units (Zamba's shared transformer) included, as FSDP2 manages a
    shared parameter in each unit that holds it and so gathers it with each."""

    name: str
    params: int
    expert_params: int


@dataclass(frozen=True)
class ModelCensus:
    model_class: str
    total_params: int
    expert_params: int
    num_experts: int
    experts_per_token: int
    decoder_layers: int
    hidden_size: int
    vocab_size: int
    units: tuple[LayerCensus, ...]
    decoder_active_params: int
    lm_head_params: int
    lora_params_per_rank: int
    activation_elements_per_token_layer: int  # the largest layer's (a MoE's first dense layers keep less)
    activation_elements_per_token: int  # summed over the decoder layers
    routed_width: int
    unit_params: int  # parameters inside the shard units, each counted once however many units hold it
    frozen_params: int = 0  # an image-text model's towers that full fine-tuning leaves frozen (model.towers: frozen)

    @property
    def active_params(self) -> int:
        """Parameters one token passes through: decoder layers (top-k experts only) and the LM head."""
        return self.decoder_active_params + self.lm_head_params

    @property
    def root_params(self) -> int:
        """Parameters outside every shard unit (embeddings, LM head, final norm): FSDP's root unit."""
        return self.total_params - self.unit_params

    def lora_params(self, rank: int) -> int:
        return self.lora_params_per_rank * rank


def _config_value(config: PreTrainedConfig, keys: tuple[str, ...]):
    """The first of ``keys`` the config sets, else the first one a sub-config it names in ``sub_configs`` sets (DBRX
    keeps its expert counts in ``ffn_config``), whether held as a config or as a dict; None where none is set."""
    holders = [config, *(getattr(config, key, None) for key in getattr(config, "sub_configs", None) or {})]
    for holder in holders:
        for key in keys:
            value = holder.get(key) if isinstance(holder, dict) else getattr(holder, key, None)
            if value:
                return value
    return None


def _expert_parameter_names(model: nn.Module, config: PreTrainedConfig, num_experts: int) -> set[str]:
    """Grouped expert weights: named by the config's expert-parallel plan, else tensors over the experts: 3D ones
    stacking them (experts, out, in), or 2D ones of an experts module folding them into their first dimension (DBRX's
    (experts * ffn_hidden_size, d_model))."""
    plan = getattr(config, "base_model_ep_plan", None) or {}
    patterns = [_pattern_regex(key) for key, style in plan.items() if style == "grouped_gemm"]
    names = set()
    for name, param in model.named_parameters():
        if patterns and any(p.search(name) for p in patterns):
            names.add(name)
        elif not patterns and num_experts > 1 and param.ndim == 3 and param.shape[0] == num_experts:
            names.add(name)
        elif not patterns and num_experts > 1 and param.ndim == 2 and param.shape[0] % num_experts == 0 and _EXPERTS_MODULE.search(name):
            names.add(name)
    return names


def _one_expert(shape: torch.Size, num_experts: int) -> tuple[int, ...]:
    """One expert's part of an expert weight: what follows the experts' dimension where the weight stacks them
    (experts, out, in), or its share of the rows where it folds them into its first dimension (experts * out, in)."""
    rows = shape[0] // num_experts
    return tuple(shape[1:]) if rows == 1 else (rows, *shape[1:])


def _decoder_stack(model: nn.Module) -> nn.ModuleList:
    """The decoder layers: the text decoder's ``layers``, else the ModuleList holding the most parameters (an
    image-text model's vision tower may outweigh its text decoder)."""
    layers = getattr(model.get_decoder(), "layers", None) if hasattr(model, "get_decoder") else None
    if isinstance(layers, nn.ModuleList) and len(layers):
        return layers
    lists = [module for module in model.modules() if isinstance(module, nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no layer list to count")
    return max(lists, key=lambda layers: sum(p.numel() for p in layers.parameters()))


def _shard_units(model: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    """The outermost modules of the classes the model lists in ``_no_split_modules`` (Mamba lists a block and the
    mixer inside it: the mixer is part of its block's unit, not one more)."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    taken: list[str] = []
    for name, module in model.named_modules():
        if type(module).__name__ in classes and not any(name.startswith(f"{outer}.") for outer in taken):
            taken.append(name)
            yield name, module


def _activation_elements(layer: nn.Module, expert_names: set[str], experts_per_token: int, num_experts: int) -> int:
    """Per token: inputs and outputs of every matmul (routed ones top-k times) plus each norm's width.

    An estimate of what autograd keeps for one layer in 16-bit, not a bound: what a model's own code keeps besides
    (a norm's float32 upcast, a MoE's routing and permutation copies) is left out, so a layer can keep more.
    """
    elements = 0
    for name, module in layer.named_modules():
        if isinstance(module, nn.Linear):
            elements += module.in_features + module.out_features
    for name, param in layer.named_parameters():
        if name in expert_names:  # a grouped weight (experts, out, in) or (experts * out, in), or a bias (experts, out)
            elements += experts_per_token * sum(_one_expert(param.shape, num_experts))
        elif param.ndim == 1:
            elements += param.shape[0]
    return elements


def _routed_width(model: nn.Module, expert_names: set[str], hidden_size: int) -> int:
    """The width tokens travel to their experts at: the hidden state fed to them, the width their experts module
    declares (transformers' ``hidden_dim``), which a MoE block may project down to from the model's width first (Muse
    Spark's pre_expert_proj), else the config's hidden size. Read from the model, not from a weight's layout, which
    differs between families (Llama 4 stores gate_up_proj (experts, hidden, 2 x intermediate)); 0 without experts."""
    for module_name, module in model.named_modules():
        for name, _ in module.named_parameters(recurse=False):
            if f"{module_name}.{name}" in expert_names:
                return int(getattr(module, "hidden_dim", None) or hidden_size)
    return 0


def _lora_params_per_rank(config: PreTrainedConfig, target_modules: Iterable[str] | str, exclude: str | None = None) -> int:
    """The weights LoRA adds per unit of rank, as peft adds them to the model a run trains: every module peft adapts
    under ``target_modules`` (nn.Linear, GPT-2's Conv1D, a MoE's grouped experts and router), none matching
    ``exclude`` (an image-text model's frozen towers). Targets the run refuses are refused here too."""
    if not target_modules:
        return 0
    model = build_on_meta(config)
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    _check_lora_targets(model, targets)
    with torch.device("meta"):
        adapted = with_adapters(model, LoraConfig(r=1, target_modules=targets, exclude_modules=exclude, task_type="CAUSAL_LM"))
    return sum(param.numel() for name, param in adapted.named_parameters() if ".lora_" in name)


def count_model(config: PreTrainedConfig, lora_target_modules: Iterable[str] | str = (), towers: str = "frozen") -> ModelCensus:
    """The census of ``config``'s model; an image-text model's towers (and projectors) as ``towers`` (the recipe's
    ``model.towers``) trains them: ``frozen`` leaves them out of full fine-tuning and of LoRA's targets."""
    model = build_on_meta(config)
    outside = outside_text_model(model) if towers != "train" else None
    frozen = sum(p.numel() for name, p in model.named_parameters() if outside and re.match(outside, name)) if towers == "frozen" else 0
    text_config = config.get_text_config()
    num_experts = int(_config_value(text_config, _EXPERT_COUNT_KEYS) or 1)
    top_k = _config_value(text_config, _TOP_K_KEYS) or 1
    experts_per_token = int(max(top_k) if isinstance(top_k, (list, tuple)) else top_k)  # Hunyuan gives one per layer
    expert_names = _expert_parameter_names(model, text_config, num_experts)
    full_names = {name for name, _ in model.named_parameters()}
    expert_full = {name for name in full_names if any(name.endswith(short) for short in expert_names)}

    units = []
    in_units: dict[int, int] = {}  # a parameter several units hold (Zamba's shared block) counted once, by identity
    for unit_name, unit in _shard_units(model):
        params = expert = 0
        for name, param in unit.named_parameters():
            params += param.numel()
            in_units[id(param)] = param.numel()
            if f"{unit_name}.{name}" in expert_full:
                expert += param.numel()
        units.append(LayerCensus(unit_name, params, expert))

    stack = _decoder_stack(model)
    stack_prefix = next(name for name, module in model.named_modules() if module is stack)
    decoder_active = 0
    for name, param in stack.named_parameters():
        share = experts_per_token / num_experts if f"{stack_prefix}.{name}" in expert_full else 1.0
        decoder_active += round(param.numel() * share)
    activations = []  # per layer: a MoE's first layers may be dense (DeepSeek-V3, Llama 4), so each is counted
    for index, layer in enumerate(stack):
        prefix = f"{stack_prefix}.{index}."
        layer_expert_names = {name[len(prefix) :] for name in expert_full if name.startswith(prefix)}
        activations.append(_activation_elements(layer, layer_expert_names, experts_per_token, num_experts))
    head = model.get_output_embeddings()
    return ModelCensus(
        model_class=type(model).__name__,
        total_params=sum(p.numel() for p in model.parameters()),
        expert_params=sum(p.numel() for name, p in model.named_parameters() if name in expert_full),
        num_experts=num_experts,
        experts_per_token=experts_per_token,
        decoder_layers=len(stack),
        hidden_size=int(text_config.hidden_size),
        vocab_size=int(text_config.vocab_size),
        units=tuple(units),
        decoder_active_params=decoder_active,
        lm_head_params=head.weight.numel() if head is not None else 0,
        lora_params_per_rank=_lora_params_per_rank(config, lora_target_modules, None if towers == "lora" else outside),
        frozen_params=frozen,
        activation_elements_per_token_layer=max(activations),
        activation_elements_per_token=sum(activations),
        routed_width=_routed_width(model, expert_full, int(text_config.hidden_size)),
        unit_params=sum(in_units.values()),
    )
