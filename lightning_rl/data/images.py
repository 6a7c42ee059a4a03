"""Rows with images: their image parts read with Pillow (a path relative to the data file, or bytes in the row),
and conversations rendered by the model's processor, which expands each image into its placeholder tokens and
gives each image's inputs (pixel values, grids)."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import torch

from lightning_rl.data.templates import rendering_row
from lightning_rl.packing.images import image_runs, split_images

# Processor outputs that are not an image's inputs.
_NOT_IMAGE_INPUTS = {"input_ids", "attention_mask", "assistant_masks", "mm_token_type_ids", "token_type_ids"}


def _turns(row: dict) -> list:
    turns = [row.get(key) for key in ("messages", "prompt", "completion")]
    return [m for value in turns if isinstance(value, list) for m in value if isinstance(m, dict)]


def row_has_images(row: dict) -> bool:
    """Whether any turn of the row holds an image part."""
    return any(isinstance(part, dict) and part.get("type") == "image" for m in _turns(row) if isinstance(m.get("content"), list) for part in m["content"])


# The keys an image part may name its image by, as transformers' chat templates read them.
IMAGE_KEYS = ("image", "url", "path")
FETCH_TIMEOUT_S = 30.0


def image_source(part: dict) -> Any:
    """What an image part names: its ``image``, ``url`` or ``path`` (None if none)."""
    return next((part[key] for key in IMAGE_KEYS if part.get(key) is not None), None)


def with_image_column(row: dict) -> dict:
    """``row`` with the images of its ``images`` column (or ``image``: one image) placed, in order, into the image parts
    that name none (``{"type": "image"}``), the layout of many `datasets` image-text sets; a row with no such part gets
    them before the text of its first user turn written as a string, as TRL places them. A ValueError if they do not pair up; a row
    without such a column is returned as it is."""
    column = "images" if row.get("images") is not None else "image" if row.get("image") is not None else None
    if column is None:
        return row
    pictures = list(row[column]) if column == "images" and isinstance(row[column], (list, tuple)) else [row[column]]
    empty = [(key, k, j) for key in ("messages", "prompt", "completion") if isinstance(row.get(key), list)
             for k, m in enumerate(row[key]) if isinstance(m, dict) and isinstance(m.get("content"), list)
             for j, part in enumerate(m["content"]) if isinstance(part, dict) and part.get("type") == "image" and image_source(part) is None]  # fmt: skip
    if not empty and pictures:
        # No part left for them (TRL's layout of image-text sets): the images go before the text of the first user
        # turn written as a string, in order.
        key, k = next(((key, k) for key in ("messages", "prompt") if isinstance(row.get(key), list)
                       for k, m in enumerate(row[key]) if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str)),
                      (None, None))  # fmt: skip
        if key is not None:
            turns = list(row[key])
            turns[k] = {**turns[k], "content": [*({"type": "image"} for _ in pictures), {"type": "text", "text": turns[k]["content"]}]}
            row = {**row, key: turns}
            empty = [(key, k, j) for j in range(len(pictures))]
    if len(empty) != len(pictures):
        raise ValueError(f"`{column}` holds {len(pictures)} images for {len(empty)} image parts that name none (put a "
                         '{"type": "image"} part where each goes)')
    row = {key: [dict(m, content=list(m["content"])) if isinstance(m, dict) and isinstance(m.get("content"), list) else m for m in value]
           if key in ("messages", "prompt", "completion") and isinstance(value, list) else value for key, value in row.items() if key != column}  # fmt: skip
    for (key, k, j), picture in zip(empty, pictures):
        row[key][k]["content"][j] = {**row[key][k]["content"][j], "image": picture}
    return row


def _fetch(url: str) -> bytes:
    """The bytes behind an http(s) or data URL; a ValueError naming the URL if they cannot be had."""
    import base64
    import urllib.error
    import urllib.request

    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        try:
            return base64.b64decode(payload, validate=True) if header.endswith(";base64") else urllib.request.unquote_to_bytes(payload)
        except ValueError:
            raise ValueError(f"image {url[:60]}...: the data URL is not valid base64") from None
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:
            return response.read()
    except urllib.error.HTTPError as error:
        raise ValueError(f"image {url}: cannot be fetched (HTTP {error.code}: {error.reason})") from None
    except (urllib.error.URLError, OSError, ValueError) as error:
        raise ValueError(f"image {url}: cannot be fetched ({getattr(error, 'reason', error)})") from None


def _base64(text: str) -> bytes | None:
    """The bytes a string of base64 image data stands for; None for anything else (a name too short to be an image's
    data, or with characters base64 does not use, is a file name)."""
    import base64
    import binascii

    if len(text) < 64:
        return None
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        return None


def _image_data(image: Any, base: Path | None) -> tuple[Any, str]:
    """What Pillow opens for an image a part names (a path, a file-like object), and how an error names it."""
    if isinstance(image, dict) and isinstance(image.get("bytes"), (bytes, bytearray)):  # a datasets / Parquet Image cell
        return io.BytesIO(image["bytes"]), "the row's image bytes"
    if isinstance(image, dict) and isinstance(image.get("path"), str):  # an Image cell that holds only its path
        return _image_data(image["path"], base)
    if isinstance(image, (bytes, bytearray)):
        return io.BytesIO(image), "the row's image bytes"
    if isinstance(image, str) and image.startswith(("http://", "https://", "data:")):
        return io.BytesIO(_fetch(image)), f"image {image[:200]}"
    if isinstance(image, str):
        path = Path(image[len("file://"):] if image.startswith("file://") else image)
        if not path.is_absolute() and base is not None:
            path = base / path
        if not path.is_file():
            raw = _base64(image)  # base64 image data without a data: prefix, which transformers' load_image takes too
            if raw is not None:
                return io.BytesIO(raw), f"image {image[:60]}... (base64)"
            raise ValueError(f"image {image}: " + (f"a folder, not an image file ({path})" if path.is_dir() else
                                                   f"not a regular file ({path})" if path.exists() else f"no such file ({path})"))
        return path, f"image {image}"
    raise ValueError(f"an image part must hold a path, a URL or bytes, got {type(image).__name__}")


def _open(image: Any, base: Path | None, decode: bool = True) -> Any:
    """The image, opened (RGB) and turned upright as its EXIF orientation says (a phone's photo, as transformers'
    ``load_image`` and ``datasets`` read it); with ``decode=False`` only checked: its header read and, where the format
    has them, its checksums, without decoding a pixel (returns None).

    Transparency goes as the same image reaches a processor elsewhere: one named by a path or URL is read by
    transformers' ``load_image``, which drops it; one that arrives decoded (a PIL image, a ``datasets`` Image cell, bytes)
    is laid onto white by the processor's ``convert_to_rgb``."""
    from PIL import Image, ImageOps

    if isinstance(image, Image.Image):
        return _on_white(image) if decode else None
    data, shown = _image_data(image, base)
    decoded = isinstance(image, (dict, bytes, bytearray))
    try:
        with Image.open(data) as opened:
            if not decode:
                return opened.verify()
            upright = ImageOps.exif_transpose(opened)
            return _on_white(upright) if decoded else upright.convert("RGB")
    except Exception as error:  # Pillow's UnidentifiedImageError, a truncated file, ...
        if not decode:  # the check is stricter than a decode (a PNG without its end marker decodes whole): as training reads it
            _open(image, base)
            return None
        raise ValueError(f"{shown} cannot be read as an image ({type(error).__name__})") from None


