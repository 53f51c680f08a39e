"""Tracing: spans of every task iteration, wait and weight sync, their exports and a summary.

A ``Tracer`` collects ``Span`` records (one per task iteration, wait or sync phase) and metric
records (reward, loss, ... per step). Recording only appends a small record under a lock; all
I/O happens in the exporters:

* ``write_chrome_trace(path)``: Chrome trace event JSON (opens in Perfetto / chrome://tracing);
  one process per resource, one thread per worker. ``load(path)`` reads it back.
* ``write_metrics_jsonl(path)``: one JSON object per metric record.
* ``summary()`` / ``format_summary()``: per-resource busy/idle and bubble ratio, samples/s and
  tokens/s, staleness histogram, weight-sync time exposed vs hidden.
* ``plot_timeline(path)``: a PNG timeline (needs the ``plot`` extra, matplotlib).

Definitions used by ``summary()`` (all times in seconds, relative to the tracer's start):

* **wall**: from the earliest span start to the latest span end, over spans of every kind.
* **busy** (per resource): the length of the *union* of that resource's busy intervals, so
  two workers of one resource that overlap count once. Busy spans are those whose ``kind`` is
  in ``busy_kinds`` (default ``{"task", "sync"}``); "wait" and "put" spans are not busy.
* **work**: the plain sum of the busy spans' durations (exceeds ``busy`` when workers overlap).
* **idle** = wall − busy; **bubble ratio** = idle / wall (0 when wall is 0). A resource whose
  first span starts late, or whose last ends early, is idle for the difference: pipeline fill
  and drain are bubbles too. The overall bubble ratio is the mean over resources.
* **samples/s, tokens/s**: rows and tokens of the "task" spans of the *throughput task*,
  divided by wall. The throughput task is the ``throughput_task`` argument, else the tracer's
  ``throughput_task`` (a ``Pipeline`` sets it to its last task, the sample consumer, if unset),
  else the task whose last "task" span ends latest.
* **staleness**: from spans whose ``args["staleness"]`` is set by whoever knows it (consumer
  weight version − the row's oldest weight version): an int applies to each of the span's rows
  (counted ``max(rows, 1)`` times), a list of ints gives one value per row.
* **sync exposed / hidden**: the summed durations of "sync" spans with ``exposed=True``
  (something waited on them) / ``exposed=False`` (overlapped with other work); ``exposed=None``
  is reported as unmarked.
"""

from __future__ import annotations

import gzip
import importlib
import json
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NamedTuple

from asyncflow_core.contracts.errors import AsyncFlowError, MissingExtraError

TRACE_FORMAT = "asyncflow-trace/1"
"""Written into the Chrome trace's ``otherData.format``; ``load`` accepts files without it."""

BUSY_KINDS: frozenset[str] = frozenset({"task", "sync"})
"""Span kinds that occupy their resource (count as busy in ``summary``)."""

MetricValue = float | int | str | bool | None


class TraceFormatError(AsyncFlowError, ValueError):
    """A file given to ``load`` is not a Chrome-trace JSON file (or is corrupt)."""


