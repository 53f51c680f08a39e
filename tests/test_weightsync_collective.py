"""The collective WeightSync over real process groups: a ``WeightSyncGroup`` of its own beside
the trainer's training world, inference workers in other processes that receive byte-exact
weights and then generate with the new version, and the failures that must be clear errors
rather than hangs (a peer that never arrives, a sender that goes quiet or dies mid-sync).

Every wait has a timeout; every process started here is killed in a ``finally``."""

from __future__ import annotations

import asyncio
import json
import queue
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from asyncflow_reference.model import ModelConfig
from asyncflow_reference.worker import InferenceWorker, WorkerSpec
from safetensors.torch import load_file

from asyncflow_core.contracts.errors import WeightSyncError
from asyncflow_core.contracts.protocols import GenerationRequest, SamplingParams
from asyncflow_core.engines.process import free_port
from asyncflow_core.sync.transports import (
    DistributedWeightReceiver,
    DistributedWeightSync,
    WeightSyncGroup,
    bucketize,
)

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
MODEL = ModelConfig(vocab_size=16, d_model=32, n_layers=2, n_heads=2, max_seq_len=32)
WAIT_S = 120.0

pytestmark = pytest.mark.slow

# The trainer's process: a training world of its own (torch.distributed's default group, world
# size 1, as DeepSpeed would make it) and, beside it, the weight-sync group with the workers.
TRAINER = textwrap.dedent(
    """
    import asyncio, json, os, sys
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from asyncflow_conformance.engines import padded_batch
    from asyncflow_core.training.rl import policy_gradient_loss
    from asyncflow_core.sync.transports import DistributedWeightSync, WeightSyncGroup
    from asyncflow_reference.engines import TorchTrainEngine
    from asyncflow_reference.model import ModelConfig

    cfg = json.loads(sys.argv[1])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{cfg['train_port']}", rank=0, world_size=1
    )
    batch = padded_batch(
        prompts=[[1, 2, 3], [4, 5]], responses=[[6, 7], [8, 9, 10]], advantages=[1.0, -0.5]
    )

    async def main():
        trainer = TorchTrainEngine(ModelConfig(**cfg["model"]), lr=0.05, seed=0, threads=1)
        group = WeightSyncGroup("127.0.0.1", cfg["sync_port"], 0, cfg["world_size"], timeout_s=60)
        sync = DistributedWeightSync(group=group)
        await sync.init()
        for _ in range(cfg["syncs"]):
            version = (await trainer.train_step(batch, policy_gradient_loss)).version
            total = torch.ones(1)
            dist.all_reduce(total)  # the training world works beside the sync group
            assert dist.get_world_size() == 1 and total.item() == 1.0
            sent = {}
            await sync.start()
            async for bucket in trainer.export_weights(cfg["bucket_bytes"]):
                sent.update(dict(bucket))
                await sync.update(bucket)
                if cfg["die_mid_sync"]:
                    os._exit(3)
            await sync.finish(version)
            save_file(sent, os.path.join(cfg["out"], f"sent-{version}.safetensors"))
            print(f"synced {version}", flush=True)
            sys.stdin.readline()  # the test has checked the workers
        await sync.close()
        group.close()
        await trainer.close()

    asyncio.run(main())
    dist.destroy_process_group()
    """
)


class Trainer:
    """The trainer script in a child process; ``line()`` reads its stdout with a timeout."""

    def __init__(self, tmp_path: Path, sync_port: int, world_size: int, **options: Any) -> None:
        script = tmp_path / "trainer.py"
        script.write_text(TRAINER)
        cfg = {
            "model": {
                "vocab_size": MODEL.vocab_size,
                "d_model": MODEL.d_model,
                "n_layers": MODEL.n_layers,
                "n_heads": MODEL.n_heads,
                "max_seq_len": MODEL.max_seq_len,
            },
            "train_port": free_port(),
            "sync_port": sync_port,
            "world_size": world_size,
            "out": str(tmp_path),
            "bucket_bytes": 4096,
            "syncs": 2,
            "die_mid_sync": False,
            **options,
        }
        self.proc = subprocess.Popen(
            [sys.executable, str(script), json.dumps(cfg)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())

    def line(self) -> str:
        try:
            return self._lines.get(timeout=WAIT_S)
        except queue.Empty:
            raise AssertionError(f"the trainer printed nothing in {WAIT_S} s") from None

    def go_on(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("next\n")
        self.proc.stdin.flush()

    def wait(self) -> int:
        return self.proc.wait(timeout=WAIT_S)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=WAIT_S)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    )


def requests(tag: str, n: int = 4) -> list[GenerationRequest]:
    return [
        GenerationRequest(f"{tag}-{i}", (1, 2, 3 + i), SamplingParams(max_tokens=6, seed=i))
        for i in range(n)
    ]


def close_all(workers: Sequence[InferenceWorker]) -> list[int | None]:
    return [worker.close() for worker in workers]


