"""Verified weight sync: after a swap, prove that a rollout engine holds the trainer's weights
for that version, or stop with an error that names the engine, the version and what differs.

Two kinds of proof, chosen per engine:

* **fingerprint** (``SupportsWeightFingerprints``): the engine hashes each tensor *from its
  own storage* (the model it generates with, not a record of what it was sent), the trainer
  hashes what it exports for the version, cast to the engine's dtype; they are compared
  tensor by tensor (SHA-256 of the bytes, with dtype and shape). Equal fingerprints prove the
  engine holds exactly those bytes. A tied alias (an LM head sharing the embedding) is hashed
  from the alias's own storage and compared with the tensor it is tied to, so a load that
  broke the tie is caught. Tensors the trainer does not export (buffers) are not compared.
* **probe** (every other engine, e.g. vLLM on CPU, which packs its linear weights and keeps no
  readable ``layer.weight``, or a server that cannot hash): the engine decodes a fixed probe
  prompt greedily and reports its log-probs; the trainer, at the same version, computes the
  log-probs of those tokens; they must agree within the tolerance of ``docs/logprobs.md``
  (mean and largest absolute difference) and every probe token must carry the version. This
  proves the engine *behaves* like the trainer on that prompt, within tolerance: a wrong load
  too small to move those log-probs passes.

``verify_engine`` runs one engine; ``VerifySchedule`` says which versions a job verifies
(``RLConfig.verify_sync``: ``"first"``, ``"always"``, ``"every N"``, ``"off"``).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from asyncflow_core.contracts.errors import ConfigError, WeightSyncError
from asyncflow_core.contracts.protocols import (
    Batch,
    GenerationRequest,
    Layout,
    SamplingParams,
    TrainEngine,
    Version,
)
from asyncflow_core.data.store import InProcessDataStore
from asyncflow_core.training.sampling import SAMPLING_FIELDS, sampling_columns

__all__ = [
    "PROBE_TOKENS",
    "SupportsWeightFingerprints",
    "SyncVerificationError",
    "TensorFingerprint",
    "VerifyReport",
    "VerifySchedule",
    "fingerprint",
    "fingerprints_of",
    "module_fingerprints",
    "tied_aliases",
    "trainer_fingerprints",
    "verify_engine",
]

PROBE_TOKENS = 16
"""Tokens the probe decodes (greedily) and compares."""


@dataclass(frozen=True, slots=True)
class TensorFingerprint:
    """What a tensor holds: its dtype (``str(torch.dtype)``), shape and the SHA-256 of its
    bytes (C order). ``alias_of``: for a tied alias, the name of the tensor it must equal."""

    dtype: str
    shape: tuple[int, ...]
    sha256: str
    alias_of: str | None = None

    def describe(self) -> str:
        return f"{self.dtype} {list(self.shape)} sha256 {self.sha256[:12]}"


def fingerprint(tensor: torch.Tensor, *, alias_of: str | None = None) -> TensorFingerprint:
    """The fingerprint of ``tensor`` as it is stored (copied to host memory to hash)."""
    t = tensor.detach()
    if t.is_meta:
        raise WeightSyncError("fingerprint: a meta tensor has no data to hash")
    data = t.to("cpu").contiguous().reshape(-1)
    raw = data.view(torch.uint8).numpy() if data.numel() else b""
    digest = hashlib.sha256(memoryview(raw)).hexdigest()  # type: ignore[arg-type]
    return TensorFingerprint(str(t.dtype), tuple(int(d) for d in t.shape), digest, alias_of)


def fingerprints_of(
    named: Sequence[tuple[str, torch.Tensor]], aliases: Mapping[str, str] | None = None
) -> dict[str, TensorFingerprint]:
    """Fingerprints of ``named`` (name, tensor) pairs; a name in ``aliases`` (alias ->
    the tensor it is tied to) gets ``alias_of``. For engines implementing
    ``SupportsWeightFingerprints`` over a ``torch.nn.Module``."""
    aliases = aliases or {}
    return {name: fingerprint(t, alias_of=aliases.get(name)) for name, t in named}


def tied_aliases(module: torch.nn.Module) -> dict[str, str]:
    """``alias -> name`` for every tensor of ``module`` reachable under a second name (a tied
    LM head: ``lm_head.weight -> model.embed_tokens.weight``), as tied now. An engine records
    it when it is built, so a later load that breaks the tie is still checked."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    named: list[tuple[str, torch.Tensor]] = [*module.named_parameters(remove_duplicate=False)]
    named += [*module.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        canonical = first.setdefault(id(tensor), name)
        if canonical != name:
            aliases[name] = canonical
    return aliases


def module_fingerprints(
    module: torch.nn.Module, aliases: Mapping[str, str] | None = None
) -> dict[str, TensorFingerprint]:
    """The fingerprints of every parameter and persistent buffer of ``module`` under its
    ``state_dict`` name, read from the module now; each name in ``aliases`` (from
    ``tied_aliases`` when the engine was built) hashed from the tensor that name reaches now,
    with ``alias_of``. For engines over a ``torch.nn.Module``."""
    aliases = dict(aliases or {})
    state = module.state_dict(keep_vars=True)
    named = [(n, t) for n, t in state.items() if n not in aliases]
    out = fingerprints_of(named)
    for alias, canonical in aliases.items():
        tensor = state.get(alias)
        if tensor is not None:
            out[alias] = fingerprint(tensor, alias_of=canonical)
    return out


@runtime_checkable
class SupportsWeightFingerprints(Protocol):
    """An engine that can read back what it holds. ``weight_fingerprints()`` returns the
    fingerprint of every tensor it generates with, under the names it loads them by (the
    trainer's export names), computed **from its own storage at the time of the call**: an
    engine that reports what it was last sent proves nothing. Tied aliases are included with
    ``alias_of`` set (hashed from the alias's own storage)."""

    async def weight_fingerprints(self) -> Mapping[str, TensorFingerprint]: ...


class SyncVerificationError(WeightSyncError):
    """A rollout engine does not hold the trainer's weights for a version it reports."""

    def __init__(self, message: str, *, engine: str, version: Version, differences: list[str]):
        super().__init__(message)
        self.engine = engine
        self.version = version
        self.differences = differences


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """One engine's verification: ``kind`` ``"fingerprint"`` (``checked`` tensors) or
    ``"probe"`` (``checked`` tokens; ``mean_abs``/``max_abs`` their log-prob differences), or
    ``"skipped"`` (``reason``), and the seconds it took."""

    engine: str
    version: Version
    kind: Literal["fingerprint", "probe", "skipped"]
    checked: int
    seconds: float
    mean_abs: float = math.nan
    max_abs: float = math.nan
    reason: str = ""


async def trainer_fingerprints(
    trainer: TrainEngine, bucket_bytes: int, dtypes: Mapping[str, str] | None = None
) -> dict[str, TensorFingerprint]:
    """Fingerprints of what ``trainer`` exports now, each tensor cast first to
    ``dtypes[name]`` (the dtype the engine holds it in) where given. Meta tensors (a
    simulator's shapes) raise ``WeightSyncError``."""
    want = dict(dtypes or {})
    out: dict[str, TensorFingerprint] = {}
    async for bucket in trainer.export_weights(bucket_bytes):
        for name, tensor in bucket:
            if tensor.is_meta:
                raise _MetaTensor(f"the trainer exports {name!r} as a meta tensor (no data)")
            dtype = _dtype(want.get(name))
            t = tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)
            out[name] = fingerprint(t)
    return out


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None or not name.startswith("torch."):
        return None
    value = getattr(torch, name.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) else None


