"""``asyncflow_serve``: the OpenAI-compatible endpoint, driven by the real ``openai`` client and
LangGraph over ``langchain_openai.ChatOpenAI``, against a real ``TorchInferenceEngine`` (a tiny
random model over the reference ``PieceTokenizer``'s chat format).

The model is random, so its text is gibberish: turns that must be tool calls or a clean answer
come from ``Scripted``, a documented script around the real engine (see its docstring); every
other turn is sampled by the real engine. Nothing waits on the clock: concurrency is arranged
with events, and timeouts are only safety nets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")

import aiohttp  # noqa: E402
from asyncflow_reference.agentic import LookupTask, PieceTokenizer, chat_format  # noqa: E402
from asyncflow_reference.engines import TorchInferenceEngine, TorchTrainEngine  # noqa: E402
from asyncflow_reference.model import ModelConfig  # noqa: E402
from asyncflow_serve import ChatEndpoint, EndpointLoop, Session, SessionRecord  # noqa: E402

from asyncflow_core.contracts.errors import BadRequestError, EngineError  # noqa: E402
from asyncflow_core.contracts.protocols import (  # noqa: E402
    GenerationRequest,
    GenerationResult,
    SamplingParams,
)
from asyncflow_core.data.scheduling import RequestRouter  # noqa: E402
from asyncflow_core.flow.agent import GenerationClient, Trajectory, TrajectoryLimits  # noqa: E402
from asyncflow_core.flow.rlflow import RLConfig, RLEngines, RLJob  # noqa: E402

CHAT = chat_format()
TOK = PieceTokenizer()  # the same pieces as CHAT's tokenizer
STOP = CHAT.stop_token_ids[0]
MODEL = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=1, n_heads=2, max_seq_len=256)
SAMPLING = SamplingParams(max_tokens=12, seed=3, stop_token_ids=CHAT.stop_token_ids)
SAFETY_S = 30.0  # a safety net only: nothing below waits on the clock

USER = {"role": "user", "content": "number of Eve?"}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up a person's phone number.",
        "parameters": {
            "type": "object",
            "properties": {"person": {"type": "string"}},
            "required": ["person"],
        },
    },
}
CALL_TEXT = '<tool_call>{"name": "lookup", "arguments": {"person": "Eve"}}</tool_call>'
CALL = [*TOK.encode(CALL_TEXT), STOP]
ANSWER = [*TOK.encode("407"), STOP]


class Scripted:
    """A script for protocol tests around the real engine. Each entry of ``script`` answers
    the next request instead of sampling: its token ids (cut at the request's ``max_tokens``,
    ``"stop"`` when the last one is a stop token, else ``"length"``), each with log-prob 0.0
    and the engine's weight version. These turns are *not* samples of the model: they stand
    for what a trained policy would write, so the tests can drive tool calls deterministically.
    With the script empty, the real engine answers. ``requests`` records every request;
    ``arrived`` is set when one arrives; ``gate`` (if set) holds scripted answers until it
    opens; ``fail_next`` makes the next request raise ``EngineError``."""

    def __init__(self, inner: TorchInferenceEngine) -> None:
        self.inner = inner
        self.script: list[Sequence[int]] = []
        self.requests: list[GenerationRequest] = []
        self.results: list[GenerationResult] = []
        self.arrived = asyncio.Event()
        self.gate: asyncio.Event | None = None
        self.fail_next = False

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.requests.append(request)
        self.arrived.set()
        if self.fail_next:
            self.fail_next = False
            raise EngineError("the scripted engine failed this request")
        if self.script:
            ids = tuple(self.script.pop(0))[: request.params.max_tokens]
            if self.gate is not None:
                await self.gate.wait()
            stopped = bool(ids) and ids[-1] in request.params.stop_token_ids
            result = GenerationResult(
                request.request_id,
                request.prompt_tokens,
                ids,
                (0.0,) * len(ids),
                (self.weight_version,) * len(ids),
                "stop" if stopped else "length",
            )
        else:
            result = await self.inner.generate(request)
        self.results.append(result)
        return result

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self.inner.abort(request_ids)


@dataclass
class Rig:
    engine: Scripted
    router: RequestRouter
    endpoint: ChatEndpoint

    def client(self, tid: str, **kw: Any) -> GenerationClient:
        kw.setdefault("sampling", SAMPLING)
        return GenerationClient([self.engine], self.router, tid, **kw)

    def open(self, tid: str = "t", **kw: Any) -> tuple[GenerationClient, Session]:
        client = self.client(tid, **kw)
        return client, self.endpoint.open(client)


@contextlib.asynccontextmanager
async def rig(**endpoint_kw: Any) -> AsyncIterator[Rig]:
    engine = Scripted(TorchInferenceEngine(MODEL, max_batch=8, seed=0, threads=1))
    endpoint = ChatEndpoint(CHAT, **endpoint_kw)
    await endpoint.start()
    try:
        yield Rig(engine, RequestRouter(["0"]), endpoint)
    finally:
        await endpoint.close()
        await engine.inner.close()


def run(coro: Any) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, SAFETY_S)

    return asyncio.run(bounded())


def aclient(session: Session, **kw: Any) -> Any:
    return openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, **kw)


def generated(t: Trajectory) -> list[tuple[int, ...]]:
    return [t.tokens[turn.start : turn.end] for turn in t.assistant_turns()]


def shown(tokens: Sequence[int]) -> str:
    """The content the endpoint returns for a turn without returned tool calls."""
    parsed = CHAT.parse(tokens)
    return parsed.text if parsed.tool_calls or parsed.malformed else parsed.content


def state(record: SessionRecord) -> tuple[Any, ...]:
    """Everything a refusal must leave as it was (``errors`` counts the refusals)."""
    return (record.segments, record.requests, record.mismatches, record.malformed, record.last)


# --- 1: one completion, exact tokens ------------------------------------------------------
def test_a_completion_records_exactly_the_prompt_and_the_generated_tokens() -> None:
    async def main() -> None:
        async with rig() as r:
            _, s = r.open("t1")
            async with aclient(s) as oa:
                resp = await oa.chat.completions.create(
                    model="my-agent", messages=[USER], logprobs=True
                )
            record = r.endpoint.record(s.key)
            (t,) = record.segments
            prompt = CHAT.prompt([USER])
            (turn,) = generated(t)
            assert t.tokens == (*prompt, *turn)  # token in, token out
            assert t.loss_mask == (0,) * len(prompt) + (1,) * len(turn)
            assert turn == r.engine.results[-1].tokens
            choice = resp.choices[0]
            # chat.parse(recorded tokens): its content (its raw text if the random model wrote
            # a stray <tool_call> block, which the endpoint returns as written)
            assert choice.message.content == shown(turn)
            assert choice.finish_reason == ("stop" if turn[-1] == STOP else "length")
            assert resp.model == "my-agent" and resp.object == "chat.completion"
            assert resp.usage.prompt_tokens == len(prompt)
            assert resp.usage.completion_tokens == len(turn)
            assert [lp.logprob for lp in choice.logprobs.content] == pytest.approx(
                t.logprobs[len(prompt) :]
            )
            assert record.requests == 1 and record.mismatches == 0

            # the blocking client, from a worker thread, on another session
            _, s2 = r.open("t2")

            def blocking() -> Any:
                with openai.OpenAI(base_url=s2.base_url, api_key=s2.api_key) as sync:
                    assert [m.id for m in sync.models.list()] == ["asyncflow-policy"]
                    return sync.chat.completions.create(model="m", messages=[USER])

            resp2 = await asyncio.to_thread(blocking)
            (t2,) = r.endpoint.close_session(s2.key).segments
            (turn2,) = generated(t2)
            assert t2.tokens == (*prompt, *turn2)
            assert resp2.choices[0].message.content == shown(turn2)

    run(main())


# --- 2: a tool-calling conversation ---------------------------------------------------------
def test_a_tool_conversation_continues_the_recorded_tokens() -> None:
    async def main() -> None:
        async with rig() as r:
            _, s = r.open()
            r.engine.script = [CALL]
            async with aclient(s) as oa:
                first = await oa.chat.completions.create(model="m", messages=[USER], tools=[LOOKUP])
                msg = first.choices[0].message
                assert first.choices[0].finish_reason == "tool_calls"
                assert msg.content is None
                (call,) = msg.tool_calls
                assert call.type == "function" and call.id.startswith("call_")
                assert call.function.name == "lookup"
                assert json.loads(call.function.arguments) == {"person": "Eve"}
                tool_msg = {"role": "tool", "tool_call_id": call.id, "content": "407"}
                history = [USER, msg.model_dump(), tool_msg]  # what user code typically sends
                second = await oa.chat.completions.create(
                    model="m", messages=history, tools=[LOOKUP]
                )
            record = r.endpoint.close_session(s.key)
            assert record.mismatches == 0 and record.requests == 2 and record.errors == 0
            (t,) = record.segments
            turn1, turn2 = generated(t)
            assert turn1 == tuple(CALL)
            prompt = CHAT.prompt([USER], [LOOKUP])
            follow = CHAT.followup([{"role": "tool", "content": "407"}])
            assert t.tokens == (*prompt, *turn1, *follow, *turn2)  # nothing re-tokenised
            assert [x.role for x in t.turns] == ["prompt", "assistant", "tool", "assistant"]
            mask = (0,) * len(prompt) + (1,) * len(turn1) + (0,) * len(follow) + (1,) * len(turn2)
            assert t.loss_mask == mask
            assert r.engine.requests[-1].prompt_tokens == (*prompt, *turn1, *follow)
            assert second.choices[0].message.content == shown(turn2)
            assert t.turns[1].meta["tool_calls"] == 1 and t.stats()["tool_calls"] >= 1

    run(main())


# --- 3: drift splits ------------------------------------------------------------------------
def test_an_edited_history_is_a_mismatch_and_splits_the_conversation() -> None:
    async def main() -> None:
        async with rig() as r:
            _, s = r.open("drift")
            r.engine.script = [ANSWER]
            async with aclient(s) as oa:
                first = await oa.chat.completions.create(model="m", messages=[USER])
                assert first.choices[0].message.content == "407"
                edited = [
                    {"role": "user", "content": "number of Fay?"},  # not what was answered
                    {"role": "assistant", "content": "407"},
                    {"role": "user", "content": "again"},
                ]
                await oa.chat.completions.create(model="m", messages=edited)
            record = r.endpoint.close_session(s.key)
            assert record.mismatches == 1 and record.splits == 1 and record.requests == 2
            one, two = record.segments
            assert one.ended == "split" and one.tokens == (*CHAT.prompt([USER]), *ANSWER)
            prompt = CHAT.prompt(edited)  # the whole request rendered afresh
            (turn,) = generated(two)
            assert two.tokens == (*prompt, *turn) and two.prompt_length == len(prompt)
            assert r.engine.requests[-1].request_id == "drift.s1.t0"

    run(main())


def test_a_continuation_after_a_cut_turn_or_a_foreign_assistant_turn_splits() -> None:
    async def main() -> None:
        async with rig() as r:
            _, s = r.open()
            r.engine.script = [TOK.encode("4071")]  # no stop token: cut at max_tokens=3
            async with aclient(s) as oa:
                cut = await oa.chat.completions.create(model="m", messages=[USER], max_tokens=3)
                assert cut.choices[0].finish_reason == "length"
                assert cut.usage.completion_tokens == 3
                assert r.engine.requests[-1].params.max_tokens == 3
                history = [USER, {"role": "assistant", "content": "407"}, USER]
                await oa.chat.completions.create(model="m", messages=history)
                assert r.endpoint.record(s.key).mismatches == 1
                # an assistant message the endpoint did not generate
                r.engine.script = [ANSWER]
                _, s2 = r.open("other")
                async with aclient(s2) as oa2:
                    await oa2.chat.completions.create(model="m", messages=[USER])
                    foreign = [USER, {"role": "assistant", "content": "407"},
                               {"role": "assistant", "content": "made up"}, USER]  # fmt: skip
                    await oa2.chat.completions.create(model="m", messages=foreign)
                assert r.endpoint.record(s2.key).mismatches == 1
            assert r.endpoint.record(s.key).segments[0].generated == 3

    run(main())


# --- 4: re-serialised arguments still match -------------------------------------------------
def test_reserialised_tool_calls_and_null_content_still_match() -> None:
    async def main() -> None:
        async with rig() as r:
            _, s = r.open()
            r.engine.script = [CALL, ANSWER]
            async with aclient(s) as oa:
                first = await oa.chat.completions.create(model="m", messages=[USER], tools=[LOOKUP])
                (call,) = first.choices[0].message.tool_calls
                args = json.loads(call.function.arguments)
                assistant = {
                    "role": "assistant",
                    "content": "",  # None == ""
                    "tool_calls": [
                        {
                            "id": "call_renamed_by_the_framework",
                            "type": "function",
                            "function": {
                                "name": "lookup",
                                "arguments": json.dumps(args, separators=(",", ":")),
                            },
                        }
                    ],
                    "refusal": None,  # extra keys are ignored
                }
                tool_msg = {"role": "tool", "tool_call_id": "x", "name": "lookup", "content": "407"}
                second = await oa.chat.completions.create(
                    model="m", messages=[USER, assistant, tool_msg], tools=[LOOKUP]
                )
                assert second.choices[0].message.content == "407"
                # a user reply continues the same segment too
                third_history = [USER, assistant, tool_msg, second.choices[0].message.model_dump(),
                                 {"role": "user", "content": "thanks"}]  # fmt: skip
                await oa.chat.completions.create(model="m", messages=third_history, tools=[LOOKUP])
            record = r.endpoint.close_session(s.key)
            assert record.mismatches == 0 and len(record.segments) == 1 and record.requests == 3
            (t,) = record.segments
            assert [x.role for x in t.turns] == [
                "prompt", "assistant", "tool", "assistant", "user", "assistant",
            ]  # fmt: skip
            thanks = CHAT.followup([{"role": "user", "content": "thanks"}])
            start = t.turns[4].start
            assert t.tokens[start : start + len(thanks)] == tuple(thanks)

    run(main())


# --- honoured fields --------------------------------------------------------------------------
def test_honoured_fields_do_what_they_say() -> None:
    async def main() -> None:
        async with rig() as r:
            # tool_choice="none": the tools are not rendered, a call block comes back as text
            _, s = r.open("none")
            r.engine.script = [CALL]
            async with aclient(s) as oa:
                resp = await oa.chat.completions.create(
                    model="m", messages=[USER], tools=[LOOKUP], tool_choice="none", max_tokens=99
                )
            msg = resp.choices[0].message
            assert msg.tool_calls is None and msg.content == CALL_TEXT
            assert resp.choices[0].finish_reason == "stop"
            assert r.engine.requests[-1].prompt_tokens == tuple(CHAT.prompt([USER]))
            assert r.engine.requests[-1].params.max_tokens == 12  # never above the session's

            # two calls in one turn (parallel_tool_calls=True), a seed, the session's own
            # temperature / top_p, a lower cap, developer role, text parts, unknown keys
            _, s = r.open("many", sampling=replace(SAMPLING, max_tokens=40))
            r.engine.script = [[*TOK.encode(CALL_TEXT + CALL_TEXT.replace("Eve", "Ann")), STOP]]
            messages: list[Any] = [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "number of "},
                                             {"type": "text", "text": "Eve?"}]},
            ]  # fmt: skip
            async with aclient(s) as oa:
                resp = await oa.chat.completions.create(
                    model="m", messages=messages, tools=[LOOKUP], parallel_tool_calls=True,
                    seed=7, temperature=1.0, top_p=1.0, max_completion_tokens=30,
                    user="someone", metadata={"k": "v"}, extra_body={"top_k": -1, "x": 1},
                )  # fmt: skip
            calls = resp.choices[0].message.tool_calls
            assert [json.loads(c.function.arguments)["person"] for c in calls] == ["Eve", "Ann"]
            assert len({c.id for c in calls}) == 2
            sent = r.engine.requests[-1]
            assert sent.params.seed == 7 and sent.params.max_tokens == 30  # the lower cap
            rendered = [{"role": "system", "content": "be brief"}, USER]
            assert sent.prompt_tokens == tuple(CHAT.prompt(rendered, [LOOKUP]))
            client = r.endpoint.record(s.key)
            assert client.last is not None and len(client.last.tool_calls) == 2

            # a malformed call block: returned as the text the model wrote, and counted
            _, s = r.open("bad")
            bad = "<tool_call>{x}</tool_call>"
            r.engine.script = [[*TOK.encode(bad), STOP]]
            async with aclient(s) as oa:
                resp = await oa.chat.completions.create(model="m", messages=[USER], tools=[LOOKUP])
            assert resp.choices[0].message.content == bad
            assert resp.choices[0].message.tool_calls is None
            record = r.endpoint.close_session(s.key)
            assert record.malformed == 1 and record.final is not None
            assert record.segments[0].stats()["tool_errors"] == 1

    run(main())


# --- 5: refusals ----------------------------------------------------------------------------
REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"n": 2}, "n=2"),
    ({"stop": ["x"]}, "stop"),
    ({"tool_choice": "required", "tools": [LOOKUP]}, "tool_choice"),
    ({"parallel_tool_calls": False, "tools": [LOOKUP]}, "parallel_tool_calls"),
    ({"temperature": 0.5}, "temperature=1.0"),  # names the session's value
    ({"top_p": 0.9}, "top_p"),
    ({"top_logprobs": 2, "logprobs": True}, "top_logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
]


def test_refusals_raise_the_clients_errors_and_leave_the_record_unchanged() -> None:
    async def main() -> None:
        async with rig(max_body_bytes=4096) as r:
            _, s = r.open()
            token = s.api_key
            bodies: list[str] = []
            async with aclient(s) as oa:
                await oa.chat.completions.create(model="m", messages=[USER])  # some state
                before = r.endpoint.record(s.key)
                for i, (extra, needle) in enumerate(REFUSED):
                    with pytest.raises(openai.BadRequestError) as info:
                        await oa.chat.completions.create(model="m", messages=[USER], **extra)
                    assert needle in info.value.message, info.value.message
                    assert info.value.param is not None
                    bodies.append(info.value.response.text)
                    now = r.endpoint.record(s.key)
                    assert state(now) == state(before) and now.errors == before.errors + i + 1
                errors = r.endpoint.record(s.key).errors
                # 413: a body above max_body_bytes
                with pytest.raises(openai.APIStatusError) as big:
                    await oa.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "x" * 8000}]
                    )
                assert big.value.status_code == 413 and "max_body_bytes" in big.value.message
                bodies.append(big.value.response.text)
            # 401: a wrong token
            async with openai.AsyncOpenAI(base_url=s.base_url, api_key="sk-" + "0" * 40) as bad:
                with pytest.raises(openai.AuthenticationError) as auth:
                    await bad.chat.completions.create(model="m", messages=[USER])
                bodies.append(auth.value.response.text)
                with pytest.raises(openai.AuthenticationError):
                    await bad.models.list()
            # 404: an unknown session key
            ghost = replace(s, base_url=s.base_url.replace(s.key, "0" * 16))
            async with aclient(ghost) as oa:
                with pytest.raises(openai.NotFoundError) as missing:
                    await oa.chat.completions.create(model="m", messages=[USER])
                bodies.append(missing.value.response.text)
            # 400: invalid JSON, without an openai client
            headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
            async with aiohttp.ClientSession() as http:
                url = f"{s.base_url}/chat/completions"
                async with http.post(url, data=b"{not json", headers=headers) as resp:
                    assert resp.status == 400
                    body = await resp.json()
                    assert set(body["error"]) == {"message", "type", "param", "code"}
                    assert "not JSON" in body["error"]["message"]
                    bodies.append(json.dumps(body))
                async with http.post(url, json={"model": "m"}, headers=headers) as resp:
                    assert resp.status == 400  # messages are required
                    assert "messages" in (await resp.json())["error"]["message"]
            after = r.endpoint.record(s.key)
            assert state(after) == state(before) and after.errors == errors + 3
            for body in bodies:
                assert json.loads(body)["error"]["message"]
                assert token not in body

    run(main())


def test_a_concurrent_request_is_a_conflict_and_is_not_retried() -> None:
    async def main() -> None:
        async with rig() as r:
            _, s = r.open()
            r.engine.gate = asyncio.Event()
            r.engine.script = [ANSWER]
            async with aclient(s) as oa:  # default retries: a 409 must not be retried
                first = asyncio.ensure_future(
                    oa.chat.completions.create(model="m", messages=[USER])
                )
                await r.engine.arrived.wait()  # the first request is generating
                held = r.endpoint.record(s.key)
                with pytest.raises(openai.ConflictError, match="one request at a time"):
                    await oa.chat.completions.create(model="m", messages=[USER])
                assert state(r.endpoint.record(s.key)) == state(held)
                assert len(r.engine.requests) == 1
                r.engine.gate.set()
                assert (await first).choices[0].message.content == "407"
            record = r.endpoint.close_session(s.key)
            assert record.requests == 1 and record.errors == 1 and len(record.segments) == 1

    run(main())


def test_a_turn_past_the_limits_is_context_length_exceeded_and_the_record_is_kept() -> None:
    async def main() -> None:
        async with rig() as r:
            _, s = r.open(limits=TrajectoryLimits(max_turns=1))
            r.engine.script = [ANSWER]
            async with aclient(s) as oa:
                await oa.chat.completions.create(model="m", messages=[USER])
                again = [USER, {"role": "assistant", "content": "407"}, USER]
                with pytest.raises(openai.BadRequestError) as info:
                    await oa.chat.completions.create(model="m", messages=again)
            assert info.value.code == "context_length_exceeded"
            assert "max_turns" in info.value.message
            (t,) = r.endpoint.close_session(s.key).segments
            assert t.ended == "max_turns" and generated(t) == [tuple(ANSWER)]

    run(main())


def test_a_failed_turn_is_a_500_not_retried_by_the_client_and_a_resend_retries_it() -> None:
    async def main() -> None:
        async with rig() as r:
            _, s = r.open()
            r.engine.fail_next = True
            r.engine.script = [ANSWER]
            async with aclient(s) as oa:  # default retries: x-should-retry: false stops them
                with pytest.raises(openai.InternalServerError, match="scripted engine failed"):
                    await oa.chat.completions.create(model="m", messages=[USER])
                assert len(r.engine.requests) == 1
                resp = await oa.chat.completions.create(model="m", messages=[USER])  # resend
            assert resp.choices[0].message.content == "407"
            record = r.endpoint.close_session(s.key)
            assert record.mismatches == 0 and record.errors == 1 and record.requests == 1
            assert "EngineError" in (record.last_error or "")
            (t,) = record.segments  # the prompt once, then the turn: the resend retried it
            assert t.tokens == (*CHAT.prompt([USER]), *ANSWER)

    run(main())


# --- 6: streaming ---------------------------------------------------------------------------
def test_streaming_yields_the_same_turn_as_a_plain_request() -> None:
    async def main() -> None:
        async with rig() as r:
            _, plain = r.open("same")
            _, streamed = r.open("same")  # same id and seed: the same sampled tokens
            async with aclient(plain) as oa:
                want = await oa.chat.completions.create(model="m", messages=[USER])
            async with aclient(streamed) as oa:
                stream = await oa.chat.completions.create(
                    model="m", messages=[USER], stream=True, stream_options={"include_usage": True}
                )
                chunks = [c async for c in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices]
            assert text == want.choices[0].message.content
            assert finish[-1] == want.choices[0].finish_reason
            assert chunks[-1].usage is not None and chunks[-1].usage == want.usage
            a = r.endpoint.record(plain.key).segments[0]
            b = r.endpoint.record(streamed.key).segments[0]
            assert a.tokens == b.tokens

            # a streamed tool call
            _, s = r.open("tools")
            r.engine.script = [CALL]
            async with aclient(s) as oa:
                stream = await oa.chat.completions.create(
                    model="m", messages=[USER], tools=[LOOKUP], stream=True
                )
                chunks = [c async for c in stream]
            calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
            assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
                ("lookup", {"person": "Eve"})
            ]
            assert chunks[-1].choices[0].finish_reason == "tool_calls"

    run(main())


# --- 7: LangGraph over ChatOpenAI -----------------------------------------------------------
@pytest.mark.parametrize("streaming", [False, True])
def test_a_langgraph_agent_over_chatopenai_is_recorded_exactly(streaming: bool) -> None:
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition
    from pydantic import SecretStr

    book = {"Eve": "407"}

    @tool
    def lookup(person: str) -> str:
        """Look up a person's phone number."""
        return book[person]

    async def main() -> None:
        async with rig() as r:
            _, s = r.open()
            # ChatOpenAI's defaults: it sends model, messages, tools and stream (no sampling
            # knobs), so the session's sampling applies
            llm = ChatOpenAI(
                base_url=s.base_url,
                api_key=SecretStr(s.api_key),
                model="policy",
                streaming=streaming,
            ).bind_tools([lookup])

            async def model(state: MessagesState) -> dict[str, Any]:
                return {"messages": [await llm.ainvoke(state["messages"])]}

            graph = StateGraph(MessagesState)
            graph.add_node("model", model)
            graph.add_node("tools", ToolNode([lookup]))
            graph.add_edge(START, "model")
            graph.add_conditional_edges("model", tools_condition)
            graph.add_edge("tools", "model")
            r.engine.script = [CALL]  # turn 1: the call; turn 2: the real engine
            start = MessagesState(messages=[HumanMessage(content=USER["content"])])
            out = await graph.compile().ainvoke(start)
            kinds = [type(m).__name__ for m in out["messages"]]
            assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"]
            assert out["messages"][1].tool_calls[0]["args"] == {"person": "Eve"}
            record = r.endpoint.close_session(s.key)
            assert record.requests == 2 and record.mismatches == 0 and record.errors == 0
            (t,) = record.segments
            turn1, turn2 = generated(t)
            prompt = CHAT.prompt([USER], [LOOKUP])
            follow = CHAT.followup([{"role": "tool", "content": "407"}])
            assert t.tokens == (*prompt, *turn1, *follow, *turn2)
            assert out["messages"][3].content == shown(turn2)
            assert sum(t.loss_mask) == len(turn1) + len(turn2)

    run(main())


