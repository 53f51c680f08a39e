"""Laws between an inference engine and a trainer (``EnginePairConformance``): after a weight
sync, the trainer's log-probs of the tokens the engine sampled equal the log-probs the engine
reported, under the sampling settings a job uses (temperature, top-k, top-p; see
``asyncflow_core.training.sampling``), on prompts of different lengths, on resumed requests, and in
the loss of a train step.

This is the agreement off-policy RL rests on: PPO's ratio, decoupled PPO's behaviour
correction and truncated importance sampling divide the trainer's probabilities by the
engine's. Each suite alone cannot see a disagreement (an engine consistent with itself, a
trainer consistent with itself); the pair can. Usage::

    from asyncflow_conformance import EnginePairConformance

    class TestMyPair(EnginePairConformance):
        vocab_size = 32000

        def make_inference(self):
            return MyEngine()

        def make_trainer(self):
            return MyTrainer()

        # make_sync(targets) defaults to InProcessWeightSync(targets)

Tolerances: ``logprob_atol`` bounds the mean absolute difference over every compared token,
``logprob_max_atol`` the largest one (fp32 on both sides agrees to ~1e-6; a bf16 engine
against an fp32 trainer needs ~5e-2 / ~0.5). ``logprob_agreement`` and ``rollout_batch`` are
public so that other tests can measure how far a pair misses.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import math
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

from asyncflow_conformance.engines import (
    ProgressHook,
    _resolve,
    _Suite,
    _with_sampling,
    check_generation_result,
)
from asyncflow_core.contracts.errors import AsyncFlowError
from asyncflow_core.contracts.protocols import (
    Batch,
    GenerationRequest,
    GenerationResult,
    InferenceEngine,
    SamplingParams,
    SupportsProgress,
    TrainEngine,
    TrainMetrics,
    Version,
    WeightBucket,
    WeightSync,
    inflight_load_refusal,
)
from asyncflow_core.data.store import InProcessDataStore
from asyncflow_core.sync.transports import InProcessWeightSync
from asyncflow_core.sync.verify import SyncVerificationError, verify_engine
from asyncflow_core.training.rl import policy_gradient_loss, response_mask
from asyncflow_core.training.sampling import SAMPLING_FIELDS, sampling_columns

__all__ = [
    "PAIR_SETTINGS",
    "Agreement",
    "AgreementLoss",
    "EnginePairConformance",
    "logprob_agreement",
    "rollout_batch",
]

PAIR_SETTINGS: tuple[tuple[str, SamplingParams], ...] = (
    ("greedy", SamplingParams(temperature=0.0)),
    ("greedy-top_k=4", SamplingParams(temperature=0.0, top_k=4)),
    ("t1", SamplingParams(temperature=1.0)),
    ("t0.7", SamplingParams(temperature=0.7)),
    ("t1.3-top_k=4", SamplingParams(temperature=1.3, top_k=4)),
    ("top_p=0.8", SamplingParams(temperature=1.0, top_p=0.8)),
    ("t1-stop", SamplingParams(temperature=1.0, stop_token_ids=(1, 2, 3))),
    ("t0.8-top_k=5-top_p=0.9", SamplingParams(temperature=0.8, top_k=5, top_p=0.9)),
)
"""The sampling settings the agreement law runs under (id, params; ``max_tokens`` and
``seed`` are set by the law)."""

AGREEMENT_METRIC = "pair_logprob_absdiff"
"""The metric ``AgreementLoss`` reports: mean |loss log-prob - engine log-prob|."""


# --------------------------------------------------------------------------------------------
# Measuring agreement
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Agreement:
    """How far a trainer's log-probs are from an engine's, over the compared tokens."""

    tokens: int
    mean_abs: float
    max_abs: float
    rows: tuple[float, ...]
    """Per row: the mean absolute difference over its compared tokens (nan: none compared)."""
    worst: tuple[tuple[int, int, int, float, float], ...] = ()
    """The largest differences (at most 3): (row, response position, token, engine's
    log-prob, trainer's)."""

    def within(self, mean_atol: float, max_atol: float) -> bool:
        return self.tokens > 0 and self.mean_abs <= mean_atol and self.max_abs <= max_atol

    def describe(self) -> str:
        worst = "; ".join(
            f"row {r} token {i} (id {t}): engine {e:.6g}, trainer {m:.6g}"
            for r, i, t, e, m in self.worst
        )
        return (
            f"mean |difference| {self.mean_abs:.3g}, max {self.max_abs:.3g} over "
            f"{self.tokens} tokens" + (f" (largest: {worst})" if worst else "")
        )


def logprob_agreement(
    results: Sequence[GenerationResult], trainer: torch.Tensor, start: Sequence[int] = ()
) -> Agreement:
    """Compare each result's reported ``logprobs[start[i]:]`` (all of them without
    ``start``) with the trainer's ``trainer[i, start[i]:len(tokens)]``."""
    diffs: list[torch.Tensor] = []
    rows: list[float] = []
    for i, result in enumerate(results):
        first = start[i] if start else 0
        n = len(result.tokens)
        reported = torch.tensor(result.logprobs[first:n], dtype=torch.float64)
        mine = trainer[i, first:n].detach().to("cpu", torch.float64)
        if mine.shape != reported.shape:
            raise AssertionError(
                f"compute_logprobs returned {trainer.shape[1]} columns for row {i}, whose "
                f"response has {n} tokens; it returns [B, T] with T >= the longest response"
            )
        diff = (mine - reported).abs()
        diffs.append(diff)
        rows.append(float(diff.mean()) if diff.numel() else math.nan)
    every = torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)
    if not every.numel():
        return Agreement(0, math.nan, math.nan, tuple(rows))
    places = [
        (i, (start[i] if start else 0) + j) for i, d in enumerate(diffs) for j in range(len(d))
    ]
    order = torch.nan_to_num(every, nan=math.inf).argsort(descending=True)[:3].tolist()
    worst = tuple(
        (i, j, int(results[i].tokens[j]), float(results[i].logprobs[j]), float(trainer[i, j]))
        for i, j in (places[k] for k in order)
    )
    nonfinite = ~torch.isfinite(every)
    if bool(nonfinite.any()):
        return Agreement(int(every.numel()), math.inf, math.inf, tuple(rows), worst)
    mean, largest = float(every.mean()), float(every.max())
    return Agreement(int(every.numel()), mean, largest, tuple(rows), worst)


