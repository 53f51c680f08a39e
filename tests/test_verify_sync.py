"""Verified weight sync (issue #40): ``asyncflow_core.sync.verify`` catches planted wrong loads
on the reference and HF engines, by fingerprint (read from the engine's own storage) and by
the probe, and the RL job stops on one with an error naming the engine, the version and the
tensor; ``verify_sync`` chooses when."""

from __future__ import annotations

import asyncio
import copy
import re
from collections.abc import Sequence
from typing import Any, ClassVar

import pytest
import torch
from asyncflow_reference.engines import TorchInferenceEngine, TorchTrainEngine
from asyncflow_reference.model import ModelConfig

from asyncflow_core.contracts.errors import ConfigError, TaskFailedError
from asyncflow_core.contracts.protocols import SamplingParams, Version
from asyncflow_core.flow.rlflow import RLConfig, RLEngines, RLJob
from asyncflow_core.sync.transports import InProcessWeightSync
from asyncflow_core.sync.verify import (
    SupportsWeightFingerprints,
    SyncVerificationError,
    VerifySchedule,
    verify_engine,
)

Weights = Sequence[tuple[str, torch.Tensor]]

# peaky (init_std 0.5) so a stale tensor moves the probe's log-probs well past the tolerance
MODEL = ModelConfig(vocab_size=24, d_model=32, n_layers=1, n_heads=2, max_seq_len=64, init_std=0.5)
TIED = ModelConfig(
    vocab_size=24, d_model=32, n_layers=1, n_heads=2, max_seq_len=64, init_std=0.5,
    tie_embeddings=True,
)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Planted wrong loads: each a minimal change an engine could ship
# --------------------------------------------------------------------------------------------
class SkipsOneTensor(TorchInferenceEngine):
    """Drops one tensor of every load (a name-mapping bug)."""

    async def load_weights(
        self, weights: Sequence[tuple[str, torch.Tensor]], version: Version
    ) -> None:
        await super().load_weights(
            [(n, t) for n, t in weights if n != "blocks.0.fc2.weight"], version
        )


class LoadsOneShard(TorchInferenceEngine):
    """Loads only the q shard of the stacked qkv projection (k and v stay stale)."""

    async def load_weights(
        self, weights: Sequence[tuple[str, torch.Tensor]], version: Version
    ) -> None:
        held = self.model.state_dict()
        d = self.config.d_model
        fixed = [
            (n, torch.cat([t[:d], held[n][d:]]) if n.endswith("qkv.weight") else t)
            for n, t in weights
        ]
        await super().load_weights(fixed, version)


class LoadsAStaleCopy(TorchInferenceEngine):
    """Loads into a copy of the model it does not generate with, and bumps the version."""

    async def load_weights(
        self, weights: Sequence[tuple[str, torch.Tensor]], version: Version
    ) -> None:
        shadow = copy.deepcopy(self.model)
        shadow.load_state_dict(dict(weights), strict=False)
        await super().load_weights([], version)


class BreaksTheTie(TorchInferenceEngine):
    """A tied model whose load gives the embedding a tensor of its own: the LM head keeps the
    old values."""

    async def load_weights(
        self, weights: Sequence[tuple[str, torch.Tensor]], version: Version
    ) -> None:
        head = self.model.lm_head
        head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        await super().load_weights(weights, version)


class NoFingerprints:
    """An engine seen without ``weight_fingerprints``: the check falls back to the probe."""

    def __init__(self, engine: TorchInferenceEngine) -> None:
        self.engine = engine

    @property
    def weight_version(self) -> Version:
        return self.engine.weight_version

    def __getattr__(self, name: str) -> Any:
        if name == "weight_fingerprints":
            raise AttributeError(name)
        return getattr(self.engine, name)


PLANTED = {
    "skips-one-tensor": (SkipsOneTensor, MODEL, "'blocks.0.fc2.weight'"),
    "one-shard-of-stacked-qkv": (LoadsOneShard, MODEL, "'blocks.0.qkv.weight'"),
    "stale-copy": (LoadsAStaleCopy, MODEL, "'tok_emb.weight'"),
    "broken-tie": (BreaksTheTie, TIED, "'lm_head.weight' (tied to 'tok_emb.weight')"),
}


async def _synced(engine: Any, trainer: TorchTrainEngine, version: int) -> None:
    """The trainer's weights into ``engine`` through the in-process transport, as ``version``
    (the trainer's version is set to match, as a train step would)."""
    sync = InProcessWeightSync([engine])
    await sync.init()
    await sync.start()
    async for bucket in trainer.export_weights(1 << 30):
        await sync.update(bucket)
    await sync.finish(version)


def _pair(cls: type[TorchInferenceEngine], config: ModelConfig) -> tuple[Any, TorchTrainEngine]:
    return cls(config, max_batch=4, seed=0, threads=1), TorchTrainEngine(config, seed=1, threads=1)


