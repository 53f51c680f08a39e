"""``AgentLoopConformance`` on the Hugging Face path: ``ToolAgentLoop`` rendering through the
tokenizer's own chat template (``HFChatFormat`` over the tokenizer built offline by
``asyncflow_hf.assets``), generating with ``HFInferenceEngine`` (transformers' continuous
batching) and scored by ``HFTrainEngine`` on a tiny random Qwen2.

The random model writes no tool calls, so the laws that need tool turns (the mask with tools,
tool output never trained on, failing tools) run on ``hf_scripted_engine``: a policy that calls
``lookup`` with the person asked about and then copies the tool's answer, in the tokenizer's
tokens. The mask, log-prob and resume laws run on the real engines."""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Mapping
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

from asyncflow_conformance.agent import (  # noqa: E402
    AgentLoopConformance,
    ChatFormatConformance,
    ScriptedPolicy,
    ToolFailure,
)
from asyncflow_hf import HFChatFormat, HFInferenceEngine, HFTrainEngine  # noqa: E402
from asyncflow_hf.assets import build_tokenizer  # noqa: E402
from asyncflow_hf.models import load_causal_lm, tiny_config  # noqa: E402
from asyncflow_reference.agentic import PhoneBook  # noqa: E402

from asyncflow_core.contracts.protocols import GenerationRequest  # noqa: E402
from asyncflow_core.flow.agent import ToolAgentLoop, Trajectory, TrajectoryLimits  # noqa: E402
from asyncflow_core.flow.tools import ToolRunner  # noqa: E402

TOKENIZER = build_tokenizer()
CHAT = HFChatFormat(TOKENIZER)
_MODELS: dict[int, Any] = {}


def tiny_qwen2(seed: int) -> Any:
    if seed not in _MODELS:
        config = tiny_config("tiny-qwen2", vocab_size=len(TOKENIZER))
        _MODELS[seed] = load_causal_lm(config, who="test", seed=seed)
    return _MODELS[seed]


def sample(index: int) -> dict[str, Any]:
    rng = random.Random(index)
    book = {name: f"{rng.randrange(1000):03d}" for name in ("Ann", "Ben", "Sam", "Mia")}
    person = rng.choice(sorted(book))
    return {
        "messages": [{"role": "user", "content": f"What is the number of {person}? ({index})"}],
        "person": person,
        "book": book,
    }


def reward(s: Mapping[str, Any], final: Any, trajectory: Trajectory) -> float:
    return float(final is not None and final.content == s["book"][s["person"]])


class FailingBook(PhoneBook):
    def __init__(self, book: Mapping[str, str], failure: ToolFailure | None) -> None:
        super().__init__(book)
        self.failure = failure

    async def call(self, arguments: Mapping[str, Any]) -> str:
        if self.failure == "raises":
            raise RuntimeError("the phone book is down")
        if self.failure == "times_out":
            await asyncio.Event().wait()  # never set: the loop's timeout cuts it off
        return await super().call(arguments)


def hf_scripted_turn(context: str, failure: ToolFailure | None) -> list[int]:
    """The tool policy's turn in the HF tokenizer's tokens: the first turn calls ``lookup``
    for the person asked about (or writes a block that does not parse, for ``malformed``; calls
    ``dial``, which the loop does not have, for ``unknown_tool``; passes an argument the schema
    refuses, for ``bad_arguments``), later turns copy the last tool answer."""
    if "<tool_response>" not in context and context.count("<|im_start|>assistant") <= 1:
        if failure == "malformed":
            text = "<tool_call>{not json</tool_call>"
        elif failure == "unknown_tool":
            text = '<tool_call>{"name": "dial", "arguments": {"person": "Ann"}}</tool_call>'
        elif failure == "bad_arguments":
            text = '<tool_call>{"name": "lookup", "arguments": {"who": 7}}</tool_call>'
        else:
            person = re.findall(r"number of (\w+)\?", context)[-1]
            text = '<tool_call>{"name": "lookup", "arguments": {"person": "%s"}}</tool_call>'
            text %= person
    else:
        answers = re.findall(r"<tool_response>\s*(.*?)\s*</tool_response>", context, re.S)
        text = answers[-1] if answers and answers[-1].isdigit() else "000"
    return [*TOKENIZER.encode(text, add_special_tokens=False), CHAT.stop_token_ids[-1]]


def hf_scripted_engine(failure: ToolFailure | None) -> ScriptedPolicy:
    """A scripted policy in the HF tokenizer's tokens (not a model)."""

    def turn(request: GenerationRequest) -> list[int]:
        context = TOKENIZER.decode(list(request.prompt_tokens), skip_special_tokens=False)
        return hf_scripted_turn(context, failure)

    return ScriptedPolicy(turn)


class TestHFToolAgentLoop(AgentLoopConformance):
    stop_token_ids = CHAT.stop_token_ids
    # The unknown-tool and bad-arguments cases differ from the reference loop's only in the
    # chat format, which law 5 covers; the job law under them (the same ToolRunner) and the
    # staleness law at eta = 0 (no straggler possible) run on the reference backend only.
    job_failures = ("raises", "times_out", "malformed")
    job_staleness = (1,)
    max_tokens = 96  # a call is ~60 tokens of this small BPE
    limits = TrajectoryLimits(max_turns=4, max_total_tokens=640)
    timeout_s = 60.0
    real_timeout_s = 180.0

    def make_loop(self, tool_failure: ToolFailure | None) -> ToolAgentLoop:
        return ToolAgentLoop(
            CHAT, ToolRunner([], timeout_s=1.0),
            tools=lambda s: [FailingBook(s["book"], tool_failure)], reward=reward,
        )  # fmt: skip

    def make_inference(self) -> HFInferenceEngine:
        return HFInferenceEngine(tiny_qwen2(0), eos_token_ids=CHAT.stop_token_ids, threads=1)

    def make_trainer(self) -> HFTrainEngine:
        return HFTrainEngine(tiny_qwen2(1), lr=1e-2, micro_batch_size=8)

    def make_tool_policy(self, tool_failure: ToolFailure | None) -> ScriptedPolicy:
        return hf_scripted_engine(tool_failure)

    def sample(self, index: int) -> Mapping[str, Any]:
        return sample(index)

    async def close_engine(self, engine: Any) -> None:
        close = getattr(engine, "close", None)
        if close is not None:
            await close()


class TestHFChatFormat(ChatFormatConformance):
    """``HFChatFormat`` over the offline tokenizer's own (Qwen2.5-style) chat template."""

    def make_chat(self) -> HFChatFormat:
        return HFChatFormat(TOKENIZER)
