"""SFTModule under a real Trainer: LoRA trains only the adapter and exports folders that from_pretrained
loads with the same outputs; accumulation and bf16 precision come from Lightning; summary figures."""

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from support.recipe_runs import run_tiny_muse
from support.paths import TOY_HELDOUT, TOY_TRAIN
from lightning.pytorch import Callback

from lightning_rl.callbacks import ExportHuggingFace, RunSummary
from lightning_rl.data.sft import SFTDataModule, plan_batches
from lightning_rl.models.loading import LoraSettings, load_causal_lm
from lightning_rl.modules.sft import SFTModule
from lightning_rl.ops.packed_forward import packed_logprobs
from lightning_rl.rollout.vllm_server_process import free_port

TESTS = Path(__file__).parent


def fit(tmp_path, module, **trainer_kwargs):
    data = SFTDataModule(TOY_TRAIN, TOY_HELDOUT, max_tokens=256)
    trainer = Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[RunSummary(tmp_path, task="sft"), ExportHuggingFace(tmp_path)],
        **trainer_kwargs,
    )
    trainer.fit(module, datamodule=data)
    return trainer, json.loads((tmp_path / "summary.json").read_text())


def logits(model, ids):
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("export", ["adapter", "merged"])
def test_lora_trains_only_the_adapter_and_exports_a_loadable_folder(tmp_path, tiny_path, export):
    lora = LoraSettings(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    module = SFTModule(learning_rate=1e-2, lora=lora, export=export)
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    _, summary = fit(tmp_path, module, max_steps=3)
    assert summary["steps"] == 3
    if export == "adapter":
        changed = {n for n, p in module.model.named_parameters() if not torch.equal(p, before[n])}
        assert changed and all("lora_" in n for n in changed)
    else:  # merged: only the adapted projections differ from the base weights
        initial, merged = load_file(tiny_path / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
        assert initial.keys() == merged.keys()
        changed = {n for n in initial if not torch.equal(initial[n], merged[n])}
        assert changed and all(any(t in n for t in lora.target_modules) for n in changed)

    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    base = AutoModelForCausalLM.from_pretrained(tiny_path)
    if export == "adapter":
        assert (tmp_path / "hf" / "adapter_config.json").exists()
        loaded = PeftModel.from_pretrained(base, tmp_path / "hf")
    else:
        assert not (tmp_path / "hf" / "adapter_config.json").exists()
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    torch.testing.assert_close(logits(loaded.eval(), ids), logits(module.model.eval(), ids), atol=1e-5, rtol=1e-5)
    untouched = AutoModelForCausalLM.from_pretrained(tiny_path).eval()  # peft adapted `base` in place
    assert not torch.allclose(logits(loaded, ids), logits(untouched, ids), atol=1e-4)
    assert (tmp_path / "hf" / "tokenizer.json").exists()


def test_accumulation_and_bf16_precision_from_lightning(tmp_path):
    module = SFTModule(learning_rate=1e-3, eval_generations=8, max_new_tokens=8)
    trainer, summary = fit(tmp_path, module, max_steps=2, accumulate_grad_batches=2, precision="bf16-true", gradient_clip_val=1.0)
    assert summary["steps"] == 2 and summary["micro_batches"] == 4
    # The step's loss over both micro-batches, as logged, not one micro-batch's (a row's mean).
    assert summary["last_loss"] == pytest.approx(float(trainer.callback_metrics["train/loss"]), rel=1e-6)
    assert next(module.model.parameters()).dtype == torch.bfloat16
    assert all(k in trainer.callback_metrics for k in ("train/grad_norm", "train/lr", "train/packing_ratio", "train/tokens_per_s"))
    assert summary["packing"] == "tree" and summary["flat_tokens"] > summary["tokens"] > 0
    assert summary["heldout_examples"] == 8 and 0.0 <= summary["heldout_exact_match"] <= 1.0
    assert summary["peak_memory_mb"] > 0 and summary["tokens_per_s"] > 0
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").dtype == torch.bfloat16


class FirstStepGradients(Callback):
    """The gradients the first optimizer step used, read before the second step zeroes them."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] | None = None

    def on_before_zero_grad(self, trainer, pl_module, optimizer) -> None:
        if self.grads is None and trainer.global_step == 1:
            self.grads = {n: p.grad.detach().clone() for n, p in pl_module.model.named_parameters() if p.grad is not None}


def test_an_accumulated_step_trains_on_the_token_mean_of_all_its_rows(tmp_path):
    data = SFTDataModule(TOY_TRAIN, None, max_tokens=96)
    capture = FirstStepGradients()
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, max_steps=2, accumulate_grad_batches=2, callbacks=[capture])  # fmt: skip
    trainer.fit(SFTModule(learning_rate=1e-3), datamodule=data)

    # The same two rows, the same initial weights, outside Lightning: one loss over all their trained tokens.
    rows = [batch for batch, _ in zip(data.train_dataloader(), range(2))]
    counts = [int(row.loss_targets.numel()) for row in rows]
    assert counts[0] != counts[1], counts  # rows of unequal size: a mean of row means would weigh them wrongly
    reference = load_causal_lm("tiny")
    logprobs = [packed_logprobs(reference, row) for row in rows]
    (-torch.cat(logprobs).mean()).backward()
    want = {n: p.grad for n, p in reference.named_parameters()}
    assert capture.grads is not None and capture.grads.keys() == want.keys()
    for name, grad in capture.grads.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-4, atol=1e-6, msg=name)

    # A mean of the two rows' means is a different gradient: the comparison above can tell them apart.
    reference.zero_grad()
    (-sum(packed_logprobs(reference, row).mean() for row in rows) / 2).backward()
    assert not torch.allclose(next(reference.parameters()).grad, next(iter(want.values())), rtol=1e-3, atol=1e-6)


def test_two_ranks_train_as_one_rank_accumulating_both_rows(tiny_path, tmp_path):
    """Step s is rows 2s and 2s+1 either way: one per FSDP2 rank, or both accumulated on a single process."""
    common = ("--model.lora=null", "--trainer.max_steps=3")
    two = run_tiny_muse(tiny_path, tmp_path / "two", *common)
    one = run_tiny_muse(tiny_path, tmp_path / "one", *common, "--trainer.devices=1", "--trainer.accumulate_grad_batches=2")
    assert two.returncode == 0 and one.returncode == 0, (two.stderr + one.stderr)[-3000:]
    want, got = load_file(tmp_path / "one" / "hf" / "model.safetensors"), load_file(tmp_path / "two" / "hf" / "model.safetensors")
    initial = load_file(tiny_path / "model.safetensors")
    assert any(not torch.equal(want[name], initial[name]) for name in want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    # Adam would hide a gradient off by a constant factor; the logged step loss and gradient norm do not.
    steps = {run: step_metrics(tmp_path / run) for run in ("one", "two")}
    assert len(steps["one"]) == 3 and steps["one"].keys() == steps["two"].keys()
    for step, (loss, norm) in steps["one"].items():
        assert steps["two"][step] == pytest.approx((loss, norm), rel=1e-4), step


def step_metrics(out) -> dict[int, tuple[float, float]]:
    """Per optimizer step: the logged token-mean loss and gradient norm (rows of the run's metrics.csv)."""
    with next(out.glob("csv/*/metrics.csv")).open() as f:
        return {int(r["step"]): (float(r["train/loss"]), float(r["train/grad_norm"])) for r in csv.DictReader(f) if r["train/grad_norm"]}


def test_greedy_generation_ends_a_reply_at_the_models_end_of_turn(tiny_path, tiny_tokenizer):
    """A chat model whose generation config ends a reply at a token besides the tokenizer's end of text (Gemma's
    ``<end_of_turn>``) stops there, as its own ``generate`` does: the held-out exact match compares that reply."""
    from lightning_rl.models.loading import generate_greedy

    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    prompt = tiny_tokenizer("12+7=")["input_ids"]
    ids = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None)[0, len(prompt):].tolist()
    assert len(ids) == 6 and tiny_tokenizer.eos_token_id not in ids
    model.generation_config.eos_token_id = [tiny_tokenizer.eos_token_id, ids[0]]  # the first token plays the end of turn
    assert generate_greedy(model, tiny_tokenizer, [prompt], max_new_tokens=6) == [tiny_tokenizer.decode(ids[:1], skip_special_tokens=True)]


def test_greedy_generation_takes_no_sampling_setting_from_the_checkpoints_generation_config(tiny_path, tiny_tokenizer):
    """An instruct checkpoint ships a generation config (repetition_penalty, top_k, min_new_tokens, ...): generate
    applied it to the held-out "greedy" replies, and the exact match read 7% where the same weights read 21%."""
    from lightning_rl.models.loading import generate_greedy

    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    prompts = [tiny_tokenizer(text)["input_ids"] for text in ("12+7=", "3*4=", "hello")]
    plain = generate_greedy(model, tiny_tokenizer, prompts, max_new_tokens=8)
    shipped = {"do_sample": True, "temperature": 0.7, "top_k": 20, "repetition_penalty": 1.3, "no_repeat_ngram_size": 1, "min_new_tokens": 8}
    for key, value in shipped.items():
        setattr(model.generation_config, key, value)
    own = model.generation_config.to_dict()
    assert generate_greedy(model, tiny_tokenizer, prompts, max_new_tokens=8) == plain
    assert model.generation_config.to_dict() == own  # given back as it was
    # Negative control: generate with the shipped config (do_sample off) replies otherwise.
    assert [tiny_tokenizer.decode(o[len(p):], skip_special_tokens=True) for p, o in zip(prompts, (
        model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0].tolist() for p in prompts))] != plain


def test_a_model_transformers_runs_without_sdpa_loads_and_generates(tmp_path, tiny_tokenizer):
    """Gemma-2 has no sdpa attention in transformers: it loads with eager attention for generation (its soft-capped
    attention is refused by tree packing in one line, ``test_packing_families``; without soft-capping it trains)."""
    from transformers import Gemma2Config

    from lightning_rl.models.loading import generate_greedy

    config = Gemma2Config(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32, attn_logit_softcapping=None)  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = load_causal_lm(str(tmp_path))
    assert model.config._attn_implementation == "eager"
    assert len(generate_greedy(model, tiny_tokenizer, [[5, 6, 7]], max_new_tokens=3)) == 1


def test_a_validations_exact_match_is_logged_at_the_step_of_its_loss(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    module = SFTModule(learning_rate=1e-3, eval_generations=2, max_new_tokens=4)
    data = SFTDataModule(TOY_TRAIN, TOY_HELDOUT, max_tokens=256)
    Trainer(accelerator="cpu", logger=CSVLogger(tmp_path), enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, max_steps=4, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0,
            ).fit(module, datamodule=data)
    (metrics,) = tmp_path.glob("lightning_logs/version_*/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    loss_steps = [row["step"] for row in rows if row.get("val/loss")]
    match_steps = [row["step"] for row in rows if row.get("val/exact_match")]
    assert len(loss_steps) == 2 and match_steps == loss_steps


def test_weight_decay_leaves_biases_and_norm_weights_alone_as_trl_does(tmp_path):
    module = SFTModule(learning_rate=1e-3, weight_decay=0.1, eval_generations=0)
    fit(tmp_path, module, max_steps=1)
    names = {id(p): n for n, p in module.policy.named_parameters()}
    decayed, kept = module.optimizers().optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and kept["weight_decay"] == 0.0
    kept_names = {names[id(p)] for p in kept["params"]}
    assert kept_names == {n for n in names.values() if "norm" in n or n.endswith("bias")} and kept_names
    assert any(n.endswith("q_proj.weight") for n in (names[id(p)] for p in decayed["params"]))


def test_every_epoch_takes_the_first_epochs_rows_so_each_validates_and_the_schedule_ends(tmp_path, capsys):
    """A later epoch's order can pack into fewer rows than the first's. Lightning reads the count once and validates at
    the batch whose index is the first epoch's count, so a shorter epoch ran no validation (the last one too: no final
    val/loss); the schedule was once built for 72 steps where the run took 70. A shorter plan's fullest rows are now split."""
    import random

    from lightning_rl import cli
    from support.paths import REPO

    rng, rows = random.Random(1), [json.loads(line) for line in TOY_TRAIN.read_text().splitlines()[:30]]
    for k, row in enumerate(rows):  # rows of many lengths, so that each epoch's order packs otherwise
        row["messages"][0]["content"] = f"S{k} " + "x y z " * rng.randint(0, 12)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    code = cli.main(["run", str(REPO / "recipes/tiny/sft.yaml"), f"--data.train_data={data}", f"--output_dir={out}",
                     "--model.eval_generations=0", "--trainer.val_check_interval=null", "--trainer.limit_val_batches=1", "--trainer.max_epochs=3",
                     "--trainer.max_steps=-1", "--model.lr_schedule=linear", "--model.warmup_steps=0", "--model.learning_rate=1e-2",
                     "--data.packing=flat", "--data.max_tokens=130", "--logger.kind=csv", "--trainer.log_every_n_steps=1",
                     "--trainer.enable_progress_bar=false"])  # fmt: skip
    assert code == 0, capsys.readouterr().err[-3000:]
    steps = json.loads((out / "summary.json").read_text())["steps"]
    module = SFTDataModule(str(data), max_tokens=130, packing="flat")
    module.setup("fit")
    first = module.batches_per_epoch()
    sampler = module._loader(module.train_examples, True, module.seed)[1]
    packed = [len(plan_batches(module.train_examples, sampler._order(len(rows), epoch), 130, "flat")) for epoch in (1, 2)]
    assert min(packed) < first, packed  # an epoch's own order does pack into fewer rows
    for epoch in range(3):
        sampler.set_epoch(epoch)
        assert len(sampler) == first and sorted(i for batch in sampler for i in batch) == list(range(len(rows)))
    assert steps == 3 * first
    rows_logged = list(csv.DictReader((next(out.rglob("metrics.csv"))).open()))
    assert [int(row["epoch"]) for row in rows_logged if row.get("val/loss")] == [0, 1, 2]  # a validation after every epoch
    rates = [float(row["train/lr"]) for row in rows_logged if row.get("train/lr")]
    assert rates[-1] == pytest.approx(1e-2 / steps, rel=1e-5)  # the last step's rate of a linear schedule over the run


def test_the_held_out_loss_on_two_ranks_is_that_of_one_process(tmp_path, capsys):
    """One held-out row of 3 trained tokens on 2 ranks: Lightning averaged the ranks' token counts as integers (1.5
    read 1), so val/loss read 1.5x the figure (and inf on 4 ranks). The sums over every rank now make it."""
    from lightning_rl import cli
    from support.paths import REPO
    from support.recipe_runs import run_on_two

    held = tmp_path / "held.jsonl"
    held.write_text(TOY_HELDOUT.read_text().splitlines(keepends=True)[0])
    recipe = str(REPO / "recipes/tiny/sft.yaml")
    args = [f"--data.val_data={held}", "--model.eval_generations=0", "--trainer.max_steps=1", "--trainer.val_check_interval=1",
            "--trainer.check_val_every_n_epoch=null", "--trainer.limit_val_batches=1.0", "--logger.kind=csv", "--trainer.enable_progress_bar=false",
            "--model.warmup_steps=1"]  # fmt: skip  (a rate of 0 at the one step: the same weights in both runs)

    def val_loss(out):
        return [float(row["val/loss"]) for row in csv.DictReader(next(out.rglob("metrics.csv")).open()) if row.get("val/loss")]

    assert cli.main(["run", recipe, f"--output_dir={tmp_path / 'one'}", *args]) == 0, capsys.readouterr().err[-3000:]
    two = run_on_two(recipe, tmp_path / "two", "--trainer.strategy=ddp", *args)
    assert two.returncode == 0, two.stderr[-3000:]
    assert val_loss(tmp_path / "two") == pytest.approx(val_loss(tmp_path / "one"), rel=1e-6) and len(val_loss(tmp_path / "one")) == 1
    # summary.json's token counts are the run's, every rank's (they were rank 0's): those of one process taking both
    # ranks' batches (rank r trains every 2nd batch from r) as one step of two micro-batches.
    assert cli.main(["run", recipe, f"--output_dir={tmp_path / 'both'}", *args, "--trainer.accumulate_grad_batches=2", "--trainer.val_check_interval=2"]) == 0
    both, summed = (json.loads((tmp_path / run / "summary.json").read_text()) for run in ("both", "two"))
    assert (summed["tokens"], summed["flat_tokens"]) == (both["tokens"], both["flat_tokens"]) and summed["world_size"] == 2


def test_entropy_and_token_accuracy_are_those_of_the_model_over_every_trained_token(tmp_path, tiny_path):
    """TRL's SFT logs `mean_token_accuracy` and `entropy` (and their eval_ twins): held out, they are the plain model's
    over every trained token; in training, the step's over all its micro-batches, before its update."""
    rows = TOY_TRAIN.read_text().splitlines(keepends=True)[:8]
    (tmp_path / "rows.jsonl").write_text("".join(rows))
    data = SFTDataModule(str(tmp_path / "rows.jsonl"), str(tmp_path / "rows.jsonl"), max_tokens=64, shuffle=False)
    data.setup("fit")
    model = AutoModelForCausalLM.from_pretrained(tiny_path).eval()
    entropies, hits = [], []
    with torch.no_grad():
        for example in data.val_examples:
            ids = torch.tensor(example.input_ids)
            logp = torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1].double(), dim=-1)
            trained = torch.tensor(example.loss_mask[1:])
            entropies.append(-(logp.exp() * logp).sum(-1)[trained])
            hits.append((logp.argmax(-1) == ids[1:])[trained])
    entropy, accuracy = float(torch.cat(entropies).mean()), float(torch.cat(hits).double().mean())
    module = SFTModule(learning_rate=1e-2)
    batches = data.batches_per_epoch()
    assert batches >= 2  # the step's figures span micro-batches
    def trainer(**kwargs):
        return Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)

    held = trainer().validate(module, datamodule=data, verbose=False)[0]
    assert held["val/entropy"] == pytest.approx(entropy, rel=1e-5) and held["val/mean_token_accuracy"] == pytest.approx(accuracy, abs=1e-9)
    trainer = trainer(max_steps=1, accumulate_grad_batches=batches, limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    assert float(trainer.callback_metrics["train/entropy"]) == pytest.approx(entropy, rel=1e-5)
    assert float(trainer.callback_metrics["train/mean_token_accuracy"]) == pytest.approx(accuracy, abs=1e-9)
    assert float(trainer.callback_metrics["train/trained_tokens"]) == sum(map(len, entropies))  # the step's, not a micro-batch's


def test_16_bit_weights_stepped_at_a_small_learning_rate_are_said_to_lose_updates(tmp_path, capsys):
    """bf16-true keeps no float32 copy of the weights: at 1e-5 most AdamW updates round away, silently (TRL's bf16
    keeps float32 weights)."""
    fit(tmp_path / "low", SFTModule(learning_rate=1e-5), max_steps=1, precision="bf16-true")
    assert "note: trainer.precision bf16-true steps 16-bit weights with no float32 copy" in capsys.readouterr().err
    fit(tmp_path / "mixed", SFTModule(learning_rate=1e-5), max_steps=1, precision="bf16-mixed")
    fit(tmp_path / "high", SFTModule(learning_rate=1e-3), max_steps=1, precision="bf16-true")
    assert "no float32 copy" not in capsys.readouterr().err


def test_load_from_checkpoint_gives_the_trained_weights_and_lora_settings_resume(tmp_path):
    """Lightning's own ways back from a checkpoint, without the command: ``load_from_checkpoint`` read the Trainer the
    module did not have yet, and a module given ``LoraSettings`` (not a dict) pickled them into its checkpoint, which
    the weights-only resume could not read."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(max_steps: int, ckpt_path: str | None = None) -> SFTModule:
        module = SFTModule(learning_rate=1e-2, lora=LoraSettings(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
        Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, max_steps=max_steps,
                callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)]).fit(module, datamodule=SFTDataModule(TOY_TRAIN, max_tokens=256), ckpt_path=ckpt_path)  # fmt: skip
        return module

    trained = run(2)
    loaded = SFTModule.load_from_checkpoint(tmp_path / "last.ckpt")
    assert loaded.lora == trained.lora
    theirs = dict(trained.model.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in loaded.model.named_parameters())
    # Exported from a script, with no Trainer (it read the Trainer's datamodule): the model's tokenizer, the steps trained.
    merged = loaded.export_hf(tmp_path / "hf")
    assert "for 2 optimizer steps" in (merged / "README.md").read_text()
    ids = torch.tensor([[5, 17, 42, 99]])
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(merged).eval(), ids), logits(loaded.model.merge_and_unload().eval(), ids), atol=1e-5, rtol=1e-5)
    assert (merged / "tokenizer_config.json").exists()
    assert run(3, ckpt_path=str(tmp_path / "last.ckpt")).global_step == 3


def test_a_plain_trainer_resumed_with_more_steps_follows_the_new_schedule_from_its_first_step(tmp_path):
    """The module brings its own run-keeping callbacks (they were the command's alone): resumed at step 4 of a cosine
    schedule now 6 steps long, the first step took the old schedule's last rate (0)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_rl.callbacks import ScheduleOnResume

    class Rates(Callback):
        def __init__(self) -> None:
            self.taken: dict[int, float] = {}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self.taken[trainer.global_step] = optimizer.param_groups[0]["lr"]

    def run(max_steps: int, **fit_options) -> tuple[Trainer, Rates]:
        rates = Rates()
        trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                          max_steps=max_steps, callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True), rates])  # fmt: skip
        trainer.fit(SFTModule(learning_rate=1e-3, lr_schedule="cosine"), datamodule=SFTDataModule(TOY_TRAIN, max_tokens=256), **fit_options)
        return trainer, rates

    run(4)
    trainer, rates = run(6, ckpt_path=str(tmp_path / "last.ckpt"))
    assert sum(isinstance(c, ScheduleOnResume) for c in trainer.callbacks) == 1
    assert rates.taken == pytest.approx({step: 1e-3 * 0.5 * (1 + math.cos(math.pi * step / 6)) for step in (4, 5)})


