"""The reference backend's workloads for the main job (``asyncflow run``), registered through
entry points (``asyncflow_core.engines.registry``): ``digits`` (a ``TransformerLM`` learns a
built-in digit task, ``asyncflow_reference.tasks``; the default workload) and ``agent`` (an
agentic task over several turns with a tool, ``asyncflow_reference.agentic``), their config
class ``ReferenceRunConfig`` (``task.*`` and the model's shape, ``model.*``) and the ``torch``
rollout engine and trainer.

How a reference run starts: a *format warm-up* (a few seconds of supervised steps on prompts
answered with random digits, ``DigitTask.format_examples``) teaches the answer's shape but not
the task, so the reward starts near chance (0.1); the RL trainer and the rollout engines then
start from those weights at version 0.
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import torch

from asyncflow_core.contracts.errors import ConfigError
from asyncflow_core.contracts.protocols import (
    Batch,
    GenerationRequest,
    InferenceEngine,
    SamplingParams,
    TrainEngine,
)
from asyncflow_core.engines import registry
from asyncflow_core.engines.process import ProcessTrainEngine
from asyncflow_core.flow.agent import ToolAgentLoop
from asyncflow_core.flow.tools import ToolRunner
from asyncflow_core.job.config import RunConfig
from asyncflow_core.training.rl import LOSS_MASK, policy_gradient_loss
from asyncflow_reference import agentic
from asyncflow_reference.agentic import TASKS as AGENT_TASKS
from asyncflow_reference.agentic import LookupTask, chat_format
from asyncflow_reference.engines import TorchInferenceEngine, TorchTrainEngine
from asyncflow_reference.model import ModelConfig, TransformerLM
from asyncflow_reference.tasks import DigitTask, TaskName


@dataclass(frozen=True)
class TaskSection:
    """The verifiable task and the format warm-up: a digit task (``reverse``, ``sort``,
    ``add``: ``asyncflow_reference.tasks``) or an agentic one, over several turns with a tool
    (``clock``, ``lookup``: ``asyncflow_reference.agentic``; for ``lookup``, ``digits`` is the
    phone numbers' length). ``--set task=clock`` is short for ``--set task.name=clock``."""

    name: Literal["reverse", "sort", "add", "clock", "lookup"] = "reverse"
    digits: int = 3
    warmup_steps: int = 60
    warmup_batch: int = 128

    def validate(self) -> None:
        if self.name == "lookup":
            LookupTask(self.digits)  # raises ConfigError naming the field
        elif self.name != "clock":
            DigitTask(self.name, self.digits)  # raises ConfigError naming the field
        if self.warmup_steps < 0 or self.warmup_batch < 1:
            raise ConfigError(
                f"task.warmup_steps must be >= 0 and task.warmup_batch >= 1, got "
                f"{self.warmup_steps} and {self.warmup_batch}"
            )


@dataclass(frozen=True)
class ModelSection:
    """The policy: a ``TransformerLM`` of this shape (vocabulary and context length come from
    the task)."""

    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int | None = None
    init_std: float = 0.1
    """Normal init std of embeddings and linear weights: 0.1 (not GPT-2's 0.02) makes the
    position embeddings distinct enough from the start that RL finds the digit-copying
    attention within ~40 steps on every seed tried (0.02: 40 to over 200 steps)."""


@dataclass(frozen=True)
class ReferenceRunConfig(RunConfig):
    """The main job's config for the reference workloads (``digits``, ``agent``): the task
    and the model's shape added to ``RunConfig``'s keys."""

    task: TaskSection = field(default_factory=TaskSection)
    model: ModelSection = field(default_factory=ModelSection)

    def auto_workload(self) -> str:
        return "agent" if self.task.name in AGENT_TASKS else "digits"

    def check(self) -> None:
        self.task.validate()
        workload = self.workload_name()
        agentic_task = self.task.name in AGENT_TASKS
        if workload not in ("digits", "agent"):
            return  # a plugin's workload reusing this class checks its own
        if (workload == "agent") != agentic_task:
            raise ConfigError(
                f"workload {workload!r} and task.name = {self.task.name!r} do not go together: "
                f"the agent workload runs task.name = {' or '.join(map(repr, AGENT_TASKS))}, "
                "the digits workload the others (leave workload = 'auto')"
            )

    def default_lr_warmup_steps(self) -> int:
        """20 for the agentic tasks, 0 otherwise (``TrainSection.lr_warmup_steps``)."""
        return 20 if self.task.name in AGENT_TASKS else 0

    def describe(self) -> str:
        return "clock" if self.task.name == "clock" else f"{self.task.name}-{self.task.digits}"

    def task_spec(self) -> DigitTask:
        if self.task.name in AGENT_TASKS:
            raise ConfigError(
                f"task.name = {self.task.name!r} is an agentic task, not a digit task "
                "(AgentWorkload)"
            )
        return DigitTask(cast(TaskName, self.task.name), self.task.digits)

    def model_config(self) -> ModelConfig:
        t = self.task_spec()
        m = self.model
        return ModelConfig(
            vocab_size=t.vocab_size, d_model=m.d_model, n_layers=m.n_layers, n_heads=m.n_heads,
            d_ff=m.d_ff, max_seq_len=t.prompt_len + t.max_tokens, init_std=m.init_std,
        )  # fmt: skip

    def sampling(self) -> SamplingParams:
        t = self.task_spec()
        r = self.rollout
        return SamplingParams(
            max_tokens=t.max_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            stop_token_ids=t.stop_token_ids,
        )  # fmt: skip


def _format_batch(task: DigitTask, rng: random.Random, n: int) -> Batch:
    """A supervised warm-up batch: prompts answered with random digits, advantage 1 (so the
    policy-gradient loss is the response's negative log-likelihood)."""
    pairs = task.format_examples(rng, n)
    prompts = torch.tensor([p for p, _ in pairs], dtype=torch.long)
    responses = torch.tensor([r for _, r in pairs], dtype=torch.long)
    return Batch(
        rows=tuple(range(n)),
        data={"prompt": prompts, "response": responses, "advantage": torch.ones(n)},
        lengths={
            "prompt": torch.full((n,), prompts.shape[1], dtype=torch.long),
            "response": torch.full((n,), responses.shape[1], dtype=torch.long),
        },
    )


async def _warm_up(cfg: ReferenceRunConfig, model: TransformerLM) -> TransformerLM:
    task = cfg.task_spec()
    if not cfg.task.warmup_steps:
        return model
    trainer = TorchTrainEngine(model, lr=cfg.train.lr, seed=cfg.seed, name="warm-up")
    rng = random.Random(cfg.seed + 1)
    try:
        for _ in range(cfg.task.warmup_steps):
            await trainer.train_step(
                _format_batch(task, rng, cfg.task.warmup_batch), policy_gradient_loss
            )
        return trainer.model
    finally:
        await trainer.close()


async def _evaluate(
    task: DigitTask, engine: InferenceEngine, count: int, seed: int
) -> tuple[float, float]:
    """Greedy decoding on ``count`` fresh prompts (a seed the training stream never used)."""
    params = SamplingParams(
        max_tokens=task.max_tokens, temperature=0.0, stop_token_ids=task.stop_token_ids
    )
    stream = task.prompts(seed=seed)
    prompts = [next(stream) for _ in range(count)]
    results = await asyncio.gather(
        *(engine.generate(GenerationRequest(f"eval-{i}", p, params)) for i, p in enumerate(prompts))
    )
    scores = [task.score(p, r.tokens) for p, r in zip(prompts, results, strict=True)]
    return (
        sum(s for s, _ in scores) / len(scores),
        sum(1.0 for _, exact in scores if exact) / len(scores),
    )


class DigitsWorkload:
    """The reference workload: a ``TransformerLM`` learns a built-in digit task
    (``asyncflow_reference.tasks``), after the format warm-up."""

    rollout_engine = "torch"
    train_engine = "torch"
    config = ReferenceRunConfig

    def __init__(self, cfg: ReferenceRunConfig, out_dir: Path | None = None) -> None:
        self.cfg = cfg
        self.task = cfg.task_spec()
        self.label = f"{cfg.task.name}-{cfg.task.digits}"

    async def fresh_model(self) -> TransformerLM:
        """The model before the warm-up (a resumed run loads its weights next)."""
        return TransformerLM(self.cfg.model_config(), seed=self.cfg.seed)

    async def initial_model(self) -> TransformerLM:
        cfg = self.cfg
        return await _warm_up(cfg, TransformerLM(cfg.model_config(), seed=cfg.seed))

    def prompts(self, seed: int) -> Iterator[tuple[int, ...]]:
        return self.task.prompts(seed)

    def reward(self, prompt: Sequence[int], response: Sequence[int]) -> float:
        return self.task.reward(prompt, response)

    def sampling(self, temperature: float, top_p: float, top_k: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.task.max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            stop_token_ids=self.task.stop_token_ids,
        )  # fmt: skip

    async def evaluate(
        self, engine: InferenceEngine, prompts: int, seed: int
    ) -> tuple[float, float]:
        return await _evaluate(self.task, engine, prompts, seed)

    async def finish(self, trainer: TrainEngine, out_dir: Path | None) -> dict[str, Any]:
        return {}


class AgentWorkload:
    """The agentic reference workload: a ``TransformerLM`` learns an agentic task
    (``asyncflow_reference.agentic``: ``clock``, ``lookup``) through ``ToolAgentLoop`` over
    the minimal chat template, after a warm-up that teaches the tool-call syntax with random
    arguments and answers only. Evaluated greedily before and after RL (reward, exact, tool
    use, turns), and after RL with the tool taken away."""

    rollout_engine = "torch"
    train_engine = "torch"
    config = ReferenceRunConfig
    runtimes = ("local",)  # not tried on Ray yet

    def __init__(self, cfg: ReferenceRunConfig, out_dir: Path | None = None) -> None:
        self.cfg = cfg
        name = cfg.task.name
        self.task: agentic.AgentTask = (
            LookupTask(cfg.task.digits) if name == "lookup" else agentic.ClockTask()
        )
        self.chat = chat_format()
        self.label = f"lookup-{cfg.task.digits}" if name == "lookup" else name
        self.runner = ToolRunner(
            [], max_concurrency=cfg.agent.tool_concurrency, timeout_s=cfg.agent.tool_timeout_s
        )
        self.evaluations: dict[str, dict[str, float]] = {}

    def model_config(self) -> ModelConfig:
        m = self.cfg.model
        return ModelConfig(
            vocab_size=self.chat.tokenizer.vocab_size,  # type: ignore[attr-defined]
            d_model=m.d_model, n_layers=m.n_layers, n_heads=m.n_heads, d_ff=m.d_ff,
            max_seq_len=self.cfg.agent.max_total_tokens, init_std=m.init_std,
        )  # fmt: skip

    async def fresh_model(self) -> TransformerLM:
        """The model before the warm-up (a resumed run loads its weights next)."""
        return TransformerLM(self.model_config(), seed=self.cfg.seed)

    async def initial_model(self) -> TransformerLM:
        cfg = self.cfg
        model = TransformerLM(self.model_config(), seed=cfg.seed)
        if cfg.task.warmup_steps:
            trainer = TorchTrainEngine(model, lr=cfg.train.lr, seed=cfg.seed, name="warm-up")
            rng = random.Random(cfg.seed + 1)
            try:
                for _ in range(cfg.task.warmup_steps):
                    examples = self.task.warmup_examples(self.chat, rng, cfg.task.warmup_batch)
                    await trainer.train_step(_masked_batch(examples), policy_gradient_loss)
                model = trainer.model
            finally:
                await trainer.close()
        if cfg.eval_prompts:  # where RL starts from, greedy
            engine = TorchInferenceEngine(model, max_batch=cfg.rollout.max_batch, seed=cfg.seed)
            try:
                self.evaluations["before"] = await self._evaluate(engine, True)
            finally:
                await engine.close()
        return model

    def prompts(self, seed: int) -> Iterator[dict[str, Any]]:
        return self.task.samples(seed)

    def reward(self, prompt: Sequence[int], response: Sequence[int]) -> float:
        raise ConfigError("an agentic workload is scored by its agent loop, not by reward()")

    def agent_loop(self) -> ToolAgentLoop:
        return ToolAgentLoop(self.chat, self.runner, tools=self.task.tools, reward=self.task.reward)

    def sampling(self, temperature: float, top_p: float, top_k: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.cfg.agent.max_turn_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, stop_token_ids=self.chat.stop_token_ids,
        )  # fmt: skip

    async def _evaluate(self, engine: InferenceEngine, tools: bool) -> dict[str, float]:
        a = self.cfg.agent
        return await agentic.evaluate(
            self.task, engine, self.cfg.eval_prompts, 10_000_019 + self.cfg.seed, tools=tools,
            limits=a.limits(), max_tokens=a.max_turn_tokens,
        )  # fmt: skip

    async def evaluate(
        self, engine: InferenceEngine, prompts: int, seed: int
    ) -> tuple[float, float]:
        after = await self._evaluate(engine, True)
        self.evaluations["after"] = after
        self.evaluations["no_tools"] = await self._evaluate(engine, False)
        return after["reward"], after["exact"]

    async def finish(self, trainer: TrainEngine, out_dir: Path | None) -> dict[str, Any]:
        return {"eval": self.evaluations, "tool_calls": dict(self.runner.metrics)}


def _masked_batch(examples: Sequence[tuple[Sequence[int], Sequence[int]]]) -> Batch:
    """Supervised rows from ``(tokens, loss_mask)`` examples: advantage 1 (the loss is the
    negative log-likelihood of the masked-in tokens), the first token as the prompt."""
    return Batch(
        tuple(range(len(examples))),
        {
            "prompt": [torch.tensor(tokens[:1]) for tokens, _ in examples],
            "response": [torch.tensor(tokens[1:]) for tokens, _ in examples],
            LOSS_MASK: [torch.tensor(mask[1:]) for _, mask in examples],
            "advantage": torch.ones(len(examples)),
        },
    )


def torch_rollout(model: Any, *, cfg: RunConfig, index: int, threads: int) -> TorchInferenceEngine:
    """The ``torch`` rollout engine (``TorchInferenceEngine``) for a ``TransformerLM``."""
    if not isinstance(model, TransformerLM):
        raise ConfigError(
            f"rollout.engine = 'torch' serves the reference TransformerLM, not "
            f"{type(model).__name__}; use rollout.engine = 'hf' (or 'auto')"
        )
    return TorchInferenceEngine(
        model, max_batch=cfg.rollout.max_batch, seed=cfg.seed * 1000 + index,
        name=f"rollout-{index}",
    )  # fmt: skip


def torch_trainer(model: Any, *, cfg: RunConfig, threads: int, platform: str) -> TrainEngine:
    """The ``torch`` trainer (``TorchTrainEngine``; ``train.process``: in a child process)."""
    if not isinstance(model, TransformerLM):
        raise ConfigError(
            f"train.engine = 'torch' trains the reference TransformerLM, not "
            f"{type(model).__name__}; use train.engine = 'hf' or 'deepspeed' (or 'auto')"
        )
    make = functools.partial(TorchTrainEngine, model, **registry.trainer_options(cfg))
    if cfg.train_process():
        return ProcessTrainEngine(functools.partial(make, threads=threads))
    return make(threads=threads) if cfg.runtime.kind != "local" else make()


__all__ = [
    "AgentWorkload",
    "DigitsWorkload",
    "ModelSection",
    "ReferenceRunConfig",
    "TaskSection",
    "torch_rollout",
    "torch_trainer",
]
