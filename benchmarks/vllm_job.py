"""The HF main job with vLLM as its rollout engine against the HF engine: does it learn, and how
fast, on the same model and settings.

``python benchmarks/vllm_job.py [--rounds 2] [--steps 150] [--seed 0] [-- extra --set ...]``

The two engines need two environments (vLLM's CPU build pins transformers < 5.20; the HF
engine's continuous batching needs 5.24): ``.venv`` runs ``asyncflow run --set
rollout.engine=hf`` and ``.venv-vllm`` (``make vllm-venv``) ``--set rollout.engine=vllm``, the
same command otherwise: one model folder (a random ``small-qwen2``, made once, the smallest
Qwen2 vLLM's CPU attention serves), the shipped GSM8K-style problems, the built-in math reward
with its format warm-up, the same seed. Runs alternate (hf, vllm, hf, vllm, ...), each a
process group of its own, killed whole before the next starts; the load average is printed at
each start. The table shows the held-out
greedy reward before RL (after the warm-up) and after, the training reward over the first and
last 10% of steps, samples/s, tokens/s and RL wall time; the last stdout line is JSON with
every run and the median vllm/hf ratio of samples/s (min-max over rounds).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ENVS = {"hf": ROOT / ".venv", "vllm": ROOT / ".venv-vllm"}


def make_model(folder: Path) -> None:
    """A random small-qwen2 with the shipped tokenizer (in .venv)."""
    code = (
        "import sys; from asyncflow_hf.assets import make_model_folder; "
        "make_model_folder(sys.argv[1], model='small-qwen2', seed=0)"
    )
    subprocess.run([str(ENVS["hf"] / "bin" / "python"), "-c", code, str(folder)], check=True)


def run_one(engine: str, model: Path, out: Path, steps: int, seed: int, sets: list[str]) -> Any:
    load = os.getloadavg()[0]
    command = [
        str(ENVS[engine] / "bin" / "asyncflow"), "run", "--out", str(out),
        "--set", f"model.path={model}", "--set", f"rollout.engine={engine}",
        "--set", f"rl.steps={steps}", "--set", f"seed={seed}", "--set", "checkpoint.every=0",
        *(x for s in sets for x in ("--set", s)),
    ]  # fmt: skip
    t0 = time.perf_counter()
    # a session of its own: whatever the run leaves behind (vLLM's engine core shutting down)
    # is killed before the next run starts, so the runs do not overlap
    run = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        text=True, start_new_session=True,
    )  # fmt: skip
    _, stderr = run.communicate()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(run.pid, signal.SIGKILL)
    if run.returncode != 0:
        sys.exit(f"{engine} run failed ({run.returncode}):\n{stderr[-4000:]}")
    s = json.loads((out / "summary.json").read_text())
    before = (s.get("extra") or {}).get("eval_before") or {}
    return {
        "engine": engine,
        "load": round(load, 2),
        "eval_before": round(before.get("reward", float("nan")), 3),
        "eval_after": None if s["eval_reward"] is None else round(s["eval_reward"], 3),
        "reward_first": round(s["reward_first"], 3),
        "reward_last": round(s["reward_last"], 3),
        "samples_per_s": round(s["samples_per_s"], 1),
        "tokens_per_s": round(s["tokens_per_s"], 1),
        "rl_s": round(s["wall_s"], 1),
        "total_s": round(time.perf_counter() - t0, 1),
        "bubble_ratio": s["bubble_ratio"],
        "sync_exposed_s": round(s["sync_exposed_s"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=sorted(ENVS))
    parser.add_argument("sets", nargs="*", help="more key=value overrides, for every run")
    args = parser.parse_args()
    for engine in args.engines:
        if not (ENVS[engine] / "bin" / "asyncflow").exists():
            sys.exit(f"{ENVS[engine]} is missing: make venv / make vllm-venv")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "small-qwen2"
        make_model(model)
        for round_ in range(args.rounds):
            for engine in args.engines:
                out = Path(tmp) / f"{engine}-{round_}"
                rows.append({"round": round_, **run_one(engine, model, out, args.steps,
                                                        args.seed, args.sets)})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    head = ("engine", "round", "load", "eval before", "after", "first 10%", "last 10%",
            "samples/s", "tokens/s", "RL s")  # fmt: skip
    print("\n{:<6} {:>5} {:>5} {:>11} {:>6} {:>9} {:>9} {:>9} {:>9} {:>6}".format(*head))
    for r in rows:
        print(
            f"{r['engine']:<6} {r['round']:>5} {r['load']:>5.2f} {r['eval_before']:>11.3f} "
            f"{r['eval_after'] or 0:>6.3f} {r['reward_first']:>9.3f} {r['reward_last']:>9.3f} "
            f"{r['samples_per_s']:>9.1f} {r['tokens_per_s']:>9.0f} {r['rl_s']:>6.1f}"
        )
    result: dict[str, Any] = {"steps": args.steps, "seed": args.seed, "sets": args.sets}
    by = {e: [r for r in rows if r["engine"] == e] for e in args.engines}
    if {"hf", "vllm"} <= set(by):
        ratios = [
            v["samples_per_s"] / h["samples_per_s"]
            for h, v in zip(by["hf"], by["vllm"], strict=True)
            if h["samples_per_s"] > 0
        ]
        if ratios:
            result["vllm_over_hf_samples_per_s"] = {
                "median": round(statistics.median(ratios), 3),
                "min": round(min(ratios), 3),
                "max": round(max(ratios), 3),
            }
    result["runs"] = rows
    print(json.dumps(result))


if __name__ == "__main__":
    main()