def test_each_validate_logs_the_exact_match_and_prompt_data_is_refused_in_one_line():
    """A second Trainer's validation at the same step number found the first one's figure cached and logged none; a
    GRPO prompt datamodule ended in an AttributeError deep in the step."""
    from lightning_rl.data.prompts import PromptDataModule
    from lightning_rl.errors import RecipeError

    module = SFTModule(eval_generations=2)
    for _ in range(2):
        trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1)
        (results,) = trainer.validate(module, datamodule=SFTDataModule(TOY_TRAIN, TOY_HELDOUT, max_tokens=256))
        assert "val/exact_match" in results
    with pytest.raises(RecipeError, match=r"^SFT trains on the packed rows of SFTDataModule, got a batch of \w+ from PromptDataModule$"):
        Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, max_steps=1).fit(SFTModule(), datamodule=PromptDataModule(batch_size=2))


def test_held_out_generations_past_the_models_context_are_refused_and_fewer_cases_than_asked_said(tmp_path, capsys):
    """SFT decoded a held-out prompt past the model's 1024 positions and counted its score, where GRPO refused it; an
    eval_generations beyond the held-out set was cut to it without a word."""
    from lightning_rl.errors import DataError

    turn = lambda question: [{"role": "user", "content": question}, {"role": "assistant", "content": "2"}]  # noqa: E731
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"messages": turn(q)}) + "\n" for q in ("1+1=", "1+" * 700 + "1=")))

    def validate(n: int, max_new_tokens: int = 4):
        trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1)
        return trainer.validate(SFTModule(eval_generations=n, max_new_tokens=max_new_tokens), datamodule=SFTDataModule(TOY_TRAIN, str(held), max_tokens=4096))

    with pytest.raises(DataError, match=r"held.jsonl: line 2: the held-out prompt is \d+ tokens; with max_new_tokens=4 it does not fit "
                                        r"the model's context of 1024 tokens: shorten it or lower max_new_tokens$"):
        validate(2)
    held.write_text(json.dumps({"messages": turn("1+1=")}) + "\n")
    (results,) = validate(3)
    assert "val/exact_match" in results
    assert "note: eval_generations=3, but data.val_data has 1 held-out conversations ending in a reply" in capsys.readouterr().err


