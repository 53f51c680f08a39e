"""Moved to ``asyncflow_core.infra.httpclient`` (issue #26). This alias of the old path
goes in the next release: import from the new path, or from ``asyncflow_core``."""

import sys
import warnings
from typing import TYPE_CHECKING

from asyncflow_core.infra import httpclient as _moved

if TYPE_CHECKING:
    from asyncflow_core.infra.httpclient import *  # noqa: F403

warnings.warn(
    "asyncflow_core.httpclient moved to asyncflow_core.infra.httpclient; import from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
