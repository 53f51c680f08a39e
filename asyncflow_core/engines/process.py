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
import functools
import itertools
import logging
import multiprocessing
import os
import pickle
import socket
import threading
import traceback
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Literal

import torch

from asyncflow_core.contracts.errors import ConfigError, EngineError, EngineLostError, PeerRankError
from asyncflow_core.contracts.protocols import (
    Batch,
    GenerationRequest,
    GenerationResult,
    LossFn,
    TrainEngine,
    TrainMetrics,
    Version,
    WeightBucket,
)
from asyncflow_core.infra.checkpoint import failpoint
from asyncflow_core.infra.platform import (
    GLOO_IFNAME_ENV,
    NCCL_IFNAME_ENV,
    interface_of,
    is_loopback,
    listen_address,
    rendezvous_store,
)

DEFAULT_START_TIMEOUT_S = 300.0
_log = logging.getLogger("asyncflow.process")
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
        failpoint(f"process.{name}.{method}")  # e.g. process.trainer.train_step=5
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


class _ProcessEngine:
    """An engine that lives in a child process (see the module docstring); the subclasses
    forward one protocol's calls.

    ``factory``: a picklable zero-argument callable run in the child that returns the engine
    (or an awaitable of it). ``threads``: ``torch.set_num_threads`` in the child before the
    factory runs (None: torch's default, every core). ``start_method``: ``forkserver`` where
    the platform has it (a fresh interpreter forked per engine: torch is imported once), else
    ``spawn``. The constructor waits for the engine to be built (``start_timeout_s``) and
    raises the child's error if the factory failed. Arguments of every call (batch, loss
    function) must pickle: a lambda loss function is refused with an error saying so.
    ``close()`` closes the child's engine and ends the process. (``wait=False`` returns as
    soon as the process is started, for ``SPMDTrainEngine``, which then waits for all its
    ranks at once: they can only become ready together.)

    **A child that dies** (killed, crashed, out of memory) is noticed at once: its end of the
    pipe closes, so the parent's reader thread sees end-of-file and fails every call in flight,
    and every later one, with ``EngineLostError`` naming the engine, its pid and exit code
    (for SIGKILL, -9). No heartbeat is needed for that; a child that hangs while alive is
    not detected (give the job's calls a timeout of their own if that can happen).
    """

    def __init__(
        self,
        factory: Callable[[], Any],
        *,
        threads: int | None = None,
        name: str = "trainer",
        start_method: str | None = None,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        wait: bool = True,
    ) -> None:
        who = type(self).__name__
        if not callable(factory):
            raise ConfigError(f"{who}: factory must be callable, got {factory!r}")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                    or threads < 1):  # fmt: skip
            raise ConfigError(f"{who}: threads must be None or >= 1, got {threads!r}")
        methods = multiprocessing.get_all_start_methods()
        method = start_method or ("forkserver" if "forkserver" in methods else "spawn")
        if method not in methods:
            raise ConfigError(
                f"{who}: start_method {method!r} is not available here; choose one of {methods}"
            )
        try:
            _dumps(factory)
        except Exception as e:
            raise ConfigError(
                f"{who}: the factory {factory!r} cannot be pickled to reach the "
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
            home = _factory_module(factory)
            preload = ["torch", "torch.optim", "torch._dynamo", "asyncflow_core.engines.process"]
            ctx.set_forkserver_preload(preload + ([home] if home and home != "__main__" else []))
        parent, child = ctx.Pipe(duplex=True)
        self._conn = parent
        self._process: multiprocessing.process.BaseProcess = ctx.Process(
            target=_child_main, args=(child, factory, threads, name), name=name, daemon=True
        )
        self._process.start()
        child.close()
        self.engine_type = ""
        if wait:
            self._wait_ready(start_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        """Wait for the child's "ready" (or its error) and start the reply reader."""
        name, parent = self.name, self._conn
        if not parent.poll(timeout_s):
            self._kill()
            raise EngineError(
                f"{name}: the engine process did not report ready within {timeout_s} s "
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
        self.engine_type = payload
        self._version = version
        self._reader = threading.Thread(target=self._read, name=f"{name}-proxy", daemon=True)
        self._reader.start()

    @property
    def weight_version(self) -> Version:
        return self._version

    @property
    def pid(self) -> int | None:
        pid: int | None = self._process.pid
        return pid

    stop_timeout_s = 30.0
    """How long ``close()`` waits for the child to finish its calls in flight and close its
    engine; then the process is killed."""

    async def close(self) -> None:
        """Close the child's engine and end its process (idempotent). A child that does not
        finish within ``stop_timeout_s`` (a call in flight that never ends, an engine whose
        close hangs) is killed: close always ends the process."""
        if self._closed:
            return
        if self._dead is None:
            try:
                await asyncio.wait_for(self._call(_STOP), timeout=self.stop_timeout_s)
            except EngineError:
                pass
            except TimeoutError:
                _log.warning(
                    "%s: its process did not finish its calls and close its engine within "
                    "%.0f s of close(); killing it (pid %s)",
                    self.name, self.stop_timeout_s, self.pid,
                )  # fmt: skip
        self._closed = True
        await asyncio.to_thread(self._process.join, 10.0)
        self._kill()

    def __repr__(self) -> str:
        state = "closed" if self._closed else (self._dead or "running")
        return f"{type(self).__name__}({self.name!r}, pid={self.pid}, {state})"

    # -- plumbing ----------------------------------------------------------------------------
    def _check_open(self, method: str) -> None:
        if self._closed:
            raise EngineError(f"{self.name}: {method} after close(); build a new engine")
        if self._dead is not None:
            raise EngineLostError(f"{self.name}: {method} failed: {self._dead}")

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
        except (OSError, ValueError) as e:  # the pipe is closed: the child is gone
            self._forget(call_id)
            if not self._closed and self._dead is None:
                self._process.join(1.0)  # it is exiting: its code says why
                self._dead = self._exit_reason()
            raise EngineLostError(
                f"{self.name}: {method} cannot reach the engine process ({e}): {self._dead}"
            ) from e
        return call_id, call

    def _exit_reason(self) -> str:
        code = self._process.exitcode
        if code is None:
            return f"its process (pid {self._process.pid}) closed its pipe"
        why = (
            "killed by SIGKILL (the kernel's OOM killer, or a kill -9)"
            if code == -9
            else "its output above says why"
        )
        return f"its process (pid {self._process.pid}) exited with code {code}: {why}"

    def _forget(self, call_id: int) -> None:
        """Stop routing replies of ``call_id`` (it ended, or nobody waits for it any more)."""
        with self._lock:
            self._calls.pop(call_id, None)

    async def _call(self, method: str, *args: Any) -> Any:
        call_id, call = self._send(method, args, stream=False)
        assert call.future is not None
        try:
            return await call.future
        finally:
            self._forget(call_id)

    async def _stream(self, method: str, *args: Any) -> AsyncIterator[Any]:
        call_id, call = self._send(method, args, stream=True)
        async for item in self._receive(call_id, call):
            yield item

    async def _receive(self, call_id: int, call: _Call) -> AsyncIterator[Any]:
        """The items of a streaming call already sent."""
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
            self._forget(call_id)

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
            self._dead = self._exit_reason()
        with self._lock:
            pending, self._calls = list(self._calls.values()), {}
        error: EngineError
        if self._dead is not None:
            error = EngineLostError(f"{self.name}: {self._dead}")
        else:
            error = EngineError(f"{self.name}: the engine process was closed")
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


class ProcessTrainEngine(_ProcessEngine):
    """A ``TrainEngine`` whose engine lives in a child process (see ``_ProcessEngine`` for the
    arguments and what happens when the child dies: a lost trainer raises
    ``EngineLostError``, which stops an RL job)."""

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


class ProcessInferenceEngine(_ProcessEngine):
    """An ``InferenceEngine`` whose engine lives in a child process (the same plumbing as
    ``ProcessTrainEngine``: ``factory``, ``threads``, ``start_method``, ``close``): rollout
    then does not share the interpreter lock with the job, and a rollout engine that dies is
    a lost worker the job survives (``EngineLostError``; ``asyncflow_core.flow.rlflow``). It
    forwards ``generate``, ``abort``, ``load_weights``, ``pause`` and ``resume``: the child's
    engine must have the last three for a job's weight sync. Requests, results and the
    synced weights are pickled over the pipe (copied, not shared)."""

    def __init__(
        self,
        factory: Callable[[], Any],
        *,
        threads: int | None = None,
        name: str = "rollout",
        start_method: str | None = None,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    ) -> None:
        super().__init__(
            factory, threads=threads, name=name, start_method=start_method,
            start_timeout_s=start_timeout_s,
        )  # fmt: skip

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        result: GenerationResult = await self._call("generate", request)
        return result

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self._call("abort", list(request_ids))

    async def load_weights(self, weights: Any, version: Version) -> None:
        await self._call("load_weights", _plain_weights(weights), version)

    async def pause(self, mode: Literal["abort", "keep"] = "keep") -> None:
        await self._call("pause", mode)

    async def resume(self) -> None:
        await self._call("resume")


def _plain_weights(weights: Any) -> Any:
    """Weights as something that pickles: a mapping or a list of ``(name, tensor)``."""
    if isinstance(weights, Mapping):
        return dict(weights)
    return list(weights)


# --------------------------------------------------------------------------------------------
# Several ranks: one SPMD trainer over N processes
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RankContext:
    """Where one rank of an ``SPMDTrainEngine`` stands: its ``rank`` among ``world_size``, and
    the rendezvous of the group's default process group (``init_method``, a ``tcp://`` URL on
    this host that the group chose for this run; loopback unless ``master_addr`` says
    otherwise). ``store(timeout)`` is that rendezvous as a store that listens on
    ``master_addr`` only: torch's own ``tcp://`` store listens on every interface."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"

    def store(self, timeout: timedelta = timedelta(minutes=30)) -> Any:
        """The rendezvous store (rank 0 hosts it on ``master_addr`` only): pass it as
        ``init_process_group(backend, store=..., rank=context.rank,
        world_size=context.world_size)`` in place of ``init_method``."""
        return rendezvous_store(
            self.master_addr,
            self.master_port,
            self.world_size,
            is_master=self.rank == 0,
            timeout=timeout,
        )


def _factory_module(factory: Callable[..., Any]) -> str | None:
    """The module that defines the user's factory (for the forkserver to import once)."""
    while isinstance(factory, functools.partial):
        factory = factory.args[0] if factory.func is _build_rank else factory.func
    module = getattr(factory, "__module__", None)
    return module if isinstance(module, str) else None


def _build_rank(factory: Callable[[RankContext], Any], context: RankContext) -> Any:
    # This process is the rank's own, and every rank runs on this machine: every gloo group
    # built in it without a device (the default group, DeepSpeed's subgroups) listens on
    # master_addr's interface (loopback by default), not on the address the hostname
    # resolves to; with a loopback master_addr NCCL's sockets (bootstrap, proxy) stay on
    # loopback too (it picks the first outward interface otherwise, measured on an H100).
    # A variable the user set stands.
    interface = interface_of(listen_address(context.master_addr))
    loopback = is_loopback(context.master_addr)
    for variable in (GLOO_IFNAME_ENV, NCCL_IFNAME_ENV) if loopback else (GLOO_IFNAME_ENV,):
        if interface is not None and not os.environ.get(variable):
            os.environ[variable] = interface
    return factory(context)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it) on ``host`` (IPv4 or IPv6)."""
    family = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def split_rows(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``(start, stop)`` spans covering ``range(n)``, sizes differing by at
    most one (the first spans get the extra rows; a span may be empty)."""
    base, extra = divmod(n, parts)
    spans, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        spans.append((start, stop))
        start = stop
    return spans


class SPMDTrainEngine:
    """One ``TrainEngine`` made of ``world_size`` rank processes that run an SPMD trainer
    together (data parallel: DeepSpeed, FSDP, ...), driven from this process.

    ``factory(context)`` runs in each rank's process with its ``RankContext`` and returns that
    rank's engine (or an awaitable of it), which must join the group's default process group
    at the context's rendezvous: ``torch.distributed.init_process_group(backend,
    store=context.store(), rank=context.rank, world_size=context.world_size)`` (listens on
    ``master_addr`` only; ``init_method=context.init_method`` works too, but torch's store then
    listens on every interface). The factory must pickle (a module-level function or a
    ``functools.partial`` of one).

    **Sockets.** The ranks meet at ``master_addr`` (default ``127.0.0.1``: nothing of the
    group is reachable from another machine); each rank process sets ``GLOO_SOCKET_IFNAME``
    (and, for a loopback ``master_addr``, ``NCCL_SOCKET_IFNAME``) to that address's
    interface unless set already, so its gloo and NCCL groups listen there too.

    Every call goes to every rank, in the same order (so their collectives line up):

    * ``compute_logprobs(batch)``, ``train_step(batch, loss_fn)``: the batch's rows are split
      into ``world_size`` contiguous shards (``split_rows``; a shard may be empty) and rank
      ``r`` gets shard ``r``. ``compute_logprobs`` concatenates the ranks' results in order
      (right-padded with 0 to the widest). ``train_step`` returns rank 0's ``TrainMetrics``:
      **a rank engine reports the whole step's metrics** (its collectives sum them over the
      ranks), and all ranks must agree on the version.
    * ``export_weights(bucket_bytes)``: every rank runs it (gathering sharded parameters is a
      collective); **rank 0 yields the buckets, the other ranks must yield none**.
    * ``save_checkpoint`` / ``load_checkpoint`` / ``sleep`` / ``wake_up``: every rank, with the
      same arguments.

    **Failures.** A rank engine must reject bad input on every rank alike (agree with the
    others before any collective that could hang), raising ``PeerRankError`` on the ranks
    that only follow another's failure; the group raises the first rank's own error, with a
    note naming the rank and its rows of the batch. If a rank's *process* dies, its peers may
    be stuck in a collective: the group kills every rank and raises, and later calls fail
    saying so.
    ``close()`` closes every rank. Keep the script's ``if __name__ == "__main__":`` guard, as
    for ``ProcessTrainEngine``.
    """

    def __init__(
        self,
        factory: Callable[[RankContext], Any],
        world_size: int,
        *,
        threads: int | None = None,
        name: str = "spmd-trainer",
        start_method: str | None = None,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(
                f"SPMDTrainEngine: world_size must be an int >= 1, got {world_size!r}"
            )
        if not callable(factory):
            raise ConfigError(f"SPMDTrainEngine: factory must be callable, got {factory!r}")
        port = free_port(master_addr) if master_port is None else master_port
        self.name = name
        self.world_size = world_size
        self._closed = False
        self._failed: str | None = None
        self.ranks: list[ProcessTrainEngine] = []
        try:
            for rank in range(world_size):
                context = RankContext(rank, world_size, master_addr, port)
                self.ranks.append(
                    ProcessTrainEngine(
                        functools.partial(_build_rank, factory, context),
                        threads=threads,
                        name=f"{name}-rank{rank}",
                        start_method=start_method,
                        start_timeout_s=start_timeout_s,
                        wait=False,
                    )
                )
            for engine in self.ranks:
                engine._wait_ready(start_timeout_s)
        except BaseException:
            for engine in self.ranks:
                engine._kill()
            raise
        self.engine_type = self.ranks[0].engine_type

    # -- TrainEngine -------------------------------------------------------------------------
    @property
    def weight_version(self) -> Version:
        return self.ranks[0].weight_version

    @property
    def pids(self) -> list[int | None]:
        return [engine.pid for engine in self.ranks]

    async def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        shards, spans = self._shards(batch)
        parts: list[torch.Tensor] = await self._all("compute_logprobs", shards, spans)
        width = max((int(p.shape[1]) for p in parts if p.dim() == 2), default=0)
        padded = [torch.nn.functional.pad(p, (0, width - int(p.shape[1]))) for p in parts]
        return torch.cat(padded) if padded else torch.zeros(0, 0)

    async def train_step(self, batch: Batch, loss_fn: LossFn) -> TrainMetrics:
        shards, spans = self._shards(batch)
        results: list[TrainMetrics] = await self._all(
            "train_step", [(shard, loss_fn) for (shard,) in shards], spans
        )
        versions = {m.version for m in results}
        if len(versions) != 1:
            raise EngineError(
                f"{self.name}: the ranks disagree on the version after the step "
                f"({[m.version for m in results]}); their engines diverged"
            )
        return results[0]

    def export_weights(self, bucket_bytes: int) -> AsyncIterator[WeightBucket]:
        return self._export(bucket_bytes)

    async def save_checkpoint(self, path: str) -> None:
        await self._all("save_checkpoint", [(path,)] * self.world_size)

    async def load_checkpoint(self, path: str) -> None:
        await self._all("load_checkpoint", [(path,)] * self.world_size)

    async def sleep(self, level: int = 1) -> None:
        """Every rank's ``sleep(level)`` (its engine must have one)."""
        await self._all("sleep", [(level,)] * self.world_size)

    async def wake_up(self) -> None:
        await self._all("wake_up", [()] * self.world_size)

    async def close(self) -> None:
        """Close every rank (idempotent)."""
        if self._closed:
            return
        self._closed = True
        await asyncio.gather(*(engine.close() for engine in self.ranks))

    def __repr__(self) -> str:
        state = "closed" if self._closed else (self._failed or "running")
        return f"SPMDTrainEngine({self.name!r}, world_size={self.world_size}, {state})"

    # -- plumbing ----------------------------------------------------------------------------
    def _shards(self, batch: Batch) -> tuple[list[tuple[Batch]], list[tuple[int, int]]]:
        """Rank ``r``'s part of the batch, and which rows of it that is."""
        if not isinstance(batch, Batch):
            raise EngineError(f"{self.name}: expected a Batch, got {type(batch).__name__}")
        if self.world_size == 1:
            return [(batch,)], []
        try:
            spans = split_rows(_row_count(batch), self.world_size)
            shards = [(batch.slice(a, b),) for a, b in spans]
        except ValueError as e:
            raise EngineError(f"{self.name}: cannot split the batch over the ranks: {e}") from e
        return shards, spans

    def _check_open(self, method: str) -> None:
        if self._closed:
            raise EngineError(f"{self.name}: {method} after close(); build a new engine")
        if self._failed is not None:
            raise EngineError(f"{self.name}: {method} failed: {self._failed}")

    def _send_all(
        self, method: str, args: list[tuple[Any, ...]], stream: bool
    ) -> list[tuple[ProcessTrainEngine, int, _Call]]:
        """Send one call to every rank, with no await in between: every rank then sees the
        group's calls in the same order. Returns each rank's (engine, call id, call)."""
        self._check_open(method)
        if len(args) != self.world_size:
            raise EngineError(f"{self.name}: {method} needs one argument set per rank")
        for engine in self.ranks:  # fail before sending anything if a rank is gone
            engine._check_open(method)
        sent: list[tuple[ProcessTrainEngine, int, _Call]] = []
        try:
            for engine, rank_args in zip(self.ranks, args, strict=True):
                call_id, call = engine._send(method, rank_args, stream)
                sent.append((engine, call_id, call))
        except BaseException:
            if sent:  # some ranks got the call and would wait for the others forever
                self._fail(f"{method} reached only ranks 0..{len(sent) - 1}")
            raise
        return sent

    async def _all(
        self, method: str, args: list[tuple[Any, ...]], spans: Sequence[tuple[int, int]] = ()
    ) -> Any:
        sent = self._send_all(method, args, stream=False)
        futures = [call.future for _, _, call in sent if call.future is not None]
        try:
            return await self._gather(method, futures, spans)
        finally:
            for engine, call_id, _ in sent:
                engine._forget(call_id)

    async def _gather(
        self,
        method: str,
        futures: Sequence[asyncio.Future[Any]],
        spans: Sequence[tuple[int, int]] = (),
    ) -> list[Any]:
        """Every rank's result; the first rank's error (rank 0 first) if any failed. A dead
        rank process fails the group at once instead of leaving its peers to hang."""
        waiting: set[asyncio.Future[Any]] = set(futures)
        while waiting:
            _, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_EXCEPTION)
            dead = [i for i, engine in enumerate(self.ranks) if engine._dead is not None]
            if dead:
                self._fail(f"rank {dead[0]}: {self.ranks[dead[0]]._dead}")
                for f in waiting:
                    f.cancel()
                raise EngineError(
                    f"{self.name}: {method} failed: rank {dead[0]}'s process died "
                    f"({self.ranks[dead[0]]._dead}); every rank was stopped, build a new engine"
                )
        failed = [(rank, f.exception()) for rank, f in enumerate(futures) if f.exception()]
        if failed:  # the first rank that failed by itself, not because a peer did
            rank, error = next(
                ((r, e) for r, e in failed if not isinstance(e, PeerRankError)), failed[0]
            )
            assert error is not None
            if rank < len(spans):
                start, stop = spans[rank]
                error.add_note(f"(rank {rank} had rows {start}:{stop} of the batch)")
            raise error
        return [f.result() for f in futures]

    async def _export(self, bucket_bytes: int) -> AsyncIterator[WeightBucket]:
        sent = self._send_all("export_weights", [(bucket_bytes,)] * self.world_size, True)
        streams = [engine._receive(call_id, call) for engine, call_id, call in sent]

        async def drain(rank: int) -> None:
            async for _ in streams[rank]:
                raise EngineError(
                    f"{self.name}: rank {rank} yielded a weight bucket; only rank 0 may "
                    "(the other ranks take part in the gathers and yield nothing)"
                )

        others = [asyncio.ensure_future(drain(r)) for r in range(1, self.world_size)]
        try:
            async for bucket in streams[0]:
                yield bucket
            await self._gather("export_weights", others)
        finally:
            for task in others:
                if not task.done():
                    task.cancel()

    def _fail(self, why: str) -> None:
        self._failed = why
        for engine in self.ranks:
            engine._kill()


def _row_count(batch: Batch) -> int:
    """Rows of a batch, from its row ids or else its first field."""
    if batch.rows:
        return len(batch.rows)
    first = next(iter(batch.lengths.values()), None)
    if first is None:
        first = next(iter(batch.data.values()), None)
    return len(first) if first is not None and hasattr(first, "__len__") else 0


if TYPE_CHECKING:  # mypy proves the proxy satisfies the protocol it stands in for
    _protocol: type[TrainEngine] = ProcessTrainEngine
    _spmd_protocol: type[TrainEngine] = SPMDTrainEngine

__all__ = [
    "DEFAULT_START_TIMEOUT_S",
    "ProcessInferenceEngine",
    "ProcessTrainEngine",
    "RankContext",
    "SPMDTrainEngine",
    "free_port",
    "split_rows",
]
