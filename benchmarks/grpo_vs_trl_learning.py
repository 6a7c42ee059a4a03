"""Does our GRPO learn as TRL 1.16's does? The same tiny model, task, rewards and hyper-parameters, several seeds each.

    python benchmarks/grpo_vs_trl_learning.py [--steps 30] [--seeds 3] [--threads 1]
        -> benchmarks/results/grpo_vs_trl_learning.json and .png (the plot needs matplotlib)
    python benchmarks/grpo_vs_trl_learning.py --from-sft [--steps 400] [--seeds 3] [--threads 1]
        -> benchmarks/results/grpo_vs_trl_learning_from_sft.json and .png
    python benchmarks/grpo_vs_trl_learning.py [--from-sft] --report-only
        -> that JSON's summaries, verdict, differences (with their permutation p-values) and plot redone from its runs
    python benchmarks/grpo_vs_trl_learning.py [--from-sft] --extend --seeds N
        -> N more seeds added to that JSON (it must hold the same settings and versions); summaries, verdict, plot redone
    python benchmarks/grpo_vs_trl_learning.py [--from-sft] --replay [--steps 150] [--seeds 2]
        -> benchmarks/results/grpo_vs_trl_replay[_from_sft].json: our run's samples replayed through TRL's trainer

Both sides start from the embedded ``tiny`` model and train on the embedded toy prompts (``problems.jsonl``: chat
messages without the reply, the ``answer`` column the reward's reference) with ``recipes/tiny/grpo.yaml``'s settings:
G=8 completions of up to 4 tokens at temperature 1 (top-p 1, top-k off), 4 prompts a step, one optimizer step per
generation batch, DAPO loss with epsilon 0.2/0.28 and beta 0, group-std advantages, AdamW at a constant 2e-3, no
weight decay, gradient norm clipped at 1, fp32 on a CPU. Rewards: our ``math_answer`` (weight 1) and ``format_match``
(weight 0.5, a reply starting with a digit), called on the reply text by both sides. Ours runs the recipe through
``lightning_rl.cli.main`` (its own Trainer, the ``hf`` rollout engine); TRL's ``GRPOTrainer`` generates with
transformers' ``generate``. One evaluator for both: our greedy held-out exact match (``modules/evaluation.py``, the
200 held-out problems) on each exported model folder. Wall time: everything a user waits for, from building the
trainer to the exported folder; CPU time: this process's (every thread's) over the same span, which a busy machine
inflates less than the wall time; the load average before and after each run says how busy the machine was.

``--from-sft``: the untrained tiny model answers no held-out problem before or after, so the comparison above says
nothing about held-out gains. This one starts both sides from one SFT'd model (``recipes/tiny/sft.yaml`` at seed 0,
run once as ``benchmarks/grpo_learns.py`` runs it) and uses ``recipes/tiny/grpo_from_sft.yaml``'s GRPO settings, the
demo's: 16 prompts a step, AdamW at 3e-4, beta 0.3 (k3 KL to the SFT model), 20-step reward windows, the rest as
above. Ours logs every step and skips the recipe's own before/after held-out decoding (TRL's side has none; the one
evaluator here scores both exports); the seeds vary GRPO only.

``--replay`` asks whether the two trainers differ anywhere but in what they sample: our run goes first, keeping each
step's batch; TRL's ``GRPOTrainer`` then trains on exactly those prompts (its sampler unshuffled) and completions
(handed in through its ``rollout_func``), and scores them, computes advantages, reference log-probs, the loss, clipping
and its AdamW step itself. It writes, per seed, the relative difference of the two runs' weight updates (over all
weights, and in the worst tensor), and each step's reward and gradient norm on both sides.

Verdict ``ours_within_or_above_trl``: our mean last-window reward and mean held-out gain are each at least TRL's
smallest over its seeds (within its spread, or better), and our mean wall time is below TRL's.
"""

from __future__ import annotations

import argparse
import copy
import csv
import itertools
import json
import logging
import math
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from functools import partial
from pathlib import Path

