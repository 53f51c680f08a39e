"""Tests of asyncflow_core.data.scheduling: samplers, Karmarkar-Karp and the request router."""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow_core.contracts.errors import BadRequestError, EngineError, SamplerError
from asyncflow_core.contracts.protocols import (
    Candidates,
    SampleRequest,
    Scheduler,
    Selection,
    SupportsRankReplay,
)
from asyncflow_core.data import scheduling
from asyncflow_core.data.scheduling import (
    GroupSampler,
    RankAwareSampler,
    RequestRouter,
    SequentialSampler,
    StalenessSampler,
    TokenBalancedSampler,
    karmarkar_karp,
)

fast = settings(max_examples=60, deadline=None)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def _a(values: Sequence[int]) -> np.ndarray:
    return np.asarray(list(values), dtype=np.int64).reshape(-1)


def cands(
    rows: Sequence[int],
    *,
    groups: Sequence[int] | None = None,
    sizes: Sequence[int] | None = None,
    mins: Sequence[int] | None = None,
    tokens: Sequence[int] | None = None,
) -> Candidates:
    """Candidates with defaults: untagged, unversioned, 0 tokens. ``sizes`` defaults to the
    number of candidates of each group."""
    m = len(rows)
    groups = list(groups) if groups is not None else [-1] * m
    if sizes is None:
        count = Counter(groups)
        sizes = [-1 if g < 0 else count[g] for g in groups]
    mins = list(mins) if mins is not None else [-1] * m
    maxs = [-1 if v < 0 else v + 1 for v in mins]
    tokens = list(tokens) if tokens is not None else [0] * m
    return Candidates(_a(rows), _a(groups), _a(sizes), _a(mins), _a(maxs), _a(tokens))


def req(batch_size: int, **kw: object) -> SampleRequest:
    return SampleRequest("p", "t", batch_size, **kw)  # type: ignore[arg-type]


def spread(weights: Sequence[int], parts: Sequence[Sequence[int]]) -> int:
    sums = [sum(weights[i] for i in p) for p in parts]
    return max(sums) - min(sums)


