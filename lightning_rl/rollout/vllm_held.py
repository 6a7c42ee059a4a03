"""What a vLLM model holds, per Hugging Face name: its live weights, with vLLM's loading transforms undone.

vLLM fuses q/k/v into one ``qkv_proj`` and gate/up into one ``gate_up_proj`` (its ``packed_modules_mapping``), stacked
along the output rows, and pads the vocabulary rows of its embeddings; each checkpoint tensor is then a block of rows
of a live parameter, cut back out here. A MoE layer's experts live in two [experts, rows, columns] parameters
(``w13``: gate and up stacked; ``w2``: down), as transformers' fused ``gate_up_proj`` and ``down_proj`` do. On a CPU,
vLLM also hands each linear layer's weight to a GEMM kernel of its own (oneDNN) and leaves the parameter empty: that
weight is read back through the layer itself, as the product of its own kernel with the identity (one non-zero term
per output, so the read is exact), which is what the engine really computes with. Its MoE kernel keeps each expert's
weights in a layout of its own (prepacked, the intermediate rows padded to its alignment), undone here by the
permutation that kernel applies, read once per shape. The digests of these tensors are
what `models.weights.verify_held` compares with the trainer's. Runs inside the worker that holds the model
(in-process, or a server's worker); no vLLM import.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from lightning_rl.errors import RecipeError
from lightning_rl.models.weights import tensor_digest
from lightning_rl.rollout.checkpoint_layout import CheckpointLayout


class HeldWeightsError(RecipeError):
    """A live parameter of the vLLM model that maps to no checkpoint tensor: its weights cannot be verified (the
    engine's ``verify_weights`` is the key)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "engine")


def _own_kernel(module: nn.Module, name: str) -> bool:
    """Whether the module computes with a copy of its weight its CPU kernel keeps (every linear layer, and the LM
    head, whose weight the tied embedding shares while the kernel holds a copy of its own)."""
    return name == "weight" and hasattr(module, "cpu_linear")


def _live_weight(module: nn.Module, name: str, param: torch.Tensor) -> torch.Tensor:
    """The values the module computes with: the parameter, or the weight its CPU kernel holds."""
    if _own_kernel(module, name):
        # A layer split over tensor-parallel ranks holds its share of the inputs; a ReplicatedLinear (a vision
        # connector's projection) holds them all and has no per-partition size.
        inputs = getattr(module, "input_size_per_partition", module.input_size)
        identity = torch.eye(inputs, dtype=param.dtype, device=param.device)
        return module.quant_method.apply(module, identity).t()  # [in, out] -> the [out, in] weight
    return param


def held_tensors(model: nn.Module, layout: CheckpointLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` for every tensor of the checkpoint the model holds, one at a time (tied: once, unless a
    module computes with a kernel's copy of its own, read as such: a head that kept its old weights is caught)."""
    packed = getattr(type(model), "packed_modules_mapping", {})
    renamed = _checkpoint_names(model, layout)
    seen: set[int] = set()
    with torch.no_grad():
        for module_name, module in model.named_modules():  # a module under two names computes once: read once
            # With LoRA serving on, vLLM wraps each adapted layer and keeps the layer itself as its ``base_layer``.
            module_name = module_name.replace(".base_layer", "")
            for name, param in module.named_parameters(recurse=False):
                if id(param) in seen and not _own_kernel(module, name):
                    continue
                seen.add(id(param))
                full = renamed.get(f"{module_name}.{name}", f"{module_name}.{name}")
                owner = full.rpartition(".")[0]  # the module's checkpoint name
                live = _live_weight(module, name, param)
                experts = _expert_tensors(owner, name, live, layout, _cpu_prepacked(module))
                if experts is not None:
                    yield from experts
                    continue
                head, _, fused = owner.rpartition(".")
                parts = [f"{head}.{part}.{name}" for part in packed.get(fused, _FUSED.get(fused, ()))]
                if not parts or full in layout.shapes or not all(part in layout.shapes for part in parts):
                    parts = [full]
                shapes = [layout.shapes.get(part) for part in parts]
                rows = sum(shape[0] for shape in shapes if shape) if all(shapes) else -1
                if not all(shapes) or tuple(live.shape[1:]) != tuple(shapes[0][1:]) or rows > live.shape[0]:
                    raise HeldWeightsError(
                        f"vLLM's '{full}' {tuple(live.shape)} maps to no tensor of the {layout.architecture} checkpoint; "
                        "its weights cannot be verified (verify_weights: false skips the check)"
                    )
                start = 0  # fused parts follow each other along the rows; rows past the last are vocabulary padding
                for part, shape in zip(parts, shapes):
                    yield part, live[start : start + shape[0]]
                    start += shape[0]


# vLLM's own names for fused layers, for a model that does not list them in its ``packed_modules_mapping``.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

# vLLM's fused experts (every expert of a layer in one [experts, rows, columns] parameter, gate and up stacked along
# the rows of w13) -> the checkpoint's: transformers fuses them the same way (``gate_up_proj``, ``down_proj``).
_EXPERT_PARTS = {"w13_weight": "gate_up_proj", "w2_weight": "down_proj"}


def _expert_tensors(
    module_name: str, name: str, live: torch.Tensor, layout: CheckpointLayout, isa: str | None = None
) -> list[tuple[str, torch.Tensor]] | None:
    """A fused-experts parameter (``...experts.routed_experts.w13_weight``) under its checkpoint name, or None if it
    is not one the checkpoint holds in the same layout (then nothing maps it, and the caller says so). ``isa``: the
    CPU kernel's prepack it holds (`_cpu_prepacked`), undone first."""
    if name not in _EXPERT_PARTS:
        return None
    checkpoint_name = f"{module_name.removesuffix('.routed_experts')}.{_EXPERT_PARTS[name]}"
    if isa is not None:
        live = _unpacked_experts(live, isa, layout.shapes.get(checkpoint_name))
    return [(checkpoint_name, live)] if layout.shapes.get(checkpoint_name) == tuple(live.shape) else None


def _cpu_prepacked(module: nn.Module) -> str | None:
    """The instruction set vLLM's CPU MoE kernel prepacked this experts module's weights for (None: not prepacked)."""
    experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
    if type(experts).__module__.rpartition(".")[2] != "cpu_moe" or getattr(experts, "_use_zentorch", True):
        return None
    return getattr(experts, "isa", None)


_PREPACK_ORDER: dict[tuple[int, int, torch.dtype, str], torch.Tensor] = {}


def _prepack_order(rows: int, columns: int, dtype: torch.dtype, isa: str) -> torch.Tensor:
    """Where the CPU MoE kernel's prepack takes each element of an expert's [rows, columns] weight from: prepacked
    flat element j is the original's element order[j]. Read by prepacking the index's base-256 digits, small integers
    every float dtype holds exactly (the prepack only moves elements, one expert at a time)."""
    key = (rows, columns, dtype, isa)
    if key not in _PREPACK_ORDER:
        index, order = torch.arange(rows * columns), torch.zeros(rows * columns, dtype=torch.long)
        for place in range(max(1, ((rows * columns - 1).bit_length() + 7) // 8)):
            digits = (index >> (8 * place)) % 256
            packed = torch.empty(1, rows, columns, dtype=dtype)
            torch.ops._C.prepack_moe_weight(digits.to(dtype).reshape(1, rows, columns), packed, isa)
            order += packed.reshape(-1).long() << (8 * place)
        _PREPACK_ORDER[key] = order
    return _PREPACK_ORDER[key]


def _unpacked_experts(live: torch.Tensor, isa: str, shape: tuple[int, ...] | None) -> torch.Tensor:
    """A prepacked [experts, rows, columns] parameter in the checkpoint's layout (``shape``): the prepack undone, and
    the kernel's padding of the intermediate size cut (``w13``: gate and up rows each padded; ``w2``: columns)."""
    experts, rows, columns = live.shape
    order = _prepack_order(rows, columns, live.dtype, isa)
    unpacked = torch.empty_like(live).reshape(experts, -1)
    unpacked[:, order] = live.reshape(experts, -1)
    unpacked = unpacked.reshape(experts, rows, columns)
    if shape is None or tuple(unpacked.shape) == tuple(shape):
        return unpacked
    if shape[2] == columns and shape[1] % 2 == 0 and rows % 2 == 0 and rows >= shape[1]:  # w13: gate, then up
        half, padded = shape[1] // 2, rows // 2
        return torch.cat([unpacked[:, :half], unpacked[:, padded : padded + half]], dim=1)
    if shape[1] == rows and columns >= shape[2]:  # w2: the intermediate columns
        return unpacked[:, :, : shape[2]]
    return unpacked


def prepack_on_reload(model: nn.Module) -> None:
    """Make every reload prepack the CPU MoE experts it writes, as the first load did. vLLM's CPU kernel prepacks (and
    pads) them once, after the first load; its layerwise reload writes them in the checkpoint's layout and, treating
    it as a weight update, skips that step: the kernel read them in the wrong order (and a padded layer's copy back
    into its storage failed on the shape). Each experts layer's post-load step then ends with its kernel's own
    prepack, inside the reload, for exactly the layers it processes. Once per model; call after the first load."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if _cpu_prepacked(module) is None or getattr(method, "_lightning_rl_prepacks", False):
            continue
        process = method.process_weights_after_loading

        def process_and_prepack(layer: nn.Module, process=process, method=method) -> None:
            process(layer)
            method.moe_kernel.fused_experts.process_weights_after_loading(layer)

        method.process_weights_after_loading = process_and_prepack
        method._lightning_rl_prepacks = True


def _checkpoint_names(model: nn.Module, layout: CheckpointLayout) -> dict[str, str]:
    """vLLM's name -> the checkpoint's, where the model renames what it loads (``hf_to_vllm_mapper``: vLLM's
    Transformers backend puts GPT-NeoX's ``gpt_neox.embed_in`` under ``model.embed_in``); a name loaded into a shard
    of a fused tensor is left to ``packed_modules_mapping``."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is None:
        return {}
    names = {}
    for checkpoint_name in layout.shapes:
        mapped = mapper._map_name_with_shard(checkpoint_name)
        if mapped is not None and mapped[1] is None and mapped[0] != checkpoint_name:
            names[mapped[0]] = checkpoint_name
    return names


def held_digests(model: nn.Module, layout: CheckpointLayout) -> dict[str, list]:
    """``{hf_name: [dtype name, digest]}`` of what the model holds (JSON-safe: a server returns it over HTTP)."""
    return {name: [str(t.dtype).removeprefix("torch."), tensor_digest(t)] for name, t in held_tensors(model, layout)}


def held_aliases(model: nn.Module, layout: CheckpointLayout) -> set[str]:
    """The tied names (``lm_head.weight``) the model has a parameter under, shared or not: only these are sent (a
    CPU kernel keeps its own copy of a shared weight, made again when the name is loaded). vLLM has no tensor under
    the others (its Gemma computes its logits with the embedding and has no ``lm_head``)."""
    renamed = _checkpoint_names(model, layout)
    names = {name.replace(".base_layer", "") for name, _ in model.named_parameters(remove_duplicate=False)}
    return {renamed.get(name, name) for name in names} & set(ties_of(layout))


def ties_of(layout: CheckpointLayout) -> dict[str, str]:
    """Each tied name -> the name whose tensor it shares (``lm_head.weight`` -> ``model.embed_tokens.weight``)."""
    return {target: source for source, targets in layout.aliases.items() for target in targets}


def held_adapter(worker: object, lora_id: int, rank: int) -> dict[str, list]:
    """``{peft name: [dtype name, digest]}`` of the LoRA adapter ``lora_id`` as the worker computes with it: each
    adapted layer's A and B in the adapter's slot, cut to ``rank`` (vLLM pads to its max_lora_rank) and cut per
    part of a fused layer. vLLM holds B already multiplied by the adapter's scaling. A layer the adapter does not
    adapt holds zeros."""
    manager = worker.model_runner.lora_manager._adapter_manager
    slots = list(manager.lora_index_to_id)
    if lora_id not in slots:
        raise HeldWeightsError(f"the engine holds no adapter {lora_id} in its slots ({slots}): it is not loaded")
    slot = slots.index(lora_id)
    packed = getattr(type(worker.get_model()), "packed_modules_mapping", {})
    held = {}
    with torch.no_grad():
        for module_name, module in manager.modules.items():
            stacked_a, stacked_b = getattr(module, "lora_a_stacked", None), getattr(module, "lora_b_stacked", None)
            if not isinstance(stacked_a, (tuple, list)) or any(a.dim() != 4 for a in stacked_a):
                continue  # embeddings and fused experts: adapters on them are refused before they are sent
            head, _, leaf = module_name.rpartition(".")
            for part, a, b in zip(packed.get(leaf, [leaf]), stacked_a, stacked_b):
                prefix = f"base_model.model.{head}.{part}"
                for name, tensor in ((f"{prefix}.lora_A.weight", a[slot, 0, :rank]), (f"{prefix}.lora_B.weight", b[slot, 0, :, :rank])):
                    held[name] = [str(tensor.dtype).removeprefix("torch."), tensor_digest(tensor)]
    return held


def lora_targets(worker: object) -> list[str]:
    """The layer names (last name part, fused layers by their parts) the worker's model serves LoRA on."""
    manager = worker.model_runner.lora_manager._adapter_manager
    packed = manager.packed_modules_mapping
    return sorted({part for module in manager.supported_lora_modules for part in packed.get(module, [module])})


def lora_dtype(worker: object) -> str:
    """The dtype the worker holds LoRA adapters in (vLLM casts each adapter tensor to it as it loads it): the
    recipe's ``lora_dtype``, else the model's."""
    return str(worker.vllm_config.lora_config.lora_dtype).removeprefix("torch.")


def lora_refusal(worker: object) -> str | None:
    """Why the worker can apply no LoRA adapter at all, or None. vLLM's CPU build wraps each MoE layer for LoRA (even
    an adapter on attention alone) with kernels written in Triton, which has no CPU backend: generation fails."""
    manager = worker.model_runner.lora_manager._adapter_manager
    moe = [name for name, module in manager.modules.items() if type(module).__name__ == "FusedMoEWithLoRA"]
    if moe and next(worker.get_model().parameters()).device.type == "cpu":
        return (f"vLLM's CPU build applies LoRA on a MoE model's expert layers ({moe[0]}) with Triton kernels, which "
                "have no CPU backend: it serves no adapter on a MoE model")
    return None


def write_groups(packed: Mapping[str, Sequence[str]], names: Iterable[str]) -> dict[str, str]:
    """Checkpoint name -> the group it is written with, for the tensors a delta must send together: the parts of a
    fused module (``packed``: vLLM's ``qkv_proj`` -> q, k, v) and a layer's experts, since vLLM's reload of a module
    rebuilds it from what it receives. Names in no group are left out."""
    fused = {part: module for module, parts in packed.items() for part in parts}
    groups = {}
    for name in names:
        module, _, param = name.rpartition(".")
        head, _, leaf = module.rpartition(".")
        if leaf in fused:
            groups[name] = f"{head}.{fused[leaf]}.{param}"
        elif ".experts." in name:
            groups[name] = name[: name.index(".experts.")] + ".experts"
    return groups
