"""TransferQueue-shaped benchmark: TransferQueue 0.1.11's perftest workload through
``asyncflow_tq`` (the TransferQueue-compatible facade) over the Ray store and over the
in-process store, and through the real ``transfer_queue`` 0.1.11, in one run (see
/work/shared/BENCHMARKING.md).

Workload (TransferQueue's ``scripts/performance_test/perftest.py``, simple case): one
``TensorDict`` of ``--batch`` samples x ``--fields`` float32 fields of ``--seq-len`` elements
(``torch.randn``; default 1024 x 10 x 8192 = 0.34 GB), keys ``test_key_<i>``, partition
``train_0``. One repetition of one system: ``kv_batch_put`` of the whole batch (timed),
``kv_list`` of the partition (untimed), ``kv_batch_get`` of every listed key (timed: the
result is a ``TensorDict`` of one jagged nested tensor per field, as TransferQueue returns it),
``kv_clear`` (untimed). GB/s = payload bytes / wall seconds of the call, GB = 1e9 bytes.

Systems, each with 2 storage units, all three alive at once on one local Ray cluster (4
logical CPUs: TransferQueue's controller and units reserve 3):

* ``tq`` — the real TransferQueue (controller and 2 SimpleStorage units as Ray actors; data
  over ZMQ). The perftest's shape: the driver calls ``init``; a writer actor and a reader
  actor (0 CPUs each) call ``init()`` to attach; the writer puts, the reader lists and gets;
  the driver times each call around ``ray.get``.
* ``ray`` — ``asyncflow_tq`` with ``storage_backend="Ray"``: its controller actor and a
  ``RayDataStore`` with 2 storage-unit actors; the same writer / reader actor shape (values go
  from the writer to the units and from the units to the reader, through Ray's object store).
* ``inproc`` — ``asyncflow_tq`` over ``InProcessDataStore(2)`` with its default
  ``copy_on_put=True`` (a put copies, so the caller may reuse its tensors, as with
  TransferQueue). An in-process store cannot be shared by processes, so the driver itself puts
  and gets: no process boundary at all, the single-process user's case.

Repetitions interleave the systems, rotating their order every repetition (A B C, B C A, ...);
after one untimed warm-up pass of each (skipped by ``--quick``). Figures are medians with
[min-max]; ``<sys>_put_vs_tq`` = that system's GB/s over TransferQueue's in the same
repetition. The first get of every system is checked against the data put. Each repetition
also times one ``clone`` of the batch in the driver (``copy``: the memcpy floor of a put or a
get that copies once); ``inproc_put_vs_copy`` = copy seconds / in-process put seconds.

Usage: ``python benchmarks/transferqueue.py [--batch B] [--seq-len L] [--fields F] [--reps N]
[--quick]``. The last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

SYSTEMS = ("tq", "ray", "inproc")
PARTITION = "train_0"


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def fmt(xs: Sequence[float]) -> str:
    return f"{med(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def make_batch(batch: int, seq_len: int, fields: int) -> Any:
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(0)
    data = {
        f"field_{i}": torch.randn(batch, seq_len, dtype=torch.float32, generator=g)
        for i in range(fields)
    }
    return TensorDict(data, batch_size=(batch,))


def check(result: Any, data: Any, name: str) -> None:
    """The batch read back holds the values put, one jagged nested tensor per field."""
    for f in data.keys():  # noqa: SIM118 (iterating a TensorDict walks its rows)
        got = result.get(f)
        if not (isinstance(got, torch.Tensor) and got.is_nested):
            raise AssertionError(f"{name}: field {f!r} came back as {type(got).__name__}")
        if not torch.equal(got.values().reshape(data.get(f).shape), data.get(f)):
            raise AssertionError(f"{name}: field {f!r} came back with other values")


def one_rep(
    api: Any, install: Callable[[], object], data: Any, keys: list[str], verify: str | None
) -> tuple[float, float]:
    install()
    t0 = time.perf_counter()
    api.kv_batch_put(keys=keys, partition_id=PARTITION, fields=data)
    put_s = time.perf_counter() - t0
    listed = list(api.kv_list(partition_id=PARTITION)[PARTITION].keys())
    if sorted(listed) != sorted(keys):
        raise AssertionError(f"kv_list listed {len(listed)} keys, not {len(keys)}")
    t0 = time.perf_counter()
    result = api.kv_batch_get(keys=listed, partition_id=PARTITION)
    get_s = time.perf_counter() - t0
    if verify is not None:
        check(result, data, verify)
    del result
    api.kv_clear(keys=listed, partition_id=PARTITION)
    return put_s, get_s


class PerftestClient:
    """A perftest client actor: ``init()`` attaches to the queue the driver started."""

    def __init__(self, system: str, batch: int, seq_len: int, fields: int, writer: bool) -> None:
        if system == "tq":
            import transfer_queue as api
        else:
            import asyncflow_tq as api
        api.init()
        self.api: Any = api
        self.system = system
        self.shape = (batch, seq_len, fields)
        self.data = make_batch(*self.shape) if writer else None
        self.keys = [f"test_key_{i}" for i in range(batch)]

    def put(self) -> None:
        self.api.kv_batch_put(keys=self.keys, partition_id=PARTITION, fields=self.data)

    def list_keys(self) -> list[str]:
        return list(self.api.kv_list(partition_id=PARTITION)[PARTITION].keys())

    def get(self, keys: list[str], verify: bool) -> None:
        result = self.api.kv_batch_get(keys=keys, partition_id=PARTITION)
        if verify:
            check(result, make_batch(*self.shape), self.system)

    def clear(self, keys: list[str]) -> None:
        self.api.kv_clear(keys=keys, partition_id=PARTITION)


def actor_rep(ray: Any, writer: Any, reader: Any, verify: bool) -> tuple[float, float]:
    t0 = time.perf_counter()
    ray.get(writer.put.remote())
    put_s = time.perf_counter() - t0
    keys = ray.get(reader.list_keys.remote())
    t0 = time.perf_counter()
    ray.get(reader.get.remote(keys, verify))
    get_s = time.perf_counter() - t0
    ray.get(writer.clear.remote(keys))
    return put_s, get_s


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--batch", type=int, default=None, help="samples (1024; quick 16)")
    ap.add_argument("--seq-len", type=int, default=None, help="floats/sample (8192; quick 256)")
    ap.add_argument("--fields", type=int, default=None, help="float32 fields (10; quick 2)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (5; quick 2)")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, no warm-up")
    args = ap.parse_args(argv)
    for name, full, quick in (
        ("batch", 1024, 16),
        ("seq_len", 8192, 256),
        ("fields", 10, 2),
        ("reps", 5, 2),
    ):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    import asyncflow_tq
    import ray
    import transfer_queue
    from asyncflow_ray.runtime import RayRuntime

    nbytes = args.batch * args.seq_len * args.fields * 4
    print(
        f"TransferQueue-shaped workload: {args.batch} samples x {args.fields} fields x "
        f"{args.seq_len} float32 = {nbytes / 1e9:.3f} GB per put; {args.reps} repetitions "
        f"(median [min-max]); systems {', '.join(SYSTEMS)}; load average "
        f"{os.getloadavg()[0]:.2f}" + (" — QUICK smoke mode" * args.quick),
        flush=True,
    )
    store_gib = 0.5 if args.quick else max(2.0, 3 * nbytes / 2**30)
    rt = RayRuntime(num_cpus=4, object_store_bytes=int(store_gib * 2**30)).start()
    inproc: Any = None
    ray_client: Any = None
    actors: list[Any] = []
    try:
        transfer_queue.init({"backend": {"SimpleStorage": {"num_data_storage_units": 2}}})
        units = {"num_data_storage_units": 2}
        asyncflow_tq.init({"backend": {"storage_backend": "Ray", "Ray": units}})
        inproc = asyncflow_tq.make_client(
            {"backend": {"storage_backend": "InProcess", "InProcess": units}}
        )
        ray_client = asyncflow_tq.use_client(None)  # the driver's own client of the Ray queue
        shape = (args.batch, args.seq_len, args.fields)
        cls = ray.remote(num_cpus=0)(PerftestClient)
        pairs = {}
        for s in ("tq", "ray"):
            pairs[s] = (cls.remote(s, *shape, True), cls.remote(s, *shape, False))
            actors.extend(pairs[s])
        data = make_batch(*shape)
        keys = [f"test_key_{i}" for i in range(args.batch)]

        def rep(system: str, verify: bool) -> tuple[float, float]:
            if system == "inproc":
                return one_rep(
                    asyncflow_tq,
                    lambda: asyncflow_tq.use_client(inproc),
                    data,
                    keys,
                    system if verify else None,
                )
            return actor_rep(ray, *pairs[system], verify)

        checked: set[str] = set()
        if not args.quick:
            for s in SYSTEMS:
                rep(s, True)
                checked.add(s)
        put: dict[str, list[float]] = {s: [] for s in SYSTEMS}
        get: dict[str, list[float]] = {s: [] for s in SYSTEMS}
        copy_s: list[float] = []
        for r in range(args.reps):
            order = SYSTEMS[r % 3 :] + SYSTEMS[: r % 3]
            for s in order:
                put_s, get_s = rep(s, s not in checked)
                checked.add(s)
                put[s].append(put_s)
                get[s].append(get_s)
            t0 = time.perf_counter()  # the memcpy floor: one copy of the batch's bytes
            copies = [data.get(f).clone() for f in list(data.keys())]
            copy_s.append(time.perf_counter() - t0)
            del copies
            print(
                f"  rep {r + 1}: "
                + "  ".join(f"{s} put {put[s][-1]:.3f}s get {get[s][-1]:.3f}s" for s in order),
                flush=True,
            )
    finally:
        ray_client = asyncflow_tq.use_client(None) or ray_client
        for a in actors:
            ray.kill(a)
        for c in (inproc, ray_client):
            if c is not None:
                c.close()
        transfer_queue.close()
        rt.shutdown()
        if ray.is_initialized():
            ray.shutdown()

    gb = nbytes / 1e9
    res: dict[str, Any] = {
        "batch": args.batch,
        "seq_len": args.seq_len,
        "fields": args.fields,
        "reps": args.reps,
        "gb": round(gb, 6),
        "quick": args.quick,
        "load_avg": round(os.getloadavg()[0], 2),
    }
    print("\n system   put GB/s                 get GB/s                 put/tq   get/tq")
    for s in SYSTEMS:
        pg = [gb / t for t in put[s]]
        gg = [gb / t for t in get[s]]
        res[f"{s}_put_gbps"] = round(med(pg), 4)
        res[f"{s}_get_gbps"] = round(med(gg), 4)
        res[f"{s}_put_gbps_range"] = [round(min(pg), 4), round(max(pg), 4)]
        res[f"{s}_get_gbps_range"] = [round(min(gg), 4), round(max(gg), 4)]
        line = f" {s:<8} {fmt(pg):<24} {fmt(gg):<24}"
        if s != "tq":
            # ratio per repetition: the same repetition's TransferQueue time over this system's
            pr = [t / u for t, u in zip(put["tq"], put[s], strict=True)]
            gr = [t / u for t, u in zip(get["tq"], get[s], strict=True)]
            res[f"{s}_put_vs_tq"] = round(med(pr), 3)
            res[f"{s}_get_vs_tq"] = round(med(gr), 3)
            res[f"{s}_put_vs_tq_range"] = [round(min(pr), 3), round(max(pr), 3)]
            res[f"{s}_get_vs_tq_range"] = [round(min(gr), 3), round(max(gr), 3)]
            line += f" {med(pr):.2f}x    {med(gr):.2f}x"
        print(line)
    cg = [gb / t for t in copy_s]
    res["copy_gbps"] = round(med(cg), 4)
    res["copy_gbps_range"] = [round(min(cg), 4), round(max(cg), 4)]
    print(f" {'copy':<8} {fmt(cg):<24} (one clone of the batch, the driver, each repetition)")
    for d, times in (("put", put["inproc"]), ("get", get["inproc"])):
        # the in-process facade against one copy of the same bytes, same repetition
        rr = [c / t for c, t in zip(copy_s, times, strict=True)]
        res[f"inproc_{d}_vs_copy"] = round(med(rr), 3)
        res[f"inproc_{d}_vs_copy_range"] = [round(min(rr), 3), round(max(rr), 3)]
    vs = (res["inproc_put_vs_copy"], res["inproc_get_vs_copy"])
    print(f" inproc vs copy: put {vs[0]:.2f}x, get {vs[1]:.2f}x")
    print(json.dumps(res, separators=(",", ":")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
