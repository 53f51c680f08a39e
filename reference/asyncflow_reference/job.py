"""Deprecated: the main job moved out of the reference backend (issue #26). Its run loop,
config and command are ``asyncflow_core.job``; the reference workloads, their config class
and the ``torch`` engine factories are ``asyncflow_reference.workloads``. This module
re-exports them for one release, with ``RunConfig`` bound to ``ReferenceRunConfig`` (the
reference workloads' config, which has the old ``task.*`` and ``model.*`` keys). Gone: the
``hf`` workload's keys (``model.path``, ``data.*``, ``reward``) live in
``asyncflow_hf.config.HFRunConfig``; read any config with
``asyncflow_core.job.load_run_config``."""

from __future__ import annotations

import warnings

from asyncflow_core.job import (
    RESUME_KEYS,
    AgentSection,
    CheckpointSection,
    RLSection,
    RolloutSection,
    RunOutput,
    RunPreempted,
    RunSummary,
    RuntimeSection,
    StepProgress,
    TrainSection,
    format_summary,
    main_job,
    make_workload,
    plot_rewards,
    run,
)
from asyncflow_reference.workloads import (
    AgentWorkload,
    DigitsWorkload,
    ModelSection,
    TaskSection,
    torch_rollout,
    torch_trainer,
)
from asyncflow_reference.workloads import ReferenceRunConfig as RunConfig

warnings.warn(
    "asyncflow_reference.job is deprecated: import the main job from asyncflow_core.job and "
    "the reference workloads from asyncflow_reference.workloads (RunConfig there is "
    "ReferenceRunConfig)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "RESUME_KEYS",
    "AgentSection",
    "AgentWorkload",
    "CheckpointSection",
    "DigitsWorkload",
    "ModelSection",
    "RLSection",
    "RolloutSection",
    "RunConfig",
    "RunOutput",
    "RunPreempted",
    "RunSummary",
    "RuntimeSection",
    "StepProgress",
    "TaskSection",
    "TrainSection",
    "format_summary",
    "main_job",
    "make_workload",
    "plot_rewards",
    "run",
    "torch_rollout",
    "torch_trainer",
]
