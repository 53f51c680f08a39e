"""Platforms: which device the engines compute on and how processes talk to each other.

A ``Platform`` bundles what the rest of AsyncFlow needs to know about one kind of hardware:
the torch device type and its device module (``torch.cuda``, ``torch.npu``), the collective
backend of weight sync and training (gloo / nccl / hccl), the environment variable that
limits the visible devices, the Ray resource name, the DeepSpeed accelerator name, memory
statistics, and how to build a process group of its backend on a ``TCPStore``.

Built in: ``cpu`` (gloo) and ``cuda`` (nccl). Others come from packages that declare an
entry point in the ``asyncflow.platforms`` group (this repository's ``asyncflow_ascend``
declares ``npu``), the way vLLM loads its platform plugins::

    [project.entry-points."asyncflow.platforms"]
    npu = "asyncflow_ascend.platform:NPUPlatform"

An entry point names a ``Platform`` subclass, an instance, or a callable returning either;
its name must be the platform's ``name``. Entry points are read the first time a platform is
looked up, never at import. ``register_platform`` registers one from code; registering the
same class under the same name again does nothing, so plugins may register themselves more
than once.

Choosing one: ``select_platform(name)``. A name (``"npu"``, or ``ASYNCFLOW_PLATFORM=npu`` in
the environment when the name is ``None``/``"auto"``) is *forced*: if it cannot run here the
call raises ``PlatformUnavailableError`` saying what is missing; nothing falls back. Without
one, the highest-priority platform that can run here wins, and ``cpu`` when none can: a
machine without ``torch_npu`` (or without CANN) gets ``cpu``, silently. ``current_platform()``
is the process's choice (made on first use; ``set_platform`` / ``use_platform`` force it).
Probing never imports an accelerator library that is not installed, and a library that
fails to load is tried once per process.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.metadata
import importlib.util
import ipaddress
import os
import re
import socket
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import torch

from asyncflow_core.contracts.errors import PlatformError, PlatformUnavailableError

ENTRY_POINT_GROUP = "asyncflow.platforms"
"""The entry-point group platform plugins declare themselves in."""

ENV_VAR = "ASYNCFLOW_PLATFORM"
"""Forces the platform when none is named in code or config (``auto`` or empty: detect)."""

KNOWN_PLUGINS = {
    "npu": "pip install 'asyncflow[ascend]' (the asyncflow_ascend plugin, torch_npu) on a "
    "machine with Ascend NPUs and the CANN toolkit",
}
"""Platforms provided by plugins of this project, and how to get them (for error messages)."""

_NAME = re.compile(r"^[a-z][a-z0-9_\-]*$")


@dataclass(frozen=True, slots=True)
class MemoryStats:
    """Memory of one device, in bytes. On an accelerator: ``allocated`` by tensors,
    ``reserved`` by torch's caching allocator, ``free`` / ``total`` as the driver reports them.
    On CPU: ``allocated`` and ``reserved`` are this process's resident memory, ``free`` the
    memory the OS says is available, ``total`` the machine's (``None`` where unknown)."""

    device: str
    allocated_bytes: int
    reserved_bytes: int
    free_bytes: int | None
    total_bytes: int | None


