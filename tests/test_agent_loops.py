"""The built-in agent loops (``ToolAgentLoop``, ``EnvironmentLoop``) on the minimal chat template
and the reference task's tokenizer, and agent jobs in ``RLJob``.

Loop logic is driven by ``ScriptedEngine``, a test engine whose "policy" is a function of the
decoded context (it writes the text a model would): what the loop does with a tool call, a bad
call, a failing tool, a cut turn or a limit does not depend on how the text was sampled. Jobs
run on the real reference engine and trainer."""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch
from asyncflow_conformance.agent import ScriptedPolicy
from asyncflow_reference.agentic import LookupTask, PhoneBook, chat_format
from asyncflow_reference.engines import TorchInferenceEngine, TorchTrainEngine
from asyncflow_reference.model import ModelConfig

from asyncflow_core.contracts.errors import BadRequestError, ConfigError
from asyncflow_core.contracts.protocols import SamplingParams
from asyncflow_core.data.scheduling import RequestRouter
from asyncflow_core.flow.agent import (
    EnvironmentLoop,
    GenerationClient,
    ToolAgentLoop,
    Trajectory,
    TrajectoryLimitReached,
    TrajectoryLimits,
)
from asyncflow_core.flow.chat import MinimalChatFormat
from asyncflow_core.flow.rlflow import RLConfig, RLEngines, RLJob
from asyncflow_core.flow.tools import ToolRunner, tool_schema
from asyncflow_core.observability.trace import Tracer
from asyncflow_core.training.rl import LOSS_MASK, policy_gradient_loss

CHAT = chat_format()
TOK = CHAT.tokenizer
STOP = CHAT.stop_token_ids[0]
TASK = LookupTask()


def ScriptedEngine(policy: Callable[[str], str]) -> ScriptedPolicy:
    """A test engine whose turn is ``policy(context text)``: the text's tokens plus the stop
    token (``ScriptedPolicy``: cut at ``max_tokens``, log-prob -0.5 each, at its version)."""
    return ScriptedPolicy(
        lambda request: [*TOK.encode(policy(TOK.decode(request.prompt_tokens))), STOP]
    )


def call(person: str, tool: str = "lookup") -> str:
    return (
        "<tool_call>" + json.dumps({"name": tool, "arguments": {"person": person}}) + "</tool_call>"
    )


def oracle(context: str) -> str:
    """The lookup task solved: call with the name asked for, then copy the tool's answer."""
    answers = re.findall(r"<tool_response>(.*?)</tool_response>", context)
    if answers:
        return answers[-1]
    person = re.findall(r"number of (\w+)\?", context)[-1]
    return call(person)


def client(engine: Any, tid: str = "t", max_tokens: int = 24, **kw: Any) -> GenerationClient:
    sampling = SamplingParams(max_tokens=max_tokens, stop_token_ids=CHAT.stop_token_ids)
    return GenerationClient([engine], RequestRouter(["0"]), tid, sampling=sampling, **kw)


def lookup_loop(runner: ToolRunner | None = None) -> ToolAgentLoop:
    return ToolAgentLoop(CHAT, runner or ToolRunner([]), tools=TASK.tools, reward=TASK.reward)


def sample() -> dict[str, Any]:
    return TASK.sample(random.Random(7))


def test_the_oracle_solves_lookup_in_two_turns_token_in_token_out() -> None:
    async def main() -> Trajectory:
        return await lookup_loop().run(sample(), client(ScriptedEngine(oracle)))

    t = asyncio.run(main())
    s = sample()
    assert t.reward == 1.0 and t.ended == "answer"
    assert t.stats()["turns"] == 2 and t.stats()["tool_calls"] == 1
    assert t.stats()["tool_errors"] == 0
    roles = [turn.role for turn in t.turns]
    assert roles == ["prompt", "assistant", "tool", "assistant"]
    prompt = CHAT.prompt(s["messages"], [tool_schema(PhoneBook(s["book"]))])
    turn1 = [*TOK.encode(call(s["person"])), STOP]
    follow = CHAT.followup([{"role": "tool", "content": s["book"][s["person"]]}])
    turn2 = [*TOK.encode(s["book"][s["person"]]), STOP]
    assert list(t.tokens) == prompt + turn1 + follow + turn2  # nothing re-tokenised
    assert list(t.loss_mask) == [0] * len(prompt) + [1] * len(turn1) + [0] * len(follow) + [1] * 4
    assert t.prompt_length == len(prompt)


