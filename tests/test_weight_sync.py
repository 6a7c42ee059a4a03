"""Weight streaming on one process: names, tied weights, LoRA merge against peft's own merge, failure paths.

The sharded (FSDP2, two processes) case, with training steps and a stalled rank, is in
test_strategies_fsdp2.py; here the same functions run on plain and peft-wrapped models.
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import Qwen3Config, Qwen3ForCausalLM

from lightning_rl.rollout.hf import HFRolloutEngine

from lightning_rl.models.weights import (
    WeightSyncError,
    hf_name,
    iter_adapter_weights,
    iter_full_weights,
    policy_model,
    sync_weights,
)

LORA = dict(r=4, lora_alpha=16, target_modules=["q_proj", "o_proj", "up_proj"], init_lora_weights=False)


def tiny(tied: bool = True, seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, tie_word_embeddings=tied,
    )
    return Qwen3ForCausalLM(config)


class Receiver:
    """Takes a limited number of tensors, then returns or raises, like an engine that gives up."""

    def __init__(self, read: int, fail: bool = False) -> None:
        self.read, self.fail, self.got = read, fail, []

    def push_weights(self, named_tensors, version: int) -> None:
        for name, _ in named_tensors:
            self.got.append(name)
            if len(self.got) == self.read:
                if self.fail:
                    raise RuntimeError("engine crashed")
                return


def test_names_are_hf_names_and_tied_weights_go_once() -> None:
    model = tiny(tied=True)
    sent = dict(iter_full_weights(model))
    expected = set(model.state_dict()) - {"lm_head.weight"}
    assert set(sent) == expected
    assert all(torch.equal(sent[n], t) for n, t in model.state_dict().items() if n in sent)
    untied = tiny(tied=False)
    assert "lm_head.weight" in dict(iter_full_weights(untied))


def test_wrapper_segments_are_stripped() -> None:
    assert hf_name("model.layers.0._checkpoint_wrapped_module.mlp.up_proj.base_layer.weight") == (
        "model.layers.0.mlp.up_proj.weight"
    )
    assert hf_name("_orig_mod.model.norm.weight") == "model.norm.weight"


def test_lora_merge_equals_peft_merge_and_leaves_the_model_untouched() -> None:
    peft_model = get_peft_model(tiny(), LoraConfig(**LORA))
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters()}
    sent = dict(iter_full_weights(peft_model))
    assert all(torch.equal(before[n], p) for n, p in peft_model.named_parameters())
    assert not any(".lora_" in n or "base_layer" in n for n in sent)

    merged = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    assert set(sent) == set(merged) - {"lm_head.weight"}
    for name, tensor in sent.items():
        torch.testing.assert_close(tensor, merged[name], rtol=0, atol=1e-6)
    q = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    delta = (16 / 4) * q.lora_B["default"].weight @ q.lora_A["default"].weight
    assert delta.abs().max() > 1e-3
    torch.testing.assert_close(sent["model.layers.0.self_attn.q_proj.weight"], q.base_layer.weight + delta)

    unmerged = dict(iter_full_weights(peft_model, merge_lora=False))
    assert torch.equal(unmerged["model.layers.0.self_attn.q_proj.weight"], q.base_layer.weight)


def test_adapter_only_uses_peft_names() -> None:
    peft_model = get_peft_model(tiny(), LoraConfig(**LORA))
    adapter = dict(iter_adapter_weights(peft_model))
    reference = get_peft_model_state_dict(peft_model)
    assert adapter.keys() == reference.keys()
    assert all(torch.equal(adapter[n], reference[n]) for n in adapter)
    with pytest.raises(WeightSyncError, match="holds no peft model"):
        next(iter_adapter_weights(tiny()))


def test_policy_found_inside_a_lightning_module() -> None:
    class WithReference(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.policy = get_peft_model(tiny(seed=1), LoraConfig(**LORA))
            self.reference = tiny(seed=2).requires_grad_(False)

    module = WithReference()
    assert policy_model(module) is module.policy.get_base_model()
    module.reference.requires_grad_(True)
    with pytest.raises(WeightSyncError, match="cannot tell which model to sync"):
        policy_model(module)


def test_sync_into_the_transformers_engine() -> None:
    source, engine = tiny(seed=3), HFRolloutEngine(tiny(seed=4))
    report = sync_weights(source, engine, version=7)
    assert engine.weight_version == 7 and report.version == 7
    assert report.num_tensors == len(set(source.state_dict()) - {"lm_head.weight"})
    assert report.largest_tensor_bytes == 64 * 32 * 4  # the embedding, the largest single tensor
    for name, tensor in source.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], tensor), name  # lm_head too, through the tie


def test_a_target_that_stops_early_still_lets_the_stream_finish() -> None:
    model = tiny()
    total = len(set(model.state_dict()) - {"lm_head.weight"})
    early = Receiver(read=2)
    assert sync_weights(model, early, version=1).num_tensors == total and len(early.got) == 2
    crashing = Receiver(read=3, fail=True)
    with pytest.raises(RuntimeError, match="engine crashed"):
        sync_weights(model, crashing, version=2)
