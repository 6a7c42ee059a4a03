"""The transformers rollout engine: its log-probs equal the trainer's tree-packed ones, sampling is
reproducible from the seed, and pushed weights take effect with their version."""

from __future__ import annotations

import torch

from lightning_rl.modules.grpo import GRPOModule
from lightning_rl.rollout.base import RolloutEngine, SamplingConfig, load_engine
from lightning_rl.rollout.hf import HFRolloutEngine

# fp32 on both sides; the trainer forwards a packed tree, the engine a KV-cached padded batch.
LOGPROB_TOLERANCE = 1e-4


def test_engine_logprobs_match_the_trainers_packed_logprobs(tiny_path):
    engine = load_engine("hf", str(tiny_path), seed=3)
    assert isinstance(engine, RolloutEngine)
    prompts = [[1, 40, 41, 42], [1, 50, 51]]
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.7, top_k=20, top_p=0.9)
    batch = engine.generate(prompts, 3, sampling)
    assert [len(g) for g in batch.groups] == [3, 3]
    assert all(r.prompt_ids == prompts[r.group_id] and r.weight_version == 0 for r in batch.rollouts)

    trainer = GRPOModule(model_name_or_path=str(tiny_path), num_generations=3, temperature=0.7)
    trainer.configure_model()
    packed = trainer.pack_rollouts(batch.rollouts, torch.zeros(6))
    with torch.no_grad():
        logprobs, _ = trainer.policy_logprobs(trainer.policy, packed)
    torch.testing.assert_close(logprobs, packed.token_values["engine_logprobs"], rtol=0, atol=LOGPROB_TOLERANCE)


def test_sampling_is_reproducible_and_pushed_weights_take_effect(tiny_path):
    first, second = HFRolloutEngine(str(tiny_path)), HFRolloutEngine(str(tiny_path))
    sampling = SamplingConfig(max_new_tokens=6, seed=11)
    before = first.generate([[1, 40, 41]], 4, sampling).rollouts
    assert [r.completion_ids for r in before] == [r.completion_ids for r in second.generate([[1, 40, 41]], 4, sampling).rollouts]

    changed = {name: tensor + 0.5 * torch.randn_like(tensor) for name, tensor in first.model.state_dict().items()}
    first.push_weights(changed.items(), version=7)
    after = first.generate([[1, 40, 41]], 4, sampling).rollouts
    assert first.weight_version == 7 and all(r.weight_version == 7 for r in after)
    assert [r.logprobs for r in after] != [r.logprobs for r in before]
