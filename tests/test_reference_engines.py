"""The pure-PyTorch reference engines: a tiny transformer whose cached decoding matches its full
forward, a continuous-batching inference engine (sampling, seeds, stop/length/abort, resume,
pause, sleep, per-token versions across a weight load) whose log-probs match the trainer's,
and a trainer (micro-batching, weight export, checkpoints, bad input, a learning smoke test).

Every check compares against an independent computation: the trainer's full forward, a fresh
engine, or the same run without the disturbance under test. Models are tiny (d_model 32) with
a peaky initialisation (``init_std=0.3``) so that sampled sequences differ from each other."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import threading
import time
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
import safetensors.torch
import torch
from asyncflow_reference.engines import (
    CHECKPOINT_META,
    CHECKPOINT_OPTIMIZER,
    CHECKPOINT_WEIGHTS,
    TorchInferenceEngine,
    TorchTrainEngine,
)
from asyncflow_reference.model import KVCache, ModelConfig, TransformerLM

from asyncflow_core.contracts.errors import ConfigError, EngineError
from asyncflow_core.contracts.protocols import (
    Batch,
    GenerationRequest,
    GenerationResult,
    InferenceEngine,
    SamplingParams,
    SupportsLoadWeights,
    SupportsPause,
    SupportsSleep,
    Tags,
    TrainEngine,
)
from asyncflow_core.data.store import InProcessDataStore
from asyncflow_core.training.rl import group_advantages, policy_gradient_loss
from asyncflow_core.training.sampling import sampling_columns

T = TypeVar("T")
CFG = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, max_seq_len=40, init_std=0.3)
MODEL = TransformerLM(CFG, seed=0)  # the weights of TorchTrainEngine(CFG) (seed 0)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
TOL = 1e-4  # engine vs trainer log-probs, fp32


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models run fastest on one intra-op thread (engines built here inherit it); the
    process setting is restored for the other test modules."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a test coroutine with a hard limit, so a hang fails instead of stalling the suite."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout=60)

    return asyncio.run(bounded())


def req(
    rid: str, prompt: Sequence[Any], params: SamplingParams = GREEDY, **kw: Any
) -> GenerationRequest:
    return GenerationRequest(rid, tuple(prompt), params, **kw)


def check_shape(result: GenerationResult) -> None:
    assert len(result.tokens) == len(result.logprobs) == len(result.versions)
    assert all(0 <= t < CFG.vocab_size for t in result.tokens)
    assert all(lp <= 0 and math.isfinite(lp) for lp in result.logprobs)


async def padded_batch(
    results: Sequence[GenerationResult], layout: str = "padded", **extra: Sequence[Any]
) -> Batch:
    """prompt/response (+ extra per-row fields) read back through the real store."""
    store = InProcessDataStore(num_storage_units=2)
    fields = ["prompt", "response", *extra]
    await store.create_partition("p", fields, tasks=["t"])
    data: dict[str, Any] = {
        "prompt": [torch.tensor(r.prompt_tokens, dtype=torch.long) for r in results],
        "response": [torch.tensor(r.tokens, dtype=torch.long) for r in results],
    }
    data.update({k: list(v) for k, v in extra.items()})
    tags = [
        Tags(group=i % 2, versions=tuple(sorted(set(r.versions)))) for i, r in enumerate(results)
    ]
    await store.put("p", data, tags=tags)
    meta = await store.get_meta("p", "t", fields, len(results), timeout=5)
    assert len(meta) == len(results)
    return await store.get_data(meta, layout=layout)  # type: ignore[arg-type]


async def agree(
    trainer: TorchTrainEngine,
    results: Sequence[GenerationResult],
    params: Sequence[SamplingParams] = (),
) -> float:
    """Max |engine log-prob - trainer log-prob| over every generated token (each row sampled
    with ``params[i]``, given to the trainer as the batch's sampling fields)."""
    batch = await padded_batch(results, **(sampling_columns(params) if params else {}))
    lp = await trainer.compute_logprobs(batch)
    assert lp.shape == (len(results), max(len(r.tokens) for r in results))
    worst = 0.0
    for i, r in enumerate(results):
        mine = torch.tensor(r.logprobs)
        worst = max(worst, float((lp[i, : len(r.tokens)] - mine).abs().max()))
        assert bool((lp[i, len(r.tokens) :] == 0).all())
    return worst


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


async def export_all(trainer: TorchTrainEngine, bucket_bytes: int = 1 << 20) -> list[Any]:
    return [pair async for bucket in trainer.export_weights(bucket_bytes) for pair in bucket]


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"vocab_size": 1}, "vocab_size must be an int in [2, "),
        ({"d_model": 0}, "d_model must be an int in [1, "),
        ({"n_layers": 0}, "n_layers must be an int in [1, "),
        ({"n_heads": 3}, "n_heads must divide d_model=32"),
        ({"n_heads": 64}, "n_heads must be an int in [1, 32]"),
        ({"max_seq_len": 1}, "max_seq_len must be an int in [2, "),
        ({"d_ff": 0}, "d_ff must be an int in [1, "),
        ({"vocab_size": 32.0}, "vocab_size must be an int"),
        ({"n_layers": True}, "n_layers must be an int"),
        ({"norm_eps": 0.0}, "norm_eps must be a finite number in (0.0, 1.0]"),
        ({"init_std": float("nan")}, "init_std must be a finite number"),
    ],
)
def test_model_config_names_the_bad_field_and_its_range(
    change: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(CFG, **change)
    assert fragment in str(info.value)


def test_model_config_defaults_and_init_are_deterministic() -> None:
    assert ModelConfig().ff_dim == 4 * 64 and CFG.head_dim == 8
    assert same_weights(TransformerLM(CFG, seed=4), TransformerLM(CFG, seed=4))
    assert not same_weights(TransformerLM(CFG, seed=4), TransformerLM(CFG, seed=5))
    before = torch.random.get_rng_state()
    TransformerLM(CFG, seed=4)
    assert torch.equal(before, torch.random.get_rng_state()), "init must not use the global RNG"


def test_prefill_and_decode_match_the_full_forward() -> None:
    model = TransformerLM(CFG, seed=1).eval()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CFG.vocab_size, (3, 30), generator=gen)
    lengths = torch.tensor([5, 2, 9])
    with torch.inference_mode():
        full = model(tokens)
        cache = KVCache(CFG, max_batch=4)
        # slots in a different order than the rows, right-padded prompts of unequal length
        logits = model.prefill(tokens[:, :9], lengths, cache, torch.tensor([2, 0, 1]))
        rows = torch.arange(3)
        assert float((logits - full[rows, lengths - 1]).abs().max()) < 1e-5
        # decode expects the sequences in slots 0..n-1: reorder to match
        order = torch.tensor([1, 2, 0])  # slot s holds row order[s]
        pos = lengths[order].clone()
        for _ in range(15):
            step = model.decode(tokens[order, pos], pos, cache)
            assert float((step - full[order, pos]).abs().max()) < 1e-5
            pos += 1


