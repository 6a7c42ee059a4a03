"""Tree packing with images: the G completions of an image prompt share its image tokens, the row holds each image
of a shared prefix once (so the vision encoder sees it once), and per-token log-probs and every gradient, vision
tower included, equal each sequence run alone. Qwen2-VL, Qwen2.5-VL, Qwen3-VL and GLM-4V (multi-axis rotary
positions for images), LLaVA, LLaVA-NeXT, Idefics3, InternVL, Aya Vision and Gemma 3 (plain 1-D positions; Gemma 3's image tokens
attend to their whole image), and Muse Spark, tiny configs with random weights; PaliGemma, bidirectional over its
prefix, and Mllama, whose text reaches its images by cross-attention, are refused."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import transformers

from lightning_rl.attention.tree_attention import PackingRefused
from lightning_rl.models.multimodal import image_token_id, image_token_types, rope_positions
from lightning_rl.ops.packed_forward import packed_logprobs, verify_row
from lightning_rl.packing.images import pack_image_sequences, stack_images

IMAGE, START, END = 60, 62, 63


# The decoder every tiny family here shares, and the Qwen-VL family's vision tower, rotary sections and tokens.
TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)  # fmt: skip
MROPE = dict(rope_type="default", mrope_section=[1, 1, 2], rope_theta=10000.0)
QWEN_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                   in_channels=3, out_hidden_size=32)  # fmt: skip
QWEN_TOKENS = dict(image_token_id=IMAGE, video_token_id=61, vision_start_token_id=START, vision_end_token_id=END)


def seeded(model_class, config, dtype):
    """The model of ``config`` with weights drawn from seed 0, in ``dtype``, in eval mode."""
    torch.manual_seed(0)
    return model_class(config).to(dtype).eval()


def qwen2_vl(dtype):
    config = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters=dict(rope_type="default", mrope_section=[1, 1, 2], rope_theta=10000.0)),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=4, spatial_merge_size=2,
                           temporal_patch_size=2, in_channels=3),
        image_token_id=IMAGE, video_token_id=61, vision_start_token_id=START, vision_end_token_id=END,
    )  # fmt: skip
    return seeded(transformers.Qwen2VLForConditionalGeneration, config, dtype)


def qwen2_vl_image(seed: int, dtype, side: int = 4):
    """An image of side x side patches (4 x 4: 16 patches, 4 placeholder tokens after the 2 x 2 merge)."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(side * side, 3 * 2 * 4 * 4, generator=g).to(dtype)
    return {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, side, side]])}, side * side // 4


def qwen2_5_vl(dtype):
    """Qwen2.5-VL: windowed attention in the vision tower, multi-axis positions in the decoder."""
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(TEXT, rope_parameters=MROPE), vision_config=dict(QWEN_VISION, window_size=8, fullatt_block_indexes=[1]), **QWEN_TOKENS
    )
    return seeded(transformers.Qwen2_5_VLForConditionalGeneration, config, dtype)


def qwen3_vl(dtype):
    """Qwen3-VL: interleaved multi-axis positions, and deepstack features added to early decoder layers at image tokens."""
    config = transformers.Qwen3VLConfig(
        text_config=dict(TEXT, head_dim=8, rope_parameters=dict(MROPE, mrope_interleaved=True)),
        vision_config=dict(QWEN_VISION, num_position_embeddings=16, deepstack_visual_indexes=[0]), **QWEN_TOKENS,
    )
    return seeded(transformers.Qwen3VLForConditionalGeneration, config, dtype)


# A CLIP tower of 2 x 2 patches of 4 on 8 x 8 images, a projector and a Llama decoder: LLaVA, and LLaVA-NeXT's base.
LLAVA = dict(
    text_config=dict(TEXT, model_type="llama"),
    vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       image_size=8, patch_size=4, projection_dim=32),
    image_token_index=IMAGE, projector_hidden_act="gelu", vision_feature_layer=-1, vision_feature_select_strategy="default",
)  # fmt: skip


def llava(dtype):
    config = transformers.LlavaConfig(**LLAVA)
    return seeded(transformers.LlavaForConditionalGeneration, config, dtype)


def llava_image(seed: int, dtype):
    """An 8 x 8 image of 4 placeholder tokens: for LLaVA 2 x 2 patches of 4 (the CLS feature dropped), for Gemma 3
    and InternVL 4 x 4 patches of 2 pooled or pixel-shuffled to 2 x 2."""
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(1, 3, 8, 8, generator=g).to(dtype)}, 4


