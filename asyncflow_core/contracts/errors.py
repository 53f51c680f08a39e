"""The one error hierarchy of AsyncFlow: every error names the bad value and what to do."""

from __future__ import annotations

from collections.abc import Iterator


class AsyncFlowError(Exception):
    """Root of every error AsyncFlow raises on purpose."""


# --- data store -------------------------------------------------------------------------------
class DataStoreError(AsyncFlowError):
    """A DataStore call was rejected; the store is unchanged."""


class UnknownPartitionError(DataStoreError, KeyError):
    """The partition does not exist (never created, or already deleted)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class UnknownFieldError(DataStoreError, KeyError):
    """A field that the partition was not created with."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class UnknownTaskError(DataStoreError, KeyError):
    """A consumer task that was not registered on the partition."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class PartitionExistsError(DataStoreError):
    """`create_partition` with a name that is already in use."""


class SchemaError(DataStoreError, TypeError):
    """A value whose kind, dtype or ndim differs from the field's first write, or is unstorable."""


class BadRequestError(DataStoreError, ValueError):
    """A malformed argument: batch_size <= 0, mismatched lengths, negative timeout, ..."""


class CellAlreadyWrittenError(DataStoreError):
    """A ready (or being written) cell written again without ``overwrite=True``."""


class UnknownRowError(DataStoreError, KeyError):
    """Rows that were never allocated, or were already reclaimed."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class PartitionClosedError(DataStoreError):
    """New rows put into a partition after ``close``."""


class CapacityError(DataStoreError):
    """A put that can never fit the partition's capacity bound."""


class LeaseError(DataStoreError):
    """ack/nack of a lease the caller does not hold (unknown, already acked or nacked)."""


class LeaseExpiredError(LeaseError):
    """ack/nack of a lease whose deadline passed; its rows were handed back for redelivery."""


class SamplerError(DataStoreError):
    """A sampler (Scheduler) returned rows that were not among its candidates, or duplicates."""


class StoreTimeoutError(DataStoreError, TimeoutError):
    """A wait (get_meta for data, put for capacity) passed its timeout. Nothing was leased or
    written; rows the sampler chose to drop while it waited stay dropped (a policy decision,
    not part of the rejected call)."""


class StorageUnitError(DataStoreError):
    """A storage unit failed or lost rows; the message names the unit and rows."""


class StorageUnitLostError(StorageUnitError):
    """A storage unit is gone (its process or node died) and the rows it held with it.
    ``unit`` is its index, ``rows`` the rows of the failed call that lived on it."""

    def __init__(self, message: str, unit: int = -1, rows: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.unit = unit
        self.rows = rows

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.unit, self.rows))


class StoreLostError(DataStoreError):
    """The store's controller is gone (its process or node died): its metadata with it."""


# --- engines and sync ---------------------------------------------------------------------------
class EngineError(AsyncFlowError):
    """An inference or training engine rejected a call or failed."""


class EngineUnavailableError(EngineError, ConnectionError):
    """An engine behind a network endpoint could not be reached, or did not answer in time
    (connection refused or dropped, a timeout): the call may not have happened at all."""


class PeerRankError(EngineError):
    """A rank of a multi-rank engine gave up a call because *another* rank failed it (that
    rank's error says why); this rank changed nothing."""


class EngineLostError(EngineError):
    """The process, actor or node hosting an engine is gone (killed, crashed, out of memory):
    every call in flight on it failed and every later one fails. An RL job takes a lost
    *rollout* engine out of routing and weight sync and sends its requests to the others
    (from ``partial``, the tokens it had generated, where the engine could return them);
    a lost trainer stops the job."""

    def __init__(self, message: str, *, partial: object | None = None) -> None:
        super().__init__(message)
        self.partial = partial
        """A ``GenerationResult`` of what the lost engine had generated for the failed
        request, where its host could return it; None otherwise (the request starts over)."""


class CheckpointError(EngineError):
    """A checkpoint that cannot be loaded (missing or truncated files, another format, model,
    layout or version); the engine or job it was meant for is unchanged."""


class CheckpointRefusedError(CheckpointError):
    """A checkpoint whose manifest is missing, is not signed with this user's checkpoint key,
    or no longer matches its files: AsyncFlow did not write it (or it changed since), and its
    loader would unpickle it, which can run code. Nothing was read past the manifest; the
    message names the opt-in for a checkpoint you trust (SECURITY.md)."""


class WeightSyncError(AsyncFlowError):
    """A weight transfer was misused (wrong phase order, unknown parameter, shape mismatch)."""


class ConfigError(AsyncFlowError, ValueError):
    """A configuration key or value that does not exist / is out of range."""


class UnsupportedEngineError(EngineError, ConfigError):
    """An engine server reports a version the adapter does not follow (or none it can read):
    an engine's answer, and a configuration to change (point it at a supported server)."""


class EnvironmentFault(AsyncFlowError):
    """The machine, not the input or the code, stopped the work: a build left half done by a
    killed process, a resource the job cannot get past by itself. The message names what to
    fix; ``asyncflow run`` exits with status 3 for it (as for a folder it cannot write)."""


class MissingExtraError(AsyncFlowError, ImportError):
    """An optional engine library is not installed; the message names the extra."""


class PlatformError(ConfigError):
    """An unknown platform name, or a platform plugin that is broken or clashes with another."""


class PlatformUnavailableError(PlatformError, MissingExtraError):
    """A platform that was asked for by name cannot run here: its library is missing or does
    not load (``torch_npu`` without CANN, a CPU-only torch for ``cuda``) or no device is
    visible. The message says which, and what to install or set."""


# --- workflow -------------------------------------------------------------------------------
class PipelineError(AsyncFlowError):
    """A pipeline that cannot run as declared (checked before it starts), or that stopped."""


class TaskFailedError(PipelineError):
    """A task raised, which stopped the pipeline; ``task`` names it, ``__cause__`` is the error."""

    def __init__(self, task: str, message: str) -> None:
        super().__init__(message)
        self.task = task


def error_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then what it was raised from or while handling (``__cause__``, else
    ``__context__``), nearest first: where to look for the error underneath a wrapper."""
    seen: BaseException | None = exc
    while seen is not None:
        yield seen
        seen = seen.__cause__ or seen.__context__
