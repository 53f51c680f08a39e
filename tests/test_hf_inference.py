"""``HFInferenceEngine`` over transformers' continuous batching (transformers 5.24, on CPU):
the ``InferenceEngine`` laws on two architectures (Qwen2 with tied embeddings, Llama
without), and its log-probs and tokens against transformers' own forward, warpers and
``generate``: oracles this project did not write."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import transformers
from asyncflow_conformance import InferenceEngineConformance
from asyncflow_hf.inference import HFInferenceEngine
from asyncflow_hf.models import load_causal_lm, tiny_config

from asyncflow_core.contracts.errors import ConfigError, EngineError
from asyncflow_core.contracts.protocols import GenerationRequest, SamplingParams
from asyncflow_core.engines.lmtrain import unique_named_tensors

VOCAB = 64
_MODELS: dict[str, Any] = {}


def tiny_model(name: str, seed: int = 0) -> Any:
    """A random-init tiny model, built once per (name, seed); engines deep-copy it."""
    key = f"{name}/{seed}"
    if key not in _MODELS:
        _MODELS[key] = load_causal_lm(tiny_config(name, vocab_size=VOCAB), who="test", seed=seed)
    return _MODELS[key]


def engine(name: str = "tiny-qwen2", **kwargs: Any) -> HFInferenceEngine:
    kwargs.setdefault("eos_token_ids", ())
    return HFInferenceEngine(tiny_model(name), **kwargs)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def request(rid: str, prompt: Sequence[int], **params: Any) -> GenerationRequest:
    return GenerationRequest(rid, tuple(prompt), SamplingParams(**params))


# --------------------------------------------------------------------------------------------
# The laws
# --------------------------------------------------------------------------------------------
class _HFLaws(InferenceEngineConformance):
    vocab_size = VOCAB
    long_max_tokens = 96
    model_name = "tiny-qwen2"

    def make_engine(self) -> HFInferenceEngine:
        return engine(self.model_name, max_batch=16, threads=1)

    def weights_for_load(self, engine: Any) -> Sequence[tuple[str, torch.Tensor]]:
        return [(n, t.detach().clone()) for n, t in unique_named_tensors(engine.model)]


class TestHFInferenceQwen2(_HFLaws):
    """Qwen2, tied embeddings; the laws see the engine through ``wait_for_tokens``."""


class TestHFInferenceLlamaPaced(_HFLaws):
    """Llama, untied; the laws pace themselves (no progress hook), as for a remote engine."""

    model_name = "tiny-llama"

    def progress(self, engine: Any) -> None:
        return None


# --------------------------------------------------------------------------------------------
# Against transformers' own forward, warpers and generate
# --------------------------------------------------------------------------------------------
def _reference_logprobs(
    model: Any, prompt: Sequence[int], tokens: Sequence[int], params: SamplingParams
) -> torch.Tensor:
    """Each token's log-prob by a plain forward of prompt + tokens, through transformers' own
    warpers (temperature, top-k, top-p), the way ``generate`` would filter (greedy: none)."""
    seq = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(seq).logits[0, len(prompt) - 1 : -1].float()
    if params.temperature > 0:
        warpers = transformers.LogitsProcessorList()
        if params.temperature != 1.0:
            warpers.append(transformers.TemperatureLogitsWarper(params.temperature))
        if params.top_k > 0:
            warpers.append(transformers.TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            warpers.append(transformers.TopPLogitsWarper(params.top_p))
        logits = warpers(seq[:, : len(prompt)], logits)
    picked = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens).unsqueeze(1))
    return picked[:, 0]


SETTINGS = {
    "greedy": SamplingParams(max_tokens=24, temperature=0.0),
    "t1": SamplingParams(max_tokens=24),
    "t0.7": SamplingParams(max_tokens=24, temperature=0.7),
    "topk0-is-off": SamplingParams(max_tokens=24, top_k=0),
    "topk5": SamplingParams(max_tokens=24, top_k=5),
    "topp0.8": SamplingParams(max_tokens=24, top_p=0.8),
    "t0.8-topk8-topp0.9": SamplingParams(max_tokens=24, temperature=0.8, top_k=8, top_p=0.9),
}


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama"])
def test_logprobs_equal_transformers_forward_and_warpers(name: str) -> None:
    """Batched together, every setting's reported log-probs equal a plain forward of the
    whole sequence through transformers' warpers, token by token."""

    async def main() -> None:
        e = engine(name)
        try:
            prompts = {k: [1 + (3 * i + j) % (VOCAB - 1) for j in range(2 + i)] for i, k in
                       enumerate(SETTINGS)}  # fmt: skip
            results = await asyncio.gather(
                *(
                    e.generate(GenerationRequest(k, tuple(prompts[k]), p))
                    for k, p in SETTINGS.items()
                )
            )
        finally:
            await e.close()
        model = tiny_model(name)
        for result in results:
            params = SETTINGS[result.request_id]
            assert len(result.tokens) == params.max_tokens
            want = _reference_logprobs(model, prompts[result.request_id], result.tokens, params)
            got = torch.tensor(result.logprobs)
            assert torch.allclose(got, want, atol=1e-4), (result.request_id, got - want)

    run(main())


