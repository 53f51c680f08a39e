"""The worker extension ``VLLMEngine`` drives through ``collective_rpc`` by method *name*:
start vLLM with ``worker_extension_cls="asyncflow_vllm.worker_ext.WeightUpdateExtension"``
(``VLLMEngine.create`` sets it unless told otherwise). It runs inside vLLM's workers; not run
live here.

* ``load_weights_from_bytes``: ``VLLMEngine.load_weights`` (tensors held by the caller, e.g.
  the staged or in-process weight sync). ``AsyncLLM`` talks to its engine core only through
  msgpack (``vllm/v1/engine/core_client.py``, ``vllm/v1/serial_utils.py``
  ``MsgpackEncoder``): a function is refused unless ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``
  (pickle, which AsyncFlow never asks for), and a tensor in a utility call's arguments arrives
  as a ``[dtype, shape, buffer index]`` list, because ``EngineCore`` decodes those arguments
  untyped (``vllm/v1/engine/core.py``). So the tensors go as ``[name, dtype, shape, bytes]``
  lists (``encode_weights``), which msgpack carries as they are, and are rebuilt on the
  worker (``decode_weights``).
* ``init_weight_update_group`` / ``update_weight``: the weight group for vLLMs without the
  native weight-transfer API (the convention of vLLM's old
  ``examples/offline_inference/rlhf_utils.py``, still used by OpenRLHF), used when
  ``init_weight_transfer_engine`` is absent.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch

EXTENSION = "asyncflow_vllm.worker_ext.WeightUpdateExtension"
"""The ``worker_extension_cls`` value that installs this extension."""


def encode_weights(weights: Sequence[tuple[str, torch.Tensor]]) -> list[list[Any]]:
    """``(name, tensor)`` pairs as msgpack-native ``[name, dtype, shape, bytes]`` lists (the
    tensor's bytes in C order, on the CPU)."""
    out: list[list[Any]] = []
    for name, tensor in weights:
        t = tensor.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), raw])
    return out


def decode_weights(items: Sequence[Sequence[Any]], device: Any = "cpu") -> list[tuple[str, Any]]:
    """``encode_weights``' lists (as msgpack hands them back) as ``(name, tensor)`` pairs on
    ``device``; a malformed item raises ``ValueError`` naming it."""
    out: list[tuple[str, Any]] = []
    for i, item in enumerate(items):
        try:
            name, dtype_name, shape, raw = item
            dtype = getattr(torch, str(dtype_name))
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"{dtype_name!r} is not a torch dtype")
            if not raw:
                tensor = torch.empty([int(d) for d in shape], dtype=dtype)
            else:
                flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype)
                tensor = flat.reshape([int(d) for d in shape])
        except (TypeError, ValueError, RuntimeError, AttributeError) as exc:
            raise ValueError(f"load_weights_from_bytes: item {i} is malformed: {exc}") from exc
        out.append((str(name), tensor.to(device)))
    return out


class WeightUpdateExtension:
    """Mixed into vLLM's worker class: ``self`` is the worker (``self.device``,
    ``self.model_runner``)."""

    model_update_group: Any = None

    def load_weights_from_bytes(self, items: list[list[Any]]) -> None:
        """Load ``encode_weights``' lists into this worker's model."""
        weights = decode_weights(items, self.device)  # type: ignore[attr-defined]
        self.model_runner.model.load_weights(weights=weights)  # type: ignore[attr-defined]

    def init_weight_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int
    ) -> None:
        utils = importlib.import_module("vllm.distributed.utils")
        pynccl = importlib.import_module("vllm.distributed.device_communicators.pynccl")
        parallel_state = importlib.import_module("vllm.distributed.parallel_state")
        rank = parallel_state.get_world_group().rank + rank_offset
        group = utils.StatelessProcessGroup.create(
            host=master_address, port=master_port, rank=rank, world_size=world_size
        )
        self.model_update_group = pynccl.PyNcclCommunicator(group, device=self.device)  # type: ignore[attr-defined]

    def update_weight(self, name: str, dtype_name: str, shape: list[int]) -> None:
        if self.model_update_group is None:
            raise RuntimeError("call init_weight_update_group first")
        weight = torch.empty(shape, dtype=getattr(torch, dtype_name), device="cuda")
        self.model_update_group.broadcast(weight, src=0, stream=torch.cuda.current_stream())
        self.model_runner.model.load_weights(weights=[(name, weight)])  # type: ignore[attr-defined]
        del weight
