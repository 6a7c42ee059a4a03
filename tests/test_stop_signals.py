"""Stop signals that find the run somewhere other than its own training step, through real `lightning-rl run`s:
DataLoader worker processes (a scheduler signals the whole process group), and a reward that does not return (in the
training step, on async GRPO's rollout thread, on one of two ranks)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from lightning_rl import stopping
from lightning_rl.checkpoints import checkpoint_step, load_safely
from lightning_rl.rollout.base import INTERRUPTED, Rollout
from lightning_rl.rollout.buffer import BatchInterrupted, RolloutProducer, ScoredBatch
from support.paths import REPO
from support.recipe_runs import exported
from support.signalled_runs import Recipe, exit_after_signal, log_of, progress, signal_mid_step, wait_until

WORKER_STEPS = 10


def test_a_signal_to_the_whole_group_leaves_the_dataloader_workers_to_the_main_process(tiny_path, tmp_path):
    """SIGTERM, then SIGUSR1, to every process of an SFT run with 2 DataLoader workers (forked anew every epoch of the
    toy data, a few steps): each time the run saves at the step boundary and exits 143, and the second run resumes from the
first one's checkpoint."""
    recipe = Recipe([
        str(REPO / "recipes" / "tiny" / "sft.yaml"), "--data.num_workers=2", "--data.val_data=null", "--model.eval_generations=0",
        "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0", f"--trainer.max_steps={WORKER_STEPS}",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--logger.kind=none",
    ], ranks=1)  # fmt: skip
    out, rng = tmp_path / "run", random.Random(21)
    first = signal_mid_step(recipe, out, rng, signal.SIGTERM, to_group=True, resume=False, max_steps=WORKER_STEPS)
    second = signal_mid_step(recipe, out, rng, signal.SIGUSR1, to_group=True, resume=True, max_steps=WORKER_STEPS)
    log = log_of(out)
    assert first < second and f"resume: step {first} from hpc_ckpt_{first}.ckpt, the newest complete checkpoint" in log
    assert "Traceback" not in log and "DataLoader worker" not in log


GRPO_STEPS = 5
GRPO = [
    str(REPO / "recipes" / "tiny" / "grpo.yaml"), f"--trainer.max_steps={GRPO_STEPS}", "--model.num_generations=4",
    "--data.batch_size=2", '--model.rewards=[{"function": "support.signalled_runs:length_until_stuck"}]',
    "--model.reward_timeout_s=3600", "--trainer.enable_progress_bar=false", "--logger.kind=none",
]  # fmt: skip


def stopped_in_a_stuck_reward_then_resumed(recipe: Recipe, root: Path, monkeypatch, why: str, stuck_rank: int | None = None) -> None:
    """An uninterrupted run, and one whose reward never returns on step 3 (on ``stuck_rank`` alone, if given; its
    timeout an hour): SIGTERM to every process ends it within seconds, exit 143, with the checkpoint of step 2 (step 3
    given up for ``why``); the resume trains step 3 once and ends with the weights of the uninterrupted run."""
    reference, out, marker = root / "reference", root / "run", root / "stuck"
    recipe.run(reference)

    monkeypatch.setenv("STUCK_REWARD_CALL", "3")
    monkeypatch.setenv("STUCK_REWARD_MARKER", str(marker))
    if stuck_rank is not None:
        monkeypatch.setenv("STUCK_REWARD_RANK", str(stuck_rank))
    proc = recipe.start(out)
    others = [marker.with_name(f"{marker.name}.returned.{r}") for r in range(recipe.ranks) if stuck_rank is not None and r != stuck_rank]
    wait_until(lambda: marker.exists() and all(m.exists() for m in others), proc, out, poll=0.1)
    time.sleep(2)  # the other ranks, their reward returned, reach the step's first collective meanwhile
    os.killpg(proc.pid, signal.SIGTERM)
    code, seconds = exit_after_signal(proc, out, "SIGTERM during a reward that does not return")
    log = log_of(out)
    assert code == 143, log[-3000:]
    assert seconds < 60, "the stop waited for the reward"  # which sleeps an hour; a save and 2 ranks' exit take seconds
    stopped = [line for line in log.splitlines() if line.startswith("stopped by")]
    assert stopped == [f"stopped by SIGTERM after step 2 (step 3 given up: {why}); resume with --ckpt_path=last"], log[-3000:]
    assert "Traceback" not in log and not (out / "hf").exists()
    assert sorted(out.glob("hpc_ckpt_*.ckpt")) == [out / "hpc_ckpt_2.ckpt"] and checkpoint_step(out / "hpc_ckpt_2.ckpt") == 2

    monkeypatch.delenv("STUCK_REWARD_CALL")
    log = recipe.run(out, "--ckpt_path=last")
    assert "resume: step 2 from hpc_ckpt_2.ckpt, the newest complete checkpoint" in log
    assert [step for step, _ in progress(out)] == [3, 4, 5]  # the abandoned step trained once, none skipped
    last = out / "checkpoints" / "last.ckpt"  # a sharded (FSDP2) one keeps the loops' and the module's state in meta.pt
    trained = load_safely(last / "meta.pt" if last.is_dir() else last)["grpo"]["per_rank"][0]["trained_batches"]
    assert [batch["index"] for batch in trained] == list(range(GRPO_STEPS))  # every prompt batch once, in order
    want, got = exported(reference), exported(out)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def test_a_signal_does_not_wait_for_a_reward_that_does_not_return(tiny_path, tmp_path, monkeypatch):
    stopped_in_a_stuck_reward_then_resumed(Recipe(GRPO, ranks=1), tmp_path, monkeypatch, "reward 'length_until_stuck' had not returned")


