"""Laws of the RL workflow (``asyncflow_core.flow.rlflow``) on a backend's engines, as a pytest
class to subclass.

Usage::

    from asyncflow_conformance import WorkflowConformance
    from asyncflow_core.flow.rlflow import RLEngines

    class TestMyEngines(WorkflowConformance):
        virtual_clock = True  # engines that sleep on the loop's clock: run on virtual time

        def make_engines(self) -> RLEngines:
            return RLEngines(rollout=[MyEngine(), MyEngine()], trainer=MyTrainer())

Every law runs real ``RLJob`` s on fresh engines from ``make_engines`` under each
``WorkflowCase`` of ``cases`` (by default ``DEFAULT_CASES``: colocated, and asynchronous with
η = 0..3, blocking / staged / in-flight weight sync, ``sync_every`` 1 and 2, with and without
partial rollout), so each (law, case) pair is its own test, e.g.
``test_staleness_never_exceeds_eta[eta1-inflight]``. The engines are wrapped in recording
proxies (``RecordingInferenceEngine``, ``RecordingTrainEngine``) that delegate every method and
claim exactly the abilities (``SupportsPause``, ``SupportsSleep``, ``SupportsLoadWeights``) of
the engine they wrap, so the job behaves as it would on the bare engines.

The laws:

1. every generated sample reaches the actor update at most once; every optimizer step trains
   ``batch_size`` rows made of whole groups of ``n``; the job takes ``steps`` steps;
2. no trained token is more than η versions older than the trainer (nor newer), and
   ``RLResult`` reports that staleness;
3. after ``load_weights(v)`` an engine's new generations report versions ``>= v``; results
   carry one version and log-prob per token and keep a resumed prefix (partial rollout) as it
   was; the synced versions reach every rollout engine;
4. a raising reward function, rollout engine or trainer stops the job with
   ``TaskFailedError`` naming the task ("reward", "rollout", "actor_update"), within a bounded
   real time, and leaves no asyncio task or thread of the job running; a finished job leaves
   nothing running either;
5. ``RLResult.samples == steps × batch_size``.

Each job runs on a ``VirtualClockLoop`` (``virtual_clock = True``, the default: simulated
engines) or with a plain event loop, in a helper thread watched in real time: a job that has
not finished after ``real_timeout_s`` seconds is cancelled and its test fails, so a deadlock
fails CI instead of hanging it. The ``check_*`` functions hold the laws' assertions and can be
used on a ``WorkflowRun`` outside pytest.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import pytest
import torch

from asyncflow_conformance._guard import CANCEL_GRACE_S, run_on_fresh_loop
from asyncflow_conformance.engines import check_resumed_prefix
from asyncflow_core.contracts.errors import TaskFailedError
from asyncflow_core.contracts.protocols import (
    Batch,
    GenerationRequest,
    GenerationResult,
    InferenceEngine,
    LossFn,
    SamplingParams,
    SupportsLoadWeights,
    SupportsPause,
    SupportsSleep,
    Tags,
    TrainEngine,
    TrainMetrics,
    Version,
    WeightBucket,
    WeightSync,
    inflight_load_refusal,
)
from asyncflow_core.flow.rlflow import Mode, RLConfig, RLEngines, RLJob, RLResult, SyncStrategy

__all__ = [
    "DEFAULT_CASES",
    "FAULTS",
    "GenerateCall",
    "InjectedFault",
    "LoadCall",
    "Recorder",
    "RecordingInferenceEngine",
    "RecordingTrainEngine",
    "TrainCall",
    "WorkflowCase",
    "WorkflowConformance",
    "WorkflowRun",
    "check_failure_stops_the_job",
    "check_generations_report_synced_versions",
    "check_nothing_left_running",
    "check_sample_count",
    "check_samples_trained_once",
    "check_staleness_bounded",
    "record_engines",
]

Fault = Literal["reward", "rollout", "actor_update"]
FAULTS: tuple[Fault, ...] = ("reward", "rollout", "actor_update")
"""The tasks the failure law makes raise, by the pipeline task name that must be reported."""


class InjectedFault(RuntimeError):
    """The error the failure law raises on purpose inside a reward function or an engine."""


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WorkflowCase:
    """One job configuration the laws run under (the test id is ``id``); the sizes (steps,
    prompts per step, n, max tokens) come from the conformance class."""

    id: str
    staleness: int
    weight_sync: SyncStrategy
    mode: Mode = "async"
    sync_every: int = 1
    partial_rollout: bool = False

    def config(
        self,
        *,
        steps: int,
        prompts_per_step: int,
        n: int,
        max_tokens: int,
        verify_sync: str = "off",
    ) -> RLConfig:
        cfg = RLConfig(
            verify_sync=verify_sync,
            steps=steps,
            prompts_per_step=prompts_per_step,
            n=n,
            staleness=self.staleness,
            sync_every=self.sync_every,
            partial_rollout=self.partial_rollout,
            mode=self.mode,
            weight_sync=self.weight_sync,
            sampling=SamplingParams(max_tokens=max_tokens),
        )
        cfg.validate()
        return cfg


DEFAULT_CASES: tuple[WorkflowCase, ...] = (
    WorkflowCase("colocated-eta0-blocking", 0, "blocking", mode="colocated"),
    WorkflowCase("eta0-staged", 0, "staged"),
    WorkflowCase("eta1-staged", 1, "staged"),
    WorkflowCase("eta1-inflight", 1, "inflight"),
    WorkflowCase("eta2-blocking-partial", 2, "blocking", partial_rollout=True),
    WorkflowCase("eta3-sync2-staged-partial", 3, "staged", sync_every=2, partial_rollout=True),
)
"""The cases every law runs under unless a subclass sets ``cases``."""


# --------------------------------------------------------------------------------------------
# Recording proxies
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GenerateCall:
    """One ``generate`` call: the engine, the request, the version of the last completed
    ``load_weights`` on that engine when the call started, and the result (None when the call
    raised or was cancelled; ``outcome`` then names what happened)."""

    engine: str
    request: GenerationRequest
    loaded_version: Version
    result: GenerationResult | None
    outcome: str = "ok"


@dataclass(frozen=True, slots=True)
class LoadCall:
    """One completed ``load_weights``: the version loaded and ``weight_version`` right after."""

    engine: str
    version: Version
    reported: Version


@dataclass(frozen=True, slots=True)
class TrainCall:
    """One ``train_step``: the trainer's version before it, the batch's rows and tags, and the
    version the step reported (None when it raised or was cancelled; ``outcome`` then names
    what happened)."""

    version_before: Version
    rows: tuple[int, ...]
    tags: tuple[Tags, ...]
    version_after: Version | None
    outcome: str = "ok"


@dataclass
class Recorder:
    """What the proxies of one job saw, and the faults to inject (1-based call numbers)."""

    generates: list[GenerateCall] = field(default_factory=list)
    loads: list[LoadCall] = field(default_factory=list)
    train_steps: list[TrainCall] = field(default_factory=list)
    engine_names: list[str] = field(default_factory=list)
    owned: list[object] = field(default_factory=list)
    """The backend's own objects (engines, transports): tasks they run are theirs, not the
    job's."""
    fail_generate_at: int | None = None
    fail_train_step_at: int | None = None
    generate_count: int = 0
    train_count: int = 0
    injected: list[str] = field(default_factory=list)


