"""A local Ray cluster does not outlive its driver: after the driver is SIGKILLed, every process
its ``RayRuntime`` started (GCS, raylet, Ray's agents, workers, the runtime's reaper) ends, Ray's
agents ended by the reaper rather than on their own; and the reaper ends the processes of the
driver's session that hold the cluster's files (and their children) but no other.

Nothing waits on the clock: the tests wait for the evidence (each process's exit status, the
processes gone, the reaper exited), and their time limits are only safety nets."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from asyncflow_ray.runtime import _alive, _reaper_watch, _start_reaper, _stop_reaper

SAFETY_S = 120.0  # for the reaper's processes to go; they go within seconds
CLUSTER_SAFETY_S = 600.0  # for a loaded machine to start a cluster and for all of it to end

DRIVER = """
import json, os, time
import psutil
from asyncflow_ray import RayRuntime
from asyncflow_ray.runtime import _cluster_pids, import_ray

RayRuntime(num_cpus=1, object_store_bytes=128 << 20).start()
ray = import_ray()

@ray.remote(num_cpus=0)
class Worker:
    def pid(self):
        return os.getpid()

worker = Worker.remote()
ray.get(worker.pid.remote())
mine = {p.pid for p in psutil.Process().children(recursive=True)}
print(json.dumps(sorted(mine | set(_cluster_pids(ray)))), flush=True)
time.sleep(3600)  # SIGKILLed
"""

OBSERVER = """
import ctypes, json, os, signal, subprocess, sys, time

# Orphans of our descendants become our children, so we see how each one ends.
PR_SET_CHILD_SUBREAPER = 36
if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
    sys.exit(f"prctl(PR_SET_CHILD_SUBREAPER) failed: errno {ctypes.get_errno()}")
errors = open(sys.argv[2], "w")  # the driver's stderr, which its reaper inherits
driver = subprocess.Popen(
    [sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, stderr=errors, text=True
)
line = driver.stdout.readline()
if not line:
    sys.exit(f"the driver exited with {driver.wait()} before starting its cluster")
commands = {}
for pid in json.loads(line):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            commands[pid] = f.read().replace(b"\\0", b" ").decode(errors="replace").strip()
    except OSError:
        commands[pid] = "?"
print(json.dumps(commands), flush=True)
os.kill(driver.pid, signal.SIGKILL)
killed = time.monotonic()
while True:
    try:
        pid, status = os.waitpid(-1, 0)
    except ChildProcessError:
        break  # no descendant left
    how = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
           else f"exit {os.WEXITSTATUS(status)}")
    print(json.dumps([pid, how, round(time.monotonic() - killed, 1)]), flush=True)
