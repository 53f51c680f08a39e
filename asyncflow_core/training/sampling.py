"""What the log-prob of a sampled token is, in code: the sampling distribution of a request,
shared by engines that sample from it and trainers that recompute it, and the per-row
sampling fields that carry a request's settings from rollout to the trainer.

**The semantics** (the protocol's; ``asyncflow_core.contracts.protocols``): the log-prob of a
sampled token is its log-probability under the distribution it was actually sampled from —

1. the model's next-token logits divided by the temperature ``T``; greedy (``T = 0``) reports
   the log-prob under the unscaled, unfiltered distribution (``T = 1``, no top-k/top-p: the
   argmax is in every support), as vLLM, SGLang and transformers do;
2. top-k (``top_k > 0``): keep every token whose scaled logit is ``>=`` the k-th largest
   (ties at the k-th value are kept);
3. top-p (``top_p < 1``), on the distribution *renormalised after top-k*: sort ascending,
   drop the tokens whose cumulative probability is ``<= 1 - top_p``, always keep the most
   probable one;
4. renormalised over what is left (``log_softmax`` with ``-inf`` outside the support).

This is vLLM's ``logprobs_mode="processed_logprobs"``, transformers' warpers (temperature,
``TopKLogitsWarper``, ``TopPLogitsWarper``, in that order) and TRL's; ``tests/test_sampling.py``
checks ``filter_logits`` against transformers' warpers.

**Off the support.** A trainer recomputing the distribution may find a sampled token outside
its top-k/top-p support: a tie at the boundary, or bf16 logits that differ from the engine's
in the last bit. Its log-prob would be ``-inf`` (a NaN in the loss). ``sampled_logprobs``
gives such a token the *floor* ``log p_T(token) - log(Z + p_T(token))``: its probability
under the support extended by that token (``p_T`` the temperature-scaled distribution,
``Z`` the probability mass the filters kept) — finite, ``<= 0``, and close to the engine's
value when the token was a near-tie. Trainers count these tokens (``train_step``'s metric
``logprobs_off_support``); a count that is not ~0 means the engine and the trainer filter
differently.

**The fields** (``SAMPLING_FIELDS``): ``temperature`` (float), ``top_k`` (int) and ``top_p``
(float), one 0-dim tensor (or plain number) per row, written by the rollout next to the
tokens (``sampling_columns``) and read by trainers (``row_sampling``). A batch without them
is sampled at the trainer's default temperature with no filters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from asyncflow_core.contracts.errors import EngineError
from asyncflow_core.contracts.protocols import Batch, SamplingParams

TEMPERATURE = "temperature"
TOP_K = "top_k"
TOP_P = "top_p"
SAMPLING_FIELDS: tuple[str, ...] = (TEMPERATURE, TOP_K, TOP_P)
"""The batch fields holding each row's sampling settings."""
OFF_SUPPORT_METRIC = "logprobs_off_support"
"""``TrainMetrics.extra`` key: response tokens of the step found off their row's support."""


