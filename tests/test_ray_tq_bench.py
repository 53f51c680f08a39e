"""Smoke test of the TransferQueue-shaped benchmark: ``benchmarks/transferqueue.py --quick``
starts a local Ray cluster, runs the real TransferQueue 0.1.11 and the facade over the
in-process and the Ray store on tiny sizes (checking the data read back), shuts everything
down, and its last stdout line is one JSON object whose figures are all positive and finite.

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
pytest.importorskip("tensordict", reason="the TransferQueue facade needs the [tq] extra")
pytest.importorskip("transfer_queue", reason="the real TransferQueue comes with [tq-bench]")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "transferqueue.py"
FIGURES = [f"{s}_{d}_gbps" for s in ("tq", "inproc", "ray") for d in ("put", "get")] + [
    f"{s}_{d}_vs_tq" for s in ("inproc", "ray") for d in ("put", "get")
]


def test_transferqueue_benchmark_quick(tmp_path: Path) -> None:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    res = json.loads(last)
    assert res["quick"] is True and res["reps"] == 2
    for name in FIGURES:
        assert math.isfinite(res[name]) and res[name] > 0, (name, res[name])
