"""Ends every process of a local Ray cluster once the driver that started it is gone.

``RayRuntime`` starts this file as a script (``python -I reaper.py SID``: standard library only,
so it starts in milliseconds and imports neither Ray nor torch) in a session of its own, before
``ray.init`` starts a local cluster, and names the cluster's folders on its stdin, a pipe, one
per line: the temp dir it made for the cluster, then the session dir once ``ray.init`` returns.
The pipe's end of file (the driver died, SIGKILL included) or an empty line (``ray.init``
failed midway) sets it off; should a fork of the driver hold the pipe open, the reaper's parent
changes, which it checks every second. (After a clean ``RayRuntime.shutdown`` the runtime
terminates it instead: what still holds the cluster's files then is a child the driver
forked.) It then ends the cluster's processes — those of the
driver's session ``SID`` that hold a file in one of the folders open or name one on their
command line, and their descendants — with SIGTERM, then SIGKILL for those left after
``GRACE_S``, and exits once none is left. Every process of a Ray cluster keeps its log files
open in the session dir; Ray rewrites its agents' and workers' command lines (and with them
part of their environment), so those alone would miss them.

Why: Ray 2.60 ties its GCS and raylet to the driver (``PR_SET_PDEATHSIG``) and its workers
follow the raylet within seconds, but its DashboardAgent and RuntimeEnvAgent, told by a pipe
that the raylet is gone, first report it to the dead GCS (a call with a 60 s deadline) and only
then exit: they outlived a SIGKILLed driver by 13 to 60 s. Ray's own reaper
(``ray_process_reaper.py``) kills its process group, but ``ray.init`` starts it only where the
kernel cannot fate-share (not on Linux), and the raylet puts each worker in a group of its own.
Linux only: it reads ``/proc``.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time
from collections.abc import Iterable

GRACE_S = 2.0
"""How long the processes have after SIGTERM before SIGKILL."""

GIVE_UP_S = 30.0
"""After SIGKILL, how long the reaper waits for the processes to go before it gives up on
those it cannot end (another user's, or stuck in the kernel)."""


def cluster_processes(folders: Iterable[str], sid: int, spare: Iterable[int] = ()) -> list[int]:
    """The live processes of session ``sid`` that hold a file under one of ``folders`` open or
    name one on their command line, and their descendants (any session), except ``spare``."""
    names = [f.rstrip("/") for f in folders if f.strip("/")]
    if not names:
        return []
    under = tuple(f"{f}/" for f in names)
    parent: dict[int, int] = {}
    roots: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[-1].split()
        except OSError:
            continue  # gone
        if fields[0] == b"Z":  # a zombie has ended; its parent has yet to reap it
            continue
        parent[pid] = int(fields[1])
        if int(fields[3]) == sid and _uses(entry, names, under):
            roots.add(pid)
    spared = set(spare)
    return sorted(p for p in with_descendants(parent, roots) if p not in spared)


def with_descendants(parent: dict[int, int], roots: set[int]) -> list[int]:
    """The processes of ``parent`` (pid -> parent pid) that are in ``roots`` or descend from
    one (at most 64 generations up)."""
    found = []
    for pid in parent:
        p, depth = pid, 0
        while p > 1 and depth < 64:
            if p in roots:
                found.append(pid)
                break
            p, depth = parent.get(p, 0), depth + 1
    return found


def _uses(entry: str, names: list[str], under: tuple[str, ...]) -> bool:
    """Whether process ``entry`` names one of the folders on its command line or holds a file
    under one open (False for one that is gone or another user's)."""
    with contextlib.suppress(OSError):
        with open(f"/proc/{entry}/cmdline", "rb") as f:
            command = os.fsdecode(f.read())  # its arguments, each ended by a NUL
        if any(f"{name}/" in command or f"{name}\0" in command for name in names):
            return True
        for fd in os.listdir(f"/proc/{entry}/fd"):
            with contextlib.suppress(OSError):  # closed meanwhile
                if os.readlink(f"/proc/{entry}/fd/{fd}").startswith(under):
                    return True
    return False


def reap(
    folders: Iterable[str], sid: int, spare: Iterable[int] = (), grace_s: float = GRACE_S
) -> list[int]:
    """End the cluster's processes (``cluster_processes``): SIGTERM, then SIGKILL after
    ``grace_s`` to any left, looking again each round for processes started meanwhile (a
    signalled process stays a target until it is gone: orphaned by its parent's end, it is no
    longer found by descent); returns every pid signalled. Gives up ``GIVE_UP_S`` after SIGKILL
    on those it cannot end."""
    folders, spare = list(folders), list(spare)
    signalled: set[int] = set()
    kill_at = time.monotonic() + grace_s
    give_up_at = kill_at + GIVE_UP_S
    while time.monotonic() < give_up_at:
        pids = set(cluster_processes(folders, sid, spare)) | {p for p in signalled if _alive(p)}
        if not pids:
            break
        kill = time.monotonic() >= kill_at
        for pid in pids:
            if kill or pid not in signalled:
                with contextlib.suppress(OSError):  # gone, or not ours to signal
                    os.kill(pid, signal.SIGKILL if kill else signal.SIGTERM)
                signalled.add(pid)
        time.sleep(0.05)
    return sorted(signalled)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return False


def main(sid: int) -> None:
    """Read folders from stdin until an empty line, its end or the parent's death, then
    ``reap`` them."""
    driver = os.getppid()
    folders: list[str] = []
    pending = b""
    while os.getppid() == driver:
        ready, _, _ = select.select([0], [], [], 1.0)
        if not ready:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            break  # the driver is gone
        *lines, pending = (pending + chunk).split(b"\n")
        if b"" in lines:  # reap now
            folders += [os.fsdecode(line) for line in lines[: lines.index(b"")]]
            break
        folders += [os.fsdecode(line) for line in lines]
    ended = reap(folders, sid, spare=(os.getpid(), driver))
    if ended:  # on the driver's stderr, if it still has one: what was left, and is no more
        with contextlib.suppress(OSError):
            print(
                f"asyncflow_ray reaper: the Ray cluster's driver (pid {driver}) is gone; "
                f"signalled its processes {ended}",
                file=sys.stderr,
                flush=True,
            )


if __name__ == "__main__":
    main(int(sys.argv[1]))
