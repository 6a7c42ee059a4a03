"""Tree packing against flat packing: forward+backward of the same rollouts on a tiny Qwen3-style model.

    python benchmarks/tree_packing.py --out benchmarks/results/tree_packing.json

Flat is the best flat baseline: padding-free packing with per-sequence causal attention (the same fused SDPA
kernel per sequence, no dense mask). Tree forwards every shared token once. Timings are medians over rounds that
alternate flat and tree in one process. Yardsticks per case: T/U (flat over unique tokens) and the FLOP bound
(flat FLOPs over tree FLOPs, with attention counted on visible (query, key) pairs and the LM head on trained
tokens only). The body (the decoder layers alone, no LM head) has its own FLOP bound: per-token layers and
attention pairs only; where attention to shared ancestors is a large share, it sits below T/U.

Cases whose group does not fit in one row (``*_spans_rows``) run a whole learner step over rows of at most
4096 unique tokens (``SPAN_ROW_BUDGET``) three ways: flat (per-sequence causal attention, rows filled in order), sub-groups (today's
planner without ``prefix_across_rows``: every row keeps the prompt) and cross-row (the prompt forwarded once, its
keys and values shared by the rows, ``ops/prefix_rows.py``). A sequence longer than the budget does not fit flat or
in a sub-group, so those two get the least row that holds it (``wide_row_budget``). ``speedup`` and ``flop_bound``
are cross-row against flat, the bound counting the whole step as one tree; ``speedup_over_subgroups`` is cross-row
against sub-groups. Cross-row holds its prefix's activations while each row runs, so its peak is the prefix's and
one row's, against a sub-group row's prompt and its answers; ``cross_row_recompute`` (what a policy trained with
gradient checkpointing does) keeps only the prefix's keys and values across the rows and runs its forward again
for the backward. Spans nest: a second-level shared part whose subtree does not fit in one row either
(``nested_spans_rows``' first turns) is forwarded once too, after the prompt. ``--span-scale`` divides every length
of these cases (a CPU runs them at 1/16):

    OMP_NUM_THREADS=1 python benchmarks/tree_packing.py --cases long_prompt_spans_rows nested_spans_rows

Only the cases run are replaced in ``--out``; the others' entries stay.
"""

from __future__ import annotations

import argparse
import json
import os
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
from lightning_rl.ops.prefix_rows import PrefixedRow, finish_prefix, share_prefixes, span_settings  # noqa: E402
from lightning_rl.packing import pack_sequences, plan_ordered_rows, plan_rows  # noqa: E402

MB = 2**20
ROW_CASES = ("no_sharing", "shared_prompt_long", "shared_prompt_short", "nested_forks")  # one row per layout
SPAN_CASES = ("long_prompt_spans_rows", "nested_spans_rows")  # a group larger than a row
SPAN_ROW_BUDGET = 4096  # the span cases' row budget at full scale