import torch
import yaml
from datasets import Dataset
from lightning.pytorch import Callback
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging
from trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, str(Path(__file__).parent))
from compare_trl import environment  # noqa: E402
from grpo_learns import GRPO_FROM_SFT_RECIPE, SFT_RECIPE, run_sft  # noqa: E402

from lightning_rl.cli import main as lightning_rl_main  # noqa: E402
from lightning_rl.modules.evaluation import exact_match, heldout_cases  # noqa: E402
from lightning_rl.recipe import build  # noqa: E402
from lightning_rl.rewards.builtin import format_match, math_answer  # noqa: E402
from lightning_rl.rollout.buffer import ScoredBatch  # noqa: E402
from lightning_rl.toy.model import tiny_model_path  # noqa: E402
from lightning_rl.toy.task import HELDOUT_FILE, PROBLEMS_FILE, read_jsonl  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "tiny" / "grpo.yaml"
RESULTS = REPO / "benchmarks" / "results" / "grpo_vs_trl_learning.json"
RESULTS_FROM_SFT = REPO / "benchmarks" / "results" / "grpo_vs_trl_learning_from_sft.json"
# Both recipes' rewards (checked in recipe_settings), and the settings neither sets (the GRPO module's defaults).
REWARDS = [("math_answer", 1.0, {}), ("format", 0.5, {"pattern": r"\s*\d"})]
FORMAT_PATTERN = REWARDS[1][2]["pattern"]
MAX_GRAD_NORM = 1.0
# Logged per step by both sides under these names (ours as train/NAME; None where a side logs none, as TRL's kl at
# beta 0): kept per run beside the rewards.
STEP_METRICS = ("kl", "grad_norm", "entropy")


def recipe_settings(recipe: Path) -> dict:
    """The recipe's GRPO settings that TRL is given under its own names (ours reads the recipe itself)."""
    config = yaml.safe_load(recipe.read_text())
    model = config["model"]
    if [(r["function"], r["weight"], r.get("kwargs", {})) for r in model["rewards"]] != REWARDS:
        raise SystemExit(f"{recipe}: model.rewards differ from the ones TRL's side computes ({REWARDS})")
    return {"G": model["num_generations"], "prompts_per_step": config["data"]["batch_size"], "max_new_tokens": model["sampling"]["max_new_tokens"],
            "temperature": model["sampling"]["temperature"], "learning_rate": model["learning_rate"], "warmup_steps": model.get("warmup_steps", 0),
            "loss": model["loss"], "window": model["summary_window"], "steps": config["trainer"]["max_steps"]}  # fmt: skip


def heldout_exact_match(model_dir: Path) -> float:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cases = heldout_cases(str(HELDOUT_FILE), tokenizer, str(model_dir))
    return exact_match(model, tokenizer, cases, max_new_tokens=16)["heldout_exact_match"]


def windows(rewards: list[float], window: int) -> dict[str, float]:
    return {"reward_first_window_mean": statistics.mean(rewards[:window]), "reward_last_window_mean": statistics.mean(rewards[-window:])}


# -- ours ----------------------------------------------------------------------------------------------------------


def train_ours(recipe: Path, overrides: list[str], seed: int, steps: int, out: Path) -> tuple[list[float], Path]:
    """The recipe as a user runs it; per-step mean reward (train/reward of its CSV log), export."""
    code = lightning_rl_main(["run", str(recipe), f"--output_dir={out}", f"--seed={seed}", f"--trainer.max_steps={steps}",
                              "--checkpoint_every_n_steps=100000", "--trainer.enable_progress_bar=false", "--overwrite", *overrides])  # fmt: skip
    if code != 0:
        raise SystemExit(f"our run failed (exit {code}): {out}")
    (metrics,) = out.glob("csv/version_*/metrics.csv")
    rows = [row for row in csv.DictReader(metrics.open()) if row["train/reward"]]
    rewards = [float(row["train/reward"]) for row in rows]
    return rewards, out / "hf", {key: [float(row[f"train/{key}"]) if row.get(f"train/{key}") else None for row in rows] for key in STEP_METRICS}


# -- TRL -----------------------------------------------------------------------------------------------------------


def reply_texts(completions: list) -> list[str]:
    """TRL hands conversational completions as message lists; our rewards score the reply text."""
    return [c[0]["content"] if isinstance(c, list) else c for c in completions]


