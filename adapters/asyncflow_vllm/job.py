"""The ``vllm`` rollout engine of the main job (``asyncflow run --set rollout.engine=vllm``;
entry point ``asyncflow.rollout_engines``): vLLM generating for a workload whose model is a
Hugging Face model (the ``hf`` workload).

- **In this process** (``rollout.url`` empty): the job's model (after any warm-up) is saved to
  a temporary folder (``save_pretrained``, safetensors) and served by an ``AsyncLLM``
  (``VLLMEngine.create``: token in / token out, no tokenizer, ``enforce_eager``, the model's
  dtype); the folder is removed when the engine closes.
- **A running server** (``rollout.url``, one URL per rollout engine): ``VLLMHTTPEngine``,
  connected before the job is built, so that a server that cannot take the job's weight sync
  is refused before anything runs. Start it as ``docs/vllm.md`` says (dev mode, scale-out,
  processed log-probs, the worker extension), on loopback.

Weights reach vLLM on a CPU through ``load_weights`` and the worker extension (no NCCL there):
over vLLM's msgpack link in process, over dev-mode ``/collective_rpc`` for a server, which must
then be on loopback. The job's ``staged`` (default) and ``blocking`` syncs both use it;
``inflight`` is refused (vLLM cannot load while it generates).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from asyncflow_core.contracts.errors import ConfigError
from asyncflow_core.contracts.protocols import InferenceEngine
from asyncflow_vllm.engine import VLLMEngine
from asyncflow_vllm.http import VLLMHTTPEngine

_log = logging.getLogger(__name__)


class _OwnedFolder(VLLMEngine):
    """A ``VLLMEngine`` that removes the model folder it was made from when it closes."""

    folder: Path | None = None

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            if self.folder is not None:
                shutil.rmtree(self.folder, ignore_errors=True)
                self.folder = None


async def vllm_rollout(model: Any, *, cfg: Any, index: int, threads: int) -> InferenceEngine:
    """Rollout engine ``index`` of the job: a client of ``rollout.url``'s ``index``-th server,
    else vLLM in this process serving ``model`` (module docstring)."""
    name = f"rollout-{index}"
    if cfg.rollout.process:
        raise ConfigError(
            "rollout.engine = 'vllm' runs its engine core in processes of its own: leave "
            "rollout.process off"
        )
    urls = cfg.rollout.urls()
    if urls:
        engine = VLLMHTTPEngine(urls[index], name=name)
        try:
            await engine.connect()
        except BaseException:
            await engine.close()
            raise
        served, trained = engine.facts.dtype, _dtype_of(model)
        if served is not None and trained is not None and served != trained:
            _log.warning(
                "%s: the server at %s computes in %s, the trainer in %s: the rollouts' "
                "log-probs will differ from the trainer's by that precision (start the server "
                "with --dtype %s to match)", name, urls[index], served, trained, trained,
            )  # fmt: skip
        return engine
    if not (callable(getattr(model, "save_pretrained", None)) and hasattr(model, "config")):
        raise ConfigError(
            f"rollout.engine = 'vllm' serves Hugging Face models, not {type(model).__name__}; "
            "use the workload's own engine (rollout.engine = 'auto') or an hf workload "
            "(model.path / model.name)"
        )
    folder = Path(tempfile.mkdtemp(prefix=f"asyncflow-vllm-{name}-"))
    try:
        model.save_pretrained(str(folder))
        local = await _OwnedFolder.create(
            str(folder),
            name=name,
            skip_tokenizer_init=True,
            enforce_eager=True,
            # vLLM's "auto" serves a float32 checkpoint in 16 bits (config/model.py,
            # _resolve_auto_dtype): the rollouts would sample from another policy than the
            # one the trainer scores
            dtype=_dtype_of(model) or "auto",
            seed=cfg.seed * 1000 + index,
            max_num_seqs=cfg.rollout.max_batch,
        )
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    assert isinstance(local, _OwnedFolder)
    local.folder = folder
    return local


def _dtype_of(model: Any) -> str | None:
    """The floating dtype of ``model``'s parameters (``float32``, ``bfloat16``, ...), or None."""
    parameters = getattr(model, "parameters", None)
    if not callable(parameters):
        return None
    for p in parameters():
        if isinstance(p, torch.Tensor) and p.is_floating_point():
            return str(p.dtype).removeprefix("torch.")
    return None


vllm_rollout.connects_to_servers = True  # type: ignore[attr-defined]  # rollout.url: its servers

__all__ = ["vllm_rollout"]
