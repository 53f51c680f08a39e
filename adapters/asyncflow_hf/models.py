"""Hugging Face causal LMs for the engines: load one from a local folder (safetensors only,
no remote code unless asked), build one from a config with a seed, or from a named tiny
config for tests and the CPU demo. Never the hub: ``from_pretrained`` runs with
``local_files_only=True``."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

from asyncflow_core.contracts.errors import ConfigError
from asyncflow_hf.compat import require_transformers

Dtype = Literal["fp32", "bf16"]
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _preset(architecture: str, width: int, kv_heads: int, tied: bool) -> Callable[[Any, int], Any]:
    """A named tiny config: 2 layers, 4 heads, an MLP twice ``width``, 512 positions."""

    def config(transformers: Any, vocab_size: int) -> Any:
        return getattr(transformers, architecture)(
            vocab_size=vocab_size,
            hidden_size=width,
            intermediate_size=2 * width,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=kv_heads,
            max_position_embeddings=512,
            tie_word_embeddings=tied,
        )

    return config


TINY: dict[str, Callable[[Any, int], Any]] = {
    "tiny-qwen2": _preset("Qwen2Config", 64, kv_heads=2, tied=True),
    "tiny-llama": _preset("LlamaConfig", 64, kv_heads=4, tied=False),
    "small-qwen2": _preset("Qwen2Config", 128, kv_heads=2, tied=True),
    "small-llama": _preset("LlamaConfig", 128, kv_heads=2, tied=False),
}
"""Named tiny configs (random init): ``tiny-qwen2`` (ties its embeddings) and ``tiny-llama``
(does not), width 64 with 16-dim heads, a few hundred thousand parameters; ``small-qwen2`` and
``small-llama``, the same at width 128 with 32-dim heads, the smallest head vLLM's CPU
attention serves (``v1/attention/backends/cpu_attn.py``: 32, 64, 80, ...)."""


def tiny_config(name: str, *, vocab_size: int = 256) -> Any:
    """The ``PretrainedConfig`` of a named tiny model (``TINY``) with ``vocab_size`` tokens."""
    if name not in TINY:
        raise ConfigError(f"unknown tiny model {name!r}; choose one of {sorted(TINY)}")
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 2:
        raise ConfigError(
            f"tiny model {name!r}: vocab_size must be an int >= 2, got {vocab_size!r}"
        )
    return TINY[name](require_transformers(f"tiny model {name!r}"), vocab_size)


def check_model_folder(path: str | Path, who: str) -> Path:
    """``path`` as a model folder that ``from_pretrained`` can read offline: a directory with
    ``config.json`` and safetensors weights; ``ConfigError`` naming what is missing."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(
            f"{who}: model folder {str(folder)!r} does not exist (or is not a directory); give "
            "a local folder written by save_pretrained (models are never downloaded)"
        )
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"{who}: model folder {str(folder)!r} has no config.json; give a folder written by "
            "save_pretrained"
        )
    if not any(folder.glob("*.safetensors")):
        found = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        extra = f" (found {found}: convert them with save_pretrained(safe_serialization=True))"
        raise ConfigError(
            f"{who}: model folder {str(folder)!r} has no *.safetensors weights"
            f"{extra if found else ''}; AsyncFlow loads safetensors only (pickled weights can "
            "run code)"
        )
    return folder


def load_causal_lm(
    source: Any,
    *,
    who: str,
    dtype: Dtype = "fp32",
    seed: int = 0,
    trust_remote_code: bool = False,
    copy_module: bool = True,
) -> Any:
    """A ``PreTrainedModel`` causal LM (on CPU, in ``dtype``) from ``source``:

    * a ``PreTrainedModel`` (deep-copied unless ``copy_module=False``);
    * a ``PretrainedConfig``: ``AutoModelForCausalLM.from_config``, random init from ``seed``
      (the same weights for the same config and seed, whoever builds it);
    * a name in ``TINY``: that tiny config, as above;
    * a local model folder: ``from_pretrained(folder, local_files_only=True,
      use_safetensors=True, trust_remote_code=trust_remote_code)``.
    """
    transformers = require_transformers(who)
    if dtype not in DTYPES:
        raise ConfigError(f"{who}: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    torch_dtype = DTYPES[dtype]
    if isinstance(source, transformers.PreTrainedModel):
        model = copy.deepcopy(source) if copy_module else source
        return model.to(device="cpu", dtype=torch_dtype)
    if isinstance(source, str) and source in TINY:
        source = tiny_config(source)
    if isinstance(source, transformers.PretrainedConfig):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = transformers.AutoModelForCausalLM.from_config(
                source, trust_remote_code=trust_remote_code
            )
        return model.to(dtype=torch_dtype)
    if isinstance(source, str | Path):
        folder = check_model_folder(source, who)
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(folder),
                local_files_only=True,
                use_safetensors=True,
                trust_remote_code=trust_remote_code,
                dtype=torch_dtype,
            )
        except ValueError as exc:  # e.g. a config needing remote code
            raise ConfigError(f"{who}: cannot load the model in {str(folder)!r}: {exc}") from exc
        return model
    raise ConfigError(
        f"{who}: model must be a PreTrainedModel, a PretrainedConfig, a tiny model name "
        f"({sorted(TINY)}) or a local model folder, got {type(source).__name__}"
    )
