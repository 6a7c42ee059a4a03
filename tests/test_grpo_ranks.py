"""Across data-parallel ranks the GRPO normaliser counts every rank's sequences and tokens: two gloo
ranks training on their own rollouts give the gradient of one process training on all of them."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lightning_rl.losses import StepCounts, group_advantages
from lightning_rl.losses.advantages import normalize_then_sum
from lightning_rl.modules.grpo import GRPOModule
from lightning_rl.rollout.base import Rollout
from lightning_rl.rollout.vllm_server_process import free_port

HERE = Path(__file__).parent


DIGITS_AND_LENGTH = [{"function": "support.grpo:text_length"}, {"function": "support.grpo:digit_count", "weight": 2.0}]
# A reward that returns None for some samples (so ranks score different numbers) and logs figures of its own.
LENGTH_AND_SOMETIMES = [{"function": "support.grpo:text_length"}, {"function": "support.grpo:length_or_none", "weight": 0.0}]


# Every statistic that spans the step is taken over both ranks: dapo's token count, the std of every reward of the
# step (scale_rewards: batch), GDPO's step normalisation, the top-entropy threshold. (bnpo normalises per rank by
# design, so it is not expected to match.)
@pytest.fixture(scope="module")
def ends_early(tmp_path_factory, tiny_path) -> str:
    """The tiny model made likely to end a reply early (it never does), so ranks train different numbers of tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, model, tokenizer = tmp_path_factory.mktemp("ends_early"), AutoModelForCausalLM.from_pretrained(tiny_path), AutoTokenizer.from_pretrained(tiny_path)
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] += 0.1  # every token carries a little of one direction ...
        model.get_output_embeddings().weight[tokenizer.eos_token_id, 0] = 6.0  # ... that the end of text reads
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize(
    "options",
    [
        {"loss": {"loss_type": "dapo"}, "model_name_or_path": "ENDS_EARLY", "mask_truncated_completions": True},
        {"scale_rewards": "batch", "rewards": LENGTH_AND_SOMETIMES},
        {"reward_aggregation": "normalize_then_sum", "rewards": DIGITS_AND_LENGTH},
        {"loss": {"loss_type": "grpo", "top_entropy_quantile": 0.5}},
        {"strategy": "fsdp2", "loss": {"beta": 0.1}, "ref_sync_every": 1},  # the reference refreshed from sharded weights
        # Rows of 48 tokens: the ranks' rollouts of unlike lengths need unlike numbers of rows, and the rank with fewer
        # runs empty ones (their pad token was counted in train/flat_tokens and train/rows).
        {"model_name_or_path": "ENDS_EARLY", "max_tokens_per_row": 48, "prefix_across_rows": "never"},
        # A prompt forwarded once across its group's rows: its backward runs after theirs, and DDP reduces once after both.
        {"model_name_or_path": "ENDS_EARLY", "max_tokens_per_row": 48, "prefix_across_rows": "always", "loss": {"beta": 0.1}},
        # DDP's static graph fixes how often each gradient is reduced: each row's backward is reduced, and auto keeps sub-groups.
        {"strategy": "ddp_static", "model_name_or_path": "ENDS_EARLY", "max_tokens_per_row": 48},
    ],
    ids=["dapo", "batch-std", "normalize-then-sum", "top-entropy", "fsdp2-reference-refresh", "rows-per-rank", "prefix-across-rows", "static-graph-rows"],
)
def test_two_ranks_give_the_gradient_of_one_process_on_all_rollouts(tmp_path, tiny_path, ends_early, options):
    # tiny_path builds the shared model cache first, so the two ranks only read it.
    options = {key: ends_early if value == "ENDS_EARLY" else value for key, value in options.items()}
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONPATH": str(HERE)}
    subprocess.run([sys.executable, str(HERE / "support" / "grpo_ddp_worker.py"), str(tmp_path), json.dumps(options)], env=env,
                   check=True, timeout=600, cwd=HERE.parent)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert ranks[0]["prompts"] != ranks[1]["prompts"]  # each rank trained its own prompts

    rollouts, rewards, groups, terms_by_reward = [], [], [], {}
    for rank, saved in enumerate(ranks):
        for r in saved["rollouts"]:
            rollouts.append(Rollout(**r))
            groups.append(rank * 100 + r["group_id"])
        rewards += saved["rewards"]
        for name, values in saved["reward_terms"].items():
            terms_by_reward.setdefault(name, []).extend(values)
    module = GRPOModule(num_generations=4, sampling={"max_new_tokens": 6}, **{k: v for k, v in options.items() if k not in ("rewards", "strategy")})
    module.configure_model()
    if options.get("reward_aggregation") == "normalize_then_sum":
        weights = torch.tensor([spec.get("weight", 1.0) for spec in options["rewards"]])
        per_function = torch.tensor([terms_by_reward[name] for name in ("text_length", "digit_count")]).T
        advantages = normalize_then_sum(per_function, weights, torch.tensor(groups))
    else:
        advantages = group_advantages(torch.tensor(rewards), torch.tensor(groups), options.get("scale_rewards", "group"))
    scored_rollouts = rollouts
    if options.get("mask_truncated_completions"):
        rollouts = [replace(r, completion_mask=[False] * len(r.completion_ids)) if r.finish_reason == "length" else r for r in rollouts]
    packed = module.pack_rollouts(rollouts, advantages)
    terms, entropy = module.row_loss(packed)  # one row of every rollout: its entropy quantile is the step's
    tokens = sum(sum(r.completion_mask) for r in rollouts)
    counts = StepCounts(num_sequences=len(rollouts), num_tokens=tokens, rank_tokens=tokens, max_completion_length=6)
    seq_tokens = torch.bincount(packed.loss_seq, minlength=len(rollouts))
    module.loss.reduce(terms, packed.loss_seq, seq_tokens, counts).backward()

    # The step's reward figures are over both ranks' samples (each rank's mean and std averaged was neither), and
    # every rank's log_metric names are logged under their own names, one rank's alone too.
    for prefix, values in [("train/reward", rewards), *((f"train/reward/{name}", v) for name, v in terms_by_reward.items())]:
        present = torch.tensor([v for v in values if v == v], dtype=torch.float64)
        for rank in ranks:
            assert rank["logged"][f"{prefix}/mean" if prefix != "train/reward" else "train/reward/mean"] == pytest.approx(float(present.mean()))
            assert rank["logged"][f"{prefix}/std"] == pytest.approx(float(present.std()) if len(present) > 1 else math.nan, nan_ok=True)
    if "length_or_none" in terms_by_reward:
        assert ranks[0]["logged"]["train/reward_metric/shared_a"] == pytest.approx(150.0)
        assert ranks[0]["logged"]["train/reward_metric/shared_b"] == pytest.approx(1.5)
        assert ranks[0]["logged"]["train/reward_metric/rank0_only"] == pytest.approx(7.0)
        assert ranks[0]["logged"]["train/reward_metric/parse_errors"] == pytest.approx(2.0)  # a mean, whatever its name
    # Per-token and per-rollout figures are the sums over both ranks divided once (each rank's mean averaged weighed a
    # rank of fewer tokens as much as one of more), as one process logs them.
    lengths = [sum(r.completion_mask) for r in scored_rollouts]
    if "model_name_or_path" in options:  # the ranks train different numbers of tokens
        assert len({sum(len(r["completion_ids"]) for r in rank["rollouts"] if r["finish_reason"] != "length") for rank in ranks}) == 2
    ended = [length for length, r in zip(lengths, scored_rollouts) if r.finish_reason != "length"]
    expected = {"train/entropy": float(entropy.mean()), "train/ratio/mean": float(terms.ratio.mean()),
                "train/completions/mean_length": sum(lengths) / len(lengths),
                "train/completions/truncated_fraction": sum(r.finish_reason == "length" for r in rollouts) / len(rollouts),
                "train/flat_tokens": sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts),
                "train/completions/mean_terminated_length": sum(ended) / len(ended) if ended else 0.0,
                "train/completions/min_terminated_length": min(ended, default=0), "train/completions/max_terminated_length": max(ended, default=0)}  # fmt: skip
    for rank in ranks:
        assert {key: rank["logged"][key] for key in expected} == pytest.approx(expected, rel=1e-5)
        assert rank["summary_losses"] == [pytest.approx(rank["logged"]["train/loss"], rel=1e-6)]  # summary.json's: each rank's was its own
    assert any(g.abs().sum() > 0 for g in ranks[0]["grads"].values())
    for name, param in ((name, param) for name, param in module.named_parameters() if param.requires_grad):  # not the reference's
        torch.testing.assert_close(ranks[0]["grads"][name], param.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")  # float32 sums in another order
        torch.testing.assert_close(ranks[1]["grads"][name], param.grad, rtol=1e-4, atol=1e-6)


def test_a_prefix_across_rows_is_refused_under_fsdp2(tmp_path, tiny_path):
    """FSDP2 gathers and reduces each layer's shards in every forward and backward, in step with the other ranks; a
    span adds a forward and a backward of its prefix on the ranks that have one. `always` is refused in one line (and
    `auto` keeps sub-groups)."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONPATH": str(HERE)}
    options = {"strategy": "fsdp2", "max_tokens_per_row": 48, "prefix_across_rows": "always"}
    done = subprocess.run([sys.executable, str(HERE / "support" / "grpo_ddp_worker.py"), str(tmp_path), json.dumps(options)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=HERE.parent)  # fmt: skip
    assert done.returncode != 0 and not (tmp_path / "rank0.pt").exists()
    assert "prefix_across_rows) under FSDP2, whose every forward and backward gathers" in done.stderr, done.stderr[-3000:]
    assert "set model.prefix_across_rows: never" in done.stderr


def test_a_reward_failing_on_every_sample_of_one_rank_only_trains_on(tmp_path, tiny_path):
    """A step spans every rank: a reward that fails on all of one rank's samples and scores the other's is no stop
    (reward_all_failed). Judged per rank, it stopped the run where one process, on the same samples, trained on."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    options = {"rewards": [{"function": "support.grpo:text_length"}, {"function": "support.grpo:fails_on_rank_zero"}]}
    done = subprocess.run([sys.executable, str(HERE / "support" / "grpo_ddp_worker.py"), str(tmp_path), json.dumps(options)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=HERE.parent)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [rank["logged"]["train/reward/fails_on_rank_zero/errors"] for rank in ranks] == [8.0, 8.0]  # rank 0's 8 of the 16


def test_two_ranks_stopped_inside_a_batch_resume_each_its_own_rollouts(tmp_path, tiny_path):
    """Each rank trains its own prompts: a checkpoint taken between the num_iterations passes of a batch keeps every
    rank's batch and old log-probs. It kept rank 0's, which every rank then trained on; the resume now equals the
    uninterrupted run."""
    from safetensors.torch import load_file

    from support.recipe_runs import run_on_two

    recipe = str(HERE.parent / "recipes" / "tiny" / "grpo.yaml")
    common = ("--trainer.max_steps=4", "--model.num_iterations=2", "--model.num_generations=4", "--model.sampling.max_new_tokens=6",
              "--data.batch_size=1", "--model.rewards=[{function: support.grpo:text_length}]", "--model.learning_rate=1e-2",
              "--trainer.strategy=ddp", "--logger.kind=none", "--trainer.enable_progress_bar=false", "--model.eval_generations=0")  # fmt: skip
    done = run_on_two(recipe, tmp_path / "whole", *common)
    assert done.returncode == 0, done.stderr[-3000:]
    stopped = run_on_two(recipe, tmp_path / "stopped", *common, "--trainer.callbacks+=test_sft_resume.SigtermAtStep", "--trainer.callbacks.step=1")
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    resumed = run_on_two(recipe, tmp_path / "stopped", *common, "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    whole, again = load_file(tmp_path / "whole" / "hf" / "model.safetensors"), load_file(tmp_path / "stopped" / "hf" / "model.safetensors")
    assert any(not torch.equal(whole[name], tensor) for name, tensor in load_file(tiny_path / "model.safetensors").items() if name in whole)
    for name, tensor in whole.items():
        torch.testing.assert_close(again[name], tensor, rtol=0, atol=1e-6, msg=name)
