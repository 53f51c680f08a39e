"""The in-process streaming DataStore: a Controller (metadata) plus N StorageUnits (values),
driven by an asyncio façade that waits for data and for capacity.

Values live in the storage units, sharded by row (``row % N``); the controller never sees them.
The façade speaks to both only through their narrow, picklable method calls, which is what lets
the Ray runtime put each of them in another process unchanged.

Batch memory (``assemble_batch``, shared with the Ray store's client): a padded or nested batch
is built in one pass into the memory of ``get_data(..., out=previous_batch)`` when nothing else
holds it, else into a buffer of ``BATCH_POOL`` (a bounded pool of recently used batch memory),
so steady-state reads touch no fresh pages.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import math
import operator
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from asyncflow_core.contracts.errors import (
    AsyncFlowError,
    BadRequestError,
    SchemaError,
    StorageUnitError,
    StoreTimeoutError,
    UnknownRowError,
)
from asyncflow_core.contracts.protocols import (
    DEFAULT_GET_TIMEOUT_S,
    DEFAULT_LEASE_S,
    Batch,
    BatchMeta,
    Capacity,
    CellValue,
    DataStore,
    FieldSchema,
    Layout,
    PartitionStats,
    Scheduler,
    Tags,
    Version,
)
from asyncflow_core.data.controller import Controller, PutTicket
from asyncflow_core.data.notify import Waiters
from asyncflow_core.data.scheduling import SequentialSampler

_PLAIN_TYPES = (type(None), bool, int, float, str, list, dict)
_LAYOUTS = ("padded", "nested", "list")
_SMALL_ROWS_ELEMS = 2048  # mean row length below which padded reads scatter with a mask


def loop_clock() -> float:
    """The running event loop's time (virtual on a ``VirtualClockLoop``), else
    ``time.monotonic()`` — which is what a standard loop's time is."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


class StorageUnit:
    """Holds the cells of the rows routed to it: ``partition -> field -> {row: value}``.

    Each call is atomic under the unit's lock. A write replaces a cell's object (tensors are
    never modified in place), so a reader holding the old value keeps a whole, consistent one:
    an overwrite can never tear a cell that is being read.
    """

    def __init__(self, unit_id: int = 0) -> None:
        self.unit_id = unit_id
        self._lock = threading.Lock()
        self._data: dict[str, dict[str, dict[int, CellValue]]] = {}

    def write(
        self, partition: str, cells: Mapping[str, Mapping[int, CellValue]]
    ) -> dict[str, dict[int, CellValue]]:
        """Store the cells; return the values they replaced (for ``undo``)."""
        with self._lock:
            part = self._data.setdefault(partition, {})
            replaced: dict[str, dict[int, CellValue]] = {}
            for field_name, values in cells.items():
                col = part.setdefault(field_name, {})
                old = {r: col[r] for r in values if r in col}
                if old:
                    replaced[field_name] = old
                col.update(values)
            return replaced

    def undo(
        self,
        partition: str,
        cells: Mapping[str, Mapping[int, CellValue]],
        replaced: Mapping[str, Mapping[int, CellValue]],
    ) -> None:
        """Revert a ``write`` of ``cells`` that returned ``replaced``."""
        with self._lock:
            part = self._data.get(partition, {})
            for field_name, values in cells.items():
                col = part.get(field_name, {})
                old = replaced.get(field_name, {})
                for r in values:
                    if r in old:
                        col[r] = old[r]
                    else:
                        col.pop(r, None)

    def read(
        self, partition: str, rows: Sequence[int], fields: Sequence[str]
    ) -> dict[str, list[CellValue]]:
        with self._lock:
            part = self._data.get(partition, {})
            out: dict[str, list[CellValue]] = {}
            for f in fields:
                col = part.get(f, {})
                try:
                    out[f] = [col[r] for r in rows]
                except KeyError as e:
                    raise StorageUnitError(
                        f"storage unit {self.unit_id} has no value for (row {e.args[0]}, field "
                        f"{f!r}) of partition {partition!r}: the row was reclaimed or the unit "
                        "lost it"
                    ) from None
            return out

    def delete_rows(self, partition: str, rows: Sequence[int]) -> None:
        with self._lock:
            for col in self._data.get(partition, {}).values():
                for r in rows:
                    col.pop(r, None)

    def drop_partition(self, partition: str) -> None:
        with self._lock:
            self._data.pop(partition, None)

    def num_cells(self, partition: str) -> int:
        with self._lock:
            return sum(len(c) for c in self._data.get(partition, {}).values())


def _plain_nbytes(v: object) -> int:
    if isinstance(v, str):
        return len(v) + 8
    if isinstance(v, list | dict):
        return 16 + 8 * len(v)
    return 8


def _tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Prepared:
    __slots__ = ("cells", "n", "row_bytes", "schemas")

    def __init__(self) -> None:
        self.n = 0
        self.cells: dict[str, list[CellValue]] = {}
        self.schemas: dict[str, FieldSchema] = {}
        self.row_bytes: dict[str, list[int]] = {}


