"""The platform layer (``asyncflow_core.infra.platform``) and the Ascend platform's paths that can
be checked without Ascend hardware: selection when ``torch_npu`` is absent, and when it is installed
but CANN is not (the real torch_npu wheel, installed by ``make`` into ``.venv/torch-npu-probe`` and
put on ``PYTHONPATH`` of a child process only); plugins registered through a real entry point (a
distribution written into a temporary folder); and the hccl transport's bucketing, run through
``NPUPlatform.new_process_group`` with torch_npu's process-group class stood in for by gloo."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import types
import warnings
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from asyncflow_ascend import NPUPlatform

import asyncflow_core.infra.platform as plat
from asyncflow_core.contracts.errors import (
    ConfigError,
    MissingExtraError,
    PlatformError,
    PlatformUnavailableError,
    WeightSyncError,
)
from asyncflow_core.engines.process import free_port
from asyncflow_core.infra.platform import (
    CpuPlatform,
    Platform,
    current_platform,
    get_platform,
    platform_for_backend,
    platforms,
    register_platform,
    select_platform,
    set_platform,
    use_platform,
)
from asyncflow_core.sync.transports import (
    DistributedWeightReceiver,
    DistributedWeightSync,
    WeightSyncGroup,
    bucketize,
    default_backend,
)

ROOT = Path(__file__).resolve().parent.parent
NPU_PROBE = ROOT / ".venv" / "torch-npu-probe"
NO_ACCELERATOR = not torch.cuda.is_available() and not NPUPlatform().is_available()


@pytest.fixture(autouse=True)
def registry() -> Iterator[None]:
    """Every test leaves the process's platform registry as it found it."""
    with plat.preserved_registry():
        yield


def child(code: str, *, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=full,
        cwd=ROOT,
    )


# --------------------------------------------------------------------------------------------
# Built-ins, selection, errors
# --------------------------------------------------------------------------------------------
def test_the_builtin_platforms_and_the_npu_plugin_are_listed_with_their_sources() -> None:
    listed = {p["name"]: p for p in platforms()}
    assert listed["cpu"]["source"] == "built in" and listed["cpu"]["available"] is True
    assert listed["cpu"]["dist_backend"] == "gloo" and listed["cpu"]["devices"] == 1
    assert listed["cuda"]["dist_backend"] == "nccl"
    assert listed["cuda"]["visible_devices_env"] == "CUDA_VISIBLE_DEVICES"
    npu = listed["npu"]
    assert npu["source"].startswith("entry point npu = asyncflow_ascend.platform:NPUPlatform")
    assert (npu["dist_backend"], npu["ray_resource"], npu["deepspeed_accelerator"]) == (
        "hccl",
        "NPU",
        "npu",
    )
    assert npu["visible_devices_env"] == "ASCEND_RT_VISIBLE_DEVICES"
    assert isinstance(get_platform("npu"), NPUPlatform)


@pytest.mark.skipif(not NO_ACCELERATOR, reason="this machine has an accelerator")
def test_auto_selects_cpu_without_an_accelerator_and_gloo_follows() -> None:
    assert isinstance(select_platform(), CpuPlatform)
    assert isinstance(select_platform("auto"), CpuPlatform)
    set_platform(None)
    assert current_platform().name == "cpu" and default_backend() == "gloo"


@pytest.mark.skipif(NPUPlatform().is_available(), reason="torch_npu runs here")
def test_forcing_npu_without_torch_npu_fails_fast_naming_the_extra_and_cann() -> None:
    before = current_platform()
    with pytest.raises(PlatformUnavailableError) as info:
        set_platform("npu")
    message = str(info.value)
    assert "platform 'npu' cannot run here" in message
    assert "asyncflow[ascend]" in message and "CANN" in message and "set_env.sh" in message
    assert "choose platform 'cpu' (or 'auto')" in message
    # one error, catchable as what it is: a config mistake and a missing extra
    assert isinstance(info.value, ConfigError) and isinstance(info.value, MissingExtraError)
    assert current_platform() is before  # a rejected choice changes nothing


@pytest.mark.skipif(NPUPlatform().is_available(), reason="torch_npu runs here")
def test_the_environment_variable_forces_a_platform_and_auto_detects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ASYNCFLOW_PLATFORM", "npu")
    with pytest.raises(PlatformUnavailableError, match=r"^ASYNCFLOW_PLATFORM=npu: platform 'npu'"):
        select_platform()
    assert select_platform("cpu").name == "cpu"  # a name in code wins over the environment
    monkeypatch.setenv("ASYNCFLOW_PLATFORM", "npux")
    with pytest.raises(PlatformError, match=r"unknown platform 'npux' \(did you mean 'npu'\?\)"):
        select_platform()
    monkeypatch.setenv("ASYNCFLOW_PLATFORM", "auto")
    assert select_platform().priority >= 0


