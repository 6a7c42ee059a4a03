"""A server group whose starter dies unannounced (SIGKILL) is ended by its watcher; one stopped in order is left to
its starter. Real processes: a starter that leads a group of two sleeping processes in a session of their own, as
`VLLMServer.start` starts vLLM, and asks `orphan_watch` to watch it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from lightning_rl.rollout import orphan_watch

STARTER = """
import subprocess, threading, time
from lightning_rl.rollout import orphan_watch
server = subprocess.Popen(["sh", "-c", "sleep 600 & exec sleep 600"], start_new_session=True)
orphan_watch.start(server.pid)
threading.Thread(target=server.wait, daemon=True).start()  # reaped once it ends, as VLLMServer reaps it
print(server.pid, flush=True)
time.sleep(600)
"""


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def _gone_within(group: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _group_alive(group):
            return True
        time.sleep(0.1)
    return False


def _start() -> tuple[subprocess.Popen, int]:
    starter = subprocess.Popen([sys.executable, "-c", STARTER], stdout=subprocess.PIPE, text=True)
    group = int(starter.stdout.readline())
    return starter, group


def _ignores(pid: int, signum: int) -> bool:
    """Whether process `pid` ignores `signum` (its SigIgn mask in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    ignored = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)
    return bool(ignored & (1 << (signum - 1)))


def test_a_group_left_by_a_killed_starter_is_ended():
    starter, group = _start()
    try:
        time.sleep(2 * orphan_watch.POLL_S)
        assert _group_alive(group)  # watched, not ended, while its starter lives
        starter.kill()
        starter.wait()
        assert _gone_within(group, orphan_watch.GRACE_S + 5), "the server group outlived its SIGKILLed starter"
    finally:
        if _group_alive(group):
            os.killpg(group, signal.SIGKILL)


def test_the_watcher_ignores_group_signals_and_leaves_with_the_group():
    starter, group = _start()
    try:
        watchers = subprocess.run(["pgrep", "-f", f"orphan_watch {starter.pid} {group}"], capture_output=True, text=True)
        (watcher,) = map(int, watchers.stdout.split())
        deadline = time.monotonic() + 30  # a signal sent before the watcher set its handlers would end it
        while not _ignores(watcher, signal.SIGTERM):
            assert time.monotonic() < deadline, "the watcher never came to ignore SIGTERM"
            time.sleep(0.05)
        os.kill(watcher, signal.SIGTERM)  # what a scheduler's signal to every process would do: it stays
        time.sleep(2 * orphan_watch.POLL_S)
        assert Path(f"/proc/{watcher}/stat").read_text().split()[2] != "Z", "the watcher died of the signal"
        os.killpg(group, signal.SIGKILL)  # the starter's own stop ends the group: the watcher goes with it
        deadline = time.monotonic() + 5
        while subprocess.run(["pgrep", "-f", f"orphan_watch {starter.pid} {group}"], capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, "the watcher outlived the group it watched"
            time.sleep(0.1)
    finally:
        starter.kill()
        starter.wait()
        if _group_alive(group):
            os.killpg(group, signal.SIGKILL)
