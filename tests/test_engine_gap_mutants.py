"""Mutants for the laws of conformance/PROMISES.md's gaps (issue #42), in the pattern of
tests/test_mutants.py: each is one bug of a shipped engine (the process host, the reference
engines) that no earlier law failed, and the test checks that the suite fails it on the new
law, with a message that says what to fix. The unbroken engines pass these laws
(tests/test_engine_conformance.py, tests/test_engine_pair.py).

- a lost engine (PR93, PR94, AD66): ``test_a_lost_engine_fails_every_call_until_restart``,
  ``test_a_lost_trainer_fails_every_call``;
- greedy log-probs with a filter set (LP8): ``test_logprobs_agree_after_a_sync[greedy-top_k=4]``;
- a temperature below 1e-6 (LP19): ``test_logprobs_match_the_sampling_distribution[t1e-7]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import pickle
import re
from collections.abc import Callable
from typing import Any

import pytest
import test_engine_conformance as shipped
import torch
from asyncflow_conformance.engines import LOGPROB_SETTINGS
from asyncflow_conformance.pair import PAIR_SETTINGS
from asyncflow_reference.engines import TorchInferenceEngine, TorchTrainEngine
from test_lost_worker import Restartable
from test_mutants import Mutant, inference_suite, pair_suite
from torch import Tensor

from asyncflow_core.contracts.errors import EngineError, EngineLostError
from asyncflow_core.engines.lmtrain import TokenRows
from asyncflow_core.engines.process import (
    ProcessInferenceEngine,
    ProcessTrainEngine,
    _ProcessEngine,
)
from asyncflow_core.training.sampling import filter_logits

LOST_LAW = "test_a_lost_engine_fails_every_call_until_restart"
LOST_TRAINER_LAW = "test_a_lost_trainer_fails_every_call"
PAIR_LAW = "test_logprobs_agree_after_a_sync"
LOGPROB_LAW = "test_logprobs_match_the_sampling_distribution"
PAIR_SETTING = dict(PAIR_SETTINGS)
LOGPROB_SETTING = dict(LOGPROB_SETTINGS)


# --------------------------------------------------------------------------------------------
# A lost engine: the process host's reader, its errors, a restart
# --------------------------------------------------------------------------------------------
def _reader(*, fail_pending: bool, error: type[EngineError]) -> Callable[[Any], None]:
    """``_ProcessEngine._read`` with one bug: on the child's death it leaves the calls in
    flight waiting (``fail_pending=False``), or fails them with ``error`` in place of
    ``EngineLostError``."""

    def _read(self: Any) -> None:
        while True:
            try:
                call_id, kind, payload, version = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            with self._lock:
                call = self._calls.get(call_id)
            if call is None:
                continue
            with contextlib.suppress(RuntimeError):
                call.loop.call_soon_threadsafe(self._deliver, call, kind, payload, version)
        self._process.join(1.0)
        if not self._closed:
            self._dead = self._exit_reason()
        with self._lock:
            pending, self._calls = list(self._calls.values()), {}
        lost = error(f"{self.name}: {self._dead}")
        for call in pending if fail_pending else ():
            with contextlib.suppress(RuntimeError):
                call.loop.call_soon_threadsafe(call.deliver, "err", lost)

    return _read


class InFlightCallsHang(ProcessInferenceEngine):
    """The reader's exit path without ``for call in pending: ... call.deliver(_ERR, error)``:
    the calls in flight when the child dies wait forever."""

    _read = _reader(fail_pending=False, error=EngineLostError)


class LostAsEngineError(ProcessInferenceEngine):
    """``error = EngineLostError(...)`` -> ``EngineError(...)`` on the reader's exit path: an
    RL job stops instead of routing the requests to the other engines."""

    _read = _reader(fail_pending=True, error=EngineError)


class TrainerCallsHang(ProcessTrainEngine):
    _read = _reader(fail_pending=False, error=EngineLostError)


class TrainerLostAsEngineError(ProcessTrainEngine):
    _read = _reader(fail_pending=True, error=EngineError)


def _says_closed(self: Any, method: str) -> None:
    """``_check_open`` reporting a dead child as a closed engine (``EngineError``)."""
    if self._closed or self._dead is not None:
        raise EngineError(f"{self.name}: {method} after close(); build a new engine")


class TrainerDeadSaysClosed(ProcessTrainEngine):
    """Later calls on a dead trainer raise ``EngineError`` ("after close()"), not
    ``EngineLostError``: the job cannot tell a lost trainer from a misuse."""

    _check_open = _says_closed


class RestartKeepsTheVersion(Restartable):
    """``restart()`` gives the fresh engine the lost one's version number (so the job "need
    not reload"): it reports a version whose weights it does not hold."""

    async def restart(self) -> None:
        version = self.weight_version
        await super().restart()
        await self.engine.load_weights([], version)


