"""Engines in Ray actors (asyncflow_ray.engines): the protocol laws through the proxies, the
optional abilities mirrored exactly, the engine's own errors and a dead actor surfacing
clearly, tensors crossing byte-equal, a weight sync through the proxies, and placement (a
resource reserved; a resource no node has refused at once instead of waiting forever).

One local Ray cluster (the ``ray_runtime`` fixture, 4 logical CPUs) serves the module. The
small engines below are defined here, and this module is not importable in Ray's workers, so
it is registered with cloudpickle to travel by value."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import pickle
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from asyncflow_conformance import InferenceEngineConformance, TrainEngineConformance
from asyncflow_conformance.engines import padded_batch, same_bytes
from asyncflow_ray.engines import RayInferenceEngine, RayTrainEngine, WorkerLostError
from asyncflow_ray.runtime import import_ray
from asyncflow_reference.engines import TorchInferenceEngine, TorchTrainEngine
from asyncflow_reference.model import ModelConfig

from asyncflow_core.contracts.errors import ConfigError, EngineError
from asyncflow_core.contracts.protocols import (
    GenerationRequest,
    GenerationResult,
    InferenceEngine,
    SamplingParams,
    SupportsLoadWeights,
    SupportsPause,
    SupportsRestart,
    SupportsSleep,
    TrainEngine,
)
from asyncflow_core.sync.transports import InProcessWeightSync
from asyncflow_core.training.rl import policy_gradient_loss

TORCH_MODEL = ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, max_seq_len=512)
ROLLOUT = functools.partial(TorchInferenceEngine, TORCH_MODEL, max_batch=8, seed=0, threads=1)
TRAINER = functools.partial(TorchTrainEngine, TORCH_MODEL, micro_batch_size=2, seed=0, threads=1)
DEVICES = 0.5  # of the fixture's 4 logical CPUs: room for every engine a test holds at once


class Spare:
    """Hands out ``total`` fresh engines, building up to ``depth`` ahead in the background:
    every law still gets an engine of its own, but the ~2 s an actor takes to start (its
    worker process imports torch) overlaps the previous laws instead of adding to each."""

    def __init__(self, build: Callable[[], Any], total: int, depth: int = 3) -> None:
        self._build = build
        self._left = total
        self._depth = depth
        self._pool = ThreadPoolExecutor(depth, thread_name_prefix="spare-engine")
        self._ready: deque[Future[Any]] = deque()

    async def take(self) -> Any:
        while self._left > 0 and len(self._ready) <= self._depth:
            self._ready.append(self._pool.submit(self._build))
            self._left -= 1
        if not self._ready:
            raise AssertionError("Spare: more engines taken than the tests it was sized for")
        return await asyncio.wrap_future(self._ready.popleft())

    def close(self) -> None:
        for future in self._ready:
            with contextlib.suppress(Exception):
                asyncio.run(future.result().close())
        self._pool.shutdown()


@pytest.fixture(scope="module", autouse=True)
def by_value(module_by_value: None) -> None:
    """Ray's workers cannot import this module: what it defines travels by value."""


@pytest.fixture(scope="class")
def spare(request: pytest.FixtureRequest, by_value: None) -> Iterator[None]:
    """A ``Spare`` of the class's ``factory`` as ``self.spare``, closed after the class."""
    cls = request.cls
    assert cls is not None
    laws = sum(1 for item in request.session.items if getattr(item, "cls", None) is cls)
    cls.spare = Spare(functools.partial(cls.proxy.create, cls.factory, devices=DEVICES), laws)
    try:
        yield
    finally:
        cls.spare.close()


