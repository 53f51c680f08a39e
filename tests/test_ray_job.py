"""``asyncflow run --runtime ray``: the main job, unchanged, with the store and every engine as
Ray actors on a local cluster the command starts and stops itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from asyncflow_reference.workloads import ReferenceRunConfig

from asyncflow_core.cli import main as cli_main
from asyncflow_core.contracts.errors import ConfigError
from asyncflow_core.flow.config import apply_override
from asyncflow_core.flow.rlflow import JobState
from asyncflow_core.infra.checkpoint import Checkpoints

ray = pytest.importorskip("ray", reason="the Ray runtime needs the [ray] extra (ray 2.60)")

QUICK = [
    "rl.steps=4", "rl.prompts_per_step=4", "rl.n=4", "task.warmup_steps=2", "eval_prompts=8",
]  # fmt: skip


@pytest.mark.parametrize(
    ("store", "where"),
    [("driver", "ray (1 node, the store in the driver)"), ("ray", "ray (1 node, 2 storage units)")],
)
def test_the_main_job_runs_on_a_local_ray_cluster(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    store: str,
    where: str,
) -> None:
    """Its staged weight syncs go from the trainer's actor to the rollout actor directly:
    the driver's export of the trainer's weights fails here, and is never called."""
    from asyncflow_ray import RayTrainEngine

    def no_export(self: object, bucket_bytes: int) -> object:
        raise AssertionError("the driver pulled the trainer's weights")

    monkeypatch.setattr(RayTrainEngine, "export_weights", no_export)
    assert not ray.is_initialized()
    out = tmp_path / "run"
    args = ["run", "--runtime", "ray", "--out", str(out), "--quiet"]
    for item in [*QUICK, f"runtime.store={store}"]:
        args += ["--set", item]
    assert cli_main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runtime"] == where
    units = {"unit-0": "head", "unit-1": "head"} if store == "ray" else {}
    assert summary["extra"]["placement"] == {"trainer": "head", "rollout-0": "head", **units}
    assert summary["trainer"] == "ray actor"
    assert summary["steps"] == 4 and summary["samples"] == 4 * 16
    hist = summary["staleness_hist"]
    assert sum(hist.values()) == 4 * 16 and set(hist) <= {"0", "1"}  # η = 1 still holds
    assert 0.0 <= summary["eval_reward"] <= 1.0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]
    printed = capsys.readouterr().out
    assert where in printed and "a Ray actor of its own" in printed
    assert not ray.is_initialized(), "the cluster the run started was stopped"


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["runtime.kind=ray", "train.process=true"], "train.process = true are for"),
        (["runtime.kind=ray", "runtime.storage_units=0"], "runtime.storage_units must be >= 1"),
        (["runtime.kind=ray", "runtime.storage_units=3"], "add --set runtime.store=ray"),
        (["runtime.kind=ray", "runtime.store=s3"], "runtime.store must be one of 'driver', 'ray'"),
        (["runtime.address=auto"], "apply to runtime.kind = 'ray'"),
        (["runtime.store=ray"], "apply to runtime.kind = 'ray'"),
        (["runtime.rollout_restarts=1"], "apply to runtime.kind = 'ray'"),
        (["runtime.kind=ray", "runtime.rollout_restarts=-1"], "must be an int >= 0, got -1"),
        (["runtime.kind=k8s"], r"runtime.kind must be 'local' or a registered runtime \(ray\)"),
    ],
)
def test_bad_runtime_choices_are_refused(overrides: list[str], match: str) -> None:
    cfg = ReferenceRunConfig()
    with pytest.raises(ConfigError, match=match):
        for o in overrides:
            cfg = apply_override(cfg, o)
        cfg.validate()


def test_a_killed_rollout_actor_does_not_end_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rollout actor 1 kills its own process (SIGKILL, a failpoint) at its 10th generate
    call, with requests in flight: its requests go to actor 0 and the run completes. The
    variable reaches the actors through the local cluster the run starts."""
    monkeypatch.setenv("ASYNCFLOW_FAILPOINTS", "ray.rollout-1.generate=10")
    out = tmp_path / "run"
    args = ["run", "--runtime", "ray", "--out", str(out), "--quiet"]
    for item in [*QUICK, "rollout.engines=2", "rl.steps=6"]:
        args += ["--set", item]
    assert cli_main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["samples"] == 6 * 16
    lost = summary["extra"]["lost_engines"]
    assert list(lost) == ["1"] and "rollout-1" in lost["1"]
    assert "lost rollout engines" in capsys.readouterr().out
    assert not ray.is_initialized()