def test_a_resume_under_a_trainer_of_ones_own_that_would_cut_other_batches_is_refused(tmp_path):
    """The data's position is a count of batches: under another max_tokens (or packing, shuffle, seed) it pointed at
    other rows, and the resumed run trained on silently. The command named the changed recipe key; a Trainer of one's
    own is refused too, naming it."""
    from lightning_rl.errors import BatchingChanged

    def trainer(steps: int) -> Trainer:
        return Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                       enable_model_summary=False, limit_val_batches=0)  # fmt: skip

    first = trainer(1)
    first.fit(SFTModule(learning_rate=1e-3), datamodule=SFTDataModule(TOY_TRAIN, None, max_tokens=96))
    first.save_checkpoint(tmp_path / "one.ckpt")
    with pytest.raises(BatchingChanged, match=r"^data\.max_tokens=128 here, 96 in the run: the run being resumed cut its rows into other batches"):
        trainer(2).fit(SFTModule(learning_rate=1e-3), datamodule=SFTDataModule(TOY_TRAIN, None, max_tokens=128), ckpt_path=tmp_path / "one.ckpt")
    # Unshuffled, the seed orders nothing: another one cuts the same batches, and resumes.
    unshuffled = [SFTDataModule(TOY_TRAIN, None, max_tokens=96, shuffle=False, seed=seed) for seed in (0, 1)]
    for data in unshuffled:
        data.setup("fit")
    unshuffled[1].load_state_dict(unshuffled[0].state_dict())
    resumed = trainer(2)  # the run's own values resume
    resumed.fit(SFTModule(learning_rate=1e-3), datamodule=SFTDataModule(TOY_TRAIN, None, max_tokens=96), ckpt_path=tmp_path / "one.ckpt")
    assert resumed.global_step == 2


