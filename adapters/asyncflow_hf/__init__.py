"""AsyncFlow's Hugging Face adapter: models, tokenizers, datasets and rewards from local files,
and engines over transformers.

Needs the ``[hf]`` extra (``pip install 'asyncflow[hf]'``, transformers pinned to the 5.24
series); importing this package does not import transformers, building an engine or loading a
model does (and raises ``MissingExtraError`` naming the extra when it is absent).
"""

from __future__ import annotations

from asyncflow_hf.compat import TESTED, require_transformers
from asyncflow_hf.models import TINY, check_model_folder, load_causal_lm, tiny_config

__all__ = [
    "TESTED",
    "TINY",
    "check_model_folder",
    "load_causal_lm",
    "require_transformers",
    "tiny_config",
]
