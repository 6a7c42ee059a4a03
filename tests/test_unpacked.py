"""Unpacked rows (SFT's ``data.packing: none``, GRPO's ``model.packing: none``) run each sequence as the model runs it
alone, so a model that tree packing refuses (an attention outside transformers' interface, recurrent layers, sinks)
still trains: SFT's first loss is that of a plain forward of the example, a packed layout of the same model is
refused in one line that names this way out, and a GRPO step over unpacked rows has the packed step's gradients."""

import pytest
import torch
from lightning.pytorch import Trainer
from transformers import AutoModelForCausalLM, AutoTokenizer

from support import packing_families
from support.grpo import LENGTH_REWARD, GradientRecorder, fit as grpo_fit
from support.paths import TOY_TRAIN

from lightning_rl.attention.tree_attention import PackingRefused
from lightning_rl.data.sft import SFTDataModule
from lightning_rl.modules.sft import SFTModule


def _saved(family: str, tiny_path, tmp_path, **more):
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    model_type, overrides = packing_families.FAMILIES[family]
    config = packing_families.build_config(model_type, dict(overrides, vocab_size=len(tokenizer), attn_implementation="eager", **more))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / family)
    tokenizer.save_pretrained(tmp_path / family)
    return str(tmp_path / family)


def _fit(path: str, packing: str, **data_options) -> tuple[Trainer, SFTDataModule]:
    data = SFTDataModule(TOY_TRAIN, None, tokenizer=path, max_tokens=128, packing=packing, shuffle=False, **data_options)
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, max_steps=1)  # fmt: skip
    trainer.fit(SFTModule(model_name_or_path=path, learning_rate=1e-3), datamodule=data)
    return trainer, data


@pytest.mark.parametrize("family", ["stablelm", "bloom", "qwen3_5_text", "gpt_oss"])
def test_a_model_packing_refuses_trains_one_example_a_row_at_a_plain_forwards_loss(family, tiny_path, tmp_path):
    path = _saved(family, tiny_path, tmp_path)
    with pytest.raises(PackingRefused, match=r"; data\.packing: none trains it one example a row, as the model runs each alone$"):
        _fit(path, "flat")
    _assert_first_loss_is_a_plain_forwards(path, *_fit(path, "none"))


def _assert_first_loss_is_a_plain_forwards(path: str, trainer: Trainer, data: SFTDataModule) -> None:
    first = next(iter(data.train_dataloader()))  # the first row again (no shuffle)
    example = data.train_examples[0]
    assert first.unpacked and first.num_sequences == 1 and first.input_ids[: first.num_unique_tokens].tolist() == example.input_ids
    model = AutoModelForCausalLM.from_pretrained(path)  # the weights before the step
    logits = model(input_ids=torch.tensor([example.input_ids])).logits[0, :-1].double()
    targets = torch.tensor(example.input_ids[1:])
    trained = torch.tensor(example.loss_mask[1:])
    nll = -torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
    assert float(trainer.logged_metrics["train/loss"]) == pytest.approx(float(nll[trained].mean()), rel=1e-5)
    assert "train/packing_error" not in trainer.callback_metrics  # nothing packed, nothing to verify


def test_a_grpo_step_over_unpacked_rows_has_the_packed_steps_gradients(tiny_path):
    steps = {}
    for packing in ("tree", "none"):
        recorder = GradientRecorder()
        grpo_fit(1, [recorder], packing=packing, rewards=LENGTH_REWARD)
        steps[packing] = recorder.steps[0]
    assert steps["tree"].keys() == steps["none"].keys() and any(g.abs().max() > 0 for g in steps["tree"].values())
    for name, grad in steps["tree"].items():
        torch.testing.assert_close(steps["none"][name], grad, rtol=1e-4, atol=1e-6)


def test_grpo_trains_a_model_packing_refuses_unpacked(tiny_path, tmp_path):
    path = _saved("stablelm", tiny_path, tmp_path)
    with pytest.raises(PackingRefused, match=r"StableLmAttention is called without the packed row's metadata .*; model\.packing: none trains it one rollout a row"):
        grpo_fit(1, model_name_or_path=path)
    module, run = grpo_fit(1, model_name_or_path=path, packing="none")
    assert run.global_step == 1 and "train/packing_error" not in run.callback_metrics


@pytest.mark.parametrize("family,config", [("gpt2", {"n_positions": 48}), ("llama_dynamic", {})])
def test_a_padded_unpacked_row_keeps_its_padding_off_the_sequences_positions(family, config, tiny_path, tmp_path):
    """Padding (static-shape devices) was placed at the positions after the sequence: past a learned table's end
    (GPT-2: an index error) or into a rope that picks its frequencies by the longest position (dynamic: other numbers)."""
    path = _saved(family, tiny_path, tmp_path, **config)
    _assert_first_loss_is_a_plain_forwards(path, *_fit(path, "none", pad_to_multiple_of=64))


def test_a_model_that_sees_later_tokens_is_refused_unpacked_too(tiny_path, tmp_path):
    """A bidirectional model (BERT as an encoder) reads the answer at every position: tree packing refused it, and
    unpacked it trained without a word."""
    path = _saved("bert", tiny_path, tmp_path)
    with pytest.raises(PackingRefused, match=r"^BertLMHeadModel is not causal: its outputs at a token change with the tokens after it \(by \d\.\d\de-\d\d\)"):
        _fit(path, "none")
