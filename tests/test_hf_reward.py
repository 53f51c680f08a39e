"""asyncflow_hf.reward: rewards named module:function, run with a timeout per call so that a
reward that raises, hangs or returns a non-number fails its row alone; the math reward."""

from __future__ import annotations

import asyncio
import math
import sys
import textwrap
import threading
from collections.abc import Iterator, Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from asyncflow_hf.assets import gsm8k_rows
from asyncflow_hf.reward import (
    RewardError,
    RewardRunner,
    batched,
    extract_answer,
    is_batched,
    load_reward,
    make_math_reward,
    math_reward,
    math_reward_strict,
    reference_answer,
)

from asyncflow_core.contracts.errors import ConfigError

ROWS = [{"answer": str(i)} for i in range(4)]
RIGHT = ["0", "1", "2", "3"]


def exact(completion: str, row: Mapping[str, Any]) -> float:
    return 1.0 if completion == row["answer"] else 0.0


# --------------------------------------------------------------------------------------------
# load_reward
# --------------------------------------------------------------------------------------------
@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module of rewards on sys.path, with a unique name (nothing cached between tests)."""
    name = f"user_rewards_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            THRESHOLD = 0.5

            def good(completion, row):
                return 1.0

            def one_arg(completion):
                return 1.0

            def flexible(*args, **kwargs):
                return 1.0

            class Judge:
                def score(self, completion, row):
                    return 0.5

            judge = Judge()
            """
        )
    )
    (tmp_path / f"{name}_broken.py").write_text("raise RuntimeError('bad config in module')\n")
    (tmp_path / f"{name}_needs.py").write_text("import missing_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for mod in [m for m in sys.modules if m.startswith(name)]:
        del sys.modules[mod]


def test_load_reward_imports_by_name(user_module: str) -> None:
    assert load_reward("asyncflow_hf.reward:math_reward") is math_reward
    assert load_reward(f"{user_module}:good")("x", {}) == 1.0
    assert load_reward(f" {user_module}:flexible ")("x", {}) == 1.0
    assert load_reward(f"{user_module}:judge.score")("x", {}) == 0.5


@pytest.mark.parametrize(
    "spec",
    ["", "math_reward", "asyncflow_hf.reward:", ":f", "a:b:c", "a.:f", "a:1f", "os:system('x')"],
)
def test_load_reward_refuses_a_malformed_spec(spec: str) -> None:
    with pytest.raises(ConfigError, match=r"must be 'package\.module:function'"):
        load_reward(spec)


def test_load_reward_refuses_a_non_string() -> None:
    with pytest.raises(ConfigError, match=r"must be 'package\.module:function'"):
        load_reward(math_reward)  # type: ignore[arg-type]


def test_load_reward_names_a_missing_module() -> None:
    with pytest.raises(ConfigError, match="no module named 'no_such_reward_module'"):
        load_reward("no_such_reward_module.sub:f")


def test_load_reward_names_a_missing_dependency_and_an_import_failure(user_module: str) -> None:
    with pytest.raises(ConfigError, match="needs 'missing_dependency_xyz'"):
        load_reward(f"{user_module}_needs:f")
    with pytest.raises(ConfigError, match="RuntimeError: bad config in module"):
        load_reward(f"{user_module}_broken:f")


def test_load_reward_lists_what_the_module_has(user_module: str) -> None:
    with pytest.raises(ConfigError, match=r"has no attribute 'gooood'.*\['Judge', 'flexible'"):
        load_reward(f"{user_module}:gooood")
    with pytest.raises(ConfigError, match=r"'.*:judge' has no attribute 'scor'.*\['score'\]"):
        load_reward(f"{user_module}:judge.scor")


def test_load_reward_refuses_a_non_callable_and_a_wrong_signature(user_module: str) -> None:
    with pytest.raises(ConfigError, match=r"is a float .*not a function"):
        load_reward(f"{user_module}:THRESHOLD")
    with pytest.raises(ConfigError, match=r"cannot be called as reward\(completion, row\)"):
        load_reward(f"{user_module}:one_arg")


def test_load_reward_says_when_the_working_directory_is_not_on_sys_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cwd_only_reward_xyz.py").write_text("def f(c, r):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    with pytest.raises(ConfigError, match=r"is in the working directory.*PYTHONPATH=\."):
        load_reward("cwd_only_reward_xyz:f")


# --------------------------------------------------------------------------------------------
# RewardRunner: sync rewards
# --------------------------------------------------------------------------------------------
def test_runner_scores_in_order_with_the_callers_ids() -> None:
    with RewardRunner(exact) as runner:
        results = runner.score_sync(["0", "x", "2", "3"], ROWS, ids=["a", "b", "c", "d"])
    assert [r.row for r in results] == ["a", "b", "c", "d"]
    assert [r.score for r in results] == [1.0, 0.0, 1.0, 1.0]
    assert all(r.ok and r.error is None for r in results)
    assert runner.name == f"{__name__}:exact"


def test_a_raising_reward_fails_its_row_only() -> None:
    def picky(completion: str, row: Mapping[str, Any]) -> float:
        if row["answer"] == "2":
            raise KeyError("no judge for row 2")
        return 1.0

    with RewardRunner(picky, name="my.rewards:picky") as runner:
        results = runner.score_sync(RIGHT, ROWS, ids=[10, 11, 12, 13])
    assert [r.score for r in results] == [1.0, 1.0, None, 1.0]
    bad = results[2]
    assert not bad.ok and bad.row == 12
    assert bad.error is not None
    assert "reward 'my.rewards:picky' failed on row 12" in bad.error
    assert "raised KeyError: 'no judge for row 2'" in bad.error


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1.0", "returned '1.0' (str), not a number"),
        (None, "returned None (NoneType), not a number"),
        ([1.0], "returned [1.0] (list), not a number"),
        (math.nan, "returned nan; a reward must be a finite number"),
        (-math.inf, "returned -inf; a reward must be a finite number"),
        (True, "returned True, a bool; return a float"),
        (np.bool_(False), "returned np.False_ (numpy.bool), not a number"),
    ],
)
def test_a_non_number_fails_its_row_naming_what_came_back(value: object, expected: str) -> None:
    def reward(completion: str, row: Mapping[str, Any]) -> object:
        return value if row["answer"] == "1" else 0.25

    with RewardRunner(reward, name="r") as runner:
        results = runner.score_sync(RIGHT, ROWS)
    assert [r.score for r in results] == [0.25, None, 0.25, 0.25]
    assert results[1].error is not None
    assert results[1].error.startswith("reward 'r' failed on row 1: ")
    assert expected in results[1].error


