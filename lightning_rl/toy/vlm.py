"""The embedded image-text model: a tiny LLaVA-style model (a CLIP vision tower, a projector, a Llama decoder) with
a processor built here: a CLIP image processor for 16 x 16 images, the embedded tokenizer with an image token, and a
chat template whose user turns may hold image parts. Random weights, written with ``save_pretrained`` so callers
load it through ``AutoModelForImageTextToText`` / ``AutoProcessor``."""

from __future__ import annotations

import os
from pathlib import Path

from transformers import AutoModelForImageTextToText, LlavaConfig, LlavaProcessor

from lightning_rl.toy.model import CHAT_TEMPLATE, build_tokenizer, cached_build, default_cache_dir, save_from_any_process, seeded_model

TINY_VLM_NAME = "tiny-vlm"
TINY_VLM_VERSION = 2  # bump when the config, processor or template changes
IMAGE_TOKEN = "<image>"
IMAGE_SIDE, PATCH = 16, 4  # 16 image tokens per image (the CLS feature dropped)

# The embedded template, with user and system turns that may be a list of parts: {"type": "image"} renders the
# image token (the processor repeats it once per image feature), {"type": "text", "text": ...} its text.
_TEXT_TURN = "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
_PARTS_TURN = (
    "{{ '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{ message.content }}{% else %}"
    "{%- for part in message.content %}{% if part.type == 'image' %}{{ '" + IMAGE_TOKEN + "' }}{% else %}{{ part.text }}{% endif %}{% endfor %}"
    "{%- endif %}{{ '<|im_end|>\\n' }}"
)
_SYSTEM = "{% set system = messages[0].content %}"
_PARTS_SYSTEM = (
    "{% if messages[0].content is string %}{% set system = messages[0].content %}{% else %}{% set parts = namespace(text='') %}"
    "{%- for part in messages[0].content %}{% set parts.text = parts.text + ('" + IMAGE_TOKEN + "' if part.type == 'image' else part.text) %}"
    "{%- endfor %}{% set system = parts.text %}{% endif %}"
)
assert _TEXT_TURN in CHAT_TEMPLATE and _SYSTEM in CHAT_TEMPLATE
VLM_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(_TEXT_TURN, _PARTS_TURN).replace(_SYSTEM, _PARTS_SYSTEM)


def build_tiny_vlm(path: str | os.PathLike, seed: int = 0) -> Path:
    """Write the tiny image-text model and its processor to ``path``."""
    # Imported here: without torchvision, transformers warns as the name is imported, and every text run imports this
    # module (for the name ``tiny-vlm``).
    from transformers import CLIPImageProcessor

    path = Path(path)
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    config = LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None),
        vision_config=dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, image_size=IMAGE_SIDE, patch_size=PATCH, projection_dim=64),
        image_token_index=image_token_id, projector_hidden_act="gelu", vision_feature_layer=-1,
        vision_feature_select_strategy="default", tie_word_embeddings=False,
    )  # fmt: skip
    model = seeded_model(AutoModelForImageTextToText, config, tokenizer, seed)
    image_processor = CLIPImageProcessor(
        size={"height": IMAGE_SIDE, "width": IMAGE_SIDE}, do_center_crop=False, do_convert_rgb=True,
    )
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH, vision_feature_select_strategy="default",
        chat_template=VLM_CHAT_TEMPLATE, image_token=IMAGE_TOKEN, num_additional_image_tokens=1,
    )  # fmt: skip
    save_from_any_process(model, path)
    processor.save_pretrained(path)
    return path


def tiny_vlm_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached tiny image-text model folder, built on first use."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return cached_build(cache / f"tiny-vlm-v{TINY_VLM_VERSION}", "config.json", build_tiny_vlm)