def test_greedy_tokens_equal_generate() -> None:
    """Greedy requests produce ``model.generate(do_sample=False)``'s tokens."""

    async def main() -> list[tuple[int, ...]]:
        e = engine("tiny-llama")
        try:
            out = await asyncio.gather(
                *(e.generate(request(f"g{i}", p, max_tokens=16, temperature=0.0))
                  for i, p in enumerate(PROMPTS))
            )  # fmt: skip
        finally:
            await e.close()
        return [r.tokens for r in out]

    PROMPTS = [[5, 9, 2], [7], [1, 2, 3, 4, 5, 6, 7]]
    got = run(main())
    model = tiny_model("tiny-llama")
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        config = transformers.GenerationConfig(
            do_sample=False, max_new_tokens=16, eos_token_id=None, pad_token_id=0
        )
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), generation_config=config)
        assert list(tokens) == want[0, len(prompt) :].tolist()


def test_top_k_zero_is_off_not_greedy() -> None:
    """``top_k=0`` means no filter (transformers' per-request top-k would make it 1, i.e.
    greedy): sampled tokens are not all the argmax."""

    async def main() -> Any:
        e = engine()
        try:
            return await e.generate(request("k0", [3, 4], max_tokens=64, top_k=0, seed=5))
        finally:
            await e.close()

    result = run(main())
    model = tiny_model("tiny-qwen2")
    seq = torch.tensor([[3, 4, *result.tokens]])
    with torch.no_grad():
        argmax = model(seq).logits[0, 1:-1].argmax(-1).tolist()
    assert argmax != list(result.tokens)


def test_eos_stops_and_is_included() -> None:
    """A request ends with ``stop`` at the engine's EOS or its own stop id, token included."""

    async def main() -> None:
        e = engine()
        try:
            first = await e.generate(request("probe", [8, 9], max_tokens=6, temperature=0.0))
            eos = first.tokens[2]
            e2 = HFInferenceEngine(tiny_model("tiny-qwen2"), eos_token_ids=[eos])
            try:
                stopped = await e2.generate(request("eos", [8, 9], max_tokens=6, temperature=0.0))
            finally:
                await e2.close()
            own = await e.generate(
                request("own", [8, 9], max_tokens=6, temperature=0.0, stop_token_ids=(eos,))
            )
        finally:
            await e.close()
        cut = first.tokens.index(eos) + 1
        for r in (stopped, own):
            assert r.finish_reason == "stop" and r.tokens == first.tokens[:cut]
        assert first.finish_reason == "length"

    run(main())


def test_context_window_ends_with_length() -> None:
    async def main() -> None:
        e = engine(max_model_len=16)
        try:
            r = await e.generate(request("win", [1] * 10, max_tokens=50))
            assert r.finish_reason == "length" and len(r.tokens) == 6
            with pytest.raises(EngineError, match="max_model_len=16"):
                await e.generate(request("too-long", [1] * 16, max_tokens=5))
        finally:
            await e.close()

    run(main())


def test_a_load_reaches_new_requests_with_the_same_prompt() -> None:
    """After ``load_weights``, a prompt generated before is recomputed under the new weights
    (no KV block from the old weights is reused: transformers shares prefix blocks by default,
    and they outlive their requests)."""
    prompt = list(range(1, 21))  # five full blocks of page_size 4

    async def main() -> None:
        e = engine(page_size=4)
        try:
            await e.generate(request("before", prompt, max_tokens=4, temperature=0.0))
            new = tiny_model("tiny-qwen2", seed=1)
            await e.load_weights([(n, t.clone()) for n, t in unique_named_tensors(new)], 1)
            after = await e.generate(request("after", prompt, max_tokens=8, temperature=0.0))
        finally:
            await e.close()
        assert set(after.versions) == {1}
        want = _reference_logprobs(new, prompt, after.tokens, SamplingParams(temperature=0.0))
        assert torch.allclose(torch.tensor(after.logprobs), want, atol=1e-4)

    run(main())


