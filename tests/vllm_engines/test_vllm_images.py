"""Image prompts on the vLLM engines (in-process and server), on a tiny Idefics3: vLLM is given the images and the
prompt as the chat template wrote it, expands the placeholders itself into the very prompt the trainer scores (or
the request is refused), samples no multimodal token when they are suppressed, and reports the log-probs
transformers gives the same image and tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_checks import KV_CACHE_BYTES, LOGPROB_ATOL
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from lightning_rl.data.images import ImageRenderer, images_of
from lightning_rl.models.multimodal import multimodal_token_ids
from lightning_rl.rollout.base import PromptImages, SamplingConfig
from lightning_rl.rollout.vllm_engine import VLLMEngine
from lightning_rl.rollout.vllm_server import VLLMServerEngine
from support.tiny_idefics3 import build_idefics3

COLOURS = [(220, 30, 30), (30, 30, 220), (30, 200, 30)]


def picture(k: int) -> Image.Image:
    image = Image.new("RGB", (32, 32), COLOURS[k % 3])
    image.paste((250, 250, 250), (4 * k, 4, 4 * k + 10, 14))
    return image


def conversation(images: list[Image.Image], question: str) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image", "image": i} for i in images), {"type": "text", "text": question}]}]


def prompt_of(processor, messages) -> tuple[list[int], PromptImages]:
    renderer = ImageRenderer(processor)
    ids, _, inputs = renderer.render(messages, add_generation_prompt=True)
    return ids, PromptImages(inputs, images_of(messages), renderer.template_ids(messages, add_generation_prompt=True))


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory) -> Path:
    return build_idefics3(tmp_path_factory.mktemp("tiny-idefics3"))


@pytest.fixture(scope="module")
def prompts(idefics3):
    """Two prompts: one image, and two images in one turn."""
    processor = AutoProcessor.from_pretrained(idefics3)
    return processor, [
        (conversation([picture(0)], "what colour is the square?"), *prompt_of(processor, conversation([picture(0)], "what colour is the square?"))),
        (conversation([picture(1), picture(2)], "which is red?"), *prompt_of(processor, conversation([picture(1), picture(2)], "which is red?"))),
    ]


@torch.no_grad()
def reference_logprobs(model, processor, messages, completion: list[int], temperature: float, suppressed: tuple[int, ...] = ()) -> torch.Tensor:
    """transformers' log-probs of ``completion`` after the image prompt, with ``suppressed`` out of the distribution."""
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    prompt = inputs.pop("input_ids")
    inputs.pop("attention_mask", None)
    ids = torch.cat([prompt, torch.tensor([completion])], dim=1)
    logits = model(input_ids=ids, **inputs).logits[0, prompt.shape[1] - 1 : -1].float()
    if suppressed:
        logits[:, list(suppressed)] = float("-inf")
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def bias_towards(model, token: int) -> dict[str, torch.Tensor]:
    """Weights under which ``token`` is the likeliest next token almost everywhere: only suppression keeps it out."""
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        head[token] = head.abs().max() * 50 * torch.sign(head.mean(0) + 1e-3)
    return dict(model.state_dict())


