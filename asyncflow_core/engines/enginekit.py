"""What every adapter over an external inference engine (vLLM, SGLang, your own) needs, so
that each maps the engine onto the ``InferenceEngine`` protocol the same way:

- ``require_module`` / ``check_version``: the engine library is installed, at a tested version,
  or one clear error naming the extra to install;
- ``check_request``: the engine-independent request checks (the conformance suite's bad
  requests), run before anything is sent, so a rejected request changes nothing;
- ``continuation`` / ``assemble``: partial rollout on an engine that knows nothing of it — the
  resumed prefix is appended to the prompt, the cap shrinks by its length, and the result
  carries the prefix back with its original log-probs and versions;
- ``finish_reason``, ``parse_version``, ``versions_from_spans``: engines' finish reasons and
  string weight versions (vLLM's ``WeightVersionSpan``, SGLang's ``weight_version``) in the
  protocol's terms;
- ``PauseGate``: "new requests wait while paused", for engines that instead reject them
  (vLLM's ``abort``/``wait`` pause modes) or that the adapter only reaches over HTTP;
- ``ModelSpec`` / ``build_module``: a trainer takes a built module or a description that
  builds one from a seed (the reference ``ModelConfig`` is one), without importing the package
  that describes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import importlib
import logging
import math
from collections.abc import Awaitable, Callable, Container, Iterable, Sequence
from types import ModuleType
from typing import Any, Protocol, TypeGuard, runtime_checkable

import torch

from asyncflow_core.contracts.errors import ConfigError, EngineError, MissingExtraError
from asyncflow_core.contracts.protocols import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    Version,
)

_log = logging.getLogger(__name__)

__all__ = [
    "InFlight",
    "ModelSpec",
    "PauseGate",
    "abort_ids",
    "assemble",
    "build_module",
    "check_request",
    "check_version",
    "check_weight_pairs",
    "continuation",
    "describe",
    "finish_reason",
    "is_int",
    "parse_release",
    "parse_version",
    "require_module",
    "versions_from_spans",
]


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


# --------------------------------------------------------------------------------------------
# Versions of the engine libraries
# --------------------------------------------------------------------------------------------
def parse_release(version: str) -> tuple[int, ...]:
    """``"0.33.0+cu129"`` -> ``(0, 33, 0)``; ``"0.5.23rc1"`` -> ``(0, 5, 23)``: the leading
    numeric release, enough to place a version in a tested range."""
    parts: list[int] = []
    for piece in str(version).split("+")[0].split("."):
        digits = ""
        for char in piece:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):
            break
    return tuple(parts)


def check_version(package: str, version: str, tested: tuple[str, str], install: str) -> None:
    """Raise ``ConfigError`` unless ``tested[0] <= version < tested[1]`` (release numbers
    compared), naming the package, the installed and tested versions, and ``install``."""
    low, high, got = parse_release(tested[0]), parse_release(tested[1]), parse_release(version)
    if not got or not low <= got < high:
        raise ConfigError(
            f"{package} {version} is installed (or served), but this adapter is tested with "
            f"{package} >={tested[0]},<{tested[1]}; install a tested version ({install})"
        )


def require_module(module: str, *, who: str, install: str) -> ModuleType:
    """``importlib.import_module(module)``, or ``MissingExtraError`` naming what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f"{who} needs {module.split('.')[0]}, which does not import here ({exc}); "
            f"install it: {install}"
        ) from exc


# --------------------------------------------------------------------------------------------
# Requests and results
# --------------------------------------------------------------------------------------------
def _reject(who: str, rid: object, message: str) -> EngineError:
    return EngineError(f"{who}: request {rid!r}: {message}")


def _check_ids(who: str, rid: str, name: str, ids: object, vocab_size: int | None) -> None:
    if not isinstance(ids, tuple | list):
        raise _reject(who, rid, f"{name}={ids!r:.60} must be a tuple of token ids")
    if not ids:
        return
    # the usual case in one pass of C loops (plain ints: bool's type is not int); anything
    # else takes the loop below, which names the first bad id
    plain = all(type(t) is int for t in ids)
    if plain and min(ids) >= 0 and (vocab_size is None or max(ids) < vocab_size):
        return
    for i, t in enumerate(ids):
        if not is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
            bound = (
                f"in [0, {vocab_size}) (vocab_size={vocab_size})"
                if vocab_size is not None
                else ">= 0"
            )
            raise _reject(who, rid, f"{name}[{i}]={t!r} is not a token id; use ints {bound}")


