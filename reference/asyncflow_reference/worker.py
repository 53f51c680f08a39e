"""An inference worker in a process of its own: a ``TorchInferenceEngine`` that receives its
weights from the trainer through a ``WeightSyncGroup`` (``DistributedWeightReceiver``) while it
keeps generating, driven from the parent over a pipe. For tests and benchmarks of the
collective weight sync; it is not the Ray runtime.

``InferenceWorker(spec)`` starts the child (``multiprocessing`` spawn). The child builds the
engine from ``spec.config`` and ``spec.seed``, joins the group as rank ``spec.rank`` and
serves syncs from rank 0 until the sender closes, concurrently with the parent's requests. How
a sync reaches the engine is the worker's ``mode`` (``set_mode`` changes it between syncs):

* ``"staged"`` (AsyncFlow's delayed update): the buckets land in a ``HostBuffer`` while the
  engine keeps generating with the old weights; then ``StagedUpdate.apply`` pauses the engine
  just for the swap.
* ``"blocking"``: the engine pauses (mode ``keep``) when the sync starts, the weights load
  straight into it, and it resumes after the load.

Each sync leaves a ``SyncReport``: ``transfer_s`` (start of the sync to the last byte
received), ``exposed_s`` (the engine could not generate: staged, ``StagedUpdate.apply``'s
pause-load-resume; blocking, from the pause at the sync's start to the resume — both include
waiting for the engine's step in flight) and the tokens generated during the transfer.
Commands and answers between the processes are pickled (``GenerationRequest``/``Result``, a
copy of the weights for checks): both ends are this program's own processes; the synced
weights travel only over the group.
Every parent call has a timeout; a child that died or stopped answering raises
``EngineError``, and ``close()`` kills a child that does not stop in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import pickle
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Literal

import torch

from asyncflow_core.contracts.errors import EngineError
from asyncflow_core.contracts.protocols import (
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    Version,
)
from asyncflow_core.sync.strategies import StagedUpdate
from asyncflow_core.sync.transports import DistributedWeightReceiver, WeightSyncGroup
from asyncflow_reference.engines import TorchInferenceEngine
from asyncflow_reference.model import ModelConfig

Mode = Literal["staged", "blocking"]


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What the child builds: the engine (``config``, ``seed``, ``max_batch``, ``threads``) and
    its place in the weight-sync group (``host``, ``port``, ``rank`` >= 1, ``world_size``,
    ``backend``, ``timeout_s``), and the first ``mode``."""

    config: ModelConfig
    host: str
    port: int
    rank: int
    world_size: int
    seed: int = 0
    mode: Mode = "staged"
    backend: str | None = None
    timeout_s: float = 120.0
    max_batch: int = 64
    threads: int | None = 1


@dataclass(frozen=True, slots=True)
class SyncReport:
    """One sync as the worker saw it (seconds on its clock)."""

    version: Version
    mode: Mode
    transfer_s: float
    exposed_s: float
    tokens_during_transfer: int


