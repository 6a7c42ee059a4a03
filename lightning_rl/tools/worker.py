"""The process tool calls run in: started by `ToolExecutor`, one call at a time, until its socket closes.

A call that exits (`sys.exit`), raises anything (`BaseException` included), prints without end (its
stdout and stderr are discarded) or returns megabytes (cut to `max_chars` here, before it travels) is
answered with a message; one that never returns is killed by the executor, with its whole process group.
The worker (with its process group) dies within a second of the process that started it, even mid-call, so a
killed run leaves no tool running.

Started as ``python -c "from lightning_rl.tools.worker import main; main()" FD PARENT_PID MAX_CHARS`` (FD: its
end of a socket pair). Protocol, pickled messages: the worker sends ``"ready"``; then for each
``(function, arguments)`` it receives, it answers ``("ok", text)`` or ``("raised", "Type: message")``.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any


def truncate(text: str, max_chars: int) -> str:
    """`text` in at most `max_chars` characters: its beginning, then how much was cut."""
    if len(text) <= max_chars:
        return text
    keep = max_chars
    for _ in range(2):  # the note's own length depends on the count it gives
        note = f"\n[... {len(text) - keep} more characters cut]"
        keep = max(max_chars - len(note), 0)
    return (text[:keep] + note)[:max_chars]


def _die_with(parent_pid: int) -> None:
    """Watch the parent from a thread of our own: a hung call does not stop it, as the main thread would."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os.killpg(0, signal.SIGKILL)  # our process group: this worker and whatever its tool started

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _text(result: object) -> str:
    """What the model reads of a tool's result: its text; content blocks of text alone (``[{"type": "text", "text":
    ...}]``, as TRL passes a list through to the template) joined, as a conversation's text parts are."""
    if isinstance(result, list) and result and all(isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in result):
        return "".join(block["text"] for block in result)
    return str(result)


def _unicode(text: str) -> str:
    """``text`` as a tokenizer takes it: a lone surrogate (bytes ``os.fsdecode`` could not read) becomes ``?``."""
    return text.encode("utf-8", "replace").decode("utf-8")


def serve(connection: Connection, max_chars: int) -> None:
    connection.send("ready")
    while True:
        try:
            payload = connection.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            function, arguments = pickle.loads(payload)
            result = function(**arguments)
            if inspect.isawaitable(result):  # an `async def` tool (TRL runs those too): its result, not the coroutine
                result = asyncio.run(_awaited(result))
            reply = ("ok", truncate(_unicode(_text(result)), max_chars))
        except BaseException as error:  # SystemExit and KeyboardInterrupt too: the tool's failure, not ours
            reply = ("raised", truncate(_unicode(f"{type(error).__name__}: {error}"), max_chars))
        connection.send(reply)


def main() -> None:
    fd, parent, max_chars = (int(arg) for arg in sys.argv[1:4])
    _die_with(parent)
    serve(Connection(fd), max_chars)
