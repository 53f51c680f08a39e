"""The DataStore laws written for the gaps of conformance/PROMISES.md (PR28, PR29, PR46, PR52,
PR53, PR59) can fail: each runs here on a store with one realistic bug (a subclass of the
in-process store) and must fail with an ``AssertionError`` naming the cause. Two laws need a
store unlike the in-process one to bite (its writes are synchronous, its reclaimed cells freed
at once), so a sound store of that kind is built here too, and the law passes on it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
from asyncflow_conformance import DataStoreConformance, FakeClock

from asyncflow_core.contracts.errors import CellAlreadyWrittenError
from asyncflow_core.contracts.protocols import (
    DEFAULT_GET_TIMEOUT_S,
    Batch,
    BatchMeta,
    Candidates,
    FieldSchema,
    Layout,
    SampleRequest,
    Scheduler,
    Selection,
)
from asyncflow_core.data.controller import Controller, PutTicket, _grid
from asyncflow_core.data.scheduling import SequentialSampler
from asyncflow_core.data.store import (
    ControlPlane,
    InProcessDataStore,
    assemble_batch,
    check_get_data,
    loop_clock,
)


# --------------------------------------------------------------------------------------------
# PR28, PR29, PR52: the protocol's defaults
# --------------------------------------------------------------------------------------------
class ShortLeaseStore(InProcessDataStore):
    """Broken: a lease taken without ``lease_s`` lasts 60 s, not ``DEFAULT_LEASE_S``."""

    async def get_meta(  # type: ignore[override]
        self, partition: str, task: str, fields: Sequence[str], batch_size: int, *,
        lease_s: float = 60.0, **kwargs: Any,
    ) -> BatchMeta:  # fmt: skip
        return await super().get_meta(
            partition, task, fields, batch_size, lease_s=lease_s, **kwargs
        )


class ShortGetTimeoutStore(InProcessDataStore):
    """Broken: ``get_meta`` without ``timeout`` gives up after 1 s (the trap the default
    exists to avoid)."""

    async def get_meta(  # type: ignore[override]
        self, partition: str, task: str, fields: Sequence[str], batch_size: int, *,
        timeout: float | None = 1.0, **kwargs: Any,
    ) -> BatchMeta:  # fmt: skip
        return await super().get_meta(
            partition, task, fields, batch_size, timeout=timeout, **kwargs
        )


class ShortPutTimeoutStore(InProcessDataStore):
    """Broken: a ``put`` of new rows without ``timeout`` waits 1 s for capacity."""

    async def put(  # type: ignore[override]
        self, partition: str, data: Mapping[str, Any], *, timeout: float | None = 1.0,
        **kwargs: Any,
    ) -> tuple[int, ...]:  # fmt: skip
        return await super().put(partition, data, timeout=timeout, **kwargs)


class NoneIsTheDefaultStore(InProcessDataStore):
    """Broken: ``timeout=None`` is read as "the default" (a store that cannot wait forever),
    so it gives up after ``DEFAULT_GET_TIMEOUT_S``."""

    async def get_meta(  # type: ignore[override]
        self, partition: str, task: str, fields: Sequence[str], batch_size: int, *,
        timeout: float | None = DEFAULT_GET_TIMEOUT_S, **kwargs: Any,
    ) -> BatchMeta:  # fmt: skip
        timeout = DEFAULT_GET_TIMEOUT_S if timeout is None else timeout
        return await super().get_meta(
            partition, task, fields, batch_size, timeout=timeout, **kwargs
        )


# --------------------------------------------------------------------------------------------
# PR53: rows dropped during a get_meta that times out
# --------------------------------------------------------------------------------------------
class _LeaseOrNothing:
    """``inner``'s answer, but its drops only count beside rows it leases."""

    def __init__(self, inner: Scheduler) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:  # members_per_rank and the like
        return getattr(self.inner, name)

    def select(self, candidates: Candidates, request: SampleRequest) -> Selection:
        sel = self.inner.select(candidates, request)
        return sel if sel.rows else Selection(held=sel.held)


class DropsOnlyWithALeaseStore(InProcessDataStore):
    """Broken: a sampler's drops are committed only with a lease (the controller's
    ``if dropped:`` made ``if dropped and rows:``), so a get_meta that times out undoes them."""

    async def get_meta(  # type: ignore[override]
        self, partition: str, task: str, fields: Sequence[str], batch_size: int, *,
        sampler: Scheduler | None = None, **kwargs: Any,
    ) -> BatchMeta:  # fmt: skip
        inner = sampler if sampler is not None else SequentialSampler()
        return await super().get_meta(
            partition, task, fields, batch_size, sampler=_LeaseOrNothing(inner), **kwargs
        )


# --------------------------------------------------------------------------------------------
# PR46: two puts of one cell at once
# --------------------------------------------------------------------------------------------
class _YieldingPlane(ControlPlane):
    """Between a put's reservation and its write, other calls run: the write travels to a
    storage unit elsewhere, as in the Ray store."""

    async def reserve_put(self, *args: Any, **kwargs: Any) -> PutTicket:
        ticket = await super().reserve_put(*args, **kwargs)
        try:
            await asyncio.sleep(0)
        except BaseException:
            self.controller.abort_put(ticket)
            raise
        return ticket