class InferenceWorker:
    """The parent's handle on a worker process (see the module docstring). Calls are blocking
    and one at a time (a lock orders callers from several threads); ``timeout_s`` bounds each,
    and a call that outlasts it kills the worker (``EngineError``). An error raised in the
    child is raised here, with the child's traceback as a note. ``close()`` (or leaving the
    ``with`` block) stops the child."""

    def __init__(self, spec: WorkerSpec) -> None:
        if spec.mode not in ("staged", "blocking"):
            raise EngineError(
                f"InferenceWorker: mode must be 'staged' or 'blocking', got {spec.mode!r}"
            )
        self.spec = spec
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_child_main,
            args=(spec, child),
            name=f"inference-worker-{spec.rank}",
            daemon=True,
        )
        self._proc.start()
        child.close()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def generate(
        self, requests: Sequence[GenerationRequest], timeout_s: float = 120.0
    ) -> list[GenerationResult]:
        """Generate ``requests`` concurrently on the worker's engine."""
        results: list[GenerationResult] = self._call(
            "generate", list(requests), timeout_s=timeout_s
        )
        return results

    def set_mode(self, mode: Mode, timeout_s: float = 60.0) -> None:
        """How the next syncs reach the engine (takes effect at the next sync's start)."""
        if mode not in ("staged", "blocking"):
            raise EngineError(f"InferenceWorker: mode must be 'staged' or 'blocking', got {mode!r}")
        self._call("set_mode", mode, timeout_s=timeout_s)

    def keep_busy(self, requests: int, max_tokens: int = 32, timeout_s: float = 60.0) -> None:
        """Keep ``requests`` generations in flight in the background (a finished one is replaced
        at once) until ``keep_busy(0)``, so that syncs happen under load."""
        if requests < 0 or max_tokens < 1:
            raise EngineError(
                f"InferenceWorker.keep_busy: requests must be >= 0 and max_tokens >= 1, got "
                f"{requests!r} and {max_tokens!r}"
            )
        self._call("keep_busy", int(requests), int(max_tokens), timeout_s=timeout_s)

    def wait_for_version(self, version: Version, timeout_s: float = 120.0) -> Version:
        """Wait until the engine serves ``version`` or newer; returns its version. Raises the
        receiver's error if it failed, ``EngineError`` if the sender closed first."""
        got: Version = self._call("wait_for_version", version, timeout_s=timeout_s)
        return got

    def weights(self, timeout_s: float = 120.0) -> dict[str, torch.Tensor]:
        """A copy of the engine's ``state_dict`` (taken between two weight loads)."""
        weights: dict[str, torch.Tensor] = self._call("weights", timeout_s=timeout_s)
        return weights

    def reports(self, timeout_s: float = 60.0) -> list[SyncReport]:
        """One ``SyncReport`` per sync the worker loaded, in order."""
        reports: list[SyncReport] = self._call("reports", timeout_s=timeout_s)
        return reports

    def close(self, timeout_s: float = 30.0) -> int | None:
        """Stop the child (killing it if it does not stop within ``timeout_s``); returns its exit
        code. Safe to repeat."""
        if not self._closed:
            self._closed = True
            with contextlib.suppress(EngineError, OSError):
                self._call("stop", timeout_s=timeout_s, closing=True)
            self._proc.join(timeout_s)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(timeout_s)
            self._conn.close()
        return self._proc.exitcode

    def __enter__(self) -> InferenceWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, command: str, *args: Any, timeout_s: float, closing: bool = False) -> Any:
        where = f"inference worker rank {self.spec.rank} (pid {self._proc.pid})"
        if self._closed and not closing:
            raise EngineError(f"{where} is closed; start a new one")
        with self._lock:
            try:
                self._conn.send((command, args))
                if not self._conn.poll(timeout_s):
                    self._proc.kill()  # a late answer would be taken for the next call's
                    self._closed = True
                    raise EngineError(
                        f"{where}: no answer to {command!r} within {timeout_s:g} s; the worker "
                        "was killed, start a new one"
                    )
                kind, payload = self._conn.recv()
            except (EOFError, BrokenPipeError, ConnectionResetError) as exc:
                self._proc.join(1.0)
                raise EngineError(
                    f"{where} is gone (exit code {self._proc.exitcode}); its stderr says why"
                ) from exc
        if kind == "err":
            raise payload
        return payload


# --------------------------------------------------------------------------------------------
# The child
# --------------------------------------------------------------------------------------------
def _child_main(spec: WorkerSpec, conn: Connection) -> None:
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    asyncio.run(_Worker(spec, conn).run())


