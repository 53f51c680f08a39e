"""The distributed DataStore (``asyncflow_ray.RayDataStore``) on a local Ray cluster: the
whole DataStore conformance suite (state machine included, fewer examples), plus what only a
distributed store has to show: the data plane bypasses the controller, puts copy, a dead
storage unit is named with its rows, a dead consumer's lease is redelivered, and the store
pickles into other actors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch
from asyncflow_conformance import DataStoreConformance, StoreFactory

from asyncflow_core.contracts.errors import AsyncFlowError, UnknownPartitionError, UnknownRowError
from asyncflow_core.contracts.protocols import BatchMeta, CellValue, DataStore

ray = pytest.importorskip("ray", reason="the Ray runtime needs the [ray] extra (ray 2.60)")

from asyncflow_ray.store import (  # noqa: E402
    BY_REF_MIN_BYTES,
    ROWS_PER_BLOCK,
    RayDataStore,
    unit_of,
    unpack_read,
)

# A safety net, not a figure: with two busy loops beside the test a store's 3 actors took
# ~150 s to start (2026-11-27; ~2 s idle), past the 120 s default.
START_S = 600.0


@pytest.fixture(scope="module")
def shared_store(ray_runtime: Any) -> Iterator[RayDataStore]:
    store = RayDataStore.create(2, start_timeout_s=START_S)  # ~2 s idle: once per module
    yield store
    store.shutdown()


def _reset(store: RayDataStore) -> None:
    """``RayDataStore.reset`` from sync code (a factory may be called inside a running loop)."""
    ray.get(store.controller.reset.remote())
    ray.get([u.reset.remote() for u in store.units])


class TestRayDataStore(DataStoreConformance):
    backend_name = "RayDataStore(2 storage units, local Ray cluster)"
    supports_direct_read = True
    real_lease_s: ClassVar[float] = 0.5  # a Ray round trip is ~1 ms; leave room for several
    state_machine_examples: ClassVar[int] = 40

    @pytest.fixture
    def store_factory(self, shared_store: RayDataStore) -> StoreFactory:
        def build() -> RayDataStore:
            _reset(shared_store)  # every partition gone: a store as new
            return shared_store

        return build

    @pytest.mark.slow
    def test_state_machine(self, store_factory: StoreFactory) -> None:
        """The suite's state machine with fewer examples than in-process (each step is a few
        Ray round trips): the profile's step count, at most ``state_machine_examples``."""
        from asyncflow_conformance.plugin import active_settings
        from asyncflow_conformance.stateful import make_datastore_state_machine
        from hypothesis import settings
        from hypothesis.stateful import run_state_machine_as_test

        base = active_settings()
        machine = make_datastore_state_machine(store_factory, name="RayDataStoreMachine")
        run_state_machine_as_test(
            machine,
            settings=settings(
                base, max_examples=min(base.max_examples, self.state_machine_examples)
            ),
        )

    def direct_read(self, store: DataStore, partition: str, row: int, field: str) -> CellValue:
        assert isinstance(store, RayDataStore)
        key = ray.get(store.controller.storage_key.remote(partition))
        unit = store.units[unit_of(row, len(store.units))]
        column = ray.get(unit.read.remote(key, [row], [field]))[field]
        return unpack_read(column, copy=True)[0]


# --------------------------------------------------------------------------------------------
# What only a distributed store has to show
# --------------------------------------------------------------------------------------------
def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_put_copies_so_the_caller_may_reuse_its_buffer(shared_store: RayDataStore) -> None:
    _reset(shared_store)

    async def go() -> None:
        await shared_store.create_partition("p", ["x"], tasks=["t"])
        buf = torch.arange(6, dtype=torch.float32).reshape(3, 2)
        await shared_store.put("p", {"x": buf})
        buf.zero_()  # the in-process store keeps references; this one cannot
        meta = await shared_store.get_meta("p", "t", ["x"], 3, timeout=5)
        got = await shared_store.get_data(meta)
        assert torch.equal(got["x"], torch.arange(6, dtype=torch.float32).reshape(3, 2))

    run(go())


