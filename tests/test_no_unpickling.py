"""Nothing a stranger could write is unpickled: every call in the repository's source that
unpickles sits in a file and function listed in SECURITY.md's "Places that deserialize" table
(whose rows say who can write the data), and every file that table lists exists.

The source (``asyncflow_core``, ``adapters``, ``reference``, ``conformance``, ``tools``,
``benchmarks``, ``examples``; not ``tests``) is read with ``ast``, imports resolved, so
``import pickle as p; p.loads(b)`` and ``from ray import cloudpickle`` are found; a name bound
otherwise stands for the module it is named after (``ray = import_ray()``). Flagged: a
call to, or a reference to, ``pickle.load``/``loads``/``Unpickler`` (``_pickle`` too),
``cloudpickle.load``/``loads`` (``ray.cloudpickle`` too), ``marshal.load``/``loads``, anything
``dill`` loads, ``joblib.load``, ``shelve.open``, ``pandas.read_pickle``; ``torch.load``
without ``weights_only=True``; ``numpy.load`` with ``allow_pickle`` other than ``False``; and,
in a file that imports ``multiprocessing``, any ``.recv`` (``Connection.recv`` unpickles).

Limits: a call through a name bound some other way (``f = getattr(pickle, "loads")``,
``importlib.import_module("pickle")``), a
``.recv()`` on a Connection handed to a file that does not import ``multiprocessing``, and
third-party code that unpickles on our behalf (DeepSpeed's loader, Ray's object store) are not
seen: those are listed in the table by hand."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("asyncflow_core", "adapters", "reference", "conformance", "tools", "benchmarks",
           "examples")  # fmt: skip
SECURITY = ROOT / "SECURITY.md"
SECTION = "## Places that deserialize"

UNPICKLES = {
    "pickle.load", "pickle.loads", "pickle.Unpickler", "pickle._load", "pickle._loads",
    "pickle._Unpickler", "_pickle.load", "_pickle.loads", "_pickle.Unpickler",
    "cloudpickle.load", "cloudpickle.loads", "ray.cloudpickle.load", "ray.cloudpickle.loads",
    "marshal.load", "marshal.loads", "joblib.load", "shelve.open", "shelve.Shelf",
    "shelve.DbfilenameShelf", "pandas.read_pickle",
    "multiprocessing.connection.Connection.recv",
}  # fmt: skip
TORCH_LOAD = {"torch.load", "torch.serialization.load"}
NUMPY_LOAD = {"numpy.load"}


@dataclass(frozen=True)
class Finding:
    file: str  # relative to the scanned root, with /
    line: int
    function: str  # Class.method, outer.inner, or <module>
    call: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.function}: {self.call}"


class _Scanner(ast.NodeVisitor):
    def __init__(self, file: str, tree: ast.Module) -> None:
        self.file = file
        self.scope: list[str] = []
        self.found: list[Finding] = []
        self.aliases: dict[str, str] = {}
        self.multiprocessing = False
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.aliases[a.asname] = a.name
                    else:
                        top = a.name.split(".")[0]
                        self.aliases[top] = top
                    self.multiprocessing |= "multiprocessing" in a.name.split(".")
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                self.multiprocessing |= "multiprocessing" in node.module.split(".")
        self.handled: set[int] = set()  # ids of call targets already judged as calls

    def _name(self, node: ast.expr) -> str | None:
        """The dotted name ``node`` refers to, its root resolved through the imports (a root
        bound otherwise, ``ray = import_ray()``, stands for the module of its name)."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = self._name(node.value)
            return f"{base}.{node.attr}" if base is not None else None
        return None

    def _report(self, node: ast.AST, what: str) -> None:
        where = ".".join(self.scope) or "<module>"
        self.found.append(Finding(self.file, getattr(node, "lineno", 0), where, what))

    def _scoped(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Call(self, node: ast.Call) -> None:
        name = self._name(node.func)
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        if name in TORCH_LOAD:
            safe = kw.get("weights_only")
            if not (isinstance(safe, ast.Constant) and safe.value is True):
                self._report(node, f"{name} without weights_only=True")
            self.handled.add(id(node.func))
        elif name in NUMPY_LOAD:
            allow = kw.get("allow_pickle")
            if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
                self._report(node, f"{name} with allow_pickle")
            self.handled.add(id(node.func))
        self.generic_visit(node)

    def _reference(self, node: ast.Name | ast.Attribute) -> None:
        if id(node) in self.handled:
            return
        name = self._name(node)
        if name is not None and (name in UNPICKLES or name.startswith("dill.load")
                                 or name in TORCH_LOAD):  # fmt: skip
            self._report(node, name)
            return  # its parts (``pickle`` of ``pickle.loads``) are not findings of their own
        if isinstance(node, ast.Attribute) and node.attr == "recv" and self.multiprocessing:
            self._report(node, f"{ast.unparse(node)} (Connection.recv unpickles)")
        self.generic_visit(node)

    visit_Name = visit_Attribute = _reference


def scan_file(path: Path, rel: str) -> list[Finding]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
    scanner = _Scanner(rel, tree)
    scanner.visit(tree)
    return scanner.found


def scan(root: Path, folders: tuple[str, ...]) -> list[Finding]:
    out: list[Finding] = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root)
            if any(p.startswith(".venv") or p in ("tests", "__pycache__") for p in rel.parts):
                continue
            out += scan_file(path, rel.as_posix())
    return out


@dataclass(frozen=True)
class Row:
    what: str
    files: frozenset[str]
    names: frozenset[str]


