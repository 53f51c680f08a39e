"""AsyncFlow's SGLang adapter.

- ``SGLangHTTPEngine``: an ``InferenceEngine`` over a running SGLang server (``[sglang-client]``
  extra: aiohttp only), with pause, sleep, version-only loads and the ``GroupReceiver`` side
  of a collective weight sync.
- ``SGLangEngine``: the same over an in-process ``sglang.Engine`` (``[sglang]`` extra, GPU).
- ``sglang_group`` / ``SGLangWeightSync``: the trainer's side of SGLang's weight-update group
  (built exactly as SGLang builds its side), for ``EngineGroupWeightSync``.
- ``compat``: the tested SGLang range (``TESTED``) and its checks.
"""

from __future__ import annotations

from .compat import TESTED, check_sglang_version, require_sglang
from .engine import SGLangEngine
from .group import SGLangGroup, SGLangWeightSync, join_sglang_group, sglang_group
from .http import SGLangHTTPEngine

__all__ = [
    "TESTED",
    "SGLangEngine",
    "SGLangGroup",
    "SGLangHTTPEngine",
    "SGLangWeightSync",
    "check_sglang_version",
    "join_sglang_group",
    "require_sglang",
    "sglang_group",
]
