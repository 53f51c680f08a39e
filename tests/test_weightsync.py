"""WeightSync transports: phase order, staging, in-process, safetensors on disk, and the
bucketed broadcast: between two real processes over the default group (gloo), and its wire in
one process over a loopback group (byte exactness, in-place views, bad headers, the event loop
kept free). Real process groups and inference workers in other processes:
tests/test_weightsync_collective.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Coroutine, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncflow_core.contracts.errors import WeightSyncError
from asyncflow_core.contracts.protocols import SupportsLoadWeights, WeightBucket, WeightSync
from asyncflow_core.engines.process import free_port
from asyncflow_core.sync import transports
from asyncflow_core.sync.strategies import BlockingUpdate, StagedUpdate, SyncTiming
from asyncflow_core.sync.transports import (
    BroadcastGroup,
    DiskWeightSync,
    DistributedWeightReceiver,
    DistributedWeightSync,
    InProcessWeightSync,
    WeightSyncGroup,
    bucketize,
    read_weights,
)

ROOT = Path(__file__).resolve().parent.parent


class Recorder:
    """An inference-side target that records every load."""

    def __init__(self) -> None:
        self.loads: list[tuple[dict[str, torch.Tensor], int]] = []

    async def load_weights(self, weights: Sequence[tuple[str, torch.Tensor]], version: int) -> None:
        self.loads.append((dict(weights), version))


def model_weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("embed.weight", torch.randn(64, 16, generator=g)),
        ("layer.0.w", torch.randn(16, 16, generator=g).to(torch.bfloat16)),
        ("layer.0.b", torch.randn(16, generator=g)),
        ("rope.positions", torch.arange(32, dtype=torch.int64)),
        ("head.weight", torch.randn(16, 64, generator=g)),
    ]


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_bucketize_respects_the_byte_bound_and_order() -> None:
    weights = model_weights()
    buckets = bucketize(weights, bucket_bytes=4096)
    assert [n for b in buckets for n in b.names] == [n for n, _ in weights]
    for b in buckets:
        assert b.nbytes <= 4096 or len(b.names) == 1  # an oversized tensor travels alone
    assert len(bucketize(weights, 1 << 30)) == 1
    with pytest.raises(WeightSyncError, match="bucket_bytes must be > 0"):
        bucketize(weights, 0)


@pytest.mark.parametrize("make", ["inprocess", "disk"])
def test_phases_must_come_in_order(make: str, tmp_path: Path) -> None:
    target = Recorder()
    sync: WeightSync = (
        InProcessWeightSync([target]) if make == "inprocess" else DiskWeightSync(tmp_path, [target])
    )
    bucket = bucketize(model_weights(), 1 << 20)[0]

    async def go() -> None:
        with pytest.raises(WeightSyncError, match=r"start\(\) called out of order.*init\(\)"):
            await sync.start()
        await sync.init()
        with pytest.raises(WeightSyncError, match=r"update\(\) called out of order.*start\(\)"):
            await sync.update(bucket)
        with pytest.raises(WeightSyncError, match=r"init\(\) called out of order"):
            await sync.init()
        await sync.start()
        await sync.update(bucket)
        with pytest.raises(WeightSyncError, match=r"'embed\.weight' was sent twice"):
            await sync.update(bucket)
        await sync.finish(1)
        with pytest.raises(WeightSyncError, match=r"finish\(\) called out of order"):
            await sync.finish(2)

    run(go())
    assert [v for _, v in target.loads] == [1]


def test_in_process_stages_copies_and_loads_every_target_at_finish() -> None:
    a, b = Recorder(), Recorder()
    sync = InProcessWeightSync([a, b])
    weights = model_weights()

    async def go() -> None:
        await sync.init()
        await sync.start()
        for bucket in bucketize(weights, 2048):
            await sync.update(bucket)
        assert a.loads == []  # nothing applied before finish: never a mix of versions
        weights[0][1].add_(1.0)  # the trainer keeps stepping in place meanwhile
        await sync.finish(7)

    run(go())
    for target in (a, b):
        ((loaded, version),) = target.loads
        assert version == 7
        assert torch.equal(loaded["embed.weight"] + 1.0, weights[0][1])  # the staged copy
        assert loaded["layer.0.w"].dtype == torch.bfloat16


def test_disk_sync_writes_versions_atomically_and_reads_back_exactly(tmp_path: Path) -> None:
    target = Recorder()
    sync = DiskWeightSync(tmp_path / "w", [target], keep=2)
    weights = model_weights()

    async def one(version: int) -> None:
        await sync.start()
        for bucket in bucketize(weights, 2048):
            await sync.update(bucket)
        await sync.finish(version)

    async def go() -> None:
        await sync.init()
        for v in (1, 2, 3):
            await one(v)
        with pytest.raises(WeightSyncError, match="already exists"):
            await one(3)

    run(go())
    root = tmp_path / "w"
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "v00000002", "v00000003"]
    got, version = read_weights(root)
    assert version == 3
    for (name, want), (got_name, have) in zip(weights, got, strict=True):
        assert name == got_name and have.dtype == want.dtype
        assert have.view(torch.uint8).tolist() == want.view(torch.uint8).tolist()
    assert [v for _, v in target.loads] == [1, 2, 3]
    with pytest.raises(WeightSyncError, match=r"manifest\.json is missing"):
        read_weights(tmp_path)


def test_distributed_sync_refuses_an_uninitialised_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    # another test of this session (an in-process DeepSpeed engine) may have initialised it
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(WeightSyncError, match="not initialised"):
        run(DistributedWeightSync().init())


WORKER = textwrap.dedent(
    """
    import asyncio, os, sys
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from asyncflow_core.sync.transports import (
        DistributedWeightReceiver, DistributedWeightSync, bucketize, default_backend,
    )

    rank = int(os.environ["RANK"])
    out = sys.argv[1]
    dist.init_process_group(default_backend(), init_method="env://")

    def weights(step):
        g = torch.Generator().manual_seed(step)
        return [
            ("embed.weight", torch.randn(300, 64, generator=g)),
            ("layer.0.w", torch.randn(64, 64, generator=g).to(torch.bfloat16)),
            ("layer.0.b", torch.randn(64, generator=g)),
            ("rope.positions", torch.arange(128, dtype=torch.int64) * step),
            ("head.weight", torch.randn(64, 300, generator=g)),
        ]

    class Target:
        def __init__(self):
            self.loads = []
        async def load_weights(self, w, version):
            self.loads.append((dict(w), version))

    async def main():
        if rank == 0:
            sync = DistributedWeightSync(src=0)
            await sync.init()
            for step in (1, 2):
                w = weights(step)
                save_file(dict(w), f"{out}/sent-{step}.safetensors")
                await sync.start()
                for bucket in bucketize(w, 40_000):
                    await sync.update(bucket)
                await sync.finish(step)
            await sync.close()
        else:
            target = Target()
            versions = await DistributedWeightReceiver(target, src=0).serve()
            assert versions == [1, 2], versions
            for loaded, version in target.loads:
                save_file(loaded, f"{out}/received-{version}.safetensors")

    asyncio.run(main())
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_bucketed_broadcast_between_two_processes_is_byte_exact(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ, "RANK": str(rank), "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
        }  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(tmp_path)],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=120)[0])
        finally:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    for step in (1, 2):
        sent = load_file(str(tmp_path / f"sent-{step}.safetensors"))
        received = load_file(str(tmp_path / f"received-{step}.safetensors"))
        assert sorted(sent) == sorted(received)
        for name, tensor in sent.items():
            assert received[name].dtype == tensor.dtype and received[name].shape == tensor.shape
            assert torch.equal(received[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_transports_satisfy_the_protocol(tmp_path: Path) -> None:
    assert isinstance(InProcessWeightSync([]), WeightSync)
    assert isinstance(DiskWeightSync(tmp_path), WeightSync)
    assert isinstance(DistributedWeightSync(), WeightSync)
    assert isinstance(Recorder(), SupportsLoadWeights)
    assert isinstance(bucketize(model_weights(), 10)[0], WeightBucket)


# --- strategies ----------------------------------------------------------------------------
class PausableEngine:
    """A stand-in for an inference engine's control surface (the reference engine implements
    the same abilities): it 'generates' a token per tick unless paused, and records loads."""

    def __init__(self) -> None:
        self.paused = False
        self.pauses = 0
        self.tokens = 0
        self.version = 0
        self.loads: list[int] = []

    async def pause(self, mode: str = "abort") -> None:
        self.paused = True
        self.pauses += 1

    async def resume(self) -> None:
        self.paused = False

    async def load_weights(self, weights: Sequence[tuple[str, torch.Tensor]], version: int) -> None:
        assert self.paused, "weights must only be swapped while paused"
        self.version = version
        self.loads.append(version)

    async def generate_forever(self) -> None:
        while True:
            if not self.paused:
                self.tokens += 1
            await asyncio.sleep(0.001)


async def slow_buckets(delay: float = 0.02) -> AsyncIterator[WeightBucket]:
    for bucket in bucketize(model_weights(), 1024):
        await asyncio.sleep(delay)  # a slow link
        yield bucket


def test_staged_update_hides_the_transfer_and_exposes_only_the_swap() -> None:
    engine = PausableEngine()
    staged = StagedUpdate([engine])

    async def go() -> SyncTiming | None:
        gen = asyncio.create_task(engine.generate_forever())
        before = engine.tokens
        transfer = await staged.sync(slow_buckets(), version=1)
        assert engine.pauses == 0 and engine.version == 0  # generation went on, old weights
        assert engine.tokens - before > 20  # ~transfer_s / 1 ms ticks of generation
        assert staged.pending_version == 1
        timing = await staged.apply()
        assert await staged.apply() is None  # nothing staged any more
        gen.cancel()
        assert transfer > 0.05
        return timing

    timing = asyncio.run(go())
    assert timing is not None and timing.version == 1
    assert engine.loads == [1] and engine.pauses == 1 and not engine.paused
    assert timing.exposed_s == timing.swap_s < timing.transfer_s
    assert timing.hidden_s == pytest.approx(timing.transfer_s)


def test_blocking_update_pauses_generation_for_the_whole_transfer() -> None:
    engine = PausableEngine()
    blocking = BlockingUpdate([engine])

    async def go() -> SyncTiming:
        gen = asyncio.create_task(engine.generate_forever())
        await asyncio.sleep(0.01)
        before = engine.tokens
        timing = await blocking.sync(slow_buckets(), version=1)
        during = engine.tokens - before
        gen.cancel()
        assert during <= 1  # at most the tick already in flight when the pause came
        return timing

    timing = asyncio.run(go())
    assert engine.loads == [1] and engine.pauses == 1 and not engine.paused
    assert timing.exposed_s == timing.transfer_s > 0.05 and timing.hidden_s == 0.0


def test_staged_update_keeps_only_the_newest_untaken_version() -> None:
    engine = PausableEngine()
    staged = StagedUpdate([engine])

    async def go() -> None:
        await staged.sync(bucketize(model_weights(), 1 << 20), version=1)
        await staged.sync(bucketize(model_weights(), 1 << 20), version=2)
        timing = await staged.apply()
        assert timing is not None and timing.version == 2

    asyncio.run(go())
    assert engine.loads == [2]


class SlowPause(PausableEngine):
    """Its ``pause`` marks it paused, then waits for the step in progress to end (as the
    reference and Hugging Face engines do), announcing that it got there."""

    def __init__(self) -> None:
        super().__init__()
        self.in_pause = asyncio.Event()
        self.step_done = asyncio.Event()

    async def pause(self, mode: str = "abort") -> None:
        await super().pause(mode)
        self.in_pause.set()
        await self.step_done.wait()


@pytest.mark.parametrize("strategy", ["staged", "blocking"])
def test_a_swap_cancelled_while_pausing_leaves_no_engine_paused(strategy: str) -> None:
    """The job stopping mid-swap cancels the rollout worker inside ``pause``: every engine is
    resumed all the same (an engine left paused made the job's final evaluation wait forever,
    seen as a hang in CI runs under load)."""
    engine = SlowPause()

    async def go() -> None:
        if strategy == "staged":
            staged = StagedUpdate([engine])
            await staged.sync(bucketize(model_weights(), 1 << 20), version=1)
            swap = asyncio.create_task(staged.apply())
        else:
            swap = asyncio.create_task(
                BlockingUpdate([engine]).sync(bucketize(model_weights(), 1 << 20), version=1)
            )
        await engine.in_pause.wait()
        assert engine.paused
        swap.cancel()
        with pytest.raises(asyncio.CancelledError):
            await swap

    asyncio.run(go())
    assert engine.pauses == 1 and not engine.paused and engine.loads == []


class GatedEngine(PausableEngine):
    """Its ``load_weights`` announces itself and waits for the test to release it."""

    def __init__(self, versions: Sequence[int]) -> None:
        super().__init__()
        self.entered = {v: asyncio.Event() for v in versions}
        self.release = {v: asyncio.Event() for v in versions}
        self.loading = 0
        self.overlapped = False

    async def load_weights(self, weights: Sequence[tuple[str, torch.Tensor]], version: int) -> None:
        assert self.paused, "weights must only be swapped while paused"
        self.loading += 1
        self.overlapped |= self.loading > 1
        self.entered[version].set()
        await self.release[version].wait()
        assert self.paused, "the engine was resumed while a swap was loading"
        self.version = version
        self.loads.append(version)
        self.loading -= 1


def test_staged_swaps_at_concurrent_safe_points_take_turns() -> None:
    """Two rollout groups reach a safe point while a swap is loading (the first took v1,
    then v2 was staged): the second swap waits for the first, so the engine loads v1 then v2,
    never two at once, and is not resumed under a loading swap (a regression seen as
    'after load_weights(version=3) its weight_version is 4' under load)."""
    engine = GatedEngine([1, 2])
    staged = StagedUpdate([engine])

    async def go() -> None:
        await staged.sync(bucketize(model_weights(), 1 << 20), version=1)
        first = asyncio.create_task(staged.apply())
        await engine.entered[1].wait()
        await staged.sync(bucketize(model_weights(), 1 << 20), version=2)
        second = asyncio.create_task(staged.apply())
        engine.release[2].set()  # a second swap that overtook the first would finish now
        for _ in range(50):  # event-loop steps, not time: let the second swap go its way
            await asyncio.sleep(0)
        assert not engine.entered[2].is_set(), "the second swap loaded during the first"
        engine.release[1].set()
        timings = await asyncio.gather(first, second)
        assert [t.version for t in timings if t is not None] == [1, 2]

    asyncio.run(go())
    assert engine.loads == [1, 2] and engine.version == 2
    assert not engine.overlapped and not engine.paused


# --- the collective transport's wire, in one process ---------------------------------------
class Loopback:
    """A ``BroadcastGroup`` of two ranks inside one process: what rank ``src`` broadcasts is
    queued, and the other rank's next broadcast takes it (a wire to inspect and to forge).
    ``delay_s`` makes every broadcast block that long, like a slow link."""

    def __init__(self, wire: deque[torch.Tensor], rank: int, delay_s: float = 0.0) -> None:
        self.wire, self._rank, self.delay_s = wire, rank, delay_s
        self.sent: list[torch.Tensor] = []  # what this rank broadcast, uncopied

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return 2

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def connect(self) -> None:
        return None

    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout_s: float | None = None) -> None:
        time.sleep(self.delay_s)
        if src == self._rank:
            self.sent.append(tensor)
            self.wire.append(tensor.clone())
        else:
            sent = self.wire.popleft()
            assert sent.shape == tensor.shape, (sent.shape, tensor.shape)
            tensor.copy_(sent)


def loopback(delay_s: float = 0.0) -> tuple[Loopback, Loopback]:
    wire: deque[torch.Tensor] = deque()
    return Loopback(wire, 0, delay_s), Loopback(wire, 1, delay_s)


def odd_weights(step: int) -> list[tuple[str, torch.Tensor]]:
    """Every layout the wire must carry: dtypes of 1-8 bytes, a strided view, 0-dim, empty."""
    g = torch.Generator().manual_seed(step)
    return [
        ("embed.weight", torch.randn(40, 16, generator=g)),
        ("layer.0.w", torch.randn(16, 16, generator=g).to(torch.bfloat16)),
        ("layer.0.w_t", torch.randn(16, 5, generator=g).t()),  # not contiguous
        ("layer.0.scale", torch.tensor(1.5 * step, dtype=torch.float64)),  # 0-dim
        ("layer.0.empty", torch.zeros(0, 4)),
        ("mask", torch.arange(7) % (step + 1) == 0),  # bool, 7 bytes: pads the next one
        ("rope.positions", torch.arange(9, dtype=torch.int64) * step),
        ("head.weight", torch.randn(16, 40, generator=g)),
    ]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.contiguous().view(-1).view(torch.uint8).tolist()
        == b.contiguous().view(-1).view(torch.uint8).tolist()
    )


