"""A measured mutation score for the conformance suite (issue #42): cosmic-ray's mutants of the
reference engines, the trainer core, the sampling maths and the weight-sync transports, each run
in a copy of the repo against the conformance laws that reach it; a table per law file and per
mutated file, the survivors with their diffs in a report.

    .venv/bin/python tools/mutation.py --sample 200 --seed 0 --jobs 2 --timeout 300  # make mutation

How a run goes:

1. The repo's files (``git ls-files``, untracked ones included) are copied once per job into a
   temporary folder; nothing in the repo is written but the report (``--out``). Each pytest
   runs in a copy with the copy's package folders first on ``PYTHONPATH``, ahead of the
   editable install's finder
   (which setuptools appends to ``sys.meta_path``, after the path finder), and this module,
   loaded as a pytest plugin there (``-p mutation``), checks that every ``asyncflow*`` module
   it imported lives in that copy: a run that imported anything from elsewhere is an error.
2. Mutants: every mutation of cosmic-ray's core operators (those that take no arguments) in
   the chosen files, numbered as ``cosmic-ray init`` numbers them (``FILE:OPERATOR:N``).
   Mutants in annotations (never evaluated: each file has ``from __future__ import
   annotations``), in ``__repr__``/``__str__``, logging calls and f-string messages of
   raised errors are counted and left out (``--include-skipped`` keeps them).
3. A baseline run of the law tests (``LAW_TESTS``) on the unmutated copy records which
   functions of the mutated files each test calls (a ``sys.settrace`` call hook). A mutant runs
   only the tests that call the function it sits in (a mutant outside any function runs every
   test that calls into its file); a mutant in a function no test calls is "not reached" and is
   counted per file and function without running anything. Tests sharing a class- or
   module-scoped fixture count as one unit. Every baseline test must pass; one that fails is
   left out (and named).
4. A sanity mutant per mutated file (an ``AssertionError`` raised on entry to the function the
   most tests call) must be killed, else the run stops: proof that the tests run the mutated
   copy.
5. The sample: ``--sample N`` code locations drawn with ``--seed`` from the reached ones, then
   one of each location's mutations (cosmic-ray makes eleven of each binary operator; drawing
   locations first keeps one ``+`` from weighing eleven times a ``not``).
6. Each mutant: its file rewritten in a free copy (its ``.pyc`` dropped), pytest on its tests
   with a ``--timeout`` for the whole run, and per law file the first failure ends that law
   file's tests (the rest are skipped: one failure is enough to know the law file killed it).

Verdicts, per law file and per mutant: killed (a law failed, or the process died in a law),
timed-out (no law failed, but a test hit the timeout or the run had to be killed), error (the
run could not say: collection failed for a reason outside the mutated file, nothing ran, the
copy was not what got imported), survived (every law it ran passed). A mutant whose file fails
to import is killed by "(import)". Law file: the module of ``asyncflow_conformance`` that
defines the failing test method (the test classes subclass the law classes); a test a test
file defines itself counts under that test file.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import importlib
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

TARGETS = (
    "reference/asyncflow_reference/engines.py",
    "asyncflow_core/engines/lmtrain.py",
    "asyncflow_core/training/sampling.py",
    "asyncflow_core/sync/transports.py",
)
"""The mutated files: the reference rollout engine and trainer, the trainer core they build on
(only its parts the reference trainer calls are reached), the sampling maths both engines use,
and the weight-sync transports (the laws run the in-process one and the collective ones)."""

LAW_TESTS = (
    "tests/test_engine_conformance.py::TestTorchInferenceEngine",
    "tests/test_engine_conformance.py::TestTorchTrainEngine",
    "tests/test_engine_conformance.py::TestTorchInProcessWeightSync",
    "tests/test_engine_conformance.py::TestTinyInProcessWeightSync",
    "tests/test_engine_conformance.py::TestInProcessWeightSyncOnSim",
    "tests/test_collective_weightsync_conformance.py::TestEngineGroupWeightSync",
    "tests/test_collective_weightsync_conformance.py::TestDistributedWeightSyncLoopback",
    "tests/test_engine_pair.py::TestTorchPair",
    "tests/test_engine_pair.py::TestTorchPairTied",
    "tests/test_engine_pair.py::TestTinyPair",
    "tests/test_agent_conformance.py::TestToolAgentLoop",
    "tests/test_agent_conformance.py::TestEndpointLoop",
    "tests/test_workflow_conformance.py::TestTinyEnginesRealClock",
    "tests/test_workflow_conformance.py::TestSimEngines",
)
"""The law classes on the reference engines, the in-process transport and the collective ones
(``EngineGroupWeightSync`` over an in-process group, ``DistributedWeightSync`` over a gloo
``WeightSyncGroup`` on 127.0.0.1) (~50 s on one core, and ~15 s for the collective ones).
The Process* classes (the same engines in a child process) are left out: the call hook cannot
see into the child, and they test the process host, not the engines."""

PACKAGE_DIRS = ("", "reference", "adapters", "conformance")
"""Where the packages live in the repo (pyproject's ``packages.find`` and ./conformance)."""

SKIPPED_CATEGORIES = ("annotation", "repr", "logging", "error-message")
VERDICTS = ("killed", "survived", "timed-out", "error")
IMPORT_LAW = "(import)"

# The environment this module reads when pytest loads it as a plugin in a mutant's run.
EVENTS_ENV = "ASYNCFLOW_MUTATION_EVENTS"  # JSON-lines file the plugin appends to
SELECT_ENV = "ASYNCFLOW_MUTATION_SELECT"  # JSON list of the node ids to run (others deselected)
TRACE_ENV = "ASYNCFLOW_MUTATION_TRACE"  # JSON {absolute path: repo path} of files whose calls count
COPY_ENV = "ASYNCFLOW_MUTATION_COPY"  # the copy every asyncflow* module must come from
MODULES_ENV = (
    "ASYNCFLOW_MUTATION_MODULES"  # JSON list: the mutated files' modules, imported to check
)
STOP_ENV = "ASYNCFLOW_MUTATION_STOP_PER_LAW"  # "1": a law file's first failure skips its rest


# --------------------------------------------------------------------------------------------
# Mutants
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Mutant:
    id: str  # FILE:OPERATOR:OCCURRENCE, cosmic-ray's numbering
    file: str
    operator: str
    occurrence: int
    line: int
    col: int
    definition: str  # Class.method, function, or <module>
    function_lines: tuple[int, ...]  # lines a code object of its function may start on; () outside
    category: str  # "code", or one of SKIPPED_CATEGORIES
    text: str  # the source line

    @property
    def site(self) -> tuple[str, int, int]:
        return (self.file, self.line, self.col)


@dataclasses.dataclass(frozen=True)
class Function:
    file: str
    definition: str
    lines: tuple[int, ...]
    body_line: int  # first statement after the docstring (0: body on the def line)
    body_col: int


def module_name(file: str) -> str:
    parts = Path(file).with_suffix("").parts
    if parts[0] in PACKAGE_DIRS:
        parts = parts[1:]
    return ".".join(parts)


def _operators() -> list[tuple[str, Any]]:
    from cosmic_ray import plugins

    found = []
    for name in plugins.operator_names():
        cls = plugins.get_operator(name)
        if not cls.arguments():  # the variable replacer/inserter need arguments: not used
            found.append((str(name), cls()))
    return found


def _definition(node: Any) -> tuple[str, Any]:
    """The dotted name of the innermost def/class around ``node``, and the innermost function
    whose body holds it (None outside any body: defaults and decorators run at def time)."""
    names: list[str] = []
    function = None
    child, parent = node, node.parent
    while parent is not None:
        if parent.type in ("funcdef", "classdef"):
            names.append(parent.name.value)
            if function is None and parent.type == "funcdef" and child is parent.children[-1]:
                function = parent
        child, parent = parent, parent.parent
    return (".".join(reversed(names)) or "<module>"), function


def _function_lines(funcdef: Any) -> tuple[int, ...]:
    """Lines a code object of ``funcdef`` may report as ``co_firstlineno``: its decorators'
    and its ``async``/``def`` line."""
    top = funcdef
    while top.parent is not None and top.parent.type in (
        "decorated",
        "async_funcdef",
        "async_stmt",
    ):
        top = top.parent
    return tuple(range(top.start_pos[0], funcdef.start_pos[0] + 1))


def _is_annotation(parent: Any, child: Any) -> bool:
    previous = child.get_previous_sibling()
    if previous is None or previous.type != "operator":
        return False
    if parent.type in ("tfpdef", "tname", "annassign") and previous.value == ":":
        return True
    return bool(parent.type == "funcdef" and previous.value == "->")


_LOGGERS = {"log", "logger", "_log", "_logger", "LOG", "LOGGER", "logging", "warnings"}
_LOG_CALLS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "log"}


