"""Which vLLM releases this adapter is written against, and the errors when vLLM is missing or
another release is installed (or served).

Two lines: vLLM 0.33 (``TESTED``, the ``[vllm]`` extra's pin, CUDA), and vLLM 0.26
(``ASCEND``), the release vllm-ascend 0.26.0rc1 runs on Ascend NPUs (when this was written,
2026-11, PyPI had 0.27.1rc1 to 0.30.0rc2 as release candidates only; a move follows the first
final release). 0.26 lacks some of 0.33's API; the adapters find out which by looking (``Features``)
and say what that costs in their docstrings: no per-token weight-version spans, no version
label on the engine, an unpacked-only init of the weight transfer.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

from asyncflow_core.contracts.errors import ConfigError
from asyncflow_core.engines.enginekit import is_int, parse_release, require_module

TESTED = ("0.33.0", "0.34")
"""The adapter follows vLLM's API in ``[TESTED[0], TESTED[1])`` (the extras' pin)."""

ASCEND = ("0.26.0", "0.27")
"""The vLLM release line vllm-ascend 0.26.0rc1 runs (its ``vllm_version_is("0.26.0")``)."""

INSTALL = "pip install 'asyncflow[vllm]' on a machine with a CUDA GPU"
INSTALL_ASCEND = (
    "on Ascend NPUs: vllm==0.26.0 with vllm-ascend==0.26.0rc1 (its own pins: torch 2.10.0, "
    "torch-npu 2.10.0.post4)"
)
INSTALL_CLIENT = "pip install 'asyncflow[vllm-client]'"

PACKED_BUFFER_BYTES = 1 << 30
"""vLLM 0.33's default ``packed_buffer_size_bytes`` (``distributed/weight_transfer/
packed_tensor.py``, ``DEFAULT_PACKED_BUFFER_SIZE_BYTES``): the chunk size of a packed sync."""

PACKED_NUM_BUFFERS = 2
"""vLLM 0.33's default ``packed_num_buffers`` (streams; it does not change the wire)."""


def check_packing(who: str, packed: bool | None, buffer_bytes: object) -> None:
    """``ConfigError`` unless ``weight_packing`` is None/True/False and ``packed_buffer_bytes``
    an int >= 1."""
    if packed not in (None, True, False):
        raise ConfigError(f"{who}: weight_packing must be None, True or False, got {packed!r}")
    if not is_int(buffer_bytes) or buffer_bytes < 1:
        raise ConfigError(f"{who}: packed_buffer_bytes must be an int >= 1, got {buffer_bytes!r}")


def packing_for(who: str, packed: bool | None, features: Features) -> bool:
    """Whether a sync into this vLLM is packed: ``packed`` if given (True refused on a vLLM
    whose init info has no ``packed`` field, 0.26), else whenever the vLLM has it."""
    if packed and not features.packed_init:
        raise ConfigError(
            f"{who}: weight_packing=True needs vLLM 0.33's packed weight transfer; this vLLM's "
            "init info has no 'packed' field (0.26 refuses the key): leave weight_packing=None"
        )
    return features.packed_init if packed is None else bool(packed)


NO_INFLIGHT_LOAD = (
    "vLLM's start_weight_update re-initialises the model's layers for a layerwise reload "
    "(distributed/weight_transfer/nccl_engine.py, NCCLWeightTransferEngine.start_weight_update "
    "-> model_executor/model_loader/reload/layerwise.py, initialize_layerwise_reload), and its "
    "engine core changes weight versions only while generation is paused (v1/engine/core.py)"
)
"""Why vLLM cannot load weights while it generates (``inflight_weight_load_refusal``)."""


def _within(version: str, line: tuple[str, str]) -> bool:
    got = parse_release(version)
    return bool(got) and parse_release(line[0]) <= got < parse_release(line[1])


def check_vllm_version(version: str) -> None:
    """``ConfigError`` unless ``version`` (installed, or reported by a server's ``/version``)
    is in ``TESTED`` or ``ASCEND``."""
    if not (_within(version, TESTED) or _within(version, ASCEND)):
        raise ConfigError(
            f"vllm {version} is installed (or served), but this adapter follows vllm "
            f">={TESTED[0]},<{TESTED[1]} ({INSTALL}) and vllm >={ASCEND[0]},<{ASCEND[1]} "
            f"({INSTALL_ASCEND}); install one of those"
        )


@dataclasses.dataclass(frozen=True)
class Features:
    """What a vLLM release offers beyond 0.26, decided from its version (0.33: all of it)."""

    weight_version_label: bool
    """``finish_weight_update(weight_version)``, ``update_weight_version``, ``/weight_info``
    and per-output ``weight_versions`` spans."""
    packed_init: bool
    """``packed`` is a field of the nccl backend's ``init_info`` (0.26 refuses it there)."""

    @classmethod
    def of(cls, version: str) -> Features:
        modern = _within(version, TESTED)
        return cls(weight_version_label=modern, packed_init=modern)


def require_vllm() -> ModuleType:
    """The ``vllm`` module at a release this adapter follows, or ``MissingExtraError`` naming
    the extra."""
    vllm = require_module("vllm", who="asyncflow_vllm.VLLMEngine", install=INSTALL)
    check_vllm_version(str(getattr(vllm, "__version__", "0")))
    return vllm
