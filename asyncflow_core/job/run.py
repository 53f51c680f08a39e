"""The main job's run: build the workload's policy, place its engines on the runtime, train
with RL, evaluate, write the run folder and checkpoints, resume (``run``).

A run folder holds:

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

**Engines and runtimes.** The workload (``asyncflow_core.engines.registry``) gives the model;
the rollout and train engine factories the config names build the engines; the runtime places
them: ``local`` (this module, ``local_runtime``: engines in this process, or child processes
with ``rollout.process`` / ``train.process``) or a runtime package's (kind ``runtime``, e.g.
``ray`` from ``asyncflow_ray.job``), each an async context manager yielding a ``Placed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import hashlib
import inspect
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from asyncflow_core.contracts.errors import CheckpointError, ConfigError
from asyncflow_core.contracts.protocols import DataStore, InferenceEngine, TrainEngine
from asyncflow_core.engines import registry
from asyncflow_core.engines.process import ProcessInferenceEngine
from asyncflow_core.flow.config import keys, to_toml
from asyncflow_core.flow.rlflow import JobState, MakeStaged, RLEngines, RLJob, RLResult, StepRecord
from asyncflow_core.flow.workflow import PipelineResult
from asyncflow_core.infra.checkpoint import Checkpoints, DiskFullError, FolderError
from asyncflow_core.infra.manifest import checkpoint_key
from asyncflow_core.job.config import RESUME_KEYS, RunConfig, load_run_config
from asyncflow_core.job.report import RunSummary, plot_rewards
from asyncflow_core.observability import trace as tracing
from asyncflow_core.observability.trace import Tracer


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
CONFIG_FILE = "config.toml"
TRACE_FILE = "trace.json.gz"  # checkpoints before trace segments: the whole trace in one file
_SEGMENT = re.compile(r"trace-\d{4}\.json\.gz")


class _RunFiles:
    """The main job's files in each checkpoint: the trace so far, where its clock was, the
    RNG states and the warm-up time (``run.json``).

    The trace is kept in segments, ``trace-NNNN.json.gz``: each checkpoint writes only the
    spans recorded since the previous one and copies the earlier segments' files from the
    previous checkpoint, so a checkpoint costs what happened since the last one, not the
    whole run so far (the whole trace, rewritten every ``checkpoint.every`` steps, was a
    fifth of a 120-step run's wall time). Copies, not hard links: a segment damaged in one
    checkpoint leaves the older checkpoints' whole, for resume to fall back to. Every
    checkpoint still holds its whole trace: deleting older ones loses nothing.

    ``config``: the run's ``config.toml`` text, also kept in each checkpoint (signed with it
    in its manifest): what the checkpoint was trained with, which ``--resume`` compares the
    run folder's config with."""

    def __init__(
        self,
        checkpoints: Path,
        *,
        tracer: Tracer,
        warmup_s: float,
        resumed_at: list[int],
        segments: Sequence[str] = (),
        config: str | None = None,
    ) -> None:
        self.checkpoints, self.tracer = checkpoints, tracer
        self.warmup_s, self.resumed_at = warmup_s, resumed_at
        self.config = config
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
        if self.config is not None:
            (folder / CONFIG_FILE).write_text(self.config)
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


@dataclass(frozen=True)
class ResumePoint:
    """Where ``--resume`` continues: the newest intact checkpoint ``folder`` of the run, its
    job state and run state, and ``skipped``: every newer checkpoint that failed its checks
    (a file changed or missing, a manifest not signed with this user's key, a job state that
    contradicts itself), newest first, with why."""

    folder: Path
    state: JobState
    run_state: dict[str, Any]
    skipped: tuple[tuple[Path, str], ...] = ()


def _plain(value: Any) -> Any:
    """A config value as JSON values (tuples as lists; anything else by its repr)."""
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return repr(value)


def run_identity(cfg: RunConfig) -> dict[str, Any]:
    """What a checkpoint's manifest records of the run that wrote it: the workload, the seed
    and ``config_sha256``, a hash of every config key a resumed run may not change (all but
    ``RESUME_KEYS``)."""
    fixed = {k: _plain(config_value(cfg, k)) for k in keys(cfg) if k not in RESUME_KEYS}
    text = json.dumps(fixed, sort_keys=True, separators=(",", ":"))
    return {
        "workload": cfg.workload_name(),
        "seed": cfg.seed,
        "config_sha256": hashlib.sha256(text.encode()).hexdigest(),
    }


