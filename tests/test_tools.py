"""Tools typed by JSON schema: schemas, argument coercion, every kind of bad call, tools that exit, raise
BaseException, flood or hang (each in a real worker process), and multi-turn rollouts through a real
transformers model that has learned to call a tool."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from lightning_rl.packing.tree import pack_sequences
from lightning_rl.rollout.base import SamplingConfig
from lightning_rl.rollout.hf import HFRolloutEngine
from lightning_rl.tools import Tool, ToolCall, ToolExecutor, load_tool, parse_tool_calls, tool_reference
from lightning_rl.tools.arguments import coerce, validated_arguments
from lightning_rl.tools.builtin import calculator
from lightning_rl.errors import RecipeError
from lightning_rl.rollout.conversation import ToolConversation, check_tool_call_format, distinct_tool_calls, tool_response_ids
from support.tool_faults import answers_in_blocks, flooding_calculator, hanging_calculator, lists_a_folder, slow, waits_then_adds
from support.tool_model import train_tool_calling_model

TESTS = Path(__file__).resolve().parent


def label(key: str, count: int, ratio: float = 1.0, loud: bool = False) -> str:
    """Make a label.

    Args:
        key: The text.
        count: How many times.
        ratio: A scale.
        loud: Shout it.
    """
    return (key * count).upper() if loud else key * count


def test_schema_comes_from_type_hints_and_docstring():
    tool = Tool.from_function(label)
    assert tool.name == "label" and tool.description == "Make a label."
    assert tool.parameters["properties"]["count"] == {"type": "integer", "description": "How many times."}
    assert tool.parameters["properties"]["ratio"]["type"] == "number"
    assert tool.parameters["required"] == ["key", "count"]
    assert tool.chat_template_spec()["function"]["name"] == "label"
    assert load_tool("lightning_rl.tools.builtin:calculator").parameters["properties"]["operation"]["enum"] == [
        "add", "subtract", "multiply", "divide"
    ]


UNDOCUMENTED = Tool.from_function(lambda x: x, {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}, name="echo")


def test_invalid_schemas_and_paths_are_refused():
    with pytest.raises(ValueError, match="tool 'label': invalid JSON Schema at properties/key/type"):
        Tool.from_function(label, parameters={"type": "object", "properties": {"key": {"type": "word"}}})
    with pytest.raises(ValueError, match="must have type 'object'"):
        Tool.from_function(label, parameters={"type": "string"})
    with pytest.raises(ValueError, match=r"cannot derive a JSON schema .*or point model.tools at a Tool.from_function\(fn, parameters=...\)"):
        Tool.from_function(lambda x: x)
    # A schema no call could satisfy: an argument the function cannot take by name, or a parameter never given.
    number = {"type": "object", "properties": {"args": {"type": "integer"}}, "required": ["args"]}
    with pytest.raises(ValueError, match=r"tool 'total': its schema's argument 'args' can never be passed: \*args takes positions"):
        Tool.from_function(lambda *args: sum(args), number, name="total")
    with pytest.raises(ValueError, match="'args' can never be passed: args comes before /"):
        Tool.from_function(lambda args, /: args, number, name="total")
    with pytest.raises(ValueError, match="'args' can never be passed: the function has no parameter 'args'"):
        Tool.from_function(lambda x: x, number, name="total")
    with pytest.raises(ValueError, match="the function's parameter 'y' has no default and the schema never gives it"):
        Tool.from_function(lambda args, y: args, number, name="total")
    assert Tool.from_function(lambda **kwargs: kwargs, number, name="total").parameters == number
    # Schemas a call can satisfy are taken: an optional argument the function lacks (that call alone fails), and
    # arguments given beyond the schema's own properties.
    optional = {"type": "object", "properties": {"args": {"type": "integer"}, "verbose": {"type": "boolean"}}, "required": ["args"]}
    assert Tool.from_function(lambda args: args, optional, name="total").parameters == optional
    for given in ({"type": "object"}, {"type": "object", "additionalProperties": {"type": "integer"}},
                  {"type": "object", "allOf": [number]}, {"type": "object", "properties": {}, "$ref": "#/$defs/n", "$defs": {"n": number}}):
        assert Tool.from_function(lambda args: args, given, name="total").parameters == given
    # ... which load_tool takes as it is: a function without a usable docstring, its schema given.
    given = load_tool("test_tools:UNDOCUMENTED")
    assert given is UNDOCUMENTED and given.parameters["required"] == ["x"]
    # A checkpoint records it by that name, which loads it again (its lambda's path named no tool).
    assert tool_reference(UNDOCUMENTED) == "test_tools:UNDOCUMENTED" and tool_reference(label) == "test_tools:label"
    with pytest.raises(ValueError, match="no module 'no' in .*the installed packages"):
        load_tool("no.such:tool")


def test_quoted_numbers_become_numbers_only_where_the_schema_says_so():
    schema = Tool.from_function(label).parameters
    assert validated_arguments({"key": "7", "count": "7"}, schema) == {"key": "7", "count": 7}
    assert validated_arguments({"key": "a", "count": 2, "ratio": "0.5", "loud": "true"}, schema) == {
        "key": "a", "count": 2, "ratio": 0.5, "loud": True,
    }
    assert coerce(3.0, {"type": "integer"}) == 3 and coerce("x", {"type": "integer"}) == "x"
    assert coerce(["1", "2"], {"type": "array", "items": {"type": "integer"}}) == [1, 2]
    with pytest.raises(ValueError, match="count: 'seven' is not of type 'integer'"):
        validated_arguments({"key": "a", "count": "seven"}, schema)
    with pytest.raises(ValueError, match="'count' is a required property"):
        validated_arguments({"key": "a"}, schema)


def optional_label(word: str, times: int | None = None, sep: str | None = " ") -> str:
    """Repeat a word.

    Args:
        word: the word.
        times: how often (once when null).
        sep: between them (none when null).
    """
    return (sep or "").join([word] * (times or 1))


def test_an_optional_argument_takes_null_and_a_number_is_read_as_json_writes_one():
    """transformers marks ``x: str | None`` ``nullable``, which JSON Schema does not know: an explicit null was
    refused as an invalid call (the rollout counted a failure where the function takes it). Python's int() and float()
    read "1_000", Arabic-Indic digits, "nan" and "1e999" as numbers."""
    schema = Tool.from_function(optional_label).parameters
    assert validated_arguments({"word": "a", "times": None, "sep": None}, schema) == {"word": "a", "times": None, "sep": None}
    assert validated_arguments({"word": "a", "times": "2"}, schema) == {"word": "a", "times": 2}
    with pytest.raises(ValueError, match="word: None is not of type 'string'"):
        validated_arguments({"word": None}, schema)
    # An optional choice (its enum takes null too), and an argument that is named `nullable` (no keyword there).
    choice = {"type": "object", "properties": {"mode": {"type": "string", "enum": ["x", "y"], "nullable": True},
              "nullable": {"type": "boolean"}}, "required": ["nullable"]}  # fmt: skip
    assert validated_arguments({"mode": None, "nullable": "true"}, choice) == {"mode": None, "nullable": True}
    with pytest.raises(ValueError, match="nullable: 'maybe' is not of type 'boolean'"):
        validated_arguments({"nullable": "maybe"}, choice)
    for text in ("1_000", "\u0663", "nan", "1e999"):
        assert coerce(text, {"type": "integer"}) == text and coerce(text, {"type": "number"}) == text
    assert coerce(" -12 ", {"type": "integer"}) == -12 and coerce("2.5e-3", {"type": "number"}) == 0.0025


def test_every_kind_of_bad_call_becomes_an_error_message_and_is_counted():
    # 2 s: what a loaded machine may take to answer an ordinary call (the first one imports the tool's module)
    executor = ToolExecutor([Tool.from_function(calculator), Tool.from_function(slow)], timeout_s=2.0)
    texts = {
        None: '<tool_call>{"name": "calculator", "arguments": {"operation": "multiply", "a": "6", "b": 7}}</tool_call>',
        "malformed": '<tool_call>{"name": "calculator", "arguments": {</tool_call>',
        "unknown_tool": '<tool_call>{"name": "weather", "arguments": {}}</tool_call>',
        "invalid_arguments": '<tool_call>{"name": "calculator", "arguments": {"operation": "pow", "a": 1, "b": 2}}</tool_call>',
        "invalid_arguments ": '<tool_call>{"name": "calculator", "arguments": {"operation": "add", "a": 1, "b": 2, "c": 3}}</tool_call>',
        "raised": '<tool_call>{"name": "calculator", "arguments": {"operation": "divide", "a": 1, "b": 0}}</tool_call>',
        "timeout": '<tool_call>{"name": "slow", "arguments": {"seconds": 30}}</tool_call>',
    }
    outcomes = {kind: executor.run(parse_tool_calls(text)[0]) for kind, text in texts.items()}
    assert outcomes[None].ok and outcomes[None].content == "42" and outcomes[None].arguments["a"] == 6
    assert "not valid JSON" in outcomes["malformed"].content
    assert "unknown tool 'weather' (available: calculator, slow)" in outcomes["unknown_tool"].content
    assert "operation: 'pow' is not one of" in outcomes["invalid_arguments"].content
    # The schema allows extra properties; the function does not: refused before it runs, not a `raised`.
    assert "unexpected keyword argument 'c'" in outcomes["invalid_arguments "].content
    assert "calculator raised ZeroDivisionError: division by zero" in outcomes["raised"].content
    assert "slow did not finish within 2 s" in outcomes["timeout"].content
    for kind, outcome in outcomes.items():
        kind = kind and kind.strip()
        assert outcome.failure == kind and outcome.content.startswith("Error: ") == (kind is not None)
    assert executor.calls == 7
    assert dict(executor.failures) == {"malformed": 1, "unknown_tool": 1, "invalid_arguments": 2, "raised": 1, "timeout": 1}
    assert parse_tool_calls('<tool_call>{"name": "slow"')[0].error == "tool call is not closed with </tool_call>"
    assert parse_tool_calls('<tool_call>{"name": "x", "arguments": "{\\"a\\": 1}"}</tool_call>')[0].arguments == {"a": 1}
    executor.close()


def test_an_async_tool_is_awaited_and_its_result_is_what_the_model_reads():
    executor = ToolExecutor([Tool.from_function(waits_then_adds)])
    outcome = executor.run(parse_tool_calls('<tool_call>{"name": "waits_then_adds", "arguments": {"a": 2, "b": 3}}</tool_call>')[0])
    executor.close()
    assert (outcome.content, outcome.failure) == ("5", None)  # not "<coroutine object ...>"


def test_a_result_of_text_blocks_is_read_as_their_text():
    """TRL passes a list result to the template as content; its text blocks were read as the list's repr here."""
    executor = ToolExecutor([Tool.from_function(answers_in_blocks)])
    outcome = executor.run(parse_tool_calls('<tool_call>{"name": "answers_in_blocks", "arguments": {"city": "Paris"}}</tool_call>')[0])
    executor.close()
    assert (outcome.content, outcome.failure) == ("Paris: sunny", None)


