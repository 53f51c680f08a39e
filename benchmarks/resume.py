"""Does a killed and resumed run learn like one that was never interrupted?

Runs the main job (``asyncflow run``, default config unless ``--set``) twice from the same
seed, in subprocesses:

* **uninterrupted**: one run to the end;
* **killed twice**: SIGKILL after optimizer step ``--kill-at`` (the ``update.step`` failpoint),
  ``asyncflow run --resume``, SIGKILL again inside the weight sync after step
  ``--kill-again-at`` (``sync.transfer``), resume again to the end.

Prints a table (reward over the first and last 10% of steps, greedy eval, RL wall seconds,
wall seconds in all with the restarts, steps trained twice in wall time because they came
after the last checkpoint before a kill) and, as its last line, a JSON object. ``--plot
PNG`` draws both reward curves with the kill and resume points. An async run cannot replay
thread timing, so the two curves are not equal sample for sample; what must hold is the
invariant (every step once, versions continuous, no prompt group trained twice) and a curve
that goes on from where it was rather than starting over.

    python benchmarks/resume.py --plot docs/img/resume.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncflow_core.flow.rlflow import JobState
from asyncflow_core.infra.checkpoint import Checkpoints

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], failpoint: str | None = None) -> tuple[int, float]:
    env = dict(os.environ)
    env.pop("ASYNCFLOW_FAILPOINTS", None)
    if failpoint:
        env["ASYNCFLOW_FAILPOINTS"] = failpoint
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "asyncflow_core.cli", "run", "--quiet", *args],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode not in (0, -9):
        sys.exit(f"asyncflow run {' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
    return done.returncode, time.perf_counter() - t0


def _rewards(run: Path) -> list[float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [float(json.loads(x)["reward_mean"]) for x in lines]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--kill-at", type=int, default=45)
    p.add_argument("--kill-again-at", type=int, default=83)
    p.add_argument("--plot", default=None, metavar="PNG")
    p.add_argument("--out", default=None, metavar="DIR", help="keep the run folders here")
    a = p.parse_args()
    sets = [x for s in a.set for x in ("--set", s)]
    base = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="asyncflow-resume-"))
    full, killed = base / "uninterrupted", base / "killed"

    _, full_s = _run(["--out", str(full), *sets])
    code1, s1 = _run(["--out", str(killed), *sets], f"update.step={a.kill_at}")
    ckpts = Checkpoints(killed / "checkpoints")
    latest = ckpts.latest()
    resumed_1 = JobState.read(latest).version if latest is not None else 0
    # the second kill is counted in the resumed run's syncs: after step kill-again-at overall
    code2, s2 = _run(["--resume", str(killed)], f"sync.transfer={a.kill_again_at - resumed_1}")
    latest = ckpts.latest()
    resumed_2 = JobState.read(latest).version if latest is not None else 0
    code3, s3 = _run(["--resume", str(killed)])

    f_sum = json.loads((full / "summary.json").read_text())
    k_sum = json.loads((killed / "summary.json").read_text())
    redone = (a.kill_at - resumed_1) + (a.kill_again_at - resumed_2)
    rows: list[tuple[str, Any, Any]] = [
        ("runs (exit codes)", "1 (0)", f"3 ({code1}, {code2}, {code3})"),
        ("resumed at step", "-", ", ".join(map(str, k_sum["extra"]["resumed_at"]))),
        ("steps / samples", f"{f_sum['steps']} / {f_sum['samples']}",
         f"{k_sum['steps']} / {k_sum['samples']}"),
        ("reward first 10%", f"{f_sum['reward_first']:.3f}", f"{k_sum['reward_first']:.3f}"),
        ("reward last 10%", f"{f_sum['reward_last']:.3f}", f"{k_sum['reward_last']:.3f}"),
        ("greedy eval", f"{f_sum['eval_reward']:.3f}", f"{k_sum['eval_reward']:.3f}"),
        ("RL wall (s)", f"{f_sum['wall_s']:.1f}", f"{k_sum['wall_s']:.1f}"),
        ("wall in all, restarts too (s)", f"{full_s:.1f}", f"{s1 + s2 + s3:.1f}"),
        ("steps lost to the kills", 0, redone),
    ]  # fmt: skip
    width = max(len(r[0]) for r in rows)
    print(f"{'':<{width}}  {'uninterrupted':>14}  {'killed twice':>14}")
    for name, x, y in rows:
        print(f"{name:<{width}}  {x!s:>14}  {y!s:>14}")
    print(f"(run folders in {base})")
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        r_full, r_killed = _rewards(full), _rewards(killed)
        ax.plot(range(1, len(r_full) + 1), r_full, lw=1.2, label="uninterrupted")
        ax.plot(range(1, len(r_killed) + 1), r_killed, lw=1.2, label="killed twice, resumed")
        for kill, resume in ((a.kill_at, resumed_1), (a.kill_again_at, resumed_2)):
            ax.axvline(kill, color="tab:red", lw=0.8, ls="--")
            ax.axvline(resume, color="tab:green", lw=0.8, ls=":")
        ax.set_xlabel("optimizer step (red: SIGKILL, green: checkpoint resumed from)")
        ax.set_ylabel("mean reward")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(a.plot, dpi=110)
        print(f"plot: {a.plot}")
    print(
        json.dumps(
            {
                "reward_last_uninterrupted": f_sum["reward_last"],
                "reward_last_resumed": k_sum["reward_last"],
                "eval_uninterrupted": f_sum["eval_reward"],
                "eval_resumed": k_sum["eval_reward"],
                "steps_uninterrupted": f_sum["steps"],
                "steps_resumed": k_sum["steps"],
                "resumed_at": k_sum["extra"]["resumed_at"],
                "steps_lost": redone,
                "wall_all_ratio": (s1 + s2 + s3) / full_s,
            }
        )
    )


if __name__ == "__main__":
    main()
