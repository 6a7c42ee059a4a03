"""A tool: a Python function and the JSON schema of its arguments.

The schema comes from the function's type hints and docstring (through transformers'
`get_json_schema`, the same one chat templates render) or is given; either way it must be a valid
JSON Schema, checked with jsonschema before training starts.
"""

from __future__ import annotations

import functools
import inspect
import pickle
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from transformers.utils import get_json_schema

from lightning_rl.dotted import load_object


_OPEN = {"$ref", "allOf", "anyOf", "oneOf", "if", "additionalProperties", "patternProperties", "dependentSchemas"}


@dataclass(frozen=True)
class Tool:
    """A callable tool. `parameters` is the JSON Schema of its keyword arguments."""

    name: str
    description: str
    parameters: dict[str, Any]
    function: Callable[..., Any]

    @classmethod
    def from_function(
        cls, function: Callable[..., Any], parameters: Mapping[str, Any] | None = None,
        name: str | None = None, description: str | None = None,
    ) -> Tool:
        """Build a tool; without `parameters` the schema is read from type hints and docstring."""
        if parameters is None:
            try:
                spec = get_json_schema(function)["function"]
            except Exception as error:
                why = " ".join(str(error).split())
                why = why if len(why) <= 160 else why[:157] + "..."  # transformers' explanations run to paragraphs
                raise ValueError(
                    f"tool {getattr(function, '__name__', function)!r}: cannot derive a JSON schema from its "
                    f"type hints and docstring ({why}); give every argument a JSON-typed hint and an `Args:` line in "
                    "the docstring, or point model.tools at a Tool.from_function(fn, parameters=...) in your module"
                ) from error
            parameters = spec.get("parameters", {"type": "object", "properties": {}})
            description = description or spec.get("description", "")
        tool = cls(
            name=name or function.__name__,
            description=description or (function.__doc__ or "").strip().split("\n")[0],
            parameters=dict(parameters),
            function=function,
        )
        tool.check_schema()
        return tool

    def check_schema(self) -> None:
        """Raise a ValueError naming the tool if `parameters` is not a valid JSON Schema object."""
        import jsonschema  # here, not at the top: training without tools must not need it

        validator = jsonschema.validators.validator_for(self.parameters)
        try:
            validator.check_schema(self.parameters)
        except jsonschema.SchemaError as error:
            location = "/".join(str(p) for p in error.absolute_path) or "<root>"
            raise ValueError(f"tool {self.name!r}: invalid JSON Schema at {location}: {error.message}") from None
        if self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name!r}: the parameters schema must have type 'object'")
        self.check_callable()

    def check_callable(self) -> None:
        """Raise a ValueError naming the tool where no call its schema allows could succeed: a required argument the
        function cannot take by name (``*args``, before ``/``, or not among its parameters without ``**kwargs``), or
        a parameter without a default that a plain schema (its ``properties`` alone) never gives (the function is
        called with keywords alone)."""
        try:
            signature = inspect.signature(self.function)
        except (TypeError, ValueError):  # a builtin without a signature: its calls say what is wrong
            return
        params = list(signature.parameters.values())
        by_name = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
        properties = self.parameters.get("properties") or {}
        for name in self.parameters.get("required") or ():
            if name not in by_name and not takes_any:
                kind = next((p.kind for p in params if p.name == name), None)
                how = {inspect.Parameter.VAR_POSITIONAL: f"*{name} takes positions, and a tool is called by name",
                       inspect.Parameter.POSITIONAL_ONLY: f"{name} comes before / (positional only), and a tool is called by name"}.get(
                           kind, f"the function has no parameter {name!r}")
                raise ValueError(f"tool {self.name!r}: its schema's argument {name!r} can never be passed: {how}; give "
                                 "the function a named parameter for it")
        if _OPEN.intersection(self.parameters) or "properties" not in self.parameters:
            return  # arguments the schema gives beyond its own properties: what a call may pass is not read here
        missing = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD,
                                                                                   p.KEYWORD_ONLY) and p.name not in properties]
        if missing:
            raise ValueError(f"tool {self.name!r}: the function's parameter {missing[0]!r} has no default and the schema "
                             "never gives it, so every call would fail; add it to the schema or give it a default")

    def chat_template_spec(self) -> dict[str, Any]:
        """The tool as chat templates expect it in `apply_chat_template(tools=...)`."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def as_tool(tool: str | Tool | Callable[..., Any]) -> Tool:
    """A tool as given: a dotted path (`load_tool`), a `Tool`, or a function (as TRL takes them). Its calls run in
    worker processes, which import its function by module and name (`check_sendable`)."""
    if isinstance(tool, Tool):
        return check_sendable(tool)
    if isinstance(tool, str):
        return check_sendable(load_tool(tool))
    if callable(tool):
        return check_sendable(Tool.from_function(tool))
    raise ValueError(f"a tool is a dotted path, a function or a Tool, got {type(tool).__name__}")


def _defined_in_main(function: Any, depth: int = 0) -> bool:
    """Whether ``function`` (a function, a partial of one, a bound method, a callable object) is pickled by a name in
    the script being run: its own module, or its object's class's, is ``__main__``."""
    if depth > 4:
        return False
    if isinstance(function, functools.partial):
        return _defined_in_main(function.func, depth + 1)
    if inspect.ismethod(function):
        return _defined_in_main(function.__func__, depth + 1) or _defined_in_main(function.__self__, depth + 1)
    named = inspect.isfunction(function) or inspect.isclass(function) or inspect.isbuiltin(function)
    return (getattr(function, "__module__", None) if named else type(function).__module__) == "__main__"


def check_sendable(tool: Tool) -> Tool:
    """``tool``, whose function a worker process can import by module and name (pickled by name); a ValueError naming
    it otherwise: a lambda, a nested function, or one defined in the script being run (``__main__``: the worker's own
    ``__main__`` lacks it, and every call would fail as the tool's own error)."""
    try:
        sent = pickle.dumps(tool.function)
    except Exception as error:
        raise ValueError(f"tool {tool.name!r} runs in a worker process, so its function must be importable by its module "
                         f"path (not a lambda or a nested function): {error}") from None
    if b"__main__" in sent and _defined_in_main(tool.function):
        raise ValueError(f"tool {tool.name!r} runs in a worker process, so its function must be importable by its module "
                         "path, and it is defined in the script being run (__main__), which the worker does not run: move "
                         "it into a module beside the script and import it from there")
    return tool


def tool_reference(tool: str | Tool | Callable[..., Any]) -> str:
    """A tool as plain data (a checkpoint's hyperparameters): its dotted path, or its function's. A ``Tool`` held by
    an attribute of its function's module is named by it, which keeps its name and schema (its function's path
    rebuilt another tool from the function's hints and docstring, or none); one built where no module holds it, by
    its function's."""
    if isinstance(tool, str):
        return tool
    function = tool.function if isinstance(tool, Tool) else tool
    module = sys.modules.get(function.__module__) if isinstance(tool, Tool) else None
    held = next((name for name, value in vars(module).items() if value is tool), None) if module is not None else None
    return f"{function.__module__}:{held or function.__qualname__}"


def load_tool(path: str, parameters: Mapping[str, Any] | None = None) -> Tool:
    """A tool from a dotted path (`pkg.module:fn` or `pkg.module.fn`) to a function, or to a `Tool` (built with its
    own ``parameters`` schema, for a function whose hints and docstring do not give one)."""
    found = load_object(path, "tool")
    if isinstance(found, Tool):
        return found
    return Tool.from_function(found, parameters)