def _on_white(image: Any) -> Any:
    """An RGB image, any transparency laid onto white (as image processors' ``convert_to_rgb`` does)."""
    from PIL import Image

    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


def check_prompt_images(record: dict, base: Path | None) -> None:
    """Each image of a GRPO prompt record (its messages' image parts, or its ``images`` / ``image`` column for the parts
    that name none) can be opened, checked without decoding its pixels; a ValueError naming the first that cannot.
    Checked when the data is set up, rather than when the prompt is drawn, mid-run. Images behind http(s) URLs are
    fetched only when the prompt is drawn."""
    prompt = record.get("prompt")
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt  # as the policy renders it
    if not isinstance(prompt, list):
        return
    row = with_image_column({"prompt": prompt, "images": record.get("images"), "image": record.get("image")})
    for message in _turns(row):
        for part in message["content"] if isinstance(message.get("content"), list) else []:
            if isinstance(part, dict) and part.get("type") == "image":
                source = image_source(part)
                if not (isinstance(source, str) and source.startswith(("http://", "https://"))):
                    _open(source, base, decode=False)


def load_images(row: dict, base: Path | None) -> dict:
    """``row`` with each image part's image opened (RGB); a missing or unreadable image is a ValueError naming it."""
    def parts(messages: list[dict]) -> list[dict]:
        out = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):
                if not all(isinstance(part, dict) for part in content):
                    raise ValueError('a content part must be {"type": "text", "text": ...} or {"type": "image", "image": PATH_OR_URL}')
                # One key for the opened image: the processor must not look for it again under url or path.
                content = [{**{k: v for k, v in part.items() if k not in IMAGE_KEYS}, "image": _open(image_source(part), base)}
                           if part.get("type") == "image" else part for part in content]
            out.append({**m, "content": content})
        return out

    return {key: parts(value) if key in ("messages", "prompt", "completion") and isinstance(value, list) else value for key, value in row.items()}


