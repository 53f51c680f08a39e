"""The facade's checkpoint files: JSON for the structure and plain values, safetensors for the
tensors. Nothing here unpickles, so a crafted file can at worst be refused (SECURITY.md).

A checkpoint folder (``asyncflow_tq.save_checkpoint``) holds:

- ``controller_state.json``: the controller (``format`` ``asyncflow-tq-controller``): the index
  counter, the free and per-partition indexes, and per partition its samples, fields in
  registration order, production and consumption status, keys, tags, field schemas and shapes;
  and the sampler's ``save_checkpoint()`` state.
- ``asyncflow_tq_storage.json`` (``format`` ``asyncflow-tq-storage``): every stored cell as
  ``[global index, value]`` per partition and field, and the sha256 of
- ``asyncflow_tq_storage.safetensors``: the tensors' data, one flat tensor per dtype (named
  by the dtype, e.g. ``float32``).
- ``metadata.json``: as TransferQueue writes it (``user_metadata``).

A value (a cell, a tag, a schema entry, the sampler's state) is JSON where JSON can say it:
null, true/false, numbers (an int stays an int, a float a float), strings, lists. Anything
else is an object with exactly one key naming its kind: ``{"dict": {...}}`` (string keys),
``{"items": [[key, value], ...]}`` (a dict with other keys: int, float, bool, None, tuple),
``{"tuple": [...]}``, ``{"float": "nan" | "inf" | "-inf"}``, ``{"dtype": "float32"}`` (a
``torch.dtype``), ``{"tensor": {"dtype", "offset", "shape", "device"}}`` (stored cells only:
``shape`` elements from ``offset`` of that dtype's flat tensor). Saving any other type (a
numpy array, a set, an object) is a ``TypeError`` naming where it sits.

Loading reads and checks every file before anything changes: a file that is not exactly this
(format tag, version, field types, indexes below the counter, tensors inside their buffer, the
safetensors file matching its recorded sha256) is a ``CheckpointError`` naming the file. A
folder in the old pickled format (``controller_state.pkl``, ``asyncflow_tq_storage.pt``) is
refused without opening it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from asyncflow_core.contracts.errors import CheckpointError

__all__ = [
    "CONTROLLER_FILE",
    "OLD_CONTROLLER_FILE",
    "OLD_STORAGE_FILE",
    "STORAGE_FILE",
    "TENSORS_FILE",
    "old_format_error",
    "read_controller",
    "read_storage",
    "write_controller",
    "write_storage",
]

CONTROLLER_FILE = "controller_state.json"
STORAGE_FILE = "asyncflow_tq_storage.json"
TENSORS_FILE = "asyncflow_tq_storage.safetensors"
OLD_CONTROLLER_FILE = "controller_state.pkl"
OLD_STORAGE_FILE = "asyncflow_tq_storage.pt"
CONTROLLER_FORMAT = "asyncflow-tq-controller"
STORAGE_FORMAT = "asyncflow-tq-storage"
VERSION = 1
# the types a store cell holds besides a tensor (asyncflow_core.data.store._PLAIN_TYPES)
_CELL_TYPES = (type(None), bool, int, float, str, list, dict)
_PARTITION_KEYS = {
    "active", "prealloc", "fields", "produced", "consumed", "custom_meta", "keys", "schema",
    "shapes",
}  # fmt: skip


class _Damaged(ValueError):
    """Raised while checking a file; reported as a ``CheckpointError`` naming the file."""


def old_format_error(path: Path) -> CheckpointError:
    return CheckpointError(
        f"{path} is a TransferQueue facade checkpoint in the old pickled format "
        f"({OLD_CONTROLLER_FILE}, {OLD_STORAGE_FILE}), which AsyncFlow no longer reads: "
        "unpickling a file can run any code it names. Nothing was changed. Re-create the "
        "checkpoint with asyncflow_tq.save_checkpoint (JSON and safetensors); if you trust "
        "the file, load it with the AsyncFlow version that wrote it and save it again"
    )


def _refused(path: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"{path} cannot be loaded: {why}. Nothing was changed; load another checkpoint, or "
        "re-create this one with asyncflow_tq.save_checkpoint"
    )


@contextmanager
def _checking(path: Path) -> Iterator[None]:
    try:
        yield
    except _Damaged as e:
        raise _refused(path, str(e)) from None
    except RecursionError:
        raise _refused(path, "values nested too deep") from None


# ----------------------------------------------------------------------------------------------
# values
# ----------------------------------------------------------------------------------------------
class _TensorSink:
    """Tensors being saved: appended to one flat buffer per dtype."""

    def __init__(self) -> None:
        self.parts: dict[str, list[torch.Tensor]] = {}
        self.sizes: dict[str, int] = {}

    def add(self, t: torch.Tensor, where: str) -> dict[str, Any]:
        if t.layout != torch.strided or t.is_nested:
            raise TypeError(f"cannot save {where}: a nested or sparse tensor (dense ones only)")
        name = str(t.dtype).removeprefix("torch.")
        if name not in self.parts:
            try:
                safetensors.torch.save({name: torch.empty(0, dtype=t.dtype)})
            except Exception:
                raise TypeError(
                    f"cannot save {where}: safetensors cannot hold dtype {t.dtype}"
                ) from None
            self.parts[name], self.sizes[name] = [], 0
        offset = self.sizes[name]
        self.parts[name].append(t.detach().reshape(-1).cpu())
        self.sizes[name] += t.numel()
        return {"dtype": name, "offset": offset, "shape": list(t.shape), "device": str(t.device)}

    def serialize(self) -> bytes:
        flat = {name: torch.cat(parts) for name, parts in self.parts.items()}
        return safetensors.torch.save(flat, metadata={"format": STORAGE_FORMAT})


def _encode(value: Any, where: str, tensors: _TensorSink | None = None) -> Any:
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"float": repr(float(value))}
    if isinstance(value, list):
        return [_encode(v, f"{where}[{i}]", tensors) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, f"{where}[{i}]", tensors) for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {"dict": {k: _encode(v, f"{where}[{k!r}]", tensors) for k, v in value.items()}}
        return {
            "items": [
                [_encode(k, f"{where} (a key)", tensors), _encode(v, f"{where}[{k!r}]", tensors)]
                for k, v in value.items()
            ]
        }
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.Tensor) and tensors is not None:
        return {"tensor": tensors.add(value, where)}
    kind = type(value).__qualname__
    module = type(value).__module__
    raise TypeError(
        f"cannot save {where}: it holds a {kind if module == 'builtins' else f'{module}.{kind}'}"
        "; a checkpoint holds None, bool, int, float, str, list, tuple, dict and torch.dtype "
        "values, and tensors in stored cells. Convert it first (float(x), x.tolist(), ...)"
    )


def _decode(data: Any, where: str, buffers: Mapping[str, torch.Tensor] | None = None) -> Any:
    if data is None or isinstance(data, bool | int | float | str):
        return data
    if isinstance(data, list):
        return [_decode(v, f"{where}[{i}]", buffers) for i, v in enumerate(data)]
    if isinstance(data, dict) and len(data) == 1:
        ((kind, body),) = data.items()
        if kind == "dict" and isinstance(body, dict):
            return {k: _decode(v, f"{where}[{k!r}]", buffers) for k, v in body.items()}
        if kind == "items" and isinstance(body, list):
            out: dict[Any, Any] = {}
            for i, pair in enumerate(body):
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise _Damaged(f"{where}: item {i} is not a [key, value] pair")
                key = _decode(pair[0], f"{where} (key {i})", buffers)
                try:
                    hash(key)
                except TypeError:
                    raise _Damaged(f"{where}: key {i} is a {type(key).__name__}") from None
                out[key] = _decode(pair[1], f"{where}[{key!r}]", buffers)
            return out
        if kind == "tuple" and isinstance(body, list):
            return tuple(_decode(v, f"{where}[{i}]", buffers) for i, v in enumerate(body))
        if kind == "float" and body in ("nan", "inf", "-inf"):
            return float(body)
        if kind == "dtype" and isinstance(body, str):
            dtype = getattr(torch, body, None) if body.isidentifier() else None
            if not isinstance(dtype, torch.dtype):
                raise _Damaged(f"{where}: {body!r:.40} is not a torch dtype")
            return dtype
        if kind == "tensor" and buffers is not None:
            return _tensor(body, where, buffers)
    raise _Damaged(f"{where}: {json.dumps(data)[:60]} is not a value this format writes")


def _tensor(body: Any, where: str, buffers: Mapping[str, torch.Tensor]) -> torch.Tensor:
    ref = _object(body, where, {"dtype", "offset", "shape", "device"})
    buf = buffers.get(ref["dtype"]) if isinstance(ref["dtype"], str) else None
    if buf is None:
        raise _Damaged(f"{where}: no tensor data of dtype {ref['dtype']!r:.40}")
    offset = _count(ref["offset"], f"{where}: offset")
    shape = [_count(s, f"{where}: shape") for s in _list(ref["shape"], f"{where}: shape")]
    n = math.prod(shape)
    if offset + n > buf.numel():
        raise _Damaged(f"{where}: runs past the end of the {ref['dtype']} data")
    try:
        device = torch.device(ref["device"])
    except (RuntimeError, TypeError):
        raise _Damaged(f"{where}: {ref['device']!r:.40} is not a device") from None
    t = buf[offset : offset + n].reshape(shape)
    if device.type == "cpu":
        return t
    try:
        return t.to(device)
    except (RuntimeError, AssertionError) as e:  # no such device here
        raise _Damaged(f"{where}: cannot place it on {device} ({e})") from None


# ----------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------
def _object(data: Any, where: str, keys: set[str]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise _Damaged(f"{where}: expected an object, found {type(data).__name__}")
    if set(data) != keys:
        missing, extra = sorted(keys - set(data)), sorted(set(data) - keys)
        raise _Damaged(f"{where}: missing keys {missing}, unexpected keys {extra}")
    return data


def _list(data: Any, where: str) -> list[Any]:
    if not isinstance(data, list):
        raise _Damaged(f"{where}: expected a list, found {type(data).__name__}")
    return data


def _mapping(data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise _Damaged(f"{where}: expected an object, found {type(data).__name__}")
    return data


def _count(data: Any, where: str) -> int:
    if isinstance(data, bool) or not isinstance(data, int) or data < 0:
        raise _Damaged(f"{where}: {data!r:.40} is not an int >= 0")
    return data


def _index(data: Any, where: str, counter: int | None) -> int:
    """A global index; below ``counter`` (every index was allocated from it) unless None."""
    g = _count(data, where)
    if counter is not None and g >= counter:
        raise _Damaged(f"{where}: index {g} was never allocated (the counter is {counter})")
    return g


def _indexes(data: Any, where: str, counter: int) -> list[int]:
    return [_index(g, where, counter) for g in _list(data, where)]


def _name(data: Any, where: str) -> str:
    if not isinstance(data, str) or not data:
        raise _Damaged(f"{where}: {data!r:.40} is not a non-empty string")
    return data


def _pairs(data: Any, where: str, counter: int | None) -> list[tuple[int, Any]]:
    out = []
    for i, pair in enumerate(_list(data, where)):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise _Damaged(f"{where}: entry {i} is not an [index, value] pair")
        out.append((_index(pair[0], where, counter), pair[1]))
    if len({g for g, _ in out}) != len(out):
        raise _Damaged(f"{where}: an index appears twice")
    return out


# ----------------------------------------------------------------------------------------------
# files
# ----------------------------------------------------------------------------------------------
def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _dumps(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _read_json(path: Path, fmt: str) -> dict[str, Any]:
    """The file's top-level object, its format tag and version checked. ``FileNotFoundError``
    when it is absent."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise
    except OSError as e:
        raise _refused(path, f"unreadable ({e.strerror or e})") from None
    if raw[:1] == b"\x80" or raw[:2] == b"PK":  # a pickle (protocol 2+), a torch.save zip
        raise old_format_error(path)
    try:
        doc = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise _refused(path, f"not JSON ({str(e)[:120]})") from None
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise _refused(path, f"format {got!r:.60}, expected {fmt!r}")
    if doc.get("version") != VERSION:
        raise _refused(path, f"version {doc.get('version')!r:.20}; this AsyncFlow reads {VERSION}")
    return doc


