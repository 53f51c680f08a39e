"""Moved to ``asyncflow_core.sync.weightsync`` (issue #26). This alias of the old path
goes in the next release: import from the new path, or from ``asyncflow_core``."""

import sys
import warnings
from typing import TYPE_CHECKING

from asyncflow_core.sync import weightsync as _moved

if TYPE_CHECKING:
    from asyncflow_core.sync.weightsync import *  # noqa: F403

warnings.warn(
    "asyncflow_core.weightsync moved to asyncflow_core.sync.weightsync; import from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