def config_value(cfg: RunConfig, key: str) -> Any:
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def changed_keys(cfg: RunConfig, saved: RunConfig) -> list[str]:
    """The keys outside ``RESUME_KEYS`` whose value differs between ``cfg`` and ``saved``
    (a key only one of them has counts), each as ``key (saved -> now)``."""
    mine, theirs = set(keys(cfg)), set(keys(saved))
    out = []
    for key in sorted(mine | theirs):
        if key in RESUME_KEYS:
            continue
        now = config_value(cfg, key) if key in mine else "(no such key)"
        was = config_value(saved, key) if key in theirs else "(no such key)"
        if now != was:
            out.append(f"{key} ({was!r} -> {now!r})")
    return out


def _checkpoint_config(folder: Path) -> RunConfig:
    """The config a checkpoint was trained with (its own ``config.toml``)."""
    try:
        return load_run_config(folder / CONFIG_FILE)
    except ConfigError as e:
        raise CheckpointError(f"{str(folder)!r}: its {CONFIG_FILE} is not usable: {e}") from e


def _read_checkpoint(
    folder: Path, meta: Mapping[str, Any]
) -> tuple[JobState, dict[str, Any], RunConfig]:
    """A verified checkpoint's job state, run state and config, after checking that they agree
    with each other: its job state reads and is consistent, its run state and trace segments
    are there, and the workload and seed its manifest signs are its ``config.toml``'s. (Not
    ``config_sha256``: a later AsyncFlow with one more config key hashes the same config
    otherwise; the signed ``config.toml`` is compared key by key instead, ``changed_keys``.)"""
    state = JobState.read(folder)
    run_state = _run_state(folder)
    _trace_segments(run_state)
    config = _checkpoint_config(folder)
    identity = meta.get("identity")
    own = run_identity(config)
    fixed = ("workload", "seed")
    signed = {k: identity.get(k) for k in fixed} if isinstance(identity, dict) else {}
    if signed != {k: own[k] for k in fixed}:
        raise CheckpointError(
            f"{str(folder)!r}: the run identity its manifest signs ({identity!r:.200}) is not "
            f"that of its {CONFIG_FILE}"
        )
    return state, run_state, config


def resume_point(cfg: RunConfig, out: Path, *, trust: bool = False) -> ResumePoint:
    """The newest intact checkpoint of run folder ``out`` (``Checkpoints.intact``: files as
    its signed manifest lists them, a consistent job state), its job state and run state,
    and the newer ones that failed. ``CheckpointError`` when none is intact (naming each and
    why); ``ConfigError`` when there is none at all, nothing is left to train, or ``cfg``
    changes a key outside ``RESUME_KEYS`` from the checkpoint's own config (naming each).
    ``trust``: skip the signature check (a run folder from another machine or user)."""
    checkpoints = Checkpoints(out / "checkpoints", trust=trust)
    if not checkpoints.list():
        raise ConfigError(
            f"--resume {out}: {out / 'checkpoints'} holds no complete checkpoint (the run died "
            f"before its first one, every {cfg.checkpoint.every} steps); start it again"
        )
    read: dict[Path, tuple[JobState, dict[str, Any], RunConfig]] = {}

    def check(folder: Path, meta: dict[str, Any]) -> None:
        read[folder] = _read_checkpoint(folder, meta)

    folder, skipped = checkpoints.intact(check)
    if folder is None:
        why = "\n".join(f"  {f.name}: {reason}" for f, reason in skipped)
        raise CheckpointError(
            f"--resume {out}: no checkpoint there is intact, so there is nothing to resume "
            f"from:\n{why}\nstart the run again in a new folder (or, for a run folder copied "
            "from another machine or user that you trust, add --trust-checkpoints)"
        )
    state, run_state, saved = read[folder]
    changed = changed_keys(cfg, saved)
    if changed:
        raise ConfigError(
            f"--resume {out}: changed since checkpoint {folder.name} was written, and not "
            f"changeable on resume (the checkpoint was trained with its values): "
            f"{'; '.join(changed)}. Set them back in {out / CONFIG_FILE} (or drop the --set); "
            f"these may change: {', '.join(RESUME_KEYS)}; to train with the new values start "
            "a new run (--out NEW_FOLDER)"
        )
    done = state.version - state.origin
    if cfg.rl.steps < done or (cfg.rl.steps == done and (out / "summary.json").exists()):
        raise ConfigError(
            f"--resume {out}: the run already trained {done} steps of rl.steps = "
            f"{cfg.rl.steps}; to train longer, resume with --set rl.steps=N (N > {done})"
        )
    return ResumePoint(folder, state, run_state, tuple(skipped))


