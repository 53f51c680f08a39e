"""Admission control: the exact bound, waiting and waking, bad input, and the staleness law
(no trained sample more than η versions stale) on random long-tailed schedules."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow_core.contracts.errors import BadRequestError, StoreTimeoutError
from asyncflow_core.flow.staleness import AdmissionController


def test_the_bound_is_exact() -> None:
    ctl = AdmissionController(batch_size=4, staleness=1)
    assert ctl.capacity() == 8  # (0 + 1 + 1) * 4
    assert ctl.try_admit(8) == 0
    assert ctl.try_admit(1) is None
    ctl.finish(8)
    assert ctl.capacity() == 0  # accepted samples still count until the trainer steps
    ctl.set_version(1)
    assert ctl.capacity() == 4 and ctl.try_admit(4) == 1


def test_on_policy_waits_for_every_step() -> None:
    ctl = AdmissionController(batch_size=2, staleness=0)
    assert ctl.try_admit(2) == 0 and ctl.try_admit(1) is None
    ctl.finish(2)
    assert ctl.try_admit(1) is None
    ctl.set_version(1)
    assert ctl.try_admit(2) == 1


def test_max_running_caps_concurrency() -> None:
    ctl = AdmissionController(batch_size=8, staleness=4, max_running=3)
    assert ctl.try_admit(3) == 0 and ctl.try_admit(1) is None
    ctl.cancel(1)
    assert ctl.stats().cancelled == 1 and ctl.try_admit(1) == 0


def test_admit_waits_and_wakes_from_another_thread() -> None:
    ctl = AdmissionController(batch_size=1, staleness=0)

    async def go() -> float:
        assert await ctl.admit() == 0
        ctl.finish()
        threading.Timer(0.1, ctl.set_version, args=(1,)).start()
        t0 = time.monotonic()
        assert await ctl.admit(timeout=5) == 1
        return time.monotonic() - t0

    assert 0.05 < asyncio.run(go()) < 2


def test_admit_timeout_admits_nothing() -> None:
    ctl = AdmissionController(batch_size=1, staleness=0)

    async def go() -> None:
        await ctl.admit()
        with pytest.raises(StoreTimeoutError, match="trainer is at version 0"):
            await ctl.admit(timeout=0.05)

    asyncio.run(go())
    assert ctl.stats().running == 1


def test_bad_input_is_rejected_and_changes_nothing() -> None:
    with pytest.raises(BadRequestError, match="staleness"):
        AdmissionController(batch_size=4, staleness=-1)
    with pytest.raises(BadRequestError, match="batch_size"):
        AdmissionController(batch_size=0, staleness=1)
    ctl = AdmissionController(batch_size=2, staleness=1)
    ctl.try_admit(2)
    ctl.set_version(3)
    before = ctl.stats()
    with pytest.raises(BadRequestError, match="only 2 are running"):
        ctl.finish(3)
    with pytest.raises(BadRequestError, match="went back from 3 to 2"):
        ctl.set_version(2)
    with pytest.raises(BadRequestError, match="n must be an int >= 1"):
        ctl.try_admit(0)
    with pytest.raises(BadRequestError, match="only 0 were accepted"):
        ctl.discard(1)
    assert ctl.stats() == before


def _simulate(batch: int, eta: int, lengths: list[int], drop_stale: bool) -> tuple[list[int], int]:
    """Discrete-time rollout/trainer loop. Each tick: admit what the bound allows (sample i
    takes lengths[i % len] ticks to generate), finish what is due, and train one batch when
    enough samples are ready (first finished first). Returns the staleness of every trained
    sample and the number of batches trained."""
    ctl = AdmissionController(batch, eta)
    running: list[tuple[int, int]] = []  # (done_at, admitted_version)
    ready: list[int] = []  # admitted versions of finished, untrained samples
    trained: list[int] = []
    admitted = 0
    target = 12 * batch
    for tick in range(10_000):
        while admitted < target and (v := ctl.try_admit(1)) is not None:
            running.append((tick + lengths[admitted % len(lengths)], v))
            admitted += 1
        for item in [r for r in running if r[0] <= tick]:
            running.remove(item)
            ctl.finish(1)
            ready.append(item[1])
        version = ctl.stats().version
        if drop_stale:
            fresh = [v for v in ready if version - v <= eta]
            if len(fresh) < len(ready):
                ctl.discard(len(ready) - len(fresh))
            ready = fresh
        if len(ready) >= batch:
            trained += [version - v for v in ready[:batch]]
            ready = ready[batch:]
            ctl.set_version(version + 1)
        if len(trained) >= target - batch or (
            admitted == target and not running and len(ready) < batch
        ):
            break
    return trained, ctl.stats().version


@settings(max_examples=150, deadline=None)
@given(
    batch=st.integers(1, 6),
    eta=st.integers(0, 3),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=12),
)
def test_staleness_law_with_a_stale_filter_at_the_trainer(
    batch: int, eta: int, lengths: list[int]
) -> None:
    trained, steps = _simulate(batch, eta, lengths, drop_stale=True)
    assert all(0 <= s <= eta for s in trained)
    assert steps >= 1  # dropping never starves training (discard gives capacity back)


def test_admission_alone_bounds_in_order_training_but_not_long_tails() -> None:
    # every sample equally long: training order == admission order, so staleness <= η
    trained, _ = _simulate(batch=4, eta=1, lengths=[5], drop_stale=False)
    assert trained and max(trained) <= 1
    # one very long sample in each group of 8: it is trained later than its number says
    trained, _ = _simulate(batch=4, eta=1, lengths=[60, 1, 1, 1, 1, 1, 1, 1], drop_stale=False)
    assert max(trained) > 1  # why StalenessSampler(max_lag=η) (or partial rollout) is needed
