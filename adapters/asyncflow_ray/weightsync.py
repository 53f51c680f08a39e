"""Direct weight sync on Ray: the trainer's actor sends to the rollout actors over a collective
group of their own; the driver only says when.

``RayDirectWeightSync(trainer, engines)`` is a staged update (AsyncFlow's delayed parameter
update, as ``asyncflow_core.sync.strategies.StagedUpdate``) whose bytes never pass through the
driver:

* **group** (built at the first sync, and again after an engine was taken out): a
  ``WeightSyncGroup`` — gloo on CPU, the platform's backend (nccl, hccl) where there is one —
  of the trainer's actor (rank 0, the sender) and every rollout actor (ranks 1..N). Rank 0
  hosts the rendezvous on its node's address as Ray knows it (``127.0.0.1`` on a local
  cluster: nothing of the group is reachable from outside), on a free port.
* **sync(version)** (hidden: the engines keep generating): the trainer's actor exports its
  weights (``export_weights``) straight into a ``DistributedWeightSync``; every rollout actor
  receives them on its receiver's thread into a staging buffer of its own
  (``DistributedWeightReceiver`` into a ``HostBuffer``). The call returns once the trainer
  sent every byte.
* **apply()** (exposed, at the job's safe point): each rollout actor waits until the version
  is staged, then pauses its engine, loads the staged weights and resumes it, in one actor
  call per engine.

The job uses it for ``weight_sync = "staged"`` on ``--runtime ray`` (``RLEngines.make_staged``);
the blocking and in-flight modes still stream buckets through the driver. Failures: a
rollout actor lost (``RLJob`` drops it) makes the next sync rebuild the group over the live
engines; a send that fails (a receiver died mid-sync) rebuilds the group over the engines
that still answer and sends once more; a trainer that dies fails the sync, as any trainer
call would.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from asyncflow_core.contracts.errors import EngineLostError, WeightSyncError
from asyncflow_core.contracts.protocols import SupportsPause, Version
from asyncflow_core.engines.process import free_port
from asyncflow_core.infra.checkpoint import failpoint
from asyncflow_core.sync.strategies import HostBuffer, SyncTiming
from asyncflow_core.sync.transports import (
    DistributedWeightReceiver,
    DistributedWeightSync,
    WeightSyncGroup,
)
from asyncflow_ray.engines import RayInferenceEngine, RayTrainEngine
from asyncflow_ray.runtime import alive_nodes, background, import_ray

__all__ = ["RayDirectWeightSync"]

DEFAULT_BUCKET_BYTES = 64 << 20


# --------------------------------------------------------------------------------------------
# What runs in the actors (through ``proxy.run(fn, ...)``: fn(engine, ...))
# --------------------------------------------------------------------------------------------
@dataclass
class _Sender:
    group: WeightSyncGroup
    sync: DistributedWeightSync


@dataclass
class _Receiver:
    group: WeightSyncGroup
    receiver: DistributedWeightReceiver
    buffer: HostBuffer
    serving: asyncio.Task[Any]
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # staged, or serving ended
    latest: Version = -1


_SENDERS: dict[int, _Sender] = {}  # this actor process's, by group id
_RECEIVERS: dict[int, _Receiver] = {}


def _address(engine: Any) -> tuple[str, int]:
    """This actor's node address (as Ray knows it) and a port free on it now."""
    ray = import_ray()
    node_id = ray.get_runtime_context().get_node_id()
    host = next((n.address for n in alive_nodes() if n.node_id == node_id), "127.0.0.1")
    return host, free_port(host)


async def _sender_open(
    engine: Any, gid: int, host: str, port: int, world: int, backend: str | None
) -> None:
    group = WeightSyncGroup(host, port, 0, world, backend=backend)
    sync = DistributedWeightSync(0, group)
    try:
        await sync.init()  # returns once every receiver joined
    except BaseException:
        group.close()
        raise
    _SENDERS[gid] = _Sender(group, sync)


