"""Fuzzing what a model (or an agent's client) writes, with Hypothesis: Hermes tool-call blocks
(``tools.parse_tool_calls``, ``MinimalChatFormat.parse`` over arbitrary token ids,
``ToolRunner`` on what parsed), OpenAI-style ``tool_calls`` of messages
(``chat.message_tool_calls``) and ``asyncflow_hf.HFChatFormat`` (its ``_decode_arguments`` via
``prompt``, and ``parse``).

Inputs: arbitrary text, blocks holding arbitrary text, JSON of every type where an object is
due, calls whose name or arguments have the wrong type, arguments JSON-encoded (or not JSON),
integers past Python's digit limit, and arrays / objects nested from just under
``MAX_JSON_DEPTH`` to 100000 levels (past the parser's recursion, which was a
``RecursionError`` everywhere here). Each entry point either parses or takes its named path: a
malformed block becomes a counted ``malformed`` ``ToolResult``, a bad message a
``BadRequestError``; the caller's messages are never changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from asyncflow_core.contracts.errors import BadRequestError
from asyncflow_core.flow.chat import MinimalChatFormat, hermes_block, message_tool_calls
from asyncflow_core.flow.tools import (
    MAX_JSON_DEPTH,
    Calculator,
    ToolCall,
    ToolRunner,
    load_json,
    parse_tool_calls,
)

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# ---- strategies ------------------------------------------------------------------------------
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([2**63, -(2**63) - 1, 10**300]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
depths = st.one_of(
    st.integers(MAX_JSON_DEPTH - 2, MAX_JSON_DEPTH + 2),
    st.integers(0, 1500),
    st.sampled_from([990, 1000, 5000, 100_000]),
)


@st.composite
def deep_json(draw: st.DrawFn) -> str:
    """Arrays or objects nested ``depth`` levels, closed or left open."""
    depth = draw(depths)
    opener, leaf, closer = draw(
        st.sampled_from([("[", "1", "]"), ('{"a": ', "1", "}"), ('{"arguments": ', "{}", "}")])
    )
    closed = draw(st.booleans())
    return opener * depth + (leaf + closer * depth if closed else "")


huge_int = st.integers(4301, 6000).map(lambda n: "1" * n)
arguments_text = st.one_of(
    st.text(max_size=30),
    json_values.map(json.dumps),
    deep_json(),
    huge_int.map(lambda digits: '{"x": ' + digits + "}"),
)


@st.composite
def call_body(draw: st.DrawFn) -> str:
    """What goes between ``<tool_call>`` and ``</tool_call>``."""
    kind = draw(
        st.sampled_from(["text", "json", "deep", "call", "call", "wrong_types", "huge", "cut"])
    )
    event(f"block: {kind}")
    if kind == "text":
        return draw(st.text(max_size=40))
    if kind == "json":
        return json.dumps(draw(json_values))
    if kind == "deep":
        return draw(deep_json())
    if kind == "huge":
        return '{"name": "calculator", "arguments": {"expression": ' + draw(huge_int) + "}}"
    name = draw(st.sampled_from(["calculator", "calculator", "nope", ""]) | st.text(max_size=8))
    if kind == "call":
        args: Any = draw(
            st.fixed_dictionaries({"expression": st.sampled_from(["2+3", "9**99", "1/0", "x"])})
            | st.dictionaries(st.text(max_size=6), json_values, max_size=3)
            | arguments_text
        )
        return json.dumps({"name": name, "arguments": args})
    whole = json.dumps({"name": draw(json_values | st.just(name)), "arguments": draw(json_values)})
    if kind == "wrong_types":
        return whole
    cut = draw(st.integers(0, len(whole)))  # a call cut short
    return whole[:cut]


@st.composite
def model_text(draw: st.DrawFn) -> str:
    """A turn: text around tool-call blocks, maybe a stray closing tag or an unclosed block."""
    parts = [draw(st.text(max_size=20))]
    for body in draw(st.lists(call_body(), max_size=3)):
        parts += [f"<tool_call>{body}</tool_call>", draw(st.text(max_size=10))]
    parts.append(draw(st.sampled_from(["", "</tool_call>", "<tool_call>", '<tool_call>{"name"'])))
    return "".join(parts)


BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def check_parsed(text: str | None, calls: list[ToolCall], bad: list[Any]) -> None:
    """Every closed block of ``text`` (when given) is a call or a malformed result; a call is
    well-typed and shallow enough to be rendered and parsed again."""
    if text is not None:
        blocks = len(BLOCK.findall(text))
        assert len(calls) + len(bad) in (blocks, blocks + 1)
    assert all(b.error == "malformed" and not b.ok and b.call is None for b in bad)
    for call in calls:
        assert isinstance(call.name, str) and call.name and isinstance(call.arguments, dict)
        again, none = parse_tool_calls(hermes_block(call))
        assert none == []
        # compared as JSON: NaN is not equal to itself
        assert [(c.name, json.dumps(c.arguments)) for c in again] == [
            (call.name, json.dumps(call.arguments))
        ]
    event(f"calls: {min(len(calls), 2)}+, malformed: {min(len(bad), 2)}+")


# ---- tools.parse_tool_calls and ToolRunner ---------------------------------------------------
@FUZZ
@given(text=model_text() | st.text())
@example(text="<tool_call>" + "[" * 100_000 + "</tool_call>")
@example(text='<tool_call>{"name": "f", "arguments": "' + "[" * 100_000 + '"}</tool_call>')
@example(text='<tool_call>{"name": "f", "arguments": {"x": ' + "1" * 5000 + "}}</tool_call>")
def test_tool_call_blocks_parse_or_are_counted_malformed(text: str) -> None:
    calls, bad = parse_tool_calls(text)
    check_parsed(text, calls, bad)
    runner = ToolRunner([Calculator()], timeout_s=30.0)  # a safety net: nothing here waits
    results = asyncio.run(runner.run(calls))
    assert len(results) == len(calls)
    assert runner.metrics["calls"] == len(calls)
    failed = sum(v for k, v in runner.metrics.items() if k.startswith("error_"))
    assert failed == sum(not r.ok for r in results)


def test_deep_nesting_is_a_value_error_at_the_limit() -> None:
    at_limit = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert load_json(at_limit) is not None
    for text in ("[" + at_limit + "]", "[" * 100_000, "[" * 5000 + "]" * 5000):
        with pytest.raises(ValueError, match="deeper than"):
            load_json(text)
    calls, bad = parse_tool_calls(f"<tool_call>{'[' * 100_000}</tool_call>")
    assert calls == [] and "deeper than" in bad[0].content


# ---- MinimalChatFormat.parse over arbitrary token ids ------------------------------------------
class CharTokenizer:
    """One token per character of printable ASCII, ``<|im_end|>`` the last id."""

    ALPHABET = [chr(c) for c in range(32, 127)] + ["\n"]

    def encode(self, text: str) -> list[int]:
        if text == "<|im_end|>":
            return [len(self.ALPHABET)]
        return [self.ALPHABET.index(c) for c in text]

    def decode(self, ids: Any) -> str:
        return "".join(self.ALPHABET[i] if i < len(self.ALPHABET) else "<|im_end|>" for i in ids)


MINIMAL = MinimalChatFormat(CharTokenizer())
ascii_text = st.text(alphabet=CharTokenizer.ALPHABET, max_size=40)


@FUZZ
@given(
    ids=st.lists(st.integers(0, len(CharTokenizer.ALPHABET)), max_size=80)
    | model_text()
    .map(lambda t: "".join(c for c in t if c in CharTokenizer.ALPHABET))
    .map(lambda t: [CharTokenizer.ALPHABET.index(c) for c in t])
)
def test_a_generated_turn_parses_whatever_the_tokens(ids: list[int]) -> None:
    msg = MINIMAL.parse(ids)
    check_parsed(msg.text, list(msg.tool_calls), list(msg.malformed))
    assert "<tool_call>" not in msg.content


# ---- chat.message_tool_calls ----------------------------------------------------------------
function = st.fixed_dictionaries(
    {"name": st.sampled_from(["calculator", ""]) | json_values},
    optional={"arguments": arguments_text | json_values},
)
openai_call = st.fixed_dictionaries(
    {"type": st.just("function") | json_values, "function": function | json_values},
    optional={"id": json_values},
)
tool_calls = (
    st.lists(openai_call, max_size=3)
    | json_values
    | deep_json().map(lambda t: [{"type": "function", "function": {"name": "f", "arguments": t}}])
)
assistant = st.fixed_dictionaries(
    {"role": st.just("assistant"), "tool_calls": tool_calls},
    optional={"content": st.none() | ascii_text},
)


@FUZZ
@given(message=assistant)
@example(message={"role": "assistant", "tool_calls": 5})
@example(
    message={
        "role": "assistant",
        "tool_calls": [{"function": {"name": "f", "arguments": "[" * 100_000}}],
    }
)
def test_message_tool_calls_parse_or_are_a_bad_request(message: dict[str, Any]) -> None:
    before = copy.deepcopy(message)
    try:
        calls = message_tool_calls(message, "fuzz")
    except BadRequestError as exc:
        event("BadRequestError")
        assert str(exc).startswith("fuzz")
    else:
        event(f"parsed {len(calls)}")
        for call in calls:
            assert isinstance(call.name, str) and call.name and isinstance(call.arguments, dict)
            json.dumps(call.arguments)  # shallow enough to encode again
    assert repr(message) == repr(before)  # unchanged (repr: NaN is not equal to itself)
    with contextlib.suppress(BadRequestError):  # rendering goes through the same path
        MINIMAL.prompt([{"role": "user", "content": "x"}, message])
    assert repr(message) == repr(before)


# ---- asyncflow_hf.HFChatFormat ----------------------------------------------------------------
# A ChatML template that renders calls as Qwen2.5's does: arguments | tojson.
TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}{%- set c = c.function if c.function is defined else c %}"
    "{{- '<tool_call>' + ({'name': c.name, 'arguments': c.arguments} | tojson) + '</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def hf_chat() -> Any:
    pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    from asyncflow_hf import HFChatFormat
    from asyncflow_hf.assets import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return HFChatFormat(tokenizer)


@FUZZ
@given(message=assistant)
@example(
    message={
        "role": "assistant",
        "tool_calls": [{"function": {"name": "f", "arguments": "[" * 100_000}}],
    }
)
@example(message={"role": "assistant", "tool_calls": [{"name": "f", "arguments": '{"a": ' * 5000}]})
def test_hf_prompt_decodes_arguments_or_is_a_bad_request(
    hf_chat: Any, message: dict[str, Any]
) -> None:
    before = copy.deepcopy(message)
    try:
        ids = hf_chat.prompt([{"role": "user", "content": "x"}, message])
    except BadRequestError as exc:
        event("BadRequestError")
        assert "HFChatFormat.prompt" in str(exc)
    else:
        event("rendered")
        assert ids and all(isinstance(t, int) for t in ids)
    assert repr(message) == repr(before)


@settings(FUZZ, max_examples=60)  # the tokenizer encodes up to 100000-level texts: slow
@given(text=model_text())
def test_hf_parse_reads_whatever_the_model_wrote(hf_chat: Any, text: str) -> None:
    ids = hf_chat.tokenizer.encode(text, add_special_tokens=False)
    msg = hf_chat.parse(ids)
    check_parsed(None, list(msg.tool_calls), list(msg.malformed))  # blocks after any </think>
