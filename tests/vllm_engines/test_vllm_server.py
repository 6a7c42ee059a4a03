"""A real `vllm serve` process on loopback: generation over HTTP, weights pushed over the gloo transport."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from engine_checks import LOGPROB_ATOL, LONG_PROMPTS, load_trainer_model, max_logprob_error, perturb_
from support.stopping_engine import sampled_tokens

from lightning_rl.rollout import gloo_transport
from lightning_rl.rollout.base import INTERRUPTED, GenerationInterrupted, RolloutEngine, SamplingConfig
from lightning_rl.rollout.vllm_server import VLLMServerEngine, VLLMServerError, served_config_refusal
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


def test_a_batch_of_more_prompt_tokens_than_one_step_takes_is_sampled(server_engine, tiny_model_dir):
    # vLLM's CPU build dies when it splits a seeded request's prefill over steps; the server prefills whole prompts.
    batch = server_engine.generate(LONG_PROMPTS, n=2, sampling=SamplingConfig(max_new_tokens=3, seed=1))
    assert [len(group) for group in batch.groups] == [2] * len(LONG_PROMPTS)
    assert max_logprob_error(load_trainer_model(tiny_model_dir), batch.rollouts[::6]) < LOGPROB_ATOL


def test_a_given_server_that_would_die_or_report_other_logprobs_is_refused_in_one_line(server_engine):
    config = server_engine._server_config()  # the fixture's server, started here: whole prefills
    assert config["device_config"]["device"] == "cpu" and served_config_refusal(server_engine.url, config) is None
    chunked = {**config, "scheduler_config": {**config["scheduler_config"], "enable_chunked_prefill": True}}
    refusal = served_config_refusal(server_engine.url, chunked)
    assert refusal is not None and server_engine.url in refusal and refusal.endswith("start it with --no-enable-chunked-prefill")
    # One reporting raw log-probs (the distribution before temperature and filters), or too few top log-probs for a
    # filter's support, was taken as it was: its figures were off by the temperature's effect.
    for model_config in ({"logprobs_mode": "raw_logprobs"}, {"max_logprobs": 20}):
        other = {**config, "model_config": {**config["model_config"], **model_config}}
        refusal = served_config_refusal(server_engine.url, other)
        assert refusal is not None and refusal.endswith("start it with --logprobs-mode processed_logprobs --max-logprobs -1")


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


def test_a_push_travels_while_the_server_generates_and_the_pause_only_loads_it(server_engine, tiny_model_dir, monkeypatch):
    """Staged (the default over gloo): every chunk is sent before the server is paused, and the pause loads what the
    server received meanwhile; with ``stage_weights`` false the chunks travel inside the pause. Either way the push
    ends verified against the server's live weights."""
    events: list[str] = []
    post, send = server_engine._post, gloo_transport.send_chunk

    def posted(route, *args, **kwargs):
        events.append(route.split("?")[0])
        return post(route, *args, **kwargs)

    def sent(group, chunk):
        events.append("chunk")
        return send(group, chunk)

    monkeypatch.setattr(server_engine, "_post", posted)
    monkeypatch.setattr(gloo_transport, "send_chunk", sent)
    version = server_engine.weight_version
    trainer = held_by(version, tiny_model_dir)  # what it holds, sent again: the tests below see no change
    server_engine.chunk_bytes = 2**20  # a few chunks of the 2 MB model
    for staged in (True, False):
        events.clear()
        server_engine.stage_weights = staged
        server_engine.push_weights(iter_full_weights(trainer), version=version)
        order = [event for event in events if event in ("chunk", "pause", "resume")]
        chunks = order.count("chunk")
        assert chunks > 1 and server_engine.weight_version == version
        assert order == (["chunk"] * chunks + ["pause", "resume"] if staged else ["pause", *["chunk"] * chunks, "resume"])
    server_engine.stage_weights = True


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


def models_up_to(version: int, tiny_model_dir):
    """The trainer weights of every version up to `version`, as the tests above push them."""
    models = {0: load_trainer_model(tiny_model_dir)}
    for v in range(1, version + 1):
        models[v] = load_trainer_model(tiny_model_dir)
        for seed in range(1, v + 1):
            perturb_(models[v], seed=seed)
    return models


def generated_mid_push(engine, models, new_version, prompts, sampling) -> tuple[list, bool]:
    """Push `models[new_version]` once `engine`'s server has sampled some tokens of `generate(prompts, ...)`; returns
    the rollouts and whether the generation was still running when the push started.

    The weights are gathered first: on a loaded machine, gathering them while the server's threads take every core
    took a second, as long as the whole generation, so the push landed after it."""
    weights = list(iter_full_weights(models[new_version]))
    before = sampled_tokens(engine.url)
    generated = []
    generating = threading.Thread(target=lambda: generated.extend(engine.generate(prompts, n=2, sampling=sampling).rollouts))
    generating.start()
    while sampled_tokens(engine.url) < before + 16 and generating.is_alive():
        time.sleep(0.02)
    in_flight = generating.is_alive()
    engine.push_weights(iter(weights), version=new_version)
    generating.join()
    return generated, in_flight


