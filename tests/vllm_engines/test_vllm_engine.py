"""The colocated vLLM engine against transformers on the same tokens, before and after a weight push."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from lightning_rl.rollout.base import RolloutEngine, SamplingConfig
from lightning_rl.models.weights import WeightMismatchError, iter_full_weights
from engine_checks import KV_CACHE_BYTES, LOGPROB_ATOL, LONG_PROMPTS, load_trainer_model, max_logprob_error, perturb_

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from lightning_rl.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(tiny_model_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=KV_CACHE_BYTES,
                        enforce_eager=True)
    yield engine
    engine.close()


def test_generates_n_samples_per_prompt_with_logprobs_of_transformers(engine, tiny_model_dir):
    assert isinstance(engine, RolloutEngine)
    batch = engine.generate(PROMPTS, n=3, sampling=SamplingConfig(max_new_tokens=12, seed=7))
    assert [len(group) for group in batch.groups] == [3, 3, 3]
    for g, group in enumerate(batch.groups):
        assert all(r.group_id == g and r.prompt_ids == PROMPTS[g] and r.weight_version == 0 for r in group)
        assert all(len(r.completion_ids) == len(r.logprobs) > 0 for r in group)
    assert len({tuple(r.completion_ids) for r in batch.rollouts}) == 9  # independent samples
    assert max_logprob_error(load_trainer_model(tiny_model_dir), batch.rollouts) < LOGPROB_ATOL


def test_a_batch_of_more_prompt_tokens_than_one_step_takes_is_sampled(engine, tiny_model_dir):
    # vLLM's CPU build dies when it splits a seeded request's prefill over steps; the engine prefills whole prompts.
    batch = engine.generate(LONG_PROMPTS, n=2, sampling=SamplingConfig(max_new_tokens=3, seed=1))
    assert [len(group) for group in batch.groups] == [2] * len(LONG_PROMPTS)
    assert max_logprob_error(load_trainer_model(tiny_model_dir), batch.rollouts[::6]) < LOGPROB_ATOL


def test_logprobs_follow_the_sampling_temperature(engine, tiny_model_dir):
    batch = engine.generate(PROMPTS[:1], n=2, sampling=SamplingConfig(max_new_tokens=8, temperature=0.6, seed=3))
    model = load_trainer_model(tiny_model_dir)
    assert max_logprob_error(model, batch.rollouts, temperature=0.6) < LOGPROB_ATOL
    assert max_logprob_error(model, batch.rollouts, temperature=1.0) > 1e-2


def test_stop_tokens_end_a_completion(engine):
    everything = tuple(range(300))
    sampling = SamplingConfig(max_new_tokens=8, stop_token_ids=everything, seed=1)
    batch = engine.generate(PROMPTS[:2], n=2, sampling=sampling)
    assert all(len(r.completion_ids) == 1 and r.finish_reason == "stop" for r in batch.rollouts)


def test_pushed_weights_change_the_logprobs_to_the_new_model(engine, tiny_model_dir):
    sampling = SamplingConfig(max_new_tokens=10, seed=11)
    before = engine.generate(PROMPTS, n=2, sampling=sampling)
    trainer = load_trainer_model(tiny_model_dir)
    perturb_(trainer, seed=1)
    # The trainer's own stream: named_parameters(), so the tied lm_head arrives once, as the input embedding.
    engine.push_weights(iter_full_weights(trainer), version=1)
    assert engine.weight_version == 1

    after = engine.generate(PROMPTS, n=2, sampling=sampling)
    assert all(r.weight_version == 1 for r in after.rollouts)
    assert max_logprob_error(trainer, after.rollouts) < LOGPROB_ATOL
    # Same seeds: what differs is the weights, so the old rollouts no longer fit the engine's model.
    assert max_logprob_error(trainer, before.rollouts) > 1e-2

    # A state_dict stream names the tied lm_head itself (after the embedding): loaded once, but a tied weight is
    # sent once, so the check refuses it; the trainer's own stream then syncs the same weights.
    perturb_(trainer, seed=2)
    with pytest.raises(WeightMismatchError, match="'lm_head.weight' was sent besides 'model.embed_tokens.weight'"):
        engine.push_weights(((name, t.detach()) for name, t in trainer.state_dict().items()), version=2)
    assert engine.weight_version == 1
    engine.push_weights(iter_full_weights(trainer), version=2)
    after = engine.generate(PROMPTS, n=2, sampling=sampling)
    assert all(r.weight_version == 2 for r in after.rollouts)
    assert max_logprob_error(trainer, after.rollouts) < LOGPROB_ATOL


def test_bad_requests_fail_clearly(engine):
    with pytest.raises(ValueError, match="n must be >= 1"):
        engine.generate(PROMPTS, n=0, sampling=SamplingConfig())
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[]], n=1, sampling=SamplingConfig())


def test_a_refused_push_names_the_tensor_and_keeps_the_old_weights(engine, tiny_model_dir):
    from lightning_rl.rollout.checkpoint_layout import WeightNameError

    version = engine.weight_version
    trainer = load_trainer_model(tiny_model_dir)
    for seed in range(1, version + 1):  # the weights the engine holds after the pushes above
        perturb_(trainer, seed=seed)
    changed = load_trainer_model(tiny_model_dir)
    perturb_(changed, seed=version + 1)
    wrong_shape = [("model.norm.weight", torch.zeros(3))] + list(iter_full_weights(changed))
    with pytest.raises(WeightNameError, match=r"'model.norm.weight': shape \(3,\)"):
        engine.push_weights(iter(wrong_shape), version=version + 1)
    unknown = [("model.layers.0.no_such_weight", torch.zeros(3))]
    with pytest.raises(WeightNameError, match="no_such_weight"):
        engine.push_weights(iter(unknown), version=version + 1)
    assert engine.weight_version == version
    batch = engine.generate(PROMPTS, n=1, sampling=SamplingConfig(max_new_tokens=6, seed=2))
    assert max_logprob_error(trainer, batch.rollouts) < LOGPROB_ATOL


def test_min_p_and_repetition_penalty_reach_vllm(engine):
    from vllm import SamplingParams

    from lightning_rl.rollout.vllm_engine import sampling_params_of

    params = SamplingParams(**sampling_params_of(SamplingConfig(min_p=0.2, repetition_penalty=1.3), n=2, seed=1, vocab_size=351))
    assert params.min_p == 0.2 and params.repetition_penalty == 1.3
    # min_p at 0.999 keeps only the likeliest token: sampling then gives the greedy completion.
    greedy = engine.generate(PROMPTS[:1], n=1, sampling=SamplingConfig(max_new_tokens=8, temperature=0)).rollouts
    nearly = engine.generate(PROMPTS[:1], n=3, sampling=SamplingConfig(max_new_tokens=8, min_p=0.999, seed=4)).rollouts
    assert all(r.completion_ids == greedy[0].completion_ids for r in nearly)


def corrupt_after_loading(engine, weights):
    engine._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})

    def corrupt(model):
        model.model.layers[1].post_attention_layernorm.weight.data[3] += 1e-3

    engine._llm.apply_model(corrupt)


def previous_version(engine, weights):
    for _ in weights:  # read as a push reads them, never loaded
        pass
    engine._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(())})


def skip(name):
    def reload(engine, weights):
        engine._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": ((n, t) for n, t in weights if n != name)})
    return reload


def stale_merge(name, previous):
    def reload(engine, weights):
        engine._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": (
            (n, previous[n] if n == name else t) for n, t in weights)})
    return reload


@pytest.fixture
def synced(engine, tiny_model_dir):
    """A trainer whose weights the engine holds (verified), and the version to push next; the engine is left synced."""
    trainer = load_trainer_model(tiny_model_dir)
    version = engine.weight_version + 1
    perturb_(trainer, seed=100 + version)
    engine.push_weights(iter_full_weights(trainer), version=version)
    yield trainer, version + 1
    perturb_(trainer, seed=200 + version)
    engine.push_weights(iter_full_weights(trainer), version=engine.weight_version + 1)


@pytest.mark.parametrize("fault, named", [
    ("corrupt", "the engine's 'model.layers.1.post_attention_layernorm.weight' differs"),
    ("skip", "the engine's 'model.layers.0.mlp.down_proj.weight' differs"),
    ("previous", "the engine's 'model.embed_tokens.weight' differs"),
])
def test_a_fault_inside_the_engine_stops_the_push_naming_tensor_and_version(engine, synced, monkeypatch, fault, named):
    trainer, version = synced
    reload = {"corrupt": corrupt_after_loading, "skip": skip("model.layers.0.mlp.down_proj.weight"),
              "previous": previous_version}[fault]
    monkeypatch.setattr(engine, "_reload", lambda weights: reload(engine, weights))
    perturb_(trainer, seed=version)
    with pytest.raises(WeightMismatchError, match=rf"^weight sync to version {version} failed verification: {named}"):
        engine.push_weights(iter_full_weights(trainer), version=version)
    assert engine.weight_version == version - 1


def test_a_head_left_computing_with_its_old_copy_of_the_tied_embedding_is_caught(engine, synced, monkeypatch):
    """vLLM's LM head shares the embedding's parameter, but its CPU kernel computes with a copy of its own, made again
    only when ``lm_head.weight`` is loaded: a push without that name leaves the head on the old weights. The check
    reads the head through its kernel, so it sees it."""
    trainer, version = synced
    monkeypatch.setattr(engine, "_held_aliases", set())  # the tied name not sent
    perturb_(trainer, seed=version)
    with pytest.raises(WeightMismatchError, match=rf"version {version} failed verification: the engine's 'lm_head.weight' differs"):
        engine.push_weights(iter_full_weights(trainer), version=version)
    assert engine.weight_version == version - 1


def test_tied_weights_not_sent_and_a_stale_lora_merge_are_caught(engine, synced, tiny_model_dir, monkeypatch):
    from peft import LoraConfig, get_peft_model

    trainer, version = synced
    without_embedding = [(n, t) for n, t in iter_full_weights(trainer) if n != "model.embed_tokens.weight"]
    with pytest.raises(WeightMismatchError, match="'model.embed_tokens.weight' was not sent"):
        engine.push_weights(iter(without_embedding), version=version)
    # LoRA merged into the base weights is verified like any other push; an engine holding the previous adapter's
    # merge of one weight is caught.
    adapted = get_peft_model(trainer, LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj"], init_lora_weights=False))
    merged = dict(iter_full_weights(adapted))
    engine.push_weights(iter(merged.items()), version=version)
    with torch.no_grad():
        adapted.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight.add_(0.1)
    name = "model.layers.0.self_attn.q_proj.weight"
    monkeypatch.setattr(engine, "_reload", lambda weights: stale_merge(name, merged)(engine, weights))
    with pytest.raises(WeightMismatchError, match=rf"version {version + 1} failed verification: the engine's '{name}' differs"):
        engine.push_weights(iter_full_weights(adapted), version=version + 1)


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
def test_first_pass_ratio_is_one_under_every_sampling_filter(engine, synced, temperature):
    """Weights just synced: over each token's support the trainer agrees with the engine in every cell of the grid."""
    from support.sampling_grid import check_first_pass

    check_first_pass(engine, synced[0], temperature)


