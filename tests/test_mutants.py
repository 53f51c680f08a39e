"""The oracle's power: deliberately broken versions of the reference engines (mutants), each
carrying one bug adapter authors really make, and a test that the conformance suite fails
each one on the law meant to catch it, with a message that says what to fix.

The unbroken engines pass every one of these laws (tests/test_engine_conformance.py,
tests/test_engine_pair.py), so a failure here is the bug, not the law. For the log-prob
mutants (a)-(c) the test also checks the margin: the mutant misses the pair law's tolerance
by at least 10x, so no tolerance tweak could let it through.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pytest
import safetensors.torch
import torch
from asyncflow_conformance import (
    EnginePairConformance,
    InferenceEngineConformance,
    TrainEngineConformance,
    WeightSyncConformance,
)
from asyncflow_conformance.engines import BAD_LOADS, without_field
from asyncflow_conformance.pair import PAIR_SETTINGS
from asyncflow_reference.engines import TorchInferenceEngine, TorchTrainEngine
from asyncflow_reference.model import ModelConfig, TransformerLM
from test_verify_sync import BreaksTheTie, LoadsAStaleCopy, LoadsOneShard, SkipsOneTensor
from torch import Tensor

from asyncflow_core.contracts.errors import CheckpointError, EngineError, WeightSyncError
from asyncflow_core.contracts.protocols import (
    Batch,
    GenerationRequest,
    GenerationResult,
    LossFn,
    WeightBucket,
)
from asyncflow_core.engines.lmtrain import (
    TokenRows,
    read_checkpoint,
    token_rows,
    unique_named_tensors,
)
from asyncflow_core.sync.transports import InProcessWeightSync, bucketize
from asyncflow_core.sync.verify import TensorFingerprint, fingerprints_of
from asyncflow_core.training.rl import LOSS_MASK
from asyncflow_core.training.sampling import SAMPLING_FIELDS, filter_logits, sampled_logprobs

MODEL = ModelConfig(vocab_size=24, d_model=32, n_layers=2, n_heads=2, max_seq_len=96, init_std=0.5)
TIED = dataclasses.replace(MODEL, n_layers=1, tie_embeddings=True)
SETTING = dict(PAIR_SETTINGS)


# --------------------------------------------------------------------------------------------
# Inference-engine mutants
# --------------------------------------------------------------------------------------------
class TemperatureOneLogprobs(TorchInferenceEngine):
    """(b) Samples at the request's temperature (and filters) but reports the log-probs of the
    raw model distribution (temperature 1, no filters)."""

    def _sample(self, idx: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
        choice, _ = super()._sample(idx, logits)
        raw = torch.log_softmax(logits, dim=-1)
        return choice, raw.gather(1, choice.unsqueeze(1)).squeeze(1)


class IgnoresTopKTopP(TorchInferenceEngine):
    """(c) Silently ignores top_k / top_p: samples and reports the temperature-only
    distribution."""

    def _sample(self, idx: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
        self._top_k[idx] = 0
        self._top_p[idx] = 1.0
        return super()._sample(idx, logits)


class LogprobsBeforeFilters(TorchInferenceEngine):
    """Samples with top-k/top-p but reports log-probs after temperature, before the filters
    (SGLang's default ``output_token_logprobs``)."""

    def _sample(self, idx: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
        choice, _ = super()._sample(idx, logits)
        temp = self._temp[idx]
        off = torch.zeros_like(self._top_k[idx])
        scaled = filter_logits(logits, temp, off, torch.ones_like(temp))
        logp = torch.log_softmax(scaled, dim=-1)
        return choice, logp.gather(1, choice.unsqueeze(1)).squeeze(1)


class GreedyReportsZero(TorchInferenceEngine):
    """Reports log-prob 0 for greedy tokens ("the argmax had probability 1"), not the model's
    log-prob at temperature 1."""

    def _sample(self, idx: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
        choice, logp = super()._sample(idx, logits)
        return choice, torch.where(self._temp[idx] == 0, torch.zeros_like(logp), logp)


class LateAbortRegistration(TorchInferenceEngine):
    """(d) ``generate`` awaits something (a tokenizer, a lock, a connection) before it
    registers the request, so an abort sent right after the call finds nothing to abort."""

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        await asyncio.sleep(0)
        return await self.submit(request)


class StalePrefixCache(TorchInferenceEngine):
    """(g) Caches each context's prefill (keys, values, next-token logits) and reuses it for
    later requests with the same context, but never drops the cache on ``load_weights``: a
    request after a sync starts from keys and values of the old weights."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._prefix: dict[tuple[int, ...], tuple[list[Tensor], list[Tensor], Tensor]] = {}

    def _prefill_step(self, out: Any) -> None:
        cache = self._cache
        assert cache is not None
        idx = self._refill[: self._n].nonzero().squeeze(1)
        keys = {s: tuple(self._tok[s, : int(self._ctx[s])].tolist()) for s in idx.tolist()}
        misses = [s for s in idx.tolist() if keys[s] not in self._prefix]
        if misses:
            rows = torch.tensor(misses)
            lengths = self._ctx[rows]
            logits = self.model.prefill(self._tok[rows, : int(lengths.max())], lengths, cache, rows)
            for j, s in enumerate(misses):
                n = int(lengths[j])
                self._prefix[keys[s]] = (
                    [k[s, :, :n].clone() for k in cache.k],
                    [v[s, :, :n].clone() for v in cache.v],
                    logits[j].clone(),
                )
        for s in idx.tolist():
            ks, vs, _ = self._prefix[keys[s]]
            n = ks[0].shape[1]
            for layer in range(len(cache.k)):
                cache.k[layer][s, :, :n] = ks[layer]
                cache.v[layer][s, :, :n] = vs[layer]
        self._refill[idx] = False
        self.prefill_steps += 1
        self._advance(idx, torch.stack([self._prefix[keys[s]][2] for s in idx.tolist()]), out)


class ResumeDropsLastToken(TorchInferenceEngine):
    """(h) Resumes a request by sending prompt + prefix as a new prompt, but with an
    off-by-one that leaves the prefix's last token out of the context: the continuation's
    log-probs jump away from the trainer's after every abort/resume."""

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        k = len(request.resume_tokens)
        if not k or k >= request.params.max_tokens:
            return await super().generate(request)
        inner = dataclasses.replace(
            request,
            prompt_tokens=request.prompt_tokens + request.resume_tokens[:-1],
            resume_tokens=(),
            resume_logprobs=(),
            resume_versions=(),
            params=dataclasses.replace(request.params, max_tokens=request.params.max_tokens - k),
        )
        r = await super().generate(inner)
        return GenerationResult(
            request.request_id,
            request.prompt_tokens,
            request.resume_tokens + r.tokens,
            request.resume_logprobs + r.logprobs,
            request.resume_versions + r.versions,
            r.finish_reason,
        )


# --------------------------------------------------------------------------------------------
# Trainer mutants
# --------------------------------------------------------------------------------------------
class ShiftedLogprobs(TorchTrainEngine):
    """(a) Scores each response token with the logits at its own position (the token given
    itself) instead of the position before it."""

    def _response_logprobs(self, rows: TokenRows) -> tuple[Tensor, int]:
        b, r = rows.response.shape
        if r == 0 or b == 0:
            return torch.zeros(b, r), 0
        seq, source = rows.inputs()
        source = (source + 1).clamp(max=seq.shape[1] - 1)
        hidden = self.model.hidden(seq)
        picked = hidden.gather(1, source.unsqueeze(2).expand(b, r, hidden.shape[2]))
        return rows.logprobs(self.model.head(picked))


class PaddingBlind(TorchTrainEngine):
    """Reads the padded prompt tensor as if every prompt filled its width: a shorter prompt's
    padding becomes context."""

    def _prepare(self, batch: Batch) -> TokenRows:
        rows = super()._prepare(batch)
        width = torch.full_like(rows.plen, rows.prompt.shape[1])
        return dataclasses.replace(rows, plen=width)


def _without_sampling(batch: Batch) -> Batch:
    data = {k: v for k, v in batch.data.items() if k not in SAMPLING_FIELDS}
    return Batch(batch.rows, data, dict(batch.lengths), batch.tags)


class IgnoresSamplingFields(TorchTrainEngine):
    """Computes every log-prob at its constructor's temperature, whatever the rows were
    sampled with."""

    def _prepare(self, batch: Batch) -> TokenRows:
        return super()._prepare(_without_sampling(batch))


class LossPathIgnoresSampling(TorchTrainEngine):
    """``compute_logprobs`` applies the rows' sampling settings, but the training path (the
    log-probs handed to the loss) does not."""

    def _train_step(self, batch: Batch, loss_fn: LossFn) -> Any:
        return super()._train_step(_without_sampling(batch), loss_fn)


class CheckpointDropsOptimizer(TorchTrainEngine):
    """(e) ``load_checkpoint`` restores weights and version but starts the optimizer afresh
    (Adam's moments and step count lost)."""

    def _load(self, path: Any) -> None:
        super()._load(path)
        self._optimizer.state.clear()


class TiedExportedTwice(TorchTrainEngine):
    """(f) Exports every ``state_dict`` name: a tied LM head travels twice, under the
    embedding's name and its own."""

    def _exported(self) -> list[tuple[str, Tensor]]:
        return [(n, t.detach()) for n, t in self.model.state_dict().items()]


class TiedSharedCheckpoint(TorchTrainEngine):
    """(f) Saves the full ``state_dict`` with safetensors, which refuses tensors that share
    memory (a tied LM head)."""

    def _save(self, path: Any) -> None:
        path.mkdir(parents=True, exist_ok=True)
        state = {n: t.detach() for n, t in self.model.state_dict().items()}
        safetensors.torch.save_file(state, str(path / "model.safetensors"))


# --------------------------------------------------------------------------------------------
# Suites over the mutants
# --------------------------------------------------------------------------------------------
class FingerprintsWhatItWasSent(SkipsOneTensor):
    """Skips a tensor at load, and reports the fingerprints of what it was sent, not of what
    it holds: the fingerprints agree, its log-probs do not."""

    async def load_weights(self, weights: Any, version: Any) -> None:
        self._sent = fingerprints_of(list(weights))
        await super().load_weights(weights, version)

    async def weight_fingerprints(self) -> dict[str, TensorFingerprint]:
        held = await super().weight_fingerprints()
        return {**held, **getattr(self, "_sent", {})}


# --------------------------------------------------------------------------------------------
# Issue #42: bug classes the suite had no law for
# --------------------------------------------------------------------------------------------
# 1. version labels across weight changes
class VersionAtAdmission(TorchInferenceEngine):
    """Labels every token of a request with the weight version it was admitted under (one
    version per request, read once)."""

    def _admit(self, admit: list[Any]) -> None:
        super()._admit(admit)
        self.__dict__.setdefault("_admitted", {}).update({id(p): self._wversion for p in admit})

    def _retire(self, slots: list[int], reasons: list[Any], out: Any) -> None:
        admitted = self.__dict__.get("_admitted", {})
        for slot in slots:
            pending = self._slots[slot]
            if pending is not None and id(pending) in admitted:
                a = int(self._plen[slot]) + len(pending.request.resume_tokens)
                self._ver[slot, a : int(self._ctx[slot])] = admitted.pop(id(pending))
        super()._retire(slots, reasons, out)


class RelabelsAtFinish(TorchInferenceEngine):
    """Labels every new token of a request with the engine's version when it finishes."""

    def _retire(self, slots: list[int], reasons: list[Any], out: Any) -> None:
        for slot in slots:
            pending = self._slots[slot]
            if pending is not None:
                a = int(self._plen[slot]) + len(pending.request.resume_tokens)
                self._ver[slot, a : int(self._ctx[slot])] = self._wversion
        super()._retire(slots, reasons, out)


class LazyVersionLabel(TorchInferenceEngine):
    """Reports the loaded version at once, but labels tokens with a version it refreshes only
    when it admits new requests."""

    _latest = 0

    @property
    def weight_version(self) -> int:
        return self._latest

    def _apply_weights(self, staged: Any, version: int) -> None:
        label = self._wversion
        super()._apply_weights(staged, version)
        self._latest, self._wversion = version, label

    def _admit(self, admit: list[Any]) -> None:
        self._wversion = self._latest
        super()._admit(admit)


# 2. the loss mask through train_step
class DropsLossMask(TorchTrainEngine):
    """Rebuilds the batch from the fields it knows before the step: the loss never sees
    ``loss_mask``, and every response token trains."""

    async def train_step(self, batch: Batch, loss_fn: LossFn) -> Any:
        return await super().train_step(without_field(batch, LOSS_MASK), loss_fn)


class _AllTokenRows(TokenRows):
    __slots__ = ()

    @property
    def trained_tokens(self) -> int:
        return self.response_tokens

    def part(self, start: int, stop: int) -> TokenRows:
        rows = super().part(start, stop)
        return _AllTokenRows(**{f.name: getattr(rows, f.name) for f in dataclasses.fields(rows)})


class WeighsByAllTokens(TorchTrainEngine):
    """Weighs each micro-batch's loss by its share of all response tokens, not of the tokens
    the loss mask trains."""

    def _prepare(self, batch: Batch) -> TokenRows:
        rows = super()._prepare(batch)
        return _AllTokenRows(**{f.name: getattr(rows, f.name) for f in dataclasses.fields(rows)})


class MaskShiftedByOne(TorchTrainEngine):
    """Aligns the loss mask with the input positions instead of the predicted tokens: shifted
    one to the right."""

    async def train_step(self, batch: Batch, loss_fn: LossFn) -> Any:
        mask = batch.data.get(LOSS_MASK)
        if isinstance(mask, Tensor) and mask.dim() == 2:
            shifted = torch.ones_like(mask)
            shifted[:, 1:] = mask[:, :-1]
            batch = Batch(batch.rows, {**batch.data, LOSS_MASK: shifted}, dict(batch.lengths))
        return await super().train_step(batch, loss_fn)


# 3. sampling filters in the documented order
def _greedy_safe(temp: Tensor) -> Tensor:
    return torch.where(temp > 0, torch.ones_like(temp), torch.zeros_like(temp))


class TopPBeforeTopK(TorchInferenceEngine):
    """Applies top-p to the whole temperature-scaled distribution, then top-k."""

    def _filter(self, logits: Tensor, temp: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
        first = filter_logits(logits, temp, torch.zeros_like(top_k), top_p)
        return filter_logits(first, _greedy_safe(temp), top_k, torch.ones_like(top_p))


class TopPBeforeTemperature(TorchInferenceEngine):
    """Applies top-k and top-p to the temperature-1 distribution, then the temperature."""

    def _filter(self, logits: Tensor, temp: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
        first = filter_logits(logits, _greedy_safe(temp), top_k, top_p)
        return filter_logits(first, temp, torch.zeros_like(top_k), torch.ones_like(top_p))


class TopPDropsTheCrossingToken(TorchInferenceEngine):
    """Keeps the tokens whose cumulative probability stays within top_p, dropping the one that
    crosses it (the documented rule keeps it)."""

    def _filter(self, logits: Tensor, temp: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
        x = filter_logits(logits, temp, top_k, torch.ones_like(top_p))
        probs, order = torch.softmax(x, dim=-1).sort(dim=-1, descending=True)
        keep = probs.cumsum(dim=-1) <= top_p.unsqueeze(-1)
        keep[..., 0] = True
        drop = torch.zeros_like(keep).scatter(-1, order, ~keep)
        active = ((top_p < 1) & (temp > 0)).unsqueeze(-1)
        return x.masked_fill(active & drop, -math.inf)


# 4. loads validated before anything changes
class LoadsAsItChecks(TorchInferenceEngine):
    """Copies each tensor in as soon as it is checked: a bad entry after good ones raises
    with the good ones already loaded."""

    def _check_weights(self, weights: Any) -> list[Any]:
        for item in weights:
            for param, tensor in super()._check_weights([item]):
                with torch.no_grad():
                    param.copy_(tensor)
        return []


class SkipsUnknownNames(TorchInferenceEngine):
    """Loads the names it knows and silently skips the others."""

    def _check_weights(self, weights: Any) -> list[Any]:
        return super()._check_weights([(n, t) for n, t in weights if n in self._params])


class VersionBeforeChecks(TorchInferenceEngine):
    """Sets the new version before it checks the tensors."""

    async def load_weights(self, weights: Any, version: int) -> None:
        self._wversion = version
        await super().load_weights(weights, version)


# 5. stop tokens
class StopTokenLeftOut(TorchInferenceEngine):
    """Ends at a stop token but leaves it out of the result."""

    def _retire(self, slots: list[int], reasons: list[Any], out: Any) -> None:
        for slot, reason in zip(slots, reasons, strict=True):
            if reason == "stop":
                self._ctx[slot] -= 1
        super()._retire(slots, reasons, out)


class FirstStopIdOnly(TorchInferenceEngine):
    """Honours only the first of several stop ids (passed on as a single EOS id)."""

    def _admit(self, admit: list[Any]) -> None:
        for pending in admit:
            ids = pending.request.params.stop_token_ids[:1]
            params = dataclasses.replace(pending.request.params, stop_token_ids=ids)
            pending.request = dataclasses.replace(pending.request, params=params)
        super()._admit(admit)


class StopReportedAsLength(TorchInferenceEngine):
    """Ends at a stop token with finish_reason "length"."""

    def _retire(self, slots: list[int], reasons: list[Any], out: Any) -> None:
        super()._retire(slots, ["length" if r == "stop" else r for r in reasons], out)


# 6. what close() frees
class CloseKeepsTheWorker(TorchInferenceEngine):
    """``close()`` stops the driver but never shuts its worker thread's executor down."""

    async def close(self) -> None:
        self._executor.shutdown = lambda *args, **kwargs: None  # type: ignore[method-assign]
        await super().close()


class CloseKeepsTheDriver(TorchInferenceEngine):
    """``close()`` shuts the executor down but leaves the driver task waiting."""

    async def close(self) -> None:
        self._closed = True
        self._executor.shutdown(wait=False)


class TrainerCloseKeepsTheWorker(TorchTrainEngine):
    """The trainer's ``close()`` marks it closed and leaves its worker thread running."""

    async def close(self) -> None:
        self._closed = True


# 7. issue #42's promise table: laws for the gaps (conformance/PROMISES.md, "Gaps")
class GreedySampledInAMixedBatch(TorchInferenceEngine):
    """Decodes greedy rows greedily only when the whole batch is greedy; in a batch mixed with
    sampled rows they are sampled at temperature 1 (the argmax overwrite forgotten)."""

    def _sample(self, idx: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
        temp = self._temp[idx].clone()
        greedy = temp == 0
        if not bool(greedy.any()) or bool(greedy.all()):
            return super()._sample(idx, logits)
        self._temp[idx] = torch.where(greedy, torch.ones_like(temp), temp)
        try:
            return super()._sample(idx, logits)
        finally:
            self._temp[idx] = temp


class UnseededGetSeedZero(TorchInferenceEngine):
    """Passes ``seed or 0`` on: every unseeded request draws with seed 0."""

    def _admit(self, admit: list[Any]) -> None:
        for pending in admit:
            params = pending.request.params
            if params.seed is None:
                params = dataclasses.replace(params, seed=0)
                pending.request = dataclasses.replace(pending.request, params=params)
        super()._admit(admit)


class GeneratorResetEveryStep(TorchInferenceEngine):
    """Builds the engine's generator afresh from its seed at every step: every step draws the
    same numbers."""

    def _sample(self, idx: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
        self._gen = torch.Generator().manual_seed(self.seed)
        return super()._sample(idx, logits)


class TensorLogprobs(TorchInferenceEngine):
    """Hands back the new tokens' log-probs as 0-dim tensors (``tuple(lps[i][a:b])`` of the
    tensor, ``.tolist()`` forgotten)."""

    def _retire(self, slots: list[int], reasons: list[Any], out: Any) -> None:
        first = len(out.results)
        super()._retire(slots, reasons, out)
        for j in range(first, len(out.results)):
            pending, r = out.results[j]
            k = len(pending.request.resume_logprobs)
            new = tuple(torch.tensor(r.logprobs[k:]).unbind())
            out.results[j] = (pending, dataclasses.replace(r, logprobs=r.logprobs[:k] + new))


class NumpyVersions(TorchInferenceEngine):
    """Hands back the versions as numpy ints (``tuple(np.asarray(...))``)."""

    def _retire(self, slots: list[int], reasons: list[Any], out: Any) -> None:
        first = len(out.results)
        super()._retire(slots, reasons, out)
        for j in range(first, len(out.results)):
            pending, r = out.results[j]
            out.results[j] = (
                pending,
                dataclasses.replace(r, versions=tuple(np.asarray(r.versions))),
            )


class VagueRejections(TorchInferenceEngine):
    """Rejects a bad request with a message that names nothing ("invalid request")."""

    def _check_request(self, request: GenerationRequest) -> None:
        try:
            super()._check_request(request)
        except EngineError:
            raise EngineError(f"{self.name}: invalid request") from None


class SleepsThoughDeclaredUnavailable(TorchInferenceEngine):
    """Declares ``SupportsSleep`` unavailable (a CPU has no device memory to free), but its
    ``sleep()`` still returns silently instead of raising the reason."""

    unavailable_abilities: ClassVar[dict[str, str]] = {
        "SupportsSleep": "no device memory to free on a CPU"
    }


class RefusesTopPWithoutSaying(TorchInferenceEngine):
    """Refuses top-p with a bare "unsupported sampling"."""

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if request.params.top_p < 1:
            raise EngineError("unsupported sampling")
        return await super().generate(request)


class WakeUpRebuildsTheModel(TorchInferenceEngine):
    """``wake_up()`` rebuilds the model from its config: the factory's weights come back under
    the loaded version."""

    def _alloc_cache(self) -> None:
        super()._alloc_cache()
        self.model = TransformerLM(self.config, seed=self.seed).eval().requires_grad_(False)


class WaitReturnsOneEarly(TorchInferenceEngine):
    """``wait_for_tokens(id, n)`` returns once the request has ``n - 1`` tokens (an
    off-by-one in the count it watches for)."""

    def watch_tokens(self, request_id: str, count: int) -> asyncio.Future[int]:
        return super().watch_tokens(request_id, max(count - 1, 0))


class WaitReportsThePrefixCount(TorchInferenceEngine):
    """``wait_for_tokens(id, n)`` with ``n`` at most the resumed prefix answers the prefix's
    length, even once the request has generated more (the count it had at submission)."""

    def watch_tokens(self, request_id: str, count: int) -> asyncio.Future[int]:
        pending = self._inflight.get(request_id)
        have = 0 if pending is None else len(pending.request.resume_tokens)
        if pending is not None and count <= have:
            future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            future.set_result(have)
            return future
        return super().watch_tokens(request_id, count)


class _RowCountRows(TokenRows):
    __slots__ = ()

    @property
    def trained_tokens(self) -> int:
        return len(self)

    def part(self, start: int, stop: int) -> TokenRows:
        rows = super().part(start, stop)
        return _RowCountRows(**{f.name: getattr(rows, f.name) for f in dataclasses.fields(rows)})


class WeighsMicroBatchesByRows(TorchTrainEngine):
    """Weighs each micro-batch's loss by its share of the rows (``(stop - start) / b``), not of
    the trained tokens: the step and its reported loss depend on how rows fall into parts."""

    def _prepare(self, batch: Batch) -> TokenRows:
        rows = super()._prepare(batch)
        return _RowCountRows(**{f.name: getattr(rows, f.name) for f in dataclasses.fields(rows)})


class StepPerMicroBatch(TorchTrainEngine):
    """Takes an optimizer step after every micro-batch (``step()`` inside the loop), still
    adding 1 to the version per ``train_step``."""

    def _optimizer_step(
        self, rows: TokenRows, parts: list[Any], loss_fn: LossFn, means: Any
    ) -> tuple[float, float, int]:
        loss, norms, off = 0.0, [], 0
        for part in parts:
            part_loss, norm, part_off = super()._optimizer_step(rows, [part], loss_fn, means)
            loss, off = loss + part_loss, off + part_off
            norms.append(norm)
        return loss, sum(norms) / len(norms), off


class DefaultTemperatureIgnored(TorchTrainEngine):
    """Built with temperature 0.7, but scores a batch without sampling fields at temperature
    1 (the constructor's temperature never reaches ``token_rows``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, temperature=0.7, **kwargs)

    def _prepare(self, batch: Batch) -> TokenRows:
        return token_rows(
            batch, who=self.name, vocab_size=self.vocab_size, max_seq_len=self.max_seq_len
        )


class DropsOneRowMicroBatches(TorchTrainEngine):
    """Skips micro-batches of fewer than two rows (as a rank with no rows skipping its
    forward and backward)."""

    def _optimizer_step(
        self, rows: TokenRows, parts: list[Any], loss_fn: LossFn, means: Any
    ) -> tuple[float, float, int]:
        kept = [(start, stop, part) for start, stop, part in parts if stop - start >= 2]
        return super()._optimizer_step(rows, kept, loss_fn, means)


class UncheckedTokenIds(TorchTrainEngine):
    """Checks no token id against the vocabulary: the embedding raises ``IndexError`` once it
    reaches the bad row."""

    def _prepare(self, batch: Batch) -> TokenRows:
        return token_rows(batch, who=self.name, vocab_size=None, max_seq_len=self.max_seq_len)


class LiveExport(TorchTrainEngine):
    """Exports the live parameters (``bucketize`` without ``pack``): a step during the export
    shows in the buckets not yet yielded."""

    def _snapshot(self, bucket_bytes: int) -> list[WeightBucket]:
        return bucketize(self._exported(), bucket_bytes)


class LiveFlaggedSnapshot(TorchTrainEngine):
    """Yields the live parameters in buckets flagged ``snapshot=True``."""

    def _snapshot(self, bucket_bytes: int) -> list[WeightBucket]:
        return [
            WeightBucket(b.names, b.tensors, snapshot=True)
            for b in bucketize(self._exported(), bucket_bytes)
        ]


class KeepsTheLastRows(TorchTrainEngine):
    """Keeps the last batch's ``TokenRows`` (a debugging handle): its tensors are the batch's."""

    def _prepare(self, batch: Batch) -> TokenRows:
        self._last_rows = super()._prepare(batch)
        return self._last_rows


class HoldsTheStepButFlagsLiveBuckets(TorchTrainEngine):
    """Holds a ``train_step`` until the export ends (no mix), but yields the live parameters
    flagged ``snapshot=True``: the step then changes buckets a transport may still be
    sending."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._exporting = asyncio.Lock()

    async def _export(self, bucket_bytes: int) -> Any:
        async with self._exporting:
            for bucket in await self._run(LiveFlaggedSnapshot._snapshot, self, bucket_bytes):
                yield bucket

    async def train_step(self, batch: Batch, loss_fn: LossFn) -> Any:
        async with self._exporting:
            return await super().train_step(batch, loss_fn)


class ComputesOnTheLoop(TorchTrainEngine):
    """Computes every call inside its coroutine (``return fn(*args)`` where ``await
    loop.run_in_executor(...)`` belongs): the event loop stalls meanwhile."""

    async def _run(self, fn: Callable[..., Any], *args: object) -> Any:
        return fn(*args)


class TwoWorkerThreads(TorchTrainEngine):
    """Runs its calls on a pool of two threads: a call overlaps or overtakes the one before."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._executor.shutdown(wait=False)
        self._executor = ThreadPoolExecutor(2, thread_name_prefix=self.name)


class FloorIsTheUnfilteredLogprob(TorchTrainEngine):
    """Gives a token off its row's top-k/top-p support its unfiltered log-prob (temperature
    only) instead of the documented floor ``log p - log(Z + p)``."""

    def _response_logprobs(self, rows: TokenRows) -> tuple[Tensor, int]:
        b, r = rows.response.shape
        if r == 0 or b == 0:
            return super()._response_logprobs(rows)
        seq, source = rows.inputs()
        hidden = self.model.hidden(seq)
        picked = hidden.gather(1, source.unsqueeze(2).expand(b, r, hidden.shape[2]))
        logits = self.model.head(picked)
        knobs = (rows.temperature.unsqueeze(1), rows.top_k.unsqueeze(1), rows.top_p.unsqueeze(1))
        lp, off = sampled_logprobs(logits, rows.response, *knobs)
        plain = (knobs[0], torch.zeros_like(knobs[1]), torch.ones_like(knobs[2]))
        unfiltered, _ = sampled_logprobs(logits, rows.response, *plain)
        lp = torch.where(off, unfiltered, lp)
        real = torch.arange(r).unsqueeze(0) < rows.rlen.unsqueeze(1)
        return torch.where(real, lp, torch.zeros_like(lp)), int((off & real).sum())


class UncountedOffSupport(TorchTrainEngine):
    """Gives off-support tokens the floor but never counts them."""

    def _response_logprobs(self, rows: TokenRows) -> tuple[Tensor, int]:
        return super()._response_logprobs(rows)[0], 0


class CopiesUntilAMisfit(TorchTrainEngine):
    """Loads a checkpoint by copying its tensors in order, without checking first that they
    fit: a misfit raises ``CheckpointError`` with the tensors before it already loaded."""

    def _load(self, path: Any) -> None:
        meta, weights, optimizer = read_checkpoint(
            path, who=self.name, format=self.checkpoint_format, writer="save_checkpoint"
        )
        try:
            with torch.no_grad():
                for name, tensor in unique_named_tensors(self.model):
                    tensor.copy_(weights[name])
            self._optimizer.load_state_dict(optimizer)
        except (RuntimeError, KeyError, ValueError) as exc:
            raise CheckpointError(f"{self.name}: checkpoint {path} does not fit: {exc}") from exc
        self._version = int(meta["version"])


# weight syncs
class ForgetsWhatWasSent(InProcessWeightSync):
    """Checks each bucket on its own but never records what was sent: a parameter sent in an
    earlier bucket of the sync is taken again."""

    async def update(self, bucket: WeightBucket) -> None:
        await super().update(bucket)
        self._seen.clear()


class ChecksOnlyEarlierBuckets(InProcessWeightSync):
    """Rejects a name sent in an earlier bucket, not one a bucket names twice."""

    async def update(self, bucket: WeightBucket) -> None:
        self._phases.expect("update")
        for name in bucket.names:
            if name in self._seen:
                raise WeightSyncError(f"parameter {name!r} was sent twice in one sync")
        self._staged += [(n, t.detach().clone()) for n, t in bucket]
        self._seen.update(bucket.names)


class StagesLiveTensors(InProcessWeightSync):
    """Stages each bucket's tensors without copying them: what the trainer writes after
    ``update`` reaches the targets at ``finish``."""

    async def update(self, bucket: WeightBucket) -> None:
        await super().update(bucket)
        n = len(bucket.names)
        self._staged[-n:] = [(name, t.detach()) for name, t in bucket]


VERIFY_LAW = "test_a_sync_is_verified_against_the_engines_own_weights"
LABEL_LAW = "test_tokens_after_a_load_carry_its_version"
PAUSED_LABEL_LAW = "test_a_load_while_paused_labels_the_resumed_tokens"
MASK_LAW = "test_train_step_honours_the_loss_mask"
FILTER_LAW = "test_each_sampling_filter_removes_tokens"
LOAD_LAW = "test_a_rejected_load_loads_nothing"
STOP_LAW = "test_stop_token_ids_end_the_request"
CLOSE_LAW = "test_close_releases_what_the_engine_started"
GREEDY_LAW = "test_greedy_picks_the_most_probable_token"
UNSEEDED_LAW = "test_unseeded_requests_draw_anew"
PLAIN_LAW = "test_results_are_plain_python_values"
NAMES_LAW = "test_a_rejection_names_the_bad_value"
UNAVAILABLE_LAW = "test_an_unavailable_ability_raises_its_reason"
REFUSAL_LAW = "test_a_refused_sampling_setting_says_why"
SLEEP_LAW = "test_sleep_keeps_the_weights"
WAIT_LAW = "test_wait_for_tokens_reports_the_count"
SPLIT_LAW = "test_a_step_does_not_depend_on_how_rows_split_into_micro_batches"
WHOLE_LOSS_LAW = "test_the_reported_loss_is_the_whole_batchs"
DEFAULT_SAMPLING_LAW = "test_a_batch_without_sampling_fields_is_scored_at_the_default"
ONE_ROW_LAW = "test_a_batch_of_one_row_trains"
BAD_ROW_LAW = "test_a_bad_row_anywhere_rejects_the_whole_batch"
MIXED_EXPORT_LAW = "test_an_export_never_mixes_two_versions"
BATCH_REFERENCE_LAW = "test_train_step_keeps_no_reference_to_the_batch"
EVENT_LOOP_LAW = "test_train_step_leaves_the_event_loop_free"
ARRIVAL_ORDER_LAW = "test_concurrent_calls_run_in_arrival_order"
DUPLICATE_LAW = "test_a_duplicate_parameter_is_rejected"
LIVE_BUCKET_LAW = "test_a_live_bucket_may_change_after_update"
OFF_SUPPORT_LAW = "test_off_support_tokens_get_the_floor_and_are_counted"
MISFIT_LAW = "test_a_checkpoint_that_does_not_fit_changes_nothing"


def _closing(self: Any, engine: Any) -> Any:
    return engine.close()


def inference_suite(engine_cls: type[TorchInferenceEngine]) -> InferenceEngineConformance:
    class Suite(InferenceEngineConformance):
        vocab_size = MODEL.vocab_size
        context_window = MODEL.max_seq_len
        long_max_tokens = 80
        real_timeout_s = 120.0
        release_timeout_s = 5.0  # a correct engine's thread ends within milliseconds

        def make_engine(self) -> TorchInferenceEngine:
            return engine_cls(MODEL, max_batch=8, seed=0)

        def weights_for_load(self, engine: Any) -> list[tuple[str, Tensor]]:
            return [(n, t.detach().clone()) for n, t in engine.model.named_parameters()]

        close_engine = _closing

    return Suite()


def train_suite(
    trainer_cls: type[TorchTrainEngine], config: ModelConfig, **knobs: Any
) -> TrainEngineConformance:
    class Suite(TrainEngineConformance):
        vocab_size = config.vocab_size
        required_fields = ("prompt", "response", "advantage")
        real_timeout_s = 120.0
        release_timeout_s = 5.0

        def make_engine(self) -> TorchTrainEngine:
            return trainer_cls(config, micro_batch_size=2, seed=0)

        def make_other_engine(self) -> TorchTrainEngine:
            return TorchTrainEngine(dataclasses.replace(config, max_seq_len=48), seed=1)

        close_engine = _closing

    for name, value in knobs.items():
        setattr(Suite, name, value)
    return Suite()


def sync_suite(sync_cls: type[InProcessWeightSync]) -> WeightSyncConformance:
    class Suite(WeightSyncConformance):
        bucket_bytes = 16 << 10
        real_timeout_s = 120.0

        def make_source(self) -> TorchTrainEngine:
            return TorchTrainEngine(MODEL, seed=1)

        def make_targets(self) -> list[TorchInferenceEngine]:
            return [TorchInferenceEngine(MODEL, max_batch=4, seed=0) for _ in range(2)]

        def make_sync(self, targets: Any) -> InProcessWeightSync:
            return sync_cls(targets)

        def target_weights(self, engine: Any) -> dict[str, Tensor]:
            return dict(engine.model.state_dict())

    return Suite()


def pair_suite(
    engine_cls: type[TorchInferenceEngine] = TorchInferenceEngine,
    trainer_cls: type[TorchTrainEngine] = TorchTrainEngine,
    config: ModelConfig = MODEL,
) -> EnginePairConformance:
    class Suite(EnginePairConformance):
        vocab_size = config.vocab_size
        real_timeout_s = 120.0

        def make_inference(self) -> TorchInferenceEngine:
            return engine_cls(config, max_batch=16, seed=0)

        def make_trainer(self) -> TorchTrainEngine:
            return trainer_cls(config, seed=1, micro_batch_size=5, lr=1e-2)

        close_engine = _closing

    return Suite()


@dataclass(frozen=True)
class Mutant:
    """A broken engine, the law that must fail on it, and what its message must say."""

    id: str
    make_suite: Callable[[], Any]
    law: str
    message: str
    arg: Any = None
    margin: bool = False
    """Check that the pair law's mean difference misses its tolerance by >= 10x."""


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "a-shifted-logprobs",
        lambda: pair_suite(trainer_cls=ShiftedLogprobs),
        "test_logprobs_agree_after_a_sync",
        "the trainer's log-probs of the tokens the engine sampled differ",
        ("t1", SETTING["t1"]),
        margin=True,
    ),
    Mutant(
        "b-temperature-one-logprobs",
        lambda: pair_suite(engine_cls=TemperatureOneLogprobs),
        "test_logprobs_agree_after_a_sync",
        "match the trainer's at temperature 1",
        ("t0.7", SETTING["t0.7"]),
        margin=True,
    ),
    Mutant(
        "c-ignores-top-k-top-p",
        lambda: pair_suite(engine_cls=IgnoresTopKTopP),
        "test_logprobs_agree_after_a_sync",
        "differ from the engine's",
        ("t1.3-top_k=4", SETTING["t1.3-top_k=4"]),
        margin=True,
    ),
    Mutant(
        "c-ignores-top-k-top-p-alone",
        lambda: inference_suite(IgnoresTopKTopP),
        "test_logprobs_match_the_sampling_distribution",
        "with top_k=1 the engine reported",
        ("top_k=1", dict(InferenceEngineConformance.logprob_settings)["top_k=1"]),
    ),
    Mutant(
        "logprobs-before-filters",
        lambda: pair_suite(engine_cls=LogprobsBeforeFilters),
        "test_logprobs_agree_after_a_sync",
        "but before top-k/top-p",
        ("t0.8-top_k=5-top_p=0.9", SETTING["t0.8-top_k=5-top_p=0.9"]),
    ),
    Mutant(
        "greedy-reports-zero",
        lambda: pair_suite(engine_cls=GreedyReportsZero),
        "test_logprobs_agree_after_a_sync",
        "differ from the engine's",
        ("greedy", SETTING["greedy"]),
    ),
    Mutant(
        "d-late-abort-registration",
        lambda: inference_suite(LateAbortRegistration),
        "test_abort_right_after_submit_is_not_lost",
        "the abort was lost",
    ),
    *(
        Mutant(
            f"d-late-registration-named-first-by-{law.removeprefix('test_')}",
            lambda: inference_suite(LateAbortRegistration),
            law,
            "First cause: the engine registers a request late",
        )
        for law in (
            "test_abort_returns_the_prefix",
            "test_pause_keep_freezes_in_flight_requests",
            "test_pause_abort_aborts_in_flight_requests",
            LABEL_LAW,
        )
    ),
    Mutant(
        "e-checkpoint-drops-optimizer",
        lambda: train_suite(CheckpointDropsOptimizer, MODEL),
        "test_checkpoint_resumes_the_optimizer",
        "must restore the optimizer state",
    ),
    Mutant(
        "f-tied-exported-twice",
        lambda: train_suite(TiedExportedTwice, TIED),
        "test_export_holds_no_parameter_twice",
        "tied weights exported twice",
    ),
    Mutant(
        "f-tied-shared-checkpoint",
        lambda: train_suite(TiedSharedCheckpoint, TIED),
        "test_checkpoint_restores_the_weights",
        "tied \\(shared\\) tensors",
    ),
    Mutant(
        "g-stale-prefix-cache",
        lambda: pair_suite(engine_cls=StalePrefixCache),
        "test_logprobs_agree_after_a_sync",
        "after a sync to version 1",
        ("t1", SETTING["t1"]),
    ),
    Mutant(
        "h-resume-drops-last-token",
        lambda: pair_suite(engine_cls=ResumeDropsLastToken),
        "test_logprobs_agree_on_a_resumed_request",
        "a resumed request sampled after its prefix",
    ),
    Mutant(
        "padding-blind-trainer",
        lambda: pair_suite(trainer_cls=PaddingBlind),
        "test_logprobs_agree_after_a_sync",
        "by prompt length",
        ("t1", SETTING["t1"]),
    ),
    Mutant(
        "trainer-ignores-sampling-fields",
        lambda: train_suite(IgnoresSamplingFields, MODEL),
        "test_compute_logprobs_applies_the_sampling_fields",
        "ignores the batch's sampling",
    ),
    # weight loads that leave the engine with other weights than it reports (issue #40)
    Mutant(
        "sync-skips-one-tensor",
        lambda: pair_suite(engine_cls=SkipsOneTensor),
        VERIFY_LAW,
        "'blocks.0.fc2.weight'",
    ),
    Mutant(
        "sync-loads-one-shard-of-qkv",
        lambda: pair_suite(engine_cls=LoadsOneShard),
        VERIFY_LAW,
        "'blocks.0.qkv.weight'",
    ),
    Mutant(
        "sync-loads-a-stale-copy",
        lambda: pair_suite(engine_cls=LoadsAStaleCopy),
        VERIFY_LAW,
        "'tok_emb.weight'",
    ),
    Mutant(
        "sync-breaks-the-tie",
        lambda: pair_suite(engine_cls=BreaksTheTie, config=TIED),
        VERIFY_LAW,
        "'lm_head.weight' \\(tied to 'tok_emb.weight'\\)",
    ),
    Mutant(
        "sync-fingerprints-what-it-was-sent",
        lambda: pair_suite(engine_cls=FingerprintsWhatItWasSent),
        VERIFY_LAW,
        "hashed from what it was sent",
    ),
    # issue #42: one entry per (mutant, law that must fail it)
    *(
        Mutant(f"versions-{name}", lambda cls=cls: inference_suite(cls), law, message)
        for name, cls in (
            ("at-admission", VersionAtAdmission),
            ("relabelled-at-finish", RelabelsAtFinish),
            ("lazy-label", LazyVersionLabel),
        )
        for law, message in (
            (LABEL_LAW, "(reports its version|not a later one)"),
            (PAUSED_LABEL_LAW, "(every token sampled after the load|keep each token's own)"),
        )
    ),
    *(
        Mutant(f"mask-{name}", lambda cls=cls: train_suite(cls, MODEL), MASK_LAW, message)
        for name, cls, message in (
            ("dropped", DropsLossMask, "Masked tokens must not train"),
            ("weighs-all-tokens", WeighsByAllTokens, "Masked tokens must not train"),
            ("shifted-by-one", MaskShiftedByOne, "Masked tokens must not train"),
        )
    ),
    *(
        Mutant(f"filters-{name}", lambda cls=cls: inference_suite(cls), FILTER_LAW, message)
        for name, cls, message in (
            ("top-p-before-top-k", TopPBeforeTopK, "applies top-p to another distribution"),
            ("top-p-before-temperature", TopPBeforeTemperature, "(another distribution|log-prob)"),
            ("top-p-drops-the-crossing-token", TopPDropsTheCrossingToken, "(crossing|log-prob)"),
            ("ignored", IgnoresTopKTopP, "top-k keeps the 4 most probable"),
            ("logprobs-before-filters", LogprobsBeforeFilters, "renormalised after the filters"),
        )
    ),
    *(
        Mutant(f"load-{name}-{bad}", lambda cls=cls: inference_suite(cls), LOAD_LAW, message, bad)
        for name, cls, message, cases in (
            ("as-it-checks", LoadsAsItChecks, "it loaded the tensors before", BAD_LOADS),
            ("skips-unknown-names", SkipsUnknownNames, "was accepted", ("unknown-name",)),
            ("version-first", VersionBeforeChecks, "left weight_version at", BAD_LOADS),
        )
        for bad in cases
    ),
    *(
        Mutant(f"stop-{name}", lambda cls=cls: inference_suite(cls), STOP_LAW, message)
        for name, cls, message in (
            ("token-left-out", StopTokenLeftOut, "it must end at the stop token"),
            ("first-id-only", FirstStopIdOnly, "(it must end at the stop token|stop_token_ids)"),
            ("reported-as-length", StopReportedAsLength, "finish_reason 'length' with"),
        )
    ),
    Mutant(
        "close-keeps-the-worker",
        lambda: inference_suite(CloseKeepsTheWorker),
        CLOSE_LAW,
        "threads the engine started were still alive",
    ),
    Mutant(
        "close-keeps-the-driver",
        lambda: inference_suite(CloseKeepsTheDriver),
        CLOSE_LAW,
        "asyncio tasks the engine started still run",
    ),
    Mutant(
        "trainer-close-keeps-the-worker",
        lambda: train_suite(TrainerCloseKeepsTheWorker, MODEL),
        CLOSE_LAW,
        "threads the engine started were still alive",
    ),
    *(
        Mutant(f"gap-{name}", lambda cls=cls: inference_suite(cls), law, message)
        for name, cls, law, message in (
            (
                "greedy-sampled-in-a-mixed-batch",
                GreedySampledInAMixedBatch,
                GREEDY_LAW,
                "greedy decoding takes the most probable token",
            ),
            (
                "unseeded-get-seed-zero",
                UnseededGetSeedZero,
                UNSEEDED_LAW,
                "unseeded requests must draw from the engine's generator",
            ),
            (
                "generator-reset-every-step",
                GeneratorResetEveryStep,
                UNSEEDED_LAW,
                "one after the other, all returned token",
            ),
            ("tensor-logprobs", TensorLogprobs, PLAIN_LAW, r"logprobs\[0\] is a torch\.Tensor"),
            ("numpy-versions", NumpyVersions, PLAIN_LAW, r"versions\[0\] is a numpy\.int64"),
            (
                "vague-rejections",
                VagueRejections,
                NAMES_LAW,
                r"\[negative-max-tokens\] max_tokens, its value -1 not in",
            ),
            (
                "sleeps-though-declared-unavailable",
                SleepsThoughDeclaredUnavailable,
                UNAVAILABLE_LAW,
                r"sleep\(\), though SupportsSleep is declared unavailable was accepted",
            ),
            (
                "refuses-top-p-without-saying",
                RefusesTopPWithoutSaying,
                REFUSAL_LAW,
                r"names none of \['temperature', 'top_k', 'top_p'\]: unsupported sampling",
            ),
            (
                "wake-up-rebuilds-the-model",
                WakeUpRebuildsTheModel,
                SLEEP_LAW,
                "holds other weights than before",
            ),
            (
                "wait-returns-one-early",
                WaitReturnsOneEarly,
                WAIT_LAW,
                r"returned 0, yet the request went on",
            ),
            (
                "wait-reports-the-prefix-count",
                WaitReportsThePrefixCount,
                WAIT_LAW,
                r"after an earlier wait reported",
            ),
        )
    ),
    *(
        Mutant(f"gap-{name}", lambda cls=cls: train_suite(cls, MODEL), law, message)
        for name, cls, law, message in (
            (
                "weighs-micro-batches-by-rows",
                WeighsMicroBatchesByRows,
                SPLIT_LAW,
                "must not depend on how the rows fall into micro-batches",
            ),
            (
                "step-per-micro-batch",
                StepPerMicroBatch,
                SPLIT_LAW,
                "must not depend on how the rows fall into micro-batches",
            ),
            (
                "reports-a-row-weighted-loss",
                WeighsMicroBatchesByRows,
                WHOLE_LOSS_LAW,
                "Report the whole batch's loss",
            ),
            (
                "drops-one-row-micro-batches",
                DropsOneRowMicroBatches,
                ONE_ROW_LAW,
                r"a batch of 1 row\(s\) changed no exported weight",
            ),
            (
                "unchecked-token-ids",
                UncheckedTokenIds,
                BAD_ROW_LAW,
                "raised IndexError: .* must raise an asyncflow_core",
            ),
            ("live-export", LiveExport, MIXED_EXPORT_LAW, "the sync mixes two versions"),
            (
                "live-flagged-snapshot",
                LiveFlaggedSnapshot,
                MIXED_EXPORT_LAW,
                "(the sync mixes two versions|snapshot=True)",
            ),
            (
                "holds-the-step-but-flags-live-buckets",
                HoldsTheStepButFlagsLiveBuckets,
                MIXED_EXPORT_LAW,
                r"buckets flagged snapshot=True changed after they were yielded",
            ),
            (
                "computes-on-the-loop",
                ComputesOnTheLoop,
                EVENT_LOOP_LAW,
                r"\['train_step\(\)', 'compute_logprobs\(\)', .*no other task ran",
            ),
            (
                "two-worker-threads",
                TwoWorkerThreads,
                ARRIVAL_ORDER_LAW,
                "Run calls one at a time in arrival order",
            ),
            (
                "floor-is-the-unfiltered-logprob",
                FloorIsTheUnfilteredLogprob,
                OFF_SUPPORT_LAW,
                r"the floor\s+log p - log\(Z \+ p\) off it",
            ),
            (
                "uncounted-off-support",
                UncountedOffSupport,
                OFF_SUPPORT_LAW,
                "reported logprobs_off_support=0",
            ),
            (
                "copies-until-a-misfit",
                CopiesUntilAMisfit,
                MISFIT_LAW,
                "rejected a checkpoint of another model, yet .* exported tensor",
            ),
            (
                "keeps-the-last-rows",
                KeepsTheLastRows,
                BATCH_REFERENCE_LAW,
                r"compute_logprobs\(\) returned but .* the batch's tensor\(s\)",
            ),
        )
    ),
    *(
        Mutant(f"gap-{name}", lambda cls=cls: sync_suite(cls), law, message)
        for name, cls, law, message in (
            (
                "sync-forgets-what-was-sent",
                ForgetsWhatWasSent,
                DUPLICATE_LAW,
                "sent already was accepted",
            ),
            (
                "sync-checks-only-earlier-buckets",
                ChecksOnlyEarlierBuckets,
                DUPLICATE_LAW,
                "twice was accepted",
            ),
            (
                "sync-stages-live-tensors",
                StagesLiveTensors,
                LIVE_BUCKET_LAW,
                "the bucket's tensors changed after update",
            ),
        )
    ),
    Mutant(
        "gap-default-temperature-ignored",
        lambda: train_suite(DefaultTemperatureIgnored, MODEL, default_temperature=0.7),
        DEFAULT_SAMPLING_LAW,
        "is scored at the trainer's default temperature",
    ),
    Mutant(
        "loss-path-ignores-sampling",
        lambda: pair_suite(trainer_cls=LossPathIgnoresSampling),
        "test_the_loss_sees_the_engines_logprobs",
        "the training path must compute the same",
    ),
)


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.id for m in MUTANTS])
def test_the_suite_fails_the_mutant_on_its_law(mutant: Mutant) -> None:
    suite = mutant.make_suite()
    law = getattr(suite, mutant.law)
    with pytest.raises(AssertionError) as failure:
        law() if mutant.arg is None else law(mutant.arg)
    message = str(failure.value)
    assert re.search(mutant.message, message), message
    if mutant.margin:
        found = re.search(r"mean \|difference\| ([0-9.e+-]+|inf)", message)
        assert found, message
        miss = float(found.group(1))
        assert miss >= 10 * suite.logprob_atol, (
            f"{mutant.id} misses the tolerance {suite.logprob_atol} by only "
            f"{miss / suite.logprob_atol:.1f}x: {message}"
        )


def test_every_mutant_class_of_the_issue_is_covered() -> None:
    """The classes the conformance issue names: (a)-(f), a stale prefix/KV cache (g) and a
    resume whose log-probs jump (h)."""
    covered = {m.id.split("-")[0] for m in MUTANTS if len(m.id.split("-")[0]) == 1}
    assert covered >= set("abcdefgh"), sorted(covered)
    assert len(MUTANTS) >= 12


def test_every_bug_class_of_issue_42_fails_on_two_mutants() -> None:
    """Issue #42's classes (version labels, the loss mask, filters that bite, rejected loads,
    stop tokens, close()): each has laws that fail on at least two different mutants."""
    engines: dict[str, set[str]] = {}
    for m in MUTANTS:
        kind = m.id.split("-")[0]
        if kind in ("versions", "mask", "filters", "load", "stop", "close", "trainer"):
            kind = "close" if kind == "trainer" else kind
            engines.setdefault(kind, set()).add(m.id.split("-", 1)[1].rsplit("-name", 1)[0])
    short = {k: sorted(v) for k, v in engines.items() if len(v) < 2}
    assert len(engines) == 6 and not short, (sorted(engines), short)


class InvalidatedPrefixCache(StalePrefixCache):
    """The prefix cache done right: ``load_weights`` drops it."""

    def _apply_weights(self, staged: Any, version: int) -> None:
        super()._apply_weights(staged, version)
        self._prefix.clear()


def test_the_prefix_cache_mutant_is_only_wrong_about_invalidation() -> None:
    """Control: the same cache, dropped at every load, passes the law that fails the mutant
    (so the law catches the stale cache, not a broken cache)."""
    suite = pair_suite(engine_cls=InvalidatedPrefixCache)
    suite.test_logprobs_agree_after_a_sync(("t1", SETTING["t1"]))


def main() -> None:
    """``python tests/test_mutants.py``: each mutant, the law that fails it, and for the
    log-prob mutants the pair law's mean difference against its tolerance."""
    print(f"{'mutant':34} {'law':48} {'verdict':8} miss")
    caught = 0
    for mutant in MUTANTS:
        suite = mutant.make_suite()
        law = getattr(suite, mutant.law)
        try:
            law() if mutant.arg is None else law(mutant.arg)
            verdict, miss = "PASSED", ""
        except AssertionError as exc:
            caught += bool(re.search(mutant.message, str(exc)))
            verdict = "failed"
            found = re.search(r"mean \|difference\| ([0-9.e+-]+)", str(exc))
            atol = getattr(suite, "logprob_atol", None)
            miss = f"{float(found.group(1)) / atol:,.0f}x the tolerance" if found and atol else ""
        print(f"{mutant.id:34} {mutant.law:48} {verdict:8} {miss}")
    print(f"caught {caught} of {len(MUTANTS)} mutants, each on its law")


if __name__ == "__main__":
    main()
