"""Which SGLang this adapter is written and tested against, and the errors when it is missing
or another version is installed (or served)."""

from __future__ import annotations

from types import ModuleType

from asyncflow_core.enginekit import check_version, require_module

TESTED = ("0.5.23", "0.6")
"""The adapter follows SGLang's API in ``[TESTED[0], TESTED[1])`` (the extras' pin)."""

INSTALL = "pip install 'asyncflow[sglang]' on a machine with a CUDA GPU"
INSTALL_CLIENT = "pip install 'asyncflow[sglang-client]'"


def check_sglang_version(version: str) -> None:
    """``ConfigError`` unless ``version`` (installed, or reported by a server's
    ``/server_info`` ``"version"``) is in ``TESTED``."""
    check_version("sglang", version, TESTED, INSTALL)


def require_sglang(*, check: bool = True) -> ModuleType:
    """The ``sglang`` module at a tested version (``check=False``: any version), or
    ``MissingExtraError`` naming the extra."""
    sglang = require_module("sglang", who="asyncflow_sglang.SGLangEngine", install=INSTALL)
    if check:
        check_sglang_version(str(getattr(sglang, "__version__", "0")))
    return sglang
