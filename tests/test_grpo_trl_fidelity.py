"""Fidelity to TRL 1.16: on one batch (same rollouts, advantages, old and reference log-probs) our
tree-packed GRPO loss and its gradients equal what TRL's `GRPOTrainer._compute_loss` computes on
the same batch, padded and unpacked, for each loss type. TRL is a test-only reference."""

from __future__ import annotations

import copy

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer  # the reference: trl==1.16.0 from the dev extra

from lightning_rl.losses import StepCounts
from lightning_rl.toy.model import tiny_model_path
from lightning_rl.modules.grpo import GRPOModule
from lightning_rl.rollout.base import Rollout

G = 3
MAX_NEW = 6
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def model_path():
    return tiny_model_path()


def _rollouts(vocab: int) -> list[Rollout]:
    """Two prompts of different lengths, G completions each of different lengths (one is empty
    of trained tokens past the first), with made-up engine log-probs."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, vocab, (5,), generator=gen).tolist(), torch.randint(10, vocab, (8,), generator=gen).tolist()]
    rollouts = []
    for g, prompt in enumerate(prompts):
        for k in range(G):
            length = [MAX_NEW, 3, 1][k] if g == 0 else [4, MAX_NEW, 5][k]
            completion = torch.randint(10, vocab, (length,), generator=gen).tolist()
            engine = (-3.0 - torch.rand(length, generator=gen)).tolist()
            rollouts.append(Rollout(prompt, completion, engine, weight_version=0, group_id=g))
    return rollouts


def _padded(rollouts: list[Rollout], pad: int) -> dict[str, torch.Tensor]:
    """TRL's batch layout: prompts left-padded, completions right-padded."""
    width_p = max(len(r.prompt_ids) for r in rollouts)
    width_c = max(len(r.completion_ids) for r in rollouts)
    out = {
        "prompt_ids": torch.full((len(rollouts), width_p), pad),
        "prompt_mask": torch.zeros(len(rollouts), width_p, dtype=torch.long),
        "completion_ids": torch.full((len(rollouts), width_c), pad),
        "completion_mask": torch.zeros(len(rollouts), width_c, dtype=torch.long),
        "sampling_per_token_logps": torch.zeros(len(rollouts), width_c),
    }
    for i, r in enumerate(rollouts):
        p, c = len(r.prompt_ids), len(r.completion_ids)
        out["prompt_ids"][i, width_p - p:] = torch.tensor(r.prompt_ids)
        out["prompt_mask"][i, width_p - p:] = 1
        out["completion_ids"][i, :c] = torch.tensor(r.completion_ids)
        out["completion_mask"][i, :c] = 1
        out["sampling_per_token_logps"][i, :c] = torch.tensor(r.logprobs)
    return out


@torch.no_grad()
def _unpacked_logprobs(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per completion token log-probs from a plain padded forward (an independent reference)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float() / TEMPERATURE
    width_c = batch["completion_ids"].size(1)
    logp = torch.log_softmax(logits[:, -width_c - 1:-1], -1)
    return logp.gather(-1, batch["completion_ids"][..., None])[..., 0]


CASES = [
    pytest.param("grpo", 0.0, "trainer", None, True, id="grpo"),
    pytest.param("dapo", 0.0, "trainer", None, True, id="dapo"),
    pytest.param("grpo", 0.05, "engine", None, True, id="grpo-kl-clipped"),
    pytest.param("bnpo", 0.05, "engine", None, False, id="bnpo-plain-kl-clipped"),
    pytest.param("dr_grpo", 0.05, "trainer", 1.5, True, id="dr_grpo-kl-is"),
]


@pytest.mark.parametrize("loss_type,beta,old,is_cap,kl_correction", CASES)
def test_loss_and_gradients_match_trl(model_path, tmp_path, loss_type, beta, old, is_cap, kl_correction):
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ours = GRPOModule(
        model_name_or_path=str(model_path), num_generations=G, max_new_tokens=MAX_NEW, temperature=TEMPERATURE,
        loss_type=loss_type, beta=beta, epsilon_low=0.2, epsilon_high=0.28, old_logprobs=old,
        importance_sampling_cap=is_cap, kl_bias_correction=kl_correction,
    )
    ours.configure_model()
    if ours.reference is not None:  # a reference that differs from the policy, so the KL term matters
        with torch.no_grad():
            for p in ours.reference.parameters():
                p.add_(0.05 * torch.randn_like(p))
    theirs_model = copy.deepcopy(ours.policy)

    rollouts = _rollouts(len(tokenizer))
    advantages = torch.tensor([1.0, -0.5, -0.5, 0.3, 1.2, -1.5])
    batch = _padded(rollouts, tokenizer.pad_token_id)
    # Computed before our packed forward switches the models to tree attention.
    ref_logprobs = _unpacked_logprobs(ours.reference, batch) if beta else None
    trainer_logprobs = _unpacked_logprobs(theirs_model, batch)

    packed = ours.pack_rollouts(rollouts, advantages)
    terms, _ = ours.row_loss(packed)
    tokens = int(batch["completion_mask"].sum())
    counts = StepCounts(num_sequences=len(rollouts), num_tokens=tokens, rank_tokens=tokens, max_completion_length=MAX_NEW)
    seq_tokens = torch.bincount(packed.loss_seq, minlength=len(rollouts))
    our_loss = (terms.loss * ours.loss.token_weights(packed.loss_seq, seq_tokens, counts)).sum()
    our_loss.backward()

    config = GRPOConfig(
        output_dir=str(tmp_path), loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=0.28,
        num_generations=G, per_device_train_batch_size=len(rollouts), max_completion_length=MAX_NEW,
        temperature=TEMPERATURE, report_to=[], use_cpu=True, bf16=False,  # fp32 on both sides
        vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=is_cap or 3.0,
        use_bias_correction_kl=kl_correction,
    )
    trainer = GRPOTrainer(
        model=theirs_model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=config,
        train_dataset=Dataset.from_list([{"prompt": "x"}] * len(rollouts)), processing_class=tokenizer,
    )
    trainer.current_gradient_accumulation_steps = 1
    inputs = {**batch, "advantages": advantages, "num_items_in_batch": torch.tensor(float(tokens))}
    if old == "engine":
        inputs["old_per_token_logps"] = batch["sampling_per_token_logps"]
    if beta:
        inputs["ref_per_token_logps"] = ref_logprobs
    if is_cap is not None:
        # TRL applies this correction only with vLLM; the ratio itself is given as its generation step builds it.
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
        inputs["importance_sampling_ratio"] = torch.exp(
            (trainer_logprobs - batch["sampling_per_token_logps"]) * batch["completion_mask"]
        ).clamp(max=is_cap)
    their_loss = trainer._compute_loss(trainer.model, inputs)
    their_loss.backward()

    if old == "engine":
        assert float(terms.low_clipped.sum() + terms.high_clipped.sum()) > 0, "the clipped branch must be exercised"
    torch.testing.assert_close(our_loss, their_loss.float(), rtol=1e-5, atol=1e-6)
    theirs = dict(trainer.model.named_parameters())
    compared = 0
    for name, param in ours.policy.named_parameters():
        torch.testing.assert_close(param.grad, theirs[name].grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        compared += 1
    assert compared > 10
