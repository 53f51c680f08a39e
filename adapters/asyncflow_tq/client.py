"""``TransferQueueClient`` over an AsyncFlow ``DataStore``.

Two planes, as in TransferQueue:

- **Control** (``_Controller``, this process): TransferQueue's bookkeeping, kept with its
  semantics: partitions created on first write, global indexes allocated from one counter
  shared by every partition (freed ones reused first), per-(sample, field) production status,
  per-task consumption status marked when ``get_meta`` hands samples out, user keys and tags.
- **Data** (``_Cells``): the values live in the store's storage units (in-process or Ray
  actors). Fields written together by one ``put`` share one store partition (its columns), so
  a batch of F fields is one store write, not F. A cell overwritten elsewhere, or cleared, is
  freed: the store reclaims a row once its one registered task (``_CLEAR_TASK``) has consumed
  it, so freeing is a lease + ack of exactly those rows; a store partition with no live row
  left is deleted.

Every public method runs its work on one event loop in a background thread (the store's loop),
so sync callers, async callers on any loop, and several threads may share a client.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from asyncflow_core.contracts.errors import (
    BadRequestError,
    CheckpointError,
    SchemaError,
    UnknownRowError,
)
from asyncflow_core.contracts.protocols import BatchMeta as StoreMeta
from asyncflow_core.contracts.protocols import Candidates, DataStore, SampleRequest, Selection
from asyncflow_tq.checkpoint import read_controller, read_storage, write_controller, write_storage
from asyncflow_tq.metadata import BatchMeta, Schema, field_schema_of
from asyncflow_tq.sampler import BaseSampler, SequentialSampler

__all__ = [
    "BadArgumentError",
    "RequestError",
    "StorageKeyNotFoundError",
    "TransferQueueClient",
]

T = TypeVar("T")
_CLEAR_TASK = "__asyncflow_tq_free__"
_MODES = ("fetch", "force_fetch", "insert")


class RequestError(RuntimeError):
    """A request the controller refused (TransferQueue reports these as ``RuntimeError``)."""


class BadArgumentError(RequestError, ValueError):
    """A bad argument, named in the message; nothing was changed. Both a ``RuntimeError`` (what
    TransferQueue raises when its controller refuses a request) and a ``ValueError``."""


class StorageKeyNotFoundError(KeyError):
    """A requested sample has no value for a requested field."""


# ----------------------------------------------------------------------------------------------
# control plane
# ----------------------------------------------------------------------------------------------
@dataclass
class _Partition:
    pid: str
    active: set[int] = field(default_factory=set)
    prealloc: set[int] = field(default_factory=set)
    fields: dict[str, int] = field(default_factory=dict)  # name -> registration order
    produced: dict[int, set[str]] = field(default_factory=dict)
    consumed: dict[str, set[int]] = field(default_factory=dict)
    custom_meta: dict[int, dict[str, Any]] = field(default_factory=dict)
    keys: dict[str, int] = field(default_factory=dict)
    rkeys: dict[int, str] = field(default_factory=dict)
    schema: dict[str, dict[str, Any]] = field(default_factory=dict)
    shapes: dict[str, dict[int, tuple[int, ...] | None]] = field(default_factory=dict)

    def all_indexes(self) -> list[int]:
        return sorted(self.active | self.prealloc)


@dataclass(frozen=True)
class PartitionView:
    """What a sampler may read about the partition it samples (``partition=`` argument)."""

    partition_id: str
    global_indexes: tuple[int, ...]
    custom_meta: Mapping[int, Mapping[str, Any]]


class _Controller:
    def __init__(self, sampler: Callable[..., tuple[list[int], list[int]]], pre_alloc: int) -> None:
        self.sampler = sampler
        self.pre_alloc = pre_alloc
        self.partitions: dict[str, _Partition] = {}
        self.counter = 0
        self.reusable: list[int] = []
        self.owned: dict[str, set[int]] = {}

    # -- indexes -------------------------------------------------------------------------------
    def _allocate(self, pid: str, count: int) -> list[int]:
        take = self.reusable[:count]
        del self.reusable[:count]
        fresh = list(range(self.counter, self.counter + count - len(take)))
        self.counter += len(fresh)
        out = take + fresh
        self.owned.setdefault(pid, set()).update(out)
        return out

    def _release(self, pid: str, indexes: Sequence[int]) -> None:
        mine = self.owned.get(pid)
        if mine is None:
            return
        mine.difference_update(indexes)
        self.reusable.extend(indexes)
        if not mine:
            del self.owned[pid]

    def create(self, pid: str) -> _Partition:
        p = self.partitions.get(pid)
        if p is None:
            p = self.partitions[pid] = _Partition(pid)
            if self.pre_alloc:
                p.prealloc.update(self._allocate(pid, self.pre_alloc))
        return p

    def activate(self, p: _Partition, count: int) -> list[int]:
        """``count`` indexes for new samples: pre-allocated ones first, then fresh ones."""
        pre = sorted(p.prealloc)[:count]
        p.prealloc.difference_update(pre)
        out = pre + self._allocate(p.pid, count - len(pre)) if count > len(pre) else pre
        p.active.update(out)
        return out

    # -- status --------------------------------------------------------------------------------
    def ready(self, p: _Partition, fields: Sequence[str], task: str) -> list[int]:
        if any(f not in p.fields for f in fields):
            return []
        done = p.consumed.get(task, set())
        need = set(fields)
        return [g for g in sorted(p.active) if g not in done and need <= p.produced.get(g, set())]

    def batch_meta(
        self, p: _Partition, indexes: Sequence[int], fields: Sequence[str], mode: str
    ) -> BatchMeta:
        schema: Schema = {}
        for f in fields:
            if f in p.schema:
                meta = dict(p.schema[f])
                shapes = [p.shapes.get(f, {}).get(g) for g in indexes]
                if meta.get("is_nested") or len({s for s in shapes if s is not None}) > 1:
                    meta["per_sample_shapes"] = shapes
                schema[f] = meta
            elif mode == "insert":
                schema[f] = {
                    "dtype": None,
                    "shape": None,
                    "is_nested": False,
                    "is_non_tensor": False,
                }
        if mode == "fetch":
            status = np.ones(len(indexes), dtype=np.int8)
        elif mode == "insert":
            status = np.zeros(len(indexes), dtype=np.int8)
        else:
            known = [f for f in fields if f in p.fields]
            need = set(known)
            status = np.array(
                [1 if known and need <= p.produced.get(g, set()) else 0 for g in indexes],
                dtype=np.int8,
            )
        return BatchMeta(
            list(indexes),
            [p.pid] * len(indexes),
            schema,
            status,
            None,
            [copy.deepcopy(p.custom_meta.get(g, {})) for g in indexes],
        )

    def produced(self, pid: str, indexes: Sequence[int], schema: Schema, shapes: Any) -> None:
        p = self.create(pid)
        for name, meta in schema.items():
            if name not in p.fields:
                p.fields[name] = len(p.fields)
            p.schema[name] = {k: v for k, v in meta.items() if k != "per_sample_shapes"}
            col = p.shapes.setdefault(name, {})
            for g, s in zip(indexes, shapes[name], strict=True):
                col[g] = s
        for g in indexes:
            p.produced.setdefault(g, set()).update(schema)
            p.active.add(g)
            p.prealloc.discard(g)

    def forget(self, p: _Partition, indexes: Sequence[int]) -> list[int]:
        """Drop these samples' status, tags and keys and free their indexes; returns those that
        existed."""
        gone = [g for g in indexes if g in p.active]
        for g in gone:
            p.active.discard(g)
            p.produced.pop(g, None)
            p.custom_meta.pop(g, None)
            for done in p.consumed.values():
                done.discard(g)
            for col in p.shapes.values():
                col.pop(g, None)
            key = p.rkeys.pop(g, None)
            if key is not None:
                p.keys.pop(key, None)
        self._release(p.pid, gone)
        return gone

    def drop_partition(self, pid: str) -> None:
        self.partitions.pop(pid, None)
        mine = self.owned.pop(pid, set())
        self.reusable.extend(sorted(mine))
        clear = getattr(self.sampler, "clear_cache", None)
        if callable(clear):
            clear(pid)

    def state(self) -> dict[str, Any]:
        """What ``checkpoint.write_controller`` saves (partitions as their fields but ``pid``)."""
        save = getattr(self.sampler, "save_checkpoint", None)
        return {
            "partitions": {
                pid: {k: v for k, v in vars(p).items() if k != "pid"}
                for pid, p in copy.deepcopy(self.partitions).items()
            },
            "counter": self.counter,
            "reusable": list(self.reusable),
            "owned": copy.deepcopy(self.owned),
            "sampler": save() if callable(save) else None,
        }

    def restore_sampler(self, state: Mapping[str, Any], path: str) -> None:
        """The sampler's part of ``state`` (read from ``path``): the one part of a restore that
        can refuse, so it goes first."""
        load = getattr(self.sampler, "load_checkpoint", None)
        saved = state["sampler"]
        if not callable(load) or saved is None:
            return
        if isinstance(self.sampler, BaseSampler) and not (
            isinstance(saved, dict) and isinstance(saved.get("_states"), dict)
        ):
            raise CheckpointError(
                f"{path} cannot be loaded: its sampler state is not a BaseSampler's "
                "({'_states': {...}}). Nothing was changed"
            )
        try:
            load(saved)
        except Exception as e:
            raise CheckpointError(
                f"{path} cannot be loaded: the sampler {type(self.sampler).__name__} refused "
                f"its saved state ({type(e).__name__}: {e})"
            ) from e

    def restore(self, state: Mapping[str, Any]) -> None:
        """The rest of ``state`` as ``checkpoint.read_controller`` returns it (checked)."""
        self.partitions = {pid: _Partition(pid, **p) for pid, p in state["partitions"].items()}
        self.counter = state["counter"]
        self.reusable = list(state["reusable"])
        self.owned = dict(state["owned"])


# ----------------------------------------------------------------------------------------------
# data plane
# ----------------------------------------------------------------------------------------------
@dataclass(eq=False)  # identity: groups are dict keys and compared with `is`
class _Group:
    name: str
    fields: tuple[str, ...]
    key: tuple[tuple[str, str, int], ...]  # (field, dtype, ndim) of every column
    live: dict[int, int] = field(default_factory=dict)  # store row -> live cells in it


class _ExactRows:
    """A store sampler that leases exactly the given rows (to free them)."""

    def __init__(self, rows: Sequence[int]) -> None:
        self.rows = set(rows)

    def select(self, candidates: Candidates, request: SampleRequest) -> Selection:
        return Selection(rows=tuple(int(r) for r in candidates.rows.tolist() if r in self.rows))


@dataclass
class WritePlan:
    """Where a put's cells go (from the controller to the writer, who stores the values)."""

    pid: str
    key: tuple[tuple[str, str, int], ...]
    group: str
    created: bool
    in_place: list[int]  # positions overwriting the rows in_rows
    in_rows: list[int]
    fresh: list[int]  # positions stored in new rows
    indexes: list[int] | None  # None: new samples
    n: int


