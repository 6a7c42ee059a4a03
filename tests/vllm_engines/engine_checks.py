"""What the vLLM engine tests compare against: transformers' log-probs on the same tokens."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from lightning_rl.rollout.base import Rollout

# fp32 on both sides; the differences measured are about 1e-6.
LOGPROB_ATOL = 1e-4
KV_CACHE_BYTES = 64 * 2**20
# More prompt tokens (12 x 240) than one vLLM step schedules on a CPU (2,048): a batch of long prompts, each seeded.
LONG_PROMPTS = [[(7 * g + 3 * t) % 250 + 5 for t in range(240)] for g in range(12)]


def load_trainer_model(path: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def reference_logprobs(
    model: PreTrainedModel, prompt: list[int], completion: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """transformers' log p(completion[t] | prefix) for each completion token."""
    ids = torch.tensor([prompt + completion])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def max_logprob_error(model: PreTrainedModel, rollouts: list[Rollout], temperature: float = 1.0) -> float:
    return max(
        (torch.tensor(r.logprobs) - reference_logprobs(model, r.prompt_ids, r.completion_ids, temperature))
        .abs().max().item()
        for r in rollouts
    )


@torch.no_grad()
def perturb_(model: PreTrainedModel, seed: int, scale: float = 0.05) -> None:
    """A stand-in for an optimizer step that changes every weight noticeably."""
    generator = torch.Generator().manual_seed(seed)
    for parameter in model.parameters():
        parameter.add_(scale * torch.randn(parameter.shape, generator=generator))


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@torch.no_grad()
def nudge_(model: torch.nn.Module, seed: int, only: str) -> None:
    """Move the parameters whose names hold ``only`` by seeded noise."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if only in name:
            param.add_(0.05 * torch.randn(param.shape, generator=generator))


def lora_trainer(path: Path, seed: int):
    """The trainer's model at ``path`` with a LoRA (r=16 on attention and MLP) whose weights are moved off zero."""
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(load_trainer_model(path), LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS))
    nudge_(policy, seed=seed, only="lora_")
    return policy.eval()


def merged_copy(policy: torch.nn.Module, path: Path) -> PreTrainedModel:
    """The base at ``path`` with ``policy``'s adapter merged in, as a merged sync sends it."""
    from lightning_rl.models.weights import iter_full_weights

    model = load_trainer_model(path)
    model.load_state_dict(dict(iter_full_weights(policy)), strict=False)  # the tied head follows the embedding
    return model


def check_adapter_refused_on_another_base(engine, policy: torch.nn.Module, path: Path, version: int) -> None:
    """Weights another run pushed (a server given by url): an adapter sent alone would apply to them, and is refused;
    then the base at ``path`` is pushed back as ``version``."""
    import pytest

    from lightning_rl.models.policy_sync import PolicySync
    from lightning_rl.models.weights import WeightMismatchError

    pushed = load_trainer_model(path)
    nudge_(pushed, seed=4, only="model.norm")
    PolicySync("full").sync(pushed, engine, version)
    with pytest.raises(WeightMismatchError, match="the base weights the engine holds are not the trainer's: the engine's 'model.norm.weight'"):
        PolicySync("adapter").sync(policy, engine, version)
    PolicySync("full").sync(load_trainer_model(path), engine, version)  # the base again
