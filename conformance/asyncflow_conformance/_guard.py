"""Running a law's coroutine on a fresh event loop in a watched daemon thread, so a hung engine
or job fails the test instead of hanging the test run (shared by every suite)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from asyncflow_core.flow.vclock import VirtualClockLoop

CANCEL_GRACE_S = 10.0
"""Real seconds a cancelled run gets to stop before it counts as stuck."""


@dataclass
class _Box:
    loop: asyncio.AbstractEventLoop | None = None
    main: asyncio.Task[Any] | None = None
    error: BaseException | None = None


@dataclass(frozen=True)
class Guarded:
    """How a guarded run ended: the exception that escaped the loop (None: returned),
    whether the real-time limit ran out (the main task was then cancelled), whether it was
    still running ``CANCEL_GRACE_S`` after that, and the thread it ran in."""

    error: BaseException | None
    timed_out: bool
    stuck: bool
    thread: threading.Thread


def run_on_fresh_loop(
    make_main: Callable[[], Coroutine[Any, Any, None]],
    *,
    name: str,
    virtual_clock: bool,
    real_timeout_s: float,
    deadlock_timeout_s: float,
) -> Guarded:
    """Run ``make_main()`` on a new loop (a ``VirtualClockLoop`` if ``virtual_clock``) in a
    daemon thread named ``name``; past ``real_timeout_s`` real seconds cancel its main task."""
    box = _Box()

    def target() -> None:
        def factory() -> asyncio.AbstractEventLoop:
            if virtual_clock:
                return VirtualClockLoop(deadlock_timeout=deadlock_timeout_s)
            return asyncio.new_event_loop()

        async def main() -> None:
            box.main = asyncio.current_task()
            await make_main()

        try:
            with asyncio.Runner(loop_factory=factory) as runner:
                box.loop = runner.get_loop()
                runner.run(main())
        except BaseException as exc:  # handed to the calling thread
            box.error = exc

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join(real_timeout_s)
    timed_out = thread.is_alive()
    if timed_out:
        loop, main = box.loop, box.main
        if loop is not None and main is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(main.cancel)
        thread.join(CANCEL_GRACE_S)
    return Guarded(box.error, timed_out, thread.is_alive(), thread)
