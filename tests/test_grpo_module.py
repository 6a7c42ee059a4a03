"""GRPOModule on a real Trainer: the normaliser spans the whole optimizer step, and bad input fails
before training with an error that names what is wrong."""

from __future__ import annotations

import functools
import json
import logging
import shutil
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from transformers import AutoTokenizer
from support.grpo import FAST, LENGTH_REWARD, GradientRecorder, TrainedRollouts, fit
from support.grpo import trainer as trainer_of

from lightning_rl.data.prompts import PromptDataModule, PromptRenderer
from lightning_rl.errors import RecipeError
from lightning_rl.losses import GRPOLoss
from lightning_rl.models.loading import LoraSettings
from lightning_rl.modules.grpo import GRPOModule
from lightning_rl.rewards import RewardSpec
from lightning_rl.rollout.vllm_server import VLLMServerEngine
from lightning_rl.tools import Tool


# Every option whose normaliser spans the step (per-sequence and constant normalisers, sequence-level ratios and
# masks, the top-entropy threshold and the entropy bonus's token count) must not depend on how the step is cut
# into micro-batches, in the synchronous and the asynchronous trainer alike. The loss values themselves are
# checked against TRL in test_grpo_trl_fidelity.py.
MICRO_BATCH_CASES = [
    pytest.param(dict(loss_type="grpo"), "trainer", False, id="grpo"),
    pytest.param(dict(loss_type="dr_grpo"), "trainer", False, id="dr_grpo"),
    pytest.param(dict(loss_type="grpo", importance_sampling_level="sequence"), "engine", False, id="gspo"),
    pytest.param(dict(loss_type="sapo"), "engine", False, id="sapo"),
    pytest.param(dict(loss_type="cispo", epsilon_high=5.0), "engine", False, id="cispo"),
    pytest.param(dict(loss_type="vespo"), "engine", False, id="vespo"),
    pytest.param(dict(loss_type="luspo", importance_sampling_level="sequence"), "engine", False, id="luspo"),
    # The transformers engine samples with the trainer's own weights, so its log-probs differ from the trainer's by
    # float noise only: bounds away from that noise (what is masked is then the same however the step is cut).
    pytest.param(dict(loss_type="dapo", importance_sampling_cap=2.0, importance_sampling_floor=0.5,
                      importance_sampling_mode="sequence_mask", off_policy_mask_threshold=0.5), "trainer", False,
                 id="engine-correction-and-off-policy-mask"),
    pytest.param(dict(loss_type="grpo", top_entropy_quantile=0.5, entropy_coef=0.01), "trainer", False, id="top-entropy-bonus"),
    pytest.param(dict(loss_type="grpo", top_entropy_quantile=0.5, entropy_coef=0.01), "trainer", True, id="top-entropy-bonus-async"),
    pytest.param(dict(loss_type="grpo", importance_sampling_level="sequence"), "engine", True, id="gspo-async"),
]


@pytest.mark.parametrize("loss,old,async_mode", MICRO_BATCH_CASES)
def test_one_micro_batch_or_four_give_the_same_gradients(loss, old, async_mode):
    """The step in one row, in several rows, and (for each option) through the asynchronous trainer at staleness 0."""
    grads, rows, rollouts = [], [], []
    for max_tokens, background in ((None, async_mode), (48, async_mode), (48, not async_mode)):
        recorder, trained = GradientRecorder(), TrainedRollouts()
        module, trainer = fit(1, [recorder, trained], batch_size=4, loss=GRPOLoss(**loss), old_logprobs=old,
                              max_grad_norm=None, max_tokens_per_row=max_tokens, rewards=LENGTH_REWARD,
                              async_mode=background, max_staleness=0)  # fmt: skip
        grads.append(recorder.steps[0])
        rows.append(float(trainer.callback_metrics["train/rows"]))
        rollouts.append(trained.batches[0]["completions"])
    assert rows[0] == 1 and rows[1] >= 4 and rows[2] == rows[1], rows
    assert rollouts[0] == rollouts[1] == rollouts[2]  # the same rollouts, split differently
    for name, grad in grads[1].items():  # the other trainer, the same split: the same step, bit for bit
        torch.testing.assert_close(grads[2][name], grad, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    assert any(g.abs().sum() > 0 for g in grads[0].values())
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


class TrainedAdapter(L.Callback):
    """An adapter as training leaves it (B not 0), so that its dropout changes the policy's outputs."""

    def on_train_start(self, trainer: L.Trainer, module: GRPOModule) -> None:
        with torch.no_grad():
            for name, param in module.policy.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(0))


def test_under_dropout_the_training_forward_keeps_the_tokens_the_entropy_threshold_counted(monkeypatch):
    """The threshold comes from a forward of its own: each row's training forward draws the same dropout masks (TRL
    takes both from one forward). Otherwise another set of tokens trains, and the bonus's mean divides by a count
    that is not theirs."""
    kept = []
    reduce = GRPOLoss.reduce

    def recording(loss, terms, loss_seq, seq_tokens, counts):
        kept.append((int(terms.entropy_mask.sum()), counts.entropy_tokens))
        return reduce(loss, terms, loss_seq, seq_tokens, counts)

    monkeypatch.setattr(GRPOLoss, "reduce", recording)
    fit(1, [TrainedAdapter()], batch_size=4, loss=GRPOLoss(top_entropy_quantile=0.3, entropy_coef=0.01), old_logprobs="trainer",
        lora=LoraSettings(r=4, alpha=8, dropout=0.5), max_tokens_per_row=48, rewards=LENGTH_REWARD)  # fmt: skip
    assert len(kept) > 1 and len({counted for _, counted in kept}) == 1  # several rows, one count for the step
    assert sum(k for k, _ in kept) == kept[0][1]


