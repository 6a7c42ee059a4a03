"""Build the tiny Muse Spark Open folder that `recipes/tiny/muse_lora_sft.yaml` trains.

Same classes as the 816B model (sliding and full attention, NoPE layers, routed experts, logit
soft-cap) at a size a CPU trains in seconds, with the embedded default's tokenizer, written with
`save_pretrained` so runs load it through `from_pretrained`.

    python tests/slurm/tiny_muse.py outputs/tiny-muse-spark
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import MuseSparkConfig, MuseSparkForConditionalGeneration

from lightning_rl.toy.model import build_tokenizer


def tiny_muse_config(vocab_size: int, pad_token_id: int, eos_token_id: int) -> MuseSparkConfig:
    text = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=16, moe_intermediate_size=32, moe_hidden_size=32,
        num_local_experts=4, num_experts_per_tok=2, bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
    )  # fmt: skip
    return MuseSparkConfig(
        text_config=text,
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, out_hidden_size=32),
        audio_config=dict(num_hidden_layers=1, out_hidden_size=64, patch_sizes=[4], hidden_sizes=[16], depths=[1]),
        out_hidden_size=32,
        projector_hidden_size=32,
    )


def build_tiny_muse(path: str | Path, seed: int = 0) -> Path:
    path = Path(path)
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = tiny_muse_config(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    MuseSparkForConditionalGeneration(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


if __name__ == "__main__":
    print(build_tiny_muse(sys.argv[1] if len(sys.argv) > 1 else "outputs/tiny-muse-spark"))
