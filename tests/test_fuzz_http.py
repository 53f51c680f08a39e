"""Fuzzing the engine adapters' HTTP answers (Hypothesis) through the replay servers.

The replay servers (``replay_vllm_server.py``: vLLM 0.33 and 0.26 shapes;
``replay_sglang_server.py``) answer one route of each example with a drawn status and body: a
genuine answer of that route cut short, or with a value swapped for another type, a key
dropped or added; JSON of any shape; non-JSON text; nesting deeper than a parser recurses;
HTTP errors. The adapter's call must return or raise ``EngineError``
(``asyncflow_core.contracts.errors``); and whatever it did, the engine keeps its weight version, its
paused and asleep state, and serves the next clean request. Each engine lives for the whole
test on one event loop (examples are cheap).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from asyncflow_reference.engines import TorchInferenceEngine
from asyncflow_reference.model import ModelConfig
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from asyncflow_core.contracts.errors import EngineError
from asyncflow_core.contracts.protocols import GenerationRequest, SamplingParams

pytest.importorskip("aiohttp", reason="the [vllm-client] / [sglang-client] extra is missing")

from asyncflow_sglang.http import SGLangHTTPEngine
from asyncflow_vllm.http import VLLMHTTPEngine
from replay_sglang_server import ReplayServer
from replay_vllm_server import ReplayVLLMServer

FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
MODEL = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_seq_len=32)
CALL_TIMEOUT_S = 20.0  # a bound, not a wait: every call here answers in milliseconds


def req(rid: str) -> GenerationRequest:
    return GenerationRequest(rid, (1, 2, 3), SamplingParams(max_tokens=4))


# --- each engine on a loop of its own, for the whole module ---------------------------------
class Rig:
    """A replay server and a connected adapter on one event loop; ``run(coro)`` runs on it."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.loop = asyncio.new_event_loop()
        self.server: Any = None
        self.engine: Any = None
        self.url = ""
        self.count = 0
        self.outcomes: Counter[str] = Counter()
        self.run(self._start())

    def run(self, coro: Awaitable[Any]) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, CALL_TIMEOUT_S))

    async def _start(self) -> None:
        inference = TorchInferenceEngine(MODEL, max_batch=8, seed=0, threads=1)
        if self.kind == "sglang":
            self.server = ReplayServer(inference)
        else:
            self.server = ReplayVLLMServer(inference, vllm_version=self.kind)
        self.url = await self.server.start()
        self.engine = self.fresh()
        await self.engine.connect()

    def fresh(self) -> Any:
        if self.kind == "sglang":
            return SGLangHTTPEngine(self.url, weight_backend="gloo")
        return VLLMHTTPEngine(self.url)

    def inject(self, path: str, status: int, body: str) -> None:
        if self.kind == "sglang":
            self.server.fault(path, status=status, body=body, times=1)
        else:
            self.server.fail(path, status=status, body=body, times=1)

    def clear(self) -> None:
        self.server.faults.clear()

    def state(self) -> tuple[Any, ...]:
        e = self.engine
        return (e.weight_version, e.paused, getattr(e, "asleep", getattr(e, "_asleep", None)))

    def rid(self) -> str:
        self.count += 1
        return f"r{self.count}"

    def close(self) -> None:
        async def stop() -> None:
            await self.engine.close()
            await self.server.close()

        self.run(stop())
        self.loop.close()


@pytest.fixture(scope="module", params=["0.33.0", "0.26.0", "sglang"])
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    made = Rig(request.param)
    yield made
    made.close()


# --- the calls: (the route the fault answers, the adapter call) -------------------------------
Call = Callable[[Rig], Awaitable[Any]]


async def _generate(r: Rig) -> Any:
    return await r.engine.generate(req(r.rid()))


async def _connect(r: Rig) -> Any:
    engine = r.fresh()
    try:
        await engine.connect()
    finally:
        await engine.close()


async def _pause_resume(r: Rig) -> Any:
    try:
        await r.engine.pause("abort")
    finally:
        if r.engine.paused:
            await r.engine.resume()


async def _sleep_wake(r: Rig) -> Any:
    try:
        await r.engine.sleep(1)
    finally:
        await r.engine.wake_up()


async def _bump_version(r: Rig) -> Any:
    return await r.engine.load_weights([], r.engine.weight_version + 1)


