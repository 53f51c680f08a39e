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

**Manifests.** Every checkpoint ends with ``manifest.json``, written last, before the rename:
each file's size and sha256, the ``identity`` the owner gives (the main job: its config hash,
workload and seed) and an HMAC-SHA256 over it all with this user's checkpoint key (the
signed manifest the DeepSpeed trainer writes too: ``sign_manifest`` in
``asyncflow_core.infra.manifest``; SECURITY.md). ``verify(folder)`` checks it (a flipped
byte, a truncated or missing file, a file added, an edit without the key: ``CheckpointError``)
and ``intact()`` finds the newest checkpoint that passes, with the reasons the newer ones
failed. A checkpoint of a step that already has one replaces it (never reuses its files),
and rotation never removes the checkpoint just written.

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
import builtins
import contextlib
import errno
import json
import os
import re
import shutil
import signal
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from asyncflow_core.contracts.errors import CheckpointError, ConfigError, error_chain

FAILPOINTS_ENV = "ASYNCFLOW_FAILPOINTS"
FAILPOINTS_ONCE_ENV = "ASYNCFLOW_FAILPOINTS_ONCE"
_PREFIX = "step-"
_TMP = ".tmp-"
_NAME = re.compile(r"^step-(\d{8,})$")


MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "asyncflow-checkpoint/1"
TRUST_OPT_IN = "asyncflow run --trust-checkpoints, or Checkpoints(..., trust=True)"
_DAMAGED = ".damaged"


