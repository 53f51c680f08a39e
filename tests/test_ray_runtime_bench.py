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
