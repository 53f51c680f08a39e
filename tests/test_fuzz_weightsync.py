"""Fuzzing the weight-sync wire and its transports with Hypothesis.

Receivers (``DistributedWeightReceiver``; ``read_weights`` for ``DiskWeightSync``'s folders)
get garbage header bytes, JSON headers whose every field is replaced by JSON of any type,
and well-formed syncs with one message dropped, cut, re-sized, duplicated or inserted: each
either loads a well-formed sync or raises ``WeightSyncError``, and a failed one loads nothing
(the target's weights and version stay as they were). Senders (``InProcessWeightSync``,
``DiskWeightSync``, ``DistributedWeightSync``, ``EngineGroupWeightSync`` — as the vLLM and
SGLang adapters build it, in each ``GroupWire``) get malformed buckets and versions: each is
refused with ``WeightSyncError`` before anything reaches a target, and the same sync then
finishes with good buckets as if the bad one had never been offered.

The wire is a fake ``BroadcastGroup`` that records what rank 0 broadcasts and replays a list
of messages to rank 1 (a message of the wrong size, or none left, fails as a real group does:
``WeightSyncError``). No process, socket or sleep; every run draws the same examples.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from asyncflow_core.contracts.errors import WeightSyncError
from asyncflow_core.contracts.protocols import WeightBucket
from asyncflow_core.sync.transports import (
    _HEADER_SLOT,
    DiskWeightSync,
    DistributedWeightReceiver,
    DistributedWeightSync,
    EngineGroupWeightSync,
    GroupWire,
    InProcessWeightSync,
    _layout,
    _pack_into,
    read_weights,
)

FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
CPU = torch.device("cpu")


# --------------------------------------------------------------------------------------------
# The fake group and the recording target
# --------------------------------------------------------------------------------------------
class Wire:
    """A ``BroadcastGroup`` of two ranks in memory: as rank 0 it records every broadcast; as
    rank 1 it fills each broadcast from the next message of ``inbox``."""

    def __init__(self, rank: int, inbox: Sequence[bytes] = ()) -> None:
        self._rank = rank
        self.sent: list[bytes] = []
        self.inbox = deque(inbox)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return 2

    @property
    def device(self) -> torch.device:
        return CPU

    def connect(self) -> None:
        return None

    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout_s: float | None = None) -> None:
        raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
        if self._rank == src:
            self.sent.append(bytes(raw.numpy()))
            return
        if not self.inbox:
            raise WeightSyncError("fake group: the sender is gone")
        message = self.inbox.popleft()
        if len(message) != raw.numel():
            raise WeightSyncError(f"fake group: {len(message)} bytes for {raw.numel()}")
        if message:
            raw.copy_(torch.frombuffer(bytearray(message), dtype=torch.uint8))


class Target:
    """Records what it is given; ``loads`` empty means nothing reached it."""

    def __init__(self) -> None:
        self.loads: list[tuple[list[tuple[str, torch.Tensor]], int]] = []

    async def load_weights(self, weights: Sequence[tuple[str, torch.Tensor]], version: int) -> None:
        self.loads.append(([(n, t.clone()) for n, t in weights], version))


def frame(header: object) -> list[bytes]:
    """A header as the sender puts it on the wire: 8-byte length + JSON in one slot, the
    rest (if any) in a second message."""
    data = json.dumps(header).encode() if not isinstance(header, bytes) else header
    framed = len(data).to_bytes(8, "little") + data
    messages = [framed[:_HEADER_SLOT].ljust(_HEADER_SLOT, b"\0")]
    if len(framed) > _HEADER_SLOT:
        messages.append(framed[_HEADER_SLOT:])
    return messages


def bucket_messages(named: Sequence[tuple[str, torch.Tensor]], op: str = "bucket") -> list[bytes]:
    """One bucket's header and payload, laid out as ``DistributedWeightSync`` sends it (the
    first bucket of a sync has ``op`` "start")."""
    tensors = [t for _, t in named]
    offsets, nbytes = _layout([t.dtype for t in tensors], [t.shape for t in tensors])
    header = {
        "op": op,
        "names": [n for n, _ in named],
        "dtypes": [str(t.dtype) for t in tensors],
        "shapes": [list(t.shape) for t in tensors],
        "nbytes": nbytes,
    }
    payload = _pack_into(torch.empty(nbytes, dtype=torch.uint8), tensors, offsets)
    return frame(header) + ([bytes(payload.numpy())] if nbytes else [])


def receive(messages: Sequence[bytes]) -> tuple[str, Target]:
    """Feed ``messages`` to a receiver; ('loaded', target), ('closed', ...) or ('refused', ...).
    Any exception other than ``WeightSyncError`` propagates (a bug)."""
    target = Target()
    receiver = DistributedWeightReceiver(target, group=Wire(1, messages))
    try:
        version = asyncio.run(receiver.receive_one())
    except WeightSyncError:
        assert target.loads == [], "a refused sync reached the target"
        return "refused", target
    finally:
        receiver.close()
    if version is None:
        assert target.loads == []
        return "closed", target
    ((weights, loaded_version),) = target.loads
    assert loaded_version == version and isinstance(version, int) and version >= 0
    names = [n for n, _ in weights]
    assert all(isinstance(n, str) for n in names) and len(set(names)) == len(names)
    assert all(isinstance(t, torch.Tensor) for _, t in weights)
    return "loaded", target


# --------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------
DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
]  # fmt: skip
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2**63 - 1, 2**63, 2**64, -(2**63)]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(
        [
            "start",
            "bucket",
            "finish",
            "close",
            "float32",
            "torch.float32",
            "torch.qint8",
            "Tensor",
            "uint4",
            "float8_e4m3fn",
            "__class__",
            "torch.",
            "",
        ]
    ),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=10,
)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    n = 1
    for d in shape:
        n *= d
    data = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
    if dtype == torch.bool:  # a bool's byte is 0 or 1 (torch normalises others on copy)
        data = bytes(b & 1 for b in data)
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0)
    return flat.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


@st.composite
def syncs(draw: st.DrawFn) -> list[list[tuple[str, torch.Tensor]]]:
    """1-3 buckets of 0-3 tensors each, names unique across the sync (a counter prefix)."""
    names = iter(f"{i}.{draw(st.text(max_size=6))}" for i in range(9))
    return [
        [(next(names), draw(tensors())) for _ in range(draw(st.integers(0, 3)))]
        for _ in range(draw(st.integers(1, 3)))
    ]


def stream(sync: list[list[tuple[str, torch.Tensor]]], version: int) -> list[list[bytes]]:
    """A whole sync as groups of messages, as the sender puts it on the wire: one group per
    bucket, the first bucket's header being the sync's start, then finish. (The receiver also
    takes a bare start header before the first bucket: see the tests that build one.)"""
    groups = [bucket_messages(b, op="bucket" if i else "start") for i, b in enumerate(sync)]
    return [*(groups or [frame({"op": "start"})]), frame({"op": "finish", "version": version})]


# --------------------------------------------------------------------------------------------
# Receivers
# --------------------------------------------------------------------------------------------
@FUZZ
@given(length=st.integers(0, 2**64 - 1), body=st.binary(max_size=200), start_first=st.booleans())
def test_garbage_header_bytes_are_refused(length: int, body: bytes, start_first: bool) -> None:
    """A header slot of random bytes (any length prefix), as the first header of the stream
    or as the first header inside a sync."""
    slot = (length.to_bytes(8, "little") + body)[:_HEADER_SLOT].ljust(_HEADER_SLOT, b"\0")
    messages = (frame({"op": "start"}) if start_first else []) + [slot]
    outcome, _ = receive(messages)
    event(outcome)  # "refused", unless the bytes happen to spell a header that makes sense


@FUZZ
@given(body=st.binary(max_size=_HEADER_SLOT * 2))
def test_any_header_body_is_parsed_or_refused(body: bytes) -> None:
    """Any bytes behind a correct length prefix (one slot or two)."""
    outcome, _ = receive(frame({"op": "start"}) + frame(body))
    event(outcome)


@FUZZ
@given(
    depth=st.integers(1, 3000),
    opener=st.sampled_from(["[", '{"op":']),
)
def test_deeply_nested_headers_are_refused(depth: int, opener: str) -> None:
    outcome, _ = receive(frame({"op": "start"}) + frame((opener * depth).encode()))
    assert outcome == "refused"


@FUZZ
@given(
    sync=syncs(),
    which=st.integers(0, 10),
    field=st.sampled_from(["op", "names", "dtypes", "shapes", "nbytes", "version", "extra"]),
    value=json_values,
)
def test_a_header_field_replaced_by_any_json(
    sync: list[list[tuple[str, torch.Tensor]]], which: int, field: str, value: Any
) -> None:
    """One field of one header (start, a bucket's, finish) replaced by any JSON value: the
    sync loads (the value happened to make sense) or is refused; never another error."""
    headers: list[dict[str, Any]] = [{"op": "start"}]
    for bucket in sync:
        tensors_ = [t for _, t in bucket]
        headers.append(
            {
                "op": "bucket",
                "names": [n for n, _ in bucket],
                "dtypes": [str(t.dtype) for t in tensors_],
                "shapes": [list(t.shape) for t in tensors_],
                "nbytes": _layout([t.dtype for t in tensors_], [t.shape for t in tensors_])[1],
            }
        )
    headers.append({"op": "finish", "version": 3})
    index = which % len(headers)
    headers[index] = {**headers[index], field: value}
    messages = list(frame(headers[0]))
    for header, bucket in zip(headers[1:-1], sync, strict=True):
        nbytes = sum(t.numel() for _, t in bucket)
        payload = bucket_messages(bucket)[-1:] if nbytes else []
        messages += frame(header) + payload
    messages += frame(headers[-1])
    outcome, _ = receive(messages)
    event(f"{outcome} ({field})")


@FUZZ
@given(
    sync=syncs(),
    version=st.integers(0, 2**40),
    cut=st.sampled_from(["drop", "truncate", "grow", "duplicate", "insert", "reorder"]),
    where=st.integers(0, 100),
    junk=st.binary(max_size=64),
)
def test_a_damaged_stream_is_refused_and_loads_nothing(
    sync: list[list[tuple[str, torch.Tensor]]],
    version: int,
    cut: str,
    where: int,
    junk: bytes,
) -> None:
    """A well-formed sync with one message dropped, cut short, grown, repeated, a junk one
    inserted, or two swapped: refused (a stream can only be out of step, never half-loaded)
    or, where the damage happens to leave a well-formed sync, loaded whole."""
    messages = [m for group in stream(sync, version) for m in group]
    i = where % len(messages)
    if cut == "drop":
        del messages[i]
    elif cut == "truncate":
        messages[i] = messages[i][: len(messages[i]) // 2]
    elif cut == "grow":
        messages[i] = messages[i] + b"\0" * (1 + len(junk))
    elif cut == "duplicate":
        messages.insert(i, messages[i])
    elif cut == "insert":
        messages.insert(i, junk)
    else:
        j = (i + 1) % len(messages)
        messages[i], messages[j] = messages[j], messages[i]
    outcome, _ = receive(messages)
    event(f"{outcome} ({cut})")


@FUZZ
@given(sync=syncs(), version=st.integers(0, 2**62))
def test_a_well_formed_sync_loads_byte_exact(
    sync: list[list[tuple[str, torch.Tensor]]], version: int
) -> None:
    """The law the refusals rest on: what the real sender puts on the wire (compared
    message for message with ``stream``) loads whole and byte-exact."""
    wire = Wire(0)
    sender = DistributedWeightSync(group=wire)

    async def send() -> None:
        await sender.init()
        await sender.start()
        for bucket in sync:
            await sender.update(WeightBucket(tuple(n for n, _ in bucket),
                                             tuple(t for _, t in bucket)))  # fmt: skip
        await sender.finish(version)
        await sender.close()

    asyncio.run(send())
    assert wire.sent[:-1] == [m for group in stream(sync, version) for m in group]
    outcome, target = receive(wire.sent)
    assert outcome == "loaded"
    ((weights, loaded),) = target.loads
    assert loaded == version
    want = [(n, t) for bucket in sync for n, t in bucket]
    assert [n for n, _ in weights] == [n for n, _ in want]
    for (_, got), (_, sent) in zip(weights, want, strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert bytes(got.contiguous().view(-1).view(torch.uint8).numpy()) == bytes(
            sent.contiguous().view(-1).view(torch.uint8).numpy()
        )


@pytest.mark.parametrize(
    "version", [-1, -(2**63), 2**63, 2**64, True, 1.0, "3", None, [3], {"v": 3}]
)
def test_a_finish_with_a_bad_version_loads_nothing(version: object) -> None:
    weights = [("w", torch.ones(2))]
    messages = [m for group in stream([weights], 0)[:-1] for m in group]
    outcome, _ = receive([*messages, *frame({"op": "finish", "version": version})])
    assert outcome == "refused"


@pytest.mark.parametrize(
    ("shape", "nbytes"),
    [
        ([2**62, 2**62], 2**126),  # beyond any buffer torch can index: refused on sight
        ([2**31, 2**31, 4], 2**66),
        ([2**40], 2**42),  # 4 TiB of float32: the allocator's refusal, as WeightSyncError
    ],
)
def test_an_impossible_bucket_size_is_refused(shape: list[int], nbytes: int) -> None:
    header = {"op": "bucket", "names": ["w"], "dtypes": ["torch.float32"], "shapes": [shape],
              "nbytes": nbytes}  # fmt: skip
    outcome, _ = receive(frame({"op": "start"}) + frame(header))
    assert outcome == "refused"


# --------------------------------------------------------------------------------------------
# DiskWeightSync's reader
# --------------------------------------------------------------------------------------------
@FUZZ
@given(manifest=json_values | st.fixed_dictionaries({"version": json_values,
                                                    "buckets": json_values}))  # fmt: skip
def test_read_weights_refuses_any_malformed_manifest(manifest: Any, tmp_path: Path) -> None:
    folder = tmp_path / "v"
    folder.mkdir(exist_ok=True)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    try:
        weights, version = read_weights(folder)
    except WeightSyncError:
        event("refused")
        return
    event("loaded")
    assert isinstance(version, int) and isinstance(weights, list)


@FUZZ
@given(data=st.binary(max_size=300))
def test_read_weights_refuses_a_garbage_bucket_file_or_manifest(
    data: bytes, tmp_path: Path
) -> None:
    folder = tmp_path / "v"
    folder.mkdir(exist_ok=True)
    (folder / "bucket-00000.safetensors").write_bytes(data)
    manifest = {"version": 1, "buckets": [{"file": "bucket-00000.safetensors", "names": ["w"]}]}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(WeightSyncError):
        read_weights(folder)
    (folder / "manifest.json").write_bytes(data)
    with pytest.raises(WeightSyncError):
        read_weights(folder)


# --------------------------------------------------------------------------------------------
# Senders
# --------------------------------------------------------------------------------------------
class GroupEngine:
    """A ``GroupReceiver`` that records metadata and commits (what vLLM / SGLang are told)."""

    def __init__(self, wire: GroupWire | None = None) -> None:
        self.weight_wire = wire
        self.received: list[tuple[list[str], list[str], list[list[int]]]] = []
        self.weight_version = 0

    @property
    def weight_group_ranks(self) -> int:
        return 1

    async def join_weight_group(self, *args: object) -> None:
        return None

    async def begin_weight_update(self) -> None:
        return None

    async def receive_weights(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
    ) -> None:
        self.received.append((list(names), list(dtypes), [list(s) for s in shapes]))

    async def commit_weights(self, version: int) -> None:
        self.weight_version = version

    async def leave_weight_group(self) -> None:
        return None


def _transport(kind: str, tmp_path: Path) -> tuple[Any, Any]:
    """A fresh sender of ``kind`` and the thing to inspect for what reached the targets."""
    if kind == "in-process":
        target = Target()
        return InProcessWeightSync([target]), target
    if kind == "disk":
        target = Target()
        return DiskWeightSync(tmp_path / "disk", [target]), target
    if kind == "distributed":
        wire = Wire(0)
        return DistributedWeightSync(group=wire), wire
    if kind == "vllm":
        from asyncflow_vllm.weightsync import VLLMWeightSync

        engine = GroupEngine()
        return VLLMWeightSync([engine], master_address="127.0.0.1", master_port=1,
                              make_group=lambda a, p, w: Wire(0)), engine  # fmt: skip
    wire_kind = {"sglang-flattened": "flattened", "vllm-packed": "packed"}[kind]
    engine = GroupEngine(GroupWire(wire_kind, 64 if wire_kind == "packed" else 0))  # type: ignore[arg-type]
    return EngineGroupWeightSync([engine], master_address="127.0.0.1", master_port=1,
                                 make_group=lambda a, p, w: Wire(0)), engine  # fmt: skip


SENDERS = ["in-process", "disk", "distributed", "vllm", "vllm-packed", "sglang-flattened"]


def _delivered(kind: str, seen: Any) -> object:
    """What reached the targets so far, comparable across runs."""
    if isinstance(seen, Target):
        return [
            ([(n, t.dtype, tuple(t.shape), t.tolist()) for n, t in w], v) for w, v in seen.loads
        ]
    if isinstance(seen, Wire):
        return list(seen.sent)
    return (list(seen.received), seen.weight_version)


bad_names = st.one_of(
    st.integers(), st.none(), st.binary(max_size=4), st.lists(st.text(max_size=3), max_size=2),
    st.tuples(st.text(max_size=3)), st.floats(allow_nan=False),
)  # fmt: skip
bad_tensors = st.one_of(
    st.none(), st.integers(), st.lists(st.floats(allow_nan=False), max_size=3),
    st.text(max_size=3),
    st.sampled_from(["sparse", "meta", "quantized"]).map(
        lambda k: {
            "sparse": lambda: torch.eye(2).to_sparse(),
            "meta": lambda: torch.empty(2, device="meta"),
            "quantized": lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8),
        }[k]()
    ),
)  # fmt: skip


@st.composite
def bad_buckets(draw: st.DrawFn) -> object:
    good = ("a", "b")
    ts = (torch.ones(2), torch.zeros(3))
    kind = draw(st.sampled_from(
        ["name", "tensor", "lengths", "duplicate", "names-is-str", "not-a-bucket", "resent"]
    ))  # fmt: skip
    event(f"bad bucket: {kind}")
    if kind == "name":
        return WeightBucket((draw(bad_names), "b"), ts)
    if kind == "tensor":
        return WeightBucket(good, (torch.ones(2), draw(bad_tensors)))
    if kind == "lengths":
        return WeightBucket(good, ts[: draw(st.integers(0, 1))])
    if kind == "duplicate":
        return WeightBucket(("a", "a"), ts)
    if kind == "names-is-str":
        return WeightBucket("ab", ts)  # type: ignore[arg-type]
    if kind == "resent":
        return WeightBucket(("first",), (torch.ones(1),))  # already sent in this sync
    return draw(st.one_of(st.none(), st.text(max_size=3), st.just([("a", torch.ones(2))])))


def _send_around(kind: str, tmp_path: Path, bad: object, bad_version: object) -> None:
    """first bucket, (bad bucket: refused), a good bucket, (bad finish: refused), finish:
    what reaches the targets equals the same sync sent without the bad calls."""

    async def run(with_bad: bool) -> object:
        sync, seen = _transport(kind, tmp_path / ("bad" if with_bad else "good"))
        await sync.init()
        await sync.start()
        await sync.update(WeightBucket(("first",), (torch.ones(1),)))
        before = _delivered(kind, seen)
        if with_bad:
            with pytest.raises(WeightSyncError):
                await sync.update(bad)
            assert _delivered(kind, seen) == before, "a refused bucket reached a target"
        await sync.update(WeightBucket(("c", "d"), (torch.arange(3.0), torch.ones(2, 2))))
        if with_bad:
            before = _delivered(kind, seen)
            with pytest.raises(WeightSyncError):
                await sync.finish(bad_version)  # type: ignore[arg-type]
            assert _delivered(kind, seen) == before, "a refused finish reached a target"
        await sync.finish(5)
        if hasattr(sync, "close"):  # the transports with threads or a group
            await sync.close()
        return _delivered(kind, seen)

    assert asyncio.run(run(True)) == asyncio.run(run(False))


bad_versions = st.one_of(
    st.integers(max_value=-1),
    st.integers(min_value=2**63, max_value=2**80),
    st.booleans(),
    st.floats(),
    st.text(max_size=3),
    st.none(),
    st.just([5]),
)


@pytest.mark.parametrize("kind", SENDERS)
@settings(FUZZ, max_examples=25)
@given(bad=bad_buckets(), bad_version=bad_versions)
def test_a_sender_refuses_bad_buckets_and_versions_and_changes_nothing(
    kind: str, bad: object, bad_version: object, tmp_path_factory: Any
) -> None:
    # in process, a meta tensor (a shape without values) is what the simulator syncs
    meta = isinstance(bad, WeightBucket) and any(
        isinstance(t, torch.Tensor) and t.device.type == "meta" for t in bad.tensors
    )
    assume(not (kind == "in-process" and meta))
    _send_around(kind, tmp_path_factory.mktemp(kind), bad, bad_version)


def test_the_group_wires_carry_every_dtype_they_are_given() -> None:
    """A bucket of every dtype above goes through each engine wire: the engines are told the
    names in the order sent, and the messages hold every byte."""
    tensors_ = [torch.arange(6).to(d).reshape(2, 3) for d in DTYPES]
    names = tuple(f"p{i}" for i in range(len(tensors_)))
    for wire in (GroupWire(), GroupWire("packed", 10), GroupWire("flattened")):
        engine = GroupEngine(wire)
        group = Wire(0)
        make = functools.partial(lambda g, *a: g, group)
        sync = EngineGroupWeightSync(
            [engine], master_address="127.0.0.1", master_port=1, make_group=make
        )

        async def run(sync: EngineGroupWeightSync = sync) -> None:
            await sync.init()
            await sync.start()
            await sync.update(WeightBucket(names, tuple(tensors_)))
            await sync.finish(1)
            await sync.close()

        asyncio.run(run())
        ((told, dtypes, shapes),) = engine.received
        assert sorted(told) == sorted(names) and engine.weight_version == 1
        order = [names.index(n) for n in told]
        want = b"".join(bytes(tensors_[i].contiguous().view(-1).view(torch.uint8).numpy())
                        for i in order)  # fmt: skip
        assert b"".join(group.sent) == want
        assert dtypes == [str(tensors_[i].dtype).removeprefix("torch.") for i in order]
        assert shapes == [[2, 3]] * len(order)


# --------------------------------------------------------------------------------------------
# A real target: the reference inference engine
# --------------------------------------------------------------------------------------------
@st.composite
def model_syncs(draw: st.DrawFn, params: dict[str, torch.Tensor]) -> list[tuple[str, Any]]:
    """Some of the model's parameters, each kept or damaged: renamed, reshaped, retyped."""
    chosen = draw(st.lists(st.sampled_from(sorted(params)), min_size=1, max_size=4, unique=True))
    out = []
    for name in chosen:
        tensor = params[name].clone()
        damage = draw(st.sampled_from(["none", "none", "name", "shape", "dtype", "empty"]))
        event(f"parameter damage: {damage}")
        if damage == "name":
            name = name + draw(st.sampled_from([".x", "_", "", " "]))
        elif damage == "shape":
            tensor = tensor.reshape(-1)[: max(tensor.numel() - 1, 0)]
        elif damage == "dtype":
            tensor = tensor.to(draw(st.sampled_from([torch.int64, torch.bool, torch.complex64])))
        elif damage == "empty":
            tensor = torch.empty(0)
        out.append((name, tensor))
    return out


def test_the_reference_engine_refuses_a_damaged_sync_and_keeps_its_weights() -> None:
    """Wire-valid syncs whose parameters do not fit the model (unknown names, wrong shapes,
    dtypes it cannot take) into a ``TorchInferenceEngine``: loaded whole, or refused with a
    named AsyncFlow error and the model's weights and version as they were."""
    from asyncflow_reference.engines import TorchInferenceEngine
    from asyncflow_reference.model import ModelConfig

    from asyncflow_core.contracts.errors import AsyncFlowError

    engine = TorchInferenceEngine(ModelConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=2,
                                              max_seq_len=8))  # fmt: skip
    params = {n: p.detach().clone() for n, p in engine.model.state_dict().items()}

    @settings(FUZZ, max_examples=40)
    @given(weights=model_syncs(params), version=st.integers(1, 2**40))
    def check(weights: list[tuple[str, torch.Tensor]], version: int) -> None:
        before = {n: t.clone() for n, t in engine.model.state_dict().items()}
        old_version = engine.weight_version
        receiver = DistributedWeightReceiver(
            engine, group=Wire(1, [m for g in stream([weights], version) for m in g])
        )
        try:
            got = asyncio.run(receiver.receive_one())
        except AsyncFlowError as exc:
            event(f"refused: {type(exc).__name__}")
            assert engine.weight_version == old_version
            after = engine.model.state_dict()
            assert all(torch.equal(after[n], t) for n, t in before.items())
            return
        finally:
            receiver.close()
        event("loaded")
        assert got == version == engine.weight_version

    try:
        check()
    finally:
        asyncio.run(engine.close())