def table_rows(text: str) -> list[Row]:
    """The "Places that deserialize" table: per row, the files its "Where" column names (code
    spans with a ``/``) and the functions (every other code span, and each dotted part)."""
    assert SECTION in text, f"SECURITY.md has no {SECTION!r} section"
    lines = text.split(SECTION, 1)[1].splitlines()
    table = []
    for line in lines:
        if line.startswith("|"):
            table.append(line)
        elif table:
            break
    header = [c.strip() for c in table[0].strip("|").split("|")]
    where_col = next(i for i, c in enumerate(header) if c.lower().startswith("where"))
    rows = []
    for line in table[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        spans = re.findall(r"`([^`]+)`", cells[where_col])
        files = {s for s in spans if "/" in s}
        names = set()
        for s in spans:
            if s not in files:
                names.add(s)
                names.update(re.findall(r"[A-Za-z_<][\w>]*", s))
        rows.append(Row(cells[0], frozenset(files), frozenset(names)))
    return rows


def listed(finding: Finding, rows: list[Row]) -> bool:
    parts = finding.function.split(".")
    candidates = {finding.function, ".".join(parts[-2:]), parts[-1]}
    return any(finding.file in r.files and candidates & r.names for r in rows)


def test_every_unpickling_call_is_in_the_security_table() -> None:
    rows = table_rows(SECURITY.read_text(encoding="utf-8"))
    found = scan(ROOT, SOURCES)
    # the scan sees the known places (it reads the right folders and resolves imports)
    known = {(f.file, f.function) for f in found}
    assert ("asyncflow_core/engines/process.py", "_portable") in known
    assert ("adapters/asyncflow_ray/engines.py", "_portable") in known
    missing = [str(f) for f in found if not listed(f, rows)]
    assert not missing, (
        "these calls unpickle (or may) but SECURITY.md's 'Places that deserialize' table does "
        "not list their file and function; stop unpickling there, or add them to the table "
        "with who can write the data:\n" + "\n".join(missing)
    )


def test_the_security_table_names_only_files_that_exist() -> None:
    rows = table_rows(SECURITY.read_text(encoding="utf-8"))
    assert len(rows) >= 10
    gone = [f"{r.what}: {f}" for r in rows for f in sorted(r.files) if not (ROOT / f).exists()]
    assert not gone, "SECURITY.md's table names files that do not exist:\n" + "\n".join(gone)


# ----------------------------------------------------------------------------------------------
# the scanner and the table reader can fail
# ----------------------------------------------------------------------------------------------
SNIPPET = """
import pickle
import pickle as pk
import marshal
import multiprocessing
import numpy as np
import torch as t
from pickle import loads as l
from ray import cloudpickle
import dill

def plain(x):
    return pickle.loads(x)

class Server:
    def read(self, f):
        return pk.load(f)

    async def run(self, loop):
        def inner(b):
            return l(b) or cloudpickle.loads(b) or marshal.loads(b) or dill.loads(b)
        await loop.run_in_executor(None, self.conn.recv)
        return self.conn.recv(), inner

def tensors(p, ray):
    t.load(p)
    t.load(p, weights_only=False)
    t.load(p, weights_only=True)
    np.load(p, allow_pickle=True)
    np.load(p)
    np.load(p, allow_pickle=False)
    return pickle.dumps(p), ray.cloudpickle.loads(p)

fn = pickle.Unpickler
"""


def test_the_scanner_reports_each_kind_of_unpickling(tmp_path: Path) -> None:
    (tmp_path / "mod.py").write_text(SNIPPET)
    found = {(f.line, f.function, f.call) for f in scan_file(tmp_path / "mod.py", "mod.py")}
    assert found == {
        (13, "plain", "pickle.loads"),
        (17, "Server.read", "pickle.load"),
        (21, "Server.run.inner", "pickle.loads"),
        (21, "Server.run.inner", "ray.cloudpickle.loads"),
        (21, "Server.run.inner", "marshal.loads"),
        (21, "Server.run.inner", "dill.loads"),
        (22, "Server.run", "self.conn.recv (Connection.recv unpickles)"),
        (23, "Server.run", "self.conn.recv (Connection.recv unpickles)"),
        (26, "tensors", "torch.load without weights_only=True"),
        (27, "tensors", "torch.load without weights_only=True"),
        (29, "tensors", "numpy.load with allow_pickle"),
        (32, "tensors", "ray.cloudpickle.loads"),
        (34, "<module>", "pickle.Unpickler"),
    }


def test_the_table_reader_matches_file_and_function() -> None:
    text = f"""# Security

{SECTION}

| What | Where (file: function) | Format |
|---|---|---|
| Pipes | `a/mod.py`: `Server.read`, the child's `run` (`Connection.recv`) | pickle |
| Gone | `a/gone.py`: `f` | pickle |

## Next
"""
    rows = table_rows(text)
    assert [r.what for r in rows] == ["Pipes", "Gone"]
    assert rows[0].files == {"a/mod.py"}

    def finding(file: str, function: str) -> Finding:
        return Finding(file, 1, function, "pickle.loads")

    assert listed(finding("a/mod.py", "Server.read"), rows)
    assert listed(finding("a/mod.py", "Server.run.inner"), rows) is False
    assert listed(finding("a/mod.py", "Worker.run"), rows)  # the child's `run`
    assert not listed(finding("a/mod.py", "plain"), rows)
    assert not listed(finding("a/other.py", "Server.read"), rows)
    assert not listed(finding("a/gone.py", "g"), rows)