def _prepare_put(partition: str, data: Mapping[str, Any], copy: bool) -> _Prepared:
    """Split ``data`` into per-row cells, infer each field's schema, copy tensors if asked."""
    if not isinstance(data, Mapping) or not data:
        raise BadRequestError(
            f"put into {partition!r} needs data as a non-empty mapping field -> values, "
            f"got {data!r:.80}"
        )
    out = _Prepared()
    counts: dict[str, int] = {}
    for name, values in data.items():
        if isinstance(values, torch.Tensor):
            if values.ndim == 0:
                raise BadRequestError(
                    f"field {name!r}: a tensor value must have dim 0 = rows; wrap a single "
                    "row's scalar as tensor.reshape(1) or pass a list"
                )
            t = values.detach() if values.requires_grad else values
            t = t.clone(memory_format=torch.contiguous_format) if copy else t
            rows_t = list(t.unbind(0))
            out.schemas[name] = FieldSchema(str(t.dtype).removeprefix("torch."), t.ndim - 1)
            nb = _tensor_nbytes(rows_t[0]) if rows_t else 0
            out.row_bytes[name] = [nb] * len(rows_t)
            out.cells[name] = list(rows_t)
        elif isinstance(values, list | tuple):
            if not values:
                raise BadRequestError(f"field {name!r}: an empty list of values")
            first = values[0]
            if isinstance(first, torch.Tensor):
                dtype, ndim = first.dtype, first.ndim
                cells: list[CellValue] = []
                sizes = []
                for i, v in enumerate(values):
                    if not isinstance(v, torch.Tensor) or v.dtype != dtype or v.ndim != ndim:
                        got = (
                            f"tensor(dtype={v.dtype}, ndim={v.ndim})"
                            if isinstance(v, torch.Tensor)
                            else type(v).__name__
                        )
                        raise SchemaError(
                            f"field {name!r}: row {i} of this put is {got} but row 0 is "
                            f"tensor(dtype={dtype}, ndim={ndim}); every row of a field must "
                            "share dtype and ndim"
                        )
                    if v.requires_grad:
                        v = v.detach()
                    if copy:
                        v = v.clone(memory_format=torch.contiguous_format)
                    cells.append(v)
                    sizes.append(v.nbytes)
                out.schemas[name] = FieldSchema(str(dtype).removeprefix("torch."), ndim)
                out.row_bytes[name] = sizes
                out.cells[name] = cells
            else:
                for i, v in enumerate(values):
                    if not isinstance(v, _PLAIN_TYPES):
                        raise SchemaError(
                            f"field {name!r}: row {i} is a {type(v).__name__}; a cell holds a "
                            "torch.Tensor or a JSON-able value (None/bool/int/float/str/list/"
                            "dict). Convert arrays with torch.as_tensor"
                        )
                out.schemas[name] = FieldSchema(None, 0)
                out.row_bytes[name] = [_plain_nbytes(v) for v in values]
                out.cells[name] = list(values)
        else:
            raise BadRequestError(
                f"field {name!r}: values must be a list (one per row) or a tensor whose dim 0 "
                f"is the row, got {type(values).__name__}"
            )
        counts[name] = len(out.cells[name])
    if len(set(counts.values())) != 1:
        raise BadRequestError(
            f"put into {partition!r}: every field needs one value per row, got counts {counts}"
        )
    out.n = next(iter(counts.values()))
    if out.n == 0:
        raise BadRequestError(f"put into {partition!r} with zero rows")
    return out


class ControlPlane:
    """A ``Controller`` plus the waiting the DataStore contract needs: for capacity (a put of
    new rows), for data (``get_meta``) and for lease deadlines. The in-process store calls it
    directly; the Ray runtime's controller actor serves the same object, so both stores wait,
    time out and explain a timeout the same way. ``on_reclaimed(freed)`` is told which rows
    (``storage key -> rows``) every task has consumed, to delete them from the storage units.
    """

    def __init__(
        self, controller: Controller, on_reclaimed: Callable[[dict[str, list[int]]], None]
    ) -> None:
        self.controller = controller
        self._on_reclaimed = on_reclaimed
        self._waiters = Waiters()
        controller.add_listener(self._waiters.wake_all)

    def free_reclaimed(self) -> None:
        freed = self.controller.take_reclaimed()
        if freed:
            self._on_reclaimed(freed)

    def ack_before_lease(
        self,
        ack: BatchMeta,
        partition: str,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        sampler: Scheduler,
        *,
        lease_s: float,
        dp_rank: int,
        dp_size: int,
        member: int,
    ) -> None:
        """The ack a lease request carries (``DataStore.get_meta(ack=)``): every check of the
        request first (a rejected request commits nothing), then the ack, as ``ack`` would."""
        self.controller.check_lease(
            partition, task, fields, batch_size, sampler, lease_s=lease_s, dp_rank=dp_rank,
            dp_size=dp_size, member=member,
        )  # fmt: skip
        self.controller.ack(ack)
        self.free_reclaimed()

    async def wait_for_change(self, generation: int, until: float | None) -> None:
        with self._waiters.arm() as waiter:
            if self.controller.generation != generation:
                return
            await waiter.wait(None if until is None else max(0.0, until - loop_clock()))

    def lease_wake(self, partition: str, until: float | None) -> float | None:
        nd = self.controller.next_deadline(partition)
        if nd is None:
            return until
        at = loop_clock() + max(0.0, nd - self.controller.now()) + 1e-3
        return at if until is None else min(at, until)

    async def reserve_put(
        self,
        partition: str,
        schemas: Mapping[str, FieldSchema],
        row_bytes: Mapping[str, Sequence[int]],
        n: int,
        rows: Sequence[int] | None,
        tags: Sequence[Tags] | None,
        overwrite: bool,
        timeout: float | None,
    ) -> PutTicket:
        """``Controller.begin_put``, waiting up to ``timeout`` for capacity."""
        until = None if timeout is None else loop_clock() + timeout
        while True:
            generation = self.controller.generation
            ticket = self.controller.begin_put(
                partition, schemas, row_bytes, n, rows, tags, overwrite
            )
            if ticket is not None:
                return ticket
            if until is not None and loop_clock() >= until:
                s = self.controller.stats(partition)
                raise StoreTimeoutError(
                    f"put of {n} new rows into {partition!r} waited {timeout} s for "
                    f"capacity ({s.rows_live} rows / {s.bytes_live} bytes live, bound "
                    f"{s.capacity}); nothing was written. Consumers must ack rows (and every "
                    f"registered task {list(s.tasks)} consume them) to free space"
                )
            await self.wait_for_change(generation, until)

    async def lease(
        self,
        partition: str,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        sampler: Scheduler,
        *,
        timeout: float | None,
        lease_s: float,
        current_version: Version | None,
        dp_rank: int,
        dp_size: int,
        member: int,
    ) -> BatchMeta:
        """``Controller.try_get_meta``, waiting up to ``timeout`` for the sampler to choose."""
        until = None if timeout is None else loop_clock() + timeout
        while True:
            generation = self.controller.generation
            meta = self.controller.try_get_meta(
                partition, task, list(fields), batch_size, sampler, lease_s=lease_s,
                current_version=current_version, dp_rank=dp_rank, dp_size=dp_size,
                member=member,
            )  # fmt: skip
            self.free_reclaimed()
            if meta is not None:
                return meta
            if until is not None and loop_clock() >= until:
                raise StoreTimeoutError(
                    self.explain_wait(partition, task, fields, batch_size, timeout)
                )
            await self.wait_for_change(generation, self.lease_wake(partition, until))

    def explain_wait(
        self,
        partition: str,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        timeout: float | None,
    ) -> str:
        s = self.controller.stats(partition)
        ready = ", ".join(f"{f}={s.ready[f]}" for f in fields)
        return (
            f"get_meta({partition!r}, task={task!r}, batch_size={batch_size}) waited {timeout} s; "
            f"{s.rows_live} live rows, ready per field: {ready}; task consumed "
            f"{s.consumed.get(task, 0)}, leased {s.leased.get(task, 0)}, held back "
            f"{s.held.get(task, 0)}; closed={s.closed}. Nothing was leased. Raise the timeout, "
            "check the producers of those fields, or close() the partition so a short final "
            "batch is handed out"
        )