def muse_spark(dtype):
    """Muse Spark Open's classes at toy size (sliding and full layers, NoPE, MoE, soft-cap), with its vision tower."""
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, sliding_window=4, moe_intermediate_size=16, moe_hidden_size=16, num_local_experts=4, num_experts_per_tok=2,
                bos_token_id=0, eos_token_id=1, pad_token_id=2)  # fmt: skip
    config = transformers.MuseSparkConfig(
        text_config=text,
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, out_hidden_size=32, patch_size=2),
        audio_config=dict(num_hidden_layers=1, out_hidden_size=32, patch_sizes=[4], hidden_sizes=[16], depths=[1]),
        out_hidden_size=64, projector_hidden_size=32, image_token_id=IMAGE, video_token_id=61, audio_token_id=59,
        experts_implementation="eager",  # transformers' grouped expert matmuls have no fp64 kernel
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    return seeded(transformers.MuseSparkForConditionalGeneration, config, dtype)


def muse_spark_image(seed: int, dtype):
    """4 x 4 patches of 2 x 2 pixels over 2 frames, merged 2 x 2: 4 placeholder tokens."""
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(16, 2 * 3 * 2 * 2, generator=g).to(dtype), "image_grid_thw": torch.tensor([[1, 4, 4]])}, 4


def idefics3(dtype):
    """Idefics3 (SmolVLM's family): a SigLIP-style tower, a pixel-shuffle connector, a Llama decoder."""
    config = transformers.Idefics3Config(
        text_config=dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=8, patch_size=2),
        image_token_id=IMAGE, scale_factor=2, pad_token_id=0,
    )  # fmt: skip
    return seeded(transformers.Idefics3ForConditionalGeneration, config, dtype)


def idefics3_image(seed: int, dtype):
    """An 8 x 8 image in Idefics' [samples, images, ...] layout: 4 x 4 patches, 2 x 2 pixel shuffle, 4 placeholders."""
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(1, 1, 3, 8, 8, generator=g).to(dtype), "pixel_attention_mask": torch.ones(1, 1, 8, 8, dtype=torch.bool)}, 4


def llava_next(dtype):
    """LLaVA-NeXT: an image is a base view and a grid of crops (anyres), unpadded, a newline feature per row."""
    config = transformers.LlavaNextConfig(**LLAVA, image_grid_pinpoints=[[8, 8], [8, 16], [16, 8]])
    return seeded(transformers.LlavaNextForConditionalGeneration, config, dtype)


