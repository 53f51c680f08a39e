"""Conformance suite for AsyncFlow backends: pytest classes to subclass, hypothesis state
machines, and a pytest plugin (``-p asyncflow_conformance``) for profiles and report headers.

Names are imported lazily: pytest imports this package in every run (it holds the plugin), so
importing it must not pull in torch or hypothesis.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncflow_conformance.agent import AgentLoopConformance, ChatFormatConformance
    from asyncflow_conformance.datastore import DataStoreConformance, FakeClock, StoreFactory
    from asyncflow_conformance.engines import (
        InferenceEngineConformance,
        TrainEngineConformance,
        WeightSyncConformance,
    )
    from asyncflow_conformance.pair import EnginePairConformance
    from asyncflow_conformance.scheduler import SchedulerConformance
    from asyncflow_conformance.stateful import (
        DataStoreStateMachine,
        make_datastore_state_machine,
    )
    from asyncflow_conformance.workflow import WorkflowCase, WorkflowConformance

_EXPORTS = {
    "AgentLoopConformance": "asyncflow_conformance.agent",
    "ChatFormatConformance": "asyncflow_conformance.agent",
    "DataStoreConformance": "asyncflow_conformance.datastore",
    "FakeClock": "asyncflow_conformance.datastore",
    "StoreFactory": "asyncflow_conformance.datastore",
    "InferenceEngineConformance": "asyncflow_conformance.engines",
    "TrainEngineConformance": "asyncflow_conformance.engines",
    "WeightSyncConformance": "asyncflow_conformance.engines",
    "EnginePairConformance": "asyncflow_conformance.pair",
    "DataStoreStateMachine": "asyncflow_conformance.stateful",
    "make_datastore_state_machine": "asyncflow_conformance.stateful",
    "SchedulerConformance": "asyncflow_conformance.scheduler",
    "WorkflowCase": "asyncflow_conformance.workflow",
    "WorkflowConformance": "asyncflow_conformance.workflow",
}

__all__ = [
    "AgentLoopConformance",
    "ChatFormatConformance",
    "DataStoreConformance",
    "DataStoreStateMachine",
    "EnginePairConformance",
    "FakeClock",
    "InferenceEngineConformance",
    "SchedulerConformance",
    "StoreFactory",
    "TrainEngineConformance",
    "WeightSyncConformance",
    "WorkflowCase",
    "WorkflowConformance",
    "make_datastore_state_machine",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
