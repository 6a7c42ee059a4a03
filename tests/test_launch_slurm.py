"""`lightning-rl launch slurm` on a real two-node SLURM cluster brought up on this machine.

The script the launcher renders for recipes/tiny/muse_lora_sft.yaml is submitted with sbatch, runs
one task per node, and trains with a process group spanning both. A second job is requeued
mid-run (as a preemption does), a third gets SLURM's requeue signal (SIGUSR1), and both must resume
from their checkpoints to the same final weights.
Both jobs train the recipe as written: a tiny Muse Spark Open, LoRA, FSDP2 across the two nodes.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_rl.launch import slurm
from slurm.cluster import PARTITION, LocalSlurmCluster, slurm_installed

RECIPE = "recipes/tiny/muse_lora_sft.yaml"
MAX_STEPS = 16
CHECKPOINT_EVERY = 4
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    assert slurm_installed(), "SLURM is not installed: `make slurm` installs slurmctld, slurmd and the client"
    # Three CPUs per node: the three jobs run side by side, one task per node each.
    cluster = LocalSlurmCluster(tmp_path_factory.mktemp("slurm"), cpus_per_node=3)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def submit(cluster: LocalSlurmCluster, run_dir: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Render and submit through the launcher's own `main`, exactly as `lightning-rl launch slurm` does."""
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    before = set(cluster.run("squeue", "-h", "-o", "%i").stdout.split())
    code = slurm.main([
        "slurm", RECIPE, "--nodes", "2", "--gpus-per-node", "1", "--partition", PARTITION,
        "--log-dir", str(run_dir / "logs"), "--script", str(run_dir / "job.sbatch"), "--",
        f"--output_dir={run_dir / 'out'}", f"--model.model_name_or_path={model_dir}",
        f"--trainer.max_steps={MAX_STEPS}", f"--checkpoint_every_n_steps={CHECKPOINT_EVERY}",
    ])  # fmt: skip
    assert code == 0
    (job_id,) = set(cluster.run("squeue", "-h", "-o", "%i").stdout.split()) - before
    return job_id


def rank_logs(run_dir: Path, job_id: str) -> dict[int, str]:
    folder = next((run_dir / "logs").glob(f"*-{job_id}"))
    return {int(p.stem.split("-")[1]): p.read_text() for p in folder.glob("rank-*.log")}


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted((run_dir / "out" / "hf").glob("*.safetensors")):
        tensors.update(load_file(shard))
    assert tensors, f"no exported weights in {run_dir / 'out' / 'hf'}"
    return tensors


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "out" / "summary.json").read_text())


def has_first_checkpoint(run_dir: Path) -> bool:
    checkpoints = run_dir / "out" / "checkpoints"
    return bool(list(checkpoints.glob(f"*step={CHECKPOINT_EVERY}.ckpt"))) and (checkpoints / "last.ckpt").exists()


def preempt_after_first_checkpoint(cluster: LocalSlurmCluster, jobs: dict[str, tuple[str, Path, bool]]) -> None:
    """Preempt each job once it has saved a checkpoint and is still training: ``scontrol requeue`` (SIGTERM now),
    or with its ``signal`` flag the SIGUSR1 that ``--signal=SIGUSR1@90`` sends before the time limit (the job then
    checkpoints where it is and requeues itself). The jobs are watched together, so one that reaches its
    checkpoint while another is still starting is preempted then, not after it has trained on to the end."""
    waiting = dict(jobs)
    deadline = time.monotonic() + 600  # three 2-rank jobs on a loaded 2-core machine
    while waiting:
        for name, (job_id, run_dir, signal) in list(waiting.items()):
            if has_first_checkpoint(run_dir):
                time.sleep(0.5)  # let last.ckpt finish writing: the kill should land mid-training, not mid-save
                if signal:
                    cluster.run("scancel", "--signal=USR1", job_id)  # to every task of the job's steps, as SLURM does
                else:
                    cluster.run("scontrol", "requeue", job_id)
                del waiting[name]
                continue
            state = cluster.job_state(job_id)
            if state in DONE:
                logs = "\n".join(rank_logs(run_dir, job_id).values()) if any((run_dir / "logs").glob(f"*-{job_id}")) else ""
                raise AssertionError(f"job {job_id} ({name}) ended {state} before its first checkpoint:\n{logs[-3000:]}")
        assert time.monotonic() < deadline, f"no checkpoint after 600 s from {', '.join(waiting)}"
        time.sleep(0.05)


def release_when_requeued(cluster: LocalSlurmCluster, job_id: str) -> None:
    cluster.wait_for(job_id, {"PENDING"}, timeout=300)
    # SLURM holds a requeued job back for a while before it may start again; skip that wait here.
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")


