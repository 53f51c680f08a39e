"""What the Hugging Face path needs to run with no download: synthetic arithmetic word problems
in GSM8K format, a tokenizer trained locally with ``tokenizers`` (digits one token each, a
ChatML-like chat template), and a complete local model folder (that tokenizer and a random
tiny model) for tests and the CPU demo."""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from asyncflow_core.contracts.errors import ConfigError
from asyncflow_core.engines.enginekit import is_int, require_module
from asyncflow_hf.compat import INSTALL, require_transformers
from asyncflow_hf.models import load_causal_lm, tiny_config

__all__ = [
    "BOS",
    "CHAT_TEMPLATE",
    "EOS",
    "IM_START",
    "PAD",
    "build_tokenizer",
    "gsm8k_rows",
    "make_model_folder",
    "tokenizer_corpus",
    "write_gsm8k_jsonl",
]

# --------------------------------------------------------------------------------------------
# Synthetic GSM8K-format word problems
# --------------------------------------------------------------------------------------------
NAMES = ("Tom", "Anna", "Sam", "Mia", "Ben", "Lily", "Max", "Zoe")
ITEMS = ("apples", "pencils", "marbles", "cookies", "books", "stickers", "cards", "shells")
DIFFICULTIES = (1, 2, 3)
"""1: one addition or subtraction; 2: one of + - * /; 3: two operations."""

Problem = tuple[str, list[str], int]  # question, reasoning lines, answer
Template = Callable[[random.Random, int], Problem]


def _operand(rng: random.Random, top: int, low: int = 2) -> int:
    return rng.randrange(low, max(low + 1, top))


def _people(rng: random.Random) -> tuple[str, str, str]:
    name, other = rng.sample(NAMES, 2)
    return name, other, rng.choice(ITEMS)


def _add_buy(rng: random.Random, top: int) -> Problem:
    n, _, item = _people(rng)
    a, b = _operand(rng, top), _operand(rng, top)
    q = f"{n} has {a} {item} and buys {b} more. How many {item} does {n} have now?"
    return q, [f"{n} has {a} + {b} = {a + b} {item}."], a + b


def _add_find(rng: random.Random, top: int) -> Problem:
    n, m, item = _people(rng)
    a, b = _operand(rng, top), _operand(rng, top)
    q = f"{n} has {a} {item}. {m} gives {n} {b} more. How many {item} does {n} have?"
    return q, [f"{n} has {a} + {b} = {a + b} {item}."], a + b


def _sub_give(rng: random.Random, top: int) -> Problem:
    n, m, item = _people(rng)
    b = _operand(rng, top - 2)
    a = _operand(rng, top, low=b + 2)
    q = f"{n} has {a} {item} and gives {b} to {m}. How many {item} does {n} have left?"
    return q, [f"{n} has {a} - {b} = {a - b} {item} left."], a - b


def _sub_lose(rng: random.Random, top: int) -> Problem:
    n, _, item = _people(rng)
    b = _operand(rng, top - 2)
    a = _operand(rng, top, low=b + 2)
    q = f"{n} had {a} {item} and lost {b} of them. How many {item} does {n} have left?"
    return q, [f"{n} has {a} - {b} = {a - b} {item} left."], a - b


def _mul_boxes(rng: random.Random, top: int) -> Problem:
    n, _, item = _people(rng)
    a, b = _operand(rng, min(top, 10)), _operand(rng, min(top, 10))
    q = f"{n} has {a} boxes with {b} {item} in each box. How many {item} does {n} have?"
    return q, [f"{n} has {a} * {b} = {a * b} {item}."], a * b


def _div_share(rng: random.Random, top: int) -> Problem:
    n, _, item = _people(rng)
    friends, each = _operand(rng, min(top, 10)), _operand(rng, min(top, 10))
    total = friends * each
    q = (
        f"{n} shares {total} {item} equally among {friends} friends. "
        f"How many {item} does each friend get?"
    )
    return q, [f"Each friend gets {total} / {friends} = {each} {item}."], each


def _buy_then_give(rng: random.Random, top: int) -> Problem:
    n, m, item = _people(rng)
    a, b = _operand(rng, top), _operand(rng, top)
    c = _operand(rng, a + b - 1)
    q = (
        f"{n} has {a} {item}. {n} buys {b} more and then gives {c} to {m}. "
        f"How many {item} does {n} have left?"
    )
    steps = [
        f"After buying, {n} has {a} + {b} = {a + b} {item}.",
        f"After giving, {n} has {a + b} - {c} = {a + b - c} {item} left.",
    ]
    return q, steps, a + b - c


