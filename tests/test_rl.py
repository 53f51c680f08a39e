"""RL advantages, objectives and their building blocks, against values computed by hand.

Every expected number below is derived in the comment next to it from the formula, not from the
code under test. Tensors are float64 so the hand values hold to ~1e-9.
"""

from __future__ import annotations

import math
import pickle
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow_core.contracts.errors import BadRequestError, ConfigError
from asyncflow_core.contracts.protocols import Batch, LossFn
from asyncflow_core.training.rl import (
    DecoupledPPOLoss,
    PPOClipLoss,
    aggregate_loss,
    group_advantages,
    grpo_advantages,
    kl_penalty,
    policy_gradient_loss,
    ppo_clip_objective,
    rejection_mask,
    response_mask,
    rloo_advantages,
    tis_weights,
)

F64 = torch.float64


def t(values: Any) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def log(values: Any) -> torch.Tensor:
    return torch.log(t(values))


def leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


def batch(lengths: list[int] | None = None, *, rows: int | None = None, **data: Any) -> Batch:
    if rows is None:
        rows = len(lengths) if lengths is not None else len(next(iter(data.values())))
    lens = {} if lengths is None else {"response": torch.tensor(lengths)}
    return Batch(rows=tuple(range(rows)), data=dict(data), lengths=lens)


def grad_of(loss_fn: LossFn, lp: torch.Tensor, b: Batch) -> tuple[float, torch.Tensor]:
    x = leaf(lp)
    loss, _ = loss_fn(x, b)
    loss.backward()
    assert x.grad is not None
    return loss.item(), x.grad


# --------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------
def test_group_advantages_normalize_within_each_group() -> None:
    adv = group_advantages([1.0, 3.0, 0.0, 0.0, 5.0], ["a", "a", "b", "b", "c"])
    # group a: mean 2, std 1 -> -1, +1; group b: all equal -> 0; group c: alone -> 0
    assert adv.tolist() == pytest.approx([-1.0, 1.0, 0.0, 0.0, 0.0], abs=1e-5)
    raw = group_advantages([1.0, 3.0, 2.0], [7, 7, 7], normalize_std=False)
    assert raw.tolist() == pytest.approx([-1.0, 1.0, 0.0])
    assert grpo_advantages([1.0, 3.0], [0, 0]).tolist() == pytest.approx([-1.0, 1.0], abs=1e-5)


def test_group_advantages_reject_bad_input_by_name() -> None:
    with pytest.raises(BadRequestError, match="group_advantages: 3 rewards but 2 group ids"):
        group_advantages([1.0, 2.0, 3.0], [0, 0])
    with pytest.raises(BadRequestError, match=r"positions \[1\]"):
        group_advantages([1.0, float("nan")], [0, 0])


def test_rloo_subtracts_the_mean_of_the_other_samples() -> None:
    adv = rloo_advantages([1.0, 2.0, 6.0, 3.0, 0.0, 4.0], ["a", "a", "a", "b", "c", "c"])
    # a: 1-(2+6)/2 = -3, 2-(1+6)/2 = -1.5, 6-(1+2)/2 = 4.5; b alone: 0; c: 0-4 = -4, 4-0 = 4
    assert adv.tolist() == pytest.approx([-3.0, -1.5, 4.5, 0.0, -4.0, 4.0])
    # equal rewards: no signal
    assert rloo_advantages(torch.tensor([2.0, 2.0]), [1, 1]).tolist() == [0.0, 0.0]
    with pytest.raises(BadRequestError, match="rloo_advantages: 2 rewards but 1 group ids"):
        rloo_advantages([1.0, 2.0], [0])
    with pytest.raises(BadRequestError, match=r"rloo_advantages: rewards at positions \[0\]"):
        rloo_advantages([float("inf"), 2.0], [0, 0])


# --------------------------------------------------------------------------------------------
# policy_gradient_loss (unchanged)
# --------------------------------------------------------------------------------------------
def test_policy_gradient_loss_masks_padding_and_weights_by_advantage() -> None:
    logprobs = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    b = Batch(
        rows=(0, 1),
        data={"advantage": torch.tensor([2.0, -1.0])},
        lengths={"response": torch.tensor([2, 3])},
    )
    loss, metrics = policy_gradient_loss(logprobs, b)
    # -(2*(-1-2) + (-1)*(-1.5)) / 5 tokens = -(-6 + 1.5)/5 = 0.9; the padded -9 is ignored
    assert float(loss.detach()) == pytest.approx(0.9)
    loss.backward()
    assert logprobs.grad is not None
    assert float(logprobs.grad[0, 2]) == 0.0
    assert metrics["advantage_mean"] == pytest.approx(0.5)
    with pytest.raises(BadRequestError, match="'advantage' field"):
        policy_gradient_loss(logprobs, Batch(rows=(0, 1), data={}))


