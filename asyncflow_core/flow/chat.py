"""Chat formats: how chat messages (and tool schemas) become the token ids an agent loop gives
the engine, and how a generated assistant turn becomes a message again (issue #21).

A ``ChatFormat`` has four jobs, each on token ids so that nothing is re-tokenised between
turns:

* ``prompt(messages, tools)``: a whole conversation, with the next assistant turn opened;
* ``followup(messages)``: the tokens that come *after* a finished assistant turn (one that
  ended with one of ``stop_token_ids``) to add ``messages`` (tool results, a user's reply, an
  environment's observation) and open the next assistant turn. For a conversation ``c`` that
  ends with an assistant turn ``a``: ``prompt(c[:-1])`` + ``a``'s tokens (ending with a stop
  token) + ``followup(m)`` == ``prompt(c + m)``, so a loop that appends generated tokens and
  ``followup`` tokens never decodes and re-encodes what came before. Two exceptions, both on
  purpose: a template that rewrites history (Qwen3 drops earlier turns' ``<think>`` blocks
  once a new user message follows) renders ``prompt(c + m)`` differently, while the token
  stream keeps what was generated; and a turn cut by ``max_tokens`` has no stop token, so a
  loop ends the trajectory there (``ToolAgentLoop`` does) rather than follow it up;
* ``parse(tokens)``: an assistant turn's text and its tool calls;
* ``decode(tokens)``: text.

Two implementations: ``MinimalChatFormat`` (here, below; documented template, any tokenizer with
``encode``/``decode``: the reference models use it) and ``asyncflow_hf.HFChatFormat`` (a Hugging
Face tokenizer's own chat template).

**The minimal template** (ChatML-like, tool calls in Hermes style)::

    <|im_start|>system\\n{system content}[\\n]tools: {name}({arg}, ...), ...<|im_end|>\\n
    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n{content}<tool_call>{"name": N, "arguments": A}</tool_call><|im_end|>\\n
    <|im_start|>tool\\n<tool_response>{content}</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n                      <- the generation prompt

(``N``: the tool's name, ``A``: its arguments as a JSON object.) The system turn appears when
the messages have one or ``tools`` are given; tools are listed by signature, ``name(arg, ...)``
from their JSON schema's properties (small models cannot afford whole schemas in their
context); an assistant turn ends with
``<|im_end|>``, which is the stop token, and the ``\\n`` after it belongs to the next turn (it is
the first token of ``followup``). Roles other than ``system``/``user``/``assistant``/``tool`` are
rendered as written (``<|im_start|>environment\\n...``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from asyncflow_core.contracts.errors import BadRequestError, ConfigError
from asyncflow_core.flow.tools import ToolCall, ToolResult, load_json, parse_tool_calls

Message = Mapping[str, Any]
"""An OpenAI-style chat message: ``{"role": ..., "content": ...}``; an assistant message may
carry ``tool_calls`` (``[{"type": "function", "function": {"name": ..., "arguments": ...}}]``,
arguments a JSON string or an object), a tool message ``tool_call_id`` / ``name``."""

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"


@dataclass(frozen=True, slots=True)
class AssistantMessage:
    """A parsed assistant turn: ``content`` (the text, tool-call blocks and the stop token
    removed), ``tool_calls`` (well-formed calls, in order) and ``malformed`` (a failed
    ``ToolResult`` for each block that was not a call: what the model is told)."""

    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    malformed: tuple[ToolResult, ...] = ()
    text: str = field(default="", compare=False)
    """The whole decoded turn (tool-call blocks included, the stop token not)."""


@runtime_checkable
class TextTokenizer(Protocol):
    """What ``MinimalChatFormat`` needs of a tokenizer: ``encode`` a text into ids (no special
    tokens added) and ``decode`` ids back into text."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@runtime_checkable
class ChatFormat(Protocol):
    """Messages to token ids and back (see the module docstring)."""

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The tokens that end an assistant turn (give them to ``SamplingParams``)."""
        ...

    def prompt(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]: ...

    def followup(self, messages: Sequence[Message]) -> list[int]: ...

    def parse(self, tokens: Sequence[int]) -> AssistantMessage: ...

    def decode(self, tokens: Sequence[int]) -> str: ...


# --------------------------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------------------------
def check_messages(messages: object, who: str) -> list[Message]:
    """``messages`` as a list of dicts with a string ``role``; ``BadRequestError`` naming the
    first bad one."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise BadRequestError(
            f"{who}: messages must be a list of dicts, got {type(messages).__name__}"
        )
    out: list[Message] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not m["role"]:
            raise BadRequestError(
                f"{who}: messages[{i}] must be a dict with a 'role' string, got {m!r:.120}"
            )
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise BadRequestError(
                f"{who}: messages[{i}] ({m['role']}) content must be a string or null, got "
                f"{type(content).__name__} (content parts are not supported)"
            )
        out.append(m)
    return out


