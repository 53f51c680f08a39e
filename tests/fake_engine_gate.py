"""The request gate the tests' hand-written inference engines share: in-flight ids, abort,
pause (abort/keep), resume, sleep/wake-up, progress (``wait_for_tokens``), and a wait that
holds a request while the engine is paused or asleep. Not a test module (no ``test_``
prefix); tests import it by name, as pytest puts this folder on ``sys.path``."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Literal

from asyncflow_core.contracts.errors import EngineError
from asyncflow_core.contracts.protocols import Version


class RequestGate:
    """Engine state and controls; a subclass implements ``generate`` (adding its request id to
    ``_inflight`` while it runs, calling ``_wait_runnable`` between tokens, ``_made`` after
    each token and ``_ended`` when it returns, and returning an abort result once the id is in
    ``_aborted``) and ``load_weights``."""

    def __init__(self) -> None:
        self._version: Version = 0
        self._paused = False
        self._asleep = False
        self._inflight: set[str] = set()
        self._aborted: set[str] = set()
        self._changed: asyncio.Event | None = None
        self._counts: dict[str, int] = {}
        self._watchers: dict[str, list[tuple[int, asyncio.Future[int]]]] = {}

    @property
    def weight_version(self) -> Version:
        return self._version

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
        self._changed = None

    async def _wait_runnable(self, rid: str) -> None:
        while (self._paused or self._asleep) and rid not in self._aborted:
            if self._changed is None:
                self._changed = asyncio.Event()
            await self._changed.wait()

    def _made(self, rid: str, count: int) -> None:
        """Request ``rid`` has ``count`` tokens: wake the watchers that wanted as many (they
        run before the next token, which comes after an await)."""
        self._counts[rid] = count
        keep = []
        for want, future in self._watchers.get(rid, []):
            if count >= want and not future.done():
                future.set_result(count)
            elif not future.done():
                keep.append((want, future))
        self._watchers[rid] = keep

    def _ended(self, rid: str) -> None:
        count = self._counts.pop(rid, 0)
        for _, future in self._watchers.pop(rid, []):
            if not future.done():
                future.set_result(count)

    async def wait_for_tokens(self, request_id: str, count: int) -> int:
        if request_id not in self._inflight:
            raise EngineError(f"request {request_id!r} is not in flight")
        have = self._counts.get(request_id, 0)
        if have >= count:
            return have
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._watchers.setdefault(request_id, []).append((count, future))
        return await future

    async def abort(self, request_ids: Sequence[str]) -> None:
        self._aborted.update(set(request_ids) & self._inflight)
        self._notify()

    async def pause(self, mode: Literal["abort", "keep"] = "abort") -> None:
        self._paused = True
        if mode == "abort":
            self._aborted.update(self._inflight)
        self._notify()

    async def resume(self) -> None:
        self._paused = False
        self._notify()

    async def sleep(self, level: int = 1) -> None:
        self._asleep = True

    async def wake_up(self) -> None:
        self._asleep = False
        self._notify()
