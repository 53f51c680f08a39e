"""Engines as Ray actors: ``RayInferenceEngine`` and ``RayTrainEngine``.

Each proxy stands for one engine that lives in a Ray actor, anywhere in the cluster, and
implements the engine protocols (``InferenceEngine`` / ``TrainEngine``) by forwarding::

    from functools import partial

    rollout = RayInferenceEngine.create(partial(TorchInferenceEngine, config, seed=1))
    trainer = RayTrainEngine.create(partial(TorchTrainEngine, config), platform="cuda")
    result = await rollout.generate(request)           # runs in the actor
    await trainer.close(); await rollout.close()      # engine closed, actor gone

**The actor.** One generic host class (``_EngineHost``, made a Ray actor at run time: Ray is
imported lazily, through ``asyncflow_ray.runtime.import_ray``) builds the engine from
``factory``, a zero-argument callable (or one returning an awaitable of the engine) that
Ray's cloudpickle carries to the actor: ``functools.partial(TorchInferenceEngine, config,
seed=1)``, a module-level function, even a lambda. Classes and functions it names are
pickled *by reference*, so their module must be importable in the actor's worker (installed
on every node, ``runtime_env={"py_modules": [...]}``, or registered with
``ray.cloudpickle.register_pickle_by_value``). The host is an *async* actor: every call is a
coroutine on the actor's one event loop, so concurrent ``generate`` calls batch in the engine
and ``abort`` / ``pause`` / ``load_weights`` run while generations are in flight. The
``generate`` calls a caller makes in one turn of its event loop travel in **one** actor call
and their results stream back one by one as they finish (``RayInferenceEngine``).
``max_concurrency`` bounds the calls the actor runs at once (default
``DEFAULT_MAX_CONCURRENCY``); calls beyond it queue in Ray, *control calls included*: keep it
above the number of requests you keep in flight, or a ``resume()`` can queue behind requests
that wait for it.

**Abilities.** The optional abilities (``SupportsPause``, ``SupportsSleep``,
``SupportsLoadWeights``) are asked of the engine once it is built; the proxy's class is
composed from the matching mixins, so ``isinstance(proxy, SupportsPause)`` holds exactly when
it holds for the engine in the actor.

**Placement.** ``create(factory, platform="cpu", devices=1.0)`` reserves ``devices`` of the
platform's Ray resource (``asyncflow_ray.runtime.resources_for``: ``CPU``, ``GPU``, ``NPU``,
...); ``node_id`` pins the actor to one node; ``runtime_env`` and any other Ray actor option
pass through. Before creating the actor the proxy checks that some alive node (the pinned one,
if any) *has* that much of each resource in total, and raises ``ConfigError`` naming the
resource and the cluster's resources otherwise: Ray itself would wait forever for a resource
no node has. (Pass ``check_resources=False`` on an autoscaling cluster that adds such nodes on
demand.) A resource that exists but is taken waits, at most ``start_timeout_s``.

**Data on the wire.** Every strided CPU tensor in the arguments and results (a ``Batch``'s
fields and lengths, weight buckets, log-probs) crosses as a flat ``uint8`` numpy view of its
bytes, which Ray moves out of band through its object store (zero-copy on the node); a
pickled torch tensor goes through torch's own reducer, in band. Measured on the 2-core dev
box, a 50 MB fp32 tensor to an actor and back took 0.15-0.18 s this way (copies included)
against 0.3 s as torch tensors (1.3 s on the first call; one way on a first call, 0.14 s vs
2.2 s). The receiver copies the bytes once into a tensor of its own (the store's buffers are
read-only, and a tensor kept past the call must not pin them), restoring dtype, shape and
``requires_grad``. Tensors on an accelerator cross as CPU tensors; other tensors (nested,
sparse, meta, subclasses) and everything else travel as Ray pickles them.

**Versions.** ``weight_version`` is a synchronous property, so the proxy caches it. Every
reply of the actor carries the engine's version and a sequence number taken on the actor's
loop; the cache keeps the version of the newest reply, so a slow reply can never roll back the
version a later ``load_weights`` reported. ``refresh_version()`` asks the actor.

**Errors.** An engine's own error comes back as the same exception (type and message; its
traceback in the actor as a note); one that does not pickle comes back as ``EngineError``
with its text. If the actor dies (killed, its process or node lost) the call in flight and
every later call raise ``WorkerLostError`` naming the engine and the actor: the engine's
state (weights, requests) is gone, build a new one. An actor that is only unreachable for a
moment gives ``EngineUnavailableError`` (the call may or may not have run). Cancelling a
call (e.g. a task awaiting ``generate``) cancels it in the actor, where the engine drops the
request.

**Restarts.** ``RayInferenceEngine.create(..., max_restarts=N)`` lets Ray restart a dead
rollout actor up to N times. A restart is never silent: the calls in flight and every later
call raise ``WorkerLostError`` (``lost`` is True) until ``await proxy.restart()``, which
waits for the new actor and builds a fresh engine there from the same factory (so its
weights and version are the factory's: load the current weights before using it; the RL job
does, and routes to it again only then). A failure of a call sent before the restart never
marks the restarted engine lost. Trainers refuse ``max_restarts`` (a restarted trainer would
have lost its optimizer state), and ``max_task_retries`` is refused everywhere (a retried
call could run twice).

**Creation** is ``create(...)`` (blocking until the engine is built) or ``await
create_async(...)`` (from a coroutine: the loop keeps running). ``close()`` closes the engine
in the actor (its ``close()``, if it has one) and kills the actor; idempotent. ``run(fn,
*args)`` runs ``fn(engine, *args)`` in the actor, for what an engine offers beyond the
protocols (counters, its weights in a test). A proxy pickles as its actor handle, so it can
be handed to another Ray task or actor of the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import os
import threading
import traceback
import weakref
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NoReturn, Self, TypeVar

import numpy as np
import torch

from asyncflow_core.contracts.errors import (
    AsyncFlowError,
    ConfigError,
    EngineError,
    EngineLostError,
    EngineUnavailableError,
)
from asyncflow_core.contracts.protocols import (
    Batch,
    GenerationRequest,
    GenerationResult,
    InferenceEngine,
    LossFn,
    SupportsLoadWeights,
    SupportsPause,
    SupportsSleep,
    TrainEngine,
    TrainMetrics,
    Version,
    WeightBucket,
)
from asyncflow_core.infra.checkpoint import failpoint
from asyncflow_core.infra.platform import Platform, get_platform
from asyncflow_ray.runtime import (
    alive_nodes,
    bytes_tensor,
    first_line,
    import_ray,
    resources_for,
    tensor_bytes,
)

__all__ = [
    "DEFAULT_EXPORT_PREFETCH",
    "DEFAULT_MAX_CONCURRENCY",
    "DEFAULT_START_TIMEOUT_S",
    "RayInferenceEngine",
    "RayTrainEngine",
    "WorkerLostError",
]

DEFAULT_MAX_CONCURRENCY = 4096
"""Calls an engine's actor runs at once (Ray's ``max_concurrency`` of an async actor)."""

DEFAULT_START_TIMEOUT_S = 300.0
"""How long ``create`` waits for the actor to be placed and the engine built."""

DEFAULT_EXPORT_PREFETCH = 2
"""Weight buckets the actor may produce ahead of the consumer of ``export_weights``."""

DEFAULT_CLOSE_TIMEOUT_S = 30.0
"""How long ``close`` waits for the engine's own ``close()`` before killing the actor."""