class _Proxy:
    """Delegates every attribute it does not define to the wrapped object."""

    def __init__(self, inner: Any, recorder: Recorder, name: str) -> None:
        self._inner = inner
        self._recorder = recorder
        self._name = name

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_inner", "_recorder", "_name", "_loaded"):
            raise AttributeError(name)
        return getattr(object.__getattribute__(self, "_inner"), name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._inner!r})"


class RecordingInferenceEngine(_Proxy):
    """An ``InferenceEngine`` proxy recording every ``generate`` (``GenerateCall``) and, when
    the wrapped engine can load weights, every ``load_weights`` (``LoadCall``). Build it with
    ``RecordingInferenceEngine.wrap``: the class it returns defines ``pause``/``resume``,
    ``sleep``/``wake_up`` and ``load_weights`` only when the wrapped engine has them, so
    ``isinstance(proxy, SupportsPause)`` etc. answer as for the engine itself."""

    _classes: ClassVar[dict[tuple[bool, bool, bool], type[RecordingInferenceEngine]]] = {}

    def __init__(self, inner: InferenceEngine, recorder: Recorder, name: str) -> None:
        super().__init__(inner, recorder, name)
        self._loaded: Version = inner.weight_version

    @classmethod
    def wrap(
        cls, inner: InferenceEngine, recorder: Recorder, name: str
    ) -> RecordingInferenceEngine:
        key = (
            isinstance(inner, SupportsPause),
            isinstance(inner, SupportsSleep),
            isinstance(inner, SupportsLoadWeights),
        )
        proxy_cls = cls._classes.get(key)
        if proxy_cls is None:
            bases: list[type] = [cls]
            names = ["Recording"]
            for has, mixin, label in zip(
                key, (_PauseMixin, _SleepMixin, _LoadMixin), ("Pause", "Sleep", "Load"), strict=True
            ):
                if has:
                    bases.insert(0, mixin)
                    names.append(label)
            proxy_cls = type("".join(names) + "Engine", tuple(bases), {})
            cls._classes[key] = proxy_cls
        return proxy_cls(inner, recorder, name)

    @property
    def inner(self) -> InferenceEngine:
        return self._inner  # type: ignore[no-any-return]

    @property
    def weight_version(self) -> Version:
        return self._inner.weight_version  # type: ignore[no-any-return]

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        rec = self._recorder
        rec.generate_count += 1
        loaded = self._loaded
        if rec.fail_generate_at is not None and rec.generate_count == rec.fail_generate_at:
            rec.injected.append(f"generate call {rec.generate_count} on {self._name}")
            raise InjectedFault(
                f"injected fault: generate call {rec.generate_count} on {self._name} raised"
            )
        try:
            result: GenerationResult = await self._inner.generate(request)
        except BaseException as exc:
            rec.generates.append(
                GenerateCall(self._name, request, loaded, None, type(exc).__name__)
            )
            raise
        rec.generates.append(GenerateCall(self._name, request, loaded, result))
        return result

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self._inner.abort(request_ids)


