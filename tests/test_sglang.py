"""The SGLang adapter (asyncflow_sglang) against a replay server (tests/replay_sglang_server.py:
SGLang's documented routes and JSON shapes, backed by the reference PyTorch engine — not
SGLang): the request bodies of every adapter method, the InferenceEngine conformance suite, a
collective weight sync into two replay servers in their own processes over SGLang's group
construction, and the error paths. ``SGLangEngine`` (in-process ``sglang.Engine``) is
contract-tested on a documented fake shaped like ``sglang.Engine``. A live test runs the
conformance suite against a real server when ``ASYNCFLOW_SGLANG_URL`` is set.

Log-probs: the replay answers them as SGLang 0.5.23 does (before top-k/top-p in
``output_token_logprobs``; renormalised over the support only in
``output_token_sampling_logprobs``, for ``return_sampling_mask``), so the tests here show that
the adapter converts them to the protocol's and refuses what SGLang cannot report."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import safetensors.torch
import torch
from asyncflow_conformance import InferenceEngineConformance
from asyncflow_conformance.engines import LOGPROB_SETTINGS, padded_batch
from asyncflow_reference.engines import TorchInferenceEngine, TorchTrainEngine
from asyncflow_reference.model import TransformerLM
from asyncflow_sglang import (
    TESTED,
    SGLangEngine,
    SGLangHTTPEngine,
    SGLangWeightSync,
    check_sglang_version,
)
from replay_sglang_server import (
    MODEL,
    ReplayServer,
    SGLangSampling,
    digest,
    sampling_mask_refusal,
    sglang_logprob_meta,
)

from asyncflow_core.contracts.errors import (
    ConfigError,
    EngineError,
    EngineUnavailableError,
    MissingExtraError,
    WeightSyncError,
)
from asyncflow_core.contracts.protocols import (
    GenerationRequest,
    InferenceEngine,
    SamplingParams,
    SupportsLoadWeights,
    SupportsPause,
    SupportsSleep,
    WeightBucket,
)
from asyncflow_core.engines.process import free_port
from asyncflow_core.sync.transports import GroupReceiver
from asyncflow_core.training.sampling import sampled_logprobs, sampling_columns

HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def reference_engine(seed: int = 0) -> TorchInferenceEngine:
    return TorchInferenceEngine(MODEL, max_batch=8, seed=seed, threads=1)


Body = Callable[[ReplayServer, SGLangHTTPEngine], Awaitable[None]]


def run(body: Body, *, server_kw: dict[str, Any] | None = None, **engine_kw: Any) -> None:
    """``body(server, engine)`` on a fresh replay server and adapter, bounded."""

    async def main() -> None:
        server = ReplayServer(reference_engine(), **(server_kw or {}))
        url = await server.start()
        engine = SGLangHTTPEngine(url, weight_backend="gloo", **engine_kw)
        try:
            await body(server, engine)
        finally:
            await engine.close()
            await server.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def req(rid: str, max_tokens: int = 6, **kw: Any) -> GenerationRequest:
    resume = kw.pop("resume", ())
    params = SamplingParams(max_tokens=max_tokens, **kw)
    return GenerationRequest(
        rid,
        (1, 2, 3, 4),
        params,
        resume_tokens=tuple(t for t, _, _ in resume),
        resume_logprobs=tuple(lp for _, lp, _ in resume),
        resume_versions=tuple(v for _, _, v in resume),
    )


# --------------------------------------------------------------------------------------------
# (a) contract: what each method sends, what it reads
# --------------------------------------------------------------------------------------------
def test_the_engine_implements_the_protocols() -> None:
    engine = SGLangHTTPEngine("http://127.0.0.1:1")
    for proto in (InferenceEngine, SupportsPause, SupportsSleep, SupportsLoadWeights):
        assert isinstance(engine, proto), proto
    assert isinstance(engine, GroupReceiver)


def test_generate_sends_the_documented_body_and_reads_the_answer() -> None:
    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        r = req("g1", 6, temperature=0.7, seed=5, stop_token_ids=(15,))
        result = await engine.generate(r)
        (sent,) = server.bodies("/generate")
        assert sent == {
            "input_ids": [1, 2, 3, 4],
            "sampling_params": {
                "max_new_tokens": 6,
                "temperature": 0.7,
                "top_p": 1.0,
                "top_k": -1,  # SGLang's "off" (0 is refused by SamplingParams.verify)
                "sampling_seed": 5,
                "stop_token_ids": [15],
            },
            "return_logprob": True,
            "rid": "g1",
            "stream": False,
        }
        direct = await reference_engine().generate(r)  # same weights, same seed
        assert result.tokens == direct.tokens and result.finish_reason == direct.finish_reason
        assert result.logprobs == pytest.approx(direct.logprobs, abs=1e-6)
        assert set(result.versions) == {0}
        # top_k > 0 passes through and asks for the after-filter log-probs; a resumed
        # request sends prompt + prefix, cap reduced
        prefix = ((5, -0.5, 0), (6, -0.25, 0))
        resumed = await engine.generate(req("g2", 5, top_k=3, resume=prefix))
        sent2 = server.bodies("/generate")[-1]
        assert sent2["input_ids"] == [1, 2, 3, 4, 5, 6]
        assert sent2["sampling_params"]["max_new_tokens"] == 3
        # unseeded: a deterministic server (the replay's default) would seed it 42, so the
        # adapter sends a seed of its own
        assert sent2["sampling_params"]["top_k"] == 3
        assert isinstance(sent2["sampling_params"]["sampling_seed"], int)
        assert sent2["return_sampling_mask"] is True
        assert sent2["sampling_logprobs_mode"] == "selected"
        assert resumed.tokens[:2] == (5, 6) and resumed.logprobs[:2] == (-0.5, -0.25)
        assert len(resumed.tokens) <= 5
        # a prefix that already fills the cap is answered without a call
        n = len(server.bodies("/generate"))
        full = await engine.generate(req("g3", 2, resume=prefix))
        assert full.tokens == (5, 6) and full.finish_reason == "length"
        assert len(server.bodies("/generate")) == n

    run(body)


def test_connect_reads_server_version_ranks_and_weight_version() -> None:
    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        server.label = "7"
        assert engine.weight_group_ranks == 1  # before connect(): assumed, checked at join
        await engine.connect()
        assert engine.server_version == "0.5.23"
        assert engine.weight_version == 7
        assert engine.weight_group_ranks == 2  # tp_size
        assert [p for p, _ in server.requests] == ["/server_info", "/model_info"]
        info = await engine.model_info()
        assert info["weight_version"] == "7"

    run(body, server_kw={"tp_size": 2})

    async def counted_early(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        assert engine.weight_group_ranks == 1  # a sync built before connect() counts 1
        with pytest.raises(EngineError, match="tp_size=2"):
            await engine.join_weight_group("127.0.0.1", 1, 1, 2)
        assert server.bodies("/init_weights_update_group") == []

    run(counted_early, server_kw={"tp_size": 2})


def test_an_explicit_rank_count_is_used_as_given() -> None:
    assert SGLangHTTPEngine("http://127.0.0.1:1", weight_group_ranks=4).weight_group_ranks == 4


def test_pause_resume_sleep_send_the_documented_bodies() -> None:
    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        await engine.pause("keep")
        assert engine.paused and server.engine.paused
        await engine.resume()
        await engine.pause("abort")
        await engine.resume()
        assert server.bodies("/pause_generation") == [{"mode": "retract"}, {"mode": "abort"}]
        assert server.bodies("/continue_generation") == [{}, {}]
        await engine.sleep(1)
        await engine.sleep(1)  # already asleep: nothing sent
        await engine.wake_up()
        await engine.sleep(2)
        await engine.wake_up()
        assert server.memory_tags == [
            ("release", ["kv_cache"]),
            ("resume", ["kv_cache"]),
            ("release", ["kv_cache", "weights"]),
            ("resume", ["kv_cache", "weights"]),
        ]
        with pytest.raises(EngineError, match="level"):
            await engine.sleep(3)
        with pytest.raises(EngineError, match="mode"):
            await engine.pause("wait")  # type: ignore[arg-type]

    run(body)
    run(
        lambda s, e: _pause_in_place(s, e),
        keep_mode="in_place",
    )


async def _pause_in_place(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
    await engine.pause("keep")
    await engine.resume()
    assert server.bodies("/pause_generation") == [{"mode": "in_place"}]


def test_abort_sends_the_rid_and_returns_the_prefix() -> None:
    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        task = asyncio.ensure_future(engine.generate(req("long", 400, seed=1)))
        while not server.engine.running:
            await asyncio.sleep(0.01)
        await server.engine.wait_for_tokens("long", 3)
        await engine.abort(["long", "unknown"])
        result = await asyncio.wait_for(task, 5)
        assert result.finish_reason == "abort" and 3 <= len(result.tokens) < 400
        assert {"rid": "long", "abort_all": False} in server.bodies("/abort_request")
        assert all(b["rid"] != "unknown" for b in server.bodies("/abort_request"))
        with pytest.raises(EngineError, match="sequence"):
            await engine.abort("long")

    run(body)


def test_version_loads_and_tensors_are_refused() -> None:
    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        await engine.load_weights([], 3)
        assert server.bodies("/update_weight_version") == [
            {"new_version": "3", "abort_all_requests": False}
        ]
        assert engine.weight_version == 3
        result = await engine.generate(req("after", 4))
        assert set(result.versions) == {3}
        with pytest.raises(EngineError, match="SGLangWeightSync"):
            await engine.load_weights([("embed.weight", torch.zeros(2))], 4)
        with pytest.raises(EngineError, match="version"):
            await engine.load_weights([], -1)
        assert engine.weight_version == 3

    run(body)


def test_update_from_disk_flush_cache_and_model_info(tmp_path: Path) -> None:
    state = {n: t + 0.5 for n, t in reference_engine(seed=1).model.state_dict().items()}
    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file(state, str(path))

    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        await engine.update_weights_from_disk(str(path), 5)
        assert server.bodies("/update_weights_from_disk") == [
            {"model_path": str(path), "abort_all_requests": False, "flush_cache": True,
             "weight_version": "5"}
        ]  # fmt: skip
        assert engine.weight_version == 5
        for n, t in server.engine.model.state_dict().items():
            assert torch.equal(t, state[n]), n
        with pytest.raises(EngineError, match="Failed to update weights"):
            await engine.update_weights_from_disk(str(tmp_path / "missing"), 6)
        assert engine.weight_version == 5
        await engine.flush_cache()  # a 200 with a text body
        task = asyncio.ensure_future(engine.generate(req("busy", 400)))
        while not server.engine.running:
            await asyncio.sleep(0.01)
        with pytest.raises(EngineError, match="400"):
            await engine.flush_cache()
        await engine.abort(["busy"])
        await task

    run(body)


def test_group_receiver_methods_send_the_documented_bodies() -> None:
    """Bodies only (answers injected so nothing joins); the real join is the sync test."""

    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        ok = '{"success": true, "message": "ok"}'
        for path in (
            "/init_weights_update_group",
            "/update_weights_from_distributed",
            "/destroy_weights_update_group",
        ):
            server.fault(path, status=200, body=ok)
        await engine.join_weight_group("10.0.0.1", 29500, 3, 5)
        await engine.begin_weight_update()
        await engine.receive_weights(["a", "b"], ["float32", "bfloat16"], [[2, 3], [4]])
        await engine.commit_weights(9)
        await engine.leave_weight_group()
        assert server.bodies("/init_weights_update_group") == [
            {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 3,
             "world_size": 5, "group_name": "weight_update_group", "backend": "gloo"}
        ]  # fmt: skip
        assert server.bodies("/update_weights_from_distributed") == [
            {"names": ["a", "b"], "dtypes": ["float32", "bfloat16"], "shapes": [[2, 3], [4]],
             "group_name": "weight_update_group", "flush_cache": True,
             "abort_all_requests": False, "load_format": "flattened_bucket"}
        ]  # fmt: skip
        assert server.bodies("/update_weight_version")[-1] == {
            "new_version": "9",
            "abort_all_requests": False,
        }
        assert server.bodies("/destroy_weights_update_group") == [
            {"group_name": "weight_update_group"}
        ]
        assert server.bodies("/begin_weight_update") == [{"selector": "all"}]
        assert server.bodies("/end_weight_update") == [{}]
        paths = [p for p, _ in server.requests if "weight" in p]
        assert paths == [
            "/init_weights_update_group", "/begin_weight_update",
            "/update_weights_from_distributed", "/end_weight_update",
            "/update_weight_version", "/destroy_weights_update_group",
        ]  # fmt: skip
        assert engine.weight_version == 9
        # SGLang's failure answer: HTTP 400 {"success": false, "message": ...}
        server.fault(
            "/init_weights_update_group",
            status=400,
            body='{"success": false, "message": "Failed to initialize custom process group"}',
        )
        with pytest.raises(EngineError, match="Failed to initialize"):
            await engine.join_weight_group("10.0.0.1", 29500, 1, 2)
        server.fault("/update_weights_from_distributed", status=200, body='{"success": false}')
        with pytest.raises(EngineError, match="did not succeed"):
            await engine.receive_weights(["a"], ["float32"], [[1]])

    run(body)


# --------------------------------------------------------------------------------------------
# (b) the InferenceEngine laws through the adapter
# --------------------------------------------------------------------------------------------
class TestSGLangHTTPAgainstReplayServer(InferenceEngineConformance):
    """SGLangHTTPEngine -> replay server (SGLang's routes over the reference engine)."""

    vocab_size = MODEL.vocab_size
    context_window = MODEL.max_seq_len
    long_max_tokens = 400
    timeout_s = 30.0
    real_timeout_s = 60.0
    # LOGPROB_SETTINGS' top_k=1 and top_k=3 + top_p=0.9 (which the adapter refuses: the law
    # skips it with the adapter's message), and top-k alone at another temperature
    logprob_settings = (
        *LOGPROB_SETTINGS,
        ("t0.8-top_k=3", SamplingParams(max_tokens=1, temperature=0.8, top_k=3)),
    )
    _servers: ClassVar[dict[int, ReplayServer]] = {}

    async def make_engine(self) -> SGLangHTTPEngine:
        server = ReplayServer(reference_engine())
        url = await server.start()
        engine = await SGLangHTTPEngine.connect_to(url, weight_backend="gloo")
        self._servers[id(engine)] = server
        return engine

    async def close_engine(self, engine: Any) -> None:
        await engine.close()
        await self._servers.pop(id(engine)).close()


# --------------------------------------------------------------------------------------------
# (b2) log-probs: SGLang's two quantities, converted to the protocol's, or refused
# --------------------------------------------------------------------------------------------
def logits_after(model: TransformerLM, prompt: Any, tokens: Any) -> torch.Tensor:
    """``[len(tokens), V]``: the logits that predicted each token (teacher forcing)."""
    seq = torch.tensor([[*prompt, *tokens[:-1]]], dtype=torch.long)
    with torch.no_grad():
        out: torch.Tensor = model(seq)[0, len(prompt) - 1 :]
    return out


def protocol_logprobs(model: TransformerLM, r: GenerationRequest, tokens: Any) -> list[float]:
    """The protocol's log-probs of ``tokens`` (asyncflow_core.training.sampling), from the model."""
    p = r.params
    lp, off = sampled_logprobs(
        logits_after(model, r.prompt_tokens, tokens),
        torch.tensor(list(tokens)),
        torch.tensor(float(p.temperature)),
        torch.tensor(int(p.top_k)),
        torch.tensor(float(p.top_p)),
    )
    assert not bool(off.any())
    return [float(x) for x in lp]


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(0.8, 3, 1.0), (1.3, 5, 1.0), (0.5, 2, 1.0), (1.0, 1, 1.0), (0.9, 1, 0.5)],
)
def test_top_k_reports_the_log_probs_after_the_filter(
    temperature: float, top_k: int, top_p: float
) -> None:
    """top_k (alone, or 1 with any top_p): the adapter asks for return_sampling_mask and
    reports output_token_sampling_logprobs: the protocol's log-probs, which the reference
    engine reports for the same draw and the trainer recomputes from the sampling fields."""

    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        r = req("k", 12, temperature=temperature, top_k=top_k, top_p=top_p, seed=11)
        result = await engine.generate(r)
        (sent,) = server.bodies("/generate")
        assert sent["return_sampling_mask"] is True
        assert sent["sampling_logprobs_mode"] == "selected"
        n = len(result.tokens)
        assert n >= 1
        want = protocol_logprobs(server.engine.model, r, result.tokens)
        assert list(result.logprobs) == pytest.approx(want, abs=1e-5)
        direct = await reference_engine().generate(r)  # same weights, same seed
        assert result.tokens == direct.tokens
        assert list(result.logprobs) == pytest.approx(list(direct.logprobs), abs=1e-5)
        if top_k == 1:
            assert set(result.logprobs) == {0.0}  # one token left: probability 1
        trainer = TorchTrainEngine(MODEL, seed=0, threads=1)  # the replay's weights
        try:
            batch = padded_batch([r.prompt_tokens], [result.tokens], [0.0])
            batch.data.update(sampling_columns([r.params]))
            lp = await trainer.compute_logprobs(batch)
        finally:
            await trainer.close()
        assert lp[0, :n].tolist() == pytest.approx(list(result.logprobs), abs=1e-5)

    run(body)


