"""A replay server for the vLLM HTTP adapter's tests. **It is not vLLM.**

``ReplayVLLMServer`` is an ``aiohttp.web`` server that answers the routes of ``vllm serve``
(0.33.0, started with ``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config
'{"backend":"nccl"}'``) with the JSON shapes vLLM's source documents, so that
``asyncflow_vllm.VLLMHTTPEngine`` can be tested on a machine without CUDA. Behind the routes is
the reference ``TorchInferenceEngine`` (a real tiny transformer on the CPU), so log-probs,
abort, pause, sleep and weight versions are real, not canned. Sources of the shapes (paths
under ``vllm/``):

- ``POST /inference/v1/generate``: ``entrypoints/scale_out/token_in_token_out/{api_router,
  protocol,serving}.py`` — the request runs as ``"generate-tokens-" + request_id``; the
  answer is ``GenerateTokensResponse`` (``choices[0]``: ``token_ids``, ``logprobs.content``,
  ``finish_reason``, ``stop_reason``, ``weight_versions`` spans ``{version, start, end}``);
  an aborted request answers with its tokens so far and ``finish_reason "abort"``.
- the RL routes of ``entrypoints/rl/online/api_router.py``; ``/sleep``, ``/wake_up``,
  ``/is_sleeping`` (``entrypoints/serve/dev/sleep/api_router.py``); ``/reset_prefix_cache``
  (``entrypoints/serve/dev/cache/api_router.py``); ``/version``, ``/health``.
- weight versions: the engine's label starts as ``"default"`` (``v1/engine/core.py``) and is
  attached to every step's tokens; ``/update_weight_version`` and ``/finish_weight_update``
  set it.

Differences from vLLM, on purpose:

- the weight group. vLLM's NCCL engine joins a ``StatelessProcessGroup`` + ``PyNccl`` group,
  which needs CUDA; here ``/init_weight_transfer_engine`` joins a gloo ``WeightSyncGroup`` at
  rank ``rank_offset`` — the same trainer-side protocol (rank 0 broadcasts each tensor, in
  the order of ``update_info.names``, into ``torch.empty(shape, dtype=getattr(torch,
  dtype_name))``), or, with ``packed: true`` in ``init_info``, in ``uint8`` chunks cut and
  unpacked as vLLM 0.33's worker does (``receive_packed``). Tensors are staged and loaded into
  the engine at ``/finish_weight_update`` (vLLM loads each as it arrives).
- ``scale_out = False`` serves a 0.33 server started without ``--enable-scale-out``:
  ``/inference/v1/generate`` answers 403 ``PermissionDeniedError`` "Scale-out endpoints are
  disabled. Restart vllm serve with --enable-scale-out to enable them."
  (``entrypoints/scale_out/factories.py``, ``register_scale_out_api_routers``: every
  scale-out route then maps to ``disabled_scale_out``). The 0.26 flavour serves the route
  regardless, as 0.26 does. The default (True) is the documented launch line.
- a request in ``/pause?mode=abort|wait`` is answered 503 at once (vLLM 0.33: the engine
  core rejects it with the retryable ``engine_paused`` error); ``mode=keep`` queues it. A
  0.32 server (``vllm_version="0.32.x"``, the CPU build the live tier runs) queues it in
  every mode, as 0.26 does (``v1/engine/core.py``, ``pause_scheduler``).
- ``/openapi.json`` lists the served paths (FastAPI's schema, as far as the adapter reads
  it); dev-mode ``/server_info?config_format=json`` reports the config fields the adapter
  reads (``device``, ``sleep_mode``, ``logprobs_mode``, ``worker_extension``,
  ``weight_transfer`` knobs: a CUDA server started as ``docs/vllm.md`` says, by default);
  dev-mode ``/collective_rpc`` runs AsyncFlow's worker extension (``ReplayWorker``) and
  answers a worker's exception as vLLM 0.32 does (``RPC_FAILED``).
- unknown ``sampling_params`` keys are ignored, as vLLM ignores them (a misspelt field is
  caught by ``tests/test_upstream_contract.py``, against the released ``SamplingParams``).

**vLLM 0.26.0** (``ReplayVLLMServer(engine, vllm_version="0.26.0")``, or ``flavour = "0.26"``:
the release vllm-ascend 0.26.0rc1 serves; RL routes in ``entrypoints/serve/dev/rlhf/
api_router.py``): ``GET /weight_info``, ``POST /update_weight_version`` and ``POST
/shutdown_weight_transfer_engine`` are absent (FastAPI's 404 ``{"detail": "Not Found"}``);
``/sleep`` and ``/wake_up`` answer 200 with an empty body (``entrypoints/serve/dev/sleep/
api_router.py``); ``/finish_weight_update`` reads no body, so the engine keeps no label and the
answers carry no ``weight_versions``; a generate answer is ``GenerateResponse`` (``protocol.py``:
``{request_id, model, created, choices, usage}``, ``choices[0]`` ``{index, logprobs,
finish_reason, token_ids, routed_experts}``) with log-prob entries ``{token: "token_id:N",
logprob, bytes, top_logprobs}`` (``serving.py`` ``_create_tokens_logprobs``); an ``init_info``
with any key beyond ``master_address, master_port, rank_offset, world_size`` (``packed``) is
refused as vLLM 0.26 refuses it: the worker's ``parse_init_info`` raises ``ValueError("Invalid
init_info for NCCLWeightTransferEngine: ...")``, the engine core's utility call fails, and the
API server answers 500 ``InternalServerError`` quoting it; and a new request while paused is
queued until ``/resume`` (0.26's scheduler holds it; 0.33 rejects it with 503).

Test knobs: ``requests`` records every call (method, path, query, JSON body);
``fail(path, status=..., body=..., delay_s=..., times=...)`` injects an HTTP status, a raw
(possibly malformed) body, or a delay; ``spans = False`` leaves ``weight_versions`` out
(vLLM sends None when no label was reported); ``world_size`` is what ``/get_world_size``
reports; ``vllm_version`` what ``/version`` reports (changing it later keeps the flavour);
``flavour`` which release's routes and shapes are served (``"0.33"`` or ``"0.26"``, from the
constructor's ``vllm_version``); ``dev_mode = False`` answers 404 on the dev routes, like a
server started without ``VLLM_SERVER_DEV_MODE``.
"""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Literal