@dataclass(frozen=True, slots=True)
class Span:
    """One interval of one worker of one resource.

    ``kind``: "task" (a task iteration), "wait" (waiting for data), "put" (writing new rows,
    which may wait for capacity), "sync" (a weight-sync phase), or any other label.
    ``name``: the task name or sync phase. ``resource``: what the span occupies (e.g. "rollout",
    "trainer"). ``start``/``end``: seconds since the tracer's start. ``versions``: (min, max)
    weight version of the rows, if known. ``exposed``: for sync spans, whether something waited
    on it. ``args``: free-form JSON-able values (e.g. ``staleness``).
    """

    kind: str
    name: str
    resource: str
    worker: int
    start: float
    end: float
    rows: int = 0
    tokens: int = 0
    versions: tuple[int, int] | None = None
    exposed: bool | None = None
    args: Mapping[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(slots=True)
class OpenSpan:
    """The span being recorded by ``Tracer.span``: set ``rows``, ``tokens``, ``versions``,
    ``exposed`` or ``args`` inside the ``with`` block; the span is recorded when it exits."""

    kind: str
    name: str
    resource: str
    worker: int
    rows: int = 0
    tokens: int = 0
    versions: tuple[int, int] | None = None
    exposed: bool | None = None
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class MetricRecord:
    """One line of ``metrics.jsonl``: ``t`` seconds since the tracer's start, an optional
    ``step`` and named values (reward, loss, ...)."""

    t: float
    step: int | None
    values: Mapping[str, MetricValue]

    def as_json(self) -> dict[str, Any]:
        return {"t": self.t, "step": self.step, **self.values}


class TraceMark(NamedTuple):
    """A place in a ``Tracer``: the number of spans and of metric records recorded before it."""

    spans: int
    metrics: int


START = TraceMark(0, 0)  # the beginning of every trace


class Tracer:
    """Collects spans and metric records; thread-safe, no I/O until an export is called.

    ``clock`` (default ``time.perf_counter``) gives seconds; times are stored relative to the
    clock's value when the tracer was made. ``throughput_task`` names the task whose rows are
    the samples in ``summary`` (see the module docstring for the default).
    """

    def __init__(
        self,
        *,
        throughput_task: str | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.throughput_task = throughput_task
        self._clock = clock
        self.t0 = clock()
        self.t0_unix = time.time()
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self._metrics: list[MetricRecord] = []

    # -- recording -------------------------------------------------------------------------------
    def now(self) -> float:
        """Seconds since the tracer started (the time base of every span)."""
        return self._clock() - self.t0

    def continue_at(self, t: float) -> None:
        """Move the time base so that ``now()`` reads ``t`` seconds: a trace read back with
        ``load`` (e.g. a checkpoint's) then continues where it stopped instead of overlapping
        its own past."""
        self.t0 = self._clock() - t

    def add(self, span: Span) -> None:
        with self._lock:
            self._spans.append(span)

    def record(
        self,
        kind: str,
        name: str,
        start: float,
        end: float,
        *,
        resource: str | None = None,
        worker: int = 0,
        rows: int = 0,
        tokens: int = 0,
        versions: tuple[int, int] | None = None,
        exposed: bool | None = None,
        **args: Any,
    ) -> Span:
        """Record a finished span (``start``/``end`` from ``now()``); ``resource`` defaults to
        ``name``. Returns the span."""
        span = Span(
            kind, name, name if resource is None else resource, worker, start, end,
            rows, tokens, versions, exposed, args,
        )  # fmt: skip
        self.add(span)
        return span

    @contextmanager
    def span(
        self,
        kind: str,
        name: str,
        *,
        resource: str | None = None,
        worker: int = 0,
        rows: int = 0,
        tokens: int = 0,
        versions: tuple[int, int] | None = None,
        exposed: bool | None = None,
        **args: Any,
    ) -> Iterator[OpenSpan]:
        """Time the ``with`` block as one span; the yielded ``OpenSpan`` can be filled in. A
        block that raises is still recorded, with ``args["error"]`` naming the exception."""
        open_span = OpenSpan(
            kind, name, name if resource is None else resource, worker,
            rows, tokens, versions, exposed, dict(args),
        )  # fmt: skip
        start = self.now()
        try:
            yield open_span
        except BaseException as e:
            open_span.args["error"] = type(e).__name__
            raise
        finally:
            o = open_span
            done = Span(
                o.kind, o.name, o.resource, o.worker, start, self.now(),
                o.rows, o.tokens, o.versions, o.exposed, o.args,
            )  # fmt: skip
            self.add(done)

    def metric(self, step: int | None = None, **values: MetricValue) -> MetricRecord:
        """Record step metrics (``tracer.metric(step=3, reward=0.5, loss=1.2)``)."""
        rec = MetricRecord(self.now(), step, values)
        with self._lock:
            self._metrics.append(rec)
        return rec

    def set_default_throughput_task(self, name: str) -> None:
        """Set ``throughput_task`` unless it is already set."""
        with self._lock:
            if self.throughput_task is None:
                self.throughput_task = name

    @property
    def spans(self) -> list[Span]:
        """A snapshot of the spans recorded so far, in recording order."""
        with self._lock:
            return list(self._spans)

    @property
    def metrics(self) -> list[MetricRecord]:
        with self._lock:
            return list(self._metrics)

    def mark(self) -> TraceMark:
        """How many spans and metric records are recorded now: a place in the trace for
        ``chrome_trace(since=, until=)`` (e.g. a checkpoint writing only what is new)."""
        with self._lock:
            return TraceMark(len(self._spans), len(self._metrics))

    # -- exports -----------------------------------------------------------------------------------
    def chrome_trace(
        self, *, since: TraceMark = START, until: TraceMark | None = None
    ) -> dict[str, Any]:
        """The trace as a Chrome trace event object: "X" events (pid = resource, tid = worker,
        ts/dur in microseconds), "M" events naming processes and threads, "C" counter events
        for numeric metrics. Each "X" event's args hold the span's fields, so ``load`` can
        rebuild it exactly. ``since`` / ``until`` (``mark()``s): only the spans and metric
        records recorded between the two (a segment; ``load`` of every segment in order gives
        the whole trace back)."""
        with self._lock:
            end = TraceMark(len(self._spans), len(self._metrics)) if until is None else until
            spans = self._spans[since.spans : end.spans]
            metrics = self._metrics[since.metrics : end.metrics]
        pids: dict[str, int] = {}
        for s in sorted(spans, key=lambda s: s.start):
            pids.setdefault(s.resource, len(pids) + 1)
        events: list[dict[str, Any]] = []
        for resource, pid in pids.items():
            events.append(_meta("process_name", pid, 0, {"name": resource}))
            events.append(_meta("process_sort_index", pid, 0, {"sort_index": pid}))
        resource_of = {pid: resource for resource, pid in pids.items()}
        for pid, worker in sorted({(pids[s.resource], s.worker) for s in spans}):
            resource = resource_of[pid]
            events.append(_meta("thread_name", pid, worker, {"name": f"{resource}[{worker}]"}))
        for s in spans:
            args: dict[str, Any] = {
                "kind": s.kind,
                "resource": s.resource,
                "worker": s.worker,
                "rows": s.rows,
                "tokens": s.tokens,
                "start_s": s.start,
                "end_s": s.end,
            }
            if s.versions is not None:
                args["versions"] = list(s.versions)
            if s.exposed is not None:
                args["exposed"] = s.exposed
            if s.args:
                args["extra"] = dict(s.args)
            events.append(
                {
                    "name": s.name,
                    "cat": s.kind,
                    "ph": "X",
                    "ts": round(s.start * 1e6, 3),
                    "dur": round(max(s.duration, 0.0) * 1e6, 3),
                    "pid": pids[s.resource],
                    "tid": s.worker,
                    "args": args,
                }
            )
        metrics_pid = len(pids) + 1
        numeric = [m for m in metrics if any(_is_number(v) for v in m.values.values())]
        if numeric:
            events.append(_meta("process_name", metrics_pid, 0, {"name": "metrics"}))
        for m in numeric:
            values = {k: v for k, v in m.values.items() if _is_number(v)}
            if m.step is not None:
                values["step"] = m.step
            events.append(
                {
                    "name": "metrics",
                    "ph": "C",
                    "ts": round(m.t * 1e6, 3),
                    "pid": metrics_pid,
                    "tid": 0,
                    "args": values,
                }
            )
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {
                "format": TRACE_FORMAT,
                "t0_unix": self.t0_unix,
                "throughput_task": self.throughput_task,
                "metrics": [m.as_json() for m in metrics],
            },
        }

    def write_chrome_trace(
        self, path: str | Path, *, since: TraceMark = START, until: TraceMark | None = None
    ) -> Path:
        """Write ``chrome_trace(since=, until=)`` as JSON (gzip-compressed, fast level, if the
        name ends in ".gz")."""
        path = Path(path)
        with _open(path, "w") as f:
            doc = self.chrome_trace(since=since, until=until)
            json.dump(doc, f, default=_jsonable, separators=(",", ":"))
        return path

    def write_metrics_jsonl(self, path: str | Path, *, start: int = 0) -> Path:
        """Write one JSON object per metric record: ``{"t": ..., "step": ..., **values}``.
        ``start`` > 0 appends the records from that index on (a log kept up to date step by
        step)."""
        path = Path(path)
        with self._lock:
            records = self._metrics[start:]
        with _open(path, "a" if start else "w") as f:
            for m in records:
                f.write(json.dumps(m.as_json(), default=_jsonable) + "\n")
        return path

    def summary(
        self,
        *,
        throughput_task: str | None = None,
        busy_kinds: Iterable[str] = BUSY_KINDS,
    ) -> dict[str, Any]:
        """The numbers defined in the module docstring, as a JSON-able dict."""
        return summarize(
            self.spans,
            throughput_task=throughput_task or self.throughput_task,
            busy_kinds=busy_kinds,
            metrics=self.metrics,
        )

    def plot_timeline(
        self, path: str | Path, *, title: str | None = None, max_lanes_per_resource: int = 4
    ) -> Path:
        """Draw the spans as a PNG timeline: one row per resource/worker, coloured by kind
        (see the module-level ``plot_timeline``). Needs matplotlib (``asyncflow[plot]``)."""
        return plot_timeline(
            self.spans, path, title=title, max_lanes_per_resource=max_lanes_per_resource
        )


# -- summary -----------------------------------------------------------------------------------
def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total = 0.0
    cur_start = cur_end = -math.inf
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if a > cur_end:
            if cur_end > cur_start:
                total += cur_end - cur_start
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    if cur_end > cur_start:
        total += cur_end - cur_start
    return total


def summarize(
    spans: Sequence[Span],
    *,
    throughput_task: str | None = None,
    busy_kinds: Iterable[str] = BUSY_KINDS,
    metrics: Sequence[MetricRecord] = (),
) -> dict[str, Any]:
    """Summarize spans (see the module docstring for every definition)."""
    busy = frozenset(busy_kinds)
    if spans:
        t_start = min(s.start for s in spans)
        t_end = max(s.end for s in spans)
    else:
        t_start = t_end = 0.0
    wall = max(t_end - t_start, 0.0)

    def ratio(x: float) -> float:
        return x / wall if wall > 0 else 0.0

    resources: dict[str, dict[str, Any]] = {}
    for resource in sorted({s.resource for s in spans}):
        mine = [s for s in spans if s.resource == resource]
        working = [s for s in mine if s.kind in busy]
        busy_s = union_length((s.start, s.end) for s in working)
        idle_s = max(wall - busy_s, 0.0)
        resources[resource] = {
            "workers": len({s.worker for s in mine}),
            "spans": len(mine),
            "busy_s": busy_s,
            "work_s": sum(s.duration for s in working),
            "idle_s": idle_s,
            "bubble_ratio": ratio(idle_s),
            "rows": sum(s.rows for s in mine if s.kind == "task"),
            "tokens": sum(s.tokens for s in mine if s.kind == "task"),
        }
    bubble = (
        sum(r["bubble_ratio"] for r in resources.values()) / len(resources) if resources else 0.0
    )

    task_spans = [s for s in spans if s.kind == "task"]
    if throughput_task is None and task_spans:
        throughput_task = max(task_spans, key=lambda s: (s.end, s.name)).name
    consumed = [s for s in task_spans if s.name == throughput_task]
    samples = sum(s.rows for s in consumed)
    tokens = sum(s.tokens for s in consumed)

    waits: dict[str, dict[str, float]] = {}
    for name in sorted({s.name for s in spans if s.kind == "wait"}):
        durations = [s.duration for s in spans if s.kind == "wait" and s.name == name]
        waits[name] = {
            "count": len(durations),
            "total_s": sum(durations),
            "mean_s": sum(durations) / len(durations),
            "max_s": max(durations),
        }

    hist: Counter[int] = Counter()
    for s in spans:
        value = s.args.get("staleness")
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int | float):
            hist[int(value)] += max(s.rows, 1)
        elif isinstance(value, list | tuple):
            hist.update(int(v) for v in value)
    n_stale = sum(hist.values())

    sync = [s for s in spans if s.kind == "sync"]
    phases: dict[str, dict[str, float]] = {}
    for name in sorted({s.name for s in sync}):
        phases[name] = _sync_totals([s for s in sync if s.name == name])

    return {
        "start_s": t_start,
        "end_s": t_end,
        "wall_s": wall,
        "spans": len(spans),
        "busy_kinds": sorted(busy),
        "resources": resources,
        "bubble_ratio": bubble,
        "throughput": {
            "task": throughput_task,
            "samples": samples,
            "tokens": tokens,
            "samples_per_s": ratio(samples),
            "tokens_per_s": ratio(tokens),
        },
        "waits": waits,
        "staleness": {
            "histogram": dict(sorted(hist.items())),
            "count": n_stale,
            "mean": sum(k * v for k, v in hist.items()) / n_stale if n_stale else None,
            "max": max(hist) if hist else None,
        },
        "sync": {**_sync_totals(sync), "phases": phases},
        "metrics": {
            "records": len(metrics),
            "last": metrics[-1].as_json() if metrics else None,
        },
    }


