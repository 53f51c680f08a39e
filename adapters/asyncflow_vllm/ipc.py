"""``VLLMIPCWeightSync``: weight sync into a *colocated* ``VLLMEngine`` (the trainer and vLLM's
workers on the same accelerator) through vllm-ascend's ``npu_ipc`` weight-transfer backend:
no collective, the workers map the trainer's tensors through IPC handles.

The engine is built with ``weight_transfer_config={"backend": "npu_ipc"}``
(``VLLMEngine.create(platform="npu", colocated=True)``). Phases (``WeightSync``):

- ``init``: ``init_weight_transfer_engine({})`` (npu_ipc needs no rendezvous);
- ``start``: ``start_weight_update()``;
- ``update(bucket)``: vllm-ascend's trainer-side sender,
  ``NPUIPCWeightTransferEngine.trainer_send_weights(iter(bucket), {"send_mode": fn,
  "packed": False})`` (``vllm_ascend/distributed/weight_transfer/npu_ipc_engine.py``), runs
  on a worker thread; it turns the bucket's tensors into IPC handles and calls ``fn`` with
  the update info while it still holds them, and ``fn`` awaits the engine's
  ``update_weights`` on the event loop before returning, so the handles outlive their use;
- ``finish(version)``: ``VLLMEngine.commit_weights(version)`` (``finish_weight_update``).

vllm-ascend requires the trainer's tensors on the same physical NPU as the worker (its IPC
handles are keyed by host and chip) and ``ray`` importable (its module imports vLLM's IPC
engine, which imports ray).

**Insecure serialization, on purpose and only here.** An IPC handle is a rebuild function
with its arguments; ``AsyncLLM`` reaches its engine core only through msgpack, which carries a
function only as pickle, with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (``vllm/v1/
serial_utils.py``, ``MsgpackEncoder.enc_hook``; vllm-ascend's HTTP variant,
``ipc_handles_pickled``, needs it too: ``npu_ipc_engine.py``, ``parse_update_info``). So
``init`` refuses unless that variable was ``1`` when the engine was created: set it yourself,
knowing the engine core will unpickle what this process sends it over its local socket.
AsyncFlow never sets it. The update info goes without the ``ipc_handles_pickled: None`` that
``dataclasses.asdict`` would add: vllm-ascend refuses an update carrying both keys
("Cannot specify both `ipc_handles` and `ipc_handles_pickled`").

**Not run on Ascend hardware**; the tests drive the phases with a stand-in for
``trainer_send_weights`` that calls ``send_mode`` the way it does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from asyncflow_core.contracts.errors import WeightSyncError
from asyncflow_core.contracts.protocols import Version, WeightBucket
from asyncflow_core.sync.transports import _Phases
from asyncflow_vllm.compat import INSTALL_ASCEND
from asyncflow_vllm.engine import VLLMEngine

SendWeights = Callable[[Iterator[tuple[str, torch.Tensor]], dict[str, Any]], None]
"""``trainer_send_weights(iterator, trainer_args)``, as vLLM's IPC engines define it."""


def npu_ipc_sender() -> SendWeights:
    """vllm-ascend's ``NPUIPCWeightTransferEngine.trainer_send_weights``."""
    try:
        module = importlib.import_module("vllm_ascend.distributed.weight_transfer.npu_ipc_engine")
    except ImportError as exc:
        raise WeightSyncError(
            f"VLLMIPCWeightSync needs vllm-ascend (and ray) in the trainer process ({exc}); "
            f"install {INSTALL_ASCEND}"
        ) from exc
    send: SendWeights = module.NPUIPCWeightTransferEngine.trainer_send_weights
    return send


