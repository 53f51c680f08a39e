"""The worker extension the vLLM adapters drive through ``collective_rpc`` by method *name*:
start vLLM with ``worker_extension_cls="asyncflow_vllm.worker_ext.WeightUpdateExtension"``
(``VLLMEngine.create`` sets it; ``vllm serve ... --worker-extension-cls`` for
``VLLMHTTPEngine``). It runs inside vLLM's workers; run live on vLLM 0.32's CPU build by the
live tier (``tests/live_vllm``).

**Loading tensors held by the caller** (``VLLMEngine.load_weights``, ``VLLMHTTPEngine
.load_weights``: the staged and blocking syncs on CPU, where vLLM has no weight-transfer
backend) goes in three steps, so that a load is checked whole before anything changes and no
single message carries more than one piece:

1. ``asyncflow_begin_load(manifest)``: the ``[name, dtype, shape]`` of every tensor. Checked
   against the model before a byte moves: every name must be a tensor of the model's
   checkpoint (its safetensors headers, read once), with the checkpoint's shape and a floating
   dtype; a layer vLLM stacks from several checkpoint tensors (``qkv_proj`` from ``q_proj``,
   ``k_proj``, ``v_proj``: the model's ``packed_modules_mapping``), or any layer with several
   tensors (weight and bias), is loaded whole or refused, naming what is missing (vLLM's
   layerwise reload fills the rest of a partly loaded layer with uninitialised memory: NaN or
   garbage, never an error). A refused load raises ``ValueError`` and changes nothing.
2. ``asyncflow_load_pieces(pieces)``, as often as needed: ``[index, offset, data]`` triples,
   ``data`` the tensor's bytes from ``offset`` (``bytes`` over the in-process msgpack link,
   base64 text over HTTP). A tensor larger than one piece (``piece_bytes``; msgpack caps one
   ``bin`` at 4 GiB - 1, ``MSGPACK_BIN_LIMIT``) arrives in several and is assembled in one
   buffer; a tensor that arrives whole is used in place (no copy).
3. ``asyncflow_commit_load()``: loads the tensors through vLLM's own in-place reload,
   ``model_runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)``
   (``v1/worker/gpu_model_runner.py``; the same in 0.32 and 0.33): layerwise reload
   (``model_executor/model_loader/reload/layerwise.py``, ``initialize_layerwise_reload`` /
   ``finalize_layerwise_reload``) runs each layer's ``process_weights_after_loading`` again,
   which on CPU re-packs linear weights for the CPU GEMM (``UnquantizedLinearMethod`` empties
   ``layer.weight``: ``model.load_weights`` alone cannot load a linear weight there), then
   ``reset_lora_state()`` and the encoder / multimodal caches, as the native path does. Then
   every module sharing a loaded weight (a tied ``lm_head``) is processed again: on CPU its
   packed copy of the embedding was taken at start-up (``vocab_parallel_embedding.py``,
   ``UnquantizedEmbeddingMethod.process_weights_after_loading``) and the reload does not touch
   it. Returns ``{"tensors", "bytes", "load_s"}``.

``asyncflow_load(manifest, pieces)`` does the three in one call, for a load that fits one
piece (each call is a round trip through vLLM's engine core, between two of its steps).
``asyncflow_abort_load()`` drops a load in progress. One load at a time per worker; a new
``begin`` replaces an unfinished one.

Nothing here unpickles: names, dtypes and shapes are plain values, bytes are bytes, and the
bytes of a tensor are read as the manifest's dtype and shape only.

The NCCL convention of vLLM's old ``examples/offline_inference/rlhf_utils.py`` (still used
by OpenRLHF) stays for vLLMs without the native weight-transfer API:
``init_weight_update_group`` / ``update_weight``.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import difflib
import importlib
import json
import time
import warnings
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

EXTENSION = "asyncflow_vllm.worker_ext.WeightUpdateExtension"
"""The ``worker_extension_cls`` value that installs this extension."""

MSGPACK_BIN_LIMIT = 2**32 - 1
"""The largest ``bytes`` value one msgpack ``bin`` holds (bin 32: a 32-bit length), and so the
largest piece one ``collective_rpc`` argument can carry over vLLM's msgpack link
(``v1/serial_utils.py``)."""

DEFAULT_PIECE_BYTES = 16 << 20
"""Bytes per ``asyncflow_load_pieces`` call by default: vLLM's shared-memory queue to its
workers holds 16 MiB per message (``VLLM_MQ_MAX_CHUNK_BYTES_MB``); a larger one goes through a
socket beside it. Measured on vLLM 0.32's CPU build (``benchmarks/vllm_weight_load.py``, 108 MB,
three runs): 8-16 MiB pieces loaded in 0.26-0.54 s, 256 MiB ones in 0.82-1.26 s."""

METHODS = ("asyncflow_begin_load", "asyncflow_load_pieces", "asyncflow_commit_load")
"""The extension's load methods, in call order (``asyncflow_load``: all three in one call,
for a load that fits one piece)."""

Manifest = list[tuple[str, torch.dtype, tuple[int, ...]]]


# --------------------------------------------------------------------------------------------
# The caller's side: manifests and pieces
# --------------------------------------------------------------------------------------------
def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in C order, on the CPU, as a view (no copy when the tensor is already
    a contiguous CPU tensor)."""
    t = tensor.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.to("cpu").contiguous()
    if not t.numel():
        return memoryview(b"")
    array: Any = t.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array)