# --- 8: EndpointLoop trains an openai-client agent under RLJob -------------------------------
TASK = LookupTask(digits=3)
TOOLS = [LOOKUP]


async def openai_agent(sample: Mapping[str, Any], session: Session) -> None:
    """Plain openai-client agent code: call the model, run its tool calls, send them back."""
    async with aclient(session) as client:
        messages: list[Any] = list(sample["messages"])
        for _ in range(4):
            resp = await client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS
            )
            msg = resp.choices[0].message
            if not msg.tool_calls:
                return
            messages.append(msg.model_dump(exclude_none=True))
            for call in msg.tool_calls:
                person = json.loads(call.function.arguments).get("person")
                answer = sample["book"].get(person, f"error: no person named {person!r}")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})


class Capture:
    """An AgentLoop around another, keeping the trajectories it returns."""

    def __init__(self, inner: EndpointLoop) -> None:
        self.inner = inner
        self.trajectories: list[Trajectory] = []

    async def run(self, sample: Mapping[str, Any], client: GenerationClient) -> Trajectory:
        t = await self.inner.run(sample, client)
        self.trajectories.append(t)
        return t


def test_endpoint_loop_trains_an_openai_agent_under_rljob() -> None:
    async def main() -> None:
        engine = TorchInferenceEngine(MODEL, max_batch=8, seed=0, threads=1)
        trainer = TorchTrainEngine(MODEL, threads=1)
        endpoint = ChatEndpoint(CHAT)
        await endpoint.start()
        try:
            loop = EndpointLoop(endpoint, openai_agent, reward=TASK.reward)
            capture = Capture(loop)
            config = RLConfig(
                steps=2,
                prompts_per_step=2,
                n=2,
                sampling=SamplingParams(max_tokens=8, stop_token_ids=CHAT.stop_token_ids),
            )
            job = RLJob(config, RLEngines([engine], trainer), TASK.samples(seed=1), agent=capture)
            result = await job.run()
        finally:
            await endpoint.close()
            await engine.close()
            await trainer.close()
        assert len(result.steps) == 2 and trainer.weight_version == 2
        assert result.samples == 8
        assert loop.metrics["sessions"] >= 8 and loop.metrics["requests"] >= 8
        assert loop.metrics["agent_errors"] == 0
        for t in capture.trajectories:
            t.validate()  # loss_mask is 1 exactly on the assistant turns
            assert t.reward is not None and 0.0 <= t.reward <= 1.0
            meta = t.turns[-1].meta["endpoint"]
            assert meta["requests"] >= 1 and meta["agent_error"] is None
            first = t.assistant_turns()[0]
            prompt = t.tokens[: first.start]
            assert CHAT.decode(prompt).startswith("<|im_start|>system\ntools: lookup")
            assert all(t.loss_mask[i] == 1 for i in range(first.start, first.end))
            assert t.generated == sum(x.end - x.start for x in t.assistant_turns())

    run(main())


