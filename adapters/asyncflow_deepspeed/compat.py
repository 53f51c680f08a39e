"""Which DeepSpeed this adapter runs on, and the one error when it is missing."""

from __future__ import annotations

import importlib
from typing import Any

from asyncflow_core.contracts.errors import ConfigError, MissingExtraError

TESTED = ("0.19.8", "0.20")
"""The adapter is tested on DeepSpeed versions in ``[TESTED[0], TESTED[1])`` (the extra's pin)."""

_INSTALL = "pip install 'asyncflow[deepspeed]'"


def _parse(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(c for c in piece if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def check_version(version: str) -> None:
    """Raise ``ConfigError`` if ``version`` is outside the tested range."""
    low, high = _parse(TESTED[0]), _parse(TESTED[1])
    if not low <= _parse(version) < high:
        raise ConfigError(
            f"asyncflow_deepspeed is tested with deepspeed >={TESTED[0]},<{TESTED[1]}; "
            f"deepspeed {version} is installed. Install a tested version ({_INSTALL})"
        )


def require_deepspeed() -> Any:
    """The ``deepspeed`` module, after checking its version; ``MissingExtraError`` naming the
    extra when it is not installed."""
    try:
        deepspeed = importlib.import_module("deepspeed")
    except ImportError as e:
        raise MissingExtraError(
            f"the DeepSpeed adapter needs DeepSpeed, which is not installed ({e}); install "
            f"the extra: {_INSTALL}"
        ) from e
    check_version(str(getattr(deepspeed, "__version__", "0")))
    return deepspeed
