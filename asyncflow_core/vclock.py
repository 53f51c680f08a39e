"""Moved to ``asyncflow_core.flow.vclock`` (issue #26). This alias of the old path
goes in the next release: import from the new path, or from ``asyncflow_core``."""

import sys
import warnings
from typing import TYPE_CHECKING

from asyncflow_core.flow import vclock as _moved

if TYPE_CHECKING:
    from asyncflow_core.flow.vclock import *  # noqa: F403

warnings.warn(
    "asyncflow_core.vclock moved to asyncflow_core.flow.vclock; import from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
