"""The DataStore conformance suite on the in-process store: one and three storage units (rows
sharded differently) and once with defensive copies on put (``copy_on_put=True``)."""

from __future__ import annotations

from typing import ClassVar

import pytest
from asyncflow_conformance import DataStoreConformance, FakeClock, StoreFactory

from asyncflow_core.contracts.protocols import CellValue, DataStore
from asyncflow_core.data.store import InProcessDataStore


class _InProcess(DataStoreConformance):
    supports_fake_clock = True
    supports_direct_read = True
    supports_virtual_clock = True  # timeouts on the running loop's clock (store.loop_clock)
    num_storage_units: ClassVar[int] = 2
    copy_on_put: ClassVar[bool] = False  # the store's default

    @pytest.fixture
    def store_factory(self) -> StoreFactory:
        def build(clock: FakeClock | None = None) -> InProcessDataStore:
            if clock is None:
                return InProcessDataStore(self.num_storage_units, copy_on_put=self.copy_on_put)
            return InProcessDataStore(
                self.num_storage_units, copy_on_put=self.copy_on_put, clock=clock
            )

        return build

    def direct_read(self, store: DataStore, partition: str, row: int, field: str) -> CellValue:
        assert isinstance(store, InProcessDataStore)
        unit = store.units[row % len(store.units)]
        return unit.read(store.storage_key(partition), [row], [field])[field][0]


class TestInProcessOneUnit(_InProcess):
    backend_name = "InProcessDataStore(num_storage_units=1)"
    num_storage_units = 1


class TestInProcessThreeUnits(_InProcess):
    backend_name = "InProcessDataStore(num_storage_units=3)"
    num_storage_units = 3


class TestInProcessCopyOnPut(_InProcess):
    backend_name = "InProcessDataStore(copy_on_put=True)"
    copy_on_put = True
