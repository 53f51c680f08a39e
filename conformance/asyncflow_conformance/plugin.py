"""The pytest plugin of the conformance suite: markers, hypothesis profiles, report header.

pytest loads this module in every run of every project where the package is installed (entry
point ``pytest11``), so it imports nothing heavy: hypothesis, torch and asyncflow are imported
only when a conformance test asks for its settings, or when the header is printed.

Profiles (``--asyncflow-profile NAME`` or ``ASYNCFLOW_HYPOTHESIS_PROFILE=NAME``; the option
wins, the default is ``asyncflow-ci``) size the suite's hypothesis tests, above all the
DataStore state machine. They are applied to the suite's own tests only, never loaded as
hypothesis' global default, so they cannot change anybody else's hypothesis tests.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytest
    from hypothesis import settings as HypothesisSettings

ENV_VAR = "ASYNCFLOW_HYPOTHESIS_PROFILE"
OPTION = "--asyncflow-profile"
DEFAULT_PROFILE = "asyncflow-ci"

PROFILES: Mapping[str, Mapping[str, Any]] = {
    # A quick look: every law once, a handful of state-machine runs, failures reported as
    # found, without shrinking (seconds).
    "asyncflow-smoke": {
        "max_examples": 10,
        "stateful_step_count": 15,
        "database": None,
        "phases": ("explicit", "reuse", "generate"),
    },
    # CI: each DataStore backend runs the state machine this many times; the in-project run
    # (three in-process configurations) totals >= 2,000 state-machine examples.
    "asyncflow-ci": {"max_examples": 700, "stateful_step_count": 25},
    # Before a release or after touching a backend's concurrency: hours, not minutes.
    "thorough": {"max_examples": 20_000, "stateful_step_count": 50},
}
"""Hypothesis settings per profile name (every profile also has ``deadline=None``)."""

_selected: str | None = None  # set by pytest_configure; None outside a pytest run


def selected_profile() -> str:
    """The profile name for this run: the command line option, else the environment
    variable, else ``asyncflow-ci``."""
    name = _selected or os.environ.get(ENV_VAR) or DEFAULT_PROFILE
    _check_name(name)
    return name


def register_profiles() -> None:
    """Register every profile with hypothesis (safe to repeat)."""
    from hypothesis import HealthCheck, Phase, settings

    base = settings.get_profile("default")
    for name, knobs in PROFILES.items():
        options = dict(knobs)
        if "phases" in options:
            options["phases"] = [Phase[p] for p in options["phases"]]
        settings.register_profile(
            name,
            parent=base,
            deadline=None,
            print_blob=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            **options,
        )


def active_settings() -> HypothesisSettings:
    """The hypothesis settings object of the selected profile."""
    from hypothesis import settings

    register_profiles()
    return settings.get_profile(selected_profile())


def _check_name(name: str) -> None:
    if name not in PROFILES:
        import pytest

        raise pytest.UsageError(
            f"unknown asyncflow hypothesis profile {name!r} (from {OPTION} or ${ENV_VAR}); "
            f"known profiles: {sorted(PROFILES)}"
        )


# --------------------------------------------------------------------------------------------
# pytest hooks
# --------------------------------------------------------------------------------------------
def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("asyncflow", "AsyncFlow conformance suite")
    group.addoption(
        OPTION,
        action="store",
        default=None,
        metavar="NAME",
        help=(
            f"hypothesis profile of the AsyncFlow conformance suite: one of {sorted(PROFILES)} "
            f"(default: ${ENV_VAR}, else {DEFAULT_PROFILE})"
        ),
    )


def pytest_configure(config: pytest.Config) -> None:
    global _selected
    config.addinivalue_line(
        "markers", "conformance: a law of an AsyncFlow protocol (asyncflow_conformance)"
    )
    config.addinivalue_line("markers", "slow: longer-running tests (still run in CI)")
    _selected = config.getoption(OPTION) or os.environ.get(ENV_VAR) or DEFAULT_PROFILE
    _check_name(_selected)


def pytest_unconfigure(config: pytest.Config) -> None:
    global _selected
    _selected = None


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _describe(knob: str, value: Any) -> str:
    if knob == "phases":
        return "no shrinking" if "shrink" not in value else f"phases={list(value)}"
    return f"{knob}={value}"


def pytest_report_header(config: pytest.Config) -> str:
    name = selected_profile()
    knobs = ", ".join(_describe(k, v) for k, v in PROFILES[name].items() if k != "database")
    return (
        f"asyncflow-conformance {_version('asyncflow-conformance')} "
        f"(asyncflow {_version('asyncflow')}, hypothesis {_version('hypothesis')}): "
        f"profile {name} ({knobs}; choose with {OPTION} or ${ENV_VAR})"
    )


def pytest_report_collectionfinish(config: pytest.Config, items: list[pytest.Item]) -> list[str]:
    """One line per DataStore backend and agent loop under test, with what they declare."""
    datastore = sys.modules.get("asyncflow_conformance.datastore")
    agent = sys.modules.get("asyncflow_conformance.agent")
    lines: dict[type, str] = {}
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is None or cls in lines:
            continue
        if datastore is not None and issubclass(cls, datastore.DataStoreConformance):
            lines[cls] = f"asyncflow-conformance: DataStore backend {cls.describe_backend()}"
        elif agent is not None and issubclass(cls, agent.AgentLoopConformance):
            lines[cls] = f"asyncflow-conformance: agent loop {cls.describe_backend()}"
    return list(lines.values())


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """What the agent-loop laws saw (turns, tool errors, agreement, abort points)."""
    agent = sys.modules.get("asyncflow_conformance.agent")
    if agent is None or not agent.REPORT:
        return
    terminalreporter.section("asyncflow-conformance: agent loops")
    for name, lines in agent.REPORT.items():
        for line in lines:
            terminalreporter.write_line(f"{name}.{line}")
