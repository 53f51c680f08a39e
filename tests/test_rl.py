"""Group advantages and the policy-gradient loss, against values computed by hand."""

from __future__ import annotations

import pytest
import torch

from asyncflow_core.errors import BadRequestError
from asyncflow_core.protocols import Batch
from asyncflow_core.rl import group_advantages, policy_gradient_loss


def test_group_advantages_normalize_within_each_group() -> None:
    adv = group_advantages([1.0, 3.0, 0.0, 0.0, 5.0], ["a", "a", "b", "b", "c"])
    # group a: mean 2, std 1 -> -1, +1; group b: all equal -> 0; group c: alone -> 0
    assert adv.tolist() == pytest.approx([-1.0, 1.0, 0.0, 0.0, 0.0], abs=1e-5)
    raw = group_advantages([1.0, 3.0, 2.0], [7, 7, 7], normalize_std=False)
    assert raw.tolist() == pytest.approx([-1.0, 1.0, 0.0])


def test_group_advantages_reject_bad_input_by_name() -> None:
    with pytest.raises(BadRequestError, match="3 rewards but 2 group ids"):
        group_advantages([1.0, 2.0, 3.0], [0, 0])
    with pytest.raises(BadRequestError, match=r"positions \[1\]"):
        group_advantages([1.0, float("nan")], [0, 0])


def test_policy_gradient_loss_masks_padding_and_weights_by_advantage() -> None:
    logprobs = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    batch = Batch(
        rows=(0, 1),
        data={"advantage": torch.tensor([2.0, -1.0])},
        lengths={"response": torch.tensor([2, 3])},
    )
    loss, metrics = policy_gradient_loss(logprobs, batch)
    # -(2*(-1-2) + (-1)*(-1.5)) / 5 tokens = -(-6 + 1.5)/5 = 0.9; the padded -9 is ignored
    assert float(loss.detach()) == pytest.approx(0.9)
    loss.backward()
    assert logprobs.grad is not None
    assert float(logprobs.grad[0, 2]) == 0.0
    assert metrics["advantage_mean"] == pytest.approx(0.5)
    with pytest.raises(BadRequestError, match="'advantage' field"):
        policy_gradient_loss(logprobs, Batch(rows=(0, 1), data={}))
