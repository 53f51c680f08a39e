"""Fuzzing the in-process DataStore's public calls with malformed arguments (Hypothesis).

Every example builds a fresh store holding a few rows (one leased), makes one call whose
arguments are drawn from bad partitions, fields, rows, tags, tensors of odd dtypes and shapes,
NaN, huge and negative numbers and wrong types, and checks the contract: the call either
succeeds or raises a ``DataStoreError`` (``asyncflow_core.contracts.errors``), and a call that
raised left the store as it was (every storage unit's cells, object for object, and every
partition's counters). No call may wait: timeouts are drawn from values that never block.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from asyncflow_core.contracts.errors import DataStoreError
from asyncflow_core.contracts.protocols import BatchMeta, Capacity, Tags
from asyncflow_core.data.store import InProcessDataStore

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# --- strategies ----------------------------------------------------------------------------
def mostly(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a well-formed value, so that a call gets past its first check to the deeper
    ones; else a bad one (not on the ends of the range: Hypothesis draws those often)."""
    return st.integers(0, 9).flatmap(lambda i: bad if 3 <= i <= 5 else good)


HUGE = [2**63, -(2**63) - 1, 2**70, -1, -(2**31)]
weird_numbers = st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308, *HUGE])
wrong_types = st.sampled_from([None, "x", b"x", [], {}, (1,), {1}, object(), 1.5, True])
names = st.one_of(
    st.sampled_from(["p", "q", "nope", "", "a", "t"]), st.text(max_size=4), wrong_types
)
bad_fields = st.one_of(
    st.lists(st.sampled_from(["a", "b", "c", ""]) | wrong_types, max_size=3),
    st.sampled_from(["a", "ab", ""]),
    wrong_types,
)
fields = mostly(st.lists(st.sampled_from(["a", "b"]), min_size=1, max_size=2, unique=True),
                bad_fields)  # fmt: skip
DTYPES = [torch.int64, torch.int32, torch.float32, torch.float64, torch.bool, torch.uint8,
          torch.complex64, torch.bfloat16]  # fmt: skip


@st.composite
def tensors(draw: st.DrawFn, rows: int | None = None) -> torch.Tensor:
    dtype = draw(mostly(st.just(torch.int64), st.sampled_from(DTYPES)))
    trailing = draw(mostly(st.just([2]), st.lists(st.integers(0, 3), max_size=2)))
    shape = ([rows] if rows is not None else []) + trailing
    fill = draw(st.sampled_from([0, 1, -1, 7]))
    t = torch.full(shape, fill).to(dtype)
    if dtype.is_floating_point and draw(st.booleans()):
        t = t.clone()
        t.view(-1)[:1] = draw(st.sampled_from([math.nan, math.inf]))
    return t


cells = st.one_of(
    tensors(),
    st.integers(),
    weird_numbers,
    st.text(max_size=3),
    st.sampled_from([None, b"raw", {1, 2}, np.zeros(2), object(), (1, 2)]),
    st.lists(st.integers(), max_size=2),
)
bad_columns = st.one_of(st.lists(cells, max_size=4), st.tuples(cells, cells), cells)


@st.composite
def datas(draw: st.DrawFn) -> Any:
    """Mostly ``{"a": [n, 2] int64, "b": n floats}`` with one part spoilt."""
    if draw(st.integers(0, 5)) == 0:
        return draw(wrong_types)
    n = draw(mostly(st.integers(1, 3), st.integers(0, 5)))
    a = draw(mostly(tensors(rows=n), bad_columns))
    b = draw(mostly(st.lists(st.floats(allow_nan=True), min_size=n, max_size=n), bad_columns))
    data = {"a": a, "b": b}
    for key in draw(st.lists(st.sampled_from(["a", "b"]), max_size=1)):
        del data[key]
    extra = draw(st.sampled_from([None, "c", "", 1, b"a", (1,)]))
    if extra is not None and draw(st.booleans()):
        data[extra] = draw(bad_columns)
    return data


