"""The facade's controller as a named Ray actor, so that every process of a Ray cluster that
calls ``asyncflow_tq.init()`` shares one queue, as TransferQueue's processes share its
controller actor.

The actor holds only metadata (``_Core``: statuses, keys, tags, where each cell lives). A
client writes and reads the values itself, straight to and from the ``RayDataStore``'s
storage units: a put asks the actor where the cells go, stores them, then tells the actor
which rows it wrote; a get asks where the cells are and reads them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from asyncflow_core.contracts.protocols import DataStore
from asyncflow_tq.client import _Core

__all__ = ["ACTOR_NAME", "NAMESPACE", "find_controller", "start_controller", "stop_controller"]

ACTOR_NAME = "asyncflow_tq_controller"
NAMESPACE = "asyncflow_tq"


class ControllerActor:
    """The body of the controller actor: ``call(method, *args)`` runs ``_Core.method``."""

    def __init__(
        self,
        store: DataStore,
        sampler: Callable[..., tuple[list[int], list[int]]],
        polling_mode: bool,
        get_meta_timeout_s: float,
    ) -> None:
        self.core = _Core(store, sampler, polling_mode, get_meta_timeout_s)

    async def call(self, method: str, *args: Any) -> Any:
        return await getattr(self.core, method)(*args)


def _ray() -> Any:
    from asyncflow_ray.runtime import import_ray

    return import_ray()


def find_controller() -> Any | None:
    """The running controller actor of this Ray cluster, or None (also when Ray is not
    installed or not initialised in this process)."""
    try:
        ray = _ray()
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    try:
        return ray.get_actor(ACTOR_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


def start_controller(
    store: DataStore,
    sampler: Callable[..., tuple[list[int], list[int]]],
    polling_mode: bool,
    get_meta_timeout_s: float,
    start_timeout_s: float = 120.0,
) -> Any:
    """Start the named controller actor over ``store`` (0 CPUs reserved; owned by this
    process) and wait until it answers."""
    ray = _ray()
    cls = ray.remote(num_cpus=0, max_concurrency=1000)(ControllerActor)
    handle = cls.options(name=ACTOR_NAME, namespace=NAMESPACE).remote(
        store, sampler, polling_mode, get_meta_timeout_s
    )
    ray.get(handle.call.remote("partition_list"), timeout=start_timeout_s)
    return handle


def stop_controller(handle: Any, timeout_s: float = 60.0) -> None:
    """Kill the controller actor and wait until its name is free (so an ``init`` right after
    starts a new queue instead of attaching to the dying one)."""
    ray = _ray()
    ray.kill(handle, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while find_controller() is not None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the controller actor {ACTOR_NAME!r} is still registered")
        time.sleep(0.02)