DEFAULT_MAX_BATCH_REQUESTS = 512
"""Most ``generate`` requests one actor call carries (``RayInferenceEngine``'s batching)."""

ABILITIES: dict[str, type] = {
    "pause": SupportsPause,
    "sleep": SupportsSleep,
    "load_weights": SupportsLoadWeights,
}
"""The optional abilities a proxy mirrors, by the name ``abilities`` reports them under."""

_METHODS = frozenset(
    {
        "generate",
        "abort",
        "pause",
        "resume",
        "sleep",
        "wake_up",
        "load_weights",
        "compute_logprobs",
        "train_step",
        "save_checkpoint",
        "load_checkpoint",
    }
)
"""The engine methods the host forwards (nothing else can be called by name)."""

_REFUSED_OPTIONS = {
    "max_task_retries": "a retried call could run twice (a train step applied twice)",
}

Reply = tuple[str, Any, Version, int]
"""What the host answers: (kind, payload, engine version, sequence number)."""


class WorkerLostError(EngineLostError):
    """The Ray actor hosting an engine is gone (killed, its process or node died): the engine's
    state (weights, requests in flight) is lost. Every later call on the proxy raises it too.
    ``engine`` names the engine, ``actor_id`` its actor. An RL job sends a lost rollout
    actor's requests to the other rollout engines (``EngineLostError``)."""

    def __init__(self, message: str, engine: str = "", actor_id: str = "") -> None:
        super().__init__(message)
        self.engine = engine
        self.actor_id = actor_id

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.engine, self.actor_id))


# --------------------------------------------------------------------------------------------
# Tensors on the wire
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _WireTensor:
    """A tensor as a flat ``uint8`` numpy array of its bytes (Ray moves it out of band)."""

    data: np.ndarray[Any, np.dtype[np.uint8]]
    dtype: str
    shape: tuple[int, ...]
    requires_grad: bool

    @staticmethod
    def fits(t: torch.Tensor) -> bool:
        return (
            type(t) in (torch.Tensor, torch.nn.Parameter)
            and t.layout == torch.strided
            and not t.is_nested
            and not t.is_quantized
            and t.device.type != "meta"
        )

    @staticmethod
    def of(t: torch.Tensor) -> _WireTensor:
        data = tensor_bytes(t.detach().resolve_conj().resolve_neg().cpu())
        name = str(t.dtype).removeprefix("torch.")
        return _WireTensor(data, name, tuple(t.shape), bool(t.requires_grad))

    def tensor(self) -> torch.Tensor:
        # a private copy: writable, aligned, ours
        t = bytes_tensor(self.data, self.dtype, copy=True).reshape(self.shape)
        return t.requires_grad_(True) if self.requires_grad else t


def _pack(obj: Any) -> Any:
    """``obj`` with every tensor that ``_WireTensor`` fits replaced by one (inside lists,
    tuples, dicts, a ``Batch`` or a ``WeightBucket``); anything else unchanged."""
    if isinstance(obj, torch.Tensor):
        return _WireTensor.of(obj) if _WireTensor.fits(obj) else obj
    if type(obj) in (list, tuple):
        return type(obj)(_pack(x) for x in obj)
    if type(obj) is dict:
        return {k: _pack(v) for k, v in obj.items()}
    if type(obj) is Batch:
        return Batch(obj.rows, _pack(obj.data), _pack(obj.lengths), obj.tags)
    if type(obj) is WeightBucket:
        return WeightBucket(obj.names, _pack(obj.tensors))
    return obj


def _unpack(obj: Any) -> Any:
    """The inverse of ``_pack``."""
    if isinstance(obj, _WireTensor):
        return obj.tensor()
    if type(obj) in (list, tuple):
        return type(obj)(_unpack(x) for x in obj)
    if type(obj) is dict:
        return {k: _unpack(v) for k, v in obj.items()}
    if type(obj) is Batch:
        return Batch(obj.rows, _unpack(obj.data), _unpack(obj.lengths), obj.tags)
    if type(obj) is WeightBucket:
        return WeightBucket(obj.names, _unpack(obj.tensors))
    return obj


# --------------------------------------------------------------------------------------------
# The actor
# --------------------------------------------------------------------------------------------
def _portable(exc: BaseException, where: str) -> BaseException:
    """``exc`` with its traceback in the actor as a note, or an ``EngineError`` carrying its
    text when the exception itself does not pickle."""
    ray = import_ray()
    tb = "".join(traceback.format_exception(exc))
    try:
        exc.add_note(f"(raised in {where}; its traceback follows)\n{tb}")
        ray.cloudpickle.loads(ray.cloudpickle.dumps(exc))
        return exc
    except Exception:
        return EngineError(f"{type(exc).__name__}: {exc} (raised in {where})\n{tb}")


@dataclass(frozen=True, slots=True)
class _Started:
    """What the host reports once the engine is built."""

    engine_type: str
    roles: tuple[str, ...]
    abilities: tuple[str, ...]
    actor_id: str
    node_id: str
    pid: int