async def _sender_send(engine: Any, gid: int, version: Version, bucket_bytes: int) -> float:
    sender = _SENDERS.get(gid)
    if sender is None:
        raise WeightSyncError(f"weight sync group {gid} is not open in the trainer's actor")
    t0 = time.perf_counter()
    await sender.sync.start()
    async for bucket in engine.export_weights(bucket_bytes):
        await sender.sync.update(bucket)
    await sender.sync.finish(version)
    return time.perf_counter() - t0


async def _sender_close(engine: Any, gid: int) -> None:
    sender = _SENDERS.pop(gid, None)
    if sender is not None:
        with contextlib.suppress(Exception):  # a dead receiver fails the close message fast
            await asyncio.wait_for(sender.sync.close(), 30)
        sender.group.close()


async def _sender_forget(engine: Any, gid: int) -> None:
    """Drop group ``gid`` without its close message (a rank of it is gone); a thread of it
    still waiting in a broadcast ends when the group times out."""
    _SENDERS.pop(gid, None)


async def _receiver_open(
    engine: Any, gid: int, host: str, port: int, rank: int, world: int, backend: str | None
) -> None:
    """Join group ``gid`` as ``rank`` and receive every sync into a staging buffer (in the
    background; returns at once: the group forms when the sender joins too)."""
    group = WeightSyncGroup(host, port, rank, world, backend=backend)
    buffer = HostBuffer()
    state: _Receiver | None = None

    def staged(version: Version) -> None:
        assert state is not None
        state.latest = max(state.latest, version)
        state.changed.set()

    receiver = DistributedWeightReceiver(buffer, src=0, group=group, on_version=staged)
    serving = asyncio.ensure_future(receiver.serve())
    state = _Receiver(group, receiver, buffer, serving)
    serving.add_done_callback(lambda _: state.changed.set())
    _RECEIVERS[gid] = state


async def _receiver_apply(
    engine: Any, gid: int, version: Version, pause_mode: Literal["abort", "keep"]
) -> float:
    """Wait until ``version`` (or a newer one) is staged here, then load it into the engine
    (paused meanwhile); the seconds the engine could not generate."""
    state = _RECEIVERS.get(gid)
    if state is None:
        raise WeightSyncError(f"weight sync group {gid} is not open in this rollout actor")
    while True:
        state.changed.clear()
        staged_now = state.buffer.pending_version
        if staged_now is not None and staged_now >= version:
            break
        if staged_now is None and state.latest >= version:
            return 0.0  # a newer apply loaded it already
        if state.serving.done():
            error = state.serving.exception() if not state.serving.cancelled() else None
            raise WeightSyncError(
                f"the weight receiver of group {gid} stopped before version {version} "
                f"arrived ({error!r})"
            ) from error
        await state.changed.wait()
    staged = state.buffer.take()
    assert staged is not None  # checked above, and nothing ran in between
    weights, got = staged
    t0 = time.perf_counter()
    paused = isinstance(engine, SupportsPause)
    if paused:
        await engine.pause(pause_mode)
    try:
        await engine.load_weights(weights, got)
    finally:
        if paused:
            await engine.resume()
    return time.perf_counter() - t0


async def _receiver_drop(engine: Any, gid: int) -> None:
    """Stop serving group ``gid`` without closing it: a rank of it died, and closing a group
    whose thread waits in a broadcast would block this actor until the group's timeout."""
    state = _RECEIVERS.pop(gid, None)
    if state is not None:
        state.receiver.close()
        state.serving.cancel()


async def _receiver_close(engine: Any, gid: int) -> None:
    state = _RECEIVERS.get(gid)
    await _receiver_drop(engine, gid)
    if state is not None:
        state.group.close()


# --------------------------------------------------------------------------------------------
# The driver's side
# --------------------------------------------------------------------------------------------
_group_ids = itertools.count(1)


