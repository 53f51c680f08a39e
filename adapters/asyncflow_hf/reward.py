"""User rewards for the Hugging Face path, and a built-in math reward.

The contract: ``reward(completion: str, row: Mapping) -> float``, where ``completion`` is the
decoded response and ``row`` the dataset row it answers (every field of the file, the answer
among them). A reward is named ``package.module:function`` and imported by name
(``load_reward``), never evaluated from a string. It may be:

* sync (``def``): each call runs in a worker thread, so a call that hangs can be given up on
  (a thread cannot be killed: a hung call keeps its thread, counted in
  ``RewardRunner.hung``; the others are reused);
* async (``async def``): awaited on the caller's loop and cancelled at its timeout (a
  coroutine that blocks the loop without awaiting, or swallows the cancellation, cannot be
  timed out: don't);
* batched (``@batched``, or a ``batched = True`` attribute): called once per batch as
  ``reward(completions: list[str], rows: list[Mapping]) -> Sequence[float]`` (sync or async),
  one score per row in order.

``RewardRunner`` scores a batch with a timeout per call. A call that raises, passes its
timeout, or returns something other than a finite number (a bool is refused too: return
``float(ok)``) fails its row, or every row of a batched call, and nothing else: each row
gets a ``RewardResult``, a score or an error that names the reward, the row and what
happened. Failed rows are **not retried** (a reward that raised on an input raises again, and
a hung one would cost another timeout); the caller logs the error and drops the sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import math
import numbers
import os
import queue
import re
import sys
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, TypeVar

from asyncflow_core.contracts.errors import AsyncFlowError, ConfigError
from asyncflow_core.engines.enginekit import is_int

__all__ = [
    "RewardError",
    "RewardFn",
    "RewardResult",
    "RewardRunner",
    "batched",
    "extract_answer",
    "is_batched",
    "load_reward",
    "make_math_reward",
    "math_reward",
    "math_reward_strict",
    "reference_answer",
]

RewardFn = Callable[..., Any]
"""``(completion, row) -> float`` (or an awaitable of it); batched: ``(completions, rows) ->
Sequence[float]``."""

F = TypeVar("F", bound=Callable[..., Any])


class RewardError(AsyncFlowError, ValueError):
    """A ``RewardRunner`` called wrongly (completions and rows of different lengths, the sync
    entry point inside a running event loop). A reward failing on a row is not raised: it is
    that row's ``RewardResult.error``."""


def batched(fn: F) -> F:
    """Mark ``fn`` as a batched reward: ``fn(completions, rows) -> Sequence[float]``."""
    fn.batched = True  # type: ignore[attr-defined]
    return fn


def is_batched(fn: RewardFn) -> bool:
    """Whether ``fn`` is declared batched (``@batched``, or ``batched = True`` on it)."""
    return getattr(fn, "batched", False) is True


def _is_async(fn: RewardFn) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an object whose __call__ is async
    )


def _name(fn: RewardFn) -> str:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}:{qualname}" if module else str(qualname)


# --------------------------------------------------------------------------------------------
# Loading a reward by name
# --------------------------------------------------------------------------------------------
_SPEC = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
_EXAMPLE = "'asyncflow_hf.reward:math_reward'"


def _missing_module_hint(top: str) -> str:
    cwd = os.getcwd()
    here = Path(cwd)
    on_path = cwd in sys.path or "" in sys.path
    if not on_path and ((here / f"{top}.py").is_file() or (here / top).is_dir()):
        return (
            f"; {top!r} is in the working directory {cwd!r}, which is not on sys.path: "
            "run with PYTHONPATH=. (or install it)"
        )
    return "; install it or put its folder on PYTHONPATH"


