"""The vLLM server engine under every sampling filter: each token's support comes back with it, and the trainer scoring
over it agrees with the engine at the first pass (the in-process engine's grid is in test_vllm_engine.py)."""

from __future__ import annotations

import pytest
from engine_checks import load_trainer_model

from lightning_rl.errors import RecipeError
from lightning_rl.rollout.base import SamplingConfig


@pytest.fixture(scope="module")
def trainer(server_engine, tiny_model_dir):
    # Runs before test_vllm_server.py pushes weights (file order): the server holds the weights it started with.
    assert server_engine.weight_version == 0, "the grid needs the server on the weights it started with"
    return load_trainer_model(tiny_model_dir)


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
def test_first_pass_ratio_is_one_under_every_sampling_filter(server_engine, trainer, temperature):
    from support.sampling_grid import check_first_pass

    check_first_pass(server_engine, trainer, temperature)


def test_a_support_wider_than_the_cap_is_refused_naming_the_key(server_engine):
    with pytest.raises(RecipeError, match=r"^sampling.max_support=16: a sampled token's filters kept at least 17 tokens") as refused:
        server_engine.generate([[5, 6, 7]], 2, SamplingConfig(max_new_tokens=4, top_p=0.9, max_support=16, seed=0))
    assert refused.value.key == "sampling.max_support"
