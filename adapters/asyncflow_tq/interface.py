"""TransferQueue's module-level API (``transfer_queue/interface.py`` in 0.1.11) over AsyncFlow
stores: ``init``/``close``, the ``kv_*`` calls and their ``async_`` twins, and checkpoints.

``init(conf)`` takes TransferQueue's config layout. ``backend.storage_backend`` picks the
store: ``"Ray"``: a ``RayDataStore`` on the connected Ray cluster, shared by every process
that attaches; ``"InProcess"``: an ``InProcessDataStore`` with ``num_data_storage_units``
units, for this process; ``"SimpleStorage"`` (TransferQueue's default name; its units are Ray
actors): ``"Ray"`` when this process is connected to Ray, else ``"InProcess"``.
``init(conf, store=...)`` uses a store you built instead.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from asyncflow_core.contracts.errors import CheckpointError
from asyncflow_core.contracts.protocols import DataStore
from asyncflow_tq.checkpoint import (
    CONTROLLER_FILE,
    OLD_CONTROLLER_FILE,
    OLD_STORAGE_FILE,
    old_format_error,
)
from asyncflow_tq.client import (
    BadArgumentError,
    TransferQueueClient,
)
from asyncflow_tq.metadata import KVBatchMeta
from asyncflow_tq.sampler import (
    BaseSampler,
    GRPOGroupNSampler,
    RankAwareSampler,
    SequentialSampler,
)

__all__ = [
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_batch_put",
    "async_kv_clear",
    "async_kv_list",
    "async_kv_put",
    "close",
    "get_client",
    "get_metrics_endpoint",
    "init",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_batch_put",
    "kv_clear",
    "kv_list",
    "kv_put",
    "load_checkpoint",
    "make_client",
    "save_checkpoint",
    "use_client",
]

T = TypeVar("T")

DEFAULT_CONFIG: dict[str, Any] = {
    "controller": {
        "sampler": "SequentialSampler",
        "polling_mode": False,
        # how long a get_meta in fetch mode waits for enough ready samples, then raises
        "get_meta_timeout_s": 5.0,
    },
    "backend": {
        "storage_backend": "SimpleStorage",
        "SimpleStorage": {
            "num_data_storage_units": 2,
            # False: the in-process store keeps references to your tensors (no copy on put;
            # never modify a tensor after putting it)
            "copy_on_put": True,
        },
    },
}
_SAMPLERS: dict[str, type[BaseSampler]] = {
    "SequentialSampler": SequentialSampler,
    "GRPOGroupNSampler": GRPOGroupNSampler,
    "RankAwareSampler": RankAwareSampler,
}
_BACKENDS = ("SimpleStorage", "InProcess", "Ray")
_METADATA_FILE = "metadata.json"
_CONTROLLER_FILE = CONTROLLER_FILE

_CLIENT: TransferQueueClient | None = None


def _plain(obj: Any) -> Any:
    """A config (dicts, OmegaConf ``DictConfig``) as plain nested dicts; leaves as they are."""
    if isinstance(obj, Mapping) or (hasattr(obj, "items") and hasattr(obj, "keys")):
        return {str(k): _plain(v) for k, v in obj.items()}
    return obj


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _sampler_of(value: Any) -> Callable[..., tuple[list[int], list[int]]]:
    if isinstance(value, str):
        cls = _SAMPLERS.get(value)
        if cls is None:
            raise ValueError(
                f"Could not find sampler {value} (controller.sampler; this package has "
                f"{sorted(_SAMPLERS)}, or pass a sampler instance)"
            )
        return cls()
    if isinstance(value, type):
        made = value()
        if not callable(made):
            raise BadArgumentError(f"controller.sampler: {value.__name__}() is not callable")
        return made  # type: ignore[no-any-return]
    if callable(value):
        return value  # type: ignore[no-any-return]
    raise BadArgumentError(
        f"controller.sampler must be a sampler name, class or instance, got {value!r:.80}"
    )


def _build(conf: dict[str, Any], store: DataStore | None) -> TransferQueueClient:
    ctl = conf.get("controller", {})
    polling = ctl.get("polling_mode", False)
    if not isinstance(polling, bool):
        raise BadArgumentError(f"controller.polling_mode must be a bool, got {polling!r:.80}")
    timeout = ctl.get("get_meta_timeout_s", 5.0)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0:
        raise BadArgumentError(
            f"controller.get_meta_timeout_s must be a number >= 0, got {timeout!r:.80}"
        )
    sampler = _sampler_of(ctl.get("sampler", "SequentialSampler"))
    if store is None:
        backend = conf.get("backend", {})
        name = backend.get("storage_backend", "SimpleStorage")
        if name not in _BACKENDS:
            raise BadArgumentError(
                f"backend.storage_backend must be one of {list(_BACKENDS)}, got {name!r:.80}"
            )
        opts = {**DEFAULT_CONFIG["backend"]["SimpleStorage"], **backend.get("SimpleStorage", {})}
        opts.update(backend.get(name, {}) if name != "SimpleStorage" else {})
        units = opts.get("num_data_storage_units", 2)
        if isinstance(units, bool) or not isinstance(units, int) or units < 1:
            raise BadArgumentError(
                f"backend.{name}.num_data_storage_units must be an int >= 1, got {units!r:.80}"
            )
        if name == "Ray" or (name == "SimpleStorage" and _ray_connected()):
            from asyncflow_ray import RayDataStore

            from asyncflow_tq import remote

            attached = _attach()
            if attached is not None:
                return attached
            ray_store = RayDataStore.create(units)
            try:
                handle = remote.start_controller(ray_store, sampler, polling, float(timeout))
            except BaseException:
                ray_store.shutdown()
                raise

            def stop() -> None:
                try:
                    remote.stop_controller(handle)
                finally:
                    ray_store.shutdown()

            return TransferQueueClient(ray_store, remote=handle, owns_store=stop)
        else:
            from asyncflow_core import InProcessDataStore

            copy_on_put = opts.get("copy_on_put", True)
            if not isinstance(copy_on_put, bool):
                raise BadArgumentError(
                    f"backend.{name}.copy_on_put must be a bool, got {copy_on_put!r:.80}"
                )
            store = InProcessDataStore(units, copy_on_put=copy_on_put)
    return TransferQueueClient(
        store,
        sampler=sampler,
        polling_mode=polling,
        get_meta_timeout_s=float(timeout),
    )


def _ray_connected() -> bool:
    """Whether Ray is installed and initialised in this process."""
    try:
        from asyncflow_ray.runtime import import_ray

        return bool(import_ray().is_initialized())
    except ImportError:
        return False


def _attach() -> TransferQueueClient | None:
    """A client of the cluster's running controller actor, if there is one."""
    from asyncflow_tq import remote

    handle = remote.find_controller()
    if handle is None:
        return None
    store = remote._ray().get(handle.call.remote("get_store"))
    return TransferQueueClient(store, remote=handle)