def test_before_filter_log_probs_are_not_the_protocols() -> None:
    """Why the adapter converts: under top_k SGLang's output_token_logprobs (emulated by the
    replay: after temperature, before the filter) are not the protocol's, while its
    output_token_sampling_logprobs are. An adapter reporting the former fails the law."""

    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        import aiohttp

        r = req("raw", 8, temperature=0.8, top_k=3, seed=4)
        sent = {
            "input_ids": list(r.prompt_tokens),
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.8, "top_k": 3,
                                "top_p": 1.0, "sampling_seed": 4},
            "return_logprob": True, "return_sampling_mask": True, "rid": "raw",
        }  # fmt: skip
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{server.url}/generate", json=sent) as response,
        ):
            assert response.status == 200
            meta = (await response.json())["meta_info"]
        tokens = [t for _, t, _ in meta["output_token_logprobs"]]
        before = [lp for lp, _, _ in meta["output_token_logprobs"]]
        after = meta["output_token_sampling_logprobs"]
        assert len(after) == len(tokens) == meta["output_token_sampling_mask_length"] == 8
        assert all(len(m) == 3 and t in m for m, t in zip(meta["output_token_sampling_mask"],
                                                           tokens, strict=True))  # fmt: skip
        logits = logits_after(server.engine.model, r.prompt_tokens, tokens)
        full = torch.log_softmax(logits / 0.8, dim=-1)
        assert before == pytest.approx(
            full.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist(), abs=1e-5
        )
        protocol = protocol_logprobs(server.engine.model, r, tokens)
        assert after == pytest.approx(protocol, abs=1e-5)
        # each before-filter value is lower by log(mass of the top 3): far beyond the law's
        # tolerance, and the reported probabilities of the top 3 do not sum to 1
        gaps = [a - b for a, b in zip(after, before, strict=True)]
        assert min(gaps) > 0.05

    run(body)

    with pytest.raises(AssertionError, match=r"top_k=1.*before the filters"):
        _BeforeFiltersSuite().test_logprobs_match_the_sampling_distribution(
            ("top_k=1", SamplingParams(max_tokens=1, temperature=1.0, top_k=1))
        )