class Platform:
    """One kind of hardware. Subclasses set the class attributes and override ``_probe`` (and,
    for a device module other than ``torch.<device_type>``, ``torch_module``).

    ``priority`` orders automatic selection (highest available wins; ``cpu`` is 0).
    ``install`` says what to install or set when the platform is unavailable."""

    name: ClassVar[str]
    device_type: ClassVar[str]
    dist_backend: ClassVar[str]
    visible_devices_env: ClassVar[str | None] = None
    ray_resource: ClassVar[str] = "CPU"
    deepspeed_accelerator: ClassVar[str] = "cpu"
    priority: ClassVar[int] = 0
    install: ClassVar[str] = ""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._probed = False

    # -- availability --------------------------------------------------------------------------
    def _probe(self) -> str | None:
        """Import what the platform needs and look for a device: ``None`` when it can run,
        else why not (one sentence). Called once per instance."""
        return None

    def unavailable_reason(self) -> str | None:
        """Why this platform cannot run here, or ``None`` when it can. Never raises."""
        with self._lock:
            if not self._probed:
                try:
                    self._reason = self._probe()
                except Exception as exc:  # a probe must not take the caller down
                    self._reason = f"probing it failed: {type(exc).__name__}: {exc}"
                self._probed = True
            return self._reason

    def is_available(self) -> bool:
        return self.unavailable_reason() is None

    def load(self) -> None:
        """Make the platform usable (imports its library; idempotent), or raise
        ``PlatformUnavailableError`` naming what is missing and what to do."""
        reason = self.unavailable_reason()
        if reason is not None:
            hint = f"; {self.install}" if self.install else ""
            raise PlatformUnavailableError(
                f"platform {self.name!r} cannot run here: {reason}{hint}. To run on this "
                f"machine's CPU instead, choose platform 'cpu' (or 'auto')"
            )

    # -- devices -------------------------------------------------------------------------------
    def torch_module(self) -> ModuleType:
        """``torch.<device_type>`` (``torch.cuda``, ``torch.npu``, ``torch.cpu``)."""
        self.load()
        module = getattr(torch, self.device_type, None)
        if not isinstance(module, ModuleType):
            raise PlatformError(f"platform {self.name!r}: torch has no {self.device_type} module")
        return module

    def device_count(self) -> int:
        return int(self.torch_module().device_count())

    def device(self, index: int | None = None) -> torch.device:
        """``torch.device`` for device ``index`` (default: the current one)."""
        if index is None:
            index = int(self.torch_module().current_device())
        return torch.device(self.device_type, index)

    def set_device(self, index: int) -> None:
        self.torch_module().set_device(index)

    def synchronize(self, device: torch.device | None = None) -> None:
        """Wait for the work queued on ``device`` (default: the current one)."""
        self.torch_module().synchronize(device)

    def memory_stats(self, device: torch.device | int | None = None) -> MemoryStats:
        mod = self.torch_module()
        dev = device if isinstance(device, torch.device) else self.device(device)
        free, total = mod.mem_get_info(dev)
        return MemoryStats(
            device=str(dev),
            allocated_bytes=int(mod.memory_allocated(dev)),
            reserved_bytes=int(mod.memory_reserved(dev)),
            free_bytes=int(free),
            total_bytes=int(total),
        )

    # -- collectives ---------------------------------------------------------------------------
    def new_process_group(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
        """A process group of ``dist_backend`` over ``store`` (a ``torch.distributed`` store),
        outside torch.distributed's default group (``WeightSyncGroup`` builds its groups so)."""
        raise PlatformError(f"platform {self.name!r} cannot build process groups")

    def describe(self) -> dict[str, Any]:
        """What ``asyncflow platforms`` prints for this platform."""
        reason = self.unavailable_reason()
        devices: int | None = None
        if reason is None:
            with contextlib.suppress(Exception):
                devices = self.device_count()
        return {
            "name": self.name,
            "available": reason is None,
            "reason": reason,
            "device_type": self.device_type,
            "devices": devices,
            "dist_backend": self.dist_backend,
            "visible_devices_env": self.visible_devices_env,
            "ray_resource": self.ray_resource,
            "deepspeed_accelerator": self.deepspeed_accelerator,
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, backend={self.dist_backend!r})"

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (type(self), ())  # a fresh instance in the receiving process: probed there


class CpuPlatform(Platform):
    """The host: gloo collectives, always available."""

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    ray_resource = "CPU"
    deepspeed_accelerator = "cpu"
    priority = 0

    def device_count(self) -> int:
        return 1

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, index: int) -> None:
        return None

    def synchronize(self, device: torch.device | None = None) -> None:
        return None

    def memory_stats(self, device: torch.device | int | None = None) -> MemoryStats:
        rss = _resident_bytes()
        free, total = _host_memory()
        return MemoryStats("cpu", rss, rss, free, total)

    def new_process_group(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
        """A gloo group that listens on the interface toward the store's host (loopback for a
        loopback store), not on whatever the machine's hostname resolves to (gloo's default)."""
        from torch.distributed import ProcessGroupGloo

        host = _store_host(store)
        if host is None:
            return ProcessGroupGloo(store, rank, world_size, timeout)
        options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # takes a device
        options._timeout = timeout
        options._devices = [ProcessGroupGloo.create_device(hostname=listen_address(host))]
        return ProcessGroupGloo(store, rank, world_size, options)


class CudaPlatform(Platform):
    """NVIDIA GPUs through ``torch.cuda``: nccl collectives."""

    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    ray_resource = "GPU"
    deepspeed_accelerator = "cuda"
    priority = 10
    install = "install a CUDA build of torch on a machine with an NVIDIA GPU"

    def _probe(self) -> str | None:
        if torch.version.cuda is None:
            return f"this torch ({torch.__version__}) is a build without CUDA"
        if not torch.cuda.is_available():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            shown = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            return f"torch.cuda.is_available() is False: no usable GPU{shown}"
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_nccl_available()):
            return "this torch was built without NCCL"
        return None

    def new_process_group(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return ProcessGroupNCCL(store, rank, world_size, options)


# --------------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------------
class _Registry:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.platforms: dict[str, Platform] = {}
        self.sources: dict[str, str] = {}
        self.broken: dict[str, str] = {}
        self.discovered = False
        self.current: Platform | None = None
        for cls in (CpuPlatform, CudaPlatform):
            self.platforms[cls.name] = cls()
            self.sources[cls.name] = "built in"


_registry = _Registry()


def _as_platform(obj: object, where: str) -> Platform:
    if isinstance(obj, type) and issubclass(obj, Platform):
        obj = obj()
    elif callable(obj) and not isinstance(obj, Platform):
        obj = obj()
        if isinstance(obj, type) and issubclass(obj, Platform):
            obj = obj()
    if not isinstance(obj, Platform):
        raise PlatformError(
            f"{where}: expected a Platform subclass, instance, or a callable returning one; "
            f"got {obj!r:.80}"
        )
    for attr in ("name", "device_type", "dist_backend"):
        value = getattr(obj, attr, None)
        if not isinstance(value, str) or not value:
            raise PlatformError(f"{where}: {type(obj).__name__}.{attr} must be a non-empty str")
    if not _NAME.match(obj.name):
        raise PlatformError(
            f"{where}: platform name {obj.name!r} must be lower-case letters, digits, '-' or "
            "'_', starting with a letter"
        )
    return obj


def register_platform(
    platform: Platform | type[Platform], *, replace: bool = False, source: str = "registered"
) -> Platform:
    """Add a platform (an instance or a subclass, instantiated with no arguments) and return
    the registered instance. Registering the same class under its name again returns the
    instance already there; another class under a taken name raises ``PlatformError`` unless
    ``replace=True`` (which also drops it as the current platform)."""
    p = _as_platform(platform, "register_platform")
    discover()  # the entry points first, so that a platform registered here is the one kept
    with _registry.lock:
        existing = _registry.platforms.get(p.name)
        if existing is not None and not replace:
            if type(existing) is type(p):
                return existing
            raise PlatformError(
                f"platform {p.name!r} is already registered as {type(existing).__qualname__} "
                f"({_registry.sources[p.name]}); {type(p).__qualname__} ({source}) cannot take "
                "its name: rename it, or pass replace=True"
            )
        _registry.platforms[p.name] = p
        _registry.sources[p.name] = source
        _registry.broken.pop(p.name, None)
        if replace and _registry.current is not None and _registry.current.name == p.name:
            _registry.current = None
        return p


def discover(*, reload: bool = False) -> None:
    """Read the ``asyncflow.platforms`` entry points (once per process unless ``reload``).
    A plugin that fails to load or clashes is remembered with the reason (``platforms()``
    shows it, choosing it by name raises it) and announced with a ``RuntimeWarning``."""
    with _registry.lock:
        if _registry.discovered and not reload:
            return
        _registry.discovered = True
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = getattr(getattr(ep, "dist", None), "name", None)
            where = f"entry point {ep.name} = {ep.value}" + (f" (from {dist})" if dist else "")
            try:
                p = _as_platform(ep.load(), where)
                if p.name != ep.name:
                    raise PlatformError(
                        f"{where}: the entry point is named {ep.name!r} but its platform is "
                        f"named {p.name!r}; the two must match"
                    )
                register_platform(p, source=where)
            except Exception as exc:
                if ep.name in _registry.platforms and ep.name not in _registry.broken:
                    reason = str(exc)  # a clash with a platform that works
                else:
                    reason = f"{where} failed to load: {type(exc).__name__}: {exc}"
                    _registry.broken[ep.name] = reason
                warnings.warn(f"asyncflow platform plugin ignored: {reason}", RuntimeWarning, 2)


def get_platform(name: str) -> Platform:
    """The registered platform ``name`` (not loaded: see ``Platform.load``), or
    ``PlatformError`` listing the known ones and how to get the one asked for."""
    if not isinstance(name, str) or not name:
        raise PlatformError(f"a platform name must be a non-empty str, got {name!r}")
    discover()
    with _registry.lock:
        p = _registry.platforms.get(name)
        if p is not None:
            return p
        if name in _registry.broken:
            raise PlatformError(f"platform {name!r} is unusable: {_registry.broken[name]}")
        known = sorted(_registry.platforms)
    hint = f"; platform {name!r} comes with {KNOWN_PLUGINS[name]}" if name in KNOWN_PLUGINS else ""
    close = difflib.get_close_matches(name, [*known, "auto"], n=1)
    guess = f" (did you mean {close[0]!r}?)" if close and not hint else ""
    raise PlatformError(
        f"unknown platform {name!r}{guess}: the platforms here are {', '.join(known)} and "
        f"'auto' (detect){hint}; other platforms register through the "
        f"{ENTRY_POINT_GROUP!r} entry-point group"
    )


def platforms() -> list[dict[str, Any]]:
    """Every registered platform's ``describe()`` plus its ``source``, then the broken plugins
    (``available`` False and the load error as ``reason``), by name."""
    discover()
    with _registry.lock:
        registered = dict(_registry.platforms)
        sources = dict(_registry.sources)
        broken = dict(_registry.broken)
    out = [{**p.describe(), "source": sources[name]} for name, p in registered.items()]
    out += [
        {"name": name, "available": False, "reason": reason, "source": "entry point"}
        for name, reason in broken.items()
        if name not in registered
    ]
    return sorted(out, key=lambda d: str(d["name"]))


def select_platform(name: str | Platform | None = None) -> Platform:
    """The platform to run on: ``name`` (or a ``Platform``) if given and not ``"auto"``, else
    ``$ASYNCFLOW_PLATFORM`` if set and not ``auto``; either is loaded or raises
    ``PlatformUnavailableError``. Otherwise the available platform of highest priority
    (ties by name), ``cpu`` when no accelerator platform can run."""
    if isinstance(name, Platform):
        name.load()
        return name
    if name is None or name == "auto":
        env = os.environ.get(ENV_VAR, "").strip()
        if env and env != "auto":
            try:
                return _forced(env)
            except PlatformError as exc:
                raise type(exc)(f"{ENV_VAR}={env}: {exc}") from exc
        return _detect()
    return _forced(name)


def _forced(name: str) -> Platform:
    p = get_platform(name)
    p.load()
    return p


def _detect() -> Platform:
    discover()
    with _registry.lock:
        candidates = sorted(_registry.platforms.values(), key=lambda p: (-p.priority, p.name))
    for p in candidates:
        if p.name != "cpu" and p.is_available():
            return p
    return get_platform("cpu")


def current_platform() -> Platform:
    """This process's platform: chosen by ``select_platform()`` on first use, or the one
    ``set_platform`` / ``use_platform`` forced."""
    with _registry.lock:
        if _registry.current is None:
            _registry.current = select_platform(None)
        return _registry.current


def set_platform(name: str | Platform | None) -> Platform:
    """Force this process's platform (``None`` / ``"auto"``: detect again) and return it. A
    platform that cannot run raises, and the current one stays."""
    p = select_platform(name)
    with _registry.lock:
        _registry.current = p
    return p


@contextlib.contextmanager
def use_platform(name: str | Platform | None) -> Iterator[Platform]:
    """``set_platform(name)`` for the ``with`` block, then the previous choice again."""
    with _registry.lock:
        previous = _registry.current
    p = set_platform(name)
    try:
        yield p
    finally:
        with _registry.lock:
            _registry.current = previous


@contextlib.contextmanager
def preserved_registry() -> Iterator[None]:
    """Restore the registry (platforms, plugins read, the current choice) on leaving the block:
    for tests that register platforms or force one."""
    r = _registry
    with r.lock:
        saved = (dict(r.platforms), dict(r.sources), dict(r.broken), r.discovered, r.current)
    try:
        yield
    finally:
        with r.lock:
            r.platforms, r.sources, r.broken = saved[0], saved[1], saved[2]
            r.discovered, r.current = saved[3], saved[4]


def platform_for_backend(backend: str) -> Platform:
    """The platform whose collective backend is ``backend`` (``gloo``: cpu), loaded; a
    ``PlatformError`` names the backends known here."""
    if backend == "gloo":
        return get_platform("cpu")
    discover()
    with _registry.lock:
        matches = [p for p in _registry.platforms.values() if p.dist_backend == backend]
        known = sorted({p.dist_backend for p in _registry.platforms.values()})
    if not matches:
        hint = f" (hccl comes with the npu platform: {KNOWN_PLUGINS['npu']})"
        raise PlatformError(
            f"no platform here uses the collective backend {backend!r}; known: "
            f"{', '.join(known)}{hint if backend == 'hccl' else ''}"
        )
    current = _registry.current
    p = current if current is not None and current in matches else matches[0]
    p.load()
    return p


# --------------------------------------------------------------------------------------------
# Rendezvous: where a process group listens
# --------------------------------------------------------------------------------------------
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
"""The variable torch reads for the interface a gloo group listens on when no device is given
(``init_process_group``, ``new_group``); unset, gloo listens on the address the machine's
hostname resolves to."""

NCCL_IFNAME_ENV = "NCCL_SOCKET_IFNAME"
"""The interface NCCL's own sockets (bootstrap, proxy) listen on. NCCL reads it once per
process, at its first communicator; unset, it takes the first interface that is not loopback,
even for a group whose rendezvous is ``127.0.0.1``."""

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
_IFF_LOOPBACK = 0x8


def _resolve(host: str) -> tuple[socket.AddressFamily, str]:
    """``host``'s first TCP address (family, address), or ``OSError`` naming it."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError, IndexError) as exc:
        raise OSError(f"cannot resolve {host!r}: {exc}") from exc
    return family, str(sockaddr[0])


def is_loopback_literal(host: str) -> bool:
    """Whether ``host`` is ``localhost`` or a loopback address as written (no name lookup: for
    checks that run often, or before anything may touch the network)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback (127.0.0.0/8, ``::1``, ``localhost``)."""
    try:
        return ipaddress.ip_address(_resolve(host)[1].split("%")[0]).is_loopback
    except (OSError, ValueError):
        return False


def listen_address(host: str) -> str:
    """The local address a process listens on for peers that meet it through ``host`` (a
    group's rendezvous address): ``host``'s own address when it is loopback or this
    machine's, else the address of the interface that routes to it. Never the wildcard."""
    family, address = _resolve(host)
    if ipaddress.ip_address(address.split("%")[0]).is_loopback:
        return address
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))  # UDP connect sends nothing: it only picks the route
        return str(probe.getsockname()[0])


