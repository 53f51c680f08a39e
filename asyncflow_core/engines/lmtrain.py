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
  ``asyncflow_core.training.sampling``), and counts the tokens it found off that distribution's
  support.
* ``check_loss`` validates what a ``LossFn`` returned; ``MetricMeans`` averages its metrics
  over micro-batches with the weights the gradients used.
* ``worker_thread`` is the single-thread executor a trainer runs its torch work on.
* ``AdamWTrainer`` is the whole single-process training loop (AdamW, micro-batches weighted
  by the response tokens they train (``TokenRows.trained_tokens``), clipping, export,
  checkpoints) over one hook, ``_response_logprobs``:
  the reference trainer and ``asyncflow_hf.HFTrainEngine`` are that loop over their models.
  ``write_checkpoint`` / ``read_checkpoint`` are its checkpoint files.

Every check raises ``EngineError`` naming the trainer (``who``), the field and what to do.
"""

from __future__ import annotations

import abc
import asyncio
import copy
import json
import math
import operator
import os
import pickle
import statistics
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np
import safetensors
import safetensors.torch
import torch
from torch import Tensor

from asyncflow_core.contracts.errors import (
    AsyncFlowError,
    CheckpointError,
    ConfigError,
    EngineError,
)
from asyncflow_core.contracts.protocols import Batch, LossFn, TrainMetrics, Version, WeightBucket
from asyncflow_core.infra.manifest import (  # re-exported: they were defined here first
    CHECKPOINT_KEY_ENV,
    checkpoint_key,
    checkpoint_key_file,
    read_signed_manifest,
    sign_manifest,
)
from asyncflow_core.sync.transports import bucketize
from asyncflow_core.training.rl import LOSS_MASK
from asyncflow_core.training.sampling import OFF_SUPPORT_METRIC, row_sampling, sampled_logprobs

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
    implements. A subclass sets ``name`` and ``_executor`` (``worker_thread``), and
    ``_closed`` when it closes (a call after that raises ``EngineError``)."""

    name: str
    _executor: ThreadPoolExecutor
    _closed: bool = False
    vocab_size: int | None = None
    """Token ids are checked to lie below it (None: not checked)."""
    max_seq_len: int | None = None
    """Prompt + response are checked to fit it (None: not checked)."""
    temperature: float = 1.0
    """The sampling temperature of a batch without the sampling fields."""

    def _prepare(self, batch: Batch) -> TokenRows:
        """The batch's rows, checked against the model (``token_rows``)."""
        return token_rows(
            batch,
            who=self.name,
            vocab_size=self.vocab_size,
            max_seq_len=self.max_seq_len,
            temperature=self.temperature,
        )

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
        if self._closed:
            raise EngineError(f"{self.name}: called after close(); build a new engine")
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
    """A batch's prompt and response tokens, right-padded, with their lengths, each row's
    sampling settings (``asyncflow_core.training.sampling``) and, for multi-turn rows, the loss mask
    (``asyncflow_core.training.rl.LOSS_MASK``: True on the response tokens the policy generated;
    None: every real response token trains)."""

    prompt: Tensor  # [B, P] long
    plen: Tensor  # [B]
    response: Tensor  # [B, R] long
    rlen: Tensor  # [B]
    temperature: Tensor  # [B] float32
    top_k: Tensor  # [B] int64
    top_p: Tensor  # [B] float32
    loss_mask: Tensor | None = None  # [B, R] bool

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
            None if self.loss_mask is None else self.loss_mask[start:stop],
        )

    @property
    def response_tokens(self) -> int:
        return int(self.rlen.sum())

    @property
    def trained_tokens(self) -> int:
        """Response tokens the loss counts (all real ones, or those the loss mask marks): a
        micro-batch's share of the step's gradient is its share of these."""
        if self.loss_mask is None:
            return self.response_tokens
        return int(self.loss_mask.sum())

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
        ``logits [B, R, V]`` taken at ``inputs()``'s source positions: each token's log-prob under
        its row's sampling distribution (``asyncflow_core.training.sampling.sampled_logprobs``:
        temperature, top-k, top-p, renormalised; a token off the support gets the documented floor
        and is counted), 0 beyond the row's length."""
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
        trained = real if self.loss_mask is None else real & self.loss_mask.to(device)
        # off-support tokens are counted where they train: a tool's output is no sample
        return torch.where(real, out, torch.zeros_like(out)), int((off & trained).sum())


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
    (``asyncflow_core.training.sampling.row_sampling``; ``temperature`` for a batch without the
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
    mask = _loss_mask(batch, rlen, response.shape[1], who)
    return TokenRows(prompt, plen, response, rlen, temp, top_k, top_p, mask)


def _loss_mask(batch: Batch, rlen: Tensor, width: int, who: str) -> Tensor | None:
    """The batch's ``loss_mask`` field as bool ``[B, width]`` (False beyond each row's
    response), or None without the field; a row whose mask is not one 0/1 per response token
    raises ``EngineError``."""
    if LOSS_MASK not in batch.data:
        return None
    value = batch.data[LOSS_MASK]
    if isinstance(value, Tensor) and value.is_nested:
        value = list(value.unbind())
    b = int(rlen.shape[0])
    if isinstance(value, Tensor) and value.dim() == 2 and value.shape[0] == b:
        given = batch.lengths.get(LOSS_MASK)
        widths = rlen if given is None else torch.as_tensor(given).reshape(-1).long()
        rows = [value[i, : int(widths[i])] for i in range(b)]
    elif isinstance(value, list | tuple) and len(value) == b:
        rows = [torch.as_tensor(v).reshape(-1) for v in value]
    else:
        raise EngineError(
            f"{who}: {LOSS_MASK!r} must hold one row per response (a [B, R] tensor or a list of "
            f"1-D tensors), got {type(value).__name__} {tuple(getattr(value, 'shape', ()))}"
        )
    mask = torch.zeros(b, width, dtype=torch.bool)
    for i, row in enumerate(rows):
        n = int(rlen[i])
        if row.numel() != n or bool(((row != 0) & (row != 1)).any()):
            raise EngineError(
                f"{who}: {LOSS_MASK!r} row {i} must be {n} values of 0 or 1 (one per response "
                f"token, 1 on generated tokens), got {row.numel()} values "
                f"{row.tolist()[:8]}{'...' if row.numel() > 8 else ''}"
            )
        mask[i, :n] = row.to(torch.bool)
    return mask


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


# --------------------------------------------------------------------------------------------
# Constructor checks
# --------------------------------------------------------------------------------------------
def check_seed(who: str, seed: object) -> int:
    """``seed`` as an int in ``[0, 2**63)``, else ``ConfigError``."""
    value = operator.index(seed) if is_int(seed) else -1  # type: ignore[arg-type]
    if not 0 <= value < 2**63:
        raise ConfigError(f"{who}: seed must be an int in [0, 2**63), got {seed!r}")
    return value


def check_number(
    who: str, field: str, value: object, *, zero_ok: bool = False, hint: str = ""
) -> float:
    """``value`` as a float when it is a finite real number > 0 (>= 0 with ``zero_ok``), else
    ``ConfigError`` naming ``field`` and what it must be (``hint`` completes that)."""
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not (value >= 0 if zero_ok else value > 0)
    ):
        want = f"a number {'>=' if zero_ok else '>'} 0{hint}"
        raise ConfigError(f"{who}: {field} must be {want}, got {value!r}")
    return float(value)


