"""Does GRPO make the SFT model better? The SFT recipe, then the GRPO-from-SFT recipe from its export, as a user runs
them; prints held-out exact match before and after GRPO (the SFT evaluator, the same held-out problems, greedy),
per kind of problem too, and the wall time of each run.
Run: python benchmarks/grpo_learns.py [--workdir /tmp/grpo-learns]   (about three minutes on two CPU cores)
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "grpo_learns.json"


def run(recipe: str, *overrides: str) -> float:
    started = time.perf_counter()
    command = [str(Path(sys.executable).parent / "lightning-rl"), "run", recipe, "--overwrite", "--trainer.enable_progress_bar=false", *overrides]
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/grpo-learns"))
    args = parser.parse_args()
    sft, grpo = args.workdir / "sft", args.workdir / "grpo"
    sft_seconds = run("recipes/tiny/sft.yaml", f"--output_dir={sft}")
    grpo_seconds = run("recipes/tiny/grpo_from_sft.yaml", f"--output_dir={grpo}", f"--model.model_name_or_path={sft / 'hf'}")
    summary = json.loads((grpo / "summary.json").read_text())
    result = {
        "sft_heldout_exact_match": json.loads((sft / "summary.json").read_text())["heldout_exact_match"],
        "grpo_heldout_exact_match_before": summary["heldout_exact_match_before"],
        "grpo_heldout_exact_match_after": summary["heldout_exact_match"],
        "gain_points": round(100 * (summary["heldout_exact_match"] - summary["heldout_exact_match_before"]), 1),
        "per_kind_before": per_kind(sft / "hf"),
        "per_kind_after": per_kind(grpo / "hf"),
        "reward_first_window_mean": summary["reward_first_window_mean"],
        "reward_last_window_mean": summary["reward_last_window_mean"],
        "sft_wall_seconds": round(sft_seconds, 1),
        "grpo_wall_seconds": round(grpo_seconds, 1),
        "grpo_train_seconds": round(summary["train_seconds"], 1),
        "machine": {"cpus": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__},
    }
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
