"""WeightSync transports: move weight buckets from a trainer to inference engines, in the
phases of the WeightSync protocol (init -> start -> update(bucket) x N -> finish(version)):
in process, as a bucketed torch.distributed broadcast, or as safetensors files on disk.

Every transport stages a sync's buckets and applies them to its targets only at
``finish(version)``, so a target never holds a mix of two versions. *When* an engine swaps is
the strategy's business: ``BlockingUpdate`` pauses the engines for the whole transfer,
``StagedUpdate`` (the paper's delayed update) transfers into a host buffer while they keep
generating and exposes only the swap at the next safe point.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import uuid
from collections.abc import AsyncIterable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from asyncflow_core.errors import WeightSyncError
from asyncflow_core.protocols import (
    SupportsLoadWeights,
    SupportsPause,
    Version,
    WeightBucket,
    WeightSync,
)

Weights = list[tuple[str, torch.Tensor]]


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


def _check_bucket(transport: str, bucket: WeightBucket, seen: set[str]) -> None:
    if not isinstance(bucket, WeightBucket):
        raise WeightSyncError(f"{transport}: update() takes a WeightBucket, got {bucket!r:.80}")
    if len(bucket.names) != len(bucket.tensors):
        raise WeightSyncError(
            f"{transport}: bucket has {len(bucket.names)} names for {len(bucket.tensors)} tensors"
        )
    for name in bucket.names:
        if name in seen:
            raise WeightSyncError(
                f"{transport}: parameter {name!r} was sent twice in one sync; send each once"
            )
        seen.add(name)


async def _apply(
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
        _check_bucket("InProcessWeightSync", bucket, self._seen)
        self._staged += [(n, t.detach().clone()) for n, t in bucket]

    async def finish(self, version: Version) -> None:
        self._phases.expect("finish")
        weights, self._staged = self._staged, []
        await _apply(self.targets, weights, version)
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

    async def finish(self, version: Version) -> None:
        self._phases.expect("finish")
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
            await _apply(self.targets, weights, version)
        self._phases.move("finish")

    def _prune(self) -> None:
        versions = sorted(p for p in self.root.glob("v*") if (p / MANIFEST).exists())
        for old in versions[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)


def read_weights(path: str | os.PathLike[str]) -> tuple[Weights, Version]:
    """Load a sync written by ``DiskWeightSync``: ``path`` is a version folder, or the root
    (then ``LATEST`` names the folder). Returns the (name, tensor) list and the version."""
    from safetensors.torch import load_file

    folder = Path(path)
    if (folder / LATEST).exists():
        folder = folder / (folder / LATEST).read_text().strip()
    manifest_path = folder / MANIFEST
    if not manifest_path.exists():
        raise WeightSyncError(
            f"no weights at {folder}: {MANIFEST} is missing (point at a version folder or at "
            "the DiskWeightSync root)"
        )
    manifest = json.loads(manifest_path.read_text())
    weights: Weights = []
    for bucket in manifest["buckets"]:  # in the order they were sent
        tensors = load_file(str(folder / bucket["file"]))
        weights += [(name, tensors[name]) for name in bucket["names"]]
    return weights, int(manifest["version"])


# --------------------------------------------------------------------------------------------
# torch.distributed: bucketed broadcast
# --------------------------------------------------------------------------------------------
def default_backend() -> str:
    """The collective backend for this machine: nccl with CUDA, else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"unknown dtype {name!r} in a weight-sync header")
    return dtype


