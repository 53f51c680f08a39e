"""``asyncflow_tq`` checkpoints (JSON and safetensors, ``asyncflow_tq.checkpoint``): a round
trip restores every value bit for bit and the controller and sampler state as they were; a
pickle, in the old file names or the new, is never unpickled; a truncated, garbled or foreign
file is a ``CheckpointError`` naming it and changes nothing; a value JSON cannot hold is
refused at save time, naming where it sits."""

from __future__ import annotations

import copy
import json
import math
import os
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("tensordict", reason="the TransferQueue facade needs the [tq] extra")
import asyncflow_tq as tq
from asyncflow_tq import checkpoint
from asyncflow_tq.checkpoint import CONTROLLER_FILE, STORAGE_FILE, TENSORS_FILE
from tensordict import TensorDict

from asyncflow_core.contracts.errors import CheckpointError


@pytest.fixture
def q() -> Iterator[Any]:
    tq.init(
        {
            "backend": {"storage_backend": "InProcess"},
            "controller": {"polling_mode": True, "sampler": "RankAwareSampler"},
        }
    )
    try:
        yield tq.get_client()
    finally:
        tq.close()


def fill(c: Any) -> None:
    """Several value kinds, tags, keys, consumption and a sampler cache."""
    rows = [torch.arange(n, dtype=torch.int64) for n in (2, 5, 1)]
    scores = torch.tensor([0.5, float("nan"), -0.0], dtype=torch.float32)
    c.put(
        TensorDict(
            {
                "tokens": torch.nested.nested_tensor(rows, layout=torch.jagged),
                "scores": scores,
                "half": torch.randn(3, 2, 2).to(torch.bfloat16),
                "mask": torch.tensor([[True, False], [False, False], [True, True]]),
                "text": ["a", "é ü", ""],
            },
            batch_size=3,
        ),
        partition_id="train",
    )
    cfg = {"dp_rank": 1, "batch_index": 0, "task_name": "actor", "partition_id": "train"}
    c.get_meta(["scores"], 2, "train", task_name="actor", sampling_config=cfg)
    tq.kv_batch_put(
        keys=["k0", "k1"],
        partition_id="kv",
        fields=TensorDict({"x": torch.arange(6, dtype=torch.float64).reshape(2, 3)}, batch_size=2),
        tags=[{"score": 1.5, "ids": [1, 2], "pair": (3, "b"), 7: None}, {"inf": float("inf")}],
    )


def snapshot(c: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The controller's whole state (a copy: the sampler's part is its live dict) and every
    stored cell."""
    core = c._core
    return copy.deepcopy(core._ctl.state()), c._sync(core._cells.dump())


def same(a: Any, b: Any) -> bool:
    """Equal, tensors bit for bit (NaN and -0.0 included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.device == b.device
            and bytes(a.contiguous().reshape(-1).view(torch.uint8).numpy())
            == bytes(b.contiguous().reshape(-1).view(torch.uint8).numpy())
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b, strict=True))
        )
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and bool(a == b)


def test_round_trip_restores_every_value_bit_for_bit(q: Any, tmp_path: Path) -> None:
    fill(q)
    before = snapshot(q)
    assert before[0]["sampler"]["_states"]["train"]["actor"][1] == {0: [0, 1]}
    tq.save_checkpoint(tmp_path / "ck", metadata={"step": 3})
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == sorted(
        ["metadata.json", CONTROLLER_FILE, STORAGE_FILE, TENSORS_FILE]
    )
    q.clear_partition("train")
    tq.kv_put(key="other", partition_id="kv", tag={"n": 1})
    q.put(TensorDict({"y": torch.zeros(1, 4)}, batch_size=1), partition_id="new")
    assert not same(snapshot(q), before)

    tq.load_checkpoint(tmp_path / "ck")
    assert same(snapshot(q), before)
    assert q.get_partition_list() == ["train", "kv"]
    got = tq.kv_batch_get(keys=["k1", "k0"], partition_id="kv")
    assert [r.tolist() for r in got["x"].unbind()] == [[3.0, 4.0, 5.0], [0.0, 1.0, 2.0]]
    assert tq.kv_list("kv")["kv"]["k0"] == {"score": 1.5, "ids": [1, 2], "pair": (3, "b"), 7: None}
    # the queue goes on from the restored state: the sampler's cache, then fresh indexes
    cfg = {"dp_rank": 1, "batch_index": 0, "task_name": "actor", "partition_id": "train"}
    meta = q.get_meta(["scores"], 2, "train", task_name="actor", sampling_config=cfg)
    assert meta.global_indexes == [0, 1]
    new = q.put(TensorDict({"y": torch.zeros(1, 4)}, batch_size=1), partition_id="new")
    assert new.global_indexes[0] not in {g for p in before[0]["owned"].values() for g in p}


