"""The Hugging Face engines together: ``HFTrainEngine`` and ``HFInferenceEngine`` must agree on
every log-prob after a sync (the pair suite), weights must travel between them byte-equal
(the weight-sync suite), and real RL jobs on them must keep the workflow's laws."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from asyncflow_conformance import (
    EnginePairConformance,
    WeightSyncConformance,
    WorkflowConformance,
)
from asyncflow_conformance.workflow import DEFAULT_CASES
from asyncflow_hf.inference import HFInferenceEngine
from asyncflow_hf.models import load_causal_lm, tiny_config
from asyncflow_hf.train import HFTrainEngine

from asyncflow_core.engines.lmtrain import unique_named_tensors
from asyncflow_core.flow.rlflow import RLEngines
from asyncflow_core.sync.transports import InProcessWeightSync

VOCAB = 64
_MODELS: dict[str, Any] = {}


def tiny_model(name: str, seed: int) -> Any:
    key = f"{name}/{seed}"
    if key not in _MODELS:
        _MODELS[key] = load_causal_lm(tiny_config(name, vocab_size=VOCAB), who="test", seed=seed)
    return _MODELS[key]


class TestHFPairQwen2(EnginePairConformance):
    """Qwen2, tied embeddings: the engine starts from other weights than the trainer's, so
    the laws' sync is what makes them agree."""

    vocab_size = VOCAB
    model_name = "tiny-qwen2"
    real_timeout_s = 120.0

    def make_inference(self) -> HFInferenceEngine:
        return HFInferenceEngine(tiny_model(self.model_name, 0), eos_token_ids=(), threads=1)

    def make_trainer(self) -> HFTrainEngine:
        return HFTrainEngine(tiny_model(self.model_name, 1), lr=1e-2, micro_batch_size=5)

    async def close_engine(self, engine: Any) -> None:
        await engine.close()


class TestHFPairLlama(TestHFPairQwen2):
    model_name = "tiny-llama"


class TestHFWeightSync(WeightSyncConformance):
    """HF names from the trainer into two continuous-batching engines, byte-equal."""

    bucket_bytes = 64 << 10
    real_timeout_s = 120.0

    def make_source(self) -> HFTrainEngine:
        return HFTrainEngine(tiny_model("tiny-qwen2", 1))

    def make_targets(self) -> list[HFInferenceEngine]:
        model = tiny_model("tiny-qwen2", 0)
        return [HFInferenceEngine(model, eos_token_ids=(), threads=1) for _ in range(2)]

    def make_sync(self, targets: Sequence[Any]) -> InProcessWeightSync:
        return InProcessWeightSync(targets)

    def target_weights(self, engine: Any) -> Mapping[str, torch.Tensor]:
        return dict(unique_named_tensors(engine.model))


class TestHFWorkflow(WorkflowConformance):
    """Real RL jobs on the HF engines (two rollout engines, a trainer), on a plain event loop:
    colocated, and asynchronous with staged and in-flight syncs and partial rollout (a subset
    of the default cases, to keep CI short; every case runs on the other backends)."""

    virtual_clock = False
    steps = 4
    max_tokens = 8
    real_timeout_s = 180.0
    cases = tuple(
        c
        for c in DEFAULT_CASES
        if c.id in ("colocated-eta0-blocking", "eta1-inflight", "eta3-sync2-staged-partial")
    )

    def make_engines(self) -> RLEngines:
        model = tiny_model("tiny-qwen2", 0)
        rollout = [HFInferenceEngine(model, eos_token_ids=(), threads=1) for _ in range(2)]
        return RLEngines(rollout=rollout, trainer=HFTrainEngine(model, lr=1e-3))


# --- planted wrong loads: the verification law fails each (issue #40) ------------------------
class _SkipsTheNorm(HFInferenceEngine):
    """Drops the final norm from every load (a name-mapping bug)."""

    async def load_weights(self, weights: Sequence[tuple[str, torch.Tensor]], version: int) -> None:
        await super().load_weights(
            [(n, t) for n, t in weights if n != "model.norm.weight"], version
        )


class _BreaksTheTie(HFInferenceEngine):
    """Gives the LM head a tensor of its own before loading: the tied head keeps old values."""

    async def load_weights(self, weights: Sequence[tuple[str, torch.Tensor]], version: int) -> None:
        head = self.model.get_output_embeddings()
        head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        await super().load_weights(weights, version)


@pytest.mark.parametrize(
    ("engine_cls", "names"),
    [(_SkipsTheNorm, "'model.norm.weight'"), (_BreaksTheTie, "'lm_head.weight' \\(tied to")],
    ids=["skips-the-norm", "breaks-the-tie"],
)
def test_the_verification_law_fails_a_planted_wrong_load(engine_cls: type, names: str) -> None:
    class Planted(TestHFPairQwen2):
        def make_inference(self) -> HFInferenceEngine:
            return engine_cls(tiny_model(self.model_name, 0), eos_token_ids=(), threads=1)

    with pytest.raises(AssertionError, match=names):
        Planted().test_a_sync_is_verified_against_the_engines_own_weights()