def _sync_totals(spans: Sequence[Span]) -> dict[str, float]:
    return {
        "count": len(spans),
        "exposed_s": sum(s.duration for s in spans if s.exposed is True),
        "hidden_s": sum(s.duration for s in spans if s.exposed is False),
        "unmarked_s": sum(s.duration for s in spans if s.exposed is None),
    }


def format_summary(summary: Mapping[str, Any]) -> str:
    """A readable, fixed-width rendering of ``summary()``'s dict."""
    lines = [
        f"trace: {summary['spans']} spans over {summary['wall_s']:.3f} s wall "
        f"(busy kinds: {', '.join(summary['busy_kinds'])})",
        "",
    ]
    resources: Mapping[str, Mapping[str, Any]] = summary["resources"]
    width = max([len("resource"), *(len(r) for r in resources)])
    lines.append(
        f"{'resource':<{width}}  {'workers':>7}  {'busy s':>9}  {'idle s':>9}  {'bubble':>7}  "
        f"{'rows':>9}  {'tokens':>11}"
    )
    for name, r in resources.items():
        lines.append(
            f"{name:<{width}}  {r['workers']:>7}  {r['busy_s']:>9.3f}  {r['idle_s']:>9.3f}  "
            f"{r['bubble_ratio']:>7.1%}  {r['rows']:>9,}  {r['tokens']:>11,}"
        )
    lines.append(f"overall bubble ratio (mean over resources): {summary['bubble_ratio']:.1%}")

    tp = summary["throughput"]
    lines += [
        "",
        f"throughput (task {tp['task']!r}): {tp['samples']:,} samples, {tp['tokens']:,} tokens"
        f" -> {tp['samples_per_s']:,.1f} samples/s, {tp['tokens_per_s']:,.1f} tokens/s",
    ]

    waits: Mapping[str, Mapping[str, float]] = summary["waits"]
    if waits:
        w_width = max([len("waiting task"), *(len(n) for n in waits)])
        lines += [
            "",
            f"{'waiting task':<{w_width}}  {'count':>7}  {'total s':>9}  {'mean ms':>9}  "
            f"{'max ms':>9}",
        ]
        for name, w in waits.items():
            lines.append(
                f"{name:<{w_width}}  {w['count']:>7.0f}  {w['total_s']:>9.3f}  "
                f"{w['mean_s'] * 1e3:>9.2f}  {w['max_s'] * 1e3:>9.2f}"
            )

    sync = summary["sync"]
    lines.append("")
    if sync["count"]:
        text = (
            f"weight sync: {sync['count']:.0f} spans, exposed {sync['exposed_s']:.3f} s, "
            f"hidden {sync['hidden_s']:.3f} s"
        )
        if sync["unmarked_s"]:
            text += f", unmarked {sync['unmarked_s']:.3f} s"
        lines.append(text)
        for name, p in sync["phases"].items():
            lines.append(
                f"  {name}: {p['count']:.0f} x, exposed {p['exposed_s']:.3f} s, "
                f"hidden {p['hidden_s']:.3f} s"
            )
    else:
        lines.append("weight sync: none recorded")

    st = summary["staleness"]
    if st["count"]:
        lines.append(f"staleness ({st['count']:,} rows, mean {st['mean']:.2f}, max {st['max']}):")
        hist: Mapping[Any, int] = st["histogram"]
        top = max(hist.values())
        for k, v in hist.items():
            bar = "#" * max(1, round(40 * v / top))
            lines.append(f"  {k!s:>4}  {v:>9,}  {bar}")
    else:
        lines.append("staleness: none recorded")
    metrics = summary.get("metrics") or {}
    if metrics.get("records"):
        lines.append(f"metrics: {metrics['records']} records, last {metrics['last']}")
    return "\n".join(lines)