VLLM_CALLS: dict[str, tuple[list[str], Call]] = {
    "generate": (["/inference/v1/generate"], _generate),
    "connect": (["/version", "/weight_info", "/get_world_size"], _connect),
    "is_sleeping": (["/is_sleeping"], lambda r: r.engine.is_sleeping()),
    "is_paused": (["/is_paused"], lambda r: r.engine.is_paused()),
    "reset_prefix_cache": (["/reset_prefix_cache"], lambda r: r.engine.reset_prefix_cache()),
    "pause": (["/pause", "/resume"], _pause_resume),
    "sleep": (["/sleep", "/wake_up"], _sleep_wake),
    "version": (["/update_weight_version"], _bump_version),
}
SGLANG_CALLS: dict[str, tuple[list[str], Call]] = {
    "generate": (["/generate"], _generate),
    "connect": (["/server_info", "/model_info"], _connect),
    "model_info": (["/model_info"], lambda r: r.engine.model_info()),
    "flush_cache": (["/flush_cache"], lambda r: r.engine.flush_cache()),
    "pause": (["/pause_generation", "/continue_generation"], _pause_resume),
    "version": (["/update_weight_version"], _bump_version),
}


UNDO_ROUTES = {"/resume", "/wake_up", "/continue_generation"}


async def _undo(r: Rig) -> None:
    """Resume and wake the server and the adapter (the fault kept the server from seeing the
    undo, which the adapter, answered 200, may have taken as done)."""
    await r.engine.resume()
    if r.kind != "sglang":
        await r.engine.wake_up()


def calls_of(r: Rig) -> dict[str, tuple[list[str], Call]]:
    return SGLANG_CALLS if r.kind == "sglang" else VLLM_CALLS


# --- the bodies ------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=8,
)  # fmt: skip
replacements = st.one_of(
    st.sampled_from([None, -1, 2**64, 1e308, "x", "", [], {}, True, "NaN", [None]]),
    json_values,
)


@st.composite
def mutated(draw: st.DrawFn, genuine: Any) -> Any:
    """``genuine`` with one value somewhere replaced, or one key dropped or added."""

    def paths(node: Any, at: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
        yield at
        if isinstance(node, dict):
            for k, v in node.items():
                yield from paths(v, (*at, k))
        elif isinstance(node, list):
            for i, v in enumerate(node[:4]):
                yield from paths(v, (*at, i))

    doc = json.loads(json.dumps(genuine))
    where = draw(st.sampled_from(list(paths(doc, ()))))
    how = draw(st.sampled_from(["replace", "drop", "add"]))
    if not where:
        return draw(replacements)
    parent = doc
    for step in where[:-1]:
        parent = parent[step]
    last = where[-1]
    if how == "drop" and isinstance(parent, dict):
        del parent[last]
    elif how == "add" and isinstance(parent, dict):
        parent[draw(st.text(max_size=4))] = draw(replacements)
    else:
        parent[last] = draw(replacements)
    return doc


def bodies(genuine: Any) -> st.SearchStrategy[str]:
    text = json.dumps(genuine)
    return st.one_of(
        st.integers(0, max(0, len(text) - 1)).map(lambda n: text[:n]),  # truncated
        mutated(genuine).map(json.dumps),
        mutated(genuine).map(json.dumps),
        json_values.map(json.dumps),
        st.text(max_size=40),
        st.sampled_from(["[" * 100_000, '{"a":' * 50_000, "NaN", "Infinity", '{"detail": 1}',
                         '{"error": {"message": {"x": 1}}}', "\x00\xff", "null", ""]),
    )  # fmt: skip


statuses = st.sampled_from([200, 200, 200, 201, 204, 400, 404, 409, 422, 500, 503])


# the answers the replay servers give, as the adapters read them (from their sources' docs)
GENUINE: dict[tuple[str, str], Any] = {}


def _record_genuine(r: Rig) -> None:
    """Fill ``GENUINE`` with each route's real answer, read straight from the server."""

    async def fetch(method: str, path: str, body: Any) -> Any:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            kwargs: dict[str, Any] = {} if body is None else {"json": body}
            async with session.request(method, r.url + path, **kwargs) as response:
                text = await response.text()
        return json.loads(text) if text.strip() else None

    gen_path = "/generate" if r.kind == "sglang" else "/inference/v1/generate"
    gen_body = (
        {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}, "return_logprob": True,
         "rid": "genuine", "stream": False}
        if r.kind == "sglang"
        else {"request_id": "genuine", "token_ids": [1, 2, 3], "stream": False,
              "sampling_params": {"n": 1, "max_tokens": 3, "logprobs": 0, "detokenize": False}}
    )  # fmt: skip
    GENUINE[(r.kind, gen_path)] = r.run(fetch("POST", gen_path, gen_body))
    for path in ("/version", "/weight_info", "/get_world_size", "/is_sleeping", "/is_paused",
                 "/server_info", "/model_info"):  # fmt: skip
        with contextlib.suppress(ValueError, OSError):
            GENUINE[(r.kind, path)] = r.run(fetch("GET", path, None))


