"""Smoke test of the Ray runtime benchmark: ``benchmarks/ray_runtime.py --quick`` runs the main
job locally, on Ray with the store in the driver and on Ray with a ``RayDataStore``, each once
on a few steps, and its last stdout line is one JSON object whose figures are positive and
finite.

Performance is measured by the benchmark itself, never asserted here."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the Ray runtime needs the [ray] extra (ray 2.60)")

ROOT = Path(__file__).resolve().parents[1]
FIGURES = (
    "local_samples_per_s",
    "ray_samples_per_s",
    "ray_store_samples_per_s",
    "ray_vs_local",
    "ray_store_vs_local",
)


@pytest.mark.slow
def test_ray_runtime_benchmark_quick_emits_json() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "ray_runtime.py"), "--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["benchmark"] == "ray_runtime" and figures["reps"] == 1
    for name in FIGURES:
        value = figures[name]
        assert isinstance(value, int | float) and math.isfinite(value) and value > 0, name
    assert "the store in the driver" in proc.stdout and "2 storage units" in proc.stdout


@pytest.mark.slow
def test_ray_call_costs_benchmark_writes_a_file_the_simulator_loads(tmp_path: Path) -> None:
    """``benchmarks/ray_calls.py`` fits the per-call costs and writes them where
    ``RayCosts.load`` reads them (figures positive and finite; their size is the benchmark's
    business, not this test's)."""
    from asyncflow_reference.sim import RayCosts

    out = tmp_path / "costs.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "ray_calls.py"), "--reps", "2",
         "--write", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    fit = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(isinstance(v, float) and math.isfinite(v) and v >= 0 for v in fit.values()), fit
    costs = RayCosts.load(out)
    assert costs.generate_call_s == fit["generate_call_s"] and "--reps 2" in costs.measured