def interface_of(address: str) -> str | None:
    """The network interface that holds the local ``address`` (Linux; IPv4 and loopback), or
    None where it cannot be told."""
    import fcntl
    import struct

    loopback = ipaddress.ip_address(address.split("%")[0]).is_loopback
    for _, name in socket.if_nameindex():
        if loopback:
            try:
                flags = int(Path(f"/sys/class/net/{name}/flags").read_text(), 16)
            except (OSError, ValueError):
                continue
            if flags & _IFF_LOOPBACK:
                return name
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                packed = fcntl.ioctl(
                    probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15])
                )
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == address:
            return name
    return None


@contextlib.contextmanager
def gloo_listens_on(host: str) -> Iterator[str | None]:
    """While inside, gloo groups that torch builds without a device (``init_process_group``,
    ``new_group``) listen on ``listen_address(host)``'s interface: sets ``GLOO_SOCKET_IFNAME``
    unless the user set it (their choice stands), and restores it on exit. Yields the
    interface (None: left as it was)."""
    if os.environ.get(GLOO_IFNAME_ENV):
        yield None
        return
    name = interface_of(listen_address(host))
    if name is None:
        yield None
        return
    os.environ[GLOO_IFNAME_ENV] = name
    try:
        yield name
    finally:
        os.environ.pop(GLOO_IFNAME_ENV, None)