class _BeforeFiltersEngine(SGLangHTTPEngine):
    """A WRONG adapter (for the test above): never asks for the sampling mask, so it reports
    SGLang's before-filter output_token_logprobs under top_k."""

    def _wants_sampling_mask(self, request: GenerationRequest) -> bool:
        return False


class _BeforeFiltersSuite(InferenceEngineConformance):
    """The conformance suite on ``_BeforeFiltersEngine`` (not collected: no ``Test``)."""

    vocab_size = MODEL.vocab_size
    context_window = MODEL.max_seq_len
    timeout_s = 30.0
    real_timeout_s = 60.0
    _servers: ClassVar[dict[int, ReplayServer]] = {}

    async def make_engine(self) -> SGLangHTTPEngine:
        server = ReplayServer(reference_engine())
        engine = _BeforeFiltersEngine(await server.start())
        self._servers[id(engine)] = server
        return engine

    async def close_engine(self, engine: Any) -> None:
        await engine.close()
        await self._servers.pop(id(engine)).close()


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"temperature": 0.8, "top_k": 3, "top_p": 0.9},
         r"SGLang.*top_k=3 and top_p=0\.9.*jointly.*use one filter"),
        ({"temperature": 1.0, "top_k": 2, "top_p": 0.5}, r"top_k=2 and top_p=0\.5"),
        ({"temperature": 1.0, "top_p": 0.9}, r"top_p=0\.9 and no top_k.*SGLang.*before top-p"),
        ({"temperature": 1e-8}, r"temperature=1e-08.*SGLang.*greedily.*temperature=0"),
    ],
)  # fmt: skip
def test_settings_sglang_cannot_report_are_refused_before_anything_is_sent(
    params: dict[str, Any], match: str
) -> None:
    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        with pytest.raises(EngineError, match=match):
            await engine.generate(req("no", 4, **params))
        assert server.requests == [] and not engine._inflight  # not even connected
        await engine.connect()
        with pytest.raises(EngineError, match=match):
            await engine.generate(req("no", 4, **params))
        assert server.bodies("/generate") == [] and not engine._inflight
        assert (await engine.generate(req("no", 4))).tokens  # the id is free, the engine fine

    run(body)


def test_the_body_asks_for_the_sampling_mask_only_when_needed() -> None:
    cases: list[tuple[dict[str, Any], bool]] = [
        ({}, False),  # temperature 1, no filter
        ({"temperature": 0.6}, False),
        ({"temperature": 1.7}, False),
        ({"temperature": 0.0}, False),  # greedy: temperature-1, unfiltered log-probs
        ({"temperature": 0.0, "top_k": 3, "top_p": 0.5}, False),  # greedy ignores the filters
        ({"temperature": 1.0, "top_k": 1}, True),
        ({"temperature": 0.8, "top_k": 3}, True),
        ({"temperature": 0.8, "top_k": 1, "top_p": 0.9}, True),
    ]

    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        for i, (params, mask) in enumerate(cases):
            r = req(f"b{i}", 4, seed=i, **params)
            result = await engine.generate(r)
            sent = server.bodies("/generate")[-1]
            assert ("return_sampling_mask" in sent) is mask, params
            assert ("sampling_logprobs_mode" in sent) is mask, params
            if mask:
                assert (sent["return_sampling_mask"], sent["sampling_logprobs_mode"]) == (
                    True,
                    "selected",
                )
            want = protocol_logprobs(server.engine.model, r, result.tokens)
            assert list(result.logprobs) == pytest.approx(want, abs=1e-5), params

    run(body)


def test_top_k_beyond_the_servers_mask_limit_is_refused() -> None:
    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        # not connected yet: the limit is learnt from /server_info, then the request refused
        # before /generate
        with pytest.raises(EngineError, match=r"top_k=3.*--sampling-mask-max-tokens=2"):
            await engine.generate(req("big", 4, top_k=3))
        assert [p for p, _ in server.requests] == ["/server_info", "/model_info"]
        assert not engine._inflight
        with pytest.raises(EngineError, match="sampling-mask-max-tokens=2"):
            await engine.generate(req("big", 4, top_k=3))  # connected: refused at once
        assert server.bodies("/generate") == []
        assert (await engine.generate(req("big", 4, top_k=2))).tokens

    run(body, server_kw={"sampling_mask_max_tokens": 2})

    async def default_limit(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        await engine.connect()
        with pytest.raises(EngineError, match="sampling-mask-max-tokens=4096"):
            await engine.generate(req("big", 4, top_k=4097))
        assert server.bodies("/generate") == []

    run(default_limit)

    async def ascend(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        await engine.connect()
        with pytest.raises(EngineError, match="ascend"):
            await engine.generate(req("npu", 4, top_k=3))
        assert server.bodies("/generate") == []
        assert (await engine.generate(req("npu", 4, temperature=0.7))).tokens

    run(ascend, server_kw={"sampling_backend": "ascend"})


def test_the_replay_refuses_the_sampling_mask_as_sglang_does() -> None:
    """The replay's emulation of SGLang's own checks (scheduler.py,
    Scheduler._handle_generate_request; tokenizer_manager.py, _validate_one_request)."""

    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        import aiohttp

        base: dict[str, Any] = {"input_ids": [1, 2, 3], "rid": "x", "return_logprob": True}
        cases: list[tuple[dict[str, Any], str]] = [
            ({"sampling_params": {"top_p": 0.9}, "return_sampling_mask": True},
             "requires top_k=1 for greedy sampling or finite 1 < top_k <= 4096; got "
             "top_k=1073741824"),
            ({"sampling_params": {"top_k": 5000}, "return_sampling_mask": True},
             "got top_k=5000"),
            ({"sampling_params": {"top_k": 3}, "sampling_logprobs_mode": "selected"},
             "sampling_logprobs_mode can only be set when return_sampling_mask=true"),
        ]  # fmt: skip
        async with aiohttp.ClientSession() as session:
            for extra, message in cases:
                async with session.post(f"{server.url}/generate", json=base | extra) as resp:
                    assert resp.status == 400
                    assert message in (await resp.json())["error"]["message"]
            # greedy: top_k becomes 1, which the mask admits; its log-prob is 0
            greedy = base | {
                "sampling_params": {"temperature": 0, "max_new_tokens": 3},
                "return_sampling_mask": True,
                "sampling_logprobs_mode": "support",
            }
            async with session.post(f"{server.url}/generate", json=greedy) as resp:
                meta = (await resp.json())["meta_info"]
            assert meta["output_token_sampling_logprobs"] == [[0.0]] * 3
            assert [m[0] for m in meta["output_token_sampling_mask"]] == [
                t for _, t, _ in meta["output_token_logprobs"]
            ]

    run(body)


class _FixedLogits:
    """A stand-in model whose next-token logits are ``log(probs)`` at every position."""

    def __init__(self, probs: list[float]) -> None:
        self.logits = torch.tensor(probs).log()

    def __call__(self, seq: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(seq.shape[0], seq.shape[1], -1)


@pytest.mark.parametrize(
    ("top_k", "top_p", "sglang", "protocol"),
    [
        (3, 0.75, math.log(0.4 / 0.9), math.log(0.4 / 0.7)),  # both: the supports differ
        (3, 1.0, math.log(0.4 / 0.9), math.log(0.4 / 0.9)),  # top-k alone: the same
        (-1, 0.75, math.log(0.4 / 0.9), math.log(0.4 / 0.9)),  # top-p alone: the same
    ],
)
def test_sglang_joint_top_p_differs_from_the_protocols(
    top_k: int, top_p: float, sglang: float, protocol: float
) -> None:
    """Why both filters are refused. probs [0.4, 0.3, 0.2, 0.1], top_k=3, top_p=0.75:
    SGLang keeps the top-3 tokens whose mass above them is <= 0.75, all three, mass 0.9; the
    protocol takes top-p of the renormalised top-3 distribution ([4, 3, 2] / 9), dropping the
    third (2/9 <= 0.25), mass 0.7. The replay computes SGLang's value; for one filter the two
    agree (and there the adapter reports SGLang's renormalised value)."""
    model: Any = _FixedLogits([0.4, 0.3, 0.2, 0.1])
    sampling = SGLangSampling.of({"temperature": 1.0, "top_k": top_k, "top_p": top_p})
    meta = sglang_logprob_meta(model, [1], [0], [0.0], sampling, sampling_mask=True)
    assert meta["output_token_sampling_logprobs"] == [pytest.approx(sglang, abs=1e-6)]
    ours, _ = sampled_logprobs(
        model.logits, torch.tensor(0), torch.tensor(1.0), torch.tensor(max(top_k, 0)),
        torch.tensor(top_p),
    )  # fmt: skip
    assert float(ours) == pytest.approx(protocol, abs=1e-6)
    if top_k > 0:  # SGLang serves it (its refusal is for top-p alone: no finite top_k)
        assert sampling_mask_refusal(sampling, max_tokens=4096) is None
    else:
        assert "finite 1 < top_k" in str(sampling_mask_refusal(sampling, max_tokens=4096))


def test_a_missing_sampling_logprob_is_a_malformed_response() -> None:
    ok = {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-1.0, 3, None]]}
    cases = [
        (ok, "output_token_sampling_logprobs is missing"),
        (ok | {"output_token_sampling_logprobs": [-0.5, -0.5]}, "2 entries for 1 output"),
        (ok | {"output_token_sampling_logprobs": [[-0.5]]}, "not a finite number"),
        (ok | {"output_token_sampling_logprobs": [None]}, "not a finite number"),
    ]

    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        await engine.connect()
        for meta, match in cases:
            server.fault("/generate", status=200, body=json.dumps({"meta_info": meta}))
            with pytest.raises(EngineError, match=match):
                await engine.generate(req("m", 4, top_k=3))
            assert not engine._inflight
        # the same answer without the field is fine where no mask was asked for
        server.fault("/generate", status=200, body=json.dumps({"meta_info": ok}))
        assert (await engine.generate(req("m", 4))).logprobs == (-1.0,)
        # and an abort before any token may come without it
        aborted = {"finish_reason": {"type": "abort"}}
        server.fault("/generate", status=200, body=json.dumps({"meta_info": aborted}))
        result = await engine.generate(req("m", 4, top_k=3))
        assert result.finish_reason == "abort" and result.tokens == ()
        server.fault(
            "/generate",
            status=200,
            body=json.dumps({"meta_info": ok | {"output_token_sampling_logprobs": [-0.25]}}),
        )
        assert (await engine.generate(req("m", 4, top_k=3))).logprobs == (-0.25,)

    run(body)


# --------------------------------------------------------------------------------------------
# (c) a collective sync into two replay servers, each in its own process
# --------------------------------------------------------------------------------------------
@dataclass
class _Proc:
    proc: subprocess.Popen[str]
    url: str = ""
    log: list[str] = field(default_factory=list)


def _spawn_replay(seed: int) -> _Proc:
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), str(HERE.parent / "adapters"), env.get("PYTHONPATH", "")]
    )
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "replay_sglang_server.py"), "--port", str(port),
         "--seed", str(seed)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    return _Proc(proc)