class _PauseMixin:
    _inner: Any

    async def pause(self, mode: Literal["abort", "keep"] = "abort") -> None:
        await self._inner.pause(mode)

    async def resume(self) -> None:
        await self._inner.resume()


class _SleepMixin:
    _inner: Any

    async def sleep(self, level: int = 1) -> None:
        await self._inner.sleep(level)

    async def wake_up(self) -> None:
        await self._inner.wake_up()


class _LoadMixin:
    _inner: Any
    _recorder: Recorder
    _name: str
    _loaded: Version

    async def load_weights(
        self, weights: Sequence[tuple[str, torch.Tensor]], version: Version
    ) -> None:
        await self._inner.load_weights(weights, version)
        self._loaded = version
        self._recorder.loads.append(LoadCall(self._name, version, self._inner.weight_version))


class RecordingTrainEngine(_Proxy):
    """A ``TrainEngine`` proxy recording every ``train_step`` (``TrainCall``)."""

    @property
    def inner(self) -> TrainEngine:
        return self._inner  # type: ignore[no-any-return]

    @property
    def weight_version(self) -> Version:
        return self._inner.weight_version  # type: ignore[no-any-return]

    async def train_step(self, batch: Batch, loss_fn: LossFn) -> TrainMetrics:
        rec = self._recorder
        rec.train_count += 1
        before = self.weight_version
        if rec.fail_train_step_at is not None and rec.train_count == rec.fail_train_step_at:
            rec.injected.append(f"train_step call {rec.train_count}")
            rec.train_steps.append(
                TrainCall(before, tuple(batch.rows), tuple(batch.tags), None, "InjectedFault")
            )
            raise InjectedFault(f"injected fault: train_step call {rec.train_count} raised")
        try:
            metrics: TrainMetrics = await self._inner.train_step(batch, loss_fn)
        except BaseException as exc:
            rec.train_steps.append(
                TrainCall(before, tuple(batch.rows), tuple(batch.tags), None, type(exc).__name__)
            )
            raise
        rec.train_steps.append(
            TrainCall(before, tuple(batch.rows), tuple(batch.tags), metrics.version)
        )
        return metrics

    async def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        return await self._inner.compute_logprobs(batch)  # type: ignore[no-any-return]

    def export_weights(self, bucket_bytes: int) -> AsyncIterator[WeightBucket]:
        return self._inner.export_weights(bucket_bytes)  # type: ignore[no-any-return]

    async def save_checkpoint(self, path: str) -> None:
        await self._inner.save_checkpoint(path)

    async def load_checkpoint(self, path: str) -> None:
        await self._inner.load_checkpoint(path)


def record_engines(engines: RLEngines, recorder: Recorder) -> RLEngines:
    """``engines`` with every rollout engine and the trainer wrapped in recording proxies; the
    transports ``make_transport`` builds are noted as the backend's own objects."""
    rollout = []
    for i, engine in enumerate(engines.rollout):
        name = f"rollout[{i}]"
        recorder.engine_names.append(name)
        recorder.owned.append(engine)
        rollout.append(RecordingInferenceEngine.wrap(engine, recorder, name))
    recorder.owned.append(engines.trainer)
    if engines.reference is not None:
        recorder.owned.append(engines.reference)
    make_transport = engines.make_transport

    def transport(targets: Sequence[SupportsLoadWeights]) -> WeightSync:
        built = make_transport(targets)
        recorder.owned.append(built)
        return built

    return RLEngines(
        rollout=rollout,
        trainer=RecordingTrainEngine(engines.trainer, recorder, "trainer"),
        reference=engines.reference,
        make_transport=transport,
    )


