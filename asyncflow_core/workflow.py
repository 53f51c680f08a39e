"""Pipelines of tasks over one DataStore partition: typed composition, validation before
running, and an asyncio runner that runs each task's callable in a worker thread and stops
cleanly (a raising task stops everything with its name; cancel stops within the running
calls' duration and leaves no thread behind).

A ``Source`` creates rows; each ``Task`` pulls batches whose ``consumes`` fields are ready,
runs its callable on them and writes its ``produces`` fields back into the same rows. The
pipeline ends when the source is exhausted and every task has consumed every row.

With a ``tracer`` (``asyncflow_core.trace.Tracer``) the runner records, per worker and
iteration: a "wait" span around ``get_meta`` + ``get_data`` (rows leased), a "task" span around
the callable (rows, tokens, weight versions), and for the source a "task" span per batch it
generates and a "put" span per put of new rows (which may wait for capacity).
"""

from __future__ import annotations

import asyncio
import difflib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from asyncflow_core.errors import AsyncFlowError, PipelineError, TaskFailedError
from asyncflow_core.protocols import (
    Batch,
    BatchMeta,
    Capacity,
    CellValue,
    DataStore,
    Layout,
    Scheduler,
    Tags,
)
from asyncflow_core.trace import Tracer

FieldValues = Sequence[CellValue] | torch.Tensor


@dataclass(frozen=True, slots=True)
class TaskOutput:
    """What a task or source returns: one value per row for each produced field, and
    optionally one ``Tags`` per row (merged into the rows' tags)."""

    data: Mapping[str, FieldValues]
    tags: Sequence[Tags] | None = None


TaskFn = Callable[[Batch], TaskOutput | Mapping[str, FieldValues] | None]
"""A task's callable: gets the batch of its consumed fields, returns its produced fields."""


@dataclass(frozen=True, slots=True)
class Task:
    """One stage of a pipeline.

    ``fn(batch)`` runs in a worker thread (engine calls release the GIL inside their kernels)
    and returns the ``produces`` fields for ``batch.rows`` (a ``TaskOutput`` or a plain
    mapping; ``None`` when it produces nothing). ``workers`` coroutines pull batches of
    ``batch_size`` rows concurrently. ``sampler`` (a Scheduler, or a zero-argument factory
    giving each worker its own) chooses the rows; default sequential.
    """

    name: str
    fn: TaskFn
    consumes: tuple[str, ...]
    produces: tuple[str, ...] = ()
    batch_size: int = 1
    workers: int = 1
    sampler: Scheduler | Callable[[], Scheduler] | None = None
    layout: Layout = "padded"


@dataclass(frozen=True, slots=True)
class Source:
    """Creates the rows: ``batches()`` yields one ``TaskOutput`` (or mapping) per put of new
    rows, holding every field in ``produces``. When it is exhausted the partition is closed,
    so the tasks drain the remaining rows and stop."""

    name: str
    produces: tuple[str, ...]
    batches: Callable[[], Iterable[TaskOutput | Mapping[str, FieldValues]]]


