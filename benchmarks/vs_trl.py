"""Peer benchmark (issue #19, part 3): the same GRPO workload through Hugging Face TRL's
``GRPOTrainer`` and through AsyncFlow (async, and colocated), in one run, interleaved.

The workload (identical for every framework):

* **Model**: one tiny Qwen2 (hidden 128, 2 layers, random init from ``--seed``) given a
  supervised warm-up once, before any run (``_supervised_warmup``: correct solutions, label
  smoothing 0.05, so the policy knows more than it samples at temperature 1); every run
  starts from that folder (``from_pretrained``), with the same tokenizer (trained here,
  chat template included).
* **Data**: chained word problems in GSM8K format (``chain_problem``): a start value, then k
  operations, one sentence each; the answer is one ``a+b=c`` line per operation, then
  ``#### N``. k is long-tailed (P(k) ∝ k^-1.5 on 1..``k_max``), so prompt and response
  lengths are long-tailed the way reasoning traces are, and the lengths come from the model
  itself (one line per operation as it learned in the warm-up, or more when it loses track:
  ``max_tokens`` truncates).
* **Reward**: ``asyncflow_hf.reward.math_reward`` (1 if the final number is right), on the
  completion decoded with ``skip_special_tokens=True``.
* **RL recipe**: GRPO, group ``n`` = 8, 16 prompts per step (128 samples per optimizer
  step), the same prompts in the same order (TRL's ``shuffle_dataset=False``), one
  optimizer step per generated batch, PPO-clip ε = 0.2, no KL, group advantages normalised
  by the group's std, the loss averaged over every response token of the step (TRL's
  ``loss_type="dapo"``, AsyncFlow's ``aggregation="token-mean"``), AdamW with a constant
  learning rate, grad-norm clipping 1.0, fp32, temperature 1 with no top-k/p, 160 tokens max.

The frameworks:

* ``trl``: ``trl.GRPOTrainer`` on CPU in its best CPU configuration (measured: see
  docs/vs-trl.md): generation with transformers' continuous batching
  (``use_transformers_continuous_batching=True``) sized like AsyncFlow's engine, no gradient
  checkpointing, fp32, 2 torch threads.
* ``af_async``: AsyncFlow's default: ``RLJob`` with η = 1, staged weight sync,
  ``HFInferenceEngine`` (transformers' continuous batching under AsyncFlow's sampler) on one
  core and ``HFTrainEngine`` on the other (one torch thread each), all in one process.
* ``af_colocated``: ``RLJob(mode="colocated")``: rollout and training take turns, each
  with both cores (2 threads), η = 0, blocking sync: AsyncFlow's synchronous baseline.

Each run is a fresh interpreter; the frameworks run in turn (trl, af_async, af_colocated),
``--repeats`` times. Reported per framework (median run, min–max): trained samples per
second of the RL phase; wall time until the policy's held-out reward first reaches
``--threshold`` (snapshots of the weights every ``eval_every`` steps, evaluated after the run
by one evaluator for every framework: temperature 1, one sample per held-out problem); the
final reward (the last snapshot, i.e. the trained policy, by the same evaluator). Ratios are
AsyncFlow / TRL. The last stdout line is one JSON object. The write-up with the measured
figures: ``docs/vs-trl.md``.

    python benchmarks/vs_trl.py --out runs/vs-trl   # the full comparison (about 30 minutes)
    python benchmarks/vs_trl.py --quick             # tiny sizes: checks that it runs

``--task reverse`` (issue #23, item 5) is another row: the default ``asyncflow run`` against
TRL's ``GRPOTrainer`` on the main job's own task (reverse-3, the reference ``TransformerLM``),
from the same warmed-up weights and prompt stream (``benchmarks/vs_trl_reverse.py``; the
last stdout line's ``default_vs_trl_reverse``). About 3 minutes on a quiet box with
``--trl-threads 1``; 15 with TRL at both 1 and 2 threads under load.

    python benchmarks/vs_trl.py --task reverse --out runs/vs-trl-reverse
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "adapters")]

GOAL_SAMPLES_RATIO = 1.5
GOAL_TIME_RATIO = 0.7
FRAMEWORKS = ("trl", "af_async", "af_colocated")
LABELS = {
    "trl": "TRL GRPOTrainer",
    "af_async": "AsyncFlow async",
    "af_colocated": "AsyncFlow colocated",
}

# --------------------------------------------------------------------------------------------
# The task: chained word problems in GSM8K format, with long-tailed lengths
# --------------------------------------------------------------------------------------------
NAMES = ("Tom", "Anna", "Sam", "Mia", "Ben", "Lily", "Max", "Zoe")
ITEMS = ("apples", "pencils", "marbles", "cookies", "books", "stickers", "cards", "shells")


def draw_k(rng: random.Random, k_max: int) -> int:
    """The number of operations: P(k) ∝ k^-1.5 on 1..k_max (a long tail)."""
    ks = range(1, k_max + 1)
    return rng.choices(ks, weights=[k**-1.5 for k in ks])[0]


def chain_problem(rng: random.Random, k_max: int, noise: float = 0.0) -> dict[str, Any]:
    """One problem: ``{"question", "answer" (GSM8K: one ``a+b=c`` line per operation, then
    ``#### N``), "k"}``. Values stay in 0..9 (each line is one fact of the single-digit
    table): the difficulty is finding each operation's operand and carrying the running value
    through k lines without a slip. With ``noise`` > 0 each line's result is replaced by a
    wrong digit with that probability (and the slip carried on)."""
    k = draw_k(rng, k_max)
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    value = rng.randrange(0, 10)
    truth = value
    sentences = [f"{name} has {value} {item}."]
    lines = []
    for _ in range(k):
        if truth == 0 or (truth < 9 and rng.random() < 0.5):
            b = rng.randrange(1, 10 - truth)
            verb = rng.choice((f"buys {b} more", f"finds {b} more"))
            truth, op, result = truth + b, "+", value + b
        else:
            b = rng.randrange(1, truth + 1)
            verb = rng.choice((f"gives {b} to {other}", f"loses {b}"))
            truth, op, result = truth - b, "-", value - b
        if noise and rng.random() < noise:
            result = rng.choice([d for d in range(10) if d != result])
        lines.append(f"{value}{op}{b}={result}")
        value = result if noise else truth
        sentences.append(f"Then {name} {verb}.")
    question = " ".join(sentences) + f" How many {item} does {name} have now?"
    return {"question": question, "answer": "\n".join([*lines, f"#### {value}"]), "k": k}


def problems(n: int, seed: int, k_max: int, noise: float = 0.0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [chain_problem(rng, k_max, noise) for _ in range(n)]


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    """Everything a run needs to know; the same for every framework."""

    seed: int = 0
    rl_seed: int | None = None  # sampling and trainer seeds of the RL runs (default: seed)
    steps: int = 50
    prompts: int = 16  # prompts per optimizer step
    n: int = 8  # samples per prompt (GRPO group)
    max_tokens: int = 160  # response cap (TRL's max_completion_length)
    k_max: int = 16  # longest chain of operations
    lr: float = 3e-4
    micro_batch: int = 32  # rows per forward/backward in training
    clip: float = 0.2
    hidden: int = 128
    layers: int = 2
    warmup_steps: int = 1500  # supervised warm-up steps (once, before every run)
    warmup_batch: int = 64
    warmup_lr: float = 3e-3
    warmup_noise: float = 0.0  # fraction of warm-up lines whose result is wrong
    warmup_smoothing: float = 0.05  # label smoothing: the policy knows more than it samples
    eval_prompts: int = 256  # held-out problems, one sample each at temperature 1
    eval_every: int = 5  # steps between the policy snapshots evaluated after the run
    threshold: float = 0.53
    window: int = 5
    trl_threads: int = 2
    trl_cb: str = "tuned"  # "tuned": the same cache/batch sizes as AsyncFlow's engine; "default"

    @property
    def batch(self) -> int:
        return self.prompts * self.n

    @property
    def run_seed(self) -> int:
        return self.seed if self.rl_seed is None else self.rl_seed

    def model_key(self) -> str:
        """What the warmed-up model folder depends on (a cache key)."""
        keys = (
            "seed",
            "k_max",
            "hidden",
            "layers",
            "warmup_steps",
            "warmup_batch",
            "warmup_lr",
            "warmup_noise",
            "warmup_smoothing",
        )
        text = json.dumps({k: getattr(self, k) for k in keys}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


QUICK = {
    "steps": 3,
    "prompts": 2,
    "n": 4,
    "max_tokens": 24,
    "k_max": 4,
    "micro_batch": 8,
    "warmup_steps": 4,
    "warmup_batch": 8,
    "eval_prompts": 4,
    "eval_every": 2,
    "window": 1,
    "threshold": 0.0,  # reached at the first step: the ratio is defined even untrained
}


# --------------------------------------------------------------------------------------------
# Preparation (once): data, tokenizer, the warmed-up model folder
# --------------------------------------------------------------------------------------------
def prepare(sizes: Sizes, out: Path) -> Path:
    """The run folder's shared inputs: ``data/train.jsonl`` (prompts in the order both
    frameworks use them), ``data/eval.jsonl`` and ``model/`` (tokenizer + the warmed-up
    model), built once and reused while ``sizes.model_key()`` is unchanged."""
    import torch

    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    # AsyncFlow may drop stale groups and take more prompts than steps x prompts (TRL never does)
    need = 2 * sizes.steps * sizes.prompts + 64
    _write_jsonl(data / "train.jsonl", problems(need, sizes.seed + 1, sizes.k_max))
    _write_jsonl(data / "eval.jsonl", problems(sizes.eval_prompts, sizes.seed + 2, sizes.k_max))
    model_dir = out / "model"
    key = sizes.model_key()
    if (model_dir / "warmup.json").is_file():
        if json.loads((model_dir / "warmup.json").read_text()).get("key") == key:
            return model_dir
        shutil.rmtree(model_dir)
    from asyncflow_hf import build_tokenizer

    corpus = problems(1000, sizes.seed + 3, max(sizes.k_max, 8))
    tokenizer = build_tokenizer(
        [f"user\n{r['question']}\nassistant\n{r['answer']}" for r in corpus]
    )
    torch.manual_seed(sizes.seed)
    model = _tiny_qwen2(sizes, tokenizer)
    t0 = time.perf_counter()
    losses = _supervised_warmup(model, tokenizer, sizes)
    took = time.perf_counter() - t0
    staging = Path(tempfile.mkdtemp(dir=out, prefix=".model."))
    model.save_pretrained(str(staging))
    tokenizer.save_pretrained(str(staging))
    (staging / "warmup.json").write_text(
        json.dumps({"key": key, "seconds": round(took, 1), "losses": losses, **asdict(sizes)})
    )
    os.replace(staging, model_dir)
    return model_dir


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _tiny_qwen2(sizes: Sizes, tokenizer: Any) -> Any:
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=sizes.hidden,
        intermediate_size=2 * sizes.hidden,
        num_hidden_layers=sizes.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    # ids only: no sampling defaults that would change either framework's sampling
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def _supervised_warmup(model: Any, tokenizer: Any, sizes: Sizes) -> list[float]:
    """Teacher-forced cross-entropy on correct solutions (its own problems, not the RL or
    eval prompts): the model learns the answer's shape (one line per operation, ``#### N``,
    EOS) and some of the arithmetic; RL has to do the rest."""
    import torch
    from asyncflow_hf import render_prompt

    torch.set_num_threads(2)
    rows = problems(
        sizes.warmup_steps * sizes.warmup_batch, sizes.seed + 4, sizes.k_max, sizes.warmup_noise
    )
    pairs = [
        (
            render_prompt(r["question"], tokenizer),
            [
                *tokenizer(r["answer"], add_special_tokens=False)["input_ids"],
                tokenizer.eos_token_id,
            ],
        )
        for r in rows
    ]
    # batches of similar lengths (less padding), in a shuffled order
    b = sizes.warmup_batch
    pairs.sort(key=lambda pa: len(pa[0]) + len(pa[1]))
    batches = [pairs[i * b : (i + 1) * b] for i in range(sizes.warmup_steps)]
    random.Random(sizes.seed).shuffle(batches)
    optimizer = torch.optim.AdamW(model.parameters(), lr=sizes.warmup_lr, weight_decay=0.0)
    model.train()
    losses = []
    for step, batch in enumerate(batches):
        width = max(len(p) + len(a) for p, a in batch)
        ids = torch.full((b, width), tokenizer.pad_token_id)
        labels = torch.full((b, width), -100)
        mask = torch.zeros(b, width, dtype=torch.long)
        for i, (p, a) in enumerate(batch):
            seq = p + a
            ids[i, : len(seq)] = torch.tensor(seq)
            mask[i, : len(seq)] = 1
            labels[i, len(p) : len(seq)] = torch.tensor(a)
        ramp = min(1.0, (step + 1) / 20)
        cosine = 0.5 * (1 + math.cos(math.pi * step / sizes.warmup_steps))
        for group in optimizer.param_groups:
            group["lr"] = sizes.warmup_lr * ramp * cosine
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
            ignore_index=-100, label_smoothing=sizes.warmup_smoothing,
        )  # fmt: skip
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 4))
        if step % 50 == 0 or step == sizes.warmup_steps - 1:
            print(f"  warm-up step {step}: loss {float(loss):.3f}", file=sys.stderr, flush=True)
    model.eval()
    return losses


# --------------------------------------------------------------------------------------------
# What every run reports
# --------------------------------------------------------------------------------------------
@dataclass
class RunResult:
    framework: str
    repeat: int
    threads: str
    wall_s: float  # RL phase: start of training to the end of the last optimizer step
    steps: int
    samples: int  # trained samples
    tokens: int  # trained response tokens
    step_end_s: list[float]  # per optimizer step, seconds since the RL phase began
    step_reward: list[float]  # per optimizer step, mean reward of the samples it trained on
    response_lengths: list[int]  # every scored sample
    prompt_lengths: list[int]
    eval_s: list[float]  # when each evaluated snapshot was taken (seconds of RL)
    eval_step: list[int]
    eval_curve: list[float]  # held-out reward of each snapshot; the last is the final policy
    eval_lengths: list[int]  # response lengths of the final policy's evaluation
    profile: dict[str, Any] = field(default_factory=dict)

    @property
    def eval_reward(self) -> float:
        return self.eval_curve[-1]

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    def smoothed(self, window: int) -> list[float]:
        r = self.step_reward
        return [statistics.fmean(r[max(0, i + 1 - window) : i + 1]) for i in range(len(r))]

    def time_to(self, threshold: float) -> float | None:
        """Seconds of RL until the first snapshot whose held-out reward reaches
        ``threshold`` (None if none does)."""
        for t, r in zip(self.eval_s, self.eval_curve, strict=True):
            if r >= threshold:
                return t
        return None

    def train_time_to(self, threshold: float, window: int) -> float | None:
        """Seconds until the moving average of the *training* reward first reaches
        ``threshold`` (biased for AsyncFlow async, whose first batches are its fastest,
        i.e. shortest, groups: reported, not used for the ratio)."""
        for t, r in zip(self.step_end_s, self.smoothed(window), strict=True):
            if r >= threshold:
                return t
        return None

    def reward_last(self) -> float:
        """Mean training reward over the last 10% of steps (at least one)."""
        k = max(1, len(self.step_reward) // 10)
        return statistics.fmean(self.step_reward[-k:])


class ForwardMeter:
    """Counts a generation model's forwards (transformers' continuous batching packs every
    running request into one ``[1, tokens]`` forward) and the tokens of each: the decode
    batch's occupancy, which the long tail of response lengths empties. Forwards with
    gradients enabled (training) are not counted."""

    def __init__(self, model: Any) -> None:
        import torch

        self.tokens: list[int] = []
        self.seconds = 0.0
        self._t0 = 0.0
        self._torch = torch
        self._hooks = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True),
            model.register_forward_hook(self._post, with_kwargs=True),
        ]

    def stop(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def _pre(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if self._torch.is_grad_enabled():
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self.tokens.append(int(ids.numel()))
            self._t0 = time.perf_counter()

    def _post(self, module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if not self._torch.is_grad_enabled() and self._t0:
            self.seconds += time.perf_counter() - self._t0
            self._t0 = 0.0

    def summary(self) -> dict[str, Any]:
        t = self.tokens
        return {
            "forwards": len(t),
            "forward_s": round(self.seconds, 3),
            "tokens_per_forward_mean": round(statistics.fmean(t), 2) if t else 0.0,
            "tokens_per_forward_median": statistics.median(t) if t else 0,
            "forwards_with_at_most_8_tokens": sum(1 for x in t if x <= 8),
        }


def _rows(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return _read_jsonl(path / "data" / "train.jsonl"), _read_jsonl(path / "data" / "eval.jsonl")


def evaluate(
    model: Any, tokenizer: Any, rows: list[dict[str, Any]], sizes: Sizes
) -> tuple[float, list[int]]:
    """The policy's mean reward on held-out ``rows``, one sample each at temperature 1
    (transformers' ``generate``, left-padded batches of similar prompt lengths, a fixed
    seed): the same code for every framework's snapshots."""
    import torch
    from asyncflow_hf import math_reward, render_prompt

    model.eval()
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["question"]))
    rows = [rows[i] for i in order]
    prompts = [render_prompt(r["question"], tokenizer) for r in rows]
    scores: list[float] = []
    lengths: list[int] = []
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(sizes.seed + 5)
        for start in range(0, len(prompts), 64):
            chunk = prompts[start : start + 64]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), pad)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for i, p in enumerate(chunk):
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=sizes.max_tokens,
                do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                eos_token_id=eos, pad_token_id=pad,
            )  # fmt: skip
            for i, row in enumerate(rows[start : start + 64]):
                gen = out[i, width:].tolist()
                if eos in gen:
                    gen = gen[: gen.index(eos) + 1]
                lengths.append(len(gen))
                text = tokenizer.decode(gen, skip_special_tokens=True)
                scores.append(float(math_reward(text, row)))
    return statistics.fmean(scores), lengths


