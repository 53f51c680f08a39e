"""Typed config: TOML file + key=value overrides onto frozen dataclasses, clear errors."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from asyncflow_core.contracts.errors import ConfigError
from asyncflow_core.flow.config import apply_override, keys, load_config, merge, to_dict, to_toml


@dataclass(frozen=True)
class Train:
    lr: float = 1e-3
    steps: int = 10
    loss: Literal["pg", "ppo"] = "pg"
    clip: float | None = None
    layers: tuple[int, ...] = (1, 2)

    def validate(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"train.lr must be > 0, got {self.lr}")


@dataclass(frozen=True)
class Job:
    name: str = "run"
    verbose: bool = False
    train: Train = field(default_factory=Train)


def test_defaults_file_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text('name = "exp"\n[train]\nlr = 0.01\nsteps = 5\n')
    cfg = load_config(Job, path, ["train.steps=7", "train.loss=ppo", "verbose=true"])
    assert cfg == Job("exp", True, Train(lr=0.01, steps=7, loss="ppo"))
    # ints are numbers; "none" clears an optional; lists become tuples
    cfg = apply_override(cfg, "train.lr=1")
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    cfg = apply_override(apply_override(cfg, "train.clip=0.2"), "train.clip=none")
    assert cfg.train.clip is None
    assert apply_override(cfg, "train.layers=[4, 5, 6]").train.layers == (4, 5, 6)
    assert apply_override(cfg, 'name="a b"').name == "a b"


def test_round_trip_through_toml(tmp_path: Path) -> None:
    cfg = Job("x", True, Train(lr=0.5, steps=3, loss="ppo", clip=0.2, layers=(3,)))
    text = to_toml(cfg)
    assert tomllib.loads(text) == to_dict(cfg)
    path = tmp_path / "c.toml"
    path.write_text(text)
    assert load_config(Job, path) == cfg
    assert keys(cfg) == [
        "name", "verbose", "train.lr", "train.steps", "train.loss", "train.clip", "train.layers",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.lrr=1", "unknown key 'train.lrr' (did you mean 'train.lr'?); valid keys here: "),
        ("trian.lr=1", "unknown key 'trian' (did you mean 'train'?)"),
        ("train.loss=sgd", "train.loss must be one of 'pg', 'ppo', got 'sgd'"),
        ("train.steps=1.5", "train.steps must be an integer, got 1.5"),
        ("train.steps=ten", "train.steps must be an integer, got 'ten'"),
        ("verbose=2", "verbose must be true or false, got 2"),
        ("train.clip=big", "train.clip must be float or none, got 'big'"),
        ("train.layers=3", "train.layers must be a list of int, got 3"),
        ("train.lr=-1", "train.lr must be > 0, got -1.0"),
        ("train=3", "train is a table; got 3, expected keys lr, steps, loss, clip, layers"),
        ("no-equals", "override 'no-equals' is not of the form key=value"),
    ],
)
def test_bad_overrides_name_the_key_and_what_is_valid(override: str, message: str) -> None:
    cfg = Job()
    with pytest.raises(ConfigError) as e:
        apply_override(cfg, override)
    assert message in str(e.value)
    assert cfg == Job()  # nothing changed


def test_bad_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(Job, tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(Job, bad)
    typo = tmp_path / "typo.toml"
    typo.write_text("[train]\nstep = 3\n")
    with pytest.raises(ConfigError, match=r"typo.toml: unknown key 'train.step' \(did you mean"):
        load_config(Job, typo)


def test_merge_leaves_the_input_alone() -> None:
    cfg = Job()
    out = merge(cfg, {"train": {"steps": 2}})
    assert out.train.steps == 2 and cfg.train.steps == 10


def test_files_and_values_the_fuzz_found(tmp_path: Path) -> None:
    """Non-UTF-8 bytes, nesting deeper than the parser recurses, non-finite floats and a
    value smuggling a second key were a UnicodeDecodeError, a RecursionError, accepted and
    silently cut; each is a ConfigError now (or, for the second key, one string)."""
    raw = tmp_path / "raw.toml"
    raw.write_bytes(b"name = '\x80'\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(Job, raw)
    deep = tmp_path / "deep.toml"
    deep.write_text("name = " + "[" * 5000)
    with pytest.raises(ConfigError, match="too deeply"):
        load_config(Job, deep)
    with pytest.raises(ConfigError, match="too deeply"):
        apply_override(Job(), "train.layers=" + "[" * 5000)
    for value in ("nan", "inf", "-inf", "1e400", str(10**400)):
        with pytest.raises(ConfigError, match=r"train\.lr must be a finite number"):
            apply_override(Job(), f"train.lr={value}")
    assert apply_override(Job(), "name=1\nverbose = true") == Job(name="1\nverbose = true")