def test_fuzz_answers(rig: Rig) -> None:
    """Every call of the adapter against every kind of bad answer on each of its routes."""
    _record_genuine(rig)
    calls = calls_of(rig)
    routes = [(name, path) for name, (paths, _) in calls.items() for path in paths]

    @FUZZ
    @given(data=st.data(), which=st.sampled_from(routes), status=statuses)
    def one(data: st.DataObject, which: tuple[str, str], status: int) -> None:
        name, path = which
        genuine = GENUINE.get((rig.kind, path), {"success": True, "status": "ok"})
        body = data.draw(bodies(genuine), label="body")
        call = calls[name][1]
        before = rig.state()
        rig.inject(path, status, body)
        accepted = False
        try:
            rig.run(call(rig))
            accepted = True
        except EngineError as exc:
            event(f"refused: {type(exc).__name__}")
            rig.outcomes["refused"] += 1
        finally:
            rig.clear()
        if accepted:
            event("accepted")
            rig.outcomes["accepted"] += 1
        if path in UNDO_ROUTES:  # the undo half failed: the engine is truthfully still paused
            rig.run(_undo(rig))  # or asleep; a clean undo must bring it back
        after = rig.state()
        if name == "version" and accepted:  # the one call that moves the version
            after = (after[0] - 1, *after[1:])
        assert after == before, f"{name}: the engine's state changed"
        result = rig.run(rig.engine.generate(req(rig.rid())))  # still serves
        assert len(result.tokens) > 0

    one()
    # not blind: bad answers were refused, and some answers (an extra key, a 201) accepted
    assert rig.outcomes["refused"] > 0 and rig.outcomes["accepted"] > 0, rig.outcomes


@pytest.mark.parametrize("kind", ["0.33.0", "sglang"])
def test_answers_the_fuzz_let_through(kind: str) -> None:
    """Token ids outside [0, 2**63), weight versions beyond int64 and SGLang ``output_ids``
    that are not ids were accepted (or a ValueError); each is a malformed answer now."""
    rig = Rig(kind)
    try:
        _record_genuine(rig)
        path = "/generate" if kind == "sglang" else "/inference/v1/generate"
        genuine = GENUINE[(kind, path)]

        def spoilt(token: int | None = None, version: str | None = None, ids: Any = None) -> str:
            doc = json.loads(json.dumps(genuine))
            if kind == "sglang":
                meta = doc["meta_info"]
                if token is not None:
                    meta["output_token_logprobs"][0][1] = token
                    doc["output_ids"][0] = token
                if version is not None:
                    meta["weight_versions"] = [{"version": version, "start": 0, "end": 3}]
                if ids is not None:
                    doc["output_ids"] = ids
            else:
                choice = doc["choices"][0]
                if token is not None:
                    choice["token_ids"][0] = token
                    choice["logprobs"]["content"][0]["token_id"] = token
                if version is not None:
                    choice["weight_versions"] = [{"version": version, "start": 0, "end": 3}]
            return json.dumps(doc)

        cases = [spoilt(token=-1), spoilt(token=2**70), spoilt(version=str(10**23))]
        if kind == "sglang":
            cases += [spoilt(ids="xyz"), spoilt(ids=[16.0, 24, 2]), spoilt(ids=5)]
        for body in cases:
            rig.inject(path, 200, body)
            with pytest.raises(EngineError, match="malformed"):
                rig.run(rig.engine.generate(req(rig.rid())))
            rig.clear()
        assert rig.engine.weight_version == 0
    finally:
        rig.close()