import torch
from aiohttp import web
from asyncflow_reference.engines import TorchInferenceEngine
from asyncflow_vllm.compat import Features
from asyncflow_vllm.worker_ext import EXTENSION, WeightUpdateExtension

from asyncflow_core.contracts.errors import AsyncFlowError
from asyncflow_core.contracts.protocols import GenerationRequest, SamplingParams
from asyncflow_core.sync.transports import WeightSyncGroup

PREFIX = "generate-tokens-"
DEV_ROUTES = frozenset(
    {
        "/pause",
        "/resume",
        "/is_paused",
        "/abort_requests",
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/shutdown_weight_transfer_engine",
        "/update_weight_version",
        "/weight_info",
        "/get_world_size",
        "/sleep",
        "/wake_up",
        "/is_sleeping",
        "/reset_prefix_cache",
        "/server_info",
        "/collective_rpc",
    }
)
MISSING_IN_026 = frozenset(
    {"/weight_info", "/update_weight_version", "/shutdown_weight_transfer_engine"}
)
"""Routes vLLM 0.26.0's server does not have (``entrypoints/serve/dev/rlhf/api_router.py``)."""

STALE_UPDATE = (
    "start_weight_update called while a weight update is already active. Call "
    "finish_weight_update first."
)  # v1/worker/gpu_worker.py, Worker._start_weight_update (0.32 and 0.33)
LAYERS_UNUSABLE = (
    "generation during a weight-update session: start_weight_update moved the layers to the "
    "meta device for a layerwise reload (distributed/weight_transfer/nccl_engine.py, "
    "model_executor/model_loader/reload/layerwise.py); pause generation first"
)
"""What the replay (and the fake AsyncLLM) answer when a request would step on the layers of
an open weight-update session (vLLM would fail inside the model)."""


SCALE_OUT_ROUTES = frozenset({"/inference/v1/generate"})
"""The scale-out routes this replay serves: vLLM 0.33 answers them 403 unless ``vllm serve``
runs with ``--enable-scale-out`` or ``--tokens-only`` (``entrypoints/scale_out/factories.py``)."""

SCALE_OUT_DISABLED = (
    "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
)
"""``register_scale_out_api_routers``'s message, verbatim."""


def query_bool(value: str | None, default: bool) -> bool:
    """A FastAPI ``bool`` query parameter (``true``/``false``/``1``/``0``/...)."""
    if value is None:
        return default
    low = value.strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise _detail(400, f"Input should be a valid boolean, unable to interpret input {value!r}")


def packed_chunks(
    dtype_names: Sequence[str], shapes: Sequence[Sequence[int]], buffer_bytes: int
) -> list[list[int]]:
    """The tensors (by index) of each ``uint8`` chunk a packed update arrives in, cut as
    vLLM 0.33's receiver cuts them from the sizes alone (``distributed/weight_transfer/
    packed_tensor.py``, ``packed_nccl_broadcast_consumer``): add each tensor's byte size; once
    the chunk's size passes ``buffer_bytes`` (that tensor included) it is received, and what
    is left at the end is the last chunk."""
    chunks: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, (dtype_name, shape) in enumerate(zip(dtype_names, shapes, strict=True)):
        dtype = getattr(torch, dtype_name)
        current.append(i)
        size += math.prod(shape) * dtype.itemsize
        if size > buffer_bytes:
            chunks.append(current)
            current, size = [], 0
    if current:
        chunks.append(current)
    return chunks


