"""Does asynchrony cost reward? The staleness ablation (issue #25), AReaL-style.

The main job (``asyncflow run``, the reference engines on this machine) over a grid of

* η (``rl.staleness``): how many versions a trained sample may lag the trainer;
* the loss: **naive** PPO-clip (the trust region around the stale behaviour policy that
  sampled the tokens: ``train.loss=ppo``), **decoupled** PPO (AReaL: the trust region around
  the trainer's own proximal policy, importance-weighted to the behaviour policy, uncapped:
  ``train.loss=decoupled-ppo train.is_cap=none``), and **tis** (decoupled with the importance
  weight truncated at 2: ``train.is_cap=2``, the job's default for decoupled-ppo);
* partial rollout off / on (``rl.partial_rollout``: at a sync, generations in flight are cut
  and resumed on the new weights, keeping each token's version);
* seeds;

every run the same total samples (``rl.steps`` × ``prompts_per_step`` × ``n``), each in a fresh
interpreter, one after another (each uses the whole machine), the configurations interleaved
so the machine's drift spreads over all of them. Per run: the final reward (mean of the last
10% of steps), greedy eval reward and exact-match rate, the RL phase's wall seconds, the wall
seconds until the reward's 5-step moving mean first reaches ``--threshold``, and the measured
staleness histogram (trained samples per version lag). Printed: the AReaL-like table (final
reward per η and loss, mean [min-max] over seeds), the wall and time-to-threshold per row,
the mean measured lag (so losses can be compared at equal lag, not only equal η: the
proximal forward pass slows the trainer, and with it the lag moves), the histograms;
``--plot PATH`` writes reward against wall time per configuration (mean over seeds; needs the
``plot`` extra).

    python benchmarks/staleness_quality.py                 # the full grid (about an hour)
    python benchmarks/staleness_quality.py --etas 0,4 --losses naive,decoupled --seeds 0,1
    python benchmarks/staleness_quality.py --quick         # 2 tiny runs: checks it works
    python benchmarks/staleness_quality.py --load runs.json --plot grid.png  # re-render

The last stdout line is one JSON object with every run and at least ``reward_eta0``,
``reward_eta4_naive``, ``reward_eta4_decoupled`` and ``speedup_eta4_vs_eta0`` (η = 0's RL
wall over η = 4 decoupled's, same samples), each a mean over seeds (null if not run).
"""

from __future__ import annotations

import argparse
import itertools
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

LOSSES: dict[str, list[str]] = {
    "naive": ["train.loss=ppo"],
    "decoupled": ["train.loss=decoupled-ppo", "train.is_cap=none"],
    "tis": ["train.loss=decoupled-ppo", "train.is_cap=2"],
}
DEFAULT_TASK = ["task=reverse", "task.digits=6", "train.lr=5e-3", "rollout.engines=2"]
"""The task and knobs the grid runs on (``--task`` replaces them)."""


