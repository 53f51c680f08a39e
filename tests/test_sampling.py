"""The protocol's log-prob semantics in code (asyncflow_core.training.sampling), checked against an
oracle we did not write: transformers' own logits warpers (temperature, top-k, top-p, applied
in that order by ``GenerationConfig``), on random logits."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from asyncflow_reference.engines import TorchInferenceEngine
from asyncflow_reference.model import ModelConfig

from asyncflow_core.contracts.errors import EngineError
from asyncflow_core.contracts.protocols import Batch, GenerationRequest, SamplingParams
from asyncflow_core.training.sampling import (
    SAMPLING_FIELDS,
    filter_logits,
    row_sampling,
    sampled_logprobs,
    sampling_columns,
)

warpers = pytest.importorskip(
    "transformers.generation.logits_process", reason="the [hf] extra is not installed"
)


def transformers_filtered(logits: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    """The same distribution, built by transformers' warpers."""
    x = warpers.TemperatureLogitsWarper(t)(None, logits.clone())
    if k > 0:
        x = warpers.TopKLogitsWarper(k)(None, x)
    if p < 1:
        x = warpers.TopPLogitsWarper(p)(None, x)
    return x


def test_filter_logits_is_transformers_warpers() -> None:
    g = torch.Generator().manual_seed(0)
    cases = 0
    for trial in range(300):
        vocab = int(torch.randint(2, 60, (1,), generator=g))
        logits = torch.randn(3, vocab, generator=g) * float(torch.rand(1, generator=g) * 6 + 0.1)
        t = float(torch.rand(1, generator=g)) * 2 + 0.05
        k = int(torch.randint(0, vocab + 3, (1,), generator=g))
        p = 1.0 if trial % 4 == 0 else float(torch.rand(1, generator=g)) * 0.99 + 0.01
        ours = filter_logits(logits, torch.tensor(t), torch.tensor(k), torch.tensor(p))
        theirs = transformers_filtered(logits, t, k, p)
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), (trial, vocab, t, k, p)
        kept = ~torch.isinf(theirs)
        torch.testing.assert_close(ours[kept], theirs[kept], rtol=0, atol=1e-6)
        cases += 1
    assert cases == 300


def test_per_row_settings_and_greedy_rows() -> None:
    """Each row has its own settings; a greedy row (temperature 0) is unscaled and unfiltered."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 10, generator=g) * 2
    t = torch.tensor([1.0, 0.5, 0.0, 1.3])
    k = torch.tensor([0, 3, 2, 0])
    p = torch.tensor([1.0, 1.0, 0.5, 0.7])
    ours = filter_logits(logits, t, k, p)
    for row, (ti, ki, pi) in enumerate(zip(t.tolist(), k.tolist(), p.tolist(), strict=True)):
        if ti == 0:
            torch.testing.assert_close(ours[row], logits[row])
        else:
            want = transformers_filtered(logits[row : row + 1], ti, ki, pi)[0]
            assert torch.equal(torch.isinf(ours[row]), torch.isinf(want))


def test_sampled_logprobs_renormalise_and_floor_off_support_tokens() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]], requires_grad=True)
    t, k, p = torch.tensor([1.0]), torch.tensor([2]), torch.tensor([1.0])
    tokens = torch.tensor([[0, 1, 4]])  # two in the top-2 support, one off it
    lp, off = sampled_logprobs(logits.unsqueeze(1).expand(1, 3, 5), tokens, t, k, p)
    z = math.log(math.exp(3) + math.exp(2))
    assert lp[0, 0].item() == pytest.approx(3 - z, abs=1e-6)
    assert lp[0, 1].item() == pytest.approx(2 - z, abs=1e-6)
    assert off.tolist() == [[False, False, True]]
    # the floor: the token's probability under the support extended by it
    floor = -1 - math.log(math.exp(3) + math.exp(2) + math.exp(-1))
    assert lp[0, 2].item() == pytest.approx(floor, abs=1e-6)
    assert bool(torch.isfinite(lp).all()) and bool((lp <= 0).all())
    lp.sum().backward()
    assert logits.grad is not None and bool(torch.isfinite(logits.grad).all())


def test_row_sampling_reads_every_layout_and_defaults() -> None:
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9), SamplingParams()]
    cells = sampling_columns(params)
    stacked = {n: torch.stack(v) for n, v in cells.items()}
    for data in (cells, stacked, {n: [float(c) for c in v] for n, v in cells.items()}):
        t, k, p = row_sampling(Batch((0, 1), dict(data)), 2, who="t")
        assert t.tolist() == pytest.approx([0.7, 1.0]) and k.tolist() == [5, 0]
        assert p.tolist() == pytest.approx([0.9, 1.0])
    t, k, p = row_sampling(Batch((0, 1), {}), 2, who="t", temperature=0.5)
    assert t.tolist() == [0.5, 0.5] and k.tolist() == [0, 0] and p.tolist() == [1.0, 1.0]


@pytest.mark.parametrize(
    ("field", "values", "message"),
    [
        ("temperature", [1.0, -0.5], "temperature of row 1 is -0.5; use a finite number >= 0"),
        ("temperature", [math.nan, 1.0], "temperature of row 0 is nan"),
        ("top_k", [2.5, 1.0], "top_k of row 0 is 2.5; use an int >= 0"),
        ("top_p", [1.0, 0.0], r"top_p of row 1 is 0.0; use a number in \(0, 1\]"),
        ("top_p", [1.0], "field 'top_p' has 1 values for 2 rows"),
        ("top_k", [torch.tensor([1, 2]), 3], "one number per row"),
    ],
)
def test_bad_sampling_fields_are_named(field: str, values: list[object], message: str) -> None:
    with pytest.raises(EngineError, match=message):
        row_sampling(Batch((0, 1), {field: values}), 2, who="trainer")
    assert field in SAMPLING_FIELDS


def test_the_reference_engine_reports_the_filtered_distribution() -> None:
    """top_k=1 leaves one token: its renormalised log-prob is 0; the unfiltered engine at the
    same temperature reports the model's (negative) log-prob of the same greedy token."""
    config = ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, init_std=0.5)

    async def main() -> None:
        engine = TorchInferenceEngine(config, seed=0)
        top1 = await engine.generate(
            GenerationRequest("k1", (1, 2, 3), SamplingParams(max_tokens=6, top_k=1, seed=3))
        )
        greedy = await engine.generate(
            GenerationRequest("g", (1, 2, 3), SamplingParams(max_tokens=6, temperature=0.0))
        )
        await engine.close()
        assert top1.tokens == greedy.tokens
        assert all(lp == pytest.approx(0.0, abs=1e-6) for lp in top1.logprobs)
        assert all(lp < -1e-3 for lp in greedy.logprobs)

    asyncio.run(main())