def check_request(
    who: str,
    request: object,
    *,
    in_flight: Container[str] = (),
    vocab_size: int | None = None,
    max_model_len: int | None = None,
) -> GenerationRequest:
    """The checks every engine makes before sending ``request`` anywhere; returns it typed.
    ``EngineError`` names the bad field and what to use instead: a non-``GenerationRequest``,
    an empty or in-flight id, an empty prompt or a bad token id (below 0, or at/above
    ``vocab_size`` when given), resumed tokens without one log-prob and version each, a
    resumed prefix longer than ``max_tokens``, sampling knobs out of range, or a prompt that
    with its prefix and cap does not fit ``max_model_len`` (when given)."""
    if not isinstance(request, GenerationRequest):
        raise EngineError(f"{who}: generate takes a GenerationRequest, got {request!r:.80}")
    rid = request.request_id
    if not isinstance(rid, str) or not rid:
        raise EngineError(f"{who}: request_id must be a non-empty str, got {rid!r}")
    if rid in in_flight:
        raise _reject(
            who, rid, "is already in flight; wait for it or abort it before reusing the id"
        )
    prompt, resume = request.prompt_tokens, request.resume_tokens
    if not isinstance(prompt, tuple | list) or not prompt:
        raise _reject(who, rid, f"prompt_tokens={prompt!r:.60} must be a non-empty tuple of ids")
    _check_ids(who, rid, "prompt_tokens", prompt, vocab_size)
    _check_ids(who, rid, "resume_tokens", resume, vocab_size)
    n = len(resume)
    if len(request.resume_logprobs) != n or len(request.resume_versions) != n:
        raise _reject(
            who,
            rid,
            f"resumes {n} tokens with {len(request.resume_logprobs)} resume_logprobs and "
            f"{len(request.resume_versions)} resume_versions; pass one of each per token",
        )
    for i, v in enumerate(request.resume_versions):
        if not is_int(v) or v < 0:
            raise _reject(who, rid, f"resume_versions[{i}]={v!r}; use ints >= 0")
    p = request.params
    if not isinstance(p, SamplingParams):
        raise _reject(who, rid, f"params must be SamplingParams, got {type(p).__name__}")
    if not is_int(p.max_tokens) or p.max_tokens < 0:
        raise _reject(who, rid, f"max_tokens={p.max_tokens!r}; use an int >= 0")
    if n > p.max_tokens:
        raise _reject(
            who,
            rid,
            f"resumes {n} tokens but max_tokens={p.max_tokens} caps the whole response, "
            "resumed tokens included; raise max_tokens to at least the prefix length",
        )
    temp = p.temperature
    if not isinstance(temp, int | float) or not math.isfinite(temp) or temp < 0:
        raise _reject(who, rid, f"temperature={temp!r}; use a finite number >= 0 (0 = greedy)")
    if not isinstance(p.top_p, int | float) or not 0 < p.top_p <= 1:
        raise _reject(who, rid, f"top_p={p.top_p!r}; use a number in (0, 1] (1 = off)")
    if not is_int(p.top_k) or p.top_k < 0:
        raise _reject(who, rid, f"top_k={p.top_k!r}; use an int >= 0 (0 = off)")
    if p.seed is not None and (not is_int(p.seed) or not 0 <= p.seed < 2**63):
        raise _reject(who, rid, f"seed={p.seed!r}; use None or an int in [0, 2**63)")
    _check_ids(who, rid, "stop_token_ids", p.stop_token_ids, vocab_size)
    if max_model_len is not None and len(prompt) + n >= max_model_len:
        raise _reject(
            who,
            rid,
            f"prompt ({len(prompt)}) + resume_tokens ({n}) tokens leave no room in the "
            f"engine's max_model_len={max_model_len}; shorten the prompt",
        )
    return request


def abort_ids(who: str, request_ids: object) -> list[str]:
    """The ids an ``abort(request_ids)`` names, each once, in order (entries that are not
    strings cannot be in flight and are dropped: aborting unknown ids is a no-op).
    ``EngineError`` for a bare string or a non-sequence: wrap a single id in a list."""
    if isinstance(request_ids, str | bytes) or not isinstance(request_ids, Sequence):
        raise EngineError(
            f"{who}: abort takes a sequence of request ids, got {describe(request_ids, 80)}; "
            "wrap a single id in a list"
        )
    return [rid for rid in dict.fromkeys(request_ids) if isinstance(rid, str)]