class Snapshots:
    """Copies of the policy's weights every ``every`` optimizer steps and after the last one,
    with the RL time they were taken at; evaluated after the run (outside the timing)."""

    def __init__(self, every: int, last: int) -> None:
        self.every, self.last = every, last
        self.taken: list[tuple[float, int, dict[str, Any]]] = []

    def maybe(self, model: Any, step: int, t: float) -> None:
        if step % self.every == 0 or step == self.last:
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            self.taken.append((t, step, state))

    def evaluate(
        self, model: Any, tokenizer: Any, rows: list[dict[str, Any]], sizes: Sizes
    ) -> tuple[list[float], list[int], list[float], list[int]]:
        times, steps, curve, lengths = [], [], [], []
        for t, step, state in self.taken:
            model.load_state_dict(state)
            reward, lengths = evaluate(model, tokenizer, rows, sizes)
            times.append(round(t, 3))
            steps.append(step)
            curve.append(reward)
        return times, steps, curve, lengths


# --------------------------------------------------------------------------------------------
# TRL
# --------------------------------------------------------------------------------------------
def run_trl(sizes: Sizes, out: Path, repeat: int) -> RunResult:
    import torch

    torch.set_num_threads(sizes.trl_threads)
    import datasets
    import transformers
    import trl

    model_dir = out / "model"
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    train_rows, eval_rows = _rows(out)
    dataset = datasets.Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]}
            for r in train_rows
        ]
    )
    from asyncflow_hf import math_reward

    scored: list[tuple[int, int, float]] = []  # (prompt tokens, response tokens, reward)

    def reward(
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]],
        answer: list[str],
        **_: Any,
    ) -> list[float]:
        out_ = []
        for c, ids, a in zip(completions, completion_ids, answer, strict=True):
            text = c[0]["content"] if isinstance(c, list) else c
            r = float(math_reward(text, {"answer": a}))
            out_.append(r)
            scored.append((0, len(ids), r))
        return out_

    cb_config: dict[str, Any] = {}
    if sizes.trl_cb == "tuned":
        # the same paged-cache geometry as AsyncFlow's engine below (no prefix-sharing
        # override: TRL builds a fresh manager per generation, so sharing is safe there)
        cb_config = {
            "page_size": 64,
            "max_batch_tokens": 512,
            "max_requests_per_batch": sizes.batch,
            "num_blocks": sizes.batch * math.ceil(512 / 64) + 1,
        }
    args = trl.GRPOConfig(
        output_dir=str(out / "runs" / f"trl-{repeat}" / "trainer"),
        # the workload
        max_steps=sizes.steps,
        per_device_train_batch_size=sizes.micro_batch,
        gradient_accumulation_steps=sizes.batch // sizes.micro_batch,
        num_generations=sizes.n,
        max_completion_length=sizes.max_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=sizes.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        beta=0.0,
        epsilon=sizes.clip,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        shuffle_dataset=False,
        seed=sizes.run_seed,
        # its best CPU configuration
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_transformers_continuous_batching=True,
        transformers_continuous_batching_config=cb_config or None,
        # no side work
        logging_steps=max(sizes.steps, 1),  # rewards are read from the reward function
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )

    class Clock(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.t0 = 0.0
            self.ends: list[float] = []
            self.rewards_seen = 0
            self.step_rewards: list[float] = []

        def on_train_begin(self, *a: Any, **k: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **k: Any) -> None:
            self.ends.append(time.perf_counter() - self.t0)
            snapshots.maybe(k["model"], state.global_step, self.ends[-1])
            new = scored[self.rewards_seen :]
            self.rewards_seen = len(scored)
            self.step_rewards.append(statistics.fmean(r for _, _, r in new) if new else math.nan)

    gen_seconds: list[float] = []

    padding = {"padded": 0, "real": 0}
    first_prompt_ids: list[list[int]] = []

    class Trainer(trl.GRPOTrainer):  # type: ignore[misc]
        """GRPOTrainer, timing its generation phase and counting the tokens its loss forwards
        (padding included); nothing else changed."""

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

        def _compute_loss(self, model: Any, inputs: Any) -> Any:
            padding["padded"] += inputs["prompt_ids"].numel() + inputs["completion_ids"].numel()
            padding["real"] += int(inputs["prompt_mask"].sum()) + int(
                inputs["completion_mask"].sum()
            )
            return super()._compute_loss(model, inputs)

    snapshots = Snapshots(sizes.eval_every, sizes.steps)
    clock = Clock()
    trainer = Trainer(
        model=model, reward_funcs=[reward], args=args, train_dataset=dataset,
        processing_class=tokenizer, callbacks=[clock],
    )  # fmt: skip
    meter = ForwardMeter(trainer.model)
    trainer.train()
    wall = clock.ends[-1]
    decode = meter.summary()  # before the evaluation, whose forwards are not rollout
    meter.stop()
    ev_s, ev_step, ev_curve, ev_lengths = snapshots.evaluate(
        trainer.model, tokenizer, eval_rows, sizes
    )
    from asyncflow_hf import render_prompt  # the chat template, as TRL applies it

    rendered = [render_prompt(r["question"], tokenizer) for r in train_rows]
    prompt_lengths = [len(p) for p in rendered[: sizes.steps * sizes.prompts]]
    # the token ids TRL generated from are the ones AsyncFlow's runs get
    same_prompts = first_prompt_ids == [
        p for p in rendered[: sizes.prompts] for _ in range(sizes.n)
    ]
    return RunResult(
        framework="trl", repeat=repeat, threads=str(sizes.trl_threads), wall_s=wall,
        steps=len(clock.ends), samples=len(clock.ends) * sizes.batch,
        tokens=sum(n for _, n, _ in scored[: len(clock.ends) * sizes.batch]),
        step_end_s=clock.ends, step_reward=clock.step_rewards,
        response_lengths=[n for _, n, _ in scored], prompt_lengths=prompt_lengths,
        eval_s=ev_s, eval_step=ev_step, eval_curve=ev_curve, eval_lengths=ev_lengths,
        profile={
            "generate_s": round(sum(gen_seconds), 3),
            "train_s": round(wall - sum(gen_seconds), 3),
            "generation_share": round(sum(gen_seconds) / wall, 4) if wall else None,
            "first_batch_prompt_ids_equal_asyncflow": same_prompts,
            "train_tokens_padded": padding["padded"],
            "train_tokens_real": padding["real"],
            "decode": decode,
        },
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# AsyncFlow
# --------------------------------------------------------------------------------------------
def run_asyncflow(sizes: Sizes, out: Path, repeat: int, mode: str) -> RunResult:
    import torch

    colocated = mode == "colocated"
    threads = 2 if colocated else 1
    torch.set_num_threads(threads)
    import transformers
    from asyncflow_hf import HFInferenceEngine, HFTrainEngine, math_reward, render_prompt

    from asyncflow_core.contracts.protocols import SamplingParams
    from asyncflow_core.flow.rlflow import RLConfig, RLEngines, RLJob
    from asyncflow_core.observability.trace import Tracer
    from asyncflow_core.training.rl import PPOClipLoss

    model_dir = out / "model"
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    train_rows, eval_rows = _rows(out)
    prompts = [render_prompt(r["question"], tokenizer) for r in train_rows]
    answer = {tuple(p): r for p, r in zip(prompts, train_rows, strict=True)}
    scored: list[tuple[int, int, float]] = []

    def reward(prompt: Sequence[int], response: Sequence[int]) -> float:
        text = tokenizer.decode(list(response), skip_special_tokens=True)
        r = float(math_reward(text, answer[tuple(prompt)]))
        scored.append((len(prompt), len(response), r))
        return r

    engine = HFInferenceEngine(
        str(model_dir), tokenizer=tokenizer, max_batch=sizes.batch, max_model_len=512,
        page_size=64, max_batch_tokens=512, seed=sizes.run_seed, threads=threads,
        name="rollout-0",
    )  # fmt: skip
    meter = ForwardMeter(engine.model)
    trainer = HFTrainEngine(
        str(model_dir), lr=sizes.lr, weight_decay=0.0, max_grad_norm=1.0,
        micro_batch_size=sizes.micro_batch, seed=sizes.run_seed, threads=threads,
    )  # fmt: skip
    padding = {"padded": 0, "real": 0}
    forward = trainer._response_logprobs

    def counted(rows: Any) -> Any:  # instrumentation only: the tokens a training forward sees
        if torch.is_grad_enabled():
            padding["padded"] += int(rows.response.shape[0]) * int((rows.plen + rows.rlen).max())
            padding["real"] += rows.tokens
        return forward(rows)

    trainer._response_logprobs = counted  # type: ignore[method-assign]
    config = RLConfig(
        steps=sizes.steps,
        prompts_per_step=sizes.prompts,
        n=sizes.n,
        mode="colocated" if colocated else "async",
        staleness=0 if colocated else 1,
        weight_sync="blocking" if colocated else "staged",
        sampling=SamplingParams(max_tokens=sizes.max_tokens, temperature=1.0, top_k=0, top_p=1.0),
    )
    tracer = Tracer()
    snapshots = Snapshots(sizes.eval_every, sizes.steps)

    def on_step(record: Any) -> None:  # the trainer is idle between its update calls
        snapshots.maybe(trainer.model, record.version, record.end_s)

    job = RLJob(
        config, RLEngines([engine], trainer), prompts, reward,
        loss_fn=PPOClipLoss(clip_low=sizes.clip), tracer=tracer, on_step=on_step,
    )  # fmt: skip

    async def go() -> Any:
        try:
            return await job.run()
        finally:
            await engine.close()

    result = asyncio.run(go())
    run_dir = out / "runs" / f"af_{mode}-{repeat}"
    run_dir.mkdir(parents=True, exist_ok=True)
    tracer.write_chrome_trace(run_dir / "trace.json")
    summary = tracer.summary()
    # the snapshots, evaluated by the same code as TRL's
    policy = trainer.model
    asyncio.run(trainer.close())
    ev_s, ev_step, ev_curve, ev_lengths = snapshots.evaluate(policy, tokenizer, eval_rows, sizes)
    steps = list(result.steps)
    resources = {
        name: {"busy_s": round(r["busy_s"], 3), "bubble_ratio": round(r["bubble_ratio"], 4)}
        for name, r in summary["resources"].items()
    }
    return RunResult(
        framework=f"af_{mode}", repeat=repeat, threads=str(threads), wall_s=steps[-1].end_s,
        steps=len(steps), samples=sum(s.samples for s in steps),
        tokens=sum(n for _, n, _ in scored), step_end_s=[s.end_s for s in steps],
        step_reward=[s.reward_mean for s in steps],
        response_lengths=[n for _, n, _ in scored],
        prompt_lengths=[len(p) for p in prompts[: result.generated // sizes.n]],
        eval_s=ev_s, eval_step=ev_step, eval_curve=ev_curve, eval_lengths=ev_lengths,
        profile={
            "generated": result.generated,
            "dropped": result.dropped,
            "max_staleness": result.max_staleness,
            "resources": resources,
            "sync": {k: round(v, 3) for k, v in summary["sync"].items() if k != "phases"},
            "train_tokens_padded": padding["padded"],
            "train_tokens_real": padding["real"],
            "decode": meter.summary(),
        },
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------------
def _child(framework: str, sizes_json: str, out: str, repeat: int) -> int:
    if framework.startswith("reverse:"):  # a run of the --task reverse row
        import vs_trl_reverse

        return vs_trl_reverse.child(framework.removeprefix("reverse:"), sizes_json, out, repeat)
    sizes = Sizes(**json.loads(sizes_json))
    path = Path(out)
    if framework == "trl":
        result = run_trl(sizes, path, repeat)
    else:
        result = run_asyncflow(sizes, path, repeat, framework.removeprefix("af_"))
    print(json.dumps(asdict(result)))
    return 0


def _run(framework: str, sizes: Sizes, out: Path, repeat: int, total: int) -> RunResult:
    """One run in a fresh interpreter (no run inherits another's threads or allocator)."""
    label = f"{LABELS[framework]} [{repeat + 1}/{total}]"
    print(f"  running {label} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--one", framework, json.dumps(asdict(sizes)), str(out),
         str(repeat)],
        capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"run {label!r} failed:\n{proc.stderr[-4000:]}")
    result = RunResult(**json.loads(proc.stdout.strip().splitlines()[-1]))
    run_dir = out / "runs" / f"{framework}-{repeat}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "result.json").write_text(json.dumps(asdict(result)))
    print(
        f"  {label}: {result.samples_per_s:.1f} samples/s, wall {result.wall_s:.1f} s, reward "
        f"{result.step_reward[0]:.3f} -> {result.reward_last():.3f}, eval {result.eval_reward:.3f} "
        f"({time.perf_counter() - t0:.0f} s with start-up and eval; load {os.getloadavg()[0]:.1f})",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    return result


def _median_run(runs: list[RunResult]) -> RunResult:
    ordered = sorted(runs, key=lambda r: r.samples_per_s)
    return ordered[(len(ordered) - 1) // 2]


def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    if len(vals) < len(xs) or not vals:
        return None  # a run that never reached the threshold makes the median undefined
    return statistics.median(vals)


def _histogram(lengths: Sequence[int], edges: Sequence[int]) -> list[int]:
    counts = [0] * (len(edges) - 1)
    for n in lengths:
        for i in range(len(edges) - 1):
            if edges[i] <= n < edges[i + 1] or (i == len(edges) - 2 and n >= edges[-1]):
                counts[i] += 1
                break
    return counts


def _plots(runs: dict[str, list[RunResult]], sizes: Sizes, out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    bins = list(range(0, sizes.max_tokens + 9, 8))
    for fw, rs in runs.items():
        lengths = [n for r in rs for n in r.response_lengths]
        axes[0].hist(
            lengths, bins=bins, histtype="step", linewidth=1.5, label=LABELS[fw], density=True
        )
        prompt = [n for r in rs for n in r.prompt_lengths]
        axes[1].hist(
            prompt,
            bins=range(0, max(prompt) + 9, 8),
            histtype="step",
            linewidth=1.5,
            label=LABELS[fw],
            density=True,
        )
    axes[0].set(
        title="response lengths (every scored sample)",
        xlabel="tokens",
        ylabel="density",
        yscale="log",
    )
    axes[1].set(title="prompt lengths", xlabel="tokens", yscale="log")
    axes[0].legend()
    fig.tight_layout()
    path = out / "vs_trl_lengths.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(str(path))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for i, (fw, rs) in enumerate(runs.items()):
        colour = f"C{i}"
        for j, r in enumerate(rs):
            label = f"{LABELS[fw]}" if j == 0 else None
            axes[0].plot(r.eval_s, r.eval_curve, marker="o", color=colour, alpha=0.8, label=label)
            axes[1].plot(
                r.step_end_s, r.smoothed(sizes.window), color=colour, alpha=0.8, label=label
            )
    for ax in axes:
        ax.axhline(
            sizes.threshold, color="grey", linestyle=":", label=f"threshold {sizes.threshold}"
        )
        ax.set(xlabel="seconds of RL", ylabel="reward")
    axes[0].set(title="held-out reward of policy snapshots (every run)")
    axes[1].set(title=f"training reward, moving average over {sizes.window} steps")
    axes[0].legend()
    fig.tight_layout()
    path = out / "vs_trl_reward.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(str(path))
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, one repeat (a smoke test)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each framework, interleaved"
    )
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run")
    parser.add_argument("--seed", type=int, default=0, help="data, model and warm-up seed")
    parser.add_argument(
        "--rl-seed", type=int, default=None, help="seed of the RL runs' sampling (default: --seed)"
    )
    parser.add_argument(
        "--threshold", type=float, default=None, help="reward for time-to-threshold"
    )
    parser.add_argument("--lr", type=float, default=None, help="RL learning rate (both frameworks)")
    parser.add_argument("--warmup-noise", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--trl-threads", type=int, default=None, help="TRL's torch threads (1 or 2)"
    )
    parser.add_argument(
        "--trl-cb",
        choices=("tuned", "default"),
        default=None,
        help="TRL's continuous-batching config",
    )
    parser.add_argument(
        "--task",
        choices=("chain", "reverse"),
        default="chain",
        help="chain: the GSM8K-style workload on a tiny Qwen2 (TRL, AsyncFlow async and "
        "colocated); reverse: the main job's own task, the default `asyncflow run` against TRL "
        "on the reference model (benchmarks/vs_trl_reverse.py)",
    )
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="comma-separated subset")
    parser.add_argument("--out", default=None, help="output folder (default: a temporary one)")
    parser.add_argument(
        "--prepare-only",
        action="store_true",
        help="build the data and the warmed-up model, then stop",
    )
    parser.add_argument(
        "--one", nargs=4, metavar=("FW", "SIZES", "OUT", "REPEAT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.one:
        fw, sizes_json, out, repeat = args.one
        return _child(fw, sizes_json, out, int(repeat))

    if args.task == "reverse":
        return _main_reverse(args)
    sizes = Sizes(seed=args.seed)
    if args.quick:
        sizes = replace(sizes, **QUICK)
        args.repeats = 1
    for name in ("steps", "threshold", "lr", "rl_seed", "warmup_noise", "trl_threads", "trl_cb"):
        value = getattr(args, name)
        if value is not None:
            sizes = replace(sizes, **{name: value})
    frameworks = [f for f in args.frameworks.split(",") if f]
    unknown = sorted(set(frameworks) - set(FRAMEWORKS))
    if unknown:
        parser.error(f"unknown frameworks {unknown}; choose from {list(FRAMEWORKS)}")
    try:
        import trl  # noqa: F401
    except ImportError:
        print(
            "vs_trl: trl is not installed; install the benchmark extra: "
            ".venv/bin/pip install 'trl>=1.16,<1.17' 'torch==2.13.0'",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="vs-trl-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"vs_trl: output in {out}; load average {os.getloadavg()}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    prepare(sizes, out)
    print(
        f"  prepared data and model in {time.perf_counter() - t0:.0f} s",
        file=sys.stderr,
        flush=True,
    )
    if args.prepare_only:
        return 0

    runs: dict[str, list[RunResult]] = {fw: [] for fw in frameworks}
    loads = []
    for r in range(args.repeats):
        for fw in frameworks:
            loads.append(os.getloadavg()[0])
            runs[fw].append(_run(fw, sizes, out, r, args.repeats))
    report = _report(runs, sizes, out, args, loads, time.perf_counter() - t0)
    print(json.dumps(report))
    return 0


def _main_reverse(args: argparse.Namespace) -> int:
    """``--task reverse``: the default ``asyncflow run`` against TRL on reverse-3 (its own
    options: ``--quick``, ``--repeats``, ``--steps``, ``--trl-threads``, ``--out``)."""
    import vs_trl_reverse

    other = {"seed": 0, "rl_seed": None, "threshold": None, "lr": None, "trl_cb": None}
    changed = sorted(k for k, v in other.items() if getattr(args, k) != v)
    if changed or args.frameworks != ",".join(FRAMEWORKS) or args.prepare_only:
        raise SystemExit(
            f"--task reverse runs the main job's defaults: {changed or 'these options'} apply "
            "to --task chain only (--task reverse takes --quick, --repeats, --steps, "
            "--trl-threads and --out)"
        )
    try:
        import trl  # noqa: F401
    except ImportError:
        print(
            "vs_trl: trl is not installed; install the benchmark extra: "
            ".venv/bin/pip install 'trl>=1.16,<1.17' 'torch==2.13.0'",
            file=sys.stderr,
        )
        return 2
    sizes = vs_trl_reverse.sizes_from(args.quick, args.steps)
    repeats = 1 if args.quick else args.repeats
    # TRL's best CPU configuration: 1 and 2 torch threads are both run (--quick: 2 only)
    trl_threads = (args.trl_threads,) if args.trl_threads else (2,) if args.quick else (1, 2)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="vs-trl-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"vs_trl: output in {out}; load average {os.getloadavg()}", file=sys.stderr, flush=True)
    report = vs_trl_reverse.main(Path(__file__), sizes, out, repeats, trl_threads)
    print(json.dumps({"benchmark": "vs_trl", "task": "reverse", "default_vs_trl_reverse": report}))
    return 0


def _report(
    runs: dict[str, list[RunResult]],
    sizes: Sizes,
    out: Path,
    args: argparse.Namespace,
    loads: list[float],
    total_s: float,
) -> dict[str, Any]:
    thr, win = sizes.threshold, sizes.window
    table = {}
    for fw, rs in runs.items():
        rates = [r.samples_per_s for r in rs]
        times = [r.time_to(thr) for r in rs]
        train_times = [r.train_time_to(thr, win) for r in rs]
        table[fw] = {
            "samples_per_s": statistics.median(rates),
            "samples_per_s_all": [round(x, 2) for x in rates],
            "time_to_threshold_s": _median(times),
            "time_to_threshold_all": [None if t is None else round(t, 1) for t in times],
            "train_reward_time_to_threshold_all": [
                None if t is None else round(t, 1) for t in train_times
            ],
            "eval_curve_median_run": [round(x, 4) for x in _median_run(rs).eval_curve],
            "eval_steps": _median_run(rs).eval_step,
            "wall_s": statistics.median(r.wall_s for r in rs),
            "reward_first": statistics.median(r.step_reward[0] for r in rs),
            "reward_last": statistics.median(r.reward_last() for r in rs),
            "eval_reward": statistics.median(r.eval_reward for r in rs),
            "eval_reward_all": [round(r.eval_reward, 4) for r in rs],
            "response_tokens_mean": statistics.fmean(n for r in rs for n in r.response_lengths),
            "profile": _median_run(rs).profile,
        }
    header = (
        f"{'run':<22} {'samples/s':>9} {'[min-max]':>13} {'t→' + str(thr):>8} {'wall s':>7} "
        f"{'reward 1st':>10} {'last 10%':>8} {'eval':>6} {'resp len':>8}"
    )
    print(
        f"== GRPO on chained word problems: {sizes.steps} steps x {sizes.batch} samples "
        f"({sizes.prompts} prompts x {sizes.n}), max {sizes.max_tokens} tokens, {args.repeats} "
        f"repeats interleaved =="
    )
    print(header)
    print("-" * len(header))
    for fw, row in table.items():
        all_ = row["samples_per_s_all"]
        ttt = row["time_to_threshold_s"]
        spread = f"[{min(all_):.1f}-{max(all_):.1f}]"
        reach = "-" if ttt is None else f"{ttt:.0f} s"
        print(
            f"{LABELS[fw]:<22} {row['samples_per_s']:>9.1f} {spread:>13} {reach:>8} "
            f"{row['wall_s']:>7.1f} {row['reward_first']:>10.3f} {row['reward_last']:>8.3f} "
            f"{row['eval_reward']:>6.3f} {row['response_tokens_mean']:>8.1f}"
        )

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else round(a / b, 4)

    result: dict[str, Any] = {"benchmark": "vs_trl"}
    if "trl" in table:
        base = table["trl"]
        for fw in ("af_async", "af_colocated"):
            if fw not in table:
                continue
            row = table[fw]
            suffix = "" if fw == "af_async" else "_colocated"
            result[f"samples_per_s_ratio{suffix}"] = ratio(
                row["samples_per_s"], base["samples_per_s"]
            )
            result[f"time_to_threshold_ratio{suffix}"] = ratio(
                row["time_to_threshold_s"], base["time_to_threshold_s"]
            )
            # per repeat: the ratio of the runs of the same round (interleaved neighbours)
            per = [
                round(a.samples_per_s / b.samples_per_s, 4)
                for a, b in zip(runs[fw], runs["trl"], strict=True)
            ]
            result[f"samples_per_s_ratio{suffix}_per_repeat"] = per
        result["reward_trl"] = round(base["eval_reward"], 4)
    if "af_async" in table:
        result["reward_asyncflow"] = round(table["af_async"]["eval_reward"], 4)
    if "af_colocated" in table:
        result["reward_asyncflow_colocated"] = round(table["af_colocated"]["eval_reward"], 4)
    if "samples_per_s_ratio" in result:
        s, t = result["samples_per_s_ratio"], result.get("time_to_threshold_ratio")
        print(
            f"AsyncFlow async / TRL: samples/s {s:.2f}x (goal >= {GOAL_SAMPLES_RATIO}x), time to "
            f"reward {thr} {'-' if t is None else f'{t:.2f}x'} (goal <= {GOAL_TIME_RATIO}x), final "
            f"reward {result['reward_asyncflow']:.3f} vs {result['reward_trl']:.3f}"
        )
    edges = [e for e in (0, 16, 32, 48, 64, 96, 128) if e < sizes.max_tokens] + [sizes.max_tokens]
    result.update(
        {
            "goal": {
                "samples_per_s_ratio": GOAL_SAMPLES_RATIO,
                "time_to_threshold_ratio": GOAL_TIME_RATIO,
            },
            "threshold": thr,
            "window": win,
            "repeats": args.repeats,
            "config": asdict(sizes),
            "frameworks": {
                fw: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
                for fw, row in table.items()
            },
            "response_length_histogram": {
                "edges": edges,
                **{
                    fw: _histogram([n for r in rs for n in r.response_lengths], edges)
                    for fw, rs in runs.items()
                },
            },
            "load_average_at_run_start": [round(x, 2) for x in loads],
            "total_s": round(total_s, 1),
            "out": str(out),
            "plots": _plots(runs, sizes, out),
        }
    )
    (out / "results.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    raise SystemExit(main())