def test_the_files_are_json_and_safetensors(q: Any, tmp_path: Path) -> None:
    fill(q)
    tq.save_checkpoint(tmp_path / "ck")
    ck = tmp_path / "ck"
    controller = json.loads((ck / CONTROLLER_FILE).read_text())
    assert controller["format"] == "asyncflow-tq-controller" and controller["version"] == 1
    assert controller["partitions"]["kv"]["keys"] == {"k0": 3, "k1": 4}
    storage = json.loads((ck / STORAGE_FILE).read_text())
    text = dict(map(tuple, storage["partitions"]["train"]["text"]))  # type: ignore[arg-type]
    assert text == {0: "a", 1: "é ü", 2: ""}
    import safetensors.torch

    flat = safetensors.torch.load_file(str(ck / TENSORS_FILE))
    assert set(flat) == {"int64", "float32", "bfloat16", "bool", "float64"}
    assert all(t.dim() == 1 for t in flat.values())


class _MakesADirectory:
    """A pickle that, once unpickled, creates ``path``: what a crafted file can do (any
    code, not just this)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.path),))


def test_a_pickle_is_never_unpickled(q: Any, tmp_path: Path) -> None:
    fill(q)
    before = snapshot(q)
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"partitions": _MakesADirectory(marker)})
    control = tmp_path / "control"  # the payload does run once unpickled
    pickle.loads(pickle.dumps(_MakesADirectory(control)))
    assert control.is_dir()

    old = tmp_path / "old"  # a folder in the old format, its files crafted
    old.mkdir()
    (old / "metadata.json").write_text("{}")
    (old / "controller_state.pkl").write_bytes(payload)
    torch.save({"train": _MakesADirectory(marker)}, old / "asyncflow_tq_storage.pt")
    with pytest.raises(CheckpointError, match="old pickled format") as err:
        tq.load_checkpoint(old)
    assert "re-create" in str(err.value).lower() and "run any code" in str(err.value)
    with pytest.raises(CheckpointError, match="old pickled format"):
        q.load_controller_checkpoint(str(old / "controller_state.pkl"))
    with pytest.raises(CheckpointError, match="old pickled format"):
        q.load_storage_checkpoint(str(old))
    (old / "controller_state.pkl").unlink()  # the storage file alone is refused too
    with pytest.raises(CheckpointError, match="old pickled format"):
        tq.load_checkpoint(old)

    tq.save_checkpoint(tmp_path / "new")  # the new names holding pickles
    new = tmp_path / "new"
    (new / CONTROLLER_FILE).write_bytes(payload)
    with pytest.raises(CheckpointError, match=CONTROLLER_FILE):
        tq.load_checkpoint(new)
    tq.save_checkpoint(new)
    (new / TENSORS_FILE).write_bytes(payload)
    with pytest.raises(CheckpointError, match=STORAGE_FILE):
        tq.load_checkpoint(new)
    (new / STORAGE_FILE).write_bytes(payload)
    with pytest.raises(CheckpointError, match=STORAGE_FILE):
        tq.load_checkpoint(new)

    assert not marker.exists()
    assert same(snapshot(q), before)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _edit(name: str, change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    """A file that stays JSON but says something this format never writes."""

    def apply(path: Path) -> None:
        doc = json.loads(path.read_text())
        change(doc)
        path.write_text(json.dumps(doc))

    apply.__name__ = name
    return apply


def _set(doc: dict[str, Any], keys: list[Any], value: Any) -> None:
    for k in keys[:-1]:
        doc = doc[k]
    doc[keys[-1]] = value


DAMAGE = [
    (CONTROLLER_FILE, _truncate, "not JSON"),
    (CONTROLLER_FILE, _flip, ""),
    (STORAGE_FILE, _truncate, "not JSON"),
    (STORAGE_FILE, _flip, ""),
    (TENSORS_FILE, _truncate, "sha256"),
    (TENSORS_FILE, _flip, "sha256"),
    (CONTROLLER_FILE, _edit("version", lambda d: _set(d, ["version"], 2)), "version 2"),
    (CONTROLLER_FILE, _edit("format", lambda d: _set(d, ["format"], "x")), "format"),
    (CONTROLLER_FILE, _edit("counter", lambda d: _set(d, ["counter"], "9")), "counter"),
    (
        CONTROLLER_FILE,
        _edit("index", lambda d: _set(d, ["partitions", "kv", "active"], [0, 10**6])),
        "never allocated",
    ),
    (
        CONTROLLER_FILE,
        _edit("tag", lambda d: _set(d, ["partitions", "kv", "custom_meta", 0, 1], {"obj": 1})),
        "not a value this format writes",
    ),
    (
        CONTROLLER_FILE,
        _edit("keys", lambda d: _set(d, ["partitions", "kv", "keys"], {"a": 3, "b": 3})),
        "two keys",
    ),
    (CONTROLLER_FILE, _edit("sampler", lambda d: _set(d, ["sampler"], [])), "sampler"),
    (CONTROLLER_FILE, _edit("extra", lambda d: _set(d, ["extra"], 1)), "unexpected keys"),
    (
        STORAGE_FILE,
        _edit("offset", lambda d: _set(d, ["partitions", "kv", "x", 0, 1, "tensor", "offset"], 99)),
        "past the end",
    ),
    (
        STORAGE_FILE,
        _edit("cell", lambda d: _set(d, ["partitions", "train", "text", 0, 1], {"tuple": [1]})),
        "cannot be a tuple",
    ),
    (STORAGE_FILE, _edit("sha", lambda d: _set(d, ["tensors_sha256"], "0" * 64)), "sha256"),
]


@pytest.mark.parametrize(("name", "damage", "why"), DAMAGE, ids=lambda v: getattr(v, "__name__", v))
def test_a_damaged_file_is_refused_and_changes_nothing(
    q: Any, tmp_path: Path, name: str, damage: Callable[[Path], None], why: str
) -> None:
    fill(q)
    tq.save_checkpoint(tmp_path / "ck")
    q.clear_partition("train")  # now the state differs from the checkpoint's
    tq.kv_put(key="other", partition_id="kv", tag={"n": 1})
    before = snapshot(q)
    damage(tmp_path / "ck" / name)
    with pytest.raises(CheckpointError, match=name) as err:
        tq.load_checkpoint(tmp_path / "ck")
    assert why in str(err.value) and "Nothing was changed" in str(err.value)
    assert same(snapshot(q), before)


def test_garbled_metadata_json_is_refused(q: Any, tmp_path: Path) -> None:
    fill(q)
    tq.save_checkpoint(tmp_path / "ck")
    before = snapshot(q)
    _truncate(tmp_path / "ck" / "metadata.json")
    with pytest.raises(CheckpointError, match=r"metadata\.json"):
        tq.load_checkpoint(tmp_path / "ck")
    assert same(snapshot(q), before)


def test_a_value_json_cannot_hold_is_refused_at_save_naming_it(q: Any, tmp_path: Path) -> None:
    fill(q)
    tq.save_checkpoint(tmp_path / "ck")
    saved = {p.name: p.read_bytes() for p in (tmp_path / "ck").iterdir()}
    tq.kv_put(key="np", partition_id="kv", tag={"score": np.float32(0.5)})
    with pytest.raises(TypeError, match=r"tags of sample \d+.*'score'.*numpy.float32"):
        tq.save_checkpoint(tmp_path / "ck")
    assert {p.name: p.read_bytes() for p in (tmp_path / "ck").iterdir()} == saved
    with pytest.raises(TypeError, match=r"'kv', field 'x', sample 0: .*complex128"):
        checkpoint.write_storage(
            tmp_path, {"kv": {"x": {0: torch.zeros(2, dtype=torch.complex128)}}}
        )


def test_value_encoding_round_trips_the_kinds_json_lacks(tmp_path: Path) -> None:
    value = {
        "nan": float("nan"),
        "inf": [float("inf"), float("-inf")],
        "tuple": (1, (2, "x")),
        "ints": {1: "a", (2, 3): None, 1.5: True, None: 0},
        "dtype": torch.bfloat16,
        "nested": [{"dict": 1}, {"tuple": [1]}],  # user dicts that look like tagged values
    }
    data = json.loads(json.dumps(checkpoint._encode(value, "v"), allow_nan=False))
    assert same(checkpoint._decode(data, "v"), value)
    cells = {"p": {"t": {5: torch.tensor(1.5, dtype=torch.float16), 2: torch.empty(0, 3)}}}
    checkpoint.write_storage(tmp_path, cells)
    assert same(checkpoint.read_storage(tmp_path), cells)
