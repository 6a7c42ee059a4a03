"""GRPO with image prompts: the transformers engine samples from image prompts without ever sampling a multimodal
token, its log-probs are those of the distribution it sampled and equal the trainer's tree-packed ones (the image
forwarded once for the G completions), and a run from a recipe trains synchronously and asynchronously."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from transformers import AutoConfig

from lightning_rl import cli
from lightning_rl.data.images import ImageRenderer, image_key, images_of
from lightning_rl.models.multimodal import load_processor
from lightning_rl.modules.grpo import GRPOModule
from lightning_rl.rollout.base import PromptImages, SamplingConfig
from lightning_rl.rollout.hf import HFRolloutEngine
from lightning_rl.toy.shapes import COLOURS, QUESTION
from lightning_rl.toy.vlm import tiny_vlm_path
from support.paths import REPO

VLM_GRPO = str(REPO / "recipes" / "tiny" / "vlm_grpo.yaml")


def image_prompt(processor, colour: str):
    """(prompt ids, each image's key and inputs for packing, the images as engines take them)."""
    image = Image.new("RGB", (16, 16), COLOURS[colour])
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]}]
    renderer = ImageRenderer(processor)
    ids, _, inputs = renderer.render(messages, add_generation_prompt=True)
    engine_images = PromptImages(inputs, images_of(messages), renderer.template_ids(messages, add_generation_prompt=True))
    return ids, list(zip([image_key(i) for i in images_of(messages)], inputs)), engine_images


def test_template_ids_are_the_prompt_before_the_processor_expands_its_placeholders():
    processor, image_token = load_processor(str(tiny_vlm_path()))
    ids, _, engine_images = image_prompt(processor, "red")
    template = engine_images.template_ids
    assert template.count(image_token) == 1 and ids.count(image_token) > 1
    at = template.index(image_token)
    expanded = template[:at] + [image_token] * ids.count(image_token) + template[at + 1 :]
    assert expanded == ids


def test_no_multimodal_token_is_sampled_and_engine_logprobs_are_the_trainers(tmp_path):
    path = str(tiny_vlm_path())
    processor, image_token = load_processor(path)
    engine = HFRolloutEngine(path)
    # Make the image token the likeliest next token everywhere, so that only suppression keeps it out.
    head = engine.model.get_output_embeddings()
    with torch.no_grad():
        head.weight[image_token] = head.weight[image_token] * 0 + head.weight.abs().max() * 50 * torch.sign(head.weight.mean(0) + 1e-3)
    prompts = [image_prompt(processor, "red"), image_prompt(processor, "blue")]
    hot = SamplingConfig(max_new_tokens=12, temperature=3.0, seed=1)
    unguarded = engine.generate([p for p, _, _ in prompts], 8, hot, images=[own for _, _, own in prompts])
    assert any(image_token in r.completion_ids for r in unguarded.rollouts)  # the bias works: the guard is needed

    guarded_sampling = SamplingConfig(max_new_tokens=12, temperature=3.0, seed=1, suppress_token_ids=(image_token,))
    batch = engine.generate([p for p, _, _ in prompts], 8, guarded_sampling, images=[own for _, _, own in prompts])
    assert not any(image_token in r.completion_ids for r in batch.rollouts)

    # The trainer, on the same weights, scores the rollouts tree-packed with their images under the same rule.
    module = GRPOModule(model_name_or_path=path, num_generations=8, sampling={"temperature": 3.0, "max_new_tokens": 12})
    module.configure_model()
    module.policy.load_state_dict(engine.model.state_dict())
    assert module.sampling.suppress_token_ids == (image_token,)
    for rollout in batch.rollouts:
        rollout.metadata["images"] = prompts[rollout.group_id][1]
    packed = module.pack_rollouts(batch.rollouts, torch.zeros(len(batch.rollouts)))
    assert packed.image_inputs["pixel_values"].shape[0] == 2  # each prompt's image once for its 8 completions
    with torch.no_grad():
        logprobs, _ = module.policy_logprobs(module.policy, packed)
    torch.testing.assert_close(logprobs, packed.token_values["engine_logprobs"], rtol=0, atol=1e-4)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_grpo_on_image_prompts_runs_from_the_recipe(mode, tmp_path):
    extra = ["--model.async_mode=true", "--model.max_staleness=1"] if mode == "async" else []
    code = cli.main(["run", VLM_GRPO, f"--output_dir={tmp_path}", "--trainer.max_steps=4", "--trainer.enable_progress_bar=false",
                     "--model.model_name_or_path=tiny-vlm", "--model.eval_generations=0", "--model.eval_data=null", "--trainer.log_every_n_steps=1",
                     *extra])  # fmt: skip
    assert code == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 4 and "reward_first_window_mean" in summary and "reward_last_window_mean" in summary
    (metrics,) = tmp_path.glob("csv/version_*/metrics.csv")
    assert "train/packing_error" in metrics.read_text()  # verify_packing checked the first image row against each rollout alone
    assert (tmp_path / "hf" / "processor_config.json").is_file()  # the export loads with AutoProcessor


