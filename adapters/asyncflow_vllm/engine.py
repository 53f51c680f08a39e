"""``VLLMEngine``: the ``InferenceEngine`` protocol over vLLM's ``AsyncLLM``, in this process.

Written against vLLM 0.33.0 (``vllm/v1/engine/async_llm.py``, ``vllm/outputs.py``,
``vllm/sampling_params.py``, ``vllm/distributed/weight_transfer/``), and **not run live here**
(vLLM's wheel needs a CUDA GPU); ``tests/test_vllm_engine.py`` checks the mapping against a
fake shaped like ``AsyncLLM`` and ``pytest -m live_vllm`` runs the conformance suite on a real
one (``ASYNCFLOW_VLLM_MODEL``).

On Ascend NPUs it runs vLLM 0.26.0 with vllm-ascend 0.26.0rc1 (``compat.ASCEND``), whose
``AsyncLLM`` lacks 0.33's weight-version labels: outputs carry no ``weight_versions`` spans
(every token of a result is labelled with the version the adapter last committed),
``finish_weight_update`` takes no version, and the nccl/hccl ``init_info`` has no ``packed``
field (``compat.Features``). ``create(platform="npu")`` selects vllm-ascend's ``hccl``
weight-transfer backend (``npu_ipc`` when colocated).

What maps to what:

- ``generate``: ``AsyncLLM.generate(TokensPrompt(prompt_token_ids=prompt + resumed),
  SamplingParams(max_tokens=cap - resumed, logprobs=0, output_kind=FINAL_ONLY, ...),
  request_id)``; log-probs from ``CompletionOutput.logprobs[i][token].logprob``, versions
  from the final output's ``weight_versions`` spans, ``finish_reason`` as is (stop, length,
  abort; anything else is an ``EngineError``).
- ``abort``: ``AsyncLLM.abort(ids)``; vLLM ends the request with a final ``abort`` output
  that carries the tokens so far.
- ``pause("abort" | "keep")`` / ``resume``: ``pause_generation(mode=...)`` /
  ``resume_generation()``. New requests wait in the adapter while paused (vLLM rejects them
  in its abort mode).
- ``sleep(level)`` / ``wake_up``: ``sleep(level)`` / ``wake_up()`` (needs
  ``enable_sleep_mode=True``; vLLM's CPU worker ignores both).
- ``load_weights(weights, version)``: ``collective_rpc("load_weights_from_bytes", ...)`` of
  the worker extension (``worker_ext.py``; the tensors as ``[name, dtype, shape, bytes]``,
  since only msgpack-native values cross to the engine core), which calls each worker's
  ``model_runner.model.load_weights``; then ``reset_prefix_cache()`` and
  ``update_weight_version(str(version))``.
- ``GroupReceiver`` (for ``EngineGroupWeightSync`` / ``VLLMWeightSync``): the native weight
  transfer, ``init_weight_transfer_engine`` -> ``start_weight_update`` ->
  ``update_weights({"names", "dtype_names", "shapes"})`` -> ``finish_weight_update(version)``,
  or, on a vLLM without it, the worker-extension convention
  (``collective_rpc("init_weight_update_group" | "update_weight", ...)``, e.g.
  ``asyncflow_vllm.worker_ext.WeightUpdateExtension``).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import torch

from asyncflow_core.contracts.errors import ConfigError, EngineError
from asyncflow_core.contracts.protocols import GenerationRequest, GenerationResult, Version
from asyncflow_core.engines.enginekit import (
    PauseGate,
    abort_ids,
    assemble,
    check_request,
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
    Features,
    check_packing,
    check_vllm_version,
    packing_for,
    require_vllm,
)
from asyncflow_vllm.weightsync import WEIGHT_TRANSFER_BACKENDS, weight_transfer_backend
from asyncflow_vllm.worker_ext import EXTENSION, encode_weights


@dataclasses.dataclass(frozen=True)
class VLLMTypes:
    """The vLLM classes the adapter builds requests with. ``load()`` takes them from the
    installed vLLM (checking its version); tests pass stand-ins of the same shape."""

    version: str
    SamplingParams: Any
    TokensPrompt: Any
    final_only: Any
    """``vllm.sampling_params.RequestOutputKind.FINAL_ONLY``."""
    WeightTransferInitRequest: Any
    WeightTransferUpdateRequest: Any

    @classmethod
    def load(cls) -> VLLMTypes:
        import importlib

        vllm = require_vllm()
        sampling = importlib.import_module("vllm.sampling_params")
        base = importlib.import_module("vllm.distributed.weight_transfer.base")
        return cls(
            version=str(vllm.__version__),
            SamplingParams=vllm.SamplingParams,
            TokensPrompt=vllm.TokensPrompt,
            final_only=sampling.RequestOutputKind.FINAL_ONLY,
            WeightTransferInitRequest=base.WeightTransferInitRequest,
            WeightTransferUpdateRequest=base.WeightTransferUpdateRequest,
        )


class VLLMEngine:
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

    ``weight_group_ranks``: the engine's workers in a weight-sync group (default: its
    parallel config's world size times its data-parallel size).

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
    ) -> None:
        self.name = name
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
        self._inflight: set[str] = set()
        self._gate = PauseGate(name)
        self._native = callable(getattr(engine, "init_weight_transfer_engine", None))
        self._pause_has_mode = _has_parameter(getattr(engine, "pause_generation", None), "mode")
        finish = getattr(engine, "finish_weight_update", None)  # vLLM 0.26: no version argument
        self._finish_has_version = _has_parameter(finish, "weight_version")
        self._closed = False
        self.prefix_cache_reset_ok: bool | None = None
        """Whether the last weight load's prefix-cache reset succeeded (None: none yet)."""

    @classmethod
    async def create(
        cls,
        model: str,
        *,
        name: str = "vllm",
        platform: str | Platform | None = None,
        colocated: bool = False,
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
        ``VLLM_ASCEND_ENABLE_NZ=0``: the adapter sets it when unset and refuses another value."""
        chosen = current_platform() if platform is None else select_platform(platform)
        engine_args = engine_args_for(chosen, engine_args, colocated=colocated, who=name)
        types = VLLMTypes.load()
        import importlib

        arg_utils = importlib.import_module("vllm.engine.arg_utils")
        async_llm = importlib.import_module("vllm.v1.engine.async_llm")
        engine_args.setdefault("worker_extension_cls", EXTENSION)  # load_weights needs it
        args = arg_utils.AsyncEngineArgs(model=model, **engine_args)
        engine = async_llm.AsyncLLM.from_engine_args(args)
        adapter = cls(engine, name=name, owns_engine=True, types=types)
        await adapter.refresh_version()
        return adapter

    # -- InferenceEngine -----------------------------------------------------------------------
    @property
    def weight_version(self) -> Version:
        return self._version

    @property
    def weight_group_ranks(self) -> int:
        return self._ranks

    async def refresh_version(self) -> Version:
        """Read the engine's version label (``get_weight_version``) into ``weight_version``."""
        getter = getattr(self.engine, "get_weight_version", None)
        if callable(getter):
            self._version = parse_version(await getter(), who=self.name)
        return self._version

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self._usable()
        check_request(self.name, request, in_flight=self._inflight)
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
        self._inflight.add(rid)
        try:
            await self._gate.wait()
            prompt, remaining = continuation(request)
            if remaining == 0:
                return assemble(request, (), (), (), "length", who=self.name)
            return await self._run(request, prompt, remaining)
        finally:
            self._inflight.discard(rid)

    async def abort(self, request_ids: Sequence[str]) -> None:
        self._usable()
        live = [rid for rid in abort_ids(self.name, request_ids) if rid in self._inflight]
        if live:
            await self.engine.abort(live)

    # -- SupportsPause / SupportsSleep / SupportsLoadWeights ------------------------------------
    async def pause(self, mode: Literal["abort", "keep"] = "abort") -> None:
        self._usable()
        if mode not in ("abort", "keep"):
            raise EngineError(f"{self.name}: pause mode must be 'abort' or 'keep', got {mode!r}")
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

    async def resume(self) -> None:
        self._usable()
        await self.engine.resume_generation()
        self._gate.resume()

    async def sleep(self, level: int = 1) -> None:
        self._usable()
        if level not in (1, 2):
            raise EngineError(f"{self.name}: sleep level must be 1 or 2, got {level!r}")
        await self.engine.sleep(level)

    async def wake_up(self) -> None:
        self._usable()
        await self.engine.wake_up()

    async def load_weights(
        self, weights: Sequence[tuple[str, torch.Tensor]], version: Version
    ) -> None:
        self._usable()
        self._check_version(version)
        weights = list(weights)
        for i, item in enumerate(weights):
            if not (
                isinstance(item, tuple)
                and len(item) == 2
                and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)
            ):
                raise EngineError(
                    f"{self.name}: load_weights takes (name, tensor) pairs; item {i} is "
                    f"{describe(item, 80)}"
                )
        if weights:
            # By method name, the tensors as bytes: AsyncLLM reaches its workers only through
            # msgpack (worker_ext.py says what crosses it and what does not).
            try:
                await self._rpc("load_weights_from_bytes", (encode_weights(weights),))
            except EngineError:
                raise
            except Exception as exc:
                raise EngineError(
                    f"{self.name}: loading {len(weights)} tensors through collective_rpc("
                    f"'load_weights_from_bytes') failed: {exc}; the engine's workers need "
                    f"worker_extension_cls={EXTENSION!r} (VLLMEngine.create sets it), or send "
                    "the weights over a weight group (VLLMWeightSync)"
                ) from exc
            await self._reset_prefix_cache()
        await self._label(version)

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
        self._usable()
        if self._native:
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

    # -- internals -----------------------------------------------------------------------------
    def _usable(self) -> None:
        if self._closed:
            raise EngineError(f"{self.name} is closed; build a new engine")

    def _check_version(self, version: object) -> None:
        if not is_int(version) or version < 0:
            raise EngineError(f"{self.name}: version must be an int >= 0, got {version!r}")

    async def _label(self, version: Version) -> None:
        setter = getattr(self.engine, "update_weight_version", None)
        if callable(setter):
            await setter(str(version))
        self._version = version

    async def _rpc(self, method: str, args: tuple[Any, ...]) -> None:
        rpc = getattr(self.engine, "collective_rpc", None)
        if not callable(rpc):
            raise EngineError(
                f"{self.name}: this engine has neither the native weight-transfer API "
                "(init_weight_transfer_engine) nor collective_rpc; use vLLM >= 0.33"
            )
        await rpc(method, args=args)

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
            logprobs=0,
            detokenize=False,
            output_kind=self.types.final_only,
        )

    async def _run(
        self, request: GenerationRequest, prompt: list[int], remaining: int
    ) -> GenerationResult:
        rid = request.request_id
        prompt_obj = self.types.TokensPrompt(prompt_token_ids=prompt)
        last: Any = None
        stream = self.engine.generate(prompt_obj, self._sampling(request, remaining), rid)
        async for output in stream:
            last = output
        if last is None or not getattr(last, "outputs", None):
            raise EngineError(
                f"{self.name}: request {rid!r}: the engine's stream ended without an output "
                f"({describe(last)}); a malformed response"
            )
        out = last.outputs[0]
        tokens = [int(t) for t in out.token_ids]
        reason = finish_reason(out.finish_reason, who=self.name, rid=rid)
        logprobs = _sampled_logprobs(self.name, rid, tokens, out.logprobs)
        spans = [(s.version, s.start, s.end) for s in (getattr(out, "weight_versions", None) or ())]
        versions = versions_from_spans(spans, len(tokens), fallback=self._version, who=self.name)
        return assemble(request, tokens, logprobs, versions, reason, who=self.name)