# ==================== lifecycle ====================
def _config(conf: Any) -> dict[str, Any]:
    plain = _plain(conf) if conf is not None else {}
    if not isinstance(plain, dict):
        raise BadArgumentError(f"conf must be a mapping (or None), got {type(conf).__name__}")
    return _merge(copy.deepcopy(DEFAULT_CONFIG), plain)


def init(conf: Any = None, *, store: DataStore | None = None) -> Any:
    """Start the client (once per process): TransferQueue's defaults merged with ``conf``.
    When this process is connected to a Ray cluster where a process already started a
    controller (``storage_backend="Ray"``), attach to it instead, ignoring ``conf``, as
    TransferQueue does. Returns the merged config, or ``conf`` unchanged when attaching or
    already initialised."""
    global _CLIENT
    if _CLIENT is not None:
        return conf
    if store is None:
        attached = _attach()  # a controller actor started by another process of the cluster
        if attached is not None:
            _CLIENT = attached
            return conf
    merged = _config(conf)
    _CLIENT = _build(merged, store)
    return merged


def make_client(conf: Any = None, *, store: DataStore | None = None) -> TransferQueueClient:
    """A client built like ``init`` builds one, not installed as the module's client (to
    compare stores in one process: install one with ``use_client``; close it yourself)."""
    return _build(_config(conf), store)