def split_by_unit(
    rows: Sequence[int], cells: Mapping[str, Sequence[CellValue]], n_units: int, consecutive: bool
) -> list[dict[str, dict[int, CellValue]]]:
    """Each unit's share of a put: ``unit -> field -> {row: value}`` (row ``r`` lives on unit
    ``r % n_units``). ``consecutive``: ``rows`` are ascending consecutive ids (new rows), so
    every unit's share is a strided slice."""
    per_unit: list[dict[str, dict[int, CellValue]]] = [{} for _ in range(n_units)]
    if n_units == 1:
        per_unit[0] = {f: dict(zip(rows, v, strict=True)) for f, v in cells.items()}
    elif consecutive and rows:
        first = rows[0]
        for u in range(n_units):
            start = (u - first) % n_units
            rows_u = rows[start::n_units]
            if rows_u:
                per_unit[u] = {
                    f: dict(zip(rows_u, v[start::n_units], strict=True)) for f, v in cells.items()
                }
    else:
        for f, values in cells.items():
            for row, v in zip(rows, values, strict=True):
                per_unit[row % n_units].setdefault(f, {})[row] = v
    return per_unit


def rows_by_unit(rows: Sequence[int], n_units: int) -> list[list[int]]:
    """``rows`` grouped by the unit holding them (order kept within each unit)."""
    by_unit: list[list[int]] = [[] for _ in range(n_units)]
    for r in rows:
        by_unit[r % n_units].append(r)
    return by_unit


def merge_by_unit(
    rows: Sequence[int],
    got: Sequence[Mapping[str, Sequence[CellValue]]],
    fields: Sequence[str],
    n_units: int,
) -> dict[str, list[CellValue]]:
    """Undo ``rows_by_unit``: ``got[u][field]`` holds unit ``u``'s values in its rows' order;
    returns ``field -> values`` in ``rows``' order."""
    order = [r % n_units for r in rows]
    out: dict[str, list[CellValue]] = {}
    for f in fields:
        cols = [g.get(f, []) for g in got]
        cursors = [0] * n_units
        col_out: list[CellValue] = []
        for u in order:
            col_out.append(cols[u][cursors[u]])
            cursors[u] += 1
        out[f] = col_out
    return out


