"""``asyncflow_core.flow.tools``: parsing tool calls, running them with limits, and failures fed
back to the model rather than raised."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from typing import Any

import pytest

from asyncflow_core.contracts.errors import ConfigError
from asyncflow_core.flow.tools import (
    Calculator,
    Environment,
    Tool,
    ToolCall,
    ToolRunner,
    parse_tool_calls,
    schema_problem,
    tool_schema,
)


def test_hermes_calls_are_parsed_and_bad_blocks_reported() -> None:
    text = (
        'Let me compute. <tool_call>{"name": "calculator", "arguments": '
        '{"expression": "2+3"}}</tool_call> and <tool_call>{"name": "calculator", '
        '"arguments": "{\\"expression\\": \\"7*6\\"}"}</tool_call>'
        '<tool_call>{not json}</tool_call><tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "x"'
    )
    calls, bad = parse_tool_calls(text)
    assert [(c.name, dict(c.arguments)) for c in calls] == [
        ("calculator", {"expression": "2+3"}),
        ("calculator", {"expression": "7*6"}),  # JSON-encoded arguments are decoded
    ]
    assert [b.error for b in bad] == ["malformed"] * 3
    assert "not JSON" in bad[0].content and "never closed" in bad[2].content


def test_blocks_nested_too_deep_or_with_huge_ints_are_malformed_not_raised() -> None:
    # a RecursionError and a ValueError (int digit limit) from json before; see also
    # tests/test_fuzz_model_output.py
    deep_args = '{"a": ' * 5000
    text = (
        f"<tool_call>{'[' * 100_000}</tool_call>"
        f'<tool_call>{{"name": "f", "arguments": "{deep_args}"}}</tool_call>'
        f'<tool_call>{{"name": "f", "arguments": {{"a": {"[" * 101 + "]" * 101}}}}}</tool_call>'
        f'<tool_call>{{"name": "f", "arguments": {{"x": {"1" * 5000}}}}}</tool_call>'
    )
    calls, bad = parse_tool_calls(text)
    assert calls == [] and [b.error for b in bad] == ["malformed"] * 4
    assert "deeper than" in bad[0].content and "digits" in bad[3].content
    assert parse_tool_calls("no calls here") == ([], [])
    with pytest.raises(ConfigError, match="format must be 'hermes'"):
        parse_tool_calls("", format="llama3")  # type: ignore[arg-type]


def test_schema_problems_are_named() -> None:
    schema = Calculator.parameters
    assert schema_problem(schema, {"expression": "1"}) is None
    assert "missing required" in str(schema_problem(schema, {}))
    assert "unknown argument(s) ['x']" in str(schema_problem(schema, {"expression": "1", "x": 2}))
    assert "must be string" in str(schema_problem(schema, {"expression": 3}))
    number = {"properties": {"n": {"type": "integer"}}}
    assert "must be integer" in str(schema_problem(number, {"n": True}))  # bool is not int


def test_the_calculator_never_evaluates_code() -> None:
    calc = Calculator()
    assert calc.call({"expression": "(17 + 5) * 3"}) == "66"
    assert calc.call({"expression": "7 / 2"}) == "3.5"
    assert calc.call({"expression": "-2 ** 3"}) == "-8"
    for bad in ("__import__('os').system('true')", "open('x')", "a + 1", "[1] * 3", "9**9**9",
                "1/0", "1e400", "x" * 300):  # fmt: skip
        with pytest.raises(ValueError):
            calc.call({"expression": bad})


class Slow:
    name = "slow"
    description = "waits"
    parameters: Mapping[str, Any] = {"type": "object", "properties": {}}

    def __init__(self) -> None:
        self.running = 0
        self.peak = 0
        self.lock = threading.Lock()
        self.release = threading.Event()

    def call(self, arguments: Mapping[str, Any]) -> str:
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        try:
            self.release.wait(timeout=30)
            return "done"
        finally:
            with self.lock:
                self.running -= 1


class Raising:
    name = "raising"
    description = "fails"
    parameters: Mapping[str, Any] = {"type": "object", "properties": {}}

    async def call(self, arguments: Mapping[str, Any]) -> str:
        raise RuntimeError("the database is down")


class Hanging:
    name = "hanging"
    description = "never answers"
    parameters: Mapping[str, Any] = {"type": "object", "properties": {}}

    async def call(self, arguments: Mapping[str, Any]) -> str:
        await asyncio.Event().wait()
        return "never"


def test_failures_become_tool_messages_and_are_counted() -> None:
    async def main() -> None:
        runner = ToolRunner([Calculator(), Raising()], timeout_s=60)  # a safety net only
        results = await runner.run(
            [
                ToolCall("calculator", {"expression": "6*7"}),
                ToolCall("nope", {}),
                ToolCall("calculator", {"expr": "1"}),
                ToolCall("raising", {}),
                ToolCall("calculator", {"expression": "1/0"}),
            ]
        )
        assert [r.ok for r in results] == [True, False, False, False, False]
        assert results[0].content == "42"
        assert [r.error for r in results[1:]] == [
            "unknown_tool", "bad_arguments", "raised", "raised",
        ]  # fmt: skip
        assert "the database is down" in results[3].content
        assert "division by zero" in results[4].content
        assert runner.metrics["calls"] == 5 and runner.metrics["error_raised"] == 2
        # a tool that never answers is cut off at the runner's timeout (it cannot finish
        # early, so this holds on any machine)
        hang = ToolRunner([Hanging()], timeout_s=0.2)
        (late,) = await hang.run([ToolCall("hanging", {})])
        assert late.error == "timeout" and hang.metrics["error_timeout"] == 1

    asyncio.run(main())


def test_the_concurrency_limit_holds() -> None:
    async def main() -> None:
        slow = Slow()
        runner = ToolRunner([slow], max_concurrency=2, timeout_s=60)
        calls = [ToolCall("slow", {}) for _ in range(5)]
        task = asyncio.ensure_future(runner.run(calls))
        while slow.running < 2:  # until two are inside the tool (evidence, not a sleep)
            await asyncio.sleep(0.01)
        assert slow.running == 2  # the other three wait for the limit
        slow.release.set()
        results = await task
        assert all(r.ok for r in results) and slow.peak == 2

    asyncio.run(main())


def test_protocols_and_config_errors() -> None:
    assert isinstance(Calculator(), Tool)
    assert tool_schema(Calculator())["function"]["name"] == "calculator"

    class Env:
        async def reset(self, sample: Mapping[str, Any]) -> str:
            return "start"

        async def step(self, action: str) -> tuple[str, float | None, bool]:
            return "obs", 1.0, True

    assert isinstance(Env(), Environment)
    with pytest.raises(ConfigError, match="unique"):
        ToolRunner([Calculator(), Calculator()])
    with pytest.raises(ConfigError, match="max_concurrency"):
        ToolRunner([Calculator()], max_concurrency=0)