def trl_math_answer(completions: list, answer: list[str], **_: object) -> list[float]:
    return math_answer(reply_texts(completions), answer)


def trl_format(completions: list, **_: object) -> list[float]:
    return format_match(reply_texts(completions), FORMAT_PATTERN)


def toy_prompts() -> Dataset:
    """The embedded GRPO prompts: each problem's system and user turns, its answer as a column."""
    return Dataset.from_list([{"prompt": row["messages"][:-1], "answer": row["answer"]} for row in read_jsonl(PROBLEMS_FILE)])


def trl_config(settings: dict, out: Path, seed: int, steps: int, **overrides: object) -> GRPOConfig:
    """TRL's GRPOConfig for the recipe's settings (``overrides``: any field set otherwise)."""
    G, loss = settings["G"], settings["loss"]
    fields = dict(
        output_dir=str(out), seed=seed, max_steps=steps, learning_rate=settings["learning_rate"], lr_scheduler_type="constant",
        warmup_steps=settings["warmup_steps"], weight_decay=0.0, max_grad_norm=MAX_GRAD_NORM,
        per_device_train_batch_size=settings["prompts_per_step"] * G, gradient_accumulation_steps=1, steps_per_generation=1,
        num_iterations=1, num_generations=G, max_completion_length=settings["max_new_tokens"], temperature=settings["temperature"],
        top_p=1.0, top_k=0, loss_type=loss["loss_type"], beta=loss["beta"], epsilon=loss["epsilon_low"], epsilon_high=loss["epsilon_high"],
        scale_rewards="group", mask_truncated_completions=False, reward_weights=[weight for _, weight, _ in REWARDS], use_cpu=True,
        bf16=False, fp16=False, report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    return GRPOConfig(**{**fields, **overrides})


def trl_trainer(config: GRPOConfig, model_path: str, dataset: Dataset, **options: object) -> GRPOTrainer:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return GRPOTrainer(model=model, reward_funcs=[trl_math_answer, trl_format], args=config, train_dataset=dataset,
                       processing_class=AutoTokenizer.from_pretrained(model_path), **options)  # fmt: skip


def logged_steps(trainer: GRPOTrainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "reward" in entry]


def train_trl(settings: dict, model_path: str, seed: int, steps: int, out: Path) -> tuple[list[float], Path]:
    trainer = trl_trainer(trl_config(settings, out, seed, steps), model_path, toy_prompts())
    trainer.train()
    trainer.save_model(str(out / "hf"))
    logged = logged_steps(trainer)
    return [float(entry["reward"]) for entry in logged], out / "hf", {key: [float(entry[key]) if key in entry else None for entry in logged] for key in STEP_METRICS}


# -- replay: our samples through TRL's trainer ----------------------------------------------------------------------


class KeepBatches(Callback):
    """Each step's scored batch as the step trained it (prompt records, completions, rewards), in order."""

    def __init__(self) -> None:
        self.batches: list[ScoredBatch] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.batches.append(copy.deepcopy(pl_module.current_batch))


def replayed_through_trl(recipe: Path, overrides: list[str], settings: dict, start: str, seed: int, steps: int, out: Path) -> dict:
    """Our run's steps, then TRL's ``GRPOTrainer`` on exactly those samples: the same prompts in the same order (its
    sampler unshuffled) and our completions handed in through its ``rollout_func``. TRL scores them with its reward
    functions and computes its own advantages, reference log-probs, loss, clipping and AdamW step. Returns how far
    apart the two runs' weight updates end (relative: over all weights, and in the worst tensor) and each step's reward
    and gradient norm on both."""
    cli = build(str(recipe), [f"--output_dir={out / 'ours'}", f"--seed={seed}", f"--trainer.max_steps={steps}", "--checkpoint_every_n_steps=100000",
                              "--trainer.enable_progress_bar=false", "--overwrite", *overrides])  # fmt: skip
    kept = KeepBatches()
    cli.trainer.callbacks.append(kept)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    ours_rows = [row for row in csv.DictReader(next((out / "ours").glob("csv/version_*/metrics.csv")).open()) if row["train/reward"]]
    queue = iter(kept.batches)

    def rollout_func(prompts: list, trainer: GRPOTrainer) -> dict[str, list]:
        scored = next(queue)
        if prompts != [record["prompt"] for record in scored.records for _ in range(settings["G"])]:
            raise SystemExit(f"replay: TRL's prompts at step {scored.index} are not the ones our step {scored.index} sampled for")
        return {"prompt_ids": [r.prompt_ids for r in scored.rollouts], "completion_ids": [r.completion_ids for r in scored.rollouts],
                "logprobs": [r.logprobs for r in scored.rollouts]}  # fmt: skip

    dataset = Dataset.from_list([{"prompt": record["prompt"], "answer": record["answer"]} for scored in kept.batches for record in scored.records])
    trainer = trl_trainer(trl_config(settings, out / "trl", seed, steps, shuffle_dataset=False), start, dataset, rollout_func=rollout_func)
    trainer.train()
    initial = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32).state_dict()
    ours, theirs = cli.model.policy.state_dict(), trainer.model.state_dict()
    differences = {name: float((ours[name] - theirs[name]).norm() / (theirs[name] - initial[name]).norm().clamp_min(1e-30)) for name in initial}
    apart = sum(float((ours[name] - theirs[name]).norm() ** 2) for name in initial) ** 0.5
    moved = sum(float((theirs[name] - initial[name]).norm() ** 2) for name in initial) ** 0.5
    logged = logged_steps(trainer)
    return {
        "steps": steps, "seed": seed, "relative_update_difference": apart / max(moved, 1e-30), "worst_relative_update_difference": max(differences.values()),
        "worst_tensor": max(differences, key=differences.get),
        "ours": {"reward": [float(row["train/reward"]) for row in ours_rows], "grad_norm": [float(row["train/grad_norm"]) for row in ours_rows]},
        "trl": {"reward": [float(entry["reward"]) for entry in logged], "grad_norm": [float(entry["grad_norm"]) for entry in logged]},
    }  # fmt: skip


