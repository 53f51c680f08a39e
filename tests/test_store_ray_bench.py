"""Smoke test of the RayDataStore benchmark: ``benchmarks/store_ray.py --quick`` starts a local
Ray cluster, runs every phase once on tiny sizes, shuts the cluster down, and its last stdout
line is one JSON object with the headline figures, all positive and finite.

Performance is measured by the benchmark itself, never asserted here."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the Ray runtime needs the [ray] extra (ray 2.60)")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "store_ray.py"
FIGURES = (
    "put_gbps",
    "get_gbps",
    "samples_per_s",
    "ragged_put_gbps",
    "ragged_get_gbps",
    "ragged_samples_per_s",
    "raw_put_gbps",
    "raw_get_gbps",
    "ragged_raw_put_gbps",
    "ragged_raw_get_gbps",
    "put_vs_raw",
    "get_vs_raw",
    "e2e_vs_raw",
    "ragged_put_vs_raw",
    "ragged_get_vs_raw",
    "ragged_e2e_vs_raw",
)


def _positive_finite(name: str, v: object) -> None:
    assert isinstance(v, int | float) and not isinstance(v, bool), f"{name} = {v!r}"
    assert math.isfinite(v) and v > 0, f"{name} = {v!r} is not a positive finite number"


@pytest.mark.slow
def test_store_ray_benchmark_quick_emits_json() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, f"benchmark failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = proc.stdout.strip().splitlines()
    assert lines, "benchmark printed nothing"
    result = json.loads(lines[-1])
    assert isinstance(result, dict)
    for key in FIGURES:
        assert key in result, f"missing {key!r} in {sorted(result)}"
        _positive_finite(key, result[key])
    assert result["storage_units"] == 2 and result["clients"] == 2
    assert result["quick"] is True
    shape = result["workload"]
    for key in ("batch", "seq_len", "fields", "bytes", "ragged_bytes"):
        _positive_finite(f"workload.{key}", shape[key])
    assert shape["bytes"] == shape["batch"] * shape["seq_len"] * shape["fields"] * 4
    for key in ("put_vs_raw", "get_vs_raw", "ragged_put_vs_raw", "ragged_get_vs_raw"):
        assert result[f"{key}_min"] <= result[key] <= result[f"{key}_max"]
    table = "\n".join(lines[:-1])  # the readable table comes before the JSON line
    assert all(word in table for word in ("fixed/store", "fixed/raw", "ragged/store", "vs raw"))
