"""A replay server for the SGLang adapter's tests. **It is not SGLang.**

It answers the SGLang 0.5.23 HTTP routes the adapter uses, with the JSON shapes documented in
SGLang's source (``sglang/srt/entrypoints/http_server.py`` for routes and answers,
``sglang/srt/managers/io_struct.py`` for bodies, ``sglang/srt/utils/weight_versions.py`` for
per-token versions), backed by the pure-PyTorch reference engine
(``asyncflow_reference.engines.TorchInferenceEngine``): tokens, log-probs, abort, pause,
sleep and per-token weight versions are real computations, not canned answers.

**Log-probs as SGLang reports them, not as AsyncFlow wants them.** The reference engine
reports the protocol's log-probs (after temperature, top-k and top-p, renormalised); SGLang
does not, and the replay answers what SGLang would (``sglang_logprob_meta``):

* ``output_token_logprobs``: after temperature, *before* top-k/top-p
  (``sglang/srt/layers/sampler.py``, ``Sampler.forward``: ``log(softmax(logits / T))``); a
  request with ``top_k == 1`` (greedy included: ``sampling_params.py``,
  ``SamplingParams.__post_init__`` turns a temperature below 1e-6 into temperature 1 with
  top_k 1) as in an all-greedy batch: ``log_softmax(logits)`` at temperature 1 (the
  ``is_all_greedy`` branch; in a batch mixed with sampled rows SGLang would scale by the
  row's temperature instead). With a filter these are recomputed by a teacher-forced pass of
  the replay's model over prompt + generated tokens; without one the reference engine's
  values are the same quantity and are used as they are.
* ``output_token_sampling_logprobs`` / ``output_token_sampling_mask`` /
  ``output_token_sampling_mask_length``, only for ``return_sampling_mask: true``
  (``tokenizer_manager.py``, ``TokenizerManager._handle_batch_output``): per token
  ``log(selected weight / support mass)`` over SGLang's *joint* support (the top-k tokens
  that are also in the top-p nucleus of the full distribution: ``sampler.py``,
  ``top_k_top_p_min_p_sampling_from_probs_torch``, and ``Sampler._build_sampling_mask_output``),
  a float per token for ``sampling_logprobs_mode`` ``"selected"`` (the default), the support's
  list for ``"support"`` (``sglang/srt/sampling/sampling_mask.py``,
  ``SamplingMaskChunk.to_lists``); greedy rows get 0.0 and the one-token mask
  (``Sampler._build_greedy_sampling_mask_output``). With one filter this equals the
  protocol's value. The request is refused as SGLang refuses it: ``top_k`` not 1 nor in
  ``2..sampling_mask_max_tokens``, the ``ascend`` backend (``scheduler.py``,
  ``Scheduler._handle_generate_request``: HTTP 400 ``{"error": {"message"}}``), a
  ``sampling_logprobs_mode`` without ``return_sampling_mask`` (``tokenizer_manager.py``,
  ``TokenizerManager._validate_one_request``).

Not emulated: the tokens are the reference engine's draws, from the protocol's distribution;
with both top-k and top-p SGLang would draw from its joint support instead (the adapter
refuses that combination). A request that spans a load of new weight *tensors* gets its
before-filter log-probs recomputed under the weights current when it ends (the replay keeps
no older weights; loads and recomputations never overlap: ``_weights_lock``).

``/init_weights_update_group`` joins the trainer's group the way SGLang's workers do
(``asyncflow_sglang.group.join_sglang_group``, rank ``rank_offset + 0``: one TP rank), and
``/update_weights_from_distributed`` receives one broadcast per tensor into
``torch.empty(shape, dtype)`` (as ``WeightUpdater.receive_weights_from_distributed``), or,
with ``load_format: "flattened_bucket"``, one ``uint8`` broadcast cut into the tensors as
``FlattenedTensorBucket`` does, alignment refusal included (``flattened_layout``,
``receive_flattened``), and loads them with ``TorchInferenceEngine.load_weights``. It does
so only inside a weight-update session: ``/begin_weight_update`` opens one (refused while one
is open), ``/end_weight_update`` closes it (refused when none is), and
``/update_weights_from_distributed`` outside one answers HTTP 400 ``success: false``
*before* receiving anything, with upstream's messages
(``sglang/srt/managers/scheduler_components/weight_updater.py``,
``WeightUpdater.begin_weight_update`` / ``end_weight_update`` /
``update_weights_from_distributed``; the routes answer 400 on ``success: false``,
``http_server.py``).

``api_key`` / ``admin_api_key`` check the ``Authorization: Bearer`` header as SGLang's
``--api-key`` / ``--admin-api-key`` do (``ReplayServer._auth``).

Every request (path, JSON body) is recorded in ``ReplayServer.requests``; ``fault(path, ...)``
injects an HTTP status, a raw (malformed) body or a delay. Body checks are strict where
SGLang's are (``/generate``'s contract check refuses unknown ``sampling_params`` fields,
``sglang/api/v1/api_types.py``, ``decode_SamplingParams``; ``top_k`` 0 is refused by
``SamplingParams.verify``), and stricter at the top level, which SGLang's contract ignores
(``decode_GenerateRequest``) but where an unknown field is an adapter bug worth seeing. Run it
in its own process with
``python replay_sglang_server.py --port P [--seed S]`` (prints ``READY <url>``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from aiohttp import web
from asyncflow_reference.engines import TorchInferenceEngine
from asyncflow_reference.model import ModelConfig, TransformerLM

from asyncflow_core.contracts.errors import AsyncFlowError
from asyncflow_core.contracts.protocols import GenerationRequest, SamplingParams

# sampling_params the replay cannot apply, with the value that means "off"
# (srt/sampling/sampling_params.py defaults); a request that sets another is refused
_NOT_EMULATED: dict[str, Any] = {
    "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1, "logit_bias": None,
    "stop": None, "stop_regex": None, "ignore_eos": False,
}  # fmt: skip
SGLANG_VERSION = "0.5.23"
DETERMINISTIC_SEED = 42  # sampling_batch_info.py: an unseeded request's seed when deterministic
MODEL = ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, max_seq_len=512)

# Fields of /generate (GenerateReqInput: sglang/srt/managers/io_struct.py) and of its
# sampling_params (sglang/api/v1/api_types.py, decode_SamplingParams); a subset: the ones a
# client may plausibly send.
_GENERATE_FIELDS = {
    "text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs", "stream", "rid",
    "lora_path", "return_hidden_states", "return_sampling_mask", "sampling_logprobs_mode",
}  # fmt: skip
_SAMPLING_FIELDS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
    "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "min_new_tokens", "n", "ignore_eos", "skip_special_tokens", "no_stop_trim",
    "sampling_seed", "logit_bias",
}  # fmt: skip


# --------------------------------------------------------------------------------------------
# SGLang's sampling settings and log-probs (see the module docstring)
# --------------------------------------------------------------------------------------------
SAMPLING_EPS = 1e-6  # sglang/srt/sampling/sampling_params.py: _SAMPLING_EPS
TOP_K_ALL = 1 << 30  # sampling_params.py: TOP_K_ALL, what top_k -1 ("whole vocabulary") becomes
SAMPLING_MASK_MAX_TOKENS = 4096  # sglang/srt/arg_groups/fields/exec_.py: the default


@dataclass(frozen=True)
class SGLangSampling:
    """A request's sampling settings as SGLang holds them after
    ``SamplingParams.__post_init__`` (sampling_params.py): a temperature below 1e-6 becomes
    temperature 1 with top_k 1 (greedy), top_k -1 becomes ``TOP_K_ALL``."""

    temperature: float
    top_k: int
    top_p: float
    greedy: bool  # asked for a temperature below SAMPLING_EPS

    @classmethod
    def of(cls, sp: dict[str, Any]) -> SGLangSampling:
        def value(name: str, default: float) -> float:  # __post_init__: null = default
            raw = sp.get(name)
            return default if raw is None else float(raw)

        temperature = value("temperature", 1.0)
        top_k = int(value("top_k", -1))
        top_p = value("top_p", 1.0)
        greedy = 0 <= temperature < SAMPLING_EPS
        if greedy:
            temperature, top_k = 1.0, 1
        if top_k == -1:
            top_k = TOP_K_ALL
        return cls(temperature, top_k, top_p, greedy)

    def reference_params(self, sp: dict[str, Any], *, deterministic: bool) -> SamplingParams:
        """What the reference engine samples with: SGLang's greedy as temperature 0; its seed
        as SGLang's: the request's ``sampling_seed`` only with
        ``--enable-deterministic-inference``, which gives an unseeded request seed 42
        (``srt/sampling/sampling_batch_info.py``, ``SamplingBatchInfo.from_schedule_batch``;
        the seeded sampler is a function of seed and position: ``srt/layers/sampler.py``,
        ``multinomial_with_seed``), and none without it (the field is ignored)."""
        seed = sp.get("sampling_seed", DETERMINISTIC_SEED) if deterministic else None
        return SamplingParams(
            max_tokens=int(sp.get("max_new_tokens", 128)),
            temperature=0.0 if self.greedy else self.temperature,
            top_p=self.top_p,
            top_k=0 if self.top_k == TOP_K_ALL else self.top_k,
            seed=DETERMINISTIC_SEED if deterministic and seed is None else seed,
            stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
        )

    @property
    def filtered(self) -> bool:
        return self.top_k != TOP_K_ALL or self.top_p < 1


def sampling_mask_refusal(
    sampling: SGLangSampling, *, max_tokens: int, backend: str = "flashinfer"
) -> str | None:
    """SGLang's refusal of ``return_sampling_mask`` for these settings, or None
    (sglang/srt/managers/scheduler.py, Scheduler._handle_generate_request)."""
    top_k = sampling.top_k
    if top_k != 1 and not (1 < top_k <= max_tokens):
        return (
            "return_sampling_mask requires top_k=1 for greedy sampling "
            f"or finite 1 < top_k <= {max_tokens}; got top_k="
            f"{top_k}. Lower top_k or increase "
            "--sampling-mask-max-tokens."
        )
    if backend == "ascend":
        return "return_sampling_mask is not supported with the ascend sampling backend."
    return None


def teacher_forced_logits(
    model: TransformerLM, prompt: Sequence[int], tokens: Sequence[int]
) -> torch.Tensor:
    """``[len(tokens), V]``: the logits that predicted each of ``tokens`` after ``prompt``
    (one causal forward pass over prompt + tokens[:-1])."""
    seq = torch.tensor([[*prompt, *tokens[:-1]]], dtype=torch.long)
    with torch.no_grad():
        logits: torch.Tensor = model(seq)[0]
    return logits[len(prompt) - 1 :].float()


def sglang_logprob_meta(
    model: TransformerLM,
    prompt: Sequence[int],
    tokens: Sequence[int],
    reference_logprobs: Sequence[float],
    sampling: SGLangSampling,
    *,
    sampling_mask: bool = False,
    mode: str = "selected",
) -> dict[str, Any]:
    """The log-prob fields of SGLang's ``meta_info`` for ``tokens`` sampled after
    ``prompt`` (see the module docstring): ``output_token_logprobs`` and, with
    ``sampling_mask``, the ``output_token_sampling_*`` fields. ``reference_logprobs`` are the
    reference engine's (the protocol's), used as they are where they equal SGLang's."""
    all_greedy = sampling.top_k == 1  # sampler.py: is_all_greedy = all(top_k <= 1)
    logits: torch.Tensor | None = None
    if tokens and (sampling.filtered and not sampling.greedy):
        logits = teacher_forced_logits(model, prompt, tokens)
    index = torch.tensor(list(tokens), dtype=torch.long).unsqueeze(1)
    if logits is None:
        # no filter, or greedy: the reference engine reports log_softmax(logits / T)
        # (T = 1 when greedy), which is Sampler.forward's value too
        before = [float(x) for x in reference_logprobs]
    else:
        # Sampler.forward: log_softmax at temperature 1 in an all-greedy batch, else of
        # logits.div_(temperatures), taken before the top-k/top-p filters
        scale = 1.0 if all_greedy else sampling.temperature
        before = torch.log_softmax(logits / scale, dim=-1).gather(1, index).squeeze(1).tolist()
    meta: dict[str, Any] = {
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(before, tokens, strict=True)]
    }
    if not sampling_mask:
        return meta
    masks: list[list[int]] = []
    values: list[Any] = []
    if all_greedy or logits is None:
        # Sampler._build_greedy_sampling_mask_output: the argmax alone, log-prob 0 (a top_k=1
        # row in a mixed batch: a one-token support, log(w / w) = 0 as well)
        for t in tokens:
            masks.append([int(t)])
            values.append(0.0 if mode == "selected" else [0.0])
    else:
        probs = torch.softmax(logits / sampling.temperature, dim=-1)
        # top_k_top_p_min_p_sampling_from_probs_torch: sort descending, zero ranks >= top_k,
        # zero where the mass above a token exceeds top_p (joint: on the full distribution;
        # the flashinfer branch of Sampler._sample_from_probs intersects top_k_renorm_prob
        # and top_p_renorm_prob of the same probs, top-p only when need_top_p_sampling)
        ranked, order = probs.sort(dim=-1, descending=True)
        drop = torch.arange(ranked.shape[-1]).unsqueeze(0) >= sampling.top_k
        if sampling.top_p < 1:
            drop |= (ranked.cumsum(dim=-1) - ranked) > sampling.top_p
        weights = ranked.masked_fill(drop, 0.0)
        for row, t in enumerate(tokens):
            keep = weights[row] > 0
            support = order[row][keep]
            mass = float(weights[row][keep].sum())
            # Sampler._build_sampling_mask_output: log(selected_weight / support_mass)
            selected = float(probs[row, int(t)])
            masks.append([int(x) for x in support.tolist()])
            if mode == "selected":
                values.append(math.log(selected / mass))
            else:
                values.append([math.log(float(w) / mass) for w in weights[row][keep].tolist()])
    meta["output_token_sampling_mask"] = masks
    meta["output_token_sampling_logprobs"] = values
    meta["output_token_sampling_mask_length"] = len(masks)
    return meta


