"""Split into ``asyncflow_core.sync.transports`` and ``asyncflow_core.sync.strategies``
(issue #26). This module re-exports both for one release: import from the new paths, or from
``asyncflow_core``."""

import warnings

from asyncflow_core.sync.strategies import *  # noqa: F403
from asyncflow_core.sync.transports import *  # noqa: F403

warnings.warn(
    "asyncflow_core.weightsync moved to asyncflow_core.sync.transports (the transports) and "
    "asyncflow_core.sync.strategies (BlockingUpdate, StagedUpdate, HostBuffer, SyncTiming); "
    "import from there",
    DeprecationWarning,
    stacklevel=2,
)
