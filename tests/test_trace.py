"""Tracing: exact summary numbers on hand-built spans, Chrome-trace and metrics.jsonl exports,
the round trip through ``load``, a traced pipeline run, the CLI, and the plot extra."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncflow_core.contracts.errors import MissingExtraError
from asyncflow_core.contracts.protocols import Batch, Tags
from asyncflow_core.flow.workflow import Pipeline, Source, Task, TaskOutput
from asyncflow_core.observability.trace import (
    Span,
    TraceFormatError,
    Tracer,
    format_summary,
    load,
    union_length,
)

ROOT = Path(__file__).resolve().parent.parent


def hand_built() -> Tracer:
    """Wall 0..10 s. rollout: workers 0 and 1 overlap on 1..5, plus 6..8 -> busy 6 s.
    trainer: task 2..3 and 5..9, a sync 9..10 (exposed) -> busy 6 s; a wait 3..5 is idle."""
    tr = Tracer()
    tr.record("task", "rollout", 1.0, 4.0, worker=0, rows=4, tokens=40, versions=(0, 1))
    tr.record("task", "rollout", 2.0, 5.0, worker=1, rows=4, tokens=60)
    tr.record("task", "rollout", 6.0, 8.0, worker=0, rows=2, tokens=10)
    tr.record("wait", "rollout", 0.0, 1.0, worker=0)
    tr.record("task", "train", 2.0, 3.0, resource="trainer", rows=8, tokens=100, staleness=0)
    tr.record("wait", "train", 3.0, 5.0, resource="trainer")
    tr.record("task", "train", 5.0, 9.0, resource="trainer", rows=2, tokens=10, staleness=[1, 2])
    tr.record("sync", "broadcast", 9.0, 10.0, resource="trainer", exposed=True)
    tr.record("sync", "stage", 6.0, 6.5, resource="trainer", exposed=False)
    tr.record("sync", "stage", 7.0, 7.25, resource="trainer", exposed=False)
    return tr


# --- summary ----------------------------------------------------------------------------------
def test_union_length_counts_overlaps_once() -> None:
    assert union_length([]) == 0.0
    assert union_length([(0, 1), (0.5, 2), (3, 4), (3.5, 3.6), (5, 5)]) == 3.0
    assert union_length([(2, 3), (0, 10)]) == 10.0


def test_busy_idle_and_bubble_are_exact() -> None:
    s = hand_built().summary(throughput_task="train")
    assert s["wall_s"] == 10.0 and s["start_s"] == 0.0 and s["end_s"] == 10.0
    rollout, trainer = s["resources"]["rollout"], s["resources"]["trainer"]
    # rollout: union of [1,4] [2,5] [6,8] = [1,5] + [6,8] = 6 s; work (sum) = 3 + 3 + 2 = 8 s
    assert rollout["busy_s"] == 6.0 and rollout["work_s"] == 8.0
    assert rollout["idle_s"] == 4.0 and rollout["bubble_ratio"] == 0.4
    assert rollout["workers"] == 2 and rollout["rows"] == 10 and rollout["tokens"] == 110
    # trainer: [2,3] [5,9] [9,10] plus syncs inside [5,9] -> 1 + 4 + 1 = 6 s
    assert trainer["busy_s"] == 6.0 and trainer["idle_s"] == 4.0
    assert trainer["bubble_ratio"] == 0.4
    assert s["bubble_ratio"] == pytest.approx(0.4)
    tp = s["throughput"]
    assert tp == {
        "task": "train",
        "samples": 10,
        "tokens": 110,
        "samples_per_s": 1.0,
        "tokens_per_s": 11.0,
    }
    # staleness: an int counts once per row of its span (8 rows of 0), a list one per row
    assert s["staleness"]["histogram"] == {0: 8, 1: 1, 2: 1}
    assert s["staleness"]["count"] == 10 and s["staleness"]["max"] == 2
    assert s["staleness"]["mean"] == pytest.approx(0.3)
    sync = s["sync"]
    assert sync["count"] == 3 and sync["exposed_s"] == 1.0 and sync["hidden_s"] == 0.75
    assert sync["unmarked_s"] == 0.0
    assert sync["phases"]["stage"]["count"] == 2 and sync["phases"]["stage"]["hidden_s"] == 0.75
    assert s["waits"]["train"] == {"count": 1, "total_s": 2.0, "mean_s": 2.0, "max_s": 2.0}


def test_throughput_task_defaults() -> None:
    tr = hand_built()
    # unset: the task whose last task span ends latest (train ends at 9, rollout at 8)
    assert tr.summary()["throughput"]["task"] == "train"
    tr.throughput_task = "rollout"
    assert tr.summary()["throughput"]["samples"] == 10
    assert tr.summary(throughput_task="train")["throughput"]["task"] == "train"
    tr.set_default_throughput_task("other")  # already set: unchanged
    assert tr.throughput_task == "rollout"


def test_busy_kinds_and_an_empty_tracer() -> None:
    s = hand_built().summary(busy_kinds={"task"})
    assert s["resources"]["trainer"]["busy_s"] == 5.0  # the exposed sync no longer counts
    empty = Tracer().summary()
    assert empty["wall_s"] == 0.0 and empty["resources"] == {} and empty["bubble_ratio"] == 0.0
    assert empty["throughput"]["samples_per_s"] == 0.0
    assert "none recorded" in format_summary(empty)


def test_format_summary_is_a_readable_table() -> None:
    text = format_summary(hand_built().summary())
    assert "rollout" in text and "trainer" in text
    assert "40.0%" in text  # the bubble ratios
    assert "1.0 samples/s" in text and "11.0 tokens/s" in text
    assert "exposed 1.000 s, hidden 0.750 s" in text
    assert "staleness (10 rows" in text


# --- recording --------------------------------------------------------------------------------
def test_span_context_manager_and_fake_clock() -> None:
    now = [100.0]
    tr = Tracer(clock=lambda: now[0])
    with tr.span("sync", "broadcast", resource="trainer", exposed=True) as s:
        now[0] = 102.5
        s.rows = 3
        s.args["bytes"] = 1024
    with pytest.raises(ValueError), tr.span("task", "train"):
        now[0] = 103.0
        raise ValueError("boom")
    a, b = tr.spans
    assert (a.kind, a.name, a.resource, a.start, a.end, a.rows) == (
        "sync", "broadcast", "trainer", 0.0, 2.5, 3,
    )  # fmt: skip
    assert a.exposed is True and a.args == {"bytes": 1024}
    assert b.resource == "train" and b.args == {"error": "ValueError"} and b.duration == 0.5


def test_recording_is_thread_safe() -> None:
    tr = Tracer()

    def spam(w: int) -> None:
        for i in range(500):
            tr.record("task", "t", i, i + 1, worker=w, rows=1)

    threads = [threading.Thread(target=spam, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(tr.spans) == 4000
    assert tr.summary()["throughput"]["samples"] == 4000


# --- exports ----------------------------------------------------------------------------------
def test_chrome_trace_format(tmp_path: Path) -> None:
    tr = hand_built()
    doc = json.loads(tr.write_chrome_trace(tmp_path / "t.json").read_text())
    events = doc["traceEvents"]
    x = [e for e in events if e["ph"] == "X"]
    assert len(x) == len(tr.spans)
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert set(names.values()) == {"rollout", "trainer"}
    threads = {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"}
    assert threads == {(e["pid"], e["tid"]) for e in x}
    first = next(e for e in x if e["args"]["versions"] == [0, 1])
    assert names[first["pid"]] == "rollout" and first["tid"] == 0
    assert first["ts"] == 1_000_000 and first["dur"] == 3_000_000  # microseconds
    assert first["cat"] == "task" and first["args"]["rows"] == 4
    for e in x:
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert e["dur"] >= 0


def test_chrome_trace_round_trip(tmp_path: Path) -> None:
    tr = hand_built()
    tr.throughput_task = "train"
    tr.metric(step=1, reward=0.25, loss=1.5, tag="warmup")
    for name in ("t.json", "t.json.gz"):
        path = tr.write_chrome_trace(tmp_path / name)
        back = load(path)
        assert back.spans == tr.spans
        assert back.throughput_task == "train"
        assert [m.as_json() for m in back.metrics] == [m.as_json() for m in tr.metrics]
        assert back.summary() == tr.summary()
    with gzip.open(tmp_path / "t.json.gz", "rt") as f:
        assert "traceEvents" in json.load(f)


def test_segments_written_since_a_mark_load_back_as_one_trace(tmp_path: Path) -> None:
    tr = hand_built()
    tr.throughput_task = "train"
    tr.metric(step=1, reward=0.25)
    first = tr.mark()
    assert first == (len(tr.spans), 1)
    tr.record("task", "train", 5.0, 6.0, rows=4)
    tr.metric(step=2, reward=0.5)
    second = tr.mark()
    tr.record("task", "train", 7.0, 8.0, rows=4)  # after the second mark: in no segment
    a = tr.write_chrome_trace(tmp_path / "a.json.gz", until=first)
    b = tr.write_chrome_trace(tmp_path / "b.json.gz", since=first, until=second)
    with gzip.open(b, "rt") as f:  # the second segment holds only what is new
        assert [e["ts"] for e in json.load(f)["traceEvents"] if e["ph"] == "X"] == [5e6]
    back = load(a, b)
    assert back.spans == tr.spans[: second.spans]
    assert [m.as_json() for m in back.metrics] == [m.as_json() for m in tr.metrics]
    assert back.throughput_task == "train"
    assert load(a).spans == tr.spans[: first.spans]


def test_load_reads_foreign_chrome_traces(tmp_path: Path) -> None:
    events = [
        {"name": "process_name", "ph": "M", "pid": 7, "tid": 0, "args": {"name": "gpu0"}},
        {"name": "fwd", "ph": "X", "pid": 7, "tid": 2, "ts": 1000, "dur": 500, "cat": "task"},
        {"name": "x", "ph": "i", "pid": 7, "tid": 2, "ts": 1000},
    ]
    (tmp_path / "f.json").write_text(json.dumps(events))
    (span,) = load(tmp_path / "f.json").spans
    assert span == Span("task", "fwd", "gpu0", 2, 0.001, 0.0015, args={})


def test_load_rejects_bad_files(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TraceFormatError, match=r"bad\.json.*not a Chrome-trace JSON"):
        load(tmp_path / "bad.json")
    (tmp_path / "obj.json").write_text('{"hello": 1}')
    with pytest.raises(TraceFormatError, match="traceEvents"):
        load(tmp_path / "obj.json")
    (tmp_path / "ev.json").write_text('{"traceEvents": [{"ph": "X", "name": "a"}]}')
    with pytest.raises(TraceFormatError, match="bad event"):
        load(tmp_path / "ev.json")


def test_metrics_jsonl(tmp_path: Path) -> None:
    tr = Tracer()
    tr.metric(step=0, reward=0.5, loss=2.0)
    tr.metric(reward=0.75, note="eval")
    lines = tr.write_metrics_jsonl(tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows] == [0, None]
    assert rows[0]["reward"] == 0.5 and rows[0]["loss"] == 2.0
    assert rows[1] == {"t": rows[1]["t"], "step": None, "reward": 0.75, "note": "eval"}
    assert 0 <= rows[0]["t"] <= rows[1]["t"]
    # numeric metrics also appear as Chrome counter events
    counters = [e for e in tr.chrome_trace()["traceEvents"] if e["ph"] == "C"]
    assert counters[0]["args"] == {"reward": 0.5, "loss": 2.0, "step": 0}
    assert counters[1]["args"] == {"reward": 0.75}


# --- a traced pipeline ------------------------------------------------------------------------
def test_pipeline_records_every_iteration() -> None:
    def batches() -> Iterator[Mapping[str, Any]]:
        for start in range(0, 30, 5):
            yield {"x": [torch.tensor(float(i)) for i in range(start, start + 5)]}

    def generate(batch: Batch) -> TaskOutput:
        time.sleep(0.002)
        return TaskOutput(
            {"y": list(batch["x"] + 1)},
            tags=[Tags(versions=(3,), tokens=int(x) + 1) for x in batch["x"]],
        )

    def train(batch: Batch) -> None:
        time.sleep(0.001)

    tracer = Tracer()
    pipe = Pipeline(
        Source("prompts", ("x",), batches),
        [
            Task("gen", generate, ("x",), ("y",), batch_size=4, workers=2),
            Task("train", train, ("y",), batch_size=6),
        ],
        tracer=tracer,
    )
    result = pipe.run_sync()
    assert result.tracer is tracer and tracer.throughput_task == "train"
    spans = tracer.spans
    for name, total in (("gen", 30), ("train", 30)):
        tasks = [s for s in spans if s.kind == "task" and s.name == name]
        waits = [s for s in spans if s.kind == "wait" and s.name == name]
        assert sum(s.rows for s in tasks) == total == result.rows[name]
        # one wait per iteration (rows leased), plus one end-of-stream wait per worker
        data_waits = [w for w in waits if not w.args.get("end_of_stream")]
        assert sorted(w.rows for w in data_waits) == sorted(t.rows for t in tasks)
        workers = 2 if name == "gen" else 1
        assert len(waits) - len(data_waits) == workers
        assert {s.worker for s in tasks} <= set(range(workers))
        assert all(s.resource == name and s.end >= s.start for s in tasks + waits)
    gen = [s for s in spans if s.kind == "task" and s.name == "gen"]
    assert sum(s.tokens for s in gen) == sum(range(1, 31))  # tokens the task generated
    assert all(s.versions == (3, 3) for s in gen)
    train_spans = [s for s in spans if s.kind == "task" and s.name == "train"]
    assert sum(s.tokens for s in train_spans) == sum(range(1, 31))
    src = [s for s in spans if s.name == "prompts"]
    assert [s.rows for s in src if s.kind == "task"] == [5] * 6
    assert [s.rows for s in src if s.kind == "put"] == [5] * 6
    summary = tracer.summary()
    assert summary["throughput"]["samples"] == 30
    assert set(summary["resources"]) == {"prompts", "gen", "train"}
    assert 0.0 <= summary["bubble_ratio"] <= 1.0


def test_pipeline_without_tracer_is_unchanged() -> None:
    def batches() -> Iterator[Mapping[str, Any]]:
        yield {"x": [1, 2, 3]}

    result = Pipeline(Source("s", ("x",), batches), [Task("t", lambda b: None, ("x",))]).run_sync()
    assert result.tracer is None and result.rows == {"s": 3, "t": 3}


# --- CLI --------------------------------------------------------------------------------------
def cli(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncflow_core.cli", *args],
        capture_output=True, text=True, cwd=ROOT, timeout=60, env=env,
    )  # fmt: skip


def test_cli_summarize(tmp_path: Path) -> None:
    path = hand_built().write_chrome_trace(tmp_path / "trace.json")
    proc = cli("trace", "summarize", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "bubble" in proc.stdout and "trainer" in proc.stdout and "40.0%" in proc.stdout
    proc = cli("trace", "summarize", str(path), "--json", "--throughput-task", "rollout")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["resources"]["rollout"]["busy_s"] == 6.0
    assert data["throughput"]["samples"] == 10 and data["throughput"]["task"] == "rollout"
    assert data["staleness"]["histogram"] == {"0": 8, "1": 1, "2": 1}


def test_cli_summarize_bad_files(tmp_path: Path) -> None:
    missing = tmp_path / "missing.json"
    proc = cli("trace", "summarize", str(missing))
    assert proc.returncode == 2 and "missing.json" in proc.stderr and not proc.stdout
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2")
    proc = cli("trace", "summarize", str(bad))
    assert proc.returncode == 2 and "bad.json" in proc.stderr
    assert "not a Chrome-trace JSON" in proc.stderr and "Traceback" not in proc.stderr


# --- plotting ---------------------------------------------------------------------------------
def test_plot_without_matplotlib_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'asyncflow\[plot\]'"):
        hand_built().plot_timeline(tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()


def test_cli_png_without_matplotlib(tmp_path: Path) -> None:
    path = hand_built().write_chrome_trace(tmp_path / "trace.json")
    code = (
        "import sys; sys.modules['matplotlib'] = None; from asyncflow_core.cli import main; "
        f"sys.exit(main(['trace', 'summarize', {str(path)!r}, '--png', 'x.png']))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert proc.returncode == 2 and "asyncflow[plot]" in proc.stderr
    assert "bubble" in proc.stdout  # the summary is still printed


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason="matplotlib (the 'plot' extra) is not installed",
)
def test_plot_timeline_writes_a_png(tmp_path: Path) -> None:
    out = hand_built().plot_timeline(tmp_path / "timeline.png", title="test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    path = hand_built().write_chrome_trace(tmp_path / "trace.json")
    png = tmp_path / "cli.png"
    proc = cli("trace", "summarize", str(path), "--png", str(png), env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"