def load_reward(spec: str) -> RewardFn:
    """The callable named by ``spec`` = ``"package.module:function"`` (``function`` may be a
    dotted attribute path, e.g. ``module:Class.method`` or an object with ``__call__``),
    imported by name. ``ConfigError`` for a malformed spec, a module that is missing or fails
    to import, a missing attribute (listing the module's public callables), something not
    callable, or a signature that cannot take ``(completion, row)``."""
    match = _SPEC.fullmatch(spec.strip()) if isinstance(spec, str) else None
    if match is None:
        raise ConfigError(
            f"reward {spec!r} must be 'package.module:function' (a module importable here and "
            f"a callable in it), e.g. {_EXAMPLE}"
        )
    module_name, attribute = match.groups()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            hint = _missing_module_hint(module_name.split(".")[0])
            raise ConfigError(f"reward {spec!r}: no module named {missing!r}{hint}") from exc
        raise ConfigError(
            f"reward {spec!r}: importing {module_name!r} failed: it needs {missing!r}, which "
            f"is not installed ({exc})"
        ) from exc
    except Exception as exc:
        raise ConfigError(
            f"reward {spec!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    obj: Any = module
    for i, part in enumerate(attribute.split(".")):
        if not hasattr(obj, part):
            owner = module_name if i == 0 else f"{module_name}:{'.'.join(attribute.split('.')[:i])}"
            public = sorted(
                n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None))
            )
            raise ConfigError(
                f"reward {spec!r}: {owner!r} has no attribute {part!r} (its public callables: "
                f"{public})"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(
            f"reward {spec!r} is a {type(obj).__name__} ({obj!r:.60}), not a function; name a "
            "callable reward(completion, row) -> float"
        )
    _check_signature(obj, spec)
    return obj  # type: ignore[no-any-return]


def _check_signature(fn: RewardFn, who: str) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none: find out at the first call
        return
    args: tuple[object, ...] = ([], []) if is_batched(fn) else ("", {})
    try:
        signature.bind(*args)
    except TypeError as exc:
        call = "reward(completions, rows)" if is_batched(fn) else "reward(completion, row)"
        raise ConfigError(
            f"reward {who!r} has signature {signature}, which cannot be called as {call} ({exc})"
        ) from exc


# --------------------------------------------------------------------------------------------
# Running rewards with a timeout, a failing row failing alone
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RewardResult:
    """One row's outcome: ``score`` (a finite float) or ``error`` (why the row failed)."""

    row: object
    """The caller's id for the row (its position in the batch unless ``ids`` were given)."""
    score: float | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _describe(value: object) -> str:
    return f"{value!r:.80} ({type(value).__module__}.{type(value).__qualname__})".replace(
        "(builtins.", "("
    )


def _as_score(value: object) -> tuple[float | None, str | None]:
    """``(score, None)`` for a finite real number, else ``(None, what is wrong)``."""
    if isinstance(value, bool):
        return None, f"returned {value!r}, a bool; return a float (e.g. float(correct))"
    if isinstance(value, numbers.Real):
        score = float(value)
        if math.isfinite(score):
            return score, None
        return None, f"returned {value!r}; a reward must be a finite number"
    return None, f"returned {_describe(value)}, not a number; return a finite float"


def _raised(exc: BaseException) -> str:
    """``raised ValueError: message (at rewards.py:12)``: the error and where it came from."""
    message = f": {exc}" if str(exc) else ""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"raised {type(exc).__name__}{message}{where}"


class RewardRunner:
    """Scores completions with ``fn`` (see the module's contract), ``timeout_s`` per call
    (per row, or per batch for a batched reward) and at most ``max_concurrency`` calls at
    once within one ``score`` call. Sync calls run in worker threads that the runner reuses
    (``close()`` ends the idle ones); a call that outlives its timeout keeps its thread
    (counted in ``hung``), and once ``max_hung`` such threads are alive, further rows fail at
    once rather than start more.
    ``name`` (default ``module:qualname``) is what errors call the reward."""

    def __init__(
        self,
        fn: RewardFn,
        *,
        name: str | None = None,
        timeout_s: float = 30.0,
        max_concurrency: int = 8,
        max_hung: int = 16,
    ) -> None:
        if not callable(fn):
            raise ConfigError(f"RewardRunner: the reward must be callable, got {_describe(fn)}")
        if (
            not isinstance(timeout_s, int | float)
            or isinstance(timeout_s, bool)
            or not 0 < timeout_s < math.inf
        ):
            raise ConfigError(f"RewardRunner: timeout_s must be a number > 0, got {timeout_s!r}")
        for key, value in (("max_concurrency", max_concurrency), ("max_hung", max_hung)):
            if not is_int(value) or value < 1:
                raise ConfigError(f"RewardRunner: {key} must be an int >= 1, got {value!r}")
        self.fn = fn
        self.name = name or _name(fn)
        self.timeout_s = float(timeout_s)
        self.max_concurrency = max_concurrency
        self.max_hung = max_hung
        self.is_async = _is_async(fn)
        self.is_batched = is_batched(fn)
        self._hung: list[threading.Thread] = []
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()

    @property
    def hung(self) -> int:
        """Threads of sync calls that passed their timeout and are still running."""
        with self._lock:
            self._hung = [t for t in self._hung if t.is_alive()]
            return len(self._hung)

    def _fail(self, row: object, what: str) -> RewardResult:
        return RewardResult(row, None, f"reward {self.name!r} failed on row {row!r}: {what}")

    async def score(
        self,
        completions: Sequence[str],
        rows: Sequence[Mapping[str, Any]],
        *,
        ids: Sequence[object] | None = None,
    ) -> list[RewardResult]:
        """One ``RewardResult`` per completion, in order; never raises for a reward's
        failure. ``ids`` name the rows in errors (default: their positions)."""
        n = len(completions)
        if len(rows) != n or (ids is not None and len(ids) != n):
            raise RewardError(
                f"reward {self.name!r}: {n} completions, {len(rows)} rows"
                f"{'' if ids is None else f' and {len(ids)} ids'}; pass one row per completion"
            )
        names: list[object] = list(range(n)) if ids is None else list(ids)
        if self.is_batched:
            return await self._score_batch(list(completions), list(rows), names)
        slots = asyncio.Semaphore(self.max_concurrency)

        async def one(completion: str, row: Mapping[str, Any], rid: object) -> RewardResult:
            async with slots:
                value, failure = await self._call((completion, row))
            if failure is None:
                score, failure = _as_score(value)
                if failure is None:
                    return RewardResult(rid, score)
            return self._fail(rid, failure)

        return list(
            await asyncio.gather(
                *(one(c, r, rid) for c, r, rid in zip(completions, rows, names, strict=True))
            )
        )

    def score_sync(
        self,
        completions: Sequence[str],
        rows: Sequence[Mapping[str, Any]],
        *,
        ids: Sequence[object] | None = None,
    ) -> list[RewardResult]:
        """``score`` from synchronous code (a worker thread): runs it on a new event loop."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.score(completions, rows, ids=ids))
        raise RewardError(
            f"reward {self.name!r}: score_sync was called inside a running event loop; "
            "await RewardRunner.score(...) there instead"
        )

    async def _score_batch(
        self, completions: list[str], rows: list[Mapping[str, Any]], names: list[object]
    ) -> list[RewardResult]:
        values, failure = await self._call((completions, rows))
        if failure is None and (
            isinstance(values, str | bytes | Mapping) or not isinstance(values, Sequence)
        ):
            failure = f"returned {_describe(values)}; a batched reward returns a list of floats"
        elif failure is None and len(values) != len(names):
            failure = (
                f"returned {len(values)} scores for {len(names)} rows; a batched reward "
                "returns one score per row, in order"
            )
        if failure is not None:
            batch = f"{failure} (the whole batch of {len(names)} rows fails with it)"
            return [self._fail(rid, batch) for rid in names]
        results = []
        for rid, value in zip(names, values, strict=True):
            score, bad = _as_score(value)
            results.append(RewardResult(rid, score) if bad is None else self._fail(rid, bad))
        return results

    async def _call(self, args: tuple[object, object]) -> tuple[Any, str | None]:
        """``(value, None)``, or ``(None, why the call failed)``."""
        if self.is_async:
            return await self._call_async(args)
        if self.hung >= self.max_hung:
            return None, (
                f"not run: {self.max_hung} earlier calls are still running past timeout_s="
                f"{self.timeout_s:g} (the reward blocks); fix it, or raise timeout_s"
            )
        return await self._call_in_thread(args)

    async def _call_async(self, args: tuple[object, object]) -> tuple[Any, str | None]:
        try:
            awaitable = self.fn(*args)
        except Exception as exc:
            return None, _raised(exc)
        if not inspect.isawaitable(awaitable):
            return awaitable, None
        task: asyncio.Future[Any] = asyncio.ensure_future(awaitable)
        done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
        if not done:
            task.cancel()
            # its outcome (cancelled or an error it raised on the way) is nobody's business now
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            return None, f"did not return within timeout_s={self.timeout_s:g} s (cancelled)"
        if task.cancelled():
            return None, "was cancelled"
        error = task.exception()
        return (None, _raised(error)) if error is not None else (task.result(), None)

    async def _call_in_thread(self, args: tuple[object, object]) -> tuple[Any, str | None]:
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future[tuple[Any, str | None]] = loop.create_future()

        def deliver(result: tuple[Any, str | None]) -> None:
            if not outcome.done():
                outcome.set_result(result)

        def job() -> None:
            try:
                result: tuple[Any, str | None] = (self.fn(*args), None)
            except BaseException as exc:  # SystemExit in a reward is still the reward's failure
                result = (None, _raised(exc))
            if inspect.isawaitable(result[0]):
                if inspect.iscoroutine(result[0]):
                    result[0].close()
                result = (None, "returned an awaitable; declare the reward with async def")
            with contextlib.suppress(RuntimeError):  # a closed loop: the caller gave up on it
                loop.call_soon_threadsafe(deliver, result)

        with self._lock:
            worker = self._idle.pop() if self._idle else _Worker(f"reward {self.name}")
        worker.inbox.put(job)
        try:
            done, _ = await asyncio.wait({outcome}, timeout=self.timeout_s)
        except BaseException:  # the caller was cancelled: let the worker end after its call
            worker.inbox.put(None)
            raise
        with self._lock:
            if done:
                self._idle.append(worker)
                return outcome.result()
            worker.inbox.put(None)  # it ends after this call, if that ever returns
            self._hung.append(worker.thread)
        return None, (
            f"did not return within timeout_s={self.timeout_s:g} s (its thread is left running)"
        )

    def close(self) -> None:
        """End the idle worker threads (a runner still scores after, with new ones)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.inbox.put(None)

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Worker:
    """A daemon thread running the jobs put in its inbox until it gets None: sync reward calls
    reuse these instead of starting a thread each."""

    def __init__(self, name: str) -> None:
        self.inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.inbox.get()) is not None:
            job()


