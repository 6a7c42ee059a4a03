"""Across data-parallel ranks the GRPO normaliser counts every rank's sequences and tokens: two gloo
ranks training on their own rollouts give the gradient of one process training on all of them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_rl.losses import GRPOLoss, StepCounts, group_advantages
from lightning_rl.modules.grpo import GRPOModule
from lightning_rl.rollout.base import Rollout
from lightning_rl.rollout.vllm_server_process import free_port

HERE = Path(__file__).parent


# dapo's normaliser is the step's token count over all ranks, which differs from any rank's own
# count; (bnpo normalises per rank by design, so it is not expected to match.)
@pytest.mark.parametrize("loss_type", ["dapo"])
def test_two_ranks_give_the_gradient_of_one_process_on_all_rollouts(tmp_path, tiny_path, loss_type):
    # tiny_path builds the shared model cache first, so the two ranks only read it.
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONPATH": str(HERE)}
    subprocess.run([sys.executable, str(HERE / "grpo_ddp_worker.py"), str(tmp_path), loss_type], env=env,
                   check=True, timeout=600, cwd=HERE.parent)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert ranks[0]["prompts"] != ranks[1]["prompts"]  # each rank trained its own prompts

    rollouts, rewards, groups = [], [], []
    for rank, saved in enumerate(ranks):
        for r in saved["rollouts"]:
            rollouts.append(Rollout(**r))
            groups.append(rank * 100 + r["group_id"])
        rewards += saved["rewards"]
    module = GRPOModule(num_generations=4, max_new_tokens=6, loss=GRPOLoss(loss_type))
    module.configure_model()
    advantages = group_advantages(torch.tensor(rewards), torch.tensor(groups))
    packed = module.pack_rollouts(rollouts, advantages)
    terms, _ = module.row_loss(packed)
    tokens = sum(sum(r.completion_mask) for r in rollouts)
    counts = StepCounts(num_sequences=len(rollouts), num_tokens=tokens, rank_tokens=tokens, max_completion_length=6)
    seq_tokens = torch.bincount(packed.loss_seq, minlength=len(rollouts))
    (terms.loss * module.loss.token_weights(packed.loss_seq, seq_tokens, counts)).sum().backward()

    assert any(g.abs().sum() > 0 for g in ranks[0]["grads"].values())
    for name, param in module.named_parameters():
        torch.testing.assert_close(ranks[0]["grads"][name], param.grad, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(ranks[1]["grads"][name], param.grad, rtol=1e-4, atol=1e-7)
