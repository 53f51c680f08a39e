"""RLJob with a trainer that does not start at version 0 (after a warm-up, from a checkpoint,
or a second ``run()``): every count is relative to the start version v0, and the rollout
engines get the trainer's weights at v0 before the first token. Small in-test engines on the
virtual clock check each rule exactly; the reference engines check it end to end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

import pytest
import torch
from asyncflow_reference.engines import TorchInferenceEngine, TorchTrainEngine
from asyncflow_reference.model import ModelConfig, TransformerLM

from asyncflow_core.contracts.errors import BadRequestError, ConfigError
from asyncflow_core.contracts.protocols import (
    Batch,
    GenerationRequest,
    GenerationResult,
    InferenceEngine,
    LossFn,
    SamplingParams,
    TrainEngine,
    TrainMetrics,
    WeightBucket,
)
from asyncflow_core.flow.rlflow import RLConfig, RLEngines, RLJob, RLResult
from asyncflow_core.flow.staleness import AdmissionController
from asyncflow_core.flow.vclock import run_virtual
from asyncflow_core.observability.trace import Span, Tracer
from asyncflow_core.training.rl import policy_gradient_loss

DEADLINE_S = 20.0
"""Virtual seconds a toy job may take: a job that drops every sample never ends, and must fail
rather than hang (the healthy ones here end within 5 virtual seconds; virtual time does not
stretch on a loaded machine)."""


class ToyTrainer:
    """Starts at ``start``; its one weight holds its version, so a load shows whose it was."""

    def __init__(self, start: int, step_s: float = 0.05) -> None:
        self.weight_version = start
        self.step_s = step_s
        self.batches: list[tuple[int, Batch]] = []  # (version before the step, batch)

    async def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        return torch.zeros(len(batch), 1)

    async def train_step(self, batch: Batch, loss_fn: LossFn) -> TrainMetrics:
        self.batches.append((self.weight_version, batch))
        await asyncio.sleep(self.step_s)
        self.weight_version += 1
        return TrainMetrics(self.weight_version, 0.0, 0.0, len(batch), 0)

    async def export_weights(self, bucket_bytes: int) -> AsyncIterator[WeightBucket]:
        yield WeightBucket(("w",), (torch.full((2,), float(self.weight_version)),))

    async def save_checkpoint(self, path: str) -> None:
        pass

    async def load_checkpoint(self, path: str) -> None:
        pass


class ToyRollout:
    """``length`` tokens per request, 10 ms each, each tagged with the engine's version; records
    every request's start (group, own version, own weight, trainer version) and every load."""

    def __init__(self, trainer: ToyTrainer, version: int = 0, length: int = 2) -> None:
        self.trainer = trainer
        self.weight_version = version
        self.weight = float("nan")  # never loaded: not any trainer's weights
        self.length = length
        self.loads: list[int] = []
        self.starts: list[tuple[int, int, float, int]] = []
        self._running = asyncio.Event()
        self._running.set()

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        await self._running.wait()
        group = request.group if isinstance(request.group, int) else -1
        self.starts.append((group, self.weight_version, self.weight, self.trainer.weight_version))
        versions = []
        for _ in range(self.length):
            await asyncio.sleep(0.01)
            await self._running.wait()
            versions.append(self.weight_version)
        n = len(versions)
        return GenerationResult(
            request.request_id, request.prompt_tokens, (1,) * n, (-1.0,) * n, tuple(versions),
            "stop",
        )  # fmt: skip

    async def abort(self, request_ids: Sequence[str]) -> None:
        pass

    async def pause(self, mode: Literal["abort", "keep"] = "abort") -> None:
        self._running.clear()

    async def resume(self) -> None:
        self._running.set()

    async def load_weights(self, weights: Sequence[tuple[str, torch.Tensor]], version: int) -> None:
        await asyncio.sleep(0.002)
        self.weight = float(dict(weights)["w"][0])
        self.weight_version = version
        self.loads.append(version)


