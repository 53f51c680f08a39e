"""Which transformers this adapter is written against, and the one error when it is missing.

Two ranges:

- ``TESTED`` (the ``[hf]`` extra's pin, the 5.24 series): ``HFInferenceEngine`` drives
  transformers' continuous batching (``transformers/generation/continuous_batching/``), whose
  internals move between releases, so it runs on that series only;
- ``MODELS_TESTED`` (5.19 up to the 5.24 series): everything else (models, tokenizers, the
  trainer, the workload, the assets), which uses transformers' stable API only
  (``from_pretrained``, a forward with ``logits_to_keep``, ``save_pretrained``). 5.19 is what
  the vLLM CPU build pins (``transformers<5.20``): the live tier runs ``HFTrainEngine`` and the
  ``hf`` workload there beside a real vLLM.
"""

from __future__ import annotations

from types import ModuleType

from asyncflow_core.engines.enginekit import check_version, require_module

TESTED = ("5.24.0", "5.25")
"""``HFInferenceEngine`` follows transformers' API in ``[TESTED[0], TESTED[1])``."""

MODELS_TESTED = ("5.19.0", "5.25")
"""The rest of the adapter runs on transformers in ``[MODELS_TESTED[0], MODELS_TESTED[1])``."""

INSTALL = "pip install 'asyncflow[hf]'"


def require_transformers(who: str, *, continuous_batching: bool = False) -> ModuleType:
    """The ``transformers`` module at a tested release, or ``MissingExtraError`` naming the
    extra (``ConfigError`` for an untested release): ``TESTED`` for continuous batching,
    ``MODELS_TESTED`` otherwise."""
    transformers = require_module("transformers", who=who, install=INSTALL)
    line = TESTED if continuous_batching else MODELS_TESTED
    check_version("transformers", str(getattr(transformers, "__version__", "0")), line, INSTALL)
    return transformers
