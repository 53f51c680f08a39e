"""Engine-agnostic RL math in plain torch: advantages, policy-gradient objectives, and their
building blocks (importance weights, rejection masks, KL penalties, loss aggregation).

Which objective for which regime
--------------------------------

=============================  ==========================================  =====================
objective                      use it for                                  batch fields needed
=============================  ==========================================  =====================
``policy_gradient_loss``       on-policy GRPO (η = 0, one update per       ``advantage``
                               batch: the ratio is 1, PPO-clip's gradient
                               is exactly this one)
``PPOClipLoss()``              slightly off-policy: one-step-off (η = 1),  ``advantage``,
                               several updates per batch; π_old is the     ``logprobs``
                               rollout's behaviour policy
``PPOClipLoss(old_logprobs_    rollout/trainer numerical mismatch: the     + ``prox_logprobs``
field="prox_logprobs",         ratio against the trainer's own π_old,
tis_cap=2.0)``                 truncated IS weight π_old/π_behav
``DecoupledPPOLoss()``         large staleness (η > 1, fully async):       ``advantage``,
                               trust region around π_prox, off-policy      ``logprobs``,
                               correction π_prox/π_behav                   ``prox_logprobs``
=============================  ==========================================  =====================

Any of the PPO losses adds ``ref_logprobs`` when ``kl_coef > 0``.

Formulas and references
-----------------------

* GRPO advantage (``group_advantages`` = ``grpo_advantages``): ``A_i = (r_i − mean_g(r)) /
  (std_g(r) + eps)`` over the samples of one prompt (Shao et al., *DeepSeekMath*,
  arXiv 2402.03300); ``normalize_std=False`` is Dr. GRPO (Liu et al., *Understanding R1-Zero-Like
  Training*, arXiv 2503.20783).
* RLOO advantage (``rloo_advantages``): ``A_i = r_i − mean_{j≠i, j∈g}(r_j)`` (Kool et al., *Buy 4
  REINFORCE Samples, Get a Baseline for Free!*, ICLR 2019 workshop; Ahmadian et al., *Back to
  Basics: Revisiting REINFORCE Style Optimization*, arXiv 2402.14740).
* PPO-clip (``PPOClipLoss``, ``ppo_clip_objective``): ``−min(ρ·A, clip(ρ, 1−ε_low, 1+ε_high)·A)``
  with ``ρ = π_θ/π_old`` (Schulman et al., *Proximal Policy Optimization Algorithms*,
  arXiv 1707.06347); ``ε_high > ε_low`` is DAPO's clip-higher (Yu et al., arXiv 2503.14476);
  ``dual_clip`` c bounds the loss of a negative-advantage token by ``−c·A`` (Ye et al.,
  *Mastering Complex Control in MOBA Games with Deep RL*, arXiv 1912.09729).
* Decoupled PPO (``DecoupledPPOLoss``): separate proximal and behaviour policies (Hilton et al.,
  *Batch Size-Invariance for Policy Optimization*, arXiv 2110.00641; used for staleness by Fu et
  al., *AReaL*, arXiv 2505.24298). Formula in the class docstring.
* Truncated importance sampling (``tis_weights``): ``min(π_old/π_behav, C)`` corrects the mismatch
  between the rollout engine's and the trainer's probabilities (Yao et al., *Your Efficient RL
  Framework Secretly Brings You Off-Policy RL Training*, 2025 blog post; truncated IS after
  Ionides 2008 / Espeholt et al., *IMPALA*, arXiv 1802.01561).
* Rejection masks (``rejection_mask``): drop tokens, or whole sequences by the geometric mean of
  their ratios, whose ratio π_old/π_behav leaves ``[low, high]`` (masked importance sampling, as
  in the token- and sequence-level variants of Liu et al., *When Speed Kills Stability*, 2025 blog
  post, and IcePop in the Ring-1T report).
* KL to a reference (``kl_penalty``): with ``r = π_ref/π_θ``, k1 ``= −log r``, k2 ``= ½(log r)²``,
  k3 ``= r − 1 − log r`` (J. Schulman, *Approximating KL Divergence*, 2020 note).

Conventions
-----------

* ``logprobs`` passed to a loss are the current policy's per-token log-probs ``[B, T]``; per-token
  batch fields are padded ``[B, T]`` tensors (or, layout "list"/"nested", per-row tensors, padded
  here). ``batch.lengths["response"]`` marks the real tokens (every column counts without it);
  padded positions are replaced by 0 before any arithmetic, so their values (even NaN/inf) never
  reach the loss, its gradient or the metrics.
* **Multi-turn rows** (``asyncflow_core.flow.agent``): the response holds every token after the
  first prompt, tool and user tokens included, and the ``loss_mask`` field (``LOSS_MASK``: one
  0/1 per response token, 1 exactly on the tokens the policy generated) marks the ones that
  train. Every loss here counts only those: ``response_mask`` is the real tokens *and* the
  loss mask, so token-mean is the mean over generated tokens, and a tool's output never
  reaches the loss, its gradient or the metrics. A row without the field trains on every
  response token (single-turn). Advantages stay per row (the GRPO/RLOO group logic is the
  same).
* Batch fields (behaviour/proximal/reference log-probs, advantages, weights) are detached: only
  ``logprobs`` carries gradient.
* Aggregation: ``"token-mean"`` (default; every kept response token of the micro-batch weighs the
  same, DAPO's token-level loss, like ``policy_gradient_loss``) or ``"seq-mean-token-mean"``
  (mean over rows of each row's token mean; rows with no kept token are left out).
* Log-ratios are clamped to ``[−20, 20]`` before ``exp`` so one wild token cannot make the loss or
  its gradient inf/NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from asyncflow_core.contracts.errors import BadRequestError, ConfigError
from asyncflow_core.contracts.protocols import Batch

Aggregation = Literal["token-mean", "seq-mean-token-mean"]
KLEstimator = Literal["k1", "k2", "k3"]
RejectLevel = Literal["token", "sequence"]

AGGREGATIONS: tuple[Aggregation, ...] = ("token-mean", "seq-mean-token-mean")
KL_ESTIMATORS: tuple[KLEstimator, ...] = ("k1", "k2", "k3")
REJECT_LEVELS: tuple[RejectLevel, ...] = ("token", "sequence")

BEHAVIOUR_LOGPROBS = "logprobs"
"""Field: per-token log-probs of the policy that sampled the response (the rollout engine)."""
PROX_LOGPROBS = "prox_logprobs"
"""Field: per-token log-probs under the trainer's weights at the start of the update."""
REF_LOGPROBS = "ref_logprobs"
"""Field: per-token log-probs under the reference policy (for the KL penalty)."""
ADVANTAGE = "advantage"
"""Field: one advantage per row ``[B]`` or per token ``[B, T]``."""
LOSS_MASK = "loss_mask"
"""Field: per response token, 1 where the policy generated it (trained), 0 on tokens it did not
(a multi-turn row's tool, environment and user tokens); absent: every response token trains."""

MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped to ``[-MAX_LOG_RATIO, MAX_LOG_RATIO]`` before ``exp``."""


# --------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------
def _grouped(
    rewards: torch.Tensor | Sequence[float], groups: Sequence[int | str], who: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validated float rewards ``[N]``, each sample's group index ``[N]`` and the group sizes."""
    r = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)
    if r.numel() != len(groups):
        raise BadRequestError(
            f"{who}: {r.numel()} rewards but {len(groups)} group ids; pass one group id per reward"
        )
    if not torch.isfinite(r).all():
        bad = [i for i, ok in enumerate(torch.isfinite(r).tolist()) if not ok]
        raise BadRequestError(f"{who}: rewards at positions {bad} are not finite")
    index: dict[int | str, int] = {}
    ids = torch.tensor([index.setdefault(g, len(index)) for g in groups], dtype=torch.long)
    count = torch.zeros(len(index)).index_add_(0, ids, torch.ones_like(r))
    return r, ids, count


def group_advantages(
    rewards: torch.Tensor | Sequence[float],
    groups: Sequence[int | str],
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO: per-sample advantage ``(r - mean_group(r)) / (std_group(r) + eps)`` (population
    std; a group of one sample gets advantage 0). ``normalize_std=False`` (Dr. GRPO) returns
    ``r - mean_group(r)``."""
    r, ids, count = _grouped(rewards, groups, "group_advantages")
    k = count.numel()
    mean = torch.zeros(k).index_add_(0, ids, r) / count
    centered = r - mean[ids]
    if not normalize_std:
        return centered
    var = torch.zeros(k).index_add_(0, ids, centered * centered) / count
    return centered / (var.sqrt()[ids] + eps)


grpo_advantages = group_advantages
"""Alias of ``group_advantages`` (GRPO's group-normalised advantage)."""


def rloo_advantages(
    rewards: torch.Tensor | Sequence[float], groups: Sequence[int | str]
) -> torch.Tensor:
    """RLOO: ``A_i = r_i − mean of the other samples' rewards in i's group`` (leave-one-out
    baseline, unbiased); a group of one sample gets advantage 0. Equals
    ``n/(n−1) · (r_i − mean_group(r))`` for a group of ``n``."""
    r, ids, count = _grouped(rewards, groups, "rloo_advantages")
    total = torch.zeros(count.numel()).index_add_(0, ids, r)
    others = count[ids] - 1.0
    baseline = (total[ids] - r) / others.clamp(min=1.0)
    return torch.where(others > 0, r - baseline, torch.zeros_like(r))


# --------------------------------------------------------------------------------------------
# Batch access
# --------------------------------------------------------------------------------------------
def _shape(logprobs: torch.Tensor, batch: Batch, who: str) -> tuple[int, int]:
    if not isinstance(logprobs, torch.Tensor) or logprobs.dim() != 2:
        got = list(logprobs.shape) if isinstance(logprobs, torch.Tensor) else type(logprobs)
        raise BadRequestError(f"{who}: logprobs must be a [B, T] tensor, got {got}")
    b, t = int(logprobs.shape[0]), int(logprobs.shape[1])
    if len(batch.rows) and b != len(batch.rows):
        raise BadRequestError(
            f"{who}: logprobs has shape [{b}, {t}] but the batch has {len(batch.rows)} rows; "
            "give one row of log-probs per batch row"
        )
    return b, t


def _work_dtype(logprobs: torch.Tensor) -> torch.dtype:
    """float32 at least: bf16/fp16 ratios and exps lose too much precision."""
    return torch.promote_types(logprobs.dtype, torch.float32)


def response_mask(logprobs: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Bool ``[B, T]``: True at the response tokens of each row that train: the real tokens
    (``batch.lengths["response"]``, or in layout "list"/"nested" each row's ``response``
    length; all True without either) that the ``loss_mask`` field, when the batch has one,
    marks 1 (the tokens the policy generated)."""
    who = "response_mask"
    b, t = _shape(logprobs, batch, who)
    lengths = batch.lengths.get("response")
    if lengths is None:  # layout "list"/"nested": each row's own response tensor says
        lengths = _row_lengths(batch.data.get("response"))
    if lengths is None:
        real = torch.ones(b, t, dtype=torch.bool, device=logprobs.device)
    else:
        n = torch.as_tensor(lengths).reshape(-1).to(device=logprobs.device, dtype=torch.long)
        if n.numel() != b:
            raise BadRequestError(
                f"{who}: lengths['response'] has {n.numel()} entries but logprobs has {b} rows"
            )
        if n.numel() and (int(n.min()) < 0 or int(n.max()) > t):
            raise BadRequestError(
                f"{who}: lengths['response'] ranges over [{int(n.min())}, {int(n.max())}] but "
                f"logprobs [B, T] = [{b}, {t}] has only {t} token columns; compute logprobs over "
                "the padded response width"
            )
        real = torch.arange(t, device=logprobs.device).unsqueeze(0) < n.unsqueeze(1)
    if LOSS_MASK not in batch:
        return real
    hint = "1 on each response token the policy generated, 0 elsewhere"
    mask = _token_field(batch, LOSS_MASK, logprobs, torch.float32, who, hint)
    rows = _row_lengths(batch[LOSS_MASK])
    if rows is not None and lengths is not None:  # a row of its own per response: its length
        n = torch.as_tensor(lengths).reshape(-1).to(dtype=torch.long, device=rows.device)
        if rows.numel() == n.numel() and bool((rows != n).any()):
            row = int((rows != n).nonzero()[0, 0])
            raise BadRequestError(
                f"{who}: {LOSS_MASK} row {row} has {int(rows[row])} values but its response has "
                f"{int(n[row])} tokens; give one value per response token ({hint})"
            )
    values = mask.masked_fill(~real, 0.0)
    if bool(((values != 0) & (values != 1)).any()):
        row, col = (int(x) for x in ((values != 0) & (values != 1)).nonzero()[0])
        raise BadRequestError(
            f"{who}: {LOSS_MASK}[{row}, {col}] = {float(values[row, col])}; give {hint}"
        )
    return real & (values == 1)


def _row_lengths(value: object) -> torch.Tensor | None:
    """The lengths of a per-row token field in layout "list" or "nested" (None otherwise)."""
    if isinstance(value, torch.Tensor) and value.is_nested:
        value = list(value.unbind())
    if isinstance(value, list | tuple) and all(isinstance(v, torch.Tensor) for v in value):
        return torch.tensor([int(v.shape[0]) if v.dim() else 1 for v in value], dtype=torch.long)
    return None


def _token_field(
    batch: Batch, name: str, like: torch.Tensor, dtype: torch.dtype, who: str, hint: str
) -> torch.Tensor:
    """Field ``name`` as a detached ``[B, T]`` tensor shaped like ``like`` (padding with 0 a
    list or nested layout)."""
    b, t = int(like.shape[0]), int(like.shape[1])
    if name not in batch:
        raise BadRequestError(
            f"{who} needs a {name!r} field ({hint}); the batch has {sorted(batch.data)}"
        )
    value: Any = batch[name]
    if isinstance(value, torch.Tensor) and value.is_nested:
        value = list(value.unbind())
    if isinstance(value, torch.Tensor):
        if tuple(value.shape) != (b, t):
            raise BadRequestError(
                f"{who}: field {name!r} has shape {list(value.shape)} but logprobs is [B, T] = "
                f"[{b}, {t}]; give one value per response token, padded like logprobs"
            )
        out = value
    elif isinstance(value, list | tuple):
        if len(value) != b:
            raise BadRequestError(
                f"{who}: field {name!r} has {len(value)} rows but logprobs is [B, T] = [{b}, {t}]"
            )
        out = torch.zeros(b, t, dtype=dtype)
        for i, row in enumerate(value):
            cells = torch.as_tensor(row).detach().reshape(-1)
            if cells.numel() > t:
                raise BadRequestError(
                    f"{who}: field {name!r} row {i} has {cells.numel()} values but logprobs is "
                    f"[B, T] = [{b}, {t}]"
                )
            out[i, : cells.numel()] = cells.to(dtype)
    else:
        raise BadRequestError(
            f"{who}: field {name!r} must be a [B, T] tensor or a list of per-row tensors, got "
            f"{type(value).__name__}"
        )
    return out.detach().to(device=like.device, dtype=dtype)


def _advantages(batch: Batch, like: torch.Tensor, dtype: torch.dtype, who: str) -> torch.Tensor:
    """The ``advantage`` field as a detached ``[B, T]`` tensor (a per-row value repeated)."""
    b, t = int(like.shape[0]), int(like.shape[1])
    hint = "one advantage per row [B] or per token [B, T], e.g. from group_advantages"
    if ADVANTAGE not in batch:
        raise BadRequestError(
            f"{who} needs an {ADVANTAGE!r} field ({hint}); the batch has {sorted(batch.data)}"
        )
    value: Any = batch[ADVANTAGE]
    if (
        isinstance(value, list | tuple)
        and value
        and all(isinstance(v, torch.Tensor) for v in value)
    ):
        if any(v.dim() > 0 for v in value):
            return _token_field(batch, ADVANTAGE, like, dtype, who, hint)
        value = torch.stack(list(value))
    elif isinstance(value, torch.Tensor) and value.is_nested:
        return _token_field(batch, ADVANTAGE, like, dtype, who, hint)
    adv = torch.as_tensor(value).detach().to(device=like.device, dtype=dtype)
    if tuple(adv.shape) == (b, t):
        return adv
    if adv.numel() == b and (adv.dim() <= 1 or tuple(adv.shape) == (b, 1)):
        return adv.reshape(b, 1).expand(b, t)
    raise BadRequestError(
        f"{who}: field {ADVANTAGE!r} has shape {list(adv.shape)} ({adv.numel()} values) but "
        f"logprobs is [B, T] = [{b}, {t}]; give {hint}"
    )


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------
def aggregate_loss(
    values: torch.Tensor, mask: torch.Tensor, mode: Aggregation = "token-mean"
) -> torch.Tensor:
    """Reduce per-token ``values [B, T]`` over the True positions of ``mask`` (bool ``[B, T]``):
    ``"token-mean"`` = sum / number of masked-in tokens; ``"seq-mean-token-mean"`` = mean over
    rows with at least one token of each row's token mean. 0 (still differentiable) when no
    token counts."""
    if mode not in AGGREGATIONS:
        raise ConfigError(f"aggregation must be one of {AGGREGATIONS}, got {mode!r}")
    keep = mask.to(torch.bool)
    weight = keep.to(values.dtype)
    v = values.masked_fill(~keep, 0.0)
    if mode == "token-mean":
        return v.sum() / weight.sum().clamp(min=1.0)
    per_row_tokens = weight.sum(dim=1)
    per_row = v.sum(dim=1) / per_row_tokens.clamp(min=1.0)
    rows = (per_row_tokens > 0).to(values.dtype).sum().clamp(min=1.0)
    return per_row.sum() / rows


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k3"
) -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from ``log r = ref_logprobs − logprobs``
    (``r = π_ref/π_θ``): k1 ``= −log r``, k2 ``= ½(log r)²``, k3 ``= r − 1 − log r`` (Schulman's
    low-variance, always >= 0). Gradient flows through ``logprobs`` only."""
    if estimator not in KL_ESTIMATORS:
        raise ConfigError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    log_r = (ref_logprobs.detach() - logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r * log_r
    return torch.exp(log_r) - 1.0 - log_r


def tis_weights(
    old_logprobs: torch.Tensor, behav_logprobs: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance weights ``min(exp(old − behav), cap)`` per token, detached:
    ``old`` = the trainer's log-probs of the sampling weights, ``behav`` = the rollout engine's.
    ``cap >= 1`` (``math.inf``: no truncation)."""
    _check_cap("tis_weights", "cap", cap)
    log_w = (old_logprobs.detach() - behav_logprobs.detach()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(log_w).clamp(max=cap)


def rejection_mask(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    *,
    low: float,
    high: float,
    level: RejectLevel = "token",
) -> torch.Tensor:
    """Bool ``[B, T]``: the positions of ``mask`` kept after rejecting ratios ``exp(log_ratio)``
    outside ``[low, high]``. ``level="token"`` rejects single tokens; ``"sequence"`` rejects
    whole rows whose geometric-mean ratio ``exp(mean over the row's tokens of log_ratio)`` is
    outside the range."""
    _check_reject_range("rejection_mask", (low, high))
    if level not in REJECT_LEVELS:
        raise ConfigError(f"rejection_mask: level must be one of {REJECT_LEVELS}, got {level!r}")
    keep = mask.to(torch.bool)
    lr = log_ratio.detach().masked_fill(~keep, 0.0)
    if level == "token":
        ratio = torch.exp(lr)
        return keep & (ratio >= low) & (ratio <= high)
    tokens = keep.sum(dim=1).clamp(min=1).to(lr.dtype)
    geo = torch.exp(lr.sum(dim=1) / tokens)
    ok = (geo >= low) & (geo <= high)
    return keep & ok.unsqueeze(1)


def ppo_clip_objective(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
) -> torch.Tensor:
    """Per-token PPO-clip loss ``−min(ρ·A, clip(ρ, 1−clip_low, 1+clip_high)·A)`` with
    ``ρ = exp(logprobs − old_logprobs)`` (``clip_high=None``: symmetric). With ``dual_clip`` c,
    a token with ``A < 0`` has its loss bounded by ``−c·A``. Unreduced ``[B, T]``; the gradient
    is zero where a clip is active."""
    eps_low, eps_high = _check_clip("ppo_clip_objective", clip_low, clip_high, dual_clip)
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return _clipped_loss(torch.exp(log_ratio), advantages.detach(), eps_low, eps_high, dual_clip)


def _clipped_loss(
    ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float, dual: float | None
) -> torch.Tensor:
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    if dual is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual * adv), loss)
    return loss


# --------------------------------------------------------------------------------------------
# Knob validation
# --------------------------------------------------------------------------------------------
def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and not math.isnan(v)


def _check_clip(
    who: str, clip_low: float, clip_high: float | None, dual_clip: float | None
) -> tuple[float, float]:
    if not _is_number(clip_low) or not 0 < clip_low < 1:
        raise ConfigError(f"{who}: clip_low (ε_low) must be a number in (0, 1), got {clip_low!r}")
    high = clip_low if clip_high is None else clip_high
    if not _is_number(high) or not 0 < high < math.inf:
        raise ConfigError(
            f"{who}: clip_high (ε_high) must be a finite number > 0 or None (= clip_low), got "
            f"{clip_high!r}"
        )
    if dual_clip is not None and (not _is_number(dual_clip) or not 1 < dual_clip < math.inf):
        raise ConfigError(
            f"{who}: dual_clip (c) must be a finite number > 1 or None (off), got {dual_clip!r}"
        )
    return float(clip_low), float(high)


def _check_cap(who: str, name: str, cap: float | None) -> None:
    if cap is not None and (not _is_number(cap) or cap < 1):
        raise ConfigError(
            f"{who}: {name} must be a number >= 1 (math.inf: no truncation) or None, got {cap!r}"
        )


def _check_reject_range(who: str, bounds: object) -> None:
    ok = (
        isinstance(bounds, tuple | list)
        and len(bounds) == 2
        and all(_is_number(v) for v in bounds)
        and 0 <= bounds[0] <= 1 <= bounds[1]
        and bounds[0] < bounds[1]
    )
    if not ok:
        raise ConfigError(
            f"{who}: reject_range must be (low, high) with 0 <= low <= 1 <= high and low < high "
            f"(high may be math.inf), got {bounds!r}"
        )


# --------------------------------------------------------------------------------------------
# Loss functions
# --------------------------------------------------------------------------------------------
_Fetch = Callable[[str, str], torch.Tensor]

_BEHAV_HINT = "the rollout engine's per-token log-probs of the response, π_behav"
_PROX_HINT = (
    "π_prox, the proximal policy's per-token log-probs: before the update, the pipeline must run "
    "TrainEngine.compute_logprobs(batch) with the trainer's current weights and add the result "
    "to the batch as 'prox_logprobs', padded like 'logprobs'"
)
_REF_HINT = "the reference policy's per-token log-probs, needed because kl_coef > 0"


@dataclass(frozen=True, kw_only=True)
class _PPOLoss:
    """Knobs shared by the PPO losses; see ``PPOClipLoss`` and ``DecoupledPPOLoss``."""

    clip_low: float = 0.2
    clip_high: float | None = None
    dual_clip: float | None = None
    tis_cap: float | None = None
    reject_range: tuple[float, float] | None = None
    reject_level: RejectLevel = "token"
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    aggregation: Aggregation = "token-mean"

    def __post_init__(self) -> None:
        who = type(self).__name__
        _check_clip(who, self.clip_low, self.clip_high, self.dual_clip)
        _check_cap(who, "tis_cap", self.tis_cap)
        if self.reject_range is not None:
            _check_reject_range(who, self.reject_range)
        if self.reject_level not in REJECT_LEVELS:
            raise ConfigError(
                f"{who}: reject_level must be one of {REJECT_LEVELS}, got {self.reject_level!r}"
            )
        if not _is_number(self.kl_coef) or not 0 <= self.kl_coef < math.inf:
            raise ConfigError(
                f"{who}: kl_coef (β) must be a finite number >= 0, got {self.kl_coef!r}"
            )
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError(
                f"{who}: kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}"
            )
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(
                f"{who}: aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}"
            )

    def _anchor(self, fetch: _Fetch) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """``(old, behav, weighted)``: the log-probs the ratio is taken against, the behaviour
        log-probs when an off-policy correction needs them, and whether the importance weight
        ``exp(old − behav)`` (truncated at ``tis_cap``) multiplies the loss."""
        raise NotImplementedError

    def __call__(
        self, logprobs: torch.Tensor, batch: Batch
    ) -> tuple[torch.Tensor, dict[str, float]]:
        who = type(self).__name__
        _shape(logprobs, batch, who)
        dtype = _work_dtype(logprobs)
        mask = response_mask(logprobs, batch)
        pad = ~mask
        lp = logprobs.to(dtype).masked_fill(pad, 0.0)

        def fetch(name: str, hint: str) -> torch.Tensor:
            return _token_field(batch, name, lp, dtype, who, hint).masked_fill(pad, 0.0)

        adv = _advantages(batch, lp, dtype, who).masked_fill(pad, 0.0)
        old, behav, weighted = self._anchor(fetch)
        eps_low, eps_high = _check_clip(who, self.clip_low, self.clip_high, self.dual_clip)

        keep = mask
        off_log = None if behav is None else old - behav  # log π_old/π_behav
        if self.reject_range is not None and off_log is not None:
            low, high = self.reject_range
            keep = rejection_mask(off_log, mask, low=low, high=high, level=self.reject_level)

        log_ratio = (lp - old).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        ratio = torch.exp(log_ratio)
        token_loss = _clipped_loss(ratio, adv, eps_low, eps_high, self.dual_clip)
        weight: torch.Tensor | None = None
        if weighted and behav is not None:
            cap = math.inf if self.tis_cap is None else self.tis_cap
            weight = tis_weights(old, behav, cap)
            token_loss = token_loss * weight
        pg_loss = aggregate_loss(token_loss, keep, self.aggregation)
        loss = pg_loss

        stats: dict[str, torch.Tensor] = {}
        kl_ref: torch.Tensor | None = None
        if self.kl_coef > 0:
            ref = fetch(REF_LOGPROBS, _REF_HINT)
            kl_ref = aggregate_loss(kl_penalty(lp, ref, self.kl_estimator), keep, self.aggregation)
            loss = loss + self.kl_coef * kl_ref

        with torch.no_grad():
            kept = keep.to(dtype)
            n_kept = kept.sum().clamp(min=1.0)

            def mean(x: torch.Tensor) -> torch.Tensor:
                return (x.to(dtype) * kept).sum() / n_kept

            r = ratio.detach()
            clipped = ((adv > 0) & (r > 1.0 + eps_high)) | ((adv < 0) & (r < 1.0 - eps_low))
            stats["loss"] = loss.detach()
            stats["pg_loss"] = pg_loss.detach()
            stats["clip_frac"] = mean(clipped)
            if self.dual_clip is not None:
                stats["dual_clip_frac"] = mean((adv < 0) & (r > self.dual_clip))
            stats["ratio_mean"] = mean(r)
            # KL(π_old ‖ π_θ), k3 with ratio π_θ/π_old over tokens sampled (nearly) from π_old
            stats["approx_kl"] = mean(r - 1.0 - log_ratio.detach())
            stats["advantage_mean"] = mean(adv)
            if weight is not None:
                stats["is_weight_mean"] = mean(weight)
                if self.tis_cap is not None and behav is not None:
                    raw = (old - behav).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
                    stats["is_weight_trunc_frac"] = mean(raw > self.tis_cap)
            if self.reject_range is not None:
                total = mask.sum().clamp(min=1)
                stats["masked_frac"] = 1.0 - keep.sum().to(dtype) / total.to(dtype)
            if kl_ref is not None:
                stats["kl_ref"] = kl_ref.detach()
            stats["tokens"] = kept.sum()
        values = torch.stack([v.to(dtype).reshape(()) for v in stats.values()]).tolist()
        return loss, dict(zip(stats, (float(v) for v in values), strict=True))


@dataclass(frozen=True, kw_only=True)
class PPOClipLoss(_PPOLoss):
    """PPO-clip ``LossFn`` (arXiv 1707.06347):

    ``loss = agg( −w · min(ρ·A, clip(ρ, 1−ε_low, 1+ε_high)·A) ) [+ β·agg(KL(π_θ‖π_ref))]``

    with ``ρ = π_θ/π_old``, ``π_old`` from field ``old_logprobs_field`` (default ``"logprobs"``:
    the rollout's behaviour log-probs, so the batch needs ``advantage`` and ``logprobs``).

    Knobs: ``clip_low`` ε_low in (0, 1) (default 0.2); ``clip_high`` ε_high > 0 (None: = ε_low;
    larger is DAPO's clip-higher); ``dual_clip`` c > 1 (None: off) bounds the loss of ``A < 0``
    tokens by ``−c·A``; ``kl_coef`` β >= 0 and ``kl_estimator`` ("k1"/"k2"/"k3", default k3) add
    ``β·KL`` against field ``ref_logprobs`` (β = 0: no term, field not needed);
    ``aggregation`` ("token-mean" default, or "seq-mean-token-mean").

    Rollout/trainer mismatch: set ``old_logprobs_field="prox_logprobs"`` (the trainer's own
    log-probs of the sampling weights, computed by the pipeline before the update) and
    ``tis_cap`` C >= 1 to multiply in ``w = min(π_old/π_behav, C)`` (TIS), and/or
    ``reject_range=(low, high)`` with ``reject_level`` "token"/"sequence" to drop tokens/rows
    whose ``π_old/π_behav`` leaves the range (masked fraction in ``metrics["masked_frac"]``).
    Both need the behaviour ``logprobs`` too, and an ``old_logprobs_field`` other than
    ``"logprobs"`` (the weights would be 1). Without them ``w = 1``.

    Metrics: loss, pg_loss, clip_frac, dual_clip_frac (with dual_clip), ratio_mean, approx_kl
    (KL(π_old‖π_θ), k3), advantage_mean, is_weight_mean / is_weight_trunc_frac (with TIS),
    masked_frac (with rejection), kl_ref (with β > 0), tokens (kept tokens).
    """

    old_logprobs_field: str = BEHAVIOUR_LOGPROBS

    def __post_init__(self) -> None:
        super().__post_init__()
        f = self.old_logprobs_field
        if not isinstance(f, str) or not f:
            raise ConfigError(f"PPOClipLoss: old_logprobs_field must be a field name, got {f!r}")
        if f == BEHAVIOUR_LOGPROBS and (self.tis_cap is not None or self.reject_range is not None):
            raise ConfigError(
                "PPOClipLoss: tis_cap and reject_range compare the trainer's old log-probs with "
                f"the behaviour log-probs {BEHAVIOUR_LOGPROBS!r}, but old_logprobs_field is "
                f"{f!r} too (every weight would be 1); set old_logprobs_field to the field "
                f"holding the trainer's recomputation, e.g. {PROX_LOGPROBS!r}"
            )

    def _anchor(self, fetch: _Fetch) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        f = self.old_logprobs_field
        if f == BEHAVIOUR_LOGPROBS:
            return fetch(f, _BEHAV_HINT), None, False
        hint = "π_old, the trainer's per-token log-probs of the sampling weights"
        old = fetch(f, hint)
        if self.tis_cap is None and self.reject_range is None:
            return old, None, False
        return old, fetch(BEHAVIOUR_LOGPROBS, _BEHAV_HINT), self.tis_cap is not None


@dataclass(frozen=True, kw_only=True)
class DecoupledPPOLoss(_PPOLoss):
    """Decoupled PPO ``LossFn`` for stale samples (Hilton et al., arXiv 2110.00641; AReaL,
    arXiv 2505.24298, eq. "decoupled PPO objective"):

    ``J(θ) = E_{a ~ π_behav}[ Σ_t  (π_prox(a_t|s_t) / π_behav(a_t|s_t)) ·
    min( u_t^prox(θ)·Â_t, clip(u_t^prox(θ), 1−ε, 1+ε)·Â_t ) ]``,
    ``u_t^prox(θ) = π_θ(a_t|s_t) / π_prox(a_t|s_t)``

    and ``loss = −agg(...)`` (+ ``β·KL`` to ``ref_logprobs`` when ``kl_coef > 0``). The trust
    region is centred on the proximal policy π_prox (the trainer's weights at the start of the
    update), not on the stale behaviour policy π_behav that sampled the tokens; the importance
    weight ``w = π_prox/π_behav`` is detached (a constant) and truncated at ``tis_cap`` when set
    (``min(w, C)``, truncated IS). ``clip_low``/``clip_high`` are ε (asymmetric allowed),
    ``dual_clip``, ``reject_range``/``reject_level`` (on ``w``), ``kl_coef``/``kl_estimator``
    and ``aggregation`` act as in ``PPOClipLoss``.

    Batch fields: ``advantage``, ``logprobs`` (π_behav, from the rollout engine) and
    ``prox_logprobs`` (π_prox): **the pipeline must compute ``prox_logprobs``** — before the
    optimizer step, ``TrainEngine.compute_logprobs(batch)`` with the current weights, stored
    padded like ``logprobs``. With ``prox_logprobs == logprobs`` this is exactly
    ``PPOClipLoss`` with the same knobs.

    Metrics: those of ``PPOClipLoss`` with ratio_mean/approx_kl taken against π_prox, plus
    is_weight_mean (and is_weight_trunc_frac with ``tis_cap``).
    """

    def _anchor(self, fetch: _Fetch) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        behav = fetch(BEHAVIOUR_LOGPROBS, _BEHAV_HINT)
        return fetch(PROX_LOGPROBS, _PROX_HINT), behav, True


def policy_gradient_loss(
    logprobs: torch.Tensor, batch: Batch
) -> tuple[torch.Tensor, Mapping[str, float]]:
    """``-mean(advantage · logprob)`` over the response tokens of ``batch``.

    ``logprobs``: ``[B, T]`` current-policy log-probs of the response tokens; ``batch`` needs an
    ``advantage`` field (one value per row) and ``lengths["response"]`` (tokens per row; all
    ``T`` tokens count without it); a ``loss_mask`` field limits the mean to the tokens it
    marks (``response_mask``)."""
    if "advantage" not in batch:
        raise BadRequestError(
            f"policy_gradient_loss needs an 'advantage' field; the batch has {sorted(batch.data)}"
        )
    adv = torch.as_tensor(batch["advantage"], dtype=logprobs.dtype).reshape(-1)
    b = logprobs.shape[0]
    if adv.numel() != b:
        raise BadRequestError(
            f"policy_gradient_loss: {adv.numel()} advantages for {b} rows of logprobs"
        )
    mask = response_mask(logprobs, batch).to(logprobs.dtype)
    tokens = mask.sum().clamp(min=1.0)
    loss = -(adv.unsqueeze(1) * logprobs * mask).sum() / tokens
    return loss, {"pg_loss": float(loss.detach()), "advantage_mean": float(adv.mean())}


__all__ = [
    "ADVANTAGE",
    "AGGREGATIONS",
    "BEHAVIOUR_LOGPROBS",
    "KL_ESTIMATORS",
    "LOSS_MASK",
    "MAX_LOG_RATIO",
    "PROX_LOGPROBS",
    "REF_LOGPROBS",
    "REJECT_LEVELS",
    "Aggregation",
    "DecoupledPPOLoss",
    "KLEstimator",
    "PPOClipLoss",
    "RejectLevel",
    "aggregate_loss",
    "group_advantages",
    "grpo_advantages",
    "kl_penalty",
    "policy_gradient_loss",
    "ppo_clip_objective",
    "rejection_mask",
    "response_mask",
    "rloo_advantages",
    "tis_weights",
]