# --------------------------------------------------------------------------------------------
# The built-in math reward
# --------------------------------------------------------------------------------------------
# a sign only when not glued to a word or number on its left ("10-3" is a subtraction);
# thousands commas ("1,234"), decimals ("3.5", ".5")
_NUMBER = re.compile(
    r"(?:(?<![\w.])[-+])?"  # the sign
    r"(?:(?:\d{1,3}(?:,\d{3})+(?!,?\d)|\d+)(?:\.\d+)?|\.\d+)"  # 1,234.5 | 12.5 | .5
)
_BOXED = "\\boxed{"
_BOXED_NOISE = re.compile(r"\\[,!;$%]|\\text\{\s*\}|[\s$%]")


def _number(text: str) -> Fraction:
    return Fraction(text.replace(",", ""))


def _numbers(text: str) -> list[str]:
    return [m.group() for m in _NUMBER.finditer(text.replace("\u2212", "-"))]


def _last_boxed(text: str) -> str | None:
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unclosed: no answer


def extract_answer(text: str, *, strict: bool = False) -> Fraction | None:
    """The final answer of a completion as an exact number, or None:

    1. after the last ``####``: the first number there (GSM8K's answer line);
    2. else the last ``\\boxed{...}``, which must hold one plain number (spaces, ``$``,
       ``%``, ``\\,`` allowed; ``\\frac`` and words are not);
    3. else, unless ``strict``, the last number in the text.

    Numbers may carry a sign, thousands commas (``1,234``) and decimals (``3.0`` == ``3``); a
    ``-`` glued to a word or number on its left (``10-3``) is an operator, not a sign."""
    marker = text.rfind("####")
    if marker >= 0:
        found = _numbers(text[marker + 4 :])
        return _number(found[0]) if found else None
    boxed = _last_boxed(text)
    if boxed is not None:
        inner = _BOXED_NOISE.sub("", boxed.replace("\u2212", "-")).rstrip(".")
        found = _numbers(inner)
        return _number(found[0]) if len(found) == 1 and found[0] == inner else None
    if strict:
        return None
    found = _numbers(text)
    return _number(found[-1]) if found else None