def test_a_correct_sync_is_proven_by_fingerprint_and_by_probe() -> None:
    async def main() -> None:
        for config in (MODEL, TIED):
            engine, trainer = _pair(TorchInferenceEngine, config)
            try:
                assert isinstance(engine, SupportsWeightFingerprints)
                await _synced(engine, trainer, trainer.weight_version)
                report = await verify_engine(engine, trainer, 0, who="engine")
                assert report.kind == "fingerprint"
                assert report.checked == len(list(trainer.model.unique_state())) + int(
                    config.tie_embeddings
                )  # every exported tensor, and the tied head against the embedding
                probe = await verify_engine(NoFingerprints(engine), trainer, 0, who="engine")
                assert probe.kind == "probe" and probe.checked > 0
                assert probe.max_abs <= 1e-4
            finally:
                await engine.close()
                await trainer.close()

    asyncio.run(main())


@pytest.mark.parametrize("planted", sorted(PLANTED))
def test_every_planted_wrong_load_is_caught_naming_the_tensor(planted: str) -> None:
    cls, config, named = PLANTED[planted]

    async def main() -> None:
        engine, trainer = _pair(cls, config)
        try:
            await _synced(engine, trainer, 0)
            with pytest.raises(SyncVerificationError) as caught:
                await verify_engine(engine, trainer, 0, who="rollout engine 3")
            message = str(caught.value)
            assert "version 0" in message and "rollout engine 3" in message
            assert named in message, message
            assert caught.value.engine == "rollout engine 3" and caught.value.differences
            # the probe (no fingerprints) sees it too: each fault moves the log-probs
            with pytest.raises(SyncVerificationError, match="probe's log-probs differ"):
                await verify_engine(NoFingerprints(engine), trainer, 0, who="rollout engine 3")
        finally:
            await engine.close()
            await trainer.close()

    asyncio.run(main())


def test_the_fingerprint_reads_the_engines_storage_not_what_it_was_sent() -> None:
    """A change made to the engine's weights directly, bypassing every sync, fails the check:
    the engine-side fingerprint comes from the model it generates with."""

    async def main() -> None:
        engine, trainer = _pair(TorchInferenceEngine, MODEL)
        try:
            await _synced(engine, trainer, 0)
            await verify_engine(engine, trainer, 0, who="engine")
            with torch.no_grad():
                engine.model.blocks[0].fc1.weight[3, 5] += 1e-3  # one value, in place
            with pytest.raises(SyncVerificationError, match=r"1 of \d+ tensor\(s\) differ"):
                await verify_engine(engine, trainer, 0, who="engine")
        finally:
            await engine.close()
            await trainer.close()

    asyncio.run(main())


def test_a_version_mismatch_is_reported_before_anything_is_hashed() -> None:
    async def main() -> None:
        engine, trainer = _pair(TorchInferenceEngine, MODEL)
        try:
            await _synced(engine, trainer, 4)
            with pytest.raises(SyncVerificationError, match="reports version 4"):
                await verify_engine(engine, trainer, 5, who="engine")
        finally:
            await engine.close()
            await trainer.close()

    asyncio.run(main())


# --------------------------------------------------------------------------------------------
# The HF engine (tied Qwen2-shaped model): fingerprints with the tie
# --------------------------------------------------------------------------------------------
def test_hf_engine_fingerprints_catch_a_skipped_tensor_and_a_broken_tie() -> None:
    pytest.importorskip("transformers")
    from asyncflow_hf import HFInferenceEngine, HFTrainEngine
    from asyncflow_hf.models import tiny_config

    async def main() -> None:
        config = tiny_config("tiny-qwen2", vocab_size=32)
        assert config.tie_word_embeddings
        engine = HFInferenceEngine(config, max_batch=2, threads=1, seed=0)
        trainer = HFTrainEngine(config, threads=1, seed=1)
        try:
            await _synced(engine, trainer, 0)
            report = await verify_engine(engine, trainer, 0, who="hf")
            assert report.kind == "fingerprint"
            head = engine.model.get_output_embeddings()
            head.weight = torch.nn.Parameter(head.weight.detach().clone() + 1, requires_grad=False)
            with pytest.raises(SyncVerificationError, match=r"'lm_head.weight' \(tied to"):
                await verify_engine(engine, trainer, 0, who="hf")
        finally:
            await engine.close()
            await trainer.close()

    asyncio.run(main())


# --------------------------------------------------------------------------------------------
# In the RL job
# --------------------------------------------------------------------------------------------
def _job(engine: Any, trainer: TorchTrainEngine, **knobs: Any) -> RLJob:
    cfg = RLConfig(steps=3, prompts_per_step=2, n=2, sampling=SamplingParams(max_tokens=4), **knobs)
    return RLJob(
        cfg, RLEngines([engine], trainer), ([1, 2, 3] for _ in range(10_000)),
        lambda p, r: float(sum(r) % 3),
    )  # fmt: skip


