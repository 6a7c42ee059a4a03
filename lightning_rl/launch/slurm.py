"""`lightning-rl launch slurm RECIPE.yaml --nodes N --gpus-per-node G`: render, then submit or print."""

from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from lightning_rl import validation
from lightning_rl.errors import UserError, report
from lightning_rl.models.paths import EMBEDDED, HUB_ID
from lightning_rl.launch.layout import Allocation
from lightning_rl.launch.recipe_view import MODEL_KEY, FlagParser, LaunchError, RecipeView, split_overrides
from lightning_rl.launch.render import SLURM_TIME, SlurmOptions, job_name, render_slurm_script, write_script


def _parser() -> argparse.ArgumentParser:
    parser = FlagParser(
        prog="lightning-rl launch slurm",
        description="Render an sbatch script for a recipe and submit it. Arguments after `--` are passed to "
        "`lightning-rl run` (e.g. -- --output_dir=runs/a --trainer.max_steps=100).",
    )
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--nodes", type=int, required=True, help="nodes in the allocation")
    parser.add_argument("--gpus-per-node", type=int, required=True, help="devices (one task each) per node")
    parser.add_argument("--partition", help="SLURM partition (required)")
    parser.add_argument("--time", default="04:00:00", help="time limit, SLURM format")
    parser.add_argument("--inference-nodes", type=int, default=0, help="GRPO: nodes serving vLLM")
    parser.add_argument("--job-name", help="defaults to lrl-<recipe name>")
    parser.add_argument("--log-dir", default="logs/slurm", help="job log and per-rank logs go here")
    parser.add_argument("--cpus-per-task", type=int)
    parser.add_argument("--vllm-port", type=int, default=8000, help="GRPO: port of the vLLM server")
    parser.add_argument("--script", type=Path, help="where to write the script (default: LOG_DIR/JOB_NAME.sbatch)")
    parser.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")
    return parser


def known_partitions() -> list[str] | None:
    """Partitions `sinfo` reports, or None where no SLURM client is installed."""
    if shutil.which("sinfo") is None:
        return None
    listing = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, check=False)
    if listing.returncode != 0:
        raise LaunchError(f"sinfo failed (is the SLURM controller reachable?): {listing.stderr.strip()}")
    return [name.rstrip("*") for name in listing.stdout.split()]


def _check_partition(partition: str, nodes: int, time: str) -> None:
    """The partition exists, has ``nodes`` nodes and allows ``time``: SLURM accepts a job past a partition's limits
    (``EnforcePartLimits=NO``, its default) and leaves it pending for ever."""
    partitions = known_partitions()
    if partitions is None:
        return
    if partition not in partitions:
        raise LaunchError(f"partition {partition!r} does not exist on this cluster; sinfo lists: {', '.join(partitions)}")
    listing = subprocess.run(["sinfo", "-h", "-p", partition, "-o", "%l %D"], capture_output=True, text=True, check=False)
    rows = [line.split() for line in listing.stdout.splitlines() if len(line.split()) == 2]
    if listing.returncode != 0 or not rows:
        return
    total = sum(int(count) for _, count in rows if count.isdigit())
    if nodes > total:
        raise LaunchError(f"--nodes {nodes}: partition {partition!r} has {total} node{'s' * (total != 1)}")
    limit = rows[0][0]
    if SLURM_TIME.match(limit) and slurm_minutes(time) > slurm_minutes(limit):
        raise LaunchError(f"--time {time}: partition {partition!r} allows a job at most {limit}")


def slurm_minutes(text: str) -> float:
    """A SLURM time (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``) in minutes; no limit
    (``UNLIMITED``, ``INFINITE``, as sinfo says it) is infinitely many."""
    if text.lower() in ("unlimited", "infinite"):
        return math.inf
    days, _, rest = text.rpartition("-")
    parts = [int(part) for part in rest.split(":")]
    if days:
        hours, minutes, seconds = (parts + [0, 0])[:3]
        return int(days) * 1440 + hours * 60 + minutes + seconds / 60
    if len(parts) == 1:  # MM
        return parts[0]
    if len(parts) == 2:  # MM:SS
        return parts[0] + parts[1] / 60
    return parts[0] * 60 + parts[1] + parts[2] / 60