def _wait_ready(p: _Proc, deadline: float) -> None:
    assert p.proc.stdout is not None
    while time.monotonic() < deadline:
        line = p.proc.stdout.readline()
        if not line:
            raise AssertionError(f"replay server exited: {''.join(p.log)}")
        p.log.append(line)
        if line.startswith("READY "):
            p.url = line.split()[1]
            return
    raise AssertionError(f"replay server not ready: {''.join(p.log)}")


@pytest.fixture
def two_replay_servers() -> Iterator[list[str]]:
    procs = [_spawn_replay(seed) for seed in (1, 2)]
    try:
        deadline = time.monotonic() + 60
        for p in procs:
            _wait_ready(p, deadline)
        yield [p.url for p in procs]
    finally:
        for p in procs:
            p.proc.terminate()
        for p in procs:
            try:
                p.proc.wait(10)
            except subprocess.TimeoutExpired:
                p.proc.kill()


def test_weight_sync_into_two_servers_is_byte_exact(two_replay_servers: list[str]) -> None:
    trainer = reference_engine(seed=7).model  # weights neither server holds
    named = list(trainer.state_dict().items())
    want = {n: digest(t) for n, t in named}

    async def main() -> None:
        import aiohttp

        engines = [SGLangHTTPEngine(u, weight_backend="gloo") for u in two_replay_servers]
        sync = SGLangWeightSync(
            engines,
            master_address="127.0.0.1",
            master_port=free_port(),
            backend="gloo",
            timeout_s=60,
        )
        try:
            await sync.init()
            assert sync.world_size == 3
            await sync.start()
            half = len(named) // 2
            for part in (named[:half], named[half:]):
                await sync.update(
                    WeightBucket(tuple(n for n, _ in part), tuple(t for _, t in part))
                )
            await sync.finish(4)
            async with aiohttp.ClientSession() as session:
                for url in two_replay_servers:
                    async with session.get(f"{url}/replay/weights_digest") as response:
                        assert await response.json() == want
            for engine in engines:
                assert engine.weight_version == 4
                result = await engine.generate(req("after-sync", 5, seed=3))
                assert result.tokens and set(result.versions) == {4}
            results = [await e.generate(req("same", 6, temperature=0.0)) for e in engines]
            assert results[0].tokens == results[1].tokens  # the same weights now
        finally:
            await sync.close()
            for engine in engines:
                await engine.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_weight_sync_needs_connected_or_explicit_ranks() -> None:
    engine = SGLangHTTPEngine(f"http://127.0.0.1:{free_port()}")
    sync = SGLangWeightSync([engine], master_address="127.0.0.1", master_port=free_port())

    async def main() -> None:
        with pytest.raises(EngineUnavailableError):
            await sync.init()  # connect() cannot reach the server
        await sync.close()
        await engine.close()

    asyncio.run(main())
    with pytest.raises(WeightSyncError):
        SGLangWeightSync([object()], master_address="127.0.0.1", master_port=1)  # type: ignore[list-item]


# --------------------------------------------------------------------------------------------
# (d) error paths
# --------------------------------------------------------------------------------------------
def test_server_down_is_unavailable_and_leaves_no_request_in_flight() -> None:
    async def main() -> None:
        engine = SGLangHTTPEngine(f"http://127.0.0.1:{free_port()}", connect_timeout_s=2)
        for _ in range(2):  # the same id again: nothing was left in flight
            with pytest.raises(EngineUnavailableError, match="cannot reach"):
                await engine.generate(req("down"))
        assert not engine._inflight
        await engine.close()
        with pytest.raises(EngineError, match="closed"):
            await engine.generate(req("down"))

    asyncio.run(asyncio.wait_for(main(), 20))


def test_http_errors_quote_the_server_and_change_nothing() -> None:
    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        await engine.connect()
        server.fault("/generate", status=500, body='{"error": {"message": "CUDA out of memory"}}')
        with pytest.raises(EngineError, match=r"HTTP 500.*CUDA out of memory"):
            await engine.generate(req("e1"))
        server.fault("/generate", status=400, body='{"error": "unknown fields [\'x\']"}')
        with pytest.raises(EngineError, match="HTTP 400"):
            await engine.generate(req("e1"))
        assert not engine._inflight
        assert (await engine.generate(req("e1"))).tokens  # the id is free again
        server.fault("/update_weight_version", status=503, body='{"message": "busy"}')
        with pytest.raises(EngineError, match=r"503.*busy"):
            await engine.load_weights([], 1)
        assert engine.weight_version == 0
        server.fault("/pause_generation", status=500)
        with pytest.raises(EngineError):
            await engine.pause("keep")
        assert not engine.paused  # a failed pause does not hold new requests

    run(body)


def test_timeouts_are_bounded() -> None:
    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        await engine.connect()
        server.fault("/generate", delay_s=3.0)
        start = time.monotonic()
        with pytest.raises(EngineUnavailableError, match="no answer within"):
            await engine.generate(req("slow"))
        assert time.monotonic() - start < 2.5
        assert not engine._inflight

    run(body, timeout_s=0.5)


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        ("this is not json", "not JSON"),
        ('{"text": ""}', "meta_info"),
        ('{"meta_info": {"finish_reason": {"type": "stop"}}}', "output_token_logprobs"),
        ('{"meta_info": {"finish_reason": null, "output_token_logprobs": []}}', "finish reason"),
        ('{"meta_info": {"finish_reason": {"type": "stop"}, '
         '"output_token_logprobs": [[-0.1, "x", null]]}}', "entry"),
        ('{"output_ids": [2], "meta_info": {"finish_reason": {"type": "stop"}, '
         '"output_token_logprobs": [[-0.1, 1, null]]}}', "output_ids disagree"),
        ('{"meta_info": {"finish_reason": {"type": "length"}, "weight_version": "v2-rc", '
         '"output_token_logprobs": [[-0.1, 1, null]]}}', "did not set"),
        ('{"meta_info": {"finish_reason": {"type": "length"}, '
         '"weight_versions": [{"version": "0", "start": 0, "end": 5}], '
         '"output_token_logprobs": [[-0.1, 1, null]]}}', "span"),
    ],
)  # fmt: skip
def test_malformed_answers_are_clear_errors(answer: str, match: str) -> None:
    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        await engine.connect()
        server.fault("/generate", status=200, body=answer)
        with pytest.raises(EngineError, match=match):
            await engine.generate(req("m"))
        assert not engine._inflight

    run(body)


def test_bad_requests_are_rejected_before_anything_is_sent() -> None:
    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        with pytest.raises(EngineError, match="max_tokens"):
            await engine.generate(req("b", -1))
        with pytest.raises(EngineError, match="GenerationRequest"):
            await engine.generate("hello")  # type: ignore[arg-type]
        assert server.requests == [] and not engine._inflight

    run(body)