@pytest.fixture(scope="module")
def echo_engine(by_value: None) -> Iterator[RayInferenceEngine]:
    """One ``EchoEngine`` actor for the tests that only read from it."""
    proxy = RayInferenceEngine.create(EchoEngine, devices=0, name="echo")
    yield proxy
    asyncio.run(proxy.close())


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# --------------------------------------------------------------------------------------------
# The protocol laws, through the proxies
# --------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("spare")
class TestRayInferenceEngine(InferenceEngineConformance):
    """The reference rollout engine in a Ray actor (settings of TestTorchInferenceEngine)."""

    vocab_size = TORCH_MODEL.vocab_size
    context_window = TORCH_MODEL.max_seq_len
    long_max_tokens = 400
    # safety nets, not assertions: on a loaded 2-core box a Ray actor took over 30 s to start
    timeout_s = 300.0
    real_timeout_s = 900.0
    proxy = RayInferenceEngine
    factory = ROLLOUT
    spare: Spare

    async def make_engine(self) -> RayInferenceEngine:
        engine: RayInferenceEngine = await self.spare.take()
        return engine

    def lose(self, engine: Any) -> None:
        import_ray().kill(engine.handle)  # the actor's death, as a node's loss would be


@pytest.mark.usefixtures("spare")
class TestRayTrainEngine(TrainEngineConformance):
    """The reference trainer in a Ray actor (settings of TestTorchTrainEngine)."""

    vocab_size = TORCH_MODEL.vocab_size
    required_fields = ("prompt", "response", "advantage")
    timeout_s = 300.0  # safety nets (see TestRayInferenceEngine)
    real_timeout_s = 900.0
    proxy = RayTrainEngine
    factory = TRAINER
    spare: Spare

    async def make_engine(self) -> RayTrainEngine:
        engine: RayTrainEngine = await self.spare.take()
        return engine

    def lose(self, engine: Any) -> None:
        import_ray().kill(engine.handle)


# --------------------------------------------------------------------------------------------
# Small engines of this module (they travel by value)
# --------------------------------------------------------------------------------------------
class EchoEngine:
    """An ``InferenceEngine`` with no optional ability: echoes the prompt as the response,
    after ``delay_s`` (a request whose id starts with ``hold`` waits 60 s); a request with
    ``max_tokens == 13`` raises ``Unlucky``. ``cancelled`` lists the requests whose call was
    cancelled."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self._version = 0
        self.cancelled: list[str] = []
        self.started: list[str] = []

    @property
    def weight_version(self) -> int:
        return self._version

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if request.params.max_tokens == 13:
            raise Unlucky(f"request {request.request_id!r}: max_tokens=13 is unlucky")
        self.started.append(request.request_id)
        try:
            await asyncio.sleep(60.0 if request.request_id.startswith("hold") else self.delay_s)
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        n = len(request.prompt_tokens)
        return GenerationResult(
            request.request_id,
            request.prompt_tokens,
            request.prompt_tokens,
            (-1.0,) * n,
            (self._version,) * n,
            "length",
        )

    async def abort(self, request_ids: Sequence[str]) -> None:
        return None


class PausableEchoEngine(EchoEngine):
    """``EchoEngine`` that also implements ``SupportsPause`` (and nothing else); its
    ``close()`` writes ``closed`` into the file ``marker``."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker
        self.pauses: list[str] = []

    async def close(self) -> None:
        with open(self.marker, "w") as f:
            f.write("closed")

    async def pause(self, mode: Literal["abort", "keep"] = "abort") -> None:
        self.pauses.append(mode)

    async def resume(self) -> None:
        self.pauses.append("resume")


class Unlucky(EngineError):
    """An engine's own error type."""


class NotPicklable(Exception):
    """An error that cannot cross a process boundary (it holds a lock)."""

    def __init__(self) -> None:
        super().__init__("holds a lock")
        self.lock = threading.Lock()


def broken_factory() -> EchoEngine:
    raise Unlucky("no such model: 'tiny-9000'")


def raise_unpicklable(engine: Any) -> None:
    raise NotPicklable()


def set_version(engine: Any, version: int) -> None:
    engine._version = version


def echo(engine: Any, value: Any) -> Any:
    return value


def engine_weights(engine: Any) -> dict[str, torch.Tensor]:
    """A reference engine's weights, by ``state_dict`` name."""
    return {n: t.detach().clone() for n, t in engine.model.state_dict().items()}


def request(rid: str, max_tokens: int = 4, prompt: tuple[int, ...] = (1, 2, 3)) -> Any:
    return GenerationRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, seed=1))


