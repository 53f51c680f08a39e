"""The DeepSpeed adapter (``asyncflow_deepspeed``), run for real on CPU with gloo.

* The ``TrainEngine`` conformance suite, in this process (a world of one), for ZeRO stages
  0-3 in fp32 and in bf16, and on two rank processes at ZeRO-3.
* The engine-pair suite with the reference inference engine: after a sync, DeepSpeed's
  log-probs of the engine's tokens are the engine's, under every sampling setting (ZeRO-0
  fp32; ZeRO-3 bf16 and two ranks on one setting each).
* The same numbers as the reference trainer: DeepSpeed's micro-batching and accumulation
  give the reference's losses, gradient norms and weights.
* Every stage x precision on **two rank processes** started by the test (``launch``): the
  sharded step equals the one-process reference step, rank 0 exports full weights, DeepSpeed
  checkpoints restore exactly, and a bad batch or a failing loss on one rank changes nothing
  on either.
* Failure paths: a loss that fails mid-step, sleep on stage 0, bad configuration, DeepSpeed
  missing or of an untested version.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import secrets
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from asyncflow_conformance import EnginePairConformance, TrainEngineConformance
from asyncflow_conformance.engines import padded_batch
from asyncflow_conformance.pair import PAIR_SETTINGS
from asyncflow_reference.engines import TorchInferenceEngine, TorchTrainEngine
from asyncflow_reference.model import ModelConfig, TransformerLM

from asyncflow_core.contracts.errors import (
    CheckpointError,
    CheckpointRefusedError,
    ConfigError,
    EngineError,
    MissingExtraError,
)
from asyncflow_core.contracts.protocols import Batch, TrainEngine, TrainMetrics
from asyncflow_core.engines.lmtrain import CHECKPOINT_KEY_ENV, sign_manifest
from asyncflow_core.training.rl import policy_gradient_loss

pytest.importorskip("deepspeed", reason="the [deepspeed] extra is not installed")

from asyncflow_deepspeed import (
    CHECKPOINT_META,
    DeepSpeedTrainEngine,
    check_version,
    launch,
    require_deepspeed,
)

CONFIG = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)


@pytest.fixture(autouse=True)
def _private_checkpoint_key(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: Any) -> Path:
    """Every test signs with a key of its own, never the user's (rank processes inherit it)."""
    config_home = tmp_path_factory.mktemp("xdg-config")
    monkeypatch.delenv(CHECKPOINT_KEY_ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config_home))
    return Path(config_home)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def batch5() -> Batch:
    """Five rows: two ranks get 3 and 2, and micro-batches of 2 give them 2 and 1."""
    return padded_batch(
        prompts=[[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [3, 3]],
        responses=[[11, 12, 13, 14], [15], [16, 17, 18], [19, 20], [5, 6, 7]],
        advantages=[1.0, -1.0, 0.5, -0.5, 0.2],
    )


async def weights(engine: TrainEngine, bucket_bytes: int = 10_000) -> dict[str, torch.Tensor]:
    return {
        n: t for bucket in [b async for b in engine.export_weights(bucket_bytes)] for n, t in bucket
    }


class FailOn:
    """A picklable loss that fails (raises, or returns NaN) on a micro-batch holding a row
    whose advantage is ``marker``; otherwise the policy-gradient loss."""

    def __init__(self, marker: float, how: str = "nan") -> None:
        self.marker, self.how = marker, how

    def __call__(
        self, logprobs: torch.Tensor, batch: Batch
    ) -> tuple[torch.Tensor, Mapping[str, float]]:
        if bool((batch["advantage"] == self.marker).any()):
            if self.how == "raise":
                raise ValueError("the loss failed on purpose")
            return logprobs.sum() * float("nan"), {}
        return policy_gradient_loss(logprobs, batch)


# --------------------------------------------------------------------------------------------
# Conformance, in this process
# --------------------------------------------------------------------------------------------
class _DeepSpeedSuite(TrainEngineConformance):
    zero_stage: ClassVar[int] = 0
    dtype: ClassVar[str] = "fp32"
    required_fields = ("prompt", "response", "advantage")
    logprob_atol = 0.0  # the same weights give the same log-probs, bit for bit

    def make_engine(self) -> TrainEngine:
        return DeepSpeedTrainEngine(
            CONFIG, zero_stage=self.zero_stage, dtype=self.dtype,  # type: ignore[arg-type]
            micro_batch_size=2, lr=1e-2, threads=1,
        )  # fmt: skip

    def close_engine(self, engine: Any) -> Any:
        return engine.close()

    def expected_parameters(self, engine: Any) -> Mapping[str, list[int]]:
        return {n: list(t.shape) for n, t in TransformerLM(CONFIG).state_dict().items()}

    def make_other_engine(self) -> TrainEngine:
        # a longer context: the position table's shape differs, every other tensor fits
        other = dataclasses.replace(CONFIG, max_seq_len=2 * CONFIG.max_seq_len)
        return DeepSpeedTrainEngine(other, zero_stage=self.zero_stage, dtype=self.dtype, threads=1)  # type: ignore[arg-type]


class TestConformanceStage0(_DeepSpeedSuite):
    zero_stage = 0


class TestConformanceStage1(_DeepSpeedSuite):
    zero_stage = 1


class TestConformanceStage2(_DeepSpeedSuite):
    zero_stage = 2


class TestConformanceStage3(_DeepSpeedSuite):
    zero_stage = 3


class TestConformanceStage0Bf16(_DeepSpeedSuite):
    zero_stage, dtype = 0, "bf16"


class TestConformanceStage1Bf16(_DeepSpeedSuite):
    zero_stage, dtype = 1, "bf16"


class TestConformanceStage2Bf16(_DeepSpeedSuite):
    zero_stage, dtype = 2, "bf16"


class TestConformanceStage3Bf16(_DeepSpeedSuite):
    zero_stage, dtype = 3, "bf16"


@pytest.mark.slow
class TestConformanceTwoRanksStage3(_DeepSpeedSuite):
    """The suite on two rank processes (``launch``: an ``SPMDTrainEngine``), ZeRO-3: the
    hardest layout (parameters themselves sharded, every forward a collective)."""

    zero_stage = 3

    def make_engine(self) -> TrainEngine:
        return launch(CONFIG, 2, zero_stage=self.zero_stage, micro_batch_size=2, lr=1e-2)


# Each law here starts two rank processes (~8 s idle). The laws below hold code every rank runs
# alike on its own shard (argument checks, per-row scoring, the loss's result, field layouts,
# the checkpoint's version, the driver's pickling and threads, which TestProcessTrainEngine
# holds); they run on the one-process ZeRO-3 classes above. What two ranks add (shards and
# their reassembly, collectives, metrics summed over ranks, ranks agreeing before a collective:
# the bad-row, malformed-batch, one-row, off-support,
# call-order and checkpoint laws) stays here.
for _law in (
    "test_bad_bucket_bytes_raise",
    "test_loading_a_missing_checkpoint_raises",
    "test_a_batch_missing_a_field_is_rejected",
    "test_a_batch_without_sampling_fields_is_scored_at_the_default",
    "test_compute_logprobs_applies_the_sampling_fields",
    "test_export_is_stable_without_a_step",
    "test_checkpoint_restores_the_version",
    "test_train_step_leaves_the_event_loop_free",
    "test_train_step_keeps_no_reference_to_the_batch",
    "test_a_malformed_loss_result_is_rejected",
    "test_every_batch_layout_is_read_alike",
):
    assert callable(getattr(TestConformanceTwoRanksStage3, _law)), _law  # a renamed law fails
    setattr(TestConformanceTwoRanksStage3, _law, None)


# --------------------------------------------------------------------------------------------
# With the reference inference engine: the pair's log-probs agree
# --------------------------------------------------------------------------------------------
PAIR_MODEL = ModelConfig(
    vocab_size=24, d_model=32, n_layers=2, n_heads=4, max_seq_len=32, init_std=0.5
)  # peaky: a semantics bug shows far above the tolerance


class TestPairStage0(EnginePairConformance):
    vocab_size = PAIR_MODEL.vocab_size
    max_tokens = 8
    zero_stage: ClassVar[int] = 0
    dtype: ClassVar[str] = "fp32"
    real_timeout_s = 180.0

    def make_inference(self) -> TorchInferenceEngine:
        return TorchInferenceEngine(PAIR_MODEL, max_batch=16, seed=0)

    def make_trainer(self) -> TrainEngine:
        return DeepSpeedTrainEngine(
            PAIR_MODEL, zero_stage=self.zero_stage, dtype=self.dtype,  # type: ignore[arg-type]
            micro_batch_size=4, lr=1e-2, seed=1, threads=1,
        )  # fmt: skip

    def close_engine(self, engine: Any) -> Any:
        return engine.close()


class TestPairStage3Bf16(TestPairStage0):
    """bf16 training against the fp32 engine: the trainer's bf16 logits differ in the last
    bits, hence the looser (bf16) tolerances."""

    zero_stage, dtype = 3, "bf16"
    logprob_atol, logprob_max_atol = 5e-2, 0.5
    pair_settings = PAIR_SETTINGS[-1:]


class TestPairTwoRanksStage3(TestPairStage0):
    zero_stage = 3
    pair_settings = PAIR_SETTINGS[-1:]

    def make_trainer(self) -> TrainEngine:
        return launch(PAIR_MODEL, 2, zero_stage=3, micro_batch_size=4, lr=1e-2, seed=1)


# --------------------------------------------------------------------------------------------
# The reference's numbers
# --------------------------------------------------------------------------------------------
async def _steps(engine: Any, n: int = 3) -> list[TrainMetrics]:
    return [await engine.train_step(batch5(), policy_gradient_loss) for _ in range(n)]


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_one_rank_matches_the_reference_trainer(zero_stage: int) -> None:
    """Micro-batches of 2 over 5 rows, DeepSpeed's accumulation and clipping: the same losses,
    gradient norms and weights as ``TorchTrainEngine`` (fp32)."""

    async def body() -> None:
        ds = DeepSpeedTrainEngine(CONFIG, zero_stage=zero_stage, micro_batch_size=2, lr=1e-2)
        ref = TorchTrainEngine(CONFIG, micro_batch_size=2, lr=1e-2)
        try:
            assert torch.equal(
                await ds.compute_logprobs(batch5()), await ref.compute_logprobs(batch5())
            )
            mine, theirs = await _steps(ds), await _steps(ref)
            for a, b in zip(mine, theirs, strict=True):
                assert (a.version, a.samples, a.tokens) == (b.version, b.samples, b.tokens)
                assert a.loss == pytest.approx(b.loss, rel=1e-5)
                assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)
                assert a.extra["pg_loss"] == pytest.approx(b.extra["pg_loss"], rel=1e-5)
            assert mine[0].extra["micro_batches"] == 3
            got, want = await weights(ds), await weights(ref)
            assert list(got) == list(want)
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
        finally:
            await ds.close()
            await ref.close()

    run(body())


