"""The main job's own task in the peer benchmark (issue #23, item 5): the default
``asyncflow run`` against TRL's ``GRPOTrainer`` on reverse-3, with the same model, weights,
prompts and RL recipe. ``benchmarks/vs_trl.py --task reverse`` runs it.

What is shared:

* **Model and weights**: the reference ``TransformerLM`` of the default config (2 layers,
  width 64), warmed up *once* by the main job's own code (``DigitsWorkload.initial_model``:
  the format warm-up, same seed, one torch thread as in the async run) and saved to
  ``OUT/reverse/warm.pt``. Both sides start from that file: AsyncFlow's run has its
  workload's ``initial_model`` replaced by a load of the file (the only change to the main
  job's code path; everything else is ``asyncflow_core.cli.main(["run", ...])``), TRL gets
  the same tensors inside ``DigitsForCausalLM``, a transformers ``PreTrainedModel`` whose
  forward *is* the reference model's (``TransformerLM.hidden`` then ``.head``).
* **Tokenizer**: the digits vocabulary as a ``PreTrainedTokenizerFast`` built in code with
  ``tokenizers`` (one token per character, ``<bos>``/``<eos>`` special; pad = ``<eos>``, as
  the vocabulary has no pad token).
* **Data**: the main job's prompt stream, ``DigitTask("reverse", 3).prompts(seed)``, in order
  (TRL: ``shuffle_dataset=False``).
* **Reward**: ``DigitTask.score`` on the generated token ids (the EOS included).
* **Recipe** (the main job's defaults, ``RunConfig``): group ``n`` = 8, 32 prompts per step,
  120 steps, 4 tokens max (3 digits and EOS), temperature 1 (no top-k/p), PPO-clip ε = 0.2, no
  KL, group advantages normalised by the group's std, token-mean loss (TRL:
  ``loss_type="dapo"``), AdamW (0.9, 0.999) at a constant 2e-3, no weight decay, grad-norm
  clip 1.0, one micro-batch of 256 rows, fp32. Differences that remain: TRL's group std is the
  sample std with eps 1e-4 (ours: population std, eps 1e-6); AsyncFlow's default is η = 1
  (a batch may come from the previous weights), TRL is on-policy.

TRL's configuration: its best one for this model on CPU. Its continuous-batching generation
needs transformers' paged attention, which a custom model does not have, so generation is
``model.generate`` with sampling; the wrapper has no KV cache (``use_cache=False``: each of
the 4 decode steps re-runs the whole 5-9 token sequence), no gradient checkpointing, fp32,
1 and 2 torch threads (both run; the ratio is against the faster).

Reported per side: trained samples/s of the RL phase (AsyncFlow: the run's ``summary.json``;
TRL: steps x batch over the time from ``on_train_begin`` to the last step's end), the final
reward (the main job's evaluator for both: greedy decoding on ``eval_prompts`` held-out
prompts, ``asyncflow_reference.workloads._evaluate`` on a ``TorchInferenceEngine``), the training
reward of the first step and of the last 10%.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT / "adapters", ROOT / "reference", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402
from asyncflow_reference.model import ModelConfig, TransformerLM  # noqa: E402
from asyncflow_reference.tasks import VOCAB, DigitTask  # noqa: E402
from torch import Tensor, nn  # noqa: E402

SIDES = ("trl", "af_default")
LABELS = {"trl": "TRL GRPOTrainer", "af_default": "asyncflow run (default)"}


def _label(key: str) -> str:
    """``trl-2t`` -> "TRL GRPOTrainer, 2 threads"; ``af_default`` -> its label."""
    side, _, threads = key.partition("-")
    return f"{LABELS[side]}, {threads.removesuffix('t')} thr" if threads else LABELS[side]


# --------------------------------------------------------------------------------------------
# The reference model as a transformers model, and the digits tokenizer
# --------------------------------------------------------------------------------------------
def _transformers() -> Any:
    import transformers

    return transformers


def digits_config_class() -> Any:
    """``DigitsConfig`` (built lazily: transformers is imported only when needed)."""
    return _classes()[0]


def digits_model_class() -> Any:
    return _classes()[1]


_CLASSES: list[Any] = []


def _classes() -> list[Any]:
    if _CLASSES:
        return _CLASSES
    transformers = _transformers()
    from transformers.modeling_outputs import BaseModelOutput, CausalLMOutputWithPast

    class DigitsConfig(transformers.PretrainedConfig):  # type: ignore[misc]
        """A ``ModelConfig`` as a transformers config."""

        model_type = "asyncflow_digits"

        def __init__(
            self,
            vocab_size: int = len(VOCAB),
            d_model: int = 64,
            n_layers: int = 2,
            n_heads: int = 4,
            max_seq_len: int = 9,
            d_ff: int | None = None,
            norm_eps: float = 1e-5,
            init_std: float = 0.1,
            **kwargs: Any,
        ) -> None:
            self.vocab_size = vocab_size
            self.d_model = self.hidden_size = d_model
            self.n_layers = self.num_hidden_layers = n_layers
            self.n_heads = self.num_attention_heads = n_heads
            self.max_seq_len = self.max_position_embeddings = max_seq_len
            self.d_ff = d_ff
            self.norm_eps = norm_eps
            self.init_std = init_std
            kwargs.setdefault("tie_word_embeddings", False)
            super().__init__(**kwargs)

        @classmethod
        def from_model_config(cls, c: ModelConfig, **kwargs: Any) -> Any:
            if c.tie_embeddings:
                raise ValueError("DigitsConfig: tied embeddings are not wrapped (untied only)")
            return cls(
                vocab_size=c.vocab_size, d_model=c.d_model, n_layers=c.n_layers,
                n_heads=c.n_heads, max_seq_len=c.max_seq_len, d_ff=c.d_ff,
                norm_eps=c.norm_eps, init_std=c.init_std, **kwargs,
            )  # fmt: skip

        def model_config(self) -> ModelConfig:
            return ModelConfig(
                vocab_size=self.vocab_size, d_model=self.d_model, n_layers=self.n_layers,
                n_heads=self.n_heads, max_seq_len=self.max_seq_len, d_ff=self.d_ff,
                norm_eps=self.norm_eps, init_std=self.init_std,
            )  # fmt: skip

    class Backbone(nn.Module):
        """``TransformerLM.hidden`` (final-normed hidden states), which TRL's fused LM head
        reads as ``base_model(...).last_hidden_state``."""

        def __init__(self, lm: TransformerLM) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, **_: Any) -> Any:
            _check_right_padded(attention_mask)
            return BaseModelOutput(last_hidden_state=self.lm.hidden(input_ids))

    class DigitsForCausalLM(transformers.PreTrainedModel, transformers.GenerationMixin):  # type: ignore[misc]
        """The reference ``TransformerLM`` behind transformers' model interface: logits are
        exactly ``TransformerLM.forward``'s. No KV cache: generation re-runs the sequence
        (``prepare_inputs_for_generation`` passes it whole). Sequences must be right-padded
        (position ``t`` is token ``t``, as in the reference model); a left-padded attention
        mask is refused."""

        config_class = DigitsConfig
        base_model_prefix = "backbone"
        main_input_name = "input_ids"
        _supports_cache_class = False

        def __init__(self, config: Any, lm: TransformerLM | None = None) -> None:
            super().__init__(config)
            if lm is None:
                lm = TransformerLM(config.model_config())
            elif lm.config != config.model_config():
                raise ValueError(
                    f"DigitsForCausalLM: lm has {lm.config}, the config says "
                    f"{config.model_config()}"
                )
            self.backbone = Backbone(lm)
            self.post_init()

        @property
        def lm(self) -> TransformerLM:
            return self.backbone.lm

        def _init_weights(self, module: nn.Module) -> None:  # the reference init stays
            return None

        def init_weights(self) -> None:
            return None

        def get_input_embeddings(self) -> nn.Module:
            return self.lm.tok_emb

        def get_output_embeddings(self) -> nn.Module:
            return self.lm.lm_head

        def forward(
            self,
            input_ids: Tensor,
            attention_mask: Tensor | None = None,
            logits_to_keep: int = 0,
            **_: Any,
        ) -> Any:
            hidden = self.backbone(input_ids, attention_mask).last_hidden_state
            if logits_to_keep:
                hidden = hidden[:, -logits_to_keep:]
            return CausalLMOutputWithPast(logits=self.lm.head(hidden))

        def prepare_inputs_for_generation(
            self, input_ids: Tensor, attention_mask: Tensor | None = None, **_: Any
        ) -> dict[str, Any]:
            return {"input_ids": input_ids, "attention_mask": attention_mask}

    _CLASSES.extend([DigitsConfig, DigitsForCausalLM])
    return _CLASSES


def _check_right_padded(mask: Tensor | None) -> None:
    """Refuse a mask with a 0 before a 1 in a row (left padding, holes): the reference
    model's positions are token indices, so only right padding leaves real tokens unchanged."""
    if mask is None:
        return
    m = mask.to(torch.long)
    if bool((m[:, 1:] > m[:, :-1]).any()):
        raise ValueError(
            "DigitsForCausalLM: attention_mask has padding before real tokens (left padding); "
            "the reference model takes right-padded sequences only"
        )


