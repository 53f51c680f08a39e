"""Fuzzing config files and ``--set`` overrides of the main job (``ReferenceRunConfig``, the
default workload's config) with Hypothesis.

Garbage bytes, TOML documents over the real keys and made-up ones with values of every TOML
type (huge and negative ints, NaN and infinities, dates, nested tables and arrays), and
``key=value`` overrides of arbitrary text: ``load_config`` either returns a config or raises
``ConfigError``; a rejected override leaves the config it was applied to as it was; and a
config that loads writes back (``to_toml``) to TOML that loads to the same config.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import tomli_w
from asyncflow_reference.workloads import ReferenceRunConfig
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from asyncflow_core.contracts.errors import ConfigError
from asyncflow_core.flow.config import apply_override, keys, load_config, to_toml

FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
KEYS = keys(ReferenceRunConfig())
SECTIONS = sorted({k.split(".")[0] for k in KEYS if "." in k})

scalars = st.one_of(
    st.integers(-5, 300),
    st.sampled_from([2**63 - 1, -(2**63), 0, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=8),
    st.sampled_from(
        [
            "ppo",
            "pg",
            "async",
            "reverse",
            "clock",
            "none",
            "cpu",
            "deepspeed",
            "hf",
            "torch",
            "auto",
            "bf16",
            "local",
            "ray",
        ]
    ),
    st.just(datetime.date(2024, 1, 2)),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=2)
    ),
    max_leaves=6,
)
known = st.sampled_from(KEYS)
made_up = st.one_of(
    st.text(min_size=1, max_size=8),
    st.sampled_from(SECTIONS).map(lambda s: f"{s}.nope"),
    st.sampled_from(["train.lrr", "rl.step", "task.name.x", "seed.x", "a..b", ".", "x."]),
)


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"train.lr": 1}`` as ``{"train": {"lr": 1}}`` (a clash keeps the first)."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        parts = key.split(".")
        node = out
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                break
            node = child
        else:
            node.setdefault(parts[-1], value)
    return out


def outcome(fn: Any) -> ReferenceRunConfig | None:
    """``fn()``'s config, or None when it raised ``ConfigError`` (anything else propagates)."""
    try:
        cfg = fn()
    except ConfigError:
        event("refused: ConfigError")
        return None
    event("accepted")
    assert isinstance(cfg, ReferenceRunConfig)
    return cfg


def round_trips(cfg: ReferenceRunConfig, folder: Path) -> None:
    path = folder / "back.toml"
    path.write_text(to_toml(cfg))
    assert load_config(ReferenceRunConfig, path) == cfg


@FUZZ
@given(data=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_garbage_files(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "garbage.toml"
    path.write_bytes(data)
    cfg = outcome(lambda: load_config(ReferenceRunConfig, path))
    if cfg is not None:
        round_trips(cfg, tmp_path)


def default_of(key: str) -> Any:
    node: Any = ReferenceRunConfig()
    for part in key.split("."):
        node = getattr(node, part)
    return node


def near(key: str) -> st.SearchStrategy[Any]:
    """Values of the key's own type around its default (so that documents reach the range
    checks), sometimes anything at all."""
    default = default_of(key)
    if isinstance(default, bool):
        typed: st.SearchStrategy[Any] = st.booleans()
    elif isinstance(default, int):
        typed = st.integers(-2, 2 * default + 2) | st.sampled_from([2**62, 10**30])
    elif isinstance(default, float):
        typed = st.floats(-1.0, 2 * default + 1.0) | st.sampled_from([1e300, 5e-324])
    elif isinstance(default, str):
        typed = st.sampled_from([default, "", "x", "auto", "cpu"])
    else:
        typed = values
    return st.integers(0, 9).flatmap(lambda i: values if 3 <= i <= 4 else typed)


entries = st.one_of(
    known.flatmap(lambda k: st.tuples(st.just(k), near(k))),
    known.flatmap(lambda k: st.tuples(st.just(k), near(k))),
    st.tuples(made_up, values),
)


@FUZZ
@given(flat=st.lists(entries, max_size=4).map(dict))
def test_toml_documents(tmp_path: Path, flat: dict[str, Any]) -> None:
    path = tmp_path / "job.toml"
    try:
        path.write_text(tomli_w.dumps(nest(flat)))
    except (TypeError, ValueError):  # not representable in TOML: nothing to load
        return
    cfg = outcome(lambda: load_config(ReferenceRunConfig, path))
    if cfg is not None:
        round_trips(cfg, tmp_path)


override_values = st.one_of(
    st.text(max_size=12),
    st.sampled_from(
        [
            "nan",
            "inf",
            "-inf",
            "1e400",
            "-1",
            "0",
            "true",
            "[1, 2",
            "[[[[",
            '"x',
            "{a = 1}",
            "1979-05-27",
            "1\nseed = 3",
            "none",
            "null",
            "'''",
            "[" * 2000,
            "9" * 5000,
            "0x10",
            "1_000",
        ]
    ),
    values.map(lambda v: tomli_w.dumps({"v": v})[4:].strip() if not isinstance(v, dict) else ""),
)


@FUZZ
@given(
    items=st.lists(
        st.tuples(
            known | made_up | st.just(""), st.sampled_from(["=", "", "=="]), override_values
        ).map("".join),
        min_size=1,
        max_size=3,
    )
)
def test_overrides(tmp_path: Path, items: list[str]) -> None:
    cfg = outcome(lambda: load_config(ReferenceRunConfig, None, items))
    if cfg is not None:
        round_trips(cfg, tmp_path)
    base = ReferenceRunConfig()
    for item in items:
        try:
            apply_override(base, item, check=False)
        except ConfigError:
            assert base == ReferenceRunConfig()  # a rejected override changed nothing


def test_non_finite_numbers_are_refused() -> None:
    """Found by the fuzz: ``nan`` / ``inf`` passed every range check written as ``x < 0``."""
    for item in ("train.lr=nan", "rollout.top_p=inf", "agent.tool_timeout_s=nan"):
        try:
            load_config(ReferenceRunConfig, None, [item])
        except ConfigError as exc:
            assert "finite" in str(exc)
        else:
            raise AssertionError(f"{item} was accepted")
    for item in ("train.lr=1e400", f"train.lr={10**400}"):  # overflows: infinity, or no float
        try:
            load_config(ReferenceRunConfig, None, [item])
        except ConfigError as exc:
            assert "finite" in str(exc)
        else:
            raise AssertionError(f"{item} was accepted")
