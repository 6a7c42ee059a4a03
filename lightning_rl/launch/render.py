"""Render an sbatch script for a recipe from the templates beside this file."""

from __future__ import annotations

import json
import re
import shlex
import string
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from lightning_rl.launch.layout import Allocation, TrainerLayout, resolve_layout
from lightning_rl.launch.recipe_view import LaunchError, RecipeView
from lightning_rl.models.paths import EMBEDDED
from lightning_rl.rollout.base import EngineSpec
from lightning_rl.rollout.vllm_server import VLLMServerEngine
from lightning_rl.rollout.vllm_server_process import VLLMServer

# SLURM's own time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
# Minutes and seconds below 60 (SLURM would carry them over); no limit as SLURM names it.
SLURM_TIME = re.compile(r"^((\d+-)?\d+(:[0-5]\d){0,2}|(?i:unlimited|infinite))$")
# What an `#SBATCH` value may hold unquoted.
_PLAIN = re.compile(r"[\w@%+=:,./-]+")


class _ScriptTemplate(string.Template):
    """`@{name}` placeholders only, so the shell's `$VAR`, `%j` and `SIGUSR1@90` pass through untouched."""

    delimiter = "@"
    pattern = r"@(?:(?P<escaped>(?!))|\{(?P<braced>[a-z_]+)\}|(?P<named>(?!))|(?P<invalid>(?!)))"


@dataclass(frozen=True)
class SlurmOptions:
    """What the job asks SLURM for besides nodes and devices."""

    partition: str | None
    time: str = "04:00:00"
    job_name: str | None = None
    log_dir: str = "logs/slurm"
    cpus_per_task: int | None = None
    vllm_port: int = 8000
    run_overrides: tuple[str, ...] = field(default_factory=tuple)


def job_name(recipe: RecipeView, options: SlurmOptions) -> str:
    return options.job_name or f"lrl-{recipe.path.stem}"


def _template(name: str) -> str:
    return resources.files("lightning_rl.launch").joinpath("templates", name).read_text()


def _check_options(options: SlurmOptions) -> None:
    if any(arg == "--overwrite" or arg.startswith("--overwrite=") for arg in options.run_overrides):
        # Every start of the job, requeues included, runs one command, and it must resume (--ckpt_path=last): a
        # command that also replaced the run would be refused by `run` inside the job, after the queue wait.
        raise LaunchError("--overwrite: a launched job resumes its run on every start (--ckpt_path=last), so it cannot "
                          "also replace one; remove the earlier run's output_dir or choose another output_dir")
    if not options.partition:
        raise LaunchError("no partition given: pass --partition NAME (`sinfo -s` lists the partitions)")
    if not SLURM_TIME.match(options.time):
        raise LaunchError(f"--time {options.time!r} is not a SLURM time (e.g. 04:00:00 or 1-12:00:00)")
    for flag, value in (("--partition", options.partition), ("--job-name", options.job_name), ("--log-dir", options.log_dir)):
        if value is not None and ("\n" in value or "\0" in value):
            raise LaunchError(f"{flag} {value!r} holds a line break, which a script line cannot hold")


