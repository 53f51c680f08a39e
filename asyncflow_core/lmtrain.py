"""Building blocks of a token-level LM ``TrainEngine``, shared by the reference trainer and the
engine adapters (DeepSpeed, ...) so that every trainer reads a ``Batch`` and weighs its
micro-batches the same way.

* ``token_rows(batch, who=..., vocab_size=..., max_seq_len=...)`` reads the ``prompt`` and
  ``response`` token fields of a batch in any store layout ("padded" with lengths, "list",
  "nested") into right-padded tensors plus lengths (``TokenRows``), checking every row.
* ``TokenRows.inputs()`` packs each row's prompt and response into one sequence and names the
  position whose logits predict each response token; ``TokenRows.logprobs(logits)`` turns the
  logits taken at those positions into per-token log-probs ``[B, R]`` under each row's
  sampling distribution (its ``temperature``/``top_k``/``top_p`` fields:
  ``asyncflow_core.sampling``), and counts the tokens it found off that distribution's
  support.
* ``check_loss`` validates what a ``LossFn`` returned; ``MetricMeans`` averages its metrics
  over micro-batches with the weights the gradients used.
* ``worker_thread`` is the single-thread executor a trainer runs its torch work on.

Every check raises ``EngineError`` naming the trainer (``who``), the field and what to do.
"""

from __future__ import annotations

import abc
import asyncio
import math
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from torch import Tensor

from asyncflow_core.errors import ConfigError, EngineError
from asyncflow_core.protocols import Batch, LossFn, TrainMetrics, WeightBucket
from asyncflow_core.sampling import row_sampling, sampled_logprobs

_T = TypeVar("_T")