def one_run(sets: Sequence[str]) -> dict[str, Any]:
    """One ``asyncflow run`` in a fresh interpreter: its summary and per-step records."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "asyncflow_core.cli", "run", "--quiet", "--out", str(out)]
        for item in sets:
            cmd += ["--set", item]
        env = dict(os.environ)
        paths = [str(ROOT), str(ROOT / "reference"), str(ROOT / "adapters")]
        env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(
                f"staleness_quality.py: a run failed ({' '.join(sets)}):\n{proc.stderr[-3000:]}"
            )
        summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
        lines = (out / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines]
    return {"summary": summary, "curve": [(s["t"], s["reward_mean"]) for s in steps]}


def time_to(
    curve: Sequence[tuple[float, float]], threshold: float, window: int = 5
) -> float | None:
    """Wall seconds (the run's own clock) when the ``window``-step moving mean of the reward
    first reaches ``threshold``; None if it never does."""
    for i in range(window - 1, len(curve)):
        if statistics.fmean(r for _, r in curve[i - window + 1 : i + 1]) >= threshold:
            return float(curve[i][0])
    return None


def span(xs: Sequence[float], digits: int = 3) -> str:
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.{digits}f}"
    return f"{statistics.fmean(xs):.{digits}f} [{min(xs):.{digits}f}-{max(xs):.{digits}f}]"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--etas", default="0,1,2,4,8", help="η values (default 0,1,2,4,8)")
    parser.add_argument("--losses", default="naive,decoupled,tis", help="of naive,decoupled,tis")
    parser.add_argument("--partial", default="off,on", help="partial rollout: off,on")
    parser.add_argument("--seeds", default="0,1,2", help="seeds (default 0,1,2)")
    parser.add_argument("--steps", type=int, default=120, help="RL steps per run (120)")
    parser.add_argument("--threshold", type=float, default=0.9, help="reward for time-to")
    parser.add_argument(
        "--task", default=" ".join(DEFAULT_TASK),
        help=f"space-separated --set items for the task and knobs (default {DEFAULT_TASK})",
    )  # fmt: skip
    parser.add_argument("--plot", type=Path, help="write reward vs wall time (PNG) here")
    parser.add_argument("--quick", action="store_true", help="η 0 and 4 naive, 1 seed, 4 steps")
    parser.add_argument("--save", type=Path, help="write every run, curves included (JSON)")
    parser.add_argument(
        "--load", type=Path,
        help="run nothing: print the table (and --plot) of a --save file, or of a saved "
        "stdout whose last line is this script's JSON (no curves: the by-η figure only)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.load is not None:
        return _replay(args.load, args.plot, args.threshold)
    if args.quick:
        args.etas, args.losses, args.partial, args.seeds, args.steps = "0,4", "naive", "off", "0", 4
    try:
        etas = [int(x) for x in args.etas.split(",") if x.strip()]
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        parser.error("--etas and --seeds must be comma-separated ints")
    losses = [x.strip() for x in args.losses.split(",") if x.strip()]
    partials = [x.strip() for x in args.partial.split(",") if x.strip()]
    bad = [x for x in losses if x not in LOSSES] + [x for x in partials if x not in ("off", "on")]
    if bad or not (etas and losses and partials and seeds):
        parser.error(f"unknown or missing grid values {bad}: losses are {sorted(LOSSES)}")
    task = args.task.split()
    quick = ["rl.prompts_per_step=4", "rl.n=4", "task.warmup_steps=2", "eval_prompts=8"]
    configs = [
        (eta, loss, partial)
        for eta, loss, partial in itertools.product(etas, losses, partials)
        if not (eta == 0 and loss != losses[0])  # at η = 0 the losses coincide: run one
    ]
    runs: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    total = len(configs) * len(seeds)
    for k, (seed, (eta, loss, partial)) in enumerate(
        itertools.product(seeds, configs), 1
    ):  # seed-major: every configuration once before any twice (drift spreads evenly)
        sets = [
            *task, f"rl.steps={args.steps}", f"rl.staleness={eta}", *LOSSES[loss],
            f"rl.partial_rollout={'true' if partial == 'on' else 'false'}", f"seed={seed}",
            "checkpoint.every=0", *(quick if args.quick else []),
        ]  # fmt: skip
        got = one_run(sets)
        s = got["summary"]
        run = {
            "eta": eta, "loss": loss, "partial": partial, "seed": seed,
            "reward_last": s["reward_last"], "reward_first": s["reward_first"],
            "eval_reward": s["eval_reward"], "eval_exact": s["eval_exact"],
            "wall_s": s["wall_s"], "samples": s["samples"], "dropped": s["dropped"],
            "time_to_threshold_s": time_to(got["curve"], args.threshold),
            "staleness_hist": s["staleness_hist"], "curve": got["curve"],
        }  # fmt: skip
        runs.append(run)
        print(
            f"  [{k}/{total}] η={eta} {loss} partial={partial} seed={seed}: reward "
            f"{run['reward_last']:.3f}, eval {run['eval_reward']:.3f}, {run['wall_s']:.1f} s, "
            f"lags {s['staleness_hist']}",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    print(report(runs, configs, args.threshold))
    if args.save is not None:
        args.save.write_text(json.dumps({"task": task, "steps": args.steps, "runs": runs}))
    if args.plot is not None:
        plot(runs, configs, args.plot)
    figures = headline(runs)
    print(
        json.dumps(
            {
                "benchmark": "staleness_quality", **figures, "task": task, "steps": args.steps,
                "threshold": args.threshold, "real_s": round(time.perf_counter() - t_start, 1),
                "runs": [{k: v for k, v in r.items() if k != "curve"} for r in runs],
            }
        )
    )  # fmt: skip
    return 0


def _replay(path: Path, png: Path | None, threshold: float) -> int:
    """``--load``: the table, the plot and the headline of runs saved earlier."""
    try:
        text = path.read_text().strip()
        saved = json.loads(text.splitlines()[-1] if not text.startswith("{") else text)
        runs: list[dict[str, Any]] = saved["runs"]
    except (OSError, ValueError, KeyError, IndexError) as e:
        print(f"staleness_quality.py: --load {path}: not a saved run file ({e})", file=sys.stderr)
        return 2
    configs = list(dict.fromkeys((r["eta"], r["loss"], r["partial"]) for r in runs))
    print(report(runs, configs, threshold))
    if png is not None:
        plot(runs, configs, png)
    print(json.dumps({"benchmark": "staleness_quality", **headline(runs), "loaded": str(path)}))
    return 0


def _of(runs: Sequence[dict[str, Any]], eta: int, loss: str, partial: str) -> list[dict[str, Any]]:
    return [r for r in runs if (r["eta"], r["loss"], r["partial"]) == (eta, loss, partial)]


def report(
    runs: Sequence[dict[str, Any]], configs: Sequence[tuple[int, str, str]], th: float
) -> str:
    """The table: final reward and greedy eval per configuration, mean [min-max] over seeds;
    wall, time to the threshold, and the pooled staleness histogram."""
    lines = [
        f"{'η':>3} {'loss':<10} {'partial':<7} {'final reward':>22} {'greedy eval':>22} "
        f"{'wall s':>7} {f'to {th} s':>9} {'lag':>4}  lags (trained samples per version lag)"
    ]
    for eta, loss, partial in configs:
        mine = _of(runs, eta, loss, partial)
        if not mine:
            continue
        hist: dict[str, int] = {}
        for r in mine:
            for lag, n in r["staleness_hist"].items():
                hist[lag] = hist.get(lag, 0) + n
        reached = [r["time_to_threshold_s"] for r in mine if r["time_to_threshold_s"] is not None]
        to = f"{statistics.fmean(reached):.1f}" if len(reached) == len(mine) else (
            f"{len(reached)}/{len(mine)}"
        )  # fmt: skip
        lines.append(
            f"{eta:>3} {loss if eta else '(any)':<10} {partial:<7} "
            f"{span([r['reward_last'] for r in mine]):>22} "
            f"{span([r['eval_reward'] for r in mine]):>22} "
            f"{statistics.fmean(r['wall_s'] for r in mine):>7.1f} {to:>9} "
            f"{mean_lag(hist):>4.2f}  "
            + " ".join(f"{k}:{v}" for k, v in sorted(hist.items(), key=lambda kv: int(kv[0])))
        )
    return "\n".join(lines)


def mean_lag(hist: dict[str, int]) -> float:
    """The mean version lag of the trained samples of a staleness histogram."""
    n = sum(hist.values())
    return sum(int(lag) * k for lag, k in hist.items()) / n if n else 0.0


def headline(runs: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """The JSON's headline figures (partial rollout off), means over seeds."""

    def mean(key: str, eta: int, loss: str | None) -> float | None:
        xs = [r[key] for r in runs if r["eta"] == eta and r["partial"] == "off"
              and (loss is None or r["loss"] == loss)]  # fmt: skip
        return statistics.fmean(xs) if xs else None

    eta0_wall, eta4_wall = mean("wall_s", 0, None), mean("wall_s", 4, "decoupled")
    return {
        "reward_eta0": mean("reward_last", 0, None),
        "reward_eta4_naive": mean("reward_last", 4, "naive"),
        "reward_eta4_decoupled": mean("reward_last", 4, "decoupled"),
        "reward_eta4_tis": mean("reward_last", 4, "tis"),
        "speedup_eta4_vs_eta0": eta0_wall / eta4_wall if eta0_wall and eta4_wall else None,
    }


def plot(
    runs: Sequence[dict[str, Any]], configs: Sequence[tuple[int, str, str]], path: Path
) -> None:
    """Two figures. ``path``: reward (5-step moving mean, the mean over seeds step by step)
    against the run's wall seconds, one panel per η > 0 with a line per loss and partial
    setting, and η = 0 in grey in every panel. ``<path stem>-by-eta.png``: the final reward
    (mean over seeds, min-max bars) against η, a line per loss, partial rollout off and on
    side by side. Runs loaded without curves (``--load`` of an older file) give the second
    figure only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    etas = sorted({e for e, _, _ in configs if e > 0})
    colors = {"naive": "tab:red", "decoupled": "tab:blue", "tis": "tab:green"}
    if etas and all("curve" in r for r in runs):
        fig, axes = plt.subplots(
            1, len(etas), figsize=(4.2 * len(etas), 4.2), sharey=True, squeeze=False
        )
        for ax, eta in zip(axes[0], etas, strict=True):
            for e, loss, partial in configs:
                if e not in (0, eta):
                    continue
                xy = _mean_curve(_of(runs, e, loss, partial))
                if xy is None:
                    continue
                style = "--" if partial == "on" else "-"
                if e == 0:
                    label, color = f"η=0{' partial' if partial == 'on' else ''}", "grey"
                else:
                    label = f"{loss}{' partial' if partial == 'on' else ''}"
                    color = colors.get(loss, "black")
                ax.plot(*xy, style, color=color, label=label, linewidth=1.3)
            ax.set_title(f"η = {eta}")
            ax.set_xlabel("wall s of the RL phase")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        axes[0][0].set_ylabel("reward (5-step moving mean, mean over seeds)")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
    partials = [p for p in ("off", "on") if any(c[2] == p for c in configs)]
    fig, axes = plt.subplots(1, len(partials), figsize=(5.5 * len(partials), 4.2),
                             sharey=True, squeeze=False)  # fmt: skip
    for ax, partial in zip(axes[0], partials, strict=True):
        for loss in dict.fromkeys(loss for _, loss, _ in configs):
            xs, ys, lo, hi = [], [], [], []
            for eta in sorted({e for e, _, _ in configs}):
                mine = _of(runs, eta, loss, partial) or (
                    _of(runs, 0, _first_loss(configs), partial) if eta == 0 else []
                )
                if not mine:
                    continue
                finals = [r["reward_last"] for r in mine]
                xs.append(eta)
                ys.append(statistics.fmean(finals))
                lo.append(ys[-1] - min(finals))
                hi.append(max(finals) - ys[-1])
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=loss,
                            color=colors.get(loss, "black"))  # fmt: skip
        ax.set_title(f"partial rollout {partial}")
        ax.set_xlabel("η (rl.staleness)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("final reward (mean, min-max over seeds)")
    fig.tight_layout()
    fig.savefig(path.with_name(f"{path.stem}-by-eta.png"), dpi=100)
    plt.close(fig)


def _first_loss(configs: Sequence[tuple[int, str, str]]) -> str:
    return next((loss for e, loss, _ in configs if e == 0), "naive")


def _mean_curve(mine: Sequence[dict[str, Any]]) -> tuple[list[float], list[float]] | None:
    """The seeds' curves averaged step by step, then a 5-step moving mean of the reward."""
    if not mine:
        return None
    n = min(len(r["curve"]) for r in mine)
    t = [statistics.fmean(r["curve"][i][0] for r in mine) for i in range(n)]
    y = [statistics.fmean(r["curve"][i][1] for r in mine) for i in range(n)]
    return t, [statistics.fmean(y[max(0, i - 4) : i + 1]) for i in range(n)]


if __name__ == "__main__":
    raise SystemExit(main())
