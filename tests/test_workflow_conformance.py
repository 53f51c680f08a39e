"""The workflow laws (asyncflow_conformance.workflow) on the simulated engines (virtual clock),
on a tiny real-time engine pair (plain event loop; an engine that can sleep), and on broken
backends, which must fail the law they break."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import subprocess
import sys
import zlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal
from xml.etree import ElementTree

import pytest
import torch
from asyncflow_conformance import WorkflowConformance
from asyncflow_conformance.workflow import (
    DEFAULT_CASES,
    Recorder,
    RecordingInferenceEngine,
    TrainCall,
    WorkflowCase,
    WorkflowRun,
    check_failure_stops_the_job,
    check_generations_report_synced_versions,
    check_sample_count,
    check_samples_trained_once,
    check_staleness_bounded,
)
from asyncflow_reference.presets import get_preset
from asyncflow_reference.sim import (
    SimInferenceEngine,
    SimTrainEngine,
    SimWeightTransport,
)
from fake_engine_gate import RequestGate

from asyncflow_core.contracts.errors import ConfigError
from asyncflow_core.contracts.protocols import (
    Batch,
    GenerationRequest,
    GenerationResult,
    InferenceEngine,
    LossFn,
    SupportsLoadWeights,
    SupportsPause,
    SupportsSleep,
    Tags,
    TrainMetrics,
    Version,
    WeightBucket,
)
from asyncflow_core.flow.rlflow import RLEngines, RLJob

PRESET = get_preset("qwen2.5-7b-grpo")
# Short responses (median 16 tokens, a few capped at max_tokens=32) keep every job to a few
# hundred engine events; the virtual clock makes the model's seconds free.
COST = dataclasses.replace(
    PRESET.cost, response_median=16.0, response_min_tokens=4, response_max_tokens=64
)


def sim_engines(engine_cls: type[SimInferenceEngine] = SimInferenceEngine) -> RLEngines:
    return RLEngines(
        rollout=[engine_cls(COST, name=f"sim-rollout-{i}", seed=i) for i in range(2)],
        trainer=SimTrainEngine(COST, PRESET.train_devices),
        make_transport=lambda targets: SimWeightTransport(targets, COST),
    )


class TestSimEngines(WorkflowConformance):
    """The reference simulated engines on the virtual clock."""

    def make_engines(self) -> RLEngines:
        return sim_engines()


# --------------------------------------------------------------------------------------------
# A tiny honest engine pair on real time: a token every few milliseconds
# --------------------------------------------------------------------------------------------
class TinyEngine(RequestGate):
    """Generates a token per ``token_s`` seconds; pause (abort/keep), resume, load_weights,
    sleep/wake_up (generation waits while asleep), abort."""

    def __init__(self, token_s: float = 0.001) -> None:
        super().__init__()
        self.token_s = token_s

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        rid = request.request_id
        tokens = list(request.resume_tokens)
        logprobs = list(request.resume_logprobs)
        versions = list(request.resume_versions)
        cap = request.params.max_tokens
        natural = 2 + zlib.crc32(rid.encode()) % 12
        target, reason = (cap, "length") if natural >= cap else (natural, "stop")

        def result(why: Literal["stop", "length", "abort"]) -> GenerationResult:
            return GenerationResult(
                rid, request.prompt_tokens, tuple(tokens), tuple(logprobs), tuple(versions), why
            )

        self._inflight.add(rid)
        try:
            while True:
                await self._wait_runnable(rid)
                if rid in self._aborted:
                    return result("abort")
                if len(tokens) >= target:
                    return result(reason)  # type: ignore[arg-type]
                await asyncio.sleep(self.token_s)
                await self._wait_runnable(rid)  # a pause(keep) freezes the token being made
                if rid in self._aborted:
                    return result("abort")
                tokens.append((len(tokens) * 31 + len(rid)) % 1000)
                logprobs.append(-1.0)
                versions.append(self._version)
                self._made(rid, len(tokens))
        finally:
            self._inflight.discard(rid)
            self._aborted.discard(rid)
            self._ended(rid)

    async def load_weights(
        self, weights: Sequence[tuple[str, torch.Tensor]], version: Version
    ) -> None:
        self._version = version


class TinyTrainer:
    """A trainer whose step takes ``step_s`` seconds and calls the loss on zero log-probs."""

    def __init__(self, step_s: float = 0.005) -> None:
        self.step_s = step_s
        self._version: Version = 0
        self.weight = torch.zeros(4)

    @property
    def weight_version(self) -> Version:
        return self._version

    async def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        return torch.zeros(len(batch), int(batch["response"].shape[1]))

    async def train_step(self, batch: Batch, loss_fn: LossFn) -> TrainMetrics:
        await asyncio.sleep(self.step_s)
        loss, _ = loss_fn(await self.compute_logprobs(batch), batch)
        self._version += 1
        self.weight += 1
        tokens = int(batch.lengths["response"].sum())
        return TrainMetrics(self._version, float(loss), 0.0, len(batch), tokens)

    async def export_weights(self, bucket_bytes: int) -> AsyncIterator[WeightBucket]:
        yield WeightBucket(("w",), (self.weight.clone(),))

    async def save_checkpoint(self, path: str) -> None:
        return None

    async def load_checkpoint(self, path: str) -> None:
        return None


class TestTinyEnginesRealClock(WorkflowConformance):
    """In-test engines that can sleep (colocated mode releases them), on a plain event loop."""

    virtual_clock = False
    steps = 5
    max_tokens = 8

    def make_engines(self) -> RLEngines:
        return RLEngines(rollout=[TinyEngine(), TinyEngine()], trainer=TinyTrainer())


# --------------------------------------------------------------------------------------------
# The proxies claim exactly the abilities of what they wrap
# --------------------------------------------------------------------------------------------
class BareEngine:
    """Only the InferenceEngine protocol: no pause, sleep or load_weights."""

    weight_version = 0

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        raise NotImplementedError

    async def abort(self, request_ids: Sequence[str]) -> None:
        return None

    def stats(self) -> str:
        return "bare"


ABILITIES = (SupportsPause, SupportsSleep, SupportsLoadWeights)
SIM = SimInferenceEngine(COST)


@pytest.mark.parametrize(
    ("engine", "abilities"),
    [
        # whatever the simulator offers today: the proxy must claim the same
        (SIM, tuple(isinstance(SIM, p) for p in ABILITIES)),
        (TinyEngine(), (True, True, True)),
        (BareEngine(), (False, False, False)),
    ],
    ids=["sim", "tiny", "bare"],
)
def test_proxies_claim_exactly_the_wrapped_abilities(
    engine: Any, abilities: tuple[bool, bool, bool]
) -> None:
    proxy = RecordingInferenceEngine.wrap(engine, Recorder(), "e")
    assert isinstance(proxy, InferenceEngine)
    assert tuple(isinstance(proxy, p) for p in ABILITIES) == abilities
    for name in ("pause", "resume", "sleep", "wake_up", "load_weights", "stats", "close"):
        assert hasattr(proxy, name) == hasattr(engine, name), name


# --------------------------------------------------------------------------------------------
# Broken backends fail the laws they break
# --------------------------------------------------------------------------------------------
CASES = {c.id: c for c in DEFAULT_CASES}


class StaleVersionEngine(SimInferenceEngine):
    """Broken: ignores loaded weights in what it reports (every new token says version 0)."""

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        r = await super().generate(request)
        k = len(request.resume_versions)
        return dataclasses.replace(r, versions=r.versions[:k] + (0,) * (len(r.tokens) - k))


class RestampingResumeEngine(SimInferenceEngine):
    """Broken: a resumed prefix comes back stamped with the engine's current version."""

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        r = await super().generate(request)
        k = len(request.resume_versions)
        return dataclasses.replace(r, versions=(self.weight_version,) * k + r.versions[k:])


