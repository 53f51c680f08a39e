"""The ``hf`` workload's config class: ``HFRunConfig``, the main job's ``RunConfig`` with the
Hugging Face model (``model.*``), the data (``data.*``), the reward and the format warm-up
(``task.warmup_*``). Light: it imports no transformers (``asyncflow run`` reads it to pick the
workload)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from asyncflow_core.contracts.errors import ConfigError
from asyncflow_core.job.config import RunConfig
from asyncflow_hf.models import TINY


@dataclass(frozen=True)
class ModelSection:
    """The policy: a Hugging Face causal LM from ``path`` or ``name`` (exactly one)."""

    path: str = ""
    """A local model folder (``from_pretrained``; safetensors only, never the hub), with
    its tokenizer (and chat template, if any)."""
    name: str = ""
    """A named tiny config, random init from ``seed`` (``tiny-qwen2``, ``tiny-llama``),
    with the tokenizer built for the shipped data."""
    trust_remote_code: bool = False
    """Let the model folder run its own code (off: a folder needing it is refused)."""


@dataclass(frozen=True)
class DataSection:
    """The prompts, from a local JSONL or parquet file read with ``datasets``."""

    path: str = ""
    """The data file (or folder); empty: the shipped synthetic GSM8K-style problems,
    generated into the run folder (``data.jsonl``)."""
    prompt_field: str = "question"
    messages_field: str = ""
    """A field of chat messages (``[{"role": ..., "content": ...}]``), used instead of
    ``prompt_field`` when set."""
    answer_field: str = "answer"
    """What the built-in math reward compares with (GSM8K ``#### N`` or a number)."""
    system_prompt: str = ""
    max_tokens: int = 16
    """The response cap (tokens)."""
    limit: int = 0
    """Use the first ``limit`` rows only (0: all)."""
    difficulty: int = 1
    """Shipped data only: 1 (one + or -), 2 (also x and /), 3 (two operations)."""


@dataclass(frozen=True)
class WarmupSection:
    """The format warm-up (built-in math reward only): supervised steps on prompts answered
    ``#### N``, N drawn from the data's answer range."""

    warmup_steps: int = 60
    warmup_batch: int = 128

    def validate(self) -> None:
        if self.warmup_steps < 0 or self.warmup_batch < 1:
            raise ConfigError(
                f"task.warmup_steps must be >= 0 and task.warmup_batch >= 1, got "
                f"{self.warmup_steps} and {self.warmup_batch}"
            )


_CLAIMED = ("model.path", "model.name", "model.trust_remote_code", "reward", "reward_timeout_s")


@dataclass(frozen=True)
class HFRunConfig(RunConfig):
    """The main job's config for the ``hf`` workload (``asyncflow_hf.job.HFWorkload``)."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    task: WarmupSection = field(default_factory=WarmupSection)
    reward: str = ""
    """The reward, ``package.module:function`` (``reward(completion, row) -> float``, sync,
    async or batched: ``asyncflow_hf.reward``); empty: the built-in math reward."""
    reward_timeout_s: float = 30.0
    """Seconds a reward call may take; a reward that raises, hangs past this or returns a
    non-number fails its row (logged; the row trains nothing) and the run goes on."""

    @classmethod
    def claims(cls, values: Mapping[str, Any]) -> bool:
        """``model.path``, ``model.name``, ``reward`` or any ``data.*`` key set."""
        return any(k in _CLAIMED or k.startswith("data.") or k == "data" for k in values)

    def auto_workload(self) -> str:
        return "hf"

    def check(self) -> None:
        m, d = self.model, self.data
        if bool(m.path) == bool(m.name):
            raise ConfigError(
                "workload 'hf' needs exactly one of model.path (a local model folder written by "
                f"save_pretrained) and model.name (a tiny config: {sorted(TINY)}); got "
                f"model.path={m.path!r}, model.name={m.name!r}"
            )
        if not 1 <= d.max_tokens <= 1 << 16:
            raise ConfigError(f"data.max_tokens must be in [1, 65536], got {d.max_tokens}")
        if not self.reward_timeout_s > 0:
            raise ConfigError(f"reward_timeout_s must be > 0, got {self.reward_timeout_s}")
        self.task.validate()

    def describe(self) -> str:
        return f"hf {self.model.path or self.model.name}"


__all__ = ["DataSection", "HFRunConfig", "ModelSection", "WarmupSection"]
