"""The Ray runtime on a two-node cluster on one machine (``ray.cluster_utils.Cluster``): the
storage units land on different nodes and reads cross them; and a runtime that started a
local cluster leaves no process behind when it shuts down."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray", reason="the Ray runtime needs the [ray] extra (ray 2.60)")

from asyncflow_ray import RayDataStore, RayRuntime  # noqa: E402

# A safety net for a store's actors to start and for its reads, as in test_ray_store.py: ~2 s
# idle, 72 s for three units on the one-CPU head beside the main suite, and past the store's
# 120 s default on a slower run.
START_S = 600.0


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": 256 << 20},
    )
    cluster.add_node(num_cpus=1, object_store_memory=256 << 20)
    rt = RayRuntime(address=cluster.address).start()
    try:
        cluster.wait_for_nodes()
        yield rt
    finally:
        rt.shutdown()
        cluster.shutdown()


@ray.remote(num_cpus=0)
class Reader:
    """Reads rows of the store from wherever it was placed."""

    def node(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    async def read(self, store: RayDataStore, rows: tuple[int, ...]) -> list[list[float]]:
        from asyncflow_core.contracts.protocols import BatchMeta

        batch = await store.get_data(BatchMeta("p", "t", rows, ("x",)), layout="list")
        return [t.tolist() for t in batch["x"]]

    async def sums(self, store: RayDataStore, rows: tuple[int, ...]) -> list[float]:
        """The sum of each row of ``big`` (shares of a MiB or more travel by reference)."""
        from asyncflow_core.contracts.protocols import BatchMeta

        batch = await store.get_data(BatchMeta("big", "t", rows, ("x",)), layout="padded")
        return [float(s) for s in batch["x"].double().sum(dim=1)]


def test_units_spread_over_nodes_and_reads_cross_them(two_nodes: Any) -> None:
    nodes = [n.node_id for n in two_nodes.nodes()]
    assert len(nodes) == 2
    # one row per block: rows alternate units, so reads cross nodes
    store = RayDataStore.create(2, rows_per_block=1, start_timeout_s=START_S)
    try:
        placement = asyncio.run(store.placement())
        assert sorted(p.node_id for p in placement) == sorted(nodes), placement
        node_of_unit = {p.unit: p.node_id for p in placement}

        async def fill() -> None:
            await store.create_partition("p", ["x"], tasks=["t"])
            rows = [torch.arange(r + 1, dtype=torch.float32) for r in range(8)]  # ragged
            await store.put("p", {"x": rows})
            await store.create_partition("big", ["x"], tasks=["t"])
            await store.put("big", {"x": torch.ones(2, 1 << 19) * torch.tensor([[1.0], [2.0]])})

        asyncio.run(fill())
        want = [[float(i) for i in range(r + 1)] for r in range(8)]
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        for node in nodes:  # a reader on each node reads every row: half of them cross nodes
            reader = Reader.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
            ).remote()
            assert ray.get(reader.node.remote()) == node
            assert ray.get(reader.read.remote(store, tuple(range(8))), timeout=START_S) == want
            # each unit's 2 MiB share went by reference; one of them lives on the other node
            assert ray.get(reader.sums.remote(store, (0, 1)), timeout=START_S) == [2.0**19, 2.0**20]
            remote_units = [u for u, n in node_of_unit.items() if n != node]
            assert remote_units, "one unit lives on the other node"
    finally:
        store.shutdown()


def test_placing_units_on_named_nodes_and_unknown_ones(two_nodes: Any) -> None:
    from asyncflow_core.contracts.errors import ConfigError

    head = next(n.node_id for n in two_nodes.nodes() if n.is_head)
    store = RayDataStore.create(3, nodes=[head], start_timeout_s=START_S)
    try:
        assert {p.node_id for p in asyncio.run(store.placement())} == {head}
    finally:
        store.shutdown()
    with pytest.raises(ConfigError, match="alive nodes"):
        RayDataStore.create(2, nodes=["f" * 56])


def test_shutdown_leaves_no_ray_process_behind(tmp_path: Path) -> None:
    """A runtime that starts a local cluster stops every process of it (GCS, raylet, agents,
    workers, the store's actors) by the time ``shutdown`` returns. In a fresh interpreter, so
    the processes are this runtime's own."""
    script = textwrap.dedent(
        """
        import asyncio, json, os
        from asyncflow_ray import RayDataStore, RayRuntime
        from asyncflow_ray.runtime import _cluster_pids, _alive, import_ray

        rt = RayRuntime(num_cpus=2, object_store_bytes=128 << 20).start()
        store = RayDataStore.create(2, start_timeout_s=600.0)
        async def go():
            await store.create_partition("p", ["x"])
            await store.put("p", {"x": [1, 2, 3]})
        asyncio.run(go())
        pids = _cluster_pids(import_ray())
        session = rt.ray._private.worker.global_worker.node.get_session_dir_path()
        rt.shutdown()
        print(json.dumps({"pids": pids, "alive": [p for p in pids if _alive(p)],
                          "session": session}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(report["pids"]) >= 5, report  # GCS, raylet, agents, 3 actors at least
    assert report["alive"] == [], f"processes left behind: {report}"
    leftovers = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if report["session"].encode() in cmd:
                leftovers.append(int(entry))
    assert leftovers == [], f"processes of the session still running: {leftovers}"


def test_a_local_cluster_listens_on_loopback_only() -> None:
    """Every socket a local cluster of ``RayRuntime`` listens on (GCS, raylet, object manager,
    agents, the driver's and every actor's gRPC server) is on loopback: ``ray.init`` alone
    listens on the machine's external address. Probed from outside (``test_sockets``'
    ``/proc`` reader) while the runtime in a fresh interpreter holds its store."""
    from test_sockets import assert_loopback_only, listening_sockets, process_tree

    script = textwrap.dedent(
        """
        import asyncio, sys
        from asyncflow_ray import RayDataStore, RayRuntime

        rt = RayRuntime(num_cpus=2, object_store_bytes=128 << 20).start()
        store = RayDataStore.create(2, start_timeout_s=600.0)
        async def go():
            await store.create_partition("p", ["x"])
            await store.put("p", {"x": [1, 2, 3]})
        asyncio.run(go())
        print("ready", flush=True)
        sys.stdin.readline()  # hold the cluster up while the test looks at its sockets
        store.shutdown()
        rt.shutdown()
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "ready"
        tree = process_tree(child.pid)
        listeners = listening_sockets(tree)
        assert len({s.pid for s in listeners}) >= 4, listeners  # GCS, raylet, driver, actors
        assert_loopback_only(listeners, at_least=5)
    finally:
        with contextlib.suppress(BrokenPipeError):  # a child that died already says why below
            child.stdin.write("\n")
            child.stdin.flush()
        assert child.wait(900) == 0