async def send_syncs(
    sync: DistributedWeightSync, syncs: Sequence[tuple[int, list[WeightBucket]]]
) -> None:
    await sync.init()
    for version, buckets in syncs:
        await sync.start()
        for bucket in buckets:
            await sync.update(bucket)
        await sync.finish(version)
    await sync.close()


def test_the_wire_is_byte_exact_and_receivers_view_one_buffer_per_bucket() -> None:
    send_group, recv_group = loopback()
    syncs = [(v, bucketize(odd_weights(v), 1200, pack=pack)) for v, pack in ((3, False), (4, True))]
    run(send_syncs(DistributedWeightSync(group=send_group), syncs))
    target = Recorder()
    receiver = DistributedWeightReceiver(target, group=recv_group)
    assert run(receiver.serve()) == [3, 4]
    assert not recv_group.wire  # every broadcast was taken, in order
    for (version, buckets), (loaded, got_version) in zip(syncs, target.loads, strict=True):
        assert got_version == version
        assert list(loaded) == [n for n, _ in odd_weights(version)]
        for bucket in buckets:
            storages = {loaded[n].untyped_storage().data_ptr() for n in bucket.names}
            assert len(storages) == 1  # one receive buffer per bucket, viewed in place
            for name, tensor in bucket:
                assert same_bytes(loaded[name], tensor), name
    # pre-packed buckets (bucketize(pack=True)) went out from their own memory, not a copy
    payloads = {t.untyped_storage().data_ptr() for t in send_group.sent}
    for bucket in syncs[1][1]:
        assert bucket.tensors[0].untyped_storage().data_ptr() in payloads


