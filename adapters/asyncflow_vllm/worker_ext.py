"""The worker extension for vLLMs without the native weight-transfer API (the convention of
vLLM's old ``examples/offline_inference/rlhf_utils.py``, still used by OpenRLHF): start vLLM
with ``worker_extension_cls="asyncflow_vllm.worker_ext.WeightUpdateExtension"`` and
``VLLMEngine`` drives it through ``collective_rpc`` when ``init_weight_transfer_engine`` is
absent. It runs inside vLLM's GPU workers; not run live here.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch


class WeightUpdateExtension:
    """Mixed into vLLM's worker class: ``self`` is the worker (``self.device``,
    ``self.model_runner``)."""

    model_update_group: Any = None

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
