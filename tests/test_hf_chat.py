"""asyncflow_hf.HFChatFormat against a real transformers tokenizer and real Jinja chat templates
(the ChatML-like one of ``build_tokenizer``, and Qwen2.5-style and Qwen3-style tool templates
written here): the followup law token for token, why followup exists (a reasoning template
rewrites history when re-rendered), parsing, and refusals."""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any

import pytest

transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from asyncflow_hf import HFChatFormat  # noqa: E402
from asyncflow_hf.assets import build_tokenizer  # noqa: E402

from asyncflow_core.contracts.errors import BadRequestError, ConfigError  # noqa: E402
from asyncflow_core.flow.chat import ChatFormat  # noqa: E402

# A ChatML template with tools in the manner of Qwen2.5-Instruct's: a system turn (the default
# one when the conversation has none) listing the tool schemas as JSON in <tools></tools>,
# assistant calls as <tool_call> blocks of {"name", "arguments": arguments|tojson}, and tool
# results inside a user turn, consecutive ones in the same turn.
QWEN25_STYLE = r"""
{%- set default_system = 'You are a helpful assistant.' %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {{- messages[0].content if messages[0].role == 'system' else default_system }}
    {{- '\n\n# Tools\n\nYou may call functions to help with the query. Their signatures are ' }}
    {{- 'in <tools></tools>:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nWrite each call as <tool_call>\n{"name": <function-name>, ' }}
    {{- '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\n' + default_system + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for call in message.tool_calls or [] %}
            {%- set call = call.function if call.function is defined else call %}
            {{- '\n<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
            {{- (call.arguments | tojson) + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# The same in the manner of Qwen3's: no default system turn; an assistant turn's
# <think>...</think> is kept only for turns after the last real user query (tool results do
# not count as one) and dropped from earlier ones; the last assistant turn of a conversation
# gets an (empty) think block even when it had none; string arguments are written as they are.
QWEN3_STYLE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call functions to help with the query. Their signatures are ' }}
    {{- 'in <tools></tools>:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nWrite each call as <tool_call>\n{"name": <function-name>, ' }}
    {{- '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(searching=true, last_query=messages | length - 1) %}
{%- for message in messages | reverse %}
    {%- set index = messages | length - 1 - loop.index0 %}
    {%- if ns.searching and message.role == 'user' and not (message.content.startswith(
            '<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.searching = false %}
        {%- set ns.last_query = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1] %}
            {%- set reasoning = reasoning.lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' }}
            {{- content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- for call in message.tool_calls or [] %}
            {%- if content or not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {%- set call = call.function if call.function is defined else call %}
            {{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
            {{- call.arguments if call.arguments is string else call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOLS = [WEATHER]


def call(name: str, arguments: dict[str, Any], call_id: str) -> dict[str, Any]:
    """An OpenAI-style tool call, arguments as a JSON string (as OpenAI clients send them)."""
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def tool(content: str, call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


@pytest.fixture(scope="module")
def base_tokenizer() -> Any:
    return build_tokenizer()


def with_template(tokenizer: Any, template: str | None) -> Any:
    out = copy.deepcopy(tokenizer)
    out.chat_template = template
    return out


@pytest.fixture(scope="module")
def chatml(base_tokenizer: Any) -> HFChatFormat:
    return HFChatFormat(base_tokenizer)


@pytest.fixture(scope="module")
def qwen25(base_tokenizer: Any) -> HFChatFormat:
    return HFChatFormat(with_template(base_tokenizer, QWEN25_STYLE))


@pytest.fixture(scope="module")
def qwen3(base_tokenizer: Any) -> HFChatFormat:
    return HFChatFormat(with_template(base_tokenizer, QWEN3_STYLE))


def generated(fmt: HFChatFormat, before: Sequence[Any], assistant: Any, tools: Any) -> list[int]:
    """The assistant turn as the engine produces it after ``prompt(before)``: the template's own
    rendering of the turn, up to and including its stop token."""
    prompt = fmt.prompt(before, tools)
    whole = fmt.tokenizer.apply_chat_template(
        [json_arguments_as_dicts(m) for m in [*before, assistant]],
        tools=tools,
        add_generation_prompt=False,
        tokenize=True,
        return_dict=False,
    )
    assert whole[: len(prompt)] == prompt, "the template must render earlier turns the same"
    turn = whole[len(prompt) :]
    end = next(i for i, t in enumerate(turn) if t in fmt.stop_token_ids)
    return [int(t) for t in turn[: end + 1]]


def json_arguments_as_dicts(message: dict[str, Any]) -> dict[str, Any]:
    out = dict(message)
    if out.get("tool_calls"):
        out["tool_calls"] = [
            {
                **c,
                "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])},
            }
            for c in out["tool_calls"]
        ]
    return out


USER: dict[str, Any] = {"role": "user", "content": "What is the weather in Paris and in Rome?"}
ONE_CALL: dict[str, Any] = {
    "role": "assistant",
    "content": "I will look it up.",
    "tool_calls": [call("weather", {"city": "Paris"}, "c1")],
}
TWO_CALLS: dict[str, Any] = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        call("weather", {"city": "Paris"}, "c1"),
        call("weather", {"city": "Rome"}, "c2"),
    ],
}
PLAIN: dict[str, Any] = {"role": "assistant", "content": "Sunny in Paris, rainy in Rome."}

# (conversation before the assistant turn, the assistant turn, the messages after it)
CASES: list[tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]]]] = [
    ([USER], ONE_CALL, [tool("sunny, 24C", "c1")]),
    ([USER], TWO_CALLS, [tool("sunny, 24C", "c1"), tool("rainy, 15C", "c2")]),
    (
        [{"role": "system", "content": "Be brief."}, USER],
        PLAIN,
        [{"role": "user", "content": "And tomorrow?"}],
    ),
    (
        [USER, ONE_CALL, tool("sunny, 24C", "c1")],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [call("weather", {"city": "Rome"}, "c2")],
        },
        [tool("rainy, 15C", "c2")],
    ),
]


# --------------------------------------------------------------------------------------------
# The followup law
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("which", ["chatml", "qwen25"])
def test_followup_law(which: str, case: int, request: pytest.FixtureRequest) -> None:
    fmt: HFChatFormat = request.getfixturevalue(which)
    before, assistant, after = CASES[case]
    # build_tokenizer's minimal template renders content only: tools and calls are not in it
    tools = TOOLS if which == "qwen25" else None
    stream = fmt.prompt(before, tools) + generated(fmt, before, assistant, tools)
    stream += fmt.followup(after)
    assert stream == fmt.prompt([*before, assistant, *after], tools)


def test_followup_law_over_a_whole_episode(qwen25: HFChatFormat) -> None:
    """Three assistant turns appended token-wise equal the whole episode rendered at once."""
    turns = [(ONE_CALL, [tool("sunny", "c1")]), (TWO_CALLS, [tool("a", "c1"), tool("b", "c2")])]
    conversation: list[Any] = [USER]
    stream = qwen25.prompt(conversation, TOOLS)
    for assistant, after in turns:
        stream += generated(qwen25, conversation, assistant, TOOLS) + qwen25.followup(after)
        conversation += [assistant, *after]
    assert stream == qwen25.prompt(conversation, TOOLS)


def test_followup_holds_the_separator_the_engine_never_generates(chatml: HFChatFormat) -> None:
    ids = chatml.followup([{"role": "user", "content": "next"}])
    assert chatml.decode(ids) == "\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n"
    assert chatml.followup([{"role": "user", "content": "next"}]) == ids  # cached reference


def test_followup_follows_a_template_whose_text_changes(base_tokenizer: Any) -> None:
    """A system prompt with today's date changes overnight: the cached reference is renewed."""
    dated = with_template(base_tokenizer, "day 1\n" + base_tokenizer.chat_template)
    fmt = HFChatFormat(dated)
    first = fmt.followup([{"role": "user", "content": "next"}])
    dated.chat_template = "day 2\n" + base_tokenizer.chat_template
    assert fmt.followup([{"role": "user", "content": "next"}]) == first