rows = st.one_of(
    st.lists(st.integers(-3, 8) | st.sampled_from(HUGE) | wrong_types, max_size=4),
    st.lists(st.integers(0, 5), min_size=1, max_size=3),
    wrong_types,
)
tags = st.one_of(
    st.lists(st.sampled_from([Tags(), Tags(group="g"), None, "tag", 1]), max_size=4),
    wrong_types,
)
# timeouts that never wait: 0, or values the store must refuse
timeouts = mostly(st.just(0), st.sampled_from([-1, -0.5, math.nan, -math.inf, "1", [], True]))
sizes = st.one_of(st.integers(-2, 5), st.sampled_from([2**63, 2**70]), weird_numbers, wrong_types)
small_ints = st.one_of(st.integers(-2, 3), st.sampled_from(HUGE), weird_numbers, wrong_types)
capacities = st.one_of(
    st.none(),
    st.builds(Capacity, max_rows=small_ints | st.none(), max_bytes=small_ints | st.none()),
    wrong_types,
)


@st.composite
def metas(draw: st.DrawFn) -> Any:
    if draw(st.booleans()):
        return draw(wrong_types)
    return BatchMeta(
        partition=draw(mostly(st.just("p"), names)),
        task=draw(mostly(st.just("t"), names)),
        rows=draw(rows),
        fields=draw(fields),
        lease_id=draw(st.one_of(st.none(), st.text(max_size=3), wrong_types)),
        member=draw(small_ints),
    )


# --- the harness ---------------------------------------------------------------------------
Call = Callable[[InProcessDataStore, BatchMeta], Coroutine[Any, Any, Any]]


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


async def seeded() -> tuple[InProcessDataStore, BatchMeta]:
    """A store with partition ``p`` (fields a, b; task t): four rows, two of them leased."""
    store = InProcessDataStore(num_storage_units=2)
    await store.create_partition("p", ["a", "b"], tasks=["t"])
    await store.put("p", {"a": torch.arange(8).reshape(4, 2), "b": [0.5, 1.5, 2.5, 3.5]})
    meta = await store.get_meta("p", "t", ["a", "b"], 2, timeout=0)
    return store, meta


def snapshot(store: InProcessDataStore) -> Any:
    """Every unit's cells (the value objects themselves: a write replaces them) and every
    partition's counters."""
    units = [
        {key: {f: dict(col) for f, col in part.items()} for key, part in unit._data.items()}
        for unit in store.units
    ]
    stats = {p: store.controller.stats(p) for p in store.controller.partitions()}
    return units, stats


def same(a: Any, b: Any) -> bool:
    units_a, stats_a = a
    units_b, stats_b = b
    if stats_a != stats_b or len(units_a) != len(units_b):
        return False
    for ua, ub in zip(units_a, units_b, strict=True):
        if ua.keys() != ub.keys():
            return False
        for key in ua:
            if ua[key].keys() != ub[key].keys():
                return False
            for f in ua[key]:
                ca, cb = ua[key][f], ub[key][f]
                if ca.keys() != cb.keys() or any(ca[r] is not cb[r] for r in ca):
                    return False
    return True


def check(call: Call) -> None:
    async def body() -> None:
        store, meta = await seeded()
        before = snapshot(store)
        try:
            await call(store, meta)
        except DataStoreError as exc:
            event(f"refused: {type(exc).__name__}")
            assert same(before, snapshot(store)), "a rejected call changed the store"
            await store.get_data(meta)  # the store still serves its lease
        else:
            event("accepted")
        # anything else (a TypeError, a hang) fails the test by itself

    run(body())


# --- one test per call ---------------------------------------------------------------------
@FUZZ
@given(partition=mostly(st.just("p"), names), data=datas(), rows=mostly(st.none(), rows),
       tags=mostly(st.none(), tags), overwrite=mostly(st.booleans(), wrong_types),
       timeout=timeouts | st.none())  # fmt: skip
