"""Run the AsyncFlow conformance suite on the example backend:

pytest -p asyncflow_conformance examples/conformance --asyncflow-profile asyncflow-smoke
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from asyncflow_conformance import DataStoreConformance
from my_store import make_store


class TestTimedStore(DataStoreConformance):
    backend_name = "TimedStore(InProcessDataStore)"
    supports_fake_clock = True  # make_store(clock=...) reads lease deadlines from the clock
    supports_virtual_clock = True  # its waits follow the event loop's clock

    @pytest.fixture
    def store_factory(self) -> Callable[..., object]:
        return make_store