def test_server_version_outside_the_tested_range() -> None:
    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        with pytest.raises(ConfigError, match=r"sglang 0\.4\.9.*>=0\.5\.23,<0\.6"):
            await engine.connect()
        with pytest.raises(ConfigError):
            await engine.generate(req("v"))
        assert not engine._inflight

    run(body, server_kw={"version": "0.4.9"})

    async def opted_out(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        assert (await engine.generate(req("v"))).tokens
        assert engine.server_version == "0.6.1"

    run(opted_out, server_kw={"version": "0.6.1"}, check_server_version=False)
    assert TESTED == ("0.5.23", "0.6")
    check_sglang_version("0.5.23")
    check_sglang_version("0.5.99rc1")
    for bad in ("0.5.22", "0.6.0", "garbage"):
        with pytest.raises(ConfigError):
            check_sglang_version(bad)


def test_older_servers_answer_on_get_server_info() -> None:
    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        server.fault("/server_info", status=404, body='{"detail": "Not Found"}')
        await engine.connect()
        assert [p for p, _ in server.requests] == [
            "/server_info",
            "/get_server_info",
            "/model_info",
        ]

    run(body)


def test_missing_sglang_is_a_missing_extra_error() -> None:
    try:
        import sglang  # noqa: F401
    except Exception:
        pass
    else:
        pytest.skip("sglang imports here")
    with pytest.raises(MissingExtraError, match=r"asyncflow\[sglang\]"):
        SGLangEngine(model_path="Qwen/Qwen2.5-0.5B")


def test_bad_constructor_arguments() -> None:
    with pytest.raises(EngineError, match="base_url"):
        SGLangHTTPEngine("localhost:30000")
    with pytest.raises(EngineError, match="keep_mode"):
        SGLangHTTPEngine("http://h:1", keep_mode="freeze")  # type: ignore[arg-type]
    with pytest.raises(EngineError, match="weight_group_ranks"):
        SGLangHTTPEngine("http://h:1", weight_group_ranks=0)


# --------------------------------------------------------------------------------------------
# SGLangEngine (in-process sglang.Engine) on a fake
# --------------------------------------------------------------------------------------------
def _io_struct() -> SimpleNamespace:
    """A FAKE of ``sglang.srt.managers.io_struct``: the request classes the adapter builds,
    with SGLang 0.5.23's field names (io_struct.py), as plain namespaces."""

    def make(cls_name: str) -> Callable[..., SimpleNamespace]:
        return lambda **kw: SimpleNamespace(kind=cls_name, **kw)

    names = [
        "GenerateReqInput",
        "PauseGenerationReqInput",
        "ContinueGenerationReqInput",
        "ReleaseMemoryOccupationReqInput",
        "ResumeMemoryOccupationReqInput",
        "InitWeightsUpdateGroupReqInput",
        "UpdateWeightsFromDistributedReqInput",
        "UpdateWeightVersionReqInput",
        "DestroyWeightsUpdateGroupReqInput",
        "BeginWeightUpdateReqInput",
        "EndWeightUpdateReqInput",
    ]
    return SimpleNamespace(**{n: make(n) for n in names})


class FakeTokenizerManager:
    """A FAKE ``sglang.srt.managers.tokenizer_manager.TokenizerManager``: records calls."""

    def __init__(
        self, engine: TorchInferenceEngine, answer: Callable[..., Awaitable[dict[str, Any]]]
    ) -> None:
        self.engine = engine
        self.answer = answer
        self.calls: list[tuple[str, Any]] = []
        self.server_args = SimpleNamespace(
            tp_size=2, dp_size=1, pp_size=1, sampling_mask_max_tokens=4096,
            sampling_backend="flashinfer", enable_deterministic_inference=True,
        )  # fmt: skip
        self.label = "default"
        self.tasks: list[asyncio.Future[None]] = []
        self.session_open = False  # WeightUpdater._session (weight_updater.py)
        self.preferred_sampling_params: dict[str, Any] | None = None  # tokenizer_manager.py
        self.groups: set[str] = set()  # the workers' weight groups, by name

    async def generate_request(self, obj: Any, request: Any) -> AsyncIterator[dict[str, Any]]:
        """As TokenizerManager.generate_request (an async generator; non-streaming: one
        answer); a request SGLang refuses raises ValueError (_handle_abort_finish_reason)."""
        self.calls.append(("generate_request", obj))
        yield await self.answer(
            input_ids=obj.input_ids,
            sampling_params=obj.sampling_params,
            rid=obj.rid,
            return_sampling_mask=obj.return_sampling_mask,
            sampling_logprobs_mode=obj.sampling_logprobs_mode,
        )

    def config_value(self, key: str) -> Any:
        assert key == "weight_version"
        return self.label

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.calls.append(("abort_request", (rid, abort_all)))
        self.tasks.append(asyncio.ensure_future(self.engine.abort([rid])))

    async def pause_generation(self, obj: Any) -> None:
        self.calls.append(("pause_generation", obj))
        await self.engine.pause("abort" if obj.mode == "abort" else "keep")

    async def continue_generation(self, obj: Any) -> None:
        self.calls.append(("continue_generation", obj))
        await self.engine.resume()

    async def update_weight_version(self, obj: Any) -> None:
        self.calls.append(("update_weight_version", obj))
        self.label = obj.new_version
        await self.engine.load_weights([], int(obj.new_version))

    # The session SGLang 0.5.23 requires around update_weights_from_distributed, with its
    # refusals (sglang/srt/managers/scheduler_components/weight_updater.py, WeightUpdater.
    # begin_weight_update / end_weight_update / update_weights_from_distributed).
    async def begin_weight_update(self, obj: Any, request: Any) -> tuple[bool, str]:
        self.calls.append(("begin_weight_update", obj))
        if self.session_open:
            return (
                False,
                "a weight-update session is already open; call end_weight_update() first",
            )
        self.session_open = True
        return (True, "Success")

    async def end_weight_update(self, obj: Any, request: Any) -> tuple[bool, str]:
        self.calls.append(("end_weight_update", obj))
        if not self.session_open:
            return (False, "no weight-update session is open; call begin_weight_update() first")
        self.session_open = False
        return (True, "Success")

    async def update_weights_from_distributed(self, obj: Any, request: Any) -> tuple[bool, str]:
        self.calls.append(("update_weights_from_distributed", obj))
        if not self.session_open:
            return (
                False,
                "update_weights_from_distributed must run between begin_weight_update() and "
                "end_weight_update()",
            )
        return (obj.names != ["fail"], "message")

    # a group of a name already created is refused as torch refuses it, passed on by
    # model_runner_components/weight_updater.py (init_weights_update_group)
    async def init_weights_update_group(self, obj: Any, request: Any) -> tuple[bool, str]:
        self.calls.append(("init_weights_update_group", obj))
        if obj.group_name in self.groups:
            return (
                False,
                "Failed to initialize custom process group: The specified group name has "
                "already been created, please use a different group name.",
            )
        self.groups.add(obj.group_name)
        return (True, "Succeeded to initialize custom process group.")

    async def destroy_weights_update_group(self, obj: Any, request: Any) -> tuple[bool, str]:
        self.calls.append(("destroy_weights_update_group", obj))
        if obj.group_name not in self.groups:
            return (False, "The group to be destroyed does not exist.")
        self.groups.discard(obj.group_name)
        return (True, "Succeeded to destroy custom process group.")

    def __getattr__(self, name: str) -> Any:
        if name in (
            "release_memory_occupation", "resume_memory_occupation",
        ):  # fmt: skip

            async def control(obj: Any, request: Any) -> tuple[bool, str]:
                self.calls.append((name, obj))
                return (getattr(obj, "names", None) != ["fail"], "message")

            return control
        raise AttributeError(name)


class FakeSGLangEngine:
    """A FAKE shaped like ``sglang.Engine`` (engine.py): ``async_generate(input_ids=...,
    sampling_params=..., return_logprob=..., rid=...)`` (0.5.23's signature: no
    ``return_sampling_mask``) answering SGLang's output dict, and a ``tokenizer_manager``
    whose ``generate_request`` takes a ``GenerateReqInput`` with ``return_sampling_mask``;
    backed by the reference engine, with SGLang's log-probs (the replay's emulation:
    ``sglang_logprob_meta``)."""

    def __init__(self) -> None:
        self.ref = reference_engine()
        self.tokenizer_manager = FakeTokenizerManager(self.ref, self._answer)
        self.generate_calls: list[dict[str, Any]] = []
        self.shut = False

    async def async_generate(self, **kw: Any) -> dict[str, Any]:
        self.generate_calls.append(kw)
        return await self._answer(
            input_ids=kw["input_ids"], sampling_params=kw["sampling_params"], rid=kw["rid"]
        )

    async def _answer(
        self,
        *,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        rid: str,
        return_sampling_mask: bool = False,
        sampling_logprobs_mode: str | None = None,
    ) -> dict[str, Any]:
        sampling = SGLangSampling.of(sampling_params)
        if return_sampling_mask:
            refusal = sampling_mask_refusal(
                sampling, max_tokens=self.tokenizer_manager.server_args.sampling_mask_max_tokens
            )
            if refusal is not None:
                raise ValueError(refusal)
        args = self.tokenizer_manager.server_args
        params = sampling.reference_params(
            sampling_params, deterministic=args.enable_deterministic_inference
        )
        r = await self.ref.generate(GenerationRequest(rid, tuple(input_ids), params))
        meta = sglang_logprob_meta(
            self.ref.model, input_ids, r.tokens, r.logprobs, sampling,
            sampling_mask=return_sampling_mask, mode=sampling_logprobs_mode or "selected",
        )  # fmt: skip
        return {
            "text": "",
            "output_ids": list(r.tokens),
            "meta_info": {
                "id": rid,
                "finish_reason": {"type": r.finish_reason},
                "weight_version": self.tokenizer_manager.label,
                **meta,
            },
        }

    def shutdown(self) -> None:
        self.shut = True


def test_sglang_engine_maps_onto_a_fake_sglang_engine() -> None:
    async def main() -> None:
        fake = FakeSGLangEngine()
        engine = SGLangEngine.from_engine(fake, io_struct=_io_struct(), weight_backend="gloo")
        assert isinstance(engine, InferenceEngine) and isinstance(engine, GroupReceiver)
        result = await engine.generate(req("f1", 5, seed=2))
        assert fake.generate_calls[-1] == {
            "input_ids": [1, 2, 3, 4],
            "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "top_p": 1.0,
                                "top_k": -1, "sampling_seed": 2},
            "return_logprob": True,
            "rid": "f1",
        }  # fmt: skip
        assert result.tokens == (await reference_engine().generate(req("f1", 5, seed=2))).tokens
        task = asyncio.ensure_future(engine.generate(req("f2", 400)))
        while not fake.ref.running:
            await asyncio.sleep(0.01)
        await engine.abort(["f2"])
        assert (await task).finish_reason == "abort"
        await engine.pause("keep")
        await engine.resume()
        await engine.sleep(1)
        await engine.wake_up()
        await engine.join_weight_group("127.0.0.1", 1234, 1, 3)
        with pytest.raises(EngineError, match="must run between begin_weight_update"):
            await engine.receive_weights(["w"], ["float32"], [[2]])  # no session: refused
        await engine.begin_weight_update()
        await engine.receive_weights(["w"], ["float32"], [[2]])
        await engine.commit_weights(2)
        assert not fake.tokenizer_manager.session_open  # commit ended the session
        order = [n for n, _ in fake.tokenizer_manager.calls if "weight" in n]
        assert order[-4:] == [
            "begin_weight_update", "update_weights_from_distributed", "end_weight_update",
            "update_weight_version",
        ]  # fmt: skip
        await engine.leave_weight_group()
        assert engine.weight_version == 2 and engine.weight_group_ranks == 2
        calls = {name: obj for name, obj in fake.tokenizer_manager.calls}
        assert fake.tokenizer_manager.calls[0] == ("abort_request", ("f2", False))
        assert calls["pause_generation"].mode == "retract"
        assert calls["release_memory_occupation"].tags == ["kv_cache"]
        j = calls["init_weights_update_group"]
        assert (j.master_address, j.master_port, j.rank_offset, j.world_size, j.group_name,
                j.backend) == ("127.0.0.1", 1234, 1, 3, "weight_update_group", "gloo")  # fmt: skip
        u = calls["update_weights_from_distributed"]
        assert (u.names, u.dtypes, u.shapes) == (["w"], ["float32"], [[2]])
        v = calls["update_weight_version"]
        assert (v.new_version, v.abort_all_requests) == ("2", False)
        await engine.begin_weight_update()
        with pytest.raises(EngineError, match="did not succeed"):
            await engine.receive_weights(["fail"], ["float32"], [[1]])
        await engine.begin_weight_update()  # the failed sync's session is ended, then reopened
        assert fake.tokenizer_manager.session_open
        await engine.load_weights([], 3)  # a version bump ends it too
        assert not fake.tokenizer_manager.session_open and engine.weight_version == 3
        with pytest.raises(EngineError, match="SGLangWeightSync"):
            await engine.load_weights([("w", torch.zeros(1))], 3)
        del FakeTokenizerManager.pause_generation  # an SGLang without it
        try:
            with pytest.raises(EngineError, match=r"tokenizer_manager\.pause_generation"):
                await engine.pause("keep")
        finally:
            FakeTokenizerManager.pause_generation = _pause  # type: ignore[method-assign]
        await engine.close()
        assert fake.shut
        await fake.ref.close()

    _pause = FakeTokenizerManager.pause_generation
    asyncio.run(asyncio.wait_for(main(), 30))


