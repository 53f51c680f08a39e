"""The RL step as a pipeline: prompt feeder -> rollout (n per prompt) -> reward and group
advantage (one task over whole groups; the advantage has a task of its own when the agent loop
wrote the rewards) -> optional reference log-probs -> actor update, composed with the public
``Pipeline``/``Task``/``Source`` API over one store partition, on any ``InferenceEngine`` s and
``TrainEngine``.

Modes (``RLConfig``):

* ``staleness`` η, AReaL-style admission control: the feeder admits a prompt's n samples only
  while ``generated_or_in_flight + n <= (rollout_version − v0 + η + 1) × batch_size``, where
  ``rollout_version`` is the newest version synced (or staged) to the rollout side and v0 the
  version the job started at (see *Versions* below). η = 0 is
  on-policy, 1 one-step-off, larger fully async. The actor update's sampler also drops, whole
  groups at a time, any sample older than η versions (a long-tailed straggler), so *no trained
  sample is ever more than η versions stale*; dropped samples free their admission slots.
* ``sync_every`` k: optimizer steps per weight sync (needs η >= k - 1: between syncs the
  rollout weights lag the trainer by up to k - 1 versions).
* ``partial_rollout``: at a sync, in-flight generations are aborted and resumed on the new
  weights from their prefix, keeping per-token versions. Without it a blocking sync first
  drains the in-flight generations.
* ``weight_sync``: ``"blocking"`` (stop rollout, [drain], pause -> transfer -> resume; all
  exposed), ``"staged"`` (the paper's delayed update: the transfer goes to a host-side buffer
  while generation continues; the swap is applied at the rollout's next safe point, before a
  new group starts: only the swap is exposed), ``"inflight"`` (weights go straight into the
  engines between decode steps, KV caches kept; the engines stall only for the load; an
  engine that cannot load while it generates says why in ``inflight_weight_load_refusal``
  and the job refuses ``"inflight"`` for it: vLLM and SGLang do).
* ``mode="colocated"``: rollout and training alternate on the same devices (η = 0, blocking
  sync; rollout engines that support ``sleep``/``wake_up`` release their memory while the
  trainer runs). The baseline every benchmark compares against.

Versions: everything counts from v0, the trainer's ``weight_version`` when ``run()`` starts
(0 for a fresh trainer; more after a warm-up or a checkpoint load). ``run()`` trains
``config.steps`` steps, to version v0 + steps; it syncs after every ``sync_every``-th of them;
the admission bound counts steps from v0. Before the feeder admits anything, ``run()`` brings
the rollout engines to v0: if any engine reports a ``weight_version`` other than v0, the
trainer's weights are synced into every engine at version v0 with the job's own strategy
(``staged``: staged and applied at once; ``blocking``/``inflight``: straight into the engines),
traced as exposed "sync" spans; if every engine already reports v0, nothing is transferred.
Without that sync the engines would tag tokens with their own older version and the update
would drop every sample as stale. ``StepRecord.version`` and the metrics' ``step`` are the
trainer's absolute versions (v0 + 1, v0 + 2, …). Running the same job again continues from
where the trainer is: another ``config.steps`` steps, with fresh admission counts.

verl's fully-async knobs map onto these (``RLConfig.from_verl``): ``trigger_parameter_sync_step``
k is ``sync_every``; ``staleness_threshold`` s lets the rollouter produce ``(1 + s)·k`` batches
per sync, i.e. η = ⌈k·(1 + s)⌉ − 1; ``partial_rollout`` is ``partial_rollout``.

Tracing: with a ``Tracer`` every task iteration is a span (the pipeline's), plus "sync" spans
(``transfer`` on the trainer, ``swap``/``drain`` on the rollout; exposed or hidden), "wait"
spans for admission, per-row staleness on the actor update's spans, and a metric record per
optimizer step. Rollout tasks use the resource "rollout", the update "trainer"; colocated, both
use "devices".
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import math
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar, cast

import numpy as np
import torch

from asyncflow_core.contracts.errors import (
    BadRequestError,
    CheckpointError,
    ConfigError,
    EngineError,
    EngineLostError,
)
from asyncflow_core.contracts.protocols import (
    Batch,
    Candidates,
    Capacity,
    DataStore,
    GenerationRequest,
    GenerationResult,
    InferenceEngine,
    Layout,
    LossFn,
    SampleRequest,
    SamplingParams,
    Selection,
    SupportsLoadWeights,
    SupportsRestart,
    SupportsSleep,
    Tags,
    TrainEngine,
    TrainMetrics,
    Version,
    WeightBucket,
    WeightSync,
    inflight_load_refusal,
    tensor_load_refusal,
    unavailable_ability,
)
from asyncflow_core.data.scheduling import (
    FillView,
    GroupSampler,
    RequestRouter,
    StalenessSampler,
    cannot_fill_of,
    is_repeatable,
)
from asyncflow_core.flow.agent import (
    AgentLoop,
    GenerationClient,
    Trajectory,
    TrajectoryLimits,
    generate_routed,
)
from asyncflow_core.flow.staleness import AdmissionController
from asyncflow_core.flow.workflow import Pipeline, PipelineResult, Source, Task, TaskOutput
from asyncflow_core.infra.checkpoint import Checkpoints, failpoint
from asyncflow_core.observability.trace import Tracer
from asyncflow_core.sync.strategies import StagedUpdate, SyncTiming, _pause, _resume
from asyncflow_core.sync.transports import (
    InProcessWeightSync,
    SupportsOwnTransport,
    close_transport,
    engine_transport,
    needs_own_transport,
)
from asyncflow_core.sync.verify import (
    SyncVerificationError,
    VerifyReport,
    VerifySchedule,
    verification_refusal,
    verify_engine,
    verify_setting_problem,
)
from asyncflow_core.training.rl import (
    LOSS_MASK,
    PROX_LOGPROBS,
    DecoupledPPOLoss,
    PPOClipLoss,
    group_advantages,
    policy_gradient_loss,
)
from asyncflow_core.training.sampling import SAMPLING_FIELDS, sampling_columns

_T = TypeVar("_T")
_log = logging.getLogger("asyncflow.rl")
Mode = Literal["async", "colocated"]
SyncStrategy = Literal["blocking", "staged", "inflight"]
RewardFn = Callable[[Sequence[int], Sequence[int]], float]
"""``reward(prompt_tokens, response_tokens) -> float``; runs in a worker thread. NaN marks a
row whose reward failed: it gets advantage 0 (its group is normalised without it), the step's
``reward_mean`` leaves it out and ``metrics.extra["reward_failed"]`` counts it; any exception
stops the job instead."""
MakeTransport = Callable[[Sequence[SupportsLoadWeights]], WeightSync]


class StagedSync(Protocol):
    """What the job asks of a staged (delayed) weight update: ``StagedUpdate``, or one of an
    engine package's own (``RLEngines.make_staged``). ``sync(buckets, version)`` stages a
    version while the engines generate (it may ignore ``buckets``: the Ray runtime's direct
    sync sends from the trainer's actor), ``apply()`` loads the newest staged version at a
    safe point (None if none), ``pending_version`` is that version, and ``engines`` can be
    set to take a lost engine out."""

    engines: Any

    @property
    def pending_version(self) -> Version | None: ...

    async def sync(self, buckets: Any, version: Version) -> float: ...

    async def apply(self) -> SyncTiming | None: ...


MakeStaged = Callable[[Sequence[SupportsLoadWeights], Literal["abort", "keep"]], StagedSync]

_MODES = ("async", "colocated")
_DEFAULT_SAMPLING = SamplingParams(max_tokens=256)
_LEASE_S = 24 * 3600.0
"""Leases of the job's tasks: a long generation (or a slow simulated one) must never be handed
to a second worker; a worker that dies takes the whole in-process job with it anyway."""
_SYNCS = ("blocking", "staged", "inflight")
_NO_LIMITS = TrajectoryLimits()  # the defaults (a frozen value, shared)


@dataclass(frozen=True, slots=True)
class RLConfig:
    """Knobs of an RL job; ``validate()`` names every bad value. ``batch_size`` (samples per
    optimizer step) is ``prompts_per_step × n``."""

    steps: int
    prompts_per_step: int
    n: int = 8
    staleness: int = 1
    sync_every: int = 1
    partial_rollout: bool = False
    mode: Mode = "async"
    weight_sync: SyncStrategy = "staged"
    sampling: SamplingParams = _DEFAULT_SAMPLING
    """Every request's sampling; with a ``seed``, request number i samples with ``seed + i``."""
    rollout_concurrency: int | None = None
    """Groups generating at once (default: enough for the staleness bound to be the limit)."""
    bucket_bytes: int = 1 << 30
    reference_logprobs: bool = False
    """Add a task computing the reference model's log-probs (needs ``RLEngines.reference``)."""
    proximal_logprobs: bool = False
    """Before each update, compute the ``prox_logprobs`` field with the trainer's current
    weights (π_prox of decoupled PPO, ``asyncflow_core.training.rl.DecoupledPPOLoss``)."""
    drop_stale: bool = True
    """Drop samples older than η at the update (keeps the staleness law exact)."""
    partition: str = "rl"
    trajectory_limits: TrajectoryLimits = _NO_LIMITS
    """Agent jobs only: turns, total tokens and tokens per turn of each trajectory."""
    max_restarts: int = 2
    """Agent jobs only: how many times a trajectory that became too stale to be trained
    before its next turn is regenerated from its prompt (``asyncflow_core.flow.agent``); after
    that it is finished and the update drops it (counted in ``dropped``)."""
    checkpoint_every: int = 0
    """With ``RLJob(checkpoints=...)``: write a checkpoint after every this many optimizer
    steps (0: only after the last step and when ``RLJob.checkpoint()`` is called)."""
    checkpoint_min_interval_s: float = 0.0
    """Skip a periodic checkpoint (``checkpoint_every``) while the previous checkpoint, or
    the start of ``run()``, is younger than this many seconds of the job's clock: a job of
    fast steps then does not spend its time writing checkpoints. The last step's checkpoint
    and ``RLJob.checkpoint()`` are always written."""
    verify_sync: str = "first"
    """Prove, after a sync, that every rollout engine holds the trainer's weights for that
    version (``asyncflow_core.sync.verify``): ``"first"`` (the first sync of each run),
    ``"always"``, ``"every N"`` (the first, then every N-th), ``"off"``. By fingerprint where
    the engine can read its weights back, else by a probe's log-probs; a mismatch stops the
    job with ``SyncVerificationError`` naming the engine, the version and what differs. A
    verified staged sync swaps at once (not at the next safe point), so the trainer is still
    at that version while it is checked."""
    verify_logprob_atol: float = 1e-3
    """The probe's bound on the mean |engine - trainer| log-prob (``docs/logprobs.md``)."""
    verify_logprob_max_atol: float = 1e-2
    """The probe's bound on the largest |engine - trainer| log-prob of one token."""
    verify_timeout_s: float = 600.0
    """Seconds (the job's clock) one engine's verification may take; past it the job stops
    with ``SyncVerificationError`` naming the engine (a hung probe never hangs the job)."""
    reward_in_thread: bool = True
    """Run ``reward_fn`` in a worker thread (the default: a slow verifier must not stall the
    event loop). ``False`` calls it on the event loop, saving a thread hand-off per reward
    batch, for a reward that takes microseconds (the simulator's stand-in verifier)."""

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.n

    def validate(self) -> None:
        problems: list[str] = []
        for name in ("steps", "prompts_per_step", "n", "sync_every", "bucket_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                problems.append(f"{name} must be an int >= 1, got {v!r}")
        for name, label in (
            ("staleness", "staleness (η)"),
            ("max_restarts", "max_restarts"),
            ("checkpoint_every", "checkpoint_every"),
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                problems.append(f"{label} must be an int >= 0, got {v!r}")
        limits: object = self.trajectory_limits
        if not isinstance(limits, TrajectoryLimits):
            problems.append(f"trajectory_limits must be a TrajectoryLimits, got {limits!r}")
        c = self.rollout_concurrency
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            problems.append(f"rollout_concurrency must be an int >= 1 or None, got {c!r}")
        gap: object = self.checkpoint_min_interval_s
        if isinstance(gap, bool) or not isinstance(gap, int | float) or not 0 <= gap < math.inf:
            problems.append(f"checkpoint_min_interval_s must be a number >= 0, got {gap!r}")
        flag: object = self.reward_in_thread
        if not isinstance(flag, bool):
            problems.append(f"reward_in_thread must be a bool, got {flag!r}")
        verify = verify_setting_problem(self.verify_sync)
        if verify is not None:
            problems.append(verify)
        for name in ("verify_logprob_atol", "verify_logprob_max_atol", "verify_timeout_s"):
            tol: object = getattr(self, name)
            if isinstance(tol, bool) or not isinstance(tol, int | float) or not 0 < tol < math.inf:
                problems.append(f"{name} must be a number > 0, got {tol!r}")
        if self.mode not in _MODES:
            problems.append(f"mode must be one of {_MODES}, got {self.mode!r}")
        if self.weight_sync not in _SYNCS:
            problems.append(f"weight_sync must be one of {_SYNCS}, got {self.weight_sync!r}")
        if not problems and self.staleness < self.sync_every - 1:
            problems.append(
                f"sync_every={self.sync_every} lets the rollout weights lag the trainer by up to "
                f"{self.sync_every - 1} versions, more than staleness={self.staleness}; raise "
                f"staleness to >= {self.sync_every - 1} or lower sync_every"
            )
        if not problems and self.mode == "colocated":
            if self.staleness != 0:
                problems.append(
                    f"mode='colocated' alternates rollout and training, so it is on-policy: "
                    f"staleness must be 0, got {self.staleness}"
                )
            if self.weight_sync != "blocking":
                problems.append(
                    f"mode='colocated' syncs while rollout is stopped: weight_sync must be "
                    f"'blocking', got {self.weight_sync!r}"
                )
            if self.sync_every != 1:
                problems.append(f"mode='colocated' needs sync_every=1, got {self.sync_every}")
        if problems:
            raise ConfigError("invalid RLConfig:\n  - " + "\n  - ".join(problems))

    @classmethod
    def from_verl(
        cls,
        *,
        staleness_threshold: float,
        trigger_parameter_sync_step: int,
        partial_rollout: bool,
        **kwargs: Any,
    ) -> RLConfig:
        """The config equivalent to verl's fully-async knobs: ``sync_every = k``,
        ``staleness = ⌈k·(1 + s)⌉ − 1`` (verl lets the rollouter produce ``(1+s)·k`` batches
        between two syncs), ``partial_rollout`` as is; other fields from ``kwargs``."""
        k, s = trigger_parameter_sync_step, staleness_threshold
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"trigger_parameter_sync_step must be an int >= 1, got {k!r}")
        if not isinstance(s, int | float) or s < 0 or math.isnan(s):
            raise ConfigError(f"staleness_threshold must be a number >= 0, got {s!r}")
        eta = max(math.ceil(k * (1 + s) - 1e-9) - 1, 0)
        cfg = cls(staleness=eta, sync_every=k, partial_rollout=partial_rollout, **kwargs)
        cfg.validate()
        return cfg


@dataclass
class RLEngines:
    """The engines of a job: rollout instances (requests are routed to the least loaded, a
    group sticking to one instance), the trainer, an optional reference model, and the weight
    transport (``make_transport(targets) -> WeightSync``; default in-process).
    ``make_staged(targets, pause_mode) -> StagedSync``: the staged update of
    ``weight_sync = "staged"`` (None: ``StagedUpdate`` over ``make_transport``; the Ray
    runtime passes ``RayDirectWeightSync``, trainer actor to rollout actors)."""

    rollout: Sequence[InferenceEngine]
    trainer: TrainEngine
    reference: TrainEngine | None = None
    make_transport: MakeTransport = InProcessWeightSync
    make_staged: MakeStaged | None = None


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One optimizer step: the version it produced (the trainer's absolute ``weight_version``:
    a trainer that started the run at v0 reports v0 + 1, v0 + 2, …), when it ended (loop
    seconds since the job started), samples and tokens trained, the staleness of its samples
    (versions behind the trainer), the metrics, and the mean reward of its samples."""

    version: Version
    end_s: float
    samples: int
    tokens: int
    max_staleness: int
    metrics: TrainMetrics
    reward_mean: float = math.nan
    groups: tuple[int | str, ...] = ()
    """The prompt groups this step trained (``Tags.group``)."""

    def as_json(self) -> dict[str, Any]:
        """The record as JSON values (``from_json`` reads it back)."""
        m = self.metrics
        return {
            "version": self.version, "end_s": self.end_s, "samples": self.samples,
            "tokens": self.tokens, "max_staleness": self.max_staleness,
            "reward_mean": None if math.isnan(self.reward_mean) else self.reward_mean,
            "groups": list(self.groups),
            "metrics": {
                "version": m.version, "loss": m.loss, "grad_norm": m.grad_norm,
                "samples": m.samples, "tokens": m.tokens, "extra": dict(m.extra),
            },
        }  # fmt: skip

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> StepRecord:
        m = d["metrics"]
        reward = d.get("reward_mean")
        return cls(
            int(d["version"]), float(d["end_s"]), int(d["samples"]), int(d["tokens"]),
            int(d["max_staleness"]),
            TrainMetrics(
                int(m["version"]), float(m["loss"]), float(m["grad_norm"]), int(m["samples"]),
                int(m["tokens"]), {str(k): float(v) for k, v in m.get("extra", {}).items()},
            ),
            math.nan if reward is None else float(reward), tuple(d.get("groups", ())),
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class RLResult:
    """What one ``run()`` did. ``wall_s`` counts the initial sync (if one was needed) and the
    pipeline. Throughputs are per loop second (virtual seconds on a virtual clock).
    ``steady_*`` exclude the first step (pipeline fill), as throughput is usually reported."""

    config: RLConfig
    steps: tuple[StepRecord, ...]
    wall_s: float
    dropped: int
    generated: int
    pipeline: PipelineResult
    tracer: Tracer | None = None

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.steps)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.steps)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def steady_samples_per_s(self) -> float:
        return self._steady(lambda s: s.samples)

    @property
    def steady_tokens_per_s(self) -> float:
        return self._steady(lambda s: s.tokens)

    def _steady(self, amount: Callable[[StepRecord], int]) -> float:
        """``amount`` per second after the first step (over the whole run if only one)."""
        if len(self.steps) < 2:
            total = sum(amount(s) for s in self.steps)
            return total / self.wall_s if self.wall_s > 0 else 0.0
        span = self.steps[-1].end_s - self.steps[0].end_s
        n = sum(amount(s) for s in self.steps[1:])
        return n / span if span > 0 else 0.0

    @property
    def max_staleness(self) -> int:
        return max((s.max_staleness for s in self.steps), default=0)


JOB_STATE_FORMAT = "asyncflow-rljob/1"
JOB_STATE_FILE = "job.json"
TRAINER_FOLDER = "trainer"


@dataclass(frozen=True)
class JobState:
    """An ``RLJob``'s checkpointed state (``job.json`` of a checkpoint folder, beside the
    trainer's own files in ``trainer/``). ``version``: the trainer's weight version at the
    checkpoint; ``origin``: its version when the job's first run started (so ``version −
    origin`` steps are done). ``fed``: prompts taken from the prompt stream so far (a resumed
    job skips that many); ``pending``: ``(group, prompt)`` of every group fed but neither
    trained nor dropped as stale at the checkpoint (a resumed job feeds them again first).
    ``steps``: every step record since ``origin``. Counters (``dropped``, ``generated``,
    ``restarts``) and ``wall_s`` are totals since ``origin``. ``staleness`` and
    ``batch_size``: the config the admission state was counted with; a resumed job starts
    its admission bound at ``version`` with nothing in flight (every in-flight row is
    regenerated)."""

    version: Version
    origin: Version
    fed: int
    pending: tuple[tuple[int | str, Any], ...]
    steps: tuple[StepRecord, ...]
    dropped: int
    generated: int
    restarts: int
    wall_s: float
    staleness: int
    batch_size: int

    def as_json(self) -> dict[str, Any]:
        return {
            "format": JOB_STATE_FORMAT, "version": self.version, "origin": self.origin,
            "fed": self.fed, "pending": [[g, p] for g, p in self.pending],
            "steps": [s.as_json() for s in self.steps], "dropped": self.dropped,
            "generated": self.generated, "restarts": self.restarts, "wall_s": self.wall_s,
            "staleness": self.staleness, "batch_size": self.batch_size,
        }  # fmt: skip

    @classmethod
    def read(cls, folder: str | Path) -> JobState:
        """The state in checkpoint ``folder``; ``CheckpointError`` naming what is wrong (no
        such file, not JSON, another format, a missing or bad field)."""
        path = Path(folder) / JOB_STATE_FILE
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(
                f"{str(folder)!r} is not a job checkpoint: it has no {JOB_STATE_FILE} (give a "
                "checkpoint folder written by RLJob.checkpoint, e.g. RUN/checkpoints/step-N)"
            ) from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{str(path)!r} is not readable JSON: {e}") from e
        if not isinstance(d, dict) or d.get("format") != JOB_STATE_FORMAT:
            found = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise CheckpointError(
                f"{str(path)!r}: format {found!r}, expected {JOB_STATE_FORMAT!r} (a checkpoint "
                "of another program or version)"
            )
        try:
            state = cls(
                version=int(d["version"]), origin=int(d["origin"]), fed=int(d["fed"]),
                pending=tuple((g, p) for g, p in d["pending"]),
                steps=tuple(StepRecord.from_json(s) for s in d["steps"]),
                dropped=int(d["dropped"]), generated=int(d["generated"]),
                restarts=int(d["restarts"]), wall_s=float(d["wall_s"]),
                staleness=int(d["staleness"]), batch_size=int(d["batch_size"]),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{str(path)!r}: a missing or bad field ({e!r})") from e
        if (
            state.version < state.origin
            or state.fed < 0
            or state.version - state.origin != len(state.steps)
        ):
            raise CheckpointError(
                f"{str(path)!r} is inconsistent: version {state.version}, origin "
                f"{state.origin}, {len(state.steps)} step records, fed {state.fed}"
            )
        why = state._contradiction()
        if why:
            raise CheckpointError(
                f"{str(path)!r} contradicts its own step records: {why}; the checkpoint is "
                "damaged or was edited (resume from an older one)"
            )
        return state

    def _contradiction(self) -> str:
        """Why the counters disagree with the step records ('' when they agree): the steps'
        versions are ``origin + 1 .. version`` in order; every group trained or pending was
        fed (group ids are ``0 .. fed - 1``), none is pending and trained, none pending twice."""
        versions = [s.version for s in self.steps]
        if versions != list(range(self.origin + 1, self.version + 1)):
            return f"step versions {versions[:5]}... are not {self.origin + 1}..{self.version}"
        trained = {g for s in self.steps for g in s.groups}
        pending = [g for g, _ in self.pending]
        unfed = sorted(
            g for g in trained.union(pending) if isinstance(g, int) and not 0 <= g < self.fed
        )
        if unfed:
            return f"groups {unfed[:5]} were trained or pending, but fed is {self.fed}"
        both = sorted(trained.intersection(pending), key=str)
        if both:
            return f"groups {both[:5]} are both trained and pending"
        if len(set(pending)) != len(pending):
            return "a pending group is listed twice"
        return ""


def _jsonable_prompt(prompt: object, group: int | str) -> Any:
    """A prompt (token ids, or an agent job's sample dict) as JSON values, for a checkpoint."""
    if isinstance(prompt, Mapping):
        value: Any = dict(prompt)
    elif isinstance(prompt, torch.Tensor):
        value = [int(t) for t in prompt.tolist()]
    else:
        value = [int(t) for t in prompt]  # type: ignore[attr-defined]
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"the prompt of group {group!r} cannot be checkpointed: it is not JSON-able ({e}); "
            "a job with checkpoints needs prompts of token ids or JSON-able sample dicts"
        ) from e
    return value


def _tokens(batch: Batch, fields: Sequence[str]) -> int:
    """Tokens of ``fields`` over the batch's rows, in any layout: from ``batch.lengths``
    (padded, nested), else from the rows' tensors (list)."""
    total = 0
    for f in fields:
        if f in batch.lengths:
            total += int(batch.lengths[f].sum())
        elif f in batch.data:
            value = batch.data[f]
            if isinstance(value, list):
                total += sum(int(t.shape[0]) for t in value if isinstance(t, torch.Tensor))
            elif isinstance(value, torch.Tensor) and value.is_nested:
                total += sum(int(t.shape[0]) for t in value.unbind())
    return total


def _to_list(t: torch.Tensor) -> list[Any]:
    """``t.tolist()``; through numpy for a plain CPU tensor (the same Python values, about
    twice as fast: the reward's conversions were ~5% of a simulated run)."""
    values: list[Any]
    if t.device.type == "cpu" and not t.requires_grad and t.dtype in _NUMPY_LISTABLE:
        try:
            values = t.numpy().tolist()
            return values
        except RuntimeError:  # a view numpy cannot share (e.g. a lazy negation): convert
            pass
    values = t.tolist()
    return values


_NUMPY_LISTABLE = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                             torch.bool, torch.float64, torch.float32})  # fmt: skip