# --------------------------------------------------------------------------------------------
# Abilities, errors, data
# --------------------------------------------------------------------------------------------
def test_proxies_expose_exactly_the_abilities_of_their_engine(
    echo_engine: RayInferenceEngine, tmp_path: Path
) -> None:
    marker = tmp_path / "closed"

    async def body() -> None:
        plain = echo_engine
        factory = functools.partial(PausableEchoEngine, str(marker))
        pausable = await RayInferenceEngine.create_async(factory, devices=0)
        try:
            for proxy in (plain, pausable):
                assert isinstance(proxy, InferenceEngine) and isinstance(proxy, RayInferenceEngine)
                assert not isinstance(proxy, TrainEngine)
                assert not isinstance(proxy, SupportsSleep | SupportsLoadWeights)
            assert not isinstance(plain, SupportsPause) and plain.abilities == frozenset()
            assert isinstance(pausable, SupportsPause) and pausable.abilities == {"pause"}
            assert plain.engine_type == "EchoEngine" and "EchoEngine" in repr(plain)
            # the ability works: the calls reached the engine in the actor
            await pausable.pause("keep")
            await pausable.resume()
            assert await pausable.run(lambda e: list(e.pauses)) == ["keep", "resume"]
            # every reply refreshes the cached version
            assert pausable.weight_version == 0
            await pausable.run(set_version, 7)
            assert pausable.weight_version == 7 and await pausable.refresh_version() == 7
            # a proxy pickles as its actor: the copy reaches the same engine, same abilities
            copy = pickle.loads(pickle.dumps(pausable))
            assert type(copy) is type(pausable) and copy.actor_id == pausable.actor_id
            assert await copy.refresh_version() == 7 and isinstance(copy, SupportsPause)
            result = await plain.generate(request("r1"))
            assert result.tokens == (1, 2, 3) and result.finish_reason == "length"
        finally:
            await pausable.close()

    run(body())
    assert marker.read_text() == "closed", "close() did not close the engine in the actor"


def test_engine_errors_come_back_as_raised(echo_engine: RayInferenceEngine) -> None:
    async def body() -> None:
        proxy = echo_engine
        with pytest.raises(Unlucky, match="max_tokens=13 is unlucky") as info:
            await proxy.generate(request("r13", max_tokens=13))
        assert type(info.value) is Unlucky  # the engine's own class, not Ray's wrapper
        assert any("raised in EchoEngine engine 'echo'" in n for n in info.value.__notes__)
        with pytest.raises(ZeroDivisionError):
            await proxy.run(lambda e: 1 / 0)
        with pytest.raises(EngineError, match=r"NotPicklable: holds a lock \(raised in"):
            await proxy.run(raise_unpicklable)
        with pytest.raises(EngineError, match=r"arguments of run \(function, tuple\) cannot be"):
            await proxy.run(echo, threading.Lock())
        assert (await proxy.generate(request("after"))).tokens == (1, 2, 3)  # still works

    run(body())


def test_cancelling_a_call_cancels_it_in_the_actor(echo_engine: RayInferenceEngine) -> None:
    async def body() -> None:
        call = asyncio.ensure_future(echo_engine.generate(request("hold-1")))
        await asyncio.sleep(0.3)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        for _ in range(100):
            cancelled = await echo_engine.run(lambda e: list(e.cancelled))
            if cancelled:
                break
            await asyncio.sleep(0.05)
        assert cancelled == ["hold-1"], "the engine's generate was not cancelled in the actor"

    run(body())


def test_bad_factories_and_options_are_clear_errors(echo_engine: RayInferenceEngine) -> None:
    with pytest.raises(ConfigError, match="Ray refused the actor's options"):
        RayInferenceEngine.create(EchoEngine, devices=0, name=echo_engine.name)  # name taken
    with pytest.raises(EngineError, match="building the engine in its Ray actor failed") as info:
        RayInferenceEngine.create(broken_factory, devices=0)
    assert type(info.value.__cause__) is Unlucky
    assert "tiny-9000" in str(info.value.__cause__)
    # a proxy of the wrong kind is refused, naming the right one
    with pytest.raises(ConfigError, match=r"EchoEngine, which is not a TrainEngine.*use RayInf"):
        RayTrainEngine.create(EchoEngine, devices=0)
    with pytest.raises(ConfigError, match="factory must be a zero-argument callable"):
        RayInferenceEngine.create("EchoEngine", devices=0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"max_restarts=1 is not supported by RayTrainEngine"):
        RayTrainEngine.create(TRAINER, devices=0, max_restarts=1)
    with pytest.raises(ConfigError, match="max_restarts must be an int >= 0, got -1"):
        RayInferenceEngine.create(EchoEngine, devices=0, max_restarts=-1)
    with pytest.raises(ConfigError, match=r"max_task_retries=2 is not supported.*run twice"):
        RayInferenceEngine.create(EchoEngine, devices=0, max_task_retries=2)
    with pytest.raises(ConfigError, match="devices must be a number >= 0, got -1"):
        RayInferenceEngine.create(EchoEngine, devices=-1)


