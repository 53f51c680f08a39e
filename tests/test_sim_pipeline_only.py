"""benchmarks/pipeline.py --only: which runs a MODEL:DEVICES[:MODE] list names, and the clear
error a bad item gets (exit 2, naming the item) before anything runs."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from asyncflow_core.contracts.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def _pipeline() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "pipeline_bench", ROOT / "benchmarks" / "pipeline.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_only_names_table_runs() -> None:
    parse = _pipeline().parse_only
    assert parse("7B:1024") == [
        ("qwen2.5-7b-grpo", 1024, None, "colocated", 0),
        ("qwen2.5-7b-grpo", 1024, None, "async", 1),
    ]
    assert parse("7b:1024:async, qwen2.5-32b-grpo:64:colocated") == [
        ("qwen2.5-7b-grpo", 1024, None, "async", 1),
        ("qwen2.5-32b-grpo", 64, None, "colocated", 0),
    ]
    assert parse("7B:256:ray") == [("qwen2.5-7b-grpo", 256, None, "ray", 1)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("7B", "is not MODEL:DEVICES"),
        ("7B:many", "DEVICES must be an int"),
        ("7B:64:sync", "MODE must be colocated, async or ray"),
        (",", "names no run"),
    ],
)
def test_only_refuses_a_bad_item(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _pipeline().parse_only(text)


def test_only_refuses_an_unknown_preset() -> None:
    with pytest.raises(ConfigError, match="9B"):
        _pipeline().parse_only("9B:32")


def test_only_exits_2_naming_the_item() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "pipeline.py"), "--only", "7B:x"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "'7B:x'" in proc.stderr and "DEVICES must be an int" in proc.stderr
