"""The controller's incremental lease state: every task's candidate mask and per-group row
counts are updated by each change instead of rescanned per lease, and a lease request that
got nothing is answered again without asking the sampler while nothing it can see changed.

Random sequences of puts (new rows in groups, more fields into existing rows, re-tagging),
leases with several samplers, acks, nacks, expiries and a close run on two controllers in
lockstep: one whose samplers declare ``repeatable`` (so the shortcut applies) and one whose
samplers are the same objects behind a wrapper that does not (every request computed in
full). Every answer must be the same, and after every step the incremental state must equal
a recomputation from the row arrays (``Controller.check_incremental_state``).

A task keeps that state only in a partition of at least ``TRACK_MIN_SLOTS`` slots (smaller
ones are scanned per lease); the tests set the bound to 0 (always tracked), to a few slots
(tracking starts and stops as the partition grows and shrinks) and leave it (never tracked
at these sizes), and the answers must not differ."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow_core.contracts.errors import AsyncFlowError
from asyncflow_core.contracts.protocols import (
    BatchMeta,
    Candidates,
    Capacity,
    FieldSchema,
    SampleRequest,
    Scheduler,
    Selection,
    Tags,
)
from asyncflow_core.data import controller as controller_module
from asyncflow_core.data.controller import TRACK_MIN_SLOTS, Controller
from asyncflow_core.data.scheduling import (
    FillView,
    GroupSampler,
    SequentialSampler,
    StalenessSampler,
    cannot_fill_of,
    is_repeatable,
)

FIELDS = ("a", "b", "c")
SCHEMA = FieldSchema("int64", 1)


class _Plain:
    """``inner`` without the ``repeatable`` promise: the controller asks it every time."""

    def __init__(self, inner: Scheduler) -> None:
        self.inner = inner
        self.calls = 0

    def select(self, candidates: Candidates, request: SampleRequest) -> Selection:
        self.calls += 1
        return self.inner.select(candidates, request)


class _Counting:
    """``inner`` with its promises (``repeatable``, and ``cannot_fill`` where ``inner`` makes
    it: the controller then answers a request that cannot be filled without building its
    candidates), counting the calls the controller makes."""

    repeatable = True

    def __init__(self, inner: Scheduler) -> None:
        self.inner = inner
        self.calls = 0
        self.waits = 0

    def cannot_fill(self, view: FillView, request: SampleRequest) -> bool:
        promise = cannot_fill_of(self.inner)
        waits = promise is not None and promise(view, request)
        self.waits += waits
        return waits

    def select(self, candidates: Candidates, request: SampleRequest) -> Selection:
        self.calls += 1
        return self.inner.select(candidates, request)

    @property
    def asked(self) -> int:
        """Requests the controller put to it: ``select`` calls and promised waits."""
        return self.calls + self.waits


class _WholeGroupsOf3:
    """Repeatable: every candidate whose group has 3 live rows (it reads group sizes)."""

    repeatable = True

    def select(self, candidates: Candidates, request: SampleRequest) -> Selection:
        ok = (candidates.groups >= 0) & (candidates.group_sizes == 3)
        return Selection(rows=tuple(int(r) for r in candidates.rows[ok][: request.batch_size]))


# lease requests (task, sampler, fields, batch size, current version): few, so that the same
# request comes again, with and without changes in between
REQUESTS = [
    ("t1", 2, ("a",), 4, 0),
    ("t1", 4, ("a", "b"), 4, 2),
    ("t1", 4, ("a", "b"), 4, 3),
    ("t2", 3, ("b",), 4, 0),
    ("t2", 0, ("a", "c"), 3, 0),
    ("t2", 5, ("c",), 2, 1),
    ("t1", 6, ("a",), 6, 0),
]
SAMPLERS: list[Scheduler] = [
    SequentialSampler(),
    SequentialSampler(greedy=True),
    GroupSampler(2),
    GroupSampler(2, greedy=True),
    StalenessSampler(1, "drop", GroupSampler(2), whole_groups=True),
    StalenessSampler(0, "hold", SequentialSampler()),
    _WholeGroupsOf3(),
]

op = st.one_of(
    st.tuples(st.just("new"), st.integers(1, 4), st.integers(0, 9), st.integers(0, 3),
              st.sets(st.sampled_from(FIELDS), min_size=1)),
    st.tuples(st.just("fill"), st.integers(0, 40), st.sampled_from(FIELDS), st.integers(0, 4)),
    st.tuples(st.just("lease"), st.integers(0, len(REQUESTS) - 1)),
    st.tuples(st.just("ack"), st.integers(0, 20)),
    st.tuples(st.just("nack"), st.integers(0, 20)),
    st.tuples(st.just("tick"), st.floats(0.0, 3.0)),
    st.tuples(st.just("close")),
)  # fmt: skip


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _world(wrap: type[Any]) -> tuple[Controller, _Clock, list[Any]]:
    clock = _Clock()
    ctl = Controller(clock=clock)
    ctl.create_partition("p", FIELDS, Capacity(max_rows=64), tasks=["t1", "t2"])
    return ctl, clock, [wrap(s) for s in SAMPLERS]


def _do(
    ctl: Controller, clock: _Clock, samplers: list[Any], held: list[BatchMeta], step: Any, i: int
) -> Any:
    """Apply step number ``i``; its outcome as plain data (an error's type, a lease's rows).
    New rows go to group 0..5, or (6..9) a group of their own."""
    kind = step[0]
    try:
        if kind == "new":
            n, group, version, fields = step[1], step[2], step[3], sorted(step[4])
            group = group if group < 6 else 1000 + i
            ticket = ctl.begin_put(
                "p", dict.fromkeys(fields, SCHEMA), {f: [8] * n for f in fields}, n,
                tags=[Tags(group=group, versions=(version,), tokens=3)] * n,
            )  # fmt: skip
            if ticket is None:
                return "full"
            ctl.commit_put(ticket)
            return ticket.rows
        if kind == "fill":
            row, field, group = step[1], step[2], step[3]
            # a new version (and, for 0..1, a group: a row may move to another)
            tags = Tags(group=group if group < 2 else None, versions=(group,))
            ticket = ctl.begin_put("p", {field: SCHEMA}, {field: [8]}, 1, rows=[row], tags=[tags])
            assert ticket is not None
            ctl.commit_put(ticket)
            return ticket.rows
        if kind == "lease":
            task, which, fields, batch, version = REQUESTS[step[1]]
            meta = ctl.try_get_meta(
                "p", task, sorted(fields), batch, samplers[which], lease_s=2.0,
                current_version=version,
            )  # fmt: skip
            if meta is None:
                return None
            if meta.rows:
                held.append(meta)
            return (meta.rows, meta.end_of_stream)
        if kind in ("ack", "nack"):
            if not held:
                return "none held"
            meta = held.pop(step[1] % len(held))
            (ctl.ack if kind == "ack" else ctl.nack)(meta)
            return meta.rows
        if kind == "tick":
            clock.t += step[1]
            return ctl.expire_leases()
        ctl.close("p")
        return "closed"
    except AsyncFlowError as e:
        return type(e).__name__


@contextmanager
def _track_min(slots: int) -> Iterator[None]:
    saved = controller_module.TRACK_MIN_SLOTS
    controller_module.TRACK_MIN_SLOTS = slots
    try:
        yield
    finally:
        controller_module.TRACK_MIN_SLOTS = saved


@pytest.fixture
def always_track() -> Iterator[None]:
    """Incremental state in every partition, however small."""
    with _track_min(0):
        yield


@pytest.mark.parametrize("track_min", [0, 16, TRACK_MIN_SLOTS])
@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(steps=st.lists(op, min_size=1, max_size=80))
def test_incremental_state_and_idle_answers_match_a_full_computation(
    track_min: int, steps: list[Any]
) -> None:
    with _track_min(track_min):
        _check_steps(steps)


def _check_steps(steps: list[Any]) -> None:
    fast, fast_clock, fast_samplers = _world(_Counting)
    full, full_clock, full_samplers = _world(_Plain)
    fast_held: list[BatchMeta] = []
    full_held: list[BatchMeta] = []
    for i, step in enumerate(steps):
        got = _do(fast, fast_clock, fast_samplers, fast_held, step, i)
        want = _do(full, full_clock, full_samplers, full_held, step, i)
        assert got == want, step
        assert fast.stats("p") == full.stats("p"), step
        fast.check_incremental_state()
        full.check_incremental_state()
    # the shortcut never asks more often than the full computation
    assert sum(s.asked for s in fast_samplers) <= sum(s.calls for s in full_samplers)


@pytest.mark.usefixtures("always_track")
def test_an_idle_request_is_not_asked_again_until_something_it_sees_changes() -> None:
    ctl, _, _ = _world(_Counting)
    sampler = _Counting(GroupSampler(2))

    def lease(task: str = "t1", fields: tuple[str, ...] = ("a",)) -> BatchMeta | None:
        return ctl.try_get_meta("p", task, list(fields), 4, sampler, lease_s=5.0)

    def put(fields: list[str], n: int, group: int) -> tuple[int, ...]:
        ticket = ctl.begin_put(
            "p", dict.fromkeys(fields, SCHEMA), {f: [8] * n for f in fields}, n,
            tags=[Tags(group=group)] * n,
        )  # fmt: skip
        assert ticket is not None
        ctl.commit_put(ticket)
        return ticket.rows

    put(["a"], 2, group=0)
    assert lease() is None and sampler.asked == 1  # one group of 2: not a batch of 4 yet
    assert lease() is None and sampler.asked == 1  # nothing changed: not asked again
    put(["b"], 2, group=1)  # a field task t1 does not read, in a new group
    assert lease() is None and sampler.asked == 1
    meta = ctl.try_get_meta("p", "t2", ["b"], 2, SequentialSampler(), lease_s=5.0)
    assert meta is not None and meta.rows  # another task's lease
    assert lease() is None and sampler.asked == 1
    assert lease(fields=("a", "c")) is None and sampler.asked == 2  # another request: asked
    assert lease() is None and sampler.asked == 3
    rows = put(["a"], 2, group=2)  # a candidate arrives
    got = lease()
    assert sampler.asked == 4 and got is not None and set(got.rows) == {0, 1, *rows}
    ctl.check_incremental_state()


@pytest.mark.usefixtures("always_track")
def test_an_idle_request_is_asked_again_when_a_candidate_group_grows() -> None:
    ctl, _, _ = _world(_Counting)
    sampler = _Counting(_WholeGroupsOf3())

    def put(fields: list[str], n: int, group: int) -> None:
        ticket = ctl.begin_put(
            "p", dict.fromkeys(fields, SCHEMA), {f: [8] * n for f in fields}, n,
            tags=[Tags(group=group)] * n,
        )  # fmt: skip
        assert ticket is not None
        ctl.commit_put(ticket)

    put(["a"], 2, group=7)
    assert ctl.try_get_meta("p", "t1", ["a"], 8, sampler, lease_s=5.0) is None
    put(["b"], 1, group=7)  # not a candidate itself, but its group now has 3 rows
    meta = ctl.try_get_meta("p", "t1", ["a"], 8, sampler, lease_s=5.0)
    assert sampler.asked == 2 and meta is not None and meta.rows == (0, 1)
    ctl.check_incremental_state()


def test_samplers_declare_repeatable_only_where_select_is_a_function_of_its_arguments() -> None:
    assert is_repeatable(SequentialSampler()) and is_repeatable(GroupSampler(2))
    assert is_repeatable(StalenessSampler(1, "drop", GroupSampler(2)))
    assert not is_repeatable(StalenessSampler(1, "drop", _Plain(GroupSampler(2))))
    assert not is_repeatable(_Plain(SequentialSampler()))

    class Stateful(GroupSampler):  # overrides select without restating the promise
        def select(self, candidates: Candidates, request: SampleRequest) -> Selection:
            return super().select(candidates, request)

    assert not is_repeatable(Stateful(2))


@pytest.mark.usefixtures("always_track")
def test_candidate_state_survives_compaction_and_growth() -> None:
    ctl = Controller()
    ctl.create_partition("p", ["a"], Capacity(max_rows=200), tasks=["t"])
    sampler = SequentialSampler(greedy=True)
    for round_ in range(6):
        tags = [Tags(group=round_ * 100 + i // 5) for i in range(50)]
        ticket = ctl.begin_put("p", {"a": SCHEMA}, {"a": [8] * 50}, 50, tags=tags)
        assert ticket is not None
        ctl.commit_put(ticket)
        meta = ctl.try_get_meta("p", "t", ["a"], 45, sampler, lease_s=5.0)
        assert meta is not None and len(meta.rows) == 45
        ctl.ack(meta)
        ctl.check_incremental_state()
    left = ctl.try_get_meta("p", "t", ["a"], 100, sampler, lease_s=5.0)
    assert left is not None and len(left.rows) == 6 * 5
    assert np.all(np.diff(left.rows) > 0)


def test_a_small_partition_keeps_no_incremental_state_and_a_large_one_does() -> None:
    """Below ``TRACK_MIN_SLOTS`` a lease scans (no per-change bookkeeping); once the
    partition grows past it the task tracks, and stops again when it shrank to a quarter."""
    ctl = Controller()
    n = TRACK_MIN_SLOTS
    ctl.create_partition("p", ["a"], tasks=["t"])
    sampler = SequentialSampler(greedy=True)
    state = ctl._parts["p"].tasks["t"]

    def put(k: int) -> None:
        ticket = ctl.begin_put("p", {"a": SCHEMA}, {"a": [8] * k}, k, tags=[Tags(group=1)] * k)
        assert ticket is not None
        ctl.commit_put(ticket)

    def take(k: int) -> None:
        meta = ctl.try_get_meta("p", "t", ["a"], k, sampler, lease_s=5.0)
        assert meta is not None and len(meta.rows) == k
        ctl.ack(meta)
        ctl.check_incremental_state()

    put(8)
    take(4)
    assert state.cand is None and state.gcount is None
    put(n)
    take(4)  # the lease that finds the partition large starts tracking
    assert state.cand is not None
    take(n)  # every row consumed: reclaimed; the arrays compact when a put needs room
    part = ctl._parts["p"]
    for _ in range(1000):
        put(64)
        take(64)  # a lease in the shrunken partition stops tracking
        if part.used < n // 4:
            break
    assert part.used < n // 4
    assert state.cand is None and state.gcount is None


@pytest.mark.usefixtures("always_track")
def test_a_request_that_cannot_be_filled_is_answered_without_its_candidates_but_drops_stale() -> (
    None
):
    """The update's case: a batch far larger than the rows there are. The sampler's promise
    (``cannot_fill``) answers without building candidates, but never where a row is stale:
    those are still dropped while the consumer waits, as the full computation drops them."""
    ctl, _, _ = _world(_Counting)
    sampler = _Counting(StalenessSampler(1, "drop", GroupSampler(2), whole_groups=True))

    def put(n: int, group: int, version: int) -> None:
        ticket = ctl.begin_put(
            "p", {"a": SCHEMA}, {"a": [8] * n}, n,
            tags=[Tags(group=group, versions=(version,))] * n,
        )  # fmt: skip
        assert ticket is not None
        ctl.commit_put(ticket)

    def lease(version: int) -> BatchMeta | None:
        return ctl.try_get_meta("p", "t1", ["a"], 8, sampler, lease_s=5.0, current_version=version)

    put(2, group=0, version=0)
    put(2, group=1, version=2)
    assert lease(1) is None and (sampler.waits, sampler.calls) == (1, 0)  # not stale: waits
    assert ctl.stats("p").dropped["t1"] == 0
    put(2, group=2, version=2)
    assert lease(2) is None and (sampler.waits, sampler.calls) == (1, 1)  # group 0 is stale
    assert ctl.stats("p").dropped["t1"] == 2  # and dropped, as select drops it
    # the rows holding the version floor down are gone: the next answer looks closer once,
    # raises the floor, and waits without a look after that
    part = ctl._parts["p"]
    other = ctl.try_get_meta("p", "t2", ["a"], 2, SequentialSampler(), lease_s=5.0)
    assert other is not None and other.rows == (0, 1)
    ctl.ack(other)  # every task is done with group 0: its rows are gone
    assert part.version_floor() == 0
    put(2, group=3, version=3)
    assert lease(3) is None and sampler.waits == 2 and part.version_floor() == 2
    put(2, group=4, version=3)  # 4 groups: a full batch of 8 rows
    got = lease(3)
    assert got is not None and len(got.rows) == 8 and sampler.calls == 2
    ctl.check_incremental_state()
