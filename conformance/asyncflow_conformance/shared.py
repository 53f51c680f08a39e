"""One engine shared by every law of a suite: for engines too slow to start for each law
(a real vLLM takes a minute or two), which the suites otherwise build fresh every time.

Each law runs on an event loop of its own (``run_law``), but an engine such as vLLM's
``AsyncLLM`` belongs to the loop it was made on. ``EngineHost`` makes the engine once, on a
loop of its own in a daemon thread, and hands each law a proxy (``host.proxy()``) whose
coroutine methods run on the engine's loop and are awaited from the law's; plain attributes
and properties are read through. Cancelling a call in the law cancels it on the engine's loop.
The proxy passes ``isinstance`` checks of the runtime protocols exactly as the engine does
(an attribute the engine lacks, the proxy lacks). Usage::

    HOST = EngineHost(lambda: VLLMEngine.create(MODEL), name="vllm")  # starts it

    class TestMyEngine(InferenceEngineConformance):
        def make_engine(self):
            return HOST.proxy()

        async def close_engine(self, engine):
            await reset(engine)  # e.g. resume it if a failed law left it paused

    # at the end of the session: HOST.close()

State carries over from law to law (the weight version, loaded weights), so a shared engine
checks the laws that hold whatever came before; a law that must start from a fresh engine
needs one of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class EngineHost(Generic[T]):
    """Makes ``make()`` (an engine, or an awaitable of one) on an event loop of its own in a
    daemon thread, waiting up to ``timeout_s`` for it; ``proxy()`` hands it to any loop."""

    def __init__(
        self, make: Callable[[], T | Awaitable[T]], *, name: str = "engine", timeout_s: float = 900
    ) -> None:
        self.name = name
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name=f"asyncflow-engine-host: {name}", daemon=True
        )
        self._thread.start()

        async def build() -> T:
            made = make()
            if inspect.isawaitable(made):
                return await made  # type: ignore[no-any-return]
            return made

        try:
            self.engine: T = self.run(build(), timeout_s=timeout_s)
        except BaseException:
            self._stop()
            raise
        self._closed = False

    def run(self, coroutine: Awaitable[Any], *, timeout_s: float | None = None) -> Any:
        """Run ``coroutine`` on the engine's loop and wait for it here (not from a coroutine
        on that loop)."""
        future = asyncio.run_coroutine_threadsafe(_awaited(coroutine), self.loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"{self.name}: no answer within {timeout_s} s") from None

    def proxy(self) -> Any:
        """An object that stands for the engine on any event loop."""
        return _Proxy(self)

    def close(self, how: Callable[[T], Awaitable[Any]] | None = None) -> None:
        """Close the engine (``how(engine)``, default its ``close()``) and stop the loop."""
        if self._closed:
            return
        self._closed = True
        try:
            if how is not None:
                self.run(how(self.engine), timeout_s=120)
            else:
                close = getattr(self.engine, "close", None)
                if callable(close):
                    result = close()
                    if inspect.isawaitable(result):
                        self.run(result, timeout_s=120)
        finally:
            self._stop()

    def _stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)


async def _awaited(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


class _Proxy:
    """The engine of an ``EngineHost``, seen from another event loop."""

    def __init__(self, host: EngineHost[Any]) -> None:
        object.__setattr__(self, "_host", host)

    def __getattr__(self, name: str) -> Any:
        host: EngineHost[Any] = object.__getattribute__(self, "_host")
        value = getattr(host.engine, name)
        if inspect.isasyncgenfunction(value):
            raise AttributeError(f"{name}: async generators are not proxied")
        if inspect.iscoroutinefunction(value):

            async def call(*args: Any, **kwargs: Any) -> Any:
                future = asyncio.run_coroutine_threadsafe(value(*args, **kwargs), host.loop)
                return await asyncio.wrap_future(future)

            call.__name__ = name
            return call
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_host").engine, name, value)

    def __repr__(self) -> str:
        host: EngineHost[Any] = object.__getattribute__(self, "_host")
        return f"<proxy of {host.engine!r} on its own loop>"


__all__ = ["EngineHost"]