# -- loading -----------------------------------------------------------------------------------
def load(path: str | Path, *more: str | Path) -> Tracer:
    """Read a Chrome trace JSON (``.json`` or ``.json.gz``) back into a ``Tracer``; with
    ``more`` paths, the segments of one trace in order (``write_chrome_trace(since=)``), their
    spans and metric records appended one file after the other.

    Files written by ``write_chrome_trace`` come back exactly (spans and metrics). "X" events
    of other tools are read too: kind from ``cat`` (default "task"), resource from the process
    name, worker from ``tid``. Raises ``OSError`` if the file cannot be read and
    ``TraceFormatError`` if it is not a Chrome trace."""
    tracer = _load_one(Path(path), None)
    for segment in more:
        _load_one(Path(segment), tracer)
    return tracer


def _load_one(path: Path, into: Tracer | None) -> Tracer:
    """Read one file; into a new ``Tracer`` (None) or appended to ``into``."""
    try:
        with _open(path, "r") as f:
            doc = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, EOFError, gzip.BadGzipFile) as e:
        raise TraceFormatError(f"{str(path)!r} is not a Chrome-trace JSON file: {e}") from e
    other: Any = {}
    if isinstance(doc, list):
        events = doc
    elif isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list):
        events, other = doc["traceEvents"], doc.get("otherData") or {}
    else:
        raise TraceFormatError(
            f"{str(path)!r} is not a Chrome-trace JSON file: expected an object with a "
            '"traceEvents" list (or a list of events)'
        )
    if into is not None:
        tracer = into
    else:
        tracer = Tracer(
            throughput_task=other.get("throughput_task") if isinstance(other, dict) else None
        )
        if isinstance(other, dict) and isinstance(other.get("t0_unix"), int | float):
            tracer.t0_unix = float(other["t0_unix"])
    try:
        names = {
            e["pid"]: str(e["args"]["name"])
            for e in events
            if isinstance(e, dict) and e.get("ph") == "M" and e.get("name") == "process_name"
        }
        for event in events:
            if isinstance(event, dict) and event.get("ph") == "X":
                tracer.add(_span_from_event(event, names))
        metrics = other.get("metrics") if isinstance(other, dict) else None
        for m in metrics if isinstance(metrics, list) else ():
            values = {k: v for k, v in m.items() if k not in ("t", "step")}
            tracer._metrics.append(MetricRecord(float(m["t"]), m.get("step"), values))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise TraceFormatError(
            f"{str(path)!r} is not a valid Chrome-trace JSON file: bad event ({e!r})"
        ) from e
    return tracer