# --------------------------------------------------------------------------------------------
# Running a job under a real-time guard
# --------------------------------------------------------------------------------------------
@dataclass
class WorkflowRun:
    """One job: its case and config, its result or the error it raised, what the proxies
    recorded, the real seconds it took, and what it left running when ``run`` returned
    (asyncio tasks not owned by the backend's engines, and new non-daemon threads).
    ``timed_out``: the job was still running after the real-time limit and was cancelled."""

    case: WorkflowCase
    config: RLConfig
    recorder: Recorder
    result: RLResult | None = None
    error: BaseException | None = None
    real_s: float = 0.0
    skipped: str | None = None
    """Why the case did not run (an engine refuses its weight sync), or None."""
    timed_out: bool = False
    leftover_tasks: tuple[str, ...] = ()
    leftover_threads: tuple[str, ...] = ()
    reward_calls: int = 0

    def describe(self) -> str:
        return f"case {self.case.id!r} ({_describe_config(self.config)})"

    def require_result(self) -> RLResult:
        """The result; an ``AssertionError`` explaining why there is none otherwise."""
        if self.timed_out:
            raise AssertionError(
                f"{self.describe()}: the job did not finish within the real-time limit "
                f"({self.real_s:.1f} s) and was cancelled: a deadlock or livelock"
            ) from self.error
        if self.error is not None:
            raise AssertionError(
                f"{self.describe()}: RLJob.run raised {type(self.error).__name__}: {self.error}"
            ) from self.error
        assert self.result is not None
        return self.result


def _describe_config(cfg: RLConfig) -> str:
    return (
        f"mode={cfg.mode}, η={cfg.staleness}, weight_sync={cfg.weight_sync}, "
        f"sync_every={cfg.sync_every}, partial_rollout={cfg.partial_rollout}, steps={cfg.steps}, "
        f"batch_size={cfg.batch_size}={cfg.prompts_per_step}×{cfg.n}"
    )


def _owner(task: asyncio.Task[Any]) -> object | None:
    """The object whose method is the task's coroutine (``self`` in its frame), if any."""
    coro = task.get_coro()
    frame = getattr(coro, "cr_frame", None)
    if frame is None:
        return None
    owner: object | None = frame.f_locals.get("self")
    return owner


def _describe_task(task: asyncio.Task[Any]) -> str:
    coro = task.get_coro()
    what = getattr(coro, "__qualname__", None) or repr(coro)
    return f"{task.get_name()} ({what})"


def _run_guarded(
    make_main: Callable[[], Coroutine[Any, Any, None]],
    *,
    virtual_clock: bool,
    real_timeout_s: float,
    deadlock_timeout_s: float,
    before: set[threading.Thread],
    release_timeout_s: float = 60.0,
) -> tuple[BaseException | None, bool, tuple[str, ...]]:
    """Run ``make_main()`` on a fresh event loop in a daemon thread. Returns the error that
    escaped the loop (e.g. ``SimulationDeadlockError``), whether the real-time limit ran out
    (the main task is then cancelled), and the non-daemon threads not in ``before`` (taken
    before the engines were made) still alive after the loop closed, each given up to
    ``release_timeout_s`` real seconds in all to end (a safety net: a thread told to stop
    ends at once). A loop that ignores the cancellation fails the calling test."""
    run = run_on_fresh_loop(
        make_main, name="asyncflow-conformance-job", virtual_clock=virtual_clock,
        real_timeout_s=real_timeout_s, deadlock_timeout_s=deadlock_timeout_s,
    )  # fmt: skip
    if run.stuck:
        pytest.fail(
            f"the job ran past the real-time limit of {real_timeout_s} s and did not stop "
            f"within {CANCEL_GRACE_S:.0f} s of being cancelled (a task ignores cancellation or "
            "a thread blocks forever); its thread is left behind as a daemon"
        )
    new = [
        t
        for t in threading.enumerate()
        if t not in before and t is not run.thread and t.is_alive() and not t.daemon
    ]
    deadline = time.monotonic() + release_timeout_s
    for thread in new:  # an executor shut down with wait=False ends a moment later
        thread.join(max(0.0, deadline - time.monotonic()))
    leftover = tuple(sorted(t.name for t in new if t.is_alive()))
    return run.error, run.timed_out, leftover