# --- EndpointLoop edge cases ----------------------------------------------------------------
def test_endpoint_loop_keeps_an_agent_errors_record_and_refuses_an_agent_that_never_asked() -> None:
    def crashing(sample: Mapping[str, Any], session: Session) -> None:  # sync: in a thread
        with openai.OpenAI(base_url=session.base_url, api_key=session.api_key) as client:
            client.chat.completions.create(model="m", messages=sample["messages"])
        raise RuntimeError("the framework fell over")

    async def silent(sample: Mapping[str, Any], session: Session) -> None:
        return None

    seen: list[Any] = []

    def reward(sample: Mapping[str, Any], final: Any, t: Trajectory) -> float:
        seen.append(final)
        return 0.25

    async def main() -> None:
        async with rig() as r:
            r.engine.script = [ANSWER]
            loop = EndpointLoop(r.endpoint, crashing, reward=reward)
            t = await loop.run({"messages": [USER]}, r.client("crash"))
            assert t.ended == "agent_error" and t.reward == 0.25
            assert t.tokens == (*CHAT.prompt([USER]), *ANSWER)
            assert "fell over" in t.turns[-1].meta["endpoint"]["agent_error"]
            assert seen[0].content == "407"  # the last turn was an answer
            assert loop.metrics["agent_errors"] == 1 and loop.metrics["requests"] == 1
            quiet = EndpointLoop(r.endpoint, silent)
            with pytest.raises(
                BadRequestError, match=r"made no chat-completion request that was answered.*Eve"
            ):
                await quiet.run({"messages": [USER]}, r.client("silent"))
            assert repr(r.endpoint).endswith("sessions=0)")  # both sessions were closed

    run(main())