class Checkpoints:
    """Numbered checkpoint folders under ``root`` (``step-NNNNNNNN``), written atomically,
    at most ``keep`` of them kept (the oldest removed after a newer one is complete), each
    with a signed manifest of its files (module docstring). ``extra(folder)``, if given,
    adds files of its own to every checkpoint (run in a worker thread, after the writer's
    files and before the rename), e.g. a run's trace and RNG states. ``identity``: JSON
    values the manifest records (what run wrote it). ``trust``: ``verify`` skips the
    signature (a checkpoint from another machine or user), still checking every file."""

    def __init__(
        self,
        root: str | Path,
        *,
        keep: int = 3,
        extra: Callable[[Path], None] | None = None,
        identity: Mapping[str, Any] | None = None,
        trust: bool = False,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"Checkpoints: keep must be an int >= 1, got {keep!r}")
        self.root = Path(root)
        self.keep = keep
        self.extra = extra
        self.identity = dict(identity or {})
        self.trust = trust

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
        temporary folder, the manifest is added, everything is flushed to disk and the
        folder renamed into place; then the oldest checkpoints beyond ``keep`` are removed
        (never this one). A checkpoint of ``step`` already there is replaced by the new one
        once it is complete. Returns the folder. A write that fails on a full disk raises
        ``DiskFullError`` naming the folder."""
        from asyncflow_core.infra.manifest import checkpoint_key

        key = checkpoint_key(who="Checkpoints", create=True)
        assert key is not None  # create=True makes one
        final = self.path(step)
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
            await asyncio.to_thread(self._sign, tmp, step, key)
            failpoint("checkpoint.write")
            _fsync_tree(tmp)
            if final.exists():  # moved aside (as a leftover the next write removes), then gone
                aside = self.root / f"{_TMP}replaced-{_PREFIX}{step:08d}-{os.getpid()}"
                os.rename(final, aside)
                os.rename(tmp, final)
                shutil.rmtree(aside, ignore_errors=True)
            else:
                os.rename(tmp, final)
            _fsync_dir(self.root)
        except BaseException as exc:
            full = _disk_full(self.root, exc)
            shutil.rmtree(tmp, ignore_errors=True)
            if full is not None:
                raise DiskFullError(
                    f"cannot write the checkpoint of step {step} in {str(self.root)!r}: the "
                    f"disk is full ({full}); free space there (or give the run a folder on "
                    "another disk) and resume from the newest checkpoint"
                ) from exc
            raise
        for _, old in self.list()[: -self.keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def _sign(self, folder: Path, step: int, key: bytes) -> None:
        from asyncflow_core.infra.manifest import sign_manifest

        meta = {"format": MANIFEST_FORMAT, "step": step, "identity": self.identity}
        manifest = sign_manifest(folder, meta, key, manifest=MANIFEST_FILE)
        (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")

    def verify(self, folder: str | Path) -> dict[str, Any]:
        """The manifest's meta (``format``, ``step``, ``identity``) of checkpoint ``folder``
        after checking that it is signed with this user's checkpoint key (unless ``trust``)
        and that the folder holds exactly the files it lists, each of its size and sha256;
        ``CheckpointError`` (``CheckpointRefusedError`` for a signature or file check)
        naming what differs."""
        from asyncflow_core.infra.manifest import read_signed_manifest

        meta = read_signed_manifest(
            Path(folder), manifest=MANIFEST_FILE, who="checkpoints", trust=self.trust,
            opt_in=TRUST_OPT_IN,
            why_signed="A checkpoint's files decide what the run trains next, so AsyncFlow "
            "resumes only",
        )  # fmt: skip
        if meta.get("format") != MANIFEST_FORMAT:
            raise CheckpointError(
                f"checkpoint {str(folder)!r}: its {MANIFEST_FILE} has format "
                f"{meta.get('format')!r}, expected {MANIFEST_FORMAT!r}"
            )
        return meta

    def intact(
        self, check: Callable[[Path, dict[str, Any]], None] | None = None
    ) -> tuple[Path | None, builtins.list[tuple[Path, str]]]:
        """The newest checkpoint that ``verify`` passes (and ``check(folder, meta)``, the
        owner's own reading of it, does not raise ``CheckpointError`` or ``ConfigError``),
        and every newer one that failed, newest first, with why."""
        bad: builtins.list[tuple[Path, str]] = []
        for _, folder in reversed(self.list()):
            try:
                meta = self.verify(folder)
                if check is not None:
                    check(folder, meta)
            except (CheckpointError, ConfigError) as e:
                bad.append((folder, str(e)))
                continue
            return folder, bad
        return None, bad

    def set_aside(self, folder: Path) -> Path:
        """Rename a damaged checkpoint out of the numbered ones (``step-N.damaged``, kept for
        a look; nothing reads it again); returns its new path."""
        target = folder.with_name(folder.name + _DAMAGED)
        n = 1
        while target.exists():
            n += 1
            target = folder.with_name(f"{folder.name}{_DAMAGED}-{n}")
        os.rename(folder, target)
        return target

    def _remove_leftovers(self) -> None:
        for entry in self.root.iterdir():
            if entry.name.startswith(_TMP):
                shutil.rmtree(entry, ignore_errors=True)


class FolderError(OSError):
    """A folder the job must write cannot be written (read-only, not permitted, full): the
    environment, not the input, is at fault. Its message (``str``) names the folder and
    what to do; ``errno`` is the system's."""

    def __str__(self) -> str:
        return str(self.strerror)


class DiskFullError(FolderError):
    """A write that failed because its disk (or quota) is full; the message names the folder."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)


_FULL_BELOW = 1 << 20  # bytes free under which a failed write is put down to a full disk


def _disk_full(folder: Path, exc: BaseException) -> str | None:
    """Why ``exc``, raised while writing into ``folder``, means its disk is full (an
    ``ENOSPC`` / ``EDQUOT`` anywhere in its chain, or torch's writer failing with under 1 MiB
    left there: ``torch.save`` says only "unexpected pos"); None otherwise."""
    for seen in error_chain(exc):
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return seen.strerror or "no space left"
    if not isinstance(exc, Exception):
        return None
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    return f"{free} bytes free" if free < _FULL_BELOW else None


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


__all__ = [
    "FAILPOINTS_ENV",
    "FAILPOINTS_ONCE_ENV",
    "MANIFEST_FILE",
    "Checkpoints",
    "DiskFullError",
    "FolderError",
    "failpoint",
]
