"""What a chat template raises on a data row it cannot render, as the ValueError with which the row's reader names
the file and line (``data/train.jsonl: line 41: ...``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from jinja2 import TemplateError


@contextmanager
def rendering_row() -> Iterator[None]:
    """Around a chat template's rendering of one row: jinja's TemplateError (the template's own ``raise_exception``
    included), and the TypeError or KeyError of a template expression on a value of another shape (text parts where
    it adds strings, ``tool_calls`` that is not a list, a message without ``content``), become a ValueError."""
    try:
        yield
    except TemplateError as error:
        raise ValueError(f"the chat template cannot render the row: {error}") from None
    except (TypeError, KeyError) as error:
        raise ValueError(f"the chat template cannot render the row ({type(error).__name__}: {error})") from None
