"""Make ``examples/`` importable, so the tests use the engines of ``examples/custom_engine.py``
(the file the guide walks through) rather than a copy."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