def llava_next_image(seed: int, dtype, size: tuple[int, int] = (8, 8)):
    """An image of ``size`` pixels: its base view and crops (2 for 8 x 8, 3 for 8 x 16), 10 placeholders for 8 x 8."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    g = torch.Generator().manual_seed(seed)
    crops = image_size_to_num_patches(size, [[8, 8], [8, 16], [16, 8]], 8)
    return {"pixel_values": torch.randn(1, crops, 3, 8, 8, generator=g).to(dtype), "image_sizes": torch.tensor([list(size)])}, 10


def gemma3(dtype):
    config = transformers.Gemma3Config(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, sliding_window=4, max_position_embeddings=256),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=8, patch_size=2),
        mm_tokens_per_image=4, image_token_index=IMAGE, boi_token_index=START, eoi_token_index=END,
    )  # fmt: skip
    return seeded(transformers.Gemma3ForConditionalGeneration, config, dtype)


def internvl(dtype):
    """InternVL: its own vision tower, pixel shuffle, a Qwen2 decoder."""
    config = transformers.InternVLConfig(
        text_config=dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=[8, 8], patch_size=[2, 2]),
        image_token_id=IMAGE, downsample_ratio=0.5, projector_hidden_act="gelu",
    )  # fmt: skip
    return seeded(transformers.InternVLForConditionalGeneration, config, dtype)


def glm4v(dtype):
    """GLM-4V: multi-axis positions by its own rule, a Qwen-VL-like vision tower."""
    config = transformers.Glm4vConfig(
        text_config=dict(TEXT, rope_parameters=dict(MROPE, partial_rotary_factor=1.0)), vision_config=dict(QWEN_VISION, depth=1, image_size=16),
        image_token_id=IMAGE, video_token_id=61, image_start_token_id=START, image_end_token_id=END,
    )
    return seeded(transformers.Glm4vForConditionalGeneration, config, dtype)


def aya_vision(dtype):
    """Aya Vision: a SigLIP tower, pixel shuffle, a Cohere2 decoder (sliding and full layers) whose logit scale its
    own causal-LM class applies but the image-text wrapper does not: the probe sees which, and scores with it."""
    config = transformers.AyaVisionConfig(
        text_config=dict(TEXT, model_type="cohere2", sliding_window=4, layer_types=["sliding_attention", "full_attention"], logit_scale=0.5),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           image_size=8, patch_size=2),
        image_token_index=IMAGE, downsample_factor=2,
    )  # fmt: skip
    return seeded(transformers.AyaVisionForConditionalGeneration, config, dtype)


# Families that compute parts of their layers in float32 even when the model is fp64 (Muse Spark's router and norms).
FP32_INSIDE = {"muse_spark"}
FAMILIES = {"qwen2_vl": (qwen2_vl, qwen2_vl_image), "qwen2_5_vl": (qwen2_5_vl, qwen2_vl_image), "qwen3_vl": (qwen3_vl, qwen2_vl_image),
            "llava": (llava, llava_image), "muse_spark": (muse_spark, muse_spark_image),
            "idefics3": (idefics3, idefics3_image), "llava_next": (llava_next, llava_next_image), "gemma3": (gemma3, llava_image),
            "internvl": (internvl, llava_image), "glm4v": (glm4v, qwen2_vl_image), "aya_vision": (aya_vision, llava_image)}


def stacked(inputs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return stack_images(inputs)  # as the row's images are stacked (zero-padding fewer crops, as processors do)


def conversations(make_image, dtype):
    """An image prompt with four completions (two fork again), a second prompt with another image, and a
    two-turn conversation with an image in each turn."""
    a, n = make_image(1, dtype)
    b, _ = make_image(2, dtype)
    c, _ = make_image(3, dtype)
    img = lambda: [START] + [IMAGE] * n + [END]  # noqa: E731
    prompt = [1, 5, *img(), 6, 7]
    seqs = [prompt + [20, 21, 22], prompt + [20, 21, 23, 24], prompt + [30, 31], prompt + [40],
            [1, 8, *img(), 9, 10, 11], [1, 5, *img(), 6, 12, *img(), 13, 14]]  # fmt: skip
    images = [["a"], ["a"], ["a"], ["a"], ["b"], ["a", "c"]]
    return seqs, images, {"a": a, "b": b, "c": c}


def reference_logprobs(model, seqs, images, inputs):
    out = []
    for seq, keys in zip(seqs, images):
        ids = torch.tensor([seq])
        extra = stacked([inputs[k] for k in keys])
        if "image_grid_thw" in extra:
            extra["mm_token_type_ids"] = (ids == IMAGE).int()
        if keys:
            extra.update(image_token_types(model, ids))  # Gemma 3: its image tokens attend both ways, as its processor says
        logits = model(input_ids=ids, use_cache=False, **extra).logits[0].float() if model.dtype != torch.float64 else \
            model(input_ids=ids, use_cache=False, **extra).logits[0]  # fmt: skip
        lp = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None]).squeeze(1)
        out.append(lp[ids[0, 1:] != IMAGE])
    return torch.cat(out)


def packed(model, seqs, images, inputs):
    rope = [rope_positions(model, s, stacked([inputs[k] for k in keys])) for s, keys in zip(seqs, images)]
    batch, row_images = pack_image_sequences(seqs, images, image_token_id(model.config),
                                             rope_positions=None if rope[0] is None else rope)  # fmt: skip
    batch.image_inputs = stacked([inputs[k] for k in row_images])
    return batch, row_images


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("backend", ["blocks", "dense"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_image_rows_equal_each_sequence_alone(family, backend, dtype):
    build, make_image = FAMILIES[family]
    model = build(dtype)
    model.requires_grad_(True)
    reference = copy.deepcopy(model)
    seqs, images, inputs = conversations(make_image, dtype)
    batch, row_images = packed(model, seqs, images, inputs)
    if family in FP32_INSIDE and dtype == torch.float64:
        # fp32 rounding inside: where this CPU's fp32 kernels round the packed row differently from each sequence
        # alone, the fp64 self-check refuses it; where they round alike, the row is held to fp64's tolerances below.
        try:
            packed_logprobs(model, batch, attention_backend=backend)
        except PackingRefused as refused:
            assert re.search(r"the packing self-check measured packed log-probs \d\.\d\de-\d\d away", str(refused))
            return
    # The image prompt's image once for its four completions; the two-turn conversation shares it too.
    assert row_images.count("a") == 1 and sorted(row_images) == ["a", "b", "c"]
    assert (batch.input_ids == IMAGE).sum() * len(seqs) < sum(s.count(IMAGE) for s in seqs) * 3
    ours = packed_logprobs(model, batch, chunk_size=7, attention_backend=backend)
    theirs = reference_logprobs(reference, seqs, images, inputs)
    assert ours.shape == theirs.shape
    tol = {torch.float32: (1e-5, 1e-4), torch.float64: (1e-10, 1e-6)}[dtype]
    assert float((ours.detach() - theirs.detach()).abs().max()) <= tol[0]
    ours.sum().backward()
    theirs.sum().backward()
    vision_grads = 0
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:
            assert p.grad is None or float(p.grad.abs().max()) == 0, name
            continue
        vision_grads += "visual" in name or "vision" in name
        scale = float(q.grad.norm()) + 1e-2 * (1 if dtype == torch.float32 else 1e-4)
        assert float((p.grad - q.grad).norm()) / scale <= tol[1], name
    assert vision_grads > 0  # the vision tower trained through the packed row


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "gemma3", "aya_vision", "llava"])
def test_unpacked_image_rows_equal_each_sequence_alone(family):
    """An unpacked row (``packing: none``) runs as the model runs the sequence alone, with the token types its processor
    marks images by and its multi-axis positions: without them Qwen2-VL failed in transformers, Qwen2.5-VL put its
    image tokens on 1-D positions and Gemma 3's attended causally; and Aya Vision's logit scale, which its forward does
    not apply, is read off the model before its first row, as the packed path's probe reads it."""
    build, make_image = FAMILIES[family]
    model = build(torch.float64)
    seqs, images, inputs = conversations(make_image, torch.float64)
    for seq, keys in zip(seqs, images):
        batch, _ = packed(model, [seq], [keys], inputs)
        batch.unpacked = True
        ours = packed_logprobs(model, batch, chunk_size=7)
        theirs = reference_logprobs(model, [seq], [keys], inputs)
        assert float((ours - theirs).abs().max()) <= 1e-10


