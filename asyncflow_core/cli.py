"""The ``asyncflow`` command line: ``run`` (the main job), ``selfcheck`` (a streaming store run),
``trace summarize FILE`` (the summary of a Chrome-trace file written by
``asyncflow_core.observability.trace``), ``simulate --preset NAME`` (a simulated cluster run of
the RL pipeline, colocated vs async), ``platforms`` (the platforms known here, which can run,
and why not).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from asyncflow_core import __version__
from asyncflow_core.contracts.errors import MissingExtraError
from asyncflow_core.contracts.protocols import Capacity, Tags
from asyncflow_core.data.scheduling import GroupSampler, TokenBalancedSampler
from asyncflow_core.data.store import InProcessDataStore


async def _selfcheck(prompts: int, group: int, batch: int, seed: int) -> dict[str, float]:
    """Stream prompts -> "rollout" (whole groups) -> "train" (token-balanced over 2 DP ranks)
    through a capacity-bounded store, and check every row reached each task exactly once."""
    gen = torch.Generator().manual_seed(seed)
    store = InProcessDataStore(num_storage_units=2)
    await store.create_partition(
        "rl", ["prompt", "response"], tasks=["rollout", "train"], capacity=Capacity(max_rows=256)
    )
    seen_rollout: list[int] = []
    seen_train: list[int] = []

    async def feeder() -> None:
        for p in range(prompts):
            prompt = torch.randint(0, 100, (8,), generator=gen)
            await store.put("rl", {"prompt": [prompt] * group}, tags=[Tags(group=p)] * group)
        await store.close("rl")

    async def rollout() -> None:
        sampler = GroupSampler(group)
        while True:
            meta = await store.get_meta("rl", "rollout", ["prompt"], batch, sampler=sampler)
            if meta.end_of_stream:
                return
            lengths = (torch.rand(len(meta), generator=gen) ** 4 * 200 + 4).long().tolist()
            responses = [torch.randint(0, 100, (n,), generator=gen) for n in lengths]
            await store.put(
                "rl",
                {"response": responses},
                rows=meta.rows,
                tags=[Tags(versions=(0,), tokens=n) for n in lengths],
            )
            seen_rollout.extend(meta.rows)
            await store.ack(meta)

    async def train() -> None:
        sampler = TokenBalancedSampler()
        while True:
            meta = await store.get_meta(
                "rl", "train", ["response"], batch, sampler=sampler, dp_size=2
            )
            if meta.end_of_stream:
                return
            for part in meta.split():
                data = await store.get_data(part)
                assert data["response"].shape[0] == len(part)
            seen_train.extend(meta.rows)
            await store.ack(meta)

    t0 = time.perf_counter()
    await asyncio.gather(feeder(), rollout(), train())
    wall = time.perf_counter() - t0
    rows = prompts * group
    stats = await store.stats("rl")
    ok = sorted(seen_rollout) == sorted(seen_train) == list(range(rows))
    if not ok or stats.rows_live != 0:
        raise SystemExit(f"selfcheck FAILED: rows lost or duplicated ({stats})")
    return {"rows": rows, "wall_s": wall, "rows_per_s": rows / wall, "reclaimed": stats.reclaimed}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncflow", description=__doc__)
    parser.add_argument("--version", action="version", version=f"asyncflow {__version__}")
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser(
        "run",
        help="the main job: async GRPO on a registered workload (default: the reference model "
        "on a digit task, CPU), with a run folder",
        description="Asynchronous RL on a registered workload, engines and runtime (default: "
        "the pure-PyTorch reference engines, a tiny model learning a built-in verifiable task; "
        "--keys lists the keys of the workload --set chooses). Writes config.toml, "
        "metrics.jsonl, trace.json, summary.json, PNG plots and checkpoints/ to the run "
        "folder; SIGTERM writes a checkpoint and stops (continue with --resume).",
    )
    run.add_argument("--config", default=None, metavar="FILE", help="a TOML config file")
    run.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override one config key, e.g. --set rl.staleness=2 (repeatable; see --keys)",
    )  # fmt: skip
    run.add_argument("--out", default=None, metavar="DIR", help="run folder (runs/<timestamp>)")
    run.add_argument(
        "--resume", default=None, metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its newest checkpoint, with its config.toml "
        "(--set may change rl.steps, eval_prompts, threads, checkpoint.*, rollout.engines, "
        "rollout.max_batch, train.process, runtime.*)",
    )  # fmt: skip
    run.add_argument(
        "--trust-checkpoints", action="store_true",
        help="with --resume: accept checkpoints not signed with your checkpoint key (a run "
        "folder copied from another machine or user that you trust); their files are still "
        "checked against their manifests",
    )  # fmt: skip
    run.add_argument("--keys", action="store_true", help="list every config key and exit")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument(
        "--runtime",
        default=None,
        help="where the job runs (= --set runtime.kind=...): local (one process, default) or "
        "ray (store and engines as Ray actors; a local cluster unless runtime.address is set)",
    )
    p = sub.add_parser("selfcheck", help="store self-check: stream rows through three tasks")
    p.add_argument("--prompts", type=int, default=500)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    trace = sub.add_parser(
        "trace", help="read traces written by asyncflow_core.observability.trace"
    )
    trace_sub = trace.add_subparsers(dest="trace_command", metavar="COMMAND", required=True)
    summarize = trace_sub.add_parser(
        "summarize", help="print the summary of a Chrome-trace JSON file (.json or .json.gz)"
    )
    summarize.add_argument("file", help="a trace written by Tracer.write_chrome_trace")
    summarize.add_argument("--json", action="store_true", help="print the summary as JSON")
    summarize.add_argument(
        "--throughput-task", default=None, help="the task whose rows count as samples"
    )
    summarize.add_argument(
        "--png", default=None, metavar="PATH", help="also draw a timeline (needs matplotlib)"
    )
    plats = sub.add_parser(
        "platforms",
        help="list the platforms (cpu, cuda, npu, plugins): which can run here and why not",
    )
    plats.add_argument("--json", action="store_true", help="print them as one JSON list")
    handlers = _plugin_commands(sub)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command in handlers:
        return int(handlers[args.command](args))
    if args.command == "platforms":
        return _platforms(args.json)
    if args.command == "trace":
        return _trace_summarize(args.file, args.json, args.throughput_task, args.png)
    if args.command == "run":
        from asyncflow_core.job.command import main_job

        return main_job(args)
    if args.command != "selfcheck":  # a parser a plugin added under another name than its own
        parser.error(f"command {args.command!r} has no handler")
    result = asyncio.run(_selfcheck(args.prompts, args.group, args.batch, args.seed))
    print(
        f"selfcheck ok: {result['rows']:.0f} rows streamed prompt -> rollout -> train, each "
        f"task saw every row once, {result['reclaimed']:.0f} reclaimed, "
        f"{result['rows_per_s']:,.0f} rows/s ({result['wall_s']:.2f} s)"
    )
    return 0


COMMANDS = "asyncflow.commands"
"""The entry-point group of the subcommands a package adds (``asyncflow simulate``, from the
reference backend): ``name = "module:add"``, ``add(subparsers)`` adding its parser and
returning its handler, ``handler(args) -> int`` (the exit status)."""


def _plugin_commands(sub: Any) -> dict[str, Callable[[argparse.Namespace], int]]:
    """Each ``asyncflow.commands`` entry point's parser added to ``sub`` (after the built-in
    commands), by name. One is left out, with a note on stderr, when its name is taken, its
    package does not import, or its ``add`` does not add a parser of its name and return a
    handler: a broken plugin never breaks the other commands."""
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {}
    for ep in sorted(importlib.metadata.entry_points(group=COMMANDS), key=lambda e: e.name):
        where = f"asyncflow: command {ep.name!r} ({ep.value})"
        if ep.name in sub.choices:
            print(f"{where} is left out: the name is taken", file=sys.stderr)
            continue
        try:
            handler = ep.load()(sub)
        except Exception as e:  # any failure of a plugin: note it, go on
            print(f"{where} is unavailable: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        if ep.name not in sub.choices or not callable(handler):
            print(
                f"{where} is left out: its add(subparsers) must add a parser named {ep.name!r} "
                "and return the handler",
                file=sys.stderr,
            )
            continue
        handlers[ep.name] = handler
    return handlers


def _platforms(as_json: bool) -> int:
    """``asyncflow platforms``: one line per platform, the one ``auto`` picks marked."""
    from asyncflow_core.infra.platform import platforms, select_platform

    rows = platforms()
    auto = select_platform("auto").name
    for row in rows:
        row["auto"] = row["name"] == auto
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'platform':<10} {'runs here':<10} {'backend':<8} {'devices':<8} source / why not")
    for row in rows:
        mark = "yes (auto)" if row["auto"] else "yes" if row["available"] else "no"
        devices = "" if row.get("devices") is None else str(row["devices"])
        note = row["source"] if row["available"] else row["reason"]
        print(f"{row['name']:<10} {mark:<10} {row.get('dist_backend', ''):<8} {devices:<8} {note}")
    return 0


def _trace_summarize(path: str, as_json: bool, throughput_task: str | None, png: str | None) -> int:
    """``asyncflow trace summarize``: exit 2 with a message naming the file if it is unusable."""
    from asyncflow_core.observability.trace import TraceFormatError, format_summary, load

    try:
        tracer = load(path)
    except OSError as e:
        print(
            f"asyncflow trace summarize: cannot read {path!r}: {e.strerror or e}", file=sys.stderr
        )
        return 2
    except TraceFormatError as e:
        print(f"asyncflow trace summarize: {e}", file=sys.stderr)
        return 2
    summary = tracer.summary(throughput_task=throughput_task)
    print(json.dumps(summary, indent=2) if as_json else format_summary(summary))
    if png is not None:
        try:
            tracer.plot_timeline(png)
        except MissingExtraError as e:
            print(f"asyncflow trace summarize: {e}", file=sys.stderr)
            return 2
        print(f"timeline written to {png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