def test_put(partition: Any, data: Any, rows: Any, tags: Any, overwrite: Any, timeout: Any) -> None:
    check(lambda s, m: s.put(partition, data, rows=rows, tags=tags, overwrite=overwrite,
                             timeout=timeout))  # fmt: skip


@FUZZ
@given(partition=mostly(st.just("p"), names), task=mostly(st.just("t"), names), fields=fields,
       batch_size=mostly(st.integers(1, 4), sizes), timeout=timeouts,
       lease_s=mostly(st.floats(0.1, 100), small_ints),
       version=mostly(st.none() | st.integers(0, 5), small_ints),
       dp_rank=mostly(st.just(0), small_ints), dp_size=mostly(st.just(1), small_ints),
       member=mostly(st.just(0), small_ints))  # fmt: skip
def test_get_meta(
    partition: Any, task: Any, fields: Any, batch_size: Any, timeout: Any, lease_s: Any,
    version: Any, dp_rank: Any, dp_size: Any, member: Any,
) -> None:  # fmt: skip
    check(lambda s, m: s.get_meta(partition, task, fields, batch_size, timeout=timeout,
                                  lease_s=lease_s, current_version=version, dp_rank=dp_rank,
                                  dp_size=dp_size, member=member))  # fmt: skip


@FUZZ
@given(forged=metas(), use_real=st.booleans(), fields=mostly(st.none(), fields),
       layout=mostly(st.sampled_from(["padded", "list", "nested"]),
                     st.sampled_from(["dense", ""]) | wrong_types),
       pad_value=mostly(st.integers(-1, 1), weird_numbers | wrong_types))  # fmt: skip
def test_get_data(forged: Any, use_real: bool, fields: Any, layout: Any, pad_value: Any) -> None:
    check(lambda s, m: s.get_data(m if use_real else forged, fields, layout=layout,
                                  pad_value=pad_value))  # fmt: skip


@FUZZ
@given(forged=metas(), nack=st.booleans(), changes=st.dictionaries(
    st.sampled_from(["rows", "lease_id", "partition", "task", "member"]),
    rows | names | small_ints, max_size=2))  # fmt: skip
def test_ack_and_nack(forged: Any, nack: bool, changes: dict[str, Any]) -> None:
    def call(store: InProcessDataStore, meta: BatchMeta) -> Coroutine[Any, Any, Any]:
        target = dataclasses.replace(meta, **changes) if changes else forged
        return store.nack(target) if nack else store.ack(target)

    check(call)


@FUZZ
@given(name=mostly(st.sampled_from(["p", "q"]), names), fields=fields, capacity=capacities,
       tasks=mostly(st.lists(st.sampled_from(["t", "u"]), max_size=2), st.lists(names,
                    max_size=2) | wrong_types))  # fmt: skip
def test_create_partition(name: Any, fields: Any, capacity: Any, tasks: Any) -> None:
    check(lambda s, m: s.create_partition(name, fields, capacity=capacity, tasks=tasks))


@FUZZ
@given(op=st.sampled_from(["register_task", "close", "delete_partition", "stats"]),
       partition=mostly(st.sampled_from(["p", "q"]), names),
       task=mostly(st.sampled_from(["t", "u"]), names))  # fmt: skip
def test_partition_calls(op: str, partition: Any, task: Any) -> None:
    def call(store: InProcessDataStore, meta: BatchMeta) -> Coroutine[Any, Any, Any]:
        if op == "register_task":
            return store.register_task(partition, task)
        method: Callable[[Any], Coroutine[Any, Any, Any]] = getattr(store, op)
        return method(partition)

    check(call)


def test_the_harness_sees_a_change() -> None:
    """The oracle is not blind: a put that succeeds is a different snapshot."""

    async def body() -> None:
        store, _ = await seeded()
        before = snapshot(store)
        await store.put("p", {"a": torch.zeros(1, 2, dtype=torch.long), "b": [9.0]})
        assert not same(before, snapshot(store))

    run(body())