def test_a_trainer_with_its_own_training_world_syncs_workers_in_other_processes(
    tmp_path: Path,
) -> None:
    """Trainer rank 0 (its default group: a training world of one) broadcasts to a staged and
    a blocking worker (ranks 1 and 2 of the sync group); after each sync both hold the
    trainer's exact bytes and every token they generate reports the new version."""
    sync_port = free_port()
    workers = [
        InferenceWorker(WorkerSpec(MODEL, HOST, sync_port, rank, 3, seed=10 + rank, mode=mode))
        for rank, mode in ((1, "staged"), (2, "blocking"))
    ]
    trainer = Trainer(tmp_path, sync_port, world_size=3)
    try:
        before = workers[0].weights(timeout_s=WAIT_S)
        for version in (1, 2):
            assert trainer.line() == f"synced {version}"
            sent = load_file(str(tmp_path / f"sent-{version}.safetensors"))
            assert any(not torch.equal(before[n], sent[n]) for n in sent)  # a real change
            for worker in workers:
                assert worker.wait_for_version(version, timeout_s=WAIT_S) == version
                got = worker.weights(timeout_s=WAIT_S)
                assert sorted(got) == sorted(sent)
                for name, tensor in sent.items():
                    assert same_bytes(got[name], tensor), (worker.spec.mode, name)
                results = worker.generate(requests(f"v{version}"), timeout_s=WAIT_S)
                for result in results:
                    assert result.tokens and result.versions == (version,) * len(result.tokens)
            trainer.go_on()
        assert trainer.wait() == 0
        for worker, mode in zip(workers, ("staged", "blocking"), strict=True):
            reports = worker.reports(timeout_s=WAIT_S)
            assert [(r.version, r.mode) for r in reports] == [(1, mode), (2, mode)]
            assert all(r.transfer_s > 0 and r.exposed_s > 0 for r in reports)
    finally:
        trainer.kill()
        codes = close_all(workers)
    assert codes == [0, 0]


def test_a_sender_that_dies_mid_sync_is_a_clear_error_and_the_worker_recovers(
    tmp_path: Path,
) -> None:
    """The trainer exits after its first bucket: the blocking worker's receiver fails at once
    with a WeightSyncError (not a hang), nothing of the sync is loaded, and the engine, paused
    for the sync, generates again with its old weights."""
    sync_port = free_port()
    worker = InferenceWorker(WorkerSpec(MODEL, HOST, sync_port, 1, 2, seed=1, mode="blocking"))
    trainer = Trainer(tmp_path, sync_port, world_size=2, die_mid_sync=True)
    try:
        before = worker.weights(timeout_s=WAIT_S)
        assert trainer.wait() == 3
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match="a peer process may have died"):
            worker.wait_for_version(1, timeout_s=WAIT_S)
        assert time.monotonic() - t0 < WAIT_S / 2
        after = worker.weights(timeout_s=WAIT_S)
        assert all(torch.equal(before[n], after[n]) for n in before)
        results = worker.generate(requests("after"), timeout_s=WAIT_S)
        assert all(r.tokens and set(r.versions) == {0} for r in results)
    finally:
        trainer.kill()
        code = worker.close()
    assert code == 0


def test_a_peer_that_never_arrives_is_a_clear_timeout_not_a_hang() -> None:
    port = free_port()
    group = WeightSyncGroup(HOST, port, 0, 2, timeout_s=1)
    sync = DistributedWeightSync(group=group)
    t0 = time.monotonic()
    with pytest.raises(
        WeightSyncError,
        match=rf"127\.0\.0\.1:{port} \(rank 0 of 2\): no rendezvous within 1 s .*check that "
        r"this port is free and that all 2 ranks build a WeightSyncGroup with the same host",
    ):
        asyncio.run(sync.init())
    assert time.monotonic() - t0 < 30 and not group.connected
    with pytest.raises(
        WeightSyncError, match=r"start\(\) called out of order; the next call must be init\(\)"
    ):
        asyncio.run(sync.start())  # the failed init changed nothing: init() comes next
    worker_side = WeightSyncGroup(HOST, port, 1, 2, timeout_s=1)
    with pytest.raises(
        WeightSyncError,
        match=rf"check that rank 0 \(the trainer's sender\) listens on 127\.0\.0\.1:{port}",
    ):
        worker_side.connect()
    assert time.monotonic() - t0 < 60


def test_two_ranks_in_one_process_sync_and_a_quiet_sender_times_out_the_idle_receiver() -> None:
    """Rank 1 in a thread of its own receives one sync byte-exact, then waits for the next one
    with ``idle_timeout_s=1``: the sender stays quiet, so it fails after ~1 s with the group's
    address and what to do."""
    port = free_port()
    weights = [("w", torch.randn(300, 7)), ("b", torch.arange(5, dtype=torch.int64))]
    outcome: dict[str, Any] = {}

    class Target:
        async def load_weights(self, w: Sequence[tuple[str, torch.Tensor]], v: int) -> None:
            outcome["loaded"] = ({n: t.clone() for n, t in w}, v)

    def receiver_side() -> None:
        async def main() -> None:
            with WeightSyncGroup(HOST, port, 1, 2, timeout_s=30) as group:
                receiver = DistributedWeightReceiver(Target(), group=group, idle_timeout_s=1.0)
                outcome["first"] = await receiver.receive_one()
                t0 = time.monotonic()
                try:
                    await receiver.receive_one()
                except WeightSyncError as exc:
                    outcome["error"], outcome["waited_s"] = exc, time.monotonic() - t0
                receiver.close()

        asyncio.run(main())

    thread = threading.Thread(target=receiver_side, daemon=True)
    thread.start()

    async def sender_side() -> None:
        with WeightSyncGroup(HOST, port, 0, 2, timeout_s=30) as group:
            sync = DistributedWeightSync(group=group)
            await sync.init()
            await sync.start()
            for bucket in bucketize(weights, 1024):
                await sync.update(bucket)
            await sync.finish(7)
            await asyncio.to_thread(thread.join, WAIT_S)

    asyncio.run(sender_side())
    assert not thread.is_alive()
    assert outcome["first"] == 7
    loaded, version = outcome["loaded"]
    assert version == 7 and all(same_bytes(loaded[n], t) for n, t in weights)
    assert 0.9 < outcome["waited_s"] < 30
    assert re.search(
        rf"127\.0\.0\.1:{port} \(rank 1 of 2\): broadcast from rank 0 failed .*outlasted its "
        r"1 s timeout; close this group",
        str(outcome["error"]),
    )