# --------------------------------------------------------------------------------------------
# PPO-clip
# --------------------------------------------------------------------------------------------
# The 2x3 batch of most tests: row 0 has 2 response tokens (column 2 is padding), row 1 has 3.
# Ratios π_θ/π_old: row 0 [1.1, 1.5, pad], row 1 [0.5, 0.9, 1.3]; advantages A = [+1, -2].
OLD = log([[0.5, 0.4, 0.3], [0.6, 0.5, 0.2]])
RATIO = t([[1.1, 1.5, 1.0], [0.5, 0.9, 1.3]])
NEW = OLD + torch.log(RATIO)


def ppo_batch(**extra: Any) -> Batch:
    return batch([2, 3], advantage=t([1.0, -2.0]), logprobs=OLD, **extra)


def test_ppo_clip_value_gradient_and_metrics_by_hand() -> None:
    # ε = 0.2, per-token loss -min(ρA, clip(ρ, 0.8, 1.2)A):
    #   (0,0) ρ=1.1 A=+1: min(1.1, 1.1)   -> -1.1  unclipped, dL/dlogπ = -Aρ = -1.1
    #   (0,1) ρ=1.5 A=+1: min(1.5, 1.2)   -> -1.2  clipped, gradient 0
    #   (1,0) ρ=0.5 A=-2: min(-1.0, -1.6) ->  1.6  clipped, gradient 0
    #   (1,1) ρ=0.9 A=-2: min(-1.8, -1.8) ->  1.8  inside, dL/dlogπ = 1.8
    #   (1,2) ρ=1.3 A=-2: min(-2.6, -2.4) ->  2.6  unclipped (pessimistic side), 2.6
    # token-mean over 5 tokens: (-1.1 - 1.2 + 1.6 + 1.8 + 2.6) / 5 = 0.74
    loss_fn = PPOClipLoss(clip_low=0.2)
    x = leaf(NEW)
    loss, metrics = loss_fn(x, ppo_batch())
    assert loss.item() == pytest.approx(0.74)
    loss.backward()
    assert x.grad is not None
    expected = [[-1.1 / 5, 0.0, 0.0], [0.0, 1.8 / 5, 2.6 / 5]]
    assert x.grad.tolist() == [pytest.approx(row) for row in expected]
    assert metrics["loss"] == pytest.approx(0.74)
    assert metrics["pg_loss"] == pytest.approx(0.74)
    assert metrics["clip_frac"] == pytest.approx(2 / 5)
    assert metrics["ratio_mean"] == pytest.approx((1.1 + 1.5 + 0.5 + 0.9 + 1.3) / 5)
    # approx KL(old‖new) = mean(ρ - 1 - ln ρ): 0.0046898 + 0.0945349 + 0.1931472 + 0.0053605
    # + 0.0376357 = 0.3353681, / 5
    assert metrics["approx_kl"] == pytest.approx(0.3353681 / 5, abs=1e-7)
    assert metrics["advantage_mean"] == pytest.approx((1 + 1 - 2 - 2 - 2) / 5)
    assert metrics["tokens"] == 5.0
    assert "kl_ref" not in metrics and "masked_frac" not in metrics


def test_ppo_clip_objective_is_the_per_token_loss() -> None:
    per_token = ppo_clip_objective(NEW, OLD, t([[1.0] * 3, [-2.0] * 3]), clip_low=0.2)
    assert per_token[0, :2].tolist() == pytest.approx([-1.1, -1.2])
    assert per_token[1].tolist() == pytest.approx([1.6, 1.8, 2.6])


def test_ppo_clip_higher_is_asymmetric() -> None:
    # row 0: A=+1, ρ=1.25; row 1: A=-1, ρ=0.75 (one token each)
    old = log([[0.4], [0.4]])
    new = old + log([[1.25], [0.75]])
    b = batch(advantage=t([1.0, -1.0]), logprobs=old)
    # symmetric 0.2: both clipped: (-1.2 + 0.8) / 2 = -0.2, no gradient
    value, grad = grad_of(PPOClipLoss(clip_low=0.2), new, b)
    assert value == pytest.approx(-0.2)
    assert grad.tolist() == [[0.0], [0.0]]
    # clip-higher ε_high = 0.28: ρ=1.25 < 1.28 is inside: (-1.25 + 0.8) / 2 = -0.225
    value, grad = grad_of(PPOClipLoss(clip_low=0.2, clip_high=0.28), new, b)
    assert value == pytest.approx(-0.225)
    assert grad.tolist() == [[pytest.approx(-1.25 / 2)], [0.0]]
    # ε_low = 0.3, ε_high = 0.2: ρ=0.75 > 0.7 inside, ρ=1.25 clipped: (-1.2 + 0.75) / 2
    value, grad = grad_of(PPOClipLoss(clip_low=0.3, clip_high=0.2), new, b)
    assert value == pytest.approx(-0.225)
    assert grad.tolist() == [[0.0], [pytest.approx(0.75 / 2)]]


