"""The metadata objects of the TransferQueue API: ``BatchMeta`` (which samples, by global index,
and which of their fields a batch holds) and ``KVBatchMeta`` (the same, named by user keys).

Same attribute and method names as ``transfer_queue.metadata`` in 0.1.11, written from its
documented behaviour; a ``BatchMeta`` of this package is only understood by this package's
client (it carries no storage-unit routing).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["BatchMeta", "KVBatchMeta", "field_schema_of"]

Schema = dict[str, dict[str, Any]]


def field_schema_of(data: Any) -> Schema:
    """Per-field description of a ``TensorDict`` batch: dtype, per-sample shape, nestedness.
    ``ValueError`` naming the field whose batch dimension disagrees with the batch size."""
    n = int(data.batch_size[0]) if len(data.batch_size) else 0
    out: Schema = {}
    if n == 0:
        return out
    for name in list(data.keys()):  # iterating a TensorDict walks its rows
        value = data.get(name)
        if isinstance(value, torch.Tensor):
            if value.is_nested:
                parts = value.unbind()
                if len(parts) != n:
                    raise ValueError(
                        f"field {name!r}: nested tensor of {len(parts)} rows in a batch of {n}"
                    )
                out[name] = {
                    "dtype": value.dtype,
                    "shape": tuple(parts[0].shape),
                    "is_nested": True,
                    "is_non_tensor": False,
                    "per_sample_shapes": [tuple(p.shape) for p in parts],
                }
                continue
            if value.dim() == 0 or value.shape[0] != n:
                raise ValueError(
                    f"field {name!r}: dim 0 is {tuple(value.shape)[:1]}, not the batch size {n}"
                )
            out[name] = {
                "dtype": value.dtype,
                "shape": tuple(value.shape[1:]),
                "is_nested": False,
                "is_non_tensor": False,
            }
        else:
            out[name] = {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": True}
    return out


class BatchMeta:
    """Which samples a batch holds (``global_indexes``, with each one's ``partition_ids``
    entry), the schema of its fields, each sample's production status (1 = every listed field
    written) and its user metadata (``custom_meta``, one dict per sample)."""

    __slots__ = (
        "custom_meta",
        "extra_info",
        "field_schema",
        "global_indexes",
        "partition_ids",
        "production_status",
    )

    def __init__(
        self,
        global_indexes: Sequence[int],
        partition_ids: Sequence[str],
        field_schema: Schema | None = None,
        production_status: Any = None,
        extra_info: dict[str, Any] | None = None,
        custom_meta: Sequence[dict[str, Any]] | None = None,
    ) -> None:
        self.global_indexes = [int(g) for g in global_indexes]
        self.partition_ids = list(partition_ids)
        n = len(self.global_indexes)
        if len(self.partition_ids) != n:
            raise ValueError(
                f"partition_ids has {len(self.partition_ids)} entries, global_indexes has {n}"
            )
        self.field_schema: Schema = {k: dict(v) for k, v in (field_schema or {}).items()}
        for name, meta in self.field_schema.items():
            shapes = meta.get("per_sample_shapes")
            if shapes is not None and len(shapes) != n:
                raise ValueError(
                    f"field_schema[{name!r}]['per_sample_shapes'] has {len(shapes)} entries, "
                    f"the batch has {n} samples"
                )
        if production_status is None:
            self.production_status = np.zeros(n, dtype=np.int8)
        else:
            self.production_status = np.array(production_status, dtype=np.int8, copy=True)
            if self.production_status.shape != (n,):
                raise ValueError(
                    f"production_status has shape {self.production_status.shape}, not ({n},)"
                )
        self.extra_info: dict[str, Any] = dict(extra_info or {})
        if custom_meta:
            if len(custom_meta) != n:
                raise ValueError(f"custom_meta has {len(custom_meta)} entries, not {n}")
            self.custom_meta = [dict(d) for d in custom_meta]
        else:
            self.custom_meta = [{} for _ in range(n)]

    def __getstate__(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            if isinstance(v, np.ndarray) and not v.flags.writeable:
                v = v.copy()  # Ray hands arrays over as read-only views of its object store
            setattr(self, k, v)

    # -- views ---------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self.global_indexes)

    def __len__(self) -> int:
        return self.size

    @property
    def field_names(self) -> list[str]:
        return sorted(self.field_schema)

    @property
    def is_ready(self) -> bool:
        return self.size > 0 and bool(np.all(self.production_status == 1))

    def __repr__(self) -> str:
        return (
            f"BatchMeta(size={self.size}, field_names={self.field_names}, "
            f"is_ready={self.is_ready}, extra_info={self.extra_info})"
        )

    __str__ = __repr__

    # -- user metadata -------------------------------------------------------------------------
    def get_all_custom_meta(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self.custom_meta)

    def update_custom_meta(self, custom_meta: Sequence[dict[str, Any]] | None) -> None:
        if custom_meta is None:
            return
        if len(custom_meta) != self.size:
            raise ValueError(
                f"custom_meta has {len(custom_meta)} entries, the batch has {self.size} samples"
            )
        for mine, new in zip(self.custom_meta, custom_meta, strict=True):
            mine.update(new)

    def clear_custom_meta(self) -> None:
        self.custom_meta = [{} for _ in range(self.size)]

    def get_extra_info(self, key: str, default: Any = None) -> Any:
        return self.extra_info.get(key, default)

    def set_extra_info(self, key: str, value: Any) -> None:
        self.extra_info[key] = value

    def get_all_extra_info(self) -> dict[str, Any]:
        return copy.deepcopy(self.extra_info)

    def update_extra_info(self, info: dict[str, Any]) -> None:
        self.extra_info.update(info)

    def remove_extra_info(self, key: str) -> Any:
        return self.extra_info.pop(key, None)

    def clear_extra_info(self) -> None:
        self.extra_info.clear()

    def has_extra_info(self, key: str) -> bool:
        return key in self.extra_info

    # -- derived batches -----------------------------------------------------------------------
    def add_fields(self, data: Any, set_all_ready: bool = True) -> BatchMeta:
        """Record the fields of ``data`` (a ``TensorDict`` of this batch's size), in place."""
        n = int(data.batch_size[0]) if len(data.batch_size) else 0
        if n == 0:
            return self
        if n != self.size:
            raise ValueError(f"add_fields: the batch has {self.size} samples, data has {n}")
        self.field_schema.update(field_schema_of(data))
        if set_all_ready:
            self.production_status[:] = 1
        return self

    def select_samples(self, sample_indices: Sequence[int]) -> BatchMeta:
        idx = [int(i) for i in sample_indices]
        if any(i < 0 or i >= self.size for i in idx):
            raise ValueError(f"sample indices must be in range [0, {self.size})")
        schema: Schema = {}
        for name, meta in self.field_schema.items():
            m = copy.deepcopy(meta)
            if meta.get("per_sample_shapes") is not None:
                m["per_sample_shapes"] = [meta["per_sample_shapes"][i] for i in idx]
            schema[name] = m
        return BatchMeta(
            [self.global_indexes[i] for i in idx],
            [self.partition_ids[i] for i in idx],
            schema,
            self.production_status[idx] if idx else None,
            self.extra_info,
            [copy.deepcopy(self.custom_meta[i]) for i in idx],
        )

    def select_fields(self, field_names: Sequence[str]) -> BatchMeta:
        schema = {
            f: copy.deepcopy(self.field_schema[f]) for f in field_names if f in self.field_schema
        }
        return BatchMeta(
            self.global_indexes,
            self.partition_ids,
            schema,
            self.production_status.copy(),
            copy.deepcopy(self.extra_info),
            copy.deepcopy(self.custom_meta),
        )

    def copy(self) -> BatchMeta:
        return BatchMeta(
            self.global_indexes,
            self.partition_ids,
            copy.deepcopy(self.field_schema),
            self.production_status.copy(),
            copy.deepcopy(self.extra_info),
            copy.deepcopy(self.custom_meta),
        )

    def __getitem__(self, item: int | slice) -> BatchMeta:
        if isinstance(item, int | np.integer) and not isinstance(item, bool):
            i = int(item) + (self.size if item < 0 else 0)
            if not 0 <= i < self.size:
                raise IndexError("BatchMeta index out of range")
            return self.select_samples([i])
        if isinstance(item, slice):
            return self.select_samples(list(range(*item.indices(self.size))))
        raise TypeError(f"BatchMeta indices are ints or slices, got {type(item).__name__}")

    def chunk(self, chunks: int) -> list[BatchMeta]:
        """``chunks`` consecutive parts, sizes differing by at most one (larger ones first)."""
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be an int >= 1, got {chunks!r}")
        base, extra = divmod(self.size, chunks)
        out, start = [], 0
        for i in range(chunks):
            end = start + base + (1 if i < extra else 0)
            out.append(self.select_samples(list(range(start, end))))
            start = end
        return out

    def chunk_by_partition(self) -> list[BatchMeta]:
        by: dict[str, list[int]] = {}
        for i, pid in enumerate(self.partition_ids):
            by.setdefault(pid, []).append(i)
        return [self.select_samples(idx) for idx in by.values()]

    def reorder(self, indices: Sequence[int]) -> None:
        """Put the samples in the order ``indices`` (a permutation of range(size)), in place."""
        idx = [int(i) for i in indices]
        if len(idx) != self.size:
            raise ValueError(f"indices has {len(idx)} entries, the batch has {self.size}")
        if len(set(idx)) != self.size:
            raise ValueError("indices contain duplicates")
        if any(i < 0 or i >= self.size for i in idx):
            raise ValueError(f"indices must be in range [0, {self.size})")
        self.global_indexes = [self.global_indexes[i] for i in idx]
        self.partition_ids = [self.partition_ids[i] for i in idx]
        self.production_status = self.production_status[idx]
        for meta in self.field_schema.values():
            if meta.get("per_sample_shapes") is not None:
                meta["per_sample_shapes"] = [meta["per_sample_shapes"][i] for i in idx]
        self.custom_meta = [self.custom_meta[i] for i in idx]

    @classmethod
    def concat(cls, data: Sequence[BatchMeta], validate: bool = True) -> BatchMeta:
        """One batch of the non-empty ``data`` in order; with ``validate`` their field names
        must agree."""
        parts = [d for d in data if d is not None and d.size > 0]
        if not parts:
            return cls.empty()
        names = parts[0].field_names
        if validate:
            for p in parts[1:]:
                if p.field_names != names:
                    raise ValueError(
                        f"cannot concat batches with fields {names} and {p.field_names}"
                    )
        schema: Schema = {}
        for name in names:
            meta = copy.deepcopy(parts[0].field_schema[name])
            if any(p.field_schema.get(name, {}).get("per_sample_shapes") for p in parts):
                meta["per_sample_shapes"] = [
                    s
                    for p in parts
                    for s in (
                        p.field_schema[name].get("per_sample_shapes")
                        or [p.field_schema[name].get("shape")] * p.size
                    )
                ]
            schema[name] = meta
        extra: dict[str, Any] = {}
        for p in parts:
            extra.update(p.extra_info)
        return cls(
            [g for p in parts for g in p.global_indexes],
            [pid for p in parts for pid in p.partition_ids],
            schema,
            np.concatenate([p.production_status for p in parts]),
            extra,
            [copy.deepcopy(m) for p in parts for m in p.custom_meta],
        )

    @classmethod
    def empty(cls, extra_info: dict[str, Any] | None = None) -> BatchMeta:
        return cls([], [], {}, None, extra_info or {}, [])


@dataclasses.dataclass
class KVBatchMeta:
    """Samples named by user ``keys`` in one partition, with one ``tags`` dict per key and the
    ``fields`` stored for them."""

    keys: list[str] = dataclasses.field(default_factory=list)
    tags: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    partition_id: str | None = None
    fields: list[str] | None = None
    extra_info: dict[str, Any] | None = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.tags):
            raise ValueError(
                f"keys and tags must have the same length, got {len(self.keys)} and "
                f"{len(self.tags)}"
            )
        if len(set(self.keys)) != len(self.keys):
            raise ValueError("keys contain duplicates")
        if self.fields is not None and len(set(self.fields)) != len(self.fields):
            raise ValueError("fields contain duplicates")
        self.tags = copy.deepcopy(self.tags)
        self.extra_info = copy.deepcopy(self.extra_info)

    @property
    def size(self) -> int:
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def __str__(self) -> str:
        return (
            f"KVBatchMeta(size={self.size}, field_names={self.fields}, "
            f"extra_info={self.extra_info})"
        )

    def select_keys(self, keys_to_select: Sequence[str]) -> KVBatchMeta:
        wanted = list(keys_to_select)
        if len(set(wanted)) != len(wanted):
            raise ValueError("keys_to_select contains duplicates")
        missing = set(wanted) - set(self.keys)
        if missing:
            raise RuntimeError(f"keys {sorted(missing)} are not in this batch")
        pos = {k: i for i, k in enumerate(self.keys)}
        return KVBatchMeta(
            keys=wanted,
            tags=[self.tags[pos[k]] for k in wanted],
            partition_id=self.partition_id,
            fields=self.fields,
            extra_info=self.extra_info,
        )

    def reorder(self, indexes: Sequence[int]) -> None:
        idx = [int(i) for i in indexes]
        if len(idx) != self.size:
            raise ValueError(f"indexes has {len(idx)} entries, the batch has {self.size}")
        if len(set(idx)) != len(idx):
            raise ValueError("indexes contain duplicates")
        if any(i < 0 or i >= self.size for i in idx):
            raise ValueError(f"indexes must be in range [0, {self.size})")
        self.keys = [self.keys[i] for i in idx]
        self.tags = [self.tags[i] for i in idx]

    def chunk(self, chunks: int) -> list[KVBatchMeta]:
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be an int >= 1, got {chunks!r}")
        base, extra = divmod(self.size, chunks)
        out, start = [], 0
        for i in range(chunks):
            end = start + base + (1 if i < extra else 0)
            out.append(
                KVBatchMeta(
                    keys=self.keys[start:end],
                    tags=self.tags[start:end],
                    partition_id=self.partition_id,
                    fields=self.fields,
                    extra_info=self.extra_info,
                )
            )
            start = end
        return out

    @classmethod
    def concat(cls, data: Sequence[KVBatchMeta]) -> KVBatchMeta:
        parts = [d for d in data if d is not None and d.size > 0]
        if not parts:
            return cls()
        first = parts[0]
        for p in parts[1:]:
            if p.fields != first.fields:
                raise ValueError("field names do not match for concatenation")
            if p.partition_id != first.partition_id:
                raise ValueError("partitions do not match for concatenation")
        extra: dict[str, Any] = {}
        for p in parts:
            extra.update(p.extra_info or {})
        return cls(
            keys=[k for p in parts for k in p.keys],
            tags=[t for p in parts for t in p.tags],
            partition_id=first.partition_id,
            fields=first.fields,
            extra_info=extra,
        )
