"""The trainer's side of a weight sync into vLLM engines: ``VLLMWeightSync`` is
``EngineGroupWeightSync`` over the group vLLM's own workers build at
``init_weight_transfer_engine`` — a ``StatelessProcessGroup`` on a TCPStore plus a device
communicator; the trainer is rank 0, engine ``i`` starts at rank 1 + the ranks before it.
Each bucket is broadcast tensor by tensor (vLLM's unpacked wire) while the engines'
``update_weights`` receive the names, dtypes and shapes.

Which group depends on the platform (``asyncflow_core.infra.platform``):

- **cuda**: ``VLLMNcclGroup``, vLLM's ``nccl_common.trainer_init`` (a ``PyNcclCommunicator``;
  ``vllm/distributed/weight_transfer/nccl_common.py``), engines started with
  ``weight_transfer_config={"backend": "nccl"}``.
- **npu**: ``VLLMHcclGroup``, vllm-ascend's ``HCCLWeightTransferEngine.trainer_init`` (a
  ``PyHcclCommunicator``; ``vllm_ascend/distributed/weight_transfer/hccl_engine.py``), engines
  started with ``{"backend": "hccl"}``.

Neither has run live here (they need vLLM and a GPU or NPU in the trainer process). The same
sync runs on CPU with ``make_group=`` a ``WeightSyncGroup`` against the replay server in the
tests.

**Exposure.** ``master_address`` is required. vLLM's ``StatelessProcessGroup`` binds the
trainer's store to ``master_address`` (not every interface); the NCCL (HCCL) communicator
listens on the interface NCCL picks for the process (``NCCL_SOCKET_IFNAME``; unset: the first
outward one, even for ``127.0.0.1``). Neither authenticates a peer: a ``master_address``
reachable from other machines lets anyone there join the group or feed the engines bytes;
keep it on a network limited to the trainer and its engines.
"""

from __future__ import annotations

import abc
import importlib
import inspect
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from asyncflow_core.contracts.errors import ConfigError, WeightSyncError
from asyncflow_core.infra.platform import (
    Platform,
    current_platform,
    get_platform,
    select_platform,
)
from asyncflow_core.sync.transports import (
    EngineGroupWeightSync,
    GroupFactory,
    GroupReceiver,
    off_loopback_refusal,
)
from asyncflow_vllm.compat import INSTALL_ASCEND, require_vllm

WEIGHT_TRANSFER_BACKENDS: dict[str, tuple[str, str | None]] = {
    "cuda": ("nccl", None),
    "npu": ("hccl", "npu_ipc"),
}
"""vLLM's weight-transfer backends AsyncFlow drives, per platform: (over a group, colocated).
CUDA's colocated ``ipc`` backend is not driven: vLLM 0.33's trainer side of it is
``IPCTrainerWeightTransferEngine`` (``vllm/distributed/weight_transfer/ipc_engine.py``; the
``trainer_send_weights`` AsyncFlow followed is gone), and nothing here has been written
against it yet."""

COLOCATED_CUDA_REFUSED = (
    "colocated weight sync over vLLM's CUDA 'ipc' backend is not supported: vLLM 0.33 drives "
    "it from the trainer through IPCTrainerWeightTransferEngine "
    "(vllm/distributed/weight_transfer/ipc_engine.py), which AsyncFlow does not implement. "
    "The 'nccl' backend cannot stand in on one GPU: NCCL refuses two ranks of one "
    "communicator on the same device ('Duplicate GPU detected'). Load weights with "
    "VLLMEngine.load_weights (the job's default staged sync does), or give the trainer and "
    "vLLM GPUs of their own and sync with VLLMWeightSync ('nccl')"
)


