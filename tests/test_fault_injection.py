"""Faults at random moments of real `lightning-rl run`s: SIGTERM and SIGUSR1 sent mid-step to a 2-rank FSDP2 SFT run
(gloo) and to an asynchronous GRPO run, SIGKILL in the middle of a checkpoint write.

A signalled run exits 143 within a bound, having saved where the signal found it, and its resume ends with the
same weights as an uninterrupted run, bit for bit. A killed run leaves no half-written checkpoint under a final
name; its resume takes the newest complete checkpoint and says so in one line. No staging file survives a resume.
The moments are drawn from a seeded generator, so a failure can be replayed.
"""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from lightning_rl import stopping
from lightning_rl.checkpoints import checkpoint_step
from support.recipe_runs import exported
from support.paths import REPO, TOY_TRAIN
from support.signalled_runs import Recipe, signal_mid_step, steps_done, wait_until

MAX_STEPS = 14


def leftovers(out: Path) -> list[Path]:
    return [p for p in out.rglob("*") if p.name.endswith((".staging", ".trash"))]


def assert_same_weights(reference: Path, resumed: Path) -> None:
    want, got = exported(reference), exported(resumed)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def signalled_again_and_again(recipe: Recipe, reference: Path, out: Path, rng: random.Random, faults: list[tuple[int, bool]]) -> None:
    """A run stopped by each of ``faults`` in turn, resumed after each; it ends with the reference's weights."""
    for attempt, (signum, to_group) in enumerate(faults):
        step = signal_mid_step(recipe, out, rng, signum, to_group, resume=attempt > 0, max_steps=MAX_STEPS)
    log = recipe.run(out, "--ckpt_path=last")
    assert f"resume: step {step} from hpc_ckpt_{step}.ckpt, the newest complete checkpoint" in log
    assert leftovers(out) == [] and list(out.glob("hpc_ckpt_*")) == []  # superseded by the final checkpoint
    assert_same_weights(reference, out)
    # summary.json describes the whole run, not only its last part
    summary, want = (json.loads((folder / "summary.json").read_text()) for folder in (out, reference))
    for key in ("steps", "micro_batches", "tokens", "first_loss", "last_loss"):
        assert summary[key] == want[key], key


def kill_mid_write_and_resume(recipe: Recipe, reference: Path, out: Path, rng: random.Random) -> None:
    """SIGKILL every process of the run while a checkpoint is being written (a staging entry exists)."""
    checkpoints = out / "checkpoints"
    after = rng.randint(2, MAX_STEPS - 3)
    for attempt in range(3):  # a write may finish between the sight of its staging entry and the kill: kill the next
        proc = recipe.start(out, "--checkpoint_every_n_steps=1", *(["--ckpt_path=last"] if attempt else []))
        wait_until(lambda: steps_done(out) >= after, proc, out)
        wait_until(lambda: checkpoints.is_dir() and any(p.name.endswith(".staging") for p in checkpoints.iterdir()), proc, out, poll=0.0005)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if leftovers(out):
            break
    assert leftovers(out), "no kill landed in a write in 3 tries"
    finals = sorted(checkpoints.glob("*.ckpt"))
    steps = {path.name: checkpoint_step(path) for path in finals}  # whatever the kill hit, every final name is whole
    newest = max(steps.values())

    log = recipe.run(out, "--ckpt_path=last")
    said = [line for line in log.splitlines() if line.startswith("resume:")]
    assert len(said) == 1, said
    assert said[0].startswith(f"resume: step {newest} from checkpoints/"), said
    assert "left by a killed write" in said[0], said
    assert f"Restored all states from the checkpoint at {out / 'checkpoints'}" in log
    assert leftovers(out) == []
    assert_same_weights(reference, out)


