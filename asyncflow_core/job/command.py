"""``asyncflow run``: read the config (``load_run_config``), print what runs, show progress,
run (``asyncflow_core.job.run.run``), print the summary; ``--resume`` continues a run folder
and SIGTERM writes a checkpoint first.

Exit status (every failure ends in one message naming the file or setting and what to do;
the README's failure table lists them, each row a test in ``tests/test_failure_table.py``):

- ``0`` done, or stopped on SIGTERM with a checkpoint;
- ``1`` the run stopped on a failure of the run itself (a lost trainer, a reward failing on
  every row, an engine error): the message names the newest checkpoint to resume from;
- ``2`` bad input: a config, a run folder or checkpoint that cannot be used as given;
- ``3`` the environment: a folder that cannot be written (read-only, not permitted, a full
  disk), an engine build left half done, an extra that is not installed;
- ``4`` a bug: anything else, with its traceback and a request to report it."""

from __future__ import annotations

import asyncio
import errno
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncflow_core.contracts.errors import (
    AsyncFlowError,
    CheckpointError,
    ConfigError,
    EnvironmentFault,
    MissingExtraError,
    TaskFailedError,
    error_chain,
)
from asyncflow_core.flow.config import keys, load_config
from asyncflow_core.infra.checkpoint import Checkpoints, FolderError
from asyncflow_core.job.config import RESUME_KEYS, RETIRED, RunConfig, load_run_config
from asyncflow_core.job.report import StepProgress, format_summary
from asyncflow_core.job.run import (
    RunPreempted,
    changed_keys,
    config_value,
    resume_point,
    run,
)

EXIT_OK, EXIT_FAILED, EXIT_INPUT, EXIT_ENVIRONMENT, EXIT_BUG = 0, 1, 2, 3, 4


def _resume_config(run_dir: Path, sets: Sequence[str]) -> RunConfig:
    """The config of the run in ``run_dir`` with ``sets`` applied, refusing a ``--set`` of a
    key outside ``RESUME_KEYS`` (the checkpoint's own config is compared with it later:
    ``resume_point``)."""
    saved = run_dir / "config.toml"
    if not saved.is_file():
        raise ConfigError(
            f"--resume {run_dir}: no config.toml there; give the folder an asyncflow run wrote "
            "(its --out, e.g. runs/<timestamp>)"
        )
    base = load_run_config(saved)
    cfg = load_config(type(base), saved, sets, retired=RETIRED)  # the run's workload's class
    refused = changed_keys(cfg, base)
    if refused:
        raise ConfigError(
            f"--resume: {'; '.join(refused)} cannot change on resume (the checkpoint was "
            f"trained with the run's value); these may: {', '.join(RESUME_KEYS)}"
        )
    return cfg


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc``'s explicit causes (``raise ... from``), nearest first."""
    out: list[BaseException] = []
    seen = exc.__cause__
    while seen is not None and len(out) < 8:
        out.append(seen)
        seen = seen.__cause__
    return out


def _explain(exc: BaseException) -> str:
    """``exc``'s message with its causes' (the cause often says what to do: an engine that
    could not be built says why)."""
    text = str(exc)
    for cause in _causes(exc):
        said = str(cause)
        if said and said not in text:
            text += f"\n  because {type(cause).__name__}: {said}"
    return text


def _environment(exc: BaseException) -> OSError | AsyncFlowError | None:
    """The error in ``exc``'s chain that a run cannot get past by itself (a folder it cannot
    write, a full disk, no permission, an ``EnvironmentFault`` such as a stale build lock, a
    library that is not installed), if any: the environment's fault."""
    for seen in error_chain(exc):
        if isinstance(seen, FolderError | EnvironmentFault | MissingExtraError):
            return seen
        if isinstance(seen, OSError) and seen.errno in _ENVIRONMENT_ERRNOS:
            return seen
    return None


_ENVIRONMENT_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}
)


def _say_environment(error: OSError | AsyncFlowError, out: Path) -> int:
    if not isinstance(error, OSError) or isinstance(error, FolderError):
        what = str(error)
    else:
        where = f"{error.filename}" if error.filename else str(out)
        what = f"cannot write {where}: {error.strerror or error}"
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            what += "; the disk is full: free space there (or use a folder on another disk)"
    latest = Checkpoints(out / "checkpoints").latest() if out.is_dir() else None
    then = f"; then continue with asyncflow run --resume {out}" if latest is not None else ""
    print(f"asyncflow run: {what}{then}", file=sys.stderr)
    return EXIT_ENVIRONMENT


