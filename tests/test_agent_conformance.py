"""The agent-loop suite (``asyncflow_conformance.agent``) on the two loops AsyncFlow ships, and on
mutants of them that each must fail the law meant to catch their bug.

Backends:

* ``TestToolAgentLoop``: ``ToolAgentLoop`` over the reference task's chat format and its
  per-sample ``lookup`` tool (``asyncflow_reference.agentic``);
* ``TestEndpointLoop``: ``EndpointLoop`` around an agent program written against the real
  ``openai.AsyncOpenAI`` client, talking to a ``ChatEndpoint`` over loopback HTTP.

``TestMinimalChatFormat`` holds the loops' chat format (``MinimalChatFormat``) to
``ChatFormatConformance``.

Both run laws 1 ``[model]``, 2 and 4 on the REAL reference engine and trainer: a tiny random
model (``turn_ending_model``: random weights, plus a bias towards the stop token so that turns
end by themselves and the endpoint's agent holds multi-turn conversations). A random model
does not write tool calls, so the laws about tool turns (1 ``[tools]``, 3, 5, the job law and
the staleness law) run on ``scripted_engine``, a scripted policy: it calls ``lookup`` for the
person asked about (spelling the name letter by letter, as BPE models often do, so that a
re-tokenisation shows), writes a call that does not parse, calls a tool the loop lacks or passes
arguments its schema refuses when told to, and answers with the tool's digits. The tools
fail on purpose: ``FailingBook`` raises, or hangs until the loop's tool timeout
(``TOOL_TIMEOUT_S``, the mechanism under test, not a sleep). Nothing else waits on the clock.

The mutants (``MUTANTS``) are deliberately broken loops and one broken loss; each fails its
law with a message naming the bug (``test_the_suite_fails_the_mutant_on_its_law``).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from asyncflow_conformance import AgentLoopConformance, ChatFormatConformance
from asyncflow_conformance.agent import ScriptedPolicy, ToolFailure
from asyncflow_reference.agentic import PhoneBook, PieceTokenizer, chat_format
from asyncflow_reference.engines import TorchInferenceEngine, TorchTrainEngine
from asyncflow_reference.model import ModelConfig, TransformerLM

from asyncflow_core.contracts.protocols import Batch
from asyncflow_core.flow.agent import (
    NO_VERSION,
    AgentLoop,
    GenerationClient,
    ToolAgentLoop,
    Trajectory,
    TrajectoryLimits,
    Turn,
)
from asyncflow_core.flow.tools import ToolResult, ToolRunner
from asyncflow_core.training.rl import LOSS_MASK, policy_gradient_loss

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

from asyncflow_serve import ChatEndpoint, EndpointLoop, Session  # noqa: E402

CHAT = chat_format()
TOK = PieceTokenizer()  # the same pieces as CHAT's tokenizer
STOP = CHAT.stop_token_ids[0]
MODEL = ModelConfig(
    vocab_size=TOK.vocab_size, d_model=32, n_layers=1, n_heads=2, max_seq_len=192, init_std=0.3
)
STOP_BIAS = 1.5
"""Added to the stop token's logit: about 7 in 10 turns of the random model end by themselves
within 16 tokens."""
TOOL_TIMEOUT_S = 0.5
"""The loops' tool timeout: a hanging tool is cut off after it (the failure law's
``times_out``)."""
LOOKUP_SCHEMA = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": PhoneBook.description,
        "parameters": dict(PhoneBook.parameters),
    },
}


def turn_ending_model() -> TransformerLM:
    """The reference model (random weights, seed 0) with a constant bias towards the stop
    token: the final LayerNorm's channel 0 is a constant 1, which only the stop token's row of
    the LM head reads."""
    model = TransformerLM(MODEL, seed=0)
    with torch.no_grad():
        model.ln_f.weight[0] = 0.0
        model.ln_f.bias[0] = 1.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[STOP, 0] = STOP_BIAS
    return model


def lookup_sample(index: int) -> dict[str, Any]:
    """The lookup task's sample ``index`` (its own phone book), the question numbered so that
    every sample's prompt differs."""
    rng = random.Random(index)
    book = {name: f"{rng.randrange(1000):03d}" for name in ("Ann", "Ben", "Cal", "Eve")}
    person = rng.choice(sorted(book))
    return {
        "messages": [{"role": "user", "content": f"number of {person}? #{index}"}],
        "person": person,
        "book": book,
    }


