"""The main job: asynchronous GRPO on the pure-PyTorch reference engines, on CPU.

``asyncflow run`` (and ``make run``) calls ``main_job``: a tiny decoder-only transformer learns
a built-in verifiable task (``asyncflow_reference.tasks``, default: reverse 3 digits) with
asynchronous RL, η = 1 and staged weight sync by default, rollout and training each on their
own thread (one CPU core each). It shows a live progress bar (step, reward, samples/s) on a
terminal, or a plain progress line every 10 s when its output goes to a log (``StepProgress``),
prints a summary table and writes a run folder:

===================== ========================================================================
``config.toml``        the full configuration (re-run it with ``asyncflow run --config``)
``metrics.jsonl``      one record per optimizer step (reward, loss, PPO metrics, staleness)
``trace.json``         every span (Chrome trace: open in https://ui.perfetto.dev)
``summary.json``       the headline figures (see ``RunSummary``)
``reward.png``         the reward curve (with the ``plot`` extra: matplotlib)
``timeline.png``       where the time went, per resource
``checkpoints/``       ``step-N/`` folders: the trainer's files, the job state, the trace so far
===================== ========================================================================

**Checkpoints and resume.** The run checkpoints after every ``checkpoint.every`` steps (but
not within ``checkpoint.min_interval_s`` seconds of the previous one), after the last one,
and on SIGTERM (then it exits with status 0 and says how to resume); each
checkpoint is written atomically and the newest ``checkpoint.keep`` are kept.
``asyncflow run --resume RUN_DIR`` continues from the newest complete checkpoint, with the
run's own ``config.toml``; only ``RESUME_KEYS`` may change with ``--set`` (e.g. ``rl.steps``
to train longer). What a resumed run guarantees (``asyncflow_core.flow.rlflow.RLJob.resume``):
every optimizer step is applied once (the trainer continues from the checkpoint's version;
steps taken after it died with the run), groups trained or dropped as stale before the
checkpoint are never fed again, groups in flight at the checkpoint are regenerated first, then
the prompt stream continues where it was; ``metrics.jsonl`` and the trace continue.

The configuration is ``RunConfig``: typed sections overridable from a TOML file and
``--set section.key=value`` (``asyncflow_core.flow.config``); ``asyncflow run --keys`` lists every
key.

How the run starts: a *format warm-up* (a few seconds of supervised steps on prompts answered
with random digits, ``DigitTask.format_examples``) teaches the answer's shape but not the
task, so the reward starts near chance (0.1); the RL trainer and the rollout engines then
start from those weights at version 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TextIO, cast

import torch

from asyncflow_core.contracts.errors import CheckpointError, ConfigError, TaskFailedError
from asyncflow_core.contracts.protocols import (
    Batch,
    DataStore,
    GenerationRequest,
    InferenceEngine,
    LossFn,
    SamplingParams,
    TrainEngine,
)
from asyncflow_core.engines import registry
from asyncflow_core.engines.process import ProcessInferenceEngine, ProcessTrainEngine
from asyncflow_core.flow.agent import ToolAgentLoop, TrajectoryLimits
from asyncflow_core.flow.config import keys, load_config, to_toml
from asyncflow_core.flow.rlflow import (
    JobState,
    MakeStaged,
    RLConfig,
    RLEngines,
    RLJob,
    RLResult,
    StepRecord,
)
from asyncflow_core.flow.tools import ToolRunner
from asyncflow_core.flow.workflow import PipelineResult
from asyncflow_core.infra.checkpoint import Checkpoints
from asyncflow_core.infra.platform import Platform, get_platform, select_platform
from asyncflow_core.observability import trace as tracing
from asyncflow_core.observability.trace import Tracer
from asyncflow_core.training.rl import (
    LOSS_MASK,
    DecoupledPPOLoss,
    PPOClipLoss,
    policy_gradient_loss,
)
from asyncflow_reference import agentic
from asyncflow_reference.agentic import TASKS as AGENT_TASKS
from asyncflow_reference.agentic import LookupTask, chat_format
from asyncflow_reference.engines import TorchInferenceEngine, TorchTrainEngine
from asyncflow_reference.model import ModelConfig, TransformerLM
from asyncflow_reference.tasks import DigitTask, TaskName

LossName = Literal["pg", "ppo", "decoupled-ppo"]


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TaskSection:
    """The verifiable task and the format warm-up: a digit task (``reverse``, ``sort``,
    ``add``: ``asyncflow_reference.tasks``) or an agentic one, over several turns with a tool
    (``clock``, ``lookup``: ``asyncflow_reference.agentic``; for ``lookup``, ``digits`` is the
    phone numbers' length). ``--set task=clock`` is short for ``--set task.name=clock``."""

    name: Literal["reverse", "sort", "add", "clock", "lookup"] = "reverse"
    digits: int = 3
    warmup_steps: int = 60
    warmup_batch: int = 128

    def validate(self) -> None:
        if self.name == "lookup":
            LookupTask(self.digits)  # raises ConfigError naming the field
        elif self.name != "clock":
            DigitTask(self.name, self.digits)  # raises ConfigError naming the field
        if self.warmup_steps < 0 or self.warmup_batch < 1:
            raise ConfigError(
                f"task.warmup_steps must be >= 0 and task.warmup_batch >= 1, got "
                f"{self.warmup_steps} and {self.warmup_batch}"
            )


@dataclass(frozen=True)
class ModelSection:
    """The policy. ``digits``: a ``TransformerLM`` of this shape (vocabulary and context
    length come from the task). ``hf``: a Hugging Face causal LM from ``path`` or ``name``."""

    path: str = ""
    """hf: a local model folder (``from_pretrained``; safetensors only, never the hub), with
    its tokenizer (and chat template, if any)."""
    name: str = ""
    """hf: a named tiny config, random init from ``seed`` (``tiny-qwen2``, ``tiny-llama``),
    with the tokenizer built for the shipped data."""
    trust_remote_code: bool = False
    """hf: let the model folder run its own code (off: a folder needing it is refused)."""
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int | None = None
    init_std: float = 0.1
    """Normal init std of embeddings and linear weights: 0.1 (not GPT-2's 0.02) makes the
    position embeddings distinct enough from the start that RL finds the digit-copying
    attention within ~40 steps on every seed tried (0.02: 40 to over 200 steps)."""


@dataclass(frozen=True)
class DataSection:
    """hf: the prompts, from a local JSONL or parquet file read with ``datasets``."""

    path: str = ""
    """The data file (or folder); empty: the shipped synthetic GSM8K-style problems,
    generated into the run folder (``data.jsonl``)."""
    prompt_field: str = "question"
    messages_field: str = ""
    """A field of chat messages (``[{"role": ..., "content": ...}]``), used instead of
    ``prompt_field`` when set."""
    answer_field: str = "answer"
    """What the built-in math reward compares with (GSM8K ``#### N`` or a number)."""
    system_prompt: str = ""
    max_tokens: int = 16
    """The response cap (tokens)."""
    limit: int = 0
    """Use the first ``limit`` rows only (0: all)."""
    difficulty: int = 1
    """Shipped data only: 1 (one + or -), 2 (also x and /), 3 (two operations)."""


@dataclass(frozen=True)
class RolloutSection:
    """Rollout engines and sampling."""

    engine: str = "auto"
    """The rollout engine (``asyncflow_core.engines.registry``): ``torch`` (the reference engine),
    ``hf`` (transformers' continuous batching) or a plugin's; ``auto``: the workload's."""
    engines: int = 1
    process: bool = False
    """Run each rollout engine in a child process of its own (``ProcessInferenceEngine``):
    it then does not share the interpreter lock with the trainer, and an engine process that
    dies is survived (its requests go to the other engines). Off by default: one process."""
    max_batch: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def validate(self) -> None:
        if self.engines < 1:
            raise ConfigError(f"rollout.engines must be >= 1, got {self.engines}")
        if not self.temperature > 0:
            raise ConfigError(
                f"rollout.temperature must be > 0 for RL (sampling explores), got "
                f"{self.temperature}"
            )


@dataclass(frozen=True)
class TrainSection:
    """The trainer and its objective: ``pg`` (REINFORCE with group advantages), ``ppo``
    (PPO-clip against the rollout's log-probs) or ``decoupled-ppo`` (AReaL's: the trust region
    around the trainer's own proximal log-probs, importance-weighted to the rollout's)."""

    loss: LossName = "ppo"
    lr: float = 2e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch_size: int = 256
    clip: float = 0.2
    kl_coef: float = 0.0
    process: bool | Literal["auto"] = "auto"
    """Run the trainer in a child process of its own (``asyncflow_core.engines.process``): it then
    does not share the interpreter lock with rollout and the store, which is what limits the
    async run's throughput on CPU. ``auto`` (the default): a child process for the reference
    ``torch`` trainer on the local runtime, this process for the others (``hf``,
    ``deepspeed``: its ``ranks`` decide; Ray runs the trainer in an actor). ``false``: the
    whole job in one process, where ``breakpoint()`` works anywhere (``RunConfig
    .train_process()`` resolves it)."""
    engine: str = "auto"
    """The trainer (``asyncflow_core.engines.registry``): ``torch`` (the reference trainer,
    ``TorchTrainEngine``), ``hf`` (``HFTrainEngine``, for an HF model), ``deepspeed`` (the
    DeepSpeed adapter, needs the ``[deepspeed]`` extra; trains either model) with
    ``zero_stage``, ``dtype`` and ``ranks`` below, or a plugin's; ``auto``: the workload's."""
    zero_stage: int = 0
    """deepspeed only: the ZeRO stage (0-3)."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """deepspeed only: the training precision."""
    ranks: int = 1
    """deepspeed only: data-parallel rank processes (``asyncflow_deepspeed.launch``); 1 keeps
    the trainer in this process unless ``process`` is set."""
    lr_warmup_steps: int | None = None
    """Reach ``lr`` linearly over this many first steps (``AdamWTrainer``: the torch and hf
    trainers). None: 20 for the agentic tasks, 0 otherwise. A fresh AdamW's first steps move
    every weight by about ``lr``; after the clock task's warm-up, one such step at 2e-3 took
    the rate of calling the tool from 75% to 1%, on every seed tried, and nothing was learnt."""
    minibatches: int = 1
    """torch and hf trainers: optimizer steps per ``train_step`` (PPO's minibatches, AReaL's
    ``ppo_n_minibatches``): the batch is cut into this many and each takes a step of its own,
    the version still adding 1 per batch. With 1 (the default) a clipped loss's trust region
    never engages (every ratio is 1 against the proximal policy at the one step), and decoupled
    PPO is an importance-weighted policy gradient with no trust region at all."""
    is_cap: float | None = 2.0
    """decoupled-ppo only (ignored otherwise): truncate the importance weight π_prox/π_behav at
    this value (none: uncapped). At η = 4 on the default task, uncapped stalled near 0.17
    reward on seed 1 and reached 0.70 on seed 0; capped at 2 it reached 0.997."""


@dataclass(frozen=True)
class RLSection:
    """The RL loop (``asyncflow_core.flow.rlflow.RLConfig``)."""

    mode: Literal["async", "colocated"] = "async"
    steps: int = 120
    prompts_per_step: int = 32
    n: int = 8
    staleness: int = 1
    weight_sync: Literal["blocking", "staged", "inflight"] = "staged"
    sync_every: int = 1
    partial_rollout: bool = False


@dataclass(frozen=True)
class AgentSection:
    """Agentic tasks only (``task.name = "clock"`` or ``"lookup"``): the trajectories' limits,
    the tools and stale trajectories."""

    max_turns: int = 3
    """Assistant turns per trajectory."""
    max_total_tokens: int = 96
    """Tokens of a whole trajectory (prompt, tool answers and generated turns); also the
    model's context length. Context that would pass it ends the trajectory (never cut)."""
    max_turn_tokens: int = 16
    """Generated tokens per turn; a turn cut there ends the trajectory."""
    tool_timeout_s: float = 10.0
    tool_concurrency: int = 64
    """Tool calls running at once across all trajectories."""
    max_restarts: int = 2
    """Times a trajectory that became too stale to train before its next turn is
    regenerated from its prompt (``RLConfig.max_restarts``)."""

    def validate(self) -> None:
        for name in ("max_turns", "max_total_tokens", "max_turn_tokens", "tool_concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError(f"agent.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_restarts < 0:
            raise ConfigError(f"agent.max_restarts must be >= 0, got {self.max_restarts}")
        if not self.tool_timeout_s > 0:
            raise ConfigError(f"agent.tool_timeout_s must be > 0, got {self.tool_timeout_s}")

    def limits(self) -> TrajectoryLimits:
        return TrajectoryLimits(self.max_turns, self.max_total_tokens, self.max_turn_tokens)


@dataclass(frozen=True)
class RuntimeSection:
    """Where the job runs. ``local``: one process (the store in memory, each engine on a
    thread of its own; ``breakpoint()`` works anywhere). ``ray`` (the ``[ray]`` extra): the
    same job with every engine in an actor of its own (``asyncflow_ray``), on the cluster at
    ``address`` (empty: start a local cluster for the run and stop it after; ``auto``: the
    cluster started on this node with ``ray start``; ``HOST:PORT``: that cluster's head).

    ``store`` (Ray only): ``driver`` (default) keeps the store in the driver's memory, where
    the job's stage tasks run: every row passes through the driver anyway (generations come
    back to it, batches leave it for the trainer), so rows cross the network once per
    direction and the store costs no actor calls. ``ray``: a ``RayDataStore`` (a controller
    actor plus ``storage_units`` unit actors), for runs whose store other processes read too;
    each stage's put, lease, read and ack are then actor calls (measured ~10x slower on one
    2-core box: ``benchmarks/ray_runtime.py``).

    ``rollout_restarts`` (Ray only): how many times Ray may restart each rollout actor that
    dies (``RayInferenceEngine.create(max_restarts=)``). Its requests go to the other rollout
    engines at once; once the actor is back, the job loads the trainer's weights into the
    fresh engine between two updates and routes to it again (``RLJob``: async mode, and no
    blocking sync that drains). 0: a dead rollout actor stays lost."""

    kind: Literal["local", "ray"] = "local"
    address: str = ""
    store: Literal["driver", "ray"] = "driver"
    storage_units: int = 2
    rollout_restarts: int = 0

    def validate(self) -> None:
        if self.kind not in ("local", "ray"):
            raise ConfigError(f"runtime.kind must be 'local' or 'ray', got {self.kind!r}")
        if self.store not in ("driver", "ray"):
            raise ConfigError(
                f"runtime.store must be 'driver' (the store in the driver's memory) or 'ray' "
                f"(a RayDataStore of actors), got {self.store!r}"
            )
        if self.kind == "local" and (
            self.address or self.store != "driver" or self.rollout_restarts
        ):  # fmt: skip
            raise ConfigError(
                "runtime.address, runtime.store and runtime.rollout_restarts apply to "
                "runtime.kind = 'ray'"
            )
        if isinstance(self.rollout_restarts, bool) or not isinstance(
            self.rollout_restarts, int
        ) or self.rollout_restarts < 0:  # fmt: skip
            raise ConfigError(
                f"runtime.rollout_restarts must be an int >= 0, got {self.rollout_restarts!r}"
            )
        if self.storage_units < 1:
            raise ConfigError(f"runtime.storage_units must be >= 1, got {self.storage_units}")
        if self.store != "ray" and self.storage_units != 2:
            raise ConfigError(
                "runtime.storage_units applies to runtime.store = 'ray' (the default store, "
                "'driver', has no unit actors); add --set runtime.store=ray"
            )
        if self.kind == "ray":
            import importlib.util

            if importlib.util.find_spec("ray") is None:
                raise ConfigError(
                    "runtime.kind = 'ray' needs Ray: pip install 'asyncflow[ray]' (tested with "
                    "ray 2.60)"
                )


@dataclass(frozen=True)
class CheckpointSection:
    """Checkpoints in the run folder's ``checkpoints/``, for ``asyncflow run --resume
    RUN_DIR``: after every ``every`` optimizer steps (0: none on the way) but no sooner than
    ``min_interval_s`` seconds after the previous one (the run's start counts as one), after
    the last step, and on SIGTERM; the newest ``keep`` are kept. A run of 0.1-s steps would
    otherwise spend 6-12% of its time writing checkpoints; set ``min_interval_s = 0`` for
    every ``every`` steps whatever their length."""

    every: int = 10
    keep: int = 3
    min_interval_s: float = 60.0

    def validate(self) -> None:
        if self.every < 0:
            raise ConfigError(
                f"checkpoint.every must be >= 0 (0: no periodic ones), got {self.every}"
            )
        if not 0 <= self.min_interval_s < math.inf:
            raise ConfigError(
                f"checkpoint.min_interval_s must be a number of seconds >= 0, got "
                f"{self.min_interval_s}"
            )
        if self.keep < 1:
            raise ConfigError(f"checkpoint.keep must be >= 1, got {self.keep}")


RESUME_KEYS = (
    "rl.steps", "eval_prompts", "threads", "checkpoint.every", "checkpoint.keep",
    "checkpoint.min_interval_s",
    "rollout.engines", "rollout.max_batch", "rollout.process", "train.process", "runtime.kind",
    "runtime.address", "runtime.store",
    "runtime.storage_units", "runtime.rollout_restarts",
)  # fmt: skip
"""The config keys ``asyncflow run --resume`` lets ``--set`` change: how long to train, where
and on how many processes. Every other key shapes the model, the data order, the optimizer
(whose state the checkpoint holds) or the objective, so it stays the run's."""


@dataclass(frozen=True)
class RunConfig:
    """Everything ``asyncflow run`` does. ``threads``: torch threads per engine (0 = auto:
    async gives rollout and training one core each; colocated gives each phase every core)."""

    seed: int = 0
    workload: str = "auto"
    """What is trained (``asyncflow_core.engines.registry``): ``digits`` (the reference model on a
    built-in digit task), ``hf`` (a Hugging Face model on a dataset with a reward) or a
    plugin's; ``auto``: ``hf`` when ``model.path`` or ``model.name`` is set, else
    ``digits``."""
    reward: str = ""
    """hf: the reward, ``package.module:function`` (``reward(completion, row) -> float``,
    sync, async or batched: ``asyncflow_hf.reward``); empty: the built-in math reward."""
    reward_timeout_s: float = 30.0
    """hf: seconds a reward call may take; a reward that raises, hangs past this or returns a
    non-number fails its row (logged; the row trains nothing) and the run goes on."""
    threads: int = 0
    platform: str = "auto"
    """Where the trainer computes (``asyncflow_core.infra.platform``): ``auto`` (the best platform
    that runs here, ``cpu`` without an accelerator), ``cpu``, ``cuda``, ``npu`` (Ascend, the
    ``[ascend]`` extra) or a plugin's name. A named platform that cannot run here is refused
    before anything starts. It applies to ``train.engine = "deepspeed"`` (DeepSpeed's
    accelerator and collective backend); the reference engines compute on CPU."""
    eval_prompts: int = 256
    task: TaskSection = field(default_factory=TaskSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    train: TrainSection = field(default_factory=TrainSection)
    rl: RLSection = field(default_factory=RLSection)
    agent: AgentSection = field(default_factory=AgentSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)

    def validate(self) -> None:
        t = self.train
        self.runtime.validate()
        self.checkpoint.validate()
        if t.kl_coef:
            raise ConfigError(
                "train.kl_coef > 0 needs a reference policy, which the main job does not run; "
                "leave it 0, or compose the job in Python with RLEngines.reference "
                "(docs/rl-jobs.md)"
            )
        workload = self.workload_name()
        train_engine = self.engine_names()[1]
        if self.runtime.kind == "ray" and self.rollout.process:
            raise ConfigError(
                "runtime.kind = 'ray' runs every rollout engine in an actor of its own already; "
                "rollout.process = true is for runtime.kind = 'local'"
            )
        if self.runtime.kind == "ray" and (train_engine == "deepspeed" or t.process is True):
            raise ConfigError(
                "runtime.kind = 'ray' runs the trainer in an actor of its own; "
                "train.engine = 'deepspeed' and train.process = true are for runtime.kind = "
                "'local'"
            )
        if train_engine != "deepspeed" and (t.zero_stage, t.ranks) != (0, 1):
            raise ConfigError(
                "train.zero_stage and train.ranks apply to train.engine = 'deepspeed'; the "
                f"{train_engine} trainer is one process"
            )
        if train_engine not in ("deepspeed", "hf") and t.dtype != "fp32":
            raise ConfigError(
                "train.dtype applies to train.engine = 'deepspeed' or 'hf'; the "
                f"{train_engine} trainer is fp32"
            )
        if self.runtime.kind == "ray" and workload != "digits":
            raise ConfigError(
                f"runtime.kind = 'ray' runs the digits workload only so far (workload "
                f"{workload!r} has not been tried on Ray); use runtime.kind = 'local'"
            )
        if workload in ("digits", "agent"):
            m, d = self.model, self.data
            if m.path or m.name or m.trust_remote_code or d != DataSection() or self.reward:
                raise ConfigError(
                    "model.path, model.name, model.trust_remote_code, data.* and reward apply "
                    f"to workload = 'hf' (a Hugging Face model); the {workload} workload trains "
                    "the reference model on task.*"
                )
        agentic = self.task.name in AGENT_TASKS
        if agentic and workload not in ("digits", "agent"):
            raise ConfigError(
                f"task.name = {self.task.name!r} runs on the reference model (the agent "
                f"workload); the {workload} workload does not run agentic tasks yet (an agent "
                "loop over a Hugging Face model is composed in Python: docs/agents.md)"
            )
        if workload in ("digits", "agent") and (workload == "agent") != agentic:
            raise ConfigError(
                f"workload {workload!r} and task.name = {self.task.name!r} do not go together: "
                f"the agent workload runs task.name = {' or '.join(map(repr, AGENT_TASKS))}, "
                "the digits workload the others (leave workload = 'auto')"
            )
        if workload != "agent" and self.agent != AgentSection():
            raise ConfigError(
                "agent.* apply to the agentic tasks (task.name = 'clock' or 'lookup'); the "
                f"{workload} workload is single-turn"
            )
        if not self.reward_timeout_s > 0:
            raise ConfigError(f"reward_timeout_s must be > 0, got {self.reward_timeout_s}")
        if isinstance(t.minibatches, bool) or not isinstance(t.minibatches, int) or (
            t.minibatches < 1
        ):  # fmt: skip
            raise ConfigError(f"train.minibatches must be an int >= 1, got {t.minibatches!r}")
        if train_engine == "deepspeed" and t.minibatches != 1:
            raise ConfigError(
                "train.minibatches applies to the torch and hf trainers; the DeepSpeed trainer "
                "takes one step per batch"
            )
        if t.lr_warmup_steps is not None and t.lr_warmup_steps < 0:
            raise ConfigError(f"train.lr_warmup_steps must be >= 0, got {t.lr_warmup_steps}")
        if train_engine == "deepspeed" and self.lr_warmup_steps():
            raise ConfigError(
                "train.lr_warmup_steps applies to the torch and hf trainers (DeepSpeed's own "
                "schedulers are not wired); set it to 0 with train.engine = 'deepspeed'"
            )
        if t.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"train.zero_stage must be 0, 1, 2 or 3, got {t.zero_stage!r}")
        if t.dtype not in ("fp32", "bf16"):
            raise ConfigError(f"train.dtype must be 'fp32' or 'bf16', got {t.dtype!r}")
        if t.ranks < 1:
            raise ConfigError(f"train.ranks must be >= 1, got {t.ranks}")
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0 (0 = auto), got {self.threads}")
        self.trainer_platform()
        if self.eval_prompts < 0:
            raise ConfigError(f"eval_prompts must be >= 0, got {self.eval_prompts}")
        self.rl_config().validate()

    def lr_warmup_steps(self) -> int:
        """``train.lr_warmup_steps`` resolved (None: 20 for the agentic tasks, else 0)."""
        steps = self.train.lr_warmup_steps
        if steps is None:
            return 20 if self.task.name in AGENT_TASKS else 0
        return steps

    def workload_name(self) -> str:
        """``workload`` resolved (``auto``: ``hf`` when a model path or name is set)."""
        if self.workload != "auto":
            registry.get("workload", self.workload)  # an unknown name fails here
            return self.workload
        if self.model.path or self.model.name:
            return "hf"
        return "agent" if self.task.name in AGENT_TASKS else "digits"

    def train_process(self) -> bool:
        """``train.process`` resolved: ``auto`` is a child process for the ``torch`` trainer
        on the local runtime, this process otherwise."""
        if self.train.process != "auto":
            return self.train.process
        return self.runtime.kind == "local" and self.engine_names()[1] == "torch"

    def engine_names(self) -> tuple[str, str]:
        """``(rollout.engine, train.engine)`` resolved (``auto``: the workload's), each
        checked against the registry."""
        default = registry.get("workload", self.workload_name())
        rollout = self.rollout.engine
        if rollout == "auto":
            rollout = str(getattr(default, "rollout_engine", "torch"))
        train = self.train.engine
        if train == "auto":
            train = str(getattr(default, "train_engine", "torch"))
        registry.get("rollout", rollout)
        registry.get("trainer", train)
        return rollout, train

    # -- derived ----------------------------------------------------------------------------
    def trainer_platform(self) -> Platform:
        """The platform the trainer runs on: ``platform`` resolved (a named one that cannot
        run here raises ``PlatformUnavailableError``, a ``ConfigError``); ``cpu`` for the
        reference trainer, which refuses a named accelerator rather than ignore it."""
        chosen = select_platform(self.platform)
        if self.engine_names()[1] != "deepspeed":
            if self.platform != "auto" and chosen.name != "cpu":
                raise ConfigError(
                    f"platform = {self.platform!r} applies to train.engine = 'deepspeed'; the "
                    f"{self.engine_names()[1]} trainer (train.engine = "
                    f"{self.engine_names()[1]!r}) computes on CPU: set train.engine = "
                    "'deepspeed', or platform = 'cpu' / 'auto'"
                )
            return get_platform("cpu")
        return chosen

    def task_spec(self) -> DigitTask:
        if self.task.name in AGENT_TASKS:
            raise ConfigError(
                f"task.name = {self.task.name!r} is an agentic task, not a digit task "
                "(AgentWorkload)"
            )
        return DigitTask(cast(TaskName, self.task.name), self.task.digits)

    def model_config(self) -> ModelConfig:
        t = self.task_spec()
        m = self.model
        return ModelConfig(
            vocab_size=t.vocab_size, d_model=m.d_model, n_layers=m.n_layers, n_heads=m.n_heads,
            d_ff=m.d_ff, max_seq_len=t.prompt_len + t.max_tokens, init_std=m.init_std,
        )  # fmt: skip

    def sampling(self) -> SamplingParams:
        t = self.task_spec()
        r = self.rollout
        return SamplingParams(
            max_tokens=t.max_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            stop_token_ids=t.stop_token_ids,
        )  # fmt: skip

    def rl_config(self, sampling: SamplingParams | None = None) -> RLConfig:
        """The RL loop's config, with ``sampling`` (the workload's; default: the digit
        task's for ``digits``, ``data.max_tokens`` for other workloads)."""
        if sampling is None:
            if self.workload_name() == "agent":
                r = self.rollout
                sampling = SamplingParams(
                    max_tokens=self.agent.max_turn_tokens, temperature=r.temperature,
                    top_p=r.top_p, top_k=r.top_k, stop_token_ids=chat_format().stop_token_ids,
                )  # fmt: skip
            elif self.workload_name() == "digits":
                sampling = self.sampling()
            else:
                r = self.rollout
                sampling = SamplingParams(
                    max_tokens=self.data.max_tokens, temperature=r.temperature,
                    top_p=r.top_p, top_k=r.top_k,
                )  # fmt: skip
        rl = self.rl
        colocated = rl.mode == "colocated"
        return RLConfig(
            steps=rl.steps, prompts_per_step=rl.prompts_per_step, n=rl.n,
            staleness=0 if colocated else rl.staleness,
            weight_sync="blocking" if colocated else rl.weight_sync,
            sync_every=1 if colocated else rl.sync_every, partial_rollout=rl.partial_rollout,
            mode=rl.mode, sampling=sampling,
            proximal_logprobs=self.train.loss == "decoupled-ppo",
            trajectory_limits=self.agent.limits(), max_restarts=self.agent.max_restarts,
            checkpoint_every=self.checkpoint.every,
            checkpoint_min_interval_s=self.checkpoint.min_interval_s,
        )  # fmt: skip

    def loss_fn(self) -> LossFn:
        t = self.train
        if t.loss == "pg":
            if t.kl_coef:
                raise ConfigError("train.kl_coef needs train.loss = 'ppo' or 'decoupled-ppo'")
            return policy_gradient_loss
        if t.loss == "ppo":
            return PPOClipLoss(clip_low=t.clip, kl_coef=t.kl_coef)
        return DecoupledPPOLoss(clip_low=t.clip, kl_coef=t.kl_coef, tis_cap=t.is_cap)


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunSummary:
    """The headline figures of a run (``summary.json``). Rewards: means over the first and
    last 10% of steps (at least one step each); ``eval_*``: greedy decoding on
    ``eval_prompts`` fresh prompts after training. ``bubble_ratio``: idle fraction per
    resource over the RL phase; ``staleness_hist``: trained samples per weight-version lag."""

    mode: str
    staleness: int
    loss: str
    task: str
    steps: int
    samples: int
    tokens: int
    dropped: int
    wall_s: float
    warmup_s: float
    samples_per_s: float
    tokens_per_s: float
    reward_first: float
    reward_last: float
    eval_reward: float | None
    eval_exact: float | None
    bubble_ratio: dict[str, float]
    staleness_hist: dict[str, int]
    sync_exposed_s: float
    sync_hidden_s: float
    threads: int
    trainer: str = "thread"
    """Where the trainer ran: ``thread`` (this process) or ``process`` (``train.process``);
    for ``train.engine = "deepspeed"``, the stage, precision and ranks as well."""
    platform: str = "cpu"
    """The trainer's platform (``RunConfig.trainer_platform()``)."""
    runtime: str = "local"
    """``local``, or ``ray`` with the cluster's nodes and the store's units."""
    extra: dict[str, Any] = field(default_factory=dict)
    """What the workload reported at the end (hf: where the policy was saved, failed
    rewards)."""

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunOutput:
    summary: RunSummary
    result: RLResult
    out_dir: Path | None


class RunPreempted(Exception):
    """``run(preemptible=True)`` got SIGTERM: it wrote ``checkpoint`` (after ``steps`` steps
    in all) and the run folder's trace and metrics so far, and stopped."""

    def __init__(self, checkpoint: Path, steps: int) -> None:
        super().__init__(f"preempted after {steps} steps; checkpoint {checkpoint}")
        self.checkpoint = checkpoint
        self.steps = steps


RUN_STATE_FILE = "run.json"
TRACE_FILE = "trace.json.gz"  # checkpoints before trace segments: the whole trace in one file
_SEGMENT = re.compile(r"trace-\d{4}\.json\.gz")


class _RunFiles:
    """The main job's files in each checkpoint: the trace so far, where its clock was, the
    RNG states and the warm-up time (``run.json``).

    The trace is kept in segments, ``trace-NNNN.json.gz``: each checkpoint writes only the
    spans recorded since the previous one and hard-links (or copies, where the file system
    cannot link) the earlier segments from the previous checkpoint, so a checkpoint costs
    what happened since the last one, not the whole run so far (the whole trace, rewritten
    every ``checkpoint.every`` steps, was a fifth of a 120-step run's wall time). Every
    checkpoint still holds its whole trace: deleting older ones loses nothing."""

    def __init__(
        self,
        checkpoints: Path,
        *,
        tracer: Tracer,
        warmup_s: float,
        resumed_at: list[int],
        segments: Sequence[str] = (),
    ) -> None:
        self.checkpoints, self.tracer = checkpoints, tracer
        self.warmup_s, self.resumed_at = warmup_s, resumed_at
        # what the newest checkpoint holds: its segments, and the trace mark they end at
        self.segments = list(segments)
        self.written = tracer.mark() if segments else tracing.START

    def __call__(self, folder: Path) -> None:
        previous = Checkpoints(self.checkpoints).latest()
        try:
            held = _trace_segments(_run_state(previous)) if previous is not None else None
        except ConfigError:  # its run.json is unreadable: start the trace over
            held = None
        if held != self.segments or previous is None:  # not the checkpoint we wrote last
            self.segments, self.written = [], tracing.START
        try:
            for name in self.segments:
                assert previous is not None
                try:
                    os.link(previous / name, folder / name)
                except OSError:  # a file system without hard links
                    shutil.copyfile(previous / name, folder / name)
        except OSError:  # a segment of the previous checkpoint is gone: the whole trace
            for name in self.segments:
                (folder / name).unlink(missing_ok=True)
            self.segments, self.written = [], tracing.START
        end = self.tracer.mark()
        name = f"trace-{len(self.segments):04d}.json.gz"
        self.tracer.write_chrome_trace(folder / name, since=self.written, until=end)
        state = {
            "format": "asyncflow-run/1",
            "trace_s": self.tracer.now(),
            "trace_segments": [*self.segments, name],
            "warmup_s": self.warmup_s,
            "resumed_at": self.resumed_at,
            "rng": {"torch": torch.get_rng_state().tolist(), "python": random.getstate()},
        }
        (folder / RUN_STATE_FILE).write_text(json.dumps(state) + "\n")
        self.segments.append(name)
        self.written = end


def _run_state(folder: Path) -> dict[str, Any]:
    try:
        state = json.loads((folder / RUN_STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{folder / RUN_STATE_FILE} is not readable: {e}") from e
    if not isinstance(state, dict):
        raise ConfigError(f"{folder / RUN_STATE_FILE} is not a JSON object")
    return state


def _trace_segments(run_state: Mapping[str, Any]) -> list[str] | None:
    """The trace segment files a checkpoint's ``run.json`` lists (None: a checkpoint of one
    whole ``trace.json.gz``); ``ConfigError`` for a name that is not a segment's."""
    names = run_state.get("trace_segments")
    if names is None:
        return None
    if not isinstance(names, list) or not all(
        isinstance(n, str) and _SEGMENT.fullmatch(n) for n in names
    ):
        raise ConfigError(
            f"run.json: trace_segments must be a list of trace-NNNN.json.gz names, got "
            f"{names!r:.120}"
        )
    return names


def _load_trace(folder: Path, run_state: Mapping[str, Any]) -> Tracer:
    """A checkpoint's trace: its segments in order, or the one file of older checkpoints."""
    segments = _trace_segments(run_state)
    if segments is None:
        return tracing.load(folder / TRACE_FILE)
    if not segments:
        return Tracer()
    first, *rest = (folder / n for n in segments)
    return tracing.load(first, *rest)


def _log_metrics(
    record: StepRecord,
    *,
    tracer: Tracer,
    out: Path,
    cfg: RunConfig,
    then: Callable[[StepRecord], None] | None,
) -> None:
    """Append the step's metric record to the run folder's ``metrics.jsonl``; at a fresh
    run's first step, start the run folder with its ``config.toml`` (what ``--resume``
    reads): a run that fails before it trained anything writes nothing."""
    if not (out / "config.toml").exists():
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.toml").write_text(to_toml(cfg))
    tracer.write_metrics_jsonl(out / "metrics.jsonl", start=len(tracer.metrics) - 1)
    if then is not None:
        then(record)


def _restore_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))


def _resume_point(cfg: RunConfig, out: Path) -> tuple[Path, JobState, dict[str, Any]]:
    """The newest complete checkpoint of run folder ``out``, its job state and run state;
    ``ConfigError`` when there is none or nothing is left to train."""
    folder = Checkpoints(out / "checkpoints").latest()
    if folder is None:
        raise ConfigError(
            f"--resume {out}: {out / 'checkpoints'} holds no complete checkpoint (the run died "
            f"before its first one, every {cfg.checkpoint.every} steps); start it again"
        )
    state = JobState.read(folder)
    done = state.version - state.origin
    if cfg.rl.steps < done or (cfg.rl.steps == done and (out / "summary.json").exists()):
        raise ConfigError(
            f"--resume {out}: the run already trained {done} steps of rl.steps = "
            f"{cfg.rl.steps}; to train longer, resume with --set rl.steps=N (N > {done})"
        )
    try:
        run_state = _run_state(folder)
        _trace_segments(run_state)
    except ConfigError as e:
        raise ConfigError(f"--resume {out}: {e}") from e
    return folder, state, run_state


def _window_mean(values: Sequence[float], first: bool) -> float:
    k = max(1, math.ceil(len(values) / 10))
    part = values[:k] if first else values[-k:]
    return sum(part) / len(part) if part else math.nan


def _format_batch(task: DigitTask, rng: random.Random, n: int) -> Batch:
    """A supervised warm-up batch: prompts answered with random digits, advantage 1 (so the
    policy-gradient loss is the response's negative log-likelihood)."""
    pairs = task.format_examples(rng, n)
    prompts = torch.tensor([p for p, _ in pairs], dtype=torch.long)
    responses = torch.tensor([r for _, r in pairs], dtype=torch.long)
    return Batch(
        rows=tuple(range(n)),
        data={"prompt": prompts, "response": responses, "advantage": torch.ones(n)},
        lengths={
            "prompt": torch.full((n,), prompts.shape[1], dtype=torch.long),
            "response": torch.full((n,), responses.shape[1], dtype=torch.long),
        },
    )


async def _warm_up(cfg: RunConfig, model: TransformerLM) -> TransformerLM:
    task = cfg.task_spec()
    if not cfg.task.warmup_steps:
        return model
    trainer = TorchTrainEngine(model, lr=cfg.train.lr, seed=cfg.seed, name="warm-up")
    rng = random.Random(cfg.seed + 1)
    try:
        for _ in range(cfg.task.warmup_steps):
            await trainer.train_step(
                _format_batch(task, rng, cfg.task.warmup_batch), policy_gradient_loss
            )
        return trainer.model
    finally:
        await trainer.close()


async def _evaluate(
    task: DigitTask, engine: InferenceEngine, count: int, seed: int
) -> tuple[float, float]:
    """Greedy decoding on ``count`` fresh prompts (a seed the training stream never used)."""
    params = SamplingParams(
        max_tokens=task.max_tokens, temperature=0.0, stop_token_ids=task.stop_token_ids
    )
    stream = task.prompts(seed=seed)
    prompts = [next(stream) for _ in range(count)]
    results = await asyncio.gather(
        *(engine.generate(GenerationRequest(f"eval-{i}", p, params)) for i, p in enumerate(prompts))
    )
    scores = [task.score(p, r.tokens) for p, r in zip(prompts, results, strict=True)]
    return (
        sum(s for s, _ in scores) / len(scores),
        sum(1.0 for _, exact in scores if exact) / len(scores),
    )


def _threads(cfg: RunConfig) -> int:
    if cfg.threads:
        return cfg.threads
    cores = os.cpu_count() or 1
    return cores if cfg.rl.mode == "colocated" else 1


async def run(
    cfg: RunConfig,
    out_dir: str | Path | None = None,
    *,
    on_step: Callable[[StepRecord], None] | None = None,
    resume: bool = False,
    preemptible: bool = False,
) -> RunOutput:
    """Build the workload's policy (and warm it up), train with RL, evaluate, let the
    workload finish (an HF policy is saved with ``save_pretrained``) and, with ``out_dir``,
    write the run folder, checkpoints included (``cfg.checkpoint``). ``resume``: continue
    the run in ``out_dir`` from its newest checkpoint (``cfg`` is its config, with only
    ``RESUME_KEYS`` changed; a run that died after its last step but before its summary is
    evaluated and summarised without training). ``preemptible``: on SIGTERM, write a
    checkpoint and raise ``RunPreempted`` (installs a handler on the running loop; the main
    thread only)."""
    cfg.validate()
    out = Path(out_dir) if out_dir is not None else None
    point = None
    if resume:
        if out is None:
            raise ConfigError("run(resume=True) needs out_dir, the run folder to resume")
        point = _resume_point(cfg, out)
    torch.manual_seed(cfg.seed)
    threads = _threads(cfg)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    workload = make_workload(cfg, out)
    extra: dict[str, Any] = {}
    preempted: list[Path] = []
    try:
        t0 = time.perf_counter()
        fresh = getattr(workload, "fresh_model", None)
        if point is not None and callable(fresh):  # its weights come from the checkpoint
            model = await fresh()
            warmup_s = float(point[2].get("warmup_s", 0.0))
        else:
            model = await workload.initial_model()
            warmup_s = time.perf_counter() - t0
        platform = cfg.trainer_platform().name  # validated above; resolved once per run
        r = cfg.rollout
        sampling = workload.sampling(r.temperature, r.top_p, r.top_k)
        rl_config = cfg.rl_config(sampling)
        resumed_at: list[int] = []
        placement: dict[str, str] = {}  # Ray: each actor's node
        left = cfg.rl.steps
        if point is not None:
            _, state, run_state = point
            left = cfg.rl.steps - (state.version - state.origin)
            rl_config = replace(rl_config, steps=max(left, 1))  # 0 left: no run() below
            resumed_at = [*run_state.get("resumed_at", []), state.version]
        placed = _placed(cfg, model, threads, platform, placement)
        async with placed as (engines, trainer, store, where):
            tracer = _load_trace(point[0], point[2]) if point is not None else Tracer()
            checkpoints = None
            if out is not None:
                checkpoints = Checkpoints(
                    out / "checkpoints", keep=cfg.checkpoint.keep,
                    extra=_RunFiles(
                        out / "checkpoints", tracer=tracer, warmup_s=warmup_s,
                        resumed_at=resumed_at,
                        segments=(_trace_segments(point[2]) or []) if point is not None else (),
                    ),
                )  # fmt: skip
            step_hook = on_step
            if out is not None:  # metrics.jsonl line by line (resumed: from the checkpoint's)
                if point is not None:  # the folder exists; --set may have changed RESUME_KEYS
                    (out / "config.toml").write_text(to_toml(cfg))
                    tracer.write_metrics_jsonl(out / "metrics.jsonl")
                step_hook = functools.partial(
                    _log_metrics, tracer=tracer, out=out, cfg=cfg, then=on_step
                )
            agent_loop = getattr(workload, "agent_loop", None)
            job = RLJob(
                rl_config, RLEngines(engines, trainer, make_staged=_direct_sync(cfg, trainer)),
                workload.prompts(cfg.seed),
                None if callable(agent_loop) else workload.reward,
                agent=agent_loop() if callable(agent_loop) else None, loss_fn=cfg.loss_fn(),
                tracer=tracer, on_step=step_hook, store=store, checkpoints=checkpoints,
            )  # fmt: skip
            if point is not None:
                await job.resume(point[0])
                _restore_rng(point[2]["rng"])
                tracer.continue_at(float(point[2]["trace_s"]))
            if left:
                with _on_sigterm(job, preempted, enabled=preemptible):
                    result = await job.run()
            else:  # trained to the end before it died: evaluate and summarise
                await job.sync_rollout()
                result = RLResult(rl_config, (), 0.0, 0, 0, PipelineResult({}, 0.0), tracer)
            lost = dict(job.lost)
            restarted = dict(job.restarted)
            if point is not None:  # the whole run's records and totals
                state = point[1]
                result = replace(
                    result, steps=(*state.steps, *result.steps),
                    wall_s=state.wall_s + result.wall_s, dropped=state.dropped + result.dropped,
                    generated=state.generated + result.generated,
                )  # fmt: skip
            if preempted:
                if out is not None:
                    tracer.write_chrome_trace(out / "trace.json")
                raise RunPreempted(preempted[0], len(result.steps))
            eval_reward = eval_exact = None
            if cfg.eval_prompts:  # on a rollout engine the run did not lose
                alive = next(e for i, e in enumerate(engines) if str(i) not in lost)
                eval_reward, eval_exact = await workload.evaluate(
                    alive, cfg.eval_prompts, 10_000_019 + cfg.seed
                )
            extra = await workload.finish(trainer, out)
    finally:
        torch.set_num_threads(previous_threads)
        close = getattr(workload, "close", None)
        if callable(close):
            close()
    summary = _summarize(
        cfg, workload.label, result, tracer, warmup_s, eval_reward, eval_exact, threads, platform
    )
    extra = {**extra, **_agent_figures(result)}
    if resumed_at:
        extra["resumed_at"] = resumed_at
    if lost:
        extra["lost_engines"] = lost
    if restarted:
        extra["restarted_engines"] = restarted
    if placement:
        extra["placement"] = placement
    summary = replace(summary, runtime=where, extra=extra)
    if out is not None:
        _write_run_folder(out, cfg, summary, tracer, result)
    return RunOutput(summary, result, out)


@contextlib.contextmanager
def _on_sigterm(job: RLJob, preempted: list[Path], *, enabled: bool) -> Iterator[None]:
    """While the job runs: SIGTERM writes a checkpoint (after the step in progress), appends
    its folder to ``preempted`` and stops the job."""
    if not enabled:
        yield
        return
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[None]] = []

    async def preempt() -> None:
        preempted.append(await job.checkpoint())
        job.pipeline.stop()

    def on_term() -> None:
        if not tasks:
            print("asyncflow run: SIGTERM: writing a checkpoint, then stopping", file=sys.stderr)
            tasks.append(loop.create_task(preempt()))

    loop.add_signal_handler(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def make_workload(cfg: RunConfig, out_dir: Path | None = None) -> registry.Workload:
    """The workload ``cfg.workload`` names, built from ``cfg`` (``out_dir``: the run folder,
    where a workload may write inputs it generates, e.g. the shipped data)."""
    factory = registry.get("workload", cfg.workload_name())
    workload = factory(cfg, out_dir)
    if not isinstance(workload, registry.Workload):
        raise ConfigError(
            f"workload {cfg.workload_name()!r}: its factory returned {type(workload).__name__}, "
            "which lacks the Workload methods (asyncflow_core.engines.registry.Workload)"
        )
    return workload


class DigitsWorkload:
    """The reference workload: a ``TransformerLM`` learns a built-in digit task
    (``asyncflow_reference.tasks``), after the format warm-up."""

    rollout_engine = "torch"
    train_engine = "torch"

    def __init__(self, cfg: RunConfig, out_dir: Path | None = None) -> None:
        self.cfg = cfg
        self.task = cfg.task_spec()
        self.label = f"{cfg.task.name}-{cfg.task.digits}"

    async def fresh_model(self) -> TransformerLM:
        """The model before the warm-up (a resumed run loads its weights next)."""
        return TransformerLM(self.cfg.model_config(), seed=self.cfg.seed)

    async def initial_model(self) -> TransformerLM:
        cfg = self.cfg
        return await _warm_up(cfg, TransformerLM(cfg.model_config(), seed=cfg.seed))

    def prompts(self, seed: int) -> Iterator[tuple[int, ...]]:
        return self.task.prompts(seed)

    def reward(self, prompt: Sequence[int], response: Sequence[int]) -> float:
        return self.task.reward(prompt, response)

    def sampling(self, temperature: float, top_p: float, top_k: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.task.max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            stop_token_ids=self.task.stop_token_ids,
        )  # fmt: skip

    async def evaluate(
        self, engine: InferenceEngine, prompts: int, seed: int
    ) -> tuple[float, float]:
        return await _evaluate(self.task, engine, prompts, seed)

    async def finish(self, trainer: TrainEngine, out_dir: Path | None) -> dict[str, Any]:
        return {}


class AgentWorkload:
    """The agentic reference workload: a ``TransformerLM`` learns an agentic task
    (``asyncflow_reference.agentic``: ``clock``, ``lookup``) through ``ToolAgentLoop`` over
    the minimal chat template, after a warm-up that teaches the tool-call syntax with random
    arguments and answers only. Evaluated greedily before and after RL (reward, exact, tool
    use, turns), and after RL with the tool taken away."""

    rollout_engine = "torch"
    train_engine = "torch"

    def __init__(self, cfg: RunConfig, out_dir: Path | None = None) -> None:
        self.cfg = cfg
        name = cfg.task.name
        self.task: agentic.AgentTask = (
            LookupTask(cfg.task.digits) if name == "lookup" else agentic.ClockTask()
        )
        self.chat = chat_format()
        self.label = f"lookup-{cfg.task.digits}" if name == "lookup" else name
        self.runner = ToolRunner(
            [], max_concurrency=cfg.agent.tool_concurrency, timeout_s=cfg.agent.tool_timeout_s
        )
        self.evaluations: dict[str, dict[str, float]] = {}

    def model_config(self) -> ModelConfig:
        m = self.cfg.model
        return ModelConfig(
            vocab_size=self.chat.tokenizer.vocab_size,  # type: ignore[attr-defined]
            d_model=m.d_model, n_layers=m.n_layers, n_heads=m.n_heads, d_ff=m.d_ff,
            max_seq_len=self.cfg.agent.max_total_tokens, init_std=m.init_std,
        )  # fmt: skip

    async def fresh_model(self) -> TransformerLM:
        """The model before the warm-up (a resumed run loads its weights next)."""
        return TransformerLM(self.model_config(), seed=self.cfg.seed)

    async def initial_model(self) -> TransformerLM:
        cfg = self.cfg
        model = TransformerLM(self.model_config(), seed=cfg.seed)
        if cfg.task.warmup_steps:
            trainer = TorchTrainEngine(model, lr=cfg.train.lr, seed=cfg.seed, name="warm-up")
            rng = random.Random(cfg.seed + 1)
            try:
                for _ in range(cfg.task.warmup_steps):
                    examples = self.task.warmup_examples(self.chat, rng, cfg.task.warmup_batch)
                    await trainer.train_step(_masked_batch(examples), policy_gradient_loss)
                model = trainer.model
            finally:
                await trainer.close()
        if cfg.eval_prompts:  # where RL starts from, greedy
            engine = TorchInferenceEngine(model, max_batch=cfg.rollout.max_batch, seed=cfg.seed)
            try:
                self.evaluations["before"] = await self._evaluate(engine, True)
            finally:
                await engine.close()
        return model

    def prompts(self, seed: int) -> Iterator[dict[str, Any]]:
        return self.task.samples(seed)

    def reward(self, prompt: Sequence[int], response: Sequence[int]) -> float:
        raise ConfigError("an agentic workload is scored by its agent loop, not by reward()")

    def agent_loop(self) -> ToolAgentLoop:
        return ToolAgentLoop(self.chat, self.runner, tools=self.task.tools, reward=self.task.reward)

    def sampling(self, temperature: float, top_p: float, top_k: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.cfg.agent.max_turn_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, stop_token_ids=self.chat.stop_token_ids,
        )  # fmt: skip

    async def _evaluate(self, engine: InferenceEngine, tools: bool) -> dict[str, float]:
        a = self.cfg.agent
        return await agentic.evaluate(
            self.task, engine, self.cfg.eval_prompts, 10_000_019 + self.cfg.seed, tools=tools,
            limits=a.limits(), max_tokens=a.max_turn_tokens,
        )  # fmt: skip

    async def evaluate(
        self, engine: InferenceEngine, prompts: int, seed: int
    ) -> tuple[float, float]:
        after = await self._evaluate(engine, True)
        self.evaluations["after"] = after
        self.evaluations["no_tools"] = await self._evaluate(engine, False)
        return after["reward"], after["exact"]

    async def finish(self, trainer: TrainEngine, out_dir: Path | None) -> dict[str, Any]:
        return {"eval": self.evaluations, "tool_calls": dict(self.runner.metrics)}


def _masked_batch(examples: Sequence[tuple[Sequence[int], Sequence[int]]]) -> Batch:
    """Supervised rows from ``(tokens, loss_mask)`` examples: advantage 1 (the loss is the
    negative log-likelihood of the masked-in tokens), the first token as the prompt."""
    return Batch(
        tuple(range(len(examples))),
        {
            "prompt": [torch.tensor(tokens[:1]) for tokens, _ in examples],
            "response": [torch.tensor(tokens[1:]) for tokens, _ in examples],
            LOSS_MASK: [torch.tensor(mask[1:]) for _, mask in examples],
            "advantage": torch.ones(len(examples)),
        },
    )


def torch_rollout(model: Any, *, cfg: RunConfig, index: int, threads: int) -> TorchInferenceEngine:
    """The ``torch`` rollout engine (``TorchInferenceEngine``) for a ``TransformerLM``."""
    if not isinstance(model, TransformerLM):
        raise ConfigError(
            f"rollout.engine = 'torch' serves the reference TransformerLM, not "
            f"{type(model).__name__}; use rollout.engine = 'hf' (or 'auto')"
        )
    return TorchInferenceEngine(
        model, max_batch=cfg.rollout.max_batch, seed=cfg.seed * 1000 + index,
        name=f"rollout-{index}",
    )  # fmt: skip


def torch_trainer(model: Any, *, cfg: RunConfig, threads: int, platform: str) -> TrainEngine:
    """The ``torch`` trainer (``TorchTrainEngine``; ``train.process``: in a child process)."""
    if not isinstance(model, TransformerLM):
        raise ConfigError(
            f"train.engine = 'torch' trains the reference TransformerLM, not "
            f"{type(model).__name__}; use train.engine = 'hf' or 'deepspeed' (or 'auto')"
        )
    make = functools.partial(TorchTrainEngine, model, **registry.trainer_options(cfg))
    if cfg.train_process():
        return ProcessTrainEngine(functools.partial(make, threads=threads))
    return make(threads=threads) if cfg.runtime.kind == "ray" else make()


@contextlib.asynccontextmanager
async def _placed(
    cfg: RunConfig,
    model: TransformerLM,
    threads: int,
    platform: str,
    placement: dict[str, str],
) -> AsyncIterator[tuple[list[InferenceEngine], TrainEngine, DataStore | None, str]]:
    """The rollout engines, the trainer and the store of the run's runtime, closed (and a
    Ray cluster started for the run stopped) on the way out. Local: engines in this process,
    the default in-process store (``None``). Ray: ``placement`` gets each actor's node
    (``head`` or ``node N``) by its name (``trainer``, ``rollout-i``, ``unit-u``)."""
    rollout_name, train_name = cfg.engine_names()
    make_rollout = registry.get("rollout", rollout_name)
    make_trainer = registry.get("trainer", train_name)
    rollout = [
        functools.partial(make_rollout, model, cfg=cfg, index=i, threads=threads)
        for i in range(cfg.rollout.engines)
    ]
    if cfg.runtime.kind == "local":
        trainer = make_trainer(model, cfg=cfg, threads=threads, platform=platform)
        if cfg.rollout.process:
            engines: list[InferenceEngine] = [
                ProcessInferenceEngine(make, threads=threads, name=f"rollout-{i}")
                for i, make in enumerate(rollout)
            ]
        else:
            engines = [make() for make in rollout]
        try:
            yield engines, trainer, None, "local"
        finally:
            for e in engines:
                await e.close()  # type: ignore[attr-defined]  # every engine here has one
            await trainer.close()  # type: ignore[attr-defined]  # every trainer here has one
        return
    from asyncflow_ray import RayDataStore, RayInferenceEngine, RayRuntime, RayTrainEngine

    needed = cfg.rollout.engines + 1  # one CPU per engine actor
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
        trainer_ray = await RayTrainEngine.create_async(
            functools.partial(make_trainer, model, cfg=cfg, threads=threads, platform=platform),
            platform=platform,
            name="trainer",
        )
        made.append(trainer_ray)
        engines = []
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
        placement.update({p.name: label.get(p.node_id, p.node_id) for p in made})
        if store is not None:
            for unit in await store.placement():
                placement[f"unit-{unit.unit}"] = label.get(unit.node_id, unit.node_id)
        yield engines, trainer_ray, store, where
    finally:
        for proxy in made:
            with contextlib.suppress(Exception):
                await proxy.close()
        if store is not None:
            store.shutdown()
        rt.shutdown()


def _direct_sync(cfg: RunConfig, trainer: TrainEngine) -> MakeStaged | None:
    """On Ray, a staged sync goes from the trainer's actor straight to the rollout actors
    (``RayDirectWeightSync``: the driver never holds the weights); None elsewhere."""
    rl = cfg.rl_config()
    if cfg.runtime.kind != "ray" or rl.weight_sync != "staged":
        return None
    from asyncflow_ray import RayTrainEngine
    from asyncflow_ray.weightsync import RayDirectWeightSync

    assert isinstance(trainer, RayTrainEngine)
    bucket_bytes = rl.bucket_bytes

    def make(targets: Sequence[Any], mode: Literal["abort", "keep"]) -> RayDirectWeightSync:
        return RayDirectWeightSync(trainer, targets, bucket_bytes=bucket_bytes, pause_mode=mode)

    return make


def _trainer_label(cfg: RunConfig) -> str:
    t = cfg.train
    engine = cfg.engine_names()[1]
    if cfg.runtime.kind == "ray":
        return "ray actor"
    process = cfg.train_process()
    if engine == "hf":
        return "hf, process" if process else "hf, thread"
    if engine == "deepspeed":
        where = f"{t.ranks} rank process(es)" if t.ranks > 1 or process else "thread"
        return f"deepspeed ZeRO-{t.zero_stage} {t.dtype}, {where}"
    return "process" if process else "thread"


def _summarize(
    cfg: RunConfig,
    label: str,
    result: RLResult,
    tracer: Tracer,
    warmup_s: float,
    eval_reward: float | None,
    eval_exact: float | None,
    threads: int,
    platform: str,
) -> RunSummary:
    rewards = [s.reward_mean for s in result.steps]
    trace = tracer.summary()
    hist = trace["staleness"]["histogram"]
    return RunSummary(
        mode=cfg.rl.mode,
        staleness=result.config.staleness,
        loss=cfg.train.loss,
        task=label,
        steps=len(result.steps),
        samples=result.samples,
        tokens=result.tokens,
        dropped=result.dropped,
        wall_s=result.wall_s,
        warmup_s=warmup_s,
        samples_per_s=result.samples / result.wall_s if result.wall_s > 0 else 0.0,
        tokens_per_s=result.tokens / result.wall_s if result.wall_s > 0 else 0.0,
        reward_first=_window_mean(rewards, first=True),
        reward_last=_window_mean(rewards, first=False),
        eval_reward=eval_reward,
        eval_exact=eval_exact,
        bubble_ratio={k: round(v["bubble_ratio"], 4) for k, v in trace["resources"].items()},
        staleness_hist={str(k): int(v) for k, v in hist.items()},
        sync_exposed_s=trace["sync"]["exposed_s"],
        sync_hidden_s=trace["sync"]["hidden_s"],
        threads=threads,
        trainer=_trainer_label(cfg),
        platform=platform,
    )


def _agent_figures(result: RLResult) -> dict[str, Any]:
    """Per-trajectory turns, tool calls and tool errors over the first and last 10% of the
    steps of an agent job (none for a single-turn job)."""
    steps = [s.metrics.extra for s in result.steps if "agent_turns" in s.metrics.extra]
    if not steps:
        return {}
    figures: dict[str, Any] = {}
    for key in ("turns", "tool_calls", "tool_errors"):
        values = [e[f"agent_{key}"] for e in steps]
        figures[key] = [_window_mean(values, first=True), _window_mean(values, first=False)]
    figures["restarts"] = int(sum(e.get("agent_restarts", 0.0) for e in steps))
    return {"agent": figures}


def _write_run_folder(
    out: Path, cfg: RunConfig, summary: RunSummary, tracer: Tracer, result: RLResult
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(to_toml(cfg))
    tracer.write_metrics_jsonl(out / "metrics.jsonl")
    tracer.write_chrome_trace(out / "trace.json")
    (out / "summary.json").write_text(json.dumps(summary.as_json(), indent=2) + "\n")
    try:
        plot_rewards(result, out / "reward.png", title=f"{summary.task}, {summary.mode}")
        tracer.plot_timeline(out / "timeline.png", title=f"{summary.task}, {summary.mode}")
    except ImportError:
        print(
            "(no PNG plots: install the plot extra, pip install 'asyncflow[plot]')",
            file=sys.stderr,
        )


def plot_rewards(result: RLResult, path: str | Path, *, title: str = "") -> Path:
    """The per-step mean reward against the step, as a PNG (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s.version for s in result.steps]
    rewards = [s.reward_mean for s in result.steps]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, rewards, lw=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------
_TRAINER_WORDS = {
    "process": "its own process",
    "thread": "a thread of this process",
    "ray actor": "a Ray actor of its own",
}


def format_summary(s: RunSummary) -> str:
    rows = [
        ("task / mode", f"{s.task}, {s.mode} (η={s.staleness}), loss {s.loss}"),
        ("trainer", f"{_TRAINER_WORDS.get(s.trainer, s.trainer)}, on {s.platform}"),
        ("runtime", s.runtime),
        ("steps / samples", f"{s.steps} / {s.samples} ({s.dropped} dropped as stale)"),
        ("wall (RL) / warm-up", f"{s.wall_s:.1f} s / {s.warmup_s:.1f} s"),
        ("samples/s, tokens/s", f"{s.samples_per_s:.1f}, {s.tokens_per_s:.0f}"),
        ("reward first → last 10%", f"{s.reward_first:.3f} → {s.reward_last:.3f}"),
    ]
    if s.eval_reward is not None and s.eval_exact is not None:
        rows.append(("greedy eval", f"reward {s.eval_reward:.3f}, exact {s.eval_exact:.1%}"))
    if s.extra.get("lost_engines"):
        lost = s.extra["lost_engines"]
        rows.append(("lost rollout engines", f"{len(lost)} ({', '.join(sorted(lost))}), survived"))
    if s.extra.get("restarted_engines"):
        back = s.extra["restarted_engines"]
        text = ", ".join(f"{n} ({k}×)" for n, k in sorted(back.items()))
        rows.append(("restarted rollout engines", f"{text}, rejoined"))
    rows += _agent_rows(s.extra)
    rows += [
        ("bubble ratio", ", ".join(f"{k} {v:.2f}" for k, v in s.bubble_ratio.items())),
        ("staleness histogram", ", ".join(f"{k}: {v}" for k, v in s.staleness_hist.items())),
        ("sync exposed / hidden", f"{s.sync_exposed_s:.2f} s / {s.sync_hidden_s:.2f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _agent_rows(extra: dict[str, Any]) -> list[tuple[str, str]]:
    """Summary rows of an agent job: turns and tool calls per trajectory during training,
    greedy evaluations before and after RL and without tools, the curriculum."""
    rows: list[tuple[str, str]] = []
    agent = extra.get("agent")
    if agent:
        (t0, t1), (c0, c1), (e0, e1) = agent["turns"], agent["tool_calls"], agent["tool_errors"]
        rows.append(
            ("turns / tool calls per traj", f"{t0:.2f} / {c0:.2f} → {t1:.2f} / {c1:.2f} "
             f"(tool errors {e0:.2f} → {e1:.2f}, restarts {agent['restarts']})")
        )  # fmt: skip
    evals = extra.get("eval") or {}

    def show(e: dict[str, float]) -> str:
        return (
            f"reward {e['reward']:.3f}, exact {e['exact']:.1%}, tool use {e['tool_use']:.0%}, "
            f"turns {e['turns']:.2f}"
        )

    for key, label in (("before", "greedy eval before RL"), ("no_tools", "after, tools off")):
        if key in evals:
            rows.append((label, show(evals[key])))
    if "after" in evals:
        rows.insert(
            len(rows) - ("no_tools" in evals), ("greedy eval after RL", show(evals["after"]))
        )
    return rows


class StepProgress:
    """The main job's progress, fed one ``StepRecord`` per optimizer step (``on_step``). On a
    terminal it is a live tqdm bar. Anywhere else (CI, ``nohup``, a pipe) a bar's
    carriage-return redraws pile up into one huge line of the log, so it prints a plain line
    (step, reward, samples/s, elapsed) at most every ``every_s`` seconds, and one for the last
    step. Time is the steps' own ``end_s`` (seconds since the RL job started; warm-up
    excluded), so the lines follow the run and samples/s is the RL phase's throughput."""

    def __init__(
        self, total: int, stream: TextIO, *, quiet: bool = False, every_s: float = 10.0
    ) -> None:
        if not every_s > 0:
            raise ConfigError(f"StepProgress: every_s must be > 0 seconds, got {every_s!r}")
        self.total = total
        self.stream = stream
        self.quiet = quiet
        self.every_s = every_s
        self.steps = 0
        self.samples = 0
        self._last_line_s = 0.0
        self._bar: Any = None
        if not quiet and _is_terminal(stream):
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc="RL", unit="step", file=stream)

    def __call__(self, record: StepRecord) -> None:
        self.steps += 1
        self.samples += record.samples
        rate = self.samples / record.end_s if record.end_s > 0 else 0.0
        if self._bar is not None:
            self._bar.set_postfix(reward=f"{record.reward_mean:.3f}", samples_s=f"{rate:.0f}")
            self._bar.update(1)
            return
        due = record.end_s - self._last_line_s >= self.every_s or self.steps >= self.total
        if self.quiet or not due:
            return
        self._last_line_s = record.end_s
        print(
            f"RL step {self.steps}/{self.total}  reward {record.reward_mean:.3f}  "
            f"samples/s {rate:.0f}  elapsed {record.end_s:.1f} s",
            file=self.stream,
            flush=True,  # a log read while the job runs (tail -f) sees each line at once
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _config_value(cfg: RunConfig, key: str) -> Any:
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _resume_config(run_dir: Path, sets: Sequence[str]) -> RunConfig:
    """The config of the run in ``run_dir`` with ``sets`` applied, refusing any change of a
    key outside ``RESUME_KEYS``."""
    saved = run_dir / "config.toml"
    if not saved.is_file():
        raise ConfigError(
            f"--resume {run_dir}: no config.toml there; give the folder an asyncflow run wrote "
            "(its --out, e.g. runs/<timestamp>)"
        )
    base = load_config(RunConfig, str(saved), [])
    cfg = load_config(RunConfig, str(saved), sets)
    changed = [k for k in keys(cfg) if _config_value(cfg, k) != _config_value(base, k)]
    refused = [k for k in changed if k not in RESUME_KEYS]
    if refused:
        raise ConfigError(
            f"--resume: {', '.join(refused)} cannot change on resume (the checkpoint was "
            f"trained with the run's value); these may: {', '.join(RESUME_KEYS)}"
        )
    return cfg


def main_job(args: Any) -> int:
    """``asyncflow run``: exit 2 with a message on a bad config."""
    if args.keys:
        cfg = RunConfig()
        for key in keys(cfg):
            print(f"{key} = {_config_value(cfg, key)!r}")
        return 0
    resume = getattr(args, "resume", None)
    try:
        sets = list(args.set or ())
        if getattr(args, "runtime", None):  # first: the runtime.* keys --set names check it
            sets.insert(0, f"runtime.kind={args.runtime}")
        if resume:
            if args.config or args.out:
                raise ConfigError(
                    "--resume RUN_DIR continues that run with its own config.toml, in that "
                    "folder: drop --config and --out (change what may change with --set)"
                )
            cfg = _resume_config(Path(resume), sets)
        else:
            cfg = load_config(RunConfig, args.config, sets)
        cfg.validate()
    except ConfigError as e:
        print(f"asyncflow run: {e}", file=sys.stderr)
        return 2
    if resume:
        out = Path(resume)
    else:
        out = Path(args.out) if args.out else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    rl = cfg.rl_config()
    if cfg.task.name == "clock":
        what = "clock"
    elif cfg.workload_name() in ("digits", "agent"):
        what = f"{cfg.task.name}-{cfg.task.digits}"
    else:
        what = f"{cfg.workload_name()} {cfg.model.path or cfg.model.name or ''}".strip()
    print(
        f"asyncflow run: {what} with {cfg.rl.mode} RL "
        f"(η={rl.staleness}, {rl.weight_sync} sync, loss "
        f"{cfg.train.loss}), {cfg.rl.steps} steps x {cfg.rl.prompts_per_step * cfg.rl.n} "
        f"samples; writing {out}/",
        file=sys.stderr,
    )
    done = 0
    if resume:
        try:
            folder, state, _ = _resume_point(cfg, out)
        except (ConfigError, CheckpointError) as e:
            print(f"asyncflow run: {e}", file=sys.stderr)
            return 2
        done = state.version - state.origin
        print(
            f"asyncflow run: resuming from {folder} ({done} of {cfg.rl.steps} steps done)",
            file=sys.stderr,
        )
    progress = StepProgress(cfg.rl.steps - done, sys.stderr, quiet=args.quiet)
    try:
        output = asyncio.run(run(cfg, out, on_step=progress, resume=bool(resume), preemptible=True))
    except RunPreempted as e:
        print(
            f"asyncflow run: stopped on SIGTERM after {e.steps} steps; checkpoint "
            f"{e.checkpoint}; continue with: asyncflow run --resume {out}",
            file=sys.stderr,
        )
        return 0
    except (ConfigError, CheckpointError) as e:  # a bad input found while building the run
        print(f"asyncflow run: {e}", file=sys.stderr)
        return 2
    except TaskFailedError as e:  # the run stopped (a lost trainer, a reward failing on every row)
        latest = Checkpoints(out / "checkpoints").latest()
        where = (
            f"the newest checkpoint is {latest}: continue with asyncflow run --resume {out}"
            if latest is not None
            else "no checkpoint was written yet"
        )
        print(f"asyncflow run: the run stopped: {e}\n{where}", file=sys.stderr)
        return 1
    finally:
        progress.close()
    print(format_summary(output.summary))
    print(f"run folder: {out}/")
    return 0


__all__ = [
    "RESUME_KEYS",
    "AgentSection",
    "AgentWorkload",
    "CheckpointSection",
    "DataSection",
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
