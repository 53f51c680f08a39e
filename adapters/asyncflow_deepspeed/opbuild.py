"""DeepSpeed's JIT-compiled ops, built before a start's clock runs, and their stale build locks.

DeepSpeed compiles some ops on first use with ``torch.utils.cpp_extension``: one build folder
per op in the torch extensions cache (``$TORCH_EXTENSIONS_DIR``, else
``~/.cache/torch_extensions/py<XY>_<cpu|cuXY>``), under a lock file (torch's ``FileBaton``:
``<folder>/lock``, created with ``O_EXCL``, no pid inside) that the building process removes
when it ends. On the CPU accelerator every process that starts DeepSpeed's comm backend loads
``deepspeed_shm_comm``: about 40 s to build on an idle 2-core box, 14 minutes seen on a busy
one. Built inside a rank process, that build ran against the rank's start timeout, which
killed it mid-build; the lock stayed, and every later start using that cache waited on it.

``prepare_ops`` (``launch`` calls it before starting the ranks, each engine before starting
DeepSpeed) builds the ops first, in a child process with no time limit, reporting progress on
stderr; it waits for a build another live process runs, and refuses a lock that no live build
holds with an error naming the file to remove. Whether a build is alive is decidable for this
user's processes on this machine only (``/proc``): one holding the lock open (the baton keeps
its descriptor until it removes the file) or running in the op's folder (torch runs ninja and
the compilers there; they outlive a killed build's Python).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TextIO

from asyncflow_core.contracts.errors import EngineError, EnvironmentFault

POLL_S = 0.2
SCAN_EVERY_S = 1.0
"""How often ``/proc`` is searched for a lock's holders while one exists (a search reads every
process's descriptors: milliseconds per hundred processes)."""
REPORT_EVERY_S = 30.0
QUIET_WAIT_S = 5.0
"""A wait on another process's lock is reported once it lasts this long (a peer rank checking
an op that is built already holds the lock for milliseconds)."""

# The child that builds one op: DeepSpeed's own loader (``OpBuilder.load``), as a rank runs it.
_BUILD = """\
import importlib, sys
module, _, name = sys.argv[1].partition(":")
getattr(importlib.import_module(module), name)().load(verbose=False)
"""


@dataclass(frozen=True)
class JitOp:
    """One op DeepSpeed compiles on first use: ``name`` is its torch extension's name (and
    build folder), ``builder`` the ``"module:Class"`` of the DeepSpeed ``OpBuilder`` whose
    ``load()`` builds and loads it."""

    name: str
    builder: str


def start_ops(accelerator: str) -> list[JitOp]:
    """The ops a process compiles when it starts DeepSpeed on ``accelerator``: the comm
    backend's shared-memory collectives (``deepspeed_shm_comm``, loaded by
    ``deepspeed.comm.torch.build_shm_op``) on the CPU accelerator on Linux, unless DeepSpeed
    was installed with them prebuilt. (The engines hand DeepSpeed torch's ``AdamW``: no
    optimizer op.)"""
    if accelerator != "cpu" or not sys.platform.startswith("linux"):
        return []
    from deepspeed.git_version_info import accelerator_name, installed_ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    name = ShareMemCommBuilder.NAME
    if installed_ops.get(name, False) and accelerator_name == accelerator:
        return []
    if not ShareMemCommBuilder().is_compatible():
        return []
    return [JitOp(name, f"{ShareMemCommBuilder.__module__}:{ShareMemCommBuilder.__name__}")]


