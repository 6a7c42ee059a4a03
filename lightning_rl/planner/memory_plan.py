"""Per-GPU memory and step time of a training layout, from a `ModelCensus`.

Every term is a plain formula over the model's real parameter counts and the layout; `format_plan`
prints each one with its inputs so a reader can check the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_rl.planner.model_census import LayerCensus, ModelCensus

GIB = 1024**3
# Adam keeps two states per trainable parameter, in the parameter's dtype. LoRA adapters are stored as every other
# weight is: trainer.precision converts the whole model after peft adds them (bf16-true: adapters in bf16 too).
_ADAM_STATES = 2
# FSDP2 all-gathers the next unit while the current one computes: two units are in flight.
_UNITS_IN_FLIGHT = 2


@dataclass(frozen=True)
class Hardware:
    gpu_memory_gb: float
    peak_tflops: float = 989.0  # H100 SXM, dense bf16
    mfu: float = 0.30
    network_gbps: float = 400.0  # per GPU, across nodes (one 400G NIC per GPU)
    nvlink_gbps: float = 3600.0  # per GPU, inside a node (H100 NVLink, one direction)
    reserved_gb: float = 5.0  # CUDA context, NCCL workspaces, allocator slack
    headroom: float = 0.10  # share of memory kept free for fragmentation


@dataclass(frozen=True)
class Term:
    name: str
    bytes: float
    formula: str


@dataclass(frozen=True)
class Training:
    nodes: int
    gpus_per_node: int
    tokens_per_micro_batch: int  # a row's: what one forward holds
    accumulate_grad_batches: int = 1
    tokens_per_batch: int | None = None  # a micro-batch's tokens when it is cut into rows forwarded one after the other (SFT's max_tokens_per_row)
    lora_rank: int | None = None
    param_bytes: int = 2
    compute_bytes: int = 2  # activations and what flows between layers (fp32 under the -mixed precisions' autocast)
    gather_bytes: int | None = None  # a weight FSDP2 gathers (its mixed_precision's dtype; None: param_bytes)
    activation_checkpointing: bool = True
    offload_activations: bool = False  # saved activations in host memory between forward and backward
    cpu_offload: bool = False
    sharded: bool = True  # FSDP2 (a single GPU without it holds weights and gradients whole: nothing to gather or scatter)
    expert_parallel: int = 1
    logits_chunk: int = 1024
    beside: tuple[Term, ...] = ()  # what shares the GPU with training (GRPO: a colocated engine, the reference model)
    notes: tuple[str, ...] = ()  # what the plan does not model, said under it

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def gathered_bytes(self) -> int:
        return self.param_bytes if self.gather_bytes is None else self.gather_bytes


@dataclass
class Plan:
    census: ModelCensus
    training: Training
    hardware: Hardware
    terms: list[Term] = field(default_factory=list)
    activations_without_checkpointing: float = 0.0
    activations_with_checkpointing: float = 0.0
    host_bytes_per_gpu: float = 0.0
    host_activation_bytes: float = 0.0
    compute_seconds: float = 0.0
    gather_seconds: float = 0.0
    all_to_all_seconds: float = 0.0
    comm_seconds: float = 0.0
    tokens_per_step: int = 0

    @property
    def total_bytes(self) -> float:
        return sum(term.bytes for term in self.terms)

    @property
    def usable_bytes(self) -> float:
        return self.hardware.gpu_memory_gb * GIB * (1 - self.hardware.headroom)

    @property
    def margin_bytes(self) -> float:
        return self.usable_bytes - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.margin_bytes >= 0

    @property
    def step_seconds(self) -> float:
        """Compute and parameter traffic overlap, so the slower of the two sets the pace."""
        return max(self.compute_seconds, self.comm_seconds)


def _gathered_params(training: Training, unit: LayerCensus) -> float:
    """Parameters of one unit once all-gathered.

    Dense weights gather over every rank. With expert parallelism each rank owns its slice of the
    experts, gathered only over the ranks holding the same slice (none when every rank has its own).
    """
    expert_group = training.world_size // training.expert_parallel
    experts = unit.expert_params / training.expert_parallel if expert_group > 1 else 0.0
    return unit.params - unit.expert_params + experts


def _largest_gathered_unit(census: ModelCensus, training: Training) -> tuple[str, float]:
    """Name and gathered bytes of the biggest shard unit."""
    if not census.units:
        return "none", 0.0
    unit = max(census.units, key=lambda u: _gathered_params(training, u))
    return unit.name, _gathered_params(training, unit) * training.gathered_bytes


def plan_memory(census: ModelCensus, training: Training, hardware: Hardware) -> Plan:
    plan = Plan(census, training, hardware)
    world, tokens, c = training.world_size, training.tokens_per_micro_batch, training.compute_bytes
    lora = training.lora_rank is not None
    trainable = census.lora_params(training.lora_rank) if lora else census.total_params - census.frozen_params
    frozen = census.total_params if lora else census.frozen_params
    trainable_bytes = training.param_bytes
    on_gpu = 0.0 if training.cpu_offload else 1.0

    sharded_frozen = frozen * training.param_bytes / world
    sharded_trainable = trainable * trainable_bytes / world
    sharded_grads = trainable * trainable_bytes / world
    sharded_optimizer = trainable * trainable_bytes * _ADAM_STATES / world
    plan.host_bytes_per_gpu = (1 - on_gpu) * (sharded_frozen + sharded_trainable + sharded_grads + sharded_optimizer)
    where = "on host (cpu_offload)" if training.cpu_offload else f"/ {world} GPUs"
    plan.terms += [
        Term("frozen weights, sharded", on_gpu * sharded_frozen, f"{_count(frozen)} x {training.param_bytes} B {where}"),
        Term("trainable weights, sharded", on_gpu * sharded_trainable, f"{_count(trainable)} x {trainable_bytes} B {where}"),
        Term("gradients, sharded", on_gpu * sharded_grads, f"{_count(trainable)} x {trainable_bytes} B {where}"),
        Term("Adam states, sharded", on_gpu * sharded_optimizer, f"{_count(trainable)} x {_ADAM_STATES} x {trainable_bytes} B {where}"),
    ]

    if training.sharded:  # FSDP2's own buffers: the units it gathers, and one unit's gradients before it scatters them
        unit_name, unit = _largest_gathered_unit(census, training)
        g = training.gathered_bytes
        root = census.root_params * g
        plan.terms += [
            Term(
                "FSDP all-gather buffers",
                _UNITS_IN_FLIGHT * unit,
                f"{_UNITS_IN_FLIGHT} units in flight x largest unit ({unit_name}) {unit / GIB:.2f} GiB"
                + (f" (experts split {training.expert_parallel}-way)" if training.expert_parallel > 1 else ""),
            ),
            Term("FSDP root unit, gathered for the step", root, f"{_count(census.root_params)} (embeddings, head) x {g} B"),
        ]
        largest_unit = max((unit.params for unit in census.units), default=0)
        unit_trainable = trainable / census.decoder_layers if lora else largest_unit
        plan.terms.append(
            Term("gradient reduce-scatter buffer", unit_trainable * 4, f"one unit's {_count(unit_trainable)} unsharded gradients x fp32")
        )
    if training.expert_parallel > 1:
        dispatch = 2 * tokens * census.experts_per_token * census.routed_width * c
        plan.terms.append(
            Term("expert all-to-all buffers", dispatch, f"send+recv x {tokens} tokens x top-{census.experts_per_token} x {census.routed_width} x {c} B")
        )

    chunk = min(training.logits_chunk, tokens)  # a chunk holds at most the row's tokens
    head = 3 * chunk * census.vocab_size * 4
    plan.terms += [
        _activations(plan),
        Term("chunked LM head", head, f"logits, softmax, grad: 3 x {chunk} tokens x {census.vocab_size} x fp32"),
        Term("reserved (CUDA context, NCCL, allocator)", hardware.reserved_gb * GIB, "assumed"),
        *training.beside,
    ]
    _plan_step_time(plan)
    return plan


def _activations(plan: Plan) -> Term:
    """The activations kept for backward. Without checkpointing every layer's are kept (their sum: a MoE's first dense
    layers keep less than its MoE layers); checkpointing keeps each layer's input and recomputes one layer at a time;
    offloading moves what is kept to host memory as it is saved, so the device holds one layer's working set (the
    layer running forward, or the one whose backward has brought its tensors back), counted at the largest layer's."""
    census, training = plan.census, plan.training
    tokens, c, layers = training.tokens_per_micro_batch, training.compute_bytes, census.decoder_layers
    per_layer = census.activation_elements_per_token_layer * tokens * c
    layer_inputs = layers * tokens * census.hidden_size * c
    plan.activations_without_checkpointing = census.activation_elements_per_token * tokens * c
    plan.activations_with_checkpointing = layer_inputs + per_layer
    if training.activation_checkpointing:
        kept, what = layer_inputs, f"{layers} layer inputs x {tokens} tokens x {census.hidden_size} x {c} B"
    else:
        kept, what = plan.activations_without_checkpointing, f"{layers} layers' {tokens} tokens x {census.activation_elements_per_token} x {c} B"
    working = f"one layer's {tokens} tokens x {census.activation_elements_per_token_layer} x {c} B"
    name = "activations (checkpointed" if training.activation_checkpointing else "activations (no checkpointing"
    if training.offload_activations:
        plan.host_activation_bytes = kept
        return Term(f"{name}, offloaded)", per_layer, f"{working}; {what} on host")
    if training.activation_checkpointing:
        return Term(f"{name})", kept + per_layer, f"{what} + {working} recomputed")
    return Term(f"{name})", kept, what)