# --- 9: security ----------------------------------------------------------------------------
def test_loopback_only_and_the_token_never_shows(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)

    async def main() -> None:
        async with rig() as r:
            _, s = r.open()
            token = s.api_key
            assert len(token) >= 32
            assert r.endpoint.url.startswith("http://127.0.0.1:")
            assert r.endpoint.addresses and all(h == "127.0.0.1" for h, _ in r.endpoint.addresses)
            assert token not in repr(r.endpoint) and token not in repr(s)
            async with aclient(s) as oa:
                await oa.chat.completions.create(model="m", messages=[USER])
                with pytest.raises(openai.BadRequestError) as info:
                    await oa.chat.completions.create(model="m", messages=[USER], n=3)
                assert token not in info.value.response.text
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{r.endpoint.url}/v1/models") as resp:
                    assert resp.status == 401 and token not in await resp.text()
                bearer = {"Authorization": f"Bearer {token}"}
                async with http.get(f"{r.endpoint.url}/nowhere", headers=bearer) as resp:
                    assert resp.status == 404 and token not in await resp.text()
            with pytest.raises(BadRequestError):
                r.endpoint.close_session("nope")
            record = r.endpoint.close_session(s.key)
            assert token not in repr(record)

    run(main())
    assert caplog.records  # something was logged at DEBUG (the refusals)
    assert all(token_free(rec.getMessage()) for rec in caplog.records)


