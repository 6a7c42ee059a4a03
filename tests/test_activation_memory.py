"""Activation memory (``gradient_checkpointing``, ``offload_activations``) changes no value: on tree-packed rows the
loss and every gradient are bit for bit those without it, for SFT rows and GRPO's step, full and LoRA, on the tiny
Qwen3 and on a sliding-window Mistral; and each does what it says (layers recomputed in backward, the activations
saved for backward moved to host memory); and ``lightning-rl plan`` counts what each keeps, and where."""

from __future__ import annotations

import re

import pytest
import torch
from support.grpo import GradientRecorder, fit
from support.tiny_models import build
from support.trees import NESTED
from transformers import Qwen3Config

from lightning_rl.models.loading import LoraSettings, load_causal_lm
from lightning_rl.modules import grpo
from lightning_rl.models.structure import find_decoder_layers
from lightning_rl.ops.packed_forward import packed_logprobs
from lightning_rl.ops.saved_activations import OffloadedForwards, SavedInPlace
from lightning_rl.packing.tree import pack_sequences
from lightning_rl.planner import plan
from lightning_rl.planner.memory_plan import GIB, Hardware, Training, plan_memory
from lightning_rl.planner.model_census import count_model
from lightning_rl.rewards import RewardSpec

LORA = LoraSettings(r=4, alpha=8)
TOKEN_REWARD = [RewardSpec("test_activation_memory:token_parity")]
SETTINGS = {"checkpointing": (True, False), "offload": (False, True), "both": (True, True)}


@pytest.fixture(scope="module")
def folders(tiny_path, tmp_path_factory) -> dict[str, str]:
    mistral = tmp_path_factory.mktemp("mistral") / "model"
    build("mistral_sliding").save_pretrained(mistral)
    return {"tiny": str(tiny_path), "mistral_sliding": str(mistral)}


def sft_step(folder: str, lora: LoraSettings | None, checkpointing: bool, offload: bool) -> dict:
    """One SFT row's summed loss and gradients, with what the forward kept and what its backward recomputed."""
    torch.manual_seed(0)  # LoRA's initial adapters alike in every run
    model = load_causal_lm(folder, lora=lora, gradient_checkpointing=checkpointing).train()
    offloaded = OffloadedForwards(model) if offload else None
    layers = find_decoder_layers(model)
    parts = [child for layer in layers for child in layer.children()]  # norms, attention, MLP: each runs once a forward
    calls = [0]  # of the layers' parts: transformers checkpoints a layer's forward, inside the layer's own hooks
    for part in parts:
        part.register_forward_pre_hook(lambda module, args: calls.__setitem__(0, calls[0] + 1))
    row = pack_sequences(NESTED, share_prefixes=True)
    assert row.num_unique_tokens < row.num_flat_tokens  # a tree: shared prefixes forwarded once
    saved = SavedInPlace()
    with saved:
        loss = -packed_logprobs(model, row, attention_backend="blocks").sum()
    forward_calls = calls[0]  # the packing probe's forwards too, the first time a model is packed
    loss.backward()
    return {
        "loss": loss.detach(),
        "grads": {name: p.grad for name, p in model.named_parameters() if p.grad is not None},
        "saved_on_device": saved.bytes,
        "host_bytes": offloaded.host_bytes if offloaded else 0,
        "recomputed": calls[0] - forward_calls,
        "layer_parts": len(parts),
    }


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
@pytest.mark.parametrize("family", ["tiny", "mistral_sliding"])
def test_a_packed_sft_row_has_the_same_loss_and_gradients(folders, family, lora):
    base = sft_step(folders[family], lora, False, False)
    assert base["recomputed"] == 0 and base["host_bytes"] == 0
    assert len(base["grads"]) > 0 and all(g.abs().sum() > 0 for n, g in base["grads"].items() if "lora_A" not in n)
    for setting, (checkpointing, offload) in SETTINGS.items():
        got = sft_step(folders[family], lora, checkpointing, offload)
        assert torch.equal(got["loss"], base["loss"]), setting
        assert got["grads"].keys() == base["grads"].keys(), setting
        for name, grad in base["grads"].items():
            assert torch.equal(got["grads"][name], grad), f"{setting}: {name}"
        # Each did what it says: the layers ran again in backward; the activations went to host memory, and what
        # stays on the device shrank to what the model's forward does not save (the chunked LM head's input).
        assert got["recomputed"] == (base["layer_parts"] if checkpointing else 0), setting
        assert got["saved_on_device"] < base["saved_on_device"] / 3, setting
        assert (got["host_bytes"] > 0) == offload, setting
    alone = sft_step(folders[family], lora, False, True)
    both = sft_step(folders[family], lora, True, True)
    # Offloading alone moves every activation the layers save; with checkpointing only the layers' inputs.
    assert alone["host_bytes"] == base["saved_on_device"] - alone["saved_on_device"]
    assert 0 < both["host_bytes"] < alone["host_bytes"] / 3


def token_parity(completion_ids: list[list[int]], **_) -> list[float]:
    """A reward that tells apart almost any two samples of a group, so every group carries a gradient."""
    return [float(sum(ids) % 5) for ids in completion_ids]


