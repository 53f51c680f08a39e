"""The main job, asyncflow run: config, run loop, engines and runtimes by name, run folder."""

from __future__ import annotations

from asyncflow_core.job.command import main_job
from asyncflow_core.job.config import (
    DEFAULT_WORKLOAD,
    RESUME_KEYS,
    AgentSection,
    CheckpointSection,
    RLSection,
    RolloutSection,
    RunConfig,
    RuntimeSection,
    TrainSection,
    config_class,
    load_run_config,
)
from asyncflow_core.job.report import RunSummary, StepProgress, format_summary, plot_rewards
from asyncflow_core.job.run import (
    Placed,
    RunOutput,
    RunPreempted,
    Runtime,
    local_runtime,
    make_workload,
    run,
)

__all__ = [
    "DEFAULT_WORKLOAD",
    "RESUME_KEYS",
    "AgentSection",
    "CheckpointSection",
    "Placed",
    "RLSection",
    "RolloutSection",
    "RunConfig",
    "RunOutput",
    "RunPreempted",
    "RunSummary",
    "Runtime",
    "RuntimeSection",
    "StepProgress",
    "TrainSection",
    "config_class",
    "format_summary",
    "load_run_config",
    "local_runtime",
    "main_job",
    "make_workload",
    "plot_rewards",
    "run",
]
