"""The collective WeightSync's overlapped wire over a real gloo ``WeightSyncGroup``: the sender
queues each bucket's header and bytes before it waits on either, and the receiver queues the
next header behind a bucket's bytes and views the bucket while they come. Whatever the mix of
buckets (pre-packed snapshots, buckets packed on send, a header too long for its slot, empty
and 0-dim tensors), every sync arrives byte-exact, in order, into fresh or reused buffers.

Two ranks in one process (the receiver on a thread of its own); every wait has a timeout."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from asyncflow_core.contracts.protocols import WeightBucket
from asyncflow_core.engines.process import free_port
from asyncflow_core.sync.transports import (
    _HEADER_SLOT,
    DistributedWeightReceiver,
    DistributedWeightSync,
    WeightSyncGroup,
    bucketize,
)

HOST = "127.0.0.1"
WAIT_S = 120.0

pytestmark = pytest.mark.slow


def weights(step: int) -> list[tuple[str, torch.Tensor]]:
    """Big and small tensors of several dtypes, a 0-dim one, an empty one, and (in the middle)
    names long enough that their bucket's header outgrows one slot."""
    g = torch.Generator().manual_seed(step)
    long_names = [(f"block.{i}." + "x" * 200, torch.randn(3, generator=g)) for i in range(30)]
    return [
        ("embed.weight", torch.randn(256, 64, generator=g)),
        ("layer.0.w", torch.randn(64, 64, generator=g).to(torch.bfloat16)),
        ("layer.0.scale", torch.tensor(0.5 * step, dtype=torch.float64)),
        ("layer.0.empty", torch.zeros(0, 4)),
        ("mask", torch.arange(7) % (step + 1) == 0),
        *long_names,
        ("rope.positions", torch.arange(9, dtype=torch.int64) * step),
        ("head.weight", torch.randn(64, 256, generator=g)),
    ]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.contiguous().view(-1).view(torch.uint8).tolist()
        == b.contiguous().view(-1).view(torch.uint8).tolist()
    )


@pytest.mark.parametrize("reuse_buffers", [False, True])
def test_overlapped_syncs_arrive_byte_exact_whatever_the_buckets(reuse_buffers: bool) -> None:
    # (version, buckets): snapshots, then buckets packed on send, then a sync of one bucket
    plan: list[tuple[int, list[WeightBucket]]] = [
        (1, bucketize(weights(1), 16 << 10, pack=True)),
        (2, bucketize(weights(2), 16 << 10)),
        (3, bucketize(weights(3), 1 << 30, pack=True)),
    ]
    longest = max(len(" ".join(b.names)) for _, buckets in plan for b in buckets)
    assert longest > _HEADER_SLOT  # one header takes a second broadcast
    assert all(len(buckets) >= 3 for _, buckets in plan[:2])
    expected = {v: [(n, t.clone()) for b in buckets for n, t in b] for v, buckets in plan}
    port = free_port()
    loads: list[tuple[int, list[tuple[str, torch.Tensor]]]] = []
    outcome: dict[str, Any] = {}

    class Target:
        async def load_weights(self, w: Sequence[tuple[str, torch.Tensor]], v: int) -> None:
            loads.append((v, [(n, t.clone()) for n, t in w]))

    def receiver_side() -> None:
        async def main() -> None:
            with WeightSyncGroup(HOST, port, 1, 2, timeout_s=WAIT_S) as group:
                receiver = DistributedWeightReceiver(
                    Target(), group=group, reuse_buffers=reuse_buffers
                )
                outcome["versions"] = await receiver.serve()
                receiver.close()

        try:
            asyncio.run(main())
        except BaseException as exc:  # reported by the assertions below
            outcome["error"] = exc

    thread = threading.Thread(target=receiver_side, daemon=True)
    thread.start()

    async def sender_side() -> None:
        with WeightSyncGroup(HOST, port, 0, 2, timeout_s=WAIT_S) as group:
            sync = DistributedWeightSync(group=group)
            await sync.init()
            for version, buckets in plan:
                await sync.start()
                for bucket in buckets:
                    await sync.update(bucket)
                await sync.finish(version)
            await sync.close()
            await asyncio.to_thread(thread.join, WAIT_S)

    asyncio.run(sender_side())
    assert not thread.is_alive()
    assert "error" not in outcome, outcome.get("error")
    assert outcome["versions"] == [1, 2, 3]
    assert [v for v, _ in loads] == [1, 2, 3]
    for version, loaded in loads:
        want = expected[version]
        assert [n for n, _ in loaded] == [n for n, _ in want]
        for (name, have), (_, sent) in zip(loaded, want, strict=True):
            assert same_bytes(have, sent), (version, name)
