"""Weight-sync strategies: when the inference side swaps. ``BlockingUpdate`` pauses the
engines for the whole transfer; ``StagedUpdate`` (the paper's delayed update) transfers into a
``HostBuffer`` while they keep generating and exposes only the swap at the next safe point.
Both move the bytes with a transport (``asyncflow_core.sync.transports``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from asyncflow_core.contracts.protocols import (
    SupportsLoadWeights,
    SupportsPause,
    Version,
    WeightBucket,
    WeightSync,
)
from asyncflow_core.sync.transports import (
    InProcessWeightSync,
    Weights,
    bucketize,
    close_transport,
    load_all,
)


@dataclass(frozen=True, slots=True)
class SyncTiming:
    """Where a sync's time went: ``transfer_s`` moving buckets, ``swap_s`` loading them into
    the engines, ``exposed_s`` the part during which the engines could not generate."""

    version: Version
    transfer_s: float
    swap_s: float
    exposed_s: float

    @property
    def hidden_s(self) -> float:
        return self.transfer_s + self.swap_s - self.exposed_s


class HostBuffer:
    """A host-side staging target: keeps the latest complete set of weights a transport
    delivered until ``take()`` hands it over (an older, untaken set is replaced)."""

    def __init__(self) -> None:
        self._pending: tuple[Weights, Version] | None = None

    async def load_weights(
        self, weights: Sequence[tuple[str, torch.Tensor]], version: Version
    ) -> None:
        self._pending = (list(weights), version)

    @property
    def pending_version(self) -> Version | None:
        return None if self._pending is None else self._pending[1]

    def take(self) -> tuple[Weights, Version] | None:
        pending, self._pending = self._pending, None
        return pending


Buckets = Iterable[WeightBucket] | AsyncIterable[WeightBucket]


async def _send(transport: WeightSync, buckets: Buckets, version: Version) -> None:
    await transport.start()
    if isinstance(buckets, AsyncIterable):
        async for bucket in buckets:
            await transport.update(bucket)
    else:
        for bucket in buckets:
            await transport.update(bucket)
    await transport.finish(version)


class BlockingUpdate:
    """Pause every engine (``SupportsPause``, mode ``pause_mode``), move the weights straight
    into them, resume: the whole sync is exposed. The baseline the staged update beats."""

    def __init__(
        self,
        engines: Sequence[SupportsLoadWeights],
        make_transport: Callable[[Sequence[SupportsLoadWeights]], WeightSync] = InProcessWeightSync,
        pause_mode: Literal["abort", "keep"] = "keep",
    ) -> None:
        self.engines = list(engines)
        self.transport = make_transport(self.engines)
        self.pause_mode = pause_mode
        self._ready = False

    async def sync(self, buckets: Buckets, version: Version) -> SyncTiming:
        if not self._ready:
            await self.transport.init()
            self._ready = True
        t0 = _loop_time()
        try:  # a pause cut short (cancelled, failed) still resumes every engine
            await _pause(self.engines, self.pause_mode)
            await _send(self.transport, buckets, version)
        finally:
            await _resume(self.engines)
        total = _loop_time() - t0
        return SyncTiming(version, transfer_s=total, swap_s=0.0, exposed_s=total)


class StagedUpdate:
    """AsyncFlow's delayed parameter update. ``sync`` moves the buckets into a ``HostBuffer``
    while the engines keep generating with the old weights (hidden); ``apply`` — called by the
    rollout loop at its next safe point, e.g. between batches — pauses the engines just long
    enough to load the staged weights (exposed), then resumes them. ``apply`` with nothing
    staged returns None at once.

    The swap hands the engines tensors (``load_weights``) unless ``swap_with`` is given: then
    it sends the staged weights (in buckets of ``swap_bucket_bytes``) through
    ``swap_with(engines)``, a transport built at the first swap and kept until the engines
    change — the engine's own channel (``transports.engine_transport``: a weight group) for
    engines that take no tensors."""

    def __init__(
        self,
        engines: Sequence[SupportsLoadWeights],
        make_transport: Callable[[Sequence[SupportsLoadWeights]], WeightSync] = InProcessWeightSync,
        pause_mode: Literal["abort", "keep"] = "keep",
        *,
        swap_with: Callable[[Sequence[SupportsLoadWeights]], WeightSync] | None = None,
        swap_bucket_bytes: int = 256 << 20,
    ) -> None:
        self.engines = list(engines)
        self.buffer = HostBuffer()
        self.transport = make_transport([self.buffer])
        self.pause_mode = pause_mode
        self.swap_with = swap_with
        self.swap_bucket_bytes = int(swap_bucket_bytes)
        self._swap: tuple[list[int], WeightSync] | None = None  # (ids of engines, transport)
        self._ready = False
        self._transfer_s: dict[Version, float] = {}
        self._lock: asyncio.Lock | None = None  # one swap at a time (made on the loop)

    @property
    def pending_version(self) -> Version | None:
        return self.buffer.pending_version

    async def sync(self, buckets: Buckets, version: Version) -> float:
        """Stage ``version``; returns the transfer seconds (hidden from generation)."""
        if not self._ready:
            await self.transport.init()
            self._ready = True
        t0 = _loop_time()
        await _send(self.transport, buckets, version)
        self._transfer_s[version] = _loop_time() - t0
        return self._transfer_s[version]

    async def apply(self) -> SyncTiming | None:
        """Load the newest staged version into the engines (paused meanwhile) and return its
        timing; None if nothing is staged. Callers at concurrent safe points take turns: a
        second caller waits for the first swap to end, then applies what is staged by then
        (so the engines load versions in order, and never resume while another swap is
        loading)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            return await self._apply_staged()

    async def _apply_staged(self) -> SyncTiming | None:
        staged = self.buffer.take()
        if staged is None:
            return None
        weights, version = staged
        t0 = _loop_time()
        try:  # a pause cut short (the job stopping mid-swap) still resumes every engine
            await _pause(self.engines, self.pause_mode)
            if self.swap_with is None:
                await load_all(self.engines, weights, version)
            else:
                transport = await self._swap_transport()
                await _send(transport, bucketize(weights, self.swap_bucket_bytes), version)
        finally:
            await _resume(self.engines)
        swap = _loop_time() - t0
        transfer = self._transfer_s.pop(version, 0.0)
        self._transfer_s = {v: s for v, s in self._transfer_s.items() if v > version}
        return SyncTiming(version, transfer_s=transfer, swap_s=swap, exposed_s=swap)

    async def _swap_transport(self) -> WeightSync:
        """The swap's transport over the current engines (rebuilt, the old one closed, when
        they changed: an engine lost or back)."""
        ids = [id(e) for e in self.engines]
        if self._swap is not None and self._swap[0] == ids:
            return self._swap[1]
        await self.close()
        assert self.swap_with is not None
        transport = self.swap_with(self.engines)
        try:
            await transport.init()
        except BaseException:
            await close_transport(transport)
            raise
        self._swap = (ids, transport)
        return transport

    async def close(self) -> None:
        """Close the swap's transport (its weight group), if one was built. Safe to repeat."""
        swap, self._swap = self._swap, None
        if swap is not None:
            await close_transport(swap[1])


async def _pause(engines: Sequence[object], mode: Literal["abort", "keep"]) -> None:
    for engine in engines:
        if isinstance(engine, SupportsPause):
            await engine.pause(mode)


async def _resume(engines: Sequence[object]) -> None:
    for engine in engines:
        if isinstance(engine, SupportsPause):
            await engine.resume()


def _loop_time() -> float:
    """Seconds on the running loop's clock (virtual when simulated)."""
    return asyncio.get_running_loop().time()