def reward(sample: Mapping[str, Any], final: Any, trajectory: Trajectory) -> float:
    answer = "" if final is None else final.content
    return float(answer == sample["book"][sample["person"]])


# --------------------------------------------------------------------------------------------
# The scripted tool policy and the failing tool
# --------------------------------------------------------------------------------------------
CALL_HEAD = TOK.encode('<tool_call>{"name": "lookup", "arguments": {"person": "')
CALL_TAIL = TOK.encode('"}}</tool_call>')
MALFORMED = TOK.encode("<tool_call>{not json</tool_call>")
UNKNOWN_TOOL = TOK.encode('<tool_call>{"name": "dial", "arguments": {"person": "Ann"}}</tool_call>')
BAD_ARGUMENTS = TOK.encode('<tool_call>{"name": "lookup", "arguments": {"who": 7}}</tool_call>')


def scripted_turn(context: str, failure: ToolFailure | None) -> list[int]:
    """The scripted policy's next turn after ``context`` (decoded): first a ``lookup`` call
    for the person asked about, the name spelt letter by letter (or a block that does not
    parse, for ``malformed``; a call of ``dial``, which the loop does not have, for
    ``unknown_tool``; ``lookup`` with an argument its schema refuses, for ``bad_arguments``);
    after that, the digits of the last tool answer, else 000."""
    if context.count("<|im_start|>assistant\n") <= 1:
        if failure == "malformed":
            return [*MALFORMED, STOP]
        if failure == "unknown_tool":
            return [*UNKNOWN_TOOL, STOP]
        if failure == "bad_arguments":
            return [*BAD_ARGUMENTS, STOP]
        person = re.findall(r"number of (\w+)\?", context)[-1]
        return [*CALL_HEAD, *(TOK.token_to_id(c) for c in person), *CALL_TAIL, STOP]
    answers = re.findall(r"<tool_response>(.*?)</tool_response>", context)
    answer = answers[-1] if answers and answers[-1].isdigit() else "000"
    return [*TOK.encode(answer), STOP]


def scripted_engine(failure: ToolFailure | None) -> ScriptedPolicy:
    """The tool policy: ``scripted_turn`` of the decoded context. It stands for a policy that
    calls tools; it is not a model."""
    return ScriptedPolicy(lambda request: scripted_turn(TOK.decode(request.prompt_tokens), failure))


class FailingBook(PhoneBook):
    """The ``lookup`` tool over one sample's book, failing as told: ``raises`` raises,
    ``times_out`` never answers (the loop's timeout cuts it off); otherwise it answers."""

    def __init__(self, book: Mapping[str, str], failure: ToolFailure | None) -> None:
        super().__init__(book)
        self.failure = failure

    async def call(self, arguments: Mapping[str, Any]) -> str:
        if self.failure == "raises":
            raise RuntimeError("the phone book is down")
        if self.failure == "times_out":
            await asyncio.Event().wait()  # never set
        return await super().call(arguments)


# --------------------------------------------------------------------------------------------
# Backend 1: ToolAgentLoop
# --------------------------------------------------------------------------------------------
class ToolLoopBackend(AgentLoopConformance):
    """``ToolAgentLoop`` with the sample's failing ``lookup`` tool; the reference engine and
    trainer; the scripted tool policy."""

    stop_token_ids = CHAT.stop_token_ids
    max_tokens = 16
    limits = TrajectoryLimits(max_turns=4, max_total_tokens=176)
    timeout_s = 30.0
    real_timeout_s = 90.0

    def runner(self) -> ToolRunner:
        return ToolRunner([], timeout_s=TOOL_TIMEOUT_S)

    def make_loop(self, tool_failure: ToolFailure | None) -> Any:
        return ToolAgentLoop(
            CHAT, self.runner(), tools=lambda s: [FailingBook(s["book"], tool_failure)],
            reward=reward,
        )  # fmt: skip

    def make_inference(self) -> TorchInferenceEngine:
        return TorchInferenceEngine(turn_ending_model(), max_batch=16, seed=0, threads=1)

    def make_trainer(self) -> TorchTrainEngine:
        return TorchTrainEngine(turn_ending_model(), seed=0, lr=1e-2, threads=1)

    def make_tool_policy(self, tool_failure: ToolFailure | None) -> ScriptedPolicy:
        return scripted_engine(tool_failure)

    def sample(self, index: int) -> Mapping[str, Any]:
        return lookup_sample(index)