def test_a_held_out_string_prompt_is_rendered_as_training_renders_one(tmp_path):
    """A chat model trains on string prompts rendered as a user turn after `system_prompt`; the held-out
    evaluation decodes its prompt/completion rows the same way, not as bare text."""
    from support.prompt_sources import PromptList

    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(json.dumps({"prompt": "2+2=", "completion": "4"}) + "\n")
    module = GRPOModule(num_generations=2, system_prompt="Answer with digits only.", eval_data=str(heldout), eval_generations=1)
    module.configure_model()
    prompts = PromptList([{"prompt": "2+2="}])
    trained = PromptRenderer(module.tokenizer, system_prompt="Answer with digits only.").render(prompts.records[0], prompts)
    assert module.eval_cases[0].prompt_ids == trained.ids and module.eval_cases[0].reference == "4"


def test_the_loss_group_reaches_the_step_and_its_mistakes_are_refused_by_key():
    """Options that change the step change its gradient; a wrong value is refused before any model loads."""
    recorders = {}
    for name, loss in {"plain": {}, "entropy_bonus": {"entropy_coef": 0.5}, "kl": {"beta": 0.5}}.items():
        recorders[name] = GradientRecorder()
        module, _ = fit(2, [recorders[name]], batch_size=2, rewards=LENGTH_REWARD, loss=loss)  # a mapping, as a recipe gives it
        assert isinstance(module.loss, GRPOLoss) and module.hparams["loss"]["entropy_coef"] == loss.get("entropy_coef", 0.0)
    plain = recorders["plain"].steps[1]  # the second step: at the first the policy is its reference, and the KL flat
    for name in ("entropy_bonus", "kl"):
        assert any(not torch.allclose(g, plain[n]) for n, g in recorders[name].steps[1].items()), name
    with pytest.raises(ValueError, match=r"^loss.top_entropy_quantile must be in \[0, 1\], got 2"):
        GRPOModule(loss={"top_entropy_quantile": 2})
    with pytest.raises(ValueError, match=r"^loss.entropy_cof: not a loss option"):
        GRPOModule(loss={"entropy_cof": 0.1})
    with pytest.raises(ValueError, match=r"^loss.importance_sampling_floor corrects trainer vs engine log-probs"):
        GRPOModule(loss={"importance_sampling_floor": 0.5}, old_logprobs="engine")


def test_one_generation_per_prompt_is_refused():
    with pytest.raises(ValueError, match="num_generations=1: GRPO needs G >= 2"):
        GRPOModule(num_generations=1)


def test_reward_path_that_does_not_import_is_refused():
    with pytest.raises(ValueError, match="reward function 'no_such_pkg.rewards:score': no module 'no_such_pkg' in .*the installed packages"):
        GRPOModule(rewards=[RewardSpec("no_such_pkg.rewards:score")])
    with pytest.raises(ValueError, match="has no 'missing'"):
        GRPOModule(rewards=[RewardSpec("lightning_rl.rewards.builtin:missing")])


def test_tool_with_invalid_schema_is_refused():
    def lookup(key: str) -> str:
        return key

    with pytest.raises(ValueError, match=r"tool 'lookup': invalid JSON Schema at properties/key/type"):
        Tool.from_function(lookup, parameters={"type": "object", "properties": {"key": {"type": "text"}}})


def test_prompts_without_the_field_are_refused(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps({"question": "2+2="}) + "\n")
    with pytest.raises(ValueError, match=r"prompts.jsonl: line 2: no field 'prompt' \(row has \['question'\]\)"):
        PromptDataModule(path=str(path)).setup("fit")
    # Every row's messages are checked as the data loads, as SFT checks them, not when (or if) a step draws them.
    user = {"role": "user", "content": "1+1="}
    for bad, said in (({"role": "robot", "content": "hi"}, "unknown role 'robot'"), ({"role": "user", "content": None}, "`content` must be a string"),
                      ({"role": "user", "content": [{"type": "input_text", "text": "hi"}]}, r"`prompt\[0\].content\[0\]` must be")):  # fmt: skip
        path.write_text("".join(json.dumps({"prompt": [user]}) + "\n" for _ in range(3)) + json.dumps({"prompt": [bad]}) + "\n")
        with pytest.raises(ValueError, match=rf"prompts.jsonl: line 4: `prompt\[0\]`.*{said}|prompts.jsonl: line 4: {said}"):
            PromptDataModule(path=str(path)).setup("fit")
    pictured = {"role": "assistant", "content": [{"type": "image", "image": "x.png"}]}  # found mid-run, in other words
    path.write_text(json.dumps({"prompt": [user]}) + "\n" + json.dumps({"prompt": [user, pictured, user]}) + "\n")
    with pytest.raises(ValueError, match=r"prompts.jsonl: line 2: `prompt\[1\].content\[0\]`: an image in an assistant turn"):
        PromptDataModule(path=str(path)).setup("fit")
    # One shape of prompt per file: a reward would read some steps' prompts as text and others' as messages.
    path.write_text(json.dumps({"prompt": [user]}) + "\n" + json.dumps({"prompt": "1+1="}) + "\n")
    with pytest.raises(ValueError, match=r"prompts.jsonl: line 2: field 'prompt' is a string, where .*prompts.jsonl: line 1 gives chat messages"):
        PromptDataModule(path=str(path)).setup("fit")


class EngineWeights(L.Callback):
    """The engine's weights at the end of training (the engine is closed when fit ends)."""

    def on_train_end(self, trainer: L.Trainer, pl_module: GRPOModule) -> None:
        self.version = pl_module.engine.weight_version
        self.q_proj = pl_module.engine.model.model.layers[0].self_attn.q_proj.weight.detach().clone()


