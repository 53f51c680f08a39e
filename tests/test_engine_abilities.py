"""What an engine declares it cannot do where it runs, and the client-side plumbing the vLLM
adapters share: ``unavailable_ability`` (the suites skip with the engine's reason, the job's
colocated mode keeps such an engine awake), ``tensor_load_refusal`` (the job refuses, before
anything runs, a weight sync that would hand such an engine tensors), ``enginekit.InFlight``
(aborts that hold when the engine drops them) and ``asyncflow_conformance.shared.EngineHost``
(one engine shared by laws that each run on an event loop of their own)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import pytest
from asyncflow_conformance.shared import EngineHost
from test_rlflow import ToyEngine, ToyTrainer

from asyncflow_core.contracts.errors import ConfigError, EngineError
from asyncflow_core.contracts.protocols import (
    InferenceEngine,
    SupportsPause,
    SupportsSleep,
    tensor_load_refusal,
    unavailable_ability,
)
from asyncflow_core.engines.enginekit import InFlight, PauseGate
from asyncflow_core.flow.rlflow import RLConfig, RLEngines, RLJob
from asyncflow_core.sync.transports import InProcessWeightSync


class SleeplessEngine(ToyEngine):
    """Has sleep/wake_up, declares them unavailable (as vLLM on a CPU does)."""

    unavailable_abilities: ClassVar[dict[str, str]] = {
        "SupportsSleep": "no memory to release on this platform"
    }

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.slept = 0

    async def sleep(self, level: int = 1) -> None:
        self.slept += 1
        raise EngineError("sleep is not available here")

    async def wake_up(self) -> None:
        raise EngineError("wake_up is not available here")


class VersionOnlyEngine(ToyEngine):
    """An HTTP client whose server takes no tensors (vLLM's NCCL-only launch)."""

    tensor_load_refusal = "the server's routes carry no tensors"


def test_declared_abilities_are_read_by_name() -> None:
    engine = SleeplessEngine(0)
    assert isinstance(engine, SupportsSleep)
    assert unavailable_ability(engine, "SupportsSleep") == "no memory to release on this platform"
    assert unavailable_ability(engine, "SupportsPause") is None
    assert unavailable_ability(ToyEngine(0), "SupportsSleep") is None
    assert tensor_load_refusal(VersionOnlyEngine(0)) == "the server's routes carry no tensors"
    assert tensor_load_refusal(ToyEngine(0)) is None


def test_a_colocated_job_keeps_an_engine_that_cannot_sleep_awake() -> None:
    async def main() -> None:
        engine = SleeplessEngine(0)
        cfg = RLConfig(
            verify_sync="off",  # toy engines: their log-probs are not a model's
            steps=2, prompts_per_step=2, n=2, mode="colocated", staleness=0,
            weight_sync="blocking",
        )  # fmt: skip
        job = RLJob(cfg, RLEngines([engine], ToyTrainer()), ([1, 2] for _ in range(100)),
                    lambda p, r: 1.0)  # fmt: skip
        result = await job.run()
        assert len(result.steps) == 2 and engine.slept == 0

    asyncio.run(main())


@pytest.mark.parametrize("sync", ["staged", "blocking"])
def test_a_sync_that_would_hand_tensors_to_an_engine_that_takes_none_is_refused(sync: str) -> None:
    """Refused when the job is built, naming the engine, its reason and what works; a
    transport of the engine's own (``make_transport`` for blocking, ``make_staged``) is fine."""
    cfg = RLConfig(steps=1, prompts_per_step=1, weight_sync=sync)  # type: ignore[arg-type]
    engines = [ToyEngine(0), VersionOnlyEngine(1)]
    with pytest.raises(ConfigError, match=r"rollout engine 1 \(VersionOnlyEngine\) cannot take "
                       r"tensors.*routes carry no tensors.*weight_sync='blocking'"):  # fmt: skip
        RLJob(cfg, RLEngines(engines, ToyTrainer()), [], lambda p, r: 0.0)

    def own(targets: Sequence[Any], *rest: Any) -> Any:
        return InProcessWeightSync(targets)

    if sync == "staged":
        RLJob(cfg, RLEngines(engines, ToyTrainer(), make_staged=own), [], lambda p, r: 0.0)
    else:
        RLJob(cfg, RLEngines(engines, ToyTrainer(), make_transport=own), [], lambda p, r: 0.0)


# --- InFlight ------------------------------------------------------------------------------
def test_an_abort_before_the_send_is_kept_and_a_gated_request_returns_at_once() -> None:
    async def main() -> None:
        flight, gate = InFlight(), PauseGate("t")
        sent: list[list[str]] = []

        async def send(ids: list[str]) -> None:
            sent.append(ids)

        flight.start("a")
        await flight.abort(["a", "unknown"], send, timeout_s=1)  # ends when "a" ends
        assert sent[0] == ["a"] and not await flight.gate(gate, "a")
        flight.end("a")
        flight.start("b")
        gate.pause()
        waiting = asyncio.ensure_future(flight.gate(gate, "b"))
        await asyncio.sleep(0)
        assert not waiting.done()  # waits for the gate
        aborting = asyncio.ensure_future(flight.abort(["b"], send, timeout_s=5))
        assert await waiting is False  # the abort wakes it
        flight.end("b")
        await aborting
        flight.start("c")
        gate.resume()
        assert await flight.gate(gate, "c") is True
        gate.close("closed")
        flight.start("d")
        with pytest.raises(EngineError, match="closed"):
            await flight.gate(gate, "d")

    asyncio.run(main())


def test_an_abort_the_engine_drops_is_sent_again_until_the_request_ends() -> None:
    """The engine ignores the first two aborts (it had not registered the request): the
    third ends it; ``abort`` returns once it ended, and sends nothing for requests gone."""

    async def main() -> None:
        flight = InFlight()
        flight.start("r")
        sends = 0

        async def send(ids: list[str]) -> None:
            nonlocal sends
            sends += 1
            if sends == 3:
                flight.end("r")

        await asyncio.wait_for(flight.abort(["r"], send, timeout_s=30), 30)
        assert sends == 3
        await flight.abort(["r"], send, timeout_s=30)
        assert sends == 3

    asyncio.run(main())


# --- EngineHost ----------------------------------------------------------------------------
class LoopBound:
    """An engine that belongs to the loop it was made on (like vLLM's AsyncLLM)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.weight_version = 0
        self.cancelled = asyncio.Event()

    async def generate(self, request: Any) -> Any:
        assert asyncio.get_running_loop() is self.loop, "called on another loop"
        return threading.current_thread().name

    async def abort(self, request_ids: Sequence[str]) -> None:
        pass

    async def pause(self, mode: Literal["abort", "keep"] = "abort") -> None:
        pass

    async def resume(self) -> None:
        pass

    async def hang(self) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def close(self) -> None:
        self.weight_version = -1


def test_streamed_counts_answer_waits_for_tokens() -> None:
    """``InFlight.wait_for_tokens`` (what a streaming adapter offers as progress evidence,
    e.g. ``VLLMEngine.streamed_tokens``): returns once ``advance`` reports the count (with the
    count then), at once when it is already there, with the final count when the request ends
    first, and refuses an id not in flight."""

    async def main() -> None:
        flight = InFlight()
        flight.start("r", 2)  # a resumed prefix of 2
        assert await flight.wait_for_tokens("r", 1, who="t") == 2
        waiting = asyncio.ensure_future(flight.wait_for_tokens("r", 5, who="t"))
        never = asyncio.ensure_future(flight.wait_for_tokens("r", 99, who="t"))
        await asyncio.sleep(0)
        flight.advance("r", 4)
        await asyncio.sleep(0)
        assert not waiting.done()
        flight.advance("r", 7)  # a delta of 3 tokens
        assert await waiting == 7
        flight.end("r")
        assert await never == 7
        with pytest.raises(EngineError, match="not in flight"):
            await flight.wait_for_tokens("r", 1, who="t")

    asyncio.run(main())


def test_an_engine_host_serves_one_engine_to_every_loop() -> None:
    async def made() -> LoopBound:
        return LoopBound()

    host = EngineHost(made, name="toy")
    proxy = host.proxy()
    try:
        assert isinstance(proxy, InferenceEngine) and isinstance(proxy, SupportsPause)
        assert not isinstance(proxy, SupportsSleep)  # what the engine lacks, the proxy lacks
        for _ in range(2):  # two laws, two loops
            where = asyncio.run(proxy.generate(None))
            assert where.startswith("asyncflow-engine-host")
        proxy.weight_version = 5  # attributes read and written through
        assert host.engine.weight_version == proxy.weight_version == 5

        async def cancel() -> None:
            call = asyncio.ensure_future(proxy.hang())
            await asyncio.sleep(0.01)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call

        asyncio.run(cancel())
        host.run(host.engine.cancelled.wait(), timeout_s=10)  # cancelled on its own loop
    finally:
        host.close()
    assert host.engine.weight_version == -1 and not host._thread.is_alive()


def test_an_engine_host_whose_engine_cannot_be_made_says_why() -> None:
    def broken() -> Any:
        raise ConfigError("no such model")

    with pytest.raises(ConfigError, match="no such model"):
        EngineHost(broken, name="broken")


def test_a_server_url_for_an_engine_that_connects_to_none_is_refused(tmp_path: Any) -> None:
    """``rollout.url`` with an engine that runs here (the digits workload's ``torch``) is an
    error naming the engine that connects, not a setting silently ignored."""
    from asyncflow_core.job import load_run_config, run

    cfg = load_run_config(
        None, ["rollout.url=http://127.0.0.1:9", "rl.steps=1", "task.warmup_steps=0"]
    )
    with pytest.raises(ConfigError, match=r"rollout.url names servers.*'torch'.*'vllm'"):
        asyncio.run(run(cfg, tmp_path / "run"))
    assert not (tmp_path / "run" / "summary.json").exists()