class RayDirectWeightSync:
    """A staged weight update from a ``RayTrainEngine``'s actor straight into
    ``RayInferenceEngine``s' actors (see the module docstring). The interface of
    ``StagedUpdate`` the job uses: ``sync(buckets, version)`` (``buckets`` is not read: the
    trainer's actor exports its own weights), ``apply()``, ``pending_version``, ``engines``
    (set it to take engines out, or put a restarted one back: the group is rebuilt over them
    at the next sync; a member that restarted since it joined is never asked to apply)."""

    def __init__(
        self,
        trainer: RayTrainEngine,
        engines: Sequence[Any],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        pause_mode: Literal["abort", "keep"] = "keep",
        backend: str | None = None,
    ) -> None:
        self.trainer = trainer
        self._engines = [_unwrap(e) for e in engines]
        for e in self._engines:
            if not isinstance(e, RayInferenceEngine):
                raise WeightSyncError(
                    f"RayDirectWeightSync: {type(e).__name__} is not a RayInferenceEngine; "
                    "direct sync needs every rollout engine in a Ray actor"
                )
        self.bucket_bytes = bucket_bytes
        self.pause_mode = pause_mode
        self.backend = backend
        self._gid: int | None = None
        self._members: list[RayInferenceEngine] = []
        self._epochs: list[int] = []  # each member's ``restarts`` when it joined the group
        self._pending: Version | None = None
        self._transfer_s: dict[Version, float] = {}
        self._lock: asyncio.Lock | None = None
        self.groups_built = 0

    @property
    def engines(self) -> list[Any]:
        return list(self._engines)

    @engines.setter
    def engines(self, engines: Sequence[Any]) -> None:
        self._engines = [_unwrap(e) for e in engines]  # the group is rebuilt at the next sync

    @property
    def pending_version(self) -> Version | None:
        return self._pending

    async def sync(self, buckets: Any, version: Version) -> float:
        """Send ``version`` from the trainer's actor to every rollout actor's staging buffer;
        returns the seconds the send took (hidden from generation)."""
        aclose = getattr(buckets, "aclose", None)
        if aclose is not None:  # the driver's export is not needed: never started, closed
            await aclose()
        t0 = time.perf_counter()
        for attempt in (1, 2):
            await self._ensure_group()
            gid = self._gid
            send = asyncio.ensure_future(
                self.trainer.run(_sender_send, gid, version, self.bucket_bytes)
            )
            failpoint("sync.transfer")  # a crash in the middle of a sync (the driver's side)
            # a receiver that dies mid-sync leaves the sender's broadcast waiting for the
            # group's timeout (gloo does not notice): watch the members meanwhile
            watch = asyncio.ensure_future(self._first_lost(self._members))
            try:
                await asyncio.wait({send, watch}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                watch.cancel()
            error: BaseException | None = None
            if send.done():
                error = send.exception()
                if error is None:
                    break
                lost = await self._drop_lost()
            else:  # a member died: give up this group (its sender is stuck until timeout)
                send.cancel()
                await asyncio.gather(send, return_exceptions=True)
                dead = watch.result()
                self._engines = [e for e in self._engines if e not in dead]
                self._abandon_group()
                lost = True
                error = WeightSyncError(f"rollout actor(s) {[e.name for e in dead]} died")
            if attempt == 2 or not lost:
                raise WeightSyncError(
                    f"direct weight sync of version {version} from {self.trainer.name} "
                    f"failed: {error}"
                ) from error
        self._pending = version
        took = time.perf_counter() - t0
        self._transfer_s[version] = took
        return took

    async def apply(self) -> SyncTiming | None:
        """Load the newest staged version into every engine (each paused meanwhile, in its
        own actor); its timing, or None if nothing is staged."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            version = self._pending
            if version is None or self._gid is None:
                return None
            self._pending = None
            gid = self._gid
            t0 = time.perf_counter()
            live = [  # not one taken out, or restarted (its receiver is gone), since
                e
                for e, epoch in zip(self._members, self._epochs, strict=True)
                if e in self._engines and e.restarts == epoch
            ]
            await asyncio.gather(
                *(e.run(_receiver_apply, gid, version, self.pause_mode) for e in live)
            )
            swap = time.perf_counter() - t0
            transfer = self._transfer_s.pop(version, 0.0)
            self._transfer_s = {v: s for v, s in self._transfer_s.items() if v > version}
            return SyncTiming(version, transfer_s=transfer, swap_s=swap, exposed_s=swap)

    async def close(self) -> None:
        """Close the group in every actor (the actors stay)."""
        await self._close_group()

    # -- the group ---------------------------------------------------------------------------
    async def _ensure_group(self) -> None:
        restarted = any(
            e.restarts != epoch for e, epoch in zip(self._members, self._epochs, strict=True)
        )
        if self._gid is not None and self._members == self._engines and not restarted:
            return
        if self._gid is not None:  # members changed: close the group, or drop it if one died
            answers = await asyncio.gather(*(_alive(e) for e in self._members))
            if all(answers) and not restarted:
                await self._close_group()
            else:  # its close message would wait on the dead rank until the group's timeout
                self._abandon_group()
        await self._drop_lost()  # a dead member would stall the group's forming
        if not self._engines:
            raise WeightSyncError("RayDirectWeightSync: no rollout engine left to sync into")
        gid = next(_group_ids)
        members = list(self._engines)
        world = 1 + len(members)
        host, port = await self.trainer.run(_address)
        joins = [
            e.run(_receiver_open, gid, host, port, rank, world, self.backend)
            for rank, e in enumerate(members, 1)
        ]
        await asyncio.gather(
            self.trainer.run(_sender_open, gid, host, port, world, self.backend), *joins
        )
        self._gid, self._members = gid, members
        self._epochs = [e.restarts for e in members]
        self.groups_built += 1

    async def _close_group(self) -> None:
        gid, members = self._gid, self._members
        self._gid, self._members, self._epochs = None, [], []
        if gid is None:
            return
        calls = [self.trainer.run(_sender_close, gid)]
        calls += [e.run(_receiver_close, gid) for e in members if not e.closed]
        await asyncio.gather(*calls, return_exceptions=True)

    def _abandon_group(self) -> None:
        """Forget a group one of whose ranks died, closing it nowhere (a thread waiting in
        one of its broadcasts ends at the group's timeout; closing the group meanwhile would
        block that actor): the trainer and the live members only drop it."""
        gid, members, epochs = self._gid, self._members, self._epochs
        self._gid, self._members, self._epochs = None, [], []
        if gid is None:
            return
        background(self.trainer.run(_sender_forget, gid))
        for e, epoch in zip(members, epochs, strict=True):
            if e in self._engines and e.restarts == epoch:
                background(e.run(_receiver_drop, gid))

    async def _first_lost(self, members: Sequence[RayInferenceEngine]) -> list[Any]:
        """The members found dead, polled every ``WATCH_S`` (returns once one is)."""
        while True:
            await asyncio.sleep(WATCH_S)
            answers = await asyncio.gather(*(_alive(e) for e in members))
            dead = [e for e, ok in zip(members, answers, strict=True) if not ok]
            if dead:
                return dead

    async def _drop_lost(self) -> bool:
        """Take out the engines that are gone; whether any was. The job may take an engine
        out (``engines = ...``) while the actors are asked, so the answers are matched with
        the engines they were asked of, not with the list as it is afterwards."""
        asked = list(self._engines)
        answers = await asyncio.gather(*(_alive(e) for e in asked))
        dead = [e for e, ok in zip(asked, answers, strict=True) if not ok]
        if not dead:
            return False
        self._engines = [e for e in self._engines if e not in dead]
        return True


WATCH_S = 1.0
"""How often a sync in flight checks that its receivers are alive."""


async def _alive(engine: RayInferenceEngine) -> bool:
    """False once ``engine``'s actor is gone (an actor that is only slow counts as alive)."""
    try:
        await engine.refresh_version()
    except EngineLostError:
        return False
    except Exception:
        return True
    return True


def _unwrap(engine: Any) -> Any:
    """The engine behind the job's guarded weight-sync target (``.engine``), or itself."""
    return getattr(engine, "engine", engine)
