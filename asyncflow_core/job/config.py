"""The main job's configuration: ``RunConfig``, typed sections read from TOML and ``--set
section.key=value`` (``asyncflow_core.flow.config``).

``RunConfig`` holds what every run has: the seed, the workload's name, threads, platform, the
rollout engines, the trainer, the RL loop, agent limits, the runtime and checkpoints. What is
trained (the model, its data, its task or reward) is the workload's: a workload names its own
config class, a ``RunConfig`` subclass that adds its keys (``asyncflow_reference``'s
``ReferenceRunConfig``: ``task.*`` and the ``TransformerLM``'s ``model.*``; ``asyncflow_hf``'s
``HFRunConfig``: ``model.path``, ``data.*``, ``reward``). ``load_run_config`` reads a file and
overrides into the class of the workload they name (``workload = "auto"``: the one whose keys
they use, ``claims``; else ``DEFAULT_WORKLOAD``); ``asyncflow run --keys`` lists the keys.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from asyncflow_core.contracts.errors import ConfigError
from asyncflow_core.contracts.protocols import LossFn, SamplingParams
from asyncflow_core.engines import registry
from asyncflow_core.flow.agent import TrajectoryLimits
from asyncflow_core.flow.config import load_config, read_toml, without_retired
from asyncflow_core.flow.rlflow import RLConfig
from asyncflow_core.infra.platform import Platform, get_platform, select_platform
from asyncflow_core.training.rl import (
    DecoupledPPOLoss,
    PPOClipLoss,
    policy_gradient_loss,
)

LossName = Literal["pg", "ppo", "decoupled-ppo"]
DEFAULT_WORKLOAD = "digits"
"""The workload ``workload = "auto"`` runs when no workload's keys are set: the reference
model on a built-in digit task (``asyncflow_reference``)."""


@dataclass(frozen=True)
class RolloutSection:
    """Rollout engines and sampling."""

    engine: str = "auto"
    """The rollout engine (``asyncflow_core.engines.registry``): ``torch`` (the reference engine),
    ``hf`` (transformers' continuous batching), ``vllm`` (vLLM, in this process or a running
    server: ``url``) or a plugin's; ``auto``: the workload's."""
    engines: int = 1
    url: str = ""
    """Servers to generate on, for a rollout engine that can be a client of one (``vllm``:
    a ``vllm serve`` started as ``docs/vllm.md`` says): one URL per rollout engine, separated
    by commas. Empty: the engine runs here."""
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
        urls = self.urls()
        if urls and len(urls) != self.engines:
            raise ConfigError(
                f"rollout.url names {len(urls)} server(s) but rollout.engines is "
                f"{self.engines}: give one URL per rollout engine (or set rollout.engines="
                f"{len(urls)})"
            )
        if not self.temperature > 0:
            raise ConfigError(
                f"rollout.temperature must be > 0 for RL (sampling explores), got "
                f"{self.temperature}"
            )

    def urls(self) -> list[str]:
        """``url`` as a list (empty: none)."""
        return [u.strip() for u in self.url.split(",") if u.strip()]


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
    verify_sync: str = "first"
    """Prove after a sync that the rollout engines hold the trainer's weights
    (``RLConfig.verify_sync``; docs/weight-sync.md): ``first``, ``always``, ``every N``,
    ``off``."""


@dataclass(frozen=True)
class AgentSection:
    """Agentic workloads only (those with an agent loop, e.g. the reference ``task.name =
    "clock"`` or ``"lookup"``): the trajectories' limits, the tools and stale trajectories."""

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

    kind: str = "local"
    """``local``, ``ray`` or a plugin's (``asyncflow_core.engines.registry``, kind ``runtime``)."""
    address: str = ""
    store: Literal["driver", "ray"] = "driver"
    storage_units: int = 2
    rollout_restarts: int = 0

    def validate(self) -> None:
        if not isinstance(self.kind, str) or not self.kind:
            raise ConfigError(
                f"runtime.kind must be 'local' or a runtime's name, got {self.kind!r}"
            )
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
        if self.kind != "local" and self.kind not in registry.names("runtime"):
            raise ConfigError(
                f"runtime.kind must be 'local' or a registered runtime "
                f"({', '.join(registry.names('runtime')) or 'none'}), got {self.kind!r}; a "
                "package adds one through the 'asyncflow.runtimes' entry-point group"
            )
        if self.kind != "local":
            registry.get("runtime", self.kind)  # its package does not import here: say so


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
    "checkpoint.min_interval_s", "rl.verify_sync",
    "rollout.engines", "rollout.url", "rollout.max_batch", "rollout.process", "train.process",
    "runtime.kind",
    "runtime.address", "runtime.store",
    "runtime.storage_units", "runtime.rollout_restarts",
)  # fmt: skip
"""The config keys ``asyncflow run --resume`` lets ``--set`` change: how long to train, where
and on how many processes. Every other key shapes the model, the data order, the optimizer
(whose state the checkpoint holds) or the objective, so it stays the run's."""


