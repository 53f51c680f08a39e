"""Pure-PyTorch reference engines (CPU-friendly) for ``TransformerLM``: a continuous-batching
inference engine with a KV cache and a trainer with micro-batching, AdamW and checkpoints.

``TorchInferenceEngine`` implements ``InferenceEngine``, ``SupportsPause``, ``SupportsSleep``
and ``SupportsLoadWeights``; ``TorchTrainEngine`` implements ``TrainEngine``. Weights travel
under the model's ``state_dict`` names, so ``TorchTrainEngine.export_weights`` buckets feed
``TorchInferenceEngine.load_weights`` directly.

Log-probs (both engines agree to ~1e-6 in fp32 for the same weights, tokens and settings):
the protocol's semantics (``asyncflow_core.training.sampling``): ``logprobs[i]`` is the log-prob of
``tokens[i]`` under the distribution it was sampled from — the model's next-token logits
given the prompt and ``tokens[:i]``, divided by the request's temperature (1 when greedy),
cut by top-k and then top-p, renormalised. ``TorchTrainEngine.compute_logprobs`` computes
the same quantity from each row's ``temperature``/``top_k``/``top_p`` fields (which
``RLJob`` writes next to the tokens; its constructor's ``temperature`` is only the default
for a batch without them).

Threads: each engine computes in its own worker thread. ``threads=None`` (the default) lets
that thread use torch's process setting (``torch.set_num_threads``, as set when the engine
is built); an int applies to the worker thread only. Measured on the 2-core dev box with
the config below: generation is fastest on 1 thread (75k vs 64k tokens/s idle: its ops take
microseconds, so OpenMP teams cost more than they save); a train step alone gains from 2
(36-43 ms vs 54 ms idle); with other load on the cores, 2 threads per engine degraded badly
(a 256-row train step took 1.4 s instead of 66 ms, AdamW's step 419 ms instead of 1 ms), and
rollout + training running concurrently gave 25-29k tokens/s with 1 thread each vs 17-22k
with 2. Pass ``threads=1`` when the cores are shared.

Timing (torch 2.13 CPU, 2 cores, idle), measured with ``python -c "from
asyncflow_reference.engines import main; main()"`` (``--help`` for options; it passes
``threads=1``): ``ModelConfig(vocab_size=32, d_model=64, n_layers=2, n_heads=4,
max_seq_len=32)``, 256 requests of a 4-token prompt and 12 new tokens at temperature 1,
``max_batch=256``, best of 3: generation 70k-76k tokens/s (5.9k-6.3k sequences/s; a decode
step for 256 sequences ~2.5 ms); one ``train_step`` over those 256 rows of 16 tokens (one
micro-batch, ``policy_gradient_loss``) 53-57 ms. With other jobs loading the cores (load
average ~4) the same command gave 43k-68k tokens/s and 60-90 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor

from asyncflow_core.contracts.errors import AsyncFlowError, ConfigError, EngineError
from asyncflow_core.contracts.protocols import (
    Batch,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    Version,
)
from asyncflow_core.engines.enginekit import check_request
from asyncflow_core.engines.lmtrain import (
    CHECKPOINT_META,
    CHECKPOINT_OPTIMIZER,
    CHECKPOINT_WEIGHTS,
    AdamWTrainer,
    TokenRows,
    worker_thread,
)
from asyncflow_core.engines.lmtrain import check_seed as _check_seed
from asyncflow_core.engines.lmtrain import is_int as _is_int
from asyncflow_core.sync.verify import TensorFingerprint, module_fingerprints, tied_aliases
from asyncflow_core.training.sampling import filter_logits
from asyncflow_reference.model import KVCache, ModelConfig, TransformerLM

_T = TypeVar("_T")


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------
def _take_model(model_or_config: TransformerLM | ModelConfig, seed: int, who: str) -> TransformerLM:
    """A private CPU fp32 copy of the model, or a fresh one initialised from ``seed``."""
    if isinstance(model_or_config, ModelConfig):
        return TransformerLM(model_or_config, seed=seed)
    if isinstance(model_or_config, TransformerLM):
        return copy.deepcopy(model_or_config).to(device="cpu", dtype=torch.float32)
    raise ConfigError(
        f"{who} takes a ModelConfig or a TransformerLM, got {type(model_or_config).__name__}"
    )


# --------------------------------------------------------------------------------------------
# Inference engine
# --------------------------------------------------------------------------------------------
@dataclass(eq=False, slots=True)
class _Pending:
    """One ``generate`` call, on the event loop's side."""

    request: GenerationRequest
    future: asyncio.Future[GenerationResult]
    state: Literal["waiting", "running", "done"] = "waiting"
    dropped: bool = False
    watchers: list[tuple[int, asyncio.Future[int]]] = field(default_factory=list)


@dataclass(slots=True)
class _Job:
    """What the driver hands the worker thread: retire ``aborts``, admit ``admit``, then run
    steps until something finishes, a watched request reaches its count, or an interrupt."""

    admit: list[_Pending]
    aborts: list[_Pending]
    watch: list[tuple[_Pending, int]]


@dataclass(slots=True)
class _JobOut:
    results: list[tuple[_Pending, GenerationResult]] = field(default_factory=list)
    progress: list[tuple[_Pending, int]] = field(default_factory=list)


def _noop() -> None:
    return None