@pytest.fixture(scope="module")
def fsdp2_sft(tmp_path_factory: pytest.TempPathFactory, tiny_path: Path) -> tuple[Recipe, Path]:
    """2 FSDP2 ranks on gloo; 60 rows, so that the run crosses several epochs. Returns it and its reference run."""
    root = tmp_path_factory.mktemp("fsdp2-sft")
    data = root / "rows.jsonl"
    data.write_text("".join(TOY_TRAIN.read_text().splitlines(keepends=True)[:60]))
    recipe = Recipe([
        str(REPO / "recipes" / "tiny" / "sft.yaml"), f"--data.train_data={data}", "--data.val_data=null",
        "--data.max_tokens=256", "--model.eval_generations=0", "--model.warmup_steps=2", f"--trainer.max_steps={MAX_STEPS}",
        "--checkpoint_every_n_steps=4", "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--logger.kind=none",
        "--trainer.devices=2", "--trainer.strategy=fsdp2",
    ], ranks=2)  # fmt: skip
    recipe.run(root / "reference")
    return recipe, root / "reference"


def grpo_recipe(root: Path, *mode: str) -> tuple[Recipe, Path]:
    recipe = Recipe([
        str(REPO / "recipes" / "tiny" / "grpo.yaml"), f"--trainer.max_steps={MAX_STEPS}", "--checkpoint_every_n_steps=4",
        *mode, "--model.num_generations=4", "--model.sampling.max_new_tokens=4",
        "--data.batch_size=2", "--trainer.enable_progress_bar=false", "--logger.kind=none",
    ], ranks=1)  # fmt: skip
    recipe.run(root / "reference")
    return recipe, root / "reference"


@pytest.fixture(scope="module")
def async_grpo(tmp_path_factory: pytest.TempPathFactory, tiny_path: Path) -> tuple[Recipe, Path]:
    """The tiny GRPO recipe with rollouts on a background thread (k=0, so the run is deterministic)."""
    return grpo_recipe(tmp_path_factory.mktemp("async-grpo"), "--model.async_mode=true", "--model.max_staleness=0")


@pytest.fixture(scope="module")
def sync_grpo(tmp_path_factory: pytest.TempPathFactory, tiny_path: Path) -> tuple[Recipe, Path]:
    """The tiny GRPO recipe, rollouts generated in the training step."""
    return grpo_recipe(tmp_path_factory.mktemp("sync-grpo"))


# (signal, to every process of the run at once): SIGTERM as schedulers send it, SIGUSR1 as SLURM's early warning.
FAULTS = [(signal.SIGTERM, True), (signal.SIGUSR1, False), (signal.SIGTERM, False), (signal.SIGUSR1, True)]


def test_fsdp2_run_signalled_at_random_moments_exits_143_each_time_and_resumes_exactly(fsdp2_sft, tmp_path):
    recipe, reference = fsdp2_sft
    signalled_again_and_again(recipe, reference, tmp_path / "run", random.Random(100), FAULTS[:3])


def test_async_grpo_signalled_at_random_moments_exits_143_each_time_and_resumes_exactly(async_grpo, tmp_path):
    recipe, reference = async_grpo
    signalled_again_and_again(recipe, reference, tmp_path / "run", random.Random(200), FAULTS[1:])


def test_sync_grpo_signalled_at_random_moments_exits_143_each_time_and_resumes_exactly(sync_grpo, tmp_path):
    recipe, reference = sync_grpo
    signalled_again_and_again(recipe, reference, tmp_path / "run", random.Random(500), FAULTS[:2])


def test_fsdp2_kill_during_a_sharded_checkpoint_write_resumes_from_the_newest_complete(fsdp2_sft, tmp_path):
    recipe, reference = fsdp2_sft
    kill_mid_write_and_resume(recipe, reference, tmp_path / "run", random.Random(300))


def test_kill_during_a_single_file_checkpoint_write_resumes_from_the_newest_complete(async_grpo, tmp_path):
    recipe, reference = async_grpo
    kill_mid_write_and_resume(recipe, reference, tmp_path / "run", random.Random(400))