def test_placeholders_are_never_trained_and_a_mismatch_is_refused():
    seqs = [[1, IMAGE, IMAGE, 5, 6], [1, IMAGE, IMAGE, 5, 7]]
    batch, keys = pack_image_sequences(seqs, [["x"], ["y"]], IMAGE)
    assert sorted(keys) == ["x", "y"] and (batch.loss_targets != IMAGE).all()  # different images: nothing shared
    assert batch.num_unique_tokens == 9
    with pytest.raises(ValueError, match="sequence 0: 1 runs of image placeholders for 2 images"):
        pack_image_sequences([[1, IMAGE, 5]], [["x", "y"]], IMAGE)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_verify_packing_checks_image_rows_against_each_sequence_with_its_own_images(family):
    """Six samples of six sequences: every one is run alone with the images on its own path (and its own positions)."""
    build, make_image = FAMILIES[family]
    model = build(torch.float32)
    seqs, images, inputs = conversations(make_image, torch.float32)
    batch, _ = packed(model, seqs, images, inputs)
    error, *_ = verify_row(model, batch, attention_backend="blocks", samples=6, seed=1)
    assert error <= 1e-5


def test_an_image_row_without_the_models_multi_axis_positions_is_refused():
    model = qwen2_vl(torch.float32)
    seqs, images, inputs = conversations(qwen2_vl_image, torch.float32)
    batch, row_images = pack_image_sequences(seqs, images, IMAGE)  # no rope_positions: depth positions only
    batch.image_inputs = stacked([inputs[k] for k in row_images])
    with pytest.raises(PackingRefused, match="Qwen2VLForConditionalGeneration places image tokens on multi-axis rotary positions"):
        packed_logprobs(model, batch)