@dataclass
class Fault:
    status: int | None = None
    body: str | None = None
    delay_s: float = 0.0
    times: int = 1


def flattened_layout(
    names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
) -> list[tuple[str, torch.dtype, list[int], int, int]]:
    """``(name, dtype, shape, start, end)`` byte ranges of a ``flattened_bucket`` update, with
    SGLang 0.5.23's refusals (``srt/weight_sync/tensor_bucket.py``,
    ``FlattenedTensorBucket.empty``): a negative dimension, a tensor whose byte offset is not
    a multiple of its element size, an empty bucket (``ValueError``, before any receive)."""
    out = []
    offset = 0
    for name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
        dtype = getattr(torch, dtype_name)
        if any(d < 0 for d in shape):
            raise ValueError(f"Negative dimension in received tensor {name}: {shape}")
        if offset % dtype.itemsize:
            raise ValueError(
                f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}"
            )
        size = math.prod(shape) * dtype.itemsize
        out.append((str(name), dtype, list(shape), offset, offset + size))
        offset += size
    if not out:
        raise ValueError("Cannot create empty tensor bucket")
    return out


def receive_flattened(
    broadcast: Callable[[torch.Tensor], None],
    layout: list[tuple[str, torch.dtype, list[int], int, int]],
) -> list[tuple[str, torch.Tensor]]:
    """One ``uint8`` broadcast of the whole bucket, then each tensor as a view of its byte
    range (``WeightUpdater._receive_bucketed_weights_from_distributed`` ->
    ``FlattenedTensorBucket.reconstruct_tensors``: ``[start:end].view(dtype).reshape(shape)``)."""
    flat = torch.empty(layout[-1][4], dtype=torch.uint8)
    broadcast(flat)
    return [(n, flat[a:b].view(d).reshape(shape)) for n, d, shape, a, b in layout]


