"""The ``WeightSync`` laws (``WeightSyncConformance``) on the collective transports, whose
trainer side runs a process group's broadcasts:

* ``EngineGroupWeightSync`` (what the vLLM and SGLang adapters build) into reference inference
  engines that receive over a group they join themselves (``GroupReceiver``), through an
  in-process group: rank 0's broadcasts reach every receiving rank's tensors, byte for byte,
  through one queue per rank.
* ``DistributedWeightSync`` over a real ``WeightSyncGroup`` (gloo on 127.0.0.1, a free port,
  every rank in this process) into ``DistributedWeightReceiver``s that feed reference
  inference engines on the law's own event loop.

Both sync two tiny ``TorchInferenceEngine``s from a ``TorchTrainEngine``, so the byte-equality
and live-bucket laws run too. Every wait is bounded; each law's groups, threads and receivers
are released when the law closes its transport."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from asyncflow_conformance import WeightSyncConformance
from asyncflow_reference.engines import TorchInferenceEngine, TorchTrainEngine
from asyncflow_reference.model import ModelConfig

from asyncflow_core.contracts.errors import WeightSyncError
from asyncflow_core.contracts.protocols import Version
from asyncflow_core.engines.process import free_port
from asyncflow_core.sync.transports import (
    DistributedWeightReceiver,
    DistributedWeightSync,
    EngineGroupWeightSync,
    GroupReceiver,
    WeightSyncGroup,
)

HOST = "127.0.0.1"
MODEL = ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, max_seq_len=32)
WAIT_S = 30.0
"""Seconds any one collective step of these tests may take (a rendezvous, a receive)."""
CLOSE_S = 10.0
"""Seconds the receivers get to end after the sender's close message (they end at once)."""
CPU = torch.device("cpu")


def _source() -> TorchTrainEngine:
    return TorchTrainEngine(MODEL, seed=1, threads=1)


def _state(engine: Any) -> Mapping[str, torch.Tensor]:
    assert isinstance(engine, TorchInferenceEngine)
    return dict(engine.model.state_dict())


# --------------------------------------------------------------------------------------------
# EngineGroupWeightSync through an in-process group
# --------------------------------------------------------------------------------------------
class Hub:
    """A broadcast group of ``world_size`` ranks in one process: rank 0 broadcasts, every other
    rank receives, in order, from a queue of its own. Checks its arguments as
    ``WeightSyncGroup`` does."""

    def __init__(self, world_size: int) -> None:
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 2:
            raise WeightSyncError(f"Hub: world_size must be an int >= 2, got {world_size!r}")
        self.world_size = world_size
        self.inboxes: dict[int, queue.SimpleQueue[bytes]] = {
            r: queue.SimpleQueue() for r in range(1, world_size)
        }


class HubGroup:
    """One rank's side of a ``Hub`` (a ``BroadcastGroup``)."""

    def __init__(self, hub: Hub, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < hub.world_size:
            raise WeightSyncError(f"HubGroup: rank {rank!r} not in [0, {hub.world_size})")
        self.hub, self._rank = hub, rank
        self._connected = False

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self.hub.world_size

    @property
    def device(self) -> torch.device:
        return CPU

    def connect(self) -> None:
        self._connected = True

    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout_s: float | None = None) -> None:
        if not self._connected:
            raise WeightSyncError(f"HubGroup rank {self._rank}: broadcast before connect()")
        if src != 0:
            raise WeightSyncError(f"HubGroup: only rank 0 sends, not {src!r}")
        if tensor.device != CPU:
            raise WeightSyncError(f"HubGroup: tensors must be on cpu, got {tensor.device}")
        raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
        if self._rank == 0:
            data = bytes(raw.numpy())
            for inbox in self.hub.inboxes.values():
                inbox.put(data)
            return
        try:
            data = self.hub.inboxes[self._rank].get(
                timeout=WAIT_S if timeout_s is None else timeout_s
            )
        except queue.Empty:
            raise WeightSyncError(f"HubGroup rank {self._rank}: nothing sent") from None
        if len(data) != raw.numel():
            raise WeightSyncError(f"HubGroup: {len(data)} bytes sent for {raw.numel()}")
        if data:
            tensor.view(-1).view(torch.uint8).copy_(
                torch.frombuffer(bytearray(data), dtype=torch.uint8)
            )


_HUBS: weakref.WeakValueDictionary[tuple[str, int], Hub] = weakref.WeakValueDictionary()
"""The live hubs by the (address, port) their trainer built them at; receivers look them up
there (a hub goes with its transport's group)."""
_PORTS = itertools.count(20_000)
"""Made-up ports (no socket is opened): one per transport, so no two hubs share one."""


def make_hub_group(address: str, port: int, world_size: int) -> HubGroup:
    """The trainer's side (rank 0) of a new hub at ``address:port`` (``make_group``)."""
    hub = Hub(world_size)
    _HUBS[(address, port)] = hub
    return HubGroup(hub, 0)


