"""``asyncflow_core.flow.agent``: trajectories, the generation client and a loop, on the reference
engine (real tokens, log-probs and versions)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest
from asyncflow_reference.engines import TorchInferenceEngine
from asyncflow_reference.model import ModelConfig

from asyncflow_core.contracts.errors import BadRequestError, ConfigError
from asyncflow_core.contracts.protocols import GenerationRequest, GenerationResult, SamplingParams
from asyncflow_core.data.scheduling import RequestRouter
from asyncflow_core.flow.agent import (
    NO_VERSION,
    AgentLoop,
    GenerationClient,
    Trajectory,
    TrajectoryLimitReached,
    TrajectoryLimits,
    Turn,
)

MODEL = ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, max_seq_len=256)
TOOL_ANSWER = (9, 9, 3)


class Recording:
    """An engine wrapper recording every request it is sent."""

    def __init__(self, inner: TorchInferenceEngine) -> None:
        self.inner = inner
        self.requests: list[GenerationRequest] = []

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.requests.append(request)
        return await self.inner.generate(request)

    async def abort(self, request_ids: Any) -> None:
        await self.inner.abort(request_ids)


class ToolLoop:
    """Generate, answer with a fixed 'tool' message, generate again (twice)."""

    async def run(self, sample: Mapping[str, Any], client: GenerationClient) -> Trajectory:
        client.add(sample["prompt"], role="prompt")
        for _ in range(2):
            await client.generate()
            client.add(TOOL_ANSWER, role="tool", tool="echo")
        await client.generate()
        return client.trajectory(reward=1.0, answer=sample.get("answer"))


def engines(n: int) -> list[Recording]:
    return [
        Recording(TorchInferenceEngine(MODEL, max_batch=8, seed=i, threads=1)) for i in range(n)
    ]


async def close(es: list[Recording]) -> None:
    for e in es:
        await e.inner.close()


def client_for(es: list[Recording], router: RequestRouter, tid: str, **kw: Any) -> GenerationClient:
    return GenerationClient(es, router, tid, sampling=SamplingParams(max_tokens=6, seed=1), **kw)  # type: ignore[arg-type]


def test_a_loop_builds_an_exact_trajectory() -> None:
    """Token in, token out: every turn's request is exactly the trajectory so far; the mask
    is 1 exactly on generated tokens; tool tokens are masked out; turns tile the tokens."""

    async def main() -> None:
        es = engines(1)
        router = RequestRouter(["0"])
        try:
            loop = ToolLoop()
            assert isinstance(loop, AgentLoop)
            client = client_for(es, router, "traj-0")
            t = await loop.run({"prompt": (1, 2, 3), "answer": 7}, client)
            reqs = es[0].requests
            assert [r.request_id for r in reqs] == ["traj-0.t0", "traj-0.t1", "traj-0.t2"]
            for r, turn in zip(reqs, t.assistant_turns(), strict=True):
                assert r.prompt_tokens == t.tokens[: turn.start]  # the exact context
            roles = [turn.role for turn in t.turns]
            assert roles == ["prompt", "assistant", "tool", "assistant", "tool", "assistant"]
            for turn in t.turns:
                span = range(turn.start, turn.end)
                if turn.role == "assistant":
                    assert all(t.loss_mask[i] == 1 for i in span)
                    assert all(t.versions[i] == 0 for i in span)
                else:
                    assert all(t.loss_mask[i] == 0 for i in span)
                    assert all(t.versions[i] == NO_VERSION and t.logprobs[i] == 0.0 for i in span)
            assert t.tokens[t.turns[2].start : t.turns[2].end] == TOOL_ANSWER
            assert t.turns[2].meta == {"tool": "echo"}
            assert t.generated == sum(
                len(r) for r in [range(x.start, x.end) for x in t.assistant_turns()]
            )
            assert t.reward == 1.0 and t.fields == {"answer": 7} and t.min_version == 0
        finally:
            await close(es)

    asyncio.run(main())


def test_turns_stick_to_one_engine_and_trajectories_spread() -> None:
    async def main() -> None:
        es = engines(2)
        router = RequestRouter(["0", "1"])
        try:
            clients = [client_for(es, router, f"traj-{i}") for i in range(4)]
            await asyncio.gather(*(ToolLoop().run({"prompt": (1, 2)}, c) for c in clients))
            for c in clients:
                assert len(set(c.engine_names)) == 1, c.engine_names  # sticky
            assert {c.engine_names[0] for c in clients} == {"0", "1"}  # spread
        finally:
            await close(es)

    asyncio.run(main())


def test_limits_end_a_trajectory_without_losing_it() -> None:
    async def main() -> None:
        es = engines(1)
        router = RequestRouter(["0"])
        try:
            c = client_for(es, router, "t", limits=TrajectoryLimits(max_turns=2, max_turn_tokens=3))
            c.add((1, 2, 3), role="prompt")
            await c.generate()
            await c.generate()
            assert all(r.params.max_tokens == 3 for r in es[0].requests)
            with pytest.raises(TrajectoryLimitReached, match="max_turns=2") as info:
                await c.generate()
            assert info.value.reason == "max_turns" and len(es[0].requests) == 2
            assert c.trajectory().generated <= 6  # what was generated is kept

            tight = client_for(es, router, "u", limits=TrajectoryLimits(max_total_tokens=5))
            tight.add((1, 2, 3), role="prompt")
            await tight.generate()  # at most 2 tokens: the room left
            assert es[0].requests[-1].params.max_tokens == 2
            with pytest.raises(TrajectoryLimitReached) as ended:
                for _ in range(3):  # every turn adds >= 1 token: the room runs out
                    await tight.generate()
            assert ended.value.reason == "max_total_tokens" and len(tight.tokens) == 5
        finally:
            await close(es)

    asyncio.run(main())


def test_a_turn_aborted_by_a_sync_resumes_with_its_versions() -> None:
    """Partial rollout inside a turn: the engine is paused (abort) after the turn's 2nd
    token, weights v1 are loaded, the turn resumes from its prefix on v1."""

    async def main() -> None:
        es = engines(1)
        ref = es[0].inner
        router = RequestRouter(["0"])
        try:
            c = GenerationClient(
                es,
                router,
                "t",
                sampling=SamplingParams(max_tokens=12, seed=2),  # type: ignore[arg-type]
            )
            c.add((1, 2, 3), role="prompt")
            task = asyncio.ensure_future(c.generate())
            while not es[0].requests:
                await asyncio.sleep(0)
            await ref.wait_for_tokens("t.t0", 2)  # holds its next step for us
            await ref.pause("abort")
            await ref.load_weights([], 1)
            await ref.resume()
            result = await task
            assert result.finish_reason in ("stop", "length")
            assert result.versions[:2] == (0, 0) and set(result.versions[2:]) <= {1}
            assert len(es[0].requests) == 2  # one resume
            assert es[0].requests[1].resume_tokens == result.tokens[:2]
            t = c.trajectory()
            assert t.min_version == 0 and t.generated == len(result.tokens)
        finally:
            await close(es)

    asyncio.run(main())


def test_bad_trajectories_and_inputs_are_named() -> None:
    good = Trajectory(
        (1, 2),
        (0, 1),
        (0.0, -0.5),
        (NO_VERSION, 0),
        (Turn("prompt", 0, 1), Turn("assistant", 1, 2)),
    )
    assert good.validate() is good
    with pytest.raises(BadRequestError, match="loss_mask has 1 entries for 2 tokens"):
        Trajectory((1, 2), (0,), (0.0, 0.0), (0, 0), ()).validate()
    with pytest.raises(BadRequestError, match="token 1 of tool turn 1 has loss_mask 1"):
        Trajectory(
            (1, 2), (0, 1), (0.0, 0.0), (0, 0), (Turn("prompt", 0, 1), Turn("tool", 1, 2))
        ).validate()
    with pytest.raises(BadRequestError, match="contiguous"):
        Trajectory((1, 2), (0, 0), (0.0, 0.0), (0, 0), (Turn("prompt", 1, 2),)).validate()
    with pytest.raises(BadRequestError, match="cover 1 of 2 tokens"):
        Trajectory((1, 2), (0, 0), (0.0, 0.0), (0, 0), (Turn("prompt", 0, 1),)).validate()
    with pytest.raises(ConfigError, match="max_turns must be an int >= 1"):
        TrajectoryLimits(max_turns=0)

    async def main() -> None:
        es = engines(1)
        try:
            c = client_for(es, RequestRouter(["0"]), "t")
            with pytest.raises(BadRequestError, match="nothing to generate from"):
                await c.generate()
            with pytest.raises(BadRequestError, match="assistant tokens come from generate"):
                c.add((1,), role="assistant")
            with pytest.raises(BadRequestError, match="token ids must be ints >= 0"):
                c.add((1, -2), role="prompt")
            assert c.tokens == ()  # nothing was added by the refused calls
        finally:
            await close(es)

    asyncio.run(main())