def test_unknown_names_list_what_exists_and_how_to_get_npu() -> None:
    with pytest.raises(PlatformError, match=r"unknown platform 'cdua' \(did you mean 'cuda'\?\)"):
        select_platform("cdua")
    with pytest.raises(PlatformError, match="non-empty str"):
        get_platform("")
    plat._registry.platforms.pop("npu")  # as if asyncflow_ascend were not installed
    with pytest.raises(PlatformError, match=r"'npu' comes with pip install 'asyncflow\[ascend\]'"):
        get_platform("npu")


def test_use_platform_restores_the_previous_choice() -> None:
    before = current_platform()
    with use_platform("cpu") as p:
        assert current_platform() is p and p.name == "cpu"
    assert current_platform() is before


def test_cpu_memory_stats_follow_the_process() -> None:
    """In a fresh process: in this one, memory an earlier test freed (and the allocator kept)
    can hold the new block without the resident size growing."""
    script = """
import torch
from asyncflow_core.infra.platform import get_platform
cpu = get_platform("cpu")
before = cpu.memory_stats()
block = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, touched
after = cpu.memory_stats()
assert after.allocated_bytes - before.allocated_bytes > 32 * 1024 * 1024, (before, after)
assert after.total_bytes is not None and after.free_bytes is not None
assert 0 < after.free_bytes < after.total_bytes and after.device == "cpu", after
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_platforms_pickle_as_a_fresh_instance_probed_where_they_land() -> None:
    npu = get_platform("npu")
    npu.unavailable_reason()
    copy = pickle.loads(pickle.dumps(npu))
    assert type(copy) is NPUPlatform and copy is not npu and not copy._probed


def test_backends_map_to_their_platform() -> None:
    assert platform_for_backend("gloo").name == "cpu"
    if not NPUPlatform().is_available():
        with pytest.raises(PlatformUnavailableError, match="platform 'npu' cannot run here"):
            platform_for_backend("hccl")
    with pytest.raises(PlatformError, match="no platform here uses the collective backend 'mpi'"):
        platform_for_backend("mpi")


# --------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------
class LabPlatform(CpuPlatform):
    name = "lab"
    priority = -1


class OtherLab(CpuPlatform):
    name = "lab"


def test_registering_the_same_class_again_is_a_no_op_and_a_clash_changes_nothing() -> None:
    first = register_platform(LabPlatform)
    assert register_platform(LabPlatform) is first
    assert register_platform(LabPlatform()) is first
    with pytest.raises(PlatformError, match=r"'lab' is already registered as LabPlatform"):
        register_platform(OtherLab)
    assert get_platform("lab") is first
    replaced = register_platform(OtherLab, replace=True)
    assert get_platform("lab") is replaced and type(replaced) is OtherLab


def test_registration_checks_the_platform() -> None:
    class Bad(CpuPlatform):
        name = "Bad Name"

    with pytest.raises(PlatformError, match="platform name 'Bad Name' must be lower-case"):
        register_platform(Bad)
    with pytest.raises(PlatformError, match="expected a Platform subclass"):
        register_platform(42)  # type: ignore[arg-type]
    assert "Bad Name" not in plat._registry.platforms


PLUGIN = '''
from asyncflow_core.infra.platform import CpuPlatform


class FakeAccelerator(CpuPlatform):
    """A test platform: the host's CPU under another name, preferred over everything."""

    name = "fakeaccel"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = 50


def make():
    return FakeAccelerator()


class Misnamed(CpuPlatform):
    name = "something-else"


class ImpostorCpu(CpuPlatform):
    name = "cpu"