def extensions_root() -> Path:
    """Where torch builds JIT extensions (``torch.utils.cpp_extension``'s rule):
    ``$TORCH_EXTENSIONS_DIR`` as given, else ``get_default_build_root()`` plus
    ``py<major><minor><abiflags>_<rocmXY|cuXY|cpu>``."""
    given = os.environ.get("TORCH_EXTENSIONS_DIR")
    if given is not None:
        return Path(given).absolute()
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def build_holders(folder: Path) -> list[tuple[int, str]]:
    """``(pid, command)`` of the processes on this machine that build in ``folder``: they hold
    its ``lock`` open or run inside it. Only the processes ``/proc`` shows in full (this
    user's, this PID namespace's) can be seen."""
    lock = os.path.realpath(folder / "lock")
    base = os.path.realpath(folder)
    found: list[tuple[bool, int, str]] = []  # (holds the lock, pid, command)
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return []
    for pid in entries:
        proc = f"/proc/{pid}"
        try:
            cwd = os.readlink(f"{proc}/cwd")
        except OSError:
            cwd = ""
        inside = cwd == base or cwd.startswith(base + os.sep)
        try:
            fds = os.listdir(f"{proc}/fd")
        except OSError:
            fds = []
        holds = any(_link(f"{proc}/fd/{fd}") == lock for fd in fds)
        if holds or inside:
            try:
                command = Path(f"{proc}/comm").read_text().strip()
            except OSError:
                command = "?"
            found.append((holds, int(pid), command))
    found.sort(key=lambda f: not f[0])  # the lock's holder first: the build's own process
    return [(pid, command) for _, pid, command in found]


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def prepare_ops(
    accelerator: str, *, who: str, in_this_process: bool = False, stream: TextIO | None = None
) -> None:
    """Return once every op of ``start_ops(accelerator)`` is built (``prepare_op``).
    ``in_this_process``: skip the ops this process has loaded already (DeepSpeed does not load
    them again)."""
    for op in start_ops(accelerator):
        if in_this_process and _loaded_here(op):
            continue
        prepare_op(op, accelerator, who=who, stream=stream)


def prepare_op(op: JitOp, accelerator: str, *, who: str, stream: TextIO | None = None) -> None:
    """Return once ``op`` is built in the extensions cache: at once if ninja has nothing to do
    in its folder; after waiting for a build that another live process runs there; else after
    building it in a child process (DeepSpeed's ``OpBuilder.load``), with no time limit and
    progress on ``stream`` (default stderr). Raises ``EngineError`` naming the lock file when a
    lock that no live process holds would make DeepSpeed wait forever, and with the build's
    output when the build fails."""
    folder = extensions_root() / op.name
    lock = folder / "lock"
    started = time.monotonic()
    reported = started - REPORT_EVERY_S + QUIET_WAIT_S
    child: subprocess.Popen[bytes] | None = None
    suspect: tuple[int, int] | None = None  # a lock no process held on the last look
    seen: tuple[int, int] | None = None
    scanned = -SCAN_EVERY_S
    holders: list[tuple[int, str]] = []
    waited = False

    def say(message: str) -> None:
        print(f"asyncflow_deepspeed: {message}", file=stream or sys.stderr, flush=True)

    with contextlib.ExitStack() as cleanup:
        log = cleanup.enter_context(tempfile.TemporaryFile())
        while True:
            if child is not None and child.poll() is not None:
                _finish(child, log, op, who)
                say(f"building DeepSpeed op {op.name} ... done in {_ago(started)}")
                return
            key = _lock_key(lock)
            if key is None:
                suspect, holders = None, []
                if child is None:
                    if _up_to_date(folder):
                        if waited:
                            say(f"DeepSpeed op {op.name} is built (waited {_ago(started)})")
                        return
                    say(
                        f"building DeepSpeed op {op.name} in {folder} (the first start with "
                        "this torch extensions cache; it can take minutes)..."
                    )
                    child = subprocess.Popen(
                        [sys.executable, "-c", _BUILD, op.builder],
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env={**os.environ, "DS_ACCELERATOR": accelerator},
                    )
                    cleanup.callback(_interrupt, child)
                    started = reported = time.monotonic()
            elif time.monotonic() - scanned >= SCAN_EVERY_S or key != seen:
                scanned, seen = time.monotonic(), key
                holders = build_holders(folder)
                if holders:
                    suspect = None
                elif suspect == key:  # the same lock, unheld, on two looks: not mid-release
                    raise _stale(who, op, lock)
                else:
                    suspect = key
            now = time.monotonic()
            if now - reported >= REPORT_EVERY_S:
                reported = now
                ours = child is not None and child.pid in {pid for pid, _ in holders}
                if holders and not ours:
                    waited = True
                    say(
                        f"waiting for {_processes(holders)}, building DeepSpeed op {op.name} "
                        f"(its lock: {lock}) for {_ago(started)} so far..."
                    )
                elif child is not None:
                    say(f"still building DeepSpeed op {op.name} ({_ago(started)} so far)...")
            time.sleep(POLL_S)


