"""The frozen reference's share of a GRPO row's training time, its forward on the row's tree against the same
sequences packed flat (each completion with its own copy of the prompt).

GRPO with ``loss.beta > 0`` scores each packed row under the reference too (`GRPOModule.row_loss`): the same
`PackedBatch` as the policy's, so the reference forwards a group's prompt once per row, without gradients. This
measures what that saves on one GRPO-shaped row (one prompt, G completions): the policy's forward and backward on
the tree, the reference's forward on the tree, and the reference's forward on the flat packing, each the median of
``--rounds``; the two reference log-probs are compared (they must agree within fp32 noise).

Run: OMP_NUM_THREADS=1 python benchmarks/reference_share.py [--prompt 1024 --completions 8 --completion 128]
(figures to benchmarks/results/reference_share.json; seconds on a shared machine are indicative).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from lightning_rl.ops.packed_forward import packed_logprobs
from lightning_rl.packing.tree import pack_sequences

RESULTS = Path(__file__).resolve().parent / "results" / "reference_share.json"


def rows(args: argparse.Namespace, vocab: int):
    """One prompt and its completions, packed as a tree and flat; the loss on the completions."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (args.prompt,), generator=g).tolist()
    sequences = [prompt + torch.randint(3, vocab, (args.completion,), generator=g).tolist() for _ in range(args.completions)]
    masks = [[False] * args.prompt + [True] * args.completion for _ in sequences]
    return pack_sequences(sequences, masks), pack_sequences(sequences, masks, share_prefixes=False)


def median_seconds(run, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--completions", type=int, default=8)
    parser.add_argument("--completion", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden // 64, num_key_value_heads=max(args.hidden // 128, 1), head_dim=64,
                         vocab_size=args.vocab, tie_word_embeddings=True, attn_implementation="sdpa")  # fmt: skip
    policy = Qwen3ForCausalLM(config).train()
    reference = Qwen3ForCausalLM(config).eval().requires_grad_(False)
    reference.load_state_dict(policy.state_dict())
    tree, flat = rows(args, args.vocab)

    def policy_step() -> None:
        policy.zero_grad(set_to_none=True)
        (-packed_logprobs(policy, tree).sum()).backward()

    def reference_on(row):
        with torch.no_grad():
            return packed_logprobs(reference, row)

    policy_step(), reference_on(tree), reference_on(flat)  # the packing probes, once per model, not timed
    on_tree, on_flat = reference_on(tree), reference_on(flat)
    policy_s = median_seconds(policy_step, args.rounds)
    tree_s = median_seconds(lambda: reference_on(tree), args.rounds)
    flat_s = median_seconds(lambda: reference_on(flat), args.rounds)
    report = {
        "machine": f"{platform.machine()} cpu, torch threads {torch.get_num_threads()}",
        "note": "a shared machine: seconds are indicative",
        "model": {"family": "qwen3", "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "dtype": "fp32"},
        "row": {"prompt": args.prompt, "completions": args.completions, "completion": args.completion,
                "tree_tokens": tree.num_unique_tokens, "flat_tokens": flat.num_unique_tokens},  # fmt: skip
        "policy_forward_backward_s": round(policy_s, 3),
        "reference_on_tree_s": round(tree_s, 3),
        "reference_on_flat_s": round(flat_s, 3),
        "reference_share_tree": round(tree_s / (policy_s + tree_s), 3),
        "reference_share_flat": round(flat_s / (policy_s + flat_s), 3),
        "reference_logprob_max_diff": float((on_tree - on_flat).abs().max()),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