@pytest.mark.parametrize("across_rows", ["never", "always"])
@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_a_grpo_step_over_tree_packed_rows_has_the_same_gradients(lora, across_rows, monkeypatch):
    """The real module and Trainer: the same rollouts, cut into several tree-packed rows, give the same gradients;
    a group's prompt forwarded once across its rows too (with checkpointing, that forward is run again for its
    backward rather than kept)."""
    runs, spans = {}, []
    share = grpo.share_prefixes  # rows that continue a prefix, counted
    monkeypatch.setattr(grpo, "share_prefixes", lambda rows, prefixes, **kw: spans.append(sum(p is not None for p in prefixes)) or share(rows, prefixes, **kw))
    for setting, (checkpointing, offload) in {"none": (False, False), **SETTINGS}.items():
        if lora is not None and setting in ("checkpointing", "offload"):
            continue  # each alone is covered on full fine-tuning; LoRA runs them together
        recorder = GradientRecorder()
        module, trainer = fit(1, [recorder], batch_size=4, num_generations=8, rewards=TOKEN_REWARD, max_grad_norm=None, max_tokens_per_row=48,
                              prefix_across_rows=across_rows, lora=lora, gradient_checkpointing=checkpointing, offload_activations=offload)  # fmt: skip
        assert float(trainer.callback_metrics["train/rows"]) >= 2
        assert float(trainer.callback_metrics["train/packing_ratio"]) > 1  # tree-packed: the prompts shared
        assert any(getattr(m, "gradient_checkpointing", False) for m in module.policy.modules()) == checkpointing
        assert (module.offloaded is not None and module.offloaded.host_bytes > 0) == offload
        runs[setting] = recorder.steps[0]
    assert (min(spans) > 0 if across_rows == "always" else max(spans) == 0), spans
    base = runs.pop("none")
    assert any(g.abs().sum() > 0 for g in base.values())
    for setting, grads in runs.items():
        assert grads.keys() == base.keys(), setting
        for name, grad in base.items():
            assert torch.equal(grads[name], grad), f"{setting}: {name}"


# Qwen3-1.7B's shapes: per token and layer, autograd keeps the inputs and outputs of its seven matmuls
# (q 2048+2048, k 2048+1024, v 2048+1024, o 2048+2048, gate and up 2048+6144 each, down 6144+2048) and its norms'
# widths (2048, 2048, 128, 128): 43,264 elements.
QWEN3_1_7B = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, vocab_size=151936, tie_word_embeddings=True)  # fmt: skip
PER_LAYER = 43_264 * 32_768 * 2  # one layer's activations, 32K tokens, bf16
LAYER_INPUTS = 28 * 32_768 * 2048 * 2  # the 28 layers' inputs: 3.5 GiB


def test_the_plan_counts_checkpointing_and_offloading_as_they_keep_activations():
    census = count_model(Qwen3Config(**QWEN3_1_7B), [])
    assert census.activation_elements_per_token_layer == 43_264
    hardware = Hardware(gpu_memory_gb=141)
    plans = {
        (checkpointing, offload): plan_memory(census, Training(1, 1, 32_768, activation_checkpointing=checkpointing,
                                                               offload_activations=offload), hardware)  # fmt: skip
        for checkpointing in (False, True) for offload in (False, True)
    }

    def activations(key: tuple[bool, bool]) -> float:
        return next(term.bytes for term in plans[key].terms if term.name.startswith("activations"))

    assert activations((False, False)) == 28 * PER_LAYER  # every layer's, on the device
    assert activations((True, False)) == LAYER_INPUTS + PER_LAYER  # the inputs, and one layer recomputed
    assert activations((False, True)) == activations((True, True)) == PER_LAYER  # one layer's working set
    assert plans[False, True].host_activation_bytes == 28 * PER_LAYER
    assert plans[True, True].host_activation_bytes == LAYER_INPUTS == 3.5 * GIB
    assert plans[False, False].host_activation_bytes == plans[True, False].host_activation_bytes == 0
    # The rest of the plan does not move: the totals differ by the activations alone.
    totals = {key: plan.total_bytes - activations(key) for key, plan in plans.items()}
    assert len(set(totals.values())) == 1


def test_lightning_rl_plan_reads_both_keys_of_a_grpo_recipe(tmp_path, capsys):
    Qwen3Config(**QWEN3_1_7B).save_pretrained(tmp_path / "qwen3")
    recipe = tmp_path / "grpo.yaml"
    for checkpointing, offload in ((True, False), (True, True)):
        recipe.write_text(
            "task: grpo\nmodel:\n  model_name_or_path: Qwen/Qwen3-1.7B\n  max_tokens_per_row: 32768\n"
            f"  gradient_checkpointing: {str(checkpointing).lower()}\n  offload_activations: {str(offload).lower()}\n"
            "trainer: {precision: bf16-true}\n"
        )
        code = plan.main([str(recipe), "--nodes", "1", "--gpus-per-node", "1", "--gpu-memory-gb", "141", "--model-config", str(tmp_path / "qwen3")])
        out = capsys.readouterr().out
        assert code == 0, out
        assert f"activation checkpointing on, activation offload {'on' if offload else 'off'}" in out
        assert "tokens per step: 1 GPUs x 32768 tokens" in out
        if offload:
            assert "host memory per GPU (offloaded activations): 3.50 GiB" in out
            assert re.search(rf"activations \(checkpointed, offloaded\)\s+{PER_LAYER / GIB:.2f} GiB", out), out
        else:
            assert "offloaded activations" not in out
            assert re.search(rf"activations \(checkpointed\)\s+{(LAYER_INPUTS + PER_LAYER) / GIB:.2f} GiB", out), out
