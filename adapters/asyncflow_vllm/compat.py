"""Which vLLM this adapter is written and tested against, and the errors when it is missing or
another version is installed (or served)."""

from __future__ import annotations

from types import ModuleType

from asyncflow_core.enginekit import check_version, require_module

TESTED = ("0.33.0", "0.34")
"""The adapter follows vLLM's API in ``[TESTED[0], TESTED[1])`` (the extras' pin)."""

INSTALL = "pip install 'asyncflow[vllm]' on a machine with a CUDA GPU"
INSTALL_CLIENT = "pip install 'asyncflow[vllm-client]'"


def check_vllm_version(version: str) -> None:
    """``ConfigError`` unless ``version`` (installed, or reported by a server's ``/version``)
    is in ``TESTED``."""
    check_version("vllm", version, TESTED, INSTALL)


def require_vllm() -> ModuleType:
    """The ``vllm`` module at a tested version, or ``MissingExtraError`` naming the extra."""
    vllm = require_module("vllm", who="asyncflow_vllm.VLLMEngine", install=INSTALL)
    check_vllm_version(str(getattr(vllm, "__version__", "0")))
    return vllm
