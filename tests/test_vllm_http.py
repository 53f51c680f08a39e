"""``asyncflow_vllm.VLLMHTTPEngine`` against the replay server (``replay_vllm_server.py``: vLLM's
documented routes and JSON shapes backed by the reference ``TorchInferenceEngine``; it is not
vLLM, which cannot run on this CPU-only machine), and against a live ``vllm serve`` when
``ASYNCFLOW_VLLM_URL`` is set (``pytest -m live_vllm``).

(a) contract: every adapter method sends the route, query and body vLLM 0.33.0's source
documents (the replay server records them); (b) the InferenceEngine conformance suite through
HTTP; (c) ``EngineGroupWeightSync`` moving a model's weights into two servers over a gloo
group; (d) error paths: a server down, HTTP errors, timeouts, malformed answers, an
untested vLLM version.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, ClassVar, TypeVar

import pytest
import torch
from asyncflow_conformance import InferenceEngineConformance
from asyncflow_reference.engines import TorchInferenceEngine
from asyncflow_reference.model import ModelConfig, TransformerLM
from asyncflow_vllm.http import DEV_MODE_HINT, VLLMHTTPEngine
from replay_vllm_server import ReplayVLLMServer

from asyncflow_core.errors import ConfigError, EngineError, EngineUnavailableError
from asyncflow_core.process import free_port
from asyncflow_core.protocols import GenerationRequest, SamplingParams, WeightBucket
from asyncflow_core.weightsync import EngineGroupWeightSync, WeightSyncGroup

T = TypeVar("T")
MODEL = ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, max_seq_len=512)


def run(coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(bounded())


async def serve(
    lm: TransformerLM | ModelConfig = MODEL, **engine_kw: Any
) -> tuple[ReplayVLLMServer, VLLMHTTPEngine]:
    server = ReplayVLLMServer(TorchInferenceEngine(lm, max_batch=8, seed=0, threads=1))
    url = await server.start()
    engine = VLLMHTTPEngine(url, **engine_kw)
    return server, engine


async def shut(server: ReplayVLLMServer, engine: VLLMHTTPEngine) -> None:
    await engine.close()
    await server.close()


def req(rid: str, max_tokens: int = 6, **params: Any) -> GenerationRequest:
    return GenerationRequest(rid, (1, 2, 3), SamplingParams(max_tokens=max_tokens, **params))


# --------------------------------------------------------------------------------------------
# (a) contract: routes, queries and bodies as vLLM documents them
# --------------------------------------------------------------------------------------------
def test_connect_reads_version_weight_info_and_world_size() -> None:
    async def main() -> None:
        server, engine = await serve()
        try:
            with pytest.raises(EngineError, match="connect"):
                _ = engine.weight_group_ranks
            await engine.connect()
            await engine.connect()  # once only
            assert [(r.method, r.path) for r in server.requests] == [
                ("GET", "/version"),
                ("GET", "/weight_info"),
                ("GET", "/get_world_size"),
            ]
            assert engine.server_version == "0.33.0"
            assert engine.weight_version == 0  # vLLM's initial label "default"
            assert engine.weight_group_ranks == 1
        finally:
            await shut(server, engine)

    run(main())


def test_generate_sends_a_generate_request_and_maps_the_answer() -> None:
    async def main() -> None:
        server, engine = await serve(model="m")
        try:
            request = GenerationRequest(
                "g1",
                (1, 2, 3),
                SamplingParams(
                    max_tokens=6, temperature=0.7, top_p=0.9, top_k=5, seed=3, stop_token_ids=(4,)
                ),
            )
            result = await engine.generate(request)
            (call,) = server.calls("/inference/v1/generate")
            assert call.body == {
                "request_id": "g1",
                "token_ids": [1, 2, 3],
                "sampling_params": {
                    "n": 1,
                    "max_tokens": 6,
                    "temperature": 0.7,
                    "top_p": 0.9,
                    "top_k": 5,
                    "logprobs": 0,
                    "detokenize": False,
                    "ignore_eos": False,
                    "seed": 3,
                    "stop_token_ids": [4],
                },
                "stream": False,
                "model": "m",
            }
            # the same request on a twin engine gives the same tokens and log-probs
            twin = TorchInferenceEngine(MODEL, max_batch=8, seed=0, threads=1)
            try:
                direct = await twin.generate(request)
            finally:
                await twin.close()
            assert result.tokens == direct.tokens
            assert result.logprobs == pytest.approx(direct.logprobs, abs=1e-6)
            assert result.finish_reason == direct.finish_reason
            assert result.versions == (0,) * len(result.tokens)
        finally:
            await shut(server, engine)

    run(main())


def test_partial_rollout_continues_after_the_resumed_prefix() -> None:
    async def main() -> None:
        server, engine = await serve()
        try:
            request = GenerationRequest(
                "cont",
                (1, 2, 3),
                SamplingParams(max_tokens=5, seed=1),
                resume_tokens=(7, 8),
                resume_logprobs=(-0.5, -0.25),
                resume_versions=(0, 0),
            )
            result = await engine.generate(request)
            (call,) = server.calls("/inference/v1/generate")
            assert call.body["token_ids"] == [1, 2, 3, 7, 8]
            assert call.body["sampling_params"]["max_tokens"] == 3
            assert result.tokens[:2] == (7, 8) and len(result.tokens) == 5
            assert result.logprobs[:2] == (-0.5, -0.25)
        finally:
            await shut(server, engine)

    run(main())


def test_abort_posts_the_server_side_ids_and_returns_the_prefix() -> None:
    async def main() -> None:
        server, engine = await serve()
        try:
            await engine.abort(["nobody"])  # unknown: nothing sent (an empty list aborts all)
            task = asyncio.ensure_future(engine.generate(req("long", 400)))
            while "generate-tokens-long" not in server.engine._inflight:
                await asyncio.sleep(0.005)
            await server.engine.wait_for_tokens("generate-tokens-long", 3)
            await engine.abort(["long"])
            result = await task
            assert result.finish_reason == "abort" and 3 <= len(result.tokens) < 400
            (call,) = server.calls("/abort_requests")
            assert call.body == {"request_ids": ["generate-tokens-long"]}
            assert len(result.logprobs) == len(result.versions) == len(result.tokens)
        finally:
            await shut(server, engine)

    run(main())


def test_pause_resume_sleep_wake_up_routes() -> None:
    async def main() -> None:
        server, engine = await serve()
        try:
            await engine.pause("keep")
            assert engine.paused and await engine.is_paused()
            waiting = asyncio.ensure_future(engine.generate(req("w")))
            await asyncio.sleep(0.1)
            assert not waiting.done() and not server.calls("/inference/v1/generate")
            await engine.resume()
            assert (await waiting).finish_reason == "length"
            await engine.pause("abort")
            await engine.resume()
            assert [c.query for c in server.calls("/pause")] == [
                {"mode": ["keep"]},
                {"mode": ["abort"]},
            ]
            assert all(c.body is None for c in server.calls("/resume"))
            await engine.sleep(1)
            assert engine.asleep and await engine.is_sleeping()
            with pytest.raises(EngineError, match="asleep"):
                await engine.generate(req("zz"))
            await engine.wake_up(["weights", "kv_cache"])
            assert not await engine.is_sleeping()
            await engine.sleep(2)
            await engine.wake_up()
            assert [c.query for c in server.calls("/sleep")] == [
                {"level": ["1"], "mode": ["abort"]},
                {"level": ["2"], "mode": ["abort"]},
            ]
            assert [c.query for c in server.calls("/wake_up")] == [
                {"tags": ["weights", "kv_cache"]},
                {},
            ]
            assert (await engine.generate(req("after"))).finish_reason == "length"
            mode: Any = "wait"
            with pytest.raises(EngineError, match="mode"):
                await engine.pause(mode)
            with pytest.raises(EngineError, match="level"):
                await engine.sleep(3)
        finally:
            await shut(server, engine)

    run(main())


def test_load_weights_sets_the_version_label_and_refuses_tensors() -> None:
    async def main() -> None:
        server, engine = await serve()
        try:
            await engine.load_weights((), 3)
            (call,) = server.calls("/update_weight_version")
            assert call.body == {"new_version": "3"}
            assert engine.weight_version == 3
            result = await engine.generate(req("v3"))
            assert set(result.versions) == {3}
            before = len(server.requests)
            with pytest.raises(EngineError, match="EngineGroupWeightSync"):
                await engine.load_weights([("w", torch.zeros(2))], 4)
            assert len(server.requests) == before and engine.weight_version == 3
        finally:
            await shut(server, engine)

    run(main())


# --------------------------------------------------------------------------------------------
# (b) the conformance suite through HTTP
# --------------------------------------------------------------------------------------------
class TestVLLMHTTPEngineAgainstReplayServer(InferenceEngineConformance):
    vocab_size = MODEL.vocab_size
    context_window = MODEL.max_seq_len
    long_max_tokens = 400
    timeout_s = 30.0
    real_timeout_s = 60.0

    servers: ClassVar[dict[int, ReplayVLLMServer]] = {}

    async def make_engine(self) -> VLLMHTTPEngine:
        server, engine = await serve()
        self.servers[id(engine)] = server
        await engine.connect()
        return engine

    async def close_engine(self, engine: Any) -> None:
        await shut(self.servers.pop(id(engine)), engine)


# --------------------------------------------------------------------------------------------
# (c) a collective weight sync into two servers
# --------------------------------------------------------------------------------------------
def test_engine_group_weight_sync_moves_a_models_weights() -> None:
    async def main() -> None:
        trained = TransformerLM(MODEL, seed=5)
        pairs = [await serve() for _ in range(2)]
        engines = [engine for _, engine in pairs]
        for engine in engines:
            await engine.connect()
        sync = EngineGroupWeightSync(
            engines,
            master_address="127.0.0.1",
            master_port=free_port(),
            make_group=lambda host, port, world: WeightSyncGroup(host, port, 0, world),
            timeout_s=30.0,
        )
        try:
            await sync.init()
            state = {k: v.detach().clone() for k, v in trained.state_dict().items()}
            names = list(state)
            await sync.start()
            for part in (names[: len(names) // 2], names[len(names) // 2 :]):
                await sync.update(WeightBucket(tuple(part), tuple(state[n] for n in part)))
            await sync.finish(7)
            for server, engine in pairs:
                assert engine.weight_version == 7
                got = server.engine.model.state_dict()
                for name, tensor in state.items():
                    assert torch.equal(got[name], tensor), name
                assert server.prefix_cache_resets == 1
                result = await engine.generate(req("after-sync", seed=2))
                assert set(result.versions) == {7}
                (init,) = server.calls("/init_weight_transfer_engine")
                offset = 1 + pairs.index((server, engine))
                assert init.body == {
                    "init_info": {
                        "master_address": "127.0.0.1",
                        "master_port": sync.master_port,
                        "rank_offset": offset,
                        "world_size": 3,
                        "packed": False,
                    }
                }
                assert [c.body for c in server.calls("/start_weight_update")] == [None]
                updates = server.calls("/update_weights")
                assert [u.body["update_info"]["names"] for u in updates] == [
                    names[: len(names) // 2],
                    names[len(names) // 2 :],
                ]
                first = updates[0].body["update_info"]
                assert first["dtype_names"][0] == "float32"
                assert first["shapes"][0] == list(state[names[0]].shape)
                assert [c.body for c in server.calls("/finish_weight_update")] == [
                    {"weight_version": "7"}
                ]
        finally:
            await sync.close()
            for server, engine in pairs:
                assert server.calls("/shutdown_weight_transfer_engine")
                await shut(server, engine)

    run(main(), 60.0)


# --------------------------------------------------------------------------------------------
# (d) error paths
# --------------------------------------------------------------------------------------------
def test_a_server_that_is_down_is_unavailable_fast() -> None:
    async def main() -> None:
        engine = VLLMHTTPEngine(f"http://127.0.0.1:{free_port()}", connect_timeout_s=2.0)
        try:
            with pytest.raises(EngineUnavailableError, match="cannot reach"):
                await engine.generate(req("x"))
            with pytest.raises(EngineUnavailableError):
                await engine.pause("keep")
            assert not engine.paused  # a refused pause leaves the engine as it was
        finally:
            await engine.close()

    run(main(), 15.0)


def test_http_errors_quote_the_server_and_leave_state_unchanged() -> None:
    async def main() -> None:
        server, engine = await serve()
        try:
            await engine.connect()
            server.fail("/inference/v1/generate", status=500)
            with pytest.raises(EngineError, match=r"HTTP 500.*injected HTTP 500"):
                await engine.generate(req("e"))
            assert (await engine.generate(req("e"))).finish_reason == "length"  # id reusable
            server.fail("/update_weight_version", status=400, body='{"detail": "bad label"}')
            with pytest.raises(EngineError, match="bad label"):
                await engine.load_weights((), 5)
            assert engine.weight_version == 0
            server.fail("/pause", status=503)
            with pytest.raises(EngineError, match="HTTP 503"):
                await engine.pause("keep")
            assert not engine.paused
            with pytest.raises(EngineError):
                await engine.generate(GenerationRequest("neg", (1, -2)))
            assert not server.calls("/inference/v1/generate")[2:]  # nothing sent
        finally:
            await shut(server, engine)

    run(main())


def test_missing_dev_routes_say_how_to_start_vllm() -> None:
    async def main() -> None:
        server, engine = await serve()
        server.dev_mode = False
        try:
            with pytest.raises(EngineError, match="VLLM_SERVER_DEV_MODE=1") as info:
                await engine.connect()
            assert DEV_MODE_HINT in str(info.value)
        finally:
            await shut(server, engine)

    run(main())


def test_a_slow_server_times_out_and_a_pause_is_rolled_back() -> None:
    async def main() -> None:
        server, engine = await serve(control_timeout_s=0.3, timeout_s=0.3)
        try:
            await engine.connect()
            server.fail("/pause", delay_s=2.0)
            with pytest.raises(EngineUnavailableError, match="no answer within"):
                await engine.pause("keep")
            assert not engine.paused
            server.fail("/inference/v1/generate", delay_s=2.0)
            with pytest.raises(EngineUnavailableError):
                await engine.generate(req("slow"))
        finally:
            await shut(server, engine)

    run(main())


@pytest.mark.parametrize(
    "body",
    [
        "not json at all",
        '{"choices": "nope"}',
        '{"request_id": "x"}',
        '{"choices": [{"token_ids": [1, 2], "finish_reason": "length"}]}',
        '{"choices": [{"token_ids": [1], "finish_reason": "length",'
        ' "logprobs": {"content": [{"token_id": 2, "logprob": -1.0}]}}]}',
        '{"choices": [{"token_ids": [1], "finish_reason": "error",'
        ' "logprobs": {"content": [{"token_id": 1, "logprob": -1.0}]}}]}',
        '{"choices": [{"token_ids": [1], "finish_reason": "length",'
        ' "logprobs": {"content": [{"token_id": 1, "logprob": -1.0}]},'
        ' "weight_versions": [{"version": "someone-elses", "start": 0, "end": 1}]}]}',
        '{"choices": [{"token_ids": [1], "finish_reason": "length",'
        ' "logprobs": {"content": [{"token_id": 1, "logprob": -1.0}]},'
        ' "weight_versions": [{"version": "1", "start": 0, "end": 5}]}]}',
    ],
)
def test_malformed_generate_answers_are_engine_errors(body: str) -> None:
    async def main() -> None:
        server, engine = await serve()
        try:
            server.fail("/inference/v1/generate", body=body)
            with pytest.raises(EngineError) as info:
                await engine.generate(req("m"))
            message = str(info.value)
            assert any(m in message for m in ("malformed", "finish reason", "did not set"))
            assert (await engine.generate(req("m"))).finish_reason == "length"
        finally:
            await shut(server, engine)

    run(main())


def test_an_answer_without_spans_falls_back_to_the_current_version() -> None:
    async def main() -> None:
        server, engine = await serve()
        try:
            server.spans = False
            await engine.load_weights((), 2)
            assert set((await engine.generate(req("nospan"))).versions) == {2}
        finally:
            await shut(server, engine)

    run(main())


def test_a_server_paused_by_someone_else_rejects_with_503() -> None:
    async def main() -> None:
        server, engine = await serve()
        try:
            server.reject_new = "abort"
            with pytest.raises(EngineError, match="paused"):
                await engine.generate(req("p"))
        finally:
            await shut(server, engine)

    run(main())


def test_a_request_that_races_our_own_pause_waits_and_goes_again() -> None:
    async def main() -> None:
        server, engine = await serve()
        try:
            await engine.connect()
            server.fail("/inference/v1/generate", delay_s=0.3)  # sent before the pause lands
            task = asyncio.ensure_future(engine.generate(req("race")))
            await asyncio.sleep(0.1)
            await engine.pause("abort")  # the server now answers new requests 503 "paused"
            await asyncio.sleep(0.4)
            assert not task.done()  # rejected by the paused server, waiting on our pause
            await engine.resume()
            result = await task
            assert result.finish_reason == "length"
            assert len(server.calls("/inference/v1/generate")) == 2
        finally:
            await shut(server, engine)

    run(main())


@pytest.mark.parametrize("version", ["0.32.1", "0.34.0", "garbage"])
def test_an_untested_server_version_is_a_config_error(version: str) -> None:
    async def main() -> None:
        server, engine = await serve()
        server.vllm_version = version
        lenient = VLLMHTTPEngine(server.base_url, check_server_version=False)
        try:
            with pytest.raises(ConfigError, match="tested with vllm"):
                await engine.connect()
            await lenient.connect()
            assert lenient.server_version == version
        finally:
            await lenient.close()
            await shut(server, engine)

    run(main())


def test_bad_constructor_arguments_and_a_closed_engine() -> None:
    with pytest.raises(EngineError, match="base_url"):
        VLLMHTTPEngine("localhost:8000")
    with pytest.raises(EngineError, match="weight_group_ranks"):
        VLLMHTTPEngine("http://127.0.0.1:1", weight_group_ranks=0)

    async def main() -> None:
        engine = VLLMHTTPEngine("http://127.0.0.1:1", weight_group_ranks=2)
        assert engine.weight_group_ranks == 2
        await engine.close()
        await engine.close()
        with pytest.raises(EngineError, match="closed"):
            await engine.generate(req("c"))

    run(main())


# --------------------------------------------------------------------------------------------
# (e) live: a real vllm serve
# --------------------------------------------------------------------------------------------
LIVE_URL = os.environ.get("ASYNCFLOW_VLLM_URL")


@pytest.mark.live_vllm
@pytest.mark.skipif(
    not LIVE_URL,
    reason="live vLLM test: set ASYNCFLOW_VLLM_URL to a `VLLM_SERVER_DEV_MODE=1 vllm serve "
    'MODEL --weight-transfer-config \'{"backend":"nccl"}\' --enable-sleep-mode` URL; no '
    "vLLM server can run on this CPU-only machine",
)
class TestLiveVLLMHTTPEngine(InferenceEngineConformance):
    long_max_tokens = 2048
    timeout_s = 120.0
    real_timeout_s = 600.0

    async def make_engine(self) -> VLLMHTTPEngine:
        engine = VLLMHTTPEngine(str(LIVE_URL), ignore_eos=True)
        await engine.connect()
        return engine

    async def close_engine(self, engine: Any) -> None:
        await engine.close()
