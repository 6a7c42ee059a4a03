"""Built-in tools."""

from __future__ import annotations

from typing import Literal


def calculator(operation: Literal["add", "subtract", "multiply", "divide"], a: int, b: int) -> str:
    """Apply an arithmetic operation to two integers.

    Args:
        operation: Which operation to apply.
        a: The left operand.
        b: The right operand.
    """
    if operation == "add":
        result = a + b
    elif operation == "subtract":
        result = a - b
    elif operation == "multiply":
        result = a * b
    else:
        if b == 0:
            raise ZeroDivisionError("division by zero")
        result = a / b
    return f"{result:g}" if isinstance(result, float) else str(result)