def run_toy_job(
    start: int,
    *,
    engine_version: int = 0,
    step_s: float = 0.05,
    length: int = 2,
    runs: int = 1,
    **knobs: Any,
) -> tuple[list[RLResult], ToyTrainer, list[ToyRollout]]:
    """``runs`` runs of one job (2 rollout engines, 3 prompts × 4 samples per step) on a trainer
    that starts at ``start``, engines at ``engine_version``."""
    trainer = ToyTrainer(start, step_s)
    engines = [ToyRollout(trainer, engine_version, length) for _ in range(2)]
    assert isinstance(engines[0], InferenceEngine) and isinstance(trainer, TrainEngine)

    async def main() -> list[RLResult]:
        tracer = Tracer(clock=asyncio.get_running_loop().time)
        cfg = RLConfig(**{"verify_sync": "off", "steps": 4, "prompts_per_step": 3, "n": 4, **knobs})
        job = RLJob(
            cfg, RLEngines(engines, trainer), ([7, 8, 9] for _ in range(100_000)),
            lambda p, r: float(len(r)), tracer=tracer,
        )  # fmt: skip
        return [await asyncio.wait_for(job.run(), DEADLINE_S) for _ in range(runs)]

    return run_virtual(main()), trainer, engines


def sync_spans(result: RLResult) -> list[Span]:
    assert result.tracer is not None
    return [s for s in result.tracer.spans if s.kind == "sync"]


def first_rollout_start(result: RLResult) -> float:
    assert result.tracer is not None
    return min(s.start for s in result.tracer.spans if s.kind == "task" and s.name == "rollout")


# --- each count is relative to the start version --------------------------------------------
def test_a_trainer_starting_at_v0_trains_exactly_config_steps() -> None:
    # drop_stale=False here and below: each test checks one rule on its own, even where a
    # broken initial sync would otherwise make the update drop every sample
    (result,), trainer, _ = run_toy_job(5, steps=4, drop_stale=False)
    assert len(result.steps) == len(trainer.batches) == 4
    assert result.samples == 4 * 12
    # the records and metrics keep the trainer's absolute versions
    assert [s.version for s in result.steps] == [6, 7, 8, 9]
    assert result.tracer is not None
    assert [m.step for m in result.tracer.metrics] == [6, 7, 8, 9]


def test_syncs_happen_every_sync_every_steps_counted_from_the_start() -> None:
    (result,), _, engines = run_toy_job(
        3, steps=5, sync_every=2, staleness=1, weight_sync="inflight", drop_stale=False
    )
    # the initial sync at v0 = 3, then after steps 2 and 4 of the run (none after the last)
    for engine in engines:
        assert engine.loads == [3, 5, 7]
    loads = [s.args["version"] for s in sync_spans(result) if s.name == "load"]
    assert loads == [3, 5, 7]
    assert [s.version for s in result.steps] == [4, 5, 6, 7, 8]


def test_the_staleness_bound_holds_after_the_first_sync() -> None:
    """A slow trainer and fast rollout make the admission bound the only limit: group g (of
    ``prompts_per_step`` per step) may start only once the trainer has done ``g // 3 - η``
    steps of this run, and no trained sample is older than η, well after the first sync."""
    eta, pps, start, steps = 1, 3, 5, 8
    # drop_stale=False: the bound must come from admission alone, not from dropping
    (result,), trainer, engines = run_toy_job(
        start, steps=steps, staleness=eta, step_s=0.5, length=1, drop_stale=False
    )
    starts = [s for e in engines for s in e.starts]
    for group, _, _, trainer_version in starts:
        done = trainer_version - start
        assert group // pps - done <= eta, (
            f"group {group} started with the trainer {done} steps in: ahead by more than η"
        )
    for before, batch in trainer.batches:
        assert all(before - t.min_version <= eta for t in batch.tags)
    assert result.max_staleness <= eta
    assert len(result.steps) == steps
    assert max(group for group, *_ in starts) >= (steps - 1) * pps  # rollout covered every step