def test_a_push_in_wait_mode_waits_for_generation(server_engine, tiny_model_dir, monkeypatch):
    """``pause: wait``: completions in flight finish on the weights they started with."""
    attempts = 8  # as below: the push must start while the completions are sampled, a race a loaded machine can lose
    models = models_up_to(server_engine.weight_version + attempts, tiny_model_dir)
    monkeypatch.setattr(server_engine, "pause", "wait")
    monkeypatch.setattr(server_engine, "engine_max_restarts", 0)
    for _ in range(attempts):
        new_version = server_engine.weight_version + 1
        generated, in_flight = generated_mid_push(server_engine, models, new_version, PROMPTS * 2, SamplingConfig(max_new_tokens=64, seed=9))
        if in_flight:
            break
    assert in_flight, f"no push of {attempts} started while the completions were sampled"
    assert len(generated) == 8
    for rollout in generated:
        assert rollout.token_versions is None  # a single version produced the whole completion
        assert max_logprob_error(models[rollout.weight_version], [rollout]) < LOGPROB_ATOL


def test_generation_continues_across_a_push_with_every_token_versioned_and_corrected(server_engine, tiny_model_dir, monkeypatch):
    """``pause: keep`` (the default): a push freezes the completions in flight, and they continue under the new weights.

    Every token carries the version that sampled it: its recorded log-prob is that of its version's model on the
    whole prefix (the continued sequences' KV cache is recomputed, not kept from the old weights), and not that of the
    other version. The GRPO loss of such a sequence, engine-vs-trainer corrected, is the one computed by hand from
    those per-token log-probs."""
    from lightning_rl.losses.grpo import GRPOLoss
    from lightning_rl.modules.grpo import GRPOModule
    from engine_checks import reference_logprobs

    attempts = 8  # each about a second; under load as few as half of them landed mid-generation
    models = models_up_to(server_engine.weight_version + attempts, tiny_model_dir)
    # The pause must come while the completions are in flight: staged, it comes after the whole transfer, which a
    # loaded machine may not finish before them (the staged push's order is tested above).
    monkeypatch.setattr(server_engine, "stage_weights", False)
    # Nor may the push do tensor work before it pauses: on a machine whose cores the server's threads take, copying
    # the weights to keep for a restart (a parallel op) took as long as the whole generation.
    monkeypatch.setattr(server_engine, "engine_max_restarts", 0)
    # Long completions (the server's max_model_len is 256), so the push lands while they are sampled. Whether it does
    # is a race the test cannot hold: a machine loaded enough to finish them first gets the next version pushed again.
    for _ in range(attempts):
        old = server_engine.weight_version
        generated, _ = generated_mid_push(server_engine, models, old + 1, PROMPTS, SamplingConfig(max_new_tokens=240, seed=3))
        spanning = [r for r in generated if r.token_versions is not None]
        if spanning:
            break
    assert spanning, f"no completion was in flight across any of {attempts} pushes"
    for rollout in generated:
        versions = torch.tensor(rollout.versions)
        assert rollout.weight_version == int(versions.min())  # the oldest token bounds the staleness
        switch = int((versions == old).sum())
        assert versions.tolist() == [old] * switch + [old + 1] * (len(versions) - switch)
        recorded = torch.tensor(rollout.logprobs)
        own = torch.where(versions == old, reference_logprobs(models[old], rollout.prompt_ids, rollout.completion_ids),
                          reference_logprobs(models[old + 1], rollout.prompt_ids, rollout.completion_ids))
        assert (recorded - own).abs().max() < LOGPROB_ATOL
    for rollout in spanning:  # the tokens either side of the switch are not the other version's
        switch = rollout.versions.index(old + 1)
        assert 0 < switch < len(rollout.completion_ids)
        for t, model in ((switch - 1, models[old + 1]), (switch, models[old])):
            other = reference_logprobs(model, rollout.prompt_ids, rollout.completion_ids)[t]
            assert abs(rollout.logprobs[t] - other) > 100 * LOGPROB_ATOL, t

    # The trainer holds the new weights; its ratio to the engine corrects each token by the version that sampled it.
    cap = 2.0
    module = GRPOModule(model_name_or_path=str(tiny_model_dir), num_generations=2, old_logprobs="trainer",
                        loss=GRPOLoss("grpo", importance_sampling_cap=cap, importance_sampling_mode="token_truncate"),  # each token's own
                        sampling={"max_new_tokens": 240})
    module.configure_model()
    module.policy.load_state_dict(models[old + 1].state_dict())
    advantages = torch.tensor([0.7 - 0.4 * i for i in range(len(spanning))])
    packed = module.pack_rollouts(spanning, advantages)
    terms, _ = module.row_loss(packed)
    by_hand, plain = torch.zeros_like(terms.loss), torch.zeros_like(terms.loss)
    for i, (rollout, advantage) in enumerate(zip(spanning, advantages)):
        trainer = reference_logprobs(models[old + 1], rollout.prompt_ids, rollout.completion_ids)
        weight = torch.exp(trainer - torch.tensor(rollout.logprobs)).clamp(max=cap)  # ~1 on the new version's tokens
        assert int((packed.loss_seq == i).sum()) == len(rollout.completion_ids)
        by_hand[packed.loss_seq == i] = -advantage * weight  # the ratio to the trainer's own log-probs is 1: unclipped
        plain[packed.loss_seq == i] = -advantage
    torch.testing.assert_close(terms.loss.detach(), by_hand, atol=1e-4, rtol=1e-4)
    versions = torch.cat([torch.tensor(r.versions) for r in spanning])[packed.loss_seq.argsort(stable=True).argsort()]
    assert (terms.loss.detach() - plain)[versions == old + 1].abs().max() < 1e-3  # sampled by the trainer's weights
    assert (terms.loss.detach() - plain)[versions == old].abs().max() > 1e-2  # corrected, token by token


