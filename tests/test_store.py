"""Tests of the in-process store's own mechanics (the generic contract is in the conformance
suite, run by test_datastore_conformance.py): sharding, window compaction, rank replay,
thread-safety, storage failures, byte capacity, and wake-ups."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import pytest
import torch

from asyncflow_core.contracts.errors import (
    CapacityError,
    LeaseError,
    StorageUnitError,
    StoreTimeoutError,
    UnknownPartitionError,
    UnknownRowError,
)
from asyncflow_core.contracts.protocols import Batch, Capacity, CellValue, Tags
from asyncflow_core.data.scheduling import (
    GroupSampler,
    RankAwareSampler,
    StalenessSampler,
    TokenBalancedSampler,
)
from asyncflow_core.data.store import InProcessDataStore, StorageUnit


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_rows_are_sharded_over_units() -> None:
    async def go() -> None:
        store = InProcessDataStore(3)
        await store.create_partition("p", ["x"], tasks=["t"])
        rows = await store.put("p", {"x": [torch.full((i + 1,), float(i)) for i in range(9)]})
        assert [u.num_cells(store.storage_key("p")) for u in store.units] == [3, 3, 3]
        meta = await store.get_meta("p", "t", ["x"], 9)
        batch = await store.get_data(meta, layout="list")
        for r, t in zip(rows, batch["x"], strict=True):
            assert t.shape == (r + 1,) and bool((t == r).all())

    run(go())


def test_slots_compact_when_rows_are_reclaimed() -> None:
    """A long stream keeps the metadata arrays bounded by the live rows, not the total."""

    async def go() -> None:
        store = InProcessDataStore(2)
        await store.create_partition("p", ["x"], tasks=["a", "b"])
        for step in range(200):
            rows = await store.put("p", {"x": torch.arange(50).reshape(50, 1) + step * 50})
            for task in ("a", "b"):
                meta = await store.get_meta("p", task, ["x"], 50)
                assert meta.rows == rows
                batch = await store.get_data(meta)
                assert batch["x"][:, 0].tolist() == list(range(step * 50, step * 50 + 50))
                await store.ack(meta)
        part = store.controller._parts["p"]
        stats = await store.stats("p")
        assert stats.rows_created == 10_000 and stats.rows_live == 0
        assert stats.reclaimed == 10_000
        assert part.cap <= 128, part.cap
        assert sum(u.num_cells(store.storage_key("p")) for u in store.units) == 0

    run(go())


def test_rank_aware_replays_batch_to_every_member() -> None:
    async def go() -> None:
        store = InProcessDataStore(1)
        await store.create_partition("p", ["x"], tasks=["t"])
        await store.put("p", {"x": list(range(8))})
        sampler = RankAwareSampler(members_per_rank=2)
        m0 = await store.get_meta("p", "t", ["x"], 4, sampler=sampler, member=0)
        m1 = await store.get_meta("p", "t", ["x"], 4, sampler=sampler, member=1)
        assert m0.rows == m1.rows == (0, 1, 2, 3) and m0.lease_id == m1.lease_id
        # another DP rank gets different rows
        r1 = await store.get_meta("p", "t", ["x"], 4, sampler=sampler, dp_rank=1, dp_size=2)
        assert r1.rows == (4, 5, 6, 7)
        await store.ack(m0)
        assert (await store.stats("p")).consumed["t"] == 0  # member 1 has not acked yet
        await store.ack(m1)
        assert (await store.stats("p")).consumed["t"] == 4
        with pytest.raises(LeaseError, match="already acked"):
            await store.ack(m1)
        # a nack by one member ends the shared lease for all
        await store.nack(r1)
        with pytest.raises(LeaseError, match="nacked by member 0"):
            await store.nack(r1)

    run(go())


class _FailingUnit(StorageUnit):
    fail = True

    def write(
        self, partition: str, cells: Mapping[str, Mapping[int, CellValue]]
    ) -> dict[str, dict[int, CellValue]]:
        if self.fail:
            raise StorageUnitError(f"unit {self.unit_id} is down")
        return super().write(partition, cells)


def test_failed_storage_write_leaves_store_unchanged() -> None:
    async def go() -> None:
        bad = _FailingUnit(1)
        store = InProcessDataStore(units=[StorageUnit(0), bad])
        await store.create_partition("p", ["x", "y"], tasks=["t"], capacity=Capacity(max_rows=4))
        await store.put("p", {"x": [torch.zeros(2)]})  # row 0 lives on unit 0
        before = await store.stats("p")
        schema_before = store.controller.schema("p")
        with pytest.raises(StorageUnitError, match="unit 1 is down"):
            await store.put("p", {"x": [torch.ones(2)] * 2, "y": [1, 2]})
        assert await store.stats("p") == before
        assert store.controller.schema("p") == schema_before  # y's schema was not fixed
        assert (
            store.units[0].num_cells(store.storage_key("p")) == 1
        )  # unit 0's share (row 2) was undone
        bad.fail = False
        rows = await store.put("p", {"x": [torch.ones(2)] * 2, "y": ["a", "b"]})
        assert rows == (1, 2)  # the aborted ids are reused: no hole in the numbering

    run(go())


def test_byte_capacity_back_pressure_and_impossible_put() -> None:
    async def go() -> None:
        store = InProcessDataStore(2)
        await store.create_partition("p", ["x"], tasks=["t"], capacity=Capacity(max_bytes=4 * 1024))
        with pytest.raises(CapacityError, match="max_bytes=4096"):
            await store.put("p", {"x": [torch.zeros(2048)]})  # 8 KiB can never fit
        await store.put("p", {"x": [torch.zeros(512)] * 2})  # 4 KiB: full
        with pytest.raises(StoreTimeoutError, match="capacity"):
            await store.put("p", {"x": [torch.zeros(1)]}, timeout=0.05)
        blocked = asyncio.create_task(store.put("p", {"x": [torch.zeros(256)]}))
        await asyncio.sleep(0.02)
        assert not blocked.done()
        meta = await store.get_meta("p", "t", ["x"], 1)
        await store.ack(meta)  # frees 2 KiB
        assert await asyncio.wait_for(blocked, 2) == (2,)
        assert (await store.stats("p")).bytes_live == 2048 + 1024

    run(go())


def test_put_from_other_threads_wakes_waiting_consumer() -> None:
    """Producers in other threads (each with its own event loop) feed one consumer; every row
    arrives exactly once."""

    async def go() -> None:
        store = InProcessDataStore(2)
        await store.create_partition("p", ["x"], tasks=["t"])

        def producer(k: int) -> None:
            async def produce() -> None:
                for i in range(25):
                    await store.put("p", {"x": [k * 1000 + i]})

            asyncio.run(produce())

        threads = [threading.Thread(target=producer, args=(k,)) for k in range(4)]
        for th in threads:
            th.start()
        seen: list[int] = []
        while len(seen) < 100:
            meta = await store.get_meta("p", "t", ["x"], 7, timeout=10)
            if len(meta) < 7:
                pytest.fail("sequential sampler handed out a short batch before close")
            seen += (await store.get_data(meta))["x"]
            await store.ack(meta)
            if len(seen) == 98:
                for th in threads:
                    th.join()
                await store.close("p")
                last = await store.get_meta("p", "t", ["x"], 7)
                seen += (await store.get_data(last))["x"]
                await store.ack(last)
        assert sorted(seen) == sorted(k * 1000 + i for k in range(4) for i in range(25))

    run(go())


def test_delete_partition_wakes_waiters_with_clear_error() -> None:
    async def go() -> None:
        store = InProcessDataStore(2)
        await store.create_partition("p", ["x"], tasks=["t"])
        waiter = asyncio.create_task(store.get_meta("p", "t", ["x"], 1, timeout=5))
        await asyncio.sleep(0.01)
        await store.delete_partition("p")
        with pytest.raises(UnknownPartitionError, match="'p' does not exist"):
            await asyncio.wait_for(waiter, 2)
        await store.create_partition("p", ["x"])  # the name is free again

    run(go())


def test_waiting_consumer_wakes_when_a_lease_expires() -> None:
    async def go() -> None:
        store = InProcessDataStore(1)
        await store.create_partition("p", ["x"], tasks=["t"])
        await store.put("p", {"x": [1, 2]})
        first = await store.get_meta("p", "t", ["x"], 2, lease_s=0.1)
        t0 = time.monotonic()
        again = await store.get_meta("p", "t", ["x"], 2, timeout=5)
        assert again.rows == first.rows
        assert 0.05 < time.monotonic() - t0 < 2

    run(go())


def test_timeout_message_explains_what_is_missing() -> None:
    async def go() -> None:
        store = InProcessDataStore(1)
        await store.create_partition("p", ["prompt", "reward"], tasks=["train"])
        await store.put("p", {"prompt": ["a", "b", "c"]})
        with pytest.raises(StoreTimeoutError) as e:
            await store.get_meta("p", "train", ["prompt", "reward"], 2, timeout=0.01)
        assert "prompt=3" in str(e.value) and "reward=0" in str(e.value)
        assert (await store.stats("p")).leased["train"] == 0

    run(go())


def test_token_balanced_micro_batches_split_meta() -> None:
    async def go() -> None:
        store = InProcessDataStore(1)
        await store.create_partition("p", ["x"], tasks=["t"])
        lengths = [50, 10, 40, 20, 30, 30, 5, 15]
        await store.put(
            "p",
            {"x": [torch.zeros(n) for n in lengths]},
            tags=[Tags(tokens=n) for n in lengths],
        )
        meta = await store.get_meta("p", "t", ["x"], 8, sampler=TokenBalancedSampler(), dp_size=2)
        parts = meta.split()
        assert len(parts) == 2 and sorted(r for p in parts for r in p.rows) == list(range(8))
        sums = [p.tokens for p in parts]
        assert sums[0] + sums[1] == 200 and abs(sums[0] - sums[1]) <= 10
        assert all(p.lease_id == meta.lease_id for p in parts)
        batch = await store.get_data(parts[0])
        assert batch["x"].shape[0] == 4

    run(go())


def test_group_sampler_and_staleness_drop_through_store() -> None:
    async def go() -> None:
        store = InProcessDataStore(2)
        await store.create_partition("p", ["x"], tasks=["t"])
        # group 0 made by version 0, group 1 by version 3
        await store.put(
            "p",
            {"x": list(range(8))},
            tags=[Tags(group=i // 4, versions=(0 if i < 4 else 3,)) for i in range(8)],
        )
        stale = StalenessSampler(max_lag=1, policy="drop", inner=GroupSampler(4))
        meta = await store.get_meta("p", "t", ["x"], 4, sampler=stale, current_version=3)
        assert meta.rows == (4, 5, 6, 7)
        stats = await store.stats("p")
        assert stats.dropped["t"] == 4 and stats.reclaimed == 4  # t was the only task
        assert [t.group for t in meta.tags] == [1] * 4

    run(go())


def test_tags_merge_on_later_puts() -> None:
    async def go() -> None:
        store = InProcessDataStore(1)
        await store.create_partition("p", ["prompt", "response"], tasks=["t"])
        rows = await store.put("p", {"prompt": ["q"]}, tags=[Tags(group="g", tokens=3)])
        await store.put(
            "p", {"response": [torch.ones(5)]}, rows=rows, tags=[Tags(versions=(2, 1), tokens=8)]
        )
        await store.put(
            "p",
            {"response": [torch.ones(6)]},
            rows=rows,
            tags=[Tags(versions=(3,))],
            overwrite=True,
        )
        meta = await store.get_meta("p", "t", ["prompt", "response"], 1)
        assert meta.tags == (Tags(group="g", versions=(1, 2, 3), tokens=8),)

    run(go())


def test_pending_put_survives_window_compaction() -> None:
    """A put that is between begin and commit while another put compacts the slots still
    marks its own rows ready (regression: pending puts used to hold stale slots)."""
    from asyncflow_core.contracts.protocols import FieldSchema
    from asyncflow_core.data.controller import Controller
    from asyncflow_core.data.scheduling import SequentialSampler

    ctrl = Controller()
    ctrl.create_partition("p", ["x"], tasks=["t"])
    plain = {"x": FieldSchema(None, 0)}
    for _ in range(2):  # fill the first 64-row window, consume and reclaim most of it
        ticket = ctrl.begin_put("p", plain, {"x": [8] * 32}, 32)
        assert ticket is not None
        ctrl.commit_put(ticket)
    pending = ctrl.begin_put("p", plain, {"x": [8] * 1}, 1)  # row 64 needs room: grows
    assert pending is not None
    meta = ctrl.try_get_meta("p", "t", ["x"], 64, SequentialSampler(), lease_s=60)
    assert meta is not None and len(meta) == 64
    ctrl.ack(meta)  # rows 0..63 reclaimed
    other = ctrl.begin_put("p", plain, {"x": [8] * 100}, 100)  # compacts the 64 dead slots
    assert other is not None
    assert int(ctrl._parts["p"].row_id[0]) == 64
    ctrl.commit_put(pending)
    ctrl.commit_put(other)
    meta = ctrl.try_get_meta("p", "t", ["x"], 101, SequentialSampler(), lease_s=60)
    assert meta is not None and meta.rows == tuple(range(64, 165))


class _PickleProxy:
    """Sends every call's arguments and result through pickle, as a process boundary (or a
    Ray actor call) would: proves the controller and storage-unit interfaces are picklable and
    that the façade does not rely on sharing their objects."""

    def __init__(self, target: object) -> None:
        self._target = target

    def __getattr__(self, name: str) -> object:
        import pickle

        attr = getattr(self._target, name)
        if name == "add_listener" or not callable(attr):
            return attr  # local wiring of notifications; a remote runtime replaces it

        def call(*args: object, **kwargs: object) -> object:
            a, k = pickle.loads(pickle.dumps((args, kwargs)))
            return pickle.loads(pickle.dumps(attr(*a, **k)))

        return call


def test_controller_and_units_work_across_a_pickle_boundary() -> None:
    from asyncflow_core.data.controller import Controller

    async def go() -> None:
        store = InProcessDataStore(
            controller=_PickleProxy(Controller()),  # type: ignore[arg-type]
            units=[_PickleProxy(StorageUnit(i)) for i in range(2)],  # type: ignore[misc]
        )
        await store.create_partition("p", ["x", "r"], tasks=["a", "b"])
        rows = await store.put(
            "p", {"x": [torch.arange(n) for n in (3, 1, 2, 5)]}, tags=[Tags(group=0)] * 4
        )
        await store.put("p", {"r": [0.5, 1.0, 0.0, 1.0]}, rows=rows)
        for task in ("a", "b"):
            meta = await store.get_meta("p", task, ["x", "r"], 4, sampler=GroupSampler(4))
            batch = await store.get_data(meta)
            assert batch.lengths["x"].tolist() == [3, 1, 2, 5] and batch["r"][1] == 1.0
            await store.ack(meta)
        stats = await store.stats("p")
        assert stats.rows_live == 0 and stats.reclaimed == 4
        assert sum(u.num_cells(store.storage_key("p")) for u in store.units) == 0

    run(go())


# --- regressions found by review: puts racing with reclaim, delete and aborts -------------------
class _GatedUnit(StorageUnit):
    """A unit whose writes of ``field`` block until released (and may then fail)."""

    def __init__(self, unit_id: int, field: str) -> None:
        super().__init__(unit_id)
        self.field = field
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self.fail: Exception | None = None

    def write(
        self, partition: str, cells: Mapping[str, Mapping[int, CellValue]]
    ) -> dict[str, dict[int, CellValue]]:
        if self.gate is not None and self.field in cells:
            self.entered.set()
            self.gate.wait(10)
            if self.fail is not None:
                raise self.fail
        return super().write(partition, cells)


def _in_thread(
    coro_fn: Callable[[], Coroutine[Any, Any, Any]],
) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(coro_fn())
        except BaseException as e:  # collected for the test to inspect
            errors.append(e)

    th = threading.Thread(target=target)
    th.start()
    return th, errors


@pytest.mark.parametrize("fail", [None, RuntimeError("unit down")])
def test_row_consumed_during_a_put_into_it_is_reclaimed_after_the_put(
    fail: Exception | None,
) -> None:
    unit = _GatedUnit(0, "b")
    store = InProcessDataStore(units=[unit])
    run(store.create_partition("p", ["a", "b"], tasks=["t"]))
    run(store.put("p", {"a": [torch.zeros(4)]}))
    unit.gate, unit.fail = threading.Event(), fail
    th, errors = _in_thread(lambda: store.put("p", {"b": [torch.zeros(100)]}, rows=[0]))
    assert unit.entered.wait(5)

    async def consume() -> None:
        meta = await store.get_meta("p", "t", ["a"], 1, timeout=1)
        await store.ack(meta)

    run(consume())
    assert run(store.stats("p")).rows_live == 1  # reclamation waits for the write
    unit.gate.set()
    th.join()
    if fail is not None:  # a non-AsyncFlowError from a unit is reported as StorageUnitError
        assert len(errors) == 1 and isinstance(errors[0], StorageUnitError)
        assert "RuntimeError: unit down" in str(errors[0])
    else:
        assert errors == []
    stats = run(store.stats("p"))
    assert (stats.rows_live, stats.bytes_live, stats.reclaimed) == (0, 0, 1)
    assert unit.num_cells(store.storage_key("p")) == 0


def test_put_racing_with_delete_leaves_no_cells_and_recreated_name_is_clean() -> None:
    unit = _GatedUnit(0, "x")
    store = InProcessDataStore(units=[unit])
    run(store.create_partition("p", ["x"], tasks=["t"]))
    old_key = store.storage_key("p")
    unit.gate = threading.Event()
    th, errors = _in_thread(lambda: store.put("p", {"x": [torch.zeros(10)] * 10}))
    assert unit.entered.wait(5)
    run(store.delete_partition("p"))
    unit.gate.set()
    th.join()
    assert len(errors) == 1 and isinstance(errors[0], UnknownPartitionError)
    assert unit.num_cells(old_key) == 0
    run(store.create_partition("p", ["x"], tasks=["t"]))
    assert store.storage_key("p") != old_key and unit.num_cells(store.storage_key("p")) == 0


def test_reclaimed_rows_of_a_deleted_partition_never_touch_its_successor() -> None:
    async def go() -> None:
        store = InProcessDataStore(2)
        await store.create_partition("p", ["x"], tasks=["t"])
        await store.put("p", {"x": [torch.ones(2)] * 4})
        meta = await store.get_meta("p", "t", ["x"], 4)
        store.controller.ack(meta)  # reclaimed, storage not freed yet
        await store.delete_partition("p")
        await store.create_partition("p", ["x"], tasks=["t"])
        await store.put("p", {"x": [torch.full((2,), 7.0)] * 4})
        store._plane.free_reclaimed()  # the old partition's queued ids must not hit the new one
        meta = await store.get_meta("p", "t", ["x"], 4)
        assert bool(((await store.get_data(meta))["x"] == 7).all())

    run(go())


def test_rows_being_created_cannot_be_written_by_another_put() -> None:
    unit = _GatedUnit(0, "a")
    store = InProcessDataStore(units=[unit])
    run(store.create_partition("p", ["a", "b"], tasks=["t"]))
    unit.gate, unit.fail = threading.Event(), StorageUnitError("unit 0 is down")
    th, errors = _in_thread(lambda: store.put("p", {"a": [torch.zeros(1)]}))
    assert unit.entered.wait(5)
    with pytest.raises(UnknownRowError, match="no live rows"):
        run(store.put("p", {"b": [torch.tensor([111.0])]}, rows=[0]))
    unit.gate.set()
    th.join()
    assert len(errors) == 1 and isinstance(errors[0], StorageUnitError)
    stats = run(store.stats("p"))
    assert (stats.rows_live, stats.bytes_live) == (0, 0)
    unit.gate = None
    assert run(store.put("p", {"a": [torch.ones(1)]})) == (0,)
    assert run(store.stats("p")).ready == {"a": 1, "b": 0}


def test_group_completion_does_not_depend_on_other_tasks_progress() -> None:
    """Task A's group of 6 (n=4) ends with 2 undeliverable rows dropped, whether or not task
    B consumed (and so reclaimed) some of the group first."""

    async def go(b_first: bool) -> None:
        store = InProcessDataStore(1)
        await store.create_partition("p", ["x"], tasks=["A", "B"])
        await store.put("p", {"x": [torch.ones(1)] * 6}, tags=[Tags(group="g")] * 6)
        sampler = GroupSampler(4)
        meta = await store.get_meta("p", "A", ["x"], 4, sampler=sampler)
        await store.ack(meta)
        if b_first:
            meta = await store.get_meta("p", "B", ["x"], 2)
            await store.ack(meta)
        await store.close("p")
        end = await store.get_meta("p", "A", ["x"], 4, sampler=sampler, timeout=1)
        assert end.end_of_stream
        assert (await store.stats("p")).dropped["A"] == 2

    run(go(False))
    run(go(True))


def test_a_lingering_row_does_not_pin_the_metadata() -> None:
    """A row that is never consumed (here: held back as stale) must not make the metadata, and
    every get_meta scan, grow with the rows ever created."""

    async def go() -> None:
        store = InProcessDataStore(1)
        await store.create_partition("p", ["x"], tasks=["t"])
        await store.put("p", {"x": [0]}, tags=[Tags(versions=(0,))])  # row 0: stale forever
        stale = StalenessSampler(max_lag=1, policy="hold")
        for step in range(100):
            await store.put("p", {"x": list(range(50))}, tags=[Tags(versions=(100,))] * 50)
            meta = await store.get_meta("p", "t", ["x"], 50, sampler=stale, current_version=100)
            assert 0 not in meta.rows and len(meta) == 50, step
            await store.ack(meta)
        stats = await store.stats("p")
        assert stats.rows_live == 1 and stats.held["t"] == 1 and stats.rows_created == 5001
        assert store.controller._parts["p"].cap <= 256

    run(go())


def test_batch_slice_takes_rows_of_every_field_and_names_a_bad_one() -> None:
    nested = torch.nested.nested_tensor(
        [torch.ones(2), torch.ones(3), torch.ones(1)], layout=torch.jagged
    )
    batch = Batch(
        rows=(10, 11, 12),
        data={"x": torch.arange(6).view(3, 2), "n": nested, "s": ["a", "b", "c"]},
        lengths={"x": torch.tensor([2, 1, 2])},
        tags=(Tags(group=1), Tags(group=1), Tags(group=2)),
    )
    part = batch.slice(1, 3)
    assert part.rows == (11, 12) and part.tags == batch.tags[1:]
    assert torch.equal(part["x"], torch.tensor([[2, 3], [4, 5]]))
    assert [t.shape[0] for t in part["n"].unbind()] == [3, 1]
    assert part["s"] == ["b", "c"] and torch.equal(part.lengths["x"], torch.tensor([1, 2]))
    unnamed = Batch((), {"x": torch.zeros(4, 2)}, {"x": torch.ones(4)})  # no row ids
    assert unnamed.slice(0, 2)["x"].shape == (2, 2) and unnamed.slice(0, 2).rows == ()
    with pytest.raises(ValueError, match="cannot split field 'scale'"):
        Batch((1, 2), {"scale": 0.5}).slice(0, 1)
    with pytest.raises(ValueError, match=r"lengths\['x'\] has 3 rows, not 2"):
        Batch((1, 2), {"x": torch.zeros(2)}, {"x": torch.ones(3)}).slice(0, 1)


def test_tags_pickle_every_field() -> None:
    """``Tags.__reduce__`` lists its fields by hand (a remote lease carries one per row): a
    field added later must be added there too."""
    import dataclasses
    import pickle

    tags = Tags(group="g-7", versions=(3, 5), tokens=12)
    assert pickle.loads(pickle.dumps(tags)) == tags
    assert [f.name for f in dataclasses.fields(Tags)] == ["group", "versions", "tokens"]