"""


def _wait_until_gone(pids: list[int], safety_s: float) -> list[int]:
    deadline = time.monotonic() + safety_s
    alive = [p for p in pids if _alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if _alive(p)]
    return alive


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper reads /proc")
def test_every_process_of_a_local_cluster_is_ended_after_its_driver_is_sigkilled(
    tmp_path: Path,
) -> None:
    """Every process a local cluster's driver started ends after the driver is SIGKILLed, and
    Ray's two agents are *ended*, by a signal, instead of ending on their own.

    Ray ties its GCS and raylet to the driver and its workers follow the raylet, but its
    DashboardAgent and RuntimeEnvAgent, told by a pipe that the raylet is gone, first report
    it to the dead GCS (a call with a 60 s deadline) and only then exit, with status 0: they
    outlived the driver by 13 to 60 s. How long is not what this test measures (the machine
    may be slow); how they end is: a subreaper observer in between makes every orphaned
    process of the cluster its child, so it sees each one's exit status. Without the
    runtime's reaper the agents exit 0, on their own, and the test fails."""
    pytest.importorskip("ray", reason="the Ray runtime needs the [ray] extra (ray 2.60)")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    errors = tmp_path / "driver.stderr"
    observer = subprocess.Popen(
        [sys.executable, "-c", OBSERVER, DRIVER, str(errors)],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        out, _ = observer.communicate(timeout=CLUSTER_SAFETY_S)
    except subprocess.TimeoutExpired:
        observer.kill()
        out, _ = observer.communicate()
        pytest.fail(f"the cluster had not ended {CLUSTER_SAFETY_S:.0f} s on: {out}")
    assert observer.returncode == 0, out
    lines = out.splitlines()
    commands = {int(pid): cmd for pid, cmd in json.loads(lines[0]).items()}
    ended = {pid: (how, after_s) for pid, how, after_s in map(json.loads, lines[1:])}
    agents = {
        p: c for p, c in commands.items() if c in ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
    }
    assert len(agents) == 2, commands
    report = {p: (commands[p][:80], ended.get(p)) for p in commands}
    assert set(commands) <= set(ended), f"not all ended: {report}"
    assert len([c for c in commands.values() if "reaper.py" in c]) == 1, report
    # Ended by us: killed by a signal, or signalled by the reaper (which says whom on the
    # driver's stderr) and gone on its own handler's terms: the DashboardAgent answers SIGTERM
    # with os._exit(15), the RuntimeEnvAgent at times with a clean exit 0.
    said = re.findall(r"signalled its processes \[([\d, ]*)\]", errors.read_text())
    signalled = {int(p) for found in said for p in found.split(",") if p.strip()}
    on_their_own = {
        agents[p]: ended[p]
        for p in agents
        if not ended[p][0].startswith("signal") and p not in signalled
    }
    assert not on_their_own, (
        f"Ray's agents ended on their own (status, seconds after the driver's death): "
        f"{on_their_own}; every process: {report}; the reaper signalled {sorted(signalled)}"
    )


def _spawn(code: str, *args: str, new_session: bool = False) -> tuple[subprocess.Popen[str], str]:
    """A Python process running ``code`` with ``args``, and the first line it prints once it
    is set up."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=new_session,
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


HOLDER = """
    import signal, sys, time
    log = open(sys.argv[1], "a")  # as every Ray process keeps its logs open
    if len(sys.argv) > 2:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready", flush=True)
    time.sleep(600)
"""
PARENT = """
    import subprocess, sys, time
    log = open(sys.argv[1], "a")
    child = subprocess.Popen(["sleep", "600"])  # holds nothing of the cluster's
    print(child.pid, flush=True)
    time.sleep(600)
"""
NAMER = """
    import time
    print("ready", flush=True)  # the folder is on its command line
    time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper reads /proc")
def test_the_reaper_ends_the_cluster_processes_and_their_children_and_no_other(
    tmp_path: Path,
) -> None:
    """Told to reap, the reaper ends every process of the driver's session that holds a file
    of the cluster's folder open (one that ignores SIGTERM included: SIGKILL after the grace)
    or names the folder, and their descendants; a process holding another folder's file, and
    one of another session holding the cluster's, are left alone."""
    cluster, other = tmp_path / "cluster", tmp_path / "other"
    cluster.mkdir()
    other.mkdir()
    reaper = _start_reaper()
    assert reaper is not None
    _reaper_watch(reaper, str(cluster))
    procs: list[subprocess.Popen[str]] = []
    try:
        holder, _ = _spawn(HOLDER, str(cluster / "a.log"))
        stubborn, ready = _spawn(HOLDER, str(cluster / "b.log"), "stubborn")
        assert ready == "ready"
        parent, grandchild = _spawn(PARENT, str(cluster / "c.log"))
        namer, _ = _spawn(NAMER, str(cluster))
        elsewhere, _ = _spawn(HOLDER, str(other / "a.log"))
        outsider, _ = _spawn(HOLDER, str(cluster / "d.log"), new_session=True)
        procs = [holder, stubborn, parent, namer, elsewhere, outsider]
        _stop_reaper(reaper, reap=True)  # returns once the reaper is done
        assert reaper.returncode == 0
        for proc in (holder, parent, namer):
            assert proc.wait(SAFETY_S) == -signal.SIGTERM
        assert stubborn.wait(SAFETY_S) == -signal.SIGKILL
        assert not _alive(int(grandchild))
        assert elsewhere.poll() is None and outsider.poll() is None
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        if reaper.poll() is None:
            reaper.kill()
            reaper.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper reads /proc")
def test_a_shut_down_clusters_reaper_ends_nothing(tmp_path: Path) -> None:
    """After a shutdown the driver lives on, and what still holds the cluster's files is the
    driver's (a forked child holds its Ray log): the reaper exits and ends nothing."""
    reaper = _start_reaper()
    assert reaper is not None
    _reaper_watch(reaper, str(tmp_path))
    holder, _ = _spawn(HOLDER, str(tmp_path / "a.log"))
    try:
        _stop_reaper(reaper, reap=False)
        assert reaper.returncode is not None
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper reads /proc")
def test_the_reaper_ends_the_cluster_when_its_driver_is_sigkilled(tmp_path: Path) -> None:
    """The driver's death alone (no shutdown, no word to the reaper) sets the reaper off."""
    driver, reaper_pid = _spawn(
        """
        import sys, time
        from asyncflow_ray.runtime import _reaper_watch, _start_reaper
        reaper = _start_reaper()
        _reaper_watch(reaper, sys.argv[1])
        print(reaper.pid, flush=True)
        time.sleep(600)
        """,
        str(tmp_path),
    )
    holder, _ = _spawn(HOLDER, str(tmp_path / "a.log"))
    try:
        driver.kill()
        driver.wait()
        assert _wait_until_gone([int(reaper_pid)], SAFETY_S) == [], "the reaper is still there"
        assert holder.wait(SAFETY_S) == -signal.SIGTERM
    finally:
        for proc in (driver, holder):
            proc.kill()
            proc.wait()
