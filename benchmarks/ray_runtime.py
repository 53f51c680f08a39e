"""Ray runtime benchmark: the same main job locally and on Ray, on this machine, in one run.

Three configurations of ``asyncflow run`` (the default task, ``rl.steps`` 20, 32 greedy-eval
prompts), each in a fresh interpreter, with equal engine counts (``rollout.engines`` rollout
engines and one trainer):

* **local** — the default: rollout engines on threads of the driver, the trainer in a child
  process (``train.process = "auto"``), the store in the driver's memory.
* **ray** — ``runtime.kind = ray`` with its defaults: a local Ray cluster started for the run,
  every engine in an actor of its own (generate calls batched per turn of the driver's loop,
  results streamed back), the store in the driver's memory (``runtime.store = driver``).
* **ray-store** — the same with ``runtime.store = ray``: a ``RayDataStore`` (a controller
  actor and two storage-unit actors), so every stage's put, lease, read and ack is an actor
  call.

Throughput is trained samples per second of the RL phase (``summary.json``'s
``samples_per_s``: cluster start, actor start and warm-up excluded; the same definition on
both sides). The configurations run ``--reps`` times, interleaved (the order rotates every
repetition), and each Ray run is divided by the local run of the same repetition:
``ray_vs_local`` is the median of those ratios, with [min-max]. The goal of the Ray runtime
issue is ``ray_vs_local`` >= 0.7 on one box.

``--two-node`` then runs the Ray configurations once more on a two-node
``ray.cluster_utils.Cluster`` started on this machine (2 logical CPUs per node, the job
joining it with ``runtime.address``, ``--engines`` at least 2) and prints where the trainer,
the rollout actors and the storage units landed (``summary.json``'s ``extra.placement``): on
one machine that shows placement, not speed. Ray's ``Cluster`` test utility binds its
nodes to this machine's network address (not loopback; Ray's cluster token guards it) for the
few seconds of those runs.

    python benchmarks/ray_runtime.py             # 3 repetitions (about 3 minutes)
    python benchmarks/ray_runtime.py --two-node  # and the placement on two nodes
    python benchmarks/ray_runtime.py --quick     # 4 steps, 1 repetition: checks it runs

The last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

CONFIGS: dict[str, list[str]] = {
    "local": ["runtime.kind=local"],
    "ray": ["runtime.kind=ray"],
    "ray-store": ["runtime.kind=ray", "runtime.store=ray"],
}
TARGET = 0.7


def run_once(name: str, sets: Sequence[str]) -> dict[str, Any]:
    """One ``asyncflow run`` in a fresh interpreter; its ``summary.json``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "asyncflow_core.cli", "run", "--quiet", "--out", str(out)]
        for item in [*CONFIGS[name], *sets]:
            cmd += ["--set", item]
        env = dict(os.environ)
        paths = [str(ROOT), str(ROOT / "reference"), str(ROOT / "adapters")]
        env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"ray_runtime.py: the {name} run failed:\n{proc.stderr[-3000:]}")
        summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    summary["process_s"] = time.perf_counter() - t0
    print(
        f"  {name}: {summary['samples_per_s']:,.0f} samples/s (RL phase {summary['wall_s']:.1f} s"
        f", whole process {summary['process_s']:.0f} s), reward {summary['reward_last']:.3f}",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    return summary


def two_node(names: Sequence[str], sets: Sequence[str]) -> dict[str, Any]:
    """The Ray configurations once each on a two-node cluster on this machine: samples/s
    and where each actor landed."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "object_store_memory": 512 << 20},
    )
    out: dict[str, Any] = {}
    try:
        cluster.add_node(num_cpus=2, object_store_memory=512 << 20)
        cluster.wait_for_nodes()
        print(f"two-node cluster at {cluster.address}", file=sys.stderr, flush=True)
        for name in names:
            summary = run_once(name, [*sets, f"runtime.address={cluster.address}"])
            placement = summary.get("extra", {}).get("placement", {})
            out[name] = {"samples_per_s": summary["samples_per_s"], "placement": placement}
    finally:
        cluster.shutdown()
    print("\ntwo nodes on this machine (placement, not speed: the nodes share its cores):")
    for name, got in out.items():
        where = ", ".join(f"{actor} on {node}" for actor, node in got["placement"].items())
        print(f"  {name}: {got['samples_per_s']:,.0f} samples/s; {where}")
    return out


def span(xs: Sequence[float], digits: int = 3) -> str:
    return f"{statistics.median(xs):.{digits}f} [{min(xs):.{digits}f}-{max(xs):.{digits}f}]"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    parser.add_argument("--steps", type=int, default=20, help="RL steps per run (default 20)")
    parser.add_argument("--engines", type=int, default=1, help="rollout engines (default 1)")
    parser.add_argument(
        "--only", default=",".join(CONFIGS), help="configurations to run (comma-separated)"
    )
    parser.add_argument("--quick", action="store_true", help="4 steps, 1 repetition")
    parser.add_argument(
        "--two-node", action="store_true",
        help="also run the Ray configurations on a two-node cluster on this machine",
    )  # fmt: skip
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a RunConfig key for every run (see asyncflow run --keys)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or "local" not in names or args.reps < 1:
        parser.error(f"--only takes local plus any of {list(CONFIGS)}; --reps >= 1")
    reps, steps = (1, 4) if args.quick else (args.reps, args.steps)
    sets = [f"rl.steps={steps}", f"rollout.engines={args.engines}", *args.set]
    sets.append("eval_prompts=8" if args.quick else "eval_prompts=32")
    print(
        f"AsyncFlow Ray runtime benchmark — {os.cpu_count()} CPUs, {reps} repetition(s), "
        f"{steps} steps, {args.engines} rollout engine(s); configurations {names}, interleaved",
        flush=True,
    )
    t_start = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        print(f"repetition {rep + 1}/{reps}: {' '.join(order)}", file=sys.stderr, flush=True)
        for name in order:
            runs[name].append(run_once(name, sets))
    ratios = {
        n: [r["samples_per_s"] / b["samples_per_s"] for r, b in zip(*pair, strict=True)]
        for n, pair in ((n, (runs[n], runs["local"])) for n in names)
    }
    rows = []
    for n in names:
        sps = [r["samples_per_s"] for r in runs[n]]
        rows.append(
            (
                n,
                span(sps, 0),
                span(ratios[n]),
                f"{statistics.median(r['reward_last'] for r in runs[n]):.3f}",
                f"{statistics.median(r['bubble_ratio']['trainer'] for r in runs[n]):.2f}",
                runs[n][0]["runtime"],
            )
        )
    headers = ("config", "samples/s", "vs local", "reward (last 10%)", "trainer idle", "runtime")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print()
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    print(
        "    samples/s: trained samples per second of the RL phase, median [min-max] over the "
        "repetitions; vs local: each run over the local run of the same repetition."
    )
    figures: dict[str, Any] = {"benchmark": "ray_runtime", "reps": reps, "steps": steps}
    figures["engines"] = args.engines
    for n in names:
        key = n.replace("-", "_")
        figures[f"{key}_samples_per_s"] = statistics.median(r["samples_per_s"] for r in runs[n])
        if n != "local":
            figures[f"{key}_vs_local"] = statistics.median(ratios[n])
            figures[f"{key}_vs_local_min"] = min(ratios[n])
            figures[f"{key}_vs_local_max"] = max(ratios[n])
    if args.two_node:
        figures["two_node"] = two_node(
            [n for n in names if n != "local"], [*sets, f"rollout.engines={max(2, args.engines)}"]
        )
    figures["wall_s"] = round(time.perf_counter() - t_start, 1)
    if "ray" in names:
        verdict = "met" if figures["ray_vs_local"] >= TARGET else "not met"
        print(
            f"\nheadline: ray {figures['ray_samples_per_s']:,.0f} vs local "
            f"{figures['local_samples_per_s']:,.0f} samples/s: ray_vs_local "
            f"{span(ratios['ray'])} (goal >= {TARGET}: {verdict}); wall {figures['wall_s']:.0f} s"
        )
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
