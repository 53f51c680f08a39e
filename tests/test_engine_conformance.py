"""The engine suites (asyncflow_conformance.engines) on the simulated engines (virtual clock),
on a tiny honest bigram engine pair that computes real log-probs and holds real weights (plain
event loop, real time), and on broken engines, which must fail the law they break."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar
from xml.etree import ElementTree

import pytest
import torch
from asyncflow_conformance import (
    InferenceEngineConformance,
    TrainEngineConformance,
    WeightSyncConformance,
)
from asyncflow_conformance.engines import (
    BAD_LOADS,
    BAD_REQUESTS,
    LOGPROB_SETTINGS,
    PHASE_MISUSES,
)
from asyncflow_reference.engines import TorchInferenceEngine, TorchTrainEngine
from asyncflow_reference.model import ModelConfig
from asyncflow_reference.sim import (
    CostModel,
    SimInferenceEngine,
    SimTrainEngine,
    SimWeightTransport,
    qwen2_param_count,
)
from fake_engine_gate import RequestGate
from test_lost_worker import Restartable

from asyncflow_core.contracts.errors import EngineError
from asyncflow_core.contracts.protocols import (
    Batch,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    LossFn,
    SamplingParams,
    TrainMetrics,
    Version,
    WeightBucket,
    WeightSync,
)
from asyncflow_core.engines.lmtrain import check_loss
from asyncflow_core.engines.process import ProcessInferenceEngine, ProcessTrainEngine
from asyncflow_core.sync.transports import InProcessWeightSync, bucketize
from asyncflow_core.training.sampling import (
    OFF_SUPPORT_METRIC,
    filter_logits,
    row_sampling,
    sampled_logprobs,
)

# A two-layer Qwen2-shaped model: small exported tensors (the simulator exports meta tensors
# of these shapes), responses of 64..1024 tokens so long requests are still running when a
# law acts on them. The simulator's token ids lie in [0, 32000).
_ARCH: dict[str, Any] = {
    "hidden_size": 64,
    "num_layers": 2,
    "intermediate_size": 128,
    "num_kv_heads": 2,
    "head_dim": 16,
    "vocab_size": 32000,
    "tie_embeddings": False,
}
COST = CostModel(
    model="tiny-qwen2",
    **_ARCH,
    params=qwen2_param_count(**_ARCH),
    kv_bytes_per_token=2 * 2 * 2 * 16 * 2,
    response_median=128.0,
    response_min_tokens=64,
    response_max_tokens=1024,
)


# --------------------------------------------------------------------------------------------
# The simulated engines
# --------------------------------------------------------------------------------------------
class TestSimInferenceEngine(InferenceEngineConformance):
    virtual_clock = True
    vocab_size = 32_000
    supports_real_logprobs = False  # made-up log-probs in [-5, 0)

    def make_engine(self) -> SimInferenceEngine:
        return SimInferenceEngine(COST, seed=3)


class TestSimTrainEngine(TrainEngineConformance):
    virtual_clock = True
    computes_loss = False  # it does not train: loss_fn is never called, loss is NaN
    required_fields = ("response",)  # the only field it reads (token_fields below)

    def make_engine(self) -> SimTrainEngine:
        return SimTrainEngine(COST, 8, token_fields=("response",))

    def expected_parameters(self, engine: Any) -> Mapping[str, Sequence[int]]:
        return {name: tuple(shape) for name, shape in COST.weight_shapes()}


class TestSimWeightTransport(WeightSyncConformance):
    virtual_clock = True
    bucket_bytes = 64 << 10

    def make_source(self) -> SimTrainEngine:
        return SimTrainEngine(COST, 8)

    def make_targets(self) -> list[SimInferenceEngine]:
        return [SimInferenceEngine(COST, name=f"sim-target-{i}", seed=i) for i in range(2)]

    def make_sync(self, targets: Sequence[Any]) -> WeightSync:
        return SimWeightTransport(targets, COST)


class TestInProcessWeightSyncOnSim(TestSimWeightTransport):
    def make_sync(self, targets: Sequence[Any]) -> WeightSync:
        return InProcessWeightSync(targets)


# --------------------------------------------------------------------------------------------
# A tiny honest bigram engine pair: real weights, real log-probs, real time
# --------------------------------------------------------------------------------------------
VOCAB, HIDDEN, EOS = 12, 8, 0


def tiny_weights(seed: int) -> dict[str, torch.Tensor]:
    """A bigram policy: logits(prev) = head.weight @ embed.weight[prev] + head.bias; EOS is
    unlikely (bias -6), so responses are long."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.zeros(VOCAB)
    bias[EOS] = -6.0
    return {
        "embed.weight": 0.3 * torch.randn(VOCAB, HIDDEN, generator=g),
        "head.weight": 0.3 * torch.randn(VOCAB, HIDDEN, generator=g),
        "head.bias": bias,
    }