def _advantages(tags: Sequence[Tags], rewards: Any) -> torch.Tensor:
    """Group advantages over the rows whose reward did not fail; a failed row (NaN reward)
    gets advantage 0, so it trains nothing and its group is scored without it."""
    groups = [t.group if t.group is not None else i for i, t in enumerate(tags)]
    values = torch.as_tensor(rewards, dtype=torch.float32)
    ok = torch.isfinite(values)
    if bool(ok.all()):
        return group_advantages(values, groups)
    advantage = torch.zeros_like(values)
    if bool(ok.any()):
        kept = [g for g, good in zip(groups, ok.tolist(), strict=True) if good]
        advantage[ok] = group_advantages(values[ok], kept)
    return advantage


def _distinct_versions(versions: Sequence[Version]) -> tuple[Version, ...]:
    """The distinct weight versions of a generation's tokens, ascending. Most generations
    ran under one version: one C-level count answers those without building a set."""
    if not versions:
        return ()
    first = versions[0]
    if isinstance(versions, tuple | list) and versions.count(first) == len(versions):
        return (first,)
    return tuple(sorted(set(versions)))


def _column(values: Sequence[Any], dtype: torch.dtype, view: object = None) -> torch.Tensor:
    """A generation result's tokens or log-probs as a 1-D tensor of ``dtype``. ``view``: the
    same values as a 1-D tensor, if the engine gave them (the simulated engine's results
    carry ``token_view`` and ``logprob_view``); it is copied instead of converting value by
    value when its dtype and length match."""
    if isinstance(view, torch.Tensor) and view.dtype == dtype and view.shape == (len(values),):
        return view.clone()
    if not values:
        return torch.tensor(values, dtype=dtype)
    # numpy converts a sequence of Python numbers several times faster than torch.tensor,
    # with the same values (float32 rounds to nearest from the float64 Python value)
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is None or not isinstance(values, tuple | list):
        return torch.tensor(values, dtype=dtype)
    try:
        array = np.fromiter(values, dtype=np_dtype, count=len(values))
    except (TypeError, ValueError, OverflowError):  # not plain numbers: torch says why
        return torch.tensor(values, dtype=dtype)
    return torch.from_numpy(array)


