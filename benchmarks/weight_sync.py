"""Weight-sync benchmark: the bucketed collective sync between two processes against one flat
broadcast of the same bytes, and the staged update's exposed time against the blocking one's.

Two sections, each interleaving its candidates over ``--repeat`` rounds after one warm-up
round (the order alternates between rounds) and reporting the median with min-max (see
/work/shared/BENCHMARKING.md):

1. **bandwidth** — this process is the trainer's sender, a spawned child the receiver. The
   model is a ``TransformerLM`` (default ``d_model=512``, 16 layers, vocabulary 4096: 54.6 M
   fp32 parameters, 208 MiB in 181 tensors). Each transfer is timed on the sender from
   "receiver ready" to "receiver has every byte" (a one-element broadcast back each time):

   * ``flat`` — the baseline: one ``torch.distributed.broadcast`` (default group, gloo) of all
     the model's bytes, already in one contiguous buffer, into a receive buffer allocated once
     and reused (the plain library call at its best);
   * ``bucketed`` — the candidate: ``DistributedWeightSync`` over a ``WeightSyncGroup`` (its own
     process group, beside the default one) sending ``bucketize(state_dict, --bucket-mb,
     pack=True)`` buckets (the bytes already laid out, as the flat baseline's are) into a
     ``DistributedWeightReceiver(reuse_buffers=True)``;
   * ``bucketed_pack`` — the same from the ``state_dict``'s own tensors, packed on send;
   * ``wire_raw`` — the floor of the bucketed wire: the same broadcasts as ``bucketed`` (per
     bucket a header slot queued with the bucket's bytes, then the finish slot), from the
     same pre-packed buffers into receive buffers allocated once, as plain
     ``torch.distributed.broadcast(async_op=True)`` calls on the default group, with none of
     the transport's Python (no JSON, checks, threads or views);
   * ``bucketed_fresh`` / ``flat_fresh`` — the receiver takes fresh memory every time (what a
     receiver whose target keeps the tensors must do); context only.

   ``X_vs_flat`` = flat seconds / X seconds, paired per round. The receiver's target keeps
   nothing (the flat receiver does nothing with its bytes either).
2. **exposed** — the receiver is an ``asyncflow_reference.worker.InferenceWorker`` (a
   ``TorchInferenceEngine`` with the same model) kept busy with ``--busy`` generations in flight;
   per round it takes one sync in ``staged`` mode (received into a host buffer while the engine
   generates; only the swap pauses it) and one in ``blocking`` mode (paused from the start of the
   transfer until the weights are loaded), ``--gap-s`` apart (after a load the engine
   recomputes its KV cache). ``exposed_s``: how long the engine could not generate, measured
   in the worker; ``tokens_during_transfer`` shows whether generation went on.

Usage: ``python benchmarks/weight_sync.py [--quick] [--repeat N] [--bucket-mb M]``. ``--quick``
(smoke test): a 16 MiB model, 4 MiB buckets, one round. The last stdout line is one JSON
object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from asyncflow_reference.model import ModelConfig, TransformerLM
from asyncflow_reference.worker import InferenceWorker, Mode, SyncReport, WorkerSpec

from asyncflow_core.contracts.protocols import WeightBucket
from asyncflow_core.engines.process import free_port
from asyncflow_core.infra.platform import gloo_listens_on, rendezvous_store
from asyncflow_core.sync.transports import (
    DistributedWeightReceiver,
    DistributedWeightSync,
    WeightSyncGroup,
    bucketize,
)

HOST = "127.0.0.1"
MB = 1 << 20
# name -> (through the transport?, pre-packed buckets?, receiver reuses its buffers?); not
# through the transport: one flat broadcast, or (pre-packed) the bucketed wire's raw calls
HEADER_SLOT = 4096  # bytes of one header broadcast on the transport's wire
VARIANTS: dict[str, tuple[bool, bool, bool]] = {
    "flat": (False, False, True),
    "bucketed": (True, True, True),
    "bucketed_pack": (True, False, True),
    "wire_raw": (False, True, True),
    "bucketed_fresh": (True, True, False),
    "flat_fresh": (False, False, False),
}


class Discard:
    """A receiver's target that copies nothing and keeps nothing (the flat baseline does not
    use its bytes either), so the receiver may reuse its buffers."""

    async def load_weights(self, weights: Sequence[tuple[str, torch.Tensor]], version: int) -> None:
        return None


def _ack(group: WeightSyncGroup | None) -> None:
    """A one-element broadcast from the receiver (rank 1): 'ready' or 'got every byte'."""
    flag = torch.zeros(1)
    if group is None:
        dist.broadcast(flag, 1)
    else:
        group.broadcast(flag, 1)


def _raw_wire(buffers: Sequence[torch.Tensor]) -> None:
    """The bucketed wire's broadcasts without the transport: per bucket a header slot queued
    with the bucket's bytes (the bytes waited for once the next header went out), then the
    finish slot; the same calls on both sides."""
    slot = torch.zeros(HEADER_SLOT, dtype=torch.uint8)
    previous = None
    for buffer in buffers:
        header = dist.broadcast(slot, 0, async_op=True)
        payload = dist.broadcast(buffer, 0, async_op=True)
        assert header is not None and payload is not None
        header.wait()
        if previous is not None:
            previous.wait()
        previous = payload
    dist.broadcast(slot, 0)
    if previous is not None:
        previous.wait()


def _plan(rounds: int) -> list[str]:
    """Every variant once per round, the order reversed every other round."""
    names = list(VARIANTS)
    return [v for r in range(rounds) for v in (names if r % 2 == 0 else names[::-1])]


def _join_world(port: int, rank: int) -> None:
    """The 2-process gloo world, its store on HOST only (torch's tcp:// store would listen on
    every interface; asyncflow_core.infra.platform.rendezvous_store)."""
    store = rendezvous_store(HOST, port, 2, is_master=rank == 0, timeout=timedelta(seconds=120))
    with gloo_listens_on(HOST):
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)


# --------------------------------------------------------------------------------------------
# Section 1: bandwidth (the receiver is this child)
# --------------------------------------------------------------------------------------------
def _receiver_main(
    ports: tuple[int, int], total_bytes: int, bucket_sizes: list[int], plan: list[str]
) -> None:
    torch.set_num_threads(1)
    _join_world(ports[0], rank=1)
    group = WeightSyncGroup(HOST, ports[1], 1, 2, timeout_s=120)
    group.connect()  # while the sender's init() connects
    receivers = {
        reuse: DistributedWeightReceiver(Discard(), group=group, reuse_buffers=reuse)
        for reuse in (False, True)
    }
    kept = torch.empty(total_bytes, dtype=torch.uint8)
    raw_buffers = [torch.empty(n, dtype=torch.uint8) for n in bucket_sizes]

    async def main() -> None:
        for variant in plan:
            bucketed, packed, reuse = VARIANTS[variant]
            if bucketed:
                _ack(group)
                await receivers[reuse].receive_one()
                _ack(group)
            elif packed:
                _ack(None)
                _raw_wire(raw_buffers)
                _ack(None)
            else:
                buffer = kept if reuse else torch.empty(total_bytes, dtype=torch.uint8)
                _ack(None)
                dist.broadcast(buffer, 0)
                _ack(None)
        assert await receivers[True].receive_one() is None  # the sender's close

    asyncio.run(main())
    for receiver in receivers.values():
        receiver.close()
    group.close()
    dist.destroy_process_group()


async def _bandwidth(
    named: list[tuple[str, torch.Tensor]], bucket_bytes: int, rounds: int
) -> dict[str, list[float]]:
    """Seconds per variant and round (the first round is a warm-up, not returned)."""
    buckets = {packed: bucketize(named, bucket_bytes, pack=packed) for packed in (False, True)}
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in named])
    # each pre-packed bucket's whole buffer (bucketize makes it exactly the wire's size)
    wire = [
        torch.empty(0, dtype=torch.uint8).set_(bucket.tensors[0].untyped_storage())
        for bucket in buckets[True]
    ]
    plan = _plan(rounds + 1)
    ports = (free_port(), free_port())
    child = multiprocessing.get_context("spawn").Process(
        target=_receiver_main,
        args=(ports, flat.numel(), [w.numel() for w in wire], plan),
        daemon=True,
    )
    child.start()
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    _join_world(ports[0], rank=0)
    group = WeightSyncGroup(HOST, ports[1], 0, 2, timeout_s=120)
    sync = DistributedWeightSync(group=group)
    try:
        await sync.init()
        for version, variant in enumerate(plan, 1):
            bucketed, packed, _ = VARIANTS[variant]
            if bucketed:
                _ack(group)
                t0 = time.perf_counter()
                await _send(sync, buckets[packed], version)
                _ack(group)
            elif packed:
                _ack(None)
                t0 = time.perf_counter()
                _raw_wire(wire)
                _ack(None)
            else:
                _ack(None)
                t0 = time.perf_counter()
                dist.broadcast(flat, 0)
                _ack(None)
            seconds[variant].append(time.perf_counter() - t0)
        await sync.close()
    finally:
        group.close()
        dist.destroy_process_group()
        child.join(60)
        if child.is_alive():
            child.kill()
    if child.exitcode != 0:
        raise SystemExit(f"the receiver process failed (exit code {child.exitcode})")
    return {v: times[1:] for v, times in seconds.items()}


async def _send(sync: DistributedWeightSync, buckets: Sequence[WeightBucket], version: int) -> None:
    await sync.start()
    for bucket in buckets:
        await sync.update(bucket)
    await sync.finish(version)


# --------------------------------------------------------------------------------------------
# Section 2: exposed time, staged vs blocking (the receiver is an InferenceWorker)
# --------------------------------------------------------------------------------------------
async def _exposed(
    config: ModelConfig,
    named: list[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    repeats: int,
    busy: int,
    busy_tokens: int,
    gap_s: float,
) -> list[SyncReport]:
    buckets = bucketize(named, bucket_bytes, pack=True)
    port = free_port()
    spec = WorkerSpec(config, HOST, port, rank=1, world_size=2, seed=1, max_batch=max(busy, 1))
    with InferenceWorker(spec) as worker:
        group = WeightSyncGroup(HOST, port, 0, 2, timeout_s=120)
        sync = DistributedWeightSync(group=group)
        try:
            await sync.init()
            await asyncio.to_thread(worker.keep_busy, busy, busy_tokens)
            await asyncio.sleep(0.5)  # let the engine reach a steady batch
            pair: tuple[Mode, Mode] = ("staged", "blocking")
            modes = [m for r in range(repeats + 1) for m in (pair if r % 2 == 0 else pair[::-1])]
            for version, mode in enumerate(modes, 1):
                await asyncio.to_thread(worker.set_mode, mode)
                await _send(sync, buckets, version)
                await asyncio.to_thread(worker.wait_for_version, version)
                await asyncio.sleep(gap_s)  # the engine recomputes its KV cache, then decodes
            await asyncio.to_thread(worker.keep_busy, 0)
            reports = (await asyncio.to_thread(worker.reports))[2:]  # round 0 warms up
            await sync.close()
        finally:
            group.close()
    return reports


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------
def _spread(values: Sequence[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, one round (smoke)")
    parser.add_argument("--repeat", type=int, default=None, help="rounds (default 5; quick 1)")
    parser.add_argument("--bucket-mb", type=float, default=None, help="default 64; quick 4")
    parser.add_argument("--d-model", type=int, default=None, help="default 512; quick 256")
    parser.add_argument("--layers", type=int, default=None, help="default 16; quick 4")
    parser.add_argument("--vocab", type=int, default=None, help="default 4096; quick 2048")
    parser.add_argument("--busy", type=int, default=8, help="generations in flight (section 2)")
    parser.add_argument(
        "--gap-s", type=float, default=None, help="seconds between syncs (section 2; default 1)"
    )
    args = parser.parse_args(argv)
    quick = bool(args.quick)
    repeats = args.repeat or (1 if quick else 5)
    bucket_mb = args.bucket_mb or (4.0 if quick else 64.0)
    config = ModelConfig(
        vocab_size=args.vocab or (2048 if quick else 4096),
        d_model=args.d_model or (256 if quick else 512),
        n_layers=args.layers or (4 if quick else 16),
        n_heads=8,
        max_seq_len=64,
    )
    busy_tokens = 24
    named = list(TransformerLM(config, seed=0).state_dict().items())
    model_bytes = sum(t.numel() * t.element_size() for _, t in named)
    bucket_bytes = int(bucket_mb * MB)
    n_buckets = len(bucketize(named, bucket_bytes))
    print(
        f"model: {sum(t.numel() for _, t in named) / 1e6:.1f} M params, {model_bytes / MB:.1f} MiB "
        f"fp32 in {len(named)} tensors; {n_buckets} buckets of <= {bucket_mb:g} MiB; "
        f"{repeats} round(s); torch {torch.__version__}, {os.cpu_count()} CPUs",
        flush=True,
    )

    t_start = time.perf_counter()
    seconds = asyncio.run(_bandwidth(named, bucket_bytes, repeats))
    gbps = {v: [model_bytes / s / 1e9 for s in seconds[v]] for v in VARIANTS}
    vs_flat = {
        v: _spread([f / b for f, b in zip(seconds["flat"], seconds[v], strict=True)])
        for v in VARIANTS
    }
    print("\n1. bandwidth, 2 processes, gloo over loopback (median, min-max)")
    print(f"  {'variant':<16}{'seconds':>22}{'GB/s':>22}{'vs flat':>22}")
    for v in VARIANTS:
        s, g, r = _spread(seconds[v]), _spread(gbps[v]), vs_flat[v]
        print(
            f"  {v:<16}{s[0]:>10.3f} ({s[1]:.3f}-{s[2]:.3f}){g[0]:>10.2f} ({g[1]:.2f}-{g[2]:.2f})"
            f"{r[0]:>10.2f} ({r[1]:.2f}-{r[2]:.2f})"
        )
    ratio = vs_flat["bucketed"]
    over_raw = _spread(
        [r / b for r, b in zip(seconds["wire_raw"], seconds["bucketed"], strict=True)]
    )
    print(
        f"  bucketed vs wire_raw (the transport's own cost): {over_raw[0]:.2f} "
        f"({over_raw[1]:.2f}-{over_raw[2]:.2f})"
    )

    gap_s = args.gap_s if args.gap_s is not None else (0.3 if quick else 1.0)
    reports = asyncio.run(
        _exposed(config, named, bucket_bytes, repeats, args.busy, busy_tokens, gap_s)
    )
    by_mode = {m: [r for r in reports if r.mode == m] for m in ("staged", "blocking")}
    print(f"\n2. exposed time, receiver generating with {args.busy} requests in flight")
    print(f"  {'mode':<10}{'exposed s':>22}{'transfer s':>22}{'tokens in transfer':>20}")
    for mode, rows in by_mode.items():
        e = _spread([r.exposed_s for r in rows])
        t = _spread([r.transfer_s for r in rows])
        tokens = statistics.median([r.tokens_during_transfer for r in rows])
        print(
            f"  {mode:<10}{e[0]:>10.3f} ({e[1]:.3f}-{e[2]:.3f}){t[0]:>10.3f} ({t[1]:.3f}-"
            f"{t[2]:.3f}){tokens:>20.0f}"
        )
    staged = _spread([r.exposed_s for r in by_mode["staged"]])
    blocking = _spread([r.exposed_s for r in by_mode["blocking"]])
    print(f"  staged exposes {staged[0] / blocking[0]:.2f}x the blocking update's pause")
    result: dict[str, Any] = {
        "bucketed_vs_flat": ratio[0],
        "bucketed_vs_flat_min": ratio[1],
        "bucketed_vs_flat_max": ratio[2],
        "bucketed_pack_vs_flat": vs_flat["bucketed_pack"][0],
        "wire_raw_vs_flat": vs_flat["wire_raw"][0],
        "bucketed_vs_wire_raw": over_raw[0],
        "bucketed_vs_wire_raw_min": over_raw[1],
        "bucketed_vs_wire_raw_max": over_raw[2],
        "bucketed_fresh_vs_flat": vs_flat["bucketed_fresh"][0],
        "flat_fresh_vs_flat": vs_flat["flat_fresh"][0],
        **{f"{v}_gbps": _spread(gbps[v])[0] for v in VARIANTS},
        "staged_exposed_s": staged[0],
        "staged_exposed_s_min": staged[1],
        "staged_exposed_s_max": staged[2],
        "blocking_exposed_s": blocking[0],
        "blocking_exposed_s_min": blocking[1],
        "blocking_exposed_s_max": blocking[2],
        "staged_transfer_s": statistics.median([r.transfer_s for r in by_mode["staged"]]),
        "blocking_transfer_s": statistics.median([r.transfer_s for r in by_mode["blocking"]]),
        "staged_tokens_during_transfer": statistics.median(
            [r.tokens_during_transfer for r in by_mode["staged"]]
        ),
        "model_mb": model_bytes / MB,
        "bucket_mb": bucket_mb,
        "buckets": n_buckets,
        "repeats": repeats,
        "busy_requests": args.busy,
        "quick": quick,
        "elapsed_s": time.perf_counter() - t_start,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