class HubEngine(TorchInferenceEngine):
    """A reference inference engine that receives its weights as vLLM and SGLang do: it joins
    the trainer's group (a hub) at its rank, receives each tensor the trainer broadcasts
    into a fresh tensor of the announced dtype and shape (off the event loop), stages them
    and loads them at ``commit_weights``."""

    weight_group_ranks: int = 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._group: HubGroup | None = None
        self._staged: list[tuple[str, torch.Tensor]] = []

    async def join_weight_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int
    ) -> None:
        hub = _HUBS.get((master_address, master_port))
        if hub is None:
            raise WeightSyncError(f"HubEngine: no group at {master_address}:{master_port}")
        if world_size != hub.world_size:
            raise WeightSyncError(
                f"HubEngine: told a world of {world_size!r}, the group has {hub.world_size}"
            )
        group = HubGroup(hub, rank_offset)
        group.connect()
        self._group = group

    async def begin_weight_update(self) -> None:
        if self._group is None:
            raise WeightSyncError("HubEngine: begin_weight_update before join_weight_group")
        self._staged = []

    async def receive_weights(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
    ) -> None:
        group = self._group
        if group is None:
            raise WeightSyncError("HubEngine: receive_weights before join_weight_group")
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            tensor = torch.empty(tuple(shape), dtype=getattr(torch, dtype))
            await asyncio.to_thread(group.broadcast, tensor, 0)
            self._staged.append((name, tensor))

    async def commit_weights(self, version: Version) -> None:
        staged, self._staged = self._staged, []
        await self.load_weights(staged, version)

    async def leave_weight_group(self) -> None:
        self._group = None


class TestEngineGroupWeightSync(WeightSyncConformance):
    """``EngineGroupWeightSync`` into two ``HubEngine``s (one rank each) over a hub."""

    bucket_bytes = 1 << 10
    real_timeout_s = 60.0

    def make_source(self) -> TorchTrainEngine:
        return _source()

    def make_targets(self) -> list[HubEngine]:
        return [HubEngine(MODEL, max_batch=2, seed=i, threads=1) for i in range(2)]

    def make_sync(self, targets: Sequence[Any]) -> EngineGroupWeightSync:
        assert all(isinstance(t, GroupReceiver) for t in targets)
        return EngineGroupWeightSync(
            targets,
            master_address=HOST,
            master_port=next(_PORTS),
            make_group=make_hub_group,
            timeout_s=WAIT_S,
        )

    def target_weights(self, engine: Any) -> Mapping[str, torch.Tensor]:
        return _state(engine)


# --------------------------------------------------------------------------------------------
# DistributedWeightSync over a real WeightSyncGroup (gloo on loopback)
# --------------------------------------------------------------------------------------------
class LoopbackWeightSync(DistributedWeightSync):
    """``DistributedWeightSync`` on rank 0 of a gloo ``WeightSyncGroup`` on 127.0.0.1 whose
    other ranks are ``DistributedWeightReceiver``s serving ``targets`` on this event loop.

    The only additions are the harness's: ``finish(v)`` also waits (bounded) until every
    receiver has loaded ``v`` into its target — the sender's ``finish`` returns once the
    bytes are sent, and the law reads the targets' versions right after — and ``close()``
    ends the receivers (through the sender's close message, connecting first if no law
    did) and closes every rank's group."""

    def __init__(self, targets: Sequence[Any]) -> None:
        port = free_port(HOST)
        world = 1 + len(targets)
        super().__init__(group=WeightSyncGroup(HOST, port, 0, world, timeout_s=WAIT_S))
        self.groups = [
            WeightSyncGroup(HOST, port, r, world, timeout_s=WAIT_S) for r in range(1, world)
        ]
        self.loaded: list[Version | None] = [None] * len(targets)
        self._changed = asyncio.Event()
        self.receivers = [
            DistributedWeightReceiver(target, group=group, on_version=self._on_version(i))
            for i, (target, group) in enumerate(zip(targets, self.groups, strict=True))
        ]
        self.serving = [asyncio.ensure_future(r.serve()) for r in self.receivers]

    def _on_version(self, index: int) -> Any:
        def loaded(version: Version) -> None:
            self.loaded[index] = version
            self._changed.set()

        return loaded

    async def finish(self, version: Version) -> None:
        await super().finish(version)

        async def every_receiver_loaded() -> None:
            while any(v != version for v in self.loaded):
                for i, task in enumerate(self.serving):
                    if task.done():
                        raise WeightSyncError(
                            f"receiver {i} stopped before loading version {version}: "
                            f"{task.exception() if not task.cancelled() else 'cancelled'}"
                        )
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), 0.5)

        await asyncio.wait_for(every_receiver_loaded(), WAIT_S)

    async def close(self) -> None:
        try:
            # a sync never initialised sends no close: connect it first (out of order, i.e.
            # already initialised, closed or failed, changes nothing), so the receivers end
            with contextlib.suppress(WeightSyncError):
                await asyncio.wait_for(self.init(), WAIT_S)
            await super().close()
            await asyncio.wait_for(asyncio.gather(*self.serving, return_exceptions=True), CLOSE_S)
        finally:
            assert isinstance(self.group, WeightSyncGroup)
            self.group.close()
            for task in self.serving:
                task.cancel()
            for receiver, group in zip(self.receivers, self.groups, strict=True):
                receiver.close()
                group.close()


class TestDistributedWeightSyncLoopback(WeightSyncConformance):
    """``DistributedWeightSync`` into two ``TorchInferenceEngine``s behind
    ``DistributedWeightReceiver``s, over a gloo ``WeightSyncGroup`` of three ranks on
    127.0.0.1."""

    bucket_bytes = 1 << 10
    real_timeout_s = 90.0

    def make_source(self) -> TorchTrainEngine:
        return _source()

    def make_targets(self) -> list[TorchInferenceEngine]:
        return [TorchInferenceEngine(MODEL, max_batch=2, seed=i, threads=1) for i in range(2)]

    async def make_sync(self, targets: Sequence[Any]) -> LoopbackWeightSync:
        return LoopbackWeightSync(targets)

    def target_weights(self, engine: Any) -> Mapping[str, torch.Tensor]:
        return _state(engine)