def lock_note(accelerator: str) -> str | None:
    """A note for a start that failed: the build locks of ``start_ops(accelerator)`` that
    exist (a rank loading that op waits until its lock is gone), and who holds them."""
    notes = []
    for op in start_ops(accelerator):
        folder = extensions_root() / op.name
        lock = folder / "lock"
        if not lock.exists():
            continue
        holders = build_holders(folder)
        if holders:
            notes.append(
                f"DeepSpeed's build lock {lock} exists, held by {_processes(holders)}: a rank "
                f"loading op {op.name} waits until that build ends"
            )
        else:
            notes.append(
                f"DeepSpeed's build lock {lock} exists and no process on this machine holds "
                f"it: a build of op {op.name} was killed before it finished and every rank "
                f"waits on the lock; remove it (rm {lock}) and start again"
            )
    return "\n".join(notes) or None


# --------------------------------------------------------------------------------------------
def _loaded_here(op: JitOp) -> bool:
    from deepspeed.ops.op_builder.builder import OpBuilder

    return op.name in getattr(OpBuilder, "_loaded_ops", {})


def _lock_key(lock: Path) -> tuple[int, int] | None:
    try:
        st = lock.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns)


def _up_to_date(folder: Path) -> bool:
    """Whether ninja has nothing to do in ``folder`` (torch runs ninja there under the lock on
    every load: a change of DeepSpeed's sources or torch's headers rebuilds)."""
    if not (folder / "build.ninja").is_file():
        return False
    try:
        done = subprocess.run(
            ["ninja", "-n"], cwd=folder, capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and "no work to do" in done.stdout


def _finish(child: subprocess.Popen[bytes], log: IO[bytes], op: JitOp, who: str) -> None:
    if child.returncode == 0:
        return
    log.seek(0)
    output = log.read().decode(errors="replace")[-6000:]
    raise EngineError(
        f"{who}: building DeepSpeed op {op.name!r} failed (exit code {child.returncode}); "
        f"its output ends:\n{output}"
    )


def _interrupt(child: subprocess.Popen[Any]) -> None:
    """Stop a build child that still runs the way Ctrl-C does, so that torch removes its lock
    (a kill would leave it); kill it if it does not end. A Ctrl-C at the terminal has reached
    it already: a second one could cut its cleanup short, so it gets a moment first."""
    try:
        child.wait(1)
        return
    except subprocess.TimeoutExpired:
        pass
    child.send_signal(signal.SIGINT)
    try:
        child.wait(30)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


class StaleBuildLockError(EngineError, EnvironmentFault):
    """A DeepSpeed op's build lock left by a build that is gone; the message names the file
    and when it is safe to remove it."""


def _stale(who: str, op: JitOp, lock: Path) -> StaleBuildLockError:
    try:
        age = f", made {_ago(lock.stat().st_mtime, clock=time.time)} ago"
    except OSError:
        age = ""
    folder = lock.parent
    return StaleBuildLockError(
        f"{who}: DeepSpeed cannot load op {op.name!r}: its build lock {lock} is left over "
        f"(no process on this machine holds it or runs in {folder}{age}): a build was killed "
        "before it finished (a start timeout, a crash), and DeepSpeed would wait on the lock "
        f"forever. Remove it (rm {lock}) and start again; the op is rebuilt then. It is safe "
        f"to remove unless a build by another user, container or machine sharing {folder} "
        "runs right now"
    )


def _processes(holders: list[tuple[int, str]], shown: int = 3) -> str:
    named = ", ".join(f"pid {pid} ({command})" for pid, command in holders[:shown])
    return named + (f" and {len(holders) - shown} more" if len(holders) > shown else "")


def _ago(since: float, clock: Callable[[], float] = time.monotonic) -> str:
    seconds = max(0.0, clock() - since)
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


__all__ = [
    "JitOp",
    "build_holders",
    "extensions_root",
    "lock_note",
    "prepare_op",
    "prepare_ops",
    "start_ops",
]
