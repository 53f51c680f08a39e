"""Connecting to a Ray cluster, or starting a local one, and leaving nothing behind.

``RayRuntime`` is the one place AsyncFlow calls ``ray.init`` / ``ray.shutdown``::

    with RayRuntime() as rt:            # a local cluster of this machine, owned by rt
        store = RayDataStore.create(rt, num_storage_units=2)
        ...
    # every Ray process this runtime started is gone here

    RayRuntime(address="auto")          # the cluster of `ray start --head` on this node
    RayRuntime(address="10.0.0.1:6379") # a cluster's head, from any node of it

A runtime that connects to a running cluster (or finds Ray already initialised in this
process, e.g. by a test's ``ray.cluster_utils.Cluster``) disconnects on ``shutdown`` but never
stops the cluster; one that started a local cluster stops it, and ``shutdown`` waits until its
processes have exited. Actors are created in the runtime's ``namespace``; nothing listens on
a port of our own: every call goes through Ray, inside the cluster.

**A killed driver.** A local cluster ends with the process that started it, however that
process ends (SIGKILL included): Ray ties its GCS and raylet to the driver, and the runtime
starts a reaper (``asyncflow_ray.reaper``) that ends the rest once the driver is gone (Ray's
agents would otherwise outlive it by a minute): every process of the driver's session that
holds a file of the cluster's folders open, and their descendants — a child the driver forked
holds the driver's own Ray log open, and ends too. Linux only (it reads ``/proc``).

**Sockets.** A local cluster listens on loopback only: its GCS, raylet, object manager,
agents and every worker's gRPC server bind this node's address, and the runtime makes that
``127.0.0.1`` (``ray.init`` alone turns a loopback node address into the machine's external
one, where any host that reaches it can connect; see ``_loopback_node``), with the dashboard
off. Ray 2.60 also requires its cluster token (token authentication, on by default). Other
machines cannot join such a cluster: for several nodes start the head with ``ray start
--head --node-ip-address=...`` and connect with ``address``, or set ``node_ip_address``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import torch

from asyncflow_core.contracts.errors import ConfigError, MissingExtraError
from asyncflow_core.infra.platform import Platform, get_platform
from asyncflow_ray.reaper import with_descendants

INSTALL = "pip install 'asyncflow[ray]'"
TESTED = "2.60"
"""The Ray release the runtime is tested with (``ray==2.60.0``)."""

DEFAULT_OBJECT_STORE_BYTES = 1 << 30
"""Object store of a local cluster started by ``RayRuntime`` (Ray's own default is 30% of
RAM, and in a container whose ``/dev/shm`` is small it falls back to slow disk)."""


def import_ray() -> ModuleType:
    """``ray``, or ``MissingExtraError`` naming the extra."""
    try:
        import ray
    except ImportError as e:
        raise MissingExtraError(
            f"the Ray runtime needs Ray ({e}): {INSTALL} (tested with ray {TESTED})"
        ) from e
    return ray


def resources_for(platform: str | Platform, count: float = 1.0) -> dict[str, Any]:
    """Ray actor options that reserve ``count`` devices of ``platform``'s Ray resource:
    ``num_cpus`` for ``CPU``, ``num_gpus`` for ``GPU``, ``resources={name: count}`` for any
    other (``NPU`` for Ascend, a node started with ``ray start --resources='{"NPU": 8}'``)."""
    p = get_platform(platform) if isinstance(platform, str) else platform
    if not count >= 0:
        raise ConfigError(f"a device count must be >= 0, got {count!r}")
    name = p.ray_resource
    if name == "CPU":
        return {"num_cpus": count}
    if name == "GPU":
        return {"num_cpus": 0, "num_gpus": count}
    return {"num_cpus": 0, "resources": {name: count}}


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One alive node of the cluster."""

    node_id: str
    address: str
    resources: dict[str, float]
    is_head: bool


