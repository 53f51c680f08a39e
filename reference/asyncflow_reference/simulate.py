"""Cluster simulation: the real ``RLJob`` pipeline (store, samplers, admission control, weight
sync strategies, tracing) driving simulated engines on a virtual clock.

``simulate(preset, mode)`` runs one job: ``"colocated"`` puts rollout and training on all of
the preset's devices in turn (η = 0, blocking sync, engines sleep while the trainer runs);
``"async"`` gives rollout and training their own devices (the preset's split) with staleness
η, a weight-sync strategy and optional partial rollout. ``compare(preset)`` runs both and
sets their throughput ratio next to the ideal overlap bound from the same cost model.

``runtime="ray"`` runs the same job as ``asyncflow run --runtime ray`` would: every engine
behind an actor call whose costs were measured on the dev box (``RayCosts``,
``benchmarks/ray_calls.py``): each request's result arrives after the call's latency and
after its share of the driver's CPU, which every call of the job queues for (one driver
process, however many engines); each batch is shipped to the trainer's actor; each control
call adds its round trip. ``SimRun.driver_busy_s`` is the driver CPU charged.

Throughput is the steady state: samples trained after the first optimizer step (pipeline
fill) divided by the time from the first step's end to the last's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from asyncflow_core.contracts.errors import ConfigError
from asyncflow_core.contracts.protocols import SamplingParams, SupportsLoadWeights, WeightSync
from asyncflow_core.flow.rlflow import RLConfig, RLEngines, RLJob, RLResult, SyncStrategy
from asyncflow_core.flow.vclock import run_virtual
from asyncflow_core.observability.trace import Tracer
from asyncflow_core.sync.transports import InProcessWeightSync
from asyncflow_reference.presets import SimPreset
from asyncflow_reference.sim import (
    RayCosts,
    RaySimInferenceEngine,
    RaySimTrainEngine,
    SimInferenceEngine,
    SimTrainEngine,
    SimWeightTransport,
    VirtualDriver,
)

SimMode = Literal["colocated", "async"]

_GC_GEN0 = 50_000  # allocations between young collections during a run (default 700)
_GC_GEN2 = 50  # middle-generation collections between full ones during a run (default 10)


@dataclass(frozen=True, slots=True)
class SimRun:
    """One simulated job: its preset, mode, the ``RLResult`` (virtual seconds), the engines'
    counters and the real seconds the simulation took."""

    preset: SimPreset
    mode: SimMode
    result: RLResult
    real_s: float
    rollout_busy_s: float
    rollout_devices: int
    train_devices: int
    runtime: Literal["local", "ray"] = "local"
    driver_busy_s: float = 0.0

    @property
    def samples_per_s(self) -> float:
        return self.result.steady_samples_per_s

    @property
    def tokens_per_s(self) -> float:
        return self.result.steady_tokens_per_s

    @property
    def step_s(self) -> float:
        """Mean seconds per optimizer step in the steady state (after the first step)."""
        steps = self.result.steps
        if len(steps) < 2:
            return self.result.wall_s / max(len(steps), 1)
        return (steps[-1].end_s - steps[0].end_s) / (len(steps) - 1)

    def summary(self) -> dict[str, Any]:
        """The trace summary (``Tracer.summary``), or {} when it ran untraced."""
        return self.result.tracer.summary() if self.result.tracer is not None else {}


@dataclass(frozen=True, slots=True)
class Comparison:
    """Colocated vs async on one preset. ``speedup``: async / colocated steady throughput.
    ``ideal_speedup``: the colocated step time over the bubble-free async step of the same
    cost model and split (``SimPreset.ideal``), i.e. what perfect overlap would give.
    ``efficiency`` = speedup / ideal_speedup."""

    preset: SimPreset
    colocated: SimRun
    asynchronous: SimRun

    @property
    def speedup(self) -> float:
        return self.asynchronous.samples_per_s / self.colocated.samples_per_s

    @property
    def ideal_step_s(self) -> float:
        return self.preset.ideal().step_s

    @property
    def ideal_speedup(self) -> float:
        return self.colocated.step_s / self.ideal_step_s

    @property
    def efficiency(self) -> float:
        return self.speedup / self.ideal_speedup


def _prompts(tokens: int) -> Iterator[list[int]]:
    i = 0
    while True:
        i += 1
        yield [(i * 7919 + j) % 32000 for j in range(tokens)]


def _reward(prompt: Sequence[int], response: Sequence[int]) -> float:
    """A stand-in verifier: the simulated responses carry no meaning."""
    return float(len(response) % 2)


def simulate(
    preset: SimPreset,
    mode: SimMode = "async",
    *,
    staleness: int = 1,
    weight_sync: SyncStrategy = "staged",
    partial_rollout: bool = False,
    sync_every: int = 1,
    steps: int | None = None,
    trace: bool = True,
    seed: int = 0,
    runtime: Literal["local", "ray"] = "local",
    ray_costs: RayCosts | None = None,
) -> SimRun:
    """Run ``preset`` as one RL job on simulated engines (see the module docstring);
    ``runtime="ray"`` puts every engine behind the Ray runtime's measured call costs
    (``ray_costs``, default ``RayCosts.load()``)."""
    if mode not in ("colocated", "async"):
        raise ConfigError(f"mode must be 'colocated' or 'async', got {mode!r}")
    if runtime not in ("local", "ray"):
        raise ConfigError(f"runtime must be 'local' or 'ray', got {runtime!r}")
    cost = preset.cost
    colocated = mode == "colocated"
    rollout_devices = preset.devices if colocated else preset.rollout_devices
    train_devices = preset.devices if colocated else preset.train_devices
    instances = rollout_devices // cost.tp
    sampling = SamplingParams(max_tokens=cost.response_max_tokens)
    if colocated:
        config = RLConfig(
            steps=steps or preset.steps, prompts_per_step=preset.prompts_per_step, n=preset.n,
            staleness=0, weight_sync="blocking", mode="colocated", sampling=sampling,
            partition=f"sim-{preset.name}-colocated", reward_in_thread=False,
        )  # fmt: skip
    else:
        config = RLConfig(
            steps=steps or preset.steps, prompts_per_step=preset.prompts_per_step, n=preset.n,
            staleness=staleness, weight_sync=weight_sync, partial_rollout=partial_rollout,
            sync_every=sync_every, mode="async", sampling=sampling,
            partition=f"sim-{preset.name}-async", reward_in_thread=False,
        )  # fmt: skip
    config.validate()
    sims = [
        SimInferenceEngine(cost, name=f"rollout-{i}", seed=seed * 100_003 + i)
        for i in range(instances)
    ]
    engines: list[Any] = list(sims)
    trainer: Any = SimTrainEngine(cost, train_devices)
    driver = VirtualDriver()
    if runtime == "ray":
        costs = RayCosts.load() if ray_costs is None else ray_costs
        engines = [RaySimInferenceEngine(e, costs, driver, group=preset.n) for e in sims]
        trainer = RaySimTrainEngine(trainer, costs, driver)

    def make_transport(targets: Sequence[SupportsLoadWeights]) -> WeightSync:
        # colocated: the weights are already on the devices (resharding is in the switch
        # cost), so the sync is the engines' load; separate pools move them over the network
        if colocated:
            return InProcessWeightSync(targets)
        return SimWeightTransport(targets, cost)

    async def main() -> RLResult:
        tracer = Tracer(clock=asyncio.get_running_loop().time) if trace else None
        job = RLJob(
            config, RLEngines(engines, trainer, make_transport=make_transport),
            _prompts(cost.prompt_tokens), _reward, tracer=tracer,
        )  # fmt: skip
        try:
            return await job.run()
        finally:
            for e in engines:
                await e.close()

    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    # The run allocates millions of short-lived objects over a heap of live rows, tags and
    # futures: at the default thresholds the collector (mostly full collections, which walk
    # that heap) took ~10% of a 256-device 7B run (5.7 s of 55 s CPU), ~2.3 s with these.
    # Collect far less often while it runs; nothing it simulates depends on when.
    thresholds = gc.get_threshold()
    gc.set_threshold(_GC_GEN0, thresholds[1], _GC_GEN2)
    try:
        result = run_virtual(main())
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
    return SimRun(
        preset, mode, result, time.perf_counter() - t0, sum(e.busy_s for e in sims),
        rollout_devices, train_devices, runtime, driver.busy_s,
    )  # fmt: skip


def compare(preset: SimPreset, **async_knobs: Any) -> Comparison:
    """Colocated and async (default η = 1, staged sync) runs of ``preset``."""
    knobs = {"staleness": 1, "weight_sync": "staged", **async_knobs}
    colocated = simulate(preset, "colocated", trace=knobs.get("trace", True))
    asynchronous = simulate(preset, "async", **knobs)
    return Comparison(preset, colocated, asynchronous)


def with_steps(preset: SimPreset, steps: int) -> SimPreset:
    return dataclasses.replace(preset, steps=steps, max_steps=steps)


__all__ = [
    "Comparison",
    "SimMode",
    "SimRun",
    "cli_simulate",
    "command",
    "compare",
    "format_rows",
    "run_row",
    "simulate",
    "with_steps",
]


# --------------------------------------------------------------------------------------------
# reporting and the `asyncflow simulate` command
# --------------------------------------------------------------------------------------------
def run_row(run: SimRun) -> dict[str, Any]:
    """The figures of one run, JSON-able."""
    summary = run.summary()
    resources = summary.get("resources", {})
    return {
        "mode": run.mode,
        "runtime": run.runtime,
        "driver_busy": run.driver_busy_s / run.result.wall_s if run.result.wall_s else 0.0,
        "staleness": run.result.config.staleness,
        "devices": run.preset.devices,
        "rollout_devices": run.rollout_devices,
        "train_devices": run.train_devices,
        "steps": len(run.result.steps),
        "step_s": run.step_s,
        "samples_per_s": run.samples_per_s,
        "tokens_per_s": run.tokens_per_s,
        "dropped": run.result.dropped,
        "generated": run.result.generated,
        "max_staleness": run.result.max_staleness,
        "bubble": {
            name: round(r["bubble_ratio"], 4)
            for name, r in resources.items()
            if name in ("devices", "rollout", "trainer")
        },
        "sync_exposed_s": summary.get("sync", {}).get("exposed_s"),
        "sync_hidden_s": summary.get("sync", {}).get("hidden_s"),
        "real_s": run.real_s,
    }


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    """A fixed-width table of ``run_row`` dicts."""
    header = (
        f"{'mode':<10} {'η':>2} {'devices':>8} {'split r/t':>10} {'step s':>8} {'samples/s':>10} "
        f"{'tokens/s':>10} {'bubble':>26} {'dropped':>8} {'real s':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        bubble = " ".join(f"{k}={v:.2f}" for k, v in r["bubble"].items())
        split = f"{r['rollout_devices']}/{r['train_devices']}"
        lines.append(
            f"{r['mode']:<10} {r['staleness']:>2} {r['devices']:>8} {split:>10} "
            f"{r['step_s']:>8.1f} {r['samples_per_s']:>10.2f} {r['tokens_per_s']:>10.0f} "
            f"{bubble:>26} {r['dropped']:>8} {r['real_s']:>7.1f}"
        )
    return "\n".join(lines)


def command(subparsers: Any) -> Callable[[Any], int]:
    """``asyncflow simulate`` (the ``asyncflow.commands`` entry point): add its parser to the
    CLI's ``subparsers``, return its handler."""
    sim = subparsers.add_parser(
        "simulate",
        help="run the RL pipeline on simulated engines (virtual clock): colocated vs async",
    )
    sim.add_argument("--preset", default=None, help="a preset name (see --list)")
    sim.add_argument("--list", action="store_true", help="list the presets and exit")
    sim.add_argument("--devices", type=int, default=None, help="weak-scale to this many devices")
    sim.add_argument("--mode", choices=("both", "async", "colocated"), default="both")
    sim.add_argument("--staleness", type=int, default=1, help="η of the async run")
    sim.add_argument("--weight-sync", choices=("staged", "blocking", "inflight"), default="staged")
    sim.add_argument("--partial-rollout", action="store_true")
    sim.add_argument("--sync-every", type=int, default=1)
    sim.add_argument("--steps", type=int, default=None, help="optimizer steps (default: preset)")
    sim.add_argument(
        "--trace-dir", default=None, help="write each run's Chrome trace, metrics.jsonl (+ PNG)"
    )
    sim.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return cli_simulate


