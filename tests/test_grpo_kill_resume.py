"""Nothing lost, nothing repeated: an asynchronous GRPO run (max_staleness 1, so the rollout queue holds batches
generated ahead) stopped by SIGTERM and by SIGKILL at random moments, each time resumed with ``--ckpt_path=last``,
trains every prompt batch exactly once. The transformers engine; the moments come from a seeded generator. The vLLM
server engine, with sequences generated across weight updates: tests/vllm_engines/test_vllm_server_kill_resume.py."""

from __future__ import annotations

import random

from support.kill_resume import stopped_killed_and_resumed
from support.paths import REPO
from support.signalled_runs import Recipe

MAX_STEPS = 10
MAX_STALENESS = 1


def test_async_grpo_killed_and_signalled_at_random_moments_trains_every_prompt_batch_once(tmp_path, tiny_path):
    recipe = Recipe([
        str(REPO / "recipes" / "tiny" / "grpo.yaml"), f"--trainer.max_steps={MAX_STEPS}", "--checkpoint_every_n_steps=1",
        "--model.async_mode=true", f"--model.max_staleness={MAX_STALENESS}", "--model.num_generations=4",
        "--model.sampling.max_new_tokens=4", "--data.batch_size=2", "--trainer.enable_progress_bar=false", "--logger.kind=none",
    ], ranks=1)  # fmt: skip
    stopped_killed_and_resumed(recipe, tmp_path / "run", random.Random(23), MAX_STEPS, MAX_STALENESS)
