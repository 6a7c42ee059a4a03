"""Trainer equals sampler, measured every step: the engine-vs-trainer figures of a real GRPO step equal the ones
computed by hand from the same batch, the alarm stops a run whose engine holds other weights (and not a healthy
one), a batch that can be stale is trained against the sampler's log-probs by default, and router replay runs
through GRPO (the tiny mixture-of-experts recipe logs a route agreement of 1.0).

Real Trainer runs of the tiny models with the real transformers engine; the only stand-in is an engine whose
weights are moved off the trainer's after each (verified) push, the fault the alarm is for."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from support.grpo import fit

from lightning_rl.errors import RecipeError
from lightning_rl.models.routing import RouterReplayError
from lightning_rl.modules.grpo import GRPOModule
from lightning_rl.modules.mismatch import MismatchAlarm
from lightning_rl.rewards import RewardSpec
from lightning_rl.rollout.base import Rollout
from lightning_rl.rollout.hf import HFRolloutEngine

REPO = Path(__file__).resolve().parents[1]
# Token ids differ between almost any two samples of the tiny model, so every group carries a gradient.
SPREAD_REWARD = [RewardSpec("test_mismatch:token_spread")]


def token_spread(completion_ids: list[list[int]], **_) -> list[float]:
    return [float(sum(ids) % 13) for ids in completion_ids]


class DriftedEngine(HFRolloutEngine):
    """The transformers engine, whose weights move off the trainer's right after each push has been verified: it
    samples from other weights than it was sent."""

    def push_weights(self, named_tensors, version: int) -> None:
        super().push_weights(named_tensors, version)
        g = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _trained_logprobs(module: GRPOModule, rollout: Rollout) -> torch.Tensor:
    """The policy's log-probs of a rollout's trained tokens, from a plain forward of the sequence alone."""
    ids = torch.tensor([rollout.sequence])
    logits = module.policy(input_ids=ids).logits[0, :-1].float() / module._temperature()
    logprobs = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return logprobs[len(rollout.prompt_ids) - 1 :][torch.tensor(rollout.completion_mask)]


def _engine_logprobs(rollout: Rollout) -> torch.Tensor:
    return torch.tensor(rollout.logprobs)[torch.tensor(rollout.completion_mask)]


class ByHand(L.Callback):
    """Before each optimizer step (the weights still those of the step's forward): the step's gradient, its batch's
    staleness, the mismatch figures by hand, and the gradient of the clipped loss by hand against the sampler's
    log-probs (``corrected``) and against the trainer's own (``on_policy``)."""

    def __init__(self, cap: float | None = None, floor: float | None = None) -> None:
        self.cap, self.floor = cap, floor
        self.steps: list[dict] = []

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        params = [p for p in module.policy.parameters() if p.requires_grad]
        grads = [p.grad.detach().clone() for p in params]
        scored = module.current_batch
        advantages = module._advantages(scored)
        trainer_lp = [_trained_logprobs(module, r) for r in scored.rollouts]
        engine_lp = [_engine_logprobs(r) for r in scored.rollouts]
        d = torch.cat([t.detach() for t in trainer_lp]).double() - torch.cat(engine_lp).double()
        ratio = d.exp()
        cap = math.inf if self.cap is None else self.cap
        floor = -math.inf if self.floor is None else self.floor
        tokens = sum(len(t) for t in trainer_lp)

        def dapo_gradient(old: list[torch.Tensor]) -> list[torch.Tensor]:
            loss = 0.0
            for lp, o, a in zip(trainer_lp, old, advantages.tolist(), strict=True):
                r = torch.exp(lp - o)
                loss = loss - torch.min(r * a, r.clamp(0.8, 1.2) * a).sum() / tokens
            return list(torch.autograd.grad(loss, params, retain_graph=True))

        self.steps.append({
            "grads": grads, "staleness": scored.index - scored.weight_version, "kl": float((ratio - d - 1).mean()),
            "ratio_mean": float(ratio.mean()), "ratio_min": float(ratio.min()), "ratio_max": float(ratio.max()),
            "corrected_fraction": float(((ratio < floor) | (ratio > cap)).double().mean()),
            # TRL's sampling_logp_difference and importance_sampling_ratio (the weights as applied: truncated)
            "logp_diff_mean": float(d.abs().mean()), "logp_diff_max": float(d.abs().max()),
            "is_ratio_mean": float(ratio.clamp(floor, cap).mean()), "is_ratio_min": float(ratio.clamp(floor, cap).min()),
            "is_ratio_max": float(ratio.clamp(floor, cap).max()),
            "corrected": dapo_gradient(engine_lp), "on_policy": dapo_gradient([t.detach() for t in trainer_lp]),
        })  # fmt: skip

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.steps[-1]["logged"] = dict(module._mismatch)


def _distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return float(sum((x - y).double().pow(2).sum() for x, y in zip(a, b, strict=True)).sqrt())


def test_the_step_logs_the_figures_computed_by_hand_from_its_batch():
    """An engine off the trainer's weights, the correction on with bounds it crosses: every figure as by hand."""
    by_hand = ByHand(cap=1.1, floor=0.9)
    fit(2, [by_hand], batch_size=2, rewards=SPREAD_REWARD, engine=DriftedEngine, mismatch_alarm_kl=None,
        loss={"importance_sampling_cap": 1.1, "importance_sampling_floor": 0.9, "importance_sampling_mode": "token_truncate"}, max_grad_norm=None)  # fmt: skip
    for step in by_hand.steps:
        logged = step["logged"]
        assert step["staleness"] == 0 and logged["offpolicy/kl"] == 0.0
        assert step["kl"] > 1e-2 and 0 < step["corrected_fraction"] < 1, step  # a real mismatch, partly corrected
        assert step["is_ratio_max"] == pytest.approx(1.1) and step["ratio_max"] > 1.1  # the cap bounds what the loss applied
        for name in ("kl", "ratio_mean", "ratio_min", "ratio_max", "corrected_fraction", "logp_diff_mean", "logp_diff_max", "is_ratio_mean",
                     "is_ratio_min", "is_ratio_max"):  # fmt: skip
            assert logged[f"mismatch/{name}"] == pytest.approx(step[name], rel=1e-4, abs=1e-7), name
        assert "mismatch/route_agreement" not in logged  # a dense model


def test_the_alarm_stops_a_run_whose_engine_holds_other_weights_before_its_first_update():
    with pytest.raises(MismatchAlarm) as caught:
        fit(2, batch_size=2, rewards=SPREAD_REWARD, engine=DriftedEngine)
    line = caught.value.line()
    assert line.startswith("mismatch_alarm_kl: train/mismatch/kl is") and "\n" not in line
    for cause in ("weights not synced", "chat template or tokenizer", "dtype", "not replayed"):
        assert cause in line
    assert caught.value.exit_code == 1


def test_the_alarm_names_a_sampling_setting_the_trainer_does_not_replay_first():
    with pytest.raises(MismatchAlarm) as caught:
        fit(1, batch_size=2, rewards=SPREAD_REWARD, sampling={"max_new_tokens": 6, "repetition_penalty": 1.5}, mismatch_alarm_kl=1e-7)
    assert "likely causes: model.sampling.repetition_penalty=1.5, which the engine applies and the trainer does not replay" in caught.value.line()


def test_a_lora_with_dropout_is_named_and_not_judged_by_the_alarm():
    """The trainer's forward applies the LoRA's dropout and the engine's does not: the figure then measures that, so
    the alarm (which stopped such runs, blaming the sync) leaves it alone; the cause is named."""
    from lightning_rl.models.loading import LoraSettings
    from lightning_rl.modules.mismatch import unreplayed

    module, _ = fit(2, batch_size=2, rewards=SPREAD_REWARD, lora=LoraSettings(r=4, alpha=8, dropout=0.5), mismatch_alarm_kl=1e-9)
    assert module._mismatch["mismatch/kl"] > 1e-9  # measured, logged, not alarmed on
    assert unreplayed(module.sampling, module.policy) == "model.lora.dropout=0.5, which the trainer's forward applies and the engine's does not"


def test_a_healthy_run_measures_no_mismatch_and_no_alarm():
    module, _ = fit(2, batch_size=2, rewards=SPREAD_REWARD)
    assert module._mismatch["mismatch/kl"] < 1e-8 and module._mismatch["mismatch/ratio_mean"] == pytest.approx(1, abs=1e-5)
    assert module._mismatch["mismatch/corrected_fraction"] == 0.0  # the correction is off by default


@pytest.mark.parametrize("bound", [0, -1e-3, float("nan"), float("inf"), True, "1e-2"])
def test_an_alarm_bound_that_is_not_a_finite_positive_number_is_refused(bound):
    with pytest.raises(RecipeError) as caught:
        GRPOModule(mismatch_alarm_kl=bound)
    assert caught.value.key == "mismatch_alarm_kl" and "\n" not in str(caught.value)
    GRPOModule(mismatch_alarm_kl=None)  # null: no alarm


def test_batches_that_can_be_stale_take_the_samplers_logprobs_by_default():
    source = lambda **kwargs: GRPOModule(**kwargs).hparams.old_logprobs  # noqa: E731
    assert source() == "trainer" and source(async_mode=True, max_staleness=0) == "trainer"
    assert source(async_mode=True, max_staleness=1) == "engine"
    assert source(async_mode=True, loss={"importance_sampling_cap": 2.0}) == "trainer"  # the correction weighs the lag
    with pytest.raises(RecipeError) as caught:
        GRPOModule(async_mode=True, max_staleness=1, old_logprobs="trainer")
    assert caught.value.key == "old_logprobs" and "ignore_staleness" in str(caught.value)
    assert source(async_mode=True, old_logprobs="trainer", ignore_staleness=True) == "trainer"  # opted out by name


def test_a_stale_batchs_gradient_is_the_clipped_ratio_against_the_sampler():
    """Asynchronous, one version of lag allowed, every default: a stale batch's gradient is the clipped ratio
    p_now / p_sampler's, not the on-policy one's; its lag is logged apart from the mismatch."""
    by_hand = ByHand()
    fit(4, [by_hand], batch_size=2, rewards=SPREAD_REWARD, async_mode=True, max_staleness=1, max_grad_norm=None,
        learning_rate=1e-2)  # fmt: skip
    for step in by_hand.steps:
        assert _distance(step["grads"], step["corrected"]) <= 1e-4 * _distance(step["grads"], [0 * g for g in step["grads"]])
    stale = [s for s in by_hand.steps if s["staleness"] == 1 and _distance(s["grads"], [0 * g for g in s["grads"]]) > 0]
    assert stale, [s["staleness"] for s in by_hand.steps]
    for step in stale:
        assert _distance(step["grads"], step["on_policy"]) > 100 * _distance(step["grads"], step["corrected"])
        assert "mismatch/kl" not in step["logged"] and step["logged"]["offpolicy/kl"] == pytest.approx(step["kl"], rel=1e-4)
        assert step["kl"] > 1e-6  # the weights moved between sampling and training


class Figures(L.Callback):
    def __init__(self) -> None:
        self.steps: list[tuple[int, dict]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.steps.append((module.last_trained.index - module.last_trained.weight_version, dict(module._mismatch)))


def test_router_replay_runs_through_grpo_in_asynchronous_mode_and_is_refused_for_a_dense_model():
    """Batches of the trainer's own weights agree on every route; a stale one measures how far the trainer's own
    choice has moved since (its routes are still the engine's: replayed, the loss is the sampler's computation)."""
    figures = Figures()
    module, _ = fit(3, [figures], batch_size=2, rewards=SPREAD_REWARD, model_name_or_path="tiny-moe", async_mode=True,
                    max_staleness=1, sampling={"max_new_tokens": 4})  # fmt: skip
    assert module.engine.record_routes and module.route_layers == 2
    assert all(r.routes is not None for r in module.last_trained.rollouts)
    assert [s for s, _ in figures.steps].count(1) >= 1
    for staleness, logged in figures.steps:
        agreement = logged["mismatch/route_agreement"]
        assert agreement == 1.0 if staleness == 0 else 0 < agreement <= 1.0
        assert logged["mismatch/kl"] < 1e-8 if staleness == 0 else logged["offpolicy/kl"] > 0
    with pytest.raises(RouterReplayError) as caught:
        fit(1, batch_size=2, rewards=SPREAD_REWARD, router_replay=True)
    assert "dense model" in str(caught.value) and caught.value.key == "router_replay"


def test_the_tiny_moe_recipe_logs_every_mismatch_figure_and_a_route_agreement_of_one(tmp_path):
    out = tmp_path / "run"
    cmd = [str(Path(sys.executable).parent / "lightning-rl"), "run", "recipes/tiny/grpo_moe.yaml", f"--output_dir={out}",
           "--trainer.max_steps=2"]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    (metrics,) = out.glob("csv/*/metrics.csv")
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("train/mismatch/kl")]
    assert len(rows) == 2
    for row in rows:
        assert float(row["train/mismatch/route_agreement"]) == 1.0
        assert float(row["train/mismatch/kl"]) < 1e-8 and float(row["train/offpolicy/kl"]) == 0.0
        for name in ("ratio_mean", "ratio_min", "ratio_max"):
            assert float(row[f"train/mismatch/{name}"]) == pytest.approx(1.0, abs=1e-5)
        assert float(row["train/mismatch/corrected_fraction"]) == 0.0


def logs_at_the_first_step(completions, trainer_state, log_metric, **_):
    if trainer_state.global_step == 0:
        log_metric("first_step_only", 123.0)
    return [len(c) / 10 for c in completions]


def test_a_figure_logged_at_some_steps_is_absent_from_the_others(tmp_path):
    """Lightning logs each training figure logged so far at every later step of the epoch; a figure of some steps (the
    mismatch of a fresh batch, a reward's metric) is absent where they did not log it, not repeated from the last."""
    from lightning.pytorch.loggers import CSVLogger

    from lightning_rl.data.prompts import PromptDataModule
    from support.grpo import FAST

    L.seed_everything(0, verbose=False)
    module = GRPOModule(**{**FAST, "rewards": [RewardSpec("test_mismatch:logs_at_the_first_step")], "async_mode": True,
                           "max_staleness": 1})  # fmt: skip
    run = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=CSVLogger(tmp_path, name="csv"), log_every_n_steps=1,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    run.fit(module, PromptDataModule(batch_size=2))
    (metrics,) = tmp_path.glob("csv/*/metrics.csv")
    rows = [row for row in csv.DictReader(metrics.open()) if row.get("train/rollout/staleness")]
    assert [row["train/rollout/staleness"] for row in rows] == ["0.0", "1.0", "1.0"]  # batch 0 of the first weights
    assert [bool(row["train/mismatch/kl"]) for row in rows] == [True, False, False]  # a stale batch's is offpolicy/kl
    assert [row["train/reward_metric/first_step_only"] for row in rows] == ["123.0", "", ""]


@pytest.mark.parametrize("mode", ["sequence_truncate", "sequence_mask"])
def test_in_the_sequence_modes_the_applied_weights_are_one_per_sequence(mode):
    """TRL's importance_sampling_ratio figures at sequence level: over sequences, each its weight as the loss applied
    it (capped, or 0 where masked); the logp difference stays per token."""
    from lightning_rl.losses import GRPOLoss
    from lightning_rl.modules.mismatch import MismatchStats

    seq = torch.tensor([0, 0, 0, 1, 1, 2])
    trainer = torch.tensor([-1.0, -0.5, -2.0, -0.3, -0.7, -1.2], dtype=torch.float64)
    d = torch.tensor([0.3, 0.2, 0.1, -0.4, -0.2, 0.05], dtype=torch.float64)
    loss = GRPOLoss(importance_sampling_cap=1.5, importance_sampling_mode=mode)
    terms = loss.token_loss(trainer, trainer, torch.ones(6, dtype=torch.float64), engine_logprobs=trainer - d, loss_seq=seq,
                            seq_num_tokens=torch.bincount(seq))  # fmt: skip
    stats = MismatchStats(corrects=True)
    stats.add(trainer, trainer - d, terms)
    figures = stats.metrics(lambda tensor, reduce_op: tensor, torch.device("cpu"), staleness=0, alarm_kl=None)
    per_sequence = torch.tensor([0.6, -0.6, 0.05], dtype=torch.float64).exp()  # e^0.6 = 1.82 is past the cap
    applied = per_sequence.clamp(max=1.5) if mode == "sequence_truncate" else per_sequence.masked_fill(per_sequence > 1.5, 0.0)
    assert figures["mismatch/is_ratio_mean"] == pytest.approx(float(applied.mean()))
    assert (figures["mismatch/is_ratio_min"], figures["mismatch/is_ratio_max"]) == pytest.approx((float(applied.min()), float(applied.max())))
    assert (figures["mismatch/logp_diff_mean"], figures["mismatch/logp_diff_max"]) == pytest.approx((float(d.abs().mean()), 0.4))


def test_a_step_that_trains_no_token_logs_each_mismatch_figure_as_0():
    from lightning_rl.modules.mismatch import MismatchStats

    figures = MismatchStats(corrects=True).metrics(lambda tensor, reduce_op: tensor, torch.device("cpu"), staleness=0, alarm_kl=1e-2)
    assert figures == {f"mismatch/{name}": 0.0 for name in ("ratio_mean", "ratio_min", "ratio_max", "corrected_fraction", "logp_diff_mean",
                                                           "logp_diff_max", "is_ratio_mean", "is_ratio_min", "is_ratio_max", "kl")} | {"offpolicy/kl": 0.0}  # fmt: skip


def test_a_routers_noise_in_training_is_named_as_dropout_is():
    """Mixtral multiplies its router's input by noise in training (router_jitter_noise): the trainer's forward drew it,
    the engine's did not, and the alarm blamed the sync with replay on."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from lightning_rl.modules.mismatch import unreplayed

    def mixtral(noise: float) -> MixtralForCausalLM:
        return MixtralForCausalLM(MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                                num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1, router_jitter_noise=noise))  # fmt: skip

    sampling = GRPOModule().sampling
    assert unreplayed(sampling, mixtral(0.5)) == "the router's noise (the model's router_jitter_noise=0.5), which the trainer's forward applies and the engine's does not"
    assert unreplayed(sampling, mixtral(0.0)) is None