def test_a_result_with_bytes_that_are_not_utf8_reaches_the_tokenizer_as_text(tiny_tokenizer):
    executor = ToolExecutor([Tool.from_function(lists_a_folder)])
    outcome = executor.run(parse_tool_calls('<tool_call>{"name": "lists_a_folder", "arguments": {"path": "."}}</tool_call>')[0])
    executor.close()
    assert (outcome.content, outcome.failure) == ("report-?.txt", None)
    ids = tool_response_ids(tiny_tokenizer, [{"role": "tool", "name": "lists_a_folder", "content": outcome.content}])
    assert "report-?.txt" in tiny_tokenizer.decode(ids)


def test_a_call_that_cannot_be_read_stays_in_the_reply_text_not_in_its_tool_calls():
    """A call of bad JSON, or cut off, reached rewards as ``tool_calls`` with name None (TRL's parsing leaves such a
    reply as text alone): rewards reading ``function.name`` failed on it."""
    from lightning_rl.rollout.conversation import _as_written

    good = '<tool_call>{"name": "calculator", "arguments": {"a": 1}}</tool_call>'
    calls = parse_tool_calls(good + '<tool_call>{"name": "calculator", "arguments": {</tool_call><tool_call>{"name": "calc')
    assert [c.error is None for c in calls] == [True, False, False]
    assert _as_written(calls) == [{"type": "function", "function": {"name": "calculator", "arguments": {"a": 1}}}]


