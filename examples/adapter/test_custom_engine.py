"""The conformance suites on the example adapter (examples/custom_engine.py):

    pytest -p asyncflow_conformance examples/adapter

One class per protocol, the engine pair's laws (the trainer's log-probs of the engine's tokens
equal the engine's, under every sampling setting), and the RL workflow's laws. Skipped laws say
why (this engine has no ``sleep``/``wake_up``); nothing else may be skipped.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from asyncflow_conformance import (
    EnginePairConformance,
    InferenceEngineConformance,
    TrainEngineConformance,
    WeightSyncConformance,
    WorkflowConformance,
)
from custom_engine import VOCAB, BigramInferenceEngine, BigramLM, BigramTrainEngine

from asyncflow_core import InProcessWeightSync
from asyncflow_core.flow.rlflow import RLEngines


class TestBigramInferenceEngine(InferenceEngineConformance):
    vocab_size = VOCAB
    real_timeout_s = 120.0

    def make_engine(self) -> BigramInferenceEngine:
        return BigramInferenceEngine(seed=0)

    def weights_for_load(self, engine: Any) -> Sequence[tuple[str, torch.Tensor]]:
        return list(BigramLM(VOCAB, seed=1).state_dict().items())  # real, different tensors


class TestBigramTrainEngine(TrainEngineConformance):
    vocab_size = VOCAB
    required_fields = ("prompt", "response", "advantage")  # the loss rejects a missing advantage

    def make_engine(self) -> BigramTrainEngine:
        return BigramTrainEngine(seed=0, micro_batch_size=2)  # 2 micro-batches per default batch

    def expected_parameters(self, engine: Any) -> Mapping[str, Sequence[int]]:
        return {"table": (VOCAB, VOCAB)}


class TestBigramWeightSync(WeightSyncConformance):
    def make_source(self) -> BigramTrainEngine:
        return BigramTrainEngine(seed=1)

    def make_targets(self) -> list[BigramInferenceEngine]:
        return [BigramInferenceEngine(seed=0, name=f"target-{i}") for i in range(2)]

    def make_sync(self, targets: Sequence[Any]) -> InProcessWeightSync:
        return InProcessWeightSync(targets)

    def target_weights(self, engine: Any) -> Mapping[str, torch.Tensor]:
        return dict(engine.model.state_dict())


class TestBigramPair(EnginePairConformance):
    vocab_size = VOCAB

    def make_inference(self) -> BigramInferenceEngine:
        return BigramInferenceEngine(seed=0)

    def make_trainer(self) -> BigramTrainEngine:
        return BigramTrainEngine(seed=1)  # other weights: the laws sync them first


class TestBigramEnginesWorkflow(WorkflowConformance):
    virtual_clock = False  # real engines on a plain event loop

    def make_engines(self) -> RLEngines:
        rollout = [BigramInferenceEngine(seed=0, name=f"rollout-{i}") for i in range(2)]
        return RLEngines(rollout, BigramTrainEngine(seed=0))

    def prompts(self) -> Iterable[Sequence[int]]:
        return ((1 + i % (VOCAB - 1), 1 + (i * 7) % (VOCAB - 1)) for i in itertools.count())