RUN_MARKERS = ("config.toml", "metrics.jsonl", "summary.json", "checkpoints")
"""What makes a folder a run folder: a fresh run does not start in one."""


def refuse_other_run(out: Path) -> None:
    """``ConfigError`` when ``out`` already holds a run (``RUN_MARKERS``), naming the two
    ways on: continue it, or a new folder. A fresh run there would mix its files with the
    other's, and the other's checkpoints (higher steps) would crowd its own out."""
    found = [m for m in RUN_MARKERS if (out / m).exists()]
    if found:
        raise ConfigError(
            f"--out {out} holds another run ({', '.join(found)}); a new run does not write "
            f"over it: continue that run with asyncflow run --resume {out}, or give a new "
            "folder with --out"
        )


_PROBE_BYTES = 1 << 20


def check_run_folder(out: Path) -> None:
    """Before any start-up work: ``out`` can be made and written and its disk holds at least
    1 MiB more (a probe file written, flushed and removed in ``out``, or in the nearest
    folder above it that exists: nothing is left behind, so a run that fails before its
    first step still writes nothing). ``FolderError`` (``DiskFullError`` for a full disk)
    naming the folder and what to do."""
    where = out.absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    probe = where / f".asyncflow-write-check-{os.getpid()}"
    try:
        if not where.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"{where} is a file, not a folder")
        with open(probe, "wb") as f:
            f.write(b"\0" * _PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        with contextlib.suppress(OSError):
            probe.unlink()
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(
                f"the run folder {str(out)!r} cannot be written: its disk is full "
                f"({e.strerror}); free space there or give --out a folder on another disk"
            ) from e
        raise FolderError(
            e.errno or errno.EIO,
            f"the run folder {str(out)!r} cannot be written ({e.strerror or e}); give --out "
            "a folder you can write (a read-only mount or another user's folder will not do)",
        ) from e
    probe.unlink()


def _window_mean(values: Sequence[float], first: bool) -> float:
    k = max(1, math.ceil(len(values) / 10))
    part = values[:k] if first else values[-k:]
    return sum(part) / len(part) if part else math.nan


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
    resume: bool | ResumePoint = False,
    preemptible: bool = False,
    trust_checkpoints: bool = False,
) -> RunOutput:
    """Build the workload's policy (and warm it up), train with RL, evaluate, let the
    workload finish (an HF policy is saved with ``save_pretrained``) and, with ``out_dir``,
    write the run folder, checkpoints included (``cfg.checkpoint``). ``resume``: continue
    the run in ``out_dir`` from its newest checkpoint (``cfg`` is its config, with only
    ``RESUME_KEYS`` changed; a run that died after its last step but before its summary is
    evaluated and summarised without training; a ``ResumePoint`` the caller got from
    ``resume_point`` is used as it is, not looked for again). ``preemptible``: on SIGTERM, write a
    checkpoint and raise ``RunPreempted`` (installs a handler on the running loop; the main
    thread only). A fresh run refuses an ``out_dir`` that holds another run
    (``refuse_other_run``); a resumed one continues from the newest intact checkpoint, moving
    newer damaged ones aside with a message (``resume_point``; ``trust_checkpoints``: accept
    ones not signed with this user's key). Either way ``out_dir`` must be writable, checked
    before any start-up work (``check_run_folder``)."""
    cfg = cfg.for_workload()
    cfg.validate()
    out = Path(out_dir) if out_dir is not None else None
    point = None
    if resume:
        if out is None:
            raise ConfigError("run(resume=True) needs out_dir, the run folder to resume")
        point = (
            resume
            if isinstance(resume, ResumePoint)
            else resume_point(cfg, out, trust=trust_checkpoints)
        )
    elif out is not None:
        refuse_other_run(out)
    if out is not None:
        check_run_folder(out)
        checkpoint_key(who="asyncflow run", create=True)  # signs checkpoints: a refusal now
    if point is not None and out is not None:
        for bad, why in point.skipped:  # kept aside: rotation must not keep them over good ones
            aside = Checkpoints(out / "checkpoints").set_aside(bad)
            print(
                f"asyncflow run: checkpoint {bad} is damaged and was moved to {aside} (delete "
                f"it when you no longer need it): {why}\nasyncflow run: resuming from "
                f"{point.folder}",
                file=sys.stderr,
            )
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
            warmup_s = float(point.run_state.get("warmup_s", 0.0))
        else:
            model = await workload.initial_model()
            warmup_s = time.perf_counter() - t0
        platform = cfg.trainer_platform().name  # validated above; resolved once per run
        r = cfg.rollout
        sampling = workload.sampling(r.temperature, r.top_p, r.top_k)
        rl_config = cfg.rl_config(sampling)
        resumed_at: list[int] = []
        left = cfg.rl.steps
        if point is not None:
            state, run_state = point.state, point.run_state
            left = cfg.rl.steps - (state.version - state.origin)
            rl_config = replace(rl_config, steps=max(left, 1))  # 0 left: no run() below
            resumed_at = [*run_state.get("resumed_at", []), state.version]
        async with _placed(cfg, model, threads, platform) as placed:
            engines, trainer, store = placed.engines, placed.trainer, placed.store
            tracer = _load_trace(point.folder, point.run_state) if point is not None else Tracer()
            checkpoints = None
            if out is not None:
                checkpoints = Checkpoints(
                    out / "checkpoints", keep=cfg.checkpoint.keep,
                    extra=_RunFiles(
                        out / "checkpoints", tracer=tracer, warmup_s=warmup_s,
                        resumed_at=resumed_at,
                        segments=(
                            (_trace_segments(point.run_state) or []) if point is not None else ()
                        ),
                        config=to_toml(cfg),
                    ),
                    identity=run_identity(cfg), trust=trust_checkpoints,
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
                rl_config, RLEngines(engines, trainer, make_staged=placed.make_staged),
                workload.prompts(cfg.seed),
                None if callable(agent_loop) else workload.reward,
                agent=agent_loop() if callable(agent_loop) else None, loss_fn=cfg.loss_fn(),
                tracer=tracer, on_step=step_hook, store=store, checkpoints=checkpoints,
            )  # fmt: skip
            if point is not None:
                await job.resume(point.folder)
                _restore_rng(point.run_state["rng"])
                tracer.continue_at(float(point.run_state["trace_s"]))
            eval_before: tuple[float, float] | None = None
            if cfg.eval_prompts and point is None and not hasattr(workload, "evaluations"):
                # where RL starts from (the engines hold the trainer's first weights), greedy;
                # a workload that evaluates itself (agents) keeps its own
                eval_before = await workload.evaluate(
                    engines[0], cfg.eval_prompts, 10_000_019 + cfg.seed
                )
            if left:
                with _on_sigterm(job, preempted, enabled=preemptible):
                    result = await job.run()
            else:  # trained to the end before it died: evaluate and summarise
                await job.sync_rollout()
                result = RLResult(rl_config, (), 0.0, 0, 0, PipelineResult({}, 0.0), tracer)
            lost = dict(job.lost)
            restarted = dict(job.restarted)
            verified = [
                {"engine": r.engine, "version": r.version, "kind": r.kind, "checked": r.checked,
                 "seconds": round(r.seconds, 4), **({"reason": r.reason} if r.reason else {})}
                for r in job.verified
            ]  # fmt: skip
            if point is not None:  # the whole run's records and totals
                state = point.state
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
    if eval_before is not None and not any(math.isnan(v) for v in eval_before):
        extra["eval_before"] = {"reward": eval_before[0], "exact": eval_before[1]}
    if resumed_at:
        extra["resumed_at"] = resumed_at
    if lost:
        extra["lost_engines"] = lost
    if restarted:
        extra["restarted_engines"] = restarted
    if verified:  # RLConfig.verify_sync: which syncs were proven, and how
        extra["sync_verified"] = verified
    if placed.placement:
        extra["placement"] = placed.placement
    summary = replace(summary, runtime=placed.where, extra=extra)
    if placed.trainer_label is not None:
        summary = replace(summary, trainer=placed.trainer_label)
    if out is not None:
        _write_run_folder(out, cfg, summary, tracer, result)
    return RunOutput(summary, result, out)


