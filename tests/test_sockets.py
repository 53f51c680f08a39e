"""Every socket AsyncFlow listens on is on loopback unless the user configured an address.

The probe reads the kernel's tables (``/proc/net/tcp``, ``/proc/net/tcp6``) and maps their
socket inodes to processes through ``/proc/<pid>/fd``: a listener is seen wherever it came
from (torch's C++ store, gloo, a child process). Checked while a 2-rank DeepSpeed world has
taken a step, while a ``WeightSyncGroup`` and SGLang's weight-update group are connected, and
(``tests/test_ray_cluster.py``) while a local Ray cluster runs.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from asyncflow_core.engines.process import free_port
from asyncflow_core.infra.platform import (
    gloo_listens_on,
    interface_of,
    is_loopback,
    listen_address,
    rendezvous_store,
)
from asyncflow_core.sync.transports import WeightSyncGroup

pytestmark = pytest.mark.skipif(
    not Path("/proc/net/tcp").exists(), reason="the probe reads Linux's /proc"
)

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


@dataclass(frozen=True)
class Listener:
    pid: int
    address: str
    port: int

    @property
    def on_loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped  # ::ffff:127.0.0.1, a dual-stack socket bound to 127.0.0.1
        return ip.is_loopback


def process_tree(root: int) -> list[int]:
    """``root`` and every process descended from it."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_bytes()
                parent[int(entry)] = int(stat.rsplit(b")", 1)[-1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, ppid in parent.items() if ppid in tree} - tree
        tree |= more
        grew = bool(more)
    return sorted(tree)


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone, or not ours
        return inodes
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[len("socket:[") : -1]))
    return inodes


def _address(hex_address: str, v6: bool) -> tuple[str, int]:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if v6:  # four 32-bit words, each in host (little-endian) order
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
        return socket.inet_ntop(socket.AF_INET6, raw), int(port, 16)
    return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)


def listening_sockets(pids: Iterable[int]) -> list[Listener]:
    """The TCP sockets in LISTEN state that the processes ``pids`` hold."""
    owner = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    found = []
    for table, v6 in (("tcp", False), ("tcp6", True)):
        with open(f"/proc/net/{table}") as f:
            next(f)  # the header
            for line in f:
                fields = line.split()
                if fields[3] == _LISTEN and int(fields[9]) in owner:
                    address, port = _address(fields[1], v6)
                    found.append(Listener(owner[int(fields[9])], address, port))
    return found


def assert_loopback_only(listeners: list[Listener], at_least: int = 1) -> None:
    assert len(listeners) >= at_least, f"expected {at_least}+ listeners, saw {listeners}"
    wide = [s for s in listeners if not s.on_loopback]
    assert not wide, f"listening beyond loopback: {wide} (all: {listeners})"


def _outward_interface() -> str | None:
    """An interface that is not loopback and has an IPv4 address, if this machine has one."""
    for _, name in socket.if_nameindex():
        if name != interface_of("127.0.0.1") and _ipv4_of(name) is not None:
            return name
    return None


def _ipv4_of(interface: str) -> str | None:
    for _, name in socket.if_nameindex():
        if name == interface:
            for addr in ("8.8.8.8", "10.255.255.255"):
                try:
                    local = listen_address(addr)
                except OSError:
                    continue
                if interface_of(local) == interface:
                    return local
    return None


# --------------------------------------------------------------------------------------------
# The probe and the helpers
# --------------------------------------------------------------------------------------------
def test_the_probe_sees_torchs_own_store_listen_on_every_interface() -> None:
    """The probe is not blind: torch's ``TCPStore("127.0.0.1", is_master=True)`` listens on
    the wildcard (what AsyncFlow's groups did before ``rendezvous_store``)."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    port = free_port()
    store = TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)
    try:
        mine = [s for s in listening_sockets([os.getpid()]) if s.port == port]
        assert [s.on_loopback for s in mine] == [False], mine
    finally:
        del store


def test_rendezvous_store_listens_on_its_host_only() -> None:
    timeout = datetime.timedelta(seconds=30)
    for host in ("127.0.0.1", "localhost"):
        port = free_port()
        master = rendezvous_store(host, port, 2, is_master=True, timeout=timeout,
                                  wait_for_workers=False)  # fmt: skip
        client = rendezvous_store(host, port, 2, is_master=False, timeout=timeout)
        client.set("k", b"v")
        assert master.get("k") == b"v"
        mine = [s for s in listening_sockets([os.getpid()]) if s.port == port]
        assert [s.address for s in mine] == [listen_address(host)], mine
        del master, client


def test_a_taken_port_is_an_os_error_naming_the_address() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            rendezvous_store("127.0.0.1", port, 2, is_master=True,
                             timeout=datetime.timedelta(seconds=5))  # fmt: skip


def test_loopback_addresses_and_their_interface() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("192.0.2.1") and not is_loopback("no-such-host.invalid")
    assert listen_address("127.0.0.1") == "127.0.0.1"
    lo = interface_of("127.0.0.1")
    assert lo is not None
    os.environ.pop("GLOO_SOCKET_IFNAME", None)
    with gloo_listens_on("127.0.0.1") as name:
        assert name == lo and os.environ["GLOO_SOCKET_IFNAME"] == lo
    assert "GLOO_SOCKET_IFNAME" not in os.environ


def test_a_rank_process_keeps_gloo_and_nccl_on_a_loopback_masters_interface(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What an SPMD rank sets before its factory runs; a value the user set stands."""
    from asyncflow_core.engines.process import RankContext, _build_rank

    def environment(context: RankContext) -> dict[str, str]:
        return {k: os.environ[k] for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}

    lo = interface_of("127.0.0.1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # unset for the rank; restored afterwards
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "")
    context = RankContext(0, 2, "127.0.0.1", free_port())
    assert _build_rank(environment, context) == {
        "GLOO_SOCKET_IFNAME": lo,
        "NCCL_SOCKET_IFNAME": lo,
    }
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "users-choice")
    assert _build_rank(environment, context)["NCCL_SOCKET_IFNAME"] == "users-choice"


