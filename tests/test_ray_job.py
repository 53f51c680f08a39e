"""``asyncflow run --runtime ray``: the main job, unchanged, with the store and every engine as
Ray actors on a local cluster the command starts and stops itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from asyncflow_reference.job import RunConfig

from asyncflow_core.cli import main as cli_main
from asyncflow_core.config import apply_override
from asyncflow_core.errors import ConfigError

ray = pytest.importorskip("ray", reason="the Ray runtime needs the [ray] extra (ray 2.60)")

QUICK = [
    "rl.steps=4", "rl.prompts_per_step=4", "rl.n=4", "task.warmup_steps=2", "eval_prompts=8",
]  # fmt: skip


def test_the_main_job_runs_on_a_local_ray_cluster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert not ray.is_initialized()
    out = tmp_path / "run"
    args = ["run", "--runtime", "ray", "--out", str(out), "--quiet"]
    for item in QUICK:
        args += ["--set", item]
    assert cli_main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runtime"] == "ray (1 node, 2 storage units)"
    assert summary["trainer"] == "ray actor"
    assert summary["steps"] == 4 and summary["samples"] == 4 * 16
    hist = summary["staleness_hist"]
    assert sum(hist.values()) == 4 * 16 and set(hist) <= {"0", "1"}  # η = 1 still holds
    assert 0.0 <= summary["eval_reward"] <= 1.0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]
    printed = capsys.readouterr().out
    assert "ray (1 node, 2 storage units)" in printed and "a Ray actor of its own" in printed
    assert not ray.is_initialized(), "the cluster the run started was stopped"


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["runtime.kind=ray", "train.process=true"], "train.process = true are for"),
        (["runtime.kind=ray", "runtime.storage_units=0"], "runtime.storage_units must be >= 1"),
        (["runtime.address=auto"], "apply to runtime.kind = 'ray'"),
        (["runtime.kind=k8s"], "runtime.kind must be one of 'local', 'ray', got 'k8s'"),
    ],
)
def test_bad_runtime_choices_are_refused(overrides: list[str], match: str) -> None:
    cfg = RunConfig()
    with pytest.raises(ConfigError, match=match):
        for o in overrides:
            cfg = apply_override(cfg, o)
        cfg.validate()
