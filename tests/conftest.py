"""Shared fixtures. ``ray_runtime``: one local Ray cluster per test module that asks for it
(skipped with the reason when the ``[ray]`` extra is missing), shut down after the module with
every process it started."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network from tests


@pytest.fixture(scope="module")
def ray_runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("ray", reason="the Ray runtime needs the [ray] extra (ray 2.60)")
    from asyncflow_ray.runtime import RayRuntime

    # logical CPUs: actors reserve 0 or fractions of them, the 2 real cores are shared
    rt = RayRuntime(num_cpus=4, object_store_bytes=512 << 20).start()
    try:
        yield rt
    finally:
        rt.shutdown()


@pytest.fixture(scope="module")
def module_by_value(ray_runtime: Any, request: pytest.FixtureRequest) -> Iterator[None]:
    """Ray's workers cannot import a test module: what the requesting module defines (its
    small engines, the functions it runs in actors) is pickled by value while it runs."""
    from asyncflow_ray.runtime import import_ray

    ray = import_ray()
    module = request.module
    ray.cloudpickle.register_pickle_by_value(module)
    try:
        yield
    finally:
        ray.cloudpickle.unregister_pickle_by_value(module)
