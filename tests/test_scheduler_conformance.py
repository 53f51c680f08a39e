"""Every sampler in asyncflow_core.data.scheduling against the Scheduler conformance laws."""

from __future__ import annotations

import pytest
from asyncflow_conformance.scheduler import SchedulerConformance, SchedulerFactory
from hypothesis import Phase, settings

from asyncflow_core.contracts.protocols import Candidates, SampleRequest, Selection
from asyncflow_core.data.scheduling import (
    GroupSampler,
    RankAwareSampler,
    SequentialSampler,
    StalenessSampler,
    TokenBalancedSampler,
)


class TestSequentialSampler(SchedulerConformance):
    @pytest.fixture
    def scheduler_factory(self) -> SchedulerFactory:
        return SequentialSampler


class TestGroupSampler(SchedulerConformance):
    needs_groups = True

    @pytest.fixture
    def scheduler_factory(self) -> SchedulerFactory:
        return lambda: GroupSampler(self.group_n)


class TestGroupSamplerPairs(SchedulerConformance):
    needs_groups = True
    group_n = 2

    @pytest.fixture
    def scheduler_factory(self) -> SchedulerFactory:
        return lambda: GroupSampler(2)


class TestSequentialSamplerGreedy(SchedulerConformance):
    @pytest.fixture
    def scheduler_factory(self) -> SchedulerFactory:
        return lambda: SequentialSampler(greedy=True)


class TestGroupSamplerGreedy(SchedulerConformance):
    needs_groups = True

    @pytest.fixture
    def scheduler_factory(self) -> SchedulerFactory:
        return lambda: GroupSampler(self.group_n, greedy=True)


class TestTokenBalancedSampler(SchedulerConformance):
    @pytest.fixture
    def scheduler_factory(self) -> SchedulerFactory:
        return TokenBalancedSampler


class TestTokenBalancedFixedParts(SchedulerConformance):
    @pytest.fixture
    def scheduler_factory(self) -> SchedulerFactory:
        return lambda: TokenBalancedSampler(parts=3)


class TestTokenBalancedGroups(SchedulerConformance):
    needs_groups = True

    @pytest.fixture
    def scheduler_factory(self) -> SchedulerFactory:
        return lambda: TokenBalancedSampler(GroupSampler(self.group_n))


class TestRankAwareSampler(SchedulerConformance):
    @pytest.fixture
    def scheduler_factory(self) -> SchedulerFactory:
        return lambda: RankAwareSampler(members_per_rank=2)


class TestStalenessHold(SchedulerConformance):
    @pytest.fixture
    def scheduler_factory(self) -> SchedulerFactory:
        return lambda: StalenessSampler(2, "hold")


class TestStalenessDrop(SchedulerConformance):
    @pytest.fixture
    def scheduler_factory(self) -> SchedulerFactory:
        return lambda: StalenessSampler(2, "drop")


class TestStalenessDropBalanced(SchedulerConformance):
    @pytest.fixture
    def scheduler_factory(self) -> SchedulerFactory:
        return lambda: StalenessSampler(1, "drop", TokenBalancedSampler())


class TestStalenessGroups(SchedulerConformance):
    needs_groups = True

    @pytest.fixture
    def scheduler_factory(self) -> SchedulerFactory:
        return lambda: StalenessSampler(3, "drop", GroupSampler(self.group_n), whole_groups=True)


# --------------------------------------------------------------------------------------------
# The suite itself must catch broken samplers.
# --------------------------------------------------------------------------------------------
class _Broken:
    """A sequential sampler with one deliberate defect."""

    def __init__(self, defect: str) -> None:
        self.defect = defect
        self.calls = 0

    def select(self, candidates: Candidates, request: SampleRequest) -> Selection:
        rows = [int(r) for r in candidates.rows[: request.batch_size].tolist()]
        self.calls += 1
        if self.defect == "foreign":
            return Selection(rows=(*rows, 10**9))
        if self.defect == "duplicate" and rows:
            return Selection(rows=(*rows, rows[0]))
        if self.defect == "oversize":
            return Selection(rows=tuple(candidates.rows.tolist()))
        if self.defect == "numpy_ints":
            return Selection(rows=tuple(candidates.rows[: request.batch_size]))
        if self.defect == "dropped_overlap" and rows:
            return Selection(rows=tuple(rows), dropped=(rows[0],))
        if self.defect == "bad_micro" and len(rows) > 1:
            return Selection(rows=tuple(rows), micro_batches=((rows[0],),))
        if self.defect == "impure":
            return Selection(rows=tuple(rows[: self.calls % 2 + len(rows) // 2]))
        if self.defect == "mutates" and len(candidates):
            candidates.tokens[0] += 1
        if self.defect == "empty_rows":
            return Selection(rows=(0,))
        if self.defect == "held":
            return Selection(rows=tuple(rows), held=len(candidates) + 1)
        return Selection(rows=tuple(rows))


@pytest.mark.parametrize(
    ("defect", "law"),
    [
        ("foreign", "test_rows_are_distinct_candidates_within_batch_size"),
        ("duplicate", "test_rows_are_distinct_candidates_within_batch_size"),
        ("oversize", "test_rows_are_distinct_candidates_within_batch_size"),
        ("numpy_ints", "test_returns_selection_of_plain_tuples"),
        ("dropped_overlap", "test_dropped_are_distinct_candidates_disjoint_from_rows"),
        ("held", "test_dropped_are_distinct_candidates_disjoint_from_rows"),
        ("bad_micro", "test_micro_batches_partition_rows"),
        ("impure", "test_deterministic"),
        ("mutates", "test_does_not_mutate_candidates"),
        ("empty_rows", "test_no_candidates_no_rows"),
    ],
)
def test_conformance_catches_defect(defect: str, law: str) -> None:
    class Quick(SchedulerConformance):
        hypothesis_settings = settings(max_examples=40, deadline=None, phases=[Phase.generate])

    suite = Quick()
    getattr(suite, law)(scheduler_factory=lambda: _Broken("none"))  # the sound one passes
    with pytest.raises((AssertionError, ValueError)):
        getattr(suite, law)(scheduler_factory=lambda: _Broken(defect))
