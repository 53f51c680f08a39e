"""The main job's config is generic over workloads (issue #26): ``RunConfig`` holds what every
run has, a workload's config class adds its keys, ``load_run_config`` picks the class from the
keys set, and a runtime is a registry entry like any engine."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from asyncflow_hf.config import HFRunConfig
from asyncflow_reference.workloads import DigitsWorkload, ReferenceRunConfig

from asyncflow_core.contracts.errors import ConfigError
from asyncflow_core.contracts.protocols import InferenceEngine, TrainEngine
from asyncflow_core.engines import registry
from asyncflow_core.flow.config import apply_override, keys, to_toml
from asyncflow_core.job import (
    Placed,
    RunConfig,
    config_class,
    load_run_config,
    local_runtime,
    run,
)
from asyncflow_core.job.command import _resume_config
from asyncflow_core.job.config import resolve_config_class, set_values

QUICK = ["rl.steps=2", "rl.prompts_per_step=4", "rl.n=4", "task.warmup_steps=1", "eval_prompts=4"]


@dataclass(frozen=True)
class _ToySection:
    size: int = 2


@dataclass(frozen=True)
class _ToyRunConfig(RunConfig):
    toy: _ToySection = field(default_factory=_ToySection)

    @classmethod
    def claims(cls, values: Mapping[str, Any]) -> bool:
        return any(k.startswith("toy.") for k in values)

    def auto_workload(self) -> str:
        return "toy-test"

    def check(self) -> None:
        if self.toy.size < 1:
            raise ConfigError(f"toy.size must be >= 1, got {self.toy.size}")


class _ToyWorkload(DigitsWorkload):
    config = _ToyRunConfig  # type: ignore[assignment]


@pytest.fixture
def toy() -> Iterator[None]:
    registry.register("workload", "toy-test", _ToyWorkload, replace=True)
    try:
        yield
    finally:
        registry._registry.factories["workload"].pop("toy-test", None)


def test_the_keys_set_pick_the_workloads_config_class() -> None:
    assert resolve_config_class({}) is ReferenceRunConfig  # the default workload, digits
    assert resolve_config_class({"rl.steps": "3", "train.lr": "1e-3"}) is ReferenceRunConfig
    assert resolve_config_class({"model.path": "/m"}) is HFRunConfig
    assert resolve_config_class({"data.max_tokens": "6"}) is HFRunConfig
    assert resolve_config_class({"task": "clock"}) is ReferenceRunConfig
    assert resolve_config_class({"workload": "hf"}) is HFRunConfig
    assert config_class("agent") is ReferenceRunConfig
    clock = load_run_config(None, ["task=clock"])
    assert type(clock) is ReferenceRunConfig and clock.workload_name() == "agent"
    hf = load_run_config(None, ["model.name=tiny-qwen2"])
    assert (
        type(hf) is HFRunConfig and hf.workload_name() == "hf" and hf.describe() == "hf tiny-qwen2"
    )
    assert "model.d_model" in keys(clock) and "model.d_model" not in keys(hf)
    assert "data.path" in keys(hf) and "data.path" not in keys(clock)


def test_a_registered_workloads_class_claims_its_keys(toy: None) -> None:
    cfg = load_run_config(None, ["toy.size=5", "rl.steps=3"])
    assert type(cfg) is _ToyRunConfig and cfg.toy.size == 5 and cfg.workload_name() == "toy-test"
    with pytest.raises(ConfigError, match=r"toy\.size must be >= 1, got 0"):
        load_run_config(None, ["toy.size=0"])
    with pytest.raises(ConfigError, match=r"unknown key 'toy.sise'.*read as _ToyRunConfig"):
        load_run_config(None, ["workload=toy-test", "toy.sise=3"])


def test_a_file_and_overrides_set_keys_in_order(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('workload = "auto"\n[model]\nname = "tiny-qwen2"\n[rl]\nsteps = 5\n')
    assert set_values(path, ["rl.steps=7", "reward='pkg.mod:fn'"]) == {
        "workload": "auto", "model.name": "tiny-qwen2", "rl.steps": "7", "reward": "pkg.mod:fn",
    }  # fmt: skip
    cfg = load_run_config(path, ["rl.steps=7"])
    assert type(cfg) is HFRunConfig and cfg.rl.steps == 7 and cfg.model.name == "tiny-qwen2"
    assert set_values(tmp_path / "missing.toml", []) == {}  # load_config names the bad file
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_run_config(tmp_path / "missing.toml")


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"[rl]\nsteps = \xff\n", "is not UTF-8 text"),  # a raw UnicodeDecodeError before
        (b"[rl\nsteps = 5\n", "is not valid TOML"),
        (b"x = " + b"[" * 100_000, "(too deeply|not valid TOML)"),
    ],
)
def test_a_bad_config_file_is_a_config_error_naming_it(
    tmp_path: Path, raw: bytes, says: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_bytes(raw)
    with pytest.raises(ConfigError, match=rf"config file '.*bad\.toml' .*{says}"):
        load_run_config(path, ["rl.steps=3"])
    assert set_values(path, ["rl.steps=3"]) == {"rl.steps": "3"}  # the file sets nothing


@pytest.mark.parametrize("sets", [["task=clock", "rl.n=2"], ["model.name=tiny-llama"]])
def test_config_toml_reads_back_into_the_same_class(tmp_path: Path, sets: list[str]) -> None:
    cfg = load_run_config(None, sets)
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg))
    again = load_run_config(path)
    assert type(again) is type(cfg) and again == cfg


def test_a_plain_run_config_runs_the_default_workload_and_a_foreign_one_is_refused() -> None:
    plain = apply_override(RunConfig(), "rl.steps=3")
    full = plain.for_workload()
    assert type(full) is ReferenceRunConfig and full.rl.steps == 3
    assert full.task == ReferenceRunConfig().task  # the class's defaults for its own keys
    plain.validate()  # RunConfig's own keys check without the workload's
    with pytest.raises(ConfigError, match=r"workload 'hf' takes a HFRunConfig"):
        ReferenceRunConfig(workload="hf").validate()
    with pytest.raises(ConfigError, match="workload 'digits' takes a ReferenceRunConfig"):
        HFRunConfig(workload="digits").for_workload()


def test_a_workload_whose_config_is_not_a_run_config_is_refused() -> None:
    class Odd(DigitsWorkload):
        config = dict  # type: ignore[assignment]

    registry.register("workload", "odd-test", Odd, replace=True)
    try:
        with pytest.raises(ConfigError, match="must be a RunConfig subclass"):
            config_class("odd-test")
    finally:
        registry._registry.factories["workload"].pop("odd-test", None)


def test_an_unknown_runtime_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"runtime.kind must be 'local' or a registered"):
        load_run_config(None, ["runtime.kind=k8s"])


def test_a_registered_runtime_places_the_engines(tmp_path: Path) -> None:
    """A runtime of a user's (here: the local one, watched) gets one factory per rollout
    engine and the trainer's; what it yields is what the run uses and reports."""
    seen: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def watched(
        cfg: RunConfig,
        *,
        rollout: Sequence[Callable[[], InferenceEngine]],
        trainer: Callable[[], TrainEngine],
        platform: str,
    ) -> AsyncIterator[Placed]:
        seen.update(rollout=len(rollout), platform=platform, cfg=type(cfg).__name__)
        async with local_runtime(cfg, rollout=rollout, trainer=trainer, platform=platform) as p:
            yield dataclasses.replace(
                p, where="watched (1 box)", placement={"rollout-0": "box"}, trainer_label="box"
            )
        seen["closed"] = True

    registry.register("runtime", "watched-test", watched, replace=True)
    try:
        cfg = load_run_config(
            None, [*QUICK, "runtime.kind=watched-test", "rollout.engines=2", "train.process=false"]
        )
        out = asyncio.run(run(cfg, tmp_path / "run")).summary
    finally:
        registry._registry.factories["runtime"].pop("watched-test", None)
    assert seen == {"rollout": 2, "platform": "cpu", "cfg": "ReferenceRunConfig", "closed": True}
    assert out.runtime == "watched (1 box)" and out.trainer == "box" and out.steps == 2
    assert out.extra["placement"] == {"rollout-0": "box"}