class _Worker:
    def __init__(self, spec: WorkerSpec, conn: Connection) -> None:
        self.spec, self.conn = spec, conn
        self.engine = TorchInferenceEngine(
            spec.config,
            seed=spec.seed,
            max_batch=spec.max_batch,
            threads=spec.threads,
            name=f"worker-{spec.rank}",
        )
        self.group = WeightSyncGroup(
            spec.host,
            spec.port,
            spec.rank,
            spec.world_size,
            backend=spec.backend,
            timeout_s=spec.timeout_s,
        )
        self.mode: Mode = spec.mode
        self.staged = StagedUpdate([self.engine], pause_mode="keep")
        self.reports: list[SyncReport] = []
        self.loading = asyncio.Lock()  # one weight load at a time; weights() waits for it
        self.changed = asyncio.Condition()
        self.busy: list[asyncio.Task[None]] = []
        self.serving: asyncio.Task[None] | None = None
        self._sync_mode: Mode = self.mode
        self._t0 = 0.0
        self._tokens0 = 0

    async def run(self) -> None:
        # load_weights below copies every sync into the engine before it returns (the staged
        # mode applies at once), so the receiver may reuse its buffers: no fresh memory per sync
        receiver = DistributedWeightReceiver(
            self, group=self.group, on_start=self._on_start, reuse_buffers=True
        )
        self.serving = asyncio.create_task(self._serve(receiver))
        loop = asyncio.get_running_loop()
        while True:
            try:
                command, args = await loop.run_in_executor(None, self.conn.recv)
            except (EOFError, OSError):  # the parent is gone
                break
            try:
                result = await getattr(self, f"_cmd_{command}")(*args)
            except Exception as exc:
                self.conn.send(("err", self._portable(exc)))
            else:
                self.conn.send(("ok", result))
            if command == "stop":
                break
        await self._shutdown()

    def _portable(self, exc: Exception) -> Exception:
        """``exc`` with the child's traceback as a note, or an ``EngineError`` with its text
        when it does not pickle."""
        where = f"inference worker rank {self.spec.rank}"
        text = "".join(traceback.format_exception(exc))
        try:
            exc.add_note(f"(raised in {where})\n{text}")
            pickle.dumps(exc)
            return exc
        except Exception:
            return EngineError(f"{type(exc).__name__}: {exc} (raised in {where})\n{text}")

    async def _serve(self, receiver: DistributedWeightReceiver) -> None:
        try:
            while await receiver.receive_one() is not None:
                pass
        finally:
            if self.engine.paused:  # a blocking sync that did not finish
                await self.engine.resume()
            async with self.changed:
                self.changed.notify_all()

    # ---- how a sync reaches the engine -------------------------------------------------------
    async def _on_start(self) -> None:
        self._sync_mode = self.mode
        self._t0 = time.perf_counter()
        self._tokens0 = self.engine.tokens_generated
        if self._sync_mode == "blocking":
            await self.engine.pause("keep")

    async def load_weights(
        self, weights: Sequence[tuple[str, torch.Tensor]], version: Version
    ) -> None:
        """The receiver's target: every byte of the sync has arrived."""
        transfer_s = time.perf_counter() - self._t0
        tokens = self.engine.tokens_generated - self._tokens0
        async with self.loading:
            if self._sync_mode == "blocking":
                try:
                    await self.engine.load_weights(weights, version)
                finally:
                    await self.engine.resume()
                exposed_s = time.perf_counter() - self._t0
            else:
                await self.staged.buffer.load_weights(weights, version)
                timing = await self.staged.apply()  # the next safe point is now
                exposed_s = 0.0 if timing is None else timing.exposed_s
        self.reports.append(SyncReport(version, self._sync_mode, transfer_s, exposed_s, tokens))
        async with self.changed:
            self.changed.notify_all()

    # ---- commands ----------------------------------------------------------------------------
    async def _cmd_generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        return list(await asyncio.gather(*(self.engine.generate(r) for r in requests)))

    async def _cmd_set_mode(self, mode: Mode) -> None:
        self.mode = mode

    async def _cmd_keep_busy(self, requests: int, max_tokens: int) -> None:
        for task in self.busy:
            task.cancel()
        self.busy = [asyncio.create_task(self._busy_loop(i, max_tokens)) for i in range(requests)]

    async def _busy_loop(self, lane: int, max_tokens: int) -> None:
        vocab = self.spec.config.vocab_size
        prompt_len = max(1, min(4, self.spec.config.max_seq_len - max_tokens - 1))
        for n in itertools.count():
            prompt = tuple((lane + n + j) % vocab for j in range(prompt_len))
            params = SamplingParams(max_tokens=max_tokens, temperature=1.0)
            await self.engine.generate(GenerationRequest(f"busy-{lane}-{n}", prompt, params))

    async def _cmd_wait_for_version(self, version: Version) -> Version:
        serving = self.serving
        assert serving is not None
        async with self.changed:
            await self.changed.wait_for(
                lambda: self.engine.weight_version >= version or serving.done()
            )
        if self.engine.weight_version >= version:
            return self.engine.weight_version
        serving.result()  # the receiver's error, if it failed
        raise EngineError(
            f"inference worker rank {self.spec.rank}: the sender closed at version "
            f"{self.engine.weight_version}, before version {version}"
        )

    async def _cmd_weights(self) -> dict[str, torch.Tensor]:
        async with self.loading:
            return {n: t.detach().clone() for n, t in self.engine.model.state_dict().items()}

    async def _cmd_reports(self) -> list[SyncReport]:
        return list(self.reports)

    async def _cmd_stop(self) -> None:
        return None

    async def _shutdown(self) -> None:
        for task in self.busy:
            task.cancel()
        await asyncio.gather(*self.busy, return_exceptions=True)
        if self.serving is not None and not self.serving.done():
            self.serving.cancel()  # its thread may be inside a collective: exit tears it down
        else:
            self.group.close()
        await self.engine.close()