def test_a_users_gloo_interface_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "users-choice")
    with gloo_listens_on("127.0.0.1") as name:
        assert name is None and os.environ["GLOO_SOCKET_IFNAME"] == "users-choice"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "users-choice"


# --------------------------------------------------------------------------------------------
# The groups
# --------------------------------------------------------------------------------------------
def _has_ipv6_loopback() -> bool:
    try:
        free_port("::1")
    except OSError:
        return False
    return True


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_a_weight_sync_group_listens_on_loopback(
    host: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both ranks of a ``WeightSyncGroup`` (threads of this process): the rendezvous store
    and gloo's listeners are on ``host`` — even with ``GLOO_SOCKET_IFNAME`` naming an outward
    interface, which the group's explicit device overrides."""
    if host == "::1" and not _has_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    outward = _outward_interface()
    if outward is not None:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", outward)
    before = {(s.address, s.port) for s in listening_sockets([os.getpid()])}
    port = free_port(host)
    groups = [WeightSyncGroup(host, port, rank, 2, timeout_s=60) for rank in (0, 1)]
    threads = [threading.Thread(target=g.connect) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    try:
        assert all(g.connected for g in groups)
        tensors = [torch.arange(4.0), torch.zeros(4)]
        pairs = zip(groups, tensors, strict=True)
        sends = [threading.Thread(target=g.broadcast, args=(t, 0)) for g, t in pairs]
        for t in sends:
            t.start()
        for t in sends:
            t.join(60)
        assert torch.equal(tensors[1], torch.arange(4.0))
        opened = [s for s in listening_sockets([os.getpid()]) if (s.address, s.port) not in before]
        assert any(s.port == port for s in opened), opened  # the store
        assert_loopback_only(opened, at_least=2)  # the store and gloo's
        assert {s.address for s in opened} == {host}
    finally:
        for g in groups:
            g.close()


_SGLANG_RANK_1 = """
import sys
from asyncflow_sglang.group import join_sglang_group
import torch
pg = join_sglang_group("127.0.0.1", int(sys.argv[1]), 1, 2, backend="gloo", timeout_s=60)
t = torch.zeros(3)
torch.distributed.broadcast(t, src=0, group=pg)
print(t.tolist(), flush=True)
sys.stdin.readline()  # hold the group open until the trainer has looked at its sockets
"""


def test_the_trainers_side_of_sglangs_group_listens_on_loopback() -> None:
    """The trainer's rank 0 of SGLang's weight-update group (``SGLangGroup``), with an
    SGLang-like rank 1 in another process joining as SGLang's workers do."""
    pytest.importorskip("aiohttp")
    from asyncflow_sglang.group import SGLangGroup

    port = free_port()
    rank1 = subprocess.Popen(
        [sys.executable, "-c", _SGLANG_RANK_1, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    group = SGLangGroup("127.0.0.1", port, 2, backend="gloo", timeout_s=60)
    try:
        group.connect()
        group.broadcast(torch.tensor([1.0, 2.0, 3.0]), 0)
        assert rank1.stdout is not None and rank1.stdout.readline().strip() == "[1.0, 2.0, 3.0]"
        listeners = listening_sockets([os.getpid(), rank1.pid])
        assert any(s.port == port and s.pid == os.getpid() for s in listeners), listeners
        assert_loopback_only(listeners, at_least=3)  # the store, gloo on each side
    finally:
        group.close()
        assert rank1.stdin is not None
        rank1.stdin.write("\n")
        rank1.stdin.flush()
        rank1.wait(60)


@pytest.mark.slow
def test_a_two_rank_deepspeed_step_listens_on_loopback() -> None:
    """``asyncflow_deepspeed.launch`` with two rank processes, after a training step: the
    default group's store (rank 0) and every rank's gloo listeners are on loopback."""
    pytest.importorskip("deepspeed", reason="the [deepspeed] extra is not installed")
    from asyncflow_conformance.engines import padded_batch
    from asyncflow_deepspeed import launch
    from asyncflow_reference.model import ModelConfig

    from asyncflow_core.training.rl import policy_gradient_loss

    config = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_seq_len=16)
    batch = padded_batch(
        prompts=[[1, 2], [3, 4], [5, 6], [7]],
        responses=[[2, 3], [4, 5], [6, 7, 8], [9]],
        advantages=[1.0, -1.0, 0.5, -0.5],
    )

    async def body() -> None:
        group = launch(config, 2, zero_stage=2, micro_batch_size=2)
        try:
            metrics = await group.train_step(batch, policy_gradient_loss)
            assert metrics.version == 1
            ranks = [pid for pid in group.pids if pid is not None]
            tree = sorted({p for pid in ranks for p in process_tree(pid)})
            listeners = listening_sockets(tree)
            assert {s.pid for s in listeners} == set(ranks), listeners  # both ranks listen
            assert_loopback_only(listeners, at_least=3)  # rank 0's store, gloo on each
        finally:
            await group.close()

    asyncio.run(body())