def receive_packed(
    broadcast: Callable[[torch.Tensor], None],
    names: Sequence[str],
    dtype_names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    buffer_bytes: int,
) -> list[tuple[str, torch.Tensor]]:
    """Receive a packed update as vLLM 0.33's worker does: one ``uint8`` buffer per chunk
    (``packed_chunks``), split by byte sizes, each piece viewed as its dtype and shape
    (``packed_tensor.py``, ``unpack_tensor``: ``split(tensor_sizes)`` then
    ``.contiguous().view(dtype).view(shape)``)."""
    out: list[tuple[str, torch.Tensor]] = []
    for chunk in packed_chunks(dtype_names, shapes, buffer_bytes):
        dtypes = [getattr(torch, dtype_names[i]) for i in chunk]
        sizes = [math.prod(shapes[i]) * d.itemsize for i, d in zip(chunk, dtypes, strict=True)]
        packed = torch.empty(sum(sizes), dtype=torch.uint8)
        broadcast(packed)
        pieces = packed.split(sizes)
        for i, dtype, piece in zip(chunk, dtypes, pieces, strict=True):
            out.append((str(names[i]), piece.contiguous().view(dtype).view(list(shapes[i]))))
    return out


class FirstTokenFreeze:
    """``with FirstTokenFreeze(engine) as freeze: ... await freeze.frozen()``: the next request
    submitted to the reference ``engine`` is frozen (``pause("keep")``) at its first token,
    whatever the machine's speed (``wait_for_tokens`` holds the engine's next step until the
    waiter has run), so a test can act on a request known to be running and frozen."""

    def __init__(self, engine: TorchInferenceEngine) -> None:
        self.engine = engine
        self._submit = engine.submit
        self._done = asyncio.Event()
        self._task: asyncio.Future[None] | None = None
        self.tokens: int | None = None

    def __enter__(self) -> FirstTokenFreeze:
        def submit(request: GenerationRequest) -> asyncio.Future[Any]:
            future = self._submit(request)
            self.engine.submit = self._submit  # type: ignore[method-assign]
            # registered now, before the engine's next step: a task's own wait_for_tokens
            # would register only when the task first runs, tokens later on a loaded machine
            watch = self.engine.watch_tokens(request.request_id, 1)
            self._task = asyncio.ensure_future(self._freeze(watch))
            return future

        self.engine.submit = submit  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.submit = self._submit  # type: ignore[method-assign]

    async def _freeze(self, watch: asyncio.Future[int]) -> None:
        self.tokens = await watch
        await self.engine.pause("keep")
        self._done.set()

    async def frozen(self) -> int:
        """Once the request is frozen: its token count then (1)."""
        await self._done.wait()
        assert self.tokens is not None
        return self.tokens


@dataclass
class PrefixCacheModel:
    """vLLM's prefix cache, as far as weight updates are concerned (shared by this replay and
    the fake ``AsyncLLM`` of ``test_vllm_engine.py``; the reference engine behind them keeps
    no KV across requests, so this is bookkeeping, not a cache):

    * loading new weight tensors leaves every cached block computed under the old ones
      (``stale``); a request admitted while stale could reuse such KV
      (``stale_requests`` counts them: a correct adapter keeps it at 0);
    * ``reset(running, reset_running_requests)`` follows ``v1/core/sched/scheduler.py``
      ``Scheduler.reset_prefix_cache``: with ``reset_running_requests`` the running (and
      frozen) requests are preempted (their KV dropped, recomputed on resume:
      ``preempted``) and the reset succeeds; without it, it fails while any request holds
      blocks (``v1/core/block_pool.py`` ``BlockPool.reset_prefix_cache``);
    * a pause with ``clear_cache`` (the default, also for ``mode="keep"``, whatever the
      route's docstring says) resets with ``reset_running_requests=True``
      (``v1/engine/core.py`` ``EngineCore._finish_pause`` -> ``_reset_caches``): the frozen
      requests of a keep-pause are preempted.
    """

    stale: bool = False
    resets: int = 0
    failed_resets: int = 0
    preempted: int = 0
    stale_requests: int = 0

    def weights_loaded(self) -> None:
        self.stale = True

    def reset(self, running: int, reset_running_requests: bool) -> bool:
        if running and not reset_running_requests:
            self.failed_resets += 1
            return False
        self.preempted += running
        self.stale = False
        self.resets += 1
        return True

    def paused(self, running: int, clear_cache: bool) -> None:
        if clear_cache:
            self.reset(running, True)

    def admit(self) -> None:
        if self.stale:
            self.stale_requests += 1


INIT_INFO_026 = ("master_address", "master_port", "rank_offset", "world_size")
"""``NCCLWeightTransferInitInfo``'s fields in vLLM 0.26.0 (``distributed/weight_transfer/
nccl_common.py``; vllm-ascend's ``HCCLWeightTransferInitInfo`` has the same)."""


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, list[str]]
    body: Any  # decoded JSON, the raw text if not JSON, None if empty


@dataclass
class Fault:
    status: int | None = None
    body: str | None = None
    delay_s: float = 0.0
    times: int | None = 1  # None: every call


@dataclass
class _Group:
    group: WeightSyncGroup
    staged: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    updating: bool = False
    packed_bytes: int | None = None  # init_info's packed_buffer_size_bytes when packed