class InProcessDataStore:
    """The DataStore contract in one process: ``Controller`` + ``num_storage_units`` units.

    The store keeps *references* to the tensors you put, as an in-process queue does: never
    modify a tensor in place after putting it (engines return fresh tensors, so RL pipelines
    don't). ``copy_on_put=True`` clones every tensor on put instead, for callers that reuse
    buffers; it costs one extra copy of every byte. ``clock`` is the lease clock (default: the
    running event loop's time, so leases and timeouts follow a virtual clock when there is one).
    """

    def __init__(
        self,
        num_storage_units: int = 2,
        *,
        copy_on_put: bool = False,
        clock: Callable[[], float] | None = None,
        controller: Controller | None = None,
        units: Sequence[StorageUnit] | None = None,
    ) -> None:
        if units is None:
            if not isinstance(num_storage_units, int) or num_storage_units < 1:
                raise BadRequestError(
                    f"num_storage_units must be an int >= 1, got {num_storage_units!r}"
                )
            units = [StorageUnit(i) for i in range(num_storage_units)]
        self.units = list(units)
        self.controller = (
            controller
            if controller is not None
            else Controller(clock if clock is not None else loop_clock)
        )
        self.copy_on_put = copy_on_put
        self._plane = ControlPlane(self.controller, self._delete_rows)

    # -- partitions ----------------------------------------------------------------------------
    async def create_partition(
        self,
        name: str,
        fields: Sequence[str],
        *,
        capacity: Capacity | None = None,
        tasks: Sequence[str] = (),
    ) -> None:
        check_create_partition(name, fields, capacity, tasks)
        self.controller.create_partition(name, fields, capacity, tasks)

    async def register_task(self, partition: str, task: str) -> None:
        check_name("partition", partition)
        check_name("task", task)
        self.controller.register_task(partition, task)

    async def close(self, partition: str) -> None:
        check_name("partition", partition)
        self.controller.close(partition)

    async def delete_partition(self, partition: str) -> None:
        check_name("partition", partition)
        key = self.controller.begin_delete(partition)
        for unit in self.units:
            unit.drop_partition(key)
        self.controller.finish_delete(partition)

    def storage_key(self, partition: str) -> str:
        """Where the storage units keep ``partition``'s values (a partition created again
        under the same name gets a new key)."""
        check_name("partition", partition)
        return self.controller.storage_key(partition)

    async def stats(self, partition: str) -> PartitionStats:
        check_name("partition", partition)
        return self.controller.stats(partition)

    # -- writes --------------------------------------------------------------------------------
    async def put(
        self,
        partition: str,
        data: Mapping[str, Sequence[CellValue] | torch.Tensor],
        *,
        rows: Sequence[int] | None = None,
        tags: Sequence[Tags] | None = None,
        overwrite: bool = False,
        timeout: float | None = DEFAULT_GET_TIMEOUT_S,
    ) -> tuple[int, ...]:
        if not isinstance(overwrite, bool):
            raise BadRequestError(f"overwrite must be a bool, got {overwrite!r:.80}")
        prep, rows, tags = prepare_put(partition, data, rows, tags, timeout, self.copy_on_put)
        ticket = await self._plane.reserve_put(
            partition, prep.schemas, prep.row_bytes, prep.n, rows, tags, overwrite, timeout
        )
        try:
            try:
                written = self._write(ticket, prep.cells)
            except BaseException as e:
                self.controller.abort_put(ticket)
                if isinstance(e, Exception) and not isinstance(e, AsyncFlowError):
                    raise StorageUnitError(
                        f"put into {partition!r} failed in a storage unit "
                        f"({type(e).__name__}: {e}); nothing was written"
                    ) from e
                raise
            try:
                self.controller.commit_put(ticket)
            except BaseException:  # e.g. the partition was deleted meanwhile: leave no cells
                _undo(ticket.storage_key, written)
                raise
        finally:  # rows consumed by every task while this put wrote into them are freed now
            self._plane.free_reclaimed()
        return ticket.rows

    def _write(self, ticket: PutTicket, cells: Mapping[str, list[CellValue]]) -> _Written:
        """Write every unit's share; if one fails, undo the others so nothing changed.
        Returns what was written, so a failed commit can undo it too."""
        per_unit = split_by_unit(ticket.rows, cells, len(self.units), ticket.new_rows)
        done: _Written = []
        try:
            for unit, part in zip(self.units, per_unit, strict=True):
                if part:
                    done.append((unit, part, unit.write(ticket.storage_key, part)))
        except BaseException:
            _undo(ticket.storage_key, done)
            raise
        return done

    # -- reads ---------------------------------------------------------------------------------
    async def get_meta(
        self,
        partition: str,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        *,
        sampler: Scheduler | None = None,
        timeout: float | None = DEFAULT_GET_TIMEOUT_S,
        lease_s: float = DEFAULT_LEASE_S,
        current_version: Version | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
        member: int = 0,
        ack: BatchMeta | None = None,
    ) -> BatchMeta:
        check_get_meta(fields, timeout)
        check_name("partition", partition)
        check_name("task", task)
        check_lease_args(batch_size, lease_s, current_version, dp_rank, dp_size, member)
        sampler = sampler if sampler is not None else SequentialSampler()
        if ack is not None:  # every check first: a rejected call commits nothing
            check_lease_meta(ack, "ack")
            self._plane.ack_before_lease(
                ack, partition, task, fields, batch_size, sampler, lease_s=lease_s,
                dp_rank=dp_rank, dp_size=dp_size, member=member,
            )  # fmt: skip
        return await self._plane.lease(
            partition, task, fields, batch_size, sampler, timeout=timeout, lease_s=lease_s,
            current_version=current_version, dp_rank=dp_rank, dp_size=dp_size, member=member,
        )  # fmt: skip

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
        check_pad_value(pad_value)
        check_out(out)
        if not meta.rows:
            return Batch((), {}, {}, ())
        key, schemas = self.controller.check_readable(meta.partition, meta.rows, names)
        values = self._read(key, meta.rows, names)
        return assemble_batch(meta, names, schemas, values, layout, pad_value, out=out)

    def _read(
        self, partition: str, rows: Sequence[int], fields: Sequence[str]
    ) -> dict[str, list[CellValue]]:
        n_units = len(self.units)
        try:
            if n_units == 1:
                return self.units[0].read(partition, rows, fields)
            by_unit = rows_by_unit(rows, n_units)
            got = [
                u.read(partition, rs, fields) if rs else {}
                for u, rs in zip(self.units, by_unit, strict=True)
            ]
        except StorageUnitError as e:
            raise UnknownRowError(str(e)) from None
        except AsyncFlowError:
            raise
        except Exception as e:
            raise StorageUnitError(
                f"reading rows of partition key {partition!r} failed in a storage unit "
                f"({type(e).__name__}: {e})"
            ) from e
        return merge_by_unit(rows, got, fields, n_units)

    # -- consumption ---------------------------------------------------------------------------
    async def ack(self, meta: BatchMeta) -> None:
        check_lease_meta(meta, "ack")
        self.controller.ack(meta)
        self._plane.free_reclaimed()

    async def nack(self, meta: BatchMeta) -> None:
        check_lease_meta(meta, "nack")
        self.controller.nack(meta)

    def _delete_rows(self, freed: dict[str, list[int]]) -> None:
        for key, rows in freed.items():
            for unit, mine in zip(self.units, rows_by_unit(rows, len(self.units)), strict=True):
                if mine:
                    unit.delete_rows(key, mine)


_FOLDS_ACK: dict[type, bool] = {}


def folds_ack(store: object) -> bool:
    """Whether ``store.get_meta`` takes ``ack=`` (see ``DataStore.get_meta``): it names the
    parameter. A store written before the parameter existed does not, and neither does one
    that only takes ``**kwargs`` (it may drop an ``ack`` it does not know, and a lost ack is a
    row trained twice): those get ``ack()`` then ``get_meta()``. Asked once per store type."""
    kind = type(store)
    known = _FOLDS_ACK.get(kind)
    if known is None:
        try:
            params = inspect.signature(getattr(store, "get_meta")).parameters  # noqa: B009
        except (AttributeError, TypeError, ValueError):
            known = False
        else:
            param = params.get("ack")
            known = param is not None and param.kind is not inspect.Parameter.VAR_POSITIONAL
        _FOLDS_ACK[kind] = known
    return known


async def get_meta_after_ack(
    store: DataStore,
    ack: BatchMeta | None,
    partition: str,
    task: str,
    fields: Sequence[str],
    batch_size: int,
    **kwargs: Any,
) -> BatchMeta:
    """``store.get_meta(partition, task, fields, batch_size, ack=ack, **kwargs)`` where the
    store takes ``ack=`` (``folds_ack``), else ``await store.ack(ack)`` then ``get_meta``:
    the same outcome, one round trip more. ``ack=None`` is a plain ``get_meta``."""
    if ack is None:
        return await store.get_meta(partition, task, fields, batch_size, **kwargs)
    if folds_ack(store):
        return await store.get_meta(partition, task, fields, batch_size, ack=ack, **kwargs)
    await store.ack(ack)
    return await store.get_meta(partition, task, fields, batch_size, **kwargs)


