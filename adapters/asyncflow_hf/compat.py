"""Which transformers this adapter is written against, and the one error when it is missing.

``HFInferenceEngine`` drives transformers' continuous batching
(``transformers/generation/continuous_batching/``), whose internals move between releases, so
the ``[hf]`` extra pins the 5.24 series and the engines check the installed version."""

from __future__ import annotations

from types import ModuleType

from asyncflow_core.engines.enginekit import check_version, require_module

TESTED = ("5.24.0", "5.25")
"""The adapter follows transformers' API in ``[TESTED[0], TESTED[1])`` (the extra's pin)."""

INSTALL = "pip install 'asyncflow[hf]'"


def require_transformers(who: str) -> ModuleType:
    """The ``transformers`` module at a tested release, or ``MissingExtraError`` naming the
    extra (``ConfigError`` for an untested release)."""
    transformers = require_module("transformers", who=who, install=INSTALL)
    check_version("transformers", str(getattr(transformers, "__version__", "0")), TESTED, INSTALL)
    return transformers
