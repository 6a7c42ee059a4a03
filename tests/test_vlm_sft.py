"""SFT of an image-text model on images, through the real `lightning-rl run`: the embedded tiny LLaVA-style model
learns the embedded image task well above chance, and every bad image row is one error line naming the file and
line, with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from lightning_rl import cli
from lightning_rl.toy.shapes import COLOURS
from support.paths import REPO

VLM_SFT = str(REPO / "recipes" / "tiny" / "vlm_sft.yaml")
SHORT = ["--trainer.max_steps=1", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
         "--data.val_data=null", "--model.eval_generations=0", "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0"]  # fmt: skip


def test_the_tiny_vlm_learns_the_image_task_well_above_chance(tmp_path):
    assert cli.main(["run", VLM_SFT, f"--output_dir={tmp_path}", "--trainer.enable_progress_bar=false"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    chance = 1 / len(COLOURS)
    assert summary["heldout_examples"] == 100 and summary["heldout_exact_match"] >= 2 * chance, summary
    assert summary["packing"] == "tree" and summary["loss_last_window_mean"] < summary["loss_first_window_mean"] / 4


def _row(image: str, answer: str = "red", text: str = "What colour is the square?", where: str = "user") -> dict:
    part = {"type": "image", "image": image}
    user = {"role": "user", "content": [part, {"type": "text", "text": text}] if where == "user" else text}
    assistant = {"role": "assistant", "content": [part, {"type": "text", "text": answer}] if where == "assistant" else answer}
    return {"messages": [user, assistant]}


def _data(tmp_path: Path, bad: dict) -> str:
    Image.new("RGB", (16, 16), COLOURS["red"]).save(tmp_path / "good.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [_row("good.png"), _row("good.png", "blue"), bad]) + "\n")
    return str(path)


BAD_ROWS = {
    "missing image": (VLM_SFT, _row("nowhere.png"), "line 3: image nowhere.png: no such file"),
    "a folder as the image": (VLM_SFT, _row("."), "line 3: image .: a folder, not an image file"),
    "corrupt image": (VLM_SFT, _row("broken.png"), "line 3: image broken.png cannot be read as an image"),
    "image in an assistant turn": (VLM_SFT, _row("good.png", where="assistant"), "line 3: `messages[1]`: an image in an assistant turn"),
    "more placeholders than images": (VLM_SFT, _row("good.png", text="<image> and this?"), "line 3: The total number of <image> tokens in the prompts should be the same as the number of images"),
    "text-only model": (str(REPO / "recipes" / "tiny" / "sft.yaml"), _row("good.png"), "line 1: the row has images, but"),  # the first row with one
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_a_bad_image_row_is_one_line_naming_the_file_and_line(case, tmp_path, capsys):
    recipe, bad, expected = BAD_ROWS[case]
    data = _data(tmp_path, bad)
    out = tmp_path / "out"
    code = cli.main(["run", recipe, *SHORT, f"--output_dir={out}", f"--data.train_data={data}"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"error: {data}: {expected}"), lines[0]
    assert "Traceback" not in err and not out.exists()


@pytest.fixture
def served_png(tmp_path):
    """A red square served over http from this machine (a real HTTP server on a free port)."""
    import functools
    import http.server
    import threading

    site = tmp_path / "site"
    site.mkdir()
    Image.new("RGB", (16, 16), COLOURS["red"]).save(site / "red.png")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_image_part_may_name_its_image_by_path_url_or_data_url(served_png, tmp_path, capsys):
    """The keys and sources transformers' chat templates take: ``image``, ``url`` or ``path``; a path, a file://,
    http(s) or data URL, or base64 data. Each row trains; an image that cannot be fetched is one line naming the file and line."""
    import base64
    import io

    Image.new("RGB", (16, 16), COLOURS["blue"]).save(tmp_path / "blue.png")
    png = io.BytesIO()
    Image.new("RGB", (16, 16), COLOURS["red"]).save(png, format="PNG")
    sources = [("image", "blue.png"), ("path", str(tmp_path / "blue.png")), ("url", f"file://{tmp_path / 'blue.png'}"),
               ("url", f"{served_png}/red.png"), ("image", "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()),
               ("image", base64.b64encode(png.getvalue()).decode())]  # raw base64, which transformers' load_image takes
    rows = [{"messages": [{"role": "user", "content": [{"type": "image", key: value}, {"type": "text", "text": "What colour?"}]},
                          {"role": "assistant", "content": "red"}]} for key, value in sources]  # fmt: skip
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert cli.main(["run", VLM_SFT, *SHORT, f"--output_dir={tmp_path / 'out'}", f"--data.train_data={data}"]) == 0
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["steps"] == 1

    rows[2]["messages"][0]["content"][0] = {"type": "image", "url": f"{served_png}/missing.png"}
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    capsys.readouterr()
    assert cli.main(["run", VLM_SFT, *SHORT, f"--output_dir={tmp_path / 'again'}", f"--data.train_data={data}"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert lines == [f"error: {data}: line 3: image {served_png}/missing.png: cannot be fetched (HTTP 404: File not found)"]
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize("towers", ["frozen", "train", "lora"])
def test_the_vision_tower_is_frozen_trained_or_adapted_as_the_recipe_says(towers, tmp_path):
    lora = ["--model.lora.r=4", "--model.lora.target_modules=all-linear"] if towers == "lora" else []
    assert cli.main(["run", VLM_SFT, *SHORT, "--trainer.max_steps=2", f"--output_dir={tmp_path}", f"--model.towers={towers}", *lora]) == 0
    from safetensors.torch import load_file

    from lightning_rl.toy.vlm import tiny_vlm_path

    before = load_file(tiny_vlm_path() / "model.safetensors")
    after = load_file(tmp_path / "hf" / "model.safetensors")  # lora: merged into the weights
    tower = [k for k in before if "vision_tower" in k and k.endswith("q_proj.weight")]
    decoder = [k for k in before if "language_model" in k and k.endswith("q_proj.weight")]
    assert tower and decoder
    moved = lambda keys: any(not torch.equal(before[k], after[k]) for k in keys)  # noqa: E731
    assert moved(decoder)
    assert moved(tower) == (towers != "frozen")


def test_towers_that_do_not_go_with_the_fine_tuning_are_refused(tmp_path, capsys):
    code = cli.main(["run", VLM_SFT, *SHORT, f"--output_dir={tmp_path / 'out'}", "--model.towers=lora"])
    err = capsys.readouterr().err
    assert code == 2 and "error: model.towers: lora puts LoRA adapters on the towers too, and needs a lora block" in err
    # Targets that name no module of the towers adapted none: the towers trained as if frozen, without a word.
    code = cli.main(["run", VLM_SFT, *SHORT, f"--output_dir={tmp_path / 'out'}", "--model.towers=lora", "--model.lora.target_modules=[gate_proj]"])
    err = capsys.readouterr().err
    assert code == 2 and "error: model.towers: lora, but lora.target_modules names no module of the towers of " in err, err[-2000:]
    # A name of the towers' alone, with the towers frozen (no adapters there): it adapted nothing, without a word.
    code = cli.main(["run", VLM_SFT, *SHORT, f"--output_dir={tmp_path / 'out'}", "--model.lora.target_modules=[fc1, q_proj]"])
    err = capsys.readouterr().err
    assert code == 2 and "error: model.lora.target_modules: 'fc1' names modules of " in err and "towers alone" in err, err[-2000:]


def test_rows_in_the_layout_of_datasets_image_sets_train(tmp_path, capsys):
    """A `datasets` folder with an ``images`` column (decoded by its Image feature) whose conversations hold
    ``{"type": "image"}`` parts and text parts in every turn, two turns with an image each; and the same rows as a
    Parquet file of image bytes. Both train from the recipe; an ``images`` column that does not pair up with the
    parts is one line naming the row."""
    import datasets

    colours = ["red", "blue"]
    for colour in colours:
        Image.new("RGB", (16, 16), COLOURS[colour]).save(tmp_path / f"{colour}.png")

    def turn(role, text, image=False):
        return {"role": role, "content": ([{"type": "image", "text": None}] if image else []) + [{"type": "text", "text": text}]}

    conversation = [turn("user", "What colour?", True), turn("assistant", "red"), turn("user", "And this?", True), turn("assistant", "blue")]
    rows = {"messages": [conversation] * 4, "images": [[str(tmp_path / f"{c}.png") for c in colours]] * 4}
    folder = tmp_path / "set"
    features = datasets.Features({"messages": datasets.List({"role": datasets.Value("string"), "content": datasets.List(
        {"type": datasets.Value("string"), "text": datasets.Value("string")})}), "images": datasets.List(datasets.Image())})
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(folder))
    parquet = tmp_path / "rows.parquet"
    datasets.load_from_disk(str(folder)).cast_column("images", datasets.List(datasets.Image(decode=False))).to_parquet(str(parquet))
    for n, data in enumerate([folder, parquet]):
        out = tmp_path / f"out{n}"
        assert cli.main(["run", VLM_SFT, *SHORT, f"--output_dir={out}", f"--data.train_data={data}"]) == 0, capsys.readouterr().err[-2000:]
        assert json.loads((out / "summary.json").read_text())["steps"] == 1

    bad = tmp_path / "bad.jsonl"
    row = {"messages": conversation, "images": [str(tmp_path / "red.png")]}
    bad.write_text(json.dumps(row) + "\n")
    capsys.readouterr()
    assert cli.main(["run", VLM_SFT, *SHORT, f"--output_dir={tmp_path / 'bad'}", f"--data.train_data={bad}"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert lines == [f'error: {bad}: line 1: `images` holds 1 images for 2 image parts that name none (put a {{"type": "image"}} part where each goes)']


def test_text_turns_and_an_images_column_train_as_trl_places_the_images(tmp_path):
    """TRL's layout: text turns, the images in a column, placed before the first user turn's text. It was refused
    (images for 0 image parts); it trains as the same row with the parts written out."""
    from transformers import AutoTokenizer

    from lightning_rl.data.sft import Renderer, load_examples
    from lightning_rl.models.multimodal import load_processor
    from lightning_rl.toy.vlm import tiny_vlm_path

    Image.new("RGB", (16, 16), COLOURS["red"]).save(tmp_path / "red.png")
    question = [{"type": "image"}, {"type": "text", "text": "What colour?"}]
    rows = [{"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": "red"}], "images": ["red.png"]},
            {"messages": [{"role": "user", "content": "What colour?"}, {"role": "assistant", "content": "red"}], "images": ["red.png"]},
            {"prompt": [{"role": "user", "content": "What colour?"}], "completion": [{"role": "assistant", "content": "red"}], "image": "red.png"},
            {"messages": [{"role": "user", "content": "What colour?"}, {"role": "assistant", "content": [{"type": "text", "text": "red"}]}],
             "images": ["red.png"]}]  # fmt: skip  (another turn written as parts: the images still go to the string user turn)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    path = str(tiny_vlm_path())
    processor, image_token = load_processor(path)
    examples, _ = load_examples(data, Renderer(AutoTokenizer.from_pretrained(path), path, processor, image_token), 512)
    assert image_token in examples[0].input_ids
    for example in examples[1:]:
        assert (example.input_ids, example.loss_mask) == (examples[0].input_ids, examples[0].loss_mask)


def test_a_photo_is_read_upright_as_its_exif_orientation_says(tmp_path):
    """A phone's photo (stored sideways, with an orientation tag) was trained sideways, unlike transformers' and
    datasets' reading of it."""
    from PIL import Image
    from transformers.image_utils import load_image

    from lightning_rl.data.images import load_images

    stored = Image.new("RGB", (40, 20), (200, 0, 0))
    exif = stored.getexif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display: 20 wide, 40 high
    stored.save(tmp_path / "photo.jpg", exif=exif)
    row = {"messages": [{"role": "user", "content": [{"type": "image", "image": "photo.jpg"}]}]}
    ours = load_images(row, tmp_path)["messages"][0]["content"][0]["image"]
    assert ours.size == load_image(str(tmp_path / "photo.jpg")).size == (20, 40)


