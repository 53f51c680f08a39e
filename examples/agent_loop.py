"""Write the loop of your own agent and train it with ``RLJob``.

An ``AgentLoop`` is one method, ``run(sample, client) -> Trajectory``: it decides what the
model sees and when it is done, and generates only through ``client`` (a
``GenerationClient``), which keeps the trajectory token-in/token-out: ``client.add(ids,
role=...)`` appends text the policy did not write (masked out of the loss), ``await
client.generate()`` appends the model's next turn (trained), ``client.trajectory(reward=...)``
returns what the trainer gets.

The loop below is a guessing game written from scratch: the model guesses a digit, the loop
answers "higher" or "lower" as a user message, for up to four turns; the reward is 1 for a
right guess, less for later ones. A few supervised steps first teach the game's syntax (random
guesses), then ``RLJob(..., agent=GuessLoop())`` runs the loop once per row: the rows hold
every turn's tokens with the loss mask on the model's guesses only.

    python examples/agent_loop.py        # ~15 s on a laptop CPU
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from asyncflow_reference.agentic import chat_format
from asyncflow_reference.engines import TorchInferenceEngine, TorchTrainEngine
from asyncflow_reference.model import ModelConfig

from asyncflow_core.contracts.protocols import Batch, SamplingParams
from asyncflow_core.flow.agent import GenerationClient, Trajectory, TrajectoryLimitReached
from asyncflow_core.flow.rlflow import RLConfig, RLEngines, RLJob, StepRecord
from asyncflow_core.training.rl import LOSS_MASK, PPOClipLoss, policy_gradient_loss

CHAT = chat_format()  # the minimal chat template over the reference tokenizer


class GuessLoop:
    """Guess the secret digit in at most ``turns`` guesses, told higher or lower."""

    def __init__(self, turns: int = 4) -> None:
        self.turns = turns

    async def run(self, sample: Mapping[str, Any], client: GenerationClient) -> Trajectory:
        secret = int(sample["secret"])
        client.add(CHAT.prompt([{"role": "user", "content": "guess 0-9"}]), role="prompt")
        for turn in range(self.turns):
            try:
                result = await client.generate()
            except TrajectoryLimitReached as exc:  # a limit or the job stopping: end here
                return client.trajectory(reward=0.0, ended=exc.reason)
            guess = CHAT.parse(result.tokens).content.strip()
            if result.finish_reason != "stop" or not guess.isdigit():
                return client.trajectory(reward=0.0, ended="invalid")
            if int(guess) == secret:
                return client.trajectory(reward=1.0 - 0.2 * turn, ended="answer")
            hint = "higher" if int(guess) < secret else "lower"
            # what the game says goes in masked out: the model never trains on it
            client.add(CHAT.followup([{"role": "user", "content": hint}]), role="user")
        return client.trajectory(reward=0.0, ended="max_turns")


async def warm_up(trainer: TorchTrainEngine, steps: int = 40) -> None:
    """Teach the game's syntax only: random guesses (one digit and the stop token), answered
    by the game's true hints, until right or four guesses; the loss on the guesses alone."""
    rng = random.Random(1)
    stop = CHAT.stop_token_ids[0]
    for _ in range(steps):
        rows = []
        for _ in range(64):
            secret = rng.randrange(10)
            tokens = CHAT.prompt([{"role": "user", "content": "guess 0-9"}])
            mask = [0] * len(tokens)
            for _turn in range(4):
                guess = rng.randrange(10)
                tokens += [*CHAT.tokenizer.encode(str(guess)), stop]
                mask += [1, 1]
                if guess == secret:
                    break
                hint = "higher" if guess < secret else "lower"
                follow = CHAT.followup([{"role": "user", "content": hint}])
                tokens += follow
                mask += [0] * len(follow)
            rows.append((tokens, mask))
        batch = Batch(
            tuple(range(len(rows))),
            {
                "prompt": [torch.tensor(t[:1]) for t, _ in rows],
                "response": [torch.tensor(t[1:]) for t, _ in rows],
                LOSS_MASK: [torch.tensor(m[1:]) for _, m in rows],
                "advantage": torch.ones(len(rows)),
            },
        )
        await trainer.train_step(batch, policy_gradient_loss)


def samples(seed: int) -> Iterator[dict[str, Any]]:
    rng = random.Random(seed)
    while True:
        yield {"secret": rng.randrange(10)}  # a JSON-able dict: the row's "sample" field


async def main() -> None:
    torch.manual_seed(0)
    model = ModelConfig(
        vocab_size=CHAT.tokenizer.vocab_size,  # type: ignore[attr-defined]
        d_model=32, n_layers=1, n_heads=2, max_seq_len=96,
    )  # fmt: skip
    trainer = TorchTrainEngine(model, lr=3e-3, seed=0, threads=1)
    await warm_up(trainer)  # the engine gets these weights at the job's first sync
    engine = TorchInferenceEngine(model, max_batch=64, seed=0, threads=1)
    config = RLConfig(
        steps=10, prompts_per_step=8, n=4, staleness=1,
        sampling=SamplingParams(max_tokens=4, stop_token_ids=CHAT.stop_token_ids),
    )  # fmt: skip

    def report(step: StepRecord) -> None:
        e = step.metrics.extra
        print(
            f"step {step.version}: reward {step.reward_mean:.3f}, turns/trajectory "
            f"{e['agent_turns']:.2f}, trained tokens {int(e['tokens'])}",
            flush=True,
        )

    job = RLJob(config, RLEngines([engine], trainer), samples(0), agent=GuessLoop(),
                loss_fn=PPOClipLoss(), on_step=report)  # fmt: skip
    try:
        result = await job.run()
    finally:
        await engine.close()
        await trainer.close()
    print(f"trained {len(result.steps)} steps on {result.samples} trajectories")


if __name__ == "__main__":
    asyncio.run(main())
