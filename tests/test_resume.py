"""Checkpoints and resume: atomic, bounded checkpoint folders; ``RLJob.checkpoint`` /
``resume``; and the main job killed with SIGKILL at chosen and at random points (inside a
checkpoint write, inside a weight sync, after an optimizer step, anywhere), then resumed with
``asyncflow run --resume``. The invariant checked after every resume: the run ends with
exactly ``rl.steps`` optimizer steps, versions 1..N each once in the step records and in
``metrics.jsonl``, no prompt group trained twice, and the groups trained before the checkpoint
never fed again."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from asyncflow_reference.engines import TorchInferenceEngine, TorchTrainEngine
from asyncflow_reference.model import ModelConfig, TransformerLM

from asyncflow_core.contracts.errors import CheckpointError, ConfigError
from asyncflow_core.contracts.protocols import SamplingParams
from asyncflow_core.flow.rlflow import JobState, RLConfig, RLEngines, RLJob
from asyncflow_core.infra.checkpoint import MANIFEST_FILE, Checkpoints, _parse
from asyncflow_core.infra.manifest import checkpoint_key
from asyncflow_core.job.config import load_run_config
from asyncflow_core.job.run import resume_point
from asyncflow_core.observability import trace as tracing

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "--set", "rl.steps=8", "--set", "rl.prompts_per_step=8", "--set", "rl.n=4",
    "--set", "task.warmup_steps=5", "--set", "eval_prompts=0", "--set", "checkpoint.every=2",
    "--set", "checkpoint.min_interval_s=0",
    "--quiet",
]  # fmt: skip
STEPS = 8


# -- the checkpoint folder ---------------------------------------------------------------------
def _write(ckpts: Checkpoints, step: int, text: str = "x") -> Path:
    async def fill(folder: Path) -> None:
        (folder / "a.txt").write_text(text)
        (folder / "sub").mkdir()
        (folder / "sub" / "b.txt").write_text(text)

    return asyncio.run(ckpts.write(step, fill))


def test_checkpoints_are_atomic_and_bounded(tmp_path: Path) -> None:
    ckpts = Checkpoints(tmp_path / "c", keep=2)
    assert ckpts.latest() is None and ckpts.list() == []
    first = _write(ckpts, 3)
    assert first.name == "step-00000003" and (first / "sub" / "b.txt").read_text() == "x"

    async def broken(folder: Path) -> None:
        (folder / "a.txt").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        asyncio.run(ckpts.write(5, broken))
    assert ckpts.latest() == first  # the failed write left nothing behind
    assert [p.name for p in (tmp_path / "c").iterdir()] == ["step-00000003"]
    # a crash mid-write leaves a temporary folder: never "latest", removed by the next write
    (tmp_path / "c" / ".tmp-step-00000009-1").mkdir()
    assert ckpts.latest() == first
    _write(ckpts, 6)
    _write(ckpts, 8)
    assert [s for s, _ in ckpts.list()] == [6, 8]  # keep=2: step 3 removed
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["step-00000006", "step-00000008"]
    # a checkpoint of a step that has one replaces it whole (its files are never reused)
    assert _write(ckpts, 8, "other") == ckpts.path(8)
    assert (ckpts.path(8) / "a.txt").read_text() == "other"
    assert ckpts.verify(ckpts.path(8))["step"] == 8
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["step-00000006", "step-00000008"]
    with pytest.raises(ConfigError, match="keep"):
        Checkpoints(tmp_path, keep=0)


def test_rotation_never_removes_the_checkpoint_just_written(tmp_path: Path) -> None:
    """A folder holding higher steps than the one written (another run's, say): keep=1 keeps
    the new one, not the old run's newest."""
    ckpts = Checkpoints(tmp_path / "c", keep=1)
    _write(ckpts, 120)
    assert _write(ckpts, 10) == ckpts.path(10)
    assert ckpts.path(10).is_dir()


def test_every_checkpoint_is_verified_against_its_signed_manifest(tmp_path: Path) -> None:
    """A flipped byte, a truncated, missing or added file, an edited manifest: each fails
    ``verify`` naming the file, and ``intact`` falls back to the newest good checkpoint;
    ``trust`` skips only the signature."""
    ckpts = Checkpoints(tmp_path / "c", keep=5, identity={"seed": 3})
    for step in (1, 2):
        _write(ckpts, step)
    assert ckpts.verify(ckpts.path(2)) == {
        "format": "asyncflow-checkpoint/1", "step": 2, "identity": {"seed": 3},
    }  # fmt: skip
    newest = ckpts.path(2)

    def damaged(change: Callable[[], object], match: str) -> None:
        change()
        with pytest.raises(CheckpointError, match=match):
            ckpts.verify(newest)
        folder, bad = ckpts.intact()
        assert folder == ckpts.path(1) and [b for b, _ in bad] == [newest]

    a, b = newest / "a.txt", newest / "sub" / "b.txt"
    damaged(lambda: a.write_text("y"), "a.txt differs")  # same size, other bytes
    a.write_text("x")
    damaged(lambda: b.write_text(""), "sub/b.txt is not the size")
    b.write_text("x")
    damaged(b.unlink, r"missing: \['sub/b.txt'\]")
    b.write_text("x")
    damaged(lambda: (newest / "c.txt").write_text("new"), r"not listed: \['c.txt'\]")
    (newest / "c.txt").unlink()
    manifest = newest / MANIFEST_FILE
    text = manifest.read_text()
    edited = text.replace('"seed": 3', '"seed": 4')
    assert edited != text
    damaged(lambda: manifest.write_text(edited), "not signed with your checkpoint key")
    assert Checkpoints(tmp_path / "c", trust=True).verify(newest)["identity"] == {"seed": 4}
    manifest.write_text(text)
    assert ckpts.intact() == (newest, [])
    aside = ckpts.set_aside(newest)
    assert aside.name == "step-00000002.damaged" and ckpts.latest() == ckpts.path(1)


def test_failpoint_spec_is_checked() -> None:
    assert _parse("checkpoint.write=2, sync.transfer") == {
        "checkpoint.write": 2,
        "sync.transfer": 1,
    }
    with pytest.raises(ConfigError, match="NAME=K"):
        _parse("sync.transfer=soon")


# -- RLJob.checkpoint / resume in one process ---------------------------------------------------
CFG = ModelConfig(vocab_size=12, d_model=16, n_layers=1, n_heads=2, max_seq_len=16)


def _prompts() -> object:
    rng = random.Random(7)
    while True:
        yield tuple(rng.randrange(1, 12) for _ in range(4))


def _job(tmp_path: Path, steps: int, *, every: int = 2, min_interval_s: float = 0.0) -> RLJob:
    model = TransformerLM(CFG, seed=0)
    config = RLConfig(
        steps=steps, prompts_per_step=4, n=2, staleness=1, checkpoint_every=every,
        checkpoint_min_interval_s=min_interval_s, sampling=SamplingParams(max_tokens=4),
    )  # fmt: skip
    engines = RLEngines(
        [TorchInferenceEngine(model, max_batch=16, seed=1)],
        TorchTrainEngine(model, lr=1e-3, seed=0),
    )
    return RLJob(
        config,
        engines,
        _prompts(),
        lambda p, r: float(sum(r) % 2),  # type: ignore[arg-type]
        checkpoints=Checkpoints(tmp_path / "ckpt", keep=10),
    )


def test_rljob_resumes_without_training_a_group_twice(tmp_path: Path) -> None:
    first = _job(tmp_path, 6)
    asyncio.run(first.run())
    ckpts = first.checkpoints
    assert ckpts is not None
    assert [s for s, _ in ckpts.list()] == [2, 4, 6]
    state = JobState.read(ckpts.path(4))
    assert state.version == 4 and state.origin == 0 and len(state.steps) == 4
    trained = [g for s in state.steps for g in s.groups]
    assert len(trained) == len(set(trained)) == 16  # 4 steps x 4 prompts
    pending = {g for g, _ in state.pending}
    assert pending and not pending & set(trained)
    assert set(range(state.fed)) == set(trained) | pending  # every fed group is one or other

    second = _job(tmp_path / "again", 3)  # the steps left to do: 7 - 4
    resumed = asyncio.run(second.resume(ckpts.path(4)))
    assert resumed == state
    assert second.engines.trainer.weight_version == 4
    result = asyncio.run(second.run())
    assert [s.version for s in result.steps] == [5, 6, 7]
    new = [g for s in result.steps for g in s.groups]
    assert len(new) == len(set(new)) and not set(new) & set(trained)
    # groups fed before the checkpoint come back only if they were pending there
    assert {g for g in new if g < state.fed} <= pending
    end = JobState.read(second.checkpoints.path(7))  # type: ignore[union-attr]
    assert [s.version for s in end.steps] == list(range(1, 8))


def test_periodic_checkpoints_wait_their_minimum_interval(tmp_path: Path) -> None:
    """Every step asks for one, but none comes within a day of the run's start: only the
    last step's is written (and an explicit ``checkpoint()`` is never skipped)."""
    job = _job(tmp_path, 4, every=1, min_interval_s=86400.0)
    asyncio.run(job.run())
    assert job.checkpoints is not None
    assert [s for s, _ in job.checkpoints.list()] == [4]
    with pytest.raises(ConfigError, match="checkpoint_min_interval_s"):
        _job(tmp_path, 4, min_interval_s=-1.0)
    with pytest.raises(ConfigError, match="checkpoint_min_interval_s"):
        _job(tmp_path, 4, min_interval_s=float("nan"))


def test_resume_refuses_a_bad_folder(tmp_path: Path) -> None:
    job = _job(tmp_path, 2)
    with pytest.raises(CheckpointError, match=r"no manifest \(manifest\.json\)"):
        asyncio.run(job.resume(tmp_path))  # not a checkpoint the job's Checkpoints wrote
    with pytest.raises(CheckpointError, match=r"job\.json"):
        JobState.read(tmp_path)
    (tmp_path / "job.json").write_text('{"format": "something-else"}')
    with pytest.raises(CheckpointError, match="something-else"):
        JobState.read(tmp_path)
    assert job.engines.trainer.weight_version == 0  # nothing was loaded


def test_a_job_state_that_contradicts_its_step_records_is_refused(tmp_path: Path) -> None:
    """``fed`` set to 0 and the pending groups dropped (what trained 64 groups twice before
    #41), re-signed with the key as the writer would: the manifest passes, the state's own
    records do not, and nothing is loaded."""
    first = _job(tmp_path, 4)
    asyncio.run(first.run())
    ckpts = first.checkpoints
    assert ckpts is not None
    folder = ckpts.path(4)
    good = json.loads((folder / "job.json").read_text())
    for edit, why in (
        (
            {"fed": 0, "pending": []},
            r"groups \[0, 1, 2, 3, 4\] were trained or pending, but fed is 0",
        ),
        ({"pending": [[0, [1, 2, 3, 4]]]}, r"groups \[0\] are both trained and pending"),
        ({"steps": good["steps"][::-1]}, "step versions"),
    ):
        (folder / "job.json").write_text(json.dumps({**good, **edit}) + "\n")
        (folder / MANIFEST_FILE).unlink()
        ckpts._sign(folder, 4, checkpoint_key(who="test", create=False) or b"")
        assert ckpts.verify(folder)["step"] == 4  # signed: only its content is wrong
        second = _job(tmp_path / "again", 2)
        with pytest.raises(CheckpointError, match=f"contradicts its own step records: {why}"):
            asyncio.run(second.resume(folder))
        assert second.engines.trainer.weight_version == 0
        assert ckpts.intact(lambda f, _: JobState.read(f) and None)[0] == ckpts.path(2)


# -- the main job, killed and resumed -----------------------------------------------------------
def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncflow_core.cli", "run", *args],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def _check_finished(run: Path, steps: int = STEPS, resumed: bool = True) -> None:
    """The invariant of a finished run, however often it died and resumed."""
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == steps
    assert summary["samples"] == steps * 32  # the same as an uninterrupted run
    # the trace continued too: every trained sample's staleness is in it once
    assert sum(summary["staleness_hist"].values()) == steps * 32
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    times = [m["t"] for m in lines]
    assert times == sorted(times)  # the trace's clock continued, it did not restart
    last = Checkpoints(run / "checkpoints").latest()
    assert last is not None and last.name == f"step-{steps:08d}"
    state = JobState.read(last)
    assert [s.version for s in state.steps] == list(range(1, steps + 1))
    groups = [g for s in state.steps for g in s.groups]
    assert len(groups) == len(set(groups)) == steps * 8
    if resumed:
        assert summary["extra"]["resumed_at"]
    # the checkpoint's trace, kept in segments (one written per checkpoint, the earlier ones
    # copied), is the beginning of the run's whole trace
    segments = json.loads((last / "run.json").read_text())["trace_segments"]
    assert segments == [f"trace-{i:04d}.json.gz" for i in range(len(segments))]
    held = tracing.load(*(last / name for name in segments)).spans
    whole = tracing.load(run / "trace.json").spans
    key = [(s.kind, s.name, s.start, s.end) for s in whole]
    assert [(s.kind, s.name, s.start, s.end) for s in held] == key[: len(held)]
    assert sum(s.kind == "task" and s.name == "actor_update" for s in held) == steps
    listed = Checkpoints(run / "checkpoints").list()
    if len(listed) > 1:  # the previous checkpoint's segments: the same bytes, copies
        previous = listed[-2][1]  # (not links: damage to one leaves the other whole)
        for name in json.loads((previous / "run.json").read_text())["trace_segments"]:
            assert (previous / name).stat().st_ino != (last / name).stat().st_ino
            assert (previous / name).read_bytes() == (last / name).read_bytes()


def _check_resumable(run: Path) -> JobState:
    """After a kill: the newest complete checkpoint, and no half-written one counted."""
    folder = Checkpoints(run / "checkpoints").latest()
    assert folder is not None, "no checkpoint was complete before the kill"
    return JobState.read(folder)


@pytest.mark.parametrize(
    "failpoint",
    ["checkpoint.write=2", "sync.transfer=3", "update.step=5"],
    ids=["during-checkpoint-write", "during-weight-sync", "after-a-step"],
)
def test_main_job_killed_at_a_failpoint_resumes(tmp_path: Path, failpoint: str) -> None:
    run = tmp_path / "run"
    done = _cli("--out", str(run), *SMALL, env={"ASYNCFLOW_FAILPOINTS": failpoint})
    assert done.returncode == -signal.SIGKILL, done.stderr
    before = _check_resumable(run)
    if failpoint.startswith("checkpoint.write"):
        assert before.version == 2  # the second checkpoint (step 4) never became complete
        assert list((run / "checkpoints").glob(".tmp-*"))
    trained_before = {g for s in before.steps for g in s.groups}
    again = _cli("--resume", str(run), "--quiet")
    assert again.returncode == 0, again.stderr
    assert f"resuming from {run}/checkpoints/step-{before.version:08d}" in again.stderr
    _check_finished(run)
    after = JobState.read(run / "checkpoints" / f"step-{STEPS:08d}")
    new = [g for s in after.steps[before.version :] for g in s.groups]
    assert not set(new) & trained_before


def test_main_job_killed_at_random_points_resumes(tmp_path: Path) -> None:
    """SIGKILL from outside at random moments (after the first checkpoint is complete, the
    evidence a kill can be resumed from), resume, kill again, until the run finishes."""
    rng = random.Random(int(os.environ.get("ASYNCFLOW_TEST_SEED", "0")))
    run = tmp_path / "run"
    args = ["--out", str(run), *SMALL[:1], "rl.steps=16", *SMALL[2:]]
    kills = 0
    while True:
        proc = subprocess.Popen(
            [sys.executable, "-m", "asyncflow_core.cli", "run", *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        ckpts = Checkpoints(run / "checkpoints")
        start = ckpts.latest()
        deadline = time.monotonic() + 300
        # wait for evidence: a checkpoint newer than the one this attempt started from
        while proc.poll() is None and ckpts.latest() == start and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is None and kills < 3:
            time.sleep(rng.uniform(0.0, 0.4))  # a random point after it (maybe the end)
            proc.send_signal(signal.SIGKILL)
            kills += proc.wait() == -signal.SIGKILL
        _, err = proc.communicate(timeout=300)
        if proc.returncode == 0 or (run / "summary.json").exists():
            break  # finished (a kill that came after the summary was written ends it too)
        assert proc.returncode == -signal.SIGKILL, err
        args = ["--resume", str(run), "--quiet"]
    _check_finished(run, 16, resumed=kills > 0)


def test_sigterm_checkpoints_and_exits_cleanly(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ["--out", str(run), *SMALL[:1], "rl.steps=400", *SMALL[2:]]
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncflow_core.cli", "run", *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    ckpts = Checkpoints(run / "checkpoints")
    deadline = time.monotonic() + 300
    while ckpts.latest() is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "stopped on SIGTERM" in err and f"asyncflow run --resume {run}" in err
    state = _check_resumable(run)
    assert 0 < state.version < 400
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) >= state.version
    # a short resume: only rl.steps (here: stop soon) and other RESUME_KEYS may change
    refused = _cli("--resume", str(run), "--set", "seed=3")
    assert refused.returncode == 2 and "seed (0 -> 3) cannot change on resume" in refused.stderr
    # an edited config.toml is compared with the checkpoint's own (signed) config, not itself
    config = run / "config.toml"
    text = config.read_text()
    # (in this process: the CLI's exit status for it is the failure table's resume-changed row)
    for edit, named, key in (
        ("seed = 0", "seed = 5", "seed (0 -> 5)"),
        ("lr = 0.002", "lr = 0.5", "train.lr (0.002 -> 0.5)"),
    ):
        assert edit in text, edit
        config.write_text(text.replace(edit, named, 1))
        with pytest.raises(ConfigError, match="not changeable on resume") as refused_edit:
            resume_point(load_run_config(config), run)
        assert key in str(refused_edit.value)
    config.write_text(text)
    done = _cli("--resume", str(run), "--set", f"rl.steps={state.version + 2}", "--quiet")
    assert done.returncode == 0, done.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == state.version + 2 and summary["extra"]["resumed_at"]
    finished = _cli("--resume", str(run))
    assert finished.returncode == 2 and "already trained" in finished.stderr


def test_resume_needs_a_run_folder_with_a_checkpoint(tmp_path: Path) -> None:
    empty = _cli("--resume", str(tmp_path))
    assert empty.returncode == 2 and "no config.toml" in empty.stderr
    (tmp_path / "config.toml").write_text("")
    none = _cli("--resume", str(tmp_path))
    assert none.returncode == 2 and "no complete checkpoint" in none.stderr
    both = _cli("--resume", str(tmp_path), "--out", str(tmp_path / "x"))
    assert both.returncode == 2 and "drop --config and --out" in both.stderr


@pytest.mark.parametrize(
    "trainer",
    [["--set", "train.process=true"], ["--set", "train.engine=deepspeed"]],
    ids=["process-trainer", "deepspeed"],
)
def test_other_trainers_resume(tmp_path: Path, trainer: list[str]) -> None:
    run = tmp_path / "run"
    done = _cli("--out", str(run), *SMALL, *trainer, env={"ASYNCFLOW_FAILPOINTS": "update.step=5"})
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert _check_resumable(run).version == 4
    again = _cli("--resume", str(run), "--quiet")
    assert again.returncode == 0, again.stderr
    _check_finished(run)


def test_a_checkpoint_naming_a_foreign_trace_file_is_refused() -> None:
    from asyncflow_core.job.run import _trace_segments

    for bad in (["../../etc/x.json.gz"], "trace-0000.json.gz", [3], ["trace-1.json.gz"]):
        with pytest.raises(ConfigError, match="trace_segments"):
            _trace_segments({"trace_segments": bad})
    assert _trace_segments({}) is None  # a checkpoint of one whole trace.json.gz
    assert _trace_segments({"trace_segments": ["trace-0000.json.gz"]}) == ["trace-0000.json.gz"]


def test_the_trace_in_segments_starts_over_when_a_segment_is_gone(tmp_path: Path) -> None:
    from asyncflow_core.job.run import _RunFiles

    tracer = tracing.Tracer()
    root = tmp_path / "checkpoints"
    ckpts = Checkpoints(
        root, keep=5, extra=_RunFiles(root, tracer=tracer, warmup_s=0.0, resumed_at=[])
    )

    async def fill(folder: Path) -> None:
        (folder / "job.json").write_text("{}")

    def segments(folder: Path) -> list[str]:
        return list(json.loads((folder / "run.json").read_text())["trace_segments"])

    for step in (1, 2):
        tracer.record("task", "actor_update", step, step + 0.5)
        asyncio.run(ckpts.write(step, fill))
    assert segments(ckpts.path(2)) == ["trace-0000.json.gz", "trace-0001.json.gz"]
    (ckpts.path(2) / "trace-0000.json.gz").unlink()  # lost: the next one holds it all again
    tracer.record("task", "actor_update", 3, 3.5)
    asyncio.run(ckpts.write(3, fill))
    assert segments(ckpts.path(3)) == ["trace-0000.json.gz"]
    back = tracing.load(ckpts.path(3) / "trace-0000.json.gz").spans
    assert [s.start for s in back] == [1, 2, 3]
