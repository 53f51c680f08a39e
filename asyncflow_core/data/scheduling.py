"""Sampling policies (Schedulers) that choose which candidate rows a consumer gets, and a router."""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import ClassVar, Literal

import numpy as np

from asyncflow_core.contracts.errors import BadRequestError, EngineError, SamplerError
from asyncflow_core.contracts.protocols import (
    NO_VERSION,
    Candidates,
    IntArray,
    SampleRequest,
    Scheduler,
    Selection,
)

__all__ = [
    "GroupSampler",
    "RankAwareSampler",
    "RequestRouter",
    "SequentialSampler",
    "StalenessSampler",
    "TokenBalancedSampler",
    "karmarkar_karp",
]

_FEW_ROWS = 32
"""Up to this many candidates, ``GroupSampler`` selects in plain Python (``_select_few``)."""

_FRESH = np.iinfo(np.int64).max
"""Sort key of a row without a version: newer than any real version, never stale."""


def _check_batch_size(sampler: str, request: SampleRequest) -> None:
    if request.batch_size <= 0:
        raise BadRequestError(
            f"{sampler}: batch_size must be >= 1, got {request.batch_size} "
            f"(partition {request.partition!r}, task {request.task!r})"
        )


def _check_flag(sampler: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise BadRequestError(f"{sampler}: {name} must be True or False, got {value!r}")
    return value


def _rows(array: IntArray) -> tuple[int, ...]:
    """Plain-int tuple of a numpy int array (numpy ints would leak into the store's metadata)."""
    values: list[int] = array.tolist()  # int64 -> Python ints
    return tuple(values)


# --------------------------------------------------------------------------------------------
# Sequential
# --------------------------------------------------------------------------------------------
class SequentialSampler:
    """First come, first served: the first ``batch_size`` candidates in the order given.

    The store passes candidates in ascending row order, so this is "lowest rows first"; when
    another sampler passes a reordered subset (e.g. ``StalenessSampler``, oldest first), that
    order is kept, never re-sorted. With fewer than ``batch_size`` candidates it returns no
    rows ("wait for more"), unless ``request.final`` is set: then it returns all of them (a
    short final batch). It never drops or holds anything.

    ``greedy=True``: never wait for a full batch; take the candidates there are (at least one,
    at most ``batch_size``). A consumer that keeps up then gets small batches at no added
    latency, and one that falls behind gets bigger ones, so its per-call overhead (store round
    trips, a thread hand-off) is paid per batch rather than per row.
    """

    stateless: ClassVar[bool] = True
    """``select`` keeps no state: a store may run a copy of this sampler in another process
    (``asyncflow_ray``'s controller does, in one round trip)."""
    repeatable: ClassVar[bool] = True
    """``select`` depends on its arguments only (``is_repeatable``)."""
    reads_first: ClassVar[bool] = True
    """``select`` reads only the first ``batch_size`` candidates (``reads_first``)."""

    def __init__(self, *, greedy: bool = False) -> None:
        self.greedy = _check_flag("SequentialSampler", "greedy", greedy)

    def select(self, candidates: Candidates, request: SampleRequest) -> Selection:
        _check_batch_size("SequentialSampler", request)
        if len(candidates) < request.batch_size and not (request.final or self.greedy):
            return Selection()
        return Selection(rows=_rows(candidates.rows[: request.batch_size]))

    def cannot_fill(self, view: FillView, request: SampleRequest) -> bool:
        """Whether ``select`` gives an empty ``Selection()`` (and raises nothing) for these
        candidates in any order: too few for a full batch, not greedy, not final."""
        return request.batch_size > view.count and not (request.final or self.greedy)

    def __repr__(self) -> str:
        return "SequentialSampler(greedy=True)" if self.greedy else "SequentialSampler()"


# --------------------------------------------------------------------------------------------
# GRPO groups
# --------------------------------------------------------------------------------------------
class GroupSampler:
    """GRPO group-complete sampling: hands out only whole groups of ``n`` rows, never a part.

    Every candidate must carry a group tag (``Candidates.groups >= 0``); an untagged row raises
    ``BadRequestError`` naming it. A group is *complete* once ``n`` of its rows are candidates;
    a group with more than ``n`` candidate rows (a producer that wrote more than ``n`` rows into
    one group) is handed out in chunks of exactly ``n`` rows, in the order given. ``batch_size``
    must be at least ``n`` (else ``BadRequestError``) and should be a multiple of it: a batch
    holds ``batch_size // n`` chunks, so any remainder of ``batch_size`` stays unused.

    Chunks are taken group by group in order of each group's first candidate (the group's
    smallest row, as the store passes candidates in ascending order), and the rows of a batch
    come out group by group. Until a full batch of ``batch_size // n`` chunks is complete it
    returns no rows ("wait for more").

    When ``request.final`` is set it returns the complete chunks there are (a short batch,
    possibly empty) and drops rows that can never be part of a full chunk, so the stream can
    end: a group of ``g = group_sizes`` live rows yields at most ``g // n`` chunks, so
    ``g % n`` of its rows can never be delivered (all of them when ``g < n``, e.g. because the
    producer wrote fewer rows). Of each group's leftover candidates (those not in a full chunk)
    up to ``g % n``, the last ones in the order given, go to ``Selection.dropped`` (the store
    marks them consumed and counts them as dropped). Leftovers of a group whose size is a
    multiple of ``n`` are kept: their missing rows are leased elsewhere and may come back.

    ``greedy=True``: never wait for a full batch; hand out the complete chunks there are (at
    least one, at most ``batch_size // n``), as ``SequentialSampler(greedy=True)`` does rows.
    """

    stateless: ClassVar[bool] = True
    """``select`` keeps no state: a store may run a copy of this sampler in another process
    (``asyncflow_ray``'s controller does, in one round trip)."""
    repeatable: ClassVar[bool] = True
    """``select`` depends on its arguments only (``is_repeatable``)."""

    def __init__(self, n: int, *, greedy: bool = False) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise BadRequestError(f"GroupSampler: group size n must be an int >= 1, got {n!r}")
        self.n = n
        self.greedy = _check_flag("GroupSampler", "greedy", greedy)

    def __repr__(self) -> str:
        return f"GroupSampler(n={self.n}{', greedy=True' if self.greedy else ''})"

    def cannot_fill(self, view: FillView, request: SampleRequest) -> bool:
        """Whether ``select`` gives an empty ``Selection()`` for these candidates in any order,
        if every one is tagged with a group (``select`` raises on an untagged one): fewer rows
        than ``batch_size // n`` whole chunks need, not greedy, not final."""
        n = self.n
        return (
            not (request.final or self.greedy)
            and request.batch_size >= n
            and view.count < (request.batch_size // n) * n
            and view.all_tagged()
        )

    def select(self, candidates: Candidates, request: SampleRequest) -> Selection:
        _check_batch_size("GroupSampler", request)
        n = self.n
        if request.batch_size < n:
            raise BadRequestError(
                f"GroupSampler(n={n}): batch_size {request.batch_size} is smaller than one "
                f"group of {n} rows; ask for a multiple of {n}"
            )
        m = len(candidates)
        if m == 0:
            return Selection()
        if m <= _FEW_ROWS:
            few = self._select_few(candidates, request)
            if few is not None:
                return few
        codes = candidates.groups
        untagged = np.flatnonzero(codes < 0)
        if not untagged.size and self.cannot_fill(FillView.of(candidates), request):
            return Selection()  # fewer rows than a full batch of chunks: nothing to count
        if untagged.size:
            raise BadRequestError(
                f"GroupSampler: row {int(candidates.rows[untagged[0]])} of partition "
                f"{request.partition!r} has no group tag ({untagged.size} untagged rows in "
                f"all); GRPO rows must be put with Tags(group=...)"
            )
        # Per distinct group (in np.unique's sorted-code order): first position, members, count.
        _, first, inverse, counts = np.unique(
            codes, return_index=True, return_inverse=True, return_counts=True
        )
        inverse = inverse.reshape(-1)
        n_groups = counts.shape[0]
        # Position of each candidate inside its group, in the order given.
        members = np.argsort(inverse, kind="stable")
        starts = np.cumsum(counts) - counts
        within = np.empty(m, dtype=np.int64)
        within[members] = np.arange(m, dtype=np.int64) - np.repeat(starts, counts)

        chunks = counts // n
        appearance = np.argsort(first, kind="stable")  # groups by first appearance
        chunks_app = chunks[appearance]
        before = np.cumsum(chunks_app) - chunks_app
        max_chunks = request.batch_size // n
        have = int(chunks_app.sum())
        if not request.final and (have == 0 if self.greedy else have < max_chunks):
            return Selection()
        taken = np.empty(n_groups, dtype=np.int64)
        taken[appearance] = np.clip(max_chunks - before, 0, chunks_app)

        chosen = np.flatnonzero(within < (taken * n)[inverse])
        rank = np.empty(n_groups, dtype=np.int64)
        rank[appearance] = np.arange(n_groups, dtype=np.int64)
        order = np.lexsort((within[chosen], rank[inverse[chosen]]))
        rows = _rows(candidates.rows[chosen[order]])

        dropped: tuple[int, ...] = ()
        if request.final:
            sizes = candidates.group_sizes[first]
            never = np.where(sizes >= 0, sizes % n, 0)
            drop_k = np.minimum(counts - chunks * n, never)
            gone = np.flatnonzero(within >= (counts - drop_k)[inverse])
            dropped = _rows(candidates.rows[gone])
        return Selection(rows=rows, dropped=dropped)

    def _select_few(self, candidates: Candidates, request: SampleRequest) -> Selection | None:
        """``select`` for a few candidates, in plain Python (the same answer: numpy's per-call
        set-up costs more than the work here; reward and advantage ask with a group or two
        thousands of times). None when a row is untagged: ``select`` raises, naming it."""
        codes: list[int] = candidates.groups.tolist()
        positions: dict[int, list[int]] = {}  # per group in order of first appearance
        for i, code in enumerate(codes):
            if code < 0:
                return None
            positions.setdefault(code, []).append(i)
        n = self.n
        max_chunks = request.batch_size // n
        have = sum(len(p) // n for p in positions.values())
        if not request.final and (have == 0 if self.greedy else have < max_chunks):
            return Selection()
        rows: list[int] = candidates.rows.tolist()
        chosen: list[int] = []
        left = max_chunks
        for p in positions.values():
            if left <= 0:
                break
            take = min(len(p) // n, left)
            chosen += [rows[i] for i in p[: take * n]]
            left -= take
        if not request.final:
            return Selection(rows=tuple(chosen))
        # rows that can never be part of a full chunk (see the class docstring)
        sizes: list[int] = candidates.group_sizes.tolist()
        gone: list[int] = []
        for p in positions.values():
            size = sizes[p[0]]
            never = size % n if size >= 0 else 0
            drop_k = min(len(p) % n, never)
            if drop_k:
                gone += p[len(p) - drop_k :]
        gone.sort()
        return Selection(rows=tuple(chosen), dropped=tuple(rows[i] for i in gone))


# --------------------------------------------------------------------------------------------
# Token balancing (Karmarkar-Karp)
# --------------------------------------------------------------------------------------------
def karmarkar_karp(weights: Sequence[int], k: int, equal_size: bool = True) -> list[list[int]]:
    """Split ``weights`` into ``k`` parts with near-equal sums (largest differencing method).

    Returns ``k`` lists of indices into ``weights`` (each ascending; together every index once;
    parts ordered by their smallest index, empty parts last). Karmarkar-Karp for k-way
    partitioning keeps a heap of partial solutions, each a k-tuple of subsets, keyed by spread
    (largest minus smallest subset sum), and repeatedly merges the two with the largest spread,
    joining the heaviest subset of one with the lightest of the other. It is a heuristic: not
    always optimal, and its spread never exceeds the largest weight.

    ``equal_size=True`` (the variant used for data-parallel balancing): weights are sorted and
    cut into runs of ``k``, each run starting as one solution with one item per subset, so every
    part gets ``len(weights) // k`` or one more items (exactly equal when ``k`` divides the
    count). ``equal_size=False``: each item starts alone; part sizes are unconstrained.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise BadRequestError(f"karmarkar_karp: k must be an int >= 1, got {k!r}")
    w = [int(x) for x in weights]
    negative = [i for i, x in enumerate(w) if x < 0]
    if negative:
        raise BadRequestError(
            f"karmarkar_karp: weights must be >= 0; weight[{negative[0]}] = {w[negative[0]]}"
        )
    n = len(w)
    # A solution: k (sum, indices) subsets sorted by sum, heaviest first.
    Subset = tuple[int, list[int]]
    heap: list[tuple[int, int, list[Subset]]] = []
    counter = itertools.count()

    def push(subsets: list[Subset]) -> None:
        subsets.sort(key=lambda s: s[0], reverse=True)
        heapq.heappush(heap, (subsets[-1][0] - subsets[0][0], next(counter), subsets))

    order = sorted(range(n), key=lambda i: w[i], reverse=True)
    if equal_size:
        for start in range(0, n, k):
            run = order[start : start + k]
            push([(w[i], [i]) for i in run] + [(0, []) for _ in range(k - len(run))])
    else:
        for i in order:
            push([(w[i], [i])] + [(0, []) for _ in range(k - 1)])
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # a and b are heaviest first: join a's heaviest with b's lightest, and so on.
        push([(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b), strict=True)])
    parts = [sorted(indices) for _, indices in heap[0][2]]
    parts.sort(key=lambda p: p[0] if p else n)
    return parts


class TokenBalancedSampler:
    """Chooses rows with ``inner`` (default ``SequentialSampler``), then splits them into
    ``parts`` micro-batches (default ``request.dp_size``, one per data-parallel rank) whose token
    sums (``Candidates.tokens``) are balanced by ``karmarkar_karp(equal_size=True)``: every part
    gets the same number of rows when ``parts`` divides the batch, else sizes differ by at most
    one (with fewer rows than parts, some parts are empty: there are always exactly ``parts``).
    Rows inside a part keep the order ``inner`` returned them in, and parts are ordered by where
    their first row stands in that order.
    ``Selection.rows``, ``dropped`` and ``held`` are ``inner``'s; its ``micro_batches`` are
    replaced. Only the chosen batch is partitioned, so the cost is independent of the number of
    candidates.
    """

    stateless: ClassVar[bool] = True
    """``select`` keeps no state: a store may run a copy of this sampler in another process
    (``asyncflow_ray``'s controller does, in one round trip)."""

    def __init__(self, inner: Scheduler | None = None, parts: int | None = None) -> None:
        if parts is not None and (
            isinstance(parts, bool) or not isinstance(parts, int) or parts < 1
        ):
            raise BadRequestError(f"TokenBalancedSampler: parts must be an int >= 1, got {parts!r}")
        self.inner: Scheduler = inner if inner is not None else SequentialSampler()
        self.parts = parts

    def __repr__(self) -> str:
        return f"TokenBalancedSampler(inner={self.inner!r}, parts={self.parts!r})"

    def select(self, candidates: Candidates, request: SampleRequest) -> Selection:
        k = self.parts if self.parts is not None else request.dp_size
        if k < 1:
            raise BadRequestError(f"TokenBalancedSampler: dp_size must be >= 1, got {k}")
        chosen = self.inner.select(candidates, request)
        if not chosen.rows:
            return chosen
        sorter = np.argsort(candidates.rows, kind="stable")
        wanted = np.asarray(chosen.rows, dtype=np.int64)
        at = np.searchsorted(candidates.rows, wanted, sorter=sorter)
        positions = sorter[np.minimum(at, len(sorter) - 1)]
        if not np.array_equal(candidates.rows[positions], wanted):
            bad = wanted[candidates.rows[positions] != wanted]
            raise SamplerError(
                f"TokenBalancedSampler: inner sampler {self.inner!r} chose row {int(bad[0])}, "
                f"which is not a candidate"
            )
        tokens = candidates.tokens[positions].tolist()
        split = karmarkar_karp(tokens, k, equal_size=True)
        micro = tuple(tuple(chosen.rows[i] for i in part) for part in split)
        return Selection(
            rows=chosen.rows, dropped=chosen.dropped, micro_batches=micro, held=chosen.held
        )


# --------------------------------------------------------------------------------------------
# Rank replay
# --------------------------------------------------------------------------------------------
class RankAwareSampler:
    """Marks a sampler's batches for replay to the ``members_per_rank`` peers of one DP rank
    (tensor/pipeline-parallel ranks that must see identical rows); satisfies
    ``SupportsRankReplay``.

    ``select`` only delegates to ``inner`` (default ``SequentialSampler``); this class does no
    replay itself. The *store* does: it calls ``select`` once, for the first peer of a DP rank
    that asks, and hands that same batch, under the same lease, to the other
    ``members_per_rank - 1`` peers (``SampleRequest.member``). A ``member`` outside
    ``[0, members_per_rank)`` raises ``BadRequestError``.
    """

    def __init__(self, inner: Scheduler | None = None, members_per_rank: int = 1) -> None:
        if (
            isinstance(members_per_rank, bool)
            or not isinstance(members_per_rank, int)
            or members_per_rank < 1
        ):
            raise BadRequestError(
                f"RankAwareSampler: members_per_rank must be an int >= 1, got {members_per_rank!r}"
            )
        self.inner: Scheduler = inner if inner is not None else SequentialSampler()
        self.members_per_rank = members_per_rank

    def __repr__(self) -> str:
        return f"RankAwareSampler(inner={self.inner!r}, members_per_rank={self.members_per_rank})"

    def select(self, candidates: Candidates, request: SampleRequest) -> Selection:
        if not 0 <= request.member < self.members_per_rank:
            raise BadRequestError(
                f"RankAwareSampler: member {request.member} is outside "
                f"[0, {self.members_per_rank}) (members_per_rank={self.members_per_rank})"
            )
        return self.inner.select(candidates, request)


# --------------------------------------------------------------------------------------------
# Staleness
# --------------------------------------------------------------------------------------------
class FillView:
    """What a ``cannot_fill`` promise may read about a set of candidates: their ``count``, and
    (computed only when asked, so a store can answer a waiting consumer without building its
    ``Candidates``) whether every one has a group tag and the oldest versioned
    ``min_version``."""

    __slots__ = ("_groups", "_mins", "count")

    def __init__(
        self, count: int, groups: Callable[[], IntArray], min_versions: Callable[[], IntArray]
    ) -> None:
        self.count = count
        self._groups = groups
        self._mins = min_versions

    @classmethod
    def of(cls, candidates: Candidates) -> FillView:
        return cls(len(candidates), lambda: candidates.groups, lambda: candidates.min_versions)

    def all_tagged(self) -> bool:
        return not self.count or bool((self._groups() >= 0).all())

    def version_floor(self) -> int | None:
        """A lower bound of every versioned candidate's ``min_version`` (None: no candidate
        has one); here the oldest, a store may answer with a cheaper bound."""
        return self.oldest_version()

    def oldest_version(self) -> int | None:
        """The oldest ``min_version`` among the versioned candidates; None if none has one."""
        if not self.count:
            return None
        mins = self._mins()
        versioned = mins[mins > NO_VERSION]
        return int(versioned.min()) if versioned.size else None


CannotFill = Callable[[FillView, SampleRequest], bool]


def is_repeatable(sampler: object) -> bool:
    """Whether ``sampler`` promises (``repeatable`` is True, declared by the class that
    defines its ``select``) that ``select`` depends only on its arguments and has no effect
    when it selects and drops nothing. A store may then skip asking it again while nothing
    the answer depends on changed, after an answer of nothing (the controller does)."""
    return _promised(sampler, "repeatable")


def reads_first(sampler: object) -> bool:
    """Whether ``sampler`` promises (``reads_first`` is True, declared by the class that
    defines its ``select``) that ``select`` answers the same for the first ``batch_size``
    candidates as for all of them, in the order given. A store may then pass only those
    (the controller does: a lease then costs O(batch_size), not O(candidates))."""
    return _promised(sampler, "reads_first")


_PROMISE_OWNERS: dict[tuple[type, str], bool] = {}


def _promised(sampler: object, flag: str) -> bool:
    """``sampler.<flag>`` is True and declared by the class that defines its ``select`` (a
    subclass that overrides ``select`` alone does not inherit a promise made for another)."""
    cls = type(sampler)
    known = _PROMISE_OWNERS.get((cls, flag))
    if known is None:
        sel = next((k for k in cls.__mro__ if "select" in k.__dict__), None)
        owner = next((k for k in cls.__mro__ if flag in k.__dict__), None)
        known = _PROMISE_OWNERS[(cls, flag)] = sel is not None and sel is owner
    return known and getattr(sampler, flag, False) is True


def cannot_fill_of(sampler: object) -> CannotFill | None:
    """``sampler.cannot_fill(view, request)`` (a sampler's promise that ``select`` answers
    ``Selection()``, raising nothing and changing no state, for any candidates that ``view``
    describes, in any order), if the class that defines its ``select`` also defines it: a
    subclass that overrides ``select`` alone does not inherit a promise made for another
    ``select``. A store may then skip building the candidates and asking (the controller
    does, for a consumer waiting on a batch it cannot fill yet)."""
    cls = type(sampler)
    owner = _CANNOT_FILL_OWNERS.get(cls)
    if owner is None:
        sel = next((k for k in cls.__mro__ if "select" in k.__dict__), None)
        fill = next((k for k in cls.__mro__ if "cannot_fill" in k.__dict__), None)
        owner = _CANNOT_FILL_OWNERS[cls] = (sel is not None and sel is fill,)
    if not owner[0]:
        return None
    fn: CannotFill = sampler.cannot_fill  # type: ignore[attr-defined]
    return fn


_CANNOT_FILL_OWNERS: dict[type, tuple[bool]] = {}


class StalenessSampler:
    """Bounded-staleness sampling: oldest rows first, too-old rows held back or dropped.

    A row's age is ``request.current_version - min_version``; it is *stale* when the age exceeds
    ``max_lag``. Rows with no version (``min_version == -1``) are fresh: never stale, and sorted
    after every versioned row. With ``current_version=None`` nothing is stale. Stale rows are
    excluded: ``policy="hold"`` leaves them in the store (for a later, laxer request) and counts
    them in ``Selection.held``; ``policy="drop"`` returns them in ``Selection.dropped`` (the
    store marks them consumed). The other candidates are passed to ``inner`` (default
    ``SequentialSampler``) as a ``Candidates.take`` subset sorted oldest first (by
    ``min_version``, then row); the result is ``inner``'s rows and micro-batches, with the
    dropped rows and held counts of both added up.

    ``whole_groups=True`` (for GRPO, with a ``GroupSampler`` inner) judges and orders a row by
    the oldest ``min_version`` among its group's candidates, so the candidate rows of a group
    are held or dropped together, never some of them (which would leave the rest unable to ever
    form a complete group); untagged rows (group -1) are judged alone.
    """

    def __init__(
        self,
        max_lag: int,
        policy: Literal["hold", "drop"] = "hold",
        inner: Scheduler | None = None,
        *,
        whole_groups: bool = False,
    ) -> None:
        if isinstance(max_lag, bool) or not isinstance(max_lag, int) or max_lag < 0:
            raise BadRequestError(f"StalenessSampler: max_lag must be an int >= 0, got {max_lag!r}")
        if policy not in ("hold", "drop"):
            raise BadRequestError(
                f"StalenessSampler: policy must be 'hold' or 'drop', got {policy!r}"
            )
        self.max_lag = max_lag
        self.policy: Literal["hold", "drop"] = policy
        self.inner: Scheduler = inner if inner is not None else SequentialSampler()
        self.whole_groups = whole_groups

    @property
    def repeatable(self) -> bool:
        """``select`` depends on its arguments only if ``inner``'s does."""
        return is_repeatable(self.inner)

    def __repr__(self) -> str:
        return (
            f"StalenessSampler(max_lag={self.max_lag}, policy={self.policy!r}, "
            f"inner={self.inner!r}, whole_groups={self.whole_groups})"
        )

    def cannot_fill(self, view: FillView, request: SampleRequest) -> bool:
        """No candidate is stale (even the oldest version is within ``max_lag``; a group's age
        key is its oldest member's version, never older than the oldest of all), so nothing
        is held or dropped, and ``inner`` promises it cannot fill a batch from these rows."""
        inner = cannot_fill_of(self.inner)
        if inner is None or not inner(view, request):
            return False
        now = request.current_version
        if now is not None:
            floor = view.version_floor()
            if floor is not None and now - floor > self.max_lag:  # may be stale: look closer
                oldest = view.oldest_version()
                if oldest is not None and now - oldest > self.max_lag:
                    return False
        return True

    def _age_keys(self, candidates: Candidates) -> IntArray:
        mins = candidates.min_versions
        key: IntArray = np.where(mins <= NO_VERSION, _FRESH, mins).astype(np.int64, copy=False)
        if self.whole_groups:
            tagged = np.flatnonzero(candidates.groups >= 0)
            if tagged.size:
                _, inverse = np.unique(candidates.groups[tagged], return_inverse=True)
                inverse = inverse.reshape(-1)
                oldest = np.full(int(inverse.max()) + 1, _FRESH, dtype=np.int64)
                np.minimum.at(oldest, inverse, key[tagged])
                key[tagged] = oldest[inverse]
        return key

    def select(self, candidates: Candidates, request: SampleRequest) -> Selection:
        _check_batch_size("StalenessSampler", request)
        if len(candidates) == 0:
            return self.inner.select(candidates, request)
        if self.cannot_fill(FillView.of(candidates), request):
            return Selection()  # nothing to hold or drop, and inner waits: skip the sort
        key = self._age_keys(candidates)
        if request.current_version is None:
            stale = np.zeros(key.shape[0], dtype=bool)
        else:
            stale = (key != _FRESH) & (request.current_version - key > self.max_lag)
        n_stale = int(stale.sum())
        keep = np.flatnonzero(~stale)
        kept_keys = key[keep]
        kept_rows = candidates.rows[keep]
        in_order = bool(np.all(kept_keys[1:] >= kept_keys[:-1])) and bool(
            np.all(kept_rows[1:] > kept_rows[:-1])
        )
        if not in_order:
            keep = keep[np.lexsort((kept_rows, kept_keys))]
        subset = candidates if n_stale == 0 and in_order else candidates.take(keep)
        inner = self.inner.select(subset, request)
        if self.policy == "drop":
            dropped = _rows(candidates.rows[stale])
            return Selection(
                rows=inner.rows,
                dropped=dropped + inner.dropped,
                micro_batches=inner.micro_batches,
                held=inner.held,
            )
        return Selection(
            rows=inner.rows,
            dropped=inner.dropped,
            micro_batches=inner.micro_batches,
            held=n_stale + inner.held,
        )


# --------------------------------------------------------------------------------------------
# Request routing across inference instances
# --------------------------------------------------------------------------------------------
class RequestRouter:
    """Routes generation requests to inference instances; thread-safe (one lock).

    ``policy="least_tokens"``: the instance with the fewest outstanding tokens (tokens of
    requests routed to it and not yet ``finish``-ed); ties go to the lowest index in the current
    instance list. ``policy="round_robin"``: instances in turn, in list order.

    ``sticky_groups=True``: a request with a ``group`` goes to the instance its group was last
    routed to, if that instance is still present, so the group's shared prompt hits that
    instance's prefix cache; otherwise the policy picks and the group is remembered there. The
    group memory is a bounded LRU of ``max_sticky_groups`` entries (default 100,000): the least
    recently routed group is forgotten first. It is not cleared when a group's requests finish,
    since a later request of the group (a retry, a resumed partial rollout) still benefits.

    ``remove_instance`` takes an instance out of routing at once; its outstanding requests may
    still be ``finish``-ed (a no-op for the load count). ``add_instance`` appends a new instance
    with zero load. ``route`` with no instance raises ``EngineError``; a duplicate or unknown
    request id, a duplicate or unknown instance, or negative tokens raise ``BadRequestError``.
    """

    def __init__(
        self,
        instances: Sequence[str],
        policy: Literal["least_tokens", "round_robin"] = "least_tokens",
        sticky_groups: bool = True,
        *,
        max_sticky_groups: int = 100_000,
    ) -> None:
        if policy not in ("least_tokens", "round_robin"):
            raise BadRequestError(
                f"RequestRouter: policy must be 'least_tokens' or 'round_robin', got {policy!r}"
            )
        if max_sticky_groups < 1:
            raise BadRequestError(
                f"RequestRouter: max_sticky_groups must be >= 1, got {max_sticky_groups}"
            )
        if isinstance(instances, str):
            raise BadRequestError(
                f"RequestRouter: instances must be a sequence of names, got the string "
                f"{instances!r}"
            )
        self.policy: Literal["least_tokens", "round_robin"] = policy
        self.sticky_groups = sticky_groups
        self.max_sticky_groups = max_sticky_groups
        self._lock = threading.Lock()
        self._names: list[str] = []
        self._load: dict[str, int] = {}
        self._epoch: dict[str, int] = {}  # bumped on every add, so stale finishes are ignored
        self._epochs = itertools.count()
        self._requests: dict[str, tuple[str, int, int]] = {}  # id -> (instance, epoch, tokens)
        self._sticky: OrderedDict[int | str, str] = OrderedDict()
        self._next = 0
        for name in instances:
            self._add(name)

    @property
    def instances(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._names)

    def _add(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise BadRequestError(f"RequestRouter: instance name must be a non-empty str: {name!r}")
        if name in self._load:
            raise BadRequestError(f"RequestRouter: instance {name!r} is already present")
        self._names.append(name)
        self._load[name] = 0
        self._epoch[name] = next(self._epochs)

    def add_instance(self, name: str) -> None:
        with self._lock:
            self._add(name)

    def remove_instance(self, name: str) -> None:
        with self._lock:
            if name not in self._load:
                raise BadRequestError(
                    f"RequestRouter: unknown instance {name!r}; present: {self._names}"
                )
            self._names.remove(name)
            del self._load[name]
            del self._epoch[name]

    def outstanding(self, instance: str) -> int:
        with self._lock:
            if instance not in self._load:
                raise BadRequestError(
                    f"RequestRouter: unknown instance {instance!r}; present: {self._names}"
                )
            return self._load[instance]

    def _pick(self) -> str:
        if self.policy == "round_robin":
            name = self._names[self._next % len(self._names)]
            self._next = (self._next + 1) % len(self._names)
            return name
        return min(self._names, key=self._load.__getitem__)  # min keeps the first of ties

    def route(self, request_id: str, tokens: int, group: int | str | None = None) -> str:
        if tokens < 0:
            raise BadRequestError(
                f"RequestRouter: tokens must be >= 0, got {tokens} for request {request_id!r}"
            )
        with self._lock:
            if request_id in self._requests:
                raise BadRequestError(
                    f"RequestRouter: request {request_id!r} is already routed and not finished"
                )
            if not self._names:
                raise EngineError(
                    f"RequestRouter: no inference instance to route request {request_id!r} to"
                )
            sticky = self.sticky_groups and group is not None
            name = self._sticky.get(group) if sticky and group is not None else None
            if name is None or name not in self._load:
                name = self._pick()
            if sticky and group is not None:
                self._sticky[group] = name
                self._sticky.move_to_end(group)
                if len(self._sticky) > self.max_sticky_groups:
                    self._sticky.popitem(last=False)
            self._load[name] += tokens
            self._requests[request_id] = (name, self._epoch[name], tokens)
            return name

    def finish(self, request_id: str) -> None:
        with self._lock:
            entry = self._requests.pop(request_id, None)
            if entry is None:
                raise BadRequestError(
                    f"RequestRouter: unknown request id {request_id!r} (never routed, or "
                    f"already finished)"
                )
            name, epoch, tokens = entry
            if self._epoch.get(name) == epoch:
                self._load[name] -= tokens

    def __repr__(self) -> str:
        return (
            f"RequestRouter(instances={self.instances!r}, policy={self.policy!r}, "
            f"sticky_groups={self.sticky_groups})"
        )
