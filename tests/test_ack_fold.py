"""The folded ack (``DataStore.get_meta(..., ack=meta)``) outside the conformance laws: the
fallback helper for stores written before the parameter, and the workflow's one-worker slot,
whose ack rides on its next ``get_meta`` (the final batch's on the end-of-stream call)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from asyncflow_conformance import FakeClock

from asyncflow_core.contracts.errors import LeaseExpiredError, TaskFailedError
from asyncflow_core.contracts.protocols import Batch, BatchMeta
from asyncflow_core.data.store import InProcessDataStore, folds_ack, get_meta_after_ack
from asyncflow_core.flow.workflow import Pipeline, Source, Task, TaskOutput


class OldStore:
    """A DataStore written against the protocol before ``ack=``: its ``get_meta`` lacks it.
    Records every call."""

    def __init__(self, clock: FakeClock | None = None) -> None:
        self.inner = InProcessDataStore(clock=clock) if clock else InProcessDataStore()
        self.calls: list[str] = []

    async def create_partition(self, name: str, fields: Any, **kwargs: Any) -> None:
        await self.inner.create_partition(name, fields, **kwargs)

    async def register_task(self, partition: str, task: str) -> None:
        await self.inner.register_task(partition, task)

    async def put(self, partition: str, data: Any, **kwargs: Any) -> tuple[int, ...]:
        return await self.inner.put(partition, data, **kwargs)

    async def get_meta(
        self,
        partition: str,
        task: str,
        fields: Any,
        batch_size: int,
        *,
        sampler: Any = None,
        timeout: float | None = 60.0,
        lease_s: float = 600.0,
        current_version: int | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
        member: int = 0,
    ) -> BatchMeta:
        self.calls.append("get_meta")
        return await self.inner.get_meta(
            partition, task, fields, batch_size, sampler=sampler, timeout=timeout,
            lease_s=lease_s, current_version=current_version, dp_rank=dp_rank,
            dp_size=dp_size, member=member,
        )  # fmt: skip

    async def get_data(self, meta: BatchMeta, fields: Any = None, **kwargs: Any) -> Batch:
        return await self.inner.get_data(meta, fields, **kwargs)

    async def ack(self, meta: BatchMeta) -> None:
        self.calls.append("ack")
        await self.inner.ack(meta)

    async def nack(self, meta: BatchMeta) -> None:
        await self.inner.nack(meta)

    async def close(self, partition: str) -> None:
        await self.inner.close(partition)

    async def delete_partition(self, partition: str) -> None:
        await self.inner.delete_partition(partition)

    async def stats(self, partition: str) -> Any:
        return await self.inner.stats(partition)


class NewStore(OldStore):
    """The same store with the folded ack: records whether each get_meta carried one."""

    async def get_meta(  # type: ignore[override]
        self,
        partition: str,
        task: str,
        fields: Any,
        batch_size: int,
        *,
        ack: BatchMeta | None = None,
        **kwargs: Any,
    ) -> BatchMeta:
        self.calls.append("get_meta+ack" if ack is not None else "get_meta")
        return await self.inner.get_meta(partition, task, fields, batch_size, ack=ack, **kwargs)


class KwargsStore(OldStore):
    """A wrapper whose get_meta takes only ``**kwargs``: it cannot be told apart from one
    that drops what it does not know, so it is not trusted with an ack."""

    async def get_meta(  # type: ignore[override]
        self, partition: str, task: str, fields: Any, batch_size: int, **kwargs: Any
    ) -> BatchMeta:
        return await self.inner.get_meta(partition, task, fields, batch_size, **kwargs)


def test_folds_ack_reads_the_signature() -> None:
    assert folds_ack(InProcessDataStore())
    assert folds_ack(NewStore())
    assert not folds_ack(KwargsStore())  # **kwargs alone: it might drop an ack it does not know
    assert not folds_ack(OldStore())
    assert not folds_ack(object())


@pytest.mark.parametrize("kind", [OldStore, NewStore])
def test_get_meta_after_ack_has_one_outcome_either_way(kind: type[OldStore]) -> None:
    async def go() -> None:
        store = kind()
        await store.create_partition("p", ["x"], tasks=["t"])
        await store.put("p", {"x": [0, 1, 2, 3]})
        first = await get_meta_after_ack(store, None, "p", "t", ["x"], 2, timeout=0)  # type: ignore[arg-type]
        second = await get_meta_after_ack(store, first, "p", "t", ["x"], 2, timeout=0)  # type: ignore[arg-type]
        assert (first.rows, second.rows) == ((0, 1), (2, 3))
        assert dict((await store.stats("p")).consumed) == {"t": 2}
        if kind is OldStore:
            assert store.calls == ["get_meta", "ack", "get_meta"]
        else:
            assert store.calls == ["get_meta", "get_meta+ack"]
        # a failing ack leases nothing, on either path
        with pytest.raises(Exception, match="already acked"):
            await get_meta_after_ack(store, first, "p", "t", ["x"], 1, timeout=0)  # type: ignore[arg-type]
        assert dict((await store.stats("p")).leased) == {"t": 2}

    asyncio.run(go())


def rows_of(n: int, per_put: int = 4) -> Source:
    def batches() -> Iterator[TaskOutput]:
        for start in range(0, n, per_put):
            yield TaskOutput({"x": list(range(start, start + per_put))})

    return Source("src", ("x",), batches)


def noop(batch: Batch) -> None:
    return None


@pytest.mark.parametrize("workers", [1, 2])
def test_a_one_worker_task_acks_in_its_next_get_meta(workers: int) -> None:
    store = NewStore()
    task = Task("t", noop, ("x",), batch_size=4, workers=workers)
    assert Pipeline(rows_of(16), [task]).run_sync(store).rows["t"] == 16  # type: ignore[arg-type]
    if workers == 1:  # 4 batches, then end of stream; the last get_meta acks the 4th batch
        assert store.calls == ["get_meta"] + ["get_meta+ack"] * 4
    else:  # with several slots each acks by itself
        assert store.calls.count("ack") == 4 and "get_meta+ack" not in store.calls
    s = asyncio.run(store.stats("pipeline"))
    assert (dict(s.consumed), dict(s.leased), s.rows_live) == ({"t": 16}, {"t": 0}, 0)


def test_a_store_without_the_fold_still_runs_a_pipeline() -> None:
    store = OldStore()
    task = Task("t", noop, ("x",), batch_size=4)
    assert Pipeline(rows_of(8), [task]).run_sync(store).rows["t"] == 8  # type: ignore[arg-type]
    assert store.calls == ["get_meta", "ack", "get_meta", "ack", "get_meta"]
    assert asyncio.run(store.stats("pipeline")).rows_live == 0


@pytest.mark.parametrize("workers", [1, 2])
def test_an_ack_that_fails_ends_the_task_as_before(workers: int) -> None:
    """The slot outlives its lease: its ack raises LeaseExpiredError, from the slot itself
    (several workers) or from the next get_meta (one worker); either way the task fails
    with it, named."""
    clock = FakeClock()

    async def slow(batch: Batch) -> None:
        clock.advance(100.0)  # past the 10 s lease

    store = NewStore(clock)
    task = Task("t", slow, ("x",), batch_size=4, workers=workers, lease_s=10.0)
    with pytest.raises(TaskFailedError, match="'t' raised LeaseExpiredError") as info:
        Pipeline(rows_of(8), [task]).run_sync(store)  # type: ignore[arg-type]
    assert isinstance(info.value.__cause__, LeaseExpiredError)


def test_a_stop_after_the_last_step_still_acks_it() -> None:
    """``Pipeline.stop()`` from the slot's own fn (a trainer's last step): the batch it
    finished is acked, by the get_meta that follows or by the puller as it stops."""
    pipeline: Pipeline
    steps = 0

    async def train(batch: Batch) -> None:
        nonlocal steps
        steps += 1
        if steps == 2:
            pipeline.stop()

    store = NewStore()
    pipeline = Pipeline(rows_of(16), [Task("t", train, ("x",), batch_size=4)])
    result = pipeline.run_sync(store)  # type: ignore[arg-type]
    assert result.stopped and result.rows["t"] == 8
    s = asyncio.run(store.stats("pipeline"))
    assert dict(s.consumed) == {"t": 8}, "both finished batches are acked"


def test_a_failure_before_the_next_get_meta_still_acks_the_finished_batch() -> None:
    """The puller fails between the slot's end and its next get_meta (here the task's
    current_version raises): the finished batch is acked anyway, as when the slot acked it."""
    calls = 0

    def version() -> int:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("no version")
        return 0

    store = NewStore()
    task = Task("t", noop, ("x",), batch_size=4, current_version=version)
    with pytest.raises(TaskFailedError, match="no version"):
        Pipeline(rows_of(16), [task]).run_sync(store)  # type: ignore[arg-type]
    s = asyncio.run(store.stats("pipeline"))
    assert (dict(s.consumed), dict(s.leased)) == ({"t": 4}, {"t": 0})


def test_a_failure_whose_finished_batch_cannot_be_acked_raises_its_own_error() -> None:
    """As above, but the finished batch's lease has expired by then: the task's own error is
    raised, not the ack's."""
    clock = FakeClock()
    calls = 0

    def version() -> int:
        nonlocal calls
        calls += 1
        if calls == 2:
            clock.advance(100.0)  # the finished batch's 10 s lease is over
            raise RuntimeError("no version")
        return 0

    store = NewStore(clock)
    task = Task("t", noop, ("x",), batch_size=4, current_version=version, lease_s=10.0)
    with pytest.raises(TaskFailedError, match="no version"):
        Pipeline(rows_of(16), [task]).run_sync(store)  # type: ignore[arg-type]
