"""Pipeline benchmark: the same simulated RL workload run colocated-sync (the baseline: rollout
and training take turns on all devices) and asynchronous (η = 1, staged weight sync, rollout
and training on their own devices), in one run, on the real store / samplers / workflow with
simulated engines on a virtual clock (see asyncflow_reference.sim for every cost constant).

Prints, for the headline preset: both runs, the throughput ratio (``speedup``), the ideal
overlap bound from the same cost model (``ideal_speedup``: colocated step time over the
bubble-free async step of the same split) and the fraction of it reached; a staleness sweep
(where the time goes when η is small); and the weak-scaling table 32 -> 1024 devices for the
7B and 32B presets next to the paper's published aggregates (1.59x average, 2.03x peak; the
paper's per-scale figures are not in our sources). The last stdout line is one JSON object.

    python benchmarks/pipeline.py                  # full: headline, sweep, scaling table
    python benchmarks/pipeline.py --quick          # headline on fewer steps, no table
    python benchmarks/pipeline.py --only 7B:1024   # one table row (colocated and async)
    python benchmarks/pipeline.py --only 7B:1024:async,32B:64   # its async run; another row
    python benchmarks/pipeline.py --ray            # and the async runs on the Ray runtime
    python benchmarks/pipeline.py --only 7B:1024:ray  # one async run on the Ray runtime

``--ray`` adds, for every row of the scaling table, the async run on the Ray runtime: every
engine behind the actor-call costs measured on the dev box (``RayCosts``, from
``benchmarks/ray_calls.py``; the driver's CPU queued across all engines), and a table of Ray
vs local async samples/s and the driver's busy fraction (JSON ``ray_scaling``).

The JSON line also says how long the simulation took in real seconds: ``real_s`` (the whole
benchmark) and ``sim_1024_real_s`` (the 1024-device 7B async run of the table, the largest:
~98 K samples; null when the table does not include it); ``sim_1024_cpu_s`` is that run's CPU
seconds (``time.process_time``), the figure to compare on a loaded machine. Every run's row
carries ``cpu_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "reference")]

from asyncflow_reference.presets import SimPreset, get_preset  # noqa: E402
from asyncflow_reference.simulate import (  # noqa: E402
    format_rows,
    run_row,
    simulate,
    with_steps,
)

from asyncflow_core.contracts.errors import ConfigError  # noqa: E402

PAPER = {"average_speedup": 1.59, "peak_speedup": 2.03, "devices": "32-1024"}
TARGET_SPEEDUP = 1.59
TARGET_EFFICIENCY = 0.95


def _job(spec: tuple[str, int | None, int | None, str, int]) -> tuple[Any, ...]:
    """One simulated run (in a worker process): (preset, devices, steps, mode, η)."""
    mode, eta = spec[3], spec[4]
    preset = _preset(spec)
    cpu_start = time.process_time()
    if mode == "ray":  # the async run on the Ray runtime's measured call costs
        run = simulate(preset, "async", staleness=eta, weight_sync="staged", runtime="ray")
    else:
        run = simulate(preset, mode, staleness=eta, weight_sync="staged")  # type: ignore[arg-type]
    row = run_row(run)  # plain data: a run itself holds locks and loops, it does not pickle
    row["cpu_s"] = round(time.process_time() - cpu_start, 1)
    row["ideal_step_s"] = preset.ideal().step_s
    row["samples_per_step"] = preset.samples_per_step
    return spec, row


def _preset(spec: tuple[str, int | None, int | None, str, int]) -> SimPreset:
    name, devices, steps, _, _ = spec
    preset = get_preset(name)
    if devices is not None and devices != preset.devices:
        preset = preset.scaled(devices)
    return preset if steps is None else with_steps(preset, steps)


def _samples_simulated(spec: tuple[str, int | None, int | None, str, int]) -> int:
    preset = _preset(spec)
    return preset.samples_per_step * preset.steps


def _compare(colocated: dict[str, Any], asynchronous: dict[str, Any]) -> dict[str, float]:
    speedup = asynchronous["samples_per_s"] / colocated["samples_per_s"]
    ideal = colocated["step_s"] / asynchronous["ideal_step_s"]
    return {"speedup": speedup, "ideal_speedup": ideal, "efficiency": speedup / ideal}


MODEL_ALIASES = {"7b": "qwen2.5-7b-grpo", "32b": "qwen2.5-32b-grpo"}


def parse_only(text: str) -> list[tuple[str, int | None, int | None, str, int]]:
    """``--only``: comma-separated ``MODEL:DEVICES[:MODE]`` (MODEL a preset name, or 7B / 32B;
    MODE colocated, async or ray (async on the Ray runtime), default colocated and async) as
    job specs of the scaling table's runs."""
    specs: list[tuple[str, int | None, int | None, str, int]] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"--only item {item!r} is not MODEL:DEVICES[:MODE]")
        model = MODEL_ALIASES.get(parts[0].lower(), parts[0])
        get_preset(model)  # an unknown preset raises ConfigError naming the known ones
        try:
            devices = int(parts[1])
        except ValueError:
            raise ValueError(f"--only item {item!r}: DEVICES must be an int") from None
        modes = ["colocated", "async"] if len(parts) == 2 else [parts[2]]
        for mode in modes:
            if mode not in ("colocated", "async", "ray"):
                raise ValueError(f"--only item {item!r}: MODE must be colocated, async or ray")
            specs.append((model, devices, None, mode, 0 if mode == "colocated" else 1))
    if not specs:
        raise ValueError("--only names no run")
    return specs


