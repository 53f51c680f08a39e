"""Laws every ``Scheduler`` (sampling policy) must obey, as a pytest class to subclass.

Usage::

    from asyncflow_conformance.scheduler import SchedulerConformance

    class TestMySampler(SchedulerConformance):
        needs_groups = False  # True: candidates come in complete groups of ``group_n`` rows

        @pytest.fixture
        def scheduler_factory(self):
            return lambda: MySampler(...)

Each test draws random ``Candidates`` and ``SampleRequest`` values with hypothesis and checks
one law of the ``Scheduler`` protocol (asyncflow_core.contracts.protocols): the answer is a
``Selection``; its rows are a duplicate-free subset of the candidates, at most ``batch_size``;
``dropped`` is a duplicate-free subset disjoint from the rows; ``held`` counts only rows
neither delivered nor dropped; ``micro_batches``, if any, partition the rows exactly; equal
inputs give equal answers; the input arrays are left unchanged (and may be read-only); zero
candidates give no rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncflow_core.contracts.protocols import Candidates, SampleRequest, Scheduler, Selection

__all__ = ["SchedulerConformance", "SchedulerFactory", "candidates_strategy", "requests_strategy"]

SchedulerFactory = Callable[[], Scheduler]

Law = Callable[[SchedulerFactory, Candidates, SampleRequest], None]


@st.composite
def candidates_strategy(
    draw: st.DrawFn, *, grouped: bool = False, group_n: int = 4, max_rows: int = 48
) -> Candidates:
    """Random, internally consistent ``Candidates``: ascending distinct rows; ``group_sizes``
    at least the number of candidates of each group (-1 for untagged rows); ``max_versions >=
    min_versions`` (both -1 for unversioned rows). ``grouped=True``: every row is tagged and the
    rows form complete groups of exactly ``group_n`` rows, interleaved.

    Hypothesis draws the shape (row count, number of groups, value ranges) and a seed; numpy
    fills the columns from the seed, which keeps each example cheap."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="seed"))
    if grouped:
        n_groups = draw(st.integers(0, max(0, max_rows // group_n)), label="groups")
        codes_of_groups = rng.choice(1000, size=n_groups, replace=False)
        codes = rng.permutation(np.repeat(codes_of_groups, group_n)).astype(np.int64)
    else:
        m = draw(st.integers(0, max_rows), label="rows")
        n_codes = draw(st.integers(0, 6), label="codes")
        codes = rng.integers(-1, n_codes, size=m, dtype=np.int64)
    m = int(codes.shape[0])
    rows = draw(st.integers(0, 20), label="first row") + np.cumsum(
        rng.integers(1, 4, size=m, dtype=np.int64)
    )
    _, inverse, counts = np.unique(codes, return_inverse=True, return_counts=True)
    extra = np.zeros_like(counts) if grouped else rng.integers(0, 4, size=counts.shape[0])
    sizes = np.where(codes < 0, -1, (counts + extra)[inverse.reshape(-1)]).astype(np.int64)
    newest = draw(st.integers(-1, 12), label="newest version")
    mins = rng.integers(-1, newest + 1, size=m, dtype=np.int64)
    maxs = np.where(mins < 0, -1, mins + rng.integers(0, 4, size=m)).astype(np.int64)
    longest = draw(st.sampled_from([0, 1, 7, 4096]), label="longest row")
    tokens = rng.integers(0, longest + 1, size=m, dtype=np.int64)
    return Candidates(rows, codes, sizes, mins, maxs, tokens)


@st.composite
def requests_strategy(draw: st.DrawFn, *, grouped: bool = False, group_n: int = 4) -> SampleRequest:
    """Random valid ``SampleRequest``; with ``grouped`` the batch size is a multiple of
    ``group_n``."""
    batch_size = group_n * draw(st.integers(1, 4)) if grouped else draw(st.integers(1, 64))
    dp_size = draw(st.integers(1, 4))
    return SampleRequest(
        partition="conformance",
        task="train",
        batch_size=batch_size,
        final=draw(st.booleans()),
        current_version=draw(st.none() | st.integers(0, 16)),
        dp_rank=draw(st.integers(0, dp_size - 1)),
        dp_size=dp_size,
        member=0,
    )


def _copy(c: Candidates) -> Candidates:
    return Candidates(
        c.rows.copy(),
        c.groups.copy(),
        c.group_sizes.copy(),
        c.min_versions.copy(),
        c.max_versions.copy(),
        c.tokens.copy(),
    )


def _read_only(c: Candidates) -> Candidates:
    c = _copy(c)
    for a in (c.rows, c.groups, c.group_sizes, c.min_versions, c.max_versions, c.tokens):
        a.setflags(write=False)
    return c


def _same(a: Candidates, b: Candidates) -> bool:
    return all(
        np.array_equal(x, y)
        for x, y in (
            (a.rows, b.rows),
            (a.groups, b.groups),
            (a.group_sizes, b.group_sizes),
            (a.min_versions, b.min_versions),
            (a.max_versions, b.max_versions),
            (a.tokens, b.tokens),
        )
    )


def _is_row_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class SchedulerConformance:
    """Subclass (as ``Test...``) and provide the ``scheduler_factory`` fixture: a zero-argument
    callable building the ``Scheduler`` under test (called afresh for every example). Set
    ``needs_groups = True`` for a sampler that requires GRPO group tags; the candidates then
    form complete groups of ``group_n`` rows and batch sizes are multiples of ``group_n``.
    ``hypothesis_settings`` sets the number of examples per law and the like."""

    needs_groups: ClassVar[bool] = False
    group_n: ClassVar[int] = 4
    hypothesis_settings: ClassVar[settings] = settings(
        max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )

    @pytest.fixture
    def scheduler_factory(self) -> SchedulerFactory:
        pytest.fail(
            f"{type(self).__name__} must define a `scheduler_factory` fixture returning a "
            f"zero-argument callable that builds the Scheduler under test"
        )

    # -- helpers ---------------------------------------------------------------------------
    def _for_all(self, factory: SchedulerFactory, law: Law) -> None:
        """Check ``law(factory, candidates, request)`` on random inputs."""
        grouped, n = self.needs_groups, self.group_n
        cases = st.tuples(
            candidates_strategy(grouped=grouped, group_n=n),
            requests_strategy(grouped=grouped, group_n=n),
        )

        @self.hypothesis_settings
        @given(case=cases)
        def check(case: tuple[Candidates, SampleRequest]) -> None:
            law(factory, *case)

        check()

    @staticmethod
    def _select(factory: SchedulerFactory, cands: Candidates, request: SampleRequest) -> Selection:
        scheduler = factory()
        assert isinstance(scheduler, Scheduler), (
            f"scheduler_factory built {scheduler!r}, which has no select(candidates, request)"
        )
        return scheduler.select(cands, request)

    # -- laws ------------------------------------------------------------------------------
    def test_returns_selection_of_plain_tuples(self, scheduler_factory: SchedulerFactory) -> None:
        def law(factory: SchedulerFactory, cands: Candidates, request: SampleRequest) -> None:
            sel = self._select(factory, cands, request)
            assert isinstance(sel, Selection), (
                f"select returned {type(sel).__name__}, not Selection"
            )
            assert isinstance(sel.rows, tuple), f"Selection.rows is {type(sel.rows).__name__}"
            assert isinstance(sel.dropped, tuple), (
                f"Selection.dropped is {type(sel.dropped).__name__}"
            )
            bad = [x for x in sel.rows + sel.dropped if not _is_row_id(x)]
            assert not bad, f"row ids must be plain Python ints, got {type(bad[0]).__name__}"
            assert _is_row_id(sel.held) and sel.held >= 0, f"Selection.held = {sel.held!r}"

        self._for_all(scheduler_factory, law)

    def test_rows_are_distinct_candidates_within_batch_size(
        self, scheduler_factory: SchedulerFactory
    ) -> None:
        def law(factory: SchedulerFactory, cands: Candidates, request: SampleRequest) -> None:
            sel = self._select(factory, cands, request)
            allowed = set(cands.rows.tolist())
            foreign = [r for r in sel.rows if r not in allowed]
            assert not foreign, f"rows {foreign} are not among the candidates {sorted(allowed)}"
            assert len(set(sel.rows)) == len(sel.rows), f"duplicate rows in {sel.rows}"
            assert len(sel.rows) <= request.batch_size, (
                f"{len(sel.rows)} rows returned for batch_size={request.batch_size}"
            )

        self._for_all(scheduler_factory, law)

    def test_dropped_are_distinct_candidates_disjoint_from_rows(
        self, scheduler_factory: SchedulerFactory
    ) -> None:
        def law(factory: SchedulerFactory, cands: Candidates, request: SampleRequest) -> None:
            sel = self._select(factory, cands, request)
            allowed = set(cands.rows.tolist())
            foreign = [r for r in sel.dropped if r not in allowed]
            assert not foreign, f"dropped rows {foreign} are not among the candidates"
            assert len(set(sel.dropped)) == len(sel.dropped), f"duplicates in {sel.dropped}"
            both = set(sel.rows) & set(sel.dropped)
            assert not both, f"rows {sorted(both)} are both delivered and dropped"
            rest = len(cands) - len(sel.rows) - len(sel.dropped)
            assert sel.held <= rest, (
                f"held={sel.held} but only {rest} candidates were neither delivered nor dropped"
            )

        self._for_all(scheduler_factory, law)

    def test_micro_batches_partition_rows(self, scheduler_factory: SchedulerFactory) -> None:
        def law(factory: SchedulerFactory, cands: Candidates, request: SampleRequest) -> None:
            sel = self._select(factory, cands, request)
            if sel.micro_batches is None:
                return
            assert isinstance(sel.micro_batches, tuple) and all(
                isinstance(mb, tuple) for mb in sel.micro_batches
            ), "micro_batches must be a tuple of tuples"
            flat = [r for mb in sel.micro_batches for r in mb]
            assert sorted(flat) == sorted(sel.rows), (
                f"micro_batches {sel.micro_batches} do not partition rows {sel.rows}"
            )

        self._for_all(scheduler_factory, law)

    def test_deterministic(self, scheduler_factory: SchedulerFactory) -> None:
        def law(factory: SchedulerFactory, cands: Candidates, request: SampleRequest) -> None:
            first = self._select(factory, cands, request)
            second = self._select(factory, _copy(cands), request)
            assert first == second, f"two equal calls on fresh schedulers: {first} != {second}"
            scheduler = factory()
            again = [scheduler.select(_copy(cands), request) for _ in range(2)]
            assert again[0] == again[1] == first, (
                f"repeated calls on one scheduler differ: {again[0]} != {again[1]} (select "
                f"must be pure)"
            )

        self._for_all(scheduler_factory, law)

    def test_does_not_mutate_candidates(self, scheduler_factory: SchedulerFactory) -> None:
        def law(factory: SchedulerFactory, cands: Candidates, request: SampleRequest) -> None:
            before = _copy(cands)
            self._select(factory, cands, request)
            assert _same(cands, before), "select changed the candidate arrays in place"
            # The store may hand out read-only views of its own arrays.
            frozen = _read_only(before)
            assert self._select(factory, frozen, request) == self._select(
                factory, before, request
            ), "select answers differently for read-only candidate arrays"

        self._for_all(scheduler_factory, law)

    def test_no_candidates_no_rows(self, scheduler_factory: SchedulerFactory) -> None:
        def law(factory: SchedulerFactory, cands: Candidates, request: SampleRequest) -> None:
            sel = self._select(factory, Candidates.empty(), request)
            assert sel.rows == (), f"rows {sel.rows} returned from zero candidates"
            assert sel.dropped == (), f"dropped {sel.dropped} from zero candidates"
            assert sel.held == 0, f"held={sel.held} from zero candidates"

        self._for_all(scheduler_factory, law)