# --------------------------------------------------------------------------------------------
# Inference engine: log-probs, sampling, ending
# --------------------------------------------------------------------------------------------
def test_engines_implement_the_protocols() -> None:
    engine = TorchInferenceEngine(CFG)
    for proto in (InferenceEngine, SupportsPause, SupportsSleep, SupportsLoadWeights):
        assert isinstance(engine, proto)
    assert isinstance(TorchTrainEngine(CFG), TrainEngine)
    assert engine.weight_version == 0


def test_logprobs_agree_with_the_trainer_for_batched_and_joining_requests() -> None:
    async def main() -> None:
        engine = TorchInferenceEngine(MODEL, max_batch=8, seed=1)
        trainer = TorchTrainEngine(CFG, temperature=0.7, micro_batch_size=3)
        assert same_weights(engine.model, trainer.model)
        sampled = SamplingParams(max_tokens=14, temperature=0.7)
        filtered = SamplingParams(max_tokens=9, temperature=0.7, top_k=5, top_p=0.8)
        first = [
            engine.submit(req("a", [1, 2, 3, 4, 5, 6, 7], sampled)),
            engine.submit(req("b", [9], sampled)),
            engine.submit(req("c", [4, 4, 4], filtered)),
        ]
        assert await engine.wait_for_tokens("a", 4) == 4
        # these join while "a" is decoding (different prompt lengths again)
        late = [
            engine.submit(req("d", [3, 1], sampled)),
            engine.submit(req("e", list(range(20)), filtered)),
        ]
        results = await asyncio.gather(*first, *late)
        assert engine.prefill_steps >= 2, "the late requests were not admitted mid-decode"
        for r in results:
            check_shape(r)
            assert r.finish_reason == "length" and set(r.versions) == {0}
        assert [len(r.tokens) for r in results] == [14, 14, 9, 14, 9]
        params = [sampled, sampled, filtered, sampled, filtered]
        assert await agree(trainer, results, params) <= TOL
        # the "list" and "nested" layouts give the same log-probs as "padded"
        columns = sampling_columns(params)
        padded = await trainer.compute_logprobs(await padded_batch(results, **columns))
        for layout in ("list", "nested"):
            other = await trainer.compute_logprobs(
                await padded_batch(results, layout=layout, **columns)
            )
            assert torch.equal(padded, other), layout
        await engine.close()

    run(main())


def test_greedy_picks_the_argmax_and_reports_temperature_one_logprobs() -> None:
    async def main() -> None:
        engine = TorchInferenceEngine(CFG)
        trainer = TorchTrainEngine(CFG, temperature=1.0)
        result = await engine.generate(req("g", [5, 6, 7], GREEDY))
        seq = torch.tensor([[5, 6, 7, *result.tokens]])
        logits = trainer.model(seq)[0, 2:-1]  # the positions that predicted each token
        assert result.tokens == tuple(logits.argmax(-1).tolist())
        assert await agree(trainer, [result]) <= TOL
        await engine.close()

    run(main())


def test_top_k_one_is_greedy_and_top_p_keeps_the_nucleus() -> None:
    async def main() -> None:
        engine = TorchInferenceEngine(MODEL, seed=3)
        trainer = TorchTrainEngine(CFG)
        greedy = await engine.generate(req("g", [2, 8], GREEDY))
        top1 = await engine.generate(req("k", [2, 8], SamplingParams(12, temperature=1.0, top_k=1)))
        assert top1.tokens == greedy.tokens
        nucleus = SamplingParams(max_tokens=30, temperature=1.0, top_p=0.3)
        result = await engine.generate(req("p", [2, 8], nucleus))
        seq = torch.tensor([[2, 8, *result.tokens]])
        with torch.no_grad():
            probs = torch.softmax(trainer.model(seq)[0, 1:-1], -1)
        for pos, tok in enumerate(result.tokens):
            sorted_p, order = probs[pos].sort(descending=True)
            before = sorted_p.cumsum(0) - sorted_p
            allowed = set(order[before < 0.3].tolist())
            assert tok in allowed, f"token {tok} at {pos} is outside the top-p=0.3 nucleus"
        assert len(set(result.tokens)) > 1
        top2 = SamplingParams(max_tokens=30, temperature=1.5, top_k=2)
        result = await engine.generate(req("k2", [2, 8], top2))
        seq = torch.tensor([[2, 8, *result.tokens]])
        with torch.no_grad():
            best2 = trainer.model(seq)[0, 1:-1].topk(2, dim=-1).indices.tolist()
        assert all(tok in best2[pos] for pos, tok in enumerate(result.tokens))
        assert any(tok != best2[pos][0] for pos, tok in enumerate(result.tokens))
        await engine.close()

    run(main())


def test_seeded_requests_do_not_depend_on_their_batch_companions() -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234)
    prompt = [3, 1, 4, 1, 5]

    async def alone() -> GenerationResult:
        engine = TorchInferenceEngine(CFG, seed=0)
        result = await engine.generate(req("s", prompt, params))
        await engine.close()
        return result

    async def crowded() -> tuple[GenerationResult, GenerationResult]:
        engine = TorchInferenceEngine(MODEL, seed=99, max_batch=6)
        other = SamplingParams(max_tokens=7, temperature=1.3, top_p=0.9)
        crowd = [engine.submit(req(f"c{i}", [i] * (i + 1), other)) for i in range(4)]
        await engine.wait_for_tokens("c0", 2)  # the seeded one joins mid-decode
        seeded = engine.submit(req("s", prompt, params))
        more = [engine.submit(req(f"m{i}", [7, i], other)) for i in range(5)]
        other_seed = dataclasses.replace(params, seed=4321)
        different = await engine.generate(req("d", prompt, other_seed))
        result = await seeded
        await asyncio.gather(*crowd, *more)
        await engine.close()
        return result, different

    reference = run(alone())
    result, different = run(crowded())
    assert result.tokens == reference.tokens
    assert max(abs(a - b) for a, b in zip(result.logprobs, reference.logprobs, strict=True)) < 1e-5
    assert different.tokens != reference.tokens, "the seed must matter"


def test_unseeded_requests_draw_fresh_randomness() -> None:
    async def main() -> None:
        engine = TorchInferenceEngine(CFG, seed=5)
        params = SamplingParams(max_tokens=16, temperature=1.0)
        a, b = await asyncio.gather(
            engine.generate(req("a", [1, 2], params)), engine.generate(req("b", [1, 2], params))
        )
        assert a.tokens != b.tokens
        await engine.close()

    run(main())


def test_stop_token_is_included_and_ends_with_stop() -> None:
    async def main() -> None:
        engine = TorchInferenceEngine(CFG)
        params = SamplingParams(max_tokens=20, temperature=1.0, seed=7)
        full = await engine.generate(req("f", [1, 2, 3], params))
        assert full.finish_reason == "length" and len(full.tokens) == 20
        stop = full.tokens[5]
        cut = full.tokens.index(stop) + 1
        stopped = await engine.generate(
            req("s", [1, 2, 3], dataclasses.replace(params, stop_token_ids=(31, stop)))
        )
        assert stopped.finish_reason == "stop"
        assert stopped.tokens == full.tokens[:cut] and stopped.tokens[-1] == stop
        assert stopped.logprobs == pytest.approx(full.logprobs[:cut], abs=1e-6)
        await engine.close()

    run(main())