def check_weight_pairs(who: str, weights: Sequence[Any]) -> None:
    """``EngineError`` naming the first item of ``weights`` that is not a ``(name, tensor)``
    pair (what ``load_weights`` takes)."""
    for i, item in enumerate(weights):
        if not (
            isinstance(item, tuple)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor)
        ):
            raise EngineError(
                f"{who}: load_weights takes (name, tensor) pairs; item {i} is {describe(item, 80)}"
            )


def resume_after(request: GenerationRequest, aborted: GenerationResult) -> GenerationRequest:
    """``request`` continued after ``aborted`` (partial rollout): the same request carrying the
    tokens, log-probs and versions generated so far, which the engine keeps and goes on from."""
    return dataclasses.replace(
        request,
        resume_tokens=aborted.tokens,
        resume_logprobs=aborted.logprobs,
        resume_versions=aborted.versions,
    )


def continuation(request: GenerationRequest) -> tuple[list[int], int]:
    """What to send an engine that knows nothing of partial rollout: the prompt followed by
    the resumed tokens, and the tokens still allowed (``max_tokens`` minus the prefix)."""
    prompt = [int(t) for t in request.prompt_tokens] + [int(t) for t in request.resume_tokens]
    return prompt, request.params.max_tokens - len(request.resume_tokens)


def assemble(
    request: GenerationRequest,
    tokens: Sequence[int],
    logprobs: Sequence[float],
    versions: Sequence[Version],
    reason: FinishReason,
    *,
    who: str,
) -> GenerationResult:
    """The ``GenerationResult`` of ``request`` from what the engine generated after the
    resumed prefix (which goes first, with its own log-probs and versions). An engine answer
    whose three lists disagree in length, or that generated past the cap, is an
    ``EngineError`` (a malformed response), never a silently wrong result."""
    if not len(tokens) == len(logprobs) == len(versions):
        raise EngineError(
            f"{who}: request {request.request_id!r}: the engine returned {len(tokens)} tokens, "
            f"{len(logprobs)} log-probs and {len(versions)} versions; a malformed response"
        )
    remaining = request.params.max_tokens - len(request.resume_tokens)
    if len(tokens) > remaining:
        raise EngineError(
            f"{who}: request {request.request_id!r}: the engine returned {len(tokens)} tokens "
            f"where at most {remaining} were allowed; a malformed response"
        )
    for i, lp in enumerate(logprobs):
        if not isinstance(lp, int | float) or math.isnan(lp) or lp > 1e-4 or lp <= -9999.0:
            raise EngineError(
                f"{who}: request {request.request_id!r}: log-prob {i} is {lp!r}, not the "
                "log-probability of a sampled token (in (-9999, 0]; -9999 is vLLM's "
                "placeholder for a missing one); a malformed response"
            )
    return GenerationResult(
        request_id=request.request_id,
        prompt_tokens=tuple(request.prompt_tokens),
        tokens=tuple(request.resume_tokens) + tuple(int(t) for t in tokens),
        logprobs=tuple(request.resume_logprobs) + tuple(min(float(x), 0.0) for x in logprobs),
        versions=tuple(request.resume_versions) + tuple(versions),
        finish_reason=reason,
    )


_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def finish_reason(raw: object, *, who: str, rid: str) -> FinishReason:
    """An engine's finish reason (``"stop"``, ``"length"``, ``"abort"``; SGLang's
    ``{"type": ...}`` dict too) in the protocol's terms; anything else (vLLM's ``"error"``,
    a missing reason) is an ``EngineError`` quoting it."""
    kind = raw.get("type") if isinstance(raw, dict) else raw
    if isinstance(kind, str) and kind in _FINISH:
        return _FINISH[kind]
    detail = f" ({raw.get('message')})" if isinstance(raw, dict) and raw.get("message") else ""
    raise EngineError(
        f"{who}: request {rid!r} ended with finish reason {kind!r}{detail}; expected stop, "
        "length or abort"
    )