@dataclass(frozen=True, slots=True)
class PipelineResult:
    """Rows each task processed (and the source created), the wall time, and the pipeline's
    tracer (None when it ran untraced)."""

    rows: Mapping[str, int]
    wall_s: float
    tracer: Tracer | None = None


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
            from asyncflow_core.store import InProcessDataStore

            store = InProcessDataStore()
        await store.create_partition(
            self.partition, list(self._fields), capacity=self.capacity,
            tasks=[t.name for t in self.tasks],
        )  # fmt: skip
        counts: dict[str, int] = {self.source.name: 0, **{t.name: 0 for t in self.tasks}}
        threads = sum(t.workers for t in self.tasks) + 1
        executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="asyncflow-task")
        if self.tracer is not None:
            self.tracer.set_default_throughput_task(
                self.tasks[-1].name if self.tasks else self.source.name
            )
        loop = asyncio.get_running_loop()
        jobs: dict[asyncio.Task[None], str] = {}
        t0 = time.perf_counter()
        try:
            jobs[asyncio.create_task(self._feed(store, executor, counts))] = self.source.name
            for task in self.tasks:
                for w in range(task.workers):
                    job = asyncio.create_task(self._work(store, task, w, executor, counts))
                    job.set_name(f"{task.name}[{w}]")
                    jobs[job] = task.name
            pending: set[asyncio.Task[None]] = set(jobs)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
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
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
            # threads still inside a task's fn finish it; nothing new starts
            await loop.run_in_executor(
                None, lambda: executor.shutdown(wait=True, cancel_futures=True)
            )
        return PipelineResult(counts, time.perf_counter() - t0, self.tracer)

    def run_sync(self, store: DataStore | None = None) -> PipelineResult:
        return asyncio.run(self.run(store))

    async def _feed(
        self, store: DataStore, executor: ThreadPoolExecutor, counts: dict[str, int]
    ) -> None:
        loop = asyncio.get_running_loop()
        batches: Iterator[TaskOutput | Mapping[str, FieldValues]] = iter(self.source.batches())
        done = object()
        tracer, name = self.tracer, self.source.name
        while True:
            t_start = tracer.now() if tracer is not None else 0.0
            item = await loop.run_in_executor(executor, next, batches, done)
            if item is done:
                break
            out = _normalize(name, self.source.produces, item, None)
            t_put = tracer.now() if tracer is not None else 0.0
            rows = await store.put(self.partition, out.data, tags=out.tags, timeout=None)
            counts[name] += len(rows)
            if tracer is not None:
                tokens, versions = _tag_stats(out.tags or ())
                tracer.record(
                    "task", name, t_start, t_put, rows=len(rows), tokens=tokens,
                    versions=versions,
                )  # fmt: skip
                tracer.record("put", name, t_put, tracer.now(), rows=len(rows))
        await store.close(self.partition)

    async def _work(
        self,
        store: DataStore,
        task: Task,
        worker: int,
        executor: ThreadPoolExecutor,
        counts: dict[str, int],
    ) -> None:
        loop = asyncio.get_running_loop()
        tracer = self.tracer
        sampler = (
            task.sampler()
            if callable(task.sampler) and not hasattr(task.sampler, "select")
            else task.sampler
        )
        while True:
            t_wait = tracer.now() if tracer is not None else 0.0
            meta = await store.get_meta(
                self.partition, task.name, list(task.consumes), task.batch_size,
                sampler=sampler, timeout=None,
            )  # fmt: skip
            if meta.end_of_stream:
                if tracer is not None:
                    tracer.record(
                        "wait", task.name, t_wait, tracer.now(), worker=worker,
                        end_of_stream=True,
                    )  # fmt: skip
                return
            batch = await store.get_data(meta, layout=task.layout)
            if tracer is None:
                result = await loop.run_in_executor(executor, task.fn, batch)
            else:
                t_run = tracer.now()
                tracer.record("wait", task.name, t_wait, t_run, worker=worker, rows=len(meta))
                try:
                    result = await loop.run_in_executor(executor, task.fn, batch)
                except BaseException as e:
                    tracer.record(
                        "task", task.name, t_run, tracer.now(), worker=worker, rows=len(meta),
                        error=type(e).__name__,
                    )  # fmt: skip
                    raise
                _record_task(tracer, task.name, worker, t_run, tracer.now(), meta, result)
            if task.produces:
                out = _normalize(task.name, task.produces, result, len(meta))
                await store.put(self.partition, out.data, rows=meta.rows, tags=out.tags)
            elif result is not None:
                raise PipelineError(
                    f"task {task.name!r} declares no produced fields but returned "
                    f"{type(result).__name__}; return None or declare produces=..."
                )
            await store.ack(meta)
            counts[task.name] += len(meta)


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
    tracer: Tracer, name: str, worker: int, start: float, end: float, meta: BatchMeta,
    result: object,
) -> None:  # fmt: skip
    """Record a task iteration's span; its tokens and versions are those of the rows' tags
    after the task's own tags are merged in (so a rollout counts the tokens it generated)."""
    tags: Sequence[Tags] = meta.tags
    out_tags = result.tags if isinstance(result, TaskOutput) else None
    if out_tags is not None and len(out_tags) == len(meta):
        if len(meta.tags) == len(meta):
            tags = [a.merged(b) for a, b in zip(meta.tags, out_tags, strict=True)]
        else:
            tags = out_tags
    tokens, versions = _tag_stats(tags)
    tracer.record(
        "task", name, start, end, worker=worker, rows=len(meta), tokens=tokens, versions=versions
    )


def _is_callable(value: object) -> bool:
    return callable(value)


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