def test_bucketize_pack_makes_a_snapshot_laid_out_as_the_wire() -> None:
    weights = odd_weights(1)
    buckets = bucketize(weights, 1200, pack=True)
    assert [b.names for b in buckets] == [b.names for b in bucketize(weights, 1200)]
    for bucket in buckets:
        assert len({t.untyped_storage().data_ptr() for t in bucket.tensors}) == 1
    before = dict(buckets[0])["embed.weight"].clone()
    weights[0][1].add_(1.0)  # the trainer steps in place: the packed snapshot does not move
    assert torch.equal(dict(buckets[0])["embed.weight"], before)
    for (name, want), (got_name, have) in zip(
        odd_weights(1), [p for b in buckets for p in b], strict=True
    ):
        assert name == got_name and same_bytes(have, want)


def test_a_packed_bucket_is_copied_before_update_returns() -> None:
    """The caller may change its tensors in place as soon as update() returns."""
    send_group, recv_group = loopback()
    weights = odd_weights(1)
    sent = [(n, t.clone()) for n, t in weights]

    async def go() -> None:
        sync = DistributedWeightSync(group=send_group)
        await sync.init()
        await sync.start()
        for bucket in bucketize(weights, 1200):
            await sync.update(bucket)
            for t in bucket.tensors:
                t.zero_() if t.dtype != torch.bool else t.fill_(True)
        await sync.finish(1)
        await sync.close()

    run(go())
    target = Recorder()
    run(DistributedWeightReceiver(target, group=recv_group).receive_one())
    ((loaded, _),) = target.loads
    for name, tensor in sent:
        assert same_bytes(loaded[name], tensor), name


