"""DataStore benchmark: the in-process store against plain baselines, in one run.

Three sections, each interleaving baseline and candidate (A B A B ...) over several
repetitions and reporting the median with min-max (see /work/shared/BENCHMARKING.md), run in
this order:

1. **get_meta** — latency p50/p99 of ``get_meta(batch_size=32)`` with 10,000 ready rows, each
   call followed by a nack (timed: the awaited get_meta alone), with the default sampler,
   ``GroupSampler(n=8)`` and ``TokenBalancedSampler`` (when ``asyncflow_core.data.scheduling``
   provides them). It runs first, on a fresh heap: its cost depends on the allocator's state,
   which the other sections change.
2. **bulk** — put + get of ~1 GiB of ragged float32 rows (two fields, long-tailed lengths of
   4-64 K floats, fixed seed) through ``InProcessDataStore`` (create partition, put in
   batches, close, get_meta + get_data + ack every row with one consumer task so rows are
   reclaimed; each get_data passes the previous step's batch as ``out=``, as a training loop
   does), against one plain copy of the same bytes: ``torch.cat(rows, out=preallocated_flat_
   buffer)`` per field (one memcpy of every byte, no allocation: the best library call for
   copying those bytes once). "The same bytes" are the bytes of the batches the configuration
   produces: for the padded layout, padding included (4.5x the data on this workload), so its
   baseline repeats the copy over the rows until it has copied as many bytes. Ratio = copy_s /
   store_s for every ``copy_on_put`` x ``layout`` configuration. The headline
   ``put_get_vs_copy`` is the store's default ``copy_on_put=False`` reading padded batches
   (``layout="padded"``, what ``TrainEngine``s consume); the zero-copy ``layout="list"`` (rows
   handed back as they were put) and "nested" (one jagged tensor) are reported beside it, and
   '/fresh' rows read without ``out=`` (memory from the store's buffer pool). "Floors" time
   the library work a configuration cannot avoid on the same rows (per-row ``clone``,
   per-batch ``pad_sequence`` / ``nested_tensor``), so the gap between a configuration and
   its floor is the store's own overhead. Minor page faults are counted because fresh memory
   is expensive on these VMs.
3. **small** — 100,000 small rows x 8 fields (tensors, ints, floats, strs) put in batches of
   1,000 and read back with get_meta + get_data + ack (batches of 1,000); rows/s for put, get
   and end to end, against a plain dict of dicts doing the same puts and gets.

Usage: ``python benchmarks/datastore.py [--quick] [--repeats N] [--gib X] [--threads N]``.
The last stdout line is one JSON object with every figure. ``--profile {bulk,small,meta}``
prints a cProfile of one store run of that section to stderr instead of benchmarking.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import json
import math
import os
import pstats
import resource
import statistics
import sys
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from asyncflow_core.contracts.protocols import Tags
from asyncflow_core.data.scheduling import GroupSampler, TokenBalancedSampler
from asyncflow_core.data.store import InProcessDataStore

T = TypeVar("T")
SEED = 1234
GB = 1e9
BULK_FIELDS = ("old_logprobs", "ref_logprobs")
SMALL_FIELDS = ("tokens", "logprobs", "reward", "group", "version", "score", "uid", "prompt")
LAYOUTS = ("list", "padded", "nested")
# Headline: the store's defaults (copy_on_put=False) reading padded batches (what TrainEngines
# consume), against a memcpy of as many bytes as those batches hold. The zero-copy rows
# (layout="list": the stored tensors) and one jagged tensor ("nested") are reported beside it.
HEADLINE_KEY = "copy_on_put=False/padded"
LIST_KEY = "copy_on_put=False/list"
FRESH = "fresh"  # key suffix: no out=, every batch in fresh memory
SMALL_HEADLINE = "default: copy_on_put=False, padded"


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
@dataclass
class Series:
    """Repeated measurements of one candidate, each paired with the baseline run before it."""

    values: list[float] = field(default_factory=list)  # candidate seconds (or rows/s)
    ratios: list[float] = field(default_factory=list)  # baseline / candidate time, per pair
    extra: dict[str, list[float]] = field(default_factory=dict)

    def add(self, key: str, v: float) -> None:
        self.extra.setdefault(key, []).append(v)

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    def span(self) -> tuple[float, float]:
        return min(self.ratios), max(self.ratios)

    def med(self, key: str) -> float:
        return statistics.median(self.extra[key])


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def faults() -> int:
    """Minor page faults of this process so far (first touches of fresh memory)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def settle() -> None:
    """Collect garbage before a timed run (cheap: the inputs are frozen by ``freeze``)."""
    gc.collect()


def freeze() -> None:
    """Move the long-lived inputs out of the collector's sight, so ``settle`` costs ~nothing."""
    gc.collect()
    gc.freeze()


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def fmt_span(mid: float, lo: float, hi: float) -> str:
    return f"{mid:.3f} [{lo:.3f}-{hi:.3f}]"