def test_lora_policy_pushes_merged_weights_to_the_engine():
    engine = EngineWeights()
    module, _ = fit(2, [engine], lora=LoraSettings(r=4, alpha=8), weight_sync="merged", learning_rate=1e-2, rewards=LENGTH_REWARD)
    base = module.policy.get_base_model()
    q_proj = base.model.layers[0].self_attn.q_proj
    merged = q_proj.base_layer.weight + q_proj.scaling["default"] * q_proj.lora_B["default"].weight @ q_proj.lora_A["default"].weight
    assert engine.version == 2
    assert not torch.allclose(merged, q_proj.base_layer.weight)  # the adapter has learned something
    torch.testing.assert_close(engine.q_proj, merged.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("epochs,iterations,steps", [(1, 2, 4), (2, 1, 3)])
def test_max_epochs_alone_stops_a_grpo_run_after_that_many_passes_over_its_prompts(tmp_path, capsys, epochs, iterations, steps):
    """TRL's num_train_epochs maps to trainer.max_epochs; GRPO draws prompt batches without end, so it ran forever.
    6 prompts at 4 a batch: a pass is 1.5 batches, whole batches rounded up, each trained num_iterations steps."""
    data = tmp_path / "six.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(6)))
    module = GRPOModule(**{**FAST, "rewards": LENGTH_REWARD, "num_iterations": iterations})
    run = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    run.fit(module, PromptDataModule(train_data=str(data), batch_size=4))
    assert run.global_step == steps and run.max_steps == steps
    assert f"note: trainer.max_epochs={epochs}: {steps} optimizer steps" in capsys.readouterr().err
    if epochs == 1:  # given max_steps too, it stops there, as TRL's max_steps overrides num_train_epochs: said, not silent
        run = L.Trainer(max_epochs=1, max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
        run.fit(GRPOModule(**{**FAST, "rewards": LENGTH_REWARD}), PromptDataModule(train_data=str(data), batch_size=4))
        assert "note: trainer.max_epochs=1 is not used: a GRPO run given trainer.max_steps stops there" in capsys.readouterr().err
    with pytest.raises(RecipeError, match="a GRPO run stops at trainer.max_steps"):
        L.Trainer(max_epochs=-1, accelerator="cpu", logger=False, enable_checkpointing=False).fit(
            GRPOModule(**FAST, rewards=LENGTH_REWARD), PromptDataModule(train_data=str(data), batch_size=4))
    # Lightning's epoch would end at the limit: the note said 900 steps and the schedule spanned them, 3 ran.
    # A whole 1 is one batch too (it equalled the float 1.0 and got past: 1 step trained where the note said 3).
    for limit in (3, 1):
        with pytest.raises(RecipeError, match=f"trainer.limit_train_batches: {limit} cuts a GRPO run's epochs short"):
            L.Trainer(max_epochs=1, limit_train_batches=limit, accelerator="cpu", logger=False, enable_checkpointing=False).fit(
                GRPOModule(**FAST, rewards=LENGTH_REWARD), PromptDataModule(train_data=str(data), batch_size=4))
    # A fraction of an endless epoch, given max_steps too, was Lightning's exception and a traceback.
    for key in ("limit_train_batches", "val_check_interval"):
        with pytest.raises(RecipeError, match=f"trainer.{key}: 0.5 is a fraction of an epoch, but a GRPO run draws prompt batches without end"):
            L.Trainer(max_steps=2, **{key: 0.5}, accelerator="cpu", logger=False, enable_checkpointing=False).fit(
                GRPOModule(**FAST, rewards=LENGTH_REWARD), PromptDataModule(train_data=str(data), batch_size=4))


def test_a_lora_policy_exports_its_adapter_alone_when_asked(tmp_path):
    """``export: adapter`` writes the adapter as TRL saves a peft policy: loaded onto the base, it is the policy."""
    from peft import PeftModel

    from lightning_rl.models.loading import load_causal_lm
    from lightning_rl.models.paths import resolve_model_path

    module, _ = fit(1, [], lora=LoraSettings(r=4, alpha=8), export="adapter", learning_rate=1e-2, rewards=LENGTH_REWARD)
    folder = module.export_hf(tmp_path / "hf")
    assert (folder / "adapter_config.json").exists() and not (folder / "model.safetensors").exists()
    base = load_causal_lm(resolve_model_path("tiny")).eval()
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    with torch.no_grad():
        before = base(ids).logits
        exported = PeftModel.from_pretrained(base, folder).eval()
        torch.testing.assert_close(exported(ids).logits, module.policy.eval()(ids).logits, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(exported(ids).logits, before, atol=1e-4)  # the adapter carries what was learned
    with pytest.raises(RecipeError, match="export='adapter' needs a model.lora block"):
        GRPOModule(export="adapter")


class Snapshots(L.Callback):
    """The policy's and the reference's weights at the start and after every step."""

    def __init__(self) -> None:
        self.policy, self.reference = [], []

    def _take(self, pl_module) -> None:
        self.policy.append({n: p.detach().clone() for n, p in pl_module.policy.named_parameters()})
        self.reference.append({n: p.detach().clone() for n, p in pl_module.reference.named_parameters()})

    def on_train_start(self, trainer, pl_module) -> None:
        self._take(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._take(pl_module)


def test_the_reference_moves_towards_the_policy_every_n_steps():
    snapshots = Snapshots()
    fit(4, [snapshots], batch_size=2, rewards=LENGTH_REWARD, loss={"beta": 0.1}, ref_sync_every=2, ref_mixup_alpha=0.25)
    policy, reference = snapshots.policy, snapshots.reference
    want = dict(policy[0])  # the reference starts as the policy
    for step in range(1, 5):
        if step % 2 == 0:
            want = {n: 0.75 * want[n] + 0.25 * policy[step][n] for n in want}
        for name, value in reference[step].items():
            torch.testing.assert_close(value, want[name], rtol=1e-6, atol=1e-7, msg=lambda m: f"step {step} {name}: {m}")
    assert any(not torch.equal(reference[4][n], policy[0][n]) for n in want)
    with pytest.raises(ValueError, match="ref_sync_every: loss.beta is 0"):
        GRPOModule(ref_sync_every=2)
    with pytest.raises(ValueError, match=r"ref_sync_every: with lora the reference is the frozen base model, read as the policy with its adapters off"):
        GRPOModule(ref_sync_every=2, loss={"beta": 0.1}, lora={"r": 4})


def test_every_pass_over_a_batch_takes_the_kl_against_the_reference_of_its_first_pass(monkeypatch):
    """num_iterations=2 with ref_sync_every=1: the reference moves between the two passes; the second pass still
    takes the reference log-probs of the first (TRL takes them once per batch), and the reference forwards once."""
    seen, token_loss = [], GRPOLoss.token_loss

    def recording(self, *args, ref_logprobs=None, **kwargs):
        seen.append(ref_logprobs.detach().clone())
        return token_loss(self, *args, ref_logprobs=ref_logprobs, **kwargs)

    monkeypatch.setattr(GRPOLoss, "token_loss", recording)
    snapshots = Snapshots()
    fit(2, [snapshots], batch_size=2, rewards=LENGTH_REWARD, loss={"beta": 0.1}, num_iterations=2, ref_sync_every=1,
        ref_mixup_alpha=0.5, learning_rate=1e-2)
    assert any(not torch.equal(snapshots.reference[1][n], snapshots.reference[0][n]) for n in snapshots.reference[0])
    first, second = seen[: len(seen) // 2], seen[len(seen) // 2 :]
    assert len(first) == len(second) > 0
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def tied_on_odd_prompts(prompts: list[str], completions: list[str], **_) -> list[float]:
    """Ties within the group of every prompt of odd length (no signal there), differs elsewhere."""
    return [1.0 if len(p) % 2 else len(c) / 10 for p, c in zip(prompts, completions, strict=True)]


def always_one(completions: list[str], **_) -> list[float]:
    return [1.0] * len(completions)


@pytest.mark.parametrize("async_mode", [False, True])
def test_dynamic_sampling_trains_only_groups_with_signal_and_fills_the_batch(async_mode, caplog):
    trained = TrainedRollouts()
    module, trainer = fit(3, [trained], batch_size=4, rewards=[RewardSpec("test_grpo_module:tied_on_odd_prompts")],
                          dynamic_sampling=True, dynamic_sampling_max_rounds=8, async_mode=async_mode, max_staleness=0)  # fmt: skip
    last = module.last_trained
    assert len(last.records) == 4 and last.sampling_rounds > 1 and last.filtered_groups > 0
    for group in range(4):
        rewards = [last.rewards[i] for i, r in enumerate(last.rollouts) if r.group_id == group]
        assert len(rewards) == 4 and max(rewards) > min(rewards), rewards
    assert float(trainer.callback_metrics["train/dynamic_sampling/filtered_fraction"]) > 0
    # The same steps again draw the same extra prompts: a resumed run trains on what it would have.
    again = TrainedRollouts()
    fit(3, [again], batch_size=4, rewards=[RewardSpec("test_grpo_module:tied_on_odd_prompts")],
        dynamic_sampling=True, dynamic_sampling_max_rounds=8, async_mode=async_mode, max_staleness=0)  # fmt: skip
    assert [b["prompts"] for b in again.batches] == [b["prompts"] for b in trained.batches]


@pytest.mark.parametrize("prompts", [10, 5])
def test_dynamic_sampling_draws_new_prompts_round_after_round(tmp_path, prompts):
    """Each round's extra prompts are none of the step's and none an earlier round drew, while the data has others
    (10 prompts: 4 in the step, 6 others for three rounds of 2); then they are drawn again (5 prompts: 1 other)."""
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(prompts)))
    data = PromptDataModule(str(path), batch_size=4)
    step = [r["prompt"] for r in data.prompt_batch(1)]
    rounds = [[r["prompt"] for r in data.extra_prompts(1, drawn, 2)] for drawn in (0, 2, 4)]
    drawn = [p for r in rounds for p in r]
    others = prompts - 4
    assert not set(drawn[:others]) & set(step) and len(set(drawn[:others])) == len(drawn[:others]) == min(others, 6)
    assert rounds == [[r["prompt"] for r in data.extra_prompts(1, drawn, 2)] for drawn in (0, 2, 4)]  # a resume draws the same


def test_ranks_draw_other_extra_prompts(tmp_path):
    """Each rank's rounds draw prompts no other rank draws in the step, while the data has others (each rank drew
    from a generator of its own, and two could draw the same prompt)."""
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(64)))
    drawn = []
    for rank in range(4):
        data = PromptDataModule(str(path), batch_size=2)
        data.trainer = SimpleNamespace(global_rank=rank, world_size=4)  # the rank and world a Trainer gives
        drawn += [r["prompt"] for drawn_before in (0, 3) for r in data.extra_prompts(1, drawn_before, 3)]
    assert len(drawn) == len(set(drawn)) == 24


def test_dynamic_sampling_says_when_its_bound_is_hit(caplog):
    with caplog.at_level(logging.WARNING):
        module, trainer = fit(1, batch_size=2, rewards=[RewardSpec("test_grpo_module:always_one")],
                              dynamic_sampling=True, dynamic_sampling_max_rounds=3)  # fmt: skip
    assert "step 1: dynamic sampling found 0 of 2 groups with differing rewards after 3 rounds (dynamic_sampling_max_rounds); the step trains the first round's groups, whose advantages are all 0" in caplog.text
    assert module.last_trained.sampling_rounds == 3 and module.last_trained.filtered_groups == 6
    assert float(trainer.callback_metrics["train/dynamic_sampling/filtered_fraction"]) == 1.0  # every group sampled tied


class StepMetrics(L.Callback):
    """Every step's logged clip fraction and mean ratio."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = trainer.callback_metrics
        self.steps.append({k: float(metrics[f"train/{k}"]) for k in ("clip/fraction", "ratio/mean")})


def test_several_passes_over_a_batch_take_the_ratio_against_the_sampling_policy():
    """num_iterations=2: each batch trains two optimizer steps; the second's ratio is against the policy that
    sampled (so it moves and, with a tight clip range, clipping bites); new weights reach the engine per batch."""
    trained, metrics = TrainedRollouts(), StepMetrics()
    module, trainer = fit(4, [trained, metrics], batch_size=2, rewards=LENGTH_REWARD, num_iterations=2,
                          loss={"epsilon_low": 1e-3, "epsilon_high": 1e-3}, learning_rate=1e-2)  # fmt: skip
    assert [b["index"] for b in module.trained_batches] == [0, 0, 1, 1]
    assert [b["iteration"] for b in module.trained_batches] == [0, 1, 0, 1]
    assert trained.batches[0]["completions"] == trained.batches[1]["completions"] != trained.batches[2]["completions"]
    assert module.engine.weight_version == 2 and trainer.global_step == 4
    first_pass, second_pass = metrics.steps[0], metrics.steps[1]
    assert first_pass["ratio/mean"] == pytest.approx(1.0, abs=1e-6) and first_pass["clip/fraction"] == 0
    assert second_pass["clip/fraction"] > 0 and second_pass["ratio/mean"] != pytest.approx(1.0, abs=1e-6)


def test_a_resume_inside_a_batchs_passes_finishes_them_exactly(tmp_path):
    whole = GradientRecorder()
    reference, _ = fit(4, [whole], batch_size=2, rewards=LENGTH_REWARD, num_iterations=2, max_grad_norm=None)
    first = GradientRecorder()
    _, trainer = fit(3, [first], batch_size=2, rewards=LENGTH_REWARD, num_iterations=2, max_grad_norm=None)
    checkpoint = tmp_path / "step3.ckpt"
    trainer.save_checkpoint(checkpoint)  # after the first pass over batch 1
    saved = torch.load(checkpoint, weights_only=True)
    assert saved["grpo"]["per_rank"][0]["batch"]["index"] == 1 and saved["written_by"]["task"] == "GRPOModule"  # an SFT run refuses it
    second = GradientRecorder()
    resumed, _ = fit(4, [second], batch_size=2, rewards=LENGTH_REWARD, num_iterations=2, max_grad_norm=None,
                     ckpt_path=str(checkpoint))  # fmt: skip
    assert [b["index"] for b in resumed.trained_batches] == [0, 0, 1, 1]
    for name, grad in whole.steps[3].items():
        torch.testing.assert_close(second.steps[0][name], grad, rtol=0, atol=0, msg=name)


def test_several_passes_are_the_same_in_the_asynchronous_trainer():
    grads = []
    for async_mode in (False, True):
        recorder = GradientRecorder()
        fit(4, [recorder], batch_size=2, rewards=LENGTH_REWARD, num_iterations=2, async_mode=async_mode, max_staleness=0)
        grads.append(recorder.steps)
    for step, (sync, background) in enumerate(zip(*grads, strict=True)):
        for name, grad in sync.items():
            torch.testing.assert_close(background[name], grad, rtol=0, atol=0, msg=f"step {step} {name}")


class EntropyLog(L.Callback):
    def __init__(self) -> None:
        self.entropy, self.coef, self.bonus = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = trainer.callback_metrics
        self.entropy.append(float(metrics["train/entropy"]))
        self.coef.append(float(metrics["train/entropy_coef"]))
        self.bonus.append(float(metrics["train/policy_loss"]) - float(metrics["train/loss"]))  # TRL's policy_loss: no bonus


def test_adaptive_entropy_control_follows_its_rule_and_gates_the_bonus():
    """The coefficient after each step is the rule applied to that step's mean entropy (TRL's: up by delta at or
    below the target, down otherwise, clamped); the bonus acts only after a step at or below the target."""
    log_, recorder = EntropyLog(), GradientRecorder()
    target = 5.824  # within the tiny model's entropies of these steps (5.835 falling to 5.817), so the controller goes both ways
    loss = {"adaptive_entropy": True, "entropy_coef": 0.05, "entropy_coef_delta": 0.02, "entropy_target": target,
            "entropy_coef_max": 0.08}  # fmt: skip
    module, _ = fit(5, [log_, recorder], batch_size=2, rewards=LENGTH_REWARD, loss=loss)
    coef, applied = 0.05, 0.0
    for step, entropy in enumerate(log_.entropy):
        assert log_.bonus[step] == pytest.approx(applied * entropy, rel=1e-4, abs=1e-7), step  # the bonus this step took
        coef = min(coef + 0.02, 0.08) if entropy <= target else max(coef - 0.02, 0.0)
        applied = coef if entropy <= target else 0.0
        assert log_.coef[step] == pytest.approx(coef), step
    assert any(log_.bonus) and not all(log_.bonus), "the bonus must apply on some steps and not on others"
    assert min(log_.entropy) <= target < max(log_.entropy), "the controller must go both ways"
    assert module.entropy_control.last_entropy == pytest.approx(log_.entropy[-1], rel=1e-5)
    # The first step has no earlier entropy: no bonus, so its gradient is the plain loss's.
    plain = GradientRecorder()
    fit(1, [plain], batch_size=2, rewards=LENGTH_REWARD)
    for name, grad in plain.steps[0].items():
        torch.testing.assert_close(recorder.steps[0][name], grad, rtol=0, atol=0)


def test_option_combinations_that_make_no_sense_are_one_line_naming_the_key():
    cases = [
        (dict(num_iterations=2, async_mode=True, max_staleness=1, old_logprobs="trainer", loss={"importance_sampling_cap": 2.0}),
         "num_iterations=2 with async_mode and max_staleness=1"),
        (dict(loss={"loss_type": "luspo"}), "loss.importance_sampling_level must be 'sequence' for loss_type='luspo'"),
        (dict(loss={"loss_type": "vespo", "importance_sampling_level": "sequence"}),
         "loss.importance_sampling_level must be 'token' for loss_type='vespo'"),
        (dict(reward_aggregation="normalize_then_sum", scale_rewards="batch"), "scale_rewards='batch' with reward_aggregation"),
        (dict(dynamic_sampling=True, num_generations=1), "num_generations=1: GRPO needs G >= 2"),
        (dict(packing="none", prefix_across_rows="always"), "prefix_across_rows: always shares a prompt across packed rows, but packing: none"),
        (dict(rewards=[{"function": "reward_model", "kwargs": {"path": "/no/such/reward/model"}}]),
         "reward 'reward_model': cannot be built from kwargs"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError) as caught:
            GRPOModule(**kwargs)
        assert message in str(caught.value) and "\n" not in str(caught.value), (kwargs, str(caught.value))


def test_truncated_completions_can_be_left_out_of_the_loss():
    """mask_truncated_completions: a completion cut at max_new_tokens trains no token, but still counts in its
    group's advantages; with every completion cut (max_new_tokens=1), nothing is trained at all."""
    recorder = GradientRecorder()
    # seed 1: none of the untrained model's 8 one-token replies is an end token, so every one is cut
    module, trainer = fit(1, [recorder], batch_size=2, rewards=LENGTH_REWARD, sampling={"max_new_tokens": 1}, mask_truncated_completions=True, seed=1)
    assert all(r.finish_reason == "length" for r in module.last_trained.rollouts)
    assert float(trainer.callback_metrics["train/trained_tokens"]) == 0
    assert float(trainer.callback_metrics["train/completions/truncated_fraction"]) == 1.0
    assert all(g.abs().sum() == 0 for g in recorder.steps[0].values())
    recorder = GradientRecorder()
    fit(1, [recorder], batch_size=2, rewards=LENGTH_REWARD, sampling={"max_new_tokens": 1}, seed=1)
    assert any(g.abs().sum() > 0 for g in recorder.steps[0].values())  # the same step, trained on
    # An entropy bonus over the top-entropy tokens of a step that trains none: a step of loss 0, as TRL's.
    _, trainer = fit(1, [], batch_size=2, rewards=LENGTH_REWARD, sampling={"max_new_tokens": 1}, mask_truncated_completions=True,
                     loss={"top_entropy_quantile": 0.5, "entropy_coef": 0.01}, seed=1)
    assert float(trainer.callback_metrics["train/loss"]) == 0.0 and trainer.global_step == 1


