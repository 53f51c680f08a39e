"""AsyncFlow's vLLM adapters (written against vLLM 0.33; see the README's adapter matrix for
what has run live):

- ``VLLMEngine``: the ``InferenceEngine`` protocol over ``AsyncLLM`` in this process
  (``[vllm]`` extra, a CUDA machine);
- ``VLLMHTTPEngine``: the same over HTTP to ``vllm serve`` in dev mode (``[vllm-client]``
  extra: aiohttp only);
- ``VLLMWeightSync``: the trainer's side of vLLM's native NCCL weight transfer, into either.

Importing this package imports neither vLLM nor aiohttp.
"""

from __future__ import annotations

from asyncflow_vllm.compat import TESTED, check_vllm_version, require_vllm
from asyncflow_vllm.engine import VLLMEngine, VLLMTypes
from asyncflow_vllm.http import VLLMHTTPEngine
from asyncflow_vllm.weightsync import VLLMNcclGroup, VLLMWeightSync, vllm_nccl_group

__all__ = [
    "TESTED",
    "VLLMEngine",
    "VLLMHTTPEngine",
    "VLLMNcclGroup",
    "VLLMTypes",
    "VLLMWeightSync",
    "check_vllm_version",
    "require_vllm",
    "vllm_nccl_group",
]