def test_a_killed_rollout_actor_restarts_and_rejoins_with_the_current_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The only rollout actor kills its own process (a failpoint that fires once across
    restarts) at its 10th generate request, with requests in flight. Ray restarts it
    (runtime.rollout_restarts=1); the job waits for it (no other engine is left), loads the
    trainer's weights into the fresh engine between two updates, and rebuilds the direct
    sync's group over it. The run completes with every sample trained once and no sample
    staler than η."""
    monkeypatch.setenv("ASYNCFLOW_FAILPOINTS", "ray.rollout-0.generate=10")
    monkeypatch.setenv("ASYNCFLOW_FAILPOINTS_ONCE", str(tmp_path))
    out = tmp_path / "run"
    args = ["run", "--runtime", "ray", "--out", str(out), "--quiet"]
    for item in [*QUICK, "rl.steps=6", "runtime.rollout_restarts=1"]:
        args += ["--set", item]
    assert cli_main(args) == 0
    assert (tmp_path / "ray.rollout-0.generate.fired").exists()  # it did die, once
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["samples"] == 6 * 16
    assert summary["extra"]["restarted_engines"] == {"0": 1}
    assert "lost_engines" not in summary["extra"]
    hist = summary["staleness_hist"]
    assert sum(hist.values()) == 6 * 16 and set(hist) <= {"0", "1"}
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert "restarted rollout engines" in capsys.readouterr().out
    assert not ray.is_initialized()


def test_a_ray_run_killed_then_stopped_by_sigterm_resumes(tmp_path: Path) -> None:
    """A --runtime ray run killed with SIGKILL inside a weight sync (a failpoint), resumed;
    stopped by SIGTERM (it checkpoints, the trainer actor writing its state into the run
    folder, and exits 0), resumed again to the end on a fresh cluster each time."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "run"
    sets = [*QUICK[1:], "rl.steps=6", "checkpoint.every=2", "checkpoint.min_interval_s=0"]
    sets.append("eval_prompts=0")
    cmd = [sys.executable, "-m", "asyncflow_core.cli", "run", "--runtime", "ray", "--quiet"]
    killed = subprocess.run(
        [*cmd, "--out", str(out), *(x for s in sets for x in ("--set", s))],
        cwd=root, capture_output=True, text=True, timeout=600,
        env={**os.environ, "ASYNCFLOW_FAILPOINTS": "sync.transfer=3"},
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    ckpts = Checkpoints(out / "checkpoints")
    assert JobState.read(ckpts.latest()).version == 2  # type: ignore[arg-type]
    proc = subprocess.Popen(
        [*cmd, "--resume", str(out), "--set", "rl.steps=400"],
        cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    while ckpts.latest() == ckpts.path(2) and proc.poll() is None:  # evidence: a newer one
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "stopped on SIGTERM" in err, err
    state = JobState.read(ckpts.latest())  # type: ignore[arg-type]
    assert state.version > 2
    done = subprocess.run(
        [*cmd, "--resume", str(out), "--set", f"rl.steps={state.version + 2}"],
        cwd=root, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == state.version + 2 and summary["runtime"].startswith("ray")
    assert summary["extra"]["resumed_at"] == [2, state.version]
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, state.version + 3))
    end = JobState.read(ckpts.latest())  # type: ignore[arg-type]
    groups = [g for s in end.steps for g in s.groups]
    assert len(groups) == len(set(groups))  # no group trained twice across the three runs
