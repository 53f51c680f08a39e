"""The five protocols of AsyncFlow (DataStore, Scheduler, InferenceEngine, TrainEngine,
WeightSync), their optional ``SupportsX`` abilities, and the plain data types they exchange.

Every data type here is a frozen dataclass of plain values, numpy arrays or tensors, so it
pickles and can cross a process or Ray boundary unchanged. Every call that may wait is async.
The docstrings are the contract; ``asyncflow_conformance`` tests them.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

import numpy as np
import torch

# --------------------------------------------------------------------------------------------
# Basic aliases
# --------------------------------------------------------------------------------------------
Version: TypeAlias = int
"""A weight version. The initial weights are 0; every optimizer step adds 1."""

NO_VERSION: Version = -1
"""Marker for "no version known" in integer arrays (e.g. a prompt row that no model produced)."""

PlainValue: TypeAlias = bool | int | float | str | list[Any] | dict[str, Any] | None
"""A small JSON-able value a cell may hold instead of a tensor."""

CellValue: TypeAlias = torch.Tensor | PlainValue
Layout: TypeAlias = Literal["padded", "nested", "list"]
FinishReason: TypeAlias = Literal["stop", "length", "abort"]
IntArray: TypeAlias = np.ndarray[Any, np.dtype[np.int64]]


# --------------------------------------------------------------------------------------------
# DataStore types
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Tags:
    """Per-row metadata visible to samplers without reading the data plane.

    ``group``: the GRPO group (prompt) id; rows of one group share it.
    ``versions``: the weight versions that produced this row's tokens (empty for a prompt).
    ``tokens``: the row's token length, used for load balancing (0 = unknown).
    A later ``put`` that passes tags for an existing row merges them: a non-None group
    replaces, versions are unioned, a positive ``tokens`` replaces.
    """

    group: int | str | None = None
    versions: tuple[Version, ...] = ()
    tokens: int = 0

    def __reduce__(self) -> tuple[Any, ...]:
        # a slots dataclass pickles through Python-level __getstate__/__setstate__, 2x slower
        # than this; a remote store's lease carries one Tags per row
        return (Tags, (self.group, self.versions, self.tokens))

    def merged(self, other: Tags) -> Tags:
        return Tags(
            group=other.group if other.group is not None else self.group,
            versions=tuple(sorted(set(self.versions) | set(other.versions))),
            tokens=other.tokens if other.tokens > 0 else self.tokens,
        )

    @property
    def min_version(self) -> Version:
        return min(self.versions) if self.versions else NO_VERSION

    @property
    def max_version(self) -> Version:
        return max(self.versions) if self.versions else NO_VERSION


@dataclass(frozen=True, slots=True)
class Capacity:
    """A bound on a partition. ``max_rows`` bounds live rows, ``max_bytes`` bounds the bytes of
    live cells. Puts of *new* rows wait (back-pressure) until the bound admits them; writes into
    existing rows are never blocked (so a pipeline cannot deadlock on its own outputs) but count.
    A new-row put bigger than the whole bound fails at once with ``CapacityError``.
    """

    max_rows: int | None = None
    max_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class FieldSchema:
    """What a field holds, fixed by its first write: a tensor of ``dtype`` with ``ndim`` dims per
    row (dim 0 may vary between rows: ragged), or plain JSON-able values (``dtype is None``)."""

    dtype: str | None
    ndim: int = 0

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None

    def describe(self) -> str:
        return f"tensor(dtype={self.dtype}, ndim={self.ndim})" if self.is_tensor else "plain"


@dataclass(frozen=True, slots=True)
class Candidates:
    """The rows a sampler may choose from, columnar (numpy arrays of equal length).

    ``rows``: row indices, in the order the sampler should prefer (the store passes them
    ascending, i.e. oldest first; a wrapping sampler may pass a reordered subset).
    ``groups``: group id codes (-1 = none; equal codes mean equal ``Tags.group``).
    ``group_sizes``: how many live rows of that row's group the requesting task has not
    consumed yet (ready or not, leased or not; -1 if no group) — a sampler uses it to know
    whether a group can still complete for this task. ``min_versions`` / ``max_versions``: as in
    ``Tags`` (-1 = none). ``tokens``: token lengths.
    """

    rows: IntArray
    groups: IntArray
    group_sizes: IntArray
    min_versions: IntArray
    max_versions: IntArray
    tokens: IntArray

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    @staticmethod
    def empty() -> Candidates:
        z = np.zeros(0, dtype=np.int64)
        return Candidates(z, z, z, z, z, z)

    def take(self, positions: IntArray) -> Candidates:
        """The candidates at ``positions`` (indices into these arrays, not row ids)."""
        return Candidates(
            self.rows[positions],
            self.groups[positions],
            self.group_sizes[positions],
            self.min_versions[positions],
            self.max_versions[positions],
            self.tokens[positions],
        )


@dataclass(frozen=True, slots=True)
class SampleRequest:
    """What a consumer asks a sampler for.

    ``final`` is set by the store when the partition is closed and every row the task has not
    consumed is either a candidate or leased elsewhere: no more rows can become candidates
    except by a nack or lease expiry, so a sampler should hand out a short batch (or drop rows
    it will never take) rather than wait for rows that will not come.
    ``current_version`` is the consumer's (trainer's) weight version, for staleness policies.
    ``dp_rank``/``dp_size`` name the data-parallel consumer. Two models are supported: one
    fetcher asks for the whole step's batch with ``dp_size`` = number of ranks and a sampler
    that splits it into ``micro_batches`` (``TokenBalancedSampler``; ``BatchMeta.split()``), or
    each rank asks for its own rows with its ``dp_rank``. ``member`` numbers the peers inside one
    DP rank (tensor/pipeline-parallel ranks that must see identical rows; see
    ``SupportsRankReplay``).
    """

    partition: str
    task: str
    batch_size: int
    final: bool = False
    current_version: Version | None = None
    dp_rank: int = 0
    dp_size: int = 1
    member: int = 0


@dataclass(frozen=True, slots=True)
class Selection:
    """A sampler's answer. ``rows``: rows to lease to the consumer, a duplicate-free subset of
    the candidates (may be empty: "wait for more"). ``dropped``: candidates to mark consumed for
    this task *without* delivering them (e.g. too stale), counted in the store's stats; disjoint
    from ``rows``. The store leases ``rows`` in the order given. ``micro_batches``: optional
    partition of ``rows`` into parts (e.g. one per DP rank, token-balanced; a part may be empty
    when there are fewer rows than parts). ``held``: how many candidates the policy held back
    (reported by ``stats().held`` as the latest value, not a running total). Row ids may be
    any ints (numpy ints included)."""

    rows: tuple[int, ...] = ()
    dropped: tuple[int, ...] = ()
    micro_batches: tuple[tuple[int, ...], ...] | None = None
    held: int = 0


@dataclass(frozen=True, slots=True)
class BatchMeta:
    """Control-plane answer of ``get_meta``: which rows were leased, not their values.

    ``end_of_stream`` is True (and ``rows`` empty) once the partition is closed and every row
    has been consumed by the task. ``lease_id`` identifies the lease to ``ack``/``nack``;
    ``deadline`` is the lease's end on the store's clock (seconds, monotonic).
    """

    partition: str
    task: str
    rows: tuple[int, ...]
    fields: tuple[str, ...]
    tags: tuple[Tags, ...] = ()
    lease_id: str | None = None
    deadline: float = math.inf
    micro_batches: tuple[tuple[int, ...], ...] | None = None
    member: int = 0
    end_of_stream: bool = False

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def tokens(self) -> int:
        return sum(t.tokens for t in self.tags)

    def split(self) -> list[BatchMeta]:
        """One meta per micro-batch (same lease), in order; ``[self]`` if there are none."""
        if not self.micro_batches:
            return [self]
        position = {row: i for i, row in enumerate(self.rows)}
        parts = []
        for mb in self.micro_batches:
            tags = tuple(self.tags[position[r]] for r in mb) if self.tags else ()
            parts.append(
                BatchMeta(
                    self.partition,
                    self.task,
                    mb,
                    self.fields,
                    tags,
                    self.lease_id,
                    self.deadline,
                    None,
                    self.member,
                    False,
                )
            )
        return parts


@dataclass(slots=True)
class Batch:
    """Data-plane answer of ``get_data``. ``data[field]`` is, for a tensor field, a padded tensor
    ``[B, max_len, ...]`` (layout "padded"; ``lengths[field]`` holds each row's dim-0 size), a
    ``torch.nested`` jagged tensor (layout "nested"), or a list of per-row tensors (layout
    "list": the store's own objects — treat them as read-only); for a plain field, a list.
    Rows whose tensors are 0-dim are stacked into ``[B]`` in every layout but "list"."""

    rows: tuple[int, ...]
    data: dict[str, Any]
    lengths: dict[str, torch.Tensor] = field(default_factory=dict)
    tags: tuple[Tags, ...] = ()

    def __getitem__(self, name: str) -> Any:
        return self.data[name]

    def __contains__(self, name: object) -> bool:
        return name in self.data

    def __len__(self) -> int:
        return len(self.rows)

    def slice(self, start: int, stop: int) -> Batch:
        """Rows ``start:stop`` of every field, length, row id and tag: a micro-batch (views,
        no copies, except for a ``torch.nested`` field, rebuilt from its rows). Raises
        ``ValueError`` naming a field that does not hold one value per row. A batch built
        without row ids (``rows=()``) counts its rows from its first field."""
        b = len(self.rows)
        if not b:
            first = next(iter(self.lengths.values()), None)
            if first is None:
                first = next(iter(self.data.values()), None)
            b = len(first) if first is not None and hasattr(first, "__len__") else 0
        data: dict[str, Any] = {}
        for name, value in self.data.items():
            if isinstance(value, torch.Tensor) and value.is_nested:
                parts = list(value.unbind())
                if len(parts) != b:
                    raise ValueError(f"field {name!r} has {len(parts)} rows, not {b}")
                data[name] = torch.nested.nested_tensor(parts[start:stop], layout=torch.jagged)
            elif (isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == b) or (
                isinstance(value, list | tuple) and len(value) == b
            ):
                data[name] = value[start:stop]
            else:
                raise ValueError(
                    f"cannot split field {name!r} ({type(value).__name__} "
                    f"{tuple(getattr(value, 'shape', ())) or ''}) into micro-batches: give one "
                    f"value per row ({b} rows)"
                )
        lengths: dict[str, torch.Tensor] = {}
        for name, value in self.lengths.items():
            if value.shape[0] != b:
                raise ValueError(f"lengths[{name!r}] has {value.shape[0]} rows, not {b}")
            lengths[name] = value[start:stop]
        tags = self.tags[start:stop] if len(self.tags) == b else self.tags
        row_ids = self.rows[start:stop] if len(self.rows) == b else self.rows
        return Batch(row_ids, data, lengths, tags)


@dataclass(frozen=True, slots=True)
class PartitionStats:
    """Counters of one partition, for tests, progress bars and traces."""

    name: str
    fields: tuple[str, ...]
    tasks: tuple[str, ...]
    closed: bool
    rows_created: int
    rows_live: int
    bytes_live: int
    ready: Mapping[str, int]
    consumed: Mapping[str, int]
    dropped: Mapping[str, int]
    held: Mapping[str, int]
    leased: Mapping[str, int]
    reclaimed: int
    capacity: Capacity


DEFAULT_GET_TIMEOUT_S = 600.0
"""Default wait of ``get_meta``: long enough for a slow rollout step, never a 1 s trap."""

DEFAULT_LEASE_S = 1800.0
"""Default lease: a consumer that neither acks nor nacks loses its rows after 30 min."""


# --------------------------------------------------------------------------------------------
# Protocols: data
# --------------------------------------------------------------------------------------------
@runtime_checkable
class Scheduler(Protocol):
    """A sampling policy: pure, synchronous, no I/O. Given the candidates (rows whose requested
    fields are all ready, that the task has neither consumed nor leased) and a request, choose
    rows. Must return a subset of the candidates; the store rejects anything else with
    ``SamplerError`` and changes nothing. Returning no rows means "wait for more"."""

    def select(self, candidates: Candidates, request: SampleRequest) -> Selection: ...


@runtime_checkable
class SupportsRankReplay(Protocol):
    """A sampler whose batches go to ``members_per_rank`` peers of one DP rank (tensor or
    pipeline parallel ranks). The store hands the batch chosen for the first peer that asks to
    every other peer of that DP rank (``SampleRequest.member``) under the same lease."""

    members_per_rank: int


@runtime_checkable
class DataStore(Protocol):
    """A set of partitions, each a table: rows (samples, indices 0, 1, ... per partition) by
    declared fields. A cell is a tensor (rows may differ in dim 0: ragged, never padded in
    storage) or a plain value. Readiness is per (row, field). Each registered task consumes each
    row exactly once: ``get_meta`` leases rows, ``ack`` commits, ``nack`` or lease expiry hands
    them back. Rows consumed by every registered task are reclaimed. Every rejected call raises
    an ``AsyncFlowError`` subclass and leaves the store exactly as it was.
    """

    async def create_partition(
        self,
        name: str,
        fields: Sequence[str],
        *,
        capacity: Capacity | None = None,
        tasks: Sequence[str] = (),
    ) -> None:
        """Create an empty partition with these field names and consumer ``tasks`` (more can be
        registered later). ``PartitionExistsError`` if the name is taken."""

    async def register_task(self, partition: str, task: str) -> None:
        """Declare a consumer task (idempotent). Reclamation waits for every registered task."""

    async def put(
        self,
        partition: str,
        data: Mapping[str, Sequence[CellValue] | torch.Tensor],
        *,
        rows: Sequence[int] | None = None,
        tags: Sequence[Tags] | None = None,
        overwrite: bool = False,
        timeout: float | None = DEFAULT_GET_TIMEOUT_S,
    ) -> tuple[int, ...]:
        """Write cells and return the rows written.

        ``data`` maps field -> one value per row (a list, or a tensor whose dim 0 is the row).
        ``rows=None`` creates new rows (waiting for capacity up to ``timeout``, ``None`` =
        without a limit; then ``StoreTimeoutError``); otherwise writes into existing rows. A
        cell already ready (or being written) needs ``overwrite=True``; an overwrite replaces
        the value atomically, so a concurrent reader sees the old or the new value, never a
        mix. ``tags`` (one per row) are merged into the rows' tags. New rows after ``close``
        raise ``PartitionClosedError``.
        """
        ...

    async def get_meta(
        self,
        partition: str,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        *,
        sampler: Scheduler | None = None,
        timeout: float | None = DEFAULT_GET_TIMEOUT_S,
        lease_s: float = DEFAULT_LEASE_S,
        current_version: Version | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
        member: int = 0,
        ack: BatchMeta | None = None,
    ) -> BatchMeta:
        """Wait until ``sampler`` (default: sequential) selects rows among the candidates, lease
        them to ``task`` for ``lease_s`` seconds and return their metadata. After ``close``,
        once rows stop arriving, the sampler may return a short final batch; when the task has
        consumed every row, returns ``end_of_stream``. Raises ``StoreTimeoutError`` after
        ``timeout`` seconds (``None`` = wait forever) without leasing anything; rows the
        sampler dropped meanwhile (``Selection.dropped``) stay dropped.

        ``ack``: a meta to commit first, exactly as ``ack(ack)`` would, in the same call (a
        consumer folds the ack of its last batch into its next lease: one round trip less on
        a remote store). Every argument is checked before the ack: a rejected call commits
        nothing. If the ack fails, its error (``LeaseExpiredError``, ``LeaseError``) is raised
        and nothing is leased. Once the call has started, the ack is committed whatever the
        lease does next (a ``StoreTimeoutError``, a cancellation: a remote store may finish
        committing it just after the cancellation). A store written before this parameter
        lacks it: ``asyncflow_core.data.store.get_meta_after_ack`` uses it where it exists and
        falls back to ``ack`` then ``get_meta``."""
        ...

    async def get_data(
        self,
        meta: BatchMeta,
        fields: Sequence[str] | None = None,
        *,
        layout: Layout = "padded",
        pad_value: float = 0,
        out: Batch | None = None,
    ) -> Batch:
        """Read ``fields`` (default: ``meta.fields``) of ``meta.rows`` from storage. The fields
        must be ready for those rows and the rows not reclaimed.

        ``out``: a ``Batch`` an earlier ``get_data`` returned, whose tensor buffers the new batch
        may reuse (a training loop passes last step's batch, so steady-state reads allocate
        nothing). The caller must be done with ``out``: its tensors may be overwritten. A store
        may ignore ``out``; the answer is the same either way."""
        ...

    async def ack(self, meta: BatchMeta) -> None:
        """Commit the lease: its rows count as consumed by ``meta.task``, never delivered to it
        again. ``LeaseExpiredError`` if the deadline passed (the rows were handed back),
        ``LeaseError`` if the lease is unknown or already ended."""

    async def nack(self, meta: BatchMeta) -> None:
        """Give the lease's rows back for redelivery to ``meta.task``."""

    async def close(self, partition: str) -> None:
        """No new rows from now on; waiting consumers get a final short batch, then the end."""

    async def delete_partition(self, partition: str) -> None:
        """Drop a partition and all its data (metadata first marked, storage freed, then gone)."""

    async def stats(self, partition: str) -> PartitionStats: ...


# --------------------------------------------------------------------------------------------
# Generation types and InferenceEngine
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling knobs shared by every engine (names as in vLLM). ``top_k=0`` and ``top_p=1``
    disable those filters; ``temperature=0`` is greedy; ``seed=None`` draws from the engine's
    generator. The distribution they define (temperature, then top-k, then top-p on the
    renormalised top-k distribution) is spelled out, in code, by
    ``asyncflow_core.training.sampling.filter_logits``. An engine honours every knob or rejects the
    request; it never ignores one."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """Token-in generation. ``resume_tokens``/``resume_logprobs``/``resume_versions`` carry what
    an earlier, aborted attempt already generated (partial rollout): the engine continues after
    them and the result includes them, with their original versions."""

    request_id: str
    prompt_tokens: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    group: int | str | None = None
    resume_tokens: tuple[int, ...] = ()
    resume_logprobs: tuple[float, ...] = ()
    resume_versions: tuple[Version, ...] = ()


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """``tokens``: generated ids (prompt excluded); ``logprobs[i]``: log-prob of ``tokens[i]``
    under the distribution it was sampled from — the weights that sampled it, after the
    request's temperature and top-k/top-p, renormalised (greedy: temperature 1, no filters;
    ``asyncflow_core.training.sampling``), the quantity ``TrainEngine.compute_logprobs`` recomputes;
    ``versions[i]``: that weight version. All three have equal length. ``finish_reason`` is
    ``stop`` (a stop token, included), ``length`` (``max_tokens`` reached) or ``abort``
    (partial)."""

    request_id: str
    prompt_tokens: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[Version, ...]
    finish_reason: FinishReason


@runtime_checkable
class InferenceEngine(Protocol):
    """Generates tokens. After weights of version v are loaded, every token it samples reports
    version >= v. ``abort`` ends the named requests; their ``generate`` calls return what was
    generated so far with ``finish_reason="abort"``. A request is in flight from the moment
    its ``generate`` coroutine first yields (register its id before the first ``await``), so
    an ``abort`` issued right after the call is never lost."""

    @property
    def weight_version(self) -> Version: ...

    async def generate(self, request: GenerationRequest) -> GenerationResult: ...

    async def abort(self, request_ids: Sequence[str]) -> None: ...


@runtime_checkable
class SupportsPause(Protocol):
    """``pause(mode="abort")`` aborts in-flight requests; ``mode="keep"`` freezes them until
    ``resume``. New requests wait while paused."""

    async def pause(self, mode: Literal["abort", "keep"] = "abort") -> None: ...

    async def resume(self) -> None: ...


@runtime_checkable
class SupportsProgress(Protocol):
    """Evidence that a request is generating, instead of a guess from the clock.
    ``wait_for_tokens(request_id, count)`` returns once the request has at least ``count``
    response tokens (resumed ones included) or has ended, with its count then; an
    ``EngineError`` if the id is not in flight. An engine that can holds the request's next
    step until the waiter has run, so an ``abort``/``pause``/``load_weights`` called at once
    applies at exactly that count (``TorchInferenceEngine`` does); otherwise the request may
    run on a little. The conformance laws use it to act on requests known to be in flight."""

    async def wait_for_tokens(self, request_id: str, count: int) -> int: ...


@runtime_checkable
class SupportsRestart(Protocol):
    """An engine that can come back after it was lost (``EngineLostError``), e.g. a Ray
    actor created with ``max_restarts``. ``lost`` is True from the loss until ``restart()``
    returns; meanwhile every call raises ``EngineLostError``. ``restart()`` waits for the
    worker to come back and builds a fresh engine there: its weights and version are the
    factory's, not the lost engine's, so load the current weights before routing requests to
    it (the RL job does). It raises ``EngineLostError`` when the engine cannot come back (its
    restarts are spent, or it did not start in time)."""

    @property
    def lost(self) -> bool: ...

    async def restart(self) -> None: ...


@runtime_checkable
class SupportsSleep(Protocol):
    """Release accelerator memory (weights and/or KV cache) and take it back."""

    async def sleep(self, level: int = 1) -> None: ...

    async def wake_up(self) -> None: ...


@runtime_checkable
class SupportsLoadWeights(Protocol):
    """Load named full tensors directly and set the weight version (the in-process transport)."""

    async def load_weights(
        self, weights: Sequence[tuple[str, torch.Tensor]], version: Version
    ) -> None: ...


def inflight_load_refusal(engine: object) -> str | None:
    """Why ``engine`` cannot take new weights while it generates (``RLConfig.weight_sync=
    "inflight"``), or None when it can or does not say. An engine that cannot sets a class
    attribute ``inflight_weight_load_refusal: str`` naming the upstream reason; the RL job
    then refuses ``"inflight"`` for it before anything runs."""
    reason = getattr(engine, "inflight_weight_load_refusal", None)
    return reason if isinstance(reason, str) and reason else None


def tensor_load_refusal(engine: object) -> str | None:
    """Why ``engine``'s ``load_weights`` cannot take tensors (only a version bump), or None
    when it can or does not say: e.g. an HTTP client of a server whose routes carry no tensors.
    Such an engine sets ``tensor_load_refusal: str | None`` (a property where it depends on
    the server it reached); the RL job then refuses, before anything runs, a weight sync that
    would hand it tensors (the default staged and blocking ones), naming one that works."""
    reason = getattr(engine, "tensor_load_refusal", None)
    return reason if isinstance(reason, str) and reason else None


def unavailable_ability(engine: object, ability: str) -> str | None:
    """Why ``engine`` cannot use ``ability`` (a ``Supports*`` protocol's name, or
    ``GroupReceiver``) although it has the methods, or None. The platform or the way an engine
    was started may take an ability away (vLLM on a CPU cannot sleep); such an engine lists
    them in ``unavailable_abilities: Mapping[str, str]`` (name -> reason), its calls of them
    raise an error with the reason, and the conformance suites skip their laws with it."""
    declared = getattr(engine, "unavailable_abilities", None)
    if not isinstance(declared, Mapping):
        return None
    reason = declared.get(ability)
    return reason if isinstance(reason, str) and reason else None


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WeightBucket:
    """A group of full (gathered) tensors, in the inference side's parameter names.

    ``snapshot``: the tensors are a copy made for this sync that nobody changes afterwards
    (``bucketize(..., pack=True)`` makes such buckets): a transport may then still be sending
    them after ``update`` returns. False (the default): they may be the trainer's live
    parameters, and ``update`` returns only once the transport is done reading them."""

    names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    snapshot: bool = False

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(zip(self.names, self.tensors, strict=True))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled with its shared memory once: tensors that view one storage (a packed
        bucket's) would each carry the whole storage under the standard pickler (a bucket of
        20 tensors: 20 copies), e.g. between a trainer process and the job."""
        tensors = self.tensors
        if len(tensors) > 1 and all(type(t) is torch.Tensor for t in tensors):
            first = tensors[0]
            ptr = first.untyped_storage().data_ptr()
            if ptr and all(
                t.device == first.device and t.untyped_storage().data_ptr() == ptr for t in tensors
            ):
                base = torch.empty(0, dtype=torch.uint8, device=first.device)
                base.set_(first.untyped_storage())
                views = tuple(
                    (t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())
                    for t in tensors
                )
                return (_bucket_over, (self.names, base, views, self.snapshot))
        return (WeightBucket, (self.names, self.tensors, self.snapshot))


def _bucket_over(
    names: tuple[str, ...],
    base: torch.Tensor,
    views: tuple[tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int], ...],
    snapshot: bool,
) -> WeightBucket:
    """``WeightBucket.__reduce__``'s inverse: the tensors as views of one unpickled storage."""
    storage = base.untyped_storage()
    tensors = tuple(
        torch.empty(0, dtype=dtype, device=base.device).set_(storage, offset, shape, stride)
        for dtype, shape, stride, offset in views
    )
    return WeightBucket(names, tensors, snapshot)


