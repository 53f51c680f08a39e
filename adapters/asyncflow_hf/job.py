"""The ``hf`` workload of the main job (``asyncflow run --set model.path=DIR`` or
``--set model.name=tiny-qwen2``) and its engines, registered through entry points
(``asyncflow_core.engines.registry``): a Hugging Face causal LM trained with RL on prompts from a
local dataset file, scored by a reward function.

* **Model**: ``model.path`` (a local model folder: ``from_pretrained``, safetensors only,
  ``model.trust_remote_code`` off unless set) or ``model.name`` (a tiny config, random init
  from ``seed``).
* **Tokenizer**: the model folder's (``AutoTokenizer``, offline), its chat template applied
  when it has one; with ``model.name``, the tokenizer built here for the shipped data
  (``asyncflow_hf.assets.build_tokenizer``). Generation stops at its EOS.
* **Data**: ``data.path`` (JSONL or parquet through ``datasets``; ``data.prompt_field`` or
  ``data.messages_field``), or, empty, synthetic GSM8K-style problems generated for the run
  and written to the run folder (``data.jsonl``). Rows held out for the final greedy
  evaluation (``eval_prompts``, at most a tenth of a file) are never trained on.
* **Reward**: ``reward = "package.module:function"`` (``reward(completion, row) -> float``;
  async or batched too: ``asyncflow_hf.reward``), or the built-in math reward on
  ``data.answer_field``. Each call has ``reward_timeout_s``; a reward that raises, hangs or
  returns a non-number fails its row: logged, counted, written to ``reward_errors.jsonl``,
  and the row trains nothing (the job goes on).
* **Warm-up** (``task.warmup_steps``, built-in math reward only): supervised steps on prompts
  answered ``#### N`` with N drawn at random from the data's answer range: the answer's
  shape, not the task.
* **Output**: the trained policy in ``<run folder>/policy`` (``save_pretrained``: config,
  safetensors, generation config, tokenizer and chat template), what vLLM or SGLang load next.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from asyncflow_core.contracts.errors import AsyncFlowError, ConfigError
from asyncflow_core.contracts.protocols import (
    Batch,
    GenerationRequest,
    InferenceEngine,
    SamplingParams,
    TrainEngine,
)
from asyncflow_core.engines import registry
from asyncflow_core.engines.lmtrain import unique_named_tensors
from asyncflow_core.training.rl import policy_gradient_loss
from asyncflow_hf.compat import require_transformers
from asyncflow_hf.config import HFRunConfig
from asyncflow_hf.inference import HFInferenceEngine
from asyncflow_hf.models import check_model_folder, load_causal_lm, tiny_config
from asyncflow_hf.reward import (
    RewardResult,
    RewardRunner,
    load_reward,
    make_math_reward,
    reference_answer,
)
from asyncflow_hf.train import HFTrainEngine

logger = logging.getLogger(__name__)

WHO = "workload 'hf'"


class RewardFailedError(AsyncFlowError):
    """The reward failed on every row of the first step: the job stops (nothing is written)."""


SHIPPED_ROWS = 20_000
"""Rows of shipped data generated for a run (the prompt stream cycles through them)."""
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)
"""A tokenizer's vocabulary file: one of them must be in a model folder (transformers 5.24
builds an empty tokenizer from ``config.json`` alone, silently)."""
MAX_ERRORS_KEPT = 100
"""Failed rewards kept in full for ``reward_errors.jsonl`` (all are counted)."""


class HFWorkload:
    """``registry.Workload`` for Hugging Face models (module docstring). Every input is read
    and checked when it is built, before anything is written."""

    rollout_engine = "hf"
    train_engine = "hf"
    config = HFRunConfig
    runtimes = ("local",)  # not tried on Ray yet

    def __init__(self, cfg: HFRunConfig, out_dir: Path | None = None) -> None:
        transformers = require_transformers(WHO)
        self.cfg = cfg
        self.out_dir = out_dir
        m, d = cfg.model, cfg.data
        cfg.check()  # its keys (HFRunConfig.check), for a workload built without validate()
        self.tokenizer = self._tokenizer(transformers)
        self.model_source: Any = (
            str(check_model_folder(m.path, WHO))
            if m.path
            else tiny_config(m.name, vocab_size=len(self.tokenizer))
        )
        self.builtin_reward = not cfg.reward
        fn = make_math_reward(answer_field=d.answer_field) if self.builtin_reward else None
        self.reward_fn = fn if fn is not None else load_reward(cfg.reward)
        self.runner = RewardRunner(self.reward_fn, timeout_s=cfg.reward_timeout_s)
        train_rows, eval_rows, self.shipped = self._rows(cfg)
        self.train = self._render(train_rows)
        self.eval = self._render(eval_rows)
        if not self.train:
            raise ConfigError(f"{WHO}: no rows left to train on in data.path={d.path!r}")
        self.by_prompt: dict[tuple[int, ...], Mapping[str, Any]] = {}
        for tokens, row in (*self.train, *self.eval):
            self.by_prompt.setdefault(tokens, row)
        self.stop_ids = self._stop_ids()
        self.label = f"{m.name or Path(m.path).name} on {Path(d.path).name if d.path else 'gsm8k'}"
        self.failed = 0
        self.scored = 0
        self.errors: list[dict[str, Any]] = []
        self.first_rows = cfg.rl.prompts_per_step * cfg.rl.n
        """If every one of the first rows' rewards failed, the reward is broken: stop."""

    # ---- inputs ------------------------------------------------------------------------------
    def _tokenizer(self, transformers: Any) -> Any:
        m = self.cfg.model
        if m.name:
            from asyncflow_hf.assets import build_tokenizer

            return build_tokenizer()
        folder = check_model_folder(m.path, WHO)
        if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
            raise ConfigError(
                f"{WHO}: model folder {str(folder)!r} has no tokenizer transformers can load "
                f"(none of {', '.join(_TOKENIZER_FILES)}); save the tokenizer beside the model "
                "(tokenizer.save_pretrained(folder))"
            )
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(
                str(folder), local_files_only=True, trust_remote_code=m.trust_remote_code
            )
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(
                f"{WHO}: model folder {str(folder)!r} has no tokenizer transformers can load "
                f"({type(exc).__name__}: {str(exc)[:200]}); save the tokenizer beside the model "
                "(tokenizer.save_pretrained(folder))"
            ) from exc
        if tokenizer.eos_token_id is None:
            raise ConfigError(
                f"{WHO}: the tokenizer in {str(folder)!r} has no eos_token; set one (generation "
                "must know where a completion ends)"
            )
        return tokenizer

    def _rows(self, cfg: Any) -> tuple[list[Any], list[Any], list[dict[str, str]]]:
        """``(train prompts, held-out prompts, shipped rows to write)``."""
        from asyncflow_hf.data import Prompt, load_prompts

        d = cfg.data
        if not d.path:
            from asyncflow_hf.assets import gsm8k_rows

            rows = gsm8k_rows(SHIPPED_ROWS, seed=cfg.seed, difficulty=d.difficulty, max_number=10)
            if d.limit:
                rows = rows[: d.limit]
            held = gsm8k_rows(max(cfg.eval_prompts, 1), seed=10_000_019 + cfg.seed,
                              difficulty=d.difficulty, max_number=10)  # fmt: skip
            train = [Prompt(i, r[d.prompt_field], r) for i, r in enumerate(rows)]
            held_out = [Prompt(i, r[d.prompt_field], r) for i, r in enumerate(held)]
            return train, held_out[: cfg.eval_prompts], rows
        prompts = load_prompts(
            d.path,
            prompt_field=d.prompt_field,
            messages_field=d.messages_field or None,
            answer_field=d.answer_field,
            limit=d.limit or None,
        )
        k = min(cfg.eval_prompts, len(prompts) // 10)
        return prompts[: len(prompts) - k], prompts[len(prompts) - k :], []

    def _render(self, prompts: Sequence[Any]) -> list[tuple[tuple[int, ...], Mapping[str, Any]]]:
        from asyncflow_hf.data import render_prompt

        system = self.cfg.data.system_prompt or None
        out = []
        for p in prompts:
            tokens = tuple(int(t) for t in render_prompt(p, self.tokenizer, system_prompt=system))
            if not tokens:
                raise ConfigError(f"{WHO}: row {p.index} renders to an empty prompt")
            out.append((tokens, p.row))
        return out

    def _stop_ids(self) -> tuple[int, ...]:
        eos = self.tokenizer.eos_token_id
        ids = [eos] if isinstance(eos, int) else list(eos)
        return tuple(sorted({int(i) for i in ids}))

    # ---- Workload ----------------------------------------------------------------------------
    async def fresh_model(self) -> Any:
        """The model before any training (a resumed run loads its weights next)."""
        cfg = self.cfg
        return load_causal_lm(
            self.model_source, who=WHO, seed=cfg.seed,
            trust_remote_code=cfg.model.trust_remote_code,
        )  # fmt: skip

    async def initial_model(self) -> Any:
        cfg = self.cfg
        model = load_causal_lm(
            self.model_source, who=WHO, seed=cfg.seed,
            trust_remote_code=cfg.model.trust_remote_code,
        )  # fmt: skip
        steps = cfg.task.warmup_steps
        if not steps or not self.builtin_reward:
            return model
        return await self._warm_up(model, steps, cfg.task.warmup_batch)

    async def _warm_up(self, model: Any, steps: int, batch: int) -> Any:
        """Supervised steps on prompts answered ``#### N``, N uniform over the data's answer
        range (independent of the question): the format of a math answer, not the task."""
        answers = []
        for _, row in self.train[:2000]:
            try:
                answers.append(reference_answer(row.get(self.cfg.data.answer_field)))
            except ConfigError:
                continue
        ints = [int(a) for a in answers if a == int(a)] or [0, 9]
        low, high = min(ints), max(ints)
        rng = random.Random(self.cfg.seed + 1)
        eos = self.stop_ids[0]
        trainer = HFTrainEngine(model, lr=self.cfg.train.lr, seed=self.cfg.seed, name="warm-up")
        try:
            for _ in range(steps):
                picked = [self.train[rng.randrange(len(self.train))][0] for _ in range(batch)]
                replies = [
                    self.tokenizer(f"#### {rng.randint(low, high)}", add_special_tokens=False)[
                        "input_ids"
                    ]
                    + [eos]
                    for _ in range(batch)
                ]
                data = {
                    "prompt": [torch.tensor(p) for p in picked],
                    "response": [torch.tensor(r) for r in replies],
                    "advantage": torch.ones(batch),
                }
                await trainer.train_step(Batch(tuple(range(batch)), data), policy_gradient_loss)
            return trainer.model
        finally:
            await trainer.close()

    def prompts(self, seed: int) -> Iterator[tuple[int, ...]]:
        """The training prompts in a fresh random order every epoch, endlessly."""
        rng = random.Random(seed)
        order = list(range(len(self.train)))
        while True:
            rng.shuffle(order)
            for i in order:
                yield self.train[i][0]

    def reward(self, prompt: Sequence[int], response: Sequence[int]) -> float:
        """The reward of one completion (runs in the job's reward thread); NaN when the
        reward failed on it (logged and kept for ``reward_errors.jsonl``)."""
        row = self.by_prompt.get(tuple(int(t) for t in prompt))
        if row is None:
            raise ConfigError(f"{WHO}: a prompt the workload did not make reached the reward")
        completion = self.tokenizer.decode(list(response), skip_special_tokens=True)
        result = self.runner.score_sync([completion], [row])[0]
        return self._scored(result, completion)

    def _scored(self, result: RewardResult, completion: str) -> float:
        self.scored += 1
        if result.ok and result.score is not None:
            return float(result.score)
        self.failed += 1
        if self.failed == self.scored == self.first_rows:
            raise RewardFailedError(
                f"{WHO}: the reward failed on every one of the first {self.first_rows} rows "
                f"(one step's worth), so it is broken, not unlucky: {result.error}"
            )
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append({"error": result.error, "completion": completion[:500]})
        if self.failed <= 5 or self.failed in (10, 100, 1000):
            logger.warning(
                "%s: reward failed on a row (%d so far; it trains nothing): %s",
                WHO,
                self.failed,
                result.error,
            )
        return math.nan

    def sampling(self, temperature: float, top_p: float, top_k: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.cfg.data.max_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, stop_token_ids=self.stop_ids,
        )  # fmt: skip

    async def evaluate(
        self, engine: InferenceEngine, prompts: int, seed: int
    ) -> tuple[float, float]:
        """Greedy decoding on the held-out prompts: ``(mean reward, share with reward >= 1)``
        (failed rewards count 0)."""
        rows = self.eval[:prompts]
        if not rows:
            return math.nan, math.nan
        params = SamplingParams(
            max_tokens=self.cfg.data.max_tokens, temperature=0.0, stop_token_ids=self.stop_ids
        )
        results = await asyncio.gather(
            *(engine.generate(GenerationRequest(f"eval-{i}", p, params))
              for i, (p, _) in enumerate(rows))
        )  # fmt: skip
        texts = [self.tokenizer.decode(list(r.tokens), skip_special_tokens=True) for r in results]
        scored = await self.runner.score(texts, [row for _, row in rows])
        scores = [r.score if r.ok and r.score is not None else 0.0 for r in scored]
        return sum(scores) / len(scores), sum(s >= 1.0 for s in scores) / len(scores)

    async def finish(self, trainer: TrainEngine, out_dir: Path | None) -> dict[str, Any]:
        """Save the policy (``save_pretrained``) and the failed rewards in the run folder."""
        extra: dict[str, Any] = {"reward_failed": self.failed}
        if out_dir is None:
            return extra
        out_dir.mkdir(parents=True, exist_ok=True)
        if self.shipped:
            with (out_dir / "data.jsonl").open("w") as f:
                for row in self.shipped:
                    f.write(json.dumps(row) + "\n")
        if self.errors:
            with (out_dir / "reward_errors.jsonl").open("w") as f:
                for item in self.errors:
                    f.write(json.dumps(item) + "\n")
        policy = out_dir / "policy"
        generation = _generation_config(self.tokenizer, self.stop_ids)
        save = getattr(trainer, "save_pretrained", None)
        if callable(save):
            await save(policy, tokenizer=self.tokenizer, generation_config=generation)
        else:  # any trainer: its exported weights into a copy of the model
            await self._save_exported(trainer, policy, generation)
        extra["policy"] = str(policy)
        return extra

    async def _save_exported(self, trainer: TrainEngine, path: Path, generation: Any) -> None:
        model = load_causal_lm(
            self.model_source, who=WHO, seed=self.cfg.seed,
            trust_remote_code=self.cfg.model.trust_remote_code,
        )  # fmt: skip
        own = dict(unique_named_tensors(model))
        with torch.no_grad():
            async for bucket in trainer.export_weights(1 << 28):
                for name, tensor in bucket:
                    if name not in own:
                        raise ConfigError(
                            f"{WHO}: the trainer exported {name!r}, which the model lacks"
                        )
                    own[name].copy_(tensor)
        model.generation_config = generation
        model.save_pretrained(str(path))
        self.tokenizer.save_pretrained(str(path))

    def close(self) -> None:
        self.runner.close()


def _generation_config(tokenizer: Any, stop_ids: Sequence[int]) -> Any:
    transformers = require_transformers(WHO)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    return transformers.GenerationConfig(
        eos_token_id=list(stop_ids) if len(stop_ids) > 1 else stop_ids[0],
        pad_token_id=pad,
        bos_token_id=tokenizer.bos_token_id,
    )


# --------------------------------------------------------------------------------------------
# Engine factories (asyncflow.rollout_engines / asyncflow.train_engines: "hf")
# --------------------------------------------------------------------------------------------
def _require_hf_model(model: Any, key: str) -> None:
    transformers = require_transformers(WHO)
    if not isinstance(model, transformers.PreTrainedModel):
        raise ConfigError(
            f"{key} = 'hf' serves Hugging Face models, not {type(model).__name__}; use the "
            f"workload's own engine ({key} = 'auto')"
        )


def hf_rollout(model: Any, *, cfg: Any, index: int, threads: int) -> HFInferenceEngine:
    """``HFInferenceEngine`` over transformers' continuous batching; requests carry their stop
    ids (the workload's EOS), so the engine adds none of its own."""
    _require_hf_model(model, "rollout.engine")
    return HFInferenceEngine(
        model,
        eos_token_ids=(),
        max_batch=cfg.rollout.max_batch,
        seed=cfg.seed * 1000 + index,
        name=f"rollout-{index}",
        threads=threads,
    )


def hf_trainer(model: Any, *, cfg: Any, threads: int, platform: str) -> TrainEngine:
    """``HFTrainEngine`` (``train.dtype``: fp32 or bf16 autocast; ``train.process``: in a
    child process of its own)."""
    import functools

    from asyncflow_core.engines.process import ProcessTrainEngine

    _require_hf_model(model, "train.engine")
    make = functools.partial(
        HFTrainEngine, model, **registry.trainer_options(cfg), dtype=cfg.train.dtype,
        name="trainer", threads=threads,
    )  # fmt: skip
    if cfg.train_process():
        return ProcessTrainEngine(make)
    return make()


__all__ = ["HFWorkload", "RewardFailedError", "hf_rollout", "hf_trainer"]