def _sampled_logprobs(who: str, rid: str, tokens: list[int], logprobs: Any) -> list[float]:
    """``CompletionOutput.logprobs`` (one ``{token_id: Logprob}`` per position, or
    ``FlatLogprobs``, which indexes the same way) -> the sampled tokens' log-probs."""
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
                f"{who}: request {rid!r}: position {i} has no log-prob for the sampled token "
                f"{token} ({describe(position, 120)}); a malformed response"
            )
        out.append(float(entry.logprob))
    return out


def _engine_ranks(engine: Any) -> int:
    config = getattr(engine, "vllm_config", None)
    parallel = getattr(config, "parallel_config", None)
    if parallel is None:
        return 1
    world = getattr(parallel, "world_size", 1)
    dp = getattr(parallel, "data_parallel_size", 1)
    return int(world) * int(dp) if is_int(world) and is_int(dp) else 1


def engine_args_for(
    platform: Platform, engine_args: dict[str, Any], *, colocated: bool = False, who: str = "vllm"
) -> dict[str, Any]:
    """``engine_args`` (a copy) completed for ``platform`` as ``VLLMEngine.create`` uses them:
    ``logprobs_mode="processed_logprobs"`` and, on cuda / npu, ``weight_transfer_config``
    with the platform's backend, unless given; on npu, ``VLLM_ASCEND_ENABLE_NZ=0`` in the
    environment (set when unset; another value is a ``ConfigError``, environment unchanged)."""
    out = dict(engine_args)
    out.setdefault("logprobs_mode", "processed_logprobs")
    if "weight_transfer_config" not in out and platform.name in WEIGHT_TRANSFER_BACKENDS:
        backend = weight_transfer_backend(platform, colocated=colocated)
        out["weight_transfer_config"] = {"backend": backend}
    if platform.name == "npu":
        _weights_not_nz(who)
    return out


def _weights_not_nz(who: str) -> None:
    """vllm-ascend's worker refuses ``start_weight_update`` and ``wake_up`` while weights are
    kept in the NZ layout (``VLLM_ASCEND_ENABLE_NZ``, default 1; its ``worker/worker.py``)."""
    import os

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


__all__ = ["VLLMEngine", "VLLMTypes", "engine_args_for"]
