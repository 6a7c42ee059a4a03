"""AMD GPUs through a ROCm build of torch: detection, RCCL, visible-device variables.

A ROCm torch exposes AMD GPUs through the ``torch.cuda`` API, reports ``torch.version.hip``, and its
``nccl`` process-group backend is RCCL. Attention needs nothing of its own: the tree attention's SDPA kernels run on
ROCm's torch as on CUDA's. No ROCm build of torch is installable on the machine this is developed on, so these paths
are tested only through :class:`DeviceInventory` inputs (mocked machines), never on an AMD GPU.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from lightning_rl.strategies.devices import DeviceInventory, detect_devices
from lightning_rl.strategies.errors import StrategyUnavailableError
from lightning_rl.strategies.fsdp2 import FSDP2Strategy

# ROCm reads HIP_VISIBLE_DEVICES (and ROCR_VISIBLE_DEVICES below it); launchers and schedulers mostly set
# CUDA_VISIBLE_DEVICES, which a ROCm torch also honours, so engine processes get both, equal.
_VISIBLE = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


def rocm_unavailable_reason(inventory: DeviceInventory) -> str | None:
    if not inventory.is_rocm:
        build = f"a CUDA {inventory.cuda_version} build" if inventory.cuda_version else "a CPU-only build"
        return f"this torch is {build} (torch.version.hip is None); AMD GPUs need a ROCm build of torch"
    if inventory.gpu_count == 0:
        shown = ", ".join(f"{k}={v}" for k, v in inventory.env.items()) or "no visible-device variable set"
        return f"ROCm torch {inventory.hip_version} sees no AMD GPU ({shown})"
    return None


def engine_visible_devices(env: Mapping[str, str], inventory: DeviceInventory) -> dict[str, str]:
    """The visible-device variables an engine process needs, so it sees the GPUs the trainer meant.

    On ROCm, ``HIP_VISIBLE_DEVICES`` and ``CUDA_VISIBLE_DEVICES`` are made equal (whichever is set wins);
    two different values are refused, since the process would see a different set of GPUs per library.
    """
    values = {key: env[key] for key in _VISIBLE if key in env}
    if not inventory.is_rocm:
        if "HIP_VISIBLE_DEVICES" in values:
            raise StrategyUnavailableError(
                f"HIP_VISIBLE_DEVICES={values['HIP_VISIBLE_DEVICES']} is a ROCm setting, but this torch is not a ROCm "
                "build; use CUDA_VISIBLE_DEVICES instead"
            )
        return values
    if len(set(values.values())) > 1:
        raise StrategyUnavailableError(
            f"CUDA_VISIBLE_DEVICES={values['CUDA_VISIBLE_DEVICES']} and HIP_VISIBLE_DEVICES="
            f"{values['HIP_VISIBLE_DEVICES']} disagree; set only one of them"
        )
    if not values:
        return {}
    chosen = next(iter(values.values()))
    return {key: chosen for key in _VISIBLE}


class ROCmFSDP2Strategy(FSDP2Strategy):
    """FSDP2 on AMD GPUs over RCCL (registered as ``fsdp2_rocm``). Untested on real hardware here.

    Refuses to start on anything but a ROCm torch with a visible AMD GPU, so a CUDA or CPU machine gets a
    clear message instead of a late, obscure failure. Sets ``CUDA_VISIBLE_DEVICES`` and ``HIP_VISIBLE_DEVICES`` equal
    in this process (``engine_visible_devices``), so the engine processes a run starts inherit the GPUs it meant.
    """

    strategy_name = "fsdp2_rocm"

    def __init__(self, *args: Any, inventory: DeviceInventory | None = None, **kwargs: Any) -> None:
        inventory = inventory or detect_devices()
        reason = rocm_unavailable_reason(inventory)
        if reason:
            raise StrategyUnavailableError(f"strategy 'fsdp2_rocm': {reason}; use 'fsdp2' instead")
        os.environ.update(engine_visible_devices(inventory.env, inventory))
        kwargs.setdefault("process_group_backend", "nccl")  # RCCL answers to the name "nccl" on ROCm
        super().__init__(*args, **kwargs)