def test_sft_and_grpo_rows_of_a_multi_axis_model_carry_its_own_positions(tmp_path):
    """The SFT collator packs with the positions of the model's own rule (read from a weightless skeleton before
    any model loads), GRPO with the policy's: both rows are exact against each sequence alone (verify_row)."""
    from lightning_rl.data.sft import Example, PackedCollator
    from lightning_rl.models.multimodal import position_rule
    from lightning_rl.modules.grpo import GRPOModule
    from lightning_rl.rollout.base import Rollout
    from support.tiny_vlms import END, PAD, START, build_qwen2_vl, image_inputs

    path = build_qwen2_vl(tmp_path / "qwen2_vl")
    model = transformers.AutoModelForImageTextToText.from_pretrained(path).eval()
    token = {t: model.config.to_dict().get(k) for t, k in ((START, "vision_start_token_id"), (PAD, "image_token_id"), (END, "vision_end_token_id"))}
    image = {"a": image_inputs(1), "b": image_inputs(2)}
    prompt = lambda: [3, 4, token[START], *[token[PAD]] * 4, token[END], 5]  # noqa: E731
    seqs = [prompt() + [20, 21], prompt() + [20, 22, 23], prompt() + [30], [3, 9, token[START], *[token[PAD]] * 4, token[END], 6, 7]]
    keys = [["a"], ["a"], ["a"], ["b"]]
    examples = [Example(s, [False] * 9 + [True] * (len(s) - 9), images=[(k[0], image[k[0]])], image_token_id=token[PAD]) for s, k in zip(seqs, keys)]
    collate = PackedCollator(share_prefixes=True, pad_to_multiple_of=None, pad_token_id=0, image_token_id=token[PAD], position_rule=position_rule(str(path)))
    batch = collate(examples)
    assert batch.rope_position_ids is not None and batch.image_inputs["image_grid_thw"].shape[0] == 2
    assert verify_row(model, batch, attention_backend="blocks", samples=6, seed=0)[0] <= 1e-5

    module = GRPOModule(model_name_or_path=str(path), num_generations=2)
    module.policy, module.image_token_id, module.tokenizer = model, token[PAD], transformers.AutoTokenizer.from_pretrained(path)
    rollouts = [Rollout(prompt_ids=s[:9], completion_ids=s[9:], logprobs=[0.0] * (len(s) - 9), weight_version=0, group_id=i // 3,
                        metadata={"images": [(k[0], image[k[0]])]}) for i, (s, k) in enumerate(zip(seqs, keys))]  # fmt: skip
    packed_rollouts = module.pack_rollouts(rollouts, torch.zeros(len(rollouts)))
    assert torch.equal(packed_rollouts.rope_position_ids, batch.rope_position_ids)
    assert verify_row(model, packed_rollouts, attention_backend="blocks", samples=6, seed=0)[0] <= 1e-5


def paligemma(dtype):
    config = transformers.PaliGemmaConfig(
        text_config=dict(model_type="gemma", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=8, patch_size=4,
                           projection_dim=32),
        image_token_index=IMAGE, projection_dim=32,
    )  # fmt: skip
    return seeded(transformers.PaliGemmaForConditionalGeneration, config, dtype)