def write_controller(path: Path, state: Mapping[str, Any]) -> None:
    """``state``: ``counter``, ``reusable``, ``owned`` (partition -> indexes), ``sampler`` (its
    ``save_checkpoint()`` or None) and ``partitions``: partition -> the ``_Partition`` fields
    but ``pid``. ``TypeError`` naming a tag, schema entry or sampler value JSON cannot hold."""
    parts: dict[str, Any] = {}
    for pid, p in state["partitions"].items():
        at = f"partition {pid!r}"
        parts[pid] = {
            "active": sorted(p["active"]),
            "prealloc": sorted(p["prealloc"]),
            "fields": sorted(p["fields"], key=p["fields"].__getitem__),
            "produced": [[g, sorted(names)] for g, names in sorted(p["produced"].items())],
            "consumed": {task: sorted(done) for task, done in p["consumed"].items()},
            "custom_meta": [
                [g, _encode(meta, f"{at}, the tags of sample {g}")]
                for g, meta in sorted(p["custom_meta"].items())
            ],
            "keys": dict(p["keys"]),
            "schema": {f: _encode(m, f"{at}, the schema of {f!r}") for f, m in p["schema"].items()},
            "shapes": {
                f: [[g, None if s is None else [int(d) for d in s]] for g, s in sorted(c.items())]
                for f, c in p["shapes"].items()
            },
        }
    sampler = state["sampler"]
    doc = {
        "format": CONTROLLER_FORMAT,
        "version": VERSION,
        "counter": state["counter"],
        "reusable": list(state["reusable"]),
        "owned": {pid: sorted(idx) for pid, idx in state["owned"].items()},
        "partitions": parts,
        "sampler": None if sampler is None else _encode(sampler, "the sampler's state"),
    }
    _write(path, _dumps(doc))