def weight_manifest(weights: Sequence[tuple[str, torch.Tensor]]) -> list[list[Any]]:
    """``[name, dtype, shape]`` per tensor, msgpack- and JSON-native."""
    return [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in weights]


def weight_pieces(
    weights: Sequence[tuple[str, torch.Tensor]], piece_bytes: int, *, text: bool = False
) -> Iterator[list[list[Any]]]:
    """The tensors' bytes as ``asyncflow_load_pieces`` arguments: lists of ``[index, offset,
    data]`` holding at most ``piece_bytes`` bytes each (a tensor larger than that is cut
    across several); ``data`` is a ``memoryview`` of the tensor (``text``: base64 text, for
    JSON). An empty tensor sends one empty piece."""
    if piece_bytes < 1:
        raise ValueError(f"piece_bytes must be >= 1, got {piece_bytes}")
    batch: list[list[Any]] = []
    size = 0
    for index, (_, tensor) in enumerate(weights):
        raw = tensor_bytes(tensor)
        offset = 0
        while True:
            take = min(piece_bytes - size, len(raw) - offset)
            chunk = raw[offset : offset + take]
            data: Any = base64.b64encode(chunk).decode("ascii") if text else chunk
            batch.append([index, offset, data])
            size += take
            offset += take
            if size >= piece_bytes:
                yield batch
                batch, size = [], 0
            if offset >= len(raw):
                break
    if batch:
        yield batch


Rpc = Callable[[str, tuple[Any, ...]], Awaitable[Any]]
"""``rpc(method, args)``: one ``collective_rpc`` of the extension's method on every worker."""


@dataclass(frozen=True)
class LoadReport:
    """One ``send_weights``: tensors and bytes sent, calls made, seconds in all and of those the
    workers' reload (``commit``), as the first worker reported them."""

    tensors: int
    bytes: int
    calls: int
    seconds: float
    load_s: float
    retied: tuple[str, ...] = ()


async def send_weights(
    rpc: Rpc, weights: Sequence[tuple[str, torch.Tensor]], *, piece_bytes: int, text: bool
) -> LoadReport:
    """Load ``weights`` into every worker through the extension: ``begin`` (checked there
    first), the pieces, ``commit``; on any failure the load is aborted on the workers (nothing
    changed). ``text``: the bytes as base64 text (HTTP's ``/collective_rpc`` carries JSON; the
    arguments go as JSON values, not JSON text in a string: one encoding pass, not two)."""
    t0 = time.perf_counter()
    manifest = weight_manifest(weights)
    total = sum(t.numel() * t.element_size() for _, t in weights)
    if total <= piece_bytes:  # one call: begin, the one piece, commit (the worker's load)
        batches = list(weight_pieces(weights, piece_bytes, text=text))
        pieces = batches[0] if batches else []
        results = await rpc("asyncflow_load", (manifest, pieces))
        return _report(manifest, total, 1, t0, results)
    await rpc("asyncflow_begin_load", (manifest,))
    calls = 1
    try:
        for batch in weight_pieces(weights, piece_bytes, text=text):
            await rpc("asyncflow_load_pieces", (batch,))
            calls += 1
        results = await rpc("asyncflow_commit_load", ())
        calls += 1
    except BaseException:
        with contextlib.suppress(Exception):  # the first error is the one to report
            await rpc("asyncflow_abort_load", ())
        raise
    return _report(manifest, total, calls, t0, results)


