"""Does GRPO make the SFT model better, on every seed? For each seed, the SFT recipe, then the GRPO-from-SFT recipe
from its export, as a user runs them (``--seed=S`` on both); held-out exact match before and after GRPO (the SFT
evaluator, the same held-out problems, greedy), per kind of problem too, and the wall time of each run. Reports the
mean and the smallest gain over the seeds (the demo must hold on each, not on one lucky seed). CPU seconds are the
runs' processes' own (user + system, every thread), which a machine busy with other work inflates less than wall
seconds; the load average before and after each seed says how busy it was.
Run: OMP_NUM_THREADS=1 python benchmarks/grpo_learns.py [--seeds 3] [--workdir DIR]   (about 5 CPU minutes a seed, SFT
and GRPO; --sft-steps/--grpo-steps shorten the runs for a smoke test, with --out elsewhere)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "grpo_learns.json"
SFT_RECIPE, GRPO_FROM_SFT_RECIPE = "recipes/tiny/sft.yaml", "recipes/tiny/grpo_from_sft.yaml"


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(recipe: str, *overrides: str) -> tuple[float, float]:
    """Wall and CPU seconds of one ``lightning-rl run``."""
    started, cpu = time.perf_counter(), children_cpu_seconds()
    command = [str(Path(sys.executable).parent / "lightning-rl"), "run", recipe, "--overwrite", "--trainer.enable_progress_bar=false", *overrides]
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started, children_cpu_seconds() - cpu


def run_sft(seed: int, out: Path, *overrides: str) -> tuple[float, float]:
    """The SFT recipe as a user runs it, its export in ``out/hf``: wall and CPU seconds."""
    return run(SFT_RECIPE, f"--output_dir={out}", f"--seed={seed}", *overrides)


def per_kind(model_dir: Path) -> dict[str, float]:
    """Held-out exact match by kind of problem, with the evaluator both recipes use."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightning_rl.modules.evaluation import exact_match, heldout_cases
    from lightning_rl.toy.task import HELDOUT_FILE, read_jsonl

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    cases = heldout_cases(str(HELDOUT_FILE), tokenizer, str(model_dir))
    kinds = [row["kind"] for row in read_jsonl(HELDOUT_FILE)]
    out = {}
    for kind in sorted(set(kinds)):
        chosen = [case for case, k in zip(cases, kinds, strict=True) if k == kind]
        out[kind] = exact_match(model, tokenizer, chosen, max_new_tokens=16)["heldout_exact_match"]
    return out


def one_seed(seed: int, workdir: Path, sft_steps: list[str], grpo_steps: list[str]) -> dict:
    sft, grpo = workdir / f"seed{seed}" / "sft", workdir / f"seed{seed}" / "grpo"
    load_before = os.getloadavg()[0]
    sft_seconds, sft_cpu = run_sft(seed, sft, *sft_steps)
    grpo_seconds, grpo_cpu = run(GRPO_FROM_SFT_RECIPE, f"--output_dir={grpo}", f"--model.model_name_or_path={sft / 'hf'}",
                       f"--seed={seed}", *grpo_steps)  # fmt: skip
    summary = json.loads((grpo / "summary.json").read_text())
    return {
        "seed": seed,
        "sft_heldout_exact_match": json.loads((sft / "summary.json").read_text())["heldout_exact_match"],
        "grpo_heldout_exact_match_before": summary["heldout_exact_match_before"],
        "grpo_heldout_exact_match_after": summary["heldout_exact_match"],
        "gain_points": round(100 * (summary["heldout_exact_match"] - summary["heldout_exact_match_before"]), 1),
        "per_kind_before": per_kind(sft / "hf"),
        "per_kind_after": per_kind(grpo / "hf"),
        "reward_first_window_mean": summary["reward_first_window_mean"],
        "reward_last_window_mean": summary["reward_last_window_mean"],
        "sft_wall_seconds": round(sft_seconds, 1),
        "sft_cpu_seconds": round(sft_cpu, 1),
        "grpo_wall_seconds": round(grpo_seconds, 1),
        "grpo_cpu_seconds": round(grpo_cpu, 1),
        "grpo_train_seconds": round(summary["train_seconds"], 1),
        "load_average_1min_before": round(load_before, 2),
        "load_average_1min_after": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1, each a whole SFT + GRPO pair")
    parser.add_argument("--workdir", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--sft-steps", type=int, default=None, help="override the SFT recipe's max_steps (smoke runs)")
    parser.add_argument("--grpo-steps", type=int, default=None, help="override the GRPO recipe's max_steps (smoke runs)")
    parser.add_argument("--note", default="", help="what else ran on the machine meanwhile, written as machine_note")
    args = parser.parse_args(argv)
    steps = lambda n: [] if n is None else [f"--trainer.max_steps={n}"]  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="grpo-learns-") as tmp:
        workdir = args.workdir or Path(tmp)
        runs = [one_seed(seed, workdir, steps(args.sft_steps), steps(args.grpo_steps)) for seed in range(args.seeds)]
    gains = [r["gain_points"] for r in runs]
    result = {
        "seeds": args.seeds,
        "gain_points_mean": round(statistics.mean(gains), 1),
        "gain_points_min": min(gains),
        "gain_points_max": max(gains),
        "gain_points_std": round(statistics.stdev(gains), 1) if len(gains) > 1 else 0.0,
        "grpo_heldout_exact_match_before_mean": round(statistics.mean(r["grpo_heldout_exact_match_before"] for r in runs), 4),
        "grpo_heldout_exact_match_after_mean": round(statistics.mean(r["grpo_heldout_exact_match_after"] for r in runs), 4),
        "grpo_train_seconds_max": max(r["grpo_train_seconds"] for r in runs),
        "grpo_cpu_seconds_max": max(r["grpo_cpu_seconds"] for r in runs),
        "per_seed": runs,
        "command": " ".join(["python benchmarks/grpo_learns.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                    "python": platform.python_version(), "torch": torch.__version__},
        "machine_note": args.note,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "per_seed"}, indent=1))


if __name__ == "__main__":
    main()