def test_reuse_buffers_receives_every_sync_into_the_same_memory() -> None:
    send_group, recv_group = loopback()
    syncs = [(v, bucketize(odd_weights(v), 1200)) for v in (1, 2)]
    run(send_syncs(DistributedWeightSync(group=send_group), syncs))
    ptrs: list[list[int]] = []

    class Copier:  # done with the tensors when load_weights returns, as reuse_buffers asks
        def __init__(self) -> None:
            self.loads: list[dict[str, torch.Tensor]] = []

        async def load_weights(self, weights: Sequence[tuple[str, torch.Tensor]], v: int) -> None:
            ptrs.append([t.data_ptr() for _, t in weights])
            self.loads.append({n: t.clone() for n, t in weights})

    target = Copier()
    assert run(DistributedWeightReceiver(target, group=recv_group, reuse_buffers=True).serve())
    assert ptrs[0] == ptrs[1]
    for (version, _), loaded in zip(syncs, target.loads, strict=True):
        for name, tensor in odd_weights(version):
            assert same_bytes(loaded[name], tensor), name


class GatedLoopback(Loopback):
    """A ``Loopback`` sender whose bucket-sized broadcasts (anything longer than a header slot)
    block until ``gate`` opens; ``entered`` is set once one is blocked there."""

    def __init__(self, wire: deque[torch.Tensor]) -> None:
        super().__init__(wire, 0)
        self.gate, self.entered = threading.Event(), threading.Event()

    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout_s: float | None = None) -> None:
        if tensor.numel() > transports._HEADER_SLOT:
            self.entered.set()
            assert self.gate.wait(60), "the test never opened the gate"
        super().broadcast(tensor, src, timeout_s=timeout_s)