def _category(node: Any, future_annotations: bool) -> str:
    in_fstring = False
    child, parent = node, node.parent
    while parent is not None:
        if future_annotations and _is_annotation(parent, child):
            return "annotation"
        if parent.type == "fstring":
            in_fstring = True
        if parent.type == "raise_stmt" and in_fstring:
            return "error-message"
        if parent.type == "funcdef" and parent.name.value in ("__repr__", "__str__"):
            return "repr"
        if parent.type in ("power", "atom_expr") and len(parent.children) >= 2:
            head, attr = parent.children[0], parent.children[1]
            if (
                head.type == "name"
                and head.value in _LOGGERS
                and attr.type == "trailer"
                and len(attr.children) == 2
                and attr.children[1].value in _LOG_CALLS
            ):
                return "logging"
        child, parent = parent, parent.parent
    return "code"


def _functions(file: str, tree: Any) -> list[Function]:
    from cosmic_ray.ast import ast_nodes

    found = []
    for node in ast_nodes(tree):
        if node.type != "funcdef":
            continue
        definition, _ = _definition(node.children[-1])
        body = node.children[-1]
        line = col = 0
        if body.type == "suite":
            statements = [c for c in body.children if c.type not in ("newline", "endmarker")]
            first = statements[0] if statements else None
            if (
                first is not None
                and first.type == "simple_stmt"
                and first.children[0].type == "string"
            ):
                first = statements[1] if len(statements) > 1 else None  # after the docstring
            if first is not None:
                line, col = first.start_pos
        found.append(Function(file, definition, _function_lines(node), line, col))
    return found


def catalogue(root: Path, files: Sequence[str]) -> tuple[list[Mutant], list[Function]]:
    """Every mutant of the core operators in ``files`` (under ``root``), numbered per file and
    operator in the order ``cosmic-ray init`` numbers them, and every function of the files."""
    from cosmic_ray.ast import ast_nodes, get_ast

    operators = _operators()
    mutants: list[Mutant] = []
    functions: list[Function] = []
    for file in files:
        source = (root / file).read_text(encoding="utf-8")
        lines = source.splitlines()
        future = "from __future__ import annotations" in source
        tree = get_ast(source)
        nodes = list(ast_nodes(tree))
        functions += _functions(file, tree)
        for name, operator in operators:
            occurrence = 0
            for node in nodes:
                for start, _end in operator.mutation_positions(node):
                    definition, function = _definition(node)
                    mutants.append(
                        Mutant(
                            id=f"{file}:{name}:{occurrence}",
                            file=file,
                            operator=name,
                            occurrence=occurrence,
                            line=start[0],
                            col=start[1],
                            definition=definition,
                            function_lines=_function_lines(function) if function else (),
                            category=_category(node, future),
                            text=lines[start[0] - 1].strip() if start[0] <= len(lines) else "",
                        )
                    )
                    occurrence += 1
    return mutants, functions