def read_controller(path: Path) -> dict[str, Any]:
    """What ``write_controller`` was given, read back and checked (``CheckpointError``)."""
    doc = _read_json(path, CONTROLLER_FORMAT)
    with _checking(path):
        _object(doc, "the file", {"format", "version", "counter", "reusable", "owned",
                                  "partitions", "sampler"})  # fmt: skip
        counter = _count(doc["counter"], "counter")
        owned = {
            _name(pid, "owned"): set(_indexes(idx, f"owned[{pid!r}]", counter))
            for pid, idx in _mapping(doc["owned"], "owned").items()
        }
        parts = {
            _name(pid, "partitions"): _partition(p, f"partitions[{pid!r}]", counter)
            for pid, p in _mapping(doc["partitions"], "partitions").items()
        }
        return {
            "counter": counter,
            "reusable": _indexes(doc["reusable"], "reusable", counter),
            "owned": owned,
            "partitions": parts,
            "sampler": _decode(doc["sampler"], "sampler"),
        }


def _partition(data: Any, at: str, counter: int) -> dict[str, Any]:
    d = _object(data, at, _PARTITION_KEYS)
    fields = [_name(f, f"{at}.fields") for f in _list(d["fields"], f"{at}.fields")]
    if len(set(fields)) != len(fields):
        raise _Damaged(f"{at}.fields: a field appears twice")
    produced = {
        g: {_name(f, f"{at}.produced") for f in _list(names, f"{at}.produced[{g}]")}
        for g, names in _pairs(d["produced"], f"{at}.produced", counter)
    }
    custom_meta = {}
    for g, meta in _pairs(d["custom_meta"], f"{at}.custom_meta", counter):
        tags = _decode(meta, f"{at}.custom_meta[{g}]")
        if not isinstance(tags, dict):
            raise _Damaged(f"{at}.custom_meta[{g}]: the tags are a {type(tags).__name__}")
        custom_meta[g] = tags
    keys = {
        _name(k, f"{at}.keys"): _index(g, f"{at}.keys[{k!r}]", counter)
        for k, g in _mapping(d["keys"], f"{at}.keys").items()
    }
    if len(set(keys.values())) != len(keys):
        raise _Damaged(f"{at}.keys: two keys name one sample")
    schema = {}
    for f, meta in _mapping(d["schema"], f"{at}.schema").items():
        entry = _decode(meta, f"{at}.schema[{f!r}]")
        if not isinstance(entry, dict) or not all(isinstance(k, str) for k in entry):
            raise _Damaged(f"{at}.schema[{f!r}]: not a dict of str keys")
        schema[_name(f, f"{at}.schema")] = entry
    shapes: dict[str, dict[int, tuple[int, ...] | None]] = {}
    for f, col in _mapping(d["shapes"], f"{at}.shapes").items():
        where = f"{at}.shapes[{f!r}]"
        shapes[_name(f, f"{at}.shapes")] = {
            g: None if s is None else tuple(_count(x, where) for x in _list(s, where))
            for g, s in _pairs(col, where, counter)
        }
    return {
        "active": set(_indexes(d["active"], f"{at}.active", counter)),
        "prealloc": set(_indexes(d["prealloc"], f"{at}.prealloc", counter)),
        "fields": {f: i for i, f in enumerate(fields)},
        "produced": produced,
        "consumed": {
            _name(task, f"{at}.consumed"): set(_indexes(done, f"{at}.consumed[{task!r}]", counter))
            for task, done in _mapping(d["consumed"], f"{at}.consumed").items()
        },
        "custom_meta": custom_meta,
        "keys": keys,
        "rkeys": {g: k for k, g in keys.items()},
        "schema": schema,
        "shapes": shapes,
    }