def _note_missing_paths(recipe: RecipeView) -> None:
    """A model folder or data file the recipe names that this machine does not have: said before the queue wait, as a
    note (a node's own disk may hold it), rather than found by the job once it starts. A model name that reads as a Hub
    id (``Qwen/Qwen3-0.6B``) is fetched on the nodes, and a bare word is an embedded model or task (``tiny``, ``toy``);
    data is read from files alone, so any other data path is noted (``trl-lib/Capybara`` too)."""
    keys = ("data.train_data", "data.val_data") if recipe.task == "sft" else ("data.train_data", "data.path", "model.eval_data")
    for key, value in ((MODEL_KEY, recipe.model_id), *((key, recipe.get(key)) for key in keys)):
        if not isinstance(value, str) or value in EMBEDDED or Path(value).expanduser().exists():
            continue
        local = value.startswith(("/", "./", "../", "~")) or not HUB_ID.fullmatch(value)
        if local or (key != MODEL_KEY and ("/" in value or Path(value).suffix)):
            print(f"note: {key}: {value} is not on this machine; the job fails unless its nodes have it", file=sys.stderr)


def _split_overrides(argv: Sequence[str]) -> tuple[list[str], tuple[str, ...]]:
    return split_overrides(argv[1:] if list(argv[:1]) == ["slurm"] else argv)


def _check_flags(args: argparse.Namespace) -> None:
    for flag, value in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node), ("--cpus-per-task", args.cpus_per_task)):
        if value is not None:
            validation.positive_int(flag, value)
    validation.non_negative_int("--inference-nodes", args.inference_nodes)
    if not 1 <= args.vllm_port <= 65535:
        raise LaunchError(f"--vllm-port must be a port number (1 to 65535), got {args.vllm_port}")


def main(argv: Sequence[str] | None = None) -> int:
    own_args, overrides = _split_overrides(sys.argv[1:] if argv is None else argv)
    try:
        if len(own_args) > 1 and own_args[0].isidentifier() and not Path(own_args[0]).exists() and not own_args[1].startswith("-"):
            # `launch torchrun RECIPE.yaml`: another launcher's name where the recipe goes
            raise LaunchError(f"launch {own_args[0]}: launch renders SLURM jobs (lightning-rl launch [slurm] RECIPE.yaml --nodes N "
                              "--gpus-per-node G); without SLURM, launch/torchrun.sh starts a run on each node")
        args = _parser().parse_args(own_args)
        _check_flags(args)
        options = SlurmOptions(
            partition=args.partition,
            time=args.time,
            job_name=args.job_name,
            log_dir=args.log_dir,
            cpus_per_task=args.cpus_per_task,
            vllm_port=args.vllm_port,
            run_overrides=overrides,
        )
        # The recipe as `lightning-rl run` will read it in the job: the same parser, the overrides applied.
        recipe = RecipeView.parse(args.recipe, overrides)
        _note_missing_paths(recipe)
        script = render_slurm_script(recipe, Allocation(args.nodes, args.gpus_per_node, args.inference_nodes), options)
        if args.dry_run:
            print(script, end="")
            return 0
        if shutil.which("sbatch") is None:
            raise LaunchError("no sbatch on this machine: submit from a SLURM login node, or print the script with --dry-run")
        _check_partition(args.partition, args.nodes, args.time)
        path = args.script or Path(args.log_dir) / f"{job_name(recipe, options)}.sbatch"
        write_script(script, path)
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    except UserError as error:
        return report(error)
    submitted = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, check=False)
    if submitted.returncode != 0:
        print(f"error: sbatch {path} failed: {submitted.stderr.strip()}", file=sys.stderr)
        return 1
    print(f"submitted job {submitted.stdout.strip().split(';')[0]} ({path})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