@dataclass(frozen=True)
class RunConfig:
    """Everything ``asyncflow run`` does but what is trained (that is the workload's config
    class, a subclass: module docstring). ``threads``: torch threads per engine (0 = auto:
    async gives rollout and training one core each; colocated gives each phase every core).

    A subclass for a workload may override ``claims`` (the keys that choose it under
    ``workload = "auto"``), ``auto_workload`` (which of its workloads ``auto`` is), ``check``
    (its keys against the rest; ``validate`` calls it), ``default_lr_warmup_steps`` and
    ``describe`` (a short label of what is trained)."""

    seed: int = 0
    workload: str = "auto"
    """What is trained (``asyncflow_core.engines.registry``): ``digits`` (the reference model on a
    built-in digit task), ``agent`` (the reference model on an agentic task), ``hf`` (a Hugging
    Face model on a dataset with a reward) or a plugin's; ``auto``: the workload whose keys are
    set (``model.path`` or ``model.name``: ``hf``; an agentic ``task.name``: ``agent``), else
    ``digits``."""
    threads: int = 0
    platform: str = "auto"
    """Where the trainer computes (``asyncflow_core.infra.platform``): ``auto`` (the best platform
    that runs here, ``cpu`` without an accelerator), ``cpu``, ``cuda``, ``npu`` (Ascend, the
    ``[ascend]`` extra) or a plugin's name. A named platform that cannot run here is refused
    before anything starts. It applies to ``train.engine = "deepspeed"`` (DeepSpeed's
    accelerator and collective backend); the reference and hf trainers compute on CPU."""
    eval_prompts: int = 256
    rollout: RolloutSection = field(default_factory=RolloutSection)
    train: TrainSection = field(default_factory=TrainSection)
    rl: RLSection = field(default_factory=RLSection)
    agent: AgentSection = field(default_factory=AgentSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)

    # -- what a workload's subclass may override ------------------------------------------------
    @classmethod
    def claims(cls, values: Mapping[str, Any]) -> bool:
        """Whether ``workload = "auto"`` picks this class for a config that sets ``values``
        (flat dotted keys, e.g. ``{"model.path": "..."}``, as a file and ``--set`` give them).
        The default workload's class need not claim anything."""
        return False

    def auto_workload(self) -> str:
        """The workload ``workload = "auto"`` runs with this config."""
        return DEFAULT_WORKLOAD

    def check(self) -> None:
        """Check the subclass's keys (``ConfigError`` naming the key); ``validate`` calls it."""

    def default_lr_warmup_steps(self) -> int:
        """``train.lr_warmup_steps`` when it is not set."""
        return 0

    def describe(self) -> str:
        """A short label of what is trained, for the run's first line."""
        return self.workload_name()

    # -- resolved -------------------------------------------------------------------------------
    def workload_name(self) -> str:
        """``workload`` resolved (``auto``: ``auto_workload()``), checked against the
        registry."""
        name = self.auto_workload() if self.workload == "auto" else self.workload
        registry.get("workload", name)  # an unknown name fails here
        return name

    def for_workload(self) -> RunConfig:
        """This config as its workload's config class: itself when it is one already; a plain
        ``RunConfig`` gets the class's defaults for the workload's keys (so ``run(RunConfig())``
        runs the default workload); ``ConfigError`` for a config of another workload's class."""
        cls = config_class(self.workload_name())
        if isinstance(self, cls):
            return self
        if type(self) is RunConfig:
            own = {f.name: getattr(self, f.name) for f in dataclasses.fields(RunConfig)}
            made = cls(**own)
            if made.workload_name() != self.workload_name():
                raise ConfigError(
                    f"workload = 'auto' picks {made.workload_name()!r} for {cls.__name__}'s "
                    f"defaults; set workload = {self.workload_name()!r}"
                )
            return made
        raise ConfigError(
            f"workload {self.workload_name()!r} takes a {cls.__name__} (its own keys), not a "
            f"{type(self).__name__}; read the config with load_run_config, which picks the class "
            "from the keys set"
        )

    def validate(self) -> None:
        t = self.train
        self.runtime.validate()
        self.checkpoint.validate()
        self.agent.validate()
        self.rollout.validate()
        if t.kl_coef:
            raise ConfigError(
                "train.kl_coef > 0 needs a reference policy, which the main job does not run; "
                "leave it 0, or compose the job in Python with RLEngines.reference "
                "(docs/rl-jobs.md)"
            )
        workload = self.workload_name()
        factory = registry.get("workload", workload)
        cls = config_class(workload)
        if not isinstance(self, cls):
            # a plain RunConfig passes (it converts); another workload's class raises, naming
            # the class this workload takes
            self.for_workload()
        train_engine = self.engine_names()[1]
        if self.runtime.kind != "local" and self.rollout.process:
            raise ConfigError(
                f"runtime.kind = {self.runtime.kind!r} runs every rollout engine in an actor of "
                "its own already; rollout.process = true is for runtime.kind = 'local'"
            )
        if self.runtime.kind != "local" and (train_engine == "deepspeed" or t.process is True):
            raise ConfigError(
                f"runtime.kind = {self.runtime.kind!r} runs the trainer in an actor of its own; "
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
        runtimes = getattr(factory, "runtimes", None)  # None: any
        if runtimes is not None and self.runtime.kind not in runtimes:
            raise ConfigError(
                f"runtime.kind = {self.runtime.kind!r}: the {workload} workload runs on "
                f"{' or '.join(map(repr, runtimes))} so far (it has not been tried on "
                f"{self.runtime.kind!r}); use runtime.kind = 'local'"
            )
        if not callable(getattr(factory, "agent_loop", None)) and self.agent != AgentSection():
            raise ConfigError(
                "agent.* apply to agentic workloads (task.name = 'clock' or 'lookup'); the "
                f"{workload} workload is single-turn"
            )
        self.check()
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
        """``train.lr_warmup_steps`` resolved (None: the workload's default,
        ``default_lr_warmup_steps``)."""
        steps = self.train.lr_warmup_steps
        if steps is None:
            return self.default_lr_warmup_steps()
        return steps

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

    def trainer_platform(self) -> Platform:
        """The platform the trainer runs on: ``platform`` resolved (a named one that cannot
        run here raises ``PlatformUnavailableError``, a ``ConfigError``); ``cpu`` for the
        trainers other than DeepSpeed, which refuse a named accelerator rather than ignore
        it."""
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

    def rl_config(self, sampling: SamplingParams | None = None) -> RLConfig:
        """The RL loop's config, with ``sampling`` (the workload's, ``Workload.sampling``;
        None: ``RLConfig``'s default, for a look at the loop's shape)."""
        rl = self.rl
        colocated = rl.mode == "colocated"
        extra: dict[str, Any] = {} if sampling is None else {"sampling": sampling}
        return RLConfig(
            steps=rl.steps, prompts_per_step=rl.prompts_per_step, n=rl.n,
            staleness=0 if colocated else rl.staleness,
            weight_sync="blocking" if colocated else rl.weight_sync,
            sync_every=1 if colocated else rl.sync_every, partial_rollout=rl.partial_rollout,
            mode=rl.mode, proximal_logprobs=self.train.loss == "decoupled-ppo",
            trajectory_limits=self.agent.limits(), max_restarts=self.agent.max_restarts,
            checkpoint_every=self.checkpoint.every,
            checkpoint_min_interval_s=self.checkpoint.min_interval_s,
            verify_sync=rl.verify_sync, **extra,
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


_CORE_KEYS = frozenset(f.name for f in dataclasses.fields(RunConfig))
RETIRED: dict[str, Any] = {
    "model.path": "", "model.name": "", "model.trust_remote_code": False, "model.d_model": 64,
    "model.n_layers": 2, "model.n_heads": 4, "model.init_std": 0.1, "task.name": "reverse",
    "task.digits": 3, "task.warmup_steps": 60, "task.warmup_batch": 128, "data.path": "",
    "data.prompt_field": "question", "data.messages_field": "", "data.answer_field": "answer",
    "data.system_prompt": "", "data.max_tokens": 16, "data.limit": 0, "data.difficulty": 1,
    "reward": "", "reward_timeout_s": 30.0,
}  # fmt: skip
"""The workload keys ``RunConfig`` had before they moved to the workloads' config classes,
with their defaults. A ``config.toml`` written then holds every one of them; one still at
its default, which its workload's class lacks, is ignored when the file is read (so runs from
before the move still ``--resume``), and claims no workload."""


def config_class(workload: str) -> type[RunConfig]:
    """The config class workload ``workload`` takes: its factory's ``config`` attribute (a
    ``RunConfig`` subclass), ``RunConfig`` when it names none."""
    factory = registry.get("workload", workload)
    cls = getattr(factory, "config", RunConfig)
    if not (isinstance(cls, type) and issubclass(cls, RunConfig)):
        raise ConfigError(
            f"workload {workload!r}: its config attribute must be a RunConfig subclass, got "
            f"{cls!r:.80}"
        )
    return cls


def _flat(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def set_values(
    toml_path: str | Path | None,
    overrides: Sequence[str],
    *,
    data: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The keys a config file and ``key=value`` overrides set, flat (``{"task.name": ...}``;
    a later one wins), with values as given (strings for overrides): what ``claims`` sees.
    A table given a plain value (``task=clock``) is its ``name``. ``data``: the file's tables,
    already read (``read_toml``); otherwise a file that cannot be read counts as setting
    nothing (``load_config`` reports it, naming the file)."""
    values: dict[str, Any] = {}
    if data is None and toml_path is not None:
        try:
            data = read_toml(toml_path)
        except ConfigError:
            data = None
    if data is not None:
        values.update(_flat(without_retired(data, RETIRED)))
    for item in overrides:
        key, sep, value = str(item).partition("=")
        if sep:
            values[key.strip()] = value.strip().strip("\"'")
    return values


def resolve_config_class(values: Mapping[str, Any]) -> type[RunConfig]:
    """The config class for a config setting ``values`` (``set_values``): the named
    workload's; for ``workload = "auto"``, the class of the first registered workload (by
    name) whose class ``claims`` them, else the default workload's. Workloads whose package
    does not import here are skipped; nothing is imported when only ``RunConfig``'s own keys
    are set."""
    return _resolve(values)[0]


def _resolve(values: Mapping[str, Any]) -> tuple[type[RunConfig], str]:
    """``resolve_config_class`` with why: the words for an error message."""
    name = values.get("workload", "auto")
    if name != "auto":
        return config_class(str(name)), f"workload = {name!r}"
    default = config_class(DEFAULT_WORKLOAD)
    why = f"the default workload, {DEFAULT_WORKLOAD!r}"
    if all(k.split(".", 1)[0] in _CORE_KEYS for k in values):
        return default, why
    seen: set[type[RunConfig]] = {default}
    for workload in registry.names("workload"):
        try:
            cls = config_class(workload)
        except ConfigError:  # its package does not import here: it cannot be the one
            continue
        if cls not in seen and cls.claims(values):
            return cls, f"workload {workload!r}, whose keys are set"
        seen.add(cls)
    return default, why


def load_run_config(
    toml_path: str | Path | None = None, overrides: Sequence[str] = ()
) -> RunConfig:
    """``asyncflow run``'s config: ``toml_path`` then ``overrides`` (``key=value``) read
    into the class of the workload they choose (``resolve_config_class``), so
    ``--set model.path=DIR`` reads as an ``hf`` config and ``--set task=clock`` as the
    reference one; every mistake is a ``ConfigError`` naming the key (and, for a key the
    class lacks, which workload's keys were read and how to list them)."""
    data = None if toml_path is None else read_toml(toml_path)  # read once, for both
    cls, why = _resolve(set_values(toml_path, overrides, data=data))
    try:
        return load_config(cls, toml_path, overrides, retired=RETIRED, data=data)
    except ConfigError as e:
        if "unknown key" not in str(e) and "is a table" not in str(e):
            raise
        raise ConfigError(
            f"{e} (read as {cls.__name__}, the keys of {why}; asyncflow run --keys --set "
            "workload=NAME lists a workload's keys)"
        ) from e


__all__ = [
    "DEFAULT_WORKLOAD",
    "RESUME_KEYS",
    "AgentSection",
    "CheckpointSection",
    "LossName",
    "RLSection",
    "RolloutSection",
    "RunConfig",
    "RuntimeSection",
    "TrainSection",
    "config_class",
    "load_run_config",
    "resolve_config_class",
    "set_values",
]
