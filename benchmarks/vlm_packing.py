"""Tree packing of an image prompt against flat packing: forward+backward on a small LLaVA-style model.

    python benchmarks/vlm_packing.py --out benchmarks/results/vlm_packing.json

One image prompt (a 64 x 64 image: 256 image tokens, between two short texts) with G=8 answers of 16 trained tokens.
Flat packs the 8 sequences padding-free with per-sequence attention, so the row holds the image 8 times and the
vision encoder runs 8 times; tree forwards the prompt, its image included, once, and encodes the image once. The
vision tower trains, so both sides include its backward. Timings are medians over rounds alternating flat and
tree; the FLOP bound is flat FLOPs over tree FLOPs (decoder per token and per visible attention pair, the vision
encoder per image, the LM head on trained tokens).
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
from transformers import LlavaConfig, LlavaForConditionalGeneration

sys.path.insert(0, str(Path(__file__).parent))
from memory import peak_memory_bytes  # noqa: E402

from lightning_rl.ops.packed_forward import packed_logprobs  # noqa: E402
from lightning_rl.packing.images import pack_image_sequences  # noqa: E402

MB = 2**20
IMAGE = 5
VOCAB, HIDDEN, LAYERS, V_HIDDEN, V_LAYERS, SIDE, PATCH = 2048, 256, 4, 256, 4, 64, 4


def model() -> LlavaForConditionalGeneration:
    config = LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=HIDDEN // 4, max_position_embeddings=4096),
        vision_config=dict(model_type="clip_vision_model", hidden_size=V_HIDDEN, intermediate_size=4 * V_HIDDEN, num_hidden_layers=V_LAYERS,
                           num_attention_heads=4, image_size=SIDE, patch_size=PATCH, projection_dim=V_HIDDEN),
        image_token_index=IMAGE, projector_hidden_act="gelu", vision_feature_layer=-1, vision_feature_select_strategy="default",
    )  # fmt: skip
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(config).float().train()


def rollouts(rng: random.Random, g: int = 8, answer: int = 16) -> tuple[list[list[int]], list[list[bool]]]:
    tok = lambda n: [rng.randrange(10, VOCAB) for _ in range(n)]  # noqa: E731
    prompt = tok(16) + [IMAGE] * (SIDE // PATCH) ** 2 + tok(16)
    seqs = [prompt + tok(answer) for _ in range(g)]
    return seqs, [[False] * len(prompt) + [True] * answer for _ in seqs]


def flops(m: LlavaForConditionalGeneration, tokens: int, pairs: int, trained: int, images: int) -> float:
    """Forward+backward FLOPs (3x forward) of a row: decoder per token and attention pair, vision encoder per image."""
    text = sum(p.numel() for n, p in m.named_parameters() if "language_model" in n and "embed" not in n)
    vision = sum(p.numel() for n, p in m.named_parameters() if "vision_tower" in n or "multi_modal_projector" in n)
    patches = (SIDE // PATCH) ** 2 + 1
    decoder = 2 * text * tokens + 4 * LAYERS * HIDDEN * pairs
    encoder = images * (2 * vision * patches + 4 * V_LAYERS * V_HIDDEN * patches * patches)
    head = 2 * HIDDEN * VOCAB * trained
    return 3.0 * (decoder + encoder + head)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/vlm_packing.json"))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    m = model()
    seqs, masks = rollouts(random.Random(0))
    pixels = torch.randn(1, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(0))
    batches = {}
    for name, share in (("flat", False), ("tree", True)):
        batch, keys = pack_image_sequences(seqs, [["image"]] * len(seqs), IMAGE, masks, share_prefixes=share)
        batch.image_inputs = {"pixel_values": pixels.expand(len(keys), -1, -1, -1).contiguous()}
        batches[name] = batch

    def run(batch):
        m.zero_grad(set_to_none=True)
        (-packed_logprobs(m, batch, chunk_size=512, attention_backend="blocks").mean()).backward()

    for batch in batches.values():  # warm up (and the first forward's self-check)
        run(batch)
    times = {name: [] for name in batches}
    for _ in range(args.rounds):
        for name, batch in batches.items():
            start = time.perf_counter()
            run(batch)
            times[name].append(time.perf_counter() - start)
    row: dict = {"image_tokens": (SIDE // PATCH) ** 2, "completions": len(seqs), "answer_tokens": 16}
    cost = {}
    for name, batch in batches.items():
        pairs = int((batch.position_ids[: batch.num_unique_tokens] + 1).sum())
        images = len(batch.image_inputs["pixel_values"])
        cost[name] = flops(m, batch.num_unique_tokens, pairs, int(batch.loss_targets.numel()), images)
        row[f"{name}_tokens"] = batch.num_unique_tokens
        row[f"{name}_images_encoded"] = images
        row[f"{name}_seconds"] = round(statistics.median(times[name]), 4)
        row[f"{name}_peak_mb"] = round(peak_memory_bytes(lambda b=batch: run(b)) / MB, 1)
    row["speedup"] = round(row["flat_seconds"] / row["tree_seconds"], 3)
    row["flop_bound"] = round(cost["flat"] / cost["tree"], 3)
    row["speedup_over_flop_bound"] = round(row["speedup"] / row["flop_bound"], 3)
    row["memory_ratio"] = round(row["flat_peak_mb"] / row["tree_peak_mb"], 3)
    row["machine"] = {"threads": args.threads, "torch": torch.__version__}
    print(json.dumps(row, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(row, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
