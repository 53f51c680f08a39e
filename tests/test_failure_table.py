"""The README's failure table, injected row by row: each row names a failure of ``asyncflow
run``, a piece of the one message it must end in, and its exit status (0 done, 1 the run
stopped, 2 bad input, 3 the environment, 4 a bug). This module reads the table and runs every
row against the real CLI (``asyncflow_core.cli.main``, in this process) on a real run folder:
flipped bytes, missing and garbled files, edited job state and config, a read-only mount, a
size-limited tmpfs, a trainer process killed at a failpoint, an internal error. A row without
an injector here, or an injector without a row, fails; so the table and the tests stay one.
``make faults`` runs it alone.

Mounts need root with ``CAP_SYS_ADMIN`` (root ignores file modes, so a read-only folder must
be a read-only mount); where mounting is refused those rows skip, saying so."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncflow_core.cli import main
from asyncflow_core.infra.checkpoint import Checkpoints

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "--set", "rl.steps=4", "--set", "rl.prompts_per_step=8", "--set", "rl.n=4",
    "--set", "task.warmup_steps=5", "--set", "eval_prompts=0", "--set", "checkpoint.every=2",
    "--set", "checkpoint.min_interval_s=0", "--quiet",
]  # fmt: skip
_ROW = re.compile(
    r"^\| (?P<what>.+?) \(`(?P<id>[a-z-]+)`\) \| `(?P<says>[^`]+)` \| (?P<exit>\d) \|$"
)


def table_rows() -> dict[str, tuple[str, int]]:
    """The README's failure table: row id -> (the text stderr must contain, exit status)."""
    text = (ROOT / "README.md").read_text()
    start = text.index("| failure (`row id`) |")
    rows: dict[str, tuple[str, int]] = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        match = _ROW.match(line)
        assert match, f"README failure table: a row this test cannot read: {line!r}"
        rows[match["id"]] = (match["says"], int(match["exit"]))
    return rows


ROWS = table_rows()


# -- helpers ----------------------------------------------------------------------------------
def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["run", *argv])
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4 (copied by each row)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["run", "--out", str(out), *SMALL]) == 0
    assert [s for s, _ in Checkpoints(out / "checkpoints").list()] == [2, 4]
    return out


def copy_of(run: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run, target)
    return target


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """``mount(*options)``: a fresh tmpfs under tmp_path with those options, unmounted after."""
    made: list[Path] = []

    def make(*options: str) -> Path:
        where = tmp_path / f"mnt{len(made)}"
        where.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(where)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            pytest.skip(f"mounting a tmpfs is not allowed here: {done.stderr.strip()}")
        made.append(where)
        return where

    yield make
    for where in reversed(made):
        subprocess.run(["umount", "-l", str(where)], check=False)


def resumed_from_step_2(run: Path, err: str) -> None:
    """The run went on from step 2, with step 4 set aside, and finished its 4 steps."""
    assert f"resuming from {run / 'checkpoints' / 'step-00000002'}" in err, err
    assert (run / "checkpoints" / "step-00000004.damaged").is_dir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["extra"]["resumed_at"] == [2]


# -- the rows ---------------------------------------------------------------------------------
def row_bad_config(capsys: Any, tmp_path: Path, **_: Any) -> tuple[int, str]:
    return cli(capsys, "--out", str(tmp_path / "run"), "--set", "rl.staleness=-1")


def row_out_taken(capsys: Any, tmp_path: Path, finished_run: Path, **_: Any) -> tuple[int, str]:
    run = copy_of(finished_run, tmp_path)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    code, err = cli(capsys, "--out", str(run), *SMALL)
    assert f"asyncflow run --resume {run}" in err and "a new folder with --out" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before  # nothing written
    return code, err


def row_resume_changed(
    capsys: Any, tmp_path: Path, finished_run: Path, **_: Any
) -> tuple[int, str]:
    run = copy_of(finished_run, tmp_path)
    (run / "summary.json").unlink()  # as if it died after its last checkpoint
    config = run / "config.toml"
    config.write_text(config.read_text().replace("seed = 0", "seed = 5", 1))
    return cli(capsys, "--resume", str(run), "--quiet")


def row_resume_none(capsys: Any, tmp_path: Path, finished_run: Path, **_: Any) -> tuple[int, str]:
    run = tmp_path / "run"
    run.mkdir()
    shutil.copyfile(finished_run / "config.toml", run / "config.toml")
    return cli(capsys, "--resume", str(run))


