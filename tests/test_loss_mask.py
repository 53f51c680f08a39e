"""The ``loss_mask`` field of multi-turn rows (``asyncflow_core.training.rl.LOSS_MASK``): every loss
and every trainer counts exactly the masked-in (policy-generated) response tokens.

The oracles do not restate the implementation: a masked loss must equal the same loss on a
batch that holds only the masked-in tokens, and a trainer's update from a row whose tail is
masked out must equal its update from the row cut before that tail (a causal LM's log-probs of
the kept tokens do not depend on the tokens after them)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from asyncflow_reference.engines import TorchTrainEngine
from asyncflow_reference.model import ModelConfig

from asyncflow_core.contracts.errors import BadRequestError, ConfigError, EngineError
from asyncflow_core.contracts.protocols import Batch, LossFn
from asyncflow_core.training.rl import (
    LOSS_MASK,
    DecoupledPPOLoss,
    PPOClipLoss,
    policy_gradient_loss,
    response_mask,
)

F64 = torch.float64
LOSSES: dict[str, LossFn] = {
    "pg": policy_gradient_loss,
    "ppo": PPOClipLoss(),
    "ppo-seq-mean": PPOClipLoss(aggregation="seq-mean-token-mean"),
    "decoupled": DecoupledPPOLoss(tis_cap=2.0),
}


def _rows(
    lengths: list[int], masks: list[list[int]] | None, seed: int = 0
) -> tuple[torch.Tensor, Batch]:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    current = -torch.rand(len(lengths), width, generator=g, dtype=F64) - 0.1
    old = current.detach() - 0.2 * torch.rand(len(lengths), width, generator=g, dtype=F64)
    data: dict[str, Any] = {
        "advantage": torch.tensor([1.0, -0.5, 2.0][: len(lengths)], dtype=F64),
        "logprobs": old,
        "prox_logprobs": old + 0.05,
    }
    if masks is not None:
        data[LOSS_MASK] = [torch.tensor(m, dtype=torch.long) for m in masks]
    b = Batch(tuple(range(len(lengths))), data, {"response": torch.tensor(lengths)})
    return current, b


def _keep_only(
    current: torch.Tensor, b: Batch, masks: list[list[int]]
) -> tuple[torch.Tensor, Batch]:
    """The same rows holding only their masked-in tokens, left-packed, no mask."""
    rows = [[j for j, m in enumerate(mask) if m] for mask in masks]
    width = max(len(r) for r in rows)

    def pack(x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(len(rows), width, dtype=x.dtype)
        for i, keep in enumerate(rows):
            out[i, : len(keep)] = x[i, keep]
        return out

    data = {k: v for k, v in b.data.items() if k != LOSS_MASK}
    data["logprobs"] = pack(b["logprobs"])
    data["prox_logprobs"] = pack(b["prox_logprobs"])
    lengths = torch.tensor([len(r) for r in rows])
    return pack(current), Batch(b.rows, data, {"response": lengths})


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_a_masked_loss_is_the_loss_of_the_generated_tokens_alone(name: str) -> None:
    loss_fn = LOSSES[name]
    lengths = [5, 3, 4]
    masks = [[0, 1, 1, 0, 1], [1, 0, 1], [0, 0, 1, 1]]
    current, b = _rows(lengths, masks)
    x = current.clone().requires_grad_(True)
    loss, metrics = loss_fn(x, b)
    loss.backward()
    assert x.grad is not None
    packed, only = _keep_only(current, b, masks)
    y = packed.clone().requires_grad_(True)
    want, want_metrics = loss_fn(y, only)
    want.backward()
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-9, abs=1e-12)
    for key, value in want_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    # no gradient reaches a masked-out (tool) token
    for i, mask in enumerate(masks):
        for j, m in enumerate(mask):
            if not m:
                assert float(x.grad[i, j]) == 0.0, (name, i, j)


def test_no_mask_field_trains_every_response_token() -> None:
    current, b = _rows([3, 2], None)
    assert response_mask(current, b).tolist() == [[True, True, True], [True, True, False]]
    ones = Batch(b.rows, {**b.data, LOSS_MASK: [torch.ones(3), torch.ones(2)]}, b.lengths)
    for loss_fn in LOSSES.values():
        assert float(loss_fn(current, b)[0]) == pytest.approx(float(loss_fn(current, ones)[0]))


def test_bad_masks_are_named() -> None:
    current, b = _rows([3, 2], [[0, 1, 2], [1, 1]])
    with pytest.raises(BadRequestError, match=r"loss_mask\[0, 2\] = 2.0"):
        response_mask(current, b)
    current, b = _rows([3, 2], [[0, 1, 1, 1, 1], [1, 1]])
    with pytest.raises(BadRequestError, match="'loss_mask' row 0 has 5 values"):
        response_mask(current, b)


# --------------------------------------------------------------------------------------------
# Trainers
# --------------------------------------------------------------------------------------------
MODEL = ModelConfig(vocab_size=12, d_model=16, n_layers=1, n_heads=2, max_seq_len=32)


def _batch(rows: list[tuple[list[int], list[int], list[int] | None]]) -> Batch:
    data: dict[str, Any] = {
        "prompt": [torch.tensor(p) for p, _, _ in rows],
        "response": [torch.tensor(r) for _, r, _ in rows],
        "advantage": torch.tensor([1.0, -0.7, 0.4][: len(rows)]),
    }
    if any(m is not None for _, _, m in rows):
        data[LOSS_MASK] = [torch.tensor(m if m is not None else [1] * len(r)) for _, r, m in rows]
    return Batch(tuple(range(len(rows))), data)


async def _step(batch: Batch, micro_batch_size: int) -> dict[str, torch.Tensor]:
    trainer = TorchTrainEngine(MODEL, lr=LR, seed=3, micro_batch_size=micro_batch_size)
    try:
        await trainer.train_step(batch, policy_gradient_loss)
        return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    finally:
        await trainer.close()


LR = 0.05


def _largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """In units of the learning rate: AdamW's first step moves each weight by about ``lr``
    times the sign of its gradient, so a gradient that is 0 up to float rounding may move its
    weight by a rounding-sized fraction of ``lr``; a real difference moves weights by ~lr."""
    return max(float((a[k] - b[k]).abs().max()) for k in a) / LR


@pytest.mark.parametrize("micro_batch_size", [1, 8])
def test_a_masked_out_tail_trains_like_a_row_cut_before_it(micro_batch_size: int) -> None:
    """Row 0's last 3 response tokens (a 'tool answer') are masked out; row 1 is unmasked.
    The update equals training on row 0 cut before those tokens, with micro-batches of 1
    (weights by trained tokens) as with one micro-batch."""
    masked = _batch([([1, 2], [3, 4, 5, 6, 7], [1, 1, 0, 0, 0]), ([2], [5, 6, 7], None)])
    cut = _batch([([1, 2], [3, 4], None), ([2], [5, 6, 7], None)])
    with_mask = asyncio.run(_step(masked, micro_batch_size))
    assert _largest_difference(with_mask, asyncio.run(_step(cut, micro_batch_size))) < 0.01
    # and the mask matters: training on every token of row 0 gives another update
    full = _batch([([1, 2], [3, 4, 5, 6, 7], None), ([2], [5, 6, 7], None)])
    assert _largest_difference(with_mask, asyncio.run(_step(full, micro_batch_size))) > 0.5


def test_a_trainer_refuses_a_mask_that_does_not_fit() -> None:
    bad = _batch([([1, 2], [3, 4, 5], [1, 1]), ([2], [5, 6], None)])

    async def main() -> None:
        trainer = TorchTrainEngine(MODEL, seed=0)
        try:
            before = trainer.weight_version
            with pytest.raises(EngineError, match="'loss_mask' row 0 must be 3 values"):
                await trainer.train_step(bad, policy_gradient_loss)
            assert trainer.weight_version == before
        finally:
            await trainer.close()

    asyncio.run(main())


def test_the_learning_rate_warms_up_over_the_first_steps() -> None:
    """AdamW's first step moves each weight by about lr (its update is the gradient's sign):
    with lr_warmup_steps=4 the first step moves by lr/4, the fourth by the full lr."""
    batch = _batch([([1, 2], [3, 4, 5], None), ([2], [5, 6, 7], None)])

    async def moves(warmup: int, steps: int) -> float:
        trainer = TorchTrainEngine(MODEL, lr=LR, seed=3, lr_warmup_steps=warmup)
        try:
            for _ in range(steps - 1):
                await trainer.train_step(batch, policy_gradient_loss)
            before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
            await trainer.train_step(batch, policy_gradient_loss)
            after = trainer.model.state_dict()
            return max(float((after[k] - before[k]).abs().max()) for k in before) / LR
        finally:
            await trainer.close()

    assert 0.9 < asyncio.run(moves(0, 1)) < 1.1
    assert 0.2 < asyncio.run(moves(4, 1)) < 0.3
    with pytest.raises(ConfigError, match="lr_warmup_steps must be an int >= 0"):
        TorchTrainEngine(MODEL, lr_warmup_steps=-1)