def _report(
    manifest: list[list[Any]], total: int, calls: int, t0: float, results: Any
) -> LoadReport:
    first = results[0] if isinstance(results, list) and results else {}
    first = first if isinstance(first, dict) else {}
    return LoadReport(
        tensors=len(manifest),
        bytes=total,
        calls=calls,
        seconds=time.perf_counter() - t0,
        load_s=float(first.get("load_s", 0.0)),
        retied=tuple(str(n) for n in first.get("retied", ())),
    )


# --------------------------------------------------------------------------------------------
# Checking a manifest against the model (pure: tested without vLLM)
# --------------------------------------------------------------------------------------------
_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


def read_checkpoint(folder: str | Path) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """``{name: (dtype, shape)}`` of every tensor in a model folder's safetensors files, read
    from their headers (no tensor data), or None when the folder has none (a hub id, another
    format): the checks then fall back to the model's stacked-parameter mapping alone."""
    path = Path(folder)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        return None
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in files:
        with file.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size < 1 << 30:
                return None
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name == "__metadata__" or not isinstance(info, dict):
                continue
            dtype = _SAFETENSORS_DTYPES.get(str(info.get("dtype")), str(info.get("dtype")))
            out[name] = (dtype, tuple(int(d) for d in info.get("shape", ())))
    return out


def layer_of(name: str, stacked: Mapping[str, Sequence[str]]) -> str:
    """The vLLM layer a checkpoint tensor loads into: its module path, with a stacked part
    (``q_proj``) replaced by the stacked layer (``qkv_proj``)."""
    module = name.rpartition(".")[0]
    parent, _, leaf = module.rpartition(".")
    for packed, parts in stacked.items():
        if leaf in parts:
            return f"{parent}.{packed}" if parent else packed
    return module