def test_a_dead_storage_unit_is_named_with_its_rows_and_the_rest_survive(
    ray_runtime: Any,
) -> None:
    from asyncflow_core.contracts.errors import StorageUnitLostError

    store = RayDataStore.create(2, start_timeout_s=START_S)
    try:
        n = ROWS_PER_BLOCK + 3  # rows 0..31 on unit 0, 32..34 on unit 1
        on_1 = tuple(r for r in range(n) if unit_of(r, 2) == 1)
        on_0 = tuple(r for r in range(n) if unit_of(r, 2) == 0)
        assert on_1 == (32, 33, 34)

        async def go() -> None:
            await store.create_partition("p", ["x", "y"], tasks=["t"])
            await store.put("p", {"x": [torch.full((3,), float(i)) for i in range(n)]})
            ray.kill(store.units[1], no_restart=True)
            with pytest.raises(StorageUnitLostError) as lost:
                await store.get_data(BatchMeta("p", "t", tuple(range(n)), ("x",)))
            err = lost.value
            assert err.unit == 1 and err.rows == on_1, (err.unit, err.rows)
            assert "storage unit 1 of 2" in str(err) and "32" in str(err)
            # the rows of the live unit are intact
            got = await store.get_data(BatchMeta("p", "t", on_0, ("x",)))
            assert got["x"][:, 0].tolist() == [float(r) for r in on_0]
            # a put that needs the dead unit is rejected and leaves the store as it was
            before = await store.stats("p")
            with pytest.raises(StorageUnitLostError) as put_lost:
                await store.put("p", {"x": [torch.zeros(3)] * 2})
            assert put_lost.value.unit == 1
            assert await store.stats("p") == before
            # a put spanning both units: the live unit's half is rolled back
            key = await store.storage_key("p")
            cells_0 = ray.get(store.units[0].num_cells.remote(key))
            with pytest.raises(StorageUnitLostError):
                await store.put("p", {"x": [torch.zeros(3)] * (2 * ROWS_PER_BLOCK)})
            assert await store.stats("p") == before
            assert ray.get(store.units[0].num_cells.remote(key)) == cells_0
            with pytest.raises(StorageUnitLostError):  # writing into its rows, too
                await store.put("p", {"y": [1, 2]}, rows=[32, 33])
            assert await store.stats("p") == before

        run(go())
    finally:
        store.shutdown()


@ray.remote(num_cpus=0)
class Consumer:
    """A consumer of one task: lease a batch, read it, "train" on it (record its rows), ack.
    With ``stall`` it leases one batch and then hangs, holding the lease (to be killed)."""

    def __init__(self, store: RayDataStore) -> None:
        self.store = store

    async def consume(self, batch: int, lease_s: float, stall: bool = False) -> list[int]:
        trained: list[int] = []
        while True:
            meta = await self.store.get_meta("p", "train", ["x"], batch, lease_s=lease_s)
            if meta.end_of_stream:
                return trained
            data = await self.store.get_data(meta)
            if stall:
                await asyncio.Event().wait()  # mid-batch, forever
            assert data["x"].shape[0] == len(meta.rows)
            trained.extend(meta.rows)  # the step's effect is committed with the ack
            await self.store.ack(meta)


def test_a_killed_consumer_s_rows_go_to_another_none_lost_none_twice(ray_runtime: Any) -> None:
    store = RayDataStore.create(2, start_timeout_s=START_S)
    try:

        async def produce() -> None:
            await store.create_partition("p", ["x"], tasks=["train"])
            await store.put("p", {"x": torch.arange(40, dtype=torch.float32).reshape(20, 2)})
            await store.close("p")

        async def leased() -> int:
            return (await store.stats("p")).leased.get("train", 0)

        run(produce())
        victim = Consumer.remote(store)
        victim_ref = victim.consume.remote(4, 1.0, stall=True)
        deadline = 600  # a safety net of 60 s: a new actor starts slowly on a loaded box
        while run(leased()) == 0 and deadline:  # the victim holds a batch, mid-step
            ray.wait([victim_ref], timeout=0.1)
            deadline -= 1
        assert run(leased()) == 4, "the victim never leased its batch"
        ray.kill(victim, no_restart=True)
        healthy = [Consumer.remote(store) for _ in range(2)]
        trained = ray.get([c.consume.remote(3, 30.0) for c in healthy], timeout=60)
        everything = sorted(r for rows in trained for r in rows)
        assert everything == list(range(20)), "every row trained exactly once"
        s = run(store.stats("p"))
        assert s.consumed["train"] == 20 and s.leased["train"] == 0
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(victim_ref, timeout=10)
    finally:
        store.shutdown()


