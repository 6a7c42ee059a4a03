"""A real `vllm serve` process on loopback: generation over HTTP, weights pushed over the gloo transport."""

from __future__ import annotations

import threading

import pytest
from engine_checks import LOGPROB_ATOL, load_trainer_model, max_logprob_error, perturb_

from lightning_rl.rollout.base import RolloutEngine, SamplingConfig
from lightning_rl.rollout.vllm_server import VLLMServerEngine, VLLMServerError
from lightning_rl.models.weights import WeightMismatchError, iter_full_weights

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
SAMPLING = SamplingConfig(max_new_tokens=10, seed=5)


def test_generates_over_http_with_logprobs_of_transformers(server_engine, tiny_model_dir):
    assert isinstance(server_engine, RolloutEngine)
    batch = server_engine.generate(PROMPTS, n=3, sampling=SAMPLING)
    assert [len(group) for group in batch.groups] == [3, 3]
    assert all(r.weight_version == 0 and r.group_id == g for g, group in enumerate(batch.groups) for r in group)
    assert len({tuple(r.completion_ids) for r in batch.rollouts}) == 6
    assert max_logprob_error(load_trainer_model(tiny_model_dir), batch.rollouts) < LOGPROB_ATOL


def test_pushed_weights_reach_the_server_and_it_reports_their_version(server_engine, tiny_model_dir):
    trainer = load_trainer_model(tiny_model_dir)
    before = server_engine.generate(PROMPTS, n=2, sampling=SAMPLING)
    for version, chunk_bytes in ((1, 64 * 2**20), (2, 1)):  # one chunk for the model, then one per tensor
        perturb_(trainer, seed=version)
        server_engine.chunk_bytes = chunk_bytes
        server_engine.push_weights(iter_full_weights(trainer), version=version)
        assert server_engine.weight_version == version
        after = server_engine.generate(PROMPTS, n=2, sampling=SAMPLING)
        # The version comes back from the server with every completion, not from the client's counter.
        assert all(r.weight_version == version for r in after.rollouts)
        assert max_logprob_error(trainer, after.rollouts) < LOGPROB_ATOL
    assert max_logprob_error(trainer, before.rollouts) > 1e-2


def held_by(version: int, tiny_model_dir):
    """The trainer weights the tests above leave the server holding at `version`."""
    model = load_trainer_model(tiny_model_dir)
    for seed in range(1, version + 1):
        perturb_(model, seed=seed)
    return model


def test_every_push_is_verified_and_faults_are_caught(server_engine, tiny_model_dir, monkeypatch):
    """The check runs in `push_weights` after either transport (gloo here; nccl shares it); faults are injected
    between the trainer's digests and the server's weights, each caught by the digests the server's worker reads."""
    version = server_engine.weight_version
    trainer, push_gloo = held_by(version, tiny_model_dir), server_engine._push_gloo
    changed = held_by(version, tiny_model_dir)
    perturb_(changed, seed=99)

    def rewrite_after_loading(stream, v):  # a second update rewrites one weight of the loaded model
        push_gloo(stream, v)
        push_gloo(iter([("model.norm.weight", changed.model.norm.weight.detach() + 1e-3)]), v)

    faults = {
        "previous": (lambda stream, v: [None for _ in stream], "the engine's 'model.embed_tokens.weight' differs"),
        "rewritten": (rewrite_after_loading, "the engine's 'model.norm.weight' differs"),
        "skipped": (lambda stream, v: push_gloo(((n, t) for n, t in stream if n != "model.layers.1.mlp.up_proj.weight"), v),
                    "the engine's 'model.layers.1.mlp.up_proj.weight' differs"),
    }
    for seed, (fault, (push, named)) in enumerate(faults.items()):
        perturb_(changed, seed=100 + seed)  # each push sends weights the server does not hold yet
        monkeypatch.setattr(server_engine, "_push_gloo", push)
        with pytest.raises(WeightMismatchError, match=rf"^weight sync to version {version + 1} failed verification: {named}"):
            server_engine.push_weights(iter_full_weights(changed), version=version + 1)
        assert server_engine.weight_version == version, fault
    monkeypatch.undo()
    state = [(name, t.detach()) for name, t in changed.state_dict().items()]  # names the tied lm_head as well
    with pytest.raises(WeightMismatchError, match="'lm_head.weight' was sent besides 'model.embed_tokens.weight'"):
        server_engine.push_weights(iter(state), version=version + 1)
    without = [(n, t) for n, t in iter_full_weights(changed) if n != "model.embed_tokens.weight"]
    with pytest.raises(WeightMismatchError, match="'model.embed_tokens.weight' was not sent"):
        server_engine.push_weights(iter(without), version=version + 1)
    server_engine.push_weights(iter_full_weights(trainer), version=version)  # verified: back to the tests' weights
    batch = server_engine.generate(PROMPTS, n=1, sampling=SAMPLING)
    assert max_logprob_error(trainer, batch.rollouts) < LOGPROB_ATOL