def test_followup_excludes_a_default_system_prompt(qwen25: HFChatFormat) -> None:
    text = qwen25.decode(qwen25.followup([tool("sunny", "c1")]))
    assert text == "\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )


# --------------------------------------------------------------------------------------------
# Why followup: a reasoning template rewrites history when the conversation is re-rendered
# --------------------------------------------------------------------------------------------
THINKING: dict[str, Any] = {
    "role": "assistant",
    "content": "<think>\nParis is in France.\n</think>\n\nIt is sunny in Paris.",
}


def test_rerendering_a_reasoning_template_drifts_and_followup_does_not(qwen3: HFChatFormat) -> None:
    before = [USER]
    after = [{"role": "user", "content": "And in Rome?"}]
    turn = generated(qwen3, before, THINKING, None)
    assert "Paris is in France." in qwen3.decode(turn)  # the engine generated the reasoning

    stream = qwen3.prompt(before) + turn + qwen3.followup(after)
    rerendered = qwen3.prompt([*before, THINKING, *after])
    assert stream != rerendered  # re-tokenising the history drifts...
    assert "Paris is in France." in qwen3.decode(stream)
    assert "Paris is in France." not in qwen3.decode(rerendered)  # ...the think block is gone
    # the stream holds exactly what was generated, and the new turns as the template writes them
    assert stream[: len(qwen3.prompt(before)) + len(turn)] == qwen3.prompt(before) + turn
    assert rerendered[-len(qwen3.followup(after)) :] == qwen3.followup(after)


