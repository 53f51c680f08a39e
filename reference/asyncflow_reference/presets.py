"""Named simulator workloads: the AsyncFlow paper's Qwen2.5-7B / 32B GRPO runs on Ascend
910B-class clusters (arXiv 2507.01663: 32 to 1024 devices, 1.59x average and 2.03x peak
throughput over a colocated verl baseline; its per-scale numbers are not in our sources).

A ``SimPreset`` is a ``CostModel`` plus the run's shape: devices, the rollout/train split of
the asynchronous mode, prompts per step, samples per prompt and steps. ``scaled(devices)``
gives the same workload weak-scaled to another cluster size for the 32 -> 1024 table.
Every number is documented where it is set; the cost model's own sources are in
``asyncflow_reference.sim.SOURCES``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from asyncflow_core.contracts.errors import ConfigError
from asyncflow_reference.sim import CostModel, qwen2_param_count


@dataclass(frozen=True, slots=True)
class IdealStep:
    """Seconds of one step of the asynchronous mode with no bubbles: rollout decoding at the
    steady-state concurrency on its devices, training on its devices, and the step as the
    slower of the two (they overlap)."""

    rollout_s: float
    train_s: float

    @property
    def step_s(self) -> float:
        return max(self.rollout_s, self.train_s)


def ideal_step(
    cost: CostModel, rollout_devices: int, train_devices: int, samples_per_step: int
) -> IdealStep:
    """The bubble-free step time of a split (``IdealStep``).

    Rollout: ``rollout_devices // cost.tp`` instances share the samples evenly; each decodes
    ``min(max_running, its samples)`` sequences at the length-biased steady-state context
    (``cost.running_context_tokens()``) and prefills each prompt once. No long-tail wait, no
    weight-sync stall. Training: ``cost.train_s`` over every sample's prompt + mean response.
    """
    if rollout_devices < cost.tp or train_devices < 1 or samples_per_step < 1:
        raise ConfigError(
            f"ideal_step needs rollout_devices >= tp ({cost.tp}), train_devices >= 1 and "
            f"samples_per_step >= 1; got {rollout_devices}, {train_devices}, {samples_per_step}"
        )
    mean_len, _ = cost.response_moments()
    instances = rollout_devices // cost.tp
    per_instance = samples_per_step / instances
    concurrency = max(1, min(cost.max_running, math.ceil(per_instance)))
    step = cost.decode_step_s(concurrency, cost.running_context_tokens())
    rollout = per_instance * (mean_len / concurrency * step + cost.prefill_s(cost.prompt_tokens))
    tokens = round(samples_per_step * (cost.prompt_tokens + mean_len))
    return IdealStep(rollout_s=rollout, train_s=cost.train_s(tokens, train_devices))


def balanced_split(cost: CostModel, devices: int, samples_per_step: int) -> tuple[int, int]:
    """``(rollout_devices, train_devices)`` summing to ``devices`` that minimises the ideal
    asynchronous step time (``ideal_step``); rollout devices come in whole instances of
    ``cost.tp``, and each side gets at least one instance / device. Ties go to fewer rollout
    devices."""
    if devices < cost.tp + 1:
        raise ConfigError(
            f"balanced_split needs at least tp + 1 = {cost.tp + 1} devices (one inference "
            f"instance and one trainer), got {devices}"
        )
    best: tuple[float, int] | None = None
    for rollout in range(cost.tp, devices, cost.tp):
        step = ideal_step(cost, rollout, devices - rollout, samples_per_step).step_s
        if best is None or step < best[0]:
            best = (step, rollout)
    assert best is not None
    return best[1], devices - best[1]


@dataclass(frozen=True, slots=True)
class SimPreset:
    """A simulated run: ``cost``, cluster size ``devices``, the async mode's
    ``rollout_devices``/``train_devices`` split (the colocated baseline uses all ``devices``
    for both), ``prompts_per_step`` prompts x ``n`` samples per optimizer step, ``steps``.

    ``scaled(devices)`` weak-scales: prompts per step grow with devices (samples per device
    stay fixed), the split is re-balanced, and the step count shrinks from ``max_steps``
    (default: ``steps``) so that ``steps x samples_per_step`` stays within ``sample_budget``
    (never below ``min_steps``), which keeps a 1024-device run to minutes of real time (4 to 9
    on 2 cores).
    """

    name: str
    cost: CostModel
    prompts_per_step: int
    n: int
    steps: int
    devices: int = 32
    rollout_devices: int = 0  # 0: balanced_split(cost, devices, samples_per_step)
    train_devices: int = 0
    sample_budget: int = 65_536
    min_steps: int = 3
    max_steps: int = 0  # the step count before the budget trims it; 0: steps
    description: str = ""

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "n", "steps", "devices", "sample_budget", "min_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"SimPreset {self.name!r}: {name} must be >= 1")
        if not self.max_steps:
            object.__setattr__(self, "max_steps", self.steps)
        if self.devices % self.cost.tp:
            raise ConfigError(
                f"SimPreset {self.name!r}: devices={self.devices} is not a multiple of the "
                f"inference tp={self.cost.tp}"
            )
        if not self.rollout_devices and not self.train_devices:
            rollout, train = balanced_split(self.cost, self.devices, self.samples_per_step)
            object.__setattr__(self, "rollout_devices", rollout)
            object.__setattr__(self, "train_devices", train)
        if self.rollout_devices + self.train_devices != self.devices:
            raise ConfigError(
                f"SimPreset {self.name!r}: rollout_devices ({self.rollout_devices}) + "
                f"train_devices ({self.train_devices}) must equal devices ({self.devices})"
            )
        if self.rollout_devices < self.cost.tp or self.rollout_devices % self.cost.tp:
            raise ConfigError(
                f"SimPreset {self.name!r}: rollout_devices={self.rollout_devices} must be a "
                f"positive multiple of tp={self.cost.tp}"
            )
        if self.train_devices < 1:
            raise ConfigError(f"SimPreset {self.name!r}: train_devices must be >= 1")

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.n

    @property
    def rollout_instances(self) -> int:
        """Inference engines of the async mode (``rollout_devices // tp``)."""
        return self.rollout_devices // self.cost.tp

    @property
    def colocated_instances(self) -> int:
        """Inference engines of the colocated baseline (every device, ``devices // tp``)."""
        return self.devices // self.cost.tp

    def ideal(self) -> IdealStep:
        """The bubble-free async step of this preset's split."""
        return ideal_step(
            self.cost, self.rollout_devices, self.train_devices, self.samples_per_step
        )

    def scaled(self, devices: int) -> SimPreset:
        """This workload weak-scaled to ``devices`` (see the class docstring)."""
        if (
            devices < 1
            or devices % self.cost.tp
            or (devices * self.prompts_per_step) % self.devices
        ):
            raise ConfigError(
                f"cannot scale {self.name!r} to {devices} devices: use a multiple of tp="
                f"{self.cost.tp} for which prompts_per_step x devices / {self.devices} is whole "
                "(e.g. 32, 64, 128, 256, 512, 1024)"
            )
        prompts = devices * self.prompts_per_step // self.devices
        samples = prompts * self.n
        steps = max(self.min_steps, min(self.max_steps, self.sample_budget // samples))
        base = self.name.split("@")[0]
        return dataclasses.replace(
            self,
            name=f"{base}@{devices}",
            devices=devices,
            prompts_per_step=prompts,
            steps=steps,
            rollout_devices=0,
            train_devices=0,
        )


# --------------------------------------------------------------------------------------------
# Cost models
# --------------------------------------------------------------------------------------------
QWEN25_7B_910B = CostModel()
"""Qwen2.5-7B bf16 on Ascend 910B-class devices (the ``CostModel`` defaults; see SOURCES)."""

QWEN25_32B_910B = CostModel(
    model="Qwen2.5-32B",
    hidden_size=5120,
    num_layers=64,
    intermediate_size=27648,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=152064,
    params=qwen2_param_count(
        hidden_size=5120,
        num_layers=64,
        intermediate_size=27648,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=152064,
        tie_embeddings=False,
    ),
    kv_bytes_per_token=2 * 64 * 8 * 128 * 2,
    tp=4,
    decode_fixed_s=0.010,
    host_to_device_bytes_per_s=4 * 25e9,
    network_bytes_per_s=4 * 25e9,
    colocate_switch_s=8.0,
    scaling_alpha=0.025,
)
"""Qwen2.5-32B bf16: tp=4 instances, so the per-instance host-to-device and network rates
are 4 links' worth; a larger per-step overhead (64 layers, tp all-reduces); a longer
colocated switch; and better data-parallel scaling (more compute per byte of gradient)."""


# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------
# Run shape, shared by both presets (the paper's batch size is not in our sources):
# - 128 prompts x n=8 samples per step at 32 devices: DeepScaleR's published GRPO recipe for
#   its 8k stage (train batch 128 prompts, 8 samples each), the data set the paper used.
#   That is 32 samples per device, kept fixed by weak scaling (4096 prompts at 1024 devices).
# - 10 steps at 32 devices (10,240 samples); scaled() keeps steps x samples <= 65,536 with at
#   least 3 steps (at 1024 devices: 3 steps x 32,768 samples), so the largest run replays in
#   minutes.
PRESETS: dict[str, SimPreset] = {
    "qwen2.5-7b-grpo": SimPreset(
        name="qwen2.5-7b-grpo",
        cost=QWEN25_7B_910B,
        description="Qwen2.5-7B GRPO on Ascend 910B-class devices, tp=1 rollout instances",
        prompts_per_step=128,
        n=8,
        steps=10,
        devices=32,
    ),
    "qwen2.5-32b-grpo": SimPreset(
        name="qwen2.5-32b-grpo",
        cost=QWEN25_32B_910B,
        description="Qwen2.5-32B GRPO on Ascend 910B-class devices, tp=4 rollout instances",
        prompts_per_step=128,
        n=8,
        steps=10,
        devices=32,
    ),
}
"""The named workloads; rollout/train splits come from ``balanced_split``."""


def get_preset(name: str) -> SimPreset:
    """The preset called ``name``; ``ConfigError`` listing the valid names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown simulator preset {name!r}; valid names: {', '.join(sorted(PRESETS))}"
        ) from None


__all__ = [
    "PRESETS",
    "QWEN25_7B_910B",
    "QWEN25_32B_910B",
    "IdealStep",
    "SimPreset",
    "balanced_split",
    "get_preset",
    "ideal_step",
]