def is_int(value: object) -> bool:
    """An int (numpy ints included), not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


# --------------------------------------------------------------------------------------------
# Threads
# --------------------------------------------------------------------------------------------
def worker_thread(name: str, threads: int | None, who: str) -> ThreadPoolExecutor:
    """A single-thread executor whose thread runs torch ops on ``threads`` intra-op threads.

    ``torch.set_num_threads`` acts on the calling thread (OpenMP/MKL settings are per thread)
    but also becomes the default of threads created later; the caller's value is restored as
    that default, so only the worker thread changes."""
    if threads is not None and (not is_int(threads) or not 1 <= threads <= 1024):
        raise ConfigError(f"{who}: threads must be None or an int in [1, 1024], got {threads!r}")
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
    if threads is not None:
        caller = torch.get_num_threads()
        executor.submit(_set_threads, int(threads)).result()
        torch.set_num_threads(caller)
    return executor


def _set_threads(threads: int) -> None:
    torch.get_num_threads()  # torch initialises a thread's setting lazily, from the default:
    torch.set_num_threads(threads)  # let that happen first, or it would undo this later


class ThreadedTrainer(abc.ABC):
    """The ``TrainEngine`` methods of a trainer whose work runs on one worker thread, one call
    at a time in call order: each checks its arguments on the caller's side and hands the work
    to ``_compute_logprobs(batch)``, ``_train_step(batch, loss_fn)``, ``_export(bucket_bytes)``
    (an async iterator of buckets), ``_save(path)`` / ``_load(path)``, which a subclass
    implements. A subclass sets ``name`` and ``_executor`` (``worker_thread``)."""

    name: str
    _executor: ThreadPoolExecutor

    async def compute_logprobs(self, batch: Batch) -> Tensor:
        return await self._run(self._compute_logprobs, batch)

    async def train_step(self, batch: Batch, loss_fn: LossFn) -> TrainMetrics:
        if not callable(loss_fn):
            raise EngineError(
                f"{self.name}: loss_fn must be callable (logprobs, batch) -> (loss, metrics), "
                f"got {loss_fn!r:.80}"
            )
        return await self._run(self._train_step, batch, loss_fn)

    def export_weights(self, bucket_bytes: int) -> AsyncIterator[WeightBucket]:
        if not is_int(bucket_bytes) or bucket_bytes <= 0:
            raise EngineError(f"{self.name}: bucket_bytes must be an int > 0, got {bucket_bytes!r}")
        return self._export(int(bucket_bytes))

    async def save_checkpoint(self, path: str) -> None:
        await self._run(self._save, Path(path))

    async def load_checkpoint(self, path: str) -> None:
        await self._run(self._load, Path(path))

    async def _run(self, fn: Callable[..., _T], *args: object) -> _T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, *args)

    # -- what a subclass implements (on the worker thread, except _export) -------------------
    @abc.abstractmethod
    def _compute_logprobs(self, batch: Batch) -> Tensor: ...

    @abc.abstractmethod
    def _train_step(self, batch: Batch, loss_fn: LossFn) -> TrainMetrics: ...

    @abc.abstractmethod
    def _export(self, bucket_bytes: int) -> AsyncIterator[WeightBucket]: ...

    @abc.abstractmethod
    def _save(self, path: Path) -> None: ...

    @abc.abstractmethod
    def _load(self, path: Path) -> None: ...


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------
def unique_named_tensors(module: torch.nn.Module) -> list[tuple[str, Tensor]]:
    """Every parameter and persistent buffer of ``module`` once, in ``state_dict`` order: a
    tied tensor (an LM head sharing the embedding) under its first name only
    (``model.embed_tokens.weight`` for Qwen2/Llama, the name vLLM and SGLang load it under;
    their loaders skip ``lm_head.weight`` when ``tie_word_embeddings`` is set)."""
    by_name: dict[str, Tensor] = dict(module.named_parameters(remove_duplicate=False))
    by_name.update(module.named_buffers(remove_duplicate=False))
    named: list[tuple[str, Tensor]] = []
    seen: set[int] = set()
    for n in module.state_dict(keep_vars=True):
        tensor = by_name.get(n)
        if tensor is not None and id(tensor) not in seen:
            seen.add(id(tensor))
            named.append((n, tensor))
    return named


# --------------------------------------------------------------------------------------------
# Token fields
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TokenRows:
    """A batch's prompt and response tokens, right-padded, with their lengths, and each row's
    sampling settings (``asyncflow_core.sampling``)."""

    prompt: Tensor  # [B, P] long
    plen: Tensor  # [B]
    response: Tensor  # [B, R] long
    rlen: Tensor  # [B]
    temperature: Tensor  # [B] float32
    top_k: Tensor  # [B] int64
    top_p: Tensor  # [B] float32

    def __len__(self) -> int:
        return int(self.prompt.shape[0])

    def part(self, start: int, stop: int) -> TokenRows:
        return TokenRows(
            self.prompt[start:stop],
            self.plen[start:stop],
            self.response[start:stop],
            self.rlen[start:stop],
            self.temperature[start:stop],
            self.top_k[start:stop],
            self.top_p[start:stop],
        )

    @property
    def response_tokens(self) -> int:
        return int(self.rlen.sum())

    @property
    def tokens(self) -> int:
        """Prompt plus response tokens."""
        return int(self.plen.sum()) + int(self.rlen.sum())

    def inputs(self) -> tuple[Tensor, Tensor]:
        """``(seq, source)``: ``seq [B, t]`` is each row's prompt followed by its response,
        right-padded with 0 to the longest row (``t = max(plen + rlen)``); ``source [B, R]``
        is, for response token ``k``, the position of ``seq`` whose next-token logits
        predict it (``plen - 1 + k``, clamped into the row for padding)."""
        b, r = self.response.shape
        total = self.plen + self.rlen
        t = int(total.max()) if b else 0
        j = torch.arange(t).unsqueeze(0)
        from_prompt = self.prompt.gather(1, j.clamp(max=self.prompt.shape[1] - 1).expand(b, t))
        from_response = self.response.gather(1, (j - self.plen.unsqueeze(1)).clamp(0, r - 1))
        seq = torch.where(j < self.plen.unsqueeze(1), from_prompt, from_response)
        seq = torch.where(j < total.unsqueeze(1), seq, torch.zeros_like(seq))
        k = torch.arange(r).unsqueeze(0)
        source = (self.plen.unsqueeze(1) - 1 + k).clamp(max=max(t - 1, 0))
        return seq, source

    def logprobs(self, logits: Tensor) -> tuple[Tensor, int]:
        """``([B, R] fp32 log-probs, off-support count)`` of the response tokens, from
        ``logits [B, R, V]`` taken at ``inputs()``'s source positions: each token's log-prob
        under its row's sampling distribution (``asyncflow_core.sampling.sampled_logprobs``:
        temperature, top-k, top-p, renormalised; a token off the support gets the documented
        floor and is counted), 0 beyond the row's length."""
        device = logits.device
        out, off = sampled_logprobs(
            logits,
            self.response.to(device),
            self.temperature.to(device).unsqueeze(1),
            self.top_k.to(device).unsqueeze(1),
            self.top_p.to(device).unsqueeze(1),
        )
        k = torch.arange(self.response.shape[1], device=device).unsqueeze(0)
        real = k < self.rlen.to(device).unsqueeze(1)
        return torch.where(real, out, torch.zeros_like(out)), int((off & real).sum())


