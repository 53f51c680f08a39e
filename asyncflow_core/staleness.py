"""Moved to ``asyncflow_core.flow.staleness`` (issue #26). This alias of the old path
goes in the next release: import from the new path, or from ``asyncflow_core``."""

import sys
import warnings
from typing import TYPE_CHECKING

from asyncflow_core.flow import staleness as _moved

if TYPE_CHECKING:
    from asyncflow_core.flow.staleness import *  # noqa: F403

warnings.warn(
    "asyncflow_core.staleness moved to asyncflow_core.flow.staleness; import from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