class _EngineHost:
    """The body of an engine's actor (see the module docstring); made a Ray actor class by
    ``_host_class``. Every method answers a ``Reply``; the engine's errors are answers too."""

    def __init__(self) -> None:
        self._engine: Any = None
        self._name = ""
        self._where = "a Ray actor"
        self._seq = itertools.count(1)
        self._running: dict[str, set[asyncio.Task[Any]]] = {}  # generate_many's, by request id

    def _reply(self, kind: str, payload: Any) -> Reply:
        version = self._engine.weight_version if self._engine is not None else 0
        return (kind, payload, int(version), next(self._seq))

    def _error(self, exc: BaseException) -> Reply:
        return self._reply("err", _portable(exc, self._where))

    def _no_engine(self, method: str) -> Reply:
        """The answer of a restarted actor (Ray ran ``__init__`` again, not ``start``) to a
        call sent before its proxy saw the restart: the engine it was meant for is gone."""
        context = import_ray().get_runtime_context()
        return self._reply(
            "err",
            WorkerLostError(
                f"the Ray actor {context.get_actor_id()} restarted and holds no engine yet: "
                f"the engine's weights and requests were lost ({method} did not run); "
                "restart() the proxy",
                actor_id=str(context.get_actor_id()),
            ),
        )

    async def start(self, factory: Callable[[], Any], name: str) -> Reply:
        context = import_ray().get_runtime_context()
        if self._engine is not None:  # a restart() of an actor that did not die: start over
            for tasks in list(self._running.values()):
                for task in list(tasks):
                    task.cancel()
            await self.stop()
            self._engine = None
        self._name = name
        self._where = f"engine {name!r} (Ray actor {context.get_actor_id()})"
        try:
            engine = factory()
            if inspect.isawaitable(engine):
                engine = await engine
        except Exception as e:
            return self._error(e)
        roles = tuple(
            role
            for role, protocol in (("inference", InferenceEngine), ("train", TrainEngine))
            if isinstance(engine, protocol)
        )
        abilities = tuple(n for n, protocol in ABILITIES.items() if isinstance(engine, protocol))
        self._engine = engine
        self._where = f"{type(engine).__name__} {self._where}"
        try:
            started = _Started(
                type(engine).__name__,
                roles,
                abilities,
                str(context.get_actor_id()),
                str(context.get_node_id()),
                os.getpid(),
            )
            return self._reply("ok", started)
        except Exception as e:  # weight_version itself failed
            return self._error(e)

    async def call(self, method: str, args: tuple[Any, ...]) -> Reply:
        if method not in _METHODS:
            return self._error(EngineError(f"{self._where}: no engine method {method!r}"))
        if self._engine is None:
            return self._no_engine(method)
        failpoint(f"ray.{self._name}.{method}")  # e.g. ray.rollout-1.generate=30
        if method == "abort":
            # the tasks of requests that generate_many started before this call have not run
            # yet (a task starts on the loop's next turn): let them register with the engine
            # first, or an abort sent right after its request would miss it
            await asyncio.sleep(0)
        try:
            result = await getattr(self._engine, method)(*_unpack(args))
            return self._reply("ok", _pack(result))
        except Exception as e:
            return self._error(e)

    async def generate_many(self, requests: list[GenerationRequest]) -> AsyncIterator[Reply]:
        """Many ``generate`` calls in one actor call: every request runs as a task of its own
        on this loop (so they batch in the engine, as separate calls would), and the results
        stream back as they finish, those finished together in one ``("items", [(index,
        result or error, failed)])`` reply; then ``("end", None)``. ``cancel_requests``
        cancels some of them; cancelling the stream cancels those still running."""
        if self._engine is None:
            yield self._no_engine("generate")
            return
        tasks: dict[asyncio.Task[Any], int] = {}
        for i, request in enumerate(requests):
            failpoint(f"ray.{self._name}.generate")  # counted per request, as by ``call``
            task = asyncio.ensure_future(self._engine.generate(_unpack(request)))
            tasks[task] = i
            self._running.setdefault(request.request_id, set()).add(task)
        pending = set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                items: list[tuple[int, Any, bool]] = []
                for task in done:
                    self._forget(requests[tasks[task]].request_id, task)
                    if task.cancelled():  # by cancel_requests: its caller gave up on it
                        continue
                    error = task.exception()
                    if error is None:
                        items.append((tasks[task], _pack(task.result()), False))
                    else:
                        items.append((tasks[task], _portable(error, self._where), True))
                if items:
                    yield self._reply("items", items)
        finally:
            for task in pending:  # the stream itself was cancelled: drop what still runs
                task.cancel()
                self._forget(requests[tasks[task]].request_id, task)
        yield self._reply("end", None)

    def _forget(self, request_id: str, task: asyncio.Task[Any]) -> None:
        running = self._running.get(request_id)
        if running is not None:
            running.discard(task)
            if not running:
                del self._running[request_id]

    async def cancel_requests(self, request_ids: list[str]) -> Reply:
        """Cancel the tasks of these requests of ``generate_many`` (their callers gave up on
        them: the engine drops them as when a ``generate`` call is cancelled)."""
        for rid in request_ids:
            for task in list(self._running.get(rid, ())):
                task.cancel()
        return self._reply("ok", None)

    async def run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Reply:
        if self._engine is None:
            return self._no_engine("run")
        try:
            result = fn(self._engine, *_unpack(args))
            if inspect.isawaitable(result):
                result = await result
            return self._reply("ok", _pack(result))
        except Exception as e:
            return self._error(e)

    async def export(self, bucket_bytes: int) -> AsyncIterator[Reply]:
        if self._engine is None:
            yield self._no_engine("export_weights")
            return
        try:
            async for bucket in self._engine.export_weights(bucket_bytes):
                yield self._reply("item", _pack(bucket))
        except Exception as e:
            yield self._error(e)
            return
        yield self._reply("end", None)

    async def ping(self) -> Reply:
        if self._engine is None:
            return self._no_engine("ping")
        try:
            return self._reply("ok", None)
        except Exception as e:
            return self._error(e)

    async def stop(self) -> Reply:
        close = getattr(self._engine, "close", None)
        try:
            if callable(close):
                result = close()
                if inspect.isawaitable(result):
                    await result
            return self._reply("ok", None)
        except Exception as e:
            return self._error(e)


_HOST_CLASS: Any = None


def _host_class() -> Any:
    """``_EngineHost`` as a Ray actor class (made once, on first use)."""
    global _HOST_CLASS
    if _HOST_CLASS is None:
        _HOST_CLASS = import_ray().remote(_EngineHost)
    return _HOST_CLASS


# --------------------------------------------------------------------------------------------
# Placement
# --------------------------------------------------------------------------------------------
def _needs(options: Mapping[str, Any]) -> dict[str, float]:
    """The Ray resources an actor created with ``options`` asks for."""
    need: dict[str, float] = {}
    for option, resource in (("num_cpus", "CPU"), ("num_gpus", "GPU"), ("memory", "memory")):
        value = options.get(option)
        if value:
            need[resource] = float(value)
    for resource, value in (options.get("resources") or {}).items():
        if value:
            need[str(resource)] = float(value)
    return need


def _describe(resources: Mapping[str, float]) -> str:
    shown = {k: v for k, v in sorted(resources.items()) if not k.startswith("node:")}
    return ", ".join(f"{k}={v:g}" for k, v in shown.items()) or "nothing"