def use_client(client: TransferQueueClient | None) -> TransferQueueClient | None:
    """Make ``client`` the one the module-level functions use (``None``: none); returns the
    previous one, which stays open."""
    global _CLIENT
    if client is not None and not isinstance(client, TransferQueueClient):
        raise BadArgumentError(f"use_client takes a TransferQueueClient, got {client!r:.80}")
    previous, _CLIENT = _CLIENT, client
    return previous


def close() -> None:
    """Drop every partition and stop the client (and a Ray store that ``init`` started)."""
    global _CLIENT
    client, _CLIENT = _CLIENT, None
    if client is not None:
        client.close()


def get_client() -> TransferQueueClient:
    if _CLIENT is None:
        raise RuntimeError("TransferQueue is not initialized: call asyncflow_tq.init() first")
    return _CLIENT


def get_metrics_endpoint() -> str | None:
    """Always ``None``: this package exports no Prometheus endpoint."""
    return None


def _client() -> TransferQueueClient:
    return get_client()


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return _client()._sync(coro)


async def _arun(coro: Coroutine[Any, Any, T]) -> T:
    return await _client()._async(coro)


# ==================== KV API (run on the client's loop) ====================
async def _kv_batch_put(
    c: TransferQueueClient,
    keys: list[str],
    partition_id: str,
    fields: Any,
    tags: list[dict[str, Any]] | None,
    data_parser: Callable[[Any], Any] | None,
) -> KVBatchMeta:
    if fields is None and tags is None:
        raise ValueError("kv_batch_put: provide at least one of `fields` or `tags`")
    if not isinstance(keys, list):
        raise TypeError(f"kv_batch_put: keys must be a list of str, got {keys!r:.80}")
    if fields is not None:
        from tensordict import TensorDictBase

        if not isinstance(fields, TensorDictBase):
            raise BadArgumentError(
                f"kv_batch_put: fields must be a TensorDict, got {type(fields).__name__}"
            )
        if len(fields.batch_size) < 1 or fields.batch_size[0] != len(keys):
            raise ValueError(
                f"kv_batch_put: `keys` has {len(keys)} entries, the `fields` TensorDict has "
                f"batch_size {list(fields.batch_size)}"
            )
    if tags is not None and (not isinstance(tags, list) or len(tags) != len(keys)):
        raise ValueError(
            f"kv_batch_put: keys has {len(keys)} entries, tags has "
            f"{len(tags) if isinstance(tags, list) else tags!r:.80}"
        )
    if tags is not None and not all(isinstance(t, dict) for t in tags):
        raise BadArgumentError("kv_batch_put: every element of tags must be a dict")
    # everything is checked before the keys are registered: a rejected call changes nothing
    meta = await c._kv_retrieve_meta(keys, partition_id, True)
    if tags is not None:
        meta.update_custom_meta(tags)
    if fields is not None:
        meta = await c._put(fields, meta, None, data_parser)
    else:
        await c._set_custom_meta(meta)
    return KVBatchMeta(
        keys=list(keys),
        tags=meta.custom_meta,
        partition_id=partition_id,
        fields=meta.field_names,
        extra_info=meta.extra_info,
    )


def _one_row(fields: Any) -> Any:
    from tensordict import NonTensorStack, TensorDict, TensorDictBase

    if isinstance(fields, TensorDictBase):
        return fields
    if not isinstance(fields, dict):
        raise ValueError("kv_put: `fields` can only be a dict or a TensorDict")
    batch: dict[str, Any] = {}
    for name, value in fields.items():
        if isinstance(value, torch.Tensor):
            if value.is_nested:
                raise ValueError(
                    f"kv_put: field {name!r} is a nested tensor; use kv_batch_put for batches"
                )
            batch[name] = value.unsqueeze(0)
        else:
            batch[name] = NonTensorStack(value)
    return TensorDict(batch, batch_size=[1])


