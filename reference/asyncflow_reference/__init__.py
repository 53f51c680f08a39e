"""Reference engines: simulated engines with a cost model (``sim``) and named simulator
workloads (``presets``)."""

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
    "SimInferenceEngine",
    "SimPreset",
    "SimTrainEngine",
    "SimWeightTransport",
    "balanced_split",
    "get_preset",
]