def _damaged_newest(
    damage: Callable[[Path], None], capsys: Any, tmp_path: Path, finished_run: Path, **_: Any
) -> tuple[int, str]:
    run = copy_of(finished_run, tmp_path)
    (run / "summary.json").unlink()  # as if it died after its last checkpoint
    damage(run / "checkpoints" / "step-00000004")
    code, err = cli(capsys, "--resume", str(run), "--quiet")
    if code == 0:
        resumed_from_step_2(run, err)
    return code, err


def row_weights_flipped(**kw: Any) -> tuple[int, str]:
    return _damaged_newest(lambda c: flip_byte(c / "trainer" / "model.safetensors"), **kw)


def row_segment_missing(**kw: Any) -> tuple[int, str]:
    return _damaged_newest(lambda c: (c / "trace-0001.json.gz").unlink(), **kw)


def row_segment_garbled(**kw: Any) -> tuple[int, str]:
    def garble(c: Path) -> None:
        path = c / "trace-0000.json.gz"
        path.write_bytes(b"\x1f\x8b" + b"\x00" * (path.stat().st_size - 2))

    return _damaged_newest(garble, **kw)


def row_job_edited(**kw: Any) -> tuple[int, str]:
    def edit(c: Path) -> None:
        state = json.loads((c / "job.json").read_text())
        state["fed"], state["pending"] = 0, []
        (c / "job.json").write_text(json.dumps(state) + "\n")

    return _damaged_newest(edit, **kw)


def row_all_damaged(capsys: Any, tmp_path: Path, finished_run: Path, **_: Any) -> tuple[int, str]:
    run = copy_of(finished_run, tmp_path)
    (run / "summary.json").unlink()
    for _, folder in Checkpoints(run / "checkpoints").list():
        flip_byte(folder / "trainer" / "model.safetensors")
    code, err = cli(capsys, "--resume", str(run))
    assert "step-00000004: " in err and "step-00000002: " in err  # each named, with why
    return code, err


def row_foreign_key(
    capsys: Any, tmp_path: Path, finished_run: Path, monkeypatch: pytest.MonkeyPatch, **_: Any
) -> tuple[int, str]:
    """A run folder signed on another machine (another checkpoint key): refused, naming the
    opt-in; with ``--trust-checkpoints`` it resumes (its files still checked)."""
    run = copy_of(finished_run, tmp_path)
    (run / "summary.json").unlink()
    monkeypatch.setenv("ASYNCFLOW_CHECKPOINT_KEY", "another-machine-" + "k" * 32)
    code, err = cli(capsys, "--resume", str(run), "--quiet")
    assert "not signed with your checkpoint key" in err
    trusted, trusted_err = cli(capsys, "--resume", str(run), "--quiet", "--trust-checkpoints")
    assert trusted == 0, trusted_err
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    return code, err


