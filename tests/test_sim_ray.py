"""The simulator's Ray runtime (issue #24): the real ``RLJob`` with every simulated engine
behind the Ray runtime's measured per-call costs (``RayCosts``, ``benchmarks/ray_calls.py``).

Only virtual time is asserted. The costs file that ships loads, and a bad one is refused
naming the field; the costs are charged; and the driver is one process: when its CPU per
request is the bottleneck, the job's throughput is capped at what the driver can serve,
however many engines generate."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from asyncflow_reference.presets import get_preset
from asyncflow_reference.sim import RAY_COSTS_FILE, RayCosts
from asyncflow_reference.simulate import simulate, with_steps

from asyncflow_core.contracts.errors import ConfigError


def _preset(devices: int = 32, steps: int = 4):  # type: ignore[no-untyped-def]
    return with_steps(get_preset("qwen2.5-7b-grpo").scaled(devices), steps)


def test_the_shipped_costs_load_and_say_how_they_were_measured() -> None:
    costs = RayCosts.load()
    assert "benchmarks/ray_calls.py" in costs.measured
    assert 0 < costs.driver_request_cpu_s < costs.generate_call_s < 1.0
    assert costs.train_bytes_per_s > 1e6


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d.pop("generate_call_s"), "has no 'generate_call_s'"),
        (lambda d: d.update(control_call_s=-1), "control_call_s must be a number >= 0, got -1"),
        (lambda d: d.update(train_call_s="fast"), "train_call_s must be a number"),
    ],
)
def test_a_bad_costs_file_is_refused_naming_the_field(tmp_path: Path, edit, match) -> None:  # type: ignore[no-untyped-def]
    data = json.loads(RAY_COSTS_FILE.read_text())
    edit(data)
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=match):
        RayCosts.load(path)
    with pytest.raises(ConfigError, match="cannot read"):
        RayCosts.load(tmp_path / "missing.json")


def test_ray_charges_its_call_costs_and_stays_near_local_at_32_devices() -> None:
    """The costs are charged (the driver was busy, the run is not the local one) and, at 32
    devices, the measured costs are small next to a 7B step (0.999x local, 0.7% driver
    busy, in the README's table). Not a law that Ray is never faster: added latency moves
    the schedule, and at 128 devices the table shows 1.006x."""
    preset = _preset()
    local = simulate(preset, "async", staleness=1, trace=False)
    ray = simulate(preset, "async", staleness=1, trace=False, runtime="ray")
    assert ray.runtime == "ray" and local.driver_busy_s == 0.0
    assert 0 < ray.driver_busy_s < 0.05 * ray.result.wall_s
    assert ray.result.wall_s != local.result.wall_s
    assert 0.95 <= ray.samples_per_s / local.samples_per_s <= 1.01
    assert [len(s.groups) for s in ray.result.steps] == [len(s.groups) for s in local.result.steps]


def test_the_driver_caps_throughput_when_its_cpu_is_the_bottleneck() -> None:
    """0.5 s of driver CPU per request: 2 requests/s at most, whatever the 32 devices could
    generate (~9 samples/s locally); the driver is then busy nearly all the time."""
    preset = _preset(steps=3)
    slow = dataclasses.replace(RayCosts.load(), driver_request_cpu_s=0.5)
    run = simulate(preset, "async", staleness=1, trace=False, runtime="ray", ray_costs=slow)
    generated = run.result.generated
    assert run.driver_busy_s >= 0.5 * generated
    assert generated / run.result.wall_s <= 2.0 + 1e-9  # the driver's cap
    assert run.driver_busy_s / run.result.wall_s > 0.9