def test_ppo_dual_clip_bounds_negative_advantage_tokens() -> None:
    # row 0: A=-2, ρ=[4, 2]; row 1: A=+1, ρ=[4, 1]; ε = 0.2, c = 3
    old = log([[0.1, 0.2], [0.1, 0.5]])
    new = old + log([[4.0, 2.0], [4.0, 1.0]])
    b = batch(advantage=t([-2.0, 1.0]), logprobs=old)
    # without dual clip: (0,0) -min(-8, -2.4) = 8 (grad -Aρ = 8); (0,1) 4 (grad 4);
    # (1,0) clipped -1.2; (1,1) -1 (grad -1) -> (8 + 4 - 1.2 - 1) / 4 = 2.45
    value, grad = grad_of(PPOClipLoss(), new, b)
    assert value == pytest.approx(2.45)
    assert grad.tolist() == [pytest.approx([2.0, 1.0]), pytest.approx([0.0, -0.25])]
    # dual clip: (0,0) min(8, -cA = 6) = 6, gradient 0; (0,1) 4 < 6 stays; A>0 unaffected
    # -> (6 + 4 - 1.2 - 1) / 4 = 1.95
    x = leaf(new)
    loss, metrics = PPOClipLoss(dual_clip=3.0)(x, b)
    loss.backward()
    assert loss.item() == pytest.approx(1.95)
    assert x.grad is not None
    assert x.grad.tolist() == [pytest.approx([0.0, 1.0]), pytest.approx([0.0, -0.25])]
    assert metrics["dual_clip_frac"] == pytest.approx(1 / 4)
    assert metrics["clip_frac"] == pytest.approx(1 / 4)  # (1,0); (0,0) is dual-clipped


def test_seq_mean_token_mean_aggregation() -> None:
    # per-token losses from the first test: row 0 [-1.1, -1.2] -> mean -1.15;
    # row 1 [1.6, 1.8, 2.6] -> mean 2.0; mean of rows: 0.425 (token-mean gave 0.74)
    value, grad = grad_of(PPOClipLoss(aggregation="seq-mean-token-mean"), NEW, ppo_batch())
    assert value == pytest.approx(0.425)
    # row 0 token (0,0): -1.1 / 2 tokens / 2 rows; row 1 tokens: x / 3 tokens / 2 rows
    assert grad.tolist() == [
        pytest.approx([-1.1 / 4, 0.0, 0.0]),
        pytest.approx([0.0, 1.8 / 6, 2.6 / 6]),
    ]


def test_aggregate_loss_modes_by_hand() -> None:
    values = t([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 6.0, 7.0]])
    mask = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    # token-mean: (1 + 2 + 3 + 4) / 4 = 2.5; seq-mean: (2 + 4) / 2 rows with tokens = 3
    assert float(aggregate_loss(values, mask)) == pytest.approx(2.5)
    assert float(aggregate_loss(values, mask, "seq-mean-token-mean")) == pytest.approx(3.0)
    # no token at all: 0, not NaN
    none = torch.zeros(3, 3, dtype=torch.bool)
    assert float(aggregate_loss(values, none)) == 0.0
    assert float(aggregate_loss(values, none, "seq-mean-token-mean")) == 0.0


# --------------------------------------------------------------------------------------------
# Decoupled PPO, TIS, rejection
# --------------------------------------------------------------------------------------------
# One row, two tokens, A = +1. w = π_prox/π_behav = [2, 0.5]; ρ = π_θ/π_prox = [1.1, 1.0].
BEHAV = log([[0.2, 0.4]])
PROX = log([[0.4, 0.2]])
CUR = PROX + log([[1.1, 1.0]])


