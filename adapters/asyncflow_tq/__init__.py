"""A TransferQueue-compatible client over AsyncFlow's stores.

``import asyncflow_tq as tq`` in place of ``import transfer_queue as tq`` (transferqueue
0.1.11): the same module-level API (``init``, ``kv_batch_put``, ``kv_batch_get``, ...), the same
``TransferQueueClient`` methods, ``BatchMeta`` and ``KVBatchMeta``, with batches as
``TensorDict``s, while the values live in an ``InProcessDataStore`` or a ``RayDataStore``.
``docs/transferqueue.md`` lists what is covered and every known difference. Needs the
``[tq]`` extra (``tensordict``).
"""

from asyncflow_tq.client import (
    BadArgumentError,
    PartitionView,
    RequestError,
    StorageKeyNotFoundError,
    TransferQueueClient,
)
from asyncflow_tq.interface import (
    DEFAULT_CONFIG,
    async_kv_batch_get,
    async_kv_batch_get_by_meta,
    async_kv_batch_put,
    async_kv_clear,
    async_kv_list,
    async_kv_put,
    close,
    get_client,
    get_metrics_endpoint,
    init,
    kv_batch_get,
    kv_batch_get_by_meta,
    kv_batch_put,
    kv_clear,
    kv_list,
    kv_put,
    load_checkpoint,
    make_client,
    save_checkpoint,
    use_client,
)
from asyncflow_tq.metadata import BatchMeta, KVBatchMeta
from asyncflow_tq.sampler import (
    BaseSampler,
    GRPOGroupNSampler,
    RankAwareSampler,
    SequentialSampler,
)

__version__ = "0.1.11"  # the TransferQueue API version this package follows

__all__ = [
    "DEFAULT_CONFIG",
    "BadArgumentError",
    "BaseSampler",
    "BatchMeta",
    "GRPOGroupNSampler",
    "KVBatchMeta",
    "PartitionView",
    "RankAwareSampler",
    "RequestError",
    "SequentialSampler",
    "StorageKeyNotFoundError",
    "TransferQueueClient",
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