# --------------------------------------------------------------------------------------------
# Checkpoint files
# --------------------------------------------------------------------------------------------
CHECKPOINT_WEIGHTS = "model.safetensors"
CHECKPOINT_OPTIMIZER = "optimizer.pt"
CHECKPOINT_META = "trainer.json"


def write_checkpoint(
    path: Path, weights: Mapping[str, Tensor], optimizer: Mapping[str, Any], meta: Mapping[str, Any]
) -> None:
    """The directory ``path`` with ``model.safetensors`` (``weights``: each tensor once;
    safetensors refuses tensors that share memory), ``optimizer.pt`` (``torch.save`` of the
    optimizer's ``state_dict``: tensors and plain values only, read back with
    ``weights_only=True``) and ``trainer.json`` (``meta``), each written under a temporary name
    and renamed, ``trainer.json`` last: a checkpoint whose ``trainer.json`` is there is
    complete (one being overwritten loses its ``trainer.json`` first)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / CHECKPOINT_META).unlink(missing_ok=True)
    tmp = f".tmp-{os.getpid()}"
    weights_tmp = path / (CHECKPOINT_WEIGHTS + tmp)
    optimizer_tmp = path / (CHECKPOINT_OPTIMIZER + tmp)
    meta_tmp = path / (CHECKPOINT_META + tmp)
    state = {n: t.detach().contiguous().cpu() for n, t in weights.items()}
    safetensors.torch.save_file(state, str(weights_tmp), metadata={"format": "pt"})
    torch.save(dict(optimizer), optimizer_tmp)
    meta_tmp.write_text(json.dumps(meta, indent=1))
    os.replace(weights_tmp, path / CHECKPOINT_WEIGHTS)
    os.replace(optimizer_tmp, path / CHECKPOINT_OPTIMIZER)
    os.replace(meta_tmp, path / CHECKPOINT_META)


def read_checkpoint(
    path: Path, *, who: str, format: str, writer: str
) -> tuple[dict[str, Any], dict[str, Tensor], dict[str, Any]]:
    """``(meta, weights, optimizer state)`` of a checkpoint ``write_checkpoint`` wrote with
    ``meta["format"] == format``; ``CheckpointError`` saying it "is not readable" (missing,
    truncated, another format; pass a directory written by ``writer``) otherwise. Nothing is
    unpickled beyond tensors and plain values (safetensors, ``weights_only=True``)."""
    try:
        meta = json.loads((path / CHECKPOINT_META).read_text())
        if not isinstance(meta, dict) or meta.get("format") != format:
            found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
            raise ValueError(f"format {found!r}, expected {format}")
        weights = safetensors.torch.load_file(str(path / CHECKPOINT_WEIGHTS))
        optimizer = torch.load(path / CHECKPOINT_OPTIMIZER, weights_only=True)
        if not isinstance(optimizer, dict):
            raise ValueError(f"{CHECKPOINT_OPTIMIZER} holds a {type(optimizer).__name__}")
    except (
        OSError,
        ValueError,
        KeyError,
        TypeError,
        RuntimeError,
        EOFError,
        pickle.UnpicklingError,
        safetensors.SafetensorError,
        AsyncFlowError,
    ) as exc:
        raise CheckpointError(
            f"{who}: checkpoint {str(path)!r} is not readable ({type(exc).__name__}: {exc}); "
            f"pass a directory written by {writer}"
        ) from exc
    return meta, weights, optimizer


# --------------------------------------------------------------------------------------------
# The single-process training loop
# --------------------------------------------------------------------------------------------
class AdamWTrainer(ThreadedTrainer):
    """A ``TrainEngine`` that trains ``self.model`` in this process with AdamW, on one worker
    thread. A subclass calls ``__init__`` (the optimizer settings, checked), sets ``model``,
    ``vocab_size`` and ``max_seq_len`` (what ``token_rows`` checks the rows against; ``None``:
    no limit), calls ``_start(threads, who)`` and implements ``_response_logprobs`` (``[b, R]``
    log-probs of a ``TokenRows`` part, with gradients when they are enabled) and
    ``_model_config`` / ``_other_model`` (what a checkpoint records of the model, and why a
    recorded one is not this model).

    **Steps.** ``train_step(batch, loss_fn)`` splits the rows into consecutive micro-batches
    of ``micro_batch_size`` and calls ``loss_fn(logprobs, part)`` on each (``part``: the
    micro-batch's own ``Batch``). Each micro-batch's loss is weighted by its share of the
    batch's response tokens before its backward, so for losses that average over response
    tokens the accumulated gradient equals one full-batch step; a micro-batch without response
    tokens is skipped. Then the gradient norm is clipped to ``max_grad_norm`` (``None``: not
    clipped, still reported), AdamW steps and ``weight_version`` adds 1. A non-finite loss or
    gradient, or a bad loss value, raises ``EngineError`` and changes nothing.

    **Minibatches** (PPO's, AReaL's ``ppo_n_minibatches``): with ``minibatches`` k > 1 the
    rows are cut into k consecutive minibatches and each takes an optimizer step of its own
    (its micro-batches accumulated as above), so a clipped loss's trust region engages from
    the second step on; ``weight_version`` still adds 1 per ``train_step`` (the version the
    staleness bound counts). The weights and the optimizer state are copied for the step,
    so that a failure in a later minibatch restores them: nothing changes then either.
    ``TrainMetrics.extra``: the loss function's metrics (token-weighted means),
    ``micro_batches`` and ``logprobs_off_support`` (``OFF_SUPPORT_METRIC``).

    **Learning rate.** ``lr``, reached linearly over the first ``lr_warmup_steps`` steps this
    trainer takes (``lr * k / lr_warmup_steps`` at its ``k``-th; 0: ``lr`` from the first). A
    fresh AdamW's first steps move every weight by about ``lr`` whatever the size of its
    gradient, which can flip a decision the policy had already learnt (measured: an agent's
    rate of calling its tool fell from 75% to 1% in one step of a new trainer at ``lr`` 2e-3);
    a warm-up gives the moment estimates time to form. A checkpoint load counts as warmed up.

    **Weights** travel under ``state_dict`` names, each tensor once (``unique_named_tensors``:
    a tied LM head under the embedding's name), snapshotted on the worker thread.
    **Checkpoints**: ``write_checkpoint`` files with ``meta = {format: checkpoint_format,
    version, model_config, optimizer}``; loading checks the format, the model config and every
    tensor's name and shape before it changes anything."""

    checkpoint_format: ClassVar[str]
    model: torch.nn.Module
    vocab_size: int | None
    max_seq_len: int | None
    _optimizer: torch.optim.AdamW

    def __init__(
        self,
        *,
        name: str,
        who: str,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        max_grad_norm: float | None,
        micro_batch_size: int,
        temperature: float,
        seed: int,
        lr_warmup_steps: int = 0,
        minibatches: int = 1,
    ) -> None:
        self.lr = check_number(who, "lr", lr)
        if not is_int(minibatches) or minibatches < 1:
            raise ConfigError(f"{who}: minibatches must be an int >= 1, got {minibatches!r}")
        self.minibatches = int(minibatches)
        if not is_int(lr_warmup_steps) or lr_warmup_steps < 0:
            raise ConfigError(
                f"{who}: lr_warmup_steps must be an int >= 0, got {lr_warmup_steps!r}"
            )
        self.lr_warmup_steps = int(lr_warmup_steps)
        self._steps_taken = 0
        self.weight_decay = check_number(who, "weight_decay", weight_decay, zero_ok=True)
        if (
            not isinstance(betas, tuple | list)
            or len(betas) != 2
            or not all(isinstance(b, int | float) and 0 <= b < 1 for b in betas)
        ):
            raise ConfigError(f"{who}: betas must be two numbers in [0, 1), got {betas!r}")
        self.betas = (float(betas[0]), float(betas[1]))
        self.max_grad_norm = (
            None
            if max_grad_norm is None
            else check_number(who, "max_grad_norm", max_grad_norm, hint=" or None (no clipping)")
        )
        if not is_int(micro_batch_size) or micro_batch_size < 1:
            raise ConfigError(
                f"{who}: micro_batch_size must be an int >= 1, got {micro_batch_size!r}"
            )
        self.micro_batch_size = int(micro_batch_size)
        self.temperature = check_number(
            who,
            "temperature",
            temperature,
            hint=" (the rollout's temperature; use 1 for greedy rollouts)",
        )
        self.seed = check_seed(who, seed)
        self.name = name
        self._version: Version = 0

    def _start(self, threads: int | None, who: str) -> None:
        """The optimizer over ``self.model``'s parameters, and the worker thread."""
        self._optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=self.lr,
            betas=self.betas,
            weight_decay=self.weight_decay,
            eps=1e-8,
        )
        self._executor = worker_thread(self.name, threads, who)

    @property
    def weight_version(self) -> Version:
        return self._version

    def _current_lr(self) -> float:
        """The learning rate of the next step (``lr_warmup_steps``, class docstring)."""
        if self._steps_taken >= self.lr_warmup_steps:
            return self.lr
        return self.lr * (self._steps_taken + 1) / self.lr_warmup_steps

    async def close(self) -> None:
        """Stop the worker thread (after the call in progress)."""
        self._closed = True
        self._executor.shutdown(wait=False)

    # -- on the worker thread: a subclass implements the abstract ones -------------------------
    @abc.abstractmethod
    def _response_logprobs(self, rows: TokenRows) -> tuple[Tensor, int]:
        """``[b, R]`` fp32 log-probs of ``rows``' response tokens under each row's sampling
        distribution (``TokenRows.logprobs``; 0 beyond each row's length), with gradients when
        they are enabled, and how many tokens were off their row's support."""

    @abc.abstractmethod
    def _model_config(self) -> dict[str, Any]:
        """The model's config as plain JSON values (``model_config`` of a checkpoint)."""

    @abc.abstractmethod
    def _other_model(self, saved: object) -> str | None:
        """Why a checkpoint's ``model_config`` is not this model's (e.g. which fields differ),
        or None when it is."""

    # -- the loop ------------------------------------------------------------------------------
    def _compute_logprobs(self, batch: Batch) -> Tensor:
        rows = self._prepare(batch)
        b = len(rows)
        mbs = self.micro_batch_size
        with torch.no_grad():
            parts = [self._response_logprobs(rows.part(s, s + mbs))[0] for s in range(0, b, mbs)]
        return torch.cat(parts) if parts else torch.zeros(0, rows.response.shape[1])

    def _split(self, batch: Batch, b: int) -> list[tuple[int, int, Batch]]:
        mbs = self.micro_batch_size
        if b <= mbs:
            return [(0, b, batch)]
        spans = [(s, min(s + mbs, b)) for s in range(0, b, mbs)]
        return [(s, e, slice_batch(self.name, batch, s, e)) for s, e in spans]

    def _train_step(self, batch: Batch, loss_fn: LossFn) -> TrainMetrics:
        rows = self._prepare(batch)
        b = len(rows)
        if b == 0:
            raise EngineError(f"{self.name}: train_step got an empty batch; pass at least 1 row")
        k = min(self.minibatches, b)
        spans = [(i * b // k, (i + 1) * b // k) for i in range(k)]
        plans = []  # every field validated before any compute
        for start, stop in spans:
            mini = batch if k == 1 else slice_batch(self.name, batch, start, stop)
            plans.append(
                (rows if k == 1 else rows.part(start, stop), self._split(mini, stop - start))
            )
        saved = None
        if k > 1:  # a later minibatch that fails must leave the earlier ones' steps undone too
            saved = (
                {n: t.detach().clone() for n, t in self.model.state_dict().items()},
                copy.deepcopy(self._optimizer.state_dict()),
                self._steps_taken,
            )
        means = MetricMeans(self.name)
        loss_sum, off_support, norms = 0.0, 0, []
        try:
            for mini_rows, parts in plans:
                loss, norm, off = self._optimizer_step(mini_rows, parts, loss_fn, means)
                loss_sum += loss / k
                off_support += off
                norms.append(norm)
        except BaseException:
            if saved is not None:
                self.model.load_state_dict(saved[0])
                self._optimizer.load_state_dict(saved[1])
                self._steps_taken = saved[2]
            raise
        self._version += 1
        extra = means.means()
        extra["micro_batches"] = float(sum(len(parts) for _, parts in plans))
        extra[OFF_SUPPORT_METRIC] = float(off_support)
        if k > 1:
            extra["minibatches"] = float(k)
        return TrainMetrics(
            version=self._version,
            loss=loss_sum,
            grad_norm=statistics.fmean(norms),
            samples=b,
            tokens=rows.tokens,
            extra=extra,
        )

    def _optimizer_step(
        self,
        rows: TokenRows,
        parts: list[tuple[int, int, Batch]],
        loss_fn: LossFn,
        means: MetricMeans,
    ) -> tuple[float, float, int]:
        """One optimizer step over ``rows`` (its micro-batches ``parts``): (loss, gradient
        norm, log-probs off support)."""
        b = len(rows)
        total = rows.trained_tokens
        params = [p for p in self.model.parameters() if p.requires_grad]
        loss_sum = 0.0
        off_support = 0
        self._optimizer.zero_grad(set_to_none=True)
        try:
            for start, stop, part in parts:
                tokens = rows.part(start, stop).trained_tokens
                weight = tokens / total if total else (stop - start) / b
                if weight == 0:
                    continue
                logprobs, off = self._response_logprobs(rows.part(start, stop))
                off_support += off
                loss, metrics = check_loss(self.name, loss_fn(logprobs, part))
                (loss * weight).backward()  # type: ignore[no-untyped-call]
                loss_sum += weight * float(loss.detach())
                means.add(weight, metrics)
            max_norm = math.inf if self.max_grad_norm is None else self.max_grad_norm
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
            if not math.isfinite(grad_norm):
                raise EngineError(
                    f"{self.name}: the gradient norm is {grad_norm}; the step was skipped and "
                    "nothing changed (check the loss and the learning rate)"
                )
            lr = self._current_lr()
            for group in self._optimizer.param_groups:
                group["lr"] = lr
            self._optimizer.step()
            self._steps_taken += 1
        finally:
            self._optimizer.zero_grad(set_to_none=True)
        return loss_sum, grad_norm, off_support

    # -- weights -------------------------------------------------------------------------------
    async def _export(self, bucket_bytes: int) -> AsyncIterator[WeightBucket]:
        buckets: list[WeightBucket] = await self._run(self._snapshot, bucket_bytes)
        for bucket in buckets:
            yield bucket

    def _snapshot(self, bucket_bytes: int) -> list[WeightBucket]:
        """A copy (on the CPU) of every tensor ``export_weights`` sends, taken on the worker
        thread so that no step runs halfway through it: copied straight into the broadcast's
        wire layout (snapshot buckets), so a collective sync sends them without packing."""
        return bucketize(self._exported(), bucket_bytes, pack=True, device="cpu")

    def _exported(self) -> list[tuple[str, Tensor]]:
        """What ``export_weights`` sends: each of the model's tensors once (tied ones under one
        name), uncopied."""
        return [(n, t.detach()) for n, t in unique_named_tensors(self.model)]

    # -- checkpoints ---------------------------------------------------------------------------
    def _save(self, path: Path) -> None:
        meta = {
            "format": self.checkpoint_format,
            "version": self._version,
            "model_config": self._model_config(),
            "optimizer": {
                "type": "AdamW",
                "lr": self.lr,
                "betas": list(self.betas),
                "weight_decay": self.weight_decay,
            },
        }
        weights = dict(unique_named_tensors(self.model))
        write_checkpoint(path, weights, self._optimizer.state_dict(), meta)

    def _load(self, path: Path) -> None:
        writer = f"{type(self).__name__}.save_checkpoint"
        meta, weights, optimizer_state = read_checkpoint(
            path, who=self.name, format=self.checkpoint_format, writer=writer
        )
        where = f"{self.name}: checkpoint {str(path)!r}"
        version = meta.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise CheckpointError(
                f"{where} is not readable (version {version!r}); pass a directory written by "
                f"{writer}"
            )
        other = self._other_model(meta.get("model_config"))
        if other is not None:
            raise CheckpointError(f"{where} {other}")
        own = unique_named_tensors(self.model)
        if set(weights) != {n for n, _ in own} or any(
            weights[n].shape != t.shape or weights[n].dtype != t.dtype for n, t in own
        ):
            raise CheckpointError(
                f"{where}: its tensors do not match the model's parameters (names, shapes or "
                "dtypes)"
            )
        bad = [n for n, t in weights.items() if t.is_floating_point() and not t.isfinite().all()]
        if bad:
            raise CheckpointError(f"{where}: tensor(s) {bad[:3]} hold NaN or infinity")
        problem = _optimizer_misfit(self._optimizer, optimizer_state)
        if problem is not None:
            raise CheckpointError(f"{where}: optimizer state does not fit ({problem})")
        try:
            self._optimizer.load_state_dict(optimizer_state)
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise CheckpointError(f"{where}: optimizer state does not fit ({exc})") from exc
        with torch.no_grad():
            for n, t in own:  # in place: a tied tensor is one object, so both ends follow
                t.copy_(weights[n])
        self._version = version
        self._steps_taken = max(self._steps_taken, self.lr_warmup_steps)  # moments restored


def _optimizer_misfit(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> str | None:
    """Why ``saved`` (an optimizer ``state_dict``) does not fit ``optimizer``, checked before
    ``load_state_dict`` (which matches parameters by position and trusts the state's shapes):
    the groups' sizes, and every per-parameter state tensor's shape and finiteness."""
    groups, state = saved.get("param_groups"), saved.get("state")
    if not isinstance(groups, list) or not isinstance(state, dict):
        return "no param_groups list or state dict"
    if len(groups) != len(optimizer.param_groups) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        return f"{len(groups)} parameter group(s), the optimizer has {len(optimizer.param_groups)}"
    ids = [i for g in groups for i in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if len(ids) != len(params) or len(set(ids)) != len(ids):
        return f"{len(ids)} parameters, the optimizer has {len(params)}"
    by_id = dict(zip(ids, params, strict=True))
    for pid, entry in state.items():
        if pid not in by_id or not isinstance(entry, dict):
            return f"state for unknown parameter {pid!r}"
        for key, value in entry.items():
            if not isinstance(value, Tensor):
                return f"state {key!r} of parameter {pid!r} is a {type(value).__name__}"
            if key != "step" and value.shape != by_id[pid].shape:
                return (
                    f"state {key!r} of parameter {pid!r} has shape {list(value.shape)}, the "
                    f"parameter {list(by_id[pid].shape)}"
                )
            if value.is_floating_point() and not value.isfinite().all():
                return f"state {key!r} of parameter {pid!r} holds NaN or infinity"
    return None


__all__ = [
    "CHECKPOINT_KEY_ENV",
    "CHECKPOINT_META",
    "CHECKPOINT_OPTIMIZER",
    "CHECKPOINT_WEIGHTS",
    "AdamWTrainer",
    "MetricMeans",
    "ThreadedTrainer",
    "TokenRows",
    "check_loss",
    "check_number",
    "check_seed",
    "checkpoint_key",
    "checkpoint_key_file",
    "is_int",
    "read_checkpoint",
    "read_signed_manifest",
    "sign_manifest",
    "slice_batch",
    "token_field",
    "token_rows",
    "unique_named_tensors",
    "worker_thread",
    "write_checkpoint",
]