def test_max_tokens_and_the_context_window_end_with_length() -> None:
    async def main() -> None:
        engine = TorchInferenceEngine(CFG)
        five = await engine.generate(req("a", [1], dataclasses.replace(GREEDY, max_tokens=5)))
        assert len(five.tokens) == 5 and five.finish_reason == "length"
        zero = await engine.generate(req("z", [1], dataclasses.replace(GREEDY, max_tokens=0)))
        assert zero.tokens == () and zero.finish_reason == "length"
        long_prompt = [1] * (CFG.max_seq_len - 3)
        window = await engine.generate(
            req("w", long_prompt, dataclasses.replace(GREEDY, max_tokens=50))
        )
        assert len(window.tokens) == 3 and window.finish_reason == "length"
        await engine.close()

    run(main())


def test_many_requests_through_few_slots_all_agree_with_the_trainer() -> None:
    """More requests than slots, finishing at different steps (lengths and stop tokens): the
    slot compaction must keep every sequence's cache and bookkeeping intact."""

    async def main() -> None:
        engine = TorchInferenceEngine(MODEL, max_batch=5, seed=2)
        trainer = TorchTrainEngine(CFG)
        jobs = []
        for i in range(23):
            params = SamplingParams(
                max_tokens=3 + (i * 7) % 15, temperature=1.0, stop_token_ids=(i % 32,)
            )
            prompt = [(i * 5 + j) % 32 for j in range(1 + i % 6)]
            jobs.append(engine.generate(req(f"r{i}", prompt, params)))
        results = await asyncio.gather(*jobs)
        assert {r.finish_reason for r in results} == {"stop", "length"}
        for i, r in enumerate(results):
            check_shape(r)
            if r.finish_reason == "stop":
                assert r.tokens[-1] == i % 32 and i % 32 not in r.tokens[:-1]
            else:
                assert len(r.tokens) == 3 + (i * 7) % 15
        assert await agree(trainer, results) <= TOL
        assert engine.running == 0 and engine.queued == 0
        await engine.close()

    run(main())


# --------------------------------------------------------------------------------------------
# Inference engine: abort, resume, pause, sleep, close
# --------------------------------------------------------------------------------------------
LONG = SamplingParams(max_tokens=30, temperature=0.0)


def test_abort_returns_what_was_generated_so_far() -> None:
    async def main() -> None:
        engine = TorchInferenceEngine(CFG, max_batch=1)
        full = await engine.generate(req("ref", [4, 2], LONG))
        running = engine.submit(req("a", [4, 2], LONG))
        queued = engine.submit(req("q", [4, 2], LONG))
        assert await engine.wait_for_tokens("a", 3) == 3
        await engine.abort(["a", "q", "unknown-id"])
        partial, never = await running, await queued
        assert partial.finish_reason == "abort" and never.finish_reason == "abort"
        assert len(partial.tokens) == 3
        assert partial.tokens == full.tokens[: len(partial.tokens)]
        check_shape(partial)
        assert never.tokens == () and never.versions == ()
        assert engine.running == 0 and engine.queued == 0
        assert engine.requests_aborted == 2
        await engine.close()

    run(main())


def test_watch_tokens_registers_before_the_caller_yields() -> None:
    """A watch made right after submit stops the engine at the count even when the event
    loop is held up afterwards (the worker thread may step freely meanwhile): a
    ``wait_for_tokens`` in a task of its own would register only when that task runs."""

    async def main() -> None:
        engine = TorchInferenceEngine(CFG)
        running = engine.submit(req("a", [4, 2], LONG))
        watch = engine.watch_tokens("a", 2)
        await asyncio.sleep(0)  # the driver starts the first step on the worker thread
        time.sleep(0.3)  # the loop is held up; with no watch the worker would run on
        assert await watch == 2
        await engine.abort(["a"])
        assert len((await running).tokens) == 2
        await engine.close()

    run(main())


def test_resume_from_a_prefix_continues_and_keeps_the_prefix_versions() -> None:
    async def main() -> None:
        engine = TorchInferenceEngine(CFG)
        full = await engine.generate(req("ref", [4, 2], LONG))
        task = engine.submit(req("a", [4, 2], LONG))
        await engine.wait_for_tokens("a", 5)
        await engine.abort(["a"])
        partial = await task
        k = len(partial.tokens)
        assert k == 5 and partial.tokens == full.tokens[:5]
        # stand-ins for the log-probs and versions of an older policy: returned as given
        old_logprobs = tuple(lp - 0.25 for lp in partial.logprobs)
        old_versions = tuple(range(100, 100 + k))
        resumed = await engine.generate(
            req(
                "a",
                [4, 2],
                LONG,
                resume_tokens=partial.tokens,
                resume_logprobs=old_logprobs,
                resume_versions=old_versions,
            )
        )
        assert resumed.finish_reason == "length"
        assert len(resumed.tokens) == 30, "max_tokens counts the resumed tokens"
        assert resumed.tokens == full.tokens
        assert resumed.logprobs[:k] == old_logprobs  # the originals, unchanged
        assert resumed.versions == old_versions + (0,) * (30 - k)
        assert resumed.logprobs[k:] == pytest.approx(full.logprobs[k:], abs=1e-5)
        # a prefix that already reaches max_tokens ends at once, unchanged
        done = await engine.generate(
            req(
                "b",
                [4, 2],
                dataclasses.replace(LONG, max_tokens=k),
                resume_tokens=partial.tokens,
                resume_logprobs=partial.logprobs,
                resume_versions=partial.versions,
            )
        )
        assert done.tokens == partial.tokens and done.finish_reason == "length"
        await engine.close()

    run(main())


def test_pause_keep_freezes_and_resume_continues_identically() -> None:
    async def main() -> None:
        engine = TorchInferenceEngine(CFG)
        full = await engine.generate(req("ref", [7, 7, 1], LONG))
        task = engine.submit(req("a", [7, 7, 1], LONG))
        await engine.wait_for_tokens("a", 3)
        await engine.pause("keep")
        assert engine.paused
        # progress already made is reported while paused (nothing steps to report it)
        assert await asyncio.wait_for(engine.wait_for_tokens("a", 2), timeout=10) == 3
        steps, tokens = engine.decode_steps, engine.tokens_generated
        late = engine.submit(req("late", [1], GREEDY))
        await asyncio.sleep(0.05)  # a negative check: nothing may happen while paused
        assert not task.done() and not late.done()
        assert (engine.decode_steps, engine.tokens_generated) == (steps, tokens)
        assert engine.queued == 1 and engine.running == 1
        await engine.resume()
        result, other = await task, await late
        assert result.tokens == full.tokens and result.finish_reason == "length"
        assert other.finish_reason == "length" and len(other.tokens) == 12
        await engine.close()

    run(main())