@dataclass
class RayRuntime:
    """A connection to a Ray cluster (see the module docstring).

    ``address``: ``None`` starts a local cluster (unless Ray is already initialised in this
    process, which is then used as is); ``"auto"`` joins the cluster started on this node with
    ``ray start``; ``"host:port"`` joins that head. ``num_cpus`` / ``num_gpus`` /
    ``resources`` / ``object_store_bytes`` size a local cluster only. ``temp_dir``: where a
    local cluster keeps its sockets and logs (default: a fresh folder under the system's
    temp dir, deleted by ``shutdown``); ``log_to_driver`` prints the actors' output here.
    ``node_ip_address``: the address a local cluster listens on (None: ``127.0.0.1``, reachable
    from this machine only; an address of this machine's network makes every server of the
    cluster reachable from that network, guarded by Ray's cluster token only).
    """

    address: str | None = None
    num_cpus: int | None = None
    num_gpus: int | None = None
    resources: dict[str, float] = field(default_factory=dict)
    object_store_bytes: int | None = DEFAULT_OBJECT_STORE_BYTES
    namespace: str = "asyncflow"
    temp_dir: str | None = None
    log_to_driver: bool = False
    node_ip_address: str | None = None
    owns_cluster: bool = field(default=False, init=False)
    _connected: bool = field(default=False, init=False, repr=False)
    _made_temp: str | None = field(default=None, init=False, repr=False)
    _did_init: bool = field(default=False, init=False, repr=False)
    _reaper: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def ray(self) -> ModuleType:
        return import_ray()

    def start(self) -> RayRuntime:
        """Connect (or start); idempotent."""
        ray = import_ray()
        if self._connected:
            return self
        if ray.is_initialized():
            if self.address not in (None, "auto") and not _same_address(ray, self.address):
                raise ConfigError(
                    f"Ray is already initialised in this process (cluster "
                    f"{_gcs_address(ray)!r}), not connected to address={self.address!r}; "
                    "call ray.shutdown() first or drop the address"
                )
            self._connected = True
            self._did_init = False
            return self
        kwargs: dict[str, Any] = {
            "namespace": self.namespace,
            "log_to_driver": self.log_to_driver,
            "include_dashboard": False,
            "configure_logging": False,
        }
        if self.address is None:
            # a local cluster reports no usage statistics unless the user asked for them
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            temp = self.temp_dir or tempfile.mkdtemp(prefix="afray-")
            self._made_temp = None if self.temp_dir else temp
            kwargs.update(
                num_cpus=self.num_cpus if self.num_cpus is not None else os.cpu_count() or 1,
                num_gpus=self.num_gpus,
                resources=dict(self.resources) or None,
                object_store_memory=self.object_store_bytes,
                _temp_dir=temp,
            )
            if self.node_ip_address is not None:
                kwargs["_node_ip_address"] = self.node_ip_address
            self.owns_cluster = True
        else:
            if self.node_ip_address is not None:
                raise ConfigError(
                    f"node_ip_address places a local cluster; the cluster at {self.address!r} "
                    "has its own (set it with `ray start --node-ip-address`)"
                )
            if self.num_cpus is not None or self.num_gpus is not None or self.resources:
                raise ConfigError(
                    f"num_cpus / num_gpus / resources size a local cluster; the cluster at "
                    f"{self.address!r} has its own (set them with `ray start`)"
                )
            kwargs["address"] = self.address
        loopback = self.address is None and self.node_ip_address is None
        if self.owns_cluster:
            self._reaper = _start_reaper()
            if self._made_temp is not None:  # ours alone: covers a death during ray.init
                _reaper_watch(self._reaper, self._made_temp)
        try:
            with _loopback_node(ray) if loopback else contextlib.nullcontext():
                ray.init(**kwargs)
        except BaseException as e:
            self.owns_cluster = False
            _stop_reaper(self._reaper, reap=True)  # whatever of the cluster had started
            self._reaper = None
            if not isinstance(e, ConnectionError):
                raise
            raise ConfigError(
                f"could not reach a Ray cluster at address={self.address!r} ({e}); start one "
                "with `ray start --head` (then address='auto' on that node, or "
                "'HEAD_IP:6379' elsewhere), or leave address unset to start a local cluster"
            ) from e
        if self._reaper is not None:
            _reaper_watch(self._reaper, _session_dir(ray))
        self._connected = True
        self._did_init = True
        return self

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Disconnect (if ``start`` connected; a Ray it found initialised is left as is); a
        cluster this runtime started is stopped and its processes waited for (at most
        ``timeout_s``)."""
        if not self._connected:
            return
        ray = import_ray()
        self._connected = False
        if not self.owns_cluster:
            if self._did_init:  # disconnect from a cluster we joined; it keeps running
                ray.shutdown()
            return
        pids = _cluster_pids(ray)
        ray.shutdown()
        self.owns_cluster = False
        _wait_gone(pids, timeout_s)
        _stop_reaper(self._reaper, reap=False)  # the driver lives on: nothing to end
        self._reaper = None
        if self._made_temp is not None:
            shutil.rmtree(self._made_temp, ignore_errors=True)
            self._made_temp = None

    def __enter__(self) -> RayRuntime:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def nodes(self) -> list[NodeInfo]:
        """The cluster's alive nodes."""
        return alive_nodes()