class _Broken(WorkflowConformance):
    engine_cls: ClassVar[type[SimInferenceEngine]] = SimInferenceEngine

    def make_engines(self) -> RLEngines:
        return sim_engines(self.engine_cls)


class BrokenStale(_Broken):
    engine_cls = StaleVersionEngine
    real_timeout_s = 2.0


class BrokenResume(_Broken):
    engine_cls = RestampingResumeEngine


def test_stale_versions_after_a_load_fail_the_version_law() -> None:
    run = BrokenStale().run_case(CASES["eta1-inflight"])
    with pytest.raises(AssertionError, match=r"started after load_weights\(version=\d+\)"):
        check_generations_report_synced_versions(run)
    # every sample is too stale for the trainer, so the job drops them forever (a livelock on
    # the virtual clock) until the real-time guard cancels it
    assert run.timed_out
    with pytest.raises(AssertionError, match="did not finish within the real-time limit"):
        check_staleness_bounded(run)


def test_restamped_resumed_prefixes_fail_the_version_law() -> None:
    run = BrokenResume().run_case(CASES["eta2-blocking-partial"])
    assert any(c.request.resume_tokens for c in run.recorder.generates), "nothing was resumed"
    with pytest.raises(AssertionError, match="resumed tokens keep their versions"):
        check_generations_report_synced_versions(run)


class HangingTrainer(SimTrainEngine):
    """Broken: the second step never ends. ``spin``: it polls a timer forever (a livelock the
    virtual clock cannot detect); otherwise it waits on an event nobody sets (a deadlock)."""

    spin = False

    async def train_step(self, batch: Batch, loss_fn: LossFn) -> TrainMetrics:
        if self.steps == 1:
            if self.spin:
                while True:
                    await asyncio.sleep(1.0)
            await asyncio.Event().wait()
        return await super().train_step(batch, loss_fn)