@pytest.mark.parametrize("weight_sync", ["staged", "blocking"])
def test_the_job_verifies_its_first_sync_by_default(weight_sync: str) -> None:
    async def main() -> None:
        engine, trainer = _pair(TorchInferenceEngine, MODEL)
        try:
            job = _job(engine, trainer, weight_sync=weight_sync)
            await job.run()
            (report,) = job.verified  # "first": the first sync of the run, version 1
            assert (report.kind, report.version) == ("fingerprint", 1)
            every = _job(engine, trainer, weight_sync=weight_sync, verify_sync="always")
            await every.run()  # from version 3: the syncs of 4 and 5 (and of 3 if behind)
            versions = [r.version for r in every.verified]
            assert versions[-2:] == [4, 5] and set(versions) <= {3, 4, 5}
            assert {r.kind for r in every.verified} == {"fingerprint"}
        finally:
            await engine.close()
            await trainer.close()

    asyncio.run(main())


def test_the_job_stops_on_a_wrong_load_naming_engine_version_and_tensor() -> None:
    async def main() -> None:
        engine, trainer = _pair(SkipsOneTensor, MODEL)
        try:
            with pytest.raises(TaskFailedError) as failed:
                await _job(engine, trainer).run()
            cause = failed.value.__cause__
            assert isinstance(cause, SyncVerificationError)
            assert cause.version == 1 and cause.engine == "rollout engine 0 (SkipsOneTensor)"
            assert "'blocks.0.fc2.weight'" in str(cause)
            # off: the same job trains on (the setting is the user's)
            await _job(engine, trainer, verify_sync="off").run()
        finally:
            await engine.close()
            await trainer.close()

    asyncio.run(main())


def test_the_schedule_and_its_refusals() -> None:
    def due(setting: str, n: int) -> list[bool]:
        schedule = VerifySchedule(setting)
        return [schedule.due() for _ in range(n)]

    assert due("off", 3) == [False] * 3
    assert due("first", 3) == [True, False, False]
    assert due("always", 3) == [True] * 3
    assert due("every 2", 5) == [True, False, True, False, True]
    for bad in ("sometimes", "every 0", "every", 3):
        with pytest.raises(ConfigError, match=re.escape("verify_sync must be")):
            RLConfig(steps=1, prompts_per_step=1, verify_sync=bad).validate()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="verify_logprob_atol must be a number > 0"):
        RLConfig(steps=1, prompts_per_step=1, verify_logprob_atol=0).validate()


class HangsOnTheProbe(TorchInferenceEngine):
    """Never answers the verification probe."""

    async def generate(self, request: Any) -> Any:
        if request.request_id.startswith("asyncflow-verify"):
            await asyncio.Event().wait()
        return await super().generate(request)


def test_a_hung_verification_ends_in_a_named_error() -> None:
    class NoPrints:  # seen without fingerprints: the probe runs
        def __init__(self, engine: HangsOnTheProbe) -> None:
            self.engine = engine

        def __getattr__(self, name: str) -> Any:
            if name == "weight_fingerprints":
                raise AttributeError(name)
            return getattr(self.engine, name)

    async def main() -> None:
        engine, trainer = _pair(HangsOnTheProbe, MODEL)
        try:
            job = _job(NoPrints(engine), trainer, verify_timeout_s=0.5)
            with pytest.raises(TaskFailedError) as failed:
                await job.run()
            cause = failed.value.__cause__
            assert isinstance(cause, SyncVerificationError)
            assert "verify_timeout_s=0.5" in str(cause) and "rollout engine 0" in str(cause)
        finally:
            await engine.close()
            await trainer.close()

    asyncio.run(main())


@pytest.mark.parametrize("layout", ["nested", "list"])
def test_the_probe_hands_the_trainer_its_own_batch_layout(layout: str) -> None:
    """The probe's batch comes through the store in the trainer's ``batch_layout``, as the
    job's batches do."""

    class Trainer(TorchTrainEngine):
        batch_layout = layout
        seen: ClassVar[list[Any]] = []

        async def compute_logprobs(self, batch: Any) -> torch.Tensor:
            self.seen.append(batch["response"])
            return await super().compute_logprobs(batch)

    async def main() -> None:
        engine = TorchInferenceEngine(MODEL, max_batch=4, seed=0, threads=1)
        trainer = Trainer(MODEL, seed=1, threads=1)
        try:
            await _synced(engine, trainer, 0)
            report = await verify_engine(NoFingerprints(engine), trainer, 0, who="engine")
            assert report.kind == "probe" and report.max_abs <= 1e-4
            (response,) = Trainer.seen
            assert isinstance(response, list) == (layout == "list")
        finally:
            await engine.close()
            await trainer.close()

    asyncio.run(main())