class RestartOnlyClearsTheFlag(Restartable):
    """``restart()`` clears ``lost`` without bringing a new worker up."""

    async def restart(self) -> None:
        self._lost = False


def _factory() -> Any:
    return functools.partial(TorchInferenceEngine, shipped.TORCH_MODEL, max_batch=8, seed=0)


def lost_inference_suite(make: Callable[[], Any], hang_s: float = 2.0) -> Any:
    class Suite(shipped.TestProcessInferenceEngine):
        timeout_s = hang_s  # a hang is the bug: fail it in seconds
        real_timeout_s = 60.0

        def make_engine(self) -> Any:
            return make()

    return Suite()


def lost_train_suite(proxy: type[ProcessTrainEngine], hang_s: float = 2.0) -> Any:
    class Suite(shipped.TestProcessTrainEngine):
        timeout_s = hang_s
        real_timeout_s = 60.0

        def make_engine(self) -> ProcessTrainEngine:
            return proxy(
                functools.partial(
                    TorchTrainEngine, shipped.TORCH_MODEL, micro_batch_size=2, seed=0, threads=1
                )
            )

    return Suite()


def _process(proxy: type[_ProcessEngine]) -> Callable[[], Any]:
    return lambda: proxy(_factory(), threads=1)


# --------------------------------------------------------------------------------------------
# Greedy log-probs with a filter set (LP8), a near-zero temperature (LP19)
# --------------------------------------------------------------------------------------------
def _greedy_at_one(temp: Tensor) -> Tensor:
    return torch.where(temp == 0, torch.ones_like(temp), temp)