async def _kv_get(
    c: TransferQueueClient,
    keys: list[str] | str,
    partition_id: str,
    select_fields: list[str] | str | None,
) -> Any:
    meta = await c._kv_retrieve_meta(keys, partition_id, False)
    if meta.size == 0:
        raise ValueError("kv_batch_get: keys or partition were not found")
    if select_fields is not None:
        meta = meta.select_fields(
            [select_fields] if isinstance(select_fields, str) else select_fields
        )
    if not meta.is_ready:
        raise ValueError("kv_batch_get: some fields are not ready in all the requested keys")
    return await c._get_data(meta)


def _by_meta_args(meta: KVBatchMeta, select_fields: list[str] | str | None) -> list[str] | None:
    if not isinstance(meta, KVBatchMeta):
        raise BadArgumentError(
            f"kv_batch_get_by_meta: meta must be a KVBatchMeta, got {type(meta).__name__}"
        )
    if meta.partition_id is None:
        raise ValueError("kv_batch_get_by_meta: the KVBatchMeta has no partition_id")
    if select_fields is None:
        return meta.fields
    wanted = [select_fields] if isinstance(select_fields, str) else list(select_fields)
    if meta.fields is None or any(f not in meta.fields for f in wanted):
        raise ValueError(
            f"kv_batch_get_by_meta: select_fields {wanted} not all in the KVBatchMeta's fields "
            f"{meta.fields}"
        )
    return wanted


async def _kv_clear(c: TransferQueueClient, keys: list[str] | str, partition_id: str) -> None:
    meta = await c._kv_retrieve_meta(keys, partition_id, False)
    if meta.size > 0:
        await c._clear_samples(meta)


def _kv_put(
    c: TransferQueueClient,
    key: str,
    partition_id: str,
    fields: Any,
    tag: dict[str, Any] | None,
    data_parser: Callable[[Any], Any] | None,
) -> Coroutine[Any, Any, KVBatchMeta]:
    """``kv_put``'s checks, then its one-key ``kv_batch_put`` (not yet awaited)."""
    if fields is None and tag is None:
        raise ValueError("kv_put: provide at least one of fields or tag")
    if not isinstance(key, str):
        raise TypeError(f"kv_put: key must be a str, got {key!r:.80}")
    row = _one_row(fields) if fields is not None else None
    tags = [tag] if tag is not None else None
    return _kv_batch_put(c, [key], partition_id, row, tags, data_parser)


