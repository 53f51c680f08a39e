"""Moved to ``asyncflow_core.flow.agent`` (issue #26). This alias of the old path
goes in the next release: import from the new path, or from ``asyncflow_core``."""

import sys
import warnings
from typing import TYPE_CHECKING

from asyncflow_core.flow import agent as _moved

if TYPE_CHECKING:
    from asyncflow_core.flow.agent import *  # noqa: F403

warnings.warn(
    "asyncflow_core.agent moved to asyncflow_core.flow.agent; import from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