class GreedyFilteredLikeSampled(TorchInferenceEngine):
    """In ``_sample``, ``self._filter(logits, temp, ...)`` -> ``self._filter(logits,
    torch.where(greedy, 1.0, temp), ...)``: a greedy request's log-probs renormalised over its
    top-k (the argmax is still decoded)."""

    def _filter(self, logits: Tensor, temp: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
        return filter_logits(logits, _greedy_at_one(temp), top_k, top_p)


class TrainerFiltersGreedyRows(TorchTrainEngine):
    """The trainer scores a greedy row (temperature 0) at temperature 1 with the row's
    top-k/top-p: it renormalises greedy log-probs that the engine reports unfiltered."""

    def _prepare(self, batch: Any) -> TokenRows:
        rows = super()._prepare(batch)
        return dataclasses.replace(rows, temperature=_greedy_at_one(rows.temperature))


class TinyTemperatureGreedyAtOne(TorchInferenceEngine):
    """A temperature below 1e-6 decoded greedily and reported at temperature 1 (SGLang's
    behaviour): ``greedy = temp == 0`` -> ``greedy = temp < 1e-6``, with greedy's report."""

    def _sample(self, idx: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
        temp = self._temp[idx]
        self._temp[idx] = torch.where(temp < 1e-6, torch.zeros_like(temp), temp)
        try:
            return super()._sample(idx, logits)
        finally:
            self._temp[idx] = temp


GAP_MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "lost-inflight-calls-hang",
        lambda: lost_inference_suite(_process(InFlightCallsHang)),
        LOST_LAW,
        r"generate\('lost-0'\), in flight at the loss, did not return within",
    ),
    Mutant(
        "lost-reported-as-engine-error",
        lambda: lost_inference_suite(_process(LostAsEngineError)),
        LOST_LAW,
        r"in flight at the loss, raised EngineError: .*raise .*EngineLostError",
    ),
    Mutant(
        "lost-restart-keeps-the-version",
        lambda: lost_inference_suite(lambda: RestartKeepsTheVersion(_factory())),
        LOST_LAW,
        r"after restart\(\) weight_version is 1, but a fresh engine's is 0",
    ),
    Mutant(
        "lost-restart-only-clears-the-flag",
        lambda: lost_inference_suite(lambda: RestartOnlyClearsTheFlag(_factory())),
        LOST_LAW,
        # the dead proxy's version is the first sign; generate() on it would raise next
        r"weight_version is 1, but a fresh engine's is 0|generate\(\) then raised EngineLost",
    ),
    Mutant(
        "lost-trainer-inflight-step-hangs",
        lambda: lost_train_suite(TrainerCallsHang),
        LOST_TRAINER_LAW,
        r"train_step\(\), in flight at the loss, did not return within",
    ),
    Mutant(
        "lost-trainer-reported-as-engine-error",
        lambda: lost_train_suite(TrainerLostAsEngineError),
        LOST_TRAINER_LAW,
        r"train_step\(\), in flight at the loss, raised EngineError",
    ),
    Mutant(
        "lost-trainer-dead-says-closed",
        lambda: lost_train_suite(TrainerDeadSaysClosed),
        LOST_TRAINER_LAW,
        r"after the trainer was lost, raised EngineError: .*after close\(\)",
    ),
    Mutant(
        "greedy-filtered-like-sampled",
        lambda: pair_suite(engine_cls=GreedyFilteredLikeSampled),
        PAIR_LAW,
        r"\[greedy-top_k=4\].*match the trainer's at temperature 1 with the request's top-k",
        ("greedy-top_k=4", PAIR_SETTING["greedy-top_k=4"]),
        margin=True,
    ),
    Mutant(
        "greedy-rows-filtered-by-the-trainer",
        lambda: pair_suite(trainer_cls=TrainerFiltersGreedyRows),
        PAIR_LAW,
        r"\[greedy-top_k=4\].*differ",
        ("greedy-top_k=4", PAIR_SETTING["greedy-top_k=4"]),
        margin=True,
    ),
    Mutant(
        "tiny-temperature-greedy-at-one",
        lambda: inference_suite(TinyTemperatureGreedyAtOne),
        LOGPROB_LAW,
        r"\[t1e-7\] at temperature 1e-07 the engine reported probabilities",
        ("t1e-7", LOGPROB_SETTING["t1e-7"]),
    ),
)


@pytest.mark.parametrize("mutant", GAP_MUTANTS, ids=[m.id for m in GAP_MUTANTS])
def test_the_gap_law_fails_the_mutant(mutant: Mutant) -> None:
    suite = mutant.make_suite()
    law = getattr(suite, mutant.law)
    with pytest.raises(AssertionError) as failure:
        law() if mutant.arg is None else law(mutant.arg)
    message = str(failure.value)
    assert re.search(mutant.message, message, re.S), message
    if mutant.margin:
        found = re.search(r"mean \|difference\| ([0-9.e+-]+|inf)", message)
        assert found, message
        assert float(found.group(1)) >= 10 * suite.logprob_atol, message


def test_the_unbroken_engines_pass_the_gap_laws_in_the_mutants_settings() -> None:
    """Control: the same suites on the unbroken engines pass (so each mutant fails on its
    bug, not on the suite's settings; a correct engine gets 30 s where a hang is the bug)."""
    for make in (
        _process(ProcessInferenceEngine),
        lambda: Restartable(_factory(), restarts=None),
    ):
        lost_inference_suite(make, hang_s=30.0).test_a_lost_engine_fails_every_call_until_restart()
    lost_train_suite(ProcessTrainEngine, hang_s=30.0).test_a_lost_trainer_fails_every_call()
    pair_suite().test_logprobs_agree_after_a_sync(
        ("greedy-top_k=4", PAIR_SETTING["greedy-top_k=4"])
    )
    inference_suite(TorchInferenceEngine).test_logprobs_match_the_sampling_distribution(
        ("t1e-7", LOGPROB_SETTING["t1e-7"])
    )