def test_a_snapshot_bucket_is_handed_over_while_its_bytes_are_sent_and_live_memory_is_not() -> None:
    """``bucketize(pack=True)`` makes snapshot buckets: ``update`` returns while their bytes
    are still on the wire (the next header can follow). A bucket of the caller's live tensor,
    sent from its own memory, holds ``update`` until every byte is out."""
    wire: deque[torch.Tensor] = deque()
    group = GatedLoopback(wire)
    live = torch.arange(4096, dtype=torch.float32)
    (snapshot,) = bucketize([("a", live.clone())], 1 << 20, pack=True)
    assert snapshot.snapshot and not WeightBucket(("b",), (live,)).snapshot

    async def go() -> None:
        sync = DistributedWeightSync(group=group)
        await sync.init()
        await sync.start()
        await sync.update(snapshot)  # returns with its bytes blocked at the gate
        assert not group.gate.is_set()
        await asyncio.to_thread(group.entered.wait, 60)
        live_update = asyncio.create_task(sync.update(WeightBucket(("b",), (live,))))
        for _ in range(50):  # event-loop steps: the live bucket cannot be out yet
            await asyncio.sleep(0)
        assert not live_update.done(), "update returned while its live tensor was on the wire"
        group.gate.set()
        await live_update
        await sync.finish(1)
        await sync.close()

    run(go())
    target = Recorder()
    receiver = DistributedWeightReceiver(target, group=Loopback(wire, 1))
    assert run(receiver.receive_one()) == 1
    loaded = dict(target.loads[0][0])
    assert torch.equal(loaded["a"], live) and torch.equal(loaded["b"], live)