@pytest.fixture(scope="module")
def runs(cluster: LocalSlurmCluster, tiny_muse_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """Three jobs side by side on the same two nodes: one left alone, one requeued mid-run, one sent SIGUSR1."""
    dirs = {name: tmp_path_factory.mktemp(name) for name in ("uninterrupted", "requeued", "signalled")}
    with pytest.MonkeyPatch.context() as monkeypatch:
        jobs = {name: submit(cluster, run_dir, tiny_muse_path, monkeypatch) for name, run_dir in dirs.items()}
    preempt_after_first_checkpoint(cluster, {name: (jobs[name], dirs[name], name == "signalled") for name in ("requeued", "signalled")})
    for name in ("requeued", "signalled"):
        release_when_requeued(cluster, jobs[name])
    states = {name: cluster.wait_for(job_id, DONE, timeout=600) for name, job_id in jobs.items()}
    return {name: (dirs[name], jobs[name], states[name]) for name in jobs}


def test_rendered_script_trains_on_two_nodes(runs) -> None:
    run_dir, job_id, state = runs["uninterrupted"]
    logs = rank_logs(run_dir, job_id)
    assert state == "COMPLETED", f"job {job_id} ended {state}:\n" + "\n".join(logs.values())
    assert sorted(logs) == [0, 1], "one log per rank"
    for rank, text in logs.items():
        assert f"GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/2" in text
        assert "SLURM auto-requeueing enabled" in text
    summary = read_summary(run_dir)
    assert summary["steps"] == MAX_STEPS and summary["world_size"] == 2
    assert summary["last_loss"] < summary["first_loss"]
    assert (run_dir / "out" / "checkpoints" / "last.ckpt").exists()


def test_requeued_job_resumes_to_the_same_weights(runs, cluster: LocalSlurmCluster) -> None:
    run_dir, job_id, state = runs["requeued"]
    logs = rank_logs(run_dir, job_id)
    assert state == "COMPLETED", f"job {job_id} ended {state}:\n" + "\n".join(logs.values())
    assert cluster.job_field(job_id, "Restarts") == "1"
    assert "Restored all states from the checkpoint" in logs[0], "the requeued run started over instead of resuming"
    assert read_summary(run_dir)["steps"] == MAX_STEPS
    reference, resumed = final_weights(runs["uninterrupted"][0]), final_weights(run_dir)
    assert reference.keys() == resumed.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=0, msg=f"{name} differs after resume")


def test_requeue_signal_checkpoints_on_every_rank_and_resumes_to_the_same_weights(runs, cluster: LocalSlurmCluster) -> None:
    run_dir, job_id, state = runs["signalled"]
    logs = rank_logs(run_dir, job_id)
    assert state == "COMPLETED", f"job {job_id} ended {state}:\n" + "\n".join(logs.values())
    assert cluster.job_field(job_id, "Restarts") == "1"
    saved = re.search(r"requeue signal: checkpoint (\S+hpc_ckpt_(\d+)\.ckpt) at step \d+; requeueing job " + job_id, logs[0])
    assert saved, logs[0][-3000:]
    assert CHECKPOINT_EVERY <= int(saved[2]) < MAX_STEPS  # saved where the signal found it, after the first checkpoint
    assert f"Restored all states from the checkpoint at {saved[1]}" in logs[0], "resumed from another checkpoint"
    assert read_summary(run_dir)["steps"] == MAX_STEPS
    reference, resumed = final_weights(runs["uninterrupted"][0]), final_weights(run_dir)
    for name, tensor in reference.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=0, msg=f"{name} differs after resume")


def test_unknown_partition_is_refused_by_name(cluster: LocalSlurmCluster, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    script = tmp_path / "job.sbatch"
    code = slurm.main(["slurm", RECIPE, "--nodes", "2", "--gpus-per-node", "1", "--partition", "gpu-h100", "--script", str(script)])
    assert code == 2 and not script.exists()
    assert f"partition 'gpu-h100' does not exist on this cluster; sinfo lists: {PARTITION}" in capsys.readouterr().err


def test_a_job_past_the_partitions_nodes_is_refused_before_it_waits_for_ever(cluster: LocalSlurmCluster, tmp_path: Path, monkeypatch, capsys) -> None:
    """SLURM accepts a job past a partition's limits (EnforcePartLimits=NO, its default) and leaves it pending, its
    reason PartitionNodeLimit or PartitionTimeLimit: refused by name before anything is written or submitted."""
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    script = tmp_path / "job.sbatch"
    code = slurm.main(["slurm", RECIPE, "--nodes", "3", "--gpus-per-node", "1", "--partition", PARTITION, "--script", str(script)])
    assert code == 2 and not script.exists()
    assert f"error: --nodes 3: partition '{PARTITION}' has 2 nodes" in capsys.readouterr().err
    # The partition's time limit read as sinfo gives it: minutes, MM:SS, HH:MM:SS or D-HH[:MM[:SS]].
    assert [slurm.slurm_minutes(t) for t in ("10", "10:30", "1:00:00", "2-00", "1-12:00", "1-00:00:30", "infinite", "UNLIMITED")] == [
        10, 10.5, 60, 2880, 2160, 1440.5, math.inf, math.inf]