def test_a_stop_cuts_the_samples_in_flight_and_each_finishes_under_the_next_weights(server_engine, tiny_model_dir):
    """What an asynchronous run's save keeps when a stop signal finds a batch half sampled: ``interrupt`` cuts every
    sample in flight (``generate`` raises `GenerationInterrupted` with the tokens each holds) and leaves the server
    serving; after the resume's push, ``continue_rollouts`` samples each on to the end. Each token keeps the version
    that sampled it, and its recorded log-prob is that version's model's on the whole prefix."""
    from engine_checks import reference_logprobs

    old = server_engine.weight_version
    models = models_up_to(old + 1, tiny_model_dir)
    sampling = SamplingConfig(max_new_tokens=240, seed=11)
    for _ in range(4):  # the cut must come while the samples are in flight: a loaded machine may finish them first
        outcome: dict = {}

        def sample() -> None:
            try:
                outcome["done"] = server_engine.generate(PROMPTS, n=2, sampling=sampling)
            except GenerationInterrupted as cut:
                outcome["cut"] = cut.partial.rollouts

        before = sampled_tokens(server_engine.url)
        generating = threading.Thread(target=sample)
        generating.start()
        while sampled_tokens(server_engine.url) < before + 16 and generating.is_alive():
            time.sleep(0.02)
        assert server_engine.interrupt()
        generating.join(60)
        cut = [r for r in outcome.get("cut", ()) if r.finish_reason == INTERRUPTED]
        if any(r.completion_ids for r in cut):
            break
    assert any(r.completion_ids for r in cut), "no sample was in flight at any of the cuts"
    assert all(r.infra_failure is None and r.versions == [old] * len(r.completion_ids) for r in cut)
    assert all(0 < len(r.completion_ids) < 240 for r in cut if r.completion_ids)

    server_engine.push_weights(iter_full_weights(models[old + 1]), version=old + 1)
    finished = server_engine.continue_rollouts(cut, SamplingConfig(max_new_tokens=240, seed=12))
    for before, after in zip(cut, finished, strict=True):
        k = len(before.completion_ids)
        assert after.prompt_ids == before.prompt_ids and after.completion_ids[:k] == before.completion_ids
        assert after.logprobs[:k] == before.logprobs and after.finish_reason in ("stop", "length")
        assert len(after.completion_ids) == 240 or after.finish_reason == "stop"
        versions = torch.tensor(after.versions)
        assert versions.tolist() == [old] * k + [old + 1] * (len(after.completion_ids) - k) and after.weight_version == old
        own = torch.where(versions == old, reference_logprobs(models[old], after.prompt_ids, after.completion_ids),
                          reference_logprobs(models[old + 1], after.prompt_ids, after.completion_ids))
        assert (torch.tensor(after.logprobs) - own).abs().max() < LOGPROB_ATOL


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


def test_a_server_given_by_url_that_serves_another_model_is_one_line_before_any_push(server_engine, tiny_model_dir, tmp_path):
    """A server started elsewhere may hold any model: the run's is compared with it, tensor by tensor, on connecting
    (the first push used to fail on the server, in a traceback through the training loop)."""
    import json
    import shutil

    from lightning_rl.errors import UserError

    other = shutil.copytree(tiny_model_dir, tmp_path / "wider")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "intermediate_size": 2 * config["intermediate_size"]}))
    with pytest.raises(UserError, match=rf"^url: the vLLM server at {server_engine.url} cannot serve this run's {other}: it serves "
                                        rf".* \(Qwen3ForCausalLM\), where 'model\.layers\.0\.mlp\.gate_proj\.weight' is "
                                        rf"\({config['intermediate_size']}, {config['hidden_size']}\), and "
                                        rf"\({2 * config['intermediate_size']}, {config['hidden_size']}\) in this run's model$"):
        VLLMServerEngine(other, url=server_engine.url)
    VLLMServerEngine(tiny_model_dir, url=server_engine.url).close()  # its own model: taken