def test_reasoning_template_keeps_think_within_a_tool_episode(qwen3: HFChatFormat) -> None:
    """Tool results are no new query: Qwen3 keeps the think block, and the law holds; the
    reference turn, which the template renders differently once it is not the last one (an
    empty think block), does not disturb followup."""
    assistant = {
        "role": "assistant",
        "content": "<think>\nI need the weather.\n</think>\n\n",
        "tool_calls": [call("weather", {"city": "Paris"}, "c1")],
    }
    after = [tool("sunny", "c1"), tool("and warm", "c1")]
    reference = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    alone = qwen3.tokenizer.apply_chat_template(reference, tokenize=False)
    followed = qwen3.tokenizer.apply_chat_template([*reference, *after], tokenize=False)
    assert "<think>\n\n</think>\n\ny<|im_end|>" in alone
    assert "<think>" not in followed  # not a prefix: followup finds the turn's end by itself
    stream = qwen3.prompt([USER], TOOLS) + generated(qwen3, [USER], assistant, TOOLS)
    stream += qwen3.followup(after)
    assert stream == qwen3.prompt([USER, assistant, *after], TOOLS)


# --------------------------------------------------------------------------------------------
# prompt
# --------------------------------------------------------------------------------------------
def test_prompt_is_the_template_with_the_generation_prompt(
    base_tokenizer: Any, chatml: HFChatFormat
) -> None:
    messages = [{"role": "user", "content": "Tom has 3 apples."}]
    ids = chatml.prompt(messages)
    assert all(type(t) is int for t in ids)
    assert chatml.decode(ids) == (
        "<|startoftext|><|im_start|>user\nTom has 3 apples.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert isinstance(chatml, ChatFormat)


def test_prompt_renders_json_string_arguments_as_objects(qwen25: HFChatFormat) -> None:
    conversation = [USER, ONE_CALL, tool("sunny", "c1")]
    snapshot = copy.deepcopy(conversation)
    text = qwen25.decode(qwen25.prompt(conversation, TOOLS))
    assert '{"name": "weather", "arguments": {"city": "Paris"}}' in text
    assert "\n<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text  # the schema is listed
    assert conversation == snapshot  # the caller's messages are not changed
    as_dicts = [USER, json_arguments_as_dicts(ONE_CALL), tool("sunny", "c1")]
    assert qwen25.prompt(as_dicts, TOOLS) == qwen25.prompt(conversation, TOOLS)


# --------------------------------------------------------------------------------------------
# parse and decode
# --------------------------------------------------------------------------------------------
def turn_ids(fmt: HFChatFormat, text: str) -> list[int]:
    ids = fmt.tokenizer.encode(text, add_special_tokens=False)
    return [*ids, fmt.stop_token_ids[0]]


def test_parse_tool_calls(chatml: HFChatFormat) -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "weather", "arguments": "{\\"city\\": \\"Rome\\"}"}'
        "\n</tool_call>"
    )
    msg = chatml.parse(turn_ids(chatml, text))
    assert msg.content == "Let me check."
    assert [(c.name, dict(c.arguments)) for c in msg.tool_calls] == [
        ("weather", {"city": "Paris"}),
        ("weather", {"city": "Rome"}),
    ]
    assert msg.malformed == ()
    assert msg.text == text  # the stop token dropped, the blocks kept


