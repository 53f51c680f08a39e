"""AsyncFlow on Ascend NPUs.

* ``NPUPlatform``: platform ``npu`` (``torch_npu``; hccl collectives), registered through the
  ``asyncflow.platforms`` entry point, so ``platform = "npu"`` selects it anywhere a platform
  is chosen (``asyncflow_core.infra.platform``).
* HCCL weight sync: ``WeightSyncGroup(..., backend="hccl")`` (``asyncflow_core.sync.transports``)
  builds its group through this platform; ``DistributedWeightSync`` /
  ``DistributedWeightReceiver`` and ``EngineGroupWeightSync`` run over it unchanged.
* vLLM on NPU (vllm-ascend): ``asyncflow_vllm`` picks vllm-ascend's ``hccl`` weight-transfer
  backend and its trainer-side group on this platform (``asyncflow_vllm.platform_wiring``).
* DeepSpeed on NPU: ``asyncflow_deepspeed.DeepSpeedTrainEngine(platform="npu")`` runs
  DeepSpeed with ``DS_ACCELERATOR=npu`` and hccl.

Nothing here has run on Ascend hardware (see the README's adapter matrix).
"""

from asyncflow_ascend.compat import CANN, INSTALL, VLLM_ASCEND
from asyncflow_ascend.platform import NPUPlatform

__all__ = ["CANN", "INSTALL", "VLLM_ASCEND", "NPUPlatform"]