def _check_resources(
    ray: Any, who: str, need: Mapping[str, float], node_id: str | None, platform: str
) -> None:
    """``ConfigError`` unless some alive node (``node_id``, if given) has ``need`` in total."""
    nodes = {n.node_id: n for n in alive_nodes()}
    if node_id is not None:
        if node_id not in nodes:
            alive = ", ".join(sorted(nodes)) or "none"
            raise ConfigError(
                f"{who}: node_id={node_id!r} is not an alive node of the Ray cluster (alive: "
                f"{alive}); pass one of those (RayRuntime.nodes()) or leave node_id unset"
            )
        candidates = [nodes[node_id]]
    else:
        candidates = list(nodes.values())
    for node in candidates:
        if all(node.resources.get(k, 0.0) >= v for k, v in need.items()):
            return
    where = f"node {node_id}" if node_id is not None else "any node of the Ray cluster"
    totals = {k: float(v) for k, v in ray.cluster_resources().items()}
    raise ConfigError(
        f"{who}: {where} lacks the resources the engine asks for ({_describe(need)}, "
        f"platform {platform!r}); the cluster has {_describe(totals)} over {len(nodes)} "
        "node(s). Add nodes that have them (`ray start --num-gpus=N` or "
        "`--resources='{\"NPU\": N}'`), ask for fewer devices or another platform, or pass "
        "check_resources=False if an autoscaler adds such nodes on demand"
    )


# --------------------------------------------------------------------------------------------
# The proxies
# --------------------------------------------------------------------------------------------
_P = TypeVar("_P", bound="_RayEngine")
_names = itertools.count(1)
_classes: dict[tuple[type, frozenset[str], bool], type] = {}
_classes_lock = threading.Lock()