def test_a_support_wider_than_the_cap_is_refused_naming_the_key(engine):
    from lightning_rl.errors import RecipeError

    with pytest.raises(RecipeError, match=r"^sampling.max_support=16: a sampled token's filters kept at least 17 tokens") as refused:
        engine.generate(PROMPTS[:1], 2, SamplingConfig(max_new_tokens=4, top_p=0.9, max_support=16, seed=0))
    assert refused.value.key == "sampling.max_support"



def test_generation_continues_across_a_push_with_every_token_versioned(engine, synced, tiny_model_dir):
    """A push from another thread lands between two of generate's steps, without waiting for the completions in flight:
    they continue under the new weights, their KV cache recomputed, and each token records the version that sampled it
    (its log-prob is that version's model on the whole prefix, not the other's)."""
    from engine_checks import reference_logprobs

    old_model, new = synced
    attempts = 8
    # Whether the push lands while completions are in flight is a race the test cannot hold: a machine loaded enough
    # to finish them first gets the next version pushed again. The weights are gathered before generation starts, so
    # the push has nothing to compute once tokens are sampled.
    old = new - 1
    for attempt in range(attempts):
        new_model = load_trainer_model(tiny_model_dir)
        new_model.load_state_dict(old_model.state_dict())
        perturb_(new_model, seed=300 + attempt)
        weights = list(iter_full_weights(new_model))
        generated = []
        generating = threading.Thread(target=lambda: generated.extend(
            engine.generate(PROMPTS, n=2, sampling=SamplingConfig(max_new_tokens=200, seed=4)).rollouts))
        generating.start()
        while sampled_so_far(engine) < 16 and generating.is_alive():
            time.sleep(0.01)
        engine.push_weights(iter(weights), version=new)
        returned_mid_flight = generating.is_alive()  # the push did not wait for the completions in flight
        generating.join()
        spanning = [r for r in generated if r.token_versions is not None]
        if spanning:
            break
        old_model, old, new = new_model, new, new + 1
    assert len(generated) == 6 and spanning, f"no completion was in flight across any of {attempts} pushes"
    assert returned_mid_flight
    for rollout in generated:
        versions = rollout.versions
        switch = versions.count(old)
        assert versions == [old] * switch + [new] * (len(versions) - switch) and rollout.weight_version == min(versions)
        of = {v: reference_logprobs(m, rollout.prompt_ids, rollout.completion_ids) for v, m in ((old, old_model), (new, new_model))}
        own = torch.stack([of[v][t] for t, v in enumerate(versions)])
        assert (torch.tensor(rollout.logprobs) - own).abs().max() < LOGPROB_ATOL
        if rollout in spanning:  # the tokens either side of the switch are not the other version's
            assert 0 < switch < len(versions)
            for t, v in ((switch - 1, new), (switch, old)):
                assert abs(rollout.logprobs[t] - of[v][t]) > 100 * LOGPROB_ATOL, t