def _logits(weights: Mapping[str, torch.Tensor], prev: torch.Tensor) -> torch.Tensor:
    return weights["embed.weight"][prev] @ weights["head.weight"].T + weights["head.bias"]


class TinyInferenceEngine(RequestGate):
    """Samples one token per ``token_s`` real seconds (0: instant, a bare yield to the event
    loop per token) from the bigram policy under the request's temperature, top-k and top-p
    (``asyncflow_core.training.sampling``; greedy at temperature 0), and reports that distribution's
    log-probs. A seeded request draws token i with a generator seeded by (seed, i), so it does
    not depend on its batch or on an abort/resume. Pause (keep/abort), sleep, load_weights
    (names and shapes checked), abort, progress (``wait_for_tokens``); malformed requests
    raise."""

    def __init__(self, weights: Mapping[str, torch.Tensor], token_s: float = 0.001) -> None:
        super().__init__()
        self.token_s = token_s
        self.weights = {n: t.detach().clone() for n, t in weights.items()}
        self._rng = torch.Generator().manual_seed(1)

    def logprobs(self, prev: int, params: SamplingParams) -> torch.Tensor:
        logits = _logits(self.weights, torch.tensor(prev))
        knobs = (params.temperature, params.top_k, params.top_p)
        return torch.log_softmax(filter_logits(logits, *map(torch.tensor, knobs)), -1)

    def _validate(self, request: GenerationRequest) -> None:
        rid, k = request.request_id, len(request.resume_tokens)
        if rid in self._inflight:
            raise EngineError(f"request {rid!r} is already in flight")
        if request.params.max_tokens < 0:
            raise EngineError(f"max_tokens={request.params.max_tokens}; use >= 0")
        if len(request.resume_logprobs) != k or len(request.resume_versions) != k:
            raise EngineError(
                f"request {rid!r}: {k} resumed tokens need a log-prob and version each"
            )
        if k > request.params.max_tokens:
            raise EngineError(
                f"request {rid!r} resumes {k} tokens > max_tokens={request.params.max_tokens}"
            )

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self._validate(request)
        rid, params = request.request_id, request.params
        tokens = list(request.resume_tokens)
        logprobs = list(request.resume_logprobs)
        versions = list(request.resume_versions)

        def result(reason: FinishReason) -> GenerationResult:
            return GenerationResult(
                rid, request.prompt_tokens, tuple(tokens), tuple(logprobs), tuple(versions), reason
            )

        self._inflight.add(rid)
        self._made(rid, len(tokens))  # a resumed request has its prefix from the start
        try:
            while len(tokens) < params.max_tokens:
                await self._wait_runnable(rid)
                if rid not in self._aborted:
                    await asyncio.sleep(self.token_s)
                    await self._wait_runnable(rid)  # a pause(keep) freezes the token being made
                if rid in self._aborted:
                    return result("abort")
                prev = tokens[-1] if tokens else request.prompt_tokens[-1]
                lp = self.logprobs(prev, params)
                if params.seed is not None:
                    gen = torch.Generator().manual_seed(params.seed * 1_000_003 + len(tokens))
                else:
                    gen = self._rng
                if params.temperature == 0:
                    token = int(lp.argmax())
                else:
                    token = int(torch.multinomial(lp.exp(), 1, generator=gen))
                tokens.append(token)
                logprobs.append(float(lp[token]))
                versions.append(self._version)
                self._made(rid, len(tokens))
                if token == EOS or token in params.stop_token_ids:
                    return result("stop")
            return result("length")
        finally:
            self._inflight.discard(rid)
            self._aborted.discard(rid)
            self._ended(rid)

    async def load_weights(
        self, weights: Sequence[tuple[str, torch.Tensor]], version: Version
    ) -> None:
        for name, tensor in weights:
            if name not in self.weights or self.weights[name].shape != tensor.shape:
                raise EngineError(f"unknown parameter or shape: {name!r} {list(tensor.shape)}")
        for name, tensor in weights:
            self.weights[name] = tensor.detach().clone()
        self._version = version


