"""What one Ray actor call of the runtime costs: the per-call figures the simulator's Ray
runtime is given (``asyncflow_reference.sim.RayCosts``).

Engines that do no work (an inference engine that answers at once with ``T`` tokens, a
trainer whose step returns at once) run in actors of a local Ray cluster, behind the real
proxies (``RayInferenceEngine`` / ``RayTrainEngine``), so what is timed is the runtime's
path: packing, Ray's calls and object store, the actor's loop, unpacking. For each shape the
benchmark takes the median over ``--reps`` repetitions of

* **generate**: ``k`` requests made in one turn of the driver's loop (one ``generate_many``
  call, the results streamed back), ``k`` in {1, 8, 64}, responses of ``T`` in {16, 1024}
  tokens: wall seconds and the driver's CPU seconds (``time.process_time``) per batch;
* **train**: one ``train_step`` of a batch of ``B`` bytes (padded token, mask and log-prob
  fields), B from 64 KiB to 32 MiB;
* **control**: one control call (``refresh_version``), the round trip of every pause,
  resume, load and swap message.

and fits ``wall = call + k·(request + T·token)`` (and the same for the driver's CPU) and
``wall = call + B / bandwidth`` by least squares. The fit and every measured point are
printed; ``--write PATH`` stores the fit as JSON for the simulator (the shipped one is
``reference/asyncflow_reference/ray_costs.json``, measured on the 2-core dev box with the
command in its ``measured`` field).

    python benchmarks/ray_calls.py                       # print the table and the fit
    python benchmarks/ray_calls.py --write reference/asyncflow_reference/ray_costs.json

The last stdout line is one JSON object (the fit).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Sequence
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "reference")]

from asyncflow_core.contracts.protocols import (  # noqa: E402
    Batch,
    GenerationRequest,
    GenerationResult,
    LossFn,
    SamplingParams,
    TrainMetrics,
    WeightBucket,
)


class InstantEngine:
    """An ``InferenceEngine`` that answers every request at once with ``max_tokens`` tokens."""

    weight_version = 0

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        n = request.params.max_tokens
        return GenerationResult(
            request.request_id,
            request.prompt_tokens,
            tuple(range(n)),
            (-1.0,) * n,
            (0,) * n,
            "length",
        )

    async def abort(self, request_ids: Sequence[str]) -> None:
        return None


class InstantTrainer:
    """A ``TrainEngine`` whose every call returns at once."""

    def __init__(self) -> None:
        self.weight_version = 0

    async def train_step(self, batch: Batch, loss_fn: LossFn) -> TrainMetrics:
        self.weight_version += 1
        return TrainMetrics(self.weight_version, 0.0, 0.0, len(batch), 0)

    async def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        return torch.zeros(len(batch), 1)

    async def export_weights(self, bucket_bytes: int) -> AsyncIterator[WeightBucket]:
        return
        yield

    async def save_checkpoint(self, path: str) -> None:
        return None

    async def load_checkpoint(self, path: str) -> None:
        return None


def no_loss(logprobs: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    return torch.zeros(()), {}


def batch_of(nbytes: int) -> Batch:
    """A padded RL batch of about ``nbytes``: token ids (int64), a mask (int64) and log-probs
    (float32) of 64 rows."""
    rows = 64
    width = max(1, nbytes // (rows * (8 + 8 + 4)))
    data = {
        "tokens": torch.ones(rows, width, dtype=torch.long),
        "mask": torch.ones(rows, width, dtype=torch.long),
        "logprobs": torch.zeros(rows, width),
    }
    return Batch(tuple(range(rows)), data)


def _fit(xs: list[list[float]], ys: list[float]) -> list[float]:
    coef, *_ = np.linalg.lstsq(np.asarray(xs), np.asarray(ys), rcond=None)
    return [max(0.0, float(c)) for c in coef]


async def measure(reps: int) -> dict[str, Any]:
    from asyncflow_ray import RayInferenceEngine, RayTrainEngine

    rollout = await RayInferenceEngine.create_async(InstantEngine, devices=0)
    trainer = await RayTrainEngine.create_async(InstantTrainer, devices=0)
    points: dict[str, list[dict[str, float]]] = {"generate": [], "train": [], "control": []}
    try:
        # warm-up: the first calls import and pickle things once
        for _ in range(3):
            await rollout.generate(GenerationRequest("w", (1, 2), SamplingParams(max_tokens=4)))
            await trainer.train_step(batch_of(1 << 16), no_loss)
        rid = 0
        for tokens in (16, 1024):
            for k in (1, 8, 64):
                walls, cpus = [], []
                for _ in range(reps):
                    requests = []
                    for _ in range(k):
                        rid += 1
                        params = SamplingParams(max_tokens=tokens)
                        requests.append(GenerationRequest(f"r{rid}", tuple(range(64)), params))
                    c0, t0 = time.process_time(), time.perf_counter()
                    await asyncio.gather(*(rollout.generate(r) for r in requests))
                    walls.append(time.perf_counter() - t0)
                    cpus.append(time.process_time() - c0)
                point = {"k": k, "tokens": tokens, "wall_s": statistics.median(walls)}
                points["generate"].append({**point, "driver_cpu_s": statistics.median(cpus)})
        for nbytes in (1 << 16, 1 << 20, 1 << 22, 1 << 25):
            batch = batch_of(nbytes)
            size = sum(t.nbytes for t in batch.data.values())
            walls, cpus = [], []
            for _ in range(reps):
                c0, t0 = time.process_time(), time.perf_counter()
                await trainer.train_step(batch, no_loss)
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
            point = {"bytes": size, "wall_s": statistics.median(walls)}
            points["train"].append({**point, "driver_cpu_s": statistics.median(cpus)})
        walls, cpus = [], []
        for _ in range(reps * 5):
            c0, t0 = time.process_time(), time.perf_counter()
            await rollout.refresh_version()
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        points["control"].append(
            {"wall_s": statistics.median(walls), "driver_cpu_s": statistics.median(cpus)}
        )
    finally:
        await rollout.close()
        await trainer.close()
    gen = points["generate"]
    features = [[1.0, p["k"], p["k"] * p["tokens"]] for p in gen]
    wall = _fit(features, [p["wall_s"] for p in gen])
    cpu = _fit(features, [p["driver_cpu_s"] for p in gen])
    train = points["train"]
    tf = [[1.0, p["bytes"]] for p in train]
    twall = _fit(tf, [p["wall_s"] for p in train])
    tcpu = _fit(tf, [p["driver_cpu_s"] for p in train])
    fit = {
        "generate_call_s": wall[0],
        "generate_request_s": wall[1],
        "generate_token_s": wall[2],
        "driver_call_cpu_s": cpu[0],
        "driver_request_cpu_s": cpu[1],
        "driver_token_cpu_s": cpu[2],
        "train_call_s": twall[0],
        "train_bytes_per_s": 1.0 / twall[1] if twall[1] > 0 else float("inf"),
        "driver_train_call_cpu_s": tcpu[0],
        "driver_train_byte_cpu_s": tcpu[1],
        "control_call_s": points["control"][0]["wall_s"],
        "driver_control_cpu_s": points["control"][0]["driver_cpu_s"],
    }
    return {"fit": fit, "points": points}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15, help="repetitions per shape (15)")
    parser.add_argument("--write", type=Path, help="store the fit as JSON for the simulator")
    args = parser.parse_args(argv)
    from asyncflow_ray import RayRuntime

    with RayRuntime(num_cpus=4):
        measured = asyncio.run(measure(args.reps))
    fit, points = measured["fit"], measured["points"]
    print(f"{'generate: k × T tokens':<28} {'wall ms':>9} {'driver CPU ms':>14}")
    for p in points["generate"]:
        label = f"{p['k']} × {p['tokens']}"
        print(f"{label:<28} {p['wall_s'] * 1e3:>9.2f} {p['driver_cpu_s'] * 1e3:>14.2f}")
    print(f"{'train_step: batch MiB':<28} {'wall ms':>9} {'driver CPU ms':>14}")
    for p in points["train"]:
        label = f"{p['bytes'] / 2**20:.2f}"
        print(f"{label:<28} {p['wall_s'] * 1e3:>9.2f} {p['driver_cpu_s'] * 1e3:>14.2f}")
    c = points["control"][0]
    print(f"{'control call':<28} {c['wall_s'] * 1e3:>9.2f} {c['driver_cpu_s'] * 1e3:>14.2f}")
    print("fit:")
    for name, value in fit.items():
        print(f"  {name:<26} {value:.3g}")
    if args.write is not None:
        record = {
            **fit,
            "measured": (
                f"{date.today().isoformat()}, python benchmarks/ray_calls.py --reps "
                f"{args.reps}, {os.cpu_count()}-CPU box, ray {_ray_version()}"
            ),
            "points": points,
        }
        args.write.write_text(json.dumps(record, indent=1) + "\n")
        print(f"written to {args.write}")
    print(json.dumps(fit))
    return 0


def _ray_version() -> str:
    import ray

    return str(ray.__version__)


if __name__ == "__main__":
    raise SystemExit(main())