_NUMPY_DTYPES = {torch.long: np.int64, torch.float32: np.float32}


class _Guarded:
    """A rollout engine as a weight-sync target: losing it (``EngineLostError``) in a pause,
    load or resume tells the job (``lost(name, error)``, which takes it out of routing and
    of later syncs) and ends that call as if it succeeded: there is nothing left to load."""

    def __init__(
        self,
        engine: SupportsLoadWeights,
        name: str,
        lost: Callable[[str, EngineLostError], None],
    ) -> None:
        self.engine = engine
        self.name = name
        self._lost = lost

    @property
    def weight_version(self) -> Version:
        return self.engine.weight_version  # type: ignore[attr-defined, no-any-return]

    async def _call(self, method: str, *args: Any) -> None:
        fn = getattr(self.engine, method, None)
        if fn is None:  # an engine without pause/resume
            return
        try:
            await fn(*args)
        except EngineLostError as error:
            self._lost(self.name, error)

    async def load_weights(self, weights: Any, version: Version) -> None:
        await self._call("load_weights", weights, version)

    async def pause(self, mode: Literal["abort", "keep"] = "keep") -> None:
        await self._call("pause", mode)

    async def resume(self) -> None:
        await self._call("resume")


class _Gate:
    """Rollout admission to the engines: closed during a blocking sync or, colocated, while the
    trainer has the devices; counts generations in flight so a sync can drain them."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def enter(self) -> None:
        while not self._open.is_set():
            await self._open.wait()
        self.active += 1
        self._idle.clear()

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    async def drained(self) -> None:
        await self._idle.wait()


class _DropCounter:
    """The update's sampler: stale whole groups are dropped and their admission slots freed."""

    def __init__(self, inner: StalenessSampler, admission: AdmissionController) -> None:
        self.inner = inner
        self.admission = admission
        self.dropped = 0

    @property
    def repeatable(self) -> bool:
        """Counting happens only on drops, so it repeats as ``inner`` does."""
        return is_repeatable(self.inner)

    def cannot_fill(self, view: FillView, request: SampleRequest) -> bool:
        """``inner``'s promise of an empty answer: then nothing is dropped or counted."""
        inner = cannot_fill_of(self.inner)
        return inner is not None and inner(view, request)

    def select(self, candidates: Candidates, request: SampleRequest) -> Selection:
        sel = self.inner.select(candidates, request)
        if sel.dropped:
            self.dropped += len(sel.dropped)
            self.admission.discard(len(sel.dropped))
        return sel


def _check_loss_fields(loss_fn: LossFn, config: RLConfig) -> None:
    """Refuse, before anything runs, a built-in loss that reads a field the job will not
    compute: it would otherwise fail only at the first update, after a batch was generated."""
    if not isinstance(loss_fn, PPOClipLoss | DecoupledPPOLoss):
        return
    name = type(loss_fn).__name__
    reads_prox = (
        isinstance(loss_fn, DecoupledPPOLoss) or loss_fn.old_logprobs_field == PROX_LOGPROBS
    )
    if reads_prox and not config.proximal_logprobs:
        raise ConfigError(
            f"loss_fn {name} reads the {PROX_LOGPROBS!r} field, which the job computes only "
            "with RLConfig(proximal_logprobs=True); set it"
        )
    if loss_fn.kl_coef > 0 and not config.reference_logprobs:
        raise ConfigError(
            f"loss_fn {name} has kl_coef={loss_fn.kl_coef} and so reads the 'ref_logprobs' "
            "field, which the job computes only with RLConfig(reference_logprobs=True) and "
            "RLEngines.reference; set both, or kl_coef=0"
        )


