"""The transformers rollout engine: its log-probs equal the trainer's tree-packed ones, sampling is
reproducible from the seed, and pushed weights take effect with their version."""

from __future__ import annotations

import torch

from lightning_rl.modules.grpo import GRPOModule
from lightning_rl.rollout.base import EngineSpec, RolloutEngine, SamplingConfig
from lightning_rl.rollout.hf import HFRolloutEngine

# fp32 on both sides; the trainer forwards a packed tree, the engine a KV-cached padded batch.
LOGPROB_TOLERANCE = 1e-4


def test_engine_logprobs_match_the_trainers_packed_logprobs(tiny_path):
    engine = EngineSpec.of("hf").build(str(tiny_path), seed=3)
    assert isinstance(engine, RolloutEngine)
    prompts = [[1, 40, 41, 42], [1, 50, 51]]
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.7, top_k=20, top_p=0.9)
    batch = engine.generate(prompts, 3, sampling)
    assert [len(g) for g in batch.groups] == [3, 3]
    assert all(r.prompt_ids == prompts[r.group_id] and r.weight_version == 0 for r in batch.rollouts)

    trainer = GRPOModule(model_name_or_path=str(tiny_path), num_generations=3, sampling={"temperature": 0.7})
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

    # named_parameters, as a sync streams them: a tied weight once (the state dict names it twice, and a push of both
    # is refused by the engine's verification)
    changed = {name: tensor + 0.5 * torch.randn_like(tensor) for name, tensor in first.model.named_parameters()}
    first.push_weights(changed.items(), version=7)
    after = first.generate([[1, 40, 41]], 4, sampling).rollouts
    assert first.weight_version == 7 and all(r.weight_version == 7 for r in after)
    assert [r.logprobs for r in after] != [r.logprobs for r in before]


def test_min_p_and_repetition_penalty_reach_the_sampler(tiny_path):
    engine = HFRolloutEngine(str(tiny_path))
    prompts = [[1, 40, 41, 42], [1, 50, 51]]
    greedy = engine.generate(prompts, 1, SamplingConfig(max_new_tokens=8, temperature=0)).rollouts
    # min_p keeps the tokens at least min_p times as likely as the likeliest: at 0.999, only the likeliest.
    nearly_greedy = engine.generate(prompts, 4, SamplingConfig(max_new_tokens=8, min_p=0.999, seed=5)).rollouts
    assert all(r.completion_ids == greedy[r.group_id].completion_ids for r in nearly_greedy)
    # Greedy with a repetition penalty: each step takes the likeliest token once every token already in the sequence
    # has its logit divided by the penalty (multiplied, where negative), as the CTRL paper defines it.
    prompt, penalty = [1, 40, 41, 42], 1.5
    (penalised,) = engine.generate([prompt], 1, SamplingConfig(max_new_tokens=8, temperature=0, repetition_penalty=penalty)).rollouts
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            logits = engine.model(torch.tensor([ids])).logits[0, -1].float()
            seen = torch.tensor(sorted(set(ids)))
            logits[seen] = torch.where(logits[seen] < 0, logits[seen] * penalty, logits[seen] / penalty)
            ids.append(int(logits.argmax()))
            if ids[-1] in engine.eos_token_ids:
                break
    assert penalised.completion_ids == ids[len(prompt):]
    (plain,) = engine.generate([prompt], 1, SamplingConfig(max_new_tokens=8, temperature=0)).rollouts
    assert plain.completion_ids != penalised.completion_ids  # the penalty changed what greedy picks
    # Prompts of several lengths: each is penalised for its own tokens alone, never for another's padding (transformers
    # 5.19 penalised the left padding; with pad == eos, shorter prompts' replies were kept from ending).
    masks = []
    generate = engine.model.generate
    engine.model.generate = lambda **kwargs: masks.append(kwargs["attention_mask"]) or generate(**kwargs)
    sampling = SamplingConfig(max_new_tokens=8, temperature=0, repetition_penalty=penalty)
    batched = engine.generate([prompt, [1, 50], [1, 50, 51, 52, 53]], 2, sampling).groups
    assert all(bool(mask.all()) for mask in masks) and len(masks) == 3  # one call per prompt length: no padding
    assert [[r.completion_ids for r in group] for group in batched] == [
        [r.completion_ids for r in engine.generate([p], 2, sampling).rollouts] for p in (prompt, [1, 50], [1, 50, 51, 52, 53])
    ]


def test_a_checkpoints_generation_config_never_changes_what_the_engine_samples(tiny_path, tmp_path):
    """generate fills what a call leaves unset from the model's generation config: a checkpoint shipping a
    repetition penalty, a minimum length or use_cache: false (as Qwen2.5-Instruct ships 1.05) made the engine sample
    from a policy the trainer never scores. The engine samples with the recipe's settings alone."""
    import json
    import shutil

    folder = tmp_path / "shipped"
    shutil.copytree(tiny_path, folder)
    shipped = json.loads((folder / "generation_config.json").read_text())
    shipped.update(repetition_penalty=1.5, min_new_tokens=6, no_repeat_ngram_size=1, use_cache=False)
    (folder / "generation_config.json").write_text(json.dumps(shipped))
    engine = HFRolloutEngine(str(folder))
    batch = engine.generate([[1, 40, 41, 42], [1, 50, 51]], 3, SamplingConfig(max_new_tokens=8, temperature=1.0, seed=2))
    for rollout in batch.rollouts:
        ids = torch.tensor([rollout.prompt_ids + rollout.completion_ids])
        with torch.no_grad():
            logprobs = torch.log_softmax(engine.model(input_ids=ids).logits[0].float(), -1)
        start = len(rollout.prompt_ids)
        policy = logprobs[start - 1 : -1].gather(1, torch.tensor(rollout.completion_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(rollout.logprobs), policy, rtol=0, atol=LOGPROB_TOLERANCE)


def test_a_sampling_call_on_a_thread_of_its_own_draws_the_same_while_the_trainer_sets_the_generator(tiny_path):
    """Async GRPO: the engine samples on the rollout thread while the trainer's thread sets the process's generator (a
    resumed run's first step restores its checkpoint's state) and draws from it (dropout). A set landing inside a
    sampling call changed its draws: a resumed async run sampled other completions than the uninterrupted one, some
    of the time. The engine draws from a generator of its own, and leaves the process's as it was."""
    import threading

    from lightning_rl.ops.random_state import RandomState

    engine = HFRolloutEngine(str(tiny_path))
    sampling = SamplingConfig(max_new_tokens=16, seed=11)
    alone = [r.completion_ids for r in engine.generate([[1, 40, 41], [1, 50]], 4, sampling).rollouts]
    saved, done, sampled = RandomState.now(torch.device("cpu")), threading.Event(), []
    thread = threading.Thread(target=lambda: (sampled.extend(engine.generate([[1, 40, 41], [1, 50]], 4, sampling).rollouts), done.set()))
    thread.start()
    while not done.is_set():
        saved.restore()
        torch.rand(64)  # as a forward under dropout draws
    thread.join()
    assert [r.completion_ids for r in sampled] == alone
    before = torch.get_rng_state()
    engine.generate([[1, 40, 41]], 4, sampling)
    assert torch.equal(torch.get_rng_state(), before)