def cli_simulate(args: Any) -> int:
    """``asyncflow simulate``: exit 2 with a message on a bad preset or knob."""
    import json
    import sys
    from pathlib import Path

    from asyncflow_reference.presets import PRESETS, get_preset

    if args.list or args.preset is None:
        for name, p in PRESETS.items():
            print(f"{name:<22} {p.devices} devices, {p.samples_per_step} samples/step, "
                  f"{p.steps} steps: {p.description}")  # fmt: skip
        if args.preset is None and not args.list:
            print("asyncflow simulate: pass --preset NAME", file=sys.stderr)
            return 2
        return 0
    try:
        preset = get_preset(args.preset)
        if args.devices is not None and args.devices != preset.devices:
            preset = preset.scaled(args.devices)
        if args.steps is not None:
            preset = with_steps(preset, args.steps)
        runs: list[SimRun] = []
        if args.mode in ("both", "colocated"):
            runs.append(simulate(preset, "colocated"))
        if args.mode in ("both", "async"):
            runs.append(
                simulate(
                    preset, "async", staleness=args.staleness, weight_sync=args.weight_sync,
                    partial_rollout=args.partial_rollout, sync_every=args.sync_every,
                )
            )  # fmt: skip
    except ConfigError as e:
        print(f"asyncflow simulate: {e}", file=sys.stderr)
        return 2
    if args.trace_dir:
        out = Path(args.trace_dir)
        out.mkdir(parents=True, exist_ok=True)
        for run in runs:
            tracer = run.result.tracer
            if tracer is None:
                continue
            stem = f"{preset.name.replace('@', '-')}-{run.mode}"
            tracer.write_chrome_trace(out / f"{stem}.trace.json")
            tracer.write_metrics_jsonl(out / f"{stem}.metrics.jsonl")
            try:
                tracer.plot_timeline(out / f"{stem}.png", title=f"{preset.name} {run.mode}")
            except Exception as e:  # the plot extra is optional
                print(f"(no PNG: {e})", file=sys.stderr)
        print(f"traces written to {out}/", file=sys.stderr)
    result: dict[str, Any] = {"preset": preset.name, "runs": [run_row(r) for r in runs]}
    if len(runs) == 2:
        c = Comparison(preset, runs[0], runs[1])
        result.update(
            speedup=c.speedup, ideal_speedup=c.ideal_speedup, efficiency=c.efficiency,
            ideal_step_s=c.ideal_step_s,
        )  # fmt: skip
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"preset {preset.name}: {preset.cost.model}, {preset.devices} devices, "
        f"{preset.samples_per_step} samples/step ({preset.prompts_per_step} prompts x "
        f"{preset.n}), {preset.steps} steps; virtual time, steady state after step 1"
    )
    print(format_rows([run_row(r) for r in runs]))
    if len(runs) == 2:
        print(
            f"speedup async/colocated {result['speedup']:.2f}x; ideal overlap bound "
            f"{result['ideal_speedup']:.2f}x (bubble-free async step {result['ideal_step_s']:.1f}"
            f" s); {result['efficiency']:.0%} of the bound"
        )
    return 0