def _run_specs(
    specs: list[tuple[str, int | None, int | None, str, int]], workers: int
) -> dict[tuple[str, int | None, int | None, str, int], dict[str, Any]]:
    done: dict[tuple[str, int | None, int | None, str, int], dict[str, Any]] = {}
    # longest first (real time grows with the samples simulated), so the workers finish together
    specs = sorted(specs, key=_samples_simulated, reverse=True)
    with ProcessPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(_job, spec) for spec in specs]
        for i, future in enumerate(as_completed(futures), 1):
            spec, row = future.result()
            done[spec] = row
            print(
                f"  [{i}/{len(specs)}] {spec[0]} devices={spec[1] or 'preset'} {spec[3]} "
                f"η={spec[4]}: {row['step_s']:.1f} s/step, {row['real_s']:.0f} s real, "
                f"{row['cpu_s']:.0f} s CPU",
                file=sys.stderr, flush=True,
            )  # fmt: skip
    return done


def main_only(text: str, workers: int) -> int:
    """``--only``: just the named runs; their rows and one JSON line (``rows``, ``real_s``)."""
    t_start = time.perf_counter()
    try:
        specs = parse_only(text)
    except (ValueError, ConfigError) as e:
        print(f"pipeline.py: {e}", file=sys.stderr)
        return 2
    done = _run_specs(specs, workers)
    rows = [{"model": spec[0], **done[spec]} for spec in specs]
    for model in dict.fromkeys(r["model"] for r in rows):
        print(f"== {model} (virtual time; throughput after step 1) ==")
        print(format_rows([r for r in rows if r["model"] == model]))
    real_s = time.perf_counter() - t_start
    print(json.dumps({"benchmark": "pipeline", "only": text, "real_s": round(real_s, 1),
                      "rows": rows}))  # fmt: skip
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-7b-grpo")
    parser.add_argument("--quick", action="store_true", help="headline only, 3 steps")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--scales", default="32,64,128,256,512,1024",
        help="device counts of the weak-scaling table, comma-separated ('' for none)",
    )  # fmt: skip
    parser.add_argument(
        "--only", default=None, metavar="MODEL:DEVICES[:MODE],...",
        help="run only these table rows (MODEL: a preset, 7B or 32B; MODE: colocated, async or "
        "ray, default colocated and async) and print their rows and a JSON line with them",
    )  # fmt: skip
    parser.add_argument(
        "--ray", action="store_true",
        help="also run every scaling-table row's async job on the Ray runtime's measured costs",
    )  # fmt: skip
    args = parser.parse_args()
    if args.only is not None:
        return main_only(args.only, args.workers)
    t_start = time.perf_counter()

    steps = 3 if args.quick else None
    specs: list[tuple[str, int | None, int | None, str, int]] = [
        (args.preset, None, steps, "colocated", 0),
        (args.preset, None, steps, "async", 1),
    ]
    sweep = [] if args.quick else [2, 4]
    specs += [(args.preset, None, steps, "async", eta) for eta in sweep]
    try:
        scales = [int(x) for x in args.scales.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--scales must be comma-separated device counts, got {args.scales!r}")
    scales = [] if args.quick else scales
    models = ["qwen2.5-7b-grpo", "qwen2.5-32b-grpo"]
    for model in models:
        for d in scales:
            if model == args.preset and d == get_preset(model).devices:
                continue  # the headline runs already cover it
            specs += [(model, d, None, "colocated", 0), (model, d, None, "async", 1)]

    def key(model: str, d: int) -> tuple[int | None, int | None]:
        """A table row's (devices, steps) in the specs: the headline run stands for its row."""
        head_run = model == args.preset and d == get_preset(model).devices
        return (None, steps) if head_run else (d, None)

    if args.ray:
        specs += [(model, *key(model, d), "ray", 1) for model in models for d in scales]

    done = _run_specs(specs, args.workers)

    preset = get_preset(args.preset)
    if steps is not None:
        preset = with_steps(preset, steps)
    colocated = done[(args.preset, None, steps, "colocated", 0)]
    asynchronous = done[(args.preset, None, steps, "async", 1)]
    head = _compare(colocated, asynchronous)
    print(
        f"== {preset.name}: {preset.cost.model}, {preset.devices} devices, "
        f"{preset.samples_per_step} samples/step, {preset.steps} steps (virtual time; "
        "throughput after step 1) =="
    )
    print(format_rows([colocated, asynchronous]))
    print(
        f"speedup {head['speedup']:.2f}x (target >= {TARGET_SPEEDUP}); ideal overlap bound "
        f"{head['ideal_speedup']:.2f}x (bubble-free async step {asynchronous['ideal_step_s']:.1f}"
        f" s vs measured {asynchronous['step_s']:.1f} s); reached {head['efficiency']:.0%} of "
        f"the bound (target >= {TARGET_EFFICIENCY:.0%})"
    )

    sweep_rows = []
    if sweep:
        print("\n== staleness sweep (async, staged sync): the bound is the same for every η ==")
        runs = [asynchronous] + [done[(args.preset, None, steps, "async", e)] for e in sweep]
        print(format_rows(runs))
        for eta, run in zip([1, *sweep], runs, strict=True):
            comp = _compare(colocated, run)
            print(f"η={eta}: speedup {comp['speedup']:.2f}x, {comp['efficiency']:.0%} of the bound")
            sweep_rows.append({"staleness": eta, **comp})

    table = []
    if scales:
        print("\n== weak scaling (samples per device fixed), async η=1 staged vs colocated ==")
        print(f"{'model':<18} {'devices':>8} {'split r/t':>10} {'coloc s/step':>13} "
              f"{'async s/step':>13} {'speedup':>8} {'bound':>7} {'of bound':>9}")  # fmt: skip
        for model in models:
            for d in scales:
                c_row = done[(model, *key(model, d), "colocated", 0)]
                a_row = done[(model, *key(model, d), "async", 1)]
                comp = _compare(c_row, a_row)
                split = f"{a_row['rollout_devices']}/{a_row['train_devices']}"
                print(
                    f"{model:<18} {d:>8} {split:>10} {c_row['step_s']:>13.1f} "
                    f"{a_row['step_s']:>13.1f} {comp['speedup']:>7.2f}x "
                    f"{comp['ideal_speedup']:>6.2f}x {comp['efficiency']:>9.0%}"
                )
                table.append(
                    {"model": model, "devices": d, **comp, "real_s": round(a_row["real_s"], 1),
                     "colocated_real_s": round(c_row["real_s"], 1), "cpu_s": a_row["cpu_s"],
                     "colocated_cpu_s": c_row["cpu_s"]}
                )  # fmt: skip
        speedups = [r["speedup"] for r in table]
        print(
            f"simulated: average {sum(speedups) / len(speedups):.2f}x, peak {max(speedups):.2f}x;"
            f" paper (arXiv 2507.01663, Ascend, {PAPER['devices']} devices): average "
            f"{PAPER['average_speedup']}x, peak {PAPER['peak_speedup']}x"
        )

    ray_table = []
    if args.ray and scales:
        print("\n== the async runs on the Ray runtime (measured per-call costs) vs locally ==")
        print(f"{'model':<18} {'devices':>8} {'local s/s':>10} {'ray s/s':>10} {'ray/local':>10} "
              f"{'driver busy':>12} {'vs coloc':>9}")  # fmt: skip
        for model in models:
            for d in scales:
                a_row = done[(model, *key(model, d), "async", 1)]
                r_row = done[(model, *key(model, d), "ray", 1)]
                c_row = done[(model, *key(model, d), "colocated", 0)]
                ratio = r_row["samples_per_s"] / a_row["samples_per_s"]
                vs_coloc = r_row["samples_per_s"] / c_row["samples_per_s"]
                print(
                    f"{model:<18} {d:>8} {a_row['samples_per_s']:>10.2f} "
                    f"{r_row['samples_per_s']:>10.2f} {ratio:>9.3f}x "
                    f"{r_row['driver_busy']:>11.1%} {vs_coloc:>8.2f}x"
                )
                ray_table.append(
                    {"model": model, "devices": d, "ray_vs_local": ratio,
                     "ray_vs_colocated": vs_coloc, "driver_busy": r_row["driver_busy"],
                     "real_s": round(r_row["real_s"], 1)}
                )  # fmt: skip
    largest = next(
        (r for r in table if r["model"] == "qwen2.5-7b-grpo" and r["devices"] == 1024), None
    )
    real_s = time.perf_counter() - t_start
    print(f"real time: {real_s:.0f} s with {args.workers} worker process(es)", file=sys.stderr)
    print(
        json.dumps(
            {
                "benchmark": "pipeline",
                "real_s": round(real_s, 1),
                "sim_1024_real_s": None if largest is None else largest["real_s"],
                "sim_1024_cpu_s": None if largest is None else largest["cpu_s"],
                "preset": preset.name,
                "speedup": round(head["speedup"], 4),
                "ideal_speedup": round(head["ideal_speedup"], 4),
                "efficiency": round(head["efficiency"], 4),
                "targets": {"speedup": TARGET_SPEEDUP, "efficiency": TARGET_EFFICIENCY},
                "colocated": colocated,
                "async": asynchronous,
                "staleness_sweep": sweep_rows,
                "scaling": table,
                "ray_scaling": ray_table,
                "paper": PAPER,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