class SpinningTrainer(HangingTrainer):
    spin = True


class BrokenHang(WorkflowConformance):
    deadlock_timeout_s = 0.5
    real_timeout_s = 2.0
    trainer_cls: ClassVar[type[SimTrainEngine]] = HangingTrainer

    def make_engines(self) -> RLEngines:
        engines = sim_engines()
        engines.trainer = self.trainer_cls(COST, PRESET.train_devices)
        return engines


class BrokenSpin(BrokenHang):
    trainer_cls = SpinningTrainer


@pytest.mark.parametrize("suite", [BrokenHang, BrokenSpin], ids=["deadlock", "livelock"])
def test_a_hanging_job_fails_in_bounded_time(suite: type[BrokenHang]) -> None:
    run = suite().run_case(CASES["eta1-staged"])
    assert run.real_s < 15
    with pytest.raises(AssertionError, match=r"did not finish|raised SimulationDeadlockError"):
        check_samples_trained_once(run)


def _synthetic_run(calls: list[TrainCall], case: WorkflowCase) -> WorkflowRun:
    """A run whose trainer saw ``calls`` (for laws that only a broken workflow could break)."""
    suite = TestSimEngines()
    cfg = suite.config_for(case)
    run = suite.run_case(case)
    run.recorder.train_steps[:] = calls
    assert run.result is not None and len(calls) == cfg.steps
    return run


def test_a_row_trained_twice_fails_the_once_law() -> None:
    case = CASES["eta1-staged"]
    n, groups = TestSimEngines.n, TestSimEngines.prompts_per_step
    b, last = n * groups, TestSimEngines.steps - 1

    def call(step: int, first_row: int) -> TrainCall:
        tags = tuple(Tags(group=step * groups + i // n, versions=(step,)) for i in range(b))
        return TrainCall(step, tuple(range(first_row, first_row + b)), tags, step + 1)

    good = [call(s, s * b) for s in range(last + 1)]
    check_samples_trained_once(_synthetic_run(good, case))
    twice = [*good[:-1], call(last, 0)]  # the last step retrains the rows of the first
    with pytest.raises(AssertionError, match="row 0 was trained twice"):
        check_samples_trained_once(_synthetic_run(twice, case))


def test_a_job_without_the_fault_fails_the_failure_law() -> None:
    run = TestSimEngines().run_case(CASES["eta1-staged"])  # no fault injected
    check_sample_count(run)
    with pytest.raises(AssertionError, match="before the fault could be injected"):
        check_failure_stops_the_job(run, "reward")


# --------------------------------------------------------------------------------------------
# The guide's snippet runs as written
# --------------------------------------------------------------------------------------------
README = Path(__file__).resolve().parent.parent / "conformance" / "README.md"


def test_the_readme_snippet_passes_from_outside(tmp_path: Path) -> None:
    text = README.read_text()
    section = text[text.index("## Test engines in the RL workflow") :]
    snippet = re.search(r"```python\n(.*?)```", section, re.S)
    assert snippet is not None
    test_file = tmp_path / "test_my_engines_workflow.py"
    test_file.write_text(snippet.group(1))
    report = tmp_path / "report.xml"
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "asyncflow_conformance", "-p", "no:cacheprovider",
         "-q", str(test_file), f"--junitxml={report}"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and report.exists(), out[-3000:]
    cases = ElementTree.parse(report).getroot().iter("testcase")
    outcomes: dict[str, str | None] = {}
    for case in cases:
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        outcomes[case.attrib["name"]] = None if problem is None else problem.get("message", "")
    laws, faults = 5, 3
    assert len(outcomes) == len(DEFAULT_CASES) * (laws + 2 * faults), sorted(outcomes)
    failed = {name: message for name, message in outcomes.items() if message is not None}
    assert not failed, failed


class NoInflightEngine(SimInferenceEngine):
    """An engine that says it cannot load weights while it generates (as the vLLM and SGLang
    adapters do)."""

    inflight_weight_load_refusal: ClassVar[str] = "its loader needs generation paused"


class NoInflight(_Broken):
    engine_cls = NoInflightEngine


def test_an_engine_refusing_inflight_loads_skips_that_case_only() -> None:
    """The job refuses weight_sync='inflight' for such an engine before anything runs, naming
    it and the alternatives; the suite reports the case as skipped with that reason (an
    optional ability), and runs the other cases as usual."""
    with pytest.raises(pytest.skip.Exception, match="its loader needs generation paused"):
        NoInflight().run_case(CASES["eta1-inflight"])
    run = NoInflight().run_case(CASES["eta1-staged"])
    run.require_result()
    config = NoInflight().config_for(CASES["eta1-inflight"])
    with pytest.raises(ConfigError, match=r"rollout engine 0 \(NoInflightEngine\).*'staged'"):
        RLJob(config, sim_engines(NoInflightEngine), [[1, 2]], lambda p, r: 0.0)