def main_job(args: Any) -> int:
    """``asyncflow run``: exit 2 with a message on a bad config."""
    if args.keys:  # the keys of the workload the config and --set choose (default: digits)
        try:
            cfg = load_run_config(args.config, list(args.set or ()))
        except ConfigError as e:
            print(f"asyncflow run: {e}", file=sys.stderr)
            return 2
        print(f"# workload {cfg.workload_name()} ({type(cfg).__name__})")
        for key in keys(cfg):
            print(f"{key} = {config_value(cfg, key)!r}")
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
            cfg = load_run_config(args.config, sets)
        cfg.validate()
        if resume:
            out = Path(resume)
        else:
            out = Path(args.out) if args.out else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    except ConfigError as e:
        print(f"asyncflow run: {e}", file=sys.stderr)
        return EXIT_INPUT
    trust = bool(getattr(args, "trust_checkpoints", False))
    rl = cfg.rl_config()
    what = cfg.describe()
    print(
        f"asyncflow run: {what} with {cfg.rl.mode} RL "
        f"(η={rl.staleness}, {rl.weight_sync} sync, loss "
        f"{cfg.train.loss}), {cfg.rl.steps} steps x {cfg.rl.prompts_per_step * cfg.rl.n} "
        f"samples; writing {out}/",
        file=sys.stderr,
    )
    done, point = 0, None
    if resume:  # (run() then takes it as found: the checkpoint's files are hashed once here)
        try:
            point = resume_point(cfg, out, trust=trust)
        except (ConfigError, CheckpointError) as e:
            print(f"asyncflow run: {e}", file=sys.stderr)
            return EXIT_INPUT
        done = point.state.version - point.state.origin
        print(
            f"asyncflow run: resuming from {point.folder} ({done} of {cfg.rl.steps} steps done)",
            file=sys.stderr,
        )
    progress = StepProgress(cfg.rl.steps - done, sys.stderr, quiet=args.quiet)
    try:
        output = asyncio.run(
            run(
                cfg, out, on_step=progress, resume=point or False, preemptible=True,
                trust_checkpoints=trust,
            )
        )  # fmt: skip
    except RunPreempted as e:
        print(
            f"asyncflow run: stopped on SIGTERM after {e.steps} steps; checkpoint "
            f"{e.checkpoint}; continue with: asyncflow run --resume {out}",
            file=sys.stderr,
        )
        return EXIT_OK
    except (ConfigError, CheckpointError) as e:  # a bad input found while building the run
        environment = _environment(e)  # or a checkpoint that could not be written
        if environment is not None:
            return _say_environment(environment, out)
        print(f"asyncflow run: {e}", file=sys.stderr)
        return EXIT_INPUT
    except Exception as e:
        environment = _environment(e)
        if environment is not None:
            return _say_environment(environment, out)
        causes = _causes(e)
        if not isinstance(e, TaskFailedError) and any(
            isinstance(c, ConfigError | CheckpointError) for c in causes
        ):  # an engine that could not be built, because of what it was given
            print(f"asyncflow run: {_explain(e)}", file=sys.stderr)
            return EXIT_INPUT
        if isinstance(e, AsyncFlowError):  # the run stopped: a lost trainer, a failing reward
            latest = Checkpoints(out / "checkpoints").latest()
            where = (
                f"the newest checkpoint is {latest}: continue with asyncflow run --resume {out}"
                if latest is not None
                else "no checkpoint was written yet"
            )
            print(f"asyncflow run: the run stopped: {_explain(e)}\n{where}", file=sys.stderr)
            return EXIT_FAILED
        traceback.print_exc()
        print(
            f"asyncflow run: an internal error ({type(e).__name__}: {e}): a bug in AsyncFlow or "
            "in a plugin it loaded, not in your input. Please report it with the traceback "
            f"above and {out / 'config.toml'} if it exists",
            file=sys.stderr,
        )
        return EXIT_BUG
    finally:
        progress.close()
    print(format_summary(output.summary))
    print(f"run folder: {out}/")
    return EXIT_OK


__all__ = ["main_job"]