def _pack(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """All tensors' bytes in one flat uint8 buffer (one broadcast per bucket)."""
    flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(flat).to(device) if flat else torch.empty(0, dtype=torch.uint8, device=device)


def _unpack(buffer: torch.Tensor, header: dict[str, Any]) -> Weights:
    out: Weights = []
    offset = 0
    for name, dtype_name, shape in zip(
        header["names"], header["dtypes"], header["shapes"], strict=True
    ):
        dtype = _dtype(dtype_name)
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        chunk = buffer[offset : offset + nbytes]
        out.append((name, chunk.view(dtype).reshape(shape).clone()))
        offset += nbytes
    return out


class _Channel:
    """Headers as JSON bytes over broadcasts of the group (no pickle between processes)."""

    def __init__(self, src: int, group: Any, device: torch.device) -> None:
        self.src, self.group, self.device = src, group, device

    def send_header(self, header: dict[str, Any]) -> None:
        import torch.distributed as dist

        data = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        dist.broadcast(size, self.src, group=self.group)
        dist.broadcast(data.to(self.device), self.src, group=self.group)

    def recv_header(self) -> dict[str, Any]:
        import torch.distributed as dist

        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        dist.broadcast(size, self.src, group=self.group)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(data, self.src, group=self.group)
        header: dict[str, Any] = json.loads(bytes(data.cpu().numpy()).decode())
        return header


class DistributedWeightSync:
    """The sender (the trainer's rank ``src``) of a bucketed broadcast over a torch.distributed
    group that also holds the receivers (``DistributedWeightReceiver`` in the inference
    processes). Each bucket is one header (names, dtypes, shapes as JSON) and one broadcast of
    its bytes packed into a flat buffer. The process group must be initialised by the caller
    (``torch.distributed.init_process_group``; ``default_backend()`` picks gloo or nccl)."""

    def __init__(self, src: int = 0, group: Any = None, device: str | torch.device = "cpu") -> None:
        self.src = src
        self.group = group
        self.device = torch.device(device)
        self._phases = _Phases("DistributedWeightSync")
        self._seen: set[str] = set()
        self._channel = _Channel(src, group, self.device)

    async def init(self) -> None:
        import torch.distributed as dist

        self._phases.expect("init")
        if not dist.is_initialized():
            raise WeightSyncError(
                "DistributedWeightSync: torch.distributed is not initialised; call "
                "init_process_group(backend=default_backend(), ...) in every process first"
            )
        if dist.get_rank() != self.src:
            raise WeightSyncError(
                f"DistributedWeightSync runs on the sending rank {self.src}, not on rank "
                f"{dist.get_rank()}; receivers use DistributedWeightReceiver"
            )
        self._phases.move("init")

    async def start(self) -> None:
        self._phases.expect("start")
        self._seen = set()
        self._channel.send_header({"op": "start"})
        self._phases.move("start")

    async def update(self, bucket: WeightBucket) -> None:
        import torch.distributed as dist

        self._phases.expect("update")
        _check_bucket("DistributedWeightSync", bucket, self._seen)
        buffer = _pack(bucket.tensors, self.device)
        self._channel.send_header(
            {
                "op": "bucket",
                "names": list(bucket.names),
                "dtypes": [str(t.dtype) for t in bucket.tensors],
                "shapes": [list(t.shape) for t in bucket.tensors],
                "nbytes": int(buffer.numel()),
            }
        )
        dist.broadcast(buffer, self.src, group=self.group)

    async def finish(self, version: Version) -> None:
        self._phases.expect("finish")
        self._channel.send_header({"op": "finish", "version": version})
        self._phases.move("finish")

    async def close(self) -> None:
        """Tell the receivers to stop their ``serve`` loops."""
        self._channel.send_header({"op": "close"})


class DistributedWeightReceiver:
    """The receiving side in an inference process: ``serve()`` takes syncs until the sender
    closes, staging each sync's buckets and loading them into ``target`` at finish (then
    ``on_version(v)`` if given). ``receive_one()`` takes a single sync."""

    def __init__(
        self,
        target: SupportsLoadWeights,
        src: int = 0,
        group: Any = None,
        device: str | torch.device = "cpu",
        on_version: Callable[[Version], None] | None = None,
    ) -> None:
        self.target = target
        self.src = src
        self.group = group
        self.device = torch.device(device)
        self.on_version = on_version
        self._channel = _Channel(src, group, self.device)

    async def receive_one(self) -> Version | None:
        """Receive one whole sync and load it; None when the sender closed instead."""
        import torch.distributed as dist

        header = self._channel.recv_header()
        if header["op"] == "close":
            return None
        if header["op"] != "start":
            raise WeightSyncError(f"receiver expected a sync to start, got {header['op']!r}")
        staged: Weights = []
        while True:
            header = self._channel.recv_header()
            if header["op"] == "bucket":
                buffer = torch.empty(header["nbytes"], dtype=torch.uint8, device=self.device)
                dist.broadcast(buffer, self.src, group=self.group)
                staged += _unpack(buffer, header)
            elif header["op"] == "finish":
                version = int(header["version"])
                await self.target.load_weights(staged, version)
                if self.on_version is not None:
                    self.on_version(version)
                return version
            else:
                raise WeightSyncError(f"receiver got {header['op']!r} inside a sync")

    async def serve(self) -> list[Version]:
        """Receive syncs until the sender closes; returns the versions loaded."""
        versions = []
        while (version := await self.receive_one()) is not None:
            versions.append(version)
        return versions


def bucketize(named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[WeightBucket]:
    """Group named tensors, in order, into buckets of at most ``bucket_bytes`` (a tensor bigger
    than that is a bucket of its own) — the layout ``TrainEngine.export_weights`` yields."""
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
    return buckets


# --------------------------------------------------------------------------------------------
# Strategies: when the inference side swaps
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SyncTiming:
    """Where a sync's time went: ``transfer_s`` moving buckets, ``swap_s`` loading them into
    the engines, ``exposed_s`` the part during which the engines could not generate."""

    version: Version
    transfer_s: float
    swap_s: float
    exposed_s: float

    @property
    def hidden_s(self) -> float:
        return self.transfer_s + self.swap_s - self.exposed_s


class HostBuffer:
    """A host-side staging target: keeps the latest complete set of weights a transport
    delivered until ``take()`` hands it over (an older, untaken set is replaced)."""

    def __init__(self) -> None:
        self._pending: tuple[Weights, Version] | None = None

    async def load_weights(
        self, weights: Sequence[tuple[str, torch.Tensor]], version: Version
    ) -> None:
        self._pending = (list(weights), version)

    @property
    def pending_version(self) -> Version | None:
        return None if self._pending is None else self._pending[1]

    def take(self) -> tuple[Weights, Version] | None:
        pending, self._pending = self._pending, None
        return pending


Buckets = Iterable[WeightBucket] | AsyncIterable[WeightBucket]


async def _send(transport: WeightSync, buckets: Buckets, version: Version) -> None:
    await transport.start()
    if isinstance(buckets, AsyncIterable):
        async for bucket in buckets:
            await transport.update(bucket)
    else:
        for bucket in buckets:
            await transport.update(bucket)
    await transport.finish(version)


class BlockingUpdate:
    """Pause every engine (``SupportsPause``, mode ``pause_mode``), move the weights straight
    into them, resume: the whole sync is exposed. The baseline the staged update beats."""

    def __init__(
        self,
        engines: Sequence[SupportsLoadWeights],
        make_transport: Callable[[Sequence[SupportsLoadWeights]], WeightSync] = InProcessWeightSync,
        pause_mode: Literal["abort", "keep"] = "keep",
    ) -> None:
        self.engines = list(engines)
        self.transport = make_transport(self.engines)
        self.pause_mode = pause_mode
        self._ready = False

    async def sync(self, buckets: Buckets, version: Version) -> SyncTiming:
        if not self._ready:
            await self.transport.init()
            self._ready = True
        t0 = _loop_time()
        await _pause(self.engines, self.pause_mode)
        try:
            await _send(self.transport, buckets, version)
        finally:
            await _resume(self.engines)
        total = _loop_time() - t0
        return SyncTiming(version, transfer_s=total, swap_s=0.0, exposed_s=total)


class StagedUpdate:
    """AsyncFlow's delayed parameter update. ``sync`` moves the buckets into a ``HostBuffer``
    while the engines keep generating with the old weights (hidden); ``apply`` — called by the
    rollout loop at its next safe point, e.g. between batches — pauses the engines just long
    enough to load the staged weights (exposed), then resumes them. ``apply`` with nothing
    staged returns None at once."""

    def __init__(
        self,
        engines: Sequence[SupportsLoadWeights],
        make_transport: Callable[[Sequence[SupportsLoadWeights]], WeightSync] = InProcessWeightSync,
        pause_mode: Literal["abort", "keep"] = "keep",
    ) -> None:
        self.engines = list(engines)
        self.buffer = HostBuffer()
        self.transport = make_transport([self.buffer])
        self.pause_mode = pause_mode
        self._ready = False
        self._transfer_s: dict[Version, float] = {}

    @property
    def pending_version(self) -> Version | None:
        return self.buffer.pending_version

    async def sync(self, buckets: Buckets, version: Version) -> float:
        """Stage ``version``; returns the transfer seconds (hidden from generation)."""
        if not self._ready:
            await self.transport.init()
            self._ready = True
        t0 = _loop_time()
        await _send(self.transport, buckets, version)
        self._transfer_s[version] = _loop_time() - t0
        return self._transfer_s[version]

    async def apply(self) -> SyncTiming | None:
        staged = self.buffer.take()
        if staged is None:
            return None
        weights, version = staged
        t0 = _loop_time()
        await _pause(self.engines, self.pause_mode)
        try:
            await _apply(self.engines, weights, version)
        finally:
            await _resume(self.engines)
        swap = _loop_time() - t0
        transfer = self._transfer_s.pop(version, 0.0)
        self._transfer_s = {v: s for v, s in self._transfer_s.items() if v > version}
        return SyncTiming(version, transfer_s=transfer, swap_s=swap, exposed_s=swap)


async def _pause(engines: Sequence[object], mode: Literal["abort", "keep"]) -> None:
    for engine in engines:
        if isinstance(engine, SupportsPause):
            await engine.pause(mode)


async def _resume(engines: Sequence[object]) -> None:
    for engine in engines:
        if isinstance(engine, SupportsPause):
            await engine.resume()


def _loop_time() -> float:
    """Seconds on the running loop's clock (virtual when simulated)."""
    return asyncio.get_running_loop().time()
