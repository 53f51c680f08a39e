"""Samplers with TransferQueue's calling convention: ``sampler(ready_indexes, batch_size,
partition=..., **sampling_config)`` returns ``(sampled, consumed)`` global indexes. A sampler
written for ``transfer_queue`` (a ``BaseSampler`` subclass) works here unchanged, as long as it
does not read the ``partition`` object (here a ``PartitionView``, not theirs)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

__all__ = ["BaseSampler", "GRPOGroupNSampler", "RankAwareSampler", "SequentialSampler"]


class BaseSampler(ABC):
    """Chooses, among the ready and not yet consumed samples of a task, the batch to hand out
    (``sampled``) and the samples to mark consumed (``consumed``; usually the same)."""

    def __init__(self) -> None:
        # partition -> task -> dp_rank -> batch_index -> (sampled, consumed): lets the ranks of
        # one data-parallel group receive the same batch.
        self._states: dict[Any, Any] = {}

    @abstractmethod
    def sample(
        self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]: ...

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[list[int], list[int]]:
        return self.sample(*args, **kwargs)

    def has_cached_result(
        self, partition_id: str, task_name: str, sampling_config: dict[str, Any] | None = None
    ) -> bool:
        cfg = sampling_config or {}
        dp_rank = cfg.get("dp_rank")
        if dp_rank is None:
            return False
        states = self._states.get(partition_id, {}).get(task_name, {})
        return dp_rank in states and cfg.get("batch_index") in states[dp_rank]

    def clear_cache(self, partition_id: str) -> None:
        self._states.pop(partition_id, None)

    def save_checkpoint(self) -> dict[str, Any]:
        return {"_states": self._states}

    def load_checkpoint(self, state: dict[str, Any]) -> None:
        self._states = state["_states"]


class SequentialSampler(BaseSampler):
    """The first ``batch_size`` ready samples, by global index (the default)."""

    def sample(
        self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        chosen = list(ready_indexes[:batch_size])
        return chosen, list(chosen)


class GRPOGroupNSampler(BaseSampler):
    """Whole groups only: runs of ``n_samples_per_prompt`` consecutive global indexes, all
    ready, scanning from the lowest; nothing until ``batch_size / n`` such runs exist. With a
    ``dp_rank`` (and ``batch_index``) in the sampling config, the answer is cached so every
    rank asking with the same pair gets the same batch."""

    def __init__(self, n_samples_per_prompt: int = 1) -> None:
        super().__init__()
        if (
            isinstance(n_samples_per_prompt, bool)
            or not isinstance(n_samples_per_prompt, int)
            or n_samples_per_prompt <= 0
        ):
            raise ValueError(
                f"n_samples_per_prompt must be a positive int, got {n_samples_per_prompt!r}"
            )
        self.n_samples_per_prompt = n_samples_per_prompt

    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        task_name: str = "",
        partition_id: str = "",
        *args: Any,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        n = self.n_samples_per_prompt
        states = self._states.get(partition_id, {}).get(task_name, {})
        dp_rank = kwargs.get("dp_rank")
        batch_index = kwargs.get("batch_index")
        if dp_rank in states and batch_index in states[dp_rank]:
            cached: tuple[list[int], list[int]] = states[dp_rank][batch_index]
            return cached
        if batch_size % n:
            raise ValueError(
                f"batch_size ({batch_size}) must be a multiple of n_samples_per_prompt ({n})"
            )
        wanted = batch_size // n
        ready = sorted(ready_indexes)
        chosen: list[int] = []
        i = found = 0
        while found < wanted and i + n <= len(ready):
            run = ready[i : i + n]
            if run[-1] - run[0] == n - 1:  # sorted and distinct: consecutive iff span is n-1
                chosen.extend(run)
                found += 1
                i += n
            else:
                i += 1
        if found < wanted:
            return [], []
        if dp_rank is not None:
            states.setdefault(dp_rank, {}).setdefault(batch_index, (chosen, list(chosen)))
            self._states.setdefault(partition_id, {})[task_name] = states
        return chosen, list(chosen)


class RankAwareSampler(BaseSampler):
    """Every rank of one data-parallel group gets the same batch: the first rank to ask for a
    ``batch_index`` takes the first ``batch_size`` ready samples (nothing if fewer are ready)
    and the answer is kept for the group's other ranks. Pass ``dp_rank``, ``batch_index``,
    ``task_name`` and ``partition_id`` in ``sampling_config``."""

    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        dp_rank: int = 0,
        batch_index: int = 0,
        task_name: str = "",
        partition_id: str = "",
        *args: Any,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0:
            raise ValueError(f"dp_rank must be an int >= 0, got {dp_rank!r}")
        cache = (
            self._states.setdefault(partition_id, {})
            .setdefault(task_name, {})
            .setdefault(dp_rank, {})
        )
        if batch_index in cache:
            kept: list[int] = cache[batch_index]
            return kept, list(kept)
        chosen = list(ready_indexes[:batch_size])
        if len(chosen) < batch_size:
            return [], []
        cache[batch_index] = chosen
        return chosen, list(chosen)
