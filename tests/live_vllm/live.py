"""What the live vLLM tier shares: two tiny models made in code, one ``vllm serve`` (the tied
Qwen2) and one in-process ``AsyncLLM`` (the untied Llama), each started once per session and
always stopped.

vLLM starts in 45-130 s here (three processes, each importing vLLM), so every suite class that
can use an engine shares it: the server through a fresh ``VLLMHTTPEngine`` client per law, the
in-process engine through an ``EngineHost`` proxy (the engine lives on an event loop of its
own; each law runs on another). State carries over between laws (weights, versions); a law
that fails while the engine is paused leaves it paused, so every class resumes it afterwards
(``reset``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

from asyncflow_core.engines.process import free_port

MODELS = {"qwen2": "small-qwen2", "llama": "small-llama"}

MAX_MODEL_LEN = 2048
"""Context of both engines (the models' ``max_position_embeddings`` raised to it): long
enough that a long request outlasts the stalls a busy 2-core machine gives the test's own
process (vLLM's workers spin on their queues between steps), so the laws that abort or pause
requests in flight catch them generating."""
"""The live models: Qwen2 ties its embeddings, Llama does not (both head size 32, the smallest
vLLM's CPU attention serves)."""

START_S = 600.0
"""Safety net on a vLLM start (idle: 45-130 s; beside other work it takes longer)."""

ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: plenty for the tiny models
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
for _key, _value in ENV.items():
    os.environ.setdefault(_key, _value)

_lock = threading.RLock()
_root: Path | None = None
_folders: dict[str, Path] = {}


def model_folder(key: str) -> Path:
    """The model folder of ``key`` (``qwen2`` or ``llama``), made once per session."""
    global _root
    with _lock:
        if key not in _folders:
            from asyncflow_hf.assets import make_model_folder

            if _root is None:
                _root = Path(tempfile.mkdtemp(prefix="asyncflow-live-vllm-"))
            folder = make_model_folder(_root / key, model=MODELS[key], seed=0)
            config = json.loads((folder / "config.json").read_text())
            config["max_position_embeddings"] = MAX_MODEL_LEN  # rotary: any length works
            (folder / "config.json").write_text(json.dumps(config, indent=2))
            _folders[key] = folder
        return _folders[key]


def checkpoint(key: str) -> list[tuple[str, torch.Tensor]]:
    """The model folder's tensors (its safetensors), in the HF names vLLM loads."""
    from safetensors.torch import load_file

    tensors = load_file(str(model_folder(key) / "model.safetensors"))
    return sorted(tensors.items())


def vocab_size(key: str) -> int:
    import json

    return int(json.loads((model_folder(key) / "config.json").read_text())["vocab_size"])


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 in a process group of its
    own, as ``docs/vllm.md`` launches it for ``VLLMHTTPEngine``."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        folder = model_folder(key)
        self.log_path = folder.parent / f"server-{key}.log"
        self._log = self.log_path.open("wb")
        env = {**os.environ, **ENV, "VLLM_SERVER_DEV_MODE": "1"}
        self.command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(folder), "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--enforce-eager", "--seed", "0",
            "--max-model-len", str(MAX_MODEL_LEN),
            "--enable-scale-out", "--logprobs-mode", "processed_logprobs",
            "--worker-extension-cls", "asyncflow_vllm.worker_ext.WeightUpdateExtension",
        ]  # fmt: skip
        self.process = subprocess.Popen(
            self.command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # its engine core and workers die with the group
        )
        self.started = time.monotonic()
        self.ready_s: float | None = None

    def wait_ready(self, timeout_s: float = START_S) -> None:
        """Until ``GET /version`` answers (the evidence), the process exits (its log tail is
        the error), or the safety net runs out."""
        deadline = time.monotonic() + timeout_s
        while self.ready_s is None:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with {self.process.returncode} before it answered:\n"
                    + self.tail()
                )
            try:
                with urllib.request.urlopen(f"{self.url}/version", timeout=5) as answer:
                    if answer.status == 200:
                        self.ready_s = time.monotonic() - self.started
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve not ready after {timeout_s} s:\n" + self.tail())
            time.sleep(0.5)  # polling for the evidence above, not a wait for it

    def tail(self, lines: int = 40) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL after 30 s."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)
        with contextlib.suppress(ProcessLookupError):  # anything the group left behind
            os.killpg(self.process.pid, signal.SIGKILL)
        self._log.close()


_servers: dict[str, Server] = {}
_hosts: dict[str, Any] = {}
start_seconds: dict[str, float] = {}


def start_server(key: str) -> Server:
    """Start the server of ``key`` (once) without waiting for it."""
    with _lock:
        if key not in _servers:
            _servers[key] = Server(key)
        return _servers[key]


def server(key: str) -> Server:
    """The server of ``key``, started and ready."""
    s = start_server(key)
    s.wait_ready()
    start_seconds.setdefault(f"vllm serve ({key})", float(s.ready_s or 0.0))
    return s


def host(key: str) -> Any:
    """The ``EngineHost`` of the in-process engine of ``key`` (made once)."""
    from asyncflow_conformance.shared import EngineHost
    from asyncflow_vllm import VLLMEngine

    with _lock:
        if key not in _hosts:
            folder = str(model_folder(key))
            t0 = time.monotonic()
            _hosts[key] = EngineHost(
                lambda: VLLMEngine.create(
                    folder, name=f"live-{key}", ignore_eos=True, dtype="float32",
                    enforce_eager=True, seed=0, max_model_len=MAX_MODEL_LEN,
                ),
                name=f"vllm AsyncLLM ({key})",
                timeout_s=START_S,
            )  # fmt: skip
            start_seconds[f"AsyncLLM ({key})"] = time.monotonic() - t0
        return _hosts[key]


def stop_all() -> None:
    """Stop every engine this session started (safe to repeat)."""
    for h in list(_hosts.values()):
        with contextlib.suppress(Exception):
            h.close()
    _hosts.clear()
    for s in list(_servers.values()):
        with contextlib.suppress(Exception):
            s.stop()
    _servers.clear()


async def reset(engine: Any) -> None:
    """After a law: an engine (or a server) left paused is resumed; a client is closed."""
    with contextlib.suppress(Exception):
        if getattr(engine, "paused", False):
            await engine.resume()
        elif hasattr(engine, "is_paused") and await engine.is_paused():
            await engine._post("/resume")
    close = getattr(engine, "close", None)
    if callable(close) and not _is_proxy(engine):
        with contextlib.suppress(Exception):
            await asyncio.wait_for(close(), 30)


def _is_proxy(engine: Any) -> bool:
    """A shared engine's proxy (also seen through another proxy): never closed by a law."""
    from asyncflow_conformance.shared import EngineHost

    return isinstance(getattr(engine, "_host", None), EngineHost)


def require_ability(engine: Any, ability: str) -> None:
    """Skip (pytest) as the conformance suites do when ``engine`` declares ``ability``
    unavailable where it runs."""
    import pytest

    from asyncflow_core.contracts.protocols import unavailable_ability

    reason = unavailable_ability(engine, ability)
    if reason is not None:
        pytest.skip(f"{type(engine).__name__} declares {ability} unavailable here: {reason}")


def kept_load(engine: Any) -> dict[str, torch.Tensor]:
    """What the engine's worker handed vLLM's loaders at its last load (the worker keeps a
    copy once ``keep_loads`` asked it to): read from another thread than the engine's."""
    import json
    import urllib.request

    from asyncflow_vllm.worker_ext import kept_tensors

    if hasattr(engine, "base_url"):  # a server: its /collective_rpc, synchronously
        body = json.dumps({"method": "asyncflow_kept_load", "args": []}).encode()
        request = urllib.request.Request(
            f"{engine.base_url}/collective_rpc",
            data=body,
            headers={"Content-Type": "application/json", "Connection": "close"},
        )
        with urllib.request.urlopen(request, timeout=120) as answer:
            results = json.loads(answer.read())["results"]
    else:  # the in-process engine, on its own loop
        results = _hosts_of(engine).run(engine._rpc("asyncflow_kept_load", ()), timeout_s=120)
    return kept_tensors(results[0])


async def keep_loads(engine: Any) -> None:
    """Ask the engine's workers to keep a copy of each load (``kept_load``)."""
    if hasattr(engine, "base_url"):
        await engine._collective_rpc("asyncflow_keep_loads", ("true",))
    else:
        await engine._rpc("asyncflow_keep_loads", (True,))


def _hosts_of(engine: Any) -> Any:
    for h in _hosts.values():
        if getattr(engine, "_host", None) is h:
            return h
    raise LookupError("not the proxy of a live engine host")