_TOKENS: list[str] = []


def token_free(text: str) -> bool:
    return not any(t in text for t in _TOKENS)


@pytest.fixture(autouse=True)
def _remember_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run token a test's endpoints hand out, for the log check above."""
    opened = ChatEndpoint.open

    def spy(self: ChatEndpoint, client: GenerationClient) -> Session:
        session = opened(self, client)
        _TOKENS.append(session.api_key)
        return session

    monkeypatch.setattr(ChatEndpoint, "open", spy)


def test_bad_endpoint_settings_are_named_without_echoing_the_token() -> None:
    from asyncflow_core.contracts.errors import ConfigError

    secret = "short-secret"
    with pytest.raises(ConfigError, match="at least 16") as info:
        ChatEndpoint(CHAT, token=secret)
    assert secret not in str(info.value)
    with pytest.raises(ConfigError, match="port"):
        ChatEndpoint(CHAT, port=70000)
    with pytest.raises(ConfigError, match="ChatFormat"):
        ChatEndpoint(object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="not started"):
        ChatEndpoint(CHAT).url  # noqa: B018


# --- 10: fuzzed request bodies and model output ---------------------------------------------
FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([10**400, -(10**400), 2**63]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=10),
)
_json = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
_depths = st.one_of(st.integers(95, 105), st.integers(0, 1500), st.sampled_from([990, 100_000]))


