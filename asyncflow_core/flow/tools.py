"""Tools and environments for agent loops (issue #21): the ``Tool`` and ``Environment``
protocols, parsing of tool calls out of generated text, and ``ToolRunner``, which runs calls
with a concurrency limit and a timeout and turns every failure into a tool message.

**Tool-call format.** Hermes style, as Qwen2.5/Qwen3, Hermes and many other chat templates
emit it: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call, any
number of blocks in a turn. Other formats (Llama 3's bare JSON, Mistral's ``[TOOL_CALLS]``)
are not parsed yet: ``parse_tool_calls`` takes ``format="hermes"`` only and refuses others.

**Failures never crash a loop.** A malformed block, an unknown tool, arguments that do not
match the tool's JSON schema, a tool that raises and a tool past its timeout each become a
``ToolResult`` with ``ok=False``, an ``error`` kind and a message for the model; ``ToolRunner``
counts them by kind (``metrics``).

**JSON from the model is bounded.** ``load_json`` (used here, by ``chat.message_tool_calls``,
``asyncflow_hf``'s chat format and ``asyncflow_serve``'s request bodies) turns every failure
into a ``ValueError``: text that is not JSON, integers past Python's digit limit, and nesting
deeper than ``MAX_JSON_DEPTH`` levels or past the parser's recursion (which would otherwise be
a ``RecursionError`` there, or later wherever the value is encoded or printed again).

**Nothing from the model is evaluated.** The built-in ``Calculator`` parses arithmetic with
``ast.parse`` and interprets a small whitelist of nodes itself (numbers, + - * / // % **,
unary minus, parentheses) with bounds on sizes; it never calls ``eval`` or ``exec``.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import math
import re
from collections import Counter
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from asyncflow_core.contracts.errors import ConfigError

ToolError = Literal["malformed", "unknown_tool", "bad_arguments", "raised", "timeout"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model wrote: the tool's ``name``, its ``arguments`` and the ``raw`` text."""

    name: str
    arguments: Mapping[str, Any]
    raw: str = ""


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What goes back to the model: ``content`` (the tool's answer, or what went wrong);
    ``ok`` False with an ``error`` kind for every failure; ``call`` None for a block that
    could not be parsed; ``seconds`` the tool's run time."""

    call: ToolCall | None
    content: str
    ok: bool = True
    error: ToolError | None = None
    seconds: float = 0.0


@runtime_checkable
class Tool(Protocol):
    """A tool the model may call: ``name``, ``description``, ``parameters`` (a JSON schema
    object: ``{"type": "object", "properties": {...}, "required": [...]}``) and ``call``,
    which gets the parsed arguments and returns the text the model sees (sync or async)."""

    name: str
    description: str
    parameters: Mapping[str, Any]

    def call(self, arguments: Mapping[str, Any]) -> str | Awaitable[str]: ...


@runtime_checkable
class Environment(Protocol):
    """A multi-step task whose observations come from code: ``reset(sample)`` returns the first
    observation (text); ``step(action)`` takes the model's turn (text) and returns
    ``(observation, reward, done)``: the next observation, a reward (None until known) and
    whether the episode ended."""

    async def reset(self, sample: Mapping[str, Any]) -> str: ...

    async def step(self, action: str) -> tuple[str, float | None, bool]: ...


def tool_schema(tool: Tool) -> dict[str, Any]:
    """The OpenAI-style description of ``tool`` a chat template renders."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": dict(tool.parameters),
        },
    }


MAX_JSON_DEPTH = 100
"""How deeply ``load_json`` lets arrays and objects nest (``[[1]]`` is 2 levels deep): far
more than any tool call or chat request needs, far less than Python's recursion limit, so a
value that loads can be encoded, compared and printed again from anywhere."""


def load_json(text: str | bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(text)``, every failure a ``ValueError``: not JSON (``JSONDecodeError``), an
    integer past the interpreter's digit limit, and arrays or objects nested deeper than
    ``max_depth`` levels or past the parser's recursion limit (a ``RecursionError`` inside
    ``json``)."""
    try:
        value = json.loads(text)
    except RecursionError as exc:
        raise ValueError(
            f"it nests arrays and objects deeper than the parser can follow; at most "
            f"{max_depth} levels are accepted"
        ) from exc
    if _nested_deeper(value, max_depth):
        raise ValueError(f"it nests arrays and objects deeper than {max_depth} levels")
    return value


def _nested_deeper(value: Any, limit: int) -> bool:
    """Whether ``value`` (as ``json.loads`` makes it) holds containers more than ``limit``
    deep; without recursion."""
    if not isinstance(value, dict | list):
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(
    text: str, format: Literal["hermes"] = "hermes"
) -> tuple[list[ToolCall], list[ToolResult]]:
    """The tool calls in a generated turn, and a failed ``ToolResult`` for each block that is
    not a call (not JSON as ``load_json`` reads it, no ``name``, ``arguments`` not an object;
    an opened block never closed). Text outside the blocks is ignored; nothing in ``text``
    makes it raise."""
    if format != "hermes":
        raise ConfigError(f"parse_tool_calls: format must be 'hermes', got {format!r}")
    calls: list[ToolCall] = []
    bad: list[ToolResult] = []
    for match in _HERMES.finditer(text):
        raw = match.group(1).strip()
        try:
            obj = load_json(raw)
        except ValueError as exc:
            why = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
            bad.append(_malformed(f"the tool call is not JSON ({why}): {raw[:200]!r}"))
            continue
        name = obj.get("name") if isinstance(obj, dict) else None
        arguments = obj.get("arguments", {}) if isinstance(obj, dict) else None
        if isinstance(arguments, str):  # some models send the arguments JSON-encoded
            try:
                arguments = load_json(arguments)
            except ValueError:
                arguments = None
        if not isinstance(name, str) or not name or not isinstance(arguments, dict):
            bad.append(
                _malformed(
                    f'a tool call is {{"name": "<tool>", "arguments": {{...}}}}, got {raw[:200]!r}'
                )
            )
            continue
        calls.append(ToolCall(name, arguments, raw))
    end = text.rfind("</tool_call>")
    tail = text[end + len("</tool_call>") :] if end >= 0 else text
    if "<tool_call>" in tail:
        bad.append(_malformed("a <tool_call> block was opened and never closed"))
    return calls, bad


def _malformed(message: str) -> ToolResult:
    return ToolResult(None, f"error: {message}", ok=False, error="malformed")


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


def schema_problem(schema: Mapping[str, Any], arguments: Mapping[str, Any]) -> str | None:
    """What is wrong with ``arguments`` for an object ``schema`` (required properties, no
    unknown ones when ``additionalProperties`` is false, the basic JSON types of each
    property), or None. A subset of JSON Schema: enough for tool arguments."""
    props: Mapping[str, Any] = schema.get("properties", {}) or {}
    missing = [k for k in schema.get("required", ()) if k not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    if schema.get("additionalProperties") is False:
        extra = sorted(set(arguments) - set(props))
        if extra:
            return f"unknown argument(s) {extra}; the tool takes {sorted(props)}"
    for key, value in arguments.items():
        kind = (props.get(key) or {}).get("type")
        if kind is None:
            continue
        kinds = kind if isinstance(kind, list) else [kind]
        allowed = tuple(t for k in kinds for t in _JSON_TYPES.get(k, ()))
        ok = isinstance(value, allowed) and not (isinstance(value, bool) and "boolean" not in kinds)
        if allowed and not ok:
            return f"argument {key!r} must be {kind}, got {type(value).__name__} {value!r}"
    return None


@dataclass
class ToolRunner:
    """Runs tool calls: at most ``max_concurrency`` at once (across all the trajectories that
    share this runner), each within ``timeout_s``; every failure is a ``ToolResult`` with
    ``ok=False`` (see the module docstring). ``metrics`` counts calls and failures by kind."""

    tools: Sequence[Tool]
    max_concurrency: int = 8
    timeout_s: float = 10.0
    metrics: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self._by_name = _by_name(self.tools)
        if isinstance(self.max_concurrency, bool) or self.max_concurrency < 1:
            raise ConfigError(
                f"ToolRunner: max_concurrency must be an int >= 1, got {self.max_concurrency!r}"
            )
        if not 0 < self.timeout_s < math.inf:
            raise ConfigError(f"ToolRunner: timeout_s must be > 0, got {self.timeout_s!r}")
        self._limit = asyncio.Semaphore(self.max_concurrency)

    async def run(
        self, calls: Sequence[ToolCall], tools: Sequence[Tool] | None = None
    ) -> list[ToolResult]:
        """Run ``calls`` (concurrently, within the limit); results in the calls' order.
        ``tools``: this trajectory's own tools instead of the runner's (e.g. tools holding
        per-sample state), under the same limit, timeout and counts."""
        by_name = self._by_name if tools is None else _by_name(tools)
        return list(await asyncio.gather(*(self._run(c, by_name) for c in calls)))

    async def run_one(self, call: ToolCall, tools: Sequence[Tool] | None = None) -> ToolResult:
        return await self._run(call, self._by_name if tools is None else _by_name(tools))

    async def _run(self, call: ToolCall, by_name: Mapping[str, Tool]) -> ToolResult:
        self.metrics["calls"] += 1
        tool = by_name.get(call.name)
        if tool is None:
            return self._failed(
                call, "unknown_tool", f"no tool named {call.name!r}; tools: {sorted(by_name)}"
            )
        problem = schema_problem(tool.parameters, call.arguments)
        if problem is not None:
            return self._failed(call, "bad_arguments", f"{call.name}: {problem}")
        loop = asyncio.get_running_loop()
        async with self._limit:
            t0 = loop.time()
            try:
                out = await asyncio.wait_for(_answer(tool, call.arguments), self.timeout_s)
            except TimeoutError:
                return self._failed(
                    call, "timeout", f"{call.name} took longer than {self.timeout_s:g} s"
                )
            except Exception as exc:  # a tool's failure goes back to the model
                return self._failed(call, "raised", f"{call.name} failed: {exc}")
            seconds = loop.time() - t0
        return ToolResult(call, str(out), seconds=seconds)

    def _failed(self, call: ToolCall, kind: ToolError, message: str) -> ToolResult:
        self.metrics[f"error_{kind}"] += 1
        return ToolResult(call, f"error: {message}", ok=False, error=kind)


def _by_name(tools: Sequence[Tool]) -> dict[str, Tool]:
    names = [t.name for t in tools]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"ToolRunner: tool names must be unique, got {dupes} twice")
    return {t.name: t for t in tools}


async def _answer(tool: Tool, arguments: Mapping[str, Any]) -> str:
    if inspect.iscoroutinefunction(tool.call):
        return str(await tool.call(arguments))
    out = await asyncio.to_thread(tool.call, arguments)  # a slow sync tool keeps the loop free
    if inspect.isawaitable(out):
        out = await out
    return str(out)


class Calculator:
    """``calculator(expression)``: the value of an arithmetic expression, computed by
    interpreting its parse tree (numbers, + - * / // % **, unary minus, parentheses); never
    ``eval``. Results beyond ``max_abs`` and exponents beyond ``max_exponent`` are refused."""

    name = "calculator"
    description = "Evaluate an arithmetic expression, e.g. '(17 + 5) * 3'."
    parameters: Mapping[str, Any] = {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
        "additionalProperties": False,
    }

    def __init__(self, max_abs: float = 1e15, max_exponent: int = 64, max_length: int = 200):
        self.max_abs = max_abs
        self.max_exponent = max_exponent
        self.max_length = max_length

    def call(self, arguments: Mapping[str, Any]) -> str:
        expression = str(arguments["expression"])
        if len(expression) > self.max_length:
            raise ValueError(f"the expression is longer than {self.max_length} characters")
        try:
            tree = ast.parse(expression, mode="eval")
        except SyntaxError as exc:
            raise ValueError(f"not an arithmetic expression: {expression!r}") from exc
        value = self._value(tree.body)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return str(value)

    def _value(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return self._bounded(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            v = self._value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp):
            a, b = self._value(node.left), self._value(node.right)
            op = node.op
            if isinstance(op, ast.Pow):
                if abs(b) > self.max_exponent:
                    raise ValueError(f"exponent {b} is beyond {self.max_exponent}")
                try:
                    return self._bounded(a**b)
                except (OverflowError, ZeroDivisionError) as exc:
                    raise ValueError(f"{a} ** {b}: {exc}") from exc
            if isinstance(op, ast.Div | ast.FloorDiv | ast.Mod) and b == 0:
                raise ValueError("division by zero")
            ops: dict[type, Any] = {
                ast.Add: lambda: a + b,
                ast.Sub: lambda: a - b,
                ast.Mult: lambda: a * b,
                ast.Div: lambda: a / b,
                ast.FloorDiv: lambda: a // b,
                ast.Mod: lambda: a % b,
            }
            if type(op) in ops:
                return self._bounded(ops[type(op)]())
        raise ValueError(f"unsupported in an arithmetic expression: {ast.dump(node)[:80]}")

    def _bounded(self, value: Any) -> int | float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ValueError(f"not a real number: {value!r}")
        if (isinstance(value, float) and not math.isfinite(value)) or abs(value) > self.max_abs:
            raise ValueError(f"{value} is beyond +-{self.max_abs:g}")
        return value


__all__ = [
    "MAX_JSON_DEPTH",
    "Calculator",
    "Environment",
    "Tool",
    "ToolCall",
    "ToolError",
    "ToolResult",
    "ToolRunner",
    "load_json",
    "parse_tool_calls",
    "schema_problem",
    "tool_schema",
]