def alive_nodes() -> list[NodeInfo]:
    """The alive nodes of the cluster this process is connected to."""
    out = []
    for n in import_ray().nodes():
        if not n.get("Alive"):
            continue
        res = {k: float(v) for k, v in n.get("Resources", {}).items()}
        out.append(
            NodeInfo(
                n["NodeID"], n.get("NodeManagerAddress", ""), res, "node:__internal_head__" in res
            )
        )
    return out


def first_line(exc: object) -> str:
    """An error's message on one line (Ray's are multi-line), or its type's name."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def tensor_bytes(t: torch.Tensor) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A contiguous CPU tensor's bytes as a flat ``uint8`` numpy view (no copy): what Ray
    moves through its object store out of band and hands the receiver as a view."""
    flat = t.detach().reshape(-1).contiguous()
    if not flat.numel():
        return np.zeros(0, dtype=np.uint8)
    if flat.stride(-1) != 1:  # one element of a strided view counts as contiguous
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8).numpy()


def bytes_tensor(
    data: np.ndarray[Any, np.dtype[np.uint8]], dtype: str, *, copy: bool
) -> torch.Tensor:
    """The inverse of ``tensor_bytes``: a flat tensor of ``dtype`` (a torch dtype's name)
    over ``data``, or over a private, writable copy of it (``copy``); without ``copy`` the
    tensor views the received (read-only) bytes."""
    torch_dtype = getattr(torch, dtype)
    if data.size == 0:
        return torch.empty(0, dtype=torch_dtype)
    if copy:
        raw = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True))
    else:
        with warnings.catch_warnings():  # Ray's zero-copy arrays are read-only
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(data)
    return raw.view(torch_dtype)


@contextlib.contextmanager
def ray_runtime(address: str | None = None, **kwargs: Any) -> Iterator[RayRuntime]:
    """``with ray_runtime(...) as rt``: a started ``RayRuntime``, shut down on exit."""
    rt = RayRuntime(address, **kwargs).start()
    try:
        yield rt
    finally:
        rt.shutdown()


@contextlib.contextmanager
def _loopback_node(ray: ModuleType) -> Iterator[None]:
    """While ``ray.init`` starts a local cluster, this node's address is ``127.0.0.1``.

    Why: Ray 2.60 binds every server of a node (GCS, raylet, object manager, workers' gRPC,
    runtime-env agent) to the node's address, but ``ray.init`` resolves that address with
    ``ray._private.services.get_node_ip_address``, which answers the machine's external
    address while ``ray_constants.ENABLE_RAY_CLUSTER`` is true (it is, except on macOS and
    Windows), and replaces ``_node_ip_address="127.0.0.1"`` with that address too
    (``resolve_ip_for_localhost``). How: the flag is false for the duration of the call, so
    Ray takes its own "local only" branch (``get_localhost_ip()``); the processes it starts
    get the address on their command line and never read the flag. The environment variable
    behind the flag (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``) is read once, at ``import ray``,
    too early for a runtime to set. Upstream: ray-project/ray#59852 made servers bind the node
    address instead of 0.0.0.0; ``ray.init`` offers no "this node only" switch yet. Remove
    when it does (or when ``_node_ip_address="127.0.0.1"`` is kept as given). Where the
    private module moved, nothing is changed and the cluster listens where Ray decides."""
    constants = getattr(getattr(ray, "_private", None), "ray_constants", None)
    if constants is None or not hasattr(constants, "ENABLE_RAY_CLUSTER"):
        yield
        return
    saved = constants.ENABLE_RAY_CLUSTER
    constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        constants.ENABLE_RAY_CLUSTER = saved