CALL = {"name": "calculator", "arguments": {"operation": "add", "a": 7, "b": 5}}


@pytest.fixture(scope="module")
def tool_calling_vlm(tmp_path_factory):
    """The tiny image-text model trained here until it reproduces a conversation that calls the calculator after
    an image prompt, saved with its processor."""
    from transformers import AutoModelForImageTextToText

    from lightning_rl.packing.images import stack_images
    from lightning_rl.tools import Tool
    from lightning_rl.tools.builtin import calculator

    path = str(tiny_vlm_path())
    processor, _ = load_processor(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    tools = [Tool.from_function(calculator).chat_template_spec()]
    image = Image.new("RGB", (16, 16), COLOURS["red"])
    conversation = [
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "7+5="}]},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALL}]},
        {"role": "tool", "name": "calculator", "content": "12"},
        {"role": "assistant", "content": "12"},
    ]
    ids, mask, inputs = ImageRenderer(processor).render(conversation, assistant_mask=True, tools=tools)
    ids, trained = torch.tensor([ids]), torch.tensor([mask])[:, 1:]
    pixels = stack_images(inputs)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(300):  # until greedy decoding reproduces every assistant token
        logits = model(input_ids=ids, **pixels).logits[:, :-1]
        if (logits.argmax(-1) == ids[:, 1:])[trained].all():
            break
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        optimizer.zero_grad()
        (-logp[trained].mean()).backward()
        optimizer.step()
    assert (logits.argmax(-1) == ids[:, 1:])[trained].all(), "the model did not learn the conversation"
    folder = tmp_path_factory.mktemp("tool-vlm")
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder, conversation[:1], tools


def test_tool_conversations_keep_the_prompts_image_in_every_turn(tool_calling_vlm):
    """The reply after the tool's response is sampled from the image prompt, the call and the response (the image
    still there), and its log-probs are those of the whole sequence with its image."""
    from transformers import AutoModelForImageTextToText

    from lightning_rl.packing.images import stack_images
    from lightning_rl.tools import Tool, ToolExecutor
    from lightning_rl.tools.builtin import calculator
    from lightning_rl.rollout.conversation import ToolConversation

    folder, prompt, tools = tool_calling_vlm
    processor, image_token = load_processor(str(folder))
    renderer = ImageRenderer(processor)
    ids, _, inputs = renderer.render(prompt, add_generation_prompt=True, tools=tools)
    own = PromptImages(inputs, images_of(prompt), renderer.template_ids(prompt, add_generation_prompt=True, tools=tools))
    engine = HFRolloutEngine(str(folder))
    executor = ToolExecutor([Tool.from_function(calculator)])
    sampling = SamplingConfig(max_new_tokens=48, temperature=0, suppress_token_ids=(image_token,))
    batch = ToolConversation(engine, processor.tokenizer, executor, max_turns=3).generate([ids], [2], lambda turn: sampling, images=[own])
    executor.close()
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    for rollout in batch.rollouts:
        assert [c["content"] for c in rollout.metadata["tool_calls"]] == ["12"] and rollout.metadata["final_reply"] == "12"
        assert rollout.completion_mask[-1] and not all(rollout.completion_mask)  # the last reply came after a tool response
        sequence = torch.tensor([rollout.sequence])
        with torch.no_grad():
            logits = model(input_ids=sequence, **stack_images(inputs)).logits[0, len(ids) - 1 : -1]
        logits[:, image_token] = torch.finfo(logits.dtype).min
        reference = torch.log_softmax(logits, -1).gather(-1, sequence[0, len(ids) :, None])[:, 0]
        sampled = torch.tensor(rollout.completion_mask)
        torch.testing.assert_close(torch.tensor(rollout.logprobs)[sampled], reference[sampled], rtol=0, atol=1e-4)