def test_decoupled_ppo_applies_the_importance_weight() -> None:
    b = batch(advantage=t([1.0]), logprobs=BEHAV, prox_logprobs=PROX)
    # -(2·1.1 + 0.5·1.0) / 2 = -1.35; dL/dlogπ = -w·A·ρ / 2 = [-1.1, -0.25]
    x = leaf(CUR)
    loss, metrics = DecoupledPPOLoss()(x, b)
    loss.backward()
    assert loss.item() == pytest.approx(-1.35)
    assert x.grad is not None
    assert x.grad.tolist() == [pytest.approx([-1.1, -0.25])]
    assert metrics["is_weight_mean"] == pytest.approx(1.25)
    assert metrics["ratio_mean"] == pytest.approx(1.05)
    # truncated at 1.5: w = [1.5, 0.5] -> -(1.65 + 0.5) / 2 = -1.075, gradient [-0.825, -0.25]
    x = leaf(CUR)
    loss, metrics = DecoupledPPOLoss(tis_cap=1.5)(x, b)
    loss.backward()
    assert loss.item() == pytest.approx(-1.075)
    assert x.grad is not None
    assert x.grad.tolist() == [pytest.approx([-0.825, -0.25])]
    assert metrics["is_weight_mean"] == pytest.approx(1.0)
    assert metrics["is_weight_trunc_frac"] == pytest.approx(0.5)


def test_decoupled_ppo_weight_and_proximal_policy_are_detached() -> None:
    prox_src = leaf(PROX)
    behav_src = leaf(BEHAV)
    b = batch(advantage=t([1.0]), logprobs=behav_src * 1.0, prox_logprobs=prox_src * 1.0)
    x = leaf(CUR)
    loss, _ = DecoupledPPOLoss()(x, b)
    loss.backward()
    assert prox_src.grad is None and behav_src.grad is None
    assert x.grad is not None
    assert x.grad.tolist() == [pytest.approx([-1.1, -0.25])]


def test_decoupled_ppo_is_ppo_clip_when_prox_equals_behaviour() -> None:
    knobs: dict[str, Any] = {"clip_low": 0.2, "clip_high": 0.3, "dual_clip": 3.0}
    b = ppo_batch(prox_logprobs=OLD.clone())
    for aggregation in ("token-mean", "seq-mean-token-mean"):
        value_d, grad_d = grad_of(DecoupledPPOLoss(aggregation=aggregation, **knobs), NEW, b)
        value_p, grad_p = grad_of(PPOClipLoss(aggregation=aggregation, **knobs), NEW, b)
        assert value_d == pytest.approx(value_p)
        assert torch.allclose(grad_d, grad_p)
    assert grad_of(DecoupledPPOLoss(), NEW, b)[0] == pytest.approx(0.74)


def test_tis_weights_are_truncated_and_detached() -> None:
    behav = log([0.2, 0.2, 0.2, 0.4])
    old = leaf(log([0.1, 0.3, 0.6, 0.4]))  # ratios 0.5, 1.5, 3.0, 1.0
    w = tis_weights(old, behav, 2.0)
    assert w.tolist() == pytest.approx([0.5, 1.5, 2.0, 1.0])
    assert not w.requires_grad
    assert tis_weights(old, behav, math.inf).tolist() == pytest.approx([0.5, 1.5, 3.0, 1.0])
    with pytest.raises(ConfigError, match=r"tis_weights: cap must be a number >= 1 .*got 0\.9"):
        tis_weights(old, behav, 0.9)


def test_ppo_clip_with_tis_against_the_trainer_old_logprobs() -> None:
    b = batch(advantage=t([1.0]), logprobs=BEHAV, prox_logprobs=PROX)
    tis = PPOClipLoss(old_logprobs_field="prox_logprobs", tis_cap=1.5)
    # ratio against π_prox [1.1, 1.0], w = min(π_prox/π_behav, 1.5) = [1.5, 0.5]: -1.075
    value, grad = grad_of(tis, CUR, b)
    assert value == pytest.approx(-1.075)
    assert grad.tolist() == [pytest.approx([-0.825, -0.25])]
    assert value == pytest.approx(grad_of(DecoupledPPOLoss(tis_cap=1.5), CUR, b)[0])
    # without tis_cap: plain PPO against π_prox, w = 1: -(1.1 + 1.0) / 2
    plain = PPOClipLoss(old_logprobs_field="prox_logprobs")
    assert grad_of(plain, CUR, b)[0] == pytest.approx(-1.05)