def test_sglang_engine_reports_the_protocols_log_probs_on_a_fake() -> None:
    """The in-process adapter: top_k goes through tokenizer_manager.generate_request with
    return_sampling_mask (async_generate has no such argument in 0.5.23) and reports the
    protocol's log-probs; no filter goes through async_generate; what SGLang cannot report is
    refused before anything is called."""

    async def main() -> None:
        fake = FakeSGLangEngine()
        engine = SGLangEngine.from_engine(fake, io_struct=_io_struct(), weight_backend="gloo")
        tm = fake.tokenizer_manager
        r = req("k1", 8, temperature=0.8, top_k=3, seed=3)
        result = await engine.generate(r)
        assert fake.generate_calls == []
        ((name, obj),) = tm.calls
        assert name == "generate_request" and obj.kind == "GenerateReqInput"
        assert (obj.input_ids, obj.rid, obj.return_logprob) == ([1, 2, 3, 4], "k1", True)
        assert (obj.return_sampling_mask, obj.sampling_logprobs_mode) == (True, "selected")
        assert obj.sampling_params["top_k"] == 3
        want = protocol_logprobs(fake.ref.model, r, result.tokens)
        assert list(result.logprobs) == pytest.approx(want, abs=1e-5)
        # no filter: async_generate, SGLang's output_token_logprobs are already the protocol's
        r2 = req("t1", 8, temperature=0.6, seed=3)
        result2 = await engine.generate(r2)
        assert len(fake.generate_calls) == 1 and len(tm.calls) == 1
        want2 = protocol_logprobs(fake.ref.model, r2, result2.tokens)
        assert list(result2.logprobs) == pytest.approx(want2, abs=1e-5)
        # refusals: nothing called, nothing registered
        for params, match in (
            ({"top_k": 3, "top_p": 0.9}, "jointly"),
            ({"top_p": 0.9}, "no top_k"),
            ({"top_k": 4097}, "sampling-mask-max-tokens=4096"),
        ):
            with pytest.raises(EngineError, match=match):
                await engine.generate(req("no", 4, **params))
        tm.server_args.sampling_mask_max_tokens = 2
        small = SGLangEngine.from_engine(fake, io_struct=_io_struct())
        with pytest.raises(EngineError, match=r"top_k=3.*sampling-mask-max-tokens=2"):
            await small.generate(req("no", 4, top_k=3))
        assert len(fake.generate_calls) == 1 and len(tm.calls) == 1
        assert not engine._inflight and not small._inflight
        # an SGLang without tokenizer_manager.generate_request: a clear error, nothing left
        del FakeTokenizerManager.generate_request
        try:
            with pytest.raises(EngineError, match=r"tokenizer_manager\.generate_request"):
                await engine.generate(req("k2", 4, top_k=2))
        finally:
            FakeTokenizerManager.generate_request = _generate_request  # type: ignore[method-assign]
        assert not engine._inflight
        await engine.close()
        await fake.ref.close()

    _generate_request = FakeTokenizerManager.generate_request
    asyncio.run(asyncio.wait_for(main(), 30))


# --------------------------------------------------------------------------------------------
# (e) live: a real SGLang server
# --------------------------------------------------------------------------------------------
_LIVE_URL = os.environ.get("ASYNCFLOW_SGLANG_URL")


@pytest.mark.live_sglang
@pytest.mark.skipif(not _LIVE_URL, reason="set ASYNCFLOW_SGLANG_URL to a running SGLang server")
class TestSGLangHTTPLive(InferenceEngineConformance):
    """The laws against a real server (``python -m sglang.launch_server ...
    --enable-memory-saver`` for the sleep law)."""

    long_max_tokens = 1024
    timeout_s = 120.0
    real_timeout_s = 600.0

    async def make_engine(self) -> SGLangHTTPEngine:
        assert _LIVE_URL is not None
        return await SGLangHTTPEngine.connect_to(_LIVE_URL)


@pytest.mark.parametrize(
    ("server_keys", "client_keys", "ok"),
    [
        ({"api_key": "k"}, {"api_key": "k"}, True),
        ({"api_key": "k", "admin_api_key": "adm"}, {"api_key": "k", "admin_api_key": "adm"}, True),
        ({"admin_api_key": "adm"}, {"admin_api_key": "adm"}, True),
        ({"api_key": "k", "admin_api_key": "adm"}, {"api_key": "k"}, False),
        ({"api_key": "k"}, {}, False),
    ],
    ids=["api-key", "both-keys", "admin-only", "admin-key-missing", "no-key"],
)
def test_api_keys_reach_the_routes_that_need_them(
    server_keys: dict[str, str], client_keys: dict[str, str], ok: bool
) -> None:
    """SGLang's auth (srt/utils/auth.py): /generate and the info routes take the API key, the
    control and weight routes (ADMIN_OPTIONAL) the admin key when the server has one. A
    refused call names the route and the 401, never the key."""

    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        if not ok:
            with pytest.raises(EngineError, match="401") as info:
                await engine.connect()
                await engine.generate(req("r0", 3))
                await engine.pause("abort")
            for key in (*client_keys.values(), *server_keys.values()):
                assert key not in str(info.value)
            return
        await engine.connect()
        assert (await engine.generate(req("r0", 3))).tokens
        await engine.pause("abort")
        await engine.resume()
        await engine.load_weights([], 3)
        assert engine.weight_version == 3

    run(body, server_kw=server_keys, **client_keys)


