"""A tiny Idefics3 (SmolVLM's family: a SigLIP-style vision tower, a pixel-shuffle connector, a Llama decoder) and its
processor (Pillow backend, one 32 x 32 tile per image: 4 image tokens between its marker tokens), random weights,
saved for ``from_pretrained``. One of the image-text families the vLLM CPU build can load without torchvision, and
head_dim 64, the smallest its CPU attention takes."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoModelForImageTextToText, Idefics3Config, Idefics3ImageProcessorPil, Idefics3Processor

from lightning_rl.toy.model import build_tokenizer, seeded_model
from lightning_rl.toy.vlm import VLM_CHAT_TEMPLATE

IMAGE, AROUND, GLOBAL = "<image>", "<fake_token_around_image>", "<global-img>"
SIDE = 32


def build_idefics3(path: Path, seed: int = 0) -> Path:
    tokenizer = build_tokenizer()
    tiles = [f"<row_{r}_col_{c}>" for r in range(1, 3) for c in range(1, 3)]
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE, AROUND, GLOBAL, *tiles]})
    config = Idefics3Config(
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None),
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1, image_size=SIDE, patch_size=8),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE), scale_factor=2, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    seeded_model(AutoModelForImageTextToText, config, tokenizer, seed).save_pretrained(path)
    image_processor = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": SIDE}, max_image_size={"longest_edge": SIDE})
    Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4, chat_template=VLM_CHAT_TEMPLATE).save_pretrained(path)
    return path