def test_numbers_of_any_real_type_are_scores() -> None:
    values = iter([1, np.float32(0.5), np.int64(-2), Fraction(1, 4)])
    with RewardRunner(lambda c, r: next(values), max_concurrency=1) as runner:
        results = runner.score_sync(RIGHT, ROWS)
    assert [r.score for r in results] == [1.0, 0.5, -2.0, 0.25]
    assert all(type(r.score) is float for r in results)


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """An event the hanging rewards wait on; set at teardown so their threads end."""
    event = threading.Event()
    yield event
    event.set()


def test_a_hanging_reward_fails_its_row_at_the_timeout(gate: threading.Event) -> None:
    def hangs_on_row_1(completion: str, row: Mapping[str, Any]) -> float:
        if row["answer"] == "1":
            gate.wait(60)  # until the test lets go: far beyond the timeout under test
        return 1.0

    runner = RewardRunner(hangs_on_row_1, name="slow", timeout_s=0.2)
    try:
        results = runner.score_sync(RIGHT, ROWS)
        assert [r.score for r in results] == [1.0, None, 1.0, 1.0]
        assert results[1].error is not None
        assert "reward 'slow' failed on row 1: did not return within timeout_s=0.2 s" in (
            results[1].error
        )
        assert runner.hung == 1
    finally:
        gate.set()
        for thread in list(runner._hung):
            thread.join(timeout=10)
    assert runner.hung == 0
    # the runner goes on working after its hung call ended
    assert [r.score for r in runner.score_sync(RIGHT, ROWS)] == [1.0] * 4
    runner.close()


