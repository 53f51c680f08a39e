"""Smoke test of the DataStore benchmark: ``benchmarks/datastore.py --quick`` runs to the end and
its last stdout line is one JSON object with the headline figures, all positive and finite.

Performance targets are measured by the benchmark itself, never asserted here."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "datastore.py"
HEADLINE_KEYS = ("put_get_vs_copy", "small_rows_per_s", "get_meta_p50_ms", "get_meta_p99_ms")
OTHER_KEYS = (
    "put_get_vs_copy_min",
    "put_get_vs_copy_max",
    "put_get_gb_per_s",
    "copy_gb_per_s",
    "small_put_rows_per_s",
    "small_get_rows_per_s",
    "small_dict_rows_per_s",
    "padded_inflation",
)


def _positive_finite(name: str, v: object) -> None:
    assert isinstance(v, int | float) and not isinstance(v, bool), f"{name} = {v!r}"
    assert math.isfinite(v) and v > 0, f"{name} = {v!r} is not a positive finite number"


@pytest.mark.slow
def test_datastore_benchmark_quick_emits_json() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, f"benchmark failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = proc.stdout.strip().splitlines()
    assert lines, "benchmark printed nothing"
    result = json.loads(lines[-1])
    assert isinstance(result, dict)
    for key in HEADLINE_KEYS + OTHER_KEYS:
        assert key in result, f"missing {key!r} in {sorted(result)}"
        _positive_finite(key, result[key])
    assert result["put_get_vs_copy_min"] <= result["put_get_vs_copy"]
    assert result["put_get_vs_copy"] <= result["put_get_vs_copy_max"]
    assert result["get_meta_p50_ms"] <= result["get_meta_p99_ms"]
    assert result["quick"] is True
    for config, figures in result["bulk"].items():
        for name in ("ratio", "total_s", "gb_per_s"):
            _positive_finite(f"bulk[{config}].{name}", figures[name])
    for config, figures in result["small"].items():
        for name in ("rows_per_s", "put_rows_per_s", "get_rows_per_s", "vs_dict"):
            _positive_finite(f"small[{config}].{name}", figures[name])
    assert "default (sequential)" in result["get_meta"]
    for sampler, figures in result["get_meta"].items():
        for name in ("p50_ms", "p99_ms"):
            _positive_finite(f"get_meta[{sampler}].{name}", figures[name])
    # the table comes before the JSON line
    assert any("put_get" in line or "ratio" in line for line in lines[:-1])


@pytest.mark.slow
def test_pipeline_benchmark_quick_emits_json() -> None:
    """benchmarks/pipeline.py --quick: colocated vs async on the simulator; the last line is
    one JSON object with the speedup, the ideal bound and the preset."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "pipeline.py"), "--quick", "--workers", "1"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["preset"].startswith("qwen2.5-7b")
    for key in ("speedup", "ideal_speedup", "efficiency"):
        _positive_finite(key, last[key])
    assert "ideal overlap bound" in proc.stdout


@pytest.mark.slow
def test_cpu_pipeline_benchmark_quick_emits_json() -> None:
    """benchmarks/cpu_pipeline.py --quick: the four runs on the reference engines; the last
    line is one JSON object with the speedup and the four final rewards."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cpu_pipeline.py"), "--quick"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    _positive_finite("speedup", last["speedup"])
    for key in ("reward_sync", "reward_async", "reward_eta4_naive", "reward_eta4_decoupled"):
        assert 0.0 <= last[key] <= 1.0, (key, last[key])
    runs = last["runs"]
    assert runs["colocated"]["staleness"] == 0 and runs["async"]["staleness"] == 1
    assert runs["eta4_decoupled"]["loss"] == "decoupled-ppo" and runs["eta4_naive"]["loss"] == "ppo"
    assert "speedup async/colocated" in proc.stdout


@pytest.mark.slow
def test_weight_sync_benchmark_quick_emits_json() -> None:
    """benchmarks/weight_sync.py --quick: bucketed vs flat broadcast between two processes and
    staged vs blocking exposed time; the last line is one JSON object of positive figures."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "weight_sync.py"), "--quick"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    last = json.loads(lines[-1])
    for key in (
        "bucketed_vs_flat",
        "bucketed_vs_flat_min",
        "bucketed_vs_flat_max",
        "flat_gbps",
        "bucketed_gbps",
        "staged_exposed_s",
        "blocking_exposed_s",
        "staged_transfer_s",
        "blocking_transfer_s",
        "model_mb",
        "bucket_mb",
        "repeats",
    ):
        assert key in last, f"missing {key!r} in {sorted(last)}"
        _positive_finite(key, last[key])
    assert last["bucketed_vs_flat_min"] <= last["bucketed_vs_flat"] <= last["bucketed_vs_flat_max"]
    assert last["quick"] is True
    table = "\n".join(lines[:-1])  # the readable table comes before the JSON line
    assert all(word in table for word in ("vs flat", "bucketed", "staged", "blocking"))
