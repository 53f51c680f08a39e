"""``SGLangHTTPEngine``: the ``InferenceEngine`` protocol (with pause, sleep, version-only
loads and the ``GroupReceiver`` side of a collective weight sync) over a running SGLang
server (``python -m sglang.launch_server``), on its native routes.

Routes, bodies and answers follow SGLang 0.5.23 (``compat.TESTED``):
``sglang/srt/entrypoints/http_server.py`` (routes and their answers) and
``sglang/srt/managers/io_struct.py`` (request bodies); sampling fields from
``sglang/srt/sampling/sampling_params.py``; per-token weight versions from
``sglang/srt/utils/weight_versions.py::add_weight_versions_to_meta_info``.

=============================  ==============================================================
adapter                        SGLang route and body
=============================  ==============================================================
``connect()``                  ``GET /server_info`` ("version", "tp_size", "dp_size",
                               "pp_size", "sampling_mask_max_tokens", "sampling_backend";
                               ``/get_server_info`` on older servers), then
                               ``GET /model_info`` ("weight_version")
``generate(request)``          ``POST /generate`` ``{input_ids, sampling_params{max_new_tokens,
                               temperature, top_p, top_k (-1 = off), sampling_seed?,
                               stop_token_ids?}, return_logprob: true, rid, stream: false}``,
                               plus ``return_sampling_mask: true, sampling_logprobs_mode:
                               "selected"`` when top-k is sampled (see **Log-probs**)
``abort(ids)``                 ``POST /abort_request {rid, abort_all: false}`` per in-flight id
``pause("abort")``             ``POST /pause_generation {mode: "abort"}``
``pause("keep")``              ``POST /pause_generation {mode: keep_mode}`` ("retract")
``resume()``                   ``POST /continue_generation {}``
``sleep(level)``/``wake_up()`` ``POST /release_memory_occupation {tags}`` /
                               ``POST /resume_memory_occupation {tags}``
``load_weights((), v)``        ``POST /update_weight_version {new_version: str(v),
                               abort_all_requests: false}``
``join_weight_group(...)``     ``POST /init_weights_update_group {master_address, master_port,
                               rank_offset, world_size, group_name, backend}``
``begin_weight_update()``      ``POST /begin_weight_update {selector: "all"}`` (the session)
``receive_weights(...)``       ``POST /update_weights_from_distributed {names, dtypes, shapes,
                               group_name, flush_cache, abort_all_requests: false,
                               load_format: "flattened_bucket"}`` (one broadcast per update)
``commit_weights(v)``          ``POST /end_weight_update {}`` (if a session is open), then
                               ``POST /update_weight_version`` (as above)
``leave_weight_group()``       ``POST /destroy_weights_update_group {group_name}``
``update_weights_from_disk``   ``POST /update_weights_from_disk {model_path, weight_version?,
                               abort_all_requests: false, flush_cache: true}``
``flush_cache()``              ``POST /flush_cache`` (200 with a plain-text body, 400 busy)
``model_info()``               ``GET /model_info``
=============================  ==============================================================

**Log-probs.** ``GenerationResult.logprobs`` are the protocol's
(``asyncflow_core.training.sampling``):
each token's log-probability under the distribution it was sampled from, after temperature,
top-k and top-p, renormalised (greedy: temperature 1, unfiltered). SGLang reports two
quantities, and ``wants_sampling_mask`` picks one per request:

* ``meta_info.output_token_logprobs`` (``return_logprob``) are taken after temperature but
  *before* top-k/top-p/min-p (``sglang/srt/layers/sampler.py``, ``Sampler.forward``: the
  log of the full softmax of ``logits / T``). Without filters that is the protocol's value,
  at any temperature; a greedy request (SGLang turns a temperature below 1e-6 into
  temperature 1 with top_k 1: ``sglang/srt/sampling/sampling_params.py``,
  ``SamplingParams.__post_init__``) gets the full-vocabulary ``log_softmax`` at temperature
  1 (``Sampler.forward``), the protocol's greedy value. These are used when no filter is
  sampled. **The server must not run with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``**: that makes
  them come before temperature too (``sampler.py``), which the adapter cannot see.
* ``meta_info.output_token_sampling_logprobs``, one float per output token, sent back for
  ``return_sampling_mask: true`` with ``sampling_logprobs_mode: "selected"`` (top-level
  fields of ``/generate``: ``sglang/srt/managers/io_struct.py``, ``GenerateReqInput``;
  filled in ``sglang/srt/managers/tokenizer_manager.py``,
  ``TokenizerManager._handle_batch_output``): ``log(selected weight / support mass)``
  over the temperature-scaled distribution cut by top-k/top-p/min-p
  (``Sampler._build_sampling_mask_output``). With top-k alone that is the protocol's value;
  the adapter asks for it whenever top-k is sampled (``top_k > 0``, temperature > 0; for
  ``top_k=1`` it is 0, where ``output_token_logprobs`` would even depend on the batch:
  temperature 1 in an all-greedy one, ``Sampler.forward``'s ``is_all_greedy`` branch). SGLang
  builds it only for ``top_k`` in ``1..--sampling-mask-max-tokens`` (default 4096) and not on
  the ``ascend`` sampling backend (``sglang/srt/managers/scheduler.py``,
  ``Scheduler._handle_generate_request``); the adapter reads both settings from
  ``/server_info`` and refuses such requests itself.

Refused with ``EngineError`` before anything is sent, because SGLang cannot report the
protocol's log-probs for them: top-p together with top-k (> 1): SGLang samples from the
*joint* support, the top-k set intersected with the top-p nucleus of the full distribution
(``Sampler._sample_from_probs``: ``filter_apply_order="joint"``;
``top_k_top_p_min_p_sampling_from_probs_torch``), not from top-p applied to the distribution
renormalised after top-k, so neither its tokens nor any log-prob it reports are those the
trainer recomputes; top-p alone: ``output_token_logprobs`` come before top-p and the sampling
mask needs a finite top-k; a temperature in ``(0, 1e-6)``: SGLang decodes it greedily and
reports temperature-1 log-probs. ``top_k=1`` with any ``top_p`` is served (both supports are
the argmax token).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from asyncflow_core.contracts.errors import ConfigError, EngineError, UnsupportedEngineError
from asyncflow_core.contracts.protocols import (
    GenerationRequest,
    GenerationResult,
    Version,
    WeightSync,
)
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
from asyncflow_core.engines.process import free_port
from asyncflow_core.infra.httpclient import JsonClient
from asyncflow_core.sync.transports import GroupWire, off_loopback_refusal

from .compat import (
    GREEDY_BELOW,
    INSTALL_CLIENT,
    NO_INFLIGHT_LOAD,
    NO_TENSOR_LOADS,
    SAMPLING_MASK_MAX_TOKENS,
    SEEDS_IGNORED,
    STALE_GROUP,
    STALE_SESSION,
    check_sglang_version,
    data_parallel_refusal,
    neutralizing,
    request_seed,
    same_group_settings,
)
from .group import DEFAULT_GROUP_NAME, SGLangWeightSync

__all__ = ["SGLangHTTPEngine", "read_output", "sampling_params", "wants_sampling_mask"]

KeepMode = Literal["retract", "in_place"]

_SLEEP_TAGS: dict[int, list[str]] = {
    # sglang/srt/constants.py: GPU_MEMORY_TYPE_KV_CACHE / _WEIGHTS / _CUDA_GRAPH
    1: ["kv_cache"],
    2: ["kv_cache", "weights"],
}


@dataclass(slots=True)
class _Flight:
    """A request this adapter has in flight: ``sent`` once its /generate left,
    ``aborted`` once ``abort``/``pause("abort")`` named it, ``done`` when generate ended."""

    sent: bool = False
    aborted: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def was_aborted(self) -> bool:
        """``aborted`` now (a call, so type checkers do not keep an earlier narrowing)."""
        return self.aborted


def mark_aborted(
    inflight: Mapping[str, _Flight], who: str, request_ids: object
) -> dict[str, _Flight]:
    """The in-flight requests ``abort(request_ids)`` names, marked aborted (unknown or
    finished ids: nothing to do)."""
    targets: dict[str, _Flight] = {}
    for rid in abort_ids(who, request_ids):
        flight = inflight.get(rid)
        if flight is not None:
            flight.aborted = True
            targets[rid] = flight
    return targets


async def abort_until_done(
    targets: Mapping[str, _Flight],
    send: Callable[[list[str]], Awaitable[None]],
    wait_s: float,
) -> None:
    """Abort each sent target (``send(rids)``) and wait until its generate ended, re-sending
    every 0.25 s while the server may not have registered the rid yet (SGLang ignores
    unknown rids: ``TokenizerManager.abort_request``); after ``wait_s`` the server keeps
    them and their generate calls end on their own."""
    deadline = time.monotonic() + wait_s
    resend = 0.0
    while True:
        live = {rid: f for rid, f in targets.items() if not f.done.is_set()}
        now = time.monotonic()
        if not live or now >= deadline:
            return
        if now >= resend:
            await send([rid for rid, f in live.items() if f.sent])
            resend = time.monotonic() + 0.25
        waits = [asyncio.ensure_future(f.done.wait()) for f in live.values()]
        await asyncio.wait(waits, timeout=0.05)
        for w in waits:
            w.cancel()


def join_fields(
    engine: Any, master_address: str, master_port: int, rank_offset: int, world_size: int
) -> dict[str, Any]:
    """``InitWeightsUpdateGroupReqInput``'s fields (io_struct.py) for ``engine``'s group."""
    return {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": int(rank_offset),
        "world_size": int(world_size),
        "group_name": engine.group_name,
        "backend": engine.weight_backend,
    }


async def replacing_stale(
    call: Callable[[], Awaitable[Any]], undo: Callable[[], Awaitable[None]], stale: Sequence[str]
) -> None:
    """``call()``; refused because something a trainer that died left behind is in the way (the
    refusal's message contains one of ``stale``: a weight group of that name, an open
    weight-update session), ``undo()`` it (its own failure ignored) and ``call()`` once more."""
    try:
        await call()
    except EngineError as exc:
        if not any(marker in str(exc) for marker in stale):
            raise
        with contextlib.suppress(EngineError):
            await undo()
        await call()


def loopback_sglang_sync(first: Any, engines: Sequence[Any]) -> WeightSync:
    """``SGLangWeightSync(engines)`` with the trainer's side on 127.0.0.1 at a free port, over
    ``first``'s ``group_name`` and ``weight_backend`` (the engines share them)."""
    return SGLangWeightSync(
        list(engines),
        master_address="127.0.0.1",
        master_port=free_port(),
        group_name=first.group_name,
        backend=first.weight_backend,
    )