class HalfFinished(GRPOModule):
    """Says every other rollout ended on its own: the untrained tiny model hardly ever ends a reply by itself."""

    def on_fit_start(self):
        super().on_fit_start()
        collect = self.collector.collect

        def half_finished(index):
            scored = collect(index)
            for i, rollout in enumerate(scored.rollouts):
                rollout.finish_reason = "stop" if i % 2 else "length"
            return scored

        self.collector.collect = half_finished


def test_only_the_truncated_completions_are_left_out():
    from support.grpo import FAST, trainer as make_trainer
    from lightning_rl.data.prompts import PromptDataModule as Prompts

    L.seed_everything(0, verbose=False)
    module = HalfFinished(**{**FAST, "rewards": LENGTH_REWARD, "mask_truncated_completions": True})
    run = make_trainer(1)
    run.fit(module, Prompts(batch_size=2))
    finished = [r for r in module.last_trained.rollouts if r.finish_reason == "stop"]
    assert len(finished) * 2 == len(module.last_trained.rollouts)
    assert float(run.callback_metrics["train/trained_tokens"]) == sum(len(r.completion_ids) for r in finished)
    assert float(run.callback_metrics["train/completions/truncated_fraction"]) == 0.5


def test_engine_options_are_checked_against_the_engines_signature_before_any_model_loads():
    """A Python caller's engine is checked as the module is built (a recipe's already when it is parsed:
    ``test_user_errors``); the error carries the recipe key."""
    cases = [
        ({"class_path": "hf", "init_args": {"devise": "cpu"}}, "engine.init_args.devise",
         "devise: not an option of HFRolloutEngine (it takes device, dtype, pad_token_id, eos_token_id, verify_weights)"),
        ({"class_path": "vllm", "init_args": {"gpu_memory_utilization": "high"}}, "engine.init_args.gpu_memory_utilization",
         "gpu_memory_utilization: Expected a"),
        (functools.partial(VLLMServerEngine, transprt="gloo"), "engine.init_args.transprt", "transprt: not an option of VLLMServerEngine"),
        ({"class_path": "hf", "init_args": {"seed": 3}}, "engine.init_args.seed", "seed: set by the run"),
        ("vlm", "engine", "rollout engine 'vlm' is neither one of hf, vllm, vllm_server (or HFRolloutEngine, VLLMEngine, VLLMServerEngine) nor a dotted path"),
        ("collections.OrderedDict", "engine", "rollout engine 'collections.OrderedDict' is not a RolloutEngine subclass"),
    ]
    for engine, key, message in cases:
        with pytest.raises(RecipeError) as caught:
            GRPOModule(engine=engine)
        assert caught.value.key == key and str(caught.value).startswith(message), (caught.value.key, str(caught.value))
    for name in ("vllm", "VLLMEngine"):  # a class name, as a recipe may write it, from Python too
        module = GRPOModule(engine={"class_path": name, "init_args": {"dtype": "bfloat16", "max_model_len": 512}})  # nothing of vLLM loads
        assert module.engine is None
        assert module.hparams["engine"] == {"class_path": "lightning_rl.rollout.vllm_engine.VLLMEngine",
                                            "init_args": {"dtype": "bfloat16", "max_model_len": 512}}  # fmt: skip
    assert GRPOModule(engine=module.hparams["engine"]).engine_spec == module.engine_spec  # a checkpoint's hparams rebuild it