class TestToolAgentLoop(ToolLoopBackend):
    pass


class TestMinimalChatFormat(ChatFormatConformance):
    """``MinimalChatFormat`` over the reference tokenizer (the chat format of both loops)."""

    def make_chat(self) -> Any:
        return chat_format()


# --------------------------------------------------------------------------------------------
# Backend 2: EndpointLoop around an openai-client agent program
# --------------------------------------------------------------------------------------------
async def lookup(sample: Mapping[str, Any], arguments: str, failure: ToolFailure | None) -> str:
    """The agent program's own ``lookup`` tool, failing as told (and on arguments other than
    ``{"person": str}``)."""
    person = json.loads(arguments).get("person")
    if not isinstance(person, str):
        raise ValueError(f"lookup takes {{'person': str}}, got {arguments}")
    if failure == "raises":
        raise RuntimeError("the phone book is down")
    if failure == "times_out":
        try:
            await asyncio.wait_for(asyncio.Event().wait(), TOOL_TIMEOUT_S)
        except TimeoutError:
            raise RuntimeError(f"lookup took longer than {TOOL_TIMEOUT_S} s") from None
    return str(sample["book"].get(person, "unknown"))


def openai_agent(failure: ToolFailure | None, *, catch: bool = True) -> Callable[..., Any]:
    """Plain agent code for the ``openai`` client: call the model; run its tool calls and send
    back their answers (a failure as ``error: ...``, unless ``catch`` is False); tell it when
    a call did not parse; ask once more after its first answer; stop after a cut turn."""

    async def agent(sample: Mapping[str, Any], session: Session) -> None:
        async with openai.AsyncOpenAI(
            base_url=session.base_url, api_key=session.api_key, max_retries=0
        ) as client:
            messages: list[Any] = list(sample["messages"])
            followed = False
            for _ in range(4):
                resp = await client.chat.completions.create(
                    model="policy", messages=messages, tools=[LOOKUP_SCHEMA]
                )
                choice = resp.choices[0]
                message = choice.message
                messages.append(message.model_dump(exclude_none=True))
                if message.tool_calls:
                    for call in message.tool_calls:
                        try:
                            if call.function.name != "lookup":
                                raise LookupError(f"no tool named {call.function.name!r}")
                            content = await lookup(sample, call.function.arguments, failure)
                        except Exception as exc:
                            if not catch:
                                raise
                            content = f"error: {exc}"
                        messages.append(
                            {"role": "tool", "tool_call_id": call.id, "content": content}
                        )
                    continue
                if choice.finish_reason != "stop":
                    return  # cut by its token cap: nothing can follow it
                if "<tool_call>" in (message.content or ""):
                    messages.append({"role": "user", "content": "error: that call did not parse"})
                    continue
                if followed:
                    return
                followed = True
                messages.append({"role": "user", "content": "and again?"})

    return agent


class ServedLoop(EndpointLoop):
    """An ``EndpointLoop`` that owns its endpoint (``close`` stops it)."""

    async def close(self) -> None:
        await self.endpoint.close()


class EndpointBackend(ToolLoopBackend):
    """``EndpointLoop`` around ``openai_agent`` over a ``ChatEndpoint`` on loopback."""

    catch_tool_errors = True
    # The agent program, not EndpointLoop, runs the tools: an unknown tool or bad arguments
    # reach the endpoint only as a call it passes on (law 5 checks that); the job law under
    # them would test this file's agent code, so it runs on ToolAgentLoop's runner only.
    job_failures = ("raises", "times_out", "malformed")
    # With eta = 0 the job cannot step while its straggler waits, so that case makes none and
    # checks nothing ToolAgentLoop's does not; eta = 1 gives this loop's three-turn straggler.
    job_staleness = (1,)

    async def make_loop(self, tool_failure: ToolFailure | None) -> Any:
        endpoint = ChatEndpoint(CHAT)
        await endpoint.start()
        agent = openai_agent(tool_failure, catch=self.catch_tool_errors)
        return ServedLoop(endpoint, agent, reward=reward)

    def tool_errors(self, trajectory: Trajectory) -> int:
        """Malformed calls (the endpoint's count) plus the agent's ``error: ...`` messages."""
        told = sum(
            1
            for turn in trajectory.turns
            if turn.role in ("tool", "user")
            and turn.start >= trajectory.prompt_length
            and "error:" in TOK.decode(trajectory.tokens[turn.start : turn.end])
        )
        return int(trajectory.stats()["tool_errors"]) + told