def test_a_signal_does_not_wait_for_the_rollout_producer_stuck_in_a_reward(tiny_path, tmp_path, monkeypatch):
    """Async GRPO (k=0, deterministic): the trainer waits for batch 2 while the producer thread's reward hangs. The
    checkpoint holds what was finished, not the batch in the making, which the resumed run generates again."""
    recipe = Recipe([*GRPO, "--model.async_mode=true", "--model.max_staleness=0"], ranks=1)
    stopped_in_a_stuck_reward_then_resumed(recipe, tmp_path, monkeypatch, "rollout batch 2 had not returned")


def test_two_ranks_stop_together_when_one_is_stuck_in_a_reward(tiny_path, tmp_path, monkeypatch):
    """Two FSDP2 ranks on gloo: rank 1's reward hangs while rank 0 has its rollouts and waits for rank 1 before the
    step's first collective. Both give the step up at once and save the step before together."""
    recipe = Recipe([*GRPO, "--trainer.devices=2", "--trainer.strategy=fsdp2"], ranks=2)
    stopped_in_a_stuck_reward_then_resumed(recipe, tmp_path, monkeypatch, "another rank was stopping", stuck_rank=1)


def scored(index: int, version: int) -> ScoredBatch:
    rollout = Rollout([1, 2], [3, 4], [-0.5, -0.25], weight_version=version, group_id=0)
    return ScoredBatch(index, [{"prompt": f"p{index}"}], [rollout], [1.0], {"r": [1.0]})


@pytest.fixture
def inside_a_step():
    """The trainer's thread inside a step a stop signal may give up, as ``RequeueOnSignal`` marks it; undone after."""
    stopping.may_abandon(True)
    yield
    stopping.may_abandon(False)
    stopping.signal_came(False)


def test_a_step_given_up_names_what_it_waited_for_only_once_it_waited(inside_a_step):
    """A signal that came earlier in the step (during generation, say) was blamed on the next wait it met: "reward
    'math_answer' had not returned", of a reward that returns at once."""
    import asyncio

    from lightning_rl.rewards.scoring import _within

    stopping.signal_came()
    with pytest.raises(stopping.StepAbandoned) as before_tool:
        stopping.wait_unless_stopping(lambda seconds: False, None, "a tool call")
    with pytest.raises(stopping.StepAbandoned) as before_reward:
        asyncio.run(_within(asyncio.sleep(0), None, "reward 'r'"))
    assert (before_tool.value.why, before_reward.value.why) == ("the signal came before a tool call was awaited",
                                                                 "the signal came before reward 'r' was awaited")  # fmt: skip
    stopping.signal_came(False)
    waits = iter([False, True])
    came = lambda seconds: stopping.signal_came() or next(waits)  # noqa: E731  # the signal comes while it waits
    with pytest.raises(stopping.StepAbandoned) as during:
        stopping.wait_unless_stopping(came, None, "a tool call")
    assert during.value.why == "a tool call had not returned"


