"""Pipelines of tasks over one DataStore partition: typed composition, validation before
running, and an asyncio runner that runs each task's callable in a worker thread and stops
cleanly (a raising task stops everything with its name; cancel stops within the running
calls' duration and leaves no thread behind).

A ``Source`` creates rows; each ``Task`` pulls batches whose ``consumes`` fields are ready,
runs its callable on them and writes its ``produces`` fields back into the same rows. The
pipeline ends when the source is exhausted and every task has consumed every row.

With a ``tracer`` (``asyncflow_core.observability.trace.Tracer``) the runner records, per worker and
iteration: a "wait" span around ``get_meta`` + ``get_data`` (rows leased), a "task" span around
the callable (rows, tokens, weight versions), and for the source a "task" span per batch it
generates and a "put" span per put of new rows (which may wait for capacity).
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import inspect
import sys
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncflow_core.contracts.errors import AsyncFlowError, PipelineError, TaskFailedError
from asyncflow_core.contracts.protocols import (
    DEFAULT_LEASE_S,
    Batch,
    BatchMeta,
    Capacity,
    CellValue,
    DataStore,
    Layout,
    Scheduler,
    Tags,
    Version,
)
from asyncflow_core.data.store import get_meta_after_ack
from asyncflow_core.observability.trace import Tracer

FieldValues = Sequence[CellValue] | torch.Tensor


@dataclass(frozen=True, slots=True)
class TaskOutput:
    """What a task or source returns: one value per row for each produced field, and
    optionally one ``Tags`` per row (merged into the rows' tags)."""

    data: Mapping[str, FieldValues]
    tags: Sequence[Tags] | None = None


TaskResult = TaskOutput | Mapping[str, FieldValues] | None
TaskFn = Callable[[Batch], TaskResult | Awaitable[TaskResult]]
"""A task's callable: gets the batch of its consumed fields, returns its produced fields. A
coroutine function is awaited on the event loop (engine calls are async); a plain function runs
in a worker thread."""

SourceItem = TaskOutput | Mapping[str, FieldValues]


@dataclass(frozen=True, slots=True)
class Task:
    """One stage of a pipeline.

    ``fn(batch)`` returns the ``produces`` fields for ``batch.rows`` (a ``TaskOutput`` or a
    plain mapping; ``None`` when it produces nothing). A plain function runs in a worker thread
    (engine kernels release the GIL); an ``async def`` runs on the event loop (engines with an
    async API, simulated engines). Up to ``workers`` batches of ``batch_size`` rows run
    concurrently, each in a worker slot; one puller per task leases a batch whenever a slot is
    idle. ``sampler`` (a Scheduler, or a zero-argument factory giving each worker slot its
    own) chooses the rows; default sequential. ``current_version`` (called before every pull)
    is passed to the sampler, e.g. the trainer's weight version for a ``StalenessSampler``.
    ``resource`` names what the task occupies in the trace (default: its name); tasks that
    share devices, e.g. rollout and training when colocated, share a resource. ``lease_s``: how
    long a pulled batch stays leased (on the loop's clock) before the store hands it to
    another worker; make it longer than one call of ``fn`` can take. ``reuse_batch``: ``fn``
    keeps no reference to its batch, nor to any of its tensors, once it returns, so a worker
    slot's next batch is read into the memory of its previous one (``get_data(out=...)``:
    steady-state reads allocate nothing; a tensor still referenced is never overwritten).
    """

    name: str
    fn: TaskFn
    consumes: tuple[str, ...]
    produces: tuple[str, ...] = ()
    batch_size: int = 1
    workers: int = 1
    sampler: Scheduler | Callable[[], Scheduler] | None = None
    layout: Layout = "padded"
    current_version: Callable[[], Version] | None = None
    resource: str | None = None
    lease_s: float = DEFAULT_LEASE_S
    reuse_batch: bool = False


@dataclass(frozen=True, slots=True)
class Source:
    """Creates the rows: ``batches()`` yields (or, as an async generator, async-yields) one
    ``TaskOutput`` (or mapping) per put of new rows, holding every field in ``produces``. A
    plain iterator is advanced in a worker thread. When it is exhausted the partition is
    closed, so the tasks drain the remaining rows and stop."""

    name: str
    produces: tuple[str, ...]
    batches: Callable[[], Iterable[SourceItem] | AsyncIterable[SourceItem]]
    resource: str | None = None


@dataclass(frozen=True, slots=True)
class PipelineResult:
    """Rows each task processed (and the source created), the wall time (event-loop seconds:
    virtual on a virtual clock), the pipeline's tracer (None when it ran untraced), and whether
    it ended early through ``Pipeline.stop()``."""

    rows: Mapping[str, int]
    wall_s: float
    tracer: Tracer | None = None
    stopped: bool = False


@dataclass
class Pipeline:
    """A source and tasks over one partition of a store. ``validate()`` runs before ``run``.

    ``tracer``: record spans of every iteration (see the module docstring); if its
    ``throughput_task`` is unset, the last task is taken as the sample consumer."""

    source: Source
    tasks: Sequence[Task]
    partition: str = "pipeline"
    capacity: Capacity | None = None
    tracer: Tracer | None = None
    _fields: tuple[str, ...] = field(default=(), init=False, repr=False)
    _stop: asyncio.Event | None = field(default=None, init=False, repr=False)
    _stop_requested: bool = field(default=False, init=False, repr=False)

    def stop(self) -> None:
        """Ask the running pipeline to end now, e.g. once the trainer took its last step: every
        worker is cancelled (rows in flight are left unacknowledged) and ``run`` returns a
        result with ``stopped=True``. Call it from the event loop (a task's ``async`` fn); a
        stop before ``run`` makes ``run`` return at once."""
        self._stop_requested = True
        if self._stop is not None:
            self._stop.set()

    # -- validation ----------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ``PipelineError`` listing every problem: bad names or sizes, a consumed field
        nobody produces, a field produced twice, a cycle."""
        problems: list[str] = []
        nodes: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
            (self.source.name, (), tuple(self.source.produces))
        ] + [(t.name, tuple(t.consumes), tuple(t.produces)) for t in self.tasks]
        names = [n for n, _, _ in nodes]
        for name in names:
            if not isinstance(name, str) or not name:
                problems.append(f"every task needs a non-empty name, got {name!r}")
        for dup in sorted({n for n in names if names.count(n) > 1}):
            problems.append(
                f"the name {dup!r} is used by {names.count(dup)} tasks; names must be unique"
            )
        if not self.source.produces:
            problems.append(f"source {self.source.name!r} produces no field")
        if not _is_callable(self.source.batches):
            problems.append(f"source {self.source.name!r}: batches must be callable")
        for t in self.tasks:
            if not t.consumes:
                problems.append(f"task {t.name!r} consumes no field; it would never be fed")
            if not _is_callable(t.fn):
                problems.append(f"task {t.name!r}: fn must be callable, got {t.fn!r}")
            for knob in ("batch_size", "workers"):
                value = getattr(t, knob)
                if not _positive_int(value):
                    problems.append(f"task {t.name!r}: {knob} must be an int >= 1, got {value!r}")
        producer: dict[str, str] = {}
        for name, _, produces in nodes:
            for f in produces:
                if f in producer:
                    problems.append(
                        f"field {f!r} is produced by both {producer[f]!r} and {name!r}; give "
                        "each field one producer"
                    )
                else:
                    producer[f] = name
        for name, consumes, produces in nodes:
            for f in consumes:
                if f in produces:
                    problems.append(f"task {name!r} consumes {f!r}, which it produces itself")
                elif f not in producer:
                    near = difflib.get_close_matches(f, list(producer), n=1)
                    hint = f" (did you mean {near[0]!r}?)" if near else ""
                    problems.append(
                        f"task {name!r} consumes {f!r}, which no task produces{hint}; produced "
                        f"fields: {sorted(producer)}"
                    )
        cycle = _find_cycle(nodes, producer)
        if cycle:
            problems.append("the tasks form a cycle: " + " -> ".join(cycle))
        if problems:
            raise PipelineError(
                f"pipeline over partition {self.partition!r} is invalid:\n  - "
                + "\n  - ".join(problems)
            )
        self._fields = tuple(producer)

    # -- running -------------------------------------------------------------------------------
    async def run(self, store: DataStore | None = None) -> PipelineResult:
        """Run to the end on ``store`` (default: a fresh ``InProcessDataStore``). A task that
        raises stops every other one and surfaces as ``TaskFailedError`` naming it."""
        self.validate()
        if store is None:
            from asyncflow_core.data.store import InProcessDataStore

            store = InProcessDataStore()
        await store.create_partition(
            self.partition, list(self._fields), capacity=self.capacity,
            tasks=[t.name for t in self.tasks],
        )  # fmt: skip
        counts: dict[str, int] = {self.source.name: 0, **{t.name: 0 for t in self.tasks}}
        threads = sum(t.workers for t in self.tasks if not _is_async(t.fn)) + 1
        executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="asyncflow-task")
        if self.tracer is not None:
            self.tracer.set_default_throughput_task(
                self.tasks[-1].name if self.tasks else self.source.name
            )
        loop = asyncio.get_running_loop()
        jobs: dict[asyncio.Task[None], str] = {}
        self._stop = asyncio.Event()
        if self._stop_requested:
            self._stop.set()
        stopper = asyncio.create_task(self._stop.wait())
        stopped = False
        t0 = loop.time()
        try:
            jobs[asyncio.create_task(self._feed(store, executor, counts))] = self.source.name
            for task in self.tasks:
                job = asyncio.create_task(self._serve(store, task, executor, counts))
                job.set_name(task.name)
                jobs[job] = task.name
            pending: set[asyncio.Task[Any]] = {*jobs, stopper}
            while pending - {stopper}:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if stopper in done:
                    stopped = True
                    break
                for job in done:
                    err = job.exception()
                    if err is not None:
                        name = jobs[job]
                        raise TaskFailedError(
                            name,
                            f"task {name!r} raised {type(err).__name__}: {err}; the pipeline "
                            "was stopped",
                        ) from err
        finally:
            stopper.cancel()
            for job in jobs:
                job.cancel()
            await asyncio.gather(stopper, *jobs, return_exceptions=True)
            # threads still inside a task's fn finish it; nothing new starts
            await loop.run_in_executor(
                None, lambda: executor.shutdown(wait=True, cancel_futures=True)
            )
            self._stop = None
            self._stop_requested = False
        return PipelineResult(counts, loop.time() - t0, self.tracer, stopped)

    def run_sync(self, store: DataStore | None = None) -> PipelineResult:
        return asyncio.run(self.run(store))

    async def _feed(
        self, store: DataStore, executor: ThreadPoolExecutor, counts: dict[str, int]
    ) -> None:
        loop = asyncio.get_running_loop()
        made = self.source.batches()
        # (with a tracer: a "task" span per batch a plain iterator makes, a "wait" span per
        # batch an async source yields, and a "put" span per put)
        done = object()
        tracer, name = self.tracer, self.source.name
        resource = self.source.resource
        sync_items: Iterator[SourceItem] | None = None
        async_items: AsyncIterator[SourceItem] | None = None
        if isinstance(made, AsyncIterable):
            async_items = aiter(made)
        else:
            sync_items = iter(made)
        while True:
            t_start = tracer.now() if tracer is not None else 0.0
            item: object
            if async_items is not None:
                item = await anext(async_items, done)
            else:
                assert sync_items is not None
                item = await loop.run_in_executor(executor, _next_or, sync_items, done)
            if item is done:
                break
            out = _normalize(name, self.source.produces, item, None)
            t_put = tracer.now() if tracer is not None else 0.0
            rows = await store.put(self.partition, out.data, tags=out.tags, timeout=None)
            counts[name] += len(rows)
            if tracer is not None:
                tokens, versions = _tag_stats(out.tags or ())
                # an async source mostly awaits something (admission, I/O): a "wait" span
                tracer.record(
                    "wait" if async_items is not None else "task", name, t_start, t_put,
                    resource=resource, rows=len(rows), tokens=tokens, versions=versions,
                )  # fmt: skip
                tracer.record("put", name, t_put, tracer.now(), resource=resource, rows=len(rows))
        await store.close(self.partition)

    async def _serve(
        self,
        store: DataStore,
        task: Task,
        executor: ThreadPoolExecutor,
        counts: dict[str, int],
    ) -> None:
        """Run one task: a single puller leases a batch whenever one of the task's
        ``workers`` slots is idle (lowest idle slot first) and runs it in that slot. One
        waiter per task on the store however many workers it has, so a change to the
        partition wakes a handful of pullers, not thousands of idle workers. A slot that
        raises ends the task with that exception.

        With one worker the slot's ack rides on the puller's next ``get_meta`` (``ack=``; one
        round trip less per batch on a remote store): the puller makes that call as soon as
        the slot is done, and the store commits the ack before any wait, so no ack is later
        than with its own call, and an ack that fails raises from that call, ending the task
        as before. With more workers the next ``get_meta`` may wait for another slot, so each
        slot acks by itself."""
        tracer = self.tracer
        fold = task.workers == 1
        unacked: BatchMeta | None = None  # fold: the finished batch the next get_meta acks
        failing = False
        if callable(task.sampler) and not hasattr(task.sampler, "select"):
            samplers: list[Scheduler | None] = [task.sampler() for _ in range(task.workers)]
        else:
            samplers = [task.sampler] * task.workers
        idle: asyncio.PriorityQueue[int] = asyncio.PriorityQueue()
        for w in range(task.workers):
            idle.put_nowait(w)
        t0 = tracer.now() if tracer is not None else 0.0
        idle_since = [t0] * task.workers
        done: list[Batch | None] = [None] * task.workers  # reuse_batch: each slot's last batch

        async def run_slot(
            worker: int, meta: BatchMeta, batch: Batch, version: Version | None
        ) -> None:
            nonlocal unacked
            try:
                await self._run_batch(
                    store, task, worker, meta, batch, version, idle_since[worker], executor,
                    ack=not fold,
                )  # fmt: skip
                if fold:
                    unacked = meta
                counts[task.name] += len(meta)
                if task.reuse_batch:
                    done[worker] = batch
            finally:
                if tracer is not None:
                    idle_since[worker] = tracer.now()
                idle.put_nowait(worker)

        try:
            async with asyncio.TaskGroup() as group:
                while True:
                    worker = await idle.get()
                    version = task.current_version() if task.current_version is not None else None
                    ack, unacked = unacked, None  # the store answers for it from here
                    meta = await get_meta_after_ack(
                        store, ack, self.partition, task.name, list(task.consumes),
                        task.batch_size, sampler=samplers[worker], timeout=None,
                        current_version=version, lease_s=task.lease_s,
                    )  # fmt: skip
                    if meta.end_of_stream:
                        idle.put_nowait(worker)
                        break
                    out, done[worker] = done[worker], None
                    if out is not None and sys.getrefcount(out) > 2:  # `out` and the call's
                        out = None  # fn kept its batch after all: leave that one alone
                    batch = await store.get_data(meta, layout=task.layout, out=out)
                    del out
                    if self._stop is not None and self._stop.is_set():
                        return  # stopping: start nothing new (the leased rows are abandoned)
                    group.create_task(run_slot(worker, meta, batch, version))
                    # the slot holds it now: a local reference here would make the slot's
                    # next reuse check (reference count) refuse it whenever the same slot
                    # comes back next
                    del batch
        except BaseExceptionGroup as eg:
            failing = True
            raise _first_leaf(eg) from None
        except BaseException:
            failing = True
            raise
        finally:
            if unacked is not None:  # done, but stopped or failed before the next get_meta
                meta, unacked = unacked, None
                if failing:  # the task's own error is the one to raise, not the ack's
                    with contextlib.suppress(Exception):
                        await store.ack(meta)
                else:
                    await store.ack(meta)
        if tracer is not None:  # every slot waited for data that never came
            end = tracer.now()
            for w in range(task.workers):
                tracer.record(
                    "wait", task.name, idle_since[w], end, resource=task.resource, worker=w,
                    end_of_stream=True,
                )  # fmt: skip

    async def _run_batch(
        self,
        store: DataStore,
        task: Task,
        worker: int,
        meta: BatchMeta,
        batch: Batch,
        version: Version | None,
        idle_since: float,
        executor: ThreadPoolExecutor,
        *,
        ack: bool = True,
    ) -> None:
        """One iteration of one worker slot (idle since ``idle_since``; ``version``: the
        task's current version when the batch was pulled): call, write the produced fields,
        ack (unless ``ack`` is False: the caller acks it later)."""
        tracer = self.tracer
        resource = task.resource

        async def call() -> object:
            if _is_async(task.fn):
                return await task.fn(batch)  # type: ignore[misc]
            return await asyncio.get_running_loop().run_in_executor(executor, task.fn, batch)

        if tracer is None:
            result = await call()
        else:
            t_run = tracer.now()
            tracer.record(
                "wait", task.name, idle_since, t_run, resource=resource, worker=worker,
                rows=len(meta),
            )  # fmt: skip
            try:
                result = await call()
            except BaseException as e:
                tracer.record(
                    "task", task.name, t_run, tracer.now(), resource=resource, worker=worker,
                    rows=len(meta), error=type(e).__name__,
                )  # fmt: skip
                raise
            _record_task(tracer, task, worker, t_run, tracer.now(), meta, result, version)
        if task.produces:
            out = _normalize(task.name, task.produces, result, len(meta))
            await store.put(self.partition, out.data, rows=meta.rows, tags=out.tags)
        elif result is not None:
            raise PipelineError(
                f"task {task.name!r} declares no produced fields but returned "
                f"{type(result).__name__}; return None or declare produces=..."
            )
        if ack:
            await store.ack(meta)


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first non-group exception of a (nested) exception group."""
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def _tag_stats(tags: Iterable[Tags]) -> tuple[int, tuple[int, int] | None]:
    """Total tokens of the rows and the (min, max) weight version over them (None if none)."""
    tokens, lo, hi = 0, None, None
    for t in tags:
        tokens += t.tokens
        if t.versions:
            lo = t.min_version if lo is None else min(lo, t.min_version)
            hi = t.max_version if hi is None else max(hi, t.max_version)
    return tokens, (lo, hi) if lo is not None and hi is not None else None


def _record_task(
    tracer: Tracer, task: Task, worker: int, start: float, end: float, meta: BatchMeta,
    result: object, version: Version | None,
) -> None:  # fmt: skip
    """Record a task iteration's span; its tokens and versions are those of the rows' tags
    after the task's own tags are merged in (so a rollout counts the tokens it generated).
    With a ``current_version`` the span also records each row's staleness: that version minus
    the row's oldest weight version (rows without versions are left out)."""
    tags: Sequence[Tags] = meta.tags
    out_tags = result.tags if isinstance(result, TaskOutput) else None
    if out_tags is not None and len(out_tags) == len(meta):
        if len(meta.tags) == len(meta):
            tags = [a.merged(b) for a, b in zip(meta.tags, out_tags, strict=True)]
        else:
            tags = out_tags
    tokens, versions = _tag_stats(tags)
    extra: dict[str, Any] = {}
    if version is not None:
        stale = [version - t.min_version for t in meta.tags if t.versions]
        if stale:
            extra["staleness"] = stale
    tracer.record(
        "task", task.name, start, end, resource=task.resource, worker=worker, rows=len(meta),
        tokens=tokens, versions=versions, **extra,
    )  # fmt: skip


def _is_callable(value: object) -> bool:
    return callable(value)


def _next_or(items: Iterator[SourceItem], default: object) -> object:
    return next(items, default)


def _is_async(fn: object) -> bool:
    """A coroutine function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004
    )


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _normalize(name: str, produces: Sequence[str], result: object, n: int | None) -> TaskOutput:
    """Check a callable's output against its declaration, with an error naming the task."""
    out = result if isinstance(result, TaskOutput) else None
    if out is None and isinstance(result, Mapping):
        out = TaskOutput(result)
    if out is None:
        raise PipelineError(
            f"{name!r} must return a TaskOutput or a mapping of its produced fields "
            f"{list(produces)}, got {type(result).__name__}"
        )
    if set(out.data) != set(produces):
        raise PipelineError(
            f"{name!r} returned fields {sorted(out.data)} but declares produces="
            f"{sorted(produces)}; return exactly the declared fields"
        )
    if n is not None:
        for f, values in out.data.items():
            if len(values) != n:
                raise PipelineError(
                    f"{name!r} returned {len(values)} values for field {f!r} but its batch "
                    f"had {n} rows; return one value per row"
                )
    return out


def _find_cycle(
    nodes: Sequence[tuple[str, tuple[str, ...], tuple[str, ...]]], producer: Mapping[str, str]
) -> list[str]:
    """A cycle of task names (first name repeated at the end), or [] if there is none."""
    edges: dict[str, set[str]] = {n: set() for n, _, _ in nodes}
    for name, consumes, _ in nodes:
        for f in consumes:
            src = producer.get(f)
            if src is not None and src != name:
                edges[src].add(name)
    state: dict[str, int] = {}  # 1 = on the current path, 2 = finished
    path: list[str] = []

    def visit(n: str) -> list[str]:
        state[n] = 1
        path.append(n)
        for m in sorted(edges[n]):
            if state.get(m) == 1:
                return [*path[path.index(m) :], m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        path.pop()
        state[n] = 2
        return []

    for n in edges:
        if n not in state:
            found = visit(n)
            if found:
                return found
    return []


__all__ = [
    "AsyncFlowError",
    "Pipeline",
    "PipelineError",
    "PipelineResult",
    "Source",
    "Task",
    "TaskFailedError",
    "TaskOutput",
]