class TestEndpointLoop(EndpointBackend):
    pass


# --------------------------------------------------------------------------------------------
# Mutants: broken loops (wrappers around the backends' loops) and a broken loss
# --------------------------------------------------------------------------------------------
class Wrapper:
    """An ``AgentLoop`` around another (``close`` reaches the inner loop's)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def run(self, sample: Mapping[str, Any], client: GenerationClient) -> Trajectory:
        trajectory: Trajectory = await self.inner.run(sample, client)
        return trajectory

    async def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            await close()


class TrainsToolTokens(Wrapper):
    """Marks the tool's (and user's) tokens as generated: turns after the prompt that the
    policy did not write become assistant turns, loss_mask 1 (so ``validate`` passes)."""

    async def run(self, sample: Mapping[str, Any], client: GenerationClient) -> Trajectory:
        t = await super().run(sample, client)
        mask, turns = list(t.loss_mask), []
        for turn in t.turns:
            if turn.role != "assistant" and turn.start >= t.prompt_length:
                mask[turn.start : turn.end] = [1] * (turn.end - turn.start)
                turn = replace(turn, role="assistant")
            turns.append(turn)
        return replace(t, loss_mask=tuple(mask), turns=tuple(turns)).validate()


def rebuilt(t: Trajectory, text: Callable[[Turn, str], str | None]) -> Trajectory:
    """``t`` with each turn for which ``text(turn, its decoded text)`` gives a string encoded
    again from that string; a generated token keeps the log-prob and version found at its
    position (what a recorder that keeps text has to do)."""
    tokens: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    versions: list[int] = []
    turns = []
    for turn in t.turns:
        ids = list(t.tokens[turn.start : turn.end])
        again = text(turn, TOK.decode(ids))
        if again is not None:
            ids = TOK.encode(again)
        start = len(tokens)
        tokens += ids
        if turn.role == "assistant":
            lp = t.logprobs[turn.start : turn.end] or (0.0,)
            v = t.versions[turn.start : turn.end] or (0,)
            mask += [1] * len(ids)
            lps += [lp[min(k, len(lp) - 1)] for k in range(len(ids))]
            versions += [v[min(k, len(v) - 1)] for k in range(len(ids))]
        else:
            mask += [0] * len(ids)
            lps += [0.0] * len(ids)
            versions += [NO_VERSION] * len(ids)
        turns.append(replace(turn, start=start, end=len(tokens)))
    return replace(
        t, tokens=tuple(tokens), loss_mask=tuple(mask), logprobs=tuple(lps),
        versions=tuple(versions), turns=tuple(turns),
    ).validate()  # fmt: skip


class Retokenizes(Wrapper):
    """Records the conversation as text and tokenises it again for training, turn by turn."""

    async def run(self, sample: Mapping[str, Any], client: GenerationClient) -> Trajectory:
        return rebuilt(await super().run(sample, client), lambda turn, text: text)


class NormalisesHistory(Wrapper):
    """Records the messages between the generated turns as normalised text (surrounding
    whitespace stripped) and tokenises that: the history the trainer gets is not the one the
    engine saw, though every generated turn is intact."""

    async def run(self, sample: Mapping[str, Any], client: GenerationClient) -> Trajectory:
        t = await super().run(sample, client)

        def normalise(turn: Turn, text: str) -> str | None:
            between = turn.role != "assistant" and turn.start >= t.prompt_length
            return text.strip() if between else None

        return rebuilt(t, normalise)


class ChangesSampling(Wrapper):
    """Lowers the client's temperature ("more focused agents"): the engine samples at 0.5,
    while the job's rows say the job's temperature."""

    async def run(self, sample: Mapping[str, Any], client: GenerationClient) -> Trajectory:
        client.sampling = replace(client.sampling, temperature=0.5)
        return await super().run(sample, client)


class RestartsInterruptedTurns(Wrapper):
    """Starts a turn aborted by a weight sync over (no partial rollout)."""

    async def run(self, sample: Mapping[str, Any], client: GenerationClient) -> Trajectory:
        client.partial_rollout = False
        return await super().run(sample, client)


class ReusesTrajectories(Wrapper):
    """Returns the first trajectory it made for every later sample (a cache keyed wrongly)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.first: Trajectory | None = None

    async def run(self, sample: Mapping[str, Any], client: GenerationClient) -> Trajectory:
        t = await super().run(sample, client)
        if self.first is None:
            self.first = t
        return self.first