def test_grpo_with_tools_runs_on_image_prompts_from_the_recipe(tool_calling_vlm, tmp_path):
    folder, prompt, _ = tool_calling_vlm
    image = tmp_path / "red.png"
    Image.new("RGB", (16, 16), COLOURS["red"]).save(image)
    row = {"messages": [{"role": "user", "content": [{"type": "image", "image": image.name}, {"type": "text", "text": "7+5="}]}], "answer": "12"}
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(row) for _ in range(4)) + "\n")
    code = cli.main(["run", VLM_GRPO, f"--output_dir={tmp_path / 'out'}", "--trainer.max_steps=2", "--trainer.enable_progress_bar=false",
                     f"--model.model_name_or_path={folder}", "--model.eval_generations=0", "--model.eval_data=null", "--trainer.log_every_n_steps=1",
                     f"--data.path={data}", "--data.batch_size=2", "--model.num_generations=2", "--model.sampling.max_new_tokens=40",
                     "--model.tools=[lightning_rl.tools.builtin:calculator]", "--model.max_turns=2"])  # fmt: skip
    assert code == 0
    (metrics,) = (tmp_path / "out").glob("csv/version_*/metrics.csv")
    header, *rows = [line.split(",") for line in metrics.read_text().splitlines()]
    calls = [float(r[header.index("train/tools/calls")]) for r in rows if r[header.index("train/tools/calls")]]
    errors = [float(r[header.index("train/packing_error")]) for r in rows if r[header.index("train/packing_error")]]
    assert calls and min(calls) > 0  # every step's rollouts called the tool after the image prompt
    assert errors and max(errors) < 1e-4  # the image row with tool turns, tree-packed, against each rollout alone


def test_grpo_prompts_may_leave_their_images_to_an_images_column(tmp_path):
    """Prompt rows in the layout of `datasets` image sets: ``{"type": "image"}`` parts, the images in a column."""
    Image.new("RGB", (16, 16), COLOURS["red"]).save(tmp_path / "red.png")
    row = {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}], "images": ["red.png"], "answer": "red"}
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(row) for _ in range(4)) + "\n")
    code = cli.main(["run", VLM_GRPO, f"--output_dir={tmp_path / 'out'}", "--trainer.max_steps=1", "--trainer.enable_progress_bar=false",
                     "--model.model_name_or_path=tiny-vlm", "--model.eval_generations=0", "--model.eval_data=null",
                     f"--data.path={data}", "--data.prompt_field=prompt", "--data.batch_size=2", "--model.num_generations=2"])  # fmt: skip
    assert code == 0
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["steps"] == 1


def test_an_image_column_beside_text_prompts_goes_before_the_first_user_turn_as_trl_places_it(tmp_path):
    """TRL's layout of image prompt sets: text turns (or a string prompt) and the images in a column. The column was
    read only where a turn held an image part, so these prompts trained without their images, silently."""
    from transformers import AutoTokenizer

    from lightning_rl.data.prompts import PromptDataModule, PromptRenderer
    from lightning_rl.data.sft import DataError

    Image.new("RGB", (16, 16), COLOURS["red"]).save(tmp_path / "red.png")
    explicit = {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}], "images": ["red.png"]}
    data = tmp_path / "prompts.jsonl"
    path = str(tiny_vlm_path())
    processor, image_token = load_processor(path)
    renderer = PromptRenderer(AutoTokenizer.from_pretrained(path), processor, image_token)
    rendered = []
    # A file holds one shape of prompt: the string one in a file of its own.
    for rows in ([explicit, {"prompt": [{"role": "user", "content": QUESTION}], "images": ["red.png"]}], [{"prompt": QUESTION, "image": "red.png"}]):
        data.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
        source = PromptDataModule(path=str(data), prompt_field="prompt", batch_size=1)
        source.setup()
        rendered += [renderer.render(record, source) for record in source.records]
    assert len(rendered) == 3
    assert image_token in rendered[0].ids
    for other in rendered[1:]:
        assert other.ids == rendered[0].ids and len(other.image_inputs) == 1
        assert all(torch.equal(other.image_inputs[0][key], value) for key, value in rendered[0].image_inputs[0].items())
    # The reward functions read each prompt as TRL gives it: every turn a list of parts, the image part holding the
    # opened image (they got the prompt as written: an empty image part, or a string turn with no image at all).
    for prompt in rendered:
        (turn,) = prompt.for_rewards
        assert [part["type"] for part in turn["content"]] == ["image", "text"] and turn["content"][1]["text"] == QUESTION
        assert turn["content"][0]["image"].size == (16, 16) and turn["content"][0]["image"].getpixel((0, 0)) == COLOURS["red"]
    data.write_text(json.dumps({"prompt": QUESTION, "image": "blue.png"}) + "\n")  # a missing image: found as the data is set up
    with pytest.raises(DataError, match=r"prompts.jsonl: line 1: .*blue.png"):
        PromptDataModule(path=str(data), prompt_field="prompt", batch_size=1).setup()