def reference_answer(value: object) -> Fraction:
    """A row's answer as an exact number: an int or float, a numeric string, or a GSM8K
    answer (``"...reasoning\\n#### 72"``); ``ConfigError`` otherwise."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return Fraction(repr(value)) if isinstance(value, float) else Fraction(value)
    if isinstance(value, str):
        marker = value.rfind("####")
        if marker >= 0:
            found = _numbers(value[marker + 4 :])
            if found:
                return _number(found[0])
        else:
            text = value.strip().replace("\u2212", "-")
            found = _numbers(text)
            if len(found) == 1 and found[0] == text:
                return _number(text)
    raise ConfigError(
        f"math reward: the row's answer {value!r:.80} is not a number; give a number or a "
        "GSM8K answer ending in '#### N'"
    )


def make_math_reward(
    *, answer_field: str = "answer", strict: bool = False
) -> Callable[[str, Mapping[str, Any]], float]:
    """A reward that is 1.0 when ``extract_answer(completion, strict=strict)`` equals the
    row's ``answer_field`` (``reference_answer``), else 0.0. For a dataset whose answer column
    has another name, put ``my_reward = make_math_reward(answer_field="solution")`` in a
    module and name it ``reward=my_module:my_reward``."""

    def reward(completion: str, row: Mapping[str, Any]) -> float:
        if answer_field not in row:
            raise ConfigError(
                f"math reward: the row has no field {answer_field!r} (fields: {sorted(row)}); "
                "use make_math_reward(answer_field=...) with the answer's column"
            )
        expected = reference_answer(row[answer_field])
        got = extract_answer(completion, strict=strict)
        return 1.0 if got is not None and got == expected else 0.0

    reward.__qualname__ = reward.__name__ = (
        f"math_reward[{answer_field}{', strict' if strict else ''}]"
    )
    return reward


_LENIENT = make_math_reward()
_STRICT = make_math_reward(strict=True)


def math_reward(completion: str, row: Mapping[str, Any]) -> float:
    """1.0 if the completion's final number (``####``, else ``\\boxed{}``, else the last
    number: ``extract_answer``) equals the row's ``answer`` (a number or GSM8K ``#### N``),
    else 0.0."""
    return _LENIENT(completion, row)


def math_reward_strict(completion: str, row: Mapping[str, Any]) -> float:
    """``math_reward`` that counts only an answer marked with ``####`` or ``\\boxed{}``."""
    return _STRICT(completion, row)