def image_key(image: Any) -> str:
    """A name for an image's pixels: two images with the same key are the same image."""
    return hashlib.sha1(f"{image.mode}{image.size}".encode() + image.tobytes()).hexdigest()


def keyed_image_ids(input_ids: list[int], keys: list[str], image_token_id: int | None) -> list[int]:
    """``input_ids`` with each image's placeholders replaced by negative ids of that image (for counting what a
    prefix tree of such sequences holds)."""
    out, k, inside, count = [], -1, False, 0
    for token in input_ids:
        if token == image_token_id:
            if not inside:
                k, count, inside = k + 1, 0, True
            out.append(-(1 + (int(keys[k][:12], 16) % (1 << 40)) * 4096 + count))
            count += 1
        else:
            inside = False
            out.append(token)
    return out


def images_of(messages: list[dict]) -> list[Any]:
    return [part["image"] for m in messages if isinstance(m.get("content"), list) for part in m["content"] if part.get("type") == "image"]


class ImageRenderer:
    """Renders conversations with images through the model's processor."""

    def __init__(self, processor: Any, image_token_id: int | None = None) -> None:
        self.processor = processor
        self.image_token_id = image_token_id  # with it, each image must be one run of placeholders

    def render(
        self, messages: list[dict], *, add_generation_prompt: bool = False, assistant_mask: bool = False, tools: list[dict] | None = None
    ) -> tuple[list[int], list[bool] | None, list[dict[str, torch.Tensor]]]:
        """(token ids, the assistant mask if asked, each image's inputs); ``tools``: the tool specs the template shows."""
        with rendering_row():
            out = self.processor.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_tensors="pt", add_generation_prompt=add_generation_prompt,
                return_assistant_tokens_mask=assistant_mask, tools=tools,
            )  # fmt: skip
        ids = out["input_ids"][0].tolist()
        mask = [bool(m) for m in out["assistant_masks"][0].tolist()] if assistant_mask else None
        inputs = {key: value for key, value in out.items() if key not in _NOT_IMAGE_INPUTS and isinstance(value, torch.Tensor)}
        per_token = [key for key, value in inputs.items() if value.dim() >= 2 and tuple(value.shape[:2]) == (1, len(ids))]
        if per_token:  # e.g. Mllama's cross_attention_mask: its text reaches the images by cross-attention, not placeholders
            raise ValueError(f"the processor gives per-token inputs ({', '.join(per_token)}) besides the image placeholders: "
                             "a model that reaches its images that way cannot be tree-packed")
        count = len(images_of(messages))
        runs = image_runs(ids, self.image_token_id)
        if self.image_token_id is not None and runs < count:
            raise ValueError(f"{count} images but {runs} runs of image placeholders after rendering: images side by side, with no "
                             "text between them, render as one run that cannot be told apart (put text between them)")
        if self.image_token_id is not None and runs != count:
            raise ValueError(f"{count} images but {runs} runs of image placeholders after rendering (a processor that splits an image's "
                             "placeholders into several runs, as Pixtral's row breaks or tiled images do, cannot be tree-packed)")
        return ids, mask, split_images(inputs, count)

    def template_ids(self, messages: list[dict], *, add_generation_prompt: bool = False, tools: list[dict] | None = None) -> list[int]:
        """The conversation's tokens as the chat template writes them, one placeholder per image, before the
        processor expands the placeholders (what vLLM is given: it expands them with its own copy of the processor).
        Special tokens are added as the processor adds them when it tokenizes its template."""
        with rendering_row():
            text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools)
        tokenizer = self.processor.tokenizer
        starts_with_bos = tokenizer.bos_token is not None and text.startswith(tokenizer.bos_token)
        return list(tokenizer(text, add_special_tokens=not starts_with_bos)["input_ids"])


def check_no_image_tokens(ids: list[int], image_token_id: int | None, tokenizer: Any) -> None:
    """A row without images must not hold the model's image placeholder (typed as text, the tokenizer makes it one):
    the model would look for an image that is not there."""
    if image_token_id is not None and image_token_id in ids:
        token = tokenizer.convert_ids_to_tokens(image_token_id)
        raise ValueError(f"the text holds the model's image placeholder {token!r}, but the row gives no image (give the image as a part, or remove it from the text)")
