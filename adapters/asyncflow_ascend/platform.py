"""``NPUPlatform``: Ascend NPUs through ``torch_npu``, with hccl collectives.

Registered as platform ``npu`` through this project's ``asyncflow.platforms`` entry point (see
``asyncflow_core.infra.platform``), so ``select_platform("npu")``, ``ASYNCFLOW_PLATFORM=npu`` or the
main job's ``platform = "npu"`` choose it without importing this module by hand.
``torch_npu`` is imported only when the platform is probed or loaded, never at import.

What it maps to (torch_npu 2.13 and vllm-ascend 0.26, read in their sources): device type
``npu`` (``torch.npu`` mirrors ``torch.cuda``: ``device_count``, ``set_device``,
``synchronize``, ``memory_allocated``, ``memory_reserved``, ``mem_get_info``), collective
backend ``hccl`` (``torch_npu._C._distributed_c10d.ProcessGroupHCCL``, built the way torch_npu
registers it with torch.distributed), visible devices ``ASCEND_RT_VISIBLE_DEVICES``, Ray
resource ``NPU``, DeepSpeed accelerator ``npu``.

Not run on Ascend hardware: the tests here cover the paths without ``torch_npu`` and with a
``torch_npu`` whose CANN libraries are missing; ``live_ascend`` tests run on NPUs.
"""

from __future__ import annotations

import importlib
import os
from datetime import timedelta
from typing import Any

import torch

from asyncflow_ascend.compat import INSTALL, check_release, explain_load_failure
from asyncflow_core.infra.platform import Platform, import_accelerator_library


class NPUPlatform(Platform):
    """Ascend NPUs: ``torch.npu`` devices, hccl collectives (see the module docstring)."""

    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    ray_resource = "NPU"
    deepspeed_accelerator = "npu"
    priority = 10
    install = INSTALL

    def _probe(self) -> str | None:
        module, why = import_accelerator_library("torch_npu")
        if module is None:
            return explain_load_failure(why)
        mismatch = check_release(torch.__version__, str(getattr(module, "__version__", "")))
        if mismatch is not None:
            return mismatch
        npu = getattr(torch, "npu", None)
        if npu is None:
            return "torch_npu imported, but torch.npu is missing (a broken torch_npu install?)"
        if not npu.is_available() or npu.device_count() < 1:
            visible = os.environ.get(self.visible_devices_env or "")
            shown = f" (ASCEND_RT_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            return f"torch.npu.is_available() is False: no usable NPU{shown}; check npu-smi info"
        import torch.distributed as dist

        if "hccl" not in dist.Backend.backend_list:
            return "torch_npu did not register the hccl backend with torch.distributed"
        return None

    def new_process_group(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
        self.load()
        c10d = importlib.import_module("torch_npu._C._distributed_c10d")
        options = c10d.ProcessGroupHCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        return c10d.ProcessGroupHCCL(store, rank, world_size, options)
