"""``SGLangEngine``: the ``InferenceEngine`` protocol over an in-process ``sglang.Engine``
(``sglang/srt/entrypoints/engine.py``), for a rollout worker that owns its GPUs.

``sglang.Engine``'s own weight and memory methods block on ``self.loop.run_until_complete``
and so cannot be called from a running event loop; this adapter calls the async
``TokenizerManager`` methods they wrap instead (``engine.tokenizer_manager``:
``tokenizer_control_mixin.py`` — each weight method takes an ``io_struct`` request and answers
``(success, message)``), and ``Engine.async_generate`` for generation. Pause, continue and
abort exist only on the tokenizer manager (``tokenizer_manager.py``: ``abort_request(rid,
abort_all)``, ``async pause_generation(PauseGenerationReqInput)``, ``async
continue_generation(ContinueGenerationReqInput)``); each is feature-detected, and a missing
one is an ``EngineError`` naming it.

The mapping is the HTTP adapter's (``asyncflow_sglang.http``): the same sampling fields, the
same log-probs and refusals (``wants_sampling_mask``; see **Log-probs** there: the engine must
not run with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``), the same answer (``read_output``),
version-only ``load_weights``, ``GroupReceiver`` methods. ``Engine.async_generate`` has no
``return_sampling_mask`` argument in SGLang 0.5.23 (``engine.py``), so a request that needs
the after-top-k log-probs is sent as ``async_generate`` sends it, with that field set:
``tokenizer_manager.generate_request(io_struct.GenerateReqInput(..., return_sampling_mask=True,
sampling_logprobs_mode="selected"), None).__anext__()``. The limits come from
``tokenizer_manager.server_args`` (``sampling_mask_max_tokens``, ``sampling_backend``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable, Sequence
from types import ModuleType
from typing import Any, ClassVar, Literal

import torch

from asyncflow_core.contracts.errors import AsyncFlowError, ConfigError, EngineError
from asyncflow_core.contracts.protocols import (
    GenerationRequest,
    GenerationResult,
    Version,
    WeightSync,
)
from asyncflow_core.engines.enginekit import (
    PauseGate,
    assemble,
    check_request,
    continuation,
    is_int,
    parse_version,
    require_module,
)
from asyncflow_core.sync.transports import GroupWire

from .compat import (
    INSTALL,
    NO_INFLIGHT_LOAD,
    NO_TENSOR_LOADS,
    SAMPLING_MASK_MAX_TOKENS,
    SEEDS_IGNORED,
    STALE_GROUP,
    STALE_SESSION,
    data_parallel_refusal,
    neutralizing,
    request_seed,
    require_sglang,
    same_group_settings,
)
from .group import DEFAULT_GROUP_NAME
from .http import (
    _SLEEP_TAGS,
    KeepMode,
    _Flight,
    abort_until_done,
    check_idle_for_sleep,
    join_fields,
    loopback_sglang_sync,
    mark_aborted,
    read_output,
    replacing_stale,
    sampling_params,
    wants_sampling_mask,
)

__all__ = ["SGLangEngine"]


class SGLangEngine:
    """``SGLangEngine(*, check_version=True, group_name=..., weight_backend="nccl",
    weight_group_ranks=None, keep_mode="retract", abort_wait_s=30, **server_args)`` builds
    ``sglang.Engine(**server_args)`` (``MissingExtraError`` without sglang, ``ConfigError``
    outside ``compat.TESTED``); ``SGLangEngine.from_engine(engine, io_struct=...)`` wraps an
    existing one (``io_struct``: the module with SGLang's request classes, default
    ``sglang.srt.managers.io_struct``). See the module docstring and ``SGLangHTTPEngine``
    for the semantics; ``shutdown()`` / ``close()`` stops the engine."""

    inflight_weight_load_refusal: ClassVar[str] = NO_INFLIGHT_LOAD
    """``RLConfig(weight_sync="inflight")`` is refused for this engine (see the reason)."""

    def __init__(
        self,
        *,
        check_version: bool = True,
        group_name: str = DEFAULT_GROUP_NAME,
        weight_backend: str = "nccl",
        weight_group_ranks: int | None = None,
        keep_mode: KeepMode = "retract",
        abort_wait_s: float = 30.0,
        flattened_bucket: bool = True,
        **server_args: Any,
    ) -> None:
        sglang = require_sglang(check=check_version)
        io_struct = require_module(
            "sglang.srt.managers.io_struct", who="asyncflow_sglang.SGLangEngine", install=INSTALL
        )
        engine = sglang.Engine(**server_args)
        self._setup(
            engine, io_struct, group_name, weight_backend, weight_group_ranks, keep_mode,
            abort_wait_s, flattened_bucket,
        )  # fmt: skip

    @classmethod
    def from_engine(
        cls,
        engine: Any,
        *,
        io_struct: ModuleType | Any = None,
        group_name: str = DEFAULT_GROUP_NAME,
        weight_backend: str = "nccl",
        weight_group_ranks: int | None = None,
        keep_mode: KeepMode = "retract",
        abort_wait_s: float = 30.0,
        flattened_bucket: bool = True,
    ) -> SGLangEngine:
        if io_struct is None:
            io_struct = require_module(
                "sglang.srt.managers.io_struct",
                who="asyncflow_sglang.SGLangEngine",
                install=INSTALL,
            )
        self = cls.__new__(cls)
        self._setup(
            engine, io_struct, group_name, weight_backend, weight_group_ranks, keep_mode,
            abort_wait_s, flattened_bucket,
        )  # fmt: skip
        return self

    def _setup(
        self,
        engine: Any,
        io_struct: Any,
        group_name: str,
        weight_backend: str,
        weight_group_ranks: int | None,
        keep_mode: KeepMode,
        abort_wait_s: float,
        flattened_bucket: bool = True,
    ) -> None:
        self.who = "SGLangEngine"
        if flattened_bucket not in (True, False):
            raise EngineError(f"{self.who}: flattened_bucket must be True or False")
        self.flattened_bucket = bool(flattened_bucket)
        if keep_mode not in ("retract", "in_place"):
            raise EngineError(f"{self.who}: keep_mode must be 'retract' or 'in_place'")
        if not hasattr(engine, "async_generate"):
            raise EngineError(
                f"{self.who}: {type(engine).__name__} has no async_generate; pass an sglang.Engine"
            )
        self.engine = engine
        self.io = io_struct
        self.group_name = group_name
        self.weight_backend = weight_backend
        self.keep_mode: KeepMode = keep_mode
        self.abort_wait_s = float(abort_wait_s)
        self._explicit_ranks = weight_group_ranks
        self._gate = PauseGate(self.who)
        self._inflight: dict[str, _Flight] = {}
        self._sleep_tags: list[str] | None = None
        self._asleep = False
        self._session_open = False  # a weight-update session we opened and did not end
        self._closed = False
        tm = getattr(engine, "tokenizer_manager", None)
        args = getattr(tm, "server_args", None)
        limit = getattr(args, "sampling_mask_max_tokens", None)
        self._mask_max_tokens = (
            int(limit) if is_int(limit) and limit >= 1 else SAMPLING_MASK_MAX_TOKENS
        )
        backend = getattr(args, "sampling_backend", None)
        self._sampling_backend = backend if isinstance(backend, str) else None
        # without it SGLang ignores sampling_seed (sampling_batch_info.py)
        self._seeds_ignored = getattr(args, "enable_deterministic_inference", None) is False
        # with it, an unseeded request gets seed 42 (compat.DETERMINISTIC_SEED)
        self._deterministic = getattr(args, "enable_deterministic_inference", None) is True
        self._seed_salt = os.urandom(16)
        self._server_pause: str | None = None  # the mode of the scheduler's pause, until resumed
        try:  # --preferred-sampling-params, merged under every request (tokenizer_manager.py)
            self._neutral = neutralizing(self.who, getattr(tm, "preferred_sampling_params", None))
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        config_value = getattr(tm, "config_value", None)
        raw = config_value("weight_version") if callable(config_value) else None
        self._version: Version = parse_version(raw, who=self.who)

    # ---- helpers ------------------------------------------------------------------------------
    def _tm_method(self, name: str) -> Any:
        tm = getattr(self.engine, "tokenizer_manager", None)
        method = getattr(tm, name, None)
        if not callable(method):
            raise EngineError(
                f"{self.who}: this sglang.Engine has no tokenizer_manager.{name}; this "
                "operation needs SGLang >=0.5.23,<0.6 (or use SGLangHTTPEngine on a server)"
            )
        return method

    def _req(self, cls_name: str, **fields: Any) -> Any:
        cls = getattr(self.io, cls_name, None)
        if cls is None:
            raise EngineError(f"{self.who}: sglang io_struct has no {cls_name}")
        return cls(**fields)

    async def _control(self, method: str, cls_name: str, **fields: Any) -> None:
        """``await tokenizer_manager.<method>(io_struct.<cls_name>(**fields), None)``, which
        answers ``(success, message)``."""
        call = self._tm_method(method)
        try:
            answer = await call(self._req(cls_name, **fields), None)
        except AsyncFlowError:
            raise
        except Exception as exc:
            raise EngineError(f"{self.who}: {method} failed: {exc}") from exc
        if isinstance(answer, tuple) and answer and answer[0] is not True:
            message = answer[1] if len(answer) > 1 else ""
            raise EngineError(f"{self.who}: {method} did not succeed: {message}")

    # ---- InferenceEngine ----------------------------------------------------------------------
    @property
    def weight_version(self) -> Version:
        return self._version

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        req = check_request(self.who, request, in_flight=self._inflight)
        if self._closed:
            raise EngineError(f"{self.who}: the engine is closed")
        if req.params.seed is not None and self._seeds_ignored:
            raise EngineError(
                f"{self.who}: request {req.request_id!r} has a seed, but {SEEDS_IGNORED}"
            )
        mask = wants_sampling_mask(
            req,
            who=self.who,
            mask_max_tokens=self._mask_max_tokens,
            sampling_backend=self._sampling_backend,
        )
        send = self._mask_sender() if mask else None
        rid = req.request_id
        flight = _Flight()
        self._inflight[rid] = flight
        try:
            await self._gate.wait()
            prompt, remaining = continuation(req)
            if flight.aborted:
                return assemble(req, [], [], [], "abort", who=self.who)
            if remaining == 0:
                return assemble(req, [], [], [], "length", who=self.who)
            flight.sent = True
            seed = request_seed(self._seed_salt, rid) if self._deterministic else None
            params = sampling_params(req, remaining, seed=seed, neutral=self._neutral)
            try:
                if send is None:
                    out = await self.engine.async_generate(
                        input_ids=prompt,
                        sampling_params=params,
                        return_logprob=True,
                        rid=rid,
                    )
                else:
                    out = await send(prompt, params, rid)
            except Exception as exc:
                if flight.was_aborted():
                    return assemble(req, [], [], [], "abort", who=self.who)
                raise EngineError(f"{self.who}: request {rid!r} failed: {exc}") from exc
            return read_output(req, out, fallback=self._version, who=self.who, sampling_mask=mask)
        finally:
            del self._inflight[rid]
            flight.done.set()

    def _mask_sender(self) -> Callable[[list[int], dict[str, Any], str], Awaitable[Any]]:
        """``send(input_ids, sampling_params, rid)``: one request with
        ``return_sampling_mask`` (mode ``"selected"``), as ``Engine.async_generate`` sends
        one (``engine.py``: ``tokenizer_manager.generate_request(GenerateReqInput(...),
        None).__anext__()``), since its 0.5.23 signature lacks the field. Looked up before
        the request is registered: an SGLang without them is an ``EngineError`` naming it."""
        generate_request = self._tm_method("generate_request")
        if getattr(self.io, "GenerateReqInput", None) is None:
            raise EngineError(
                f"{self.who}: sglang io_struct has no GenerateReqInput; top_k needs SGLang "
                ">=0.5.23,<0.6 (return_sampling_mask)"
            )

        async def send(input_ids: list[int], params: dict[str, Any], rid: str) -> Any:
            obj = self._req(
                "GenerateReqInput",
                input_ids=input_ids,
                sampling_params=params,
                return_logprob=True,
                rid=rid,
                return_sampling_mask=True,
                sampling_logprobs_mode="selected",
            )
            return await generate_request(obj, None).__anext__()

        return send

    async def abort(self, request_ids: Sequence[str]) -> None:
        targets = mark_aborted(self._inflight, self.who, request_ids)
        if not targets:
            return
        abort_request = self._tm_method("abort_request")

        async def send(rids: list[str]) -> None:
            for rid in rids:
                abort_request(rid=rid, abort_all=False)

        await abort_until_done(targets, send, self.abort_wait_s)

    # ---- SupportsPause ----------------------------------------------------------------------
    async def pause(self, mode: Literal["abort", "keep"] = "abort") -> None:
        if mode not in ("abort", "keep"):
            raise EngineError(f"{self.who}: pause mode must be 'abort' or 'keep', got {mode!r}")
        pause = self._tm_method("pause_generation")
        self._gate.pause()
        server_mode = "abort" if mode == "abort" else self.keep_mode
        await pause(self._req("PauseGenerationReqInput", mode=server_mode))
        self._server_pause = server_mode
        if mode == "abort":
            await self.abort([rid for rid, f in self._inflight.items() if f.sent])

    async def resume(self) -> None:
        cont = self._tm_method("continue_generation")
        await cont(self._req("ContinueGenerationReqInput"))
        self._server_pause = None
        self._gate.resume()

    # ---- SupportsSleep ----------------------------------------------------------------------
    async def sleep(self, level: int = 1) -> None:
        if not is_int(level) or level not in _SLEEP_TAGS:
            raise EngineError(f"{self.who}: sleep level must be 1 or 2, got {level!r}")
        if self._asleep:
            return
        check_idle_for_sleep(self.who, self._inflight, self._server_pause)
        tags = list(_SLEEP_TAGS[level])
        await self._control(
            "release_memory_occupation", "ReleaseMemoryOccupationReqInput", tags=tags
        )
        self._sleep_tags, self._asleep = tags, True

    async def wake_up(self) -> None:
        if not self._asleep:
            return
        await self._control(
            "resume_memory_occupation", "ResumeMemoryOccupationReqInput", tags=self._sleep_tags
        )
        self._sleep_tags, self._asleep = None, False

    tensor_load_refusal: ClassVar[str] = NO_TENSOR_LOADS
    """The RL job's default syncs reach this engine through ``own_weight_transport``."""

    def own_transport_refusal(self, engines: Sequence[Any]) -> str | None:
        """None when ``engines`` share their group settings: in-process engines' schedulers
        run on this host, so the group opens on loopback."""
        return same_group_settings(self.who, engines)

    def own_weight_transport(self, engines: Sequence[Any]) -> WeightSync:
        """``SGLangWeightSync`` into ``engines``, the trainer's side on 127.0.0.1."""
        refusal = self.own_transport_refusal(engines)
        if refusal is not None:
            raise ConfigError(refusal)
        return loopback_sglang_sync(self, engines)

    # ---- SupportsLoadWeights ------------------------------------------------------------
    async def load_weights(
        self, weights: Sequence[tuple[str, torch.Tensor]], version: Version
    ) -> None:
        """Version bump only (empty ``weights``); tensors come through ``SGLangWeightSync``."""
        if len(weights):
            raise EngineError(
                f"{self.who}: load_weights takes no tensors; send them with "
                "asyncflow_sglang.SGLangWeightSync (the GroupReceiver methods of this engine)"
            )
        await self.commit_weights(version)

    # ---- GroupReceiver ----------------------------------------------------------------------
    @property
    def weight_wire(self) -> GroupWire:
        """Each update as one flattened ``uint8`` bucket (``load_format=
        "flattened_bucket"``: ``srt/weight_sync/tensor_bucket.py``), else one tensor at a
        time (``flattened_bucket=False``)."""
        return GroupWire("flattened") if self.flattened_bucket else GroupWire()

    @property
    def weight_group_ranks(self) -> int:
        if self._explicit_ranks is not None:
            return self._explicit_ranks
        args = getattr(getattr(self.engine, "tokenizer_manager", None), "server_args", None)
        tp = getattr(args, "tp_size", None)
        pp = getattr(args, "pp_size", 1)
        refusal = data_parallel_refusal(self.who, getattr(args, "dp_size", 1))
        if refusal is not None:
            raise EngineError(refusal)
        if not is_int(tp) or tp < 1 or pp != 1:
            raise EngineError(
                f"{self.who}: cannot tell the engine's weight-group ranks (tp_size={tp!r}, "
                f"pp_size={pp!r}); pass weight_group_ranks="
            )
        return tp

    async def join_weight_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int
    ) -> None:
        args = getattr(getattr(self.engine, "tokenizer_manager", None), "server_args", None)
        refusal = data_parallel_refusal(self.who, getattr(args, "dp_size", 1))
        if refusal is not None:
            raise EngineError(refusal)
        fields = join_fields(self, master_address, master_port, rank_offset, world_size)
        await replacing_stale(
            lambda: self._control(
                "init_weights_update_group", "InitWeightsUpdateGroupReqInput", **fields
            ),
            self.leave_weight_group,
            STALE_GROUP,
        )

    async def begin_weight_update(self) -> None:
        """Open the weight-update session SGLang 0.5.23 requires around
        ``update_weights_from_distributed`` (``tokenizer_control_mixin.py``,
        ``begin_weight_update``; refused outside one by ``scheduler_components/
        weight_updater.py``, ``WeightUpdater.update_weights_from_distributed``). A session a
        failed sync left open is ended first, and so is one another client left (a trainer
        that died mid-sync: ``compat.STALE_SESSION``), once."""
        if self._session_open:
            with contextlib.suppress(EngineError):  # the begin below tells the truth
                await self._end_session()
        await replacing_stale(
            lambda: self._control(
                "begin_weight_update", "BeginWeightUpdateReqInput", selector="all"
            ),
            self._end_session,
            (STALE_SESSION,),
        )
        self._session_open = True

    async def _end_session(self) -> None:
        """``end_weight_update``: closes the session, runs the runners' post-load step."""
        self._session_open = False
        await self._control("end_weight_update", "EndWeightUpdateReqInput")

    async def receive_weights(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
    ) -> None:
        await self._control(
            "update_weights_from_distributed",
            "UpdateWeightsFromDistributedReqInput",
            names=list(names),
            dtypes=list(dtypes),
            shapes=[[int(d) for d in s] for s in shapes],
            group_name=self.group_name,
            flush_cache=True,
            **({"load_format": "flattened_bucket"} if self.flattened_bucket else {}),
        )

    async def commit_weights(self, version: Version) -> None:
        if not is_int(version) or version < 0:
            raise EngineError(f"{self.who}: version must be an int >= 0, got {version!r}")
        if self._session_open:
            await self._end_session()
        update = self._tm_method("update_weight_version")
        req = self._req(
            "UpdateWeightVersionReqInput", new_version=str(version), abort_all_requests=False
        )
        try:
            await update(req)
        except Exception as exc:
            raise EngineError(f"{self.who}: update_weight_version failed: {exc}") from exc
        self._version = version

    async def leave_weight_group(self) -> None:
        await self._control(
            "destroy_weights_update_group",
            "DestroyWeightsUpdateGroupReqInput",
            group_name=self.group_name,
        )

    async def close(self) -> None:
        """Shut the engine down (``sglang.Engine.shutdown``). Safe to repeat."""
        if self._closed:
            return
        self._closed = True
        self._gate.close("the engine is closed")
        shutdown = getattr(self.engine, "shutdown", None)
        if callable(shutdown):
            await asyncio.to_thread(shutdown)