@st.composite
def _deep(draw: st.DrawFn) -> str:
    """JSON text nested ``depth`` levels: arrays or objects, closed or left open."""
    depth = draw(_depths)
    opener, leaf, closer = draw(st.sampled_from([("[", "1", "]"), ('{"a": ', "{}", "}")]))
    return opener * depth + (leaf + closer * depth if draw(st.booleans()) else "")


_function = st.fixed_dictionaries(
    {"name": st.sampled_from(["lookup", ""]) | _json},
    optional={"arguments": st.text(max_size=20) | _deep() | _json.map(json.dumps) | _json},
)
_call = st.fixed_dictionaries(
    {"type": st.just("function") | _json, "function": _function | _json}, optional={"id": _json}
)
_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot"])
        | _json
    },
    optional={
        "content": st.text(alphabet="abc ?", max_size=12) | _json,
        "tool_calls": st.lists(_call, max_size=2) | _json,
        "tool_call_id": _json,
    },
)
_fields = {
    name: _json
    for name in (
        "model", "tools", "tool_choice", "parallel_tool_calls", "n", "stop", "temperature",
        "top_p", "top_k", "seed", "max_tokens", "max_completion_tokens", "stream",
        "stream_options", "logprobs", "top_logprobs", "response_format", "logit_bias",
        "frequency_penalty", "modalities", "audio", "functions",
    )
}  # fmt: skip
_request = st.fixed_dictionaries(
    {"messages": st.lists(_message, min_size=1, max_size=3) | _json}, optional=_fields
)


