"""Built-in verifiable tasks: answers, exact rewards, warm-up examples, bad input."""

from __future__ import annotations

import random

import pytest
from asyncflow_reference.tasks import BOS, EOS, EQ, PLUS, VOCAB_SIZE, DigitTask

from asyncflow_core.contracts.errors import ConfigError


def test_answers_by_hand() -> None:
    assert DigitTask("reverse", 3).answer((BOS, 3, 1, 7, EQ)) == (7, 1, 3)
    assert DigitTask("sort", 4).answer((BOS, 3, 1, 7, 1, EQ)) == (1, 1, 3, 7)
    add = DigitTask("add", 2)
    assert add.answer((BOS, 4, 7, PLUS, 1, 8, EQ)) == (0, 6, 5)
    assert add.answer((BOS, 9, 9, PLUS, 9, 9, EQ)) == (1, 9, 8)
    assert (add.prompt_len, add.answer_len, add.max_tokens) == (7, 3, 4)


def test_reward_counts_right_digits_only_in_the_right_format() -> None:
    t = DigitTask("reverse", 3)
    p = (BOS, 3, 1, 7, EQ)
    assert t.score(p, (7, 1, 3, EOS)) == (1.0, True)
    assert t.score(p, (7, 0, 3, EOS)) == (pytest.approx(2 / 3), False)
    assert t.score(p, (7, 1, 3)) == (0.0, False)  # no <eos>
    assert t.score(p, (7, 1, EOS)) == (0.0, False)  # too short
    assert t.score(p, (7, 1, 3, 3, EOS)) == (0.0, False)  # too long
    assert t.reward(p, (0, 0, 0, EOS)) == 0.0


def test_prompts_are_seeded_and_valid() -> None:
    for name in ("reverse", "sort", "add"):
        t = DigitTask(name, 3)  # type: ignore[arg-type]
        s1, s2, other = t.prompts(5), t.prompts(5), t.prompts(6)
        first = [next(s1) for _ in range(20)]
        assert first == [next(s2) for _ in range(20)]
        assert first != [next(other) for _ in range(20)]
        for p in first:
            assert len(p) == t.prompt_len and all(0 <= x < VOCAB_SIZE for x in p)
            assert len(t.answer(p)) == t.answer_len


def test_random_answers_score_about_a_tenth() -> None:
    t = DigitTask("reverse", 3)
    rng = random.Random(0)
    pairs = t.format_examples(rng, 4000)
    mean = sum(t.reward(p, r) for p, r in pairs) / len(pairs)
    assert 0.08 < mean < 0.12
    assert all(len(r) == t.max_tokens and r[-1] == EOS for _, r in pairs)


def test_bad_task_and_bad_prompt() -> None:
    with pytest.raises(ConfigError, match="task must be one of reverse, sort, add, got 'mul'"):
        DigitTask("mul", 3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"digits must be in 1\.\.8, got 0"):
        DigitTask("reverse", 0)
    with pytest.raises(ConfigError, match="is not a reverse prompt of 3 digits"):
        DigitTask("reverse", 3).answer((BOS, 1, 2, EQ))
    assert DigitTask("reverse", 2).render((BOS, 1, 2, EQ, 2, 1, EOS)) == "<bos>12=21<eos>"
