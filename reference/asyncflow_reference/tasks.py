"""Built-in verifiable tasks, made in code (no downloads): digit puzzles with an exact reward.

Every task shares one small vocabulary: the digits ``0``-``9`` (ids 0-9), ``<bos>`` (10),
``=`` (11), ``<eos>`` (12) and ``+`` (13). A prompt is ``<bos> question =``; the answer is a
fixed number of digits followed by ``<eos>``.

========== ==================================== ==============================================
task       prompt -> answer                      what the model has to learn
========== ==================================== ==============================================
reverse    ``<bos> 3 1 7 =`` -> ``7 1 3 <eos>``  copy the i-th digit from the end (the default)
sort       ``<bos> 3 1 7 =`` -> ``1 3 7 <eos>``  sort the digits ascending
add        ``<bos> 4 7 + 1 8 =`` -> ``0 6 5``    add two numbers (fixed width, zero-padded)
========== ==================================== ==============================================

**Reward** (in [0, 1]): the fraction of answer positions holding the right digit, counted only
when the response is exactly the answer's length followed by ``<eos>`` (else 0). A uniformly
random answer of the right format scores 1/10 on average; ``exact`` (all digits right) is
reported next to it.

**Warm-up**: a model trained from scratch first learns the *format* only — a few seconds of
supervised steps on ``prompt -> random digits <eos>`` (``format_examples``). It then answers in
the right shape with random digits, so the reward starts near 0.1 and everything above that is
learned by RL from the reward alone.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from asyncflow_core.contracts.errors import ConfigError

DIGITS = 10
BOS, EQ, EOS, PLUS = 10, 11, 12, 13
VOCAB = ("0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "<bos>", "=", "<eos>", "+")
VOCAB_SIZE = len(VOCAB)

TaskName = Literal["reverse", "sort", "add"]
TASKS: tuple[TaskName, ...] = ("reverse", "sort", "add")


@dataclass(frozen=True, slots=True)
class DigitTask:
    """One of ``TASKS`` over ``digits``-digit questions (for ``add``: two ``digits``-digit
    numbers). ``answer_len`` digits then ``<eos>`` is the answer; ``max_tokens`` is its length
    (a longer response can never score)."""

    name: TaskName = "reverse"
    digits: int = 3

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise ConfigError(f"task must be one of {', '.join(TASKS)}, got {self.name!r}")
        if isinstance(self.digits, bool) or not isinstance(self.digits, int):
            raise ConfigError(f"task digits must be an int, got {self.digits!r}")
        if not 1 <= self.digits <= 8:
            raise ConfigError(f"task digits must be in 1..8, got {self.digits}")

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    @property
    def answer_len(self) -> int:
        return self.digits + 1 if self.name == "add" else self.digits

    @property
    def prompt_len(self) -> int:
        inner = 2 * self.digits + 1 if self.name == "add" else self.digits
        return inner + 2

    @property
    def max_tokens(self) -> int:
        return self.answer_len + 1

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (EOS,)

    # -- questions and answers -----------------------------------------------------------------
    def prompt(self, rng: random.Random) -> tuple[int, ...]:
        """A random question."""
        if self.name == "add":
            a = [rng.randrange(DIGITS) for _ in range(self.digits)]
            b = [rng.randrange(DIGITS) for _ in range(self.digits)]
            return (BOS, *a, PLUS, *b, EQ)
        return (BOS, *(rng.randrange(DIGITS) for _ in range(self.digits)), EQ)

    def prompts(self, seed: int = 0) -> Iterator[tuple[int, ...]]:
        """An endless stream of questions from ``seed``."""
        rng = random.Random(seed)
        while True:
            yield self.prompt(rng)

    def answer(self, prompt: Sequence[int]) -> tuple[int, ...]:
        """The right answer's digits (without ``<eos>``); ``ConfigError`` for a prompt this task
        did not make."""
        body = list(prompt)
        if len(body) != self.prompt_len or body[0] != BOS or body[-1] != EQ:
            raise ConfigError(
                f"{self.name}: {list(prompt)} is not a {self.name} prompt of {self.digits} "
                f"digits (<bos> question =, {self.prompt_len} tokens)"
            )
        inner = body[1:-1]
        if self.name == "reverse":
            return tuple(reversed(inner))
        if self.name == "sort":
            return tuple(sorted(inner))
        a = int("".join(map(str, inner[: self.digits])))
        b = int("".join(map(str, inner[self.digits + 1 :])))
        return tuple(int(c) for c in str(a + b).zfill(self.answer_len))

    def score(self, prompt: Sequence[int], response: Sequence[int]) -> tuple[float, bool]:
        """``(reward, exact)`` of a response (see the module docstring)."""
        target = self.answer(prompt)
        k = len(target)
        resp = list(response)
        if len(resp) != k + 1 or resp[k] != EOS:
            return 0.0, False
        right = sum(1 for got, want in zip(resp[:k], target, strict=True) if got == want)
        return right / k, right == k

    def reward(self, prompt: Sequence[int], response: Sequence[int]) -> float:
        """The reward in [0, 1] (a ``reward_fn`` for ``RLJob``)."""
        return self.score(prompt, response)[0]

    def format_examples(self, rng: random.Random, n: int) -> list[tuple[tuple[int, ...], ...]]:
        """``n`` warm-up pairs ``(prompt, response)``: a real question, answered with random
        digits and ``<eos>``; they teach the answer's shape, not the task."""
        out = []
        for _ in range(n):
            answer = tuple(rng.randrange(DIGITS) for _ in range(self.answer_len))
            out.append((self.prompt(rng), (*answer, EOS)))
        return out

    def render(self, tokens: Sequence[int]) -> str:
        """Tokens as text, e.g. ``"<bos>317=713<eos>"``."""
        return "".join(VOCAB[t] if 0 <= t < VOCAB_SIZE else f"<{t}?>" for t in tokens)


__all__ = ["BOS", "EOS", "EQ", "PLUS", "TASKS", "VOCAB", "VOCAB_SIZE", "DigitTask", "TaskName"]