def test_images_that_do_not_pair_with_the_prompts_are_refused():
    path = str(tiny_vlm_path())
    processor, _ = load_processor(path)
    ids, _, own = image_prompt(processor, "red")
    with pytest.raises(ValueError, match=r"1 image entries for 2 prompts \(one per prompt, None for a text prompt\)"):
        HFRolloutEngine(path).generate([ids, ids], 2, SamplingConfig(max_new_tokens=2), images=[own])


def test_qwen_vl_image_tokens_sit_on_their_multi_axis_positions_in_generation_and_under_lora(tmp_path):
    """The transformers engine generated a Qwen-VL prompt with its image tokens on 1-D positions (the model's
    generate finds image tokens by the token types, which were not given), so rollouts came from another policy than
    the trainer scores; and a LoRA-wrapped policy hid the model's position rule from packing (no refusal, wrong
    positions, a self-check blind to it)."""
    from transformers import AutoModelForImageTextToText

    from lightning_rl.models.loading import LoraSettings, load_causal_lm
    from lightning_rl.models.multimodal import uses_multi_axis_positions
    from support.tiny_vlms import build_qwen2_vl, image_inputs

    path = build_qwen2_vl(tmp_path / "qwen2-vl")
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    config = model.config
    start, pad, end = config.vision_start_token_id, config.image_token_id, config.vision_end_token_id
    image, prompt = image_inputs(1), [3, 4, start, *[pad] * 4, end, 5]
    suppressed = (pad, start, end, config.video_token_id)
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, seed=1, suppress_token_ids=suppressed)
    batch = HFRolloutEngine(str(path)).generate([prompt], 2, sampling, images=[PromptImages([image], [None], [])])
    for rollout in batch.rollouts:
        ids = torch.tensor([rollout.sequence])
        with torch.no_grad():
            logits = model(input_ids=ids, mm_token_type_ids=(ids == pad).int(), **image).logits[0, len(prompt) - 1 : -1]
        logits[:, list(suppressed)] = float("-inf")
        own = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
        torch.testing.assert_close(torch.tensor(rollout.logprobs), own, rtol=0, atol=1e-5)  # 3e-4 to 1e-3 before
    assert uses_multi_axis_positions(load_causal_lm(str(path), lora=LoraSettings(r=4, alpha=8, target_modules=["q_proj", "v_proj"])))


def test_an_image_that_decodes_whole_though_its_end_marker_is_cut_is_read_as_sft_reads_it(tmp_path):
    """A PNG missing its last bytes (the end marker): SFT decodes it and trains; GRPO's check of the prompts, which
    does not decode, refused it for its checksum. Both read it now; one that does not decode is refused by both."""
    from lightning_rl.data.images import check_prompt_images, load_images

    Image.new("RGB", (16, 16), COLOURS["red"]).save(tmp_path / "red.png")
    (tmp_path / "cut.png").write_bytes((tmp_path / "red.png").read_bytes()[:-20])
    record = {"prompt": [{"role": "user", "content": [{"type": "image", "image": "cut.png"}, {"type": "text", "text": QUESTION}]}]}
    check_prompt_images(record, tmp_path)
    (turn,) = load_images({"prompt": record["prompt"]}, tmp_path)["prompt"]
    assert turn["content"][0]["image"].getpixel((15, 15)) == COLOURS["red"]
    (tmp_path / "cut.png").write_bytes((tmp_path / "red.png").read_bytes()[:60])
    with pytest.raises(ValueError, match=r"cut.png cannot be read as an image"):
        check_prompt_images(record, tmp_path)