def _broadcast(tensor: torch.Tensor, group: Any) -> None:
    work = torch.distributed.broadcast(tensor, src=0, group=group, async_op=True)
    assert work is not None
    work.wait()


ADMIN_ROUTES = frozenset(
    {
        "/abort_request", "/pause_generation", "/continue_generation",
        "/release_memory_occupation", "/resume_memory_occupation", "/flush_cache",
        "/update_weight_version", "/init_weights_update_group",
        "/update_weights_from_distributed", "/destroy_weights_update_group",
        "/update_weights_from_disk", "/begin_weight_update", "/end_weight_update",
    }
)  # fmt: skip
"""The routes served here that SGLang 0.5.23 marks ``@auth_level(AuthLevel.ADMIN_OPTIONAL)``
(``srt/entrypoints/http_server.py``)."""


class ReplayServer:
    """``ReplayServer(engine=None, *, version="0.5.23", tp_size=1, dp_size=1,
    sampling_mask_max_tokens=4096, sampling_backend="flashinfer")`` (the last two as
    SGLang's ``--sampling-mask-max-tokens`` and sampling backend, reported in
    ``/server_info``); ``await start()`` returns the base URL; ``await close()``."""

    def __init__(
        self,
        engine: TorchInferenceEngine | None = None,
        *,
        version: str = SGLANG_VERSION,
        tp_size: int = 1,
        dp_size: int = 1,
        seed: int = 0,
        sampling_mask_max_tokens: int = SAMPLING_MASK_MAX_TOKENS,
        sampling_backend: str = "flashinfer",
        api_key: str | None = None,
        admin_api_key: str | None = None,
        deterministic: bool = True,
        preferred_sampling_params: dict[str, Any] | None = None,
    ) -> None:
        self.engine = engine or TorchInferenceEngine(MODEL, max_batch=8, seed=seed, threads=1)
        # --enable-deterministic-inference (on, as the README's launch line): without it
        # SGLang ignores sampling_seed (sampling_batch_info.py); the replay reports it only
        self.deterministic = deterministic
        # --preferred-sampling-params: merged under each request's (tokenizer_manager.py)
        self.preferred = dict(preferred_sampling_params or {})
        self.effective: list[dict[str, Any]] = []  # each /generate's merged sampling_params
        self.api_key = api_key  # --api-key
        self.admin_api_key = admin_api_key  # --admin-api-key
        self.version = version
        self.tp_size = tp_size
        self.dp_size = dp_size
        self.sampling_mask_max_tokens = sampling_mask_max_tokens
        self.sampling_backend = sampling_backend
        self._weights_lock = asyncio.Lock()  # tensor loads vs teacher-forced passes
        self.label = "default"  # SGLang's --weight-version default
        self.session_open = False  # WeightUpdater._session (weight_updater.py)
        self.paused_mode: str | None = None  # /pause_generation's mode until continued
        self.dead = False  # the scheduler died (an assert): the server is gone
        self._connections: set[asyncio.BaseTransport] = set()  # of requests being answered
        self.requests: list[tuple[str, Any]] = []
        self.faults: dict[str, Fault] = {}
        self.groups: dict[str, Any] = {}
        self.memory_tags: list[Any] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    # ---- control ----------------------------------------------------------------------------
    def fault(
        self,
        path: str,
        *,
        status: int | None = None,
        body: str | None = None,
        delay_s: float = 0.0,
        times: int = 1,
    ) -> None:
        """The next ``times`` calls of ``path`` wait ``delay_s`` then answer ``status`` with
        ``body`` (raw text; default a JSON error), or the real answer when both are None."""
        self.faults[path] = Fault(status, body, delay_s, times)

    def bodies(self, path: str) -> list[Any]:
        return [b for p, b in self.requests if p == path]

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        app = web.Application(middlewares=[self._middleware])
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        for path, handler in (
            ("/release_memory_occupation", self.release_memory),
            ("/resume_memory_occupation", self.resume_memory),
            ("/flush_cache", self.flush_cache),
        ):
            r.add_get(path, handler)
            r.add_post(path, handler)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_get("/model_info", self.model_info)
        r.add_get("/server_info", self.server_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/begin_weight_update", self.begin_weight_update)
        r.add_post("/end_weight_update", self.end_weight_update)
        r.add_post("/update_weights_from_distributed", self.update_from_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_post("/update_weights_from_disk", self.update_from_disk)
        r.add_get("/replay/weights_digest", self.weights_digest)  # test-only, not SGLang
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{host}:{bound}"
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.engine.close()
        for pg in self.groups.values():
            torch.distributed.destroy_process_group(pg)
        self.groups.clear()

    # ---- plumbing ---------------------------------------------------------------------------
    def _auth(self, request: web.Request) -> web.Response | None:
        """SGLang's API-key check (``srt/utils/auth.py``, ``decide_request_auth``, 401
        ``{"error": "Unauthorized"}``): routes marked ``ADMIN_OPTIONAL`` (``ADMIN_ROUTES``)
        take the admin key if the server has one, else the API key, else nothing; the others
        the API key if set; health routes are always open."""
        if request.path.lstrip("/").startswith(("health", "ready", "metrics")):  # always open
            return None
        if request.path in ADMIN_ROUTES:
            expected = self.admin_api_key or self.api_key
        else:
            expected = self.api_key
        if expected is None:
            return None
        given = request.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "bearer" and token == expected:
            return None
        return web.json_response({"error": "Unauthorized"}, status=401)

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.dead:  # the launcher took the whole server down
            if request.transport is not None:
                request.transport.close()
            return web.Response(status=503, text="server is gone")
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        self.requests.append((request.path, body))
        refused = self._auth(request)
        if refused is not None:
            return refused
        fault = self.faults.get(request.path)
        if fault is not None and fault.times > 0:
            fault.times -= 1
            if fault.delay_s:
                await asyncio.sleep(fault.delay_s)
            if fault.status is not None or fault.body is not None:
                return web.Response(
                    status=fault.status or 200,
                    text=fault.body
                    if fault.body is not None
                    else '{"error": {"message": "injected"}}',
                    content_type="application/json",
                )
        transport = request.transport
        if transport is not None:
            self._connections.add(transport)
        try:
            return await handler(request)  # type: ignore[no-any-return]
        except AsyncFlowError as exc:  # SGLang's _create_error_response shape
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        finally:
            self._connections.discard(transport)  # type: ignore[arg-type]

    @staticmethod
    async def _json(request: web.Request) -> dict[str, Any]:
        body = await request.json() if await request.read() else {}
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text='{"error": "body must be an object"}')
        return body

    def _label_of(self, version: int) -> str:
        return self.label if version == self.engine.weight_version else str(version)

    # ---- generation -------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        extra = set(body) - _GENERATE_FIELDS
        sp = body.get("sampling_params") or {}
        extra |= {f"sampling_params.{k}" for k in set(sp) - _SAMPLING_FIELDS}
        if extra:
            return web.json_response({"error": f"unknown fields {sorted(extra)}"}, status=400)
        top_k = sp.get("top_k", -1)
        if top_k != -1 and top_k < 1:
            msg = f"top_k must be -1 (disable) or at least 1, got {top_k}."
            return web.json_response({"error": {"message": msg}}, status=400)
        rid = body.get("rid")
        ids = body.get("input_ids")
        if not isinstance(rid, str) or not isinstance(ids, list):
            return web.json_response({"error": {"message": "need rid and input_ids"}}, status=400)
        sp = {**self.preferred, **sp}  # tokenizer_manager.py: preferred under the request's
        self.effective.append(sp)
        unemulated = {k: v for k, v in sp.items() if k in _NOT_EMULATED and v != _NOT_EMULATED[k]}
        if unemulated:  # the reference engine has no penalties, biases or grammars
            msg = f"the replay cannot emulate sampling_params {unemulated} (SGLang applies them)"
            return web.json_response({"error": {"message": msg}}, status=400)
        want_mask = bool(body.get("return_sampling_mask"))
        mode = body.get("sampling_logprobs_mode")
        sampling = SGLangSampling.of(sp)
        refusal = None
        if mode is not None and not want_mask:  # TokenizerManager._validate_one_request
            refusal = "sampling_logprobs_mode can only be set when return_sampling_mask=true."
        elif mode not in (None, "selected", "support"):
            refusal = f"sampling_logprobs_mode must be 'selected' or 'support', got {mode!r}"
        elif want_mask:
            refusal = sampling_mask_refusal(
                sampling, max_tokens=self.sampling_mask_max_tokens, backend=self.sampling_backend
            )
        if refusal is not None:
            return web.json_response({"error": {"message": refusal}}, status=400)
        params = sampling.reference_params(sp, deterministic=self.deterministic)
        result = await self.engine.generate(GenerationRequest(rid, tuple(ids), params))
        tokens, lps, versions = list(result.tokens), list(result.logprobs), result.versions
        async with self._weights_lock:
            logprob_meta = sglang_logprob_meta(
                self.engine.model,
                ids,
                tokens,
                lps,
                sampling,
                sampling_mask=want_mask,
                mode=mode or "selected",
            )
        spans: list[dict[str, Any]] = []
        for i, v in enumerate(versions):
            if spans and spans[-1]["_v"] == v:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"_v": v, "version": self._label_of(v), "start": i, "end": i + 1})
        for s in spans:
            del s["_v"]
        reason: dict[str, Any]
        if result.finish_reason == "stop":
            reason = {"type": "stop", "matched": tokens[-1]}
        elif result.finish_reason == "length":
            reason = {"type": "length", "length": len(tokens)}
        else:
            reason = {
                "type": "abort",
                "message": "Abort in waiting queue" if not tokens else "abort",
            }
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": reason,
            "prompt_tokens": len(ids),
            "completion_tokens": len(tokens),
            "cached_tokens": 0,
            "weight_version": self.label,
            "num_retractions": 0,
            "input_token_logprobs": [[None, t, None] for t in ids],
            **logprob_meta,
            "output_token_logprobs_length": len(tokens),
        }
        if spans:
            meta["weight_versions"] = spans
        return web.json_response({"text": "", "output_ids": tokens, "meta_info": meta})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if body.get("abort_all"):
            await self.engine.abort(list(self.engine._inflight))
        elif body.get("rid"):
            await self.engine.abort([body["rid"]])
        return web.Response(status=200)  # http_server.py: an empty 200

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return web.json_response({"detail": f"bad mode {mode!r}"}, status=422)
        await self.engine.pause("abort" if mode == "abort" else "keep")
        self.paused_mode = mode
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self.engine.resume()
        self.paused_mode = None
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def release_memory(self, request: web.Request) -> web.Response:
        self.memory_tags.append(("release", (await self._json(request)).get("tags")))
        if not self._idle():  # weight_updater.py, release_memory_occupation: an assert in
            # the scheduler process, which dies of it; the launcher then kills the whole
            # server (srt/entrypoints/engine.py: a dead child takes the server down)
            self.dead = True
            for transport in list(self._connections):  # every client loses its connection
                transport.close()
            return web.Response(status=500, text="Internal Server Error")
        await self.engine.sleep()
        return web.json_response(None)  # the route returns None: FastAPI sends "null"

    async def resume_memory(self, request: web.Request) -> web.Response:
        self.memory_tags.append(("resume", (await self._json(request)).get("tags")))
        await self.engine.wake_up()
        return web.json_response(None)

    def _idle(self) -> bool:
        """``Scheduler.is_fully_idle(ignore_waiting=self._engine_paused)``
        (``srt/managers/scheduler.py``): nothing running, and nothing waiting unless the
        engine is paused. A ``"retract"`` pause moves running requests back to the waiting
        queue (so a paused server is idle), an ``"abort"`` one ends them, an ``"in_place"`` one
        holds the running batch (busy)."""
        if self.paused_mode is not None:
            return self.paused_mode != "in_place" or not self.engine.running
        return not (self.engine.running or self.engine.queued)

    async def flush_cache(self, request: web.Request) -> web.Response:
        if not self._idle():  # scheduler.py, Scheduler.flush_cache
            return web.Response(status=400, text="Flush cache failed.\n")
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details.\n")

    # ---- versions and info --------------------------------------------------------------------
    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        new = body.get("new_version")
        if not isinstance(new, str):
            return web.json_response({"detail": "new_version: field required"}, status=422)
        if body.get("abort_all_requests", True):
            await self.engine.abort(list(self.engine._inflight))
        await self._set_label(new)
        return web.json_response(
            {"success": True, "message": f"Weight version updated to {new}", "new_version": new}
        )

    async def _set_label(self, label: str) -> None:
        self.label = label
        if label.isdigit():
            await self.engine.load_weights([], int(label))

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": "replay/tiny",
                "served_model_name": "replay/tiny",
                "tokenizer_path": None,
                "is_generation": True,
                "preferred_sampling_params": json.dumps(self.preferred) if self.preferred else None,
                "weight_version": self.label,
                "load_format": "auto",
                "model_type": "replay",
                "architectures": ["TransformerLM"],
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": "replay/tiny",
                "tp_size": self.tp_size,
                "dp_size": self.dp_size,
                "pp_size": 1,
                "weight_version": "default",
                "internal_states": [{}],
                "sampling_mask_max_tokens": self.sampling_mask_max_tokens,
                "sampling_backend": self.sampling_backend,
                "enable_deterministic_inference": self.deterministic,
                "version": self.version,
                "frontend": "python",
            }
        )

    # ---- weights ------------------------------------------------------------------------------
    async def init_group(self, request: web.Request) -> web.Response:
        from asyncflow_sglang.group import join_sglang_group

        body = await self._json(request)
        if self.dp_size != 1:  # tokenizer_control_mixin.py: assert dp_size == 1 (an HTTP 500)
            return web.Response(status=500, text="Internal Server Error")
        name = body.get("group_name", "weight_update_group")
        try:
            pg = await asyncio.to_thread(
                join_sglang_group,
                body["master_address"],
                int(body["master_port"]),
                int(body["rank_offset"]) + 0,  # + tp_rank (one TP rank here)
                int(body["world_size"]),
                group_name=name,
                backend=body.get("backend", "nccl"),
                timeout_s=60.0,
            )
        except Exception as exc:
            msg = f"Failed to initialize custom process group: {exc}."
            return web.json_response({"success": False, "message": msg}, status=400)
        self.groups[name] = pg
        return web.json_response(
            {"success": True, "message": "Succeeded to initialize custom process group."}
        )

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        # weight_updater.py, WeightUpdater.begin_weight_update
        body = await self._json(request)
        if body.get("selector", "all") not in ("target", "draft", "all"):
            return web.json_response({"detail": "selector: bad value"}, status=422)
        if self.session_open:
            msg = "a weight-update session is already open; call end_weight_update() first"
            return web.json_response({"success": False, "message": msg}, status=400)
        self.session_open = True
        return web.json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        # weight_updater.py, WeightUpdater.end_weight_update
        await self._json(request)
        if not self.session_open:
            msg = "no weight-update session is open; call begin_weight_update() first"
            return web.json_response({"success": False, "message": msg}, status=400)
        self.session_open = False
        return web.json_response({"success": True, "message": "Success"})

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if not self.session_open:  # weight_updater.py, refused before any receive
            msg = (
                "update_weights_from_distributed must run between begin_weight_update() and "
                "end_weight_update()"
            )
            return web.json_response({"success": False, "message": msg}, status=400)
        name = body.get("group_name", "weight_update_group")
        pg = self.groups.get(name)
        if pg is None:
            msg = f"Group {name} not in {list(self.groups)}."
            return web.json_response({"success": False, "message": msg}, status=400)

        if body.get("load_format") == "flattened_bucket":
            try:
                layout = flattened_layout(body["names"], body["dtypes"], body["shapes"])
            except ValueError as exc:  # raised before any receive, as upstream's
                return web.json_response({"success": False, "message": str(exc)}, status=400)

        def receive() -> list[tuple[str, torch.Tensor]]:
            if body.get("load_format") == "flattened_bucket":
                return receive_flattened(lambda t: _broadcast(t, pg), layout)
            out = []
            for n, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
                t = torch.empty(shape, dtype=getattr(torch, dtype))
                work = torch.distributed.broadcast(t, src=0, group=pg, async_op=True)
                assert work is not None
                work.wait()
                out.append((n, t))
            return out

        weights = await asyncio.to_thread(receive)
        async with self._weights_lock:
            await self.engine.load_weights(weights, self.engine.weight_version)
        if body.get("weight_version") is not None:
            await self._set_label(str(body["weight_version"]))
        return web.json_response(
            {"success": True, "message": "Succeeded to update parameter online."}
        )

    async def destroy_group(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        pg = self.groups.pop(body.get("group_name", "weight_update_group"), None)
        if pg is None:
            msg = "The group to be destroyed does not exist."
            return web.json_response({"success": False, "message": msg}, status=400)
        torch.distributed.destroy_process_group(pg)
        return web.json_response(
            {"success": True, "message": "Succeeded to destroy custom process group."}
        )

    async def update_from_disk(self, request: web.Request) -> web.Response:
        import safetensors.torch

        body = await self._json(request)
        try:
            weights = list(safetensors.torch.load_file(body["model_path"]).items())
            async with self._weights_lock:
                await self.engine.load_weights(weights, self.engine.weight_version)
        except Exception as exc:
            msg = f"Failed to update weights: {exc}."
            return web.json_response(
                {"success": False, "message": msg, "num_paused_requests": 0}, status=400
            )
        if body.get("weight_version") is not None:
            await self._set_label(str(body["weight_version"]))
        return web.json_response(
            {
                "success": True,
                "message": "Succeeded to update model weights.",
                "num_paused_requests": 0,
            }
        )

    async def weights_digest(self, request: web.Request) -> web.Response:
        state = self.engine.model.state_dict()
        return web.json_response(
            {
                n: hashlib.sha256(
                    t.detach().contiguous().view(torch.uint8).numpy().tobytes()
                ).hexdigest()
                for n, t in state.items()
            }
        )


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(
        tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()
    ).hexdigest()


async def _serve(port: int, seed: int) -> None:
    torch.set_num_threads(1)
    server = ReplayServer(seed=seed)
    url = await server.start(port=port)
    print(f"READY {url}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    asyncio.run(_serve(args.port, args.seed))