def test_an_inflight_load_recomputes_the_running_requests_context() -> None:
    """A load while requests run (frozen by ``pause("keep")``): one decoding, one still
    prefilling a long prompt in chunks. Every token after the load has the new weights'
    log-prob given prompt + all earlier tokens (transformers' forward as the oracle), so no
    key or value of the old weights stayed in the context; the earlier tokens keep version 0
    and the old weights' log-probs."""
    short, long = [5, 9, 2], [i % 60 + 1 for i in range(300)]  # ~40 chunks of 8 tokens
    params = SamplingParams(max_tokens=12, seed=7)

    async def main() -> tuple[Any, Any]:
        e = engine(max_batch_tokens=8, threads=1)
        try:
            decoding = asyncio.ensure_future(
                e.generate(GenerationRequest("d", tuple(short), params))
            )
            prefilling = asyncio.ensure_future(
                e.generate(GenerationRequest("p", tuple(long), params))
            )
            await asyncio.sleep(0)  # one turn of the loop: both requests are in flight
            await e.wait_for_tokens("d", 3)
            await e.pause("keep")
            assert await e.wait_for_tokens("p", 0) == 0  # its prompt is not through yet
            assert 3 <= await e.wait_for_tokens("d", 0) < params.max_tokens
            new = tiny_model("tiny-qwen2", seed=1)
            await e.load_weights([(n, t.clone()) for n, t in unique_named_tensors(new)], 1)
            await e.resume()
            return await decoding, await prefilling
        finally:
            await e.close()

    old, new = tiny_model("tiny-qwen2"), tiny_model("tiny-qwen2", seed=1)
    for prompt, result in zip((short, long), run(main()), strict=True):
        k = result.versions.index(1)
        assert set(result.versions[:k]) <= {0} and set(result.versions[k:]) == {1}
        assert len(result.tokens) == params.max_tokens
        before = _reference_logprobs(old, prompt, result.tokens[:k], params) if k else None
        after = _reference_logprobs(new, [*prompt, *result.tokens[:k]], result.tokens[k:], params)
        got = torch.tensor(result.logprobs)
        if before is not None:
            assert torch.allclose(got[:k], before, atol=1e-4), (result.request_id, got[:k] - before)
        assert torch.allclose(got[k:], after, atol=1e-4), (result.request_id, got[k:] - after)


def test_bad_weights_load_nothing() -> None:
    async def main() -> None:
        e = engine("tiny-qwen2")
        try:
            before = {n: t.clone() for n, t in e.model.state_dict().items()}
            good = ("model.norm.weight", torch.zeros(64))
            cases = [
                ([good, ("lm_head.weight", torch.zeros(VOCAB, 64))], "tied"),
                ([good, ("nope.weight", torch.zeros(1))], "unknown parameter 'nope.weight'"),
                ([good, ("model.layers.0.input_layernorm.weight", torch.zeros(3))], "shape"),
                ([good, good], "twice"),
            ]
            for weights, match in cases:
                with pytest.raises(EngineError, match=match):
                    await e.load_weights(weights, 3)
            after = e.model.state_dict()
            assert all(torch.equal(before[n], after[n]) for n in before)
            assert e.weight_version == 0
        finally:
            await e.close()

    run(main())


def test_bad_configuration_is_refused() -> None:
    model = tiny_model("tiny-qwen2")
    with pytest.raises(ConfigError, match="max_model_len"):
        HFInferenceEngine(model, max_model_len=10_000)
    with pytest.raises(ConfigError, match="EOS token id 99"):
        HFInferenceEngine(model, eos_token_ids=[99])
    with pytest.raises(ConfigError, match="max_batch"):
        HFInferenceEngine(model, max_batch=0)


def test_generation_config_sampling_fields_are_named_and_not_applied(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A model folder's ``generation_config`` (here a repetition penalty) does not change
    sampling; the engine says it ignores it."""
    model = load_causal_lm(tiny_config("tiny-qwen2", vocab_size=VOCAB), who="test", seed=0)
    model.generation_config.repetition_penalty = 3.0

    async def main() -> Any:
        with caplog.at_level(logging.WARNING, logger="asyncflow_hf.inference"):
            e = HFInferenceEngine(model, eos_token_ids=())
        try:
            return await e.generate(request("rp", [2, 3], max_tokens=12, temperature=0.0))
        finally:
            await e.close()

    result = run(main())
    assert "repetition_penalty" in caplog.text
    want = _reference_logprobs(model, [2, 3], result.tokens, SamplingParams(temperature=0.0))
    assert torch.allclose(torch.tensor(result.logprobs), want, atol=1e-4)
