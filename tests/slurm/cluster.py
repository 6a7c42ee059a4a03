"""A real two-node SLURM cluster on this one machine, for tests.

Both slurmd daemons run here under different node names and ports; the controller authenticates
with auth/none, so no munge is needed. Every daemon is started by this module and stopped by its
PID (slurmd deletes its own pid file on exit, so the Popen handle is what we keep).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo", "sacct")
PARTITION = "debug"


def slurm_installed() -> bool:
    return all(shutil.which(name) for name in DAEMONS[:5])


def _port_pair_free(base: int) -> bool:
    for port in (base, base + 1, base + 2):
        with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def _free_ports() -> int:
    """Three consecutive free ports: controller, node 1, node 2."""
    for base in range(17000 + os.getpid() % 1000 * 3, 30000, 3):
        if _port_pair_free(base):
            return base
    raise RuntimeError("no three consecutive free ports between 17000 and 30000")


def _config(root: Path, host: str, base_port: int, nodes: int, cpus_per_node: int) -> str:
    return f"""\
ClusterName=lrltest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={base_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
MpiDefault=none
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
SlurmdParameters=config_overrides
ReturnToService=2
MailProg=/bin/true
MinJobAge=600
KillWait=2
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
NodeName=n[1-{nodes}] NodeHostname={host} NodeAddr=127.0.0.1 Port=[{base_port + 1}-{base_port + nodes}] CPUs={cpus_per_node} State=UNKNOWN
PartitionName={PARTITION} Nodes=n[1-{nodes}] Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class LocalSlurmCluster:
    root: Path
    nodes: int = 2
    cpus_per_node: int = 1
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        """Environment for SLURM client commands (and for jobs, which inherit it through sbatch)."""
        return {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}

    def start(self, timeout: float = 120.0) -> None:
        for sub in ("state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        host = socket.gethostname()
        (self.root / "slurm.conf").write_text(_config(self.root, host, _free_ports(), self.nodes, self.cpus_per_node))
        self._spawn("slurmctld", ["slurmctld", "-D", "-i"])
        for index in range(1, self.nodes + 1):
            (self.root / "spool" / f"n{index}").mkdir(exist_ok=True)
            self._spawn(f"slurmd-n{index}", ["slurmd", "-D", "-N", f"n{index}"])
        self._wait_until_idle(timeout)

    def _spawn(self, name: str, command: list[str]) -> None:
        log = open(self.root / f"{name}.stdout", "wb")
        self.processes[name] = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def _wait_until_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode}; see {self.root}/{name}.stdout")
            states = self.run("sinfo", "-h", "-N", "-o", "%t", check=False).stdout.split()
            if len(states) == self.nodes and all(state == "idle" for state in states):
                return
            time.sleep(0.3)
        raise TimeoutError(f"SLURM nodes not idle after {timeout}s; logs in {self.root}")

    def run(self, *command: str, check: bool = True, cwd: Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(list(command), env=self.env, capture_output=True, text=True, check=check, cwd=cwd)

    def job_state(self, job_id: str) -> str:
        out = self.run("scontrol", "show", "job", job_id, "-o", check=False).stdout
        for item in out.split():
            if item.startswith("JobState="):
                return item.split("=", 1)[1]
        return "UNKNOWN"

    def job_field(self, job_id: str, key: str) -> str:
        out = self.run("scontrol", "show", "job", job_id, "-o").stdout
        for item in out.split():
            if item.startswith(f"{key}="):
                return item.split("=", 1)[1]
        raise KeyError(f"{key} not in `scontrol show job {job_id}`")

    def wait_for(self, job_id: str, states: set[str], timeout: float) -> str:
        deadline = time.monotonic() + timeout
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in states:
                return state
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {state} after {timeout}s (wanted one of {sorted(states)})")

    def cancel_all_jobs(self, timeout: float = 20.0) -> None:
        """Cancel this cluster's jobs and wait until their steps are gone, so no task outlives the daemons."""
        job_ids = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
        if job_ids:
            self.run("scancel", *job_ids, check=False)
        deadline = time.monotonic() + timeout
        while job_ids and time.monotonic() < deadline:
            states = {self.job_state(job_id) for job_id in job_ids}
            if states <= {"CANCELLED", "COMPLETED", "FAILED", "TIMEOUT", "NODE_FAIL", "UNKNOWN", "PREEMPTED"}:
                return
            time.sleep(0.3)

    def stop(self) -> None:
        """Stop every daemon this cluster started, by its PID: TERM, then KILL after a grace period."""
        if self.processes.get("slurmctld") is not None and self.processes["slurmctld"].poll() is None:
            self.cancel_all_jobs()
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()
        self._stop_stray_step_daemons()

    def _stop_stray_step_daemons(self) -> None:
        """slurmd starts a slurmstepd per job step, detached from it; one still winding down when slurmd
        stops is left behind. They carry this cluster's SLURM_CONF, which is how they are found."""
        marker = f"SLURM_CONF={self.root / 'slurm.conf'}".encode()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                if marker in (proc / "environ").read_bytes().split(b"\0"):
                    os.kill(int(proc.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                continue
