"""CPU pipeline benchmark: the real reference engines (pure PyTorch) learning the main job's
task, colocated-sync vs asynchronous, in one run.

* **colocated** (the baseline): rollout and training take turns, each phase using every core
  (``torch.set_num_threads(cores)``), on-policy (η = 0), blocking weight sync.
* **async**: rollout on one core and training on the other at the same time (one torch
  thread each), η = 1, staged weight sync; the same samples per step and the same steps.
* **η = 4**: a much staler pipeline trained with naive PPO (the ratio against the rollout's
  behaviour log-probs) and with decoupled PPO (AReaL: the trust region around the trainer's own
  proximal log-probs, importance-weighted to the behaviour policy), same seed.

Throughput is trained samples per second of the RL phase (warm-up excluded). Rewards are the
mean over the last 10% of steps (``reward_last``) plus a greedy evaluation on fresh prompts.
The last stdout line is one JSON object.

    python benchmarks/cpu_pipeline.py            # the full comparison (about 6-8 minutes)
    python benchmarks/cpu_pipeline.py --quick    # a few steps each: checks it runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "reference")]

from asyncflow_reference.job import RunConfig, RunSummary, run  # noqa: E402

from asyncflow_core.config import apply_override  # noqa: E402

TARGET_SPEEDUP = 1.3
TARGET_REWARD_GAP = 0.05


def _run(cfg: RunConfig, label: str) -> RunSummary:
    print(f"  running {label} ...", file=sys.stderr, flush=True)
    summary = asyncio.run(run(cfg)).summary
    print(
        f"  {label}: {summary.samples_per_s:.0f} samples/s, reward {summary.reward_first:.3f} "
        f"-> {summary.reward_last:.3f}, {summary.wall_s:.0f} s",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 steps per run (a smoke test)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a RunConfig key for every run (see asyncflow run --keys)",
    )  # fmt: skip
    args = parser.parse_args()

    base = RunConfig(seed=args.seed)
    for item in args.set:
        base = apply_override(base, item)
    if args.quick:
        base = replace(base, rl=replace(base.rl, steps=8), eval_prompts=32)
    runs: dict[str, RunSummary] = {}
    runs["colocated"] = _run(
        replace(base, rl=replace(base.rl, mode="colocated", staleness=0)), "colocated η=0"
    )
    runs["async"] = _run(
        replace(base, rl=replace(base.rl, mode="async", staleness=1, weight_sync="staged")),
        "async η=1 staged",
    )
    eta4 = replace(base.rl, mode="async", staleness=4, weight_sync="staged")
    runs["eta4_naive"] = _run(
        replace(base, rl=eta4, train=replace(base.train, loss="ppo")), "async η=4 naive PPO"
    )
    runs["eta4_decoupled"] = _run(
        replace(base, rl=eta4, train=replace(base.train, loss="decoupled-ppo")),
        "async η=4 decoupled PPO",
    )

    header = (
        f"{'run':<16} {'η':>2} {'loss':<14} {'threads':>7} {'samples/s':>10} {'wall s':>7} "
        f"{'reward first':>12} {'reward last':>11} {'eval':>6} {'dropped':>7}"
    )
    print(f"== reference engines, task {base.task.name}-{base.task.digits}, "
          f"{base.rl.steps} steps x {base.rl.prompts_per_step * base.rl.n} samples ==")  # fmt: skip
    print(header)
    print("-" * len(header))
    for name, s in runs.items():
        ev = f"{s.eval_reward:.3f}" if s.eval_reward is not None else "-"
        print(
            f"{name:<16} {s.staleness:>2} {s.loss:<14} {s.threads:>7} {s.samples_per_s:>10.1f} "
            f"{s.wall_s:>7.1f} {s.reward_first:>12.3f} {s.reward_last:>11.3f} {ev:>6} "
            f"{s.dropped:>7}"
        )
    speedup = runs["async"].samples_per_s / runs["colocated"].samples_per_s
    gap = runs["async"].reward_last - runs["colocated"].reward_last
    print(
        f"speedup async/colocated {speedup:.2f}x (target >= {TARGET_SPEEDUP}x); final reward "
        f"async - colocated {gap:+.3f} (target within {TARGET_REWARD_GAP}); η=4 final reward: "
        f"naive PPO {runs['eta4_naive'].reward_last:.3f}, decoupled PPO "
        f"{runs['eta4_decoupled'].reward_last:.3f}"
    )
    result: dict[str, Any] = {
        "benchmark": "cpu_pipeline",
        "speedup": round(speedup, 4),
        "reward_sync": round(runs["colocated"].reward_last, 4),
        "reward_async": round(runs["async"].reward_last, 4),
        "reward_eta4_naive": round(runs["eta4_naive"].reward_last, 4),
        "reward_eta4_decoupled": round(runs["eta4_decoupled"].reward_last, 4),
        "targets": {"speedup": TARGET_SPEEDUP, "reward_gap": TARGET_REWARD_GAP},
        "runs": {k: v.as_json() for k, v in runs.items()},
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
