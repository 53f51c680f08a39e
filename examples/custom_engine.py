"""Write an engine adapter from scratch, then train it with AsyncFlow's RL job.

The "model" is a bigram table: ``logits(prev) = table[prev]``. It is small enough to
read in one sitting, yet the adapter does everything a real one must (docs/writing-an-adapter.md):

* ``BigramInferenceEngine``: ``InferenceEngine`` + ``SupportsPause`` + ``SupportsLoadWeights``:
  seeded sampling, per-token log-probs and weight versions, stop tokens, ``max_tokens``,
  ``abort`` returning the partial result, resume from an aborted prefix, ``EngineError`` for
  bad requests. Compute runs in the engine's own worker thread, never on the event loop.
* ``BigramTrainEngine``: ``TrainEngine``: ``compute_logprobs``, ``train_step`` with any
  ``LossFn`` over micro-batches, ``export_weights`` in buckets (``state_dict`` names, which is
  what ``load_weights`` expects), safetensors checkpoints.

``main()`` trains them with ``RLJob`` (async GRPO, η = 1, staged sync, partial rollout) on a
verifiable task: the reward is 1 when the first response token is ``target(prompt)``.
Both engines pass the conformance suites: ``pytest -p asyncflow_conformance examples/adapter``.

    python examples/custom_engine.py
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

import numpy as np
import safetensors
import safetensors.torch
import torch

from asyncflow_core import (
    Batch,
    EngineError,
    GenerationRequest,
    GenerationResult,
    InProcessWeightSync,
    SamplingParams,
    TrainMetrics,
    Version,
    WeightBucket,
    bucketize,
)
from asyncflow_core.contracts.protocols import FinishReason, LossFn
from asyncflow_core.engines.lmtrain import check_loss
from asyncflow_core.flow.rlflow import RLConfig, RLEngines, RLJob, StepRecord
from asyncflow_core.training.rl import response_mask
from asyncflow_core.training.sampling import (
    OFF_SUPPORT_METRIC,
    filter_logits,
    row_sampling,
    sampled_logprobs,
)

VOCAB = 16
STOP = 0  # the task's end-of-sequence token
_T = TypeVar("_T")


class BigramLM(torch.nn.Module):
    """The policy: ``logits(prev) = table[prev]``. Both engines hold one, and weights travel
    under its ``state_dict`` names (here the single name ``"table"``)."""

    def __init__(self, vocab_size: int = VOCAB, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)  # same seed -> same initial weights
        self.table = torch.nn.Parameter(0.1 * torch.randn(vocab_size, vocab_size, generator=g))

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        return self.table[prev]  # [...] -> [..., vocab]


class _Worker:
    """One thread per engine: compute never blocks the event loop, and since calls run one at
    a time, a weight load always lands between two tokens (versions stay ordered)."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False)