def mutated_source(source: str, mutant: Mutant) -> str | None:
    """The source with ``mutant`` applied (cosmic-ray's own ``mutate_code``); None when the
    operator finds nothing to change there."""
    from cosmic_ray import plugins
    from cosmic_ray.mutating import mutate_code

    operator = plugins.get_operator(mutant.operator)()
    code = mutate_code(source, operator, mutant.occurrence)
    return None if code is None or code == source else str(code)


def sanity_source(source: str, function: Function) -> str:
    """The source with an ``AssertionError`` raised on entry to ``function``."""
    lines = source.splitlines(keepends=True)
    raise_line = (
        " " * function.body_col
        + "raise AssertionError('mutation sanity check: the mutated copy is what runs')\n"
    )
    return "".join([*lines[: function.body_line - 1], raise_line, *lines[function.body_line - 1 :]])


def diff_lines(before: str, after: str) -> list[str]:
    """The changed lines, ``-`` then ``+``, with their line numbers."""
    a, b = before.splitlines(), after.splitlines()
    out = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        out += [f"-{i + 1}: {a[i].strip()}" for i in range(i1, i2)]
        out += [f"+{j + 1}: {b[j].strip()}" for j in range(j1, j2)]
    return out


# --------------------------------------------------------------------------------------------
# The pytest plugin (loaded as ``-p mutation`` in each run; inert without EVENTS_ENV)
# --------------------------------------------------------------------------------------------
class _Recorder:
    def __init__(self, events: str) -> None:
        self._out = open(events, "a", encoding="utf-8")  # noqa: SIM115 (closed at unconfigure)
        self._lock = threading.Lock()
        self.killed_laws: set[str] = set()
        self.stop_per_law = os.environ.get(STOP_ENV) == "1"
        self.outcome: dict[str, Any] = {}
        trace = os.environ.get(TRACE_ENV)
        self.traced: dict[str, str] = json.loads(trace) if trace else {}
        self.reached: set[tuple[str, int]] = set()

    def write(self, **event: Any) -> None:
        with self._lock:
            self._out.write(json.dumps(event) + "\n")
            self._out.flush()

    def close(self) -> None:
        self._out.close()

    def on_call(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            file = self.traced.get(frame.f_code.co_filename)
            if file is not None:
                self.reached.add((file, frame.f_code.co_firstlineno))


_recorder: _Recorder | None = None


def _law_of(item: pytest.Item) -> tuple[str, str]:
    """(law file, law) of a test: the module and qualified name of the test method."""
    function = getattr(item, "function", None) or getattr(item, "obj", None)
    module = getattr(function, "__module__", "") or ""
    qualname = getattr(function, "__qualname__", item.name) or item.name
    if module.startswith("asyncflow_conformance."):
        return module.rsplit(".", 1)[1] + ".py", qualname
    return item.nodeid.split("::", 1)[0], qualname


def _sharing(item: pytest.Item) -> str:
    """The widest scope of a fixture the test shares with other tests of its class or module
    ("function" if none): such a fixture runs once, in whichever of them comes first, so a
    mutant reached there must run them all. Session fixtures (tmp_path_factory, ...) are not
    counted: none of them runs the code under test."""
    info = getattr(item, "_fixtureinfo", None)
    scopes = {chain[-1].scope for chain in (getattr(info, "name2fixturedefs", {}) or {}).values()}
    return "module" if "module" in scopes else "class" if "class" in scopes else "function"


def pytest_configure(config: pytest.Config) -> None:
    global _recorder
    events = os.environ.get(EVENTS_ENV)
    if not events:
        return
    _recorder = _Recorder(events)
    if _recorder.traced:
        recorder = _recorder

        def tracer(frame: FrameType, event: str, arg: Any) -> None:
            recorder.on_call(frame, event, arg)

        sys.settrace(tracer)
        threading.settrace(tracer)


def pytest_unconfigure(config: pytest.Config) -> None:
    global _recorder
    if _recorder is not None:
        sys.settrace(None)
        threading.settrace(None)
        _recorder.close()
        _recorder = None


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    selection = os.environ.get(SELECT_ENV)
    if _recorder is None or not selection:
        return
    wanted = set(json.loads(Path(selection).read_text(encoding="utf-8")))
    keep = [item for item in items if item.nodeid in wanted]
    dropped = [item for item in items if item.nodeid not in wanted]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if _recorder is not None and report.failed:
        _recorder.write(event="collect-error", nodeid=report.nodeid, text=report.longreprtext)


def _outside_the_copy() -> tuple[dict[str, str], list[str]]:
    """Every loaded asyncflow* module's file, and those not under the copy."""
    copy = os.path.realpath(os.environ[COPY_ENV])
    modules = {}
    outside = []
    for name, module in sorted(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if name.startswith("asyncflow") and file:
            modules[name] = file
            if not os.path.realpath(file).startswith(copy + os.sep):
                outside.append(f"{name} from {file}")
    return modules, outside


def pytest_collection_finish(session: pytest.Session) -> None:
    """The provenance check, before any test: the mutated files' modules (imported here if no
    test module did) and every other asyncflow* module come from the copy under test."""
    if _recorder is None:
        return
    for name in json.loads(os.environ.get(MODULES_ENV) or "[]"):
        importlib.import_module(name)
    modules, outside = _outside_the_copy()
    _recorder.write(event="imports", modules=modules, outside=outside)
    if outside:
        pytest.exit(f"mutation: modules imported from outside the copy: {outside}", 3)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    recorder = _recorder
    if recorder is None:
        yield
        return
    law_file, law = _law_of(item)
    recorder.reached = set()
    recorder.outcome = {"outcome": "passed", "message": "", "duration": 0.0}
    recorder.write(event="start", nodeid=item.nodeid, law_file=law_file, law=law)
    yield
    outcome = recorder.outcome
    if outcome["outcome"] == "failed":
        recorder.killed_laws.add(law_file)
    recorder.write(
        event="test",
        nodeid=item.nodeid,
        cls=item.nodeid.rsplit("::", 1)[0],
        sharing=_sharing(item),
        law_file=law_file,
        law=law,
        **outcome,
    )
    if recorder.traced:
        recorder.write(event="reached", nodeid=item.nodeid, functions=sorted(recorder.reached))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    recorder = _recorder
    if recorder is not None and recorder.stop_per_law:
        law_file, _ = _law_of(item)
        if law_file in recorder.killed_laws:
            pytest.skip(f"mutation: a law of {law_file} already failed on this mutant")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    recorder = _recorder
    if recorder is None:
        return
    recorder.outcome["duration"] += report.duration
    if report.failed and recorder.outcome["outcome"] != "failed":
        crash = getattr(report.longrepr, "reprcrash", None)
        message = str(getattr(crash, "message", "") or report.longreprtext[-2000:])
        # pytest-timeout's failure ("Timeout >Ns"): a hang, not a law's verdict
        timeout = message.startswith("Failed: Timeout >") or "+ Timeout +" in report.longreprtext
        recorder.outcome["outcome"] = "timeout" if timeout else "failed"
        recorder.outcome["message"] = f"{report.when}: {message[:1500]}"
    elif report.skipped and report.when != "teardown" and recorder.outcome["outcome"] == "passed":
        recorder.outcome["outcome"] = "skipped"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _recorder is not None:
        _, outside = _outside_the_copy()  # and the modules the tests imported late
        _recorder.write(event="finish", exitstatus=int(exitstatus), outside=outside)


# --------------------------------------------------------------------------------------------
# Running pytest in a copy
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class TestResult:
    nodeid: str
    outcome: str  # passed, failed, skipped, timeout
    law_file: str
    law: str
    message: str = ""
    duration: float = 0.0
    cls: str = ""
    sharing: str = "function"


@dataclasses.dataclass
class Run:
    rc: int
    killed_at_timeout: bool
    wall_s: float
    tests: list[TestResult]
    started: list[tuple[str, str, str]]  # (nodeid, law file, law)
    reached: dict[str, list[tuple[str, int]]]
    outside: list[str]
    collect_errors: list[str]
    finished: bool
    log_tail: str


_live: set[subprocess.Popen[bytes]] = set()  # pytest processes running now
_live_lock = threading.Lock()


_stopping = threading.Event()  # set on an interrupt: no new pytest starts


def kill_live() -> None:
    """End every pytest process this run started (each leads a process group of its own)."""
    _stopping.set()
    with _live_lock:
        for process in _live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)


@contextlib.contextmanager
def worker_pool(workers: int) -> Iterator[ThreadPoolExecutor]:
    """A thread pool whose running pytest processes are killed, not awaited, when the caller
    is interrupted or gives up."""
    pool = ThreadPoolExecutor(workers)
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        kill_live()
        raise
    finally:
        pool.shutdown(wait=True)


def copy_repo(source: Path, dest: Path) -> None:
    """The repo's files as git sees them (tracked and untracked, not ignored), else all but
    the usual build and cache folders."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"],
        cwd=source,
        capture_output=True,
        check=False,
    )
    if listed.returncode == 0 and listed.stdout:
        dest.mkdir(parents=True)
        for name in listed.stdout.decode().split("\0"):
            if not name or not (source / name).is_file():
                continue  # deleted in the work tree, or a submodule
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / name, dest / name)
    else:
        ignore = shutil.ignore_patterns(".git", ".venv*", "__pycache__", "*.egg-info", "runs")
        shutil.copytree(source, dest, ignore=ignore)


def _drop_bytecode(path: Path) -> None:
    for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        pyc.unlink(missing_ok=True)


def run_pytest(
    copy: Path,
    work: Path,
    nodes: Iterable[str],  # what pytest collects (test classes)
    *,
    select: Sequence[str] | None,
    trace: Mapping[str, str] | None,
    modules: Sequence[str],
    timeout: float,
    threads: int,
    stop_per_law: bool,
) -> Run:
    """One pytest process in ``copy``: the collected classes, ``select`` of their tests, the
    events this module's plugin records there."""
    work.mkdir(parents=True, exist_ok=True)
    stamp = f"{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}"
    events, log = work / f"events-{stamp}.jsonl", work / f"pytest-{stamp}.log"
    env = dict(os.environ)
    paths = [str(copy / d) if d else str(copy) for d in PACKAGE_DIRS] + [str(copy / "tools")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(paths),
            EVENTS_ENV: str(events),
            COPY_ENV: str(copy),
            STOP_ENV: "1" if stop_per_law else "0",
            MODULES_ENV: json.dumps(list(modules)),
            "OMP_NUM_THREADS": str(threads),
            "ASYNCFLOW_HYPOTHESIS_PROFILE": "asyncflow-smoke",
            "ASYNCFLOW_TEST_EXIT_GRACE_S": "20",  # tests/conftest.py's exit watchdog
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.pop(SELECT_ENV, None)
    env.pop(TRACE_ENV, None)
    if select is not None:
        selection = work / f"select-{stamp}.json"
        selection.write_text(json.dumps(sorted(select)), encoding="utf-8")
        env[SELECT_ENV] = str(selection)
    if trace is not None:
        env[TRACE_ENV] = json.dumps(dict(trace))
    per_test = max(1, int(timeout))
    command = [
        *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "mutation"),
        *("-o", f"timeout={per_test}", "--rootdir", str(copy)),
        *sorted(set(nodes)),
    ]
    start = time.monotonic()
    with open(log, "wb") as out, _live_lock:
        if _stopping.is_set():
            raise KeyboardInterrupt("mutation: stopping")
        process = subprocess.Popen(
            command, cwd=copy, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        _live.add(process)
    killed = False
    try:
        rc = process.wait(timeout + 15)  # pytest-timeout's per-test limit fires first
    except subprocess.TimeoutExpired:
        killed = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        rc = process.wait()
    finally:
        with _live_lock:
            _live.discard(process)
    wall = time.monotonic() - start
    run = Run(rc, killed, wall, [], [], {}, [], [], False, "")
    if events.exists():
        for line in events.read_text(encoding="utf-8").splitlines():
            event = json.loads(line)
            kind = event.pop("event")
            if kind == "start":
                run.started.append((event["nodeid"], event["law_file"], event["law"]))
            elif kind == "test":
                run.tests.append(TestResult(**event))
            elif kind == "reached":
                run.reached[event["nodeid"]] = [(f, n) for f, n in event["functions"]]
            elif kind == "imports":
                run.outside = list(event["outside"])
            elif kind == "collect-error":
                run.collect_errors.append(f"{event['nodeid']}: {event['text']}")
            elif kind == "finish":
                run.finished = True
                run.outside += event["outside"]
    run.log_tail = log.read_bytes()[-3000:].decode(errors="replace")
    if trace is None:
        for path in (events, log):
            path.unlink(missing_ok=True)
    return run


@dataclasses.dataclass
class Verdict:
    verdict: str
    laws: dict[str, str]  # law file -> verdict
    failures: list[dict[str, str]]
    reason: str = ""


def _failure(test: str, law: str, law_file: str, message: str) -> dict[str, str]:
    return {"test": test, "law": law, "law_file": law_file, "message": message}


def judge(run: Run, law_files: Iterable[str], mutated: Path | None) -> Verdict:
    """A run's verdict per law file and overall (see the module's docstring)."""
    laws = dict.fromkeys(law_files, "survived")
    failures: list[dict[str, str]] = []
    for test in run.tests:
        laws.setdefault(test.law_file, "survived")
        if test.outcome == "failed":
            laws[test.law_file] = "killed"
            failures.append(_failure(test.nodeid, test.law, test.law_file, test.message))
        elif test.outcome == "timeout" and laws[test.law_file] != "killed":
            laws[test.law_file] = "timed-out"
    done = {t.nodeid for t in run.tests}
    unfinished = [s for s in run.started if s[0] not in done]
    if unfinished and not run.finished:
        nodeid, law_file, law = unfinished[-1]
        # pytest-timeout's thread method ends the process itself, after this banner
        hung = run.killed_at_timeout or "+ Timeout +" in run.log_tail
        if not hung:
            laws[law_file] = "killed"
            message = f"the test process died (exit status {run.rc})"
            failures.append(_failure(nodeid, law, law_file, message))
        elif laws.get(law_file) != "killed":
            laws[law_file] = "timed-out"
    if run.killed_at_timeout:  # law files whose tests never got to run
        ran = {t.law_file for t in run.tests} | {s[1] for s in run.started}
        for law_file in laws:
            if law_file not in ran:
                laws[law_file] = "timed-out"

    def error(reason: str) -> Verdict:
        return Verdict("error", dict.fromkeys(laws, "error"), failures, reason)

    if run.collect_errors:
        text = "\n".join(run.collect_errors)
        if mutated is not None and str(mutated) in text:  # the mutated file failed to import
            failure = _failure("(collection)", IMPORT_LAW, IMPORT_LAW, text[-1500:])
            return Verdict("killed", {IMPORT_LAW: "killed"}, [failure])
        return error("collection failed: " + text[-1500:])
    if run.outside:
        return error(f"imported from outside the copy: {run.outside}")
    if "killed" in laws.values():
        return Verdict("killed", laws, failures)
    if "timed-out" in laws.values() or run.killed_at_timeout:
        return Verdict("timed-out", laws, failures, "no law failed before the timeout")
    if not run.tests:
        return error("no test ran: " + run.log_tail[-1500:])
    if run.rc != 0:
        if run.finished and "had not exited" in run.log_tail:  # tests/conftest.py's watchdog
            return Verdict(
                "timed-out", laws, failures, "every law passed; the process hung at exit"
            )
        return error(f"pytest exited {run.rc} with every law passing: {run.log_tail[-1500:]}")
    return Verdict("survived", laws, failures)


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Baseline:
    wall_s: float
    passed: dict[str, TestResult]
    failed: list[TestResult]
    units: dict[str, list[str]]  # a test, or the class or module sharing a fixture -> tests
    reach: dict[tuple[str, int], set[str]]  # (file, first line) -> units calling it
    files: dict[str, set[str]]  # mutated file -> units calling into it


def baseline(
    copies: Sequence[Path],
    work: Path,
    tests: Sequence[str],
    files: Sequence[str],
    timeout: float,
    threads: int,
) -> Baseline:
    """The law tests on the unmutated copies, split over the jobs, with the call hook on."""
    shares: list[list[str]] = [[] for _ in copies]
    for i, node in enumerate(tests):
        shares[i % len(copies)].append(node)
    runs: list[Run] = []
    start = time.monotonic()
    with worker_pool(len(copies)) as pool:
        futures = []
        for copy, share in zip(copies, shares, strict=True):
            if not share:
                continue
            trace = {}
            for file in files:
                trace[str(copy / file)] = file
                trace[os.path.realpath(copy / file)] = file
            futures.append(
                pool.submit(
                    run_pytest,
                    copy,
                    work / "baseline",
                    share,
                    select=None,
                    trace=trace,
                    modules=[module_name(f) for f in files],
                    timeout=timeout,
                    threads=threads,
                    stop_per_law=False,
                )
            )
        runs = [f.result() for f in futures]
    wall = time.monotonic() - start
    for run in runs:
        if run.outside or run.collect_errors or not run.finished or not run.tests:
            sys.exit(
                "mutation: the baseline run failed (nothing is mutated there): "
                + "; ".join(run.outside + run.collect_errors)
                + "\n"
                + run.log_tail
            )
    results = [t for run in runs for t in run.tests]
    passed = {t.nodeid: t for t in results if t.outcome in ("passed", "skipped")}
    failed = [t for t in results if t.outcome not in ("passed", "skipped")]
    units: dict[str, list[str]] = defaultdict(list)
    unit_of = {}
    for t in passed.values():
        unit = {"class": t.cls, "module": t.nodeid.split("::")[0]}.get(t.sharing, t.nodeid)
        units[unit].append(t.nodeid)
        unit_of[t.nodeid] = unit
    reach: dict[tuple[str, int], set[str]] = defaultdict(set)
    by_file: dict[str, set[str]] = defaultdict(set)
    for run in runs:
        for nodeid, functions in run.reached.items():
            if nodeid not in unit_of:
                continue
            for file, line in functions:
                reach[(file, line)].add(unit_of[nodeid])
                by_file[file].add(unit_of[nodeid])
    return Baseline(wall, passed, failed, dict(units), dict(reach), dict(by_file))


def units_for(mutant: Mutant | Function, base: Baseline) -> set[str]:
    lines = mutant.function_lines if isinstance(mutant, Mutant) else mutant.lines
    if not lines:
        return set(base.files.get(mutant.file, ()))
    found: set[str] = set()
    for line in lines:
        found |= base.reach.get((mutant.file, line), set())
    return found


def draw(pool: Sequence[Mutant], n: int, seed: int) -> list[Mutant]:
    """``n`` sites drawn uniformly, then one mutation of each."""
    sites: dict[tuple[str, int, int], list[Mutant]] = defaultdict(list)
    for mutant in pool:
        sites[mutant.site].append(mutant)
    rng = random.Random(seed)
    keys = sorted(sites)
    chosen = rng.sample(keys, min(n, len(keys)))
    return [rng.choice(sites[key]) for key in chosen]


@dataclasses.dataclass(frozen=True)
class Job:
    """One mutated source to run: a sampled mutant or a sanity mutant."""

    id: str
    file: str
    line: int
    definition: str
    operator: str
    source: str | None  # None: cosmic-ray changed nothing there
    units: frozenset[str]  # the baseline's test units that reach it


@dataclasses.dataclass
class Outcome:
    job: Job
    diff: list[str]
    verdict: Verdict
    tests: int
    wall_s: float


class Runner:
    """The copies, each lent to one job at a time."""

    def __init__(
        self,
        copies: Sequence[Path],
        work: Path,
        base: Baseline,
        files: Sequence[str],
        timeout: float,
    ) -> None:
        self.free: queue.Queue[Path] = queue.Queue()
        for copy in copies:
            self.free.put(copy)
        self.copies = list(copies)
        self.work = work
        self.base = base
        self.timeout = timeout
        self.threads = max(1, (os.cpu_count() or 1) // len(copies))
        self.originals = {f: (copies[0] / f).read_text(encoding="utf-8") for f in files}
        self.modules = [module_name(f) for f in files]

    def run(self, job: Job) -> Outcome:
        def error(reason: str) -> Outcome:
            return Outcome(job, [], Verdict("error", {}, [], reason), 0, 0.0)

        if job.source is None:
            return error("cosmic-ray made no change at this occurrence")
        tests = sorted(t for unit in job.units for t in self.base.units[unit])
        if not tests:  # never run pytest on nothing: it would collect the whole test folder
            return error("no law test calls into this file")
        try:
            compile(job.source, job.file, "exec")
        except SyntaxError as e:
            return error(f"the mutant does not compile: {e}")
        law_files = {self.base.passed[t].law_file for t in tests}
        classes = sorted({self.base.passed[t].cls for t in tests})
        copy = self.free.get()
        path = copy / job.file
        try:
            path.write_text(job.source, encoding="utf-8")
            _drop_bytecode(path)
            run = run_pytest(
                copy,
                self.work / "runs",
                classes,
                select=tests,
                trace=None,
                modules=self.modules,
                timeout=self.timeout,
                threads=self.threads,
                stop_per_law=True,
            )
        finally:
            path.write_text(self.originals[job.file], encoding="utf-8")
            _drop_bytecode(path)
            self.free.put(copy)
        diff = diff_lines(self.originals[job.file], job.source)
        return Outcome(job, diff, judge(run, law_files, path), len(tests), run.wall_s)


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(map(str, header))] + [list(map(str, r)) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [title]
    for i, row in enumerate(cells):
        lines.append(
            "  ".join(
                c.ljust(w) if j == 0 else c.rjust(w)
                for j, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summarize(
    outcomes: Sequence[Outcome],
    mutants: Sequence[Mutant],
    unreached: Sequence[Mutant],
    files: Sequence[str],
) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    per_law: dict[str, Counter[str]] = defaultdict(Counter)
    per_file: dict[str, Counter[str]] = {f: Counter() for f in files}
    for m in mutants:
        per_file[m.file]["enumerated"] += 1
        if m.category != "code":
            per_file[m.file][f"skipped:{m.category}"] += 1
    for m in unreached:
        per_file[m.file]["not-reached"] += 1
    for o in outcomes:
        per_file[o.job.file]["sampled"] += 1
        per_file[o.job.file][o.verdict.verdict] += 1
        for law_file, verdict in o.verdict.laws.items():
            per_law[law_file][verdict] += 1
    return (
        {k: dict(v) for k, v in sorted(per_law.items())},
        {k: dict(v) for k, v in per_file.items()},
    )


def score(counts: Mapping[str, int]) -> float | None:
    judged = sum(counts.get(v, 0) for v in ("killed", "survived", "timed-out"))
    return round(counts.get("killed", 0) / judged, 3) if judged else None


def write_report(out: Path, report: dict[str, Any], outcomes: Sequence[Outcome]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    md = [
        "# Mutation run of the conformance suite",
        "",
        f"`{report['command']}` at {report['commit']}, {report['date']}: "
        f"{len(outcomes)} mutants, {report['wall_s']:.0f} s wall.",
        "",
        "```",
        report["tables"],
        "```",
        "",
        "## Survivors",
        "",
        "Classify each: equivalent / not protocol behaviour / needs a law.",
        "",
    ]
    for o in outcomes:
        if o.verdict.verdict != "survived":
            continue
        md += [
            f"### `{o.job.id}`",
            "",
            f"{o.job.file}:{o.job.line} in `{o.job.definition}` ({o.job.operator}), "
            f"{o.tests} tests ran (laws: {', '.join(sorted(o.verdict.laws)) or 'none'}).",
            "",
            "```diff",
            *o.diff,
            "```",
            "",
            "Classification: ",
            "",
        ]
    others = [o for o in outcomes if o.verdict.verdict in ("timed-out", "error")]
    if others:
        md += ["## Timed out and errors", ""]
        for o in others:
            md += [f"- `{o.job.id}` ({o.verdict.verdict}): {o.verdict.reason[:300]}"]
        md.append("")
    md += ["## Not reached by any law (mutants per function, not run)", ""]
    for where, n in report["not_reached"].items():
        file, definition = where.split("::", 1)
        md.append(f"- {file} `{definition}`: {n}")
    out.with_suffix(".md").write_text("\n".join(md) + "\n", encoding="utf-8")


def _outcome_json(o: Outcome) -> dict[str, Any]:
    return {
        "id": o.job.id,
        "file": o.job.file,
        "line": o.job.line,
        "definition": o.job.definition,
        "operator": o.job.operator,
        "verdict": o.verdict.verdict,
        "laws": o.verdict.laws,
        "failures": o.verdict.failures,
        "reason": o.verdict.reason,
        "diff": o.diff,
        "tests": o.tests,
        "wall_s": round(o.wall_s, 2),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--sample", type=int, default=200, help="code locations to mutate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2, help="mutants run at once (a copy each)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant's run")
    parser.add_argument("--files", nargs="+", default=list(TARGETS), help="files to mutate")
    parser.add_argument("--tests", nargs="+", default=list(LAW_TESTS), help="law test classes")
    parser.add_argument("--ids", nargs="+", help="run exactly these mutants (reached or not)")
    parser.add_argument("--list", action="store_true", help="print the mutants as JSON lines")
    parser.add_argument(
        "--include-skipped",
        action="store_true",
        help="mutate annotations, __repr__, logging and error messages too",
    )
    parser.add_argument("--no-sanity", action="store_true", help="skip the sanity mutants")
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "runs" / "mutation-report",
        help="report path without suffix (.json and .md are written)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the copies (printed)")
    args = parser.parse_args(argv)
    for file in args.files:
        if not (ROOT / file).is_file():
            parser.error(f"no such file: {file}")

    if args.list:
        for m in catalogue(ROOT, args.files)[0]:
            print(json.dumps(dataclasses.asdict(m)))
        return 0

    started = time.monotonic()
    log = sys.stderr
    temp = Path(tempfile.mkdtemp(prefix="asyncflow-mutation-"))
    try:
        copies = [temp / f"copy{i}" for i in range(max(1, args.jobs))]
        commit = _commit()  # the tree the mutants run on: as copied now, not at the end
        copy_repo(ROOT, copies[0])
        for copy in copies[1:]:
            shutil.copytree(copies[0], copy)
        mutants, functions = catalogue(copies[0], args.files)
        threads = max(1, (os.cpu_count() or 1) // len(copies))
        print(
            f"mutation: {len(mutants)} mutants in {len(args.files)} files; copies in {temp}; "
            "baseline run of the law tests...",
            file=log,
            flush=True,
        )
        base = baseline(copies, temp / "work", args.tests, args.files, 600.0, threads)
        print(
            f"mutation: baseline {len(base.passed)} tests passed in {base.wall_s:.0f} s "
            f"({len(base.failed)} failed, left out)",
            file=log,
            flush=True,
        )
        for t in base.failed:
            print(f"  left out (failed unmutated): {t.nodeid}: {t.message[:200]}", file=log)

        by_id = {m.id: m for m in mutants}
        unreached = [m for m in mutants if m.category == "code" and not units_for(m, base)]
        if args.ids:
            unknown = [i for i in args.ids if i not in by_id]
            if unknown:
                parser.error(f"unknown mutant ids: {unknown}")
            sample = [by_id[i] for i in args.ids]
        else:
            pool = [
                m
                for m in mutants
                if (m.category == "code" or args.include_skipped) and units_for(m, base)
            ]
            sample = draw(pool, args.sample, args.seed)

        runner = Runner(copies, temp / "work", base, args.files, args.timeout)
        if not args.no_sanity:
            sanity_check(runner, functions, sorted({m.file for m in sample}), log)

        outcomes: list[Outcome] = []
        done_at = time.monotonic()
        with worker_pool(len(copies)) as pool_:
            futures = []
            for m in sample:
                # a mutant run by --ids in a function no law calls: every test that calls into
                # its file
                units = units_for(m, base) or base.files.get(m.file, set())
                try:
                    source = mutated_source(runner.originals[m.file], m)
                except Exception as exc:  # an operator that cannot rewrite this node
                    job = Job(m.id, m.file, m.line, m.definition, m.operator, None, frozenset())
                    why = f"cosmic-ray could not apply {m.operator} here: {exc!r}"
                    outcomes.append(Outcome(job, [], Verdict("error", {}, [], why), 0, 0.0))
                    print(f"mutant {m.id}: error: {why}", file=log, flush=True)
                    continue
                job = Job(m.id, m.file, m.line, m.definition, m.operator, source, frozenset(units))
                futures.append(pool_.submit(runner.run, job))
            for i, future in enumerate(as_completed(futures), 1):
                o = future.result()
                outcomes.append(o)
                elapsed = time.monotonic() - done_at
                eta = elapsed / i * (len(futures) - i)
                where = ", ".join(f"{k}:{v}" for k, v in sorted(o.verdict.laws.items()))
                print(
                    f"mutant {i}/{len(futures)} {o.verdict.verdict:9s} {o.job.id} "
                    f"line {o.job.line} ({o.tests} tests, {o.wall_s:.0f} s; {where}) elapsed "
                    f"{_clock(time.monotonic() - started)} ETA {_clock(eta)}",
                    file=log,
                    flush=True,
                )
        order = {m.id: i for i, m in enumerate(sample)}
        outcomes.sort(key=lambda o: order[o.job.id])
        wall = time.monotonic() - started
        per_law, per_file = summarize(outcomes, mutants, unreached, args.files)
        tables = render_tables(per_law, per_file)
        print(tables)
        totals = Counter(o.verdict.verdict for o in outcomes)
        not_reached: Counter[tuple[str, str]] = Counter((m.file, m.definition) for m in unreached)
        summary = {
            "sampled": len(outcomes),
            **{v: totals.get(v, 0) for v in VERDICTS},
            "score": score(totals),
            "not_reached": len(unreached),
            "baseline_tests": len(base.passed),
            "baseline_s": round(base.wall_s, 1),
            "mean_mutant_s": round(sum(o.wall_s for o in outcomes) / max(1, len(outcomes)), 1),
            "wall_s": round(wall, 1),
            "per_law": per_law,
            "per_file": {f: {**c, "score": score(c)} for f, c in per_file.items()},
            "report": str(args.out.with_suffix(".json")),
        }
        report = {
            "command": " ".join(
                ["tools/mutation.py", *(argv if argv is not None else sys.argv[1:])]
            ),
            "commit": commit,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "seed": args.seed,
            "sample": args.sample,
            "timeout_s": args.timeout,
            "jobs": args.jobs,
            "files": args.files,
            "tests": args.tests,
            "baseline_left_out": [t.nodeid for t in base.failed],
            "wall_s": wall,
            "tables": tables,
            "summary": summary,
            "not_reached": {f"{f}::{d}": n for (f, d), n in sorted(not_reached.items())},
            "mutants": [_outcome_json(o) for o in outcomes],
        }
        write_report(args.out, report, outcomes)
        print(json.dumps(summary))
        return 0
    finally:
        kill_live()
        if args.keep:
            print(f"mutation: copies kept in {temp}", file=log)
        else:
            shutil.rmtree(temp, ignore_errors=True)


def sanity_check(
    runner: Runner, functions: Sequence[Function], files: Sequence[str], log: Any
) -> None:
    """A mutant per file that must be killed: an AssertionError on entry to the function the
    most tests call. Stops the run (exit 3) when one is not."""
    jobs = []
    for file in files:
        reached = [(units_for(f, runner.base), f) for f in functions if f.file == file]
        candidates = [(units, f) for units, f in reached if units and f.body_line]
        if not candidates:
            continue
        units, fn = max(candidates, key=lambda c: (len(c[0]), -c[1].lines[0]))
        source = sanity_source(runner.originals[file], fn)
        id = f"{file}:sanity:{fn.definition}"
        jobs.append(Job(id, file, fn.body_line, fn.definition, "sanity", source, frozenset(units)))
    with worker_pool(len(runner.copies)) as pool:
        for future in as_completed([pool.submit(runner.run, job) for job in jobs]):
            o = future.result()
            print(
                f"mutation: sanity mutant {o.job.id}: {o.verdict.verdict} ({o.wall_s:.0f} s)",
                file=log,
                flush=True,
            )
            if o.verdict.verdict != "killed":
                sys.exit(
                    f"mutation: the sanity mutant {o.job.id} was not killed "
                    f"({o.verdict.reason}); the tests may not run the copy"
                )


def render_tables(
    per_law: Mapping[str, Mapping[str, int]], per_file: Mapping[str, Mapping[str, int]]
) -> str:
    law_rows = [
        [law, *(c.get(v, 0) for v in VERDICTS), sum(c.values())] for law, c in per_law.items()
    ]
    file_rows = []
    for file, c in per_file.items():
        skipped = sum(n for k, n in c.items() if k.startswith("skipped:"))
        file_rows.append(
            [
                file,
                c.get("enumerated", 0),
                skipped,
                c.get("not-reached", 0),
                c.get("sampled", 0),
                *(c.get(v, 0) for v in VERDICTS),
                score(c) if score(c) is not None else "-",
            ]
        )
    return "\n\n".join(
        [
            table(
                "per law file (a mutant counts under each law file whose tests it ran)",
                ["law file", *VERDICTS, "mutants"],
                law_rows,
            ),
            table(
                "per mutated file (score: killed / (killed + survived + timed-out))",
                ["file", "mutants", "skipped", "not-reached", "sampled", *VERDICTS, "score"],
                file_rows,
            ),
        ]
    )


def _commit() -> str:
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()
    return f"{head or 'unknown'}{' (dirty tree)' if dirty else ''}"


if __name__ == "__main__":
    sys.exit(main())
