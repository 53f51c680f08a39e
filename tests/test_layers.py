"""The layout is the architecture: ``asyncflow_core`` is split into layers and a module imports
only from its own layer or the ones below; the core imports no engine package; the adapters
and the reference backend sit beside each other above the core; the conformance package has
no import cycle. Imports are read from the source with ``ast`` (those inside functions too),
with the module names given to ``importlib.import_module`` as string literals and the
packages' entry points.

Issue #26 removed the last known leaks (the CLI loading the main job and the simulator from the
reference package by name; the main job, then in ``reference/``, building the Ray runtime):
``KNOWN`` is empty and stays so. The main job (``asyncflow_core.job``) finds workloads, engines,
runtimes and CLI commands through entry points only."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

import asyncflow_core

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "asyncflow_core"

# bottom to top: a module may import its own layer and the ones listed before it
LAYERS = [
    "contracts",  # protocols, errors
    "observability",  # trace
    "infra",  # platform, httpclient, checkpoint
    "data",  # scheduling, controller, store, notify
    "training",  # rl, sampling
    "sync",  # weightsync
    "engines",  # enginekit, process, lmtrain, registry
    "flow",  # workflow, staleness, vclock, rlflow, agent, chat, tools, config
    "job",  # the main job: config, run, report, command
    "cli",  # asyncflow_core/cli.py
]
RANK = {name: i for i, name in enumerate(LAYERS)}
# the old flat module paths: aliases of the moved modules for one release (see MOVED)
MOVED = {
    "errors": "contracts", "protocols": "contracts", "trace": "observability",
    "platform": "infra", "httpclient": "infra", "checkpoint": "infra",
    "scheduling": "data", "controller": "data", "store": "data", "notify": "data",
    "rl": "training", "sampling": "training", "weightsync": "sync",  # split: SPLIT
    "enginekit": "engines", "process": "engines", "lmtrain": "engines", "registry": "engines",
    "workflow": "flow", "staleness": "flow", "vclock": "flow", "rlflow": "flow",
    "agent": "flow", "chat": "flow", "tools": "flow", "config": "flow",
}  # fmt: skip
# old modules split in two: the old path re-exports the public names of both
SPLIT = {"weightsync": ("sync.transports", "sync.strategies")}
ENGINE_PACKAGES = {
    "asyncflow_reference", "asyncflow_deepspeed", "asyncflow_vllm", "asyncflow_sglang",
    "asyncflow_ascend", "asyncflow_ray", "asyncflow_hf", "asyncflow_serve", "asyncflow_tq",
}  # fmt: skip
ADAPTERS = ENGINE_PACKAGES - {"asyncflow_reference"}

# (importing module, imported top-level package): known leaks; none left (an entry that no
# longer occurs fails the test, so the list could only shrink)
KNOWN: set[tuple[str, str]] = set()
# old paths outside the core: aliases of moved modules for one release, imported nowhere here
OLD_PATHS = {"asyncflow_reference.job": ("asyncflow_core.job", "asyncflow_reference.workloads")}


def _module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str) -> Iterator[str]:
    """Every module ``path`` (module ``module``) imports, as absolute names (relative imports
    resolved), in functions too, and the string literals it hands to
    ``importlib.import_module``."""
    tree = ast.parse(path.read_text(), str(path))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])])
            yield target
            for a in node.names:  # ``from asyncflow_core.data import store``
                yield f"{target}.{a.name}"
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name == "import_module" and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    yield arg.value


def _sources(*dirs: Path) -> Iterator[tuple[str, Path]]:
    for d in dirs:
        for path in sorted(d.rglob("*.py")):
            if ".egg-info" not in str(path):
                yield _module_name(path, d.parent), path


def _core_layer(module: str) -> str | None:
    """The layer of an ``asyncflow_core`` module (None: the package itself, an old alias)."""
    parts = module.split(".")
    if parts[0] != "asyncflow_core" or len(parts) == 1:
        return None
    if parts[1] in RANK:  # a layer folder, or cli.py
        return parts[1]
    return None  # an alias of a moved module (it imports its new home)


def test_core_layers_import_only_downward() -> None:
    bad = []
    modules = 0
    for name, path in _sources(CORE):
        mine = _core_layer(name)
        if mine is None:
            continue
        modules += 1
        for dep in _imports(path, name):
            theirs = _core_layer(dep)
            parts = dep.split(".")
            if parts[0] == "asyncflow_core" and len(parts) > 1 and parts[1] in MOVED:
                bad.append(f"{name} imports {dep}: an old path, import the new one")
                continue
            if theirs is not None and RANK[theirs] > RANK[mine]:
                bad.append(f"{name} ({mine}) imports {dep} ({theirs}), a layer above it")
    assert modules >= 25, "the layer folders were not found"
    assert not bad, "\n".join(bad)


def test_nothing_here_imports_an_old_path() -> None:
    """The aliases are for users: every file of this repository imports the new paths."""
    dirs = ["asyncflow_core", "adapters", "reference", "conformance", "tests", "benchmarks"]
    dirs += ["examples", "tools"]
    bad = []
    for d in dirs:
        for path in sorted((ROOT / d).rglob("*.py")):
            if ".egg-info" in str(path) or (path.parent == CORE and path.stem in MOVED):
                continue
            module = _module_name(path, ROOT)
            if module.endswith(tuple(OLD_PATHS)):  # the alias itself
                continue
            for dep in _imports(path, module):
                parts = dep.split(".")
                if parts[0] == "asyncflow_core" and len(parts) > 1 and parts[1] in MOVED:
                    bad.append(f"{path.relative_to(ROOT)}: {dep}")
                if any(dep == old or dep.startswith(old + ".") for old in OLD_PATHS):
                    bad.append(f"{path.relative_to(ROOT)}: {dep}")
    assert not bad, "old module paths imported:\n" + "\n".join(sorted(set(bad)))


def _leaks() -> set[tuple[str, str]]:
    """(module, package) for every import across the boundaries the layout promises."""
    found: set[tuple[str, str]] = set()
    for name, path in _sources(CORE):
        for dep in _imports(path, name):
            if dep.split(".")[0] in ENGINE_PACKAGES | {"asyncflow_conformance"}:
                found.add((name, dep.split(".")[0]))
    adapters = [p for p in sorted((ROOT / "adapters").iterdir()) if (p / "__init__.py").exists()]
    for name, path in _sources(*adapters):
        for dep in _imports(path, name):
            top = dep.split(".")[0]
            other_adapter = top in ADAPTERS and top != name.split(".")[0]
            if top == "asyncflow_reference" or (other_adapter and not _adapter_may_use(name, top)):
                found.add((name, top))
    for name, path in _sources(ROOT / "reference" / "asyncflow_reference"):
        for dep in _imports(path, name):
            if dep.split(".")[0] in ADAPTERS:
                found.add((name, dep.split(".")[0]))
    return found


def _adapter_may_use(name: str, other: str) -> bool:
    """Adapters built on another adapter: vllm-ascend rides on the vLLM adapter; the Ray
    runtime hosts any engine; the TransferQueue facade wraps the Ray store."""
    allowed = {
        "asyncflow_ascend": {"asyncflow_vllm"},
        "asyncflow_tq": {"asyncflow_ray"},
        "asyncflow_serve": {"asyncflow_hf"},
    }
    return other in allowed.get(name.split(".")[0], set())


def test_no_engine_package_below_the_core_and_adapters_beside_the_reference() -> None:
    found = _leaks()
    new = sorted(found - KNOWN)
    assert not new, (
        "imports across the layout's boundaries (the core imports no engine package; an "
        f"adapter does not import asyncflow_reference nor the reverse): {new}"
    )
    fixed = sorted(KNOWN - found)
    assert not fixed, f"no longer imported, take them off KNOWN: {fixed}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


@pytest.mark.parametrize(
    "package", ["asyncflow_core", "asyncflow_conformance", "asyncflow_reference"]
)
def test_no_import_cycles_between_modules(package: str) -> None:
    base = {
        "asyncflow_core": CORE,
        "asyncflow_conformance": ROOT / "conformance" / "asyncflow_conformance",
        "asyncflow_reference": ROOT / "reference" / "asyncflow_reference",
    }[package]
    names = {name for name, _ in _sources(base)}
    graph: dict[str, set[str]] = {}
    for name, path in _sources(base):
        if package == "asyncflow_core" and _core_layer(name) is None:
            continue  # the package facade and the old-path aliases import everything
        deps = set()
        for dep in _imports(path, name):
            while dep and dep not in names:
                dep = dep.rpartition(".")[0]
            if dep and dep != name and dep != package and not name.startswith(dep + "."):
                deps.add(dep)
        graph[name] = deps
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


PUBLIC = [
    "AdmissionController", "AdmissionStats", "AgentLoop", "AsyncFlowError", "BadRequestError",
    "Batch", "BatchMeta", "BlockingUpdate", "BroadcastGroup", "Candidates", "Capacity",
    "CapacityError", "CellAlreadyWrittenError", "CheckpointError", "Checkpoints", "ConfigError",
    "Controller", "DEFAULT_GET_TIMEOUT_S", "DEFAULT_LEASE_S", "DataStore", "DataStoreError",
    "DiskWeightSync", "DistributedWeightReceiver", "DistributedWeightSync", "EngineError",
    "EngineGroupWeightSync", "EngineLostError", "EngineUnavailableError", "EnvironmentFault",
    "FieldSchema",
    "GenerationClient", "GenerationRequest", "GenerationResult", "GroupReceiver",
    "GroupSampler", "GroupWire", "HostBuffer", "InProcessDataStore", "InProcessWeightSync",
    "InferenceEngine", "LeaseError", "LeaseExpiredError", "MemoryStats", "MissingExtraError",
    "NO_VERSION", "PartitionClosedError", "PartitionExistsError", "PartitionStats",
    "PeerRankError", "Pipeline", "PipelineError", "PipelineResult", "Platform",
    "PlatformError", "PlatformUnavailableError", "RankAwareSampler", "RequestRouter",
    "SampleRequest", "SamplerError", "SamplingParams", "Scheduler", "SchemaError", "Selection",
    "SequentialSampler", "Source", "Span", "StagedUpdate", "StalenessSampler", "StorageUnit",
    "SupportsOwnTransport", "SupportsWeightFingerprints", "SyncVerificationError",
    "TensorFingerprint", "VerifyReport", "verify_engine",
    "StorageUnitError", "StorageUnitLostError", "StoreLostError", "StoreTimeoutError",
    "SupportsLoadWeights", "SupportsPause", "SupportsProgress", "SupportsRankReplay",
    "SupportsRestart", "SupportsSleep", "SyncTiming", "Tags", "Task", "TaskFailedError",
    "TaskOutput", "TokenBalancedSampler", "Tracer", "TrainEngine", "TrainMetrics",
    "Trajectory", "TrajectoryLimitReached", "TrajectoryLimits", "Turn", "UnknownFieldError",
    "UnknownPartitionError", "UnknownRowError", "UnknownTaskError", "UnsupportedEngineError",
    "Version", "WeightBucket", "WeightSync", "WeightSyncError", "WeightSyncGroup",
    "__version__", "bucketize", "current_platform", "folds_ack", "get_meta_after_ack",
    "karmarkar_karp", "read_weights", "register_platform", "select_platform", "set_platform",
    "use_platform",
]  # fmt: skip


def test_every_public_name_still_imports() -> None:
    """``from asyncflow_core import X`` for every name exported before the split (an addition
    is added here; a removal is a documented break)."""
    assert sorted(asyncflow_core.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(asyncflow_core, name) is not None, name


def test_old_module_paths_are_aliases_that_warn() -> None:
    """``import asyncflow_core.store`` (a path before the split) still works for one release:
    it is the moved module itself (so patching it patches the code) and warns where it moved.
    A module split in two (``SPLIT``) re-exports both halves' public names."""
    script = f"""
import importlib, json, warnings
out = {{}}
for old, layer in {MOVED!r}.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = importlib.import_module("asyncflow_core." + old)
    msgs = [str(w.message) for w in caught if w.category is DeprecationWarning]
    halves = {SPLIT!r}.get(old)
    if halves is None:
        same = mod is importlib.import_module(f"asyncflow_core.{{layer}}.{{old}}")
    else:
        news = [importlib.import_module("asyncflow_core." + h) for h in halves]
        names = [n for m in news for n in vars(m) if not n.startswith("_")
                 and getattr(vars(m)[n], "__module__", None) == m.__name__]
        same = bool(names) and all(
            getattr(mod, n, None) is getattr(m, n) for m in news for n in vars(m)
            if n in names
        )
    out[old] = [same, msgs]
print(json.dumps(out))
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT
    )
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(got) == set(MOVED)
    for old, (same, warned) in got.items():
        assert same, f"asyncflow_core.{old} does not give the moved names"
        where = SPLIT.get(old, (f"{MOVED[old]}.{old}",))
        for new in where:
            assert any(f"asyncflow_core.{new}" in w for w in warned), (old, warned)


def test_the_main_jobs_old_path_is_an_alias_that_warns() -> None:
    """``asyncflow_reference.job`` (the main job before it left ``reference/``) still imports
    for one release: it warns where the names went and gives the moved objects themselves,
    ``RunConfig`` being the reference workloads' config class."""
    script = """
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import asyncflow_reference.job as old
import asyncflow_core.job as job
import asyncflow_reference.workloads as workloads
same = all(getattr(old, n) is getattr(job, n, getattr(workloads, n, None)) for n in old.__all__
           if n != "RunConfig")
print(json.dumps([same, old.RunConfig is workloads.ReferenceRunConfig,
                  [str(w.message) for w in caught if w.category is DeprecationWarning]]))
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT
    )
    same, run_config, warned = json.loads(proc.stdout.strip().splitlines()[-1])
    assert same and run_config
    assert any("asyncflow_core.job" in w and "asyncflow_reference.workloads" in w for w in warned)


def test_every_layer_opens_with_its_job() -> None:
    for layer in LAYERS[:-1]:
        mod = importlib.import_module(f"asyncflow_core.{layer}")
        doc = (mod.__doc__ or "").strip()
        assert doc and "\n" not in doc, f"asyncflow_core.{layer} needs a one-line docstring"


def test_entry_points_plug_engine_packages_into_the_core() -> None:
    """The core finds workloads, engines and platforms through entry-point groups; each entry
    points into an engine package (a dependency upward would be a core module registered as a
    plugin of itself), at a module that exists."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    groups = data["project"]["entry-points"]
    assert {
        "asyncflow.workloads", "asyncflow.rollout_engines", "asyncflow.train_engines",
        "asyncflow.runtimes", "asyncflow.commands",
    } <= set(groups)  # fmt: skip
    roots = {"asyncflow_reference": ROOT / "reference"}
    roots |= {name: ROOT / "adapters" for name in ADAPTERS}
    for group, entries in groups.items():
        for key, target in entries.items():
            module = target.split(":")[0]
            top = module.split(".")[0]
            assert top in ENGINE_PACKAGES, f"{group} {key} = {target}: not an engine package"
            path = roots[top].joinpath(*module.split("."))
            assert path.with_suffix(".py").exists() or (path / "__init__.py").exists(), target
