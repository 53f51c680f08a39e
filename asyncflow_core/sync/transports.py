"""WeightSync transports: move weight buckets from a trainer to inference engines, in the
phases of the WeightSync protocol (init -> start -> update(bucket) x N -> finish(version)):
in process, as a bucketed broadcast to inference engines in other processes, over the
engines' own weight groups, or as safetensors files on disk.

Every transport stages a sync's buckets and applies them to its targets only at
``finish(version)``, so a target never holds a mix of two versions. *When* an engine swaps is
the strategy's business (``asyncflow_core.sync.strategies``).

The broadcast: ``DistributedWeightSync`` on the trainer's sending rank,
``DistributedWeightReceiver`` in each inference process, over a ``WeightSyncGroup`` (a process
group of their own, beside the trainer's training world; gloo on CPU, nccl with CUDA, hccl on
Ascend NPUs: the platform's backend, ``asyncflow_core.infra.platform``) or a
torch.distributed group. ``benchmarks/weight_sync.py`` measures it against one flat broadcast.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import json
import math
import operator
import os
import queue
import shutil
import threading
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, TypeGuard, TypeVar, runtime_checkable

import torch

from asyncflow_core.contracts.errors import PlatformError, WeightSyncError
from asyncflow_core.contracts.protocols import (
    SupportsLoadWeights,
    Version,
    WeightBucket,
    WeightSync,
    tensor_load_refusal,
)
from asyncflow_core.infra.platform import (
    current_platform,
    is_loopback_literal,
    platform_for_backend,
    rendezvous_store,
)

Weights = list[tuple[str, torch.Tensor]]
_VERSION_LIMIT = 1 << 63  # versions are int64 wherever they are stored


class _Phases:
    """Enforces init -> (start -> update* -> finish)*, naming the expected phase on misuse."""

    def __init__(self, transport: str) -> None:
        self.transport = transport
        self.state = "new"  # new -> ready <-> open

    def expect(self, phase: str) -> None:
        allowed = {
            "init": ("new",),
            "start": ("ready",),
            "update": ("open",),
            "finish": ("open",),
        }[phase]
        if self.state not in allowed:
            follows = {"new": "init()", "ready": "start()", "open": "update() or finish()"}
            raise WeightSyncError(
                f"{self.transport}: {phase}() called out of order; the next call must be "
                f"{follows[self.state]} (phases: init -> start -> update x N -> finish)"
            )

    def move(self, phase: str) -> None:
        self.state = {"init": "ready", "start": "open", "update": "open", "finish": "ready"}[phase]


def _check_bucket(
    transport: str, bucket: WeightBucket, seen: set[str], *, meta: bool = False
) -> None:
    """Reject a malformed bucket (names that are not strings, values that are not dense
    tensors with values, counts that differ) or a parameter already sent in this sync
    (``seen``, which the caller extends once the bucket is taken: a rejected bucket changes
    nothing)."""
    if not isinstance(bucket, WeightBucket):
        raise WeightSyncError(f"{transport}: update() takes a WeightBucket, got {bucket!r:.80}")
    if not isinstance(bucket.names, tuple | list) or not isinstance(bucket.tensors, tuple | list):
        raise WeightSyncError(
            f"{transport}: a bucket's names and tensors are sequences, got "
            f"{type(bucket.names).__name__} and {type(bucket.tensors).__name__}"
        )
    if len(bucket.names) != len(bucket.tensors):
        raise WeightSyncError(
            f"{transport}: bucket has {len(bucket.names)} names for {len(bucket.tensors)} tensors"
        )
    names: set[str] = set()
    for name in bucket.names:
        if not isinstance(name, str):
            raise WeightSyncError(f"{transport}: parameter name {name!r:.80} is not a str")
        if name in seen or name in names:
            raise WeightSyncError(
                f"{transport}: parameter {name!r} was sent twice in one sync; send each once"
            )
        names.add(name)
    _check_tensors(transport, bucket, meta=meta)


def _check_version(transport: str, version: object) -> None:
    """A sync's version: an int in [0, 2**63) (it travels as int64 in engines and traces)."""
    if not _is_int(version) or not 0 <= version < _VERSION_LIMIT:
        raise WeightSyncError(
            f"{transport}: a sync's version must be an int in [0, 2**63), got {version!r:.80}"
        )


async def load_all(
    targets: Sequence[SupportsLoadWeights], weights: Weights, version: Version
) -> None:
    """Every target loads concurrently (each engine swaps on its own devices)."""
    await asyncio.gather(*(target.load_weights(weights, version) for target in targets))


# --------------------------------------------------------------------------------------------
# In process
# --------------------------------------------------------------------------------------------
class InProcessWeightSync:
    """Copies each bucket into a host-side staging list (the trainer may keep stepping and
    modify its parameters in place meanwhile) and loads the whole set into every target at
    ``finish``."""

    def __init__(self, targets: Sequence[SupportsLoadWeights]) -> None:
        self.targets = list(targets)
        self._phases = _Phases("InProcessWeightSync")
        self._staged: Weights = []
        self._seen: set[str] = set()

    async def init(self) -> None:
        self._phases.expect("init")
        self._phases.move("init")

    async def start(self) -> None:
        self._phases.expect("start")
        self._staged, self._seen = [], set()
        self._phases.move("start")

    async def update(self, bucket: WeightBucket) -> None:
        self._phases.expect("update")
        # meta tensors pass: the simulator's engines sync shapes only, in process
        _check_bucket("InProcessWeightSync", bucket, self._seen, meta=True)
        self._staged += [(n, t.detach().clone()) for n, t in bucket]
        self._seen.update(bucket.names)

    async def finish(self, version: Version) -> None:
        self._phases.expect("finish")
        _check_version("InProcessWeightSync", version)
        weights, self._staged = self._staged, []
        await load_all(self.targets, weights, version)
        self._phases.move("finish")


# --------------------------------------------------------------------------------------------
# Disk (safetensors)
# --------------------------------------------------------------------------------------------
MANIFEST = "manifest.json"
LATEST = "LATEST"


class DiskWeightSync:
    """Writes each sync as ``root/v{version:08d}/bucket-NNNNN.safetensors`` plus a manifest.

    Buckets go to a hidden incoming folder; ``finish`` writes the manifest, renames the folder
    into place (atomic on one file system), points ``root/LATEST`` at it, and loads it into the
    in-process ``targets`` (if any). A reader in another process uses ``read_weights``.
    ``keep`` bounds how many versions stay on disk (oldest removed first).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        targets: Sequence[SupportsLoadWeights] = (),
        keep: int = 2,
    ) -> None:
        if keep < 1:
            raise WeightSyncError(f"DiskWeightSync: keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.targets = list(targets)
        self.keep = keep
        self._phases = _Phases("DiskWeightSync")
        self._incoming: Path | None = None
        self._buckets: list[dict[str, Any]] = []
        self._seen: set[str] = set()

    async def init(self) -> None:
        self._phases.expect("init")
        self.root.mkdir(parents=True, exist_ok=True)
        self._phases.move("init")

    async def start(self) -> None:
        from safetensors.torch import save_file  # noqa: F401  (fail early if missing)

        self._phases.expect("start")
        self._incoming = self.root / f".incoming-{uuid.uuid4().hex}"
        self._incoming.mkdir()
        self._buckets, self._seen = [], set()
        self._phases.move("start")

    async def update(self, bucket: WeightBucket) -> None:
        from safetensors.torch import save_file

        self._phases.expect("update")
        _check_bucket("DiskWeightSync", bucket, self._seen)
        assert self._incoming is not None
        name = f"bucket-{len(self._buckets):05d}.safetensors"
        tensors = {n: t.detach().contiguous().clone() for n, t in bucket}
        save_file(tensors, str(self._incoming / name))
        self._buckets.append({"file": name, "names": list(bucket.names)})
        self._seen.update(bucket.names)

    async def finish(self, version: Version) -> None:
        self._phases.expect("finish")
        _check_version("DiskWeightSync", version)
        assert self._incoming is not None
        manifest = {"version": version, "buckets": self._buckets, "names": sorted(self._seen)}
        (self._incoming / MANIFEST).write_text(json.dumps(manifest))
        final = self.root / f"v{version:08d}"
        if final.exists():
            shutil.rmtree(self._incoming, ignore_errors=True)
            self._incoming = None
            self._phases.move("finish")
            raise WeightSyncError(
                f"DiskWeightSync: {final} already exists; versions must increase between syncs"
            )
        os.replace(self._incoming, final)
        tmp = self.root / f".{LATEST}.{uuid.uuid4().hex}"
        tmp.write_text(final.name)
        os.replace(tmp, self.root / LATEST)
        self._incoming = None
        self._prune()
        if self.targets:
            weights, _ = read_weights(final)
            await load_all(self.targets, weights, version)
        self._phases.move("finish")

    def _prune(self) -> None:
        versions = sorted(p for p in self.root.glob("v*") if (p / MANIFEST).exists())
        for old in versions[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)


def read_weights(path: str | os.PathLike[str]) -> tuple[Weights, Version]:
    """Load a sync written by ``DiskWeightSync``: ``path`` is a version folder, or the root
    (then ``LATEST`` names the folder). Returns the (name, tensor) list and the version.
    A folder that is not such a sync (files missing or garbled, a manifest of another shape,
    names that leave the folder) raises ``WeightSyncError``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    try:
        if (folder / LATEST).exists():
            folder = folder / _plain_name((folder / LATEST).read_text().strip(), LATEST)
        manifest_path = folder / MANIFEST
        if not manifest_path.exists():
            raise WeightSyncError(
                f"no weights at {folder}: {MANIFEST} is missing (point at a version folder or "
                "at the DiskWeightSync root)"
            )
        manifest = json.loads(manifest_path.read_text())
        version, buckets = _parse_manifest(manifest, manifest_path)
        weights: Weights = []
        for file, names in buckets:  # in the order they were sent
            tensors = load_file(str(folder / file))
            missing = [n for n in names if n not in tensors]
            if missing:
                raise WeightSyncError(f"{folder / file} lacks {missing[:3]!r} named by {MANIFEST}")
            weights += [(name, tensors[name]) for name in names]
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, SafetensorError) as exc:
        raise WeightSyncError(f"cannot read the weights at {folder}: {exc}") from exc
    return weights, version