@dataclass
class Placed:
    """What a runtime gives the job: the rollout engines, the trainer, the store (None: the
    default in-process store), where it runs (``local``, ``ray (2 nodes, ...)``), a staged
    weight-sync factory of its own (None: the job's default), each actor's node by name and
    how to name the trainer's place in the summary (None: the job's own label)."""

    engines: list[InferenceEngine]
    trainer: TrainEngine
    store: DataStore | None = None
    where: str = "local"
    make_staged: MakeStaged | None = None
    placement: dict[str, str] = field(default_factory=dict)
    trainer_label: str | None = None


Runtime = Callable[..., contextlib.AbstractAsyncContextManager[Placed]]
"""A runtime factory (registry kind ``runtime``): ``runtime(cfg, *, rollout, trainer,
platform)`` with ``rollout`` one zero-argument factory per rollout engine and ``trainer`` the
trainer's (each builds its engine where it is called, e.g. inside an actor), returning an
async context manager that yields a ``Placed`` and closes what it made on the way out."""


@contextlib.asynccontextmanager
async def local_runtime(
    cfg: RunConfig,
    *,
    rollout: Sequence[Callable[[], InferenceEngine | Awaitable[InferenceEngine]]],
    trainer: Callable[[], TrainEngine],
    platform: str,
) -> AsyncIterator[Placed]:
    """The ``local`` runtime: the trainer built in this process (a trainer factory may host
    it in a child process: ``train.process``), each rollout engine in this process or, with
    ``rollout.process``, in a child process of its own; the default in-process store. A
    rollout factory may return an awaitable (an engine that must connect or start first)."""
    made_trainer = trainer()
    engines: list[InferenceEngine] = []
    try:  # an engine that cannot be built closes the ones built before it
        for i, make in enumerate(rollout):
            if cfg.rollout.process:
                engines.append(
                    ProcessInferenceEngine(make, threads=_threads(cfg), name=f"rollout-{i}")
                )
            else:
                made = make()  # an engine, or an awaitable of one (e.g. a server's client)
                engines.append(await made if inspect.isawaitable(made) else made)
        yield Placed(engines, made_trainer)
    finally:
        for e in engines:
            await e.close()  # type: ignore[attr-defined]  # every engine here has one
        await made_trainer.close()  # type: ignore[attr-defined]  # every trainer here has one


