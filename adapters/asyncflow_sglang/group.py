"""The process group SGLang receives weights over, built from the trainer's side (rank 0).

SGLang's workers join it in ``WeightUpdater.init_weights_update_group``
(``sglang/srt/model_executor/model_runner_components/weight_updater.py``: rank =
``rank_offset + tp_rank``) through ``init_custom_process_group``
(``sglang/srt/utils/common.py``): a ``tcp://`` rendezvous, a ``PrefixStore(group_name)`` over
its store, then ``torch.distributed.distributed_c10d._new_process_group_helper`` with the
identity rank map. ``join_sglang_group`` repeats exactly those steps, so the trainer's rank 0
(which hosts the rendezvous store) and SGLang's ranks meet in one group; it needs no default
process group (``init_process_group``) on the trainer. Weights then travel as one
``torch.distributed.broadcast(tensor, src=0, group=pg)`` per tensor, in the order of the
``/update_weights_from_distributed`` request's ``names``.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import math
from collections.abc import Sequence
from typing import Any

import torch

from asyncflow_core.contracts.errors import WeightSyncError
from asyncflow_core.infra.platform import gloo_listens_on, platform_for_backend, rendezvous_store
from asyncflow_core.sync.transports import EngineGroupWeightSync, GroupReceiver, default_backend

__all__ = [
    "DEFAULT_GROUP_NAME",
    "SGLangGroup",
    "SGLangWeightSync",
    "join_sglang_group",
    "sglang_group",
    "tcp_address",
]

DEFAULT_GROUP_NAME = "weight_update_group"
"""SGLang's default ``group_name`` (``InitWeightsUpdateGroupReqInput``, io_struct.py)."""


def tcp_address(host: str, port: int) -> str:
    """``tcp://host:port`` (IPv6 hosts in brackets), as SGLang's ``NetworkAddress.to_tcp``."""
    wrapped = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{wrapped}:{int(port)}"


