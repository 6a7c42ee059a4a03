"""Nothing lost, nothing repeated, on the vLLM server engine with sequences generated across weight updates
(``pause: keep``): an asynchronous GRPO run stopped by SIGTERM and by SIGKILL at random moments, each time resumed
with ``--ckpt_path=last``, trains every prompt batch exactly once (the multiset of trained indices), and every token
it trains was sampled within the staleness bound.

A periodic save waits until the rollout thread has finished the batches the current weights allow; a SIGTERM's save
cuts the samples in flight and keeps them as far as they got, for the resume to finish; the completions a SIGKILL cuts
were never saved and are sampled again on the resume, with the same seeds (README, "Generation never stops for a
weight update"). The runs share the test run's one server (by url), as
runs share a server started beside them on a cluster, so that one server start serves them all."""

from __future__ import annotations

import json
import random

import torch
from support.kill_resume import stopped_killed_and_resumed
from support.paths import REPO
from support.signalled_runs import Recipe, exit_after_signal, log_of, wait_until

from lightning_rl.rollout.base import INTERRUPTED, Rollout

MAX_STEPS = 8
MAX_STALENESS = 1


def test_async_grpo_across_updates_killed_and_signalled_trains_every_prompt_batch_once(
    server_engine, tiny_model_dir, tmp_path, monkeypatch
):
    versions_file = tmp_path / "token_versions.jsonl"
    monkeypatch.setenv("TOKEN_VERSIONS_FILE", str(versions_file))
    recipe = Recipe([
        str(REPO / "recipes" / "tiny" / "grpo.yaml"), f"--model.model_name_or_path={tiny_model_dir}",
        "--model.engine.class_path=VLLMServerEngine", f"--model.engine.init_args.url={server_engine.url}",
        "--model.engine.init_args.pause=keep", f"--trainer.max_steps={MAX_STEPS}", "--checkpoint_every_n_steps=1",
        "--model.async_mode=true", f"--model.max_staleness={MAX_STALENESS}", "--model.num_generations=4",
        "--model.sampling.max_new_tokens=48", "--data.batch_size=2", "--trainer.enable_progress_bar=false",
        "--logger.kind=none", "--trainer.callbacks+=support.kill_resume.TokenVersions",
    ], ranks=1)  # fmt: skip
    stopped_killed_and_resumed(recipe, tmp_path / "run", random.Random(23), MAX_STEPS, MAX_STALENESS)

    trained = [json.loads(line) for line in versions_file.read_text().splitlines()]
    # Whether a completion spans an update here depends on the machine's timing (on a loaded one none may); that a
    # completion generated across a push carries the right version on every token is tested exactly in
    # test_vllm_server.py. Here: each token within the bound, and versions only moving forward along a completion.
    spanning = [v for batch in trained for v in batch["versions"] if len(set(v)) > 1]
    for batch in trained:  # each token's version within the bound, and never newer than the trainer's
        assert all(0 <= batch["index"] - v <= MAX_STALENESS for versions in batch["versions"] for v in versions)
    assert all(v == sorted(v) for v in spanning)  # versions only move forward along a completion


def test_a_sigterm_mid_generation_saves_the_samples_as_far_as_they_got_and_the_resume_finishes_them(
    server_engine, tiny_model_dir, tmp_path, monkeypatch
):
    """A SIGTERM sent while the server samples a batch (from inside the engine: `StopsMidGeneration`). The save keeps
    that batch's samples as far as they got; the resumed run trains it once, each trained completion starting with the
    tokens saved, and every other batch once."""
    versions_file = tmp_path / "token_versions.jsonl"
    monkeypatch.setenv("TOKEN_VERSIONS_FILE", str(versions_file))
    steps = 3
    recipe = Recipe([
        str(REPO / "recipes" / "tiny" / "grpo.yaml"), f"--model.model_name_or_path={tiny_model_dir}",
        "--model.engine.class_path=support.stopping_engine.StopsMidGeneration", f"--model.engine.init_args.url={server_engine.url}",
        f"--trainer.max_steps={steps}", "--checkpoint_every_n_steps=1", "--model.async_mode=true", "--model.max_staleness=1",
        "--model.num_generations=16", "--model.sampling.max_new_tokens=200", "--data.batch_size=4", "--model.eval_generations=0",
        "--trainer.enable_progress_bar=false", "--logger.kind=none", "--trainer.callbacks+=support.kill_resume.TokenVersions",
    ], ranks=1)  # fmt: skip
    # The tiny model samples fast: a batch may finish before the abort lands, and is then saved whole. Up to three
    # runs, each stopped anew, until one saves a sample cut mid-way.
    for attempt in range(3):
        out = tmp_path / f"run{attempt}"
        versions_file.unlink(missing_ok=True)
        monkeypatch.setenv("STOP_AT_CALL", "2")  # batch 1's
        proc = recipe.start(out)
        wait_until(lambda: (out / "recipe.yaml").exists(), proc, out)
        code, _ = exit_after_signal(proc, out, "SIGTERM mid-generation")
        assert code == 143, log_of(out)[-3000:]
        monkeypatch.delenv("STOP_AT_CALL")
        [checkpoint] = out.glob("hpc_ckpt_*.ckpt")
        queue = torch.load(checkpoint, map_location="cpu", weights_only=False)["grpo"]["per_rank"][0]["rollout_queue"]
        saved = {p["index"]: [Rollout(**r) for r in p["rollouts"]] for p in queue["partial"]}  # one that had finished, too
        if any(r.finish_reason == INTERRUPTED and r.completion_ids for cut in saved.values() for r in cut):
            break
    else:
        raise AssertionError(f"no sample was cut mid-way in 3 stops: {[(i, [(r.finish_reason, len(r.completion_ids)) for r in cut]) for i, cut in saved.items()]}")

    recipe.run(out, "--ckpt_path=last")
    assert f"the rollouts of step(s) {', '.join(str(i + 1) for i in sorted(saved))} were saved as far as the stop" in log_of(out)
    trained = [json.loads(line) for line in versions_file.read_text().splitlines()]
    assert sorted(batch["index"] for batch in trained) == list(range(steps))
    for index, cut in saved.items():
        [batch] = [batch for batch in trained if batch["index"] == index]
        for completion, before in zip(batch["completions"], cut, strict=True):
            assert completion[: len(before.completion_ids)] == before.completion_ids
            if before.finish_reason != INTERRUPTED:
                assert completion == before.completion_ids
            elif len(before.completion_ids) < 200:
                assert len(completion) > len(before.completion_ids)