def message_tool_calls(message: Message, who: str = "message") -> list[ToolCall]:
    """The OpenAI-style ``tool_calls`` of an assistant message as ``ToolCall`` s (arguments
    decoded from their JSON string by ``tools.load_json``); ``BadRequestError`` naming the
    first call that is not one."""
    calls: list[ToolCall] = []
    raw = message.get("tool_calls") or ()
    if isinstance(raw, str | bytes | Mapping) or not isinstance(raw, Sequence):
        raise BadRequestError(
            f"{who}: tool_calls must be a list of calls, got {type(raw).__name__} {raw!r:.80}"
        )
    for i, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, Mapping) else None
        name = fn.get("name") if isinstance(fn, Mapping) else None
        args: Any = fn.get("arguments", {}) if isinstance(fn, Mapping) else None
        if isinstance(args, str):
            try:
                args = load_json(args) if args.strip() else {}
            except ValueError as exc:  # not JSON, or nested too deep (tools.load_json)
                raise BadRequestError(
                    f"{who}: tool_calls[{i}].function.arguments is not JSON ({exc})"
                ) from exc
        if not isinstance(name, str) or not name or not isinstance(args, Mapping):
            raise BadRequestError(
                f"{who}: tool_calls[{i}] must be {{'type': 'function', 'function': {{'name': "
                f"str, 'arguments': JSON object or string}}}}, got {call!r:.160}"
            )
        calls.append(ToolCall(name, dict(args)))
    return calls


def hermes_block(call: ToolCall) -> str:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the Hermes rendering."""
    body = json.dumps({"name": call.name, "arguments": dict(call.arguments)})
    return f"<tool_call>{body}</tool_call>"


def split_tool_blocks(text: str) -> AssistantMessage:
    """Parse a decoded assistant turn (Hermes ``<tool_call>`` blocks)."""
    calls, bad = parse_tool_calls(text)
    content = _BLOCKS.sub("", text)
    return AssistantMessage(content.strip(), tuple(calls), tuple(bad), text)


_BLOCKS = re.compile(r"<tool_call>.*?(</tool_call>|\Z)", re.DOTALL)
"""A tool-call block, or an opened one never closed (to the end of the text)."""


# --------------------------------------------------------------------------------------------
# The minimal template
# --------------------------------------------------------------------------------------------
class MinimalChatFormat:
    """The documented minimal template (module docstring) over ``tokenizer`` (a
    ``TextTokenizer``; ``<|im_end|>`` must encode to exactly one token, the stop token)."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        if not isinstance(tokenizer, TextTokenizer):
            raise ConfigError(
                f"MinimalChatFormat: the tokenizer needs encode(text) and decode(ids), got "
                f"{type(tokenizer).__name__}"
            )
        self.tokenizer = tokenizer
        end = tokenizer.encode(IM_END)
        if len(end) != 1:
            raise ConfigError(
                f"MinimalChatFormat: {IM_END!r} must encode to one token (the stop token), got "
                f"{end}; add it to the tokenizer's special tokens"
            )
        self._stop = (int(end[0]),)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self._stop

    # -- rendering ------------------------------------------------------------------------------
    def render(self, message: Message) -> str:
        """One message as text (its ``\\n`` after ``<|im_end|>`` included)."""
        role = message["role"]
        content = message.get("content") or ""
        if role == "assistant":
            calls = "".join(hermes_block(c) for c in message_tool_calls(message))
            return f"{IM_START}assistant\n{content}{calls}{IM_END}\n"
        if role == "tool":
            return f"{IM_START}tool\n<tool_response>{content}</tool_response>{IM_END}\n"
        return f"{IM_START}{role}\n{content}{IM_END}\n"

    def prompt_text(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> str:
        msgs = check_messages(messages, "MinimalChatFormat.prompt")
        names = [_tool_signature(t) for t in tools or ()]
        if names:
            listing = "tools: " + ", ".join(names)
            if msgs and msgs[0]["role"] == "system":
                first = msgs[0].get("content") or ""
                system = {"role": "system", "content": f"{first}\n{listing}" if first else listing}
                msgs = [system, *msgs[1:]]
            else:
                msgs = [{"role": "system", "content": listing}, *msgs]
        return "".join(self.render(m) for m in msgs) + f"{IM_START}assistant\n"

    def prompt(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        return self.tokenizer.encode(self.prompt_text(messages, tools))

    def followup(self, messages: Sequence[Message]) -> list[int]:
        msgs = check_messages(messages, "MinimalChatFormat.followup")
        # the "\n" closing the assistant turn the engine ended with <|im_end|>
        text = "\n" + "".join(self.render(m) for m in msgs) + f"{IM_START}assistant\n"
        return self.tokenizer.encode(text)

    # -- reading --------------------------------------------------------------------------------
    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens))

    def parse(self, tokens: Sequence[int]) -> AssistantMessage:
        ids = list(tokens)
        if ids and ids[-1] in self._stop:
            ids = ids[:-1]
        return split_tool_blocks(self.decode(ids))


def _tool_signature(tool: Mapping[str, Any]) -> str:
    """``name(arg, ...)`` of an OpenAI-style tool schema (its parameters' property names)."""
    fn = tool.get("function") if isinstance(tool, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str) or not name:
        raise BadRequestError(
            f"a tool schema must be {{'type': 'function', 'function': {{'name': ..., ...}}}}, "
            f"got {tool!r:.120}"
        )
    params = fn.get("parameters") if isinstance(fn, Mapping) else None
    props = params.get("properties") if isinstance(params, Mapping) else None
    args = ", ".join(props) if isinstance(props, Mapping) else ""
    return f"{name}({args})"


__all__ = [
    "IM_END",
    "IM_START",
    "AssistantMessage",
    "ChatFormat",
    "Message",
    "MinimalChatFormat",
    "TextTokenizer",
    "check_messages",
    "hermes_block",
    "message_tool_calls",
    "split_tool_blocks",
]