class SlowWriteStore(InProcessDataStore):
    """Sound: the in-process store whose writes yield to the event loop, so a second put can
    arrive while the first is being written (the in-process store writes synchronously)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._plane = _YieldingPlane(self.controller, self._delete_rows)


class _UnmarkedController(Controller):
    """``begin_put`` without ``p.writing[_grid(slots, cols)] = True``."""

    def begin_put(self, partition: str, *args: Any, **kwargs: Any) -> PutTicket | None:
        ticket = super().begin_put(partition, *args, **kwargs)
        if ticket is not None:
            with self._lock:
                p = self._parts[partition]
                pending = p.pending[ticket.ticket_id]
                p.writing[_grid(p.lookup(pending.rows), pending.cols)] = False
        return ticket


class UnmarkedWriteStore(SlowWriteStore):
    """Broken: a put's reservation does not mark its cells as being written, so a second put
    of an unwritten cell passes while the first writes, and both return."""

    def __init__(self, *args: Any, clock: Callable[[], float] | None = None, **kwargs: Any):
        controller = _UnmarkedController(clock if clock is not None else loop_clock)
        super().__init__(*args, controller=controller, **kwargs)


# --------------------------------------------------------------------------------------------
# PR59: get_data of reclaimed rows
# --------------------------------------------------------------------------------------------
class LazyFreeStore(InProcessDataStore):
    """Sound: reclaimed cells are freed in a batch at the next put, not at once (a store that
    frees storage off the critical path); ``get_data`` still checks that the rows live."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._unfreed: list[dict[str, list[int]]] = []

    def _delete_rows(self, freed: dict[str, list[int]]) -> None:
        self._unfreed.append(freed)

    async def put(self, *args: Any, **kwargs: Any) -> tuple[int, ...]:  # type: ignore[override]
        for freed in self._unfreed:
            super()._delete_rows(freed)
        self._unfreed.clear()
        return await super().put(*args, **kwargs)


class UncheckedLazyFreeStore(LazyFreeStore):
    """Broken: ``get_data`` reads the storage units without the controller's liveness check
    (``check_readable``), trusting a unit that still holds a cell: a reclaimed row's stale
    value comes back."""

    async def get_data(
        self,
        meta: BatchMeta,
        fields: Sequence[str] | None = None,
        *,
        layout: Layout = "padded",
        pad_value: float = 0,
        out: Batch | None = None,
    ) -> Batch:
        names = check_get_data(meta, fields, layout)
        schema = self.controller.schema(meta.partition)
        if not meta.rows or any(f not in schema for f in names):  # the full check names them
            return await super().get_data(meta, fields, layout=layout, pad_value=pad_value, out=out)
        values = self._read(self.storage_key(meta.partition), meta.rows, names)
        schemas = {f: schema[f] for f in names}
        return assemble_batch(meta, names, schemas, values, layout, pad_value, out=out)  # type: ignore[arg-type]