def test_past_max_hung_calls_fail_at_once_instead_of_starting_threads(
    gate: threading.Event,
) -> None:
    def hangs_on_row_0(completion: str, row: Mapping[str, Any]) -> float:
        if row["answer"] == "0":
            gate.wait(60)
        return 1.0

    runner = RewardRunner(hangs_on_row_0, timeout_s=0.2, max_hung=1)
    try:
        assert [r.score for r in runner.score_sync(RIGHT[:1], ROWS[:1])] == [None]
        (result,) = runner.score_sync(RIGHT[1:2], ROWS[1:2])
        assert result.error is not None
        assert "not run: 1 earlier calls are still running past timeout_s=0.2" in result.error
    finally:
        gate.set()
        for thread in list(runner._hung):
            thread.join(timeout=10)
    assert [r.score for r in runner.score_sync(RIGHT[1:2], ROWS[1:2])] == [1.0]
    runner.close()


def test_at_most_max_concurrency_calls_run_at_once() -> None:
    # async calls all start in one loop turn unless the bound holds them back: no clock
    running, peak = [0], [0]

    async def reward(completion: str, row: Mapping[str, Any]) -> float:
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        for _ in range(3):
            await asyncio.sleep(0)
        running[0] -= 1
        return 1.0

    results = RewardRunner(reward, max_concurrency=2).score_sync(["x"] * 6, [{}] * 6)
    assert [r.score for r in results] == [1.0] * 6
    assert peak[0] == 2
    peak[0] = 0
    RewardRunner(reward, max_concurrency=8).score_sync(["x"] * 6, [{}] * 6)
    assert peak[0] == 6


def test_a_sync_reward_returning_a_coroutine_is_told_to_be_async() -> None:
    async def inner() -> float:
        return 1.0

    with RewardRunner(lambda c, r: inner(), name="r") as runner:
        (result,) = runner.score_sync(["x"], [{}])
    assert result.error is not None
    assert "returned an awaitable; declare the reward with async def" in result.error


# --------------------------------------------------------------------------------------------
# RewardRunner: async and batched rewards
# --------------------------------------------------------------------------------------------
def test_async_rewards_score_and_fail_per_row() -> None:
    never = asyncio.Event()
    cancelled: list[bool] = []

    async def reward(completion: str, row: Mapping[str, Any]) -> object:
        if row["answer"] == "1":
            try:
                await never.wait()
            except asyncio.CancelledError:
                cancelled.append(True)
                raise
        if row["answer"] == "2":
            raise ValueError("judge unavailable")
        if row["answer"] == "3":
            return "high"
        return 1.0

    async def main() -> list[Any]:
        runner = RewardRunner(reward, name="judge", timeout_s=0.2)
        assert runner.is_async
        results = await runner.score(RIGHT, ROWS)
        await asyncio.sleep(0)  # one loop turn: the cancellation reaches the coroutine
        return results

    results = asyncio.run(main())
    assert [r.score for r in results] == [1.0, None, None, None]
    errors = [r.error or "" for r in results]
    assert "did not return within timeout_s=0.2 s (cancelled)" in errors[1]
    assert "raised ValueError: judge unavailable" in errors[2]
    assert "returned 'high' (str), not a number" in errors[3]
    assert cancelled == [True]


def test_an_object_with_an_async_call_is_an_async_reward() -> None:
    class Judge:
        async def __call__(self, completion: str, row: Mapping[str, Any]) -> float:
            await asyncio.sleep(0)
            return exact(completion, row)

    runner = RewardRunner(Judge())
    assert runner.is_async
    assert [r.score for r in runner.score_sync(["0", "0"], ROWS[:2])] == [1.0, 0.0]


