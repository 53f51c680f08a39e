"""Engine-agnostic RL math in plain torch: group-relative advantages and a policy-gradient loss.

``group_advantages(rewards, groups)``: GRPO's advantage of each sample is its reward minus the
mean reward of its group (the samples of one prompt), divided by the group's standard
deviation (``normalize_std=True``; Dr. GRPO drops the division) plus ``eps``.

``policy_gradient_loss``: the REINFORCE-style loss ``-mean(A · log π(token))`` over response
tokens, a ``LossFn`` any ``TrainEngine`` can take; richer objectives (PPO-clip, decoupled PPO)
plug in the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from asyncflow_core.errors import BadRequestError
from asyncflow_core.protocols import Batch


def group_advantages(
    rewards: torch.Tensor | Sequence[float],
    groups: Sequence[int | str],
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-sample advantage ``(r - mean_group(r)) / (std_group(r) + eps)`` (population std;
    a group of one sample gets advantage 0)."""
    r = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)
    if r.numel() != len(groups):
        raise BadRequestError(
            f"group_advantages: {r.numel()} rewards but {len(groups)} group ids; pass one "
            "group id per reward"
        )
    if not torch.isfinite(r).all():
        bad = [i for i, ok in enumerate(torch.isfinite(r).tolist()) if not ok]
        raise BadRequestError(f"group_advantages: rewards at positions {bad} are not finite")
    index: dict[int | str, int] = {}
    ids = torch.tensor([index.setdefault(g, len(index)) for g in groups], dtype=torch.long)
    k = len(index)
    count = torch.zeros(k).index_add_(0, ids, torch.ones_like(r))
    mean = torch.zeros(k).index_add_(0, ids, r) / count
    centered = r - mean[ids]
    if not normalize_std:
        return centered
    var = torch.zeros(k).index_add_(0, ids, centered * centered) / count
    return centered / (var.sqrt()[ids] + eps)


def policy_gradient_loss(
    logprobs: torch.Tensor, batch: Batch
) -> tuple[torch.Tensor, Mapping[str, float]]:
    """``-mean(advantage · logprob)`` over the response tokens of ``batch``.

    ``logprobs``: ``[B, T]`` current-policy log-probs of the response tokens; ``batch`` needs an
    ``advantage`` field (one value per row) and ``lengths["response"]`` (tokens per row; all
    ``T`` tokens count without it)."""
    if "advantage" not in batch:
        raise BadRequestError(
            f"policy_gradient_loss needs an 'advantage' field; the batch has {sorted(batch.data)}"
        )
    adv = torch.as_tensor(batch["advantage"], dtype=logprobs.dtype).reshape(-1)
    b, t = logprobs.shape[0], logprobs.shape[1]
    if adv.numel() != b:
        raise BadRequestError(
            f"policy_gradient_loss: {adv.numel()} advantages for {b} rows of logprobs"
        )
    lengths = batch.lengths.get("response")
    if lengths is None:
        mask = torch.ones(b, t, dtype=logprobs.dtype)
    else:
        mask = (torch.arange(t).unsqueeze(0) < lengths.reshape(-1, 1)).to(logprobs.dtype)
    tokens = mask.sum().clamp(min=1.0)
    loss = -(adv.unsqueeze(1) * logprobs * mask).sum() / tokens
    return loss, {"pg_loss": float(loss.detach()), "advantage_mean": float(adv.mean())}


__all__ = ["group_advantages", "policy_gradient_loss"]
