"""Tools that misbehave, each in its own way, for the fault tests of the tool executor.

A module of its own with no heavy imports: tool workers import it to run these.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time


def exits(code: int) -> str:
    """Exit the interpreter.

    Args:
        code: The exit status.
    """
    sys.exit(code)


class Escape(BaseException):
    """Not an Exception: `except Exception` does not catch it."""


def raises_base() -> str:
    """Raise a BaseException."""
    raise Escape("out of here")


def interrupts() -> str:
    """Raise KeyboardInterrupt, as a Ctrl-C would."""
    raise KeyboardInterrupt


def dies() -> str:
    """End the process at once, without cleanup."""
    os._exit(7)


def prints_megabytes(megabytes: int) -> str:
    """Print a lot, then answer.

    Args:
        megabytes: How much to print.
    """
    line = "x" * 1023 + "\n"
    for _ in range(megabytes * 1024):
        sys.stdout.write(line)
    print("and to stderr", file=sys.stderr)
    return "printed"


def returns_megabytes(megabytes: int) -> str:
    """Return a very long answer.

    Args:
        megabytes: How long.
    """
    return "y" * (megabytes * 2**20)


def sleeps_forever() -> str:
    """Never return."""
    while True:
        time.sleep(3600)


def slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "done"


def hangs_with_a_child(pid_file: str) -> str:
    """Start a child process, write both pids, then never return.

    Args:
        pid_file: Where to write the pids.
    """
    import subprocess

    child = subprocess.Popen(["sleep", "600"])
    with open(pid_file, "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    sleeps_forever()
    return "never"


# The calculator's signature, so that a model trained to call `calculator` calls these.


def hanging_calculator(operation: str, a: int, b: int) -> str:
    """Never answer.

    Args:
        operation: Which operation to apply.
        a: The left operand.
        b: The right operand.
    """
    sleeps_forever()
    return "never"


def flooding_calculator(operation: str, a: int, b: int) -> str:
    """Answer with megabytes.

    Args:
        operation: Which operation to apply.
        a: The left operand.
        b: The right operand.
    """
    return returns_megabytes(5)


async def waits_then_adds(a: int, b: int) -> int:
    """Add two numbers once an await has passed, as an `async def` tool does.

    Args:
        a: The first.
        b: The second.
    """
    await asyncio.sleep(0.01)
    return a + b


def answers_in_blocks(city: str) -> list[dict]:
    """The weather in a city, as content blocks of text.

    Args:
        city: The city.
    """
    return [{"type": "text", "text": f"{city}: "}, {"type": "text", "text": "sunny"}]


def lists_a_folder(path: str) -> str:
    """A folder's listing, its file names read as `os.fsdecode` reads bytes that are not UTF-8 (a lone surrogate).

    Args:
        path: The folder.
    """
    return os.fsdecode(b"report-\xff.txt") if path else ""
