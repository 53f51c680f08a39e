"""``HFChatFormat``: a Hugging Face tokenizer's own chat template as an AsyncFlow ``ChatFormat``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from asyncflow_core.contracts.errors import BadRequestError, ConfigError
from asyncflow_core.engines.enginekit import is_int
from asyncflow_core.flow.chat import AssistantMessage, Message, check_messages, split_tool_blocks
from asyncflow_core.flow.tools import load_json

__all__ = ["END_OF_TURN_TOKENS", "REFERENCE_CONVERSATION", "HFChatFormat"]

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
"""Tokens that end a chat turn in common templates (ChatML/Qwen, Llama 3, Phi-3, Gemma): stop
tokens besides ``eos_token`` when the vocabulary has them."""

REFERENCE_CONVERSATION: tuple[Mapping[str, str], ...] = (
    {"role": "user", "content": "x"},
    {"role": "assistant", "content": "y"},
)
"""The fixed conversation ``followup`` renders new messages after: it starts with a user turn
(some templates refuse anything else) and ends with a finished assistant turn."""

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class HFChatFormat:
    """A ``ChatFormat`` (``asyncflow_core.flow.chat``) over a Hugging Face ``tokenizer`` and its
    chat template: ``prompt`` is ``apply_chat_template`` itself, ``followup`` renders only what
    comes after a finished assistant turn, ``parse`` reads Hermes ``<tool_call>`` blocks.

    **Stop tokens.** ``stop_token_ids`` when given; otherwise the tokenizer's ``eos_token_id``,
    then each of ``END_OF_TURN_TOKENS`` (``<|im_end|>``, ``<|eot_id|>``, ``<|end|>``,
    ``<end_of_turn>``) that the vocabulary holds, without repeats. An instruct model's turn
    usually ends with its eos, but a base tokenizer's eos (Qwen's ``<|endoftext|>``) is not the
    token its template closes turns with, hence the extra ones. Give ``stop_token_ids`` when
    the template ends turns with another token.

    **Tool calls in messages.** Assistant messages may carry OpenAI-style ``tool_calls`` whose
    ``arguments`` are JSON strings; many templates (Qwen2.5's) write ``arguments | tojson``,
    which would render a string as a quoted string, so they are decoded to dicts (on copies:
    the caller's messages are never changed) before rendering.

    **Reasoning.** When a turn holds a ``<think>...</think>`` block (Qwen3 and other reasoning
    models), ``parse`` keeps it in ``AssistantMessage.text`` but not in ``content``, and reads
    tool calls only after it (a model thinking about a call has not made it yet); a
    ``<think>`` never closed (the turn was cut off while reasoning) leaves no content."""

    def __init__(self, tokenizer: Any, *, stop_token_ids: Sequence[int] | None = None) -> None:
        name = type(tokenizer).__name__
        if not callable(getattr(tokenizer, "apply_chat_template", None)) or not callable(
            getattr(tokenizer, "decode", None)
        ):
            raise ConfigError(
                f"HFChatFormat: the tokenizer must be a Hugging Face tokenizer (with "
                f"apply_chat_template and decode), got {name}"
            )
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"HFChatFormat: the tokenizer ({name}) has no chat template; load one from a "
                f"model folder that has it (chat_template.jinja), set tokenizer.chat_template, "
                f"or use asyncflow_core.flow.chat.MinimalChatFormat"
            )
        self.tokenizer = tokenizer
        self._stop = _stop_tokens(tokenizer, stop_token_ids)
        self._reference: tuple[list[int], int] | None = None

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The tokens that end an assistant turn (give them to ``SamplingParams``)."""
        return self._stop

    # -- rendering ------------------------------------------------------------------------------
    def prompt(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """``messages`` (and ``tools``, OpenAI-style schemas) rendered by the template, with the
        next assistant turn opened."""
        who = "HFChatFormat.prompt"
        schemas = _check_tools(tools, who)
        return self._render(_prepare(messages, who), schemas, generation_prompt=True, who=who)

    def followup(self, messages: Sequence[Message]) -> list[int]:
        """The tokens that follow an assistant turn the engine ended with a stop token, to add
        ``messages`` and open the next assistant turn; the conversation before is not rendered
        again.

        How: the template renders ``REFERENCE_CONVERSATION`` alone (cached) and followed by
        ``messages`` with the generation prompt; the result is what the second rendering has
        after the reference assistant turn's stop token (the last stop token of the first), which
        includes what the template puts between turns (the ``\\n`` after ``<|im_end|>``), never
        generated by the engine. When the second rendering does not start with the first,
        the template rendered the reference turns differently once more turns followed. That is
        accepted only if the turns before the reference assistant turn are unchanged and only
        that turn is (Qwen3 writes an empty ``<think></think>`` into the last assistant turn of a
        conversation and not into earlier ones): the turn then ends at its first stop token.
        Anything else is a ``ConfigError``: this template cannot be continued token-wise. (The
        cached reference is rendered again once before that, for templates whose text changes
        over time, such as a system prompt holding today's date.)"""
        who = "HFChatFormat.followup"
        msgs = _prepare(messages, who)
        full = self._render([*REFERENCE_CONVERSATION, *msgs], None, generation_prompt=True, who=who)
        for fresh in (False, True):
            reference, turn_start = self._reference_ids(fresh)
            if full[: len(reference)] == reference:
                return full[len(reference) :]
            if turn_start >= 0 and full[:turn_start] == reference[:turn_start]:
                stops = (i for i in range(turn_start, len(full)) if full[i] in self._stop)
                end = next(stops, None)
                if end is not None:
                    return full[end + 1 :]
        raise ConfigError(
            f"{who}: the chat template renders the conversation before the new messages "
            f"differently once they follow, so the new turns cannot be rendered alone: "
            f"{list(REFERENCE_CONVERSATION)} renders as {self.decode(reference)!r}, and with the "
            f"new messages after it as {self.decode(full[: len(reference) + 16])!r}...; "
            f"re-render the whole conversation with prompt(), or use a template whose earlier "
            f"turns do not depend on what follows"
        )

    def _reference_ids(self, fresh: bool = False) -> tuple[list[int], int]:
        """``REFERENCE_CONVERSATION`` rendered (cached unless ``fresh``), up to and including
        its assistant turn's stop token, and where that turn starts (after the stop token before
        it; -1 if none)."""
        if self._reference is None or fresh:
            who = "HFChatFormat.followup"
            try:
                ids = self._render(REFERENCE_CONVERSATION, None, generation_prompt=False, who=who)
            except BadRequestError as exc:
                raise ConfigError(
                    f"{who}: the chat template cannot render the reference conversation "
                    f"{list(REFERENCE_CONVERSATION)} ({exc}); followup needs a template that "
                    f"accepts a user turn and an assistant turn"
                ) from exc
            stops = [i for i, t in enumerate(ids) if t in self._stop]
            if not stops:
                raise ConfigError(
                    f"{who}: the chat template ends an assistant turn with none of the stop "
                    f"tokens {list(self._stop)} (it renders {list(REFERENCE_CONVERSATION)} as "
                    f"{self.decode(ids)!r}); pass stop_token_ids= with the token that ends a turn"
                )
            turn_start = stops[-2] + 1 if len(stops) > 1 else -1
            self._reference = (ids[: stops[-1] + 1], turn_start)
        return self._reference

    def _render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None,
        *,
        generation_prompt: bool,
        who: str,
    ) -> list[int]:
        from jinja2.exceptions import TemplateError  # a dependency of transformers

        try:
            ids = self.tokenizer.apply_chat_template(
                [dict(m) for m in messages],
                tools=list(tools) if tools else None,
                add_generation_prompt=generation_prompt,
                tokenize=True,
                return_dict=False,
            )
        except TemplateError as exc:  # the template's raise_exception, or a Jinja error
            raise BadRequestError(f"{who}: the chat template refused the messages: {exc}") from exc
        return [int(t) for t in ids]

    # -- reading --------------------------------------------------------------------------------
    def decode(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens``, special tokens included."""
        return str(self.tokenizer.decode(list(tokens), skip_special_tokens=False))

    def parse(self, tokens: Sequence[int]) -> AssistantMessage:
        """A generated assistant turn (its final stop token, if any, dropped) as a message:
        Hermes ``<tool_call>`` blocks become ``tool_calls`` (or ``malformed``); a reasoning
        block stays in ``text`` only (class docstring)."""
        ids = list(tokens)
        if ids and ids[-1] in self._stop:
            ids = ids[:-1]
        text = self.decode(ids)
        if THINK_OPEN not in text and THINK_CLOSE not in text:
            return split_tool_blocks(text)
        parsed = split_tool_blocks(_after_reasoning(text))
        return AssistantMessage(parsed.content, parsed.tool_calls, parsed.malformed, text)


def _after_reasoning(text: str) -> str:
    """``text`` after its last ``</think>`` (the prompt may have opened the block), or before
    a ``<think>`` never closed."""
    end = text.rfind(THINK_CLOSE)
    if end >= 0:
        return text[end + len(THINK_CLOSE) :]
    return text[: text.find(THINK_OPEN)]


def _stop_tokens(tokenizer: Any, given: Sequence[int] | None) -> tuple[int, ...]:
    """The stop tokens: ``given`` (checked), or those found as the class docstring says."""
    if given is not None:
        if (
            isinstance(given, str | bytes)
            or not isinstance(given, Sequence)
            or not given
            or not all(is_int(t) and t >= 0 for t in given)
        ):
            raise ConfigError(
                f"HFChatFormat: stop_token_ids must be a non-empty list of token ids (ints >= 0), "
                f"got {given!r:.120}"
            )
        return tuple(dict.fromkeys(int(t) for t in given))
    found: list[int] = []
    eos = getattr(tokenizer, "eos_token_id", None)
    for t in eos if isinstance(eos, list | tuple) else (eos,):
        if is_int(t) and t not in found:
            found.append(t)
    get_vocab = getattr(tokenizer, "get_vocab", None)
    vocab: Mapping[str, Any] = get_vocab() if callable(get_vocab) else {}
    for token in END_OF_TURN_TOKENS:
        t = vocab.get(token)
        if is_int(t) and t not in found:
            found.append(t)
    if not found:
        raise ConfigError(
            f"HFChatFormat: found no stop token: the tokenizer ({type(tokenizer).__name__}) has "
            f"no eos_token and none of {list(END_OF_TURN_TOKENS)}; pass stop_token_ids= with the "
            f"id of the token that ends an assistant turn"
        )
    return tuple(found)


def _check_tools(tools: object, who: str) -> list[Mapping[str, Any]] | None:
    """``tools`` as a list of schemas (None when there are none)."""
    if tools is None:
        return None
    if (
        isinstance(tools, str | bytes)
        or not isinstance(tools, Sequence)
        or not all(isinstance(t, Mapping) for t in tools)
    ):
        raise BadRequestError(
            f"{who}: tools must be a list of OpenAI-style tool schemas (dicts) or None, got "
            f"{tools!r:.120}"
        )
    return list(tools) or None


def _prepare(messages: object, who: str) -> list[dict[str, Any]]:
    """Checked copies of ``messages``, tool-call arguments given as JSON strings decoded."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(check_messages(messages, who)):
        msg = dict(message)
        calls = msg.get("tool_calls")
        if calls:
            where = f"{who}: messages[{i}].tool_calls"
            if isinstance(calls, str | bytes) or not isinstance(calls, Sequence):
                raise BadRequestError(f"{where} must be a list, got {type(calls).__name__}")
            msg["tool_calls"] = [_decode_call(c, f"{where}[{j}]") for j, c in enumerate(calls)]
        out.append(msg)
    return out


def _decode_call(call: object, where: str) -> dict[str, Any]:
    """A copy of an OpenAI-style call (``{"function": {"name", "arguments"}}``, or the flat
    ``{"name", "arguments"}``) with ``arguments`` a dict (``{}`` when left out);
    ``BadRequestError`` for anything else (a template would fail on it in its own way)."""
    shape = "{'type': 'function', 'function': {'name': str, 'arguments': JSON object or string}}"
    if not isinstance(call, Mapping):
        raise BadRequestError(f"{where} must be {shape}, got {call!r:.120}")
    out = dict(call)
    if "function" not in out:
        return _decode_arguments(out, where, shape)
    fn = out["function"]
    if not isinstance(fn, Mapping):
        raise BadRequestError(f"{where}.function must be an object ({shape}), got {fn!r:.120}")
    out["function"] = _decode_arguments(fn, f"{where}.function", shape)
    return out


def _decode_arguments(holder: Mapping[str, Any], where: str, shape: str) -> dict[str, Any]:
    out = dict(holder)
    name = out.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequestError(
            f"{where}.name must be a non-empty string ({shape}), got {name!r:.80}"
        )
    args = out.get("arguments", {})
    if isinstance(args, str):
        try:
            args = load_json(args) if args.strip() else {}
        except ValueError as exc:  # not JSON, or nested too deep (tools.load_json)
            raise BadRequestError(
                f"{where}.arguments is not JSON ({exc}): {out['arguments']!r:.120}; give a JSON "
                f"object (as a string or a dict)"
            ) from exc
    if not isinstance(args, Mapping):
        raise BadRequestError(
            f"{where}.arguments must be a JSON object, got {out.get('arguments')!r:.120}"
        )
    out["arguments"] = dict(args)
    return out