def check_manifest(
    manifest: Sequence[Sequence[Any]],
    *,
    expected: Mapping[str, tuple[str, tuple[int, ...]]] | None,
    stacked: Mapping[str, Sequence[str]],
    tied: Mapping[str, str] | None = None,
) -> Manifest:
    """The manifest as ``(name, dtype, shape)`` if it can be loaded whole into the model, else
    ``ValueError`` listing every problem: a malformed or repeated entry, a dtype that is not
    floating, a name the checkpoint lacks (``expected``, None: unknown), a shape other than
    the checkpoint's, a layer loaded in part (every tensor of a layer, per the checkpoint or,
    without one, every part of a stacked layer, must come together). ``tied``: names the
    model ties to another (``lm_head.weight`` -> ``model.embed_tokens.weight``): accepted only
    beside the tensor they are tied to (vLLM skips them)."""
    problems: list[str] = []
    parsed: Manifest = []
    seen: set[str] = set()
    tied = tied or {}
    for i, entry in enumerate(manifest):
        try:
            name, dtype_name, shape = entry
            dtype = getattr(torch, str(dtype_name))
            if not isinstance(name, str) or not name or not isinstance(dtype, torch.dtype):
                raise TypeError("not [name, dtype, shape]")
            dims = tuple(int(d) for d in shape)
            if any(d < 0 for d in dims) or any(isinstance(d, bool) for d in shape):
                raise TypeError(f"bad shape {shape!r}")
        except (TypeError, ValueError, AttributeError) as exc:
            problems.append(f"entry {i} is malformed ({str(entry)[:80]}: {exc})")
            continue
        if name in seen:
            problems.append(f"{name!r} appears twice")
            continue
        seen.add(name)
        if not (dtype.is_floating_point):
            problems.append(f"{name!r} has dtype {dtype_name}; weights are floating point")
        parsed.append((name, dtype, dims))
    if expected is not None:
        for name, _, dims in parsed:
            if name in tied:
                if tied[name] not in seen:
                    problems.append(
                        f"{name!r} is tied to {tied[name]!r} in this model and vLLM loads only "
                        f"the latter: send {tied[name]!r}"
                    )
                continue
            if name not in expected:
                close = difflib.get_close_matches(name, list(expected), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                problems.append(f"{name!r} is not a tensor of this model's checkpoint{hint}")
            elif expected[name][1] != dims:
                problems.append(
                    f"{name!r} has shape {list(dims)}; the model's is {list(expected[name][1])}"
                )
        members: dict[str, set[str]] = {}
        for name in expected:
            members.setdefault(layer_of(name, stacked), set()).add(name)
    else:  # no checkpoint to read: the stacked layers' parts, with the same parameter suffix
        members = {}
        for name, _, _ in parsed:
            module, _, suffix = name.rpartition(".")
            parent, _, leaf = module.rpartition(".")
            for parts in stacked.values():
                if leaf in parts:
                    group = {f"{parent}.{p}.{suffix}" if parent else f"{p}.{suffix}" for p in parts}
                    members.setdefault(f"{layer_of(name, stacked)}.{suffix}", set()).update(group)
    incomplete: list[str] = []
    for layer, names in sorted(members.items()):
        sent = names & seen
        if sent and sent != names:
            missing = sorted(names - seen)
            incomplete.append(f"{layer} (missing {', '.join(missing)})")
    if incomplete:
        problems.append(
            "a layer must be loaded whole (vLLM fills the rest of a partly loaded layer with "
            "uninitialised memory): " + "; ".join(incomplete)
        )
    if problems:
        raise ValueError("refused the weight load, nothing changed: " + "; ".join(problems))
    return parsed


def _piece_data(data: Any, what: str) -> memoryview:
    if isinstance(data, str):  # base64 over HTTP's JSON
        try:
            return memoryview(base64.b64decode(data.encode("ascii"), validate=True))
        except (binascii.Error, UnicodeEncodeError) as exc:
            raise ValueError(f"{what}: data is not base64 ({exc})") from exc
    if isinstance(data, bytes | bytearray | memoryview):
        return memoryview(data).cast("B")
    raise ValueError(f"{what}: data is a {type(data).__name__}, not bytes or base64 text")


def _native(value: Any) -> Any:
    """An argument as sent: a value (msgpack, or JSON over ``/collective_rpc``), or JSON text
    (also taken: a hand-written ``/collective_rpc`` call may find it easier)."""
    return json.loads(value) if isinstance(value, str) else value


class _Load:
    """A load in progress on one worker: the checked manifest and the bytes received."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.sizes = [
            (torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size())
            for _, dtype, shape in manifest
        ]
        self.buffers: list[Any] = [None] * len(manifest)  # whole bytes, or a uint8 tensor
        self.received = [0] * len(manifest)

    def add(self, index: Any, offset: Any, data: Any) -> None:
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"piece index {index!r} is not an int")
        if not 0 <= index < len(self.manifest):
            raise ValueError(f"piece index {index} is outside the manifest's {len(self.sizes)}")
        name, size = self.manifest[index][0], self.sizes[index]
        raw = _piece_data(data, f"piece of {name!r}")
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise ValueError(f"piece of {name!r}: offset {offset!r} is not an int")
        if offset != self.received[index] or offset + len(raw) > size:
            raise ValueError(
                f"piece of {name!r} at byte {offset} with {len(raw)} bytes: expected the piece "
                f"at byte {self.received[index]} of {size}"
            )
        if offset == 0 and len(raw) == size:
            self.buffers[index] = raw  # arrived whole: used in place
        else:
            if self.buffers[index] is None:
                self.buffers[index] = torch.empty(size, dtype=torch.uint8)
            if raw.nbytes:
                self.buffers[index][offset : offset + len(raw)] = _from_buffer(raw)
        self.received[index] += len(raw)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        short = [
            f"{entry[0]!r} ({got} of {size} bytes)"
            for entry, got, size in zip(self.manifest, self.received, self.sizes, strict=True)
            if got != size
        ]
        if short:
            raise ValueError(f"commit before every byte arrived: {', '.join(short[:5])}")
        out: list[tuple[str, torch.Tensor]] = []
        for (name, dtype, shape), buffer in zip(self.manifest, self.buffers, strict=True):
            flat = buffer if isinstance(buffer, torch.Tensor) else _from_buffer(buffer)
            out.append((name, flat.view(dtype).reshape(shape) if flat.numel() else
                        torch.empty(shape, dtype=dtype)))  # fmt: skip
        return out


def _from_buffer(raw: memoryview) -> torch.Tensor:
    if not raw.nbytes:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # read-only bytes: the loaders only read them
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(raw, dtype=torch.uint8)


def retie(model: Any, loaded: set[str]) -> list[str]:
    """Process again every module that shares its ``weight`` with a module whose weight was
    loaded but was not loaded itself (a tied ``lm_head``): its kernel-format copy (on CPU,
    a packed GEMM weight) still holds the old values. Returns their names."""
    by_param: dict[int, list[tuple[str, Any]]] = {}
    named = getattr(model, "named_modules", None)
    for name, module in named() if callable(named) else ():
        weight = getattr(module, "_parameters", {}).get("weight")
        if weight is not None and getattr(module, "quant_method", None) is not None:
            by_param.setdefault(id(weight), []).append((name, module))
    again: list[str] = []
    for group in by_param.values():
        if len(group) < 2 or not any(f"{name}.weight" in loaded for name, _ in group):
            continue
        for name, module in group:
            if f"{name}.weight" not in loaded:
                module.quant_method.process_weights_after_loading(module)
                again.append(name)
    return again


# --------------------------------------------------------------------------------------------
# The extension
# --------------------------------------------------------------------------------------------
class WeightUpdateExtension:
    """Mixed into vLLM's worker class: ``self`` is the worker (``self.device``,
    ``self.model_runner``)."""

    model_update_group: Any = None
    _asyncflow_load: _Load | None = None
    _asyncflow_checkpoint: Any = False  # False: not read yet; None: no safetensors
    _asyncflow_keep = False
    _asyncflow_kept: list[tuple[str, torch.Tensor]] | None = None

    # -- loading tensors held by the caller ----------------------------------------------------
    def asyncflow_begin_load(self, manifest: Any) -> dict[str, int]:
        """Check ``manifest`` (``[[name, dtype, shape], ...]``) against
        the model and open a load; ``ValueError`` naming every problem otherwise."""
        self._asyncflow_load = None
        model = self.model_runner.model  # type: ignore[attr-defined]
        parsed = check_manifest(
            _native(manifest),
            expected=self._asyncflow_expected(),
            stacked=dict(getattr(model, "packed_modules_mapping", None) or {}),
            tied=_tied_names(model),
        )
        self._asyncflow_load = _Load(parsed)
        return {"tensors": len(parsed), "bytes": sum(self._asyncflow_load.sizes)}

    def asyncflow_load_pieces(self, pieces: Any) -> int:
        """Take ``[[index, offset, data], ...]`` (base64 data over HTTP);
        returns the bytes received so far. A bad piece drops the load."""
        load = self._asyncflow_load
        if load is None:
            raise ValueError("asyncflow_load_pieces without asyncflow_begin_load")
        try:
            for piece in _native(pieces):
                index, offset, data = piece
                load.add(index, offset, data)
        except (TypeError, ValueError) as exc:
            self._asyncflow_load = None
            raise ValueError(f"weight load dropped, nothing changed: {exc}") from exc
        return sum(load.received)

    def asyncflow_commit_load(self) -> dict[str, Any]:
        """Load what arrived through vLLM's in-place reload (module docstring)."""
        load, self._asyncflow_load = self._asyncflow_load, None
        if load is None:
            raise ValueError("asyncflow_commit_load without asyncflow_begin_load")
        weights = load.tensors()
        device = getattr(self, "device", "cpu")
        if str(device) != "cpu":
            weights = [(n, t.to(device)) for n, t in weights]
        t0 = time.perf_counter()
        runner = self.model_runner  # type: ignore[attr-defined]
        reload = getattr(runner, "reload_weights", None)
        if callable(reload):
            reload(weights_iterator=iter(weights), is_checkpoint_format=True)
        else:  # a vLLM before the in-place reload (0.26): the model's own loader
            runner.model.load_weights(weights=weights)
        retied = retie(runner.model, {n for n, _ in weights})
        if self._asyncflow_keep:
            self._asyncflow_kept = [(n, t.detach().to("cpu").clone()) for n, t in weights]
        return {
            "tensors": len(weights),
            "bytes": sum(load.sizes),
            "load_s": time.perf_counter() - t0,
            "retied": retied,
        }

    def asyncflow_load(self, manifest: Any, pieces: Any) -> dict[str, Any]:
        """``asyncflow_begin_load``, ``asyncflow_load_pieces`` and ``asyncflow_commit_load`` in
        one call, for a load that fits one piece (one round trip through the engine core
        instead of three)."""
        self.asyncflow_begin_load(manifest)
        self.asyncflow_load_pieces(pieces)
        return self.asyncflow_commit_load()

    def asyncflow_abort_load(self) -> None:
        """Drop a load in progress (nothing was loaded)."""
        self._asyncflow_load = None

    def asyncflow_keep_loads(self, keep: Any) -> None:
        """Tests: keep a copy of what each load hands vLLM's loaders (``True``), or stop."""
        self._asyncflow_keep = bool(_native(keep))
        self._asyncflow_kept = None

    def asyncflow_kept_load(self) -> dict[str, list[Any]]:
        """Tests: the tensors the last load handed vLLM's loaders (kept since
        ``asyncflow_keep_loads(True)``), as ``{name: [dtype, shape, base64 bytes]}``. vLLM's
        CPU kernels keep linear weights packed (unreadable) in the model, so a test that checks
        that bytes arrived whole reads them here; that the model computes with them is what
        the log-prob agreement of the pair suite checks."""
        kept = self._asyncflow_kept or []
        return {
            name: [
                str(t.dtype).removeprefix("torch."),
                list(t.shape),
                base64.b64encode(tensor_bytes(t)).decode("ascii"),
            ]
            for name, t in kept
        }

    def _asyncflow_expected(self) -> Any:
        if self._asyncflow_checkpoint is False:
            runner = self.model_runner  # type: ignore[attr-defined]
            config = getattr(runner, "vllm_config", None) or getattr(runner, "model_config", None)
            model_config = getattr(config, "model_config", config)
            folder = getattr(model_config, "model", None)
            self._asyncflow_checkpoint = read_checkpoint(folder) if folder else None
        return self._asyncflow_checkpoint

    # -- the NCCL group of vLLMs without the native weight transfer ----------------------------
    def init_weight_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int
    ) -> None:
        utils = importlib.import_module("vllm.distributed.utils")
        pynccl = importlib.import_module("vllm.distributed.device_communicators.pynccl")
        parallel_state = importlib.import_module("vllm.distributed.parallel_state")
        rank = parallel_state.get_world_group().rank + rank_offset
        group = utils.StatelessProcessGroup.create(
            host=master_address, port=master_port, rank=rank, world_size=world_size
        )
        self.model_update_group = pynccl.PyNcclCommunicator(group, device=self.device)  # type: ignore[attr-defined]

    def update_weight(self, name: str, dtype_name: str, shape: list[int]) -> None:
        if self.model_update_group is None:
            raise RuntimeError("call init_weight_update_group first")
        weight = torch.empty(shape, dtype=getattr(torch, dtype_name), device="cuda")
        self.model_update_group.broadcast(weight, src=0, stream=torch.cuda.current_stream())
        self.model_runner.model.load_weights(weights=[(name, weight)])  # type: ignore[attr-defined]
        del weight