@pytest.mark.parametrize(("zero_stage", "how"), [(0, "raise"), (2, "nan"), (3, "nan")])
def test_a_loss_failing_mid_step_changes_nothing(zero_stage: int, how: str) -> None:
    """The loss fails on the third micro-batch, after two backwards: EngineError (or the
    loss's own error), no version, and the gradients already accumulated are dropped: the
    next good step gives exactly what a fresh engine's first step gives."""

    async def body() -> None:
        make = lambda: DeepSpeedTrainEngine(  # noqa: E731
            CONFIG, zero_stage=zero_stage, micro_batch_size=2, lr=1e-2
        )
        engine, fresh = make(), make()
        try:
            with pytest.raises((EngineError, ValueError), match=r"non-finite|on purpose"):
                await engine.train_step(batch5(), FailOn(0.2, how))  # row 4: micro-batch 3
            assert engine.weight_version == 0
            (a,) = await _steps(engine, 1)
            (b,) = await _steps(fresh, 1)
            assert a.version == b.version == 1 and a.loss == b.loss
            got, want = await weights(engine), await weights(fresh)
            assert all(torch.equal(got[n], want[n]) for n in want)
        finally:
            await engine.close()
            await fresh.close()

    run(body())


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_sleep_offloads_and_wake_up_restores_the_optimizer(zero_stage: int) -> None:
    async def body() -> None:
        engine = DeepSpeedTrainEngine(CONFIG, zero_stage=zero_stage, micro_batch_size=2)
        twin = DeepSpeedTrainEngine(CONFIG, zero_stage=zero_stage, micro_batch_size=2)
        try:
            await _steps(engine, 1)
            await _steps(twin, 1)
            await engine.sleep()
            await engine.wake_up()
            (a,) = await _steps(engine, 1)
            (b,) = await _steps(twin, 1)
            assert a.loss == b.loss and a.version == 2
        finally:
            await engine.close()
            await twin.close()

    run(body())


