"""A hypothesis state machine that drives any DataStore and mirrors every step on a plain model.

One partition of three fields (``tok``: ragged float32 tensors, ``score``: plain values, ``n``:
0-dim int64 tensors), two consumer tasks, an optional ``max_rows`` bound. Rules put new rows and
write into existing ones (with and without ``overwrite``, sometimes invalid), lease with
``get_meta(timeout=0)``, read, ack, nack, let leases expire (fake clock), close, and make calls
that must be rejected. After every step the invariants compare the store with the model: no row
lost, readiness exact, consumption and leases exact, capacity respected, stored values equal.
Every rejected call must raise the named error, name the offending value, and leave ``stats()``
and every stored value as they were.

Reuse it for a backend::

    from asyncflow_conformance import make_datastore_state_machine

    TestMyStoreMachine = make_datastore_state_machine(MyStore, supports_fake_clock=False).TestCase

(``DataStoreConformance.test_state_machine`` does this for every subclass.)
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

import torch
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from asyncflow_conformance.storekit import (
    FakeClock,
    StoreFactory,
    cell_key,
    snapshot,
    unpack,
)
from asyncflow_core.contracts.errors import (
    AsyncFlowError,
    BadRequestError,
    CapacityError,
    CellAlreadyWrittenError,
    LeaseError,
    LeaseExpiredError,
    PartitionClosedError,
    SamplerError,
    SchemaError,
    StoreTimeoutError,
    UnknownFieldError,
    UnknownPartitionError,
    UnknownRowError,
    UnknownTaskError,
)
from asyncflow_core.contracts.protocols import (
    BatchMeta,
    Candidates,
    Capacity,
    CellValue,
    DataStore,
    Layout,
    PartitionStats,
    SampleRequest,
    Selection,
    Tags,
)
from asyncflow_core.data.scheduling import SequentialSampler

__all__ = ["FIELDS", "PARTITION", "TASKS", "DataStoreStateMachine", "make_datastore_state_machine"]

PARTITION = "statemachine"
TASKS = ("t0", "t1")
FIELDS = ("tok", "score", "n")
NDIM: dict[str, int | None] = {"tok": 1, "score": None, "n": 0}  # None: a plain field
REAL_CLOCK_LEASE_S = 3600.0  # without a fake clock, leases never end during a run
LAYOUTS: tuple[Layout, ...] = ("padded", "nested", "list")

BAD_CALLS = ("put", "get_meta", "sampler", "ended_lease", "forged_lease")
BAD_GET_META = ("batch_zero", "batch_negative", "task", "field", "partition", "timeout")

T = TypeVar("T")
E = TypeVar("E", bound=AsyncFlowError)

field_lists = st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3, unique=True)
put_fields = st.one_of(st.just(list(FIELDS)), field_lists)  # whole rows half of the time
FIELD_CHOICES = [c for k in (1, 2, 3) for c in itertools.combinations(FIELDS, k)]
get_fields = st.one_of(st.sampled_from([[f] for f in FIELDS]), field_lists)


def make_value(field: str, seed: int, length: int) -> CellValue:
    """A valid cell of ``field``, distinct per ``seed``."""
    if field == "tok":
        return torch.arange(length, dtype=torch.float32) + float(seed)
    if field == "score":
        return {"seed": seed, "len": length} if seed % 3 == 0 else seed
    return torch.tensor(seed, dtype=torch.int64)


def bad_value(field: str, variant: int) -> tuple[CellValue, str]:
    """A cell that breaks ``field``'s schema, and the text its error must mention."""
    options: dict[str, list[tuple[CellValue, str]]] = {
        "tok": [
            (torch.zeros(2, dtype=torch.float64), "float64"),
            (torch.zeros(2, 2), "ndim=2"),
            (5, "plain"),
        ],
        "score": [(torch.zeros(3), "float32"), (torch.tensor(1, dtype=torch.int64), "int64")],
        "n": [
            (torch.tensor(1, dtype=torch.int32), "int32"),
            (torch.zeros(2, dtype=torch.int64), "ndim=1"),
        ],
    }
    choices = options[field]
    return choices[variant % len(choices)]


