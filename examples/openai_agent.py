"""Train an agent written for the ``openai`` client, unchanged, with ``RLJob``.

``agent`` below is ordinary openai-client code: it calls ``chat.completions.create`` with a
tool, runs the tool calls it gets back on its own side, sends the results and stops at the
first answer. All it learns from AsyncFlow is a ``Session``: the ``base_url`` and ``api_key``
of one trajectory on an ``asyncflow_serve.ChatEndpoint``, which generates every turn with the
rollout engine and records the exact tokens. ``EndpointLoop`` runs the agent once per sample
and hands the recorded trajectory to ``RLJob``, which trains on it like any agent loop's.

The task is the reference ``lookup`` task (``asyncflow_reference.agentic``): find a person's
number in a private phone book through the ``lookup`` tool. The tiny model first gets a few
supervised steps teaching the tool-call *syntax* (so it calls the tool at all), then RL.

    python examples/openai_agent.py        # ~10 s on a laptop CPU
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Mapping
from typing import Any

import openai
import torch
from asyncflow_reference.agentic import LookupTask, chat_format
from asyncflow_reference.engines import TorchInferenceEngine, TorchTrainEngine
from asyncflow_reference.model import ModelConfig
from asyncflow_serve import ChatEndpoint, EndpointLoop, Session

from asyncflow_core.contracts.protocols import Batch, SamplingParams
from asyncflow_core.flow.agent import TrajectoryLimits
from asyncflow_core.flow.rlflow import RLConfig, RLEngines, RLJob, StepRecord
from asyncflow_core.training.rl import LOSS_MASK, policy_gradient_loss

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up a person's phone number.",
            "parameters": {
                "type": "object",
                "properties": {"person": {"type": "string"}},
                "required": ["person"],
            },
        },
    }
]


# ---- the agent: plain openai-client code ----------------------------------------------------
async def agent(sample: Mapping[str, Any], session: Session) -> str | None:
    book = sample["book"]  # the tool's data lives on the agent's side

    def lookup(person: str) -> str:
        return str(book.get(person, f"error: no person named {person!r}"))

    async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key) as client:
        messages: list[Any] = list(sample["messages"])
        for _ in range(4):
            response = await client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS
            )
            message = response.choices[0].message
            if not message.tool_calls:
                return message.content  # the answer
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                if call.type != "function":
                    continue
                args = json.loads(call.function.arguments)
                result = lookup(str(args.get("person")))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None


# ---- the job --------------------------------------------------------------------------------
async def warm_up(trainer: TorchTrainEngine, task: LookupTask, steps: int = 30) -> None:
    """Supervised steps on the task's syntax examples (random arguments: the rest is RL's)."""
    chat = chat_format()
    rng = random.Random(0)
    for _ in range(steps):
        rows = []
        for tokens, mask in task.warmup_examples(chat, rng, 16):
            p = mask.index(1)
            rows.append((tokens[:p], tokens[p:], mask[p:]))
        batch = Batch(
            tuple(range(len(rows))),
            {
                "prompt": [torch.tensor(p) for p, _, _ in rows],
                "response": [torch.tensor(r) for _, r, _ in rows],
                LOSS_MASK: [torch.tensor(m) for _, _, m in rows],
                "advantage": torch.ones(len(rows)),  # policy gradient = masked NLL
            },
        )
        await trainer.train_step(batch, policy_gradient_loss)


async def run() -> None:
    chat = chat_format()
    task = LookupTask(digits=3)
    config = ModelConfig(
        vocab_size=chat.tokenizer.vocab_size,  # type: ignore[attr-defined]
        d_model=32,
        n_layers=1,
        n_heads=4,
        max_seq_len=128,
    )
    teacher = TorchTrainEngine(config, lr=2e-2, seed=0, name="warm-up")
    await warm_up(teacher, task)
    # RL starts from the warmed weights, on both sides (each engine copies the model)
    trainer = TorchTrainEngine(teacher.model, lr=1e-3, seed=0)
    engine = TorchInferenceEngine(teacher.model, max_batch=16, seed=0)
    await teacher.close()

    endpoint = ChatEndpoint(chat)  # 127.0.0.1, a random run token
    await endpoint.start()
    loop = EndpointLoop(endpoint, agent, reward=task.reward)

    def on_step(step: StepRecord) -> None:
        m = loop.metrics
        print(
            f"step {step.version}: reward {step.reward_mean:.3f}, tool calls/trajectory "
            f"{step.metrics.extra.get('agent_tool_calls', 0.0):.2f}; so far {m['sessions']} "
            f"sessions, {m['requests']} requests, {m['mismatches']} mismatches"
        )

    rl = RLConfig(
        steps=3,
        prompts_per_step=4,
        n=4,
        sampling=SamplingParams(max_tokens=24, stop_token_ids=chat.stop_token_ids),
        trajectory_limits=TrajectoryLimits(max_turns=4, max_total_tokens=128),
    )
    job = RLJob(rl, RLEngines([engine], trainer), task.samples(seed=1), agent=loop, on_step=on_step)
    try:
        result = await job.run()
    finally:
        await endpoint.close()
        await engine.close()
        await trainer.close()
    m = loop.metrics
    print(
        f"trained {len(result.steps)} steps on {result.samples} trajectories; the endpoint "
        f"answered {m['requests']} requests in {m['sessions']} sessions, {m['mismatches']} "
        f"mismatches, {m['splits']} splits, {m['agent_errors']} agent errors"
    )
    assert len(result.steps) == rl.steps and m["agent_errors"] == 0


def main() -> None:
    asyncio.run(run())


if __name__ == "__main__":
    main()
