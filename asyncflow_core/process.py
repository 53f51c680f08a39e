"""A ``TrainEngine`` hosted in its own child process: ``ProcessTrainEngine``.

Why: Python threads share one interpreter lock. An in-process trainer issues thousands of
small torch ops per step, and every op gives the lock up and must win it back from the event
loop (the store, the workflow) and the rollout engine's thread; measured on the 2-core box, a
train step that takes 41 ms of CPU took 81 ms of wall time that way. In a child process the
trainer has an interpreter of its own.

The child builds the engine from ``factory`` (a picklable zero-argument callable, e.g.
``functools.partial(TorchTrainEngine, model, lr=1e-3, threads=1)``) and serves the
``TrainEngine`` calls one message each over a pipe; ``export_weights`` streams its buckets.
Messages are pickled with the standard pickler (tensors are copied, not shared), between two
processes of the same program: nothing is read from a socket or a peer we did not start.

The default path of an AsyncFlow job stays in one process (so ``breakpoint()`` works); this is
opt-in, for throughput.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import pickle
import threading
import traceback
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch

from asyncflow_core.errors import ConfigError, EngineError
from asyncflow_core.protocols import Batch, LossFn, TrainEngine, TrainMetrics, Version, WeightBucket

DEFAULT_START_TIMEOUT_S = 300.0
_STOP = "__stop__"

# child -> parent message kinds
_OK, _ERR, _ITEM, _END, _READY = "ok", "err", "item", "end", "ready"


def _dumps(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _portable(exc: BaseException, where: str) -> BaseException:
    """``exc`` with the child's traceback as a note, or an ``EngineError`` carrying its text
    when the exception itself does not pickle."""
    tb = "".join(traceback.format_exception(exc))
    try:
        exc.add_note(f"(raised in {where}; its traceback follows)\n{tb}")
        pickle.loads(_dumps(exc))
        return exc
    except Exception:
        return EngineError(f"{type(exc).__name__}: {exc} (raised in {where})\n{tb}")


# --------------------------------------------------------------------------------------------
# The child
# --------------------------------------------------------------------------------------------
def _child_main(
    conn: Connection, factory: Callable[[], Any], threads: int | None, name: str
) -> None:
    if threads is not None:
        torch.set_num_threads(threads)
    asyncio.run(_serve(conn, factory, name))


async def _serve(conn: Connection, factory: Callable[[], Any], name: str) -> None:
    loop = asyncio.get_running_loop()
    where = f"engine process {name!r}"
    send_lock = threading.Lock()

    def send(msg: tuple[Any, ...]) -> None:
        data = _dumps(msg)
        with send_lock:
            conn.send_bytes(data)

    try:
        engine = factory()
        if asyncio.iscoroutine(engine):
            engine = await engine
    except BaseException as e:  # the parent re-raises it from the constructor
        send((0, _ERR, _portable(e, where), None))
        return
    send((0, _READY, type(engine).__name__, engine.weight_version))

    inbox: asyncio.Queue[tuple[Any, ...] | None] = asyncio.Queue()

    def read() -> None:
        while True:
            try:
                msg = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):  # the parent is gone: stop
                loop.call_soon_threadsafe(inbox.put_nowait, None)
                return
            loop.call_soon_threadsafe(inbox.put_nowait, msg)
            if msg[1] == _STOP:
                return

    threading.Thread(target=read, name=f"{name}-reader", daemon=True).start()

    async def handle(call_id: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            if method == "export_weights":
                async for bucket in engine.export_weights(*args):
                    send((call_id, _ITEM, bucket, None))
                send((call_id, _END, None, engine.weight_version))
                return
            result = await getattr(engine, method)(*args)
            send((call_id, _OK, result, engine.weight_version))
        except Exception as e:
            send((call_id, _ERR, _portable(e, where), engine.weight_version))

    tasks: set[asyncio.Task[None]] = set()
    while True:
        msg = await inbox.get()
        if msg is None:
            break
        call_id, method, args = msg
        if method == _STOP:
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            close = getattr(engine, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()
            send((call_id, _OK, None, engine.weight_version))
            break
        task = asyncio.create_task(handle(call_id, method, args))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


# --------------------------------------------------------------------------------------------
# The parent's proxy
# --------------------------------------------------------------------------------------------
class _Call:
    """One outstanding call: a future (one reply) or a queue (a stream of buckets)."""

    __slots__ = ("future", "loop", "queue")

    def __init__(self, stream: bool) -> None:
        self.loop = asyncio.get_running_loop()
        self.future: asyncio.Future[Any] | None = None if stream else self.loop.create_future()
        self.queue: asyncio.Queue[tuple[str, Any]] | None = asyncio.Queue() if stream else None

    def deliver(self, kind: str, payload: Any) -> None:
        if self.queue is not None:
            self.queue.put_nowait((kind, payload))
        elif self.future is not None and not self.future.done():
            if kind == _ERR:
                self.future.set_exception(payload)
            else:
                self.future.set_result(payload)


class ProcessTrainEngine:
    """A ``TrainEngine`` whose engine lives in a child process (see the module docstring).

    ``factory``: a picklable zero-argument callable run in the child that returns the engine
    (or an awaitable of it). ``threads``: ``torch.set_num_threads`` in the child before the
    factory runs (None: torch's default, every core). ``start_method``: ``forkserver`` where
    the platform has it (a fresh interpreter forked per engine: torch is imported once), else
    ``spawn``. The constructor waits for the engine to be built (``start_timeout_s``) and
    raises the child's error if the factory failed. Arguments of every call (batch, loss
    function) must pickle: a lambda loss function is refused with an error saying so.
    ``close()`` closes the child's engine and ends the process.
    """

    def __init__(
        self,
        factory: Callable[[], Any],
        *,
        threads: int | None = None,
        name: str = "trainer",
        start_method: str | None = None,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    ) -> None:
        if not callable(factory):
            raise ConfigError(f"ProcessTrainEngine: factory must be callable, got {factory!r}")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                    or threads < 1):  # fmt: skip
            raise ConfigError(f"ProcessTrainEngine: threads must be None or >= 1, got {threads!r}")
        methods = multiprocessing.get_all_start_methods()
        method = start_method or ("forkserver" if "forkserver" in methods else "spawn")
        if method not in methods:
            raise ConfigError(
                f"ProcessTrainEngine: start_method {method!r} is not available here; "
                f"choose one of {methods}"
            )
        try:
            _dumps(factory)
        except Exception as e:
            raise ConfigError(
                f"ProcessTrainEngine: the factory {factory!r} cannot be pickled to reach the "
                f"engine process ({type(e).__name__}: {e}); use a module-level function or "
                "functools.partial of a class with picklable arguments"
            ) from e
        self.name = name
        self._version: Version = 0
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False
        self._dead: str | None = None
        ctx: Any = multiprocessing.get_context(method)  # typeshed's BaseContext lacks Process
        if method == "forkserver":  # the server imports these once; each engine forks from it
            home = getattr(getattr(factory, "func", factory), "__module__", None)
            preload = ["torch", "torch.optim", "torch._dynamo", "asyncflow_core.process"]
            ctx.set_forkserver_preload(preload + ([home] if home and home != "__main__" else []))
        parent, child = ctx.Pipe(duplex=True)
        self._conn = parent
        self._process: multiprocessing.process.BaseProcess = ctx.Process(
            target=_child_main, args=(child, factory, threads, name), name=name, daemon=True
        )
        self._process.start()
        child.close()
        if not parent.poll(start_timeout_s):
            self._kill()
            raise EngineError(
                f"{name}: the engine process did not report ready within {start_timeout_s} s "
                "(building the engine hung?); raise start_timeout_s if it is just slow"
            )
        try:
            _, kind, payload, version = pickle.loads(parent.recv_bytes())
        except (EOFError, OSError) as e:
            self._kill()
            raise EngineError(
                f"{name}: the engine process exited while starting (exit code "
                f"{self._process.exitcode}); see its output above. A script that builds "
                'engines at import time needs the `if __name__ == "__main__":` guard: the '
                "child process imports the main module again"
            ) from e
        if kind == _ERR:
            self._kill()
            raise EngineError(f"{name}: building the engine in its process failed") from payload
        self.engine_type: str = payload
        self._version = version
        self._reader = threading.Thread(target=self._read, name=f"{name}-proxy", daemon=True)
        self._reader.start()

    # -- TrainEngine -------------------------------------------------------------------------
    @property
    def weight_version(self) -> Version:
        return self._version

    @property
    def pid(self) -> int | None:
        pid: int | None = self._process.pid
        return pid

    async def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        result: torch.Tensor = await self._call("compute_logprobs", batch)
        return result

    async def train_step(self, batch: Batch, loss_fn: LossFn) -> TrainMetrics:
        result: TrainMetrics = await self._call("train_step", batch, loss_fn)
        return result

    def export_weights(self, bucket_bytes: int) -> AsyncIterator[WeightBucket]:
        return self._stream("export_weights", bucket_bytes)

    async def save_checkpoint(self, path: str) -> None:
        await self._call("save_checkpoint", path)

    async def load_checkpoint(self, path: str) -> None:
        await self._call("load_checkpoint", path)

    async def close(self) -> None:
        """Close the child's engine and end its process (idempotent)."""
        if self._closed:
            return
        if self._dead is None:
            with contextlib.suppress(EngineError):
                await asyncio.wait_for(self._call(_STOP), timeout=30.0)
        self._closed = True
        await asyncio.to_thread(self._process.join, 10.0)
        self._kill()

    def __repr__(self) -> str:
        state = "closed" if self._closed else (self._dead or "running")
        return f"ProcessTrainEngine({self.name!r}, pid={self.pid}, {state})"

    # -- plumbing ----------------------------------------------------------------------------
    def _check_open(self, method: str) -> None:
        if self._closed:
            raise EngineError(f"{self.name}: {method} after close(); build a new engine")
        if self._dead is not None:
            raise EngineError(f"{self.name}: {method} failed: {self._dead}")

    def _send(self, method: str, args: tuple[Any, ...], stream: bool) -> tuple[int, _Call]:
        self._check_open(method)
        call_id = next(self._ids)
        try:
            data = _dumps((call_id, method, args))
        except Exception as e:
            what = ", ".join(type(a).__name__ for a in args)
            raise EngineError(
                f"{self.name}: the arguments of {method} ({what}) cannot be pickled to reach "
                f"the engine process ({type(e).__name__}: {e}); a loss function must be a "
                "module-level function or an instance of a module-level class, not a lambda "
                "or a closure"
            ) from e
        call = _Call(stream)
        with self._lock:
            self._calls[call_id] = call
        try:
            self._conn.send_bytes(data)
        except (OSError, ValueError) as e:
            with self._lock:
                self._calls.pop(call_id, None)
            raise EngineError(f"{self.name}: cannot reach the engine process: {e}") from e
        return call_id, call

    async def _call(self, method: str, *args: Any) -> Any:
        call_id, call = self._send(method, args, stream=False)
        assert call.future is not None
        try:
            return await call.future
        finally:
            with self._lock:
                self._calls.pop(call_id, None)

    async def _stream(self, method: str, *args: Any) -> AsyncIterator[Any]:
        call_id, call = self._send(method, args, stream=True)
        assert call.queue is not None
        try:
            while True:
                kind, payload = await call.queue.get()
                if kind == _ITEM:
                    yield payload
                elif kind == _END:
                    return
                else:
                    raise payload
        finally:
            with self._lock:
                self._calls.pop(call_id, None)

    def _read(self) -> None:
        """The reader thread: hand each reply to its caller's event loop."""
        while True:
            try:
                call_id, kind, payload, version = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            with self._lock:
                call = self._calls.get(call_id)
            if call is None:
                continue
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed
                call.loop.call_soon_threadsafe(self._deliver, call, kind, payload, version)
        self._process.join(1.0)
        if not self._closed:
            code = self._process.exitcode
            self._dead = f"the engine process exited (exit code {code}); its output above says why"
        with self._lock:
            pending, self._calls = list(self._calls.values()), {}
        error = EngineError(f"{self.name}: {self._dead or 'the engine process was closed'}")
        for call in pending:
            with contextlib.suppress(RuntimeError):
                call.loop.call_soon_threadsafe(call.deliver, _ERR, error)

    def _deliver(self, call: _Call, kind: str, payload: Any, version: Version | None) -> None:
        if version is not None:
            self._version = version
        call.deliver(kind, payload)

    def _kill(self) -> None:
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5.0)
        with contextlib.suppress(OSError):
            self._conn.close()


if TYPE_CHECKING:  # mypy proves the proxy satisfies the protocol it stands in for
    _protocol: type[TrainEngine] = ProcessTrainEngine

__all__ = ["DEFAULT_START_TIMEOUT_S", "ProcessTrainEngine"]
