"""The RL step as a pipeline: config validation, verl's knobs, and what each mode and weight-sync
strategy does (seen in the trace and the per-token versions), on small in-test engines driven
by the virtual clock. The workflow laws over every mode live in test_workflow_conformance."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Literal

import pytest
import torch

from asyncflow_core.contracts.errors import ConfigError
from asyncflow_core.contracts.protocols import (
    Batch,
    GenerationRequest,
    GenerationResult,
    InferenceEngine,
    LossFn,
    TrainEngine,
    TrainMetrics,
    WeightBucket,
)
from asyncflow_core.flow.rlflow import RLConfig, RLEngines, RLJob, RLResult
from asyncflow_core.flow.vclock import run_virtual
from asyncflow_core.observability.trace import Tracer
from asyncflow_core.training.rl import DecoupledPPOLoss, PPOClipLoss, policy_gradient_loss


class ToyEngine:
    """Generates 1..max_len tokens, one per 10 ms; honours pause (keep/abort) and loads."""

    def __init__(self, seed: int, max_len: int = 20) -> None:
        self.weight_version = 0
        self.rng = random.Random(seed)
        self.max_len = max_len
        self._running = asyncio.Event()
        self._running.set()
        self._abort = 0
        self.loads: list[int] = []

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        await self._running.wait()
        target = self.rng.randint(1, self.max_len)
        toks, lps, vs = (
            list(request.resume_tokens),
            list(request.resume_logprobs),
            list(request.resume_versions),
        )
        epoch = self._abort
        while len(toks) < max(target, len(request.resume_tokens) + 1):
            await asyncio.sleep(0.01)
            await self._running.wait()
            if self._abort != epoch:
                return GenerationResult(
                    request.request_id, request.prompt_tokens, tuple(toks), tuple(lps),
                    tuple(vs), "abort",
                )  # fmt: skip
            toks.append(len(toks) % 5)
            lps.append(-1.0)
            vs.append(self.weight_version)
        return GenerationResult(
            request.request_id, request.prompt_tokens, tuple(toks), tuple(lps), tuple(vs), "stop"
        )

    async def abort(self, request_ids: Sequence[str]) -> None:
        self._abort += 1

    async def pause(self, mode: Literal["abort", "keep"] = "abort") -> None:
        if mode == "abort":
            self._abort += 1
        self._running.clear()

    async def resume(self) -> None:
        self._running.set()

    async def load_weights(self, weights: Sequence[tuple[str, torch.Tensor]], version: int) -> None:
        await asyncio.sleep(0.002)
        self.weight_version = version
        self.loads.append(version)


class ToyTrainer:
    def __init__(self) -> None:
        self.weight_version = 0
        self.w = torch.zeros(4)
        self.batches: list[Batch] = []

    async def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        return torch.zeros(len(batch), 1)

    async def train_step(self, batch: Batch, loss_fn: LossFn) -> TrainMetrics:
        await asyncio.sleep(0.05)
        self.batches.append(batch)
        self.weight_version += 1
        return TrainMetrics(self.weight_version, 0.0, 0.0, len(batch), 0)

    async def export_weights(self, bucket_bytes: int) -> AsyncIterator[WeightBucket]:
        yield WeightBucket(("w",), (self.w,))

    async def save_checkpoint(self, path: str) -> None:
        pass

    async def load_checkpoint(self, path: str) -> None:
        pass


def run_job(**knobs: Any) -> tuple[RLResult, ToyTrainer, list[ToyEngine]]:
    engines = [ToyEngine(0), ToyEngine(1)]
    trainer = ToyTrainer()
    assert isinstance(engines[0], InferenceEngine) and isinstance(trainer, TrainEngine)

    async def main() -> RLResult:
        tracer = Tracer(clock=asyncio.get_running_loop().time)
        cfg = RLConfig(**{"verify_sync": "off", "steps": 4, "prompts_per_step": 3, "n": 4, **knobs})
        job = RLJob(
            cfg, RLEngines(engines, trainer), ([7, 8, 9] for _ in range(10_000)),
            lambda p, r: float(len(r)), tracer=tracer,
        )  # fmt: skip
        return await job.run()

    return run_virtual(main()), trainer, engines


# --- config ---------------------------------------------------------------------------------
def test_bad_configs_name_every_problem() -> None:
    with pytest.raises(ConfigError) as e:
        RLConfig(steps=0, prompts_per_step=2, n=-1, staleness=-1, mode="hybrid").validate()  # type: ignore[arg-type]
    msg = str(e.value)
    for part in ("steps must be", "n must be", "staleness (η)", "mode must be one of"):
        assert part in msg
    with pytest.raises(ConfigError, match="raise staleness to >= 3"):
        RLConfig(steps=2, prompts_per_step=2, staleness=1, sync_every=4).validate()
    with pytest.raises(ConfigError, match=r"colocated.*staleness must be 0"):
        RLConfig(steps=2, prompts_per_step=2, staleness=1, mode="colocated").validate()
    with pytest.raises(ConfigError, match="weight_sync must be 'blocking'"):
        RLConfig(steps=2, prompts_per_step=2, staleness=0, mode="colocated").validate()


@pytest.mark.parametrize(
    ("threshold", "trigger", "eta"),
    [(0.0, 1, 0), (1.0, 1, 1), (0.0, 4, 3), (0.1, 4, 4), (0.5, 2, 2), (0.5, 1, 1)],
)
def test_verl_knobs_map_onto_staleness_and_sync_every(
    threshold: float, trigger: int, eta: int
) -> None:
    cfg = RLConfig.from_verl(
        staleness_threshold=threshold, trigger_parameter_sync_step=trigger,
        partial_rollout=True, steps=3, prompts_per_step=2,
    )  # fmt: skip
    assert (cfg.staleness, cfg.sync_every, cfg.partial_rollout) == (eta, trigger, True)
    with pytest.raises(ConfigError, match="staleness_threshold"):
        RLConfig.from_verl(
            staleness_threshold=-1, trigger_parameter_sync_step=1, partial_rollout=False,
            steps=1, prompts_per_step=1,
        )  # fmt: skip


def test_a_job_without_rollout_engines_or_reference_is_refused() -> None:
    cfg = RLConfig(steps=1, prompts_per_step=1)
    with pytest.raises(ConfigError, match="rollout is empty"):
        RLJob(cfg, RLEngines([], ToyTrainer()), [], lambda p, r: 0.0)
    with pytest.raises(ConfigError, match=r"needs RLEngines\.reference"):
        RLJob(
            RLConfig(steps=1, prompts_per_step=1, reference_logprobs=True),
            RLEngines([ToyEngine(0)], ToyTrainer()), [], lambda p, r: 0.0,
        )  # fmt: skip


def test_a_loss_reading_a_field_the_job_does_not_compute_is_refused_up_front() -> None:
    cfg = RLConfig(steps=1, prompts_per_step=1)

    def job(loss: LossFn, config: RLConfig = cfg) -> RLJob:
        return RLJob(config, RLEngines([ToyEngine(0)], ToyTrainer()), [], lambda p, r: 0.0,
                     loss_fn=loss)  # fmt: skip

    prox = r"reads the 'prox_logprobs' field.*RLConfig\(proximal_logprobs=True\)"
    with pytest.raises(ConfigError, match="DecoupledPPOLoss " + prox):
        job(DecoupledPPOLoss())
    with pytest.raises(ConfigError, match="PPOClipLoss " + prox):
        job(PPOClipLoss(old_logprobs_field="prox_logprobs", tis_cap=2.0))
    with pytest.raises(ConfigError, match=r"kl_coef=0.1 .*reference_logprobs=True"):
        job(PPOClipLoss(kl_coef=0.1))
    with_prox = RLConfig(steps=1, prompts_per_step=1, proximal_logprobs=True)
    for loss in (policy_gradient_loss, PPOClipLoss(), DecoupledPPOLoss(tis_cap=2.0)):
        job(loss, with_prox)  # accepted


# --- modes ----------------------------------------------------------------------------------
def sync_spans(result: RLResult) -> Mapping[str, list[Any]]:
    assert result.tracer is not None
    out: dict[str, list[Any]] = {}
    for s in result.tracer.spans:
        if s.kind == "sync":
            out.setdefault(s.name, []).append(s)
    return out


def test_colocated_alternates_on_one_resource_and_is_on_policy() -> None:
    result, _, engines = run_job(staleness=0, weight_sync="blocking", mode="colocated")
    assert len(result.steps) == 4 and result.max_staleness == 0
    assert result.tracer is not None
    resources = {s.resource for s in result.tracer.spans if s.name in ("rollout", "actor_update")}
    assert resources == {"devices"}
    # rollout and training never overlap on the shared devices
    roll = [
        (s.start, s.end) for s in result.tracer.spans if s.kind == "task" and s.name == "rollout"
    ]
    train = [
        (s.start, s.end)
        for s in result.tracer.spans
        if s.kind == "task" and s.name == "actor_update"
    ]
    for a, b in train:
        assert all(e <= a + 1e-9 or s >= b - 1e-9 for s, e in roll)
    assert all(s.exposed for spans in sync_spans(result).values() for s in spans)
    assert engines[0].loads == [1, 2, 3]  # synced after every step but the last


def test_staged_sync_hides_the_transfer_and_exposes_only_the_swap() -> None:
    result, _, engines = run_job(staleness=1, weight_sync="staged")
    spans = sync_spans(result)
    assert spans["transfer"] and all(s.exposed is False for s in spans["transfer"])
    assert {s.resource for s in spans["transfer"]} == {"trainer"}
    assert spans["swap"] and all(
        s.exposed is True and s.resource == "rollout" for s in spans["swap"]
    )
    assert result.max_staleness <= 1
    assert engines[0].loads and engines[0].loads == sorted(engines[0].loads)
    summary = result.tracer.summary() if result.tracer else {}
    assert summary["sync"]["exposed_s"] > 0  # the swap; the in-process transfer takes ~0 s


def test_async_overlaps_rollout_with_training() -> None:
    colocated, _, _ = run_job(staleness=0, weight_sync="blocking", mode="colocated")
    overlapped, _, _ = run_job(staleness=1, weight_sync="staged")
    assert overlapped.tracer is not None
    roll = [
        (s.start, s.end)
        for s in overlapped.tracer.spans
        if s.kind == "task" and s.name == "rollout"
    ]
    train = [
        (s.start, s.end)
        for s in overlapped.tracer.spans
        if s.kind == "task" and s.name == "actor_update"
    ]
    assert any(s < b and e > a for a, b in train for s, e in roll)  # they overlap
    assert overlapped.wall_s < colocated.wall_s


def test_partial_rollout_resumes_aborted_generations_with_their_versions() -> None:
    result, trainer, _ = run_job(staleness=2, weight_sync="blocking", partial_rollout=True)
    assert result.max_staleness <= 2
    mixed = [t for b in trainer.batches for t in b.tags if len(t.versions) > 1]
    assert mixed, "an aborted generation resumed on new weights carries both versions"
    spans = sync_spans(result)
    assert spans["drain"] and spans["transfer"]


def test_blocking_without_partial_rollout_drains_so_every_sample_has_one_version() -> None:
    result, trainer, _ = run_job(staleness=1, weight_sync="blocking")
    assert all(len(t.versions) == 1 for b in trainer.batches for t in b.tags)
    assert result.max_staleness <= 1


def test_inflight_sync_loads_into_running_engines() -> None:
    result, _, engines = run_job(staleness=1, weight_sync="inflight")
    assert engines[0].loads == [1, 2, 3] and engines[1].loads == [1, 2, 3]
    spans = sync_spans(result)
    assert all(s.exposed is False for s in spans["transfer"])
    assert all(s.exposed is True and s.resource == "rollout" for s in spans["load"])


def test_sync_every_skips_syncs_and_per_step_metrics_are_recorded() -> None:
    result, _, engines = run_job(staleness=1, sync_every=2, weight_sync="staged", steps=5)
    assert engines[0].loads == [2, 4] or engines[1].loads == [2, 4]
    assert result.tracer is not None
    steps = [m.step for m in result.tracer.metrics]
    assert steps == [1, 2, 3, 4, 5]
    assert result.samples == 5 * 12


def test_proximal_logprobs_reach_the_update_only_when_asked() -> None:
    _, trainer, _ = run_job(proximal_logprobs=True)
    assert trainer.batches and all("prox_logprobs" in b for b in trainer.batches)
    for b in trainer.batches:
        assert b["prox_logprobs"].shape[0] == len(b)
        assert torch.equal(b.lengths["prox_logprobs"], b.lengths["response"])
    _, plain, _ = run_job()
    assert plain.batches and not any("prox_logprobs" in b for b in plain.batches)


def test_each_row_carries_its_sampling_settings_to_the_trainer() -> None:
    """The update's batch holds every row's temperature/top_k/top_p ([B] tensors): the trainer
    scores the tokens under the distribution they were sampled from."""
    from asyncflow_core.contracts.protocols import SamplingParams
    from asyncflow_core.training.sampling import row_sampling

    sampling = SamplingParams(max_tokens=8, temperature=0.7, top_k=5, top_p=0.9)
    _, trainer, _ = run_job(sampling=sampling)
    assert trainer.batches
    for batch in trainer.batches:
        t, k, p = row_sampling(batch, len(batch), who="test")
        assert t.tolist() == pytest.approx([0.7] * len(batch))
        assert k.tolist() == [5] * len(batch)
        assert p.tolist() == pytest.approx([0.9] * len(batch))


def test_on_step_sees_every_step_with_its_mean_reward() -> None:
    seen: list[Any] = []

    async def main() -> RLResult:
        cfg = RLConfig(verify_sync="off", steps=3, prompts_per_step=2, n=2)
        job = RLJob(
            cfg, RLEngines([ToyEngine(0)], ToyTrainer()), ([1, 2] for _ in range(1000)),
            lambda p, r: float(len(r)), on_step=seen.append,
        )  # fmt: skip
        return await job.run()

    result = run_virtual(main())
    assert tuple(seen) == result.steps and [s.version for s in seen] == [1, 2, 3]
    # the toy reward is the response length (1..20 tokens): each step's mean lies in that range
    assert all(1.0 <= s.reward_mean <= 20.0 for s in seen)


class SleepyEngine(ToyEngine):
    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.asleep = False
        self.calls: list[str] = []

    async def sleep(self, level: int = 1) -> None:
        self.asleep = True
        self.calls.append("sleep")

    async def wake_up(self) -> None:
        self.asleep = False
        self.calls.append("wake")


def test_colocated_job_hands_the_engines_back_awake() -> None:
    engine = SleepyEngine(0)

    async def main() -> RLResult:
        cfg = RLConfig(verify_sync="off", steps=2, prompts_per_step=2, n=2, staleness=0,
                       mode="colocated", weight_sync="blocking")  # fmt: skip
        job = RLJob(cfg, RLEngines([engine], ToyTrainer()), ([1] for _ in range(100)),
                    lambda p, r: 1.0)  # fmt: skip
        return await job.run()

    run_virtual(main())
    assert engine.calls[:2] == ["sleep", "wake"] and engine.calls[-1] == "wake"
    assert not engine.asleep  # no sync follows the last step, yet the engine is awake again


def test_a_sampling_seed_gives_each_request_its_own_seed() -> None:
    from asyncflow_core.contracts.protocols import SamplingParams

    seeds: list[int | None] = []

    class SeedEngine(ToyEngine):
        async def generate(self, request: GenerationRequest) -> GenerationResult:
            seeds.append(request.params.seed)
            return await super().generate(request)

    async def main() -> RLResult:
        cfg = RLConfig(
            verify_sync="off", steps=2, prompts_per_step=2, n=3, sampling=SamplingParams(seed=100)
        )
        job = RLJob(cfg, RLEngines([SeedEngine(0)], ToyTrainer()), ([1] for _ in range(100)),
                    lambda p, r: 1.0)  # fmt: skip
        return await job.run()

    run_virtual(main())
    assert len(seeds) >= 12 and len(set(seeds)) == len(seeds)  # distinct per request
    assert all(s is not None and s > 100 for s in seeds)


def test_a_nan_reward_fails_its_row_alone() -> None:
    """A NaN reward marks a failed row: it gets advantage 0, its group's advantages are those
    of the other rows alone, the step's reward mean leaves it out and ``reward_failed`` counts
    it; the job goes on."""
    engines = [ToyEngine(0)]
    trainer = ToyTrainer()
    calls = itertools.count()

    def reward(prompt: Sequence[int], response: Sequence[int]) -> float:
        i = next(calls)
        return math.nan if i % 4 == 0 else float(i % 2)

    async def main() -> RLResult:
        cfg = RLConfig(verify_sync="off", steps=3, prompts_per_step=2, n=4)
        job = RLJob(cfg, RLEngines(engines, trainer), ([7, 8, 9] for _ in range(1000)), reward)
        return await job.run()

    result = run_virtual(main())
    assert len(result.steps) == 3
    for step, batch in zip(result.steps, trainer.batches, strict=True):
        rewards = torch.as_tensor(batch["reward"], dtype=torch.float32)
        advantage = torch.as_tensor(batch["advantage"], dtype=torch.float32)
        failed = ~torch.isfinite(rewards)
        assert bool(failed.any()) and bool(torch.isfinite(advantage).all())
        assert bool((advantage[failed] == 0).all())
        assert step.metrics.extra["reward_failed"] == float(failed.sum())
        assert step.reward_mean == pytest.approx(float(rewards[~failed].mean()))
        groups = [t.group for t in batch.tags]
        for g in set(groups):
            rows = [i for i, x in enumerate(groups) if x == g and not failed[i]]
            kept = advantage[rows]
            if len(rows) > 1 and float(rewards[rows].std()) > 0:
                assert float(kept.mean()) == pytest.approx(0.0, abs=1e-5)