def test_the_store_works_from_inside_actors_and_by_name(ray_runtime: Any) -> None:
    store = RayDataStore.create(2, name="shared-store-test", start_timeout_s=START_S)
    try:
        again = RayDataStore.connect("shared-store-test")
        assert again.units and len(again.units) == 2

        async def go() -> None:
            await again.create_partition("p", ["x"], tasks=["train"])
            await again.put("p", {"x": [torch.ones(2)] * 5})
            await again.close("p")

        run(go())
        got = ray.get(Consumer.remote(store).consume.remote(2, 30.0), timeout=60)
        assert sorted(got) == [0, 1, 2, 3, 4]
    finally:
        store.shutdown()
    from asyncflow_core.contracts.errors import ConfigError

    with pytest.raises(ConfigError, match="no RayDataStore named 'nope'"):
        RayDataStore.connect("nope")


# --------------------------------------------------------------------------------------------
# The data plane: large shares by reference, small ones by value; the store owns what it holds
# --------------------------------------------------------------------------------------------
WIDE = 8192  # float32 row of 32 KiB: a block of 32 rows is 1 MiB, a by-reference share


def _refs_held(store: RayDataStore, partition: str, rows: list[int], fields: list[str]) -> int:
    """How many object-store references the units answer ``rows`` with (0: all by value)."""
    key = ray.get(store.controller.storage_key.remote(partition))
    n = len(store.units)
    total = 0
    for u, unit in enumerate(store.units):
        mine = [r for r in rows if unit_of(r, n) == u]
        if mine:
            refs, _ = ray.get(unit.read_refs.remote(key, mine, fields))
            total += len(refs)
    return total


def test_large_puts_go_by_reference_small_ones_by_value_and_read_back_exactly(
    shared_store: RayDataStore,
) -> None:
    _reset(shared_store)
    assert BY_REF_MIN_BYTES <= ROWS_PER_BLOCK * WIDE * 4
    n = 2 * ROWS_PER_BLOCK + 16  # three blocks: unit 0, unit 1, unit 0
    lengths = [WIDE + 37 * i for i in range(n)]

    async def go() -> None:
        store = shared_store
        await store.create_partition("p", ["x", "r", "s"], tasks=["t"])
        x = torch.arange(n * WIDE, dtype=torch.float32).reshape(n, WIDE)
        ragged = [torch.full((k,), float(i), dtype=torch.bfloat16) for i, k in enumerate(lengths)]
        text = [f"row {i}" for i in range(n)]
        await store.put("p", {"x": x, "r": ragged, "s": text})
        want = x.clone()
        x.zero_()  # the caller may reuse its buffers at once: the store holds its own bytes
        for t in ragged:
            t.zero_()
        assert _refs_held(store, "p", list(range(n)), ["x", "r"]) == 2  # one share per unit
        # overwrite 3 rows with a small put (by value): reads mix both kinds of rows
        await store.put("p", {"x": torch.full((3, WIDE), -1.0)}, rows=[10, 11, 12], overwrite=True)
        want[10:13] = -1.0
        assert _refs_held(store, "p", [10, 11, 12], ["x"]) == 0
        sel = (79, 0, 11, 33, 64, 12, 5, 40, 10, 63, 32, 31)  # across blocks and units
        got = await store.get_data(BatchMeta("p", "t", sel, ("x", "r", "s")), layout="list")
        for i, r in enumerate(sel):
            assert torch.equal(got["x"][i], want[r]), r
            assert got["r"][i].dtype == torch.bfloat16 and got["r"][i].shape == (lengths[r],)
            assert bool((got["r"][i] == float(r)).all()), r
            assert got["s"][i] == f"row {r}"
        padded = await store.get_data(BatchMeta("p", "t", sel, ("x",)))
        assert torch.equal(padded["x"], want[list(sel)])
        padded["x"].add_(1.0)  # a padded batch is the caller's own memory
        again = await store.get_data(BatchMeta("p", "t", sel, ("x",)))
        assert torch.equal(again["x"], want[list(sel)])

    run(go())


