"""Nothing lost, nothing repeated: an asynchronous GRPO run (max_staleness 1, so the rollout queue holds batches
generated ahead) stopped by SIGTERM and by SIGKILL at random moments, each time resumed with ``--ckpt_path=last``,
trains every prompt batch exactly once. The transformers engine; the moments come from a seeded generator. The vLLM
server engine, with sequences generated across weight updates: tests/vllm_engines/test_vllm_server_kill_resume.py.
A SIGTERM while a batch is sampled keeps its samples as far as they got, and the resume finishes them."""

from __future__ import annotations

import json
import random

import torch
from support.kill_resume import stopped_killed_and_resumed
from support.paths import REPO
from support.signalled_runs import Recipe, exit_after_signal, log_of, wait_until

from lightning_rl.rollout.base import INTERRUPTED, Rollout

MAX_STEPS = 10
MAX_STALENESS = 1


def test_async_grpo_killed_and_signalled_at_random_moments_trains_every_prompt_batch_once(tmp_path, tiny_path):
    recipe = Recipe([
        str(REPO / "recipes" / "tiny" / "grpo.yaml"), f"--trainer.max_steps={MAX_STEPS}", "--checkpoint_every_n_steps=1",
        "--model.async_mode=true", f"--model.max_staleness={MAX_STALENESS}", "--model.num_generations=4",
        "--model.sampling.max_new_tokens=4", "--data.batch_size=2", "--trainer.enable_progress_bar=false", "--logger.kind=none",
    ], ranks=1)  # fmt: skip
    stopped_killed_and_resumed(recipe, tmp_path / "run", random.Random(23), MAX_STEPS, MAX_STALENESS)


def test_a_sigterm_mid_generation_saves_the_samples_as_far_as_they_got_and_the_resume_finishes_them(tmp_path, monkeypatch):
    """The stop comes while the transformers engine samples batch 1 (sent from inside it: `HFStopsMidGeneration`). The
    save cuts that batch's samples where they are, and keeps them; the resumed run trains it once, each trained
    completion starting with the tokens saved, those cut longer than they were, and every other batch once."""
    versions_file = tmp_path / "token_versions.jsonl"
    monkeypatch.setenv("TOKEN_VERSIONS_FILE", str(versions_file))
    monkeypatch.setenv("STOP_AT_CALL", "2")  # batch 1's
    steps, out, longest = 3, tmp_path / "run", 64
    recipe = Recipe([
        str(REPO / "recipes" / "tiny" / "grpo.yaml"), "--model.engine.class_path=support.stopping_engine.HFStopsMidGeneration",
        f"--trainer.max_steps={steps}", "--checkpoint_every_n_steps=1", "--model.async_mode=true", "--model.max_staleness=1",
        "--model.num_generations=4", f"--model.sampling.max_new_tokens={longest}", "--data.batch_size=2", "--model.eval_generations=0",
        "--trainer.enable_progress_bar=false", "--logger.kind=none", "--trainer.callbacks+=support.kill_resume.TokenVersions",
    ], ranks=1)  # fmt: skip
    proc = recipe.start(out)
    wait_until(lambda: (out / "recipe.yaml").exists(), proc, out)
    code, _ = exit_after_signal(proc, out, "SIGTERM mid-generation")
    assert code == 143, log_of(out)[-3000:]
    monkeypatch.delenv("STOP_AT_CALL")
    [checkpoint] = out.glob("hpc_ckpt_*.ckpt")
    queue = torch.load(checkpoint, map_location="cpu", weights_only=False)["grpo"]["per_rank"][0]["rollout_queue"]
    saved = {p["index"]: [Rollout(**r) for r in p["rollouts"]] for p in queue["partial"]}
    assert list(saved) == [1], queue
    assert any(r.finish_reason == INTERRUPTED and r.completion_ids for r in saved[1]), [(r.finish_reason, len(r.completion_ids)) for r in saved[1]]

    recipe.run(out, "--ckpt_path=last")
    assert "the rollouts of step(s) 2 were saved as far as the stop" in log_of(out)
    trained = [json.loads(line) for line in versions_file.read_text().splitlines()]
    assert sorted(batch["index"] for batch in trained) == list(range(steps))
    [batch] = [batch for batch in trained if batch["index"] == 1]
    for completion, before in zip(batch["completions"], saved[1], strict=True):
        assert completion[: len(before.completion_ids)] == before.completion_ids
        if before.finish_reason != INTERRUPTED:
            assert completion == before.completion_ids
        elif len(before.completion_ids) < longest:
            assert len(completion) > len(before.completion_ids)