class TinyTrainEngine:
    """Trains the bigram policy with SGD on ``loss_fn`` over padded prompt/response batches,
    one call at a time on a worker thread of its own (``close()`` ends it); checkpoints are
    ``torch.save`` files."""

    def __init__(self, weights: Mapping[str, torch.Tensor], lr: float = 0.5) -> None:
        self.params = {n: t.detach().clone().requires_grad_(True) for n, t in weights.items()}
        self.lr = lr
        self._version: Version = 0
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="tiny-trainer")

    @property
    def weight_version(self) -> Version:
        return self._version

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    def _logprobs(self, batch: Batch) -> torch.Tensor:
        for name in ("prompt", "response"):
            if name not in batch.data or name not in batch.lengths:
                raise EngineError(
                    f"the batch needs a padded {name!r} field; it has {list(batch.data)}"
                )
        prompt, response = batch["prompt"], batch["response"]
        if (
            not isinstance(prompt, torch.Tensor)
            or not isinstance(response, torch.Tensor)
            or not prompt.dim() == response.dim() == 2
            or prompt.shape[0] != response.shape[0]
        ):
            raise EngineError(
                "the batch's prompt and response must be padded [rows, width] tensors, one of "
                "each per row"
            )
        for name, tokens in (("prompt", prompt), ("response", response)):
            real = torch.arange(tokens.shape[1]) < batch.lengths[name].unsqueeze(1)
            if bool((real & ((tokens < 0) | (tokens >= VOCAB))).any()):
                raise EngineError(f"the batch's {name!r} holds token ids outside [0, {VOCAB})")
        last = prompt[torch.arange(len(batch)), batch.lengths["prompt"] - 1]
        prev = torch.cat([last.unsqueeze(1), response[:, :-1]], dim=1)
        knobs = row_sampling(batch, len(batch), who="tiny-trainer")
        lp, off = sampled_logprobs(
            _logits(self.params, prev), response, *(k.unsqueeze(1) for k in knobs)
        )
        real = torch.arange(response.shape[1]) < batch.lengths["response"].unsqueeze(1)
        self._off_support = int((off & real).sum())
        return lp

    def _no_grad_logprobs(self, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            return self._logprobs(batch)

    async def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        result: torch.Tensor = await self._run(self._no_grad_logprobs, batch)
        return result

    def _train_step(self, batch: Batch, loss_fn: LossFn) -> TrainMetrics:
        loss, _ = check_loss("tiny-trainer", loss_fn(self._logprobs(batch), batch))
        for p in self.params.values():
            p.grad = None
        torch.autograd.backward(loss)
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        norm = float(torch.sqrt(sum((g * g).sum() for g in grads)))  # type: ignore[arg-type]
        with torch.no_grad():
            for p in self.params.values():
                if p.grad is not None:
                    p -= self.lr * p.grad
        self._version += 1
        tokens = int(batch.lengths["response"].sum())
        extra = {OFF_SUPPORT_METRIC: float(self._off_support)}
        return TrainMetrics(self._version, float(loss.detach()), norm, len(batch), tokens, extra)

    async def train_step(self, batch: Batch, loss_fn: LossFn) -> TrainMetrics:
        result: TrainMetrics = await self._run(self._train_step, batch, loss_fn)
        return result

    def _snapshot(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach().clone()) for n, p in self.params.items()]

    async def export_weights(self, bucket_bytes: int) -> AsyncIterator[WeightBucket]:
        for bucket in bucketize(await self._run(self._snapshot), bucket_bytes):
            yield bucket

    async def save_checkpoint(self, path: str) -> None:
        state = dict(await self._run(self._snapshot))
        torch.save({"params": state, "version": self._version}, path)

    async def load_checkpoint(self, path: str) -> None:
        if not Path(path).is_file():
            raise EngineError(f"no checkpoint at {path}")
        state = torch.load(path, weights_only=True)
        await self._run(self._load, state)

    def _load(self, state: Mapping[str, Any]) -> None:
        with torch.no_grad():
            for name, tensor in state["params"].items():
                self.params[name].copy_(tensor)
        self._version = int(state["version"])

    async def close(self) -> None:
        self._worker.shutdown(wait=False)