def check_idle_for_sleep(
    who: str, inflight: Mapping[str, _Flight], server_pause: str | None
) -> None:
    """Refuse ``sleep`` unless SGLang would find its scheduler idle. Its
    ``release_memory_occupation`` *asserts* ``is_fully_idle(ignore_waiting=paused)``
    (``srt/managers/scheduler_components/weight_updater.py``; ``srt/managers/scheduler.py``,
    ``Scheduler.is_fully_idle``): a busy scheduler dies of it, and the server with it. Idle:
    no request of this engine generating, or the server paused with ``"abort"`` (they ended)
    or ``"retract"`` (they wait, which a paused scheduler ignores); ``"in_place"`` holds them
    running. (Requests of other clients of the same server are not seen here.)"""
    if server_pause in ("abort", "retract"):
        return
    busy = sorted(rid for rid, flight in inflight.items() if flight.sent)
    if busy:
        raise EngineError(
            f"{who}: sleep needs the server idle, but {len(busy)} request(s) of this engine "
            f"are generating ({busy[:4]}); SGLang asserts an idle scheduler in "
            "release_memory_occupation (srt/managers/scheduler_components/weight_updater.py) "
            "and the assert kills the server: let them finish, or pause('abort') first (or "
            "pause('keep') with keep_mode='retract')"
        )