@pytest.fixture(scope="module")
def tool_calling_model():
    return train_tool_calling_model()


def test_multi_turn_rollouts_run_tools_and_feed_back_results_and_errors(tool_calling_model):
    model, tokenizer, prompts, bad_result = tool_calling_model
    executor = ToolExecutor([Tool.from_function(calculator)])
    conversation = ToolConversation(HFRolloutEngine(model), tokenizer, executor, max_turns=3)
    batch = conversation.generate(prompts, [2], lambda turn: SamplingConfig(max_new_tokens=48, temperature=0))
    good, bad = batch.groups[0][0], batch.groups[1][0]
    assert len(batch.groups[0]) == len(batch.groups[1]) == 2
    assert good.metadata["tool_calls"] == [
        {"call_id": 0, "name": "calculator", "arguments": {"operation": "add", "a": 7, "b": 5}, "content": "12",
         "failure": None}
    ]
    assert good.metadata["final_reply"] == "12"
    assert bad.metadata["tool_calls"][0]["failure"] == "invalid_arguments"
    assert bad.metadata["tool_calls"][0]["content"] == bad_result and "'seven' is not of type 'integer'" in bad_result
    # Rewards read the call as the model wrote it (TRL's messages), though the schema refused it ({} before).
    assert bad.messages[0]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": {"operation": "add", "a": "seven", "b": 1}}
    assert executor.failures["invalid_arguments"] == 2  # both samples of the second prompt
    # The tool's output is in the history but is not trained; the model's own tokens are.
    response = tokenizer.decode([t for t, m in zip(good.completion_ids, good.completion_mask) if not m])
    assert "<tool_response>12</tool_response>" in response
    assert sum(good.completion_mask) < len(good.completion_ids)
    assert all(lp == 0.0 for lp, m in zip(good.logprobs, good.completion_mask) if not m)
    assert [m["role"] for m in good.messages] == ["assistant", "tool", "assistant"]
    # On the last allowed turn the call is not run, yet the reply still holds it (it lost its `tool_calls` key).
    last = ToolConversation(HFRolloutEngine(model), tokenizer, executor, max_turns=1)
    (unrun, _), _ = last.generate(prompts, [2], lambda turn: SamplingConfig(max_new_tokens=48, temperature=0)).groups
    assert unrun.messages == [{"role": "assistant", "content": unrun.metadata["final_reply"], "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"operation": "add", "a": "7", "b": 5}}}]}]  # fmt: skip (as written: a quoted 7)
    assert unrun.metadata["tool_calls"] == []


def test_forked_turns_make_nested_forks_that_tree_packing_shares(tool_calling_model):
    model, tokenizer, prompts, _ = tool_calling_model
    engine = HFRolloutEngine(model)
    executor = ToolExecutor([Tool.from_function(calculator)])
    conversation = ToolConversation(engine, tokenizer, executor, max_turns=2)
    sampling = lambda turn: SamplingConfig(max_new_tokens=48, temperature=1.0, seed=turn)  # noqa: E731
    batch = conversation.generate(prompts[:1], [2, 3], sampling)
    leaves = batch.groups[0]
    assert len(leaves) == 6 and {r.group_id for r in leaves} == {0}
    # Each first reply's call ran once; its 3 continuations share the record, and it is counted once.
    assert sum(len(r.metadata["tool_calls"]) for r in leaves) == 6
    assert len(distinct_tool_calls(leaves)) == executor.calls == 2
    first_turns = {tuple(r.completion_ids[: r.completion_mask.index(False)]) for r in leaves}
    assert len(first_turns) <= 2  # 2 first replies, each continued 3 times
    packed = pack_sequences([r.sequence for r in leaves], [r.loss_mask for r in leaves])
    shared = len(prompts[0]) + sum(len(t) for t in first_turns)
    assert packed.num_unique_tokens <= packed.num_flat_tokens - 5 * len(prompts[0])
    assert packed.num_unique_tokens >= shared


def _call(name: str, **arguments) -> ToolCall:
    return parse_tool_calls(f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>")[0]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"  # a zombie: dead, waiting to be reaped


def test_tools_that_exit_raise_base_exceptions_flood_or_hang_are_contained(tmp_path):
    faults = ["exits", "raises_base", "interrupts", "dies", "prints_megabytes", "returns_megabytes", "sleeps_forever",
              "hangs_with_a_child"]  # fmt: skip
    tools = [Tool.from_function(calculator)] + [load_tool(f"support.tool_faults:{name}") for name in faults]
    executor = ToolExecutor(tools, timeout_s=5.0, max_output_chars=500)  # long enough for a loaded machine's ordinary call
    pid_file = tmp_path / "pids"
    calls = {
        "exits": _call("exits", code=3), "raises_base": _call("raises_base"), "interrupts": _call("interrupts"),
        "dies": _call("dies"), "prints_megabytes": _call("prints_megabytes", megabytes=5),
        "returns_megabytes": _call("returns_megabytes", megabytes=5), "sleeps_forever": _call("sleeps_forever"),
        "hangs_with_a_child": _call("hangs_with_a_child", pid_file=str(pid_file)),
    }  # fmt: skip
    started = time.monotonic()
    outcomes = {name: executor.run(call) for name, call in calls.items()}
    elapsed = time.monotonic() - started
    assert outcomes["exits"].content == "Error: exits raised SystemExit: 3"
    assert outcomes["raises_base"].content == "Error: raises_base raised Escape: out of here"
    assert outcomes["interrupts"].content == "Error: interrupts raised KeyboardInterrupt: "
    assert outcomes["dies"].content == "Error: dies failed: its worker process exited with code 7"
    assert outcomes["prints_megabytes"].ok and outcomes["prints_megabytes"].content == "printed"  # prints go nowhere
    flood = outcomes["returns_megabytes"]
    kept = flood.content.index("\n[...")
    assert flood.ok and len(flood.content) == 500 and flood.content[:kept] == "y" * kept and kept > 400
    assert flood.content.endswith(f"[... {5 * 2**20 - kept} more characters cut]")
    for name in ("sleeps_forever", "hangs_with_a_child"):
        assert outcomes[name].failure == "timeout" and outcomes[name].content == f"Error: {name} did not finish within 5 s"
    # A tool that raises, even SystemExit, is the rollout's failure; one whose worker died is the infrastructure's.
    assert [o.failure for o in outcomes.values()] == ["raised"] * 3 + ["worker_lost", None, None] + ["timeout"] * 2
    assert dict(executor.failures) == {"raised": 3, "worker_lost": 1, "timeout": 2}
    assert elapsed < 180, elapsed  # two 5 s timeouts and a few worker starts, not the hour a hung tool would take
    worker, child = (int(pid) for pid in pid_file.read_text().split())
    deadline = time.monotonic() + 5
    while not (_gone(worker) and _gone(child)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(worker) and _gone(child), "a timed-out tool's process group must be killed, its children too"
    # The executor still serves: four hung calls at once are replaced, and ordinary calls go on.
    started = time.monotonic()
    mixed = executor.run_all([calls["sleeps_forever"]] * 4 + [_call("calculator", operation="add", a=2, b=3)] * 4)
    assert [o.failure for o in mixed] == ["timeout"] * 4 + [None] * 4 and mixed[-1].content == "5"
    assert time.monotonic() - started < 180
    assert executor.calls == 16
    executor.close()


def test_closing_never_waits_for_a_hung_tool_and_an_exiting_run_leaves_no_worker(tmp_path):
    executor = ToolExecutor([load_tool("support.tool_faults:sleeps_forever")], timeout_s=600)
    outcome: list = []
    caller = threading.Thread(target=lambda: outcome.append(executor.run(_call("sleeps_forever"))))
    caller.start()
    time.sleep(2)  # the call is running (or its worker starting)
    started = time.monotonic()
    executor.close()
    assert time.monotonic() - started < 10  # not the 600 s the call may take: a loaded machine may take seconds to reap
    caller.join(timeout=10)
    assert not caller.is_alive() and outcome[0].failure == "worker_lost"
    assert executor.run(_call("sleeps_forever")).content == "Error: sleeps_forever was not run: the run is ending"
    # A process that exits (without closing) while a call hangs: it exits at once, and the worker follows it.
    pid_file = tmp_path / "pids"
    script = textwrap.dedent(f"""
        import sys, threading, time
        from lightning_rl.tools import ToolExecutor, load_tool, parse_tool_calls
        executor = ToolExecutor([load_tool("support.tool_faults:hangs_with_a_child")], timeout_s=600)
        call = parse_tool_calls('<tool_call>{{"name": "hangs_with_a_child", "arguments": {{"pid_file": "{pid_file}"}}}}</tool_call>')[0]
        threading.Thread(target=executor.run_all, args=([call, call],), daemon=True).start()
        while True:
            time.sleep(0.1)
            try:
                if open("{pid_file}").read():
                    break
            except FileNotFoundError:
                pass
        print("exiting", flush=True)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout == "exiting\n", run.stderr
    worker, child = (int(pid) for pid in pid_file.read_text().split())
    deadline = time.monotonic() + 10
    while not (_gone(worker) and _gone(child)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(worker) and _gone(child)


def test_invalid_executor_settings_are_refused():
    with pytest.raises(ValueError, match="tool_timeout_s must be > 0, got 0"):
        ToolExecutor([Tool.from_function(calculator)], timeout_s=0)
    with pytest.raises(ValueError, match="tool_output_max_chars must be >= 1"):
        ToolExecutor([Tool.from_function(calculator)], max_output_chars=0)
    with pytest.raises(ValueError, match="tool 'label' runs in a worker process, so its function must be importable"):
        ToolExecutor([Tool("label", "", {"type": "object"}, lambda: "x")])


def test_a_tool_defined_in_the_script_being_run_is_refused_before_any_call(monkeypatch):
    """A tool written in the training script itself (TRL users' habit) pickles by name under __main__, which a worker's
    __main__ lacks: it was taken, and every call failed as the tool's own error, scored as the model's."""
    import sys

    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: the city.
        """
        return "sunny"

    get_weather.__module__, get_weather.__qualname__ = "__main__", "get_weather"
    monkeypatch.setattr(sys.modules["__main__"], "get_weather", get_weather, raising=False)
    from lightning_rl.tools.schema import as_tool

    for given in (lambda: as_tool(get_weather), lambda: ToolExecutor([Tool.from_function(get_weather)])):  # a module's tools, an executor's
        with pytest.raises(ValueError, match=r"^tool 'get_weather' runs in a worker process, .* it is defined in the script being run \(__main__\)"):
            given()
    import functools
    import posixpath

    # An importable function whose pickled arguments merely hold the text: taken.
    joined = Tool("joined", "", {"type": "object"}, functools.partial(posixpath.join, "/srv/app/__main__"))
    assert as_tool(joined) is joined


def test_a_hanging_tool_in_a_conversation_times_out_and_the_executor_serves_on(tool_calling_model):
    model, tokenizer, prompts, _ = tool_calling_model
    hanging = Tool.from_function(hanging_calculator, name="calculator")
    executor = ToolExecutor([hanging, Tool.from_function(calculator, name="real_calculator")], timeout_s=0.5)
    conversation = ToolConversation(HFRolloutEngine(model), tokenizer, executor, max_turns=2)
    started = time.monotonic()
    batch = conversation.generate(prompts, [2], lambda turn: SamplingConfig(max_new_tokens=48, temperature=0))
    assert time.monotonic() - started < 60  # the four calls ran side by side: one 0.5 s timeout, not four
    calls = distinct_tool_calls(batch.rollouts)
    assert len(calls) == executor.calls == 4 and dict(executor.failures) == {"timeout": 2, "invalid_arguments": 2}
    assert {c["content"] for c in calls if c["failure"] == "timeout"} == {"Error: calculator did not finish within 0.5 s"}
    assert all(r.metadata["final_reply"] is not None for r in batch.rollouts) and len(batch.rollouts) == 4
    assert executor.run(_call("real_calculator", operation="multiply", a=6, b=7)).content == "42"
    executor.close()


def test_a_flooding_tool_is_cut_and_a_history_that_outgrows_the_context_ends(tool_calling_model):
    model, tokenizer, prompts, _ = tool_calling_model
    executor = ToolExecutor([Tool.from_function(flooding_calculator, name="calculator")], max_output_chars=2000)
    sampling = lambda turn: SamplingConfig(max_new_tokens=48, temperature=0)  # noqa: E731
    roomy = ToolConversation(HFRolloutEngine(model), tokenizer, executor, max_turns=2)
    (long,) = roomy.generate(prompts[:1], [1], sampling).groups[0]
    response = tokenizer.decode([t for t, m in zip(long.completion_ids, long.completion_mask) if not m])
    assert "y" * 1000 in response and "more characters cut]" in response and len(response) < 2200
    limit = len(long.sequence) - 1  # the same history, one token short of fitting
    tight = ToolConversation(HFRolloutEngine(model), tokenizer, executor, max_turns=2, max_context_tokens=limit)
    (ended,) = tight.generate(prompts[:1], [1], sampling).groups[0]
    assert ended.metadata["ended"] == "context_length" and len(ended.sequence) <= limit
    assert ended.metadata["tool_calls"][0]["content"].endswith("more characters cut]")
    assert all(ended.completion_mask)  # only the model's first reply: the tool's answer was never appended
    executor.close()


def test_filtered_turns_keep_their_supports_and_the_trainer_scores_what_was_sampled(tool_calling_model):
    """top-k and top-p on every turn: each reply's support travels through the tool turns and the forks, and the
    trainer, scoring the tree-packed histories over those supports, gives the engine's log-probs."""
    import copy

    from lightning_rl.ops.packed_forward import packed_logprobs

    model, tokenizer, prompts, _ = tool_calling_model
    conversation = ToolConversation(HFRolloutEngine(model), tokenizer, ToolExecutor([Tool.from_function(calculator)]), max_turns=2)
    sampling = lambda turn: SamplingConfig(max_new_tokens=48, temperature=1.0, top_k=8, top_p=0.9, seed=turn)  # noqa: E731
    leaves = conversation.generate(prompts[:1], [2, 2], sampling).groups[0]
    assert any(not all(r.completion_mask) for r in leaves)  # a tool ran: its output is in the history, untrained
    for r in leaves:
        untrained = torch.tensor([not m for m in r.completion_mask])
        assert r.support.shape[0] == len(r.completion_ids) and (r.support[untrained] == -1).all()
        assert ((r.support[~untrained] >= 0).sum(1) >= 1).all()
    packed = pack_sequences([r.sequence for r in leaves], [r.loss_mask for r in leaves],
                            token_values={"engine": [r.sequence_logprobs for r in leaves]}, token_supports=[r.sequence_support for r in leaves])
    scorer = copy.deepcopy(model)
    with torch.no_grad():
        scored = packed_logprobs(scorer, packed)
        full = packed_logprobs(scorer, dataclasses.replace(packed, token_support=None))
    torch.testing.assert_close(scored, packed.token_values["engine"], atol=1e-4, rtol=0)
    assert (full - packed.token_values["engine"]).abs().max() > 1e-2  # without the supports: the filters' kept mass


def test_tool_results_follow_a_reply_whose_template_writes_the_last_turn_otherwise(tiny_tokenizer):
    """Qwen3's template writes an empty <think></think> into the last assistant turn only: once tool results follow,
    the turn renders otherwise, and the first tool call stopped the run ("changes the earlier turns"). The results are
    what follows the turn's end token, as many end tokens in."""
    import copy

    thinking = copy.deepcopy(tiny_tokenizer)
    thinking.chat_template = thinking.chat_template.replace("{% generation %}", "{% generation %}{{ \'<think></think>\' if loop.last else \'\' }}")
    results = [{"role": "tool", "name": "calculator", "content": "12"}]
    assert tool_response_ids(thinking, results) == tool_response_ids(tiny_tokenizer, results)
    thinking.eos_token = "<|endoftext|>"  # a base model's tokenizer: its eos ends no turn, the template's <|im_end|> does
    assert tool_response_ids(thinking, results) == tool_response_ids(tiny_tokenizer, results)
    assert tiny_tokenizer.decode(tool_response_ids(thinking, results)) == "\n<|im_start|>tool\n<tool_response>12</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_writes_calls_without_the_parsed_tags_is_refused(tiny_tokenizer):
    """Llama 3's template writes a call as bare JSON: replies were parsed for <tool_call> blocks, and no call ever ran."""
    import copy

    bare = copy.deepcopy(tiny_tokenizer)
    bare.chat_template = bare.chat_template.replace("<tool_call>", "").replace("</tool_call>", "")
    check_tool_call_format(tiny_tokenizer, "tiny")  # its template writes the blocks
    with pytest.raises(RecipeError, match="^tools: the chat template of bare writes tool calls without <tool_call> blocks"):
        check_tool_call_format(bare, "bare")


def test_tools_given_as_functions_or_tool_objects_are_taken_and_kept_by_name():
    """TRL takes tool functions: given as objects from Python they failed inside the path loader, and their
    hyperparameters would have pickled functions into the checkpoint."""
    from lightning_rl.modules.grpo import GRPOModule
    from lightning_rl.tools import Tool
    from lightning_rl.tools.builtin import calculator

    for tools in ([calculator], [Tool.from_function(calculator)], ["lightning_rl.tools.builtin:calculator"]):
        module = GRPOModule(tools=tools, max_turns=2)
        assert [tool.name for tool in module.rollout.loaded_tools] == ["calculator"]
        assert module.hparams["tools"] == ["lightning_rl.tools.builtin:calculator"]
