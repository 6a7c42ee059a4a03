"""Packing sequences with images: a placeholder token stands for one image's features, so two placeholders may share
a tree node only when they are the same placeholder of the same image after the same prefix. The G completions of
an image prompt then share its image tokens, and the row holds (and the vision encoder sees) each image of a shared
prefix once."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from lightning_rl.packing.tree import PackedBatch, pack_sequences


def _runs(seq: Sequence[int], token: int) -> list[tuple[int, int]]:
    """(start, end) of each maximal run of ``token`` in ``seq``."""
    runs, start = [], None
    for t, tok in enumerate([*seq, None]):
        if tok == token and start is None:
            start = t
        elif tok != token and start is not None:
            runs.append((start, t))
            start = None
    return runs


def image_runs(seq: Sequence[int], image_token_id: int | None) -> int:
    """How many images ``seq`` holds: its runs of placeholders (each image's placeholders are one run)."""
    return len(_runs(seq, image_token_id)) if image_token_id is not None else 0


def pack_image_sequences(
    sequences: Sequence[Sequence[int]],
    images: Sequence[Sequence[Hashable]],
    image_token_id: int,
    loss_masks: Sequence[Sequence[bool]] | None = None,
    **pack_options: Any,
) -> tuple[PackedBatch, list[Hashable]]:
    """Pack ``sequences`` whose runs of ``image_token_id`` are images: ``images[i][j]`` is the key of sequence
    ``i``'s ``j``-th image (equal keys: the same image, e.g. a hash of its pixels). Placeholders are never trained.

    Returns the packed row (placeholders back as ``image_token_id``) and the image keys in the row's order, one per
    image the row holds: the caller stacks those images' inputs into ``batch.image_inputs``. ``pack_options`` go to
    `pack_sequences` (``rope_positions``, ``token_values``, ...)."""
    if len(images) != len(sequences):
        raise ValueError(f"{len(images)} image lists for {len(sequences)} sequences")
    slots: dict[Hashable, int] = {}
    longest = max((end - start for seq in sequences for start, end in _runs(seq, image_token_id)), default=0)
    keyed, masks = [], []
    for i, seq in enumerate(sequences):
        runs = _runs(seq, image_token_id)
        if len(runs) != len(images[i]):
            raise ValueError(f"sequence {i}: {len(runs)} runs of image placeholders for {len(images[i])} images")
        ids = [int(t) for t in seq]
        mask = [True] * len(ids) if loss_masks is None else [bool(m) for m in loss_masks[i]]
        if loss_masks is None:
            mask[0] = False
        for (start, end), key in zip(runs, images[i]):
            slot = slots.setdefault(key, len(slots))
            for k in range(start, end):  # negative ids: apart from every real token and every other image
                ids[k] = -(1 + slot * (longest + 1) + (k - start))
                mask[k] = False
        keyed.append(ids)
        masks.append(mask)
    batch = pack_sequences(keyed, masks, **pack_options)
    keys = list(slots)
    row_images = [keys[(-int(t) - 1) // (longest + 1)] for t in batch.input_ids.tolist() if t < 0 and (-t - 1) % (longest + 1) == 0]
    batch.input_ids = torch.where(batch.input_ids < 0, torch.full_like(batch.input_ids, image_token_id), batch.input_ids)
    return batch, row_images


def split_images(image_inputs: dict[str, torch.Tensor], count: int | None = None) -> list[dict[str, torch.Tensor]]:
    """The inputs of each of the ``count`` images of ``image_inputs``, in order: per-image tensors stacked along dim 0,
    the images of one sample along dim 1 (Idefics' [samples, images, ...] layout), or, with an ``image_grid_thw``
    (Qwen-VL layout), flattened patches, ``grid.prod()`` rows per image. Without ``count``, dim 0 is the image.
    Inputs that split no such way (an image cut into several tiles) are a ValueError."""
    if not image_inputs:
        return []
    grid = image_inputs.get("image_grid_thw")
    if grid is not None:
        sizes = grid.prod(-1).tolist()
        pixels = torch.split(image_inputs["pixel_values"], sizes)
        return [{"pixel_values": p, "image_grid_thw": grid[i : i + 1]} for i, p in enumerate(pixels)]
    values = list(image_inputs.values())
    if count is None or all(len(value) == count for value in values):
        count = len(values[0]) if count is None else count
        return [{key: value[i : i + 1] for key, value in image_inputs.items()} for i in range(count)]
    if all(value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == count for value in values):
        return [{key: value[:, i : i + 1] for key, value in image_inputs.items()} for i in range(count)]
    shapes = ", ".join(f"{key} {tuple(value.shape)}" for key, value in image_inputs.items())
    raise ValueError(f"cannot tell which of the processor's image inputs ({shapes}) belong to which of its {count} images "
                     "(an image split into tiles? turn the processor's image splitting off)")


def _cat_padded(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` concatenated along dim 0, each zero-padded at the end of its other dims to the largest: how
    processors batch images of different patch or tile counts (the model reads the real ones off the image sizes, or
    drops all-zero padding images)."""
    shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    padded = []
    for t in tensors:
        pad = [amount for d in reversed(range(1, t.dim())) for amount in (0, shape[d - 1] - t.shape[d])]
        padded.append(torch.nn.functional.pad(t, pad) if any(pad) else t)
    return torch.cat(padded)


def stack_images(images: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One input dict for several images (the inverse of `split_images`)."""
    return {key: _cat_padded([image[key] for image in images]) for key in images[0]} if images else {}


def placeholder_blocks(input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """Per token of a row, which run of image placeholders it belongs to (0, 1, ... in row order), -1 outside them."""
    is_image = input_ids == image_token_id
    starts = is_image & ~torch.cat([is_image.new_zeros(1), is_image[:-1]])
    return torch.where(is_image, torch.cumsum(starts.long(), 0) - 1, torch.full_like(input_ids, -1))


def images_on_path(input_ids: torch.Tensor, rows: torch.Tensor, image_token_id: int) -> list[int]:
    """Which of the row's images (by their order in the row) the tokens ``rows`` of a path pass through."""
    is_image = input_ids == image_token_id
    starts = is_image & ~torch.cat([is_image.new_zeros(1), is_image[:-1]])  # a run of placeholders starts here
    occurrence = torch.cumsum(starts.long(), 0) - 1
    on_path = rows[starts[rows]]
    return occurrence[on_path].tolist()


def pack_with_images(
    sequences: Sequence[Sequence[int]],
    images: Sequence[Sequence[tuple[Hashable, dict[str, torch.Tensor]]]],
    image_token_id: int,
    loss_masks: Sequence[Sequence[bool]] | None = None,
    *,
    position_rule: Callable[[Sequence[int], dict[str, torch.Tensor]], torch.Tensor] | None = None,
    **pack_options: Any,
) -> PackedBatch:
    """`pack_image_sequences` for sequences whose images come as (key, inputs): the row's ``image_inputs`` are those
    of the images it holds, in its order, and with a ``position_rule`` (the model's, for multi-axis rotary positions)
    each sequence is packed with its own positions."""
    if position_rule is not None:
        pack_options["rope_positions"] = [position_rule(seq, stack_images([inputs for _, inputs in own])) for seq, own in zip(sequences, images)]
    batch, row_images = pack_image_sequences(sequences, [[key for key, _ in own] for own in images], image_token_id, loss_masks, **pack_options)
    by_key = {key: inputs for own in images for key, inputs in own}
    batch.image_inputs = stack_images([by_key[key] for key in row_images])
    return batch