def test_sleep_needs_a_zero_optimizer() -> None:
    async def body() -> None:
        engine = DeepSpeedTrainEngine(CONFIG, zero_stage=0)
        try:
            with pytest.raises(EngineError, match="zero_stage 1-3"):
                await engine.sleep()
            (metrics,) = await _steps(engine, 1)
            assert metrics.version == 1
        finally:
            await engine.close()

    run(body())


def test_a_checkpoint_from_another_stage_is_refused_without_change(tmp_path: Path) -> None:
    async def body() -> None:
        two = DeepSpeedTrainEngine(CONFIG, zero_stage=2)
        zero = DeepSpeedTrainEngine(CONFIG, zero_stage=0)
        try:
            await _steps(two, 1)
            await two.save_checkpoint(str(tmp_path / "ckpt"))
            assert (tmp_path / "ckpt" / CHECKPOINT_META).exists()
            before = await weights(zero)
            with pytest.raises(EngineError, match=r"zero_stage=2.*has 0"):
                await zero.load_checkpoint(str(tmp_path / "ckpt"))
            with pytest.raises(EngineError, match="not readable"):
                await zero.load_checkpoint(str(tmp_path / "nothing"))
            assert zero.weight_version == 0
            after = await weights(zero)
            assert all(torch.equal(before[n], after[n]) for n in before)
        finally:
            await two.close()
            await zero.close()

    run(body())