class _RayEngine:
    """What both proxies share: creation, the version cache, calls and error mapping."""

    _role: ClassVar[str] = ""
    _protocol: ClassVar[str] = ""
    _restartable: ClassVar[bool] = False

    def __init__(
        self, handle: Any, name: str, started: _Started, version: Version, seq: int
    ) -> None:
        """Use ``create`` / ``create_async``; this wraps an actor already started."""
        self.name = name
        self.engine_type = started.engine_type
        self.abilities = frozenset(started.abilities)
        self.node_id = started.node_id
        self.pid = started.pid
        self._handle = handle
        self.actor_id = started.actor_id
        self._version = version
        self._seq = seq
        self._closed = False
        self._lost: str | None = None
        self.max_restarts = 0
        """Restarts Ray may make of this engine's actor (``create(..., max_restarts=)``)."""
        self.restarts = 0
        """Times ``restart()`` brought the engine back; calls are tagged with it, so the failure
        of a call sent before a restart never marks the restarted engine lost."""
        self._factory: Callable[[], Any] | None = None
        self._start_timeout_s = DEFAULT_START_TIMEOUT_S

    # -- creation ------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        factory: Callable[[], Any],
        *,
        platform: str | Platform = "cpu",
        devices: float = 1.0,
        name: str | None = None,
        node_id: str | None = None,
        runtime_env: Mapping[str, Any] | None = None,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        check_resources: bool = True,
        max_restarts: int = 0,
        **actor_options: Any,
    ) -> Self:
        """Start an actor that builds the engine with ``factory()`` and return its proxy, once
        the engine is built (blocking, at most ``start_timeout_s``; from a coroutine, prefer
        ``create_async``). ``platform`` / ``devices``: the Ray resource to reserve
        (``resources_for``); ``name``: the engine's name in messages and the Ray actor's name
        (unique in the runtime's namespace; default: a generated one, and no Ray name);
        ``node_id``: pin the actor to that node; ``runtime_env``, ``**actor_options``: Ray
        actor options (they override the resource options); ``max_restarts``: restarts Ray
        may make of a dead actor (``RayInferenceEngine`` only; see "Restarts" in the module
        docstring). Raises ``ConfigError`` for bad options or resources no node has,
        ``EngineError`` if the factory failed (its error as ``__cause__``) or the engine did
        not start in time."""
        ray = import_ray()
        handle, ref, who = cls._launch(
            ray, factory, platform, devices, name, node_id, runtime_env, max_concurrency,
            start_timeout_s, check_resources, max_restarts, actor_options,
        )  # fmt: skip
        try:
            reply = ray.get(ref, timeout=start_timeout_s)
        except BaseException as e:
            cls._start_failed(ray, handle, who, e, start_timeout_s)
        return cls._started(ray, handle, who, reply, factory, start_timeout_s, max_restarts)

    @classmethod
    async def create_async(
        cls,
        factory: Callable[[], Any],
        *,
        platform: str | Platform = "cpu",
        devices: float = 1.0,
        name: str | None = None,
        node_id: str | None = None,
        runtime_env: Mapping[str, Any] | None = None,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        check_resources: bool = True,
        max_restarts: int = 0,
        **actor_options: Any,
    ) -> Self:
        """``create`` for a coroutine: the event loop keeps running while the engine builds."""
        ray = import_ray()
        handle, ref, who = cls._launch(
            ray, factory, platform, devices, name, node_id, runtime_env, max_concurrency,
            start_timeout_s, check_resources, max_restarts, actor_options,
        )  # fmt: skip

        async def wait() -> Reply:
            reply: Reply = await ref
            return reply

        try:
            reply = await asyncio.wait_for(wait(), start_timeout_s)
        except BaseException as e:
            cls._start_failed(ray, handle, who, e, start_timeout_s)
        return cls._started(ray, handle, who, reply, factory, start_timeout_s, max_restarts)

    @classmethod
    def _launch(
        cls,
        ray: Any,
        factory: Callable[[], Any],
        platform: str | Platform,
        devices: float,
        name: str | None,
        node_id: str | None,
        runtime_env: Mapping[str, Any] | None,
        max_concurrency: int,
        start_timeout_s: float,
        check_resources: bool,
        max_restarts: int,
        actor_options: dict[str, Any],
    ) -> tuple[Any, Any, str]:
        """Check the options, create the actor and send it ``start``."""
        who = name if name is not None else f"ray-{cls._role}-{next(_names)}"
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigError(f"{cls.__name__}: name must be a non-empty str, got {name!r}")
        if not callable(factory):
            raise ConfigError(
                f"{who}: factory must be a zero-argument callable returning the engine (e.g. "
                f"functools.partial(MyEngine, config)), got {factory!r:.80}"
            )
        if isinstance(devices, bool) or not isinstance(devices, int | float) or devices < 0:
            raise ConfigError(f"{who}: devices must be a number >= 0, got {devices!r}")
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or (
            max_concurrency < 1
        ):  # fmt: skip
            raise ConfigError(
                f"{who}: max_concurrency must be an int >= 1, got {max_concurrency!r}"
            )
        if not start_timeout_s > 0:
            raise ConfigError(f"{who}: start_timeout_s must be > 0, got {start_timeout_s!r}")
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or (
            max_restarts < 0
        ):  # fmt: skip
            raise ConfigError(f"{who}: max_restarts must be an int >= 0, got {max_restarts!r}")
        if max_restarts and not cls._restartable:
            raise ConfigError(
                f"{who}: max_restarts={max_restarts} is not supported by {cls.__name__}: a "
                "restarted trainer would have lost its optimizer state and steps; resume the "
                "job from a checkpoint instead"
            )
        for option, why in _REFUSED_OPTIONS.items():
            if actor_options.get(option):
                raise ConfigError(
                    f"{who}: {option}={actor_options[option]!r} is not supported: {why}; "
                    "catch WorkerLostError and create a new engine instead"
                )
        if not ray.is_initialized():
            raise ConfigError(
                f"{who}: Ray is not initialised in this process; start a RayRuntime first "
                "(`with RayRuntime() as rt: ...`, asyncflow_ray.runtime)"
            )
        platform_obj = get_platform(platform) if isinstance(platform, str) else platform
        options: dict[str, Any] = resources_for(platform_obj, devices)
        extra = dict(actor_options)
        if "resources" in extra and "resources" in options:
            options["resources"] = {**options["resources"], **(extra.pop("resources") or {})}
        options.update(extra)
        options["max_concurrency"] = max_concurrency
        options["max_restarts"] = max_restarts
        options["max_task_retries"] = 0
        if runtime_env is not None:
            options["runtime_env"] = dict(runtime_env)
        if name is not None:
            options["name"] = name
        if check_resources:
            _check_resources(ray, who, _needs(options), node_id, platform_obj.name)
        if node_id is not None:
            strategy = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy
            try:
                options["scheduling_strategy"] = strategy(node_id=node_id, soft=False)
            except ValueError as e:
                raise ConfigError(f"{who}: node_id={node_id!r}: {first_line(e)}") from e
        try:
            handle = _host_class().options(**options).remote()
        except ValueError as e:  # a taken name, a bad option
            raise ConfigError(f"{who}: Ray refused the actor's options {options}: {e}") from e
        try:
            ref = handle.start.remote(factory, who)
        except Exception as e:
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
            raise ConfigError(
                f"{who}: the factory {factory!r:.120} cannot be pickled to reach the engine's "
                f"actor ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); use "
                "a function or functools.partial of a class with picklable arguments"
            ) from e
        return handle, ref, who

    @classmethod
    def _start_failed(
        cls, ray: Any, handle: Any, who: str, error: BaseException, timeout_s: float
    ) -> NoReturn:
        """Kill the actor of a failed start and raise why it failed (``error`` is the
        exception being handled)."""
        with contextlib.suppress(Exception):
            ray.kill(handle, no_restart=True)
        if isinstance(error, ray.exceptions.GetTimeoutError | TimeoutError):
            try:
                available = _describe(ray.available_resources())
            except Exception:  # pragma: no cover - the cluster went away too
                available = "unknown"
            message = (
                f"{who}: the engine's actor did not start within start_timeout_s={timeout_s} "
                f"s: it may wait for resources taken by other actors (available now: "
                f"{available}), or building the engine hung; raise start_timeout_s if it is "
                "just slow"
            )
        elif isinstance(error, ray.exceptions.RayError):
            message = (
                f"{who}: the engine's actor could not start: {_summary(error)}. If a module "
                "could not be imported there, install it on every node (asyncflow with "
                "pip install 'asyncflow[ray]'), ship it with runtime_env={'py_modules': [...]}, "
                "or register it with ray.cloudpickle.register_pickle_by_value"
            )
        else:  # cancelled, interrupted
            raise error
        raise EngineError(message) from error

    @classmethod
    def _started(
        cls,
        ray: Any,
        handle: Any,
        who: str,
        reply: Reply,
        factory: Callable[[], Any],
        start_timeout_s: float,
        max_restarts: int,
    ) -> Self:
        kind, payload, version, seq = reply
        if kind == "err":
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
            raise EngineError(
                f"{who}: building the engine in its Ray actor failed: "
                f"{type(payload).__name__}: {first_line(payload)}"
            ) from payload
        started: _Started = payload
        if cls._role not in started.roles:
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
            other = {"inference": "RayInferenceEngine", "train": "RayTrainEngine"}
            hint = "".join(f"; use {other[r]} for it" for r in started.roles)
            raise ConfigError(
                f"{who}: the factory built a {started.engine_type}, which is not "
                f"{cls._protocol} (it lacks a method or property of the protocol){hint}"
            )
        klass = _compose(cls, started.abilities, restart=max_restarts > 0)
        proxy = klass(handle, who, started, version, seq)
        proxy.max_restarts = max_restarts
        proxy._factory = factory
        proxy._start_timeout_s = start_timeout_s
        return proxy

    # -- state -----------------------------------------------------------------------------
    @property
    def weight_version(self) -> Version:
        """The engine's version as of the actor's newest reply (see the module docstring)."""
        return self._version

    @property
    def handle(self) -> Any:
        """The Ray actor handle (to pass the engine to another actor, or for ``ray.kill``)."""
        return self._handle

    @property
    def closed(self) -> bool:
        return self._closed

    async def refresh_version(self) -> Version:
        """Ask the actor for the engine's version now (and cache it)."""
        self._check_open("refresh_version")
        await self._request("refresh_version", self._handle.ping.remote())
        return self._version

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(engine, *args)`` in the actor (awaiting it if it returns an awaitable) and
        return its result; ``fn`` must pickle. For what an engine offers beyond the
        protocols (counters, ``wait_for_tokens``, reading its weights in a test)."""
        self._check_open("run")
        return await self._request("run", self._send(self._handle.run, "run", fn, args))

    async def close(self) -> None:
        """Close the engine in its actor (its ``close()``, if it has one) and kill the actor;
        idempotent. Calls still in flight end with the engine's answer or ``EngineError``."""
        if self._closed:
            return
        self._closed = True
        ray = import_ray()
        if self._lost is None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    self._await_ref(self._handle.stop.remote()), DEFAULT_CLOSE_TIMEOUT_S
                )
        with contextlib.suppress(Exception):
            ray.kill(self._handle, no_restart=True)

    def __reduce__(self) -> tuple[Any, ...]:
        """A proxy pickles as its actor handle (to hand the engine to another Ray actor or
        task of the cluster); the copy is a proxy of the same actor, its own version cache."""
        started = _Started(
            self.engine_type, (self._role,), tuple(sorted(self.abilities)), self.actor_id,
            self.node_id, self.pid,
        )  # fmt: skip
        base = next(c for c in type(self).__mro__ if c in (RayInferenceEngine, RayTrainEngine))
        return (_rebuild, (base, self._handle, self.name, started, self._version))

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("lost" if self._lost else "running")
        abilities = ",".join(sorted(self.abilities)) or "-"
        return (
            f"{type(self).__name__}({self.name!r}, {self.engine_type}, abilities={abilities}, "
            f"actor={self.actor_id[:12]}, node={self.node_id[:12]}, {state})"
        )

    # -- plumbing ----------------------------------------------------------------------------
    def _check_open(self, method: str) -> None:
        if self._closed:
            raise EngineError(f"{self.name}: {method} after close(); create a new engine")
        if self._lost is not None:
            raise WorkerLostError(f"{self._lost} ({method} was not sent)", self.name, self.actor_id)

    def _send(self, remote_method: Any, method: str, *args: Any) -> Any:
        """Submit one actor call; arguments Ray cannot pickle are an ``EngineError``."""
        try:
            return remote_method.remote(*(_pack(a) for a in args))
        except TypeError as e:
            what = ", ".join(type(a).__name__ for a in args)
            raise EngineError(
                f"{self.name}: the arguments of {method} ({what}) cannot be pickled to reach "
                f"the engine's actor: {first_line(e)}"
            ) from e

    async def _call(self, method: str, *args: Any) -> Any:
        """``engine.method(*args)`` in the actor."""
        self._check_open(method)
        ref = self._send(self._handle.call, method, method, args)
        return await self._request(method, ref, self.restarts)

    async def _await_ref(self, ref: Any) -> Any:
        return await ref

    async def _request(self, method: str, ref: Any, epoch: int | None = None) -> Any:
        """Await ``ref``'s reply: its result, or the engine's error raised here. ``epoch``:
        ``restarts`` when the call was sent (default: now)."""
        epoch = self.restarts if epoch is None else epoch
        kind, payload = self._take(await self._reply_of(method, ref, epoch), epoch)
        if kind == "err":
            raise payload
        return _unpack(payload)

    async def _reply_of(self, method: str, ref: Any, epoch: int | None = None) -> Reply:
        ray = import_ray()
        epoch = self.restarts if epoch is None else epoch
        try:
            reply: Reply = await ref
            return reply
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                ray.cancel(ref)  # an async actor cancels the call's task: the engine drops it
            raise
        except Exception as e:
            raise self._ray_error(method, e, epoch) from e

    def _take(self, reply: Reply, epoch: int | None = None) -> tuple[str, Any]:
        """A reply's kind and payload; its version updates the cache if it is the newest of
        this incarnation. A restarted actor's "no engine" answer marks the engine lost."""
        kind, payload, version, seq = reply
        current = epoch is None or epoch == self.restarts
        if current and seq > self._seq:
            self._seq, self._version = seq, version
        if kind == "err" and isinstance(payload, WorkerLostError):
            payload.engine = payload.engine or self.name
            if current and self._lost is None:
                self._lost = f"{self.name}: {payload}"
        return kind, payload

    def _ray_error(self, method: str, error: Exception, epoch: int | None = None) -> Exception:
        """What a Ray failure of a call means for the caller. ``epoch``: ``restarts`` when the
        call was sent; a failure from before a restart does not mark the engine lost."""
        ray = import_ray()
        exceptions = ray.exceptions
        if self._closed:
            return EngineError(f"{self.name}: {method} was interrupted: the engine was closed")
        if epoch is not None and epoch != self.restarts:
            return WorkerLostError(
                f"{self.name}: {method} was sent to the engine before its actor restarted and "
                f"failed ({_summary(error)}); the engine is back since",
                self.name,
                self.actor_id,
            )
        if self.max_restarts and isinstance(
            error, exceptions.ActorUnavailableError | exceptions.RayActorError
        ):
            # Ray restarts the actor (it fails the calls in flight with ActorUnavailableError)
            # with a fresh host: the engine is gone, and stays lost until restart()
            spent = isinstance(error, exceptions.ActorDiedError)
            if self._lost is None:
                self._lost = (
                    f"{self.name}: the Ray actor hosting the engine ({self.engine_type}, actor "
                    f"{self.actor_id}, node {self.node_id}) failed: {_summary(error)}. The "
                    "engine's weights and requests are lost; "
                    + (
                        f"its restarts are spent (max_restarts={self.max_restarts})"
                        if spent
                        else "restart() brings a fresh engine back once Ray restarted the actor"
                    )
                )
            return WorkerLostError(f"{self._lost} ({method} failed)", self.name, self.actor_id)
        if isinstance(error, exceptions.ActorUnavailableError):
            return EngineUnavailableError(
                f"{self.name}: the engine's Ray actor {self.actor_id} is unreachable for now "
                f"({_summary(error)}); {method} may or may not have run: retry later"
            )
        if isinstance(error, exceptions.RayActorError):
            self._lost = (
                f"{self.name}: the Ray actor hosting the engine ({self.engine_type}, actor "
                f"{self.actor_id}, node {self.node_id}) is gone: {_summary(error)}. The "
                "engine's weights and requests are lost: close() this proxy and create a new "
                "engine from its factory"
            )
            return WorkerLostError(f"{self._lost} ({method} failed)", self.name, self.actor_id)
        if isinstance(error, exceptions.RayTaskError):
            cause = getattr(error, "cause", None)
            if isinstance(cause, AsyncFlowError):
                return cause
            detail = f"{type(cause).__name__}: {first_line(cause)}" if cause else _summary(error)
            return EngineError(
                f"{self.name}: {method} failed in the engine's Ray actor before reaching the "
                f"engine ({detail}). If a class or function could not be imported there, "
                "make its module importable on every node (install it, or "
                "runtime_env={'py_modules': [...]}) or register it with "
                "ray.cloudpickle.register_pickle_by_value"
            )
        if isinstance(error, exceptions.RayError):
            return EngineError(f"{self.name}: {method} failed in Ray: {_summary(error)}")
        return error