class TestTinyInferenceEngine(InferenceEngineConformance):
    """On a plain event loop, a token per millisecond."""

    vocab_size = VOCAB
    long_max_tokens = 128
    pause_hold_s = 0.05
    timeout_s = 20.0
    real_timeout_s = 60.0

    def make_engine(self) -> TinyInferenceEngine:
        return TinyInferenceEngine(tiny_weights(0))


class TestInstantInferenceEngine(TestTinyInferenceEngine):
    """No decode time at all (a token per bare yield to the event loop), with its progress
    hook: the laws act once requests have tokens, never after a sleep that a fast engine
    outruns."""

    def make_engine(self) -> TinyInferenceEngine:
        return TinyInferenceEngine(tiny_weights(0), token_s=0.0)


class TestInstantInferenceEngineWithoutHook(TestInstantInferenceEngine):
    """The same engine seen without its progress hook: the laws pace themselves."""

    def progress(self, engine: Any) -> None:
        return None


class TestSlowInferenceEngine(TestTinyInferenceEngine):
    """100 ms per token (a big model, a loaded machine) and no progress hook: the paced laws
    measure the engine before acting. Long requests are 12 tokens so the laws stay short;
    nothing else is tuned to the speed (short requests are 4 tokens for the same reason)."""

    max_tokens = 4
    long_max_tokens = 12
    timeout_s = 60.0
    real_timeout_s = 300.0

    def make_engine(self) -> TinyInferenceEngine:
        return TinyInferenceEngine(tiny_weights(0), token_s=0.1)

    def progress(self, engine: Any) -> None:
        return None


class TestSlowInferenceEngineWithHook(TestSlowInferenceEngine):
    """The slow engine with its progress hook."""

    def progress(self, engine: Any) -> Any:
        return engine.wait_for_tokens


class TestTinyTrainEngine(TrainEngineConformance):
    vocab_size = VOCAB
    required_fields = ("prompt", "response", "advantage")
    real_timeout_s = 60.0

    def make_engine(self) -> TinyTrainEngine:
        return TinyTrainEngine(tiny_weights(0))

    def expected_parameters(self, engine: Any) -> Mapping[str, Sequence[int]]:
        return {n: tuple(t.shape) for n, t in tiny_weights(0).items()}


class TestTinyInProcessWeightSync(WeightSyncConformance):
    bucket_bytes = 400  # the two [12, 8] float32 matrices travel alone, the bias with one
    real_timeout_s = 60.0

    def make_source(self) -> TinyTrainEngine:
        return TinyTrainEngine(tiny_weights(1))

    def make_targets(self) -> list[TinyInferenceEngine]:
        return [TinyInferenceEngine(tiny_weights(0)) for _ in range(2)]

    def make_sync(self, targets: Sequence[Any]) -> InProcessWeightSync:
        return InProcessWeightSync(targets)

    def target_weights(self, engine: Any) -> Mapping[str, torch.Tensor]:
        assert isinstance(engine, TinyInferenceEngine)
        return engine.weights