def token_field(batch: Batch, name: str, who: str) -> tuple[Tensor, Tensor]:
    """``(padded [B, W] long, lengths [B] long)`` of token field ``name`` in any layout."""
    if name not in batch.data:
        raise EngineError(
            f"{who}: the batch has no {name!r} field (fields: {sorted(batch.data)}); "
            f"read {name!r} with get_data"
        )
    value = batch.data[name]
    if isinstance(value, Tensor) and value.is_nested:
        value = list(value.unbind())
    if isinstance(value, list | tuple):
        rows: list[Tensor] = []
        for i, t in enumerate(value):
            if not isinstance(t, Tensor) or t.dim() != 1 or t.is_floating_point():
                raise EngineError(
                    f"{who}: {name!r} row {i} must be a 1-D integer tensor of token ids, got "
                    f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}"
                )
            rows.append(t.long())
        lengths = torch.tensor([t.shape[0] for t in rows], dtype=torch.long)
        if not rows:
            return torch.zeros(0, 0, dtype=torch.long), lengths
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True), lengths
    if not isinstance(value, Tensor) or value.dim() != 2:
        raise EngineError(
            f"{who}: {name!r} must be a padded [B, T] tensor, a list of 1-D tensors or a "
            f"nested tensor, got {type(value).__name__} {tuple(getattr(value, 'shape', ()))}"
        )
    if value.is_floating_point() or value.dtype == torch.bool or value.is_complex():
        raise EngineError(f"{who}: {name!r} must hold integer token ids, got dtype {value.dtype}")
    b, w = value.shape
    given = batch.lengths.get(name)
    if given is None:
        lengths = torch.full((b,), w, dtype=torch.long)
    else:
        lengths = torch.as_tensor(given).reshape(-1).long()
        if lengths.shape[0] != b or bool(((lengths < 0) | (lengths > w)).any()):
            raise EngineError(
                f"{who}: lengths[{name!r}]={lengths.tolist()} do not fit a [{b}, {w}] tensor; "
                f"give one length in [0, {w}] per row"
            )
    return value.long(), lengths