def rendezvous_store(
    host: str,
    port: int,
    world_size: int,
    *,
    is_master: bool,
    timeout: timedelta,
    wait_for_workers: bool = True,
) -> Any:
    """A ``torch.distributed.TCPStore`` for a group that meets at ``host:port``. The master
    (rank 0) listens on ``host`` only: torch's own ``TCPStore(host, port, is_master=True)``
    listens on every interface, so the master gets a socket bound here and handed to torch
    (``master_listen_fd``, libuv backend; torch owns it from then on). The others connect.
    ``OSError`` when the master cannot bind (port taken, ``host`` not this machine's);
    torch's ``RuntimeError`` subclasses for a rendezvous that fails."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, documented

    if not is_master:
        return TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    family, address = _resolve(host)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own listener
        sock.bind((address, port))
        sock.listen(max(128, world_size))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} ({exc})") from exc
    fd = sock.detach()  # torch closes it, on success and on failure alike
    return TCPStore(
        host,
        port,
        world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=wait_for_workers,
        master_listen_fd=fd,
        use_libuv=True,
    )


def _store_host(store: Any) -> str | None:
    """The rendezvous host of a ``TCPStore`` (through ``PrefixStore``s), or None."""
    for _ in range(16):
        inner = getattr(store, "underlying_store", None)
        if inner is None:
            break
        store = inner
    host = getattr(store, "host", None)
    return host if isinstance(host, str) and host else None


# --------------------------------------------------------------------------------------------
# Helpers for plugins
# --------------------------------------------------------------------------------------------
def import_accelerator_library(module: str) -> tuple[ModuleType | None, str]:
    """Import ``module`` for a platform probe without importing anything that is not installed:
    ``(module, "")``, or ``(None, why)`` when it is absent or fails to load (its shared
    libraries missing, say)."""
    if importlib.util.find_spec(module) is None:
        return None, f"{module} is not installed"
    try:
        return importlib.import_module(module), ""
    except Exception as exc:  # ImportError of a shared library, RuntimeError of a backend
        return None, f"{module} is installed but does not load ({type(exc).__name__}: {exc})"


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _host_memory() -> tuple[int | None, int | None]:
    free: int | None = None
    total: int | None = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemAvailable", "MemTotal"):
                    value = int(rest.split()[0]) * 1024
                    if key == "MemAvailable":
                        free = value
                    else:
                        total = value
    except (OSError, ValueError, IndexError):
        with contextlib.suppress(ValueError, OSError, AttributeError):
            total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return free, total