# --------------------------------------------------------------------------------------------
# The laws as plain checks
# --------------------------------------------------------------------------------------------
def check_samples_trained_once(run: WorkflowRun) -> None:
    """Law 1: no row reaches ``train_step`` twice; each step trains ``batch_size`` rows made
    of whole groups of ``n`` (no group in two steps); each step adds one version; the job
    called ``train_step`` exactly ``steps`` times (a started step counts, even if cancelled:
    a real trainer may not stop mid-step) and ``RLResult`` records them."""
    cfg, calls, where = run.config, run.recorder.train_steps, run.describe()
    trained_in: dict[int, int] = {}
    group_in: dict[object, int] = {}
    for i, call in enumerate(calls, start=1):
        assert len(call.rows) == cfg.batch_size, (
            f"{where}: step {i} trained {len(call.rows)} rows, not batch_size={cfg.batch_size}"
        )
        assert len(call.tags) == len(call.rows), (
            f"{where}: step {i}: the batch has {len(call.tags)} tags for {len(call.rows)} rows"
        )
        for row in call.rows:
            assert row not in trained_in, (
                f"{where}: row {row} was trained twice, in step {trained_in[row]} and step {i}"
            )
            trained_in[row] = i
        groups = Counter(t.group for t in call.tags)
        assert None not in groups, f"{where}: step {i} trained rows without a group tag"
        partial = {g: c for g, c in groups.items() if c != cfg.n}
        assert not partial, (
            f"{where}: step {i} trained partial groups (group: rows) {partial}; every group "
            f"must be whole, n={cfg.n}"
        )
        for g in groups:
            assert g not in group_in, (
                f"{where}: group {g!r} was trained in step {group_in[g]} and again in step {i}"
            )
            group_in[g] = i
    extra = calls[cfg.steps :]
    assert not extra, (
        f"{where}: train_step was called {len(calls)} times for steps={cfg.steps}: after the "
        f"last step the job started {len(extra)} more (outcome: "
        f"{', '.join(c.outcome for c in extra)}), consuming {sum(len(c.rows) for c in extra)} "
        "rows it never reports"
    )
    result = run.require_result()
    assert len(calls) == cfg.steps, (
        f"{where}: train_step was called {len(calls)} times for steps={cfg.steps}"
    )
    for i, call in enumerate(calls, start=1):
        assert call.version_after == call.version_before + 1, (
            f"{where}: step {i} took the trainer from version {call.version_before} to "
            f"{call.version_after} ({call.outcome}); one optimizer step adds 1"
        )
    assert len(result.steps) == cfg.steps, (
        f"{where}: RLResult records {len(result.steps)} steps for steps={cfg.steps}"
    )


def check_staleness_bounded(run: WorkflowRun) -> None:
    """Law 2: for every trained row, trainer version before the step − the row's oldest token
    version ≤ η, no token is newer than the trainer, and ``RLResult`` reports exactly that
    staleness per step (so ``max_staleness ≤ η``)."""
    cfg, calls, where = run.config, run.recorder.train_steps, run.describe()
    eta = cfg.staleness
    reported: list[int] = []
    for i, call in enumerate(calls, start=1):
        lags = []
        for row, tags in zip(call.rows, call.tags, strict=True):
            assert tags.versions, (
                f"{where}: step {i} trained row {row}, whose tags carry no weight versions "
                f"({tags}); the rollout must tag the versions that produced its tokens"
            )
            lag = call.version_before - min(tags.versions)
            assert lag <= eta, (
                f"{where}: step {i} (trainer at version {call.version_before}) trained row "
                f"{row} with tokens of version {min(tags.versions)}: staleness {lag} > η={eta}"
            )
            assert max(tags.versions) <= call.version_before, (
                f"{where}: step {i} (trainer at version {call.version_before}) trained row "
                f"{row} with tokens of version {max(tags.versions)}, newer than the trainer"
            )
            lags.append(lag)
        reported.append(max(lags, default=0))
    result = run.require_result()
    for i, (step, lag) in enumerate(zip(result.steps, reported, strict=False), start=1):
        assert step.max_staleness == lag, (
            f"{where}: RLResult step {i} reports max_staleness={step.max_staleness}, but the "
            f"batch the trainer got has {lag}"
        )
    assert result.max_staleness <= eta, (
        f"{where}: RLResult.max_staleness={result.max_staleness} > η={eta}"
    )


