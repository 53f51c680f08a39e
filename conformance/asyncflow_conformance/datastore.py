"""The DataStore conformance suite: one pytest class that a backend author subclasses.

Usage::

    import pytest
    from asyncflow_conformance import DataStoreConformance

    class TestMyStore(DataStoreConformance):
        supports_fake_clock = True  # optional: store_factory accepts clock=

        @pytest.fixture
        def store_factory(self):
            return lambda clock=None: MyStore(clock=clock or time.monotonic)

Each test checks one law of the ``DataStore`` protocol (asyncflow_core.contracts.protocols; its
docstrings are the contract) on a fresh store, and every rejected call is checked three ways:
it raises the named ``AsyncFlowError`` subclass, its message names the offending value, and the
store is exactly as before (``stats()`` and the stored values compared, then the next valid call
behaves as if the rejected one never happened). ``test_state_machine`` runs the hypothesis
state machine of ``asyncflow_conformance.stateful`` on the same factory.

Optional abilities, declared as class attributes (a test that needs a missing one is skipped
with the ability's name in the reason):

``supports_fake_clock``
    ``store_factory`` returns a callable accepting ``clock=`` (a zero-arg callable giving
    seconds, monotonic), which the store uses for lease deadlines. Without it, lease-expiry
    tests use real leases of ``real_lease_s`` seconds and tests of exact deadlines are skipped.
``supports_direct_read``
    The subclass overrides ``direct_read`` to read a stored cell without the API under test,
    an independent oracle for "ragged tensors are stored unpadded".
``supports_virtual_clock``
    The store measures the waits of ``get_meta`` and ``put`` on the running event loop's clock
    (``loop.time()``, ``asyncio`` timers), so they run on a ``VirtualClockLoop``
    (``asyncflow_core.flow.vclock``), where the protocol's 600 s default timeout passes at
    once. A store that waits elsewhere (a remote controller's own clock) lacks it; the
    default timeouts are then untested.

One ability is read off the store itself: a ``get_meta`` that names an ``ack`` parameter
(``asyncflow_core.data.store.folds_ack``; ``**kwargs`` alone does not count) folds an ack into a
lease, and the laws of the folded ack run; a store without it skips them.

The suite reads data with ``get_data`` and hand-built ``BatchMeta(partition, task, rows,
fields)`` (no lease), so a backend's ``get_data`` must accept any meta naming live rows whose
fields are ready, as the protocol says.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from asyncflow_core.contracts.errors import (
    AsyncFlowError,
    BadRequestError,
    CapacityError,
    CellAlreadyWrittenError,
    DataStoreError,
    LeaseError,
    LeaseExpiredError,
    PartitionClosedError,
    PartitionExistsError,
    SamplerError,
    SchemaError,
    StoreTimeoutError,
    UnknownFieldError,
    UnknownPartitionError,
    UnknownRowError,
    UnknownTaskError,
)
from asyncflow_core.contracts.protocols import (
    DEFAULT_GET_TIMEOUT_S,
    DEFAULT_LEASE_S,
    Batch,
    BatchMeta,
    Candidates,
    Capacity,
    CellValue,
    DataStore,
    Layout,
    SampleRequest,
    Selection,
    Tags,
)
from asyncflow_core.data.scheduling import GroupSampler, RankAwareSampler, SequentialSampler
from asyncflow_core.data.store import folds_ack
from asyncflow_core.flow.vclock import run_virtual

__all__ = [
    "WAIT_S",
    "DataStoreConformance",
    "FakeClock",
    "StoreFactory",
    "async_test",
    "cell_key",
    "snapshot",
    "unpack",
]

from asyncflow_conformance.storekit import (
    WAIT_S,
    FakeClock,
    StoreFactory,
    async_test,
    batch_key,
    cell_key,
    expect_rejected,
    new_partition,
    ragged,
    same,
    settle,
    snapshot,
    unpack,
)


class FixedSampler:
    """A sampler that answers the same whatever the candidates: ``rows``, or a whole
    ``Selection`` (to test the store's validation and its handling of drops and holds)."""

    def __init__(self, rows: Sequence[int] = (), selection: Selection | None = None) -> None:
        self.selection = selection if selection is not None else Selection(rows=tuple(rows))

    def select(self, candidates: Candidates, request: SampleRequest) -> Selection:
        return self.selection


class DropOldestSampler:
    """Drops the oldest candidate and selects nothing (a staleness policy that finds every row
    too old), recording each row it dropped."""

    def __init__(self) -> None:
        self.dropped: list[int] = []

    def select(self, candidates: Candidates, request: SampleRequest) -> Selection:
        if not len(candidates):
            return Selection()
        row = int(candidates.rows[0])
        if row not in self.dropped:
            self.dropped.append(row)
        return Selection(dropped=(row,))


class SpySampler:
    """The sequential sampler, recording the candidates and requests it was shown."""

    def __init__(self) -> None:
        self.seen: list[tuple[Candidates, SampleRequest]] = []

    def select(self, candidates: Candidates, request: SampleRequest) -> Selection:
        self.seen.append((candidates, request))
        return SequentialSampler().select(candidates, request)


# --------------------------------------------------------------------------------------------
# The suite
# --------------------------------------------------------------------------------------------
class DataStoreConformance:
    """Every law of the ``DataStore`` protocol; subclass it and override ``store_factory``."""

    pytestmark: ClassVar[list[pytest.MarkDecorator]] = [pytest.mark.conformance]

    backend_name: ClassVar[str] = ""
    """Shown in the report header (default: the subclass's name)."""
    supports_fake_clock: ClassVar[bool] = False
    """``store_factory(clock=FakeClock())`` makes the store use that clock for leases."""
    supports_direct_read: ClassVar[bool] = False
    """``direct_read`` is overridden (reads a stored cell bypassing ``get_data``)."""
    supports_virtual_clock: ClassVar[bool] = False
    """The waits of ``get_meta`` and ``put`` follow the running event loop's clock."""
    real_lease_s: ClassVar[float] = 0.05
    """Lease length for expiry tests when there is no fake clock (real seconds)."""

    @classmethod
    def describe_backend(cls) -> str:
        name = cls.backend_name or cls.__qualname__
        clock = "yes" if cls.supports_fake_clock else f"no (real {cls.real_lease_s} s leases)"
        direct = "yes" if cls.supports_direct_read else "no"
        virtual = "yes" if cls.supports_virtual_clock else "no"
        return (
            f"{name} [{cls.__module__}]: fake clock {clock}, direct read {direct}, "
            f"virtual clock {virtual}"
        )

    # -- hooks for the backend author --------------------------------------------------------
    @pytest.fixture
    def store_factory(self) -> StoreFactory:
        raise NotImplementedError(
            f"{type(self).__name__} must override the store_factory fixture: "
            "@pytest.fixture\ndef store_factory(self): return lambda: MyStore()"
        )

    def direct_read(self, store: DataStore, partition: str, row: int, field: str) -> CellValue:
        """The stored value of one cell, read without ``get_data`` (see
        ``supports_direct_read``)."""
        raise NotImplementedError

    # -- fixtures ----------------------------------------------------------------------------
    @pytest.fixture
    def clock(self) -> FakeClock | None:
        return FakeClock() if self.supports_fake_clock else None

    @pytest.fixture
    def store(self, store_factory: StoreFactory, clock: FakeClock | None) -> DataStore:
        return store_factory(clock=clock) if clock is not None else store_factory()

    def lease_s(self, clock: FakeClock | None) -> float:
        """A lease length that ``expire`` can end."""
        return 30.0 if clock is not None else self.real_lease_s

    async def expire(self, clock: FakeClock | None, lease_s: float) -> None:
        """Let every lease of ``lease_s`` taken so far pass its deadline."""
        if clock is not None:
            clock.advance(lease_s + 1.0)
        else:
            await asyncio.sleep(2 * lease_s + 0.02)  # real time: the store's own clock

    def need_fake_clock(self) -> None:
        if not self.supports_fake_clock:
            pytest.skip(
                f"{type(self).__name__} lacks the ability supports_fake_clock (a store_factory "
                "accepting clock=): exact lease deadlines cannot be tested on a real clock"
            )

    def need_virtual_clock(self) -> None:
        if not self.supports_virtual_clock:
            pytest.skip(
                f"{type(self).__name__} lacks the ability supports_virtual_clock (waits of "
                "get_meta and put on the event loop's clock): the 600 s default timeout "
                "cannot be tested without waiting 600 s"
            )

    # ========================================================================================
    # Partitions
    # ========================================================================================
    @async_test
    async def test_new_partition_is_empty(self, store: DataStore) -> None:
        await new_partition(store, tasks=("a", "b"))
        s = await store.stats("p")
        assert s.name == "p"
        assert tuple(s.fields) == ("x", "y")
        assert set(s.tasks) == {"a", "b"}
        assert not s.closed
        assert (s.rows_created, s.rows_live, s.bytes_live, s.reclaimed) == (0, 0, 0, 0)
        assert dict(s.ready) == {"x": 0, "y": 0}
        assert dict(s.consumed) == {"a": 0, "b": 0}
        assert dict(s.leased) == {"a": 0, "b": 0}
        assert s.capacity == Capacity()

    @async_test
    async def test_partitions_are_independent(self, store: DataStore) -> None:
        await new_partition(store, "p")
        await new_partition(store, "q", fields=("x",))
        assert await store.put("p", {"x": [1, 2, 3]}) == (0, 1, 2)
        assert await store.put("q", {"x": ["a"]}) == (0,)
        meta = await store.get_meta("q", "t", ["x"], 1, timeout=WAIT_S)
        assert meta.rows == (0,)
        assert (await store.get_data(meta))["x"] == ["a"]
        await store.ack(meta)
        p, q = await store.stats("p"), await store.stats("q")
        assert (p.rows_live, dict(p.consumed)) == (3, {"t": 0})
        assert q.rows_live == 0 and q.reclaimed == 1

    @async_test
    async def test_create_existing_partition_is_rejected(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [1]})
        await expect_rejected(
            store,
            lambda: store.create_partition("p", ["z"]),
            PartitionExistsError,
            "'p'",
            cells={"x": [0]},
        )
        # the old partition, with its fields, is still there
        await expect_rejected(
            store, lambda: store.put("p", {"z": [1]}), UnknownFieldError, "'z'", cells={"x": [0]}
        )
        assert await store.put("p", {"y": [2]}, rows=[0]) == (0,)

    @async_test
    async def test_delete_partition_drops_it(self, store: DataStore) -> None:
        await new_partition(store)
        await new_partition(store, "q")
        await store.put("p", {"x": [1, 2]})
        await store.put("q", {"x": [3]})
        await store.delete_partition("p")
        with pytest.raises(UnknownPartitionError, match="'p'"):
            await store.stats("p")
        assert (await store.stats("q")).rows_live == 1
        await new_partition(store, "p", fields=("z",))
        s = await store.stats("p")
        assert (s.rows_created, s.rows_live, tuple(s.fields)) == (0, 0, ("z",))
        assert await store.put("p", {"z": [7]}) == (0,)

    @async_test
    async def test_delete_partition_wakes_waiters(self, store: DataStore) -> None:
        await new_partition(store)
        waiter = asyncio.create_task(store.get_meta("p", "t", ["x"], 1, timeout=WAIT_S))
        await settle()
        assert not waiter.done()
        await store.delete_partition("p")
        with pytest.raises(UnknownPartitionError):
            await asyncio.wait_for(waiter, WAIT_S)

    @async_test
    async def test_register_task_is_idempotent(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [1, 2]})
        meta = await store.get_meta("p", "t", ["x"], 1, timeout=WAIT_S)
        await store.ack(meta)
        await store.register_task("p", "t")
        s = await store.stats("p")
        assert list(s.tasks).count("t") == 1 and s.consumed["t"] == 1
        again = await store.get_meta("p", "t", ["x"], 1, timeout=WAIT_S)
        assert again.rows == (1,)

    # ========================================================================================
    # Rows x fields
    # ========================================================================================
    @async_test
    async def test_new_rows_are_numbered_in_creation_order(self, store: DataStore) -> None:
        await new_partition(store)
        assert await store.put("p", {"x": [1, 2, 3]}) == (0, 1, 2)
        assert await store.put("p", {"x": [4, 5]}) == (3, 4)
        s = await store.stats("p")
        assert (s.rows_created, s.rows_live, dict(s.ready)) == (5, 5, {"x": 5, "y": 0})

    @async_test
    async def test_put_into_existing_rows_fills_their_cells(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [10, 11, 12]})
        assert await store.put("p", {"y": ["c", "a"]}, rows=[2, 0]) == (2, 0)
        assert dict((await store.stats("p")).ready) == {"x": 3, "y": 2}
        batch = await store.get_data(BatchMeta("p", "t", (0, 2), ("x", "y")))
        assert batch["x"] == [10, 12] and batch["y"] == ["a", "c"]

    @async_test
    async def test_a_tensor_is_split_along_dim_0(self, store: DataStore) -> None:
        await new_partition(store)
        rows = await store.put("p", {"x": torch.arange(6).reshape(3, 2)})
        assert rows == (0, 1, 2)
        batch = await store.get_data(BatchMeta("p", "t", rows, ("x",)), layout="list")
        assert [t.tolist() for t in batch["x"]] == [[0, 1], [2, 3], [4, 5]]

    @async_test
    async def test_get_data_reads_meta_fields_by_default(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [1, 2], "y": [3, 4]})
        meta = await store.get_meta("p", "t", ["y"], 2, timeout=WAIT_S)
        batch = await store.get_data(meta)
        assert batch.rows == (0, 1) and "y" in batch and "x" not in batch
        assert batch["y"] == [3, 4]
        both = await store.get_data(meta, ["x", "y"])
        assert both["x"] == [1, 2] and both["y"] == [3, 4]

    # ========================================================================================
    # Layouts
    # ========================================================================================
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
    @async_test
    async def test_ragged_tensors_round_trip_unpadded(
        self, store: DataStore, dtype: torch.dtype
    ) -> None:
        values = ragged([3, 0, 5, 1], dtype=dtype)
        await new_partition(store)
        rows = await store.put("p", {"x": values})
        batch = await store.get_data(BatchMeta("p", "t", rows, ("x",)), layout="list")
        for got, want in zip(batch["x"], values, strict=True):
            assert got.dtype == dtype and same(got, want)

    @async_test
    async def test_ragged_cells_are_stored_unpadded(self, store: DataStore) -> None:
        if not self.supports_direct_read:
            pytest.skip(
                f"{type(self).__name__} lacks the ability supports_direct_read "
                "(override direct_read to read a cell bypassing get_data)"
            )
        values = ragged([2, 7, 0])
        await new_partition(store)
        rows = await store.put("p", {"x": values})
        for row, want in zip(rows, values, strict=True):
            assert same(self.direct_read(store, "p", row, "x"), want)

    @pytest.mark.parametrize("pad_value", [0, -7])
    @async_test
    async def test_padded_layout_pads_and_reports_lengths(
        self, store: DataStore, pad_value: float
    ) -> None:
        values = ragged([3, 0, 5, 1], start=1)
        await new_partition(store)
        rows = await store.put("p", {"x": values})
        batch = await store.get_data(
            BatchMeta("p", "t", rows, ("x",)), layout="padded", pad_value=pad_value
        )
        data = batch["x"]
        assert tuple(data.shape) == (4, 5) and data.dtype == torch.float32
        assert batch.lengths["x"].tolist() == [3, 0, 5, 1]
        for i, v in enumerate(values):
            assert same(data[i, : len(v)], v)
            assert bool((data[i, len(v) :] == pad_value).all())

    @async_test
    async def test_padded_layout_keeps_trailing_dims(self, store: DataStore) -> None:
        values = [torch.ones(2, 3), torch.full((4, 3), 2.0)]
        await new_partition(store)
        rows = await store.put("p", {"x": values})
        batch = await store.get_data(BatchMeta("p", "t", rows, ("x",)), layout="padded")
        assert tuple(batch["x"].shape) == (2, 4, 3)
        for got, want in zip(unpack(batch, "x", "padded", 2), values, strict=True):
            assert same(got, want)

    @async_test
    async def test_nested_layout_round_trips_rows(self, store: DataStore) -> None:
        values = ragged([2, 0, 4], dtype=torch.int64)
        await new_partition(store)
        rows = await store.put("p", {"x": values})
        batch = await store.get_data(BatchMeta("p", "t", rows, ("x",)), layout="nested")
        for got, want in zip(unpack(batch, "x", "nested", 1), values, strict=True):
            assert same(got, want)

    @pytest.mark.parametrize("layout", ["padded", "nested", "list"])
    @async_test
    async def test_zero_dim_tensors(self, store: DataStore, layout: Layout) -> None:
        values = [torch.tensor(1.5), torch.tensor(-2.0), torch.tensor(0.0)]
        await new_partition(store)
        rows = await store.put("p", {"x": values})
        batch = await store.get_data(BatchMeta("p", "t", rows, ("x",)), layout=layout)
        got = unpack(batch, "x", layout, 0)
        if layout == "list":
            assert all(t.ndim == 0 for t in got)
        assert [cell_key(t) for t in got] == [cell_key(t) for t in values]

    @pytest.mark.parametrize("layout", ["padded", "nested", "list"])
    @async_test
    async def test_plain_values_round_trip(self, store: DataStore, layout: Layout) -> None:
        values: list[Any] = ["text", 3, 2.5, True, None, [1, "a"], {"k": [1, 2], "n": None}]
        await new_partition(store)
        rows = await store.put("p", {"y": values})
        batch = await store.get_data(BatchMeta("p", "t", rows, ("y",)), layout=layout)
        assert unpack(batch, "y", layout, None) == values

    @async_test
    async def test_tensor_and_plain_fields_in_one_batch(self, store: DataStore) -> None:
        await new_partition(store)
        values = ragged([1, 3])
        await store.put("p", {"x": values, "y": ["a", "b"]})
        meta = await store.get_meta("p", "t", ["x", "y"], 2, timeout=WAIT_S)
        batch = await store.get_data(meta)
        assert batch["y"] == ["a", "b"]
        got = unpack(batch, "x", "padded", 1)
        assert all(same(g, w) for g, w in zip(got, values, strict=True))

    # -- get_data(..., out=): reusing an earlier batch's buffers changes no answer -------------
    async def _put_step(
        self, store: DataStore, lengths: Sequence[int], step: int
    ) -> tuple[int, ...]:
        """Rows of every kind of field: ragged 1-d floats, ragged [len, 2] ints, 0-dim, plain."""
        return await store.put(
            "p",
            {
                "x": ragged(lengths, start=1000 * step),
                "z": [torch.arange(2 * n, dtype=torch.int64).reshape(n, 2) + step for n in lengths],
                "s": [torch.tensor(float(step + i)) for i in range(len(lengths))],
                "y": [f"row {step}.{i}" for i in range(len(lengths))],
            },
        )

    @pytest.mark.parametrize("layout", ["padded", "nested", "list"])
    @async_test
    async def test_get_data_with_out_equals_get_data_without(
        self, store: DataStore, layout: Layout
    ) -> None:
        """Each step reads its batch twice, without ``out`` and with the previous step's batch
        as ``out``; the answers are equal while row counts and lengths shrink and grow, and
        when ``out`` holds other fields than the read."""
        await new_partition(store, fields=("x", "z", "s", "y"))
        steps: list[tuple[list[int], tuple[str, ...], float]] = [
            ([3, 1, 4], ("x", "z", "s", "y"), 0),
            ([6, 2, 5, 0, 7], ("x", "z", "s", "y"), -1),  # more rows, longer
            ([1], ("x", "z", "s", "y"), 0),  # fewer, shorter
            ([2, 2], ("z",), 5),  # out holds x, z, s, y; read z alone
            ([9, 3, 3, 8, 1, 1], ("x", "s"), 0),  # out holds z alone; read x and s
            ([4, 12, 2], ("y", "x"), 2.5),
            ([3, 0, 1, 2, 5, 1, 1, 4, 2, 2, 3, 1], ("x", "z", "s"), -3),  # many short rows
            ([2, 1, 1, 1, 1, 1, 1, 1, 1, 1], ("x", "z", "s"), 7),
        ]
        prev: Batch | None = None
        for step, (lengths, fields, pad_value) in enumerate(steps):
            rows = await self._put_step(store, lengths, step)
            meta = BatchMeta("p", "t", rows, fields)
            want = await store.get_data(meta, layout=layout, pad_value=pad_value)
            got = await store.get_data(meta, layout=layout, pad_value=pad_value, out=prev)
            assert batch_key(got) == batch_key(want), f"step {step}: out= changed the batch"
            assert batch_key(want) == batch_key(
                await store.get_data(meta, layout=layout, pad_value=pad_value)
            ), f"step {step}: a read with out= changed the stored values"
            prev = got

    @async_test
    async def test_out_from_another_layout_changes_nothing(self, store: DataStore) -> None:
        """``out`` from any layout, passed to a read of any other: the same answer, and the
        stored cells (which a "list" batch hands out as they are) stay as they were."""
        await new_partition(store, fields=("x", "z", "s", "y"))
        rows = await self._put_step(store, [4, 1, 6], 0)
        meta = BatchMeta("p", "t", rows, ("x", "z", "s", "y"))
        stored = await snapshot(store, "p", {f: list(rows) for f in ("x", "z", "s", "y")})
        prev: Batch | None = None
        for layout in ["list", "padded", "nested", "list", "nested", "padded", "list"]:
            got = await store.get_data(meta, layout=layout, out=prev)  # type: ignore[arg-type]
            want = await store.get_data(meta, layout=layout)  # type: ignore[arg-type]
            assert batch_key(got) == batch_key(want), f"layout {layout}: out= changed the batch"
            prev = got
        assert await snapshot(store, "p", {f: list(rows) for f in ("x", "z", "s", "y")}) == stored

    @pytest.mark.parametrize("bad", ["dict", "tensor", "list"])
    @async_test
    async def test_out_that_is_not_a_batch_is_rejected(self, store: DataStore, bad: str) -> None:
        await new_partition(store)
        await store.put("p", {"x": ragged([2, 3])})
        out: Any = {
            "dict": {"x": torch.zeros(2, 3)},
            "tensor": torch.zeros(2, 3),
            "list": [torch.zeros(3)],
        }[bad]
        await expect_rejected(
            store,
            lambda: store.get_data(BatchMeta("p", "t", (0, 1), ("x",)), out=out),
            BadRequestError,
            "out",
            cells={"x": [0, 1]},
        )

    # ========================================================================================
    # Readiness and waiting
    # ========================================================================================
    @async_test
    async def test_readiness_is_per_row_and_field(self, store: DataStore) -> None:
        await new_partition(store, tasks=("a", "b"))
        await store.put("p", {"x": [0, 1, 2]})
        await store.put("p", {"y": ["one"]}, rows=[1])
        assert dict((await store.stats("p")).ready) == {"x": 3, "y": 1}
        both = await store.get_meta("p", "a", ["x", "y"], 1, timeout=WAIT_S)
        assert both.rows == (1,)
        with pytest.raises(StoreTimeoutError):
            await store.get_meta("p", "a", ["x", "y"], 1, timeout=0)
        only_x = await store.get_meta("p", "b", ["x"], 3, timeout=WAIT_S)
        assert only_x.rows == (0, 1, 2)

    @async_test
    async def test_consumer_waits_for_every_requested_field(self, store: DataStore) -> None:
        await new_partition(store)
        waiter = asyncio.create_task(store.get_meta("p", "t", ["x", "y"], 1, timeout=WAIT_S))
        (row,) = await store.put("p", {"x": [5]})
        await settle()
        assert not waiter.done(), "served a row whose field 'y' was not written"
        await store.put("p", {"y": [6]}, rows=[row])
        meta = await asyncio.wait_for(waiter, WAIT_S)
        assert meta.rows == (row,)

    @async_test
    async def test_get_meta_waits_then_wakes_when_data_arrives(self, store: DataStore) -> None:
        await new_partition(store)
        waiter = asyncio.create_task(store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S))
        await settle()
        assert not waiter.done()
        await store.put("p", {"x": [1]})
        await settle()
        assert not waiter.done(), "served a short batch before close"
        await store.put("p", {"x": [2]})
        meta = await asyncio.wait_for(waiter, WAIT_S)
        assert meta.rows == (0, 1)

    @async_test
    async def test_a_waiter_in_another_thread_wakes_on_put(self, store: DataStore) -> None:
        """Engines run in worker threads, each with its own event loop: a put here must wake a
        get_meta waiting there."""
        await new_partition(store)
        ready = threading.Event()
        result: list[BatchMeta | BaseException] = []

        async def wait_there() -> None:
            task = asyncio.create_task(store.get_meta("p", "t", ["x"], 1, timeout=WAIT_S))
            await settle()
            ready.set()
            result.append(await task)

        def thread_main() -> None:
            try:
                asyncio.run(wait_there())
            except BaseException as e:  # reported by the test thread
                result.append(e)
                ready.set()

        thread = threading.Thread(target=thread_main, daemon=True)
        thread.start()
        assert await asyncio.to_thread(ready.wait, WAIT_S)
        assert not result, f"get_meta returned before any put: {result}"
        await store.put("p", {"x": [7]})
        await asyncio.to_thread(thread.join, WAIT_S)
        assert result and isinstance(result[0], BatchMeta), f"the waiter was not woken: {result}"
        assert result[0].rows == (0,)

    @async_test
    async def test_timeout_raises_and_leases_nothing(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [1, 2]})
        for timeout in (0, 0.05):
            err = await expect_rejected(
                store,
                functools.partial(store.get_meta, "p", "t", ["x"], 3, timeout=timeout),
                StoreTimeoutError,
                "'p'",
                cells={"x": [0, 1]},
            )
            assert isinstance(err, TimeoutError)
        await store.put("p", {"x": [3]})
        meta = await store.get_meta("p", "t", ["x"], 3, timeout=0)
        assert meta.rows == (0, 1, 2)

    @async_test
    async def test_timeout_zero_serves_a_ready_batch(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [1, 2, 3]})
        meta = await store.get_meta("p", "t", ["x"], 2, timeout=0)
        assert meta.rows == (0, 1) and not meta.end_of_stream

    # -- the protocol's defaults: DEFAULT_LEASE_S, DEFAULT_GET_TIMEOUT_S, timeout=None ---------
    @pytest.mark.parametrize("default", ["lease_s", "get_meta_timeout", "put_timeout"])
    def test_defaults_are_the_protocols(
        self, store: DataStore, clock: FakeClock | None, default: str
    ) -> None:
        """A ``get_meta`` without ``lease_s`` leases for ``DEFAULT_LEASE_S``; a ``get_meta`` or a
        ``put`` of new rows without ``timeout`` waits ``DEFAULT_GET_TIMEOUT_S``, not less (never
        a short trap) and not more; ``timeout=None`` waits without a limit. The timeouts run on
        a ``VirtualClockLoop`` (``supports_virtual_clock``): 600 s of loop time pass at once."""
        if default == "lease_s":
            asyncio.run(self._default_lease(store, clock))
        else:
            self.need_virtual_clock()
            run_virtual(self._default_timeout(store, default), deadlock_timeout=WAIT_S)

    async def _default_lease(self, store: DataStore, clock: FakeClock | None) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0, 1]})
        if clock is None:  # the store's clock is its own: compare with an explicit lease
            start = time.monotonic()
            explicit = await store.get_meta("p", "t", ["x"], 1, timeout=WAIT_S, lease_s=60.0)
            default = await store.get_meta("p", "t", ["x"], 1, timeout=WAIT_S)
            slack = time.monotonic() - start + 1.0
            gap = default.deadline - explicit.deadline  # DEFAULT_LEASE_S - 60, plus the time
            assert abs(gap - (DEFAULT_LEASE_S - 60.0)) <= slack, (
                f"a lease taken without lease_s ends {gap:.1f} s after one of lease_s=60 taken "
                f"just before: its length is not the protocol's DEFAULT_LEASE_S = "
                f"{DEFAULT_LEASE_S} s"
            )
            await store.ack(explicit)
            await store.ack(default)
            return
        meta = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S)
        assert meta.deadline == pytest.approx(clock() + DEFAULT_LEASE_S), (
            f"a lease taken without lease_s ends {meta.deadline - clock()} s from now; the "
            f"protocol's default is DEFAULT_LEASE_S = {DEFAULT_LEASE_S} s"
        )
        clock.advance(DEFAULT_LEASE_S - 1.0)  # just before the default deadline: still held
        try:
            early = await store.get_meta("p", "t", ["x"], 2, timeout=0)
        except StoreTimeoutError:
            pass
        else:
            raise AssertionError(
                f"rows {early.rows} of a lease taken without lease_s were handed out again "
                f"{DEFAULT_LEASE_S - 1.0} s later, before DEFAULT_LEASE_S = {DEFAULT_LEASE_S} s"
            )
        clock.advance(2.0)  # just after: the rows go back
        again = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S)
        assert again.rows == meta.rows, (
            f"a lease taken without lease_s still held its rows past DEFAULT_LEASE_S = "
            f"{DEFAULT_LEASE_S} s: got {again.rows}"
        )
        await store.ack(again)

    async def _default_timeout(self, store: DataStore, default: str) -> None:
        """One call of each kind with its ``timeout`` left out, then one with ``None``: the
        first times out at loop time ``DEFAULT_GET_TIMEOUT_S``, the second is still waiting at
        ten times that and takes what then arrives."""
        loop = asyncio.get_running_loop()
        limit = DEFAULT_GET_TIMEOUT_S
        cells: dict[str, list[int]] = {}
        if default == "get_meta_timeout":
            await new_partition(store)
            what = "get_meta of an empty partition"

            def wait(forever: bool = False) -> Awaitable[Any]:
                if forever:
                    return store.get_meta("p", "t", ["x"], 1, timeout=None)
                return store.get_meta("p", "t", ["x"], 1)

            async def unblock() -> None:
                await store.put("p", {"x": [7]})

            wanted = (0,)  # the rows of the meta the waiter then gets
        else:
            await new_partition(store, fields=("x",), capacity=Capacity(max_rows=1))
            await store.put("p", {"x": [0]})
            cells = {"x": [0]}
            what = "put of a new row into a full partition"

            def wait(forever: bool = False) -> Awaitable[Any]:
                if forever:
                    return store.put("p", {"x": [1]}, timeout=None)
                return store.put("p", {"x": [1]})

            async def unblock() -> None:
                await store.ack(await store.get_meta("p", "t", ["x"], 1, timeout=WAIT_S))

            wanted = (1,)  # the rows the put then creates

        before = await snapshot(store, "p", cells)
        start = loop.time()
        call = asyncio.ensure_future(wait())
        await asyncio.wait({call}, timeout=10 * limit)
        waited = loop.time() - start
        if not call.done():
            call.cancel()
            raise AssertionError(
                f"{what} without a timeout still waited after {waited:.0f} s of loop time; the "
                f"protocol's default is DEFAULT_GET_TIMEOUT_S = {limit} s"
            )
        error = call.exception()
        if error is None:
            raise AssertionError(f"{what} returned {call.result()!r:.200} with nothing to give")
        if not isinstance(error, StoreTimeoutError):
            raise error
        assert limit - 0.01 <= waited <= limit + 1.0, (
            f"{what} without a timeout gave up after {waited:.3f} s of loop time; the "
            f"protocol's default is DEFAULT_GET_TIMEOUT_S = {limit} s"
        )
        assert "'p'" in str(error), f"StoreTimeoutError message does not name 'p': {error}"
        assert await snapshot(store, "p", cells) == before, f"a timed-out {what} changed the store"

        start = loop.time()
        call = asyncio.ensure_future(wait(forever=True))
        await asyncio.wait({call}, timeout=10 * limit)
        if call.done():
            ended = call.exception() or call.result()
            raise AssertionError(
                f"{what} with timeout=None ended after {loop.time() - start:.3f} s of loop "
                f"time ({ended!r:.200}); None waits without a limit"
            )
        await unblock()
        got = await asyncio.wait_for(call, WAIT_S)
        rows = got.rows if isinstance(got, BatchMeta) else got
        assert rows == wanted, (
            f"{what} with timeout=None, woken after {10 * limit} s, gave {got!r:.200}"
        )

    # ========================================================================================
    # Consumption per task
    # ========================================================================================
    @async_test
    async def test_each_task_gets_every_row_once(self, store: DataStore) -> None:
        await new_partition(store, tasks=("a", "b"))
        await store.put("p", {"x": list(range(7))})
        await store.close("p")
        for task in ("a", "b"):
            got: list[int] = []
            values: list[Any] = []
            for _ in range(8):  # 4 batches and the end; a few more to report a broken store
                meta = await store.get_meta("p", task, ["x"], 2, timeout=WAIT_S)
                if meta.end_of_stream:
                    assert meta.rows == ()
                    break
                again = set(got) & set(meta.rows)
                assert not again, f"rows {sorted(again)} delivered to {task!r} twice"
                got += meta.rows
                values += (await store.get_data(meta))["x"]
                await store.ack(meta)
            else:
                pytest.fail(f"task {task!r} got no end of stream after 8 batches")
            assert got == list(range(7)) and values == list(range(7))
        s = await store.stats("p")
        assert dict(s.consumed) == {"a": 7, "b": 7} and s.rows_live == 0

    @async_test
    async def test_concurrent_consumers_of_a_task_get_disjoint_rows(self, store: DataStore) -> None:
        await new_partition(store)
        got: list[int] = []

        async def consume() -> None:
            while True:
                meta = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S)
                if meta.end_of_stream:
                    return
                again = set(got) & set(meta.rows)
                assert not again, f"rows {sorted(again)} delivered twice"
                got.extend(meta.rows)
                await settle()
                await store.ack(meta)

        consumers = [asyncio.create_task(consume()) for _ in range(3)]
        for start in range(0, 12, 3):
            await store.put("p", {"x": list(range(start, start + 3))})
            await settle()
        await store.close("p")
        await asyncio.wait_for(asyncio.gather(*consumers), WAIT_S)
        assert sorted(got) == list(range(12))

    @async_test
    async def test_default_sampler_serves_lowest_rows_first(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0, 1, 2, 3, 4]})
        first = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S)
        second = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S)
        assert (first.rows, second.rows) == ((0, 1), (2, 3))
        assert first.lease_id and second.lease_id and first.lease_id != second.lease_id
        assert (first.partition, first.task, first.fields) == ("p", "t", ("x",))

    # ========================================================================================
    # Close and end of stream
    # ========================================================================================
    @async_test
    async def test_close_gives_short_final_batch_then_end(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0, 1, 2, 3, 4]})
        first = await store.get_meta("p", "t", ["x"], 3, timeout=WAIT_S)
        await store.ack(first)
        with pytest.raises(StoreTimeoutError):
            await store.get_meta("p", "t", ["x"], 3, timeout=0)
        await store.close("p")
        assert (await store.stats("p")).closed
        last = await store.get_meta("p", "t", ["x"], 3, timeout=WAIT_S)
        assert last.rows == (3, 4) and not last.end_of_stream
        await store.ack(last)
        for _ in range(2):  # the end repeats
            end = await store.get_meta("p", "t", ["x"], 3, timeout=WAIT_S)
            assert end.end_of_stream and end.rows == ()

    @async_test
    async def test_close_wakes_a_waiter_with_the_short_batch(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0, 1]})
        waiter = asyncio.create_task(store.get_meta("p", "t", ["x"], 3, timeout=WAIT_S))
        await settle()
        assert not waiter.done()
        await store.close("p")
        meta = await asyncio.wait_for(waiter, WAIT_S)
        assert meta.rows == (0, 1)

    @async_test
    async def test_close_wakes_a_waiter_with_end_of_stream(self, store: DataStore) -> None:
        await new_partition(store, tasks=("a", "b"))
        waiters = [
            asyncio.create_task(store.get_meta("p", task, ["x"], 2, timeout=WAIT_S))
            for task in ("a", "a", "b")
        ]
        await settle()
        assert not any(w.done() for w in waiters)
        await store.close("p")
        for meta in await asyncio.wait_for(asyncio.gather(*waiters), WAIT_S):
            assert meta.end_of_stream and meta.rows == ()

    @async_test
    async def test_no_end_of_stream_while_rows_are_leased(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0, 1]})
        await store.close("p")
        meta = await store.get_meta("p", "t", ["x"], 5, timeout=WAIT_S)
        assert meta.rows == (0, 1)
        with pytest.raises(StoreTimeoutError):
            await store.get_meta("p", "t", ["x"], 5, timeout=0)
        await store.nack(meta)
        again = await store.get_meta("p", "t", ["x"], 5, timeout=WAIT_S)
        assert again.rows == (0, 1)
        await store.ack(again)
        end = await store.get_meta("p", "t", ["x"], 5, timeout=WAIT_S)
        assert end.end_of_stream

    @async_test
    async def test_closed_partition_keeps_existing_rows_writable(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0, 1]})
        await store.close("p")
        assert await store.put("p", {"y": ["a", "b"]}, rows=[0, 1]) == (0, 1)
        meta = await store.get_meta("p", "t", ["x", "y"], 2, timeout=WAIT_S)
        assert (await store.get_data(meta))["y"] == ["a", "b"]

    # ========================================================================================
    # Ack and nack
    # ========================================================================================
    @async_test
    async def test_ack_commits_rows(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0, 1, 2]})
        meta = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S)
        assert dict((await store.stats("p")).leased) == {"t": 2}
        await store.ack(meta)
        s = await store.stats("p")
        assert (dict(s.leased), dict(s.consumed)) == ({"t": 0}, {"t": 2})
        with pytest.raises(StoreTimeoutError):
            await store.get_meta("p", "t", ["x"], 2, timeout=0)
        await store.close("p")
        last = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S)
        assert last.rows == (2,)

    @async_test
    async def test_nack_redelivers_rows(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0, 1, 2]})
        meta = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S)
        await store.nack(meta)
        s = await store.stats("p")
        assert (dict(s.leased), dict(s.consumed)) == ({"t": 0}, {"t": 0})
        again = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S)
        assert again.rows == meta.rows and again.lease_id != meta.lease_id
        await store.ack(again)
        assert dict((await store.stats("p")).consumed) == {"t": 2}

    @async_test
    async def test_unexpired_lease_is_not_redelivered(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0, 1]})
        await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S)
        with pytest.raises(StoreTimeoutError):
            await store.get_meta("p", "t", ["x"], 1, timeout=0.05)

    @async_test
    async def test_nack_wakes_a_waiter(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0, 1]})
        held = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S)
        waiter = asyncio.create_task(store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S))
        await settle()
        assert not waiter.done()
        await store.nack(held)
        assert (await asyncio.wait_for(waiter, WAIT_S)).rows == (0, 1)

    # ========================================================================================
    # Lease expiry
    # ========================================================================================
    @async_test
    async def test_lease_expiry_redelivers_rows(
        self, store: DataStore, clock: FakeClock | None
    ) -> None:
        lease_s = self.lease_s(clock)
        await new_partition(store)
        await store.put("p", {"x": [0, 1, 2]})
        meta = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S, lease_s=lease_s)
        await self.expire(clock, lease_s)
        assert dict((await store.stats("p")).leased) == {"t": 0}
        again = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S)
        assert again.rows == meta.rows and again.lease_id != meta.lease_id

    @async_test
    async def test_late_ack_raises_and_does_not_double_deliver(
        self, store: DataStore, clock: FakeClock | None
    ) -> None:
        lease_s = self.lease_s(clock)
        await new_partition(store)
        await store.put("p", {"x": [0, 1]})
        late = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S, lease_s=lease_s)
        await self.expire(clock, lease_s)
        again = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S)
        assert again.rows == late.rows
        assert late.lease_id is not None
        await expect_rejected(
            store, lambda: store.ack(late), LeaseExpiredError, late.lease_id, cells={"x": [0, 1]}
        )
        await store.ack(again)
        await store.close("p")
        end = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S)
        assert end.end_of_stream
        assert dict((await store.stats("p")).consumed) == {"t": 2}

    @pytest.mark.parametrize("verb", ["ack", "nack"])
    @async_test
    async def test_ack_or_nack_after_expiry_raises_lease_expired(
        self, store: DataStore, clock: FakeClock | None, verb: str
    ) -> None:
        lease_s = self.lease_s(clock)
        await new_partition(store)
        await store.put("p", {"x": [0, 1]})
        meta = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S, lease_s=lease_s)
        await self.expire(clock, lease_s)
        assert meta.lease_id is not None
        call = store.ack if verb == "ack" else store.nack
        await expect_rejected(
            store, lambda: call(meta), LeaseExpiredError, meta.lease_id, cells={"x": [0, 1]}
        )
        again = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S)
        assert again.rows == (0, 1)
        await store.ack(again)
        with pytest.raises(StoreTimeoutError):
            await store.get_meta("p", "t", ["x"], 1, timeout=0)

    @async_test
    async def test_a_waiter_gets_rows_when_a_lease_expires(
        self, store_factory: StoreFactory
    ) -> None:
        """Nothing but time passes: the waiter must notice the deadline by itself. Runs on a
        real clock (``store_factory()``), as a fake clock's advance is no event a store sees."""
        store = store_factory()
        await new_partition(store)
        await store.put("p", {"x": [0, 1]})
        await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S, lease_s=self.real_lease_s)
        waiter = asyncio.create_task(store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S))
        assert (await asyncio.wait_for(waiter, WAIT_S)).rows == (0, 1)

    @async_test
    async def test_lease_deadline_is_on_the_store_clock(
        self, store: DataStore, clock: FakeClock | None
    ) -> None:
        self.need_fake_clock()
        assert clock is not None
        await new_partition(store)
        await store.put("p", {"x": [0, 1]})
        meta = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S, lease_s=10.0)
        assert meta.deadline == pytest.approx(clock() + 10.0)
        clock.advance(9.5)  # just before the deadline: still held
        with pytest.raises(StoreTimeoutError):
            await store.get_meta("p", "t", ["x"], 1, timeout=0)
        await store.ack(meta)
        assert dict((await store.stats("p")).consumed) == {"t": 2}

    @async_test
    async def test_expiry_hands_back_only_expired_leases(
        self, store: DataStore, clock: FakeClock | None
    ) -> None:
        self.need_fake_clock()
        assert clock is not None
        await new_partition(store)
        await store.put("p", {"x": [0, 1, 2, 3]})
        short = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S, lease_s=5.0)
        long = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S, lease_s=50.0)
        clock.advance(6.0)
        again = await store.get_meta("p", "t", ["x"], 2, timeout=0, lease_s=50.0)
        assert again.rows == short.rows == (0, 1)
        await store.ack(long)
        await store.ack(again)
        assert dict((await store.stats("p")).consumed) == {"t": 4}

    # ========================================================================================
    # The folded ack: get_meta(..., ack=meta)
    # ========================================================================================
    def need_ack_fold(self, store: DataStore) -> None:
        if not folds_ack(store):
            pytest.skip(
                f"{type(store).__name__}.get_meta lacks the ability to fold an ack (its ack= "
                "parameter, DataStore.get_meta); callers fall back to ack() then get_meta()"
            )

    @async_test
    async def test_folded_ack_commits_then_leases(self, store: DataStore) -> None:
        self.need_ack_fold(store)
        await new_partition(store)
        await store.put("p", {"x": [0, 1, 2, 3, 4]})
        first = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S)
        second = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S, ack=first)
        assert (first.rows, second.rows) == ((0, 1), (2, 3))
        s = await store.stats("p")
        assert (dict(s.consumed), dict(s.leased)) == ({"t": 2}, {"t": 2})
        await store.close("p")
        last = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S, ack=second)
        assert last.rows == (4,), "acked rows must never be delivered again"
        end = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S, ack=last)
        assert end.end_of_stream, "the ack of the last batch lets the end of stream through"
        s = await store.stats("p")
        assert (dict(s.consumed), dict(s.leased), s.rows_live) == ({"t": 5}, {"t": 0}, 0)
        for meta in (first, second, last):  # committed exactly once
            assert meta.lease_id is not None
            await expect_rejected(store, lambda m=meta: store.ack(m), LeaseError, meta.lease_id)

    @async_test
    async def test_folded_ack_may_be_another_tasks_lease(self, store: DataStore) -> None:
        self.need_ack_fold(store)
        await new_partition(store, tasks=("t", "u"))
        await store.put("p", {"x": [0, 1]})
        theirs = await store.get_meta("p", "u", ["x"], 2, timeout=WAIT_S)
        mine = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S, ack=theirs)
        assert mine.rows == (0, 1)
        assert dict((await store.stats("p")).consumed) == {"t": 0, "u": 2}

    @pytest.mark.parametrize("case", ["acked", "nacked", "forged", "not_a_meta", "expired"])
    @async_test
    async def test_a_failing_folded_ack_leases_nothing(
        self, store: DataStore, clock: FakeClock | None, case: str
    ) -> None:
        self.need_ack_fold(store)
        lease_s = self.lease_s(clock)
        await new_partition(store)
        await store.put("p", {"x": [0, 1, 2, 3]})
        meta = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S, lease_s=lease_s)
        assert meta.lease_id is not None
        bad: Any = meta
        error: type[AsyncFlowError] = LeaseError
        mention = meta.lease_id
        if case == "acked":
            await store.ack(meta)
        elif case == "nacked":
            await store.nack(meta)
        elif case == "forged":
            bad = BatchMeta("p", "t", (0, 1), ("x",), lease_id="forged-lease-7")
            mention = "forged-lease-7"
        elif case == "not_a_meta":
            bad, error, mention = "lease-7", BadRequestError, "lease-7"
        else:
            await self.expire(clock, lease_s)
            error = LeaseExpiredError
        err = await expect_rejected(
            store,
            lambda: store.get_meta("p", "t", ["x"], 2, timeout=0, ack=bad),
            error,
            mention,
            cells={"x": [0, 1, 2, 3]} if case != "acked" else {"x": [2, 3]},
        )
        if case not in ("expired", "not_a_meta"):
            assert not isinstance(err, LeaseExpiredError), "the lease did not expire"
        # the rejected call leased nothing: the next plain get_meta sees the same rows
        expected = {"acked": (2, 3), "forged": (2, 3), "not_a_meta": (2, 3)}.get(case, (0, 1, 2, 3))
        again = await store.get_meta("p", "t", ["x"], len(expected), timeout=0)
        assert again.rows == expected

    @async_test
    async def test_an_ack_folded_into_a_timed_out_get_meta_stays_committed(
        self, store: DataStore
    ) -> None:
        self.need_ack_fold(store)
        await new_partition(store)
        await store.put("p", {"x": [0, 1]})
        meta = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S)
        assert meta.lease_id is not None
        with pytest.raises(StoreTimeoutError):
            await store.get_meta("p", "t", ["x"], 1, timeout=0.05, ack=meta)
        s = await store.stats("p")
        assert (dict(s.consumed), dict(s.leased)) == ({"t": 2}, {"t": 0})
        await expect_rejected(store, lambda: store.ack(meta), LeaseError, meta.lease_id)
        await store.close("p")
        assert (await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S)).end_of_stream

    @async_test
    async def test_an_ack_folded_into_a_cancelled_get_meta_stays_committed(
        self, store: DataStore
    ) -> None:
        self.need_ack_fold(store)
        await new_partition(store)
        await store.put("p", {"x": [0, 1]})
        meta = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S)
        waiter = asyncio.create_task(store.get_meta("p", "t", ["x"], 1, timeout=WAIT_S, ack=meta))
        await settle()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        # a remote store may commit it just after the cancellation: wait for it, not for time
        loop = asyncio.get_running_loop()
        until = loop.time() + WAIT_S
        while dict((await store.stats("p")).consumed) != {"t": 2}:
            assert loop.time() < until, "the ack of a cancelled get_meta was never committed"
            await asyncio.sleep(0.01)
        await store.close("p")
        assert (await store.get_meta("p", "t", ["x"], 1, timeout=WAIT_S)).end_of_stream

    @pytest.mark.parametrize(
        ("case", "error", "mention"),
        [
            ("batch_size", BadRequestError, "batch_size"),
            ("lease_s", BadRequestError, "lease_s"),
            ("dp_rank", BadRequestError, "dp_rank"),
            ("member", BadRequestError, "member"),
            ("timeout", BadRequestError, "-1.5"),
            ("no_fields", BadRequestError, "fields"),
            ("partition", UnknownPartitionError, "'nope'"),
            ("field", UnknownFieldError, "'zz'"),
            ("task", UnknownTaskError, "'ghost'"),
        ],
    )
    @async_test
    async def test_a_rejected_get_meta_commits_no_folded_ack(
        self, store: DataStore, case: str, error: type[AsyncFlowError], mention: str
    ) -> None:
        self.need_ack_fold(store)
        await new_partition(store)
        await store.put("p", {"x": [0, 1, 2]})
        meta = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S)
        args: dict[str, Any] = {"partition": "p", "task": "t", "fields": ["x"], "batch_size": 1}
        kwargs: dict[str, Any] = {"timeout": 0}
        if case == "batch_size":
            args["batch_size"] = 0
        elif case == "no_fields":
            args["fields"] = []
        elif case == "partition":
            args["partition"] = "nope"
        elif case == "field":
            args["fields"] = ["x", "zz"]
        elif case == "task":
            args["task"] = "ghost"
        else:
            kwargs.update(
                {
                    "lease_s": {"lease_s": 0.0},
                    "dp_rank": {"dp_rank": 2, "dp_size": 2},
                    "member": {"member": 1},  # the default sampler serves one member
                    "timeout": {"timeout": -1.5},
                }[case]
            )
        await expect_rejected(
            store,
            lambda: store.get_meta(**args, **kwargs, ack=meta),
            error,
            mention,
            cells={"x": [0, 1, 2]},
        )
        await store.ack(meta)  # still held: the rejected call did not commit it
        assert dict((await store.stats("p")).consumed) == {"t": 2}

    # ========================================================================================
    # Capacity and reclamation
    # ========================================================================================
    @async_test
    async def test_capacity_back_pressure_until_every_task_acks(self, store: DataStore) -> None:
        await new_partition(store, fields=("x",), tasks=("a", "b"), capacity=Capacity(max_rows=2))
        await store.put("p", {"x": [0, 1]})
        producer = asyncio.create_task(store.put("p", {"x": [2]}, timeout=WAIT_S))
        await settle()
        assert not producer.done(), "a put of new rows went past max_rows"
        meta_a = await store.get_meta("p", "a", ["x"], 2, timeout=WAIT_S)
        await store.ack(meta_a)
        await settle()
        assert not producer.done(), "rows were freed before task 'b' consumed them"
        assert (await store.stats("p")).rows_live == 2
        meta_b = await store.get_meta("p", "b", ["x"], 2, timeout=WAIT_S)
        await store.ack(meta_b)
        assert await asyncio.wait_for(producer, WAIT_S) == (2,)
        s = await store.stats("p")
        assert s.rows_live == 1 and s.rows_live <= 2
        await store.close("p")
        for task in ("a", "b"):  # nothing was dropped: the blocked row reaches every task
            meta = await store.get_meta("p", task, ["x"], 2, timeout=WAIT_S)
            assert meta.rows == (2,)
            assert (await store.get_data(meta))["x"] == [2]

    @async_test
    async def test_full_partition_put_times_out_and_changes_nothing(self, store: DataStore) -> None:
        await new_partition(store, fields=("x",), capacity=Capacity(max_rows=2))
        await store.put("p", {"x": [0, 1]})
        for timeout in (0, 0.05):
            await expect_rejected(
                store,
                functools.partial(store.put, "p", {"x": [2]}, timeout=timeout),
                StoreTimeoutError,
                "'p'",
                cells={"x": [0, 1]},
            )
        meta = await store.get_meta("p", "t", ["x"], 1, timeout=WAIT_S)
        await store.ack(meta)
        assert await store.put("p", {"x": [2]}, timeout=0) == (2,)

    @async_test
    async def test_put_bigger_than_capacity_is_rejected(self, store: DataStore) -> None:
        await new_partition(store, fields=("x",), capacity=Capacity(max_rows=2))
        await store.put("p", {"x": [0]})
        await expect_rejected(
            store, lambda: store.put("p", {"x": [1, 2, 3]}), CapacityError, "2", cells={"x": [0]}
        )
        assert await store.put("p", {"x": [1]}) == (1,)

    @async_test
    async def test_byte_capacity_back_pressure(self, store: DataStore) -> None:
        await new_partition(store, capacity=Capacity(max_bytes=1000))
        await store.put("p", {"x": [torch.zeros(100), torch.ones(100)]})  # 400 bytes each
        assert (await store.stats("p")).bytes_live >= 800
        await expect_rejected(
            store,
            lambda: store.put("p", {"x": [torch.zeros(100)]}, timeout=0),
            StoreTimeoutError,
            "'p'",
            cells={"x": [0, 1]},
        )
        await expect_rejected(
            store,
            lambda: store.put("p", {"x": [torch.zeros(300)]}),
            CapacityError,
            "1000",
            cells={"x": [0, 1]},
        )
        # a write into an existing row is never blocked, but counts
        before = (await store.stats("p")).bytes_live
        await store.put("p", {"y": [torch.zeros(50)]}, rows=[0], timeout=0)
        assert (await store.stats("p")).bytes_live > before
        meta = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S)
        await store.ack(meta)
        assert (await store.stats("p")).bytes_live == 0
        assert await store.put("p", {"x": [torch.zeros(100)]}, timeout=0) == (2,)

    @async_test
    async def test_writes_into_existing_rows_ignore_capacity(self, store: DataStore) -> None:
        await new_partition(store, capacity=Capacity(max_rows=2))
        await store.put("p", {"x": [0, 1]})
        assert await store.put("p", {"y": ["a", "b"]}, rows=[0, 1], timeout=0) == (0, 1)
        assert await store.put("p", {"y": ["c"]}, rows=[1], overwrite=True, timeout=0) == (1,)

    @async_test
    async def test_rows_are_reclaimed_once_every_task_consumed(self, store: DataStore) -> None:
        await new_partition(store, tasks=("a", "b"))
        await store.put("p", {"x": [0, 1, 2]})
        meta_a = await store.get_meta("p", "a", ["x"], 2, timeout=WAIT_S)
        await store.ack(meta_a)
        s = await store.stats("p")
        assert (s.rows_live, s.reclaimed) == (3, 0)
        meta_b = await store.get_meta("p", "b", ["x"], 2, timeout=WAIT_S)
        await store.ack(meta_b)
        s = await store.stats("p")
        assert (s.rows_live, s.reclaimed, s.rows_created) == (1, 2, 3)
        assert dict(s.ready) == {"x": 1, "y": 0}
        await expect_rejected(
            store,
            lambda: store.get_data(BatchMeta("p", "a", (0, 1), ("x",))),
            UnknownRowError,
            "0",
            cells={"x": [2]},
        )
        await expect_rejected(
            store,
            lambda: store.put("p", {"y": ["late"]}, rows=[1]),
            UnknownRowError,
            "1",
            cells={"x": [2]},
        )

    @async_test
    async def test_get_data_of_reclaimed_rows_is_rejected(self, store: DataStore) -> None:
        """Rows every task consumed (by an ack or a drop) are reclaimed: ``get_data`` of them,
        through the acked lease's own meta or a meta naming them beside a live row, raises
        ``UnknownRowError`` naming the row, in every layout, and changes nothing. A store that
        frees reclaimed cells lazily must still refuse them, not hand out what is left."""
        await new_partition(store)  # one task: its ack or drop reclaims
        values = ragged([2, 3, 1, 4, 2, 5, 3, 1])
        await store.put("p", {"x": values})
        # rows 5, 6 and 7 go (ids that appear in no other number of a message); 0-4 stay
        acked = await store.get_meta(
            "p", "t", ["x"], 2, sampler=FixedSampler((6, 5)), timeout=WAIT_S
        )
        await store.get_data(acked)  # readable while leased
        await store.ack(acked)
        dropper = FixedSampler(selection=Selection(rows=(3,), dropped=(7,)))
        live = await store.get_meta("p", "t", ["x"], 2, sampler=dropper, timeout=WAIT_S)
        assert live.rows == (3,)
        s = await store.stats("p")
        assert (s.rows_live, s.reclaimed) == (5, 3)
        metas = [
            (acked, "6", "the meta of an acked lease"),
            (BatchMeta("p", "t", (3, 7), ("x",)), "7", "a live row beside a dropped one"),
            (BatchMeta("p", "t", (5,), ("x",)), "5", "an acked row"),
        ]
        for meta, mention, which in metas:
            for layout in ("padded", "nested", "list"):
                await expect_rejected(
                    store,
                    functools.partial(store.get_data, meta, layout=layout),
                    UnknownRowError,
                    mention,
                    cells={"x": [0, 1, 2, 3, 4]},
                    because=f"get_data ({layout}) of {which}, reclaimed (rows {meta.rows})",
                )
        batch = await store.get_data(live, layout="list")
        assert batch.rows == (3,) and same(batch["x"][0], values[3])
        await store.ack(live)
        assert (await store.stats("p")).rows_live == 4

    @async_test
    async def test_a_later_task_blocks_reclamation_and_sees_old_rows(
        self, store: DataStore
    ) -> None:
        await new_partition(store, tasks=("a",))
        await store.put("p", {"x": [0, 1]})
        await store.register_task("p", "b")
        meta_a = await store.get_meta("p", "a", ["x"], 2, timeout=WAIT_S)
        await store.ack(meta_a)
        assert (await store.stats("p")).rows_live == 2
        meta_b = await store.get_meta("p", "b", ["x"], 2, timeout=WAIT_S)
        assert meta_b.rows == (0, 1)
        await store.ack(meta_b)
        assert (await store.stats("p")).rows_live == 0

    # ========================================================================================
    # Tags and samplers
    # ========================================================================================
    @async_test
    async def test_tags_are_visible_in_batch_meta(self, store: DataStore) -> None:
        await new_partition(store)
        tags = [Tags(group="g0", versions=(3,), tokens=7), Tags(), Tags(group=5, tokens=2)]
        await store.put("p", {"x": [0, 1, 2]}, tags=tags)
        meta = await store.get_meta("p", "t", ["x"], 3, timeout=WAIT_S)
        assert meta.tags == tuple(tags)
        assert meta.tokens == 9

    @async_test
    async def test_tags_merge_on_later_puts(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0]}, tags=[Tags(group=1, versions=(2,), tokens=5)])
        await store.put("p", {"y": [0]}, rows=[0], tags=[Tags(versions=(0, 4))])
        await store.put("p", {"x": [9]}, rows=[0], overwrite=True, tags=[Tags(group=8, tokens=3)])
        meta = await store.get_meta("p", "t", ["x", "y"], 1, timeout=WAIT_S)
        assert meta.tags == (Tags(group=8, versions=(0, 2, 4), tokens=3),)

    @async_test
    async def test_samplers_see_tags_as_candidates(self, store: DataStore) -> None:
        await new_partition(store)
        tags = [
            Tags(group="a", versions=(1, 3), tokens=10),
            Tags(group="b", tokens=20),
            Tags(group="a", versions=(2,), tokens=30),
            Tags(),
        ]
        await store.put("p", {"x": [0, 1, 2, 3]}, tags=tags)
        await store.put("p", {"y": ["not a candidate"]}, tags=[Tags(group="a")])
        spy = SpySampler()
        meta = await store.get_meta("p", "t", ["x"], 4, sampler=spy, timeout=WAIT_S)
        assert meta.rows == (0, 1, 2, 3)
        cand, request = spy.seen[-1]
        assert (request.partition, request.task, request.batch_size) == ("p", "t", 4)
        assert cand.rows.tolist() == [0, 1, 2, 3]
        g = cand.groups.tolist()
        assert g[0] == g[2] >= 0 and g[1] >= 0 and g[1] != g[0] and g[3] == -1
        assert cand.group_sizes.tolist() == [3, 1, 3, -1]  # row 4 counts, though not ready
        assert cand.min_versions.tolist() == [1, -1, 2, -1]
        assert cand.max_versions.tolist() == [3, -1, 2, -1]
        assert cand.tokens.tolist() == [10, 20, 30, 0]

    @async_test
    async def test_group_sizes_count_what_this_task_has_not_consumed(
        self, store: DataStore
    ) -> None:
        """``group_sizes`` is per task: this task's consumption lowers it, another task's
        consumption (and the reclamation it causes) does not."""
        await new_partition(store, tasks=("t", "u"))
        await store.put("p", {"x": list(range(6))}, tags=[Tags(group="g")] * 6)
        await store.ack(await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S))
        await store.ack(await store.get_meta("p", "u", ["x"], 4, timeout=WAIT_S))
        # rows 0 and 1 are now consumed by both tasks, so reclaimed
        spy = SpySampler()
        await store.get_meta("p", "t", ["x"], 1, sampler=spy, timeout=WAIT_S)
        assert spy.seen[-1][0].group_sizes.tolist() == [4, 4, 4, 4]
        spy_u = SpySampler()
        await store.get_meta("p", "u", ["x"], 1, sampler=spy_u, timeout=WAIT_S)
        assert spy_u.seen[-1][0].group_sizes.tolist() == [2, 2]

    @async_test
    async def test_group_sampler_gets_whole_groups(self, store: DataStore) -> None:
        await new_partition(store)
        groups = ["A", "B", "A", "B", "A"]
        await store.put("p", {"x": list(range(5))}, tags=[Tags(group=g) for g in groups])
        sampler = GroupSampler(3)
        meta = await store.get_meta("p", "t", ["x"], 3, sampler=sampler, timeout=WAIT_S)
        assert meta.rows == (0, 2, 4)
        assert {t.group for t in meta.tags} == {"A"}
        with pytest.raises(StoreTimeoutError):
            await store.get_meta("p", "t", ["x"], 3, sampler=sampler, timeout=0)
        await store.put("p", {"x": [5]}, tags=[Tags(group="B")])
        meta = await store.get_meta("p", "t", ["x"], 3, sampler=sampler, timeout=WAIT_S)
        assert meta.rows == (1, 3, 5)

    @async_test
    async def test_sampler_sees_the_consumer_request(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0, 1]})
        await store.put("p", {"x": [2]})  # y of rows 0..2 unwritten: y-readers must wait
        spy = SpySampler()
        meta = await store.get_meta(
            "p", "t", ["x"], 2, sampler=spy, timeout=0, current_version=5, dp_rank=1, dp_size=2
        )
        assert meta.rows == (0, 1)
        request = spy.seen[-1][1]
        assert (request.current_version, request.dp_rank, request.dp_size) == (5, 1, 2)
        assert (request.member, request.final) == (0, False)
        await store.close("p")
        meta = await store.get_meta("p", "t", ["x"], 2, sampler=spy, timeout=WAIT_S)
        assert meta.rows == (2,) and spy.seen[-1][1].final, "closed, all free rows ready: final"
        await store.nack(meta)
        with pytest.raises(StoreTimeoutError):  # free row 2 has no y yet: not final for x+y
            await store.get_meta("p", "t", ["x", "y"], 3, sampler=spy, timeout=0)
        assert not spy.seen[-1][1].final

    @async_test
    async def test_micro_batches_reach_the_meta(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0, 1, 2, 3]})
        parts = ((2, 0), (3, 1))
        chooser = FixedSampler(selection=Selection(rows=(2, 0, 3, 1), micro_batches=parts))
        meta = await store.get_meta("p", "t", ["x"], 4, sampler=chooser, timeout=WAIT_S)
        assert meta.rows == (2, 0, 3, 1), "rows are leased in the order the sampler gave"
        assert meta.micro_batches == parts
        assert [m.rows for m in meta.split()] == [(2, 0), (3, 1)]
        assert (await store.get_data(meta.split()[1]))["x"] == [3, 1]

    @async_test
    async def test_sampler_may_answer_numpy_ints(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0, 1, 2]})
        chooser = FixedSampler(selection=Selection(rows=tuple(np.asarray([2, 0]))))
        meta = await store.get_meta("p", "t", ["x"], 2, sampler=chooser, timeout=WAIT_S)
        assert meta.rows == (2, 0) and all(type(r) is int for r in meta.rows), meta.rows
        assert (await store.get_data(meta))["x"] == [2, 0]

    @async_test
    async def test_a_failing_sampler_changes_nothing(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0, 1, 2]}, tags=[Tags(group=1), Tags(), Tags(group=1)])
        await expect_rejected(  # GroupSampler refuses untagged row 1, naming it
            store,
            lambda: store.get_meta("p", "t", ["x"], 2, sampler=GroupSampler(2), timeout=0),
            BadRequestError,
            "row 1",
            cells={"x": [0, 1, 2]},
        )
        assert (await store.get_meta("p", "t", ["x"], 3, timeout=0)).rows == (0, 1, 2)

    @async_test
    async def test_rank_replay_gives_every_member_one_lease(self, store: DataStore) -> None:
        """``SupportsRankReplay``: the peers of one DP rank share the batch and its lease;
        the rows count as consumed once every peer acked."""
        await new_partition(store)
        await store.put("p", {"x": [0, 1, 2, 3]})
        sampler = RankAwareSampler(members_per_rank=2)
        first = await store.get_meta("p", "t", ["x"], 2, sampler=sampler, member=0, timeout=0)
        peer = await store.get_meta("p", "t", ["x"], 2, sampler=sampler, member=1, timeout=0)
        assert first.rows == peer.rows == (0, 1)
        assert first.lease_id == peer.lease_id and (first.member, peer.member) == (0, 1)
        await store.ack(first)
        assert (await store.stats("p")).consumed["t"] == 0, "committed before every peer acked"
        await expect_rejected(
            store, lambda: store.ack(first), LeaseError, str(first.lease_id), cells={"x": [0, 1]}
        )
        await store.ack(peer)
        assert (await store.stats("p")).consumed["t"] == 2
        later = await store.get_meta("p", "t", ["x"], 2, sampler=sampler, member=1, timeout=0)
        assert later.rows == (2, 3)
        await expect_rejected(
            store,
            lambda: store.get_meta("p", "t", ["x"], 2, sampler=sampler, member=2, timeout=0),
            BadRequestError,
            "member",
            cells={"x": [2, 3]},
        )

    @async_test
    async def test_dropped_rows_are_consumed_but_never_delivered(self, store: DataStore) -> None:
        await new_partition(store, tasks=("a", "b"))
        await store.put("p", {"x": [0, 1, 2]})
        dropper = FixedSampler(selection=Selection(rows=(1,), dropped=(0,), held=1))
        meta = await store.get_meta("p", "a", ["x"], 2, sampler=dropper, timeout=WAIT_S)
        assert meta.rows == (1,)
        s = await store.stats("p")
        assert (s.dropped["a"], s.consumed["a"], s.leased["a"], s.held["a"]) == (1, 1, 1, 1)
        await store.ack(meta)
        await store.close("p")
        rest = await store.get_meta("p", "a", ["x"], 2, timeout=WAIT_S)
        assert rest.rows == (2,), "a dropped row was delivered"
        assert (await store.stats("p")).held["a"] == 0  # the latest selection held nothing
        await store.ack(rest)
        assert (await store.get_meta("p", "a", ["x"], 2, timeout=WAIT_S)).end_of_stream
        # a drop is per task: b still gets every row
        everything = await store.get_meta("p", "b", ["x"], 3, timeout=WAIT_S)
        assert everything.rows == (0, 1, 2)
        await store.ack(everything)
        s = await store.stats("p")
        assert (s.rows_live, s.reclaimed, dict(s.dropped)) == (0, 3, {"a": 1, "b": 0})

    @async_test
    async def test_rows_dropped_by_a_timed_out_get_meta_stay_dropped(
        self, store: DataStore
    ) -> None:
        """A sampler drops rows and selects none, so the call times out. The timeout is a
        rejected call, yet the drops are not part of it (``DataStore.get_meta``,
        ``StoreTimeoutError``): they stay counted, consumed and never delivered; everything
        else is as before."""
        await new_partition(store, tasks=("t", "u"))
        await store.put("p", {"x": [0, 1, 2, 3]})
        cells = {"x": [0, 1, 2, 3]}
        before = await snapshot(store, "p", cells)
        dropper = DropOldestSampler()
        with pytest.raises(StoreTimeoutError) as info:
            await store.get_meta("p", "t", ["x"], 2, sampler=dropper, timeout=0.05)
        assert "'p'" in str(info.value), f"StoreTimeoutError does not name 'p': {info.value}"
        dropped = sorted(dropper.dropped)
        assert dropped, "get_meta timed out without asking the sampler once"
        n = len(dropped)
        stats, values = await snapshot(store, "p", cells)
        assert (stats.dropped["t"], stats.consumed["t"]) == (n, n), (
            f"the sampler dropped rows {dropped} during a get_meta that timed out, but stats "
            f"count dropped={stats.dropped['t']}, consumed={stats.consumed['t']} for task 't': "
            "the drops were undone with the timeout"
        )
        expected = dataclasses.replace(
            before[0],
            consumed={**before[0].consumed, "t": n},
            dropped={**before[0].dropped, "t": n},
        )
        assert stats == expected, f"the timed-out get_meta changed more than its drops: {stats}"
        assert values == before[1], "the timed-out get_meta changed stored values"
        await store.close("p")
        delivered: list[int] = []
        for _ in range(6):  # at most 4 rows, then the end; a few more to report a broken store
            meta = await store.get_meta("p", "t", ["x"], 4, timeout=WAIT_S)
            if meta.end_of_stream:
                break
            delivered += meta.rows
            await store.ack(meta)
        else:
            pytest.fail("task 't' got no end of stream after 6 batches")
        again = sorted(set(delivered) & set(dropped))
        assert not again, (
            f"rows {again}, dropped during a get_meta that timed out, were delivered later"
        )
        assert delivered == [r for r in range(4) if r not in dropped]
        everything = await store.get_meta("p", "u", ["x"], 4, timeout=WAIT_S)
        assert everything.rows == (0, 1, 2, 3), "a drop for task 't' reached task 'u'"

    # ========================================================================================
    # Overwrite
    # ========================================================================================
    @async_test
    async def test_overwrite_replaces_the_value(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": ragged([3, 2])})
        assert await store.put("p", {"x": [torch.ones(6)]}, rows=[1], overwrite=True) == (1,)
        batch = await store.get_data(BatchMeta("p", "t", (0, 1), ("x",)), layout="list")
        assert same(batch["x"][0], ragged([3])[0]) and same(batch["x"][1], torch.ones(6))
        assert dict((await store.stats("p")).ready) == {"x": 2, "y": 0}

    @async_test
    async def test_overwrite_is_atomic_for_concurrent_readers(self, store: DataStore) -> None:
        """A thread reads a large cell in a loop while this coroutine overwrites it with
        constant tensors of alternating length; every read must be one whole version."""
        n = 1 << 20
        await new_partition(store, fields=("x",))
        await store.put("p", {"x": [torch.zeros(n)]})
        meta = await store.get_meta("p", "t", ["x"], 1, timeout=WAIT_S)
        length_of = {0.0: n}  # value -> length written with it
        started, stop = threading.Event(), threading.Event()
        reads: list[tuple[int, float, float]] = []
        failures: list[BaseException] = []

        async def hammer() -> None:
            layouts: tuple[Layout, Layout] = ("list", "padded")
            while not stop.is_set():
                batch = await store.get_data(meta, layout=layouts[len(reads) % 2])
                cell = unpack(batch, "x", layouts[len(reads) % 2], 1)[0]
                reads.append((int(cell.shape[0]), float(cell.min()), float(cell.max())))
                started.set()

        def reader() -> None:
            try:
                asyncio.run(hammer())
            except BaseException as e:  # reported by the test thread
                failures.append(e)
                started.set()

        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        try:
            assert started.wait(WAIT_S), "the reader thread never read"
            for k in range(1, 41):
                length = n if (k // 2) % 2 else n // 2  # pairs of equal shape, then a change
                length_of[float(k)] = length
                await store.put(
                    "p", {"x": [torch.full((length,), float(k))]}, rows=[0], overwrite=True
                )
                await asyncio.sleep(0)
        finally:
            stop.set()
            thread.join(WAIT_S)
        assert not failures, f"the reader thread failed: {failures[0]!r}"
        assert reads
        for length, lo, hi in reads:
            assert lo == hi and length_of.get(lo) == length, (
                f"a read saw a mix of versions: length {length}, values {lo}..{hi}"
            )

    @async_test
    async def test_concurrent_writes_of_one_cell_admit_one(self, store: DataStore) -> None:
        """Two puts of one unwritten cell without ``overwrite``, started together: one returns
        and the other raises ``CellAlreadyWrittenError``, whether it comes while the first is
        being written (a store whose writes take time must mark the cell before it writes) or
        after; the cell holds the winner's value whole and the loser changed nothing."""
        n = 1 << 18  # big enough that a store's write of it takes time
        await new_partition(store)
        await new_partition(store, "q")  # the same puts one at a time: what "p" must become
        for partition in ("p", "q"):
            await store.put(partition, {"x": [0]})
        values = [torch.full((n,), 1.0), torch.full((n,), 2.0)]  # same size, told apart
        await store.put("q", {"y": values[:1]}, rows=[0])
        outcomes = await asyncio.wait_for(
            asyncio.gather(
                *(store.put("p", {"y": [v]}, rows=[0]) for v in values), return_exceptions=True
            ),
            WAIT_S,
        )
        won = [i for i, o in enumerate(outcomes) if not isinstance(o, BaseException)]
        assert len(won) == 1, (
            f"two puts of cell (row 0, field 'y') without overwrite=True, started together: "
            f"{len(won)} of them returned ({outcomes}); the one that comes while the other is "
            "being written, or after it, must raise CellAlreadyWrittenError"
        )
        (winner,) = won
        error = outcomes[1 - winner]
        if not isinstance(error, CellAlreadyWrittenError):
            raise AssertionError(
                f"the losing put of a cell written concurrently raised {error!r}, not "
                "CellAlreadyWrittenError"
            )
        for mention in ("0", "'y'"):
            assert mention in str(error), f"CellAlreadyWrittenError does not name {mention}"
        assert outcomes[winner] == (0,)
        batch = await store.get_data(BatchMeta("p", "t", (0,), ("y",)), layout="list")
        assert same(batch["y"][0], values[winner]), (
            "the cell does not hold the value of the put that returned, whole"
        )
        p, q = await store.stats("p"), await store.stats("q")
        assert p == dataclasses.replace(q, name="p"), (
            f"the rejected put changed the store: after both puts {p}\nafter one put {q}"
        )
        loser = values[1 - winner]
        assert await store.put("p", {"y": [loser]}, rows=[0], overwrite=True) == (0,)
        batch = await store.get_data(BatchMeta("p", "t", (0,), ("y",)), layout="list")
        assert same(batch["y"][0], loser)

    # ========================================================================================
    # Rejected calls: the named error, a message naming the value, the store unchanged
    # ========================================================================================
    @pytest.mark.parametrize(
        "op",
        [
            "put",
            "put_rows",
            "get_meta",
            "get_data",
            "ack",
            "nack",
            "close",
            "register_task",
            "stats",
            "delete_partition",
        ],
    )
    @async_test
    async def test_unknown_partition_is_rejected(self, store: DataStore, op: str) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0]})
        meta = await store.get_meta("p", "t", ["x"], 1, timeout=WAIT_S)
        ghost = BatchMeta("nope", "t", (0,), ("x",), lease_id=meta.lease_id)
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "put": lambda: store.put("nope", {"x": [1]}),
            "put_rows": lambda: store.put("nope", {"x": [1]}, rows=[0]),
            "get_meta": lambda: store.get_meta("nope", "t", ["x"], 1, timeout=0),
            "get_data": lambda: store.get_data(ghost),
            "ack": lambda: store.ack(ghost),
            "nack": lambda: store.nack(ghost),
            "close": lambda: store.close("nope"),
            "register_task": lambda: store.register_task("nope", "t"),
            "stats": lambda: store.stats("nope"),
            "delete_partition": lambda: store.delete_partition("nope"),
        }
        await expect_rejected(store, calls[op], UnknownPartitionError, "'nope'", cells={"x": [0]})
        await store.ack(meta)  # the real lease is still held

    @pytest.mark.parametrize("op", ["put", "put_rows", "get_meta", "get_data"])
    @async_test
    async def test_unknown_field_is_rejected(self, store: DataStore, op: str) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0]})
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "put": lambda: store.put("p", {"y": ["ok"], "zz": [1]}),
            "put_rows": lambda: store.put("p", {"y": ["ok"], "zz": [1]}, rows=[0]),
            "get_meta": lambda: store.get_meta("p", "t", ["x", "zz"], 1, timeout=0),
            "get_data": lambda: store.get_data(BatchMeta("p", "t", (0,), ("x", "zz"))),
        }
        await expect_rejected(store, calls[op], UnknownFieldError, "'zz'", cells={"x": [0]})
        assert await store.put("p", {"y": ["ok"]}, rows=[0]) == (0,)
        assert await store.put("p", {"x": [1]}) == (1,)

    @async_test
    async def test_unknown_task_is_rejected(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0]})
        await expect_rejected(
            store,
            lambda: store.get_meta("p", "ghost", ["x"], 1, timeout=0),
            UnknownTaskError,
            "'ghost'",
            cells={"x": [0]},
        )
        assert (await store.get_meta("p", "t", ["x"], 1, timeout=0)).rows == (0,)

    @pytest.mark.parametrize("target", ["new_rows", "existing_rows"])
    @async_test
    async def test_dtype_change_is_rejected(self, store: DataStore, target: str) -> None:
        await new_partition(store)
        await store.put("p", {"x": ragged([2])})
        rows = None if target == "new_rows" else [0]
        bad = {"y": ["fine"], "x": ragged([2], dtype=torch.int64)}
        await expect_rejected(
            store, lambda: store.put("p", bad, rows=rows), SchemaError, "int64", cells={"x": [0]}
        )
        assert await store.put("p", {"x": ragged([4])}) == (1,)

    @async_test
    async def test_ndim_change_is_rejected(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": ragged([2])})
        await expect_rejected(
            store,
            lambda: store.put("p", {"x": [torch.zeros(2, 2)]}),
            SchemaError,
            "ndim=2",
            cells={"x": [0]},
        )
        assert await store.put("p", {"x": ragged([1])}) == (1,)

    @pytest.mark.parametrize("direction", ["plain_into_tensor", "tensor_into_plain"])
    @async_test
    async def test_kind_change_is_rejected(self, store: DataStore, direction: str) -> None:
        await new_partition(store)
        await store.put("p", {"x": ragged([2]), "y": ["plain"]})
        if direction == "plain_into_tensor":
            bad: dict[str, Any] = {"x": ["plain"]}
            mention = "plain"
        else:
            bad = {"y": ragged([2])}
            mention = "float32"
        await expect_rejected(
            store,
            lambda: store.put("p", bad, rows=[0], overwrite=True),
            SchemaError,
            mention,
            cells={"x": [0], "y": [0]},
        )

    @async_test
    async def test_mixed_dtypes_in_one_put_are_rejected(self, store: DataStore) -> None:
        await new_partition(store)
        mixed = [torch.zeros(2), torch.zeros(2, dtype=torch.int64)]
        await expect_rejected(store, lambda: store.put("p", {"x": mixed}), SchemaError, "int64")
        assert await store.put("p", {"x": [torch.zeros(2, dtype=torch.int64)]}) == (0,)

    @async_test
    async def test_rejected_first_write_does_not_fix_a_schema(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"y": ["plain"]})
        bad = {"x": ragged([2]), "y": ragged([2])}  # x would be fixed to float32; y is wrong
        await expect_rejected(
            store, lambda: store.put("p", bad), SchemaError, "'y'", cells={"y": [0]}
        )
        # x was never written, so its first write may still choose any kind
        assert await store.put("p", {"x": ["plain after all"], "y": ["b"]}) == (1,)

    @async_test
    async def test_unstorable_value_is_rejected(self, store: DataStore) -> None:
        await new_partition(store)
        unstorable: list[Any] = [object()]
        await expect_rejected(
            store, lambda: store.put("p", {"y": unstorable}), SchemaError, "object"
        )
        assert await store.put("p", {"y": [1]}) == (0,)

    @async_test
    async def test_writing_a_ready_cell_twice_is_rejected(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0, 1]})
        await store.put("p", {"y": ["b"]}, rows=[1])
        cells = {"x": [0, 1], "y": [1]}
        err = await expect_rejected(
            store,
            lambda: store.put("p", {"y": ["a", "again"]}, rows=[0, 1]),
            CellAlreadyWrittenError,
            "1",
            cells=cells,
        )
        assert "'y'" in str(err)
        # nothing of the rejected put landed: row 0's y is still unwritten
        assert dict((await store.stats("p")).ready) == {"x": 2, "y": 1}
        assert await store.put("p", {"y": ["a"]}, rows=[0]) == (0,)
        assert await store.put("p", {"y": ["b2"]}, rows=[1], overwrite=True) == (1,)
        batch = await store.get_data(BatchMeta("p", "t", (0, 1), ("y",)))
        assert batch["y"] == ["a", "b2"]

    @async_test
    async def test_put_of_new_rows_after_close_is_rejected(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0]})
        await store.close("p")
        await expect_rejected(
            store, lambda: store.put("p", {"x": [1]}), PartitionClosedError, "'p'", cells={"x": [0]}
        )
        meta = await store.get_meta("p", "t", ["x"], 2, timeout=WAIT_S)
        assert meta.rows == (0,)

    @pytest.mark.parametrize("batch_size", [0, -1])
    @async_test
    async def test_bad_batch_size_is_rejected(self, store: DataStore, batch_size: int) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0]})
        err = await expect_rejected(
            store,
            lambda: store.get_meta("p", "t", ["x"], batch_size, timeout=0),
            BadRequestError,
            str(batch_size),
            cells={"x": [0]},
        )
        assert "batch_size" in str(err)
        assert (await store.get_meta("p", "t", ["x"], 1, timeout=0)).rows == (0,)

    @pytest.mark.parametrize(
        ("kwargs", "mention"),
        [
            ({"lease_s": 0.0}, "lease_s"),
            ({"lease_s": -5.0}, "-5.0"),
            ({"dp_rank": 2, "dp_size": 2}, "dp_rank"),
            ({"dp_size": 0}, "dp_size"),
            ({"member": -1}, "member"),
            ({"fields": []}, "fields"),
        ],
        ids=["lease_zero", "lease_negative", "dp_rank", "dp_size", "member", "no_fields"],
    )
    @async_test
    async def test_bad_get_meta_arguments_are_rejected(
        self, store: DataStore, kwargs: dict[str, Any], mention: str
    ) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0]})
        args: dict[str, Any] = {"fields": ["x"], "timeout": 0, **kwargs}
        fields = args.pop("fields")
        await expect_rejected(
            store,
            lambda: store.get_meta("p", "t", fields, 1, **args),
            BadRequestError,
            mention,
            cells={"x": [0]},
        )
        assert (await store.get_meta("p", "t", ["x"], 1, timeout=0)).rows == (0,)

    @pytest.mark.parametrize("op", ["get_meta", "put"])
    @async_test
    async def test_negative_timeout_is_rejected(self, store: DataStore, op: str) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0]})
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "get_meta": lambda: store.get_meta("p", "t", ["x"], 1, timeout=-1.5),
            "put": lambda: store.put("p", {"x": [1]}, timeout=-1.5),
        }
        await expect_rejected(store, calls[op], BadRequestError, "-1.5", cells={"x": [0]})
        assert await store.put("p", {"x": [1]}) == (1,)

    @async_test
    async def test_put_into_unknown_rows_is_rejected(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0]})
        await expect_rejected(
            store,
            lambda: store.put("p", {"y": ["a", "b"]}, rows=[0, 42]),
            UnknownRowError,
            "42",
            cells={"x": [0]},
        )
        assert dict((await store.stats("p")).ready) == {"x": 1, "y": 0}
        assert await store.put("p", {"x": [1]}) == (1,)

    @pytest.mark.parametrize(
        ("data", "mention"),
        [({}, "{}"), ({"x": [0, 1], "y": ["a"]}, "'y': 1"), ({"x": []}, "'x'")],
        ids=["empty", "counts", "no_rows"],
    )
    @async_test
    async def test_malformed_put_is_rejected(
        self, store: DataStore, data: dict[str, list[Any]], mention: str
    ) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0]})
        await expect_rejected(
            store, lambda: store.put("p", data), BadRequestError, mention, cells={"x": [0]}
        )
        assert await store.put("p", {"x": [1]}) == (1,)

    @async_test
    async def test_tags_count_mismatch_is_rejected(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0]})
        await expect_rejected(
            store,
            lambda: store.put("p", {"x": [1, 2]}, tags=[Tags(group=1)]),
            BadRequestError,
            "2",
            cells={"x": [0]},
        )
        assert await store.put("p", {"x": [1]}) == (1,)

    @async_test
    async def test_rows_and_values_count_mismatch_is_rejected(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0, 1]})
        await expect_rejected(
            store,
            lambda: store.put("p", {"y": ["a"]}, rows=[0, 1]),
            BadRequestError,
            "2",
            cells={"x": [0, 1]},
        )

    @pytest.mark.parametrize("case", ["forged", "other_task", "acked", "nacked"])
    @async_test
    async def test_ack_or_nack_of_a_lease_not_held_is_rejected(
        self, store: DataStore, case: str
    ) -> None:
        await new_partition(store, tasks=("t", "u"))
        await store.put("p", {"x": [0, 1]})
        meta = await store.get_meta("p", "t", ["x"], 1, timeout=WAIT_S)
        assert meta.lease_id is not None
        bad = meta
        if case == "forged":
            bad = BatchMeta("p", "t", (1,), ("x",), lease_id="forged-lease-7")
        elif case == "other_task":
            bad = BatchMeta("p", "u", meta.rows, meta.fields, lease_id=meta.lease_id)
        elif case == "acked":
            await store.ack(meta)
        else:
            await store.nack(meta)
        for call in (store.ack, store.nack):
            err = await expect_rejected(
                store,
                functools.partial(call, bad),
                LeaseError,
                str(bad.lease_id),
                cells={"x": [0, 1]},
            )
            assert not isinstance(err, LeaseExpiredError), "the lease did not expire"
        if case in ("forged", "other_task"):
            await store.ack(meta)  # the real lease is still held by "t"
        s = await store.stats("p")
        assert dict(s.consumed) == {"t": 1 if case != "nacked" else 0, "u": 0}

    @pytest.mark.parametrize(
        "case", ["not_ready", "consumed", "leased", "never_created", "duplicate", "too_many"]
    )
    @async_test
    async def test_sampler_choosing_non_candidates_is_rejected(
        self, store: DataStore, case: str
    ) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0, 1, 2, 3], "y": ["a", "b", "c", "d"]})
        await store.put("p", {"x": [4]})  # row 4 has no y: not a candidate for [x, y]
        consumed = await store.get_meta("p", "t", ["x", "y"], 1, timeout=WAIT_S)
        await store.ack(consumed)  # row 0
        leased = await store.get_meta("p", "t", ["x", "y"], 1, timeout=WAIT_S)  # row 1
        rows, mention = {
            "not_ready": ((2, 4), "4"),
            "consumed": ((0,), "0"),
            "leased": ((1, 2), "1"),
            "never_created": ((2, 99), "99"),
            "duplicate": ((2, 2), "2"),
            "too_many": ((2, 3), "2"),
        }[case]
        batch_size = 1 if case == "too_many" else 2
        await expect_rejected(
            store,
            lambda: store.get_meta(
                "p", "t", ["x", "y"], batch_size, sampler=FixedSampler(rows), timeout=0
            ),
            SamplerError,
            mention,
            cells={"x": [1, 2, 3, 4], "y": [1, 2, 3]},  # row 0 was reclaimed
        )
        meta = await store.get_meta("p", "t", ["x", "y"], 2, timeout=0)
        assert meta.rows == (2, 3)
        await store.ack(leased)

    @async_test
    async def test_get_data_of_an_unwritten_field_is_rejected(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0, 1]})
        await store.put("p", {"y": ["b"]}, rows=[1])
        await expect_rejected(
            store,
            lambda: store.get_data(BatchMeta("p", "t", (1, 0), ("x", "y"))),
            DataStoreError,
            "'y'",
            cells={"x": [0, 1], "y": [1]},
        )
        batch = await store.get_data(BatchMeta("p", "t", (1,), ("x", "y")))
        assert (batch["x"], batch["y"]) == ([1], ["b"])

    @async_test
    async def test_unknown_layout_is_rejected(self, store: DataStore) -> None:
        await new_partition(store)
        await store.put("p", {"x": [0]})
        await expect_rejected(
            store,
            lambda: store.get_data(BatchMeta("p", "t", (0,), ("x",)), layout="sparse"),  # type: ignore[arg-type]
            BadRequestError,
            "'sparse'",
            cells={"x": [0]},
        )

    # ========================================================================================
    # The state machine
    # ========================================================================================
    @pytest.mark.slow
    def test_state_machine(self, store_factory: StoreFactory) -> None:
        """The hypothesis state machine (asyncflow_conformance.stateful) on this backend, sized
        by the selected profile (``--asyncflow-profile``)."""
        from hypothesis.stateful import run_state_machine_as_test

        from asyncflow_conformance.plugin import active_settings
        from asyncflow_conformance.stateful import make_datastore_state_machine

        machine = make_datastore_state_machine(
            store_factory,
            supports_fake_clock=self.supports_fake_clock,
            name=f"{type(self).__name__}StateMachine",
        )
        run_state_machine_as_test(machine, settings=active_settings())