_Written = list[
    tuple["StorageUnit", dict[str, dict[int, CellValue]], dict[str, dict[int, CellValue]]]
]


def _undo(key: str, written: _Written) -> None:
    for unit, part, replaced in written:
        unit.undo(key, part, replaced)


def prepare_put(
    partition: str,
    data: Mapping[str, Any],
    rows: Sequence[int] | None,
    tags: Sequence[Tags] | None,
    timeout: float | None,
    copy: bool,
) -> tuple[_Prepared, list[int] | None, list[Tags] | None]:
    """Check a put's arguments and split its data into per-row cells (see ``put``)."""
    _check_timeout(timeout)
    check_name("partition", partition)
    prep = _prepare_put(partition, data, copy)
    row_ids = None
    if rows is not None:
        row_ids = _int_rows(rows)
        if len(row_ids) != prep.n:
            raise BadRequestError(
                f"put into {partition!r}: {len(row_ids)} rows given for {prep.n} values per field"
            )
    tag_list = None
    if tags is not None:
        if not isinstance(tags, list | tuple):
            raise BadRequestError(
                f"put into {partition!r}: tags must be a list of Tags, got {tags!r:.80}"
            )
        tag_list = list(tags)
        if len(tag_list) != prep.n or not all(isinstance(t, Tags) for t in tag_list):
            raise BadRequestError(
                f"put into {partition!r}: tags must be {prep.n} Tags objects (one per row)"
            )
    return prep, row_ids, tag_list


def check_get_meta(fields: Sequence[str], timeout: float | None) -> None:
    """The checks of ``get_meta``'s arguments made before the controller sees them."""
    _check_timeout(timeout)
    if (
        not isinstance(fields, list | tuple)
        or not fields
        or not all(isinstance(f, str) and f for f in fields)
    ):
        raise BadRequestError(f"fields must be a non-empty list of field names, got {fields!r:.80}")


def check_get_data(meta: BatchMeta, fields: Sequence[str] | None, layout: str) -> list[str]:
    """The checks of ``get_data``'s arguments; returns the field names to read."""
    if not isinstance(meta, BatchMeta):
        raise BadRequestError(f"get_data takes the BatchMeta from get_meta, got {meta!r:.80}")
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        raise BadRequestError(f"layout must be one of {list(_LAYOUTS)}, got {layout!r:.80}")
    names = meta.fields if fields is None else fields
    if not isinstance(names, list | tuple) or not all(isinstance(f, str) and f for f in names):
        raise BadRequestError(f"fields must be a list of field names, got {names!r:.80}")
    check_name("partition", meta.partition)
    _rows_of(meta, "get_data")
    return list(names)


def assemble_batch(
    meta: BatchMeta,
    names: Sequence[str],
    schemas: Mapping[str, FieldSchema],
    values: Mapping[str, list[CellValue]],
    layout: Layout,
    pad_value: float,
    *,
    out: Batch | None = None,
) -> Batch:
    """The ``Batch`` of ``meta``'s rows from the per-row cell values read from storage.

    ``out``: an earlier batch whose buffers the new one may reuse (see ``DataStore.get_data``).
    A padded or nested field is written into the memory of one of ``out``'s tensors (the one
    of the same field name first, else any other that is big enough) when nothing but ``out``
    holds that memory: a tensor that is still viewed elsewhere (a kept micro-batch slice, a
    tensor saved for backward, a numpy view, shared memory) is never overwritten. Whatever
    cannot be reused (a list-layout or plain field, a buffer too small, no spare tensor) is
    simply not reused: the answer is the same either way. ``out`` that is not a ``Batch``
    raises ``BadRequestError`` before anything is read. The returned batch may share memory
    with ``out``: the caller must be done with ``out``."""
    check_out(out)
    buffers = _Buffers(out if layout != "list" else None)
    batch = Batch(meta.rows, {}, {}, meta.tags)
    for f in names:
        _assemble(batch, f, schemas[f], values[f], layout, pad_value, buffers)
    return batch


def check_out(out: object) -> None:
    """``get_data``'s ``out`` is None or a ``Batch``."""
    if out is not None and not isinstance(out, Batch):
        raise BadRequestError(
            f"out must be a Batch an earlier get_data returned, or None; got {type(out).__name__}"
        )


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and (not _is_number(timeout) or not timeout >= 0):
        raise BadRequestError(
            f"timeout must be >= 0 seconds or None (wait forever), got {timeout!r:.80}"
        )


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_index(value: object) -> bool:
    """An integer (numpy and torch integer scalars included), not a bool or a float."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor | np.ndarray) and value.ndim):
        return False
    try:
        operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def _int_rows(rows: Sequence[int]) -> list[int]:
    if not isinstance(rows, list | tuple | range | np.ndarray | torch.Tensor):
        raise BadRequestError(f"rows must be a list of row ids, got {rows!r:.80}")
    out = []
    for r in rows:
        if not _is_index(r):
            raise BadRequestError(f"row ids must be ints, got {r!r:.80}")
        out.append(operator.index(r))
    return out


def check_name(what: str, value: object) -> None:
    """``value`` is a non-empty str (a partition, task or field name)."""
    if not isinstance(value, str) or not value:
        raise BadRequestError(f"{what} must be a non-empty str, got {value!r:.80}")


def check_create_partition(name: object, fields: object, capacity: object, tasks: object) -> None:
    """The type checks of ``create_partition``'s arguments (the controller checks values)."""
    check_name("partition name", name)
    for what, names in (("fields", fields), ("tasks", tasks)):
        if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
            raise BadRequestError(f"{what} must be a list of names, got {names!r:.80}")
    if capacity is None:
        return
    if not isinstance(capacity, Capacity):
        raise BadRequestError(f"capacity must be a Capacity or None, got {capacity!r:.80}")
    for knob in ("max_rows", "max_bytes"):
        value = getattr(capacity, knob)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise BadRequestError(f"Capacity.{knob} must be a positive int or None, got {value!r}")