def _boxes_plus(rng: random.Random, top: int) -> Problem:
    n, _, item = _people(rng)
    a, b = _operand(rng, min(top, 10)), _operand(rng, min(top, 10))
    c = _operand(rng, top)
    q = (
        f"{n} has {a} boxes with {b} {item} in each box and {c} more {item}. "
        f"How many {item} does {n} have?"
    )
    steps = [
        f"The boxes hold {a} * {b} = {a * b} {item}.",
        f"{n} has {a * b} + {c} = {a * b + c} {item}.",
    ]
    return q, steps, a * b + c


TEMPLATES: dict[int, tuple[Template, ...]] = {
    1: (_add_buy, _add_find, _sub_give, _sub_lose),
    2: (_add_buy, _add_find, _sub_give, _sub_lose, _mul_boxes, _div_share),
    3: (_buy_then_give, _boxes_plus),
}


def _check_generator_args(n: int, seed: int, difficulty: int, max_number: int) -> None:
    if not is_int(n) or n < 0:
        raise ConfigError(f"gsm8k: n must be an int >= 0 (the number of rows), got {n!r}")
    if not is_int(seed):
        raise ConfigError(f"gsm8k: seed must be an int, got {seed!r}")
    if difficulty not in DIFFICULTIES:
        raise ConfigError(
            f"gsm8k: difficulty must be one of {list(DIFFICULTIES)} (1: one addition or "
            f"subtraction, 2: one of + - * /, 3: two operations), got {difficulty!r}"
        )
    if not is_int(max_number) or max_number < 5:
        raise ConfigError(
            f"gsm8k: max_number must be an int >= 5 (operands are below it), got {max_number!r}"
        )


def gsm8k_rows(
    n: int, *, seed: int = 0, difficulty: int = 1, max_number: int = 20
) -> list[dict[str, str]]:
    """``n`` word problems in GSM8K format, ``{"question": ..., "answer": "reasoning\\n#### 42"}``,
    the same for the same arguments. Operands are in ``[2, max_number)`` (factors below 10);
    answers are positive integers. ``difficulty``: 1 one addition or subtraction, 2 one of
    ``+ - * /``, 3 two operations."""
    _check_generator_args(n, seed, difficulty, max_number)
    rng = random.Random(seed)
    templates = TEMPLATES[difficulty]
    rows = []
    for _ in range(n):
        question, steps, answer = rng.choice(templates)(rng, max_number)
        rows.append({"question": question, "answer": "\n".join([*steps, f"#### {answer}"])})
    return rows


def write_gsm8k_jsonl(
    path: str | Path, n: int, seed: int = 0, *, difficulty: int = 1, max_number: int = 20
) -> Path:
    """Write ``gsm8k_rows(n, ...)`` to ``path`` as JSON lines (atomically: a reader never sees
    half a file) and return the path."""
    rows = gsm8k_rows(n, seed=seed, difficulty=difficulty, max_number=max_number)
    target = Path(path).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 is for secrets; this is plain data
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


