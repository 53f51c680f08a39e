"""Smoke test of the peer benchmark: ``benchmarks/vs_trl.py --quick`` (a tiny model, a few
steps of each framework) runs to the end and its last stdout line is one JSON object with the
headline keys. Skipped when TRL (the ``bench-trl`` extra) is not installed.

The figures themselves are measured by the benchmark (docs/vs-trl.md), never asserted here."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "vs_trl.py"
REQUIRED = ("samples_per_s_ratio", "time_to_threshold_ratio", "reward_asyncflow", "reward_trl")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("trl") is None or importlib.util.find_spec("transformers") is None,
    reason="trl is not installed: the peer benchmark needs the bench-trl extra "
    "(pip install 'trl>=1.16,<1.17' 'torch==2.13.0')",
)


@pytest.mark.slow
def test_vs_trl_quick_emits_json(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path / "out")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, f"benchmark failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = proc.stdout.strip().splitlines()
    assert lines, "benchmark printed nothing"
    result = json.loads(lines[-1])
    for key in REQUIRED:
        assert key in result, f"missing {key!r} in {sorted(result)}"
        value = result[key]
        assert isinstance(value, int | float) and not isinstance(value, bool), f"{key} = {value!r}"
        assert math.isfinite(value) and value >= 0, f"{key} = {value!r}"
    assert result["samples_per_s_ratio"] > 0
    frameworks = result["frameworks"]
    assert set(frameworks) == {"trl", "af_async", "af_colocated"}
    for name, row in frameworks.items():
        assert row["samples_per_s"] > 0, name
    config = result["config"]
    steps = config["steps"]
    batch = config["prompts"] * config["n"]
    for name, counts in result["response_length_histogram"].items():
        if name != "edges":  # every framework scored at least the samples it trained on
            assert sum(counts) >= steps * batch, (name, counts)
    assert (tmp_path / "out" / "results.json").is_file()