def sampled_so_far(engine) -> int:
    """Tokens the completions in flight have sampled (read from another thread while the engine steps)."""
    try:
        return sum(engine._in_flight().values())
    except RuntimeError:  # the engine changed its requests while they were read
        return 0


def test_asynchronous_scheduling_is_refused_naming_the_key():
    """It would have a step's tokens in flight when a push lands: which weights sampled them would not be known."""
    from lightning_rl.rollout.vllm_engine import VLLMEngine

    with pytest.raises(ValueError, match=r"^engine_kwargs.async_scheduling: true is refused"):
        VLLMEngine.check_options({"dtype": "auto", "engine_kwargs": {"async_scheduling": True}})
    VLLMEngine.check_options({"dtype": "auto", "engine_kwargs": {"async_scheduling": False}})
    # Chunked prefill on a CPU: accepted, then the engine died on the first step that split a seeded prompt.
    with pytest.raises(ValueError, match=r"^engine_kwargs.enable_chunked_prefill: true is refused on a CPU"):
        VLLMEngine.check_options({"dtype": "auto", "engine_kwargs": {"enable_chunked_prefill": True}})
    # A key vLLM's engine does not take, or one the engine sets itself, was a TypeError traceback once the model had
    # loaded (and its recipe.yaml blocked the corrected rerun).
    with pytest.raises(ValueError, match=r"^engine_kwargs.max_num_seqz: not an argument of vLLM's engine \(did you mean 'max_num_seqs'\?\)$"):
        VLLMEngine.check_options({"dtype": "auto", "engine_kwargs": {"max_num_seqz": 4}})
    with pytest.raises(ValueError, match=r"^engine_kwargs.logprobs_mode: set by the engine itself$"):
        VLLMEngine.check_options({"dtype": "auto", "engine_kwargs": {"logprobs_mode": "raw_logprobs"}})
    with pytest.raises(ValueError, match=r"^engine_kwargs.max_model_len: set by the engine itself \(give it as the engine's own max_model_len\)$"):
        VLLMEngine.check_options({"dtype": "auto", "engine_kwargs": {"max_model_len": 64}})
    VLLMEngine.check_options({"dtype": "auto", "engine_kwargs": {"max_num_seqs": 4}})


def test_options_vllm_refuses_are_one_line_and_leave_no_run_folder(tmp_path):
    """vLLM's own option checks ended in a pydantic traceback after the run had written recipe.yaml and csv/, so the
    corrected rerun was refused as a folder holding a run. (In a process of its own: an engine vLLM refused to build
    leaves vLLM's process groups half made, and no later engine of that process starts.)"""
    import subprocess
    import sys

    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "lightning_rl.cli", "run", "recipes/tiny/grpo.yaml", f"--output_dir={out}",
                           "--trainer.max_steps=1", "--model.engine=VLLMEngine", "--model.engine.init_args.dtype=float32",
                           "--model.engine.init_args.max_model_len=100000"], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and errors[0].startswith("error: model.engine: vLLM refused the engine's options: "), done.stderr[-3000:]
    assert "max_model_len (100000)" in errors[0] and "Traceback" not in done.stderr and not out.exists()