def test_batched_rewards_get_lists_and_score_each_row() -> None:
    calls: list[int] = []

    @batched
    def many(completions: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> list[object]:
        calls.append(len(completions))
        return [exact(c, r) if c != "bad" else "?" for c, r in zip(completions, rows, strict=True)]

    assert is_batched(many)
    with RewardRunner(many, name="many") as runner:
        results = runner.score_sync(["0", "bad", "2", "9"], ROWS)
    assert calls == [4]
    assert [r.score for r in results] == [1.0, None, 1.0, 0.0]
    assert "returned '?' (str), not a number" in (results[1].error or "")


def test_a_batched_attribute_and_async_batched_rewards() -> None:
    async def many(completions: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> list[float]:
        return [exact(c, r) for c, r in zip(completions, rows, strict=True)]

    many.batched = True  # type: ignore[attr-defined]
    runner = RewardRunner(many)
    assert runner.is_batched and runner.is_async
    assert [r.score for r in runner.score_sync(RIGHT, ROWS)] == [1.0] * 4


@pytest.mark.parametrize(
    ("returns", "expected"),
    [
        (lambda n: [1.0] * (n - 1), "returned 3 scores for 4 rows"),
        (lambda n: "1111", "returned '1111' (str); a batched reward returns a list of floats"),
        (lambda n: 1.0, "returned 1.0 (float); a batched reward returns a list of floats"),
        (lambda n: 1 / 0, "raised ZeroDivisionError: division by zero"),
    ],
)
def test_a_failing_batched_call_fails_every_row_of_its_batch(returns: Any, expected: str) -> None:
    @batched
    def many(completions: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> Any:
        return returns(len(completions))

    with RewardRunner(many, name="many") as runner:
        results = runner.score_sync(RIGHT, ROWS)
    assert [r.row for r in results] == [0, 1, 2, 3]
    for r in results:
        assert r.score is None and r.error is not None
        assert r.error.startswith(f"reward 'many' failed on row {r.row}: {expected}")
        assert r.error.endswith("(the whole batch of 4 rows fails with it)")


def test_a_hanging_batched_call_fails_its_batch(gate: threading.Event) -> None:
    @batched
    def many(completions: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> list[float]:
        gate.wait(60)
        return [1.0] * len(completions)

    runner = RewardRunner(many, timeout_s=0.2)
    try:
        results = runner.score_sync(RIGHT[:2], ROWS[:2])
    finally:
        gate.set()
    assert all("did not return within timeout_s=0.2 s" in (r.error or "") for r in results)


# --------------------------------------------------------------------------------------------
# RewardRunner: misuse
# --------------------------------------------------------------------------------------------
def test_runner_refuses_mismatched_inputs_and_sync_calls_inside_a_loop() -> None:
    runner = RewardRunner(exact)
    with pytest.raises(RewardError, match="3 completions, 4 rows; pass one row per completion"):
        runner.score_sync(RIGHT[:3], ROWS)
    with pytest.raises(RewardError, match="4 completions, 4 rows and 2 ids"):
        runner.score_sync(RIGHT, ROWS, ids=[1, 2])

    async def inside() -> None:
        runner.score_sync(RIGHT, ROWS)

    with pytest.raises(RewardError, match=r"await RewardRunner\.score"):
        asyncio.run(inside())


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"timeout_s": 0}, "timeout_s must be a number > 0"),
        ({"timeout_s": math.inf}, "timeout_s must be a number > 0"),
        ({"timeout_s": True}, "timeout_s must be a number > 0"),
        ({"max_concurrency": 0}, "max_concurrency must be an int >= 1"),
        ({"max_hung": 1.5}, "max_hung must be an int >= 1"),
    ],
)
def test_runner_refuses_bad_settings(kwargs: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        RewardRunner(exact, **kwargs)
    with pytest.raises(ConfigError, match="the reward must be callable"):
        RewardRunner("asyncflow_hf.reward:math_reward")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# The math reward
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "lenient", "strict"),
    [
        ("3 + 4 = 7\n#### 7", 7, 7),
        ("#### 1,234 apples", 1234, 1234),
        ("#### $-12.50", Fraction(-25, 2), Fraction(-25, 2)),
        ("#### 8\nwait\n#### 9", 9, 9),  # the last marker
        ("#### 5 then \\boxed{6}", 5, 5),  # #### before \boxed
        ("the total is 12.\n####", None, None),  # a marker with no number is no answer
        ("so \\boxed{42}. Also 7", 42, 42),
        ("\\boxed{ -3.0 }", -3, -3),
        ("\\boxed{1,000}", 1000, 1000),
        ("\\boxed{\\$5}", 5, 5),
        ("\\boxed{\\frac{1}{2}}", None, None),  # not a plain number
        ("\\boxed{42 apples}", None, None),
        ("\\boxed{5", 5, None),  # unclosed: falls through to the last number
        ("10-3=7", 7, None),  # '-' after a number is an operator
        ("x = -5", -5, None),
        ("\u22124", -4, None),  # unicode minus
        ("about .5 or 0.50", Fraction(1, 2), None),
        ("1,2345", 2345, None),  # not a thousands group
        ("The answer is 42.", 42, None),
        ("no number here", None, None),
    ],
)
def test_extract_answer(text: str, lenient: object, strict: object) -> None:
    assert extract_answer(text) == lenient
    assert extract_answer(text, strict=True) == strict


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("Tom has 3 + 4 = 7.\n#### 7", 7),
        ("#### 1,234", 1234),
        (" 72 ", 72),
        ("-3.50", Fraction(-7, 2)),
        (5, 5),
        (0.1, Fraction(1, 10)),
    ],
)
def test_reference_answer(value: object, expected: object) -> None:
    assert reference_answer(value) == expected