class _MetaTensor(WeightSyncError):
    """The trainer exports a meta tensor (a simulator's shapes): nothing to hash."""


def verification_refusal(obj: object) -> str | None:
    """Why ``obj`` (an engine or a trainer) cannot take part in a sync verification, or
    None: it sets ``sync_verification_refusal: str`` (a simulator: its weights are shapes and
    its log-probs made up). The job then records the verification as skipped, with it."""
    reason = getattr(obj, "sync_verification_refusal", None)
    return reason if isinstance(reason, str) and reason else None


def compare_fingerprints(
    trainer: Mapping[str, TensorFingerprint], engine: Mapping[str, TensorFingerprint]
) -> tuple[list[str], int]:
    """The differences (each a sentence naming the tensor), and how many tensors were
    compared: every trainer tensor against the engine's, every engine alias against the
    trainer tensor it is tied to."""
    problems: list[str] = []
    compared = 0
    for name, want in trainer.items():
        have = engine.get(name)
        compared += 1
        if have is None:
            problems.append(f"{name!r}: the engine holds no tensor of that name")
        elif (have.dtype, have.shape) != (want.dtype, want.shape):
            problems.append(
                f"{name!r}: the engine holds {have.dtype} {list(have.shape)}, the trainer "
                f"exports {want.dtype} {list(want.shape)}"
            )
        elif have.sha256 != want.sha256:
            problems.append(
                f"{name!r}: different bytes (engine sha256 {have.sha256[:12]}, trainer "
                f"{want.sha256[:12]})"
            )
    for name, have in engine.items():
        if have.alias_of is None or have.alias_of not in trainer:
            continue
        compared += 1
        want = trainer[have.alias_of]
        if (have.dtype, have.shape, have.sha256) != (want.dtype, want.shape, want.sha256):
            problems.append(
                f"{name!r} (tied to {have.alias_of!r}): the engine's copy differs from the "
                f"trainer's {have.alias_of!r} ({have.describe()} vs {want.describe()}): the tie "
                "was broken or the alias not loaded"
            )
    return problems, compared


