"""Machines the tests describe rather than have: device inventories of CPU, CUDA, ROCm and Neuron machines, and a
preamble that makes the packages the GPU machine lacks look not installed."""

import textwrap

from lightning_rl.strategies.devices import DeviceInventory

CPU = DeviceInventory(cpu_count=2, machine="x86_64")
CUDA = DeviceInventory(cpu_count=96, machine="x86_64", cuda_version="12.8", gpu_names=("NVIDIA H100 80GB HBM3",) * 8)
ROCM = DeviceInventory(
    cpu_count=64, machine="x86_64", hip_version="6.4.1", gpu_names=("AMD Instinct MI300X",) * 8,
    env={"HIP_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"},
)
NEURON = DeviceInventory(cpu_count=128, machine="x86_64", accelerator_type="neuron", accelerator_count=32)
NEURONX = DeviceInventory(cpu_count=128, machine="x86_64", has_torch_neuronx=True, has_torch_xla=True)

GPU_MACHINE_LACKS = ("jsonargparse", "jsonschema", "wandb", "vllm", "trl", "datasets", "pyarrow")

# Makes the packages the GPU machine lacks look not installed (find_spec answers None, import raises
# ModuleNotFoundError, no distribution metadata), as they are there.
WITHOUT_THEM = textwrap.dedent(f"""
    import sys
    HIDDEN = {set(GPU_MACHINE_LACKS)!r}

    class Absent:
        def __init__(self, finder):
            self.finder = finder

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in HIDDEN or not hasattr(self.finder, "find_spec"):
                return None
            return self.finder.find_spec(name, path, target)

        def find_distributions(self, context=None):
            found = getattr(self.finder, "find_distributions", lambda context: [])(context)
            return [d for d in found if (d.metadata["Name"] or "").lower().replace("_", "-") not in HIDDEN]

        def __getattr__(self, attribute):
            return getattr(self.finder, attribute)

    sys.meta_path[:] = [Absent(finder) for finder in sys.meta_path]
""")