def test_rejection_mask_token_and_sequence_level() -> None:
    # ratios row 0 [0.4, 1.0, pad], row 1 [1.5, 3.0, pad]; keep range [0.5, 2]
    log_ratio = log([[0.4, 1.0, 1e6], [1.5, 3.0, 1e-6]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    token = rejection_mask(log_ratio, mask, low=0.5, high=2.0)
    assert token.tolist() == [[False, True, False], [True, False, False]]
    # geometric means: row 0 sqrt(0.4·1) = 0.632 kept, row 1 sqrt(1.5·3) = 2.12 rejected;
    # the padded ratios would flip both rows if they counted
    seq = rejection_mask(log_ratio, mask, low=0.5, high=2.0, level="sequence")
    assert seq.tolist() == [[True, True, False], [False, False, False]]


def test_rejected_tokens_contribute_nothing() -> None:
    # π_old/π_behav = row 0 [0.4, 1.0], row 1 [1.5, 3.0]; current = π_old (ρ = 1)
    behav = log([[0.5, 0.2], [0.2, 0.1]])
    old = behav + log([[0.4, 1.0], [1.5, 3.0]])
    adv = t([[10.0, 1.0], [2.0, 20.0]])
    b = batch(advantage=adv, logprobs=behav, prox_logprobs=old)
    base: dict[str, Any] = {"old_logprobs_field": "prox_logprobs", "reject_range": (0.5, 2.0)}
    # token level keeps (0,1) and (1,0): -(1 + 2) / 2 = -1.5 (all four: -33/4)
    x = leaf(old)
    loss, metrics = PPOClipLoss(**base)(x, b)
    loss.backward()
    assert loss.item() == pytest.approx(-1.5)
    assert x.grad is not None
    assert x.grad.tolist() == [pytest.approx([0.0, -0.5]), pytest.approx([-1.0, 0.0])]
    assert metrics["masked_frac"] == pytest.approx(0.5)
    assert metrics["tokens"] == 2.0
    # sequence level keeps row 0 only: -(10 + 1) / 2 = -5.5
    value, grad = grad_of(PPOClipLoss(reject_level="sequence", **base), old, b)
    assert value == pytest.approx(-5.5)
    assert grad.tolist() == [pytest.approx([-5.0, -0.5]), [0.0, 0.0]]
    # decoupled PPO rejects on w = π_prox/π_behav the same way (ρ = 1, w multiplies in):
    # kept (0,1) w=1.0 A=1 and (1,0) w=1.5 A=2: -(1 + 3) / 2 = -2
    value, _ = grad_of(DecoupledPPOLoss(reject_range=(0.5, 2.0)), old, b)
    assert value == pytest.approx(-2.0)


# --------------------------------------------------------------------------------------------
# KL to the reference
# --------------------------------------------------------------------------------------------
def test_kl_estimators_by_hand() -> None:
    # token 0: π_θ = 0.5, π_ref = 0.25 -> r = 0.5, log r = -ln 2
    # token 1: π_θ = 0.5, π_ref = 1.0  -> r = 2,   log r = +ln 2
    lp, ref = log([0.5, 0.5]), log([0.25, 1.0])
    ln2 = 0.6931472
    assert kl_penalty(lp, ref, "k1").tolist() == pytest.approx([ln2, -ln2], abs=1e-7)
    assert kl_penalty(lp, ref, "k2").tolist() == pytest.approx([0.2402265] * 2, abs=1e-7)
    # k3 = r - 1 - log r: 0.5 - 1 + ln 2 = 0.1931472; 2 - 1 - ln 2 = 0.3068528
    assert kl_penalty(lp, ref, "k3").tolist() == pytest.approx([0.1931472, 0.3068528], abs=1e-7)
    assert kl_penalty(lp, ref).tolist() == kl_penalty(lp, ref, "k3").tolist()
    # gradients wrt log π_θ: k1 -> 1; k2 -> -log r; k3 -> 1 - r
    for estimator, expected in (("k1", [1.0, 1.0]), ("k2", [ln2, -ln2]), ("k3", [0.5, -1.0])):
        x = leaf(lp)
        kl_penalty(x, ref, estimator).sum().backward()  # type: ignore[arg-type]
        assert x.grad is not None
        assert x.grad.tolist() == pytest.approx(expected, abs=1e-7), estimator
    with pytest.raises(ConfigError, match=r"kl_estimator must be one of .*got 'k9'"):
        kl_penalty(lp, ref, "k9")  # type: ignore[arg-type]


def test_kl_term_is_added_with_its_coefficient() -> None:
    # ρ = 1 and A = 0, so the policy term is 0 and the loss is β · mean(k3) = 0.5 · 0.25
    lp, ref = log([[0.5, 0.5]]), log([[0.25, 1.0]])
    b = batch(advantage=t([0.0]), logprobs=lp, ref_logprobs=ref)
    x = leaf(lp)
    loss, metrics = PPOClipLoss(kl_coef=0.5)(x, b)
    loss.backward()
    assert loss.item() == pytest.approx(0.125)
    assert metrics["kl_ref"] == pytest.approx(0.25)
    assert metrics["pg_loss"] == pytest.approx(0.0)
    assert x.grad is not None
    assert x.grad.tolist() == [pytest.approx([0.5 * 0.5 / 2, 0.5 * -1.0 / 2])]
    value, _ = grad_of(PPOClipLoss(kl_coef=0.5, kl_estimator="k1"), lp, b)
    assert value == pytest.approx(0.0)  # k1 = [ln 2, -ln 2] averages to 0


def test_zero_kl_coefficient_adds_no_term_and_needs_no_reference() -> None:
    with_ref = ppo_batch(ref_logprobs=OLD - 3.0)
    value_0, grad_0 = grad_of(PPOClipLoss(kl_coef=0.0), NEW, with_ref)
    value_none, grad_none = grad_of(PPOClipLoss(), NEW, ppo_batch())
    assert value_0 == pytest.approx(value_none) == pytest.approx(0.74)
    assert torch.equal(grad_0, grad_none)
    _, metrics = PPOClipLoss(kl_coef=0.0)(NEW, with_ref)
    assert "kl_ref" not in metrics
    assert grad_of(PPOClipLoss(kl_coef=0.1), NEW, with_ref)[0] > 0.74 + 0.1  # k3 of 3 nats


# --------------------------------------------------------------------------------------------
# Padding and layouts
# --------------------------------------------------------------------------------------------
def test_padded_positions_never_matter() -> None:
    loss_fn = DecoupledPPOLoss(
        clip_high=0.28, dual_clip=3.0, tis_cap=2.0, reject_range=(0.2, 5.0), kl_coef=0.1,
        aggregation="seq-mean-token-mean",
    )  # fmt: skip
    lengths = [2, 3, 0]
    mask = torch.tensor([[True, True, False], [True, True, True], [False, False, False]])
    cur = log([[0.3, 0.5, 0.2], [0.4, 0.1, 0.3], [0.5, 0.5, 0.5]])
    fields: dict[str, Any] = {
        "logprobs": log([[0.2, 0.4, 0.5], [0.3, 0.2, 0.6], [0.5, 0.5, 0.5]]),
        "prox_logprobs": log([[0.25, 0.45, 0.1], [0.35, 0.15, 0.2], [0.5, 0.5, 0.5]]),
        "ref_logprobs": log([[0.3, 0.3, 0.3], [0.3, 0.3, 0.3], [0.3, 0.3, 0.3]]),
        "advantage": t([[1.0, 2.0, 3.0], [-1.0, -2.0, 0.5], [4.0, 4.0, 4.0]]),
    }
    clean_loss, clean_metrics = loss_fn(leaf(cur), batch(lengths, **fields))
    clean_grad = grad_of(loss_fn, cur, batch(lengths, **fields))[1]
    for junk in (float("nan"), float("inf"), -float("inf"), 1e4):
        dirty = {k: v.masked_fill(~mask, junk) for k, v in fields.items()}
        x = leaf(cur.masked_fill(~mask, junk))
        loss, metrics = loss_fn(x, batch(lengths, **dirty))
        loss.backward()
        assert loss.item() == pytest.approx(clean_loss.item()), junk
        assert metrics == pytest.approx(clean_metrics), junk
        assert x.grad is not None
        assert torch.equal(x.grad, clean_grad), junk
        assert bool((x.grad[~mask] == 0).all())


def test_per_row_fields_in_list_and_nested_layouts_match_padded() -> None:
    padded = ppo_batch(ref_logprobs=OLD - 1.0)
    rows = [OLD[0, :2], OLD[1]]
    ref_rows = [OLD[0, :2] - 1.0, OLD[1] - 1.0]
    as_list = ppo_batch(ref_logprobs=ref_rows)
    as_list.data["logprobs"] = rows
    as_list.data["advantage"] = [torch.tensor(1.0), torch.tensor(-2.0)]
    nested = ppo_batch(ref_logprobs=torch.nested.nested_tensor(ref_rows, layout=torch.jagged))
    nested.data["logprobs"] = torch.nested.nested_tensor(rows, layout=torch.jagged)
    nested.data["advantage"] = [1.0, -2.0]
    column = ppo_batch(ref_logprobs=OLD - 1.0)
    column.data["advantage"] = t([[1.0], [-2.0]])
    loss_fn = PPOClipLoss(kl_coef=0.2)
    expected = loss_fn(NEW, padded)[0].item()
    for b in (as_list, nested, column):
        assert loss_fn(NEW, b)[0].item() == pytest.approx(expected)


def test_response_mask_from_lengths() -> None:
    b = ppo_batch()
    assert response_mask(NEW, b).tolist() == [[True, True, False], [True, True, True]]
    assert response_mask(NEW, batch(None, advantage=t([1.0, 2.0]))).all()


# --------------------------------------------------------------------------------------------
# Errors: bad knobs, missing fields, shapes
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("cls", "knobs", "message"),
    [
        (PPOClipLoss, {"clip_low": 0.0}, r"clip_low \(ε_low\) must be a number in \(0, 1\), got 0"),
        (PPOClipLoss, {"clip_low": 1.5}, r"clip_low .* in \(0, 1\), got 1\.5"),
        (PPOClipLoss, {"clip_low": True}, r"clip_low .* got True"),
        (PPOClipLoss, {"clip_low": math.nan}, r"clip_low .* got nan"),
        (PPOClipLoss, {"clip_low": "0.2"}, r"clip_low .* got '0\.2'"),
        (PPOClipLoss, {"clip_high": -0.1}, r"clip_high \(ε_high\) must be a finite number > 0"),
        (DecoupledPPOLoss, {"clip_high": math.inf}, r"clip_high .* got inf"),
        (PPOClipLoss, {"dual_clip": 1.0}, r"dual_clip \(c\) must be a finite number > 1 .*1\.0"),
        (DecoupledPPOLoss, {"tis_cap": 0.5}, r"tis_cap must be a number >= 1 .*got 0\.5"),
        (DecoupledPPOLoss, {"reject_range": (1.5, 2.0)}, r"reject_range must be .*\(1\.5, 2\.0\)"),
        (DecoupledPPOLoss, {"reject_range": (0.5, 0.9)}, r"0 <= low <= 1 <= high.*0\.9"),
        (DecoupledPPOLoss, {"reject_range": (0.5,)}, r"reject_range must be \(low, high\)"),
        (DecoupledPPOLoss, {"reject_level": "batch"}, r"reject_level must be one of .*'batch'"),
        (PPOClipLoss, {"kl_coef": -0.1}, r"kl_coef \(β\) must be a finite number >= 0, got -0\.1"),
        (PPOClipLoss, {"kl_estimator": "k4"}, r"kl_estimator must be one of .*'k3'\), got 'k4'"),
        (PPOClipLoss, {"aggregation": "sum"}, r"aggregation must be one of .*got 'sum'"),
        (PPOClipLoss, {"tis_cap": 2.0}, r"old_logprobs_field to the field .*'prox_logprobs'"),
        (PPOClipLoss, {"reject_range": (0.5, 2.0)}, r"every weight would be 1"),
        (PPOClipLoss, {"old_logprobs_field": ""}, r"old_logprobs_field must be a field name"),
    ],
)
def test_bad_knobs_are_named(cls: type[PPOClipLoss], knobs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=f"{cls.__name__}: .*{message}"):
        cls(**knobs)


def test_bad_arguments_of_the_building_blocks() -> None:
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ConfigError, match=r"aggregation must be one of .*got 'x'"):
        aggregate_loss(t([[1.0, 2.0]]), mask, "x")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"rejection_mask: reject_range .*\(2\.0, 3\.0\)"):
        rejection_mask(t([[0.0, 0.0]]), mask, low=2.0, high=3.0)
    with pytest.raises(ConfigError, match=r"rejection_mask: level must be one of .*'row'"):
        rejection_mask(t([[0.0, 0.0]]), mask, low=0.5, high=2.0, level="row")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"ppo_clip_objective: clip_low .*got -1"):
        ppo_clip_objective(t([[0.0]]), t([[0.0]]), t([[1.0]]), clip_low=-1)


