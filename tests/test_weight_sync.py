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
    WeightMismatchError,
    WeightSyncError,
    hf_name,
    iter_adapter_weights,
    iter_full_weights,
    policy_model,
    sync_weights,
    tensor_digest,
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


def test_the_digest_catches_one_changed_element_of_any_dtype_and_agrees_across_layouts() -> None:
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool):
        tensor = (torch.randn(5, 7) * 100).to(dtype)
        changed = tensor.clone()
        changed[3, 2] = ~changed[3, 2] if dtype == torch.bool else changed[3, 2] + 1
        assert tensor_digest(changed) != tensor_digest(tensor), dtype
        assert tensor_digest(tensor.t().contiguous().t()) == tensor_digest(tensor.clone())  # values, not strides
    swapped = torch.tensor([1.0, 2.0, 3.0])
    assert tensor_digest(swapped) != tensor_digest(swapped.flip(0))  # positions count, not just the values
    assert tensor_digest(torch.tensor([-0.0, 1.0])) == tensor_digest(torch.tensor([0.0, 1.0]))


def test_the_digest_is_the_position_weighted_word_sum_across_chunks() -> None:
    import numpy as np

    tensor = torch.randn(2**22 + 3)  # more than one chunk, and a tail that is not a whole 8-byte word
    raw = np.frombuffer(tensor.numpy().tobytes() + bytes(4), dtype=np.uint64)
    with np.errstate(over="ignore"):
        expected = int((raw * (np.arange(raw.size, dtype=np.uint64) * np.uint64(2) + np.uint64(1))).sum(dtype=np.uint64))
    assert tensor_digest(tensor) == expected


class FaultyEngine(HFRolloutEngine):
    """The transformers engine with one fault injected between receiving the trainer's tensors and holding them."""

    def __init__(self, model, fault: str, name: str = "model.layers.1.mlp.down_proj.weight", **options) -> None:
        super().__init__(model, **options)
        self.fault, self.name, self.previous = fault, name, {}

    def _load(self, named_tensors, params) -> None:
        if self.fault == "previous_version":
            for _ in named_tensors:  # read, as a push does, and never loaded
                pass
            return
        if self.fault == "stale_merge":  # the named tensor keeps the merge of the previous push's adapter
            received = [(n, t.clone()) for n, t in named_tensors]
            super()._load([(n, self.previous.get(n, t)) if n == self.name else (n, t) for n, t in received], params)
            self.previous = dict(received)
            return
        if self.fault == "skip":
            named_tensors = ((n, t) for n, t in named_tensors if n != self.name)
        super()._load(named_tensors, params)
        if self.fault == "corrupt":
            params[self.name].view(-1)[17] += 1e-3  # one element, after loading


def assert_refused(action, *pieces: str) -> WeightMismatchError:
    with pytest.raises(WeightMismatchError) as caught:
        action()
    line = caught.value.line()
    assert "\n" not in line and caught.value.exit_code == 1, line
    for piece in pieces:
        assert piece in line, line
    return caught.value


def test_a_clean_sync_is_verified_full_merged_and_tied() -> None:
    engine = HFRolloutEngine(tiny(seed=4))
    sync_weights(tiny(seed=3), engine, version=1)
    peft_model = get_peft_model(tiny(seed=5), LoraConfig(**LORA))
    sync_weights(peft_model, engine, version=2)
    assert engine.weight_version == 2
    untied_engine = HFRolloutEngine(tiny(tied=False, seed=4))
    sync_weights(tiny(tied=False, seed=6), untied_engine, version=1)


@pytest.mark.parametrize("fault", ["corrupt", "skip", "previous_version"])
def test_a_fault_inside_the_engine_stops_the_sync_naming_tensor_and_version(fault: str) -> None:
    engine = FaultyEngine(tiny(seed=4), fault)
    error = assert_refused(lambda: sync_weights(tiny(seed=3), engine, version=5), "weight sync to version 5", "differs")
    named = "'model.layers.1.mlp.down_proj.weight'" if fault != "previous_version" else "'model.embed_tokens.weight'"
    assert named in error.line() and ("more)" in error.line()) == (fault == "previous_version")
    assert engine.weight_version == 0  # the failed version is never reported as held
    assert error.within("model").line().startswith("model.engine: weight sync to version 5")  # as the CLI prints it
    # The negative control: the same fault, unverified, goes unnoticed.
    quiet = FaultyEngine(tiny(seed=4), fault, verify_weights=False)
    sync_weights(tiny(seed=3), quiet, version=5)
    assert quiet.weight_version == 5


def test_an_engine_holding_the_previous_adapters_merge_is_caught() -> None:
    peft_model = get_peft_model(tiny(seed=3), LoraConfig(**LORA))
    name = "model.layers.0.self_attn.q_proj.weight"
    engine = FaultyEngine(tiny(seed=4), "stale_merge", name=name)
    sync_weights(peft_model, engine, version=1)  # nothing earlier to be stale with: verified
    with torch.no_grad():
        peft_model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight.add_(0.1)
    assert_refused(lambda: sync_weights(peft_model, engine, version=2), f"the engine's '{name}' differs", "version 2")


def test_a_tied_weight_sent_twice_or_not_at_all_is_caught() -> None:
    trainer, engine = tiny(seed=3), HFRolloutEngine(tiny(seed=4))
    state = [(name, tensor.detach()) for name, tensor in trainer.state_dict().items()]  # names lm_head as well
    assert_refused(lambda: engine.push_weights(iter(state), version=1),
                   "'lm_head.weight' was sent besides 'model.embed_tokens.weight'")
    without = [(n, t) for n, t in iter_full_weights(trainer) if n != "model.embed_tokens.weight"]
    assert_refused(lambda: engine.push_weights(iter(without), version=2), "'model.embed_tokens.weight' was not sent")
    # An untied trainer syncing into a tied engine sends both, with different values: the engine can hold only one.
    assert_refused(lambda: sync_weights(tiny(tied=False, seed=3), engine, version=3), "'lm_head.weight' was sent besides")
