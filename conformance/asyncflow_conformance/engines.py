"""Laws of the engine protocols (``InferenceEngine``, ``TrainEngine``, ``WeightSync`` and the
optional ``SupportsPause`` / ``SupportsSleep`` / ``SupportsLoadWeights`` abilities), as pytest
classes to subclass. The protocols' docstrings (``asyncflow_core.contracts.protocols``) are the
contract.

Usage::

    from asyncflow_conformance import (
        InferenceEngineConformance, TrainEngineConformance, WeightSyncConformance,
    )

    class TestMyInferenceEngine(InferenceEngineConformance):
        def make_engine(self):  # sync or async; a fresh engine on every call
            return MyEngine()

    class TestMyTrainEngine(TrainEngineConformance):
        def make_engine(self):
            return MyTrainer()

    class TestMyWeightSync(WeightSyncConformance):
        def make_source(self):
            return MyTrainer()

        def make_targets(self):
            return [MyEngine(), MyEngine()]

        def make_sync(self, targets):
            return MyTransport(targets)

Every law is a test method running on fresh engines. A law that needs an optional ability
the engine lacks (detected with the runtime protocols ``SupportsPause``, ``SupportsSleep``,
``SupportsLoadWeights``), that the engine declares unavailable where it runs
(``unavailable_abilities``: vLLM on a CPU cannot sleep) or that the class declares it lacks
(``supports_seed_determinism``, ``supports_real_logprobs``, ``computes_loss``, a
``target_weights`` or ``make_other_engine`` hook, exported tensors that hold data) is skipped
with the reason.

Nothing may hang: each law runs its async body on a fresh event loop in a helper thread; every
await on the engine is bounded by ``timeout_s`` seconds of the loop's clock (a hung call fails
the law with a message naming the call) and the whole law by ``real_timeout_s`` real seconds
(an engine that blocks its event loop fails instead of stalling CI). ``virtual_clock = True``
runs the body on a ``VirtualClockLoop`` (for simulated engines that sleep on the loop's clock:
their seconds then cost nothing). The ``check_*`` functions hold reusable assertions.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import inspect
import math
import os
import pickle
import re
import tempfile
import threading
import time
import weakref
import zlib
from collections import Counter
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, cast

import pytest
import torch

from asyncflow_conformance._guard import run_on_fresh_loop
from asyncflow_conformance.shared import _Proxy
from asyncflow_core.contracts.errors import AsyncFlowError, EngineLostError, WeightSyncError
from asyncflow_core.contracts.protocols import (
    Batch,
    GenerationRequest,
    GenerationResult,
    InferenceEngine,
    LossFn,
    SamplingParams,
    SupportsLoadWeights,
    SupportsPause,
    SupportsProgress,
    SupportsRestart,
    SupportsSleep,
    TrainEngine,
    TrainMetrics,
    Version,
    WeightBucket,
    WeightSync,
    tensor_load_refusal,
    unavailable_ability,
)
from asyncflow_core.flow.vclock import SimulationDeadlockError
from asyncflow_core.sync.verify import SupportsWeightFingerprints
from asyncflow_core.training.rl import LOSS_MASK, policy_gradient_loss
from asyncflow_core.training.sampling import (
    OFF_SUPPORT_METRIC,
    SAMPLING_FIELDS,
    sampling_columns,
)

__all__ = [
    "BAD_REQUESTS",
    "FINISH_REASONS",
    "LOGPROB_SETTINGS",
    "PHASE_MISUSES",
    "InferenceEngineConformance",
    "TrainEngineConformance",
    "WeightSyncConformance",
    "bounded",
    "check_export",
    "check_generation_result",
    "padded_batch",
    "run_law",
    "same_bytes",
    "without_field",
]

T = TypeVar("T")

FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")
"""The finish reasons a ``GenerationResult`` may carry."""

HUGE_BUCKET = 1 << 62
"""A ``bucket_bytes`` no model reaches: one bucket may hold everything."""


# --------------------------------------------------------------------------------------------
# Running a law: a fresh loop in a watched thread, every await bounded
# --------------------------------------------------------------------------------------------
def run_law(
    make_main: Callable[[], Coroutine[Any, Any, None]],
    *,
    what: str,
    virtual_clock: bool = False,
    real_timeout_s: float = 300.0,
    deadlock_timeout_s: float = 10.0,
) -> None:
    """Run ``make_main()`` on a fresh event loop (a ``VirtualClockLoop`` if ``virtual_clock``)
    in a daemon thread, and re-raise here whatever it raised (an ``AssertionError`` of a law,
    pytest's skip). If it is still running after ``real_timeout_s`` real seconds it is
    cancelled and an ``AssertionError`` names ``what``; so is a virtual-clock deadlock."""
    run = run_on_fresh_loop(
        make_main, name=f"asyncflow-conformance: {what}", virtual_clock=virtual_clock,
        real_timeout_s=real_timeout_s, deadlock_timeout_s=deadlock_timeout_s,
    )  # fmt: skip
    if run.timed_out:
        raise AssertionError(
            f"{what}: still running after {real_timeout_s} s of real time and cancelled: the "
            "engine hangs while blocking its event loop (a timeout on the loop cannot fire), "
            "or the law needs a larger real_timeout_s"
            + ("" if not run.stuck else "; it ignored the cancellation too")
        )
    error = run.error
    if error is None:
        return
    if isinstance(error, SimulationDeadlockError):
        raise AssertionError(
            f"{what}: every coroutine waits and nothing can wake them (virtual clock): {error}"
        ) from error
    raise error


async def bounded(awaitable: Awaitable[T], timeout_s: float, what: str) -> T:
    """Await ``awaitable`` for at most ``timeout_s`` seconds of the loop's clock; past that,
    cancel it and fail with an ``AssertionError`` naming ``what`` (a ``TimeoutError`` the
    awaitable raises itself passes through unchanged)."""
    guard = asyncio.timeout(timeout_s)
    try:
        async with guard:
            return await awaitable
    except TimeoutError:
        if guard.expired():
            raise AssertionError(
                f"{what} did not return within {timeout_s} s (event-loop clock): a hang; if the "
                "engine is just slow, raise timeout_s"
            ) from None
        raise


async def settle() -> None:
    """Let every runnable coroutine on this loop run until it blocks (no sleeping)."""
    for _ in range(20):
        await asyncio.sleep(0)


async def _resolve(value: T | Awaitable[T]) -> T:
    if inspect.isawaitable(value):
        return cast(T, await value)
    return value


async def _close(obj: object) -> None:
    """Call ``obj.close()`` (awaiting it if it is a coroutine) when the object has one."""
    close = getattr(obj, "close", None)
    if callable(close):
        result = close()
        if inspect.isawaitable(result):
            await result


class _Suite:
    """The knobs and plumbing every engine suite shares."""

    pytestmark: ClassVar[list[pytest.MarkDecorator]] = [pytest.mark.conformance]

    virtual_clock: ClassVar[bool] = False
    """Run each law on a ``VirtualClockLoop`` (simulated engines that sleep on the loop's
    clock); False: a plain event loop, real time."""
    timeout_s: ClassVar[float] = 60.0
    """Seconds (on the loop's clock) any single call on an engine may take."""
    real_timeout_s: ClassVar[float] = 300.0
    """Real seconds a whole law may take before it is cancelled and fails."""
    deadlock_timeout_s: ClassVar[float] = 10.0
    """Virtual clock only: real seconds with nothing scheduled before a deadlock is reported."""
    known_failures: ClassVar[Mapping[str, str]] = {}
    """Laws the engine is known to fail, by test name (``"test_x"`` or ``"test_x[param]"``) ->
    reason: such a law is reported as an expected failure while it fails, and fails the run
    (strict) once it passes, so the entry is removed when the defect is fixed."""

    def _run(self, law: str, body: Callable[[], Coroutine[Any, Any, None]]) -> None:
        what = f"{type(self).__name__}.{law}"
        reason = self.known_failures.get(law)
        try:
            run_law(
                body,
                what=what,
                virtual_clock=self.virtual_clock,
                real_timeout_s=self.real_timeout_s,
                deadlock_timeout_s=self.deadlock_timeout_s,
            )
        except AssertionError as exc:
            if reason is None:
                raise
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else "AssertionError"
            pytest.xfail(f"known failure: {reason} ({first})")
        if reason is not None:
            pytest.fail(
                f"{what} is listed in known_failures ({reason!r}) but passed: remove the entry",
                pytrace=False,
            )

    async def close_engine(self, engine: Any) -> None:
        """Release an engine after a law (default: its ``close()``, if it has one)."""
        await _close(engine)

    def _engine_law(
        self,
        name: str,
        body: Callable[[Any], Coroutine[Any, Any, None]],
        protocol: type,
        lacks: str,
    ) -> None:
        """Run ``body`` on a fresh engine from ``make_engine()`` (which must implement
        ``protocol``; ``lacks`` completes the error otherwise), closing it afterwards."""

        async def main() -> None:
            make = self.make_engine  # type: ignore[attr-defined]
            engine = await self._wait(_resolve(make()), "make_engine()")
            assert isinstance(engine, protocol), (
                f"make_engine() returned {type(engine).__name__}, which lacks {lacks}"
            )
            try:
                await body(engine)
            except BaseException:
                with contextlib.suppress(Exception):
                    await self._wait(self.close_engine(engine), "close_engine()")
                raise
            await self._wait(self.close_engine(engine), "close_engine()")

        self._run(name, main)

    engine_is_shared: ClassVar[bool] = False
    """``make_engine`` hands out one engine shared across laws (``close_engine`` does not close
    it): the law on what ``close()`` releases is skipped."""
    release_timeout_s: ClassVar[float] = 60.0
    """Real seconds a closed engine's threads and processes get to end (a safety net: the law
    returns as soon as they have)."""

    def _close_law(
        self,
        name: str,
        protocol: type,
        lacks: str,
        use: Callable[[Any], Coroutine[Any, Any, None]],
    ) -> None:
        """Build an engine, ``use`` it, ``close_engine`` it: every asyncio task, thread and
        child process that appeared since just before ``make_engine()`` must be gone."""
        if self.engine_is_shared:
            pytest.skip("the engine is shared across laws (engine_is_shared): it is not closed")

        async def main() -> None:
            threads = set(threading.enumerate())
            tasks = asyncio.all_tasks()
            children = _child_pids()
            make = self.make_engine  # type: ignore[attr-defined]
            engine = await self._wait(_resolve(make()), "make_engine()")
            assert isinstance(engine, protocol), (
                f"make_engine() returned {type(engine).__name__}, which lacks {lacks}"
            )
            if isinstance(engine, _Proxy):
                pytest.skip("the engine is an EngineHost's, shared across laws: it is not closed")
            try:
                await use(engine)
            finally:
                await self._wait(self.close_engine(engine), "close_engine()")
            await settle()
            me = asyncio.current_task()
            started = [t for t in asyncio.all_tasks() - tasks if t is not me and not t.done()]
            if started:  # cancelled ones finish at their next step
                await asyncio.wait(started, timeout=self.release_timeout_s)
            left = sorted(_task_name(t) for t in started if not t.done())
            assert not left, (
                f"after close_engine() these asyncio tasks the engine started still run: {left}; "
                "close() must cancel (and await) its background tasks"
            )
            deadline = time.monotonic() + self.release_timeout_s
            new = [
                t
                for t in threading.enumerate()
                if t not in threads and not t.name.startswith("asyncio_")  # the loop's own pool
            ]
            for thread in new:
                thread.join(max(0.0, deadline - time.monotonic()))
            alive = sorted(t.name for t in new if t.is_alive())
            assert not alive, (
                f"{self.release_timeout_s:.0f} s after close_engine() these threads the engine "
                f"started were still alive: {alive}; close() must stop its worker threads "
                "(e.g. executor.shutdown())"
            )
            spawned = _child_pids() - children
            while spawned and time.monotonic() < deadline:
                spawned = {pid for pid in spawned if _running(pid)}
                if spawned:
                    time.sleep(0.05)
            spawned = {pid for pid in spawned if _running(pid)}
            assert not spawned, (
                f"{self.release_timeout_s:.0f} s after close_engine() the child process(es) "
                f"{sorted(spawned)} the engine started were still running; close() must end them"
            )

        self._run(name, main)

    async def _wait(self, awaitable: Awaitable[T], what: str) -> T:
        return await bounded(awaitable, self.timeout_s, what)

    async def _transfer(
        self,
        sync: WeightSync,
        trainer: TrainEngine,
        version: Version,
        bucket_bytes: int,
        *,
        init: bool,
    ) -> None:
        """One weight sync of ``trainer``'s weights as ``version``: ``init()`` (when ``init``),
        ``start()``, ``update`` with every bucket of ``export_weights``, ``finish(version)``,
        each under the suite's timeout."""
        if init:
            await self._wait(sync.init(), "init()")
        await self._wait(sync.start(), "start()")
        iterator = trainer.export_weights(bucket_bytes).__aiter__()
        while True:
            try:
                bucket = await self._wait(iterator.__anext__(), "export_weights: next bucket")
            except StopAsyncIteration:
                break
            await self._wait(sync.update(bucket), "update(bucket)")
        await self._wait(sync.finish(version), f"finish({version})")

    async def _expect_error(self, awaitable: Awaitable[Any], what: str) -> AsyncFlowError:
        """``awaitable`` must raise an ``AsyncFlowError`` subclass with a message."""
        try:
            await self._wait(awaitable, what)
        except AsyncFlowError as exc:
            assert str(exc).strip(), (
                f"{what} raised {type(exc).__name__} with an empty message; name the bad "
                "value and what to do"
            )
            return exc
        except AssertionError:
            raise
        except Exception as exc:
            raise AssertionError(
                f"{what} raised {type(exc).__name__}: {exc}; a rejected call must raise an "
                "asyncflow_core.contracts.errors.AsyncFlowError subclass (e.g. EngineError)"
            ) from exc
        raise AssertionError(f"{what} was accepted; it must raise an AsyncFlowError subclass")

    lose: ClassVar[Callable[[Any, Any], Awaitable[None] | None] | None] = None
    """Hook ``lose(self, engine)`` (sync or async): make ``engine`` lost as a crash would
    (kill its worker process, server or actor) and return. Default None: the lost-engine law
    is skipped."""

    fail_steps: ClassVar[Callable[[Any, Any], Callable[[], None]] | None] = None
    """Hook ``fail_steps(self, engine)``: make every later model step of ``engine`` raise (as
    an out-of-memory error or a kernel bug would: e.g. patch its forward) and return a function
    that undoes it. Default None: the failed-step law is skipped."""

    def _require_lose(self) -> None:
        if self.lose is None:
            pytest.skip(
                "no lose(engine) hook: the suite cannot make the engine lost; give the class a "
                "method lose(self, engine) that kills the engine's worker process, server or "
                "actor (e.g. os.kill(engine.pid, signal.SIGKILL))"
            )

    async def _lose(self, engine: Any) -> None:
        assert self.lose is not None
        await self._wait(_resolve(self.lose(engine)), "lose(engine)")

    async def _expect_lost(self, awaitable: Awaitable[Any], what: str, when: str) -> None:
        """``awaitable``, a call on a lost engine, must raise ``EngineLostError`` within
        ``timeout_s``; ``when`` says which call it is, for the message."""
        try:
            value = await bounded(awaitable, self.timeout_s, what)
        except EngineLostError:
            return
        except AssertionError as exc:
            if "did not return within" not in str(exc):
                raise
            raise AssertionError(
                f"{what}, {when}, did not return within {self.timeout_s} s: a call on a lost "
                "engine must fail with EngineLostError at once, never wait for an engine that "
                "is gone (when the host's pipe, connection or actor reports the loss, fail "
                "every call waiting on it: asyncflow_core.engines.process does)"
            ) from None
        except Exception as exc:
            raise AssertionError(
                f"{what}, {when}, raised {type(exc).__name__}: {exc}; a lost engine's calls "
                "raise asyncflow_core.contracts.errors.EngineLostError (or a subclass): an RL "
                "job takes a lost rollout engine out and sends its requests to the others, "
                "any other error stops the job"
            ) from exc
        shown = (
            f"a result ({value.finish_reason!r}, {len(value.tokens)} tokens)"
            if isinstance(value, GenerationResult)
            else _type_name(value)
        )
        raise AssertionError(
            f"{what}, {when}, returned {shown} instead of raising EngineLostError: every "
            "call on a lost engine fails, until a restart (SupportsRestart)"
        )


# --------------------------------------------------------------------------------------------
# Checks usable outside the classes
# --------------------------------------------------------------------------------------------
def check_resumed_prefix(request: GenerationRequest, result: GenerationResult, what: str) -> int:
    """The resume law: a result starts with the request's ``resume_tokens``, with their
    versions and (to float tolerance) log-probs unchanged. Returns the prefix's length."""
    k = len(request.resume_tokens)
    if k:
        assert tuple(result.tokens[:k]) == tuple(request.resume_tokens), (
            f"{what}: resumed {k} tokens but the result does not start with them"
        )
        assert tuple(result.versions[:k]) == tuple(request.resume_versions), (
            f"{what}: the resumed prefix's versions {tuple(request.resume_versions)} came back "
            f"as {tuple(result.versions[:k])}; resumed tokens keep their versions"
        )
        same = all(
            math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)
            for a, b in zip(result.logprobs[:k], request.resume_logprobs, strict=True)
        )
        assert same, f"{what}: the resumed prefix's log-probs changed"
    return k


def check_generation_result(
    request: GenerationRequest,
    result: GenerationResult,
    *,
    submitted_version: Version,
    current_version: Version,
    vocab_size: int | None = None,
    context_window: int | None = None,
    where: str = "",
) -> None:
    """The result law: one token, log-prob and version per token; the request's id and prompt
    echoed; ``finish_reason`` in ``FINISH_REASONS``; at most ``max_tokens`` tokens in all
    (resumed ones included), exactly that many when ``length`` (or prompt + response filling
    ``context_window``, if given), at least one (the stop token)
    when ``stop``; the resumed prefix returned unchanged; every new log-prob finite and
    ``<= 0``; new tokens report non-decreasing versions between ``submitted_version`` (the
    engine's version when the request was submitted) and ``current_version`` (its version when
    the result came back); token ids in ``[0, vocab_size)`` if given."""
    rid = request.request_id
    what = f"{where}: request {rid!r}" if where else f"request {rid!r}"
    assert isinstance(result, GenerationResult), (
        f"{what}: generate returned {type(result).__name__}, not a GenerationResult"
    )
    assert result.request_id == rid, f"{what}: the result names request {result.request_id!r}"
    assert tuple(result.prompt_tokens) == tuple(request.prompt_tokens), (
        f"{what}: the result's prompt_tokens {tuple(result.prompt_tokens)[:8]}... are not the "
        "request's prompt"
    )
    n = len(result.tokens)
    assert n == len(result.logprobs) == len(result.versions), (
        f"{what}: {n} tokens, {len(result.logprobs)} log-probs and {len(result.versions)} "
        "versions; a result needs exactly one of each per token"
    )
    reason = result.finish_reason
    assert reason in FINISH_REASONS, f"{what}: finish_reason {reason!r} not in {FINISH_REASONS}"
    cap = request.params.max_tokens
    assert n <= cap, (
        f"{what}: {n} tokens (resumed ones included) for max_tokens={cap}; max_tokens caps the "
        "whole response"
    )
    if reason == "length":
        full = context_window is not None and len(request.prompt_tokens) + n >= context_window
        assert n == cap or full, (
            f"{what}: finish_reason 'length' with {n} tokens, but max_tokens is {cap}; "
            "'length' means the cap (or the context_window, when declared) was reached"
        )
    if reason == "stop":
        assert n >= 1, f"{what}: finish_reason 'stop' with no token; the stop token is included"
    k = check_resumed_prefix(request, result, what)
    stops = set(request.params.stop_token_ids)
    if stops:
        # a stop token ends the request where it is sampled: none before the last new token,
        # and none at all unless the result says "stop" (an engine may also stop on its own
        # end-of-sequence token, which the request does not name)
        last = n - 1 if reason == "stop" else n
        early_stop = [i for i in range(k, last) if result.tokens[i] in stops]
        assert not early_stop, (
            f"{what}: new token {early_stop[0]} is {result.tokens[early_stop[0]]}, one of the "
            f"request's stop_token_ids {sorted(stops)}, yet the request went on to "
            f"{n} tokens ({reason!r}); a stop token ends the request with 'stop', the token "
            "included"
        )
    for i in range(k, n):
        token, lp = result.tokens[i], result.logprobs[i]
        assert isinstance(token, int), f"{what}: token {i} is {token!r}, not an int"
        if vocab_size is not None:
            assert 0 <= token < vocab_size, (
                f"{what}: token {i} is {token}, outside the vocabulary [0, {vocab_size})"
            )
        assert math.isfinite(lp) and lp <= 1e-4, (
            f"{what}: token {i} has log-prob {lp}; a sampled token's log-prob is finite and <= 0"
        )
    new_versions = tuple(result.versions[k:])
    early = sorted({v for v in new_versions if v < submitted_version})
    assert not early, (
        f"{what}: submitted at weight version {submitted_version}, yet new tokens report "
        f"version(s) {early}; after version v is loaded every sampled token reports >= v"
    )
    late = sorted({v for v in new_versions if v > current_version})
    assert not late, (
        f"{what}: tokens report version(s) {late}, newer than the engine's weight_version "
        f"{current_version} when the result came back"
    )
    decreasing = [i for i in range(1, len(new_versions)) if new_versions[i] < new_versions[i - 1]]
    assert not decreasing, (
        f"{what}: versions decrease along the sequence at new token {decreasing[0]} "
        f"({new_versions[decreasing[0] - 1]} -> {new_versions[decreasing[0]]})"
    )


def _not_plain(result: GenerationResult) -> list[str]:
    """What in ``result`` is not a plain Python value of its declared type, or does not come
    back equal from a pickle round trip (empty: all plain)."""
    problems: list[str] = []
    if type(result.request_id) is not str:
        problems.append(f"request_id is a {_type_name(result.request_id)}, not str")
    if type(result.finish_reason) is not str:
        problems.append(f"finish_reason is a {_type_name(result.finish_reason)}, not str")
    for name, kind in (("tokens", int), ("logprobs", float), ("versions", int)):
        value = getattr(result, name)
        if type(value) is not tuple:
            problems.append(f"{name} is a {_type_name(value)}, not a tuple")
            continue
        odd = [(i, x) for i, x in enumerate(value) if type(x) is not kind]
        if odd:
            i, x = odd[0]
            problems.append(
                f"{name}[{i}] is a {_type_name(x)} ({x!r:.40}), not {kind.__name__} "
                f"({len(odd)} of {len(value)} items)"
            )
    if problems:
        return problems
    fields = [f.name for f in dataclasses.fields(GenerationResult)]
    try:
        copy = pickle.loads(pickle.dumps(result))
    except Exception as exc:
        return [f"does not pickle: {type(exc).__name__}: {exc}"]
    changed = [n for n in fields if getattr(copy, n) != getattr(result, n)]
    if changed:
        problems.append(f"fields {changed} changed through pickle")
    return problems


def _type_name(value: object) -> str:
    kind = type(value)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when the two tensors have the same dtype, shape and bytes (NaNs compare by bits)."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    if a.numel() == 0:
        return True
    left = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    right = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(left, right)


def _describe_tensor(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} on {t.device}"


def check_export(
    buckets: Sequence[WeightBucket], bucket_bytes: int, where: str = "export_weights"
) -> dict[str, torch.Tensor]:
    """The export law for one ``export_weights(bucket_bytes)``: every item is a
    ``WeightBucket`` with one name per tensor; no parameter appears twice; a bucket holding
    more than one tensor is at most ``bucket_bytes`` (a tensor bigger than that travels alone).
    Returns the parameters by name."""
    named: dict[str, torch.Tensor] = {}
    for i, bucket in enumerate(buckets):
        assert isinstance(bucket, WeightBucket), (
            f"{where}: item {i} is {type(bucket).__name__}, not a WeightBucket"
        )
        assert len(bucket.names) == len(bucket.tensors), (
            f"{where}: bucket {i} has {len(bucket.names)} names for {len(bucket.tensors)} tensors"
        )
        for name, tensor in bucket:
            assert isinstance(tensor, torch.Tensor), f"{where}: {name!r} is not a tensor"
            assert name not in named, (
                f"{where}: parameter {name!r} was exported twice (buckets must hold every "
                "parameter exactly once)"
            )
            named[name] = tensor
        if len(bucket.tensors) > 1:
            assert bucket.nbytes <= bucket_bytes, (
                f"{where}: bucket {i} holds {len(bucket.tensors)} tensors, {bucket.nbytes} bytes, "
                f"over bucket_bytes={bucket_bytes}; only a tensor bigger than bucket_bytes may "
                "exceed it, alone in its bucket"
            )
    return named


def padded_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    advantages: Sequence[float],
    *,
    pad: int = 0,
) -> Batch:
    """A ``Batch`` in the store's "padded" layout: ``prompt`` and ``response`` ``[B, max_len]``
    int64 (padded with ``pad``) with their ``lengths``, and ``advantage`` ``[B]`` float32."""
    if not len(prompts) == len(responses) == len(advantages):
        raise ValueError("padded_batch: pass one prompt, response and advantage per row")

    def pack(rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max((len(r) for r in rows), default=0)
        data = torch.full((len(rows), width), pad, dtype=torch.int64)
        for i, row in enumerate(rows):
            data[i, : len(row)] = torch.tensor(list(row), dtype=torch.int64)
        return data, torch.tensor([len(r) for r in rows], dtype=torch.int64)

    prompt, prompt_len = pack(prompts)
    response, response_len = pack(responses)
    return Batch(
        rows=tuple(range(len(prompts))),
        data={
            "prompt": prompt,
            "response": response,
            "advantage": torch.tensor(list(advantages), dtype=torch.float32),
        },
        lengths={"prompt": prompt_len, "response": response_len},
    )


def without_field(batch: Batch, name: str) -> Batch:
    """``batch`` without ``name`` (neither its data nor its lengths)."""
    return Batch(
        rows=batch.rows,
        data={k: v for k, v in batch.data.items() if k != name},
        lengths={k: v for k, v in batch.lengths.items() if k != name},
        tags=batch.tags,
    )


def _negated_advantages(batch: Batch) -> Batch:
    """``batch`` with its ``advantage`` field negated (unchanged if it has none)."""
    value = batch.data.get("advantage")
    if not isinstance(value, torch.Tensor):
        return batch
    return Batch(batch.rows, {**batch.data, "advantage": -value}, dict(batch.lengths), batch.tags)


def _with_sampling(batch: Batch, params: SamplingParams) -> Batch:
    """``batch`` with every row's sampling fields set to ``params``' ([B] tensors)."""
    cells = sampling_columns([params] * len(batch))
    columns = {name: torch.stack(values) for name, values in cells.items()}
    return Batch(batch.rows, {**batch.data, **columns}, dict(batch.lengths), batch.tags)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return float((a.detach().double() - b.detach().double()).abs().max())


def _digest(t: torch.Tensor) -> int:
    """A cheap fingerprint of a tensor's bytes (equal tensors, equal fingerprints)."""
    flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return hash(flat[:4096].numpy().tobytes()) ^ int(flat.shape[0])


def _outcome(task: asyncio.Future[GenerationResult]) -> str:
    """How a finished ``generate`` ended, for messages."""
    if task.cancelled():
        return "cancelled"
    error = task.exception()
    if error is not None:
        return f"raised {type(error).__name__}: {error}"
    result = task.result()
    return f"finish_reason {result.finish_reason!r} with {len(result.tokens)} tokens"


def _binomial_tail(n: int, k: int, p: float) -> float:
    """Two-sided exact binomial p-value of ``k`` successes in ``n`` draws of probability ``p``."""
    p = min(max(p, 0.0), 1.0)
    pmf = [math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(n + 1)]
    low, high = sum(pmf[: k + 1]), sum(pmf[k:])
    return min(1.0, 2 * min(low, high))


# --------------------------------------------------------------------------------------------
# InferenceEngine
# --------------------------------------------------------------------------------------------
BadRequest = Literal[
    "negative-max-tokens",
    "resume-without-logprobs",
    "resume-longer-than-max-tokens",
    "duplicate-in-flight-id",
]
BAD_REQUESTS: tuple[BadRequest, ...] = (
    "negative-max-tokens",
    "resume-without-logprobs",
    "resume-longer-than-max-tokens",
    "duplicate-in-flight-id",
)
"""The malformed requests an engine must reject with an ``AsyncFlowError`` subclass: a
negative ``max_tokens``; resumed tokens without one log-prob and version each; a resumed
prefix longer than ``max_tokens`` (no result could both echo it and respect the cap); an id
already in flight."""


def _task_name(task: asyncio.Task[Any]) -> str:
    coro = task.get_coro()
    return f"{task.get_name()} ({getattr(coro, '__qualname__', type(coro).__name__)})"


_SHARED_HELPERS = (b"multiprocessing.resource_tracker", b"multiprocessing.forkserver")
"""Child processes Python starts once and keeps for the interpreter's life (the first spawned
process starts them): not the engine's."""


def _child_pids() -> set[int]:
    """This process's child processes (Linux ``/proc``; empty elsewhere), but Python's own
    long-lived multiprocessing helpers."""
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/children") as f:
                found.update(int(pid) for pid in f.read().split())
    helpers = set()
    for pid in found:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read()
            if any(name in command for name in _SHARED_HELPERS):
                helpers.add(pid)
    return found - helpers


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (exited, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _runs(versions: Sequence[Version]) -> str:
    """``[0, 0, 0, 1, 1]`` as ``0x3 1x2``: a sequence's versions, for messages."""
    out: list[str] = []
    for v in versions:
        if out and out[-1].split("x")[0] == str(v):
            head, count = out[-1].split("x")
            out[-1] = f"{head}x{int(count) + 1}"
        else:
            out.append(f"{v}x1")
    return " ".join(out) or "(none)"


def _rounded(q: Mapping[int, float]) -> dict[int, float]:
    return {t: round(p, 4) for t, p in sorted(q.items(), key=lambda kv: -kv[1])}


def _one_token_left(setting: SamplingParams) -> tuple[str, str] | None:
    """For a sampling setting that leaves one token (a tie aside): how the log-prob law names
    it and the usual cause of a failure; None for any other setting."""
    if setting.temperature > 0 and setting.top_k == 1:
        return (
            "with top_k=1",
            "The engine ignores top_k, or reports log-probs from before the filters",
        )
    if 0 < setting.temperature < ONE_TOKEN_TEMPERATURE:
        return (
            f"at temperature {setting.temperature:g}",
            "The engine reports the log-probs of another temperature (e.g. it decodes tiny "
            "temperatures greedily and reports them at temperature 1, as SGLang does)",
        )
    return None


def _bite_top_p(q: Mapping[int, float], temperature: float) -> tuple[float, set[int]] | None:
    """A ``top_p`` that keeps exactly the two most probable tokens of ``q`` (top-k's
    renormalised distribution at ``temperature``), with a margin on both sides and, where one
    exists, a value at which the same tokens at temperature 1 would keep another number (so
    top-p applied before the temperature draws otherwise); None on near-ties."""
    order = sorted(q, key=lambda t: q[t], reverse=True)
    if len(order) < 3:
        return None
    p = [q[t] for t in order]
    margin = 0.005  # the engine's own numbers: rounding is far below this
    if p[1] - p[2] < 1e-3 or p[1] < 2 * margin:
        return None
    low, high = p[0] + margin, p[0] + p[1] - margin
    if temperature != 1.0:  # q at temperature 1 is q ** temperature, renormalised
        raw = [x**temperature for x in p]
        one, two = raw[0] / sum(raw), (raw[0] + raw[1]) / sum(raw)
        apart = [(low, min(high, one - margin)), (max(low, two + margin), high)]
        wide = max(apart, key=lambda span: span[1] - span[0])
        if wide[1] > wide[0]:
            low, high = wide
    if low > high:
        return None
    return (low + high) / 2, set(order[:2])


def _take_rows(batch: Batch, order: Sequence[int]) -> Batch:
    """``batch``'s rows in ``order`` (repeats allowed), in every field, length and tag, as
    copies (a list layout shares its row tensors); row ids numbered afresh."""
    b = len(batch) or len(next(iter(batch.lengths.values()), ()))
    index = torch.tensor(list(order), dtype=torch.long)
    data: dict[str, Any] = {}
    for name, value in batch.data.items():
        if isinstance(value, torch.Tensor) and value.is_nested:
            rows = list(value.unbind())
            data[name] = torch.nested.nested_tensor([rows[i] for i in order], layout=torch.jagged)
        elif isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == b:
            data[name] = value.index_select(0, index)
        elif isinstance(value, list | tuple) and len(value) == b:
            data[name] = [value[i] for i in order]
        else:
            data[name] = value
    lengths = {name: value.index_select(0, index) for name, value in batch.lengths.items()}
    tags = tuple(batch.tags[i] for i in order) if len(batch.tags) == b else batch.tags
    return Batch(tuple(range(len(order))), data, lengths, tags)


def _copied(batch: Batch) -> Batch:
    """``batch`` with every tensor (of ``data``, lists included, and ``lengths``) cloned."""

    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.clone()
        if isinstance(value, list | tuple) and any(isinstance(v, torch.Tensor) for v in value):
            return [copy(v) for v in value]
        return value

    data = {name: copy(value) for name, value in batch.data.items()}
    lengths = {name: value.clone() for name, value in batch.lengths.items()}
    return Batch(batch.rows, data, lengths, batch.tags)


def _batch_tensors(batch: Batch) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of ``batch``'s ``data`` (each row of a list layout) and ``lengths``."""
    found: list[tuple[str, torch.Tensor]] = []
    for name, value in batch.data.items():
        if isinstance(value, torch.Tensor):
            found.append((f"data[{name!r}]", value))
        elif isinstance(value, list | tuple):
            found += [(f"data[{name!r}][{i}]", v) for i, v in enumerate(value)
                      if isinstance(v, torch.Tensor)]  # fmt: skip
    found += [(f"lengths[{name!r}]", value) for name, value in batch.lengths.items()]
    return found


_NOT_A_TOKEN = (1 << 31) - 1
"""A token id outside any vocabulary."""


def _with_bad_last_row(batch: Batch, field: str, lengths: Sequence[int]) -> Batch | None:
    """``batch`` plus a copy of its longest row whose first ``field`` token is ``_NOT_A_TOKEN``;
    None unless ``field`` is padded (``[B, R]``) or a list of rows."""
    longest = max(range(len(lengths)), key=lambda i: lengths[i], default=None)
    if longest is None or lengths[longest] < 1:
        return None
    out = _take_rows(batch, [*range(len(batch)), longest])
    value = out.data.get(field)
    if isinstance(value, torch.Tensor) and not value.is_nested and value.dim() == 2:
        value = value.clone()
        value[-1, 0] = _NOT_A_TOKEN
    elif isinstance(value, list) and value and isinstance(value[-1], torch.Tensor):
        last = value[-1].clone()
        last[0] = _NOT_A_TOKEN
        value = [*value[:-1], last]
    else:
        return None
    out.data[field] = value
    return out


def metrics_apart(a: TrainMetrics, b: TrainMetrics) -> float:
    """The larger relative difference of two steps' loss and grad norm (the laws compare
    steps by these: Adam's first step turns rounding noise in a gradient into a full step)."""
    return max(
        abs(x - y) / max(abs(x), abs(y), 1e-6)
        for x, y in ((a.loss, b.loss), (a.grad_norm, b.grad_norm))
    )


def _one_token_rows(batch: Batch, field: str, vocab: int) -> Batch | None:
    """``vocab`` copies of ``batch``'s first row, row ``j``'s ``field`` the one token ``j``
    (a ``loss_mask`` set to train it); None unless ``field`` is padded or a list of rows."""
    out = _take_rows(batch, [0] * vocab)
    value = out.data.get(field)
    tokens = torch.arange(vocab, dtype=torch.int64)
    if isinstance(value, torch.Tensor) and not value.is_nested and value.dim() == 2:
        out.data[field] = tokens.to(value.dtype).unsqueeze(1)
        out.lengths[field] = torch.ones(vocab, dtype=torch.int64)
    elif isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
        out.data[field] = [tokens[j : j + 1].to(value[0].dtype) for j in range(vocab)]
        if field in out.lengths:
            out.lengths[field] = torch.ones(vocab, dtype=torch.int64)
    else:
        return None
    if LOSS_MASK in out.data:
        out.data[LOSS_MASK] = torch.ones(vocab, 1, dtype=torch.uint8)
        out.lengths.pop(LOSS_MASK, None)
    return out


def _masked_tails(batch: Batch, field: str, lengths: Sequence[int]) -> tuple[Batch | None, Batch]:
    """``(masked, cut)``: ``batch`` with a ``loss_mask`` that zeroes a tail of several rows'
    responses (uneven shares, so micro-batches weigh differently by all tokens than by trained
    ones), and ``batch`` with those tails cut off (no mask). ``(None, batch)`` when no row has
    two response tokens or the layout is neither padded (``[B, R]`` with ``lengths``) nor a
    list of rows."""
    tails = [(n - 1 if i % 2 == 0 else 0) if n >= 2 else 0 for i, n in enumerate(lengths)]
    if not any(tails):
        return None, batch
    keep = [n - t for n, t in zip(lengths, tails, strict=True)]
    value = batch.data.get(field)
    data = dict(batch.data)
    sizes = dict(batch.lengths)
    if isinstance(value, torch.Tensor) and value.dim() == 2 and field in batch.lengths:
        width = int(value.shape[1])
        mask = torch.zeros(len(lengths), width, dtype=torch.uint8)
        for i, n in enumerate(keep):
            mask[i, :n] = 1
        masked = Batch(batch.rows, {**data, LOSS_MASK: mask}, sizes, batch.tags)
        ref = batch.lengths[field]
        cut_lengths = torch.tensor(keep, dtype=ref.dtype).reshape(ref.shape)
        cut = Batch(batch.rows, data, {**sizes, field: cut_lengths}, batch.tags)
        return masked, cut
    if isinstance(value, list | tuple) and all(isinstance(t, torch.Tensor) for t in value):
        rows = [torch.ones(n, dtype=torch.uint8) for n in lengths]
        for i, n in enumerate(keep):
            rows[i][n:] = 0
        masked = Batch(batch.rows, {**data, LOSS_MASK: rows}, sizes, batch.tags)
        cut_rows = [t[:n] for t, n in zip(value, keep, strict=True)]
        cut = Batch(batch.rows, {**data, field: cut_rows}, sizes, batch.tags)
        return masked, cut
    return None, batch


def _malformed_batches(batch: Batch, field: str, lengths: Sequence[int]) -> list[tuple[str, Batch]]:
    """``(kind, batch)``: ``batch`` made malformed in one way each, where its layout allows:
    its ``field`` (and that field's lengths) one row short; one ``field`` row of a list layout
    ``[1, n]`` instead of ``[n]``; a list-layout ``loss_mask`` whose first row is one value
    short of its response; a ``[B]`` ``loss_mask`` (one value per row, not per token)."""
    out: list[tuple[str, Batch]] = []
    b = len(lengths)
    value = batch.data.get(field)
    if isinstance(value, torch.Tensor) and not value.is_nested and value.dim() == 2 and b >= 2:
        sizes = dict(batch.lengths)
        if field in sizes:
            sizes[field] = sizes[field][: b - 1]
        short = Batch(batch.rows, {**batch.data, field: value[: b - 1]}, sizes, batch.tags)
        out.append(("response-missing-a-row", short))
        rows = [value[i, : lengths[i]].clone() for i in range(b)]
        listed = Batch(batch.rows, {**batch.data, field: rows}, dict(batch.lengths), batch.tags)
    elif isinstance(value, list) and all(isinstance(t, torch.Tensor) for t in value):
        rows = [t.clone() for t in value]
        listed = batch
    else:
        return out
    if lengths and lengths[0] >= 1:
        bent = [rows[0].reshape(1, -1), *rows[1:]]
        out.append(
            (
                "list-response-row-not-1-D",
                Batch(batch.rows, {**listed.data, field: bent}, dict(listed.lengths), batch.tags),
            )
        )
        mask = [torch.ones(n, dtype=torch.uint8) for n in lengths]
        mask[0] = mask[0][:-1]
        out.append(
            ("loss-mask-row-of-wrong-length",
             Batch(batch.rows, {**batch.data, LOSS_MASK: mask}, dict(batch.lengths), batch.tags))
        )  # fmt: skip
    flat = torch.ones(b, dtype=torch.uint8)
    out.append(
        ("loss-mask-not-one-row-per-response",
         Batch(batch.rows, {**batch.data, LOSS_MASK: flat}, dict(batch.lengths), batch.tags))
    )  # fmt: skip
    return out


def _listed(batch: Batch, names: Sequence[str], lengths: Sequence[int] | None = None) -> Batch:
    """``batch`` with fields ``names`` in the "list" layout: a ``[B]`` field as B 0-dim
    tensors, a ``[B, R]`` one as B 1-D rows of ``lengths`` (their lengths dropped)."""
    data = dict(batch.data)
    sizes = dict(batch.lengths)
    for name in names:
        value = data.get(name)
        if not isinstance(value, torch.Tensor) or value.is_nested:
            continue
        if value.dim() == 1:
            data[name] = [value[i].clone() for i in range(int(value.shape[0]))]
        elif value.dim() == 2 and lengths is not None:
            data[name] = [value[i, : lengths[i]].clone() for i in range(int(value.shape[0]))]
            sizes.pop(name, None)
    return Batch(batch.rows, data, sizes, batch.tags)


@dataclass(frozen=True)
class _BrokenLoss:
    """``good``'s loss and metrics, returned as ``how`` says: ``"probe"`` (correct, plus the
    metric ``PROBE`` = 1.0), ``"three-tuple"``, ``"bare-loss"``, ``"metric-a-string"``,
    ``"metric-none"``. A module-level class: it pickles to a trainer in another process."""

    PROBE: ClassVar[str] = "conformance_probe"
    good: LossFn
    how: str

    def __call__(self, logprobs: torch.Tensor, batch: Batch) -> Any:
        loss, metrics = self.good(logprobs, batch)
        if self.how == "probe":
            return loss, {**metrics, self.PROBE: 1.0}
        if self.how == "three-tuple":
            return loss, metrics, {}
        if self.how == "bare-loss":
            return loss
        return loss, {**metrics, self.PROBE: "abc" if self.how == "metric-a-string" else None}


_LATE_LAW = "test_abort_right_after_submit_is_not_lost"


def _late_message(evidence: str) -> str:
    return (
        "First cause: the engine registers a request late. One event-loop step after "
        f"generate() was called the request was not in flight ({evidence}). Register its id "
        "before generate's first await (the protocol's rule; the law "
        f"{_LATE_LAW} holds it): an abort, pause, load or wait right after the call otherwise "
        "finds nothing, and the laws acting on requests in flight fail for that reason."
    )


BadLoad = Literal["unknown-name", "wrong-shape"]
BAD_LOADS: tuple[BadLoad, ...] = ("unknown-name", "wrong-shape")
"""The malformed loads ``load_weights`` must reject whole: an unknown name, or a tensor of the
wrong shape, after every valid tensor."""


@dataclass
class _Gen:
    """A submitted ``generate``: the request, its task and the engine's version then."""

    request: GenerationRequest
    task: asyncio.Future[GenerationResult]
    version: Version


ProgressHook = Callable[[str, int], Awaitable[int]]
"""``hook(request_id, count)``: returns once the request has ``count`` tokens or has ended."""


class _Pace:
    """When to act on long requests for an engine that gives no evidence of progress (no
    ``SupportsProgress``): a quarter of a measured full generation at first, then adjusted by
    what each attempt saw — the requests finished first (too late: act sooner, down to right
    after submission) or had no token yet (too early: act later)."""

    def __init__(self) -> None:
        self.full_s: float | None = None  # loop seconds of one whole long request, measured
        self.early = 0.0  # the latest delay known to be too early
        self.late = math.inf  # the earliest delay known to be too late
        self.last = 0.0  # the delay the last attempt used

    def measured(self, seconds: float) -> None:
        if self.full_s is None:
            self.full_s = max(seconds, 0.0)

    def next(self) -> float:
        if self.early > 0 and self.late < math.inf:
            delay = math.sqrt(self.early * self.late)
        elif self.late < math.inf:
            delay = self.late / 8
        elif self.early > 0:
            delay = self.early * 4
        else:
            delay = (self.full_s or 0.0) / 4
        self.last = delay if delay >= 1e-4 else 0.0  # below that: right after submission
        return self.last

    def too_late(self) -> None:
        self.late = min(self.late, self.last)

    def too_early(self) -> None:
        self.early = max(self.early, self.last)


LOGPROB_SETTINGS: tuple[tuple[str, SamplingParams], ...] = (
    ("t1", SamplingParams(max_tokens=1, temperature=1.0)),
    ("t0.6", SamplingParams(max_tokens=1, temperature=0.6)),
    ("top_k=1", SamplingParams(max_tokens=1, temperature=1.0, top_k=1)),
    ("t0.8-top_k=3-top_p=0.9", SamplingParams(max_tokens=1, temperature=0.8, top_k=3, top_p=0.9)),
    ("t1e-7", SamplingParams(max_tokens=1, temperature=1e-7)),
)
"""The sampling settings the log-prob distribution law runs under (id, params)."""

ONE_TOKEN_TEMPERATURE = 1e-6
"""A temperature in (0, this) leaves one token of the sampling distribution (or a tie): the
logits divided by it are millions apart, as ``top_k=1`` leaves one."""


class InferenceEngineConformance(_Suite):
    """The ``InferenceEngine`` laws; subclass it (as ``Test...``) and implement
    ``make_engine``. Class attributes size the requests and declare what the engine cannot
    do; ``prompt_tokens``, ``weights_for_load``, ``progress`` and ``close_engine`` are
    optional hooks.

    No law races the clock. The laws that act on requests while they generate (abort,
    pause, a load mid-generation) wait for the engine's own evidence that the requests have
    tokens (``progress``: by default ``SupportsProgress.wait_for_tokens``) and act at once; for
    an engine without it they pace themselves from a measured generation and, when an attempt
    finds the requests already finished, try again sooner, down to acting one event-loop step
    after submission (when the protocol says a request is already in flight). A correct engine
    passes whatever its speed; a law fails only with evidence against the engine."""

    max_tokens: ClassVar[int] = 8
    """The cap of a short request."""
    long_max_tokens: ClassVar[int] = 256
    """The cap of a long request: one still generating when a law acts on it right after its
    first tokens (the abort, pause and in-flight load laws). Keep it well above one token; a
    slow engine may lower it to keep the laws short."""
    pause_hold_s: ClassVar[float] = 0.2
    """Loop seconds the pause laws wait while paused, to see that nothing finishes (a
    negative check: a longer hold only makes it stricter, never flaky)."""
    max_attempts: ClassVar[int] = 6
    """Attempts at catching requests in flight before a law gives its verdict."""
    temperature: ClassVar[float] = 1.0
    vocab_size: ClassVar[int | None] = None
    """When set, every generated token id must lie in ``[0, vocab_size)``."""
    context_window: ClassVar[int | None] = None
    """The engine's context length (prompt + response), if it ends requests with ``length``
    there; keep ``long_max_tokens`` below it so long requests are ended by the laws."""
    supports_seed_determinism: ClassVar[bool] = True
    """``SamplingParams.seed`` makes a request reproducible, whatever runs beside it."""
    supports_real_logprobs: ClassVar[bool] = True
    """``logprobs`` are the real log-probabilities of the sampling distribution (False for a
    simulator that reports made-up numbers)."""
    logprob_settings: ClassVar[tuple[tuple[str, SamplingParams], ...]] = LOGPROB_SETTINGS
    """The sampling settings of the log-prob distribution law, one test each."""
    logprob_samples: ClassVar[int] = 64
    """One-token requests drawn by the log-prob law, per setting."""
    logprob_atol: ClassVar[float] = 1e-2
    """How far two reports of the same token's log-prob after the same context may differ."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "progress_s" in cls.__dict__:
            raise TypeError(
                f"{cls.__name__}.progress_s is no longer used: the laws do not sleep a fixed "
                "time before acting on a request (that fails fast engines); they wait for the "
                "engine's evidence (SupportsProgress.wait_for_tokens, or the suite's progress() "
                "hook) or pace themselves from a measured generation. Delete progress_s."
            )

    # -- hooks for the backend author --------------------------------------------------------
    def make_engine(self) -> InferenceEngine | Awaitable[InferenceEngine]:
        """A fresh engine (sync or async factory); called on the law's event loop."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement make_engine(self), returning a fresh "
            "InferenceEngine (or an awaitable of one) on every call"
        )

    def prompt_tokens(self, index: int) -> Sequence[int]:
        """The ``index``-th prompt: valid token ids for the engine's vocabulary (default: four
        ids in ``[1, min(vocab_size, 1000))``, distinct per index)."""
        vocab = min(self.vocab_size or 1000, 1000)
        return tuple(1 + (7 * index + 3 * k) % (vocab - 1) for k in range(4))

    def weights_for_load(self, engine: Any) -> Sequence[tuple[str, torch.Tensor]]:
        """What the version laws pass to ``load_weights`` (default: nothing, a version bump
        only); an engine that needs real tensors returns its current weights here."""
        return ()

    def progress(self, engine: Any) -> ProgressHook | None:
        """How the laws see that a request is generating: ``hook(request_id, count)`` returns
        once the request has ``count`` tokens or has ended (an ``AsyncFlowError`` if it is
        not in flight). Default: the engine's ``wait_for_tokens`` (``SupportsProgress``), else
        None, and the laws pace themselves instead. Override to observe your engine another
        way (a metrics endpoint, a stream)."""
        return engine.wait_for_tokens if isinstance(engine, SupportsProgress) else None

    # -- plumbing ----------------------------------------------------------------------------
    def _law(self, name: str, body: Callable[[Any], Coroutine[Any, Any, None]]) -> None:
        async def first_cause(engine: Any) -> None:
            try:
                await body(engine)
            except AssertionError as exc:
                late = await self._registered_late()
                if late is None:
                    raise
                raise AssertionError(
                    f"{late}\n\nThe law's own failure, which may follow: {exc}"
                ) from exc

        self._engine_law(
            name, body if name == _LATE_LAW else first_cause, InferenceEngine,
            "the InferenceEngine protocol (weight_version, generate, abort)",
        )  # fmt: skip

    async def _registered_late(self) -> str | None:
        """After a failed law: whether a fresh engine registers a request only after
        ``generate``'s first await (the first cause of many failures: an abort, pause or wait
        right after the call finds nothing), as a message naming it, or None."""
        try:
            engine = await self._wait(_resolve(self.make_engine()), "make_engine()")
        except Exception:
            return None
        gen = self._submit(engine, self._long("registration-probe", 3, 11))
        rid = gen.request.request_id
        try:
            await asyncio.sleep(0)  # generate ran to its first await: the id must be in flight
            if gen.task.done():
                return None
            hook = self.progress(engine)
            if hook is not None:
                try:
                    await self._wait(hook(rid, 1), f"wait_for_tokens({rid!r}, 1)")
                except AsyncFlowError as exc:
                    if not gen.task.done():
                        return _late_message(f"wait_for_tokens({rid!r}, 1) raised: {exc}")
                return None
            await self._wait(engine.abort([rid]), f"abort([{rid!r}])")
            result = await self._wait(gen.task, f"generate({rid!r})")
            if result.finish_reason != "abort":
                return _late_message(
                    f"abort([{rid!r}]) right after the call was lost: it ran to "
                    f"{len(result.tokens)} tokens ({result.finish_reason!r})"
                )
            return None
        except Exception:
            return None
        finally:
            with contextlib.suppress(Exception):
                if not gen.task.done():
                    await self._wait(engine.abort([rid]), "abort(probe)")
                    await asyncio.wait([gen.task], timeout=self.timeout_s)
            with contextlib.suppress(Exception):
                await self._wait(self.close_engine(engine), "close_engine()")

    def _request(
        self, rid: str, index: int, max_tokens: int, *, seed: int | None = None
    ) -> GenerationRequest:
        params = SamplingParams(max_tokens=max_tokens, temperature=self.temperature, seed=seed)
        return GenerationRequest(rid, tuple(self.prompt_tokens(index)), params)

    def _long(self, rid: str, index: int, seed: int) -> GenerationRequest:
        return self._request(rid, index, self.long_max_tokens, seed=seed)

    def _submit(self, engine: InferenceEngine, request: GenerationRequest) -> _Gen:
        return _Gen(request, asyncio.ensure_future(engine.generate(request)), engine.weight_version)

    async def _finish(self, engine: InferenceEngine, gen: _Gen) -> GenerationResult:
        """Wait (bounded) for a submitted request and check the result law on it."""
        rid = gen.request.request_id
        result = await self._wait(gen.task, f"generate({rid!r})")
        self._check(engine, gen.request, result, gen.version)
        return result

    async def _generate(
        self, engine: InferenceEngine, request: GenerationRequest
    ) -> GenerationResult:
        return await self._finish(engine, self._submit(engine, request))

    async def _timed(
        self, engine: InferenceEngine, request: GenerationRequest, pace: _Pace
    ) -> GenerationResult:
        """``_generate``, recording its loop-clock duration as the pace's measurement."""
        start = asyncio.get_running_loop().time()
        result = await self._generate(engine, request)
        pace.measured(asyncio.get_running_loop().time() - start)
        return result

    def _check(
        self,
        engine: InferenceEngine,
        request: GenerationRequest,
        result: GenerationResult,
        submitted: Version,
    ) -> None:
        check_generation_result(
            request,
            result,
            submitted_version=submitted,
            current_version=engine.weight_version,
            vocab_size=self.vocab_size,
            context_window=self.context_window,
        )

    async def _still_works(self, engine: InferenceEngine, rid: str) -> GenerationResult:
        result = await self._generate(engine, self._request(rid, 1, self.max_tokens, seed=7))
        assert result.finish_reason != "abort", (
            f"request {rid!r}, submitted to an idle engine and never aborted, came back "
            "with finish_reason 'abort'"
        )
        return result

    async def _measure(self, engine: InferenceEngine, pace: _Pace) -> None:
        """For an engine without a progress hook, time one long request alone (before the
        requests a law acts on are submitted), unless the pace has a measurement."""
        if pace.full_s is None and self.progress(engine) is None:
            request = self._request("pace", 0, self.long_max_tokens, seed=424_242)
            await self._timed(engine, request, pace)

    async def _when_generating(
        self, engine: InferenceEngine, gens: Sequence[_Gen], tokens: int, pace: _Pace
    ) -> str:
        """Return when ``gens`` are generating: each has ``tokens`` tokens (or has ended), by
        the ``progress`` hook; without one, after the pace's next delay (``_measure`` first).
        Every submitted ``generate`` has reached its first await by then, so its request is
        in flight. Returns how it waited, for messages."""
        await asyncio.sleep(0)  # each submitted generate runs to its first await: in flight
        hook = self.progress(engine)
        if hook is not None:
            for gen in gens:
                await self._wait_for_tokens(hook, gen, tokens)
            return f"once wait_for_tokens(..., {tokens}) returned"
        delay = pace.next()
        if delay > 0:
            await asyncio.sleep(delay)
        return f"{delay:.4f} s after submission (no progress hook; paced)"

    async def _three_generating(
        self, engine: InferenceEngine, tag: str, index: int, pace: _Pace
    ) -> tuple[list[_Gen], str]:
        """Three long requests (prompts ``index``, ``index + 1``, ``index + 2``; seeds from the
        tag, so each attempt draws anew), returned once they are generating."""
        await self._measure(engine, pace)
        seed = zlib.crc32(tag.encode())
        gens = [
            self._submit(engine, self._long(f"{tag}-{i}", index + i, seed + i)) for i in range(3)
        ]
        return gens, await self._when_generating(engine, gens, 1, pace)

    async def _wait_for_tokens(self, hook: ProgressHook, gen: _Gen, tokens: int) -> None:
        rid = gen.request.request_id
        if gen.task.done():
            return
        try:
            await self._wait(hook(rid, tokens), f"wait_for_tokens({rid!r}, {tokens})")
        except AsyncFlowError as exc:  # not in flight: it must have ended
            try:
                await self._wait(gen.task, f"generate({rid!r})")
            except AssertionError:
                raise AssertionError(
                    f"wait_for_tokens({rid!r}, {tokens}) raised {type(exc).__name__} ({exc}) "
                    "while the request's generate() had not returned; it must return once "
                    "the request has the tokens (or ended)"
                ) from exc
            except Exception:
                return  # generate() raised: its law reports that

    # -- the laws ----------------------------------------------------------------------------
    def test_results_are_well_formed(self) -> None:
        """Result law on concurrent requests of caps 1, ``max_tokens`` and
        ``long_max_tokens``: see ``check_generation_result``; none comes back ``abort``, and a
        request capped at one token ends with ``length`` (or ``stop``)."""

        async def body(engine: InferenceEngine) -> None:
            caps = (1, self.max_tokens, self.long_max_tokens) * 2
            gens = [
                self._submit(engine, self._request(f"shape-{i}", i, cap, seed=100 + i))
                for i, cap in enumerate(caps)
            ]
            results = [await self._finish(engine, g) for g in gens]
            for gen, result in zip(gens, results, strict=True):
                assert result.finish_reason != "abort", (
                    f"request {gen.request.request_id!r} was never aborted but finished "
                    "with 'abort'"
                )
            assert any(r.finish_reason == "length" for r in results), (
                "no request ended with finish_reason 'length', not even those with "
                f"max_tokens=1 (reasons: {[r.finish_reason for r in results]}); a request "
                "that reaches max_tokens ends with 'length'"
            )

        self._law("test_results_are_well_formed", body)

    def test_seeded_generation_is_deterministic(self) -> None:
        """The same request with the same ``seed`` gives the same tokens twice, and again when
        other requests are generated beside it."""
        if not self.supports_seed_determinism:
            pytest.skip("the engine declares supports_seed_determinism = False")

        async def body(engine: InferenceEngine) -> None:
            cap = min(self.long_max_tokens, 4 * self.max_tokens)
            request = self._request("seeded", 0, cap, seed=1234)
            first = await self._generate(engine, request)
            second = await self._generate(engine, request)
            others = [
                self._submit(engine, self._request(f"beside-{i}", 10 + i, cap, seed=i))
                for i in range(3)
            ]
            gen = self._submit(engine, request)
            third = await self._finish(engine, gen)
            for other in others:
                await self._finish(engine, other)
            same = tuple(first.tokens) == tuple(second.tokens)
            assert same and first.finish_reason == second.finish_reason, (
                f"request 'seeded' (seed=1234) generated {first.tokens[:8]}... "
                f"({first.finish_reason}) then {second.tokens[:8]}... ({second.finish_reason})"
            )
            same = tuple(first.tokens) == tuple(third.tokens)
            assert same and first.finish_reason == third.finish_reason, (
                f"request 'seeded' (seed=1234) generated {first.tokens[:8]}... alone but "
                f"{third.tokens[:8]}... with 3 other requests beside it; a seeded request must "
                "not depend on its batch"
            )

        self._law("test_seeded_generation_is_deterministic", body)

    def test_abort_returns_the_prefix(self) -> None:
        """``abort`` ends exactly the named in-flight requests: each returns what it generated
        so far with ``finish_reason="abort"`` (with seeds: a prefix of the full generation); a
        request not named keeps going to its natural end. The abort is sent once the named
        requests are generating (see the class docstring); an attempt in which both finished
        first is repeated, acting sooner."""

        async def body(engine: InferenceEngine) -> None:
            pace = _Pace()
            seen: list[str] = []
            for attempt in range(self.max_attempts):
                seeds = [50 + i + 7919 * attempt for i in range(3)]
                requests = [
                    self._long(f"abort-{attempt}-{i}", 3 + i, s) for i, s in enumerate(seeds)
                ]
                full: dict[str, GenerationResult] = {}
                if self.supports_seed_determinism:
                    for r in requests[:2]:
                        full[r.request_id] = await self._timed(engine, r, pace)
                await self._measure(engine, pace)
                gens = [self._submit(engine, r) for r in requests]
                when = await self._when_generating(engine, gens[:2], 1, pace)
                named = [r.request_id for r in requests[:2]]
                await self._wait(engine.abort(named), f"abort({named})")
                results = [await self._finish(engine, g) for g in gens]
                for result in results[:2]:
                    reference = full.get(result.request_id)
                    if reference is None:
                        continue
                    k = len(result.tokens)
                    if result.finish_reason == "abort":
                        assert tuple(result.tokens) == tuple(reference.tokens[:k]), (
                            f"request {result.request_id!r} was aborted with {k} tokens that "
                            "are not a prefix of its seeded generation"
                        )
                    else:
                        assert tuple(result.tokens) == tuple(reference.tokens), (
                            f"request {result.request_id!r} finished before the abort but "
                            "differs from its seeded generation"
                        )
                assert results[2].finish_reason != "abort", (
                    f"abort({named}) also aborted {requests[2].request_id!r}, which it did not name"
                )
                if any(r.finish_reason == "abort" for r in results[:2]):
                    return
                pace.too_late()
                seen.append(
                    f"attempt {attempt}: aborted {when}, both came back "
                    f"{[(r.finish_reason, len(r.tokens)) for r in results[:2]]}"
                )
            raise AssertionError(
                "abort() of two in-flight long requests returned neither with finish_reason "
                f"'abort' in {self.max_attempts} attempts ({'; '.join(seen)}): abort() does "
                "not end in-flight requests (or long_max_tokens is too small for them to be "
                "in flight)"
            )

        self._law("test_abort_returns_the_prefix", body)

    def test_abort_right_after_submit_is_not_lost(self) -> None:
        """An ``abort`` issued one event-loop step after ``generate`` was called ends the
        request (``"abort"``, typically with no token): the protocol puts a request in flight
        from its ``generate``'s first await, so an engine that registers the id later (after
        an await of its own) loses the abort and generates to the end."""

        async def body(engine: InferenceEngine) -> None:
            outcomes: list[str] = []
            for attempt in range(3):
                request = self._long(f"early-abort-{attempt}", 4, 77 + attempt)
                gen = self._submit(engine, request)
                await asyncio.sleep(0)  # generate ran to its first await: in flight
                await self._wait(engine.abort([request.request_id]), "abort([...])")
                result = await self._finish(engine, gen)
                if result.finish_reason == "abort":
                    return
                outcomes.append(f"{result.finish_reason!r} with {len(result.tokens)} tokens")
            raise AssertionError(
                f"abort() issued one event-loop step after generate() was called did not end "
                f"the request; it came back {', '.join(outcomes)}: the abort was lost. "
                "Register the request id synchronously at the top of generate(), before its "
                "first await, and honour an abort that arrives before the engine has started "
                "the request (return its prefix with finish_reason 'abort')"
            )

        self._law("test_abort_right_after_submit_is_not_lost", body)

    def test_aborting_unknown_ids_is_a_no_op(self) -> None:
        """``abort`` of ids that are not in flight (never submitted, already finished, or the
        empty list) changes nothing: no error, a running request is not disturbed and a later
        request with such an id runs normally."""

        async def body(engine: InferenceEngine) -> None:
            await self._wait(engine.abort([]), "abort([])")
            await self._wait(engine.abort(["never-submitted"]), "abort(['never-submitted'])")
            gen = self._submit(engine, self._request("running", 4, self.max_tokens * 4, seed=3))
            await settle()
            await self._wait(engine.abort(["also-unknown"]), "abort(['also-unknown'])")
            result = await self._finish(engine, gen)
            assert result.finish_reason != "abort", (
                "abort(['also-unknown']) aborted request 'running'"
            )
            await self._wait(engine.abort(["running"]), "abort(['running']) after it finished")
            await self._still_works(engine, "running")  # the same id, after a late abort
            await self._wait(engine.abort(["later"]), "abort(['later']) before it is submitted")
            await self._still_works(engine, "later")

        self._law("test_aborting_unknown_ids_is_a_no_op", body)

    async def _aborted_prefix(
        self, engine: InferenceEngine, tag: str
    ) -> tuple[GenerationRequest, GenerationResult]:
        """A long request aborted after it generated at least one token (attempts paced as in
        the class docstring)."""
        pace = _Pace()
        seen: list[str] = []
        hook = self.progress(engine)
        for attempt in range(self.max_attempts):
            request = self._long(f"{tag}-partial-{attempt}", 2, 11 + 7919 * attempt)
            await self._measure(engine, pace)
            gen = self._submit(engine, request)
            when = await self._when_generating(engine, [gen], 1, pace)
            await self._wait(engine.abort([request.request_id]), "abort([...])")
            result = await self._finish(engine, gen)
            if result.finish_reason == "abort" and result.tokens:
                return request, result
            if result.finish_reason == "abort":
                assert hook is None, (
                    f"request {request.request_id!r} came back from abort() with no token, "
                    "though wait_for_tokens said it had one; abort returns every token "
                    "generated so far"
                )
                pace.too_early()
            else:
                pace.too_late()
            seen.append(
                f"aborted {when}: {result.finish_reason!r} with {len(result.tokens)} tokens"
            )
        raise AssertionError(
            f"could not abort a long request (max_tokens={self.long_max_tokens}) after it had "
            f"generated a token and before it finished, in {self.max_attempts} attempts "
            f"({'; '.join(seen)}): abort() does not return the tokens generated so far, or the "
            "engine generates a whole request at once (implement SupportsProgress, or raise "
            "long_max_tokens)"
        )

    def test_resume_keeps_the_aborted_prefix(self) -> None:
        """A request resumed from an aborted attempt's tokens, log-probs and versions returns
        them unchanged as the start of its result, then continues (at most ``max_tokens`` in
        all, not ``abort``); one whose prefix already holds ``max_tokens`` tokens returns
        exactly the prefix. After a ``load_weights`` (when supported) the prefix keeps its old
        versions while the new tokens report the new one."""

        async def body(engine: InferenceEngine) -> None:
            request, partial = await self._aborted_prefix(engine, "resume")
            resumed = dataclasses.replace(
                request,
                resume_tokens=tuple(partial.tokens),
                resume_logprobs=tuple(partial.logprobs),
                resume_versions=tuple(partial.versions),
            )
            if isinstance(engine, SupportsLoadWeights):
                version = engine.weight_version + 1
                weights = self.weights_for_load(engine)
                await self._wait(engine.load_weights(weights, version), "load_weights(...)")
            result = await self._generate(engine, resumed)
            assert result.finish_reason != "abort", (
                f"the resumed request {request.request_id!r} came back 'abort' without an abort"
            )
            k = len(partial.tokens)
            capped = dataclasses.replace(
                resumed, params=dataclasses.replace(request.params, max_tokens=k)
            )
            at_cap = await self._generate(engine, capped)
            unchanged = tuple(at_cap.tokens) == tuple(partial.tokens)
            assert unchanged and at_cap.finish_reason != "abort", (
                f"a request resumed with {k} tokens and max_tokens={k} returned "
                f"{len(at_cap.tokens)} tokens ({at_cap.finish_reason}); it must return the "
                "prefix unchanged"
            )

        self._law("test_resume_keeps_the_aborted_prefix", body)

    def test_pause_keep_freezes_in_flight_requests(self) -> None:
        """``pause("keep")``: no in-flight request finishes (or is aborted) while paused, a
        request submitted while paused waits; after ``resume`` all of them finish normally.
        The pause comes once the requests are generating; an attempt in which all had
        finished first is repeated, pausing sooner."""

        async def body(engine: Any) -> None:
            self._require(engine, SupportsPause, "SupportsPause")
            pace = _Pace()
            seen: list[str] = []
            for attempt in range(self.max_attempts):
                gens, when = await self._three_generating(engine, f"keep-{attempt}", 5, pace)
                await self._wait(engine.pause("keep"), "pause('keep')")
                waiting: _Gen | None = None
                try:
                    await settle()
                    done = {g.request.request_id for g in gens if g.task.done()}
                    if len(done) < len(gens):
                        for gen in gens:
                            if gen.task.done() and not gen.task.cancelled():
                                assert gen.task.result().finish_reason != "abort", (
                                    f"pause('keep') aborted request {gen.request.request_id!r}"
                                )
                        waiting = self._submit(engine, self._request("keep-new", 9, 8))
                        await asyncio.sleep(self.pause_hold_s)
                        await settle()
                        late = [
                            g.request.request_id
                            for g in gens
                            if g.task.done() and g.request.request_id not in done
                        ]
                        assert not late, (
                            f"request(s) {late} returned while the engine was paused with mode "
                            "'keep'"
                        )
                        assert not waiting.task.done(), (
                            "a request submitted while the engine was paused returned before "
                            f"resume(): {_outcome(waiting.task)}"
                        )
                finally:
                    await self._wait(engine.resume(), "resume()")
                if waiting is None:  # every request had finished before the pause
                    for gen in gens:
                        await self._finish(engine, gen)
                    pace.too_late()
                    seen.append(f"paused {when}: all had finished")
                    continue
                for gen in [*gens, waiting]:
                    result = await self._finish(engine, gen)
                    assert result.finish_reason != "abort", (
                        f"request {gen.request.request_id!r} came back 'abort' after "
                        "pause('keep') and resume()"
                    )
                return
            raise AssertionError(
                f"all long requests (max_tokens={self.long_max_tokens}) had finished before "
                f"pause('keep') in {self.max_attempts} attempts ({'; '.join(seen)}), even "
                "when paused right after submission: pause() does not take effect at once"
            )

        self._law("test_pause_keep_freezes_in_flight_requests", body)

    def test_pause_abort_aborts_in_flight_requests(self) -> None:
        """``pause("abort")``: every in-flight request returns while the engine stays paused,
        with ``finish_reason="abort"`` (one that had already finished may return normally);
        after ``resume`` the engine generates again. The pause comes once the requests are
        generating; an attempt in which all had finished first is repeated, pausing sooner."""

        async def body(engine: Any) -> None:
            self._require(engine, SupportsPause, "SupportsPause")
            pace = _Pace()
            seen: list[str] = []
            for attempt in range(self.max_attempts):
                gens, when = await self._three_generating(engine, f"pause-abort-{attempt}", 6, pace)
                await self._wait(engine.pause("abort"), "pause('abort')")
                try:
                    results = []
                    for gen in gens:
                        rid = gen.request.request_id
                        result = await self._wait(
                            gen.task,
                            f"generate({rid!r}), in flight at pause('abort'), while paused",
                        )
                        self._check(engine, gen.request, result, gen.version)
                        results.append(result)
                finally:
                    await self._wait(engine.resume(), "resume()")
                if any(r.finish_reason == "abort" for r in results):
                    await self._still_works(engine, "after-pause-abort")
                    return
                pace.too_late()
                seen.append(f"paused {when}: {[r.finish_reason for r in results]}")
            raise AssertionError(
                f"pause('abort') with long requests in flight returned none of them with "
                f"finish_reason 'abort' in {self.max_attempts} attempts ({'; '.join(seen)}): "
                "pause('abort') does not abort in-flight requests"
            )

        self._law("test_pause_abort_aborts_in_flight_requests", body)

    @pytest.mark.parametrize("mode", ["keep", "abort"])
    def test_new_requests_wait_while_paused(self, mode: Literal["keep", "abort"]) -> None:
        """A request submitted to a paused engine (either mode) waits, and after ``resume``
        runs normally (it is new, so a ``pause("abort")`` does not abort it)."""

        async def body(engine: Any) -> None:
            self._require(engine, SupportsPause, "SupportsPause")
            await self._wait(engine.pause(mode), f"pause({mode!r})")
            try:
                gen = self._submit(engine, self._request(f"paused-{mode}", 8, self.max_tokens))
                await settle()
                await asyncio.sleep(self.pause_hold_s)
                await settle()
                assert not gen.task.done(), (
                    f"a request submitted while paused (mode {mode!r}) returned before "
                    f"resume(): {_outcome(gen.task)}"
                )
            finally:
                await self._wait(engine.resume(), "resume()")
            result = await self._finish(engine, gen)
            assert result.finish_reason != "abort", (
                f"a request submitted while paused (mode {mode!r}) came back 'abort' after "
                "resume(); only requests in flight at the pause are aborted"
            )

        self._law(f"test_new_requests_wait_while_paused[{mode}]", body)

    def test_load_weights_sets_the_version(self) -> None:
        """After ``load_weights(weights, v)`` returns, ``weight_version == v`` and every token
        sampled afterwards reports a version ``>= v``."""

        async def body(engine: Any) -> None:
            self._require(engine, SupportsLoadWeights, "SupportsLoadWeights")
            base = engine.weight_version
            await self._still_works(engine, "before-load")
            for step in (1, 2):
                version = base + step
                await self._wait(
                    engine.load_weights(self.weights_for_load(engine), version),
                    f"load_weights(..., {version})",
                )
                assert engine.weight_version == version, (
                    f"after load_weights(..., {version}) weight_version is {engine.weight_version}"
                )
                result = await self._still_works(engine, f"after-load-{version}")
                assert result.tokens and min(result.versions) >= version, (
                    f"after load_weights(..., {version}) a new request's tokens report versions "
                    f"{sorted(set(result.versions))}"
                )

        self._law("test_load_weights_sets_the_version", body)

    def test_a_load_mid_generation_keeps_versions_ordered(self) -> None:
        """Loads while requests generate (the first once they have a token, the second once
        they have two, or paced): each sequence's versions never decrease and lie between the
        version at submission and the last loaded one; requests submitted after the last load
        report only it."""

        async def body(engine: Any) -> None:
            self._require(engine, SupportsLoadWeights, "SupportsLoadWeights")
            base = engine.weight_version
            pace = _Pace()
            await self._measure(engine, pace)
            gens = [
                self._submit(engine, self._request(f"swap-{i}", 12 + i, self.long_max_tokens))
                for i in range(2)
            ]
            for step in (1, 2):
                await self._when_generating(engine, gens, step, pace)
                await self._wait(
                    engine.load_weights(self.weights_for_load(engine), base + step),
                    f"load_weights(..., {base + step}) while requests generate",
                )
            for gen in gens:
                await self._finish(engine, gen)  # checks order and bounds of the versions
            assert engine.weight_version == base + 2
            result = await self._still_works(engine, "after-swaps")
            assert set(result.versions) <= {base + 2}, (
                f"a request submitted after load_weights(..., {base + 2}) reports versions "
                f"{sorted(set(result.versions))}"
            )

        self._law("test_a_load_mid_generation_keeps_versions_ordered", body)

    # -- versions across weight changes ----------------------------------------------------
    def _require_progress(self, engine: Any, law: str) -> ProgressHook:
        hook = self.progress(engine)
        if hook is None:
            pytest.skip(
                f"{law} needs evidence of how many tokens a request has at a given moment "
                "(SupportsProgress.wait_for_tokens, or the suite's progress() hook); the engine "
                "gives none"
            )
        return hook

    async def _count(self, hook: ProgressHook, gen: _Gen, count: int) -> int:
        """How many tokens ``gen`` has once it has ``count`` (or ended): the hook's answer,
        read after this call began; the final count of a request that had ended."""
        rid = gen.request.request_id
        if not gen.task.done():
            try:
                return int(await self._wait(hook(rid, count), f"wait_for_tokens({rid!r}, {count})"))
            except AsyncFlowError:
                pass  # not in flight: it has ended
        result = await self._wait(gen.task, f"generate({rid!r})")
        return len(result.tokens)

    def test_tokens_after_a_load_carry_its_version(self) -> None:
        """Each token is labelled with the weights that sampled it: two long requests
        generate through two loads; before each ``load_weights(..., v)`` the law reads each
        request's count (``progress``), and after the load returns, the count again. Tokens
        below the count before the load report a version below ``v`` (they were sampled
        before it); tokens from the count after it on report ``v`` or newer, exactly the last
        loaded version after the last load. Catches a version taken once per request (at
        admission, or at the end for every token) or refreshed only when new requests
        arrive. Needs the engine's evidence of progress; an attempt in which the requests
        ended before the last load is repeated."""

        async def body(engine: Any) -> None:
            self._require(engine, SupportsLoadWeights, "SupportsLoadWeights")
            hook = self._require_progress(engine, "test_tokens_after_a_load_carry_its_version")
            seen: list[str] = []
            for attempt in range(self.max_attempts):
                base = engine.weight_version
                gens = [
                    self._submit(
                        engine, self._long(f"label-{attempt}-{i}", 14 + i, 77 * attempt + i)
                    )
                    for i in range(2)
                ]
                await asyncio.sleep(0)  # each generate reached its first await: in flight
                have = {g.request.request_id: 0 for g in gens}
                marks: list[tuple[Version, dict[str, int], dict[str, int]]] = []
                for step in (1, 2):
                    version = base + step
                    before = {}
                    for g in gens:
                        rid = g.request.request_id
                        before[rid] = await self._count(hook, g, have[rid] + 1)
                    await self._wait(
                        engine.load_weights(self.weights_for_load(engine), version),
                        f"load_weights(..., {version}) while requests generate",
                    )
                    after = {}
                    for g in gens:
                        rid = g.request.request_id
                        after[rid] = have[rid] = await self._count(hook, g, before[rid] + 1)
                    marks.append((version, before, after))
                results = [await self._finish(engine, g) for g in gens]
                checked = 0
                for result in results:
                    rid = result.request_id
                    versions = tuple(result.versions)
                    for version, before, after in marks:
                        stale = [
                            i
                            for i in range(min(before[rid], len(versions)))
                            if versions[i] >= version
                        ]
                        assert not stale, (
                            f"request {rid!r}: token {stale[0]} reports version "
                            f"{versions[stale[0]]}, but it was sampled before load_weights(..., "
                            f"{version}) was called (the request had {before[rid]} tokens "
                            f"then); a token reports the version of the weights that sampled "
                            f"it, not a later one (versions {_runs(versions)})"
                        )
                        old = [i for i in range(after[rid], len(versions)) if versions[i] < version]
                        assert not old, (
                            f"request {rid!r}: token {old[0]} reports version {versions[old[0]]}, "
                            f"but it was sampled after load_weights(..., {version}) had returned "
                            f"(the request had {after[rid]} tokens by then); every token sampled "
                            f"after a load reports its version (versions {_runs(versions)})"
                        )
                    last_version, _, last_after = marks[-1]
                    tail = versions[last_after[rid] :]
                    wrong = sorted(set(tail) - {last_version})
                    assert not wrong, (
                        f"request {rid!r}: tokens sampled after the last load_weights(..., "
                        f"{last_version}) report versions {wrong}; they must report "
                        f"{last_version} (versions {_runs(versions)})"
                    )
                    checked += len(tail)
                if checked:
                    return
                seen.append(f"attempt {attempt}: both requests ended before the last load")
            raise AssertionError(
                f"no long request (max_tokens={self.long_max_tokens}) generated a token after "
                f"a load_weights in {self.max_attempts} attempts ({'; '.join(seen)}): "
                "load_weights waits for requests to finish, or the requests end within a few "
                "tokens (raise long_max_tokens)"
            )

        self._law("test_tokens_after_a_load_carry_its_version", body)

    def test_a_load_while_paused_labels_the_resumed_tokens(self) -> None:
        """``pause("keep")`` → ``load_weights(..., v)`` → ``resume()`` (the blocking sync):
        the tokens a kept request had at the pause keep their old version, and every token it
        samples after ``resume`` reports ``v``. Catches an engine that labels a kept request
        with the version it was admitted under, or relabels its whole sequence."""

        async def body(engine: Any) -> None:
            self._require(engine, SupportsPause, "SupportsPause")
            self._require(engine, SupportsLoadWeights, "SupportsLoadWeights")
            law = "test_a_load_while_paused_labels_the_resumed_tokens"
            hook = self._require_progress(engine, law)
            seen: list[str] = []
            for attempt in range(self.max_attempts):
                base = engine.weight_version
                version = base + 1
                gens = [
                    self._submit(
                        engine, self._long(f"kept-{attempt}-{i}", 16 + i, 91 * attempt + i)
                    )
                    for i in range(2)
                ]
                await asyncio.sleep(0)
                for g in gens:
                    await self._count(hook, g, 2)
                await self._wait(engine.pause("keep"), "pause('keep')")
                try:
                    frozen = {g.request.request_id: await self._count(hook, g, 1) for g in gens}
                    await self._wait(
                        engine.load_weights(self.weights_for_load(engine), version),
                        f"load_weights(..., {version}) while paused",
                    )
                finally:
                    await self._wait(engine.resume(), "resume()")
                checked = 0
                for g in gens:
                    result = await self._finish(engine, g)
                    rid = result.request_id
                    versions = tuple(result.versions)
                    k = frozen[rid]
                    relabelled = sorted({v for v in versions[:k] if v >= version})
                    assert not relabelled, (
                        f"request {rid!r}: its first {k} tokens were sampled before the pause, "
                        f"yet report version(s) {relabelled} of the load made while paused; "
                        f"keep each token's own version (versions {_runs(versions)})"
                    )
                    stale = sorted({v for v in versions[k:] if v != version})
                    assert not stale, (
                        f"request {rid!r}: after pause('keep') -> load_weights(..., {version}) -> "
                        f"resume(), its tokens from {k} on report version(s) {stale}; every "
                        f"token sampled after the load reports {version} (versions "
                        f"{_runs(versions)})"
                    )
                    checked += len(versions) - k
                if checked:
                    return
                seen.append(f"attempt {attempt}: both requests had ended at the pause")
            raise AssertionError(
                f"no long request (max_tokens={self.long_max_tokens}) was still generating at "
                f"pause('keep') in {self.max_attempts} attempts ({'; '.join(seen)})"
            )

        self._law("test_a_load_while_paused_labels_the_resumed_tokens", body)

    # -- rejected loads ----------------------------------------------------------------------
    async def _held_weights(self, engine: Any) -> tuple[str, Any]:
        """What the engine holds, as evidence: its weight fingerprints where it can report
        them, else a greedy probe's tokens and log-probs."""
        if isinstance(engine, SupportsWeightFingerprints):
            prints = await self._wait(engine.weight_fingerprints(), "weight_fingerprints()")
            return "fingerprints", dict(prints)
        probe = GenerationRequest(
            f"probe-{zlib.crc32(repr(engine.weight_version).encode())}-{id(engine) % 997}",
            tuple(self.prompt_tokens(2)),
            SamplingParams(max_tokens=4, temperature=0.0),
        )
        result = await self._generate(engine, probe)
        return "greedy probe", (tuple(result.tokens), tuple(result.logprobs))

    def _same_holding(self, a: tuple[str, Any], b: tuple[str, Any]) -> str | None:
        """None when two ``_held_weights`` agree, else what differs."""
        kind, x = a
        y = b[1]
        if kind == "fingerprints":
            changed = sorted(n for n in set(x) | set(y) if x.get(n) != y.get(n))
            return None if not changed else f"fingerprints of {changed[:4]} changed"
        if x[0] != y[0]:
            return f"greedy tokens {x[0]} became {y[0]}"
        gap = max((abs(p - q) for p, q in zip(x[1], y[1], strict=True)), default=0.0)
        return None if gap <= self.logprob_atol else f"greedy log-probs moved by {gap:.3g}"

    @pytest.mark.parametrize("bad", BAD_LOADS)
    def test_a_rejected_load_loads_nothing(self, bad: BadLoad) -> None:
        """``load_weights`` checks every name and shape before it changes anything: a load of
        changed tensors (the ``weights_for_load`` ones, negated) followed by one unknown name
        or one tensor of a wrong shape raises an ``AsyncFlowError`` naming it, and leaves the
        version and the weights as they were (fingerprints, or a greedy probe); the same load
        without the bad entry then changes them (so the law can see a change). Needs real
        tensors from ``weights_for_load``."""

        async def body(engine: Any) -> None:
            self._require(engine, SupportsLoadWeights, "SupportsLoadWeights")
            refusal = tensor_load_refusal(engine)
            if refusal is not None:
                pytest.skip(f"the engine's load_weights takes no tensors: {refusal}")
            original = [(n, t) for n, t in self.weights_for_load(engine) if t.is_floating_point()]
            if not original:
                pytest.skip(
                    "weights_for_load returns no tensors (a version bump only), so no load can "
                    "be checked for atomicity; return the engine's weights there"
                )
            changed = [(n, -t.detach().clone()) for n, t in original]
            if bad == "unknown-name":
                name = "conformance.no_such_parameter.weight"
                load = [*changed, (name, changed[-1][1].clone())]
            else:  # a wrong shape, last (after every valid tensor)
                name, tensor = changed[-1]
                shape = list(tensor.shape) or [1]
                shape[0] += 1
                load = [*changed[:-1], (name, torch.zeros(shape, dtype=tensor.dtype))]
            base = engine.weight_version
            before = await self._held_weights(engine)
            error = await self._expect_error(
                engine.load_weights(load, base + 1), f"load_weights with {bad} {name!r}"
            )
            assert name in str(error), (
                f"load_weights rejected the {bad} {name!r} but its message does not name it: "
                f"{error}"
            )
            assert engine.weight_version == base, (
                f"a rejected load_weights(..., {base + 1}) left weight_version at "
                f"{engine.weight_version}, not {base}; a rejected load changes nothing"
            )
            after = await self._held_weights(engine)
            moved = self._same_holding(before, after)
            assert moved is None, (
                f"load_weights rejected the {bad} {name!r}, yet the engine's weights changed "
                f"({moved}): it loaded the tensors before the bad one; check every name and "
                "shape before changing anything"
            )
            await self._wait(engine.load_weights(changed, base + 1), "load_weights(valid)")
            seen = self._same_holding(before, await self._held_weights(engine))
            try:
                assert seen is not None, (
                    f"loading the negated weights changed nothing the law can see ({before[0]}), "
                    "so it cannot tell whether the rejected load changed anything"
                )
            finally:  # a shared engine goes on with the weights it had
                await self._wait(engine.load_weights(original, base + 2), "load_weights(back)")

        self._law(f"test_a_rejected_load_loads_nothing[{bad}]", body)

    # -- stop tokens -------------------------------------------------------------------------
    def test_stop_token_ids_end_the_request(self) -> None:
        """A token of ``stop_token_ids`` ends the request with ``"stop"``, the token included:
        a seeded request is generated without stop tokens, then again with one of its tokens
        (its first occurrence at position j) as the stop token: the second result is the
        first's first j + 1 tokens, ``"stop"``; with other stop ids beside it and the same
        as a resumed request, too. Without seed determinism the law checks the shape of such
        results only (no stop token before the end, ``"stop"`` ends on one)."""

        async def body(engine: InferenceEngine) -> None:
            cap = max(self.max_tokens, 6)
            plain = self._request("stop-free", 4, cap, seed=4242)
            free = await self._generate(engine, plain)
            tokens = tuple(free.tokens)
            if not tokens:
                raise AssertionError("a request without stop tokens returned no token")
            target = tokens[len(tokens) // 2]
            j = tokens.index(target)
            others = tuple(sorted({t for t in range(8)} - set(tokens)))[:3]
            for label, stops in (("alone", (target,)), ("among others", (*others, target))):
                params = dataclasses.replace(plain.params, stop_token_ids=stops)
                request = dataclasses.replace(plain, params=params)  # the same id: no two at once
                result = await self._generate(engine, request)
                if not self.supports_seed_determinism:
                    continue  # check_generation_result held its shape
                assert (tuple(result.tokens), result.finish_reason) == (tokens[: j + 1], "stop"), (
                    f"a seeded request that generates {list(tokens)} without stop tokens, sent "
                    f"again with stop_token_ids={list(stops)} ({label}), returned "
                    f"{list(result.tokens)} ({result.finish_reason!r}); it must end at the stop "
                    f"token {target} (position {j}) with 'stop', the token included: "
                    f"{list(tokens[: j + 1])}"
                )
            if j >= 1 and self.supports_seed_determinism:
                resumed = dataclasses.replace(
                    plain,
                    params=dataclasses.replace(plain.params, stop_token_ids=(tokens[j],)),
                    resume_tokens=tokens[:j],
                    resume_logprobs=tuple(free.logprobs[:j]),
                    resume_versions=tuple(free.versions[:j]),
                )
                result = await self._generate(engine, resumed)
                # a resumed request re-seeds: only the shape is certain
                assert result.finish_reason != "abort", "a resumed request came back 'abort'"

        self._law("test_stop_token_ids_end_the_request", body)

    def test_sleep_and_wake_up(self) -> None:
        """``sleep()`` then ``wake_up()`` keeps the weight version, and the engine generates
        normally again."""

        async def body(engine: Any) -> None:
            self._require(engine, SupportsSleep, "SupportsSleep")
            await self._still_works(engine, "before-sleep")
            version = engine.weight_version
            await self._wait(engine.sleep(), "sleep()")
            await self._wait(engine.wake_up(), "wake_up()")
            assert engine.weight_version == version, (
                f"sleep()/wake_up() changed weight_version from {version} to "
                f"{engine.weight_version}"
            )
            await self._still_works(engine, "after-wake-up")

        self._law("test_sleep_and_wake_up", body)

    async def _bad_request(
        self, engine: InferenceEngine, bad: BadRequest
    ) -> tuple[GenerationRequest, _Gen | None]:
        """The malformed request ``bad`` and, for a duplicate id, the original request (in
        flight)."""
        if bad == "negative-max-tokens":
            return self._request("bad", 0, -1), None
        if bad == "resume-without-logprobs":
            request = self._request("bad", 0, self.max_tokens)
            return dataclasses.replace(request, resume_tokens=(1, 2)), None
        if bad == "resume-longer-than-max-tokens":
            prefix = tuple(self.prompt_tokens(3))[:2] * 2
            request = dataclasses.replace(
                self._request("bad", 0, len(prefix) - 1),
                resume_tokens=prefix,
                resume_logprobs=(-1.0,) * len(prefix),
                resume_versions=(engine.weight_version,) * len(prefix),
            )
            return request, None
        request = self._request("twice", 0, self.long_max_tokens)
        original = self._submit(engine, request)
        await asyncio.sleep(0)  # its generate reached its first await: in flight
        assert not original.task.done(), (
            f"the request 'twice' (max_tokens={self.long_max_tokens}) finished within one "
            f"event-loop step of its submission ({_outcome(original.task)}): generate() "
            "must not compute a whole request while blocking the event loop"
        )
        return request, original

    @pytest.mark.parametrize("bad", BAD_REQUESTS)
    def test_bad_requests_are_rejected(self, bad: BadRequest) -> None:
        """A malformed request raises an ``AsyncFlowError`` subclass with a message, and the
        engine works normally afterwards (a duplicate id leaves the original request running)."""

        async def body(engine: InferenceEngine) -> None:
            request, original = await self._bad_request(engine, bad)
            await self._expect_error(engine.generate(request), f"generate() of a {bad} request")
            if original is not None:
                result = await self._finish(engine, original)
                assert result.finish_reason != "abort", (
                    "rejecting a duplicate id aborted the original request"
                )
            await self._still_works(engine, f"after-{bad}")

        self._law(f"test_bad_requests_are_rejected[{bad}]", body)

    def test_a_rejection_names_the_bad_value(self) -> None:
        """Each ``BAD_REQUESTS`` rejection names the bad value, so the caller can fix it: the
        ``max_tokens`` of ``-1``; the missing log-probs (``resume_logprobs``, or "log-prob") and
        the 2 resumed tokens; the resumed prefix's length (4) and the ``max_tokens`` (3) it
        exceeds; the duplicate request id."""

        def wanted(bad: BadRequest, request: GenerationRequest) -> dict[str, str]:
            """What the message must contain, as (what, regex)."""
            if bad == "negative-max-tokens":
                return {"max_tokens": r"max_tokens", "its value -1": r"-1\b"}
            if bad == "resume-without-logprobs":
                return {"the log-probs": r"(?i)log-?probs?", "the 2 resumed tokens": r"\b2\b"}
            if bad == "resume-longer-than-max-tokens":
                k, cap = len(request.resume_tokens), request.params.max_tokens
                return {
                    f"the prefix length {k}": rf"\b{k}\b",
                    f"max_tokens={cap}": rf"max_tokens\D{{0,12}}\b{cap}\b",
                }
            return {f"the id {request.request_id!r}": re.escape(request.request_id)}

        async def body(engine: InferenceEngine) -> None:
            missing: list[str] = []
            for bad in BAD_REQUESTS:
                request, original = await self._bad_request(engine, bad)
                error = await self._expect_error(
                    engine.generate(request), f"generate() of a {bad} request"
                )
                if original is not None:
                    await self._wait(engine.abort(["twice"]), "abort(['twice'])")
                    await self._finish(engine, original)
                absent = [
                    what
                    for what, rx in wanted(bad, request).items()
                    if not re.search(rx, str(error))
                ]
                if absent:
                    missing.append(f"[{bad}] {', '.join(absent)} not in: {error}")
            assert not missing, (
                "a rejection must name the bad value and what to do (the caller reads the "
                "message, not the code); these do not:\n  " + "\n  ".join(missing)
            )

        self._law("test_a_rejection_names_the_bad_value", body)

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "logprob_setting" in metafunc.fixturenames:
            settings = list(self.logprob_settings)
            metafunc.parametrize("logprob_setting", settings, ids=[s[0] for s in settings])

    def test_logprobs_match_the_sampling_distribution(
        self, logprob_setting: tuple[str, SamplingParams]
    ) -> None:
        """Real log-probs, per sampling setting (``logprob_settings``: temperature 1 and
        below, top-k, top-k with top-p, a near-zero temperature): ``logprob_samples``
        one-token requests on one prompt (distinct seeds) report the same log-prob for the
        same token (``logprob_atol``), the probabilities of the distinct tokens seen sum to at
        most 1, and each token's frequency is consistent with its reported probability (exact
        binomial test, p < 1e-6 fails): the log-probs are those of the distribution sampled
        from, after temperature and filters. With ``top_k=1``, and at a temperature in
        (0, 1e-6) (``t1e-7``), one token is left (or a tie): every reported probability is at
        least 1/2 and those of the tokens drawn sum to 1. An engine that refuses the setting
        (an ``AsyncFlowError`` naming it) is skipped for it, with its message."""
        if not self.supports_real_logprobs:
            pytest.skip(
                "the engine declares supports_real_logprobs = False (its log-probs are not "
                "those of the sampling distribution)"
            )
        name, setting = logprob_setting

        async def body(engine: InferenceEngine) -> None:
            prompt = tuple(self.prompt_tokens(0))
            n = self.logprob_samples
            params = [dataclasses.replace(setting, max_tokens=1, seed=9000 + i) for i in range(n)]
            first = GenerationRequest(f"lp-{name}-0", prompt, params[0])
            try:
                results = [await self._generate(engine, first)]
            except AsyncFlowError as exc:
                pytest.skip(f"the engine refuses the sampling setting {name!r}: {exc}")
            gens = [
                self._submit(engine, GenerationRequest(f"lp-{name}-{i}", prompt, params[i]))
                for i in range(1, n)
            ]
            results += [await self._finish(engine, g) for g in gens]
            seen: dict[int, list[float]] = {}
            for r in results:
                assert len(r.tokens) == 1, f"{r.request_id!r}: {len(r.tokens)} tokens, not 1"
                seen.setdefault(r.tokens[0], []).append(r.logprobs[0])
            for token, lps in seen.items():
                spread = max(lps) - min(lps)
                assert spread <= self.logprob_atol, (
                    f"[{name}] token {token}, sampled {len(lps)} times as the first token after "
                    f"the same prompt, was reported with log-probs from {min(lps)} to "
                    f"{max(lps)}; the same token in the same context has one log-prob"
                )
            probs = {t: math.exp(sum(lps) / len(lps)) for t, lps in seen.items()}
            total = sum(probs.values())
            assert total <= 1.0 + self.logprob_atol, (
                f"[{name}] the {len(probs)} distinct first tokens have probabilities summing to "
                f"{total:.3f} > 1; the log-probs are not those of one distribution"
            )
            one_left = _one_token_left(setting)
            if one_left is not None:
                what, fix = one_left
                low = [p for p in probs.values() if p < 0.5 - self.logprob_atol]
                assert not low and total >= 1.0 - self.logprob_atol, (
                    f"[{name}] {what} the engine reported probabilities {_rounded(probs)} for "
                    f"the tokens sampled in {n} draws: the setting leaves one token, of "
                    "probability 1 (1/2 each for a tie, and every tied token is drawn), so "
                    f"each is at least 1/2 and they sum to 1, not {total:.4f}. {fix}; report "
                    "the log-probs of the distribution sampled from "
                    "(asyncflow_core.training.sampling), or refuse the setting"
                )
            counts = Counter(r.tokens[0] for r in results)
            for token, p in probs.items():
                tail = _binomial_tail(n, counts[token], p)
                assert tail >= 1e-6, (
                    f"[{name}] token {token} was sampled {counts[token]} times in {n} draws, "
                    f"but its reported probability is {p:.4f} (two-sided binomial p-value "
                    f"{tail:.2e}); the log-probs do not describe the sampling distribution "
                    "(after temperature, top-k and top-p: asyncflow_core.training.sampling)"
                )

        self._law(f"test_logprobs_match_the_sampling_distribution[{name}]", body)

    # -- sampling filters that bite ------------------------------------------------------------
    async def _draws(
        self, engine: InferenceEngine, tag: str, prompt: tuple[int, ...], params: SamplingParams
    ) -> list[tuple[int, float]]:
        """``logprob_samples`` one-token requests (distinct seeds) under ``params``:
        ``(token, log-prob)`` each."""
        n = self.logprob_samples
        gens = [
            self._submit(
                engine,
                GenerationRequest(
                    f"{tag}-{i}", prompt, dataclasses.replace(params, max_tokens=1, seed=5000 + i)
                ),
            )
            for i in range(n)
        ]
        out = []
        for gen in gens:
            result = await self._finish(engine, gen)
            assert len(result.tokens) == 1, f"{result.request_id!r}: {len(result.tokens)} tokens"
            out.append((result.tokens[0], result.logprobs[0]))
        return out

    async def _refusable(
        self, engine: InferenceEngine, tag: str, prompt: tuple[int, ...], params: SamplingParams
    ) -> list[tuple[int, float]]:
        """``_draws``; an engine that refuses the setting (an ``AsyncFlowError``) skips the
        law with its message, as an engine may refuse what it cannot honour."""
        try:
            return await self._draws(engine, tag, prompt, params)
        except AsyncFlowError as exc:
            pytest.skip(f"the engine refuses {params}: {exc}")

    def test_each_sampling_filter_removes_tokens(self) -> None:
        """Settings chosen on the engine under test so that each filter removes tokens, then
        the documented order (temperature, top-k, top-p on the renormalised top-k
        distribution) checked exactly. At temperature ``T`` (2, else 0.5, else 1) on a prompt where
        more than ``k = 4`` distinct first tokens are drawn: ``top_k=4`` lets at most 4
        through, renormalised (their probabilities sum to 1 once all are seen); from those
        probabilities ``q`` the law picks a ``top_p`` between the top-1 and top-2 mass of
        ``q`` (and, where it can, above the top-2 mass of the same tokens at temperature 1),
        so exactly the two most probable tokens survive: every draw is one of them, with the
        log-prob ``log(q_i / (q_1 + q_2))``. Top-p applied before top-k or before the
        temperature, a threshold that drops the token crossing it, or log-probs from before a
        filter all draw or report otherwise. An engine whose model is too peaked for top-k to
        remove anything on any prompt is skipped, saying so."""
        if not self.supports_real_logprobs:
            pytest.skip(
                "the engine declares supports_real_logprobs = False (its log-probs are not "
                "those of the sampling distribution)"
            )
        k = 4

        async def body(engine: InferenceEngine) -> None:
            tried: list[str] = []
            for temperature in (2.0, 0.5, 1.0):
                for index in range(3):
                    prompt = tuple(self.prompt_tokens(20 + index))
                    tag = f"bite-t{temperature}-{index}"
                    try:
                        free = await self._draws(
                            engine, f"{tag}-free", prompt, SamplingParams(temperature=temperature)
                        )
                    except AsyncFlowError as exc:
                        pytest.skip(f"the engine refuses temperature {temperature}: {exc}")
                    distinct = len({t for t, _ in free})
                    if distinct <= k:
                        tried.append(
                            f"T={temperature} prompt {index}: {distinct} tokens unfiltered"
                        )
                        continue
                    top_k = SamplingParams(temperature=temperature, top_k=k)
                    drawn = await self._refusable(engine, f"{tag}-k", prompt, top_k)
                    q: dict[int, float] = {}
                    for token, lp in drawn:
                        q.setdefault(token, math.exp(lp))
                    assert len(q) <= k, (
                        f"[T={temperature}, top_k={k}] {len(q)} distinct tokens were sampled "
                        f"({sorted(q)}); top-k keeps the {k} most probable after temperature"
                    )
                    if len(q) < k:
                        more = await self._draws(engine, f"{tag}-k2", prompt, top_k)
                        for token, lp in more:
                            q.setdefault(token, math.exp(lp))
                        assert len(q) <= k, (
                            f"[T={temperature}, top_k={k}] {len(q)} distinct tokens were "
                            f"sampled ({sorted(q)}); top-k keeps the {k} most probable"
                        )
                    mass = sum(q.values())
                    if len(q) == k:
                        assert abs(mass - 1.0) <= 2 * self.logprob_atol, (
                            f"[T={temperature}, top_k={k}] the {k} tokens top-k keeps were "
                            f"reported with probabilities {_rounded(q)}, summing to {mass:.4f}, "
                            "not 1: report the log-probs of the distribution sampled from, "
                            "renormalised after the filters (asyncflow_core.training.sampling)"
                        )
                    else:
                        tried.append(
                            f"T={temperature} prompt {index}: top-k showed {len(q)} of {k} tokens"
                        )
                        continue
                    choice = _bite_top_p(q, temperature)
                    if choice is None:
                        tried.append(f"T={temperature} prompt {index}: near-ties in {_rounded(q)}")
                        continue
                    top_p, kept = choice
                    both = SamplingParams(temperature=temperature, top_k=k, top_p=top_p)
                    final = await self._refusable(engine, f"{tag}-kp", prompt, both)
                    z = sum(q[t] for t in kept)
                    setting = f"T={temperature}, top_k={k}, top_p={top_p:.4f}"
                    outside = sorted({t for t, _ in final if t not in kept})
                    assert not outside, (
                        f"[{setting}] sampled token(s) {outside}; top-k keeps {_rounded(q)} "
                        f"(probabilities after temperature, as this engine reported them), and "
                        f"top-p={top_p:.4f} on that renormalised distribution keeps only "
                        f"{sorted(kept)}. The engine applies top-p to another distribution "
                        "(before top-k, or before the temperature), or in another order"
                    )
                    for token, lp in final:
                        want = math.log(q[token] / z)
                        assert abs(lp - want) <= self.logprob_atol, (
                            f"[{setting}] token {token} was reported with log-prob {lp:.4f}; "
                            f"after top-k {_rounded(q)} and top-p keeping {sorted(kept)} it is "
                            f"log({q[token]:.4f} / {z:.4f}) = {want:.4f}"
                        )
                    n = len(final)
                    for token in kept:
                        share = q[token] / z
                        hits = sum(1 for t, _ in final if t == token)
                        if hits == 0 and (1 - share) ** n < 1e-6:
                            raise AssertionError(
                                f"[{setting}] token {token} (probability {share:.3f} after "
                                f"top-k and top-p) was never sampled in {n} draws; top-p must "
                                f"keep {sorted(kept)}, the token whose cumulative probability "
                                "crosses top_p included"
                            )
                    return
            pytest.skip(
                f"no setting in which top-k removes tokens and top-p then removes some of "
                f"those ({'; '.join(tried)}): the model is too peaked (or too tied) here"
            )

        self._law("test_each_sampling_filter_removes_tokens", body)

    # -- greedy and unseeded sampling --------------------------------------------------------
    def test_greedy_picks_the_most_probable_token(self) -> None:
        """``temperature=0`` is greedy: the most probable token, whatever the seed and whatever
        is batched beside it. One greedy one-token request alone, then four more (seeds 1-3
        and none) submitted together with ``logprob_samples`` temperature-1 requests
        (distinct seeds), interleaved so that any batch mixes both: every greedy request
        returns one token ``g``; no token drawn at temperature 1 has a larger reported
        log-prob than ``g`` (greedy reports the temperature-1, unfiltered log-prob: the
        argmax has the largest), ``g``'s two reports agree when it was drawn, and a ``g``
        never drawn must not be so probable that missing it is a 1e-6 chance; a greedy
        ``max_tokens`` request gives the same tokens twice."""
        if not self.supports_real_logprobs:
            pytest.skip(
                "the engine declares supports_real_logprobs = False: without the log-probs of "
                "its distribution nothing says which token is the most probable"
            )

        async def body(engine: InferenceEngine) -> None:
            prompt = tuple(self.prompt_tokens(0))
            greedy = SamplingParams(max_tokens=1, temperature=0.0)
            try:
                alone = await self._generate(
                    engine, GenerationRequest("greedy-alone", prompt, greedy)
                )
            except AsyncFlowError as exc:
                pytest.skip(f"the engine refuses greedy requests (temperature=0): {exc}")
            seeds = (None, 1, 2, 3)
            n = self.logprob_samples
            greedy_gens: list[_Gen] = []
            sampled_gens: list[_Gen] = []
            for i in range(max(n, len(seeds))):
                if i < len(seeds):
                    params = dataclasses.replace(greedy, seed=seeds[i])
                    request = GenerationRequest(f"greedy-{i}", prompt, params)
                    greedy_gens.append(self._submit(engine, request))
                if i < n:
                    params = SamplingParams(max_tokens=1, temperature=1.0, seed=7000 + i)
                    request = GenerationRequest(f"beside-greedy-{i}", prompt, params)
                    sampled_gens.append(self._submit(engine, request))
            greedy_results = [alone] + [await self._finish(engine, g) for g in greedy_gens]
            sampled = [await self._finish(engine, g) for g in sampled_gens]
            for r in [*greedy_results, *sampled]:
                assert len(r.tokens) == 1, f"{r.request_id!r}: {len(r.tokens)} tokens, not 1"
            picked = Counter(r.tokens[0] for r in greedy_results)
            assert len(picked) == 1, (
                f"five greedy (temperature=0) one-token requests on one prompt returned the "
                f"tokens {dict(picked)} (the first alone, the others with seeds 1-3 and none, "
                f"batched with {n} temperature-1 requests): greedy decoding takes the most "
                "probable token, whatever the seed and the batch. Is a greedy row sampled "
                "when other rows of its batch are not greedy?"
            )
            g = greedy_results[0].tokens[0]
            g_lps = [r.logprobs[0] for r in greedy_results]
            spread = max(g_lps) - min(g_lps)
            assert spread <= self.logprob_atol, (
                f"the greedy token {g} was reported with log-probs from {min(g_lps):.4f} to "
                f"{max(g_lps):.4f}; the same token in the same context has one log-prob"
            )
            lp_g = g_lps[0]
            seen: dict[int, list[float]] = {}
            for r in sampled:
                seen.setdefault(r.tokens[0], []).append(r.logprobs[0])
            drawn = {t: sum(lps) / len(lps) for t, lps in seen.items()}
            if g in drawn:
                assert abs(drawn[g] - lp_g) <= self.logprob_atol, (
                    f"the greedy token {g} was reported with log-prob {lp_g:.4f} by greedy "
                    f"requests and {drawn[g]:.4f} at temperature 1 without filters; greedy "
                    "reports the temperature-1, unfiltered log-prob (docs/logprobs.md)"
                )
                lp_g = drawn[g]
            above = {t: round(lp, 4) for t, lp in drawn.items() if lp > lp_g + self.logprob_atol}
            assert not above, (
                f"greedy decoding picked token {g} (log-prob {lp_g:.4f} at temperature 1), but "
                f"temperature-1 draws on the same prompt reported more probable tokens {above}: "
                "temperature=0 must pick the most probable token (the argmax of the logits)"
            )
            if g not in drawn and drawn:
                p = max(math.exp(lp_g), max(math.exp(lp) for lp in drawn.values()))
                chance = (1 - min(p, 1.0)) ** n
                assert chance >= 1e-6, (
                    f"greedy decoding picked token {g}, which none of {n} temperature-1 draws "
                    f"on the same prompt gave, though the most probable token has probability "
                    f">= {p:.3f} (missing it {n} times: a {chance:.1e} chance); they drew "
                    f"{dict(Counter(r.tokens[0] for r in sampled))}. temperature=0 must pick "
                    "the most probable token"
                )
            longer = GenerationRequest(
                "greedy-long", prompt, SamplingParams(max_tokens=self.max_tokens, temperature=0.0)
            )
            first = await self._generate(engine, longer)
            second = await self._generate(engine, longer)
            assert tuple(first.tokens) == tuple(second.tokens), (
                f"a greedy request gave {list(first.tokens)} then {list(second.tokens)}; greedy "
                "decoding is deterministic"
            )

        self._law("test_greedy_picks_the_most_probable_token", body)

    def test_unseeded_requests_draw_anew(self) -> None:
        """``seed=None`` draws from the engine's generator: 20 unseeded one-token requests on
        one prompt, one after the other, then 20 submitted together (temperature 2, which
        flattens the distribution: any temperature draws from the generator). A group whose
        draws all gave one token fails when its reported probability ``p`` makes that a
        ``p ** 19 < 1e-6`` chance (a fixed seed for unseeded requests, a generator reset at
        every step). Skipped, saying so, when every group gave one token of a probability
        that makes this likely (a peaked model), or when the engine reports no real
        log-probs."""

        async def body(engine: InferenceEngine) -> None:
            prompt = tuple(self.prompt_tokens(0))
            n = 20
            params = SamplingParams(max_tokens=1, temperature=2.0)
            try:
                alone = [
                    await self._generate(engine, GenerationRequest("unseeded-0", prompt, params))
                ]
            except AsyncFlowError as exc:
                pytest.skip(f"the engine refuses temperature 2: {exc}")
            alone += [
                await self._generate(engine, GenerationRequest(f"unseeded-{i}", prompt, params))
                for i in range(1, n)
            ]
            gens = [
                self._submit(engine, GenerationRequest(f"unseeded-together-{i}", prompt, params))
                for i in range(n)
            ]
            together = [await self._finish(engine, g) for g in gens]
            unclear: list[str] = []
            for label, results in (("one after the other", alone), ("together", together)):
                tokens = Counter(r.tokens[0] for r in results if len(r.tokens) == 1)
                assert sum(tokens.values()) == n, "a one-token request returned another count"
                if len(tokens) > 1:
                    return  # the generator drew anew
                token = next(iter(tokens))
                if not self.supports_real_logprobs:
                    unclear.append(f"{label}: token {token} every time")
                    continue
                lps = [r.logprobs[0] for r in results]
                p = math.exp(sum(lps) / n)
                chance = p ** (n - 1)
                assert chance >= 1e-6, (
                    f"{n} unseeded (seed=None) one-token requests at temperature 2, submitted "
                    f"{label}, all returned token {token}, whose reported probability is "
                    f"{p:.3f} (a {chance:.1e} chance): unseeded requests must draw from the "
                    "engine's generator, anew each time (no fixed seed for a missing one, no "
                    "generator reset per step or per request)"
                )
                unclear.append(f"{label}: token {token} every time, probability {p:.3f}")
            pytest.skip(
                f"every unseeded draw gave one token ({'; '.join(unclear)}): the model is too "
                "peaked on this prompt (or its log-probs are not real) to tell whether the "
                "engine draws anew"
            )

        self._law("test_unseeded_requests_draw_anew", body)

    # -- what a result is made of ------------------------------------------------------------
    def test_results_are_plain_python_values(self) -> None:
        """A result is a frozen dataclass of plain values, so it pickles and crosses a process
        boundary unchanged: for a finished, an aborted and a resumed request, ``tokens``,
        ``logprobs`` and ``versions`` are tuples of exactly ``int``, ``float`` and ``int``
        (no bool, numpy scalar or 0-dim tensor), ``request_id`` and ``finish_reason`` are
        ``str``, and ``pickle.loads(pickle.dumps(result))`` has the same fields."""

        def check(results: Sequence[tuple[str, GenerationResult]]) -> None:
            problems = [
                f"{label} {r.request_id!r}: {problem}"
                for label, r in results
                for problem in _not_plain(r)
            ]
            assert not problems, (
                "a GenerationResult holds plain Python values (tokens int, log-probs float, "
                "versions int, in tuples) so that it pickles and crosses a process unchanged; "
                "convert with .tolist() / int() / float():\n  " + "\n  ".join(problems)
            )

        async def body(engine: InferenceEngine) -> None:
            finished = await self._still_works(engine, "plain")
            request, aborted = await self._aborted_prefix(engine, "plain")
            check([("finished", finished), ("aborted", aborted)])
            resumed = await self._generate(
                engine,
                dataclasses.replace(
                    request,
                    resume_tokens=tuple(aborted.tokens),
                    resume_logprobs=tuple(aborted.logprobs),
                    resume_versions=tuple(aborted.versions),
                ),
            )
            check([("resumed", resumed)])

        self._law("test_results_are_plain_python_values", body)

    # -- wait_for_tokens ---------------------------------------------------------------------
    def test_wait_for_tokens_reports_the_count(self) -> None:
        """``SupportsProgress.wait_for_tokens(id, count)`` returns once the request has at
        least ``count`` tokens (or has ended: then its final count), with its count then, and
        raises an ``AsyncFlowError`` for an id not in flight (never submitted, or finished).
        On a long request: the waits for 1 and 3 report at least that many, a wait for 0
        then reports at least the count already reported, a wait for 10**6 returns the final
        count when the request ends (here by an ``abort``, whose result holds every token
        reported). A resumed request has its prefix from the start: a wait for its length
        returns at once, even while the engine is paused (``SupportsPause``)."""

        async def body(engine: Any) -> None:
            self._require(engine, SupportsProgress, "SupportsProgress")
            wait = engine.wait_for_tokens
            await self._expect_error(wait("never-submitted", 1), "wait_for_tokens of an unknown id")
            await self._still_works(engine, "waited-done")
            await self._expect_error(
                wait("waited-done", 1), "wait_for_tokens of a request whose generate() returned"
            )
            gen = self._submit(engine, self._long("waited", 2, 21))
            rid = gen.request.request_id
            await asyncio.sleep(0)  # generate reached its first await: in flight
            reported = 0
            for count in (1, 3, 0):
                have = int(await self._wait(wait(rid, count), f"wait_for_tokens({rid!r}, {count})"))
                if have < count:  # it ended first: the count is its final one
                    result = await self._finish(engine, gen)
                    assert have == len(result.tokens), (
                        f"wait_for_tokens({rid!r}, {count}) returned {have}, yet the request "
                        f"went on to {len(result.tokens)} tokens ({result.finish_reason!r}): "
                        "it returns once the request has count tokens, with its count then"
                    )
                    pytest.skip(f"the long request ended with {have} tokens; raise long_max_tokens")
                assert have >= reported, (
                    f"wait_for_tokens({rid!r}, {count}) returned {have}, after an earlier wait "
                    f"reported {reported}: it returns the request's count then, which never "
                    "goes down"
                )
                reported = have
            final = asyncio.ensure_future(wait(rid, 10**6))
            await asyncio.sleep(0)  # the wait is registered
            await self._wait(engine.abort([rid]), f"abort([{rid!r}])")
            result = await self._finish(engine, gen)
            assert len(result.tokens) >= reported, (
                f"wait_for_tokens({rid!r}, ...) reported {reported} tokens, but the request "
                f"came back from abort() with {len(result.tokens)}: the count must be of tokens "
                "the request has (abort returns every one of them)"
            )
            try:
                last = int(await self._wait(final, f"wait_for_tokens({rid!r}, 10**6)"))
            except AsyncFlowError:
                last = None  # the request had ended before the wait reached the engine
            if last is not None:
                assert last == len(result.tokens), (
                    f"wait_for_tokens({rid!r}, 10**6) returned {last} when the request ended "
                    f"with {len(result.tokens)} tokens: a wait returns the final count once "
                    "the request has ended"
                )
            k = len(result.tokens)
            resumed = dataclasses.replace(
                gen.request,
                request_id="waited-resumed",
                resume_tokens=tuple(result.tokens),
                resume_logprobs=tuple(result.logprobs),
                resume_versions=tuple(result.versions),
            )
            pause = isinstance(engine, SupportsPause) and not unavailable_ability(
                engine, "SupportsPause"
            )
            if pause:
                await self._wait(engine.pause("keep"), "pause('keep')")
            try:
                again = self._submit(engine, resumed)
                await asyncio.sleep(0)
                have = int(
                    await self._wait(
                        wait("waited-resumed", k),
                        f"wait_for_tokens('waited-resumed', {k}) of a request resumed with {k} "
                        f"tokens{', submitted while paused' if pause else ''}",
                    )
                )
            finally:
                if pause:
                    await self._wait(engine.resume(), "resume()")
            assert have >= k, (
                f"wait_for_tokens('waited-resumed', {k}) returned {have} for a request resumed "
                f"with {k} tokens; resumed tokens count"
            )
            await self._wait(engine.abort(["waited-resumed"]), "abort(['waited-resumed'])")
            await self._finish(engine, again)

        self._law("test_wait_for_tokens_reports_the_count", body)

    # -- what an engine cannot do, or refuses ------------------------------------------------
    def test_an_unavailable_ability_raises_its_reason(self) -> None:
        """An ability the engine declares unavailable (``unavailable_abilities``: name ->
        reason) although it has the methods raises, when called, an ``AsyncFlowError`` whose
        message carries the declared reason (``SupportsSleep``: ``sleep()``;
        ``SupportsPause``: ``pause("keep")``; ``SupportsLoadWeights``: ``load_weights``;
        ``SupportsProgress``: ``wait_for_tokens`` on a running request); the version is
        unchanged and the engine then serves a request. Skipped when it declares none of
        them."""

        async def body(engine: Any) -> None:
            declared = getattr(engine, "unavailable_abilities", None)
            declared = dict(declared) if isinstance(declared, Mapping) else {}
            abilities: dict[str, type] = {
                "SupportsSleep": SupportsSleep,
                "SupportsPause": SupportsPause,
                "SupportsLoadWeights": SupportsLoadWeights,
                "SupportsProgress": SupportsProgress,
            }
            checked = {
                name: reason
                for name, reason in declared.items()
                if name in abilities
                and isinstance(engine, abilities[name])
                and unavailable_ability(engine, name)
            }
            if not checked:
                pytest.skip(
                    f"{type(engine).__name__} declares no unavailable ability this law can call "
                    f"(unavailable_abilities: {sorted(declared) or 'none'})"
                )
            version = engine.weight_version
            for name, reason in checked.items():
                running: _Gen | None = None
                if name == "SupportsSleep":
                    call, what = engine.sleep(), "sleep()"
                elif name == "SupportsPause":
                    call, what = engine.pause("keep"), "pause('keep')"
                elif name == "SupportsLoadWeights":
                    weights = self.weights_for_load(engine)
                    call, what = engine.load_weights(weights, version + 1), "load_weights(...)"
                else:
                    running = self._submit(engine, self._long("unavailable", 3, 5))
                    await asyncio.sleep(0)
                    call = engine.wait_for_tokens("unavailable", 1)
                    what = "wait_for_tokens('unavailable', 1)"
                error = await self._expect_error(
                    call, f"{what}, though {name} is declared unavailable"
                )
                assert reason in str(error), (
                    f"{type(engine).__name__} declares {name} unavailable ({reason!r}), and "
                    f"{what} raised {type(error).__name__}: {error}; the error must carry the "
                    "declared reason, so the caller learns why"
                )
                assert engine.weight_version == version, (
                    f"the refused {what} changed weight_version from {version} to "
                    f"{engine.weight_version}"
                )
                if running is not None:
                    await self._wait(engine.abort(["unavailable"]), "abort(['unavailable'])")
                    await self._finish(engine, running)
            await self._still_works(engine, "after-unavailable")

        self._law("test_an_unavailable_ability_raises_its_reason", body)

    def test_a_refused_sampling_setting_says_why(self) -> None:
        """A sampling setting the engine cannot honour (each of ``logprob_settings``, one
        request) is refused with an ``AsyncFlowError`` whose message names a knob of the
        setting it refuses (``temperature``, ``top_k`` or ``top_p``) and the engine (its
        class name or ``name``); the engine then serves a request. Skipped when it refuses
        none of them."""

        async def body(engine: InferenceEngine) -> None:
            prompt = tuple(self.prompt_tokens(0))
            default = SamplingParams()
            engine_names = {type(engine).__name__}
            for attr in ("name", "who"):
                value = getattr(engine, attr, None)
                if isinstance(value, str) and value:
                    engine_names.add(value)
            refused: list[str] = []
            unclear: list[str] = []
            for name, setting in self.logprob_settings:
                params = dataclasses.replace(setting, max_tokens=1, seed=11)
                request = GenerationRequest(f"refusal-{name}", prompt, params)
                try:
                    await self._generate(engine, request)
                    continue
                except AsyncFlowError as exc:
                    message = str(exc)
                knobs = [
                    k
                    for k in ("temperature", "top_k", "top_p")
                    if getattr(setting, k) != getattr(default, k)
                ]
                refused.append(name)
                if not any(k in message for k in knobs):
                    unclear.append(f"[{name}] names none of {knobs}: {message}")
                if not any(n.lower() in message.lower() for n in engine_names):
                    unclear.append(
                        f"[{name}] names the engine as none of {sorted(engine_names)}: {message}"
                    )
            if not refused:
                pytest.skip("the engine serves every sampling setting of logprob_settings")
            assert not unclear, (
                "a refused sampling setting must say which knob the engine cannot honour and "
                "which engine refuses (docs/writing-an-adapter.md, inference law 3):\n  "
                + "\n  ".join(unclear)
            )
            await self._still_works(engine, "after-refusals")

        self._law("test_a_refused_sampling_setting_says_why", body)

    def test_sleep_keeps_the_weights(self) -> None:
        """``sleep(1)`` then ``wake_up()`` keeps the weights, not only the version: after a
        load of changed weights (the ``weights_for_load`` tensors times 1.5, where the engine
        takes tensors), the engine's weight fingerprints (``SupportsWeightFingerprints``), or
        else a greedy probe's tokens and log-probs, are the same after the wake-up as before
        the sleep. (Level 2 may discard the weights by design: not checked.)"""

        async def body(engine: Any) -> None:
            self._require(engine, SupportsSleep, "SupportsSleep")
            if (
                not isinstance(engine, SupportsWeightFingerprints)
                and not self.supports_real_logprobs
            ):
                pytest.skip(
                    "the engine reports no weight fingerprints and no real log-probs "
                    "(supports_real_logprobs = False): nothing shows which weights it holds"
                )
            loaded = ""
            if (
                isinstance(engine, SupportsLoadWeights)
                and unavailable_ability(engine, "SupportsLoadWeights") is None
                and tensor_load_refusal(engine) is None
            ):
                changed = [
                    (n, t.detach() * 1.5)
                    for n, t in self.weights_for_load(engine)
                    if t.is_floating_point() and not t.is_meta
                ]
                if changed:
                    version = engine.weight_version + 1
                    await self._wait(
                        engine.load_weights(changed, version), f"load_weights(..., {version})"
                    )
                    loaded = f" (after a load of changed weights as version {version})"
            version = engine.weight_version
            before = await self._held_weights(engine)
            await self._wait(engine.sleep(1), "sleep(1)")
            await self._wait(engine.wake_up(), "wake_up()")
            assert engine.weight_version == version, (
                f"sleep(1)/wake_up() changed weight_version from {version} to "
                f"{engine.weight_version}"
            )
            moved = self._same_holding(before, await self._held_weights(engine))
            assert moved is None, (
                f"after sleep(1) and wake_up() the engine holds other weights than before{loaded}"
                f": {moved}. A level-1 sleep keeps the weights (offloads them, at most): "
                "wake_up() must not rebuild the model or reload its original weights"
            )

        self._law("test_sleep_keeps_the_weights", body)

    def test_close_releases_what_the_engine_started(self) -> None:
        """After ``close_engine`` (its ``close()``) every asyncio task, thread and child
        process that the engine started (since just before ``make_engine()``, through one
        request) has ended (waited for, up to ``release_timeout_s``)."""

        async def use(engine: InferenceEngine) -> None:
            await self._still_works(engine, "before-close")

        self._close_law(
            "test_close_releases_what_the_engine_started",
            InferenceEngine,
            "the InferenceEngine protocol (weight_version, generate, abort)",
            use,
        )

    def test_a_failed_step_fails_every_request_in_flight(self) -> None:
        """``fail_steps(engine)`` (the hook; without it the law is skipped) while two long
        requests generate: both ``generate`` calls raise an ``AsyncFlowError`` within
        ``timeout_s`` (a failed step is an ``EngineError``; none hangs, none returns as if
        nothing happened); once the hook's undo has run, a new request completes (the engine
        was not left wedged). Catches an engine that fails only the requests of the step's own
        batch, or none."""
        if self.fail_steps is None:
            pytest.skip(
                "no fail_steps(engine) hook: the suite cannot make a model step fail; give the "
                "class a method fail_steps(self, engine) that makes the engine's forward raise "
                "and returns a function undoing it"
            )
        fail_steps = self.fail_steps

        async def body(engine: InferenceEngine) -> None:
            gens = [self._submit(engine, self._long(f"failstep-{i}", i, 4300 + i)) for i in (0, 1)]
            await asyncio.sleep(0)  # each generate ran to its first await: in flight
            running = [gen for gen in gens if not gen.task.done()]
            assert running, (
                f"both requests of {self.long_max_tokens} tokens ended within one event-loop "
                "step of generate(), before fail_steps(engine): nothing was in flight to check; "
                "raise long_max_tokens"
            )
            heal = fail_steps(engine)
            try:
                for gen in running:
                    rid = gen.request.request_id
                    await self._expect_error(
                        gen.task, f"generate({rid!r}), in flight when the engine's steps failed"
                    )
            finally:
                heal()
            after = self._request("failstep-after", 2, self.max_tokens)
            result = await self._wait(engine.generate(after), "generate('failstep-after')")
            assert result.finish_reason in ("stop", "length"), (
                f"after its failed steps were undone the engine answered a new request with "
                f"finish_reason {result.finish_reason!r}: a failed step must fail the requests "
                "in flight and leave the engine serving"
            )

        self._law("test_a_failed_step_fails_every_request_in_flight", body)

    def test_a_lost_engine_fails_every_call_until_restart(self) -> None:
        """``lose(engine)`` (the hook; without it the law is skipped) with two long requests
        in flight: both ``generate`` calls raise ``EngineLostError`` within ``timeout_s``
        (none hangs), and so does every later ``generate``, ``abort``, ``load_weights`` and
        ``pause`` (those the engine has). With ``SupportsRestart``: ``lost`` is True from then
        until ``restart()`` returns; after it ``weight_version`` is the factory's (a fresh
        engine's, not the version loaded before the loss) and a request completes; or
        ``restart()`` raises ``EngineLostError`` and the engine stays lost."""
        self._require_lose()

        async def body(engine: InferenceEngine) -> None:
            factory_version = engine.weight_version
            weights = self.weights_for_load(engine)  # read while the engine is alive
            loads = isinstance(engine, SupportsLoadWeights)
            if loads:  # the lost engine holds a later version than a fresh one
                await self._wait(
                    cast(Any, engine).load_weights(weights, factory_version + 1),
                    f"load_weights(..., {factory_version + 1})",
                )
            gens = [self._submit(engine, self._long(f"lost-{i}", i, 4200 + i)) for i in (0, 1)]
            await asyncio.sleep(0)  # each generate ran to its first await: in flight
            running = [gen for gen in gens if not gen.task.done()]
            assert running, (
                f"both requests of {self.long_max_tokens} tokens ended within one event-loop "
                "step of generate(), before lose(engine): nothing was in flight to check; "
                "raise long_max_tokens"
            )
            await self._lose(engine)
            for gen in running:
                rid = gen.request.request_id
                await self._expect_lost(gen.task, f"generate({rid!r})", "in flight at the loss")
            self._still_lost(engine, "after the calls in flight failed")
            ids = [gen.request.request_id for gen in gens]
            later: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
                (
                    "generate('lost-after')",
                    lambda: engine.generate(self._request("lost-after", 2, self.max_tokens)),
                ),
                (f"abort({ids!r})", lambda: engine.abort(ids)),
            ]
            if loads:
                version = factory_version + 2
                later.append(
                    (
                        f"load_weights(..., {version})",
                        lambda: cast(Any, engine).load_weights(weights, version),
                    )
                )
            if isinstance(engine, SupportsPause):
                later.append(("pause('keep')", lambda: cast(Any, engine).pause("keep")))
            for what, call in later:
                await self._expect_lost(call(), what, "after the engine was lost")
            self._still_lost(engine, "after every later call failed")
            if not isinstance(engine, SupportsRestart):
                return
            try:
                await self._wait(engine.restart(), "restart()")
            except EngineLostError:  # it cannot come back: it stays lost
                self._still_lost(engine, "after restart() raised EngineLostError")
                await self._expect_lost(
                    engine.generate(self._request("lost-no-restart", 3, self.max_tokens)),
                    "generate('lost-no-restart')",
                    "after restart() raised EngineLostError",
                )
                return
            except AssertionError:
                raise
            except Exception as exc:
                raise AssertionError(
                    f"restart() raised {type(exc).__name__}: {exc}; it returns once a fresh "
                    "engine is up, or raises EngineLostError when the engine cannot come back "
                    "(SupportsRestart)"
                ) from exc
            assert not engine.lost, (
                "restart() returned but lost is still True: lost is True only until restart() "
                "returns (SupportsRestart)"
            )
            assert engine.weight_version == factory_version, (
                f"after restart() weight_version is {engine.weight_version}, but a fresh "
                f"engine's is {factory_version} (the lost engine had loaded "
                f"{factory_version + 1 if loads else factory_version}): restart() builds a "
                "fresh engine with the factory's weights and version, and must say so, so that "
                "the job loads the current weights into it before routing requests to it"
            )
            try:
                await self._still_works(engine, "after-restart")
            except EngineLostError as exc:
                raise AssertionError(
                    f"restart() returned, lost is False, but generate() then raised "
                    f"EngineLostError ({exc}): restart() must bring a working engine back "
                    "(or raise EngineLostError itself)"
                ) from exc

        self._law("test_a_lost_engine_fails_every_call_until_restart", body)

    def _still_lost(self, engine: Any, when: str) -> None:
        if isinstance(engine, SupportsRestart):
            assert engine.lost, (
                f"{type(engine).__name__}.lost is False {when}: lost is True from the loss "
                "until restart() returns (SupportsRestart), so the job knows to restart it"
            )

    def _require(self, engine: Any, ability: type, name: str) -> None:
        if not isinstance(engine, ability):
            pytest.skip(f"{type(engine).__name__} does not implement {name} (optional ability)")
        reason = unavailable_ability(engine, name)
        if reason is not None:
            pytest.skip(f"{type(engine).__name__} declares {name} unavailable here: {reason}")


# --------------------------------------------------------------------------------------------
# TrainEngine
# --------------------------------------------------------------------------------------------
class RecordingLoss:
    """Wraps a loss and records each call's log-prob shape and whether they carry gradients.

    Picklable, so an engine in another process can call it: its copy's observations come back
    as three metrics (``conformance_rows``, ``conformance_ndim``, ``conformance_grad``;
    engines average a metric over micro-batches, so ``reported`` recovers one call of the mean
    shape: enough for the law's bounds)."""

    def __init__(self, inner: LossFn) -> None:
        self.inner = inner
        self.calls: list[tuple[tuple[int, ...], bool]] = []

    def __call__(
        self, logprobs: torch.Tensor, batch: Batch
    ) -> tuple[torch.Tensor, Mapping[str, float]]:
        self.calls.append((tuple(logprobs.shape), bool(logprobs.requires_grad)))
        loss, metrics = self.inner(logprobs, batch)
        return loss, {
            **metrics,
            "conformance_rows": float(logprobs.shape[0]) if logprobs.dim() else 0.0,
            "conformance_ndim": float(logprobs.dim()),
            "conformance_grad": float(logprobs.requires_grad),
        }

    @staticmethod
    def reported(metrics: TrainMetrics) -> list[tuple[tuple[int, ...], bool]]:
        extra = metrics.extra
        if "conformance_grad" not in extra:
            return []
        ndim = round(extra.get("conformance_ndim", 0.0))
        shape = (extra.get("conformance_rows", 0.0),) + (1,) * max(ndim - 1, 0)
        return [(tuple(math.ceil(x) for x in shape), extra["conformance_grad"] >= 1.0)]


class TrainEngineConformance(_Suite):
    """The ``TrainEngine`` laws; subclass it (as ``Test...``) and implement ``make_engine``
    (and ``make_batch`` unless the default padded batch suits the engine)."""

    vocab_size: ClassVar[int] = 32
    """Token ids of the default batch lie in ``[0, vocab_size)``."""
    computes_loss: ClassVar[bool] = True
    """``train_step`` calls the loss on log-probs with gradients and reports a finite loss and
    grad norm (False for a simulator that does not train)."""
    required_fields: ClassVar[tuple[str, ...]] = ("response",)
    """Fields without which ``train_step`` must reject the batch (one test per field)."""
    response_field: ClassVar[str] = "response"
    bucket_bytes: ClassVar[int | None] = None
    """A bucket size to test beside the suite's own (1 byte, the median tensor, unbounded)."""
    logprob_atol: ClassVar[float] = 1e-4
    """How far two ``compute_logprobs`` of the same batch (no step between) may differ."""
    checkpoint_rtol: ClassVar[float] = 1e-3
    """How far (relative to the step's own size) a step after ``load_checkpoint`` may differ
    from the step that followed ``save_checkpoint``."""
    mask_rtol: ClassVar[float] = 1e-3
    """How far (relatively) the loss and grad norm of a step with masked tail tokens may differ
    from those of the step with the tokens cut off."""
    metrics_rtol: ClassVar[float] = 1e-3
    """How far (relatively) two reports of one step's loss (and grad norm) may differ when only
    rounding separates them: the rows split into micro-batches otherwise, or the loss
    recomputed from ``compute_logprobs``."""
    micro_batch_rows: ClassVar[int | None] = None
    """The engine's micro-batch size in rows, if known: the micro-batch laws then use
    ``3 * micro_batch_rows`` rows (else 12), so that the batch is split."""
    default_temperature: ClassVar[float] = 1.0
    """The temperature the trainer scores a batch without sampling fields at (its
    constructor's)."""
    world_size: ClassVar[int] = 1
    """Data-parallel ranks the trainer splits a batch over (one-row law: ``world_size + 1``
    rows leave a rank with one row or none)."""

    # -- hooks -------------------------------------------------------------------------------
    def make_engine(self) -> TrainEngine | Awaitable[TrainEngine]:
        """A fresh train engine (sync or async factory); called on the law's event loop."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement make_engine(self), returning a fresh "
            "TrainEngine (or an awaitable of one) on every call"
        )

    def make_batch(self) -> Batch:
        """A small valid batch (default: four rows of ``padded_batch`` with token ids below
        ``vocab_size`` and advantages ±1)."""
        v = self.vocab_size

        def ids(*xs: int) -> list[int]:
            return [x % v for x in xs]

        return padded_batch(
            prompts=[ids(1, 2, 3), ids(4, 5), ids(6, 7, 8, 9), ids(10)],
            responses=[ids(11, 12, 13, 14), ids(15), ids(16, 17, 18), ids(19, 20)],
            advantages=[1.0, -1.0, 0.5, -0.5],
        )

    def make_loss_fn(self) -> LossFn:
        """The loss of the laws (default ``asyncflow_core.training.rl.policy_gradient_loss``)."""
        return policy_gradient_loss

    def make_other_engine(self) -> TrainEngine | Awaitable[TrainEngine] | None:
        """A fresh trainer of another model (another size, the same kind), whose checkpoints
        ``make_engine``'s cannot load (default None: the law on a checkpoint that does not
        fit is skipped)."""
        return None

    def expected_parameters(self, engine: Any) -> Mapping[str, Sequence[int]] | None:
        """The full (unsharded) shape of every parameter, if known independently of
        ``export_weights``: the export law then checks names and shapes against it."""
        return None

    def response_lengths(self, batch: Batch) -> list[int]:
        """Each row's response length (default: ``batch.lengths[response_field]``, else the
        per-row tensors' lengths, else the padded width)."""
        name = self.response_field
        if name in batch.lengths:
            return [int(x) for x in batch.lengths[name].reshape(-1).tolist()]
        value = batch.data[name]
        if isinstance(value, list):
            return [int(t.shape[0]) for t in value]
        return [int(value.shape[1])] * len(batch)

    # -- plumbing ----------------------------------------------------------------------------
    def _law(self, name: str, body: Callable[[Any], Coroutine[Any, Any, None]]) -> None:
        self._engine_law(name, body, TrainEngine, "the TrainEngine protocol")

    async def _step(
        self, engine: TrainEngine, batch: Batch, loss_fn: LossFn | None = None
    ) -> TrainMetrics:
        before = engine.weight_version
        loss = self.make_loss_fn() if loss_fn is None else loss_fn
        metrics = await self._wait(engine.train_step(batch, loss), "train_step()")
        assert isinstance(metrics, TrainMetrics), (
            f"train_step returned {type(metrics).__name__}, not TrainMetrics"
        )
        assert engine.weight_version == before + 1, (
            f"train_step took weight_version from {before} to {engine.weight_version}; one "
            "optimizer step adds exactly 1"
        )
        assert metrics.version == engine.weight_version, (
            f"train_step reported TrainMetrics.version={metrics.version}, but weight_version is "
            f"now {engine.weight_version}; the metrics carry the version after the step"
        )
        return metrics

    async def _export(self, engine: TrainEngine, bucket_bytes: int) -> list[WeightBucket]:
        what = f"export_weights({bucket_bytes})"
        iterator: AsyncIterator[WeightBucket] = engine.export_weights(bucket_bytes).__aiter__()
        buckets: list[WeightBucket] = []
        try:
            while True:
                try:
                    bucket = await self._wait(iterator.__anext__(), f"{what}: next bucket")
                except StopAsyncIteration:
                    return buckets
                buckets.append(bucket)
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    async def _checkpoint(
        self, engine: TrainEngine, call: Literal["save", "load"], path: str
    ) -> None:
        """``save_checkpoint``/``load_checkpoint`` (bounded); an error that is not an
        ``AsyncFlowError`` fails the law with what to do."""
        method = engine.save_checkpoint if call == "save" else engine.load_checkpoint
        what = f"{call}_checkpoint({path!r})"
        try:
            await self._wait(method(path), what)
        except (AssertionError, AsyncFlowError):
            raise
        except Exception as exc:
            hint = ""
            if "share memory" in str(exc) or "shared" in str(exc):
                hint = (
                    "; the model has tied (shared) tensors: save each once (safetensors "
                    "refuses shared tensors; e.g. drop the tied alias, or "
                    "safetensors.torch.save_model) and re-tie them on load"
                )
            raise AssertionError(f"{what} raised {type(exc).__name__}: {exc}{hint}") from exc

    async def _weights(self, engine: TrainEngine) -> dict[str, torch.Tensor]:
        named = check_export(await self._export(engine, HUGE_BUCKET), HUGE_BUCKET)
        return {n: t.detach().clone() for n, t in named.items()}

    async def _changed_since(
        self, engine: TrainEngine, before: Mapping[str, torch.Tensor]
    ) -> list[str]:
        """The names of the exported tensors (with data) that differ from ``before`` now."""
        after = await self._weights(engine)
        return [n for n, t in before.items() if not t.is_meta and not same_bytes(t, after[n])]

    @staticmethod
    def _require_data(weights: Mapping[str, torch.Tensor], law: str) -> None:
        meta = [n for n, t in weights.items() if t.is_meta]
        if meta:
            pytest.skip(
                f"the engine exports meta tensors (no data, e.g. {meta[0]!r}), so {law} cannot "
                "be compared byte for byte"
            )

    # -- the laws ----------------------------------------------------------------------------
    def test_train_step_adds_one_version(self) -> None:
        """Each ``train_step`` adds exactly 1 to ``weight_version`` and returns
        ``TrainMetrics`` whose ``version`` is the new one and ``samples`` the batch's rows."""

        async def body(engine: TrainEngine) -> None:
            batch = self.make_batch()
            for _ in range(2):
                metrics = await self._step(engine, batch)
                assert metrics.samples == len(batch), (
                    f"TrainMetrics.samples={metrics.samples} for a batch of {len(batch)} rows"
                )

        self._law("test_train_step_adds_one_version", body)

    def test_train_step_calls_the_loss_and_reports_finite_metrics(self) -> None:
        """``train_step`` calls the loss function on log-probs ``[b, T]`` (``b`` at most the
        batch's rows) that carry gradients, and reports a finite loss and a finite, non-negative
        grad norm."""
        if not self.computes_loss:
            pytest.skip("the engine declares computes_loss = False (it does not train)")

        async def body(engine: TrainEngine) -> None:
            rows = len(self.make_batch())
            recording = RecordingLoss(self.make_loss_fn())
            before = engine.weight_version
            metrics = await self._wait(
                engine.train_step(self.make_batch(), recording), "train_step()"
            )
            assert engine.weight_version == before + 1, (
                f"train_step took weight_version from {before} to {engine.weight_version}"
            )
            # an engine in this process leaves the calls in `recording`; one in another process
            # called a copy, whose observations come back in the loss's metrics
            calls = recording.calls or recording.reported(metrics)
            assert calls, (
                "train_step never called the loss function (an engine in another process must "
                "return the loss's metrics in TrainMetrics.extra for this law to see the calls)"
            )
            for shape, grad in calls:
                assert len(shape) == 2 and 1 <= shape[0] <= rows, (
                    f"the loss got log-probs of shape {list(shape)}; expected [b, T] with "
                    f"1 <= b <= {rows}"
                )
                assert grad, "the loss got log-probs without gradients; nothing can train"
            assert math.isfinite(metrics.loss), f"TrainMetrics.loss is {metrics.loss}"
            assert math.isfinite(metrics.grad_norm) and metrics.grad_norm >= 0, (
                f"TrainMetrics.grad_norm is {metrics.grad_norm}"
            )

        self._law("test_train_step_calls_the_loss_and_reports_finite_metrics", body)

    def test_compute_logprobs_shape(self) -> None:
        """``compute_logprobs`` returns ``[B, T]`` with ``T >=`` the longest response, finite
        and ``<= 0`` where a response token exists, the same on a second call, and does not
        change ``weight_version``."""

        async def body(engine: TrainEngine) -> None:
            batch = self.make_batch()
            lengths = self.response_lengths(batch)
            version = engine.weight_version
            first = await self._wait(engine.compute_logprobs(batch), "compute_logprobs()")
            second = await self._wait(engine.compute_logprobs(batch), "compute_logprobs()")
            assert isinstance(first, torch.Tensor), "compute_logprobs did not return a tensor"
            assert first.dim() == 2 and first.shape[0] == len(batch), (
                f"compute_logprobs returned shape {list(first.shape)} for {len(batch)} rows; "
                "expected [B, T]"
            )
            assert first.shape[1] >= max(lengths, default=0), (
                f"compute_logprobs returned T={first.shape[1]}, shorter than the longest "
                f"response ({max(lengths)} tokens)"
            )
            for i, n in enumerate(lengths):
                row = first[i, :n].detach().float()
                assert bool(torch.isfinite(row).all()), f"row {i}: non-finite log-probs {row}"
                assert bool((row <= 1e-4).all()), f"row {i}: positive log-probs {row}"
                again = second[i, :n].detach().float()
                assert torch.allclose(row, again, atol=self.logprob_atol, rtol=0.0), (
                    f"row {i}: two compute_logprobs of the same batch differ by "
                    f"{float((row - again).abs().max())}"
                )
            assert engine.weight_version == version, "compute_logprobs changed weight_version"

        self._law("test_compute_logprobs_shape", body)

    def test_checkpoint_resumes_the_optimizer(self) -> None:
        """A step after ``load_checkpoint`` is the step that followed ``save_checkpoint``:
        train a step (the optimizer now has state), save, train on a second batch (its
        advantages negated, so the optimizer's state matters), load, train on the second batch
        again: the weights equal those of the uninterrupted run (within ``checkpoint_rtol`` of
        that step's size). Catches a checkpoint that drops or resets the optimizer state
        (Adam's moments, its step count) or the learning-rate schedule."""

        async def body(engine: TrainEngine) -> None:
            batch = self.make_batch()
            await self._step(engine, batch)
            flipped = _negated_advantages(batch)
            with tempfile.TemporaryDirectory(prefix="asyncflow-ckpt-") as tmp:
                path = str(Path(tmp) / "checkpoint")
                await self._checkpoint(engine, "save", path)
                saved = await self._weights(engine)
                self._require_data(saved, "the resumed step")
                await self._step(engine, flipped)
                uninterrupted = await self._weights(engine)
                await self._checkpoint(engine, "load", path)
                await self._step(engine, flipped)
                resumed = await self._weights(engine)
            size = max(_max_abs(uninterrupted[n], saved[n]) for n in saved)
            assert size > 0, (
                "train_step changed no exported weight, so the resumed step proves nothing; "
                "make_batch must give a non-zero gradient"
            )
            gap = {n: _max_abs(resumed[n], uninterrupted[n]) for n in saved}
            worst = max(gap, key=lambda n: gap[n])
            assert gap[worst] <= self.checkpoint_rtol * size, (
                f"the step after load_checkpoint differs from the step that followed "
                f"save_checkpoint: {worst!r} differs by {gap[worst]:.3g} (the step itself moved "
                f"the weights by up to {size:.3g}; tolerance {self.checkpoint_rtol} of it). The "
                "checkpoint must restore the optimizer state (moments, step count, learning-"
                "rate schedule), not only the weights"
            )

        self._law("test_checkpoint_resumes_the_optimizer", body)

    def test_train_step_honours_the_loss_mask(self) -> None:
        """A ``loss_mask`` field (1 on the response tokens the policy generated, 0 elsewhere,
        e.g. a tool's output) decides what trains, through ``train_step``: from one saved
        checkpoint, a step on rows whose trailing response tokens are masked reports the loss
        and gradient norm of the step on the same rows with those tokens cut off (relative
        ``mask_rtol``), and not those of the step on the rows without the mask. Catches a
        trainer that drops the field before the loss, slices it wrongly into micro-batches,
        or weighs micro-batches by every response token instead of the trained ones. (The
        metrics, not the weights, are compared: Adam's first step turns rounding noise in a
        near-zero gradient into a full step.)"""
        if not self.computes_loss:
            pytest.skip("computes_loss = False: the engine does not train")

        async def body(engine: TrainEngine) -> None:
            batch = self.make_batch()
            lengths = self.response_lengths(batch)
            masked, cut = _masked_tails(batch, self.response_field, lengths)
            if masked is None:
                pytest.skip(
                    "make_batch's responses are too short (or not in the padded or list "
                    "layout) to mask a tail"
                )
            runs: dict[str, TrainMetrics] = {}
            with tempfile.TemporaryDirectory(prefix="asyncflow-mask-") as tmp:
                path = str(Path(tmp) / "checkpoint")
                await self._checkpoint(engine, "save", path)
                for label, rows in (("masked", masked), ("cut", cut), ("unmasked", batch)):
                    await self._checkpoint(engine, "load", path)
                    runs[label] = await self._step(engine, rows)

            m, c, u = runs["masked"], runs["cut"], runs["unmasked"]
            assert metrics_apart(m, c) <= self.mask_rtol, (
                f"a step on rows whose last response tokens have loss_mask 0 reported loss "
                f"{m.loss:.6g} and grad norm {m.grad_norm:.6g}; the same rows with those tokens "
                f"cut off: loss {c.loss:.6g}, grad norm {c.grad_norm:.6g} (without the mask: "
                f"{u.loss:.6g}, {u.grad_norm:.6g}). Masked tokens must not train: hand the loss "
                "each micro-batch's own loss_mask rows and weigh micro-batches by their "
                "loss_mask == 1 tokens (asyncflow_core.training.rl.response_mask)"
            )
            assert metrics_apart(m, u) > 10 * self.mask_rtol, (
                f"the step with the loss_mask reported loss {m.loss:.6g} and grad norm "
                f"{m.grad_norm:.6g}, the step without it {u.loss:.6g} and {u.grad_norm:.6g}: "
                "the trainer (or the loss) ignores the loss_mask field"
            )

        self._law("test_train_step_honours_the_loss_mask", body)

    def test_close_releases_what_the_engine_started(self) -> None:
        """After ``close_engine`` (its ``close()``) every asyncio task, thread and child
        process that the engine started (since just before ``make_engine()``, through a
        ``compute_logprobs`` and a ``train_step``) has ended (waited for, up to
        ``release_timeout_s``)."""

        async def use(engine: TrainEngine) -> None:
            batch = self.make_batch()
            await self._wait(engine.compute_logprobs(batch), "compute_logprobs()")
            await self._step(engine, batch)

        self._close_law(
            "test_close_releases_what_the_engine_started",
            TrainEngine,
            "the TrainEngine protocol",
            use,
        )

    def test_export_holds_no_parameter_twice(self) -> None:
        """After a step, no two exported names hold the same tensor (same dtype, shape and
        bytes, with at least two distinct values): tied parameters (an LM head sharing the
        embedding) are one parameter, exported once under the name the inference side loads
        (Qwen2/Llama in vLLM and SGLang: ``model.embed_tokens.weight``)."""

        async def body(engine: TrainEngine) -> None:
            await self._step(engine, self.make_batch())
            weights = await self._weights(engine)
            self._require_data(weights, "exported tensors")
            first: dict[tuple[Any, ...], str] = {}
            for name, tensor in weights.items():
                flat = tensor.detach().reshape(-1)
                if flat.numel() < 2 or bool((flat == flat[0]).all()):
                    continue  # constants (zero biases, unit norms) coincide innocently
                key = (tensor.dtype, tuple(tensor.shape), _digest(tensor))
                other = first.setdefault(key, name)
                if other != name and same_bytes(weights[other], tensor):
                    raise AssertionError(
                        f"export_weights yielded the same tensor as {other!r} and {name!r}: "
                        "tied weights exported twice. Export a tied parameter once, under "
                        "the name the inference engine loads (Qwen2/Llama: "
                        "'model.embed_tokens.weight'), and let the engine's load_weights "
                        "fill both ends of the tie"
                    )

        self._law("test_export_holds_no_parameter_twice", body)

    def test_compute_logprobs_applies_the_sampling_fields(self) -> None:
        """``compute_logprobs`` applies each row's ``temperature``/``top_k``/``top_p`` fields
        (``asyncflow_core.training.sampling``): the same batch at temperature 0.5 gives other
        log-probs than at 1, and with ``top_k=2`` every log-prob is at least its unfiltered
        one (renormalising over a smaller support raises a kept token's probability) and some
        are larger."""
        if not self.computes_loss:
            pytest.skip("the engine declares computes_loss = False (no real model)")

        async def body(engine: TrainEngine) -> None:
            batch = self.make_batch()
            lengths = self.response_lengths(batch)

            async def at(params: SamplingParams) -> torch.Tensor:
                lp = await self._wait(
                    engine.compute_logprobs(_with_sampling(batch, params)), "compute_logprobs()"
                )
                return torch.cat([lp[i, :n].detach().double() for i, n in enumerate(lengths)])

            base = await at(SamplingParams(temperature=1.0))
            cold = await at(SamplingParams(temperature=0.5))
            top2 = await at(SamplingParams(temperature=1.0, top_k=2))
            for name, lp in (("temperature 0.5", cold), ("top_k=2", top2)):
                assert bool(torch.isfinite(lp).all()) and bool((lp <= 1e-4).all()), (
                    f"compute_logprobs at {name} gave log-probs outside (-inf, 0]: {lp.tolist()}"
                )
            assert float((cold - base).abs().max()) > self.logprob_atol, (
                "compute_logprobs gave the same log-probs with every row's temperature field "
                "at 0.5 as at 1: it ignores the batch's sampling fields; apply each row's "
                "temperature, top_k and top_p (asyncflow_core.training.sampling.row_sampling, or "
                "lmtrain.token_rows)"
            )
            lower = float((base - top2).max())
            assert lower <= self.logprob_atol, (
                f"with top_k=2 some log-prob is {lower:.3g} below its unfiltered value; top-k "
                "renormalises over fewer tokens, so a token's log-prob can only rise (a token "
                "off the support gets the floor of asyncflow_core.training.sampling)"
            )
            assert float((top2 - base).max()) > self.logprob_atol, (
                "compute_logprobs gave the same log-probs with every row's top_k field at 2 as "
                "without: it ignores top_k; apply each row's top_k and top_p"
            )

        self._law("test_compute_logprobs_applies_the_sampling_fields", body)

    def _bucket_sizes(self, sizes: Sequence[int]) -> list[int]:
        ordered = sorted(sizes)
        median = ordered[len(ordered) // 2] if ordered else 1
        chosen = [HUGE_BUCKET, max(1, 2 * median), 1]
        if self.bucket_bytes is not None:
            chosen.append(self.bucket_bytes)
        return chosen

    def test_export_yields_every_parameter_once(self) -> None:
        """At any ``bucket_bytes`` (unbounded, twice the median tensor, 1 byte, and
        ``bucket_bytes`` if set) ``export_weights`` yields the same non-empty set of
        parameters, each exactly once with the same full shape and dtype, in buckets of at most
        ``bucket_bytes`` unless a bucket is one oversized tensor alone."""

        async def body(engine: TrainEngine) -> None:
            reference = check_export(await self._export(engine, HUGE_BUCKET), HUGE_BUCKET)
            assert reference, "export_weights yielded no parameter"
            sizes = [t.numel() * t.element_size() for t in reference.values()]
            for size in self._bucket_sizes(sizes):
                named = check_export(
                    await self._export(engine, size), size, f"export_weights({size})"
                )
                odd = sorted(set(named) ^ set(reference))[:5]
                assert not odd, (
                    f"export_weights({size}) and an unbounded export disagree on parameters "
                    f"{odd}; every export yields every parameter once"
                )
                for name, tensor in named.items():
                    ref = reference[name]
                    assert tensor.dtype == ref.dtype and tensor.shape == ref.shape, (
                        f"export_weights({size}): {name!r} is {_describe_tensor(tensor)}, "
                        f"but {_describe_tensor(ref)} in an unbounded export"
                    )
            expected = self.expected_parameters(engine)
            if expected is not None:
                assert set(reference) == set(expected), (
                    f"export_weights names {sorted(set(reference) ^ set(expected))[:5]} "
                    "differ from expected_parameters()"
                )
                for name, shape in expected.items():
                    assert tuple(reference[name].shape) == tuple(shape), (
                        f"{name!r} is exported as {list(reference[name].shape)}, but its full "
                        f"shape is {list(shape)}: a shard instead of the gathered tensor?"
                    )

        self._law("test_export_yields_every_parameter_once", body)

    def test_export_is_stable_without_a_step(self) -> None:
        """Two exports with no step between are byte-equal, whatever ``bucket_bytes``."""

        async def body(engine: TrainEngine) -> None:
            first = await self._weights(engine)
            self._require_data(first, "two exports")
            sizes = [t.numel() * t.element_size() for t in first.values()]
            small = self._bucket_sizes(sizes)[1]
            second = check_export(await self._export(engine, small), small)
            for name, tensor in first.items():
                assert same_bytes(tensor, second[name]), (
                    f"{name!r} differs between two exports with no train_step between"
                )

        self._law("test_export_is_stable_without_a_step", body)

    def test_checkpoint_restores_the_version(self) -> None:
        """save, train, load: ``weight_version`` is the saved one again, and the next step
        adds 1 to it."""

        async def body(engine: TrainEngine) -> None:
            batch = self.make_batch()
            await self._step(engine, batch)
            saved = engine.weight_version
            with tempfile.TemporaryDirectory(prefix="asyncflow-ckpt-") as tmp:
                path = str(Path(tmp) / "checkpoint")
                await self._checkpoint(engine, "save", path)
                await self._step(engine, batch)
                await self._checkpoint(engine, "load", path)
            assert engine.weight_version == saved, (
                f"load_checkpoint restored weight_version {engine.weight_version}; the "
                f"checkpoint was saved at {saved}"
            )
            await self._step(engine, batch)

        self._law("test_checkpoint_restores_the_version", body)

    def test_checkpoint_restores_the_weights(self) -> None:
        """save, train (which must change some weight), load: every exported parameter is
        byte-equal to the one exported when the checkpoint was saved."""

        async def body(engine: TrainEngine) -> None:
            batch = self.make_batch()
            saved = await self._weights(engine)
            self._require_data(saved, "checkpointed weights")
            with tempfile.TemporaryDirectory(prefix="asyncflow-ckpt-") as tmp:
                path = str(Path(tmp) / "checkpoint")
                await self._checkpoint(engine, "save", path)
                await self._step(engine, batch)
                trained = await self._weights(engine)
                assert any(not same_bytes(saved[n], trained[n]) for n in saved), (
                    "train_step changed no exported weight, so the round trip proves nothing; "
                    "make_batch must give a non-zero gradient"
                )
                await self._checkpoint(engine, "load", path)
            restored = await self._weights(engine)
            assert set(restored) == set(saved), "the parameters changed across the round trip"
            differ = [n for n in saved if not same_bytes(saved[n], restored[n])]
            assert not differ, (
                f"after load_checkpoint, {len(differ)} parameter(s) differ from the saved "
                f"weights, e.g. {differ[:3]}"
            )

        self._law("test_checkpoint_restores_the_weights", body)

    def test_loading_a_missing_checkpoint_raises(self) -> None:
        """``load_checkpoint`` of a path nothing was saved to raises an ``AsyncFlowError``
        subclass and leaves ``weight_version`` unchanged."""

        async def body(engine: TrainEngine) -> None:
            await self._step(engine, self.make_batch())
            version = engine.weight_version
            with tempfile.TemporaryDirectory(prefix="asyncflow-ckpt-") as tmp:
                path = str(Path(tmp) / "never-saved")
                await self._expect_error(engine.load_checkpoint(path), f"load_checkpoint({path!r})")
            assert engine.weight_version == version, (
                f"a failed load_checkpoint changed weight_version from {version} to "
                f"{engine.weight_version}"
            )

        self._law("test_loading_a_missing_checkpoint_raises", body)

    @pytest.mark.parametrize("size", [0, -1])
    def test_bad_bucket_bytes_raise(self, size: int) -> None:
        """``export_weights(bucket_bytes <= 0)`` raises an ``AsyncFlowError`` subclass (at the
        call or at the first bucket); a valid export works afterwards."""

        async def body(engine: TrainEngine) -> None:
            async def export() -> None:
                await self._export(engine, size)

            await self._expect_error(export(), f"export_weights({size})")
            assert check_export(await self._export(engine, HUGE_BUCKET), HUGE_BUCKET)

        self._law(f"test_bad_bucket_bytes_raise[{size}]", body)

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "missing_field" in metafunc.fixturenames:
            fields: list[str | None] = [*self.required_fields] or [None]
            ids = [str(f) if f is not None else "none-declared" for f in fields]
            metafunc.parametrize("missing_field", fields, ids=ids)

    def test_a_batch_missing_a_field_is_rejected(self, missing_field: str | None) -> None:
        """``train_step`` on the batch without a ``required_fields`` field (and
        ``compute_logprobs`` without ``response_field``) raises an ``AsyncFlowError`` subclass,
        leaves ``weight_version`` unchanged, and the next valid step works."""
        if missing_field is None:
            pytest.skip("the suite declares no required_fields")
        field = missing_field

        async def body(engine: TrainEngine) -> None:
            batch = self.make_batch()
            assert field in batch.data, f"make_batch() has no field {field!r} to remove"
            version = engine.weight_version
            incomplete = without_field(batch, field)
            await self._expect_error(
                engine.train_step(incomplete, self.make_loss_fn()),
                f"train_step() of a batch without {field!r}",
            )
            if field == self.response_field:  # log-probs of which tokens?
                await self._expect_error(
                    engine.compute_logprobs(incomplete),
                    f"compute_logprobs() of a batch without {field!r}",
                )
            assert engine.weight_version == version, (
                f"a rejected train_step changed weight_version from {version} to "
                f"{engine.weight_version}"
            )
            await self._step(engine, batch)

        self._law(f"test_a_batch_missing_a_field_is_rejected[{field}]", body)

    # -- how one step covers its batch -------------------------------------------------------
    def _spread_batches(self) -> tuple[Batch, Batch]:
        """``make_batch``'s rows tiled to ``max(12, 3 * micro_batch_rows)`` rows, twice: ordered
        by response length (consecutive micro-batches then hold very different numbers of
        tokens) and with long and short rows alternating (micro-batches of similar counts)."""
        base = self.make_batch()
        n = max(12, 3 * (self.micro_batch_rows or 0))
        tiled = _take_rows(base, [i % len(base) for i in range(n)])
        lengths = self.response_lengths(tiled)
        if len(set(lengths)) < 2:
            pytest.skip(
                "every row of make_batch has the same response length: no split of its rows "
                "gives micro-batches of different token counts"
            )
        ascending = sorted(range(n), key=lambda i: lengths[i])
        mixed = [ascending[i // 2] if i % 2 == 0 else ascending[n - 1 - i // 2] for i in range(n)]
        return _take_rows(tiled, ascending), _take_rows(tiled, mixed)

    def test_a_step_does_not_depend_on_how_rows_split_into_micro_batches(self) -> None:
        """``train_step`` is one optimizer step over the whole batch: micro-batches weighted by
        their share of the trained response tokens, gradients accumulated, one step. From one
        saved checkpoint, a step on 12 rows (``3 * micro_batch_rows`` if set) ordered by
        response length (micro-batches of very different token counts) reports the loss and
        gradient norm of the step on the same rows with long and short ones alternating
        (relative ``metrics_rtol``). Skipped when the loss saw every row at once (no split).
        Catches micro-batches weighted by rows, or an optimizer step per micro-batch.
        (Metrics, not weights, are compared: Adam's first step turns rounding noise into full
        steps.)"""
        if not self.computes_loss:
            pytest.skip("computes_loss = False: the engine does not train")

        async def body(engine: TrainEngine) -> None:
            ascending, mixed = self._spread_batches()
            n = len(ascending)
            runs: dict[str, TrainMetrics] = {}
            parts: list[int] = []
            with tempfile.TemporaryDirectory(prefix="asyncflow-split-") as tmp:
                path = str(Path(tmp) / "checkpoint")
                await self._checkpoint(engine, "save", path)
                for label, rows in (("ordered by length", ascending), ("alternating", mixed)):
                    await self._checkpoint(engine, "load", path)
                    recording = RecordingLoss(self.make_loss_fn())
                    runs[label] = await self._step(engine, rows, recording)
                    calls = recording.calls or recording.reported(runs[label])
                    parts += [shape[0] for shape, _ in calls if shape]
            if not parts or min(parts) >= n:
                pytest.skip(
                    f"the loss saw all {n} rows at once: the engine did not split them into "
                    "micro-batches, so there is no split to vary (set micro_batch_rows to its "
                    "micro-batch size)"
                )
            a, b = runs["ordered by length"], runs["alternating"]
            gap = metrics_apart(a, b)
            assert gap <= self.metrics_rtol, (
                f"one step over the same {n} rows from one checkpoint reported loss {a.loss:.6g} "
                f"and grad norm {a.grad_norm:.6g} with the rows ordered by response length "
                f"(micro-batches of very different token counts), but loss {b.loss:.6g} and "
                f"grad norm {b.grad_norm:.6g} with long and short rows alternating (relative "
                f"difference {gap:.3g} > metrics_rtol={self.metrics_rtol}). A step must not "
                "depend on how the rows fall into micro-batches: weigh each micro-batch's loss "
                "by its share of the batch's trained response tokens, accumulate the gradients, "
                "take one optimizer step"
            )

        self._law("test_a_step_does_not_depend_on_how_rows_split_into_micro_batches", body)

    def test_the_reported_loss_is_the_whole_batchs(self) -> None:
        """``TrainMetrics`` covers the whole batch: on a fresh engine, the loss function applied
        to ``compute_logprobs`` of the whole batch (12 rows ordered by response length, split
        into micro-batches of different token counts) equals the ``loss`` the step on it then
        reports (relative ``metrics_rtol``; the suite's loss is a token mean, as the default
        ``policy_gradient_loss``), and ``samples`` counts every row. Catches a loss averaged
        over micro-batches by rows, or one rank's share reported for the whole step."""
        if not self.computes_loss:
            pytest.skip("computes_loss = False: the engine does not train")

        async def body(engine: TrainEngine) -> None:
            batch, _ = self._spread_batches()
            logprobs = await self._wait(engine.compute_logprobs(batch), "compute_logprobs()")
            loss, _ = self.make_loss_fn()(logprobs.detach().float().cpu(), batch)
            expected = float(loss)
            metrics = await self._step(engine, batch)
            assert metrics.samples == len(batch), (
                f"TrainMetrics.samples={metrics.samples} for a batch of {len(batch)} rows; "
                "the metrics cover the whole batch"
            )
            gap = abs(metrics.loss - expected) / max(abs(metrics.loss), abs(expected), 1e-6)
            assert gap <= self.metrics_rtol, (
                f"train_step reported loss {metrics.loss:.6g} for {len(batch)} rows, but the "
                f"loss of the whole batch (its compute_logprobs before the step, through the "
                f"same loss function) is {expected:.6g} (relative difference {gap:.3g} > "
                f"metrics_rtol={self.metrics_rtol}). Report the whole batch's loss: weigh each "
                "micro-batch's loss by its share of the trained response tokens (not by rows), "
                "and sum over the ranks of a data-parallel group"
            )

        self._law("test_the_reported_loss_is_the_whole_batchs", body)

    def test_a_batch_without_sampling_fields_is_scored_at_the_default(self) -> None:
        """A batch without the ``temperature``/``top_k``/``top_p`` fields is scored at the
        trainer's default temperature (``default_temperature``: what the suite built it with)
        and no filters: its ``compute_logprobs`` equals that of the same batch with the fields
        ``temperature=default_temperature, top_k=0, top_p=1`` on every row (``logprob_atol``)."""
        if not self.computes_loss:
            pytest.skip("computes_loss = False: the engine has no model to score with")

        async def body(engine: TrainEngine) -> None:
            batch = self.make_batch()
            for name in SAMPLING_FIELDS:
                batch = without_field(batch, name)
            lengths = self.response_lengths(batch)
            bare = await self._wait(engine.compute_logprobs(batch), "compute_logprobs()")
            t = self.default_temperature
            explicit = await self._wait(
                engine.compute_logprobs(_with_sampling(batch, SamplingParams(temperature=t))),
                f"compute_logprobs() with temperature={t}, top_k=0, top_p=1 on every row",
            )
            gap = max(
                (_max_abs(bare[i, :k], explicit[i, :k]) for i, k in enumerate(lengths)),
                default=0.0,
            )
            assert gap <= self.logprob_atol, (
                f"compute_logprobs of a batch without sampling fields differs by up to "
                f"{gap:.3g} from the same batch with temperature={t}, top_k=0, top_p=1 on every "
                f"row (logprob_atol={self.logprob_atol}): a batch without the fields is scored "
                "at the trainer's default temperature (its constructor's; the suite's "
                "default_temperature) and no filters"
            )

        self._law("test_a_batch_without_sampling_fields_is_scored_at_the_default", body)

    def test_a_batch_of_one_row_trains(self) -> None:
        """A batch of one row, and one of ``world_size + 1`` rows (a data-parallel rank then
        gets none, or one), each train: the step returns within ``timeout_s``, adds 1 to the
        version and (``computes_loss``) changes some exported weight. Catches a rank without
        rows that skips its forward and backward (the others hang in the collective), or a
        trainer that drops micro-batches of one row."""

        async def body(engine: TrainEngine) -> None:
            batch = self.make_batch()
            lengths = self.response_lengths(batch)
            order = sorted(range(len(batch)), key=lambda i: -lengths[i])
            sizes = sorted({1, self.world_size + 1})
            for size in sizes:
                rows = _take_rows(batch, [order[i % len(order)] for i in range(size)])
                before = await self._weights(engine) if self.computes_loss else {}
                await self._step(engine, rows)
                if not before or any(t.is_meta for t in before.values()):
                    continue
                after = await self._weights(engine)
                assert any(not same_bytes(before[n], after[n]) for n in before), (
                    f"a train_step on a batch of {size} row(s) changed no exported weight: the "
                    "rows did not train. A micro-batch (or a rank's share) of one row, or of "
                    "none, still runs its forward and backward (a rank without rows runs a "
                    "zero-weight dummy micro-batch)"
                )

        self._law("test_a_batch_of_one_row_trains", body)

    def test_a_bad_row_anywhere_rejects_the_whole_batch(self) -> None:
        """``make_batch()`` plus a last row whose response holds a token id outside any
        vocabulary (in the last micro-batch, after valid ones): ``train_step`` and
        ``compute_logprobs`` raise an ``AsyncFlowError`` (not an ``IndexError`` from the
        embedding, and never a hang), the version and every exported tensor are unchanged,
        and the valid batch then trains. Catches a trainer that checks rows only as it reaches
        them, or not at all."""
        if not self.computes_loss:
            pytest.skip(
                "computes_loss = False: the engine has no model to check a token id against"
            )

        async def body(engine: TrainEngine) -> None:
            batch = self.make_batch()
            bad = _with_bad_last_row(batch, self.response_field, self.response_lengths(batch))
            if bad is None:
                pytest.skip(
                    f"make_batch's {self.response_field!r} field is neither padded nor a list "
                    "of rows: the law cannot plant a bad token"
                )
            version = engine.weight_version
            before = await self._weights(engine)
            what = (
                f"a batch whose last row (row {len(bad) - 1}) holds token id {_NOT_A_TOKEN} in "
                f"its {self.response_field!r}"
            )
            await self._expect_error(
                engine.train_step(bad, self.make_loss_fn()), f"train_step() of {what}"
            )
            await self._expect_error(engine.compute_logprobs(bad), f"compute_logprobs() of {what}")
            assert engine.weight_version == version, (
                f"a rejected train_step changed weight_version from {version} to "
                f"{engine.weight_version}"
            )
            changed = await self._changed_since(engine, before)
            assert not changed, (
                f"train_step rejected {what}, yet {len(changed)} exported tensor(s) changed, "
                f"e.g. {changed[:3]}: validate the whole batch before any micro-batch trains"
            )
            await self._step(engine, batch)

        self._law("test_a_bad_row_anywhere_rejects_the_whole_batch", body)

    # -- what an export holds ----------------------------------------------------------------
    def test_an_export_never_mixes_two_versions(self) -> None:
        """An export is a snapshot taken between two steps: after a step, an unbounded export
        gives the weights ``w``; then ``export_weights(1)`` (a bucket per tensor) yields its
        first bucket, a ``train_step`` starts (the law waits for it a while: an engine may
        hold it until the export ends), and the export is drained. Every tensor, as received,
        is byte-equal to ``w`` (a sync never mixes two versions), and every bucket flagged
        ``snapshot=True`` still holds, once the step has run, what it held when received
        (nobody changes a snapshot afterwards)."""

        async def body(engine: TrainEngine) -> None:
            loop = asyncio.get_running_loop()
            batch = self.make_batch()
            began = loop.time()
            await self._step(engine, batch)
            step_s = loop.time() - began
            exported = await self._weights(engine)
            self._require_data(exported, "the export's tensors")
            received: list[tuple[WeightBucket, dict[str, torch.Tensor]]] = []
            iterator = engine.export_weights(1).__aiter__()
            step: asyncio.Future[TrainMetrics] | None = None
            ran_between = False
            try:
                while True:
                    try:
                        bucket = await self._wait(
                            iterator.__anext__(), "export_weights(1): next bucket"
                        )
                    except StopAsyncIteration:
                        break
                    received.append((bucket, {n: t.detach().clone() for n, t in bucket}))
                    if step is None:  # after the first bucket: a step while the export is open
                        step = asyncio.ensure_future(engine.train_step(batch, self.make_loss_fn()))
                        # an engine may hold the step until the export ends: the law then
                        # waits this long and goes on (no evidence, no failure)
                        await asyncio.wait([step], timeout=10 * step_s + 0.1)
                        ran_between = step.done()
            finally:
                aclose = getattr(iterator, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()
                if step is not None:
                    await self._wait(step, "train_step() started while an export was open")
            assert step is not None, "export_weights(1) yielded no bucket"
            total = sum(len(copy) for _, copy in received)
            mixed = [
                n for _, copy in received for n, t in copy.items() if not same_bytes(t, exported[n])
            ]
            assert not mixed, (
                f"an export begun before a train_step yielded {len(mixed)} of {total} tensors "
                f"(e.g. {mixed[:3]}) with other values than the weights before the step"
                f"{' (the step had returned before they were drained)' if ran_between else ''}: "
                "the sync mixes two versions. Snapshot every tensor between two steps when "
                "the export begins (copy them on the worker thread, e.g. bucketize(..., "
                "pack=True)), or hold the step until the export ends"
            )
            moved = [
                n
                for bucket, copy in received
                if bucket.snapshot
                for n, t in bucket
                if not same_bytes(t, copy[n])
            ]
            assert not moved, (
                f"buckets flagged snapshot=True changed after they were yielded ({moved[:3]}): "
                "snapshot=True promises a copy made for this sync that nobody changes "
                "afterwards (a transport may still be sending it); set it only on such copies"
            )

        self._law("test_an_export_never_mixes_two_versions", body)

    def test_train_step_keeps_no_reference_to_the_batch(self) -> None:
        """``compute_logprobs`` and ``train_step`` keep no reference to the batch once they
        return (the job reuses its memory for the next step's batch): every tensor of the
        batch's ``data`` and ``lengths`` (copies only the law holds) is freed once the law
        drops the batch after each call (a kept view keeps its base alive too), waiting up to
        ``release_timeout_s`` for it (a worker thread drops its call's arguments just after
        the result is handed over)."""

        async def body(engine: TrainEngine) -> None:
            for call in ("compute_logprobs", "train_step"):
                batch = _copied(self.make_batch())
                refs = {name: weakref.ref(t) for name, t in _batch_tensors(batch)}
                if call == "compute_logprobs":
                    out = await self._wait(engine.compute_logprobs(batch), "compute_logprobs()")
                    del out
                else:
                    await self._step(engine, batch)
                del batch
                deadline = time.monotonic() + self.release_timeout_s
                while True:  # a worker thread may drop its call's arguments just after
                    gc.collect()
                    alive = sorted(name for name, ref in refs.items() if ref() is not None)
                    if not alive or time.monotonic() >= deadline:
                        break
                    await asyncio.sleep(0.01)
                assert not alive, (
                    f"{call}() returned but {self.release_timeout_s:.0f} s later the batch's "
                    f"tensor(s) {alive} are still referenced (the law dropped its own, and "
                    "collected garbage): the engine keeps the batch, or a view of it "
                    "(e.g. the last TokenRows, a cache keyed by batch). The job overwrites that "
                    "memory with the next batch; keep nothing of it once the call returns"
                )

        self._law("test_train_step_keeps_no_reference_to_the_batch", body)

    # -- how calls run -----------------------------------------------------------------------
    def test_train_step_leaves_the_event_loop_free(self) -> None:
        """A trainer computes off the event loop (a worker thread, a process) and waits with
        asyncio primitives: while a ``train_step``, a ``compute_logprobs`` and (for tensors
        that hold data) the first bucket of an export are computed, another task gets to run
        before the call returns. Catches a trainer that computes inside its coroutine (a
        ``return fn(*args)`` where ``await loop.run_in_executor(...)`` belongs), which stalls
        every rollout, store and timer of the job meanwhile."""

        async def body(engine: TrainEngine) -> None:
            async def first_bucket() -> WeightBucket:
                iterator = engine.export_weights(HUGE_BUCKET).__aiter__()
                try:
                    return await iterator.__anext__()
                finally:
                    aclose = getattr(iterator, "aclose", None)
                    if aclose is not None:
                        with contextlib.suppress(Exception):
                            await aclose()

            batch = self.make_batch()
            exported = await self._weights(engine)
            calls: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
                ("train_step()", lambda: engine.train_step(batch, self.make_loss_fn())),
                ("compute_logprobs()", lambda: engine.compute_logprobs(batch)),
            ]
            if not any(t.is_meta for t in exported.values()):
                calls.append(("export_weights(): its first bucket", first_bucket))
            blocked: list[str] = []
            for what, call in calls:
                task = asyncio.ensure_future(call())
                seen: list[bool] = []

                async def marker(task: asyncio.Future[Any] = task, seen: list[bool] = seen) -> None:
                    seen.append(task.done())

                mark = asyncio.ensure_future(marker())
                await self._wait(task, what)
                await mark
                if seen[0]:
                    blocked.append(what)
            assert not blocked, (
                f"{blocked}: no other task ran until the call had returned, so it computed on "
                "the event loop and stalled everything else the job runs. Compute on a worker "
                "thread (await loop.run_in_executor(executor, fn, ...)) or in another process, "
                "and wait with asyncio primitives"
            )

        self._law("test_train_step_leaves_the_event_loop_free", body)

    def test_concurrent_calls_run_in_arrival_order(self) -> None:
        """Calls run one at a time, in the order they were made: ``compute_logprobs``,
        ``train_step``, ``compute_logprobs`` started together (no await between) give, first,
        the log-probs of the weights before the step and, last, those after it (each equal,
        within ``logprob_atol``, to a ``compute_logprobs`` made alone before and after).
        Catches a worker pool of more than one thread, or calls reordered on their way to
        the workers (collectives of a data-parallel group interleave then)."""
        if not self.computes_loss:
            pytest.skip("computes_loss = False: the engine's log-probs do not follow its weights")

        async def body(engine: TrainEngine) -> None:
            batch = self.make_batch()
            lengths = self.response_lengths(batch)

            def rows(lp: torch.Tensor) -> torch.Tensor:
                return torch.cat([lp[i, :n].detach().double().cpu() for i, n in enumerate(lengths)])

            before = rows(await self._wait(engine.compute_logprobs(batch), "compute_logprobs()"))
            first = asyncio.ensure_future(engine.compute_logprobs(batch))
            step = asyncio.ensure_future(engine.train_step(batch, self.make_loss_fn()))
            last = asyncio.ensure_future(engine.compute_logprobs(batch))
            early = rows(await self._wait(first, "compute_logprobs() made before a train_step"))
            await self._wait(step, "train_step() made between two compute_logprobs()")
            late = rows(await self._wait(last, "compute_logprobs() made after a train_step"))
            after = rows(await self._wait(engine.compute_logprobs(batch), "compute_logprobs()"))
            moved = float((after - before).abs().max()) if before.numel() else 0.0
            if moved <= 10 * self.logprob_atol:
                pytest.skip(
                    f"the step moved the log-probs by {moved:.3g} only: make_batch must give a "
                    "gradient that moves them"
                )
            for label, got, want in (
                ("the first compute_logprobs (made before the train_step)", early, before),
                ("the last compute_logprobs (made after the train_step)", late, after),
            ):
                gap = float((got - want).abs().max()) if got.numel() else 0.0
                assert gap <= self.logprob_atol, (
                    f"compute_logprobs, train_step, compute_logprobs were started in that order "
                    f"without an await between: {label} differs by {gap:.3g} from the log-probs "
                    f"of the weights it should have seen (the step moved them by {moved:.3g}). "
                    "Run calls one at a time in arrival order (a single worker thread): calls "
                    "that overlap or overtake each other see half-updated weights, and the "
                    "collectives of a data-parallel group interleave"
                )

        self._law("test_concurrent_calls_run_in_arrival_order", body)

    def test_off_support_tokens_get_the_floor_and_are_counted(self) -> None:
        """A response token off its row's top-k/top-p support gets the documented floor, and
        ``train_step`` counts it: ``vocab_size`` rows on ``make_batch``'s first prompt, row
        ``j``'s response the one token ``j``. At temperature 1, ``compute_logprobs`` gives the
        whole next-token distribution ``p`` (skipped unless it sums to 1: ``vocab_size`` is
        then the model's); with ``top_k=2`` the two most probable tokens get ``log(p / Z)``
        (``Z`` their mass) and every other token ``log p - log(Z + p)`` (``logprob_atol``),
        and a ``train_step`` on those rows reports ``extra["logprobs_off_support"] ==
        vocab_size - 2`` (docs/logprobs.md)."""
        if not self.computes_loss:
            pytest.skip("computes_loss = False: the engine has no model to score with")

        async def body(engine: TrainEngine) -> None:
            v = self.vocab_size
            rows = _one_token_rows(self.make_batch(), self.response_field, v)
            if rows is None:
                pytest.skip(
                    f"make_batch's {self.response_field!r} field is neither padded nor a list "
                    "of rows: the law cannot build one-token responses"
                )

            async def scored(params: SamplingParams) -> torch.Tensor:
                lp = await self._wait(
                    engine.compute_logprobs(_with_sampling(rows, params)), "compute_logprobs()"
                )
                return lp[:, 0].detach().double().cpu()

            full = await scored(SamplingParams(temperature=1.0))
            p = full.exp()
            mass = float(p.sum())
            if abs(mass - 1.0) > 1e-3:
                pytest.skip(
                    f"the {v} tokens below vocab_size have probability {mass:.4f} in all, not 1: "
                    "vocab_size is not the model's vocabulary, so the law cannot see the whole "
                    "distribution"
                )
            top = torch.argsort(p, descending=True)
            if float(p[top[1]] - p[top[2]]) < 1e-3 * float(p[top[1]]):
                pytest.skip("the second and third most probable tokens nearly tie")
            kept = top[:2]
            z = float(p[kept].sum())
            want = torch.log(p) - torch.log(z + p)
            want[kept] = torch.log(p[kept] / z)
            got = await scored(SamplingParams(temperature=1.0, top_k=2))
            gap = (got - want).abs()
            worst = int(gap.argmax())
            assert float(gap[worst]) <= max(self.logprob_atol, 1e-5), (
                f"with top_k=2, compute_logprobs gave token {worst} (probability "
                f"{float(p[worst]):.4f} at temperature 1; the top two {kept.tolist()} hold "
                f"{z:.4f}) the log-prob {float(got[worst]):.5f}; it should be "
                f"{float(want[worst]):.5f}: log(p / Z) on the support and the floor "
                "log p - log(Z + p) off it (docs/logprobs.md; asyncflow_core.training.sampling."
                "sampled_logprobs)"
            )
            metrics = await self._step(engine, _with_sampling(rows, SamplingParams(top_k=2)))
            counted = metrics.extra.get(OFF_SUPPORT_METRIC)
            assert counted is not None and round(counted) == v - 2, (
                f"a train_step on {v} one-token rows with top_k=2, {v - 2} of them off the "
                f"support, reported {OFF_SUPPORT_METRIC}={counted}; trainers count such tokens "
                f"in TrainMetrics.extra[{OFF_SUPPORT_METRIC!r}] (a count far from 0 says the "
                "engine and the trainer filter differently)"
            )

        self._law("test_off_support_tokens_get_the_floor_and_are_counted", body)

    def test_a_checkpoint_that_does_not_fit_changes_nothing(self) -> None:
        """``load_checkpoint`` of a checkpoint this engine cannot take (saved by
        ``make_other_engine()``, a trainer of another model) raises an ``AsyncFlowError``
        (``CheckpointError``) and changes nothing: the version and every exported tensor are
        as before, and the next step works. Catches a load that copies tensors until the
        first that does not fit. Skipped without the ``make_other_engine`` hook."""

        async def body(engine: TrainEngine) -> None:
            other = await self._wait(_resolve(self.make_other_engine()), "make_other_engine()")
            if other is None:
                pytest.skip(
                    "make_other_engine() gives no trainer of another model, whose checkpoint "
                    "this engine could be asked to load"
                )
            batch = self.make_batch()
            try:
                with tempfile.TemporaryDirectory(prefix="asyncflow-misfit-") as tmp:
                    path = str(Path(tmp) / "checkpoint")
                    await self._checkpoint(other, "save", path)
                    await self._step(engine, batch)
                    version = engine.weight_version
                    before = await self._weights(engine)
                    await self._expect_error(
                        engine.load_checkpoint(path),
                        "load_checkpoint() of a checkpoint of another model",
                    )
            finally:
                with contextlib.suppress(Exception):
                    await self._wait(self.close_engine(other), "close_engine(other)")
            assert engine.weight_version == version, (
                f"a rejected load_checkpoint changed weight_version from {version} to "
                f"{engine.weight_version}"
            )
            changed = await self._changed_since(engine, before)
            assert not changed, (
                f"load_checkpoint rejected a checkpoint of another model, yet {len(changed)} "
                f"exported tensor(s) changed (e.g. {changed[:3]}): check every name, shape and "
                "dtype (and the optimizer state) before loading anything"
            )
            await self._step(engine, batch)

        self._law("test_a_checkpoint_that_does_not_fit_changes_nothing", body)

    # -- malformed input, every layout -------------------------------------------------------
    async def _rejected_unchanged(
        self,
        engine: TrainEngine,
        cases: Sequence[tuple[str, Callable[[], Awaitable[Any]]]],
        batch: Batch,
    ) -> None:
        """Each ``(what, call)``: ``call()`` must raise an ``AsyncFlowError``, one after the
        other; then the version and every exported tensor are as before them, and ``batch``
        trains."""
        version = engine.weight_version
        before = await self._weights(engine)
        for what, call in cases:
            await self._expect_error(call(), what)
            assert engine.weight_version == version, (
                f"{what} was rejected, yet weight_version went from {version} to "
                f"{engine.weight_version}"
            )
        changed = await self._changed_since(engine, before)
        assert not changed, (
            f"{len(cases)} rejected call(s) ({', '.join(w for w, _ in cases)}) changed "
            f"{len(changed)} exported tensor(s), e.g. {changed[:3]}: check the whole batch "
            "(and the loss's result) before any weight changes"
        )
        await self._step(engine, batch)

    def test_a_malformed_batch_is_rejected(self) -> None:
        """``make_batch()`` made malformed, one way at a time, where its layout allows: its
        ``response_field`` one row short of the others; a list-layout response row shaped
        ``[1, n]``; a list-layout ``loss_mask`` whose first row is one value short of its
        response; a ``[B]`` ``loss_mask`` (a value per row, not per token). ``train_step``
        (and, for the response cases, ``compute_logprobs``) raises an ``AsyncFlowError`` (not
        a torch ``RuntimeError`` or ``IndexError`` from deep inside), nothing changes, and the
        valid batch then trains (the Errors table: bad input is an ``EngineError``)."""
        if not self.computes_loss:
            pytest.skip("computes_loss = False: the engine has no model to feed a batch")

        async def body(engine: TrainEngine) -> None:
            batch = self.make_batch()
            field = self.response_field
            bad = _malformed_batches(batch, field, self.response_lengths(batch))
            if not bad:
                pytest.skip(
                    f"make_batch's {field!r} field is neither padded nor a list of rows: the "
                    "law cannot make it malformed"
                )
            loss = self.make_loss_fn()
            cases: list[tuple[str, Callable[[], Awaitable[Any]]]] = []
            for kind, rows in bad:
                cases.append(
                    (f"train_step() of a batch with {kind}",
                     functools.partial(engine.train_step, rows, loss))
                )  # fmt: skip
                if not kind.startswith("loss-mask"):
                    cases.append(
                        (f"compute_logprobs() of a batch with {kind}",
                         functools.partial(engine.compute_logprobs, rows))
                    )  # fmt: skip
            await self._rejected_unchanged(engine, cases, batch)

        self._law("test_a_malformed_batch_is_rejected", body)

    def test_a_malformed_loss_result_is_rejected(self) -> None:
        """A ``loss_fn`` that breaks ``LossFn``'s contract (``(loss, metrics)``, metrics
        mapping names to numbers): one returning ``(loss, metrics, extra)``, one returning the
        bare loss tensor, and, for an engine that reports the loss's metrics in
        ``TrainMetrics.extra``, one whose metrics hold a string and one whose metrics hold
        None. ``train_step`` raises an ``AsyncFlowError`` naming the loss's result (a failed
        step is an ``EngineError``, never a ``ValueError`` or ``TypeError`` of the engine's own
        unpacking; ``asyncflow_core.engines.lmtrain.check_loss`` checks it), nothing changes,
        and a valid step then trains."""
        if not self.computes_loss:
            pytest.skip("computes_loss = False: the engine calls no loss")
        good = self.make_loss_fn()
        probe = _BrokenLoss.PROBE

        def broken(how: str) -> LossFn:
            return cast(LossFn, _BrokenLoss(good, how))

        async def body(engine: TrainEngine) -> None:
            batch = self.make_batch()
            reported = await self._step(engine, batch, broken("probe"))
            kinds = ["three-tuple", "bare-loss"]
            if (
                probe in reported.extra
            ):  # the engine reports the loss's metrics: they must be numbers
                kinds += ["metric-a-string", "metric-none"]
            cases = [
                (f"train_step() with a loss_fn returning a {k} result",
                 functools.partial(engine.train_step, batch, broken(k)))
                for k in kinds
            ]  # fmt: skip
            await self._rejected_unchanged(engine, cases, batch)

        self._law("test_a_malformed_loss_result_is_rejected", body)

    def test_every_batch_layout_is_read_alike(self) -> None:
        """A ``DataStore`` hands a consumer any layout (the ``Batch`` docstring; the rows'
        sampling fields are written as 0-dim cells, ``sampling_columns``): ``compute_logprobs``
        of ``make_batch()`` with sampling fields (temperature 0.7, ``top_k`` 3, ``top_p`` 0.9)
        as ``[B]`` tensors equals it with them as lists of 0-dim tensors (``logprob_atol``);
        and, from one checkpoint, a step with a ``[B, R]`` ``loss_mask`` reports the loss and
        grad norm of the step with the same mask as a list of 1-D rows (``metrics_rtol``)."""
        if not self.computes_loss:
            pytest.skip("computes_loss = False: the engine has no model to score with")

        async def body(engine: TrainEngine) -> None:
            batch = self.make_batch()
            stacked = _with_sampling(batch, SamplingParams(temperature=0.7, top_k=3, top_p=0.9))
            listed = _listed(stacked, SAMPLING_FIELDS)
            a = await self._wait(engine.compute_logprobs(stacked), "compute_logprobs([B])")
            c = await self._wait(engine.compute_logprobs(listed), "compute_logprobs(lists)")
            lengths = self.response_lengths(batch)
            gap = max(
                (float((a[i, :n] - c[i, :n]).abs().max()) for i, n in enumerate(lengths) if n),
                default=0.0,
            )
            assert tuple(a.shape) == tuple(c.shape) and gap <= self.logprob_atol, (
                f"compute_logprobs gave other log-probs when the rows' sampling fields came as "
                f"lists of 0-dim tensors instead of [B] tensors (shapes {tuple(a.shape)} and "
                f"{tuple(c.shape)}, largest difference {gap:.3g} > logprob_atol="
                f"{self.logprob_atol}): read every layout of a field alike "
                "(asyncflow_core.training.sampling.row_sampling does)"
            )
            masked, _ = _masked_tails(batch, self.response_field, lengths)
            value = None if masked is None else masked.data.get(LOSS_MASK)
            if not isinstance(value, torch.Tensor):
                return  # the mask half needs a padded response with a tail to mask
            assert masked is not None
            as_rows = _listed(masked, [LOSS_MASK], lengths)
            runs: dict[str, TrainMetrics] = {}
            with tempfile.TemporaryDirectory(prefix="asyncflow-layout-") as tmp:
                path = str(Path(tmp) / "checkpoint")
                await self._checkpoint(engine, "save", path)
                for label, rows in (("padded", masked), ("list", as_rows)):
                    await self._checkpoint(engine, "load", path)
                    runs[label] = await self._step(engine, rows)
            p, q = runs["padded"], runs["list"]
            assert metrics_apart(p, q) <= self.metrics_rtol, (
                f"a step with a [B, R] loss_mask reported loss {p.loss:.6g} and grad norm "
                f"{p.grad_norm:.6g}; with the same mask as a list of 1-D rows: {q.loss:.6g} and "
                f"{q.grad_norm:.6g} (metrics_rtol={self.metrics_rtol}): read every layout of "
                "loss_mask alike (asyncflow_core.training.rl.response_mask)"
            )

        self._law("test_every_batch_layout_is_read_alike", body)

    def test_a_lost_trainer_fails_every_call(self) -> None:
        """``lose(engine)`` (the hook; without it the law is skipped) with a ``train_step`` in
        flight: it raises ``EngineLostError`` within ``timeout_s`` (it does not hang), and so
        does every later ``train_step``, ``compute_logprobs``, ``save_checkpoint`` and the
        first bucket of ``export_weights``: the job stops, naming what died, instead of
        waiting for a trainer that is gone."""
        self._require_lose()

        async def body(engine: TrainEngine) -> None:
            batch, loss = self.make_batch(), self.make_loss_fn()
            step = asyncio.ensure_future(engine.train_step(batch, loss))
            await asyncio.sleep(0)  # train_step ran to its first await: in flight
            in_flight = not step.done()
            await self._lose(engine)
            if in_flight:
                await self._expect_lost(step, "train_step()", "in flight at the loss")
            else:  # it ended within one loop step: nothing in flight to check
                step.exception()
            with tempfile.TemporaryDirectory() as tmp:
                later: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
                    ("train_step()", lambda: engine.train_step(batch, loss)),
                    ("compute_logprobs()", lambda: engine.compute_logprobs(batch)),
                    ("save_checkpoint()", lambda: engine.save_checkpoint(str(Path(tmp) / "c"))),
                    (
                        f"export_weights({HUGE_BUCKET}): the first bucket",
                        lambda: _first_bucket(engine),
                    ),
                ]
                for what, call in later:
                    await self._expect_lost(call(), what, "after the trainer was lost")

        self._law("test_a_lost_trainer_fails_every_call", body)


async def _first_bucket(engine: TrainEngine) -> WeightBucket | None:
    """The first bucket of ``export_weights`` (None for an export of none), the export then
    closed."""
    iterator = engine.export_weights(HUGE_BUCKET).__aiter__()
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        return None
    finally:
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()


# --------------------------------------------------------------------------------------------
# WeightSync
# --------------------------------------------------------------------------------------------
Phase = Literal["init", "start", "update", "finish"]


@dataclass(frozen=True, slots=True)
class PhaseMisuse:
    """Valid calls that set a state (``before``), then an out-of-order ``call``."""

    id: str
    before: tuple[Phase, ...]
    call: Phase


PHASE_MISUSES: tuple[PhaseMisuse, ...] = (
    PhaseMisuse("start-before-init", (), "start"),
    PhaseMisuse("update-before-init", (), "update"),
    PhaseMisuse("finish-before-init", (), "finish"),
    PhaseMisuse("init-twice", ("init",), "init"),
    PhaseMisuse("update-before-start", ("init",), "update"),
    PhaseMisuse("finish-before-start", ("init",), "finish"),
    PhaseMisuse("start-twice", ("init", "start"), "start"),
    PhaseMisuse("init-during-a-sync", ("init", "start"), "init"),
    PhaseMisuse("update-after-finish", ("init", "start", "finish"), "update"),
    PhaseMisuse("finish-twice", ("init", "start", "finish"), "finish"),
)
"""The out-of-order calls that must raise ``WeightSyncError``."""


@dataclass
class _SyncSetup:
    source: Any
    targets: list[Any]
    sync: Any


class WeightSyncConformance(_Suite):
    """The ``WeightSync`` laws; subclass it (as ``Test...``) and implement ``make_source``,
    ``make_targets`` and ``make_sync``; ``target_weights`` enables the byte-equality law."""

    bucket_bytes: ClassVar[int] = 1 << 20
    """Bucket size of the source's exports."""
    max_tokens: ClassVar[int] = 4
    """Cap of the request each target generates after a sync."""

    # -- hooks -------------------------------------------------------------------------------
    def make_source(self) -> TrainEngine | Awaitable[TrainEngine]:
        """A fresh train engine whose ``export_weights`` feeds the syncs."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement make_source(self) -> TrainEngine"
        )

    def make_targets(self) -> Sequence[Any] | Awaitable[Sequence[Any]]:
        """Fresh inference engines (``SupportsLoadWeights``) to sync into."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement make_targets(self), returning fresh "
            "inference engines that support load_weights"
        )

    def make_sync(self, targets: Sequence[Any]) -> WeightSync | Awaitable[WeightSync]:
        """A fresh, not yet initialised ``WeightSync`` into ``targets``."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement make_sync(self, targets) -> WeightSync"
        )

    def target_weights(self, engine: Any) -> Mapping[str, torch.Tensor] | None:
        """The weights a target holds now, by name (default None: the byte-equality law is
        skipped)."""
        return None

    def prompt_tokens(self) -> Sequence[int]:
        """The prompt each target generates from after a sync."""
        return (1, 2, 3, 4)

    # -- plumbing ----------------------------------------------------------------------------
    def _law(self, name: str, body: Callable[[_SyncSetup], Coroutine[Any, Any, None]]) -> None:
        async def main() -> None:
            source = await self._wait(_resolve(self.make_source()), "make_source()")
            assert isinstance(source, TrainEngine), (
                f"make_source() returned {type(source).__name__}, not a TrainEngine"
            )
            targets = list(await self._wait(_resolve(self.make_targets()), "make_targets()"))
            assert targets, "make_targets() returned no target"
            for t in targets:
                assert isinstance(t, SupportsLoadWeights), (
                    f"make_targets() returned {type(t).__name__}, which lacks load_weights"
                )
            sync = await self._wait(_resolve(self.make_sync(targets)), "make_sync(targets)")
            assert isinstance(sync, WeightSync), (
                f"make_sync() returned {type(sync).__name__}, not a WeightSync"
            )
            try:
                await body(_SyncSetup(source, targets, sync))
            finally:
                for obj in (sync, *targets, source):
                    with contextlib.suppress(Exception):
                        await self._wait(self.close_engine(obj), "close_engine()")

        self._run(name, main)

    async def _buckets(self, source: TrainEngine) -> list[WeightBucket]:
        what = f"export_weights({self.bucket_bytes})"
        buckets: list[WeightBucket] = []
        iterator = source.export_weights(self.bucket_bytes).__aiter__()
        while True:
            try:
                buckets.append(await self._wait(iterator.__anext__(), f"{what}: next bucket"))
            except StopAsyncIteration:
                break
        check_export(buckets, self.bucket_bytes, what)
        return buckets

    async def _call(self, sync: WeightSync, phase: Phase, bucket: WeightBucket, v: int) -> None:
        if phase == "init":
            await self._wait(sync.init(), "init()")
        elif phase == "start":
            await self._wait(sync.start(), "start()")
        elif phase == "update":
            await self._wait(sync.update(bucket), "update(bucket)")
        else:
            await self._wait(sync.finish(v), f"finish({v})")

    async def _sync(
        self, sync: WeightSync, buckets: Sequence[WeightBucket], version: Version, *, init: bool
    ) -> None:
        if init:
            await self._wait(sync.init(), "init()")
        await self._wait(sync.start(), "start()")
        for i, bucket in enumerate(buckets):
            await self._wait(sync.update(bucket), f"update(bucket {i})")
        await self._wait(sync.finish(version), f"finish({version})")

    async def _check_versions(self, targets: Sequence[Any], version: Version, when: str) -> None:
        for i, target in enumerate(targets):
            reported = getattr(target, "weight_version", None)
            assert reported == version, (
                f"{when}: target {i} ({type(target).__name__}) reports weight_version "
                f"{reported}, not {version}"
            )
            if isinstance(target, InferenceEngine):
                params = SamplingParams(max_tokens=self.max_tokens, seed=i, stop_token_ids=(1, 2))
                request = GenerationRequest(
                    f"after-{version}-{i}", tuple(self.prompt_tokens()), params
                )
                result = await self._wait(target.generate(request), f"target {i}: generate()")
                check_generation_result(
                    request,
                    result,
                    submitted_version=version,
                    current_version=target.weight_version,
                    where=f"{when}: target {i}",
                )

    @staticmethod
    def _base(targets: Sequence[Any]) -> Version:
        return max(int(getattr(t, "weight_version", 0)) for t in targets)

    # -- the laws ----------------------------------------------------------------------------
    @pytest.mark.parametrize("misuse", PHASE_MISUSES, ids=[m.id for m in PHASE_MISUSES])
    def test_out_of_order_phases_raise(self, misuse: PhaseMisuse) -> None:
        """Each out-of-order call of ``PHASE_MISUSES`` raises ``WeightSyncError`` with a
        message and changes no state: the sync then completes from where it was, and every
        target reports the finished version."""

        async def body(s: _SyncSetup) -> None:
            buckets = await self._buckets(s.source)
            assert buckets, "the source exported nothing"
            base = self._base(s.targets)
            for phase in misuse.before:
                await self._call(s.sync, phase, buckets[0], base + 1)
            if "finish" in misuse.before:
                base += 1
            try:
                await self._call(s.sync, misuse.call, buckets[0], base + 1)
            except WeightSyncError as exc:
                assert str(exc).strip(), f"{misuse.id}: WeightSyncError with an empty message"
            except AssertionError:
                raise
            except Exception as exc:
                raise AssertionError(
                    f"{misuse.id}: {misuse.call}() raised {type(exc).__name__}: {exc}, not "
                    "WeightSyncError"
                ) from exc
            else:
                raise AssertionError(
                    f"{misuse.id}: {misuse.call}() after {list(misuse.before) or 'nothing'} "
                    "was accepted; out-of-order calls raise WeightSyncError"
                )
            state = (
                "new" if not misuse.before else "open" if misuse.before[-1] == "start" else "ready"
            )
            if state == "new":
                await self._wait(s.sync.init(), "init() after a rejected call")
            if state != "open":
                await self._wait(s.sync.start(), "start() after a rejected call")
            for i, bucket in enumerate(buckets):
                await self._wait(s.sync.update(bucket), f"update(bucket {i})")
            await self._wait(s.sync.finish(base + 1), f"finish({base + 1})")
            await self._check_versions(s.targets, base + 1, f"after {misuse.id} was rejected")

        self._law(f"test_out_of_order_phases_raise[{misuse.id}]", body)

    def test_finish_sets_every_target_version(self) -> None:
        """After ``start``, ``update`` of every exported bucket and ``finish(v)`` (twice, with
        increasing v), every target's ``weight_version`` is ``v`` and its new tokens report
        ``>= v``."""

        async def body(s: _SyncSetup) -> None:
            buckets = await self._buckets(s.source)
            base = self._base(s.targets)
            for step in (1, 2):
                await self._sync(s.sync, buckets, base + step, init=step == 1)
                await self._check_versions(s.targets, base + step, f"after finish({base + step})")

        self._law("test_finish_sets_every_target_version", body)

    def test_a_sync_of_zero_buckets_sets_the_version(self) -> None:
        """``start`` then ``finish(v)`` with no bucket still sets every target to ``v``."""

        async def body(s: _SyncSetup) -> None:
            version = self._base(s.targets) + 1
            await self._sync(s.sync, [], version, init=True)
            await self._check_versions(s.targets, version, f"after an empty sync to {version}")

        self._law("test_a_sync_of_zero_buckets_sets_the_version", body)

    def test_bucket_round_trip_is_byte_equal(self) -> None:
        """Every tensor sent arrives byte-equal (dtype, shape, bytes) in every target: first
        the source's export, then a second sync of the same buckets with every value changed
        (so a transport that moves nothing cannot pass)."""

        async def body(s: _SyncSetup) -> None:
            if self.target_weights(s.targets[0]) is None:
                pytest.skip("target_weights() is not provided: the targets' weights are opaque")
            buckets = await self._buckets(s.source)
            meta = [n for b in buckets for n, t in b if t.is_meta]
            if meta:
                pytest.skip(f"the source exports meta tensors (no data, e.g. {meta[0]!r})")
            assert buckets, "the source exported nothing"
            base = self._base(s.targets)
            changed = [WeightBucket(b.names, tuple(_flip(t) for t in b.tensors)) for b in buckets]
            for step, sent in ((1, buckets), (2, changed)):
                expected = {n: t.detach().clone() for b in sent for n, t in b}
                await self._sync(s.sync, sent, base + step, init=step == 1)
                for i, target in enumerate(s.targets):
                    held = self.target_weights(target)
                    assert held is not None, f"target_weights(target {i}) returned None"
                    for name, tensor in expected.items():
                        assert name in held, f"sync {step}: target {i} has no {name!r}"
                        assert same_bytes(tensor, held[name]), (
                            f"sync {step}: target {i} holds {name!r} as "
                            f"{_describe_tensor(held[name])}, not byte-equal to the "
                            f"{_describe_tensor(tensor)} sent"
                        )

        self._law("test_bucket_round_trip_is_byte_equal", body)

    def test_a_duplicate_parameter_is_rejected(self) -> None:
        """A parameter sent twice in one sync raises ``WeightSyncError`` with a message and
        changes nothing: every exported parameter but the last (``p``) goes in a first
        ``update``; a bucket naming ``p`` twice, and one of ``p`` with a parameter already
        sent, are each rejected; ``p`` alone is then accepted (the rejected buckets staged
        nothing), and rejected when sent again; after ``finish(v)`` every target reports
        ``v``."""

        async def body(s: _SyncSetup) -> None:
            named = [(n, t) for b in await self._buckets(s.source) for n, t in b]
            assert named, "the source exported nothing"
            (held, tensor), rest = named[-1], named[:-1]
            version = self._base(s.targets) + 1
            await self._wait(s.sync.init(), "init()")
            await self._wait(s.sync.start(), "start()")
            if rest:
                first = WeightBucket(tuple(n for n, _ in rest), tuple(t for _, t in rest))
                await self._wait(s.sync.update(first), "update(every parameter but one)")

            async def rejected(what: str, bucket: WeightBucket) -> None:
                try:
                    await self._wait(s.sync.update(bucket), f"update({what})")
                except WeightSyncError as exc:
                    assert str(exc).strip(), f"update({what}): WeightSyncError without a message"
                    return
                except AssertionError:
                    raise
                except Exception as exc:
                    raise AssertionError(
                        f"update({what}) raised {type(exc).__name__}: {exc}, not WeightSyncError"
                    ) from exc
                raise AssertionError(
                    f"update of a bucket of {what} was accepted: a parameter sent twice in one "
                    "sync raises WeightSyncError (which copy would the targets load?)"
                )

            await rejected(f"{held!r} twice", WeightBucket((held, held), (tensor, tensor)))
            if rest:
                (sent, other) = rest[0]
                await rejected(
                    f"{held!r} and {sent!r}, sent already",
                    WeightBucket((held, sent), (tensor, other)),
                )
            try:
                await self._wait(s.sync.update(WeightBucket((held,), (tensor,))), "update")
            except WeightSyncError as exc:
                raise AssertionError(
                    f"update of {held!r} alone, after buckets holding it were rejected, raised "
                    f"{exc}: a rejected update must stage nothing (nor mark its names sent)"
                ) from exc
            await rejected(f"{held!r} again", WeightBucket((held,), (tensor,)))
            await self._wait(s.sync.finish(version), f"finish({version})")
            await self._check_versions(s.targets, version, "after the duplicates were rejected")

        self._law("test_a_duplicate_parameter_is_rejected", body)

    def test_a_live_bucket_may_change_after_update(self) -> None:
        """A bucket with ``snapshot=False`` may hold the trainer's live tensors: once
        ``update`` returns the transport is done reading them, so the trainer may change them.
        Each bucket is sent as fresh copies that the law overwrites as soon as ``update``
        returns; after ``finish`` every target holds, byte for byte, the values as they were
        at ``update``. Needs ``target_weights``."""

        async def body(s: _SyncSetup) -> None:
            if self.target_weights(s.targets[0]) is None:
                pytest.skip("target_weights() is not provided: the targets' weights are opaque")
            buckets = await self._buckets(s.source)
            meta = [n for b in buckets for n, t in b if t.is_meta]
            if meta:
                pytest.skip(f"the source exports meta tensors (no data, e.g. {meta[0]!r})")
            assert buckets, "the source exported nothing"
            version = self._base(s.targets) + 1
            sent: dict[str, torch.Tensor] = {}
            await self._wait(s.sync.init(), "init()")
            await self._wait(s.sync.start(), "start()")
            for i, bucket in enumerate(buckets):
                live = tuple(t.detach().clone() for t in bucket.tensors)
                sent.update((n, t.clone()) for n, t in zip(bucket.names, live, strict=True))
                await self._wait(
                    s.sync.update(WeightBucket(bucket.names, live, snapshot=False)),
                    f"update(bucket {i})",
                )
                for t in live:  # the trainer steps on: its live tensors change in place
                    t.copy_(_flip(t))
            await self._wait(s.sync.finish(version), f"finish({version})")
            for i, target in enumerate(s.targets):
                held = self.target_weights(target)
                assert held is not None, f"target_weights(target {i}) returned None"
                changed = [n for n, t in sent.items() if not same_bytes(t, held[n])]
                assert not changed, (
                    f"target {i} holds {len(changed)} tensor(s) (e.g. {changed[:3]}) other than "
                    "they were when update() returned: the bucket's tensors changed after "
                    "update, and the transport read them later. A bucket with snapshot=False "
                    "may be the trainer's live parameters: copy (or finish sending) its "
                    "tensors before update() returns"
                )

        self._law("test_a_live_bucket_may_change_after_update", body)


def _flip(t: torch.Tensor) -> torch.Tensor:
    """A tensor of the same dtype and shape with (nearly) every value changed."""
    t = t.detach().clone()
    if t.dtype == torch.bool:
        return ~t
    if t.is_floating_point() or t.is_complex():
        return -t - 1  # equal to t only where t == -0.5
    return t ^ 1
