"""The conformance suite works from outside the project: a throw-away backend and test file in
a temporary directory, run by a fresh ``python -m pytest -p asyncflow_conformance``. A correct
backend passes every law; a broken one fails named tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from asyncflow_conformance import make_datastore_state_machine
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import HypothesisException
from hypothesis.stateful import run_state_machine_as_test

pytestmark = pytest.mark.slow

# A backend written the way an outside author would: its own class, delegating to the
# in-process store only so that this test needs no second implementation. It takes no clock
# and offers no direct read, so the suite runs its real-time lease tests and skips the rest.
BACKEND = '''
from asyncflow_core.data.store import InProcessDataStore


class WrappedStore:
    """Every DataStore call forwarded to an InProcessDataStore."""

    def __init__(self) -> None:
        self._inner = InProcessDataStore(2)

    async def create_partition(self, name, fields, *, capacity=None):
        return await self._inner.create_partition(name, fields, capacity=capacity)

    async def register_task(self, partition, task):
        return await self._inner.register_task(partition, task)

    async def put(self, partition, data, **kwargs):
        return await self._inner.put(partition, data, **kwargs)

    async def get_meta(self, partition, task, fields, batch_size, *, ack=None, **kwargs):
        return await self._inner.get_meta(partition, task, fields, batch_size, ack=ack, **kwargs)

    async def get_data(self, meta, fields=None, **kwargs):
        return await self._inner.get_data(meta, fields, **kwargs)

    async def ack(self, meta):
        return await self._inner.ack(meta)

    async def nack(self, meta):
        return await self._inner.nack(meta)

    async def close(self, partition):
        return await self._inner.close(partition)

    async def delete_partition(self, partition):
        return await self._inner.delete_partition(partition)

    async def stats(self, partition):
        return await self._inner.stats(partition)


class AckForgetsStore(WrappedStore):
    """Broken: ack hands the rows back instead of committing them (they come again)."""

    async def ack(self, meta):
        return await self._inner.nack(meta)


class NackIgnoredStore(WrappedStore):
    """Broken: nack does nothing, so the rows stay leased until the lease ends."""

    async def nack(self, meta):
        return None


class OverwriteAlwaysStore(WrappedStore):
    """Broken: every put overwrites, so writing a ready cell twice is never rejected."""

    async def put(self, partition, data, **kwargs):
        kwargs["overwrite"] = True
        return await self._inner.put(partition, data, **kwargs)


class TornPutStore(WrappedStore):
    """Broken: a put of several fields is written one field at a time, so a put rejected on
    its second field has already written its first."""

    async def put(self, partition, data, *, rows=None, **kwargs):
        written = None
        for name, values in data.items():
            written = await self._inner.put(
                partition, {name: values}, rows=rows if rows is not None else written, **kwargs
            )
        return written
'''

TESTS = """
import pytest
from asyncflow_conformance import DataStoreConformance

import backend_under_test as backend


class TestWrappedStore(DataStoreConformance):
    backend_name = "WrappedStore"

    @pytest.fixture
    def store_factory(self):
        return getattr(backend, "{cls}")
"""

# Per conformance class: every law runs; without a fake clock, a virtual clock or direct
# read, five skip.
EXPECTED_SKIPPED = 5


def _write_project(root: Path, cls: str) -> Path:
    root.mkdir()
    (root / "backend_under_test.py").write_text(BACKEND)
    (root / "test_backend_conformance.py").write_text(TESTS.replace("{cls}", cls))
    return root


def _pytest(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("ASYNCFLOW_HYPOTHESIS_PROFILE", None)
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # only -p can bring the plugin in
    cmd = [sys.executable, "-m", "pytest", "-p", "asyncflow_conformance", "-p", "no:cacheprovider"]
    return subprocess.run(
        [*cmd, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def _expected_tests() -> int:
    """How many tests one DataStoreConformance subclass has (parametrized cases included)."""
    from asyncflow_conformance import DataStoreConformance

    total = 0
    for name in dir(DataStoreConformance):
        if not name.startswith("test_"):
            continue
        cases = 1
        for mark in getattr(getattr(DataStoreConformance, name), "pytestmark", []):
            if mark.name == "parametrize":
                cases *= len(mark.args[1])
        total += cases
    return total


def test_a_correct_backend_passes_from_outside(tmp_path: Path) -> None:
    project = _write_project(tmp_path / "good", "WrappedStore")
    run = _pytest(tmp_path, "-q", "-x", str(project), "--asyncflow-profile", "asyncflow-smoke")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    passed = _expected_tests() - EXPECTED_SKIPPED
    assert re.search(rf"\b{passed} passed, {EXPECTED_SKIPPED} skipped\b", out), out
    assert "DataStore backend WrappedStore [test_backend_conformance]: fake clock no" in out, out


def test_report_header_names_versions_and_profile(tmp_path: Path) -> None:
    project = _write_project(tmp_path / "good", "WrappedStore")
    run = _pytest(
        tmp_path, str(project), "--collect-only", "--asyncflow-profile", "asyncflow-smoke"
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    header = re.search(r"^asyncflow-conformance (\S+) \(asyncflow (\S+), hypothesis .*$", out, re.M)
    assert header, out
    assert "profile asyncflow-smoke (max_examples=10" in header.group(0)


def test_the_environment_variable_selects_a_profile(tmp_path: Path) -> None:
    project = _write_project(tmp_path / "good", "WrappedStore")
    env_run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(project), "--co"],
        cwd=tmp_path,
        env={**os.environ, "ASYNCFLOW_HYPOTHESIS_PROFILE": "thorough"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "profile thorough (max_examples=20000" in env_run.stdout, env_run.stdout
    bad = _pytest(tmp_path, str(project), "--co", "--asyncflow-profile", "nope")
    assert bad.returncode != 0
    assert "unknown asyncflow hypothesis profile 'nope'" in bad.stdout + bad.stderr


@pytest.mark.parametrize(
    "backend", ["AckForgetsStore", "NackIgnoredStore", "OverwriteAlwaysStore", "TornPutStore"]
)
def test_the_state_machine_catches_a_broken_backend(backend: str) -> None:
    """The machine alone (no law test) finds each broken store, deterministically."""
    module = types.ModuleType("backend_under_test")
    exec(compile(BACKEND, "backend_under_test.py", "exec"), module.__dict__)
    machine = make_datastore_state_machine(getattr(module, backend), name=f"{backend}Machine")
    quick = settings(
        max_examples=300,
        stateful_step_count=25,
        phases=[Phase.generate],  # report the first failure; do not spend time shrinking it
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    with pytest.raises(Exception) as caught:
        run_state_machine_as_test(machine, settings=quick)
    assert not isinstance(caught.value, HypothesisException), caught.value


@pytest.mark.parametrize(
    ("backend", "must_fail"),
    [
        ("AckForgetsStore", "test_ack_commits_rows"),
        ("TornPutStore", "test_unknown_field_is_rejected[put]"),
        ("OverwriteAlwaysStore", "test_writing_a_ready_cell_twice_is_rejected"),
    ],
)
def test_a_broken_backend_is_caught(tmp_path: Path, backend: str, must_fail: str) -> None:
    project = _write_project(tmp_path / "broken", backend)
    run = _pytest(
        tmp_path, "-q", str(project), "--asyncflow-profile", "asyncflow-smoke", "-k", must_fail
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    failed = f"FAILED broken/test_backend_conformance.py::TestWrappedStore::{must_fail}"
    assert failed in out, out