def run_tiny_sft_in_process(out: Path, callback: str, *extra: str) -> int:
    """The tiny SFT recipe through `lightning-rl run` in this process, without validation, with a callback of this
    module; its exit code."""
    from lightning_rl import cli

    return cli.main([
        "run", str(REPO / "recipes" / "tiny" / "sft.yaml"), f"--output_dir={out}", "--data.val_data=null",
        "--model.eval_generations=0", "--trainer.limit_val_batches=0", "--trainer.val_check_interval=null",
        "--trainer.enable_progress_bar=false", f"--trainer.callbacks+=test_fault_injection.{callback}", *extra,
    ])  # fmt: skip


class SignalDuringSetup(Callback):
    """Sends this process SIGTERM while the model is being set up, before any step."""

    def setup(self, trainer, pl_module, stage) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_before_the_first_step_stops_the_run_at_its_start(tmp_path, capsys):
    """Recorded during setup, acted on by every rank as training starts: exit 143, nothing new saved."""
    out = tmp_path / "run"
    assert run_tiny_sft_in_process(out, "SignalDuringSetup") == 143
    assert "stopped by SIGTERM after step 0; resume with --ckpt_path=last" in capsys.readouterr().err
    assert not list(out.rglob("*.ckpt")) and not (out / "hf").exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are put back after the run
    assert not stopping.signalled()  # and the stop request with them: a later run in this process would give up its steps


class SignalAfterTheLastStep(Callback):
    """Sends this process SIGTERM once training has ended, just before the final export."""

    def on_fit_end(self, trainer, pl_module) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


class SignalAtTheEnd(Callback):
    """Sends this process SIGTERM as the run tears down, before its summary and closing line are written (a
    scheduler's late signal)."""

    def teardown(self, trainer, pl_module, stage) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("sender", ["SignalAfterTheLastStep", "SignalAtTheEnd"])
def test_a_signal_after_the_last_step_lets_the_export_finish_and_the_run_end_finished(tmp_path, capsys, sender):
    """Nothing is left to stop: the export (staged like a checkpoint) is written whole, exit 0, said in one line."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    assert run_tiny_sft_in_process(out, sender, "--trainer.max_steps=3") == 0
    assert "SIGTERM arrived after the last step: the final checkpoint and hf/ were written whole" in capsys.readouterr().err
    assert checkpoint_step(out / "checkpoints" / "last.ckpt") == 3 and leftovers(out) == []
    assert json.loads((out / "summary.json").read_text())["steps"] == 3  # the run's end is said all the same
    AutoModelForCausalLM.from_pretrained(out / "hf")  # the export is complete
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_rank_one_batch_short_trains_what_one_process_does(tmp_path):
    """One row on 2 ranks (DDP, then FSDP2): the second rank's batch is empty (it trains no token, and the step's
    loss is the mean over the first rank's), so the row is not dropped and the weights are one process's. A rank
    short of batches used to drop its row (the run trained nothing, and said done), and with an empty batch the
    ranks hung: its backward reached no decoder layer."""
    data = tmp_path / "row.jsonl"
    data.write_text(TOY_TRAIN.read_text().splitlines(keepends=True)[0])
    args = [str(REPO / "recipes" / "tiny" / "sft.yaml"), f"--data.train_data={data}", "--data.val_data=null", "--model.eval_generations=0",
            "--trainer.max_steps=1", "--logger.kind=none", "--trainer.enable_progress_bar=false"]  # fmt: skip
    Recipe(args, ranks=1).run(tmp_path / "one")
    want = exported(tmp_path / "one")
    counted = lambda out: {k: v for k, v in json.loads((out / "summary.json").read_text()).items() if k in ("tokens", "flat_tokens")}  # noqa: E731
    for strategy in ("ddp", "fsdp2"):
        Recipe([*args, "--trainer.devices=2", f"--trainer.strategy={strategy}"], ranks=2).run(tmp_path / strategy)
        assert counted(tmp_path / strategy) == counted(tmp_path / "one")  # the empty batch's one token was counted
        got = exported(tmp_path / strategy)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=f"{strategy}: {name}")