def test_a_push_during_generation_waits_for_it(server_engine, tiny_model_dir):
    """Asynchronous mode: completions in flight finish on the weights they started with."""
    models = {server_engine.weight_version: load_trainer_model(tiny_model_dir)}
    for version in range(1, server_engine.weight_version + 1):
        perturb_(models[server_engine.weight_version], seed=version)
    new_version = server_engine.weight_version + 1
    models[new_version] = load_trainer_model(tiny_model_dir)
    for version in range(1, new_version + 1):
        perturb_(models[new_version], seed=version)
    generated = []
    generating = threading.Thread(target=lambda: generated.extend(
        server_engine.generate(PROMPTS * 2, n=2, sampling=SamplingConfig(max_new_tokens=32, seed=9)).rollouts))
    generating.start()
    server_engine.push_weights(iter_full_weights(models[new_version]), version=new_version)
    generating.join()
    assert len(generated) == 8
    for rollout in generated:
        assert "weight_versions" not in rollout.metadata  # a single version produced the whole completion
        assert max_logprob_error(models[rollout.weight_version], [rollout]) < LOGPROB_ATOL


def test_a_refused_push_names_the_tensor_and_leaves_the_server_serving(server_engine, tiny_model_dir):
    trainer = load_trainer_model(tiny_model_dir)
    version = server_engine.weight_version
    bad = [("model.layers.0.no_such_weight", trainer.model.norm.weight.detach())]
    with pytest.raises(VLLMServerError, match="no_such_weight"):
        server_engine.push_weights(iter(bad), version=version + 1)
    assert server_engine.weight_version == version
    batch = server_engine.generate(PROMPTS[:1], n=1, sampling=SAMPLING)
    assert batch.rollouts[0].completion_ids


def test_grpo_training_keeps_the_server_on_the_trainer_weights(server_engine, tiny_model_dir, tmp_path):
    """A real Trainer runs GRPO with this server as its engine; afterwards the server samples from the trained policy.

    Runs after the tests above: the module's own client takes over the server's transfer group.
    """
    import lightning as L

    from lightning_rl.data.prompts import PromptDataModule
    from lightning_rl.modules.grpo import GRPOModule

    module = GRPOModule(
        model_name_or_path=str(tiny_model_dir), num_generations=4, sampling={"max_new_tokens": 12}, learning_rate=1e-3,
        engine={"class_path": "lightning_rl.rollout.vllm_server.VLLMServerEngine", "init_args": {"url": server_engine.url}},
    )
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, PromptDataModule(path="toy", batch_size=2))
    observer = VLLMServerEngine(url=server_engine.url)
    batch = observer.generate(PROMPTS, n=2, sampling=SAMPLING)
    assert all(r.weight_version == trainer.global_step == 2 for r in batch.rollouts)
    assert max_logprob_error(module.policy.float().eval(), batch.rollouts) < LOGPROB_ATOL
    observer.close()
