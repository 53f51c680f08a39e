"""The mutation tool (tools/mutation.py) end to end on two fixed mutants, and its verdict rules.

The two mutants are picked by what they change, not by number (a number moves when the file
changes): one the train-engine laws must kill (``weight_version`` adds 2 per step), one in code
no law runs (``DiskWeightSync._prune``: no conformance class runs the disk transport), which must
come out survived, so the tool can fail. The run also proves its sanity mutants were killed (the
tests ran the mutated copy) and that the repo's own files were left as they were.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("cosmic_ray", reason="the [mutation] extra (cosmic-ray) is not installed")

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "mutation.py"
LMTRAIN = "asyncflow_core/engines/lmtrain.py"
TRANSPORTS = "asyncflow_core/sync/transports.py"
TRAIN_LAWS = "tests/test_engine_conformance.py::TestTorchTrainEngine"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("asyncflow_mutation_tool", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _catalogue() -> list[dict[str, Any]]:
    listed = subprocess.run(
        [sys.executable, str(TOOL), "--list", "--files", LMTRAIN, TRANSPORTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return [json.loads(line) for line in listed.stdout.splitlines()]


def _pick(mutants: list[dict[str, Any]], **want: str) -> str:
    found = [m for m in mutants if all(m[k] == v for k, v in want.items())]
    assert found, f"no mutant {want}: the code moved; pick another one like it"
    return str(min(found, key=lambda m: m["occurrence"])["id"])


@pytest.mark.slow
def test_fixed_mutants_get_their_verdicts(tmp_path: Path) -> None:
    mutants = _catalogue()
    killed = _pick(
        mutants,
        definition="AdamWTrainer._train_step",
        text="self._version += 1",
        operator="core/NumberReplacer",
    )
    survived = _pick(
        mutants, definition="DiskWeightSync._prune", operator="core/ReplaceBinaryOperator_Div_Mul"
    )
    before = {f: hashlib.sha256((ROOT / f).read_bytes()).hexdigest() for f in (LMTRAIN, TRANSPORTS)}
    out = tmp_path / "report"
    run = subprocess.run(
        [
            *(sys.executable, str(TOOL), "--jobs", "2", "--timeout", "240"),
            *("--files", LMTRAIN, TRANSPORTS, "--tests", TRAIN_LAWS),
            *("--ids", killed, survived, "--out", str(out)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.splitlines()[-1])
    assert (summary["sampled"], summary["killed"], summary["survived"]) == (2, 1, 1), run.stderr
    for file in (LMTRAIN, TRANSPORTS):
        assert f"sanity mutant {file}:sanity:" in run.stderr and "killed" in run.stderr

    report = json.loads(out.with_suffix(".json").read_text())
    verdicts = {m["id"]: m for m in report["mutants"]}
    assert verdicts[killed]["verdict"] == "killed"
    assert verdicts[killed]["laws"] == {"engines.py": "killed"}
    assert all(f["law"].startswith("TrainEngineConformance.") for f in verdicts[killed]["failures"])
    assert verdicts[survived]["verdict"] == "survived", verdicts[survived]
    assert verdicts[survived]["laws"] == {"engines.py": "survived"}
    diff = verdicts[survived]["diff"]
    assert any(line.startswith("+") and "p * MANIFEST" in line for line in diff), diff
    assert f"`{survived}`" in out.with_suffix(".md").read_text()  # listed for classification
    after = {f: hashlib.sha256((ROOT / f).read_bytes()).hexdigest() for f in (LMTRAIN, TRANSPORTS)}
    assert after == before  # mutated in the copies only


# --------------------------------------------------------------------------------------------
# The verdict rules on made-up runs (no subprocess)
# --------------------------------------------------------------------------------------------
def _run(tool: ModuleType, *tests: Any, **changes: Any) -> Any:
    fields: dict[str, Any] = {
        "rc": 0,
        "killed_at_timeout": False,
        "wall_s": 1.0,
        "tests": list(tests),
        "started": [(t.nodeid, t.law_file, t.law) for t in tests],
        "reached": {},
        "outside": [],
        "collect_errors": [],
        "finished": True,
        "log_tail": "",
    }
    fields.update(changes)
    return tool.Run(**fields)


def test_verdict_rules() -> None:
    tool = _tool()
    judge, Test = tool.judge, tool.TestResult
    passed = Test("t::a", "passed", "engines.py", "L.a")
    failed = Test("t::b", "failed", "pair.py", "P.b", "AssertionError")
    hung = Test("t::c", "timeout", "agent.py", "A.c", "Failed: Timeout >9s")
    mutated = Path("/copy/asyncflow_core/sync/transports.py")

    v = judge(_run(tool, passed), ["engines.py"], mutated)
    assert (v.verdict, v.laws) == ("survived", {"engines.py": "survived"})
    v = judge(_run(tool, passed, failed, rc=1), ["engines.py", "pair.py"], mutated)
    assert (v.verdict, v.laws) == ("killed", {"engines.py": "survived", "pair.py": "killed"})
    v = judge(_run(tool, passed, hung, rc=1), ["engines.py", "agent.py"], mutated)
    assert (v.verdict, v.laws["agent.py"]) == ("timed-out", "timed-out")
    # killed by the outer timeout in a test: timed-out, unless a law had already failed
    stuck = {"started": [("t::a", "engines.py", "L.a"), ("t::d", "pair.py", "P.d")]}
    v = judge(
        _run(tool, passed, rc=-9, killed_at_timeout=True, finished=False, **stuck),
        ["engines.py", "pair.py", "agent.py"],
        mutated,
    )
    assert (v.verdict, v.laws) == (
        "timed-out",
        {"engines.py": "survived", "pair.py": "timed-out", "agent.py": "timed-out"},
    )
    v = judge(
        _run(tool, failed, rc=-9, killed_at_timeout=True, finished=False), ["pair.py"], mutated
    )
    assert v.verdict == "killed"
    # the process died inside a law (not a timeout): that law killed it
    v = judge(_run(tool, rc=-11, finished=False, started=[("t::e", "pair.py", "P.e")]), [], None)
    assert (v.verdict, v.laws) == ("killed", {"pair.py": "killed"})
    # collection: the mutated file failed to import (killed), or something else did (error)
    broken = [f"tests/x.py: ImportError in {mutated}"]
    v = judge(_run(tool, rc=2, collect_errors=broken), ["engines.py"], mutated)
    assert (v.verdict, v.laws) == ("killed", {"(import)": "killed"})
    other = ["tests/x.py: ModuleNotFoundError: no module named 'openai'"]
    v = judge(_run(tool, rc=2, collect_errors=other), ["engines.py"], mutated)
    assert (v.verdict, v.laws) == ("error", {"engines.py": "error"})
    v = judge(_run(tool, passed, outside=["asyncflow_core from /repo"]), ["engines.py"], mutated)
    assert v.verdict == "error"
    v = judge(_run(tool, rc=5), ["engines.py"], mutated)
    assert v.verdict == "error"  # nothing ran: never a survivor


def test_the_provenance_check_names_modules_from_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncflow_core.sync.transports  # noqa: F401 (loaded from the repo, not tmp_path)

    tool = _tool()
    monkeypatch.setenv(tool.COPY_ENV, str(tmp_path))
    modules, outside = tool._outside_the_copy()
    assert "asyncflow_core.sync.transports" in modules
    assert any(o.startswith("asyncflow_core.sync.transports from ") for o in outside)
    monkeypatch.setenv(tool.COPY_ENV, str(ROOT))
    assert "asyncflow_core.sync.transports" not in str(tool._outside_the_copy()[1])