class BigramInferenceEngine:
    """Generates token by token, each token in the worker thread. ``seed`` sets the initial
    weights (as ``BigramTrainEngine(seed=...)``) and the generator of unseeded requests.

    Log-probs are those of the distribution each token is drawn from: ``logits / T``, then
    top-k, then top-p, renormalised (``asyncflow_core.training.sampling.filter_logits``; greedy: the
    unscaled, unfiltered log-prob), which is what ``BigramTrainEngine.compute_logprobs``
    computes from the rows' sampling fields. A seeded request draws token i from
    ``rng(seed, i)``: the same whatever runs beside it, and a resumed request continues
    exactly as an uninterrupted one would under the same weights."""

    def __init__(self, vocab_size: int = VOCAB, *, seed: int = 0, name: str = "bigram") -> None:
        self.name, self.vocab_size = name, vocab_size
        self.model = BigramLM(vocab_size, seed).requires_grad_(False)
        self._version: Version = 0
        self._rng = np.random.default_rng(seed)  # touched only in the worker thread
        self._live: dict[str, bool] = {}  # request id in flight -> aborted?
        self._paused = False
        self._closed = False
        self._changed: asyncio.Condition | None = None  # created on the engine's loop
        self._waiting: dict[str, list[tuple[int, asyncio.Future[int]]]] = {}
        self._counts: dict[str, int] = {}  # request id in flight -> tokens it has
        self._worker = _Worker(name)

    @property
    def weight_version(self) -> Version:
        return self._version

    # -- InferenceEngine -----------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self._validate(request)
        rid = request.request_id
        self._live[rid] = False  # in flight from here on, before the first await
        self._counts[rid] = len(request.resume_tokens)
        tokens = list(request.resume_tokens)  # a resumed prefix comes back unchanged
        lps = list(request.resume_logprobs)
        versions = list(request.resume_versions)

        def result(reason: FinishReason) -> GenerationResult:
            return GenerationResult(rid, request.prompt_tokens, tuple(tokens), tuple(lps),
                                    tuple(versions), reason)  # fmt: skip

        try:
            stops = set(request.params.stop_token_ids)
            while not (tokens and tokens[-1] in stops):
                if len(tokens) >= request.params.max_tokens:
                    return result("length")
                await self._wait_runnable(rid)
                if self._live[rid]:
                    return result("abort")
                prev = tokens[-1] if tokens else request.prompt_tokens[-1]
                token, lp, version = await self._worker.run(
                    self._sample, prev, request.params, len(tokens)
                )
                tokens.append(token)
                lps.append(lp)
                versions.append(version)
                self._reached(rid, len(tokens))
            return result("stop")
        finally:
            del self._live[rid]
            self._reached(rid, len(tokens), ended=True)

    async def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:  # unknown or finished ids: nothing to do, no tombstone
            if rid in self._live:
                self._live[rid] = True
        await self._notify()

    # -- SupportsProgress ----------------------------------------------------------------------
    async def wait_for_tokens(self, request_id: str, count: int) -> int:
        """Once request ``request_id`` has ``count`` tokens (resumed ones included) or has
        ended: how many it has then. The laws that act on requests in flight (abort, pause, a
        load) use it as evidence instead of guessing from the clock."""
        if request_id not in self._live:
            raise EngineError(f"{self.name}: request {request_id!r} is not in flight")
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(request_id, []).append((count, future))
        self._reached(request_id, self._counts.get(request_id, 0))
        return await future

    def _reached(self, rid: str, have: int, *, ended: bool = False) -> None:
        self._counts[rid] = have
        keep = []
        for count, future in self._waiting.pop(rid, []):
            if (ended or have >= count) and not future.done():
                future.set_result(have)
            elif not future.done():
                keep.append((count, future))
        if keep and not ended:
            self._waiting[rid] = keep
        if ended:
            del self._counts[rid]

    # -- SupportsPause -------------------------------------------------------------------------
    async def pause(self, mode: Literal["abort", "keep"] = "abort") -> None:
        if mode not in ("abort", "keep"):
            raise EngineError(f"{self.name}: pause mode must be 'abort' or 'keep', got {mode!r}")
        self._paused = True
        if mode == "abort":
            await self.abort(list(self._live))
        await self._worker.run(lambda: None)  # the token being computed has been delivered

    async def resume(self) -> None:
        self._paused = False
        await self._notify()

    # -- SupportsLoadWeights -------------------------------------------------------------------
    async def load_weights(
        self, weights: Sequence[tuple[str, torch.Tensor]], version: Version
    ) -> None:
        params = dict(self.model.named_parameters())
        for name, tensor in weights:  # check everything before changing anything
            if name not in params or tensor.shape != params[name].shape:
                shapes = {n: tuple(p.shape) for n, p in params.items()}
                raise EngineError(
                    f"{self.name}: cannot load {name!r} of shape {tuple(tensor.shape)}; the "
                    f"parameters are {shapes}; nothing was loaded"
                )
        await self._worker.run(self._apply, [(params[n], t) for n, t in weights], version)

    async def close(self) -> None:
        await self.abort(list(self._live))
        self._closed = True
        self._worker.close()

    # -- internals -----------------------------------------------------------------------------
    def _validate(self, request: GenerationRequest) -> None:
        rid, p, k = request.request_id, request.params, len(request.resume_tokens)
        problem = None
        if self._closed:
            problem = "the engine is closed"
        elif rid in self._live:
            problem = "is already in flight; wait for it or abort it before reusing the id"
        elif p.max_tokens < 0 or p.temperature < 0:
            problem = f"max_tokens={p.max_tokens}, temperature={p.temperature}; use >= 0"
        elif p.top_k < 0 or not 0 < p.top_p <= 1:
            problem = f"top_k={p.top_k}, top_p={p.top_p}; use top_k >= 0, 0 < top_p <= 1"
        elif p.seed is not None and p.seed < 0:
            problem = f"seed={p.seed}; use None or an int >= 0"
        elif len(request.resume_logprobs) != k or len(request.resume_versions) != k:
            problem = f"resumes {k} tokens; pass one resume log-prob and version per token"
        elif k > p.max_tokens:
            problem = f"resumes {k} tokens but max_tokens={p.max_tokens} caps the whole response"
        elif not request.prompt_tokens:
            problem = "prompt_tokens is empty; the first token is predicted from the last one"
        else:
            ids = (*request.prompt_tokens, *request.resume_tokens, *p.stop_token_ids)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                problem = f"token ids {bad[:4]} are outside the vocabulary [0, {self.vocab_size})"
        if problem is not None:
            raise EngineError(f"{self.name}: request {rid!r}: {problem}")

    async def _wait_runnable(self, rid: str) -> None:
        """Return when ``rid`` may make its next token (not paused) or was aborted."""
        if self._live[rid] or not self._paused:
            return
        if self._changed is None:
            self._changed = asyncio.Condition()
        async with self._changed:
            await self._changed.wait_for(lambda: self._live[rid] or not self._paused)

    async def _notify(self) -> None:
        if self._changed is not None:
            async with self._changed:
                self._changed.notify_all()

    def _sample(self, prev: int, params: SamplingParams, i: int) -> tuple[int, float, Version]:
        """Worker thread: one token, its log-prob under the distribution it is drawn from
        (temperature, top-k, top-p, renormalised: ``filter_logits``), and the version of the
        weights used."""
        knobs = (torch.tensor(x) for x in (params.temperature, params.top_k, params.top_p))
        logits = filter_logits(self.model(torch.tensor(prev)), *knobs)  # -inf off the support
        logp = torch.log_softmax(logits, -1).double()
        if params.temperature == 0:
            token = int(logp.argmax())
        else:
            rng = self._rng if params.seed is None else np.random.default_rng([params.seed, i])
            cdf = np.cumsum(logp.exp().numpy())  # inverse-CDF draw of one uniform number
            token = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], "right")), len(cdf) - 1)
        return token, float(logp[token]), self._version

    def _apply(self, staged: list[tuple[torch.Tensor, torch.Tensor]], version: Version) -> None:
        with torch.no_grad():
            for param, tensor in staged:
                param.copy_(tensor)
        self._version = version