@st.composite
def _bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["bytes", "text", "json", "deep", "deep_inside", "request"]))
    event(f"body: {kind}")
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "text":
        return draw(st.text(max_size=200)).encode()
    if kind == "json":
        return json.dumps(draw(_json)).encode()
    if kind == "deep":
        return draw(_deep()).encode()
    if kind == "deep_inside":  # a deep value where a string or an object belongs
        deep = draw(_deep())
        where = draw(st.sampled_from(["content", "arguments", "arguments_string", "tools"]))
        if where == "arguments_string":
            return json.dumps(_with_call_arguments(deep)).encode()
        if where == "content":
            body = {"messages": [{"role": "user", "content": "@"}]}
        elif where == "arguments":
            body = _with_call_arguments("@")
        else:
            tool = {"type": "function", "function": {"name": "f", "parameters": "@"}}
            body = {"messages": [USER], "tools": [tool]}
        return json.dumps(body).replace('"@"', deep).encode()
    return json.dumps(draw(_request)).encode()


def _with_call_arguments(arguments: str) -> dict[str, Any]:
    call = {"type": "function", "function": {"name": "lookup", "arguments": arguments}}
    return {"messages": [USER, {"role": "assistant", "tool_calls": [call]}, USER]}


def _is_openai_error(text: str) -> bool:
    error = json.loads(text)["error"]
    return set(error) == {"message", "type", "param", "code"} and bool(error["message"])


