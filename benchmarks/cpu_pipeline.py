"""CPU pipeline benchmark: the real reference engines (pure PyTorch) learning the main job's
task, colocated-sync vs asynchronous, in one run.

* **colocated** (the baseline): rollout and training take turns, each phase using every core
  (``torch.set_num_threads(cores)``), on-policy (η = 0), blocking weight sync. Run twice, with
  the trainer in this process and in a child process; the faster is the baseline.
* **async**: rollout on one core and training on the other at the same time (one torch
  thread each), η = 1, staged weight sync; the same samples per step and the same steps. Run
  with the trainer as a thread of this process (it then shares the interpreter lock with
  rollout and the store: ``train.process=false``, the one-process mode) and in a child
  process of its own (``asyncflow_core.engines.process.ProcessTrainEngine``; what ``train.process =
  "auto"``, the main job's default, does for this trainer): the headline ``speedup`` is the
  latter's, i.e. the default ``asyncflow run``'s.
* **η = 4**: a much staler pipeline (trainer in its own process) trained with naive PPO (the
  ratio against the rollout's behaviour log-probs) and with decoupled PPO (AReaL: the trust
  region around the trainer's own proximal log-probs, importance-weighted to the behaviour
  policy), same seed.

Throughput is trained samples per second of the RL phase (warm-up and process start
excluded). Each run has a fresh interpreter; the three throughput configurations (colocated,
async with the trainer as a thread, async with it in a process) run ``--repeat`` times (3),
interleaved, and each reports its median run. Rewards are the mean over the last 10% of
steps (``reward_last``) plus a greedy evaluation on fresh prompts. The last stdout line is one
JSON object.

    python benchmarks/cpu_pipeline.py            # the full comparison (about 3 minutes)
    python benchmarks/cpu_pipeline.py --quick    # a few steps each: checks it runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "reference")]

from asyncflow_reference.workloads import ReferenceRunConfig  # noqa: E402

from asyncflow_core.flow.config import apply_override, to_toml  # noqa: E402
from asyncflow_core.job import RunSummary, load_run_config, run  # noqa: E402

TARGET_SPEEDUP = 1.3
TARGET_REWARD_GAP = 0.05


def _run(cfg: ReferenceRunConfig, label: str) -> RunSummary:
    """One run in a fresh interpreter, so no run inherits another's thread pools, forkserver
    or allocator state (in one process, runs after a 2-thread colocated run were slower)."""
    print(f"  running {label} ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.toml"
        config.write_text(to_toml(cfg))
        proc = subprocess.run(
            [sys.executable, __file__, "--one", str(config)], capture_output=True, text=True
        )
    if proc.returncode != 0:
        raise SystemExit(f"run {label!r} failed:\n{proc.stderr[-3000:]}")
    summary = RunSummary(**json.loads(proc.stdout.strip().splitlines()[-1]))
    print(
        f"  {label}: {summary.samples_per_s:.0f} samples/s, reward {summary.reward_first:.3f} "
        f"-> {summary.reward_last:.3f}, {summary.wall_s:.0f} s",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    return summary


_REPEATED = ("colocated", "async_thread", "async")


def _median(runs: list[RunSummary]) -> RunSummary:
    """The run of median throughput (the lower middle one of an even count)."""
    ordered = sorted(runs, key=lambda r: r.samples_per_s)
    return ordered[(len(ordered) - 1) // 2]


def _one(config: str) -> int:
    cfg = load_run_config(config, ())
    print(json.dumps(asyncio.run(run(cfg)).summary.as_json()))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 steps per run (a smoke test)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a RunConfig key for every run (see asyncflow run --keys)",
    )  # fmt: skip
    parser.add_argument(
        "--repeat", type=int, default=3,
        help="runs of each throughput configuration (colocated, async_thread, async); median",
    )  # fmt: skip
    parser.add_argument("--one", metavar="CONFIG", help=argparse.SUPPRESS)  # a child's run
    args = parser.parse_args()
    if args.one:
        return _one(args.one)

    base = ReferenceRunConfig(seed=args.seed)
    for item in args.set:
        base = apply_override(base, item)
    if args.quick:
        base = replace(base, rl=replace(base.rl, steps=8), eval_prompts=32)
        args.repeat = 1
    coloc = replace(base.rl, mode="colocated", staleness=0)
    async1 = replace(base.rl, mode="async", staleness=1, weight_sync="staged")
    eta4 = replace(base.rl, mode="async", staleness=4, weight_sync="staged")
    here, there = replace(base.train, process=False), replace(base.train, process=True)
    configs = {
        "colocated": (replace(base, rl=coloc, train=here), "colocated η=0"),
        "colocated_proc": (replace(base, rl=coloc, train=there), "colocated η=0, trainer process"),
        "async_thread": (replace(base, rl=async1, train=here), "async η=1 staged, thread"),
        "async": (replace(base, rl=async1, train=there), "async η=1 staged, trainer process"),
        "eta4_naive": (
            replace(base, rl=eta4, train=replace(there, loss="ppo")),
            "async η=4 naive PPO",
        ),
        "eta4_decoupled": (
            replace(base, rl=eta4, train=replace(there, loss="decoupled-ppo")),
            "async η=4 decoupled PPO",
        ),
    }
    # the throughput runs repeat, interleaved (a slow spell of the machine hits each alike);
    # the figure of a configuration is its median run
    reps: dict[str, list[RunSummary]] = {name: [] for name in configs}
    for r in range(args.repeat):
        for name, (cfg, label) in configs.items():
            if r == 0 or name in _REPEATED:
                reps[name].append(_run(cfg, f"{label} [{r + 1}/{args.repeat}]"))
    runs = {name: _median(rs) for name, rs in reps.items()}
    baseline_name = max(("colocated", "colocated_proc"), key=lambda n: runs[n].samples_per_s)
    baseline = runs[baseline_name]

    header = (
        f"{'run':<16} {'η':>2} {'loss':<14} {'trainer':<8} {'threads':>7} {'samples/s':>10} "
        f"{'[min-max]':>13} {'n':>2} {'wall s':>7} "
        f"{'reward first':>12} {'reward last':>11} {'eval':>6} {'dropped':>7}"
    )
    print(f"== reference engines, task {base.task.name}-{base.task.digits}, "
          f"{base.rl.steps} steps x {base.rl.prompts_per_step * base.rl.n} samples ==")  # fmt: skip
    print(header)
    print("-" * len(header))
    for name, s in runs.items():
        ev = f"{s.eval_reward:.3f}" if s.eval_reward is not None else "-"
        rates = [x.samples_per_s for x in reps[name]]
        spread = f"[{min(rates):.0f}-{max(rates):.0f}]"
        print(
            f"{name:<16} {s.staleness:>2} {s.loss:<14} {s.trainer:<8} {s.threads:>7} "
            f"{s.samples_per_s:>10.1f} {spread:>13} {len(rates):>2} {s.wall_s:>7.1f} "
            f"{s.reward_first:>12.3f} {s.reward_last:>11.3f} {ev:>6} {s.dropped:>7}"
        )
    speedup = runs["async"].samples_per_s / baseline.samples_per_s
    speedup_thread = runs["async_thread"].samples_per_s / baseline.samples_per_s
    gap = runs["async"].reward_last - baseline.reward_last
    print(
        f"speedup async/colocated (medians) {speedup:.2f}x with the trainer in its own process "
        f"(target >= {TARGET_SPEEDUP}x), {speedup_thread:.2f}x with it as a thread; final "
        f"reward async - colocated {gap:+.3f} (target within {TARGET_REWARD_GAP}); η=4 final "
        f"reward: naive PPO {runs['eta4_naive'].reward_last:.3f}, decoupled PPO "
        f"{runs['eta4_decoupled'].reward_last:.3f}"
    )
    result: dict[str, Any] = {
        "benchmark": "cpu_pipeline",
        "speedup": round(speedup, 4),
        "speedup_thread": round(speedup_thread, 4),
        "baseline": baseline_name,
        "repeat": args.repeat,
        "reward_sync": round(baseline.reward_last, 4),
        "reward_async": round(runs["async"].reward_last, 4),
        "reward_eta4_naive": round(runs["eta4_naive"].reward_last, 4),
        "reward_eta4_decoupled": round(runs["eta4_decoupled"].reward_last, 4),
        "targets": {"speedup": TARGET_SPEEDUP, "reward_gap": TARGET_REWARD_GAP},
        "samples_per_s": {k: [round(x.samples_per_s, 1) for x in v] for k, v in reps.items()},
        "runs": {k: v.as_json() for k, v in runs.items()},
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