def _plain_name(name: str, what: str) -> str:
    """``name`` if it names an entry of its folder (no separators, not hidden)."""
    if not name or name != Path(name).name or name.startswith("."):
        raise WeightSyncError(f"{what} names {name!r:.80}, not an entry of its folder")
    return name


def _parse_manifest(manifest: object, where: Path) -> tuple[Version, list[tuple[str, list[str]]]]:
    """(version, [(file, names)]) of a ``DiskWeightSync`` manifest, or ``WeightSyncError``."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("buckets"), list):
        raise WeightSyncError(f"{where} is not a weight-sync manifest (no 'buckets' list)")
    version = manifest.get("version")
    if not _is_int(version) or not 0 <= version < _VERSION_LIMIT:
        raise WeightSyncError(f"{where}: version {version!r:.80} is not an int in [0, 2**63)")
    buckets = []
    for bucket in manifest["buckets"]:
        file = bucket.get("file") if isinstance(bucket, dict) else None
        names = bucket.get("names") if isinstance(bucket, dict) else None
        if not isinstance(file, str) or not isinstance(names, list):
            raise WeightSyncError(f"{where}: bucket {bucket!r:.80} needs a 'file' and 'names'")
        if not all(isinstance(n, str) for n in names):
            raise WeightSyncError(f"{where}: bucket {file!r:.80} has names that are not str")
        buckets.append((_plain_name(file, str(where)), names))
    return version, buckets


# --------------------------------------------------------------------------------------------
# torch.distributed: bucketed broadcast
# --------------------------------------------------------------------------------------------
def default_backend() -> str:
    """The collective backend of this process's platform (``asyncflow_core.infra.platform``): gloo
    on CPU, nccl with CUDA, hccl on Ascend NPUs."""
    return current_platform().dist_backend


_ALIGN = 64  # byte alignment of each tensor in a packed bucket, so the receiver views it in place
_HEADER_SLOT = 4096  # a header is one broadcast of this many bytes (length + JSON; a longer
_MAX_HEADER_BYTES = 1 << 30  # one takes a second); a length beyond this is a corrupt stream
_NO_LIMIT_S = 10 * 365 * 24 * 3600.0  # "wait without limit" for backends that need a timeout


@runtime_checkable
class BroadcastGroup(Protocol):
    """What ``DistributedWeightSync`` and ``DistributedWeightReceiver`` need from a process group
    of their own (``WeightSyncGroup`` is the one this module provides): this process's ``rank``
    in it, its ``world_size``, the ``device`` its collectives use, an idempotent blocking
    ``connect()``, and a blocking ``broadcast(tensor, src, timeout_s=None)`` that returns once
    ``tensor`` holds rank ``src``'s bytes (``timeout_s`` None: the group's own timeout)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    def connect(self) -> None: ...

    def broadcast(
        self, tensor: torch.Tensor, src: int, *, timeout_s: float | None = None
    ) -> None: ...


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