def timed(train, seed: int, steps: int, out: Path) -> tuple[list[float], Path, dict, dict]:
    """One training run with its wall and process CPU seconds and the load average (1 min) before and after."""
    load_before, wall, cpu = os.getloadavg()[0], time.perf_counter(), time.process_time()
    rewards, export, per_step = train(seed, steps, out)
    cost = {"wall_seconds": round(time.perf_counter() - wall, 1), "cpu_seconds": round(time.process_time() - cpu, 1),
            "load_average_1min_before": round(load_before, 2), "load_average_1min_after": round(os.getloadavg()[0], 2)}  # fmt: skip
    return rewards, export, cost, per_step


# -- report --------------------------------------------------------------------------------------------------------


def summarise(runs: list[dict]) -> dict:
    def spread(key: str) -> dict[str, float]:
        values = [run[key] for run in runs]
        return {"mean": statistics.mean(values), "min": min(values), "max": max(values),
                "std": statistics.stdev(values) if len(values) > 1 else 0.0}  # fmt: skip

    return {key: spread(key) for key in ("reward_first_window_mean", "reward_last_window_mean", "gain_points", "wall_seconds", "cpu_seconds")}


def permutation_p(ours: list[float], theirs: list[float], samples: int = 200_000) -> float:
    """Two-sided permutation test of the difference of the means: the share of the ways to split the pooled runs into
    two groups of these sizes whose means differ at least as much (every split when they are few, else ``samples``
    random ones from a fixed seed). Small: a difference that seed-to-seed noise rarely gives."""
    pooled, k = [*ours, *theirs], len(ours)
    observed = abs(statistics.mean(ours) - statistics.mean(theirs)) - 1e-12
    total = sum(pooled)

    def apart(chosen: tuple[int, ...]) -> float:
        first = sum(pooled[i] for i in chosen)
        return abs(first / k - (total - first) / (len(pooled) - k))

    if math.comb(len(pooled), k) <= samples:
        splits = list(itertools.combinations(range(len(pooled)), k))
    else:
        rng = random.Random(0)
        splits = [tuple(rng.sample(range(len(pooled)), k)) for _ in range(samples)]
    return sum(apart(chosen) >= observed for chosen in splits) / len(splits)


