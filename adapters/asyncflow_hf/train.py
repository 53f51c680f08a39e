"""``HFTrainEngine``: a ``TrainEngine`` for any Hugging Face ``AutoModelForCausalLM``, the
single-process AdamW loop of ``asyncflow_core.engines.lmtrain.AdamWTrainer`` over a transformers
model.

The loop (micro-batches weighted by response tokens, clipping, the checks that leave the
engine unchanged on a bad step, the checkpoint files) is the reference trainer's; this module
supplies the forward pass of an HF model and what is HF-specific around it: the names weights
travel under, the model's config in checkpoints, and ``save_pretrained``.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from asyncflow_core.contracts.errors import ConfigError, EngineError
from asyncflow_core.engines.lmtrain import AdamWTrainer, TokenRows
from asyncflow_hf.compat import require_transformers
from asyncflow_hf.models import load_causal_lm

_NOT_THE_MODEL = frozenset(
    {
        "transformers_version",
        "dtype",
        "torch_dtype",
        "use_cache",
        "architectures",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)
"""Config fields that say how a model was saved or is run, not which model it is (with every
field whose name starts with ``_``, e.g. ``_name_or_path``): a checkpoint's config may differ
from the engine's in them."""


class HFTrainEngine(AdamWTrainer):
    """Trains a Hugging Face causal LM with AdamW, in this process, on the CPU.

    ``HFTrainEngine(model, *, lr=1e-5, betas=(0.9, 0.999), weight_decay=0.0,
    max_grad_norm=1.0, micro_batch_size=8, temperature=1.0, dtype="fp32",
    gradient_checkpointing=False, seed=0, trust_remote_code=False, name="hf-trainer",
    threads=None)``:

    * ``model``: what ``asyncflow_hf.models.load_causal_lm`` takes: a local model folder
      (safetensors only, remote code only with ``trust_remote_code=True``), a
      ``PretrainedConfig`` (random init from ``seed``), a ``TINY`` name, or a
      ``PreTrainedModel`` (deep-copied). The engine trains its own fp32 copy, every parameter
      trainable.
    * ``dtype="bf16"``: mixed precision. The weights and AdamW's state stay fp32 (master
      weights); the forward runs under ``torch.autocast(device, dtype=torch.bfloat16)`` and
      the log-softmax of the picked logits in fp32. Exports, checkpoints and
      ``save_pretrained`` carry the fp32 weights (an inference engine in bf16 casts them, as
      autocast does).
    * ``gradient_checkpointing=True``: transformers' activation checkpointing
      (non-reentrant) during ``train_step``: the same gradients for less memory, one more
      forward per layer. No KV cache is built in any forward (``use_cache=False``).
    * ``lr``, ``betas``, ``weight_decay``, ``max_grad_norm`` (``None``: no clipping),
      ``micro_batch_size``, ``temperature`` (for a batch without sampling fields),
      ``threads``: as for ``TorchTrainEngine``. Every argument is checked; a bad one raises
      ``ConfigError`` naming it.

    **Batches and log-probs** as ``TorchTrainEngine``'s: ``prompt`` and ``response`` token
    fields in any store layout, each row's sampling fields
    (``asyncflow_core.training.sampling``); ids
    must lie in ``[0, config.vocab_size)`` and prompt + response within
    ``config.max_position_embeddings``. The rows are packed right-padded with an attention
    mask and position ids ``0, 1, ...`` per row, so a row's log-probs do not depend on the
    rows padded beside it, and the model computes logits only at the positions that predict
    response tokens (``logits_to_keep``). Dropout (if the config has any) acts only in
    ``train_step``; ``compute_logprobs`` runs the model in eval mode.

    **Steps**: ``AdamWTrainer``'s (token-weighted micro-batches, clipping, a non-finite loss
    or gradient changes nothing).

    **Weights** travel under the model's ``state_dict`` names, the ones vLLM and SGLang load
    (``model.embed_tokens.weight``, ``model.layers.0.self_attn.q_proj.weight``, ...; a tied
    ``lm_head.weight`` is not sent: their loaders tie it to the embedding), each tensor once.

    **Checkpoints** (``save_checkpoint`` / ``load_checkpoint``): ``model.safetensors``
    (each tensor once), ``optimizer.pt`` and ``trainer.json`` (format tag, version, the
    model's config, optimizer settings), written atomically. Loading refuses, changing nothing,
    a checkpoint that is unreadable or of another model (its config differs, e.g. in
    ``hidden_size``; fields such as ``_name_or_path``, ``dtype`` or ``transformers_version``
    are ignored).

    **``save_pretrained(path, *, tokenizer=None, generation_config=None)``** writes the
    trained policy as transformers does (``config.json``, ``model.safetensors``,
    ``generation_config.json``; tied embeddings stay tied), plus the tokenizer's files and a
    generation config when given: what ``AutoModelForCausalLM.from_pretrained`` and vLLM or
    SGLang load next.

    The work runs on one worker thread, one call at a time; ``close()`` stops it.
    """

    checkpoint_format = "asyncflow-hf-trainer/1"
    model: Any  # a transformers PreTrainedModel (transformers is imported lazily)

    def __init__(
        self,
        model: Any,
        *,
        lr: float = 1e-5,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        max_grad_norm: float | None = 1.0,
        micro_batch_size: int = 8,
        temperature: float = 1.0,
        dtype: Literal["fp32", "bf16"] = "fp32",
        gradient_checkpointing: bool = False,
        seed: int = 0,
        lr_warmup_steps: int = 0,
        minibatches: int = 1,
        trust_remote_code: bool = False,
        name: str = "hf-trainer",
        threads: int | None = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"HFTrainEngine: name must be a non-empty str, got {name!r}")
        who = f"HFTrainEngine {name!r}"
        super().__init__(
            name=name,
            who=who,
            lr=lr,
            weight_decay=weight_decay,
            betas=betas,
            max_grad_norm=max_grad_norm,
            micro_batch_size=micro_batch_size,
            temperature=temperature,
            seed=seed,
            lr_warmup_steps=lr_warmup_steps,
            minibatches=minibatches,
        )
        if dtype not in ("fp32", "bf16"):
            raise ConfigError(f"{who}: dtype must be 'fp32' or 'bf16', got {dtype!r}")
        for field, flag in (
            ("gradient_checkpointing", gradient_checkpointing),
            ("trust_remote_code", trust_remote_code),
        ):
            if not isinstance(flag, bool):
                raise ConfigError(f"{who}: {field} must be True or False, got {flag!r}")
        self.dtype = dtype
        self.gradient_checkpointing = gradient_checkpointing
        self.model = load_causal_lm(
            model, who=who, dtype="fp32", seed=self.seed, trust_remote_code=trust_remote_code
        )
        self.model.requires_grad_(True).eval()
        if gradient_checkpointing:
            try:
                self.model.activation_checkpointing_enable(
                    activation_checkpointing_kwargs={"use_reentrant": False}
                )
            except ValueError as exc:  # the model class does not support it
                raise ConfigError(
                    f"{who}: gradient_checkpointing=True, but {exc}; pass False"
                ) from exc
        text = self.model.config.get_text_config()
        self.vocab_size = int(text.vocab_size)
        positions = getattr(text, "max_position_embeddings", None)
        self.max_seq_len = int(positions) if isinstance(positions, int) else None
        self.device = next(self.model.parameters()).device
        forward = inspect.signature(self.model.forward).parameters
        # Per-row positions in logits_to_keep (a [B, R] index) need transformers' 2-D slicing
        # (modeling_utils.slice_logits_to_keep, 5.24); before it (5.19, the vLLM CPU build's)
        # a 2-D index slices wrongly, so the logits of every position are computed and the
        # response positions gathered from them (the same values, more compute)
        utils = importlib.import_module("transformers.modeling_utils")
        self._keeps_logits = "logits_to_keep" in forward and hasattr(utils, "slice_logits_to_keep")
        self._start(threads, who)

    # -- the model's forward ---------------------------------------------------------------------
    def _response_logprobs(self, rows: TokenRows) -> tuple[Tensor, int]:
        b, r = rows.response.shape
        if r == 0 or b == 0:
            return torch.zeros(b, r), 0
        # dropout and activation checkpointing only where gradients flow (train_step)
        self.model.train(torch.is_grad_enabled())
        seq, source = rows.inputs()
        t = seq.shape[1]
        steps = torch.arange(t).unsqueeze(0)
        mask = (steps < (rows.plen + rows.rlen).unsqueeze(1)).long()
        # with r == t the logits of a model that ignored logits_to_keep ([b, t, V]) could not
        # be told from the kept ones ([b, r, V]): a micro-batch sliced from a wider batch can
        # have that shape, so there every position's logits are computed and gathered
        use_keep = self._keeps_logits and r != t
        keep = {"logits_to_keep": source.to(self.device)} if use_keep else {}
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.dtype == "bf16"):
            out = self.model(
                input_ids=seq.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=steps.expand(b, t).to(self.device),
                use_cache=False,
                **keep,
            )
        logits = getattr(out, "logits", out)
        if isinstance(logits, Tensor) and logits.dim() == 3 and logits.shape[:2] == (b, t):
            index = source.to(logits.device).unsqueeze(2).expand(b, r, logits.shape[2])
            logits = logits.gather(1, index)  # every position's, or a model that ignored it
        if not isinstance(logits, Tensor) or logits.dim() != 3 or logits.shape[:2] != (b, r):
            raise EngineError(
                f"{self.name}: the model returned logits "
                f"{type(logits).__name__} {list(getattr(logits, 'shape', []))} for tokens "
                f"{[b, t]} and logits_to_keep positions {[b, r]}; expected [{b}, {r}, V] (or "
                f"[{b}, {t}, V]): use a causal LM whose output has .logits"
            )
        return rows.logprobs(logits.float())

    # -- checkpoints ---------------------------------------------------------------------------
    def _model_config(self) -> dict[str, Any]:
        config: dict[str, Any] = json.loads(self.model.config.to_json_string(use_diff=False))
        return config

    def _other_model(self, saved: object) -> str | None:
        if not isinstance(saved, dict):
            return (
                f"is not readable (its model_config is a {type(saved).__name__}); pass a "
                "directory written by HFTrainEngine.save_checkpoint"
            )
        mine, theirs = _identity(self._model_config()), _identity(saved)
        differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        if not differ:
            return None
        shown = "; ".join(
            f"{k}: checkpoint {theirs.get(k)!r}, this model {mine.get(k)!r}" for k in differ[:4]
        )
        more = f" and {len(differ) - 4} more" if len(differ) > 4 else ""
        return (
            f"is for another model (its config differs in {shown}{more}); load it into an "
            "engine built from the same model config"
        )

    # -- the trained policy, as transformers saves it --------------------------------------------
    async def save_pretrained(
        self, path: str | Path, *, tokenizer: Any = None, generation_config: Any = None
    ) -> None:
        """Write the model to the folder ``path`` with transformers' ``save_pretrained``
        (safetensors; tied embeddings saved once and tied again by ``from_pretrained``), with
        ``tokenizer.save_pretrained(path)`` when a tokenizer is given and
        ``generation_config`` (a ``GenerationConfig`` or a mapping of its fields) as
        ``generation_config.json`` when given (else the model's own, if it has one)."""
        if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
            raise ConfigError(
                f"{self.name}: tokenizer must have save_pretrained (a transformers tokenizer "
                f"or processor), got {type(tokenizer).__name__}"
            )
        gen = self._generation_config(generation_config)
        await self._run(self._save_pretrained, Path(path), tokenizer, gen)

    def _generation_config(self, value: Any) -> Any:
        if value is None:
            return None
        transformers = require_transformers(self.name)
        if isinstance(value, transformers.GenerationConfig):
            return value
        if isinstance(value, Mapping):
            try:
                return transformers.GenerationConfig(**value)
            except (TypeError, ValueError) as exc:
                raise ConfigError(
                    f"{self.name}: generation_config is not a valid GenerationConfig ({exc})"
                ) from exc
        raise ConfigError(
            f"{self.name}: generation_config must be a transformers GenerationConfig or a "
            f"mapping of its fields, got {type(value).__name__}"
        )

    def _save_pretrained(self, path: Path, tokenizer: Any, generation_config: Any) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(str(path))  # transformers 5 writes safetensors only
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))
        if generation_config is not None:
            generation_config.save_pretrained(str(path))


def _identity(config: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a model config that say which model it is."""
    return {k: v for k, v in config.items() if not k.startswith("_") and k not in _NOT_THE_MODEL}


__all__ = ["HFTrainEngine"]