def _plan_step_time(plan: Plan) -> None:
    census, training, hardware = plan.census, plan.training, plan.hardware
    world, g, c = training.world_size, training.gathered_bytes, training.compute_bytes
    plan.tokens_per_step = world * (training.tokens_per_batch or training.tokens_per_micro_batch) * training.accumulate_grad_batches
    flops = 6 * census.active_params * plan.tokens_per_step
    plan.compute_seconds = flops / (world * hardware.peak_tflops * 1e12 * hardware.mfu)
    # Units are resharded after forward, so every micro-batch gathers each one twice (forward, backward).
    gathered = sum(_gathered_params(training, unit) for unit in census.units)
    received = 2 * gathered * g * (1 - 1 / world) * training.accumulate_grad_batches
    plan.gather_seconds = received / (hardware.network_gbps / 8 * 1e9) if training.nodes > 1 else 0.0
    plan.all_to_all_seconds = 0.0
    if training.expert_parallel > 1:
        # Dispatch and combine, in forward, recomputed forward and backward, for every layer.
        passes = 3 if training.activation_checkpointing else 2
        sent = 2 * passes * census.decoder_layers * training.tokens_per_micro_batch * census.experts_per_token
        sent *= census.routed_width * c * training.accumulate_grad_batches
        inside_node = training.expert_parallel <= training.gpus_per_node
        plan.all_to_all_seconds = sent / ((hardware.nvlink_gbps if inside_node else hardware.network_gbps) / 8 * 1e9)
    plan.comm_seconds = plan.gather_seconds + plan.all_to_all_seconds