def _without(b: Batch, name: str) -> Batch:
    del b.data[name]
    return b


@pytest.mark.parametrize(
    ("loss_fn", "lp", "b", "message"),
    [
        (PPOClipLoss(), NEW, _without(ppo_batch(), "advantage"), r"needs an 'advantage' field"),
        (PPOClipLoss(), NEW, _without(ppo_batch(), "logprobs"), r"needs a 'logprobs' field .*\["),
        (
            DecoupledPPOLoss(),
            NEW,
            ppo_batch(),
            r"DecoupledPPOLoss needs a 'prox_logprobs' field \(.*the pipeline must run "
            r"TrainEngine\.compute_logprobs\(batch\) .*\); the batch has \['advantage', "
            r"'logprobs'\]",
        ),
        (PPOClipLoss(kl_coef=0.1), NEW, ppo_batch(), r"needs a 'ref_logprobs' field"),
        (PPOClipLoss(old_logprobs_field="old"), NEW, ppo_batch(), r"needs a 'old' field"),
        (
            PPOClipLoss(),
            NEW,
            batch([2, 3], advantage=t([1.0, 2.0, 3.0]), logprobs=OLD),
            r"field 'advantage' has shape \[3\] \(3 values\) but logprobs is \[B, T\] = \[2, 3\]",
        ),
        (
            PPOClipLoss(),
            NEW,
            batch([2, 3], advantage=t([1.0, 2.0]), logprobs=torch.zeros(2, 4)),
            r"field 'logprobs' has shape \[2, 4\] but logprobs is \[B, T\] = \[2, 3\]",
        ),
        (
            PPOClipLoss(),
            NEW,
            batch([2, 3], advantage=t([1.0, 2.0]), logprobs=[torch.zeros(2), torch.zeros(4)]),
            r"field 'logprobs' row 1 has 4 values but logprobs is \[B, T\] = \[2, 3\]",
        ),
        (
            PPOClipLoss(),
            NEW,
            batch([2, 3], advantage=t([1.0, 2.0]), logprobs="oops"),
            r"field 'logprobs' must be a \[B, T\] tensor or a list of per-row tensors, got str",
        ),
        (PPOClipLoss(), NEW[0], ppo_batch(), r"logprobs must be a \[B, T\] tensor, got \[3\]"),
        (
            PPOClipLoss(),
            torch.zeros(3, 3),
            ppo_batch(),
            r"logprobs has shape \[3, 3\] but the batch has 2 rows",
        ),
        (
            PPOClipLoss(),
            NEW,
            batch([2, 5], advantage=t([1.0, 2.0]), logprobs=OLD),
            r"lengths\['response'\] ranges over \[2, 5\] but logprobs \[B, T\] = \[2, 3\]",
        ),
        (
            PPOClipLoss(),
            NEW,
            batch([2, 3, 1], rows=2, advantage=t([1.0, 2.0]), logprobs=OLD),
            r"lengths\['response'\] has 3 entries but logprobs has 2 rows",
        ),
    ],
)
def test_missing_fields_and_bad_shapes_are_named(
    loss_fn: LossFn, lp: torch.Tensor, b: Batch, message: str
) -> None:
    with pytest.raises(BadRequestError, match=message):
        loss_fn(lp, b)