# --------------------------------------------------------------------------------------------
# A tokenizer trained here
# --------------------------------------------------------------------------------------------
PAD = "<|endoftext|>"
"""Padding, and the unknown token (byte-level BPE never emits it; Qwen2Tokenizer needs one)."""
BOS = "<|startoftext|>"
IM_START = "<|im_start|>"
EOS = "<|im_end|>"
"""The end of a chat turn is the end of a generation (as in ChatML models)."""
SPECIAL_TOKENS = (PAD, BOS, IM_START, EOS)  # ids 0..3 in this order

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML-like: each turn is ``<|im_start|>role\\ncontent<|im_end|>\\n``, after one BOS; the
generation prompt opens an assistant turn, which the model ends with EOS (``<|im_end|>``)."""

DEFAULT_VOCAB_SIZE = 512
"""An upper bound: on the default corpus training runs out of pairs to merge earlier (every
word of the generator is then one token)."""


def tokenizer_corpus() -> list[str]:
    """Texts the default tokenizer is trained on: problems of every difficulty, rendered as
    chat turns, so every word of the generator is one token (digits are always one each)."""
    texts = ["system", "You are a helpful assistant. Answer with #### and the number."]
    for difficulty in DIFFICULTIES:
        for row in gsm8k_rows(300, seed=1000 + difficulty, difficulty=difficulty):
            texts.append(f"user\n{row['question']}\nassistant\n{row['answer']}")
    return texts


def _pretokenize_regex() -> str:
    from transformers.models.qwen2 import tokenization_qwen2

    return str(tokenization_qwen2.PRETOKENIZE_REGEX)


def build_tokenizer(
    texts: Iterable[str] | None = None, *, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> Any:
    """A ``transformers.PreTrainedTokenizerFast`` trained here on ``texts`` (default:
    ``tokenizer_corpus()``): byte-level BPE (any text encodes, nothing is unknown) whose
    pre-tokenizer splits digits one by one, so numbers tokenize compositionally; specials
    ``<|endoftext|>`` (pad, unk), ``<|startoftext|>`` (bos, added in front of plain text too),
    ``<|im_start|>``, ``<|im_end|>`` (eos); ``CHAT_TEMPLATE`` as its chat template. The same
    texts give the same tokenizer. ``save_pretrained`` / ``AutoTokenizer.from_pretrained``
    round-trip it offline."""
    transformers = require_transformers("build_tokenizer")
    tk = require_module("tokenizers", who="build_tokenizer", install=INSTALL)
    if not is_int(vocab_size) or vocab_size < 300:
        raise ConfigError(
            f"build_tokenizer: vocab_size must be an int >= 300 (256 bytes, the special "
            f"tokens and some merges), got {vocab_size!r}"
        )
    corpus = tokenizer_corpus() if texts is None else list(texts)
    bad = next((i for i, t in enumerate(corpus) if not isinstance(t, str)), None)
    if bad is not None:
        raise ConfigError(
            f"build_tokenizer: texts[{bad}] is {type(corpus[bad]).__name__}, not a string"
        )
    tokenizer = tk.Tokenizer(tk.models.BPE())
    # Qwen2's normalizer and pre-tokenizer (its regex isolates every digit), because
    # AutoTokenizer loads any folder whose config says model_type "qwen2" as Qwen2Tokenizer,
    # which rebuilds these two from its own definitions: with the same ones, every class
    # AutoTokenizer may pick encodes like this tokenizer.
    tokenizer.normalizer = tk.normalizers.NFC()
    tokenizer.pre_tokenizer = tk.pre_tokenizers.Sequence(
        [
            tk.pre_tokenizers.Split(
                tk.Regex(_pretokenize_regex()), behavior="isolated", invert=False
            ),
            tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = tk.processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=PAD,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
    )


# --------------------------------------------------------------------------------------------
# A complete local model folder
# --------------------------------------------------------------------------------------------
def make_model_folder(
    path: str | Path, *, model: str = "tiny-qwen2", seed: int = 0, tokenizer: Any = None
) -> Path:
    """Write a model folder that ``from_pretrained`` loads offline, and return its path:
    ``tokenizer`` (default ``build_tokenizer()``) with its chat template, a random tiny
    ``model`` (a name in ``asyncflow_hf.models.TINY``, weights from ``seed``) in safetensors,
    and a ``generation_config.json`` holding only the bos/eos/pad ids (no sampling defaults
    that would change an engine's sampling). ``path`` must not exist or be an empty folder;
    it is written whole or not at all."""
    who = f"make_model_folder({str(path)!r})"
    transformers = require_transformers(who)
    target = Path(path).expanduser()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(
            f"{who}: {str(target)!r} already exists and is not an empty folder; give a new path"
        )
    tok = build_tokenizer() if tokenizer is None else tokenizer
    if tok.eos_token_id is None or tok.pad_token_id is None:
        raise ConfigError(
            f"{who}: the tokenizer needs an eos_token and a pad_token (has eos="
            f"{tok.eos_token!r}, pad={tok.pad_token!r})"
        )
    ids = {
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    config = tiny_config(model, vocab_size=len(tok))
    for key, value in ids.items():
        setattr(config, key, value)
    lm = load_causal_lm(config, who=who, seed=seed)
    lm.generation_config = transformers.GenerationConfig(**ids)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
    try:
        lm.save_pretrained(str(staging))
        tok.save_pretrained(str(staging))
        staging.chmod(0o755)  # mkdtemp's 0700 is for secrets; this is a model folder
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
