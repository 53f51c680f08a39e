"""The test process's exit safety net (``tests/conftest.py``): a run whose exit is held by a
thread blocked for good fails after the grace, naming every thread and printing its stack,
instead of holding CI until an outside limit kills it; a run that exits cleanly is untouched."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from asyncflow_ray.runtime import _alive  # a zombie counts as dead

TESTS = Path(__file__).resolve().parent

LEAKS_A_THREAD = """
import threading

def test_leaves_a_thread_blocked_for_good():
    threading.Thread(target=threading.Event().wait, name="stuck-for-good").start()
"""

LEAKS_A_CHILD = """
import multiprocessing
import time
from pathlib import Path

def test_leaves_a_child_process_running():
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(3600,))
    child.start()  # not a daemon: multiprocessing's exit hook joins it
    Path("child.pid").write_text(str(child.pid))
"""

CLEAN = """
def test_nothing_left_behind():
    pass
"""


def _run(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_case.py").write_text(body)
    env = {**os.environ, "ASYNCFLOW_TEST_EXIT_GRACE_S": "2", "PYTHONPATH": str(TESTS)}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "conftest",
            "test_case.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_an_exit_held_by_a_stuck_thread_fails_with_every_stack(tmp_path: Path) -> None:
    proc = _run(tmp_path, LEAKS_A_THREAD)
    assert "1 passed" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "had not exited 2 s after its tests ended" in proc.stderr
    assert "'stuck-for-good' (non-daemon)" in proc.stderr
    assert "in wait" in proc.stderr  # the stuck thread's stack


def test_an_exit_held_by_a_child_process_kills_it_and_fails(tmp_path: Path) -> None:
    proc = _run(tmp_path, LEAKS_A_CHILD)
    assert "1 passed" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == 1, proc.stdout + proc.stderr
    pid = int((tmp_path / "child.pid").read_text())
    assert f"child process {pid}: " in proc.stderr, proc.stderr
    assert "multiprocessing" in proc.stderr  # its command line, and the join in the stacks
    deadline = time.monotonic() + 60.0  # a safety net: the kill was sent before the exit
    while _alive(pid):
        assert time.monotonic() < deadline, f"child {pid} outlived the watchdog's kill"
        time.sleep(0.05)


def test_a_clean_exit_is_untouched(tmp_path: Path) -> None:
    proc = _run(tmp_path, CLEAN)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "had not exited" not in proc.stderr
