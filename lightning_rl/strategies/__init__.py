"""Lightning strategies of lightning-rl, registered by name on import (``trainer.strategy: fsdp2``)."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_rl.strategies.devices import detect_devices, resolve_pad_to_multiple_of
from lightning_rl.strategies.fsdp2 import FSDP2Strategy
from lightning_rl.strategies.weight_sync import iter_adapter_weights, iter_full_weights, sync_weights

if "fsdp2" not in StrategyRegistry:
    StrategyRegistry.register(
        "fsdp2", FSDP2Strategy, description="FSDP2 fully_shard, one unit per decoder layer (CPU/gloo, CUDA, ROCm)"
    )

__all__ = [
    "FSDP2Strategy",
    "detect_devices",
    "iter_adapter_weights",
    "iter_full_weights",
    "resolve_pad_to_multiple_of",
    "sync_weights",
]