def test_a_transparent_image_reaches_the_model_as_the_processor_and_load_image_make_it(tmp_path):
    """A transparent image given decoded (a PIL image, a datasets Image cell) lost its alpha channel here, where the
    processor lays it onto white (TRL's collator hands it the decoded image): other pixels, another loss. One named by
    a path is read as transformers' load_image reads it (alpha dropped), as apply_chat_template does."""
    import io

    import numpy as np
    from transformers.image_transforms import convert_to_rgb
    from transformers.image_utils import load_image

    from lightning_rl.data.images import load_images

    pixels = np.zeros((8, 8, 4), np.uint8)
    pixels[..., 0], pixels[4:, :, 3] = 200, 255  # red, its top half transparent
    image = Image.fromarray(pixels, "RGBA")
    image.save(tmp_path / "clear.png")
    cell = {"bytes": (tmp_path / "clear.png").read_bytes(), "path": None}
    for given, reference in ((image, convert_to_rgb(image, return_numpy=True)), (image.convert("LA"), convert_to_rgb(image.convert("LA"), return_numpy=True)),
                             (cell, convert_to_rgb(Image.open(io.BytesIO(cell["bytes"])), return_numpy=True)),
                             ("clear.png", np.asarray(load_image(str(tmp_path / "clear.png"))))):  # fmt: skip
        row = {"messages": [{"role": "user", "content": [{"type": "image", "image": given}]}]}
        ours = np.asarray(load_images(row, tmp_path)["messages"][0]["content"][0]["image"])
        assert ours.shape == reference.shape and (ours == reference).all(), type(given).__name__
    assert (np.asarray(load_images({"messages": [{"role": "user", "content": [{"type": "image", "image": image}]}]}, None)["messages"][0]["content"][0]["image"])[0, 0] == 255).all()