def test_tensors_cross_byte_equal_and_writable(echo_engine: RayInferenceEngine) -> None:
    async def body() -> None:
        g = torch.Generator().manual_seed(0)
        big = torch.randn(1 << 21, generator=g)  # 8 MiB: through the object store
        sent: dict[str, Any] = {
            "big": big,
            "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
            "bool": torch.rand(4, 4, generator=g) > 0.5,
            "scalar": torch.tensor(7, dtype=torch.int64),
            "empty": torch.zeros(0, 3),
            "strided": torch.arange(24.0).reshape(4, 6).t(),  # not contiguous
            "grad": torch.ones(2, requires_grad=True),
            "nested": [torch.arange(3), (torch.arange(2.0),)],
        }
        back = await echo_engine.run(echo, sent)
        for name in ("big", "bf16", "bool", "scalar", "empty", "strided"):
            assert same_bytes(back[name].contiguous(), sent[name].contiguous()), name
        assert back["grad"].requires_grad and torch.equal(back["grad"], sent["grad"])
        assert torch.equal(back["nested"][0], torch.arange(3))
        assert isinstance(back["nested"][1], tuple)
        assert torch.equal(back["nested"][1][0], torch.arange(2.0))
        back["big"].add_(1.0)  # the copy is ours: writable, the sender's tensor untouched
        assert torch.equal(back["big"], big + 1.0)

    run(body())


# --------------------------------------------------------------------------------------------
# A dead actor
# --------------------------------------------------------------------------------------------
def test_a_killed_actor_is_a_lost_worker() -> None:
    ray = import_ray()

    async def body() -> None:
        proxy = await RayInferenceEngine.create_async(
            functools.partial(EchoEngine, delay_s=30.0), devices=0, name="doomed-rollout"
        )
        in_flight = asyncio.ensure_future(proxy.generate(request("long")))
        await asyncio.sleep(0.5)
        assert not in_flight.done()
        ray.kill(proxy.handle)
        with pytest.raises(WorkerLostError, match=r"^doomed-rollout: the Ray actor") as info:
            await asyncio.wait_for(in_flight, 10)
        error = info.value
        assert isinstance(error, EngineError)
        assert error.engine == "doomed-rollout" and error.actor_id == proxy.actor_id
        assert proxy.actor_id in str(error) and "create a new engine" in str(error)
        start = time.monotonic()
        with pytest.raises(WorkerLostError, match=r"^doomed-rollout: .*\(generate was not sent\)"):
            await proxy.generate(request("next"))
        assert time.monotonic() - start < 0.5, "a call on a lost worker must fail fast"
        assert proxy.weight_version == 0 and "lost" in repr(proxy)
        await proxy.close()
        await proxy.close()  # idempotent
        assert "closed" in repr(proxy)
        with pytest.raises(EngineError, match="generate after close"):
            await proxy.generate(request("closed"))

    run(body())