def test_rollouts_of_a_base_tokenizer_with_a_chatml_template_end_at_the_templates_end_of_turn(tiny_path, tmp_path):
    """A base model's tokenizer ends text with ``<|endoftext|>`` (its generation config names nothing else), while its
    ChatML template ends each reply with ``<|im_end|>``: the engines went on sampling past ``<|im_end|>``, so the
    policy was trained on text after its own end of turn. A reply now ends at the first ``<|im_end|>`` it samples."""
    folder = tmp_path / "base"
    shutil.copytree(tiny_path, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.eos_token = "<|endoftext|>"
    tokenizer.save_pretrained(folder)
    endoftext, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": endoftext}))
    rollouts = TrainedRollouts()
    # Hot sampling of an untrained model: about one token in 500 is <|im_end|>, 4,096 tokens are sampled.
    fit(1, [rollouts], batch_size=4, model_name_or_path=str(folder), num_generations=16,
        sampling={"max_new_tokens": 64, "temperature": 3.0}, rewards=LENGTH_REWARD)  # fmt: skip
    completions = rollouts.batches[0]["completions"]
    ended = [ids for ids in completions if im_end in ids]
    assert ended, "no rollout sampled <|im_end|>"
    assert all(ids.index(im_end) == len(ids) - 1 for ids in ended)


def test_prompts_given_from_python_as_a_dataset_or_rows_train_as_a_file_of_them_does(tmp_path):
    """TRL users hand GRPO a `datasets.Dataset`; it crashed in pathlib (SFT reads one). Its rows, a list of rows and a
    JSONL file of them give the same first step's rewards, and a bad row is named by its position."""
    import datasets
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 6), (7, 1)]]
    file = tmp_path / "p.jsonl"
    file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    rewards = []
    for source in (datasets.Dataset.from_list(rows), rows, str(file)):
        L.seed_everything(0, verbose=False)
        module = GRPOModule(**{**FAST, "rewards": LENGTH_REWARD})
        data = PromptDataModule(train_data=source, batch_size=2)
        trainer_of(1).fit(module, data)
        rewards.append(module.last_trained.rewards)
    assert rewards[0] == rewards[1] == rewards[2]
    with pytest.raises(Exception, match=r"^data.train_data \(list\): row 2: no field 'prompt'"):
        PromptDataModule(train_data=[rows[0], {"question": "1+1="}]).setup()


