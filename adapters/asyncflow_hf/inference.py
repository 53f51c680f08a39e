"""``HFInferenceEngine``: an ``InferenceEngine`` over transformers' continuous batching.

transformers 5.24's ``ContinuousBatchingManager`` (``model.init_continuous_batching()``,
``transformers/generation/continuous_batching/continuous_api.py``) runs a background thread
that schedules requests into paged-attention forwards, one token per running request per
step. This adapter drives it and supplies what it lacks, inside the adapter (transformers
itself is never patched):

* **Sampling and log-probs.** The manager samples with one generator for the whole batch
  (``ContinuousBatchingConfig.seed``; ``model_runner.py::ModelRunner._sample`` draws with
  ``torch.multinomial`` over every row at once), so a request's tokens depend on what runs
  beside it and no request can have its own seed; ``do_sample`` is fixed per manager, so
  greedy and sampled requests could not share one; per-request temperature/top-k/top-p exist
  only with ``per_request_processors=True`` and only for knobs the generation config enabled
  at construction (``cb_logits_processors.py``), and a per-request ``top_k=0`` ("off" in
  this protocol) becomes 1 there (``max(top_k, min_tokens_to_keep)``), i.e. greedy. So the
  adapter installs its own per-request sampler as the manager's only logits processor (a
  ``ContinuousBatchingLogitsProcessor``, the manager's own extension type): for each row it
  applies ``asyncflow_core.training.sampling.filter_logits`` with the request's knobs, draws from
  the request's own generator (``SamplingParams.seed``) or the engine's, records the token, its
  log-prob under that distribution (greedy: temperature 1, unfiltered) and the weight version, and
  hands the manager a distribution with all its mass on that token, which the manager (built with
  ``do_sample=False``) takes by argmax. The model folder's ``generation_config.json`` (a repetition
  penalty, a default top-k) is not applied: the request's ``SamplingParams`` are the only knobs (a
  warning names the fields it ignores).
* **Finish reasons.** ``GenerationOutput`` has none: ``stop`` when the last token is one of
  the request's stop ids (the tokenizer's EOS plus ``stop_token_ids``), else ``length``.
* **Abort.** ``cancel_request`` drops a request without an output (``scheduler.py``): the
  adapter returns the tokens its sampler recorded.
* **Prefix sharing and CPU offloading are off** (``allow_block_sharing=False``,
  ``cpu_offload_space=0``): shared prefix blocks outlive their requests (``cache.py``), and an
  offloaded request's KV comes back from the CPU pool as it was, so after a weight load
  requests would reuse KV computed under the old weights.
* **Recompute at a load.** The manager keeps a running request's KV cache across a weight
  update. ``load_weights`` copies the weights between two steps (under the manager's
  ``pause()``) and, in the same pause, frees the KV cache of every request the manager is
  running (prefilling or decoding) and queues it again, first in line, with prompt + tokens
  generated so far as its prompt: transformers' own soft reset
  (``RequestState.create_equivalent_initial_request``, what ``offloading_manager.py`` does to
  a request it evicts). The next steps prefill that context under the new weights, and the
  next token is sampled from it, so every token labelled with the new version has the log-prob
  of the new weights given the whole context. Tokens generated before the load keep their
  version. The cost is one prefill of each running request's context per load. This reaches
  the scheduler's state (``active_requests``, ``waiting_requests_order``; transformers has no
  public call for it): pinned by the ``[hf]`` extra, and checked by the pair suite's in-flight
  law and ``tests/test_hf_inference.py``; replace it once the manager invalidates running
  requests' KV at a weight update itself.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import logging
import math
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from asyncflow_core.contracts.errors import ConfigError, EngineError
from asyncflow_core.contracts.protocols import GenerationRequest, GenerationResult, Version
from asyncflow_core.engines.enginekit import (
    PauseGate,
    abort_ids,
    assemble,
    check_request,
    continuation,
    is_int,
)
from asyncflow_core.engines.lmtrain import unique_named_tensors
from asyncflow_core.sync.verify import TensorFingerprint, module_fingerprints, tied_aliases
from asyncflow_core.training.sampling import filter_logits
from asyncflow_hf.compat import require_transformers
from asyncflow_hf.models import Dtype, load_causal_lm

logger = logging.getLogger(__name__)

# Sampling fields of a generation config that this engine does not apply (warned about).
_IGNORED_GENERATION_FIELDS = {
    "repetition_penalty": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "temperature": 1.0,
    "min_p": None,
    "typical_p": 1.0,
    "no_repeat_ngram_size": 0,
    "bad_words_ids": None,
}


@dataclass(eq=False)
class _Live:
    """One request from ``generate`` to its result."""

    request: GenerationRequest
    cb_id: str
    future: asyncio.Future[GenerationResult]
    cap: int  # tokens this attempt may generate
    stop: frozenset[int]
    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None
    state: Literal["waiting", "running", "done"] = "waiting"
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[Version] = field(default_factory=list)
    watchers: list[tuple[int, asyncio.Future[int]]] = field(default_factory=list)


class HFInferenceEngine:
    """Generates with a Hugging Face causal LM through transformers' continuous batching.

    ``HFInferenceEngine(model, *, tokenizer=None, eos_token_ids=None, dtype="fp32",
    max_batch=64, max_model_len=None, page_size=64, num_blocks=None, max_batch_tokens=512,
    kv_cache_gib=2.0, seed=0, trust_remote_code=False, name=..., threads=None)``

    * ``model``: what ``asyncflow_hf.models.load_causal_lm`` takes (a local model folder, a
      ``PretrainedConfig`` with ``seed``, a ``TINY`` name, or a ``PreTrainedModel``, which is
      deep-copied). The engine owns its copy.
    * Stop ids: every request stops on ``eos_token_ids`` (default: the tokenizer's
      ``eos_token_id`` if a tokenizer is given, else the model's generation/model config's)
      plus its own ``stop_token_ids``; the stop token is included in the result.
    * Capacity: up to ``max_batch`` requests run at once; each may hold ``max_model_len``
      tokens (default: the model's ``max_position_embeddings``, at most 4096), prompt and
      response together: a request reaching it ends with ``length``; a prompt that does not
      fit is refused. The paged KV cache holds ``num_blocks`` blocks of ``page_size`` tokens
      (default: enough for ``max_batch`` full-length requests, within ``kv_cache_gib``; the
      manager queues requests that do not fit). ``max_batch_tokens`` caps the
      tokens of one forward (long prompts are prefilled in chunks).
    * ``seed`` seeds the generator of requests without ``SamplingParams.seed``; a request
      with a seed draws from its own generator, so it is reproducible whatever runs beside it
      (a resumed request re-seeds: deterministic, but not the uninterrupted run's tokens).
    * ``threads``: torch intra-op threads of the manager's generation thread (None: torch's).

    A ``load_weights`` while requests generate recomputes their context's keys and values
    under the new weights before their next token (see the module docstring).

    Abilities: ``abort``, ``pause``/``resume`` (``keep`` freezes running requests at a step
    boundary, under the manager's ``pause()``; ``abort`` aborts them; new requests wait
    either way), ``load_weights`` (HF ``state_dict`` names, a tied LM head under the
    embedding's name only; applied between two steps), ``wait_for_tokens``. No ``sleep``: the
    manager cannot release its paged cache and keep its requests, and on CPU there is no
    device memory to hand back. ``close()`` aborts what is in flight and stops the manager.
    """

    def __init__(
        self,
        model: Any,
        *,
        tokenizer: Any = None,
        eos_token_ids: Sequence[int] | None = None,
        dtype: Dtype = "fp32",
        max_batch: int = 64,
        max_model_len: int | None = None,
        page_size: int = 64,
        num_blocks: int | None = None,
        max_batch_tokens: int = 512,
        kv_cache_gib: float = 2.0,
        seed: int = 0,
        trust_remote_code: bool = False,
        name: str = "hf-rollout",
        threads: int | None = None,
    ) -> None:
        who = f"HFInferenceEngine {name!r}"
        self.name = name
        transformers = require_transformers(who, continuous_batching=True)
        for arg, value, low in (
            ("max_batch", max_batch, 1),
            ("page_size", page_size, 4),
            ("max_batch_tokens", max_batch_tokens, 1),
        ):
            if not is_int(value) or value < low:
                raise ConfigError(f"{who}: {arg} must be an int >= {low}, got {value!r}")
        if threads is not None and (not is_int(threads) or threads < 1):
            raise ConfigError(f"{who}: threads must be None or an int >= 1, got {threads!r}")
        if not is_int(seed) or not 0 <= seed < 2**63:
            raise ConfigError(f"{who}: seed must be an int in [0, 2**63), got {seed!r}")
        self.model = load_causal_lm(
            model, who=who, dtype=dtype, seed=seed, trust_remote_code=trust_remote_code
        )
        self.model.eval().requires_grad_(False)
        self._aliases = tied_aliases(self.model)  # the ties as built (weight_fingerprints)
        config = self.model.config
        self.vocab_size: int = int(config.vocab_size)
        positions = getattr(config, "max_position_embeddings", None)
        limit = min(int(positions), 4096) if is_int(positions) else 4096
        if max_model_len is None:
            max_model_len = limit
        if not is_int(max_model_len) or not 2 <= max_model_len <= (positions or max_model_len):
            raise ConfigError(
                f"{who}: max_model_len must be an int in [2, {positions}] (the model's "
                f"max_position_embeddings), got {max_model_len!r}"
            )
        self.max_model_len = int(max_model_len)
        self.eos_token_ids = self._eos(who, tokenizer, eos_token_ids)
        self._warn_generation_config(who)
        if not isinstance(kv_cache_gib, int | float) or not kv_cache_gib > 0:
            raise ConfigError(f"{who}: kv_cache_gib must be a number > 0, got {kv_cache_gib!r}")
        blocks = num_blocks
        if blocks is None:
            per_block = page_size * _kv_bytes_per_token(config, self.model.dtype)
            budget = int(kv_cache_gib * (1 << 30)) // per_block
            blocks = min(max_batch * math.ceil(self.max_model_len / page_size) + 1, budget)
            blocks = max(blocks, math.ceil(self.max_model_len / page_size))
        if not is_int(blocks) or blocks < math.ceil(self.max_model_len / page_size):
            raise ConfigError(
                f"{who}: num_blocks must be an int >= {math.ceil(self.max_model_len / page_size)}"
                f" (one max_model_len request), got {num_blocks!r}"
            )
        self.max_batch = int(max_batch)
        self._version: Version = 0
        self._generator = torch.Generator().manual_seed(int(seed))
        self._live: dict[str, _Live] = {}  # by request_id
        self._by_cb: dict[str, _Live] = {}  # by the manager's id (one per attempt)
        self._ids = itertools.count()
        self._lock = threading.Lock()  # _Live token lists, shared with the sampler thread
        self._gate = PauseGate(self.name)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watching = 0
        self._hold: tuple[threading.Thread, threading.Event] | None = None
        self._control = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-ctl")
        self._closed = False
        self._threads = threads
        cbl = importlib.import_module(
            "transformers.generation.continuous_batching.cb_logits_processors"
        )
        gen_config = transformers.GenerationConfig(
            do_sample=False, max_new_tokens=self.max_model_len, eos_token_id=-1
        )
        cb_config = transformers.ContinuousBatchingConfig(
            page_size=int(page_size),
            num_blocks=int(blocks),
            max_batch_tokens=int(max_batch_tokens),
            max_requests_per_batch=int(max_batch),
            allow_block_sharing=False,
            cpu_offload_space=0.0,  # a request offloaded to the CPU would come back with old KV
            use_async_batching=False,  # the sampler pairs rows with requests within one step
            use_cuda_graph=False,
            return_logprobs=False,
            seed=int(seed),
            auto_switch_to_flash=False,
        )
        self._manager = self.model.init_continuous_batching(
            generation_config=gen_config, continuous_batching_config=cb_config
        )
        self._request_status = importlib.import_module(
            "transformers.generation.continuous_batching.requests"
        ).RequestStatus
        sampler = _make_sampler(cbl, self)
        processors = cbl.ContinuousBatchingLogitsProcessorList(
            transformers.LogitsProcessorList([sampler])
        )
        processors.tensors_required = 1  # one int32 row of per-request arguments (unused)
        self._manager.logit_processor = processors
        self._start()

    # ---- construction ------------------------------------------------------------------------
    def _eos(self, who: str, tokenizer: Any, given: Sequence[int] | None) -> tuple[int, ...]:
        if given is not None:
            ids = list(given)
        elif tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            ids = [tokenizer.eos_token_id]
        else:
            found = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
            if found is None:
                found = getattr(self.model.config, "eos_token_id", None)
            ids = [] if found is None else list(found) if isinstance(found, list) else [found]
        for t in ids:
            if not is_int(t) or not 0 <= t < self.vocab_size:
                raise ConfigError(
                    f"{who}: EOS token id {t!r} is not in [0, {self.vocab_size}); pass "
                    "eos_token_ids= or a tokenizer whose eos_token_id fits the model"
                )
        return tuple(int(t) for t in ids)

    def _warn_generation_config(self, who: str) -> None:
        config = getattr(self.model, "generation_config", None)
        if config is None:
            return
        ignored = {
            k: getattr(config, k)
            for k, default in _IGNORED_GENERATION_FIELDS.items()
            if getattr(config, k, default) not in (default, None)
        }
        if ignored:
            logger.warning(
                "%s: the model's generation config sets %s; this engine does not apply them: "
                "each request's SamplingParams (temperature, top_k, top_p) are the only "
                "sampling knobs",
                who,
                ignored,
            )

    def _start(self) -> None:
        """Start the manager's generation thread as a daemon (a thread takes its creator's
        daemon flag, and the manager does not set one), with ``threads`` intra-op threads,
        and stop it when this engine is garbage-collected unclosed: an engine nobody closed
        must neither keep the process from exiting nor keep a model and its cache alive."""
        manager, threads = self._manager, self._threads
        failure: list[BaseException] = []

        def start() -> None:
            try:
                if threads is not None:
                    torch.set_num_threads(threads)  # the generation thread's default
                manager.start()
            except BaseException as exc:
                failure.append(exc)

        starter = threading.Thread(target=start, name=f"{self.name}-start", daemon=True)
        starter.start()
        starter.join()
        if failure:
            raise failure[0]
        weakref.finalize(self, _stop_unclosed, manager)

    # ---- protocol ------------------------------------------------------------------------
    @property
    def weight_version(self) -> Version:
        return self._version

    @property
    def running(self) -> int:
        """Requests in flight (waiting or generating)."""
        return len(self._live)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        loop = self._bind()
        request = check_request(
            self.name,
            request,
            in_flight=self._live,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
        )
        prompt, remaining = continuation(request)
        cap = min(remaining, self.max_model_len - len(prompt))
        if cap <= 0:
            return assemble(request, [], [], [], "length", who=self.name)
        p = request.params
        live = _Live(
            request=request,
            cb_id=f"{request.request_id}#{next(self._ids)}",
            future=loop.create_future(),
            cap=cap,
            stop=frozenset(self.eos_token_ids) | frozenset(int(t) for t in p.stop_token_ids),
            temperature=float(p.temperature),
            top_k=int(p.top_k),
            top_p=float(p.top_p),
            generator=None if p.seed is None else torch.Generator().manual_seed(int(p.seed)),
        )
        self._live[request.request_id] = live  # in flight before the first await
        try:
            await self._gate.wait()
            if live.state == "waiting":  # not aborted while paused
                self._add(live, prompt)
            return await asyncio.shield(live.future)
        finally:
            if self._live.get(request.request_id) is live and live.future.done():
                self._forget(live)
            elif not live.future.done():  # the caller was cancelled: drop the request
                self._abort(live)

    async def abort(self, request_ids: Sequence[str]) -> None:
        self._bind()
        for rid in abort_ids(self.name, request_ids):
            live = self._live.get(rid)
            if live is not None:
                self._abort(live)

    async def pause(self, mode: Literal["abort", "keep"] = "abort") -> None:
        """``keep``: running requests freeze at the next step boundary (the manager's
        ``pause()``), and this returns once they are frozen; ``abort``: every request in
        flight ends with ``abort``. New requests wait until ``resume()`` either way."""
        if mode not in ("abort", "keep"):
            raise EngineError(f"{self.name}: pause mode must be 'abort' or 'keep', got {mode!r}")
        self._bind()
        self._gate.pause()
        if mode == "abort":
            for live in list(self._live.values()):
                self._abort(live)
        elif self._hold is None:
            await self._hold_manager()

    async def resume(self) -> None:
        self._bind()
        hold, self._hold = self._hold, None
        if hold is not None:
            thread, release = hold
            release.set()
            await asyncio.get_running_loop().run_in_executor(None, thread.join)
        self._gate.resume()

    async def load_weights(
        self, weights: Sequence[tuple[str, torch.Tensor]], version: Version
    ) -> None:
        """Copy named full tensors (HF ``state_dict`` names, any subset, any floating dtype)
        into the model between two steps and set the version; requests running then have
        their context's KV cache recomputed under the new weights before their next token
        (their earlier tokens keep their version). Unknown names, an alias of a
        tied tensor (``lm_head.weight`` of a tied model: load the embedding), duplicates,
        wrong shapes or a non-int version raise ``EngineError`` and load nothing."""
        loop = self._bind()
        if not is_int(version) or version < 0:
            raise EngineError(f"{self.name}: version must be an int >= 0, got {version!r}")
        staged = self._check_weights(weights)
        await loop.run_in_executor(self._control, self._apply, staged, int(version))

    async def weight_fingerprints(self) -> dict[str, TensorFingerprint]:
        """``SupportsWeightFingerprints``: every tensor of the model it generates with, hashed
        from the model now (on the control thread, as loads run); a tied LM head is hashed
        from its own tensor and marked ``alias_of`` the embedding (the tie as it was when the
        engine was built), so a load that broke the tie shows."""
        loop = self._bind()
        return await loop.run_in_executor(
            self._control, module_fingerprints, self.model, self._aliases
        )

    async def wait_for_tokens(self, request_id: str, count: int) -> int:
        """Wait until request ``request_id`` has at least ``count`` response tokens (resumed
        ones included) or has ended; return its count then. ``EngineError`` if the id is not
        in flight. The manager does not wait for the waiter: the request may run on a few
        tokens before a following ``abort``/``pause`` applies."""
        loop = self._bind()
        if not is_int(count) or count < 0:
            raise EngineError(f"{self.name}: count must be an int >= 0, got {count!r}")
        live = self._live.get(request_id)
        if live is None:
            raise EngineError(
                f"{self.name}: request {request_id!r} is not in flight; wait on it before its "
                "generate() call returns"
            )
        have = self._count(live)
        if have >= count or live.state == "done":
            return have
        future: asyncio.Future[int] = loop.create_future()
        with self._lock:
            live.watchers.append((int(count), future))
            self._watching += 1
        self._notify(live)  # tokens may have come between the count and the registration
        return await future

    async def close(self) -> None:
        """Abort every request in flight and stop the manager's thread. Final."""
        if self._closed:
            return
        self._closed = True
        for live in list(self._live.values()):
            self._abort(live)
        self._gate.close("the engine is closed; build a new one")
        hold, self._hold = self._hold, None
        if hold is not None:
            hold[1].set()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._control, self._stop)
        self._control.shutdown(wait=False)

    # ---- requests (event loop thread) ----------------------------------------------------
    def _bind(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._closed:
            raise EngineError(f"{self.name}: the engine is closed; build a new one")
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise EngineError(
                f"{self.name}: used from a second event loop; an engine serves the loop it "
                "was first used on"
            )
        return loop

    def _add(self, live: _Live, prompt: list[int]) -> None:
        manager = self._manager
        manager.register_result_handler(live.cb_id, lambda out: self._on_output(live, out))
        live.state = "running"
        self._by_cb[live.cb_id] = live
        added = manager.add_request(
            prompt,
            request_id=live.cb_id,
            max_new_tokens=live.cap,
            eos_token_id=sorted(live.stop) or -1,
        )
        if added is None:  # the manager refuses work once its thread stopped or crashed
            self._fail(live, self._dead())

    def _dead(self) -> EngineError:
        status = self._manager.background_thread_status
        why = status.fatal_error or "it was stopped"
        return EngineError(
            f"{self.name}: transformers' continuous-batching loop is not running ({why}); "
            "build a new engine"
        )

    def _on_output(self, live: _Live, out: Any) -> None:
        """The manager's result for ``live`` (on the loop thread), when it finished or failed."""
        if live.state == "done" or not out.is_finished():
            return
        if out.error is not None:
            self._fail(
                live,
                EngineError(
                    f"{self.name}: request {live.request.request_id!r} failed in transformers' "
                    f"continuous batching: {out.error}"
                ),
            )
            return
        with self._lock:
            tokens, logprobs, versions = list(live.tokens), list(live.logprobs), live.versions[:]
            live.state = "done"
        generated = [int(t) for t in out.generated_tokens]
        if generated != tokens:
            self._finish(
                live,
                error=EngineError(
                    f"{self.name}: request {live.request.request_id!r}: transformers returned "
                    f"tokens {generated[:8]}... but the sampler drew {tokens[:8]}...; a bug in "
                    "the adapter or an unsupported transformers version"
                ),
            )
            return
        reason: Literal["stop", "length"] = (
            "stop" if tokens and tokens[-1] in live.stop else "length"
        )
        self._finish(live, tokens, logprobs, versions, reason)

    def _abort(self, live: _Live) -> None:
        if live.state == "done":
            return
        with self._lock:
            was_running = live.state == "running"
            tokens, logprobs, versions = list(live.tokens), list(live.logprobs), live.versions[:]
            live.state = "done"
        if was_running:
            self._manager.cancel_request(live.cb_id)
            with self._manager.output_router._lock:  # no result is coming for a cancelled id
                self._manager.output_router.result_handlers.pop(live.cb_id, None)
        self._finish(live, tokens, logprobs, versions, "abort")

    def _fail(self, live: _Live, error: BaseException) -> None:
        with self._lock:
            live.state = "done"
        self._finish(live, error=error)

    def _finish(
        self,
        live: _Live,
        tokens: Sequence[int] = (),
        logprobs: Sequence[float] = (),
        versions: Sequence[Version] = (),
        reason: Literal["stop", "length", "abort"] = "abort",
        *,
        error: BaseException | None = None,
    ) -> None:
        self._by_cb.pop(live.cb_id, None)
        if not live.future.done():
            if error is not None:
                live.future.set_exception(error)
            else:
                try:
                    result = assemble(
                        live.request, tokens, logprobs, versions, reason, who=self.name
                    )
                except EngineError as exc:
                    live.future.set_exception(exc)
                else:
                    live.future.set_result(result)
        self._notify(live)
        if self._live.get(live.request.request_id) is live:
            self._forget(live)

    def _forget(self, live: _Live) -> None:
        del self._live[live.request.request_id]

    def _count(self, live: _Live) -> int:
        with self._lock:
            return len(live.request.resume_tokens) + len(live.tokens)

    def _notify(self, live: _Live) -> None:
        """Resolve the watchers of ``live`` whose count is reached (or all, once it ended)."""
        have = self._count(live)
        with self._lock:
            ready = [w for w in live.watchers if w[0] <= have or live.state == "done"]
            live.watchers = [w for w in live.watchers if w not in ready]
            self._watching -= len(ready)
        for _, future in ready:
            if not future.done():
                future.set_result(have)

    # ---- pausing and weights (worker threads) --------------------------------------------
    async def _hold_manager(self) -> None:
        """Hold the manager's pause from a thread of its own (its pause counter is per thread)
        until ``resume``; return once the generation loop is parked."""
        loop = asyncio.get_running_loop()
        parked: asyncio.Future[BaseException | None] = loop.create_future()
        release = threading.Event()
        manager = self._manager

        def hold() -> None:
            try:
                with manager.pause():
                    loop.call_soon_threadsafe(_settle, parked, None)
                    release.wait()
            except BaseException as exc:  # the loop is gone: nothing to hold
                loop.call_soon_threadsafe(_settle, parked, exc)

        thread = threading.Thread(target=hold, name=f"{self.name}-pause", daemon=True)
        thread.start()
        self._hold = (thread, release)
        error = await parked
        if error is not None:
            self._hold = None
            raise EngineError(f"{self.name}: cannot pause the generation loop: {error}") from error

    def _check_weights(self, weights: object) -> list[tuple[Tensor, Tensor]]:
        if isinstance(weights, str | bytes) or not isinstance(weights, Sequence):
            raise EngineError(
                f"{self.name}: weights must be a sequence of (name, tensor) pairs, got "
                f"{type(weights).__name__}"
            )
        own = dict(unique_named_tensors(self.model))
        aliases = {
            n for n, _ in self.model.named_parameters(remove_duplicate=False) if n not in own
        }
        staged: list[tuple[Tensor, Tensor]] = []
        seen: set[str] = set()
        for i, item in enumerate(weights):
            if not isinstance(item, tuple | list) or len(item) != 2:
                raise EngineError(f"{self.name}: weights[{i}] must be a (name, tensor) pair")
            name, tensor = item
            if name in aliases:
                raise EngineError(
                    f"{self.name}: {name!r} is tied to another parameter of this model (its "
                    "embedding); load it under the embedding's name only. Nothing was loaded"
                )
            if name not in own:
                raise EngineError(
                    f"{self.name}: unknown parameter {name!r} (the model has e.g. "
                    f"{sorted(own)[:3]}); use HF state_dict names. Nothing was loaded"
                )
            if name in seen:
                raise EngineError(f"{self.name}: {name!r} is given twice. Nothing was loaded")
            seen.add(name)
            target = own[name]
            if not isinstance(tensor, Tensor) or tuple(tensor.shape) != tuple(target.shape):
                raise EngineError(
                    f"{self.name}: {name!r} must be a tensor of shape {tuple(target.shape)}, got "
                    f"{type(tensor).__name__} {tuple(getattr(tensor, 'shape', ()))}. Nothing "
                    "was loaded"
                )
            if not tensor.is_floating_point() and target.is_floating_point():
                raise EngineError(
                    f"{self.name}: {name!r} has dtype {tensor.dtype}; give a floating tensor. "
                    "Nothing was loaded"
                )
            staged.append((target, tensor))
        return staged

    def _apply(self, staged: list[tuple[Tensor, Tensor]], version: int) -> None:
        def copy() -> None:
            with torch.no_grad():
                for target, tensor in staged:
                    target.copy_(tensor.to(device=target.device, dtype=target.dtype))
            self._version = version

        if self._manager.is_running():
            with self._manager.pause():
                copy()
                self._refill_running()
        else:
            copy()

    def _refill_running(self) -> None:
        """Under the manager's pause, right after a load: drop the KV cache of every request
        the manager runs (computed under the weights before the load) and queue each again,
        ahead of the requests not yet started, as prompt + tokens generated so far, so the next
        steps prefill that context under the new weights before its next token is sampled.
        The manager's own soft reset (``offloading_manager.py::offload_requests``); the
        request keeps its id, the sampler's records and its remaining token budget."""
        processor = getattr(self._manager, "batch_processor", None)
        if processor is None:  # the loop has not started: nothing runs
            return
        scheduler = processor.scheduler
        running = list(scheduler.active_requests.values())
        for state in reversed(running):  # appendleft: they keep their order, ahead of the rest
            again = state.create_equivalent_initial_request()
            state._status = self._request_status.FINISHED  # the old state is dropped
            scheduler.active_requests.pop(state.request_id)
            scheduler.cache.free_blocks(state.request_id, no_cache=True)  # never reused
            scheduler.waiting_requests[again.request_id] = again
            scheduler.waiting_requests_order.appendleft(again.request_id)
        # set when the cache ran full (offloading); nothing holds blocks now, and a set flag
        # with no request running would leave the queued requests waiting forever
        scheduler.block_new_requests = False

    def _stop(self) -> None:
        if self._manager.is_running():
            self._manager.stop(block=True, timeout=60)
        self._manager.destroy()

    # ---- the sampler (the manager's generation thread) -----------------------------------
    def _sample(self, cb_ids: Sequence[str], scores: Tensor) -> Tensor:
        """Draw each row's token (``scores [>= n, V]``, fp32 logits of the ``n`` requests in
        ``cb_ids``' order), record it, and return scores that put all the mass on it."""
        n = len(cb_ids)
        logits = scores[:n]
        rows = [self._by_cb.get(c) for c in cb_ids]
        temperature = torch.tensor([r.temperature if r else 0.0 for r in rows])
        top_k = torch.tensor([r.top_k if r else 0 for r in rows])
        top_p = torch.tensor([r.top_p if r else 1.0 for r in rows])
        filtered = filter_logits(logits, temperature, top_k, top_p)
        logp = torch.log_softmax(filtered, dim=-1)
        chosen = logits.argmax(dim=-1)  # greedy rows and rows of requests already ended
        sampled = [(i, r) for i, r in enumerate(rows) if r is not None and r.temperature > 0]
        if sampled:
            # one uniform per sampled row: a request with its own seed draws from its own
            # generator, the others take theirs in one draw from the engine's, in row order
            u = torch.empty(len(sampled), dtype=logp.dtype)
            shared = [j for j, (_, r) in enumerate(sampled) if r.generator is None]
            if shared:
                u[shared] = torch.rand(len(shared), generator=self._generator, dtype=u.dtype)
            for j, (_, r) in enumerate(sampled):
                if r.generator is not None:
                    u[j] = torch.rand(1, generator=r.generator, dtype=u.dtype)[0]
            index = torch.tensor([i for i, _ in sampled])
            cdf = logp[index].exp().cumsum(dim=-1)
            pick = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True)[:, 0]
            chosen[index] = pick.clamp(max=cdf.shape[1] - 1)
        picked = logp.gather(1, chosen.unsqueeze(1))[:, 0].tolist()
        tokens = chosen.tolist()
        version = self._version
        notify: list[_Live] = []
        with self._lock:
            for i, row in enumerate(rows):
                if row is None or row.state != "running":
                    continue
                row.tokens.append(tokens[i])
                row.logprobs.append(picked[i])
                row.versions.append(version)
                if row.watchers:
                    notify.append(row)
        if notify and self._loop is not None:
            for row in notify:
                self._loop.call_soon_threadsafe(self._notify, row)
        out = torch.full_like(scores, -math.inf)
        out[torch.arange(n), chosen] = 0.0
        return out