async def rollout_batch(
    results: Sequence[GenerationResult],
    params: Sequence[SamplingParams],
    advantages: Sequence[float] | None = None,
) -> Batch:
    """The batch an ``RLJob`` update reads for these results, through the real store
    (``InProcessDataStore``, layout "padded"): ``prompt``, ``response`` ``[B, L]`` with
    lengths, the engine's ``logprobs``, ``advantage`` (``advantages``, default 0) and the
    rows' sampling fields ``temperature``/``top_k``/``top_p`` (``params[i]`` per row)."""
    store = InProcessDataStore()
    fields = ["prompt", "response", "logprobs", "advantage", *SAMPLING_FIELDS]
    await store.create_partition("pair", fields, tasks=["trainer"])
    adv = [0.0] * len(results) if advantages is None else list(advantages)
    data: dict[str, Any] = {
        "prompt": [torch.tensor(r.prompt_tokens, dtype=torch.long) for r in results],
        "response": [torch.tensor(r.tokens, dtype=torch.long) for r in results],
        "logprobs": [torch.tensor(r.logprobs, dtype=torch.float32) for r in results],
        "advantage": [torch.tensor(a, dtype=torch.float32) for a in adv],
        **sampling_columns(params),
    }
    await store.put("pair", data)
    meta = await store.get_meta("pair", "trainer", fields, len(results), timeout=60)
    return await store.get_data(meta, layout="padded")