def test_bad_calls_and_failing_tools_become_tool_messages() -> None:
    """Malformed JSON, an unknown tool, bad arguments, a raising tool and a hanging tool: each
    is told to the model, counted, and the loop goes on to the answer."""
    gate = asyncio.Event()  # never set: the hanging tool waits on it until the timeout

    class Hangs:
        name = "slow"
        description = "never answers"
        parameters: Mapping[str, Any] = {"type": "object", "properties": {}}

        async def call(self, arguments: Mapping[str, Any]) -> str:
            await gate.wait()
            return "never"

    turns = iter(
        [
            "<tool_call>{not json</tool_call>",
            call("Ann", tool="nope"),
            '<tool_call>{"name": "lookup", "arguments": {"who": "Ann"}}</tool_call>',
            call("Zed"),  # the tool raises KeyError: no such person
            '<tool_call>{"name": "slow", "arguments": {}}</tool_call>',
            call("Ann"),
            "123",
        ]
    )
    # a timeout the instant tools never come near, even on a loaded machine
    runner = ToolRunner([], timeout_s=2.0)
    loop = ToolAgentLoop(
        CHAT, runner, tools=lambda s: [*TASK.tools(s), Hangs()], reward=TASK.reward
    )

    async def main() -> Trajectory:
        limits = TrajectoryLimits(max_turns=8, max_total_tokens=1000)
        engine = ScriptedEngine(lambda _: next(turns))
        return await loop.run(sample(), client(engine, max_tokens=64, limits=limits))

    t = asyncio.run(main())
    assert t.ended == "answer" and t.stats()["turns"] == 7
    assert t.stats()["tool_calls"] == 6 and t.stats()["tool_errors"] == 5
    errors = [turn.meta["errors"] for turn in t.turns if turn.role == "tool"]
    assert errors == [
        ["malformed"],
        ["unknown_tool"],
        ["bad_arguments"],
        ["raised"],
        ["timeout"],
        [],
    ]
    text = TOK.decode(t.tokens)
    assert "no tool named 'nope'" in text and "no person named 'Zed'" in text
    assert f"<tool_response>{sample()['book']['Ann']}</tool_response>" in text  # the good call
    assert runner.metrics["error_timeout"] == 1 and runner.metrics["error_raised"] == 1
    for turn in t.turns:  # tool output is never trained on
        want = 1 if turn.role == "assistant" else 0
        assert set(t.loss_mask[turn.start : turn.end]) <= {want}


def test_a_cut_turn_and_an_overflow_end_the_trajectory() -> None:
    async def cut() -> Trajectory:
        c = client(ScriptedEngine(lambda _: "9" * 40), limits=TrajectoryLimits(max_turn_tokens=5))
        return await lookup_loop().run(sample(), c)

    t = asyncio.run(cut())
    assert t.ended == "length" and t.stats()["turns"] == 1 and t.reward == 0.0

    s = sample()
    prompt = CHAT.prompt(s["messages"], [tool_schema(PhoneBook(s["book"]))])
    room = len(prompt) + len(TOK.encode(call(s["person"]))) + 1 + 2  # the call, not the answer

    async def overflow() -> tuple[Trajectory, GenerationClient]:
        c = client(ScriptedEngine(oracle), limits=TrajectoryLimits(max_total_tokens=room))
        return await lookup_loop().run(s, c), c

    t, c = asyncio.run(overflow())
    assert t.ended == "max_total_tokens" and [x.role for x in t.turns] == ["prompt", "assistant"]
    assert len(t.tokens) <= room and c.ended == "max_total_tokens"

    async def refused_add() -> None:
        c = client(ScriptedEngine(oracle), limits=TrajectoryLimits(max_total_tokens=4))
        c.add([1, 2, 3], role="prompt")
        with pytest.raises(TrajectoryLimitReached, match="max_total_tokens=4"):
            c.add([4, 5], role="tool")
        assert c.tokens == (1, 2, 3)  # the refused add left the context as it was

    asyncio.run(refused_add())


def test_a_stale_trajectory_does_not_start_another_turn() -> None:
    async def main() -> Trajectory:
        engine = ScriptedEngine(oracle)
        c = client(engine, too_stale=lambda v: engine.weight_version - v > 1)
        loop = lookup_loop()

        class Aging(PhoneBook):  # the trainer moves on while the tool runs
            async def call(self, arguments: Mapping[str, Any]) -> str:
                engine.weight_version = 2
                return await super().call(arguments)

        loop.tools = lambda s: [Aging(s["book"])]
        return await loop.run(sample(), c)

    t = asyncio.run(main())
    assert t.ended == "stale" and t.stats()["turns"] == 1