def test_pause_abort_ends_everything_and_new_requests_wait_for_resume() -> None:
    async def main() -> None:
        engine = TorchInferenceEngine(CFG, max_batch=1)
        running = engine.submit(req("a", [1, 2], LONG))
        queued = engine.submit(req("b", [1, 2], LONG))
        await engine.wait_for_tokens("a", 2)
        await engine.pause("abort")
        a, b = await running, await queued
        assert (a.finish_reason, b.finish_reason) == ("abort", "abort")
        assert len(a.tokens) >= 2 and b.tokens == ()
        waiting = engine.submit(req("c", [1, 2], GREEDY))
        await asyncio.sleep(0.05)  # a negative check: paused, so it must not start
        assert not waiting.done() and engine.queued == 1
        await engine.resume()
        c = await waiting
        assert c.finish_reason == "length" and a.tokens == c.tokens[: len(a.tokens)]
        await engine.close()

    run(main())


def test_sleep_frees_the_cache_refuses_work_and_wake_up_continues_the_frozen_sequences() -> None:
    async def main() -> None:
        engine = TorchInferenceEngine(CFG, max_batch=1)
        trainer = TorchTrainEngine(CFG)
        full = await engine.generate(req("ref", [3, 3], LONG))
        task = engine.submit(req("a", [3, 3], LONG))
        queued = engine.submit(req("q", [5], GREEDY))  # waits for the only slot
        await engine.wait_for_tokens("a", 4)
        assert engine.kv_cache_bytes > 0
        await engine.sleep()
        sleeping = engine.asleep  # (a local: mypy would narrow the property for good)
        assert sleeping and engine.kv_cache_bytes == 0
        with pytest.raises(EngineError, match=r"asleep .* call wake_up\(\) before generate"):
            await engine.generate(req("late", [5], GREEDY))
        assert engine.queued == 1 and engine.running == 1
        steps = engine.decode_steps
        await asyncio.sleep(0.05)  # a negative check: asleep, nothing is computed
        assert not task.done() and not queued.done() and engine.decode_steps == steps
        await engine.wake_up()
        assert engine.kv_cache_bytes > 0 and not engine.asleep
        result, other = await task, await queued
        assert result.tokens == full.tokens
        late = await engine.generate(req("late", [5], GREEDY))
        assert late.tokens == other.tokens
        assert await agree(trainer, [result, other]) <= TOL
        await engine.close()

    run(main())


def test_close_aborts_in_flight_work_and_refuses_more() -> None:
    async def main() -> None:
        engine = TorchInferenceEngine(CFG)
        task = engine.submit(req("a", [1], LONG))
        await engine.wait_for_tokens("a", 1)
        await engine.close()
        assert (await task).finish_reason == "abort"
        with pytest.raises(EngineError, match="closed"):
            await engine.generate(req("b", [1]))

    run(main())


def test_a_failing_step_fails_the_requests_in_flight_and_the_engine_recovers() -> None:
    async def main() -> None:
        engine = TorchInferenceEngine(CFG)
        reference = await engine.generate(req("ref", [2, 4], LONG))
        real_decode = engine.model.decode
        armed = threading.Event()

        def broken(*args: Any) -> torch.Tensor:
            if armed.is_set():
                raise RuntimeError("simulated kernel failure")
            return real_decode(*args)

        setattr(engine.model, "decode", broken)  # noqa: B010 (an instance attribute)
        doomed = engine.submit(req("a", [2, 4], LONG))
        watcher = engine.watch_tokens("a", 20)  # registered now
        await engine.wait_for_tokens("a", 2)
        armed.set()  # the next step fails
        with pytest.raises(EngineError, match=r"generation failed .*simulated kernel failure"):
            await doomed
        with pytest.raises(EngineError, match="generation failed"):
            await watcher
        assert engine.running == 0 and engine.queued == 0
        armed.clear()
        again = await engine.generate(req("a", [2, 4], LONG))
        assert again.tokens == reference.tokens
        await engine.close()

    run(main())


def test_cancelled_requests_are_dropped_and_free_their_slot() -> None:
    async def main() -> None:
        engine = TorchInferenceEngine(CFG, max_batch=1)
        running = engine.submit(req("a", [1], LONG))
        queued_task = asyncio.ensure_future(engine.generate(req("b", [1], LONG)))
        await engine.wait_for_tokens("a", 2)  # meanwhile "b" was submitted and queued
        assert engine.queued == 1
        queued_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued_task
        assert engine.queued == 0
        running.cancel()
        # the only slot must come back: this request can only finish if it did
        result = await engine.generate(req("a", [1], GREEDY))
        assert result.finish_reason == "length" and len(result.tokens) == 12
        assert engine.running == 0 and engine.requests_aborted == 1
        await engine.close()

    run(main())


# --------------------------------------------------------------------------------------------
# Weights: load mid-generation, export round trip, buckets
# --------------------------------------------------------------------------------------------
def test_load_weights_mid_generation_switches_versions_and_matches_a_fresh_engine() -> None:
    async def main() -> None:
        old = TorchTrainEngine(CFG, seed=0)
        new = TorchTrainEngine(CFG, seed=11)  # other weights: "version 1"
        engine = TorchInferenceEngine(CFG, seed=0)
        reference_old = await engine.generate(req("ref", [6, 1, 6], LONG))
        new_weights = await export_all(new)
        task = engine.submit(req("a", [6, 1, 6], LONG))
        await engine.wait_for_tokens("a", 4)
        await engine.load_weights(new_weights, version=1)  # while "a" is decoding
        assert engine.weight_version == 1
        result = await task
        k = 4
        assert result.versions == (0,) * k + (1,) * (30 - k)
        assert result.tokens[:k] == reference_old.tokens[:k]
        # after the load, it decodes exactly like a fresh engine holding the new weights
        fresh = TorchInferenceEngine(new.model)
        continued = await fresh.generate(
            req(
                "a",
                [6, 1, 6],
                LONG,
                resume_tokens=result.tokens[:k],
                resume_logprobs=result.logprobs[:k],
                resume_versions=result.versions[:k],
            )
        )
        assert continued.tokens == result.tokens
        # and each token's log-prob is that of the weights that sampled it
        batch = await padded_batch([result])
        lp_old = (await old.compute_logprobs(batch))[0]
        lp_new = (await new.compute_logprobs(batch))[0]
        mine = torch.tensor(result.logprobs)
        assert float((lp_old[:k] - mine[:k]).abs().max()) <= TOL
        assert float((lp_new[k:] - mine[k:]).abs().max()) <= TOL
        # new requests match the fresh engine too
        a = await engine.generate(req("n", [2, 2], GREEDY))
        b = await fresh.generate(req("n", [2, 2], GREEDY))
        assert a.tokens == b.tokens and set(a.versions) == {1}
        await engine.close()
        await fresh.close()

    run(main())


