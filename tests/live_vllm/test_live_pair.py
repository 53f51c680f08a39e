"""The engine pair, weight sync and workflow suites on a real vLLM, with ``HFTrainEngine`` (on
the vLLM environment's transformers 5.19) as the trainer: after a sync the trainer's log-probs
of vLLM's tokens equal vLLM's (greedy, temperature, top-k, top-p, resumed requests, the loss);
weights arrive byte-equal at the worker; real RL jobs keep the workflow's laws. On both tiny
models: the tied Qwen2 behind ``vllm serve`` (``VLLMHTTPEngine``, the bytes over
``/collective_rpc``), the untied Llama in process (``VLLMEngine``, over the msgpack link).
On a CPU the weights go through ``load_weights`` (the worker extension); vLLM's NCCL group is
declared unavailable and its class skips with that reason."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import live
import pytest
import torch
from asyncflow_conformance import (
    EnginePairConformance,
    WeightSyncConformance,
    WorkflowConformance,
)
from asyncflow_conformance.workflow import DEFAULT_CASES
from asyncflow_hf.train import HFTrainEngine
from asyncflow_vllm import VLLMHTTPEngine, VLLMWeightSync

from asyncflow_core.engines.process import free_port
from asyncflow_core.flow.rlflow import RLEngines
from asyncflow_core.sync.transports import InProcessWeightSync


class _OnServer:
    """The tied Qwen2 behind the shared ``vllm serve``: a fresh client per law."""

    key = "qwen2"
    timeout_s = 120.0
    real_timeout_s = 600.0

    @classmethod
    def setup_class(cls) -> None:
        cls.url = live.server(cls.key).url
        cls.vocab_size = live.vocab_size(cls.key)

    async def inference(self) -> Any:
        engine = VLLMHTTPEngine(self.url, ignore_eos=True)
        await engine.connect()
        return engine

    def trainer(self, **kw: Any) -> HFTrainEngine:
        return HFTrainEngine(str(live.model_folder(self.key)), **kw)

    async def close_engine(self, engine: Any) -> None:
        await live.reset(engine)


class _InProcess(_OnServer):
    """The untied Llama in the shared in-process ``AsyncLLM``."""

    key = "llama"

    @classmethod
    def setup_class(cls) -> None:
        cls.host = live.host(cls.key)
        cls.vocab_size = live.vocab_size(cls.key)

    async def inference(self) -> Any:
        return self.host.proxy()

    def progress(self, engine: Any) -> Any:
        return engine.streamed_tokens  # the deltas streamed so far (the in-flight pair law)


# --- the pair: log-prob agreement after a sync ----------------------------------------------
class TestLivePairQwen2OverHTTP(_OnServer, EnginePairConformance):
    def make_inference(self) -> Any:
        return self.inference()

    def make_trainer(self) -> HFTrainEngine:
        return self.trainer(lr=1e-2, micro_batch_size=5)


class TestLivePairLlamaInProcess(_InProcess, TestLivePairQwen2OverHTTP):
    pass


# --- weight sync: bytes arrive whole --------------------------------------------------------
class TestLiveWeightSyncQwen2OverHTTP(_OnServer, WeightSyncConformance):
    """``InProcessWeightSync`` (``load_weights``: the worker extension's pieces) into vLLM;
    what the worker handed vLLM's loaders is read back (vLLM's CPU kernels keep linear
    weights packed, unreadable in the model: that the model computes with them is the pair
    suite's law)."""

    bucket_bytes = 256 << 10

    def make_source(self) -> HFTrainEngine:
        return self.trainer()

    async def make_targets(self) -> list[Any]:
        engine = await self.inference()
        await live.keep_loads(engine)
        return [engine]

    def make_sync(self, targets: Sequence[Any]) -> InProcessWeightSync:
        return InProcessWeightSync(targets)

    def target_weights(self, engine: Any) -> Mapping[str, torch.Tensor]:
        return live.kept_load(engine)


class TestLiveWeightSyncLlamaInProcess(_InProcess, TestLiveWeightSyncQwen2OverHTTP):
    pass


class TestLiveNcclWeightSync(_OnServer, WeightSyncConformance):
    """vLLM's own weight group (NCCL): declared unavailable on a CPU, so every law skips with
    the engine's reason (a GPU runs it: ``VLLMWeightSync``)."""

    def make_source(self) -> HFTrainEngine:
        return self.trainer()

    async def make_targets(self) -> list[Any]:
        return [await self.inference()]

    def make_sync(self, targets: Sequence[Any]) -> Any:
        live.require_ability(targets[0], "GroupReceiver")
        return VLLMWeightSync(targets, master_address="127.0.0.1", master_port=free_port())


# --- the workflow: real RL jobs on vLLM -----------------------------------------------------
LIVE_CASES = tuple(
    c
    for c in DEFAULT_CASES
    if c.id in ("colocated-eta0-blocking", "eta1-staged", "eta3-sync2-staged-partial")
)
"""Colocated, async with a staged sync, and async with partial rollout; ``inflight`` is
refused for vLLM by the job (it cannot load while it generates)."""


class TestLiveWorkflowInProcess(_InProcess, WorkflowConformance):
    virtual_clock = False
    steps = 4
    max_tokens = 8
    real_timeout_s = 300.0
    cases = LIVE_CASES

    def make_engines(self) -> RLEngines:
        """The shared engine as a fresh one would be: the model's own weights at version 0
        (a job syncs an engine at another version first, which the laws would count)."""
        engine = self.host.proxy()
        self.host.run(self.host.engine.load_weights(live.checkpoint(self.key), 0))
        return RLEngines(
            rollout=[engine],
            trainer=HFTrainEngine(str(live.model_folder(self.key)), lr=1e-3),
        )


# --- verified sync: the probe catches a planted wrong load ----------------------------------
class SkipsTensors:
    """The shared engine behind a load that drops every tensor ``skip(name)`` selects (a
    name-mapping bug): vLLM keeps those old values and reports the new version."""

    def __init__(self, engine: Any, skip: Any) -> None:
        self._engine = engine
        self._skip = skip

    async def load_weights(self, weights: Sequence[tuple[str, torch.Tensor]], version: int) -> None:
        await self._engine.load_weights([(n, t) for n, t in weights if not self._skip(n)], version)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


PROBE_FAILS = "probe's log-probs differ"
PLANTED = {
    # the untied Llama in process: its LM head
    "llama-skips-the-head": (
        TestLivePairLlamaInProcess,
        lambda n: n == "lm_head.weight",
        PROBE_FAILS,
    ),
    # the k shard of every stacked qkv_proj: the worker extension refuses the partial layer
    # before anything changes (vLLM would fill the rest with uninitialised memory), so the
    # wrong load never lands for the check to see
    "llama-skips-the-k-shards": (
        TestLivePairLlamaInProcess,
        lambda n: ".k_proj." in n,
        "a layer must be loaded whole",
    ),
    # the tied Qwen2 over HTTP: its embedding, which is also its LM head
    "qwen2-skips-the-tied-embedding": (
        TestLivePairQwen2OverHTTP,
        lambda n: n == "model.embed_tokens.weight",
        PROBE_FAILS,
    ),
}


@pytest.mark.parametrize("planted", sorted(PLANTED))
def test_the_verification_law_catches_a_planted_wrong_load_on_live_vllm(planted: str) -> None:
    """The pair suite's verification law on the real vLLM (the probe: vLLM's CPU build keeps
    no readable linear weights) passes with the engine's own load (the classes above) and
    fails each planted load: by the probe's log-probs, or, for a partial stacked layer, at
    the load itself."""
    from asyncflow_core.contracts.errors import EngineError

    base, skip, caught = PLANTED[planted]

    async def make(self: Any) -> Any:
        return SkipsTensors(await base.inference(self), skip)

    suite = type("Planted", (base,), {"make_inference": make})()
    suite.setup_class()
    with pytest.raises((AssertionError, EngineError), match=caught):
        suite.test_a_sync_is_verified_against_the_engines_own_weights()
