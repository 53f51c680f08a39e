"""The HF main job on the shipped data, several seeds: does it learn, and how fast.

``python benchmarks/hf_job.py [--seeds 0 1 2] [--steps 150] [-- extra --set overrides]``
runs ``asyncflow run --set model.name=tiny-qwen2 --set rl.steps=STEPS`` (the README's "Train
your Hugging Face model" command) once per seed, one after another, and prints a table of
reward over the first and last 10% of steps, greedy eval, samples/s and wall time; the last
stdout line is JSON with every run's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from asyncflow_core.job import load_run_config, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--model", default="tiny-qwen2")
    parser.add_argument("sets", nargs="*", help="more key=value overrides")
    args = parser.parse_args()
    rows = []
    for seed in args.seeds:
        sets = [f"model.name={args.model}", f"rl.steps={args.steps}", f"seed={seed}", *args.sets]
        cfg = load_run_config(None, sets)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as out:
            s = asyncio.run(run(cfg, Path(out))).summary
        rows.append(
            {
                "seed": seed,
                "reward_first": round(s.reward_first, 3),
                "reward_last": round(s.reward_last, 3),
                "eval_reward": None if s.eval_reward is None else round(s.eval_reward, 3),
                "samples_per_s": round(s.samples_per_s, 1),
                "rl_s": round(s.wall_s, 1),
                "total_s": round(time.perf_counter() - t0, 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    head = ("seed", "first 10%", "last 10%", "eval", "samples/s", "RL s")
    print("\n{:>4} {:>9} {:>9} {:>6} {:>9} {:>6}".format(*head))
    for r in rows:
        print(
            f"{r['seed']:>4} {r['reward_first']:>9.3f} {r['reward_last']:>9.3f} "
            f"{r['eval_reward'] or 0:>6.3f} {r['samples_per_s']:>9.1f} {r['rl_s']:>6.1f}"
        )
    print(json.dumps({"model": args.model, "steps": args.steps, "sets": args.sets, "runs": rows}))


if __name__ == "__main__":
    main()