def test_export_then_load_makes_the_engines_agree_after_a_train_step() -> None:
    async def main() -> None:
        engine = TorchInferenceEngine(MODEL, seed=1)
        trainer = TorchTrainEngine(CFG, lr=1e-2)
        params = SamplingParams(max_tokens=8, temperature=1.0)
        rollout = await asyncio.gather(
            *(engine.generate(req(f"r{i}", [i, i + 1], params)) for i in range(6))
        )
        batch = await padded_batch(rollout, advantage=[1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
        metrics = await trainer.train_step(batch, policy_gradient_loss)
        assert metrics.version == trainer.weight_version == 1
        assert not same_weights(engine.model, trainer.model)
        async for bucket in trainer.export_weights(bucket_bytes=4096):
            await engine.load_weights(list(bucket), version=trainer.weight_version)
        assert same_weights(engine.model, trainer.model)
        after = await asyncio.gather(
            *(engine.generate(req(f"s{i}", [i, 3], params)) for i in range(4))
        )
        assert all(set(r.versions) == {1} for r in after)
        assert await agree(trainer, after) <= TOL
        await engine.close()

    run(main())


def test_export_buckets_hold_every_parameter_once_within_the_bound() -> None:
    async def main() -> None:
        trainer = TorchTrainEngine(CFG)
        state = trainer.model.state_dict()
        sizes = {n: t.numel() * t.element_size() for n, t in state.items()}
        bound = 3000
        assert max(sizes.values()) > bound > min(sizes.values())  # both cases occur
        buckets = [b async for b in trainer.export_weights(bound)]
        names = [n for b in buckets for n in b.names]
        assert names == list(state)  # every parameter once, in order
        for b in buckets:
            assert b.nbytes <= bound or len(b.names) == 1
        assert any(len(b.names) > 1 for b in buckets)
        for name, tensor in (pair for b in buckets for pair in b):
            assert torch.equal(tensor, state[name])
        # a snapshot: later training does not change what was exported
        first_name, first = buckets[0].names[0], buckets[0].tensors[0].clone()
        batch = await padded_batch(
            [GenerationResult("x", (1, 2), (3, 4), (0.0, 0.0), (0, 0), "length")], advantage=[1.0]
        )
        await trainer.train_step(batch, policy_gradient_loss)
        assert torch.equal(buckets[0].tensors[0], first)
        assert not torch.equal(trainer.model.state_dict()[first_name], first)
        with pytest.raises(EngineError, match="bucket_bytes must be an int > 0"):
            trainer.export_weights(0)

    run(main())


# --------------------------------------------------------------------------------------------
# Trainer: micro-batching, checkpoints, learning
# --------------------------------------------------------------------------------------------
def _rows(n: int, seed: int) -> list[GenerationResult]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(0, 32, (1 + i % 4,), generator=gen).tolist()
        r = torch.randint(0, 32, (2 + (i * 3) % 7,), generator=gen).tolist()
        out.append(
            GenerationResult(f"x{i}", tuple(p), tuple(r), (0.0,) * len(r), (0,) * len(r), "length")
        )
    return out


def test_micro_batching_matches_one_big_batch() -> None:
    async def main() -> None:
        rows = _rows(6, seed=0)
        advantages = [0.7, -1.2, 0.3, 1.5, -0.4, -0.9]
        batch = await padded_batch(rows, advantage=advantages)
        seen: list[tuple[int, tuple[int, ...], list[int], int, tuple[Any, ...]]] = []

        def recording(
            logprobs: torch.Tensor, batch: Batch
        ) -> tuple[torch.Tensor, Mapping[str, float]]:
            seen.append(
                (
                    logprobs.shape[0],
                    batch.rows,
                    batch.lengths["response"].tolist(),
                    batch["response"].shape[1],
                    tuple(t.group for t in batch.tags),
                )
            )
            return policy_gradient_loss(logprobs, batch)

        final = {}
        for mbs in (6, 1, 4):
            trainer = TorchTrainEngine(CFG, lr=1e-3, micro_batch_size=mbs, max_grad_norm=0.5)
            seen.clear()
            m1 = await trainer.train_step(batch, recording)
            m2 = await trainer.train_step(batch, recording)
            final[mbs] = (trainer.model.state_dict(), m1, m2)
            assert len(seen) == 2 * math.ceil(6 / mbs)
            if mbs == 4:  # each part is its own rows, lengths and tags, at the full width
                lengths = batch.lengths["response"].tolist()
                groups = tuple(t.group for t in batch.tags)
                width = batch["response"].shape[1]
                assert seen[0] == (4, batch.rows[:4], lengths[:4], width, groups[:4])
                assert seen[1] == (2, batch.rows[4:], lengths[4:], width, groups[4:])
        base, b1, b2 = final[6]
        for mbs in (1, 4):
            state, m1, m2 = final[mbs]
            diff = max(float((state[k] - base[k]).abs().max()) for k in base)
            assert diff <= 1e-5, f"micro_batch_size={mbs} drifts by {diff}"
            assert m1.loss == pytest.approx(b1.loss, abs=1e-5)
            assert m1.grad_norm == pytest.approx(b1.grad_norm, rel=1e-4)
            assert m2.extra["pg_loss"] == pytest.approx(b2.extra["pg_loss"], abs=1e-5)
        assert b1.grad_norm > 0.5, "clipping must be active for this check to mean something"
        assert b1.tokens == int(batch.lengths["prompt"].sum() + batch.lengths["response"].sum())
        assert (b1.samples, b1.version, b2.version) == (6, 1, 2)

    run(main())


def test_tokens_off_the_top_k_support_get_the_floor_and_are_counted() -> None:
    """Random response tokens scored under top_k=1: most are not the argmax, so they are off
    the trainer's support. They get the finite floor (never -inf or NaN), train_step counts
    them in ``logprobs_off_support`` and the loss and its gradient stay finite."""

    async def main() -> None:
        rows = _rows(4, seed=5)
        params = [SamplingParams(temperature=1.0, top_k=1)] * len(rows)
        batch = await padded_batch(
            rows, advantage=[1.0, -1.0, 0.5, -0.5], **sampling_columns(params)
        )
        trainer = TorchTrainEngine(CFG, lr=1e-3)
        lp = await trainer.compute_logprobs(batch)
        lengths = batch.lengths["response"]
        real = torch.arange(lp.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
        assert bool(torch.isfinite(lp).all()) and bool((lp[real] <= 0).all())
        inside = int((lp[real] == 0).sum())  # top_k=1: the argmax has probability 1
        metrics = await trainer.train_step(batch, policy_gradient_loss)
        assert metrics.extra["logprobs_off_support"] == int(lengths.sum()) - inside > 0
        assert math.isfinite(metrics.loss) and math.isfinite(metrics.grad_norm)

    run(main())


def test_gradient_clipping_bounds_the_update_and_reports_the_norm_before_it() -> None:
    """Adam is nearly blind to a gradient's scale, except next to its eps (1e-8): clipped to a
    norm of 1e-9, every update is at most lr * 1e-9 / (1e-9 + 1e-8) < lr / 10."""

    async def main() -> None:
        batch = await padded_batch(_rows(4, seed=3), advantage=[1.0, -1.0, 0.5, -0.5])
        lr = 1e-3
        moved = {}
        norms = {}
        for clip in (None, 1e-9):
            trainer = TorchTrainEngine(CFG, lr=lr, max_grad_norm=clip)
            before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
            norms[clip] = (await trainer.train_step(batch, policy_gradient_loss)).grad_norm
            after = trainer.model.state_dict()
            moved[clip] = max(float((after[k] - before[k]).abs().max()) for k in before)
        assert norms[None] == pytest.approx(norms[1e-9]) and norms[None] > 1e-3
        assert moved[None] > 0.9 * lr
        assert moved[1e-9] < 0.1 * lr

    run(main())


def test_minibatches_take_one_optimizer_step_each_and_one_version() -> None:
    """minibatches=2 over 6 rows is exactly two steps of a one-step trainer on rows 0-2 then
    3-5 (same seed, same micro-batching), but adds 1 to the version, not 2."""

    async def main() -> None:
        batch = await padded_batch(_rows(6, seed=4), advantage=[1.0, -1.0, 0.5, -0.5, 0.3, -0.2])
        two = TorchTrainEngine(CFG, lr=5e-3, micro_batch_size=2, minibatches=2)
        one = TorchTrainEngine(CFG, lr=5e-3, micro_batch_size=2)
        assert same_weights(two.model, one.model)
        metrics = await two.train_step(batch, policy_gradient_loss)
        assert metrics.version == 1 and two.weight_version == 1
        assert metrics.extra["minibatches"] == 2 and metrics.extra["micro_batches"] == 4
        await one.train_step(batch.slice(0, 3), policy_gradient_loss)
        await one.train_step(batch.slice(3, 6), policy_gradient_loss)
        assert one.weight_version == 2
        for name, tensor in two.model.state_dict().items():
            assert torch.allclose(tensor, one.model.state_dict()[name], atol=1e-6), name
        # one step per batch (the default) lands elsewhere: the minibatches did step twice
        single = TorchTrainEngine(CFG, lr=5e-3, micro_batch_size=2)
        await single.train_step(batch, policy_gradient_loss)
        assert not same_weights(single.model, two.model)

    run(main())


def test_a_minibatch_that_fails_undoes_the_earlier_ones() -> None:
    """The second minibatch's loss is NaN: the first one's step is undone too, the version,
    weights and optimizer state are as before."""

    async def main() -> None:
        batch = await padded_batch(_rows(4, seed=5), advantage=[1.0, -1.0, 0.5, -0.5])
        trainer = TorchTrainEngine(CFG, lr=5e-3, micro_batch_size=2, minibatches=2)
        await trainer.train_step(batch, policy_gradient_loss)  # optimizer state exists
        state = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        opt = optimizer_tensors(trainer)
        steps = trainer._steps_taken  # optimizer steps (the lr warm-up counts them): 2
        calls = []

        def second_fails(logprobs: torch.Tensor, part: Batch) -> Any:
            calls.append(len(part))
            loss, metrics = policy_gradient_loss(logprobs, part)
            return (loss * math.nan, metrics) if len(calls) == 2 else (loss, metrics)

        with pytest.raises(EngineError, match=r"not finite|NaN|nan"):
            await trainer.train_step(batch, second_fails)
        assert calls == [2, 2] and trainer.weight_version == 1
        assert all(torch.equal(v, state[k]) for k, v in trainer.model.state_dict().items())
        now = optimizer_tensors(trainer)
        assert now.keys() == opt.keys() and all(torch.equal(now[k], opt[k]) for k in opt)
        assert trainer._steps_taken == steps == 2

    run(main())


def test_checkpoint_round_trip_restores_weights_optimizer_and_version(tmp_path: Path) -> None:
    async def main() -> None:
        batch = await padded_batch(_rows(5, seed=1), advantage=[1.0, -1.0, 0.5, 0.2, -0.7])
        original = TorchTrainEngine(CFG, lr=5e-3, weight_decay=0.01, micro_batch_size=2)
        for _ in range(2):
            await original.train_step(batch, policy_gradient_loss)
        await original.save_checkpoint(str(tmp_path / "ckpt"))
        files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
        assert files == sorted([CHECKPOINT_META, CHECKPOINT_OPTIMIZER, CHECKPOINT_WEIGHTS])
        on_disk = safetensors.torch.load_file(str(tmp_path / "ckpt" / CHECKPOINT_WEIGHTS))
        assert on_disk.keys() == original.model.state_dict().keys()
        assert json.loads((tmp_path / "ckpt" / CHECKPOINT_META).read_text())["version"] == 2

        restored = TorchTrainEngine(CFG, lr=5e-3, weight_decay=0.01, micro_batch_size=2, seed=77)
        assert not same_weights(restored.model, original.model)
        await restored.load_checkpoint(str(tmp_path / "ckpt"))
        assert restored.weight_version == 2
        for name, tensor in restored.model.state_dict().items():  # byte-equal
            other = original.model.state_dict()[name]
            assert tensor.numpy().tobytes() == other.numpy().tobytes(), name
        for _ in range(2):
            a = await original.train_step(batch, policy_gradient_loss)
            b = await restored.train_step(batch, policy_gradient_loss)
            assert (a.loss, a.grad_norm, a.version) == (b.loss, b.grad_norm, b.version)
        assert same_weights(original.model, restored.model)
        # without the optimizer state (a fresh AdamW), the next steps would differ
        fresh = TorchTrainEngine(CFG, lr=5e-3, weight_decay=0.01, micro_batch_size=2)
        fresh.model.load_state_dict(on_disk)
        for _ in range(2):
            await fresh.train_step(batch, policy_gradient_loss)
        assert not same_weights(fresh.model, original.model)

    run(main())


def test_load_checkpoint_rejects_bad_checkpoints_and_changes_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        trainer = TorchTrainEngine(CFG)
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        with pytest.raises(EngineError, match="is not readable"):
            await trainer.load_checkpoint(str(tmp_path / "missing"))
        other = TorchTrainEngine(dataclasses.replace(CFG, d_ff=64))
        await other.save_checkpoint(str(tmp_path / "other"))
        with pytest.raises(EngineError, match="this engine's model is"):
            await trainer.load_checkpoint(str(tmp_path / "other"))
        assert trainer.weight_version == 0
        assert all(torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())

    run(main())


def test_policy_gradient_learns_to_prefer_a_rewarded_token() -> None:
    """Rollout -> reward -> advantages -> train -> sync, a few dozen times: the probability of
    the rewarded first token rises far above its start."""
    good, prompt = 7, (1, 2, 3)

    async def prob_of_good(trainer: TorchTrainEngine) -> float:
        probe = GenerationResult("p", prompt, (good,), (0.0,), (0,), "length")
        lp = await trainer.compute_logprobs(await padded_batch([probe]))
        return math.exp(float(lp[0, 0]))

    async def main() -> tuple[float, float, float]:
        small = dataclasses.replace(CFG, init_std=0.02)  # near-uniform start
        engine = TorchInferenceEngine(small, seed=0, max_batch=32)
        trainer = TorchTrainEngine(small, lr=1e-2, micro_batch_size=16)
        start = await prob_of_good(trainer)
        params = SamplingParams(max_tokens=2, temperature=1.0)
        rewards_seen = []
        for step in range(30):
            rollout = await asyncio.gather(
                *(engine.generate(req(f"{step}-{i}", prompt, params)) for i in range(32))
            )
            rewards = [1.0 if r.tokens[0] == good else 0.0 for r in rollout]
            rewards_seen.append(sum(rewards) / len(rewards))
            adv = group_advantages(rewards, [0] * len(rewards)).tolist()
            batch = await padded_batch(rollout, advantage=adv)
            await trainer.train_step(batch, policy_gradient_loss)
            await engine.load_weights(await export_all(trainer), trainer.weight_version)
        await engine.close()
        return start, await prob_of_good(trainer), sum(rewards_seen[-5:]) / 5

    start, end, late_reward = run(main())
    assert start < 0.1
    assert end > 0.6, f"p(good) went from {start:.3f} to {end:.3f}"
    assert late_reward > 0.4


# --------------------------------------------------------------------------------------------
# Bad input: every message, and nothing changes
# --------------------------------------------------------------------------------------------
S = CFG.max_seq_len
BAD_REQUESTS: list[tuple[GenerationRequest, str]] = [
    (req("x", []), "prompt_tokens=() must be a non-empty tuple"),
    (req("x", [1] * S), f"prompt_tokens has {S} tokens; max_seq_len={S} leaves room for"),
    (req("x", [1, 32]), "prompt_tokens[1]=32 is not a token id; use ints in [0, 32)"),
    (req("x", [1, -1]), "prompt_tokens[1]=-1 is not a token id"),
    (req("x", [1, True]), "prompt_tokens[1]=True is not a token id"),
    (req("x", [1], SamplingParams(max_tokens=-1)), "max_tokens=-1; use an int >= 0"),
    (req("x", [1], SamplingParams(temperature=-0.5)), "temperature=-0.5; use a finite number"),
    (req("x", [1], SamplingParams(temperature=math.nan)), "temperature=nan"),
    (req("x", [1], SamplingParams(top_p=0.0)), "top_p=0.0; use a number in (0, 1]"),
    (req("x", [1], SamplingParams(top_p=1.5)), "top_p=1.5; use a number in (0, 1]"),
    (req("x", [1], SamplingParams(top_k=-1)), "top_k=-1; use an int >= 0"),
    (req("x", [1], SamplingParams(seed=-3)), "seed=-3; use None or an int in [0, 2**63)"),
    (req("x", [1], SamplingParams(stop_token_ids=(40,))), "stop_token_ids[0]=40 is not a token"),
    (
        req("x", [1], resume_tokens=(1, 2), resume_logprobs=(0.0,), resume_versions=(0, 0)),
        "resumes 2 tokens with 1 resume_logprobs and 2 resume_versions",
    ),
    (
        req("x", [1], resume_tokens=(99,), resume_logprobs=(0.0,), resume_versions=(0,)),
        "resume_tokens[0]=99 is not a token id",
    ),
    (
        req(
            "x",
            [1],
            SamplingParams(max_tokens=1),
            resume_tokens=(1, 2),
            resume_logprobs=(0.0, 0.0),
            resume_versions=(0, 0),
        ),
        "resumes 2 tokens but max_tokens=1 caps the whole response",
    ),
    (
        req(
            "x",
            [1] * 30,
            resume_tokens=(1,) * 11,
            resume_logprobs=(0.0,) * 11,
            resume_versions=(0,) * 11,
        ),
        f"prompt (30) + resume_tokens (11) = 41 tokens exceed max_seq_len={S}",
    ),
]


@pytest.mark.parametrize(("bad", "fragment"), BAD_REQUESTS)
def test_bad_requests_are_rejected_by_name_and_change_nothing(
    bad: GenerationRequest, fragment: str
) -> None:
    params = SamplingParams(max_tokens=10, temperature=1.0)

    async def main() -> tuple[GenerationResult, GenerationResult]:
        engine = TorchInferenceEngine(CFG, seed=3)
        pristine = TorchInferenceEngine(CFG, seed=3)
        with pytest.raises(EngineError) as info:
            await engine.generate(bad)
        assert fragment in str(info.value), str(info.value)
        assert "request 'x'" in str(info.value)
        assert engine.running == engine.queued == 0 and engine.tokens_generated == 0
        # unchanged: the same unseeded request draws exactly what a pristine engine draws
        a = await engine.generate(req("x", [5, 5], params))
        b = await pristine.generate(req("x", [5, 5], params))
        await engine.close()
        await pristine.close()
        return a, b

    a, b = run(main())
    assert a.tokens == b.tokens


def test_a_duplicate_in_flight_id_is_rejected_and_the_first_request_is_untouched() -> None:
    async def main() -> None:
        engine = TorchInferenceEngine(CFG)
        reference = await engine.generate(req("ref", [1, 2], LONG))
        task = engine.submit(req("a", [1, 2], LONG))
        await engine.wait_for_tokens("a", 1)
        with pytest.raises(EngineError, match="request 'a': is already in flight; wait for it"):
            await engine.generate(req("a", [9], GREEDY))
        assert (await task).tokens == reference.tokens
        await engine.close()

    run(main())


def test_bad_control_calls_are_rejected_by_name() -> None:
    async def main() -> None:
        engine = TorchInferenceEngine(CFG)
        with pytest.raises(EngineError, match="abort takes a sequence of request ids"):
            await engine.abort("r1")
        with pytest.raises(EngineError, match="pause mode must be 'abort' or 'keep', got 'x'"):
            await engine.pause("x")  # type: ignore[arg-type]
        assert not engine.paused
        with pytest.raises(EngineError, match="sleep level must be 1 or 2, got 3"):
            await engine.sleep(3)
        assert not engine.asleep
        with pytest.raises(EngineError, match="request 'nope' is not in flight"):
            await engine.wait_for_tokens("nope", 1)
        with pytest.raises(EngineError, match="count must be an int >= 0"):
            await engine.wait_for_tokens("nope", -1)
        with pytest.raises(EngineError, match="generate takes a GenerationRequest"):
            await engine.generate(("r", (1,)))  # type: ignore[arg-type]
        await engine.close()

    run(main())


def optimizer_tensors(trainer: TorchTrainEngine) -> dict[tuple[int, str], torch.Tensor]:
    state = trainer._optimizer.state_dict()["state"]
    return {(i, k): torch.as_tensor(v).clone() for i, s in state.items() for k, v in s.items()}


def _weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, t.clone() + 1) for n, t in model.state_dict().items()]


@pytest.mark.parametrize(
    ("mutate", "version", "fragment"),
    [
        (lambda w: [*w, ("blocks.9.qkv.weight", w[0][1])], 1, "unknown parameter 'blocks.9.qkv"),
        (lambda w: [*w, w[0]], 1, "parameter 'tok_emb.weight' given twice"),
        (lambda w: [(w[0][0], w[0][1][:-1]), *w[1:]], 1, "has shape (31, 32), the model's is"),
        (lambda w: [(w[0][0], w[0][1].long()), *w[1:]], 1, "must be a floating-point tensor"),
        (
            lambda w: [(w[0][0], torch.empty(32, 32, device="meta")), *w[1:]],
            1,
            "is a meta tensor",
        ),
        (lambda w: w, "1", "version must be an int, got '1'"),
        (lambda w: [*w, ("only-a-name",)], 1, "takes (name, tensor) pairs"),
    ],
)
def test_bad_weight_loads_load_nothing(mutate: Any, version: Any, fragment: str) -> None:
    async def main() -> None:
        engine = TorchInferenceEngine(CFG)
        before = {k: v.clone() for k, v in engine.model.state_dict().items()}
        with pytest.raises(EngineError) as info:
            await engine.load_weights(mutate(_weights(engine.model)), version)
        assert fragment in str(info.value), str(info.value)
        assert engine.weight_version == 0
        assert all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())
        await engine.close()

    run(main())