def test_gemma3_image_tokens_attend_to_their_whole_image_and_paligemma_is_refused():
    """Gemma 3's image tokens attend to each other both ways, as its processor's token type ids make them: packed, each
    image's placeholders are one such block on every branch (the family tests above hold it to the model's own forward
    with those ids), which differs from causal attention over them. PaliGemma is configured bidirectional throughout
    (its whole prefix), which a packed row cannot be: refused in one line."""
    model = gemma3(torch.float32)
    seqs, images, inputs = conversations(llava_image, torch.float32)
    batch, _ = packed(model, seqs, images, inputs)
    with torch.no_grad():
        ours = packed_logprobs(model, batch)
        causal = []
        for seq, keys in zip(seqs, images):  # the model's forward without token types attends causally over images
            ids = torch.tensor([seq])
            lp = torch.log_softmax(model(input_ids=ids, **stacked([inputs[k] for k in keys])).logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
            causal.append(lp[ids[0, 1:] != IMAGE])
    assert float((ours - torch.cat(causal)).abs().max()) > 1e-3
    model = paligemma(torch.float32)
    batch, row_images = pack_image_sequences([[1, *[IMAGE] * 4, 5, 20], [1, *[IMAGE] * 4, 5, 30]], [["a"], ["a"]], IMAGE)
    batch.image_inputs = stacked([{"pixel_values": torch.randn(1, 3, 8, 8)}])
    with pytest.raises(PackingRefused, match="PaliGemmaForConditionalGeneration is configured for bidirectional attention"):
        packed_logprobs(model, batch)


def test_each_image_gets_its_own_inputs_in_every_processor_layout(tmp_path):
    """Idefics3's processor stacks one sample's images along dim 1: a prompt with two images splits into two inputs
    that stack back into the model's layout; an image cut into tiles cannot be told apart and is refused."""
    from PIL import Image

    from lightning_rl.data.images import ImageRenderer
    from lightning_rl.packing.images import split_images, stack_images
    from support.tiny_idefics3 import build_idefics3

    processor = transformers.AutoProcessor.from_pretrained(build_idefics3(tmp_path / "idefics3"))
    pictures = [Image.new("RGB", (32, 32), colour) for colour in ((200, 0, 0), (0, 0, 200))]
    messages = [{"role": "user", "content": [{"type": "image", "image": p} for p in pictures] + [{"type": "text", "text": "which is red?"}]}]
    _, _, inputs = ImageRenderer(processor).render(messages, add_generation_prompt=True)
    assert len(inputs) == 2 and inputs[0]["pixel_values"].shape == (1, 1, 3, 32, 32)
    whole = processor.image_processor(images=[pictures], return_tensors="pt")
    assert not torch.equal(inputs[0]["pixel_values"], inputs[1]["pixel_values"])
    torch.testing.assert_close(stack_images(inputs)["pixel_values"].flatten(0, 1), whole["pixel_values"].flatten(0, 1))
    tiles = {"pixel_values": torch.zeros(1, 5, 3, 32, 32), "pixel_attention_mask": torch.ones(1, 5, 32, 32, dtype=torch.bool)}
    with pytest.raises(ValueError, match=r"cannot tell which of the processor's image inputs .* belong to which of its 2 images"):
        split_images(tiles, 2)
    # With image splitting on, a 64 x 64 image is four tiles and a global view, each a run of placeholders.
    processor.image_processor.do_image_splitting = True
    processor.image_processor.size = {"longest_edge": 64}
    big = [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (64, 64))}, {"type": "text", "text": "what?"}]}]
    with pytest.raises(ValueError, match=r"1 images but 5 runs of image placeholders after rendering \(a processor that splits"):
        ImageRenderer(processor, processor.tokenizer.convert_tokens_to_ids("<image>")).render(big, add_generation_prompt=True)


def test_images_of_different_crop_counts_stack_as_the_processor_pads_them():
    """LLaVA-NeXT images of two sizes have 2 and 3 crops: a row holding both zero-pads the fewer (the model reads the
    real count off ``image_sizes``) and stays exact against each sequence alone."""
    model = llava_next(torch.float32)
    square, _ = llava_next_image(1, torch.float32)
    wide, _ = llava_next_image(2, torch.float32, (8, 16))
    inputs = {"square": square, "wide": wide}
    tokens = {"square": 10, "wide": 14}  # the wide image's 2 x 1 crop grid, unpadded, with its newline features
    img = lambda key: [START] + [IMAGE] * tokens[key] + [END]  # noqa: E731
    seqs = [[1, 5, *img("square"), 6, 20, 21], [1, 5, *img("square"), 6, 30], [1, 8, *img("wide"), 9, 10], [1, 5, *img("square"), 6, 12, *img("wide"), 13]]
    images = [["square"], ["square"], ["wide"], ["square", "wide"]]
    batch, row_images = packed(model, seqs, images, inputs)
    assert batch.image_inputs["pixel_values"].shape == (3, 3, 3, 8, 8)  # square, wide, wide again after another prefix
    with torch.no_grad():
        error = (packed_logprobs(model, batch) - reference_logprobs(model, seqs, images, inputs)).abs().max()
    assert error <= 1e-5


