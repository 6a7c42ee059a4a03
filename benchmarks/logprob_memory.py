"""Peak memory of per-token log-probs, chunked LM head against the plain full-logits computation.

Each case runs forward and backward in a fresh process so peaks do not mix. On a GPU the figure is
torch's peak allocation; on a CPU it is the rise of the process's peak resident memory over what the
inputs already held. Run: python benchmarks/logprob_memory.py [--tokens 8192 --vocab 32768]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import resource
import time
from pathlib import Path

import torch

from lightning_rl.ops.logprobs import token_logprobs

RESULTS = Path(__file__).resolve().parent / "results" / "logprob_memory.json"


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def plain_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The reference: the whole [tokens x vocab] logits tensor, then log_softmax."""
    logits = (hidden @ weight.t()).float()
    return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)


def _measure(case: str, tokens: int, vocab: int, hidden_size: int, chunk_size: int, device: str, queue: mp.Queue) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, device=device, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size, device=device) * 0.02).requires_grad_()
    targets = torch.randint(vocab, (tokens,), device=device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _current_rss_mb()
    start = time.perf_counter()
    if case == "plain":
        logprobs = plain_logprobs(hidden, weight, targets)
    else:
        logprobs = token_logprobs(hidden, weight, targets, chunk_size=chunk_size)
    (-logprobs.mean()).backward()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    queue.put({"case": case, "peak_extra_mb": round(peak, 1), "seconds": round(time.perf_counter() - start, 2), "loss": float(-logprobs.detach().mean())})


def run_case(case: str, **kwargs) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=_measure, args=(case,), kwargs={**kwargs, "queue": queue})
    process.start()
    result = queue.get()
    process.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    setting = dict(tokens=args.tokens, vocab=args.vocab, hidden_size=args.hidden, chunk_size=args.chunk_size, device=args.device)
    cases = {case: run_case(case, **setting) for case in ("plain", "chunked")}
    logits_mb = args.tokens * args.vocab * 4 / 2**20
    report = {
        "setting": setting,
        "fp32_logits_tensor_mb": logits_mb,
        "cases": cases,
        "memory_ratio_plain_over_chunked": round(cases["plain"]["peak_extra_mb"] / max(cases["chunked"]["peak_extra_mb"], 1e-9), 1),
        "same_loss": abs(cases["plain"]["loss"] - cases["chunked"]["loss"]) < 1e-4,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(args.out)
    print(f"{args.tokens} tokens x {args.vocab} vocab (one fp32 logits tensor: {logits_mb:.0f} MiB), {args.device}")
    for case, result in cases.items():
        print(f"  {case:8s} peak extra memory {result['peak_extra_mb']:8.1f} MiB   {result['seconds']:6.2f} s   loss {result['loss']:.6f}")
    print(f"  plain / chunked peak memory: {report['memory_ratio_plain_over_chunked']}x   -> {args.out}")


if __name__ == "__main__":
    main()