def test_turn_and_tool_spans_are_traced() -> None:
    tracer = Tracer()

    async def main() -> Trajectory:
        return await lookup_loop().run(sample(), client(ScriptedEngine(oracle), tracer=tracer))

    asyncio.run(main())
    spans = tracer.spans
    assert [(s.name, s.resource) for s in spans if s.name == "turn"] == [("turn", "rollout")] * 2
    assert [(s.name, s.resource) for s in spans if s.name == "tools"] == [("tools", "tools")]
    turn = next(s for s in spans if s.name == "turn")
    assert turn.args["trajectory"] == "t" and turn.tokens > 0


class Guess:
    """An environment: guess a number in 0..9, told "higher"/"lower"; reward 1 when found."""

    def __init__(self, sample: Mapping[str, Any]) -> None:
        self.secret = int(sample["secret"])

    async def reset(self, sample: Mapping[str, Any]) -> str:
        return "guess 0-9"

    async def step(self, action: str) -> tuple[str, float | None, bool]:
        guess = int(action) if action.strip().isdigit() else -1
        if guess == self.secret:
            return "yes", 1.0, True
        return ("higher" if guess < self.secret else "lower"), 0.0, False


def test_an_environment_loop_feeds_observations_back() -> None:
    def bisect(context: str) -> str:
        low, high = 0, 9
        guesses = re.findall(r"assistant\n(\d)<\|im_end\|>", context)
        replies = re.findall(r"user\n(higher|lower)<\|im_end\|>", context)
        for g, r in zip(guesses, replies, strict=False):
            low, high = (int(g) + 1, high) if r == "higher" else (low, int(g) - 1)
        return str((low + high) // 2)

    async def main() -> Trajectory:
        loop = EnvironmentLoop(CHAT, Guess)
        return await loop.run({"secret": 7}, client(ScriptedEngine(bisect)))

    t = asyncio.run(main())
    assert t.ended == "done" and t.reward == 1.0
    assert [x.role for x in t.turns][:4] == ["prompt", "assistant", "environment", "assistant"]
    assert "higher" in TOK.decode(t.tokens)


def test_loop_inputs_are_checked() -> None:
    with pytest.raises(ConfigError, match="max_tool_output_chars"):
        ToolAgentLoop(CHAT, ToolRunner([]), max_tool_output_chars=3)
    with pytest.raises(BadRequestError, match="'messages'"):
        asyncio.run(lookup_loop().run({"book": {}}, client(ScriptedEngine(oracle))))
    with pytest.raises(ConfigError, match="one token"):

        class NoStop:
            def encode(self, text: str) -> list[int]:
                return [1, 2]

            def decode(self, ids: Sequence[int]) -> str:
                return ""

        MinimalChatFormat(NoStop())


# --------------------------------------------------------------------------------------------
# Agent jobs
# --------------------------------------------------------------------------------------------
MODEL = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=1, n_heads=2, max_seq_len=128)


class EchoLoop:
    """Two generated turns around a fixed tool message, on the real engine; the reward is the
    number of generated tokens of turn 1 (anything deterministic in the tokens)."""

    def __init__(self, before_tool: Callable[[Mapping[str, Any]], Any] | None = None) -> None:
        self.before_tool = before_tool

    async def run(self, sample: Mapping[str, Any], client: GenerationClient) -> Trajectory:
        client.add(CHAT.prompt([{"role": "user", "content": sample["q"]}]), role="prompt")
        try:
            first = await client.generate()
            if self.before_tool is not None:
                await self.before_tool(sample)
            client.add(CHAT.followup([{"role": "tool", "content": "42"}]), role="tool")
            await client.generate()
        except TrajectoryLimitReached as exc:
            return client.trajectory(reward=0.0, ended=exc.reason)
        return client.trajectory(reward=float(len(first.tokens)), ended="answer")