def test_fuzzed_bodies_are_answered_or_refused_and_a_refusal_changes_no_record() -> None:
    """Arbitrary bytes and text, JSON of every type, bodies nested up to 100000 levels (whole,
    or inside a message, a call's arguments, its arguments string, a tool schema) and requests
    whose fields have arbitrary JSON values: each is answered (one more request recorded) or
    refused with a 4xx OpenAI error object, never a 500, and a refusal leaves the record as it
    was (``errors`` counts it). Hypothesis runs in a worker thread; the endpoint on the loop."""
    statuses: Counter[int] = Counter()

    async def main() -> None:
        async with rig() as r:
            loop = asyncio.get_running_loop()
            _, s = r.open("fuzz", limits=TrajectoryLimits(max_turns=1000, max_total_tokens=1 << 20))
            headers = {"Authorization": f"Bearer {s.api_key}", "Content-Type": "application/json"}
            url = f"{s.base_url}/chat/completions"
            async with aiohttp.ClientSession() as http:

                async def post(body: bytes) -> tuple[int, str, SessionRecord, SessionRecord]:
                    before = r.endpoint.record(s.key)
                    r.engine.script = [ANSWER]  # an accepted request is answered at once
                    async with http.post(url, data=body, headers=headers) as resp:
                        status, text = resp.status, await resp.text()
                    return status, text, before, r.endpoint.record(s.key)

                @FUZZ
                @given(body=_bodies())
                @example(body=b"[" * 100_000)
                @example(body=json.dumps({"messages": [USER], "temperature": 10**400}).encode())
                def fuzz(body: bytes) -> None:
                    future = asyncio.run_coroutine_threadsafe(post(body), loop)
                    status, text, before, after = future.result(SAFETY_S)
                    statuses[status] += 1
                    event(f"status {status}")
                    if status == 200:
                        assert after.requests == before.requests + 1
                        assert json.loads(text)["choices"][0]["message"]["content"] == "407"
                        return
                    assert 400 <= status < 500, text
                    assert _is_openai_error(text), text
                    assert state(after) == state(before) and after.errors == before.errors + 1

                await asyncio.to_thread(fuzz)

    asyncio.run(asyncio.wait_for(main(), 240))  # a safety net only
    assert statuses[400] > 0 and set(statuses) <= {200, 400}, statuses


_ascii = st.text(alphabet=[c for c in TOK.pieces if len(c) == 1], max_size=20)


@st.composite
def _model_turn(draw: st.DrawFn) -> str:
    """A turn the model writes (printable ASCII, what ``TOK`` encodes): text around Hermes
    blocks holding text, JSON of any type, calls with wrong types, deep nesting."""
    parts = [draw(_ascii)]
    for _ in range(draw(st.integers(0, 2))):
        kind = draw(st.sampled_from(["text", "json", "call", "deep"]))
        event(f"block: {kind}")
        if kind == "text":
            inner = draw(_ascii)
        elif kind == "json":
            inner = json.dumps(draw(_json))
        elif kind == "call":
            args = draw(st.fixed_dictionaries({"person": _ascii}) | _json | _deep())
            inner = json.dumps({"name": draw(st.just("lookup") | _json), "arguments": args})
        else:
            depth = draw(st.integers(0, 300) | st.just(1200))
            inner = '{"name": "lookup", "arguments": ' + '{"a": ' * depth + "1" + "}" * depth + "}"
        parts += ["<tool_call>", inner, "</tool_call>", draw(_ascii)]
    parts.append(draw(st.sampled_from(["", "<tool_call>", "</tool_call>"])))
    return "".join(parts)


def test_fuzzed_model_turns_are_answered_and_malformed_calls_counted() -> None:
    """Whatever the model writes (printable text with Hermes blocks of arbitrary text, JSON
    of any type, calls with wrong types, arguments nested up to 1200 levels) is answered with
    HTTP 200: well-formed calls as ``tool_calls`` (arguments JSON), a turn with a malformed
    block as its raw text, counted in the session's ``malformed``."""
    sampling = replace(SAMPLING, max_tokens=1 << 15)
    limits = TrajectoryLimits(max_total_tokens=1 << 16)

    async def main() -> None:
        async with rig() as r:
            loop = asyncio.get_running_loop()
            async with aiohttp.ClientSession() as http:

                async def turn(ids: list[int]) -> tuple[int, Any, SessionRecord, tuple[int, ...]]:
                    _, s = r.open("model", sampling=sampling, limits=limits)
                    r.engine.script = [ids]
                    headers = {"Authorization": f"Bearer {s.api_key}"}
                    url = f"{s.base_url}/chat/completions"
                    async with http.post(url, json={"messages": [USER]}, headers=headers) as resp:
                        status, body = resp.status, await resp.json()
                    return (
                        status,
                        body,
                        r.endpoint.close_session(s.key),
                        r.engine.results[-1].tokens,
                    )

                @FUZZ
                @given(text=_model_turn())
                def fuzz(text: str) -> None:
                    ids = [*TOK.encode(text), STOP]
                    future = asyncio.run_coroutine_threadsafe(turn(ids), loop)
                    status, body, record, tokens = future.result(SAFETY_S)
                    assert status == 200, body
                    assert tokens == tuple(ids)  # the whole turn, not cut
                    parsed = CHAT.parse(ids)
                    message = body["choices"][0]["message"]
                    assert record.requests == 1 and record.errors == 0
                    assert record.malformed == int(bool(parsed.malformed))
                    calls = message.get("tool_calls") or []
                    event(f"tool calls {len(calls)}, malformed {record.malformed}")
                    if parsed.malformed or not parsed.tool_calls:
                        assert calls == [] and message["content"] == shown(ids[:-1])
                    else:
                        assert [c["function"]["name"] for c in calls] == [
                            c.name for c in parsed.tool_calls
                        ]
                        assert all(
                            isinstance(json.loads(c["function"]["arguments"]), dict) for c in calls
                        )

                await asyncio.to_thread(fuzz)

    asyncio.run(asyncio.wait_for(main(), 240))  # a safety net only