def extension_refusal(extension: str | None) -> str | None:
    """Why workers started with ``worker_extension_cls=extension`` ("": none) cannot take
    tensors from ``load_weights``; None when they can, or when it cannot be told (``None``:
    the engine did not say; a class not importable here)."""
    if extension is None or extension == EXTENSION:
        return None
    if extension:
        module, _, name = extension.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError):
            return None
        if isinstance(cls, type) and issubclass(cls, WeightUpdateExtension):
            return None
    what = f"worker_extension_cls={extension!r}" if extension else "no worker_extension_cls"
    return (
        f"its workers run {what}, not {EXTENSION!r} (or a subclass), whose methods "
        "load_weights calls: start vLLM with it (VLLMEngine.create sets it; vllm serve ... "
        f"--worker-extension-cls {EXTENSION})"
    )


def kept_tensors(kept: Mapping[str, Sequence[Any]]) -> dict[str, torch.Tensor]:
    """``asyncflow_kept_load``'s answer as tensors."""
    out: dict[str, torch.Tensor] = {}
    for name, (dtype_name, shape, text) in kept.items():
        raw = base64.b64decode(text)
        dtype = getattr(torch, str(dtype_name))
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else None
        out[name] = (
            flat.view(dtype).reshape(shape) if flat is not None else torch.empty(shape, dtype=dtype)
        )
    return out


def _tied_names(model: Any) -> dict[str, str]:
    """``{"lm_head.weight": "model.embed_tokens.weight"}`` when the model ties them (its config
    says so, and vLLM skips ``lm_head`` when loading)."""
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False):
        return {"lm_head.weight": "model.embed_tokens.weight"}
    return {}


__all__ = [
    "DEFAULT_PIECE_BYTES",
    "EXTENSION",
    "METHODS",
    "MSGPACK_BIN_LIMIT",
    "LoadReport",
    "WeightUpdateExtension",
    "check_manifest",
    "extension_refusal",
    "kept_tensors",
    "layer_of",
    "read_checkpoint",
    "retie",
    "send_weights",
    "tensor_bytes",
    "weight_manifest",
    "weight_pieces",
]
