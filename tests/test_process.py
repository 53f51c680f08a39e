"""ProcessTrainEngine (asyncflow_core.engines.process): the same results as the engine in this
process,
clear errors that lose nothing, and no child process left behind. The protocol laws run in
tests/test_engine_conformance.py (TestProcessTrainEngine)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import signal
from pathlib import Path

import pytest
import torch
from asyncflow_conformance.engines import padded_batch
from asyncflow_reference.engines import TorchTrainEngine
from asyncflow_reference.model import ModelConfig

from asyncflow_core.contracts.errors import ConfigError, EngineError, EngineLostError
from asyncflow_core.contracts.protocols import Batch
from asyncflow_core.engines.process import ProcessTrainEngine
from asyncflow_core.training.rl import PPOClipLoss, policy_gradient_loss

MODEL = ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, max_seq_len=64)
make = functools.partial(TorchTrainEngine, MODEL, micro_batch_size=2, seed=3, threads=1)


def batch() -> Batch:
    return padded_batch(
        prompts=[[1, 2, 3], [4, 5], [6]],
        responses=[[7, 8], [9, 10, 11], [12]],
        advantages=[1.0, -0.5, 0.25],
    )


def failing_factory() -> TorchTrainEngine:
    raise ValueError("no such model: 'tiny-9000'")


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_same_results_as_the_engine_in_this_process(tmp_path: Path) -> None:
    async def body() -> None:
        local = make()
        remote = ProcessTrainEngine(make)
        try:
            assert remote.weight_version == 0 and remote.engine_type == "TorchTrainEngine"
            b = batch()
            assert torch.equal(await remote.compute_logprobs(b), await local.compute_logprobs(b))
            loss = PPOClipLoss(clip_low=0.2)
            old = torch.tensor([[-1.0, -2.0, 0.0], [-1.5, -0.5, -3.0], [-2.0, 0.0, 0.0]])
            b = dataclasses.replace(b, data={**b.data, "logprobs": old})
            for _ in range(2):
                m_local = await local.train_step(b, loss)
                m_remote = await remote.train_step(b, loss)
                assert m_remote == m_local
            assert remote.weight_version == 2
            mine = [(n, t) async for bucket in local.export_weights(4096) for n, t in bucket]
            theirs = [(n, t) async for bucket in remote.export_weights(4096) for n, t in bucket]
            assert [n for n, _ in mine] == [n for n, _ in theirs]
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(mine, theirs, strict=True))
            # checkpoints go through the child's engine; the proxy's version follows a load
            await remote.save_checkpoint(str(tmp_path / "ckpt"))
            await remote.train_step(b, policy_gradient_loss)
            assert remote.weight_version == 3
            await remote.load_checkpoint(str(tmp_path / "ckpt"))
            assert remote.weight_version == 2
        finally:
            await remote.close()
            await local.close()

    run(body())


def test_unpicklable_loss_is_refused_and_changes_nothing() -> None:
    async def body() -> None:
        engine = ProcessTrainEngine(make)
        try:
            before = await engine.compute_logprobs(batch())
            with pytest.raises(EngineError, match=r"train_step .* cannot be pickled.*not a lambda"):
                await engine.train_step(batch(), lambda lp, b: (lp.sum(), {}))
            assert engine.weight_version == 0
            assert torch.equal(await engine.compute_logprobs(batch()), before)
            # the engine's own errors come back as they were raised, with the child's traceback
            with pytest.raises(EngineError, match="is not readable") as info:
                await engine.load_checkpoint("/nonexistent/ckpt")
            assert any("raised in engine process" in note for note in info.value.__notes__)
            assert engine.weight_version == 0
        finally:
            await engine.close()

    run(body())


def test_bad_factories_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="cannot be pickled"):
        ProcessTrainEngine(lambda: make())
    with pytest.raises(ConfigError, match="factory must be callable"):
        ProcessTrainEngine("TorchTrainEngine")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="threads must be None or >= 1"):
        ProcessTrainEngine(make, threads=0)
    with pytest.raises(ConfigError, match="start_method 'teleport' is not available"):
        ProcessTrainEngine(make, start_method="teleport")
    with pytest.raises(EngineError, match="building the engine in its process failed") as info:
        ProcessTrainEngine(failing_factory)
    assert isinstance(info.value.__cause__, ValueError)
    assert "tiny-9000" in str(info.value.__cause__)


def test_a_dead_child_fails_calls_clearly() -> None:
    async def body() -> None:
        engine = ProcessTrainEngine(make)
        assert engine.pid is not None
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(EngineLostError, match="exited with code -9"):
            for _ in range(100):  # the reader (or the next send) notices the pipe closing
                await engine.compute_logprobs(batch())
                await asyncio.sleep(0.05)
        with pytest.raises(EngineLostError, match=r"exited with code -9: killed by SIGKILL"):
            await engine.train_step(batch(), policy_gradient_loss)
        await engine.close()  # still closes cleanly

    run(body())


class _HangingClose(TorchTrainEngine):
    """An engine whose close never returns."""

    async def close(self) -> None:
        await asyncio.Event().wait()


def hanging_close_factory() -> TorchTrainEngine:
    return _HangingClose(MODEL, seed=3, threads=1)


def test_close_kills_a_child_that_does_not_finish(caplog: pytest.LogCaptureFixture) -> None:
    """A child whose engine never closes is killed after ``stop_timeout_s``: close() returns,
    no process is left, the engine is closed, and the warning names it."""

    async def body() -> None:
        engine = ProcessTrainEngine(hanging_close_factory, name="stuck")
        engine.stop_timeout_s = 0.5
        process = engine._process
        with caplog.at_level("WARNING", logger="asyncflow.process"):
            await engine.close()
        assert not process.is_alive()
        assert "closed" in repr(engine)
        assert "stuck: its process did not finish" in caplog.text

    run(body())


def test_close_is_idempotent_and_leaves_no_process() -> None:
    async def body() -> None:
        engine = ProcessTrainEngine(make)
        process = engine._process
        await engine.close()
        await engine.close()
        assert not process.is_alive()
        assert "closed" in repr(engine)
        with pytest.raises(EngineError, match="after close"):
            await engine.compute_logprobs(batch())

    run(body())