def token_rows(
    batch: Batch,
    *,
    who: str,
    vocab_size: int | None,
    max_seq_len: int | None,
    temperature: float = 1.0,
) -> TokenRows:
    """The batch's ``prompt`` and ``response`` tokens, checked: one of each per row, every
    prompt at least one token, prompt + response at most ``max_seq_len`` and every real token
    in ``[0, vocab_size)`` (``None`` skips that check); and each row's sampling settings
    (``asyncflow_core.sampling.row_sampling``; ``temperature`` for a batch without the
    field)."""
    if not isinstance(batch, Batch):
        raise EngineError(f"{who}: expected a Batch, got {type(batch).__name__}")
    prompt, plen = token_field(batch, "prompt", who)
    response, rlen = token_field(batch, "response", who)
    b = prompt.shape[0]
    if response.shape[0] != b or (batch.rows and len(batch.rows) != b):
        raise EngineError(
            f"{who}: the batch has {len(batch.rows)} rows, {b} prompts and "
            f"{response.shape[0]} responses; give one of each per row"
        )
    if bool((plen < 1).any()):
        row = int((plen < 1).nonzero()[0, 0])
        raise EngineError(
            f"{who}: prompt of row {row} is empty; every prompt needs at least one token (the "
            "first response token is predicted from it)"
        )
    total = plen + rlen
    if max_seq_len is not None and bool((total > max_seq_len).any()):
        row = int((total > max_seq_len).nonzero()[0, 0])
        raise EngineError(
            f"{who}: row {row} has prompt + response = {int(total[row])} tokens > "
            f"max_seq_len={max_seq_len}; truncate it or use a longer model"
        )
    for name, tokens, lengths in (("prompt", prompt, plen), ("response", response, rlen)):
        real = torch.arange(tokens.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
        bad = real & (tokens < 0)
        if vocab_size is not None:
            bad |= real & (tokens >= vocab_size)
        if bool(bad.any()):
            row, col = (int(x) for x in bad.nonzero()[0])
            upper = vocab_size if vocab_size is not None else "vocab_size"
            raise EngineError(
                f"{who}: {name}[{row}, {col}]={int(tokens[row, col])} is not a token id; use "
                f"ints in [0, {upper})"
            )
    temp, top_k, top_p = row_sampling(batch, b, who=who, temperature=temperature)
    return TokenRows(prompt, plen, response, rlen, temp, top_k, top_p)


def slice_batch(who: str, batch: Batch, start: int, stop: int) -> Batch:
    """``batch.slice(start, stop)`` with its ``ValueError`` as an ``EngineError``."""
    try:
        return batch.slice(start, stop)
    except ValueError as exc:
        raise EngineError(f"{who}: {exc}") from exc


# --------------------------------------------------------------------------------------------
# Losses and metrics
# --------------------------------------------------------------------------------------------
def check_loss(who: str, result: object) -> tuple[Tensor, Mapping[str, float]]:
    """``(loss, metrics)`` from a ``LossFn``'s return value: a finite scalar tensor with a
    gradient, and a mapping. Anything else raises ``EngineError`` saying what was wrong."""
    if not isinstance(result, tuple) or len(result) != 2:
        raise EngineError(f"{who}: loss_fn must return (loss, metrics), got {result!r:.80}")
    loss, metrics = result
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise EngineError(f"{who}: loss_fn's loss must be a scalar tensor, got {loss!r:.80}")
    if not loss.requires_grad:
        raise EngineError(
            f"{who}: loss_fn's loss does not depend on the log-probs (no gradient); build it "
            "from the logprobs argument"
        )
    if not math.isfinite(float(loss.detach())):
        raise EngineError(
            f"{who}: loss_fn returned a non-finite loss ({float(loss.detach())}); the step "
            "was skipped and nothing changed"
        )
    if not isinstance(metrics, Mapping):
        raise EngineError(
            f"{who}: loss_fn's metrics must be a mapping of floats, got {type(metrics).__name__}"
        )
    return loss.reshape(()), metrics


class MetricMeans:
    """Weighted means of a loss function's metrics over micro-batches (a metric a micro-batch
    did not report is averaged over the ones that did)."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.sums: dict[str, float] = {}
        self.shares: dict[str, float] = {}

    def add(self, weight: float, metrics: Mapping[str, object]) -> None:
        for key, value in metrics.items():
            try:
                number = float(value)  # type: ignore[arg-type]
            except (TypeError, ValueError) as exc:
                raise EngineError(
                    f"{self.who}: loss_fn's metric {key!r}={value!r:.40} is not a number; "
                    "report floats"
                ) from exc
            self.sums[key] = self.sums.get(key, 0.0) + weight * number
            self.shares[key] = self.shares.get(key, 0.0) + weight

    def merge(self, other_sums: Mapping[str, float], other_shares: Mapping[str, float]) -> None:
        """Add another accumulator's raw sums and shares (e.g. another rank's)."""
        for key, value in other_sums.items():
            self.sums[key] = self.sums.get(key, 0.0) + float(value)
            self.shares[key] = self.shares.get(key, 0.0) + float(other_shares.get(key, 0.0))

    def means(self) -> dict[str, float]:
        return {k: self.sums[k] / self.shares[k] for k in self.sums if self.shares[k] > 0}


__all__ = [
    "MetricMeans",
    "ThreadedTrainer",
    "TokenRows",
    "check_loss",
    "is_int",
    "slice_batch",
    "token_field",
    "token_rows",
    "unique_named_tensors",
    "worker_thread",
]