def fmt_ratio(s: Series) -> str:
    return fmt_span(s.ratio, *s.span())


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(line.rstrip() for line in out)


# --------------------------------------------------------------------------------------------
# 1. bulk: ragged float32 rows, store put+get vs one plain copy
# --------------------------------------------------------------------------------------------
@dataclass
class BulkData:
    lengths: list[int]
    cols: dict[str, list[torch.Tensor]]
    nbytes: int


def make_bulk(gib: float, seed: int = SEED) -> BulkData:
    """Rows of two float32 fields sharing a long-tailed length (lognormal, median 8 K floats,
    sigma 0.8, clipped to [4 K, 64 K]) until the two fields together hold ``gib`` GiB. Every
    row is its own tensor, as a rollout would produce it."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    per_field = int(gib * 2**30) // 4 // len(BULK_FIELDS)
    lengths: list[int] = []
    total = 0
    while total < per_field:
        n = int(np.clip(rng.lognormal(math.log(8192), 0.8), 4096, 65536))
        lengths.append(n)
        total += n
    cols = {f: [torch.rand(n, generator=gen) for n in lengths] for f in BULK_FIELDS}
    nbytes = sum(t.numel() * t.element_size() for rows in cols.values() for t in rows)
    return BulkData(lengths, cols, nbytes)


class CopyBaseline:
    """``torch.cat(rows, out=buf)`` per field into preallocated, already-touched flat buffers:
    every byte copied once, no allocation, no page faults — the plain library memcpy.

    ``nbytes`` (default: the data's bytes) is how many bytes to copy in all: more than the
    data (the padded layout's batch bytes) repeats the copy, the last pass over a prefix of
    the rows, so the baseline copies exactly as many bytes as the candidate produces."""

    def __init__(self, data: BulkData, nbytes: int | None = None) -> None:
        self.data = data
        self.bufs = {f: torch.zeros(sum(data.lengths)) for f in BULK_FIELDS}
        per_field = (data.nbytes if nbytes is None else nbytes) // 4 // len(BULK_FIELDS)
        whole, rest = divmod(per_field, sum(data.lengths))
        self.passes: list[tuple[dict[str, list[torch.Tensor]], int]] = [
            (data.cols, sum(data.lengths))
        ] * whole
        if rest:  # a prefix of the rows holding exactly `rest` elements per field
            k = int(np.searchsorted(np.cumsum(data.lengths), rest))
            before = sum(data.lengths[:k])
            prefix = {f: [*data.cols[f][:k], data.cols[f][k][: rest - before]] for f in BULK_FIELDS}
            self.passes.append((prefix, rest))
        self.nbytes = sum(n for _, n in self.passes) * 4 * len(BULK_FIELDS)

    def __call__(self) -> float:
        settle()
        t = time.perf_counter()
        for cols, n in self.passes:
            for f in BULK_FIELDS:
                torch.cat(cols[f], out=self.bufs[f][:n])
        return time.perf_counter() - t


def padded_nbytes(data: BulkData, get_rows: int) -> int:
    """Bytes of every padded batch the bulk read produces (the sequential sampler hands out the
    rows in order, ``get_rows`` at a time; each batch is padded to its longest row)."""
    lens = data.lengths
    elems = sum(
        len(lens[i : i + get_rows]) * max(lens[i : i + get_rows])
        for i in range(0, len(lens), get_rows)
    )
    return elems * 4 * len(BULK_FIELDS)


def floor_clone(data: BulkData) -> float:
    """What ``copy_on_put=True`` cannot avoid: one clone per row (allocation + copy), freed."""
    settle()
    t = time.perf_counter()
    kept = [[r.clone() for r in data.cols[f]] for f in BULK_FIELDS]
    del kept
    return time.perf_counter() - t


def floor_assemble(data: BulkData, layout: str, batch_rows: int) -> float:
    """What a padded / nested read cannot avoid: building each batch's tensors (every field of
    the batch alive at once, as in a ``Batch``) from its row tensors, then dropping them."""
    settle()
    n = len(data.lengths)
    t = time.perf_counter()
    for i in range(0, n, batch_rows):
        out = []
        for f in BULK_FIELDS:
            rows = data.cols[f][i : i + batch_rows]
            if layout == "padded":
                out.append(torch.nn.utils.rnn.pad_sequence(rows, batch_first=True))
            else:
                out.append(torch.nested.nested_tensor(rows, layout=torch.jagged))
        del out
    return time.perf_counter() - t


def batch_elems(batch: Any) -> int:
    """Elements of the batch's bulk fields, padding included (a helper, so no variable of the
    read loop keeps a field's tensor alive: a kept tensor is not reused by ``out=``)."""
    n = 0
    for f in BULK_FIELDS:
        v = batch[f]
        if isinstance(v, list):
            n += sum(t.numel() for t in v)
        elif type(v) is torch.Tensor:  # dense: padded (a nested tensor's own methods are slow)
            n += v.numel()
        else:  # nested: its rows' lengths
            n += int(batch.lengths[f].sum())
    return n


async def store_bulk(
    data: BulkData,
    copy_on_put: bool,
    layout: str,
    put_rows: int,
    get_rows: int,
    reuse: bool = True,
) -> tuple[float, float, int, dict[str, float]]:
    """One pass through a fresh store; returns (put_s, get_s, elements handed out by get,
    seconds of the get phase spent in each of get_meta / get_data / ack). ``reuse``: each
    get_data passes the previous step's batch as ``out=``, as a training loop does once it is
    done with that batch (else the batch is dropped and the next one gets fresh memory)."""
    store = InProcessDataStore(num_storage_units=2, copy_on_put=copy_on_put)
    await store.create_partition("bulk", BULK_FIELDS, tasks=("train",))
    n = len(data.lengths)
    cols = data.cols
    settle()
    t0 = time.perf_counter()
    for i in range(0, n, put_rows):
        await store.put("bulk", {f: cols[f][i : i + put_rows] for f in BULK_FIELDS})
    await store.close("bulk")
    t1 = time.perf_counter()
    got = 0
    elems = 0
    phase = {"meta": 0.0, "data": 0.0, "ack": 0.0}
    pc = time.perf_counter
    batch = None
    while True:
        ta = pc()
        meta = await store.get_meta("bulk", "train", BULK_FIELDS, get_rows, timeout=60.0)
        tb = pc()
        if meta.end_of_stream:
            break
        batch = await store.get_data(meta, layout=layout, out=batch)  # type: ignore[arg-type]
        elems += batch_elems(batch)
        if not reuse:
            batch = None  # the consumer drops the batch (frees a padded / nested copy)
        tc = pc()
        await store.ack(meta)  # reclaims the rows (frees the store's clones if any)
        td = pc()
        phase["meta"] += tb - ta
        phase["data"] += tc - tb
        phase["ack"] += td - tc
        got += len(meta)
    del batch
    t2 = time.perf_counter()
    if got != n:
        raise RuntimeError(f"bulk: read {got} rows, expected {n}")
    stats = await store.stats("bulk")
    if stats.rows_live != 0:
        raise RuntimeError(f"bulk: {stats.rows_live} rows were not reclaimed")
    await store.delete_partition("bulk")
    return t1 - t0, t2 - t1, elems, phase


def bulk_keys() -> list[str]:
    keys = [f"copy_on_put={c}/{lay}" for c in (True, False) for lay in LAYOUTS]
    keys += [f"copy_on_put=False/{lay}/{FRESH}" for lay in ("padded", "nested")]
    return [*keys, "floor:clone", "floor:padded", "floor:nested"]


def is_padded(key: str) -> bool:
    """The configuration produces padded batches (its bytes include the padding)."""
    return key == "floor:padded" or "/padded" in key


def bench_bulk(
    data: BulkData, repeats: int, put_rows: int, get_rows: int, warm: bool = True
) -> dict[str, Any]:
    """Each candidate run follows a run of the copy baseline of the same bytes as the batches
    it produces: the data's bytes, or for a padded configuration the padded batches' bytes
    (then the plain data-bytes copy runs too, for the ratio against the real bytes)."""
    baseline = CopyBaseline(data)
    padded_base = CopyBaseline(data, padded_nbytes(data, get_rows))
    keys = bulk_keys()
    series = {k: Series() for k in keys}
    base = Series()
    pbase = Series()

    def candidate(key: str) -> float:
        if key == "floor:clone":
            return floor_clone(data)
        if key.startswith("floor:"):
            return floor_assemble(data, key.split(":")[1], get_rows)
        c, lay, *rest = key.split("/")
        ps, gs, elems, phase = run(
            store_bulk(data, c == "copy_on_put=True", lay, put_rows, get_rows, not rest)
        )
        series[key].add("put_s", ps)
        series[key].add("get_s", gs)
        for name, v in phase.items():
            series[key].add(f"{name}_s", v)
        series[key].add("elems", elems)
        if lay == "padded" and elems * 4 != padded_base.nbytes:
            raise RuntimeError(
                f"bulk {key}: the batches held {elems * 4} bytes, the padded copy baseline "
                f"copies {padded_base.nbytes}"
            )
        return ps + gs

    if warm:  # one untimed pass of everything (allocator, first touches, lazy imports)
        baseline()
        padded_base()
        for k in keys:
            candidate(k)
    series = {k: Series() for k in keys}
    for rep in range(repeats):
        shift = rep % len(keys)
        for k in keys[shift:] + keys[:shift]:  # rotate positions between repetitions
            f0 = faults()
            b = baseline()
            f1 = faults()
            if is_padded(k):
                bp = padded_base()
                pbase.values.append(bp)
            f2 = faults()
            c = candidate(k)
            f3 = faults()
            base.values.append(b)
            base.add("faults", f1 - f0)
            series[k].values.append(c)
            series[k].ratios.append((bp if is_padded(k) else b) / c)
            series[k].add("ratio_real_bytes", b / c)
            series[k].add("faults", f3 - f2)
    return {"series": series, "base": base, "padded_base": pbase, "keys": keys,
            "padded_bytes": padded_base.nbytes}  # fmt: skip


def floor_of(key: str, floors: dict[str, float]) -> float:
    """Median seconds of the library work configuration ``key`` cannot avoid."""
    c, lay, *_ = key.split("/")
    s = floors["floor:clone"] if c == "copy_on_put=True" else 0.0
    return s + floors.get(f"floor:{lay}", 0.0)


# --------------------------------------------------------------------------------------------
# 2. small rows: rows/s through put and get vs a dict of dicts
# --------------------------------------------------------------------------------------------
def make_small(n_rows: int, put_rows: int, seed: int = SEED) -> list[dict[str, list[Any]]]:
    """Batches of ``put_rows`` rows: token ids and logprobs (ragged, 8-64), a 0-dim reward
    tensor, group and version ints, a float score, a uid and a prompt string."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    lengths = rng.integers(8, 65, size=n_rows).tolist()
    total = int(sum(lengths))
    flat_tokens = torch.randint(0, 32_000, (total,), generator=gen)
    tokens = [t.clone() for t in torch.split(flat_tokens, lengths)]
    logprobs = [t.clone() for t in torch.split(-torch.rand(total, generator=gen), lengths)]
    rewards = [t.clone() for t in torch.rand(n_rows, generator=gen).unbind(0)]
    scores = rng.random(n_rows).tolist()
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    batches = []
    for s in range(0, n_rows, put_rows):
        e = min(n_rows, s + put_rows)
        batches.append(
            {
                "tokens": tokens[s:e],
                "logprobs": logprobs[s:e],
                "reward": rewards[s:e],
                "group": [i // 8 for i in range(s, e)],
                "version": [i // 1000 for i in range(s, e)],
                "score": scores[s:e],
                "uid": [f"req-{i:08d}" for i in range(s, e)],
                "prompt": [" ".join(words[(i + k) % 8] for k in range(6)) for i in range(s, e)],
            }
        )
    return batches


def dict_small(batches: list[dict[str, list[Any]]], get_rows: int) -> tuple[float, float]:
    """The plain baseline: one dict per row in a dict keyed by row id, read back in batches
    as per-field lists (like ``layout="list"``), popped once read (like ack + reclaim)."""
    settle()
    rows: dict[int, dict[str, Any]] = {}
    nxt = 0
    t0 = time.perf_counter()
    for b in batches:
        cols = [(f, b[f]) for f in SMALL_FIELDS]
        n = len(b["uid"])
        for i in range(n):
            rows[nxt + i] = {f: v[i] for f, v in cols}
        nxt += n
    t1 = time.perf_counter()
    got = 0
    for s in range(0, nxt, get_rows):
        recs = [rows.pop(r) for r in range(s, min(nxt, s + get_rows))]
        out = {f: [r[f] for r in recs] for f in SMALL_FIELDS}
        got += len(out["uid"])
    t2 = time.perf_counter()
    if got != nxt or rows:
        raise RuntimeError("dict baseline lost rows")
    return t1 - t0, t2 - t1


async def store_small(
    batches: list[dict[str, list[Any]]],
    copy_on_put: bool,
    layout: str,
    get_rows: int,
    stream: bool = False,
) -> tuple[float, float]:
    """All batches put, then all read (``stream=False``), or each batch read right after its
    put (``stream=True``). Returns (seconds in put, seconds in get_meta+get_data+ack)."""
    store = InProcessDataStore(num_storage_units=2, copy_on_put=copy_on_put)
    await store.create_partition("small", SMALL_FIELDS, tasks=("train",))
    n = sum(len(b["uid"]) for b in batches)
    got = 0
    put_s = get_s = 0.0

    async def read_one() -> bool:
        nonlocal got
        meta = await store.get_meta("small", "train", SMALL_FIELDS, get_rows, timeout=60.0)
        if meta.end_of_stream:
            return False
        batch = await store.get_data(meta, layout=layout)  # type: ignore[arg-type]
        del batch
        await store.ack(meta)
        got += len(meta)
        return True

    settle()
    for i, b in enumerate(batches):
        t = time.perf_counter()
        await store.put("small", b)
        if i == len(batches) - 1:
            await store.close("small")
        put_s += time.perf_counter() - t
        if stream:
            t = time.perf_counter()
            await read_one()
            get_s += time.perf_counter() - t
    t = time.perf_counter()
    while await read_one():
        pass
    get_s += time.perf_counter() - t
    if got != n:
        raise RuntimeError(f"small: read {got} rows, expected {n}")
    await store.delete_partition("small")
    return put_s, get_s


SMALL_CONFIGS: dict[str, tuple[bool, str, bool]] = {  # copy_on_put, layout, stream
    SMALL_HEADLINE: (False, "padded", False),
    "copy_on_put=False, list": (False, "list", False),
    "copy_on_put=True, padded": (True, "padded", False),
    "default, streaming (put 1 batch, get 1 batch)": (False, "padded", True),
}


def bench_small(
    batches: list[dict[str, list[Any]]], repeats: int, get_rows: int, warm: bool = True
) -> dict[str, Any]:
    n = sum(len(b["uid"]) for b in batches)
    base = Series()
    series = {k: Series() for k in SMALL_CONFIGS}

    def candidate(key: str) -> tuple[float, float]:
        copy, layout, stream = SMALL_CONFIGS[key]
        return run(store_small(batches, copy, layout, get_rows, stream))

    if warm:
        dict_small(batches, get_rows)
        for k in SMALL_CONFIGS:
            candidate(k)
    keys = list(SMALL_CONFIGS)
    for rep in range(repeats):
        shift = rep % len(keys)
        for k in keys[shift:] + keys[:shift]:
            bp, bg = dict_small(batches, get_rows)
            sp, sg = candidate(k)
            base.values.append(n / (bp + bg))
            base.add("put", n / bp)
            base.add("get", n / bg)
            s = series[k]
            s.values.append(n / (sp + sg))
            s.ratios.append((bp + bg) / (sp + sg))
            s.add("put", n / sp)
            s.add("get", n / sg)
            s.add("put_ratio", bp / sp)
            s.add("get_ratio", bg / sg)
    return {"n": n, "base": base, "series": series}


# --------------------------------------------------------------------------------------------
# 3. get_meta latency
# --------------------------------------------------------------------------------------------
def samplers() -> dict[str, Any]:
    return {
        "default (sequential)": None,
        "GroupSampler(n=8)": GroupSampler(8),
        "TokenBalancedSampler(parts=4)": TokenBalancedSampler(parts=4),
    }


async def meta_latency(
    ready_rows: int, calls: int, batch: int = 32, warm: int = 50
) -> dict[str, np.ndarray]:
    """Milliseconds of each awaited ``get_meta`` on a partition of ``ready_rows`` ready rows
    (groups of 8, token tags), each call followed by an untimed nack."""
    rng = np.random.default_rng(SEED)
    store = InProcessDataStore(num_storage_units=2)
    fields = ("tokens", "reward")
    await store.create_partition("lat", fields, tasks=("train",))
    for s in range(0, ready_rows, 1000):
        e = min(ready_rows, s + 1000)
        toks = rng.integers(16, 2048, size=e - s).tolist()
        await store.put(
            "lat",
            {
                "tokens": [torch.zeros(8, dtype=torch.long) for _ in range(s, e)],
                "reward": [float(i) for i in range(s, e)],
            },
            tags=[
                Tags(group=i // 8, versions=(0,), tokens=t)
                for i, t in zip(range(s, e), toks, strict=True)
            ],
        )
    out: dict[str, np.ndarray] = {}
    for name, sampler in samplers().items():
        for _ in range(warm):
            m = await store.get_meta("lat", "train", fields, batch, sampler=sampler)
            await store.nack(m)
        settle()
        ns = np.empty(calls, dtype=np.int64)
        for k in range(calls):
            t = time.perf_counter_ns()
            m = await store.get_meta("lat", "train", fields, batch, sampler=sampler, timeout=5.0)
            ns[k] = time.perf_counter_ns() - t
            if len(m) != batch:
                raise RuntimeError(f"get_meta returned {len(m)} rows, expected {batch}")
            await store.nack(m)
        out[name] = ns / 1e6
    stats = await store.stats("lat")
    if stats.ready["tokens"] != ready_rows or stats.leased["train"] != 0:
        raise RuntimeError("get_meta latency: rows were lost or left leased")
    return out


# --------------------------------------------------------------------------------------------
# profiles
# --------------------------------------------------------------------------------------------
def profile(section: str, args: argparse.Namespace) -> None:
    prof = cProfile.Profile()
    lay = args.layout
    if section == "bulk":
        data = make_bulk(args.gib)
        freeze()
        run(store_bulk(data, args.copy_on_put, lay, args.put_rows, args.get_rows))  # warm-up
        prof.enable()
        ps, gs, _, _ = run(store_bulk(data, args.copy_on_put, lay, args.put_rows, args.get_rows))
        prof.disable()
        print(f"bulk copy_on_put={args.copy_on_put} layout={lay}: put {ps:.3f} s, get {gs:.3f} s")
    elif section == "small":
        batches = make_small(args.small_rows, 1000)
        freeze()
        run(store_small(batches, args.copy_on_put, lay, 1000))
        prof.enable()
        ps, gs = run(store_small(batches, args.copy_on_put, lay, 1000))
        prof.disable()
        print(f"small copy_on_put={args.copy_on_put} layout={lay}: put {ps:.3f} s, get {gs:.3f} s")
    else:
        prof.enable()
        lat = run(meta_latency(args.meta_rows, args.meta_calls))
        prof.disable()
        for k, v in lat.items():
            print(f"get_meta {k}: p50 {np.percentile(v, 50):.3f} ms (under cProfile)")
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s).strip_dirs()
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats(30)
    print(s.getvalue(), file=sys.stderr)


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="AsyncFlow DataStore benchmark (see module doc)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 64 MiB, 10k small rows, 500 get_meta calls, 1 repetition, no warm-up",
    )
    ap.add_argument("--repeats", type=int, default=None, help="repetitions (default 5; quick 1)")
    ap.add_argument("--gib", type=float, default=None, help="bulk GiB (default 1; quick 1/16)")
    ap.add_argument("--put-rows", type=int, default=64, help="bulk rows per put (default 64)")
    ap.add_argument("--get-rows", type=int, default=64, help="bulk rows per get (default 64)")
    ap.add_argument("--small-rows", type=int, default=None, help="default 100000; quick 10000")
    ap.add_argument("--meta-rows", type=int, default=10_000, help="ready rows for get_meta")
    ap.add_argument("--meta-calls", type=int, default=None, help="default 2000; quick 500")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--profile", choices=("bulk", "small", "meta"), default=None)
    ap.add_argument("--layout", choices=LAYOUTS, default="padded", help="for --profile")
    ap.add_argument(
        "--no-copy-on-put", dest="copy_on_put", action="store_false", help="for --profile"
    )
    args = ap.parse_args(argv)
    q = args.quick
    args.repeats = args.repeats if args.repeats is not None else (1 if q else 5)
    args.gib = args.gib if args.gib is not None else (1 / 16 if q else 1.0)
    args.small_rows = args.small_rows if args.small_rows is not None else (10_000 if q else 100_000)
    args.meta_calls = args.meta_calls if args.meta_calls is not None else (500 if q else 2000)
    if min(args.repeats, args.small_rows, args.meta_calls, args.put_rows, args.get_rows) < 1:
        ap.error("--repeats, --small-rows, --meta-calls, --put-rows, --get-rows must be >= 1")
    if args.threads is not None and args.threads < 1:
        ap.error("--threads must be >= 1")
    if not args.gib > 0 or args.meta_rows < 32:
        ap.error("--gib must be > 0 and --meta-rows >= 32")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.profile:
        profile(args.profile, args)
        return 0
    torch.manual_seed(SEED)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    t_start = time.perf_counter()
    print(
        f"AsyncFlow DataStore benchmark — torch {torch.__version__}, {threads} intra-op "
        f"threads, {os.cpu_count()} CPUs, {args.repeats} repetitions (median [min-max]), "
        "baseline and candidate interleaved"
        + (" — QUICK smoke mode: no warm-up, figures indicative only" if args.quick else "")
    )

    # ---- 1. get_meta latency (first: on a fresh heap) --------------------------------------
    print(
        f"\n[1] get_meta latency (run first, on a fresh heap): {args.meta_rows} ready rows "
        "(groups of 8, token tags), "
        f"{args.meta_calls} calls of get_meta(batch_size=32) per sampler, each followed by an "
        "untimed nack;\n    perf_counter_ns around the awaited get_meta"
    )
    t_sec = time.perf_counter()
    lat = run(meta_latency(args.meta_rows, args.meta_calls, warm=10 if args.quick else 50))
    lrows = []
    lat_json: dict[str, dict[str, float]] = {}
    for name, v in lat.items():
        p50, p90, p99 = (float(np.percentile(v, q)) for q in (50, 90, 99))
        lat_json[name] = {"p50_ms": p50, "p90_ms": p90, "p99_ms": p99, "max_ms": float(v.max())}
        lrows.append([name, f"{p50:.3f}", f"{p90:.3f}", f"{p99:.3f}", f"{v.max():.3f}"])
    print(table(["sampler", "p50 ms", "p90 ms", "p99 ms", "max ms"], lrows))
    print(f"    (section: {time.perf_counter() - t_sec:.1f} s)")

    # ---- 2. bulk ----------------------------------------------------------------------------
    t_sec = time.perf_counter()
    data = make_bulk(args.gib)
    freeze()
    lens = np.asarray(data.lengths)
    n_rows = len(data.lengths)
    print(
        f"\n[2] bulk put+get: {data.nbytes / 2**30:.3f} GiB = {n_rows} rows x "
        f"{len(BULK_FIELDS)} float32 fields; row length p50 {int(np.median(lens))}, p99 "
        f"{int(np.percentile(lens, 99))}, max {int(lens.max())} floats (lognormal, clipped "
        f"4K-64K); put {args.put_rows} rows/call, close, get_meta {args.get_rows} rows/call + "
        "get_data + ack; 2 storage units, 1 consumer task (rows reclaimed on ack)"
    )
    print(
        "    baseline: torch.cat(rows, out=<preallocated, pre-touched flat buffer>) per field = "
        "one memcpy of every byte; for a padded config, of as many bytes as its padded batches "
        "hold\n    (padding included: the copy repeats over the rows). ratio = copy_s / store_s,"
        " each store run paired with the copy run just before it;\n    >= 0.5 = at least half "
        "the copy's speed. The read loop passes the previous step's batch as out= (as a "
        f"training loop does); '/{FRESH}' = without out=\n    (every batch in fresh memory)."
    )
    bulk = bench_bulk(data, args.repeats, args.put_rows, args.get_rows, warm=not args.quick)
    bs: dict[str, Series] = bulk["series"]
    base: Series = bulk["base"]
    copy_med = med(base.values)
    pcopy_med = med(bulk["padded_base"].values)
    floors = {k: med(bs[k].values) for k in bulk["keys"] if k.startswith("floor:")}
    padded_bytes: int = bulk["padded_bytes"]
    pad_infl = padded_bytes / data.nbytes
    rows_out = []
    bulk_json: dict[str, dict[str, float]] = {}
    for k in bulk["keys"]:
        s = bs[k]
        t = med(s.values)
        lo, hi = s.span()
        j = {"ratio": s.ratio, "ratio_min": lo, "ratio_max": hi, "total_s": t}
        rr = s.extra["ratio_real_bytes"]
        j["ratio_real_bytes"] = med(rr)
        j["ratio_real_bytes_min"], j["ratio_real_bytes_max"] = min(rr), max(rr)
        j["gb_per_s"] = data.nbytes / t / GB
        j["batch_bytes"] = padded_bytes if is_padded(k) else data.nbytes
        j["batch_gb_per_s"] = j["batch_bytes"] / t / GB
        j["minor_faults"] = s.med("faults")
        put = get = split = fl = "-"
        if "put_s" in s.extra:
            for name in ("put_s", "get_s", "meta_s", "data_s", "ack_s"):
                j[name] = s.med(name)
            put, get = f"{j['put_s']:.3f}", f"{j['get_s']:.3f}"
            split = f"{j['meta_s']:.3f}/{j['data_s']:.3f}/{j['ack_s']:.3f}"
            floor_s = floor_of(k, floors)
            if floor_s > 0:
                j["floor_ratio"] = (pcopy_med if is_padded(k) else copy_med) / floor_s
                fl = f"{j['floor_ratio']:.3f}"
        bulk_json[k] = j
        mark = {HEADLINE_KEY: "  <- headline (padded: what TrainEngines consume)",
                LIST_KEY: "  <- zero-copy rows"}.get(k, "")  # fmt: skip
        real = fmt_span(j["ratio_real_bytes"], min(rr), max(rr)) if is_padded(k) else "="
        rows_out.append(
            [k, put, get, split, f"{t:.3f}", f"{j['batch_gb_per_s']:.2f}",
             f"{j['minor_faults'] / 1e3:.0f}", fl, real, fmt_ratio(s) + mark]
        )  # fmt: skip
    rows_out.append(
        ["copy baseline (data bytes)", "-", "-", "-", f"{copy_med:.3f}",
         f"{data.nbytes / copy_med / GB:.2f}", f"{base.med('faults') / 1e3:.0f}", "-", "1", "1"]
    )  # fmt: skip
    rows_out.append(
        ["copy baseline (padded bytes)", "-", "-", "-", f"{pcopy_med:.3f}",
         f"{padded_bytes / pcopy_med / GB:.2f}", "-", "-", "-", "1"]
    )  # fmt: skip
    print(
        table(
            ["config", "put s", "get s", "get: meta/data/ack s", "total s", "batch GB/s",
             "kfaults", "floor ratio", "vs copy of data bytes", "ratio copy/store (same bytes)"],
            rows_out,
        )
    )  # fmt: skip
    print(
        f"    batch GB/s = bytes of the batches produced (data {data.nbytes / GB:.3f} GB; padded "
        f"{padded_bytes / GB:.3f} GB) / total s. get = get_meta + get_data "
        "(+ dropping the batch) + ack (reclaim).\n    kfaults = thousands of minor page faults "
        "per run (4 KiB first touches; each costs microseconds on this VM).\n    floor ratio = "
        "copy_s / (median "
        "time of the floors the config needs: clone if copy_on_put, pad_sequence or "
        "nested_tensor\n    per batch) = the best ratio that config could reach. The padded "
        f"layout writes {pad_infl:.2f}x the real elements (padding to each batch's longest row)."
        f"\n    (section: {time.perf_counter() - t_sec:.1f} s)"
    )

    # ---- 3. small rows ----------------------------------------------------------------------
    t_sec = time.perf_counter()
    batches = make_small(args.small_rows, 1000)
    freeze()
    print(
        f"\n[3] small rows: {args.small_rows} rows x {len(SMALL_FIELDS)} fields "
        f"({', '.join(SMALL_FIELDS)}: int64 and float32 tensors of 8-64, a 0-dim float32 "
        "tensor, 2 ints, a float, 2 strs);\n    1000 rows per put and per get_meta; all rows "
        "put, then all read, unless streaming. Baseline: a dict of per-row dicts, read back "
        "as per-field lists, popped when read"
    )
    small = bench_small(batches, args.repeats, 1000, warm=not args.quick)
    sb: Series = small["base"]
    srows = [
        ["dict-of-dicts baseline", f"{sb.med('put'):,.0f}", f"{sb.med('get'):,.0f}",
         f"{med(sb.values):,.0f}", "1", "1", "1"]
    ]  # fmt: skip
    small_json: dict[str, dict[str, float]] = {}
    for k, s in small["series"].items():
        pr, gr = s.extra["put_ratio"], s.extra["get_ratio"]
        srows.append(
            ["store " + k, f"{s.med('put'):,.0f}", f"{s.med('get'):,.0f}",
             f"{med(s.values):,.0f}", fmt_span(med(pr), min(pr), max(pr)),
             fmt_span(med(gr), min(gr), max(gr)), fmt_ratio(s)]
        )  # fmt: skip
        small_json[k] = {
            "rows_per_s": med(s.values),
            "put_rows_per_s": s.med("put"),
            "get_rows_per_s": s.med("get"),
            "vs_dict": s.ratio,
            "vs_dict_min": s.span()[0],
            "vs_dict_max": s.span()[1],
        }
    print(
        table(
            ["config", "put rows/s", "get rows/s", "e2e rows/s", "put vs dict", "get vs dict",
             "e2e vs dict"],
            srows,
        )
    )  # fmt: skip
    print(f"    (section: {time.perf_counter() - t_sec:.1f} s)")

    # ---- summary ----------------------------------------------------------------------------
    hs = bs[HEADLINE_KEY]
    lo, hi = hs.span()
    ls, ns = bs[LIST_KEY], bs["copy_on_put=False/nested"]
    ds: Series = small["series"][SMALL_HEADLINE]
    seq = lat_json["default (sequential)"]
    result: dict[str, Any] = {
        "put_get_vs_copy": hs.ratio,
        "put_get_vs_copy_min": lo,
        "put_get_vs_copy_max": hi,
        "put_get_vs_copy_config": (
            "copy_on_put=False (store default), layout=padded, out=previous batch; against a "
            "memcpy of the padded batches' bytes (padding included)"
        ),
        "put_get_gb_per_s": padded_bytes / med(hs.values) / GB,
        "put_get_floor_ratio": bulk_json[HEADLINE_KEY].get("floor_ratio"),
        "put_get_vs_copy_real_bytes": bulk_json[HEADLINE_KEY]["ratio_real_bytes"],
        "copy_gb_per_s": data.nbytes / copy_med / GB,
        "copy_padded_gb_per_s": padded_bytes / pcopy_med / GB,
        "copy_baseline": "torch.cat(rows, out=preallocated flat buffer) per field",
        "put_get_vs_copy_list": ls.ratio,
        "put_get_vs_copy_list_min": ls.span()[0],
        "put_get_vs_copy_list_max": ls.span()[1],
        "put_get_vs_copy_nested": ns.ratio,
        "put_get_vs_copy_nested_min": ns.span()[0],
        "put_get_vs_copy_nested_max": ns.span()[1],
        "put_get_vs_copy_padded": hs.ratio,
        "put_get_vs_copy_padded_fresh": bs[f"{HEADLINE_KEY}/{FRESH}"].ratio,
        "put_get_vs_copy_nested_fresh": bs[f"copy_on_put=False/nested/{FRESH}"].ratio,
        "put_get_vs_copy_copy_on_put_list": bs["copy_on_put=True/list"].ratio,
        "put_get_vs_copy_copy_on_put_nested": bs["copy_on_put=True/nested"].ratio,
        "bulk": bulk_json,
        "bulk_bytes": data.nbytes,
        "bulk_padded_bytes": padded_bytes,
        "bulk_rows": n_rows,
        "padded_inflation": pad_infl,
        "small_rows_per_s": med(ds.values),
        "small_put_rows_per_s": ds.med("put"),
        "small_get_rows_per_s": ds.med("get"),
        "small_vs_dict": ds.ratio,
        "small_vs_dict_min": ds.span()[0],
        "small_vs_dict_max": ds.span()[1],
        "small_config": "store defaults (copy_on_put=False, layout=padded), put all then read",
        "small_dict_rows_per_s": med(sb.values),
        "small": small_json,
        "small_rows": small["n"],
        "get_meta_p50_ms": seq["p50_ms"],
        "get_meta_p99_ms": seq["p99_ms"],
        "get_meta": lat_json,
        "get_meta_ready_rows": args.meta_rows,
        "get_meta_calls": args.meta_calls,
        "repeats": args.repeats,
        "quick": args.quick,
        "torch_threads": threads,
        "wall_s": time.perf_counter() - t_start,
    }
    print(
        f"\nheadline: put_get_vs_copy {fmt_span(hs.ratio, lo, hi)} (padded, out=, vs a memcpy "
        f"of the padded bytes; target >= 0.5; nested {fmt_ratio(ns)}, list {fmt_ratio(ls)}), "
        f"small_rows_per_s {result['small_rows_per_s']:,.0f}, get_meta p50 "
        f"{seq['p50_ms']:.3f} ms (target <= 1) p99 {seq['p99_ms']:.3f} ms; "
        f"wall {result['wall_s']:.0f} s"
    )
    print(json.dumps(result, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