# --------------------------------------------------------------------------------------------
# The probe
# --------------------------------------------------------------------------------------------
async def probe_batch(
    prompt: Sequence[int], tokens: Sequence[int], layout: Layout = "padded"
) -> Batch:
    """The one-row ``Batch`` a trainer scores the probe with (greedy sampling fields), through
    the store in the trainer's ``layout`` (its ``batch_layout``), as the job's batches come."""
    store = InProcessDataStore()
    fields = ["prompt", "response", "advantage", *SAMPLING_FIELDS]
    await store.create_partition("probe", fields, tasks=["trainer"])
    await store.put(
        "probe",
        {
            "prompt": [torch.tensor(list(prompt), dtype=torch.long)],
            "response": [torch.tensor(list(tokens), dtype=torch.long)],
            "advantage": [torch.tensor(0.0)],
            **sampling_columns([SamplingParams(temperature=0.0)]),
        },
    )
    meta = await store.get_meta("probe", "trainer", fields, 1, timeout=60)
    return await store.get_data(meta, layout=layout)


async def _probe(
    engine: Any,
    trainer: TrainEngine,
    version: Version,
    *,
    who: str,
    prompt: Sequence[int],
    tokens: int,
    mean_atol: float,
    max_atol: float,
    request_id: str,
) -> tuple[list[str], int, float, float]:
    request = GenerationRequest(
        request_id, tuple(int(t) for t in prompt), SamplingParams(max_tokens=tokens, temperature=0)
    )
    result = await engine.generate(request)
    if not result.tokens:
        return [f"the probe generated no token (finish reason {result.finish_reason!r})"], 0, 0, 0
    stale = sorted({int(v) for v in result.versions if int(v) != int(version)})
    if stale:
        return (
            [f"the probe's tokens carry version(s) {stale}, not {version}"],
            len(result.tokens),
            math.nan,
            math.nan,
        )
    layout: Layout = getattr(trainer, "batch_layout", "padded")
    lp = await trainer.compute_logprobs(await probe_batch(prompt, result.tokens, layout))
    mine = lp[0, : len(result.tokens)].detach().to("cpu", torch.float64)
    reported = torch.tensor(result.logprobs, dtype=torch.float64)
    diff = (mine - reported).abs()
    diff = torch.nan_to_num(diff, nan=math.inf)
    mean, largest = float(diff.mean()), float(diff.max())
    if mean <= mean_atol and largest <= max_atol:
        return [], len(result.tokens), mean, largest
    first = int((diff > max_atol).nonzero()[0]) if largest > max_atol else int(diff.argmax())
    return (
        [
            f"the probe's log-probs differ from the trainer's: mean |difference| {mean:.3g} "
            f"(tolerance {mean_atol}), max {largest:.3g} (tolerance {max_atol}); first beyond "
            f"tolerance at response position {first} (token {result.tokens[first]}: engine "
            f"{result.logprobs[first]:.6g}, trainer {float(mine[first]):.6g})"
        ],
        len(result.tokens),
        mean,
        largest,
    )