class RatesTaken(L.Callback):
    """The learning rate each optimizer step takes, and the `train/lr` logged for that step."""

    def __init__(self) -> None:
        self.taken: list[float] = []
        self.logged: list[float] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.taken.append(optimizer.param_groups[0]["lr"])

    def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
        self.logged.append(float(trainer.callback_metrics["train/lr"]))


def test_the_logged_learning_rate_is_the_one_the_step_took():
    """It was read after the scheduler had moved on: the next step's rate, one step late (TRL logs the step's own)."""
    rates = RatesTaken()
    fit(3, [rates], warmup_steps=2, lr_schedule="linear", learning_rate=2e-3, rewards=LENGTH_REWARD)
    assert rates.taken == pytest.approx([0.0, 1e-3, 2e-3])
    assert rates.logged == pytest.approx(rates.taken)


SCORED: list[int] = []


def counted_length(completions: list[str], **_: Any) -> list[float]:
    SCORED.append(len(completions))
    return [float(len(c)) for c in completions]


def test_a_model_tree_packing_refuses_is_refused_before_a_step_is_generated_and_scored(tiny_path, tmp_path):
    """Attention dropout (which tree attention does not apply) was refused in the first training forward, after the
    engine was built and a whole step generated and scored."""
    from lightning_rl.attention.tree_attention import PackingRefused

    folder = tmp_path / "dropout"
    shutil.copytree(tiny_path, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    SCORED.clear()
    with pytest.raises(PackingRefused, match="applies attention dropout 0.1; tree attention does not: set the model's attention_dropout to 0"):
        fit(1, model_name_or_path=str(folder), rewards=[RewardSpec("test_grpo_module:counted_length")])
    assert SCORED == []


def test_a_key_whose_switch_is_off_is_said_to_be_unused(capsys):
    """A setting that only acts beside another (dynamic sampling's rounds, held-out data, adaptive entropy's bounds)
    given alone was ignored without a word."""
    from lightning_rl.losses import GRPOLoss

    GRPOModule(dynamic_sampling_max_rounds=8, eval_data="toy", loss=GRPOLoss(entropy_coef_max=0.5, entropy_target=0.3))
    assert capsys.readouterr().err.splitlines() == [
        "note: dynamic_sampling_max_rounds is set, but dynamic_sampling is False, so it is not used",
        "note: eval_data is set, but eval_generations is 0, so it is not used",
        "note: loss.entropy_coef_max, loss.entropy_target are set, but loss.adaptive_entropy is off, so not used",
    ]
    GRPOModule(dynamic_sampling=True, dynamic_sampling_max_rounds=8, eval_data="toy", eval_generations=2,
               loss=GRPOLoss(adaptive_entropy=True, entropy_coef_max=0.5))  # fmt: skip
    assert "note:" not in capsys.readouterr().err


def test_load_from_checkpoint_gives_the_trained_weights(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning.pytorch import Trainer

    module = GRPOModule(**{**FAST, "rewards": LENGTH_REWARD})
    Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)]).fit(module, PromptDataModule(batch_size=2))  # fmt: skip
    loaded = GRPOModule.load_from_checkpoint(tmp_path / "last.ckpt")
    theirs = dict(module.policy.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in loaded.policy.named_parameters())
    exported = loaded.export_hf(tmp_path / "hf")  # from a script, with no Trainer: the model's own tokenizer
    assert (exported / "tokenizer_config.json").exists() and "for 1 optimizer steps" in (exported / "README.md").read_text()