def rollouts(case: str, vocab: int, rng: random.Random, scale: int = 1) -> tuple[list[list[int]], list[list[bool]]]:
    """Sequences and loss masks (answers trained, prompts not) for one benchmark case; a span case's lengths
    divided by ``scale``."""
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
    elif case == "long_prompt_spans_rows":  # G=16 answers of 512 to one prompt of 8192
        prompt = tok(8192 // scale)
        for _ in range(16):
            add(prompt, [(tok(512 // scale), True)])
    elif case == "nested_spans_rows":  # prompt 2048 -> 2 first turns of 2048 -> 8 answers of 512 each: a turn's subtree exceeds a row
        prompt = tok(2048 // scale)
        for _ in range(2):
            turn1 = tok(2048 // scale)
            for _ in range(8):
                add(prompt, [(turn1, False), (tok(512 // scale), True)])
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


def step(model, batch, advantages, chunk_size: int = 1024):
    """One GRPO-like learner step: log-probs of trained tokens (the LM head ``chunk_size`` tokens at a time, the
    library's default), weighted, backward. Returns body-saved bytes."""
    with saved_for_backward(model) as saved:
        hidden = packed_hidden_states(model, batch)
    weight, bias, transform = lm_head_of(model)
    logp = token_logprobs(hidden.index_select(0, batch.loss_positions), weight, batch.loss_targets, transform=transform, chunk_size=chunk_size)
    (-(logp * advantages[batch.loss_seq]).sum() / logp.numel()).backward()
    return saved["bytes"]


def span_layouts(model, seqs, masks, budget: int, device: str | torch.device = "cpu") -> dict:
    """The rows of a group that spans rows, three ways: (sequence indices, packed row) per row, and the spans'
    prefixes (cross-row only: `share_prefixes` cuts them afresh for every step, a span being used once)."""
    wide = max(budget, *map(len, seqs))  # flat and sub-groups refuse a sequence longer than their row
    groups = [0] * len(seqs)
    plans = {
        "flat": (plan_ordered_rows(seqs, wide, "flat"), None),
        "subgroups": (plan_rows(seqs, wide, groups=groups).ranks[0], None),
    }
    spans = plan_rows(seqs, budget, groups=groups, **span_settings("always", model, masks, apart=False))
    plans["cross_row"] = plans["cross_row_recompute"] = (spans.ranks[0], spans.prefixes[0])
    return {
        name: ([(row, pack_sequences([seqs[i] for i in row], [masks[i] for i in row], share_prefixes=(name != "flat")).to(device)) for row in rows],
               prefixes, name.endswith("recompute"))
        for name, (rows, prefixes) in plans.items()
    }  # fmt: skip


def rows_step(model, layout, advantages, chunk_size: int = 1024) -> None:
    """One learner step over a layout's rows: each row's backward, then a span's prefix's once after its last row."""
    rows, prefixes, recompute = layout
    batches = [b for _, b in rows] if prefixes is None else share_prefixes([b for _, b in rows], prefixes, recompute=recompute)
    for (seq_ids, _), batch in zip(rows, batches):
        step(model, batch, advantages[seq_ids], chunk_size)
        finish_prefix(batch)


def layout_cost(config, layout, trained: int) -> tuple[int, float]:
    """Forwarded tokens and fwd+bwd FLOPs of a layout's rows, a span's prefix counted once."""
    rows, prefixes, _ = layout
    batches = [b for _, b in rows] if prefixes is None else share_prefixes([b for _, b in rows], prefixes)
    parts = list(batches) + list({id(p): p.batch for b in batches if isinstance(b, PrefixedRow) for p in b.prefix.chain}.values())
    tokens = sum(b.num_tokens for b in parts)
    return tokens, layout_flops(config, tokens, sum(int((b.position_ids + 1).sum()) for b in parts), trained)


def span_case(model, config, case: str, args) -> dict:
    """Flat, sub-groups and cross-row on a case whose group spans rows: medians of interleaved whole steps."""
    seqs, masks = rollouts(case, args.vocab, random.Random(case), scale=args.span_scale)
    budget = SPAN_ROW_BUDGET // args.span_scale
    advantages = torch.randn(len(seqs))
    layouts = span_layouts(model, seqs, masks, budget)
    tree = pack_sequences(seqs, masks)
    trained = int(tree.loss_positions.numel())
    bound = layout_flops(config, tree.num_unique_tokens, int((tree.position_ids + 1).sum()), trained)
    costs = {name: layout_cost(config, layout, trained) for name, layout in layouts.items()}
    times: dict[str, list[float]] = {name: [] for name in layouts}
    for name in layouts:  # warm-up
        rows_step(model, layouts[name], advantages)
    for r in range(args.span_rounds):  # the order rotates each round
        names = list(layouts)[r % len(layouts) :] + list(layouts)[: r % len(layouts)]
        for name in names:
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            rows_step(model, layouts[name], advantages)
            times[name].append(time.perf_counter() - t0)
    peak, block_peak = {}, {}
    block = max(len(masks[0]) - masks[0].index(True), 1)  # one answer's trained tokens
    for name, layout in layouts.items():
        model.zero_grad(set_to_none=True)
        peak[name] = peak_memory_bytes(lambda: rows_step(model, layout, advantages)) / MB
        model.zero_grad(set_to_none=True)
        block_peak[name] = peak_memory_bytes(lambda: rows_step(model, layout, advantages, chunk_size=block)) / MB
    s = {name: statistics.median(t) for name, t in times.items()}
    flop_bound = costs["flat"][1] / bound
    return {
        "case": case, "shape": f"lengths 1/{args.span_scale} of the case's; Qwen3 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, fp32",
        "sequences": len(seqs), "row_budget": budget, "wide_row_budget": max(budget, *map(len, seqs)),
        "rows": {name: len(layout[0]) for name, layout in layouts.items()},
        "tokens_flat": costs["flat"][0], "tokens_unique": tree.num_unique_tokens, "t_over_u": round(costs["flat"][0] / tree.num_unique_tokens, 3),
        "tokens_subgroups": costs["subgroups"][0], "tokens_cross_row": costs["cross_row"][0], "trained_tokens": trained,
        "flop_bound": round(flop_bound, 3), "subgroups_flop_bound": round(costs["subgroups"][1] / bound, 3),
        "flat_s": round(s["flat"], 4), "subgroups_s": round(s["subgroups"], 4), "cross_row_s": round(s["cross_row"], 4),
        "speedup": round(s["flat"] / s["cross_row"], 3),
        "speedup_over_flop_bound": round(s["flat"] / s["cross_row"] / flop_bound, 3),
        "speedup_over_subgroups": round(s["subgroups"] / s["cross_row"], 3),
        "flat_peak_mb": round(peak["flat"], 1), "subgroups_peak_mb": round(peak["subgroups"], 1), "cross_row_peak_mb": round(peak["cross_row"], 1),
        # gradient checkpointing's way for a span: the prefix's forward run again for its backward instead of kept
        "cross_row_recompute_s": round(s["cross_row_recompute"], 4), "cross_row_recompute_peak_mb": round(peak["cross_row_recompute"], 1),
        "recompute_speedup_over_subgroups": round(s["subgroups"] / s["cross_row_recompute"], 3),
        # the same peaks with the LM head run `peak_chunk_size` tokens at a time (one answer's), so that every layout
        # holds the same [chunk x vocab] logits block and the peaks differ by the body alone: at 1/16 of the lengths
        # the vocabulary is not scaled down, and a cross-row row's many trained tokens make that block most of it
        "peak_chunk_size": block, **{f"{name}_peak_mb_at_chunk": round(block_peak[name], 1) for name in layouts},
        "rounds": args.span_rounds,
        "machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}, {torch.get_num_threads()} threads" + (f"; {args.note}" if args.note else ""),
    }  # fmt: skip


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
    parser.add_argument("--cases", nargs="*", default=[*ROW_CASES, *SPAN_CASES], choices=[*ROW_CASES, *SPAN_CASES])
    parser.add_argument("--span-scale", type=int, default=16)  # 1 on an accelerator; 16 keeps a case within two minutes on one CPU core
    parser.add_argument("--span-rounds", type=int, default=3)  # whole steps of the three layouts
    parser.add_argument("--note", default="", help="about the machine while measured (e.g. other work running), kept in the span cases' entries")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 128), head_dim=64,
        attn_implementation="sdpa", tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3ForCausalLM(config).float()
    rows, spans = [], []
    for case in args.cases:
        if case in SPAN_CASES:
            spans.append(span_case(model, config, case, args))
            print(json.dumps(spans[-1]), flush=True)
            continue
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
    kept = json.loads(args.out.read_text()) if args.out.exists() else []
    measured = {row["case"]: row for row in rows + spans}
    order = [*ROW_CASES, *SPAN_CASES]
    merged = sorted([row for row in kept if row["case"] not in measured] + list(measured.values()), key=lambda row: order.index(row["case"]))
    args.out.write_text(json.dumps(merged, indent=2) + "\n")
    cols = ["case", "tokens_flat", "tokens_unique", "t_over_u", "flop_bound", "flat_s", "tree_s", "speedup",
            "speedup_over_flop_bound", "body_speedup", "body_speedup_over_t_over_u", "body_flop_bound",
            "body_speedup_over_body_flop_bound", "flat_peak_mb", "tree_peak_mb", "flat_saved_mb", "tree_saved_mb", "saved_ratio_over_u_over_t"]  # fmt: skip
    if rows:
        print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")
    span_cols = ["case", "t_over_u", "flop_bound", "flat_s", "subgroups_s", "cross_row_s", "speedup", "speedup_over_flop_bound",
                 "speedup_over_subgroups", "flat_peak_mb", "subgroups_peak_mb", "cross_row_peak_mb", "cross_row_recompute_s",
                 "recompute_speedup_over_subgroups", "cross_row_recompute_peak_mb", "peak_chunk_size", "subgroups_peak_mb_at_chunk",
                 "cross_row_peak_mb_at_chunk", "cross_row_recompute_peak_mb_at_chunk"]  # fmt: skip
    if spans:
        print("\n| " + " | ".join(span_cols) + " |\n|" + "---|" * len(span_cols))
    for row in spans:
        print("| " + " | ".join(str(row[c]) for c in span_cols) + " |")
    print(f"\nmodel: Qwen3 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; medians of {args.rounds} interleaved rounds ({args.span_rounds} for the span cases)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
