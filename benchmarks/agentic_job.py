"""The agentic main job, several seeds: does the model learn to use its tool, and how fast.

``python benchmarks/agentic_job.py [--task clock] [--seeds 0 1 2] [--steps 200] [--plot PNG]
[-- extra key=value overrides]`` runs ``asyncflow run --set task=TASK --set rl.steps=STEPS``
(the README's agentic command) once per seed, one after another, and prints a table: reward
over the first and last 10% of steps, turns and tool calls per trajectory over the same
windows, and the greedy evaluations (on fresh samples) before RL, after RL, and after RL with
the tool taken away; samples/s and wall time. ``--plot`` draws every seed's reward curve
(needs matplotlib). The last stdout line is JSON with every run's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncflow_core.job import load_run_config, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="clock")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--plot", default="", help="write the reward curves to this PNG")
    parser.add_argument("sets", nargs="*", help="more key=value overrides")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    curves: dict[int, list[tuple[float, float]]] = {}
    for seed in args.seeds:
        sets = [f"task={args.task}", f"rl.steps={args.steps}", f"seed={seed}", *args.sets]
        cfg = load_run_config(None, sets)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as out:
            output = asyncio.run(run(cfg, Path(out)))
        s = output.summary
        curves[seed] = [(step.end_s, step.reward_mean) for step in output.result.steps]
        evals = s.extra.get("eval", {})
        agent = s.extra.get("agent", {})
        rows.append(
            {
                "seed": seed,
                "reward_first": round(s.reward_first, 3),
                "reward_last": round(s.reward_last, 3),
                "turns": [round(x, 2) for x in agent.get("turns", [])],
                "tool_calls": [round(x, 2) for x in agent.get("tool_calls", [])],
                **{f"eval_{k}": {m: round(v, 3) for m, v in e.items()} for k, e in evals.items()},
                "samples_per_s": round(s.samples_per_s, 1),
                "rl_s": round(s.wall_s, 1),
                "total_s": round(time.perf_counter() - t0, 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    head = ("seed", "reward", "tool calls", "eval before", "after", "tools off", "RL s")
    print("\n{:>4} {:>13} {:>11} {:>16} {:>16} {:>10} {:>6}".format(*head))
    for r in rows:
        before, after, off = r["eval_before"], r["eval_after"], r["eval_no_tools"]
        print(
            f"{r['seed']:>4} {r['reward_first']:>5.3f} → {r['reward_last']:.3f} "
            f"{r['tool_calls'][0]:>4.2f} → {r['tool_calls'][1]:.2f} "
            f"{before['reward']:>5.3f} ({before['tool_use']:>4.0%} tool) "
            f"{after['reward']:>5.3f} ({after['tool_use']:>4.0%} tool) "
            f"{off['reward']:>10.3f} {r['rl_s']:>6.1f}"
        )
    if args.plot:
        plot(curves, Path(args.plot), args.task)
    print(json.dumps({"task": args.task, "steps": args.steps, "sets": args.sets, "runs": rows}))


def plot(curves: dict[int, list[tuple[float, float]]], path: Path, task: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for seed, points in curves.items():
        ax.plot([t for t, _ in points], [r for _, r in points], lw=1.2, label=f"seed {seed}")
    ax.set_xlabel("seconds of RL (2-core CPU)")
    ax.set_ylabel("mean reward of the step")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"asyncflow run --set task={task}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
