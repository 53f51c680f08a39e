"""The DataStore on a Ray cluster: a controller actor, N storage-unit actors spread over the
nodes, and a client (``RayDataStore``) that any driver, task or actor of the cluster can hold.

Control plane and data plane are separate, as in TransferQueue:

* The **controller actor** holds the partitions' metadata: the same ``Controller`` and
  ``ControlPlane`` the in-process store runs (readiness per cell, consumption per task,
  leases, tags, capacity), so both stores follow one implementation of the contract. It never
  sees a value. It is an asyncio actor: a ``get_meta`` (or a put waiting for capacity) waits
  inside it, and many can wait at once.
* Each **storage-unit actor** holds the cells of the rows routed to it (row ``r`` on unit
  ``(r // B) % N``: blocks of ``B = rows_per_block`` consecutive rows, 32 by default), in a
  ``StorageUnit``. ``create()`` places unit ``u`` on node ``u % nodes``.
* The **client** asks the controller for a ticket (put) or a lease (``get_meta``), then writes
  or reads the units directly, all units in parallel: values never pass through the
  controller.

The data plane moves each byte once per direction (within a node):

* **Put.** The client splits the put by unit; a batch tensor's rows for one unit are
  contiguous slices of it (blocks of consecutive ids), sent as numpy views (a list of row
  tensors is packed per run first: one copy). A unit's share of 1 MiB or more
  (``BY_REF_MIN_BYTES``) is ``ray.put`` by the client (Ray's copy into the node's
  shared-memory object store: the only copy) and the unit gets its ``ObjectRef``; a smaller
  share travels by value in the call. Either way the unit **keeps what it received**, no copy:
  read-only numpy views of the object store's copy (pulled to the unit's node first when the
  producer is on another node), plus the ``ObjectRef``.
* **Get.** A unit answers a read of large shares with their ``ObjectRef``s and the rows'
  places in them; the reader maps them from its node's object store (no copy in the unit, none
  in Ray's reply; pulled once across nodes) and takes views of its rows. Small shares come by
  value (Ray copies them into the reply). ``get_data`` then assembles the batch: ``padded`` and
  ``nested`` copy the rows once into tensors the caller owns; ``list`` hands out the views.
  If a large share's object is lost (its producer's node is gone) the read falls back to the
  unit's own mapped copy, by value.

Ownership rule: what a unit holds is immutable. A put's bytes are copied out of the caller's
tensors before ``put`` returns (the caller may reuse its buffers at once); nobody writes the
object-store copies afterwards: units keep read-only views, ``list``-layout reads are
read-only views of them (never modify those tensors in place; ``padded`` / ``nested`` batches
are the caller's own memory). An object is freed when every row of it has been reclaimed
(acked by every task, or its partition deleted) and no reader still holds a view of it: the
store's live data lives in Ray's object store, so size it for them
(``RayRuntime(object_store_bytes=...)``; when it is full, Ray falls back to disk-backed
memory). An overwritten cell keeps the rest of its put's object alive until those rows go.

Control plane per call: a put is 3 round trips (the controller's ticket, the units' writes in
parallel, the controller's commit; an overwrite's units are then told to drop their undo
entries, fire and forget); a ``get_meta`` with a built-in sampler 1, which also brings the
controller's readability check of the leased rows; ``get_data`` 1 (the units' reads in
parallel, then mapping the objects), plus the controller's check in parallel when the lease's
own check no longer stands (older than ``LEASE_TRUST * lease_s``, acked, other rows or
fields, another sampler); ``ack`` 1, durable when it returns (the deletes it frees are sent
``DELETE_DELAY_S`` later, several acks' in one call per unit). A ``get_meta`` that carries
an ack (``ack=``) is still 1 call: the controller commits the ack, then leases.

Trust: every message is a Ray call between members of one cluster (Ray's own serialization);
AsyncFlow opens no port and unpickles nothing from outside the cluster. Use Ray's token
authentication (on by default in Ray 2.60) and keep the cluster's ports private.

Failures: a dead storage unit makes every call that touches its rows raise
``StorageUnitLostError`` naming the unit, its node and those rows; the other units' rows stay
readable. A dead controller raises ``StoreLostError``. A consumer that dies holding a lease
loses it at the lease's deadline and its rows go to the next consumer (``lease_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import math
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from asyncflow_core.contracts.errors import (
    AsyncFlowError,
    BadRequestError,
    ConfigError,
    SamplerError,
    StorageUnitError,
    StorageUnitLostError,
    StoreLostError,
    StoreTimeoutError,
    UnknownRowError,
)
from asyncflow_core.contracts.protocols import (
    DEFAULT_GET_TIMEOUT_S,
    DEFAULT_LEASE_S,
    Batch,
    BatchMeta,
    Candidates,
    Capacity,
    CellValue,
    FieldSchema,
    Layout,
    PartitionStats,
    PlainValue,
    SampleRequest,
    Scheduler,
    Selection,
    Tags,
    Version,
)
from asyncflow_core.data.controller import (
    Controller,
    PutTicket,
    check_get_args,
    fmt_rows,
    members_of,
    validate_selection,
)
from asyncflow_core.data.scheduling import SequentialSampler
from asyncflow_core.data.store import (
    ControlPlane,
    Rows,
    StorageUnit,
    assemble_batch,
    check_get_data,
    check_get_meta,
    check_lease_meta,
    check_out,
    loop_clock,
    prepare_put,
)
from asyncflow_ray.runtime import alive_nodes, background, bytes_tensor, first_line, import_ray

UNIT_CONCURRENCY = 8
"""Calls a storage-unit actor serves at once (threads; a unit's state has its own lock)."""


# --------------------------------------------------------------------------------------------
# Wire format
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PackedColumn:
    """The tensors of one field for some rows: ``data`` holds their bytes back to back."""

    dtype: str
    shapes: tuple[tuple[int, ...], ...]
    data: np.ndarray[Any, np.dtype[np.uint8]]


Segments = list[PackedColumn]
"""A tensor field read from a unit: runs of rows, each a slice of one packed column as the
unit received it (no copy in the unit)."""
Column = list[PackedColumn] | list[PlainValue]
Share = dict[str, Column]
"""A unit's part of a put: ``field -> values`` of its rows (the rows are sent alongside); a
tensor field as one ``PackedColumn`` per run of consecutive rows of the put."""
ReadColumn = Segments | list[PlainValue]
RefSegment = tuple[int, int, int, int, int, int]
"""Rows ``a..b-1`` of a put's share held in the object store: ``(i, p, a, b, lo, hi)``,
``i`` the index of the share's ``ObjectRef`` in the reply, ``p`` the field's piece there,
``lo..hi`` the rows' bytes in it."""

ROWS_PER_BLOCK = 32
"""The default block (``RayDataStore.create(rows_per_block=...)``): rows are routed to units
by blocks of consecutive ids, row ``r`` on unit ``(r // rows_per_block) % N``, so a put of
consecutive rows of a batch tensor sends each unit contiguous slices of it (views: no copy
before Ray's) and a batch of consecutive rows is read as few runs. A larger block means fewer
unit calls per put and read (a batch within one block is one call), a smaller one spreads a
batch over more units (more parallel reads, across nodes too)."""


def unit_of(row: int, n_units: int, block: int = ROWS_PER_BLOCK) -> int:
    """The storage unit holding ``row``."""
    return (row // block) % n_units


def rows_by_unit(rows: Sequence[int], n_units: int, block: int) -> list[list[int]]:
    """``rows`` grouped by the unit holding them (order kept within each unit)."""
    by_unit: list[list[int]] = [[] for _ in range(n_units)]
    for r in rows:
        by_unit[(r // block) % n_units].append(r)
    return by_unit


def merge_by_unit(
    rows: Sequence[int],
    got: Sequence[Mapping[str, Sequence[CellValue]]],
    fields: Sequence[str],
    block: int,
) -> dict[str, list[CellValue]]:
    """Undo ``rows_by_unit``: ``got[u][field]`` holds unit ``u``'s values in its rows'
    order; returns ``field -> values`` in ``rows``' order. A field whose every unit gave
    ``Rows`` comes back as ``Rows`` too, its pieces the runs of the batch's rows that are
    consecutive in one unit piece (see ``batch_pieces``)."""
    n = len(got)
    order = [(r // block) % n for r in rows]
    out: dict[str, list[CellValue]] = {}
    for f in fields:
        cols = [g.get(f, ()) for g in got]
        iters = [iter(c) for c in cols]
        values: list[Any] = [next(iters[u]) for u in order]
        if values and all(type(c) is Rows or not c for c in cols):
            pieces = batch_pieces(order, cast(list[Rows], cols))
            if pieces is not None:
                values = Rows(values, pieces)
        out[f] = values
    return out


def batch_pieces(order: Sequence[int], cols: Sequence[Rows]) -> list[torch.Tensor] | None:
    """The pieces (see ``Rows``) of the rows taken in ``order`` (``order[i]``: the unit whose
    next row is the batch's row ``i``) from the units' ``cols``: each run of rows that follow
    each other in one of a unit's pieces is one slice of it (a view). None if a column's rows
    do not tile its pieces (the caller then copies row by row)."""
    sizes = [[p.numel() for p in c.pieces] if c else [] for c in cols]
    at = [[0, 0, 0] for _ in cols]  # per unit: next row, its piece, its element offset there
    out: list[torch.Tensor] = []
    run: list[int] = []  # the open run: unit, piece, first element, end element
    try:
        for u in order:
            cursor = at[u]
            k = cols[u][cursor[0]].numel()
            cursor[0] += 1
            if not k:
                continue
            while cursor[2] >= sizes[u][cursor[1]]:  # this piece is used up: the next one
                cursor[1] += 1
                cursor[2] = 0
            p, a = cursor[1], cursor[2]
            if a + k > sizes[u][p]:
                return None
            cursor[2] = a + k
            if run and run[0] == u and run[1] == p and run[3] == a:
                run[3] = a + k
                continue
            if run:
                out.append(cols[run[0]].pieces[run[1]][run[2] : run[3]])
            run = [u, p, a, a + k]
    except IndexError:
        return None
    if run:
        out.append(cols[run[0]].pieces[run[1]][run[2] : run[3]])
    return out


RefColumn = list[PackedColumn | RefSegment] | list[PlainValue]

LEASE_TRUST = 0.9
"""A lease's own readability check (made when the controller granted it) stands in for
``get_data``'s check while less than this fraction of ``lease_s`` has passed on the client's
clock since it asked: the lease's rows cannot be reclaimed before it ends, and cells once
ready stay ready."""

DELETE_DELAY_S = 0.01
"""How long the controller actor holds reclaimed rows before telling the units to delete
them (see ``ControllerServer._delete_rows``)."""

BY_REF_MIN_BYTES = 1 << 20
"""A put's share of at least this many tensor bytes goes to its unit by reference (the client
``ray.put``s it, the unit keeps the reference and a view) and is read by reference: a reader
on the same node maps it, with no copy. Smaller shares travel by value."""


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_numpy(t: torch.Tensor) -> np.ndarray[Any, Any]:
    """A CPU tensor as a numpy array sharing its memory (an integer view of the same width
    for the dtypes numpy lacks: bfloat16, the float8s, complex32)."""
    try:  # the common case, one call: a plain CPU tensor of a numpy dtype
        return t.numpy()
    except (RuntimeError, TypeError):
        pass
    t = t.detach().resolve_conj().resolve_neg()  # views unless a lazy bit is set
    if t.device.type != "cpu":
        t = t.cpu()
    try:
        return t.numpy()
    except TypeError:
        return t.view(_SAME_WIDTH_INT[t.element_size()]).numpy()


def _as_bytes(a: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A C-contiguous array's bytes as a flat ``uint8`` view."""
    return a.reshape(-1).view(np.uint8)


def pack(values: Sequence[CellValue]) -> PackedColumn | list[PlainValue]:
    """One column for the wire: tensors packed into one byte array (one copy, by numpy),
    plain values as a list."""
    if not values or not isinstance(values[0], torch.Tensor):
        return cast(list[PlainValue], list(values))  # a plain field holds plain values
    tensors = cast(list[torch.Tensor], list(values))
    shapes = tuple(tuple(t.shape) for t in tensors)
    flat = np.concatenate([_as_numpy(t).reshape(-1) for t in tensors])
    return PackedColumn(str(tensors[0].dtype).removeprefix("torch."), shapes, _as_bytes(flat))


def rows_view(source: torch.Tensor, run: range) -> PackedColumn:
    """Consecutive rows of a batch tensor (dim 0 = rows) as one column: a view of its
    memory when it is contiguous (Ray copies it once into the object store), else a copy."""
    picked = np.ascontiguousarray(_as_numpy(source)[run.start : run.stop])
    return PackedColumn(
        str(source.dtype).removeprefix("torch."),
        (tuple(source.shape[1:]),) * len(run),
        _as_bytes(picked),
    )


def unpack(column: PackedColumn, *, copy: bool) -> list[torch.Tensor]:
    """The per-row tensors of a column: views of one buffer (``copy``: of a private copy of
    it, else of the received, read-only bytes)."""
    return unpack_flat(column, copy=copy)[1]


def unpack_flat(column: PackedColumn, *, copy: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``unpack``, and the flat 1-D tensor of all the rows' elements its rows view."""
    flat = bytes_tensor(column.data, column.dtype, copy=copy)
    shapes = column.shapes
    if not shapes:
        return flat, []
    first = shapes[0]
    if all(s == first for s in shapes):  # equal rows: one view, unbound
        return flat, list(flat.view(len(shapes), *first).unbind(0))
    if all(len(s) == 1 for s in shapes):  # ragged 1-d rows: one split
        return flat, list(flat.split_with_sizes([s[0] for s in shapes]))
    parts = flat.split_with_sizes([math.prod(s) for s in shapes])
    return flat, [p.view(s) for p, s in zip(parts, shapes, strict=True)]


def unpack_read(column: ReadColumn, *, copy: bool = False) -> list[CellValue]:
    """The per-row values of a unit's ``read`` of one field (see ``unpack``)."""
    if column and isinstance(column[0], PackedColumn):
        return [t for seg in column for t in unpack(seg, copy=copy)]
    return list(cast(list[PlainValue], column))


class _Held:
    """A packed column as a storage unit received it, kept as is (a read-only view of the
    object store's copy of the put's argument) with each row's byte offset."""

    __slots__ = ("column", "offsets", "piece", "ref")

    def __init__(self, column: PackedColumn, ref: Any = None, piece: int = 0) -> None:
        self.column = column
        self.ref = ref  # the share's ObjectRef when it came by reference
        self.piece = piece  # which of the field's pieces in that share
        itemsize = getattr(torch, column.dtype).itemsize
        self.offsets = [0, *itertools.accumulate(math.prod(s) * itemsize for s in column.shapes)]

    def segment(self, a: int, b: int) -> PackedColumn:
        """Rows ``a..b-1`` as a column: a view, no copy."""
        c = self.column
        return PackedColumn(c.dtype, c.shapes[a:b], c.data[self.offsets[a] : self.offsets[b]])


class _RowCell:
    """What a storage unit stores for one tensor cell: row ``index`` of a ``_Held`` column."""

    __slots__ = ("held", "index")

    def __init__(self, held: _Held, index: int) -> None:
        self.held = held
        self.index = index


def _runs(cells: Sequence[_RowCell]) -> list[tuple[_Held, int, int]]:
    """Tensor cells as runs ``(held, a, b)`` of consecutive rows of one received column."""
    out = []
    start = 0
    for i in range(1, len(cells) + 1):
        if (
            i == len(cells)
            or cells[i].held is not cells[i - 1].held
            or cells[i].index != cells[i - 1].index + 1
        ):
            first = cells[start]
            out.append((first.held, first.index, first.index + i - start))
            start = i
    return out


def _segments(cells: Sequence[_RowCell]) -> Segments:
    """Tensor cells as slices (views) of the received columns, one per run."""
    return [held.segment(a, b) for held, a, b in _runs(cells)]


def _share_bytes(share: Share) -> int:
    return sum(p.data.nbytes for c in share.values() for p in c if isinstance(p, PackedColumn))


# --------------------------------------------------------------------------------------------
# The actors
# --------------------------------------------------------------------------------------------
class StorageUnitServer:
    """The body of a storage-unit actor: a ``StorageUnit`` plus the undo log of the puts
    whose writes may still be rolled back (until the client's ``release``)."""

    def __init__(self, unit_id: int) -> None:
        self.unit = StorageUnit(unit_id)
        self.unit_id = unit_id
        self._undo: dict[tuple[str, int], tuple[dict[str, dict[int, CellValue]], Any]] = {}

    def info(self) -> dict[str, Any]:
        ctx = import_ray().get_runtime_context()
        return {"unit": self.unit_id, "node_id": ctx.get_node_id(), "pid": os.getpid()}

    def write(
        self, key: str, rows: list[int], payload: Share | list[Any], ticket_id: int | None
    ) -> None:
        """Keep the values of ``rows`` as received, no copy (see the module's ownership
        rule): ``payload`` is the share itself or ``[ObjectRef]`` of it, mapped here (pulled
        to this node first if it was put on another). ``ticket_id``: keep what the write
        replaced until ``release`` (or ``undo``); None for new rows, which replace nothing
        (``forget`` undoes them)."""
        ref = None
        if isinstance(payload, list):
            ref = payload[0]
            share: Share = import_ray().get(ref)
        else:
            share = payload
        cells: dict[str, dict[int, CellValue]] = {}
        for f, col in share.items():
            if col and isinstance(col[0], PackedColumn):
                mine: dict[int, CellValue] = {}
                at = 0
                for p, piece in enumerate(col):
                    held = _Held(piece, ref, p)
                    for i in range(len(piece.shapes)):
                        mine[rows[at]] = cast(CellValue, _RowCell(held, i))
                        at += 1
                if at != len(rows):
                    raise BadRequestError(f"field {f!r}: {at} values for {len(rows)} rows")
                cells[f] = mine
            else:
                cells[f] = dict(zip(rows, cast(list[CellValue], col), strict=True))
        replaced = self.unit.write(key, cells)
        if ticket_id is not None:
            self._undo[(key, ticket_id)] = (cells, replaced)

    def undo(self, key: str, ticket_id: int) -> None:
        entry = self._undo.pop((key, ticket_id), None)
        if entry is not None:
            self.unit.undo(key, entry[0], entry[1])

    def release(self, key: str, ticket_id: int) -> None:
        self._undo.pop((key, ticket_id), None)

    def forget(self, key: str, rows: list[int], fields: list[str]) -> None:
        """Undo a write of new rows: drop their cells of ``fields``."""
        self.unit.undo(key, {f: dict.fromkeys(rows) for f in fields}, {})

    def read(self, key: str, rows: list[int], fields: list[str]) -> dict[str, ReadColumn]:
        """The cells of ``rows``: a tensor field as runs of the received columns (views, no
        copy here; Ray copies them once into the reply)."""
        got = self.unit.read(key, rows, fields)
        return {
            f: _segments(cast(list[_RowCell], v))
            if v and isinstance(v[0], _RowCell)
            else cast(list[PlainValue], v)
            for f, v in got.items()
        }

    def read_refs(
        self, key: str, rows: list[int], fields: list[str]
    ) -> tuple[list[Any], dict[str, RefColumn]]:
        """Like ``read``, but rows of shares that came by reference are answered as
        ``RefSegment``s of the returned ``ObjectRef``s (the reader maps them: no copy)."""
        got = self.unit.read(key, rows, fields)
        refs: list[Any] = []
        index: dict[int, int] = {}
        out: dict[str, RefColumn] = {}
        for f, values in got.items():
            v: list[Any] = values
            if not (v and isinstance(v[0], _RowCell)):
                out[f] = cast(list[PlainValue], v)
                continue
            col: list[PackedColumn | RefSegment] = []
            for held, a, b in _runs(v):
                if held.ref is None:
                    col.append(held.segment(a, b))
                    continue
                i = index.setdefault(id(held.ref), len(refs))
                if i == len(refs):
                    refs.append(held.ref)
                col.append((i, held.piece, a, b, held.offsets[a], held.offsets[b]))
            out[f] = col
        return refs, out

    def delete_rows(self, key: str, rows: list[int]) -> None:
        self.unit.delete_rows(key, rows)

    def drop_partition(self, key: str) -> None:
        self.unit.drop_partition(key)
        for k in [k for k in self._undo if k[0] == key]:
            del self._undo[k]

    def num_cells(self, key: str) -> int:
        return self.unit.num_cells(key)

    def reset(self) -> None:
        self.unit = StorageUnit(self.unit_id)
        self._undo.clear()


class ControllerServer:
    """The body of the controller actor: a ``ControlPlane`` (``Controller`` plus waiting)
    that tells the units to delete reclaimed rows."""

    def __init__(self, units: Sequence[Any], rows_per_block: int = ROWS_PER_BLOCK) -> None:
        self.units = list(units)
        self.rows_per_block = rows_per_block
        self.controller = Controller(loop_clock)
        self.plane = ControlPlane(self.controller, self._delete_rows)
        self._freed: dict[str, list[int]] = {}  # reclaimed rows whose deletes are not sent

    def _delete_rows(self, freed: dict[str, list[int]]) -> None:
        """Tell the units to delete reclaimed rows, ``DELETE_DELAY_S`` after the first of
        them (the deletes are fire and forget: no caller waits for them). Sending them at
        once cost the ack that freed them ~1.5 ms of its ~3 ms round trip on a 2-core box;
        later, the reclaims of several acks go out in one call per unit."""
        first = not self._freed
        for key, rows in freed.items():
            self._freed.setdefault(key, []).extend(rows)
        if first:
            asyncio.get_running_loop().call_later(DELETE_DELAY_S, self._send_deletes)

    def _send_deletes(self) -> None:
        freed, self._freed = self._freed, {}
        for key, rows in freed.items():
            by_unit = rows_by_unit(rows, len(self.units), self.rows_per_block)
            for unit, mine in zip(self.units, by_unit, strict=True):
                if mine:  # fire and forget: a dead unit's rows are lost anyway
                    unit.delete_rows.remote(key, mine)

    def get_units(self) -> list[Any]:
        return self.units

    def get_rows_per_block(self) -> int:
        return self.rows_per_block

    async def reset(self) -> None:
        """Forget every partition (new metadata; the units are cleared by the client)."""
        self._freed.clear()  # a new controller numbers its storage keys from 1 again
        self.controller = Controller(loop_clock)
        self.plane = ControlPlane(self.controller, self._delete_rows)

    async def create_partition(
        self, name: str, fields: Sequence[str], capacity: Capacity | None, tasks: Sequence[str]
    ) -> None:
        self.controller.create_partition(name, fields, capacity, tasks)

    async def register_task(self, partition: str, task: str) -> None:
        self.controller.register_task(partition, task)

    async def close(self, partition: str) -> None:
        self.controller.close(partition)

    async def delete_partition(self, partition: str) -> None:
        key = self.controller.begin_delete(partition)
        try:
            await asyncio.gather(
                *(u.drop_partition.remote(key) for u in self.units), return_exceptions=True
            )
        finally:
            self.controller.finish_delete(partition)

    async def storage_key(self, partition: str) -> str:
        return self.controller.storage_key(partition)

    async def stats(self, partition: str) -> PartitionStats:
        return self.controller.stats(partition)

    async def partitions(self) -> list[str]:
        return self.controller.partitions()

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
        return await self.plane.reserve_put(
            partition, schemas, row_bytes, n, rows, tags, overwrite, timeout
        )

    async def commit_put(self, ticket: PutTicket) -> None:
        try:
            self.controller.commit_put(ticket)
        finally:
            self.plane.free_reclaimed()

    async def abort_put(self, ticket: PutTicket) -> None:
        try:
            self.controller.abort_put(ticket)
        finally:
            self.plane.free_reclaimed()

    async def get_meta(
        self,
        partition: str,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        sampler: Scheduler,
        timeout: float | None,
        lease_s: float,
        current_version: Version | None,
        dp_rank: int,
        dp_size: int,
        member: int,
        ack: BatchMeta | None = None,
    ) -> tuple[BatchMeta, tuple[str, dict[str, FieldSchema]] | None]:
        """A whole lease in one call, the (stateless) sampler run here, waiting here; with
        what ``check_readable`` says of its rows and fields now (None if it refuses), so the
        lease's first ``get_data`` needs no check of its own. ``ack``: committed first (see
        ``DataStore.get_meta``), durable once applied here, before any wait."""
        if ack is not None:
            self.plane.ack_before_lease(
                ack, partition, task, fields, batch_size, sampler, lease_s=lease_s,
                dp_rank=dp_rank, dp_size=dp_size, member=member,
            )  # fmt: skip
        meta = await self.plane.lease(
            partition, task, fields, batch_size, sampler, timeout=timeout, lease_s=lease_s,
            current_version=current_version, dp_rank=dp_rank, dp_size=dp_size, member=member,
        )  # fmt: skip
        checked = None
        if meta.rows and meta.lease_id is not None:
            with contextlib.suppress(AsyncFlowError):
                checked = self.controller.check_readable(partition, meta.rows, fields)
        return meta, checked

    async def peek(
        self,
        partition: str,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        members: int,
        lease_s: float,
        current_version: Version | None,
        dp_rank: int,
        dp_size: int,
        member: int,
        ack: BatchMeta | None = None,
    ) -> tuple[BatchMeta | None, tuple[Candidates, SampleRequest] | None, int]:
        """Step 1 of a lease whose sampler runs in the caller: a meta that needs no sampler
        (end of stream, a peer's batch to replay), else the candidates and request to choose
        from; and the generation they were seen at (for ``wait_change``). ``ack``: committed
        first, as in ``get_meta``."""
        capture = _Capture(members)
        if ack is not None:
            self.plane.ack_before_lease(
                ack, partition, task, fields, batch_size, capture, lease_s=lease_s,
                dp_rank=dp_rank, dp_size=dp_size, member=member,
            )  # fmt: skip
        generation = self.controller.generation
        meta = self.controller.try_get_meta(
            partition, task, fields, batch_size, capture, lease_s=lease_s,
            current_version=current_version, dp_rank=dp_rank, dp_size=dp_size, member=member,
        )  # fmt: skip
        self.plane.free_reclaimed()
        return meta, capture.seen, generation

    async def lease_selected(
        self,
        partition: str,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        selection: Selection,
        members: int,
        lease_s: float,
        current_version: Version | None,
        dp_rank: int,
        dp_size: int,
        member: int,
    ) -> BatchMeta | None:
        """Step 2: lease (and drop) what the caller's sampler chose, if those rows are still
        candidates; ``SamplerError`` if another consumer took one meanwhile (choose again)."""
        meta = self.controller.try_get_meta(
            partition, task, fields, batch_size, _Given(selection, members), lease_s=lease_s,
            current_version=current_version, dp_rank=dp_rank, dp_size=dp_size, member=member,
        )  # fmt: skip
        self.plane.free_reclaimed()
        return meta

    async def wait_change(self, partition: str, generation: int, timeout: float | None) -> None:
        """Return once the metadata changed after ``generation``, a lease of ``partition``
        is due, or ``timeout`` seconds passed."""
        until = None if timeout is None else loop_clock() + timeout
        await self.plane.wait_for_change(generation, self.plane.lease_wake(partition, until))

    async def explain_wait(
        self,
        partition: str,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        timeout: float | None,
    ) -> str:
        return self.plane.explain_wait(partition, task, fields, batch_size, timeout)

    async def check_readable(
        self, partition: str, rows: Sequence[int], fields: Sequence[str]
    ) -> tuple[str, dict[str, FieldSchema]]:
        return self.controller.check_readable(partition, rows, fields)

    async def ack(self, meta: BatchMeta) -> None:
        self.controller.ack(meta)
        self.plane.free_reclaimed()

    async def nack(self, meta: BatchMeta) -> None:
        self.controller.nack(meta)

    async def ping(self) -> bool:
        return True


class _Capture:
    """Records what a sampler would be shown, and chooses nothing."""

    def __init__(self, members: int) -> None:
        self.members_per_rank = members
        self.seen: tuple[Candidates, SampleRequest] | None = None

    def select(self, candidates: Candidates, request: SampleRequest) -> Selection:
        self.seen = (candidates, request)
        return Selection()


class _Given:
    """Answers with a selection made elsewhere (by the caller's sampler)."""

    def __init__(self, selection: Selection, members: int) -> None:
        self.selection = selection
        self.members_per_rank = members

    def select(self, candidates: Candidates, request: SampleRequest) -> Selection:
        return self.selection


# --------------------------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class UnitPlacement:
    """Where a storage unit runs."""

    unit: int
    node_id: str
    pid: int


class RayDataStore:
    """The ``DataStore`` contract over a controller actor and storage-unit actors (see the
    module docstring). Build one with ``create``; pass it to any actor or task of the cluster
    (it pickles as its actor handles) or attach by name with ``connect``. Every call is a
    coroutine of the caller's event loop; values never pass through the controller.

    Unlike the in-process store, a put always copies its tensors (they cross processes), so
    the caller may reuse its buffers at once. See the module docstring for what is copied
    where, and the ownership rule.
    """

    def __init__(
        self,
        controller: Any,
        units: Sequence[Any],
        name: str | None = None,
        rows_per_block: int = ROWS_PER_BLOCK,
    ) -> None:
        if not units:
            raise BadRequestError("a RayDataStore needs at least one storage unit")
        self.controller = controller
        self.units = list(units)
        self.name = name
        self.rows_per_block = rows_per_block
        self._keys: dict[str, str] = {}
        self._checked: dict[str, _Checked] = {}  # lease id -> its check (see get_data)

    def __reduce__(self) -> tuple[object, ...]:
        return (RayDataStore, (self.controller, self.units, self.name, self.rows_per_block))

    def __repr__(self) -> str:
        label = f"{self.name!r}, " if self.name else ""
        return f"RayDataStore({label}{len(self.units)} storage units)"

    # -- lifecycle -------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        num_storage_units: int = 2,
        *,
        nodes: Sequence[str] | None = None,
        name: str | None = None,
        unit_cpus: float = 0.0,
        detached: bool = False,
        start_timeout_s: float = 120.0,
        rows_per_block: int = ROWS_PER_BLOCK,
    ) -> RayDataStore:
        """Start a store's actors on the connected cluster (``RayRuntime.start()`` first) and
        wait until they answer.

        ``nodes``: node ids to place storage units on, unit ``u`` on ``nodes[u % len]``
        (default: every alive node, in the order Ray lists them: units spread across the
        cluster). ``name``: register the controller under this name in the runtime's
        namespace, for ``connect``. ``unit_cpus``: CPUs each unit reserves (default 0: units
        move bytes, they do not compute). ``detached``: the actors outlive this driver (then
        ``shutdown`` them explicitly). ``rows_per_block``: row ``r`` lives on unit
        ``(r // rows_per_block) % N`` (see ``ROWS_PER_BLOCK``).
        """
        ray = import_ray()
        if not ray.is_initialized():
            raise ConfigError(
                "RayDataStore.create needs a connected Ray cluster: start one with "
                "asyncflow_ray.RayRuntime().start() (or ray.init) first"
            )
        if (
            isinstance(num_storage_units, bool)
            or not isinstance(num_storage_units, int)
            or num_storage_units < 1
        ):
            raise BadRequestError(
                f"num_storage_units must be an int >= 1, got {num_storage_units!r}"
            )
        if isinstance(rows_per_block, bool) or not isinstance(rows_per_block, int):
            raise BadRequestError(f"rows_per_block must be an int >= 1, got {rows_per_block!r}")
        if rows_per_block < 1:
            raise BadRequestError(f"rows_per_block must be an int >= 1, got {rows_per_block!r}")
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        alive = [n.node_id for n in alive_nodes()]
        targets = list(nodes) if nodes is not None else alive
        unknown = [n for n in targets if n not in alive]
        if not targets or unknown:
            raise ConfigError(
                f"cannot place storage units on nodes {unknown or targets}: the cluster's alive "
                f"nodes are {alive}"
            )
        lifetime = "detached" if detached else None
        unit_cls = ray.remote(StorageUnitServer)
        units = [
            unit_cls.options(
                num_cpus=unit_cpus,
                max_concurrency=UNIT_CONCURRENCY,
                scheduling_strategy=NodeAffinitySchedulingStrategy(
                    targets[u % len(targets)], soft=False
                ),
                name=f"{name}.unit{u}" if name else None,
                lifetime=lifetime,
            ).remote(u)
            for u in range(num_storage_units)
        ]
        controller = (
            ray.remote(ControllerServer)
            .options(num_cpus=0, max_concurrency=10_000, name=name, lifetime=lifetime)
            .remote(units, rows_per_block)
        )
        store = cls(controller, units, name, rows_per_block)
        try:
            ray.get(
                [controller.ping.remote(), *(u.info.remote() for u in units)],
                timeout=start_timeout_s,
            )
        except Exception as e:
            store.shutdown()
            raise StoreLostError(
                f"the store's actors did not start within {start_timeout_s} s ({type(e).__name__}: "
                f"{e}); check the cluster's resources (ray status) and the actors' logs"
            ) from e
        return store

    @classmethod
    def connect(cls, name: str, *, namespace: str | None = None) -> RayDataStore:
        """The store whose controller was created with ``name`` (in ``namespace``, default:
        the current one)."""
        ray = import_ray()
        try:
            controller = ray.get_actor(name, namespace=namespace)
        except ValueError as e:
            raise ConfigError(
                f"no RayDataStore named {name!r} in namespace {namespace or 'current'!r} ({e}); "
                "create it with RayDataStore.create(name=...)"
            ) from e
        units, block = ray.get(
            [controller.get_units.remote(), controller.get_rows_per_block.remote()]
        )
        return cls(controller, units, name, block)

    def shutdown(self) -> None:
        """Kill the store's actors (its data is gone). Idempotent."""
        ray = import_ray()
        for handle in (self.controller, *self.units):
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)

    async def reset(self) -> None:
        """Delete every partition with its data, as if the store were new; the actors stay
        (a fresh store without starting processes: tests, benchmarks, a new experiment)."""
        await self._ctl(self.controller.reset.remote())
        await asyncio.gather(*(self._unit_call(u, (), "reset") for u in range(len(self.units))))
        self._keys.clear()

    async def placement(self) -> list[UnitPlacement]:
        """Where each storage unit runs (node id, process id)."""
        infos = await asyncio.gather(
            *(self._unit_call(u, (), "info") for u in range(len(self.units)))
        )
        return [UnitPlacement(i["unit"], i["node_id"], i["pid"]) for i in infos]

    # -- calls -------------------------------------------------------------------------------
    async def _ctl(self, ref: Any) -> Any:
        """Await a controller call; its ``AsyncFlowError`` is raised as itself."""
        ray = import_ray()
        try:
            return await ref
        except ray.exceptions.RayTaskError as e:
            raise _cause(e) from None
        except ray.exceptions.RayActorError as e:
            raise StoreLostError(
                f"the store's controller actor is gone ({type(e).__name__}: {first_line(e)}); "
                "its metadata is lost with it: create a new store and rerun the producers"
            ) from None

    async def _unit_call(self, u: int, rows: Sequence[int], method: str, *args: Any) -> Any:
        """Await ``unit u.method(*args)`` touching ``rows``; a dead unit raises
        ``StorageUnitLostError`` naming it and those rows."""
        ray = import_ray()
        try:
            return await getattr(self.units[u], method).remote(*args)
        except ray.exceptions.RayTaskError as e:
            raise _cause(e) from None
        except ray.exceptions.RayActorError as e:
            raise StorageUnitLostError(
                f"storage unit {u} of {len(self.units)} is gone ({type(e).__name__}: "
                f"{first_line(e)}); rows {fmt_rows(rows)} held there are lost (row r lives "
                f"on unit (r // {self.rows_per_block}) % {len(self.units)}); the other units' "
                "rows are intact",
                u,
                tuple(rows),
            ) from None

    async def _cancellable(
        self,
        ref: Any,
        undo: Callable[[Any], Awaitable[None]],
        unfinished: Callable[[], Awaitable[None]] | None = None,
    ) -> Any:
        """Await a controller call that may wait long (a lease, a capacity wait). If the
        caller is cancelled the call is cancelled in the actor too, and if it had already
        succeeded its result is undone (``undo``), so no lease or ticket is orphaned; if it
        did not succeed, ``unfinished`` (if given) is awaited, e.g. to commit an ack the call
        carried that the cancellation may have kept from running."""
        try:
            return await self._ctl(ref)
        except asyncio.CancelledError:
            ray = import_ray()
            with contextlib.suppress(Exception):
                ray.cancel(ref)

            async def settle() -> None:
                try:
                    got = await ref
                except Exception as e:  # refused (nothing to undo) or cancelled before it ran
                    if unfinished is not None and isinstance(e, ray.exceptions.TaskCancelledError):
                        with contextlib.suppress(Exception):
                            await unfinished()
                    return
                with contextlib.suppress(Exception):
                    await undo(got)

            background(settle())
            raise

    # -- partitions ----------------------------------------------------------------------------
    async def create_partition(
        self,
        name: str,
        fields: Sequence[str],
        *,
        capacity: Capacity | None = None,
        tasks: Sequence[str] = (),
    ) -> None:
        await self._ctl(
            self.controller.create_partition.remote(name, list(fields), capacity, list(tasks))
        )

    async def register_task(self, partition: str, task: str) -> None:
        await self._ctl(self.controller.register_task.remote(partition, task))

    async def close(self, partition: str) -> None:
        await self._ctl(self.controller.close.remote(partition))

    async def delete_partition(self, partition: str) -> None:
        self._keys.pop(partition, None)
        await self._ctl(self.controller.delete_partition.remote(partition))

    async def stats(self, partition: str) -> PartitionStats:
        result: PartitionStats = await self._ctl(self.controller.stats.remote(partition))
        return result

    async def storage_key(self, partition: str) -> str:
        key: str = await self._ctl(self.controller.storage_key.remote(partition))
        return key

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
        prep, row_ids, tag_list = prepare_put(partition, data, rows, tags, timeout, copy=False)
        ticket: PutTicket = await self._cancellable(
            self.controller.reserve_put.remote(
                partition, prep.schemas, prep.row_bytes, prep.n, row_ids, tag_list, overwrite,
                timeout,
            ),
            self._abort,
        )  # fmt: skip
        # from here the put runs to its end (or rolls back) even if the caller is cancelled
        await asyncio.shield(self._write_and_commit(ticket, data, prep.cells))
        return ticket.rows

    async def _abort(self, ticket: PutTicket) -> None:
        await self._ctl(self.controller.abort_put.remote(ticket))

    async def _write_and_commit(
        self, ticket: PutTicket, data: Mapping[str, Any], cells: Mapping[str, list[CellValue]]
    ) -> None:
        """Write every unit's share (put into the object store first when large), all units
        at once, then commit the ticket; on a failure undo every write and abort."""
        key = ticket.storage_key
        tid = None if ticket.new_rows else ticket.ticket_id  # new rows replace nothing
        try:
            plan = _plan(ticket.rows, len(self.units), self.rows_per_block)
            shares = [_by_ref(_share(data, cells, runs)) for _, _, runs in plan]
        except BaseException:
            await self._abort(ticket)
            raise
        used = [u for u, _, _ in plan]
        results = await asyncio.gather(
            *(
                self._unit_call(u, rows, "write", key, rows, share, tid)
                for (u, rows, _), share in zip(plan, shares, strict=True)
            ),
            return_exceptions=True,
        )
        failed = [
            (u, r) for u, r in zip(used, results, strict=True) if isinstance(r, BaseException)
        ]
        rows_of = {u: rows for u, rows, _ in plan}
        if failed:
            await self._roll_back(ticket, {u: rows_of[u] for u in used if u not in dict(failed)})
            u, err = failed[0]
            if isinstance(err, AsyncFlowError):
                raise err
            raise StorageUnitError(
                f"put into {ticket.partition!r} failed in storage unit {u} "
                f"({type(err).__name__}: {err}); nothing was written"
            ) from err
        try:
            await self._ctl(self.controller.commit_put.remote(ticket))
        except BaseException:  # e.g. the partition was deleted meanwhile: leave no cells
            await self._roll_back(ticket, rows_of, abort=False)
            raise
        if tid is not None:  # what the overwrite replaced can go now
            for u in used:
                self.units[u].release.remote(key, tid)

    async def _roll_back(
        self, ticket: PutTicket, rows_of: Mapping[int, list[int]], abort: bool = True
    ) -> None:
        """Undo the writes of ``ticket`` in the units ``rows_of`` (unit -> its rows)."""
        key, tid = ticket.storage_key, ticket.ticket_id
        fields = list(ticket.fields)
        await asyncio.gather(
            *(
                self.units[u].forget.remote(key, rows, fields)
                if ticket.new_rows
                else self.units[u].undo.remote(key, tid)
                for u, rows in rows_of.items()
            ),
            return_exceptions=True,
        )
        if abort:
            await self._abort(ticket)

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
        sampler = sampler if sampler is not None else SequentialSampler()
        check_get_args(batch_size, lease_s, dp_rank, dp_size, member, sampler)
        members = members_of(sampler)
        names = list(fields)
        common = (lease_s, current_version, dp_rank, dp_size, member)
        wire_ack = None
        if ack is not None:  # committed by the controller in this call's first request
            check_lease_meta(ack, "ack")
            self._forget(ack)
            wire_ack = _for_ack(ack)
        if getattr(sampler, "stateless", False) is True:  # run it in the controller: 1 call
            asked = loop_clock()
            whole, checked = await self._cancellable(
                self.controller.get_meta.remote(
                    partition, task, names, batch_size, sampler, timeout, *common, wire_ack
                ),
                self._give_back_checked,
                None if wire_ack is None else functools.partial(self._late_ack, wire_ack),
            )
            if checked is not None and whole.lease_id is not None:
                self._remember(whole, asked + LEASE_TRUST * lease_s, *checked)
            return cast(BatchMeta, whole)
        until = None if timeout is None else loop_clock() + timeout
        while True:
            found, seen, generation = await self._ctl(
                self.controller.peek.remote(
                    partition, task, names, batch_size, members, *common, wire_ack
                )
            )
            wire_ack = None  # committed (or refused: then peek raised)
            if found is not None:
                return cast(BatchMeta, found)
            if seen is not None:
                candidates, request = seen
                sel = sampler.select(candidates, request)
                validate_selection(sel, candidates, batch_size, sampler)
                try:
                    leased = await self._cancellable(
                        self.controller.lease_selected.remote(
                            partition, task, names, batch_size, sel, members, *common
                        ),
                        self._give_back,
                    )
                except SamplerError:
                    continue  # another consumer took a chosen row meanwhile: choose again
                if leased is not None:
                    return cast(BatchMeta, leased)
            left = None if until is None else until - loop_clock()
            if left is not None and left <= 0:
                raise StoreTimeoutError(
                    await self._ctl(
                        self.controller.explain_wait.remote(
                            partition, task, names, batch_size, timeout
                        )
                    )
                )
            await self._ctl(self.controller.wait_change.remote(partition, generation, left))

    def _remember(
        self, meta: BatchMeta, until: float, key: str, schemas: dict[str, FieldSchema]
    ) -> None:
        """Keep a fresh lease's readability check for its ``get_data``, valid until
        ``until`` (the client's clock), its ``ack`` or ``nack``."""
        if len(self._checked) >= 1024:  # leases never acked: forget the expired ones
            now = loop_clock()
            for lease in [k for k, v in self._checked.items() if v.until <= now]:
                del self._checked[lease]
        assert meta.lease_id is not None
        self._checked[meta.lease_id] = _Checked(until, meta.partition, meta.rows, key, schemas)

    def _still_checked(self, meta: BatchMeta, names: Sequence[str]) -> _Checked | None:
        """The check made with ``meta``'s lease if it still holds: the same rows, the
        fields it covered, and the lease neither ended (ack, nack) nor possibly expired."""
        if meta.lease_id is None:
            return None
        c = self._checked.get(meta.lease_id)
        if (
            c is None
            or loop_clock() >= c.until
            or c.partition != meta.partition
            or tuple(c.rows) != tuple(meta.rows)
            or any(f not in c.schemas for f in names)
        ):
            return None
        return c

    async def _give_back_checked(
        self, got: tuple[BatchMeta, tuple[str, dict[str, FieldSchema]] | None]
    ) -> None:
        await self._give_back(got[0])

    async def _give_back(self, meta: BatchMeta) -> None:
        if meta.rows and meta.lease_id is not None:
            await self._ctl(self.controller.nack.remote(_for_ack(meta)))

    async def _late_ack(self, wire_ack: BatchMeta) -> None:
        """The ack a cancelled ``get_meta`` carried, in case the cancellation stopped the
        request before the controller ran it (if it ran, this ack is refused: already
        committed)."""
        await self._ctl(self.controller.ack.remote(wire_ack))

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
        check_out(out)
        if not meta.rows:
            return Batch((), {}, {}, ())
        fresh = self._still_checked(meta, names)
        if fresh is not None:  # the lease's own check holds: read at once
            try:
                values = await self._read(fresh.key, meta.rows, names)
            except StorageUnitLostError:
                raise
            except AsyncFlowError:  # e.g. its partition was deleted: the check says why
                pass
            else:
                schemas = {f: fresh.schemas[f] for f in names}
                return assemble_batch(meta, names, schemas, values, layout, pad_value, out=out)
        check = self._ctl(self.controller.check_readable.remote(meta.partition, meta.rows, names))
        cached = self._keys.get(meta.partition)
        if cached is None:  # first read of this partition: learn its storage key first
            key, schemas = await check
            values = await self._read(key, meta.rows, names)
        else:  # the check and the reads in parallel; a stale key or early read is retried
            outcome: tuple[Any, Any] = await asyncio.gather(
                check, self._read(cached, meta.rows, names), return_exceptions=True
            )
            checked, read = outcome
            if isinstance(checked, BaseException):
                raise checked
            key, schemas = checked
            if key != cached or isinstance(read, BaseException):
                if isinstance(read, StorageUnitLostError):
                    raise read
                values = await self._read(key, meta.rows, names)
            else:
                values = read
        self._keys[meta.partition] = key
        return assemble_batch(meta, names, schemas, values, layout, pad_value, out=out)

    async def _read(
        self, key: str, rows: Sequence[int], fields: Sequence[str]
    ) -> dict[str, list[CellValue]]:
        n = len(self.units)
        by_unit = rows_by_unit(rows, n, self.rows_per_block)
        ray = import_ray()
        try:
            got = await asyncio.gather(
                *(
                    self._unit_call(u, rs, "read_refs", key, rs, list(fields)) if rs else _empty()
                    for u, rs in enumerate(by_unit)
                )
            )
            refs = [ref for g in got for ref in g[0]]
            try:
                shares = await self._map(refs)
            except ray.exceptions.ObjectLostError:  # e.g. its producer's node is gone: the
                # unit still holds the bytes, so read them by value
                got = await asyncio.gather(
                    *(
                        self._unit_call(u, rs, "read", key, rs, list(fields)) if rs else _empty()
                        for u, rs in enumerate(by_unit)
                    )
                )
                columns = [{f: unpack_read(c) for f, c in g.items()} for g in got]
                return merge_by_unit(rows, columns, fields, self.rows_per_block)
        except StorageUnitLostError:
            raise
        except StorageUnitError as e:
            raise UnknownRowError(str(e)) from None
        columns = []
        base = 0
        for unit_refs, cols in got:
            mine = shares[base : base + len(unit_refs)]
            base += len(unit_refs)
            columns.append({f: _resolve(f, c, mine) for f, c in cols.items()})
        return merge_by_unit(rows, columns, fields, self.rows_per_block)

    async def _map(self, refs: Sequence[Any]) -> list[Share]:
        """The shares behind ``refs``: mapped from this node's object store (pulled first
        if they are on another node)."""
        return list(await asyncio.gather(*refs))

    # -- consumption ---------------------------------------------------------------------------
    async def ack(self, meta: BatchMeta) -> None:
        self._forget(meta)
        await self._ctl(self.controller.ack.remote(_for_ack(meta)))

    async def nack(self, meta: BatchMeta) -> None:
        self._forget(meta)
        await self._ctl(self.controller.nack.remote(_for_ack(meta)))

    def _forget(self, meta: object) -> None:
        lease = getattr(meta, "lease_id", None)
        if isinstance(lease, str):
            self._checked.pop(lease, None)


@dataclass(frozen=True, slots=True)
class _Checked:
    """A lease's readability check, made by the controller when it granted the lease."""

    until: float
    partition: str
    rows: tuple[int, ...]
    key: str
    schemas: dict[str, FieldSchema]


def _for_ack(meta: BatchMeta) -> BatchMeta:
    """``meta`` as an ack or nack sends it: without its tags and micro-batches, which the
    controller does not read (64 ``Tags`` were most of an ack's pickled bytes). Anything
    that is not a ``BatchMeta`` goes as is, for the controller to reject."""
    if type(meta) is not BatchMeta or (not meta.tags and meta.micro_batches is None):
        return meta
    return dataclasses.replace(meta, tags=(), micro_batches=None)


async def _empty() -> tuple[list[Any], dict[str, Any]]:
    return [], {}


def _resolve(field: str, column: RefColumn, shares: Sequence[Share]) -> list[CellValue]:
    """The per-row values of a ``read_refs`` column, its ``RefSegment``s sliced out of the
    mapped ``shares`` (views, no copy); a tensor field as ``Rows``, one piece per segment."""
    if not column or not isinstance(column[0], PackedColumn | tuple):
        return list(cast(list[PlainValue], column))
    rows: list[torch.Tensor] = []
    pieces: list[torch.Tensor] = []
    for seg in column:
        if not isinstance(seg, PackedColumn):
            i, p, a, b, lo, hi = seg
            held = cast(PackedColumn, shares[i][field][p])
            seg = PackedColumn(held.dtype, held.shapes[a:b], held.data[lo:hi])
        flat, got = unpack_flat(seg, copy=False)
        pieces.append(flat)
        rows.extend(got)
    return cast(list[CellValue], Rows(rows, pieces))


def _plan(ids: Sequence[int], n_units: int, block: int) -> list[tuple[int, list[int], list[range]]]:
    """Each unit's part of a put of rows ``ids``: ``(unit, its row ids, the runs of
    positions in the put they come from)``, a run being consecutive positions of one unit."""
    parts: dict[int, tuple[list[int], list[range]]] = {}
    start = 0
    for i in range(1, len(ids) + 1):
        u = unit_of(ids[start], n_units, block)
        if i < len(ids) and unit_of(ids[i], n_units, block) == u and ids[i] == ids[i - 1] + 1:
            continue
        rows, runs = parts.setdefault(u, ([], []))
        rows.extend(ids[start:i])
        runs.append(range(start, i))
        start = i
    return [(u, rows, runs) for u, (rows, runs) in parts.items()]


def _by_ref(share: Share) -> Share | list[Any]:
    """A large share as ``[ObjectRef]`` (put into the object store now), a small one as is."""
    if _share_bytes(share) < BY_REF_MIN_BYTES:
        return share
    return [import_ray().put(share)]


def _share(
    data: Mapping[str, Any], cells: Mapping[str, list[CellValue]], runs: Sequence[range]
) -> Share:
    """The values at the positions ``runs`` of every field, for the wire: a batch tensor as
    one slice (a view) per run, a list of tensors packed per run, plain values as a list."""
    out: Share = {}
    for f, values in cells.items():
        source = data[f]
        if isinstance(source, torch.Tensor):
            out[f] = [rows_view(source, run) for run in runs]
        elif values and isinstance(values[0], torch.Tensor):
            out[f] = [cast(PackedColumn, pack(values[run.start : run.stop])) for run in runs]
        else:
            out[f] = cast(list[PlainValue], [values[i] for run in runs for i in run])
    return out


def _cause(err: Exception) -> BaseException:
    """The exception an actor method raised, as itself when it is one of ours."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, AsyncFlowError):
        return cause
    return err