def test_a_step_given_up_while_its_stale_batch_is_sampled_again_leaves_a_resumable_queue(inside_a_step):
    """Batch 3 came back from a checkpoint too stale: the producer samples it again, and that sample never comes (a
    reward that does not return). A stop signal gives the wait up; the queue a checkpoint then takes, without waiting
    for the sample, still holds batches 3 and 4, so the resumed run trains them in order."""
    release = threading.Event()

    def produce(index: int) -> ScoredBatch:
        release.wait()
        return scored(index, 3)

    producer = RolloutProducer(produce, lambda: 3, max_staleness=1)
    producer.load_state_dict({"ready": [scored(3, 1).state(), scored(4, 3).state()]}, next_step=3)
    producer.start()
    threading.Timer(0.3, stopping.signal_came).start()  # once the trainer waits for the new sample
    try:
        with pytest.raises(stopping.StepAbandoned) as abandoned:
            producer.take(3)
        state = producer.state_dict()
    finally:
        release.set()
        producer.close()
    assert abandoned.value.why == "rollout batch 3 had not returned" and abandoned.value.code == 143
    assert [batch["index"] for batch in state["ready"]] == [3, 4]
    RolloutProducer(produce, lambda: 3, max_staleness=1).load_state_dict(state, next_step=3)  # refuses a gap


def test_a_batch_taken_for_a_step_another_rank_gives_up_goes_back_to_the_queue(inside_a_step):
    producer = RolloutProducer(lambda index: scored(index, 3), lambda: 3, max_staleness=1)
    producer.load_state_dict({"ready": [scored(3, 3).state()]}, next_step=3)
    producer.start()
    try:
        with pytest.raises(stopping.StepAbandoned) as abandoned:
            stopping.fetched_on_every_rank(lambda: producer.take(3), lambda _: True, producer.give_back)  # the other rank's vote
        assert abandoned.value.why == "another rank was stopping"
        assert [batch["index"] for batch in producer.state_dict()["ready"]] == [3, 4]  # 4: generated meanwhile
    finally:
        producer.close()


def test_a_fetch_that_fails_on_one_rank_stops_the_others_with_its_exit_code(inside_a_step):
    """A bad data row found by one rank's fetch: the others learn it in the same agreement and stop with its exit code,
    instead of waiting in the step's collectives for it (a traceback on gloo, a hang until the timeout on NCCL)."""
    from lightning_rl.data.sft import DataError

    votes: list[float] = []

    def bad_row():
        raise DataError("prompts.jsonl: line 7: the prompt is too long")

    with pytest.raises(DataError):
        stopping.fetched_on_every_rank(bad_row, lambda value: votes.append(value) or value)
    healthy = 0.0  # this rank's own vote
    with pytest.raises(stopping.AnotherRankFailed) as stopped:
        stopping.fetched_on_every_rank(lambda: "batch", lambda value: value + votes[0] + healthy)
    assert stopped.value.exit_code == 2 and stopped.value.on_every_rank
    assert stopping.fetched_on_every_rank(lambda: "batch", lambda value: value) == "batch"  # no failure, no stop


def _catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler of its own for ``signum`` (Linux: the SigCgt mask of /proc/PID/status)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (signum - 1) & 1)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_during_the_commands_start_exits_143_with_one_line(tmp_path, signum):
    """A scheduler's signal in the seconds the command spends importing torch and Lightning, before the run installs
    its handlers, killed the process without a word (status -15, or -10: SIGUSR1's default action ends it too)."""
    import subprocess
    import sys

    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "lightning_rl.cli", "run", str(REPO / "recipes" / "tiny" / "sft.yaml"), f"--output_dir={out}"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 60
    while not _catches(proc.pid, signum) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signum)  # the first handler there is: the command's own, long before the run's
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert err.strip().splitlines()[-1] == f"{signal.Signals(signum).name} arrived before training started: the command stops, nothing trained"
    assert not out.exists()


def test_a_stop_saves_the_batch_in_the_making_as_far_as_it_got_and_the_resume_finishes_it(inside_a_step):
    """Batch 4 is being sampled when the stop comes: the save has the engine cut it (``interrupt``), keeps its samples
    as far as they got, and a later batch that finished meanwhile (concurrent batches) stays queued behind it. The
    resumed run hands the cut samples back to finish them (``produce(4, rollouts)``) before it trains batch 5."""
    cut = threading.Event()
    half = Rollout([1, 2], [3], [-0.5], weight_version=3, group_id=0, finish_reason=INTERRUPTED)
    calls = []

    def produce(index: int, partial: list[Rollout] | None = None) -> ScoredBatch:
        calls.append((index, partial))
        if index == 4 and partial is None:
            cut.wait(10)
            raise BatchInterrupted(4, [half])
        return scored(index, 4 if partial is not None else 3)

    producer = RolloutProducer(produce, lambda: 3, max_staleness=2, start_index=4, concurrent=True, interrupt=lambda: cut.set() or True)
    producer.start()
    deadline = time.monotonic() + 10
    while not (len(calls) == 2 and 5 in producer._ready) and time.monotonic() < deadline:  # 5 done, 4 being sampled
        time.sleep(0.01)
    stopping.signal_came()
    try:
        state = producer.state_dict()
    finally:
        producer.close()
    assert [batch["index"] for batch in state["ready"]] == [5]
    assert [(p["index"], [Rollout(**r) for r in p["rollouts"]]) for p in state["partial"]] == [(4, [half])]
    stopping.signal_came(False)
    calls.clear()
    restored = RolloutProducer(produce, lambda: 4, max_staleness=2, concurrent=True)
    restored.load_state_dict(state, next_step=4)
    restored.start()
    try:
        assert [restored.take(i).index for i in (4, 5)] == [4, 5]
    finally:
        restored.close()
    assert (4, [half]) in calls and all(index != 5 for index, _ in calls)  # 5 came from the queue


