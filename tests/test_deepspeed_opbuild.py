"""DeepSpeed's JIT op builds (``asyncflow_deepspeed.opbuild``) happen before a start's clock
runs, report progress, and a build lock left by a killed build fails a start at once, naming
the file to remove, instead of making every later start wait on it (issue #41, item 5).

The real op (``deepspeed_shm_comm``) takes about 40 s to build, so the build and wait paths run
with a stand-in op: a ``FakeBuilder`` that does what torch's JIT build does (takes the lock
with ``O_CREAT | O_EXCL``, runs ninja in the op's folder, removes the lock). The stale-lock
refusals run with DeepSpeed's real op, whose lock the test plants in a cache of its own.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from asyncflow_reference.model import ModelConfig

from asyncflow_core.contracts.errors import EngineError

pytest.importorskip("deepspeed", reason="the [deepspeed] extra is not installed")

import asyncflow_deepspeed
from asyncflow_deepspeed import DeepSpeedTrainEngine, launch, opbuild
from asyncflow_deepspeed.opbuild import JitOp, prepare_op

CONFIG = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
SHM = "deepspeed_shm_comm"
FAKE = JitOp("asyncflow_fake_op", "fake_ds_op:FakeBuilder")

needs_ninja = pytest.mark.skipif(
    shutil.which("ninja") is None, reason="ninja is not installed (torch's JIT builds need it)"
)

_FAKE_BUILDER = '''
import os, subprocess, sys
from pathlib import Path

WAIT = "import os, sys, time\\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.05)"

class FakeBuilder:
    """Builds like torch's JIT build: the lock (torch's FileBaton), ninja in the op's folder."""
    def load(self, verbose=False):
        folder = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "asyncflow_fake_op"
        folder.mkdir(parents=True, exist_ok=True)
        lock = folder / "lock"
        fd = os.open(lock, os.O_CREAT | os.O_EXCL)
        try:
            if os.environ.get("FAKE_OP_HOLD"):
                print("holding", flush=True)
                sys.stdin.readline()
            go = os.environ.get("FAKE_OP_GO")
            if go:  # a compiler at work in the folder, as ninja runs them, until the test says
                (folder / "compiling").touch()
                subprocess.run([sys.executable, "-c", WAIT, go], cwd=folder, check=True)
            if os.environ.get("FAKE_OP_FAILS"):
                raise RuntimeError("Error building extension 'asyncflow_fake_op': c++ said no")
            (folder / "build.ninja").write_text(
                "rule stamp\\n  command = touch $out\\nbuild built: stamp\\n"
            )
            subprocess.run(["ninja"], cwd=folder, check=True, capture_output=True)
        finally:
            os.close(fd)
            os.remove(lock)