def wrap(lm: TransformerLM) -> Any:
    """``lm`` (its very tensors, shared) as a ``DigitsForCausalLM``."""
    config_cls, model_cls = _classes()
    return model_cls(config_cls.from_model_config(lm.config), lm)


def digits_tokenizer() -> Any:
    """The digits vocabulary (``asyncflow_reference.tasks.VOCAB``, ids in order) as a
    ``PreTrainedTokenizerFast``: one token per character, ``<bos>``/``<eos>`` whole; no
    special tokens added on encoding; pad = ``<eos>``; decoding joins without spaces."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    transformers = _transformers()
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<eos>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(["<bos>", "<eos>"])
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<eos>",
        padding_side="left",
    )  # fmt: skip
    return tok


# --------------------------------------------------------------------------------------------
# Sizes: the main job's RunConfig, with the step count (and in --quick, the sizes) changed
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReverseSizes:
    """The ``--set`` overrides of the default ``asyncflow run`` both sides share (``None``:
    the main job's default), and TRL's thread count."""

    steps: int | None = None
    prompts_per_step: int | None = None
    n: int | None = None
    warmup_steps: int | None = None
    warmup_batch: int | None = None
    eval_prompts: int | None = None
    trl_threads: int = 2

    def sets(self) -> list[str]:
        keys = {
            "steps": "rl.steps", "prompts_per_step": "rl.prompts_per_step", "n": "rl.n",
            "warmup_steps": "task.warmup_steps", "warmup_batch": "task.warmup_batch",
            "eval_prompts": "eval_prompts",
        }  # fmt: skip
        return [f"{k}={getattr(self, f)}" for f, k in keys.items() if getattr(self, f) is not None]

    def run_config(self) -> Any:
        from asyncflow_core.job import load_run_config

        cfg = load_run_config(None, self.sets())
        cfg.validate()
        return cfg


QUICK_REVERSE = ReverseSizes(
    steps=3, prompts_per_step=4, n=4, warmup_steps=5, warmup_batch=32, eval_prompts=16
)


def prepare(sizes: ReverseSizes, out: Path) -> Path:
    """Warm the model up once, as the main job does, and save it (``OUT/reverse/warm.pt``,
    with ``warm.json``: the sha256 of its tensors and the warm-up's seconds)."""
    from asyncflow_reference.workloads import DigitsWorkload

    from asyncflow_core.job.run import _threads

    cfg = sizes.run_config()
    folder = out / "reverse"
    folder.mkdir(parents=True, exist_ok=True)
    previous = torch.get_num_threads()
    torch.manual_seed(cfg.seed)  # as job.run does before the warm-up
    torch.set_num_threads(_threads(cfg))
    try:
        t0 = time.perf_counter()
        model = asyncio.run(DigitsWorkload(cfg).initial_model())
        took = time.perf_counter() - t0
    finally:
        torch.set_num_threads(previous)
    state = {k: v.detach().clone() for k, v in model.unique_state().items()}
    torch.save(state, folder / "warm.pt")
    (folder / "warm.json").write_text(
        json.dumps({"sha256": state_hash(state), "warmup_s": round(took, 2), "sets": sizes.sets()})
    )
    return folder / "warm.pt"


def state_hash(state: dict[str, Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def load_warm(cfg: Any, path: Path) -> TransformerLM:
    model = TransformerLM(cfg.model_config(), seed=cfg.seed)
    model.load_state_dict(torch.load(path, weights_only=True))
    return model


# --------------------------------------------------------------------------------------------
# What a run reports
# --------------------------------------------------------------------------------------------
@dataclass
class ReverseResult:
    side: str
    repeat: int
    threads: str
    wall_s: float  # RL phase
    steps: int
    samples: int  # trained samples
    reward_first: float
    reward_last: float  # mean training reward over the last 10% of steps
    eval_reward: float  # greedy, held-out prompts, the main job's evaluator
    eval_exact: float
    start_sha256: str  # the weights the RL phase started from
    profile: dict[str, Any]

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0


def _evaluate(cfg: Any, lm: TransformerLM) -> tuple[float, float]:
    """The main job's evaluator (greedy, ``cfg.eval_prompts`` prompts of seed
    10_000_019 + seed) on ``lm``."""
    from asyncflow_reference.engines import TorchInferenceEngine
    from asyncflow_reference.workloads import _evaluate as job_evaluate

    async def go() -> tuple[float, float]:
        engine = TorchInferenceEngine(lm, max_batch=cfg.rollout.max_batch, seed=cfg.seed)
        try:
            return await job_evaluate(
                cfg.task_spec(), engine, cfg.eval_prompts, 10_000_019 + cfg.seed
            )
        finally:
            await engine.close()

    return asyncio.run(go())


def _last10(values: Sequence[float]) -> float:
    k = max(1, len(values) // 10)
    return statistics.fmean(values[-k:])


# --------------------------------------------------------------------------------------------
# AsyncFlow: the default `asyncflow run`
# --------------------------------------------------------------------------------------------
def run_af_default(sizes: ReverseSizes, out: Path, repeat: int) -> ReverseResult:
    """``asyncflow run --set ... --out RUN`` in this (fresh) interpreter, its workload's
    ``initial_model`` loading the shared warmed-up weights instead of warming up again."""
    from asyncflow_reference import workloads

    from asyncflow_core import cli

    sizes.run_config()  # the overrides are checked here, before anything runs
    warm = out / "reverse" / "warm.pt"
    started: list[str] = []

    async def initial_model(self: Any) -> TransformerLM:
        model = load_warm(self.cfg, warm)
        started.append(state_hash(model.unique_state()))
        return model

    workloads.DigitsWorkload.initial_model = initial_model  # type: ignore[method-assign]
    run_dir = out / "reverse" / "runs" / f"af_default-{repeat}"
    args = ["run", *(a for s in sizes.sets() for a in ("--set", s)), "--out", str(run_dir)]
    with open(os.devnull, "w") as sink:  # its progress and table: the summary is read back
        stdout, sys.stdout = sys.stdout, sink
        try:
            rc = cli.main(args)
        finally:
            sys.stdout = stdout
    if rc != 0:
        raise SystemExit(f"asyncflow {' '.join(args)} exited with {rc}")
    summary = json.loads((run_dir / "summary.json").read_text())
    rewards = [
        json.loads(line)["reward_mean"]
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip() and "reward_mean" in json.loads(line)
    ]
    return ReverseResult(
        side="af_default", repeat=repeat, threads=f"{summary['threads']} per engine",
        wall_s=summary["wall_s"], steps=summary["steps"], samples=summary["samples"],
        reward_first=rewards[0] if rewards else summary["reward_first"],
        reward_last=summary["reward_last"], eval_reward=summary["eval_reward"],
        eval_exact=summary["eval_exact"], start_sha256=started[0] if started else "",
        profile={
            "trainer": summary["trainer"], "bubble_ratio": summary["bubble_ratio"],
            "dropped": summary["dropped"], "staleness_hist": summary["staleness_hist"],
            "sync_exposed_s": summary["sync_exposed_s"], "samples_per_s": summary["samples_per_s"],
            "run_dir": str(run_dir),
        },
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# TRL's GRPOTrainer on the same model, weights and prompts
# --------------------------------------------------------------------------------------------
def trl_args(cfg: Any, sizes: ReverseSizes, output_dir: str) -> Any:
    """``GRPOConfig`` of the main job's recipe (``cfg``) in TRL's best CPU configuration."""
    import trl

    batch = cfg.rl.prompts_per_step * cfg.rl.n
    micro = min(cfg.train.micro_batch_size, batch)
    if batch % micro:
        raise ValueError(f"train.micro_batch_size {micro} must divide the batch {batch} for TRL")
    if cfg.train.loss != "ppo" or cfg.train.kl_coef or cfg.lr_warmup_steps():
        raise ValueError("the TRL row reproduces train.loss = 'ppo', no KL, no lr warm-up only")
    return trl.GRPOConfig(
        output_dir=output_dir,
        max_steps=cfg.rl.steps,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,
        num_generations=cfg.rl.n,
        max_completion_length=cfg.task_spec().max_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        learning_rate=cfg.train.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=cfg.train.weight_decay,
        max_grad_norm=cfg.train.max_grad_norm,
        adam_beta1=0.9,
        adam_beta2=0.999,
        beta=0.0,
        epsilon=cfg.train.clip,
        num_iterations=1,
        loss_type="dapo",  # token-mean over the step's response tokens
        scale_rewards="group",
        shuffle_dataset=False,
        seed=cfg.seed,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        generation_kwargs={"use_cache": False},  # the wrapper has no KV cache
        logging_steps=max(cfg.rl.steps, 1),
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def run_trl(sizes: ReverseSizes, out: Path, repeat: int) -> ReverseResult:
    torch.set_num_threads(sizes.trl_threads)
    import datasets
    import transformers
    import trl

    cfg = sizes.run_config()
    task: DigitTask = cfg.task_spec()
    lm = load_warm(cfg, out / "reverse" / "warm.pt")
    start = state_hash(lm.unique_state())
    model = wrap(lm)
    tokenizer = digits_tokenizer()
    stream = task.prompts(cfg.seed)  # the main job's stream: workload.prompts(cfg.seed)
    prompts = [next(stream) for _ in range(cfg.rl.steps * cfg.rl.prompts_per_step)]
    dataset = datasets.Dataset.from_list(
        [{"prompt": task.render(p), "tokens": list(p)} for p in prompts]
    )
    scored: list[float] = []

    def reward(
        prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
        tokens: list[list[int]], **_: Any,
    ) -> list[float]:  # fmt: skip
        out_ = [task.reward(p, ids) for p, ids in zip(tokens, completion_ids, strict=True)]
        scored.extend(out_)
        return out_

    batch = cfg.rl.prompts_per_step * cfg.rl.n
    gen_seconds: list[float] = []
    first_prompt_ids: list[list[int]] = []

    class Clock(transformers.TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.t0 = 0.0
            self.ends: list[float] = []
            self.step_rewards: list[float] = []
            self.seen = 0

        def on_train_begin(self, *a: Any, **k: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            self.ends.append(time.perf_counter() - self.t0)
            new = scored[self.seen :]
            self.seen = len(scored)
            self.step_rewards.append(statistics.fmean(new) if new else math.nan)

    class Trainer(trl.GRPOTrainer):  # type: ignore[misc]
        """GRPOTrainer, timing its generation phase; nothing else changed."""

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            t = time.perf_counter()
            result = super()._generate_and_score_completions(inputs)
            gen_seconds.append(time.perf_counter() - t)
            return result

        def _tokenize_prompts(self, prompts: list[Any]) -> Any:
            result = super()._tokenize_prompts(prompts)
            if not first_prompt_ids:
                first_prompt_ids.extend(list(map(list, result[0])))
            return result

    clock = Clock()
    run_dir = out / "reverse" / "runs" / f"trl-{repeat}"
    trainer = Trainer(
        model=model, reward_funcs=[reward], args=trl_args(cfg, sizes, str(run_dir)),
        train_dataset=dataset, processing_class=tokenizer, callbacks=[clock],
    )  # fmt: skip
    trainer.train()
    wall = clock.ends[-1]
    eval_reward, eval_exact = _evaluate(cfg, lm)  # lm: the trained tensors (shared)
    expected = [list(p) for p in prompts[: cfg.rl.prompts_per_step] for _ in range(cfg.rl.n)]
    return ReverseResult(
        side="trl", repeat=repeat, threads=str(sizes.trl_threads), wall_s=wall,
        steps=len(clock.ends), samples=len(clock.ends) * batch,
        reward_first=clock.step_rewards[0], reward_last=_last10(clock.step_rewards),
        eval_reward=eval_reward, eval_exact=eval_exact, start_sha256=start,
        profile={
            "generate_s": round(sum(gen_seconds), 3),
            "train_s": round(wall - sum(gen_seconds), 3),
            "first_batch_prompt_ids_equal_main_job": first_prompt_ids == expected,
        },
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# The driver (called by vs_trl.py --task reverse)
# --------------------------------------------------------------------------------------------
def child(side: str, sizes_json: str, out: str, repeat: int) -> int:
    sizes = ReverseSizes(**json.loads(sizes_json))
    if side == "trl":
        result = run_trl(sizes, Path(out), repeat)
    elif side == "af_default":
        result = run_af_default(sizes, Path(out), repeat)
    else:
        raise SystemExit(f"unknown side {side!r}; choose from {SIDES}")
    print(json.dumps(asdict(result)))
    return 0


def _one(script: Path, side: str, sizes: ReverseSizes, out: Path, repeat: int) -> ReverseResult:
    key = f"trl-{sizes.trl_threads}t" if side == "trl" else side
    print(f"  running {_label(key)} [{repeat + 1}] ...", file=sys.stderr, flush=True)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(script), "--one", f"reverse:{side}", json.dumps(asdict(sizes)),
         str(out), str(repeat)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"run {side} [{repeat + 1}] failed:\n{proc.stderr[-4000:]}")
    result = ReverseResult(**json.loads(proc.stdout.strip().splitlines()[-1]))
    result.profile["load_at_start"] = round(load, 2)
    print(
        f"  {_label(key)} [{repeat + 1}]: {result.samples_per_s:.1f} samples/s, wall "
        f"{result.wall_s:.1f} s, reward {result.reward_first:.3f} -> {result.reward_last:.3f}, "
        f"eval {result.eval_reward:.3f} ({time.perf_counter() - t0:.0f} s in all; load "
        f"{load:.1f})",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    return result


def main(
    script: Path, sizes: ReverseSizes, out: Path, repeats: int, trl_threads: Sequence[int]
) -> dict[str, Any]:
    """Warm up once, then ``repeats`` rounds of (TRL at each of ``trl_threads``, asyncflow
    run), interleaved; print the table and return the JSON report (also written to
    ``OUT/reverse/results.json``). The ratio is against the faster TRL configuration (by
    median samples/s)."""
    cfg = sizes.run_config()
    t0 = time.perf_counter()
    prepare(sizes, out)
    warm = json.loads((out / "reverse" / "warm.json").read_text())
    print(f"  warmed up once in {warm['warmup_s']:.1f} s", file=sys.stderr, flush=True)
    keys = [*(f"trl-{t}t" for t in trl_threads), "af_default"]
    runs: dict[str, list[ReverseResult]] = {k: [] for k in keys}
    for r in range(repeats):
        for t in trl_threads:
            runs[f"trl-{t}t"].append(_one(script, "trl", replace(sizes, trl_threads=t), out, r))
        runs["af_default"].append(_one(script, "af_default", sizes, out, r))
    for rs in runs.values():
        for res in rs:
            if res.start_sha256 != warm["sha256"]:
                raise SystemExit(f"{res.side} [{res.repeat}] did not start from warm.pt")
    batch = cfg.rl.prompts_per_step * cfg.rl.n
    table = {}
    for side, rs in runs.items():
        rates = [x.samples_per_s for x in rs]
        table[side] = {
            "samples_per_s": statistics.median(rates),
            "samples_per_s_all": [round(x, 2) for x in rates],
            "wall_s": statistics.median(x.wall_s for x in rs),
            "reward_first": statistics.median(x.reward_first for x in rs),
            "reward_last": statistics.median(x.reward_last for x in rs),
            "eval_reward": statistics.median(x.eval_reward for x in rs),
            "eval_reward_all": [round(x.eval_reward, 4) for x in rs],
            "eval_exact": statistics.median(x.eval_exact for x in rs),
            "threads": rs[0].threads,
            "runs": [asdict(x) for x in rs],
        }
    best = max((k for k in keys if k.startswith("trl")), key=lambda k: table[k]["samples_per_s"])
    per = [
        round(a.samples_per_s / b.samples_per_s, 4)
        for a, b in zip(runs["af_default"], runs[best], strict=True)
        if b.samples_per_s > 0
    ]
    ratio = table["af_default"]["samples_per_s"] / table[best]["samples_per_s"]
    print(
        f"== GRPO on {cfg.task.name}-{cfg.task.digits}, the main job's task: {cfg.rl.steps} steps "
        f"x {batch} samples ({cfg.rl.prompts_per_step} prompts x {cfg.rl.n}), {repeats} "
        "repeats interleaved =="
    )
    header = (
        f"{'run':<26} {'samples/s':>9} {'[min-max]':>15} {'wall s':>7} {'reward 1st':>10} "
        f"{'last 10%':>8} {'eval':>6} {'exact':>6}"
    )
    print(header)
    print("-" * len(header))
    for side, row in table.items():
        all_ = row["samples_per_s_all"]
        print(
            f"{_label(side):<26} {row['samples_per_s']:>9.1f} "
            f"{f'[{min(all_):.1f}-{max(all_):.1f}]':>15} {row['wall_s']:>7.1f} "
            f"{row['reward_first']:>10.3f} {row['reward_last']:>8.3f} {row['eval_reward']:>6.3f} "
            f"{row['eval_exact']:>6.3f}"
        )
    print(
        f"asyncflow run (default) / TRL ({_label(best)}, the faster): samples/s {ratio:.2f}x "
        f"(per repeat {', '.join(f'{x:.2f}' for x in per)}; goal > 1), final reward "
        f"{table['af_default']['eval_reward']:.3f} vs {table[best]['eval_reward']:.3f}"
    )
    report = {
        "samples_per_s_ratio": round(ratio, 4),
        "samples_per_s_ratio_per_repeat": per,
        "samples_per_s_asyncflow": round(table["af_default"]["samples_per_s"], 2),
        "samples_per_s_trl": round(table[best]["samples_per_s"], 2),
        "trl_best": best,
        "reward_asyncflow": round(table["af_default"]["eval_reward"], 4),
        "reward_trl": round(table[best]["eval_reward"], 4),
        "repeats": repeats,
        "config": {"sets": sizes.sets(), "trl_threads": list(trl_threads),
                   "steps": cfg.rl.steps, "prompts_per_step": cfg.rl.prompts_per_step,
                   "n": cfg.rl.n, "lr": cfg.train.lr, "max_tokens": cfg.task_spec().max_tokens},
        "warm": warm,
        "sides": table,
        "total_s": round(time.perf_counter() - t0, 1),
    }  # fmt: skip
    (out / "reverse" / "results.json").write_text(json.dumps(report, indent=1))
    return report


def sizes_from(quick: bool, steps: int | None) -> ReverseSizes:
    sizes = QUICK_REVERSE if quick else ReverseSizes()
    if steps is not None:
        sizes = replace(sizes, steps=steps)
    return sizes


__all__ = [
    "QUICK_REVERSE",
    "ReverseResult",
    "ReverseSizes",
    "child",
    "digits_config_class",
    "digits_model_class",
    "digits_tokenizer",
    "main",
    "prepare",
    "sizes_from",
    "state_hash",
    "wrap",
]