class WeightSyncGroup:
    """A process group for weight sync only: the trainer's sending rank (rank 0) and the
    inference workers (ranks ``1 .. world_size - 1``), independent of torch.distributed's
    default group — the trainer's training world (DeepSpeed's ranks, say) keeps its own, and
    no process needs ``init_process_group`` for this one (vLLM calls the same idea a stateless
    process group).

    ``WeightSyncGroup(host, port, rank, world_size, *, backend=None, timeout_s=300.0)``:
    ``connect()`` (blocking; idempotent) has rank 0 host a ``torch.distributed.TCPStore`` at
    ``host:port`` — the address every other rank connects to — and builds the backend's
    process group directly on it: the platform whose backend it is builds it
    (``asyncflow_core.infra.platform``: ``ProcessGroupGloo`` for gloo, ``ProcessGroupNCCL`` for
    nccl, torch_npu's ``ProcessGroupHCCL`` for hccl; ``backend`` None picks
    ``default_backend()``, the current platform's). A backend whose platform cannot run here
    is refused at construction. Every rank must call ``connect()`` within ``timeout_s``
    of the others, or each raises ``WeightSyncError`` naming ``host:port`` and what to check;
    a failed ``connect()`` leaves the group unconnected (call it again, or build a new one).

    ``broadcast(tensor, src, timeout_s=None)`` blocks until ``tensor`` holds rank ``src``'s
    bytes (on an accelerator it also waits for the device), or raises ``WeightSyncError``
    when a peer died or the call took longer than ``timeout_s`` (default: the group's); after
    such an error the group is unusable: ``close()`` it and build a new one on every rank. Tensors
    must be on ``device`` (cpu for gloo, else the platform's current device). ``close()``
    releases the group (final; safe to repeat); the group is also a context manager.

    **Exposure.** ``host`` is required: there is no default address. Rank 0's store listens on
    ``host`` only (``platform.rendezvous_store``; torch's own ``TCPStore`` would listen on
    every interface) and a gloo group on the interface toward ``host``: with ``127.0.0.1``
    nothing of the group can be reached from another machine. NCCL (and HCCL) choose their
    own interface once per process: set ``NCCL_SOCKET_IFNAME=lo`` in processes whose groups
    are all on one machine, or NCCL's bootstrap listens on the first outward interface. A
    ``host`` other machines reach opens the store's port and gloo's (or NCCL's) ports to
    anyone who can reach that address, and none of them authenticates a peer (torch's store
    and gloo have no shared secret): whoever connects first may take a rank, or send a
    receiver bytes it will parse (JSON headers, checked field by field; nothing is
    unpickled). Use such an address only on a network limited to the group's hosts.
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        *,
        backend: str | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        who = "WeightSyncGroup"
        if not isinstance(host, str) or not host:
            raise WeightSyncError(f"{who}: host must be a non-empty address, got {host!r}")
        if not _is_int(port) or not 1 <= port <= 65_535:
            raise WeightSyncError(f"{who}: port must be an int in [1, 65535], got {port!r}")
        if not _is_int(world_size) or world_size < 2:
            raise WeightSyncError(
                f"{who}: world_size must be an int >= 2 (the sender and at least one "
                f"receiver), got {world_size!r}"
            )
        if not _is_int(rank) or not 0 <= rank < world_size:
            raise WeightSyncError(
                f"{who}: rank must be an int in [0, {world_size - 1}] (0 is the trainer's "
                f"sender), got {rank!r}"
            )
        if not isinstance(timeout_s, int | float) or not 0 < timeout_s < math.inf:
            raise WeightSyncError(f"{who}: timeout_s must be a number > 0, got {timeout_s!r}")
        backend = default_backend() if backend is None else backend
        if not isinstance(backend, str) or not backend:
            raise WeightSyncError(
                f"{who}: backend must be a collective backend name such as 'gloo', 'nccl' or "
                f"'hccl' (or None for default_backend()), got {backend!r}"
            )
        try:
            platform = platform_for_backend(backend)
        except PlatformError as exc:
            raise WeightSyncError(
                f"{who}: backend {backend!r} cannot run here: {exc}. Use 'gloo' (or "
                "backend=None: the platform's) on this machine"
            ) from exc
        self.host, self.port, self.backend = host, int(port), backend
        self.platform = platform
        self.timeout_s = float(timeout_s)
        self._rank, self._world_size = int(rank), int(world_size)
        self._device = platform.device()
        self._store: Any = None
        self._pg: Any = None
        self._closed = False

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def connected(self) -> bool:
        return self._pg is not None

    def _where(self) -> str:
        return f"WeightSyncGroup {self.host}:{self.port} (rank {self._rank} of {self._world_size})"

    def connect(self) -> None:
        """Rendezvous with every other rank (blocking); see the class docstring."""
        from datetime import timedelta

        if self._closed:
            raise WeightSyncError(f"{self._where()} is closed; build a new one")
        if self._pg is not None:
            return
        timeout = timedelta(seconds=self.timeout_s)
        store = None
        try:
            store = rendezvous_store(
                self.host,
                self.port,
                self._world_size,
                is_master=self._rank == 0,
                timeout=timeout,
            )
            pg = self._make_backend(store, timeout)
        except (RuntimeError, OSError) as exc:  # bind, DistStoreError, gloo/nccl errors
            del store
            role = (
                f"rank 0 hosts the rendezvous on {self.host}:{self.port}; check that this "
                "port is free and that"
                if self._rank == 0
                else f"check that rank 0 (the trainer's sender) listens on {self.host}:"
                f"{self.port}, that this address is reachable from here, and that"
            )
            raise WeightSyncError(
                f"{self._where()}: no rendezvous within {self.timeout_s:g} s ({exc}); {role} "
                f"all {self._world_size} ranks build a WeightSyncGroup with the same host, "
                "port and world_size, each with its own rank, and call connect()"
            ) from exc
        self._store, self._pg = store, pg

    def _make_backend(self, store: Any, timeout: Any) -> Any:
        return self.platform.new_process_group(store, self._rank, self._world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout_s: float | None = None) -> None:
        """Rank ``src``'s ``tensor`` into every rank's ``tensor`` (blocking); see the class."""
        self.broadcast_start(tensor, src, timeout_s=timeout_s)()

    def broadcast_start(
        self, tensor: torch.Tensor, src: int, *, timeout_s: float | None = None
    ) -> Callable[[], None]:
        """Start ``broadcast`` and return at once; calling the returned function blocks until
        it is done (raising as ``broadcast`` does). Every rank must start its broadcasts in the
        same order; two started ones may be on the wire at once (gloo runs two at a time), so
        a small header can travel while a bucket's bytes do. ``tensor`` must not be touched
        until the wait returns."""
        from datetime import timedelta

        from torch.distributed import BroadcastOptions

        if self._pg is None:
            state = "closed; build a new one" if self._closed else "not connected; call connect()"
            raise WeightSyncError(f"{self._where()} is {state} before broadcast()")
        if not _is_int(src) or not 0 <= src < self._world_size:
            raise WeightSyncError(
                f"{self._where()}: src must be a rank in [0, {self._world_size - 1}], got {src!r}"
            )
        if tensor.device != self._device:
            raise WeightSyncError(
                f"{self._where()}: broadcast tensors must be on {self._device}, got one on "
                f"{tensor.device}"
            )
        limit = self.timeout_s if timeout_s is None else timeout_s
        opts = BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = timedelta(seconds=limit)

        def failed(exc: RuntimeError) -> WeightSyncError:
            return WeightSyncError(
                f"{self._where()}: broadcast from rank {src} failed ({exc}); a peer process "
                f"may have died, or the call outlasted its {limit:g} s timeout; close this "
                "group and build a new one on every rank"
            )

        try:
            work = self._pg.broadcast([tensor], opts)
        except RuntimeError as exc:
            raise failed(exc) from exc

        def wait() -> None:
            try:
                work.wait()
                self.platform.synchronize(self._device)
            except RuntimeError as exc:
                raise failed(exc) from exc

        return wait

    def close(self) -> None:
        """Release the group (final; safe to repeat)."""
        self._closed = True
        pg, self._pg, self._store = self._pg, None, None
        if pg is not None:
            with contextlib.suppress(RuntimeError):
                pg.shutdown()

    def __enter__(self) -> WeightSyncGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "connected" if self.connected else "closed" if self._closed else "unconnected"
        return (
            f"WeightSyncGroup({self.host!r}, {self.port}, rank={self._rank}, "
            f"world_size={self._world_size}, backend={self.backend!r}, {state})"
        )


_T = TypeVar("_T")


class _SerialThread:
    """Runs blocking calls one at a time, in submission order, on one daemon thread: every rank
    must issue its collectives in the same order, the event loop stays free meanwhile, and a
    thread stuck in a collective whose peer never comes cannot hold up interpreter exit."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[
            tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None
        ] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[..., _T], *args: Any) -> concurrent.futures.Future[_T]:
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
            self._thread.start()
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        self._queue.put((functools.partial(fn, *args), future))
        return future

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.wrap_future(self.submit(fn, *args))

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread = None

    def _main(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as exc:  # handed to the awaiting side
                future.set_exception(exc)
            else:
                future.set_result(result)


def _dtype(name: object) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(
            f"unknown dtype {name!r} in a weight-sync header; sender and receiver must run "
            "compatible torch versions"
        )
    return dtype


def _layout(
    dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]
) -> tuple[list[int], int]:
    """Where each tensor starts in a bucket's packed buffer (aligned, so that the receiver can
    view every tensor in place) and the buffer's size: the one layout both sides compute."""
    offsets: list[int] = []
    end = 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        start = -(-end // _ALIGN) * _ALIGN
        offsets.append(start)
        end = start + math.prod(shape) * dtype.itemsize
    return offsets, end


def _region(
    buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: Sequence[int]
) -> torch.Tensor:
    """The bytes ``buffer[offset:]`` seen as a tensor of ``dtype`` and ``shape`` (no copy)."""
    nbytes = math.prod(shape) * dtype.itemsize
    return buffer[offset : offset + nbytes].view(dtype).view(list(shape))


def _views(
    buffer: torch.Tensor, entries: Sequence[tuple[str, torch.dtype, list[int], int]]
) -> Weights:
    """A parsed bucket header's (name, dtype, shape, offset) entries as views of the bucket's
    ``buffer`` (which starts at its storage's first byte): one typed view of the buffer per
    dtype, then one strided view per tensor (a slice and two views, as ``_region`` makes,
    took about three times as long)."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    views: Weights = []
    for name, dtype, shape, offset in entries:
        try:
            whole = typed.get(dtype)
            if whole is None:
                whole = buffer[: buffer.numel() // dtype.itemsize * dtype.itemsize].view(dtype)
                typed[dtype] = whole
            # contiguous strides: the product of the later dimensions (none for a scalar)
            strides = list(itertools.accumulate(reversed(shape[1:]), operator.mul, initial=1))
            start = whole.storage_offset() + offset // dtype.itemsize
            views.append((name, whole.as_strided(shape, strides[::-1] if shape else [], start)))
        except (RuntimeError, TypeError, ValueError) as exc:
            raise WeightSyncError(
                f"weight-sync receiver cannot view parameter {name!r} as {dtype} ({exc}); send "
                "plain (dequantized) tensors"
            ) from exc
    return views


def _pack_into(
    buffer: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int]
) -> torch.Tensor:
    """Copy ``tensors`` into ``buffer`` at ``offsets`` (zeroing the alignment gaps, so the bytes
    on the wire are deterministic); returns ``buffer``."""
    end = 0
    with torch.no_grad():
        for tensor, offset in zip(tensors, offsets, strict=True):
            if offset > end:
                buffer[end:offset].zero_()
            _region(buffer, offset, tensor.dtype, tensor.shape).copy_(tensor.detach())
            end = offset + tensor.numel() * tensor.element_size()
    return buffer


def _wire_view(
    tensors: Sequence[torch.Tensor], offsets: Sequence[int], nbytes: int, device: torch.device
) -> torch.Tensor | None:
    """A bucket's bytes as one uint8 view of its own memory when its tensors already lie at
    the wire layout in one storage on ``device`` (``bucketize(..., pack=True)`` buckets, or one
    contiguous tensor); None when they must be packed."""
    if not tensors:
        return None
    storage = tensors[0].untyped_storage()
    base = int(tensors[0].storage_offset()) * tensors[0].element_size()
    if base + nbytes > storage.nbytes():
        return None
    # every tensor with bytes at its offset from the first one's address, densely laid out:
    # the bytes [base, base + nbytes) of the first one's storage are then exactly the wire's
    # (an empty tensor has no bytes, and its address may be null)
    start = storage.data_ptr() + base
    for tensor, offset in zip(tensors, offsets, strict=True):
        if tensor.device != device or (
            tensor.numel() and (tensor.data_ptr() != start + offset or not tensor.is_contiguous())
        ):
            return None
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, base, (nbytes,), (1,))


def _check_tensors(who: str, bucket: WeightBucket, *, meta: bool = False) -> None:
    """Every tensor dense, with values (``meta``: or a meta tensor, a shape without values,
    which only an in-process target can take)."""
    for name, tensor in zip(bucket.names, bucket.tensors, strict=True):
        if not isinstance(tensor, torch.Tensor):
            raise WeightSyncError(
                f"{who}: parameter {name!r} is a {type(tensor).__name__}, not a tensor"
            )
        if (
            tensor.layout != torch.strided
            or tensor.is_quantized
            or (tensor.device.type == "meta" and not meta)
        ):
            raise WeightSyncError(
                f"{who}: parameter {name!r} must be a dense tensor with values (got layout "
                f"{tensor.layout}, dtype {tensor.dtype}, device {tensor.device}); send full "
                "(gathered, dequantized) tensors"
            )


class _Channel:
    """Blocking broadcasts over one group, called from a transport's own thread: headers as
    JSON bytes (no pickle between processes), then payloads."""

    def __init__(self, src: int, group: Any, device: torch.device) -> None:
        self.src, self.group, self.device = src, group, device

    def broadcast(self, tensor: torch.Tensor, timeout_s: float | None = None) -> None:
        if isinstance(self.group, BroadcastGroup):
            self.group.broadcast(tensor, self.src, timeout_s=timeout_s)
        else:
            import torch.distributed as dist

            dist.broadcast(tensor, self.src, group=self.group)

    def start(self, tensor: torch.Tensor) -> Callable[[], None]:
        """Start a broadcast of ``tensor``; the returned function waits for it. Overlaps with
        the next broadcast where the group can (a ``WeightSyncGroup``, a torch.distributed
        group); another ``BroadcastGroup`` broadcasts here and now, in order all the same."""
        start = getattr(self.group, "broadcast_start", None)
        if isinstance(self.group, BroadcastGroup):
            if callable(start):
                started: Callable[[], None] = start(tensor, self.src)
                return started
            self.group.broadcast(tensor, self.src)
            return _nothing
        import torch.distributed as dist

        work = dist.broadcast(tensor, self.src, group=self.group, async_op=True)

        def wait() -> None:
            if work is not None:
                work.wait()

        return wait

    def send_header(self, header: dict[str, Any]) -> None:
        self.header_send_start(header)()

    def header_send_start(self, header: dict[str, Any]) -> Callable[[], None]:
        """Start sending ``header`` (one slot; a long one's rest in a second broadcast); the
        returned function waits until it is sent."""
        data = json.dumps(header).encode()
        framed = len(data).to_bytes(8, "little") + data
        slot = framed[:_HEADER_SLOT].ljust(_HEADER_SLOT, b"\0")
        waits = [self.start(torch.frombuffer(bytearray(slot), dtype=torch.uint8).to(self.device))]
        if len(framed) > _HEADER_SLOT:
            rest = bytearray(framed[_HEADER_SLOT:])
            waits.append(self.start(torch.frombuffer(rest, dtype=torch.uint8).to(self.device)))

        def wait() -> None:
            for each in waits:
                each()

        return wait

    def recv_header(self, timeout_s: float | None = None) -> dict[str, Any]:
        slot = torch.empty(_HEADER_SLOT, dtype=torch.uint8, device=self.device)
        self.broadcast(slot, timeout_s)
        return self._read_header(slot)

    def header_start(self) -> Callable[[], dict[str, Any]]:
        """Start receiving the next header (behind any broadcast started before it); the
        returned function waits for it and returns it checked, as ``recv_header`` does."""
        slot = torch.empty(_HEADER_SLOT, dtype=torch.uint8, device=self.device)
        wait = self.start(slot)

        def header() -> dict[str, Any]:
            wait()
            return self._read_header(slot)

        return header

    def _read_header(self, slot: torch.Tensor) -> dict[str, Any]:
        """The header whose first ``_HEADER_SLOT`` bytes arrived in ``slot`` (the rest of a long
        one is received here)."""
        framed = bytes(slot.cpu().numpy())
        nbytes = int.from_bytes(framed[:8], "little")
        if not 0 < nbytes <= _MAX_HEADER_BYTES:
            raise WeightSyncError(
                f"weight-sync receiver got a header size of {nbytes} bytes: the stream is out "
                "of step (is another sender using this group?)"
            )
        if 8 + nbytes > _HEADER_SLOT:
            rest = torch.empty(8 + nbytes - _HEADER_SLOT, dtype=torch.uint8, device=self.device)
            self.broadcast(rest)
            framed += bytes(rest.cpu().numpy())
        try:
            header = json.loads(framed[8 : 8 + nbytes].decode())
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # nested too deep
            raise WeightSyncError(
                f"weight-sync receiver got a header that is not JSON ({exc})"
            ) from exc
        if (
            not isinstance(header, dict)
            or not isinstance(header.get("op"), str)
            or (header["op"] not in _OPS)
        ):
            raise WeightSyncError(
                f"weight-sync receiver got {header!r:.120} as a header; expected an object "
                f"with 'op' in {sorted(_OPS)}"
            )
        return header


_OPS = frozenset({"start", "bucket", "finish", "close"})


def _nothing() -> None:
    return None


def _parse_bucket(
    header: dict[str, Any], seen: set[str]
) -> list[tuple[str, torch.dtype, list[int], int]]:
    """Check a bucket header; returns (name, dtype, shape, offset) per tensor. Raises
    ``WeightSyncError`` naming the bad field."""
    names, dtype_names, shapes = header.get("names"), header.get("dtypes"), header.get("shapes")
    if not (isinstance(names, list) and isinstance(dtype_names, list) and isinstance(shapes, list)):
        raise WeightSyncError(
            "weight-sync bucket header needs the lists 'names', 'dtypes' and 'shapes', got "
            f"{header!r:.160}"
        )
    if not len(names) == len(dtype_names) == len(shapes):
        raise WeightSyncError(
            f"weight-sync bucket header has {len(names)} names, {len(dtype_names)} dtypes and "
            f"{len(shapes)} shapes; they must match"
        )
    dtypes = [_dtype(d) for d in dtype_names]
    for name, shape in zip(names, shapes, strict=True):
        if not isinstance(name, str):
            raise WeightSyncError(f"weight-sync bucket header: name {name!r:.80} is not a string")
        if name in seen:
            raise WeightSyncError(f"weight-sync receiver got parameter {name!r} twice in one sync")
        seen.add(name)
        if not isinstance(shape, list) or not all(
            _is_int(d) and 0 <= d < _VERSION_LIMIT for d in shape
        ):
            raise WeightSyncError(
                f"weight-sync bucket header: shape {shape!r:.80} of {name!r:.80} is not a list "
                "of ints in [0, 2**63)"
            )
    offsets, nbytes = _layout(dtypes, shapes)
    if nbytes >= _VERSION_LIMIT:
        raise WeightSyncError(
            f"weight-sync bucket header describes {nbytes} bytes, more than any buffer can "
            "hold: the stream is corrupt"
        )
    if not _is_int(header.get("nbytes")) or header["nbytes"] != nbytes:
        raise WeightSyncError(
            f"weight-sync bucket header says {header.get('nbytes')!r} bytes, its tensors take "
            f"{nbytes}; sender and receiver disagree on the layout"
        )
    return list(zip(names, dtypes, shapes, offsets, strict=True))


class DistributedWeightSync:
    """The sender of a bucketed broadcast: the trainer's rank ``src`` of a group that also
    holds the receivers (``DistributedWeightReceiver`` in the inference processes).

    ``group``: a ``WeightSyncGroup`` (or any ``BroadcastGroup``; ``src`` is then the sender's
    rank in it, normally 0) — the usual choice, independent of the trainer's training world;
    or None for torch.distributed's default group, or a ``torch.distributed`` group (``src``
    then a global rank; the caller runs ``init_process_group`` in every process, with
    ``default_backend()``). ``device``: where packed buckets live (None: the group's device,
    or cpu for torch.distributed groups). ``init()`` connects a ``WeightSyncGroup`` and
    checks that this process is rank ``src``.

    **Wire.** Per bucket a header (names, dtypes, shapes, byte count: JSON in one fixed-size
    broadcast, no pickle) and one broadcast of the bucket's bytes — its tensors at 64-byte-
    aligned offsets, so that receivers view them in place — then a ``finish`` header with the
    version. The first bucket's header is the sync's ``start`` (a sync of no buckets sends a
    bare one). Each bucket's bytes stay on the wire while the next header travels: both sides
    start the broadcasts in the same order, and a ``WeightSyncGroup`` (gloo runs two at a
    time) or a torch.distributed group lets them overlap; another ``BroadcastGroup`` runs them
    one after the other. The sender queues a bucket's header and bytes together before it
    waits on either, so one bucket's bytes follow the previous one's without a turn of its
    thread; the receiver queues the next header behind a bucket's bytes and makes the
    bucket's views while they come, so between a header's arrival and the next receive it
    only checks that header. The collectives run on the sender's own thread; the event loop
    stays free.

    **Copies.** A bucket whose tensors already lie at that layout in one buffer on ``device``
    (``bucketize(..., pack=True)``, or a bucket of one contiguous tensor) is sent from its own
    memory: ``update`` returns once it is sent, or at once for a ``snapshot`` bucket (what
    ``bucketize(..., pack=True)`` makes; nobody changes it), which is then sent while the
    next bucket is handed over. Any other bucket is packed into one of two pack buffers kept
    across syncs, concurrently with the previous bucket's broadcast, and ``update`` returns
    once its bytes are copied: the caller may change its tensors then. ``finish`` returns
    once every byte was sent.

    **Cost** (``benchmarks/weight_sync.py``: 2 processes on the 2-core dev box, gloo over
    loopback, a 208 MiB model in 64 MiB buckets, against one flat broadcast of the same bytes):
    see the README's weight-sync section for the measured ratio, and the benchmark's
    ``wire_raw`` for the same broadcasts without this transport's Python. Each broadcast costs
    a fraction of a millisecond besides its bytes; with the start folded into the first header
    and each header overlapping the previous bucket's bytes, a sync exposes about one header
    more than the flat broadcast, plus the receiver's check of each header.

    A failed collective leaves the transport unusable (every later call raises that error):
    close the group and rebuild it. ``close()`` tells the receivers to stop (their ``serve``
    returns) and stops the sender's threads.
    """

    def __init__(
        self, src: int = 0, group: Any = None, device: str | torch.device | None = None
    ) -> None:
        self.src = src
        self.group = group
        default = group.device if isinstance(group, BroadcastGroup) else "cpu"
        self.device = torch.device(default if device is None else device)
        self._phases = _Phases("DistributedWeightSync")
        self._seen: set[str] = set()
        self._channel = _Channel(src, group, self.device)
        self._comm = _SerialThread("weightsync-send")
        self._packer = _SerialThread("weightsync-pack")
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._buffer_busy: list[concurrent.futures.Future[None] | None] = [None, None]
        self._next_buffer = 0
        self._on_wire = False  # this sync's start has gone out
        # sends and bucket-sent futures not yet awaited (the event loop's side)
        self._sends: list[concurrent.futures.Future[None]] = []
        # the sending thread's side: the bucket bytes on the wire now, and their future
        self._on_wire_now: tuple[Callable[[], None], concurrent.futures.Future[None]] | None = None
        self._failed: BaseException | None = None
        self._closed = False

    async def init(self) -> None:
        self._usable()
        self._phases.expect("init")
        if isinstance(self.group, BroadcastGroup):
            await self._comm.run(self.group.connect)
            if self.group.rank != self.src:
                raise WeightSyncError(
                    f"DistributedWeightSync runs on the sending rank {self.src} of {self.group!r}"
                    "; receivers use DistributedWeightReceiver"
                )
        else:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise WeightSyncError(
                    "DistributedWeightSync: torch.distributed is not initialised; pass a "
                    "WeightSyncGroup as group, or call init_process_group(backend="
                    "default_backend(), ...) in every process first"
                )
            if dist.get_rank() != self.src:
                raise WeightSyncError(
                    f"DistributedWeightSync runs on the sending rank {self.src}, not on rank "
                    f"{dist.get_rank()}; receivers use DistributedWeightReceiver"
                )
        self._phases.move("init")

    async def start(self) -> None:
        self._usable()
        self._phases.expect("start")
        # nothing on the wire yet: the start travels in the first bucket's header
        self._on_wire = False
        self._seen = set()
        self._phases.move("start")

    async def update(self, bucket: WeightBucket) -> None:
        self._usable()
        self._phases.expect("update")
        _check_bucket("DistributedWeightSync", bucket, self._seen)
        self._raise_failed_send()
        tensors = bucket.tensors
        offsets, nbytes = _layout([t.dtype for t in tensors], [t.shape for t in tensors])
        header = {
            "op": "bucket" if self._on_wire else "start",
            "names": list(bucket.names),
            "dtypes": [str(t.dtype) for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "nbytes": nbytes,
        }
        sent: concurrent.futures.Future[None] = concurrent.futures.Future()
        in_place = _wire_view(tensors, offsets, nbytes, self.device)
        if in_place is None:
            index = self._next_buffer
            self._next_buffer ^= 1
            busy, self._buffer_busy[index] = self._buffer_busy[index], sent
            if busy is not None:  # the bucket two back still on the wire from this buffer
                await self._failing_on(asyncio.wrap_future(busy))
            buffer = self._pack_buffer(index, nbytes)
            payload = await self._packer.run(_pack_into, buffer, tensors, offsets)
        else:
            payload = in_place
        # the caller's own memory must be sent before update() returns; a snapshot may go on
        # the wire while the next bucket's header does
        wait_now = in_place is not None and not bucket.snapshot
        self._on_wire = True
        self._seen.update(bucket.names)
        self._sends.append(self._comm.submit(self._send_bucket, header, payload, sent, wait_now))
        self._sends.append(sent)
        if wait_now:
            await self._failing_on(asyncio.wrap_future(sent))

    async def finish(self, version: Version) -> None:
        self._usable()
        self._phases.expect("finish")
        _check_version("DistributedWeightSync", version)
        first = None if self._on_wire else {"op": "start"}  # a sync of no buckets
        await self._comm_call(self._send_finish, first, {"op": "finish", "version": version})
        await self._drain()
        self._phases.move("finish")

    async def close(self) -> None:
        """Tell the receivers to stop their ``serve`` loops (a sync still open is dropped on
        their side, nothing loaded), then stop the sender's threads. Final; safe to repeat.
        The group stays open: its owner closes it."""
        if self._closed:
            return
        try:
            if self._failed is None and self._phases.state != "new":
                await self._comm_call(self._send_finish, None, {"op": "close"})
                await self._drain()
        finally:
            self._closed = True
            self._comm.close()
            self._packer.close()
            self._buffers = [None, None]

    # ---- internals ---------------------------------------------------------------------------
    def _usable(self) -> None:
        if self._closed:
            raise WeightSyncError("DistributedWeightSync is closed; build a new one")
        if self._failed is not None:
            raise WeightSyncError(
                f"DistributedWeightSync: an earlier transfer failed ({self._failed}); close the "
                "group and build a new one on every rank"
            ) from self._failed

    def _raise_failed_send(self) -> None:
        """A send that already failed makes this transport unusable now, not at ``finish``."""
        for future in self._sends:
            if future.done() and future.exception() is not None:
                self._failed = future.exception()
                self._usable()

    def _pack_buffer(self, index: int, nbytes: int) -> torch.Tensor:
        """Pack buffer ``index`` (two, used alternately: the other may still be on the wire),
        grown when too small."""
        buffer = self._buffers[index]
        if buffer is None or buffer.numel() < nbytes:
            self._buffers[index] = None  # let the old one go before the bigger one is made
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._buffers[index] = buffer
        return buffer[:nbytes]

    # on the sending thread: one sync's broadcasts in order, each bucket's bytes overlapping
    # the next header (the receiver posts them in the same order)
    def _send_bucket(
        self,
        header: dict[str, Any],
        payload: torch.Tensor,
        sent: concurrent.futures.Future[None],
        wait_now: bool,
    ) -> None:
        try:
            # the header and the bytes are both queued before anything is awaited: the bytes
            # follow the header (and the previous bucket's bytes) without a wake-up of this
            # thread in between
            header_sent = self._channel.header_send_start(header)
            wait = self._channel.start(payload) if payload.numel() else _nothing
            header_sent()
        except BaseException as exc:
            self._end_on_wire(exc)
            sent.set_exception(exc)
            raise
        self._end_on_wire()
        self._on_wire_now = (wait, sent)
        if wait_now:
            self._end_on_wire()

    def _send_finish(self, first: dict[str, Any] | None, header: dict[str, Any]) -> None:
        try:
            if first is not None:
                self._channel.send_header(first)
            self._channel.send_header(header)
        except BaseException as exc:
            self._end_on_wire(exc)
            raise
        self._end_on_wire()

    def _end_on_wire(self, error: BaseException | None = None) -> None:
        """Wait for the bucket bytes on the wire (if any) and settle their future."""
        pending, self._on_wire_now = self._on_wire_now, None
        if pending is None:
            return
        wait, sent = pending
        if error is not None:
            sent.set_exception(error)
            return
        try:
            wait()
        except BaseException as exc:
            sent.set_exception(exc)
            raise
        sent.set_result(None)

    async def _drain(self) -> None:
        sends, self._sends = self._sends, []
        for future in sends:
            if future.done() and future.exception() is None:
                continue  # settled: no trip through the event loop to learn it
            await self._failing_on(asyncio.wrap_future(future))

    async def _comm_call(self, fn: Callable[..., None], *args: Any) -> None:
        await self._failing_on(self._comm.run(fn, *args))

    async def _failing_on(self, call: Awaitable[None]) -> None:
        try:
            await call
        except WeightSyncError as exc:
            self._failed = exc
            raise


class DistributedWeightReceiver:
    """The receiving side in an inference process: ``serve()`` takes syncs until the sender
    closes; ``receive_one()`` takes one. Each sync's buckets are received, in order, on the
    receiver's own thread (the event loop — and the engine's generation — go on meanwhile),
    one buffer per bucket, and handed to ``target.load_weights(weights, version)`` at finish
    as views of those buffers (no copy), then ``on_version(version)`` is called if given.

    ``group``, ``src`` and ``device`` as for ``DistributedWeightSync`` (``src``: the sender's
    rank). ``on_start``: an async callable awaited when a sync starts, before its buckets are
    received (e.g. pause the engine for a blocking update). ``idle_timeout_s``: how long
    ``receive_one`` waits for a sync to start (None: no limit; a sender that dies still ends
    the wait at once, with ``WeightSyncError``); needs a ``BroadcastGroup`` (torch.distributed
    groups wait as ``init_process_group(timeout=...)`` says). Inside a sync, the group's own
    timeout applies.

    ``reuse_buffers``: False (default) receives every sync into fresh buffers, which the
    target may keep (``HostBuffer`` does). True receives every sync into the buffers of the
    previous one (bucket ``i`` into buffer ``i``, replaced when too small): only for a target
    that is done with the tensors when its ``load_weights`` returns (it copies them, as
    ``TorchInferenceEngine`` does). Fresh memory costs page faults: on the dev box, fresh
    buffers took a sync from ~0.9x the bandwidth of one flat broadcast to ~0.7x with 32 MiB
    buckets and 0.2-0.45x with 64 MiB ones (glibc maps blocks over 32 MiB anew every time).

    A sender that closes mid-sync ends ``serve`` with nothing of that sync loaded. A header
    that does not parse, a failed collective or a receive cancelled midway raises (or
    propagates) and leaves the receiver unusable (the stream is out of step): rebuild the
    group. A failed first connect changes nothing (call again).
    """

    def __init__(
        self,
        target: SupportsLoadWeights,
        src: int = 0,
        group: Any = None,
        device: str | torch.device | None = None,
        on_version: Callable[[Version], None] | None = None,
        *,
        on_start: Callable[[], Awaitable[None]] | None = None,
        idle_timeout_s: float | None = None,
        reuse_buffers: bool = False,
    ) -> None:
        if idle_timeout_s is not None:
            if not isinstance(group, BroadcastGroup):
                raise WeightSyncError(
                    "DistributedWeightReceiver: idle_timeout_s needs a WeightSyncGroup (or "
                    "another BroadcastGroup) as group"
                )
            if not isinstance(idle_timeout_s, int | float) or not idle_timeout_s > 0:
                raise WeightSyncError(
                    f"DistributedWeightReceiver: idle_timeout_s must be a number > 0 or None, "
                    f"got {idle_timeout_s!r}"
                )
        self.target = target
        self.src = src
        self.group = group
        default = group.device if isinstance(group, BroadcastGroup) else "cpu"
        self.device = torch.device(default if device is None else device)
        self.on_version = on_version
        self.on_start = on_start
        self.idle_timeout_s = idle_timeout_s
        self._channel = _Channel(src, group, self.device)
        self._comm = _SerialThread("weightsync-recv")
        self.reuse_buffers = bool(reuse_buffers)
        self._buffers: list[torch.Tensor] = []  # by bucket index, with reuse_buffers
        self._failed: BaseException | None = None
        self._ready = False

    async def receive_one(self) -> Version | None:
        """Receive one whole sync and load it; None when the sender closed instead."""
        if self._failed is not None:
            raise WeightSyncError(
                f"DistributedWeightReceiver: an earlier receive failed or was cancelled "
                f"({self._failed!r}); the stream is out of step: rebuild the group"
            ) from self._failed
        if not self._ready:
            await self._comm.run(self._connect)
            self._ready = True
        try:
            if self.on_start is None:  # the whole sync in one call on the receiving thread
                received = await self._comm.run(self._wait_and_receive)
            else:
                header = await self._comm.run(self._wait_for_sync)
                if header["op"] == "close":
                    return None
                await self.on_start()
                received = await self._comm.run(self._receive_sync, header)
        except BaseException as exc:
            self._failed = exc
            raise
        if received is None:
            return None
        weights, version = received
        await self.target.load_weights(weights, version)
        if self.on_version is not None:
            self.on_version(version)
        return version

    async def serve(self) -> list[Version]:
        """Receive syncs until the sender closes; returns the versions loaded."""
        versions = []
        while (version := await self.receive_one()) is not None:
            versions.append(version)
        return versions

    def close(self) -> None:
        """Stop the receiver's thread (after the call in progress). The group's owner closes
        the group."""
        self._comm.close()
        self._buffers = []

    # ---- on the receiver's thread ------------------------------------------------------------
    def _wait_for_sync(self) -> dict[str, Any]:
        idle = self.idle_timeout_s
        header = self._channel.recv_header(
            (_NO_LIMIT_S if idle is None else idle)
            if isinstance(self.group, BroadcastGroup)
            else None
        )
        if header["op"] not in ("start", "close"):
            raise WeightSyncError(
                f"weight-sync receiver expected a sync to start, got {header['op']!r}: the "
                "stream is out of step"
            )
        return header

    def _wait_and_receive(self) -> tuple[Weights, Version] | None:
        header = self._wait_for_sync()
        return None if header["op"] == "close" else self._receive_sync(header)

    def _connect(self) -> None:
        if isinstance(self.group, BroadcastGroup):
            self.group.connect()
            if self.group.rank == self.src:
                raise WeightSyncError(
                    f"DistributedWeightReceiver runs on the receiving ranks of {self.group!r}, "
                    f"not on the sending rank {self.src}; the sender uses DistributedWeightSync"
                )
            return
        import torch.distributed as dist

        if not dist.is_initialized():
            raise WeightSyncError(
                "DistributedWeightReceiver: torch.distributed is not initialised; pass a "
                "WeightSyncGroup as group, or call init_process_group(backend="
                "default_backend(), ...) in every process first"
            )

    def _bucket_buffer(self, index: int, nbytes: int) -> torch.Tensor:
        """Where bucket ``index`` of a sync lands: a fresh buffer, or with ``reuse_buffers``
        the one that bucket used last time (replaced when it is too small)."""
        if not self.reuse_buffers:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if index == len(self._buffers):
            self._buffers.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        if self._buffers[index].numel() < nbytes:
            self._buffers[index] = torch.empty(0, dtype=torch.uint8, device=self.device)
            self._buffers[index] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buffers[index][:nbytes]

    def _receive_sync(self, start: dict[str, Any]) -> tuple[Weights, Version] | None:
        """The rest of a sync whose ``start`` header came: bucket headers and bytes, each
        bucket's bytes received while the next header is (the sender sends them so), up to
        the finish."""
        staged: Weights = []
        seen: set[str] = set()
        # a start header that describes a bucket is that bucket's header too
        header = start if "names" in start else self._channel.recv_header()
        for index in itertools.count():
            op = header["op"]
            if op == "bucket" or header is start:
                entries = _parse_bucket(header, seen)
                try:
                    buffer = self._bucket_buffer(index, header["nbytes"])
                except (RuntimeError, MemoryError) as exc:  # the allocator's refusal
                    raise WeightSyncError(
                        f"weight-sync receiver cannot hold a bucket of {header['nbytes']} bytes "
                        f"({exc})"
                    ) from exc
                wait = self._channel.start(buffer) if buffer.numel() else _nothing
                next_header = self._channel.header_start()  # comes once the bytes have
                staged += _views(buffer, entries)  # made while the bytes come
                header = next_header()
                wait()
            elif op == "finish":
                version = header.get("version")
                if not _is_int(version) or not 0 <= version < _VERSION_LIMIT:
                    raise WeightSyncError(
                        f"weight-sync finish header has version {version!r:.80}; expected an "
                        "int in [0, 2**63)"
                    )
                return staged, version
            elif op == "close":
                return None
            else:
                raise WeightSyncError(
                    f"weight-sync receiver got {op!r} inside a sync: the stream is out of step"
                )
        raise AssertionError("unreachable")


# --------------------------------------------------------------------------------------------
# Engines that run their own receiving side (vLLM's weight transfer, SGLang's update group)
# --------------------------------------------------------------------------------------------
@runtime_checkable
class GroupReceiver(Protocol):
    """An inference engine that receives weights over a process group it joins itself — vLLM's
    weight-transfer engine (``init_weight_transfer_engine`` -> ``start_weight_update`` ->
    ``update_weights`` -> ``finish_weight_update``), SGLang's ``init_weights_update_group`` +
    ``update_weights_from_distributed`` — seen from the trainer. ``EngineGroupWeightSync``
    drives it: the trainer (rank 0) broadcasts each tensor of a bucket, in order, while
    ``receive_weights`` tells the engine the matching names, dtypes and shapes.

    ``weight_group_ranks``: how many ranks of the group the engine's workers take (its
    tensor x pipeline x data parallel size). ``join_weight_group`` returns once the engine's
    workers joined (it runs concurrently with the trainer's own join). ``receive_weights``
    returns once the engine received (and loaded or staged) every tensor it names.
    ``commit_weights(version)`` ends the sync: afterwards the engine's ``weight_version`` is
    ``version`` and new tokens report it. ``leave_weight_group`` releases the engine's side."""

    @property
    def weight_group_ranks(self) -> int: ...

    async def join_weight_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int
    ) -> None: ...

    async def begin_weight_update(self) -> None: ...

    async def receive_weights(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
    ) -> None: ...

    async def commit_weights(self, version: Version) -> None: ...

    async def leave_weight_group(self) -> None: ...