def sampling_params(
    request: GenerationRequest,
    max_new_tokens: int,
    *,
    seed: int | None = None,
    neutral: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """SGLang's ``sampling_params`` for ``request`` (``SamplingParams`` in
    ``sglang/srt/sampling/sampling_params.py``): ``top_k`` -1 is "off" there (0 is rejected
    by ``verify``: "top_k must be -1 (disable) or at least 1"); the seed field is
    ``sampling_seed`` (the request's, else ``seed``: see ``compat.request_seed``);
    temperature 0 is greedy (SGLang turns it into top_k = 1). ``neutral``: the values that undo
    the server's preferred sampling params (``compat.neutralizing``), for fields not set."""
    p = request.params
    params: dict[str, Any] = {
        "max_new_tokens": int(max_new_tokens),
        "temperature": float(p.temperature),
        "top_p": float(p.top_p),
        "top_k": int(p.top_k) if p.top_k > 0 else -1,
    }
    if p.seed is not None:
        params["sampling_seed"] = int(p.seed)
    elif seed is not None:
        params["sampling_seed"] = int(seed)
    if p.stop_token_ids:
        params["stop_token_ids"] = [int(t) for t in p.stop_token_ids]
    for key, value in (neutral or {}).items():
        params.setdefault(key, value)
    return params


def wants_sampling_mask(
    request: GenerationRequest,
    *,
    who: str,
    mask_max_tokens: int | None,
    sampling_backend: str | None = None,
) -> bool:
    """Where ``request``'s log-probs come from (module docstring, **Log-probs**): ``True``:
    ask for ``return_sampling_mask`` and report ``output_token_sampling_logprobs``;
    ``False``: report ``output_token_logprobs``. What SGLang cannot report (both filters,
    top-p alone, a temperature in ``(0, 1e-6)``, a ``top_k`` above the server's
    ``mask_max_tokens`` or on the ``ascend`` backend) raises ``EngineError`` naming SGLang,
    the values and what to do. ``mask_max_tokens=None``: the server's limit is not known
    yet (not connected); that check is then left for a second call."""
    p = request.params
    rid = request.request_id
    temperature, top_k, top_p = float(p.temperature), int(p.top_k), float(p.top_p)
    if temperature == 0:
        return False  # greedy: output_token_logprobs are temperature 1, unfiltered
    if temperature < GREEDY_BELOW:
        raise EngineError(
            f"{who}: request {rid!r} has temperature={temperature}; SGLang decodes any "
            f"temperature below {GREEDY_BELOW} greedily and reports temperature-1 log-probs "
            "(sglang/srt/sampling/sampling_params.py, SamplingParams.__post_init__), not "
            f"those of temperature {temperature}; use temperature=0 for greedy decoding, or "
            f"a temperature of at least {GREEDY_BELOW}"
        )
    if top_k == 0 and top_p >= 1:
        return False  # temperature only: output_token_logprobs are after temperature
    if top_k == 0:
        raise EngineError(
            f"{who}: request {rid!r} samples with top_p={top_p} and no top_k, but SGLang "
            "cannot report the log-probs of a top-p distribution: its output_token_logprobs "
            "are taken before top-p (sglang/srt/layers/sampler.py, Sampler.forward) and it "
            "returns the renormalised ones (return_sampling_mask) only for a finite top_k "
            "(sglang/srt/managers/scheduler.py, Scheduler._handle_generate_request), so the "
            "log-probs it reports are not those of the distribution it samples from; sample "
            "with top_k instead of top_p, or with temperature alone, or use an engine that "
            "reports them (vLLM, the reference engine)"
        )
    if top_p < 1 and top_k > 1:
        raise EngineError(
            f"{who}: request {rid!r} samples with top_k={top_k} and top_p={top_p}, but SGLang "
            "applies top-p jointly: it keeps the top-k tokens that are also in the top-p "
            "nucleus of the full temperature-scaled distribution (sglang/srt/layers/"
            'sampler.py, Sampler._sample_from_probs, filter_apply_order="joint"), where '
            "AsyncFlow's semantics apply top-p to the distribution renormalised after top-k "
            "(asyncflow_core.training.sampling); SGLang samples from another distribution, and "
            "neither its tokens' log-probs nor any conversion of them are those the trainer "
            "recomputes; use one filter (top_k alone) with SGLang, or an engine with these "
            "semantics (vLLM, the reference engine)"
        )
    if sampling_backend == "ascend":
        raise EngineError(
            f"{who}: request {rid!r} samples with top_k={top_k}, but this SGLang server uses "
            "the ascend sampling backend, which cannot return the after-top-k log-probs "
            "(return_sampling_mask: sglang/srt/managers/scheduler.py, "
            "Scheduler._handle_generate_request) that AsyncFlow reports; sample with "
            "temperature alone on this server, or use another sampling backend"
        )
    if mask_max_tokens is not None and top_k > mask_max_tokens:
        raise EngineError(
            f"{who}: request {rid!r} samples with top_k={top_k}, above this SGLang server's "
            f"--sampling-mask-max-tokens={mask_max_tokens} (default "
            f"{SAMPLING_MASK_MAX_TOKENS}); SGLang returns the after-top-k log-probs "
            "(return_sampling_mask) only up to that limit and refuses the request otherwise "
            "(sglang/srt/managers/scheduler.py, Scheduler._handle_generate_request); lower "
            "top_k, or restart the server with a larger --sampling-mask-max-tokens"
        )
    return True


def read_output(
    request: GenerationRequest,
    out: Any,
    *,
    fallback: Version,
    who: str,
    sampling_mask: bool = False,
) -> GenerationResult:
    """The ``GenerationResult`` of a ``/generate`` (or ``Engine.async_generate``) answer:
    ``meta_info.output_token_logprobs`` is ``[(logprob, token_id, text|None), ...]``
    (tokenizer_manager.py), ``meta_info.finish_reason`` is ``{"type": ...}``,
    ``meta_info.weight_versions`` is ``[{"version", "start", "end"}]`` when the server
    tracks per-token versions (weight_versions.py), else every token gets
    ``meta_info.weight_version`` (or ``fallback`` when absent). With ``sampling_mask`` (the
    request asked for ``return_sampling_mask``, mode ``"selected"``) the log-probs are
    ``meta_info.output_token_sampling_logprobs`` instead, one float per output token
    (``sglang/srt/sampling/sampling_mask.py``, ``SamplingMaskChunk.to_lists``). Anything
    else is an ``EngineError`` quoting the answer."""
    rid = request.request_id

    def malformed(what: str) -> EngineError:
        return EngineError(
            f"{who}: request {rid!r}: {what} in the answer {describe(out)}; a malformed "
            "response — is this an SGLang server of a tested version?"
        )

    if not isinstance(out, dict) or not isinstance(out.get("meta_info"), dict):
        raise malformed("no meta_info object")
    meta = out["meta_info"]
    reason = finish_reason(meta.get("finish_reason"), who=who, rid=rid)
    entries = meta.get("output_token_logprobs")
    if entries is None and reason == "abort":
        entries = []  # e.g. aborted before prefill: nothing generated
    if not isinstance(entries, list):
        raise malformed("meta_info.output_token_logprobs is missing (return_logprob was sent)")
    tokens: list[int] = []
    logprobs: list[float] = []
    for entry in entries:
        if (
            not isinstance(entry, list | tuple)
            or len(entry) < 2
            or not _is_token_id(entry[1])
            or isinstance(entry[0], bool)
            or not isinstance(entry[0], int | float)
            or not math.isfinite(entry[0])
        ):
            raise malformed(f"output_token_logprobs entry {entry!r:.60} is not (logprob, id, _)")
        logprobs.append(float(entry[0]))
        tokens.append(int(entry[1]))
    output_ids = out.get("output_ids")
    if output_ids is not None and (
        not isinstance(output_ids, list)
        or not all(is_int(t) for t in output_ids)
        or [int(t) for t in output_ids] != tokens
    ):
        raise malformed("output_ids disagree with output_token_logprobs")
    if sampling_mask:
        sampled = meta.get("output_token_sampling_logprobs")
        if sampled is None and reason == "abort" and not tokens:
            sampled = []
        if not isinstance(sampled, list):
            raise malformed(
                "meta_info.output_token_sampling_logprobs is missing (return_sampling_mask "
                "was sent, for the log-probs after top-k)"
            )
        if len(sampled) != len(tokens):
            raise malformed(
                f"meta_info.output_token_sampling_logprobs has {len(sampled)} entries for "
                f"{len(tokens)} output tokens"
            )
        for value in sampled:
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
            ):
                raise malformed(
                    f"output_token_sampling_logprobs entry {value!r:.60} is not a finite "
                    "number (sampling_logprobs_mode 'selected' gives one per token)"
                )
        logprobs = [float(v) for v in sampled]
    now = meta.get("weight_version")
    base = fallback if now is None else parse_version(now, who=who)
    raw_spans = meta.get("weight_versions")
    spans: list[tuple[object, int, int]] = []
    if raw_spans is not None:
        if not isinstance(raw_spans, list):
            raise malformed("meta_info.weight_versions is not a list")
        for span in raw_spans:
            if isinstance(span, dict) and {"version", "start", "end"} <= span.keys():
                spans.append((span["version"], span["start"], span["end"]))
            elif isinstance(span, list | tuple) and len(span) == 3:  # msgspec array_like form
                spans.append((span[0], span[1], span[2]))
            else:
                raise malformed(f"weight-version span {span!r:.60}")
    versions = versions_from_spans(spans, len(tokens), fallback=base, who=who)
    if any(v >= _INT64_END for v in versions):
        raise malformed(f"weight version {max(versions)} (beyond int64)")
    return assemble(request, tokens, logprobs, versions, reason, who=who)