# --------------------------------------------------------------------------------------------
# The pure-PyTorch reference engines (asyncflow_reference.engines), on a plain event loop
# --------------------------------------------------------------------------------------------
TORCH_MODEL = ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, max_seq_len=512)


class TestTorchInferenceEngine(InferenceEngineConformance):
    vocab_size = TORCH_MODEL.vocab_size
    context_window = TORCH_MODEL.max_seq_len
    long_max_tokens = 400
    timeout_s = 30.0
    real_timeout_s = 60.0

    def make_engine(self) -> TorchInferenceEngine:
        return TorchInferenceEngine(TORCH_MODEL, max_batch=8, seed=0)

    def weights_for_load(self, engine: Any) -> Sequence[tuple[str, torch.Tensor]]:
        return [(n, t.detach().clone()) for n, t in engine.model.named_parameters()]

    async def close_engine(self, engine: Any) -> None:
        await engine.close()

    def fail_steps(self, engine: Any) -> Callable[[], None]:
        """Every prefill and decode step raises, as an out-of-memory error would."""

        def fail(*args: Any) -> None:
            raise RuntimeError("a model step failed on purpose (the failed-step law)")

        engine._prefill_step = engine._decode_step = fail

        def heal() -> None:
            del engine._prefill_step, engine._decode_step

        return heal


class TestTorchTrainEngine(TrainEngineConformance):
    vocab_size = TORCH_MODEL.vocab_size
    required_fields = ("prompt", "response", "advantage")
    real_timeout_s = 60.0

    def make_engine(self) -> TorchTrainEngine:
        return TorchTrainEngine(TORCH_MODEL, micro_batch_size=2, seed=0)

    def make_other_engine(self) -> TorchTrainEngine:
        return TorchTrainEngine(dataclasses.replace(TORCH_MODEL, max_seq_len=64), seed=1)


class TestProcessTrainEngine(TrainEngineConformance):
    """The reference trainer hosted in a child process (asyncflow_core.engines.process)."""

    vocab_size = TORCH_MODEL.vocab_size
    required_fields = ("prompt", "response", "advantage")
    real_timeout_s = 120.0

    def make_engine(self) -> ProcessTrainEngine:
        return ProcessTrainEngine(
            functools.partial(TorchTrainEngine, TORCH_MODEL, micro_batch_size=2, seed=0, threads=1)
        )

    def make_other_engine(self) -> TorchTrainEngine:
        return TorchTrainEngine(dataclasses.replace(TORCH_MODEL, max_seq_len=64), seed=1)

    async def close_engine(self, engine: Any) -> None:
        await engine.close()

    def lose(self, engine: Any) -> None:
        kill_child(engine)


def kill_child(engine: Any) -> None:
    """The ``lose`` hook of the process-hosted engines: SIGKILL the child, as the kernel's OOM
    killer would."""
    os.kill(engine.pid, signal.SIGKILL)


class TestProcessInferenceEngine(InferenceEngineConformance):
    """The reference rollout engine hosted in a child process (asyncflow_core.engines.process):
    every law through the pipe, the engine's own progress evidence not forwarded (the laws pace
    themselves)."""

    vocab_size = TORCH_MODEL.vocab_size
    context_window = TORCH_MODEL.max_seq_len
    long_max_tokens = 400
    timeout_s = 60.0
    real_timeout_s = 120.0

    def make_engine(self) -> ProcessInferenceEngine:
        return ProcessInferenceEngine(
            functools.partial(TorchInferenceEngine, TORCH_MODEL, max_batch=8, seed=0), threads=1
        )

    async def close_engine(self, engine: Any) -> None:
        await engine.close()

    def lose(self, engine: Any) -> None:
        kill_child(engine)


class _RestartableProcessInference(TestProcessInferenceEngine):
    def make_engine(self) -> Any:
        return Restartable(
            functools.partial(TorchInferenceEngine, TORCH_MODEL, max_batch=8, seed=0),
            restarts=None,
        )