@pytest.mark.parametrize("weight_sync", ["staged", "blocking"])
def test_nothing_is_dropped_because_of_the_start_version(weight_sync: str) -> None:
    (at_zero,), _, _ = run_toy_job(0, weight_sync=weight_sync)
    (at_five,), _, _ = run_toy_job(5, weight_sync=weight_sync)
    assert at_zero.dropped == 0  # this workload drops nothing (no long tail) ...
    assert at_five.dropped == 0  # ... wherever the trainer starts
    assert len(at_five.steps) == 4 and at_five.max_staleness <= 1


@pytest.mark.parametrize(
    "knobs",
    [
        {"weight_sync": "staged"},
        {"weight_sync": "staged", "partial_rollout": True},
        {"weight_sync": "blocking"},
        {"weight_sync": "inflight"},
        {"mode": "colocated", "staleness": 0, "weight_sync": "blocking"},
    ],
    ids=["staged", "staged-partial", "blocking", "inflight", "colocated"],
)
def test_engines_get_the_trainers_weights_at_v0_before_the_first_token(
    knobs: dict[str, Any],
) -> None:
    # drop_stale=False: the engines' versions and weights are the point here, not the drop
    (result,), _, engines = run_toy_job(5, drop_stale=False, **knobs)
    for engine in engines:
        assert engine.loads and engine.loads[0] == 5
        assert engine.starts, "every engine generated"
        # every request started on the trainer's weights (the weight holds their version)
        assert all(v >= 5 and w >= 5.0 for _, v, w, _ in engine.starts)
    first = first_rollout_start(result)
    initial = [s for s in sync_spans(result) if s.args.get("version") == 5]
    names = {"staged": {"transfer", "swap"}}.get(knobs["weight_sync"], {"transfer", "load"})
    assert {s.name for s in initial} == names
    assert all(s.exposed and s.end <= first for s in initial)  # rollout waited for it


def test_engines_already_at_the_trainers_version_get_no_transfer() -> None:
    (result,), _, engines = run_toy_job(5, engine_version=5, weight_sync="inflight")
    for engine in engines:
        assert engine.loads == [6, 7, 8]  # only the job's own syncs
    assert all(s.args.get("version") != 5 for s in sync_spans(result))


def test_a_second_run_trains_config_steps_more_from_where_the_trainer_is() -> None:
    (first, second), trainer, engines = run_toy_job(0, steps=3, weight_sync="inflight", runs=2)
    assert [s.version for s in first.steps] == [1, 2, 3]
    assert [s.version for s in second.steps] == [4, 5, 6]
    assert second.samples == 3 * 12 and second.max_staleness <= 1
    assert trainer.weight_version == 6
    for engine in engines:
        # the first run's syncs; the second run's initial sync (3: no sync after step 3), its own
        assert engine.loads == [1, 2, 3, 4, 5]


def test_engines_that_cannot_load_weights_are_refused_when_a_sync_is_needed() -> None:
    class Fixed(ToyRollout):
        load_weights = None  # type: ignore[assignment]  # no SupportsLoadWeights

    async def main() -> None:
        trainer = ToyTrainer(4)
        cfg = RLConfig(verify_sync="off", steps=1, prompts_per_step=1, n=2)
        job = RLJob(cfg, RLEngines([Fixed(trainer)], trainer), [[1]], lambda p, r: 0.0)
        await job.run()

    with pytest.raises(ConfigError) as e:
        run_virtual(main())
    msg = str(e.value)
    assert "rollout engine(s) 0 (Fixed) do not" in msg
    assert "trainer starts at version 4" in msg and "0 at 0" in msg