def check_generations_report_synced_versions(run: WorkflowRun) -> None:
    """Law 3: every result has one token, log-prob and version per token and starts with the
    request's resumed prefix unchanged; the tokens a call generated report versions ``>=``
    the engine's last completed ``load_weights`` when the call started; after
    ``load_weights(v)`` the engine's ``weight_version`` is ``v``; every rollout engine loads
    the synced versions in order (all of them, unless the sync is staged: a staged version may
    be superseded before a safe point applies it, and is applied once a group starts after it,
    which must happen when ``steps > η + 1``)."""
    rec, cfg, where = run.recorder, run.config, run.describe()
    finished = [c for c in rec.generates if c.result is not None]
    for call in finished:
        r, req = call.result, call.request
        assert r is not None
        what = f"{where}: {call.engine} request {req.request_id!r}"
        assert r.request_id == req.request_id, f"{what}: result names request {r.request_id!r}"
        assert len(r.versions) == len(r.tokens) == len(r.logprobs), (
            f"{what}: {len(r.tokens)} tokens, {len(r.logprobs)} log-probs and "
            f"{len(r.versions)} versions; the result needs one of each per token"
        )
        k = check_resumed_prefix(req, r, what)
        stale = sorted({v for v in r.versions[k:] if v < call.loaded_version})
        assert not stale, (
            f"{what}: started after load_weights(version={call.loaded_version}) completed, "
            f"yet its new tokens reported version(s) {stale}"
        )
    for load in rec.loads:
        assert load.reported == load.version, (
            f"{where}: after {load.engine}.load_weights(version={load.version}) its "
            f"weight_version is {load.reported}"
        )
    run.require_result()
    assert finished, f"{where}: no generate call returned a result"
    synced = [v for v in range(1, cfg.steps) if v % cfg.sync_every == 0]
    for name in rec.engine_names:
        loaded = [load.version for load in rec.loads if load.engine == name]
        if cfg.weight_sync == "staged":
            assert loaded == sorted(set(loaded)) and set(loaded) <= set(synced), (
                f"{where}: {name} loaded versions {loaded}; the job synced {synced} (a staged "
                "sync may skip a superseded version, never repeat or reorder one)"
            )
            # more steps than the staleness bound lets run ahead: some group is admitted
            # only after a sync raised the bound, and its safe point applies the staged set
            assert loaded or not synced or cfg.steps <= cfg.staleness + 1, (
                f"{where}: {name} never loaded any of the synced versions {synced}, although "
                f"steps={cfg.steps} > η + 1 means a group started after a sync"
            )
        else:
            assert loaded == synced, (
                f"{where}: {name} loaded versions {loaded} through load_weights; the job "
                f"synced {synced}"
            )


def check_sample_count(run: WorkflowRun) -> None:
    """Law 5: ``RLResult.samples == steps × batch_size``."""
    result = run.require_result()
    cfg = run.config
    assert result.samples == cfg.steps * cfg.batch_size, (
        f"{run.describe()}: RLResult.samples={result.samples}, expected steps × batch_size = "
        f"{cfg.steps} × {cfg.batch_size} = {cfg.steps * cfg.batch_size}"
    )


def check_nothing_left_running(run: WorkflowRun) -> None:
    """When ``RLJob.run`` has returned or raised, no asyncio task of the job is pending (the
    backend's own background tasks, e.g. an engine's driver, do not count) and no thread it
    started is alive once its event loop closed."""
    where = run.describe()
    assert not run.timed_out, f"{where}: the job hung and was cancelled after {run.real_s:.1f} s"
    assert not run.leftover_tasks, (
        f"{where}: after RLJob.run ended these asyncio tasks of the job were still pending: "
        f"{list(run.leftover_tasks)}"
    )
    assert not run.leftover_threads, (
        f"{where}: after the job's event loop closed these threads it started were still "
        f"alive: {list(run.leftover_threads)}"
    )


def check_failure_stops_the_job(run: WorkflowRun, task: Fault) -> None:
    """Law 4: the injected fault made ``RLJob.run`` raise ``TaskFailedError`` with
    ``.task == task`` and the fault as its cause, within the real-time limit (no deadlock).
    ``check_nothing_left_running`` is its second half."""
    where = f"{run.describe()}, fault in {task!r}"
    assert not run.timed_out, (
        f"{where}: the job did not stop within {run.real_s:.1f} s of real time after the "
        "fault (a deadlock) and was cancelled"
    )
    assert run.recorder.injected, (
        f"{where}: the job ended before the fault could be injected ({run.error!r}); make the "
        "job longer (steps)"
    )
    err = run.error
    assert err is not None, (
        f"{where}: RLJob.run returned normally although the fault was injected "
        f"({run.recorder.injected[0]})"
    )
    assert isinstance(err, TaskFailedError), (
        f"{where}: RLJob.run raised {type(err).__name__}: {err}, not TaskFailedError"
    )
    assert err.task == task, (
        f"{where}: TaskFailedError names task {err.task!r}, expected {task!r} ({err})"
    )
    chain: list[BaseException] = []
    cause: BaseException | None = err
    while cause is not None and len(chain) < 20:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    assert any(isinstance(c, InjectedFault) for c in chain), (
        f"{where}: the injected fault is not in the TaskFailedError's cause chain: "
        f"{[type(c).__name__ for c in chain]}"
    )


