"""Wake-ups across event loops and threads: a coroutine arms a waiter, re-checks its condition,
then waits; ``wake_all()`` from any thread resolves every armed waiter. Arming before the
re-check is what makes a wake-up between the check and the wait impossible to miss."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator


class Waiter:
    """One armed wait, bound to the event loop that armed it."""

    __slots__ = ("future", "loop")

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.future: asyncio.Future[None] = self.loop.create_future()

    async def wait(self, timeout: float | None) -> None:
        """Until woken or ``timeout`` seconds (None: no limit); never raises on timeout."""
        await asyncio.wait([self.future], timeout=timeout)


class Waiters:
    """The set of armed waiters of one piece of shared state."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: list[Waiter] = []

    @contextlib.contextmanager
    def arm(self) -> Iterator[Waiter]:
        waiter = Waiter()
        with self._lock:
            self._armed.append(waiter)
        try:
            yield waiter
        finally:
            with self._lock:
                if waiter in self._armed:
                    self._armed.remove(waiter)

    def wake_all(self) -> None:
        with self._lock:
            armed, self._armed = self._armed, []
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        for waiter in armed:
            if waiter.loop is here:  # same loop and thread: no self-pipe write needed
                here.call_soon(_resolve, waiter.future)
                continue
            # a closed loop raises RuntimeError: nobody is waiting there any more
            with contextlib.suppress(RuntimeError):
                waiter.loop.call_soon_threadsafe(_resolve, waiter.future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