class TorchInferenceEngine:
    """Continuous-batching generation with a slot-based KV cache, on the CPU in fp32.

    ``TorchInferenceEngine(model_or_config, *, max_batch=64, seed=0, name=...,
    threads=None)``: a ``ModelConfig`` builds a ``TransformerLM`` initialised from ``seed``; a
    ``TransformerLM`` is deep-copied to CPU fp32 (never shared with the caller).
    ``seed`` also seeds the engine's generator, used by requests without
    ``SamplingParams.seed`` (so two engines built from one config with different seeds hold
    different weights: pass a model to vary only the sampling). ``threads``: torch intra-op
    threads of the engine's worker thread only (``None``: torch's setting); see the module
    docstring for when to pass 1.

    **Batching.** Up to ``max_batch`` sequences run at once, each in a cache slot (running
    sequences always occupy slots ``0 .. n-1``: a finished sequence's slot is filled by the
    last one). Requests queue FIFO and join between steps: each admitted group is prefilled in
    one forward (prompt + resumed tokens, right-padded), then every running sequence advances
    by one token per decode step (one forward for all of them). Finished sequences leave
    between steps. All of it runs in one worker thread (a dedicated single-thread executor)
    driven by one asyncio task per engine, so the event loop stays responsive.

    **Sampling** (per ``SamplingParams``): temperature, then top-k (``0`` = off) and top-p
    (``1`` = off) filters (``asyncflow_core.training.sampling.filter_logits``), then one uniform
    draw inverted through the filtered distribution; ``temperature == 0`` is greedy (argmax). A
    request with ``seed`` draws from its own ``torch.Generator`` seeded with it, so same seed + same
    prompt + same weights gives the same tokens whatever else is batched alongside (a resumed
    request re-seeds: its continuation is deterministic but differs from an uninterrupted run);
    requests without a seed draw from the engine's generator. Log-probs: see the module docstring
    (those of the filtered, renormalised distribution; temperature 1 for greedy).

    **Ending.** A token in ``stop_token_ids`` ends the request with ``"stop"`` (the token is
    included). ``max_tokens`` caps the whole response, resumed tokens included (a longer
    prefix is rejected), and ends it with ``"length"``; so does the context window (prompt +
    response reaching ``max_seq_len``). ``abort`` ends requests with ``"abort"`` and what
    they have so far; a resumed request (``resume_tokens/logprobs/versions``) continues after
    its prefix and its result starts with that prefix, original log-probs and versions
    included.

    **Weights and versions.** ``load_weights(weights, version)`` is applied between two
    steps; the KV cache of every running sequence is then recomputed under the new weights
    before its next token, so every token sampled after the load reports ``version`` and its
    log-prob is exactly that of the new weights given the full context. ``weight_version`` is
    the version of the last load (0 initially).

    **Pause and sleep.** ``pause("keep")`` freezes running sequences (KV kept), ``pause(
    "abort")`` aborts every request in flight; either way new requests wait until
    ``resume()``. ``sleep()`` frees the KV cache (on CPU there is no device memory to hand
    back for the weights, which stay) and refuses work until ``wake_up()``: ``generate``
    raises ``EngineError`` (a silent wait would hang a caller that forgot to wake the engine),
    while requests already in flight or queued are frozen; ``wake_up()`` reallocates the
    cache and recomputes it for the frozen sequences, which then continue. ``close()`` aborts
    what is in flight and stops the driver.

    Bad input raises ``EngineError`` naming the field, the value and what to do, and leaves the
    engine unchanged. Counters: ``tokens_generated``, ``decode_steps``, ``prefill_steps``,
    ``requests_finished``, ``requests_aborted``.
    """

    def __init__(
        self,
        model_or_config: TransformerLM | ModelConfig,
        *,
        max_batch: int = 64,
        seed: int = 0,
        name: str = "torch-rollout-0",
        threads: int | None = None,
    ) -> None:
        who = f"TorchInferenceEngine {name!r}"
        if not _is_int(max_batch) or not 1 <= max_batch <= 65_536:
            raise ConfigError(f"{who}: max_batch must be an int in [1, 65536], got {max_batch!r}")
        self.seed = _check_seed(who, seed)
        self.name = name
        self.max_batch = int(max_batch)
        self.model = _take_model(model_or_config, self.seed, who).eval().requires_grad_(False)
        self._aliases = tied_aliases(self.model)  # as built: weight_fingerprints checks them
        self.config: ModelConfig = self.model.config
        self._params = dict(self.model.named_parameters())
        self._gen = torch.Generator().manual_seed(self.seed)
        # ---- worker-thread state (touched only inside executor jobs) ----------------------
        mb, s = self.max_batch, self.config.max_seq_len
        self._cache: KVCache | None = KVCache(self.config, mb)
        self._tok = torch.zeros(mb, s, dtype=torch.long)  # prompt + response per slot
        self._lp = torch.zeros(mb, s)  # log-prob of the token at that position
        self._ver = torch.zeros(mb, s, dtype=torch.long)  # version that sampled it
        self._ctx = torch.zeros(mb, dtype=torch.long)  # tokens in the slot (last is uncached)
        self._plen = torch.zeros(mb, dtype=torch.long)
        self._limit = torch.zeros(mb, dtype=torch.long)  # ctx length that ends with "length"
        self._temp = torch.zeros(mb)
        self._top_p = torch.ones(mb)
        self._top_k = torch.zeros(mb, dtype=torch.long)
        self._stops = torch.full((mb, 1), -1, dtype=torch.long)
        self._refill = torch.zeros(mb, dtype=torch.bool)  # KV must be (re)computed
        self._slots: list[_Pending | None] = [None] * mb
        self._where: dict[str, int] = {}
        self._gens: dict[int, torch.Generator] = {}  # slot -> generator of a seeded request
        self._n = 0
        self._arange = torch.arange(mb)
        self._wversion: Version = 0
        self.tokens_generated = 0
        self.decode_steps = 0
        self.prefill_steps = 0
        self.requests_finished = 0
        self._aborted_in_slots = 0
        # ---- event-loop state ---------------------------------------------------------------
        self._executor = worker_thread(name, threads, who)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._driver: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._waiting: deque[_Pending] = deque()
        self._inflight: dict[str, _Pending] = {}
        self._aborts: list[_Pending] = []
        self._watched: set[_Pending] = set()
        self._active = 0  # admitted and not yet retired
        self._paused = False
        self._asleep = False
        self._closed = False
        self._interrupt = False  # read by the worker: return to the driver after this step
        self._new_watch = False  # a wait_for_tokens the worker has not seen yet
        self._aborted_in_queue = 0

    # ---- properties ------------------------------------------------------------------------
    @property
    def weight_version(self) -> Version:
        return self._wversion

    @property
    def running(self) -> int:
        """Requests admitted to a slot (decoding, or frozen by pause/sleep)."""
        return self._active

    @property
    def queued(self) -> int:
        """Requests waiting for a slot (or for ``resume``/``wake_up``)."""
        return len(self._waiting)

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def asleep(self) -> bool:
        return self._asleep

    @property
    def requests_aborted(self) -> int:
        """Requests ended by ``abort``/``pause("abort")``/``close`` (queued or running)."""
        return self._aborted_in_queue + self._aborted_in_slots

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes held by the KV cache (0 while asleep)."""
        cache = self._cache
        return 0 if cache is None else cache.nbytes

    # ---- protocol --------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await self.submit(request)

    def submit(self, request: GenerationRequest) -> asyncio.Future[GenerationResult]:
        """Register ``request`` now (call from the event loop's thread) and return a future of
        its result; ``generate`` is ``await submit(request)``. Useful when the caller must know
        the request is in flight before it awaits (e.g. to ``wait_for_tokens`` on it).
        Cancelling the future (or a task awaiting ``generate``) drops the request."""
        loop = self._bind()
        if self._asleep:
            raise EngineError(
                f"{self.name}: the engine is asleep (sleep() freed its KV cache) and takes no "
                f"new requests; call wake_up() before generate() (request "
                f"{getattr(request, 'request_id', request)!r:.60})"
            )
        self._check_request(request)
        prompt, resume = request.prompt_tokens, request.resume_tokens
        cap = min(request.params.max_tokens, self.config.max_seq_len - len(prompt))
        if len(resume) >= cap:  # nothing left to generate
            done: asyncio.Future[GenerationResult] = loop.create_future()
            done.set_result(
                GenerationResult(
                    request.request_id,
                    prompt,
                    resume,
                    request.resume_logprobs,
                    request.resume_versions,
                    "length",
                )
            )
            return done
        pending = _Pending(request, loop.create_future())
        pending.future.add_done_callback(lambda f: self._drop(pending) if f.cancelled() else None)
        self._inflight[request.request_id] = pending
        self._waiting.append(pending)
        if self._active < self.max_batch:
            self._interrupt = True  # a slot is free: let the worker return to admit it
        self._kick()
        return pending.future

    async def abort(self, request_ids: Sequence[str]) -> None:
        if isinstance(request_ids, str | bytes) or not isinstance(request_ids, Sequence):
            raise EngineError(
                f"{self.name}: abort takes a sequence of request ids, got {request_ids!r:.80}; "
                "wrap a single id in a list"
            )
        self._bind()
        waits: list[asyncio.Future[GenerationResult]] = []
        for rid in request_ids:
            pending = self._inflight.get(rid)
            if pending is None:
                continue  # unknown or already finished: nothing to do
            if pending.state == "waiting":
                self._waiting.remove(pending)
                req = pending.request
                self._aborted_in_queue += 1
                self._finish(
                    pending,
                    GenerationResult(
                        req.request_id,
                        req.prompt_tokens,
                        req.resume_tokens,
                        req.resume_logprobs,
                        req.resume_versions,
                        "abort",
                    ),
                )
            elif pending.state == "running":
                if pending not in self._aborts:
                    self._aborts.append(pending)
                waits.append(pending.future)
        if waits:
            self._interrupt = True
            self._kick()
            await asyncio.wait(waits)

    async def pause(self, mode: Literal["abort", "keep"] = "abort") -> None:
        if mode not in ("abort", "keep"):
            raise EngineError(f"{self.name}: pause mode must be 'abort' or 'keep', got {mode!r}")
        loop = self._bind()
        self._paused = True
        self._interrupt = True
        if mode == "abort":
            await self.abort(list(self._inflight))
        await loop.run_in_executor(self._executor, _noop)  # the step in progress has ended

    async def resume(self) -> None:
        self._bind()
        self._paused = False
        self._kick()

    async def sleep(self, level: int = 1) -> None:
        """Free the KV cache and compute nothing until ``wake_up`` (levels 1 and 2 alike on
        CPU: the weights stay in host memory). Requests in flight are frozen, not aborted;
        new ones are refused (``EngineError``) until ``wake_up``."""
        if isinstance(level, bool) or level not in (1, 2):
            raise EngineError(f"{self.name}: sleep level must be 1 or 2, got {level!r}")
        loop = self._bind()
        if self._asleep:
            return
        self._asleep = True
        self._interrupt = True
        await loop.run_in_executor(self._executor, self._free_cache)

    async def wake_up(self) -> None:
        loop = self._bind()
        if not self._asleep:
            return
        await loop.run_in_executor(self._executor, self._alloc_cache)
        self._asleep = False
        self._kick()

    async def load_weights(
        self, weights: Sequence[tuple[str, torch.Tensor]], version: Version
    ) -> None:
        """Copy named full tensors (``state_dict`` names; any subset; any floating dtype,
        converted to the parameter's) into the model between two steps and set the version.
        Unknown names, duplicates, wrong shapes or a non-int version raise ``EngineError``
        and load nothing. Works while paused or asleep."""
        loop = self._bind()
        if not _is_int(version):
            raise EngineError(f"{self.name}: version must be an int, got {version!r}")
        staged = self._check_weights(weights)
        self._interrupt = True
        await loop.run_in_executor(self._executor, self._apply_weights, staged, int(version))
        self._kick()

    async def weight_fingerprints(self) -> dict[str, TensorFingerprint]:
        """``SupportsWeightFingerprints``: every tensor of the model it generates with, hashed
        on the model's thread (between two steps, as loads run), from the model itself."""
        loop = self._bind()
        return await loop.run_in_executor(
            self._executor, module_fingerprints, self.model, self._aliases
        )

    async def wait_for_tokens(self, request_id: str, count: int) -> int:
        """Wait until request ``request_id`` has at least ``count`` response tokens (resumed
        ones included) or has ended, and return how many it had then (its final count if it
        ended). ``EngineError`` if the id is not in flight.

        The engine checks after every step and holds its next step until the waiting task has
        run: an ``abort``, ``pause`` or ``load_weights`` that task calls right away (before any
        other await) applies before another token is sampled, so a request can be stopped or
        re-weighted at an exact token count. For progress reports and tests. Awaited directly
        the wait is registered before the caller yields; from a task of its own it is
        registered only when that task first runs (the engine may have stepped on by then):
        use :meth:`watch_tokens` there."""
        return await self.watch_tokens(request_id, count)

    def watch_tokens(self, request_id: str, count: int) -> asyncio.Future[int]:
        """``wait_for_tokens`` registered now, synchronously (call from the event loop's
        thread): the returned future is set as ``wait_for_tokens`` would return, and no step
        that starts after this call can pass ``count`` unseen."""
        loop = self._bind()
        if not _is_int(count) or count < 0:
            raise EngineError(f"{self.name}: count must be an int >= 0, got {count!r}")
        pending = self._inflight.get(request_id)
        if pending is None:
            raise EngineError(
                f"{self.name}: request {request_id!r} is not in flight; wait on it before "
                "its generate() call returns"
            )
        future: asyncio.Future[int] = loop.create_future()
        have = len(pending.request.resume_tokens)
        if pending.state == "waiting" and have >= count:  # not admitted: the prefix is all
            future.set_result(have)
            return future
        pending.watchers.append((int(count), future))
        self._watched.add(pending)
        self._new_watch = True  # checked even while paused or asleep
        self._interrupt = True
        self._kick()
        return future

    async def close(self) -> None:
        """Abort everything in flight, stop the driver and the worker thread. Final."""
        if self._closed:
            return
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            await self.pause("abort")
            if self._driver is not None:
                self._driver.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._driver
        self._closed = True
        self._driver = None
        self._executor.shutdown(wait=False)

    # ---- validation ----------------------------------------------------------------------
    def _reject(self, rid: str, message: str) -> EngineError:
        return EngineError(f"{self.name}: request {rid!r}: {message}")

    def _check_request(self, request: GenerationRequest) -> None:
        if isinstance(request, GenerationRequest):
            earlier = self._inflight.get(request.request_id)
            if earlier is not None and earlier.future.cancelled():
                self._drop(earlier)  # its done-callback has not run yet
        check_request(
            self.name, request, in_flight=self._inflight, vocab_size=self.config.vocab_size
        )
        rid, s = request.request_id, self.config.max_seq_len
        prompt, n = request.prompt_tokens, len(request.resume_tokens)
        if len(prompt) >= s:
            raise self._reject(
                rid,
                f"prompt_tokens has {len(prompt)} tokens; max_seq_len={s} leaves room for "
                f"prompts of at most {s - 1} tokens (shorten the prompt or use a model with a "
                "longer max_seq_len)",
            )
        if len(prompt) + n > s:
            raise self._reject(
                rid,
                f"prompt ({len(prompt)}) + resume_tokens ({n}) = {len(prompt) + n} tokens "
                f"exceed max_seq_len={s}; this engine cannot have produced that prefix",
            )

    def _check_weights(
        self, weights: Sequence[tuple[str, torch.Tensor]]
    ) -> list[tuple[torch.nn.Parameter, Tensor]]:
        staged: list[tuple[torch.nn.Parameter, Tensor]] = []
        seen: set[str] = set()
        for item in weights:
            if not isinstance(item, tuple | list) or len(item) != 2:
                raise EngineError(
                    f"{self.name}: load_weights takes (name, tensor) pairs, got {item!r:.80}"
                )
            name, tensor = item
            param = self._params.get(name)
            if param is None and name in self.model.tied:
                raise EngineError(
                    f"{self.name}: {name!r} is tied to {self.model.tied[name]!r} (one tensor); "
                    f"send it once, as {self.model.tied[name]!r}; nothing was loaded"
                )
            if param is None:
                known = ", ".join(list(self._params)[:4])
                raise EngineError(
                    f"{self.name}: unknown parameter {name!r}; names are the model's "
                    f"state_dict names ({known}, ...); nothing was loaded"
                )
            if name in seen:
                raise EngineError(
                    f"{self.name}: parameter {name!r} given twice; pass each once; nothing "
                    "was loaded"
                )
            seen.add(name)
            if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
                raise EngineError(
                    f"{self.name}: parameter {name!r} must be a floating-point tensor, got "
                    f"{getattr(tensor, 'dtype', type(tensor).__name__)}; nothing was loaded"
                )
            if tensor.device.type == "meta":
                raise EngineError(
                    f"{self.name}: parameter {name!r} is a meta tensor (no values); send "
                    "real tensors; nothing was loaded"
                )
            if tensor.shape != param.shape:
                raise EngineError(
                    f"{self.name}: parameter {name!r} has shape {tuple(tensor.shape)}, the "
                    f"model's is {tuple(param.shape)}; nothing was loaded"
                )
            staged.append((param, tensor))
        return staged

    # ---- event-loop side -----------------------------------------------------------------
    def _bind(self) -> asyncio.AbstractEventLoop:
        if self._closed:
            raise EngineError(f"{self.name}: the engine is closed; create a new one")
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None:  # requests of an earlier event loop are dead
                self._executor.submit(self._reset_slots).result()
                self._waiting.clear()
                self._inflight.clear()
                self._aborts.clear()
                self._watched.clear()
                self._active = 0
            self._loop, self._wake, self._driver = loop, asyncio.Event(), None
        if self._driver is None or self._driver.done():
            self._driver = loop.create_task(self._drive(), name=f"{self.name}-driver")
        return loop

    def _kick(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _drop(self, pending: _Pending) -> None:
        """The caller of ``generate`` gave up (its future was cancelled): forget the request."""
        if self._closed or pending.dropped:
            return
        pending.dropped = True
        if pending.state == "waiting":
            self._waiting.remove(pending)
            pending.state = "done"
        elif pending.state == "running" and pending not in self._aborts:
            self._aborts.append(pending)
            self._interrupt = True
            self._kick()
        if self._inflight.get(pending.request.request_id) is pending:
            del self._inflight[pending.request.request_id]

    def _finish(self, pending: _Pending, result: GenerationResult) -> None:
        pending.state = "done"
        rid = pending.request.request_id
        if self._inflight.get(rid) is pending:
            del self._inflight[rid]
        if not pending.future.done():
            pending.future.set_result(result)
        for _, waiter in pending.watchers:
            if not waiter.done():
                waiter.set_result(len(result.tokens))
        pending.watchers.clear()
        self._watched.discard(pending)

    def _next_job(self) -> _Job | None:
        aborts, self._aborts = self._aborts, []
        admit: list[_Pending] = []
        if not (self._paused or self._asleep):
            while self._waiting and self._active + len(admit) < self.max_batch:
                pending = self._waiting.popleft()
                pending.state = "running"
                admit.append(pending)
        self._active += len(admit)
        stepping = self._active > 0 and not (self._paused or self._asleep)
        watch = [
            (p, min(n for n, _ in p.watchers))
            for p in self._watched
            if p.state == "running" and p.watchers
        ]
        new_watch, self._new_watch = self._new_watch, False
        if not (aborts or admit or stepping or (new_watch and watch)):
            return None
        return _Job(admit, aborts, watch)

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        wake = self._wake
        assert wake is not None
        while True:
            job = self._next_job()
            if job is None:
                wake.clear()
                await wake.wait()
                continue
            self._interrupt = False
            try:
                out = await loop.run_in_executor(self._executor, self._work, job)
            except Exception as exc:  # a bug or an allocation failure: fail, do not hang
                await loop.run_in_executor(self._executor, self._reset_slots)
                error = EngineError(
                    f"{self.name}: generation failed ({exc!r}); every request in flight was dropped"
                )
                error.__cause__ = exc
                for pending in [*self._inflight.values(), *job.admit]:
                    pending.state = "done"
                    waiters: list[asyncio.Future[Any]] = [pending.future]
                    waiters += [w for _, w in pending.watchers]
                    for waiter in waiters:
                        if not waiter.done():
                            waiter.set_exception(error)
                    pending.watchers.clear()
                self._waiting.clear()
                self._inflight.clear()
                self._watched.clear()
                self._active = 0
                continue
            for pending, result in out.results:
                self._active -= 1
                self._finish(pending, result)
            for pending, have in out.progress:
                keep = []
                for n, waiter in pending.watchers:
                    if n <= have:
                        if not waiter.done():
                            waiter.set_result(have)
                    else:
                        keep.append((n, waiter))
                pending.watchers[:] = keep
                if not keep:
                    self._watched.discard(pending)
            if out.progress:
                # let the woken waiters run first: a control call they make at once (abort,
                # pause, load_weights) is then queued before the next step
                await asyncio.sleep(0)

    # ---- worker side (runs only in the executor thread) -----------------------------------
    def _work(self, job: _Job) -> _JobOut:
        out = _JobOut()
        with torch.inference_mode():
            for pending in job.aborts:
                slot = self._where.get(pending.request.request_id)
                if slot is not None and self._slots[slot] is pending:
                    self._retire([slot], ["abort"], out)
            if job.admit:
                self._admit(job.admit)
            if self._watch_reached(job.watch, out):
                return out
            while self._n and not (self._paused or self._asleep):
                if bool(self._refill[: self._n].any()):
                    self._prefill_step(out)
                else:
                    self._decode_step(out)
                if out.results or self._interrupt or self._watch_reached(job.watch, out):
                    break
        return out

    def _watch_reached(self, watch: list[tuple[_Pending, int]], out: _JobOut) -> bool:
        for pending, count in watch:
            slot = self._where.get(pending.request.request_id)
            if slot is None or self._slots[slot] is not pending:
                continue
            have = int(self._ctx[slot] - self._plen[slot])
            if have >= count:
                out.progress.append((pending, have))
        return bool(out.progress)

    def _admit(self, admit: list[_Pending]) -> None:
        n, k, s = self._n, len(admit), self.config.max_seq_len
        contexts = [list(p.request.prompt_tokens) + list(p.request.resume_tokens) for p in admit]
        lengths = [len(c) for c in contexts]
        width = max(lengths)
        rows = slice(n, n + k)
        self._tok[rows, :width] = torch.tensor([c + [0] * (width - len(c)) for c in contexts])
        self._ctx[rows] = torch.tensor(lengths)
        plens = [len(p.request.prompt_tokens) for p in admit]
        self._plen[rows] = torch.tensor(plens)
        self._limit[rows] = torch.tensor(
            [
                pl + min(p.request.params.max_tokens, s - pl)
                for p, pl in zip(admit, plens, strict=True)
            ]
        )
        self._temp[rows] = torch.tensor([float(p.request.params.temperature) for p in admit])
        self._top_p[rows] = torch.tensor([float(p.request.params.top_p) for p in admit])
        self._top_k[rows] = torch.tensor([int(p.request.params.top_k) for p in admit])
        stops = [list(p.request.params.stop_token_ids) for p in admit]
        n_stop = max(1, *(len(x) for x in stops))
        if n_stop > self._stops.shape[1]:
            wider = torch.full((self.max_batch, n_stop), -1, dtype=torch.long)
            wider[:, : self._stops.shape[1]] = self._stops
            self._stops = wider
        width_s = self._stops.shape[1]
        self._stops[rows] = torch.tensor([x + [-1] * (width_s - len(x)) for x in stops])
        self._refill[rows] = True
        for i, pending in enumerate(admit):
            slot = n + i
            self._slots[slot] = pending
            self._where[pending.request.request_id] = slot
            seed = pending.request.params.seed
            if seed is not None:
                self._gens[slot] = torch.Generator().manual_seed(int(seed))
        self._n = n + k

    def _prefill_step(self, out: _JobOut) -> None:
        assert self._cache is not None
        idx = self._refill[: self._n].nonzero().squeeze(1)
        lengths = self._ctx[idx]
        width = int(lengths.max())
        logits = self.model.prefill(self._tok[idx, :width], lengths, self._cache, idx)
        self._refill[idx] = False
        self.prefill_steps += 1
        self._advance(idx, logits, out)

    def _decode_step(self, out: _JobOut) -> None:
        assert self._cache is not None
        n = self._n
        rows = self._arange[:n]
        positions = self._ctx[:n] - 1
        logits = self.model.decode(self._tok[rows, positions], positions, self._cache)
        self.decode_steps += 1
        self._advance(rows, logits, out)

    def _advance(self, idx: Tensor, logits: Tensor, out: _JobOut) -> None:
        """Sample the next token of slots ``idx``, record it, retire what ended."""
        choice, logp = self._sample(idx, logits)
        pos = self._ctx[idx]
        self._tok[idx, pos] = choice
        self._lp[idx, pos] = logp
        self._ver[idx, pos] = self._wversion
        self._ctx[idx] = pos + 1
        self.tokens_generated += int(idx.shape[0])
        stop = (choice.unsqueeze(1) == self._stops[idx]).any(1)
        done = stop | (pos + 1 >= self._limit[idx])
        if bool(done.any()):
            which = done.nonzero().squeeze(1)
            reasons: list[FinishReason] = ["stop" if s else "length" for s in stop[which].tolist()]
            self._retire(idx[which].tolist(), reasons, out)

    def _sample(self, idx: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
        temp = self._temp[idx]
        greedy = temp == 0
        n_greedy = int(greedy.sum())
        logp_all = torch.log_softmax(
            self._filter(logits, temp, self._top_k[idx], self._top_p[idx]), dim=-1
        )  # -inf off the support: the filtered, renormalised distribution
        if n_greedy == idx.shape[0]:
            choice = logits.argmax(dim=-1)
        else:
            probs = logp_all.exp()
            # the engine's generator draws for its unseeded sampled rows only: a greedy or
            # seeded request in the batch (a verification probe) leaves the others' draws
            # as they would be without it
            u = torch.zeros(idx.shape[0])
            own = ~greedy
            if self._gens:
                for i, slot in enumerate(idx.tolist()):
                    gen = self._gens.get(slot)
                    if gen is not None and not bool(greedy[i]):
                        u[i] = torch.rand((), generator=gen)
                        own[i] = False
            drawn = int(own.sum())
            if drawn:
                u[own] = torch.rand(drawn, generator=self._gen)
            cdf = probs.cumsum(dim=-1)
            total = cdf[:, -1:]
            choice = torch.searchsorted(cdf, u.unsqueeze(1) * total, right=True).squeeze(1)
            last = (cdf < total).sum(dim=-1)  # the last token with a positive probability
            choice = torch.minimum(choice, last)
            if n_greedy:
                choice = torch.where(greedy, logits.argmax(dim=-1), choice)
        logp = logp_all.gather(1, choice.unsqueeze(1)).squeeze(1)
        return choice, logp

    def _filter(self, logits: Tensor, temp: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
        """The sampling distribution's logits (``filter_logits``: temperature, top-k, top-p)."""
        return filter_logits(logits, temp, top_k, top_p)

    def _retire(self, slots: list[int], reasons: list[FinishReason], out: _JobOut) -> None:
        rows = torch.tensor(slots, dtype=torch.long)
        toks, lps, vers = (
            self._tok[rows].tolist(),
            self._lp[rows].tolist(),
            self._ver[rows].tolist(),
        )
        ctxs, plens = self._ctx[rows].tolist(), self._plen[rows].tolist()
        for i, (slot, reason) in enumerate(zip(slots, reasons, strict=True)):
            pending = self._slots[slot]
            assert pending is not None
            req = pending.request
            a, b = plens[i] + len(req.resume_tokens), ctxs[i]
            result = GenerationResult(
                req.request_id,
                req.prompt_tokens,
                req.resume_tokens + tuple(toks[i][a:b]),
                req.resume_logprobs + tuple(lps[i][a:b]),
                req.resume_versions + tuple(vers[i][a:b]),
                reason,
            )
            out.results.append((pending, result))
            del self._where[req.request_id]
            self._slots[slot] = None
            self._gens.pop(slot, None)
            if reason == "abort":
                self._aborted_in_slots += 1
            else:
                self.requests_finished += 1
        self._compact(set(slots))

    def _compact(self, removed: set[int]) -> None:
        """Keep running slots a prefix: move the last running slots into the holes."""
        n_old = self._n
        n_new = n_old - len(removed)
        holes = sorted(s for s in removed if s < n_new)
        movers = [s for s in range(n_new, n_old) if s not in removed]
        if holes:
            src = torch.tensor(movers, dtype=torch.long)
            dst = torch.tensor(holes, dtype=torch.long)
            for t in (
                self._tok,
                self._lp,
                self._ver,
                self._ctx,
                self._plen,
                self._limit,
                self._temp,
                self._top_p,
                self._top_k,
                self._stops,
                self._refill,
            ):
                t[dst] = t[src]
            if self._cache is not None:
                self._cache.move(src, dst, int(self._ctx[dst].max()))
            for s, d in zip(movers, holes, strict=True):
                pending = self._slots[s]
                assert pending is not None
                self._slots[d], self._slots[s] = pending, None
                self._where[pending.request.request_id] = d
                gen = self._gens.pop(s, None)
                if gen is not None:
                    self._gens[d] = gen
        self._n = n_new

    def _apply_weights(self, staged: list[tuple[torch.nn.Parameter, Tensor]], version: int) -> None:
        with torch.no_grad():
            for param, tensor in staged:
                param.copy_(tensor)
        self._wversion = version
        if staged:
            self._refill[: self._n] = True  # recompute the KV under the new weights

    def _free_cache(self) -> None:
        self._cache = None
        self._refill[: self._n] = True

    def _alloc_cache(self) -> None:
        if self._cache is None:
            self._cache = KVCache(self.config, self.max_batch)

    def _reset_slots(self) -> None:
        self._slots = [None] * self.max_batch
        self._where.clear()
        self._gens.clear()
        self._refill.zero_()
        self._n = 0


# --------------------------------------------------------------------------------------------
# Train engine
# --------------------------------------------------------------------------------------------
class TorchTrainEngine(AdamWTrainer):
    """Trains a ``TransformerLM`` with AdamW (``asyncflow_core.engines.lmtrain.AdamWTrainer``).

    ``TorchTrainEngine(model_or_config, *, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999),
    max_grad_norm=1.0, micro_batch_size=32, seed=0, lr_warmup_steps=0, temperature=1.0,
    name=..., threads=None)``: a ``ModelConfig`` builds a model initialised from ``seed`` (the same
    weights as a ``TorchInferenceEngine`` built from that config and seed); a model is
    deep-copied (CPU, fp32). ``max_grad_norm=None`` disables clipping (the norm is still
    reported). ``threads`` as for ``TorchInferenceEngine``.

    **Batches.** ``batch`` needs tensor fields ``prompt`` and ``response`` of token ids, in
    the store's "padded" layout (``[B, max_len]`` plus ``batch.lengths[field]``; a field
    without lengths counts as full width), "list" layout (one 1-D tensor per row) or "nested".
    ``compute_logprobs(batch)`` returns ``[B, R]`` fp32 (``R``: the response tensor's padded
    width, or its longest row in the other layouts): position ``j`` of row ``i`` is the
    log-prob of ``response[i, j]`` given ``prompt[i]`` and ``response[i, :j]`` under row
    ``i``'s sampling distribution (its ``temperature``/``top_k``/``top_p`` fields, see
    ``asyncflow_core.training.sampling``; the constructor's ``temperature`` and no filters for a
    batch without them), 0 beyond the row's length; the loss gets the same quantity, with gradients.
    Every prompt needs at least one token and prompt + response at most ``max_seq_len``.

    **Steps.** ``train_step(batch, loss_fn)`` splits the rows into consecutive micro-batches
    of ``micro_batch_size`` and calls ``loss_fn(logprobs, part)`` on each, ``part`` being the
    micro-batch's own ``Batch`` (rows, data, lengths and tags sliced alike; padded tensors keep
    the full batch's width so they line up with ``logprobs``). Each micro-batch's loss is
    weighted by its share of the batch's response tokens before its backward, so for losses
    that average over response tokens (``policy_gradient_loss``) the accumulated gradient
    equals one full-batch step exactly; a loss that averages over rows instead is weighted by
    tokens, not rows (a micro-batch without response tokens is skipped). Then the gradient
    norm is clipped to ``max_grad_norm``, AdamW steps and ``weight_version`` adds 1.
    ``TrainMetrics``: ``loss`` and ``extra`` (the loss function's metrics) are the same
    token-weighted means; ``grad_norm`` is the norm before clipping; ``tokens`` counts prompt
    and response tokens; ``extra["logprobs_off_support"]`` counts the response tokens found
    off their row's top-k/top-p support (given the documented floor). A non-finite loss or
    gradient, or a bad loss value, raises ``EngineError`` and changes nothing (no step, no
    version).

    **Weights.** ``export_weights(bucket_bytes)`` snapshots every ``state_dict`` tensor
    (cloned, fp32; a tied LM head once, as ``tok_emb.weight``) and yields them in order in
    buckets of at most ``bucket_bytes`` (a bigger tensor alone). **Checkpoints**:
    ``save_checkpoint(path)`` writes the directory ``path`` with ``model.safetensors`` (the
    ``state_dict``, a tied tensor once), ``optimizer.pt`` (``torch.save`` of the
    AdamW ``state_dict``, read back with ``weights_only=True``) and ``trainer.json``
    (format tag, weight version, model config, optimizer settings), each written to a
    temporary name and renamed, ``trainer.json`` last. ``load_checkpoint(path)`` restores the
    weights, the optimizer state and the version, after checking that the checkpoint's model
    config equals this engine's.

    The work runs in a dedicated worker thread, one call at a time, so the event loop stays
    responsive. ``close()`` stops that thread.
    """

    checkpoint_format = "asyncflow-torch-trainer/1"
    model: TransformerLM

    def __init__(
        self,
        model_or_config: TransformerLM | ModelConfig,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        max_grad_norm: float | None = 1.0,
        micro_batch_size: int = 32,
        seed: int = 0,
        lr_warmup_steps: int = 0,
        minibatches: int = 1,
        temperature: float = 1.0,
        name: str = "torch-trainer",
        threads: int | None = None,
    ) -> None:
        who = f"TorchTrainEngine {name!r}"
        super().__init__(
            name=name,
            who=who,
            lr=lr,
            weight_decay=weight_decay,
            betas=betas,
            max_grad_norm=max_grad_norm,
            micro_batch_size=micro_batch_size,
            temperature=temperature,
            seed=seed,
            lr_warmup_steps=lr_warmup_steps,
            minibatches=minibatches,
        )
        self.model = _take_model(model_or_config, self.seed, who).train().requires_grad_(True)
        self.config: ModelConfig = self.model.config
        self.vocab_size, self.max_seq_len = self.config.vocab_size, self.config.max_seq_len
        self._start(threads, who)

    def _response_logprobs(self, rows: TokenRows) -> tuple[Tensor, int]:
        b, r = rows.response.shape
        if r == 0 or b == 0:
            return torch.zeros(b, r), 0
        seq, source = rows.inputs()
        hidden = self.model.hidden(seq)  # [b, t, D]; only the source positions get logits
        picked = hidden.gather(1, source.unsqueeze(2).expand(b, r, hidden.shape[2]))
        return rows.logprobs(self.model.head(picked))

    def _model_config(self) -> dict[str, Any]:
        return asdict(self.config)

    def _other_model(self, saved: object) -> str | None:
        try:
            config = ModelConfig(**saved)  # type: ignore[arg-type]
        except (TypeError, ValueError, AsyncFlowError) as exc:
            return f"is not readable (model_config: {exc})"
        if config != self.config:
            return f"is for {config}, this engine's model is {self.config}"
        return None


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------
async def benchmark(
    config: ModelConfig,
    *,
    requests: int = 256,
    prompt_len: int = 4,
    new_tokens: int = 12,
    max_batch: int = 256,
    rounds: int = 3,
    threads: int | None = 1,
) -> dict[str, float]:
    """Best-of-``rounds`` generation throughput (temperature 1) and ``train_step`` time (one
    micro-batch of all rows, ``policy_gradient_loss``) for ``config``."""
    from asyncflow_core.training.rl import policy_gradient_loss

    engine = TorchInferenceEngine(config, max_batch=max_batch, threads=threads, name="bench")
    trainer = TorchTrainEngine(config, micro_batch_size=requests, threads=threads)
    params = SamplingParams(max_tokens=new_tokens, temperature=1.0)
    vocab = config.vocab_size
    gen_s, results = math.inf, []
    for r in range(rounds):
        prompts = [tuple((i + j) % vocab for j in range(prompt_len)) for i in range(requests)]
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(
                engine.generate(GenerationRequest(f"b{r}-{i}", p, params))
                for i, p in enumerate(prompts)
            )
        )
        gen_s = min(gen_s, time.perf_counter() - t0)
    await engine.close()
    tokens = sum(len(x.tokens) for x in results)
    batch = Batch(
        tuple(range(requests)),
        {
            "prompt": [torch.tensor(x.prompt_tokens) for x in results],
            "response": [torch.tensor(x.tokens) for x in results],
            "advantage": torch.randn(requests, generator=torch.Generator().manual_seed(0)),
        },
        {"response": torch.tensor([len(x.tokens) for x in results])},
    )
    train_s = math.inf
    for _ in range(rounds):
        t0 = time.perf_counter()
        await trainer.train_step(batch, policy_gradient_loss)
        train_s = min(train_s, time.perf_counter() - t0)
    await trainer.close()
    return {
        "tokens": float(tokens),
        "generate_s": gen_s,
        "tokens_per_s": tokens / gen_s,
        "sequences_per_s": requests / gen_s,
        "train_step_s": train_s,
    }


def main(argv: Sequence[str] | None = None) -> None:
    """The timing command of the module docstring."""
    parser = argparse.ArgumentParser(description="Time the reference torch engines on CPU.")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1, help="0: torch's setting")
    args = parser.parse_args(argv)
    config = ModelConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.layers,
        max_seq_len=args.prompt_len + args.new_tokens + 16,
    )
    stats = asyncio.run(
        benchmark(
            config,
            requests=args.requests,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            max_batch=args.requests,
            threads=args.threads or None,
        )
    )
    print(
        f"{config}, threads={args.threads or torch.get_num_threads()}\n"
        f"  generate: {stats['tokens']:.0f} tokens in {stats['generate_s'] * 1e3:.1f} ms = "
        f"{stats['tokens_per_s']:,.0f} tokens/s ({stats['sequences_per_s']:,.0f} seq/s)\n"
        f"  train_step ({args.requests} rows): {stats['train_step_s'] * 1e3:.1f} ms"
    )


__all__ = [
    "CHECKPOINT_META",
    "CHECKPOINT_OPTIMIZER",
    "CHECKPOINT_WEIGHTS",
    "TorchInferenceEngine",
    "TorchTrainEngine",
    "benchmark",
]