def greedy(weights: Sequence[int], k: int, equal_size: bool) -> list[list[int]]:
    """Baseline: largest first onto the lightest part (with room, when ``equal_size``)."""
    cap = -(-len(weights) // k)
    parts: list[list[int]] = [[] for _ in range(k)]
    sums = [0] * k
    for i in sorted(range(len(weights)), key=lambda i: -weights[i]):
        room = [j for j in range(k) if not equal_size or len(parts[j]) < cap]
        j = min(room, key=lambda j: (sums[j], j))
        parts[j].append(i)
        sums[j] += weights[i]
    return parts


def optimum(weights: Sequence[int], k: int, equal_size: bool) -> int:
    """Exhaustive: the smallest spread over all assignments (balanced sizes if asked)."""
    n = len(weights)
    best: int | None = None
    for assign in itertools.product(range(k), repeat=n):
        if equal_size:
            sizes = Counter(assign)
            if max(sizes.get(j, 0) for j in range(k)) - min(sizes.get(j, 0) for j in range(k)) > 1:
                continue
        sums = [0] * k
        for i, j in enumerate(assign):
            sums[j] += weights[i]
        d = max(sums) - min(sums)
        best = d if best is None else min(best, d)
    assert best is not None
    return best


@st.composite
def grouped_candidates(draw: st.DrawFn, n: int) -> Candidates:
    """Tagged candidates with complete, partial and oversized groups; ``group_sizes`` may exceed
    the number of candidates of a group (rows leased, consumed or not ready)."""
    n_groups = draw(st.integers(0, 8))
    codes: list[int] = []
    sizes: dict[int, int] = {}
    for g in range(n_groups):
        present = draw(st.integers(1, 2 * n + 1))
        sizes[g] = present + draw(st.sampled_from([0, 0, 1, n]))
        codes += [g] * present
    codes = draw(st.permutations(codes))
    rows = list(range(0, 2 * len(codes), 2))
    return cands(rows, groups=codes, sizes=[sizes[g] for g in codes])


def group_model(c: Candidates, request: SampleRequest, n: int, greedy: bool = False) -> Selection:
    """A slow, obviously-correct statement of GroupSampler's documented policy."""
    order: list[int] = []
    members: dict[int, list[int]] = {}
    size: dict[int, int] = {}
    for row, g, s in zip(c.rows.tolist(), c.groups.tolist(), c.group_sizes.tolist(), strict=True):
        if g not in members:
            order.append(g)
            members[g] = []
            size[g] = s
        members[g].append(row)
    room = request.batch_size // n
    rows: list[int] = []
    available = sum(len(members[g]) // n for g in order)
    if not request.final and (available == 0 if greedy else available < room):
        return Selection()
    for g in order:
        take = min(len(members[g]) // n, room)
        rows += members[g][: take * n]
        room -= take
    dropped: list[int] = []
    if request.final:
        for g in order:
            leftover = members[g][len(members[g]) // n * n :]
            k = min(len(leftover), size[g] % n)
            dropped += leftover[len(leftover) - k :]
    return Selection(rows=tuple(rows), dropped=tuple(sorted(dropped, key=c.rows.tolist().index)))


# --------------------------------------------------------------------------------------------
# SequentialSampler
# --------------------------------------------------------------------------------------------
def test_sequential_takes_first_rows() -> None:
    c = cands([3, 5, 8, 9, 12])
    assert SequentialSampler().select(c, req(3)) == Selection(rows=(3, 5, 8))
    assert SequentialSampler().select(c, req(5)) == Selection(rows=(3, 5, 8, 9, 12))


def test_sequential_waits_for_a_full_batch_unless_final() -> None:
    c = cands([3, 5])
    assert SequentialSampler().select(c, req(3)) == Selection()
    assert SequentialSampler().select(c, req(3, final=True)) == Selection(rows=(3, 5))
    assert SequentialSampler().select(Candidates.empty(), req(3, final=True)) == Selection()


def test_sequential_keeps_the_order_given() -> None:
    c = cands([1, 2, 3, 4]).take(_a([3, 1, 2, 0]))
    assert SequentialSampler().select(c, req(2)).rows == (4, 2)


def test_sequential_returns_plain_ints() -> None:
    rows = SequentialSampler().select(cands([7, 9]), req(2)).rows
    assert [type(r) for r in rows] == [int, int]


@pytest.mark.parametrize("batch_size", [0, -3])
def test_sequential_rejects_bad_batch_size(batch_size: int) -> None:
    with pytest.raises(BadRequestError, match=f"batch_size must be >= 1, got {batch_size}"):
        SequentialSampler().select(cands([1]), req(batch_size))


@fast
@given(m=st.integers(0, 30), bs=st.integers(1, 40), final=st.booleans())
def test_sequential_law(m: int, bs: int, final: bool) -> None:
    rows = list(range(10, 10 + 3 * m, 3))
    sel = SequentialSampler().select(cands(rows), req(bs, final=final))
    expected = tuple(rows[:bs]) if (m >= bs or final) else ()
    assert sel == Selection(rows=expected)


# --------------------------------------------------------------------------------------------
# GroupSampler
# --------------------------------------------------------------------------------------------
def test_group_sampler_hands_out_complete_groups_in_order_of_smallest_row() -> None:
    # group 7 is complete (rows 1,4), group 3 complete (rows 2,3), group 5 incomplete.
    c = cands([0, 1, 2, 3, 4, 5], groups=[5, 7, 3, 3, 7, 9], sizes=[2, 2, 2, 2, 2, 2])
    sel = GroupSampler(2).select(c, req(4))
    assert sel == Selection(rows=(1, 4, 2, 3))


def test_group_sampler_waits_then_gives_a_short_final_batch() -> None:
    c = cands([0, 1, 2, 3, 4], groups=[1, 1, 2, 2, 2], sizes=[2, 2, 3, 3, 3])
    assert GroupSampler(2).select(c, req(6)) == Selection()
    sel = GroupSampler(2).select(c, req(6, final=True))
    # group 1 whole; group 2 (3 rows) is one chunk of 2, and its odd row can never complete.
    assert sel.rows == (0, 1, 2, 3)
    assert sel.dropped == (4,)


def test_group_sampler_never_splits_a_group_to_fill_a_batch() -> None:
    c = cands(range(9), groups=[0, 0, 0, 1, 1, 1, 2, 2, 2])
    sel = GroupSampler(3).select(c, req(8))  # room for two groups, not two and two-thirds
    assert sel.rows == (0, 1, 2, 3, 4, 5)


def test_group_sampler_drops_groups_that_can_never_complete_only_when_final() -> None:
    # group 4 has only 2 live rows but needs 4: it can never complete.
    c = cands(range(6), groups=[4, 8, 8, 4, 8, 8], sizes=[2, 4, 4, 2, 4, 4])
    assert GroupSampler(4).select(c, req(8)) == Selection()
    sel = GroupSampler(4).select(c, req(8, final=True))
    assert sel == Selection(rows=(1, 2, 4, 5), dropped=(0, 3))


def test_group_sampler_keeps_leftovers_whose_rows_may_come_back() -> None:
    # group 6 has 4 live rows, 2 of them leased elsewhere (not candidates): wait for a nack.
    c = cands([0, 1], groups=[6, 6], sizes=[4, 4])
    assert GroupSampler(4).select(c, req(4, final=True)) == Selection()


def test_group_sampler_splits_oversized_groups_into_chunks() -> None:
    c = cands(range(9), groups=[1] * 9, sizes=[9] * 9)
    assert GroupSampler(4).select(c, req(4)).rows == (0, 1, 2, 3)
    assert GroupSampler(4).select(c, req(8)).rows == tuple(range(8))
    final = GroupSampler(4).select(c, req(12, final=True))
    assert final == Selection(rows=tuple(range(8)), dropped=(8,))


def test_group_sampler_uses_whole_multiple_of_n() -> None:
    c = cands(range(12), groups=[0] * 4 + [1] * 4 + [2] * 4)
    assert GroupSampler(4).select(c, req(10)).rows == tuple(range(8))


def test_group_sampler_errors() -> None:
    with pytest.raises(BadRequestError, match=r"row 11 .* no group tag"):
        GroupSampler(2).select(cands([10, 11], groups=[0, -1]), req(2))
    with pytest.raises(BadRequestError, match="batch_size 3 is smaller than one group of 4"):
        GroupSampler(4).select(cands([1, 2, 3, 4], groups=[0, 0, 0, 0]), req(3))
    with pytest.raises(BadRequestError, match="n must be an int >= 1"):
        GroupSampler(0)


def test_greedy_samplers_take_what_is_there_without_waiting() -> None:
    assert SequentialSampler(greedy=True).select(cands([3, 5]), req(8)) == Selection(rows=(3, 5))
    assert SequentialSampler(greedy=True).select(cands([3, 5, 7]), req(2)).rows == (3, 5)
    assert SequentialSampler(greedy=True).select(Candidates.empty(), req(8)) == Selection()
    c = cands([0, 1, 2, 3, 4], groups=[1, 1, 2, 2, 2], sizes=[2, 2, 3, 3, 3])
    # one complete chunk per group is there: both come out now, the odd row waits (not final)
    assert GroupSampler(2, greedy=True).select(c, req(16)) == Selection(rows=(0, 1, 2, 3))
    assert GroupSampler(2, greedy=True).select(c, req(2)) == Selection(rows=(0, 1))
    partial = cands([0, 1, 2], groups=[1, 2, 2], sizes=[2, 2, 2])
    assert GroupSampler(2, greedy=True).select(partial, req(8)).rows == (1, 2)
    assert GroupSampler(2, greedy=True).select(cands([0], groups=[1]), req(8)) == Selection()
    for bad in (1, "yes", None):
        with pytest.raises(BadRequestError, match="greedy must be True or False"):
            SequentialSampler(greedy=bad)  # type: ignore[arg-type]
        with pytest.raises(BadRequestError, match="greedy must be True or False"):
            GroupSampler(2, greedy=bad)  # type: ignore[arg-type]
    assert repr(GroupSampler(2, greedy=True)) == "GroupSampler(n=2, greedy=True)"


@fast
@given(m=st.integers(0, 30), bs=st.integers(1, 40), final=st.booleans())
def test_sequential_greedy_law(m: int, bs: int, final: bool) -> None:
    rows = list(range(10, 10 + 3 * m, 3))
    sel = SequentialSampler(greedy=True).select(cands(rows), req(bs, final=final))
    assert sel == Selection(rows=tuple(rows[:bs]))


@fast
@given(data=st.data(), n=st.integers(1, 4), final=st.booleans(), chunks=st.integers(1, 4))
def test_group_sampler_greedy_matches_model(
    data: st.DataObject, n: int, final: bool, chunks: int
) -> None:
    c = data.draw(grouped_candidates(n))
    request = req(n * chunks + data.draw(st.integers(0, n - 1)), final=final)
    sel = GroupSampler(n, greedy=True).select(c, request)
    assert sel == group_model(c, request, n, greedy=True)
    complete = sum(v // n for v in Counter(c.groups.tolist()).values())
    assert len(sel.rows) == n * min(complete, chunks)  # never waits while a chunk is there


@fast
@given(data=st.data(), n=st.integers(1, 4), final=st.booleans(), chunks=st.integers(1, 4))
def test_group_sampler_matches_model(data: st.DataObject, n: int, final: bool, chunks: int) -> None:
    c = data.draw(grouped_candidates(n))
    request = req(n * chunks + data.draw(st.integers(0, n - 1)), final=final)
    sel = GroupSampler(n).select(c, request)
    assert sel == group_model(c, request, n)
    # Independent laws: whole chunks only; groups come out contiguously; waits for a full batch.
    group_of = dict(zip(c.rows.tolist(), c.groups.tolist(), strict=True))
    per_group = Counter(group_of[r] for r in sel.rows)
    assert all(v % n == 0 for v in per_group.values())
    runs = [g for g, _ in itertools.groupby(group_of[r] for r in sel.rows)]
    assert len(runs) == len(set(runs))
    if not final:
        assert len(sel.rows) in (0, n * chunks)
        assert sel.dropped == ()
    assert len(sel.rows) <= n * chunks


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(), n=st.integers(1, 4), final=st.booleans(), greedy=st.booleans(),
    chunks=st.integers(1, 4),
)  # fmt: skip
def test_group_sampler_few_rows_path_answers_as_the_numpy_path(
    data: st.DataObject, n: int, final: bool, greedy: bool, chunks: int
) -> None:
    """Up to ``_FEW_ROWS`` candidates select in plain Python: the same Selection as the
    vectorized path, on candidates in any order."""
    c = data.draw(grouped_candidates(n))
    order = data.draw(st.permutations(list(range(len(c)))))
    c = c.take(np.asarray(order, dtype=np.int64))
    request = req(n * chunks + data.draw(st.integers(0, n - 1)), final=final)
    sampler = GroupSampler(n, greedy=greedy)
    few = sampler.select(c, request)
    saved = scheduling._FEW_ROWS
    scheduling._FEW_ROWS = -1  # every call takes the numpy path
    try:
        vectorized = sampler.select(c, request)
    finally:
        scheduling._FEW_ROWS = saved
    assert few == vectorized
    assert [type(r) for r in few.rows + few.dropped] == [int] * len(few.rows + few.dropped)


@fast
@given(
    m=st.integers(0, 30), bs=st.integers(1, 40), final=st.booleans(), greedy=st.booleans(),
    seed=st.integers(0, 1000),
)  # fmt: skip
def test_samplers_that_read_the_first_rows_answer_the_same_for_those_alone(
    m: int, bs: int, final: bool, greedy: bool, seed: int
) -> None:
    """``reads_first``: the controller passes only the first ``batch_size`` candidates."""
    sampler = SequentialSampler(greedy=greedy)
    assert scheduling.reads_first(sampler)
    rows = sorted(np.random.default_rng(seed).choice(1000, size=m, replace=False).tolist())
    c = cands(rows)
    request = req(bs, final=final)
    assert sampler.select(c.take(np.arange(min(bs, m))), request) == sampler.select(c, request)


def test_reads_first_is_a_promise_of_the_class_that_defines_select() -> None:
    class Reordering(SequentialSampler):  # overrides select without restating the promise
        def select(self, candidates: Candidates, request: SampleRequest) -> Selection:
            return super().select(candidates.take(np.arange(len(candidates))[::-1]), request)

    assert not scheduling.reads_first(Reordering())
    assert not scheduling.reads_first(GroupSampler(2))
    assert not scheduling.reads_first(StalenessSampler(1, "hold", SequentialSampler()))


def test_group_sampler_few_rows_path_names_an_untagged_row() -> None:
    c = cands([4, 6, 8], groups=[0, -1, 0])
    with pytest.raises(BadRequestError, match=r"row 6 .* has no group tag"):
        GroupSampler(2).select(c, req(2))


@fast
@given(data=st.data(), n=st.integers(1, 4))
def test_group_sampler_final_drains_every_group(data: st.DataObject, n: int) -> None:
    """With all of each group's live rows among the candidates (nothing leased elsewhere), final
    requests deliver or drop every row: the stream can end."""
    raw = data.draw(grouped_candidates(n))
    count = Counter(raw.groups.tolist())
    c = cands(raw.rows.tolist(), groups=raw.groups.tolist())  # sizes = counts
    remaining = c
    for _ in range(len(count) * 3 + 2):
        if len(remaining) == 0:
            break
        sel = GroupSampler(n).select(remaining, req(n, final=True))
        assert sel.rows or sel.dropped
        gone = set(sel.rows) | set(sel.dropped)
        keep = np.flatnonzero([r not in gone for r in remaining.rows.tolist()])
        remaining = remaining.take(keep)
    assert len(remaining) == 0


# --------------------------------------------------------------------------------------------
# Karmarkar-Karp
# --------------------------------------------------------------------------------------------
def test_kk_examples() -> None:
    w = [10, 1, 1, 10]
    parts = karmarkar_karp(w, 2)
    assert sorted(sum(w[i] for i in p) for p in parts) == [11, 11]
    # The textbook case where differencing is not optimal: {4, 5, 7} vs {6, 8} (spread 2),
    # while {4, 5, 6} vs {7, 8} is perfect.
    assert karmarkar_karp([4, 5, 6, 7, 8], 2, equal_size=False) == [[0, 1, 3], [2, 4]]
    assert optimum([4, 5, 6, 7, 8], 2, equal_size=False) == 0
    assert karmarkar_karp([], 3) == [[], [], []]
    assert karmarkar_karp([5, 1], 4) == [[0], [1], [], []]
    assert karmarkar_karp([3, 3, 3], 1) == [[0, 1, 2]]


def test_kk_errors() -> None:
    with pytest.raises(BadRequestError, match="k must be an int >= 1, got 0"):
        karmarkar_karp([1, 2], 0)
    with pytest.raises(BadRequestError, match=r"weight\[1\] = -2"):
        karmarkar_karp([1, -2], 2)


@fast
@given(
    w=st.lists(st.integers(0, 10_000), max_size=60),
    k=st.integers(1, 9),
    equal_size=st.booleans(),
)
def test_kk_is_a_partition_with_balanced_sizes(w: list[int], k: int, equal_size: bool) -> None:
    parts = karmarkar_karp(w, k, equal_size)
    assert len(parts) == k
    assert sorted(i for p in parts for i in p) == list(range(len(w)))
    assert all(p == sorted(p) for p in parts)
    if equal_size:
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1
        if len(w) % k == 0:
            assert set(sizes) == {len(w) // k}
    # The differencing method never leaves a spread larger than the largest weight.
    assert spread(w, parts) <= max(w, default=0)


@settings(max_examples=150, deadline=None)
@given(w=st.lists(st.integers(0, 50), min_size=1, max_size=4), equal_size=st.booleans())
def test_kk_two_way_is_optimal_up_to_four_items(w: list[int], equal_size: bool) -> None:
    assert spread(w, karmarkar_karp(w, 2, equal_size)) == optimum(w, 2, equal_size)


@fast
@given(
    w=st.lists(st.integers(0, 30), min_size=1, max_size=7),
    k=st.integers(2, 3),
    equal_size=st.booleans(),
)
def test_kk_between_optimum_and_largest_weight(w: list[int], k: int, equal_size: bool) -> None:
    got = spread(w, karmarkar_karp(w, k, equal_size))
    assert optimum(w, k, equal_size) <= got <= max(w)


@pytest.mark.parametrize("equal_size", [True, False])
@pytest.mark.parametrize("k", [2, 4, 8])
def test_kk_beats_greedy_on_random_batches(k: int, equal_size: bool) -> None:
    """KK is a heuristic, not always better than greedy (LPT); on random token lengths of a
    DP batch it is at least as good in the large majority of cases and better in total."""
    rng = np.random.default_rng(1234 + k)
    kk_total = greedy_total = not_worse = 0
    trials = 300
    for _ in range(trials):
        n = int(rng.integers(k, 8 * k + 1))
        w = rng.integers(1, 8192, size=n).tolist()
        a = spread(w, karmarkar_karp(w, k, equal_size))
        b = spread(w, greedy(w, k, equal_size))
        kk_total += a
        greedy_total += b
        not_worse += a <= b
    assert kk_total < 0.95 * greedy_total
    assert not_worse >= 0.85 * trials


# --------------------------------------------------------------------------------------------
# TokenBalancedSampler
# --------------------------------------------------------------------------------------------
def test_token_balanced_splits_into_dp_size_equal_parts() -> None:
    tokens = [100, 1, 1, 1, 100, 1, 1, 100]
    c = cands(range(8), tokens=tokens)
    sel = TokenBalancedSampler().select(c, req(8, dp_size=4))
    assert sel.rows == tuple(range(8))
    assert sel.micro_batches is not None
    assert [len(mb) for mb in sel.micro_batches] == [2, 2, 2, 2]
    sums = sorted(sum(tokens[r] for r in mb) for mb in sel.micro_batches)
    assert sums == [2, 101, 101, 101]


def test_token_balanced_parts_override_dp_size_and_use_candidate_tokens() -> None:
    # Candidates in a shuffled order: tokens must follow their rows, not positions.
    base = cands([10, 20, 30, 40], tokens=[7, 1, 1, 7])
    c = base.take(_a([2, 0, 3, 1]))
    sel = TokenBalancedSampler(parts=2).select(c, req(4, dp_size=4, final=True))
    assert sel.rows == (30, 10, 40, 20)
    assert sel.micro_batches is not None
    weights = {10: 7, 20: 1, 30: 1, 40: 7}
    assert sorted(sum(weights[r] for r in mb) for mb in sel.micro_batches) == [8, 8]


def test_token_balanced_passes_empty_and_inner_counts_through() -> None:
    c = cands([1, 2], mins=[0, 9])
    assert TokenBalancedSampler().select(c, req(4)) == Selection()
    inner = StalenessSampler(2, "drop")
    sel = TokenBalancedSampler(inner, parts=1).select(c, req(1, current_version=9))
    assert sel == Selection(rows=(2,), dropped=(1,), micro_batches=((2,),))


def test_token_balanced_with_groups_keeps_rows_of_inner() -> None:
    c = cands(range(8), groups=[0, 1, 0, 1, 2, 2, 3, 3], tokens=[5, 1, 5, 1, 3, 3, 2, 2])
    sel = TokenBalancedSampler(GroupSampler(2)).select(c, req(8, dp_size=2))
    assert sel.rows == (0, 2, 1, 3, 4, 5, 6, 7)
    assert sel.micro_batches is not None
    assert sorted(sum(c.tokens[list(mb)].tolist()) for mb in sel.micro_batches) == [11, 11]


def test_token_balanced_rejects_foreign_rows_of_inner() -> None:
    class Liar:
        def select(self, candidates: Candidates, request: SampleRequest) -> Selection:
            return Selection(rows=(99,))

    with pytest.raises(SamplerError, match="row 99"):
        TokenBalancedSampler(Liar()).select(cands([1, 2]), req(2))
    with pytest.raises(BadRequestError, match="parts must be an int >= 1"):
        TokenBalancedSampler(parts=0)


@fast
@given(
    tokens=st.lists(st.integers(0, 5000), max_size=40),
    bs=st.integers(1, 40),
    dp=st.integers(1, 6),
)
def test_token_balanced_law(tokens: list[int], bs: int, dp: int) -> None:
    c = cands(range(len(tokens)), tokens=tokens)
    sel = TokenBalancedSampler().select(c, req(bs, dp_size=dp, final=True))
    assert sel.rows == tuple(range(min(bs, len(tokens))))
    if not sel.rows:
        return
    assert sel.micro_batches is not None and len(sel.micro_batches) == dp
    assert sorted(r for mb in sel.micro_batches for r in mb) == list(sel.rows)
    expected = karmarkar_karp([tokens[r] for r in sel.rows], dp)
    assert sorted(sum(tokens[r] for r in mb) for mb in sel.micro_batches) == sorted(
        sum(tokens[i] for i in p) for p in expected
    )


# --------------------------------------------------------------------------------------------
# RankAwareSampler
# --------------------------------------------------------------------------------------------
def test_rank_aware_supports_replay_and_delegates() -> None:
    s = RankAwareSampler(GroupSampler(2), members_per_rank=4)
    assert isinstance(s, SupportsRankReplay) and isinstance(s, Scheduler)
    assert s.members_per_rank == 4
    c = cands(range(4), groups=[0, 1, 1, 0])
    assert s.select(c, req(4, member=3)) == GroupSampler(2).select(c, req(4))
    assert not isinstance(SequentialSampler(), SupportsRankReplay)
    assert RankAwareSampler().select(cands([5, 6]), req(1)).rows == (5,)


def test_rank_aware_errors() -> None:
    with pytest.raises(BadRequestError, match="members_per_rank must be an int >= 1"):
        RankAwareSampler(members_per_rank=0)
    with pytest.raises(BadRequestError, match=r"member 2 is outside \[0, 2\)"):
        RankAwareSampler(members_per_rank=2).select(cands([1]), req(1, member=2))


# --------------------------------------------------------------------------------------------
# StalenessSampler
# --------------------------------------------------------------------------------------------
STALE = cands([0, 1, 2, 3, 4, 5], mins=[5, 9, 8, 10, -1, 7])


def test_staleness_hold_counts_and_orders_oldest_first() -> None:
    sel = StalenessSampler(2).select(STALE, req(3, current_version=10))
    # row 0 (10-5) and row 5 (10-7) are stale; the rest oldest first: 2 (v8), 1 (v9), 3 (v10).
    assert sel == Selection(rows=(2, 1, 3), held=2)


def test_staleness_drop_returns_stale_rows() -> None:
    sel = StalenessSampler(2, "drop").select(STALE, req(3, current_version=10))
    assert sel == Selection(rows=(2, 1, 3), dropped=(0, 5))


def test_staleness_unversioned_rows_are_fresh_and_last() -> None:
    sel = StalenessSampler(0, "drop").select(STALE, req(6, current_version=100, final=True))
    assert sel == Selection(rows=(4,), dropped=(0, 1, 2, 3, 5))


def test_staleness_without_current_version_nothing_is_stale() -> None:
    sel = StalenessSampler(0, "drop").select(STALE, req(6))
    assert sel == Selection(rows=(0, 5, 2, 1, 3, 4))


def test_staleness_boundary_is_inclusive() -> None:
    c = cands([1, 2], mins=[3, 2])
    sel = StalenessSampler(2).select(c, req(2, current_version=5, final=True))
    assert sel == Selection(rows=(1,), held=1)  # age 2 is fine, age 3 is stale
    assert StalenessSampler(3).select(c, req(2, current_version=5)).rows == (2, 1)


def test_staleness_ties_by_row_and_inner_waits() -> None:
    c = cands([4, 5, 6], mins=[3, 1, 3])
    assert StalenessSampler(9).select(c, req(3, current_version=3)).rows == (5, 4, 6)
    held = StalenessSampler(1).select(c, req(3, current_version=3))
    assert held == Selection(held=1)  # two fresh rows are too few for a batch of 3


def test_staleness_whole_groups_hold_or_drop_a_group_together() -> None:
    c = cands(range(4), groups=[0, 0, 1, 1], mins=[1, 5, 4, 5])
    split = StalenessSampler(2, "drop", GroupSampler(2)).select(c, req(2, current_version=5))
    assert split == Selection(rows=(2, 3), dropped=(0,))
    whole = StalenessSampler(2, "drop", GroupSampler(2), whole_groups=True)
    assert whole.select(c, req(2, current_version=5)) == Selection(rows=(2, 3), dropped=(0, 1))


def test_staleness_adds_inner_counts() -> None:
    c = cands(range(5), mins=[0, 1, 2, 3, 4])
    outer = StalenessSampler(3, "hold", StalenessSampler(1, "drop"))
    sel = outer.select(c, req(1, current_version=4))
    assert sel == Selection(rows=(3,), dropped=(1, 2), held=1)


def test_staleness_drop_adds_inner_dropped_rows() -> None:
    # row 0 is stale; group 9 (rows 3, 4) is short of n=3 for good, so the final batch drops it.
    c = cands(
        range(6), groups=[1, 1, 1, 9, 9, 2], sizes=[3, 3, 3, 2, 2, 3], mins=[0, 5, 5, 5, 5, 5]
    )
    sel = StalenessSampler(2, "drop", GroupSampler(3)).select(
        c, req(3, current_version=5, final=True)
    )
    assert sel == Selection(rows=(), dropped=(0, 3, 4))


def test_staleness_errors() -> None:
    with pytest.raises(BadRequestError, match="max_lag must be an int >= 0"):
        StalenessSampler(-1)
    with pytest.raises(BadRequestError, match="policy must be 'hold' or 'drop'"):
        StalenessSampler(1, "skip")  # type: ignore[arg-type]


@fast
@given(
    mins=st.lists(st.integers(-1, 12), max_size=40),
    lag=st.integers(0, 5),
    current=st.none() | st.integers(0, 14),
    bs=st.integers(1, 40),
    drop=st.booleans(),
)
def test_staleness_law(mins: list[int], lag: int, current: int | None, bs: int, drop: bool) -> None:
    rows = list(range(100, 100 + len(mins)))
    sampler = StalenessSampler(lag, "drop" if drop else "hold")
    sel = sampler.select(cands(rows, mins=mins), req(bs, current_version=current, final=True))

    def is_stale(v: int) -> bool:
        return current is not None and v >= 0 and current - v > lag

    fresh = sorted(
        (r for r, v in zip(rows, mins, strict=True) if not is_stale(v)),
        key=lambda r: (mins[r - 100] if mins[r - 100] >= 0 else 10**9, r),
    )
    stale = [r for r, v in zip(rows, mins, strict=True) if is_stale(v)]
    assert sel.rows == tuple(fresh[:bs])
    assert sel.dropped == (tuple(stale) if drop else ())
    assert sel.held == (0 if drop else len(stale))


def test_samplers_are_fast_on_ten_thousand_candidates() -> None:
    m = 10_000
    idx = np.arange(m, dtype=np.int64)
    c = Candidates(idx, idx // 8, np.full(m, 8), idx // 500, idx // 500 + 1, 100 + idx % 900)
    request = req(512, current_version=15, dp_size=8)
    budget_ms: dict[Scheduler, float] = {
        SequentialSampler(): 1.0,
        StalenessSampler(3): 2.0,
        StalenessSampler(3, "drop"): 3.0,
        GroupSampler(8): 4.0,
        TokenBalancedSampler(): 10.0,
    }
    for sampler, budget in budget_ms.items():
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            sampler.select(c, request)
            times.append(time.perf_counter() - t0)
        # Generous bounds (shared CI machines): they catch accidental O(n^2) or Python loops.
        assert statistics.median(times) * 1e3 < budget, (sampler, statistics.median(times))


# --------------------------------------------------------------------------------------------
# RequestRouter
# --------------------------------------------------------------------------------------------
def test_router_least_tokens_with_ties_to_lowest_index() -> None:
    r = RequestRouter(["a", "b", "c"], sticky_groups=False)
    assert r.route("r1", 100) == "a"
    assert r.route("r2", 50) == "b"
    assert r.route("r3", 10) == "c"
    assert r.route("r4", 10) == "c"  # c has 10 < 50 < 100
    assert r.route("r5", 0) == "c"
    assert (r.outstanding("a"), r.outstanding("b"), r.outstanding("c")) == (100, 50, 20)
    r.finish("r1")
    assert r.outstanding("a") == 0
    assert r.route("r6", 5) == "a"


def test_router_finish_errors_name_the_request() -> None:
    r = RequestRouter(["a"])
    r.route("x", 3)
    r.finish("x")
    with pytest.raises(BadRequestError, match="unknown request id 'x'"):
        r.finish("x")
    with pytest.raises(BadRequestError, match="unknown request id 'never'"):
        r.finish("never")
    r.route("y", 1)
    with pytest.raises(BadRequestError, match="request 'y' is already routed"):
        r.route("y", 1)
    with pytest.raises(BadRequestError, match="tokens must be >= 0"):
        r.route("z", -1)
    assert r.outstanding("a") == 1


def test_router_sticky_groups_follow_their_instance() -> None:
    r = RequestRouter(["a", "b"])
    assert r.route("g0-0", 100, group="g0") == "a"
    assert r.route("g0-1", 100, group="g0") == "a"  # sticky despite a's load
    assert r.route("g1-0", 10, group=1) == "b"
    assert r.route("free", 1) == "b"
    plain = RequestRouter(["a", "b"], sticky_groups=False)
    plain.route("g0-0", 100, group="g0")
    assert plain.route("g0-1", 100, group="g0") == "b"


def test_router_sticky_to_removed_instance_reroutes() -> None:
    r = RequestRouter(["a", "b"])
    assert r.route("1", 5, group=7) == "a"
    r.remove_instance("a")
    assert list(r.instances) == ["b"]
    assert r.route("2", 5, group=7) == "b"
    r.finish("1")  # its instance is gone: nothing to release, no error
    r.add_instance("a")
    assert list(r.instances) == ["b", "a"]
    assert r.outstanding("a") == 0
    assert r.route("3", 1, group=7) == "b"  # group 7 now lives on b
    with pytest.raises(BadRequestError, match="unknown instance 'zz'"):
        r.remove_instance("zz")
    with pytest.raises(BadRequestError, match="instance 'b' is already present"):
        r.add_instance("b")


def test_router_readded_instance_ignores_finishes_of_old_requests() -> None:
    r = RequestRouter(["a"])
    r.route("old", 50)
    r.remove_instance("a")
    r.add_instance("a")
    r.route("new", 7)
    r.finish("old")
    assert r.outstanding("a") == 7


def test_router_sticky_memory_is_a_bounded_lru() -> None:
    r = RequestRouter(["a", "b"], max_sticky_groups=2)
    assert r.route("g1", 300, group=1) == "a"
    assert r.route("g2", 100, group=2) == "b"
    assert r.route("g1b", 0, group=1) == "a"  # sticky although b is lighter; refreshes group 1
    assert r.route("g3", 0, group=3) == "b"  # a third group evicts group 2, the least recent
    assert r.route("g1c", 0, group=1) == "a"  # group 1 is still remembered
    assert r.route("load", 1000) == "b"  # b: 1100 tokens, a: 300
    assert r.route("g2b", 0, group=2) == "a"  # group 2 was forgotten: least tokens decides


def test_router_round_robin() -> None:
    r = RequestRouter(["a", "b", "c"], policy="round_robin", sticky_groups=False)
    assert [r.route(str(i), 1000 * i) for i in range(5)] == ["a", "b", "c", "a", "b"]
    s = RequestRouter(["a", "b"], policy="round_robin")
    assert [s.route(str(i), 1, group=i % 2) for i in range(4)] == ["a", "b", "a", "b"]


def test_router_errors() -> None:
    with pytest.raises(EngineError, match="no inference instance"):
        RequestRouter([]).route("r", 1)
    with pytest.raises(BadRequestError, match="policy must be"):
        RequestRouter(["a"], policy="random")  # type: ignore[arg-type]
    with pytest.raises(BadRequestError, match="instance 'a' is already present"):
        RequestRouter(["a", "a"])
    with pytest.raises(BadRequestError, match="sequence of names"):
        RequestRouter("ab")
    with pytest.raises(BadRequestError, match="unknown instance 'q'"):
        RequestRouter(["a"]).outstanding("q")


def test_router_is_thread_safe() -> None:
    names = [f"i{j}" for j in range(4)]
    r = RequestRouter(names)
    n_threads, per_thread = 8, 1500
    kept: list[int] = [0] * n_threads
    start = threading.Barrier(n_threads)

    def work(t: int) -> None:
        start.wait()
        for i in range(per_thread):
            rid = f"{t}-{i}"
            tokens = (i * 7 + t) % 97 + 1
            r.route(rid, tokens, group=i % 50 if i % 3 else None)
            if i % 4:
                r.finish(rid)
            else:
                kept[t] += tokens

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sum(r.outstanding(n) for n in names) == sum(kept)
    for t in range(n_threads):
        for i in range(0, per_thread, 4):
            r.finish(f"{t}-{i}")
    assert [r.outstanding(n) for n in names] == [0, 0, 0, 0]
