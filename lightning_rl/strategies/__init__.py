"""Lightning strategies of lightning-rl, registered by name on import (``trainer.strategy: fsdp2``)."""

from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import StrategyRegistry

from lightning_rl.strategies.availability import check_strategy_request, strategy_statuses
from lightning_rl.strategies.devices import detect_devices
from lightning_rl.strategies.errors import StrategyUnavailableError
from lightning_rl.strategies.fsdp2 import FSDP2Strategy
from lightning_rl.strategies.rocm import ROCmFSDP2Strategy
from lightning_rl.strategies.xla import NeuronAccelerator, NeuronStrategy, StaticShapeCPUStrategy, XLAStaticStrategy

_STRATEGIES = {
    "fsdp2": (FSDP2Strategy, "FSDP2 fully_shard, one unit per decoder layer (CPU/gloo, CUDA/NCCL)"),
    "fsdp2_rocm": (ROCmFSDP2Strategy, "FSDP2 on AMD GPUs over RCCL"),
    "xla_static": (XLAStaticStrategy, "torch_xla (TPU, Trainium via torch-neuronx) with static shapes"),
    "neuron": (NeuronStrategy, "one native neuron device with static shapes"),
    "cpu_static": (StaticShapeCPUStrategy, "CPU rehearsal of the XLA/Neuron static-shape policy"),
}
for _name, (_strategy, _description) in _STRATEGIES.items():
    if _name not in StrategyRegistry:
        StrategyRegistry.register(_name, _strategy, description=_description)
if "neuron" not in AcceleratorRegistry:
    AcceleratorRegistry.register("neuron", NeuronAccelerator, description="native neuron device (torch.accelerator)")

__all__ = [
    "FSDP2Strategy",
    "NeuronStrategy",
    "ROCmFSDP2Strategy",
    "StaticShapeCPUStrategy",
    "StrategyUnavailableError",
    "XLAStaticStrategy",
    "check_strategy_request",
    "detect_devices",
    "strategy_statuses",
]