def test_sft_through_the_python_api_on_two_ranks_deals_its_own_rows(tmp_path, tiny_path):
    """A user's own Trainer(devices=2) keeps Lightning's distributed sampler on by default, which could not wrap the
    token-budget batch sampler: a 30-line TypeError on every rank. The datamodule turns it off (it deals the rows)."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONPATH": str(TESTS)}
    done = subprocess.run([sys.executable, str(TESTS / "support" / "sft_api_ddp.py"), str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=TESTS.parent)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["steps"] == 2 and math.isfinite(result["loss"])


def test_a_64_true_step_logs_its_loss_in_float64(tiny_path):
    """The step's sums were kept in float32: a 64-true run logged 5.8726801872 where its loss is 5.8726799491."""
    data = SFTDataModule(TOY_TRAIN, None, max_tokens=256, shuffle=False)
    trainer = Trainer(accelerator="cpu", precision="64-true", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, max_steps=1)  # fmt: skip
    module = SFTModule(learning_rate=1e-3)
    trainer.fit(module, datamodule=data)
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float64)  # the weights before the step
    first = next(iter(data._loader(data.train_examples, False, data.seed)[1]))  # the first row's examples (no shuffle)
    total, tokens = 0.0, 0
    for example in (data.train_examples[i] for i in first):
        logits = model(input_ids=torch.tensor([example.input_ids])).logits[0, :-1]
        nll = -torch.log_softmax(logits, -1).gather(1, torch.tensor(example.input_ids[1:])[:, None])[:, 0]
        trained = torch.tensor(example.loss_mask[1:])
        total, tokens = total + float(nll[trained].sum()), tokens + int(trained.sum())
    assert float(trainer.callback_metrics["train/loss"]) == pytest.approx(total / tokens, rel=1e-12)
    assert module.step_loss == pytest.approx(total / tokens, rel=1e-12)  # summary.json's first and last loss


