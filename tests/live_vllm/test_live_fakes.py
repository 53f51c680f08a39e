"""Our fakes checked against the engine: one request script, run through the adapters against
the replay server (``tests/replay_vllm_server.py``, set up like the live server: vLLM 0.32 on a
CPU) and the live ``vllm serve``, and against the fake ``AsyncLLM``
(``tests/test_vllm_engine.py``) and the live in-process ``AsyncLLM``; and raw requests whose
status codes the replay must answer as vLLM does. What each observation records is structural
(finish reasons, lengths, version labels, outcomes, error kinds, status codes), since the fakes
generate with another model. Differences found this way were fixed in the fakes; what stays
different on purpose is listed in ``KNOWN_DIFFERENCES`` (and docs/vllm.md)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import live
import pytest
import torch

from asyncflow_core.contracts.errors import AsyncFlowError
from asyncflow_core.contracts.protocols import GenerationRequest, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the fakes

LONG = 1500
"""A long request's cap: seconds on the live engines, so an abort catches it generating."""

ABORT_ATTEMPTS: list[Any] = []
"""Each script's abort attempts, printed with the observations."""

KNOWN_DIFFERENCES: dict[str, str] = {}
"""Observation -> why the fake answers otherwise, on purpose."""


def req(rid: str, max_tokens: int = 6, **params: Any) -> GenerationRequest:
    return GenerationRequest(rid, (4, 5, 6, 7), SamplingParams(max_tokens=max_tokens, **params))


async def script(engine: Any, long_tokens: int = LONG) -> dict[str, Any]:
    """The request script, through an adapter; returns what it saw (``long_tokens``: the cap
    of the requests it aborts)."""
    seen: dict[str, Any] = {}
    await engine.load_weights((), 3)
    greedy = await engine.generate(req("f-greedy", temperature=0.0))
    seen["greedy"] = (
        greedy.finish_reason, len(greedy.tokens), len(greedy.logprobs),
        sorted(set(greedy.versions)), all(lp <= 0 for lp in greedy.logprobs),
    )  # fmt: skip
    stop = greedy.tokens[2]
    first = greedy.tokens.index(stop)
    stopped = await engine.generate(req("f-stop", temperature=0.0, stop_token_ids=(stop,)))
    seen["stop"] = (stopped.finish_reason, stopped.tokens == greedy.tokens[: first + 1])
    resumed = await engine.generate(
        dataclasses.replace(
            req("f-resume", temperature=0.0),
            resume_tokens=greedy.tokens[:2],
            resume_logprobs=greedy.logprobs[:2],
            resume_versions=greedy.versions[:2],
        )
    )
    seen["resume"] = (
        resumed.finish_reason, len(resumed.tokens), resumed.tokens[:2] == greedy.tokens[:2],
        resumed.logprobs[:2] == greedy.logprobs[:2],
    )  # fmt: skip
    a = await engine.generate(req("f-seed-a", seed=11))
    b = await engine.generate(req("f-seed-b", seed=11))
    seen["seeded"] = a.tokens == b.tokens
    await engine.abort(["f-unknown"])
    seen["abort_unknown"] = "no-op"
    # a long request aborted right after it is submitted ends "abort"; the abort can still
    # reach a busy server after the request finished (vLLM's API server shares the 2 cores),
    # so, as the conformance law does, up to three attempts
    outcomes = []
    for attempt in range(3):
        rid = f"f-long-{attempt}"
        t0 = time.perf_counter()
        long = asyncio.ensure_future(engine.generate(req(rid, max_tokens=long_tokens)))
        await asyncio.sleep(0)  # in flight
        await engine.abort([rid])
        aborted_s = time.perf_counter() - t0
        result = await long
        outcomes.append(
            (result.finish_reason, len(result.tokens), round(aborted_s, 3),
             round(time.perf_counter() - t0, 3))
        )  # fmt: skip
        if result.finish_reason == "abort":
            break
    ABORT_ATTEMPTS.append(outcomes)  # (finish, tokens, abort returned at s, ended at s)
    seen["abort"] = any(o[0] == "abort" for o in outcomes)
    outcomes = []
    for attempt in range(3):
        long = asyncio.ensure_future(
            engine.generate(req(f"f-paused-{attempt}", max_tokens=long_tokens))
        )
        await asyncio.sleep(0)
        await engine.pause("abort")
        done = long.done()  # pause("abort") returns once the requests in flight ended
        outcomes.append(long.result().finish_reason if done else "still running")
        if outcomes[-1] != "abort":
            await engine.resume()
            if not done:
                await long
            continue
        break
    seen["pause_abort"] = outcomes[-1]
    waiting = asyncio.ensure_future(engine.generate(req("f-after")))
    await asyncio.sleep(0)
    seen["waits_while_paused"] = not waiting.done()
    await engine.resume()
    after = await waiting
    seen["after_resume"] = (after.finish_reason, len(after.tokens))
    await engine.load_weights((), 9)
    labelled = await engine.generate(req("f-label"))
    seen["label"] = (engine.weight_version, sorted(set(labelled.versions)))
    try:
        await engine.load_weights([("no.such.weight", torch.zeros(2))], 10)
        seen["bad_load"] = "accepted"
    except AsyncFlowError as exc:
        seen["bad_load"] = (type(exc).__name__, engine.weight_version)
    try:
        await engine.sleep()
        seen["sleep"] = "slept"
    except AsyncFlowError as exc:
        seen["sleep"] = type(exc).__name__
    seen["unavailable"] = sorted(engine.unavailable_abilities)
    return seen