'''


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A torch extensions cache of the test's own (never the user's)."""
    root = tmp_path / "torch_extensions"
    root.mkdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    return root


@pytest.fixture
def fake_op(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stand-in op is the one op a start needs; returns its build folder."""
    (tmp_path / "fake_ds_op.py").write_text(_FAKE_BUILDER)
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *([path] if path else [])]))
    monkeypatch.setattr(opbuild, "start_ops", lambda accelerator: [FAKE])
    return cache / FAKE.name


def _stale_lock(cache: Path, name: str = SHM) -> Path:
    lock = cache / name / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()  # what a build killed mid-way leaves: nobody holds it, nobody removes it
    return lock


def _wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class _Prepare:
    """``prepare_op`` on a thread of its own, its progress in a string."""

    def __init__(self, op: JitOp) -> None:
        self.out = io.StringIO()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(op,), daemon=True)
        self.thread.start()

    def _run(self, op: JitOp) -> None:
        try:
            prepare_op(op, "cpu", who="test", stream=self.out)
        except BaseException as e:
            self.error = e

    def join(self) -> None:
        self.thread.join(60)
        assert not self.thread.is_alive(), self.out.getvalue()


@pytest.fixture
def holder(fake_op: Path) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start a process that builds in the op's folder until told to go on (a line on stdin)."""
    started: list[subprocess.Popen[str]] = []

    def start(*, in_folder_only: bool = False) -> subprocess.Popen[str]:
        if in_folder_only:  # an orphaned ninja or compiler: runs in the folder, no lock open
            fake_op.mkdir(parents=True, exist_ok=True)
            command = [sys.executable, "-c", "import sys; print('holding', flush=True); input()"]
            process = subprocess.Popen(
                command, cwd=fake_op, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
        else:
            command = [sys.executable, "-c", "import fake_ds_op; fake_ds_op.FakeBuilder().load()"]
            env = {**os.environ, "FAKE_OP_HOLD": "1"}
            process = subprocess.Popen(
                command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
        started.append(process)
        assert process.stdout is not None and process.stdout.readline() == "holding\n"
        return process

    yield start
    for process in started:
        process.kill()
        process.wait()


# --------------------------------------------------------------------------------------------
# A stale lock fails a start at once, naming the file
# --------------------------------------------------------------------------------------------
def test_a_stale_build_lock_fails_the_launch_at_once_naming_the_file(cache: Path) -> None:
    """Before: the ranks waited on the lock in torch's file baton until the start timeout
    killed them, with an error that said nothing of the lock."""
    lock = _stale_lock(cache)
    with pytest.raises(EngineError) as info:
        launch(CONFIG, 2, zero_stage=0, micro_batch_size=2, start_timeout_s=30)
    message = str(info.value)
    assert str(lock) in message
    assert f"rm {lock}" in message
    assert "no process on this machine holds it" in message
    assert lock.exists()  # removing it is the user's call (another machine may share the cache)


@pytest.mark.timeout(120)  # before the fix this waited forever, in the constructor
def test_a_stale_build_lock_fails_an_engine_in_this_process(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from deepspeed.ops.op_builder.builder import OpBuilder

    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})  # as in a process that never loaded it
    lock = _stale_lock(cache)
    with pytest.raises(EngineError, match=re.escape(f"rm {lock}")):
        DeepSpeedTrainEngine(CONFIG)


def test_the_real_op_is_the_one_a_cpu_start_needs() -> None:
    assert [op.name for op in opbuild.start_ops("cpu")] == (
        [SHM] if sys.platform.startswith("linux") else []
    )
    assert opbuild.start_ops("cuda") == []


@pytest.mark.parametrize("given", [True, False])
def test_the_cache_folder_is_torchs(
    given: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.utils.cpp_extension import _get_build_directory  # the oracle

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # never the user's cache
    if given:
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    else:
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert opbuild.extensions_root() / SHM == Path(_get_build_directory(SHM, verbose=False))


# --------------------------------------------------------------------------------------------
# The build runs before the timed start, with progress; a live build is waited for
# --------------------------------------------------------------------------------------------
@needs_ninja
def test_the_build_runs_before_the_timed_start_and_reports_progress(
    fake_op: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    starts: list[tuple[bool, bool, float]] = []

    ranks: Any = object()

    def timed_start(*args: Any, start_timeout_s: float, **kwargs: Any) -> Any:
        starts.append(((fake_op / "built").exists(), (fake_op / "lock").exists(), start_timeout_s))
        return ranks

    monkeypatch.setattr(asyncflow_deepspeed, "SPMDTrainEngine", timed_start)
    assert launch(CONFIG, 2, start_timeout_s=0.5) is ranks
    assert starts == [(True, False, 0.5)]  # built, lock gone, before the clock started
    err = capsys.readouterr().err
    assert f"building DeepSpeed op {FAKE.name} in {fake_op}" in err
    assert "can take minutes" in err
    assert re.search(rf"building DeepSpeed op {FAKE.name} \.\.\. done in \d+ s", err)

    assert launch(CONFIG, 2, start_timeout_s=0.5) is ranks  # built: nothing to do, quietly
    assert capsys.readouterr().err == ""


@needs_ninja
def test_a_long_build_reports_that_it_goes_on(
    fake_op: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(opbuild, "REPORT_EVERY_S", 0.0)
    go = tmp_path / "go"
    monkeypatch.setenv("FAKE_OP_GO", str(go))  # the build goes on until the test says
    prepare = _Prepare(FAKE)
    _wait_for((fake_op / "compiling").exists, "the build's compiler")
    seen = len(prepare.out.getvalue())
    _wait_for(lambda: "\n" in prepare.out.getvalue()[seen:], "a report while it compiles")
    report = prepare.out.getvalue()[seen:]
    go.touch()
    prepare.join()
    assert prepare.error is None
    assert "still building DeepSpeed op" in report  # its own compilers are not another build
    out = prepare.out.getvalue()
    assert re.search(rf"building DeepSpeed op {FAKE.name} \.\.\. done in \d+ s", out)


@needs_ninja
def test_a_live_build_is_waited_for_and_reported(
    fake_op: Path, holder: Callable[..., subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(opbuild, "QUIET_WAIT_S", 0.0)
    builder = holder()
    prepare = _Prepare(FAKE)
    _wait_for(lambda: f"waiting for pid {builder.pid}" in prepare.out.getvalue(), "the report")
    assert str(fake_op / "lock") in prepare.out.getvalue()
    builder.communicate("go\n")  # its build goes on and ends
    prepare.join()
    assert prepare.error is None
    assert "is built (waited" in prepare.out.getvalue()
    assert f"building DeepSpeed op {FAKE.name} in" not in prepare.out.getvalue()  # not again


@needs_ninja
def test_an_orphaned_compiler_in_the_folder_is_waited_for_then_its_lock_is_stale(
    fake_op: Path, holder: Callable[..., subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's case: the rank was killed mid-build, its ninja and compilers go on in the
    op's folder, and nobody will remove the lock when they end."""
    monkeypatch.setattr(opbuild, "QUIET_WAIT_S", 0.0)
    orphan = holder(in_folder_only=True)
    lock = fake_op / "lock"
    lock.touch()
    prepare = _Prepare(FAKE)
    _wait_for(lambda: f"waiting for pid {orphan.pid}" in prepare.out.getvalue(), "the report")
    orphan.communicate("done\n")
    prepare.join()
    assert isinstance(prepare.error, EngineError)
    assert f"rm {lock}" in str(prepare.error)


@needs_ninja
def test_a_failed_build_raises_with_its_output(
    fake_op: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_OP_FAILS", "1")
    with pytest.raises(EngineError, match=r"(?s)failed \(exit code 1\).*c\+\+ said no"):
        prepare_op(FAKE, "cpu", who="test", stream=io.StringIO())
    assert not (fake_op / "lock").exists()


@needs_ninja
def test_a_failed_start_names_a_build_lock_left_behind(
    fake_op: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank killed by the start timeout while it held the lock (the build was done before
    the start, but a peer sharing the cache may have started one)."""

    def timed_start(*args: Any, **kwargs: Any) -> None:
        (fake_op / "lock").touch()
        raise EngineError("trainer-rank0: the engine process did not report ready within 0.5 s")

    monkeypatch.setattr(asyncflow_deepspeed, "SPMDTrainEngine", timed_start)
    with pytest.raises(EngineError, match="did not report ready") as info:
        launch(CONFIG, 2, start_timeout_s=0.5)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert f"rm {fake_op / 'lock'}" in notes
