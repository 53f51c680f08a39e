"""``asyncflow run``: read the config (``load_run_config``), print what runs, show progress,
run (``asyncflow_core.job.run.run``), print the summary; ``--resume`` continues a run folder
and SIGTERM writes a checkpoint first. Exit status: 0 done (or stopped on SIGTERM, with a
checkpoint), 1 the run stopped on a failure, 2 a bad config or input."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncflow_core.contracts.errors import CheckpointError, ConfigError, TaskFailedError
from asyncflow_core.flow.config import keys, load_config
from asyncflow_core.infra.checkpoint import Checkpoints
from asyncflow_core.job.config import RESUME_KEYS, RETIRED, RunConfig, load_run_config
from asyncflow_core.job.report import StepProgress, format_summary
from asyncflow_core.job.run import RunPreempted, resume_point, run


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
    base = load_run_config(saved)
    cfg = load_config(type(base), saved, sets, retired=RETIRED)  # the run's workload's class
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
    if args.keys:  # the keys of the workload the config and --set choose (default: digits)
        try:
            cfg = load_run_config(args.config, list(args.set or ()))
        except ConfigError as e:
            print(f"asyncflow run: {e}", file=sys.stderr)
            return 2
        print(f"# workload {cfg.workload_name()} ({type(cfg).__name__})")
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
            cfg = load_run_config(args.config, sets)
        cfg.validate()
    except ConfigError as e:
        print(f"asyncflow run: {e}", file=sys.stderr)
        return 2
    if resume:
        out = Path(resume)
    else:
        out = Path(args.out) if args.out else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    rl = cfg.rl_config()
    what = cfg.describe()
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
            folder, state, _ = resume_point(cfg, out)
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


__all__ = ["main_job"]