def _stop_unclosed(manager: Any) -> None:
    """``weakref.finalize`` of an engine that was never closed: ask its manager's thread to
    stop (without waiting: this may run in any thread, at any time)."""
    if manager.is_running():
        manager.stop(block=False)


def _kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token takes in every layer's cache."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(getattr(text, "num_attention_heads", 1))
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = getattr(text, "head_dim", None) or int(text.hidden_size) // heads
    layers = int(getattr(text, "num_hidden_layers", 1))
    size = torch.empty((), dtype=dtype).element_size()
    return max(1, 2 * layers * kv_heads * int(head_dim) * size)


def _settle(future: asyncio.Future[BaseException | None], value: BaseException | None) -> None:
    if not future.done():
        future.set_result(value)


def _make_sampler(cbl: Any, engine: HFInferenceEngine) -> Any:
    """The engine's per-request sampler as a ``ContinuousBatchingLogitsProcessor``: the
    manager calls ``prepare_tensor_args`` with the requests of a step (those about to get a
    token, in the order of the logits rows) before the forward, then ``__call__`` with those
    rows' logits (``input_outputs.py::prepare_batch_tensors``, ``model_runner.py::
    _forward_process_and_sample``; sync batching only, which the engine configures)."""

    class _Sampler(cbl.ContinuousBatchingLogitsProcessor):  # type: ignore[misc]
        supported_kwargs: ClassVar[dict[str, type]] = {}
        ignored_kwargs: ClassVar[tuple[str, ...]] = ()

        def __init__(self, owner: HFInferenceEngine) -> None:
            self.cb_ids: list[str] = []
            self.engine = weakref.ref(owner)  # the manager must not keep the engine alive

        def fill_defaults(self, int32_tensor: Tensor) -> None:
            int32_tensor.fill_(0)

        def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> Tensor:
            self.cb_ids = [f.state.request_id for f in requests_with_new_token]
            return torch.zeros(len(self.cb_ids), dtype=torch.int32)

        def __call__(self, scores: Tensor, tensor_arg: Tensor) -> Tensor:
            owner = self.engine()
            if owner is None:  # the engine is gone: its requests no longer matter
                return scores
            return owner._sample(self.cb_ids, scores)

    return _Sampler(engine)


__all__ = ["HFInferenceEngine"]
