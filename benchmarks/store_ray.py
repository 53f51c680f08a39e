"""RayDataStore benchmark: put/get throughput of the distributed store against a raw Ray
object-store transfer of the same bytes, in one run (see /work/shared/BENCHMARKING.md).

Cluster: a local Ray cluster started with ``RayRuntime`` (always shut down), one
``RayDataStore`` with ``--units`` storage-unit actors, ``--clients`` client actors (async Ray
actors, each holding the store: it pickles as its actor handles, and running its loops on its
own event loop). Every actor reserves 0 CPUs; the machine's cores are shared by all of them.

Workload, shaped like TransferQueue's own perftest: ``--batch`` rows x ``--fields`` float32
fields of ``--seq-len`` elements (default 1024 x 8192 x 10 = 0.34 GB), in two variants:

* **fixed** — every row ``seq_len`` long; a client puts ``{field: tensor(chunk, seq_len)}``.
* **ragged** — row lengths uniform in ``[seq_len/4, seq_len]`` (fixed seed; one length per
  row, shared by its tensor fields) plus one string field (``text``, 64-512 ASCII chars per
  row); a client puts ``{field: [one tensor per row], "text": [str, ...]}``.

Each client owns a contiguous share of the rows (generated in the actor, untimed, reused by
every repetition). One repetition of one path is two phases, each timed by the driver's wall
clock around ``ray.get`` of every client's call (phases start together, end with the last):

1. **put** — every client puts its rows, one ``put`` per ``--chunk`` rows, one put in flight
   per client; then the driver closes the partition (untimed).
2. **get** — every client leases batches of ``--get-rows`` rows with ``get_meta`` on **one
   shared task** (``train``), reads them with ``get_data`` and acks them (rows are reclaimed),
   until end of stream. ``--ack fold`` (default) acks each batch in the client's next
   ``get_meta`` (``get_meta(..., ack=previous)``: one controller round trip per batch; the
   last batch's ack rides on the end-of-stream ``get_meta``); ``--ack separate`` calls
   ``ack`` after each batch (two round trips per batch). ``--out previous`` (default) reads
   each batch into the client's previous batch (``get_data(..., out=)``, as a training loop
   does: no fresh pages per batch); ``--out none`` into fresh memory. A shared task is the
   data-parallel consumer pattern (the clients split the rows between them, whoever asks
   first gets the next batch) and reads every byte exactly once, so the get phase moves the
   same bytes as the put phase and as the baseline; one task per client would read every row
   once per client. ``--layout auto`` reads the fixed rows as
   one padded tensor per field (``torch.stack``: no padding, the rows are full length) and the
   ragged rows as one jagged nested tensor per field (no padding written): a batch tensor, as
   a trainer wants it, like TransferQueue's reads.

Baseline (**raw**): the same clients move the same bytes with plain Ray calls and no store:
``--units`` sink actors (threaded, like the units) and, per chunk, one call per sink carrying
its part of the chunk (a contiguous slice of rows per sink), all sinks in parallel; the sink
keeps what it received (zero-copy views of the object store) and hands it back, and forgets
it, when the get phase asks for it. That is Ray's own path: one copy into shared memory per
direction, zero-copy reads, no metadata, no lease, no repacking; nothing is pickled but the
strings. Fixed rows travel as the numpy views of the ``(rows, seq_len)`` slices (one array per
field). Ragged rows have two raw configurations, both timed every repetition: ``raw-rows``
sends the per-row arrays as they are (one buffer per row and field, no copy in the client),
``raw-packed`` concatenates each field's rows first (one copy, few large buffers, plus the
lengths). The baseline of a repetition and phase is the faster of the two (the best plain
configuration, never a strawman); both are reported.

Repetitions interleave store and raw per workload (A B, A B, B A, B A, ...: the paths of a
workload are rotated every two repetitions), alternating which workload goes first; each store
run is paired with the baseline of the same workload and repetition, and
``put_vs_raw = raw_put_s / store_put_s`` (= the store's GB/s over the raw GB/s). Figures are
medians with [min-max]; GB = 1e9 bytes; bytes are the real payload (tensor elements x 4 plus
string characters), the same for put and get. ``reset()`` empties the store between runs
without restarting actors. One untimed warm-up pass of everything precedes the timed ones
(skipped by ``--quick``).

Usage: ``python benchmarks/store_ray.py [--clients N] [--units N] [--batch B] [--seq-len L]
[--fields F] [--chunk R] [--get-rows R] [--reps N] [--layout L] [--rows-per-block B]
[--object-store-gib X] [--quick]``. The last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
from asyncflow_ray.runtime import RayRuntime, import_ray
from asyncflow_ray.store import ROWS_PER_BLOCK, RayDataStore

from asyncflow_core.contracts.protocols import Batch, BatchMeta

T = TypeVar("T")
SEED = 1234
GB = 1e9
TASK = "train"
TEXT = "text"
WORKLOADS = ("fixed", "ragged")
PATHS = {"fixed": ("store", "raw"), "ragged": ("store", "raw-rows", "raw-packed")}
LAYOUTS = ("auto", "list", "padded", "nested")
ACKS = ("fold", "separate")
OUTS = ("previous", "none")
GET_TIMEOUT_S = 120.0


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def med(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def fmt_span(xs: Sequence[float], digits: int = 3) -> str:
    return f"{med(xs):.{digits}f} [{min(xs):.{digits}f}-{max(xs):.{digits}f}]"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(line.rstrip() for line in out)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def field_names(n: int) -> list[str]:
    return [f"f{i}" for i in range(n)]


def layout_for(workload: str, layout: str) -> str:
    if layout != "auto":
        return layout
    return "padded" if workload == "fixed" else "nested"


def shares(batch: int, clients: int) -> list[int]:
    """Rows of each client: as even as possible, the first ones one more."""
    return [batch // clients + (1 if c < batch % clients else 0) for c in range(clients)]


@dataclass(frozen=True)
class Spec:
    """What every client generates and how it moves it."""

    seq_len: int
    fields: int
    chunk: int
    get_rows: int
    layout: str
    units: int
    ack: str = "fold"
    out: str = "previous"


# --------------------------------------------------------------------------------------------
# actors
# --------------------------------------------------------------------------------------------
class RawSink:
    """The baseline's storage: keeps what a client sends (zero-copy views of the object store)
    and hands it back once."""

    def __init__(self) -> None:
        self.held: dict[tuple[int, int], Any] = {}

    def write(self, key: tuple[int, int], payload: Any) -> None:
        self.held[key] = payload

    def read(self, key: tuple[int, int]) -> Any:
        return self.held.pop(key)

    def size(self) -> int:
        return len(self.held)

    def clear(self) -> None:
        self.held.clear()


class BenchClient:
    """One client: its share of the rows, generated once (fixed: one ``(rows, seq_len)``
    float32 tensor per field; ragged: per-row prefixes of those rows, plus strings), and the
    put / get loops of the store and of the raw baseline."""

    def __init__(
        self,
        index: int,
        first_row: int,
        n_rows: int,
        batch: int,
        spec: Spec,
        store: Any,
        sinks: list[Any],
    ) -> None:
        self.index = index
        self.n_rows = n_rows
        self.spec = spec
        self.store: RayDataStore = store
        self.sinks = sinks
        self.names = field_names(spec.fields)
        gen = torch.Generator().manual_seed(SEED + index)
        self.fixed = {f: torch.rand(n_rows, spec.seq_len, generator=gen) for f in self.names}
        # lengths and strings are drawn per global row: the workload does not depend on
        # how many clients share it
        rng = np.random.default_rng(SEED)
        lo = max(1, spec.seq_len // 4)
        mine = slice(first_row, first_row + n_rows)
        self.lengths = rng.integers(lo, spec.seq_len + 1, size=batch).tolist()[mine]
        text_lens = rng.integers(64, 513, size=batch)[mine]
        letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz0123456789 ", dtype=np.uint8)
        self.text = [
            f"row {first_row + i}: " + rng.choice(letters, size=int(k)).tobytes().decode()
            for i, k in enumerate(text_lens)
        ]
        # a row prefix of a C-contiguous 2-D tensor is contiguous: no extra memory
        self.ragged = {
            f: [self.fixed[f][i, :n] for i, n in enumerate(self.lengths)] for f in self.names
        }

    def nbytes(self) -> dict[str, int]:
        fixed = self.n_rows * self.spec.seq_len * 4 * self.spec.fields
        ragged = sum(self.lengths) * 4 * self.spec.fields + sum(len(s) for s in self.text)
        return {"fixed": fixed, "ragged": ragged}

    def _chunks(self) -> list[tuple[int, int]]:
        c = self.spec.chunk
        return [(s, min(self.n_rows, s + c)) for s in range(0, self.n_rows, c)]

    # -- the store ------------------------------------------------------------------------
    async def store_put(self, workload: str, partition: str) -> dict[str, float]:
        t0 = time.perf_counter()
        for s, e in self._chunks():
            data: dict[str, Any]
            if workload == "fixed":
                data = {f: self.fixed[f][s:e] for f in self.names}
            else:
                data = {f: self.ragged[f][s:e] for f in self.names}
                data[TEXT] = self.text[s:e]
            await self.store.put(partition, data)
        return {"loop_s": time.perf_counter() - t0}

    async def store_get(self, workload: str, partition: str) -> dict[str, float]:
        layout = layout_for(workload, self.spec.layout)
        fields = self.names + ([TEXT] if workload == "ragged" else [])
        rows = nbytes = calls = 0
        meta_s = data_s = ack_s = 0.0
        pc = time.perf_counter
        fold = self.spec.ack == "fold"
        done: BatchMeta | None = None  # fold: the last batch, acked by the next get_meta
        last: Batch | None = None  # --out previous: the last batch, its memory reused
        t0 = pc()
        while True:
            ta = pc()
            meta = await self.store.get_meta(
                partition, TASK, fields, self.spec.get_rows, timeout=GET_TIMEOUT_S, ack=done
            )
            done = None
            tb = pc()
            meta_s += tb - ta
            calls += 1
            if meta.end_of_stream:
                break
            batch = await self.store.get_data(meta, layout=layout, out=last)  # type: ignore[arg-type]
            for f in self.names:  # real elements (never padding), read from what came back
                nbytes += int(batch.lengths[f].sum()) * 4
            if workload == "ragged":
                nbytes += sum(len(s) for s in batch[TEXT])
            last = batch if self.spec.out == "previous" else None
            del batch
            tc = pc()
            if fold:
                done = meta
            else:
                await self.store.ack(meta)
            td = pc()
            data_s += tc - tb
            ack_s += td - tc
            rows += len(meta.rows)
        return {
            "loop_s": pc() - t0,
            "rows": rows,
            "bytes": nbytes,
            "meta_s": meta_s,
            "data_s": data_s,
            "ack_s": ack_s,
            "get_meta_calls": calls,
        }

    # -- the raw baseline --------------------------------------------------------------------
    def _parts(self, s: int, e: int) -> list[tuple[int, int]]:
        """The contiguous slice of chunk rows [s, e) each sink receives."""
        n = len(self.sinks)
        bounds = [s + (e - s) * u // n for u in range(n + 1)]
        return list(itertools.pairwise(bounds))

    def _payload(self, path: str, s: int, e: int) -> tuple[list[Any], dict[str, Any]]:
        """Rows [s, e) for one sink: one entry per float field, and the extras."""
        if path == "raw":  # fixed: numpy views (Ray's zero-copy path; torch would be pickled)
            return [self.fixed[f][s:e].numpy() for f in self.names], {}
        rows = [[t.numpy() for t in self.ragged[f][s:e]] for f in self.names]
        extra: dict[str, Any] = {TEXT: self.text[s:e]}
        if path == "raw-rows":  # one out-of-band buffer per row and field, no copy here
            return rows, extra
        # raw-packed: one flat array per field (one copy here) plus the lengths
        extra["lengths"] = np.asarray(self.lengths[s:e], dtype=np.int64)
        return [np.concatenate(r) for r in rows], extra

    async def raw_put(self, path: str) -> dict[str, float]:
        t0 = time.perf_counter()
        for k, (s, e) in enumerate(self._chunks()):
            await asyncio.gather(
                *(
                    sink.write.remote((self.index, k), self._payload(path, a, b))
                    for sink, (a, b) in zip(self.sinks, self._parts(s, e), strict=True)
                    if b > a
                )
            )
        return {"loop_s": time.perf_counter() - t0}

    async def raw_get(self) -> dict[str, float]:
        t0 = time.perf_counter()
        rows = nbytes = 0
        for k, (s, e) in enumerate(self._chunks()):
            got = await asyncio.gather(
                *(
                    sink.read.remote((self.index, k))
                    for sink, (a, b) in zip(self.sinks, self._parts(s, e), strict=True)
                    if b > a
                )
            )
            for cols, extra in got:
                for col in cols:
                    arrays = [col] if isinstance(col, np.ndarray) else col
                    nbytes += sum(int(a.nbytes) for a in arrays)
                nbytes += sum(len(t) for t in extra.get(TEXT, ()))
            del got
            rows += e - s
        return {"loop_s": time.perf_counter() - t0, "rows": rows, "bytes": nbytes}


# --------------------------------------------------------------------------------------------
# one run
# --------------------------------------------------------------------------------------------
@dataclass
class Bench:
    ray: Any
    store: RayDataStore
    clients: list[Any]
    sinks: list[Any]
    spec: Spec
    batch: int
    nbytes: dict[str, int]
    runs: int = 0

    def store_run(self, workload: str) -> dict[str, float]:
        """put phase, close, get phase through a fresh partition of an empty store."""
        ray, store = self.ray, self.store
        self.runs += 1
        partition = f"{workload}-{self.runs}"
        fields = field_names(self.spec.fields) + ([TEXT] if workload == "ragged" else [])

        async def prepare() -> None:
            await store.reset()
            await store.create_partition(partition, fields, tasks=[TASK])

        run(prepare())
        t0 = time.perf_counter()
        puts = ray.get([c.store_put.remote(workload, partition) for c in self.clients])
        put_s = time.perf_counter() - t0
        run(store.close(partition))
        t1 = time.perf_counter()
        gets = ray.get([c.store_get.remote(workload, partition) for c in self.clients])
        get_s = time.perf_counter() - t1
        rows = sum(int(g["rows"]) for g in gets)
        got = sum(int(g["bytes"]) for g in gets)
        if rows != self.batch or got != self.nbytes[workload]:
            raise RuntimeError(
                f"store/{workload}: read {rows} rows and {got} bytes, expected {self.batch} "
                f"rows and {self.nbytes[workload]} bytes"
            )
        stats = run(store.stats(partition))
        if stats.rows_live != 0:
            raise RuntimeError(f"store/{workload}: {stats.rows_live} rows were not reclaimed")
        n = len(self.clients)
        return {
            "put_s": put_s,
            "get_s": get_s,
            "put_loop_max_s": max(p["loop_s"] for p in puts),
            # per client, averaged: where a client's get loop spends its time
            "meta_s": sum(g["meta_s"] for g in gets) / n,
            "data_s": sum(g["data_s"] for g in gets) / n,
            "ack_s": sum(g["ack_s"] for g in gets) / n,
            "get_meta_calls": sum(g["get_meta_calls"] for g in gets),
            "rows_min": min(g["rows"] for g in gets),
            "rows_max": max(g["rows"] for g in gets),
        }

    def raw_run(self, workload: str, path: str) -> dict[str, float]:
        ray = self.ray
        ray.get([s.clear.remote() for s in self.sinks])
        t0 = time.perf_counter()
        ray.get([c.raw_put.remote(path) for c in self.clients])
        put_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        gets = ray.get([c.raw_get.remote() for c in self.clients])
        get_s = time.perf_counter() - t1
        rows = sum(int(g["rows"]) for g in gets)
        got = sum(int(g["bytes"]) for g in gets)
        if rows != self.batch or got != self.nbytes[workload]:
            raise RuntimeError(
                f"{path}/{workload}: read {rows} rows and {got} bytes, expected {self.batch} rows "
                f"and {self.nbytes[workload]} bytes"
            )
        left = sum(ray.get([s.size.remote() for s in self.sinks]))
        if left:
            raise RuntimeError(f"{path}/{workload}: {left} chunk parts left in the sinks")
        return {"put_s": put_s, "get_s": get_s}

    def one(self, workload: str, path: str) -> dict[str, float]:
        return self.store_run(workload) if path == "store" else self.raw_run(workload, path)


@dataclass
class Series:
    runs: list[dict[str, float]] = field(default_factory=list)

    def get(self, key: str) -> list[float]:
        return [r[key] for r in self.runs]


def bench(b: Bench, reps: int, warm: bool) -> dict[tuple[str, str], Series]:
    if warm:  # untimed: first touches of the units' heaps and the object store, lazy imports
        for w in WORKLOADS:
            for p in PATHS[w]:
                b.one(w, p)
    out = {(w, p): Series() for w in WORKLOADS for p in PATHS[w]}
    for rep in range(reps):
        workloads = WORKLOADS if rep % 2 == 0 else WORKLOADS[::-1]
        for w in workloads:
            paths = PATHS[w]
            shift = (rep // 2) % len(paths)  # A B, A B, B A, B A, ... (rotations of 3 paths)
            for p in paths[shift:] + paths[:shift]:
                out[(w, p)].runs.append(b.one(w, p))
    return out


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="AsyncFlow RayDataStore benchmark (see module doc)")
    ap.add_argument("--clients", type=int, default=2, help="client actors (default 2)")
    ap.add_argument("--units", type=int, default=2, help="storage units (default 2)")
    ap.add_argument("--batch", type=int, default=None, help="rows (default 1024; quick 64)")
    ap.add_argument("--seq-len", type=int, default=None, help="floats/row (8192; quick 1024)")
    ap.add_argument("--fields", type=int, default=None, help="float32 fields (10; quick 4)")
    ap.add_argument("--chunk", type=int, default=None, help="rows per put (64; quick 16)")
    ap.add_argument("--get-rows", type=int, default=None, help="rows per get_meta (64; quick 16)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 7; quick 1)")
    ap.add_argument("--layout", choices=LAYOUTS, default="auto", help="get_data layout")
    ap.add_argument(
        "--ack",
        choices=ACKS,
        default="fold",
        help="store get loop: fold each batch's ack into the next get_meta (default), or ack "
        "it with its own call (separate)",
    )
    ap.add_argument(
        "--out",
        choices=OUTS,
        default="previous",
        help="store get loop: read each batch into the previous batch's memory (get_data(..., "
        "out=previous), as a training loop does: the default), or into fresh memory (none)",
    )
    ap.add_argument(
        "--rows-per-block",
        type=int,
        default=ROWS_PER_BLOCK,
        help=f"store routing: row r on unit (r // B) %% units (default {ROWS_PER_BLOCK})",
    )
    ap.add_argument(
        "--object-store-gib", type=float, default=None, help="object store (3; quick 0.5)"
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, 1 rep, no warm")
    args = ap.parse_args(argv)
    q = args.quick
    defaults = {
        "batch": (1024, 64),
        "seq_len": (8192, 1024),
        "fields": (10, 4),
        "chunk": (64, 16),
        "get_rows": (64, 16),
        "reps": (7, 1),
        "object_store_gib": (3.0, 0.5),
    }
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    ints = (
        "clients", "units", "batch", "seq_len", "fields", "chunk", "get_rows", "reps",
        "rows_per_block",
    )  # fmt: skip
    if min(getattr(args, n) for n in ints) < 1:
        ap.error("--" + ", --".join(n.replace("_", "-") for n in ints) + " must be >= 1")
    if args.batch < args.clients:
        ap.error("--batch must be >= --clients")
    if not args.object_store_gib > 0:
        ap.error("--object-store-gib must be > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    spec = Spec(
        args.seq_len,
        args.fields,
        args.chunk,
        args.get_rows,
        args.layout,
        args.units,
        args.ack,
        args.out,
    )
    rt = RayRuntime(
        num_cpus=max(4, os.cpu_count() or 1),  # logical: every actor here reserves 0 CPUs
        object_store_bytes=int(args.object_store_gib * 2**30),
    )
    print(
        f"AsyncFlow RayDataStore benchmark — ray {import_ray().__version__}, torch "
        f"{torch.__version__}, {os.cpu_count()} CPUs, {args.units} storage units, "
        f"{args.clients} client actors, {args.reps} repetitions (median [min-max]), store and "
        "raw interleaved"
        + (" — QUICK smoke mode: no warm-up, figures indicative only" * args.quick)
    )
    rt.start()
    store: RayDataStore | None = None
    try:
        ray = import_ray()
        t_boot = time.perf_counter()
        store = RayDataStore.create(args.units, rows_per_block=args.rows_per_block)
        sink_cls = ray.remote(RawSink).options(num_cpus=0, max_concurrency=8)
        sinks = [sink_cls.remote() for _ in range(args.units)]
        client_cls = ray.remote(BenchClient).options(num_cpus=0)
        clients = []
        first = 0
        for c, n in enumerate(shares(args.batch, args.clients)):
            clients.append(client_cls.remote(c, first, n, args.batch, spec, store, sinks))
            first += n
        per_client = ray.get([c.nbytes.remote() for c in clients])
        ray.get([s.size.remote() for s in sinks])
        nbytes = {w: sum(p[w] for p in per_client) for w in WORKLOADS}
        boot_s = time.perf_counter() - t_boot
        b = Bench(ray, store, clients, sinks, spec, args.batch, nbytes)
        lay = {w: layout_for(w, args.layout) for w in WORKLOADS}
        print(
            f"\nworkload: {args.batch} rows x {args.fields} float32 fields x seq_len "
            f"{args.seq_len} = {nbytes['fixed'] / GB:.3f} GB fixed; ragged: row lengths uniform "
            f"in [{max(1, args.seq_len // 4)}, {args.seq_len}] + a '{TEXT}' field (64-512 chars)"
            f" = {nbytes['ragged'] / GB:.3f} GB.\n    put: {args.chunk} rows per put, one in "
            f"flight per client; get: get_meta({args.get_rows}) on one shared task + get_data "
            f"(layout {lay['fixed']} / {lay['ragged']}, out={args.out}) + ack ({args.ack}: "
            + ("in the next get_meta" if args.ack == "fold" else "its own call")
            + "). GB = 1e9 bytes of payload.\n"
            "    raw baseline: per chunk, one Ray actor call per sink carrying numpy arrays of "
            "its rows (fixed: views; ragged: per-row views = raw-rows,\n    or one concatenated "
            "array per field = raw-packed), kept by the sink and returned once on get.\n"
            f"    (cluster + actors + data: {boot_s:.1f} s)"
        )
        res = bench(b, args.reps, warm=not args.quick)
    finally:
        if store is not None:
            store.shutdown()
        rt.shutdown()

    def times(w: str, p: str, phase: str) -> list[float]:
        s = res[(w, p)]
        if phase == "e2e":
            return [a + b for a, b in zip(s.get("put_s"), s.get("get_s"), strict=True)]
        return s.get(f"{phase}_s")

    def best_raw(w: str, phase: str) -> list[float]:
        """Per repetition, the faster raw configuration's seconds (the baseline)."""
        raws = [times(w, p, phase) for p in PATHS[w] if p != "store"]
        return [min(ts) for ts in zip(*raws, strict=True)]

    def ratios(w: str, p: str, phase: str) -> list[float]:
        base = best_raw(w, phase)
        return [r / t for r, t in zip(base, times(w, p, phase), strict=True)]

    def gbps(w: str, phase: str, p: str | None = None) -> list[float]:
        ts = best_raw(w, phase) if p is None else times(w, p, phase)
        return [nbytes[w] / t / GB for t in ts]

    def sps(w: str, phase: str, p: str | None = None) -> list[float]:
        ts = best_raw(w, phase) if p is None else times(w, p, phase)
        return [args.batch / t for t in ts]

    rows_out = []
    for w in WORKLOADS:
        for p in PATHS[w]:
            s = res[(w, p)]
            split = "-"
            if p == "store":
                split = "/".join(f"{med(s.get(k)):.3f}" for k in ("meta_s", "data_s", "ack_s"))
            rows_out.append(
                [f"{w}/{p}", f"{med(s.get('put_s')):.3f}", f"{med(s.get('get_s')):.3f}",
                 fmt_span(gbps(w, "put", p), 2), fmt_span(gbps(w, "get", p), 2),
                 f"{med(sps(w, 'e2e', p)):,.0f}", split,
                 *(fmt_span(ratios(w, p, ph)) for ph in ("put", "get", "e2e"))]
            )  # fmt: skip
    print()
    print(
        table(
            ["workload/path", "put s", "get s", "put GB/s", "get GB/s", "samples/s e2e",
             "get: meta/data/ack s", "put vs raw", "get vs raw", "e2e vs raw"],
            rows_out,
        )
    )  # fmt: skip
    print(
        "    put s / get s: driver wall clock of the phase (all clients), median. GB/s = payload "
        "bytes / phase s.\n    samples/s e2e = rows / (put s + get s). get: meta/data/ack s = "
        "seconds per client in get_meta / get_data / ack\n    (--ack fold: the acks ride on "
        "the get_metas, ack s = 0).\n    vs raw = best raw s / this s "
        "in the same repetition (best raw: the faster raw configuration of that repetition\n"
        "    and phase; ragged has two: raw-rows sends one array per row, raw-packed "
        "concatenates each field first): 1 = as fast as plain Ray calls."
    )
    fs = res[("fixed", "store")]
    calls = fs.get("get_meta_calls")
    print(
        f"    fixed/store get: {med(calls):.0f} get_meta calls in all (batches + one end of "
        f"stream per client), rows per client {min(fs.get('rows_min')):.0f}-"
        f"{max(fs.get('rows_max')):.0f}"
    )

    def span_json(prefix: str, xs: list[float]) -> dict[str, float]:
        return {prefix: med(xs), f"{prefix}_min": min(xs), f"{prefix}_max": max(xs)}

    result: dict[str, Any] = {
        "put_gbps": med(gbps("fixed", "put", "store")),
        "get_gbps": med(gbps("fixed", "get", "store")),
        "samples_per_s": med(sps("fixed", "e2e", "store")),
        "put_samples_per_s": med(sps("fixed", "put", "store")),
        "get_samples_per_s": med(sps("fixed", "get", "store")),
        "ragged_put_gbps": med(gbps("ragged", "put", "store")),
        "ragged_get_gbps": med(gbps("ragged", "get", "store")),
        "ragged_samples_per_s": med(sps("ragged", "e2e", "store")),
        "raw_put_gbps": med(gbps("fixed", "put")),
        "raw_get_gbps": med(gbps("fixed", "get")),
        "raw_samples_per_s": med(sps("fixed", "e2e")),
        "ragged_raw_put_gbps": med(gbps("ragged", "put")),
        "ragged_raw_get_gbps": med(gbps("ragged", "get")),
        "ragged_raw_samples_per_s": med(sps("ragged", "e2e")),
        **{
            f"ragged_{p.replace('-', '_')}_{ph}_gbps": med(gbps("ragged", ph, p))
            for p in PATHS["ragged"][1:]
            for ph in ("put", "get")
        },
        **span_json("put_vs_raw", ratios("fixed", "store", "put")),
        **span_json("get_vs_raw", ratios("fixed", "store", "get")),
        **span_json("e2e_vs_raw", ratios("fixed", "store", "e2e")),
        **span_json("ragged_put_vs_raw", ratios("ragged", "store", "put")),
        **span_json("ragged_get_vs_raw", ratios("ragged", "store", "get")),
        **span_json("ragged_e2e_vs_raw", ratios("ragged", "store", "e2e")),
        "get_split_s": {
            w: {k: med(res[(w, "store")].get(k)) for k in ("meta_s", "data_s", "ack_s")}
            for w in WORKLOADS
        },
        "storage_units": args.units,
        "rows_per_block": args.rows_per_block,
        "clients": args.clients,
        "ack": args.ack,
        "out": args.out,
        "workload": {
            "batch": args.batch,
            "seq_len": args.seq_len,
            "fields": args.fields,
            "dtype": "float32",
            "bytes": nbytes["fixed"],
            "ragged_bytes": nbytes["ragged"],
            "ragged_lengths": [max(1, args.seq_len // 4), args.seq_len],
            "ragged_string_field": TEXT,
            "chunk_rows": args.chunk,
            "get_rows": args.get_rows,
            "layout": lay,
            "get_task": "one shared task (rows split between clients)",
        },
        "baseline": (
            "raw Ray actor calls carrying numpy views, one call per sink per chunk; ragged: "
            "the faster of one array per row (raw-rows) and one concatenated array per field "
            "(raw-packed), per repetition and phase"
        ),
        "gb": 1e9,
        "reps": args.reps,
        "quick": args.quick,
        "wall_s": time.perf_counter() - t_start,
    }
    print(
        f"\nheadline ({args.clients} clients, {args.units} units): fixed put "
        f"{result['put_gbps']:.2f} GB/s ({fmt_span(ratios('fixed', 'store', 'put'))} of raw), "
        f"get {result['get_gbps']:.2f} GB/s ({fmt_span(ratios('fixed', 'store', 'get'))} of "
        "raw), "
        f"{result['samples_per_s']:,.0f} samples/s; ragged put {result['ragged_put_gbps']:.2f} "
        f"get {result['ragged_get_gbps']:.2f} GB/s; wall {result['wall_s']:.0f} s"
    )
    print(json.dumps(result, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