def _span_from_event(e: Mapping[str, Any], names: Mapping[Any, str]) -> Span:
    args = e.get("args") or {}
    if "start_s" in args and "end_s" in args and "resource" in args:
        versions = args.get("versions")
        return Span(
            kind=str(args.get("kind", e.get("cat", "task"))),
            name=str(e["name"]),
            resource=str(args["resource"]),
            worker=int(args.get("worker", 0)),
            start=float(args["start_s"]),
            end=float(args["end_s"]),
            rows=int(args.get("rows", 0)),
            tokens=int(args.get("tokens", 0)),
            versions=(int(versions[0]), int(versions[1])) if versions else None,
            exposed=args.get("exposed"),
            args=dict(args.get("extra") or {}),
        )
    start = float(e["ts"]) / 1e6
    tid = e.get("tid", 0)
    return Span(
        kind=str(e.get("cat") or "task"),
        name=str(e["name"]),
        resource=names.get(e.get("pid"), str(e.get("pid", "?"))),
        worker=tid if isinstance(tid, int) else 0,
        start=start,
        end=start + float(e.get("dur", 0)) / 1e6,
        args=dict(args) if isinstance(args, dict) else {},
    )


# -- plotting ----------------------------------------------------------------------------------
KIND_COLORS = {"task": "tab:blue", "wait": "tab:gray", "put": "tab:olive", "sync": "tab:red"}