_INT64_END = 2**63  # token ids and versions end up in int64 tensors


def _is_token_id(value: object) -> bool:
    """A token id as an answer may carry one: an int in [0, 2**63)."""
    return is_int(value) and 0 <= int(value) < _INT64_END


_NORMAL_AUTH_ROUTES = frozenset({"/generate", "/server_info", "/get_server_info", "/model_info"})
"""The routes used here that SGLang 0.5.23 does not mark ``ADMIN_OPTIONAL``
(``srt/entrypoints/http_server.py``: no ``@auth_level``): they take the API key."""


def _bearer(key: str | None) -> dict[str, str] | None:
    return None if key is None else {"Authorization": f"Bearer {key}"}


class SGLangHTTPEngine:
    """An ``InferenceEngine`` (+ ``SupportsPause``, ``SupportsSleep``, ``SupportsLoadWeights``
    for version-only loads, ``GroupReceiver``) over an SGLang server at ``base_url``.

    ``SGLangHTTPEngine(base_url, *, timeout_s=600, connect_timeout_s=10,
    control_timeout_s=300, check_server_version=True, group_name="weight_update_group",
    weight_backend="nccl", weight_group_ranks=None, keep_mode="retract", flush_cache=True,
    abort_wait_s=30, name=None)`` or ``await SGLangHTTPEngine.connect_to(base_url, ...)``.

    **Connecting.** ``connect()`` (also run on first use) reads ``/server_info``: its
    ``"version"`` must lie in ``compat.TESTED`` (``ConfigError`` otherwise;
    ``check_server_version=False`` skips it) and its ``tp_size`` is ``weight_group_ranks``
    (a server with ``pp_size`` > 1 needs ``weight_group_ranks`` passed: SGLang joins at
    ``rank_offset + tp_rank``; one with ``dp_size`` > 1 cannot join a weight group at all:
    ``compat.data_parallel_refusal``); then ``/model_info``'s ``weight_version`` (SGLang's
    ``"default"`` = 0) sets ``weight_version``.

    **Generation.** Each request is checked (``enginekit.check_request``, and
    ``wants_sampling_mask``: the sampling settings SGLang cannot report the protocol's
    log-probs for) before anything is sent; a resumed request is sent as prompt + prefix with
    ``max_new_tokens`` reduced. Log-probs: see the module docstring (the server must not set
    ``SGLANG_RETURN_ORIGINAL_LOGPROB``; top-k is served through ``return_sampling_mask``;
    top-p, alone or with top-k > 1, is refused).
    ``abort`` ends named in-flight requests (SGLang ignores unknown rids; ids this adapter
    never sent are a no-op) and waits (``abort_wait_s``) until each returns its partial
    result, re-sending the abort while the server has not registered the rid yet.

    **Pausing.** New requests wait in the adapter while paused (``PauseGate``).
    ``pause("keep")`` uses SGLang's ``"retract"`` mode by default: running requests go back
    to the waiting queue keeping their tokens, and their KV cache is recomputed after
    ``continue_generation`` — under the new weights when a sync happened in between (as the
    protocol's version law expects), and ``flush_cache`` (which a weight update runs) still
    works; ``"in_place"`` keeps the KV cache computed by the old weights and makes
    ``flush_cache`` fail while requests are held (io_struct.py ``PauseGenerationReqInput``).

    **Weights.** ``load_weights`` takes no tensors over HTTP: an empty ``weights`` bumps the
    version (``/update_weight_version``); tensors reach the server by ``SGLangWeightSync`` /
    ``EngineGroupWeightSync`` (``GroupReceiver`` methods here) or ``update_weights_from_disk``.
    ``weight_backend`` is the collective backend the server joins with (``"gloo"`` for CPU
    tests); it must match the trainer's ``sglang_group(backend=...)``.
    """

    inflight_weight_load_refusal: ClassVar[str] = NO_INFLIGHT_LOAD
    """``RLConfig(weight_sync="inflight")`` is refused for this engine (see the reason)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        control_timeout_s: float = 300.0,
        check_server_version: bool = True,
        group_name: str = DEFAULT_GROUP_NAME,
        weight_backend: str = "nccl",
        weight_group_ranks: int | None = None,
        keep_mode: KeepMode = "retract",
        flush_cache: bool = True,
        abort_wait_s: float = 30.0,
        flattened_bucket: bool = True,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        name: str | None = None,
    ) -> None:
        self.who = f"SGLangHTTPEngine {name or base_url!r}"
        for label, key in (("api_key", api_key), ("admin_api_key", admin_api_key)):
            if key is not None and (not isinstance(key, str) or not key.strip()):
                raise EngineError(f"{self.who}: {label} must be None or a non-empty string")
        # SGLang's auth (srt/utils/auth.py, decide_request_auth): the routes marked
        # ADMIN_OPTIONAL (every control and weight route used here) take the admin key when
        # the server has one, else the API key; the others (/generate, info) the API key.
        self._auth = _bearer(api_key)
        self._admin_auth = _bearer(admin_api_key) or self._auth
        if flattened_bucket not in (True, False):
            raise EngineError(f"{self.who}: flattened_bucket must be True or False")
        self.flattened_bucket = bool(flattened_bucket)
        if keep_mode not in ("retract", "in_place"):
            raise EngineError(f"{self.who}: keep_mode must be 'retract' or 'in_place'")
        if weight_group_ranks is not None and (
            not is_int(weight_group_ranks) or weight_group_ranks < 1
        ):
            raise EngineError(f"{self.who}: weight_group_ranks must be None or an int >= 1")
        for label, value in (
            ("control_timeout_s", control_timeout_s),
            ("abort_wait_s", abort_wait_s),
        ):
            if not isinstance(value, int | float) or not 0 < value < math.inf:
                raise EngineError(f"{self.who}: {label} must be a number > 0, got {value!r}")
        if not isinstance(group_name, str) or not group_name:
            raise EngineError(f"{self.who}: group_name must be a non-empty str")
        self.client = JsonClient(
            base_url,
            who=self.who,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            install=INSTALL_CLIENT,
            hints={
                404: "the server lacks this route: start an SGLang server of a tested version "
                "(python -m sglang.launch_server, sglang >=0.5.23,<0.6)"
            },
        )
        self.base_url = self.client.base_url
        self.control_timeout_s = float(control_timeout_s)
        self.check_server_version = bool(check_server_version)
        self.group_name = group_name
        self.weight_backend = weight_backend
        self.keep_mode: KeepMode = keep_mode
        self.flush_on_update = bool(flush_cache)
        self.abort_wait_s = float(abort_wait_s)
        self.server_version: str | None = None
        self.server_info: dict[str, Any] = {}
        self._explicit_ranks = weight_group_ranks
        self._ranks: int | None = None
        self._ranks_problem: str | None = None
        self._dp_refusal: str | None = None  # compat.data_parallel_refusal
        self._reported_ranks: int | None = None
        self._mask_max_tokens: int | None = None  # --sampling-mask-max-tokens, once connected
        self._sampling_backend: str | None = None
        self._version: Version = 0
        self._gate = PauseGate(self.who)
        self._inflight: dict[str, _Flight] = {}
        self._connected = False
        self._connect_lock: asyncio.Lock | None = None
        self._sleep_tags: list[str] | None = None
        self._asleep = False
        self._session_open = False  # a weight-update session we opened and did not end
        self._seeds_ignored = False  # the server reports enable_deterministic_inference=False
        self._deterministic = False  # ... =True: unseeded requests get seed 42 there
        self._seed_salt = os.urandom(16)  # compat.request_seed
        self._server_pause: str | None = None  # the mode of the server's pause, until resumed
        self._neutral: dict[str, Any] = {}  # undoes --preferred-sampling-params
        self._closed = False

    # ---- construction -------------------------------------------------------------------
    @classmethod
    async def connect_to(cls, base_url: str, **kwargs: Any) -> SGLangHTTPEngine:
        """Build and ``connect()``: the version check and the server's state happen here."""
        engine = cls(base_url, **kwargs)
        try:
            await engine.connect()
        except BaseException:
            await engine.close()
            raise
        return engine

    async def connect(self) -> None:
        """Read the server's version, parallel sizes and weight version (idempotent)."""
        if self._connected:
            return
        if self._connect_lock is None:
            self._connect_lock = asyncio.Lock()
        async with self._connect_lock:
            if self.connected:
                return
            self._usable()
            info = await self._server_info()
            version = info.get("version")
            if not isinstance(version, str):
                raise EngineError(
                    f"{self.who}: /server_info has no 'version' ({describe(info)}); a malformed "
                    "response — is this an SGLang server?"
                )
            if self.check_server_version:
                try:
                    check_sglang_version(version)
                except ConfigError as exc:  # the server's answer: an engine error too
                    raise UnsupportedEngineError(str(exc)) from None
            self.server_version = version
            self.server_info = info
            sizes = {k: info.get(k, 1) for k in ("tp_size", "dp_size", "pp_size")}
            if all(is_int(v) and v >= 1 for v in sizes.values()):
                self._ranks = int(sizes["tp_size"])
                if sizes["pp_size"] != 1:
                    self._ranks_problem = (
                        f"the server runs pp_size={sizes['pp_size']}, where SGLang joins "
                        "weight groups at rank_offset + tp_rank; pass weight_group_ranks= "
                        "explicitly"
                    )
            else:
                self._ranks_problem = f"/server_info reports parallel sizes {sizes}"
            self._dp_refusal = data_parallel_refusal(self.who, sizes["dp_size"])
            # /server_info carries the resolved server arguments (build_server_info in
            # sglang/srt/utils/common.py: ServerArgs.resolved_dict()).
            deterministic = info.get("enable_deterministic_inference")
            self._seeds_ignored = deterministic is False
            self._deterministic = deterministic is True
            limit = info.get("sampling_mask_max_tokens")
            self._mask_max_tokens = (
                int(limit) if is_int(limit) and limit >= 1 else SAMPLING_MASK_MAX_TOKENS
            )
            backend = info.get("sampling_backend")
            self._sampling_backend = backend if isinstance(backend, str) else None
            model = await self.model_info()
            try:
                self._neutral = neutralizing(self.who, model.get("preferred_sampling_params"))
            except ValueError as exc:
                raise EngineError(str(exc)) from None
            self._version = parse_version(model.get("weight_version"), who=self.who)
            self._connected = True

    @property
    def connected(self) -> bool:
        return self._connected

    async def _server_info(self) -> dict[str, Any]:
        try:
            info = await self._call("GET", "/server_info")
        except EngineError as exc:
            if "HTTP 404" not in str(exc):
                raise
            info = await self._call("GET", "/get_server_info")  # deprecated name, older servers
        if not isinstance(info, dict):
            raise EngineError(
                f"{self.who}: /server_info answered {describe(info)}, not an object; a "
                "malformed response"
            )
        return info

    # ---- InferenceEngine ----------------------------------------------------------------
    @property
    def weight_version(self) -> Version:
        return self._version

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        req = check_request(self.who, request, in_flight=self._inflight)
        self._usable()
        self._wants_sampling_mask(req)  # a refusal comes before anything is registered
        rid = req.request_id
        flight = _Flight()
        self._inflight[rid] = flight
        try:
            await self.connect()
            if req.params.seed is not None and self._seeds_ignored:
                raise EngineError(f"{self.who}: request {rid!r} has a seed, but {SEEDS_IGNORED}")
            mask = self._wants_sampling_mask(req)  # now against the server's limits
            await self._gate.wait()
            prompt, remaining = continuation(req)
            if flight.aborted:
                return assemble(req, [], [], [], "abort", who=self.who)
            if remaining == 0:
                return assemble(req, [], [], [], "length", who=self.who)
            body: dict[str, Any] = {
                "input_ids": prompt,
                "sampling_params": sampling_params(
                    req, remaining, seed=self._seed_for(rid), neutral=self._neutral
                ),
                "return_logprob": True,
                "rid": rid,
                "stream": False,
            }
            if mask:  # top-level GenerateReqInput fields (io_struct.py)
                body["return_sampling_mask"] = True
                body["sampling_logprobs_mode"] = "selected"
            flight.sent = True
            try:
                out = await self.client.call(
                    "POST", "/generate", json_body=body, headers=self._auth
                )
            except EngineError:
                if flight.was_aborted():  # the server refused a request aborted before prefill
                    return assemble(req, [], [], [], "abort", who=self.who)
                raise
            return read_output(req, out, fallback=self._version, who=self.who, sampling_mask=mask)
        finally:
            del self._inflight[rid]
            flight.done.set()

    def _seed_for(self, request_id: str) -> int | None:
        """The seed an unseeded request gets from a deterministic server's adapter (None
        elsewhere): ``compat.request_seed``, since such a server seeds it 42 otherwise."""
        return request_seed(self._seed_salt, request_id) if self._deterministic else None

    def _wants_sampling_mask(self, request: GenerationRequest) -> bool:
        return wants_sampling_mask(
            request,
            who=self.who,
            mask_max_tokens=self._mask_max_tokens,
            sampling_backend=self._sampling_backend,
        )

    async def abort(self, request_ids: Sequence[str]) -> None:
        targets = mark_aborted(self._inflight, self.who, request_ids)
        await self._abort_until_done(targets)

    async def _abort_until_done(self, targets: Mapping[str, _Flight]) -> None:
        async def send(rids: list[str]) -> None:
            await asyncio.gather(
                *(
                    self._call("POST", "/abort_request", {"rid": rid, "abort_all": False})
                    for rid in rids
                )
            )

        await abort_until_done(targets, send, self.abort_wait_s)

    # ---- SupportsPause --------------------------------------------------------------------
    async def pause(self, mode: Literal["abort", "keep"] = "abort") -> None:
        if mode not in ("abort", "keep"):
            raise EngineError(f"{self.who}: pause mode must be 'abort' or 'keep', got {mode!r}")
        await self.connect()
        was_paused = self._gate.paused
        self._gate.pause()
        server_mode = "abort" if mode == "abort" else self.keep_mode
        try:
            await self._call("POST", "/pause_generation", {"mode": server_mode})
        except BaseException:
            if not was_paused:
                self._gate.resume()
            raise
        self._server_pause = server_mode
        if mode == "abort":
            # Requests that reached the server after its abort-all wait there for
            # continue_generation; they were in flight at the pause, so abort them too.
            sent = {rid: f for rid, f in self._inflight.items() if f.sent}
            for f in sent.values():
                f.aborted = True
            await self._abort_until_done(sent)

    async def resume(self) -> None:
        await self.connect()
        await self._call("POST", "/continue_generation", {})
        self._server_pause = None
        self._gate.resume()

    @property
    def paused(self) -> bool:
        return self._gate.paused

    # ---- SupportsSleep --------------------------------------------------------------------
    async def sleep(self, level: int = 1) -> None:
        """Level 1 releases the KV cache (``tags=["kv_cache"]``); level 2 also the weights
        (they come back on ``wake_up`` only with ``--enable-weights-cpu-backup``; otherwise
        sync weights before generating). The server needs ``--enable-memory-saver``."""
        if not is_int(level) or level not in _SLEEP_TAGS:
            raise EngineError(f"{self.who}: sleep level must be 1 or 2, got {level!r}")
        await self.connect()
        if self._asleep:
            return
        check_idle_for_sleep(self.who, self._inflight, self._server_pause)
        tags = list(_SLEEP_TAGS[level])
        await self._call("POST", "/release_memory_occupation", {"tags": tags})
        self._sleep_tags, self._asleep = tags, True

    async def wake_up(self) -> None:
        await self.connect()
        if not self._asleep:
            return
        await self._call("POST", "/resume_memory_occupation", {"tags": self._sleep_tags})
        self._sleep_tags, self._asleep = None, False

    # ---- SupportsLoadWeights ------------------------------------------------------------
    async def load_weights(
        self, weights: Sequence[tuple[str, torch.Tensor]], version: Version
    ) -> None:
        """Only a version bump (empty ``weights``) goes over HTTP; see the class docstring."""
        self._check_version_arg(version)
        if len(weights):
            raise EngineError(
                f"{self.who}: load_weights cannot send {len(weights)} tensors to an SGLang "
                "server over HTTP; send them with asyncflow_sglang.SGLangWeightSync (or "
                "asyncflow_core.sync.transports.EngineGroupWeightSync with make_group="
                "asyncflow_sglang.sglang_group), or save them and call "
                "update_weights_from_disk(path, version)"
            )
        await self.commit_weights(version)

    tensor_load_refusal: ClassVar[str] = NO_TENSOR_LOADS
    """The RL job's default syncs reach this engine through ``own_weight_transport``."""

    def own_transport_refusal(self, engines: Sequence[Any]) -> str | None:
        """Why the RL job cannot sync ``engines`` over a weight group of its own making, or
        None. It opens the group on loopback (secure by default), so every server must be on
        loopback too; for servers elsewhere, pass the group yourself:
        ``RLEngines(make_transport=lambda engines: SGLangWeightSync(engines,
        master_address=<this host's address the servers reach>, master_port=<free port>))``."""
        alike = same_group_settings(self.who, engines)
        if alike is not None:
            return alike
        return off_loopback_refusal(
            engines,
            "asyncflow_sglang.SGLangWeightSync(engines, master_address=..., master_port=<a free "
            "port>, backend=<the servers' weight_backend>)",
        )

    def own_weight_transport(self, engines: Sequence[Any]) -> WeightSync:
        """``SGLangWeightSync`` into ``engines`` with the trainer's side on 127.0.0.1 at a free
        port, over the engines' ``group_name`` and ``weight_backend``."""
        refusal = self.own_transport_refusal(engines)
        if refusal is not None:
            raise ConfigError(refusal)
        return loopback_sglang_sync(self, engines)

    # ---- GroupReceiver ----------------------------------------------------------------------
    @property
    def weight_wire(self) -> GroupWire:
        """How the trainer's broadcasts must arrive: each update as one flattened ``uint8``
        bucket (``load_format="flattened_bucket"``, ``flattened_bucket=True``, the default),
        else one tensor at a time."""
        return GroupWire("flattened") if self.flattened_bucket else GroupWire()

    @property
    def weight_group_ranks(self) -> int:
        """The ranks this server's workers take in the weight group: ``weight_group_ranks=``
        if given, else ``/server_info``'s ``tp_size`` once connected (SGLang joins at
        ``rank_offset + tp_rank``: weight_updater.py). Read before ``connect()`` it is 1, and
        ``join_weight_group`` fails if the server turns out to need more (never raises here:
        ``isinstance(engine, GroupReceiver)`` reads it)."""
        if self._explicit_ranks is not None:
            return self._explicit_ranks
        self._reported_ranks = 1 if self._ranks is None else self._ranks
        return self._reported_ranks

    def _check_ranks(self) -> None:
        if self._dp_refusal is not None:
            raise EngineError(self._dp_refusal)
        if self._explicit_ranks is not None:
            return
        if self._ranks_problem is not None:
            raise EngineError(f"{self.who}: {self._ranks_problem}")
        if self._reported_ranks is not None and self._reported_ranks != self._ranks:
            raise EngineError(
                f"{self.who}: the weight sync counted {self._reported_ranks} rank(s) for this "
                f"engine before it connected, but the server runs tp_size={self._ranks}; await "
                "engine.connect() before building the sync (SGLangWeightSync does), or pass "
                "weight_group_ranks="
            )

    async def join_weight_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int
    ) -> None:
        await self.connect()
        self._check_ranks()
        body = join_fields(self, master_address, master_port, rank_offset, world_size)
        await replacing_stale(
            lambda: self._control("/init_weights_update_group", body),
            self.leave_weight_group,
            STALE_GROUP,
        )

    async def begin_weight_update(self) -> None:
        """Open SGLang's weight-update session: 0.5.23 refuses
        ``/update_weights_from_distributed`` outside ``/begin_weight_update`` ..
        ``/end_weight_update`` (``srt/managers/scheduler_components/weight_updater.py``,
        ``WeightUpdater.update_weights_from_distributed``), before it receives anything, so
        the trainer's broadcast would wait for no one. A session a failed sync left open is
        ended first (``begin_weight_update`` refuses while one is open), and so is one another
        client left (a trainer that died mid-sync: ``compat.STALE_SESSION``), once."""
        await self.connect()
        if self._session_open:
            with contextlib.suppress(EngineError):  # the begin below tells the truth
                await self._end_session()
        await replacing_stale(
            lambda: self._control("/begin_weight_update", {"selector": "all"}),
            self._end_session,
            (STALE_SESSION,),
        )
        self._session_open = True

    async def _end_session(self) -> None:
        """``POST /end_weight_update``: closes the session and runs the runners' post-load
        step (``WeightUpdater.end_weight_update``)."""
        self._session_open = False
        await self._control("/end_weight_update", {})

    async def receive_weights(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
    ) -> None:
        body = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [[int(d) for d in s] for s in shapes],
            "group_name": self.group_name,
            "flush_cache": self.flush_on_update,
            "abort_all_requests": False,
            **({"load_format": "flattened_bucket"} if self.flattened_bucket else {}),
        }
        await self._control("/update_weights_from_distributed", body)

    async def commit_weights(self, version: Version) -> None:
        self._check_version_arg(version)
        await self.connect()
        if self._session_open:
            await self._end_session()
        body = {"new_version": str(version), "abort_all_requests": False}
        answer = await self._control("/update_weight_version", body)
        if answer.get("new_version", str(version)) != str(version):
            raise EngineError(
                f"{self.who}: /update_weight_version answered {describe(answer)} for "
                f"version {version}; a malformed response"
            )
        self._version = version

    async def leave_weight_group(self) -> None:
        await self._control("/destroy_weights_update_group", {"group_name": self.group_name})

    # ---- more of SGLang -------------------------------------------------------------------
    async def update_weights_from_disk(self, path: str, version: Version | None = None) -> None:
        """Reload the weights from ``path`` (a checkpoint the server can read); with
        ``version``, label them (``weight_version``) and set ``weight_version``."""
        if version is not None:
            self._check_version_arg(version)
        await self.connect()
        body: dict[str, Any] = {
            "model_path": str(path),
            "abort_all_requests": False,
            "flush_cache": self.flush_on_update,
        }
        if version is not None:
            body["weight_version"] = str(version)
        await self._control("/update_weights_from_disk", body)
        if version is not None:
            self._version = version

    async def flush_cache(self) -> None:
        """``POST /flush_cache``: 200 with a plain-text body, or 400 while requests run."""
        self._usable()
        # the route answers plain text, not JSON (http_server.py flush_cache)
        await self.client.call(
            "POST",
            "/flush_cache",
            timeout_s=self.control_timeout_s,
            expect_json=False,
            headers=self._headers("/flush_cache"),
        )

    async def model_info(self) -> dict[str, Any]:
        """``GET /model_info`` (model_path, weight_version, ...)."""
        info = await self._call("GET", "/model_info")
        if not isinstance(info, dict):
            raise EngineError(
                f"{self.who}: /model_info answered {describe(info)}, not an object; a "
                "malformed response"
            )
        return info

    async def close(self) -> None:
        """Release the HTTP session; requests waiting on a pause fail. Safe to repeat."""
        if self._closed:
            return
        self._closed = True
        self._gate.close("the engine is closed")
        await self.client.close()

    # ---- internals --------------------------------------------------------------------------
    def _usable(self) -> None:
        if self._closed:
            raise EngineError(f"{self.who}: the engine is closed; build a new one")

    def _check_version_arg(self, version: object) -> None:
        if not is_int(version) or version < 0:
            raise EngineError(f"{self.who}: version must be an int >= 0, got {version!r}")

    def _headers(self, path: str) -> dict[str, str] | None:
        """The ``Authorization`` header for ``path`` (None without keys)."""
        return self._auth if path in _NORMAL_AUTH_ROUTES else self._admin_auth

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        self._usable()
        headers = self._headers(path)
        if body is None:
            return await self.client.call(
                method, path, timeout_s=self.control_timeout_s, headers=headers
            )
        return await self.client.call(
            method, path, json_body=body, timeout_s=self.control_timeout_s, headers=headers
        )

    async def _control(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """A weight route answering ``{"success", "message"}`` (io_struct's ...ReqOutput;
        a failure is HTTP 400 with that body, which ``JsonClient`` raises)."""
        answer = await self._call("POST", path, body)
        if not isinstance(answer, dict) or answer.get("success") is not True:
            raise EngineError(f"{self.who}: POST {path} did not succeed: {describe(answer)}")
        return answer

    def __repr__(self) -> str:
        return f"SGLangHTTPEngine({self.base_url!r}, version={self._version})"