def check_engine(engine, idefics3: Path, prompts) -> None:
    processor, cases = prompts
    model = AutoModelForImageTextToText.from_pretrained(idefics3, dtype=torch.float32).eval()
    ids = [ids for _, ids, _ in cases]
    images = [own for _, _, own in cases]

    batch = engine.generate(ids, 4, SamplingConfig(max_new_tokens=8, temperature=1.0, seed=3), images=images)
    for rollout in batch.rollouts:
        messages = cases[rollout.group_id][0]
        assert rollout.prompt_ids == ids[rollout.group_id]  # the prompt the trainer scores, placeholders expanded
        error = (torch.tensor(rollout.logprobs) - reference_logprobs(model, processor, messages, rollout.completion_ids, 1.0)).abs().max()
        assert error < LOGPROB_ATOL

    # The image token made the likeliest: sampled without suppression, never with it, and the log-probs are those
    # of the distribution without the suppressed tokens.
    suppressed = multimodal_token_ids(model.config)
    image_token = model.config.image_token_id
    assert image_token in suppressed
    original = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    engine.push_weights(bias_towards(model, image_token).items(), version=1)
    hot = SamplingConfig(max_new_tokens=8, temperature=2.0, seed=5)
    assert any(image_token in r.completion_ids for r in engine.generate(ids, 4, hot, images=images).rollouts)
    guarded = SamplingConfig(max_new_tokens=8, temperature=2.0, seed=5, suppress_token_ids=suppressed)
    batch = engine.generate(ids, 4, guarded, images=images)
    assert not any(set(r.completion_ids) & set(suppressed) for r in batch.rollouts)
    for rollout in batch.rollouts:
        messages = cases[rollout.group_id][0]
        expected = reference_logprobs(model, processor, messages, rollout.completion_ids, 2.0, suppressed)
        assert (torch.tensor(rollout.logprobs) - expected).abs().max() < LOGPROB_ATOL

    # A prompt whose placeholders vLLM would expand otherwise than the processor is refused, not sampled after.
    wrong = PromptImages(images[0].inputs, images[0].images, ids[0])  # already expanded: vLLM expands it again
    with pytest.raises(ValueError, match="prompt 0 expands to .* tokens in vLLM but .* in the model's processor"):
        engine.generate(ids[:1], 1, guarded, images=[wrong])
    engine.push_weights(original.items(), version=2)  # the checkpoint's own weights again, for whoever samples next


def test_in_process_engine_takes_image_prompts(idefics3, prompts):
    engine = VLLMEngine(idefics3, dtype="float32", max_model_len=256, kv_cache_memory_bytes=KV_CACHE_BYTES, enforce_eager=True)
    try:
        check_engine(engine, idefics3, prompts)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def server(idefics3, tmp_path_factory):
    engine = VLLMServerEngine(idefics3, server_options={
        "dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": KV_CACHE_BYTES, "enforce_eager": True,
        "log_path": tmp_path_factory.mktemp("vllm-server-images") / "server.log",
    })
    yield engine
    engine.close()


def test_server_engine_takes_image_prompts(server, idefics3, prompts):
    check_engine(server, idefics3, prompts)


def test_grpo_trains_on_image_prompts_sampled_by_vllm(server, idefics3, prompts, tmp_path):
    """A real Trainer runs GRPO on the embedded image task with the server as its engine: the rollouts are scored
    tree-packed with their images (checked against each rollout alone), and afterwards the server samples from the
    trained policy. Runs after the test above: its client takes over the server's transfer group."""
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from lightning_rl.data.prompts import PromptDataModule
    from lightning_rl.modules.grpo import GRPOModule

    module = GRPOModule(
        model_name_or_path=str(idefics3), num_generations=4, sampling={"max_new_tokens": 4}, learning_rate=1e-3,
        rewards=[{"function": "math_answer"}], eval_generations=0,
        engine={"class_path": "vllm_server", "init_args": {"url": server.url}},
    )  # fmt: skip
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=CSVLogger(tmp_path), log_every_n_steps=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, PromptDataModule(path="toy_shapes", prompt_field="messages", batch_size=2))
    (metrics,) = tmp_path.glob("**/metrics.csv")
    header, *rows = [line.split(",") for line in metrics.read_text().splitlines()]
    column = header.index("train/packing_error")
    errors = [float(row[column]) for row in rows if row[column]]
    assert errors and max(errors) < 1e-4  # the first image row, tree-packed, against each rollout alone

    processor, cases = prompts
    observer = VLLMServerEngine(url=server.url)
    suppressed = module.sampling.suppress_token_ids
    batch = observer.generate([c[1] for c in cases], 2, SamplingConfig(max_new_tokens=6, seed=9, suppress_token_ids=suppressed),
                              images=[c[2] for c in cases])
    observer.close()
    assert all(r.weight_version == trainer.global_step == 2 for r in batch.rollouts)
    policy = module.policy.float().eval()
    for rollout in batch.rollouts:
        expected = reference_logprobs(policy, processor, cases[rollout.group_id][0], rollout.completion_ids, 1.0, suppressed)
        assert (torch.tensor(rollout.logprobs) - expected).abs().max() < LOGPROB_ATOL