def test_a_restarted_engine_comes_back_fresh() -> None:
    """The lost-engine law's restart half (``SupportsRestart``) on a restartable process
    engine: lost until restart() returns, then the factory's version, and it generates."""
    _RestartableProcessInference().test_a_lost_engine_fails_every_call_until_restart()


class TestTorchInProcessWeightSync(WeightSyncConformance):
    bucket_bytes = 16 << 10
    real_timeout_s = 60.0

    def make_source(self) -> TorchTrainEngine:
        return TorchTrainEngine(TORCH_MODEL, seed=1)

    def make_targets(self) -> list[TorchInferenceEngine]:
        return [TorchInferenceEngine(TORCH_MODEL, max_batch=4, seed=0) for _ in range(2)]

    def make_sync(self, targets: Sequence[Any]) -> InProcessWeightSync:
        return InProcessWeightSync(targets)

    def target_weights(self, engine: Any) -> Mapping[str, torch.Tensor]:
        assert isinstance(engine, TorchInferenceEngine)
        return dict(engine.model.state_dict())


# --------------------------------------------------------------------------------------------
# Broken engines fail the law they break
# --------------------------------------------------------------------------------------------
class ShortLogprobsEngine(SimInferenceEngine):
    """Broken: one log-prob fewer than tokens."""

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        r = await super().generate(request)
        return dataclasses.replace(r, logprobs=r.logprobs[:-1])


class StaleVersionEngine(SimInferenceEngine):
    """Broken: new tokens report version 0 whatever was loaded."""

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        r = await super().generate(request)
        k = len(request.resume_versions)
        return dataclasses.replace(r, versions=r.versions[:k] + (0,) * (len(r.tokens) - k))


class DeafAbortEngine(SimInferenceEngine):
    """Broken: abort() does nothing."""

    async def abort(self, request_ids: Sequence[str]) -> None:
        return None


class HangingEngine(SimInferenceEngine):
    """Broken: generate never returns."""

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


class LenientEngine(SimInferenceEngine):
    """Broken: a negative max_tokens is taken as 0 instead of rejected."""

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if request.params.max_tokens < 0:
            params = dataclasses.replace(request.params, max_tokens=0)
            request = dataclasses.replace(request, params=params)
        return await super().generate(request)


class MadeUpLogprobsEngine(TinyInferenceEngine):
    """Broken: samples from the policy but reports a fixed log-prob."""

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        r = await super().generate(request)
        k = len(request.resume_logprobs)
        return dataclasses.replace(r, logprobs=r.logprobs[:k] + (-0.1,) * (len(r.tokens) - k))


class _BrokenSimInference(InferenceEngineConformance):
    virtual_clock = True
    supports_real_logprobs = False
    real_timeout_s = 30.0
    engine_cls: ClassVar[type[SimInferenceEngine]] = SimInferenceEngine

    def make_engine(self) -> SimInferenceEngine:
        return self.engine_cls(COST, seed=3)


@pytest.mark.parametrize(
    ("engine_cls", "law", "message"),
    [
        (ShortLogprobsEngine, "test_results_are_well_formed", "log-probs and"),
        (StaleVersionEngine, "test_load_weights_sets_the_version", "yet new tokens report"),
        (DeafAbortEngine, "test_abort_returns_the_prefix", "returned neither"),
        (HangingEngine, "test_results_are_well_formed", r"did not return within 60\.0 s"),
    ],
    ids=["mismatched-lengths", "stale-versions", "deaf-abort", "hang"],
)
def test_a_broken_inference_engine_fails_its_law(
    engine_cls: type[SimInferenceEngine], law: str, message: str
) -> None:
    suite = type("Broken", (_BrokenSimInference,), {"engine_cls": engine_cls})()
    with pytest.raises(AssertionError, match=message):
        getattr(suite, law)()


def test_accepting_a_negative_max_tokens_fails_the_bad_request_law() -> None:
    suite = type("Broken", (_BrokenSimInference,), {"engine_cls": LenientEngine})()
    with pytest.raises(AssertionError, match="was accepted"):
        suite.test_bad_requests_are_rejected("negative-max-tokens")