def test_collectives_run_off_the_event_loop() -> None:
    """Every broadcast blocks 50 ms here, on both sides; the loop keeps ticking meanwhile."""
    send_group, recv_group = loopback(delay_s=0.05)
    buckets = bucketize(odd_weights(1), 1200)

    async def ticking(coro: Coroutine[Any, Any, Any]) -> tuple[Any, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        ticker = asyncio.create_task(tick())
        try:
            return await coro, ticks
        finally:
            ticker.cancel()

    _, ticks = run(ticking(send_syncs(DistributedWeightSync(group=send_group), [(1, buckets)])))
    broadcasts = len(send_group.sent)  # finish, close headers + 2 per bucket (start folded)
    assert broadcasts == 2 + 2 * len(buckets)
    assert ticks > broadcasts * 2  # ~10 ticks per 50 ms broadcast; ~0 if the loop were blocked
    target = Recorder()
    versions, ticks = run(ticking(DistributedWeightReceiver(target, group=recv_group).serve()))
    assert versions == [1] and ticks > broadcasts * 2


def frame(header: dict[str, Any] | bytes) -> torch.Tensor:
    """A header as it travels: its length (8 bytes, little-endian), then its JSON, in one slot."""
    data = header if isinstance(header, bytes) else json.dumps(header).encode()
    framed = (len(data).to_bytes(8, "little") + data).ljust(transports._HEADER_SLOT, b"\0")
    return torch.frombuffer(bytearray(framed), dtype=torch.uint8)


def bucket_header(**changes: Any) -> dict[str, Any]:
    header = {"op": "bucket", "names": ["w"], "dtypes": ["torch.float32"], "shapes": [[2]]}
    return {**header, "nbytes": 8, **changes}


START = frame({"op": "start"})
BAD_WIRES = {  # what the receiver reads -> what its error says
    "dtype": ([START, frame(bucket_header(dtypes=["torch.float33"]))], "dtype 'torch.float33'"),
    "nbytes": ([START, frame(bucket_header(nbytes=9))], "says 9 bytes, its tensors take 8"),
    "shape": ([START, frame(bucket_header(shapes=[[-2]]))], r"shape \[-2\] of 'w' is not"),
    "lengths": ([START, frame(bucket_header(dtypes=[]))], "1 names, 0 dtypes and 1 shapes"),
    "names": ([START, frame(bucket_header(names=None))], "needs the lists"),
    "duplicate": (
        [START, frame(bucket_header()), torch.zeros(8, dtype=torch.uint8), frame(bucket_header())],
        "got parameter 'w' twice",
    ),
    "json": ([frame(b"{not json")], "not JSON"),
    "op": ([frame({"op": "bucket!"})], "expected an object with 'op'"),
    "no-start": ([frame(bucket_header())], "expected a sync to start, got 'bucket'"),
    "version": ([START, frame({"op": "finish", "version": "v1"})], "version 'v1'"),
    "size": ([torch.full((transports._HEADER_SLOT,), 255, dtype=torch.uint8)], "header size of"),
}


@pytest.mark.parametrize("case", list(BAD_WIRES))
def test_the_receiver_rejects_a_bad_header_and_loads_nothing(case: str) -> None:
    wire, message = BAD_WIRES[case]
    target = Recorder()
    receiver = DistributedWeightReceiver(target, group=Loopback(deque(wire), rank=1))
    with pytest.raises(WeightSyncError, match=message):
        run(receiver.receive_one())
    assert target.loads == []
    with pytest.raises(WeightSyncError, match="out of step"):  # it never reads past the error
        run(receiver.receive_one())


def test_a_header_longer_than_its_slot_takes_a_second_broadcast() -> None:
    send_group, recv_group = loopback()
    names = [f"layers.{i}.a_rather_long_parameter_name.weight" for i in range(200)]
    weights = [(n, torch.full((3,), float(i))) for i, n in enumerate(names)]
    run(send_syncs(DistributedWeightSync(group=send_group), [(1, bucketize(weights, 1 << 20))]))
    target = Recorder()
    assert run(DistributedWeightReceiver(target, group=recv_group).serve()) == [1]
    assert all(torch.equal(target.loads[0][0][n], t) for n, t in weights)


def test_the_sender_checks_its_calls_and_a_rejected_one_changes_nothing() -> None:
    send_group, _ = loopback()
    sync = DistributedWeightSync(group=send_group)
    bucket = bucketize(odd_weights(1), 1 << 20)[0]

    async def go() -> None:
        with pytest.raises(WeightSyncError, match=r"start\(\) called out of order.*init\(\)"):
            await sync.start()
        assert send_group.sent == []  # nothing went out
        await sync.init()
        await sync.start()
        with pytest.raises(WeightSyncError, match="takes a WeightBucket"):
            await sync.update(("w", torch.zeros(2)))  # type: ignore[arg-type]
        meta = WeightBucket(("m",), (torch.empty(2, device="meta"),))
        with pytest.raises(WeightSyncError, match="'m' must be a dense tensor with values"):
            await sync.update(meta)
        twice = WeightBucket(("a", "a"), (torch.zeros(1), torch.zeros(1)))
        with pytest.raises(WeightSyncError, match="'a' was sent twice"):
            await sync.update(twice)
        await sync.update(bucket)
        with pytest.raises(WeightSyncError, match=r"'embed\.weight' was sent twice"):
            await sync.update(bucket)
        with pytest.raises(
            WeightSyncError, match=r"version must be an int in \[0, 2\*\*63\), got '2'"
        ):
            await sync.finish("2")  # type: ignore[arg-type]
        await sync.finish(2)  # the rejected finish left the sync open
        assert len(send_group.sent) == 3  # the bucket's header (the start), its bytes, finish
        await sync.close()
        with pytest.raises(WeightSyncError, match="closed; build a new one"):
            await sync.start()

    run(go())


def test_ranks_and_groups_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    # another test of this session (an in-process DeepSpeed engine) may have initialised it
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    send_group, recv_group = loopback()
    with pytest.raises(WeightSyncError, match="runs on the sending rank 1"):
        run(DistributedWeightSync(src=1, group=send_group).init())
    with pytest.raises(WeightSyncError, match="not on the sending rank 0"):
        run(DistributedWeightReceiver(Recorder(), group=send_group).receive_one())
    with pytest.raises(WeightSyncError, match=r"torch\.distributed is not initialised"):
        run(DistributedWeightReceiver(Recorder()).receive_one())
    with pytest.raises(WeightSyncError, match="idle_timeout_s needs a WeightSyncGroup"):
        DistributedWeightReceiver(Recorder(), idle_timeout_s=1.0)
    with pytest.raises(WeightSyncError, match="idle_timeout_s must be a number > 0"):
        DistributedWeightReceiver(Recorder(), group=recv_group, idle_timeout_s=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"host": ""}, "host must be a non-empty address"),
        ({"port": 0}, r"port must be an int in \[1, 65535\], got 0"),
        ({"port": "29500"}, "port must be an int"),
        ({"world_size": 1}, "world_size must be an int >= 2"),
        ({"rank": 2}, r"rank must be an int in \[0, 1\]"),
        ({"rank": True}, "rank must be an int"),
        ({"timeout_s": 0}, "timeout_s must be a number > 0"),
        ({"backend": "mpi"}, "backend 'mpi' cannot run here: no platform here uses the "),
        ({"backend": ""}, "backend must be a collective backend name"),
    ],
)
def test_weight_sync_group_checks_its_arguments(kwargs: dict[str, Any], message: str) -> None:
    args = {"host": "127.0.0.1", "port": 29500, "rank": 0, "world_size": 2, **kwargs}
    backend = args.pop("backend", None)
    timeout_s = args.pop("timeout_s", 5.0)
    with pytest.raises(WeightSyncError, match=message):
        WeightSyncGroup(**args, backend=backend, timeout_s=timeout_s)