class _ChosenRows:
    """A sampler that answers with fixed rows whatever the candidates."""

    def __init__(self, rows: Sequence[int]) -> None:
        self.rows = tuple(rows)

    def select(self, candidates: Candidates, request: SampleRequest) -> Selection:
        return Selection(rows=self.rows)


class _RecordingSampler:
    """The sequential sampler, keeping every ``Candidates`` it is shown."""

    def __init__(self) -> None:
        self.seen: list[Candidates] = []

    def select(self, candidates: Candidates, request: SampleRequest) -> Selection:
        self.seen.append(candidates)
        return SequentialSampler().select(candidates, request)


@dataclass
class _Lease:
    meta: BatchMeta
    deadline: float
    state: Literal["active", "acked", "nacked", "expired"] = "active"


class DataStoreStateMachine(RuleBasedStateMachine):
    """Drives a DataStore built by ``make_store`` and checks it against a plain-dict model.

    Subclass it and override ``make_store`` (or use ``make_datastore_state_machine``). Set
    ``supports_fake_clock = True`` when ``make_store`` honours ``clock`` (then leases expire by
    advancing it); otherwise leases last an hour and the expiry rule never runs.
    """

    supports_fake_clock: ClassVar[bool] = False

    def make_store(self, clock: FakeClock | None) -> DataStore:
        raise NotImplementedError(
            f"{type(self).__name__}.make_store must build a fresh store; or build the machine "
            "with make_datastore_state_machine(factory)"
        )

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = FakeClock() if self.supports_fake_clock else None
        self.store = self.make_store(self.clock)
        # the model
        self.cells: dict[int, dict[str, CellValue]] = {}  # live row -> written cells
        self.tags: dict[int, Tags] = {}
        self.next_row = 0
        self.consumed: dict[str, set[int]] = {t: set() for t in TASKS}  # ever, incl. reclaimed
        self.leased: dict[str, set[int]] = {t: set() for t in TASKS}
        self.reclaimed = 0
        self.closed = False
        self.written_fields: set[str] = set()  # fields whose schema a write fixed
        self.max_rows: int | None = None
        self.leases: list[_Lease] = []
        self.seeds = itertools.count(1)

    def teardown(self) -> None:
        self.loop.close()

    # -- plumbing ----------------------------------------------------------------------------
    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def cells_by_field(self) -> dict[str, list[int]]:
        return {f: sorted(r for r, c in self.cells.items() if f in c) for f in FIELDS}

    def snapshot(self) -> tuple[PartitionStats, dict[str, list[Any]]]:
        return self.run(snapshot(self.store, PARTITION, self.cells_by_field()))

    def rejected(
        self,
        call: Callable[[], Coroutine[Any, Any, Any]],
        error: type[E],
        mentions: Sequence[str],
    ) -> E:
        """``call()`` must raise ``error`` naming one of ``mentions``, changing nothing."""
        before = self.snapshot()
        try:
            self.run(call())
        except error as e:
            caught = e
        else:
            raise AssertionError(f"expected {error.__name__}, but the call succeeded")
        message = str(caught)
        assert any(m in message for m in mentions), (
            f"{type(caught).__name__} message names none of {list(mentions)}: {message}"
        )
        after = self.snapshot()
        assert after[0] == before[0], (
            f"rejected call ({type(caught).__name__}) changed stats:\n{before[0]}\n{after[0]}"
        )
        assert after[1] == before[1], f"rejected call ({type(caught).__name__}) changed data"
        return caught

    def live_after(self, n: int) -> bool:
        return self.max_rows is None or len(self.cells) + n <= self.max_rows

    def values(self, fields: Sequence[str], n: int, lengths: Sequence[int]) -> dict[str, Any]:
        return {f: [make_value(f, next(self.seeds), lengths[i]) for i in range(n)] for f in fields}

    def candidates(self, task: str, fields: Sequence[str]) -> tuple[list[int], list[int]]:
        """(free rows, candidate rows) of ``task`` for ``fields``, ascending."""
        free = sorted(
            r for r in self.cells if r not in self.consumed[task] and r not in self.leased[task]
        )
        ready = [r for r in free if all(f in self.cells[r] for f in fields)]
        return free, ready

    def record_write(self, rows: Sequence[int], data: dict[str, Any], tags: Any) -> None:
        for i, r in enumerate(rows):
            for f, vals in data.items():
                self.cells[r][f] = vals[i]
            if tags is not None:
                self.tags[r] = self.tags[r].merged(tags[i])
        self.written_fields |= set(data)

    # -- setup -------------------------------------------------------------------------------
    @initialize(max_rows=st.sampled_from([None, 3, 6]))
    def create(self, max_rows: int | None) -> None:
        self.max_rows = max_rows
        capacity = Capacity(max_rows=max_rows) if max_rows is not None else None
        self.run(self.store.create_partition(PARTITION, list(FIELDS), capacity=capacity))
        for task in TASKS:
            self.run(self.store.register_task(PARTITION, task))

    # -- writes ------------------------------------------------------------------------------
    @rule(
        n=st.integers(1, 4),
        fields=put_fields,
        lengths=st.lists(st.integers(0, 4), min_size=4, max_size=4),
        tagged=st.booleans(),
        group=st.sampled_from(["g0", "g1", 7]),
        version=st.integers(0, 3),
    )
    def put_new_rows(
        self,
        n: int,
        fields: list[str],
        lengths: list[int],
        tagged: bool,
        group: str | int,
        version: int,
    ) -> None:
        data = self.values(fields, n, lengths)
        tags = [Tags(group, (version,), lengths[i]) for i in range(n)] if tagged else None

        def put() -> Coroutine[Any, Any, tuple[int, ...]]:
            return self.store.put(PARTITION, data, tags=tags, timeout=0)

        if self.closed:
            self.rejected(put, PartitionClosedError, [PARTITION])
        elif self.max_rows is not None and n > self.max_rows:
            self.rejected(put, CapacityError, [str(self.max_rows)])
        elif not self.live_after(n):
            self.rejected(put, StoreTimeoutError, [PARTITION])
        else:
            rows = self.run(put())
            assert rows == tuple(range(self.next_row, self.next_row + n)), rows
            self.next_row += n
            for r in rows:
                self.cells[r] = {}
                self.tags[r] = Tags()
            self.record_write(rows, data, tags)

    @precondition(lambda self: self.cells)
    @rule(
        data=st.data(),
        fields=field_lists,
        overwrite=st.booleans(),
        lengths=st.lists(st.integers(0, 4), min_size=2, max_size=2),
        tag=st.one_of(st.none(), st.builds(Tags, st.sampled_from([None, "g1", 9]), st.just((5,)))),
    )
    def put_into_rows(
        self,
        data: st.DataObject,
        fields: list[str],
        overwrite: bool,
        lengths: list[int],
        tag: Tags | None,
    ) -> None:
        rows = data.draw(
            st.lists(st.sampled_from(sorted(self.cells)), min_size=1, max_size=2, unique=True)
        )
        values = self.values(fields, len(rows), lengths)
        tags = [tag] * len(rows) if tag is not None else None
        taken = [(r, f) for r in rows for f in fields if f in self.cells[r]]

        def put() -> Coroutine[Any, Any, tuple[int, ...]]:
            return self.store.put(
                PARTITION, values, rows=rows, tags=tags, overwrite=overwrite, timeout=0
            )

        if taken and not overwrite:
            self.rejected(put, CellAlreadyWrittenError, [repr(f) for _, f in taken])
            return
        assert self.run(put()) == tuple(rows)
        self.record_write(rows, values, tags)

    def put_invalid(self, data: st.DataObject, variant: int, new_rows: bool) -> bool:
        """A put that must be rejected; False if none applies now."""
        kind = data.draw(st.sampled_from(["schema", "unknown_field", "dead_row", "counts"]))
        can_add = not self.closed and self.live_after(1)
        if kind == "dead_row" or not (new_rows and can_add):
            if not self.cells:
                return False
            new_rows = False
        if not self.written_fields:
            return False
        field = data.draw(st.sampled_from(sorted(self.written_fields)))
        partner = next(f for f in FIELDS if f != field)
        good = make_value(partner, next(self.seeds), 2)
        rows: list[int] | None = None
        if not new_rows:
            rows = [data.draw(st.sampled_from(sorted(self.cells)))]
        values: dict[str, Any]
        error: type[AsyncFlowError]
        if kind == "schema":
            bad, mention = bad_value(field, variant)
            values, error, mentions = {partner: [good], field: [bad]}, SchemaError, [mention]
        elif kind == "unknown_field":
            values = {partner: [good], "ghost-field": [1]}
            error, mentions = UnknownFieldError, ["ghost-field"]
        elif kind == "dead_row":
            dead = [r for r in range(self.next_row) if r not in self.cells] or [self.next_row + 7]
            missing = data.draw(st.sampled_from(dead))
            assert rows is not None
            rows.append(missing)
            values = {partner: [good, good]}
            error, mentions = UnknownRowError, [str(missing)]
        else:
            values = {partner: [good], field: [make_value(field, 1, 1)] * 2}
            error, mentions = BadRequestError, [partner, field]
        self.rejected(
            lambda: self.store.put(PARTITION, values, rows=rows, overwrite=True, timeout=0),
            error,
            mentions,
        )
        return True

    # -- consumption -------------------------------------------------------------------------
    @rule(
        data=st.data(),
        task=st.sampled_from(TASKS),
        aimed=st.booleans(),
        lease_s=st.sampled_from([2.5, 12.5]),
        spy=st.booleans(),
    )
    def get_meta(
        self, data: st.DataObject, task: str, aimed: bool, lease_s: float, spy: bool
    ) -> None:
        """Lease with ``timeout=0``. ``aimed``: ask for fields some row has ready and at most
        as many rows as there are (a blind request mostly finds nothing to lease). ``spy``:
        through a sequential sampler that records its candidates, checked against the model."""
        if self.clock is None:
            lease_s = REAL_CLOCK_LEASE_S
        useful = [list(c) for c in FIELD_CHOICES if self.candidates(task, c)[1]]
        if aimed and useful:
            fields = data.draw(st.sampled_from(useful), label="fields")
            most = len(self.candidates(task, fields)[1])
            batch_size = data.draw(st.integers(1, min(most, 3)), label="batch_size")
        else:
            fields = data.draw(get_fields, label="fields")
            batch_size = data.draw(st.integers(1, 3), label="batch_size")
        free, ready = self.candidates(task, fields)
        unconsumed = [r for r in self.cells if r not in self.consumed[task]]
        final = self.closed and len(ready) == len(free)
        expected = ready[:batch_size] if len(ready) >= batch_size or final else []

        sampler = _RecordingSampler() if spy else None

        def get() -> Coroutine[Any, Any, BatchMeta]:
            return self.store.get_meta(
                PARTITION, task, fields, batch_size, sampler=sampler, timeout=0, lease_s=lease_s
            )

        if self.closed and not unconsumed:
            meta = self.run(get())
            assert meta.end_of_stream and meta.rows == (), f"expected end of stream, got {meta}"
            return
        if not expected:
            self.rejected(get, StoreTimeoutError, [PARTITION])
            if sampler is not None and sampler.seen:
                self.check_candidates(sampler.seen[-1], task, fields)
            return
        meta = self.run(get())
        if sampler is not None:
            assert sampler.seen, "the store leased rows without asking the sampler"
            self.check_candidates(sampler.seen[-1], task, fields)
        again = set(meta.rows) & self.consumed[task]
        assert not again, f"rows {sorted(again)} delivered to {task!r} again after ack"
        twice = set(meta.rows) & self.leased[task]
        assert not twice, f"rows {sorted(twice)} leased to {task!r} twice at once"
        assert not meta.end_of_stream
        assert meta.rows == tuple(expected), f"leased {meta.rows}, expected {tuple(expected)}"
        assert (meta.partition, meta.task, meta.fields) == (PARTITION, task, tuple(fields))
        assert meta.tags == tuple(self.tags[r] for r in expected), meta.tags
        assert meta.lease_id is not None
        deadline = REAL_CLOCK_LEASE_S
        if self.clock is not None:
            deadline = self.clock() + lease_s
            assert abs(meta.deadline - deadline) < 1e-6, (meta.deadline, deadline)
        self.leased[task] |= set(meta.rows)
        lease = _Lease(meta, deadline)
        self.leases.append(lease)
        then = data.draw(st.sampled_from(["hold", "consume", "nack"]), label="then")
        if then == "consume":  # what a consumer does: read, then ack
            self.read_lease(lease, None, data.draw(st.sampled_from(LAYOUTS)), 0)
            self.end_lease(lease, "ack")
        elif then == "nack":
            self.end_lease(lease, "nack")

    def check_candidates(self, cand: Candidates, task: str, fields: Sequence[str]) -> None:
        """What a sampler is shown must match the model: the ready, free rows of ``task``
        ascending, with their tags as columns and, per group, the live rows the task has not
        consumed."""
        _, ready = self.candidates(task, fields)
        assert cand.rows.tolist() == ready, f"candidates {cand.rows.tolist()}, model {ready}"
        tags = [self.tags[r] for r in ready]
        codes = cand.groups.tolist()
        for i, (tag, code) in enumerate(zip(tags, codes, strict=True)):
            assert (code < 0) == (tag.group is None), f"row {ready[i]}: group code {code}, {tag}"
            for j in range(i):
                same_group = tag.group is not None and tag.group == tags[j].group
                assert (code == codes[j] and code >= 0) == same_group, (
                    f"rows {ready[j]} and {ready[i]}: group codes {codes[j]}, {code} but groups "
                    f"{tags[j].group!r}, {tag.group!r}"
                )
        # per task: the group's live rows this task has not consumed (ready or not)
        mine = [t.group for r, t in self.tags.items() if r not in self.consumed[task]]
        sizes = [mine.count(t.group) if t.group is not None else -1 for t in tags]
        assert cand.group_sizes.tolist() == sizes, (cand.group_sizes.tolist(), sizes)
        assert cand.min_versions.tolist() == [t.min_version for t in tags]
        assert cand.max_versions.tolist() == [t.max_version for t in tags]
        assert cand.tokens.tolist() == [t.tokens for t in tags]

    @precondition(lambda self: self.active_leases())
    @rule(data=st.data(), layout=st.sampled_from(LAYOUTS), pad=st.sampled_from([0, -1]))
    def get_data(self, data: st.DataObject, layout: Layout, pad: int) -> None:
        lease = data.draw(st.sampled_from(self.active_leases()))
        fields: list[str] | None = None
        if data.draw(st.booleans(), label="subset of fields"):
            fields = data.draw(
                st.lists(st.sampled_from(lease.meta.fields), min_size=1, unique=True)
            )
        self.read_lease(lease, fields, layout, pad)

    def read_lease(self, lease: _Lease, fields: list[str] | None, layout: Layout, pad: int) -> None:
        """get_data of a held lease must return the model's values in ``layout``."""
        meta = lease.meta
        batch = self.run(self.store.get_data(meta, fields, layout=layout, pad_value=pad))
        assert tuple(batch.rows) == meta.rows
        for f in fields or meta.fields:
            got = unpack(batch, f, layout, NDIM[f])
            want = [self.cells[r][f] for r in meta.rows]
            assert [cell_key(v) for v in got] == [cell_key(v) for v in want], (f, layout)
            if layout == "padded" and f == "tok" and meta.rows:
                lengths = batch.lengths[f].tolist()
                for i, length in enumerate(lengths):
                    assert bool((batch[f][i, length:] == pad).all()), "padding is not pad_value"

    def end_lease(self, lease: _Lease, verb: Literal["ack", "nack"]) -> None:
        call = self.store.ack if verb == "ack" else self.store.nack
        lease_id = str(lease.meta.lease_id)
        if lease.state == "expired":
            self.rejected(lambda: call(lease.meta), LeaseExpiredError, [lease_id])
            return
        if lease.state != "active":
            err = self.rejected(lambda: call(lease.meta), LeaseError, [lease_id])
            assert not isinstance(err, LeaseExpiredError), f"{lease.state} lease called expired"
            return
        self.run(call(lease.meta))
        task, rows = lease.meta.task, set(lease.meta.rows)
        self.leased[task] -= rows
        if verb == "nack":
            lease.state = "nacked"
            return
        lease.state = "acked"
        self.consumed[task] |= rows
        for r in sorted(rows):
            if all(r in self.consumed[t] for t in TASKS):
                del self.cells[r], self.tags[r]
                self.reclaimed += 1

    def active_leases(self) -> list[_Lease]:
        return [lease for lease in self.leases if lease.state == "active"]

    def ended_leases(self) -> list[_Lease]:
        return [lease for lease in self.leases if lease.state != "active"]

    def unsettled_leases(self) -> list[_Lease]:
        """Leases their consumer has neither acked nor nacked (held, or expired meanwhile)."""
        return [lease for lease in self.leases if lease.state in ("active", "expired")]

    @precondition(lambda self: self.unsettled_leases())
    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        self.end_lease(data.draw(st.sampled_from(self.unsettled_leases())), "ack")

    @precondition(lambda self: self.unsettled_leases())
    @rule(data=st.data())
    def nack(self, data: st.DataObject) -> None:
        self.end_lease(data.draw(st.sampled_from(self.unsettled_leases())), "nack")

    @precondition(lambda self: self.clock is not None and self.active_leases())
    @rule(seconds=st.sampled_from([1.0, 4.0, 20.0]))
    def advance_clock(self, seconds: float) -> None:
        assert self.clock is not None
        self.clock.advance(seconds)
        for lease in self.leases:
            if lease.state == "active" and lease.deadline <= self.clock():
                lease.state = "expired"
                self.leased[lease.meta.task] -= set(lease.meta.rows)

    @precondition(lambda self: not self.closed and self.next_row >= 3)
    @rule()
    def close(self) -> None:
        self.run(self.store.close(PARTITION))
        self.closed = True

    # -- calls that must be rejected ---------------------------------------------------------
    # (hypothesis tries rules with fewer arguments first; drawing this rule's choices as
    # arguments puts it last, so rejected calls do not crowd out the valid ones)
    @rule(
        data=st.data(),
        kind=st.sampled_from(BAD_CALLS),
        task=st.sampled_from(TASKS),
        variant=st.integers(0, 5),
        new_rows=st.booleans(),
        verb=st.sampled_from(["ack", "nack"]),
        bad_get=st.sampled_from(BAD_GET_META),
    )
    def invalid_call(
        self,
        data: st.DataObject,
        kind: str,
        task: str,
        variant: int,
        new_rows: bool,
        verb: Literal["ack", "nack"],
        bad_get: str,
    ) -> None:
        """One call that must be rejected (and change nothing): a put, a get_meta, a sampler's
        answer, an ack or nack of an ended (acked, nacked, expired) or forged lease."""
        if kind == "put" and self.put_invalid(data, variant, new_rows):
            return
        if kind == "sampler" and self.sampler_chooses_non_candidates(data, task):
            return
        ended = self.ended_leases()
        if kind == "ended_lease" and ended:
            self.end_lease(data.draw(st.sampled_from(ended)), verb)
        elif kind == "forged_lease":
            lease_id = f"forged-lease-{variant}"
            meta = BatchMeta(PARTITION, task, (0,), ("tok",), lease_id=lease_id)
            err = self.rejected(lambda: self.store.ack(meta), LeaseError, [lease_id])
            assert not isinstance(err, LeaseExpiredError)
        else:
            self.get_meta_invalid(bad_get, task)

    def get_meta_invalid(self, kind: str, task: str) -> None:
        args: dict[str, Any] = {"partition": PARTITION, "task": task, "fields": ["tok"]}
        batch_size, timeout = 1, 0.0
        error: type[AsyncFlowError] = BadRequestError
        if kind == "batch_zero":
            batch_size, mention = 0, "batch_size"
        elif kind == "batch_negative":
            batch_size, mention = -3, "-3"
        elif kind == "task":
            args["task"] = mention = "ghost-task"
            error = UnknownTaskError
        elif kind == "field":
            args["fields"], mention, error = (
                ["tok", "ghost-field"],
                "ghost-field",
                UnknownFieldError,
            )
        elif kind == "partition":
            args["partition"] = mention = "ghost-partition"
            error = UnknownPartitionError
        else:
            timeout, mention = -2.5, "-2.5"
        self.rejected(
            lambda: self.store.get_meta(
                args["partition"], args["task"], args["fields"], batch_size, timeout=timeout
            ),
            error,
            [mention],
        )

    def sampler_chooses_non_candidates(self, data: st.DataObject, task: str) -> bool:
        fields = data.draw(get_fields)
        kind = data.draw(
            st.sampled_from(["consumed", "leased", "not_ready", "never_created", "duplicate"])
        )
        free, ready = self.candidates(task, fields)
        if not ready:
            return False  # the store may not ask a sampler when nothing is a candidate
        pool = {
            "consumed": sorted(self.consumed[task]),
            "leased": sorted(self.leased[task]),
            "not_ready": [r for r in free if r not in ready],
            "never_created": [self.next_row + 7],
            "duplicate": [ready[0]],
        }[kind] or [self.next_row + 7]
        bad = data.draw(st.sampled_from(pool))
        chosen = (ready[0], bad) if bad != ready[0] or kind == "duplicate" else (bad,)
        self.rejected(
            lambda: self.store.get_meta(
                PARTITION, task, fields, 3, sampler=_ChosenRows(chosen), timeout=0
            ),
            SamplerError,
            [str(bad)],
        )
        return True

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def stats_match_the_model(self) -> None:
        s = self.run(self.store.stats(PARTITION))
        model = {
            "rows_created": self.next_row,
            "rows_live": len(self.cells),
            "reclaimed": self.reclaimed,
            "ready": {f: sum(f in c for c in self.cells.values()) for f in FIELDS},
            "consumed": {t: len(self.consumed[t]) for t in TASKS},
            "leased": {t: len(self.leased[t]) for t in TASKS},
            "closed": self.closed,
        }
        for name, want in model.items():
            got = getattr(s, name)
            got = dict(got) if isinstance(want, dict) else got
            assert got == want, f"stats().{name} is {got}, the model says {want}"
        assert s.rows_live + s.reclaimed == s.rows_created, f"a row was lost: {s}"
        if self.max_rows is not None:
            assert s.rows_live <= self.max_rows, f"{s.rows_live} rows live > {self.max_rows}"

    @invariant()
    def stored_values_match_the_model(self) -> None:
        _, stored = self.snapshot()
        for f, rows in self.cells_by_field().items():
            want = [cell_key(self.cells[r][f]) for r in rows]
            assert stored.get(f, []) == want, f"field {f!r} of rows {rows} differs from the model"


def make_datastore_state_machine(
    factory: StoreFactory,
    *,
    supports_fake_clock: bool = False,
    name: str = "DataStoreMachine",
) -> type[DataStoreStateMachine]:
    """A ``DataStoreStateMachine`` subclass whose stores come from ``factory`` (called with
    ``clock=`` when ``supports_fake_clock``). Run it with
    ``hypothesis.stateful.run_state_machine_as_test`` or collect its ``.TestCase``."""

    def make_store(self: DataStoreStateMachine, clock: FakeClock | None) -> DataStore:
        return factory(clock=clock) if clock is not None else factory()

    namespace = {"make_store": make_store, "supports_fake_clock": supports_fake_clock}
    return type(name, (DataStoreStateMachine,), namespace)
