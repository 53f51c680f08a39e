"""Staleness-bounded admission control (AReaL-style): rollout may run ahead of training by at
most η weight versions, enforced when work is admitted rather than by discarding samples.

With ``batch_size`` samples per optimizer step, the trainer at version ``v`` and ``v0`` the
version it was at when counting began (``start_version``: 0 for a fresh trainer, more after a
warm-up or a checkpoint; ``v − v0`` optimizer steps done since), ``n`` more samples are
admitted only while

    accepted + running + n <= (v − v0 + η + 1) × batch_size      (and running + n <= max_running)

where ``accepted`` counts samples that finished generating and ``running`` those in flight,
both since counting began: that is why the bound counts steps from ``v0`` rather than from
version 0 (a trainer at version 100 would otherwise let rollout run 100 steps ahead).
η = 0 is on-policy (generation waits for every step), η = 1 one-step-off, larger fully async.

What this bounds, exactly: sample number ``i`` (0-based, in admission order) is admitted at a
version ``>= v0 + i // batch_size - η``, so if samples are trained in admission order, no trained
sample is more than η versions stale. A sample that finishes late (long-tailed lengths) can be
trained in a later batch than its number says; to make "staleness <= η" hold for every trained
sample, pair this with ``StalenessSampler(max_lag=η)`` at the trainer (hold or drop), or with
partial rollout (resume late samples on new weights).

verl's fully-async knobs map onto this: ``staleness_threshold`` s with
``trigger_parameter_sync_step`` k lets the rollouter produce ``(1 + s)·k`` batches per sync,
i.e. η ≈ s·k with sync_every = k.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

from asyncflow_core.contracts.errors import BadRequestError, StoreTimeoutError
from asyncflow_core.contracts.protocols import Version
from asyncflow_core.data.notify import Waiters


@dataclass(frozen=True, slots=True)
class AdmissionStats:
    version: Version
    accepted: int
    running: int
    cancelled: int
    capacity: int


class AdmissionController:
    """Counts samples through admission (``admit``), completion (``finish``) or cancellation
    (``cancel``, e.g. an aborted request that will not produce a sample), and the trainer's
    progress (``set_version``, absolute versions from ``start_version`` on). ``admit`` waits
    for capacity. Safe to call from several event loops and threads."""

    def __init__(
        self,
        batch_size: int,
        staleness: int,
        max_running: int | None = None,
        *,
        start_version: Version = 0,
    ) -> None:
        for name, value in (
            ("batch_size", batch_size),
            ("staleness", staleness),
            ("start_version", start_version),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise BadRequestError(f"{name} must be an int, got {value!r}")
        if start_version < 0:
            raise BadRequestError(
                f"start_version must be >= 0 (the trainer's weight_version when counting "
                f"begins), got {start_version}"
            )
        if batch_size < 1:
            raise BadRequestError(f"batch_size must be >= 1, got {batch_size}")
        if staleness < 0:
            raise BadRequestError(
                f"staleness (η) must be >= 0 (0 = on-policy, 1 = one-step-off), got {staleness}"
            )
        if max_running is not None and max_running < 1:
            raise BadRequestError(f"max_running must be >= 1 or None, got {max_running}")
        self.batch_size = batch_size
        self.staleness = staleness
        self.max_running = max_running
        self._lock = threading.Lock()
        self.start_version = start_version
        self._version = start_version
        self._accepted = 0
        self._running = 0
        self._cancelled = 0
        self._waiters = Waiters()

    # -- the rule ------------------------------------------------------------------------------
    def _capacity(self) -> int:
        steps = self._version - self.start_version
        cap = (steps + self.staleness + 1) * self.batch_size - (self._accepted + self._running)
        if self.max_running is not None:
            cap = min(cap, self.max_running - self._running)
        return cap

    def capacity(self) -> int:
        """How many more samples may be admitted now (may be <= 0)."""
        with self._lock:
            return self._capacity()

    def try_admit(self, n: int = 1) -> Version | None:
        """Admit ``n`` samples now if the bound allows, returning the trainer version they are
        admitted under; None if they must wait."""
        self._check_n(n)
        with self._lock:
            if self._capacity() < n:
                return None
            self._running += n
            return self._version

    async def admit(self, n: int = 1, timeout: float | None = None) -> Version:
        """Wait until ``n`` samples fit the bound, admit them, and return the trainer version
        at admission. ``StoreTimeoutError`` after ``timeout`` seconds, admitting nothing."""
        self._check_n(n)
        if self.max_running is not None and n > self.max_running:
            raise BadRequestError(
                f"cannot admit {n} samples at once with max_running={self.max_running}"
            )
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            with self._waiters.arm() as waiter:
                with self._lock:
                    if self._capacity() >= n:
                        self._running += n
                        return self._version
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    raise StoreTimeoutError(
                        f"admission of {n} samples waited {timeout} s: the trainer is at version "
                        f"{self._version}, η={self.staleness}, batch_size={self.batch_size}, "
                        f"{self._accepted} accepted + {self._running} running; generation is "
                        "ahead by the staleness bound until the trainer steps"
                    )
                await waiter.wait(remaining)

    def finish(self, n: int = 1) -> None:
        """``n`` admitted samples finished generating (they now count as accepted)."""
        self._check_n(n)
        with self._lock:
            self._take_running(n)
            self._accepted += n
        self._wake()

    def cancel(self, n: int = 1) -> None:
        """``n`` admitted samples will never finish (aborted, dropped): free their slots."""
        self._check_n(n)
        with self._lock:
            self._take_running(n)
            self._cancelled += n
        self._wake()

    def discard(self, n: int = 1) -> None:
        """``n`` accepted samples will never be trained (e.g. dropped as too stale): give their
        slots back, so dropping cannot starve generation."""
        self._check_n(n)
        with self._lock:
            if n > self._accepted:
                raise BadRequestError(
                    f"{n} samples discarded but only {self._accepted} were accepted"
                )
            self._accepted -= n
            self._cancelled += n
        self._wake()

    def set_version(self, version: Version) -> None:
        """The trainer reached ``version`` (its absolute ``weight_version``); never goes
        backwards, nor below ``start_version``."""
        with self._lock:
            if version < self._version:
                raise BadRequestError(
                    f"trainer version went back from {self._version} to {version}"
                )
            self._version = version
        self._wake()

    def stats(self) -> AdmissionStats:
        with self._lock:
            return AdmissionStats(
                self._version, self._accepted, self._running, self._cancelled, self._capacity()
            )

    # -- plumbing ------------------------------------------------------------------------------
    def _check_n(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise BadRequestError(f"n must be an int >= 1, got {n!r}")

    def _take_running(self, n: int) -> None:
        if n > self._running:
            raise BadRequestError(
                f"{n} samples reported done but only {self._running} are running; report each "
                "admitted sample once, with finish() or cancel()"
            )
        self._running -= n

    def _wake(self) -> None:
        self._waiters.wake_all()
