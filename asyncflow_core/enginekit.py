"""Moved to ``asyncflow_core.engines.enginekit`` (issue #26). This alias of the old path
goes in the next release: import from the new path, or from ``asyncflow_core``."""

import sys
import warnings
from typing import TYPE_CHECKING

from asyncflow_core.engines import enginekit as _moved

if TYPE_CHECKING:
    from asyncflow_core.engines.enginekit import *  # noqa: F403

warnings.warn(
    "asyncflow_core.enginekit moved to asyncflow_core.engines.enginekit; import from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