def test_known_failures_are_strict_expected_failures() -> None:
    tracked = {"known_failures": {"test_results_are_well_formed": "tracked defect"}}
    broken = type("Tracked", (_BrokenSimInference,), {"engine_cls": ShortLogprobsEngine, **tracked})
    with pytest.raises(pytest.xfail.Exception, match="known failure: tracked defect"):
        broken().test_results_are_well_formed()
    fixed = type("Fixed", (_BrokenSimInference,), tracked)
    with pytest.raises(pytest.fail.Exception, match="but passed: remove the entry"):
        fixed().test_results_are_well_formed()


class _MadeUpLogprobs(TestTinyInferenceEngine):
    def make_engine(self) -> TinyInferenceEngine:
        return MadeUpLogprobsEngine(tiny_weights(0))


def test_made_up_logprobs_fail_the_logprob_law() -> None:
    with pytest.raises(AssertionError, match="summing to"):
        _MadeUpLogprobs().test_logprobs_match_the_sampling_distribution(LOGPROB_SETTINGS[0])


class NoBumpTrainer(SimTrainEngine):
    """Broken: train_step reports the next version but leaves weight_version unchanged."""

    async def train_step(self, batch: Batch, loss_fn: LossFn) -> TrainMetrics:
        metrics = await super().train_step(batch, loss_fn)
        self._version -= 1
        return metrics


class OneBucketTrainer(SimTrainEngine):
    """Broken: ignores bucket_bytes and exports everything in one bucket."""

    async def export_weights(self, bucket_bytes: int) -> AsyncIterator[WeightBucket]:
        async for bucket in super().export_weights(1 << 62):
            yield bucket


class VersionOnlyCheckpointTrainer(TinyTrainEngine):
    """Broken: load_checkpoint restores the version but keeps the current weights."""

    async def load_checkpoint(self, path: str) -> None:
        self._version = int(torch.load(path, weights_only=True)["version"])


class _BrokenSimTrain(TestSimTrainEngine):
    real_timeout_s = 30.0
    trainer_cls: ClassVar[type[SimTrainEngine]] = SimTrainEngine

    def make_engine(self) -> SimTrainEngine:
        return self.trainer_cls(COST, 8, token_fields=("response",))


@pytest.mark.parametrize(
    ("trainer_cls", "law", "message"),
    [
        (NoBumpTrainer, "test_train_step_adds_one_version", "adds exactly 1"),
        (OneBucketTrainer, "test_export_yields_every_parameter_once", "over bucket_bytes"),
    ],
    ids=["no-version-bump", "one-bucket"],
)
def test_a_broken_train_engine_fails_its_law(
    trainer_cls: type[SimTrainEngine], law: str, message: str
) -> None:
    suite = type("Broken", (_BrokenSimTrain,), {"trainer_cls": trainer_cls})()
    with pytest.raises(AssertionError, match=message):
        getattr(suite, law)()


class _VersionOnlyCheckpoint(TestTinyTrainEngine):
    def make_engine(self) -> TinyTrainEngine:
        return VersionOnlyCheckpointTrainer(tiny_weights(0))


def test_a_checkpoint_that_forgets_the_weights_fails_the_round_trip() -> None:
    suite = _VersionOnlyCheckpoint()
    suite.test_checkpoint_restores_the_version()  # the version part it does honour
    with pytest.raises(AssertionError, match="differ from the saved weights"):
        suite.test_checkpoint_restores_the_weights()


class ForgetfulSync(InProcessWeightSync):
    """Broken: finish() ends the phase but loads nothing into the targets."""

    async def finish(self, version: Version) -> None:
        self._phases.expect("finish")
        self._staged = []
        self._phases.move("finish")


class LaxSync(InProcessWeightSync):
    """Broken: update() is accepted outside a sync."""

    async def update(self, bucket: WeightBucket) -> None:
        if self._phases.state != "open":
            return
        await super().update(bucket)


