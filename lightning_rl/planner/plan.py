"""`lightning-rl plan RECIPE.yaml --nodes N --gpus-per-node G --gpu-memory-gb M [-- RUN OVERRIDES]`: will it fit, how fast.

Exit code 0 when the plan fits, 1 when it does not (the numbers say by how much), 2 on bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoConfig, PreTrainedConfig

from lightning_rl.planner.memory_plan import GIB, Hardware, Term, Training, format_plan, plan_memory
from lightning_rl.planner.model_census import count_model
from lightning_rl import validation
from lightning_rl.device_policy import resolve_pad_to_multiple_of
from lightning_rl.errors import UserError, report
from lightning_rl.launch.layout import FILL_FROM_ALLOCATION
from lightning_rl.launch.recipe_view import MODEL_KEY, FlagParser, LaunchError, RecipeView, split_overrides
from lightning_rl.models.paths import EMBEDDED, resolve_model_path

# Where configs of models too large to download for planning are checked in, by model id.
LOCAL_CONFIGS = Path(__file__).resolve().parent / "models"  # package data: found from any working directory
# trainer.precision -> (bytes of stored weights, of activations): under the -mixed precisions autocast computes the
# matmuls in 16 bits, but the weights and what flows between the layers (each layer's input, kept under checkpointing)
# stay float32.
_PRECISION_BYTES = {"bf16-true": (2, 2), "bf16-mixed": (4, 4), "16-mixed": (4, 4), "32-true": (4, 4), "64-true": (8, 8)}  # validation.PRECISIONS
# FSDP2's mixed_precision: the bytes of the dtype it gathers weights in (None: the weights' own, as fp32's policy
# leaves them: strategies/fsdp2.py).
_GATHER_BYTES = {"bf16": 2, "fp16": 2, "fp32": None, None: None}


def _parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog="lightning-rl plan", description=__doc__.splitlines()[0],
                        epilog="after --: lightning-rl run overrides of the recipe (--model.lora.r=32 ...), planned as run reads them")
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, required=True)
    parser.add_argument("--gpu-memory-gb", type=float, required=True)
    parser.add_argument("--model-config", type=Path, help="folder or config.json to read instead of the recipe's model")
    parser.add_argument("--tokens-per-micro-batch", type=int, help="default: the recipe's data.max_tokens, or data.max_tokens_per_row where set (GRPO: model.max_tokens_per_row)")
    parser.add_argument(
        "--expert-parallel", type=int, default=None,
        help="ranks the experts of a layer are split over (default: the recipe's trainer.strategy expert_parallel_size, else 1)",
    )  # fmt: skip
    parser.add_argument("--peak-tflops", type=float, default=Hardware.peak_tflops, help="per GPU, dense bf16")
    parser.add_argument("--mfu", type=float, default=Hardware.mfu, help="assumed model FLOP utilisation")
    parser.add_argument("--network-gbps", type=float, default=Hardware.network_gbps, help="inter-node, per GPU")
    parser.add_argument("--nvlink-gbps", type=float, default=Hardware.nvlink_gbps, help="inside a node, per GPU")
    parser.add_argument("--reserved-gb", type=float, default=Hardware.reserved_gb)
    return parser


def _read_config(folder: Path, what: str) -> PreTrainedConfig:
    try:
        return AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as error:  # broken JSON, a model type transformers does not know
        raise LaunchError(f"{what}: {folder}/config.json cannot be read by transformers ({' '.join(str(error).split())[:200]})") from None


def load_model_config(recipe: RecipeView, override: Path | None) -> PreTrainedConfig:
    """The model's own config class, from a local folder, the local HF cache, or `lightning_rl/planner/models/<model id>`;
    an embedded model (``tiny``, ``tiny-moe``, ``tiny-vlm``) as ``run`` finds it, built once into the cache."""
    if override is not None:
        source = override.parent if override.name == "config.json" else override
        if not (source / "config.json").is_file():
            raise LaunchError(f"--model-config {override}: no config.json there")
        return _read_config(source, f"--model-config {override}")
    model_id = recipe.model_id
    if model_id in EMBEDDED:
        return AutoConfig.from_pretrained(resolve_model_path(model_id))
    candidates = [Path(model_id), LOCAL_CONFIGS / model_id]
    for folder in candidates:
        if (folder / "config.json").is_file():
            return _read_config(folder, f"{recipe.path}: `{MODEL_KEY}: {model_id}`")
    try:
        return AutoConfig.from_pretrained(model_id, local_files_only=True)
    except OSError:
        raise LaunchError(
            f"{recipe.path}: `{MODEL_KEY}: {model_id}` has no config.json in {candidates[0]}, in {candidates[1]}, or in "
            "the local Hugging Face cache; pass --model-config"
        ) from None


def _training(recipe: RecipeView, args: argparse.Namespace) -> Training:
    try:
        precision = validation.precision(recipe.get("trainer.precision", "32-true"))  # as run reads it
    except UserError as error:
        raise LaunchError(f"{recipe.path}: {error}") from None
    param_bytes, compute_bytes = _PRECISION_BYTES[precision]
    row_key = "model.max_tokens_per_row" if recipe.get("task") == "grpo" else "data.max_tokens"  # a packed row's tokens
    batch_tokens = None  # an SFT batch cut into rows (data.max_tokens_per_row): a forward holds a row, a step the batch
    if recipe.get("task") != "grpo" and recipe.get("data.max_tokens_per_row") is not None:
        batch, row = recipe.setting("data.max_tokens"), recipe.setting("data.max_tokens_per_row")
        if isinstance(batch, int) and isinstance(row, int) and 0 < row < batch:
            row_key, batch_tokens = "data.max_tokens_per_row", batch
            if args.nodes * args.gpus_per_node > 1:
                raise LaunchError(f"{recipe.path}: `data.max_tokens_per_row` cuts each batch into rows, which several processes run under DDP "
                                  f"alone, and the plan models FSDP2 on {args.nodes * args.gpus_per_node} GPUs: leave it unset, and lower data.max_tokens")
    tokens = args.tokens_per_micro_batch or recipe.setting(row_key)
    if batch_tokens is not None and isinstance(tokens, int) and tokens > batch_tokens:
        raise LaunchError(f"{recipe.path}: --tokens-per-micro-batch {tokens} is a row of a batch of data.max_tokens={batch_tokens}: no row is larger than its batch")
    if tokens is None and recipe.task == "grpo":
        batch, samples = recipe.setting("data.batch_size"), recipe.setting("model.num_generations")
        new = recipe.get("model.sampling.max_new_tokens", None) or "its max_new_tokens"
        raise LaunchError(f"{recipe.path}: `{row_key}` is null: each step is forwarded in one row, as long as its "
                          f"prompts and completions (data.batch_size x model.num_generations x (a prompt + "
                          f"model.sampling.max_new_tokens): {batch} x {samples} x (the longest prompt + {new}) tokens at "
                          "most, a shared prompt counted once per group); pass --tokens-per-micro-batch with that length")
    if not isinstance(tokens, int) or tokens < 1:
        raise LaunchError(f"{recipe.path}: `{row_key}` is missing or not a positive integer; pass --tokens-per-micro-batch")
    _check_strategy(recipe, args.nodes * args.gpus_per_node)
    padded, notes = _padded_row(recipe, tokens)
    lora = recipe.get("model.lora")
    checkpointing = bool(recipe.get("trainer.strategy.activation_checkpointing") or recipe.get("model.gradient_checkpointing"))
    return Training(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        tokens_per_micro_batch=padded,
        tokens_per_batch=batch_tokens,
        accumulate_grad_batches=int(recipe.get("trainer.accumulate_grad_batches", 1)),
        lora_rank=int(lora.get("r", 16)) if isinstance(lora, dict) else None,
        param_bytes=param_bytes,
        compute_bytes=compute_bytes,
        gather_bytes=_gather_bytes(recipe),
        activation_checkpointing=checkpointing,
        offload_activations=bool(recipe.get("model.offload_activations", False)),
        cpu_offload=bool(recipe.get("trainer.strategy.cpu_offload", False)),
        sharded=_shards(recipe),
        expert_parallel=_expert_parallel(recipe, args.expert_parallel),
        logits_chunk=int(recipe.setting("model.chunk_size")),
        notes=notes,
    )


def _padded_row(recipe: RecipeView, tokens: int) -> tuple[int, tuple[str, ...]]:
    """The row length the run forwards: ``tokens`` padded as the data pads each row (``data.pad_to_multiple_of``; ``auto``
    is 128 under a static-shape strategy, nothing elsewhere; GRPO pads the rows it packs as ``auto`` does), and what
    the plan says of it. Under a static-shape strategy attention runs dense, its scores growing with the square of the
    row's length, which the plan does not count."""
    device = _static_device(recipe)
    key, asked = ("data.pad_to_multiple_of", recipe.setting("data.pad_to_multiple_of")) if recipe.task == "sft" else ("GRPO's rows", "auto")
    multiple = resolve_pad_to_multiple_of(asked, device or "cuda") or 1  # the plan's GPUs under any other strategy
    padded = -(-tokens // multiple) * multiple
    notes = []
    if padded != tokens:
        notes.append(f"rows padded to a multiple of {multiple} ({key}: {asked}): {tokens} tokens planned as {padded}")
    if device is not None:
        notes.append(f"`trainer.strategy: {_strategy_name(recipe)}` runs attention dense (docs/neuron.md): its scores, growing with the "
                     f"square of the {padded}-token row, are not modelled")
    return padded, tuple(notes)


VLLM_DEFAULT_SHARE = 0.3  # VLLMEngine's gpu_memory_utilization by default (tests/test_plan.py holds them equal)


def _grpo_beside(recipe: RecipeView, training: Training, total_params: int, root_params: int, config_bytes: int, gpu_memory_gb: float) -> Training:
    """A GRPO plan with what shares the trainer's GPUs: the reference model (``model.loss.beta`` != 0: a frozen copy,
    sharded as the policy is; none with LoRA) and an engine in the trainer's process (``vllm``: its share of the GPU, or its weights
    and KV cache where ``kv_cache_memory_bytes`` is set), and what the plan does not model."""
    beside = []
    # With LoRA the reference is the policy's base, its adapters off: no copy of its own.
    if recipe.get("model.loss.beta", 0.0) not in (0, 0.0, None) and training.lora_rank is None:
        # Sharded as the policy; its root (embeddings, head) runs forwards only, so it stays gathered after them.
        size = total_params * training.param_bytes / training.world_size + (root_params * training.gathered_bytes if training.world_size > 1 else 0)
        beside.append(Term("reference model (model.loss.beta != 0)", size, f"{_plain_count(total_params)} x {training.param_bytes} B / {training.world_size} GPUs"
                           + (f" + its root {_plain_count(root_params)} x {training.gathered_bytes} B, gathered" if training.world_size > 1 else "")))
    engine = recipe.get("model.engine") or "hf"
    name = engine if isinstance(engine, str) else str(engine.get("class_path", "")) if isinstance(engine, dict) else ""
    if name == "hf" or name.endswith("HFRolloutEngine"):
        device = recipe.get("model.engine.init_args.device")  # none given: the policy's device, a GPU here
        if not str(device).startswith("cpu"):  # a whole copy of its own on the GPU
            width = _dtype_bytes(recipe.get("model.engine.init_args.dtype", "float32"), 4)
            beside.append(Term("transformers engine's own copy (model.engine)", total_params * width,
                               f"its weights ({_plain_count(total_params)} x {width} B), whole, and the KV cache of its batch (not modelled)"))
    if name == "vllm" or name.endswith("VLLMEngine"):
        kv = recipe.get("model.engine.init_args.kv_cache_memory_bytes")
        if isinstance(kv, int) and kv > 0:
            width = _dtype_bytes(recipe.get("model.engine.init_args.dtype", "auto"), config_bytes)  # auto: the checkpoint's own
            weights = total_params * width
            beside.append(Term("colocated vLLM engine (model.engine)", weights + kv, f"its weights ({_plain_count(total_params)} x {width} B) + kv_cache_memory_bytes"))
        else:
            share = recipe.get("model.engine.init_args.gpu_memory_utilization") or VLLM_DEFAULT_SHARE
            beside.append(Term("colocated vLLM engine (model.engine)", share * gpu_memory_gb * GIB, f"gpu_memory_utilization {share:g} x {gpu_memory_gb:g} GiB"))
    notes = ("GRPO: the step time above is for rows of this size; a step forwards data.batch_size x model.num_generations "
             "completions (with their prompts) in such rows, and generation time is not modelled.",)
    return dataclasses.replace(training, beside=tuple(beside), notes=training.notes + notes)


def _gather_bytes(recipe: RecipeView) -> int | None:
    """The bytes FSDP2 gathers a weight element in, as the recipe's ``mixed_precision`` sets them: a name, or a
    ``MixedPrecisionPolicy`` by ``class_path`` (its ``param_dtype``); None: the weights' own."""
    value = recipe.get("trainer.strategy.mixed_precision")
    if isinstance(value, dict):  # the policy's fields, as the recipe gave them
        dtype = value.get("param_dtype")
        return None if dtype is None else _dtype_bytes(dtype, 0) or None
    if isinstance(value, str | type(None)) and value in _GATHER_BYTES:
        return _GATHER_BYTES[value]
    raise LaunchError(f"{recipe.path}: `trainer.strategy.mixed_precision: {value!r}` is not planned: give bf16, fp16, fp32, null or a "
                      "MixedPrecisionPolicy class_path")


def _dtype_bytes(name: object, default: int) -> int:
    """The bytes of one element of a dtype named as recipes and configs name it (``bfloat16``, ``torch.float32``, a
    ``torch.dtype``); ``default`` for anything else (``auto``, none)."""
    dtype = name if isinstance(name, torch.dtype) else getattr(torch, str(name).removeprefix("torch."), None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else default


def _layout_notes(recipe: RecipeView, args: argparse.Namespace) -> tuple[str, ...]:
    """What the plan's flags change of the recipe's layout: the plan is the flags' (a run of the recipe as written
    would shard over its own devices)."""
    notes = []
    for key, flag, value in (("trainer.num_nodes", "--nodes", args.nodes), ("trainer.devices", "--gpus-per-node", args.gpus_per_node)):
        asked = recipe.get(key)
        if asked not in FILL_FROM_ALLOCATION and str(asked) != str(value):
            notes.append(f"planned for {flag} {value}; the recipe's `{key}: {asked}` differs: run it with --{key}={value} for this plan's layout")
    return tuple(notes)


def _plain_count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else str(n)


def _strategy_name(recipe: RecipeView) -> str:
    strategy = recipe.get("trainer.strategy") or "auto"
    return strategy if isinstance(strategy, str) else str(strategy.get("class_path", "")) if isinstance(strategy, dict) else type(strategy).__name__


def _static_device(recipe: RecipeView) -> str | None:
    """The device type of a static-shape strategy (``xla_static``, ``neuron``, ``cpu_static``: it pads every row and
    compiles once per shape), None for any other."""
    strategy = recipe.strategy_class
    return strategy.static_shape_device_type if getattr(strategy, "requires_static_shapes", False) else None


def _shards(recipe: RecipeView) -> bool:
    """Whether the recipe's strategy is FSDP2, which shards the weights (and gathers them to compute)."""
    strategy = recipe.strategy_class  # as the run resolves it: FSDP2 in any case, by name, class or class path
    return strategy is not None and any(cls.__name__ == "FSDP2Strategy" for cls in strategy.__mro__)


def _check_strategy(recipe: RecipeView, world_size: int) -> None:
    """The plan is FSDP2's (weights, gradients and optimizer states sharded over the GPUs, each decoder layer gathered
    in its turn and freed after forward): on several GPUs another strategy (a static-shape one's XLA layout among them),
    or layers kept gathered, is refused."""
    name = _strategy_name(recipe)
    if world_size > 1 and _static_device(recipe) is not None:
        raise LaunchError(f"{recipe.path}: `trainer.strategy: {name}`: an XLA/Neuron layout on several devices is not planned (the plan "
                          "models FSDP2 on GPUs): plan one device, --nodes 1 --gpus-per-node 1")
    if world_size > 1 and not _shards(recipe):
        raise LaunchError(f"{recipe.path}: `trainer.strategy: {name}`: the plan models FSDP2 (weights, gradients and optimizer states "
                          "sharded over the GPUs); another strategy on several GPUs (Lightning's auto picks DDP, which keeps "
                          "them whole on each) is not planned: set trainer.strategy: fsdp2")
    if recipe.get("trainer.strategy.layer_classes"):
        raise LaunchError(f"{recipe.path}: `trainer.strategy.layer_classes` chooses the shard units, which the plan takes from the model "
                          "(its _no_split_modules) and does not model otherwise: plan without it")
    if recipe.get("trainer.strategy.reshard_after_forward") is False:
        raise LaunchError(f"{recipe.path}: `trainer.strategy.reshard_after_forward: false` keeps every decoder layer gathered from "
                          "forward to backward, which the plan (one layer gathered at a time) does not model")


def _expert_parallel(recipe: RecipeView, flag: int | None) -> int:
    value = flag if flag is not None else recipe.get("trainer.strategy.expert_parallel_size", 1)
    if not isinstance(value, int) or value < 1:
        source = "--expert-parallel" if flag is not None else f"{recipe.path}: `trainer.strategy.expert_parallel_size`"
        raise LaunchError(f"{source} must be a positive integer, got {value!r}")
    return value


def _lora_targets(recipe: RecipeView) -> list[str] | str:
    """The LoRA's target_modules as a run hands them to peft: ``all-linear``, or a list of names (one name alone is a
    list of it, as `LoraSettings` reads it; peft would take a string for a pattern)."""
    lora = recipe.get("model.lora")
    if not isinstance(lora, dict):
        return []
    targets = lora.get("target_modules", "all-linear")
    return targets if targets == "all-linear" else [targets] if isinstance(targets, str) else list(targets)


def _check_flags(args: argparse.Namespace) -> None:
    for flag, value in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node),
                        ("--tokens-per-micro-batch", args.tokens_per_micro_batch), ("--expert-parallel", args.expert_parallel)):  # fmt: skip
        if value is not None:
            validation.positive_int(flag, value)
    for flag, value in (("--gpu-memory-gb", args.gpu_memory_gb), ("--peak-tflops", args.peak_tflops), ("--mfu", args.mfu),
                        ("--network-gbps", args.network_gbps), ("--nvlink-gbps", args.nvlink_gbps)):  # fmt: skip
        validation.finite_positive(flag, value)
    validation.finite_non_negative("--reserved-gb", args.reserved_gb)
    if args.mfu > 1:
        raise LaunchError(f"--mfu is a fraction of the peak, at most 1, got {args.mfu}")
    if args.reserved_gb >= args.gpu_memory_gb:
        raise LaunchError(f"--reserved-gb {args.reserved_gb} leaves nothing of --gpu-memory-gb {args.gpu_memory_gb}")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        own_args, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
        args = _parser().parse_args(own_args)
        _check_flags(args)
        recipe = RecipeView.parse(args.recipe, overrides, sized_only=True)
        training = _training(recipe, args)
        config = load_model_config(recipe, args.model_config)
        census = count_model(config, _lora_targets(recipe), recipe.get("model.towers") or "frozen")
        config_bytes = _dtype_bytes(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None), 4)
        if census.num_experts % training.expert_parallel or training.world_size % training.expert_parallel:
            raise LaunchError(
                f"expert parallel {training.expert_parallel} must divide both the {census.num_experts} experts "
                f"and the {training.world_size} GPUs"
            )
    except UserError as error:
        return report(error)
    hardware = Hardware(
        gpu_memory_gb=args.gpu_memory_gb,
        peak_tflops=args.peak_tflops,
        mfu=args.mfu,
        network_gbps=args.network_gbps,
        nvlink_gbps=args.nvlink_gbps,
        reserved_gb=args.reserved_gb,
    )
    training = dataclasses.replace(training, notes=training.notes + _layout_notes(recipe, args))
    if recipe.task == "grpo":
        training = _grpo_beside(recipe, training, census.total_params, census.root_params, config_bytes, args.gpu_memory_gb)
    plan = plan_memory(census, training, hardware)
    print(format_plan(plan))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    raise SystemExit(main())