def filter_logits(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """The logits of the sampling distribution (see the module docstring): ``logits [..., V]``
    divided by the temperature, ``-inf`` outside the top-k/top-p support, in float32 (or
    float64 if given). ``temperature``, ``top_k`` and ``top_p`` broadcast against
    ``logits.shape[:-1]`` (one value per row, or per token). Differentiable in ``logits``."""
    x = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    t = torch.as_tensor(temperature, dtype=x.dtype, device=x.device)
    sampled = t > 0  # greedy rows: unscaled and unfiltered
    x = x / torch.where(sampled, t, torch.ones_like(t)).unsqueeze(-1)
    vocab = x.shape[-1]
    shape = x.shape[:-1]
    sampled = sampled.expand(shape)
    k = torch.as_tensor(top_k, device=x.device).long().expand(shape)
    use_k = sampled & (k > 0) & (k < vocab)
    if bool(use_k.any()):
        scores = x.detach()
        ranked = scores.sort(dim=-1, descending=True).values
        kth = ranked.gather(-1, (k.clamp(1, vocab) - 1).unsqueeze(-1))
        x = x.masked_fill(use_k.unsqueeze(-1) & (scores < kth), -math.inf)
    p = torch.as_tensor(top_p, dtype=x.dtype, device=x.device).expand(shape)
    use_p = sampled & (p < 1)
    if bool(use_p.any()):
        probs, order = torch.softmax(x.detach(), dim=-1).sort(dim=-1)  # ascending
        drop_sorted = probs.cumsum(dim=-1) <= (1 - p).unsqueeze(-1)
        drop_sorted[..., -1] = False  # the most probable token always stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(use_p.unsqueeze(-1) & drop, -math.inf)
    return x


def sampled_logprobs(
    logits: Tensor, tokens: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor
) -> tuple[Tensor, Tensor]:
    """``(logprobs, off_support)``: the log-prob of each of ``tokens [...]`` under the sampling
    distribution of ``logits [..., V]`` (``filter_logits``), and a bool mask of the tokens
    outside its support, which get the floor of the module docstring instead of ``-inf``.
    Finite and ``<= 0`` everywhere; differentiable in ``logits``."""
    x = filter_logits(logits, temperature, top_k, top_p)
    index = tokens.long().clamp(0, x.shape[-1] - 1).unsqueeze(-1)
    log_z = torch.logsumexp(x, dim=-1)
    chosen = x.gather(-1, index).squeeze(-1)
    off = torch.isneginf(chosen.detach())
    if not bool(off.any()):
        return chosen - log_z, off
    t = torch.as_tensor(temperature, dtype=x.dtype, device=x.device)
    scale = torch.where(t > 0, t, torch.ones_like(t))
    full = logits.to(x.dtype).gather(-1, index).squeeze(-1) / scale
    log_all = torch.logsumexp(logits.to(x.dtype) / scale.unsqueeze(-1), dim=-1)
    token = full - log_all  # log p_T(token)
    kept = log_z - log_all  # log Z
    floor = token - torch.logaddexp(kept, token)
    inside = torch.where(off, torch.zeros_like(chosen), chosen - log_z)
    return torch.where(off, floor, inside), off


# --------------------------------------------------------------------------------------------
# The per-row fields
# --------------------------------------------------------------------------------------------
def sampling_columns(params: Sequence[SamplingParams]) -> dict[str, list[Tensor]]:
    """The ``SAMPLING_FIELDS`` cells of rows sampled with ``params`` (one per row): 0-dim
    float32 ``temperature`` and ``top_p``, int64 ``top_k``, ready for ``DataStore.put``."""
    return {
        TEMPERATURE: [torch.tensor(float(p.temperature), dtype=torch.float32) for p in params],
        TOP_K: [torch.tensor(int(p.top_k), dtype=torch.int64) for p in params],
        TOP_P: [torch.tensor(float(p.top_p), dtype=torch.float32) for p in params],
    }


def _column(batch: Batch, name: str, rows: int, who: str) -> Tensor | None:
    """Field ``name`` as a float64 ``[rows]`` tensor (None if the batch lacks it)."""
    if name not in batch.data:
        return None
    value: Any = batch.data[name]
    if isinstance(value, Tensor) and value.is_nested:
        value = list(value.unbind())
    try:
        if isinstance(value, Tensor):
            column = value.detach().to("cpu", torch.float64).reshape(-1)
        else:
            cells = [v.detach().cpu().reshape(-1) if isinstance(v, Tensor) else v for v in value]
            if any(isinstance(c, Tensor) and c.numel() != 1 for c in cells):
                raise ValueError("a cell holds more than one value")
            numbers = [float(c.item() if isinstance(c, Tensor) else c) for c in cells]
            column = torch.tensor(numbers, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise EngineError(
            f"{who}: field {name!r} must hold one number per row (a [B] tensor, or one 0-dim "
            f"tensor or number per row), got {type(value).__name__}: {exc}"
        ) from exc
    if column.shape[0] != rows:
        raise EngineError(
            f"{who}: field {name!r} has {column.shape[0]} values for {rows} rows; give one per row"
        )
    return column


def _first_bad(bad: Tensor) -> int:
    return int(bad.nonzero()[0, 0])


def row_sampling(
    batch: Batch, rows: int, *, who: str, temperature: float = 1.0
) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's ``(temperature [rows] float32, top_k [rows] int64, top_p [rows] float32)``
    from the batch's ``SAMPLING_FIELDS``; a missing field means ``temperature`` (the
    trainer's default), ``top_k = 0`` or ``top_p = 1`` for every row. A bad value raises
    ``EngineError`` naming the field, the row and the valid range."""
    temp = _column(batch, TEMPERATURE, rows, who)
    k = _column(batch, TOP_K, rows, who)
    p = _column(batch, TOP_P, rows, who)
    if temp is None:
        temp = torch.full((rows,), float(temperature), dtype=torch.float64)
    bad = ~torch.isfinite(temp) | (temp < 0)
    if bool(bad.any()):
        i = _first_bad(bad)
        raise EngineError(
            f"{who}: temperature of row {i} is {float(temp[i])}; use a finite number >= 0 "
            "(0 = greedy)"
        )
    if k is None:
        k = torch.zeros(rows, dtype=torch.float64)
    bad = ~torch.isfinite(k) | (k < 0) | (k != k.round())
    if bool(bad.any()):
        i = _first_bad(bad)
        raise EngineError(f"{who}: top_k of row {i} is {float(k[i])}; use an int >= 0 (0 = off)")
    if p is None:
        p = torch.ones(rows, dtype=torch.float64)
    bad = ~torch.isfinite(p) | (p <= 0) | (p > 1)
    if bool(bad.any()):
        i = _first_bad(bad)
        raise EngineError(f"{who}: top_p of row {i} is {float(p[i])}; use a number in (0, 1]")
    return temp.float(), k.long(), p.float()


__all__ = [
    "OFF_SUPPORT_METRIC",
    "SAMPLING_FIELDS",
    "TEMPERATURE",
    "TOP_K",
    "TOP_P",
    "filter_logits",
    "row_sampling",
    "sampled_logprobs",
    "sampling_columns",
]
