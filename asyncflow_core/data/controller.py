"""The store's control plane: readiness, consumption, leases, tags and capacity per partition.

The controller never touches values (storage units do) and never waits: every method is a
synchronous, thread-safe, all-or-nothing state change under one lock, taking and returning plain
picklable values, so the same object can live in another process or a Ray actor. Waiting (for
data, for capacity) is the caller's job, driven by ``generation`` and ``add_listener``.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncflow_core.contracts.errors import (
    BadRequestError,
    CapacityError,
    CellAlreadyWrittenError,
    LeaseError,
    LeaseExpiredError,
    PartitionClosedError,
    PartitionExistsError,
    SamplerError,
    SchemaError,
    UnknownFieldError,
    UnknownPartitionError,
    UnknownRowError,
    UnknownTaskError,
)
from asyncflow_core.contracts.protocols import (
    NO_VERSION,
    BatchMeta,
    Candidates,
    Capacity,
    FieldSchema,
    IntArray,
    PartitionStats,
    SampleRequest,
    Scheduler,
    Selection,
    Tags,
)
from asyncflow_core.data.scheduling import FillView, cannot_fill_of, is_repeatable, reads_first

_NO_TAGS = Tags()
_ENDED_LEASES_KEPT = 100_000  # how many ended lease ids we remember to explain a late ack
_FEW = 32  # below this many rows a Python loop beats numpy's per-call set-up
# A task keeps its incremental candidate state (_TaskState.cand/gcount) only while its
# partition holds at least this many slots: below it a scan per lease costs less than the
# updates every change would pay (the small main job lost ~9% to them), above it the scans
# grow with the rows (~160 K at 1024 simulated devices) and the updates win. A task stops
# tracking when the partition shrinks below a quarter of it (no flapping at the border).
TRACK_MIN_SLOTS = 4096
_NO_FLOOR = np.iinfo(np.int64).max


def _add_codes(gcount: np.ndarray[Any, np.dtype[np.int64]], codes: IntArray, sign: int) -> None:
    """``gcount[code] += sign`` for each of ``codes`` (repeats counted)."""
    if codes.size <= _FEW:  # np.add.at's set-up costs more than a few adds
        for code in codes.tolist():
            gcount[code] += sign
    elif codes.size:
        np.add.at(gcount, codes, sign)


def _tracks(ts: _TaskState, cols: IntArray) -> bool:
    """``ts``'s incremental state is kept for requests of exactly ``cols``."""
    return ts.cols is not None and len(ts.cols) == len(cols) and ts.cols == tuple(cols.tolist())


def fmt_rows(rows: Iterable[int], limit: int = 8) -> str:
    """``rows`` for a message: the first ``limit`` of them and how many there are."""
    rows = list(rows)
    shown = ", ".join(str(r) for r in rows[:limit])
    return f"[{shown}{', ...' if len(rows) > limit else ''}] ({len(rows)} rows)"


@dataclass(frozen=True, slots=True)
class PutTicket:
    """A reservation made by ``begin_put``: finish it with ``commit_put`` or ``abort_put``."""

    partition: str
    ticket_id: int
    rows: tuple[int, ...]
    fields: tuple[str, ...]
    new_rows: bool
    storage_key: str  # where the storage units keep this partition's values (see _Partition)


@dataclass(slots=True)
class _PendingPut:
    ticket: PutTicket
    rows: IntArray  # row ids, not slots: the window may shift while the put is pending
    cols: IntArray
    old_bytes: np.ndarray[Any, np.dtype[np.int64]]
    new_bytes: np.ndarray[Any, np.dtype[np.int64]]
    schemas_set: list[str]
    tags: Sequence[Tags] | None


@dataclass(slots=True)
class _Lease:
    lease_id: str
    task: str
    rows: tuple[int, ...]
    fields: tuple[str, ...]
    deadline: float
    micro_batches: tuple[tuple[int, ...], ...] | None
    dp_rank: int
    members: int = 1
    served: set[int] = field(default_factory=set)
    acked: set[int] = field(default_factory=set)


@dataclass(slots=True)
class _TaskState:
    """A task's consumption of one partition. ``cand``/``gcount`` are kept up to date by
    every change, so a lease costs O(candidates) instead of a scan of every row:
    ``cand[slot]`` is whether the row is a candidate for a request of the fields ``cols``
    (alive, neither consumed nor leased by this task, every field of ``cols`` ready);
    ``gcount[code]`` counts the live rows of group ``code`` this task has not consumed.
    Both start when first needed in a partition of at least ``TRACK_MIN_SLOTS`` slots
    (``cols``/``gcount`` None until then, and again once it shrank): a smaller partition
    is scanned per lease instead."""

    consumed: np.ndarray[Any, np.dtype[np.bool_]]
    leased: np.ndarray[Any, np.dtype[np.bool_]]
    n_consumed: int = 0
    n_dropped: int = 0
    n_held: int = 0
    cols: tuple[int, ...] | None = None
    col_index: IntArray | None = None
    cand: np.ndarray[Any, np.dtype[np.bool_]] | None = None
    gcount: np.ndarray[Any, np.dtype[np.int64]] | None = None
    # the last lease request that got nothing (no rows, nothing dropped) and whether nothing
    # it could see changed since: the same request again gets nothing without a sampler call
    idle_request: tuple[Any, ...] | None = None
    clean: bool = False