def weight_transfer_backend(
    platform: str | Platform | None = None, *, colocated: bool = False
) -> str:
    """vLLM's ``weight_transfer_config`` backend for ``platform`` (None: the current one):
    ``nccl`` on CUDA (colocated: ``ConfigError``, see ``COLOCATED_CUDA_REFUSED``),
    vllm-ascend's ``hccl`` / ``npu_ipc`` (colocated) on NPU. ``ConfigError`` on a platform
    vLLM has no weight transfer for (cpu: use ``load_weights``)."""
    p = current_platform() if platform is None else platform
    name = p if isinstance(p, str) else p.name
    if name not in WEIGHT_TRANSFER_BACKENDS:
        known = ", ".join(f"{k}: {v[0]}/{v[1]}" for k, v in WEIGHT_TRANSFER_BACKENDS.items())
        raise ConfigError(
            f"vLLM has no weight-transfer backend for platform {name!r} (it has {known}); on "
            "CPU load weights with VLLMEngine.load_weights (collective_rpc) or from disk"
        )
    backend = WEIGHT_TRANSFER_BACKENDS[name][1 if colocated else 0]
    if backend is None:
        raise ConfigError(COLOCATED_CUDA_REFUSED)
    return backend


class _TrainerGroup(abc.ABC):
    """A ``BroadcastGroup`` (rank 0, the trainer) over the communicator vLLM's workers join,
    built by ``_init`` at ``connect()`` (each subclass calls its engine's ``trainer_init``)."""

    platform_name: ClassVar[str]
    what: ClassVar[str]

    def __init__(self, master_address: str, master_port: int, world_size: int) -> None:
        self.master_address, self.master_port = master_address, master_port
        self._world_size = world_size
        self._comm: Any = None
        self.platform = get_platform(self.platform_name)

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def device(self) -> torch.device:
        return self.platform.device()

    @abc.abstractmethod
    def _init(self, info: dict[str, Any]) -> Any:
        """The communicator, from ``master_address``, ``master_port`` and ``world_size``."""

    def connect(self) -> None:
        if self._comm is not None:
            return
        require_vllm()
        if not self.platform.is_available():
            raise WeightSyncError(
                f"{type(self).__name__}: {self.what} needs platform {self.platform_name!r} in "
                f"the trainer process ({self.platform.unavailable_reason()}); on CPU pass "
                "make_group=... a WeightSyncGroup (gloo) to a matching receiver"
            )
        info = {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "world_size": self._world_size,
        }
        self._comm = self._init(info)

    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout_s: float | None = None) -> None:
        if self._comm is None:
            raise WeightSyncError(f"{type(self).__name__}: broadcast before connect()")
        stream = self.platform.torch_module().current_stream()
        self._comm.broadcast(tensor, src=src, stream=stream)
        stream.synchronize()

    def close(self) -> None:
        comm, self._comm = self._comm, None
        destroy = getattr(comm, "destroy", None)  # PyHcclCommunicator has none
        if callable(destroy):
            destroy()


class VLLMNcclGroup(_TrainerGroup):
    """The trainer's side of vLLM's ``nccl`` weight transfer (CUDA):
    ``vllm.distributed.weight_transfer.nccl_common.trainer_init``."""

    platform_name = "cuda"
    what = "vLLM's NCCL weight transfer"

    def _init(self, info: dict[str, Any]) -> Any:
        nccl_common = importlib.import_module("vllm.distributed.weight_transfer.nccl_common")
        init = nccl_common.trainer_init
        if "rank" in inspect.signature(init).parameters:  # 0.33; 0.26 takes the info only
            return init(info, rank=0)
        return init(info)


class VLLMHcclGroup(_TrainerGroup):
    """The trainer's side of vllm-ascend's ``hccl`` weight transfer (Ascend NPUs):
    ``HCCLWeightTransferEngine.trainer_init`` (the trainer is always rank 0 there)."""

    platform_name = "npu"
    what = "vllm-ascend's HCCL weight transfer"

    def _init(self, info: dict[str, Any]) -> Any:
        try:
            module = importlib.import_module("vllm_ascend.distributed.weight_transfer.hccl_engine")
        except ImportError as exc:
            raise WeightSyncError(
                f"VLLMHcclGroup needs vllm-ascend in the trainer process ({exc}); install "
                f"{INSTALL_ASCEND}"
            ) from exc
        return module.HCCLWeightTransferEngine.trainer_init(info)


vllm_nccl_group = VLLMNcclGroup
"""The default ``make_group`` of ``VLLMWeightSync`` on CUDA."""
vllm_hccl_group = VLLMHcclGroup
"""The default ``make_group`` of ``VLLMWeightSync`` on Ascend NPUs."""

