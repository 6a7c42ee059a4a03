"""A tiny Qwen2-VL-style image-text model folder (multi-axis rotary positions for images) and its image processor
(Pillow backend), random weights, loaded through ``from_pretrained``. Qwen2-VL's processor class itself cannot be
built here (it needs torchvision for its video processor), so rows are tokenized by hand in the tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

from lightning_rl.toy.model import build_tokenizer

START, PAD, END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"


def build_qwen2_vl(path: Path) -> Path:
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [START, PAD, END, "<|video_pad|>"]})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (START, PAD, END, "<|video_pad|>")}
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                         rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3], rope_theta=10000.0)),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=4, spatial_merge_size=2,
                           temporal_patch_size=2, in_channels=3),
        image_token_id=ids[PAD], video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids[START], vision_end_token_id=ids[END],
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def image_inputs(seed: int) -> dict[str, torch.Tensor]:
    """One 16 x 16 image's inputs (4 placeholder tokens after the 2 x 2 merge)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(16, 16, 3, generator=g) * 255).to(torch.uint8).numpy()
    processor = Qwen2VLImageProcessorPil(min_pixels=16 * 16, max_pixels=16 * 16, patch_size=4, merge_size=2, temporal_patch_size=2)
    return dict(processor(images=[Image.fromarray(pixels)], return_tensors="pt"))