'''


def write_plugin(folder: Path, entry_points: str, module: str = PLUGIN) -> None:
    """A distribution ``fakeplat`` in ``folder``: its module and a dist-info with the entry
    points, which ``importlib.metadata`` finds once ``folder`` is on ``sys.path``."""
    (folder / "fakeplat.py").write_text(module)
    info = folder / "fakeplat-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeplat\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[asyncflow.platforms]\n{entry_points}\n")


def test_a_platform_plugin_registers_through_the_entry_point_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_plugin(
        tmp_path,
        "fakeaccel = fakeplat:make\n"
        "broken = fakeplat_missing:Nothing\n"
        "misnamed = fakeplat:Misnamed\n"
        "cpu = fakeplat:ImpostorCpu",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(RuntimeWarning) as caught:
        plat.discover(reload=True)
    notes = " | ".join(str(w.message) for w in caught)
    assert "entry point broken = fakeplat_missing:Nothing (from fakeplat) failed to load" in notes
    assert "named 'misnamed' but its platform is named 'something-else'" in notes
    assert "'cpu' is already registered as CpuPlatform (built in)" in notes

    listed = {p["name"]: p for p in platforms()}
    assert listed["fakeaccel"]["source"] == "entry point fakeaccel = fakeplat:make (from fakeplat)"
    assert listed["broken"]["available"] is False
    assert "ModuleNotFoundError" in listed["broken"]["reason"]
    assert listed["cpu"]["source"] == "built in"  # a plugin cannot take a built-in's name
    with pytest.raises(PlatformError, match="platform 'broken' is unusable: entry point broken"):
        select_platform("broken")
    # the highest-priority available platform wins automatic selection
    assert select_platform().name == "fakeaccel"
    # discovery is once per process; reading the entry points again registers nothing twice
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plat.discover(reload=True)
    assert get_platform("fakeaccel") is plat._registry.platforms["fakeaccel"]


def test_a_plugin_in_a_fresh_process_is_chosen_by_name_and_by_the_environment(
    tmp_path: Path,
) -> None:
    write_plugin(tmp_path, "fakeaccel = fakeplat:FakeAccelerator")
    code = """
        from asyncflow_core.infra.platform import current_platform
        from asyncflow_core.sync.transports import default_backend
        p = current_platform()
        print(p.name, type(p).__module__, default_backend())
    """
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = child(code, env={**env, "ASYNCFLOW_PLATFORM": "fakeaccel"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["fakeaccel", "fakeplat", "gloo"]
    out = child(code, env={**env, "ASYNCFLOW_PLATFORM": "cpu"})
    assert out.stdout.split()[0] == "cpu", out.stderr


# --------------------------------------------------------------------------------------------
# torch_npu installed, CANN absent (the real wheel)
# --------------------------------------------------------------------------------------------
needs_probe = pytest.mark.skipif(
    not (NPU_PROBE / "torch_npu").is_dir(),
    reason=f"the torch_npu wheel is not unpacked at {NPU_PROBE} (make venv puts it there)",
)


@needs_probe
def test_with_torch_npu_but_no_cann_importing_asyncflow_explains_the_autoload_failure() -> None:
    out = child("import asyncflow_core", env={"PYTHONPATH": str(NPU_PROBE)})
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "asyncflow_core.contracts.errors.PlatformUnavailableError: import torch failed"
    )
    assert "libhccl.so" in last and "CANN" in last and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in last


@needs_probe
def test_with_torch_npu_but_no_cann_auto_is_cpu_and_npu_is_one_clear_error() -> None:
    code = """
        import importlib.util, json
        from asyncflow_core.contracts.errors import PlatformUnavailableError
        from asyncflow_core.infra.platform import select_platform, platforms
        from asyncflow_core.sync.transports import WeightSyncGroup
        out = {"found": importlib.util.find_spec("torch_npu") is not None}
        out["auto"] = select_platform().name
        try:
            select_platform("npu")
        except PlatformUnavailableError as exc:
            out["npu"] = str(exc)
        try:
            WeightSyncGroup("127.0.0.1", 29500, 0, 2, backend="hccl")
        except Exception as exc:
            out["hccl"] = f"{type(exc).__name__}: {exc}"
        out["listed"] = {p["name"]: p["available"] for p in platforms()}
        print(json.dumps(out))
    """
    env = {"PYTHONPATH": str(NPU_PROBE), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    out = child(code, env=env)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["found"] is True and got["auto"] == "cpu"
    assert "torch_npu is installed but does not load (ImportError: libhccl.so" in got["npu"]
    assert "CANN toolkit's libraries are not loadable" in got["npu"]
    assert "asyncflow[ascend]" in got["npu"]
    assert got["hccl"].startswith("WeightSyncError: WeightSyncGroup: backend 'hccl' cannot run")
    assert got["listed"]["npu"] is False


# --------------------------------------------------------------------------------------------
# The hccl transport, through NPUPlatform's own process-group code, on gloo
# --------------------------------------------------------------------------------------------
class NPUOverGloo(NPUPlatform):
    """``NPUPlatform`` with the device on the host: its ``new_process_group`` runs as is, on
    the stand-in for torch_npu's ``ProcessGroupHCCL`` below."""

    calls: list[str] = []  # noqa: RUF012  (shared by the two ranks' threads)

    def _probe(self) -> str | None:
        return None

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def synchronize(self, device: torch.device | None = None) -> None:
        self.calls.append("synchronize")


def hccl_stand_in() -> types.ModuleType:
    """``torch_npu._C._distributed_c10d`` as far as ``NPUPlatform.new_process_group`` uses it:
    ``ProcessGroupHCCL.Options`` (``_timeout``, ``is_high_priority_stream``) and
    ``ProcessGroupHCCL(store, rank, size, options)`` — here a gloo group."""
    from torch.distributed import ProcessGroupGloo

    class Options:
        _timeout: timedelta | None = None
        is_high_priority_stream = True

    def ProcessGroupHCCL(store: Any, rank: int, size: int, options: Options) -> Any:
        assert isinstance(options._timeout, timedelta) and not options.is_high_priority_stream
        NPUOverGloo.calls.append(f"hccl group rank {rank} of {size}")
        return ProcessGroupGloo(store, rank, size, options._timeout)

    ProcessGroupHCCL.Options = Options  # type: ignore[attr-defined]
    module = types.ModuleType("torch_npu._C._distributed_c10d")
    module.ProcessGroupHCCL = ProcessGroupHCCL  # type: ignore[attr-defined]
    return module


def test_the_hccl_transport_buckets_through_the_npu_platform_code_path_on_gloo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu._C._distributed_c10d", hccl_stand_in())
    NPUOverGloo.calls = []
    register_platform(NPUOverGloo, replace=True)
    port = free_port()
    g = torch.Generator().manual_seed(0)
    weights = [
        ("embed", torch.randn(300, 16, generator=g)),
        ("bias", torch.arange(7, dtype=torch.int64)),
        ("half", torch.randn(33, generator=g).to(torch.bfloat16)),
    ]
    got: dict[str, Any] = {}

    class Target:
        async def load_weights(self, w: Sequence[tuple[str, torch.Tensor]], v: int) -> None:
            got["weights"], got["version"] = {n: t.clone() for n, t in w}, v

    def receiver() -> None:
        async def main() -> None:
            with WeightSyncGroup("127.0.0.1", port, 1, 2, backend="hccl", timeout_s=30) as grp:
                assert isinstance(grp.platform, NPUOverGloo)
                await DistributedWeightReceiver(Target(), group=grp).receive_one()

        asyncio.run(main())

    thread = threading.Thread(target=receiver, daemon=True)
    thread.start()

    async def sender() -> None:
        with WeightSyncGroup("127.0.0.1", port, 0, 2, backend="hccl", timeout_s=30) as grp:
            sync = DistributedWeightSync(group=grp)
            await sync.init()
            await sync.start()
            buckets = bucketize(weights, 4096)
            assert len(buckets) >= 2  # several buckets, each a header and a payload broadcast
            for bucket in buckets:
                await sync.update(bucket)
            await sync.finish(3)
            await asyncio.to_thread(thread.join, 60)

    asyncio.run(sender())
    assert not thread.is_alive() and got["version"] == 3
    for name, tensor in weights:
        assert got["weights"][name].dtype == tensor.dtype
        assert torch.equal(got["weights"][name].view(torch.uint8), tensor.view(torch.uint8))
    calls = NPUOverGloo.calls
    assert sorted(c for c in calls if c.startswith("hccl")) == [
        "hccl group rank 0 of 2",
        "hccl group rank 1 of 2",
    ]
    assert calls.count("synchronize") >= 2 * (2 * len(bucketize(weights, 4096)) + 1)


def test_an_unusable_platform_is_refused_before_any_group_is_built() -> None:
    class Gone(NPUPlatform):
        def _probe(self) -> str | None:
            return "no NPU today"

    register_platform(Gone, replace=True)
    with pytest.raises(WeightSyncError, match=r"backend 'hccl' cannot run here: .*no NPU today"):
        WeightSyncGroup("127.0.0.1", 29500, 0, 2, backend="hccl")
    assert isinstance(get_platform("npu"), Gone)


def test_a_platform_without_collectives_says_so() -> None:
    class Bare(Platform):
        name = "bare"
        device_type = "cpu"
        dist_backend = "bare-backend"

    p = register_platform(Bare)
    with pytest.raises(PlatformError, match="platform 'bare' cannot build process groups"):
        p.new_process_group(None, 0, 2, timedelta(seconds=1))
