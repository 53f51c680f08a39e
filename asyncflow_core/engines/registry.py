"""Named factories the main job (``asyncflow run``, ``asyncflow_core.job``) builds from, open to
third parties through entry points.

Four kinds, each an entry-point group a package can add to (in its ``pyproject.toml``)::

    [project.entry-points."asyncflow.workloads"]        # a model with its data and reward
    mymodel = "my_package.job:MyWorkload"
    [project.entry-points."asyncflow.rollout_engines"]  # an InferenceEngine factory
    myengine = "my_package.job:make_rollout"
    [project.entry-points."asyncflow.train_engines"]    # a TrainEngine factory
    mytrainer = "my_package.job:make_trainer"
    [project.entry-points."asyncflow.runtimes"]         # where the engines run
    mycluster = "my_package.job:my_runtime"

then ``asyncflow run --set workload=mymodel --set rollout.engine=myengine``. The factories'
contracts:

* workload: ``make(cfg, out_dir) -> Workload`` (below), ``cfg`` being the job's config: an
  instance of the factory's ``config`` attribute, a ``RunConfig`` subclass adding the
  workload's own keys (``asyncflow_core.job.config``; ``asyncflow run --keys --set
  workload=NAME`` lists them). Optional attributes of the factory: ``config``, ``runtimes``
  (the ``runtime.kind`` values it has been tried on, the others refused; default: any) and
  an ``agent_loop`` method (the workload is agentic: ``agent.*`` apply);
* rollout engine: ``make(model, *, cfg, index, threads) -> InferenceEngine`` for the
  ``index``-th rollout instance, ``model`` being what ``Workload.initial_model`` returned;
* trainer: ``make(model, *, cfg, threads, platform) -> TrainEngine`` (``platform``: the
  resolved platform's name);
* runtime: ``make(cfg, *, rollout, trainer, platform)``, an async context manager yielding
  ``asyncflow_core.job.run.Placed`` (``rollout``: one zero-argument factory per rollout
  engine; ``trainer``: the trainer's); ``local`` is the job's own.

A factory raises ``ConfigError`` for a model or configuration it cannot serve (naming the key
to change). This repository registers the workloads ``digits`` and ``agent`` (the reference
model on a built-in task) and ``hf`` (Hugging Face models, data and rewards), the rollout
engines ``torch`` and ``hf``, the trainers ``torch``, ``deepspeed`` and ``hf`` and the runtime
``ray``. ``register`` adds one in-process (tests, notebooks).
"""

from __future__ import annotations

import difflib
import importlib.metadata
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from asyncflow_core.contracts.errors import ConfigError
from asyncflow_core.contracts.protocols import InferenceEngine, SamplingParams, TrainEngine

Kind = Literal["workload", "rollout", "trainer", "runtime"]
GROUPS: dict[Kind, str] = {
    "workload": "asyncflow.workloads",
    "rollout": "asyncflow.rollout_engines",
    "trainer": "asyncflow.train_engines",
    "runtime": "asyncflow.runtimes",
}
_KEYS: dict[Kind, str] = {
    "workload": "workload",
    "rollout": "rollout.engine",
    "trainer": "train.engine",
    "runtime": "runtime.kind",
}


@runtime_checkable
class Workload(Protocol):
    """What a kind of model gives the main job: the initial policy (built, warmed up), the
    prompt stream, the reward, the sampling, an evaluation and what to leave in the run
    folder. ``reward`` returns NaN for a row whose reward failed (the workload reports why);
    the job then trains the row's group without it."""

    label: str
    """A short name for summaries (e.g. ``reverse-3``, ``gsm8k.jsonl``)."""
    rollout_engine: str
    """The rollout engine ``rollout.engine = "auto"`` picks."""
    train_engine: str
    """The trainer ``train.engine = "auto"`` picks."""

    async def initial_model(self) -> Any: ...

    def prompts(self, seed: int) -> Iterable[Sequence[int]]: ...

    def reward(self, prompt: Sequence[int], response: Sequence[int]) -> float: ...

    def sampling(self, temperature: float, top_p: float, top_k: int) -> SamplingParams: ...

    async def evaluate(
        self, engine: InferenceEngine, prompts: int, seed: int
    ) -> tuple[float, float]: ...

    async def finish(self, trainer: TrainEngine, out_dir: Path | None) -> dict[str, Any]: ...


class _Registry:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.factories: dict[Kind, dict[str, Callable[..., Any]]] = {k: {} for k in GROUPS}
        self.sources: dict[Kind, dict[str, str]] = {k: {} for k in GROUPS}
        self.entry_points: dict[Kind, dict[str, importlib.metadata.EntryPoint]] | None = None


_registry = _Registry()


def _check_kind(kind: object) -> Kind:
    if kind not in GROUPS:
        raise ConfigError(f"registry kind must be one of {sorted(GROUPS)}, got {kind!r}")
    return kind