def test_a_module_fitted_again_starts_a_run_of_its_own():
    """Its summary counted the first fit's steps and its 'before training' figure was the first fit's."""
    module, _ = fit(2, eval_data="toy", eval_generations=1, eval_max_new_tokens=2)
    first = module.heldout_before
    assert first is not None and module.summary_metrics()["grpo_steps"] == 2
    trainer_of(1).fit(module, PromptDataModule(batch_size=2))
    assert module.heldout_before is not first and module.summary_metrics()["grpo_steps"] == 1
    assert [batch["index"] for batch in module.trained_batches] == [0]


def test_a_packing_refusal_during_training_names_the_unpacked_way(monkeypatch):
    """A row refused in the middle of a run (not by the check before it) says, as that check's refusal does, that
    ``model.packing: none`` trains the model one rollout a row."""
    from lightning_rl.attention.tree_attention import PackingRefused

    def refuses(*args, **kwargs):
        raise PackingRefused("SomeModel: this row's layout is not computed exactly")

    monkeypatch.setattr("lightning_rl.modules.grpo.packed_logprobs", refuses)  # what a model's row can raise mid-run
    with pytest.raises(PackingRefused, match=r"not computed exactly; model\.packing: none trains it one rollout a row"):
        fit(1)


def test_a_resume_under_a_trainer_of_ones_own_with_another_prompt_batch_size_is_refused(tmp_path):
    """Step i takes prompts i * batch_size on: under another batch size a resumed run trained on other prompts than
    the uninterrupted one, silently (the command named the recipe key)."""
    from lightning_rl.errors import BatchingChanged
    from support.grpo import DIGIT_REWARDS

    _, run = fit(1)
    run.save_checkpoint(tmp_path / "one.ckpt")
    with pytest.raises(BatchingChanged, match=r"^data\.batch_size=3 here, 2 in the run: the run being resumed cut"):
        trainer_of(2).fit(GRPOModule(**{**FAST, "rewards": DIGIT_REWARDS}), PromptDataModule(batch_size=3), ckpt_path=tmp_path / "one.ckpt")