class CorruptingSync(InProcessWeightSync):
    """Broken: the last tensor of every bucket arrives with one value changed."""

    async def update(self, bucket: WeightBucket) -> None:
        tensors = list(bucket.tensors)
        damaged = tensors[-1].detach().clone()
        damaged.view(-1)[0] += 1
        tensors[-1] = damaged
        await super().update(WeightBucket(bucket.names, tuple(tensors)))


def _sync_suite(base: type[WeightSyncConformance], cls: type[InProcessWeightSync]) -> Any:
    def make_sync(self: Any, targets: Sequence[Any]) -> InProcessWeightSync:
        return cls(targets)

    return type("Broken", (base,), {"make_sync": make_sync, "real_timeout_s": 30.0})()


def test_a_broken_weight_sync_fails_its_law() -> None:
    forgetful = _sync_suite(TestInProcessWeightSyncOnSim, ForgetfulSync)
    with pytest.raises(AssertionError, match=r"reports weight_version 0, not 1"):
        forgetful.test_finish_sets_every_target_version()
    with pytest.raises(AssertionError, match="reports weight_version 0, not 1"):
        forgetful.test_a_sync_of_zero_buckets_sets_the_version()
    lax = _sync_suite(TestInProcessWeightSyncOnSim, LaxSync)
    misuse = {m.id: m for m in PHASE_MISUSES}["update-before-start"]
    with pytest.raises(AssertionError, match="was accepted"):
        lax.test_out_of_order_phases_raise(misuse)
    corrupting = _sync_suite(TestTinyInProcessWeightSync, CorruptingSync)
    with pytest.raises(AssertionError, match="not byte-equal"):
        corrupting.test_bucket_round_trip_is_byte_equal()


# --------------------------------------------------------------------------------------------
# The guide's snippets run as written
# --------------------------------------------------------------------------------------------
README = Path(__file__).resolve().parent.parent / "conformance" / "README.md"
SECTION = "## Test your engine in 10 lines"


def test_the_readme_engine_snippets_pass_from_outside(tmp_path: Path) -> None:
    text = README.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    snippets = re.findall(r"```python\n(.*?)```", text[start : end if end > 0 else None], re.S)
    assert len(snippets) == 3, "one snippet per suite"
    files = []
    for i, snippet in enumerate(snippets):
        code_lines = [ln for ln in snippet.splitlines() if ln.strip() and not ln.startswith("#")]
        assert len(code_lines) <= 12, f"snippet {i} has {len(code_lines)} lines of code"
        path = tmp_path / f"test_engine_snippet_{i}.py"
        path.write_text(snippet)
        files.append(str(path))
    report = tmp_path / "report.xml"
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "asyncflow_conformance", "-p", "no:cacheprovider",
         "-q", *files, f"--junitxml={report}"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and report.exists(), out[-3000:]
    outcomes: dict[str, str] = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = f"{case.attrib['classname']}::{case.attrib['name']}"
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[name] = kinds[0] if kinds else "passed"
    failed = {name: kind for name, kind in outcomes.items() if kind in ("failure", "error")}
    assert not failed, failed
    # every law of every suite was collected (a parametrized law once per parameter)
    suites = Counter(name.split("::")[0].rsplit(".", 1)[-1] for name in outcomes)
    assert sorted(suites.values()) == sorted(LAW_COUNTS.values()), (suites, LAW_COUNTS)


LAW_COUNTS = {
    # 26 laws, 2 pause modes, each bad request and bad load, the log-prob law under each
    # sampling setting
    "inference": 26 + 2 + len(BAD_REQUESTS) + len(BAD_LOADS) + len(LOGPROB_SETTINGS),
    "train": 28 + 2 + 1,  # 28 laws, 2 bad bucket sizes, the default required field "response"
    "weight sync": 5 + len(PHASE_MISUSES),
}


def test_a_suite_still_setting_progress_s_is_told_to_delete_it() -> None:
    with pytest.raises(TypeError, match="Delete progress_s"):
        type("Old", (InferenceEngineConformance,), {"progress_s": 0.1})
