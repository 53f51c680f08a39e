"""Smoke test of the staleness ablation: ``benchmarks/staleness_quality.py --quick`` runs η = 0
and η = 4 (naive PPO) once each on a few steps, prints the table, writes the plot, and its
last stdout line is one JSON object with the headline keys and every run's staleness
histogram. What the figures say is the benchmark's business, not this test's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_run_prints_the_table_and_the_json(tmp_path: Path) -> None:
    png, saved = tmp_path / "reward.png", tmp_path / "runs.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "staleness_quality.py"), "--quick",
         "--plot", str(png), "--save", str(saved)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in (
        "reward_eta0",
        "reward_eta4_naive",
        "reward_eta4_decoupled",
        "speedup_eta4_vs_eta0",
    ):
        assert key in figures
    runs = figures["runs"]
    assert [(r["eta"], r["loss"]) for r in runs] == [(0, "naive"), (4, "naive")]
    for r in runs:
        assert sum(r["staleness_hist"].values()) == r["samples"] == 4 * 16
        assert max(int(lag) for lag in r["staleness_hist"]) <= r["eta"]
    assert "final reward" in proc.stdout and png.stat().st_size > 0
    assert (tmp_path / "reward-by-eta.png").stat().st_size > 0
    # --load re-renders the table and both figures from the saved runs, running nothing
    again = tmp_path / "again.png"
    replay = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "staleness_quality.py"), "--load",
         str(saved), "--plot", str(again)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert replay.returncode == 0, replay.stderr[-3000:]
    table = [
        line
        for line in proc.stdout.splitlines()
        if ("final reward" in line or "naive" in line) and not line.startswith("{")
    ]
    assert table == [line for line in replay.stdout.splitlines() if line in table]
    assert (
        json.loads(replay.stdout.strip().splitlines()[-1])["reward_eta0"] == figures["reward_eta0"]
    )
    assert again.stat().st_size > 0 and (tmp_path / "again-by-eta.png").stat().st_size > 0


def test_a_file_that_is_not_a_saved_run_is_refused_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "notes.txt"
    bad.write_text("hello")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "staleness_quality.py"), "--load", str(bad)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "notes.txt" in proc.stderr and "not a saved run" in proc.stderr


def test_a_bad_grid_value_is_refused_naming_it() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "staleness_quality.py"), "--losses", "adam"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "'adam'" in proc.stderr
