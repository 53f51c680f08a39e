"""The RL job's cheaper hot path (issue #23): results stored from a tensor view instead of
value by value, a reward on the event loop instead of a thread, the trainer's own batch
layout; and the simulated engine's results that carry their tensors. Each must give exactly
what the plain path gives."""

from __future__ import annotations

import dataclasses
import pickle
import random

import numpy as np
import pytest
import torch
from asyncflow_reference.presets import get_preset
from asyncflow_reference.sim import SimInferenceEngine, SimTrainEngine
from asyncflow_reference.simulate import simulate, with_steps

from asyncflow_core.contracts.errors import ConfigError
from asyncflow_core.contracts.protocols import GenerationRequest, SamplingParams
from asyncflow_core.data.store import InProcessDataStore
from asyncflow_core.flow.rlflow import RLConfig, RLEngines, RLJob, _column, _tokens
from asyncflow_core.flow.vclock import run_virtual


def test_column_equals_torch_tensor_for_ints_floats_and_empty() -> None:
    rng = random.Random(3)
    ints = tuple(rng.randrange(-(2**40), 2**40) for _ in range(500))
    floats = (*(rng.uniform(-30, 0) for _ in range(500)), 1e-40, -0.0, 3.4e38)
    got, want = _column(ints, torch.long), torch.tensor(ints, dtype=torch.long)
    assert got.dtype == want.dtype and torch.equal(got, want)
    got, want = _column(list(floats), torch.float32), torch.tensor(floats, dtype=torch.float32)
    assert got.dtype == want.dtype and torch.equal(got, want)
    for dtype in (torch.long, torch.float32):
        empty = _column((), dtype)
        assert empty.dtype == dtype and empty.shape == (0,)
    # not plain numbers: torch.tensor's own answer (here: its error)
    with pytest.raises((TypeError, ValueError)):
        _column(("x",), torch.long)


def test_column_copies_a_matching_view_and_ignores_a_wrong_one() -> None:
    values = (5, 6, 7)
    view = torch.tensor([5, 6, 7])
    got = _column(values, torch.long, view)
    assert torch.equal(got, torch.tensor([5, 6, 7]))
    got[0] = 0  # a copy: the engine's tensor is not shared with the store
    assert int(view[0]) == 5
    # wrong length, wrong dtype, not a tensor: converted from the values
    for wrong in (torch.tensor([1, 2]), torch.tensor([1.0, 2.0, 3.0]), [5, 6, 7]):
        assert torch.equal(_column(values, torch.long, wrong), torch.tensor([5, 6, 7]))


def test_sim_results_carry_their_values_as_tensors() -> None:
    cost = get_preset("qwen2.5-7b-grpo").cost
    engine = SimInferenceEngine(cost, seed=1)

    async def main() -> None:
        req = GenerationRequest(
            "r1", (1, 2, 3), SamplingParams(max_tokens=cost.response_max_tokens)
        )
        res = await engine.generate(req)
        pairs = (
            (res.tokens, getattr(res, "token_view", None), torch.long),
            (res.logprobs, getattr(res, "logprob_view", None), torch.float32),
        )
        for values, view, dtype in pairs:
            assert type(values) is tuple  # the protocol's type; the tensors ride beside
            assert isinstance(view, torch.Tensor) and view.dtype == dtype
            assert torch.equal(view, torch.tensor(values, dtype=dtype))
        copy = pickle.loads(pickle.dumps(res))
        assert copy.tokens == res.tokens
        await engine.close()

    run_virtual(main())


def test_tokens_counts_every_layout() -> None:
    async def main() -> None:
        store = InProcessDataStore()
        await store.create_partition("p", ["prompt", "response"], tasks=["t"])
        await store.put("p", {"prompt": [torch.arange(3), torch.arange(5)],
                              "response": [torch.arange(7), torch.arange(1)]})  # fmt: skip
        meta = await store.get_meta("p", "t", ["prompt", "response"], 2, timeout=0)
        for layout in ("padded", "list", "nested"):
            batch = await store.get_data(meta, layout=layout)
            assert _tokens(batch, ("prompt", "response")) == 16, layout
            assert _tokens(batch, ("response",)) == 8, layout

    run_virtual(main())


def test_reward_in_thread_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="reward_in_thread must be a bool"):
        RLConfig(steps=1, prompts_per_step=1, reward_in_thread="no").validate()  # type: ignore[arg-type]


def test_a_trainer_with_an_unknown_batch_layout_is_refused() -> None:
    cost = get_preset("qwen2.5-7b-grpo").cost

    class Odd(SimTrainEngine):
        batch_layout = "ragged"  # type: ignore[assignment]

    engines = RLEngines([SimInferenceEngine(cost)], Odd(cost, 1))
    with pytest.raises(ConfigError, match="batch_layout must be 'padded', 'nested' or 'list'"):
        RLJob(RLConfig(steps=1, prompts_per_step=1, n=2), engines, [[1, 2]], lambda p, r: 0.0)


def _figures(run: object) -> tuple[object, ...]:
    result = run.result  # type: ignore[attr-defined]
    steps = tuple(dataclasses.replace(s, metrics=None) for s in result.steps)
    return steps, result.dropped, result.generated, result.wall_s


def test_reward_on_the_loop_and_list_batches_change_no_virtual_figure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same simulated job with the fast paths (reward on the loop, the trainer's "list"
    layout) and without them (reward in a thread, padded batches): every step record,
    count and the wall time are equal."""
    preset = with_steps(get_preset("qwen2.5-7b-grpo").scaled(16), 2)
    fast = simulate(preset, "async", staleness=1, trace=False)
    monkeypatch.setattr(SimTrainEngine, "batch_layout", "padded")
    original = RLConfig.validate

    def in_thread(self: RLConfig) -> None:
        object.__setattr__(self, "reward_in_thread", True)
        original(self)

    monkeypatch.setattr(RLConfig, "validate", in_thread)
    plain = simulate(preset, "async", staleness=1, trace=False)
    assert plain.result.config.reward_in_thread and not fast.result.config.reward_in_thread
    assert _figures(fast) == _figures(plain)
    assert np.isfinite(fast.result.wall_s) and fast.result.steps