class VLLMIPCWeightSync:
    """The ``WeightSync`` protocol into one colocated ``VLLMEngine`` over IPC handles (see the
    module docstring). ``send_weights``: the trainer-side sender (default: vllm-ascend's
    ``npu_ipc`` one, imported at ``init``)."""

    def __init__(self, engine: VLLMEngine, *, send_weights: SendWeights | None = None) -> None:
        if not isinstance(engine, VLLMEngine):
            raise WeightSyncError(
                f"VLLMIPCWeightSync syncs into a VLLMEngine in this process, got "
                f"{type(engine).__name__}; for engines elsewhere use VLLMWeightSync"
            )
        self.engine = engine
        self._send = send_weights
        self._phases = _Phases("VLLMIPCWeightSync")
        self._closed = False
        self._failed: BaseException | None = None

    async def init(self) -> None:
        self._usable()
        self._phases.expect("init")
        if os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") != "1":
            raise WeightSyncError(
                "VLLMIPCWeightSync: vllm-ascend's npu_ipc handles reach vLLM's engine core "
                "only as pickle, which vLLM allows with VLLM_ALLOW_INSECURE_SERIALIZATION=1 "
                "(vllm/v1/serial_utils.py); set it in the environment before creating the "
                "engine if you accept that its engine core unpickles what this process sends "
                "(AsyncFlow never sets it), or sync over a group with VLLMWeightSync"
            )
        if self._send is None:
            self._send = npu_ipc_sender()
        request = self.engine.types.WeightTransferInitRequest(init_info={})
        await self._guard("init", self.engine.engine.init_weight_transfer_engine(request))
        self._phases.move("init")

    async def start(self) -> None:
        self._usable()
        self._phases.expect("start")
        await self._guard("start", self.engine.begin_weight_update())
        self._phases.move("start")

    async def update(self, bucket: WeightBucket) -> None:
        self._usable()
        self._phases.expect("update")
        loop = asyncio.get_running_loop()
        make_request = self.engine.types.WeightTransferUpdateRequest
        llm = self.engine.engine
        sent: list[int] = []

        def send_mode(info: Any) -> None:  # on the sender's thread, handles still held
            is_record = dataclasses.is_dataclass(info) and not isinstance(info, type)
            fields = dataclasses.asdict(info) if is_record else dict(info)
            if fields.get("ipc_handles_pickled", 0) is None:  # npu_ipc_engine.py refuses both
                del fields["ipc_handles_pickled"]
            request = make_request(update_info=fields)
            asyncio.run_coroutine_threadsafe(llm.update_weights(request), loop).result()
            sent.append(len(fields.get("names", ())))

        pairs = zip(bucket.names, bucket.tensors, strict=True)
        assert self._send is not None
        sender = self._send
        args = {"send_mode": send_mode, "packed": False}
        await self._guard("update", asyncio.to_thread(sender, pairs, args))
        if sum(sent) != len(bucket.names):
            raise WeightSyncError(
                f"VLLMIPCWeightSync: update() sent {sum(sent)} of the bucket's "
                f"{len(bucket.names)} tensors; the sender did not call send_mode for all"
            )
        self._phases.move("update")

    async def finish(self, version: Version) -> None:
        self._usable()
        self._phases.expect("finish")
        await self._guard("finish", self.engine.commit_weights(version))
        self._phases.move("finish")

    async def close(self) -> None:
        self._closed = True

    def _usable(self) -> None:
        if self._closed:
            raise WeightSyncError("VLLMIPCWeightSync is closed; build a new one")
        if self._failed is not None:
            raise WeightSyncError(
                f"VLLMIPCWeightSync: an earlier transfer failed ({self._failed}); the engine "
                "may hold part of a sync: build a new transport and sync again"
            )

    async def _guard(self, phase: str, call: Any) -> None:
        try:
            await call
        except WeightSyncError as exc:
            if phase != "init":
                self._failed = exc
            raise
        except Exception as exc:
            error = WeightSyncError(f"VLLMIPCWeightSync: {phase}() failed: {exc}")
            if phase != "init":
                self._failed = error
            raise error from exc