@dataclass(frozen=True, slots=True)
class TrainMetrics:
    """What one optimizer step reports. ``version`` is the weight version after the step."""

    version: Version
    loss: float
    grad_norm: float
    samples: int
    tokens: int
    extra: Mapping[str, float] = field(default_factory=dict)


class LossFn(Protocol):
    """``loss_fn(logprobs, batch) -> (loss, metrics)``: ``logprobs`` are the current policy's
    per-token log-probs ``[B, T]`` for ``batch``'s response tokens."""

    def __call__(
        self, logprobs: torch.Tensor, batch: Batch
    ) -> tuple[torch.Tensor, Mapping[str, float]]: ...


@runtime_checkable
class TrainEngine(Protocol):
    """Trains the policy. ``compute_logprobs(batch)`` returns ``[B, T]``: the log-prob of each
    response token under its row's sampling distribution (the batch's ``temperature``,
    ``top_k``, ``top_p`` fields, ``asyncflow_core.training.sampling``; without them the trainer's
    default temperature and no filters), i.e. what the inference engine reported for it under
    the same weights; ``train_step`` hands the loss the same quantity, with gradients.
    ``train_step`` is one optimizer step over ``batch`` (split into micro-batches, gradients
    accumulated) and adds 1 to ``weight_version``. ``export_weights`` yields every parameter
    once, full, in buckets of at most ``bucket_bytes`` (a tensor bigger than that is a bucket
    of its own); tied parameters are one parameter, exported once under the name the
    inference side loads. ``load_checkpoint`` restores weights, optimizer state and version:
    a step after it is the step that would have followed ``save_checkpoint``.

    ``compute_logprobs`` and ``train_step`` must not keep ``batch`` once they return: ``RLJob``
    reads the next step's batch into its memory (a tensor of it still referenced, or a view
    of one, is never overwritten; the ``Batch`` object itself is not checked)."""

    @property
    def weight_version(self) -> Version: ...

    async def compute_logprobs(self, batch: Batch) -> torch.Tensor: ...

    async def train_step(self, batch: Batch, loss_fn: LossFn) -> TrainMetrics: ...

    def export_weights(self, bucket_bytes: int) -> AsyncIterator[WeightBucket]: ...

    async def save_checkpoint(self, path: str) -> None: ...

    async def load_checkpoint(self, path: str) -> None: ...


# --------------------------------------------------------------------------------------------
# Weight sync (shaped like vLLM's 2026 API: init -> start -> update x N -> finish(version))
# --------------------------------------------------------------------------------------------
@runtime_checkable
class WeightSync(Protocol):
    """Moves weights from a TrainEngine to InferenceEngines. Phases must run in order:
    ``init`` once, then per sync ``start``, ``update`` once per bucket, ``finish(version)``.
    After ``finish(v)`` returns, every target engine's ``weight_version`` is ``v`` and new
    tokens report ``>= v``. Out-of-order calls raise ``WeightSyncError``."""

    async def init(self) -> None: ...

    async def start(self) -> None: ...

    async def update(self, bucket: WeightBucket) -> None: ...

    async def finish(self, version: Version) -> None: ...