def _start_reaper() -> subprocess.Popen[bytes] | None:
    """A reaper (``asyncflow_ray.reaper``) for a local cluster about to start, in a session of
    its own (signals to this process's group, Ctrl-C or a scheduler's SIGTERM, leave it
    waiting for this process); None where there is no ``/proc`` to find the processes in."""
    if not os.path.isdir("/proc") or not sys.executable:
        return None
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reaper.py")
    return subprocess.Popen(
        [sys.executable, "-I", script, str(os.getsid(0))],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )


def _reaper_watch(reaper: subprocess.Popen[bytes] | None, folder: str | None) -> None:
    """Name one of the cluster's folders to its reaper (as given and resolved: the kernel
    shows open files by their real path)."""
    if reaper is None or not folder or "\n" in folder or reaper.stdin is None:
        return  # a folder with a line break cannot be said on the reaper's line protocol
    with contextlib.suppress(OSError):  # the reaper is gone
        for name in dict.fromkeys((folder, os.path.realpath(folder))):
            reaper.stdin.write(os.fsencode(name) + b"\n")
        reaper.stdin.flush()


def _stop_reaper(reaper: subprocess.Popen[bytes] | None, *, reap: bool) -> None:
    """End the reaper: after it ended the cluster's processes (``reap``: a ``ray.init`` that
    failed midway), or at once (a cluster shut down: its processes are gone, and any other
    process holding its files is one the driver forked)."""
    if reaper is None:
        return
    assert reaper.stdin is not None
    if reap:
        with contextlib.suppress(OSError):  # gone already
            reaper.stdin.write(b"\n")  # an empty line: reap now
            reaper.stdin.flush()
    else:
        reaper.terminate()
    with contextlib.suppress(OSError):
        reaper.stdin.close()
    try:
        reaper.wait(60.0)  # it gives up on what it cannot end well before
    except subprocess.TimeoutExpired:
        warnings.warn(
            f"the Ray cluster's reaper (pid {reaper.pid}) was still ending its processes "
            "after 60 s; it goes on alone",
            RuntimeWarning,
            stacklevel=3,
        )


def _session_dir(ray: ModuleType) -> str | None:
    try:
        return str(ray._private.worker.global_worker.node.get_session_dir_path())
    except Exception:  # pragma: no cover - Ray internals vary
        return None


def _gcs_address(ray: ModuleType) -> str:
    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:  # pragma: no cover - Ray internals vary
        return "?"


def _same_address(ray: ModuleType, address: str) -> bool:
    return _gcs_address(ray).split(":")[-1] == address.split(":")[-1]


def _cluster_pids(ray: ModuleType) -> list[int]:
    """The processes of the local cluster started by this driver: those naming its session
    folder (GCS, raylet, agents) and their descendants (the workers)."""
    session = _session_dir(ray)
    if session is None:
        return []
    parent: dict[int, int] = {}
    roots = set()
    for pid, cmd, ppid in _processes():
        parent[pid] = ppid
        if session in cmd:
            roots.add(pid)
    return with_descendants(parent, roots)


def _processes() -> Iterator[tuple[int, str, int]]:
    """(pid, command line, parent pid) of every process (Linux ``/proc``; none elsewhere)."""
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[-1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        yield int(entry), cmd, ppid


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[-1].split()[0]
        return state != b"Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)


_BACKGROUND: set[asyncio.Task[Any]] = set()


def background(coro: Any) -> None:
    """Run ``coro`` on the running loop without awaiting it (fire and forget), keeping a
    reference so the task is not garbage-collected before it ends."""
    task = asyncio.get_running_loop().create_task(coro)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