def test_bad_batches_are_rejected_by_name_and_change_nothing() -> None:
    async def main() -> None:
        trainer = TorchTrainEngine(CFG, micro_batch_size=2)
        good = await padded_batch(_rows(3, seed=2), advantage=[1.0, 0.0, -1.0])
        await trainer.train_step(good, policy_gradient_loss)  # optimizer state exists now
        state = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        opt = optimizer_tensors(trainer)
        assert len(opt) == 3 * len(state)  # step, exp_avg, exp_avg_sq per parameter

        def with_data(**change: Any) -> Batch:
            return Batch(good.rows, {**good.data, **change}, dict(good.lengths), good.tags)

        prompt, response = good["prompt"], good["response"]
        too_long = torch.zeros(3, S, dtype=torch.long)
        cases: list[tuple[Batch, Any, str]] = [
            (Batch(good.rows, {"prompt": prompt}), policy_gradient_loss, "no 'response' field"),
            (with_data(response=response.float()), policy_gradient_loss, "integer token ids"),
            (with_data(response=response + 40), policy_gradient_loss, "is not a token id"),
            (
                Batch(
                    good.rows,
                    dict(good.data),
                    {**good.lengths, "prompt": torch.tensor([0, 1, 1])},
                    good.tags,
                ),
                policy_gradient_loss,
                "prompt of row 0 is empty",
            ),
            (
                Batch(
                    good.rows,
                    {**good.data, "response": too_long},
                    {"prompt": good.lengths["prompt"]},
                    good.tags,
                ),
                policy_gradient_loss,
                f"max_seq_len={S}; truncate it",
            ),
            (
                Batch(
                    good.rows,
                    dict(good.data),
                    {**good.lengths, "response": torch.tensor([1, 99, 1])},
                    good.tags,
                ),
                policy_gradient_loss,
                "do not fit a [3, ",
            ),
            (
                with_data(advantage=torch.tensor(1.0)),
                policy_gradient_loss,
                "cannot split field 'advantage'",
            ),
            (good, lambda lp, b: (lp.sum() * math.nan, {}), "non-finite loss"),
            (good, lambda lp, b: (torch.tensor(1.0), {}), "does not depend on the log-probs"),
            (good, lambda lp, b: lp.sum(), "must return (loss, metrics)"),
            (good, lambda lp, b: (lp, {}), "loss must be a scalar tensor"),
            (good, lambda lp, b: (lp.sum(), {"m": "x"}), "metric 'm'='x' is not a number"),
            (good, "not callable", "loss_fn must be callable"),
        ]
        for batch, loss_fn, fragment in cases:
            with pytest.raises(EngineError) as info:
                await trainer.train_step(batch, loss_fn)
            assert fragment in str(info.value), (fragment, str(info.value))
            assert trainer.weight_version == 1
            assert all(torch.equal(v, state[k]) for k, v in trainer.model.state_dict().items())
            now = optimizer_tensors(trainer)
            assert now.keys() == opt.keys() and all(torch.equal(now[k], opt[k]) for k in opt)
            assert all(p.grad is None for p in trainer.model.parameters())
        with pytest.raises(EngineError, match="no 'response' field"):
            await trainer.compute_logprobs(Batch(good.rows, {"prompt": prompt}))

    run(main())


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"lr": 0}, "lr must be a number > 0"),
        ({"weight_decay": -1}, "weight_decay must be a number >= 0"),
        ({"betas": (0.9, 1.0)}, "betas must be two numbers in [0, 1)"),
        ({"max_grad_norm": 0}, "max_grad_norm must be a number > 0 or None"),
        ({"micro_batch_size": 0}, "micro_batch_size must be an int >= 1"),
        ({"minibatches": 0}, "minibatches must be an int >= 1, got 0"),
        ({"temperature": 0}, "temperature must be a number > 0"),
        ({"seed": -1}, "seed must be an int in [0, 2**63)"),
    ],
)
def test_bad_trainer_settings_raise_config_errors(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        TorchTrainEngine(CFG, **kwargs)
    assert fragment in str(info.value)


def test_threads_apply_to_the_engine_worker_only() -> None:
    torch.set_num_threads(2)  # the fixture restores the process setting afterwards
    before = torch.get_num_threads()
    engine = TorchInferenceEngine(CFG, threads=1)
    trainer = TorchTrainEngine(CFG, threads=1)
    inherit = TorchInferenceEngine(CFG)  # threads=None: torch's setting
    assert engine._executor.submit(torch.get_num_threads).result() == 1
    assert trainer._executor.submit(torch.get_num_threads).result() == 1
    assert inherit._executor.submit(torch.get_num_threads).result() == 2
    assert torch.get_num_threads() == before
    with ThreadPoolExecutor(1) as other:  # threads created later keep torch's default
        assert other.submit(torch.get_num_threads).result() == before
    with pytest.raises(ConfigError, match="threads must be None or an int in"):
        TorchInferenceEngine(CFG, threads=0)


def test_an_engine_moves_to_a_new_event_loop() -> None:
    engine = TorchInferenceEngine(CFG)
    first = run(engine.generate(req("a", [1, 2])))
    second = run(engine.generate(req("a", [1, 2])))  # asyncio.run: a new loop, a new driver
    assert first.tokens == second.tokens and len(first.tokens) == 12


def test_bad_engine_settings_raise_config_errors() -> None:
    with pytest.raises(ConfigError, match="max_batch must be an int in"):
        TorchInferenceEngine(CFG, max_batch=0)
    with pytest.raises(ConfigError, match="takes a ModelConfig or a TransformerLM"):
        TorchInferenceEngine(torch.nn.Linear(2, 2))  # type: ignore[arg-type]
