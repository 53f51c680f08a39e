"""``DeepSpeedTrainEngine``: a ``TrainEngine`` over ``deepspeed.initialize``.

One instance is one *rank* of a data-parallel DeepSpeed job (SPMD): with ``world_size=1`` it
is a complete trainer in this process; with more ranks each process builds one and every
rank makes the same calls with its own share of the batch (``SPMDTrainEngine`` in
``asyncflow_core.engines.process`` does that for you: ``launch()`` in this package).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import math
import os
import sys
import threading
import warnings
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import torch
from torch import Tensor

from asyncflow_core.contracts.errors import CheckpointError, ConfigError, EngineError, PeerRankError
from asyncflow_core.contracts.protocols import Batch, LossFn, TrainMetrics, Version, WeightBucket
from asyncflow_core.engines.enginekit import build_module
from asyncflow_core.engines.lmtrain import (
    MetricMeans,
    ThreadedTrainer,
    TokenRows,
    check_loss,
    checkpoint_key,
    is_int,
    read_signed_manifest,
    sign_manifest,
    slice_batch,
    unique_named_tensors,
    worker_thread,
)
from asyncflow_core.engines.process import free_port
from asyncflow_core.infra.platform import (
    Platform,
    current_platform,
    gloo_listens_on,
    rendezvous_store,
    select_platform,
)
from asyncflow_core.sync.transports import bucketize
from asyncflow_core.training.sampling import OFF_SUPPORT_METRIC
from asyncflow_deepspeed.compat import require_deepspeed
from asyncflow_deepspeed.opbuild import prepare_ops

_T = TypeVar("_T")
Dtype = Literal["fp32", "bf16"]

CHECKPOINT_TAG = "asyncflow"
CHECKPOINT_META = "asyncflow.json"
_FORMAT = "asyncflow-deepspeed-trainer/1"

# Keys of the DeepSpeed config this engine sets from its own arguments.
_OWNED = {
    "train_batch_size": "micro_batch_size (and the world size)",
    "train_micro_batch_size_per_gpu": "micro_batch_size",
    "gradient_accumulation_steps": "micro_batch_size (the engine accumulates per batch)",
    "gradient_clipping": "max_grad_norm",
    "optimizer": "lr, betas, weight_decay (the engine builds a torch AdamW)",
    "fp16": "dtype",
}


class DeepSpeedTrainEngine(ThreadedTrainer):
    """Trains any ``torch.nn.Module`` that maps token ids ``[B, T]`` to next-token logits
    ``[B, T, V]`` (or to an output with a ``.logits`` field, as a Hugging Face causal LM does)
    with DeepSpeed: ZeRO stage 0-3, fp32 or bf16, one or several ranks.

    ``DeepSpeedTrainEngine(model, *, zero_stage=0, dtype="fp32", lr=1e-3, betas=(0.9, 0.999),
    weight_decay=0.0, max_grad_norm=1.0, micro_batch_size=32, temperature=1.0, seed=0,
    ds_config=None, init_method=None, rank=None, world_size=None, backend=None,
    timeout_s=600, name=..., threads=None)``

    * ``model``: a module (deep-copied: the caller's is never changed) or a model spec
      (``asyncflow_core.engines.enginekit.ModelSpec``: ``build(seed=...)``, e.g. the reference
      ``ModelConfig``, which builds a ``TransformerLM``) built from ``seed``. Token ids are
      checked against ``model.config.vocab_size`` and the length
      against ``max_seq_len`` / ``max_position_embeddings`` when the model has them.
    * The optimizer is ``torch.optim.AdamW(lr, betas, weight_decay, eps=1e-8)`` handed to
      ``deepspeed.initialize`` (so no DeepSpeed optimizer op is compiled); ZeRO partitions its
      state. ``max_grad_norm`` is DeepSpeed's ``gradient_clipping`` (``None``: off).
    * ``ds_config``: more DeepSpeed config keys, merged over the engine's (e.g.
      ``{"zero_optimization": {"overlap_comm": True}}``); a key the engine derives from its
      arguments (batch sizes, ``gradient_clipping``, ``optimizer``, ``fp16``, the ZeRO stage,
      ``bf16.enabled``) is refused with an error naming the argument to use instead.
    * Distributed: if ``torch.distributed`` is not initialised, the engine initialises it:
      at ``init_method`` with ``rank`` / ``world_size`` if given, from the ``env://``
      variables if ``RANK`` and ``WORLD_SIZE`` are set (a ``torchrun`` / ``deepspeed``
      launch), else as a world of one on a free local port, which then serves every later
      engine of this process (DeepSpeed caches groups derived from it, so it is never torn
      down). ``backend`` defaults to the platform's (gloo on CPU, nccl on CUDA, hccl on
      NPU). ``LOCAL_RANK`` is set if missing (DeepSpeed reads it).
    * ``platform`` (``asyncflow_core.infra.platform``; a name or a ``Platform``; None: the
      process's current one): DeepSpeed runs on its accelerator. DeepSpeed picks its
      accelerator once per process, at its first import, from ``DS_ACCELERATOR`` or by
      probing; the engine sets ``DS_ACCELERATOR`` to the platform's (``cpu``, ``cuda``,
      ``npu``) when DeepSpeed is not imported yet, and refuses, naming both, a
      ``DS_ACCELERATOR`` or an already chosen accelerator that differs. ``platform="npu"``
      on a machine without torch_npu or CANN fails here, before DeepSpeed is touched.
    * The ops DeepSpeed compiles on first use (on CPU ``deepspeed_shm_comm``) are built before
      DeepSpeed starts, with progress on stderr; a build lock that no live build holds (a
      killed build's) is refused with an error naming the file to remove, where DeepSpeed
      would wait on it forever (``asyncflow_deepspeed.opbuild``).

    **Batches and steps** follow ``asyncflow_reference.engines.TorchTrainEngine``: fields
    ``prompt`` and ``response`` in any store layout; ``compute_logprobs`` returns ``[B, R]``
    fp32 log-probs of the response tokens under each row's sampling distribution (its
    ``temperature``/``top_k``/``top_p`` fields, ``asyncflow_core.training.sampling``; the
    constructor's ``temperature`` for a batch without them), the quantity the loss gets too;
    ``extra["logprobs_off_support"]`` counts the tokens found off their support. ``train_step(batch,
    loss_fn)`` splits this rank's rows into micro-batches of ``micro_batch_size`` and runs
    DeepSpeed's own accumulation: ``engine(x)``, ``engine.backward(loss)`` per micro-batch with the
    accumulation boundary set on the last (``set_gradient_accumulation_boundary``), then one
    ``engine.step()``. Each micro-batch's loss is weighted by its share of the *whole* batch's
    response tokens (all ranks), times the world size because DeepSpeed averages gradients over
    ranks, so the step equals one full-batch step of a token-mean loss however the rows are spread.
    The ranks agree on the number of micro-batches (a rank with fewer runs zero-weight ones: ZeRO-3
    gathers parameters collectively in every forward).

    **Failures change nothing, on every rank alike**: a bad batch on any rank is rejected by
    all of them before any compute; a loss that raises or is not finite stops the step
    before its backward on every rank, and the gradients accumulated so far are discarded;
    a non-finite gradient makes DeepSpeed skip the step (this engine turns the skip into an
    ``EngineError``). ``weight_version`` only moves on a step that happened.

    **Metrics** are the whole step's (summed over ranks): ``loss`` and the loss function's
    metrics are token-weighted means, ``grad_norm`` the norm before clipping, ``samples``
    and ``tokens`` the totals; ``extra["micro_batches"]`` counts this rank's.

    **Weights**: ``export_weights(bucket_bytes)`` yields every parameter and persistent
    buffer under the module's ``state_dict`` names, full size, in the training dtype,
    bucketed as ``asyncflow_core.sync.transports.bucketize`` does, *from rank 0 only*; the other
    ranks take part (under ZeRO-3 each bucket's parameters are gathered with
    ``deepspeed.zero.GatheredParameters``, so memory holds one bucket at a time) and yield
    nothing. **Checkpoints** are DeepSpeed's own (``save_checkpoint`` / ``load_checkpoint``,
    tag ``"asyncflow"``: module, ZeRO-partitioned optimizer state, one file set per rank)
    plus ``asyncflow.json`` (format, version, stage, dtype, world size, parameter shapes, and
    the sha256 and size of every file of the checkpoint, signed with an HMAC-SHA256 under this
    user's checkpoint key: ``ASYNCFLOW_CHECKPOINT_KEY``, else the 0600 file
    ``$XDG_CONFIG_HOME/asyncflow/checkpoint.key`` or ``~/.config/asyncflow/checkpoint.key``,
    made on the first save), written last. DeepSpeed reads checkpoints with
    ``torch.load(weights_only=False)``, which runs whatever code a pickle names, so loading
    first checks that manifest and refuses (``CheckpointRefusedError``, before DeepSpeed
    opens a file) a checkpoint with no manifest, one signed with another key, or whose files
    differ from it; ``trust_checkpoints=True`` (for checkpoints from elsewhere that you trust)
    skips that check. Then it refuses a checkpoint from another model, stage, dtype or world
    size (``CheckpointError``) without touching the engine. Ranks on several hosts need the
    same key (set ``ASYNCFLOW_CHECKPOINT_KEY`` on each). **Sleep**: ``sleep()``
    moves the trainer's states off the accelerator with ``engine.offload_states()`` and
    ``wake_up()`` brings them back (``reload_states()``): ZeRO stages 1 and 2 move all of
    them; stage 3 moves the 16-bit parameters and gradients and the gradient buffer (DeepSpeed
    moves stage 3's optimizer states only for its FusedAdam, a CUDA op); stage 0 has no ZeRO
    optimizer and refuses. On CPU the states stay in host memory either way.

    All work runs on one worker thread, one call at a time, in the order the calls were
    made, which keeps every rank's collectives in the same order. ``close()`` stops it.
    """

    def __init__(
        self,
        model: torch.nn.Module | Any,
        *,
        zero_stage: int = 0,
        dtype: Dtype = "fp32",
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        max_grad_norm: float | None = 1.0,
        micro_batch_size: int = 32,
        temperature: float = 1.0,
        seed: int = 0,
        ds_config: Mapping[str, Any] | None = None,
        init_method: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        backend: str | None = None,
        timeout_s: float = 600.0,
        name: str = "deepspeed-trainer",
        threads: int | None = None,
        platform: str | Platform | None = None,
        trust_checkpoints: bool = False,
    ) -> None:
        who = f"DeepSpeedTrainEngine {name!r}"
        self.name = name
        if not isinstance(trust_checkpoints, bool):
            raise ConfigError(f"{who}: trust_checkpoints must be a bool, got {trust_checkpoints!r}")
        self.trust_checkpoints = trust_checkpoints
        self.platform = current_platform() if platform is None else select_platform(platform)
        deepspeed = _deepspeed_on(self.platform, who)
        if zero_stage not in (0, 1, 2, 3) or isinstance(zero_stage, bool):
            raise ConfigError(f"{who}: zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
        if dtype not in ("fp32", "bf16"):
            raise ConfigError(f"{who}: dtype must be 'fp32' or 'bf16', got {dtype!r}")
        _positive(who, "lr", lr)
        _positive(who, "temperature", temperature)
        if max_grad_norm is not None:
            _positive(who, "max_grad_norm", max_grad_norm)
        if not is_int(micro_batch_size) or micro_batch_size < 1:
            raise ConfigError(
                f"{who}: micro_batch_size must be an int >= 1, got {micro_batch_size!r}"
            )
        if not (
            isinstance(weight_decay, int | float)
            and math.isfinite(weight_decay)
            and weight_decay >= 0
        ):
            raise ConfigError(f"{who}: weight_decay must be a number >= 0, got {weight_decay!r}")
        if (
            not isinstance(betas, tuple | list)
            or len(betas) != 2
            or not all(isinstance(b, int | float) and 0 <= b < 1 for b in betas)
        ):
            raise ConfigError(f"{who}: betas must be two numbers in [0, 1), got {betas!r}")
        self.zero_stage = int(zero_stage)
        self.dtype: Dtype = dtype
        self.lr = float(lr)
        self.betas = (float(betas[0]), float(betas[1]))
        self.weight_decay = float(weight_decay)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.micro_batch_size = int(micro_batch_size)
        self.temperature = float(temperature)
        self.seed = int(seed)
        config = self._config(who, ds_config)

        module = _take_module(model, self.seed, who)
        spec = getattr(module, "config", None)
        self.vocab_size: int | None = _int_attr(spec, "vocab_size")
        self.max_seq_len: int | None = _int_attr(spec, "max_seq_len") or _int_attr(
            spec, "max_position_embeddings"
        )
        # DeepSpeed's own build of its JIT ops waits forever on a lock a killed build left
        prepare_ops(self.platform.deepspeed_accelerator, who=who, in_this_process=True)
        self._executor = worker_thread(name, threads, who)
        self._version: Version = 0
        self._closed = False
        try:
            self._executor.submit(
                self._build,
                deepspeed,
                module,
                config,
                init_method,
                rank,
                world_size,
                backend,
                timeout_s,
            ).result()
        except BaseException:
            self._executor.shutdown(wait=False)
            raise

    # ---- construction (worker thread) ------------------------------------------------------
    def _config(self, who: str, extra: Mapping[str, Any] | None) -> dict[str, Any]:
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": self.max_grad_norm or 0.0,
            # memory_efficient_linear would replace torch.nn.functional.linear for the whole
            # process, for good (DeepSpeed's words), changing every other model's numerics
            "zero_optimization": {"stage": self.zero_stage, "memory_efficient_linear": False},
            "bf16": {"enabled": self.dtype == "bf16", "check_grad_overflow": True},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        if extra is None:
            return config
        if not isinstance(extra, Mapping):
            raise ConfigError(f"{who}: ds_config must be a mapping, got {type(extra).__name__}")
        for key, value in extra.items():
            if key in _OWNED:
                raise ConfigError(
                    f"{who}: ds_config[{key!r}] is set by the engine; use its argument "
                    f"{_OWNED[key]} instead"
                )
            if key == "zero_optimization" and isinstance(value, Mapping):
                if "stage" in value and value["stage"] != self.zero_stage:
                    raise ConfigError(
                        f"{who}: ds_config['zero_optimization']['stage'] is set by the engine; "
                        "use its argument zero_stage instead"
                    )
                config[key] = {**config[key], **value}
            elif key == "bf16" and isinstance(value, Mapping):
                if "enabled" in value and bool(value["enabled"]) != (self.dtype == "bf16"):
                    raise ConfigError(
                        f"{who}: ds_config['bf16']['enabled'] is set by the engine; use its "
                        "argument dtype instead"
                    )
                config[key] = {**config[key], **value}
            else:
                config[key] = copy.deepcopy(value)
        return config

    def _build(
        self,
        deepspeed: Any,
        module: torch.nn.Module,
        config: dict[str, Any],
        init_method: str | None,
        rank: int | None,
        world_size: int | None,
        backend: str | None,
        timeout_s: float,
    ) -> None:
        import torch.distributed as dist

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        for api in ("all_gather_into_tensor", "reduce_scatter_tensor"):  # DeepSpeed's calls
            warnings.filterwarnings(
                "ignore", message=f"`torch.distributed.{api}` is deprecated", category=FutureWarning
            )
        backend = backend or self.platform.dist_backend
        timeout = timedelta(seconds=timeout_s)
        if not dist.is_initialized():
            if init_method is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
                init_method = "env://"
            elif init_method is None:
                if world_size not in (None, 1):
                    raise ConfigError(
                        f"{self.name}: world_size={world_size} needs init_method (a tcp:// "
                        "rendezvous) or a launcher's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT; "
                        "or use asyncflow_deepspeed.launch(), which starts the ranks for you"
                    )
                init_method = f"tcp://127.0.0.1:{free_port()}"
                rank, world_size = 0, 1
            kwargs: dict[str, Any] = {"init_method": init_method, "timeout": timeout}
            if init_method != "env://":
                if rank is None or world_size is None:
                    raise ConfigError(
                        f"{self.name}: init_method={init_method!r} needs rank and world_size"
                    )
                kwargs.update(rank=rank, world_size=world_size)
            _init_default_group(dist, backend, kwargs)
        elif world_size is not None and world_size != dist.get_world_size():
            raise ConfigError(
                f"{self.name}: world_size={world_size}, but torch.distributed is already "
                f"initialised with {dist.get_world_size()} ranks"
            )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        os.environ.setdefault("LOCAL_RANK", str(self.rank))
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
        torch.manual_seed(self.seed)
        optimizer = torch.optim.AdamW(
            module.parameters(),
            lr=self.lr,
            betas=self.betas,
            weight_decay=self.weight_decay,
            eps=1e-8,
        )
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
        self._ds = deepspeed
        self._engine = engine
        self.device = engine.device

    # ---- protocol ----------------------------------------------------------------------------
    @property
    def weight_version(self) -> Version:
        return self._version

    async def sleep(self, level: int = 1) -> None:
        """Offload the optimizer's states (``offload_states``; ZeRO stages 1-3)."""
        await self._run(self._sleep)

    async def wake_up(self) -> None:
        """Reload what ``sleep`` offloaded (``reload_states``)."""
        await self._run(self._wake_up)

    async def close(self) -> None:
        """Stop the worker thread (after the call in progress) and drop the DeepSpeed engine.
        The process group stays: DeepSpeed keeps groups derived from it for the life of the
        process, so later engines here reuse it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(self._executor, self._release)
        self._executor.shutdown(wait=False)

    def _release(self) -> None:
        self._engine = None

    @property
    def engine(self) -> Any:
        """The ``deepspeed.DeepSpeedEngine`` (for what this class does not wrap)."""
        return self._engine

    # ---- internals ---------------------------------------------------------------------------
    async def _run(self, fn: Callable[..., _T], *args: object) -> _T:
        if self._closed:
            raise EngineError(f"{self.name}: called after close(); build a new engine")
        return await super()._run(fn, *args)

    def _logits(self, seq: Tensor) -> Tensor:
        out = self._engine(seq.to(self.device))
        logits = getattr(out, "logits", out)
        if not isinstance(logits, Tensor) or logits.dim() != 3 or logits.shape[:2] != seq.shape:
            raise EngineError(
                f"{self.name}: the model must return logits [B, T, V] for tokens "
                f"{list(seq.shape)} (or an output with .logits), got "
                f"{type(logits).__name__} {list(getattr(logits, 'shape', []))}"
            )
        return logits

    def _response_logprobs(self, rows: TokenRows) -> tuple[Tensor, int]:
        """``[b, R]`` log-probs of ``rows``' response tokens under each row's sampling
        distribution (with gradients when enabled), and how many were off its support."""
        b, r = rows.response.shape
        if r == 0 or b == 0:
            if self.world_size > 1:  # every rank must run as many forwards (ZeRO-3 gathers)
                self._response_logprobs(_DUMMY)
            return torch.zeros(b, r), 0
        seq, source = rows.inputs()
        logits = self._logits(seq)
        index = source.to(logits.device).unsqueeze(2).expand(b, r, logits.shape[2])
        return rows.logprobs(logits.gather(1, index).cpu())

    def _dummy_loss(self) -> Tensor:
        """A zero loss through the whole model: a rank with fewer micro-batches runs it so
        that every rank does as many forwards and backwards."""
        return self._response_logprobs(_DUMMY)[0].sum() * 0.0

    # -- agreement between ranks -----------------------------------------------------------
    def _gather_floats(self, values: Sequence[float]) -> Tensor:
        """``[world_size, len(values)]``: every rank's values (a collective)."""
        local = torch.tensor([float(v) for v in values], dtype=torch.float64)
        if self.world_size == 1:
            return local.unsqueeze(0)
        import torch.distributed as dist

        device = self.device if self._backend_needs_device() else torch.device("cpu")
        parts = [torch.empty_like(local, device=device) for _ in range(self.world_size)]
        dist.all_gather(parts, local.to(device))
        return torch.stack([p.cpu() for p in parts])

    def _backend_needs_device(self) -> bool:
        import torch.distributed as dist

        return str(dist.get_backend()) != "gloo"

    def _gather_json(self, obj: Any) -> list[Any]:
        """Every rank's JSON-able ``obj`` (sizes, then padded bytes: no pickle)."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        data = json.dumps(obj).encode()
        sizes = self._gather_floats([len(data)])[:, 0].long().tolist()
        width = max(sizes)
        device = self.device if self._backend_needs_device() else torch.device("cpu")
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty(width, dtype=torch.uint8, device=device) for _ in sizes]
        dist.all_gather(parts, mine.to(device))
        return [json.loads(bytes(p[:n].cpu().tolist())) for p, n in zip(parts, sizes, strict=True)]

    def _agree(self, failed: bool) -> list[int]:
        """The ranks that failed (a collective); [] if none."""
        return _failed_ranks(self._gather_floats([1.0 if failed else 0.0])[:, 0])

    def _peer_error(self, ranks: list[int], what: str) -> EngineError:
        return PeerRankError(
            f"{self.name} (rank {self.rank}): rank(s) {ranks} failed {what}; nothing changed "
            "on any rank (their error says why)"
        )

    # -- logprobs ----------------------------------------------------------------------------
    def _micro_spans(self, b: int) -> list[tuple[int, int]]:
        mbs = self.micro_batch_size
        return [(s, min(s + mbs, b)) for s in range(0, b, mbs)]

    def _compute_logprobs(self, batch: Batch) -> Tensor:
        error: EngineError | None = None
        try:
            rows = self._prepare(batch)
        except EngineError as e:
            error, rows = e, _EMPTY
        spans = self._micro_spans(len(rows))
        agreed = self._gather_floats([1.0 if error else 0.0, len(spans)])
        bad = _failed_ranks(agreed[:, 0])
        if bad:
            raise error or self._peer_error(bad, "to read the batch")
        n_micro = int(agreed[:, 1].max())
        parts: list[Tensor] = []
        with torch.no_grad():
            for i in range(n_micro):
                if i < len(spans):
                    parts.append(self._response_logprobs(rows.part(*spans[i]))[0])
                else:
                    self._response_logprobs(_DUMMY)
        return torch.cat(parts) if parts else torch.zeros(0, rows.response.shape[1])

    # -- train step ----------------------------------------------------------------------------
    def _train_step(self, batch: Batch, loss_fn: LossFn) -> TrainMetrics:
        error: EngineError | None = None
        parts: list[tuple[int, int, Batch]] = []
        try:
            rows = self._prepare(batch)
            spans = self._micro_spans(len(rows))
            parts = (
                [(0, len(rows), batch)]
                if len(spans) == 1
                else [(s, e, slice_batch(self.name, batch, s, e)) for s, e in spans]
            )
        except EngineError as e:
            error, rows = e, _EMPTY
        agreed = self._gather_floats(
            [1.0 if error else 0.0, rows.trained_tokens, len(rows), rows.tokens, len(parts)]
        )
        bad = _failed_ranks(agreed[:, 0])
        if bad:
            raise error or self._peer_error(bad, "to read the batch")
        total_rows = int(agreed[:, 2].sum())
        if total_rows == 0:
            raise EngineError(f"{self.name}: train_step got an empty batch; pass at least 1 row")
        total = int(agreed[:, 1].sum())
        n_micro = int(agreed[:, 4].max())
        engine = self._engine
        loss_sum = 0.0
        off_support = 0
        means = MetricMeans(self.name)
        failure: BaseException | None = None
        done = 0  # micro-batches whose backward ran
        for i in range(n_micro):
            engine.set_gradient_accumulation_boundary(i == n_micro - 1)
            weight = 0.0
            local_error: BaseException | None = None
            step_means = MetricMeans(self.name)
            loss = None
            try:
                if i < len(parts):
                    start, stop, part = parts[i]
                    sub = rows.part(start, stop)
                    weight = sub.trained_tokens / total if total else (stop - start) / total_rows
                if weight > 0:
                    logprobs, off = self._response_logprobs(sub)
                    off_support += off
                    loss, metrics = check_loss(self.name, loss_fn(logprobs, part))
                    step_means.add(weight, metrics)
                else:
                    loss = self._dummy_loss()
            except Exception as e:  # the loss is user code: any error stops the step
                local_error = e
            bad = self._agree(local_error is not None)
            if bad or loss is None:
                failure = local_error or self._peer_error(bad, f"the loss of micro-batch {i}")
                break
            if weight > 0:
                loss_sum += weight * float(loss.detach())
                means.merge(step_means.sums, step_means.shares)
            engine.backward(loss * (weight * self.world_size), scale_wrt_gas=False)
            done += 1
        if failure is not None:
            self._discard(done)
            raise failure
        grad_norm = self._grad_norm_before_step()
        if grad_norm is not None and not math.isfinite(grad_norm):
            engine.zero_grad()
            raise EngineError(
                f"{self.name}: the gradient norm is {grad_norm}; the step was skipped and "
                "nothing changed (check the loss and the learning rate)"
            )
        skipped = engine.skipped_steps
        engine.step()
        if engine.skipped_steps != skipped:
            raise EngineError(
                f"{self.name}: DeepSpeed found a non-finite gradient and skipped the step; "
                "nothing changed (check the loss and the learning rate)"
            )
        if grad_norm is None:
            norm = engine.get_global_grad_norm()
            grad_norm = float(norm) if norm is not None else float("nan")
        self._version += 1
        summed = self._gather_json(
            {"loss": loss_sum, "sums": means.sums, "shares": means.shares, "off": off_support}
        )
        total_means = MetricMeans(self.name)
        for item in summed:
            total_means.merge(item["sums"], item["shares"])
        extra = total_means.means()
        extra["micro_batches"] = float(len(parts))
        extra[OFF_SUPPORT_METRIC] = float(sum(int(item["off"]) for item in summed))
        return TrainMetrics(
            version=self._version,
            loss=sum(float(item["loss"]) for item in summed),
            grad_norm=float(grad_norm),
            samples=total_rows,
            tokens=int(agreed[:, 3].sum()),
            extra=extra,
        )

    def _plain_fp32(self) -> bool:
        """Stage 0 in fp32: DeepSpeed steps the torch optimizer on the full gradients."""
        return self.zero_stage == 0 and self.dtype == "fp32"

    def _grad_norm_before_step(self) -> float | None:
        """The global norm, where this engine can see whole gradients (stage 0, fp32: after
        the boundary backward they are all-reduced in ``param.grad``)."""
        if not self._plain_fp32():
            return None
        grads = [p.grad for p in self._engine.module.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        return float(torch.nn.utils.get_total_norm(grads))

    def _discard(self, done: int) -> None:
        """Drop the gradients of an abandoned step (on every rank alike). Up to stage 1 they
        are still in ``param.grad`` (the reduction waits for the boundary, which an
        abandoned step never reached). From stage 2 on, ZeRO reduces into partitioned
        buffers at every backward, so the engine ends the accumulation with a non-finite
        loss and lets DeepSpeed's overflow check skip the step and clear them."""
        engine = self._engine
        if self.zero_stage <= 1 or done == 0:
            engine.zero_grad()
            return
        engine.set_gradient_accumulation_boundary(True)
        engine.backward(self._dummy_loss() * float("nan"), scale_wrt_gas=False)
        skipped = engine.skipped_steps
        engine.step()
        if engine.skipped_steps == skipped:  # pragma: no cover - DeepSpeed's contract
            raise EngineError(f"{self.name}: DeepSpeed applied a step that had to be skipped")

    # -- weights -------------------------------------------------------------------------------
    def _named(self) -> list[tuple[str, Tensor]]:
        """Every parameter and buffer once (``unique_named_tensors``: a tied LM head under the
        embedding's name only)."""
        return unique_named_tensors(self._engine.module)

    def _plan(self, bucket_bytes: int) -> list[list[tuple[str, Tensor]]]:
        """Buckets of (name, parameter) by full size (ZeRO-3 parameters hold only a shard)."""
        named = self._named()
        sized = []
        for name, t in named:
            shape = tuple(getattr(t, "ds_shape", t.shape))
            sized.append((name, torch.empty(shape, dtype=t.dtype, device="meta")))
        by_name = dict(named)
        return [[(n, by_name[n]) for n in b.names] for b in bucketize(sized, bucket_bytes)]

    def _gathered(self, params: list[Tensor]) -> contextlib.AbstractContextManager[Any]:
        partitioned = [p for p in params if hasattr(p, "ds_id")]
        if not partitioned:
            return contextlib.nullcontext()
        return self._ds.zero.GatheredParameters(partitioned, modifier_rank=None)  # type: ignore[no-any-return]

    def _export_buckets(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        for bucket in self._plan(bucket_bytes):
            tensors = [t for _, t in bucket]
            with self._gathered(tensors):
                if self.rank == 0:
                    yield WeightBucket(
                        tuple(n for n, _ in bucket),
                        tuple(t.detach().to("cpu", copy=True) for t in tensors),
                    )

    async def _export(self, bucket_bytes: int) -> AsyncIterator[WeightBucket]:
        """One job on the worker thread produces the buckets (so no other call's collectives
        can come between two gathers); at most two wait here at a time. If the consumer
        stops early, the job still finishes its gathers (the other ranks expect them)."""
        if self._closed:
            raise EngineError(f"{self.name}: export_weights after close(); build a new engine")
        loop = asyncio.get_running_loop()
        out: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        room = threading.Semaphore(2)
        stop = threading.Event()

        def produce() -> None:
            try:
                for bucket in self._export_buckets(bucket_bytes):
                    while not stop.is_set() and not room.acquire(timeout=0.1):
                        pass
                    if not stop.is_set():
                        loop.call_soon_threadsafe(out.put_nowait, ("item", bucket))
                loop.call_soon_threadsafe(out.put_nowait, ("end", None))
            except BaseException as e:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(out.put_nowait, ("error", e))

        job = loop.run_in_executor(self._executor, produce)
        try:
            while True:
                kind, payload = await out.get()
                if kind == "item":
                    room.release()
                    yield payload
                elif kind == "end":
                    break
                else:
                    raise payload
        finally:
            stop.set()
            if not job.done():
                with contextlib.suppress(Exception):
                    await asyncio.shield(job)

    # -- checkpoints -------------------------------------------------------------------------
    def _shapes(self) -> dict[str, list[int]]:
        return {n: list(getattr(t, "ds_shape", t.shape)) for n, t in self._named()}

    def _save(self, path: Path) -> None:
        key: bytes | None = b""
        error: ConfigError | None = None
        if self.rank == 0:  # rank 0 signs: it must have a key before any rank writes
            try:
                key = checkpoint_key(who=self.name, create=True)
            except ConfigError as e:
                error = e
        bad = self._agree(error is not None)
        if bad:
            raise error or self._peer_error(bad, "to find the checkpoint key")
        path.mkdir(parents=True, exist_ok=True)
        meta_path = path / CHECKPOINT_META
        if self.rank == 0 and meta_path.exists():
            meta_path.unlink()  # a half-overwritten checkpoint must not look complete
        self._engine.save_checkpoint(
            str(path), tag=CHECKPOINT_TAG, client_state={"asyncflow_version": self._version}
        )
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()
        if self.rank == 0:
            meta = {
                "format": _FORMAT,
                "version": self._version,
                "zero_stage": self.zero_stage,
                "dtype": self.dtype,
                "world_size": self.world_size,
                "shapes": self._shapes(),
            }
            signed = sign_manifest(path, meta, key or b"", manifest=CHECKPOINT_META)
            tmp = path / f"{CHECKPOINT_META}.tmp-{os.getpid()}"
            tmp.write_text(json.dumps(signed, indent=1))
            os.replace(tmp, meta_path)
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def _check_checkpoint(self, path: Path) -> CheckpointError | None:
        """Why ``path`` cannot be loaded into this engine (its manifest is not ours, or it is
        of another format or layout), or None. Opens nothing but the manifest and, to hash
        them, the files it lists."""
        try:
            meta = read_signed_manifest(
                path,
                manifest=CHECKPOINT_META,
                who=self.name,
                trust=self.trust_checkpoints,
                opt_in="DeepSpeedTrainEngine(..., trust_checkpoints=True)",
            )
        except CheckpointError as e:
            return e
        except ConfigError as e:  # the key file is unusable
            return CheckpointError(f"{self.name}: checkpoint {str(path)!r} not checked: {e}")
        problem = self._misfit(meta, path)
        if problem is None:
            return None
        return CheckpointError(f"{self.name}: checkpoint {str(path)!r}: {problem}")

    def _misfit(self, meta: dict[str, Any], path: Path) -> str | None:
        """Why a checkpoint with manifest ``meta`` does not fit this engine, or None."""
        if meta.get("format") != _FORMAT:
            return f"its format is {meta.get('format')!r}, expected {_FORMAT!r}"
        version = meta.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            return f"its version is {version!r}, expected an int >= 0"
        for key, mine in (
            ("zero_stage", self.zero_stage),
            ("dtype", self.dtype),
            ("world_size", self.world_size),
        ):
            if meta.get(key) != mine:
                return (
                    f"it was saved with {key}={meta.get(key)!r}, this engine has {mine!r}; "
                    "load it into an engine built the same way (DeepSpeed's ds_to_universal "
                    "converts between layouts)"
                )
        if meta.get("shapes") != self._shapes():
            return "its parameters (names or shapes) differ from this model's"
        if not (path / CHECKPOINT_TAG).is_dir():
            return f"DeepSpeed's files ({path / CHECKPOINT_TAG}) are missing"
        return None

    def _load(self, path: Path) -> None:
        problem = self._check_checkpoint(path)
        bad = self._agree(problem is not None)
        if bad:
            if problem is not None:
                raise problem
            raise self._peer_error(bad, f"to check checkpoint {str(path)!r}")
        loaded, client = self._engine.load_checkpoint(str(path), tag=CHECKPOINT_TAG)
        if loaded is None:
            raise CheckpointError(f"{self.name}: DeepSpeed could not load checkpoint {str(path)!r}")
        self._version = int(client.get("asyncflow_version") or 0)

    # -- sleep -----------------------------------------------------------------------------------
    def _sleep(self) -> None:
        if self.zero_stage == 0:
            raise EngineError(
                f"{self.name}: sleep() offloads ZeRO optimizer states (offload_states), which "
                "DeepSpeed supports for zero_stage 1-3; this engine has zero_stage=0"
            )
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

        include = None  # everything
        if self.zero_stage == 3:  # stage 3 moves optimizer states only for DeepSpeed's FusedAdam
            include = [
                OffloadStateTypeEnum.lp_params,
                OffloadStateTypeEnum.lp_grads,
                OffloadStateTypeEnum.contiguous_grad_buffer,
            ]
        self._engine.offload_states(
            include=include,
            device=OffloadDeviceEnum.cpu,
            pin_memory=self.platform.device_type != "cpu",
        )
        self._asleep = True

    def _wake_up(self) -> None:
        if getattr(self, "_asleep", False):
            self._engine.reload_states()
            self._asleep = False


# --------------------------------------------------------------------------------------------
def _init_default_group(dist: Any, backend: str, kwargs: dict[str, Any]) -> None:
    """``init_process_group``, but a ``tcp://host:port`` rendezvous listens on ``host`` only
    (torch's own tcp:// store listens on every interface: ``rendezvous_store`` instead) and
    a gloo group on ``host``'s interface (``gloo_listens_on``; a ``GLOO_SOCKET_IFNAME`` the
    user set stands). The default ``tcp://127.0.0.1`` is reachable from this machine only."""
    url = urlsplit(kwargs["init_method"])
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        dist.init_process_group(backend, **kwargs)  # env://, file://: the launcher's choice
        return
    rank, world_size, timeout = kwargs["rank"], kwargs["world_size"], kwargs["timeout"]
    store = rendezvous_store(
        url.hostname, url.port, world_size, is_master=rank == 0, timeout=timeout
    )
    with gloo_listens_on(url.hostname):
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )


def _deepspeed_on(platform: Platform, who: str) -> Any:
    """``deepspeed``, its accelerator being ``platform``'s (see the class docstring)."""
    want = platform.deepspeed_accelerator
    env = os.environ.get("DS_ACCELERATOR")
    if env is not None and env != want:
        raise ConfigError(
            f"{who}: DS_ACCELERATOR={env!r}, but the platform is {platform.name!r}, whose "
            f"DeepSpeed accelerator is {want!r}: unset DS_ACCELERATOR (the engine sets it) or "
            f"choose the platform that matches it"
        )
    if "deepspeed" not in sys.modules:
        os.environ["DS_ACCELERATOR"] = want  # DeepSpeed reads it once, at its first import
    deepspeed = require_deepspeed()
    chosen = str(deepspeed.accelerator.get_accelerator().device_name())
    if chosen != want:
        raise ConfigError(
            f"{who}: DeepSpeed already runs on accelerator {chosen!r} in this process (it "
            f"chose at its first import), but the platform is {platform.name!r} ({want!r}): "
            f"set DS_ACCELERATOR={want} before anything imports deepspeed, or use platform "
            f"{chosen!r}"
        )
    return deepspeed


def _positive(who: str, field: str, value: object) -> None:
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"{who}: {field} must be a number > 0, got {value!r}")


