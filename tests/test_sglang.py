"""The SGLang adapter (asyncflow_sglang) against a replay server (tests/replay_sglang_server.py:
SGLang's documented routes and JSON shapes, backed by the reference PyTorch engine — not
SGLang): the request bodies of every adapter method, the InferenceEngine conformance suite, a
collective weight sync into two replay servers in their own processes over SGLang's group
construction, and the error paths. ``SGLangEngine`` (in-process ``sglang.Engine``) is
contract-tested on a documented fake shaped like ``sglang.Engine``. A live test runs the
conformance suite against a real server when ``ASYNCFLOW_SGLANG_URL`` is set."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import safetensors.torch
import torch
from asyncflow_conformance import InferenceEngineConformance
from asyncflow_reference.engines import TorchInferenceEngine
from asyncflow_sglang import (
    TESTED,
    SGLangEngine,
    SGLangHTTPEngine,
    SGLangWeightSync,
    check_sglang_version,
)
from replay_sglang_server import MODEL, ReplayServer, digest

from asyncflow_core.errors import (
    ConfigError,
    EngineError,
    EngineUnavailableError,
    MissingExtraError,
    WeightSyncError,
)
from asyncflow_core.process import free_port
from asyncflow_core.protocols import (
    GenerationRequest,
    InferenceEngine,
    SamplingParams,
    SupportsLoadWeights,
    SupportsPause,
    SupportsSleep,
    WeightBucket,
)
from asyncflow_core.weightsync import GroupReceiver

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
        r = req("g1", 6, temperature=0.7, top_p=0.9, seed=5, stop_token_ids=(15,))
        result = await engine.generate(r)
        (sent,) = server.bodies("/generate")
        assert sent == {
            "input_ids": [1, 2, 3, 4],
            "sampling_params": {
                "max_new_tokens": 6,
                "temperature": 0.7,
                "top_p": 0.9,
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
        # top_k > 0 passes through; a resumed request sends prompt + prefix, cap reduced
        prefix = ((5, -0.5, 0), (6, -0.25, 0))
        resumed = await engine.generate(req("g2", 5, top_k=3, resume=prefix))
        sent2 = server.bodies("/generate")[-1]
        assert sent2["input_ids"] == [1, 2, 3, 4, 5, 6]
        assert sent2["sampling_params"]["max_new_tokens"] == 3
        assert (
            sent2["sampling_params"]["top_k"] == 3
            and "sampling_seed" not in sent2["sampling_params"]
        )
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


def test_ranks_need_an_explicit_count_with_data_parallel() -> None:
    async def body(server: ReplayServer, engine: SGLangHTTPEngine) -> None:
        await engine.connect()
        with pytest.raises(EngineError, match="weight_group_ranks"):
            await engine.join_weight_group("127.0.0.1", 1, 1, 2)

    run(body, server_kw={"dp_size": 2})
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
             "abort_all_requests": False}
        ]  # fmt: skip
        assert server.bodies("/update_weight_version")[-1] == {
            "new_version": "9",
            "abort_all_requests": False,
        }
        assert server.bodies("/destroy_weights_update_group") == [
            {"group_name": "weight_update_group"}
        ]
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
        "PauseGenerationReqInput",
        "ContinueGenerationReqInput",
        "ReleaseMemoryOccupationReqInput",
        "ResumeMemoryOccupationReqInput",
        "InitWeightsUpdateGroupReqInput",
        "UpdateWeightsFromDistributedReqInput",
        "UpdateWeightVersionReqInput",
        "DestroyWeightsUpdateGroupReqInput",
    ]
    return SimpleNamespace(**{n: make(n) for n in names})


class FakeTokenizerManager:
    """A FAKE ``sglang.srt.managers.tokenizer_manager.TokenizerManager``: records calls."""

    def __init__(self, engine: TorchInferenceEngine) -> None:
        self.engine = engine
        self.calls: list[tuple[str, Any]] = []
        self.server_args = SimpleNamespace(tp_size=2, dp_size=1, pp_size=1)
        self.label = "default"
        self.tasks: list[asyncio.Future[None]] = []

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

    def __getattr__(self, name: str) -> Any:
        if name in (
            "init_weights_update_group", "update_weights_from_distributed",
            "destroy_weights_update_group", "release_memory_occupation",
            "resume_memory_occupation",
        ):  # fmt: skip

            async def control(obj: Any, request: Any) -> tuple[bool, str]:
                self.calls.append((name, obj))
                return (getattr(obj, "names", None) != ["fail"], "message")

            return control
        raise AttributeError(name)


class FakeSGLangEngine:
    """A FAKE shaped like ``sglang.Engine`` (engine.py): ``async_generate(input_ids=...,
    sampling_params=..., return_logprob=..., rid=...)`` answering SGLang's output dict, and a
    ``tokenizer_manager``; backed by the reference engine."""

    def __init__(self) -> None:
        self.ref = reference_engine()
        self.tokenizer_manager = FakeTokenizerManager(self.ref)
        self.generate_calls: list[dict[str, Any]] = []
        self.shut = False

    async def async_generate(self, **kw: Any) -> dict[str, Any]:
        self.generate_calls.append(kw)
        sp = kw["sampling_params"]
        params = SamplingParams(
            max_tokens=sp["max_new_tokens"],
            temperature=sp["temperature"],
            top_p=sp["top_p"],
            top_k=max(sp["top_k"], 0),
            seed=sp.get("sampling_seed"),
        )
        r = await self.ref.generate(GenerationRequest(kw["rid"], tuple(kw["input_ids"]), params))
        return {
            "text": "",
            "output_ids": list(r.tokens),
            "meta_info": {
                "id": kw["rid"],
                "finish_reason": {"type": r.finish_reason},
                "weight_version": self.tokenizer_manager.label,
                "output_token_logprobs": [
                    [lp, t, None] for lp, t in zip(r.logprobs, r.tokens, strict=True)
                ],
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
        await engine.receive_weights(["w"], ["float32"], [[2]])
        await engine.commit_weights(2)
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
        with pytest.raises(EngineError, match="did not succeed"):
            await engine.receive_weights(["fail"], ["float32"], [[1]])
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