def parse_version(raw: object, *, who: str) -> Version:
    """An engine's weight-version label as the protocol's int: AsyncFlow labels versions
    ``str(int)``; an engine that was never updated reports its own default (vLLM ``None``
    or ``""``, SGLang ``"default"``), which is version 0. Any other label is an
    ``EngineError``: someone else set it, and the versions would lie."""
    if raw is None or raw == "" or raw == "default":
        return 0
    if is_int(raw) and raw >= 0:
        return raw
    if isinstance(raw, str) and raw.isdigit():
        return int(raw)
    raise EngineError(
        f"{who}: the engine reports weight version {raw!r}, which AsyncFlow did not set "
        "(it labels versions with non-negative integers); set the engine's version with "
        "this adapter only, or restart it"
    )


def versions_from_spans(
    spans: Iterable[tuple[object, int, int]] | None,
    n: int,
    *,
    fallback: Version,
    who: str,
) -> tuple[Version, ...]:
    """Per-token versions of ``n`` generated tokens from ``(version, start, end)`` spans
    (vLLM's ``WeightVersionSpan``: tokens ``[start, end)`` came from weights ``version``).
    Tokens no span covers get ``fallback`` (the engine's version when the answer arrived,
    an upper bound); spans that overlap or run past ``n`` are an ``EngineError``."""
    out: list[Version | None] = [None] * n
    for version, start, end in spans or ():
        if not (is_int(start) and is_int(end) and 0 <= start <= end <= n):
            raise EngineError(
                f"{who}: weight-version span [{start!r}, {end!r}) does not lie within the "
                f"{n} generated tokens; a malformed response"
            )
        v = parse_version(version, who=who)
        for i in range(start, end):
            if out[i] is not None:
                raise EngineError(f"{who}: weight-version spans overlap at token {i}")
            out[i] = v
    return tuple(fallback if v is None else v for v in out)


# --------------------------------------------------------------------------------------------
# Pausing on the client side
# --------------------------------------------------------------------------------------------
class PauseGate:
    """New requests wait while paused. ``close()``-d gates fail waiters with ``EngineError``.

    ``async with gate.admit(): ...`` is not offered on purpose: a request admitted before a
    pause runs on, and the engine's own pause decides what happens to it."""

    def __init__(self, who: str) -> None:
        self.who = who
        self._open = asyncio.Event()
        self._open.set()
        self._closed: str | None = None

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def pause(self) -> None:
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    def close(self, why: str) -> None:
        self._closed = why
        self._open.set()

    async def wait(self) -> None:
        """Return once not paused (at once if not paused); ``EngineError`` if closed."""
        while True:
            if self._closed is not None:
                raise EngineError(f"{self.who}: {self._closed}")
            if self._open.is_set():
                return
            await self._open.wait()


