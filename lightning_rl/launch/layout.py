"""How an allocation is split into ranks, checked against what the recipe asks for."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_rl.launch.recipe_view import LaunchError, RecipeView
from lightning_rl.strategies.availability import LIGHTNING_XLA_NAMES

# Values of `trainer.devices` / `trainer.num_nodes` that mean "whatever the allocation gives".
FILL_FROM_ALLOCATION = (None, "auto", -1, "-1")


@dataclass(frozen=True)
class Allocation:
    """What is asked of SLURM (or torchrun): nodes and devices per node."""

    nodes: int
    gpus_per_node: int
    inference_nodes: int = 0


@dataclass(frozen=True)
class TrainerLayout:
    """The ranks the trainer runs on, and the nodes left to the vLLM servers (GRPO)."""

    trainer_nodes: int
    devices_per_node: int
    inference_nodes: int
    accelerator: str

    @property
    def world_size(self) -> int:
        return self.trainer_nodes * self.devices_per_node

    @property
    def uses_gpus(self) -> bool:
        return self.accelerator not in ("cpu", "xla")

    @property
    def uses_xla(self) -> bool:
        """Neuron or another XLA device: SLURM gives those as whole nodes (no GPU resource to ask for)."""
        return self.accelerator == "xla"


def resolve_layout(recipe: RecipeView, allocation: Allocation) -> TrainerLayout:
    """Check the recipe fits the allocation exactly, so a bad request fails here, not as a hung job."""
    if allocation.nodes < 1 or allocation.gpus_per_node < 1:
        raise LaunchError(
            f"--nodes ({allocation.nodes}) and --gpus-per-node ({allocation.gpus_per_node}) must be at least 1"
        )
    task = recipe.task
    if task == "sft" and allocation.inference_nodes:
        raise LaunchError("--inference-nodes is for GRPO recipes; an SFT recipe trains on every node")
    trainer_nodes = allocation.nodes - allocation.inference_nodes
    if trainer_nodes < 1:
        raise LaunchError(
            f"--nodes {allocation.nodes} leaves no trainer node after {allocation.inference_nodes} vLLM server node(s)"
        )
    _check_matches(recipe, "trainer.devices", allocation.gpus_per_node, "--gpus-per-node", "devices per node")
    _check_matches(recipe, "trainer.num_nodes", trainer_nodes, _trainer_nodes_flag(allocation), "trainer nodes")
    accelerator = _device_kind(recipe.get("trainer.accelerator", "auto"), recipe.get("trainer.strategy", "auto"))
    layout = TrainerLayout(trainer_nodes, allocation.gpus_per_node, allocation.inference_nodes, accelerator)
    _check_parallel_sizes(recipe, layout)
    return layout


# Lightning's names of its XLA strategies, ours, and the XLA accelerators (Neuron, TPU); class paths that hold them.
_XLA_NAMES = LIGHTNING_XLA_NAMES | {"xla_static", "neuron", "tpu"}


def _device_kind(accelerator: object, strategy: object) -> str:
    """``cpu``, ``xla`` (Neuron, TPU: named by the accelerator or the strategy) or, for anything else, the
    accelerator's name (a GPU's)."""
    def name(value: object) -> str:
        return str(value.get("class_path", "") if isinstance(value, dict) else value).lower()

    if any(name(value) in _XLA_NAMES or any(word in name(value) for word in ("neuron", "xla")) for value in (accelerator, strategy)):
        return "xla"
    return name(accelerator)


def _trainer_nodes_flag(allocation: Allocation) -> str:
    if allocation.inference_nodes:
        return f"--nodes minus --inference-nodes ({allocation.nodes} - {allocation.inference_nodes})"
    return "--nodes"


def _check_matches(recipe: RecipeView, key: str, available: int, flag: str, what: str) -> None:
    asked = recipe.get(key)
    if asked in FILL_FROM_ALLOCATION:
        return
    if isinstance(asked, str) and asked.isdigit():  # `--trainer.devices=8` on the command line
        asked = int(asked)
    if isinstance(asked, bool) or not isinstance(asked, int):
        raise LaunchError(f"{recipe.path}: `{key}` must be an integer or 'auto' for a launch, got {asked!r}")
    if asked > available:
        raise LaunchError(
            f"{recipe.path}: `{key}: {asked}` asks for more {what} than the allocation has ({flag} = {available})"
        )
    if asked < available:
        raise LaunchError(
            f"{recipe.path}: `{key}: {asked}` would leave {available - asked} of {available} {what} idle "
            f"({flag} = {available}); set `{key}: auto` or match the allocation"
        )


def _parallel_size(recipe: RecipeView, name: str) -> int | None:
    value = recipe.get(f"trainer.strategy.{name}")
    if value in (None, "auto"):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LaunchError(f"{recipe.path}: `trainer.strategy.{name}` must be a positive integer or 'auto', got {value!r}")
    return value


def _check_parallel_sizes(recipe: RecipeView, layout: TrainerLayout) -> None:
    """World = data-parallel x tensor-parallel (the sizes of Lightning's ModelParallelStrategy); experts split in a node."""
    world = layout.world_size
    ranks = f"{layout.trainer_nodes} node(s) x {layout.devices_per_node} = {world} ranks"
    tensor = _parallel_size(recipe, "tensor_parallel_size") or 1
    if tensor > layout.devices_per_node or layout.devices_per_node % tensor:
        raise LaunchError(
            f"{recipe.path}: `trainer.strategy.tensor_parallel_size: {tensor}` must divide the "
            f"{layout.devices_per_node} devices of one node (tensor parallelism stays inside a node)"
        )
    data = _parallel_size(recipe, "data_parallel_size")
    if data is not None and data * tensor != world:
        raise LaunchError(
            f"{recipe.path}: {ranks}, but `trainer.strategy.data_parallel_size: {data}` x "
            f"tensor_parallel_size {tensor} = {data * tensor}; the node count does not fit this layout"
        )
    experts = _parallel_size(recipe, "expert_parallel_size") or 1
    if experts > layout.devices_per_node or layout.devices_per_node % experts:
        raise LaunchError(
            f"{recipe.path}: `trainer.strategy.expert_parallel_size: {experts}` must divide the "
            f"{layout.devices_per_node} devices of one node (the experts' all-to-all stays inside a node)"
        )