def test_a_stale_batch_cut_while_sampled_again_is_saved_once_and_a_lowered_bound_still_resumes(inside_a_step):
    """Batch 3 came back too stale and is being sampled again when the stop comes: the save keeps the new, cut sample
    alone (the queue held the stale one as well, and such a checkpoint would not load). A resume under a lower
    ``max_staleness`` than the queue was filled under still finishes batch 3 first (it needs no room in the queue), and
    nothing starts while the stop signal stands: the cut batch waits until it is withdrawn."""
    cut = threading.Event()
    half = Rollout([1, 2], [3], [-0.5], weight_version=3, group_id=0, finish_reason=INTERRUPTED)
    calls = []

    def produce(index: int, partial: list[Rollout] | None = None) -> ScoredBatch:
        calls.append((index, partial))
        if partial is None and index == 3:
            cut.wait(10)
            raise BatchInterrupted(3, [half])
        return scored(index, 5)

    producer = RolloutProducer(produce, lambda: 3, max_staleness=2, interrupt=lambda: cut.set() or True)
    producer.load_state_dict({"ready": [scored(3, 0).state(), scored(4, 3).state(), scored(5, 3).state()]}, next_step=3)
    producer.start()
    threading.Timer(0.3, stopping.signal_came).start()  # once batch 3 is being sampled again
    try:
        with pytest.raises(stopping.StepAbandoned):
            producer.take(3)
        state = producer.state_dict()
    finally:
        producer.close()
    assert [batch["index"] for batch in state["ready"]] == [4, 5] and [p["index"] for p in state["partial"]] == [3]

    calls.clear()
    restored = RolloutProducer(produce, lambda: 5, max_staleness=1)  # room for one batch: 4 and 5 are queued already
    restored.load_state_dict(state, next_step=3)
    stopping.signal_came()  # still standing: nothing starts
    restored.start()
    try:
        time.sleep(0.3)
        assert calls == []
        stopping.signal_came(False)
        assert restored.take(3).index == 3 and calls == [(3, [half])]
    finally:
        restored.close()


def test_a_wait_that_may_not_give_up_still_ends_when_a_stop_leaves_its_batch_to_nobody():
    """Batch 0 came back too stale, and a stop signal stands: nothing starts its new sample, so the wait for it ends
    (a step outside ``may_abandon``'s reach waited for a batch nothing would produce), and the batch stays queued."""
    producer = RolloutProducer(lambda index: scored(index, 3), lambda: 3, max_staleness=1)
    producer.load_state_dict({"ready": [scored(0, -5).state()]}, next_step=0)
    stopping.signal_came()
    ended: list[BaseException] = []
    try:
        producer.start()
        waiting = threading.Thread(target=lambda: ended.append(pytest.raises(stopping.StepAbandoned, producer.take, 0).value))
        waiting.start()
        waiting.join(10)
        assert not waiting.is_alive() and ended[0].why == "rollout batch 0 had not returned"
        assert [batch["index"] for batch in producer.state_dict()["ready"]] == [0]
    finally:
        stopping.signal_came(False)
        producer.close()


def test_a_one_device_slurm_job_is_requeued_on_the_signal(tmp_path, monkeypatch, capsys):
    """A one-device strategy holds no cluster environment of its own: a one-rank SLURM job (one GPU, or a GRPO trainer
    node beside its vLLM server node) was never requeued on SIGUSR1 and ended FAILED at its time limit. SLURM's
    environment as a job step sees it, read by Lightning's own detection."""
    import lightning as L

    from lightning_rl.callbacks import RequeueOnSignal

    for name, value in {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_JOB_NAME": "grpo", "SLURM_NODELIST": "n1",
                        "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    requeue = RequeueOnSignal(tmp_path)
    try:
        requeue.setup(trainer, L.LightningModule(), "fit")
    finally:
        requeue.restore()
    assert requeue._slurm_requeue and "SLURM auto-requeueing enabled: SIGUSR1 requeues the job" in capsys.readouterr().out