class BigramTrainEngine:
    """Trains ``BigramLM`` with plain SGD (stateless: a checkpoint of the weights and the
    version restores training exactly; with Adam you would save its state too). Batches are in
    the store's "padded" layout, which ``RLJob``'s update task uses: ``prompt`` and
    ``response`` ``[B, max_len]`` token ids with ``batch.lengths``."""

    def __init__(
        self, vocab_size: int = VOCAB, *, seed: int = 0, lr: float = 50.0,
        micro_batch_size: int = 32, temperature: float = 1.0, name: str = "bigram-trainer",
    ) -> None:  # fmt: skip
        self.name, self.micro_batch_size, self.temperature = name, micro_batch_size, temperature
        self._off_support = 0  # off-support tokens of the current step (worker thread)
        self.model = BigramLM(vocab_size, seed)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        self._version: Version = 0
        self._worker = _Worker(name)

    @property
    def weight_version(self) -> Version:
        return self._version

    async def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        return await self._worker.run(self._logprobs_no_grad, batch)

    async def train_step(self, batch: Batch, loss_fn: LossFn) -> TrainMetrics:
        return await self._worker.run(self._train_step, batch, loss_fn)

    async def export_weights(self, bucket_bytes: int) -> AsyncIterator[WeightBucket]:
        if bucket_bytes <= 0:
            raise EngineError(f"{self.name}: bucket_bytes must be > 0, got {bucket_bytes}")
        snapshot = await self._worker.run(
            lambda: [(n, t.detach().clone()) for n, t in self.model.state_dict().items()]
        )  # cloned between two steps: a bucket never mixes two versions
        for bucket in bucketize(snapshot, bucket_bytes):
            yield bucket

    async def save_checkpoint(self, path: str) -> None:
        await self._worker.run(self._save, path)

    async def load_checkpoint(self, path: str) -> None:
        await self._worker.run(self._load, path)

    async def close(self) -> None:
        self._worker.close()

    # -- internals (worker thread) -------------------------------------------------------------
    def _logprobs(self, batch: Batch) -> torch.Tensor:
        """``[B, R]``: log-prob of ``response[i, j]`` given the token before it, under row
        ``i``'s sampling distribution (its ``temperature``/``top_k``/``top_p`` fields, the
        engine's semantics); 0 past the row's length."""
        for name in ("prompt", "response"):
            if not isinstance(batch.data.get(name), torch.Tensor) or name not in batch.lengths:
                raise EngineError(
                    f"{self.name}: the batch needs a padded {name!r} tensor with "
                    f"lengths[{name!r}]; it has fields {sorted(batch.data)}"
                )
        prompt, response = batch["prompt"], batch["response"]
        plen, rlen = batch.lengths["prompt"], batch.lengths["response"]
        rows = len(batch.rows) or (int(prompt.shape[0]) if prompt.dim() else -1)
        fields = (("prompt", prompt), ("response", response), ("prompt lengths", plen),
                  ("response lengths", rlen))  # fmt: skip
        shapes = [(n, t.dim(), int(t.shape[0]) if t.dim() else -1) for n, t in fields]
        if any(
            dims != (2 if "lengths" not in n else 1) or size != rows for n, dims, size in shapes
        ):
            raise EngineError(
                f"{self.name}: the batch has {rows} rows; prompt and response must be [rows, "
                f"width] with [rows] lengths, got {[(n, s) for n, _, s in shapes]}"
            )
        if bool((plen < 1).any()):
            raise EngineError(f"{self.name}: every prompt needs at least one token")
        for name, ids, n in (("prompt", prompt, plen), ("response", response, rlen)):
            real = torch.arange(ids.shape[1]).unsqueeze(0) < n.unsqueeze(1)
            bad = real & ((ids < 0) | (ids >= VOCAB))
            if bool(bad.any()):
                row, col = (int(x) for x in bad.nonzero()[0])
                raise EngineError(
                    f"{self.name}: {name}[{row}, {col}] = {int(ids[row, col])} is not a token "
                    f"id of this model; use ints in [0, {VOCAB})"
                )
        last = prompt.gather(1, (plen - 1).unsqueeze(1))
        prev = torch.cat([last, response[:, :-1]], dim=1)[:, : response.shape[1]]
        knobs = row_sampling(batch, len(batch), who=self.name, temperature=self.temperature)
        picked, off = sampled_logprobs(self.model(prev), response, *(k.unsqueeze(1) for k in knobs))
        inside = torch.arange(response.shape[1]).unsqueeze(0) < rlen.unsqueeze(1)
        self._off_support += int((off & inside).sum())  # tokens outside the support (floored)
        return torch.where(inside, picked, torch.zeros_like(picked))

    def _logprobs_no_grad(self, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            return self._logprobs(batch)

    def _train_step(self, batch: Batch, loss_fn: LossFn) -> TrainMetrics:
        whole = self._logprobs_no_grad(batch)  # validate the whole batch before any change
        b, rlen = len(batch), batch.lengths["response"]
        # token-weighted accumulation over the tokens that train (a loss_mask's 1s, else every
        # response token), so the step is the same however the rows split into micro-batches
        total = max(int(response_mask(whole, batch).sum()), 1)
        self._off_support = 0  # counted over the step's micro-batches
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for start in range(0, b, self.micro_batch_size):
            part = batch.slice(start, min(start + self.micro_batch_size, b))
            logprobs = self._logprobs(part)
            loss, _ = check_loss(self.name, loss_fn(logprobs, part))
            weight = int(response_mask(logprobs, part).sum()) / total
            (loss * weight).backward()  # type: ignore[no-untyped-call]
            loss_sum += weight * float(loss.detach())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0))
        self.optimizer.step()
        self._version += 1
        tokens = int(batch.lengths["prompt"].sum()) + int(rlen.sum())
        extra = {OFF_SUPPORT_METRIC: float(self._off_support)}
        return TrainMetrics(self._version, loss_sum, grad_norm, b, tokens, extra)

    def _save(self, path: str) -> None:
        state = {n: t.detach().contiguous() for n, t in self.model.state_dict().items()}
        safetensors.torch.save_file(state, f"{path}.tmp", metadata={"version": str(self._version)})
        os.replace(f"{path}.tmp", path)  # a crash mid-save never leaves a torn checkpoint

    def _load(self, path: str) -> None:
        try:
            with safetensors.safe_open(path, framework="pt") as f:
                version = int((f.metadata() or {})["version"])
                state = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        except (OSError, KeyError, ValueError, safetensors.SafetensorError) as exc:
            raise EngineError(
                f"{self.name}: cannot read checkpoint {path!r} ({exc}); pass a file written by "
                "save_checkpoint"
            ) from exc
        own = {n: t.shape for n, t in self.model.state_dict().items()}
        if {n: t.shape for n, t in state.items()} != own:  # check before changing anything
            raise EngineError(f"{self.name}: checkpoint {path!r} does not hold {own}")
        self.model.load_state_dict(state, strict=True)
        self._version = version


