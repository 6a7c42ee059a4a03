"""What hardware this process can see (the shape policy that follows from it is ``lightning_rl.device_policy``).

Detection reads torch's own answers (``torch.cuda``, ``torch.version.hip``, ``torch.accelerator``) and
looks for optional runtimes (``torch_neuronx``, ``torch_xla``) by import spec, so an absent backend is a
fact to report, never an error. Every decision function takes a :class:`DeviceInventory`, which lets
tests describe machines (ROCm, Neuron) that cannot exist on the machine running them.
"""

from __future__ import annotations

import importlib.util
import os
import platform
from dataclasses import dataclass, field

import torch

@dataclass(frozen=True)
class DeviceInventory:
    """The devices and runtimes one process can use."""

    cpu_count: int
    machine: str
    cuda_version: str | None = None
    hip_version: str | None = None
    gpu_names: tuple[str, ...] = ()
    accelerator_type: str | None = None
    accelerator_count: int = 0
    has_torch_neuronx: bool = False
    has_torch_xla: bool = False
    env: dict[str, str] = field(default_factory=dict)

    @property
    def is_rocm(self) -> bool:
        return self.hip_version is not None

    @property
    def has_native_neuron(self) -> bool:
        return self.accelerator_type == "neuron" and self.accelerator_count > 0

    @property
    def gpu_count(self) -> int:
        return len(self.gpu_names)


def module_installed(name: str) -> bool:
    """Whether ``import name`` would find a module, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def detect_devices() -> DeviceInventory:
    """Inspect this process: CPU, CUDA or ROCm GPUs, a native accelerator device, Neuron and XLA runtimes."""
    gpu_names: tuple[str, ...] = ()
    if torch.cuda.is_available():
        gpu_names = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    accelerator_type = accelerator.type if accelerator is not None else None
    accelerator_count = torch.accelerator.device_count() if accelerator is not None else 0
    visible = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "NEURON_RT_VISIBLE_CORES")
    return DeviceInventory(
        cpu_count=os.cpu_count() or 1,
        machine=platform.machine(),
        cuda_version=torch.version.cuda,
        hip_version=torch.version.hip,
        gpu_names=gpu_names,
        accelerator_type=accelerator_type,
        accelerator_count=accelerator_count,
        has_torch_neuronx=module_installed("torch_neuronx"),
        has_torch_xla=module_installed("torch_xla"),
        env={key: os.environ[key] for key in visible if key in os.environ},
    )