def test_held_out_prompts_are_evaluated_every_val_check_interval_steps(tmp_path):
    """TRL's eval_steps: a whole trainer.val_check_interval evaluates eval_data every that many steps, besides before
    training and at its end (it was taken and did nothing); without eval_generations it is refused in one line."""
    from lightning.pytorch.loggers import CSVLogger

    L.seed_everything(0, verbose=False)
    module = GRPOModule(**{**FAST, "rewards": LENGTH_REWARD}, eval_data="toy", eval_generations=1, eval_max_new_tokens=2)
    trainer_of(5, logger=CSVLogger(tmp_path), val_check_interval=2).fit(module, PromptDataModule(batch_size=2))
    rows = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    steps = lambda key: [int(row.split(",")[rows[0].split(",").index("step")]) for row in rows[1:] if row.split(",")[rows[0].split(",").index(key)]]  # noqa: E731
    # after steps 2 and 4 (logged where their figures are: 1 and 3), the end's is summary.json's; before training under
    # its own name (at 0, where step 1's figures are: under one name, W&B kept one of them)
    assert steps("val/exact_match") == [1, 3] and steps("val/exact_match_before") == [0]
    with pytest.raises(RecipeError, match=r"trainer.val_check_interval=2: a GRPO run evaluates held-out prompts .* only with model.eval_generations"):
        trainer_of(1, val_check_interval=2).fit(GRPOModule(**FAST, rewards=LENGTH_REWARD), PromptDataModule(batch_size=2))


def test_a_resume_that_starts_evaluating_has_no_before_training_figure(tmp_path):
    """Held-out prompts first evaluated on a resume were scored on the checkpoint's weights and called 'before training'."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    trainer_of(1, callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)], enable_checkpointing=True).fit(
        GRPOModule(**FAST, rewards=LENGTH_REWARD), PromptDataModule(batch_size=2))
    resumed = GRPOModule(**FAST, rewards=LENGTH_REWARD, eval_data="toy", eval_generations=1, eval_max_new_tokens=2)
    trainer_of(2).fit(resumed, PromptDataModule(batch_size=2), ckpt_path=tmp_path / "last.ckpt")
    summary = resumed.summary_metrics()
    assert resumed.heldout_before is None and summary["heldout_exact_match_before"] is None and summary["heldout_exact_match"] is not None


def test_a_prompt_column_beside_another_prompt_field_is_left_to_the_prompt_read(tmp_path):
    """ultrachat's layout (a `prompt` string beside `messages`) read through data.prompt_field=messages: the prompt
    read takes the name, and rewards get neither (as TRL gives a `prompt` column to none)."""
    rows = tmp_path / "p.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}],
                                "prompt": "1+1=", "prompt_id": "a"}) + "\n")
    data = PromptDataModule(train_data=str(rows), prompt_field="messages")
    data.setup()
    assert data.records[0]["prompt"] == [{"role": "user", "content": "1+1="}] and data.columns() == {"messages", "prompt", "prompt_id"}


def wants_completion(completions, completion):
    return [float(c == r) for c, r in zip(completions, completion)]


def test_a_completion_column_is_not_given_to_rewards_as_trl_gives_none(tmp_path):
    """TRL passes rewards every column but the prompt and a `completion` column; the latter reached rewards here."""
    rows = tmp_path / "p.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{k}+1=", "completion": str(k + 1)}) + "\n" for k in range(4)))
    module = GRPOModule(**{**FAST, "rewards": [RewardSpec("test_grpo_module:wants_completion")]})
    with pytest.raises(Exception, match=r"reward 'wants_completion' needs 'completion': a data column of that name is not given to rewards, as TRL gives none"):
        trainer_of(1).fit(module, PromptDataModule(train_data=str(rows), batch_size=2))