def _failed_ranks(flags: Tensor) -> list[int]:
    """The ranks whose flag (one per rank, from ``_gather_floats``) is set."""
    return [int(r) for r in (flags > 0).nonzero().reshape(-1).tolist()]


def _int_attr(obj: object, name: str) -> int | None:
    value: Any = getattr(obj, name, None)
    return int(value) if is_int(value) else None


def _take_module(model: object, seed: int, who: str) -> torch.nn.Module:
    """A module, deep-copied, or a ``ModelSpec`` built from ``seed``, in fp32."""
    return build_module(model, seed=seed, who=who).float()


def _rows(prompt: list[list[int]], response: list[list[int]]) -> TokenRows:
    def pad(rows: list[list[int]]) -> tuple[Tensor, Tensor]:
        width = max((len(r) for r in rows), default=0)
        data = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long)
        return data.reshape(len(rows), width), torch.tensor([len(r) for r in rows])

    p, pl = pad(prompt)
    r, rl = pad(response)
    n = len(prompt)
    return TokenRows(p, pl, r, rl, torch.ones(n), torch.zeros(n, dtype=torch.long), torch.ones(n))


_EMPTY = _rows([], [])
_DUMMY = _rows([[0]], [[0]])  # a zero-weight micro-batch for a rank with fewer rows


__all__ = ["CHECKPOINT_META", "CHECKPOINT_TAG", "DeepSpeedTrainEngine"]