class _Partition:
    """Row-state arrays, one slot per row that is (or recently was) live. Slots ``[0, used)``
    hold rows in ascending row id (``row_id``); a row's slot is found by binary search.
    Compaction squeezes out dead slots wherever they are, so the arrays (and every scan) stay
    proportional to the live rows even when an old row lingers (e.g. held back as stale)."""

    def __init__(self, name: str, fields: Sequence[str], capacity: Capacity, key: str) -> None:
        self.name = name
        # Storage units key values by this, not by the name: a partition deleted and created
        # again under the same name never sees (or frees) the old one's cells.
        self.key = key
        self.fields = tuple(fields)
        self.fidx = {f: i for i, f in enumerate(self.fields)}
        self.capacity = capacity
        self.schema: dict[str, FieldSchema | None] = dict.fromkeys(self.fields)
        self.closed = False
        self.deleting = False
        self.end = 0  # the next new row id
        self.used = 0  # slots in use
        self.cap = 0
        nf = len(self.fields)
        self.row_id = np.zeros(0, dtype=np.int64)
        self.alive = np.zeros(0, dtype=bool)
        self.creating = np.zeros(0, dtype=bool)  # allocated by a put that has not committed
        self.ready = np.zeros((0, nf), dtype=bool)
        self.writing = np.zeros((0, nf), dtype=bool)
        self.cell_bytes = np.zeros((0, nf), dtype=np.int64)
        self.group = np.zeros(0, dtype=np.int64)
        self.tokens = np.zeros(0, dtype=np.int64)
        self.vmin = np.zeros(0, dtype=np.int64)
        self.vmax = np.zeros(0, dtype=np.int64)
        self.tags: dict[int, Tags] = {}
        self.group_codes: dict[int | str, int] = {}
        self.code_group: list[int | str | None] = []
        self.group_count = np.zeros(0, dtype=np.int64)  # live rows per group code
        self.free_codes: list[int] = []
        self.tasks: dict[str, _TaskState] = {}
        self.leases: dict[str, _Lease] = {}
        # (deadline, lease_id) of every lease, earliest first; entries of ended leases are
        # skipped lazily and compacted away, so expiry and the next deadline cost O(log n)
        self.deadlines: list[tuple[float, str]] = []
        self.replay: dict[tuple[str, int], list[str]] = {}
        self.pending: dict[int, _PendingPut] = {}
        self.rows_live = 0
        self.bytes_live = 0
        self.reclaimed = 0
        # lower bound of every versioned min_version of a live row (NO_FLOOR: none has one),
        # lowered as tags are set and raised by a rescan (``version_floor``)
        self.vfloor = _NO_FLOOR
        self.untagged = False  # some committed row may have no group

    # -- slot management ---------------------------------------------------------------------
    def _row_arrays(self) -> list[str]:
        return [
            "row_id", "alive", "creating", "ready", "writing", "cell_bytes", "group", "tokens",
            "vmin", "vmax",
        ]  # fmt: skip

    def _all_arrays(self) -> list[np.ndarray[Any, Any]]:
        arrays: list[np.ndarray[Any, Any]] = [getattr(self, n) for n in self._row_arrays()]
        for ts in self.tasks.values():
            arrays += [ts.consumed, ts.leased]
            if ts.cand is not None:
                arrays.append(ts.cand)
        return arrays

    def ensure_room(self, n_new: int) -> None:
        """Room for ``n_new`` slots at the end: compact when at least half the slots are dead,
        else grow (doubling)."""
        if self.used + n_new <= self.cap:
            return
        live = int(self.alive[: self.used].sum())
        if live <= self.used // 2:
            self._compact()
            if self.used + n_new <= self.cap:
                return
        new_cap = max(64, self.cap)
        while new_cap < self.used + n_new:
            new_cap *= 2
        self._resize(new_cap)

    def _compact(self) -> None:
        keep = np.flatnonzero(self.alive[: self.used])
        k = int(keep.size)
        for a in self._all_arrays():
            a[:k] = a[keep]
            a[k : self.used] = 0
        self.used = k

    def _resize(self, new_cap: int) -> None:
        def grow(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
            out = np.zeros((new_cap, *a.shape[1:]), dtype=a.dtype)
            out[: a.shape[0]] = a
            return out

        for n in self._row_arrays():
            setattr(self, n, grow(getattr(self, n)))
        for ts in self.tasks.values():
            ts.consumed = grow(ts.consumed)
            ts.leased = grow(ts.leased)
            if ts.cand is not None:
                ts.cand = grow(ts.cand)
        self.cap = new_cap

    def lookup(self, rows: Sequence[int] | IntArray) -> IntArray:
        """Slots of rows known to have one (leased, pending or candidate rows)."""
        return np.searchsorted(self.row_id[: self.used], np.asarray(rows, dtype=np.int64))

    def slots_of(self, rows: Sequence[int]) -> IntArray:
        """Slots of existing, live rows; ``UnknownRowError`` naming the others."""
        arr = np.asarray(rows, dtype=np.int64)
        slots = self.lookup(arr)
        found = slots < self.used
        ok = found.copy()
        hit = slots[found]
        ok[found] = (self.row_id[hit] == arr[found]) & self.alive[hit] & ~self.creating[hit]
        if not ok.all():
            bad = arr[~ok].tolist()
            raise UnknownRowError(
                f"partition {self.name!r} has no live rows {fmt_rows(bad)}: rows are numbered "
                f"from 0 in creation order ({self.end} allocated so far; a row exists once the "
                "put creating it returned) and disappear once every registered task consumed "
                "them; write to rows returned by put()"
            )
        return slots

    # -- leases --------------------------------------------------------------------------------
    def add_lease(self, lease: _Lease) -> None:
        self.leases[lease.lease_id] = lease
        heapq.heappush(self.deadlines, (lease.deadline, lease.lease_id))
        if len(self.deadlines) > 2 * len(self.leases) + 64:  # mostly ended leases: compact
            self.deadlines = [(x.deadline, x.lease_id) for x in self.leases.values()]
            heapq.heapify(self.deadlines)

    def next_deadline(self) -> float | None:
        """The earliest deadline of a live lease (None without leases)."""
        heap = self.deadlines
        while heap and heap[0][1] not in self.leases:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def due_leases(self, now: float) -> list[_Lease]:
        """Live leases whose deadline is at or before ``now``, earliest first (they stay
        registered: the caller ends them)."""
        due: list[_Lease] = []
        heap = self.deadlines
        while heap and heap[0][0] <= now:
            _, lid = heapq.heappop(heap)
            lease = self.leases.get(lid)
            if lease is not None:
                due.append(lease)
        return due

    # -- tags ----------------------------------------------------------------------------------
    def group_code(self, group: int | str | None) -> int:
        """A dense int code per live group (codes of finished groups are recycled), so
        samplers compare ints and group sizes are one array lookup."""
        if group is None:
            return -1
        code = self.group_codes.get(group)
        if code is None:
            if self.free_codes:
                code = self.free_codes.pop()
            else:
                code = len(self.code_group)
                self.code_group.append(None)
                if code >= self.group_count.shape[0]:
                    grown = np.zeros(max(64, 2 * self.group_count.shape[0]), dtype=np.int64)
                    grown[: self.group_count.shape[0]] = self.group_count
                    self.group_count = grown
            self.group_codes[group] = code
            self.code_group[code] = group
        return code

    def set_tags(self, row: int, slot: int, new: Tags) -> None:
        old = self.tags.get(row)
        merged = (old or _NO_TAGS).merged(new)
        if old is None or merged.group != old.group:
            code = self.group_code(merged.group)
            if code >= 0:
                self.group_count[code] += 1
            if old is not None:
                self._dec_group(int(self.group[slot]))
            self.group[slot] = code
        self.tags[row] = merged
        self.tokens[slot] = merged.tokens
        self.vmin[slot] = v = merged.min_version
        self.vmax[slot] = merged.max_version
        if NO_VERSION < v < self.vfloor:
            self.vfloor = v
        if merged.group is None:
            self.untagged = True

    def version_floor(self) -> int | None:
        """A lower bound of the ``min_version`` of every versioned live row (None: none)."""
        return None if self.vfloor == _NO_FLOOR else self.vfloor

    def rescan_version_floor(self) -> None:
        """Raise ``vfloor`` to the oldest versioned live row (rows since gone held it down)."""
        used = self.used
        v = self.vmin[:used][self.alive[:used] & ~self.creating[:used]]
        v = v[v > NO_VERSION]
        self.vfloor = int(v.min()) if v.size else _NO_FLOOR

    def _dec_group(self, code: int) -> None:
        if code < 0:
            return
        self.group_count[code] -= 1
        if self.group_count[code] == 0:
            group = self.code_group[code]
            assert group is not None  # a live code always names its group
            self.code_group[code] = None
            del self.group_codes[group]
            self.free_codes.append(code)

    def drop_row_tags(self, row: int, slot: int) -> None:
        self.tags.pop(row, None)
        self._dec_group(int(self.group[slot]))
        self.group[slot] = -1

    # -- incremental candidate state (see _TaskState) ----------------------------------------
    def track(self, ts: _TaskState, cols: IntArray) -> None:
        """Start (or restart, for other fields) ``ts.cand`` for requests of ``cols``: one
        scan; every later change updates it for the rows it touches (``refresh``)."""
        used = self.used
        ts.cols = tuple(int(c) for c in cols)
        ts.col_index = cols.copy()
        cand = np.zeros(self.cap, dtype=bool)
        cand[:used] = (
            self.alive[:used]
            & ~ts.consumed[:used]
            & ~ts.leased[:used]
            & self.ready[:used][:, cols].all(axis=1)
        )
        ts.cand = cand

    def untrack(self, ts: _TaskState) -> None:
        """Drop ``ts``'s incremental state: its leases scan (``candidate_slots``)."""
        ts.cols = ts.col_index = ts.cand = ts.gcount = None

    def candidate_slots(self, ts: _TaskState, cols: IntArray) -> IntArray:
        """Slots of ``ts``'s candidates for a request of ``cols``, ascending: from the
        incremental state in a large partition (started here when needed), by a scan in a
        small one (``TRACK_MIN_SLOTS``)."""
        used = self.used
        if ts.cand is not None and used < TRACK_MIN_SLOTS // 4:
            self.untrack(ts)
        if ts.cand is None and used < TRACK_MIN_SLOTS:
            mask = self.alive[:used] & ~ts.consumed[:used] & ~ts.leased[:used]
            mask &= (
                self.ready[:used, cols[0]] if cols.size == 1 else self.ready[:used][:, cols].all(1)
            )
            return np.flatnonzero(mask)
        if not _tracks(ts, cols):
            self.track(ts, cols)
        assert ts.cand is not None
        return np.flatnonzero(ts.cand[:used])

    def candidate_count(self, ts: _TaskState, cols: IntArray) -> tuple[int, IntArray | None]:
        """How many candidates ``candidate_slots`` would give, and those slots where counting
        needed them: from the incremental state without listing them, when it is there."""
        used = self.used
        if ts.cand is not None and used >= TRACK_MIN_SLOTS // 4 and _tracks(ts, cols):
            return int(np.count_nonzero(ts.cand[:used])), None
        slots = self.candidate_slots(ts, cols)
        return int(slots.size), slots

    def count_groups(self, ts: _TaskState) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Live rows per group code that ``ts`` has not consumed: ``ts.gcount`` while the
        task tracks (counted by one scan the first time), else a scan."""
        if ts.gcount is None:
            used = self.used
            g = self.group[:used]
            mine = g[self.alive[:used] & ~ts.consumed[:used] & (g >= 0)]
            counts = np.bincount(mine, minlength=self.group_count.shape[0]).astype(np.int64)
            if ts.cand is None:
                return counts
            ts.gcount = counts
        return ts.gcount

    def refresh(self, slots: IntArray) -> None:
        """Recompute ``cand`` of every tracking task at ``slots`` after a change there."""
        if not slots.size:
            return
        alive: IntArray | None = None  # gathered once for every tracking task
        ready: IntArray | None = None
        for ts in self.tasks.values():
            if ts.cand is None or ts.col_index is None:
                ts.clean = False  # not tracked: any change may matter to its next lease
                continue
            if alive is None:
                alive, ready = self.alive[slots], self.ready[slots]
            assert ready is not None
            now = alive & ~(ts.consumed[slots] | ts.leased[slots])
            cols = ts.col_index
            now &= ready[:, cols[0]] if cols.size == 1 else ready[:, cols].all(axis=1)
            if ts.clean and (now.any() or ts.cand[slots].any()):
                ts.clean = False  # a candidate came, went or changed its tags
            ts.cand[slots] = now

    def dirty_all(self) -> None:
        """Something every task's lease answer may depend on changed."""
        for ts in self.tasks.values():
            ts.clean = False

    def consume(self, ts: _TaskState, slots: IntArray) -> None:
        """Mark the rows at ``slots`` consumed by ``ts``: only its own ``gcount`` changes (the
        live grouped rows it had not consumed leave it), never another task's."""
        if ts.gcount is not None and slots.size:
            g = self.group[slots]
            _add_codes(ts.gcount, g[self.alive[slots] & (g >= 0) & ~ts.consumed[slots]], -1)
        ts.consumed[slots] = True

    def count_slots(self, slots: IntArray, sign: int) -> None:
        """Add (``sign`` 1) or take away (-1) the rows at ``slots`` from every counting task's
        ``gcount``: around a change of their group, liveness or consumption."""
        if not slots.size:
            return
        g = self.group[slots]
        live = self.alive[slots] & (g >= 0)
        if not live.any():
            return
        for ts in self.tasks.values():
            if ts.gcount is None:
                continue
            codes = g[live & ~ts.consumed[slots]]
            if not codes.size:
                continue
            top = int(codes.max()) + 1
            if top > ts.gcount.shape[0]:
                grown = np.zeros(max(top, 2 * ts.gcount.shape[0]), dtype=np.int64)
                grown[: ts.gcount.shape[0]] = ts.gcount
                ts.gcount = grown
            _add_codes(ts.gcount, codes, sign)


class Controller:
    """Metadata of every partition. See the module docstring for the threading model."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.RLock()
        self._parts: dict[str, _Partition] = {}
        self._ids = itertools.count(1)
        self._ended: OrderedDict[str, str] = OrderedDict()  # lease id -> how it ended
        self._listeners: list[Callable[[], None]] = []
        self.generation = 0  # bumped on every state change a waiter may care about
        self._to_free: dict[str, list[int]] = {}

    # -- plumbing ------------------------------------------------------------------------------
    def add_listener(self, fn: Callable[[], None]) -> None:
        """``fn()`` is called (outside the lock, from the changing thread) after each change."""
        with self._lock:
            self._listeners.append(fn)

    def _changed(self) -> None:
        with self._lock:
            self.generation += 1
            listeners = list(self._listeners)
        for fn in listeners:
            fn()

    def now(self) -> float:
        return self._clock()

    def _part(self, name: str) -> _Partition:
        p = self._parts.get(name)
        if p is None or p.deleting:
            known = sorted(n for n, q in self._parts.items() if not q.deleting)
            state = "is being deleted" if p is not None else "does not exist"
            raise UnknownPartitionError(
                f"partition {name!r} {state}; existing partitions: {known}. "
                "Create it with create_partition(name, fields)."
            )
        return p

    def _fields(self, p: _Partition, fields: Iterable[str]) -> IntArray:
        cols = []
        for f in fields:
            i = p.fidx.get(f)
            if i is None:
                raise UnknownFieldError(
                    f"field {f!r} is not in partition {p.name!r}; its fields are "
                    f"{list(p.fields)} (declared by create_partition)"
                )
            cols.append(i)
        return np.asarray(cols, dtype=np.int64)

    def _task(self, p: _Partition, task: str) -> _TaskState:
        ts = p.tasks.get(task)
        if ts is None:
            raise UnknownTaskError(
                f"task {task!r} is not registered on partition {p.name!r} (registered: "
                f"{sorted(p.tasks)}); call register_task({p.name!r}, {task!r}) first"
            )
        return ts

    # -- partitions and tasks ------------------------------------------------------------------
    def create_partition(
        self,
        name: str,
        fields: Sequence[str],
        capacity: Capacity | None = None,
        tasks: Sequence[str] = (),
    ) -> None:
        if not isinstance(name, str) or not name:
            raise BadRequestError(f"partition name must be a non-empty str, got {name!r}")
        fields = list(fields)
        if not fields or not all(isinstance(f, str) and f for f in fields):
            raise BadRequestError(f"fields must be non-empty strs, got {fields!r}")
        dup = sorted({f for f in fields if fields.count(f) > 1})
        if dup:
            raise BadRequestError(f"fields {dup} are declared twice for partition {name!r}")
        cap = capacity or Capacity()
        for knob in ("max_rows", "max_bytes"):
            v = getattr(cap, knob)
            if v is not None and (not isinstance(v, int) or v <= 0):
                raise BadRequestError(f"Capacity.{knob} must be a positive int or None, got {v!r}")
        for t in tasks:
            if not isinstance(t, str) or not t:
                raise BadRequestError(f"task names must be non-empty strs, got {t!r}")
        with self._lock:
            if name in self._parts:
                raise PartitionExistsError(
                    f"partition {name!r} already exists; pick another name or "
                    "delete_partition() it first"
                )
            p = _Partition(name, fields, cap, f"{name}#{next(self._ids)}")
            for t in tasks:
                p.tasks[t] = _TaskState(np.zeros(0, bool), np.zeros(0, bool))
            self._parts[name] = p

    def register_task(self, partition: str, task: str) -> None:
        if not isinstance(task, str) or not task:
            raise BadRequestError(f"task name must be a non-empty str, got {task!r}")
        with self._lock:
            p = self._part(partition)
            if task not in p.tasks:
                p.tasks[task] = _TaskState(np.zeros(p.cap, bool), np.zeros(p.cap, bool))

    def partitions(self) -> list[str]:
        with self._lock:
            return sorted(n for n, p in self._parts.items() if not p.deleting)

    def close(self, partition: str) -> None:
        with self._lock:
            p = self._part(partition)
            p.closed = True
            p.dirty_all()
        self._changed()

    def begin_delete(self, partition: str) -> str:
        """Step 1 of delete: the partition disappears for every caller (waiters wake and fail).
        Returns its storage key, for step 2: the storage units drop that key."""
        with self._lock:
            p = self._part(partition)
            p.deleting = True
            self._to_free.pop(p.key, None)
        self._changed()
        return p.key

    def finish_delete(self, partition: str) -> None:
        """Step 3 of delete, after storage dropped the values: forget the metadata."""
        with self._lock:
            p = self._parts.get(partition)
            if p is not None and p.deleting:
                del self._parts[partition]

    def storage_key(self, partition: str) -> str:
        """The key the storage units file this partition's values under."""
        with self._lock:
            return self._part(partition).key

    def schema(self, partition: str) -> dict[str, FieldSchema | None]:
        with self._lock:
            return dict(self._part(partition).schema)

    # -- writes --------------------------------------------------------------------------------
    def begin_put(
        self,
        partition: str,
        fields: Mapping[str, FieldSchema],
        row_bytes: Mapping[str, Sequence[int]],
        n: int,
        rows: Sequence[int] | None = None,
        tags: Sequence[Tags] | None = None,
        overwrite: bool = False,
    ) -> PutTicket | None:
        """Validate and reserve a put of ``n`` rows. Returns None when new rows do not fit the
        capacity yet (retry after a change); raises if the put can never succeed. Cells of the
        ticket are marked "being written" until commit/abort."""
        with self._lock:
            p = self._part(partition)
            cols = self._fields(p, fields)
            for fname, sch in fields.items():
                have = p.schema[fname]
                if have is not None and have != sch:
                    raise SchemaError(
                        f"field {fname!r} of partition {partition!r} holds "
                        f"{have.describe()} (fixed by its first write); this put gives "
                        f"{sch.describe()}. Convert the values (e.g. .to({have.dtype}))."
                        if have.is_tensor
                        else f"field {fname!r} of partition {partition!r} holds plain values "
                        f"(fixed by its first write); this put gives {sch.describe()}"
                    )
            nb = np.zeros((n, len(cols)), dtype=np.int64)
            for j, fname in enumerate(fields):
                nb[:, j] = row_bytes[fname]
            total_new_bytes = int(nb.sum())
            if rows is None:
                if p.closed:
                    raise PartitionClosedError(
                        f"partition {partition!r} is closed: no new rows can be put; write into "
                        "existing rows with put(..., rows=...) or use another partition"
                    )
                self._check_capacity_possible(p, n, total_new_bytes)
                if not self._fits(p, n, total_new_bytes):
                    return None
                p.ensure_room(n)
                new_rows = tuple(range(p.end, p.end + n))
                slots = np.arange(p.used, p.used + n, dtype=np.int64)
                p.row_id[slots] = np.arange(p.end, p.end + n, dtype=np.int64)
                p.end += n
                p.used += n
                p.alive[slots] = True
                p.creating[slots] = True
                p.group[slots] = -1  # no group until its tags are committed
                p.refresh(slots)
                p.rows_live += n
                old = np.zeros_like(nb)
            else:
                if len(set(rows)) != len(rows):
                    dups = sorted({r for r in rows if list(rows).count(r) > 1})
                    raise BadRequestError(f"rows {dups} appear twice in one put; write each once")
                slots = p.slots_of(rows)
                sub_ready = p.ready[_grid(slots, cols)]
                sub_writing = p.writing[_grid(slots, cols)]
                if sub_writing.any():
                    i, j = map(int, np.argwhere(sub_writing)[0])
                    raise CellAlreadyWrittenError(
                        f"cell (row {rows[i]}, field {list(fields)[j]!r}) of partition "
                        f"{partition!r} is being written by another put; retry after it ends"
                    )
                if sub_ready.any() and not overwrite:
                    i, j = map(int, np.argwhere(sub_ready)[0])
                    raise CellAlreadyWrittenError(
                        f"cell (row {rows[i]}, field {list(fields)[j]!r}) of partition "
                        f"{partition!r} is already written; pass overwrite=True to replace it"
                    )
                new_rows = tuple(int(r) for r in rows)
                old = p.cell_bytes[_grid(slots, cols)]
            # from here on nothing can fail: apply the reservation
            schemas_set = []
            for fname, sch in fields.items():
                if p.schema[fname] is None:
                    p.schema[fname] = sch
                    schemas_set.append(fname)
            if p.closed:  # a pending put holds back the final batch
                p.dirty_all()
            p.writing[_grid(slots, cols)] = True
            p.bytes_live += total_new_bytes - int(old.sum())
            p.cell_bytes[_grid(slots, cols)] = nb
            ticket = PutTicket(
                partition, next(self._ids), new_rows, tuple(fields), rows is None, p.key
            )
            p.pending[ticket.ticket_id] = _PendingPut(
                ticket, p.row_id[slots].copy(), cols, old, nb, schemas_set, tags
            )
            return ticket

    def _check_capacity_possible(self, p: _Partition, n: int, nbytes: int) -> None:
        c = p.capacity
        if c.max_rows is not None and n > c.max_rows:
            raise CapacityError(
                f"a put of {n} new rows can never fit partition {p.name!r} "
                f"(max_rows={c.max_rows}); put fewer rows at a time or raise max_rows"
            )
        if c.max_bytes is not None and nbytes > c.max_bytes:
            raise CapacityError(
                f"a put of {nbytes} bytes can never fit partition {p.name!r} "
                f"(max_bytes={c.max_bytes}); put fewer rows at a time or raise max_bytes"
            )

    def _fits(self, p: _Partition, n: int, nbytes: int) -> bool:
        c = p.capacity
        if c.max_rows is not None and p.rows_live + n > c.max_rows:
            return False
        return c.max_bytes is None or p.bytes_live + nbytes <= c.max_bytes

    def commit_put(self, ticket: PutTicket) -> None:
        with self._lock:
            p = self._part(ticket.partition)
            pend = p.pending.pop(ticket.ticket_id)
            slots = p.lookup(pend.rows)
            grid = _grid(slots, pend.cols)
            p.writing[grid] = False
            p.ready[grid] = True
            p.creating[slots] = False
            if pend.tags is not None:
                before = p.group[slots].copy()
                p.count_slots(slots, -1)
                for row, slot, t in zip(ticket.rows, slots.tolist(), pend.tags, strict=True):
                    p.set_tags(row, slot, t)
                p.count_slots(slots, 1)
                if not np.array_equal(before, p.group[slots]) and not _new_groups_only(
                    p, slots, ticket.new_rows
                ):
                    p.dirty_all()  # group sizes of other rows changed
            elif ticket.new_rows:  # untagged new rows: no group, no version, 0 tokens
                p.untagged = True
                p.group[slots] = -1
                p.tokens[slots] = 0
                p.vmin[slots] = NO_VERSION
                p.vmax[slots] = NO_VERSION
            self._reclaim(p, slots)  # rows every task consumed while this put was writing
            p.refresh(slots)
            if p.closed:
                p.dirty_all()
        self._changed()

    def abort_put(self, ticket: PutTicket) -> None:
        """Undo ``begin_put`` (e.g. a storage unit failed): the store is as before the put."""
        with self._lock:
            p = self._parts.get(ticket.partition)
            if p is None:
                return
            pend = p.pending.pop(ticket.ticket_id, None)
            if pend is None:
                return
            p.dirty_all()
            slots = p.lookup(pend.rows)
            grid = _grid(slots, pend.cols)
            p.writing[grid] = False
            p.cell_bytes[grid] = pend.old_bytes
            p.bytes_live -= int(pend.new_bytes.sum()) - int(pend.old_bytes.sum())
            if ticket.new_rows:  # nobody else could write these rows (they were "creating")
                p.alive[slots] = False
                p.creating[slots] = False
                p.rows_live -= len(ticket.rows)
                if p.end == ticket.rows[-1] + 1:  # nobody allocated after us: reuse the ids
                    p.end = ticket.rows[0]
                    first = int(slots[0])
                    for a in p._all_arrays():
                        a[first : p.used] = 0
                    p.used = first
            else:
                self._reclaim(p, slots)  # rows every task consumed while this put was writing
            p.refresh(slots[slots < p.used])
            for fname in pend.schemas_set:
                j = p.fidx[fname]
                if not (p.ready[:, j].any() or p.writing[:, j].any()):
                    p.schema[fname] = None
        self._changed()

    # -- reads ---------------------------------------------------------------------------------
    def check_readable(
        self, partition: str, rows: Sequence[int], fields: Sequence[str]
    ) -> tuple[str, dict[str, FieldSchema]]:
        """The storage key and the schemas of ``fields`` if every (row, field) cell is ready;
        raises otherwise."""
        with self._lock:
            p = self._part(partition)
            cols = self._fields(p, fields)
            slots = p.slots_of(rows)
            sub = p.ready[_grid(slots, cols)]
            if not sub.all():
                i, j = map(int, np.argwhere(~sub)[0])
                raise BadRequestError(
                    f"cell (row {rows[i]}, field {fields[j]!r}) of partition {partition!r} is not "
                    "written yet; ask get_meta for the fields you read so it waits for them"
                )
            out = {}
            for f in fields:
                s = p.schema[f]
                assert s is not None  # ready implies a schema
                out[f] = s
            return p.key, out

    # -- consumption ---------------------------------------------------------------------------
    def check_lease(
        self,
        partition: str,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        sampler: Scheduler,
        *,
        lease_s: float,
        dp_rank: int = 0,
        dp_size: int = 1,
        member: int = 0,
    ) -> None:
        """Raise what ``try_get_meta`` would refuse about this request, with its errors,
        leasing nothing: a ``get_meta`` that carries an ``ack`` checks first, so a rejected
        call commits nothing."""
        check_get_args(batch_size, lease_s, dp_rank, dp_size, member, sampler)
        with self._lock:
            p = self._part(partition)
            self._fields(p, fields)
            self._task(p, task)
        _members_serving(sampler, member)

    def try_get_meta(
        self,
        partition: str,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        sampler: Scheduler,
        *,
        lease_s: float,
        current_version: int | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
        member: int = 0,
    ) -> BatchMeta | None:
        """Lease a batch now, or return None if the sampler wants to wait. Returns an
        end-of-stream meta once the partition is closed and the task consumed every row."""
        check_get_args(batch_size, lease_s, dp_rank, dp_size, member, sampler)
        changed = False
        try:
            with self._lock:
                p = self._part(partition)
                cols = self._fields(p, fields)
                ts = self._task(p, task)
                changed = self._expire(p)
                members = _members_serving(sampler, member)
                if members > 1:
                    meta = self._replay(p, task, tuple(fields), dp_rank, member)
                    if meta is not None:
                        return meta
                if _finished(p, ts):
                    return BatchMeta(partition, task, (), tuple(fields), end_of_stream=True)
                request_key = None
                if members == 1 and is_repeatable(sampler):
                    request_key = (
                        tuple(fields),
                        batch_size,
                        sampler,
                        current_version,
                        dp_rank,
                        dp_size,
                    )
                    if (
                        ts.clean
                        and ts.idle_request is not None
                        and _same(ts.idle_request, request_key)
                    ):
                        return None  # nothing it can see changed since it got nothing
                ts.clean = False
                used = p.used
                first = batch_size if reads_first(sampler) else None  # all it reads
                final = False
                if p.closed and not p.pending:
                    free = p.alive[:used] & ~ts.consumed[:used] & ~ts.leased[:used]
                    final = not (free & ~p.ready[:used][:, cols].all(axis=1)).any()
                request = SampleRequest(
                    partition, task, batch_size, final, current_version, dp_rank, dp_size, member
                )
                promise = None if final else cannot_fill_of(sampler)
                if promise is not None and promise(_FillView(p, ts, cols, first), request):
                    # the sampler promises an empty answer for any such candidates: skip
                    # building them (O(candidates)) for a consumer waiting on a full batch
                    ts.n_held = 0
                    if request_key is not None:
                        ts.idle_request, ts.clean = request_key, True
                    return None
                slots = p.candidate_slots(ts, cols)
                if first is not None and slots.size > first:
                    slots = slots[:first]  # the rest would cost O(candidates)
                cand = self._candidates(p, slots, ts)
                sel = sampler.select(cand, request)
                rows, dropped = validate_selection(sel, cand, batch_size, sampler)
                ts.n_held = int(sel.held)
                if dropped:
                    ts.clean = False
                    dslots = p.lookup(dropped)
                    p.consume(ts, dslots)
                    ts.n_dropped += len(dropped)
                    ts.n_consumed += len(dropped)
                    self._reclaim(p, dslots)
                    p.refresh(dslots)
                    changed = True
                if not rows:
                    if dropped and _finished(p, ts):  # the drops consumed the last rows
                        return BatchMeta(partition, task, (), tuple(fields), end_of_stream=True)
                    if not dropped and request_key is not None:
                        ts.idle_request, ts.clean = request_key, True
                    return None
                lease = _Lease(
                    lease_id=f"{partition}/{task}/{next(self._ids)}",
                    task=task,
                    rows=rows,
                    fields=tuple(fields),
                    deadline=self._clock() + lease_s,
                    micro_batches=sel.micro_batches,
                    dp_rank=dp_rank,
                    members=members,
                    served={member},
                )
                lslots = p.lookup(rows)
                ts.leased[lslots] = True
                p.refresh(lslots)
                p.add_lease(lease)
                if members > 1:
                    p.replay.setdefault((task, dp_rank), []).append(lease.lease_id)
                changed = True
                return self._meta(p, lease, member)
        finally:
            if changed:
                self._changed()

    def _candidates(self, p: _Partition, slots: IntArray, ts: _TaskState) -> Candidates:
        if not slots.size:
            return Candidates.empty()
        groups = p.group[slots]
        if (groups >= 0).any():
            # per task: rows of each group this task has not consumed (other tasks' progress
            # and reclamation must not change what this task can still complete)
            counts = p.count_groups(ts)
            sizes = np.where(groups >= 0, counts[np.maximum(groups, 0)], -1)
        else:
            sizes = np.full(groups.shape[0], -1, dtype=np.int64)
        return Candidates(
            rows=p.row_id[slots],
            groups=groups,
            group_sizes=sizes,
            min_versions=p.vmin[slots],
            max_versions=p.vmax[slots],
            tokens=p.tokens[slots],
        )

    def _meta(self, p: _Partition, lease: _Lease, member: int) -> BatchMeta:
        return BatchMeta(
            partition=p.name,
            task=lease.task,
            rows=lease.rows,
            fields=lease.fields,
            tags=tuple(p.tags.get(r, _NO_TAGS) for r in lease.rows),
            lease_id=lease.lease_id,
            deadline=lease.deadline,
            micro_batches=lease.micro_batches,
            member=member,
        )

    def _replay(
        self, p: _Partition, task: str, fields: tuple[str, ...], dp_rank: int, member: int
    ) -> BatchMeta | None:
        queue = p.replay.get((task, dp_rank))
        if not queue:
            return None
        queue[:] = [
            lid
            for lid in queue
            if lid in p.leases and len(p.leases[lid].served) < p.leases[lid].members
        ]
        for lid in queue:
            lease = p.leases[lid]
            if member not in lease.served:
                if lease.fields != fields:
                    raise BadRequestError(
                        f"member {member} of DP rank {dp_rank} asked for fields {list(fields)} "
                        f"but its peers' batch was leased for {list(lease.fields)}; all members "
                        "of one DP rank must request the same fields"
                    )
                lease.served.add(member)
                return self._meta(p, lease, member)
        return None

    def ack(self, meta: BatchMeta) -> None:
        with self._lock:
            p, lease = self._lease_of(meta, "ack")
            lease.acked.add(meta.member)
            if len(lease.acked) < lease.members:
                return
            ts = p.tasks[lease.task]
            ts.clean = False
            slots = p.lookup(lease.rows)
            ts.leased[slots] = False
            p.consume(ts, slots)
            ts.n_consumed += len(slots)
            self._end_lease(p, lease, "acked")
            self._reclaim(p, slots)
            p.refresh(slots)
        self._changed()

    def nack(self, meta: BatchMeta) -> None:
        with self._lock:
            p, lease = self._lease_of(meta, "nack")
            self._release(p, lease, f"nacked by member {meta.member}")
        self._changed()

    def _lease_of(self, meta: BatchMeta, verb: str) -> tuple[_Partition, _Lease]:
        if not isinstance(meta, BatchMeta):
            raise BadRequestError(f"{verb} takes the BatchMeta from get_meta, got {meta!r}")
        p = self._part(meta.partition)
        if self._expire(p):
            self.generation += 1  # listeners run after the caller's change
        lease = p.leases.get(meta.lease_id) if meta.lease_id else None
        if lease is None or lease.task != meta.task:
            how = self._ended.get(meta.lease_id or "")
            if how == "expired":
                raise LeaseExpiredError(
                    f"cannot {verb} lease {meta.lease_id!r} (task {meta.task!r}, rows "
                    f"{fmt_rows(meta.rows)}): it expired and its rows went back for "
                    "redelivery; use a longer lease_s or ack sooner"
                )
            detail = f"it was already {how}" if how else "no such lease is held"
            raise LeaseError(
                f"cannot {verb} lease {meta.lease_id!r} (task {meta.task!r}, rows "
                f"{fmt_rows(meta.rows)}): {detail}; {verb} only a meta from get_meta, once"
            )
        if meta.member not in lease.served or meta.member in lease.acked:
            raise LeaseError(
                f"member {meta.member} cannot {verb} lease {lease.lease_id!r}: it "
                + ("already acked it" if meta.member in lease.acked else "was not served it")
            )
        return p, lease

    def _release(self, p: _Partition, lease: _Lease, how: str) -> None:
        ts = p.tasks[lease.task]
        ts.clean = False
        slots = p.lookup(lease.rows)
        ts.leased[slots] = False
        p.refresh(slots)
        self._end_lease(p, lease, how)

    def _end_lease(self, p: _Partition, lease: _Lease, how: str) -> None:
        del p.leases[lease.lease_id]
        self._ended[lease.lease_id] = how
        while len(self._ended) > _ENDED_LEASES_KEPT:
            self._ended.popitem(last=False)

    def _expire(self, p: _Partition) -> bool:
        if not p.leases:
            return False
        gone = p.due_leases(self._clock())
        for lease in gone:
            self._release(p, lease, "expired")
        return bool(gone)

    def expire_leases(self) -> int:
        """Hand back every lease past its deadline now; returns how many ended."""
        with self._lock:
            n = 0
            for p in self._parts.values():
                before = len(p.leases)
                self._expire(p)
                n += before - len(p.leases)
        if n:
            self._changed()
        return n

    def next_deadline(self, partition: str) -> float | None:
        with self._lock:
            p = self._parts.get(partition)
            return None if p is None else p.next_deadline()

    def _reclaim(self, p: _Partition, slots: IntArray) -> None:
        """Rows consumed by every registered task are dropped from the metadata; their ids are
        queued for the storage units (``take_reclaimed``). A row with a cell being written
        waits: the put's commit or abort reclaims it."""
        if not p.tasks:
            return
        done = p.alive[slots] & ~p.writing[slots].any(axis=1)
        for ts in p.tasks.values():
            done &= ts.consumed[slots]
        gone = slots[done]
        if not gone.size:
            return
        p.alive[gone] = False
        p.ready[gone] = False
        p.refresh(gone)
        p.rows_live -= int(gone.size)
        p.bytes_live -= int(p.cell_bytes[gone].sum())
        p.cell_bytes[gone] = 0
        p.reclaimed += int(gone.size)
        gone_rows = p.row_id[gone].tolist()
        for row, slot in zip(gone_rows, gone.tolist(), strict=True):
            p.drop_row_tags(row, slot)
        self._to_free.setdefault(p.key, []).extend(gone_rows)

    def check_incremental_state(self) -> None:
        """Recompute every task's incremental candidate state (``_TaskState.cand``/``gcount``)
        from the row arrays and raise ``AssertionError`` where they differ: a check for
        tests, O(rows)."""
        with self._lock:
            for p in self._parts.values():
                used = p.used
                live = p.alive[:used] & ~p.creating[:used]
                v = p.vmin[:used][live]
                v = v[v > NO_VERSION]
                assert not v.size or p.vfloor <= int(v.min()), f"{p.name}: version floor"
                g = p.group[:used][live & p.ready[:used].any(axis=1)]
                assert p.untagged or not (g < 0).any(), f"{p.name}: untagged rows unflagged"
                for name, ts in p.tasks.items():
                    if ts.cand is not None and ts.col_index is not None:
                        want = (
                            p.alive[:used]
                            & ~ts.consumed[:used]
                            & ~ts.leased[:used]
                            & p.ready[:used][:, ts.col_index].all(axis=1)
                        )
                        bad = np.flatnonzero(want != ts.cand[:used])
                        assert not bad.size, f"{p.name}/{name}: cand wrong at slots {bad[:8]}"
                    if ts.gcount is not None:
                        g = p.group[:used]
                        mine = g[p.alive[:used] & ~ts.consumed[:used] & (g >= 0)]
                        want_c = np.bincount(mine, minlength=ts.gcount.shape[0])
                        assert np.array_equal(want_c, ts.gcount), f"{p.name}/{name}: gcount"

    def take_reclaimed(self) -> dict[str, list[int]]:
        """Rows reclaimed since the last call, per storage key, for the storage units to drop."""
        with self._lock:
            out, self._to_free = self._to_free, {}
            return out

    def stats(self, partition: str) -> PartitionStats:
        with self._lock:
            p = self._part(partition)
            self._expire(p)
            used = p.used
            alive = p.alive[:used]
            return PartitionStats(
                name=p.name,
                fields=p.fields,
                tasks=tuple(sorted(p.tasks)),
                closed=p.closed,
                rows_created=p.end,
                rows_live=p.rows_live,
                bytes_live=p.bytes_live,
                ready={f: int((alive & p.ready[:used, j]).sum()) for f, j in p.fidx.items()},
                consumed={t: ts.n_consumed for t, ts in p.tasks.items()},
                dropped={t: ts.n_dropped for t, ts in p.tasks.items()},
                held={t: ts.n_held for t, ts in p.tasks.items()},
                leased={t: int(ts.leased[:used].sum()) for t, ts in p.tasks.items()},
                reclaimed=p.reclaimed,
                capacity=p.capacity,
            )


def _grid(slots: IntArray, cols: IntArray) -> tuple[IntArray, IntArray]:
    """``np.ix_(slots, cols)`` for two 1-D int arrays, without its per-call type checks (it
    ran on every put and commit)."""
    return slots.reshape(-1, 1), cols.reshape(1, -1)


def _new_groups_only(p: _Partition, slots: IntArray, new_rows: bool) -> bool:
    """Whether the rows at ``slots``, just tagged, are new rows forming groups no other live
    row belongs to (so no other row's group size changed)."""
    if not new_rows:
        return False
    codes = p.group[slots]
    codes = codes[codes >= 0]
    if not codes.size:
        return True
    uniq, counts = np.unique(codes, return_counts=True)
    return bool(np.array_equal(p.group_count[uniq], counts))


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Equal request keys; the sampler (index 2) compared by identity."""
    return a[2] is b[2] and a[:2] == b[:2] and a[3:] == b[3:]


def _finished(p: _Partition, ts: _TaskState) -> bool:
    """End of stream for a task: closed, nothing in flight, every live row consumed by it."""
    if not p.closed or p.pending:
        return False
    used = p.used
    return not (p.alive[:used] & ~ts.consumed[:used]).any()


def _members_serving(sampler: Scheduler, member: int) -> int:
    """The sampler's members per DP rank; ``BadRequestError`` if ``member`` is not one."""
    members = members_of(sampler)
    if member >= members:
        raise BadRequestError(
            f"member={member} but the sampler serves {members} member(s) per DP rank; members "
            "are numbered 0..members_per_rank-1"
        )
    return members


def members_of(sampler: Scheduler) -> int:
    """How many peers of one DP rank share a batch (``SupportsRankReplay``; else 1)."""
    # the SupportsRankReplay check by attribute: a runtime-checkable isinstance costs more
    # than the rest of a lease
    if hasattr(sampler, "members_per_rank"):
        m = sampler.members_per_rank
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise BadRequestError(f"members_per_rank must be an int >= 1, got {m!r}")
        return m
    return 1


class _FillView(FillView):
    """A task's candidates as a ``cannot_fill`` promise reads them: counted from the
    incremental state, listed only if the promise asks more; the partition's version floor
    and untagged flag answer first where they can."""

    __slots__ = ("_cols", "_p", "_slots", "_ts")

    def __init__(self, p: _Partition, ts: _TaskState, cols: IntArray, first: int | None) -> None:
        count, self._slots = p.candidate_count(ts, cols)
        super().__init__(
            count if first is None else min(count, first), self._groups_of, self._mins_of
        )
        self._p, self._ts, self._cols = p, ts, cols

    def _listed(self) -> IntArray:
        if self._slots is None:
            self._slots = self._p.candidate_slots(self._ts, self._cols)
        return self._slots[: self.count]

    def _groups_of(self) -> IntArray:
        return self._p.group[self._listed()]

    def _mins_of(self) -> IntArray:
        self._p.rescan_version_floor()  # the floor was too old to answer: raise it for next time
        return self._p.vmin[self._listed()]

    def all_tagged(self) -> bool:
        return not self._p.untagged or super().all_tagged()

    def version_floor(self) -> int | None:
        return self._p.version_floor()


def check_get_args(
    batch_size: int, lease_s: float, dp_rank: int, dp_size: int, member: int, sampler: object
) -> None:
    """The argument checks of a lease request (``try_get_meta``)."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
        raise BadRequestError(f"batch_size must be a positive int, got {batch_size!r}")
    if not lease_s > 0:
        raise BadRequestError(f"lease_s must be > 0 seconds, got {lease_s!r}")
    if not (isinstance(dp_size, int) and dp_size >= 1 and isinstance(dp_rank, int)):
        raise BadRequestError(f"dp_size must be an int >= 1, got {dp_size!r}")
    if not 0 <= dp_rank < dp_size:
        raise BadRequestError(f"dp_rank must be in [0, {dp_size}), got {dp_rank!r}")
    if not isinstance(member, int) or member < 0:
        raise BadRequestError(f"member must be an int >= 0, got {member!r}")
    if not callable(getattr(sampler, "select", None)):
        raise BadRequestError(
            f"sampler must have a select(candidates, request) method: {sampler!r}"
        )


def validate_selection(
    sel: Selection, cand: Candidates, batch_size: int, sampler: Scheduler
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``sel``'s rows and dropped rows as ints, or ``SamplerError`` naming ``sampler`` if
    they are not a duplicate-free subset of ``cand`` within ``batch_size``."""
    name = type(sampler).__name__
    if not isinstance(sel, Selection):
        raise SamplerError(f"sampler {name} returned {type(sel).__name__}, not a Selection")
    rows = tuple(int(r) for r in sel.rows)
    dropped = tuple(int(r) for r in sel.dropped)
    if len(rows) > batch_size:
        raise SamplerError(f"sampler {name} returned {len(rows)} rows for batch_size={batch_size}")
    chosen = rows + dropped
    if len(set(chosen)) != len(chosen):
        raise SamplerError(f"sampler {name} returned a row twice (in rows or dropped): {chosen}")
    if chosen:
        # cand.rows is ascending (built by the controller), so membership is a binary search
        arr = np.asarray(chosen, dtype=np.int64)
        n = cand.rows.shape[0]
        pos = np.minimum(np.searchsorted(cand.rows, arr), max(n - 1, 0))
        bad = arr if n == 0 else arr[cand.rows[pos] != arr]
        if bad.size:
            raise SamplerError(
                f"sampler {name} returned rows {fmt_rows(bad.tolist())} that were not "
                "candidates (not ready, already consumed or leased); a sampler may only "
                "choose among the candidates it was given"
            )
    if sel.micro_batches is not None:
        flat = [int(r) for mb in sel.micro_batches for r in mb]
        if sorted(flat) != sorted(rows):
            raise SamplerError(
                f"sampler {name} returned micro_batches that do not partition its rows"
            )
    return rows, dropped