def test_gemma3_rollouts_are_sampled_under_the_attention_the_trainer_scores():
    """The transformers engine gives Gemma 3 its image token types, so it samples with each image attended both ways,
    as the packed row is scored: engine and trainer log-probs agree (they would not if either ran causally)."""
    from lightning_rl.packing.images import pack_with_images
    from lightning_rl.rollout.base import PromptImages, SamplingConfig
    from lightning_rl.rollout.hf import HFRolloutEngine

    model = gemma3(torch.float32)
    engine = HFRolloutEngine(copy.deepcopy(model))
    image, n = llava_image(1, torch.float32)
    prompt = [1, 5, START, *[IMAGE] * n, END, 6]
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, seed=0, suppress_token_ids=(IMAGE,))
    rollouts = engine.generate([prompt], 4, sampling, images=[PromptImages([image], [], [])]).rollouts
    batch = pack_with_images([r.sequence for r in rollouts], [[("a", image)]] * 4, IMAGE, [r.loss_mask for r in rollouts],
                             token_values={"engine": [r.sequence_logprobs for r in rollouts]})  # fmt: skip
    assert batch.image_inputs["pixel_values"].shape[0] == 1
    with torch.no_grad():
        ours = packed_logprobs(model, batch, suppressed=(IMAGE,))
    torch.testing.assert_close(ours, batch.token_values["engine"], rtol=0, atol=1e-4)


def test_a_model_whose_text_reaches_its_images_by_cross_attention_is_refused():
    """Mllama's text attends to its images through cross-attention under a per-token mask, not through placeholders
    in the row: its processor's per-token inputs are refused by name when a row is rendered."""
    from PIL import Image

    from lightning_rl.data.images import ImageRenderer
    from lightning_rl.toy.model import build_tokenizer
    from lightning_rl.toy.vlm import VLM_CHAT_TEMPLATE

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|image|>"], "bos_token": "<s>"})
    processor = transformers.MllamaProcessor(
        image_processor=transformers.MllamaImageProcessorPil(size={"height": 16, "width": 16}, max_image_tiles=1),
        tokenizer=tokenizer, chat_template=VLM_CHAT_TEMPLATE.replace("<image>", "<|image|>"),
    )  # fmt: skip
    messages = [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (16, 16))}, {"type": "text", "text": "what is it?"}]}]
    with pytest.raises(ValueError, match=r"the processor gives per-token inputs \(cross_attention_mask\) besides the image placeholders"):
        ImageRenderer(processor).render(messages, add_generation_prompt=True)


def test_which_models_group_image_tokens_into_blocks_and_by_which_rule():
    """Only the Gemma family's rule (each run of image tokens one block) is what a packed row computes; a model that
    builds its blocks otherwise (Molmo2: every image token in one block; PaliGemma, DeepSeek-OCR 2: a prefix) has its
    image rows refused, and the rest attend causally."""
    from lightning_rl.models.multimodal import image_block_rule

    rules = {name: image_block_rule(getattr(transformers, name)) for name in (
        "Gemma3ForConditionalGeneration", "Gemma4ForConditionalGeneration", "Molmo2ForConditionalGeneration",
        "PaliGemmaForConditionalGeneration", "DeepseekOcr2ForConditionalGeneration", "LlavaForConditionalGeneration",
        "Qwen2VLForConditionalGeneration", "Idefics3ForConditionalGeneration")}  # fmt: skip
    assert rules == {
        "Gemma3ForConditionalGeneration": "runs", "Gemma4ForConditionalGeneration": "runs", "Molmo2ForConditionalGeneration": "other",
        "PaliGemmaForConditionalGeneration": "other", "DeepseekOcr2ForConditionalGeneration": "other",
        "LlavaForConditionalGeneration": None, "Qwen2VLForConditionalGeneration": None, "Idefics3ForConditionalGeneration": None,
    }  # fmt: skip


def test_images_side_by_side_are_refused_for_what_they_are():
    """The embedded image-text model's template writes two adjacent images' placeholders as one run: refused naming
    that (and the fix), not as a processor that splits an image; with text between them the row renders."""
    from PIL import Image

    from lightning_rl.data.images import ImageRenderer
    from lightning_rl.models.multimodal import load_processor
    from lightning_rl.models.paths import resolve_model_path

    processor, image_token = load_processor(resolve_model_path("tiny-vlm"))
    picture = {"type": "image", "image": Image.new("RGB", (16, 16), (200, 0, 0))}
    adjacent = [{"role": "user", "content": [picture, picture, {"type": "text", "text": "same?"}]}]
    with pytest.raises(ValueError, match=r"2 images but 1 runs .*images side by side, with no text between them"):
        ImageRenderer(processor, image_token).render(adjacent, add_generation_prompt=True)
    apart = [{"role": "user", "content": [picture, {"type": "text", "text": "and"}, picture, {"type": "text", "text": "same?"}]}]
    assert len(ImageRenderer(processor, image_token).render(apart, add_generation_prompt=True)[2]) == 2


