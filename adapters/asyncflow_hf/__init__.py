"""AsyncFlow's Hugging Face adapter: models, tokenizers, datasets and rewards from local files,
and engines over transformers.

Needs the ``[hf]`` extra (``pip install 'asyncflow[hf]'``, transformers pinned to the 5.24
series; all but ``HFInferenceEngine`` also run on 5.19, the vLLM CPU build's: ``compat``);
importing this package does not import transformers, building an engine or loading a model
does (and raises ``MissingExtraError`` naming the extra when it is absent).
"""

from __future__ import annotations

from asyncflow_hf.assets import build_tokenizer, gsm8k_rows, make_model_folder, write_gsm8k_jsonl
from asyncflow_hf.chat import HFChatFormat
from asyncflow_hf.compat import MODELS_TESTED, TESTED, require_transformers
from asyncflow_hf.data import Prompt, load_prompts, render_prompt
from asyncflow_hf.inference import HFInferenceEngine
from asyncflow_hf.models import TINY, check_model_folder, load_causal_lm, tiny_config
from asyncflow_hf.reward import (
    RewardError,
    RewardResult,
    RewardRunner,
    batched,
    load_reward,
    math_reward,
    math_reward_strict,
)
from asyncflow_hf.train import HFTrainEngine

__all__ = [
    "MODELS_TESTED",
    "TESTED",
    "TINY",
    "HFChatFormat",
    "HFInferenceEngine",
    "HFTrainEngine",
    "Prompt",
    "RewardError",
    "RewardResult",
    "RewardRunner",
    "batched",
    "build_tokenizer",
    "check_model_folder",
    "gsm8k_rows",
    "load_causal_lm",
    "load_prompts",
    "load_reward",
    "make_model_folder",
    "math_reward",
    "math_reward_strict",
    "render_prompt",
    "require_transformers",
    "tiny_config",
    "write_gsm8k_jsonl",
]