def test_an_image_row_whose_generation_block_holds_the_separator_does_not_train_it():
    """As a text row's: each trained run ends at its end-of-turn token (the image path kept the separator trained)."""
    from PIL import Image
    from transformers import AutoTokenizer

    from lightning_rl.data.sft import Renderer
    from lightning_rl.models.multimodal import load_processor
    from lightning_rl.models.paths import resolve_model_path

    path = resolve_model_path("tiny-vlm")
    processor, image_token = load_processor(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    moved = processor.chat_template.replace("{{ '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}", "{{ '<|im_end|>\\n' }}{% endgeneration %}")
    assert moved != processor.chat_template
    processor.chat_template = moved
    row = {"messages": [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (16, 16))}, {"type": "text", "text": "colour?"}]},
                        {"role": "assistant", "content": "red"}]}  # fmt: skip
    example = Renderer(tokenizer, path, processor, image_token).example(row)
    trained = [token for token, on in zip(example.input_ids, example.loss_mask) if on]
    assert tokenizer.decode(trained) == "red<|im_end|>"


def test_the_tiny_vlms_template_renders_a_system_turn_of_parts():
    """datasets' image sets store every turn as parts; the system turn's made the template fail (str + list)."""
    from transformers import AutoTokenizer

    from lightning_rl.toy.vlm import VLM_CHAT_TEMPLATE, tiny_vlm_path

    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm_path())
    user = {"role": "user", "content": [{"type": "text", "text": "what?"}]}

    def text(system):
        return tokenizer.apply_chat_template([{"role": "system", "content": system}, user], chat_template=VLM_CHAT_TEMPLATE, tokenize=False)

    assert text([{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]) == text("Be brief.")
    assert text([{"type": "image"}, {"type": "text", "text": "Be brief."}]) == text("<image>Be brief.")


def test_questions_about_one_image_forward_it_once_across_rows(tmp_path):
    """Questions about the same image share it: a batch cut into rows (``data.max_tokens_per_row``) forwards the
    prompt with the image once across them (``prefix_across_rows: always``), the vision tower encoding each image
    once, and the step's gradient, the trained tower's included, is that of the batch in one row."""
    from lightning.pytorch import Callback, Trainer

    from lightning_rl.data.sft import BatchRows, SFTDataModule
    from lightning_rl.modules.sft import SFTModule

    Image.new("RGB", (16, 16), COLOURS["red"]).save(tmp_path / "red.png")
    questions = ["What colour is the square?", "Name the colour of the shape.", "Which colour do you see?", "Say the colour.", "Tell me the colour.",
                 "What is its colour?"]  # fmt: skip
    rows = [_row(str(tmp_path / "red.png"), "red", text) for text in questions]  # about 49 tokens each, the first 19 (the image's 16) shared
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")

    class Figures(Callback):
        def __init__(self) -> None:
            self.grads, self.rows, self.encoded = {}, 0, 0

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            self.rows = len(batch.rows) if isinstance(batch, BatchRows) else 1
            tower = next(m for name, m in module.policy.named_modules() if name.endswith("vision_tower"))
            tower.register_forward_hook(lambda *_: setattr(self, "encoded", self.encoded + 1))

        def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
            self.grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}

    def fit(per_row):
        data = SFTDataModule(str(tmp_path / "rows.jsonl"), tokenizer="tiny-vlm", max_tokens=1024, max_tokens_per_row=per_row,
                             prefix_across_rows="always" if per_row else "auto", shuffle=False)  # fmt: skip
        figures = Figures()
        trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          max_steps=1, limit_val_batches=0, callbacks=[figures])  # fmt: skip
        trainer.fit(SFTModule(model_name_or_path="tiny-vlm", towers="train", verify_packing="never"), datamodule=data)
        return figures

    whole, cut = fit(None), fit(56)
    assert whole.rows == 1 and cut.rows >= 3
    assert cut.encoded == whole.encoded == 1  # the one row's forward, or the span's prefix's, encodes the image once
    assert any("vision_tower" in name for name in whole.grads)
    for name, grad in whole.grads.items():
        torch.testing.assert_close(cut.grads[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