def _entry_points() -> dict[Kind, dict[str, importlib.metadata.EntryPoint]]:
    with _registry.lock:
        if _registry.entry_points is None:
            _registry.entry_points = {
                kind: {ep.name: ep for ep in importlib.metadata.entry_points(group=group)}
                for kind, group in GROUPS.items()
            }
        return _registry.entry_points


def register(kind: Kind, name: str, factory: Callable[..., Any], *, replace: bool = False) -> None:
    """Add ``factory`` under ``name`` (in this process). A name taken by another factory is
    refused unless ``replace``."""
    kind = _check_kind(kind)
    if not isinstance(name, str) or not name or name == "auto":
        raise ConfigError(f"a {kind} name must be a non-empty str other than 'auto', got {name!r}")
    if not callable(factory):
        raise ConfigError(f"the {kind} factory {name!r} must be callable, got {factory!r:.60}")
    with _registry.lock:
        taken = _registry.factories[kind].get(name)
        if taken is not None and taken is not factory and not replace:
            raise ConfigError(
                f"a {kind} named {name!r} is already registered ({_registry.sources[kind][name]});"
                " pass replace=True to replace it"
            )
        _registry.factories[kind][name] = factory
        _registry.sources[kind][name] = "register()"


def names(kind: Kind) -> list[str]:
    """The registered names of ``kind`` (entry points included), sorted."""
    kind = _check_kind(kind)
    found = set(_entry_points()[kind])
    with _registry.lock:
        found |= set(_registry.factories[kind])
    return sorted(found)


def get(kind: Kind, name: str) -> Callable[..., Any]:
    """The factory registered as ``name``: ``ConfigError`` naming the config key, the known
    names and the entry-point group for an unknown one, and the import error for one whose
    package does not load (e.g. its extra is not installed)."""
    kind = _check_kind(kind)
    with _registry.lock:
        factory = _registry.factories[kind].get(name)
    if factory is not None:
        return factory
    ep = _entry_points()[kind].get(name) if isinstance(name, str) else None
    if ep is None:
        known = names(kind)
        close = difflib.get_close_matches(str(name), known, n=1)
        guess = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{_KEYS[kind]} = {name!r} is not a registered {kind}{guess}; the known ones are "
            f"{', '.join(known) or 'none'}; a package adds one through the {GROUPS[kind]!r} "
            "entry-point group"
        )
    dist = getattr(getattr(ep, "dist", None), "name", None)
    where = f"entry point {ep.name} = {ep.value}" + (f" (from {dist})" if dist else "")
    try:
        loaded = ep.load()
    except ImportError as exc:
        top = ep.value.split(".")[0].split(":")[0]
        extra = top.removeprefix("asyncflow_") if top.startswith("asyncflow_") else ""
        hint = (
            f"pip install 'asyncflow[{extra}]'"
            if dist in (None, "asyncflow") and extra
            else f"install {dist or top} with what it needs"
        )
        raise ConfigError(
            f"{_KEYS[kind]} = {name!r} needs a package that does not import here ({where}: "
            f"{exc}); {hint}"
        ) from exc
    if not callable(loaded):
        raise ConfigError(f"{where} is not callable ({type(loaded).__name__})")
    with _registry.lock:
        _registry.factories[kind].setdefault(name, loaded)
        _registry.sources[kind].setdefault(name, where)
        return _registry.factories[kind][name]


def trainer_options(cfg: Any) -> dict[str, Any]:
    """The options every trainer of the main job is built with, from its ``RunConfig``
    (``train.lr``, ``weight_decay``, ``max_grad_norm``, ``micro_batch_size``, ``seed``, the
    rollout's ``temperature`` and, when they are not the default, ``lr_warmup_steps`` and
    ``minibatches``): a trainer factory passes them on."""
    t = cfg.train
    options = {
        "lr": t.lr,
        "weight_decay": t.weight_decay,
        "max_grad_norm": t.max_grad_norm,
        "micro_batch_size": t.micro_batch_size,
        "seed": cfg.seed,
        "temperature": cfg.rollout.temperature,
    }
    warmup = cfg.lr_warmup_steps() if callable(getattr(cfg, "lr_warmup_steps", None)) else 0
    if warmup:  # only then: a trainer without the option is not handed it
        options["lr_warmup_steps"] = warmup
    minibatches = getattr(t, "minibatches", 1)
    if minibatches != 1:  # likewise
        options["minibatches"] = minibatches
    return options


def is_failed_reward(value: float) -> bool:
    """A reward that marks its row as failed (NaN)."""
    return isinstance(value, float) and math.isnan(value)


__all__ = [
    "GROUPS",
    "Workload",
    "get",
    "is_failed_reward",
    "names",
    "register",
    "trainer_options",
]
