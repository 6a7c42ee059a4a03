"""Real `lightning-rl run`s started in a session of their own, so that a test can signal every process of the run at
once (as a scheduler does), with each finished optimizer step written to a progress file to aim the signals by; and
a reward that gets stuck on a given call."""

from __future__ import annotations

import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch import Callback

from lightning_rl.checkpoints import checkpoint_step
from lightning_rl.rollout.vllm_server_process import free_port
from support.paths import REPO

TESTS = Path(__file__).resolve().parents[1]
EXIT_BOUND_S = 60  # from the signal to the exit of the signalled process; a step here takes well under a second


class Progress(Callback):
    """Appends each finished optimizer step to $PROGRESS_FILE (rank 0), so the test can aim its signals."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.is_global_zero:
            with open(os.environ["PROGRESS_FILE"], "a") as f:
                f.write(f"{trainer.global_step} {time.monotonic()}\n")


@dataclass
class Recipe:
    """One of the runs under test: its recipe arguments and how many processes it uses."""

    args: list[str]
    ranks: int

    def start(self, out: Path, *extra: str) -> subprocess.Popen:
        """Start the run in a session of its own (so a signal can go to every rank at once), output to files."""
        out.parent.mkdir(parents=True, exist_ok=True)
        progress = out.with_name(out.name + ".progress")
        progress.unlink(missing_ok=True)
        env = {
            **os.environ, "MASTER_PORT": str(free_port()), "PROGRESS_FILE": str(progress),
            "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        }  # fmt: skip
        cmd = [str(Path(sys.executable).parent / "lightning-rl"), "run", *self.args, f"--output_dir={out}",
               "--trainer.callbacks+=support.signalled_runs.Progress", *extra]  # fmt: skip
        log = open(out.with_name(out.name + ".log"), "a")
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def run(self, out: Path, *extra: str) -> str:
        """Run to the end; returns its output."""
        proc = self.start(out, *extra)
        try:
            code = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # never leave a hung run behind
            raise AssertionError(f"the run did not finish within 300 s:\n{log_of(out)[-4000:]}") from None
        assert code == 0, log_of(out)[-4000:]
        return log_of(out)


def log_of(out: Path) -> str:
    return out.with_name(out.name + ".log").read_text()


def progress(out: Path) -> list[tuple[int, float]]:
    """(step, when) of each finished optimizer step of the run."""
    path = out.with_name(out.name + ".progress")
    lines = path.read_text().splitlines() if path.exists() else []
    return [(int(step), float(when)) for step, when in (line.split() for line in lines if line.count(" ") == 1)]


def steps_done(out: Path) -> int:
    return max((step for step, _ in progress(out)), default=0)


def step_seconds(out: Path) -> float:
    """How long a step of the run takes: the median of its steps so far (one slow step, a checkpoint's, say, must
    not stretch the wait for "somewhere inside the next step" over several steps)."""
    times = [when for _, when in progress(out)]
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def wait_until(condition, proc: subprocess.Popen, out: Path, timeout: float = 300, poll: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before the fault:\n{log_of(out)[-3000:]}"
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(poll)


def exit_after_signal(proc: subprocess.Popen, out: Path, what: str) -> tuple[int, float]:
    """The exit code of a process just signalled, and the seconds it took; a process still running after
    ``EXIT_BOUND_S`` is killed and the test fails, showing its log."""
    sent = time.monotonic()
    try:
        code = proc.wait(timeout=EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"{what}: no exit within {EXIT_BOUND_S}s\n{log_of(out)[-3000:]}")
    return code, time.monotonic() - sent


def signal_mid_step(recipe: Recipe, out: Path, rng: random.Random, signum: int, to_group: bool, resume: bool, max_steps: int) -> int:
    """Signal the run at a random moment of a random step; it must exit 143 within the bound, having saved a complete
    checkpoint of the step it stopped after. Returns that step."""
    name = signal.Signals(signum).name
    proc = recipe.start(out, *(["--ckpt_path=last"] if resume else []))
    wait_until(lambda: progress(out), proc, out)
    first = progress(out)[0][0]
    after = min(first + rng.randint(1, 2), max_steps - 3)
    assert after > first, "too many faults for max_steps"
    wait_until(lambda: steps_done(out) >= after, proc, out)
    time.sleep(rng.uniform(0.0, step_seconds(out)))  # somewhere inside the next step: forward, backward, a collective, a save
    if to_group:
        os.killpg(proc.pid, signum)  # as a scheduler does: every rank at once
    else:
        proc.send_signal(signum)  # rank 0 only: the others learn it at the next step boundary
    code, _ = exit_after_signal(proc, out, f"{name} after step {after}")
    log = log_of(out)
    assert code == 143, f"{name} after step {after}: exit {code}\n{log[-3000:]}"
    stopped = [line for line in log.splitlines() if line.startswith("stopped by")]
    assert stopped[-1].startswith(f"stopped by {name} after step"), stopped
    # "after step N; resume ...", or "after step N (step N+1 given up: ...)" when the signal found a reward running
    step = int(stopped[-1].split("after step ")[1].split(";")[0].split(" (")[0])
    assert after <= step < max_steps and not (out / "hf").exists()
    assert sorted(out.glob("hpc_ckpt_*.ckpt")) == [out / f"hpc_ckpt_{step}.ckpt"]  # it replaced the earlier one
    assert checkpoint_step(out / f"hpc_ckpt_{step}.ckpt") == step  # saved where the signal found it, complete
    return step


_reward_calls = 0


def length_until_stuck(completions: list[str], **_: Any) -> list[float]:
    """A reward (the completions' length) whose call number $STUCK_REWARD_CALL in this process (on the rank
    $STUCK_REWARD_RANK only, if it is set) never returns: it creates the file $STUCK_REWARD_MARKER, for the test to
    aim its signal by, and sleeps. On the other ranks that call returns, and creates $STUCK_REWARD_MARKER.returned.<rank>
    first: that rank is on its way to the step's first collective."""
    global _reward_calls
    _reward_calls += 1
    rank, own = os.environ.get("STUCK_REWARD_RANK"), os.environ.get("LOCAL_RANK", "0")
    if str(_reward_calls) == os.environ.get("STUCK_REWARD_CALL"):
        if rank in (None, own):
            Path(os.environ["STUCK_REWARD_MARKER"]).touch()
            time.sleep(3600)
        Path(f"{os.environ['STUCK_REWARD_MARKER']}.returned.{own}").touch()
    return [len(c) / 10 for c in completions]