class InFlight:
    """A client-side adapter's requests in flight, and aborts that hold.

    An engine may drop an abort that reaches it before it registered the request (vLLM:
    ``v1/engine/output_processor.py``, ``abort_requests`` skips unknown ids), and a request
    that raced a pause to the engine may sit there until resume. So ``abort`` marks the
    requests aborted here first (``aborted``: a request not yet sent is then never sent, and
    one waiting at a pause gate returns at once), sends the abort, and sends it again, less
    and less often, until every request has ended (up to ``timeout_s``)."""

    def __init__(self) -> None:
        self._ended: dict[str, asyncio.Event] = {}
        self._abort: dict[str, asyncio.Event] = {}
        self.aborted: set[str] = set()
        self._counts: dict[str, int] = {}
        self._watchers: dict[str, list[tuple[int, asyncio.Future[int]]]] = {}

    def __contains__(self, rid: object) -> bool:
        return rid in self._ended

    def ids(self) -> list[str]:
        return list(self._ended)

    def start(self, rid: str, tokens: int = 0) -> None:
        """``rid`` is in flight, with ``tokens`` response tokens (its resumed prefix)."""
        self._ended[rid] = asyncio.Event()
        self._abort[rid] = asyncio.Event()
        self._counts[rid] = tokens

    def advance(self, rid: str, tokens: int) -> None:
        """``rid`` has ``tokens`` response tokens now (an adapter that streams says so as
        they arrive): the ``wait_for_tokens`` calls they satisfy return."""
        if rid not in self._counts:
            return
        self._counts[rid] = tokens
        waiting = self._watchers.get(rid)
        if waiting:
            keep = []
            for count, future in waiting:
                if count <= tokens:
                    if not future.done():
                        future.set_result(tokens)
                else:
                    keep.append((count, future))
            waiting[:] = keep

    async def wait_for_tokens(self, rid: str, count: int, *, who: str) -> int:
        """``SupportsProgress.wait_for_tokens`` from the counts ``advance`` reported: once
        ``rid`` has ``count`` tokens (or has ended), its count then; ``EngineError`` if it is
        not in flight. The request may run on a little meanwhile (nothing holds its engine)."""
        if not is_int(count) or count < 0:
            raise EngineError(f"{who}: count must be an int >= 0, got {count!r}")
        have = self._counts.get(rid)
        if have is None:
            raise EngineError(
                f"{who}: request {rid!r} is not in flight; wait on it before its generate() "
                "call returns"
            )
        if have >= count:
            return have
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._watchers.setdefault(rid, []).append((count, future))
        return await future

    def end(self, rid: str) -> None:
        self._abort.pop(rid, None)
        self.aborted.discard(rid)
        final = self._counts.pop(rid, 0)
        for _, future in self._watchers.pop(rid, ()):
            if not future.done():
                future.set_result(final)
        event = self._ended.pop(rid, None)
        if event is not None:
            event.set()

    async def gate(self, gate: PauseGate, rid: str) -> bool:
        """Wait for ``gate`` to open (``EngineError`` if it is closed): True; or False at once
        when ``rid`` is aborted meanwhile (or was before)."""
        while rid not in self.aborted:
            signal = self._abort.get(rid)
            if not gate.paused or signal is None:
                await gate.wait()
                return rid not in self.aborted
            opened = asyncio.ensure_future(gate.wait())
            aborted = asyncio.ensure_future(signal.wait())
            done, pending = await asyncio.wait(
                {opened, aborted}, return_when=asyncio.FIRST_COMPLETED
            )
            for task in pending:
                task.cancel()
            if opened in done:
                opened.result()  # a closed gate raises
        return False

    async def abort(
        self,
        rids: Sequence[str],
        send: Callable[[list[str]], Awaitable[Any]],
        *,
        timeout_s: float,
    ) -> None:
        """Abort those of ``rids`` in flight: mark them, ``send(ids)``, then send again for
        those still running, 0.05 s, 0.1 s, ... up to 1 s apart, until all have ended or
        ``timeout_s`` passed. A repeated send's errors are ignored (the first's are not)."""
        live = [rid for rid in rids if rid in self._ended]
        _log.debug("abort %s: in flight %s", list(rids), live)
        if not live:
            return
        for rid in live:
            self.aborted.add(rid)
            self._abort[rid].set()
        await send(live)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pause = 0.05
        while True:
            running = [self._ended[rid] for rid in live if rid in self._ended]
            left = deadline - loop.time()
            if not running or left <= 0:
                return
            waits = [asyncio.ensure_future(e.wait()) for e in running]
            _, pending = await asyncio.wait(waits, timeout=min(pause, left))
            for w in pending:
                w.cancel()
            again = [rid for rid in live if rid in self._ended]
            if again:
                _log.debug("abort %s again: still running", again)
                with contextlib.suppress(Exception):
                    await send(again)
            pause = min(pause * 2, 1.0)


def describe(value: Any, limit: int = 200) -> str:
    """``repr`` cut to ``limit`` characters, for quoting malformed engine answers."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@runtime_checkable
class ModelSpec(Protocol):
    """A description of a model that builds it: ``build(seed=...)`` returns a fresh
    ``torch.nn.Module``, initialised deterministically from ``seed``."""

    def build(self, *, seed: int) -> torch.nn.Module: ...


def build_module(model: object, *, seed: int, who: str) -> torch.nn.Module:
    """The module a trainer trains: a deep copy of ``model`` when it is a module (the caller's
    is never changed), else ``model.build(seed=seed)`` for a ``ModelSpec``. Anything else
    raises ``ConfigError`` naming ``who`` and what it got."""
    if isinstance(model, torch.nn.Module):
        module: torch.nn.Module = copy.deepcopy(model)
        return module
    if isinstance(model, ModelSpec):
        built = model.build(seed=seed)
        if isinstance(built, torch.nn.Module):
            return built
        raise ConfigError(
            f"{who}: {type(model).__name__}.build() returned {type(built).__name__}, not a "
            "torch.nn.Module"
        )
    raise ConfigError(
        f"{who} takes a torch.nn.Module returning logits, or a model spec with "
        f"build(seed=...) (e.g. the reference ModelConfig), got {type(model).__name__}"
    )