@ray.remote(num_cpus=0)
class Producer:
    def __init__(self, store: RayDataStore) -> None:
        self.store = store

    async def put(self, n: int) -> tuple[int, ...]:
        x = torch.arange(n * WIDE, dtype=torch.float32).reshape(n, WIDE)
        return await self.store.put("p", {"x": x})

    def ping(self) -> bool:
        return True


def _wait_until_dead(actor: Any) -> None:
    """Return once `actor` is dead: `ray.kill` only asks for it, so a call sent just after may
    still run (seen in CI). Each ping answered means not yet; START_S is a safety net."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=START_S)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)  # between polls only: the loop ends on the evidence above
    pytest.fail(f"{actor} still answered pings {START_S} s after ray.kill")


def test_rows_put_by_reference_outlive_the_producer_that_put_them(
    shared_store: RayDataStore,
) -> None:
    """A large put's bytes are in the object store, put there by the producer; the unit holds
    them, so they stay readable after the producer is gone."""
    _reset(shared_store)
    n = 2 * ROWS_PER_BLOCK
    run(shared_store.create_partition("p", ["x"], tasks=["t"]))
    producer = Producer.remote(shared_store)
    assert ray.get(producer.put.remote(n), timeout=START_S) == tuple(range(n))  # starts it
    assert _refs_held(shared_store, "p", list(range(n)), ["x"]) == 2
    ray.kill(producer, no_restart=True)
    _wait_until_dead(producer)
    got = run(shared_store.get_data(BatchMeta("p", "t", tuple(range(n)), ("x",))))
    want = torch.arange(n * WIDE, dtype=torch.float32).reshape(n, WIDE)
    assert torch.equal(got["x"], want)


class _LosesObjects(RayDataStore):
    """A client for which every object-store reference is lost (as when the node holding a
    share's primary copy is gone)."""

    async def _map(self, refs: Any) -> Any:
        raise ray.exceptions.OwnerDiedError("00" * 28, "", "")


def test_a_read_whose_objects_are_lost_falls_back_to_the_unit_s_copy(
    shared_store: RayDataStore,
) -> None:
    _reset(shared_store)
    n = 2 * ROWS_PER_BLOCK
    want = torch.arange(n * WIDE, dtype=torch.float32).reshape(n, WIDE)

    async def go() -> None:
        await shared_store.create_partition("p", ["x", "s"], tasks=["t"])
        await shared_store.put("p", {"x": want.clone(), "s": [str(i) for i in range(n)]})
        assert _refs_held(shared_store, "p", list(range(n)), ["x"]) == 2
        lossy = _LosesObjects(shared_store.controller, shared_store.units)
        sel = tuple(range(n - 1, -1, -3))
        got = await lossy.get_data(BatchMeta("p", "t", sel, ("x", "s")))
        assert torch.equal(got["x"], want[list(sel)])
        assert got["s"] == [str(r) for r in sel]

    run(go())


def test_a_lease_s_own_check_does_not_outlive_its_partition_or_its_ack(
    shared_store: RayDataStore,
) -> None:
    """``get_data`` trusts the readability check made with a fresh lease; once the partition
    is deleted or the lease acked, it answers as the controller does, never with stale
    values."""
    _reset(shared_store)

    async def go() -> None:
        store = shared_store
        await store.create_partition("p", ["x"], tasks=["t"])
        await store.put("p", {"x": torch.arange(4, dtype=torch.float32).reshape(2, 2)})
        meta = await store.get_meta("p", "t", ["x"], 2, timeout=10)
        assert (await store.get_data(meta))["x"].tolist() == [[0.0, 1.0], [2.0, 3.0]]
        await store.ack(meta)
        with pytest.raises(AsyncFlowError) as after_ack:
            await store.get_data(meta)
        await store.create_partition("q", ["x"], tasks=["t"])
        await store.put("q", {"x": torch.ones(2, 2)})
        meta_q = await store.get_meta("q", "t", ["x"], 2, timeout=10)
        await store.delete_partition("q")
        with pytest.raises(AsyncFlowError) as after_delete:
            await store.get_data(meta_q)
        return after_ack.value, after_delete.value

    after_ack, after_delete = run(go())
    assert isinstance(after_ack, UnknownRowError) and "no live rows [0, 1]" in str(after_ack)
    assert isinstance(after_delete, UnknownPartitionError), after_delete


def test_rows_per_block_routes_rows_and_travels_with_the_store(ray_runtime: Any) -> None:
    from asyncflow_core.contracts.errors import BadRequestError

    for bad in (0, -1, 2.0, True):
        with pytest.raises(BadRequestError, match="rows_per_block"):
            RayDataStore.create(2, rows_per_block=bad)  # type: ignore[arg-type]
    store = RayDataStore.create(2, rows_per_block=1, name="block-test", start_timeout_s=START_S)
    try:
        assert RayDataStore.connect("block-test").rows_per_block == 1

        async def go() -> None:
            await store.create_partition("p", ["x"], tasks=["t"])
            await store.put("p", {"x": torch.arange(12, dtype=torch.float32).reshape(6, 2)})
            key = await store.storage_key("p")
            assert ray.get([u.num_cells.remote(key) for u in store.units]) == [3, 3]
            got = await store.get_data(BatchMeta("p", "t", (5, 0, 3), ("x",)))
            assert got["x"][:, 0].tolist() == [10.0, 0.0, 6.0]

        run(go())
    finally:
        store.shutdown()


# --------------------------------------------------------------------------------------------
# The folded ack on the two-step lease (a sampler that runs in the caller: peek carries it)
# --------------------------------------------------------------------------------------------
class _CallerSampler:
    """Sequential, but not ``stateless``: the Ray store runs it in the caller (peek, then
    lease_selected)."""

    def select(self, candidates: Any, request: Any) -> Any:
        from asyncflow_core.data.scheduling import SequentialSampler

        return SequentialSampler().select(candidates, request)


def test_a_caller_run_sampler_folds_the_ack_into_its_first_request(
    shared_store: RayDataStore,
) -> None:
    from asyncflow_core.contracts.errors import LeaseError, UnknownFieldError

    _reset(shared_store)
    store = shared_store

    async def go() -> None:
        await store.create_partition("p", ["x"], tasks=["t"])
        await store.put("p", {"x": [0, 1, 2, 3, 4]})
        sampler = _CallerSampler()
        first = await store.get_meta("p", "t", ["x"], 2, sampler=sampler, timeout=5)
        # a rejected request commits nothing
        with pytest.raises(UnknownFieldError):
            await store.get_meta("p", "t", ["zz"], 2, sampler=sampler, timeout=0, ack=first)
        assert dict((await store.stats("p")).consumed) == {"t": 0}
        second = await store.get_meta("p", "t", ["x"], 2, sampler=sampler, timeout=5, ack=first)
        assert (first.rows, second.rows) == ((0, 1), (2, 3))
        assert dict((await store.stats("p")).consumed) == {"t": 2}
        with pytest.raises(LeaseError):  # committed once
            await store.get_meta("p", "t", ["x"], 1, sampler=sampler, timeout=0, ack=first)
        assert dict((await store.stats("p")).leased) == {"t": 2}
        await store.close("p")
        last = await store.get_meta("p", "t", ["x"], 2, sampler=sampler, timeout=5, ack=second)
        end = await store.get_meta("p", "t", ["x"], 2, sampler=sampler, timeout=5, ack=last)
        assert last.rows == (4,) and end.end_of_stream
        assert dict((await store.stats("p")).consumed) == {"t": 5}

    run(go())