RAW = [
    ("POST", "/inference/v1/generate", {"request_id": "r", "sampling_params": {"max_tokens": 2}}),
    ("POST", "/inference/v1/generate", {"request_id": "r", "token_ids": [], "sampling_params": {}}),
    ("POST", "/inference/v1/generate",
     {"request_id": "r", "token_ids": [4, 5], "sampling_params": {"max_tokens": 0}}),
    ("POST", "/inference/v1/generate",
     {"request_id": "r", "token_ids": [4, 5], "sampling_params": {"max_tokens": 2, "bogus": 1}}),
    ("POST", "/pause?mode=bogus", None),
    ("POST", "/abort_requests", [1]),
    ("POST", "/collective_rpc", {}),
    ("POST", "/update_weight_version", {}),
    ("GET", "/no_such_route", None),
]  # fmt: skip
"""Requests the server refuses (or, for the unknown sampling key, does not): (method, path,
JSON body)."""


async def raw_statuses(base_url: str) -> list[tuple[str, int, str | None]]:
    import aiohttp

    out = []
    async with aiohttp.ClientSession() as session:
        for method, path, body in RAW:
            kw = {} if body is None else {"json": body}
            async with session.request(method, base_url + path, **kw) as answer:
                try:
                    data = json.loads(await answer.text() or "null")
                except ValueError:  # a plain-text answer (aiohttp's own 404)
                    data = None
                kind = data.get("error", {}).get("type") if isinstance(data, dict) else None
                out.append((f"{method} {path}", answer.status, kind))
            await session.post(base_url + "/resume")  # if anything paused it
    return out


def compare(fake: dict[str, Any], real: dict[str, Any]) -> list[str]:
    return [
        f"{key}: fake {fake.get(key)!r}, vLLM {real.get(key)!r}"
        for key in sorted(set(fake) | set(real))
        if fake.get(key) != real.get(key) and key not in KNOWN_DIFFERENCES
    ]


def test_the_replay_server_answers_as_vllm_serve_does() -> None:
    from asyncflow_reference.engines import TorchInferenceEngine
    from asyncflow_reference.model import ModelConfig
    from asyncflow_vllm import VLLMHTTPEngine
    from replay_vllm_server import ReplayVLLMServer

    async def main() -> tuple[Any, Any, Any, Any]:
        model = ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, max_seq_len=512)
        replay = ReplayVLLMServer(TorchInferenceEngine(model, max_batch=8, seed=0),
                                  vllm_version="0.32.0")  # fmt: skip
        replay.device, replay.sleep_mode, replay.weight_transfer = "cpu", False, None
        url = await replay.start()
        fake_engine = VLLMHTTPEngine(url, ignore_eos=True)
        real_engine = VLLMHTTPEngine(live.server("qwen2").url, ignore_eos=True)
        try:
            fake = await script(fake_engine, 400)
            real = await script(real_engine)
            return fake, real, await raw_statuses(url), await raw_statuses(real_engine.base_url)
        finally:
            await fake_engine.close()
            await live.reset(real_engine)
            await replay.close()

    fake, real, fake_raw, real_raw = asyncio.run(main())
    print(f"replay: {fake}\nvLLM:   {real}\nraw replay: {fake_raw}\nraw vLLM:   {real_raw}")
    print(f"abort attempts (replay, vLLM): {ABORT_ATTEMPTS[-2:]}")
    assert compare(fake, real) == []
    assert fake_raw == real_raw


def test_the_fake_async_llm_answers_as_async_llm_does() -> None:
    from test_vllm_engine import FakeAsyncLLM032, make_adapter

    host = live.host("llama")
    real = host.run(script(host.engine), timeout_s=600)

    async def fake_run() -> dict[str, Any]:
        adapter = make_adapter(FakeAsyncLLM032, ignore_eos=True)
        adapter.facts = dataclasses.replace(adapter.facts, device="cpu")  # as the live one
        try:
            return await script(adapter, 400)
        finally:
            await adapter.close()
            await adapter.engine.ref.close()

    fake = asyncio.run(fake_run())
    print(f"fake AsyncLLM: {fake}\nAsyncLLM:      {real}")
    print(f"abort attempts (fake, AsyncLLM): {ABORT_ATTEMPTS[-2:]}")
    assert compare(fake, real) == []


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
