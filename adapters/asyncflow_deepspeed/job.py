"""The ``deepspeed`` trainer of the main job (``train.engine = "deepspeed"``, registered in
the ``asyncflow.train_engines`` entry-point group): ``DeepSpeedTrainEngine`` over the
workload's model, any ``torch.nn.Module`` (the reference model or a Hugging Face one), with
``train.zero_stage``, ``train.dtype`` and ``train.ranks`` (rank processes via ``launch``)."""

from __future__ import annotations

from typing import Any

from asyncflow_core.contracts.protocols import TrainEngine
from asyncflow_core.engines import registry


def job_trainer(model: Any, *, cfg: Any, threads: int, platform: str) -> TrainEngine:
    import asyncflow_deepspeed

    t = cfg.train
    options: dict[str, Any] = {
        **registry.trainer_options(cfg),
        "zero_stage": t.zero_stage,
        "dtype": t.dtype,
        "platform": platform,
    }
    if t.ranks > 1 or cfg.train_process():
        return asyncflow_deepspeed.launch(model, t.ranks, threads=threads, **options)
    return asyncflow_deepspeed.DeepSpeedTrainEngine(model, threads=threads, **options)
