"""What the DataStore conformance laws and state machine share: the store factory's type, a
fake clock, values and snapshots of a store, and the check that a rejected call changed
nothing. ``asyncflow_conformance.datastore`` re-exports the public ones."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar

import torch

from asyncflow_core.contracts.errors import AsyncFlowError
from asyncflow_core.contracts.protocols import (
    Batch,
    BatchMeta,
    Capacity,
    DataStore,
    Layout,
    PartitionStats,
)

StoreFactory = Callable[..., DataStore]
"""Builds a fresh, empty store: ``factory()``, or ``factory(clock=...)`` for a backend that
declares ``supports_fake_clock``."""

WAIT_S = 5.0
"""The longest a test waits for something that should happen at once; a broken backend fails
a test after this long instead of hanging the run."""

P = ParamSpec("P")
E = TypeVar("E", bound=AsyncFlowError)


class FakeClock:
    """A monotonic clock that moves only when told to: ``clock()`` reads, ``advance`` moves."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a monotonic clock cannot go back {seconds} s")
        self.now += seconds

    def __repr__(self) -> str:
        return f"FakeClock(now={self.now})"


def async_test(fn: Callable[P, Coroutine[Any, Any, None]]) -> Callable[P, None]:
    """Run an async test body with ``asyncio.run`` (no pytest-asyncio needed); pytest still
    sees the body's parameters as the fixtures to pass."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        asyncio.run(fn(*args, **kwargs))

    return run


async def settle() -> None:
    """Let every runnable coroutine on this loop run until it blocks (no sleeping)."""
    for _ in range(20):
        await asyncio.sleep(0)


# --------------------------------------------------------------------------------------------
# Values and snapshots
# --------------------------------------------------------------------------------------------
def cell_key(value: Any) -> Any:
    """A comparable, hashable-free stand-in for a cell: tensors by dtype, shape and values."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), value.tolist())
    return ("plain", value)


def unpack(batch: Batch, field: str, layout: Layout, ndim: int | None) -> list[Any]:
    """The per-row values of ``field`` in ``batch``, undoing ``layout``. ``ndim`` is the field's
    per-row tensor ndim (None for a plain field). Checks the layout's shape rules on the way."""
    data = batch[field]
    n = len(batch.rows)
    if ndim is None or layout == "list":
        assert isinstance(data, list), f"field {field!r} ({layout}): expected a list, got {data!r}"
        assert len(data) == n, f"field {field!r}: {len(data)} values for {n} rows"
        return list(data)
    assert isinstance(data, torch.Tensor), f"field {field!r} ({layout}): expected a tensor"
    if ndim == 0:
        assert tuple(data.shape) == (n,), (
            f"field {field!r} ({layout}): 0-dim rows must stack into [{n}], got {data.shape}"
        )
        return list(data.unbind(0))
    if layout == "nested":
        assert data.is_nested, f"field {field!r}: layout 'nested' gave a non-nested tensor"
        rows = list(data.unbind())
        assert len(rows) == n
        return rows
    lengths = batch.lengths.get(field)
    assert lengths is not None, f"field {field!r}: layout 'padded' must fill Batch.lengths"
    assert data.shape[0] == n and lengths.shape == (n,)
    assert data.shape[1] == (int(lengths.max()) if n else 0), "padded to more than max length"
    return [data[i, : int(length)] for i, length in enumerate(lengths.tolist())]


async def snapshot(
    store: DataStore, partition: str, cells: Mapping[str, Sequence[int]]
) -> tuple[PartitionStats, dict[str, list[Any]]]:
    """``stats(partition)`` plus the values of ``cells`` (field -> rows), read with
    ``get_data`` through a hand-built meta: what "the store is unchanged" compares."""
    stats = await store.stats(partition)
    values: dict[str, list[Any]] = {}
    task = stats.tasks[0] if stats.tasks else ""
    for field, rows in cells.items():
        if rows:
            meta = BatchMeta(partition, task, tuple(rows), (field,))
            batch = await store.get_data(meta, layout="list")
            values[field] = [cell_key(v) for v in batch[field]]
    return stats, values


async def expect_rejected(
    store: DataStore,
    call: Callable[[], Awaitable[Any]],
    error: type[E],
    *mentions: str,
    partition: str = "p",
    cells: Mapping[str, Sequence[int]] | None = None,
    because: str = "",
) -> E:
    """Assert ``call()`` raises ``error`` whose message contains every ``mentions`` string, and
    that ``partition``'s stats and ``cells`` values are the same before and after. A call that
    returns fails with an ``AssertionError`` naming what it returned, after ``because`` (why
    the call must be rejected); an error of another type propagates as it is."""
    before = await snapshot(store, partition, cells or {})
    try:
        result = await call()
    except error as e:
        caught = e
    else:
        why = f"{because}: " if because else ""
        raise AssertionError(
            f"{why}the call returned {result!r:.300} instead of raising {error.__name__}"
        )
    message = str(caught)
    for m in mentions:
        assert m in message, f"{type(caught).__name__} message does not name {m!r}: {message}"
    after = await snapshot(store, partition, cells or {})
    assert after[0] == before[0], (
        f"a rejected call ({type(caught).__name__}) changed stats:\n"
        f"before {before[0]}\nafter  {after[0]}"
    )
    assert after[1] == before[1], f"a rejected call ({type(caught).__name__}) changed data"
    return caught


async def new_partition(
    store: DataStore,
    name: str = "p",
    fields: Sequence[str] = ("x", "y"),
    tasks: Sequence[str] = ("t",),
    capacity: Capacity | None = None,
) -> None:
    await store.create_partition(name, list(fields), capacity=capacity)
    for task in tasks:
        await store.register_task(name, task)


def ragged(lengths: Sequence[int], start: int = 0, dtype: torch.dtype = torch.float32) -> list[Any]:
    """One 1-d tensor per length, each with distinct values."""
    return [(torch.arange(n) + start + 100 * i).to(dtype) for i, n in enumerate(lengths)]


def same(a: Any, b: Any) -> bool:
    return bool(cell_key(a) == cell_key(b))


def batch_key(batch: Batch) -> Any:
    """Everything a batch says, comparable: row ids, tags, each field's value exactly as laid
    out (a padded tensor with its padding, a nested tensor row by row, a list cell by cell)
    and each field's lengths."""
    data: dict[str, Any] = {}
    for name, value in batch.data.items():
        if isinstance(value, torch.Tensor) and value.is_nested:
            data[name] = ("nested", str(value.dtype), [cell_key(r) for r in value.unbind()])
        elif isinstance(value, list):
            data[name] = ("list", [cell_key(v) for v in value])
        else:
            data[name] = cell_key(value)
    lengths = {name: cell_key(v) for name, v in batch.lengths.items()}
    return batch.rows, batch.tags, data, lengths