def test_a_restarted_actor_is_lost_until_restart_brings_a_fresh_engine_back() -> None:
    """``max_restarts=1``: Ray restarts the killed actor, but never silently. The requests in
    flight fail with ``WorkerLostError``, later calls are refused, and ``restart()`` builds a
    fresh engine from the factory (the factory's version, not the lost engine's). A failure of
    a call sent before the restart never marks the restarted engine lost. A second death spends
    the restarts: ``restart()`` then says so."""
    ray = import_ray()

    async def body() -> None:
        proxy = await RayInferenceEngine.create_async(
            functools.partial(EchoEngine, delay_s=0.0), devices=0, name="phoenix",
            max_restarts=1,
        )  # fmt: skip
        plain = await RayInferenceEngine.create_async(EchoEngine, devices=0)
        try:
            assert isinstance(proxy, SupportsRestart) and not proxy.lost
            assert not isinstance(plain, SupportsRestart)  # no max_restarts: no restart()
            await proxy.run(set_version, 5)
            assert await proxy.refresh_version() == 5
            first_pid = proxy.pid
            held = [asyncio.ensure_future(proxy.generate(request(f"hold{i}"))) for i in range(2)]
            await _wait_until(lambda: proxy.run(started, 2), "the held requests running")
            ray.kill(proxy.handle, no_restart=False)
            for call in held:
                with pytest.raises(WorkerLostError, match="restart\\(\\) brings a fresh engine"):
                    await asyncio.wait_for(call, 60)
            assert proxy.lost and "lost" in repr(proxy)
            with pytest.raises(WorkerLostError, match=r"\(generate was not sent\)"):
                await proxy.generate(request("refused"))
            await asyncio.wait_for(proxy.restart(), 120)
            assert not proxy.lost and proxy.restarts == 1 and proxy.pid != first_pid
            assert proxy.weight_version == 0  # the factory's engine, not the lost one's v5
            done = await proxy.generate(request("after"))
            assert done.finish_reason == "length" and done.versions == (0, 0, 0)
            # a failure from before the restart does not mark the new engine lost
            stale = proxy._ray_error("generate", RuntimeError("late"), epoch=0)
            assert isinstance(stale, WorkerLostError) and "before its actor restarted" in str(stale)
            assert not proxy.lost
            await proxy.restart()  # not lost: nothing to do
            assert proxy.restarts == 1
            # the second death spends the restarts
            last = asyncio.ensure_future(proxy.generate(request("hold-last")))
            await _wait_until(lambda: proxy.run(started, 1), "the held request running")
            ray.kill(proxy.handle, no_restart=False)
            with pytest.raises(WorkerLostError) as info:
                await asyncio.wait_for(last, 60)
            assert proxy.lost
            with pytest.raises(WorkerLostError, match=r"phoenix.*(cannot restart|restarts are sp)"):
                await asyncio.wait_for(proxy.restart(), 120)
            assert proxy.lost and proxy.restarts == 1 and "phoenix" in str(info.value)
        finally:
            await proxy.close()
            await plain.close()

    run(body())


def started(engine: Any, count: int) -> bool:
    """Whether the engine has started ``count`` requests."""
    return len(engine.started) >= count


