"""The virtual-clock event loop: simulated seconds pass instantly, timers fire in order,
threads take zero virtual time, and a deadlock is reported instead of hanging."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from asyncflow_core.data.store import InProcessDataStore
from asyncflow_core.flow.vclock import SimulationDeadlockError, is_virtual, run_virtual


def test_a_day_of_sleeps_takes_no_real_time_and_timers_fire_in_order() -> None:
    order: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(seconds)
        order.append((name, loop.time()))

    async def main() -> float:
        assert is_virtual()
        await asyncio.gather(sleeper("c", 86400.0), sleeper("a", 1.5), sleeper("b", 3600.0))
        return asyncio.get_running_loop().time()

    t0 = time.perf_counter()
    end = run_virtual(main(), start=100.0)
    assert time.perf_counter() - t0 < 2.0
    assert end == pytest.approx(100.0 + 86400.0)
    assert order == [("a", 101.5), ("b", 3700.0), ("c", 86500.0)]


def test_timeouts_are_virtual() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.sleep(1000.0), timeout=7.0)
        return loop.time()

    assert run_virtual(main()) == pytest.approx(7.0)


def test_threads_take_zero_virtual_time() -> None:
    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        sleeper = asyncio.create_task(asyncio.sleep(0.01))  # a timer due very soon
        await asyncio.to_thread(time.sleep, 0.2)  # real work in a thread
        during = loop.time()
        await sleeper
        return during, loop.time()

    during, after = run_virtual(main())
    assert during == 0.0  # the clock waited for the thread instead of jumping to the timer
    assert after == pytest.approx(0.01)


def test_a_foreign_threads_callback_wakes_a_waiting_loop() -> None:
    """A thread the loop did not start (no ``run_in_executor``) hands a result back with
    ``call_soon_threadsafe`` while nothing else is scheduled: the loop sleeps in its selector
    on its own wake-up pipe, which the virtual selector no longer polls when it need not."""

    async def main() -> tuple[str, float]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[str] = loop.create_future()
        started = threading.Event()

        def work() -> None:
            started.wait()
            loop.call_soon_threadsafe(done.set_result, "from the thread")

        thread = threading.Thread(target=work)
        thread.start()
        loop.call_soon(started.set)  # the thread answers only once the loop waits on it
        result = await done
        thread.join()
        return result, loop.time()

    assert run_virtual(main()) == ("from the thread", 0.0)


def test_a_socket_is_still_polled_while_timers_are_due() -> None:
    """With a socket registered, bytes already sent are read before the clock jumps to a
    far timer (a selector that skipped its polls would time out at virtual t = 1000)."""

    async def main() -> tuple[bytes, float]:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        try:
            reader, writer = await asyncio.open_connection(sock=a)
            b.sendall(b"ping")
            data = await asyncio.wait_for(reader.readexactly(4), timeout=1000.0)
            writer.close()
            return data, loop.time()
        finally:
            b.close()

    assert run_virtual(main()) == (b"ping", 0.0)


def test_store_waits_time_out_on_the_virtual_clock() -> None:
    async def main() -> float:
        store = InProcessDataStore()
        await store.create_partition("p", ["x"], tasks=["t"])
        from asyncflow_core.contracts.errors import StoreTimeoutError

        with pytest.raises(StoreTimeoutError):
            await store.get_meta("p", "t", ["x"], 1, timeout=120.0)
        return asyncio.get_running_loop().time()

    t0 = time.perf_counter()
    assert run_virtual(main()) == pytest.approx(120.0)
    assert time.perf_counter() - t0 < 2.0


def test_a_deadlock_is_reported_not_hung() -> None:
    async def main() -> None:
        await asyncio.get_running_loop().create_future()  # nothing will ever resolve it

    t0 = time.perf_counter()
    with pytest.raises(SimulationDeadlockError, match="deadlock"):
        run_virtual(main(), deadlock_timeout=0.3)
    assert time.perf_counter() - t0 < 3.0


def test_the_default_loop_is_not_virtual() -> None:
    async def main() -> bool:
        return is_virtual()

    assert asyncio.run(main()) is False