def test_the_admission_controller_counts_steps_from_its_start_version() -> None:
    ctl = AdmissionController(batch_size=2, staleness=0, start_version=7)
    assert ctl.try_admit(2) == 7  # one step's worth at η = 0, not 8 steps' worth
    assert ctl.try_admit(1) is None
    ctl.finish(2)
    ctl.set_version(8)
    assert ctl.try_admit(2) == 8 and ctl.try_admit(1) is None
    with pytest.raises(BadRequestError, match="went back from 8 to 6"):
        ctl.set_version(6)
    with pytest.raises(BadRequestError, match="start_version must be >= 0"):
        AdmissionController(2, 0, start_version=-1)
    with pytest.raises(BadRequestError, match="start_version must be an int"):
        AdmissionController(2, 0, start_version=True)


# --- the reference engines, end to end ------------------------------------------------------
TINY = ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, max_seq_len=64)


class RecordingEngine(TorchInferenceEngine):
    """Records the weights and version in place when the first request arrives, and the
    versions every result reports."""

    first: tuple[int, dict[str, torch.Tensor]] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.versions: list[int] = []

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if self.first is None:
            state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            self.first = (self.weight_version, state)
        result = await super().generate(request)
        self.versions += result.versions
        return result


def warm_up_batch(n: int = 8) -> Batch:
    prompts = torch.randint(0, 16, (n, 3), generator=torch.Generator().manual_seed(1))
    responses = torch.randint(0, 16, (n, 4), generator=torch.Generator().manual_seed(2))
    return Batch(
        rows=tuple(range(n)),
        data={"prompt": prompts, "response": responses, "advantage": torch.ones(n)},
        lengths={"prompt": torch.full((n,), 3), "response": torch.full((n,), 4)},
    )


@pytest.mark.parametrize(
    "knobs",
    [
        {"staleness": 1, "weight_sync": "staged"},
        {"staleness": 0, "weight_sync": "blocking", "mode": "colocated"},
    ],
    ids=["async-staged", "colocated"],
)
def test_reference_engines_start_from_a_warmed_up_trainer(knobs: dict[str, Any]) -> None:
    """A ``TorchTrainEngine`` warmed up for 3 steps (v0 = 3) and a ``TorchInferenceEngine``
    still at version 0 with the pre-warm-up weights: the engine gets the trainer's weights
    at version 3 before its first token, every generated token reports >= 3, and the job
    trains exactly ``steps`` steps within the staleness bound."""
    model = TransformerLM(TINY, seed=0)

    async def main() -> tuple[RLResult, dict[str, torch.Tensor], RecordingEngine]:
        trainer = TorchTrainEngine(model, lr=1e-2, seed=0, name="t")
        engine = RecordingEngine(model, max_batch=16, seed=1, name="r")
        try:
            for _ in range(3):
                await trainer.train_step(warm_up_batch(), policy_gradient_loss)
            assert trainer.weight_version == 3 and engine.weight_version == 0
            at_start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
            cfg = RLConfig(
                verify_sync="off",  # toy engines: their log-probs are not a model's
                steps=3, prompts_per_step=2, n=4, sampling=SamplingParams(max_tokens=4, seed=0),
                **knobs,
            )  # fmt: skip
            job = RLJob(
                cfg, RLEngines([engine], trainer), ([1, 2, 3] for _ in range(1_000)),
                lambda p, r: float(sum(r) % 3),
            )  # fmt: skip
            # a job that drops every sample never ends: fail instead of hanging
            return await asyncio.wait_for(job.run(), 300), at_start, engine
        finally:
            await engine.close()
            await trainer.close()

    result, at_start, engine = asyncio.run(main())
    assert engine.first is not None
    version, state = engine.first
    assert version == 3
    assert state.keys() == at_start.keys()
    for name, tensor in at_start.items():
        assert torch.equal(state[name], tensor), name
    assert engine.versions and min(engine.versions) >= 3
    assert [s.version for s in result.steps] == [4, 5, 6]
    assert result.max_staleness <= result.config.staleness
    if knobs.get("mode") == "colocated":  # on-policy: nothing can be stale
        assert result.dropped == 0