@dataclass
class ReadPlan:
    """Where a batch's cells are: per store partition (``groups``) the rows to read, in order,
    and the fields; per field either the position in ``groups`` of the one partition whose
    rows are the batch's samples in order, or each sample's (partition position, position in
    that partition's rows)."""

    groups: list[tuple[str, tuple[int, ...], tuple[str, ...]]]
    locs: dict[str, int | list[tuple[int, int]]]
    n: int  # samples (a partition read in order holds them first, maybe more rows after)


async def store_write(
    store: DataStore, plan: WritePlan, columns: Mapping[str, Any]
) -> Sequence[int]:
    """Store the values as ``plan`` says (each store put is all or nothing); the new rows."""
    if plan.in_place:
        await store.put(
            plan.group, _take(columns, plan.in_place, plan.n), rows=plan.in_rows, overwrite=True
        )
    if plan.fresh:
        return await store.put(plan.group, _take(columns, plan.fresh, plan.n))
    return ()


async def store_fetch(store: DataStore, plan: ReadPlan) -> dict[str, list[Any]]:
    """Read the cells ``plan`` names: per field, one value per sample."""
    data: list[dict[str, Any]] = []
    for name, rows, fields in plan.groups:
        try:
            batch = await store.get_data(StoreMeta(name, _CLEAR_TASK, rows, fields), layout="list")
        except UnknownRowError as e:  # cleared since the plan was made
            raise StorageKeyNotFoundError(str(e)) from None
        data.append(batch.data)
    return {
        f: list(data[loc][f][: plan.n])
        if isinstance(loc, int)
        else [data[k][f][at] for k, at in loc]
        for f, loc in plan.locs.items()
    }