@pytest.mark.parametrize("value", ["seven", "#### none", "$5", None, True, math.nan, [7]])
def test_reference_answer_refuses_what_is_not_a_number(value: object) -> None:
    with pytest.raises(ConfigError, match=r"the row's answer .* is not a number"):
        reference_answer(value)


def test_math_reward_on_gsm8k_rows() -> None:
    row = {"question": "?", "answer": "Tom has 3 + 4 = 7 apples.\n#### 7"}
    assert math_reward("3 + 4 = 7\n#### 7", row) == 1.0
    assert math_reward("3 + 4 = 7\n#### 7.0", row) == 1.0
    assert math_reward("3 + 4 = 8\n#### 8", row) == 0.0
    assert math_reward("so it is 7", row) == 1.0
    assert math_reward_strict("so it is 7", row) == 0.0
    assert math_reward_strict("so it is \\boxed{7}", row) == 1.0
    assert math_reward("", row) == 0.0
    # every generated row's own answer is right, and off by one is wrong
    for r in gsm8k_rows(200, seed=3, difficulty=3):
        assert math_reward(r["answer"], r) == 1.0
        answer = int(r["answer"].rsplit("#### ", 1)[1])
        assert math_reward(f"#### {answer + 1}", r) == 0.0


def test_math_reward_for_another_answer_field_and_a_missing_one() -> None:
    reward = make_math_reward(answer_field="solution", strict=True)
    assert reward("#### 4", {"solution": 4}) == 1.0
    assert reward("4", {"solution": 4}) == 0.0
    with pytest.raises(ConfigError, match=r"no field 'solution' \(fields: \['answer'\]\)"):
        reward("#### 4", {"answer": "4"})
    # through the runner, a bad row is that row's failure
    with RewardRunner(math_reward) as runner:
        results = runner.score_sync(["#### 4", "#### 4"], [{"answer": "4"}, {"answer": "four"}])
    assert results[0].score == 1.0
    assert "raised ConfigError: math reward: the row's answer 'four'" in (results[1].error or "")