# --------------------------------------------------------------------------------------------
# Batched generate calls
# --------------------------------------------------------------------------------------------
async def _wait_until(check: Callable[[], Any], what: str, timeout_s: float = 60.0) -> Any:
    """Poll ``check`` (a coroutine function) until it returns something truthy: a safety net
    for evidence that arrives from the actor, not a timing assertion."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = await check()
        if got:
            return got
        assert time.monotonic() < deadline, f"no evidence of {what} in {timeout_s} s"
        await asyncio.sleep(0.02)


def test_generate_calls_of_one_turn_travel_in_one_actor_call(
    echo_engine: RayInferenceEngine,
) -> None:
    async def body() -> None:
        proxy = echo_engine
        calls, requests = proxy.calls_sent, proxy.requests_sent
        prompts = [(i, i + 1, i + 2) for i in range(10)]
        results = await asyncio.gather(
            *(proxy.generate(request(f"b{i}", prompt=p)) for i, p in enumerate(prompts))
        )
        assert (proxy.calls_sent - calls, proxy.requests_sent - requests) == (1, 10)
        assert [r.request_id for r in results] == [f"b{i}" for i in range(10)]
        assert [r.tokens for r in results] == prompts  # each caller its own result
        # calls of different turns are different actor calls
        await proxy.generate(request("c1"))
        await proxy.generate(request("c2"))
        assert proxy.calls_sent - calls == 3

    run(body())


def test_batched_results_stream_back_as_each_finishes(echo_engine: RayInferenceEngine) -> None:
    async def body() -> None:
        proxy = echo_engine
        calls = proxy.calls_sent
        held = asyncio.ensure_future(proxy.generate(request("hold-stream")))
        quick = asyncio.ensure_future(proxy.generate(request("quick")))
        assert (await quick).tokens == (1, 2, 3)  # while its batch-mate still runs
        assert proxy.calls_sent - calls == 1 and not held.done()
        held.cancel()  # the caller gives up: the request's task is cancelled in the actor
        with pytest.raises(asyncio.CancelledError):
            await held

        async def cancelled() -> bool:
            return "hold-stream" in await proxy.run(lambda e: list(e.cancelled))

        await _wait_until(cancelled, "the held request cancelled in the actor")

    run(body())


def test_one_request_s_error_fails_only_its_caller(echo_engine: RayInferenceEngine) -> None:
    async def body() -> None:
        proxy = echo_engine
        calls = proxy.calls_sent
        got = await asyncio.gather(
            proxy.generate(request("ok-1")),
            proxy.generate(request("bad", max_tokens=13)),
            proxy.generate(request("ok-2")),
            return_exceptions=True,
        )
        assert proxy.calls_sent - calls == 1
        assert isinstance(got[1], Unlucky) and "'bad'" in str(got[1])
        assert [g.request_id for g in (got[0], got[2])] == ["ok-1", "ok-2"]  # type: ignore[union-attr]

    run(body())


def test_abort_in_a_batch_ends_exactly_the_named_requests(by_value: None) -> None:
    async def body() -> None:
        proxy = await RayInferenceEngine.create_async(ROLLOUT, devices=DEVICES, name="batch-abort")
        try:
            long = [
                GenerationRequest(f"long-{i}", (1, 2, 3), SamplingParams(max_tokens=400, seed=i))
                for i in range(3)
            ]
            # paused ("keep"), the engine queues the requests and runs none: the abort cannot
            # lose a race with long-1's 400th token on a loaded box (it did, once)
            await proxy.pause("keep")
            calls = [asyncio.ensure_future(proxy.generate(r)) for r in long]
            await asyncio.sleep(0)  # the calls are made (queued for this turn's actor call)
            await proxy.abort(["long-1"])
            await proxy.resume()
            results = await asyncio.gather(*calls)
            assert proxy.calls_sent == 1
            assert results[1].finish_reason == "abort"
            assert [r.finish_reason for r in (results[0], results[2])] == ["length"] * 2
            assert [len(r.tokens) for r in (results[0], results[2])] == [400, 400]
        finally:
            await proxy.close()

    run(body())


def test_a_killed_actor_fails_every_request_of_its_batch() -> None:
    ray = import_ray()

    async def body() -> None:
        proxy = await RayInferenceEngine.create_async(
            functools.partial(EchoEngine, delay_s=30.0), devices=0, name="doomed-batch"
        )
        try:
            calls = [asyncio.ensure_future(proxy.generate(request(f"d{i}"))) for i in range(3)]
            for _ in range(100):  # a few turns of the loop: the calls are made, then sent
                if proxy.calls_sent:
                    break
                await asyncio.sleep(0)
            assert (proxy.calls_sent, proxy.requests_sent) == (1, 3)
            ray.kill(proxy.handle)
            for call in calls:
                with pytest.raises(WorkerLostError, match=r"^doomed-batch: the Ray actor"):
                    await asyncio.wait_for(call, 60)
        finally:
            await proxy.close()

    run(body())


# --------------------------------------------------------------------------------------------
# A weight sync through the proxies
# --------------------------------------------------------------------------------------------
def test_weight_sync_from_a_remote_trainer_into_remote_rollouts() -> None:
    async def body() -> None:
        source_factory = functools.partial(TorchTrainEngine, TORCH_MODEL, seed=1, threads=1)
        trainer, rollout_0, rollout_1 = await asyncio.gather(
            RayTrainEngine.create_async(source_factory, devices=DEVICES),
            RayInferenceEngine.create_async(ROLLOUT, devices=DEVICES, name="rollout-0"),
            RayInferenceEngine.create_async(ROLLOUT, devices=DEVICES, name="rollout-1"),
        )
        rollouts = [rollout_0, rollout_1]
        try:
            assert trainer.abilities == frozenset() and isinstance(trainer, TrainEngine)
            assert not isinstance(trainer, InferenceEngine | SupportsSleep)
            for rollout in rollouts:
                assert rollout.abilities == {"pause", "sleep", "load_weights"}
                assert isinstance(rollout, SupportsPause | SupportsSleep)
                assert isinstance(rollout, SupportsLoadWeights)
            batch = padded_batch([[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10]], [1.0, -1.0])
            metrics = await trainer.train_step(batch, policy_gradient_loss)
            assert metrics.version == 1 == trainer.weight_version
            source = await trainer.run(engine_weights)
            before = await rollouts[0].run(engine_weights)
            assert set(before) == set(source)
            assert not all(same_bytes(before[n], source[n]) for n in source), (
                "the rollouts already hold the trainer's weights: the sync would prove nothing"
            )
            # an export abandoned after one bucket leaves the trainer usable
            stream = trainer.export_weights(1)
            first = await stream.__anext__()
            await stream.aclose()  # type: ignore[attr-defined]
            assert isinstance(rollout_0, SupportsLoadWeights)
            assert isinstance(rollout_1, SupportsLoadWeights)
            sync = InProcessWeightSync([rollout_0, rollout_1])
            await sync.init()
            await sync.start()
            names: list[str] = []
            async for bucket in trainer.export_weights(16 << 10):
                await sync.update(bucket)
                names += bucket.names
            await sync.finish(trainer.weight_version)
            assert names[0] == first.names[0] and len(names) > len(first.names)
            for rollout in rollouts:
                assert rollout.weight_version == 1
                held = await rollout.run(engine_weights)
                for name, tensor in source.items():
                    assert same_bytes(held[name], tensor), f"{rollout.name}: {name} differs"
                result = await rollout.generate(request(f"after-sync-{rollout.name}"))
                assert result.tokens and set(result.versions) == {1}
        finally:
            for engine in (trainer, *rollouts):
                await engine.close()

    run(body())


# --------------------------------------------------------------------------------------------
# Placement
# --------------------------------------------------------------------------------------------
def _cpus_available(ray: Any) -> float:
    return float(ray.available_resources().get("CPU", 0.0))


def _wait_for_cpus(ray: Any, value: float) -> float:
    """Ray's resource view is eventually consistent: poll until it shows ``value``."""
    deadline = time.monotonic() + 10
    while (cpus := _cpus_available(ray)) != value and time.monotonic() < deadline:
        time.sleep(0.05)
    return cpus