class _MakesADirectory:
    """A pickle that, when loaded with ``weights_only=False``, creates ``path``: what a
    checkpoint from elsewhere can do (any code, not just this)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.path),))


def _files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


def test_own_checkpoints_are_signed_with_a_key_kept_outside_the_run(
    tmp_path: Path, _private_checkpoint_key: Path
) -> None:
    """The manifest lists every file with its sha256 and size and is signed; the key is made
    on the first save, mode 0600, under XDG_CONFIG_HOME, and appears in no checkpoint file."""

    async def body() -> None:
        engine = DeepSpeedTrainEngine(CONFIG, zero_stage=1)
        try:
            await _steps(engine, 1)
            saved = await weights(engine)
            await engine.save_checkpoint(str(tmp_path / "ckpt"))
            await _steps(engine, 2)
            await engine.load_checkpoint(str(tmp_path / "ckpt"))
            assert engine.weight_version == 1
            after = await weights(engine)
            assert all(torch.equal(saved[n], after[n]) for n in saved)
        finally:
            await engine.close()

    run(body())
    key_file = _private_checkpoint_key / "asyncflow" / "checkpoint.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    key = key_file.read_text().strip()
    assert len(key) == 64
    files = _files(tmp_path / "ckpt")
    manifest = json.loads(files.pop(CHECKPOINT_META))
    assert set(manifest["files"]) == set(files) and len(manifest["hmac_sha256"]) == 64
    assert any(name.endswith("_model_states.pt") for name in files)
    assert not any(key.encode() in data for data in _files(tmp_path).values())


def test_foreign_checkpoints_are_refused_before_deepspeed_unpickles_them(tmp_path: Path) -> None:
    """A checkpoint whose model file was swapped for a pickle that runs code, one without a
    manifest, one re-signed with another key: each is refused with CheckpointRefusedError
    naming the opt-in, the pickle never runs, the engine's weights and version stay. With
    ``trust_checkpoints=True`` a checkpoint signed elsewhere loads."""
    ckpt = tmp_path / "ckpt"
    marker = tmp_path / "the-pickle-ran"

    async def body() -> None:
        writer = DeepSpeedTrainEngine(CONFIG, zero_stage=0, lr=1e-2)
        reader = DeepSpeedTrainEngine(CONFIG, zero_stage=0, lr=1e-2)
        trusting = DeepSpeedTrainEngine(CONFIG, zero_stage=0, lr=1e-2, trust_checkpoints=True)
        try:
            await _steps(writer, 2)
            await writer.save_checkpoint(str(ckpt))
            written = await weights(writer)
            before = await weights(reader)
            genuine = _files(ckpt)
            (model_file,) = [n for n in genuine if n.endswith("_model_states.pt")]
            manifest = json.loads(genuine[CHECKPOINT_META])

            def restore() -> None:
                for name, data in genuine.items():
                    (ckpt / name).write_bytes(data)

            def plant() -> None:
                torch.save(_MakesADirectory(marker), ckpt / model_file)

            def flip() -> None:
                data = bytearray(genuine[model_file])
                data[len(data) // 2] ^= 0xFF
                (ckpt / model_file).write_bytes(bytes(data))

            def resign(meta: dict[str, Any]) -> None:
                meta = {k: v for k, v in meta.items() if k not in ("files", "hmac_sha256")}
                (ckpt / CHECKPOINT_META).unlink()
                signed = sign_manifest(
                    ckpt, meta, secrets.token_bytes(32), manifest=CHECKPOINT_META
                )
                (ckpt / CHECKPOINT_META).write_text(json.dumps(signed))

            plant()  # the planted file does run code when unpickled the way DeepSpeed does
            torch.load(ckpt / model_file, weights_only=False)
            assert marker.is_dir()
            marker.rmdir()

            cases = {
                "a planted pickle": (plant, "not the size"),
                "a modified byte": (flip, "differs from the manifest"),
                "no manifest": (lambda: (ckpt / CHECKPOINT_META).unlink(), "has no manifest"),
                "another key": (lambda: (plant(), resign(manifest)), "not signed with your"),
                "an unlisted file": (
                    lambda: (
                        ckpt / "asyncflow" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
                    ).write_bytes(b"x"),
                    "not listed",
                ),
                "a truncated file": (
                    lambda: (ckpt / model_file).write_bytes(genuine[model_file][:100]),
                    "not the size",
                ),
            }
            for case, (spoil, message) in cases.items():
                restore()
                spoil()
                with pytest.raises(CheckpointRefusedError, match=message) as info:
                    await reader.load_checkpoint(str(ckpt))
                assert "trust_checkpoints=True" in str(info.value), case
                assert not marker.exists(), case
                assert reader.weight_version == 0, case
                now = await weights(reader)
                assert all(torch.equal(before[n], now[n]) for n in before), case
                (ckpt / "asyncflow" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink(
                    missing_ok=True
                )

            restore()
            resign(manifest)  # a genuine checkpoint, signed on another machine
            with pytest.raises(CheckpointRefusedError):
                await reader.load_checkpoint(str(ckpt))
            await trusting.load_checkpoint(str(ckpt))
            assert trusting.weight_version == 2
            loaded = await weights(trusting)
            assert all(torch.equal(written[n], loaded[n]) for n in written)
            # the opt-in skips the signature, not the layout checks
            resign({**manifest, "zero_stage": 2})
            with pytest.raises(CheckpointError, match="zero_stage=2"):
                await trusting.load_checkpoint(str(ckpt))
        finally:
            for engine in (writer, reader, trusting):
                await engine.close()

    run(body())


def test_a_bad_checkpoint_key_is_a_config_error(
    tmp_path: Path, _private_checkpoint_key: Path
) -> None:
    async def body() -> None:
        engine = DeepSpeedTrainEngine(CONFIG, zero_stage=0)
        try:
            os.environ[CHECKPOINT_KEY_ENV] = "short"
            with pytest.raises(ConfigError, match=f"{CHECKPOINT_KEY_ENV} is set but shorter") as e:
                await engine.save_checkpoint(str(tmp_path / "a"))
            assert "'short'" not in str(e.value)  # the key is never quoted
            del os.environ[CHECKPOINT_KEY_ENV]
            key_file = _private_checkpoint_key / "asyncflow" / "checkpoint.key"
            key_file.parent.mkdir(parents=True)
            key_file.write_text(secrets.token_hex(32))
            key_file.chmod(0o644)
            with pytest.raises(ConfigError, match="not private to you"):
                await engine.save_checkpoint(str(tmp_path / "b"))
            key_file.chmod(0o600)
            await engine.save_checkpoint(str(tmp_path / "b"))
            await engine.load_checkpoint(str(tmp_path / "b"))
            with pytest.raises(ConfigError, match="trust_checkpoints must be a bool"):
                DeepSpeedTrainEngine(CONFIG, trust_checkpoints="yes")  # type: ignore[arg-type]
        finally:
            os.environ.pop(CHECKPOINT_KEY_ENV, None)
            await engine.close()

    run(body())


def test_the_callers_model_is_never_changed() -> None:
    """Nor the process: ZeRO-3 would swap ``torch.nn.functional.linear`` for every model of
    the process (its memory-efficient linear); the engine turns that off."""
    model = TransformerLM(CONFIG, seed=3)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    linear = torch.nn.functional.linear

    async def body() -> None:
        engine = DeepSpeedTrainEngine(model, zero_stage=3, dtype="bf16", lr=1e-2)
        try:
            await _steps(engine, 2)
        finally:
            await engine.close()

    run(body())
    assert all(torch.equal(model.state_dict()[n], t) for n, t in before.items())
    assert next(model.parameters()).dtype == torch.float32
    assert torch.nn.functional.linear is linear


def test_engines_of_one_process_share_its_world_of_one() -> None:
    """Two engines at once, closed in turn: closing one leaves the other working."""

    async def body() -> None:
        a = DeepSpeedTrainEngine(CONFIG)
        b = DeepSpeedTrainEngine(CONFIG, zero_stage=3)
        await a.close()
        (metrics,) = await _steps(b, 1)
        assert metrics.version == 1
        await b.close()
        await b.close()  # idempotent
        with pytest.raises(EngineError, match="after close"):
            await b.train_step(batch5(), policy_gradient_loss)

    run(body())


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_a_hugging_face_causal_lm(zero_stage: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Qwen2 built from a config in code (no download; tied embeddings): the
    engine's log-probs are the model's own, it trains, and it exports every ``state_dict``
    name except the tied LM head: the tied weight travels once, as
    ``model.embed_tokens.weight``, the name vLLM and SGLang load it under."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    config = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    batch = padded_batch(
        prompts=[[1, 2, 3], [4, 5]], responses=[[11, 12, 13, 14], [15]], advantages=[1.0, -1.0]
    )
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 11, 12, 13, 14]])).logits[0, 2:6]
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor([[11], [12], [13], [14]]))

    async def body() -> None:
        engine = DeepSpeedTrainEngine(model, zero_stage=zero_stage, micro_batch_size=1, lr=1e-2)
        try:
            assert engine.vocab_size == 64 and engine.max_seq_len == 32
            logprobs = await engine.compute_logprobs(batch)
            torch.testing.assert_close(logprobs[0], want.squeeze(1), rtol=0, atol=1e-6)
            losses = [(await engine.train_step(batch, policy_gradient_loss)).loss for _ in range(3)]
            assert losses[2] < losses[0]
            names = list(await weights(engine, 1 << 20))
            tied = [n for n in model.state_dict() if n != "lm_head.weight"]
            assert names == tied and "model.embed_tokens.weight" in names
        finally:
            await engine.close()

    run(body())


# --------------------------------------------------------------------------------------------
# Two rank processes
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_two_ranks(zero_stage: int, dtype: str, tmp_path: Path) -> None:
    """Two rank processes, each holding half the batch: the step equals the one-process
    reference step (fp32: to rounding; bf16: to bf16's precision); rank 0 exports every
    parameter full size; a DeepSpeed checkpoint restores byte for byte; a bad row in rank 1's
    half, or a loss failing on rank 1 only, is refused by both ranks and changes nothing."""
    fp32 = dtype == "fp32"

    async def body() -> None:
        group = launch(CONFIG, 2, zero_stage=zero_stage, dtype=dtype, micro_batch_size=2, lr=1e-2)
        ref = TorchTrainEngine(CONFIG, micro_batch_size=2, lr=1e-2)
        try:
            assert group.world_size == 2 and len(set(group.pids)) == 2
            logprobs = await group.compute_logprobs(batch5())
            torch.testing.assert_close(
                logprobs, await ref.compute_logprobs(batch5()),
                rtol=0, atol=1e-6 if fp32 else 0.05,
            )  # fmt: skip
            mine, theirs = await _steps(group, 2), await _steps(ref, 2)
            for a, b in zip(mine, theirs, strict=True):
                assert (a.version, a.samples, a.tokens) == (b.version, b.samples, b.tokens)
                assert a.loss == pytest.approx(b.loss, rel=1e-5 if fp32 else 0.02)
                assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4 if fp32 else 0.05)
            exported = await weights(group)
            want = await weights(ref)
            assert list(exported) == list(want)
            for name, tensor in exported.items():
                assert tensor.shape == want[name].shape, name
                assert tensor.dtype == (torch.float32 if fp32 else torch.bfloat16), name
                torch.testing.assert_close(
                    tensor.float(), want[name], rtol=0, atol=1e-5 if fp32 else 0.05
                )

            await group.save_checkpoint(str(tmp_path / "ckpt"))
            await _steps(group, 1)
            await group.load_checkpoint(str(tmp_path / "ckpt"))
            assert group.weight_version == 2
            restored = await weights(group)
            assert all(torch.equal(restored[n], exported[n]) for n in exported)

            bad = batch5()
            bad.data["response"][4, 0] = 99  # row 4 is in rank 1's half
            with pytest.raises(EngineError, match=r"response\[1, 0\]=99") as info:
                await group.train_step(bad, policy_gradient_loss)
            assert "rank 1 had rows 3:5" in "".join(getattr(info.value, "__notes__", []))
            with pytest.raises(EngineError, match="non-finite"):
                await group.train_step(batch5(), FailOn(0.2))  # fails on rank 1 only
            assert group.weight_version == 2
            after = await weights(group)
            assert all(torch.equal(after[n], exported[n]) for n in exported)
            (metrics,) = await _steps(group, 1)
            assert metrics.version == 3 and math.isfinite(metrics.loss)
        finally:
            await group.close()
            await ref.close()

    run(body())


@pytest.mark.slow
def test_rank_0_broadcasts_to_an_inference_worker_in_another_process() -> None:
    """The DeepSpeed trainer here (ZeRO-3: its export gathers the shards; its training world
    is this process's default group) is rank 0 of a separate ``WeightSyncGroup``; a
    ``TorchInferenceEngine`` in a worker process (rank 1) receives the buckets, holds the
    exported bytes exactly and generates with the new version afterwards."""
    from asyncflow_reference.worker import InferenceWorker, WorkerSpec

    from asyncflow_core.contracts.protocols import GenerationRequest, SamplingParams
    from asyncflow_core.engines.process import free_port
    from asyncflow_core.sync.transports import DistributedWeightSync, WeightSyncGroup

    port = free_port()
    worker = InferenceWorker(WorkerSpec(CONFIG, "127.0.0.1", port, 1, 2, seed=1, mode="staged"))

    async def body() -> None:
        engine = DeepSpeedTrainEngine(CONFIG, zero_stage=3, micro_batch_size=2, lr=1e-2)
        group = WeightSyncGroup("127.0.0.1", port, 0, 2, timeout_s=60)
        sync = DistributedWeightSync(group=group)
        try:
            await sync.init()
            for _ in range(2):
                version = (await engine.train_step(batch5(), policy_gradient_loss)).version
                sent: dict[str, torch.Tensor] = {}
                await sync.start()
                async for bucket in engine.export_weights(4096):
                    sent.update(dict(bucket))
                    await sync.update(bucket)
                await sync.finish(version)
                assert await asyncio.to_thread(worker.wait_for_version, version, 60) == version
                got = await asyncio.to_thread(worker.weights, 60)
                assert list(sent) == list(TransformerLM(CONFIG).state_dict())
                assert sorted(got) == sorted(sent)
                for name, tensor in sent.items():
                    assert got[name].dtype == tensor.dtype and torch.equal(
                        got[name].view(torch.uint8), tensor.view(torch.uint8)
                    ), name
                prompts = [
                    GenerationRequest(f"v{version}-{i}", (1, 2, 3 + i), SamplingParams(4, seed=i))
                    for i in range(3)
                ]
                results = await asyncio.to_thread(worker.generate, prompts, 60)
                assert all(r.tokens and set(r.versions) == {version} for r in results)
            await sync.close()
        finally:
            group.close()
            await engine.close()

    try:
        run(body())
    finally:
        assert worker.close() == 0


@pytest.mark.slow
def test_a_dead_rank_fails_the_group_instead_of_hanging() -> None:
    async def body() -> None:
        group = launch(CONFIG, 2, zero_stage=3, micro_batch_size=2)
        try:
            group.ranks[1]._process.kill()
            with pytest.raises(EngineError, match="rank 1"):
                await asyncio.wait_for(group.train_step(batch5(), policy_gradient_loss), 60)
            with pytest.raises(EngineError, match="rank 1"):
                await group.compute_logprobs(batch5())
        finally:
            await group.close()
        assert all(not engine._process.is_alive() for engine in group.ranks)

    run(body())


# --------------------------------------------------------------------------------------------
# Configuration and installation errors
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"zero_stage": 4}, "zero_stage must be 0, 1, 2 or 3"),
        ({"dtype": "fp16"}, "dtype must be 'fp32' or 'bf16'"),
        ({"lr": 0}, "lr must be a number > 0"),
        ({"micro_batch_size": 0}, "micro_batch_size must be an int >= 1"),
        ({"ds_config": {"gradient_clipping": 2.0}}, "use its argument max_grad_norm"),
        ({"ds_config": {"zero_optimization": {"stage": 3}}}, "use its argument zero_stage"),
        ({"ds_config": {"bf16": {"enabled": True}}}, "use its argument dtype"),
        ({"world_size": 2}, r"world_size=2"),
    ],
)
def test_bad_configuration_is_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        DeepSpeedTrainEngine(CONFIG, **kwargs)


def test_a_model_that_does_not_return_logits_is_refused() -> None:
    class Scalar(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.w * tokens.float().sum()

    async def body() -> None:
        engine = DeepSpeedTrainEngine(Scalar())
        try:
            with pytest.raises(EngineError, match=r"must return logits \[B, T, V\]"):
                await engine.compute_logprobs(batch5())
        finally:
            await engine.close()

    run(body())
    with pytest.raises(ConfigError, match=r"takes a torch.nn.Module"):
        DeepSpeedTrainEngine("gpt2")


def test_without_deepspeed_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed -> ImportError
    with pytest.raises(MissingExtraError, match=r"asyncflow\[deepspeed\]"):
        DeepSpeedTrainEngine(CONFIG)
    with pytest.raises(MissingExtraError, match=r"asyncflow\[deepspeed\]"):
        launch(CONFIG, 2)
    with pytest.raises(MissingExtraError, match=r"asyncflow\[deepspeed\]"):
        require_deepspeed()


def test_an_untested_deepspeed_version_is_refused() -> None:
    check_version("0.19.8")
    check_version("0.19.9+cpu")
    for version in ("0.18.2", "0.20.0", "1.0"):
        with pytest.raises(ConfigError, match=r"tested with deepspeed >=0\.19\.8,<0\.20"):
            check_version(version)
