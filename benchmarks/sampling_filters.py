"""Engine vs trainer log-probs at the first pass, under every sampling filter: before and after scoring the support.

For each cell of temperature {0.7, 1.0, 1.3} x top_p {1, 0.9, 0.5} x top_k {0, 5, 50} x min_p {0, 0.1}, the
engine samples one small batch from the embedded tiny model and reports each token's log-prob (that of the
filtered distribution it drew from) and support; the trainer, holding the same weights in fp32, scores the
tree-packed rollouts with its chunked LM head. Two scorings are compared with the engine's:

- before: the full softmax at the sampling temperature (what the trainer scored without the support), whose
  ratio to the engine's is each token's kept probability mass;
- after: renormalised over each token's support (``PackedBatch.token_support``), the distribution sampled from.

Per cell it prints the mean engine-vs-trainer ratio ``p_trainer / p_engine`` and the k3 estimate of
KL(engine || trainer) over the sampled tokens. Run ``python benchmarks/sampling_filters.py --engine hf`` in the
main environment, ``--engine vllm`` or ``--engine vllm_server`` in the vLLM one (``.venv-vllm``). One thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

TEMPERATURES = (0.7, 1.0, 1.3)
TOP_PS = (1.0, 0.9, 0.5)
TOP_KS = (0, 5, 50)
MIN_PS = (0.0, 0.1)
GRID = list(itertools.product(TEMPERATURES, TOP_PS, TOP_KS, MIN_PS))
PROMPTS = [[5, 6, 7, 8], [40, 41, 42]]


@dataclasses.dataclass(frozen=True)
class Agreement:
    """How the trainer's log-probs of the sampled tokens agree with the engine's."""

    ratio_mean: float  # mean of p_trainer / p_engine
    kl: float  # k3 estimate of KL(engine || trainer): mean of (r - 1) - log r

    @classmethod
    def of(cls, trainer: torch.Tensor, engine: torch.Tensor) -> Agreement:
        log_ratio = trainer.double() - engine.double()
        ratio = log_ratio.exp()
        return cls(float(ratio.mean()), float((ratio - 1 - log_ratio).mean()))


@torch.no_grad()
def first_pass(engine: Any, trainer: torch.nn.Module, sampling: Any, n: int = 4, prompts: list[list[int]] = PROMPTS) -> dict[str, Any]:
    """One batch of ``engine`` under ``sampling``, scored by ``trainer`` before and after the fix."""
    from lightning_rl.ops.packed_forward import packed_logprobs
    from lightning_rl.packing import pack_sequences

    rollouts = engine.generate(prompts, n, sampling).rollouts
    packed = pack_sequences(
        [r.sequence for r in rollouts], [r.loss_mask for r in rollouts],
        token_values={"engine_logprobs": [r.sequence_logprobs for r in rollouts]},
        token_supports=[r.sequence_support for r in rollouts],
    )
    engine_logprobs = packed.token_values["engine_logprobs"]
    after = packed_logprobs(trainer, packed, temperature=sampling.temperature)
    before = packed_logprobs(trainer, dataclasses.replace(packed, token_support=None), temperature=sampling.temperature)
    widest = 0 if packed.token_support is None else int((packed.token_support >= 0).sum(1).max())
    return {"before": Agreement.of(before, engine_logprobs), "after": Agreement.of(after, engine_logprobs),
            "tokens": int(engine_logprobs.numel()), "widest_support": widest}


def sampling_of(temperature: float, top_p: float, top_k: int, min_p: float, seed: int = 0) -> Any:
    from lightning_rl.rollout.base import SamplingConfig

    return SamplingConfig(max_new_tokens=8, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)


def start_engine(name: str, folder: Path) -> Any:
    if name == "hf":
        from lightning_rl.rollout.hf import HFRolloutEngine

        return HFRolloutEngine(str(folder))
    options = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 64 * 2**20, "enforce_eager": True}
    if name == "vllm":
        from lightning_rl.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(folder, **options)
    from lightning_rl.rollout.vllm_server import VLLMServerEngine

    return VLLMServerEngine(folder, server_options=options)


def table(rows: list[tuple[tuple, dict[str, Any]]], phase: str) -> str:
    lines = [f"{phase}:", "| temperature | top_p | top_k | min_p | tokens | widest support | ratio mean | k3 KL |", "|---|---|---|---|---|---|---|---|"]
    for (t, p, k, m), cell in rows:
        agreement = cell[phase]
        lines.append(f"| {t} | {p} | {k} | {m} | {cell['tokens']} | {cell['widest_support']} | {agreement.ratio_mean:.6f} | {agreement.kl:.2e} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("hf", "vllm", "vllm_server"), default="hf")
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt in each cell")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from lightning_rl.toy.model import build_tiny

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny(Path(tmp) / "tiny")
        trainer = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        engine = start_engine(args.engine, folder)
        try:
            rows = [(cell, first_pass(engine, trainer, sampling_of(*cell), n=args.samples)) for cell in GRID]
        finally:
            engine.close()
    print(f"engine {args.engine}, tiny model (vocab {trainer.config.vocab_size}), fp32, {len(PROMPTS)} prompts x {args.samples} samples x 8 tokens per cell")
    print(table(rows, "before"))
    print()
    print(table(rows, "after"))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
