"""The main job's ``ray`` runtime (``asyncflow run --runtime ray``), registered through the
``asyncflow.runtimes`` entry point (``asyncflow_core.engines.registry``, kind ``runtime``):
every engine in a Ray actor of its own, on the cluster at ``runtime.address`` (empty: a local
cluster started for the run and stopped after), the store in the driver or, with
``runtime.store = "ray"``, a ``RayDataStore``; a staged weight sync goes from the trainer's
actor straight to the rollout actors (``RayDirectWeightSync``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Literal

from asyncflow_core.contracts.protocols import InferenceEngine, TrainEngine
from asyncflow_core.flow.rlflow import MakeStaged
from asyncflow_core.job.config import RunConfig
from asyncflow_core.job.run import Placed
from asyncflow_ray.engines import RayInferenceEngine, RayTrainEngine
from asyncflow_ray.runtime import RayRuntime
from asyncflow_ray.store import RayDataStore
from asyncflow_ray.weightsync import RayDirectWeightSync


@contextlib.asynccontextmanager
async def job_runtime(
    cfg: RunConfig,
    *,
    rollout: Sequence[Callable[[], InferenceEngine]],
    trainer: Callable[[], TrainEngine],
    platform: str,
) -> AsyncIterator[Placed]:
    """The engines as actors (the trainer's on ``platform``, the rollout engines' on CPU),
    closed and the cluster started for the run stopped on the way out; ``Placed.placement``
    names each actor's node (``head`` or ``node N``) by its name (``trainer``, ``rollout-i``,
    ``unit-u``)."""
    needed = len(rollout) + 1  # one CPU per engine actor
    rt = RayRuntime(
        cfg.runtime.address or None,
        num_cpus=None if cfg.runtime.address else max(os.cpu_count() or 1, needed),
    )
    rt.start()
    made: list[Any] = []
    store = None
    try:
        if cfg.runtime.store == "ray":
            store = RayDataStore.create(cfg.runtime.storage_units)
        trainer_ray = await RayTrainEngine.create_async(trainer, platform=platform, name="trainer")
        made.append(trainer_ray)
        engines: list[InferenceEngine] = []
        for i, make in enumerate(rollout):
            engines.append(
                await RayInferenceEngine.create_async(
                    make,
                    platform="cpu",
                    name=f"rollout-{i}",
                    max_restarts=cfg.runtime.rollout_restarts,
                )
            )
            made.append(engines[-1])
        alive = rt.nodes()
        nodes = len(alive)
        held = f"{cfg.runtime.storage_units} storage units" if store else "the store in the driver"
        where = f"ray ({nodes} node{'s' if nodes != 1 else ''}, {held})"
        # where each actor landed, by node: "head" or "node N" (the others, in Ray's order)
        label = {n.node_id: "head" for n in alive if n.is_head}
        workers = [n for n in alive if not n.is_head]
        label.update({n.node_id: f"node {i}" for i, n in enumerate(workers, 1)})
        placement = {p.name: label.get(p.node_id, p.node_id) for p in made}
        if store is not None:
            for unit in await store.placement():
                placement[f"unit-{unit.unit}"] = label.get(unit.node_id, unit.node_id)
        yield Placed(
            engines, trainer_ray, store, where, make_staged=_direct_sync(cfg, trainer_ray),
            placement=placement, trainer_label="ray actor",
        )  # fmt: skip
    finally:
        for proxy in made:
            with contextlib.suppress(Exception):
                await proxy.close()
        if store is not None:
            store.shutdown()
        rt.shutdown()


def _direct_sync(cfg: RunConfig, trainer: RayTrainEngine) -> MakeStaged | None:
    """A staged sync from the trainer's actor straight to the rollout actors (the driver
    never holds the weights); None for the other weight syncs."""
    rl = cfg.rl_config()
    if rl.weight_sync != "staged":
        return None
    bucket_bytes = rl.bucket_bytes

    def make(targets: Sequence[Any], mode: Literal["abort", "keep"]) -> RayDirectWeightSync:
        return RayDirectWeightSync(trainer, targets, bucket_bytes=bucket_bytes, pause_mode=mode)

    return make


__all__ = ["job_runtime"]
