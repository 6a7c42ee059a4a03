"""Which strategies this machine can run, why not the others, and the check made before training starts."""

from __future__ import annotations

from dataclasses import dataclass

from lightning.pytorch.strategies import StrategyRegistry

from lightning_rl.strategies.devices import DeviceInventory, detect_devices
from lightning_rl.strategies.errors import StrategyUnavailableError
from lightning_rl.strategies.rocm import rocm_unavailable_reason
from lightning_rl.strategies.xla import neuron_unavailable_reason, xla_unavailable_reason

# Lightning's names for FSDP1, which it runs on CUDA devices only.
FSDP1_NAMES = frozenset({"fsdp", "fsdp_cpu_offload"})
# Lightning's own XLA strategies (and its TPU accelerator): without torch_xla, Lightning fails in a traceback.
LIGHTNING_XLA_NAMES = frozenset({"xla", "single_xla", "xla_fsdp", "xla_debug"})


@dataclass(frozen=True)
class StrategyStatus:
    """One strategy on this machine: can it run, and why (or why not)."""

    name: str
    usable: bool
    reason: str


def _fsdp2_reason(inventory: DeviceInventory) -> str:
    if inventory.gpu_count:
        kind, backend = ("AMD GPU", "RCCL") if inventory.is_rocm else ("CUDA GPU", "NCCL")
        return f"{inventory.gpu_count} {kind}(s) over {backend}"
    return f"CPU ({inventory.cpu_count} cores) over gloo"


def strategy_statuses(inventory: DeviceInventory | None = None) -> list[StrategyStatus]:
    """Every strategy lightning-rl offers (and Lightning's FSDP1), judged for ``inventory``."""
    inventory = inventory or detect_devices()
    fsdp1 = None if inventory.gpu_count else "FSDP1 runs on CUDA/ROCm GPUs only and this machine has none"
    unavailable = {
        "fsdp2": None,
        "fsdp2_rocm": rocm_unavailable_reason(inventory),
        "fsdp": fsdp1,
        "xla_static": xla_unavailable_reason(inventory),
        "neuron": None if inventory.has_native_neuron else (
            neuron_unavailable_reason(inventory) or "torch-neuronx drives NeuronCores as XLA devices: use 'xla_static'"
        ),
        "cpu_static": None,
    }
    usable_reasons = {
        "fsdp2": _fsdp2_reason(inventory),
        "fsdp2_rocm": f"ROCm {inventory.hip_version}, {inventory.gpu_count} AMD GPU(s), RCCL",
        "fsdp": f"{inventory.gpu_count} GPU(s)",
        "xla_static": "torch_xla is installed; rows padded to multiples of 128",
        "neuron": f"{inventory.accelerator_count} native neuron device(s); rows padded to multiples of 128",
        "cpu_static": "CPU rehearsal of the XLA/Neuron shape policy (compiles once per shape)",
    }
    return [
        StrategyStatus(name, reason is None, usable_reasons[name] if reason is None else reason)
        for name, reason in unavailable.items()
    ]


def check_strategy_request(
    strategy: str, accelerator: str | None = None, inventory: DeviceInventory | None = None
) -> None:
    """Fail before training, in one line, when ``strategy`` (a registered name) cannot run here."""
    inventory = inventory or detect_devices()
    if strategy in FSDP1_NAMES:
        if accelerator == "cpu" or not inventory.gpu_count:
            where = "accelerator 'cpu' was asked for" if accelerator == "cpu" else "this machine has no GPU"
            raise StrategyUnavailableError(
                f"strategy '{strategy}' is FSDP1, which needs CUDA/ROCm GPUs, but {where}; "
                "use strategy 'fsdp2' (FSDP2, runs on CPU with gloo and on GPUs)"
            )
        return
    registered = StrategyRegistry[strategy] if strategy in StrategyRegistry else {}  # (its `get` builds the strategy)
    if registered.get("init_params", {}).get("start_method") == "spawn":
        raise StrategyUnavailableError(
            f"strategy '{strategy}' starts its processes by pickling the running trainer, which holds what cannot be "
            "pickled (the run's stop-signal handlers); use 'ddp' (each process starts the command afresh) or 'fsdp2'"
        )
    if (strategy in LIGHTNING_XLA_NAMES or accelerator == "tpu") and (reason := xla_unavailable_reason(inventory)):
        asked = strategy not in LIGHTNING_XLA_NAMES  # the accelerator asked for it, not the strategy
        said = f"accelerator '{accelerator}'" if asked else f"strategy '{strategy}'"
        raise StrategyUnavailableError(f"{said} needs torch_xla, and {reason}; where it runs, strategy 'xla_static' pads "
                                       "rows to static shapes (Lightning's XLA setup compiles a graph per row length)",
                                       "trainer.accelerator" if asked else "trainer.strategy")
    status = {s.name: s for s in strategy_statuses(inventory)}.get(strategy)
    if status is not None and not status.usable:
        instead = "'fsdp2' (CPU or GPU), or 'cpu_static' to rehearse static shapes on a CPU"
        raise StrategyUnavailableError(f"strategy '{strategy}' cannot run here: {status.reason}; use {instead}")
