"""GRPOModule on a real Trainer: the normaliser spans the whole optimizer step, and bad input fails
before training with an error that names what is wrong."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from grpo_helpers import LENGTH_REWARD, GradientRecorder, TrainedRollouts, fit

from lightning_rl.data.prompts import PromptDataModule
from lightning_rl.models.loading import LoraSettings
from lightning_rl.modules.grpo import GRPOModule
from lightning_rl.rewards import RewardSpec
from lightning_rl.tools import Tool


# grpo normalises per sequence, dr_grpo by a constant times the step's sequences; dapo and bnpo
# (token-level) are covered through the same code path by test_grpo_loss.py's weight checks.
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_one_micro_batch_or_four_give_the_same_gradients(loss_type):
    grads, rows, rollouts = [], [], []
    for max_tokens in (None, 48):
        recorder, trained = GradientRecorder(), TrainedRollouts()
        module, trainer = fit(1, [recorder, trained], batch_size=4, loss_type=loss_type, max_grad_norm=None,
                              max_tokens_per_row=max_tokens, rewards=LENGTH_REWARD)
        grads.append(recorder.steps[0])
        rows.append(float(trainer.callback_metrics["train/rows"]))
        rollouts.append(trained.batches[0]["completions"])
    assert rows[0] == 1 and rows[1] >= 4, rows
    assert rollouts[0] == rollouts[1]  # the same rollouts, split differently
    assert any(g.abs().sum() > 0 for g in grads[0].values())
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_one_generation_per_prompt_is_refused():
    with pytest.raises(ValueError, match="num_generations=1: GRPO needs G >= 2"):
        GRPOModule(num_generations=1)


def test_reward_path_that_does_not_import_is_refused():
    with pytest.raises(ValueError, match="reward function 'no_such_pkg.rewards:score': cannot import module"):
        GRPOModule(rewards=[RewardSpec("no_such_pkg.rewards:score")])
    with pytest.raises(ValueError, match="has no 'missing'"):
        GRPOModule(rewards=[RewardSpec("lightning_rl.rewards.builtin:missing")])


def test_tool_with_invalid_schema_is_refused():
    def lookup(key: str) -> str:
        return key

    with pytest.raises(ValueError, match=r"tool 'lookup': invalid JSON Schema at properties/key/type"):
        Tool.from_function(lookup, parameters={"type": "object", "properties": {"key": {"type": "text"}}})


def test_prompts_without_the_field_are_refused(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps({"question": "2+2="}) + "\n")
    with pytest.raises(ValueError, match=r"prompts.jsonl: line 2: no field 'prompt' \(row has \['question'\]\)"):
        PromptDataModule(path=str(path)).setup("fit")


class EngineWeights(L.Callback):
    """The engine's weights at the end of training (the engine is closed when fit ends)."""

    def on_train_end(self, trainer: L.Trainer, pl_module: GRPOModule) -> None:
        self.version = pl_module.engine.weight_version
        self.q_proj = pl_module.engine.model.model.layers[0].self_attn.q_proj.weight.detach().clone()


def test_lora_policy_pushes_merged_weights_to_the_engine():
    engine = EngineWeights()
    module, _ = fit(2, [engine], lora=LoraSettings(r=4, alpha=8), learning_rate=1e-2, rewards=LENGTH_REWARD)
    base = module.policy.get_base_model()
    q_proj = base.model.layers[0].self_attn.q_proj
    merged = q_proj.base_layer.weight + q_proj.scaling["default"] * q_proj.lora_B["default"].weight @ q_proj.lora_A["default"].weight
    assert engine.version == 2
    assert not torch.allclose(merged, q_proj.base_layer.weight)  # the adapter has learned something
    torch.testing.assert_close(engine.q_proj, merged.detach(), rtol=1e-5, atol=1e-6)