# --------------------------------------------------------------------------------------------
# The class to subclass
# --------------------------------------------------------------------------------------------
class WorkflowConformance:
    """The workflow laws on a backend's engines; subclass it (as ``Test...``) and implement
    ``make_engines``. Class attributes size the jobs; ``cases`` lists the configurations."""

    pytestmark: ClassVar[list[pytest.MarkDecorator]] = [pytest.mark.conformance]

    virtual_clock: ClassVar[bool] = True
    """Run each job on a ``VirtualClockLoop`` (engines that sleep on the loop's clock take no
    real time); False: a plain ``asyncio`` loop, real time."""
    steps: ClassVar[int] = 6
    verify_sync: ClassVar[str] = "off"
    """The jobs' ``RLConfig.verify_sync``: off here, since sync verification has a law of its
    own (``EnginePairConformance.test_a_sync_is_verified_against_the_engines_own_weights``)
    and its probe requests would count among the generate calls these laws inject faults
    into; set ``"first"`` to run the laws' jobs with it."""
    prompts_per_step: ClassVar[int] = 2
    n: ClassVar[int] = 4
    max_tokens: ClassVar[int] = 32
    cases: ClassVar[Sequence[WorkflowCase]] = DEFAULT_CASES
    real_timeout_s: ClassVar[float] = 600.0
    """Real seconds one job may take before it is cancelled and its test fails: a safety net
    against hangs, far above a correct job on a busy machine (60 s failed one once)."""
    deadlock_timeout_s: ClassVar[float] = 10.0
    """Virtual clock: real seconds with nothing scheduled before the loop reports a deadlock."""
    reward_fault_at: ClassVar[int | None] = None
    """The reward call (per row, 1-based) that raises in the failure law; default: the first
    row of the second step."""
    generate_fault_at: ClassVar[int | None] = None
    """The ``generate`` call (over all rollout engines, 1-based) that raises; default: the
    first call of the second step."""
    train_fault_at: ClassVar[int] = 2
    """The ``train_step`` call (1-based) that raises."""

    # -- hooks for the backend author --------------------------------------------------------
    def make_engines(self) -> RLEngines:
        """Fresh engines for one job: rollout instances, trainer, optional ``make_transport``."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement make_engines(self) -> RLEngines, returning "
            "fresh rollout engines and a trainer on every call"
        )

    def prompts(self) -> Iterable[Sequence[int]]:
        """The prompt token sequences of a job (default: short, distinct, endless)."""
        return ((1 + i % 97, 2 + i % 5, 3, 4) for i in itertools.count())

    def reward(self, prompt: Sequence[int], response: Sequence[int]) -> float:
        """The reward function of a job (default: a cheap deterministic function)."""
        return float(sum(response) % 7) / 7.0 + 0.01 * len(response)

    async def close_engine(self, engine: Any) -> None:
        """Release an engine after its job, on the job's loop (default: its ``close()``, if it
        has one); called for every rollout engine, the trainer and the reference."""
        close = getattr(engine, "close", None)
        if callable(close):
            result = close()
            if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                await result

    # -- pytest plumbing ---------------------------------------------------------------------
    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "case" in metafunc.fixturenames:
            cases = list(self.cases)
            metafunc.parametrize("case", cases, ids=[c.id for c in cases], scope="class")
        if "fault" in metafunc.fixturenames:
            metafunc.parametrize("fault", FAULTS, scope="class")

    @pytest.fixture(scope="class")
    @classmethod
    def workflow_run(cls, case: WorkflowCase) -> WorkflowRun:
        """One job per case, shared by the laws that only observe it."""
        return cls().run_case(case)

    @pytest.fixture(scope="class")
    @classmethod
    def failed_run(cls, case: WorkflowCase, fault: Fault) -> WorkflowRun:
        """One job per (case, fault) with that task made to raise."""
        return cls().run_case(case, fault=fault)

    # -- running -----------------------------------------------------------------------------
    def config_for(self, case: WorkflowCase) -> RLConfig:
        return case.config(
            steps=self.steps,
            prompts_per_step=self.prompts_per_step,
            n=self.n,
            max_tokens=self.max_tokens,
            verify_sync=self.verify_sync,
        )

    def run_case(self, case: WorkflowCase, *, fault: Fault | None = None) -> WorkflowRun:
        """Run one job of ``case`` on fresh, recorded engines, optionally with a fault in the
        named task, and return what happened (never raises for the job's own errors)."""
        config = self.config_for(case)
        batch = config.batch_size
        recorder = Recorder()
        if fault == "rollout":
            recorder.fail_generate_at = self.generate_fault_at or batch + 1
        elif fault == "actor_update":
            recorder.fail_train_step_at = self.train_fault_at
        reward_fault = (self.reward_fault_at or batch + 1) if fault == "reward" else None
        run = WorkflowRun(case, config, recorder)
        threads = set(threading.enumerate())  # before the engines: their threads count too
        made = self.make_engines()
        engines = record_engines(made, recorder)
        lock = threading.Lock()

        def reward_fn(prompt: Sequence[int], response: Sequence[int]) -> float:
            with lock:
                run.reward_calls += 1
                number = run.reward_calls
            if reward_fault is not None and number == reward_fault:
                recorder.injected.append(f"reward call {number}")
                raise InjectedFault(f"injected fault: reward call {number} raised")
            return self.reward(prompt, response)

        owned_ids = {id(o) for o in recorder.owned}

        refusals = [
            f"{type(e).__name__}: {reason}"
            for e in made.rollout
            if config.weight_sync == "inflight" and (reason := inflight_load_refusal(e))
        ]
        if refusals:  # the job refuses this case for these engines (an optional ability)
            run.skipped = (
                f"case {case.id!r}: the engine cannot load weights while it generates, so "
                f"RLJob refuses weight_sync='inflight' ({'; '.join(refusals)})"
            )

        async def main() -> None:
            if run.skipped is None:
                await run_job()
            for engine in (*made.rollout, made.trainer, made.reference):
                if engine is not None:
                    await self.close_engine(engine)

        async def run_job() -> None:
            job = RLJob(config, engines, self.prompts(), reward_fn)
            try:
                run.result = await job.run()
            except asyncio.CancelledError as exc:
                run.error = exc
                raise
            except Exception as exc:
                run.error = exc
            for _ in range(3):  # let cancellations that need no time complete
                await asyncio.sleep(0)
            owned_ids.update(id(o) for o in recorder.owned)  # transports built meanwhile
            me = asyncio.current_task()
            run.leftover_tasks = tuple(
                sorted(
                    _describe_task(t)
                    for t in asyncio.all_tasks()
                    if t is not me and not t.done() and id(_owner(t)) not in owned_ids
                )
            )

        t0 = time.perf_counter()
        error, timed_out, leftover = _run_guarded(
            main,
            virtual_clock=self.virtual_clock,
            real_timeout_s=self.real_timeout_s,
            deadlock_timeout_s=self.deadlock_timeout_s,
            before=threads,
        )
        run.real_s = time.perf_counter() - t0
        run.timed_out = timed_out
        run.leftover_threads = leftover
        if error is not None and (
            run.error is None or isinstance(run.error, asyncio.CancelledError)
        ):  # e.g. SimulationDeadlockError escaped the loop, which then cancelled the job
            run.error = error
        if run.skipped is not None and error is None:
            pytest.skip(run.skipped)
        return run

    # -- laws on one job per case ------------------------------------------------------------
    def test_each_sample_reaches_the_update_once(self, workflow_run: WorkflowRun) -> None:
        check_samples_trained_once(workflow_run)

    def test_staleness_never_exceeds_eta(self, workflow_run: WorkflowRun) -> None:
        check_staleness_bounded(workflow_run)

    def test_generations_report_synced_versions(self, workflow_run: WorkflowRun) -> None:
        check_generations_report_synced_versions(workflow_run)

    def test_samples_equal_steps_times_batch_size(self, workflow_run: WorkflowRun) -> None:
        check_sample_count(workflow_run)

    def test_a_finished_job_leaves_nothing_running(self, workflow_run: WorkflowRun) -> None:
        workflow_run.require_result()
        check_nothing_left_running(workflow_run)

    # -- the failure law: one job per (case, fault) ------------------------------------------
    def test_a_raising_task_stops_the_job(self, failed_run: WorkflowRun, fault: Fault) -> None:
        check_failure_stops_the_job(failed_run, fault)

    def test_a_failed_job_leaves_nothing_running(
        self, failed_run: WorkflowRun, fault: Fault
    ) -> None:
        check_nothing_left_running(failed_run)