# --------------------------------------------------------------------------------------------
# Plug the engines into an RL job
# --------------------------------------------------------------------------------------------
PROMPTS = range(1, VOCAB // 2)  # questions are tokens 1..7, answers tokens 8..15


def target(prompt_token: int) -> int:
    """The answer to prompt ``t`` (a rule the policy has to discover from rewards alone)."""
    return VOCAB // 2 + (5 * prompt_token) % (VOCAB // 2)


def reward(prompt: Sequence[int], response: Sequence[int]) -> float:
    return float(len(response) > 0 and response[0] == target(prompt[-1]))


def show(step: StepRecord) -> None:
    bar = "#" * round(40 * step.reward_mean)
    print(f"step {step.version:2d}  reward {step.reward_mean:.2f}  {bar}", flush=True)


async def train(seed: int = 0, steps: int = 12) -> list[StepRecord]:
    rollout = [BigramInferenceEngine(seed=seed, name=f"bigram-{i}") for i in range(2)]
    trainer = BigramTrainEngine(seed=seed)  # same seed: both sides start from version 0's weights
    config = RLConfig(
        steps=steps, prompts_per_step=8, n=8, staleness=1, weight_sync="staged",
        partial_rollout=True,  # at a swap, generations are aborted and resumed from their prefix
        sampling=SamplingParams(max_tokens=4, stop_token_ids=(STOP,), seed=seed),
    )  # fmt: skip
    prompts = ((PROMPTS[i % len(PROMPTS)],) for i in itertools.count())
    result = await RLJob(config, RLEngines(rollout, trainer), prompts, reward, on_step=show).run()

    # the job does not sync after its last step: do it by hand with the WeightSync protocol
    # (init, start, update per bucket, finish(version)), then answer greedily
    sync = InProcessWeightSync(rollout)
    await sync.init()
    await sync.start()
    async for bucket in trainer.export_weights(bucket_bytes=1 << 20):
        await sync.update(bucket)
    await sync.finish(trainer.weight_version)
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    answers = [await rollout[0].generate(GenerationRequest(f"q{t}", (t,), greedy)) for t in PROMPTS]
    right = sum(r.tokens[0] == target(r.prompt_tokens[0]) for r in answers)
    print(f"greedy answers at version {rollout[0].weight_version}: {right}/{len(answers)} right")
    await asyncio.gather(*(engine.close() for engine in rollout), trainer.close())
    return list(result.steps)


def main() -> None:
    t0 = time.perf_counter()
    steps = asyncio.run(train())
    first, last = steps[0].reward_mean, sum(s.reward_mean for s in steps[-3:]) / 3
    print(
        f"mean reward {first:.2f} -> {last:.2f} (last 3 steps) in {time.perf_counter() - t0:.1f} s"
    )
    assert last >= 0.6 and last > first + 0.4, "the policy did not learn the task"


if __name__ == "__main__":
    main()
