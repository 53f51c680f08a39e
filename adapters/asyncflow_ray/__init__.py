"""AsyncFlow on a Ray cluster: the same pipeline, with the store and the engines spread over
nodes.

* ``RayRuntime``: connect to a cluster (``ray start --head`` / ``--address``) or start a local
  one, and shut it down leaving no process behind.
* ``RayDataStore``: the DataStore as a controller actor plus storage-unit actors placed across
  nodes; clients read and write the units directly, tensors through Ray's object store.
* ``RayInferenceEngine`` / ``RayTrainEngine``: any engine in an actor, placed by its
  platform's Ray resource (CPU / GPU / NPU), behind the same protocols.
* ``RayDirectWeightSync``: a staged weight sync from the trainer's actor straight to the
  rollout actors over a collective group of their own (the driver only says when).

Ray is imported when one of these is used, never at import: without the ``[ray]`` extra the
error names it.
"""

from asyncflow_ray.engines import RayInferenceEngine, RayTrainEngine, WorkerLostError
from asyncflow_ray.runtime import INSTALL, TESTED, NodeInfo, RayRuntime, ray_runtime, resources_for
from asyncflow_ray.store import PackedColumn, RayDataStore, UnitPlacement
from asyncflow_ray.weightsync import RayDirectWeightSync

__all__ = [
    "INSTALL",
    "TESTED",
    "NodeInfo",
    "PackedColumn",
    "RayDataStore",
    "RayDirectWeightSync",
    "RayInferenceEngine",
    "RayRuntime",
    "RayTrainEngine",
    "UnitPlacement",
    "WorkerLostError",
    "ray_runtime",
    "resources_for",
]