class _Cells:
    """Where each (partition, field, global index) cell lives in the store."""

    def __init__(self, store: DataStore) -> None:
        self.store = store
        self.groups: dict[str, dict[tuple[tuple[str, str, int], ...], _Group]] = {}
        self.where: dict[str, dict[str, dict[int, tuple[_Group, int]]]] = {}
        self._names = 0

    async def begin_write(
        self, pid: str, key: tuple[tuple[str, str, int], ...], n: int, indexes: list[int] | None
    ) -> WritePlan:
        """Where ``n`` samples' cells go: the store partition of this field set (created on
        first use) and, per sample, an existing row to overwrite or a new row. ``indexes=None``:
        new samples (their indexes are allocated by ``end_write``)."""
        names = tuple(k[0] for k in key)
        groups = self.groups.setdefault(pid, {})
        where = self.where.setdefault(pid, {})
        grp = groups.get(key)
        created = grp is None
        if grp is None:
            self._names += 1
            grp = _Group(f"tq{self._names}:{pid}", names, key)
            await self.store.create_partition(grp.name, list(names), tasks=(_CLEAR_TASK,))
            groups[key] = grp
        plan = WritePlan(pid, key, grp.name, created, [], [], [], indexes, n)
        for pos, g in enumerate(indexes if indexes is not None else range(n)):
            loc = None
            if indexes is not None:
                locs = {where.get(f, {}).get(g) for f in names}
                loc = locs.pop() if len(locs) == 1 else None
            if loc is not None and loc[0] is grp:
                plan.in_place.append(pos)
                plan.in_rows.append(loc[1])
            else:
                plan.fresh.append(pos)
        return plan

    async def abort_write(self, plan: WritePlan) -> None:
        grp = self.groups.get(plan.pid, {}).get(plan.key)
        if plan.created and grp is not None and grp.name == plan.group and not grp.live:
            self.groups[plan.pid].pop(plan.key, None)
            await self.store.delete_partition(grp.name)

    async def end_write(
        self, plan: WritePlan, rows: Sequence[int], allocate: Callable[[], list[int]]
    ) -> list[int]:
        """Record the rows the store wrote for ``plan``; returns the samples' indexes."""
        grp = self.groups.get(plan.pid, {}).get(plan.key)
        if grp is None or grp.name != plan.group:
            raise RequestError(f"put: partition {plan.pid!r} was cleared during the put")
        idx = list(plan.indexes) if plan.indexes is not None else allocate()
        where = self.where.setdefault(plan.pid, {})
        dead: list[tuple[_Group, int]] = []
        for pos, row in zip(plan.fresh, rows, strict=True):
            g = idx[pos]
            for f in grp.fields:
                old = where.setdefault(f, {}).get(g)
                if old is not None:
                    dead.append(old)
                where[f][g] = (grp, int(row))
            grp.live[int(row)] = len(grp.fields)
        await self._free(plan.pid, dead)
        return idx

    def plan_read(
        self, pids: Sequence[str], indexes: Sequence[int], fields: Sequence[str]
    ) -> ReadPlan:
        """Which store partitions and rows hold these samples' ``fields``. The usual case, a
        field whose cells all sit in one store partition, is read in the batch's order as
        is (``locs[field]`` is then that partition's position in ``groups``)."""
        groups: list[tuple[str, list[int], list[str]]] = []
        slot: dict[int, int] = {}
        position: dict[int, dict[int, int]] = {}
        locs: dict[str, int | list[tuple[int, int]]] = {}
        one_pid = pids[0] if pids and all(p == pids[0] for p in pids) else None
        for f in fields:
            if one_pid is not None:
                get = self.where.get(one_pid, {}).get(f, {}).get
                cells = [get(g) for g in indexes]
            else:
                cells = [
                    self.where.get(p, {}).get(f, {}).get(g)
                    for p, g in zip(pids, indexes, strict=True)
                ]
            if None in cells:
                i = cells.index(None)
                raise StorageKeyNotFoundError(
                    f"sample {indexes[i]} of partition {pids[i]!r} has no value for field {f!r}"
                )
            first = cells[0][0]  # type: ignore[index]
            if all(c[0] is first for c in cells):  # type: ignore[index]
                rows = [c[1] for c in cells]  # type: ignore[index]
                k = slot.get(id(first))
                if k is None and len(set(rows)) == len(rows):
                    slot[id(first)] = len(groups)
                    locs[f] = len(groups)
                    groups.append((first.name, rows, [f]))
                    continue
                if k is not None and groups[k][1] == rows:
                    groups[k][2].append(f)
                    locs[f] = k
                    continue
            got: list[tuple[int, int]] = []
            for cell in cells:
                grp, row = cell  # type: ignore[misc]
                k = slot.get(id(grp))
                if k is None:
                    k = slot[id(grp)] = len(groups)
                    groups.append((grp.name, [], []))
                pos = position.setdefault(k, {r: i for i, r in enumerate(groups[k][1])})
                at = pos.get(row)
                if at is None:
                    at = pos[row] = len(groups[k][1])
                    groups[k][1].append(row)
                if f not in groups[k][2]:
                    groups[k][2].append(f)
                got.append((k, at))
            locs[f] = got
        return ReadPlan([(n, tuple(r), tuple(fs)) for n, r, fs in groups], locs, len(indexes))

    async def write_values(
        self, pid: str, columns: Mapping[str, Any], n: int, indexes: list[int]
    ) -> None:
        key = tuple((f, *_kind(columns[f])) for f in sorted(columns))
        plan = await self.begin_write(pid, key, n, indexes)
        try:
            rows = await store_write(self.store, plan, columns)
        except BaseException:
            await self.abort_write(plan)
            raise
        await self.end_write(plan, rows, list)

    async def free(self, pid: str, indexes: Sequence[int]) -> None:
        where = self.where.get(pid, {})
        dead = [loc for col in where.values() for g in indexes if (loc := col.pop(g, None))]
        await self._free(pid, dead)

    async def _free(self, pid: str, dead: Sequence[tuple[_Group, int]]) -> None:
        rows: dict[int, tuple[_Group, list[int]]] = {}
        for grp, row in dead:
            left = grp.live.get(row, 0) - 1
            if left > 0:
                grp.live[row] = left
                continue
            grp.live.pop(row, None)
            rows.setdefault(id(grp), (grp, []))[1].append(row)
        groups = self.groups.get(pid, {})
        for grp, gone in rows.values():
            if not grp.live:
                await self.store.delete_partition(grp.name)
                groups.pop(grp.key, None)
                continue
            meta = await self.store.get_meta(
                grp.name, _CLEAR_TASK, list(grp.fields), len(gone),
                sampler=_ExactRows(gone), timeout=60.0,
            )  # fmt: skip
            await self.store.ack(meta)

    async def drop(self, pid: str) -> None:
        for grp in self.groups.pop(pid, {}).values():
            await self.store.delete_partition(grp.name)
        self.where.pop(pid, None)

    async def dump(self) -> dict[str, dict[str, dict[int, Any]]]:
        out: dict[str, dict[str, dict[int, Any]]] = {}
        for pid, where in self.where.items():
            for f, col in where.items():
                idx = sorted(col)
                if idx:
                    plan = self.plan_read([pid] * len(idx), idx, [f])
                    vals = (await store_fetch(self.store, plan))[f]
                    out.setdefault(pid, {})[f] = dict(zip(idx, vals, strict=True))
        return out

    async def load(self, cells: Mapping[str, Mapping[str, Mapping[int, Any]]]) -> None:
        for pid in list(self.groups):
            await self.drop(pid)
        for pid, cols in cells.items():
            for f, col in cols.items():
                by_kind: dict[tuple[str, int], list[int]] = {}  # a store partition holds one
                for g in sorted(col):
                    by_kind.setdefault(_kind([col[g]]), []).append(g)
                for idx in by_kind.values():
                    await self.write_values(pid, {f: [col[g] for g in idx]}, len(idx), idx)