@pytest.mark.parametrize("family", ["llava", "qwen2-vl"])
def test_an_image_prompt_forwarded_once_across_rows_gives_the_gradient_of_one_row(family, tmp_path):
    """Two image prompts' groups of 8, in rows too small for a group: each prompt, its image included, is forwarded
    (and its image encoded) once for its rows, on 1-D or multi-axis positions, and the step's gradient and
    verify_packing are those of all rollouts in one row."""
    from lightning_rl.losses import StepCounts
    from lightning_rl.ops.packed_forward import verify_row
    from lightning_rl.ops.prefix_rows import finish_prefix, plan_step_rows, share_prefixes
    from support.tiny_vlms import build_qwen2_vl, image_inputs

    if family == "llava":
        path = str(tiny_vlm_path())
        processor, image_token = load_processor(path)
        prompts = [image_prompt(processor, colour) for colour in ("red", "blue")]
        budget = 30  # a prompt of 45 tokens; 8 answers of 8 in 3 rows
    else:  # multi-axis rotary positions
        path = str(build_qwen2_vl(tmp_path / "qwen2-vl"))
        config = AutoConfig.from_pretrained(path)
        image_token = config.image_token_id
        prompts = []
        for seed in (1, 2):
            prompt, image = [3, 4, config.vision_start_token_id, *[image_token] * 4, config.vision_end_token_id, 5], image_inputs(seed)
            prompts.append((prompt, [(seed, image)], PromptImages([image], [None], [])))
        budget = 20  # a prompt of 10 tokens
    module = GRPOModule(model_name_or_path=path, num_generations=8, sampling={"max_new_tokens": 8})
    module.configure_model()
    module.image_token_id = image_token  # the built Qwen2-VL folder has no processor to read it from
    engine = HFRolloutEngine(path)
    sampling = SamplingConfig(max_new_tokens=8, temperature=3.0, seed=2, suppress_token_ids=module.sampling.suppress_token_ids)
    batch = engine.generate([p for p, _, _ in prompts], 8, sampling, images=[own for _, _, own in prompts])
    for rollout in batch.rollouts:
        rollout.metadata["images"] = prompts[rollout.group_id][1]
    module.policy.load_state_dict(engine.model.state_dict())
    rollouts, advantages = batch.rollouts, torch.linspace(-1, 1, len(batch.rollouts))
    tokens = sum(sum(r.completion_mask) for r in rollouts)
    counts = StepCounts(num_sequences=len(rollouts), num_tokens=tokens, rank_tokens=tokens, max_completion_length=8)

    def gradients(rows, prefixes):
        module.policy.zero_grad()
        packed_rows = share_prefixes([module.pack_rollouts([rollouts[i] for i in row], advantages[row]) for row in rows], prefixes, image_token_id=image_token)
        for packed in packed_rows:
            terms, _ = module.row_loss(packed)
            module.loss.reduce(terms, packed.loss_seq, torch.bincount(packed.loss_seq, minlength=packed.num_sequences), counts).backward()
            finish_prefix(packed)
        return {n: p.grad.clone() for n, p in module.policy.named_parameters() if p.grad is not None}, packed_rows

    encoded = []
    tower = next(m for name, m in module.policy.named_modules() if name.endswith(("vision_tower", "visual")))
    tower.register_forward_hook(lambda *_: encoded.append(1))
    one, _ = gradients([list(range(len(rollouts)))], [None])
    assert len(encoded) == 1  # both images, once, in one row
    plan = plan_step_rows(budget, "always", module.policy, [r.sequence for r in rollouts], [r.loss_mask for r in rollouts],
                          [r.group_id for r in rollouts], apart=False)  # fmt: skip
    rows, prefixes = plan.ranks[0], plan.prefixes[0]
    assert len(rows) >= 6 and all(p is not None for p in prefixes)  # every row continues its group's image prompt
    encoded.clear()
    spans, packed_rows = gradients(rows, prefixes)
    assert len(encoded) == 2  # each prompt's image encoded once for its rows
    for name, grad in one.items():
        torch.testing.assert_close(spans[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    error, _, _ = verify_row(module.policy, packed_rows[-1])
    assert error < 1e-5