def _placed(
    cfg: RunConfig, model: Any, threads: int, platform: str
) -> contextlib.AbstractAsyncContextManager[Placed]:
    """The run's engines on its runtime (``runtime.kind``), built by the engine factories the
    config names from ``model``."""
    rollout_name, train_name = cfg.engine_names()
    make_rollout = registry.get("rollout", rollout_name)
    make_trainer = registry.get("trainer", train_name)
    if cfg.rollout.urls() and not getattr(make_rollout, "connects_to_servers", False):
        raise ConfigError(
            f"rollout.url names servers, but rollout.engine = {rollout_name!r} runs its "
            "engines here and connects to none: set rollout.engine = 'vllm' (a factory that "
            "connects sets connects_to_servers = True), or leave rollout.url empty"
        )
    rollout = [
        functools.partial(make_rollout, model, cfg=cfg, index=i, threads=threads)
        for i in range(cfg.rollout.engines)
    ]
    trainer = functools.partial(make_trainer, model, cfg=cfg, threads=threads, platform=platform)
    runtime: Runtime = (
        local_runtime if cfg.runtime.kind == "local" else registry.get("runtime", cfg.runtime.kind)
    )
    return runtime(cfg, rollout=rollout, trainer=trainer, platform=platform)


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


def _trainer_label(cfg: RunConfig) -> str:
    t = cfg.train
    engine = cfg.engine_names()[1]
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
