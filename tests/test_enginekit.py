"""``asyncflow_core.engines.enginekit``: the pieces every engine adapter maps the protocol with."""

from __future__ import annotations

import pytest
import torch

from asyncflow_core.contracts.errors import ConfigError, EngineError
from asyncflow_core.contracts.protocols import GenerationRequest, SamplingParams
from asyncflow_core.engines.enginekit import (
    ModelSpec,
    assemble,
    build_module,
    check_request,
    check_version,
    continuation,
    finish_reason,
    parse_release,
    parse_version,
    versions_from_spans,
)


def test_release_numbers_and_the_tested_range() -> None:
    assert parse_release("0.33.0+cu129") == (0, 33, 0)
    assert parse_release("0.5.23rc1") == (0, 5, 23)
    assert parse_release("garbage") == ()
    check_version("vllm", "0.33.4", ("0.33.0", "0.34"), "pip install x")
    for bad in ("0.32.9", "0.34.0", "garbage"):
        with pytest.raises(ConfigError, match=rf"vllm {bad} .*>=0\.33\.0,<0\.34.*pip install x"):
            check_version("vllm", bad, ("0.33.0", "0.34"), "pip install x")


def test_versions_spans_and_finish_reasons() -> None:
    assert versions_from_spans([("1", 0, 2), ("2", 2, 3)], 4, fallback=5, who="e") == (1, 1, 2, 5)
    assert versions_from_spans(None, 2, fallback=3, who="e") == (3, 3)
    with pytest.raises(EngineError, match="overlap"):
        versions_from_spans([("1", 0, 2), ("2", 1, 3)], 3, fallback=0, who="e")
    assert parse_version("default", who="e") == 0 and parse_version("12", who="e") == 12
    with pytest.raises(EngineError, match="did not set"):
        parse_version("v1.2", who="e")
    assert finish_reason({"type": "length"}, who="e", rid="r") == "length"
    with pytest.raises(EngineError, match=r"'error' \(boom\)"):
        finish_reason({"type": "error", "message": "boom"}, who="e", rid="r")


def test_partial_rollout_round_trip() -> None:
    request = GenerationRequest(
        "r",
        (1, 2),
        SamplingParams(max_tokens=5),
        resume_tokens=(7, 8),
        resume_logprobs=(-0.5, -0.25),
        resume_versions=(3, 3),
    )
    assert continuation(request) == ([1, 2, 7, 8], 3)
    result = assemble(request, [9], [-1.0], [4], "stop", who="e")
    assert result.tokens == (7, 8, 9) and result.versions == (3, 3, 4)
    assert result.logprobs == (-0.5, -0.25, -1.0)
    with pytest.raises(EngineError, match="at most 3"):
        assemble(request, [9] * 4, [-1.0] * 4, [4] * 4, "length", who="e")
    with pytest.raises(EngineError, match="placeholder"):
        assemble(request, [9], [-9999.0], [4], "stop", who="e")


def test_bad_requests_name_the_field() -> None:
    ok = GenerationRequest("r", (1, 2), SamplingParams(max_tokens=2))
    assert check_request("e", ok) is ok
    with pytest.raises(EngineError, match="already in flight"):
        check_request("e", ok, in_flight={"r"})
    with pytest.raises(EngineError, match=r"prompt_tokens\[1\]=16 .*\[0, 16\)"):
        check_request("e", GenerationRequest("r", (1, 16)), vocab_size=16)
    with pytest.raises(EngineError, match="top_p"):
        check_request("e", GenerationRequest("r", (1,), SamplingParams(top_p=0.0)))
    with pytest.raises(EngineError, match="max_model_len=3"):
        check_request("e", GenerationRequest("r", (1, 2, 3)), max_model_len=3)


class _Spec:
    """A model spec of our own (not the reference package's): a linear layer per seed."""

    def __init__(self, returns_module: bool = True) -> None:
        self.returns_module = returns_module

    def build(self, *, seed: int) -> torch.nn.Module:
        if not self.returns_module:
            return "not a module"  # type: ignore[return-value]
        torch.manual_seed(seed)
        return torch.nn.Linear(2, 2)


def test_build_module_copies_a_module_and_builds_a_spec_from_its_seed() -> None:
    given = torch.nn.Linear(2, 2)
    copied = build_module(given, seed=0, who="trainer")
    assert copied is not given and torch.equal(copied.weight, given.weight)
    copied.weight.data.add_(1.0)  # the caller's module is never changed
    assert not torch.equal(copied.weight, given.weight)
    assert isinstance(_Spec(), ModelSpec)
    a, b = (build_module(_Spec(), seed=s, who="trainer") for s in (3, 3))
    assert isinstance(a, torch.nn.Linear) and torch.equal(a.weight, b.weight)
    c = build_module(_Spec(), seed=4, who="trainer")
    assert isinstance(c, torch.nn.Linear) and not torch.equal(a.weight, c.weight)


def test_build_module_refuses_what_is_neither() -> None:
    with pytest.raises(ConfigError, match=r"trainer: _Spec.build\(\) returned str"):
        build_module(_Spec(returns_module=False), seed=0, who="trainer")
    with pytest.raises(ConfigError, match=r"trainer takes a torch.nn.Module .* got dict"):
        build_module({"d_model": 8}, seed=0, who="trainer")