def join_sglang_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    *,
    group_name: str = DEFAULT_GROUP_NAME,
    backend: str = "gloo",
    timeout_s: float = 300.0,
) -> Any:
    """Join (blocking) the group as ``rank`` of ``world_size`` the way SGLang's
    ``init_custom_process_group`` does, and return the ``ProcessGroup``. Rank 0 hosts the
    rendezvous store at ``master_address:master_port``. One process can hold a given
    ``group_name`` once at a time (torch refuses a second group of that name).

    Unlike SGLang's ``tcp://`` rendezvous (torch's store, which listens on every interface),
    rank 0's store listens on ``master_address`` only (``rendezvous_store``), and a gloo
    group on that address's interface (``gloo_listens_on``): a loopback ``master_address``
    keeps the group off the network. SGLang's own ranks connect the same way either way."""
    from torch.distributed.distributed_c10d import (
        Backend,
        GroupName,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )

    timeout = datetime.timedelta(seconds=timeout_s)
    store = rendezvous_store(
        master_address, master_port, world_size, is_master=rank == 0, timeout=timeout
    )
    store = PrefixStore(group_name, store)
    with gloo_listens_on(master_address):
        pg, _ = _new_process_group_helper(
            world_size,
            rank,
            [],
            Backend(backend),
            store,
            group_name=GroupName(group_name),
            backend_options=None,
            timeout=timeout,
            device_id=None,
        )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class SGLangGroup:
    """The trainer's side (rank 0) of SGLang's weight-update group: a ``BroadcastGroup``.

    ``connect()`` (blocking, idempotent) joins with ``join_sglang_group``; ``broadcast``
    is ``torch.distributed.broadcast(tensor, src, group=pg)``, bounded by ``timeout_s``;
    ``close()`` destroys the group. ``backend`` None: nccl with CUDA, else gloo — it must
    be the backend the engines were told (``SGLangHTTPEngine(weight_backend=...)``).

    ``master_address`` is required: the trainer's store listens there only, and must be an
    address of this machine that the SGLang servers reach (``127.0.0.1`` when they run here).
    Any other address opens the store's and the group's ports on that network, without
    authentication (neither torch's store nor gloo/NCCL take a secret): keep it on a network
    limited to the trainer and its servers."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        *,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        who = "asyncflow_sglang.sglang_group"
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
            raise WeightSyncError(f"{who}: world_size must be an int >= 2, got {world_size!r}")
        if not isinstance(timeout_s, int | float) or not 0 < timeout_s < math.inf:
            raise WeightSyncError(f"{who}: timeout_s must be a number > 0, got {timeout_s!r}")
        if not isinstance(group_name, str) or not group_name:
            raise WeightSyncError(f"{who}: group_name must be a non-empty str")
        self.master_address = master_address
        self.master_port = int(master_port)
        self.group_name = group_name
        self.backend = backend or default_backend()
        if self.backend not in ("gloo", "nccl"):
            raise WeightSyncError(f"{who}: backend must be 'gloo' or 'nccl', got {backend!r}")
        self.timeout_s = float(timeout_s)
        self._world_size = world_size
        self._pg: Any = None

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def device(self) -> torch.device:
        return platform_for_backend(self.backend).device()

    @property
    def connected(self) -> bool:
        return self._pg is not None

    def connect(self) -> None:
        if self._pg is not None:
            return
        try:
            self._pg = join_sglang_group(
                self.master_address,
                self.master_port,
                0,
                self._world_size,
                group_name=self.group_name,
                backend=self.backend,
                timeout_s=self.timeout_s,
            )
        except Exception as exc:
            raise WeightSyncError(
                f"sglang_group: joining {self.group_name!r} at "
                f"{self.master_address}:{self.master_port} as rank 0 of {self._world_size} "
                f"failed: {exc}"
            ) from exc

    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout_s: float | None = None) -> None:
        if self._pg is None:
            raise WeightSyncError("sglang_group: broadcast before connect(); connect() first")
        work = torch.distributed.broadcast(tensor, src=src, group=self._pg, async_op=True)
        limit = self.timeout_s if timeout_s is None else timeout_s
        assert work is not None
        work.wait(timeout=datetime.timedelta(seconds=limit))

    def close(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None:
            with contextlib.suppress(Exception):  # best effort: a peer may be gone
                torch.distributed.destroy_process_group(pg)

    def __repr__(self) -> str:
        return (
            f"SGLangGroup({self.group_name!r} at {self.master_address}:{self.master_port}, "
            f"rank 0 of {self._world_size}, {self.backend})"
        )


sglang_group = SGLangGroup
"""The trainer's rank 0 of SGLang's weight-update group, not yet connected: pass
``functools.partial(sglang_group, group_name=..., backend=...)`` as
``EngineGroupWeightSync(make_group=...)``, or use ``SGLangWeightSync``."""


class SGLangWeightSync(EngineGroupWeightSync):
    """``EngineGroupWeightSync`` over ``sglang_group``: the WeightSync transport from the
    trainer into SGLang engines (``SGLangHTTPEngine`` / ``SGLangEngine``). ``init()`` first
    awaits each engine's ``connect()`` (which reads its rank count from the server), then
    builds the group and joins it with every engine. ``group_name``/``backend`` must match
    the engines' (their ``group_name``/``weight_backend``)."""

    def __init__(
        self,
        engines: Sequence[GroupReceiver],
        *,
        master_address: str,
        master_port: int,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        make = functools.partial(
            sglang_group, group_name=group_name, backend=backend, timeout_s=timeout_s
        )
        super().__init__(
            engines,
            master_address=master_address,
            master_port=master_port,
            make_group=make,
            timeout_s=timeout_s,
        )

    async def init(self) -> None:
        for engine in self.engines:
            connect = getattr(engine, "connect", None)
            if callable(connect):
                await connect()
        await super().init()