def test_the_markers_an_image_text_processor_writes_are_kept_out_of_sampling(tmp_path):
    """Only the tokens a config names were kept out of sampling: Idefics3's processor writes markers of its own."""
    from lightning_rl.models.multimodal import multimodal_token_ids, processor_token_ids
    from support.tiny_idefics3 import build_idefics3

    path = build_idefics3(tmp_path / "idefics3")
    processor, tokenizer = transformers.AutoProcessor.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(path)
    kept_out = {*multimodal_token_ids(transformers.AutoConfig.from_pretrained(path)), *processor_token_ids(processor, tokenizer)}
    assert {tokenizer.convert_ids_to_tokens(i) for i in kept_out} == {"<image>", "<fake_token_around_image>", "<global-img>"}
    assert processor_token_ids(None, tokenizer) == ()  # a text-only model


@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "idefics3"])
def test_rows_continuing_prefixes_that_hold_images_equal_one_row(family):
    """Two images, each asked four questions below a shared text prompt, in rows too small for an image's questions:
    the text is a span's prefix and each image's part a nested one, which encodes its image once for its rows. The
    loss, its gradient and verify_row are those of every sequence in one row; a prompt that ends in an image's
    placeholders stops its prefix before them (the rows encode the image)."""
    from lightning_rl.data.images import keyed_image_ids
    from lightning_rl.ops.prefix_rows import finish_prefix, share_prefixes
    from lightning_rl.packing.planner import plan_batch_rows, prefix_limits

    build, make_image = FAMILIES[family]
    model = build(torch.float32)
    (a, n), (b, _) = make_image(1, torch.float32), make_image(2, torch.float32)
    inputs, token = {"a": a, "b": b}, image_token_id(model.config)
    seqs, images = [], []
    for key, question in (("a", 41), ("b", 42)):
        for k in range(4):
            seqs.append([*range(1, 12), question, START, *[IMAGE] * n, END, 15, 16, 45 + k, 50 + k, 47])
            images.append([key])
    masks = [[False] * (len(s) - 3) + [True] * 3 for s in seqs]
    encoded = []
    tower = next(m for name, m in model.named_modules() if name.endswith(("vision_tower", "visual", "vision_model")))
    tower.register_forward_hook(lambda *_: encoded.append(1))

    def step(rows, prefixes):
        model.zero_grad()
        encoded.clear()
        batches = []
        for row in rows:
            rope = [rope_positions(model, seqs[i], stacked([inputs[k] for k in images[i]])) for i in row]
            batch, keys = pack_image_sequences([seqs[i] for i in row], [images[i] for i in row], token, [masks[i] for i in row],
                                               rope_positions=None if rope[0] is None else rope)  # fmt: skip
            batch.image_inputs = stacked([inputs[k] for k in keys])
            batches.append(batch)
        total, cut = 0.0, share_prefixes(batches, prefixes, image_token_id=token)
        for batch in cut:
            loss = -packed_logprobs(model, batch).sum()
            loss.backward()
            finish_prefix(batch)
            total += float(loss)
        return total, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}, cut

    one_loss, one, _ = step([list(range(len(seqs)))], [None])
    assert len(encoded) == 1
    keyed = [keyed_image_ids(s, keys, token) for s, keys in zip(seqs, images)]
    rows, prefixes = plan_batch_rows(keyed, masks, 8, "always")
    assert all(isinstance(p, tuple) and isinstance(p[0], tuple) for p in prefixes)  # every row continues a nested prefix
    loss, spans, cut = step(rows, prefixes)
    assert len(encoded) == 2  # each image once, in its nested prefix's forward
    assert loss == pytest.approx(one_loss, rel=1e-5)
    for name, grad in one.items():
        torch.testing.assert_close(spans[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert verify_row(model, cut[-1])[0] < 1e-5  # each path through the chain of prefixes, with their images
    # A prompt ending in an image's placeholders: the prefix stops before the image.
    ends_in_image = [1, 2, 3, START, *[IMAGE] * n, 9]
    assert prefix_limits([[False] * (len(ends_in_image) - 1) + [True]], [ends_in_image], token) == [4]