def _not_started(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record any start-up work (building the workload): a refused folder must come first."""
    job_run = importlib.import_module(
        "asyncflow_core.job.run"
    )  # (the package's `run` is a function)
    built: list[str] = []
    real = job_run.make_workload

    def recording(*args: Any, **kwargs: Any) -> Any:
        built.append("workload")
        return real(*args, **kwargs)

    monkeypatch.setattr(job_run, "make_workload", recording)
    return built


def row_read_only(
    capsys: Any, mount: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, **_: Any
) -> tuple[int, str]:
    built = _not_started(monkeypatch)
    where = mount("ro", "size=4m")
    code, err = cli(capsys, "--out", str(where / "run"), *SMALL)
    assert str(where / "run") in err and built == []
    return code, err


def row_disk_full_start(
    capsys: Any, mount: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, **_: Any
) -> tuple[int, str]:
    built = _not_started(monkeypatch)
    where = mount("size=512k")
    code, err = cli(capsys, "--out", str(where / "run"), *SMALL)
    assert str(where / "run") in err and built == []
    return code, err


def row_disk_full_checkpoint(capsys: Any, mount: Callable[..., Path], **_: Any) -> tuple[int, str]:
    # 2 MiB: the 1-MiB start probe passes, the first checkpoint (~1.3 MB) fits, the second not
    where = mount("size=2m")
    code, err = cli(capsys, "--out", str(where / "run"), *SMALL)
    assert str(where / "run") in err
    return code, err


def row_trainer_lost(tmp_path: Path, **_: Any) -> tuple[int, str]:
    # a process of its own: a child's failpoint is read from the environment the child
    # starts with, and this process's multiprocessing helpers may predate the variable
    run = tmp_path / "run"
    code, err = _in_a_process_of_its_own(
        run,
        "--set",
        "train.process=true",
        env={"ASYNCFLOW_FAILPOINTS": "process.trainer.train_step=3"},
    )
    assert "killed by SIGKILL" in err, err
    assert f"asyncflow run --resume {run}" in err
    return code, err


def row_bug(
    capsys: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **_: Any
) -> tuple[int, str]:
    job_run = importlib.import_module(
        "asyncflow_core.job.run"
    )  # (the package's `run` is a function)

    def broken(*args: Any, **kwargs: Any) -> Any:
        return {}["a key that is not there"]  # a plain bug: KeyError

    monkeypatch.setattr(job_run, "make_workload", broken)
    code, err = cli(capsys, "--out", str(tmp_path / "run"), *SMALL)
    assert "Traceback" in err and "KeyError" in err
    return code, err


def _in_a_process_of_its_own(run: Path, *sets: str, env: dict[str, str]) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "asyncflow_core.cli", "run", "--out", str(run), *SMALL, *sets],
        capture_output=True, text=True, cwd=ROOT, timeout=600, check=False,
        env={**os.environ, **env},
    )  # fmt: skip
    return done.returncode, done.stderr


def row_deepspeed_stale_lock(tmp_path: Path, **_: Any) -> tuple[int, str]:
    # a process of its own: one that has loaded the op already (an earlier DeepSpeed test in
    # this one) rightly needs no build, so it never looks at the lock
    pytest.importorskip("deepspeed")
    cache = tmp_path / "torch_extensions"
    lock = cache / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()  # what a build killed mid-way leaves: nobody holds it, nobody removes it
    code, err = _in_a_process_of_its_own(
        tmp_path / "run",
        "--set",
        "train.engine=deepspeed",
        env={"TORCH_EXTENSIONS_DIR": str(cache)},
    )
    assert f"rm {lock}" in err, err
    return code, err


INJECT: dict[str, Callable[..., tuple[int, str]]] = {
    "bad-config": row_bad_config,
    "out-taken": row_out_taken,
    "resume-changed": row_resume_changed,
    "resume-none": row_resume_none,
    "weights-flipped": row_weights_flipped,
    "segment-missing": row_segment_missing,
    "segment-garbled": row_segment_garbled,
    "job-edited": row_job_edited,
    "all-damaged": row_all_damaged,
    "foreign-key": row_foreign_key,
    "read-only": row_read_only,
    "disk-full-start": row_disk_full_start,
    "disk-full-checkpoint": row_disk_full_checkpoint,
    "trainer-lost": row_trainer_lost,
    "bug": row_bug,
    "deepspeed-stale-lock": row_deepspeed_stale_lock,
}
NEEDS_RUN = {"foreign-key", "out-taken", "resume-changed", "resume-none", "weights-flipped",
             "segment-missing", "segment-garbled", "job-edited", "all-damaged"}  # fmt: skip


def test_every_row_of_the_table_has_an_injection_and_every_injection_a_row() -> None:
    assert sorted(ROWS) == sorted(INJECT)


@pytest.mark.parametrize("row", sorted(ROWS))
def test_failure_row(row: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    says, status = ROWS[row]
    kwargs: dict[str, Any] = {
        "capsys": request.getfixturevalue("capsys"),
        "tmp_path": tmp_path,
        "monkeypatch": request.getfixturevalue("monkeypatch"),
    }
    if row in NEEDS_RUN:
        kwargs["finished_run"] = request.getfixturevalue("finished_run")
    if row.startswith(("read-only", "disk-full")):
        kwargs["mount"] = request.getfixturevalue("mount")
    code, err = INJECT[row](**kwargs)
    assert says in err, f"{row}: expected {says!r} in:\n{err}"
    assert code == status, f"{row}: exit {code}, expected {status}:\n{err}"
    # one message of ours; a traceback only for a bug (with the request to report it)
    assert "asyncflow run: " in err
    assert ("Traceback" in err) == (row == "bug"), err