def kv_put(
    key: str,
    partition_id: str,
    fields: Any = None,
    tag: dict[str, Any] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    c = _client()
    return c._sync(_kv_put(c, key, partition_id, fields, tag, data_parser))


async def async_kv_put(
    key: str,
    partition_id: str,
    fields: Any = None,
    tag: dict[str, Any] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    c = _client()
    return await c._async(_kv_put(c, key, partition_id, fields, tag, data_parser))


def kv_batch_put(
    keys: list[str],
    partition_id: str,
    fields: Any = None,
    tags: list[dict[str, Any]] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    c = _client()
    return c._sync(_kv_batch_put(c, keys, partition_id, fields, tags, data_parser))


async def async_kv_batch_put(
    keys: list[str],
    partition_id: str,
    fields: Any = None,
    tags: list[dict[str, Any]] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    c = _client()
    return await c._async(_kv_batch_put(c, keys, partition_id, fields, tags, data_parser))


def kv_batch_get(
    keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None
) -> Any:
    c = _client()
    return c._sync(_kv_get(c, keys, partition_id, select_fields))


async def async_kv_batch_get(
    keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None
) -> Any:
    c = _client()
    return await c._async(_kv_get(c, keys, partition_id, select_fields))


def kv_batch_get_by_meta(meta: KVBatchMeta, select_fields: list[str] | str | None = None) -> Any:
    fields = _by_meta_args(meta, select_fields)
    assert meta.partition_id is not None
    return kv_batch_get(meta.keys, meta.partition_id, fields)


async def async_kv_batch_get_by_meta(
    meta: KVBatchMeta, select_fields: list[str] | str | None = None
) -> Any:
    fields = _by_meta_args(meta, select_fields)
    assert meta.partition_id is not None
    return await async_kv_batch_get(meta.keys, meta.partition_id, fields)


def kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    return _client().kv_list(partition_id)


async def async_kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    return await _client().async_kv_list(partition_id)


def kv_clear(keys: list[str] | str, partition_id: str) -> None:
    c = _client()
    c._sync(_kv_clear(c, keys, partition_id))


async def async_kv_clear(keys: list[str] | str, partition_id: str) -> None:
    c = _client()
    await c._async(_kv_clear(c, keys, partition_id))


# ==================== checkpoints ====================
def save_checkpoint(
    checkpoint_dir: str | Path,
    *,
    include_storage: bool = True,
    metadata: dict[str, Any] | None = None,
) -> None:
    """Write the controller state and every stored value under ``checkpoint_dir``, replacing
    an earlier checkpoint there only once the new one is complete. ``include_storage`` is
    ignored: every AsyncFlow store keeps its values in memory, so they are always saved.
    The files are JSON and safetensors (``asyncflow_tq.checkpoint``); a value JSON cannot
    hold (a tag or a cell that is a numpy array, an object) is a ``TypeError`` naming it."""
    if _CLIENT is None:
        raise RuntimeError("TransferQueue is not initialized. Call init() first.")
    if metadata is not None:
        json.dumps(metadata)  # TypeError now, before anything is written
    final = Path(checkpoint_dir)
    tmp = final.parent / f"{final.name}.tmp"
    old = final.parent / f"{final.name}.old"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        _CLIENT.save_controller_checkpoint(str(tmp / _CONTROLLER_FILE))
        _CLIENT.save_storage_checkpoint(str(tmp))
        (tmp / _METADATA_FILE).write_text(
            json.dumps({"storage_saved": True, "user_metadata": metadata or {}}, indent=2)
        )
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            final.rename(old)
        tmp.rename(final)
        if old.exists():
            shutil.rmtree(old)
    except BaseException:
        if tmp.exists():
            shutil.rmtree(tmp)
        if old.exists() and not final.exists():
            old.rename(final)
        raise


def load_checkpoint(checkpoint_dir: str | Path) -> None:
    """Replace the whole state (every partition, value, status, key and tag) with the one
    saved in ``checkpoint_dir``. Every file is read and checked first: a damaged or foreign
    one is a ``CheckpointError`` naming it and nothing changes. A checkpoint in the old
    pickled format is refused unread (``CheckpointError``): re-create it."""
    if _CLIENT is None:
        raise RuntimeError("TransferQueue is not initialized. Call init() first.")
    final = Path(checkpoint_dir)
    old = final.parent / f"{final.name}.old"
    if not final.exists() and old.exists():
        old.rename(final)  # a save interrupted between its two renames
    if not final.exists():
        raise FileNotFoundError(f"Checkpoint directory not found: {final}")
    controller = final / _CONTROLLER_FILE
    if not controller.exists():
        for pickled in (OLD_CONTROLLER_FILE, OLD_STORAGE_FILE):
            if (final / pickled).exists():
                raise old_format_error(final / pickled)
    meta_path = final / _METADATA_FILE
    if not meta_path.exists():
        raise FileNotFoundError(f"{_METADATA_FILE} not found in {final}")
    try:
        json.loads(meta_path.read_bytes())
    except (ValueError, RecursionError) as e:
        raise CheckpointError(
            f"{meta_path} cannot be loaded: not JSON ({str(e)[:120]}). Nothing was changed"
        ) from None
    if not controller.exists():
        raise FileNotFoundError(f"{_CONTROLLER_FILE} not found in {final}")
    _CLIENT._sync(_CLIENT._load_checkpoint(str(controller), str(final)))