class RaisesOnAgentError(Wrapper):
    """Re-raises the agent program's error instead of keeping what was recorded: the sample's
    trajectory is lost when a tool's exception escaped the agent."""

    async def run(self, sample: Mapping[str, Any], client: GenerationClient) -> Trajectory:
        t = await super().run(sample, client)
        error = t.turns[-1].meta.get("endpoint", {}).get("agent_error")
        if error:
            raise RuntimeError(f"the agent failed: {error}")
        return t


class UnguardedRunner(ToolRunner):
    """Runs the tools without catching their failures: a raising (or hanging) tool's
    exception escapes the loop, and the sample's trajectory with it."""

    async def run(self, calls: Sequence[Any], tools: Sequence[Any] | None = None) -> list[Any]:
        by_name = {t.name: t for t in (self.tools if tools is None else tools)}
        out = []
        for call in calls:
            answer = by_name[call.name].call(call.arguments)
            if inspect.isawaitable(answer):
                answer = await asyncio.wait_for(answer, self.timeout_s)
            out.append(ToolResult(call, str(answer)))
        return out


def loss_ignoring_the_mask(logprobs: torch.Tensor, batch: Batch) -> Any:
    """``policy_gradient_loss`` on every response token (the loss_mask dropped)."""
    data = {k: v for k, v in batch.data.items() if k != LOSS_MASK}
    lengths = {k: v for k, v in batch.lengths.items() if k != LOSS_MASK}
    return policy_gradient_loss(logprobs, Batch(batch.rows, data, lengths, batch.tags))


def wrapped(
    backend: type[AgentLoopConformance], wrap: Callable[[Any], Any]
) -> AgentLoopConformance:
    """``backend`` with its loop wrapped by ``wrap``."""
    base = backend.make_loop

    class Mutant(backend):  # type: ignore[misc, valid-type]
        async def make_loop(self, tool_failure: ToolFailure | None) -> Any:
            made = base(self, tool_failure)
            loop = await made if asyncio.iscoroutine(made) else made
            return wrap(loop)

    return Mutant()


class UnguardedToolLoop(ToolLoopBackend):
    def runner(self) -> ToolRunner:
        return UnguardedRunner([], timeout_s=TOOL_TIMEOUT_S)


class CrashingAgent(EndpointBackend):
    catch_tool_errors = False


class MaskBlindLoss(ToolLoopBackend):
    def make_loss(self) -> Any:
        return loss_ignoring_the_mask


class TrainerDropsTheMask(ToolLoopBackend):
    """The reference trainer, but it rebuilds each batch from the fields it knows: the loss
    never sees ``loss_mask``."""

    def make_trainer(self) -> TorchTrainEngine:
        class Dropping(TorchTrainEngine):
            async def train_step(self, batch: Batch, loss_fn: Any) -> Any:
                data = {k: v for k, v in batch.data.items() if k != LOSS_MASK}
                lengths = {k: v for k, v in batch.lengths.items() if k != LOSS_MASK}
                return await super().train_step(Batch(batch.rows, data, lengths), loss_fn)

        return Dropping(turn_ending_model(), seed=0, lr=1e-2, threads=1)


@dataclass(frozen=True)
class Mutant:
    id: str
    make_suite: Callable[[], AgentLoopConformance]
    law: str
    message: str
    arg: Any = None


MASK = "test_the_mask_covers_exactly_the_generated_tokens"
LOGPROBS = "test_trainer_logprobs_of_generated_tokens_equal_the_engines"
LOSS = "test_tool_output_is_never_trained_on"
RESUME = "test_an_interrupted_trajectory_resumes_with_versions_intact"
FAILURE = "test_a_failing_tool_cannot_lose_or_duplicate_a_trajectory"
JOB = "test_a_job_trains_each_trajectory_exactly_once"