def test_a_seed_is_refused_where_sglang_would_ignore_it() -> None:
    """SGLang 0.5.23 builds per-request seeds only with --enable-deterministic-inference
    (srt/sampling/sampling_batch_info.py): a seeded request to a server without it is refused
    before anything is sent, naming the flag; unseeded requests go on."""

    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        with pytest.raises(EngineError, match="--enable-deterministic-inference"):
            await engine.generate(req("seeded", 3, seed=1))
        assert not server.bodies("/generate")
        assert (await engine.generate(req("plain", 3))).tokens

    run(body, server_kw={"deterministic": False})


def test_sleep_with_requests_generating_is_refused_clearly() -> None:
    """SGLang asserts an idle scheduler to release memory; the adapter says so before asking,
    and sleeps once the requests ended."""
    from replay_vllm_server import FirstTokenFreeze

    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        await engine.connect()
        with FirstTokenFreeze(server.engine) as freeze:
            task = asyncio.ensure_future(engine.generate(req("busy", 40)))
            await freeze.frozen()  # generating (frozen at its first token) behind the server
        with pytest.raises(EngineError, match="sleep needs the server idle"):
            await engine.sleep(1)
        assert not server.memory_tags  # nothing was asked of the server
        await engine.abort(["busy"])
        assert (await task).finish_reason == "abort"
        await server.engine.resume()
        await engine.sleep(1)
        await engine.wake_up()

    run(body)


def test_in_process_seed_refused_without_deterministic_inference() -> None:
    """SGLangEngine reads the same flag from the engine's server_args."""

    async def main() -> None:
        fake = FakeSGLangEngine()
        fake.tokenizer_manager.server_args.enable_deterministic_inference = False
        engine = SGLangEngine.from_engine(fake, io_struct=_io_struct())
        with pytest.raises(EngineError, match="--enable-deterministic-inference"):
            await engine.generate(req("seeded", 3, seed=1))
        assert not fake.generate_calls
        assert (await engine.generate(req("plain", 3))).tokens
        await engine.close()
        await fake.ref.close()

    asyncio.run(main())


# --------------------------------------------------------------------------------------------
# Silent failures of a real SGLang our replay lacked (issue #40), each with its upstream file
# --------------------------------------------------------------------------------------------
def test_unseeded_samples_of_one_prompt_differ_on_a_deterministic_server() -> None:
    """With --enable-deterministic-inference SGLang seeds every unseeded request 42 and its
    seeded sampler is a function of seed and position (sampling_batch_info.py, sampler.py):
    the replay does so (raw requests collapse), and the adapter sends each request a seed of
    its own, so a GRPO group keeps its spread."""

    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        raw = []
        for i in range(4):  # what SGLang does to unseeded requests: one sample, four times
            out = await engine.client.call(
                "POST",
                "/generate",
                json_body={
                    "input_ids": [1, 2, 3, 4],
                    "sampling_params": {"max_new_tokens": 8, "temperature": 1.0},
                    "return_logprob": True,
                    "rid": f"raw{i}",
                    "stream": False,
                },
            )
            raw.append(tuple(out["output_ids"]))
        assert len(set(raw)) == 1
        results = [await engine.generate(req(f"s{i}", 8, temperature=1.0)) for i in range(8)]
        assert len({r.tokens for r in results}) > 1
        seeds = [b["sampling_params"]["sampling_seed"] for b in server.bodies("/generate")[4:]]
        assert len(set(seeds)) == 8

    run(body)


def test_in_process_unseeded_samples_differ_on_a_deterministic_engine() -> None:
    async def main() -> None:
        fake = FakeSGLangEngine()
        engine = SGLangEngine.from_engine(fake, io_struct=_io_struct())
        results = [await engine.generate(req(f"s{i}", 8, temperature=1.0)) for i in range(8)]
        assert len({r.tokens for r in results}) > 1
        seeds = {c["sampling_params"]["sampling_seed"] for c in fake.generate_calls}
        assert len(seeds) == 8
        await engine.close()
        await fake.ref.close()

    asyncio.run(main())


def test_a_session_a_dead_trainer_left_open_is_ended_and_begun_again() -> None:
    """A trainer killed mid-sync leaves SGLang's weight-update session open; every later
    /begin_weight_update is refused until it is ended (weight_updater.py,
    WeightUpdater.begin_weight_update). A new engine (the resumed run's) ends it once."""

    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        server.session_open = True  # the dead trainer's
        await engine.begin_weight_update()
        paths = [p for p, _ in server.requests if "weight_update" in p]
        assert paths == ["/begin_weight_update", "/end_weight_update", "/begin_weight_update"]
        assert server.session_open
        await engine.commit_weights(1)
        assert not server.session_open and engine.weight_version == 1

    run(body)

    async def in_process() -> None:
        fake = FakeSGLangEngine()
        fake.tokenizer_manager.session_open = True
        engine = SGLangEngine.from_engine(fake, io_struct=_io_struct())
        await engine.begin_weight_update()
        calls = [n for n, _ in fake.tokenizer_manager.calls if "weight_update" in n]
        assert calls == ["begin_weight_update", "end_weight_update", "begin_weight_update"]
        await engine.close()
        await fake.ref.close()

    asyncio.run(in_process())


def test_a_data_parallel_server_is_refused_a_weight_group_naming_why() -> None:
    """SGLang asserts dp_size == 1 on every distributed-update route
    (tokenizer_control_mixin.py); no weight_group_ranks= makes it work, so none is advised."""

    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        await engine.connect()
        with pytest.raises(EngineError, match="dp_size == 1") as info:
            await engine.join_weight_group("127.0.0.1", 1, 1, 2)
        assert "weight_group_ranks" not in str(info.value)
        assert not server.bodies("/init_weights_update_group")

    run(body, server_kw={"dp_size": 2})
    run(body, server_kw={"dp_size": 2}, weight_group_ranks=1)

    async def in_process() -> None:
        fake = FakeSGLangEngine()
        fake.tokenizer_manager.server_args.dp_size = 2
        engine = SGLangEngine.from_engine(fake, io_struct=_io_struct())
        with pytest.raises(EngineError, match="dp_size == 1"):
            await engine.join_weight_group("127.0.0.1", 1, 1, 2)
        with pytest.raises(EngineError, match="dp_size == 1"):
            _ = engine.weight_group_ranks
        await engine.close()
        await fake.ref.close()

    asyncio.run(in_process())


def test_releasing_memory_while_busy_kills_the_replay_as_it_kills_sglang() -> None:
    """release_memory_occupation asserts an idle scheduler (weight_updater.py); the assert
    kills the scheduler process and the launcher takes the server down. The replay does the
    same, so a client that asks anyway is seen failing."""
    from replay_vllm_server import FirstTokenFreeze

    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        await engine.connect()
        with FirstTokenFreeze(server.engine) as freeze:
            task = asyncio.ensure_future(engine.generate(req("busy", 40)))
            await freeze.frozen()
            with pytest.raises(EngineError):
                await engine.client.call("POST", "/release_memory_occupation", json_body={})
        assert server.dead
        with pytest.raises(EngineError):
            await engine.model_info()
        with pytest.raises(EngineError):
            await task
        await server.engine.resume()  # the frozen request's handler ends before the close

    run(body)


def test_in_process_sleep_while_busy_is_refused_before_the_scheduler_asserts() -> None:
    from replay_vllm_server import FirstTokenFreeze

    async def main() -> None:
        fake = FakeSGLangEngine()
        engine = SGLangEngine.from_engine(fake, io_struct=_io_struct())
        with FirstTokenFreeze(fake.ref) as freeze:
            task = asyncio.ensure_future(engine.generate(req("busy", 40)))
            await freeze.frozen()
        with pytest.raises(EngineError, match="kills the server"):
            await engine.sleep(1)
        assert not [n for n, _ in fake.tokenizer_manager.calls if "memory" in n]
        await engine.pause("abort")  # ended: the scheduler is idle
        assert (await task).finish_reason == "abort"
        await engine.sleep(1)
        await engine.wake_up()
        await engine.resume()
        await engine.close()
        await fake.ref.close()

    asyncio.run(main())


def test_a_retracting_pause_leaves_the_server_idle_for_flush_and_sleep() -> None:
    """A paused scheduler ignores its waiting queue (Scheduler.is_fully_idle(ignore_waiting=
    self._engine_paused): scheduler.py flush_cache, weight_updater.py release_memory_
    occupation), and a "retract" pause moves running requests there: flush_cache and sleep
    work with a request held, which then finishes after resume."""
    from replay_vllm_server import FirstTokenFreeze

    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        await engine.connect()
        with FirstTokenFreeze(server.engine) as freeze:
            task = asyncio.ensure_future(engine.generate(req("held", 6)))
            await freeze.frozen()
            await engine.pause("keep")  # keep_mode "retract"
        await engine.flush_cache()
        await engine.sleep(1)
        await engine.wake_up()
        await engine.resume()
        assert (await task).finish_reason in ("length", "stop")
        assert not server.dead

    run(body)


