"""Ends a process group its starter left behind: ``python -m lightning_rl.rollout.orphan_watch STARTER GROUP``.

A vLLM server runs in a session of its own, so signals meant for the trainer's group (SIGINT at a terminal, a
scheduler's SIGTERM to the group) reach the trainer, which then stops the server in order. A trainer that dies
without that (SIGKILL, the OOM killer) would leave the server running, holding its memory and its port. This small
process, started beside the server in a session of its own too, watches the starter: once the starter is gone it
sends the group SIGTERM, then SIGKILL to whatever is left, and exits. It also exits once the group is gone. It
ignores the signals a group gets, so only the starter's end (or a kill by PID) ends it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL_S = 0.5
GRACE_S = 10.0


def start(group: int) -> subprocess.Popen[bytes]:
    """Watch process group ``group`` (a process's PID, leading its own session) on behalf of this process."""
    command = [sys.executable, "-m", __name__, str(os.getpid()), str(group)]
    return subprocess.Popen(command, start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _end_group(group: int) -> None:
    try:
        os.killpg(group, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and _group_alive(group):
        time.sleep(0.1)
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


def watch(starter: int, group: int) -> None:
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)
    # Started by ``starter``: it is this process's parent until it dies, when the process is adopted by another.
    while _group_alive(group):
        if os.getppid() != starter:
            _end_group(group)
            return
        time.sleep(POLL_S)


if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]))
