"""Shared fixtures. ``ray_runtime``: one local Ray cluster per test module that asks for it
(skipped with the reason when the ``[ray]`` extra is missing), shut down after the module with
every process it started."""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network from tests

# A safety net for the test process's own exit, after its summary: Python waits there for every
# non-daemon thread, then runs atexit hooks (multiprocessing's joins its live children, Ray's
# shuts its cluster down), and one blocked for good would hold the run (and CI) until an outside
# limit killed it, with nothing printed. After the grace this prints what is left (threads and
# their stacks, child processes), kills those children so none holds the run's output open, and
# exits with a failure.
EXIT_GRACE_S = float(os.environ.get("ASYNCFLOW_TEST_EXIT_GRACE_S", "300"))
_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


def pytest_unconfigure(config: pytest.Config) -> None:
    status = config.stash.get(_EXIT_STATUS, 0)

    def start() -> None:
        threading.Thread(
            target=_exit_watchdog, args=(status,), name="exit-watchdog", daemon=True
        ).start()

    # Armed when the interpreter starts to exit (before it waits for the other threads, as
    # concurrent.futures' own exit hook is), so a pytest run inside a longer process arms nothing.
    threading._register_atexit(start)  # type: ignore[attr-defined]


def _exit_watchdog(status: int) -> None:
    time.sleep(EXIT_GRACE_S)  # a daemon thread: a process that exits ends it here
    err = sys.stderr
    err.write(
        f"\n!!! the test process had not exited {EXIT_GRACE_S:.0f} s after its tests ended; "
        "its threads, their stacks and its child processes follow; the children are killed "
        "and it exits with a failure !!!\n"
    )
    for thread in threading.enumerate():
        kind = "daemon" if thread.daemon else "non-daemon"
        err.write(f"  thread {thread.ident or 0:#x} {thread.name!r} ({kind})\n")
    err.flush()
    faulthandler.dump_traceback(file=err, all_threads=True)
    for pid, cmdline in _descendants(os.getpid()):
        err.write(f"  child process {pid}: {cmdline[:300]}\n")
        with contextlib.suppress(OSError):  # gone already
            os.kill(pid, signal.SIGKILL)
    err.flush()
    os._exit(status or 1)


def _descendants(root: int) -> list[tuple[int, str]]:
    """Every live descendant of ``root`` with its command line, read from ``/proc`` (Linux);
    elsewhere, multiprocessing's own children only."""
    if not os.path.isdir("/proc/self"):
        return [(p.pid or 0, p.name) for p in multiprocessing.active_children()]
    from test_sockets import process_tree  # this folder's /proc walk

    found: list[tuple[int, str]] = []
    for pid in process_tree(root):
        if pid == root:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            cmdline = "?"
        found.append((pid, cmdline))
    return found


@pytest.fixture(scope="module")
def ray_runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("ray", reason="the Ray runtime needs the [ray] extra (ray 2.60)")
    from asyncflow_ray.runtime import RayRuntime

    # logical CPUs: actors reserve 0 or fractions of them, the 2 real cores are shared
    rt = RayRuntime(num_cpus=4, object_store_bytes=512 << 20).start()
    try:
        yield rt
    finally:
        rt.shutdown()


@pytest.fixture(scope="module")
def module_by_value(ray_runtime: Any, request: pytest.FixtureRequest) -> Iterator[None]:
    """Ray's workers cannot import a test module: what the requesting module defines (its
    small engines, the functions it runs in actors) is pickled by value while it runs."""
    from asyncflow_ray.runtime import import_ray

    ray = import_ray()
    module = request.module
    ray.cloudpickle.register_pickle_by_value(module)
    try:
        yield
    finally:
        ray.cloudpickle.unregister_pickle_by_value(module)