def differences(report: dict) -> dict:
    """Ours minus TRL on the mean, and how often noise alone would part the two sets of seeds that much."""
    return {key: {"ours_minus_trl": statistics.mean(run[key] for run in report["ours"]["runs"]) - statistics.mean(run[key] for run in report["trl"]["runs"]),
                  "permutation_p": permutation_p([run[key] for run in report["ours"]["runs"]], [run[key] for run in report["trl"]["runs"]])}
            for key in ("reward_last_window_mean", "gain_points")}  # fmt: skip


def verdict(ours: dict, theirs: dict) -> bool:
    return (ours["reward_last_window_mean"]["mean"] >= theirs["reward_last_window_mean"]["min"]
            and ours["gain_points"]["mean"] >= theirs["gain_points"]["min"]
            and ours["wall_seconds"]["mean"] < theirs["wall_seconds"]["mean"])  # fmt: skip


def plot(report: dict, path: Path, start: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(7, 4))
    for side, label in (("ours", "lightning-rl"), ("trl", "TRL 1.16 GRPOTrainer")):
        curves = torch.tensor([run["rewards"] for run in report[side]["runs"]])
        mean, low, high = curves.mean(0), curves.min(0).values, curves.max(0).values
        steps = range(1, curves.shape[1] + 1)
        ax.plot(steps, mean, label=f"{label} (mean of {curves.shape[0]} seeds)")
        ax.fill_between(steps, low, high, alpha=0.25)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward (math_answer + 0.5 format)")
    ax.set_title(f"GRPO from the {start}, toy task (shaded: min to max over seeds)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return str(path.resolve().relative_to(REPO)) if path.resolve().is_relative_to(REPO) else path.name  # no machine paths in the JSON


def extended(out: Path, report: dict) -> dict:
    """The report at ``out``, to add seeds to: written with the same recipe, steps, window, threads and versions."""
    if not out.is_file():
        raise SystemExit(f"--extend: {out} does not exist; run without --extend first")
    earlier = json.loads(out.read_text())
    differs = [key for key in ("recipe", "steps", "window", "threads", "versions") if earlier.get(key) != report[key]]
    if differs:
        raise SystemExit(f"--extend: {out} was written with other {', '.join(differs)} ({', '.join(f'{k}={earlier.get(k)}' for k in differs)})")
    earlier["extended_by"] = [*earlier.get("extended_by", []), {key: report[key] for key in ("command", "machine_note", "date_utc", "load_average_1_5_15")}]
    return earlier


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from-sft", action="store_true", help="both sides start from one SFT'd model, with grpo_from_sft.yaml's settings")
    parser.add_argument("--sft-steps", type=int, default=None, help="with --from-sft: override the SFT recipe's max_steps (smoke runs)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the recipe's max_steps, 30 or 400)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1 for each side")
    parser.add_argument("--window", type=int, default=None, help="steps in the first and last reward windows (default: the recipe's summary_window)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both sides")
    parser.add_argument("--out", type=Path, default=None, help="the JSON (default: grpo_vs_trl_learning[_from_sft].json); the PNG goes beside it")
    parser.add_argument("--note", default="", help="what else ran on the machine meanwhile, written as machine_note")
    parser.add_argument("--extend", action="store_true", help="add --seeds more seeds to the JSON already written with the same settings and versions")
    parser.add_argument("--report-only", action="store_true", help="train nothing: redo the summaries, verdict, differences and plot of the JSON")
    parser.add_argument("--replay", action="store_true", help="no learning comparison: our steps replayed through TRL's trainer on the same samples")
    args = parser.parse_args(argv)
    recipe = REPO / GRPO_FROM_SFT_RECIPE if args.from_sft else RECIPE
    settings = recipe_settings(recipe)
    steps = args.steps or settings["steps"]
    out = args.out or (RESULTS_FROM_SFT if args.from_sft else RESULTS)
    if args.replay and args.out is None:
        out = out.with_name(out.name.replace("_learning", "_replay"))
    if args.report_only:
        return finish(json.loads(out.read_text()), out)
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    window = min(args.window or settings["window"], steps)
    command = " ".join(["python benchmarks/grpo_vs_trl_learning.py", *(sys.argv[1:] if argv is None else argv)])
    report: dict = {"command": command, "recipe": str(recipe.relative_to(REPO)), "steps": steps, "window": window, "threads": args.threads,
                    "machine_note": args.note, **environment()}  # fmt: skip
    if args.extend:
        report = extended(out, report)
    first_seed = len(report["ours"]["runs"]) if args.extend else 0
    with tempfile.TemporaryDirectory(prefix="grpo-vs-trl-") as tmp:
        if args.from_sft:
            sft_load, sft = os.getloadavg()[0], Path(tmp) / "sft"
            sft_wall, sft_cpu = run_sft(0, sft, *([] if args.sft_steps is None else [f"--trainer.max_steps={args.sft_steps}"]))
            sft_steps = args.sft_steps or yaml.safe_load((REPO / SFT_RECIPE).read_text())["trainer"]["max_steps"]
            report["sft_of_extension" if args.extend else "sft"] = {
                "recipe": SFT_RECIPE, "seed": 0, "max_steps": sft_steps, "wall_seconds": round(sft_wall, 1), "cpu_seconds": round(sft_cpu, 1),
                "load_average_1min_before": round(sft_load, 2)}  # fmt: skip
            start = str(sft / "hf")
            ours_overrides = [f"--model.model_name_or_path={start}", "--model.eval_generations=0", "--trainer.log_every_n_steps=1"]
        else:
            start, ours_overrides = tiny_model_path(), []
        if args.replay:
            report["replay"] = [replayed_through_trl(recipe, ours_overrides, settings, start, seed, steps, Path(tmp) / f"replay-{seed}")
                                for seed in range(args.seeds)]  # fmt: skip
            report["worst_relative_update_difference"] = max(run["worst_relative_update_difference"] for run in report["replay"])
            out.write_text(json.dumps(report, indent=1) + "\n")
            print(f"worst relative difference of the weight updates over {args.seeds} seed(s) of {steps} steps: "
                  f"{report['worst_relative_update_difference']:.2e}; {out}")  # fmt: skip
            return 0
        before = heldout_exact_match(Path(start))
        if args.extend and before != report["heldout_exact_match_start"]:
            raise SystemExit(f"--extend: the start model scores {before} held out, not {report['heldout_exact_match_start']} as in {out}: another start")
        report["heldout_exact_match_start"] = before
        trainers = {"ours": partial(train_ours, recipe, ours_overrides), "trl": partial(train_trl, settings, start)}
        for side in trainers:
            report.setdefault(side, {"runs": []})
        for seed in range(first_seed, first_seed + args.seeds):
            for side, train in trainers.items():  # interleaved, so a change in machine load falls on both
                rewards, export, cost, per_step = timed(train, seed, steps, Path(tmp) / f"{side}-{seed}")
                after = heldout_exact_match(export)
                run = {"seed": seed, "rewards": rewards, **windows(rewards, window), "heldout_exact_match_before": before,
                       "heldout_exact_match_after": after, "gain_points": round(100 * (after - before), 1), **cost, **per_step}  # fmt: skip
                report[side]["runs"].append(run)
                print(side, json.dumps({k: v for k, v in run.items() if k not in ("rewards", *STEP_METRICS)}), flush=True)
    report["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    return finish(report, out)


def finish(report: dict, out: Path) -> int:
    """Summaries, verdict, differences and plot of the runs in ``report``, written to ``out`` and printed."""
    for side in ("ours", "trl"):
        report[side]["summary"] = summarise(report[side]["runs"])
    report["ours_within_or_above_trl"] = verdict(report["ours"]["summary"], report["trl"]["summary"])
    report["differences"] = differences(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    report["plot"] = plot(report, out.with_suffix(".png"), "SFT'd tiny model" if "sft" in report else "embedded tiny model")
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({side: report[side]["summary"] for side in ("ours", "trl")} | {"differences": report["differences"]}, indent=1))
    print(f"ours_within_or_above_trl: {report['ours_within_or_above_trl']}; {out}; {report['plot']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
