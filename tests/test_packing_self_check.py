"""The packing self-checks fire: the probe when tree attention is first used on a model, and ``verify_packing`` on a
real row of a training step, each fed a deliberately broken attention (a real Trainer run for the latter)."""

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from support.tiny_models import build
from support.trees import NESTED, leaky_beyond
from support.paths import TOY_HELDOUT, TOY_TRAIN

from support.grpo import FAST, DIGIT_REWARDS
from lightning_rl.attention import tree_attention
from lightning_rl.attention.tree_attention import PackingRefused
from lightning_rl.data.prompts import PromptDataModule
from lightning_rl.data.sft import SFTDataModule
from lightning_rl.modules.grpo import GRPOModule
from lightning_rl.modules.sft import SFTModule
from lightning_rl.ops import packed_forward
from lightning_rl.ops.packed_forward import PackingVerifier, packed_logprobs, probe, probe_sequences, verify_row
from lightning_rl.packing import pack_sequences

def test_probe_refuses_a_leaking_attention_with_the_measured_error(monkeypatch):
    model = build("qwen3")
    monkeypatch.setattr(tree_attention, "attend_tree", leaky_beyond(0))
    with pytest.raises(PackingRefused, match=r"Qwen3ForCausalLM: the packing self-check measured packed log-probs \d\.\d\de[-+]\d\d away .*blocks attention, float32, tolerance 1e-04"):
        packed_logprobs(model, pack_sequences(NESTED))


def test_probe_passes_an_exact_model_once_per_backend_and_restores_train_mode(monkeypatch):
    model = build("qwen3").train()
    calls = []
    monkeypatch.setattr(packed_forward, "probe", lambda *a: calls.append(a[1]) or probe(*a))
    batch = pack_sequences(NESTED)
    for backend in ("blocks", "blocks", "dense", "blocks"):
        packed_logprobs(model, batch, attention_backend=backend)
    assert calls == ["blocks", "dense"]
    assert model.training and all(m.training for m in model.modules())
    error, dtype, _ = probe(model, "blocks", torch.device("cpu"))
    assert error < 1e-5 and dtype == torch.float32


def test_probe_sequences_fork_and_avoid_special_tokens():
    model = build("muse_spark")  # an image-text model: its placeholder ids would make it expect pixels
    seqs = probe_sequences(model.config)
    specials = packed_forward._special_token_ids(model.config)
    assert specials and not specials & {t for s in seqs for t in s}
    batch = pack_sequences(seqs)
    assert batch.num_unique_tokens < batch.num_flat_tokens  # shared prefixes, so the tree is really exercised
    assert int(batch.position_ids[-1]) < batch.num_tokens - 1  # the last root sits far from its depth


def test_verify_row_measures_real_rows_and_fires_past_the_probe(monkeypatch):
    model = build("llama")
    rows = [list(range(3, 3 + 30)), list(range(3, 3 + 20)) + [40, 41, 42], [50, 51, 52, 53, 54, 55]]
    batch = pack_sequences(rows)
    error, dtype, _ = verify_row(model, batch)
    assert error < 1e-5 and dtype == torch.float32
    monkeypatch.setattr(tree_attention, "attend_tree", leaky_beyond(20))  # the probe's rows are shorter: it passes
    packed_logprobs(model, pack_sequences(NESTED))
    error, *_ = verify_row(model, batch)
    assert error > 1e-3
    verifier = PackingVerifier("first_step")
    with pytest.raises(PackingRefused, match=r"verify_packing at step 0: packed log-probs are .* stopped before any weight changed"):
        verifier.check(model, batch, step=0, backend="blocks")


def test_verifier_schedule():
    first, every, never = PackingVerifier("first_step"), PackingVerifier("every_n_steps", every=3), PackingVerifier("never")
    due = lambda v: [s for s in range(8) if v.due(s) and not v.__setattr__("last_step", s)]  # noqa: E731
    assert due(first) == [0] and due(every) == [0, 3, 6] and due(never) == []
    resumed = PackingVerifier("first_step")
    assert resumed.due(5)  # a resumed run checks its first step too
    with pytest.raises(ValueError, match="verify_packing must be"):
        PackingVerifier("sometimes")
    with pytest.raises(ValueError, match="verify_packing_every"):
        PackingVerifier("every_n_steps", every=0)


def _trainer(**kwargs):
    return Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   limit_val_batches=0, **kwargs)  # fmt: skip


def test_sft_run_stops_before_any_weight_changes(tiny_path, monkeypatch):
    module = SFTModule(learning_rate=1e-2)
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    monkeypatch.setattr(tree_attention, "attend_tree", leaky_beyond(40))
    with pytest.raises(PackingRefused, match="verify_packing at step 0"):
        _trainer(max_steps=2).fit(module, datamodule=SFTDataModule(TOY_TRAIN, TOY_HELDOUT, max_tokens=256))
    assert all(torch.equal(p, before[n]) for n, p in module.model.named_parameters())


def test_sft_run_logs_the_packing_error(tiny_path):
    for mode in ("never", "first_step"):
        module = SFTModule(learning_rate=1e-2, verify_packing=mode)
        trainer = _trainer(max_steps=1, log_every_n_steps=1)
        trainer.fit(module, datamodule=SFTDataModule(TOY_TRAIN, TOY_HELDOUT, max_tokens=256))
        logged = trainer.callback_metrics  # the last step's; no logger here (what one gets: test_every_check_reaches_the_log...)
        assert ("train/packing_error" in logged) == (mode == "first_step")
    assert float(logged["train/packing_error"]) < 1e-4


