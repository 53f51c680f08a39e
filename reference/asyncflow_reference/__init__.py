"""Reference engines: simulated engines with a cost model (``sim``), named simulator
workloads (``presets``), and pure-PyTorch engines for a small transformer (``model``,
``engines``)."""

from asyncflow_reference.engines import TorchInferenceEngine, TorchTrainEngine
from asyncflow_reference.model import KVCache, ModelConfig, TransformerLM
from asyncflow_reference.presets import PRESETS, SimPreset, balanced_split, get_preset
from asyncflow_reference.sim import (
    SOURCES,
    CostModel,
    SimInferenceEngine,
    SimTrainEngine,
    SimWeightTransport,
)

__all__ = [
    "PRESETS",
    "SOURCES",
    "CostModel",
    "KVCache",
    "ModelConfig",
    "SimInferenceEngine",
    "SimPreset",
    "SimTrainEngine",
    "SimWeightTransport",
    "TorchInferenceEngine",
    "TorchTrainEngine",
    "TransformerLM",
    "balanced_split",
    "get_preset",
]