def _sbatch(value: str) -> str:
    """A value for an ``#SBATCH`` line, which sbatch splits itself: double-quoted when it needs to be (sbatch reads
    double quotes and backslashes as a shell does, and expands nothing)."""
    if _PLAIN.fullmatch(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _in_double_quotes(value: str) -> str:
    """``value`` as the shell reads it inside double quotes: nothing in it expands or ends the string."""
    return re.sub(r'([\\"$`])', r"\\\1", value)


def _trainer_overrides(recipe: RecipeView, layout: TrainerLayout, options: SlurmOptions) -> str:
    args = [f"--trainer.num_nodes={layout.trainer_nodes}", f"--trainer.devices={layout.devices_per_node}"]
    # A requeued job starts the same command again; it must pick up the last checkpoint, not start over. Another
    # checkpoint would be taken again at every start, training again what the job trained since.
    overrides = list(options.run_overrides)
    named = [arg.partition("=")[2] if "=" in arg else (overrides[i + 1] if i + 1 < len(overrides) else "")
             for i, arg in enumerate(overrides) if arg.split("=")[0] == "--ckpt_path"]  # fmt: skip
    given = named[-1] if named else recipe.get("ckpt_path")
    if given not in (None, "last"):  # null too: a requeued start would find the run's folder taken
        raise LaunchError(f"ckpt_path: {given}: a launched job resumes from its own last checkpoint at every start (SLURM requeues "
                          "it), so it cannot start from another one; run from it once with lightning-rl run, then launch")
    if not named:
        args.append("--ckpt_path=last")
    args += options.run_overrides
    return " ".join(shlex.quote(arg) for arg in args)


_EMBEDDED_FOLDER = "@EMBEDDED_MODEL_FOLDER@"  # stands in for the folder until the command is one line


def _server_command(recipe: RecipeView, layout: TrainerLayout, options: SlurmOptions) -> str:
    """The engine's own server command line, tensor-parallel over the server node's devices."""
    engine = recipe.get("model.engine") or "hf"
    try:
        spec = EngineSpec.of(engine)
    except ValueError as err:
        raise LaunchError(f"{recipe.path}: `model.engine`: {err}") from None
    if not issubclass(spec.engine_class, VLLMServerEngine):
        raise LaunchError(
            f"{recipe.path}: a GRPO launch runs the rollouts on a vLLM server node, so `model.engine` must be "
            f"VLLMServerEngine (class_path), got {spec.engine_class.__name__}"
        )
    server_options = dict(spec.init_args.get("server_options") or {})
    for local_only in ("env", "log_path", "port", "host", "whole_prefills", "on_cpu"):
        server_options.pop(local_only, None)
    server_options.setdefault("python", "python")
    extra = list(server_options.pop("extra_args", ())) + ["--tensor-parallel-size", str(layout.devices_per_node)]
    # The trainer's engine on "auto" follows the backend the server runs: nccl between GPU nodes, else gloo.
    transport = spec.init_args.get("transport", "auto")
    if transport == "auto":
        transport = "nccl" if layout.uses_gpus else "gloo"
    # An embedded model has no hub id: the server's own Python builds it into its cache (LIGHTNING_RL_CACHE, on the
    # job's shared file system as the recipe and the run folder are) and the server loads that folder.
    model = _EMBEDDED_FOLDER if recipe.model_id in EMBEDDED else recipe.model_id
    try:
        server = VLLMServer(
            model, host="0.0.0.0", port=options.vllm_port, transport=transport, extra_args=extra,
            on_cpu=not layout.uses_gpus, **server_options,  # decided by the server node's devices, not this one's
        )
    except (TypeError, ValueError) as err:
        raise LaunchError(f"{recipe.path}: `model.engine.init_args.server_options`: {err}") from None
    command = shlex.join(server.command)
    if model is _EMBEDDED_FOLDER:
        build = f"from lightning_rl.models.paths import resolve_model_path; print(resolve_model_path({json.dumps(recipe.model_id)}))"
        folder = f"$({shlex.quote(str(server_options['python']))} -c {shlex.quote(build)})"
        command = command.replace(_EMBEDDED_FOLDER, f'"{folder}"')
    return command


def render_slurm_script(recipe: RecipeView, allocation: Allocation, options: SlurmOptions) -> str:
    """The sbatch script text; every inconsistency is raised as a `LaunchError` before anything is written."""
    _check_options(options)
    layout = resolve_layout(recipe, allocation)
    if recipe.task == "grpo" and layout.inference_nodes != 1:
        raise LaunchError(
            f"a GRPO launch needs exactly one vLLM server node (--inference-nodes 1), got {layout.inference_nodes}: "
            "the server engine talks to one server"
        )
    # Optional header lines, each carrying its own leading newline so an absent one leaves no gap.
    gpu_request = f"\n#SBATCH --gpus-per-node={allocation.gpus_per_node}" if layout.uses_gpus else ""
    if layout.uses_xla:  # a Neuron (XLA) node is the job's whole: its devices are no SLURM GPU resource
        gpu_request = "\n#SBATCH --exclusive"
    if options.cpus_per_task:
        gpu_request += f"\n#SBATCH --cpus-per-task={options.cpus_per_task}"
    if "\n" in str(recipe.path):
        raise LaunchError(f"the recipe path {str(recipe.path)!r} holds a line break, which a script line cannot hold")
    values = {
        "recipe": shlex.quote(str(recipe.path)),
        "job_name": _sbatch(job_name(recipe, options)),
        "partition": _sbatch(options.partition),
        "nodes": str(allocation.nodes),
        "trainer_nodes": str(layout.trainer_nodes),
        "inference_nodes": str(layout.inference_nodes),
        "trainer_tasks": str(layout.world_size),
        "tasks_per_node": str(layout.devices_per_node),
        "gpu_request": gpu_request,
        "time": options.time,
        "job_output": _sbatch(f"{options.log_dir}/%x-%j.out"),
        "log_dir": _in_double_quotes(options.log_dir),
        "vllm_port": str(options.vllm_port),
        "server_command": _server_command(recipe, layout, options) if recipe.task == "grpo" else "",
        "trainer_overrides": _trainer_overrides(recipe, layout, options),
    }
    values["common_env"] = _ScriptTemplate(_template("common_env.sh")).substitute(values).rstrip("\n")
    body = _template("grpo.sbatch" if recipe.task == "grpo" else "train.sbatch")
    return _ScriptTemplate(body).substitute(values)


def write_script(text: str, path: Path) -> None:
    """Write atomically, so an existing script is never left half-written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    partial.chmod(0o755)
    partial.replace(path)