class AgreementLoss:
    """``policy_gradient_loss`` plus the metric ``pair_logprob_absdiff``: the mean absolute
    difference between the log-probs the loss receives and the batch's ``logprobs`` (the
    engine's), over response tokens. Picklable, so a trainer in another process reports it
    through ``TrainMetrics.extra``; in this process ``seen`` also records each call's value."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, int]] = []

    def __call__(
        self, logprobs: torch.Tensor, batch: Batch
    ) -> tuple[torch.Tensor, Mapping[str, float]]:
        loss, metrics = policy_gradient_loss(logprobs, batch)
        engine = batch["logprobs"]
        width = min(logprobs.shape[1], engine.shape[1])
        mask = response_mask(logprobs, batch)[:, :width]
        diff = (logprobs.detach()[:, :width].float() - engine[:, :width].float()).abs()
        n = int(mask.sum())
        value = float(diff[mask].mean()) if n else 0.0
        self.seen.append((value, n))
        return loss, {**metrics, AGREEMENT_METRIC: value}


# --------------------------------------------------------------------------------------------
# The suite
# --------------------------------------------------------------------------------------------
@dataclass
class _Pair:
    engine: Any
    trainer: Any
    sync: Any
    synced: bool = False


class EnginePairConformance(_Suite):
    """Laws of an inference engine and a trainer together; subclass it (as ``Test...``) and
    implement ``make_inference`` and ``make_trainer`` (``make_sync`` defaults to
    ``InProcessWeightSync``). Every law first trains the trainer one step, so that its
    weights differ from the engine's, then syncs them: a sync that moves nothing cannot pass."""

    vocab_size: ClassVar[int | None] = None
    """Prompt token ids are drawn below it (and below 1000)."""
    max_tokens: ClassVar[int] = 12
    """Tokens per compared request."""
    prompts: ClassVar[int] = 6
    """Prompts per law, of lengths 1, 2, ... (so padding bugs show)."""
    samples_per_prompt: ClassVar[int] = 2
    logprob_atol: ClassVar[float] = 1e-3
    """Bound on the mean |trainer - engine| log-prob over the compared tokens."""
    logprob_max_atol: ClassVar[float] = 1e-2
    """Bound on the largest |trainer - engine| log-prob of one token."""
    pair_settings: ClassVar[tuple[tuple[str, SamplingParams], ...]] = PAIR_SETTINGS
    """The sampling settings of the agreement law, one test each."""
    resume_setting: ClassVar[SamplingParams] = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    """The sampling of the resume and loss laws."""
    bucket_bytes: ClassVar[int] = 1 << 30

    # -- hooks -------------------------------------------------------------------------------
    def make_inference(self) -> InferenceEngine | Awaitable[InferenceEngine]:
        """A fresh inference engine (that the sync can load weights into)."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement make_inference(self) -> InferenceEngine"
        )

    def make_trainer(self) -> TrainEngine | Awaitable[TrainEngine]:
        """A fresh trainer of the same model (its initial weights may differ: they are
        synced)."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement make_trainer(self) -> TrainEngine"
        )

    def make_sync(self, targets: Sequence[Any]) -> WeightSync | Awaitable[WeightSync]:
        """A fresh, not yet initialised ``WeightSync`` from the trainer into ``targets``
        (default ``InProcessWeightSync``)."""
        return InProcessWeightSync(targets)

    def prompt_tokens(self, index: int) -> Sequence[int]:
        """The ``index``-th prompt: ``index + 1`` valid token ids (lengths differ, so a
        trainer that mishandles padding disagrees on some rows)."""
        vocab = min(self.vocab_size or 1000, 1000)
        return tuple(1 + (5 * index + 3 * k + 1) % (vocab - 1) for k in range(index + 1))

    # -- plumbing ----------------------------------------------------------------------------
    def _law(self, name: str, body: Callable[[_Pair], Coroutine[Any, Any, None]]) -> None:
        async def main() -> None:
            engine = await self._wait(_resolve(self.make_inference()), "make_inference()")
            assert isinstance(engine, InferenceEngine), (
                f"make_inference() returned {type(engine).__name__}, not an InferenceEngine"
            )
            trainer = await self._wait(_resolve(self.make_trainer()), "make_trainer()")
            assert isinstance(trainer, TrainEngine), (
                f"make_trainer() returned {type(trainer).__name__}, not a TrainEngine"
            )
            try:
                sync = await self._wait(_resolve(self.make_sync([engine])), "make_sync([engine])")
                assert isinstance(sync, WeightSync), (
                    f"make_sync() returned {type(sync).__name__}, not a WeightSync"
                )
                await body(_Pair(engine, trainer, sync))
            finally:
                for obj in (engine, trainer):
                    with contextlib.suppress(Exception):
                        await self._wait(self.close_engine(obj), "close_engine()")

        self._run(name, main)

    def _prompts(self) -> list[tuple[int, ...]]:
        return [tuple(self.prompt_tokens(i)) for i in range(self.prompts)]

    async def _generate(
        self,
        engine: InferenceEngine,
        tag: str,
        prompts: Sequence[tuple[int, ...]],
        params: SamplingParams,
        *,
        seed: int,
        resume: Sequence[GenerationResult] = (),
    ) -> list[GenerationResult]:
        """One request per prompt (``samples_per_prompt`` each unless resuming), concurrent,
        each checked by the result law."""
        requests: list[GenerationRequest] = []
        for i, prompt in enumerate(prompts):
            for _ in range(1 if resume else self.samples_per_prompt):
                n = len(requests)
                request = GenerationRequest(
                    f"{tag}-{n}", prompt, dataclasses.replace(params, seed=seed + n)
                )
                if resume:
                    prior = resume[i]
                    request = dataclasses.replace(
                        request,
                        resume_tokens=tuple(prior.tokens),
                        resume_logprobs=tuple(prior.logprobs),
                        resume_versions=tuple(prior.versions),
                    )
                requests.append(request)
        version = engine.weight_version
        tasks = [asyncio.ensure_future(engine.generate(r)) for r in requests]
        results = await self._collect(engine, requests, tasks, version)
        for result in results:
            assert result.finish_reason != "abort", (
                f"request {result.request_id!r} came back 'abort' without an abort"
            )
        return results

    async def _collect(
        self,
        engine: InferenceEngine,
        requests: Sequence[GenerationRequest],
        tasks: Sequence[asyncio.Future[GenerationResult]],
        version: Version,
    ) -> list[GenerationResult]:
        """The submitted requests' results, each checked by the result law (``version``: the
        engine's at submission)."""
        results = []
        for request, task in zip(requests, tasks, strict=True):
            result = await self._wait(task, f"generate({request.request_id!r})")
            check_generation_result(
                request,
                result,
                submitted_version=version,
                current_version=engine.weight_version,
                vocab_size=self.vocab_size,
            )
            results.append(result)
        return results

    async def _train_and_sync(
        self, pair: _Pair, results: Sequence[GenerationResult], params: SamplingParams
    ) -> Version:
        """One train step on ``results`` (sampled with ``params``; advantages ±1: the weights
        move), then a sync of the trainer's weights into the engine; returns the synced
        version."""
        advantages = [1.0 if i % 2 == 0 else -1.0 for i in range(len(results))]
        batch = await rollout_batch(results, [params] * len(results), advantages)
        before = pair.trainer.weight_version
        await self._wait(pair.trainer.train_step(batch, policy_gradient_loss), "train_step()")
        version: Version = pair.trainer.weight_version
        assert version == before + 1, f"train_step took the version from {before} to {version}"
        await self._transfer(
            pair.sync, pair.trainer, version, self.bucket_bytes, init=not pair.synced
        )
        pair.synced = True
        assert pair.engine.weight_version == version, (
            f"after the sync to version {version} the engine reports {pair.engine.weight_version}"
        )
        return version

    async def _diagnose(
        self,
        trainer: TrainEngine,
        batch: Batch,
        results: Sequence[GenerationResult],
        params: SamplingParams,
        start: Sequence[int],
        agreement: Agreement,
    ) -> str:
        """Hints: which other semantics the engine's log-probs match, which rows disagree."""
        hints: list[str] = []
        tries = [
            ("temperature 1 and no top-k/top-p", SamplingParams(temperature=1.0)),
            (
                f"temperature {params.temperature} but before top-k/top-p",
                SamplingParams(temperature=params.temperature),
            ),
        ]
        if params.temperature == 0 and (params.top_k > 0 or params.top_p < 1):
            tries.append(
                (
                    "temperature 1 with the request's top-k/top-p (greedy log-probs are the "
                    "model's at temperature 1 unfiltered, whatever filters the request sets)",
                    SamplingParams(temperature=1.0, top_k=params.top_k, top_p=params.top_p),
                )
            )
        for what, other in tries:
            if (other.temperature, other.top_k, other.top_p) == (
                params.temperature,
                params.top_k,
                params.top_p,
            ):
                continue
            lp = await self._wait(
                trainer.compute_logprobs(_with_sampling(batch, other)), "compute_logprobs()"
            )
            alt = logprob_agreement(results, lp, start)
            if alt.within(self.logprob_atol, self.logprob_max_atol):
                hints.append(
                    f"the engine's log-probs match the trainer's at {what}: the engine reports "
                    "log-probs of another distribution than the one it samples from, or the "
                    "trainer ignores the batch's sampling fields"
                )
        by_length: dict[int, list[float]] = {}
        for result, row in zip(results, agreement.rows, strict=True):
            if not math.isnan(row):
                by_length.setdefault(len(result.prompt_tokens), []).append(row)
        means = {k: sum(v) / len(v) for k, v in sorted(by_length.items())}
        if means:
            hints.append(
                "mean |difference| by prompt length: "
                + ", ".join(f"{k}: {v:.3g}" for k, v in means.items())
                + " (only some lengths off: padding; every length off: a position shift, the "
                "sampling settings, or the weights)"
            )
        return "; ".join(hints)

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "pair_setting" in metafunc.fixturenames:
            settings = list(self.pair_settings)
            metafunc.parametrize("pair_setting", settings, ids=[s[0] for s in settings])

    # -- the laws ----------------------------------------------------------------------------
    def test_logprobs_agree_after_a_sync(self, pair_setting: tuple[str, SamplingParams]) -> None:
        """Generate on prompts of different lengths (which fills any prefix cache), train the
        trainer one step, sync it into the engine, generate on the same prompts again: the
        trainer's ``compute_logprobs`` of the tokens sampled after the sync equals the
        engine's reported log-probs (``logprob_atol`` on the mean, ``logprob_max_atol`` on
        the largest difference), for this sampling setting. Catches a trainer that scores
        the wrong position or ignores padding or the rows' sampling fields, an engine that
        reports log-probs of another distribution than it samples (temperature, top-k,
        top-p; greedy ones included: with a filter set they are still the model's at
        temperature 1, unfiltered), and a prefix cache that outlives a weight load."""
        name, setting = pair_setting
        params = dataclasses.replace(setting, max_tokens=self.max_tokens)

        async def body(pair: _Pair) -> None:
            prompts = self._prompts()
            warm = await self._generate(pair.engine, f"warm-{name}", prompts, params, seed=100)
            version = await self._train_and_sync(pair, warm, params)
            results = await self._generate(pair.engine, f"after-{name}", prompts, params, seed=500)
            stale = sorted({v for r in results for v in r.versions if v != version})
            assert not stale, f"tokens sampled after the sync to {version} report {stale}"
            batch = await rollout_batch(results, [params] * len(results))
            lp = await self._wait(pair.trainer.compute_logprobs(batch), "compute_logprobs()")
            agreement = logprob_agreement(results, lp)
            if not agreement.within(self.logprob_atol, self.logprob_max_atol):
                hints = await self._diagnose(pair.trainer, batch, results, params, (), agreement)
                raise AssertionError(
                    f"[{name}] after a sync to version {version}, the trainer's log-probs of "
                    f"the tokens the engine sampled differ from the engine's: "
                    f"{agreement.describe()} (tolerance: mean {self.logprob_atol}, max "
                    f"{self.logprob_max_atol}). The protocol's log-prob is that of the "
                    "distribution sampled from, after temperature, top-k and top-p "
                    "(asyncflow_core.training.sampling); token i of a response is scored by "
                    f"the logits after prompt + response[:i]. {hints}"
                )

        self._law(f"test_logprobs_agree_after_a_sync[{name}]", body)

    def progress(self, engine: Any) -> ProgressHook | None:
        """How the in-flight law sees that requests are generating (as
        ``InferenceEngineConformance.progress``): default the engine's ``wait_for_tokens``
        (``SupportsProgress``), else None and the law paces itself from a measured request."""
        return engine.wait_for_tokens if isinstance(engine, SupportsProgress) else None

    def test_logprobs_agree_across_an_inflight_load(self) -> None:
        """A sync while requests generate (no pause: ``weight_sync="inflight"``): the tokens
        labelled with the new version have the trainer's log-probs given the whole context,
        the tokens sampled under the old weights included (the engine recomputed, or never
        kept, the context's keys and values of the old weights). After a sync to v (idle),
        the trainer steps to v + 1; requests of ``2 * max_tokens`` start, and once each has
        ``max_tokens // 2`` tokens (``progress``; else paced from a measured request) the sync
        to v + 1 runs. Skipped for an engine that refuses in-flight loads
        (``inflight_weight_load_refusal``); an attempt in which no request had tokens of both
        versions is repeated, acting sooner."""
        params = dataclasses.replace(self.resume_setting, max_tokens=2 * self.max_tokens)
        short = dataclasses.replace(self.resume_setting, max_tokens=self.max_tokens)

        async def body(pair: _Pair) -> None:
            refusal = inflight_load_refusal(pair.engine)
            if refusal is not None:
                pytest.skip(f"the engine refuses weight loads while it generates: {refusal}")
            prompts = self._prompts()
            warm = await self._generate(pair.engine, "inflight-warm", prompts, short, seed=1700)
            await self._train_and_sync(pair, warm, short)
            hook = self.progress(pair.engine)
            delay: float | None = None
            seen: list[str] = []
            for attempt in range(3):
                advantages = [1.0 if i % 2 == 0 else -1.0 for i in range(len(warm))]
                batch = await rollout_batch(warm, [short] * len(warm), advantages)
                await self._wait(
                    pair.trainer.train_step(batch, policy_gradient_loss), "train_step()"
                )
                version: Version = pair.trainer.weight_version
                if hook is None and delay is None:  # pace: a quarter of one whole request
                    loop = asyncio.get_running_loop()
                    t0 = loop.time()
                    await self._generate(pair.engine, "inflight-pace", prompts[:1], params, seed=3)
                    delay = (loop.time() - t0) / 4
                requests = [
                    GenerationRequest(
                        f"inflight-{attempt}-{i}",
                        prompt,
                        dataclasses.replace(params, seed=2100 + 10 * attempt + i),
                    )
                    for i, prompt in enumerate(prompts)
                ]
                before = pair.engine.weight_version
                tasks = [asyncio.ensure_future(pair.engine.generate(r)) for r in requests]
                await asyncio.sleep(0)
                if hook is not None:
                    for request, task in zip(requests, tasks, strict=True):
                        if not task.done():
                            with contextlib.suppress(AsyncFlowError):
                                await self._wait(
                                    hook(request.request_id, self.max_tokens // 2),
                                    "wait_for_tokens()",
                                )
                elif delay:
                    await asyncio.sleep(delay)
                await self._transfer(
                    pair.sync, pair.trainer, version, self.bucket_bytes, init=False
                )
                results = await self._collect(pair.engine, requests, tasks, before)
                start = [
                    r.versions.index(version) if version in r.versions else len(r.tokens)
                    for r in results
                ]
                mixed = sum(0 < k < len(r.tokens) for r, k in zip(results, start, strict=True))
                if not mixed:
                    seen.append(f"attempt {attempt}: no request had tokens of both versions")
                    delay = None if delay is None else delay / 4
                    continue
                rows = await rollout_batch(results, [params] * len(results))
                lp = await self._wait(pair.trainer.compute_logprobs(rows), "compute_logprobs()")
                agreement = logprob_agreement(results, lp, start)
                if not agreement.within(self.logprob_atol, self.logprob_max_atol):
                    raise AssertionError(
                        f"after a sync to version {version} while {mixed} requests were "
                        f"generating, the tokens they sampled under version {version} disagree "
                        f"with the trainer's log-probs: {agreement.describe()} (tolerance: mean "
                        f"{self.logprob_atol}, max {self.logprob_max_atol}). Their context's "
                        "keys and values must be those of the new weights (recompute the KV "
                        "cache of running sequences at a load; the reference engine refills "
                        "it), with the tokens sampled before the load kept in the context"
                    )
                return
            pytest.skip(
                "no request had tokens from both sides of the in-flight sync "
                f"({'; '.join(seen)}): the engine finishes requests too fast to catch"
            )

        self._law("test_logprobs_agree_across_an_inflight_load", body)

    def test_logprobs_agree_on_a_resumed_request(self) -> None:
        """Generate a few tokens per prompt, train one step and sync, then resume each request
        from those tokens (partial rollout): the tokens sampled after the sync, whose context
        is prompt + the old prefix, have the trainer's log-probs (the engine recomputed the
        prefix under the new weights and kept it in the context)."""
        params = self.resume_setting
        first_tokens = max(1, self.max_tokens // 3)

        async def body(pair: _Pair) -> None:
            prompts = self._prompts()
            head = dataclasses.replace(params, max_tokens=first_tokens)
            first = await self._generate(pair.engine, "head", prompts, head, seed=900)
            first = first[:: self.samples_per_prompt]  # one per prompt
            version = await self._train_and_sync(pair, first, head)
            full = dataclasses.replace(params, max_tokens=self.max_tokens)
            resumed = await self._generate(
                pair.engine, "resumed", prompts, full, seed=1300, resume=first
            )
            start = [len(r.tokens) for r in first]
            for r, k in zip(resumed, start, strict=True):
                new = set(r.versions[k:])
                assert new <= {version}, (
                    f"{r.request_id!r}: tokens sampled after the sync to {version} report {new}"
                )
            batch = await rollout_batch(resumed, [full] * len(resumed))
            lp = await self._wait(pair.trainer.compute_logprobs(batch), "compute_logprobs()")
            agreement = logprob_agreement(resumed, lp, start)
            assert agreement.tokens > 0, "no token was generated after the resumed prefixes"
            if not agreement.within(self.logprob_atol, self.logprob_max_atol):
                hints = await self._diagnose(pair.trainer, batch, resumed, full, start, agreement)
                raise AssertionError(
                    f"the tokens a resumed request sampled after its prefix disagree with the "
                    f"trainer's log-probs: {agreement.describe()} (tolerance: mean "
                    f"{self.logprob_atol}, max {self.logprob_max_atol}). A resumed request "
                    "continues from prompt + resume_tokens, all of them in the context (the "
                    f"prefix recomputed under the current weights). {hints}"
                )

        self._law("test_logprobs_agree_on_a_resumed_request", body)

    def test_the_loss_sees_the_engines_logprobs(self) -> None:
        """After a sync, ``train_step`` hands the loss the same log-probs the engine reported
        for the tokens (the batch carries them as ``logprobs``): the training path applies
        the rows' sampling settings like ``compute_logprobs`` does. A trainer in another
        process reports the loss's metric ``pair_logprob_absdiff`` in ``TrainMetrics.extra``."""
        params = dataclasses.replace(self.resume_setting, max_tokens=self.max_tokens)

        async def body(pair: _Pair) -> None:
            prompts = self._prompts()
            warm = await self._generate(pair.engine, "warm", prompts, params, seed=1700)
            await self._train_and_sync(pair, warm, params)
            results = await self._generate(pair.engine, "loss", prompts, params, seed=2100)
            advantages = [1.0 if i % 2 == 0 else -1.0 for i in range(len(results))]
            batch = await rollout_batch(results, [params] * len(results), advantages)
            loss = AgreementLoss()
            metrics: TrainMetrics = await self._wait(
                pair.trainer.train_step(batch, loss), "train_step()"
            )
            if loss.seen:
                total = sum(n for _, n in loss.seen)
                value = sum(v * n for v, n in loss.seen) / total if total else 0.0
            else:
                assert AGREEMENT_METRIC in metrics.extra, (
                    "the loss ran elsewhere and TrainMetrics.extra lacks its metric "
                    f"{AGREEMENT_METRIC!r}: return the loss's metrics in TrainMetrics.extra"
                )
                value = float(metrics.extra[AGREEMENT_METRIC])
            assert value <= self.logprob_atol, (
                f"train_step handed the loss log-probs that differ from the engine's by "
                f"{value:.3g} on average (tolerance {self.logprob_atol}), though "
                "compute_logprobs and the engine were compared by the agreement law: the "
                "training path must compute the same quantity (each row's temperature, "
                "top_k and top_p applied)"
            )

        self._law("test_the_loss_sees_the_engines_logprobs", body)

    def test_a_sync_is_verified_against_the_engines_own_weights(self) -> None:
        """After a sync to version v, ``asyncflow_core.sync.verify.verify_engine`` proves the
        engine holds the trainer's weights for v: by fingerprint where the engine implements
        ``SupportsWeightFingerprints`` (every exported tensor, hashed from the engine's own
        storage, equal to the trainer's, and the probe agreeing with them), else by the probe
        (greedy log-probs within the tolerances). Then the same sync moves *changed* values
        into the engine while the trainer keeps v: the check must now fail, so an engine
        whose fingerprints do not follow what it holds (or a probe blind to its weights)
        fails this law."""
        params = dataclasses.replace(self.resume_setting, max_tokens=self.max_tokens)

        async def body(pair: _Pair) -> None:
            prompts = self._prompts()
            warm = await self._generate(pair.engine, "warm", prompts, params, seed=2500)
            version = await self._train_and_sync(pair, warm, params)
            probe = tuple(self.prompt_tokens(self.prompts - 1))
            check = functools.partial(
                verify_engine, pair.engine, pair.trainer, version, who="the engine",
                bucket_bytes=self.bucket_bytes, probe_prompt=probe,
                mean_atol=self.logprob_atol, max_atol=self.logprob_max_atol,
            )  # fmt: skip
            try:
                report = await self._wait(check(), "verify_engine()")
            except SyncVerificationError as exc:
                raise AssertionError(
                    f"after a sync to version {version} the check says the engine does not "
                    f"hold the trainer's weights: {exc}"
                ) from exc
            assert report.kind != "skipped", f"the check was skipped: {report.reason}"
            assert report.checked > 0, f"the {report.kind} check compared nothing"
            if report.kind == "fingerprint":  # the engine's behaviour must agree with them
                try:
                    await self._wait(check(kind="probe"), "verify_engine(kind='probe')")
                except SyncVerificationError as exc:
                    raise AssertionError(
                        f"the engine's weight fingerprints equal the trainer's for version "
                        f"{version}, but its log-probs do not ({exc}): its fingerprints do "
                        "not describe the weights it generates with (hashed from what it was "
                        "sent rather than from its own storage?)"
                    ) from exc
            changed = [
                WeightBucket(b.names, tuple(_scaled(t) for t in b.tensors))
                for b in await _export(pair.trainer, self.bucket_bytes)
            ]
            await self._wait(pair.sync.start(), "start()")
            for bucket in changed:
                await self._wait(pair.sync.update(bucket), "update()")
            await self._wait(pair.sync.finish(version), f"finish({version})")
            with pytest.raises(SyncVerificationError):
                await self._wait(check(), "verify_engine() after a changed sync")

        self._law("test_a_sync_is_verified_against_the_engines_own_weights", body)


def _scaled(t: torch.Tensor) -> torch.Tensor:
    """``t`` changed enough to move any log-prob: floating values times 3 plus 0.5."""
    return t.detach() * 3 + 0.5 if t.is_floating_point() else t.detach().clone()


async def _export(trainer: TrainEngine, bucket_bytes: int) -> list[WeightBucket]:
    return [b async for b in trainer.export_weights(bucket_bytes)]