def _rebuild(
    base: type[_RayEngine], handle: Any, name: str, started: _Started, version: Version
) -> _RayEngine:
    return _compose(base, started.abilities)(handle, name, started, version, 0)


def _summary(error: BaseException, limit: int = 400) -> str:
    """A Ray error's message on one line (Ray's are multi-line)."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    text = text or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- optional abilities ----------------------------------------------------------------------
class _PauseAbility(_RayEngine):
    async def pause(self, mode: Literal["abort", "keep"] = "abort") -> None:
        await self._call("pause", mode)

    async def resume(self) -> None:
        await self._call("resume")


class _SleepAbility(_RayEngine):
    async def sleep(self, level: int = 1) -> None:
        await self._call("sleep", level)

    async def wake_up(self) -> None:
        await self._call("wake_up")


class _LoadWeightsAbility(_RayEngine):
    async def load_weights(
        self, weights: Sequence[tuple[str, torch.Tensor]], version: Version
    ) -> None:
        await self._call("load_weights", list(weights), version)


_MIXINS: dict[str, type[_RayEngine]] = {
    "pause": _PauseAbility,
    "sleep": _SleepAbility,
    "load_weights": _LoadWeightsAbility,
}


class _RestartAbility(_RayEngine):
    """``SupportsRestart``: composed in when the engine was created with ``max_restarts``."""

    @property
    def lost(self) -> bool:
        """True from the loss of the engine's actor until ``restart()`` returns."""
        return self._lost is not None

    async def restart(self) -> None:
        """Wait for Ray to restart the engine's actor and build a fresh engine there (from the
        factory ``create`` was given); a no-op while the engine is not lost. The fresh engine
        has the factory's weights and version: load the current weights before using it.
        ``WorkerLostError`` if the actor cannot come back (its restarts are spent, or Ray
        reports it dead) or the engine did not build within ``start_timeout_s``; the engine
        then stays lost."""
        if self._closed:
            raise EngineError(f"{self.name}: restart after close(); create a new engine")
        if self._lost is None:
            return
        ray = import_ray()
        factory = self._factory
        assert factory is not None  # composed in by create() only, which sets it
        deadline = asyncio.get_running_loop().time() + self._start_timeout_s
        while True:  # a call sent while Ray restarts the actor waits for the new one
            ref = self._handle.start.remote(factory, self.name)
            try:
                left = deadline - asyncio.get_running_loop().time()
                reply: Reply = await asyncio.wait_for(self._await_ref(ref), max(left, 0.001))
                break
            except TimeoutError as e:
                with contextlib.suppress(Exception):
                    ray.cancel(ref)
                raise WorkerLostError(
                    f"{self._lost}; the engine did not restart within start_timeout_s="
                    f"{self._start_timeout_s} s",
                    self.name,
                    self.actor_id,
                ) from e
            except ray.exceptions.ActorUnavailableError:
                if asyncio.get_running_loop().time() >= deadline:
                    raise
                await asyncio.sleep(0.05)  # still restarting: ask again (bounded by deadline)
            except ray.exceptions.RayActorError as e:
                raise WorkerLostError(
                    f"{self._lost}; it cannot restart: {_summary(e)}", self.name, self.actor_id
                ) from e
        kind, payload, version, seq = reply
        if kind == "err":
            raise WorkerLostError(
                f"{self._lost}; building the engine again failed: {type(payload).__name__}: "
                f"{first_line(payload)}",
                self.name,
                self.actor_id,
            ) from payload
        started: _Started = payload
        if set(started.abilities) != set(self.abilities) or self._role not in started.roles:
            raise WorkerLostError(
                f"{self._lost}; the factory built a {started.engine_type} with abilities "
                f"{sorted(started.abilities)} this time, not {sorted(self.abilities)}",
                self.name,
                self.actor_id,
            )
        self.actor_id, self.node_id, self.pid = started.actor_id, started.node_id, started.pid
        self.restarts += 1
        self._seq, self._version = seq, version  # the new actor counts from 1 again
        self._lost = None


