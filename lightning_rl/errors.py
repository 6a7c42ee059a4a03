"""The base class of every error about what a user gave us (a recipe value, a data file, a checkpoint, a flag); a leaf.

``lightning-rl`` turns each into one ``error:`` line naming ``key`` (the recipe key it is about) and exits with
``exit_code``, without a traceback. Anything else that escapes is a bug, and keeps its traceback.
"""

from __future__ import annotations

import sys


class UserError(Exception):
    """A mistake in what the user gave. ``key`` is the recipe key it is about, dotted from the top of the recipe
    (``model.learning_rate``) or, for an error raised by a module or datamodule, from the top of its own arguments
    (``learning_rate``: the command line puts the block in front)."""

    key: str | None = None
    exit_code: int = 2
    on_every_rank = False  # raised by every rank of a job together: only the first process says it

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        if key is not None:
            self.key = key

    def within(self, block: str) -> UserError:
        """This error with its key (and the message, where it starts with the key) read from inside ``block``."""
        if self.key is not None and not self.key.startswith(f"{block}."):
            message = str(self)
            if message.startswith(self.key):
                self.args = (f"{block}.{message}", *self.args[1:])
            self.key = f"{block}.{self.key}"
        return self

    def line(self) -> str:
        """What the command prints after ``error: ``: one line, the key first."""
        message = " ".join(str(self).split()) or type(self).__name__
        return message if self.key is None or message.startswith(self.key) else f"{self.key}: {message}"


class RecipeError(UserError, ValueError):
    """A recipe value, or a command-line flag, that cannot be used as given."""


class BatchingChanged(RecipeError):
    """A resume that would cut the rows into other batches than the run it resumes (another ``max_tokens``, packing,
    shuffle or seed): its position, a count of batches, would point at other rows. The command names every changed
    recipe key instead (``lightning_rl/same_run.py``)."""


class DataError(UserError, ValueError):
    """A problem with the training data, with the file and line (or row) it was found in."""


class RowsChanged(DataError):
    """A resume whose data holds other rows than the run it resumes trained on: the data was changed, or a recipe key
    that renders it (the tokenizer, which tokens are trained), which the command names instead where one changed."""


def report(error: UserError, say: bool = True) -> int:
    """The one way a command ends on a ``UserError``: one ``error:`` line on stderr (where ``say``), and its exit code."""
    if say:
        print(f"error: {error.line()}", file=sys.stderr)
    return error.exit_code