def _kind(column: Any) -> tuple[str, int]:
    """A column's cell dtype and rank (plain values: ``("plain", 0)``)."""
    if isinstance(column, torch.Tensor):
        return str(column.dtype), column.dim() - 1
    first = column[0] if len(column) else None
    if isinstance(first, torch.Tensor):
        return str(first.dtype), first.dim()
    return "plain", 0


def _take(columns: Mapping[str, Any], pos: list[int], n: int) -> dict[str, Any]:
    if len(pos) == n:
        return dict(columns)
    out: dict[str, Any] = {}
    for f, v in columns.items():
        if isinstance(v, torch.Tensor):
            out[f] = v[torch.tensor(pos, dtype=torch.long)]
        else:
            out[f] = [v[i] for i in pos]
    return out


def _columns(data: Any) -> tuple[dict[str, Any], dict[str, list[tuple[int, ...] | None]]]:
    """Per-field row values of a ``TensorDict`` for the store (a dense tensor whose dim 0 is
    the sample, or a list of per-sample values), and each row's shape."""
    n = int(data.batch_size[0])
    cols: dict[str, Any] = {}
    shapes: dict[str, list[tuple[int, ...] | None]] = {}
    for name in list(data.keys()):  # iterating a TensorDict walks its rows
        v = data.get(name)
        if isinstance(v, torch.Tensor):
            if v.is_nested:
                rows = list(v.unbind())
                cols[name] = rows
                shapes[name] = [tuple(r.shape) for r in rows]
            else:
                cols[name] = v.detach()
                shapes[name] = [tuple(v.shape[1:])] * n
        elif hasattr(v, "tolist"):
            vals = v.tolist()
            if not isinstance(vals, list) or len(vals) != n:
                raise BadArgumentError(
                    f"put: field {name!r} holds {type(v).__name__}, not one value per sample"
                )
            cols[name] = vals
            shapes[name] = [None] * n
        else:
            raise BadArgumentError(
                f"put: field {name!r} holds {type(v).__name__}; a field is a tensor, a nested "
                "tensor or a NonTensorStack"
            )
    return cols, shapes


def pack(values: list[Any]) -> Any:
    """A batch column from per-sample values, as TransferQueue returns it: 0-dim tensors
    stacked, other tensors a jagged nested tensor (strided when the rows differ beyond dim
    0), anything else a ``NonTensorStack``."""
    from tensordict import NonTensorStack

    if values and all(isinstance(v, torch.Tensor) for v in values):
        if all(v.dim() == 0 for v in values):
            return torch.stack(values)
        try:
            return torch.nested.as_nested_tensor(values, layout=torch.jagged)
        except (RuntimeError, TypeError):
            try:
                return torch.nested.as_nested_tensor(values, layout=torch.strided)
            except (RuntimeError, TypeError):
                return NonTensorStack(*values)
    return NonTensorStack(*values)