class KeptLeaseCheckStore(LazyFreeStore):
    """Broken: ``get_data`` of a lease's meta trusts the readability check made when the lease
    was granted (a round trip saved, as the Ray client does) and ``ack`` does not forget it,
    so the acked lease's own meta still reads its reclaimed rows."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._checked: dict[str, tuple[BatchMeta, str, dict[str, FieldSchema]]] = {}

    async def get_meta(self, *args: Any, **kwargs: Any) -> BatchMeta:  # type: ignore[override]
        meta = await super().get_meta(*args, **kwargs)
        if meta.lease_id is not None and meta.rows:
            key, schemas = self.controller.check_readable(meta.partition, meta.rows, meta.fields)
            self._checked[meta.lease_id] = (meta, key, schemas)
        return meta

    async def get_data(
        self,
        meta: BatchMeta,
        fields: Sequence[str] | None = None,
        *,
        layout: Layout = "padded",
        pad_value: float = 0,
        out: Batch | None = None,
    ) -> Batch:
        names = check_get_data(meta, fields, layout)
        checked = self._checked.get(meta.lease_id) if meta.lease_id is not None else None
        if (
            checked is None
            or (checked[0].partition, checked[0].rows) != (meta.partition, meta.rows)
            or any(f not in checked[2] for f in names)
        ):
            return await super().get_data(meta, fields, layout=layout, pad_value=pad_value, out=out)
        _, key, schemas = checked
        values = self._read(key, meta.rows, names)
        return assemble_batch(meta, names, schemas, values, layout, pad_value, out=out)


# --------------------------------------------------------------------------------------------
# The laws on them
# --------------------------------------------------------------------------------------------
class _Suite(DataStoreConformance):
    """The suite, its laws called directly on one store (no ``Test`` prefix: not collected)."""

    supports_fake_clock = True
    supports_virtual_clock = True


def _run_law(law: str, store: InProcessDataStore, **params: Any) -> None:
    getattr(_Suite(), law)(store=store, **params)


DEFAULTS = "test_defaults_are_the_protocols"
CONCURRENT = "test_concurrent_writes_of_one_cell_admit_one"
DROPPED = "test_rows_dropped_by_a_timed_out_get_meta_stay_dropped"
RECLAIMED = "test_get_data_of_reclaimed_rows_is_rejected"


@pytest.mark.parametrize(
    ("mutant", "law", "params", "cause"),
    [
        pytest.param(
            ShortLeaseStore,
            DEFAULTS,
            {"default": "lease_s", "fake_clock": True},
            r"ends 60\.0 s from now; the protocol's default is DEFAULT_LEASE_S = 1800\.0 s",
            id="lease-60s-fake-clock",
        ),
        pytest.param(
            ShortLeaseStore,
            DEFAULTS,
            {"default": "lease_s", "fake_clock": False},
            r"its length is not the protocol's DEFAULT_LEASE_S = 1800\.0 s",
            id="lease-60s-real-clock",
        ),
        pytest.param(
            ShortGetTimeoutStore,
            DEFAULTS,
            {"default": "get_meta_timeout"},
            r"get_meta of an empty partition without a timeout gave up after 1\.0\d* s",
            id="get-meta-timeout-1s",
        ),
        pytest.param(
            ShortPutTimeoutStore,
            DEFAULTS,
            {"default": "put_timeout"},
            r"put of a new row into a full partition without a timeout gave up after 1\.0\d* s",
            id="put-timeout-1s",
        ),
        pytest.param(
            NoneIsTheDefaultStore,
            DEFAULTS,
            {"default": "get_meta_timeout"},
            r"with timeout=None ended after 600\.0\d* s .*StoreTimeoutError",
            id="timeout-none-is-600s",
        ),
        pytest.param(
            DropsOnlyWithALeaseStore,
            DROPPED,
            {},
            r"dropped rows \[0\] during a get_meta that timed out, but stats count dropped=0"
            r".*the drops were undone with the timeout",
            id="drops-only-with-a-lease",
        ),
        pytest.param(
            UnmarkedWriteStore,
            CONCURRENT,
            {},
            r"started together: 2 of them returned",
            id="reservation-not-marked-writing",
        ),
        pytest.param(
            UncheckedLazyFreeStore,
            RECLAIMED,
            {},
            r"(?s)get_data \(padded\) of the meta of an acked lease, reclaimed \(rows \(6, 5\)\): "
            r"the call returned Batch\(.* instead of raising UnknownRowError",
            id="get-data-without-liveness-check",
        ),
        pytest.param(
            KeptLeaseCheckStore,
            RECLAIMED,
            {},
            r"(?s)get_data \(padded\) of the meta of an acked lease, reclaimed \(rows \(6, 5\)\): "
            r"the call returned Batch\(.* instead of raising UnknownRowError",
            id="lease-check-kept-after-ack",
        ),
    ],
)
def test_each_gap_law_fails_on_its_mutant(
    mutant: type[InProcessDataStore], law: str, params: dict[str, Any], cause: str
) -> None:
    params = dict(params)
    if law == DEFAULTS:
        clock = FakeClock() if params.pop("fake_clock", True) else None
        params["clock"] = clock
        store = mutant(clock=clock) if clock is not None else mutant()
    else:
        store = mutant()
    with pytest.raises(AssertionError, match=cause):
        _run_law(law, store, **params)


@pytest.mark.parametrize(
    ("store_type", "law"),
    [(SlowWriteStore, CONCURRENT), (LazyFreeStore, RECLAIMED), (SlowWriteStore, DEFAULTS)],
    ids=["slow-writes", "lazy-free", "slow-writes-defaults"],
)
def test_the_laws_pass_on_the_sound_stores_the_mutants_break(
    store_type: type[InProcessDataStore], law: str
) -> None:
    if law == DEFAULTS:
        for default in ("lease_s", "get_meta_timeout", "put_timeout"):
            clock = FakeClock()
            _run_law(law, store_type(clock=clock), clock=clock, default=default)
    else:
        _run_law(law, store_type())


def test_a_slow_write_store_refuses_a_cell_that_is_being_written() -> None:
    """The interleaving the concurrent-writes law is there for does happen on
    ``SlowWriteStore``: the second put arrives while the first is written (not after it)."""

    async def race() -> list[Any]:
        store = SlowWriteStore()
        await store.create_partition("p", ["x", "y"], tasks=["t"])
        await store.put("p", {"x": [0]})
        puts = (store.put("p", {"y": [v]}, rows=[0]) for v in ("a", "b"))
        return await asyncio.gather(*puts, return_exceptions=True)

    first, second = asyncio.run(race())
    assert first == (0,)
    assert isinstance(second, CellAlreadyWrittenError)
    assert "is being written by another put" in str(second), second
