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