def test_a_cpu_engine_reserves_its_cpus_on_the_pinned_node(ray_runtime: Any) -> None:
    ray = import_ray()

    [node] = ray_runtime.nodes()
    free = _wait_for_cpus(ray, float(ray.cluster_resources()["CPU"]))
    proxy = RayInferenceEngine.create(EchoEngine, platform="cpu", devices=1, node_id=node.node_id)
    try:
        assert proxy.node_id == node.node_id
        assert _wait_for_cpus(ray, free - 1) == free - 1
        # the cluster has 4 CPUs, but not free: the start times out instead of waiting forever
        with pytest.raises(EngineError, match=r"did not start within start_timeout_s=1 s.*CPU=3"):
            RayInferenceEngine.create(EchoEngine, devices=free, start_timeout_s=1)
    finally:
        run(proxy.close())
    assert _wait_for_cpus(ray, free) == free


@pytest.mark.parametrize(("platform", "resource"), [("cuda", "GPU"), ("npu", "NPU")])
def test_a_resource_no_node_has_is_refused_at_once(platform: str, resource: str) -> None:
    start = time.monotonic()
    with pytest.raises(ConfigError, match=rf"lacks .*{resource}=1.*the cluster has CPU=4") as info:
        RayInferenceEngine.create(EchoEngine, platform=platform, devices=1)
    assert f"platform {platform!r}" in str(info.value)
    assert time.monotonic() - start < 5, "refused before creating an actor, not after waiting"


def test_an_unknown_node_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"node_id='f00d' is not an alive node"):
        RayInferenceEngine.create(EchoEngine, devices=0, node_id="f00d")