def _check_tensor_loads(config: RLConfig, engines: RLEngines) -> None:
    """The default weight syncs hand the rollout engines tensors (``load_weights``): the
    staged one (its swap) unless ``make_staged`` is given, the others unless
    ``make_transport`` is. An engine that cannot take them but has a transport of its own
    (``SupportsOwnTransport``: SGLang's weight group, vLLM's) gets its weights through that
    one instead (the staged swap through ``make_transport`` when one is given). Refuse, before
    anything runs, an engine that can do neither, or whose own transport cannot be used here
    (naming the setting that works)."""
    staged_default = config.weight_sync == "staged" and engines.make_staged is None
    direct_default = (
        config.weight_sync != "staged" and engines.make_transport is InProcessWeightSync
    )
    if not (staged_default or direct_default):
        return
    custom_swap = staged_default and engines.make_transport is not InProcessWeightSync
    for i, engine in enumerate(engines.rollout):
        reason = tensor_load_refusal(engine)
        if reason is not None and isinstance(engine, SupportsOwnTransport):
            if custom_swap:
                continue  # the staged swap goes through the user's transport
            same = [e for e in engines.rollout if type(e) is type(engine)]
            refusal = engine.own_transport_refusal(same)
            if refusal is None:
                continue
            raise ConfigError(
                f"weight_sync={config.weight_sync!r}: rollout engine {i} "
                f"({type(engine).__name__}) takes no tensors through load_weights ({reason}), "
                f"and its own weight transport cannot be set up by default: {refusal}"
            )
        if reason is not None:
            raise ConfigError(
                f"weight_sync={config.weight_sync!r}: rollout engine {i} "
                f"({type(engine).__name__}) cannot take tensors through load_weights: "
                f"{reason}. Use weight_sync='blocking' with RLEngines(make_transport=...) a "
                "transport the engine receives from (e.g. asyncflow_vllm.VLLMWeightSync over "
                "the engine's NCCL group), or give the engine a way to take tensors"
            )


def _sample_cell(sample: object, group: int | str) -> dict[str, Any]:
    """An agent job's sample as a store cell (a JSON-able dict)."""
    if not isinstance(sample, Mapping):
        raise BadRequestError(
            f"sample {group} is a {type(sample).__name__}; an agent job's prompts yield samples "
            "as dicts (e.g. {'messages': [...], ...the fields its reward or tools need})"
        )
    return dict(sample)