def test_preferred_sampling_params_of_the_server_are_undone_on_every_request() -> None:
    """SGLang merges --preferred-sampling-params under every request's sampling_params
    (tokenizer_manager.py); a preferred repetition penalty would make its log-probs differ
    from the trainer's. The adapter reads them from /model_info and sends the neutral value
    for each; one it cannot undo is refused when connecting, naming it."""

    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        result = await engine.generate(req("p", 4, temperature=1.0))
        assert result.tokens
        (effective,) = server.effective
        assert effective["repetition_penalty"] == 1.0 and effective["min_p"] == 0.0
        assert effective["stop"] is None

    preferred = {"repetition_penalty": 1.3, "min_p": 0.1, "stop": ["x"], "no_stop_trim": True}
    run(body, server_kw={"preferred_sampling_params": preferred})

    async def refused(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        with pytest.raises(EngineError, match=r"\['watermark'\]"):
            await engine.connect()

    run(refused, server_kw={"preferred_sampling_params": {"watermark": {"on": True}}})

    async def in_process() -> None:
        fake = FakeSGLangEngine()
        fake.tokenizer_manager.preferred_sampling_params = {"frequency_penalty": 0.5}
        engine = SGLangEngine.from_engine(fake, io_struct=_io_struct())
        await engine.generate(req("p", 3))
        assert fake.generate_calls[-1]["sampling_params"]["frequency_penalty"] == 0.0
        await engine.close()
        await fake.ref.close()

    asyncio.run(in_process())


# --------------------------------------------------------------------------------------------
# A job built with defaults syncs into SGLang (issue #40 item 2)
# --------------------------------------------------------------------------------------------
def _sglang_job(
    engines: list[Any], trainer: TorchTrainEngine, make_transport: Any = None, **knobs: Any
) -> Any:
    from asyncflow_core.flow.rlflow import RLConfig, RLEngines, RLJob

    cfg = RLConfig(steps=2, prompts_per_step=2, n=2, sampling=SamplingParams(max_tokens=3), **knobs)
    given = {} if make_transport is None else {"make_transport": make_transport}
    return RLJob(
        cfg, RLEngines(engines, trainer, **given), ([1, 2, 3] for _ in range(10_000)),
        lambda p, r: float(len(r)),
    )  # fmt: skip


@pytest.mark.parametrize("weight_sync", ["staged", "blocking", "staged-given-transport"])
def test_a_job_built_with_defaults_syncs_into_sglang_over_its_group(
    weight_sync: str, two_replay_servers: list[str]
) -> None:
    """RLConfig's default staged sync (and blocking) once handed SGLang tensors through
    load_weights, which it refuses: the first swap failed. Now the job stages on the trainer's
    side and swaps through the engines' own weight group (the trainer's side on loopback);
    both servers' weights then equal the trainer's, and their tokens carry its version."""
    import hashlib

    async def main() -> None:
        engines = [SGLangHTTPEngine(u, weight_backend="gloo") for u in two_replay_servers]
        trainer = TorchTrainEngine(MODEL, seed=7, threads=1)  # weights neither server holds
        given: list[SGLangWeightSync] = []

        def transport(targets: Any) -> SGLangWeightSync:  # what a remote server needs
            made = SGLangWeightSync(
                targets, master_address="127.0.0.1", master_port=free_port(), backend="gloo"
            )
            given.append(made)
            return given[-1]

        try:
            if weight_sync == "staged-given-transport":  # the staged swap goes through it
                job = _sglang_job(engines, trainer, transport, weight_sync="staged")
            else:
                job = _sglang_job(engines, trainer, weight_sync=weight_sync)
            result = await job.run()
            assert len(result.steps) == 2
            await job.sync_rollout()  # a staged job's last version waits for a safe point
            sent = {}
            async for bucket in trainer.export_weights(1 << 30):
                for name, tensor in bucket:
                    raw = tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()
                    sent[name] = hashlib.sha256(raw).hexdigest()
            for engine in engines:
                assert engine.weight_version == trainer.weight_version == 2
                served = await engine.client.call("GET", "/replay/weights_digest")
                assert sent and {n: served[n] for n in sent} == sent
                after = await engine.generate(req("after", 3, temperature=0.0))
                assert set(after.versions) == {2}
            assert len(given) == (weight_sync == "staged-given-transport")
        finally:
            for made in given:  # the user's transport stays the user's to close
                await made.close()
            await trainer.close()
            for engine in engines:
                await engine.close()

    asyncio.run(asyncio.wait_for(main(), 90))


def test_a_job_into_a_remote_sglang_is_refused_naming_the_setting() -> None:
    """The job opens the trainer's side of the group on loopback only: a server elsewhere is
    refused when the job is built (nothing ran), naming make_transport=SGLangWeightSync."""
    from asyncflow_core.flow.rlflow import RLConfig, RLEngines, RLJob

    engine = SGLangHTTPEngine("http://10.0.0.7:30000", weight_backend="gloo")
    trainer = TorchTrainEngine(MODEL, seed=1, threads=1)
    with pytest.raises(ConfigError, match="SGLangWeightSync") as refused:
        _sglang_job([engine], trainer)
    assert "not on loopback" in str(refused.value)
    # given the transport, the same job is built
    RLJob(
        RLConfig(steps=1, prompts_per_step=1, n=2),
        RLEngines(
            [engine], trainer,
            make_transport=lambda e: SGLangWeightSync(
                e, master_address="10.0.0.1", master_port=29600, backend="gloo"
            ),
        ),
        ([1] for _ in range(10)), lambda p, r: 0.0,
    )  # fmt: skip
    asyncio.run(trainer.close())


def test_a_default_job_over_an_in_process_sglang_swaps_through_its_group() -> None:
    """SGLangEngine takes no tensors; a job built with defaults is accepted and its staged
    swap goes through SGLangWeightSync with the trainer's side on loopback (the group itself
    is the replay's test above; the fake engine cannot join one)."""
    from asyncflow_core.flow.rlflow import RLConfig, RLEngines, RLJob
    from asyncflow_core.sync.strategies import StagedUpdate
    from asyncflow_core.sync.transports import engine_transport

    async def main() -> None:
        fake = FakeSGLangEngine()
        engine = SGLangEngine.from_engine(fake, io_struct=_io_struct(), weight_backend="gloo")
        trainer = TorchTrainEngine(MODEL, seed=1, threads=1)
        try:
            assert engine.tensor_load_refusal
            job = RLJob(
                RLConfig(steps=1, prompts_per_step=1, n=2), RLEngines([engine], trainer),
                ([1] for _ in range(10)), lambda p, r: 0.0,
            )  # fmt: skip
            staged = job._staged_update()
            assert isinstance(staged, StagedUpdate) and staged.swap_with is engine_transport
            sync = engine_transport(staged.engines)
            assert isinstance(sync, SGLangWeightSync)
            assert sync.master_address == "127.0.0.1" and sync.engines == [engine]
            with pytest.raises(EngineError, match="SGLangWeightSync"):
                await engine.load_weights([("w", torch.zeros(1))], 1)
        finally:
            await trainer.close()
            await engine.close()
            await fake.ref.close()

    asyncio.run(main())


def test_a_server_a_dead_trainer_left_mid_sync_takes_the_resumed_trainers_sync(
    two_replay_servers: list[str],
) -> None:
    """#40 item 3: a trainer killed mid-sync leaves SGLang in its weight group and in an open
    weight-update session; the resumed trainer's join is refused ("already been created")
    and so is its begin ("already open"). The adapter destroys the stale group and ends the
    stale session, once each, and the resumed sync lands whole."""
    url = two_replay_servers[0]
    named = list(reference_engine(seed=9).model.state_dict().items())
    want = {n: digest(t) for n, t in named}

    async def main() -> None:
        dead = SGLangHTTPEngine(url, weight_backend="gloo")
        sync = SGLangWeightSync(
            [dead], master_address="127.0.0.1", master_port=free_port(), backend="gloo"
        )
        await sync.init()
        await sync.start()  # the session is open; then the trainer dies:
        assert sync.group is not None
        sync.group.close()  # type: ignore[attr-defined]  # its side of the group only
        await dead.close()

        engine = SGLangHTTPEngine(url, weight_backend="gloo")  # the resumed run's
        resumed = SGLangWeightSync(
            [engine], master_address="127.0.0.1", master_port=free_port(), backend="gloo",
            timeout_s=60,
        )  # fmt: skip
        try:
            await resumed.init()
            await resumed.start()
            await resumed.update(
                WeightBucket(tuple(n for n, _ in named), tuple(t for _, t in named))
            )
            await resumed.finish(7)
            served = await engine.client.call("GET", "/replay/weights_digest")
            assert served == want and engine.weight_version == 7
        finally:
            await resumed.close()
            await engine.close()

    asyncio.run(asyncio.wait_for(main(), 90))


def test_in_process_a_stale_weight_group_is_destroyed_and_joined_again() -> None:
    async def main() -> None:
        fake = FakeSGLangEngine()
        fake.tokenizer_manager.groups.add("weight_update_group")  # a dead trainer's
        engine = SGLangEngine.from_engine(fake, io_struct=_io_struct())
        await engine.join_weight_group("127.0.0.1", 1, 1, 2)
        calls = [n for n, _ in fake.tokenizer_manager.calls if "group" in n]
        assert calls == [
            "init_weights_update_group", "destroy_weights_update_group",
            "init_weights_update_group",
        ]  # fmt: skip
        await engine.close()
        await fake.ref.close()

    asyncio.run(main())
