"""Start-up, generation, weight-push time and log-prob agreement of the two vLLM engines (tiny model, CPU).

Run in the vLLM environment: ``.venv-vllm/bin/python benchmarks/vllm_rollout.py [--repeats 5]
[--out benchmarks/results/vllm_rollout.json]``. For each engine (colocated ``vllm.LLM``, and a ``vllm
serve`` process reached over HTTP with weights pushed over gloo on loopback) it measures the engine start,
one generation of ``--prompts`` x ``--samples`` completions, ``--repeats`` weight pushes of the whole tiny
model, and the largest difference between the engine's log-probs and transformers' on the same tokens,
before and after a push.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from lightning_rl.toy.model import build_tiny
from lightning_rl.rollout.base import Rollout, RolloutEngine, SamplingConfig
from lightning_rl.models.weights import iter_full_weights

KV_CACHE_BYTES = 64 * 2**20


@torch.no_grad()
def max_logprob_error(model: PreTrainedModel, rollouts: list[Rollout]) -> float:
    worst = 0.0
    for r in rollouts:
        ids = torch.tensor([r.prompt_ids + r.completion_ids])
        logits = model(ids).logits[0, len(r.prompt_ids) - 1 : -1].float()
        reference = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.completion_ids)[:, None])[:, 0]
        worst = max(worst, (torch.tensor(r.logprobs) - reference).abs().max().item())
    return worst


@torch.no_grad()
def perturb_(model: PreTrainedModel, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for parameter in model.parameters():
        parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))


def measure(name: str, start_engine: Any, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    engine: RolloutEngine = start_engine()
    start_s = time.perf_counter() - started
    trainer = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [[5 + i, 6 + i, 7 + i, 8 + i] for i in range(args.prompts)]
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, seed=0)
    engine.generate(prompts[:1], n=1, sampling=sampling)  # the first call warms kernels up
    started = time.perf_counter()
    batch = engine.generate(prompts, n=args.samples, sampling=sampling)
    generate_s = time.perf_counter() - started
    error_before = max_logprob_error(trainer, batch.rollouts)
    push_s = []
    for version in range(1, args.repeats + 1):
        perturb_(trainer, seed=version)
        started = time.perf_counter()
        engine.push_weights(iter_full_weights(trainer), version=version)
        push_s.append(time.perf_counter() - started)
    error_after = max_logprob_error(trainer, engine.generate(prompts, n=args.samples, sampling=sampling).rollouts)
    engine.close()
    num_bytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
    return {
        "engine": name,
        "start_s": round(start_s, 2),
        "generate_s": round(generate_s, 3),
        "generated_tokens": batch.num_generated_tokens,
        "generated_tokens_per_s": round(batch.num_generated_tokens / generate_s, 1),
        "push_s_median": round(statistics.median(push_s), 4),
        "push_s_max": round(max(push_s), 4),
        "pushed_mib": round(num_bytes / 2**20, 2),
        "max_abs_logprob_error_before_push": error_before,
        "max_abs_logprob_error_after_push": error_after,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/vllm_rollout.json"))
    args = parser.parse_args()
    load_at_start = round(os.getloadavg()[0], 2)

    from lightning_rl.rollout.vllm_engine import VLLMEngine
    from lightning_rl.rollout.vllm_server import VLLMServerEngine

    with tempfile.TemporaryDirectory() as scratch:
        folder = build_tiny(Path(scratch) / "tiny")
        options = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": KV_CACHE_BYTES,
                   "enforce_eager": True}
        results = [
            measure("colocated", lambda: VLLMEngine(folder, **options), folder, args),
            measure("server", lambda: VLLMServerEngine(folder, server_options=options), folder, args),
        ]
    report = {
        "model": "tiny Qwen3 (hidden 128, 2 layers, head_dim 64), fp32, on the CPU",
        # Timings on a shared machine move with its load: the load average is recorded beside them.
        "cpu_count": os.cpu_count(), "load_average_1min_at_start": load_at_start,
        "settings": vars(args) | {"out": str(args.out)}, "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