_GROUPS: dict[str, GroupFactory] = {"cuda": vllm_nccl_group, "npu": vllm_hccl_group}


def VLLMWeightSync(
    engines: Sequence[GroupReceiver],
    *,
    master_address: str,
    master_port: int,
    make_group: GroupFactory | None = None,
    platform: str | Platform | None = None,
    timeout_s: float = 300.0,
) -> EngineGroupWeightSync:
    """``EngineGroupWeightSync`` into vLLM engines (``VLLMEngine`` / ``VLLMHTTPEngine``), over
    the ``platform``'s vLLM group (None: the current platform; ``VLLMNcclGroup`` on cuda,
    ``VLLMHcclGroup`` on npu) unless ``make_group`` says otherwise. The engines must run the
    matching backend (``weight_transfer_backend(platform)``)."""
    if make_group is None:
        p = current_platform() if platform is None else select_platform(platform)
        if p.name not in _GROUPS:
            raise ConfigError(
                f"VLLMWeightSync: no vLLM weight-transfer group for platform {p.name!r} (cuda: "
                "VLLMNcclGroup, npu: VLLMHcclGroup); on CPU pass make_group=..., e.g. a "
                "WeightSyncGroup (gloo), to engines that join with gloo"
            )
        make_group = _GROUPS[p.name]
    return EngineGroupWeightSync(
        engines,
        master_address=master_address,
        master_port=master_port,
        make_group=make_group,
        timeout_s=timeout_s,
    )


def own_transport_refusal(engines: Sequence[Any], *, servers: bool) -> str | None:
    """Why the RL job cannot open a vLLM weight group into ``engines`` by itself, or None: it
    needs the trainer's platform to have one (cuda: NCCL, npu: HCCL), each engine to have
    joined one at start (its ``unavailable_abilities`` lacks ``GroupReceiver``), and, for
    ``servers`` (HTTP engines), every server on loopback: the job opens the trainer's side of
    the group on loopback only."""
    from asyncflow_core.contracts.protocols import unavailable_ability

    platform = current_platform().name
    if platform not in _GROUPS:
        return (
            f"vLLM has no weight-transfer group on this trainer's platform ({platform}); give "
            "the engines tensors instead: run vLLM with the AsyncFlow worker extension "
            "(--worker-extension-cls asyncflow_vllm.worker_ext.AsyncFlowWorkerExtension, and "
            "VLLM_SERVER_DEV_MODE=1 for a server: docs/vllm.md), which the default sync then "
            "uses"
        )
    for engine in engines:
        reason = unavailable_ability(engine, "GroupReceiver")
        if reason is not None:
            return f"{getattr(engine, 'name', type(engine).__name__)}: {reason}"
    if servers:
        return off_loopback_refusal(
            engines,
            "asyncflow_vllm.VLLMWeightSync(engines, master_address=..., master_port=<a free port>)",
        )
    return None


def loopback_vllm_sync(engines: Sequence[Any]) -> EngineGroupWeightSync:
    """``VLLMWeightSync(engines)`` over this platform's vLLM group, the trainer's side on
    127.0.0.1 at a free port."""
    from asyncflow_core.engines.process import free_port

    return VLLMWeightSync(list(engines), master_address="127.0.0.1", master_port=free_port())


class OwnVLLMTransport:
    """``SupportsOwnTransport`` for the vLLM adapters: the RL job's default sync into engines
    that refuse tensors (no worker extension) goes over this platform's vLLM group, the
    trainer's side on 127.0.0.1 (``own_transport_refusal`` says where it cannot)."""

    name: str
    _own_transport_servers: ClassVar[bool] = False
    """HTTP engines: every server must be on loopback as well."""

    def own_transport_refusal(self, engines: Sequence[Any]) -> str | None:
        return own_transport_refusal(engines, servers=self._own_transport_servers)

    def own_weight_transport(self, engines: Sequence[Any]) -> EngineGroupWeightSync:
        refusal = self.own_transport_refusal(engines)
        if refusal is not None:
            raise ConfigError(f"{self.name}: {refusal}")
        return loopback_vllm_sync(engines)
