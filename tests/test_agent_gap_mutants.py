"""The agent laws written for the gaps of conformance/PROMISES.md (AG3, AG5, AG7) can fail: each
mutant here is a one-line bug of the framework code under those laws (the tool runner, the
agent client's staleness count, RLJob's regeneration and its update's sampler, the minimal chat
template), made by editing that one line of the function's source and patching the result in
for the test. Each must fail its law with an ``AssertionError`` naming the cause; the unbroken
code passes the same laws (tests/test_agent_conformance.py, tests/test_hf_agent.py).

One mutant the PROMISES.md gap names is not here: ``Trajectory.min_version`` ``min`` ->
``max``. Nothing in the job reads that property (the client counts a trajectory through
``GenerationClient.min_version``, the update through the rows' tags), so it cannot change what
RLJob trains; the client's own count is the mutant that matters (``client-counts-newest``).
"""

from __future__ import annotations

import inspect
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from types import FunctionType
from typing import Any

import pytest
from asyncflow_conformance import ChatFormatConformance

from asyncflow_core.flow.agent import GenerationClient
from asyncflow_core.flow.chat import MinimalChatFormat
from asyncflow_core.flow.rlflow import RLJob
from asyncflow_core.flow.tools import ToolRunner


def one_line_mutant(owner: type, name: str, old: str, new: str) -> Any:
    """``owner.name`` (a function or property) compiled again from its source with ``old``
    (which must occur exactly once) replaced by ``new``, in its own module's globals."""
    attr = inspect.getattr_static(owner, name)
    func = attr.fget if isinstance(attr, property) else attr
    assert isinstance(func, FunctionType), f"{owner.__name__}.{name} is not a function"
    source = textwrap.dedent(inspect.getsource(func))
    assert source.count(old) == 1, f"{owner.__name__}.{name}: {old!r} is not in it once"
    namespace: dict[str, Any] = {}
    code = compile(source.replace(old, new), inspect.getsourcefile(func) or name, "exec")
    exec(code, func.__globals__, namespace)
    return namespace[name]


def backend(name: str) -> Callable[[], Any]:
    """A backend class of tests/test_agent_conformance.py (imported when used: it needs openai)."""

    def make() -> Any:
        import test_agent_conformance

        return getattr(test_agent_conformance, name)()

    return make


class MinimalChat(ChatFormatConformance):
    def make_chat(self) -> MinimalChatFormat:
        from asyncflow_reference.agentic import chat_format

        return chat_format()


@dataclass(frozen=True)
class Mutant:
    id: str
    owner: type
    name: str
    old: str
    new: str
    make_suite: Callable[[], Any]
    law: str
    message: str
    arg: Any = None


FAILURE = "test_a_failing_tool_cannot_lose_or_duplicate_a_trajectory"
STALENESS = "test_a_job_never_trains_a_trajectory_staler_than_eta"
FOLLOWUP = "test_followup_continues_the_template"

MUTANTS: tuple[Mutant, ...] = (
    # AG7: a KeyError escapes ToolRunner.run (the sample is lost and RLJob stops)
    Mutant("unknown-tool-raises", ToolRunner, "_run", "by_name.get(call.name)",
           "by_name[call.name]", backend("ToolLoopBackend"), FAILURE,
           "trajectories were lost when the loop's tools failed", "unknown_tool"),
    # AG7: arguments the schema refuses answered as if the call had worked (not counted)
    Mutant("bad-arguments-uncounted", ToolRunner, "_run",
           'return self._failed(call, "bad_arguments", f"{call.name}: {problem}")',
           'return ToolResult(call, f"error: {call.name}: {problem}")',
           backend("ToolLoopBackend"), FAILURE, "the trajectory shows no tool error",
           "bad_arguments"),
    # AG5: RLJob regenerates the trajectories that finished, keeps the stale ones
    Mutant("regenerates-the-finished", RLJob, "_trajectory", 'trajectory.ended != "stale"',
           'trajectory.ended == "stale"', backend("ToolLoopBackend"), STALENESS,
           "a sample is run again only when its trajectory became too stale", 0),
    # AG5: the client counts a trajectory by its newest generated token
    Mutant("client-counts-newest", GenerationClient, "min_version", "min(seen)", "max(seen)",
           backend("EndpointBackend"), STALENESS,
           "A trajectory counts by its oldest generated token: no turn starts on one", 1),
    # AG5: the update's sampler lets rows one version staler than eta through
    Mutant("update-drops-past-eta-plus-one", RLJob, "__init__",
           "config.staleness if config.drop_stale", "config.staleness + 1 if config.drop_stale",
           backend("ToolLoopBackend"), STALENESS, r"versions stale, more than staleness", 1),
    # AG3: the newline that closes the assistant turn dropped
    Mutant("followup-drops-the-newline", MinimalChatFormat, "followup", 'text = "\\n" + ',
           "text = ", MinimalChat, FOLLOWUP, "followup gives"),
    # AG3: the next assistant turn not opened
    Mutant("followup-opens-no-turn", MinimalChatFormat, "followup",
           ' + f"{IM_START}assistant\\n"', "", MinimalChat, FOLLOWUP, "followup gives"),
)  # fmt: skip


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.id for m in MUTANTS])
def test_the_gap_law_fails_the_mutant(mutant: Mutant, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = one_line_mutant(mutant.owner, mutant.name, mutant.old, mutant.new)
    monkeypatch.setattr(mutant.owner, mutant.name, broken)
    suite = mutant.make_suite()
    law = getattr(suite, mutant.law)
    with pytest.raises(AssertionError) as failure:
        law() if mutant.arg is None else law(mutant.arg)
    assert re.search(mutant.message, str(failure.value)), str(failure.value)


def test_every_gap_law_has_two_mutants() -> None:
    laws = [m.law for m in MUTANTS]
    assert {law: laws.count(law) for law in laws} == {FAILURE: 2, STALENESS: 3, FOLLOWUP: 2}