DATA = Path(__file__).parent / "data"


def test_a_config_toml_written_before_the_move_still_loads(tmp_path: Path) -> None:
    """Files ``asyncflow run`` wrote before the workload keys moved (every workload's keys,
    at their defaults but the run's own) load into their workload's class, so old run folders
    still ``--resume``; a retired key with a value of its own is still an error."""
    digits = load_run_config(DATA / "config-before-26-digits.toml")
    assert type(digits) is ReferenceRunConfig and digits.rl.steps == 5
    assert digits.workload_name() == "digits"
    hf = load_run_config(DATA / "config-before-26-hf.toml")
    assert type(hf) is HFRunConfig and hf.model.name == "tiny-qwen2" and hf.data.max_tokens == 8
    text = (DATA / "config-before-26-digits.toml").read_text()
    assert 'prompt_field = "question"' in text
    bad = text.replace('prompt_field = "question"', 'prompt_field = "q"')
    assert bad != text
    path = tmp_path / "config.toml"
    path.write_text(bad)
    with pytest.raises(ConfigError, match=r"needs exactly one of model\.path"):
        load_run_config(path)  # a data key of its own: an hf config without a model
    # --resume reads an old run folder's config.toml, with the keys that may change
    old_run = tmp_path / "run"
    old_run.mkdir()
    (old_run / "config.toml").write_text(text)
    resumed = _resume_config(old_run, ["rl.steps=9"])
    assert type(resumed) is ReferenceRunConfig and resumed.rl.steps == 9


def test_a_rollout_engine_that_cannot_be_built_closes_the_trainer() -> None:
    closed: list[str] = []

    class Trainer:
        async def close(self) -> None:
            closed.append("trainer")

    def trainer(model: Any, *, cfg: Any, threads: int, platform: str) -> Any:
        return Trainer()

    def refuses(model: Any, *, cfg: Any, index: int, threads: int) -> Any:
        raise ConfigError("rollout.engine = 'refuses-test' cannot serve this model")

    registry.register("trainer", "closing-test", trainer, replace=True)
    registry.register("rollout", "refuses-test", refuses, replace=True)
    try:
        cfg = load_run_config(
            None, [*QUICK, "rollout.engine=refuses-test", "train.engine=closing-test"]
        )
        with pytest.raises(ConfigError, match="cannot serve this model"):
            asyncio.run(run(cfg))
    finally:
        registry._registry.factories["trainer"].pop("closing-test", None)
        registry._registry.factories["rollout"].pop("refuses-test", None)
    assert closed == ["trainer"]