MUTANTS: tuple[Mutant, ...] = (
    # ToolAgentLoop
    Mutant("tool/trains-tool-tokens", lambda: wrapped(ToolLoopBackend, TrainsToolTokens), MASK,
           "names request None, which the engine never answered", "tools"),
    Mutant("tool/trains-tool-tokens-loss", lambda: wrapped(ToolLoopBackend, TrainsToolTokens),
           LOSS, r"labels 'assistant'; the engine did not generate it\) has loss_mask 1"),
    Mutant("tool/retokenizes", lambda: wrapped(ToolLoopBackend, Retokenizes), MASK,
           "never their text tokenised again", "tools"),
    Mutant("tool/normalises-history", lambda: wrapped(ToolLoopBackend, NormalisesHistory), MASK,
           "re-tokenised or edited history", "tools"),
    Mutant("tool/changes-sampling", lambda: wrapped(ToolLoopBackend, ChangesSampling), LOGPROBS,
           "the loop changed the client's sampling"),
    Mutant("tool/loss-ignores-mask", MaskBlindLoss, LOSS,
           "gradient with respect to the log-prob of response token"),
    Mutant("tool/trainer-drops-the-mask", TrainerDropsTheMask, LOSS,
           "Tool output reaches the loss through train_step"),
    Mutant("tool/restarts-interrupted-turns",
           lambda: wrapped(ToolLoopBackend, RestartsInterruptedTurns), RESUME,
           "regenerated instead of resumed"),
    Mutant("tool/loses-trajectory-on-raise", UnguardedToolLoop, FAILURE,
           "trajectories were lost when the loop's tools failed", "raises"),
    Mutant("tool/loses-trajectory-on-timeout", UnguardedToolLoop, FAILURE,
           "TimeoutError", "times_out"),
    Mutant("tool/reuses-trajectories", lambda: wrapped(ToolLoopBackend, ReusesTrajectories),
           FAILURE, "generated for another trajectory", "raises"),
    Mutant("tool/reuses-trajectories-job", lambda: wrapped(ToolLoopBackend, ReusesTrajectories),
           JOB, "generated for another trajectory", "raises"),
    # EndpointLoop
    Mutant("endpoint/trains-tool-tokens", lambda: wrapped(EndpointBackend, TrainsToolTokens),
           MASK, "names request None, which the engine never answered", "tools"),
    Mutant("endpoint/retokenizes", lambda: wrapped(EndpointBackend, Retokenizes), MASK,
           "never their text tokenised again", "tools"),
    Mutant("endpoint/normalises-history", lambda: wrapped(EndpointBackend, NormalisesHistory),
           MASK, "re-tokenised or edited history", "tools"),
    Mutant("endpoint/trains-tool-tokens-loss", lambda: wrapped(EndpointBackend, TrainsToolTokens),
           LOSS, r"labels 'assistant'; the engine did not generate it\) has loss_mask 1"),
    Mutant("endpoint/changes-sampling", lambda: wrapped(EndpointBackend, ChangesSampling),
           LOGPROBS, "the loop changed the client's sampling"),
    Mutant("endpoint/restarts-interrupted-turns",
           lambda: wrapped(EndpointBackend, RestartsInterruptedTurns), RESUME,
           "regenerated instead of resumed"),
    Mutant("endpoint/agent-lets-tool-errors-escape", CrashingAgent, FAILURE,
           "the trajectory shows no tool error", "raises"),
    Mutant("endpoint/drops-trajectory-on-agent-error",
           lambda: wrapped(CrashingAgent, RaisesOnAgentError), FAILURE,
           "trajectories were lost when the loop's tools failed", "raises"),
    Mutant("endpoint/reuses-trajectories-job",
           lambda: wrapped(EndpointBackend, ReusesTrajectories), JOB,
           "generated for another trajectory", "raises"),
)  # fmt: skip


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.id for m in MUTANTS])
def test_the_suite_fails_the_mutant_on_its_law(mutant: Mutant) -> None:
    suite = mutant.make_suite()
    law = getattr(suite, mutant.law)
    with pytest.raises(AssertionError) as failure:
        law() if mutant.arg is None else law(mutant.arg)
    assert re.search(mutant.message, str(failure.value)), str(failure.value)


def test_every_law_has_a_mutant_on_both_loops() -> None:
    laws = {MASK, LOGPROBS, LOSS, RESUME, FAILURE, JOB}
    assert {m.law for m in MUTANTS if m.id.startswith("tool/")} == laws
    assert {m.law for m in MUTANTS if m.id.startswith("endpoint/")} == laws


def test_the_backends_describe_themselves() -> None:
    line = TestToolAgentLoop.describe_backend()
    assert "make_tool_policy" in line and "SupportsPause and SupportsProgress" in line
    assert "['raises', 'times_out', 'malformed', 'unknown_tool', 'bad_arguments']" in line
    assert TestEndpointLoop.report_lines()[0] == TestEndpointLoop.describe_backend()
    assert isinstance(ToolLoopBackend().make_loop(None), AgentLoop)
