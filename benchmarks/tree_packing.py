"""Tree packing against flat packing: forward+backward of the same rollouts on a tiny Qwen3-style model.

    python benchmarks/tree_packing.py --out benchmarks/results/tree_packing.json

Flat is the best flat baseline: padding-free packing with per-sequence causal attention (the same fused SDPA
kernel per sequence, no dense mask). Tree forwards every shared token once. Timings are medians over rounds that
alternate flat and tree in one process. Yardsticks per case: T/U (flat over unique tokens) and the FLOP bound
(flat FLOPs over tree FLOPs, with attention counted on visible (query, key) pairs and the LM head on trained
tokens only). The body (the decoder layers alone, no LM head) has its own FLOP bound: per-token layers and
attention pairs only; where attention to shared ancestors is a large share, it sits below T/U.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from memory import peak_memory_bytes, saved_for_backward  # noqa: E402

from lightning_rl.ops.logprobs import lm_head_of, token_logprobs  # noqa: E402
from lightning_rl.ops.packed_forward import packed_hidden_states  # noqa: E402
from lightning_rl.packing import pack_sequences  # noqa: E402

MB = 2**20


def rollouts(case: str, vocab: int, rng: random.Random) -> tuple[list[list[int]], list[list[bool]]]:
    """Sequences and loss masks (answers trained, prompts not) for one benchmark case."""
    tok = lambda n: [rng.randrange(10, vocab) for _ in range(n)]  # noqa: E731
    seqs, masks = [], []

    def add(prompt, answer_parts):
        seq, mask = list(prompt), [False] * len(prompt)
        for part, trained in answer_parts:
            seq += part
            mask += [trained] * len(part)
        seqs.append(seq)
        masks.append(mask)

    if case == "no_sharing":  # 8 different prompts, one answer each
        for _ in range(8):
            add(tok(384), [(tok(128), True)])
    elif case == "shared_prompt_long":  # G=8 answers of 128 to one prompt of 1536
        prompt = tok(1536)
        for _ in range(8):
            add(prompt, [(tok(128), True)])
    elif case == "shared_prompt_short":  # 2 prompts of 512, G=8 answers of 256 each
        for _ in range(2):
            prompt = tok(512)
            for _ in range(8):
                add(prompt, [(tok(256), True)])
    elif case == "nested_forks":  # prompt 512 -> 4 first turns of 128 -> each 2 tool results + answers of 128
        prompt = tok(512)
        for _ in range(4):
            turn1 = tok(128)
            for _ in range(2):
                add(prompt, [(turn1, True), (tok(32), False), (tok(96), True)])
    else:
        raise ValueError(case)
    return seqs, masks


def layout_flops(config: Qwen3Config, tokens: int, pairs: int, trained: int) -> float:
    """fwd+bwd FLOPs (3x forward): per-token layers on ``tokens``, attention on ``pairs``, LM head on ``trained``."""
    h, kv, i, L = config.hidden_size, config.num_key_value_heads * config.head_dim, config.intermediate_size, config.num_hidden_layers
    q = config.num_attention_heads * config.head_dim
    per_token = 2 * (h * q + 2 * h * kv + q * h + 3 * h * i)
    per_pair = 2 * 2 * q  # q.k and p.v
    return 3 * (L * (tokens * per_token + pairs * per_pair) + trained * 2 * h * config.vocab_size)


def step(model, batch, advantages):
    """One GRPO-like learner step: log-probs of trained tokens, weighted, backward. Returns body-saved bytes."""
    with saved_for_backward(model) as saved:
        hidden = packed_hidden_states(model, batch)
    weight, bias, transform = lm_head_of(model)
    logp = token_logprobs(hidden.index_select(0, batch.loss_positions), weight, batch.loss_targets, transform=transform)
    (-(logp * advantages[batch.loss_seq]).sum() / logp.numel()).backward()
    return saved["bytes"]


def body_step(model, batch):
    """The transformer body alone, forward and backward (the hidden states' sum as the loss)."""
    packed_hidden_states(model, batch)[: batch.num_unique_tokens].sum().backward()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/tree_packing.json"))
    parser.add_argument("--rounds", type=int, default=9)  # 5 rounds still move by several percent here
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--cases", nargs="*", default=["no_sharing", "shared_prompt_long", "shared_prompt_short", "nested_forks"])
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 128), head_dim=64,
        attn_implementation="sdpa", tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3ForCausalLM(config).float()
    rows = []
    for case in args.cases:
        seqs, masks = rollouts(case, args.vocab, random.Random(case))
        advantages = torch.randn(len(seqs))
        layouts = {name: pack_sequences(seqs, masks, share_prefixes=(name == "tree")) for name in ("flat", "tree")}
        T, U = layouts["flat"].num_unique_tokens, layouts["tree"].num_unique_tokens
        trained = int(layouts["tree"].loss_positions.numel())
        pairs = {name: int((b.position_ids + 1).sum()) for name, b in layouts.items()}
        flops = {name: layout_flops(config, b.num_unique_tokens, pairs[name], trained) for name, b in layouts.items()}
        body_flops = {name: layout_flops(config, b.num_unique_tokens, pairs[name], 0) for name, b in layouts.items()}

        step(model, layouts["flat"], advantages)  # warm-up both layouts
        step(model, layouts["tree"], advantages)
        times = {"flat": [], "tree": [], "flat_body": [], "tree_body": []}
        # Whole steps and body-only steps in rounds of their own, so a body step never follows a whole step's
        # large LM-head buffers; within each, flat and tree alternate which goes first.
        for kind, run in (("", lambda b: step(model, b, advantages)), ("_body", lambda b: body_step(model, b))):
            for r in range(args.rounds):
                for name in (("flat", "tree") if r % 2 == 0 else ("tree", "flat")):
                    model.zero_grad(set_to_none=True)
                    t0 = time.perf_counter()
                    run(layouts[name])
                    times[name + kind].append(time.perf_counter() - t0)
        saved, peak = {}, {}
        for name, batch in layouts.items():
            model.zero_grad(set_to_none=True)
            box = {}
            peak[name] = peak_memory_bytes(lambda: box.setdefault("saved", step(model, batch, advantages))) / MB
            saved[name] = box["saved"] / MB
        flat_s, tree_s = statistics.median(times["flat"]), statistics.median(times["tree"])
        body_speedup = statistics.median(times["flat_body"]) / statistics.median(times["tree_body"])
        rows.append({
            "case": case, "sequences": len(seqs), "tokens_flat": T, "tokens_unique": U, "t_over_u": round(T / U, 3),
            "trained_tokens": trained, "pairs_flat": pairs["flat"], "pairs_tree": pairs["tree"],
            "flop_bound": round(flops["flat"] / flops["tree"], 3),
            "flat_s": round(flat_s, 4), "tree_s": round(tree_s, 4), "speedup": round(flat_s / tree_s, 3),
            "speedup_over_flop_bound": round((flat_s / tree_s) / (flops["flat"] / flops["tree"]), 3),
            "body_speedup": round(body_speedup, 3), "body_speedup_over_t_over_u": round(body_speedup / (T / U), 3),
            "body_flop_bound": round(body_flops["flat"] / body_flops["tree"], 3),
            "body_speedup_over_body_flop_bound": round(body_speedup / (body_flops["flat"] / body_flops["tree"]), 3),
            "flat_peak_mb": round(peak["flat"], 1), "tree_peak_mb": round(peak["tree"], 1),
            "flat_saved_mb": round(saved["flat"], 1), "tree_saved_mb": round(saved["tree"], 1),
            "saved_ratio_over_u_over_t": round((saved["tree"] / saved["flat"]) / (U / T), 3),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    cols = ["case", "tokens_flat", "tokens_unique", "t_over_u", "flop_bound", "flat_s", "tree_s", "speedup",
            "speedup_over_flop_bound", "body_speedup", "body_speedup_over_t_over_u", "body_flop_bound",
            "body_speedup_over_body_flop_bound", "flat_peak_mb", "tree_peak_mb", "flat_saved_mb", "tree_saved_mb", "saved_ratio_over_u_over_t"]  # fmt: skip
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")
    print(f"\nmodel: Qwen3 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; medians of {args.rounds} interleaved rounds")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
