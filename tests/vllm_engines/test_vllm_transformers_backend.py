"""An architecture vLLM serves through its Transformers backend (GPT-NeoX in vLLM 0.32).

That backend rewrites transformers' own classes of the architecture (`support_torch_compile` on the decoder class) for
the whole process it runs in: a trainer's GPT-NeoX model in the same process then fails on its first forward (checked
by hand: ``'GPTNeoXModel' object has no attribute 'do_not_compile'``), and no new one can be built. So the in-process
engine refuses it in one line, before vLLM loads anything, and names the server engine. The server runs vLLM in a
process of its own; there the weight check reads the checkpoint's names back through the backend's renaming
(``gpt_neox.embed_in`` is vLLM's ``model.embed_in``).
"""

from __future__ import annotations

import pytest
import torch
from engine_checks import KV_CACHE_BYTES, load_trainer_model, perturb_
from transformers import AutoModelForCausalLM, GPTNeoXConfig

from lightning_rl.errors import RecipeError
from lightning_rl.models.weights import WeightMismatchError, iter_full_weights
from lightning_rl.rollout.base import SamplingConfig
from lightning_rl.toy.model import build_tokenizer, save_from_any_process, seeded_model


@pytest.fixture(scope="module")
def neox_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gpt-neox")
    tokenizer = build_tokenizer()
    config = GPTNeoXConfig(  # head size 64: vLLM's CPU attention has no kernel for the smallest head sizes
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=256, rotary_pct=1.0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    save_from_any_process(seeded_model(AutoModelForCausalLM, config, tokenizer, seed=0), path)
    tokenizer.save_pretrained(path)
    return path


def test_the_in_process_engine_refuses_it_in_one_line_and_names_the_server(neox_dir):
    from lightning_rl.rollout.vllm_engine import VLLMEngine

    with pytest.raises(RecipeError, match=r"^engine: vLLM serves GPTNeoXForCausalLM through its Transformers backend, .* \(model.engine: vllm_server\)$") as caught:
        VLLMEngine(neox_dir, dtype="float32", max_model_len=128, kv_cache_memory_bytes=KV_CACHE_BYTES, enforce_eager=True)
    assert caught.value.key == "engine"  # the command prints it as one line naming the key, not a stack trace
    load_trainer_model(neox_dir)(input_ids=torch.tensor([[5, 6, 7]]))  # this process's classes untouched


def test_the_server_takes_verified_pushes_under_the_checkpoint_names(neox_dir, tmp_path):
    from lightning_rl.rollout.vllm_server import VLLMServerEngine

    engine = VLLMServerEngine(neox_dir, server_options={"dtype": "float32", "max_model_len": 128, "kv_cache_memory_bytes": KV_CACHE_BYTES,
                                                        "enforce_eager": True, "log_path": tmp_path / "server.log"})
    try:
        trainer = load_trainer_model(neox_dir)
        perturb_(trainer, seed=1)
        engine.push_weights(iter_full_weights(trainer), version=1)  # every tensor read back under its checkpoint name
        assert engine.weight_version == 1
        assert engine.generate([[5, 6, 7]], n=1, sampling=SamplingConfig(max_new_tokens=3, seed=1)).rollouts[0].weight_version == 1
        # Negative control: a tensor left out of a push is named as the checkpoint names it.
        perturb_(trainer, seed=2)
        partial = ((n, t) for n, t in iter_full_weights(trainer) if n != "gpt_neox.embed_in.weight")
        with pytest.raises(WeightMismatchError, match="'gpt_neox.embed_in.weight' was not sent"):
            engine.push_weights(partial, version=2)
    finally:
        engine.close()