# ----------------------------------------------------------------------------------------------
# the client
# ----------------------------------------------------------------------------------------------
class _Core:
    """TransferQueue's controller over a store: the bookkeeping and where each cell lives.
    Runs on one event loop: the client's (in-process) or a Ray actor's (shared by every
    process that attached)."""

    def __init__(
        self,
        store: DataStore,
        sampler: Callable[..., tuple[list[int], list[int]]],
        polling_mode: bool,
        get_meta_timeout_s: float,
        pre_alloc: int = 1,
    ) -> None:
        self.store = store
        self.polling_mode = polling_mode
        self.get_meta_timeout_s = get_meta_timeout_s
        self._ctl = _Controller(sampler, pre_alloc)
        self._cells = _Cells(store)
        self._changed: asyncio.Event | None = None

    async def get_store(self) -> DataStore:
        return self.store

    async def begin_write(
        self, pid: str, key: tuple[tuple[str, str, int], ...], n: int, indexes: list[int] | None
    ) -> WritePlan:
        return await self._cells.begin_write(pid, key, n, indexes)

    async def abort_write(self, plan: WritePlan) -> None:
        await self._cells.abort_write(plan)

    async def end_write(
        self,
        plan: WritePlan,
        rows: Sequence[int],
        schema: Schema,
        shapes: Mapping[str, list[tuple[int, ...] | None]],
        custom_meta: Sequence[dict[str, Any]],
    ) -> list[int]:
        ctl = self._ctl
        idx = await self._cells.end_write(
            plan, rows, lambda: ctl.activate(ctl.create(plan.pid), plan.n)
        )
        ctl.produced(plan.pid, idx, schema, shapes)
        p = ctl.partitions[plan.pid]
        for g, meta in zip(idx, custom_meta, strict=True):
            p.custom_meta[g] = copy.deepcopy(meta)
        self._notify()
        return idx

    async def plan_read(
        self, pids: Sequence[str], indexes: Sequence[int], fields: Sequence[str]
    ) -> ReadPlan:
        return self._cells.plan_read(pids, indexes, fields)

    async def shutdown(self) -> None:
        for pid in list(self._ctl.partitions):
            await self.clear_partition(pid)

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def _wait_change(self, timeout: float) -> None:
        if self._changed is None:
            self._changed = asyncio.Event()
        ev = self._changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ev.wait(), timeout)

    async def get_meta(
        self,
        data_fields: list[str],
        batch_size: int,
        partition_id: str,
        mode: str,
        task_name: str | None,
        sampling_config: dict[str, Any] | None,
    ) -> BatchMeta:
        if mode not in _MODES:
            raise BadArgumentError(f"get_meta: mode must be one of {list(_MODES)}, got {mode!r}")
        fields = _check_names("get_meta: data_fields", data_fields)
        pid = _check_pid("get_meta: partition_id", partition_id)
        if mode == "force_fetch":
            p = self._ctl.partitions.get(pid)
            if p is None:
                raise RequestError(f"get_meta: partition {pid!r} not found")
            return self._ctl.batch_meta(p, p.all_indexes(), fields, mode)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise BadArgumentError(f"get_meta: batch_size must be an int >= 1, got {batch_size!r}")
        if mode == "insert":
            p = self._ctl.create(pid)
            return self._ctl.batch_meta(p, self._ctl.activate(p, batch_size), fields, mode)
        task = _check_pid("get_meta: task_name", task_name)
        if sampling_config is not None and not isinstance(sampling_config, dict):
            raise BadArgumentError(
                f"get_meta: sampling_config must be a dict or None, got {sampling_config!r:.80}"
            )
        cfg = dict(sampling_config or {})
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.get_meta_timeout_s
        sampler = self._ctl.sampler
        while True:
            p = self._ctl.partitions.get(pid)
            ready = self._ctl.ready(p, fields, task) if p is not None else []
            if len(ready) >= batch_size:
                break
            if self.polling_mode:
                has = getattr(sampler, "has_cached_result", None)
                if callable(has) and has(pid, task, cfg):
                    break
                return BatchMeta.empty()
            left = deadline - loop.time()
            if left <= 0:
                raise RequestError(
                    f"get_meta: timed out after {self.get_meta_timeout_s} s waiting for "
                    f"batch_size={batch_size} samples with fields {fields} in partition {pid!r} "
                    f"for task {task!r}; {len(ready)} are ready"
                )
            await self._wait_change(left)
        p = self._ctl.partitions[pid]
        view = PartitionView(pid, tuple(sorted(p.active)), p.custom_meta)
        try:
            sampled, consumed = sampler(ready, batch_size, partition=view, **cfg)
        except ValueError as e:  # TransferQueue's client sees a sampler's error as RuntimeError
            raise BadArgumentError(f"get_meta: the sampler refused the request: {e}") from e
        except Exception as e:
            raise RequestError(f"get_meta: the sampler failed: {type(e).__name__}: {e}") from e
        sampled, consumed = [int(g) for g in sampled], [int(g) for g in consumed]
        if not sampled:
            if self.polling_mode:
                return BatchMeta.empty()
            raise RequestError(
                f"get_meta: the sampler returned no samples (batch_size={batch_size}, "
                f"{len(ready)} ready)"
            )
        if consumed:
            p.consumed.setdefault(task, set()).update(consumed)
        return self._ctl.batch_meta(p, sampled, fields, "fetch")

    async def set_custom_meta(self, metadata: BatchMeta) -> None:
        if not isinstance(metadata, BatchMeta):
            raise BadArgumentError(
                f"set_custom_meta: metadata must be a BatchMeta, got {type(metadata).__name__}"
            )
        for g, pid, meta in zip(
            metadata.global_indexes, metadata.partition_ids, metadata.custom_meta, strict=True
        ):
            p = self._ctl.partitions.get(pid)
            if p is not None:
                p.custom_meta[g] = copy.deepcopy(meta)

    async def clear_partition(self, partition_id: str) -> None:
        pid = _check_pid("clear_partition: partition_id", partition_id)
        if pid not in self._ctl.partitions:
            return
        await self._cells.drop(pid)
        self._ctl.drop_partition(pid)
        self._notify()

    async def clear_samples(self, metadata: BatchMeta) -> None:
        if not isinstance(metadata, BatchMeta):
            raise BadArgumentError(
                f"clear_samples: metadata must be a BatchMeta, got {type(metadata).__name__}"
            )
        by_pid: dict[str, list[int]] = {}
        for g, pid in zip(metadata.global_indexes, metadata.partition_ids, strict=True):
            by_pid.setdefault(pid, []).append(g)
        for pid, idx in by_pid.items():
            p = self._ctl.partitions.get(pid)
            if p is None:
                continue
            gone = self._ctl.forget(p, idx)
            await self._cells.free(pid, gone)
        self._notify()

    async def consumption(
        self, task_name: str, partition_id: str
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        task = _check_pid("get_consumption_status: task_name", task_name)
        p = self._ctl.partitions.get(partition_id)
        if p is None:
            return None, None
        idx = p.all_indexes()
        done = p.consumed.setdefault(task, set())
        return (
            torch.tensor(idx, dtype=torch.long),
            torch.tensor([1 if g in done else 0 for g in idx], dtype=torch.int8),
        )

    async def production(
        self, data_fields: list[str], partition_id: str
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        fields = _check_names("get_production_status: data_fields", data_fields)
        p = self._ctl.partitions.get(partition_id)
        if p is None or not fields or any(f not in p.fields for f in fields):
            return None, None
        cols = sorted(set(fields), key=p.fields.__getitem__)  # registration order
        idx = p.all_indexes()
        status = torch.tensor(
            [[1 if f in p.produced.get(g, ()) else 0 for f in cols] for g in idx],
            dtype=torch.int8,
        ).reshape(len(idx), len(cols))
        return torch.tensor(idx, dtype=torch.long), status

    async def reset_consumption(self, partition_id: str, task_name: str | None) -> bool:
        if task_name is not None:
            _check_pid("reset_consumption: task_name", task_name)
        p = self._ctl.partitions.get(partition_id)
        if p is not None:
            for task, done in p.consumed.items():
                if task_name is None or task == task_name:
                    done.clear()
            self._notify()
        return True

    async def partition_list(self) -> list[str]:
        return list(self._ctl.partitions)

    async def kv_retrieve_meta(
        self, keys: list[str] | str, partition_id: str, create: bool
    ) -> BatchMeta:
        if isinstance(keys, str):
            keys = [keys]
        elif isinstance(keys, list):
            if not keys:
                raise ValueError("kv_retrieve_meta: keys is an empty list")
            if not all(isinstance(k, str) for k in keys):
                raise TypeError("kv_retrieve_meta: not every element of keys is a str")
        else:
            raise TypeError(
                f"kv_retrieve_meta: keys must be a str or a list of str, got {keys!r:.80}"
            )
        if len(set(keys)) != len(keys):
            raise BadArgumentError("kv_retrieve_meta: keys contain duplicates")
        pid = _check_pid("kv_retrieve_meta: partition_id", partition_id)
        p = self._ctl.partitions.get(pid)
        if p is None:
            if not create:
                return BatchMeta.empty()
            p = self._ctl.create(pid)
        idx: list[int | None] = [p.keys.get(k) for k in keys]
        missing = [i for i, g in enumerate(idx) if g is None]
        if missing and create:
            new = self._ctl.activate(p, len(missing))
            for i, g in zip(missing, new, strict=True):
                idx[i] = g
                p.keys[keys[i]] = g
                p.rkeys[g] = keys[i]
        found = [g for g in idx if g is not None]
        common = [f for f in p.fields if all(f in p.produced.get(g, ()) for g in found)]
        return self._ctl.batch_meta(p, found, common, "force_fetch")

    async def kv_retrieve_keys(
        self, global_indexes: list[int] | int, partition_id: str
    ) -> list[str]:
        if isinstance(global_indexes, int) and not isinstance(global_indexes, bool):
            global_indexes = [global_indexes]
        elif isinstance(global_indexes, list):
            if not global_indexes:
                raise ValueError("kv_retrieve_keys: global_indexes is an empty list")
            if not all(isinstance(g, int) and not isinstance(g, bool) for g in global_indexes):
                raise TypeError("kv_retrieve_keys: not every element of global_indexes is an int")
        else:
            raise TypeError(
                f"kv_retrieve_keys: global_indexes must be an int or a list of int, got "
                f"{global_indexes!r:.80}"
            )
        p = self._ctl.partitions.get(partition_id)
        keys = [p.rkeys.get(g) for g in global_indexes] if p is not None else []
        if len(keys) != len(global_indexes) or any(k is None for k in keys):
            raise RequestError(
                f"kv_retrieve_keys: some of {global_indexes} have no key in partition "
                f"{partition_id!r}"
            )
        return [k for k in keys if k is not None]

    async def kv_list(self, partition_id: str | None) -> dict[str, dict[str, Any]]:
        pids = list(self._ctl.partitions) if partition_id is None else [partition_id]
        out: dict[str, dict[str, Any]] = {}
        for pid in pids:
            p = self._ctl.partitions.get(pid)
            if p is not None:
                out[pid] = {k: copy.deepcopy(p.custom_meta.get(g, {})) for k, g in p.keys.items()}
        return out

    # Checkpoints: JSON and safetensors (asyncflow_tq.checkpoint), each file read and checked
    # whole before anything changes; a refused file is a CheckpointError.
    async def save_controller(self, path: str) -> None:
        write_controller(Path(path), self._ctl.state())

    async def load_controller(self, path: str) -> None:
        state = read_controller(Path(path))
        self._ctl.restore_sampler(state, path)
        self._ctl.restore(state)
        self._notify()

    async def save_storage(self, checkpoint_dir: str) -> None:
        cells = await self._cells.dump()
        Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
        write_storage(Path(checkpoint_dir), cells)

    async def load_storage(self, checkpoint_dir: str) -> None:
        await self._cells.load(read_storage(Path(checkpoint_dir)))

    async def load_checkpoint(self, controller_path: str, checkpoint_dir: str) -> None:
        """Both halves, each checked before either is applied."""
        state = read_controller(Path(controller_path))
        cells = read_storage(Path(checkpoint_dir))
        self._ctl.restore_sampler(state, controller_path)
        await self._cells.load(cells)
        self._ctl.restore(state)
        self._notify()


class _Loop:
    """An event loop in a daemon thread; coroutines are submitted to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="asyncflow-tq-loop", daemon=True
        )
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        if not self.thread.is_alive():
            self.loop.close()


def _check_names(what: str, value: object) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v for v in value):
        raise BadArgumentError(f"{what} must be a list of field names, got {value!r:.80}")
    return list(value)


def _check_pid(what: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise BadArgumentError(f"{what} must be a non-empty str, got {value!r:.80}")
    return value


def _batch_size(data: Any) -> int:
    from tensordict import TensorDictBase

    if not isinstance(data, TensorDictBase):
        raise BadArgumentError(f"put: data must be a TensorDict, got {type(data).__name__}")
    if len(data.batch_size) < 1:
        raise BadArgumentError("put: data must have a batch dimension (batch_size=[n])")
    return int(data.batch_size[0])


class TransferQueueClient:
    """TransferQueue's client API (sync methods and their ``async_`` twins) over an AsyncFlow
    ``DataStore``. Built by ``asyncflow_tq.init``; ``get_client()`` returns it."""

    def __init__(
        self,
        store: DataStore,
        *,
        sampler: Callable[..., tuple[list[int], list[int]]] | None = None,
        polling_mode: bool = False,
        get_meta_timeout_s: float = 5.0,
        pre_alloc: int = 1,
        client_id: str | None = None,
        owns_store: Callable[[], None] | None = None,
        remote: Any = None,
    ) -> None:
        """In-process controller over ``store`` (the default), or, with ``remote``, a client
        of the controller actor ``remote`` (see ``asyncflow_tq.remote``; ``store`` is then
        its store, written and read directly by this client)."""
        self.client_id = client_id or f"TransferQueueClient_{os.getpid()}"
        self.store = store
        self._core: _Core | None = None
        self._remote = remote
        if remote is None:
            self._core = _Core(
                store,
                sampler if sampler is not None else SequentialSampler(),
                polling_mode,
                get_meta_timeout_s,
                pre_alloc,
            )
        self._loop = _Loop()
        self._closed = False
        self._on_close = owns_store

    # -- plumbing ------------------------------------------------------------------------------
    def _sync(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise RuntimeError(f"[{self.client_id}]: the client is closed")
        return self._loop.submit(coro).result()

    async def _async(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise RuntimeError(f"[{self.client_id}]: the client is closed")
        return await asyncio.wrap_future(self._loop.submit(coro))

    async def _call(self, method: str, *args: Any) -> Any:
        """A controller call: in this process, or on the controller actor (its errors
        re-raised as themselves, not wrapped in Ray's)."""
        if self._core is not None:
            return await getattr(self._core, method)(*args)
        try:
            return await self._remote.call.remote(method, *args)
        except Exception as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None
            raise

    @property
    def is_attached(self) -> bool:
        """Whether this client talks to a controller actor (shared by processes)."""
        return self._remote is not None

    # -- control-plane calls ------------------------------------------------------------------
    async def _get_meta(
        self,
        data_fields: list[str],
        batch_size: int,
        partition_id: str,
        mode: str,
        task_name: str | None,
        sampling_config: dict[str, Any] | None,
    ) -> BatchMeta:
        meta: BatchMeta = await self._call(
            "get_meta", data_fields, batch_size, partition_id, mode, task_name, sampling_config
        )
        return meta

    async def _set_custom_meta(self, metadata: BatchMeta) -> None:
        await self._call("set_custom_meta", metadata)

    async def _clear_partition(self, partition_id: str) -> None:
        await self._call("clear_partition", partition_id)

    async def _clear_samples(self, metadata: BatchMeta) -> None:
        await self._call("clear_samples", metadata)

    async def _consumption(
        self, task_name: str, partition_id: str
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        out: tuple[torch.Tensor | None, torch.Tensor | None] = await self._call(
            "consumption", task_name, partition_id
        )
        return out

    async def _production(
        self, data_fields: list[str], partition_id: str
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        out: tuple[torch.Tensor | None, torch.Tensor | None] = await self._call(
            "production", data_fields, partition_id
        )
        return out

    async def _reset_consumption(self, partition_id: str, task_name: str | None) -> bool:
        return bool(await self._call("reset_consumption", partition_id, task_name))

    async def _partition_list(self) -> list[str]:
        return list(await self._call("partition_list"))

    async def _kv_retrieve_meta(
        self, keys: list[str] | str, partition_id: str, create: bool
    ) -> BatchMeta:
        meta: BatchMeta = await self._call("kv_retrieve_meta", keys, partition_id, create)
        return meta

    async def _kv_retrieve_keys(
        self, global_indexes: list[int] | int, partition_id: str
    ) -> list[str]:
        return list(await self._call("kv_retrieve_keys", global_indexes, partition_id))

    async def _kv_list(self, partition_id: str | None) -> dict[str, dict[str, Any]]:
        return dict(await self._call("kv_list", partition_id))

    async def _save_controller(self, path: str) -> None:
        await self._call("save_controller", path)

    async def _load_controller(self, path: str) -> None:
        await self._call("load_controller", path)

    async def _save_storage(self, checkpoint_dir: str) -> None:
        await self._call("save_storage", checkpoint_dir)

    async def _load_storage(self, checkpoint_dir: str) -> None:
        await self._call("load_storage", checkpoint_dir)

    async def _load_checkpoint(self, controller_path: str, checkpoint_dir: str) -> None:
        await self._call("load_checkpoint", controller_path, checkpoint_dir)

    async def _write(
        self,
        pid: str,
        columns: Mapping[str, Any],
        n: int,
        indexes: list[int] | None,
        schema: Schema,
        shapes: Mapping[str, list[tuple[int, ...] | None]],
        custom_meta: Sequence[dict[str, Any]],
    ) -> list[int]:
        """Store the values (this process writes the store directly), then record them."""
        key = tuple((f, *_kind(columns[f])) for f in sorted(columns))
        plan: WritePlan = await self._call("begin_write", pid, key, n, indexes)
        try:
            rows = await store_write(self.store, plan, columns)
        except BaseException:
            await self._call("abort_write", plan)
            raise
        return list(await self._call("end_write", plan, rows, schema, shapes, custom_meta))

    # -- get_meta ------------------------------------------------------------------------------
    def get_meta(
        self,
        data_fields: list[str],
        batch_size: int,
        partition_id: str,
        mode: str = "fetch",
        task_name: str | None = None,
        sampling_config: dict[str, Any] | None = None,
    ) -> BatchMeta:
        return self._sync(
            self._get_meta(data_fields, batch_size, partition_id, mode, task_name, sampling_config)
        )

    async def async_get_meta(
        self,
        data_fields: list[str],
        batch_size: int,
        partition_id: str,
        mode: str = "fetch",
        task_name: str | None = None,
        sampling_config: dict[str, Any] | None = None,
    ) -> BatchMeta:
        return await self._async(
            self._get_meta(data_fields, batch_size, partition_id, mode, task_name, sampling_config)
        )

    # -- custom meta ---------------------------------------------------------------------------
    def set_custom_meta(self, metadata: BatchMeta) -> None:
        self._sync(self._set_custom_meta(metadata))

    async def async_set_custom_meta(self, metadata: BatchMeta) -> None:
        await self._async(self._set_custom_meta(metadata))

    # -- put -----------------------------------------------------------------------------------
    async def _put(
        self,
        data: Any,
        metadata: BatchMeta | None,
        partition_id: str | None,
        data_parser: Callable[[Any], Any] | None,
    ) -> BatchMeta:
        n = _batch_size(data)
        if metadata is not None and not isinstance(metadata, BatchMeta):
            raise BadArgumentError(
                f"put: metadata must be a BatchMeta or None, got {type(metadata).__name__}"
            )
        if metadata is None:
            if partition_id is None:
                raise ValueError("put: partition_id must be provided if metadata is not given")
            _check_pid("put: partition_id", partition_id)
        elif metadata.size == 0:
            raise ValueError("put: metadata cannot be empty")
        elif n != metadata.size:
            raise BadArgumentError(
                f"put: data has batch size {n}, metadata has {metadata.size} samples"
            )
        if n == 0:
            raise ValueError("put: data has batch size 0")
        schema = field_schema_of(data)  # ValueError naming a field of the wrong length
        if not schema:
            raise BadArgumentError("put: data has no fields")
        cols, shapes = _columns(data)
        if data_parser is not None:
            data_parser(cols)
        try:
            if metadata is None:  # new samples: their indexes once the store took the values
                pid = _check_pid("put: partition_id", partition_id)
                idx = await self._write(pid, cols, n, None, schema, shapes, [{}] * n)
                metadata = BatchMeta(idx, [pid] * n)
            else:
                by_pid: dict[str, list[int]] = {}
                for i, pid in enumerate(metadata.partition_ids):
                    by_pid.setdefault(pid, []).append(i)
                for pid, pos in by_pid.items():
                    await self._write(
                        pid,
                        cols if len(pos) == n else _take(cols, pos, n),
                        len(pos),
                        [metadata.global_indexes[i] for i in pos],
                        schema,
                        {f: [s[i] for i in pos] for f, s in shapes.items()},
                        [metadata.custom_meta[i] for i in pos],
                    )
        except (BadRequestError, SchemaError) as e:  # the store refused a value
            raise BadArgumentError(f"put: {e}") from e
        return metadata.add_fields(data)

    def put(
        self,
        data: Any,
        metadata: BatchMeta | None = None,
        partition_id: str | None = None,
        data_parser: Callable[[Any], Any] | None = None,
    ) -> BatchMeta:
        return self._sync(self._put(data, metadata, partition_id, data_parser))

    async def async_put(
        self,
        data: Any,
        metadata: BatchMeta | None = None,
        partition_id: str | None = None,
        data_parser: Callable[[Any], Any] | None = None,
    ) -> BatchMeta:
        return await self._async(self._put(data, metadata, partition_id, data_parser))

    # -- get_data ------------------------------------------------------------------------------
    async def _get_data(self, metadata: BatchMeta) -> Any:
        from tensordict import TensorDict

        if not isinstance(metadata, BatchMeta):
            raise BadArgumentError(
                f"get_data: metadata must be a BatchMeta, got {type(metadata).__name__}"
            )
        if metadata.size == 0 or not metadata.field_names:
            return TensorDict({}, batch_size=0)
        names = metadata.field_names
        plan: ReadPlan = await self._call(
            "plan_read", metadata.partition_ids, metadata.global_indexes, names
        )
        cols = await store_fetch(self.store, plan)
        return TensorDict({f: pack(v) for f, v in cols.items()}, batch_size=metadata.size)

    def get_data(self, metadata: BatchMeta) -> Any:
        return self._sync(self._get_data(metadata))

    async def async_get_data(self, metadata: BatchMeta) -> Any:
        return await self._async(self._get_data(metadata))

    # -- clear ---------------------------------------------------------------------------------
    def clear_partition(self, partition_id: str) -> None:
        self._sync(self._clear_partition(partition_id))

    async def async_clear_partition(self, partition_id: str) -> None:
        await self._async(self._clear_partition(partition_id))

    def clear_samples(self, metadata: BatchMeta) -> None:
        self._sync(self._clear_samples(metadata))

    async def async_clear_samples(self, metadata: BatchMeta) -> None:
        await self._async(self._clear_samples(metadata))

    # -- status --------------------------------------------------------------------------------
    def get_consumption_status(
        self, task_name: str, partition_id: str
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self._sync(self._consumption(task_name, partition_id))

    async def async_get_consumption_status(
        self, task_name: str, partition_id: str
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return await self._async(self._consumption(task_name, partition_id))

    def get_production_status(
        self, data_fields: list[str], partition_id: str
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self._sync(self._production(data_fields, partition_id))

    async def async_get_production_status(
        self, data_fields: list[str], partition_id: str
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return await self._async(self._production(data_fields, partition_id))

    @staticmethod
    def _all_consumed(status: torch.Tensor | None) -> bool:
        return status is not None and status.numel() > 0 and bool(torch.all(status == 1))

    @staticmethod
    def _all_produced(status: torch.Tensor | None) -> bool:
        return status is not None and bool(torch.all(status == 1))

    def check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        return self._all_consumed(self.get_consumption_status(task_name, partition_id)[1])

    async def async_check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        _, s = await self.async_get_consumption_status(task_name, partition_id)
        return self._all_consumed(s)

    def check_production_status(self, data_fields: list[str], partition_id: str) -> bool:
        return self._all_produced(self.get_production_status(data_fields, partition_id)[1])

    async def async_check_production_status(
        self, data_fields: list[str], partition_id: str
    ) -> bool:
        _, s = await self.async_get_production_status(data_fields, partition_id)
        return self._all_produced(s)

    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        return self._sync(self._reset_consumption(partition_id, task_name))

    async def async_reset_consumption(
        self, partition_id: str, task_name: str | None = None
    ) -> bool:
        return await self._async(self._reset_consumption(partition_id, task_name))

    def get_partition_list(self) -> list[str]:
        return self._sync(self._partition_list())

    async def async_get_partition_list(self) -> list[str]:
        return await self._async(self._partition_list())

    # -- keys ----------------------------------------------------------------------------------
    def kv_retrieve_meta(
        self, keys: list[str] | str, partition_id: str, create: bool = False
    ) -> BatchMeta:
        return self._sync(self._kv_retrieve_meta(keys, partition_id, create))

    async def async_kv_retrieve_meta(
        self, keys: list[str] | str, partition_id: str, create: bool = False
    ) -> BatchMeta:
        return await self._async(self._kv_retrieve_meta(keys, partition_id, create))

    def kv_retrieve_keys(self, global_indexes: list[int] | int, partition_id: str) -> list[str]:
        return self._sync(self._kv_retrieve_keys(global_indexes, partition_id))

    async def async_kv_retrieve_keys(
        self, global_indexes: list[int] | int, partition_id: str
    ) -> list[str]:
        return await self._async(self._kv_retrieve_keys(global_indexes, partition_id))

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, Any]]:
        return self._sync(self._kv_list(partition_id))

    async def async_kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, Any]]:
        return await self._async(self._kv_list(partition_id))

    # -- checkpoints ---------------------------------------------------------------------------
    def save_controller_checkpoint(self, path: str) -> None:
        self._sync(self._save_controller(path))

    async def async_save_controller_checkpoint(self, path: str) -> None:
        await self._async(self._save_controller(path))

    def load_controller_checkpoint(self, path: str) -> None:
        self._sync(self._load_controller(path))

    async def async_load_controller_checkpoint(self, path: str) -> None:
        await self._async(self._load_controller(path))

    def save_storage_checkpoint(self, checkpoint_dir: str) -> None:
        self._sync(self._save_storage(checkpoint_dir))

    async def async_save_storage_checkpoint(self, checkpoint_dir: str) -> None:
        await self._async(self._save_storage(checkpoint_dir))

    def load_storage_checkpoint(self, checkpoint_dir: str) -> None:
        self._sync(self._load_storage(checkpoint_dir))

    async def async_load_storage_checkpoint(self, checkpoint_dir: str) -> None:
        await self._async(self._load_storage(checkpoint_dir))

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop this client (idempotent). An in-process controller drops every partition from
        the store first; an attached client leaves the shared state to its owner."""
        if self._closed:
            return
        try:
            if self._core is not None:
                self._sync(self._core.shutdown())
        finally:
            self._closed = True
            self._loop.stop()
            if self._on_close is not None:
                self._on_close()
