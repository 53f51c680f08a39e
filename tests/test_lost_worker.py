"""A lost rollout worker does not end the run; a lost trainer does, naming what died and the
checkpoint to resume from. The dying engines are real child processes
(``ProcessInferenceEngine`` / ``ProcessTrainEngine``) killed with SIGKILL: by the test, at a
moment chosen from the job's own state (requests in flight on the victim), or by a failpoint
inside the child."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from asyncflow_reference.engines import TorchInferenceEngine, TorchTrainEngine
from asyncflow_reference.model import ModelConfig, TransformerLM

from asyncflow_core.errors import EngineLostError, TaskFailedError
from asyncflow_core.process import ProcessInferenceEngine
from asyncflow_core.protocols import GenerationRequest, SamplingParams
from asyncflow_core.rlflow import RLConfig, RLEngines, RLJob, RLResult, StepRecord

ROOT = Path(__file__).resolve().parents[1]
CFG = ModelConfig(vocab_size=12, d_model=16, n_layers=1, n_heads=2, max_seq_len=24)


def _prompts():  # type: ignore[no-untyped-def]
    i = 0
    while True:
        yield tuple((i + k) % 11 + 1 for k in range(4))
        i += 1


def _reward(prompt: object, response: list[int]) -> float:
    return float(sum(response) % 2)


def _rollout(seed: int) -> ProcessInferenceEngine:
    make = functools.partial(TorchInferenceEngine, CFG, max_batch=16, seed=seed)
    return ProcessInferenceEngine(make, threads=1, name=f"rollout-{seed}")


def _job(engines: list[ProcessInferenceEngine], steps: int, **kw: object) -> RLJob:
    config = RLConfig(
        steps=steps, prompts_per_step=4, n=2, staleness=1,
        sampling=SamplingParams(max_tokens=12), **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    trainer = TorchTrainEngine(TransformerLM(CFG, seed=0), lr=1e-3, seed=0)
    return RLJob(config, RLEngines(engines, trainer), _prompts(), _reward)  # type: ignore[arg-type]


@pytest.mark.parametrize("weight_sync", ["staged", "blocking"])
def test_a_killed_rollout_process_does_not_end_the_run(weight_sync: str) -> None:
    engines = [_rollout(1), _rollout(2)]
    victim = engines[1]
    killed: list[int] = []
    job = _job(engines, 10, weight_sync=weight_sync)  # type: ignore[arg-type]

    async def kill_when_busy() -> None:
        # evidence, not timing: the job's own registry shows requests on the victim
        while not any(e is victim for e in job._inflight.values()):
            await asyncio.sleep(0.001)
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        killed.append(len(job.steps))

    async def main() -> RLResult:
        watcher = asyncio.create_task(kill_when_busy())
        try:
            result = await job.run()
        finally:
            watcher.cancel()
        with pytest.raises(EngineLostError, match="SIGKILL"):  # and stays lost
            await victim.generate(GenerationRequest("x", (1, 2), SamplingParams(max_tokens=2)))
        return result

    try:
        result = asyncio.run(main())
    finally:
        for e in engines:
            asyncio.run(e.close())
    assert killed, "the victim never had a request in flight"
    assert set(job.lost) == {"1"} and "SIGKILL" in job.lost["1"]
    assert [s.version for s in result.steps] == list(range(1, 11))  # the run completed
    groups = [g for s in result.steps for g in s.groups]
    assert len(groups) == len(set(groups))  # no group trained twice
    assert result.samples == 10 * 8
    # the survivor kept getting the weights after the loss: the last steps trained samples
    # at most η = 1 version old
    assert result.steps[-1].max_staleness <= 1
    assert engines[0].weight_version >= 9


def test_losing_every_rollout_engine_stops_the_run_with_its_reason() -> None:
    engines = [_rollout(1)]

    def on_step(record: StepRecord) -> None:
        if record.version == 2:
            assert engines[0].pid is not None
            os.kill(engines[0].pid, signal.SIGKILL)

    job = _job(engines, 20)
    job.on_step = on_step
    try:
        with pytest.raises(TaskFailedError, match="every rollout engine is lost"):
            asyncio.run(job.run())
    finally:
        asyncio.run(engines[0].close())
    assert set(job.lost) == {"0"}


def _cli(out: Path, *sets: str, failpoints: str) -> subprocess.CompletedProcess[str]:
    args = ["--out", str(out), "--quiet"]
    for s in (
        "rl.steps=8", "rl.prompts_per_step=8", "rl.n=4", "task.warmup_steps=5",
        "eval_prompts=8", "checkpoint.every=2", *sets,
    ):  # fmt: skip
        args += ["--set", s]
    return subprocess.run(
        [sys.executable, "-m", "asyncflow_core.cli", "run", *args],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
        env={**os.environ, "ASYNCFLOW_FAILPOINTS": failpoints},
    )  # fmt: skip


def test_main_job_survives_a_rollout_process_killed_mid_request(tmp_path: Path) -> None:
    """Rollout engine 0 dies at its 20th request; the run trains every step on engine 1 and
    evaluates there too."""
    done = _cli(
        tmp_path, "rollout.process=true", "rollout.engines=2",
        failpoints="process.rollout-0.generate=20",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "rollout engine 0 (ProcessInferenceEngine) is lost" in done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["samples"] == 8 * 32
    assert list(summary["extra"]["lost_engines"]) == ["0"]
    assert summary["eval_reward"] is not None
    assert "lost rollout engines" in done.stdout


def test_a_lost_trainer_stops_the_run_naming_it_and_the_checkpoint(tmp_path: Path) -> None:
    done = _cli(tmp_path, "train.process=true", failpoints="process.trainer.train_step=5")
    assert done.returncode == 1
    assert "EngineLostError: trainer: its process" in done.stderr
    assert "killed by SIGKILL" in done.stderr
    assert f"continue with asyncflow run --resume {tmp_path}" in done.stderr
    assert "checkpoints/step-00000004" in done.stderr
