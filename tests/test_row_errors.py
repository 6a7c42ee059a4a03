"""Data rows a chat template cannot render, and GRPO prompts with a broken image, through the real `lightning-rl run`:
each is one error line naming the file and line, before anything is written."""

from __future__ import annotations

import json
import re

import pytest
from PIL import Image

from lightning_rl import cli
from lightning_rl.toy.shapes import COLOURS, QUESTION
from support.paths import REPO

SFT = str(REPO / "recipes" / "tiny" / "sft.yaml")
VLM_SFT = str(REPO / "recipes" / "tiny" / "vlm_sft.yaml")
SHORT = ["--trainer.max_steps=1", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
         "--data.val_data=null", "--model.eval_generations=0", "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0"]  # fmt: skip
GOOD = {"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]}
IMAGE = {"type": "image", "image": "red.png"}

BAD_ROWS = {
    "tool_calls that is not a list": (
        SFT, {"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "", "tool_calls": "add"}]},
        "`messages[1]`: `tool_calls` is a string but not JSON (Expecting value)"),
    "the image placeholder typed in a row without images": (
        VLM_SFT, {"messages": [{"role": "user", "content": "<image> what colour?"}, {"role": "assistant", "content": "red"}]},
        "the text holds the model's image placeholder '<image>', but the row gives no image (give the image as a part, or "
        "remove it from the text)"),
    "a message without content": (
        SFT, {"messages": [{"role": "user"}, {"role": "assistant", "content": "2"}]}, "`messages[0]`: `content` must be a string, got NoneType"),
}  # fmt: skip


def _errors(argv: list[str], capsys) -> tuple[int, list[str], str]:
    code = cli.main(argv)
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.startswith("error:")], err


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_a_row_the_chat_template_cannot_render_is_one_line_naming_the_file_and_line(case, tmp_path, capsys):
    recipe, bad, expected = BAD_ROWS[case]
    Image.new("RGB", (16, 16), COLOURS["red"]).save(tmp_path / "red.png")
    good = {"messages": [{"role": "user", "content": [IMAGE, {"type": "text", "text": QUESTION}]}, {"role": "assistant", "content": "red"}]}
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in [good if recipe == VLM_SFT else GOOD] * 2 + [bad]) + "\n")
    out = tmp_path / "out"
    code, lines, err = _errors(["run", recipe, *SHORT, f"--output_dir={out}", f"--data.train_data={data}"], capsys)
    assert code == 2 and lines == [f"error: {data}: line 3: {expected}"], err[-3000:]
    assert "Traceback" not in err and not out.exists()


def _prompt(image: str) -> dict:
    return {"prompt": [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]}], "answer": "red"}


def test_grpo_prompts_with_a_broken_image_fail_at_setup_naming_the_file_and_line(tmp_path, capsys):
    """The broken image is on the 5th of 8 prompts; a 1-step run would never draw it, and is refused all the same."""
    Image.new("RGB", (16, 16), COLOURS["red"]).save(tmp_path / "red.png")
    png = (tmp_path / "red.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(png[: len(png) // 2])  # a PNG header, its data cut short
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(_prompt("cut.png" if i == 5 else "red.png")) for i in range(1, 9)) + "\n")
    out = tmp_path / "out"
    code, lines, err = _errors([
        "run", str(REPO / "recipes" / "tiny" / "vlm_grpo.yaml"), f"--output_dir={out}", "--trainer.max_steps=1",
        "--trainer.enable_progress_bar=false", "--model.model_name_or_path=tiny-vlm", "--model.eval_generations=0",
        "--model.eval_data=null", f"--data.path={data}", "--data.prompt_field=prompt", "--data.batch_size=1", "--model.num_generations=2",
    ], capsys)  # fmt: skip
    assert code == 2 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"error: {data}: line 5: image cut.png cannot be read as an image"), lines[0]
    assert "Traceback" not in err and not out.exists()


def test_a_grpo_prompt_the_chat_template_cannot_render_is_one_line_naming_the_file_and_line(tmp_path, capsys):
    rows = [{"prompt": [{"role": "user", "content": "1+1"}], "answer": "2"}] * 3
    rows.append({"prompt": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "", "tool_calls": "add"},
                            {"role": "user", "content": "again"}], "answer": "2"})  # fmt: skip
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    code, lines, err = _errors([
        "run", str(REPO / "recipes" / "tiny" / "grpo.yaml"), f"--output_dir={tmp_path / 'out'}", "--trainer.max_steps=1",
        "--trainer.enable_progress_bar=false", f"--data.path={data}", "--data.batch_size=4", "--model.num_generations=2",
        "--logger.kind=none",
    ], capsys)  # fmt: skip
    assert code == 2 and lines == [f"error: {data}: line 4: the chat template cannot render the row "
                                   "(TypeError: Object of type Undefined is not JSON serializable)"], err[-3000:]  # fmt: skip
    assert "Traceback" not in err


def test_grpo_prompts_of_text_parts_read_as_text_and_malformed_messages_name_their_line(tmp_path):
    """TRL's typed content (``[{"type": "text", "text": ...}]``) is a text prompt, not an image one; a message that is
    not an object was a traceback mid-run."""
    from lightning_rl.data.prompts import read_prompt_records
    from lightning_rl.data.sft import DataError

    parts = {"prompt": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                        {"role": "user", "content": [{"type": "text", "text": "12+"}, {"type": "text", "text": "7="}]}]}  # fmt: skip
    pictured = {"prompt": [{"role": "user", "content": [IMAGE, {"type": "text", "text": QUESTION}]}]}
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in (parts, pictured)) + "\n")
    (_, text), (_, image) = read_prompt_records(str(data), "prompt")
    assert text["prompt"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+7="}]
    assert image["prompt"] == pictured["prompt"]  # the processor's template reads an image prompt's parts
    for bad, message in ((["hello"], "`prompt[0]` must be an object with `role` and `content`, got str"),
                         ([{"role": "user", "content": [{"type": "text"}]}], "`prompt[0].content[0]` must be")):  # fmt: skip
        data.write_text(json.dumps(parts) + "\n" + json.dumps({"prompt": bad}) + "\n")
        with pytest.raises(DataError, match=re.escape(f"{data}: line 2: {message}")):
            read_prompt_records(str(data), "prompt")
    # A prompt of whitespace alone is empty, as an SFT row's (it prompted the model with a blank turn).
    data.write_text(json.dumps(parts) + "\n" + json.dumps({"prompt": "  \n"}) + "\n")
    with pytest.raises(DataError, match=re.escape(f"{data}: line 2: field 'prompt' must be a non-empty string or message list")):
        read_prompt_records(str(data), "prompt")
