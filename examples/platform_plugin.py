"""A platform plugin: teach AsyncFlow about a device it does not know (docs/writing-an-adapter.md,
"A platform of your own").

A ``Platform`` says which torch device type the engines use, which collective backend weight
sync and training use, and how to build a process group of that backend. A package ships it
through an entry point, the way ``asyncflow_ascend`` ships ``npu``::

    [project.entry-points."asyncflow.platforms"]
    mydev = "my_package.platform:MyDevicePlatform"

Here the plugin is registered from code (``register_platform``), and it is the host's CPU under
another name, so the example runs anywhere: it is chosen by name, and a weight sync between two
ranks (threads of this process) runs over a group that the platform builds.

Run: ``python examples/platform_plugin.py``
"""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta
from typing import Any

import torch

from asyncflow_core.engines.process import free_port
from asyncflow_core.infra.platform import CpuPlatform, platforms, register_platform, use_platform
from asyncflow_core.sync.transports import (
    DistributedWeightReceiver,
    DistributedWeightSync,
    WeightSyncGroup,
    bucketize,
    default_backend,
)


class LabPlatform(CpuPlatform):
    """A "device" for this example: computes on the host, counts the groups it builds."""

    name = "lab"
    dist_backend = "lab-gloo"  # its own backend name; WeightSyncGroup(backend=...) finds it
    priority = -1  # never chosen by "auto" over cpu
    groups_built = 0

    def _probe(self) -> str | None:  # None: it can run here (a real one imports its library)
        return None

    def new_process_group(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
        LabPlatform.groups_built += 1
        return super().new_process_group(store, rank, world_size, timeout)  # gloo underneath


def main() -> None:
    register_platform(LabPlatform)
    register_platform(LabPlatform)  # registering the same class again changes nothing
    print("platforms:", ", ".join(f"{p['name']} ({p['dist_backend']})" for p in platforms()))

    weights = [("w", torch.randn(64, 8)), ("b", torch.arange(8, dtype=torch.int64))]
    port = free_port()
    received: dict[str, torch.Tensor] = {}

    class Target:  # what the receiving rank loads into (an inference engine, normally)
        async def load_weights(self, ws: Any, version: int) -> None:
            received.update({n: t.clone() for n, t in ws})

    def receiver() -> None:
        async def run() -> None:
            with WeightSyncGroup("127.0.0.1", port, 1, 2, backend="lab-gloo") as group:
                await DistributedWeightReceiver(Target(), group=group).receive_one()

        asyncio.run(run())

    with use_platform("lab") as platform:
        assert default_backend() == "lab-gloo"
        thread = threading.Thread(target=receiver, daemon=True)
        thread.start()

        async def send() -> None:
            with WeightSyncGroup("127.0.0.1", port, 0, 2) as group:  # the platform's backend
                sync = DistributedWeightSync(group=group)
                await sync.init()
                await sync.start()
                for bucket in bucketize(weights, 256):
                    await sync.update(bucket)
                await sync.finish(1)
            await asyncio.to_thread(thread.join, 60)

        asyncio.run(send())
    assert all(torch.equal(received[n], t) for n, t in weights)
    assert LabPlatform.groups_built == 2
    print(f"synced {len(weights)} tensors over {platform.name}'s {platform.dist_backend} groups")


if __name__ == "__main__":
    main()