def _agent_metrics(stats: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Per-step figures of the trained trajectories: mean turns, tool calls and tool errors
    per trajectory, restarts in all."""
    n = max(len(stats), 1)
    return {
        "agent_turns": sum(float(s.get("turns", 0)) for s in stats) / n,
        "agent_tool_calls": sum(float(s.get("tool_calls", 0)) for s in stats) / n,
        "agent_tool_errors": sum(float(s.get("tool_errors", 0)) for s in stats) / n,
        "agent_restarts": float(sum(int(s.get("restarts", 0)) for s in stats)),
    }


class RLJob:
    """An RL job on the streaming store. ``prompts`` yields prompt token sequences (consumed
    lazily, one per group); ``reward_fn(prompt, response) -> float``.

    **Agent jobs** (``agent=``, an ``asyncflow_core.flow.agent.AgentLoop``): ``prompts`` yields
    *samples* instead, JSON-able dicts (messages, the fields a reward or a tool needs), and
    the rollout runs the loop once per sample and row of its group, each trajectory on a
    ``GenerationClient`` (sticky to one engine, ``config.trajectory_limits``, partial rollout
    inside a turn, per-turn trace spans). A trajectory is stored as ``prompt`` (its tokens
    before the first generated one), ``response`` (everything after: assistant, tool, user
    tokens), ``logprobs`` (0 where not generated), ``loss_mask`` (1 exactly on the generated
    tokens: every loss in ``asyncflow_core.training.rl`` trains those only) and ``agent`` (its
    ``Trajectory.stats()`` plus ``restarts``); its staleness tag is the versions of its
    generated tokens (the oldest counts). The reward is the loop's (``Trajectory.reward``)
    unless ``reward_fn`` is given, which then scores ``(prompt, response)`` as usual. A
    trajectory that became too stale to train before its next turn is regenerated
    (``RLConfig.max_restarts``). Per step, ``metrics.extra`` gains ``agent_turns``,
    ``agent_tool_calls``, ``agent_tool_errors`` (means per trajectory) and
    ``agent_restarts`` (sum).

    ``run()`` syncs the
    rollout engines to the trainer's version if they differ, trains ``config.steps`` optimizer
    steps from there and returns an ``RLResult`` (see the module docstring's *Versions*; a
    second ``run()`` trains ``config.steps`` more). ``loss_fn`` is the update's objective
    (``asyncflow_core.training.rl``; a built-in one that reads ``prox_logprobs`` or ``ref_logprobs``
    is refused here unless the config computes them). ``pipeline`` is the ``Pipeline`` it runs
    (inspect or trace it; build your own variant from the same parts). ``on_step(record)`` is
    called after every optimizer step (e.g. to drive a progress bar). Guide:
    ``docs/rl-jobs.md``."""

    def __init__(
        self,
        config: RLConfig,
        engines: RLEngines,
        prompts: Iterable[Sequence[int]] | Iterable[Mapping[str, Any]],
        reward_fn: RewardFn | None = None,
        *,
        agent: AgentLoop | None = None,
        loss_fn: LossFn = policy_gradient_loss,
        tracer: Tracer | None = None,
        store: DataStore | None = None,
        on_step: Callable[[StepRecord], None] | None = None,
        checkpoints: Checkpoints | None = None,
    ) -> None:
        config.validate()
        if not engines.rollout:
            raise ConfigError("RLEngines.rollout is empty: give at least one InferenceEngine")
        if agent is not None and not isinstance(agent, AgentLoop):
            raise ConfigError(
                f"agent must be an AgentLoop (an object with async run(sample, client) -> "
                f"Trajectory), got {type(agent).__name__}"
            )
        if reward_fn is None and agent is None:
            raise ConfigError(
                "RLJob needs a reward_fn(prompt, response) -> float, or an agent loop whose "
                "trajectories carry their reward"
            )
        if config.reference_logprobs and engines.reference is None:
            raise ConfigError(
                "reference_logprobs=True needs RLEngines.reference (a TrainEngine holding the "
                "reference policy)"
            )
        _check_loss_fields(loss_fn, config)
        if config.weight_sync == "inflight":
            for i, engine in enumerate(engines.rollout):
                reason = inflight_load_refusal(engine)
                if reason is not None:
                    raise ConfigError(
                        f"weight_sync='inflight': rollout engine {i} ({type(engine).__name__}) "
                        f"cannot load weights while it generates: {reason}; use "
                        "weight_sync='staged' (the transfer hidden, only the swap exposed) or "
                        "'blocking'"
                    )
        _check_tensor_loads(config, engines)
        self.config = config
        self.engines = engines
        self.prompts = prompts
        self.reward_fn = reward_fn
        self.agent = agent
        self.restarts = 0
        """Agent jobs: trajectories regenerated because they became too stale (this run)."""
        self.loss_fn = loss_fn
        self.on_step = on_step
        self.tracer = tracer
        self.store = store
        self.checkpoints = checkpoints
        self.history: list[StepRecord] = []
        """Step records of earlier runs (or of the checkpoint this job resumed from)."""
        self._origin: Version | None = None  # the trainer's version at the first run
        self._prior = (0, 0, 0, 0.0)  # dropped, generated, restarts, wall_s before this run
        self._fed = 0  # prompts taken from the stream (group ids are 0 .. _fed - 1)
        self._skip = 0  # prompts a resumed job skips (taken before the checkpoint)
        self._refeed: list[tuple[int | str, Any]] = []  # a resumed job's pending groups
        self._open: dict[int | str, Any] = {}  # fed, neither trained nor dropped
        self._generated_min: dict[int | str, Version] = {}  # generated, oldest version
        self._lock = asyncio.Lock()  # an update and a checkpoint never overlap
        self._checkpointing: set[asyncio.Task[Path]] = set()  # writes under way
        self._last_checkpoint = 0.0  # when the last one was asked for (the job's clock)
        self._checkpoint_failed: BaseException | None = None
        self.lost: dict[str, str] = {}
        """Rollout engines lost during the job (router name -> why); the job went on with the
        others (``EngineLostError``). An engine that restarted and rejoined is taken out."""
        self.restarted: dict[str, int] = {}
        """Rollout engines that came back after a loss (``SupportsRestart``): name -> times."""
        self._rejoining: dict[str, asyncio.Task[None]] = {}  # restarts under way, by name
        self._rejoined = asyncio.Event()  # set when one ends (back in routing, or not)
        self._ended: float | None = None  # the last run's wall seconds, once it ended
        self._start: Version = 0  # the trainer's version when run() started
        # replaced at each run() by one counting from that run's start version
        self.admission = AdmissionController(config.batch_size, config.staleness)
        self.router = RequestRouter([str(i) for i in range(len(engines.rollout))])
        self.gate = _Gate()
        self.steps: list[StepRecord] = []
        self.generated = 0
        self._rid = 0
        self._inflight: dict[str, InferenceEngine] = {}
        self._t0 = 0.0
        self._staged: StagedSync | None = None
        self._verify = VerifySchedule(config.verify_sync)
        self.verified: list[VerifyReport] = []
        """Every sync verification so far (``RLConfig.verify_sync``), one report per engine."""
        self._probe_prompt: tuple[int, ...] | None = None  # the first prompt generated from
        self._transport: WeightSync | None = None
        self._own_transport = False  # _transport is one the job built (closed after run())
        self._closing_transport: asyncio.Future[None] | None = None  # _drop_transport's
        self._transport_ready = False
        self._sleeping = False
        self._closing = False
        self._sampler = _DropCounter(
            StalenessSampler(
                config.staleness if config.drop_stale else 1 << 30, "drop",
                GroupSampler(config.n), whole_groups=True,
            ),
            self.admission,
        )  # fmt: skip
        self.pipeline = self._build()

    # -- composition ---------------------------------------------------------------------------
    def _build(self) -> Pipeline:
        cfg = self.config
        coloc = cfg.mode == "colocated"
        rollout_res = "devices" if coloc else "rollout"
        train_res = "devices" if coloc else "trainer"
        concurrency = cfg.rollout_concurrency or (cfg.staleness + 1) * cfg.prompts_per_step
        # each row's sampling settings travel with its tokens: the trainer scores the tokens
        # under the distribution they were sampled from (asyncflow_core.training.sampling)
        update_consumes = ["prompt", "response", "logprobs", "reward", "advantage"]
        update_consumes += SAMPLING_FIELDS
        # reward and advantage take whole groups greedily, up to one step's worth: one group at
        # a time while they keep up, many per call (fewer store round trips) once behind
        per_call = cfg.batch_size
        whole_groups = functools.partial(GroupSampler, cfg.n, greedy=True)
        if self.agent is None:
            source = Source("prompts", ("prompt",), self._feed, resource="feeder")
            rollout = Task(
                "rollout", self._rollout, consumes=("prompt",),
                produces=("response", "logprobs", *SAMPLING_FIELDS), batch_size=cfg.n,
                workers=concurrency, layout="list", resource=rollout_res, lease_s=_LEASE_S,
            )  # fmt: skip
        else:
            # the loop's task spans a whole trajectory, tool calls included; its generated
            # turns are the spans on the rollout resource (GenerationClient), so time spent
            # in tools is a rollout bubble
            source = Source("samples", ("sample",), self._feed, resource="feeder")
            produces = ["prompt", "response", "logprobs", LOSS_MASK, *SAMPLING_FIELDS, "agent"]
            if self.reward_fn is None:
                produces.append("reward")
            rollout = Task(
                "rollout", self._rollout_agents, consumes=("sample",), produces=tuple(produces),
                batch_size=cfg.n, workers=concurrency, layout="list",
                resource="devices" if coloc else "agent", lease_s=_LEASE_S,
            )  # fmt: skip
            update_consumes += [LOSS_MASK, "agent"]
        tasks = [rollout]
        if self.reward_fn is not None:
            # the reward task scores whole groups, so it writes their advantages too: one
            # store round trip (lease, read, write, ack) per group fewer than a task of its own
            score = self._score if cfg.reward_in_thread else self._score_on_loop
            tasks.append(
                Task(
                    "reward", score, consumes=("prompt", "response"),
                    produces=("reward", "advantage"), batch_size=per_call, sampler=whole_groups,
                    layout="list", resource="reward",
                )
            )  # fmt: skip
        else:  # the agent loop wrote the rewards
            tasks.append(
                Task(
                    "advantage", self._advantage, consumes=("reward",), produces=("advantage",),
                    batch_size=per_call, sampler=whole_groups, resource="reward",
                )
            )  # fmt: skip
        if cfg.reference_logprobs:
            tasks.insert(
                len(tasks) - 1,
                Task(
                    "reference", self._reference,
                    consumes=("prompt", "response", *SAMPLING_FIELDS),
                    produces=("ref_logprobs",), batch_size=cfg.n, resource="reference",
                ),
            )  # fmt: skip
            update_consumes.append("ref_logprobs")
        tasks.append(
            Task(
                "actor_update", self._update, consumes=tuple(update_consumes),
                batch_size=cfg.batch_size, sampler=self._sampler, layout=self._update_layout(),
                current_version=lambda: self.engines.trainer.weight_version,
                resource=train_res, lease_s=_LEASE_S, reuse_batch=True,
            )
        )  # fmt: skip
        in_flight = (cfg.staleness + 2) * cfg.batch_size + concurrency * cfg.n
        return Pipeline(
            source,
            tasks,
            partition=cfg.partition,
            capacity=Capacity(max_rows=in_flight),
            tracer=self.tracer,
        )

    def _update_layout(self) -> Layout:
        """The layout the trainer's batches are fetched in: its ``batch_layout`` attribute if
        it has one (a trainer that only counts tokens, like the simulator's, takes "list"
        and saves padding a whole batch), else "padded"."""
        layout: object = getattr(self.engines.trainer, "batch_layout", "padded")
        if layout == "padded" or layout == "nested" or layout == "list":
            return layout
        raise ConfigError(
            f"the trainer's batch_layout must be 'padded', 'nested' or 'list', got {layout!r}"
        )

    # -- the tasks -----------------------------------------------------------------------------
    def _stream(self) -> Iterable[tuple[int | str, Any]]:
        """``(group, prompt)`` in feeding order: a resumed job's pending groups, then the
        prompt stream from where the checkpoint left it (its first ``fed`` prompts skipped)."""
        refeed, self._refeed = self._refeed, []
        yield from refeed
        stream = iter(self.prompts)
        if self._skip:
            skipped = sum(1 for _ in itertools.islice(stream, self._skip))
            if skipped < self._skip:
                raise CheckpointError(
                    f"the prompt stream ended after {skipped} prompts, but the checkpoint "
                    f"resumed from had taken {self._skip}: resume with the same prompts"
                )
            self._skip = 0
        for prompt in stream:
            group = self._fed
            self._fed += 1
            yield group, prompt

    async def _feed(self) -> AsyncIterator[TaskOutput]:
        n = self.config.n
        for group, prompt in self._stream():
            self._open[group] = prompt
            if self.agent is not None:
                sample = _sample_cell(prompt, group)
                await self.admission.admit(n)
                yield TaskOutput({"sample": [sample] * n}, tags=[Tags(group=group)] * n)
                continue
            await self.admission.admit(n)  # the pipeline traces this as the source's wait
            tensor = torch.as_tensor(list(prompt), dtype=torch.long)
            yield TaskOutput({"prompt": [tensor] * n}, tags=[Tags(group=group)] * n)

    async def _rollout(self, batch: Batch) -> TaskOutput:
        group = batch.tags[0].group if batch.tags else None
        prompts: list[tuple[int, ...]] = []
        last: object = None
        for p in batch["prompt"]:  # a group's rows share one prompt tensor: convert it once
            if p is not last:
                last, ids = p, tuple(p.tolist())
            prompts.append(ids)
        results = await self._group(batch, lambda: [self._generate(p, group) for p in prompts])
        versions = [_distinct_versions(r.versions) for r in results]
        self._generated(group, [v[0] for v in versions if v])
        # one cell object per sampling field for the whole group, as its rows share a prompt
        sampling = {
            k: v * len(results) for k, v in sampling_columns([self.config.sampling]).items()
        }
        return TaskOutput(
            {
                "response": [
                    _column(r.tokens, torch.long, getattr(r, "token_view", None)) for r in results
                ],
                "logprobs": [
                    _column(r.logprobs, torch.float32, getattr(r, "logprob_view", None))
                    for r in results
                ],
                **sampling,
            },
            tags=[
                Tags(versions=v, tokens=len(r.tokens))
                for v, r in zip(versions, results, strict=True)
            ],
        )

    async def _group(
        self, batch: Batch, work: Callable[[], list[Coroutine[Any, Any, _T]]]
    ) -> list[_T]:
        """Run one group's generations (``work()``) through the gate, after the staged
        weights' safe point, all at once; one failing (or the task cancelled) stops its
        siblings and frees the group's admission slots. Counts the group as generated."""
        await self.gate.enter()
        try:
            await self._safe_point()
            jobs = [asyncio.ensure_future(w) for w in work()]
            try:
                results = list(await asyncio.gather(*jobs))
            except BaseException:
                for job in jobs:  # one failed (or we were cancelled): stop its siblings
                    job.cancel()
                await asyncio.gather(*jobs, return_exceptions=True)
                raise
        except BaseException:
            self.admission.cancel(len(batch))
            raise
        finally:
            self.gate.leave()
        self.admission.finish(len(batch))
        self.generated += len(batch)
        return results

    async def _generate(self, prompt: tuple[int, ...], group: int | str | None) -> GenerationResult:
        cfg = self.config
        if self._probe_prompt is None:  # the verification probe's: tokens the model knows
            self._probe_prompt = tuple(prompt)
        self._rid += 1
        rid = f"r{self._rid}"
        params = cfg.sampling
        if params.seed is not None:  # one seed per request, or a group's samples would be equal
            params = replace(params, seed=params.seed + self._rid)
        request = GenerationRequest(rid, prompt, params, group=group)
        _, result = await generate_routed(
            self.engines.rollout, self.router, request, len(prompt) + cfg.sampling.max_tokens,
            group, partial_rollout=cfg.partial_rollout, closing=lambda: self._closing,
            inflight=self._inflight, on_lost=self._engine_lost, wait_ready=self._rollout_ready,
        )  # fmt: skip
        return result

    async def _rollout_agents(self, batch: Batch) -> TaskOutput:
        """One group of trajectories: the agent loop once per row, concurrently."""
        group = batch.tags[0].group if batch.tags else None
        samples = batch["sample"]
        done = await self._group(
            batch, lambda: [self._trajectory(s, group, k) for k, s in enumerate(samples)]
        )
        columns: dict[str, list[Any]] = {
            "prompt": [], "response": [], "logprobs": [], LOSS_MASK: [], "agent": [], "reward": []
        }  # fmt: skip
        tags = []
        for trajectory, restarts in done:
            p = trajectory.prompt_length
            columns["prompt"].append(torch.tensor(trajectory.tokens[:p], dtype=torch.long))
            columns["response"].append(torch.tensor(trajectory.tokens[p:], dtype=torch.long))
            logprobs = torch.tensor(trajectory.logprobs[p:], dtype=torch.float32)
            columns["logprobs"].append(logprobs)
            columns[LOSS_MASK].append(torch.tensor(trajectory.loss_mask[p:], dtype=torch.uint8))
            columns["agent"].append({**trajectory.stats(), "restarts": restarts})
            reward = trajectory.reward
            columns["reward"].append(math.nan if reward is None else float(reward))
            generated = {v for v, m in zip(trajectory.versions, trajectory.loss_mask, strict=True)
                         if m}  # fmt: skip
            tags.append(Tags(versions=tuple(sorted(generated)), tokens=len(trajectory.tokens) - p))
        if self.reward_fn is not None:
            del columns["reward"]
        columns.update(sampling_columns([self.config.sampling] * len(done)))
        self._generated(group, [v for t in tags for v in t.versions])
        return TaskOutput(columns, tags=tags)

    def _generated(self, group: int | str | None, versions: Sequence[Version]) -> None:
        """Note a group's generation finished, with the oldest version among its tokens."""
        if group is not None and versions:
            self._generated_min[group] = min(versions)

    async def _trajectory(
        self, sample: dict[str, Any], group: int | str | None, k: int
    ) -> tuple[Trajectory, int]:
        """Run the loop on one sample (regenerating a trajectory that became too stale to be
        trained, ``max_restarts`` times at most); the trajectory and its restarts."""
        cfg = self.config
        assert self.agent is not None
        restarts = 0
        while True:
            self._rid += 1
            sampling = cfg.sampling
            if sampling.seed is not None:  # distinct per trajectory and turn
                sampling = replace(
                    sampling, seed=sampling.seed + self._rid * cfg.trajectory_limits.max_turns
                )
            client = GenerationClient(
                self.engines.rollout, self.router, f"g{group}.{k}.{self._rid}",
                sampling=sampling, limits=cfg.trajectory_limits,
                partial_rollout=cfg.partial_rollout, closing=lambda: self._closing,
                too_stale=self._too_stale if cfg.drop_stale else None, tracer=self.tracer,
                resource="devices" if cfg.mode == "colocated" else "rollout",
                inflight=self._inflight, on_lost=self._engine_lost,
                wait_ready=self._rollout_ready,
            )  # fmt: skip
            trajectory = await self.agent.run(dict(sample), client)
            if not isinstance(trajectory, Trajectory):
                raise BadRequestError(
                    f"the agent loop {type(self.agent).__name__} returned "
                    f"{type(trajectory).__name__}, not a Trajectory (return client.trajectory())"
                )
            trajectory.validate()
            if not trajectory.tokens:
                raise BadRequestError(
                    f"the agent loop {type(self.agent).__name__} returned an empty trajectory; "
                    "add the prompt (client.add(ids, role='prompt')) and generate"
                )
            if self.reward_fn is None and trajectory.reward is None:
                raise BadRequestError(
                    f"the agent loop {type(self.agent).__name__} returned a trajectory without "
                    "a reward and the job has no reward_fn; score it in the loop "
                    "(client.trajectory(reward=...)) or give RLJob a reward_fn"
                )
            if trajectory.ended != "stale" or restarts >= cfg.max_restarts or self._closing:
                return trajectory, restarts
            restarts += 1
            self.restarts += 1

    def _too_stale(self, version: Version) -> bool:
        """A trajectory whose oldest generated token has ``version`` would be dropped by the
        update (more than η versions behind the trainer)."""
        return self.engines.trainer.weight_version - version > self.config.staleness

    async def _score_on_loop(self, batch: Batch) -> dict[str, Any]:
        """``_score`` on the event loop (``RLConfig.reward_in_thread=False``)."""
        return self._score(batch)

    def _score(self, batch: Batch) -> dict[str, Any]:
        """The reward task: rewards of whole groups, and their group advantages."""
        rewards = self._rewards(batch)
        return {"reward": rewards, "advantage": _advantages(batch.tags, rewards)}

    def _rewards(self, batch: Batch) -> list[float]:
        assert self.reward_fn is not None  # the task exists only with one
        prompts, responses = batch["prompt"], batch["response"]
        rewards = []
        last: object = None
        ids: list[int] = []
        for p, r in zip(prompts, responses, strict=True):
            if p is not last:  # a group's rows share one prompt tensor: convert it once
                last, ids = p, _to_list(p)
            # each call gets its own list (a copy is cheaper than a conversion): a reward
            # function may keep or change its arguments
            rewards.append(float(self.reward_fn(ids.copy(), _to_list(r))))
        return rewards

    async def _reference(self, batch: Batch) -> dict[str, list[torch.Tensor]]:
        ref = self.engines.reference
        assert ref is not None
        lp = await ref.compute_logprobs(batch)
        lengths = batch.lengths.get("response")
        rows = []
        for i in range(len(batch)):
            k = int(lengths[i]) if lengths is not None else lp.shape[1]
            rows.append(lp[i, :k].detach().clone())
        return {"ref_logprobs": rows}

    async def _advantage(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The advantage task, when the agent loop wrote the rewards (see ``_advantages``)."""
        return {"advantage": _advantages(batch.tags, batch["reward"])}

    async def _update(self, batch: Batch) -> None:
        async with self._lock:
            await self._update_locked(batch)

    async def _update_locked(self, batch: Batch) -> None:
        cfg = self.config
        trainer = self.engines.trainer
        before = trainer.weight_version
        stale = [before - t.min_version for t in batch.tags if t.versions]
        if cfg.mode == "colocated":
            await self._to_training()
        if cfg.proximal_logprobs:
            prox = await trainer.compute_logprobs(batch)
            lengths = dict(batch.lengths)
            if "response" in lengths:
                lengths[PROX_LOGPROBS] = lengths["response"]
            batch = Batch(batch.rows, {**batch.data, PROX_LOGPROBS: prox}, lengths, batch.tags)
        metrics = await trainer.train_step(batch, self.loss_fn)
        failpoint("update.step")
        groups = tuple(dict.fromkeys(t.group for t in batch.tags if t.group is not None))
        self._trained(groups, metrics.version)
        tokens = _tokens(batch, ("prompt", "response"))
        version = metrics.version
        done = version - self._start  # steps of this run: the cadence and the end count these
        # no sync after the last step: nothing would use it
        if done % cfg.sync_every == 0 and done < cfg.steps:
            await self._sync(version)
        rewards = torch.as_tensor(batch["reward"], dtype=torch.float32)
        failed = int((~torch.isfinite(rewards)).sum())
        reward = float(rewards.nanmean()) if failed < len(rewards) else math.nan
        if failed:
            metrics = replace(metrics, extra={**metrics.extra, "reward_failed": float(failed)})
        if "agent" in batch:
            metrics = replace(metrics, extra={**metrics.extra, **_agent_metrics(batch["agent"])})
        record = StepRecord(
            version, self._now(), len(batch), tokens, max(stale, default=0), metrics, reward,
            groups,
        )  # fmt: skip
        self.steps.append(record)
        if self.tracer is not None:
            values: dict[str, float] = {k: v for k, v in metrics.extra.items() if k != "step"}
            values.update(
                loss=metrics.loss, grad_norm=metrics.grad_norm, samples=len(batch),
                tokens=tokens, max_staleness=record.max_staleness,
                dropped=self._sampler.dropped, reward_mean=reward,
            )  # fmt: skip
            self.tracer.metric(step=version, **values)
        if self.on_step is not None:
            self.on_step(record)
        every = cfg.checkpoint_every
        periodic = bool(every) and done % every == 0
        if periodic and self._now() - self._last_checkpoint < cfg.checkpoint_min_interval_s:
            periodic = False  # the previous one is recent enough
        if self.checkpoints is not None and (done >= cfg.steps or periodic):
            self._last_checkpoint = self._now()
            self._checkpoint_soon()
        if done >= cfg.steps:
            self.pipeline.stop()

    def _trained(self, groups: Sequence[int | str], version: Version) -> None:
        """Close the groups a step trained, and those it made too stale to train ever (the
        update's sampler drops them: their oldest token is more than η versions behind)."""
        for g in groups:
            self._open.pop(g, None)
            self._generated_min.pop(g, None)
        if self.config.drop_stale:
            eta = self.config.staleness
            for g, oldest in list(self._generated_min.items()):
                if version - oldest > eta:
                    self._open.pop(g, None)
                    del self._generated_min[g]

    # -- checkpoints ---------------------------------------------------------------------------
    def state(self) -> JobState:
        """The job's state now (what a checkpoint holds besides the trainer's files)."""
        cfg = self.config
        dropped, generated, restarts, wall_s = self._prior
        version = self.engines.trainer.weight_version
        origin = self._start if self._origin is None else self._origin
        return JobState(
            version=version, origin=origin, fed=self._fed,
            pending=tuple((g, _jsonable_prompt(p, g)) for g, p in self._open.items())
            + tuple(self._refeed),
            steps=tuple(self.history) + tuple(self.steps),
            dropped=dropped + self._sampler.dropped, generated=generated + self.generated,
            restarts=restarts + self.restarts, wall_s=wall_s + self._elapsed(),
            staleness=cfg.staleness, batch_size=cfg.batch_size,
        )  # fmt: skip

    def _checkpoint_soon(self) -> None:
        """Write a checkpoint as soon as this update has returned: a task that takes the lock
        after it (so nothing trains in between), once the pipeline has recorded the update's
        span (the trace in the checkpoint then holds every trained step). A failed write
        stops the job; ``run()`` raises it."""
        task = asyncio.get_running_loop().create_task(self.checkpoint())
        self._checkpointing.add(task)

        def done(t: asyncio.Task[Path]) -> None:
            self._checkpointing.discard(t)
            if not t.cancelled() and t.exception() is not None:
                self._checkpoint_failed = t.exception()
                self.pipeline.stop()

        task.add_done_callback(done)

    async def checkpoint(self) -> Path:
        """Write a checkpoint now (between optimizer steps: it waits for one in progress)
        into ``checkpoints``; returns its folder. E.g. on SIGTERM, before the job stops."""
        if self.checkpoints is None:
            raise ConfigError("RLJob.checkpoint() needs RLJob(checkpoints=Checkpoints(folder))")
        async with self._lock:
            return await self._write_checkpoint()

    async def _write_checkpoint(self) -> Path:
        assert self.checkpoints is not None
        state = self.state()
        trainer = self.engines.trainer

        async def fill(folder: Path) -> None:
            t0 = self._now()
            await trainer.save_checkpoint(str(folder / TRAINER_FOLDER))
            (folder / JOB_STATE_FILE).write_text(json.dumps(state.as_json()) + "\n")
            if self.tracer is not None:
                self.tracer.record(
                    "checkpoint", "checkpoint", t0, self._now(), resource="trainer",
                    version=state.version,
                )  # fmt: skip

        return await self.checkpoints.write(state.version, fill)

    async def resume(self, folder: str | Path) -> JobState:
        """Continue from checkpoint ``folder`` (written by ``checkpoint`` or by the job's
        ``checkpoint_every``): the trainer loads its state (weights, optimizer, version), the
        step records and counters continue, and the next ``run()`` feeds the groups that were
        pending at the checkpoint first, then the prompt stream after the prompts it had
        taken. Give this job the same prompt stream (it skips the first ``fed``) and
        ``config.steps`` = the steps still to do. Call it before ``run()``. With
        ``checkpoints``, the folder is first checked against its signed manifest
        (``Checkpoints.verify``: ``CheckpointError`` naming a changed, missing or added file);
        ``job.json`` is always checked against its own step records (``JobState.read``)."""
        if self._origin is not None or self.steps:
            raise ConfigError("RLJob.resume() must come before the job's first run()")
        if self.checkpoints is not None:  # its signed manifest: every file as it was written
            await asyncio.to_thread(self.checkpoints.verify, folder)
        state = JobState.read(folder)
        trainer = self.engines.trainer
        await trainer.load_checkpoint(str(Path(folder) / TRAINER_FOLDER))
        if trainer.weight_version != state.version:
            raise CheckpointError(
                f"{str(folder)!r}: the trainer loaded version {trainer.weight_version}, but the "
                f"job state is at version {state.version}: the folder's trainer/ and job.json "
                "do not belong together"
            )
        self._origin = state.origin
        self._fed = self._skip = state.fed
        self._refeed = list(state.pending)
        self.history = list(state.steps)
        self._prior = (state.dropped, state.generated, state.restarts, state.wall_s)
        return state

    # -- weight sync ---------------------------------------------------------------------------
    def _live(self) -> list[tuple[str, InferenceEngine]]:
        """The rollout engines not lost, with their router names."""
        return [(str(i), e) for i, e in enumerate(self.engines.rollout) if str(i) not in self.lost]

    def _load_targets(self, why: str = "", *, guard: bool = True) -> list[SupportsLoadWeights]:
        """The live rollout engines as weight-sync targets; ``guard``: each wrapped so that
        losing it in the middle of a sync takes it out of the job instead of failing the
        sync (``_Guarded``)."""
        live = self._live()
        missing = [
            f"{name} ({type(e).__name__})"
            for name, e in live
            if not isinstance(e, SupportsLoadWeights)
        ]
        if missing:
            raise ConfigError(
                "every rollout engine must support load_weights(weights, version) for weight "
                f"sync; rollout engine(s) {', '.join(missing)} do not{why}"
            )
        if not guard:
            return [e for _, e in live]  # type: ignore[misc]  # checked above
        return [_Guarded(e, name, self._engine_lost) for name, e in live]  # type: ignore[arg-type]

    def _engine_lost(self, name: str, error: EngineLostError) -> None:
        """Rollout engine ``name`` is gone: take it out of routing and of weight sync (its
        requests are sent again by ``generate_routed``). An engine that can restart
        (``SupportsRestart``) comes back through ``_rejoin``; with none left and none
        coming back, the job stops."""
        if name in self.lost:
            return
        engine = self.engines.rollout[int(name)]
        if isinstance(engine, SupportsRestart) and not engine.lost:
            return  # a call sent before the engine restarted failed late: it is back already
        self.lost[name] = str(error)
        if name in self.router.instances:
            self.router.remove_instance(name)
        if self._staged is not None:
            self._staged.engines = [
                e for e in self._staged.engines if getattr(e, "engine", e) is not engine
            ]
        if self._transport is not None:  # rebuilt over the live engines at the next sync
            self._drop_transport()
        live = len(self.engines.rollout) - len(self.lost)
        restart = isinstance(engine, SupportsRestart) and not self._closing and self._can_rejoin()
        _log.warning(
            "rollout engine %s (%s) is lost: %s; its requests go to the %d left%s",
            name, type(engine).__name__, error, live,
            " (it restarts, and rejoins with the current weights)" if restart else "",
        )  # fmt: skip
        if self.tracer is not None:
            now = self._now()
            self.tracer.record(
                "lost", "engine lost", now, now, resource="rollout", engine=name, error=str(error)
            )
        if restart and name not in self._rejoining:
            back = cast(SupportsRestart, engine)
            task = asyncio.get_running_loop().create_task(self._rejoin(name, back))
            self._rejoining[name] = task
        if live == 0 and not self._rejoining:
            raise EngineError(
                f"every rollout engine is lost (the last, {name}: {error}); the job cannot "
                "generate any more"
            ) from error

    def _can_rejoin(self) -> bool:
        """Whether a restarted engine can rejoin: it loads the weights between two updates, so
        no update may wait for generations to drain (they may wait for the engine): not
        colocated, and no blocking sync that drains (one without partial rollout)."""
        cfg = self.config
        drains = cfg.weight_sync == "blocking" and not cfg.partial_rollout
        return cfg.mode == "async" and not drains

    async def _rejoin(self, name: str, engine: SupportsRestart) -> None:
        """Bring lost engine ``name`` back in step: wait for it to restart, then, between two
        updates (the update lock), load the trainer's weights at the trainer's version and
        put it back into routing and into the weight sync. Its requests were sent again
        elsewhere when it was lost; none of its old results can arrive (the engine drops a
        failure from before its restart), so nothing is trained twice."""
        try:
            try:
                await engine.restart()
            except EngineLostError as error:
                self.lost[name] = str(error)
                _log.warning("rollout engine %s stays lost: %s", name, error)
                return
            async with self._lock:  # no update (or sync) moves the trainer meanwhile
                if self._closing:
                    return
                trainer = self.engines.trainer
                version = trainer.weight_version
                weights: list[tuple[str, torch.Tensor]] = []
                async for bucket in trainer.export_weights(self.config.bucket_bytes):
                    weights.extend(zip(bucket.names, bucket.tensors, strict=True))
                target = cast(SupportsLoadWeights, engine)
                try:
                    await target.load_weights(weights, version)
                except EngineLostError as error:  # lost again before it rejoined
                    self.lost[name] = str(error)
                    _log.warning("rollout engine %s was lost again while rejoining", name)
                    return
                del weights
                self.lost.pop(name, None)
                self.restarted[name] = self.restarted.get(name, 0) + 1
                self._with_engine(name)
            _log.warning("rollout engine %s restarted and rejoined at version %d", name, version)
            if self.tracer is not None:
                now = self._now()
                self.tracer.record(
                    "lost", "engine rejoined", now, now, resource="rollout", engine=name,
                    version=version,
                )  # fmt: skip
        finally:
            self._rejoining.pop(name, None)
            self._rejoined.set()

    def _with_engine(self, name: str) -> None:
        """Put a rejoined engine back into routing and into the next weight sync."""
        engine = self.engines.rollout[int(name)]
        if self._staged is not None:
            # a staged sync over the engines (the host buffer) loads it from the next swap
            # on; one of an engine package (a collective group) rebuilds its group over it
            guarded = _Guarded(cast(SupportsLoadWeights, engine), name, self._engine_lost)
            self._staged.engines = [*self._staged.engines, guarded]
        if self._transport is not None:  # rebuilt over the live engines at the next sync
            self._drop_transport()
        self.router.add_instance(name)

    async def _rollout_ready(self) -> None:
        """Before a request is routed: while no rollout engine is left but one is restarting,
        wait for it; with none left and none coming back, the job cannot go on."""
        while not self.router.instances:
            if not self._rejoining:
                raise EngineError(
                    "every rollout engine is lost and none restarted ("
                    + "; ".join(f"{n}: {why}" for n, why in self.lost.items())
                    + "); the job cannot generate any more"
                )
            self._rejoined.clear()
            await self._rejoined.wait()

    def _staged_update(self) -> StagedSync:
        # the engines only load what the host buffer staged: safe to guard whatever the
        # transport is
        if self._staged is None:
            mode: Literal["abort", "keep"] = "abort" if self.config.partial_rollout else "keep"
            targets = self._load_targets()
            if self.engines.make_staged is not None:
                self._staged = self.engines.make_staged(targets, mode)
            elif needs_own_transport(targets):
                # engines that take no tensors: stage here, swap through their own transport
                # (or the one the user gave) at the safe point
                given = self.engines.make_transport
                swap_with: MakeTransport = engine_transport
                if given is not InProcessWeightSync:  # the user's (e.g. a remote server's)

                    def swap_with(targets: Sequence[SupportsLoadWeights]) -> WeightSync:
                        return given([getattr(t, "engine", t) for t in targets])  # unguarded

                self._staged = StagedUpdate(
                    targets,
                    pause_mode=mode,
                    swap_with=swap_with,
                    swap_bucket_bytes=self.config.bucket_bytes,
                )
            else:
                self._staged = StagedUpdate(targets, self.engines.make_transport, pause_mode=mode)
        return self._staged

    def _drop_transport(self) -> None:
        """Forget the direct transport (the engines changed); one the job built is closed
        in the background (its engines leave the group) before the next one is built."""
        transport, self._transport = self._transport, None
        self._transport_ready = False
        if self._own_transport and transport is not None:
            self._own_transport = False
            self._closing_transport = asyncio.ensure_future(close_transport(transport))

    async def _close_own_transports(self) -> None:
        """Close the weight groups the job opened itself (the engines' own transports: the
        staged swap's, a blocking sync's), so the engines leave them and a later run (or job)
        in this process can open them again. A user's ``make_transport`` stays the user's."""
        staged = self._staged
        if isinstance(staged, StagedUpdate) and staged.swap_with is engine_transport:
            await staged.close()
        if self._own_transport and self._transport is not None:
            transport, self._transport = self._transport, None
            self._transport_ready = self._own_transport = False
            await close_transport(transport)

    async def _ensure_transport(self) -> WeightSync:
        """The transport of a blocking or in-flight sync (straight into the engines)."""
        if self._closing_transport is not None:  # the old group is gone before a new one
            closing, self._closing_transport = self._closing_transport, None
            await closing
        if self._transport is None:
            # a transport of our own (in-process) talks to the engines through load_weights
            # only, so it takes guarded targets; another (a collective group, an engine's own
            # channel) needs the engines themselves, and losing one fails its sync
            guard = self.engines.make_transport is InProcessWeightSync
            targets = self._load_targets(guard=guard)
            if guard and needs_own_transport(targets):  # engines with a channel of their own
                self._transport = engine_transport(targets)
                self._own_transport = True
            else:
                self._transport = self.engines.make_transport(targets)
        if not self._transport_ready:
            await self._transport.init()
            self._transport_ready = True
        return self._transport

    async def _transfer(
        self, transport: WeightSync, version: Version, *, send_exposed: bool, load_exposed: bool
    ) -> None:
        """Send every bucket (span "transfer", on the trainer unless exposed to the rollout),
        then ``finish`` (span "load": the targets load the weights)."""
        t0 = self._now()
        await transport.start()
        async for bucket in self._buckets():
            await transport.update(bucket)
        self._span("transfer", "rollout" if send_exposed else "trainer", t0, send_exposed, version)
        t1 = self._now()
        await transport.finish(version)
        self._span("load", "rollout" if load_exposed else "trainer", t1, load_exposed, version)

    async def _buckets(self) -> AsyncIterator[WeightBucket]:
        """The trainer's weights in buckets (the ``sync.transfer`` failpoint after the
        first: a crash in the middle of a sync)."""
        first = True
        async for bucket in self.engines.trainer.export_weights(self.config.bucket_bytes):
            yield bucket
            if first:
                failpoint("sync.transfer")
                first = False

    async def _sync(self, version: Version) -> None:
        cfg = self.config
        if cfg.weight_sync == "staged":  # into the host buffer; swapped at a safe point
            staged = self._staged_update()
            t0 = self._now()
            await staged.sync(self._buckets(), version)
            self._span("transfer", "trainer", t0, False, version)
            self.admission.set_version(version)
            if self._verify.due():  # swap now, while the trainer is at this version
                if self._verifiable():
                    await self._safe_point(force=True)
                await self._verify_engines(version)
            return
        transport = await self._ensure_transport()
        if cfg.weight_sync == "inflight":  # engines stall only while loading
            await self._transfer(transport, version, send_exposed=False, load_exposed=True)
        else:  # blocking
            self.gate.close()
            try:
                t0 = self._now()
                live = self._load_targets()
                if not cfg.partial_rollout:
                    await self.gate.drained()
                try:  # a pause cut short (cancelled, failed) still resumes every engine
                    await _pause(live, "abort" if cfg.partial_rollout else "keep")
                    self._span("drain", "rollout", t0, True, version)
                    if cfg.mode == "colocated":
                        await self._wake()
                    await self._transfer(transport, version, send_exposed=True, load_exposed=True)
                finally:
                    await _resume(self._load_targets())
            finally:
                self.gate.open()
        self.admission.set_version(version)
        if self._verify.due():
            await self._verify_engines(version)

    async def sync_rollout(self) -> None:
        """Bring every rollout engine to the trainer's weights and version, as ``run()`` does
        before it admits anything (nothing is transferred when they are there already); e.g.
        to evaluate a resumed trainer's policy without training."""
        self._start = self.engines.trainer.weight_version
        if self._origin is None:
            self._origin = self._start
        try:
            await self._initial_sync()
        finally:
            await self._close_own_transports()

    async def _initial_sync(self) -> None:
        """Bring every rollout engine to the start version before anything is admitted. The
        engines tag each token with their own version, so an engine left behind a trainer that
        starts at v0 > 0 would make every sample look stale to the update (all dropped), and
        its first groups would be generated by weights the trainer never had. Nothing is
        generating yet, so the whole sync is exposed and needs no pause or drain; it goes
        through the job's own strategy so a transport that can be set up only once (a
        collective group) is the one the later syncs reuse."""
        version = self._start
        behind = [
            f"{i} at {e.weight_version}" for i, e in self._live() if e.weight_version != version
        ]
        if not behind:
            return
        self._load_targets(
            f" (the trainer starts at version {version} and rollout engine(s) "
            f"{', '.join(behind)} must get its weights before they generate; or load the "
            "trainer's weights into them yourself before run())"
        )
        cfg = self.config
        if cfg.weight_sync == "staged":
            staged = self._staged_update()
            t0 = self._now()
            await staged.sync(self._buckets(), version)
            self._span("transfer", "rollout", t0, True, version)
            await self._safe_point()  # the swap, at once: no group is running to finish first
        else:
            transport = await self._ensure_transport()
            await self._transfer(transport, version, send_exposed=True, load_exposed=True)
        if self._verify.due():
            await self._verify_engines(version)

    def _verifiable(self) -> bool:
        """Whether a verification could check anything (no simulator on either side)."""
        if verification_refusal(self.engines.trainer) is not None:
            return False
        return any(verification_refusal(e) is None for _, e in self._live())

    async def _verify_engines(self, version: Version) -> None:
        """Prove every live rollout engine holds the trainer's weights for ``version``
        (``asyncflow_core.sync.verify.verify_engine``; span "verify", on the trainer, which
        waits meanwhile); ``SyncVerificationError`` stops the job. An engine lost meanwhile is
        taken out as in a sync."""
        cfg = self.config
        t0 = self._now()
        prints: dict[Any, Any] = {}  # the trainer's fingerprints, hashed once for all engines
        for name, engine in self._live():
            who = f"rollout engine {name} ({type(engine).__name__})"
            check = verify_engine(
                engine, self.engines.trainer, version, who=who, bucket_bytes=cfg.bucket_bytes,
                trainer_prints=prints,
                probe_prompt=self._probe_prompt or (1, 2, 3, 4),
                mean_atol=cfg.verify_logprob_atol, max_atol=cfg.verify_logprob_max_atol,
            )  # fmt: skip
            try:
                report = await asyncio.wait_for(check, cfg.verify_timeout_s)
            except TimeoutError:
                raise SyncVerificationError(
                    f"verifying the weight sync to version {version} on {who} took more than "
                    f"verify_timeout_s={cfg.verify_timeout_s} s (the engine did not answer the "
                    "probe, or hashing its weights hung); the run stops. Raise the timeout for "
                    "a slow engine, or set verify_sync='off'",
                    engine=who,
                    version=version,
                    differences=[],
                ) from None
            except EngineLostError as exc:
                self._engine_lost(name, exc)
                continue
            self.verified.append(report)
            if report.kind == "skipped":
                _log.info("sync verification of version %s skipped: %s", version, report.reason)
        self._span("verify", "trainer", t0, False, version)

    async def _safe_point(self, *, force: bool = False) -> None:
        """Before a rollout group starts: apply staged weights (the delayed update's swap).
        ``force``: apply even when nothing looks staged, waiting for a swap under way (so
        the engines are at the staged version when it returns)."""
        if self._staged is None or (self._staged.pending_version is None and not force):
            return
        t0 = self._now()
        # one swap at a time, the newest staged set; a swap under way is not cut short when
        # the job stops (a group half-joined or a broadcast half-received would leave the
        # engines and the trainer's group unusable): it ends, bounded by its transport's
        # timeouts, and then the cancellation goes on
        swap = asyncio.ensure_future(self._staged.apply())
        try:
            timing = await asyncio.shield(swap)
        except asyncio.CancelledError:
            if not swap.done():
                await asyncio.wait([swap])
            if not swap.cancelled():
                swap.exception()  # retrieved: the job is stopping anyway
            raise
        if timing is not None:
            self._span("swap", "rollout", t0, True, timing.version)

    # -- colocated switching -------------------------------------------------------------------
    async def _to_training(self) -> None:
        self.gate.close()
        await self.gate.drained()
        if not self._sleeping:
            t0 = self._now()
            await asyncio.gather(*(e.sleep(1) for e in self._sleepers()))
            self._sleeping = True
            self._span("offload", "devices", t0, True, None)

    async def _wake(self) -> None:
        if self._sleeping:
            t0 = self._now()
            await asyncio.gather(*(e.wake_up() for e in self._sleepers()))
            self._sleeping = False
            self._span("onload", "devices", t0, True, None)

    def _sleepers(self) -> list[SupportsSleep]:
        """The live rollout engines that can release their memory while the trainer runs
        (those declaring sleep unavailable where they run, e.g. vLLM on a CPU, keep it)."""
        return [
            e
            for _, e in self._live()
            if isinstance(e, SupportsSleep) and unavailable_ability(e, "SupportsSleep") is None
        ]

    # -- running -------------------------------------------------------------------------------
    def _begin(self, start: Version) -> None:
        """Per-run state: a run counts its steps, admissions and drops from ``start``; the
        previous run's records and counters go to the job's history."""
        cfg = self.config
        if self._origin is None:
            self._origin = start
        if self.steps or self.generated:
            dropped, generated, restarts, wall_s = self._prior
            self.history += self.steps
            self._prior = (
                dropped + self._sampler.dropped, generated + self.generated,
                restarts + self.restarts, wall_s + self._elapsed(),
            )  # fmt: skip
        self._open.clear()
        self._generated_min.clear()
        self._start = start
        self.admission = AdmissionController(cfg.batch_size, cfg.staleness, start_version=start)
        self._sampler.admission = self.admission
        self._sampler.dropped = 0
        self.gate = _Gate()
        self.steps = []
        self.generated = 0
        self.restarts = 0

    async def run(self) -> RLResult:
        loop = asyncio.get_running_loop()
        self._begin(self.engines.trainer.weight_version)  # counts the last run's wall first
        self._t0 = loop.time()
        self._last_checkpoint = self._now()  # a periodic checkpoint waits the interval
        self._ended = None
        self._closing = False
        self._verify.restart()
        try:
            await self._initial_sync()
            synced_s = loop.time() - self._t0
            result = await self.pipeline.run(self.store)
        finally:
            self._closing = True  # aborted generations are not re-submitted any more
            for task in list(self._rejoining.values()):
                task.cancel()
            await asyncio.gather(*self._rejoining.values(), return_exceptions=True)
            await self._abort_inflight()
            if self._checkpointing:  # the last step's checkpoint, or one under way
                await asyncio.gather(*self._checkpointing, return_exceptions=True)
            if self._sleeping:  # colocated: hand the engines back awake (no sync after the end)
                await self._wake()
            await self._close_own_transports()
            self._ended = loop.time() - self._t0
        if self._checkpoint_failed is not None:
            failed, self._checkpoint_failed = self._checkpoint_failed, None
            raise CheckpointError(f"writing a checkpoint failed: {failed}") from failed
        return RLResult(
            self.config, tuple(self.steps), synced_s + result.wall_s, self._sampler.dropped,
            self.generated, result, self.tracer,
        )  # fmt: skip

    def run_sync(self) -> RLResult:
        return asyncio.run(self.run())

    async def _abort_inflight(self) -> None:
        by_engine: dict[int, tuple[InferenceEngine, list[str]]] = {}
        for rid, engine in self._inflight.items():
            by_engine.setdefault(id(engine), (engine, []))[1].append(rid)
        for engine, ids in by_engine.values():
            with contextlib.suppress(Exception):
                await engine.abort(ids)
        self._inflight.clear()

    # -- helpers -------------------------------------------------------------------------------
    def _elapsed(self) -> float:
        """Loop seconds since the current (or last) run started; until it ended."""
        if self._ended is not None:
            return self._ended
        return asyncio.get_running_loop().time() - self._t0 if self._t0 else 0.0

    def _now(self) -> float:
        if self.tracer is not None:
            return self.tracer.now()
        return asyncio.get_running_loop().time() - self._t0

    def _span(
        self, phase: str, resource: str, t0: float, exposed: bool, version: Version | None
    ) -> None:
        if self.tracer is None:
            return
        if self.config.mode == "colocated":
            resource = "devices"
        args: dict[str, Any] = {} if version is None else {"version": version}
        self.tracer.record(
            "sync", phase, t0, self._now(), resource=resource, exposed=exposed, **args
        )


__all__ = [
    "JOB_STATE_FILE",
    "JobState",
    "MakeStaged",
    "RLConfig",
    "RLEngines",
    "RLJob",
    "RLResult",
    "RewardFn",
    "StagedSync",
    "StepRecord",
    "group_advantages",
    "policy_gradient_loss",
]