def check_lease_args(
    batch_size: object,
    lease_s: object,
    current_version: object,
    dp_rank: object,
    dp_size: object,
    member: object,
) -> None:
    """The type checks of ``get_meta``'s numbers (the controller checks their ranges)."""
    for what, value in (("batch_size", batch_size), ("dp_rank", dp_rank), ("dp_size", dp_size),
                        ("member", member)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadRequestError(f"{what} must be an int, got {value!r:.80}")
    if not _is_number(lease_s) or not 0 < lease_s < math.inf:  # type: ignore[operator]
        raise BadRequestError(f"lease_s must be a number of seconds > 0, got {lease_s!r:.80}")
    if current_version is not None and (
        isinstance(current_version, bool)
        or not isinstance(current_version, int)
        or current_version < 0
    ):
        raise BadRequestError(
            f"current_version must be None or an int >= 0, got {current_version!r:.80}"
        )


def check_pad_value(pad_value: object) -> None:
    if not _is_number(pad_value):
        raise BadRequestError(f"pad_value must be a number, got {pad_value!r:.80}")


def check_lease_meta(meta: object, verb: str) -> None:
    """``meta`` is a ``BatchMeta`` whose lease fields have the types ``get_meta`` gives."""
    if not isinstance(meta, BatchMeta):
        raise BadRequestError(f"{verb} takes the BatchMeta from get_meta, got {meta!r:.80}")
    check_name("partition", meta.partition)
    check_name("task", meta.task)
    if meta.lease_id is not None and not isinstance(meta.lease_id, str):
        raise BadRequestError(f"{verb}: lease_id must be a str, got {meta.lease_id!r:.80}")
    if isinstance(meta.member, bool) or not isinstance(meta.member, int) or meta.member < 0:
        raise BadRequestError(f"{verb}: member must be an int >= 0, got {meta.member!r:.80}")
    _rows_of(meta, verb)


def _rows_of(meta: BatchMeta, verb: str) -> None:
    rows = meta.rows  # a plain int is the common case: test it first, it is 10x cheaper
    if not isinstance(rows, tuple | list) or not all(type(r) is int or _is_index(r) for r in rows):
        raise BadRequestError(f"{verb}: meta.rows must be row ids, got {meta.rows!r:.80}")


def _assemble(
    batch: Batch,
    name: str,
    schema: FieldSchema,
    values: list[CellValue],
    layout: Layout,
    pad_value: float,
    buffers: _Buffers,
) -> None:
    if not schema.is_tensor:
        batch.data[name] = values
        return
    tensors: list[torch.Tensor] = values  # type: ignore[assignment]  # schema says tensors
    pieces = tensors.pieces if type(tensors) is Rows else None
    if layout == "list":
        batch.data[name] = tensors if pieces is None else list(tensors)
        if schema.ndim:
            batch.lengths[name] = torch.tensor([t.shape[0] for t in tensors], dtype=torch.long)
        return
    dtype = tensors[0].dtype
    if schema.ndim == 0:
        dst = buffers.tensor(name, dtype, (len(tensors),))
        batch.data[name] = torch.stack(tensors, out=dst)
        return
    lens = [t.shape[0] for t in tensors]
    batch.lengths[name] = torch.tensor(lens, dtype=torch.long)
    trailing = tensors[0].shape[1:]
    uniform = schema.ndim == 1 or all(t.shape[1:] == trailing for t in tensors)
    if layout == "nested":
        batch.data[name] = _nested(buffers, name, tensors, lens, trailing, uniform, pieces)
        return
    if not uniform:
        raise BadRequestError(
            f"field {name!r}: rows differ beyond dim 0, so they cannot be padded into one "
            "tensor; read it with layout='list'"
        )
    batch.data[name] = _padded(buffers, name, tensors, lens, trailing, pad_value, pieces)


def _padded(
    buffers: _Buffers,
    name: str,
    tensors: list[torch.Tensor],
    lens: list[int],
    trailing: torch.Size,
    pad_value: float,
    pieces: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """``[B, max_len, *trailing]`` in one pass: each row copied into place and only the tail
    after it filled with ``pad_value`` (one ``torch.cat`` into the output, the padding pieces
    read from one small filler), into reused memory when ``buffers`` has some. ``pieces``
    (see ``Rows``): rows of equal length are copied from them, a few large copies."""
    n, max_len, min_len = len(tensors), max(lens), min(lens)
    dtype = tensors[0].dtype
    dst = buffers.tensor(name, dtype, (n, max_len, *trailing))
    if dst.numel() == 0:
        return dst
    flat = dst.view(n * max_len, *trailing)  # row i's slot: flat[i * max_len : (i + 1) * max_len]
    if min_len == max_len:
        if pieces is not None:
            torch.cat(pieces, out=dst.view(-1))
        else:
            torch.cat(tensors, out=flat)
        return dst
    if sum(lens) < _SMALL_ROWS_ELEMS * n and n > _SMALL_ROWS_MIN_BATCH:
        # many short rows: the per-piece cost of the copy below dominates, so fill the padding
        # positions, then scatter the rows into the others (each element written once)
        mask = torch.arange(max_len)[None, :] < torch.tensor(lens)[:, None]
        dst.masked_fill_(~mask.view(n, max_len, *([1] * len(trailing))), pad_value)
        dst[mask] = torch.cat(tensors)
        return dst
    gap = max_len - min_len
    if gap * math.prod(trailing) * dtype.itemsize <= _FILLER_MAX_BYTES:
        filler = torch.full((gap, *trailing), pad_value, dtype=dtype)
    else:  # a huge gap (wide trailing dims): one value, broadcast
        one = torch.full((1,) * (1 + len(trailing)), pad_value, dtype=dtype)
        filler = one.expand(gap, *trailing)
    parts: list[torch.Tensor] = []
    for t, k in zip(tensors, lens, strict=True):
        parts.append(t)
        if k < max_len:
            parts.append(filler[: max_len - k])
    torch.cat(parts, out=flat)
    return dst


def _nested(
    buffers: _Buffers,
    name: str,
    tensors: list[torch.Tensor],
    lens: list[int],
    trailing: torch.Size,
    uniform: bool,
    pieces: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """One jagged ``torch.nested`` tensor: the rows concatenated into one values tensor (in
    reused memory when ``buffers`` has some; from ``pieces`` when given, see ``Rows``) plus
    their offsets."""
    total = sum(lens)
    if not uniform or total == 0:  # torch decides which dim is ragged, as before
        return torch.nested.nested_tensor(tensors, layout=torch.jagged)
    values = buffers.tensor(name, tensors[0].dtype, (total, *trailing))
    if pieces is not None:
        torch.cat(pieces, out=values.view(-1))
    else:
        torch.cat(tensors, out=values)
    offsets = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.long)
    return _JAGGED(values, offsets, min(lens), max(lens))


class Rows(list[torch.Tensor]):
    """The per-row tensors of one field, in batch order, that are consecutive slices of a few
    flat 1-D tensors, ``pieces``: their concatenation is the rows' elements back to back. A
    store's reader that knows this (the Ray store's rows arrive as a few packed columns)
    passes ``Rows`` to ``assemble_batch``, which then builds a padded (rows of equal length)
    or nested field with a few large copies instead of one per row."""

    __slots__ = ("pieces",)

    def __init__(self, rows: Sequence[torch.Tensor], pieces: list[torch.Tensor]) -> None:
        super().__init__(rows)
        self.pieces = pieces


def _jagged_builder() -> Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]:
    """``build(values, offsets, min_len, max_len)``: a jagged nested tensor over ``values``.

    It constructs torch's ``NestedTensor`` directly, as the op that
    ``torch.nested.nested_tensor(..., layout=torch.jagged)`` ends in does
    (``_nested_view_from_jagged_default`` in ``torch/nested/_internal/ops.py``); going through
    that op costs ~90 us of Python dispatch per tensor, 3x the construction, and batches have
    a dozen nested fields. The result is not an autograd view of ``values`` (store batches
    carry no gradient). A probe at import compares it with the public builder (type, values,
    offsets, rows, storage reference counts); if this torch differs, the public op is used."""

    def public(values: torch.Tensor, offsets: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        return torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=lo, max_seqlen=hi)

    try:
        from torch.nested._internal import nested_tensor as njt

        view = njt.nested_view_from_values_offsets  # what the public op wraps, minus a warning
        nested_tensor, store = njt.NestedTensor, njt._store_val_in_tensor

        def direct(values: torch.Tensor, offsets: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
            cache = {"min_seqlen": store(lo), "max_seqlen": store(hi)}
            return nested_tensor(values, offsets, _metadata_cache=cache)

        rows = [torch.arange(2.0), torch.arange(3.0, 6.0)]
        want = torch.nested.nested_tensor(rows, layout=torch.jagged)
        values, offsets = torch.cat(rows), torch.tensor([0, 2, 5])
        got = direct(values, offsets, 2, 3)

        def refs(t: torch.Tensor) -> tuple[int, tuple[bool, int] | None]:
            py, found = _ref_counts({"n": t})["n"]
            return py, None if found is None else (found[0], found[2])

        ok = (
            type(got) is type(want)
            and getattr(got, "_values", None) is values
            and getattr(got, "_offsets", None) is offsets
            and got.dim() == want.dim()
            and all(torch.equal(a, b) for a, b in zip(got.unbind(), rows, strict=True))
            and refs(got) == refs(want)
        )
    except Exception:  # pragma: no cover - another torch's internals
        return public
    if ok:
        return direct

    def via_op(values: torch.Tensor, offsets: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        return view(values, offsets, min_seqlen=lo, max_seqlen=hi)  # type: ignore[no-any-return,no-untyped-call]

    return via_op  # pragma: no cover


# -- batch memory: reuse of ``out`` and a small pool of recently freed buffers ---------------
_FILLER_MAX_BYTES = 1 << 20  # a padding filler bigger than this is one broadcast value instead
_SMALL_ROWS_MIN_BATCH = 8
_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def _storage_refs(t: torch.Tensor) -> tuple[bool, torch.UntypedStorage, int] | None:
    """Whether ``t`` is a jagged nested tensor, its memory (for a nested tensor, that of its
    values) and how many references that memory has, counted the same way for every tensor
    (see ``_EXCLUSIVE``). It reads a nested tensor's ``_values`` attribute rather than calling
    its methods, which dispatch through Python (~20 us each)."""
    if _use_count is None:
        return None
    nested = type(t) is not torch.Tensor
    if nested:  # a torch.nested jagged tensor keeps its values as ``_values``
        values = getattr(t, "_values", None)
        if type(values) is not torch.Tensor:
            return None
        t = values
    if t.is_nested or t.layout != torch.strided or t.device.type != "cpu":
        return None
    s = t.untyped_storage()
    return nested, s, int(_use_count(s._cdata))


def _ref_counts(
    data: Mapping[str, object],
) -> dict[str, tuple[int, tuple[bool, torch.UntypedStorage, int] | None]]:
    """For each value: its Python reference count and, for a tensor, ``_storage_refs``, all
    taken the same way for every batch (``_EXCLUSIVE`` holds what they are for a tensor that
    nothing but ``data`` references)."""
    found = {}
    for name, value in data.items():
        py = sys.getrefcount(value)
        found[name] = (py, _storage_refs(value) if isinstance(value, torch.Tensor) else None)
    return found


def _probe_exclusive() -> tuple[int, int | None, int] | None:
    """``_ref_counts`` of a dense and of a nested tensor held by nothing but a dict: the
    storage reference counts of each (nested None: this torch's nested tensors are not
    understood, so their memory is not reused) and the Python reference count of a tensor
    object. None: this torch cannot tell, so nothing is reused."""
    try:
        nt = torch.nested.nested_tensor([torch.empty(1), torch.empty(3)], layout=torch.jagged)
        data: dict[str, object] = {"dense": torch.empty(4), "nested": nt}
        del nt
        counts = _ref_counts(data)
    except Exception:  # pragma: no cover - a torch without these internals
        return None
    (py, dense), (py_nested, nested) = counts["dense"], counts["nested"]
    if dense is None or dense[0]:
        return None
    nested_refs = nested[2] if nested is not None and nested[0] and py_nested == py else None
    return dense[2], nested_refs, py


_EXCLUSIVE = _probe_exclusive()
_JAGGED = _jagged_builder()


def _spare_storages(data: Mapping[str, object]) -> dict[str, torch.UntypedStorage]:
    """The memory of each value of ``data`` that the store may write into: a CPU tensor the
    store could have made (dense or jagged nested, private resizable memory) that nothing
    else references: neither another tensor viewing its memory nor another reference to the
    tensor object (a variable, a list, a store cell). Each memory once."""
    if _EXCLUSIVE is None:
        return {}
    spare: dict[str, torch.UntypedStorage] = {}
    seen: set[int] = set()
    for name, (py, got) in _ref_counts(data).items():
        if got is None or py != _EXCLUSIVE[2]:
            continue
        nested, s, refs = got
        if refs != _EXCLUSIVE[1 if nested else 0] or s.is_shared() or not s.resizable():
            continue
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            spare[name] = s
    return spare


def _on_storage(s: torch.UntypedStorage, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A contiguous tensor of ``shape`` at the start of ``s``."""
    stride = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        stride[d] = stride[d + 1] * max(shape[d + 1], 1)
    return torch.empty(0, dtype=dtype).set_(s, 0, tuple(shape), stride)


class BufferPool:
    """Memory of recent batches, kept so the next batch of a similar size reuses it instead of
    asking the OS for fresh pages (their first touch costs a page fault each: ~2-3x the cost of
    a padded batch on these VMs). It holds at most ``max_bytes`` of buffers (LRU eviction of
    the unused ones; 0 turns it off); a buffer is handed out again only once nothing else
    references its memory (the batch that used it was dropped), so a batch still in use is
    never overwritten. Only buffers of at least ``min_bytes`` are pooled: smaller ones come
    from the allocator's heap, which reuses memory by itself. ``get_data(..., out=)`` is still
    the faster path: it needs no lookup and keeps the memory with the caller."""

    def __init__(self, max_bytes: int = 256 << 20, min_bytes: int = 1 << 20) -> None:
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        self._lock = threading.Lock()
        self._entries: list[torch.UntypedStorage] = []  # least recently used first

    @property
    def nbytes(self) -> int:
        """Bytes of memory the pool holds (in use by a batch or not)."""
        with self._lock:
            return sum(s.nbytes() for s in self._entries)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def clear(self) -> None:
        """Forget every buffer (memory still used by a batch stays with that batch)."""
        with self._lock:
            self._entries.clear()

    def tensor(self, dtype: torch.dtype, shape: Sequence[int], nbytes: int) -> torch.Tensor:
        """A tensor of ``shape`` in a free pooled buffer of ``nbytes`` to ``2 * nbytes``, else
        in a new buffer (pooled if it fits in ``max_bytes``, evicting unused ones)."""
        if _POOL_FREE is None or nbytes < self.min_bytes or self.max_bytes <= 0:
            return torch.empty(tuple(shape), dtype=dtype)
        with self._lock:
            best = None
            for i, s in enumerate(self._entries):
                cap = s.nbytes()
                fits = nbytes <= cap <= 2 * nbytes
                if fits and (best is None or cap < self._entries[best].nbytes()) and _is_free(s):
                    best = i
            if best is not None:
                s = self._entries.pop(best)
                self._entries.append(s)
                return _on_storage(s, dtype, shape)  # in use from here: not free any more
            s = torch.empty(_size_class(nbytes), dtype=torch.uint8).untyped_storage()
            t = _on_storage(s, dtype, shape)
            total = sum(e.nbytes() for e in self._entries) + s.nbytes()
            for e in [e for e in self._entries if _is_free(e)]:  # evict LRU unused buffers
                if total <= self.max_bytes:
                    break
                self._entries.remove(e)
                total -= e.nbytes()
            if total <= self.max_bytes:
                self._entries.append(s)
            return t


def _size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to the next of four sizes per power of two (at most 25% more), so
    batches of similar sizes fit each other's buffers."""
    step = max(1, (1 << max(0, nbytes.bit_length() - 3)))
    return -(-nbytes // step) * step


def _probe_pool_free() -> int | None:
    """The reference count of a pooled storage that no tensor uses (None: cannot tell)."""
    if _use_count is None:
        return None
    try:
        s = torch.empty(4).untyped_storage()
        return int(_use_count(s._cdata))
    except Exception:  # pragma: no cover - a torch without these internals
        return None


_POOL_FREE = _probe_pool_free()


def _is_free(s: torch.UntypedStorage) -> bool:
    """Only the pool references ``s`` (and it was never moved to shared memory, where another
    process may map it)."""
    return _use_count is not None and int(_use_count(s._cdata)) == _POOL_FREE and not s.is_shared()


BATCH_POOL = BufferPool()
"""The process's pool of batch memory (``assemble_batch`` allocates from it when ``out`` has
no buffer to reuse); set ``BATCH_POOL.max_bytes = 0`` to turn it off, ``clear()`` to drop it."""


class _Buffers:
    """Where one batch's tensors go: the spare memory of ``out`` (the same field's first,
    else the smallest other one that fits), else ``BATCH_POOL``. Each spare is used once."""

    __slots__ = ("_spare",)

    def __init__(self, out: Batch | None) -> None:
        self._spare = {} if out is None else _spare_storages(out.data)

    def tensor(self, name: str, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        s = self._spare.get(name)
        if s is None or s.nbytes() < nbytes:
            fits = [(v.nbytes(), k) for k, v in self._spare.items() if v.nbytes() >= nbytes]
            s = self._spare[min(fits)[1]] if fits else None
        if s is not None:
            del self._spare[next(k for k, v in self._spare.items() if v is s)]
            return _on_storage(s, dtype, shape)
        return BATCH_POOL.tensor(dtype, shape, nbytes)