def test_every_check_reaches_the_log_whatever_log_every_n_steps(tiny_path, tmp_path):
    """A check on a step Lightning does not log (log_every_n_steps 10: steps 9, 19, ...) was dropped: the shipped
    recipe's metrics.csv had no train/packing_error column. Each check is written at its own step, once."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    class StopAfterStep8(Callback):  # a stop (max_time, a signal) makes Lightning write that step too: once, still
        def on_train_batch_end(self, trainer, *args) -> None:
            trainer.should_stop = trainer.global_step == 9

    module = SFTModule(learning_rate=1e-3, verify_packing="every_n_steps", verify_packing_every=4)
    logger = CSVLogger(tmp_path, name="run", version=0)
    trainer = Trainer(accelerator="cpu", logger=logger, enable_checkpointing=False, enable_progress_bar=False, callbacks=[StopAfterStep8()],
                      enable_model_summary=False, limit_val_batches=0, max_steps=20, log_every_n_steps=5)  # fmt: skip
    trainer.fit(module, datamodule=SFTDataModule(TOY_TRAIN, TOY_HELDOUT, max_tokens=256))
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    checked = [int(row["step"]) for row in rows if row.get("train/packing_error")]
    assert checked == [0, 4, 8] and all(float(row["train/packing_error"]) < 1e-4 for row in rows if row.get("train/packing_error"))
    assert [int(row["step"]) for row in rows if row.get("train/loss")] == [4, 8]  # Lightning's own steps, as before


def test_grpo_run_stops_before_any_weight_changes(tiny_path, monkeypatch):
    module = GRPOModule(**{**FAST, "rewards": DIGIT_REWARDS})
    monkeypatch.setattr(tree_attention, "attend_tree", leaky_beyond(24))
    before = {}
    trainer = _trainer(max_steps=1)
    with pytest.raises(PackingRefused, match="verify_packing at step 0"):
        module.configure_model()
        before.update({n: p.detach().clone() for n, p in module.policy.named_parameters()})
        trainer.fit(module, PromptDataModule(batch_size=2))
    assert before and all(torch.equal(p, before[n]) for n, p in module.policy.named_parameters())


@pytest.mark.parametrize("backend", ["blocks", "dense"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed", "bf16-true", "64-true"])
def test_every_precision_trains_and_verifies_on_every_cpu_backend(tiny_path, precision, backend):
    module = SFTModule(learning_rate=1e-3, attention_backend=backend)
    trainer = _trainer(max_steps=1, precision=precision, log_every_n_steps=1)
    trainer.fit(module, datamodule=SFTDataModule(TOY_TRAIN, TOY_HELDOUT, max_tokens=256))
    assert trainer.global_step == 1
    compute_dtype = {"32-true": torch.float32, "64-true": torch.float64}.get(precision, torch.bfloat16)  # 16-mixed is bf16 on a CPU
    assert float(trainer.callback_metrics["train/packing_error"]) <= packed_forward.TOLERANCE[compute_dtype]


def test_compiled_layers_give_the_eager_loss_and_gradients_on_a_packed_row(tiny_path):
    # The recipe's `model.compile: true` (inductor, the default backend) against the eager model, same weights.
    data = SFTDataModule(TOY_TRAIN, TOY_HELDOUT, max_tokens=256)
    data.setup("fit")
    rows = iter(data.train_dataloader())
    eager, compiled = SFTModule(), SFTModule(compile=True)
    eager.configure_model()
    compiled.configure_model()
    assert all(layer._compiled_call_impl is not None for layer in compiled.model.model.layers)
    for _ in range(2):  # a second row of another length: the layers recompile or reuse, and stay right
        batch = next(rows)
        losses = [-packed_logprobs(m.model, batch, attention_backend="blocks").mean() for m in (eager, compiled)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=0)
        for (name, p), q in zip(eager.model.named_parameters(), compiled.model.parameters()):
            torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
            p.grad = q.grad = None


def test_in_bf16_an_exact_model_with_trained_sized_logits_passes_and_a_leak_is_still_refused(monkeypatch):
    """bf16 rounds the hidden states packed or not, and the head multiplies that noise by the logits' size: with the
    logits of a trained model (tens), a fixed 5e-2 refused exactly packed models. The bound now grows with the
    largest logit past 4; a leak across sequences moves the log-probs far more and is still refused."""
    model = build("qwen3").to(torch.bfloat16)
    with torch.no_grad():
        model.model.norm.weight.mul_(100.0)  # logits of trained size
    packed_logprobs(model, pack_sequences(NESTED))  # the probe passes
    error, dtype, scale = probe(model, "blocks", torch.device("cpu"))
    assert dtype == torch.bfloat16 and scale > 20 and packed_forward._tolerance(dtype) < error <= packed_forward._tolerance(dtype, scale)
    leaky = build("qwen3").to(torch.bfloat16)
    with torch.no_grad():
        leaky.model.norm.weight.mul_(100.0)
    monkeypatch.setattr(tree_attention, "attend_tree", leaky_beyond(0))
    with pytest.raises(PackingRefused, match=r"the packing self-check measured packed log-probs .* bfloat16, tolerance"):
        packed_logprobs(leaky, pack_sequences(NESTED))