# --------------------------------------------------------------------------------------------
# One engine
# --------------------------------------------------------------------------------------------
async def verify_engine(
    engine: Any,
    trainer: TrainEngine,
    version: Version,
    *,
    who: str,
    bucket_bytes: int = 1 << 30,
    probe_prompt: Sequence[int] = (1, 2, 3, 4),
    probe_tokens: int = PROBE_TOKENS,
    mean_atol: float = 1e-3,
    max_atol: float = 1e-2,
    kind: Literal["auto", "fingerprint", "probe"] = "auto",
    trainer_prints: dict[Any, dict[str, TensorFingerprint]] | None = None,
) -> VerifyReport:
    """Prove that ``engine`` holds ``trainer``'s weights for ``version`` (the trainer must be
    at that version now, the engine must have swapped to it): by fingerprint where the engine
    has them (``kind="auto"``), else by the probe. Raises ``SyncVerificationError`` naming
    ``who``, the version and the first differences; returns the report otherwise. A trainer
    or engine that refuses verification (``verification_refusal``: the simulator's), or a
    trainer exporting meta tensors, is skipped, with the reason. Only the fingerprint check
    exports the trainer's weights (to this process); the probe needs its log-probs only.
    ``trainer_prints``: a dict kept across the engines of one verification, so the trainer's
    weights are exported and hashed once per set of engine dtypes, not once per engine."""
    t0 = time.perf_counter()
    refusal = verification_refusal(engine) or verification_refusal(trainer)
    if refusal is not None:
        return VerifyReport(who, version, "skipped", 0, time.perf_counter() - t0, reason=refusal)
    if int(engine.weight_version) != int(version):
        _fail(who, version, [f"the engine reports version {engine.weight_version}"], kind="version")
    use_fingerprints = isinstance(engine, SupportsWeightFingerprints)
    if kind == "fingerprint" and not use_fingerprints:
        raise ConfigError(f"{who} cannot report weight fingerprints (SupportsWeightFingerprints)")
    if use_fingerprints and kind != "probe":
        held = dict(await engine.weight_fingerprints())
        dtypes = {n: fp.dtype for n, fp in held.items() if fp.alias_of is None}
        key = frozenset(dtypes.items())  # engines holding the same dtypes share one export
        try:
            if trainer_prints is not None and key in trainer_prints:
                sent = trainer_prints[key]
            else:
                sent = await trainer_fingerprints(trainer, bucket_bytes, dtypes)
                if trainer_prints is not None:
                    trainer_prints[key] = sent
        except _MetaTensor:
            return VerifyReport(
                who, version, "skipped", 0, time.perf_counter() - t0,
                reason="the trainer exports meta tensors (shapes only): nothing to compare",
            )  # fmt: skip
        problems, compared = compare_fingerprints(sent, held)
        if problems:
            _fail(who, version, problems, compared=compared, what="tensor(s)")
        return VerifyReport(who, version, "fingerprint", compared, time.perf_counter() - t0)
    problems, checked, mean, largest = await _probe(
        engine, trainer, version, who=who, prompt=probe_prompt, tokens=probe_tokens,
        mean_atol=mean_atol, max_atol=max_atol, request_id=f"asyncflow-verify-v{version}",
    )  # fmt: skip
    if problems:
        _fail(who, version, problems, kind="probe")
    return VerifyReport(who, version, "probe", checked, time.perf_counter() - t0, mean, largest)


def _fail(
    who: str,
    version: Version,
    problems: list[str],
    *,
    compared: int | None = None,
    what: str = "",
    kind: str = "fingerprint",
) -> None:
    shown = "; ".join(problems[:5]) + (
        f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
    )
    counted = f" ({len(problems)} of {compared} {what} differ)" if compared is not None else ""
    raise SyncVerificationError(
        f"weight sync to version {version} is wrong on {who}: it does not hold the trainer's "
        f"weights ({kind} check{counted}): {shown}. The run stops rather than train on "
        "samples from weights the trainer never had; check the engine's weight loading "
        "(names, stacked or tied parameters) and the transport",
        engine=who,
        version=version,
        differences=problems,
    )


# --------------------------------------------------------------------------------------------
# When
# --------------------------------------------------------------------------------------------
@dataclass
class VerifySchedule:
    """Which syncs a job verifies, from ``RLConfig.verify_sync``: ``"off"``; ``"first"`` (the
    first sync of each run: the one that brings the engines to a resumed trainer, or the
    first of trained weights); ``"always"``; ``"every N"`` (the first, then every N-th)."""

    setting: str
    every: int = field(init=False, default=0)
    _syncs: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        problem = verify_setting_problem(self.setting)
        if problem is not None:
            raise ConfigError(problem)
        text = self.setting.strip()
        self.every = {"off": 0, "first": -1, "always": 1}.get(text, 0)
        if text.startswith("every"):
            self.every = int(text.split()[1])

    def due(self) -> bool:
        """Whether the next sync (counted by this call) is verified."""
        n = self._syncs
        self._syncs += 1
        if self.every == 0:
            return False
        if self.every == -1:
            return n == 0
        return n % self.every == 0

    def restart(self) -> None:
        """A new run (``run()`` again): ``"first"`` verifies its first sync too."""
        self._syncs = 0


def verify_setting_problem(value: object) -> str | None:
    """Why ``value`` is not a ``verify_sync`` setting, or None."""
    if isinstance(value, str):
        text = value.strip()
        if text in ("off", "first", "always"):
            return None
        parts = text.split()
        if len(parts) == 2 and parts[0] == "every" and parts[1].isdigit() and int(parts[1]) >= 1:
            return None
    return f"verify_sync must be 'off', 'first', 'always' or 'every N' (N >= 1), got {value!r}"