def _count(n: float) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}"
    return f"{n:.0f}"


def format_plan(plan: Plan) -> str:
    census, training, hardware = plan.census, plan.training, plan.hardware
    lines = [
        f"model: {census.model_class}: {_count(census.total_params)} parameters, "
        f"{_count(census.active_params)} active per token ({census.experts_per_token} of {census.num_experts} experts), "
        f"{census.decoder_layers} decoder layers",
        f"layout: {training.nodes} node(s) x {training.gpus_per_node} GPUs = {training.world_size}, "
        f"{'LoRA r=' + str(training.lora_rank) if training.lora_rank is not None else 'full fine-tuning'}, "
        f"expert parallel {training.expert_parallel}, activation checkpointing "
        f"{'on' if training.activation_checkpointing else 'off'}, activation offload {'on' if training.offload_activations else 'off'}, "
        f"cpu offload {'on' if training.cpu_offload else 'off'}",
        "",
        "per-GPU memory:",
    ]
    for term in plan.terms:
        lines.append(f"  {term.name:<42} {term.bytes / GIB:9.2f} GiB   {term.formula}")
    lines += [
        f"  {'total':<42} {plan.total_bytes / GIB:9.2f} GiB",
        f"  activations with checkpointing {plan.activations_with_checkpointing / GIB:.2f} GiB, "
        f"without {plan.activations_without_checkpointing / GIB:.2f} GiB",
    ]
    if plan.host_bytes_per_gpu:
        lines.append(f"  host memory per GPU (offloaded shards): {plan.host_bytes_per_gpu / GIB:.2f} GiB")
    if plan.host_activation_bytes:
        lines.append(f"  host memory per GPU (offloaded activations): {plan.host_activation_bytes / GIB:.2f} GiB")
    lines += [
        f"  usable: {hardware.gpu_memory_gb:g} GiB x (1 - {hardware.headroom:g} headroom) = {plan.usable_bytes / GIB:.2f} GiB",
        "",
        "step time:",
        f"  tokens per step: {training.world_size} GPUs x "
        + (f"{training.tokens_per_batch} tokens (rows of {training.tokens_per_micro_batch}) x " if training.tokens_per_batch
           else f"{training.tokens_per_micro_batch} tokens x ")
        + f"{training.accumulate_grad_batches} accumulation = {plan.tokens_per_step}",
        f"  compute: 6 x {_count(census.active_params)} active x {plan.tokens_per_step} tokens / "
        f"({training.world_size} x {hardware.peak_tflops:g} TFLOP/s x MFU {hardware.mfu:g}) = {plan.compute_seconds:.2f} s",
        f"  parameter all-gathers across nodes at {hardware.network_gbps:g} Gb/s per GPU: {plan.gather_seconds:.2f} s",
        f"  expert all-to-all ({'NVLink' if training.expert_parallel <= training.gpus_per_node else 'network'}): "
        f"{plan.all_to_all_seconds:.2f} s",
        f"  expected step time: {plan.step_seconds:.2f} s (compute and communication overlap: the slower sets the pace)",
        "",
    ]
    lines += [f"{note}" for note in training.notes] + ([""] if training.notes else [])
    if plan.fits:
        lines.append(f"FITS: {plan.total_bytes / GIB:.2f} GiB of {plan.usable_bytes / GIB:.2f} GiB usable, margin {plan.margin_bytes / GIB:.2f} GiB")
    else:
        lines.append(
            f"DOES NOT FIT: needs {plan.total_bytes / GIB:.2f} GiB per GPU, {plan.usable_bytes / GIB:.2f} GiB usable "
            f"(short by {-plan.margin_bytes / GIB:.2f} GiB)"
        )
    return "\n".join(lines)