def plot_timeline(
    spans: Sequence[Span],
    path: str | Path,
    *,
    title: str | None = None,
    max_lanes_per_resource: int = 4,
) -> Path:
    """Write a PNG timeline of ``spans`` (one row per resource/worker, coloured by kind;
    exposed syncs hatched). A resource with more than ``max_lanes_per_resource`` workers gets
    one row, "resource[N workers]", showing when any of them was busy (its waits left out).
    Raises ``MissingExtraError`` without matplotlib."""
    try:
        figure_mod = importlib.import_module("matplotlib.figure")
        patches = importlib.import_module("matplotlib.patches")
    except ImportError as e:
        raise MissingExtraError(
            "plot_timeline needs matplotlib, which is not installed; install the plot extra: "
            "pip install 'asyncflow[plot]'"
        ) from e
    path = Path(path)
    workers: dict[str, set[int]] = {}
    for sp in spans:
        workers.setdefault(sp.resource, set()).add(sp.worker)
    crowded = {r: len(w) for r, w in workers.items() if len(w) > max_lanes_per_resource}
    spans = [
        Span(sp.kind, sp.name, sp.resource, -1, sp.start, sp.end, exposed=sp.exposed)
        if sp.resource in crowded else sp
        for sp in spans
        if not (sp.resource in crowded and sp.kind not in BUSY_KINDS)
    ]  # fmt: skip
    lanes = sorted({(s.resource, s.worker) for s in spans})
    index = {lane: i for i, lane in enumerate(lanes)}
    fig = figure_mod.Figure(figsize=(12, 1.0 + 0.45 * max(len(lanes), 1)), dpi=120)
    ax = fig.add_subplot(1, 1, 1)
    kinds = sorted({s.kind for s in spans})
    palette = ["tab:green", "tab:purple", "tab:orange", "tab:brown", "tab:pink", "tab:cyan"]
    colors = {k: KIND_COLORS.get(k) or palette[i % len(palette)] for i, k in enumerate(kinds)}
    for lane, i in index.items():
        for kind in kinds:
            for exposed in (False, True):
                bars = [
                    (s.start, max(s.duration, 0.0))
                    for s in spans
                    if (s.resource, s.worker) == lane and s.kind == kind
                    and (s.exposed is True) == exposed
                ]  # fmt: skip
                if bars:
                    ax.broken_barh(
                        bars, (i - 0.4, 0.8), facecolors=colors[kind],
                        hatch="//" if exposed else None, edgecolor="none",
                    )  # fmt: skip
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"{r}[{crowded[r]} workers]" if w == -1 else f"{r}[{w}]" for r, w in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title or f"asyncflow timeline ({len(spans)} spans)")
    ax.legend(
        handles=[patches.Patch(facecolor=colors[k], label=k) for k in kinds],
        loc="upper right", fontsize="small",
    )  # fmt: skip
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


# -- helpers -----------------------------------------------------------------------------------
def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _jsonable(v: object) -> Any:
    tolist = getattr(v, "tolist", None)  # tensors, numpy values
    if callable(tolist):
        return tolist()
    if isinstance(v, set | frozenset | tuple):
        return list(v)
    return repr(v)


def _open(path: Path, mode: str) -> IO[str]:
    if path.suffix != ".gz":
        return open(path, mode, encoding="utf-8")
    if mode == "w":  # level 1: a trace compresses well anyway, and level 9 costs 5x the time
        return gzip.open(path, "wt", encoding="utf-8", compresslevel=1)
    return gzip.open(path, "rt", encoding="utf-8")


__all__ = [
    "BUSY_KINDS",
    "MetricRecord",
    "OpenSpan",
    "Span",
    "TraceFormatError",
    "TraceMark",
    "Tracer",
    "format_summary",
    "load",
    "plot_timeline",
    "summarize",
    "union_length",
]
