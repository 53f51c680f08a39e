"""AsyncFlow's DeepSpeed adapter: ``DeepSpeedTrainEngine``, a ``TrainEngine`` over
``deepspeed.initialize`` (ZeRO 0-3, fp32/bf16), and ``launch`` for several ranks.

Needs the ``[deepspeed]`` extra (``pip install 'asyncflow[deepspeed]'``); importing this
package does not import DeepSpeed, building an engine does (and raises
``MissingExtraError`` naming the extra when it is absent).
"""

from __future__ import annotations

import functools
from typing import Any

from asyncflow_core.contracts.errors import AsyncFlowError, EngineError
from asyncflow_core.engines.process import DEFAULT_START_TIMEOUT_S, RankContext, SPMDTrainEngine
from asyncflow_core.infra.platform import select_platform
from asyncflow_deepspeed.compat import TESTED, check_version, require_deepspeed
from asyncflow_deepspeed.engine import CHECKPOINT_META, CHECKPOINT_TAG, DeepSpeedTrainEngine
from asyncflow_deepspeed.opbuild import lock_note, prepare_ops


def _rank_engine(kwargs: dict[str, Any], context: RankContext) -> DeepSpeedTrainEngine:
    return DeepSpeedTrainEngine(
        **kwargs,
        init_method=context.init_method,
        rank=context.rank,
        world_size=context.world_size,
        name=f"{kwargs.get('name', 'deepspeed-trainer')}-rank{context.rank}",
    )


def launch(
    model: Any,
    world_size: int,
    *,
    threads: int | None = 1,
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    **kwargs: Any,
) -> SPMDTrainEngine:
    """``world_size`` rank processes, each a ``DeepSpeedTrainEngine(model, **kwargs)``, driven
    as one ``TrainEngine`` from this process (``asyncflow_core.engines.process.SPMDTrainEngine``:
    the batch is split over the ranks, rank 0 exports the weights). ``threads``: torch threads per
    rank. ``model`` and ``kwargs`` must pickle. Checks that DeepSpeed is installed first.

    The ops DeepSpeed compiles on first use (on CPU its ``deepspeed_shm_comm``, minutes on a
    busy machine) are built here, before the ranks start and ``start_timeout_s`` runs, with
    progress on stderr; a build lock that no live build holds fails the launch at once, naming
    the file to remove (``asyncflow_deepspeed.opbuild``)."""
    require_deepspeed()
    for key in ("init_method", "rank", "world_size"):
        if key in kwargs:
            raise TypeError(f"launch() sets {key} itself; do not pass it")
    try:
        accelerator: str | None = select_platform(kwargs.get("platform")).deepspeed_accelerator
    except AsyncFlowError:  # each rank raises it, as it would without this step
        accelerator = None
    if accelerator is not None:
        prepare_ops(accelerator, who="asyncflow_deepspeed.launch")
    factory = functools.partial(_rank_engine, {"model": model, **kwargs})
    try:
        return SPMDTrainEngine(
            factory,
            world_size,
            threads=threads,
            name=str(kwargs.get("name", "deepspeed-trainer")),
            start_timeout_s=start_timeout_s,
        )
    except EngineError as e:  # e.g. the start timeout: a build lock a rank waited on?
        note = lock_note(accelerator) if accelerator is not None else None
        if note is not None:
            e.add_note(note)
        raise


__all__ = [
    "CHECKPOINT_META",
    "CHECKPOINT_TAG",
    "TESTED",
    "DeepSpeedTrainEngine",
    "check_version",
    "launch",
    "require_deepspeed",
]