def _compose(base: type[_P], abilities: Sequence[str], *, restart: bool = False) -> type[_P]:
    """``base`` with the mixins of ``abilities`` (one class per combination, cached), and
    ``SupportsRestart`` when ``restart``."""
    key = (base, frozenset(abilities), restart)
    with _classes_lock:
        klass = _classes.get(key)
        if klass is None:
            mixins = tuple(_MIXINS[a] for a in ABILITIES if a in key[1])
            if restart:
                mixins = (_RestartAbility, *mixins)
            klass = type(base.__name__, (*mixins, base), {"__module__": base.__module__})
            klass.__qualname__ = base.__qualname__
            _classes[key] = klass
    return klass


# -- the two proxies -------------------------------------------------------------------------
class _Call:
    """One ``generate`` call waiting in a ``_Batcher``."""

    __slots__ = ("future", "request", "sent")

    def __init__(self, request: GenerationRequest, future: asyncio.Future[GenerationResult]):
        self.request = request
        self.future = future
        self.sent = False


class _Batcher:
    """A proxy's ``generate`` calls on one event loop: those made in one turn of the loop go
    to the actor together, in one ``generate_many`` call (at most ``max_batch_requests`` a
    call), and each caller gets its own result as it streams back."""

    def __init__(self, engine: RayInferenceEngine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.loop = loop
        self.queue: list[_Call] = []
        self.scheduled = False
        self.streams: set[asyncio.Task[None]] = set()

    async def submit(self, request: GenerationRequest) -> GenerationResult:
        call = _Call(request, self.loop.create_future())
        self.queue.append(call)
        if not self.scheduled:  # after every call made in this turn of the loop
            self.scheduled = True
            self.loop.call_soon(self.flush)
        try:
            return await call.future
        except asyncio.CancelledError:
            if call.sent:  # the caller gave up on it: the engine drops it
                self.engine._cancel_requests([request.request_id])
            raise

    def flush(self) -> None:
        """Send what is queued now (also before an ``abort``, so the abort follows the
        requests it may name, as separate calls would)."""
        self.scheduled = False
        calls = [c for c in self.queue if not c.future.done()]  # done: cancelled while queued
        self.queue = []
        size = max(1, self.engine.max_batch_requests)
        for start in range(0, len(calls), size):
            chunk = calls[start : start + size]
            try:
                stream = self.send(chunk)
            except BaseException as error:
                for call in chunk:
                    if not call.future.done():
                        call.future.set_exception(error)
                continue
            task = self.loop.create_task(self.receive(chunk, stream, self.engine.restarts))
            self.streams.add(task)
            task.add_done_callback(self.streams.discard)

    def send(self, calls: list[_Call]) -> Any:
        """One ``generate_many`` actor call for ``calls``: its stream of replies."""
        engine = self.engine
        engine._check_open("generate")
        options = {"num_returns": "streaming"}
        stream = engine._send(
            engine._handle.generate_many.options(**options), "generate",
            [c.request for c in calls],
        )  # fmt: skip
        for c in calls:
            c.sent = True
        engine.calls_sent += 1
        engine.requests_sent += len(calls)
        return stream

    async def receive(self, calls: list[_Call], stream: Any, epoch: int) -> None:
        """Hand each caller its result (or error) as the stream brings it (``epoch``: the
        engine's ``restarts`` when the stream was sent)."""
        engine = self.engine
        what = "generate"
        waiting = dict(enumerate(calls))
        try:
            while waiting:
                try:
                    ref = await stream.__anext__()
                except StopAsyncIteration:
                    break
                except Exception as e:
                    raise engine._ray_error(what, e, epoch) from e
                kind, payload = engine._take(await engine._reply_of(what, ref, epoch), epoch)
                if kind == "err":
                    raise payload
                if kind == "end":
                    break
                for i, value, failed in payload:
                    call = waiting.pop(i)
                    if call.future.done():
                        continue
                    if failed:
                        call.future.set_exception(value)
                    else:
                        call.future.set_result(_unpack(value))
            missing = sum(not c.future.done() for c in waiting.values())
            if missing:
                raise EngineError(
                    f"{engine.name}: the actor's stream of generate results ended without "
                    f"{missing} of them (it was cut)"
                )
        except BaseException as error:
            cancelled = isinstance(error, asyncio.CancelledError)
            for call in waiting.values():
                if call.future.done():
                    continue
                if cancelled:  # a future cannot hold a CancelledError: cancel it instead
                    call.future.cancel()
                else:
                    call.future.set_exception(error)
            with contextlib.suppress(Exception):
                import_ray().cancel(stream)
            if cancelled:
                raise


class RayInferenceEngine(_RayEngine):
    """An ``InferenceEngine`` in a Ray actor (see the module docstring). Build it with
    ``RayInferenceEngine.create(factory, ...)`` (or ``await create_async(...)``); it also
    implements ``SupportsPause`` / ``SupportsSleep`` / ``SupportsLoadWeights`` exactly when
    the engine does (``abilities`` names them).

    **Batched calls.** The ``generate`` calls made in one turn of the event loop (a group's
    samples, started together) travel to the actor in **one** actor call (``generate_many``,
    at most ``max_batch_requests`` requests a call): the actor runs each request as its own
    task, so they batch in the engine as separate calls would, and streams each result back
    as it finishes (results finished together share a message), so a short request never
    waits for a long one. Each caller gets its own result or its own error; ``abort`` ends
    exactly the named requests (the engine answers them with ``finish_reason="abort"``);
    cancelling a caller cancels its request's task in the actor, as before; a lost actor
    fails every request in flight with ``WorkerLostError``. ``calls_sent`` and
    ``requests_sent`` count the actor calls and the requests they carried."""

    _role = "inference"
    _protocol = "an InferenceEngine"
    _restartable = True
    max_batch_requests: int = DEFAULT_MAX_BATCH_REQUESTS

    def __init__(
        self, handle: Any, name: str, started: _Started, version: Version, seq: int
    ) -> None:
        super().__init__(handle, name, started, version, seq)
        self.calls_sent = 0
        self.requests_sent = 0
        self._batchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Batcher] = (
            weakref.WeakKeyDictionary()
        )

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self._check_open("generate")
        loop = asyncio.get_running_loop()
        batcher = self._batchers.get(loop)
        if batcher is None:
            batcher = self._batchers[loop] = _Batcher(self, loop)
        return await batcher.submit(request)

    def _cancel_requests(self, request_ids: list[str]) -> None:
        """Ask the actor to cancel these requests' tasks (fire and forget: a lost actor has
        dropped them anyway)."""
        if self._closed or self._lost is not None:
            return
        with contextlib.suppress(Exception):
            self._handle.cancel_requests.remote(request_ids)

    async def abort(self, request_ids: Sequence[str]) -> None:
        batcher = self._batchers.get(asyncio.get_running_loop())
        if batcher is not None and batcher.queue:
            batcher.flush()  # requests made this turn go first, or the abort could miss them
        await self._call("abort", request_ids)


