"""Batch memory of the in-process store: ``get_data(..., out=)`` writes a padded or nested batch
into an earlier batch's memory only when nothing else holds it, and ``BATCH_POOL`` reuses the
memory of dropped batches within a bound. (The generic law, "a read with ``out=`` equals a read
without it", is in the conformance suite.)"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import torch

from asyncflow_core.contracts.errors import BadRequestError
from asyncflow_core.contracts.protocols import Batch, BatchMeta
from asyncflow_core.data.store import BATCH_POOL, BufferPool, InProcessDataStore


def run(fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(fn())


def ptr(t: torch.Tensor) -> int:
    """Where ``t``'s memory starts (a nested tensor's values)."""
    values = t.values() if t.is_nested else t
    return int(values.untyped_storage().data_ptr())


def rows(lengths: list[int], start: float = 0.0) -> list[torch.Tensor]:
    return [torch.arange(n, dtype=torch.float32) + start + 1000 * i for i, n in enumerate(lengths)]


async def store_with(
    lengths: list[int], start: float = 0.0
) -> tuple[InProcessDataStore, BatchMeta]:
    store = InProcessDataStore(2)
    await store.create_partition("p", ["x", "y"], tasks=["t"])
    ids = await store.put("p", {"x": rows(lengths, start), "y": rows(lengths, start + 0.5)})
    return store, BatchMeta("p", "t", ids, ("x", "y"))


async def put_more(store: InProcessDataStore, lengths: list[int], start: float) -> BatchMeta:
    ids = await store.put("p", {"x": rows(lengths, start), "y": rows(lengths, start + 0.5)})
    return BatchMeta("p", "t", ids, ("x", "y"))


def padded_ok(batch: Batch, field: str, lengths: list[int], start: float, pad: float) -> None:
    data = batch[field]
    assert tuple(data.shape) == (len(lengths), max(lengths))
    for i, (row, want) in enumerate(zip(data, rows(lengths, start), strict=True)):
        assert torch.equal(row[: lengths[i]], want)
        assert bool((row[lengths[i] :] == pad).all())


@pytest.mark.parametrize("layout", ["padded", "nested"])
def test_out_memory_is_reused_when_the_new_batch_fits(layout: str) -> None:
    async def go() -> None:
        store, meta = await store_with([700, 300, 900])
        first = await store.get_data(meta, layout=layout)  # type: ignore[arg-type]
        before = {f: ptr(first[f]) for f in ("x", "y")}
        smaller = await put_more(store, [200, 100], 5.0)
        second = await store.get_data(smaller, layout=layout, out=first)  # type: ignore[arg-type]
        assert {f: ptr(second[f]) for f in ("x", "y")} == before
        if layout == "padded":
            padded_ok(second, "x", [200, 100], 5.0, 0)
            padded_ok(second, "y", [200, 100], 5.5, 0)
        else:
            for got, want in zip(second["x"].unbind(), rows([200, 100], 5.0), strict=True):
                assert torch.equal(got, want)

    run(go)


def test_out_that_is_too_small_is_replaced_and_the_answer_is_right() -> None:
    async def go() -> None:
        store, meta = await store_with([10, 3])
        first = await store.get_data(meta)
        bigger = await put_more(store, [4000, 20, 9000], 7.0)
        second = await store.get_data(bigger, pad_value=-1, out=first)
        padded_ok(second, "x", [4000, 20, 9000], 7.0, -1)
        padded_ok(second, "y", [4000, 20, 9000], 7.5, -1)

    run(go)


def test_out_from_other_fields_lends_its_memory() -> None:
    async def go() -> None:
        store, meta = await store_with([500, 600])
        first = await store.get_data(meta)
        spare = {ptr(first["x"]), ptr(first["y"])}
        again = await put_more(store, [100, 50], 3.0)
        only_y = BatchMeta("p", "t", again.rows, ("y",))
        # out holds x and y, the read asks for y alone: y reuses y's memory
        second = await store.get_data(only_y, out=first)
        assert ptr(second["y"]) in spare
        padded_ok(second, "y", [100, 50], 3.5, 0)
        # out holds y alone, the read asks for x: x takes y's memory (once `first`, which
        # shares that memory, is dropped: memory two batches hold is not reused)
        del first
        x_only = BatchMeta("p", "t", again.rows, ("x",))
        third = await store.get_data(x_only, out=second)
        assert ptr(third["x"]) == ptr(second["y"])
        padded_ok(third, "x", [100, 50], 3.0, 0)

    run(go)


@pytest.mark.parametrize("holder", ["slice", "variable", "list", "numpy", "other field"])
def test_memory_still_referenced_elsewhere_is_never_overwritten(holder: str) -> None:
    """The caller keeps part of ``out`` (a micro-batch slice, a variable, a list, a numpy
    view, or the same tensor under two names): that memory is not reused, so what the
    caller kept still holds the old values."""

    async def go() -> None:
        store, meta = await store_with([400, 800])
        first = await store.get_data(meta)
        x = first["x"]
        kept: Any = {
            "slice": x[:1],
            "variable": x,
            "list": [x],
            "numpy": x.numpy(),
            "other field": None,
        }[holder]
        if holder == "other field":
            first.data["z"] = x  # one tensor under two names: still one buffer, used once
            kept = x
        del x
        snapshot = torch.as_tensor(kept if holder != "list" else kept[0]).clone()
        nxt = await put_more(store, [300, 100], 9.0)
        second = await store.get_data(nxt, out=first)
        assert torch.equal(torch.as_tensor(kept if holder != "list" else kept[0]), snapshot)
        padded_ok(second, "x", [300, 100], 9.0, 0)
        padded_ok(second, "y", [300, 100], 9.5, 0)
        if holder != "other field":
            assert ptr(second["x"]) != ptr(first["x"])  # x's memory was not reused
        assert len({ptr(second["x"]), ptr(second["y"])}) == 2

    run(go)


def test_out_from_a_list_layout_never_touches_stored_tensors() -> None:
    async def go() -> None:
        store, meta = await store_with([30, 10])
        listed = await store.get_data(meta, layout="list")
        stored = [t.clone() for t in listed["x"]]
        await store.get_data(meta, out=listed)
        await store.get_data(meta, layout="nested", out=listed)
        again = await store.get_data(meta, layout="list")
        assert all(torch.equal(a, b) for a, b in zip(again["x"], stored, strict=True))

    run(go)


@pytest.mark.parametrize("bad", [{"x": torch.zeros(3)}, torch.zeros(2, 2), "batch", 0])
def test_out_that_is_not_a_batch_is_rejected_before_reading(bad: object) -> None:
    async def go() -> None:
        store, meta = await store_with([3, 2])
        before = await store.stats("p")
        with pytest.raises(BadRequestError, match="out must be a Batch"):
            await store.get_data(meta, out=bad)  # type: ignore[arg-type]
        assert await store.stats("p") == before
        # the empty read takes the same check
        with pytest.raises(BadRequestError, match="out must be a Batch"):
            await store.get_data(BatchMeta("p", "t", (), ("x",)), out=bad)  # type: ignore[arg-type]

    run(go)


# -- the pool -------------------------------------------------------------------------------
def test_pool_reuses_the_memory_of_a_dropped_batch_not_of_a_held_one() -> None:
    pool = BufferPool(max_bytes=64 << 20, min_bytes=1 << 20)
    a = pool.tensor(torch.float32, (1 << 20,), 4 << 20)
    a_ptr = ptr(a)
    b = pool.tensor(torch.float32, (1 << 20,), 4 << 20)  # a is held: b gets new memory
    assert ptr(b) != a_ptr
    b.fill_(7.0)
    del a
    c = pool.tensor(torch.float32, (3 << 18,), 3 << 20)  # a was dropped: its memory again
    assert ptr(c) == a_ptr
    assert bool((b == 7.0).all())  # b was never handed out
    assert len(pool) == 2


def test_pool_never_hands_out_memory_moved_to_shared_memory() -> None:
    pool = BufferPool(max_bytes=64 << 20, min_bytes=1 << 20)
    a = pool.tensor(torch.float32, (1 << 20,), 4 << 20)
    a_ptr = ptr(a)
    a.share_memory_()  # type: ignore[no-untyped-call]  # another process may map it now
    a_ptr = ptr(a)
    del a
    b = pool.tensor(torch.float32, (1 << 20,), 4 << 20)
    assert ptr(b) != a_ptr


def test_pool_keeps_at_most_max_bytes() -> None:
    pool = BufferPool(max_bytes=10 << 20, min_bytes=1 << 20)
    held = []
    for i in range(30):
        n = (1 << 20) + (i % 7) * (300 << 10)
        t = pool.tensor(torch.uint8, (n,), n)
        t.fill_(i % 251)
        if i % 3 == 0:
            held.append((t, i % 251))  # some batches stay in use
        assert pool.nbytes <= pool.max_bytes
    for t, v in held:  # nothing in use was handed out twice
        assert bool((t == v).all())
    held.clear()
    assert pool.nbytes <= pool.max_bytes
    pool.clear()
    assert pool.nbytes == 0 and len(pool) == 0


def test_pool_off_and_small_buffers_are_not_pooled() -> None:
    off = BufferPool(max_bytes=0)
    off.tensor(torch.float32, (1 << 20,), 4 << 20)
    assert len(off) == 0
    pool = BufferPool(max_bytes=64 << 20, min_bytes=1 << 20)
    pool.tensor(torch.float32, (1000,), 4000)
    assert len(pool) == 0


def test_reads_without_out_reuse_pooled_memory_within_the_bound() -> None:
    async def go() -> None:
        BATCH_POOL.clear()  # no free buffers of earlier tests to choose from
        store, meta = await store_with([300_000, 200_000])  # 2.4 MB padded per field
        first = await store.get_data(meta)
        first_ptrs = {ptr(first["x"]), ptr(first["y"])}
        del first
        second = await store.get_data(meta)
        assert {ptr(second["x"]), ptr(second["y"])} == first_ptrs
        padded_ok(second, "x", [300_000, 200_000], 0.0, 0)
        assert BATCH_POOL.nbytes <= BATCH_POOL.max_bytes

    run(go)