# --------------------------------------------------------------------------------------------
# Objects and properties
# --------------------------------------------------------------------------------------------
def test_loss_fns_are_frozen_picklable_and_readable() -> None:
    fn = DecoupledPPOLoss(clip_high=0.28, tis_cap=2.0)
    assert pickle.loads(pickle.dumps(fn)) == fn
    assert repr(fn).startswith("DecoupledPPOLoss(clip_low=0.2, clip_high=0.28, dual_clip=None")
    with pytest.raises(AttributeError):
        fn.clip_low = 0.3  # type: ignore[misc]
    typed: LossFn = PPOClipLoss()
    assert typed(NEW, ppo_batch())[0].item() == pytest.approx(0.74)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    rows=st.integers(1, 4),
    width=st.integers(1, 5),
    clip_low=st.floats(0.05, 0.5),
    clip_high=st.none() | st.floats(0.05, 0.5),
    dual_clip=st.none() | st.floats(1.5, 5.0),
)
def test_at_ratio_one_ppo_has_the_policy_gradient(
    data: st.DataObject,
    rows: int,
    width: int,
    clip_low: float,
    clip_high: float | None,
    dual_clip: float | None,
) -> None:
    lengths = data.draw(st.lists(st.integers(0, width), min_size=rows, max_size=rows))
    adv = data.draw(st.lists(st.floats(-5, 5), min_size=rows, max_size=rows))
    cells = st.lists(st.floats(-8, 0), min_size=rows * width, max_size=rows * width)
    lp = t(data.draw(cells)).reshape(rows, width)
    b = batch(lengths, advantage=t(adv), logprobs=lp.clone())
    ppo = PPOClipLoss(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
    value, grad = grad_of(ppo, lp, b)
    pg_value, pg_grad = grad_of(policy_gradient_loss, lp, b)
    # same gradient -A/N on every response token ...
    assert torch.allclose(grad, pg_grad, atol=1e-12)
    # ... and the surrogate's value is -Σ A_i·len_i / N (ρ = 1 replaces log π in the PG loss)
    tokens = max(sum(lengths), 1)
    assert value == pytest.approx(-sum(a * n for a, n in zip(adv, lengths, strict=True)) / tokens)
    # (the PG loss's value is -Σ A·log π / N: the two values differ, only gradients agree)
    lp_sum = sum(float(lp[i, : lengths[i]].sum()) * adv[i] for i in range(rows))
    assert pg_value == pytest.approx(-lp_sum / tokens)
