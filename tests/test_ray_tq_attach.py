"""Several processes share one queue, as with TransferQueue: the driver starts it with
``storage_backend="Ray"`` (a controller actor over a ``RayDataStore``), and Ray actors that call
``asyncflow_tq.init()`` attach to it (their config ignored). TransferQueue's perftest shape: a
writer actor ``kv_batch_put``s, a reader actor lists the keys and ``kv_batch_get``s them; a
consumer actor takes batches by task while the driver watches the statuses. The values go from
the writer straight to the storage units and from them to the reader."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray", reason="the Ray runtime needs the [ray] extra (ray 2.60)")
pytest.importorskip("tensordict", reason="the TransferQueue facade needs the [tq] extra")

import asyncflow_tq  # noqa: E402


@pytest.fixture
def shared(ray_runtime: Any) -> Iterator[Any]:
    asyncflow_tq.init({"backend": {"storage_backend": "Ray"}, "controller": {"polling_mode": True}})
    try:
        yield asyncflow_tq.get_client()
    finally:
        asyncflow_tq.close()


def test_actors_attach_and_share_the_queue(shared: Any) -> None:
    @ray.remote(num_cpus=0)
    class Worker:
        def __init__(self) -> None:
            import asyncflow_tq as tq

            self.tq = tq
            tq.init({"backend": {"storage_backend": "SimpleStorage"}})  # ignored: attaches

        def attached(self) -> bool:
            return bool(self.tq.get_client().is_attached)

        def put(self, n: int) -> list[str]:
            from tensordict import TensorDict

            keys = [f"k{i}" for i in range(n)]
            x = torch.arange(n * 4, dtype=torch.float32).reshape(n, 4)
            self.tq.kv_batch_put(
                keys=keys,
                partition_id="train",
                fields=TensorDict({"x": x, "s": [f"s{i}" for i in range(n)]}, batch_size=n),
                tags=[{"i": i} for i in range(n)],
            )
            return keys

        def read(self) -> tuple[list[str], list[list[float]], list[str]]:
            keys = list(self.tq.kv_list("train")["train"])
            got = self.tq.kv_batch_get(keys=keys, partition_id="train")
            return keys, [r.tolist() for r in got["x"].unbind()], got["s"].tolist()

        def take(self, n: int) -> list[int]:
            c = self.tq.get_client()
            meta = c.get_meta(["x"], n, "train", task_name="trainer")
            return [int(v) for v in c.get_data(meta)["x"].values()[::4].tolist()]

        def close(self) -> None:
            self.tq.close()

    writer, reader = Worker.remote(), Worker.remote()  # type: ignore[attr-defined]
    assert ray.get([writer.attached.remote(), reader.attached.remote()]) == [True, True]
    keys = ray.get(writer.put.remote(6))
    listed, rows, strings = ray.get(reader.read.remote())
    assert listed == keys
    assert rows == [[float(4 * i + j) for j in range(4)] for i in range(6)]
    assert strings == [f"s{i}" for i in range(6)]
    assert ray.get(reader.take.remote(4)) == [0, 4, 8, 12]
    # the driver sees what the actors did: same controller
    _, done = shared.get_consumption_status("trainer", "train")
    assert done.tolist() == [1, 1, 1, 1, 0, 0]
    assert asyncflow_tq.kv_list("train")["train"]["k5"] == {"i": 5}
    # an attached client closing leaves the shared queue alone
    ray.get(writer.close.remote())
    assert ray.get(reader.take.remote(2)) == [16, 20]
    with pytest.raises(ValueError, match="batch_size"):
        shared.get_meta(["x"], 0, "train", task_name="trainer")  # errors come back unwrapped
    ray.kill(writer)
    ray.kill(reader)
