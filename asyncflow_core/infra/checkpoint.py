"""Job checkpoints on disk: a folder of numbered checkpoints, each written atomically, the
newest ``keep`` kept; and failpoints, the crash-injection points the kill-and-resume tests
use.

``Checkpoints(root, keep=3)`` manages ``root/step-00000040/`` folders. ``await write(step,
fill)`` has ``fill(folder)`` write the files into a hidden temporary folder beside them,
flushes every file to disk, then renames the folder into place: a checkpoint folder either
holds everything or does not exist, so a crash while writing (a SIGKILL, a full disk, a
``fill`` that raises) leaves the previous checkpoint as the newest complete one. Leftover
temporary folders of a crashed write are removed by the next ``write`` (and ignored by
``latest``). What goes into a checkpoint is the writer's: ``RLJob.checkpoint`` writes the
trainer's own files (``TrainEngine.save_checkpoint``) under ``trainer/`` and the job's state
in ``job.json`` (``asyncflow_core.flow.rlflow``).

**Failpoints** (``failpoint(name)``): a point in the code where, when the environment variable
``ASYNCFLOW_FAILPOINTS`` names it (``name=K``, comma-separated for several), the process kills
itself with SIGKILL the K-th time it gets there: no ``finally``, no flush, exactly what a
preempted or OOM-killed job sees. Unset (always, outside tests), a failpoint is a dictionary
lookup. The points: ``checkpoint.write`` (inside a checkpoint's temporary folder, after the
trainer's files are written and before the rename), ``sync.transfer`` (in a weight sync,
after the first bucket was sent), ``update.step`` (after an optimizer step, before the job
records it), ``process.NAME.METHOD`` (in the child process of a ``ProcessTrainEngine`` or
``ProcessInferenceEngine`` named NAME, when a call of METHOD arrives: e.g.
``process.trainer.train_step=5`` kills the trainer's process at its fifth step),
``ray.NAME.METHOD`` (the same in the Ray actor hosting engine NAME; the variable reaches the
actors of a local cluster started after it was set).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

from asyncflow_core.contracts.errors import ConfigError

FAILPOINTS_ENV = "ASYNCFLOW_FAILPOINTS"
FAILPOINTS_ONCE_ENV = "ASYNCFLOW_FAILPOINTS_ONCE"
_PREFIX = "step-"
_TMP = ".tmp-"
_NAME = re.compile(r"^step-(\d{8,})$")


class Checkpoints:
    """Numbered checkpoint folders under ``root`` (``step-NNNNNNNN``), written atomically,
    at most ``keep`` of them kept (the oldest removed after a newer one is complete).
    ``extra(folder)``, if given, adds files of its own to every checkpoint (run in a worker
    thread, after the writer's files and before the rename), e.g. a run's trace and RNG
    states."""

    def __init__(
        self,
        root: str | Path,
        *,
        keep: int = 3,
        extra: Callable[[Path], None] | None = None,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"Checkpoints: keep must be an int >= 1, got {keep!r}")
        self.root = Path(root)
        self.keep = keep
        self.extra = extra

    def __repr__(self) -> str:
        return f"Checkpoints({str(self.root)!r}, keep={self.keep})"

    def path(self, step: int) -> Path:
        """Where the checkpoint of ``step`` is (or would be)."""
        return self.root / f"{_PREFIX}{step:08d}"

    def list(self) -> list[tuple[int, Path]]:
        """The complete checkpoints, oldest first, as ``(step, folder)``."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            match = _NAME.match(entry.name)
            if match and entry.is_dir():
                found.append((int(match.group(1)), entry))
        return sorted(found)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        found = self.list()
        return found[-1][1] if found else None

    async def write(self, step: int, fill: Callable[[Path], Awaitable[None]]) -> Path:
        """Write the checkpoint of ``step``: ``await fill(folder)`` writes its files into a
        temporary folder, which is flushed to disk and renamed into place; then the oldest
        checkpoints beyond ``keep`` are removed. A checkpoint of ``step`` that is already
        complete is kept as it is (``fill`` is not called). Returns the folder."""
        final = self.path(step)
        if final.is_dir():
            return final
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_leftovers()
        tmp = self.root / f"{_TMP}{_PREFIX}{step:08d}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        try:
            await fill(tmp)
            if self.extra is not None:
                await asyncio.to_thread(self.extra, tmp)
            failpoint("checkpoint.write")
            _fsync_tree(tmp)
            os.rename(tmp, final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for _, old in self.list()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def _remove_leftovers(self) -> None:
        for entry in self.root.iterdir():
            if entry.name.startswith(_TMP):
                shutil.rmtree(entry, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(folder))


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems refuse fsync on a directory
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# -- failpoints ------------------------------------------------------------------------------
_hits: dict[str, int] = {}
_armed: dict[str, int] | None = None


def _parse(spec: str) -> dict[str, int]:
    armed: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, count = part.partition("=")
        try:
            armed[name.strip()] = int(count) if count else 1
        except ValueError:
            raise ConfigError(
                f"{FAILPOINTS_ENV}: {part!r} is not NAME=K (K: the hit that kills)"
            ) from None
    return armed


def failpoint(name: str) -> None:
    """SIGKILL this process at the K-th hit of ``name`` when ``ASYNCFLOW_FAILPOINTS`` arms it
    (``name=K``); otherwise nothing. With ``ASYNCFLOW_FAILPOINTS_ONCE`` set to a folder, a
    failpoint fires once in all: it leaves a file named after it there first, and a process
    that finds the file (e.g. a worker restarted after the kill) lets the hit pass."""
    global _armed
    if _armed is None:
        _armed = _parse(os.environ.get(FAILPOINTS_ENV, ""))
    if name not in _armed:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == _armed[name]:
        once = os.environ.get(FAILPOINTS_ONCE_ENV)
        if once:
            try:
                with open(Path(once) / f"{name}.fired", "x"):
                    pass
            except FileExistsError:
                return
        os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["FAILPOINTS_ENV", "FAILPOINTS_ONCE_ENV", "Checkpoints", "failpoint"]