def _job(loop: Any, steps: int, **cfg: Any) -> tuple[RLJob, TorchTrainEngine, TorchInferenceEngine]:
    engine = TorchInferenceEngine(MODEL, max_batch=16, seed=0, threads=1)
    trainer = TorchTrainEngine(MODEL, seed=0, threads=1)
    config = RLConfig(
        steps=steps, prompts_per_step=cfg.pop("prompts_per_step", 2), n=cfg.pop("n", 2),
        sampling=SamplingParams(max_tokens=6, stop_token_ids=CHAT.stop_token_ids, seed=3),
        trajectory_limits=TrajectoryLimits(max_turns=4, max_total_tokens=128), **cfg,
    )  # fmt: skip
    samples = ({"q": f"question {i}", "id": i} for i in range(10_000))
    job = RLJob(config, RLEngines([engine], trainer), samples, agent=loop,
                loss_fn=policy_gradient_loss, tracer=Tracer())  # fmt: skip
    return job, trainer, engine


def test_an_agent_job_trains_generated_tokens_only_and_logprobs_agree() -> None:
    """Rows of an agent job: prompt + response tile the trajectory, the mask is exactly the
    generated tokens, and the trainer's log-probs of those tokens equal the engine's (checked
    with the trainer before any update, on the same weights)."""
    batches: list[Any] = []

    async def main() -> None:
        job, trainer, engine = _job(EchoLoop(), steps=2)
        original = trainer.train_step

        async def spy(batch: Any, loss_fn: Any) -> Any:
            if not batches:
                batches.append((batch, await trainer.compute_logprobs(batch)))
            return await original(batch, loss_fn)

        trainer.train_step = spy  # type: ignore[method-assign]
        try:
            result = await job.run()
            assert len(result.steps) == 2
            extra = result.steps[-1].metrics.extra
            assert extra["agent_turns"] == 2.0 and extra["agent_restarts"] == 0.0
            spans = job.tracer.spans  # type: ignore[union-attr]
            assert {s.resource for s in spans if s.name == "turn"} == {"rollout"}
        finally:
            await engine.close()
            await trainer.close()

    asyncio.run(main())
    batch, recomputed = batches[0]
    lengths = batch.lengths["response"]
    for i in range(len(batch)):
        n = int(lengths[i])
        mask = batch[LOSS_MASK][i, :n].bool()
        behaviour = batch["logprobs"][i, :n]
        assert 0 < int(mask.sum()) < n  # some tokens generated, some not (the tool's)
        assert torch.all(behaviour[~mask] == 0.0)
        torch.testing.assert_close(recomputed[i, :n][mask], behaviour[mask], atol=1e-4, rtol=0)
        assert batch["agent"][i]["turns"] == 2


def test_a_trajectory_that_went_stale_is_regenerated_once() -> None:
    """One sample's tool waits until the trainer has moved two versions past the
    trajectory's first turn (η = 1): its next turn is refused as stale, and the sample is
    generated again from its prompt, which then trains."""
    held: dict[str, Any] = {}

    async def main() -> None:
        async def wait_for_trainer(sample: Mapping[str, Any]) -> None:
            if sample["id"] == 1 and "done" not in held:
                held["done"] = True
                while trainer.weight_version < 2:
                    await held["stepped"].wait()
                    held["stepped"].clear()

        job, trainer, engine = _job(
            EchoLoop(wait_for_trainer), steps=4, prompts_per_step=1, n=1, staleness=1
        )
        held["stepped"] = asyncio.Event()
        job.on_step = lambda record: held["stepped"].set()
        try:
            result = await job.run()
            assert job.restarts == 1
            assert sum(s.metrics.extra["agent_restarts"] for s in result.steps) == 1.0
            assert result.max_staleness <= 1 and result.dropped == 0
        finally:
            await engine.close()
            await trainer.close()

    asyncio.run(main())


def test_agent_job_inputs_are_checked() -> None:
    class NoReward:
        async def run(self, sample: Mapping[str, Any], client: GenerationClient) -> Trajectory:
            client.add([1, 2], role="prompt")
            await client.generate()
            return client.trajectory()

    async def main(loop: Any, samples: Any) -> None:
        job, trainer, engine = _job(loop, steps=1)
        job.prompts = samples
        try:
            await job.run()
        finally:
            await engine.close()
            await trainer.close()

    from asyncflow_core.contracts.errors import TaskFailedError

    with pytest.raises(TaskFailedError, match="without a reward"):
        asyncio.run(main(NoReward(), iter([{"q": "x"}] * 8)))
    with pytest.raises(TaskFailedError, match="samples as dicts"):
        asyncio.run(main(EchoLoop(), iter([[1, 2, 3]] * 8)))
    with pytest.raises(ConfigError, match="needs a reward_fn"):
        RLJob(RLConfig(steps=1, prompts_per_step=1), RLEngines([ScriptedEngine(oracle)], None), [])  # type: ignore[arg-type, list-item]
