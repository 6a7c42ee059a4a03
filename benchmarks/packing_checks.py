"""What the packing self-checks cost on the embedded default (recipes/tiny/sft.yaml's model and data).

Times, in one process, medians of a few rounds: the probe (run once per model, backend and dtype, at the first
packed forward), ``verify_row`` on the first real row (``verify_packing: first_step``), and one ordinary
training micro-batch (packed forward + backward) of the same row for scale.
Run: python benchmarks/packing_checks.py [--rounds 5 --max-tokens 1024 --threads 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from lightning_rl.data.sft import SFTDataModule
from lightning_rl.models.loading import load_causal_lm
from lightning_rl.ops.packed_forward import packed_logprobs, probe, verify_row

RESULTS = Path(__file__).resolve().parent / "results" / "packing_checks.json"
TOY = Path(__file__).resolve().parent.parent / "lightning_rl" / "assets" / "toy"


def _median_seconds(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=1024, help="data.max_tokens of the row (the recipe's value)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = load_causal_lm("tiny")
    model.train()
    data = SFTDataModule(str(TOY / "train.jsonl"), str(TOY / "heldout.jsonl"), max_tokens=args.max_tokens)
    data.setup("fit")
    row = next(iter(data.train_dataloader()))
    device = torch.device("cpu")

    def step():
        model.zero_grad(set_to_none=True)
        (-packed_logprobs(model, row, attention_backend="blocks").sum()).backward()

    step()  # warm up (and the probe, once)
    figures = {
        "row_tokens": row.num_tokens,
        "row_sequences": row.num_sequences,
        "probe_s": _median_seconds(lambda: probe(model, "blocks", device), args.rounds),
        "verify_row_s": _median_seconds(lambda: verify_row(model, row, attention_backend="blocks"), args.rounds),
        "train_microbatch_s": _median_seconds(step, args.rounds),
    }
    figures["probe_over_microbatch"] = figures["probe_s"] / figures["train_microbatch_s"]
    figures["verify_over_microbatch"] = figures["verify_row_s"] / figures["train_microbatch_s"]
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads, "torch": torch.__version__}, **figures}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
