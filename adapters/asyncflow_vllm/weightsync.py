"""The trainer's side of a weight sync into vLLM engines: ``VLLMWeightSync`` is
``EngineGroupWeightSync`` over vLLM's own NCCL group (``vllm_nccl_group``), so the trainer
joins exactly the group vLLM's workers build at ``init_weight_transfer_engine``
(``vllm/distributed/weight_transfer/nccl_common.py``: a ``StatelessProcessGroup`` on a
TCPStore plus a ``PyNcclCommunicator``; the trainer is rank 0, engine ``i`` starts at rank
1 + the ranks before it). Each bucket is broadcast tensor by tensor (vLLM's unpacked wire,
``packed=False``) while the engines' ``update_weights`` receive the names, dtypes and shapes.

Needs vLLM and a CUDA GPU in the trainer process; not run live here. The same sync runs on
CPU with ``make_group=`` a ``WeightSyncGroup`` against the replay server in the tests.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch

from asyncflow_core.errors import WeightSyncError
from asyncflow_core.weightsync import EngineGroupWeightSync, GroupFactory, GroupReceiver
from asyncflow_vllm.compat import require_vllm


class VLLMNcclGroup:
    """A ``BroadcastGroup`` (rank 0, the trainer) over vLLM's ``PyNcclCommunicator``, built
    by ``vllm.distributed.weight_transfer.nccl_common.trainer_init`` at ``connect()``."""

    def __init__(self, master_address: str, master_port: int, world_size: int) -> None:
        self.master_address, self.master_port = master_address, master_port
        self._world_size = world_size
        self._comm: Any = None

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def connect(self) -> None:
        if self._comm is not None:
            return
        require_vllm()
        if not torch.cuda.is_available():
            raise WeightSyncError(
                "VLLMNcclGroup: vLLM's NCCL weight transfer needs a CUDA device in the trainer "
                "process; on CPU pass make_group=... a WeightSyncGroup (gloo) to a matching "
                "receiver"
            )
        nccl_common = importlib.import_module("vllm.distributed.weight_transfer.nccl_common")
        info = {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "world_size": self._world_size,
        }
        self._comm = nccl_common.trainer_init(info, rank=0)

    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout_s: float | None = None) -> None:
        if self._comm is None:
            raise WeightSyncError("VLLMNcclGroup: broadcast before connect()")
        self._comm.broadcast(tensor, src=src, stream=torch.cuda.current_stream())
        torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        comm, self._comm = self._comm, None
        destroy = getattr(comm, "destroy", None)
        if callable(destroy):
            destroy()


vllm_nccl_group = VLLMNcclGroup
"""The default ``make_group`` of ``VLLMWeightSync``."""


def VLLMWeightSync(
    engines: Sequence[GroupReceiver],
    *,
    master_address: str,
    master_port: int,
    make_group: GroupFactory | None = None,
    timeout_s: float = 300.0,
) -> EngineGroupWeightSync:
    """``EngineGroupWeightSync`` into vLLM engines (``VLLMEngine`` / ``VLLMHTTPEngine``),
    over vLLM's NCCL group unless ``make_group`` says otherwise."""
    return EngineGroupWeightSync(
        engines,
        master_address=master_address,
        master_port=master_port,
        make_group=vllm_nccl_group if make_group is None else make_group,
        timeout_s=timeout_s,
    )