GroupFactory = Callable[[str, int, int], BroadcastGroup]
"""``make_group(master_address, master_port, world_size)``: the trainer's side (rank 0) of
the group the engines join, built but not connected."""


def engine_wire(engine: object) -> GroupWire:
    """The ``GroupWire`` an engine receives its weight group's broadcasts in (its
    ``weight_wire`` attribute; one broadcast per tensor when it has none)."""
    wire = getattr(engine, "weight_wire", None)
    if wire is None:
        return GroupWire()
    if not isinstance(wire, GroupWire):
        raise WeightSyncError(
            f"{type(engine).__name__}.weight_wire must be a GroupWire, got {wire!r}"
        )
    return wire


def wire_dtype(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how vLLM and SGLang name dtypes on the wire
    (``getattr(torch, name)`` on their side)."""
    return str(dtype).removeprefix("torch.")


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes in C order as a 1-D ``uint8`` view (a copy only if not contiguous)."""
    return tensor.contiguous().view(-1).view(torch.uint8)


@dataclass(frozen=True)
class GroupWire:
    """How a bucket's tensors cross an engine's weight group, matched to how the engine
    receives them (a ``GroupReceiver``'s optional ``weight_wire``; default ``tensor``):

    * ``"tensor"``: one broadcast per tensor, in the bucket's order (vLLM unpacked, SGLang's
      default load format).
    * ``"packed"``: vLLM 0.33's ``packed=True`` wire: the tensors' bytes concatenated into
      ``uint8`` chunks, a chunk closed as soon as its size passes ``buffer_bytes`` (the tensor
      that passes it included), one broadcast per chunk (``vllm/distributed/weight_transfer/
      packed_tensor.py``, ``pack_tensors`` / ``packed_nccl_broadcast_consumer``: both sides cut
      the same chunks from the sizes alone).
    * ``"flattened"``: SGLang's ``load_format="flattened_bucket"``: the whole bucket as one
      ``uint8`` broadcast (``srt/weight_sync/tensor_bucket.py``, ``FlattenedTensorBucket``).

    Both bulk wires send the tensors ordered by element size, largest first (stable), so
    each tensor's byte offset in its buffer is a multiple of its element size: SGLang refuses
    an unaligned offset (``FlattenedTensorBucket.empty``), and vLLM's ``unpack_tensor`` views
    each piece in place (``.contiguous().view(dtype)``), which torch refuses at such an
    offset. The engines get the names in the order sent."""

    kind: Literal["tensor", "packed", "flattened"] = "tensor"
    buffer_bytes: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("tensor", "packed", "flattened"):
            raise WeightSyncError(f"GroupWire: unknown kind {self.kind!r}")
        if self.kind == "packed" and (not _is_int(self.buffer_bytes) or self.buffer_bytes < 1):
            raise WeightSyncError(
                f"GroupWire: packed needs buffer_bytes >= 1, got {self.buffer_bytes!r}"
            )

    def arrange(
        self, names: Sequence[str], tensors: Sequence[torch.Tensor]
    ) -> tuple[list[str], list[torch.Tensor]]:
        """The order the tensors go in (and the names posted to the engines in)."""
        order = list(range(len(names)))
        if self.kind != "tensor":
            order.sort(key=lambda i: -tensors[i].element_size())
        return [names[i] for i in order], [tensors[i] for i in order]

    def messages(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What rank 0 broadcasts for ``tensors`` (already arranged), in order."""
        if self.kind == "tensor":
            return list(tensors)
        if self.kind == "flattened":
            return [torch.cat([tensor_bytes(t) for t in tensors])] if tensors else []
        chunks: list[torch.Tensor] = []
        pending: list[torch.Tensor] = []
        size = 0
        for tensor in tensors:
            pending.append(tensor_bytes(tensor))
            size += pending[-1].numel()
            if size > self.buffer_bytes:
                chunks.append(torch.cat(pending))
                pending, size = [], 0
        if pending:
            chunks.append(torch.cat(pending))
        return chunks


class EngineGroupWeightSync:
    """The trainer's side of a collective sync into engines that receive on their own
    (``GroupReceiver``: the vLLM and SGLang adapters), in the WeightSync phases.

    ``init()`` builds the group (``make_group(master_address, master_port, world_size)``,
    world = 1 + the engines' ranks; default ``WeightSyncGroup`` — gloo on CPU, nccl with
    CUDA; the vLLM adapter passes vLLM's own NCCL group, the SGLang adapter SGLang's) and
    joins it while every engine joins at its rank offset (the first engine at 1). ``start()``
    opens a sync on every engine; ``update(bucket)`` broadcasts the bucket's tensors one by
    one from rank 0 (on the group's own thread, the event loop free) while every engine's
    ``receive_weights`` gets the names, dtypes and shapes; ``finish(version)`` commits the
    version on every engine.

    A failure mid-transfer (an engine refusing the metadata, a peer gone, a broadcast past
    ``timeout_s``) leaves the transport unusable (later calls raise that error): ``close()``
    it and build a new one, with a fresh port; the engines keep serving the weights they had
    (SGLang loads tensors as they arrive, so its weights may then be partly new — sync again).
    """

    def __init__(
        self,
        engines: Sequence[GroupReceiver],
        *,
        master_address: str,
        master_port: int,
        make_group: GroupFactory | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        who = "EngineGroupWeightSync"
        engines = list(engines)
        if not engines:
            raise WeightSyncError(f"{who}: pass at least one engine to sync into")
        for engine in engines:
            if not isinstance(engine, GroupReceiver):
                raise WeightSyncError(
                    f"{who}: {type(engine).__name__} does not receive over a weight group (it "
                    "lacks the GroupReceiver methods); use InProcessWeightSync or "
                    "DistributedWeightSync for it"
                )
        if not isinstance(timeout_s, int | float) or not 0 < timeout_s < math.inf:
            raise WeightSyncError(f"{who}: timeout_s must be a number > 0, got {timeout_s!r}")
        wires = {engine_wire(engine) for engine in engines}
        if len(wires) > 1:
            raise WeightSyncError(
                f"{who}: the engines receive in different wire formats ({sorted(map(str, wires))}"
                "); one broadcast cannot serve them all: sync each kind with its own transport"
            )
        self.wire: GroupWire = wires.pop()
        self.engines = engines
        self.master_address = master_address
        self.master_port = master_port
        self.timeout_s = float(timeout_s)
        self._make_group = make_group
        self.group: BroadcastGroup | None = None
        self._phases = _Phases(who)
        self._seen: set[str] = set()
        self._comm = _SerialThread("weightsync-engine-group")
        self._failed: BaseException | None = None
        self._closed = False

    @property
    def world_size(self) -> int:
        return 1 + sum(int(engine.weight_group_ranks) for engine in self.engines)

    async def init(self) -> None:
        self._usable()
        self._phases.expect("init")
        world = self.world_size
        if self._make_group is None:
            group: BroadcastGroup = WeightSyncGroup(
                self.master_address, self.master_port, 0, world, timeout_s=self.timeout_s
            )
        else:
            group = self._make_group(self.master_address, self.master_port, world)
        if group.rank != 0 or group.world_size != world:
            raise WeightSyncError(
                f"EngineGroupWeightSync: make_group built rank {group.rank} of "
                f"{group.world_size}; the trainer is rank 0 of {world} (1 + the engines' ranks)"
            )
        self.group = group
        joins: list[Awaitable[None]] = [self._comm.run(group.connect)]
        offset = 1
        for engine in self.engines:
            joins.append(
                engine.join_weight_group(self.master_address, self.master_port, offset, world)
            )
            offset += int(engine.weight_group_ranks)
        await self._all("init", joins)
        self._phases.move("init")

    async def start(self) -> None:
        self._usable()
        self._phases.expect("start")
        await self._all("start", [engine.begin_weight_update() for engine in self.engines])
        self._seen = set()
        self._phases.move("start")

    async def update(self, bucket: WeightBucket) -> None:
        self._usable()
        self._phases.expect("update")
        _check_bucket("EngineGroupWeightSync", bucket, self._seen)
        if not bucket.names:
            return
        assert self.group is not None
        device = self.group.device
        names, tensors = self.wire.arrange(
            list(bucket.names), [t.detach().to(device).contiguous() for t in bucket.tensors]
        )
        dtypes = [wire_dtype(t.dtype) for t in tensors]
        shapes = [list(t.shape) for t in tensors]
        group, timeout, wire = self.group, self.timeout_s, self.wire

        def send() -> None:
            for message in wire.messages(tensors):
                group.broadcast(message, 0, timeout_s=timeout)

        calls: list[Awaitable[None]] = [
            engine.receive_weights(names, dtypes, shapes) for engine in self.engines
        ]
        await self._all("update", [self._comm.run(send), *calls])
        self._seen.update(names)

    async def finish(self, version: Version) -> None:
        self._usable()
        self._phases.expect("finish")
        _check_version("EngineGroupWeightSync", version)
        await self._all("finish", [engine.commit_weights(version) for engine in self.engines])
        self._phases.move("finish")

    async def close(self) -> None:
        """Release every engine's side of the group (errors ignored: an engine may be gone),
        then the trainer's. Final; safe to repeat."""
        if self._closed:
            return
        self._closed = True
        if self.group is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    asyncio.gather(
                        *(engine.leave_weight_group() for engine in self.engines),
                        return_exceptions=True,
                    ),
                    timeout=min(self.timeout_s, 30.0),
                )
            close = getattr(self.group, "close", None)
            if callable(close):
                with contextlib.suppress(Exception):
                    close()
        self._comm.close()

    # ---- internals ---------------------------------------------------------------------------
    def _usable(self) -> None:
        if self._closed:
            raise WeightSyncError("EngineGroupWeightSync is closed; build a new one")
        if self._failed is not None:
            raise WeightSyncError(
                f"EngineGroupWeightSync: an earlier transfer failed ({self._failed}); close it "
                "and build a new one (with a fresh port)"
            ) from self._failed

    async def _all(self, phase: str, calls: Sequence[Awaitable[None]]) -> None:
        """Run ``calls`` together; the first failure fails the transport at once (the others
        may be stuck in a collective waiting for the failed peer) and is raised."""
        tasks = [asyncio.ensure_future(call) for call in calls]
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in done if not t.cancelled() and t.exception() is not None]
        if not failed:
            return
        for task in pending:
            task.cancel()
        for task in tasks:  # retrieve every exception: none is left unobserved
            if task.done() and not task.cancelled():
                task.exception()
        exc = failed[0].exception()
        assert exc is not None
        self._failed = exc
        if isinstance(exc, WeightSyncError):
            raise exc
        raise WeightSyncError(f"EngineGroupWeightSync: {phase}() failed: {exc}") from exc


# --------------------------------------------------------------------------------------------
# The engines' own transports: what a default sync uses for engines that take no tensors
# --------------------------------------------------------------------------------------------
@runtime_checkable
class SupportsOwnTransport(Protocol):
    """An engine that receives weights through a channel of its own (a weight group) and not
    as tensors through ``load_weights`` (its ``tensor_load_refusal`` says why). The default
    syncs of the RL job then move weights with ``own_weight_transport(engines)`` (the
    engines: every rollout engine of this class), a ``WeightSync`` not yet initialised.
    ``own_transport_refusal(engines)`` says, before anything runs, why there is none here
    (e.g. a server the trainer cannot safely reach on its own), naming the setting that
    works; None when there is one."""

    def own_weight_transport(self, engines: Sequence[Any]) -> WeightSync: ...

    def own_transport_refusal(self, engines: Sequence[Any]) -> str | None: ...


def _unwrapped(engine: object) -> object:
    """The engine a job's wrapper (``_Guarded``: ``.engine``) stands for."""
    return getattr(engine, "engine", engine)


def own_transport_parts(
    targets: Sequence[SupportsLoadWeights],
) -> tuple[list[SupportsLoadWeights], list[list[Any]]]:
    """``targets`` split into those that take tensors through ``load_weights`` and, by class,
    those that receive through their own transport (``SupportsOwnTransport`` and a
    ``tensor_load_refusal``; unwrapped from the job's guards)."""
    takers: list[SupportsLoadWeights] = []
    own: dict[type, list[Any]] = {}
    for target in targets:
        engine = _unwrapped(target)
        if isinstance(engine, SupportsOwnTransport) and tensor_load_refusal(engine) is not None:
            own.setdefault(type(engine), []).append(engine)
        else:
            takers.append(target)
    return takers, list(own.values())


def off_loopback_refusal(engines: Sequence[Any], transport: str) -> str | None:
    """Why the job cannot open a weight group into these HTTP engines by itself (some server,
    by its ``base_url``, is not on loopback, and the job opens the trainer's side on loopback
    only: secure by default), naming ``transport`` (the call that works, e.g.
    ``"asyncflow_sglang.SGLangWeightSync(engines, master_address=..., ...)"``); None when all
    are on loopback."""
    remote = [
        e.base_url
        for e in engines
        if not is_loopback_literal(urllib.parse.urlsplit(e.base_url).hostname or "")
    ]
    if not remote:
        return None
    return (
        f"server(s) {remote} are not on loopback, and the job opens the trainer's side of the "
        f"weight group on loopback only; pass RLEngines(make_transport=lambda engines: "
        f"{transport}), with master_address this host's address on a network only the "
        "trainer and the servers share"
    )


def own_transport_refusal(targets: Sequence[SupportsLoadWeights]) -> str | None:
    """Why ``engine_transport(targets)`` cannot be built (the first engine class's own
    refusal), or None."""
    for engines in own_transport_parts(targets)[1]:
        reason = engines[0].own_transport_refusal(engines)
        if reason:
            return f"{type(engines[0]).__name__}: {reason}"
    return None


def needs_own_transport(targets: Sequence[SupportsLoadWeights]) -> bool:
    """Whether some target takes no tensors and has a transport of its own."""
    return bool(own_transport_parts(targets)[1])


def engine_transport(targets: Sequence[SupportsLoadWeights]) -> WeightSync:
    """A transport into ``targets`` that reaches each engine the way it receives: in process
    (``InProcessWeightSync``) for those that take tensors, the engine's own
    (``SupportsOwnTransport.own_weight_transport``) for each class of the others; one
    ``FanOutWeightSync`` over them when there are several."""
    takers, own = own_transport_parts(targets)
    parts: list[WeightSync] = [engines[0].own_weight_transport(engines) for engines in own]
    if takers:
        parts.insert(0, InProcessWeightSync(takers))
    return parts[0] if len(parts) == 1 else FanOutWeightSync(parts)


class FanOutWeightSync:
    """One sync into several transports: each phase runs on every part, together; ``close``
    closes the parts that can be closed."""

    def __init__(self, parts: Sequence[WeightSync]) -> None:
        if not parts:
            raise WeightSyncError("FanOutWeightSync: pass at least one transport")
        self.parts = list(parts)

    async def init(self) -> None:
        await asyncio.gather(*(p.init() for p in self.parts))

    async def start(self) -> None:
        await asyncio.gather(*(p.start() for p in self.parts))

    async def update(self, bucket: WeightBucket) -> None:
        await asyncio.gather(*(p.update(bucket) for p in self.parts))

    async def finish(self, version: Version) -> None:
        await asyncio.gather(*(p.finish(version) for p in self.parts))

    async def close(self) -> None:
        await close_transport(*self.parts)


async def close_transport(*transports: object) -> None:
    """``await t.close()`` for each transport that has one (errors suppressed: closing is
    best effort, e.g. an engine already gone)."""
    for transport in transports:
        close = getattr(transport, "close", None)
        if callable(close):
            with contextlib.suppress(Exception):
                result = close()
                if asyncio.iscoroutine(result):
                    await result


def bucketize(
    named: Sequence[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    *,
    pack: bool = False,
    device: str | torch.device | None = None,
) -> list[WeightBucket]:
    """Group named tensors, in order, into buckets of at most ``bucket_bytes`` (a tensor bigger
    than that is a bucket of its own) — the layout ``TrainEngine.export_weights`` yields.

    ``pack=True`` also copies each bucket's tensors into one buffer of its own, laid out as
    ``DistributedWeightSync`` puts them on the wire, and returns views of it: a snapshot
    (later changes to ``named`` do not show; ``WeightBucket.snapshot`` is True) that the
    sender broadcasts from its own memory, without packing, while the next bucket is handed
    over. An exporter that copies the weights anyway can copy them this way (one copy, not a
    copy and then a pack). ``device``: where packed buffers live (default: each bucket's first
    tensor's device; ``"cpu"`` copies a GPU model's weights to host memory in the same pass)."""
    if bucket_bytes <= 0:
        raise WeightSyncError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[WeightBucket] = []
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if tensors and size + nbytes > bucket_bytes:
            buckets.append(WeightBucket(tuple(names), tuple(tensors)))
            names, tensors, size = [], [], 0
        names.append(name)
        tensors.append(t)
        size += nbytes
    if tensors:
        buckets.append(WeightBucket(tuple(names), tuple(tensors)))
    return [_packed(b, device) for b in buckets] if pack else buckets


def _packed(bucket: WeightBucket, device: str | torch.device | None) -> WeightBucket:
    tensors = bucket.tensors
    offsets, nbytes = _layout([t.dtype for t in tensors], [t.shape for t in tensors])
    where = tensors[0].device if device is None else torch.device(device)
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=where)
    _pack_into(buffer, tensors, offsets)
    views = (_region(buffer, o, t.dtype, t.shape) for t, o in zip(tensors, offsets, strict=True))
    return WeightBucket(bucket.names, tuple(views), snapshot=True)