def test_weight_sync_group_refuses_to_broadcast_before_connect_or_after_close() -> None:
    group = WeightSyncGroup("127.0.0.1", 29500, 0, 2, timeout_s=5)
    assert isinstance(group, BroadcastGroup) and group.device == torch.device("cpu")
    with pytest.raises(WeightSyncError, match=r"127.0.0.1:29500 .*not connected; call connect"):
        group.broadcast(torch.zeros(1), 0)
    group.close()
    with pytest.raises(WeightSyncError, match="closed; build a new one"):
        group.connect()
    if not torch.cuda.is_available():
        with pytest.raises(WeightSyncError, match="'nccl' cannot run here: platform 'cuda'"):
            WeightSyncGroup("127.0.0.1", 29500, 0, 2, backend="nccl")
    with pytest.raises(WeightSyncError, match=r"'hccl' cannot run here: .*asyncflow\[ascend\]"):
        WeightSyncGroup("127.0.0.1", 29500, 0, 2, backend="hccl")


def test_a_packed_bucket_pickles_its_memory_once_and_round_trips() -> None:
    """A trainer process sends its buckets pickled: a packed bucket's tensors view one buffer,
    which must travel once (the standard pickler would send it once per tensor)."""
    import pickle

    weights = odd_weights(3)
    (packed,) = bucketize(weights, 1 << 20, pack=True)
    (plain,) = bucketize(weights, 1 << 20)
    for bucket in (packed, plain):
        back = pickle.loads(pickle.dumps(bucket))
        assert back.names == bucket.names and back.snapshot == bucket.snapshot
        for (_, got), (_, want) in zip(back, weights, strict=True):
            assert same_bytes(got, want) and got.shape == want.shape
    assert len(pickle.dumps(packed)) < 2 * packed.nbytes + 8192
    shared = torch.randn(64, 32)
    bucket = WeightBucket(("w", "w_t", "row"), (shared, shared.t(), shared[3]))
    back = pickle.loads(pickle.dumps(bucket))
    assert [t.stride() for t in back.tensors] == [t.stride() for t in bucket.tensors]
    assert all(torch.equal(a, b) for a, b in zip(back.tensors, bucket.tensors, strict=True))
    assert len(pickle.dumps(bucket)) < 2 * shared.numel() * 4 + 8192


def test_a_bucket_of_other_objects_pickles_as_it_is() -> None:
    """Transports may carry a bucket whose items stand in for tensors (the Ray adapter's wire
    tensors): it pickles field by field."""
    import pickle

    bucket = WeightBucket(("a", "b"), ("not", "tensors"))  # type: ignore[arg-type]
    assert pickle.loads(pickle.dumps(bucket)) == bucket
