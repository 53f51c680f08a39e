"""Compose and run the RL step (prompts -> rollout -> reward -> advantage -> actor update) on
the streaming store, colocated vs asynchronous, and read the trace.

The engines here are the simulator's (a cost model on a virtual clock, so a cluster's hour
takes a second); any InferenceEngine / TrainEngine pair plugs into ``RLEngines`` the same way.

    python examples/rl_pipeline.py [OUT_DIR]    # writes traces (+ PNG timelines with matplotlib)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
from pathlib import Path

from asyncflow_reference.presets import get_preset
from asyncflow_reference.sim import SimInferenceEngine, SimTrainEngine, SimWeightTransport

from asyncflow_core import SamplingParams
from asyncflow_core.contracts.errors import MissingExtraError
from asyncflow_core.flow.rlflow import RLConfig, RLEngines, RLJob, RLResult
from asyncflow_core.flow.vclock import run_virtual
from asyncflow_core.observability.trace import Tracer, format_summary

# a small workload: Qwen2.5-7B costs, responses capped at 2k tokens, 8 devices
cost = dataclasses.replace(get_preset("qwen2.5-7b-grpo").cost, response_max_tokens=2048)


def reward(prompt: list[int], response: list[int]) -> float:
    return float(len(response) % 2)  # a stand-in verifier


async def run(mode: str) -> RLResult:
    colocated = mode == "colocated"
    config = RLConfig(
        steps=6,
        prompts_per_step=16,
        n=8,
        mode="colocated" if colocated else "async",
        staleness=0 if colocated else 2,  # η: rollout may run 2 versions ahead
        weight_sync="blocking" if colocated else "staged",  # staged = the delayed update
        sampling=SamplingParams(max_tokens=cost.response_max_tokens),
    )
    # colocated: rollout and training take turns on all 8 devices; async: 3 + 5
    rollout = [SimInferenceEngine(cost, name=f"r{i}", seed=i) for i in range(8 if colocated else 3)]
    trainer = SimTrainEngine(cost, devices=8 if colocated else 5)
    engines = RLEngines(rollout, trainer, make_transport=lambda t: SimWeightTransport(t, cost))
    prompts = ([1] * cost.prompt_tokens for _ in range(10_000))
    tracer = Tracer(clock=asyncio.get_running_loop().time)  # virtual seconds
    job = RLJob(config, engines, prompts, reward, tracer=tracer)
    result = await job.run()
    for e in rollout:
        await e.close()
    return result


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    results = {mode: run_virtual(run(mode)) for mode in ("colocated", "async")}
    for mode, r in results.items():
        print(
            f"{mode:>9}: {len(r.steps)} steps, {r.samples} samples, {r.wall_s:.0f} s simulated, "
            f"{r.steady_samples_per_s:.2f} samples/s after step 1, max staleness "
            f"{r.max_staleness}, {r.dropped} stale samples dropped"
        )
        assert r.max_staleness <= r.config.staleness
        if out is not None and r.tracer is not None:
            out.mkdir(parents=True, exist_ok=True)
            r.tracer.write_chrome_trace(out / f"{mode}.trace.json")  # open in Perfetto
            r.tracer.write_metrics_jsonl(out / f"{mode}.metrics.jsonl")
            with contextlib.suppress(MissingExtraError):  # the PNG needs the `plot` extra
                r.tracer.plot_timeline(out / f"{mode}.png", title=f"{mode} (simulated)")
    speedup = results["async"].steady_samples_per_s / results["colocated"].steady_samples_per_s
    print(f"async / colocated throughput: {speedup:.2f}x")
    tracer = results["async"].tracer
    assert tracer is not None
    print(format_summary(tracer.summary()))


if __name__ == "__main__":
    main()