class ReplayWorker(WeightUpdateExtension):
    """The replay's one worker: AsyncFlow's worker extension (its real load methods, run by
    ``/collective_rpc``) over a model runner whose ``reload_weights`` (vLLM's in-place reload)
    stages the tensors for the reference engine; the server loads them into it when the
    commit returns. No checkpoint folder: manifests are checked against the stacked layers
    only (none here)."""

    device = "cpu"

    def __init__(self) -> None:
        self.loaded: list[tuple[str, torch.Tensor]] = []
        self.model_runner = SimpleNamespace(
            model=SimpleNamespace(packed_modules_mapping={}),
            reload_weights=self._reload,
            vllm_config=None,
        )

    def _reload(self, weights_iterator: Any, is_checkpoint_format: bool) -> None:
        self.loaded += [(n, t.clone()) for n, t in weights_iterator]


RPC_FAILED = (
    "Call to collective_rpc method failed: Worker failed with error '{}', please check the "
    "stack trace above for the root cause"
)
"""How vLLM 0.32 answers a worker's exception in ``/collective_rpc`` (HTTP 500, as an
``InternalServerError``; seen live): the engine core's utility call fails with this text."""


class _HTTPError(Exception):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(status, body)
        self.status = status
        self.body = body


def _error(status: int, message: str) -> _HTTPError:
    """vLLM's ``ErrorResponse``: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = {
        400: "BadRequestError",
        403: "PermissionDeniedError",
        404: "NotFoundError",
        503: "ServiceUnavailableError",
    }
    return _HTTPError(
        status,
        {
            "error": {
                "message": message,
                "type": kind.get(status, "InternalServerError"),
                "param": None,
                "code": status,
            }
        },
    )


def _detail(status: int, detail: Any) -> _HTTPError:
    """A request refused before its handler's work: an unknown route is FastAPI's 404
    ``{"detail": "Not Found"}``; a body or query that fails validation, or a handler's
    ``HTTPException``, is vLLM's 400 ``ErrorResponse`` (``entrypoints/serve/exception_handling/
    handlers/validation.py`` turns FastAPI's 422 into 400; the same in 0.32 and 0.33, seen
    live), with ``type`` "Bad Request"."""
    if status == 404:
        return _HTTPError(404, {"detail": detail})
    message = detail if isinstance(detail, str) else f"1 validation error:\n  {detail}"
    return _HTTPError(
        400, {"error": {"message": message, "type": "Bad Request", "param": None, "code": 400}}
    )


class ReplayVLLMServer:
    """``ReplayVLLMServer(engine, *, vllm_version="0.33.0", world_size=1)``; ``await
    start()`` returns the base URL (a free port on 127.0.0.1); ``await close()`` stops the
    server and closes the engine. ``vllm_version="0.26.x"`` serves vLLM 0.26.0's routes and
    shapes (``flavour == "0.26"``), any other the 0.33.0 ones."""

    def __init__(
        self,
        engine: TorchInferenceEngine,
        *,
        vllm_version: str = "0.33.0",
        world_size: int = 1,
        host: str = "127.0.0.1",
    ) -> None:
        self.engine = engine
        self.vllm_version = vllm_version
        self.flavour: Literal["0.33", "0.26"] = (
            "0.26" if vllm_version.startswith("0.26.") else "0.33"
        )
        self.world_size = world_size
        self.host = host
        self.dev_mode = True
        self.scale_out = True  # started with --enable-scale-out (0.33's generate route)
        self.spans = True
        self.requests: list[Recorded] = []
        self.faults: dict[str, Fault] = {}
        self.reject_new: str | None = None  # the pause mode that rejects new requests
        self.labels: dict[int, str] = {0: "default"}
        self._versions: dict[str, int] = {"default": 0}
        self.group: _Group | None = None
        self.inflight: dict[str, asyncio.Task[Any]] = {}
        self.prefix = PrefixCacheModel()
        self._runner: web.AppRunner | None = None
        self.base_url = ""
        # what GET /server_info?config_format=json reports (the launch line of docs/vllm.md)
        self.device = "cuda"
        self.sleep_mode = True
        self.logprobs_mode = "processed_logprobs"
        self.dtype = "torch.float32"  # vLLM writes the torch.dtype's str
        self.worker_extension = EXTENSION
        self.weight_transfer: str | None = "nccl"
        self.openapi = True  # FastAPI's /openapi.json (off: --disable-fastapi-docs)
        self.worker = ReplayWorker()

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> str:
        app = web.Application(middlewares=[self._middleware])
        routes: list[tuple[str, str, Callable[[web.Request], Awaitable[Any]]]] = [
            ("GET", "/version", self._version),
            ("GET", "/health", self._health),
            ("POST", "/inference/v1/generate", self._generate),
            ("POST", "/pause", self._pause),
            ("POST", "/resume", self._resume),
            ("GET", "/is_paused", self._is_paused),
            ("POST", "/abort_requests", self._abort),
            ("POST", "/init_weight_transfer_engine", self._init_transfer),
            ("POST", "/start_weight_update", self._start_update),
            ("POST", "/update_weights", self._update_weights),
            ("POST", "/finish_weight_update", self._finish_update),
            ("POST", "/shutdown_weight_transfer_engine", self._shutdown_transfer),
            ("POST", "/update_weight_version", self._update_version),
            ("GET", "/weight_info", self._weight_info),
            ("GET", "/get_world_size", self._world_size),
            ("POST", "/sleep", self._sleep),
            ("POST", "/wake_up", self._wake_up),
            ("GET", "/is_sleeping", self._is_sleeping),
            ("POST", "/reset_prefix_cache", self._reset_prefix_cache),
            ("GET", "/server_info", self._server_info),
            ("POST", "/collective_rpc", self._collective_rpc),
        ]
        self.paths = sorted({path for _, path, _ in routes})
        routes.append(("GET", "/openapi.json", self._openapi))
        for method, path, handler in routes:
            app.router.add_route(method, path, self._wrap(handler))
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.base_url = f"http://{self.host}:{port}"
        return self.base_url

    async def close(self) -> None:
        if self.group is not None:
            self.group.group.close()
            self.group = None
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await self.engine.close()
            await runner.cleanup()

    # ---- knobs ----------------------------------------------------------------------------
    def fail(
        self,
        path: str,
        *,
        status: int | None = None,
        body: str | None = None,
        delay_s: float = 0.0,
        times: int | None = 1,
    ) -> None:
        self.faults[path] = Fault(status, body, delay_s, times)

    def calls(self, path: str) -> list[Recorded]:
        return [r for r in self.requests if r.path == path]

    def label(self, version: int) -> str:
        return self.labels.get(version, str(version))

    @property
    def legacy(self) -> bool:
        """Serving vLLM 0.26.0's routes and shapes."""
        return self.flavour == "0.26"

    # ---- plumbing -------------------------------------------------------------------------
    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        text = await request.text()
        try:
            body: Any = json.loads(text) if text.strip() else None
        except ValueError:
            body = text
        query: dict[str, list[str]] = {}
        for key, value in request.query.items():
            query.setdefault(key, []).append(value)
        self.requests.append(Recorded(request.method, request.path, query, body))
        if not self.dev_mode and request.path in DEV_ROUTES:
            return web.json_response({"detail": "Not Found"}, status=404)
        if self.legacy and request.path in MISSING_IN_026:
            return web.json_response({"detail": "Not Found"}, status=404)
        if not self.legacy and not self.scale_out and request.path in SCALE_OUT_ROUTES:
            refused = _error(403, SCALE_OUT_DISABLED)  # factories.py, disabled_scale_out
            return web.json_response(refused.body, status=refused.status)
        fault = self.faults.get(request.path)
        if fault is not None:
            if fault.times is not None:
                fault.times -= 1
                if fault.times <= 0:
                    del self.faults[request.path]
            if fault.delay_s:
                await asyncio.sleep(fault.delay_s)
            if fault.status is not None or fault.body is not None:
                status = fault.status or 200
                reply = fault.body
                if reply is None:
                    reply = json.dumps(_error(status, f"injected HTTP {status}").body)
                return web.Response(status=status, text=reply, content_type="application/json")
        return await handler(request)

    def _wrap(
        self, handler: Callable[[web.Request], Awaitable[Any]]
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def run(request: web.Request) -> web.StreamResponse:
            try:
                result = await handler(request)
            except _HTTPError as exc:
                return web.json_response(exc.body, status=exc.status)
            except AsyncFlowError as exc:  # the engine refused: vLLM answers 500 here
                return web.json_response(_error(500, str(exc)).body, status=500)
            if isinstance(result, web.StreamResponse):
                return result
            return web.json_response(result)

        return run

    @staticmethod
    async def _json(request: web.Request) -> dict[str, Any]:
        text = await request.text()
        if not text.strip():
            return {}
        try:
            body = json.loads(text)
        except ValueError as exc:
            raise _detail(400, "Invalid JSON format") from exc
        if not isinstance(body, dict):
            raise _detail(400, "Request body must be a JSON object")
        return body

    @staticmethod
    def _missing(*where: str) -> _HTTPError:
        """A missing embedded body field: FastAPI's validation error, as vLLM answers it."""
        return _detail(400, {"type": "missing", "loc": ".".join(where), "msg": "Field required"})

    def _version_of(self, label: str) -> int:
        """The engine's int version for a label (AsyncFlow's labels are ``str(int)``)."""
        if label in self._versions:
            return self._versions[label]
        version = int(label) if label.isdigit() else 1_000_000 + len(self._versions)
        self._versions[label] = version
        self.labels[version] = label
        return version

    # ---- routes: info ---------------------------------------------------------------------
    async def _version(self, request: web.Request) -> Any:
        return {"version": self.vllm_version}

    async def _health(self, request: web.Request) -> Any:
        return web.Response(status=200)

    async def _weight_info(self, request: web.Request) -> Any:
        return {"weight_version": self.label(self.engine.weight_version)}

    async def _world_size(self, request: web.Request) -> Any:
        return {"world_size": self.world_size}

    async def _is_paused(self, request: web.Request) -> Any:
        return {"is_paused": self.engine.paused}

    async def _is_sleeping(self, request: web.Request) -> Any:
        return {"is_sleeping": self.engine.asleep}

    # ---- routes: generation ---------------------------------------------------------------
    async def _generate(self, request: web.Request) -> Any:
        body = await self._json(request)
        rid = body.get("request_id") or str(uuid.uuid4())
        tokens = body.get("token_ids")
        if (
            not isinstance(tokens, list)
            or not tokens
            or not all(isinstance(t, int) and t >= 0 for t in tokens)
        ):
            raise _detail(400, "token_ids: a non-empty list of non-negative ints")
        sp = body.get("sampling_params")
        if not isinstance(sp, dict):
            raise self._missing("body", "sampling_params")
        # vLLM ignores sampling_params keys it does not know (SamplingParams is a msgspec
        # Struct; seen live on 0.32: a misspelt field is accepted silently), so the replay
        # does too; tests/test_upstream_contract.py checks every key the adapter sends against
        # the released SamplingParams instead
        if sp.get("n", 1) != 1:
            raise _error(400, "the replay server serves n=1 only")
        if body.get("stream"):
            raise _error(400, "the replay server does not stream")
        if self.reject_new is not None:
            raise _error(503, "Generation is paused. Please retry after it resumes.")
        if self.engine.asleep:
            raise _error(503, "The engine is sleeping; POST /wake_up first.")
        max_tokens = sp.get("max_tokens", 16)
        if isinstance(max_tokens, int) and max_tokens < 1:  # vllm/sampling_params.py
            raise _error(400, f"max_tokens must be at least 1, got {max_tokens}.")
        try:
            params = SamplingParams(
                max_tokens=int(sp.get("max_tokens", 16)),
                temperature=float(sp.get("temperature", 1.0)),
                top_p=float(sp.get("top_p", 1.0)),
                top_k=int(sp.get("top_k", 0)),
                seed=sp.get("seed"),
                stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
            )
        except (TypeError, ValueError) as exc:
            raise _error(400, f"bad sampling_params: {exc}") from exc
        internal = PREFIX + str(rid)
        if self.group is not None and self.group.updating and not self.engine.paused:
            raise _error(500, LAYERS_UNUSABLE)  # a step during a weight-update session
        self.prefix.admit()
        try:
            future = self.engine.submit(GenerationRequest(internal, tuple(tokens), params))
        except AsyncFlowError as exc:
            raise _error(400, str(exc)) from exc
        result = await future
        want_logprobs = sp.get("logprobs") is not None
        if self.legacy:
            return self._generate_026(internal, tokens, result, want_logprobs)
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": result.finish_reason,
            "stop_reason": (
                result.tokens[-1] if result.finish_reason == "stop" and result.tokens else None
            ),
            "token_ids": list(result.tokens),
            "routed_experts": None,
            "sampling_mask": None,
            "logprobs": (
                {
                    "content": [
                        {
                            "token_id": t,
                            "logprob": lp,
                            "rank": None,
                            "top_logprobs": [{"token_id": t, "logprob": lp, "rank": None}],
                        }
                        for t, lp in zip(result.tokens, result.logprobs, strict=True)
                    ]
                }
                if want_logprobs
                else None
            ),
            "weight_versions": self._spans(result.versions) if self.spans else None,
        }
        return {
            "request_id": internal,
            "model": "replay",
            "created": 0,
            "usage": {
                "prompt_tokens": len(tokens),
                "completion_tokens": len(result.tokens),
                "total_tokens": len(tokens) + len(result.tokens),
            },
            "prompt_token_ids": None,
            "output_mode": "tokens",
            "choices": [choice],
        }

    @staticmethod
    def _generate_026(
        internal: str, tokens: list[int], result: Any, want_logprobs: bool
    ) -> dict[str, Any]:
        """vLLM 0.26.0's ``GenerateResponse.model_dump()`` (``protocol.py``; ``serving.py``
        ``serve_tokens_full_generator`` and ``_create_tokens_logprobs``)."""

        def logprob(token: int, lp: float) -> dict[str, Any]:
            return {"token": f"token_id:{token}", "logprob": max(lp, -9999.0), "bytes": None}

        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": (
                {
                    "content": [
                        {**logprob(t, lp), "top_logprobs": [logprob(t, lp)]}
                        for t, lp in zip(result.tokens, result.logprobs, strict=True)
                    ]
                }
                if want_logprobs
                else None
            ),
            "finish_reason": result.finish_reason or "stop",
            "token_ids": list(result.tokens),
            "routed_experts": None,
        }
        return {
            "request_id": internal,
            "model": "replay",
            "created": 0,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(tokens),
                "total_tokens": len(tokens) + len(result.tokens),
                "completion_tokens": len(result.tokens),
                "prompt_tokens_details": None,
            },
        }

    def _spans(self, versions: tuple[int, ...]) -> list[dict[str, Any]]:
        spans: list[dict[str, Any]] = []
        for i, v in enumerate(versions):
            label = self.label(v)
            if spans and spans[-1]["version"] == label:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": label, "start": i, "end": i + 1})
        return spans

    async def _abort(self, request: web.Request) -> Any:
        body = await self._json(request)
        ids = body.get("request_ids")
        if ids:
            await self.engine.abort([str(i) for i in ids])
            count = len(ids)
        else:  # empty/missing: abort everything in flight (vLLM does the same)
            await self.engine.pause("abort")
            await self.engine.resume()
            count = -1
        return {"status": "aborted", "aborted": count}

    # ---- routes: pause / sleep ------------------------------------------------------------
    async def _pause(self, request: web.Request) -> Any:
        mode = request.query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            raise _detail(400, f"mode: Input should be 'abort', 'wait' or 'keep', got {mode!r}")
        clear_cache = query_bool(request.query.get("clear_cache"), True)
        try:
            return await self._pause_mode(mode)
        finally:
            self.prefix.paused(self.engine.running, clear_cache)

    async def _pause_mode(self, mode: str) -> Any:
        if mode == "keep":
            await self.engine.pause("keep")
        else:
            if Features.of(self.vllm_version).paused_adds_rejected:
                self.reject_new = mode  # 0.33; 0.32 and 0.26 queue new requests meanwhile
            if mode == "abort":
                await self.engine.pause("abort")
            else:
                while self.engine.running or self.engine.queued:
                    await asyncio.sleep(0.01)
                await self.engine.pause("keep")
        return {"status": "paused"}

    async def _resume(self, request: web.Request) -> Any:
        self.reject_new = None
        await self.engine.resume()
        return {"status": "resumed"}

    async def _sleep(self, request: web.Request) -> Any:
        try:
            level = int(request.query.get("level", "1"))
        except ValueError as exc:
            raise _detail(400, "level: an int") from exc
        mode = request.query.get("mode", "abort")
        if not 0 <= level <= 2 or mode not in ("abort", "wait", "keep"):
            raise _detail(400, "level: 0..2; mode: abort|wait|keep")
        if mode == "abort":
            await self.engine.pause("abort")
            await self.engine.resume()
        await self.engine.sleep(max(level, 1))
        if self.legacy:
            return web.Response(status=200)
        return {"status": "sleeping", "level": level}

    async def _wake_up(self, request: web.Request) -> Any:
        tags = request.query.getall("tags", []) or None
        await self.engine.wake_up()
        if self.legacy:
            return web.Response(status=200)
        return {"status": "awake", "tags": tags}

    async def _reset_prefix_cache(self, request: web.Request) -> Any:
        # entrypoints/serve/dev/cache/api_router.py: {"success": bool}
        running = query_bool(request.query.get("reset_running_requests"), False)
        return {"success": self.prefix.reset(self.engine.running, running)}

    # ---- routes: weights ------------------------------------------------------------------
    async def _openapi(self, request: web.Request) -> Any:
        """FastAPI's schema, as far as the adapter reads it: the served paths."""
        if not self.openapi:
            raise _detail(404, "Not Found")
        paths = [p for p in self.paths if self.dev_mode or p not in DEV_ROUTES]
        if self.legacy:
            paths = [p for p in paths if p not in MISSING_IN_026]
        return {"openapi": "3.1.0", "paths": {p: {} for p in paths}}

    async def _server_info(self, request: web.Request) -> Any:
        """``entrypoints/serve/dev/server_info/api_router.py``: the config as text, or (0.32 and
        later, ``config_format=json``) as JSON; only the fields the adapter reads are filled."""
        if self.legacy or request.query.get("config_format", "text") != "json":
            return {"vllm_config": f"device_config={self.device}", "vllm_env": {}}
        transfer = None if self.weight_transfer is None else {"backend": self.weight_transfer}
        config = {
            "model_config": {
                "logprobs_mode": self.logprobs_mode,
                "enable_sleep_mode": self.sleep_mode,
                "dtype": self.dtype,
            },
            "device_config": {"device": self.device},
            "parallel_config": {"worker_extension_cls": self.worker_extension},
            "weight_transfer_config": transfer,
        }
        return {"vllm_config": config, "vllm_env": {}, "system_env": {}}

    async def _collective_rpc(self, request: web.Request) -> Any:
        """``entrypoints/serve/dev/rpc/api_router.py``: the method by name on the worker, the
        JSON ``args`` passed as they are; ``{"results": [...]}``, or an empty 200 when every
        result is None. A worker's exception is a 500 quoting it (``RPC_FAILED``)."""
        body = await self._json(request)
        method = body.get("method")
        if method is None:
            raise _detail(400, "Missing 'method' in request body")
        args = body.get("args", [])
        fn = getattr(self.worker, str(method), None)
        if not self.worker_extension and str(method).startswith("asyncflow_"):
            fn = None  # no extension installed: the worker has no such method
        if fn is None:
            raise _error(500, RPC_FAILED.format(f"Method {method!r} is not implemented."))
        try:
            result = fn(*args)
        except Exception as exc:
            raise _error(500, RPC_FAILED.format(exc)) from exc
        if method in ("asyncflow_commit_load", "asyncflow_load"):
            loaded, self.worker.loaded = self.worker.loaded, []
            await self.engine.load_weights(loaded, self.engine.weight_version)
            if loaded:
                self.prefix.weights_loaded()
        if result is None:
            return web.Response(status=200)
        return {"results": [result]}

    async def _update_version(self, request: web.Request) -> Any:
        body = await self._json(request)
        label = body.get("new_version")
        if not isinstance(label, str):
            raise self._missing("body", "new_version")
        await self.engine.load_weights((), self._version_of(label))
        return {"success": True, "new_version": label}

    async def _init_transfer(self, request: web.Request) -> Any:
        body = await self._json(request)
        info = body.get("init_info")
        if not isinstance(info, dict):
            raise self._missing("body", "init_info")
        if self.legacy and set(info) != set(INIT_INFO_026):
            raise _error(500, self._invalid_init_info_026(info))
        for key in INIT_INFO_026:
            if key not in info:
                raise _error(400, f"init_info lacks {key!r}")
        packed_bytes: int | None = None
        if info.get("packed", False):  # NCCLWeightTransferInitInfo.packed (0.33)
            packed_bytes = int(info.get("packed_buffer_size_bytes", 1024**3))
            if packed_bytes < 1 or int(info.get("packed_num_buffers", 2)) < 1:
                raise _error(400, "packed_buffer_size_bytes and packed_num_buffers must be >= 1")
        group = WeightSyncGroup(
            str(info["master_address"]),
            int(info["master_port"]),
            int(info["rank_offset"]),
            int(info["world_size"]),
            backend="gloo",
            timeout_s=60.0,
        )
        await asyncio.to_thread(group.connect)
        self.group = _Group(group, packed_bytes=packed_bytes)
        return {"message": "Weight transfer initialized"}

    @staticmethod
    def _invalid_init_info_026(info: dict[str, Any]) -> str:
        """What vLLM 0.26.0 answers (HTTP 500, ``InternalServerError``) for an ``init_info``
        that is not ``NCCLWeightTransferInitInfo(**info)``: the worker's ``parse_init_info``
        turns the dataclass's ``TypeError`` into ``ValueError("Invalid init_info for ...")``
        (``distributed/weight_transfer/base.py``), and the engine core reports the failed
        utility call as ``"Call to collective_rpc method failed: ..."`` (``v1/engine/
        core.py``), which the API server's catch-all handler answers with 500."""
        extra = [k for k in info if k not in INIT_INFO_026]
        missing = [k for k in INIT_INFO_026 if k not in info]
        cls = "NCCLWeightTransferInitInfo.__init__()"
        if extra:
            error = f"{cls} got an unexpected keyword argument {extra[0]!r}"
        else:
            quoted = [repr(k) for k in missing]
            names = (
                " and ".join(quoted)
                if len(quoted) <= 2
                else ", ".join(quoted[:-1]) + f", and {quoted[-1]}"
            )
            plural = "s" if len(missing) > 1 else ""
            error = f"{cls} missing {len(missing)} required positional argument{plural}: {names}"
        return (
            "Call to collective_rpc method failed: Invalid init_info for "
            f"NCCLWeightTransferEngine: {error}"
        )

    def _need_group(self) -> _Group:
        if self.group is None:
            raise _error(500, "the weight transfer engine is not initialized")
        return self.group

    async def _start_update(self, request: web.Request) -> Any:
        group = self._need_group()
        # NCCLWeightTransferEngine.start_weight_update moves the layers to the meta device
        # for a layerwise reload (nccl_engine.py -> model_loader/reload/layerwise.py): a
        # request still stepping would run on them, so the replay fails it, as vLLM would
        if self.engine.running and not self.engine.paused:
            raise _error(500, LAYERS_UNUSABLE)
        if group.updating:  # v1/worker/gpu_worker.py, Worker._start_weight_update
            raise _error(500, STALE_UPDATE)
        group.staged = []
        group.updating = True
        return {"message": "Weight update started"}

    async def _update_weights(self, request: web.Request) -> Any:
        body = await self._json(request)
        info = body.get("update_info")
        if not isinstance(info, dict):
            raise self._missing("body", "update_info")
        group = self._need_group()
        if not group.updating:
            raise _error(500, "update_weights before start_weight_update")
        names, dtypes, shapes = info.get("names"), info.get("dtype_names"), info.get("shapes")
        if not (
            isinstance(names, list)
            and isinstance(dtypes, list)
            and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes)
        ):
            raise _error(400, "update_info: names, dtype_names and shapes of equal length")

        def receive() -> list[tuple[str, torch.Tensor]]:
            if group.packed_bytes is not None:  # nccl_engine.py, receive_weights: packed
                return receive_packed(
                    lambda t: group.group.broadcast(t, 0), names, dtypes, shapes,
                    group.packed_bytes,
                )  # fmt: skip
            got = []
            for name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype_name))
                group.group.broadcast(tensor, 0)
                got.append((str(name), tensor))
            return got

        group.staged.extend(await asyncio.to_thread(receive))
        return {"message": "Weights updated"}

    async def _finish_update(self, request: web.Request) -> Any:
        # vLLM 0.26 reads no body: the engine keeps its label (and version) as it was
        label = None if self.legacy else (await self._json(request)).get("weight_version")
        group = self._need_group()
        if not group.updating:
            raise _error(500, "finish_weight_update before start_weight_update")
        version = self.engine.weight_version if label is None else self._version_of(str(label))
        staged, group.staged, group.updating = group.staged, [], False
        await self.engine.load_weights(staged, version)
        if staged:
            self.prefix.weights_loaded()
        return {"message": "Weight update finished"}

    async def _shutdown_transfer(self, request: web.Request) -> Any:
        if self.group is not None:
            self.group.group.close()
            self.group = None
        return {"message": "Weight transfer shut down"}
