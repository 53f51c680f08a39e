"""WeightSync transports: phase order, staging, in-process, safetensors on disk, and a
bucketed torch.distributed broadcast between two real processes (gloo)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import torch

from asyncflow_core.errors import WeightSyncError
from asyncflow_core.protocols import SupportsLoadWeights, WeightBucket, WeightSync
from asyncflow_core.weightsync import (
    BlockingUpdate,
    DiskWeightSync,
    DistributedWeightSync,
    InProcessWeightSync,
    StagedUpdate,
    SyncTiming,
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


def test_distributed_sync_refuses_an_uninitialised_group() -> None:
    with pytest.raises(WeightSyncError, match="not initialised"):
        run(DistributedWeightSync().init())


WORKER = textwrap.dedent(
    """
    import asyncio, os, sys
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from asyncflow_core.weightsync import (
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_bucketed_broadcast_between_two_processes_is_byte_exact(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = str(_free_port())
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