def write_storage(folder: Path, cells: Mapping[str, Mapping[str, Mapping[int, Any]]]) -> None:
    """Every stored cell (partition -> field -> global index -> value) into ``folder``: the
    tensors' data first, then the JSON that names it by its sha256. ``TypeError`` naming a
    cell that cannot be saved, before anything is written."""
    tensors = _TensorSink()
    parts = {
        pid: {
            f: [
                [g, _encode(v, f"partition {pid!r}, field {f!r}, sample {g}", tensors)]
                for g, v in sorted(col.items())
            ]
            for f, col in cols.items()
        }
        for pid, cols in cells.items()
    }
    blob = tensors.serialize()
    doc = {
        "format": STORAGE_FORMAT,
        "version": VERSION,
        "tensors_sha256": hashlib.sha256(blob).hexdigest(),
        "partitions": parts,
    }
    _write(folder / TENSORS_FILE, blob)
    _write(folder / STORAGE_FILE, _dumps(doc))


def read_storage(folder: Path) -> dict[str, dict[str, dict[int, Any]]]:
    """What ``write_storage`` wrote into ``folder``, read back and checked
    (``CheckpointError``; ``FileNotFoundError`` when there is no such checkpoint)."""
    path = folder / STORAGE_FILE
    if not path.exists() and (folder / OLD_STORAGE_FILE).exists():
        raise old_format_error(folder / OLD_STORAGE_FILE)
    if not path.exists():
        raise FileNotFoundError(f"{STORAGE_FILE} not found in {folder}")
    doc = _read_json(path, STORAGE_FORMAT)
    with _checking(path):
        _object(doc, "the file", {"format", "version", "tensors_sha256", "partitions"})
        try:
            blob = (folder / TENSORS_FILE).read_bytes()
        except OSError as e:
            raise _Damaged(f"cannot read {TENSORS_FILE} beside it ({e.strerror or e})") from None
        if hashlib.sha256(blob).hexdigest() != doc["tensors_sha256"]:
            raise _Damaged(f"{TENSORS_FILE} beside it is not the one saved with it (sha256)")
        try:
            buffers = safetensors.torch.load(blob)
        except Exception as e:  # safetensors' own error type, or one from torch
            raise _Damaged(f"{TENSORS_FILE} is not readable safetensors ({e})") from None
        for name, buf in buffers.items():
            if buf.dim() != 1 or str(buf.dtype) != f"torch.{name}":
                raise _Damaged(f"{TENSORS_FILE}: {name!r:.40} is not a flat {name} tensor")
        cells: dict[str, dict[str, dict[int, Any]]] = {}
        for pid, cols in _mapping(doc["partitions"], "partitions").items():
            out = cells[_name(pid, "partitions")] = {}
            for f, col in _mapping(cols, f"partitions[{pid!r}]").items():
                at = f"partitions[{pid!r}][{f!r}]"
                out[_name(f, at)] = {
                    g: _cell(v, f"{at}[{g}]", buffers) for g, v in _pairs(col, at, None)
                }
        return cells


def _cell(data: Any, where: str, buffers: Mapping[str, torch.Tensor]) -> Any:
    value = _decode(data, where, buffers)
    if not isinstance(value, (torch.Tensor, *_CELL_TYPES)):
        raise _Damaged(f"{where}: a stored cell cannot be a {type(value).__name__}")
    return value
