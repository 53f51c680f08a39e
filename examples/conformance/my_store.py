"""An example backend for the conformance guide: a DataStore that wraps another one and
records how long each call took (what an infra engineer adds before putting a store in
production). A wrapper must keep every law of the contract, which is what the suite checks."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from asyncflow_core import DataStore, InProcessDataStore


class TimedStore:
    """Forwards every DataStore call to ``inner`` and keeps per-method latencies (seconds)."""

    def __init__(self, inner: DataStore) -> None:
        self._inner = inner
        self.latencies: dict[str, list[float]] = defaultdict(list)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._inner, name)

        async def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await method(*args, **kwargs)
            finally:
                self.latencies[name].append(time.perf_counter() - t0)

        return timed


def make_store(clock: Callable[[], float] | None = None) -> TimedStore:
    inner = InProcessDataStore(2) if clock is None else InProcessDataStore(2, clock=clock)
    return TimedStore(inner)