class RayTrainEngine(_RayEngine):
    """A ``TrainEngine`` in a Ray actor (see the module docstring). Build it with
    ``RayTrainEngine.create(factory, ...)`` (or ``await create_async(...)``). The batch and the
    loss function are pickled to the actor (cloudpickle: a lambda works; its module must be
    importable there); checkpoint paths are paths on the actor's node. ``export_weights``
    streams the buckets (the actor runs at most ``DEFAULT_EXPORT_PREFETCH`` ahead)."""

    _role = "train"
    _protocol = "a TrainEngine"
    _order: asyncio.Lock | None = None

    async def _in_order(self, method: str, *args: Any) -> Any:
        """``engine.method(*args)`` in the actor, after every trainer call made before it has
        ended: a trainer's calls run in the order they are made (``compute_logprobs`` before
        a ``train_step`` sees the weights before it), and Ray does not keep an async actor's
        calls in order (its docs, "Actor task execution order": for async actors "task
        execution order is not guaranteed"). A trainer runs its calls one at a time anyway."""
        if self._order is None:
            self._order = asyncio.Lock()  # its waiters are served first come, first served
        async with self._order:
            return await self._call(method, *args)

    async def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        result: torch.Tensor = await self._in_order("compute_logprobs", batch)
        return result

    async def train_step(self, batch: Batch, loss_fn: LossFn) -> TrainMetrics:
        result: TrainMetrics = await self._in_order("train_step", batch, loss_fn)
        return result

    def export_weights(self, bucket_bytes: int) -> AsyncIterator[WeightBucket]:
        return self._export(bucket_bytes)

    async def save_checkpoint(self, path: str) -> None:
        await self._in_order("save_checkpoint", path)

    async def load_checkpoint(self, path: str) -> None:
        await self._in_order("load_checkpoint", path)

    async def _export(self, bucket_bytes: int) -> AsyncIterator[WeightBucket]:
        ray = import_ray()
        what = "export_weights"
        self._check_open(what)
        options = {
            "num_returns": "streaming",
            "_generator_backpressure_num_objects": DEFAULT_EXPORT_PREFETCH,
        }
        stream = self._handle.export.options(**options).remote(bucket_bytes)
        finished = False
        try:
            while True:
                try:
                    ref = await stream.__anext__()
                except StopAsyncIteration:
                    raise EngineError(
                        f"{self.name}: {what} ended without its last message (the actor's "
                        "stream was cut)"
                    ) from None
                except Exception as e:
                    raise self._ray_error(what, e) from e
                kind, payload = self._take(await self._reply_of(what, ref))
                if kind == "err":
                    finished = True
                    raise payload
                if kind == "end":
                    finished = True
                    return
                yield _unpack(payload)
        finally:
            if not finished:  # the consumer stopped early, or failed: stop the actor's side
                with contextlib.suppress(Exception):
                    ray.cancel(stream)


if TYPE_CHECKING:  # mypy proves the proxies satisfy the protocols they stand in for
    _inference: type[InferenceEngine] = RayInferenceEngine
    _train: type[TrainEngine] = RayTrainEngine
    _pause: type[SupportsPause] = _PauseAbility
    _sleep: type[SupportsSleep] = _SleepAbility
    _load: type[SupportsLoadWeights] = _LoadWeightsAbility
