"""``VLLMHTTPEngine``: AsyncFlow's ``InferenceEngine`` over a running ``vllm serve``, through
its HTTP routes only (no vLLM, no CUDA on the client: ``pip install 'asyncflow[vllm-client]'``).

Start the server with the development routes, the scale-out routes and the NCCL
weight-transfer engine::

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --enable-scale-out \\
        --weight-transfer-config '{"backend":"nccl"}' --logprobs-mode processed_logprobs

(``--enable-scale-out``: vLLM 0.33 mounts ``/inference/v1/generate``, the only route this
adapter generates through, only with it or ``--tokens-only``, and otherwise answers it 403
"Scale-out endpoints are disabled" — ``entrypoints/scale_out/factories.py``,
``register_scale_out_api_routers``; releases between 0.26 and 0.33 may not mount it at all,
404. vLLM 0.26.0 mounts it unconditionally and has no such flag.)

(``processed_logprobs`` makes the reported log-probs those of the sampling distribution,
temperature included, as AsyncFlow's trainers compute them; vLLM's default ``raw_logprobs``
reports the model's distribution before temperature — ``vllm/config/model.py``
``ModelConfig.logprobs_mode``.)

On Ascend NPUs (vLLM 0.26.0 with vllm-ascend 0.26.0rc1, ``compat.ASCEND``) the weight-transfer
backend is HCCL, and FRACTAL_NZ weights must be off: vllm-ascend's NPU worker refuses
``start_weight_update`` unless ``VLLM_ASCEND_ENABLE_NZ=0`` (it defaults to 1), and ``wake_up``
unless its ``weight_nz_mode`` is 0 (taken from that variable unless ``--additional-config``
sets ``weight_nz_mode``) — ``vllm_ascend/worker/worker.py``, ``ascend_config.py``::

    VLLM_ASCEND_ENABLE_NZ=0 VLLM_SERVER_DEV_MODE=1 vllm serve MODEL \\
        --weight-transfer-config '{"backend":"hccl"}' --logprobs-mode processed_logprobs

(vllm-ascend registers the ``hccl`` and ``npu_ipc`` backends, and also points ``nccl`` at its
HCCL engine, so ``{"backend":"nccl"}`` works there too.)

Routes, bodies and answers follow vLLM 0.33.0's source (paths relative to ``vllm/``):

- generate: ``POST /inference/v1/generate`` (``entrypoints/scale_out/token_in_token_out/
  api_router.py``; request/response models in its ``protocol.py``: ``GenerateRequest``
  ``{request_id, token_ids, sampling_params, ...}``, ``GenerateTokensResponse.choices[0]``
  ``{token_ids, logprobs.content[i].{token_id, logprob}, finish_reason, weight_versions}``).
  Chosen over ``/v1/completions`` because it is the only route whose answer carries the token
  ids, the per-token log-probs *and* the ``WeightVersionSpan`` list (``vllm/outputs.py``);
  completions answers carry no weight-version spans. The server prefixes the id:
  ``serving.py`` ``serve_tokens`` runs the request as ``"generate-tokens-" + request_id``
  (unless an ``X-Request-Id`` header overrides it; this adapter sends none), and that
  external id is what ``/abort_requests`` takes. An aborted request's non-streaming answer
  holds every token generated so far with ``finish_reason "abort"``
  (``v1/engine/output_processor.py`` ``OutputProcessor.abort_requests`` puts a final output;
  ``_new_completion_output`` returns the cumulative token ids in ``FINAL_ONLY`` mode).
- dev-mode RL routes (``entrypoints/rl/online/api_router.py``, mounted only with
  ``VLLM_SERVER_DEV_MODE=1`` by ``entrypoints/launchers/api_server/routers.py``):
  ``/pause?mode=``, ``/resume``, ``/abort_requests {"request_ids"}`` (an empty list aborts
  everything — never sent here), ``/init_weight_transfer_engine {"init_info"}``,
  ``/start_weight_update``, ``/update_weights {"update_info"}``,
  ``/finish_weight_update {"weight_version"}``, ``/shutdown_weight_transfer_engine``,
  ``/update_weight_version {"new_version"}``, ``GET /weight_info``, ``GET /get_world_size``.
- sleep: ``/sleep?level=&mode=``, ``/wake_up?tags=``, ``GET /is_sleeping``
  (``entrypoints/serve/dev/sleep/api_router.py``); ``/reset_prefix_cache``
  (``entrypoints/serve/dev/cache/api_router.py``); ``GET /version``
  (``entrypoints/serve/instrumentator/basic.py``).

vLLM 0.26.0 (``Features.of(version).weight_version_label`` / ``packed_init`` False; its RL
routes live in ``entrypoints/serve/dev/rlhf/api_router.py``) serves the same routes with the
same answers except: no ``GET /weight_info``, ``POST /update_weight_version`` or
``POST /shutdown_weight_transfer_engine`` (404); ``/finish_weight_update`` reads no body (no
``weight_version``); ``/sleep`` and ``/wake_up`` answer 200 with an empty body
(``entrypoints/serve/dev/sleep/api_router.py``); a generate choice is ``{index, logprobs,
finish_reason, token_ids, routed_experts}`` without ``weight_versions``, its log-prob entries
``{token: "token_id:N", logprob, bytes, top_logprobs}`` without ``token_id``
(``token_in_token_out/{protocol,serving}.py``); the nccl (and vllm-ascend's hccl) ``init_info``
takes only ``master_address, master_port, rank_offset, world_size`` — any other key, such as
``packed``, fails with "Invalid init_info" (``distributed/weight_transfer/base.py``
``parse_init_info``); and a new request while paused is queued, not rejected.

Weights, two ways:

- over vLLM's NCCL group (a GPU): ``EngineGroupWeightSync`` drives this class's
  ``GroupReceiver`` methods while the trainer broadcasts (``distributed/weight_transfer/
  nccl_engine.py``, packed or one broadcast per tensor);
- through ``load_weights`` (a CPU, where vLLM has no weight-transfer backend; any platform):
  the worker extension's checked, pieced load (``worker_ext.py``) over the dev-mode
  ``POST /collective_rpc {"method", "args"}`` (``entrypoints/serve/dev/rpc/api_router.py``),
  the arguments JSON text and the bytes base64. The route runs any worker method by name for
  whoever reaches the port, so this path is taken only for a server on loopback unless
  ``weight_rpc=True`` says otherwise (``SECURITY.md``). The server needs
  ``--worker-extension-cls asyncflow_vllm.worker_ext.WeightUpdateExtension``.

What the server offers is read from the server itself at ``connect()``: its routes
(``GET /openapi.json``) and its config (dev-mode ``GET /server_info?config_format=json``:
device, sleep mode, log-prob mode, worker extension, weight-transfer backend), so a CPU
server's missing sleep and NCCL are declared (``unavailable_abilities``) and a server started
without ``--logprobs-mode processed_logprobs`` is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import urllib.parse
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import torch

from asyncflow_core.contracts.errors import ConfigError, EngineError, UnsupportedEngineError
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
from asyncflow_core.infra.httpclient import JsonClient
from asyncflow_core.infra.platform import is_loopback_literal
from asyncflow_core.sync.transports import GroupWire
from asyncflow_vllm.compat import (
    INSTALL_CLIENT,
    NO_INFLIGHT_LOAD,
    PACKED_BUFFER_BYTES,
    PACKED_NUM_BUFFERS,
    STALE_WEIGHT_UPDATE,
    EngineFacts,
    Features,
    check_packing,
    check_vllm_version,
    packing_for,
)
from asyncflow_vllm.weightsync import OwnVLLMTransport
from asyncflow_vllm.worker_ext import LoadReport, extension_refusal, send_weights

HTTP_PIECE_BYTES = 16 << 20
"""Tensor bytes per ``/collective_rpc`` call of a ``load_weights`` (base64 in JSON: ~1.33x that
on the wire)."""

__all__ = [
    "DEV_MODE_HINT",
    "HTTP_PIECE_BYTES",
    "REQUEST_ID_PREFIX",
    "SCALE_OUT_HINT",
    "VLLMHTTPEngine",
]

DEV_MODE_HINT = (
    "the route is missing: start vllm serve with VLLM_SERVER_DEV_MODE=1 (the RL, sleep and "
    "cache routes exist only then), --enable-scale-out (vLLM 0.33 serves "
    "/inference/v1/generate only then; 0.26 has no such flag) and --weight-transfer-config "
    '\'{"backend":"nccl"}\' (on Ascend: \'{"backend":"hccl"}\' and VLLM_ASCEND_ENABLE_NZ=0), '
    "and check base_url"
)

SCALE_OUT_HINT = (
    "vLLM 0.33 refuses /inference/v1/generate (the scale-out tokens route this adapter "
    "generates through) unless vllm serve runs with --enable-scale-out (or --tokens-only): "
    "restart the server with --enable-scale-out"
)

REQUEST_ID_PREFIX = "generate-tokens-"
"""vLLM runs a ``/inference/v1/generate`` request under this prefix + its ``request_id``
(``entrypoints/scale_out/token_in_token_out/serving.py``, ``serve_tokens``)."""

_PAUSED_MARK = "paused"  # vLLM's RequestError "Generation is paused..." (v1/engine/core.py)
_TOKEN_LABEL = re.compile(r"token_id:(\d+)", re.ASCII)  # 0.26's logprob "token" (serving.py)


class VLLMHTTPEngine(OwnVLLMTransport):
    """``InferenceEngine`` + ``SupportsPause`` + ``SupportsSleep`` + ``SupportsLoadWeights``
    + ``GroupReceiver`` over one ``vllm serve`` (``base_url``, e.g. ``http://127.0.0.1:8000``).

    ``await engine.connect()`` (run by the first call otherwise; safe to repeat) reads
    ``GET /version`` and raises ``ConfigError`` outside ``compat.TESTED`` and
    ``compat.ASCEND`` unless ``check_server_version=False``; decides ``features``
    (``compat.Features.of`` that version); reads the weight version (``GET /weight_info``,
    where the server has it) and, unless ``weight_group_ranks`` is given, how many ranks the
    server's workers take in a weight group (``GET /get_world_size``: TP x PP x DP).
    ``weight_group_ranks`` needs ``connect()`` (or the constructor argument) before
    ``EngineGroupWeightSync.init``.

    **A vLLM 0.26 server** (vllm-ascend 0.26.0rc1; ``features.weight_version_label`` False —
    also any version outside ``compat.TESTED`` reached with ``check_server_version=False``)
    keeps no weight-version label, so this class keeps the version itself: it starts at 0
    (no ``/weight_info``), ``commit_weights(v)`` and ``load_weights((), v)`` set it here only
    (no ``/update_weight_version``; ``/finish_weight_update`` gets no body), and every token of
    an answer is labelled with the version this client knows when the answer arrives, not with
    per-token ``weight_versions`` spans (0.26 sends none; any spans such a server sent would
    carry a label nobody set, and are ignored). What that costs: a request that straddles a
    weight update reports the newer version for all its tokens (an upper bound; exact when
    generation is paused across the update, as ``BlockingUpdate`` does), and the server
    carries no engine-side label, so another client of the same server (or this one after a
    restart) cannot read the version back. ``leave_weight_group`` sends nothing (no
    ``/shutdown_weight_transfer_engine``: the server keeps its side of the group until it
    exits or joins another); ``init_info`` carries no ``packed`` (0.26 rejects the key);
    ``/sleep`` and ``/wake_up`` answer with an empty body, so after ``wake_up(tags)`` the
    engine asks ``GET /is_sleeping`` whether it is fully awake.

    ``timeout_s`` bounds a generate call, ``control_timeout_s`` every other route (a weight
    group join or a weight update waits for the trainer's broadcast). ``ignore_eos``: by
    default vLLM ends a request at the model's EOS too (``finish_reason "stop"``, EOS
    included); True ends it only at ``stop_token_ids`` and ``max_tokens``. ``vocab_size`` /
    ``max_model_len``, when given, are checked before sending. ``sleep_mode`` is the pause mode
    ``/sleep`` applies to requests in flight (vLLM's default ``"abort"``). After a weight
    commit ``/reset_prefix_cache?reset_running_requests=true`` runs
    (``reset_prefix_cache_on_commit``), so no new request reuses KV cached under the old
    weights; requests running or frozen by ``pause("keep")`` are preempted by it and recompute
    their KV under the new weights when they go on (their tokens so far are kept).
    ``prefix_cache_reset_ok`` is False when vLLM refused all the same.

    ``load_weights`` with tensors goes through ``/collective_rpc`` and the worker extension
    (module docstring) when the server has the route and the extension, and is on loopback or
    ``weight_rpc=True``; ``weight_rpc=False`` never sends tensors. ``tensor_load_refusal``
    says why tensors cannot go (known once connected); ``piece_bytes`` bounds one call.
    ``unavailable_abilities``: abilities the server has routes for but cannot use (on a CPU:
    ``SupportsSleep``, which vLLM's CPU worker ignores while reporting itself asleep, and
    ``GroupReceiver``, no weight-transfer backend); their calls raise ``EngineError``.

    Errors: a server down or too slow is ``EngineUnavailableError``; an HTTP error quotes
    the server's message (404 adds ``DEV_MODE_HINT``, 403 ``SCALE_OUT_HINT``); an answer
    without the documented keys is an ``EngineError`` saying "malformed". Requests are
    checked (``check_request``) before anything is sent, so a rejected request changes
    nothing.
    """

    _own_transport_servers: ClassVar[bool] = True  # OwnVLLMTransport: servers on loopback

    inflight_weight_load_refusal: ClassVar[str] = NO_INFLIGHT_LOAD
    """``RLConfig(weight_sync="inflight")`` is refused for this engine (see the reason)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        control_timeout_s: float = 300.0,
        connect_timeout_s: float = 10.0,
        check_server_version: bool = True,
        weight_group_ranks: int | None = None,
        model: str | None = None,
        api_key: str | None = None,
        ignore_eos: bool = False,
        vocab_size: int | None = None,
        max_model_len: int | None = None,
        sleep_mode: Literal["abort", "wait", "keep"] = "abort",
        reset_prefix_cache_on_commit: bool = True,
        weight_packing: bool | None = None,
        packed_buffer_bytes: int = PACKED_BUFFER_BYTES,
        weight_rpc: bool | None = None,
        piece_bytes: int = HTTP_PIECE_BYTES,
        name: str | None = None,
    ) -> None:
        self.name = name or f"VLLMHTTPEngine({base_url})"
        who = self.name
        if weight_rpc not in (None, True, False):
            raise EngineError(f"{who}: weight_rpc must be None, True or False, got {weight_rpc!r}")
        if not is_int(piece_bytes) or piece_bytes < 1:
            raise EngineError(f"{who}: piece_bytes must be an int >= 1, got {piece_bytes!r}")
        self.weight_rpc = weight_rpc
        self.piece_bytes = int(piece_bytes)
        check_packing(who, weight_packing, packed_buffer_bytes)
        self._weight_packing = weight_packing
        self._packed_bytes = int(packed_buffer_bytes)
        if weight_group_ranks is not None and (
            not is_int(weight_group_ranks) or weight_group_ranks < 1
        ):
            raise EngineError(
                f"{who}: weight_group_ranks must be None (read /get_world_size) or an int "
                f">= 1, got {weight_group_ranks!r}"
            )
        for field, value in (("vocab_size", vocab_size), ("max_model_len", max_model_len)):
            if value is not None and (not is_int(value) or value < 1):
                raise EngineError(f"{who}: {field} must be None or an int >= 1, got {value!r}")
        if sleep_mode not in ("abort", "wait", "keep"):
            raise EngineError(f"{who}: sleep_mode must be abort, wait or keep; got {sleep_mode!r}")
        for field, limit in (("timeout_s", timeout_s), ("control_timeout_s", control_timeout_s)):
            if not isinstance(limit, int | float) or not 0 < limit < math.inf:
                raise EngineError(f"{who}: {field} must be a number > 0, got {limit!r}")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._client = JsonClient(
            base_url,
            who=who,
            timeout_s=float(control_timeout_s),
            connect_timeout_s=connect_timeout_s,
            install=INSTALL_CLIENT,
            hints={403: SCALE_OUT_HINT, 404: DEV_MODE_HINT},
            headers=headers,
        )
        self.base_url = self._client.base_url
        self.timeout_s = float(timeout_s)
        self.control_timeout_s = float(control_timeout_s)
        self.check_server_version = bool(check_server_version)
        self.model = model
        self.ignore_eos = bool(ignore_eos)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.sleep_mode = sleep_mode
        self.reset_prefix_cache_on_commit = bool(reset_prefix_cache_on_commit)
        self.server_version: str | None = None
        self.prefix_cache_reset_ok = True
        self._ranks = weight_group_ranks
        self._features: Features | None = None
        self._version: Version = 0
        self._connected = False
        self._connect_lock: asyncio.Lock | None = None
        self._gate = PauseGate(who)
        self._asleep = False
        self._closed = False
        self._requests = InFlight()
        self._sent: set[str] = set()
        self.facts = EngineFacts()
        """What the server said about itself at ``connect()`` (``compat.EngineFacts``)."""
        self.last_load: LoadReport | None = None
        """The last ``load_weights`` with tensors: sizes, calls, seconds."""

    # ---- properties ----------------------------------------------------------------------
    @property
    def weight_version(self) -> Version:
        return self._version

    @property
    def weight_group_ranks(self) -> int:
        if self._ranks is None:
            raise EngineError(
                f"{self.name}: weight_group_ranks is not known yet; await engine.connect() "
                "first (it reads GET /get_world_size) or pass weight_group_ranks= to the "
                "constructor"
            )
        return self._ranks

    @property
    def weight_wire(self) -> GroupWire:
        """How the trainer's broadcasts must arrive: vLLM 0.33's packed ``uint8`` chunks
        (``weight_packing``: None packs when the server's vLLM can, the default; the trainer
        must use the same ``packed_buffer_bytes``), else one tensor at a time. Known once
        connected (the server's release decides)."""
        if self._features is None:
            raise EngineError(
                f"{self.name}: the weight wire is not known yet; await engine.connect() first "
                "(the server's vLLM release decides whether syncs are packed)"
            )
        if packing_for(self.name, self._weight_packing, self._features):
            return GroupWire("packed", self._packed_bytes)
        return GroupWire()

    @property
    def features(self) -> Features | None:
        """What the server's vLLM release offers (``compat.Features``), decided by
        ``connect()`` from ``GET /version``; None before."""
        return self._features

    @property
    def paused(self) -> bool:
        return self._gate.paused

    @property
    def unavailable_abilities(self) -> dict[str, str]:
        """Abilities the server cannot use where it runs, with the reason (class docstring);
        empty before ``connect()``."""
        return self.facts.unavailable()

    @property
    def tensor_load_refusal(self) -> str | None:
        """Why ``load_weights`` cannot take tensors from here, or None: it can, or it is not
        known yet (``connect()`` first)."""
        if not self._connected:
            return None
        if self.weight_rpc is False:
            return "weight_rpc=False: this client sends no tensors"
        if self.facts.routes and "/collective_rpc" not in self.facts.routes:
            return (
                "the server has no /collective_rpc route: start vllm serve with "
                "VLLM_SERVER_DEV_MODE=1"
            )
        refusal = extension_refusal(self.facts.extension)
        if refusal is not None:
            return f"the server's {refusal}"
        if self.weight_rpc is None and not is_loopback_literal(
            urllib.parse.urlsplit(self.base_url).hostname or ""
        ):
            return (
                f"the server ({self.base_url}) is not on loopback, and /collective_rpc runs any "
                "worker method for whoever reaches the port: keep such a server on loopback, "
                "or pass weight_rpc=True if its port is reachable by the trainer only"
            )
        return None

    @property
    def asleep(self) -> bool:
        return self._asleep

    # ---- connection ----------------------------------------------------------------------
    async def connect(self) -> None:
        """Check the server's vLLM version, read its weight version and weight-group size.
        A failure leaves the engine unconnected (the next call tries again)."""
        self._usable()
        if self._connected:
            return
        if self._connect_lock is None:
            self._connect_lock = asyncio.Lock()
        async with self._connect_lock:
            await self._connect_once()

    async def _connect_once(self) -> None:
        if self._connected:  # another call connected while this one waited for the lock
            return
        data = await self._get("/version")
        version = self._key(data, "version", "GET /version")
        if not isinstance(version, str):
            raise self._malformed("GET /version", data)
        if self.check_server_version:
            try:
                check_vllm_version(version)
            except ConfigError as exc:  # the server's answer: an engine error too
                raise UnsupportedEngineError(str(exc)) from None
        features = Features.of(version)
        if features.weight_version_label:
            info = await self._get("/weight_info")
            current = parse_version(
                self._key(info, "weight_version", "GET /weight_info"), who=self.name
            )
        else:  # vLLM 0.26: no /weight_info, no label on the server; the version is kept here
            current = self._version
        ranks = self._ranks
        if ranks is None:
            sizes = await self._get("/get_world_size")
            size = self._key(sizes, "world_size", "GET /get_world_size")
            if not is_int(size) or size < 1:
                raise self._malformed("GET /get_world_size", sizes)
            ranks = size
        facts = await self._facts()
        if facts.logprobs_mode not in (None, "processed_logprobs"):
            raise UnsupportedEngineError(
                f"{self.name}: the server runs with --logprobs-mode {facts.logprobs_mode}; "
                "AsyncFlow needs the log-probs of the distribution it samples from: restart it "
                "with --logprobs-mode processed_logprobs"
            )
        self.server_version = version
        self._features = features
        self._version = current
        self._ranks = ranks
        self.facts = facts
        self._connected = True

    async def _facts(self) -> EngineFacts:
        """The server's routes (``GET /openapi.json``) and config (dev-mode ``GET /server_info
        ?config_format=json``), where it serves them; what it does not serve stays unknown."""
        routes: frozenset[str] = frozenset()
        with contextlib.suppress(EngineError):
            spec = await self._get("/openapi.json")
            paths = spec.get("paths") if isinstance(spec, dict) else None
            if isinstance(paths, dict):
                routes = frozenset(str(p) for p in paths)
        if routes and "/server_info" not in routes:
            return EngineFacts(routes=routes)
        try:
            info = await self._client.call(
                "GET",
                "/server_info",
                params={"config_format": "json"},
                timeout_s=self.control_timeout_s,
            )
        except EngineError:
            return EngineFacts(routes=routes)
        config = info.get("vllm_config") if isinstance(info, dict) else None
        if not isinstance(config, dict):
            return EngineFacts(routes=routes)
        return EngineFacts.from_config(config, routes)

    async def close(self) -> None:
        """Release the HTTP session; requests waiting on a pause fail. Final; safe to repeat.
        The server keeps running (and keeps any request still in flight there)."""
        if self._closed:
            return
        self._closed = True
        self._gate.close("the engine is closed; build a new one")
        await self._client.close()

    # ---- InferenceEngine -----------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """``POST /inference/v1/generate`` with the prompt (+ resumed tokens), ``logprobs=0``
        and the request's sampling knobs; waits while paused (vLLM rejects new requests in
        its ``abort``/``wait`` pause modes)."""
        self._usable()
        request = check_request(
            self.name,
            request,
            in_flight=self._requests,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
        )
        if self._asleep:
            raise EngineError(
                f"{self.name}: the engine is asleep (sleep() released its GPU memory) and "
                f"takes no new requests; call wake_up() before generate() (request "
                f"{request.request_id!r})"
            )
        rid = request.request_id
        self._requests.start(rid)
        try:
            await self.connect()
            return await self._generate(request)
        finally:
            self._sent.discard(rid)
            self._requests.end(rid)

    async def abort(self, request_ids: Sequence[str]) -> None:
        """``POST /abort_requests {"request_ids": ["generate-tokens-<id>", ...]}`` for the
        named requests this engine has sent (unknown ids are ignored; an empty list is never
        sent, since vLLM reads it as "abort everything"; one not sent yet is never sent).
        vLLM drops an abort for a request it has not registered yet (``v1/engine/
        output_processor.py``, ``abort_requests``), which one sent a moment ago may be: the
        abort goes again until the requests end (``enginekit.InFlight``); returns once their
        ``generate`` calls returned (bounded by ``control_timeout_s``)."""
        requested = abort_ids(self.name, request_ids)
        self._usable()
        await self._requests.abort(requested, self._abort_sent, timeout_s=self.control_timeout_s)

    async def _abort_sent(self, ids: Sequence[str]) -> None:
        remote = [rid for rid in ids if rid in self._sent]
        if remote:
            await self._abort_remote(remote)

    # ---- SupportsPause -------------------------------------------------------------------
    async def pause(self, mode: Literal["abort", "keep"] = "abort") -> None:
        """``POST /pause?mode=abort|keep``: ``abort`` ends requests in flight (their
        ``generate`` returns ``"abort"`` with the tokens so far; one the server did not have
        yet, queued by 0.32 or turned away by 0.33 until resume, is aborted too), ``keep``
        freezes them; new requests wait here until ``resume``."""
        if mode not in ("abort", "keep"):
            raise EngineError(f"{self.name}: pause mode must be 'abort' or 'keep', got {mode!r}")
        self._usable()
        await self.connect()
        was_paused = self._gate.paused
        in_flight = self._requests.ids()  # new requests from here on wait for resume
        self._gate.pause()
        try:
            # keep: clear_cache=false, or vLLM resets its caches and preempts the frozen
            # requests (v1/engine/core.py, EngineCore._finish_pause; the route's docstring
            # calls the flag ignored for keep, the code does not ignore it)
            params = {"mode": mode, **({"clear_cache": "false"} if mode == "keep" else {})}
            data = await self._post("/pause", params=params)
            self._expect(data, "status", "paused", "POST /pause")
        except BaseException:  # a malformed answer too: new requests must not wait forever
            if not was_paused:
                self._gate.resume()
            raise
        if mode == "abort":
            await self._requests.abort(
                in_flight, self._abort_sent, timeout_s=self.control_timeout_s
            )

    async def resume(self) -> None:
        """``POST /resume``; then requests waiting on the pause go."""
        self._usable()
        await self.connect()
        data = await self._post("/resume")
        self._expect(data, "status", "resumed", "POST /resume")
        self._gate.resume()

    # ---- SupportsSleep -------------------------------------------------------------------
    async def sleep(self, level: int = 1) -> None:
        """``POST /sleep?level=&mode=`` (level 1: offload weights, drop the KV cache; 2:
        drop both; needs ``--enable-sleep-mode``). New requests are refused until
        ``wake_up``."""
        if not is_int(level) or not 0 <= level <= 2:
            raise EngineError(f"{self.name}: sleep level must be 0, 1 or 2, got {level!r}")
        self._usable()
        await self.connect()
        self._available("SupportsSleep", "sleep")
        params = {"level": level, "mode": self.sleep_mode}
        if self._labels():
            data = await self._post("/sleep", params=params)
            self._expect(data, "status", "sleeping", "POST /sleep")
        else:  # vLLM 0.26 answers 200 with an empty body
            await self._post("/sleep", params=params, expect_json=False)
        self._asleep = True

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """``POST /wake_up`` (``?tags=weights&tags=kv_cache`` to wake part of it; none wakes
        everything). vLLM 0.26 answers with an empty body: after a partial wake-up
        ``GET /is_sleeping`` tells whether everything is awake again. vLLM's ``wake_up`` also
        resumes a pause (``v1/engine/core.py``)."""
        self._usable()
        await self.connect()
        self._available("SupportsSleep", "wake_up")
        params = [("tags", str(tag)) for tag in tags] if tags else None
        if not self._labels():
            await self._post("/wake_up", params=params, expect_json=False)
            # vLLM 0.26 resumes scheduling once all memory is resident; /is_sleeping is True
            # while any tag still sleeps (v1/engine/core.py wake_up, is_sleeping)
            self._asleep = bool(params) and await self.is_sleeping()
            return
        data = await self._post("/wake_up", params=params)
        status = self._key(data, "status", "POST /wake_up")
        if status not in ("awake", "sleeping"):
            raise self._malformed("POST /wake_up", data)
        self._asleep = status != "awake"

    async def is_sleeping(self) -> bool:
        """``GET /is_sleeping``."""
        data = await self._get("/is_sleeping")
        return self._bool(data, "is_sleeping", "GET /is_sleeping")

    async def is_paused(self) -> bool:
        """``GET /is_paused``."""
        data = await self._get("/is_paused")
        return self._bool(data, "is_paused", "GET /is_paused")

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """``POST /reset_prefix_cache``; False when vLLM refused (blocks still held by
        requests). ``reset_running_requests=True`` preempts running and frozen requests first
        (their KV is recomputed when they run again), so the reset succeeds."""
        params = {"reset_running_requests": "true"} if reset_running_requests else None
        data = await self._post("/reset_prefix_cache", params=params)
        return self._bool(data, "success", "POST /reset_prefix_cache")

    # ---- SupportsLoadWeights -------------------------------------------------------------
    async def load_weights(
        self, weights: Sequence[tuple[str, torch.Tensor]], version: Version
    ) -> None:
        """Tensors (if any) through ``/collective_rpc`` and the worker extension (class
        docstring; refused with the reason where they cannot go: then sync them with
        ``EngineGroupWeightSync`` over vLLM's NCCL group), then ``POST /reset_prefix_cache``;
        the version: ``POST /update_weight_version {"new_version": str(version)}`` (on vLLM
        0.26, which has no such route, the bump is this client's only)."""
        self._check_version_arg("load_weights", version)
        weights = list(weights)
        self._usable()
        if weights:
            await self.connect()
            refusal = self.tensor_load_refusal
            if refusal is not None:
                raise EngineError(
                    f"{self.name}: load_weights got {len(weights)} tensors, which cannot go "
                    f"to this server: {refusal}. Or sync them with "
                    "asyncflow_core.sync.transports.EngineGroupWeightSync(engines=[...], "
                    "master_address=..., master_port=...) over vLLM's NCCL weight-transfer "
                    "group (a GPU), or call load_weights((), version) to set the version only"
                )
            check_weight_pairs(self.name, weights)
            # Paused ("keep") unless the caller paused it: no token is sampled between the
            # load and the new label; requests in flight recompute their KV afterwards.
            hold = not self._gate.paused
            if hold:
                await self.pause("keep")
            try:
                self.last_load = await send_weights(
                    self._collective_rpc, weights, piece_bytes=self.piece_bytes, text=True
                )
                self.prefix_cache_reset_ok = await self.reset_prefix_cache(True)
                await self._set_version(version)
            finally:
                if hold:
                    await self.resume()
            return
        await self.connect()
        await self._set_version(version)

    async def _set_version(self, version: Version) -> None:
        if self._labels():
            data = await self._post("/update_weight_version", {"new_version": str(version)})
            if not isinstance(data, dict) or data.get("success") is not True:
                raise self._malformed("POST /update_weight_version", data)
        self._version = int(version)

    async def _collective_rpc(self, method: str, args: tuple[Any, ...]) -> Any:
        """``POST /collective_rpc {"method", "args", "timeout"}``: the method on every worker;
        their results (``{"results": [...]}``; an empty answer: None)."""
        body = {"method": method, "args": list(args), "timeout": self.control_timeout_s}
        # A worker's exception escapes the route: its 500 goes out without "Connection:
        # close", then uvicorn drops the connection, and the next request on it would be reset
        # (seen on vLLM 0.32): these calls take a connection of their own.
        data = await self._client.call(
            "POST",
            "/collective_rpc",
            json_body=body,
            timeout_s=self.control_timeout_s,
            headers={"Connection": "close"},
        )
        if data is None:
            return None
        results = self._key(data, "results", "POST /collective_rpc")
        if not isinstance(results, list):
            raise self._malformed("POST /collective_rpc", data, "'results' is not a list")
        return results

    # ---- GroupReceiver -------------------------------------------------------------------
    async def join_weight_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int
    ) -> None:
        """``POST /init_weight_transfer_engine {"init_info": {master_address, master_port,
        rank_offset, world_size, packed[, packed_buffer_size_bytes, packed_num_buffers]}}``
        (``NCCLWeightTransferInitInfo``, ``distributed/weight_transfer/nccl_common.py``);
        returns once the workers joined. Without ``packed`` on vLLM 0.26, whose init info has
        no such field."""
        self._usable()
        await self.connect()
        self._available("GroupReceiver", "join_weight_group")
        init_info: dict[str, Any] = {
            "master_address": str(master_address),
            "master_port": int(master_port),
            "rank_offset": int(rank_offset),
            "world_size": int(world_size),
        }
        features = self._connected_features()
        if features.packed_init:
            packed = packing_for(self.name, self._weight_packing, features)
            init_info["packed"] = packed
            if packed:
                init_info["packed_buffer_size_bytes"] = self._packed_bytes
                init_info["packed_num_buffers"] = PACKED_NUM_BUFFERS
        await self._post("/init_weight_transfer_engine", {"init_info": init_info})

    async def begin_weight_update(self) -> None:
        """``POST /start_weight_update`` (no body). Refused because an update is open (a
        trainer died mid-sync: vLLM answers 500, with ``compat.STALE_WEIGHT_UPDATE`` in the
        message where the server passes it on), the open update is finished
        (``/finish_weight_update``, no body: the label stays) and the start sent once more; a
        start refused for another reason fails the same way again and raises."""
        self._usable()
        try:
            await self._post("/start_weight_update")
        except EngineError as exc:
            if "HTTP 500" not in str(exc) and STALE_WEIGHT_UPDATE not in str(exc):
                raise
            with contextlib.suppress(EngineError):
                await self._post("/finish_weight_update")
            await self._post("/start_weight_update")

    async def receive_weights(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
    ) -> None:
        """``POST /update_weights {"update_info": {names, dtype_names, shapes}}``
        (``NCCLWeightTransferUpdateInfo``, ``distributed/weight_transfer/nccl_engine.py``);
        returns once the workers received every tensor. Nothing is sent for an empty list:
        vLLM reads empty lists as "reuse the previous metadata"."""
        self._usable()
        if not len(names) == len(dtypes) == len(shapes):
            raise EngineError(
                f"{self.name}: receive_weights got {len(names)} names, {len(dtypes)} dtypes "
                f"and {len(shapes)} shapes; pass one of each per tensor"
            )
        if not names:
            return
        update_info = {
            "names": [str(n) for n in names],
            "dtype_names": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [[int(x) for x in shape] for shape in shapes],
        }
        await self._post("/update_weights", {"update_info": update_info})

    async def commit_weights(self, version: Version) -> None:
        """``POST /finish_weight_update {"weight_version": str(version)}`` (vLLM 0.26: no
        body, and the version is this client's only), then ``POST /reset_prefix_cache`` (see
        ``reset_prefix_cache_on_commit``)."""
        self._check_version_arg("commit_weights", version)
        self._usable()
        await self.connect()
        if self._labels():
            await self._post("/finish_weight_update", {"weight_version": str(version)})
        else:
            await self._post("/finish_weight_update")
        self._version = int(version)
        if self.reset_prefix_cache_on_commit:
            self.prefix_cache_reset_ok = await self.reset_prefix_cache(True)

    async def leave_weight_group(self) -> None:
        """``POST /shutdown_weight_transfer_engine``; nothing on vLLM 0.26, which has no such
        route (its workers keep the group until the server exits or joins another)."""
        self._usable()
        await self.connect()
        if self._labels():
            await self._post("/shutdown_weight_transfer_engine")

    # ---- internals -----------------------------------------------------------------------
    async def _generate(self, request: GenerationRequest) -> GenerationResult:
        rid = request.request_id
        while True:
            if not await self._requests.gate(self._gate, rid):  # aborted before it was sent
                return assemble(request, (), (), (), "abort", who=self.name)
            prompt, remaining = continuation(request)
            if remaining <= 0:
                return assemble(request, (), (), (), "length", who=self.name)
            self._sent.add(rid)
            try:
                data = await self._client.call(
                    "POST",
                    "/inference/v1/generate",
                    json_body=self._generate_body(request, prompt, remaining),
                    timeout_s=self.timeout_s,
                )
            except asyncio.CancelledError:
                # The caller gave up: do not leave the request generating on the server.
                task = asyncio.ensure_future(self._abort_quietly([rid]))
                task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)
                raise
            except EngineError as exc:
                # A request that raced our own pause: vLLM rejects it (HTTP 503, "Generation
                # is paused"); it waits for resume like any new request, then goes again.
                self._sent.discard(rid)
                if self._gate.paused and _PAUSED_MARK in str(exc).lower():
                    continue
                raise
            return self._result(request, data)

    def _generate_body(
        self, request: GenerationRequest, prompt: list[int], remaining: int
    ) -> dict[str, Any]:
        """A ``GenerateRequest`` (``token_in_token_out/protocol.py``) whose
        ``sampling_params`` are ``vllm.SamplingParams`` fields (``vllm/sampling_params.py``:
        ``top_k=0`` disables top-k, ``logprobs=0`` returns the sampled token's log-prob)."""
        p = request.params
        sampling: dict[str, Any] = {
            "n": 1,
            "max_tokens": remaining,
            "temperature": float(p.temperature),
            "top_p": float(p.top_p),
            "top_k": int(p.top_k),
            "logprobs": 0,
            "detokenize": False,
            "ignore_eos": self.ignore_eos,
        }
        if p.seed is not None:
            sampling["seed"] = int(p.seed)
        if p.stop_token_ids:
            sampling["stop_token_ids"] = [int(t) for t in p.stop_token_ids]
        body: dict[str, Any] = {
            "request_id": request.request_id,
            "token_ids": prompt,
            "sampling_params": sampling,
            "stream": False,
        }
        if self.model is not None:
            body["model"] = self.model
        return body

    def _result(self, request: GenerationRequest, data: Any) -> GenerationResult:
        where = "POST /inference/v1/generate"
        rid = request.request_id
        choices = self._key(data, "choices", where)
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            raise self._malformed(where, data)
        choice = choices[0]
        tokens = choice.get("token_ids")
        if not isinstance(tokens, list) or not all(is_int(t) and 0 <= t < 2**63 for t in tokens):
            raise self._malformed(where, data, "choices[0].token_ids is not a list of ids")
        raw_logprobs = choice.get("logprobs")
        content = raw_logprobs.get("content") if isinstance(raw_logprobs, dict) else None
        if not isinstance(content, list) or len(content) != len(tokens):
            raise self._malformed(
                where, data, "choices[0].logprobs.content needs one entry per token"
            )
        labels = self._labels()
        logprobs: list[float] = []
        for i, (token, entry) in enumerate(zip(tokens, content, strict=True)):
            lp = entry.get("logprob") if isinstance(entry, dict) else None
            if not isinstance(lp, int | float) or isinstance(lp, bool):
                raise self._malformed(where, data, f"no logprob for token {i}")
            if "token_id" in entry or ("token" not in entry and labels):
                if entry.get("token_id", token) != token:  # vLLM 0.33's entries
                    raise self._malformed(where, data, f"logprob {i} is for another token")
            else:  # vLLM 0.26's entries name the token "token_id:N" (serving.py)
                label = entry.get("token")
                match = _TOKEN_LABEL.fullmatch(label) if isinstance(label, str) else None
                if match is None:
                    raise self._malformed(
                        where, data, f"logprob {i} names its token {label!r}, not 'token_id:N'"
                    )
                if int(match.group(1)) != token:
                    raise self._malformed(where, data, f"logprob {i} is for another token")
            logprobs.append(float(lp))
        reason = finish_reason(choice.get("finish_reason"), who=self.name, rid=rid)
        raw_spans = choice.get("weight_versions") if labels else None
        spans: list[tuple[object, int, int]] = []
        if raw_spans is not None:
            if not isinstance(raw_spans, list):
                raise self._malformed(where, data, "weight_versions is not a list")
            for span in raw_spans:
                if not isinstance(span, dict) or not {"version", "start", "end"} <= span.keys():
                    raise self._malformed(where, data, f"bad weight-version span {span!r}")
                spans.append((span["version"], span["start"], span["end"]))
        versions = versions_from_spans(spans, len(tokens), fallback=self._version, who=self.name)
        if any(v >= 2**63 for v in versions):  # versions end up in int64 tensors
            raise self._malformed(where, data, f"weight version {max(versions)} (beyond int64)")
        return assemble(request, tokens, logprobs, versions, reason, who=self.name)

    async def _abort_remote(self, request_ids: Sequence[str]) -> None:
        ids = [REQUEST_ID_PREFIX + rid for rid in request_ids]
        if not ids:  # an empty list would abort every request on the server
            return
        data = await self._post("/abort_requests", {"request_ids": ids})
        self._expect(data, "status", "aborted", "POST /abort_requests")

    async def _abort_quietly(self, request_ids: Sequence[str]) -> None:
        with contextlib.suppress(Exception):
            await self._abort_remote(request_ids)

    async def _get(self, path: str) -> Any:
        return await self._client.call("GET", path, timeout_s=self.control_timeout_s)

    async def _post(
        self, path: str, body: Any = None, *, params: Any = None, expect_json: bool = True
    ) -> Any:
        if body is None:
            return await self._client.call(
                "POST",
                path,
                params=params,
                timeout_s=self.control_timeout_s,
                expect_json=expect_json,
            )
        return await self._client.call(
            "POST",
            path,
            json_body=body,
            params=params,
            timeout_s=self.control_timeout_s,
            expect_json=expect_json,
        )

    def _connected_features(self) -> Features:
        if self._features is None:  # connect() sets it; every caller awaited connect() first
            raise EngineError(f"{self.name}: not connected; await engine.connect() first")
        return self._features

    def _labels(self) -> bool:
        """Whether the server keeps a weight-version label (vLLM 0.33; not 0.26)."""
        return self._connected_features().weight_version_label

    def _usable(self) -> None:
        if self._closed:
            raise EngineError(f"{self.name}: the engine is closed; build a new one")

    def _available(self, ability: str, call: str) -> None:
        reason = self.unavailable_abilities.get(ability)
        if reason is not None:
            raise EngineError(
                f"{self.name}: {call}() is not available on this server (device "
                f"{self.facts.device or 'unknown'}): {reason}"
            )

    def _check_version_arg(self, what: str, version: object) -> None:
        if not is_int(version) or version < 0:
            raise EngineError(f"{self.name}: {what} version must be an int >= 0, got {version!r}")

    def _malformed(self, where: str, data: Any, detail: str = "") -> EngineError:
        extra = f" ({detail})" if detail else ""
        line = "0.26" if self._features is not None and not self._labels() else "0.33"
        return EngineError(
            f"{self.name}: {where} answered {describe(data)}, not the JSON vLLM {line} sends"
            f"{extra}; a malformed response — is {self.base_url} a vllm serve of a supported "
            "version?"
        )

    def _key(self, data: Any, key: str, where: str) -> Any:
        if not isinstance(data, dict) or key not in data:
            raise self._malformed(where, data, f"no {key!r} key")
        return data[key]

    def _bool(self, data: Any, key: str, where: str) -> bool:
        value = self._key(data, key, where)
        if not isinstance(value, bool):
            raise self._malformed(where, data, f"{key!r} is not a bool")
        return value

    def _expect(self, data: Any, key: str, value: str, where: str) -> None:
        if self._key(data, key, where) != value:
            raise self._malformed(where, data, f"{key!r} is not {value!r}")