def test_a_checkpoint_of_the_earlier_epoch_rule_past_its_first_epoch_is_refused(tiny_path):
    """An earlier version let a later epoch pack into fewer rows than the first; this one splits such an epoch's rows.
    A checkpoint written by it past its first epoch would resume at other rows (repeating examples): refused in one
    line. In its first epoch the rows are the same, so it resumes."""
    from lightning_rl.errors import BatchingChanged

    data = SFTDataModule(TOY_TRAIN, None, max_tokens=256)
    data.setup("fit")
    state = data.state_dict()
    old = {**state, "batching": {k: v for k, v in state["batching"].items() if k != "epoch_rows"}}
    with pytest.raises(BatchingChanged, match=r"^ckpt_path: the run being resumed \(in its data epoch 2\) was written by an earlier lightning-rl"):
        data.load_state_dict({**old, "epoch": 2, "batches_taken": 1})
    data.load_state_dict({**old, "epoch": 0, "batches_taken": 1})
    data.load_state_dict({**state, "epoch": 2, "batches_taken": 1})  # this version's own


def test_a_config_asking_for_the_routers_auxiliary_loss_is_told_it_is_not_added(tmp_path, capsys):
    """A mixture of experts whose config asks for the load-balancing loss (output_router_logits) trained without it,
    without a word; the model's own forward with labels adds it, as TRL does."""
    import shutil

    from lightning_rl.toy.model import tiny_moe_path

    folder = tmp_path / "moe"
    shutil.copytree(tiny_moe_path(), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "output_router_logits": True, "router_aux_loss_coef": 0.5}))
    fit(tmp_path, SFTModule(model_name_or_path=str(folder)), max_steps=1)
    assert f"note: {folder}'s config asks for its router's auxiliary loss (output_router_logits: true, router_aux_loss_coef 0.5)" in capsys.readouterr().err