def test_parse_reports_malformed_calls(chatml: HFChatFormat) -> None:
    text = '<tool_call>{"name": "weather", "arguments": {"city": </tool_call>'
    text += '<tool_call>{"name": "weather", "arguments": {}}</tool_call>'
    msg = chatml.parse(turn_ids(chatml, text))
    assert [(c.name, dict(c.arguments)) for c in msg.tool_calls] == [("weather", {})]
    assert len(msg.malformed) == 1 and msg.malformed[0].error == "malformed"
    assert "not JSON" in msg.malformed[0].content


def test_parse_plain_content(chatml: HFChatFormat) -> None:
    msg = chatml.parse(turn_ids(chatml, "Tom has 3 + 4 = 7 apples.\n#### 7"))
    assert msg.content == "Tom has 3 + 4 = 7 apples.\n#### 7"
    assert msg.tool_calls == () and msg.malformed == ()
    without_stop = chatml.tokenizer.encode("#### 7", add_special_tokens=False)
    assert chatml.parse(without_stop).content == "#### 7"  # cut off by max_tokens


def test_parse_strips_reasoning_from_content(chatml: HFChatFormat) -> None:
    text = (
        "<think>\nMaybe <tool_call>{}</tool_call> would help.\n</think>\n\nI will check.\n"
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    msg = chatml.parse(turn_ids(chatml, text))
    assert msg.content == "I will check."
    assert msg.text == text  # the reasoning is kept in text
    assert [c.name for c in msg.tool_calls] == ["weather"]
    assert msg.malformed == ()  # a block inside the reasoning is not a call
    # a prompt that opened the block itself: only the close is generated
    assert chatml.parse(turn_ids(chatml, "thinking\n</think>\n\n42")).content == "42"
    # cut off while reasoning: no content yet
    cut = chatml.tokenizer.encode("<think>\nstill thinking", add_special_tokens=False)
    assert chatml.parse(cut).content == ""


def test_decode_keeps_special_tokens(chatml: HFChatFormat) -> None:
    ids = turn_ids(chatml, "done")
    assert chatml.decode(ids) == "done<|im_end|>"
    assert chatml.decode(tuple(ids)) == "done<|im_end|>"


# --------------------------------------------------------------------------------------------
# Stop tokens and refusals
# --------------------------------------------------------------------------------------------
def test_stop_tokens(base_tokenizer: Any) -> None:
    eos = base_tokenizer.eos_token_id  # <|im_end|>, also an end-of-turn token: once
    assert HFChatFormat(base_tokenizer).stop_token_ids == (eos,)
    other = with_template(base_tokenizer, base_tokenizer.chat_template)
    other.eos_token = "<|endoftext|>"  # a base model's eos: <|im_end|> still ends a turn
    assert HFChatFormat(other).stop_token_ids == (other.eos_token_id, eos)
    assert HFChatFormat(base_tokenizer, stop_token_ids=[7, 7, 3]).stop_token_ids == (7, 3)


@pytest.mark.parametrize("bad", [[], "3", [-1], [1.5], [True]])
def test_bad_stop_token_ids(base_tokenizer: Any, bad: Any) -> None:
    with pytest.raises(ConfigError, match="stop_token_ids"):
        HFChatFormat(base_tokenizer, stop_token_ids=bad)


def test_no_stop_token_found() -> None:
    class NoEnd:
        chat_template = "{{ messages }}"
        eos_token_id = None

        def apply_chat_template(self, *args: Any, **kwargs: Any) -> list[int]:
            return []

        def decode(self, *args: Any, **kwargs: Any) -> str:
            return ""

        def get_vocab(self) -> dict[str, int]:
            return {"a": 0}

    with pytest.raises(ConfigError, match="stop_token_ids="):
        HFChatFormat(NoEnd())


def test_no_chat_template(base_tokenizer: Any) -> None:
    with pytest.raises(ConfigError, match="no chat template"):
        HFChatFormat(with_template(base_tokenizer, None))
    with pytest.raises(ConfigError, match="apply_chat_template"):
        HFChatFormat(object())


def test_bad_messages(chatml: HFChatFormat) -> None:
    with pytest.raises(BadRequestError, match=r"messages\[1\]"):
        chatml.prompt([{"role": "user", "content": "hi"}, {"content": "no role"}])
    with pytest.raises(BadRequestError, match=r"messages\[0\].*content"):
        chatml.followup([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    with pytest.raises(BadRequestError, match="must be a list"):
        chatml.prompt("hello")  # type: ignore[arg-type]
    with pytest.raises(BadRequestError, match="tools must be a list"):
        chatml.prompt([USER], tools=["weather"])  # type: ignore[list-item]
    bad_call = call("weather", {}, "c")
    bad_call["function"]["arguments"] = "{city: Paris"
    bad_json = {"role": "assistant", "content": "", "tool_calls": [bad_call]}
    with pytest.raises(BadRequestError, match=r"messages\[1\]\.tool_calls\[0\]\.function"):
        chatml.prompt([USER, bad_json])
    # calls a template would fail on in its own way (a TypeError, a RecursionError) are named
    where = r"messages\[1\]\.tool_calls\[0\]"
    for bad, what in [
        ({"type": "function", "function": None}, r"\.function must be an object"),
        ({"type": "function", "function": {"arguments": "{}"}}, r"\.function\.name"),
        ({"name": "weather", "arguments": [1]}, r"\.arguments must be a JSON object"),
        ({"name": "weather", "arguments": "[" * 100_000}, r"\.arguments is not JSON.*deeper"),
        ({"name": "weather", "arguments": '{"a": ' + "1" * 5000 + "}"}, r"\.arguments is not JSON"),
    ]:
        message = {"role": "assistant", "content": "", "tool_calls": [bad]}
        with pytest.raises(BadRequestError, match=where + what):
            chatml.prompt([USER, message])


def test_template_refusal_is_a_bad_request(base_tokenizer: Any) -> None:
    strict = "{{ raise_exception('roles must alternate') if messages[0].role != 'user' }}"
    fmt = HFChatFormat(with_template(base_tokenizer, strict + base_tokenizer.chat_template))
    with pytest.raises(BadRequestError, match="roles must alternate"):
        fmt.prompt([{"role": "assistant", "content": "hi"}])


def test_template_that_cannot_be_continued(base_tokenizer: Any) -> None:
    """A template whose first turn depends on the length of the conversation: the new turns
    cannot be rendered alone."""
    counting = "{{ messages | length }} turns\n" + base_tokenizer.chat_template
    fmt = HFChatFormat(with_template(base_tokenizer, counting))
    with pytest.raises(ConfigError, match="differently once they follow"):
        fmt.followup([{"role": "user", "content": "next"}])


def test_template_that_never_ends_a_turn_with_the_stop_token(base_tokenizer: Any) -> None:
    fmt = HFChatFormat(base_tokenizer, stop_token_ids=[base_tokenizer.pad_token_id])
    with pytest.raises(ConfigError, match="none of the stop tokens"):
        fmt.followup([{"role": "user", "content": "next"}])
