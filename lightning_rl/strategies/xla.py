"""XLA (torch_xla) and AWS Neuron (torch-neuronx, or the native ``neuron`` device), with static shapes.

Neuron and XLA compile one graph per input shape, so these strategies declare ``requires_static_shapes``:
``pad_to_multiple_of="auto"`` then resolves to 128 and rows are padded to buckets. Lightning's XLA
precision plugin already cuts the lazy graph (``mark_step``) after each optimizer step. The XLA and Neuron code
paths are import-guarded and UNTESTED ON REAL HARDWARE here (torch_xla cannot be installed beside this
torch, and there is no Neuron device). :class:`StaticShapeCPUStrategy` runs the same shape policy on a CPU
with ``torch.compile(dynamic=False)``, which recompiles on every new shape the way XLA does; that is how
the policy is tested, and how a user can count compiles before renting accelerator time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.strategies import SingleDeviceStrategy, XLAStrategy
from typing_extensions import override

from lightning_rl import validation
from lightning_rl.errors import RecipeError
from lightning_rl.strategies.devices import DeviceInventory, detect_devices
from lightning_rl.strategies.errors import StrategyUnavailableError
from lightning_rl.models.structure import find_model_roots


def xla_unavailable_reason(inventory: DeviceInventory) -> str | None:
    if not inventory.has_torch_xla:
        return "torch_xla is not installed (it needs the torch version it was built for; on Neuron: torch-neuronx)"
    return None


def neuron_unavailable_reason(inventory: DeviceInventory) -> str | None:
    if inventory.has_native_neuron:
        return None
    if not inventory.has_torch_neuronx:
        return "no Neuron runtime: neither a native 'neuron' device (torch.accelerator) nor torch-neuronx"
    if not inventory.has_torch_xla:
        return "torch-neuronx is installed but torch_xla is not importable"
    return None


class StaticShapes:
    """Marks a strategy whose device compiles once per input shape (read by ``resolve_pad_to_multiple_of``)."""

    requires_static_shapes = True
    static_shape_device_type = "xla"


def check_one_device(trainer: Trainer, name: str) -> None:
    """A single-device strategy given several devices or nodes: Lightning keeps one and says nothing (a trn1's 32
    NeuronCores would train on one, on 1/32 of the batch), so it is refused in one line."""
    connector = trainer._accelerator_connector  # what was asked for: Lightning has already cut it to one device
    asked = connector._devices_flag != "auto"  # devices left at auto (every device, to Lightning) is this one
    devices, nodes = len(connector._parallel_devices or [None]) if asked else 1, int(connector._num_nodes_flag or 1)
    if devices > 1 or nodes > 1:
        raise RecipeError(f"strategy '{name}' trains on one device, but trainer.devices asks for {devices} on {nodes} node(s): "
                          "set trainer.devices: 1 and trainer.num_nodes: 1 (several XLA devices: strategy 'xla_static')", "trainer.devices")


class XLAStaticStrategy(StaticShapes, XLAStrategy):
    """Lightning's XLA strategy with the static-shape policy (registered as ``xla_static``). Untested here."""

    strategy_name = "xla_static"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        reason = xla_unavailable_reason(detect_devices())
        if reason:
            raise StrategyUnavailableError(f"strategy 'xla_static': {reason}; use 'fsdp2' on CPU or CUDA instead")
        super().__init__(*args, **kwargs)


class NeuronAccelerator(Accelerator):
    """The native ``neuron`` device of torch's accelerator API (registered as ``neuron``). Untested here."""

    @override
    def setup_device(self, device: torch.device) -> None:
        torch.accelerator.set_device_index(device.index or 0)

    @override
    def get_device_stats(self, device: torch.device) -> dict[str, Any]:
        return {}

    @override
    def teardown(self) -> None:
        pass

    @staticmethod
    @override
    def parse_devices(devices: int | str | list[int]) -> list[int]:
        """As Lightning reads ``devices`` (``validation.devices``): every device, a count, or the devices named."""
        chosen = validation.devices(devices, "devices")
        if chosen is None:
            return list(range(torch.accelerator.device_count()))
        return list(range(chosen)) if isinstance(chosen, int) else chosen

    @staticmethod
    @override
    def get_parallel_devices(devices: list[int]) -> list[torch.device]:
        return [torch.device("neuron", index) for index in devices]

    @staticmethod
    @override
    def auto_device_count() -> int:
        return torch.accelerator.device_count()

    @staticmethod
    @override
    def is_available() -> bool:
        return detect_devices().has_native_neuron

    @staticmethod
    @override
    def name() -> str:
        return "neuron"


class NeuronStrategy(StaticShapes, SingleDeviceStrategy):
    """One NeuronCore with the static-shape policy (registered as ``neuron``). Untested here.

    With torch-neuronx (an XLA device) use ``xla_static``; this one is for the native ``neuron`` device.
    """

    strategy_name = "neuron"
    static_shape_device_type = "neuron"

    def __init__(self, device: int = 0, **kwargs: Any) -> None:
        inventory = detect_devices()
        if not inventory.has_native_neuron:
            hint = "use 'xla_static' (torch-neuronx is an XLA device)" if inventory.has_torch_neuronx else (
                "install the Neuron SDK (torch-neuronx) on a Trainium/Inferentia instance, or use 'fsdp2' elsewhere"
            )
            reason = neuron_unavailable_reason(inventory) or "no native 'neuron' device is visible"
            raise StrategyUnavailableError(f"strategy 'neuron': {reason}; {hint}")
        super().__init__(device=torch.device("neuron", device), accelerator=NeuronAccelerator(), **kwargs)

    @override
    def setup(self, trainer: Trainer) -> None:
        check_one_device(trainer, self.strategy_name)
        super().setup(trainer)


class StaticShapeCPUStrategy(StaticShapes, SingleDeviceStrategy):
    """A CPU rehearsal of the XLA/Neuron shape policy (registered as ``cpu_static``).

    Rows are padded as on XLA, and each model inside the LightningModule is compiled in place with
    ``dynamic=False``, so every new input shape costs a compile, as it would on the accelerator.

    Args:
        compile_backend: the ``torch.compile`` backend; a counting one turns compiles into a number.
    """

    strategy_name = "cpu_static"

    def __init__(self, compile_backend: str | Callable[..., Any] = "inductor", **kwargs: Any) -> None:
        super().__init__(device=torch.device("cpu"), **kwargs)
        self.compile_backend = compile_backend

    @override
    def setup(self, trainer: Trainer) -> None:
        check_one_device(trainer, self.strategy_name)
        super().setup(trainer)
        module = self.lightning_module
        assert isinstance(module, LightningModule)
        # Past torch's recompile limit (8 shapes) a model runs eagerly, uncounted: the rehearsal counts every shape.
        import torch._dynamo.config as dynamo

        self._limits = {name: getattr(dynamo, name) for name in ("recompile_limit", "accumulated_recompile_limit")}
        for name in self._limits:
            setattr(dynamo, name, 1 << 20)
        for root in find_model_roots(module):
            root.compile(backend=self.compile_backend, dynamic=False)

    @override
    def teardown(self) -> None:
        import torch._dynamo.config as dynamo

        for name, value in getattr(self, "_limits", {}).items():
            setattr(dynamo, name, value)
        super().teardown()
