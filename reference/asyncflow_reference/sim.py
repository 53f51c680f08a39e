"""Simulated engines with a cost model: an inference engine, a trainer and a weight transport
that take *virtual* time (``asyncflow_core.flow.vclock``) instead of doing work, so the real store,
schedulers and workflow can replay a 32 -> 1024-device cluster on a laptop.

Nothing here computes a model. ``CostModel`` turns every step into seconds from a handful of
published hardware and model numbers plus stated assumptions (each field's origin is in
``SOURCES``); the engines sleep for those seconds on the event loop's clock and hand back
cheap, deterministic tokens, log-probs and per-token weight versions that obey the same
protocol laws as a real engine (versions after a load, abort, pause, partial-rollout resume).

``SimInferenceEngine`` is event-driven: between two events (an arrival, a finish, a pause, a
weight load, an abort) the set of running sequences is constant, so it advances every decode
step up to the next finish with one timer, and credits fractional progress when an event cuts
the wait short. It never wakes per token.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import hashlib
import heapq
import json
import math
import statistics
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from asyncflow_core.contracts.errors import ConfigError, EngineError, WeightSyncError
from asyncflow_core.contracts.protocols import (
    Batch,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    LossFn,
    SupportsLoadWeights,
    TrainMetrics,
    Version,
    WeightBucket,
)
from asyncflow_core.sync.transports import bucketize

# --------------------------------------------------------------------------------------------
# Cost model
# --------------------------------------------------------------------------------------------
_QWEN25_7B_CONFIG = "Qwen2.5-7B config.json (huggingface.co/Qwen/Qwen2.5-7B)"
_QWEN25_32B_CONFIG = "Qwen2.5-32B config.json (huggingface.co/Qwen/Qwen2.5-32B)"

SOURCES: dict[str, str] = {
    "model": "name only; the AsyncFlow paper (arXiv 2507.01663) ran Qwen2.5-7B and -32B GRPO",
    "device": "name only; the AsyncFlow paper ran on Ascend NPU clusters (910B class)",
    "hidden_size": f"{_QWEN25_7B_CONFIG}: 3584; {_QWEN25_32B_CONFIG}: 5120",
    "num_layers": f"{_QWEN25_7B_CONFIG}: 28; {_QWEN25_32B_CONFIG}: 64",
    "intermediate_size": f"{_QWEN25_7B_CONFIG}: 18944; {_QWEN25_32B_CONFIG}: 27648",
    "num_kv_heads": f"{_QWEN25_7B_CONFIG}: 4 (GQA); {_QWEN25_32B_CONFIG}: 8",
    "head_dim": "Qwen2.5 configs: hidden_size / num_attention_heads = 3584/28 = 5120/40 = 128",
    "vocab_size": "Qwen2.5-7B and -32B config.json: 152064",
    "tie_embeddings": "Qwen2.5-7B and -32B config.json: tie_word_embeddings = false",
    "params": (
        "derived: the exact parameter count of the Qwen2 architecture fields "
        "(qwen2_param_count); 7,615,616,512 for 7B (the model card says 7.61B) and "
        "32,763,876,352 for 32B (the card rounds to 32.5B)"
    ),
    "bytes_per_param": "bf16 weights (Qwen2.5 config torch_dtype = bfloat16): 2 bytes",
    "kv_bytes_per_token": (
        "derived: K and V x num_layers x num_kv_heads x head_dim x 2 bytes (bf16 KV cache); "
        "56 KiB/token for 7B, 256 KiB/token for 32B"
    ),
    "prompt_tokens": (
        "assumption: DeepScaleR math problems (the paper's data set) are ~100 tokens; with a "
        "chat template and instruction ~256 tokens"
    ),
    "response_median": (
        "assumption: median response ~1k tokens for Qwen2.5-7B/32B on competition math early "
        "in GRPO; the paper does not report its length distribution"
    ),
    "response_sigma": (
        "assumption: lognormal sigma 0.8 gives p90 ~2.8x and p99 ~6.4x the median, the long "
        "tail that makes a synchronous rollout wait on stragglers"
    ),
    "response_min_tokens": "assumption: even a terse answer carries ~32 tokens of reasoning",
    "response_max_tokens": (
        "assumption: an 8k response cap, as in DeepScaleR's first (8k-context) stage; the "
        "paper's cap is not in our sources"
    ),
    "tp": (
        "assumption: 7B fits one 64 GB device with ~40 GB left for KV (tp=1); 32B bf16 (66 GB) "
        "needs tp=4 on 64 GB devices to leave ~160 GB of KV"
    ),
    "max_running": (
        "vLLM's default max_num_seqs = 256; kv_capacity_tokens() fits 256 sequences at the "
        "length-biased mean running context for both presets (checked by a test)"
    ),
    "peak_flops": (
        "Ascend 910B FP16/BF16 dense peak: third-party spec summaries give ~313-320 TFLOPS "
        "(e.g. boardor.com 'Huawei Ascend 910B outperforms H20'); 320e12 taken"
    ),
    "hbm_bytes": "Ascend 910B: 64 GB HBM2e per device (third-party spec summaries)",
    "memory_utilization": "vLLM's default gpu_memory_utilization = 0.9",
    "hbm_bytes_per_s": (
        "Ascend 910B HBM2e bandwidth: third-party summaries give 1.2-1.6 TB/s; 1.6e12 taken "
        "(the 910B-class figure of the project brief)"
    ),
    "decode_efficiency": (
        "assumption: decode reads weights+KV at ~65% of peak HBM bandwidth (GPU vLLM decode "
        "kernels reach ~60-80%; the 2025 NPU stack is taken at the low end)"
    ),
    "decode_fixed_s": (
        "assumption: per-step launch/scheduling/sampling overhead, 5 ms for 28 layers at tp=1, "
        "10 ms for 64 layers with tp=4 all-reduces"
    ),
    "mfu_prefill": (
        "assumption: prefill and the compute roof of large-batch decode reach 50% of peak "
        "(large, regular matmuls)"
    ),
    "mfu_train": (
        "assumption: 30% model FLOPs utilisation for RL training (variable-length sequences, "
        "no packing), below the ~40-50% of tuned pre-training"
    ),
    "train_flops_per_param_token": (
        "6 FLOPs/param/token for forward+backward (Kaplan et al. 2020) + 2 for the old-policy "
        "log-prob forward + 2 for the reference log-prob forward = 10: one GRPO trainer step "
        "including both recomputes. A pipeline that calls compute_logprobs as separate tasks "
        "should use 6 (dataclasses.replace) to avoid counting them twice"
    ),
    "host_to_device_bytes_per_s": (
        "assumption: PCIe 4.0 x16 per device (Ascend 910: PCIe 4.0 x16, Hot Chips 2019) at "
        "~25 GB/s effective, times tp (each device of an instance loads its own shard)"
    ),
    "network_bytes_per_s": (
        "assumption: 200 Gb/s RoCE per device (~25 GB/s; Ascend 910 integrates 2x100 Gb/s "
        "RoCE v2, Hot Chips 2019) times tp for a trainer->rollout broadcast; verl measured "
        "0.12 s for a plain Qwen2.5-7B sync on H20 (peers.md), so this is conservative"
    ),
    "colocate_switch_s": (
        "assumption: one rollout<->training switch in a colocated (verl hybrid-engine) setup: "
        "offload/onload of weights, optimizer state and KV pool plus resharding, a few seconds "
        "for 7B and more for 32B; not measured in our sources"
    ),
    "scaling_alpha": (
        "assumption: data-parallel training loses alpha per doubling beyond "
        "scaling_base_devices (gradient all-reduce, stragglers); 0.04 (7B) and 0.025 (32B) keep "
        "~0.84/0.90 of per-device throughput at 16x, the order of the paper's reported "
        "end-to-end scaling linearity (0.65 7B, 0.88 32B; secondary source, transferqueue.md)"
    ),
    "scaling_base_devices": "assumption: one 8-device node scales perfectly (intra-node links)",
    "scaling_floor": "assumption: efficiency never modelled below 50%",
}
"""Where every ``CostModel`` field's value comes from: a public source, a derivation, or the
text "assumption: <why>". A test checks that every field has an entry."""


def qwen2_param_count(
    *,
    hidden_size: int,
    num_layers: int,
    intermediate_size: int,
    num_kv_heads: int,
    head_dim: int,
    vocab_size: int,
    tie_embeddings: bool,
) -> int:
    """Exact parameter count of a Qwen2-architecture decoder (q/k/v with bias, o, SwiGLU MLP,
    two RMSNorms per layer, a final norm, embeddings and an untied or tied LM head)."""
    return sum(
        t.numel()
        for _, t in _qwen2_shapes(
            hidden_size,
            num_layers,
            intermediate_size,
            num_kv_heads,
            head_dim,
            vocab_size,
            tie_embeddings,
        )
    )


def _qwen2_shapes(
    hidden: int,
    layers: int,
    intermediate: int,
    kv_heads: int,
    head_dim: int,
    vocab: int,
    tie: bool,
) -> list[tuple[str, torch.Size]]:
    kv = kv_heads * head_dim
    per_layer = [
        ("self_attn.q_proj.weight", (hidden, hidden)),
        ("self_attn.q_proj.bias", (hidden,)),
        ("self_attn.k_proj.weight", (kv, hidden)),
        ("self_attn.k_proj.bias", (kv,)),
        ("self_attn.v_proj.weight", (kv, hidden)),
        ("self_attn.v_proj.bias", (kv,)),
        ("self_attn.o_proj.weight", (hidden, hidden)),
        ("mlp.gate_proj.weight", (intermediate, hidden)),
        ("mlp.up_proj.weight", (intermediate, hidden)),
        ("mlp.down_proj.weight", (hidden, intermediate)),
        ("input_layernorm.weight", (hidden,)),
        ("post_attention_layernorm.weight", (hidden,)),
    ]
    shapes: list[tuple[str, torch.Size]] = [
        ("model.embed_tokens.weight", torch.Size((vocab, hidden)))
    ]
    for i in range(layers):
        shapes += [(f"model.layers.{i}.{name}", torch.Size(s)) for name, s in per_layer]
    shapes.append(("model.norm.weight", torch.Size((hidden,))))
    if not tie:
        shapes.append(("lm_head.weight", torch.Size((vocab, hidden))))
    return shapes


@dataclass(frozen=True)
class CostModel:
    """Every constant the simulator assumes, and the seconds it derives from them.

    Defaults: Qwen2.5-7B in bf16 on Ascend 910B-class devices. ``SOURCES`` says where each
    value comes from. All times are per *one* inference instance (``tp`` devices serving one
    engine) or per training step over ``devices`` devices.

    Decode is memory-bound with a compute roof: a step reads the instance's weight shard once
    plus each running sequence's KV cache, over HBM bandwidth x ``decode_efficiency``; it can
    not be faster than ``2 * params * running`` FLOPs at ``mfu_prefill``; plus a fixed
    per-step overhead. Prefill and training are compute-bound.
    """

    SOURCES: ClassVar[dict[str, str]] = SOURCES

    model: str = "Qwen2.5-7B"
    device: str = "Ascend 910B"
    # architecture (exported weight shapes, parameter count, KV size)
    hidden_size: int = 3584
    num_layers: int = 28
    intermediate_size: int = 18944
    num_kv_heads: int = 4
    head_dim: int = 128
    vocab_size: int = 152064
    tie_embeddings: bool = False
    params: int = 7_615_616_512
    bytes_per_param: int = 2
    kv_bytes_per_token: int = 2 * 28 * 4 * 128 * 2
    # workload
    prompt_tokens: int = 256
    response_median: float = 1000.0
    response_sigma: float = 0.8
    response_min_tokens: int = 32
    response_max_tokens: int = 8192
    # inference instance
    tp: int = 1
    max_running: int = 256
    # device
    peak_flops: float = 320e12
    hbm_bytes: float = 64e9
    memory_utilization: float = 0.9
    hbm_bytes_per_s: float = 1.6e12
    decode_efficiency: float = 0.65
    decode_fixed_s: float = 0.005
    mfu_prefill: float = 0.5
    mfu_train: float = 0.3
    train_flops_per_param_token: float = 10.0
    # data movement
    host_to_device_bytes_per_s: float = 25e9
    network_bytes_per_s: float = 25e9
    colocate_switch_s: float = 3.0
    # data-parallel scaling of training
    scaling_alpha: float = 0.04
    scaling_base_devices: int = 8
    scaling_floor: float = 0.5

    def __post_init__(self) -> None:
        positive = (
            "hidden_size", "num_layers", "intermediate_size", "num_kv_heads", "head_dim",
            "vocab_size", "params", "bytes_per_param", "kv_bytes_per_token", "response_median",
            "response_min_tokens", "tp", "max_running", "peak_flops", "hbm_bytes",
            "hbm_bytes_per_s", "train_flops_per_param_token", "host_to_device_bytes_per_s",
            "network_bytes_per_s", "scaling_base_devices",
        )  # fmt: skip
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(f"CostModel.{name} must be > 0, got {getattr(self, name)!r}")
        non_negative = (
            "prompt_tokens", "response_sigma", "decode_fixed_s", "colocate_switch_s",
            "scaling_alpha",
        )  # fmt: skip
        for name in non_negative:
            if not getattr(self, name) >= 0:
                raise ConfigError(f"CostModel.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in (
            "memory_utilization", "decode_efficiency", "mfu_prefill", "mfu_train", "scaling_floor",
        ):  # fmt: skip
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ConfigError(f"CostModel.{name} is a fraction in (0, 1], got {value!r}")
        if self.response_max_tokens < self.response_min_tokens:
            raise ConfigError(
                f"CostModel.response_max_tokens ({self.response_max_tokens}) is below "
                f"response_min_tokens ({self.response_min_tokens}); swap or fix them"
            )
        arch = qwen2_param_count(
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            intermediate_size=self.intermediate_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            tie_embeddings=self.tie_embeddings,
        )
        if self.params != arch:
            raise ConfigError(
                f"CostModel.params = {self.params} but the architecture fields give {arch} "
                "parameters; set params=qwen2_param_count(...) of the same fields"
            )
        kv = 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_param
        if self.kv_bytes_per_token != kv:
            raise ConfigError(
                f"CostModel.kv_bytes_per_token = {self.kv_bytes_per_token} but K+V of "
                f"{self.num_layers} layers x {self.num_kv_heads} kv heads x {self.head_dim} dims x "
                f"{self.bytes_per_param} bytes is {kv}; set it to {kv}"
            )

    # ---- sizes ---------------------------------------------------------------------------
    @property
    def weight_bytes(self) -> int:
        """Bytes of one full copy of the weights."""
        return self.params * self.bytes_per_param

    def kv_capacity_tokens(self) -> float:
        """KV-cache tokens one instance holds: its devices' memory x ``memory_utilization``
        minus the weights, over ``kv_bytes_per_token``."""
        free = self.tp * self.hbm_bytes * self.memory_utilization - self.weight_bytes
        return max(0.0, free / self.kv_bytes_per_token)

    def weight_shapes(self) -> list[tuple[str, torch.Size]]:
        """Parameter names (Hugging Face Qwen2 layout) and shapes; they sum to ``params``."""
        return _qwen2_shapes(
            self.hidden_size,
            self.num_layers,
            self.intermediate_size,
            self.num_kv_heads,
            self.head_dim,
            self.vocab_size,
            self.tie_embeddings,
        )

    # ---- times ---------------------------------------------------------------------------
    def decode_step_s(self, running: int, context_tokens: float) -> float:
        """Seconds of one decode step of one instance with ``running`` sequences whose mean
        context (prompt + generated so far) is ``context_tokens``. 0 when nothing runs."""
        if running <= 0:
            return 0.0
        weights_s, kv_s, compute_s = self._decode_terms(running)
        return self.decode_fixed_s + max(weights_s + kv_s * context_tokens, compute_s)

    def decode_time_s(self, running: int, context_tokens: float, steps: float) -> float:
        """Seconds for ``steps`` consecutive decode steps of a constant running set whose mean
        context starts at ``context_tokens`` and grows one token per step: the integral of
        ``decode_step_s`` over the steps (so fractional steps are well defined)."""
        if running <= 0 or steps <= 0:
            return 0.0
        weights_s, kv_s, compute_s = self._decode_terms(running)
        fixed = self.decode_fixed_s
        flat = self._compute_bound_steps(running, context_tokens, steps)
        memory = steps - flat
        first = weights_s + kv_s * (context_tokens + flat)
        return flat * (fixed + compute_s) + memory * (fixed + first) + kv_s * memory**2 / 2

    def decode_steps_in(self, running: int, context_tokens: float, seconds: float) -> float:
        """The inverse of ``decode_time_s``: how many (fractional) steps ``seconds`` buy."""
        if running <= 0 or seconds <= 0:
            return 0.0
        weights_s, kv_s, compute_s = self._decode_terms(running)
        fixed = self.decode_fixed_s
        flat = self._compute_bound_steps(running, context_tokens, math.inf)
        if seconds <= flat * (fixed + compute_s):
            return seconds / (fixed + compute_s)
        rest = seconds - flat * (fixed + compute_s)
        step0 = fixed + weights_s + kv_s * (context_tokens + flat)
        # kv_s/2 y^2 + step0 y = rest, in the cancellation-free form
        return flat + 2 * rest / (step0 + math.sqrt(step0 * step0 + 2 * kv_s * rest))

    def _decode_terms(self, running: int) -> tuple[float, float, float]:
        """(weight-read seconds, KV-read seconds per context token, compute-roof seconds) of
        one decode step with ``running`` sequences, per device of the instance."""
        rate = self.hbm_bytes_per_s * self.decode_efficiency * self.tp
        compute = 2 * self.params * running / (self.tp * self.peak_flops * self.mfu_prefill)
        return self.weight_bytes / rate, running * self.kv_bytes_per_token / rate, compute

    def _compute_bound_steps(self, running: int, context_tokens: float, steps: float) -> float:
        """How many of the next ``steps`` steps sit on the compute roof (they come first:
        the memory time grows with the context)."""
        weights_s, kv_s, compute_s = self._decode_terms(running)
        gap = compute_s - weights_s - kv_s * context_tokens
        if gap <= 0:
            return 0.0
        return steps if kv_s == 0 else min(steps, gap / kv_s)

    def prefill_s(self, tokens: int) -> float:
        """Seconds to prefill ``tokens`` prompt (or resumed) tokens on one instance."""
        return 2 * self.params * max(0, tokens) / (self.tp * self.peak_flops * self.mfu_prefill)

    def scaling_efficiency(self, devices: int) -> float:
        """Fraction of linear speed-up data-parallel training keeps on ``devices`` devices:
        ``1 - scaling_alpha * log2(devices / scaling_base_devices)``, 1 up to the base, never
        below ``scaling_floor``. An assumption (see ``SOURCES``), not a measurement."""
        if devices <= self.scaling_base_devices:
            return 1.0
        loss = self.scaling_alpha * math.log2(devices / self.scaling_base_devices)
        return max(self.scaling_floor, 1.0 - loss)

    def train_s(self, tokens: int, devices: int) -> float:
        """Seconds of one optimizer step over ``tokens`` tokens on ``devices`` devices:
        ``train_flops_per_param_token * params * tokens`` FLOPs (forward+backward and the old
        and reference log-prob forwards) at ``mfu_train`` x ``scaling_efficiency``."""
        return self._dp_s(self.train_flops_per_param_token, tokens, devices)

    def logprob_s(self, tokens: int, devices: int) -> float:
        """Seconds of one forward-only log-prob pass (2 FLOPs/param/token)."""
        return self._dp_s(2.0, tokens, devices)

    def _dp_s(self, flops_per_param_token: float, tokens: int, devices: int) -> float:
        if devices < 1:
            raise ConfigError(f"devices must be >= 1, got {devices!r}")
        flops = flops_per_param_token * self.params * max(0, tokens)
        rate = devices * self.peak_flops * self.mfu_train * self.scaling_efficiency(devices)
        return flops / rate

    @staticmethod
    def transfer_s(nbytes: int, bandwidth: float) -> float:
        """Seconds to move ``nbytes`` at ``bandwidth`` bytes/s."""
        if not bandwidth > 0:
            raise ConfigError(f"bandwidth must be > 0 bytes/s, got {bandwidth!r}")
        return max(0, nbytes) / bandwidth

    # ---- workload ------------------------------------------------------------------------
    def sample_response_length(self, rng: np.random.Generator) -> int:
        """One response length drawn with ``rng`` (see ``response_length_at``)."""
        return self.response_length_at(float(rng.random()))

    def response_length_at(self, u: float) -> int:
        """The response length at quantile ``u`` in (0, 1) of lognormal(median, sigma),
        rounded and clipped to [response_min_tokens, response_max_tokens]: a long tail."""
        u = min(max(u, 1e-12), 1 - 1e-12)
        x = self.response_median * math.exp(self.response_sigma * _STD_NORMAL.inv_cdf(u))
        return int(min(max(round(x), self.response_min_tokens), self.response_max_tokens))

    def response_moments(self) -> tuple[float, float]:
        """``(E[L], E[L^2])`` of the clipped response length, by a fixed-seed sample of 200k
        (deterministic, cached per cost model)."""
        return _moments(self)

    def running_context_tokens(self) -> float:
        """Mean context of the sequences of a saturated instance in steady state. Long
        responses stay longer, so the running set is length-biased: a running sequence is on
        average ``E[L^2] / (2 E[L])`` tokens in, after the prompt."""
        mean, second = self.response_moments()
        return self.prompt_tokens + second / (2 * mean)


_STD_NORMAL = statistics.NormalDist()


@lru_cache(maxsize=64)
def _moments(cost: CostModel) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    x = rng.lognormal(math.log(cost.response_median), cost.response_sigma, size=200_000)
    x = np.clip(np.rint(x), cost.response_min_tokens, cost.response_max_tokens)
    return float(x.mean()), float((x * x).mean())


# --------------------------------------------------------------------------------------------
# Inference engine
# --------------------------------------------------------------------------------------------
_VOCAB = 32_000
_EPS = 1e-6  # steps: a sequence this close to its end has ended


def _id_hash(seed: int, request_id: str) -> int:
    """64 stable bits of (seed, request_id): the same in every process and attempt."""
    digest = hashlib.blake2b(f"{seed}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass(eq=False, slots=True)
class _Seq:
    request: GenerationRequest
    target: int  # response length (resume included) at which it ends
    reason: FinishReason  # how it ends when it reaches target
    start: int  # len(resume_tokens)
    prompt_len: int
    key: int  # _id_hash(seed, request_id): picks the target length and the token values
    future: asyncio.Future[GenerationResult]
    offset: float = 0.0  # engine step count at which this sequence had produced 0 tokens
    state: Literal["queued", "running", "done"] = "queued"


class SimInferenceEngine:
    """One simulated inference instance (``cost.tp`` devices) with continuous batching.

    At most ``cost.max_running`` sequences decode together; more requests queue FIFO. Each
    admission adds ``prefill_s(prompt + resume)`` before decoding continues (no chunked
    prefill). A request's response length is ``cost.response_length_at(u)``, ``u`` a hash of
    ``(seed, request_id)``, so a resumed request keeps its target (same seed, same id);
    ``SamplingParams.max_tokens`` caps the whole response, resumed tokens included
    (``finish_reason="length"``), else it ends with ``"stop"``, as it does at the first new
    token in ``stop_token_ids`` (included). Tokens are deterministic ids in
    [0, 32000) and log-probs in [-5, 0) (also functions of ``(seed, request_id)``);
    ``versions[i]`` is the engine's weight version when token ``i`` was produced, so a load
    mid-generation gives later tokens the new version (in-flight swap, KV kept).

    Implements ``InferenceEngine``, ``SupportsPause``, ``SupportsLoadWeights`` and
    ``SupportsSleep`` (each of ``sleep``/``wake_up`` costs ``cost.colocate_switch_s``). Counters:
    ``busy_s`` (seconds with at least one sequence prefilling or decoding: not while paused or
    loading weights), ``load_s``, ``tokens_generated`` (new tokens handed back, aborted ones
    included), ``requests_finished`` (stop/length), ``requests_aborted``.
    """

    sync_verification_refusal: ClassVar[str] = (
        "a simulated engine: its weights are shapes and its log-probs are made up"
    )
    """``asyncflow_core.sync.verify``: a job's sync verification is skipped, with this."""

    def __init__(self, cost: CostModel, *, name: str = "sim-rollout-0", seed: int = 0) -> None:
        self.cost = cost
        self.name = name
        self.seed = seed
        self.busy_s = 0.0
        self.load_s = 0.0
        self.switch_s = 0.0
        self.loads = 0
        self.tokens_generated = 0
        self.requests_finished = 0
        self.requests_aborted = 0
        self._version: Version = 0
        # progress: every running sequence advances by the same number of steps, so one
        # engine-wide step count S and a per-sequence offset give each one's progress
        self._steps = 0.0
        self._heap: list[tuple[float, int, _Seq]] = []  # (S at which it ends, tiebreak, seq)
        self._tiebreak = 0
        self._n_running = 0
        self._ctx_base = 0.0  # sum over running of (prompt_len - offset): ctx sum = n*S + this
        self._queue: deque[_Seq] = deque()
        self._n_queued = 0
        self._inflight: dict[str, _Seq] = {}
        # version history as (S at the change, version); a token completed at S_tok reports
        # the last version whose change happened before S_tok
        self._change_steps: list[float] = [-math.inf]
        self._change_versions: list[Version] = [0]
        # the current plan of the driver
        self._accruing = False
        self._plan_t = 0.0
        self._plan_ctx = 0.0
        self._prefill_left = 0.0
        self._paused = False
        self._loading = 0
        self._load_lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._driver: asyncio.Task[None] | None = None
        self._waiter: asyncio.Future[None] | None = None

    # ---- protocol ------------------------------------------------------------------------
    @property
    def weight_version(self) -> Version:
        return self._version

    @property
    def running(self) -> int:
        """Sequences decoding now."""
        return self._n_running

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return self._n_queued

    @property
    def paused(self) -> bool:
        return self._paused

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        loop = self._ensure_driver()
        rid = request.request_id
        if rid in self._inflight:
            raise EngineError(
                f"{self.name}: request {rid!r} is already in flight; wait for it or abort it "
                "before submitting the same id again"
            )
        start = len(request.resume_tokens)
        if len(request.resume_logprobs) != start or len(request.resume_versions) != start:
            raise EngineError(
                f"{self.name}: request {rid!r} resumes {start} tokens with "
                f"{len(request.resume_logprobs)} logprobs and {len(request.resume_versions)} "
                "versions; pass one of each per resumed token"
            )
        if request.params.max_tokens < 0:
            raise EngineError(
                f"{self.name}: request {rid!r} has max_tokens={request.params.max_tokens}; "
                "use a value >= 0"
            )
        if start > request.params.max_tokens:
            raise EngineError(
                f"{self.name}: request {rid!r} resumes {start} tokens but max_tokens="
                f"{request.params.max_tokens} caps the whole response, resumed tokens included; "
                "raise max_tokens or resume from a shorter prefix"
            )
        key = _id_hash(self.seed, rid)
        natural = self.cost.response_length_at(((key >> 11) + 0.5) / 2.0**53)
        cap = request.params.max_tokens
        reason: FinishReason = "length" if natural > cap else "stop"
        target = min(natural, cap)
        stops = set(request.params.stop_token_ids)
        if stops:  # the first stop token among the new ones ends it, included
            ids_pool, _ = _pools(_POOL_BASES + self.cost.response_max_tokens)
            base = key % _POOL_BASES
            hit = next((i for i in range(start, target) if ids_pool[base + i] in stops), None)
            if hit is not None:
                target, reason = hit + 1, "stop"
        seq = _Seq(
            request, target, reason, start, len(request.prompt_tokens), key, loop.create_future()
        )
        if start >= target:  # nothing left to generate
            return self._result(seq, start, reason if start == target else "length")
        self._inflight[rid] = seq
        self._queue.append(seq)
        self._n_queued += 1
        self._poke()
        try:
            return await seq.future
        except asyncio.CancelledError:
            if seq.state != "done":  # the caller gave up: drop it silently
                self._catch_up()
                self._remove(seq)
                self._poke()
            raise

    async def abort(self, request_ids: Sequence[str]) -> None:
        self._catch_up()
        for rid in request_ids:
            seq = self._inflight.get(rid)
            if seq is not None:
                self._end(seq, aborted=True)
        self._poke()

    async def pause(self, mode: Literal["abort", "keep"] = "abort") -> None:
        if mode not in ("abort", "keep"):
            raise EngineError(f"{self.name}: pause mode must be 'abort' or 'keep', got {mode!r}")
        self._catch_up()
        self._paused = True
        if mode == "abort":
            for seq in list(self._inflight.values()):
                self._end(seq, aborted=True)
        self._poke()

    async def resume(self) -> None:
        self._catch_up()
        self._paused = False
        self._poke()

    async def load_weights(
        self, weights: Sequence[tuple[str, torch.Tensor]], version: Version
    ) -> None:
        """Stall decoding for ``cost.transfer_s(nbytes, host_to_device_bytes_per_s)`` (the
        swap from a host buffer), then set ``weight_version``: tokens completed afterwards
        report ``version``; running sequences keep their KV. Works while paused."""
        if isinstance(version, bool) or not isinstance(version, int | np.integer):
            raise EngineError(f"{self.name}: version must be an int, got {version!r}")
        nbytes = sum(t.numel() * t.element_size() for _, t in weights)
        if self._load_lock is None:
            self._load_lock = asyncio.Lock()
        async with self._load_lock:
            self._catch_up()
            self._loading += 1
            self._poke()
            try:
                stall = self.cost.transfer_s(nbytes, self.cost.host_to_device_bytes_per_s)
                await asyncio.sleep(stall)
                self._catch_up()
                self._version = int(version)
                self._change_steps.append(self._steps)
                self._change_versions.append(int(version))
                self.load_s += stall
                self.loads += 1
            finally:
                self._loading -= 1
                self._poke()

    async def sleep(self, level: int = 1) -> None:
        """Colocated mode hands the devices to the trainer: freeze in-flight work (none, when
        the workflow drained first) and spend ``cost.colocate_switch_s`` offloading weights
        and KV cache and resharding. ``SupportsSleep``."""
        if level not in (1, 2):
            raise EngineError(f"{self.name}: sleep level must be 1 or 2, got {level!r}")
        await self.pause("keep")
        await asyncio.sleep(self.cost.colocate_switch_s)
        self.switch_s += self.cost.colocate_switch_s

    async def wake_up(self) -> None:
        """Take the devices back: ``cost.colocate_switch_s`` to onload, then resume."""
        await asyncio.sleep(self.cost.colocate_switch_s)
        self.switch_s += self.cost.colocate_switch_s
        await self.resume()

    async def close(self) -> None:
        """Abort everything in flight and stop the driver task."""
        await self.pause("abort")
        self._paused = False
        if self._driver is not None:
            self._driver.cancel()
            self._driver = None

    # ---- driver --------------------------------------------------------------------------
    def _ensure_driver(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first use, or a new event loop: old waiters are dead
            self._loop, self._driver, self._waiter = loop, None, None
            self._load_lock = None
            self._queue.clear()
            self._inflight.clear()
            self._heap.clear()
            self._n_running, self._n_queued, self._ctx_base = 0, 0, 0.0
            self._accruing, self._prefill_left = False, 0.0
        if self._driver is None or self._driver.done():
            self._plan_t = loop.time()
            self._driver = loop.create_task(self._drive(), name=f"{self.name}-driver")
        return loop

    def _poke(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _drive(self) -> None:
        try:
            while True:
                self._catch_up()
                self._plan()
                await self._wait(self._planned_s() if self._accruing else None)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a bug here must not leave callers waiting forever
            error = EngineError(f"{self.name}: simulator driver failed: {exc!r}")
            for seq in list(self._inflight.values()):
                if not seq.future.done():
                    seq.future.set_exception(error)
            raise

    async def _wait(self, timeout: float | None) -> None:
        assert self._loop is not None
        waiter = self._loop.create_future()
        self._waiter = waiter
        handle = None if timeout is None else self._loop.call_later(timeout, _wake, waiter)
        try:
            await waiter
        finally:
            if handle is not None:
                handle.cancel()
            self._waiter = None

    def _plan(self) -> None:
        """Admit what fits, then decide how long the current running set decodes untouched."""
        assert self._loop is not None
        self._plan_t = self._loop.time()
        if self._paused or self._loading:
            self._accruing = False
            return
        while self._queue and self._n_running < self.cost.max_running:
            seq = self._queue.popleft()
            if seq.state == "queued":
                self._admit(seq)
        self._drop_finished_heads()
        if not self._n_running:
            self._accruing = False
            return
        self._plan_ctx = self._steps + self._ctx_base / self._n_running  # mean context now
        self._accruing = True

    def _planned_s(self) -> float:
        """Seconds until the first running sequence ends (prefill first, then decoding)."""
        steps = max(0.0, self._heap[0][0] - self._steps)
        return self._prefill_left + self.cost.decode_time_s(self._n_running, self._plan_ctx, steps)

    def _admit(self, seq: _Seq) -> None:
        self._n_queued -= 1
        seq.state = "running"
        seq.offset = self._steps - seq.start
        self._tiebreak += 1
        heapq.heappush(self._heap, (seq.offset + seq.target, self._tiebreak, seq))
        self._n_running += 1
        self._ctx_base += seq.prompt_len - seq.offset
        self._prefill_left += self.cost.prefill_s(seq.prompt_len + seq.start)

    def _drop_finished_heads(self) -> None:
        while self._heap and self._heap[0][2].state != "running":
            heapq.heappop(self._heap)

    def _catch_up(self) -> None:
        """Credit the progress made since the plan started, finishing what reached its end."""
        if self._loop is None:
            return
        now = self._loop.time()
        elapsed = now - self._plan_t
        self._plan_t = now
        if not self._accruing or elapsed <= 0:
            return
        self.busy_s += elapsed
        if self._prefill_left > 0:
            used = min(elapsed, self._prefill_left)
            self._prefill_left -= used
            elapsed -= used
        if elapsed <= 0:
            return
        steps = self.cost.decode_steps_in(self._n_running, self._plan_ctx, elapsed)
        while steps > 0:
            self._drop_finished_heads()
            if not self._heap:
                break
            end = self._heap[0][0]
            chunk = min(steps, end - self._steps)
            self._steps += max(0.0, chunk)
            steps -= max(0.0, chunk)
            while self._heap and self._heap[0][0] <= self._steps + _EPS:
                seq = heapq.heappop(self._heap)[2]
                if seq.state == "running":
                    self._end(seq, aborted=False)
            if chunk <= 0 and not self._heap:
                break
        if self._n_running:  # a later credit in the same plan starts from here
            self._plan_ctx = self._steps + self._ctx_base / self._n_running

    # ---- ending a sequence -----------------------------------------------------------------
    def _remove(self, seq: _Seq) -> None:
        if seq.state == "running":
            self._n_running -= 1
            self._ctx_base -= seq.prompt_len - seq.offset
            if not self._n_running:  # reset, so rounding cannot accumulate
                self._ctx_base = 0.0
                self._prefill_left = 0.0
        elif seq.state == "queued":
            self._n_queued -= 1
        seq.state = "done"
        if self._inflight.get(seq.request.request_id) is seq:
            del self._inflight[seq.request.request_id]

    def _end(self, seq: _Seq, *, aborted: bool) -> None:
        if aborted:
            produced = seq.start
            if seq.state == "running":
                produced = math.floor(self._steps - seq.offset + _EPS)
            produced = min(max(produced, seq.start), seq.target)
            reason: FinishReason = "abort"
            self.requests_aborted += 1
        else:
            produced, reason = seq.target, seq.reason
            self.requests_finished += 1
        self._remove(seq)
        result = self._result(seq, produced, reason)
        if not seq.future.done():
            seq.future.set_result(result)

    def _result(self, seq: _Seq, produced: int, reason: FinishReason) -> GenerationResult:
        req = seq.request
        new = produced - seq.start
        if new <= 0:
            tokens, lps, vers = req.resume_tokens, req.resume_logprobs, req.resume_versions
            return GenerationResult(req.request_id, req.prompt_tokens, tokens, lps, vers, reason)
        self.tokens_generated += new
        # token i of a request is pool[base + i] in every attempt: cheap tuple slices
        length = _POOL_BASES + self.cost.response_max_tokens
        ids_pool, lp_pool = _pools(length)
        base = seq.key % _POOL_BASES
        lo, hi = base + seq.start, base + produced
        tokens = ids_pool[lo:hi]
        lps = lp_pool[lo:hi]
        versions = self._versions(seq, produced)
        if seq.start:
            tokens, lps = req.resume_tokens + tokens, req.resume_logprobs + lps
            return GenerationResult(
                req.request_id, req.prompt_tokens, tokens, lps, versions, reason
            )
        # the same values as tensors, so the job stores them without converting each
        return _SimResult(
            req.request_id, req.prompt_tokens, tokens, lps, versions, reason,
            _pool_tensors(length), (lo, hi),
        )  # fmt: skip

    def _versions(self, seq: _Seq, produced: int) -> tuple[Version, ...]:
        """Token j (done when the step count reaches offset + j + 1) reports the version of the
        last load that happened strictly before that; built as runs of equal versions."""
        steps, versions = self._change_steps, self._change_versions
        k = bisect.bisect_left(steps, seq.offset + seq.start + 1) - 1
        last_done = seq.offset + produced
        out = seq.request.resume_versions
        pos, current = seq.start, versions[k]
        for kk in range(k + 1, len(steps)):
            if steps[kk] >= last_done:
                break
            first_after = min(max(math.floor(steps[kk] - seq.offset - 1) + 1, pos), produced)
            out += (current,) * (first_after - pos)
            pos, current = first_after, versions[kk]
        tail = (current,) * (produced - pos)
        return out + tail if out else tail


_POOL_BASES = 4096


@lru_cache(maxsize=8)
def _pools(length: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Fixed pseudo-random token ids in [0, 32000) and log-probs in [-5, 0)."""
    rng = np.random.default_rng(20250701)
    ids = tuple(rng.integers(0, _VOCAB, size=length).tolist())
    logprobs = tuple((-5.0 * (1.0 - rng.random(length))).tolist())
    return ids, logprobs


@lru_cache(maxsize=8)
def _pool_tensors(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``_pools(length)`` as an int64 and a float32 tensor."""
    ids, logprobs = _pools(length)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(logprobs, dtype=torch.float32)


@dataclass(frozen=True, slots=True)
class _SimResult(GenerationResult):
    """A ``GenerationResult`` that can also give its tokens and log-probs as 1-D tensors
    (``token_view``, ``logprob_view``: slices ``span`` of the pool tensors, taken when asked
    for; read by ``asyncflow_core.flow.rlflow``, which copies them instead of converting every
    value, a per-token cost the simulator would otherwise pay per sample)."""

    pools: tuple[torch.Tensor, torch.Tensor] | None = None
    span: tuple[int, int] = (0, 0)

    @property
    def token_view(self) -> torch.Tensor | None:
        return None if self.pools is None else self.pools[0][self.span[0] : self.span[1]]

    @property
    def logprob_view(self) -> torch.Tensor | None:
        return None if self.pools is None else self.pools[1][self.span[0] : self.span[1]]


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


# --------------------------------------------------------------------------------------------
# Train engine
# --------------------------------------------------------------------------------------------
class SimTrainEngine:
    """A trainer on ``devices`` devices that only takes time. ``train_step`` sleeps
    ``cost.train_s(tokens, devices)`` and adds 1 to ``weight_version``; it does not train:
    ``loss_fn`` is not called and the reported loss and grad norm are NaN. ``tokens`` is the
    sum over rows of the lengths of ``token_fields`` (default "prompt" and "response"), read
    from ``batch.lengths``, else from "list"/"nested" tensors in ``batch.data``, else from
    the rows' ``Tags.tokens`` (taken as the whole row's length).

    ``export_weights`` yields meta-device bf16 tensors with the model's real names and shapes
    (total bytes = ``cost.weight_bytes``), bucketed like a real trainer; gathering them takes
    no simulated time (the transport charges the transfer). Checkpoints are a small JSON file
    recording the version. Counters: ``busy_s``, ``steps``.
    """

    sync_verification_refusal: ClassVar[str] = (
        "a simulated engine: its weights are shapes and its log-probs are made up"
    )
    """``asyncflow_core.sync.verify``: a job's sync verification is skipped, with this."""

    batch_layout: ClassVar[Literal["list"]] = "list"
    """The layout ``RLJob`` fetches its update batches in: the token counts are all it
    reads, so no padded batch (tens of GB at 1024 devices) is built for it."""

    def __init__(
        self,
        cost: CostModel,
        devices: int,
        *,
        name: str = "sim-trainer",
        token_fields: Sequence[str] = ("prompt", "response"),
    ) -> None:
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise ConfigError(f"SimTrainEngine devices must be an int >= 1, got {devices!r}")
        self.cost = cost
        self.devices = devices
        self.name = name
        self.token_fields = tuple(token_fields)
        self.busy_s = 0.0
        self.steps = 0
        self._version: Version = 0

    @property
    def weight_version(self) -> Version:
        return self._version

    def batch_tokens(self, batch: Batch) -> int:
        """Tokens ``train_step`` charges for ``batch`` (see the class docstring)."""
        total, found = 0, False
        for name in self.token_fields:
            if name in batch.lengths:
                total += int(batch.lengths[name].sum().item())
                found = True
            elif name in batch.data:
                value = batch.data[name]
                if isinstance(value, list) and all(isinstance(t, torch.Tensor) for t in value):
                    total += sum(int(t.shape[0]) if t.dim() else 1 for t in value)
                    found = True
                elif isinstance(value, torch.Tensor) and value.is_nested:
                    total += sum(int(t.shape[0]) for t in value.unbind())
                    found = True
        if found:
            return total
        tagged = sum(t.tokens for t in batch.tags)
        if tagged > 0 or len(batch) == 0:
            return tagged
        raise EngineError(
            f"{self.name}: cannot tell how many tokens the batch of {len(batch)} rows has: no "
            f"lengths for {list(self.token_fields)} and every Tags.tokens is 0; fetch those "
            "fields with layout='padded' (which fills batch.lengths) or tag rows with tokens"
        )

    async def train_step(self, batch: Batch, loss_fn: LossFn) -> TrainMetrics:
        tokens = self.batch_tokens(batch)
        seconds = self.cost.train_s(tokens, self.devices)
        await asyncio.sleep(seconds)
        self.busy_s += seconds
        self.steps += 1
        self._version += 1
        return TrainMetrics(
            version=self._version,
            loss=float("nan"),
            grad_norm=float("nan"),
            samples=len(batch),
            tokens=tokens,
            extra={"sim_seconds": seconds},
        )

    async def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """Sleep ``cost.logprob_s`` and return zeros ``[B, T]`` (T: the longest response)."""
        tokens = self.batch_tokens(batch)
        seconds = self.cost.logprob_s(tokens, self.devices)
        await asyncio.sleep(seconds)
        self.busy_s += seconds
        return torch.zeros(len(batch), self._response_width(batch))

    def _response_width(self, batch: Batch) -> int:
        name = self.token_fields[-1]
        if name in batch.lengths and batch.lengths[name].numel():
            return int(batch.lengths[name].max().item())
        value = batch.data.get(name)
        if isinstance(value, torch.Tensor) and not value.is_nested and value.dim() >= 2:
            return int(value.shape[1])
        if isinstance(value, list) and value and all(isinstance(t, torch.Tensor) for t in value):
            return max(int(t.shape[0]) if t.dim() else 1 for t in value)
        return 0

    async def export_weights(self, bucket_bytes: int) -> AsyncIterator[WeightBucket]:
        dtype = torch.bfloat16 if self.cost.bytes_per_param == 2 else torch.float32
        if torch.empty((), dtype=dtype).element_size() != self.cost.bytes_per_param:
            raise ConfigError(
                f"{self.name}: cannot export {self.cost.bytes_per_param}-byte parameters; "
                "use bytes_per_param 2 (bf16) or 4 (fp32)"
            )
        named = [
            (name, torch.empty(shape, dtype=dtype, device="meta"))
            for name, shape in self.cost.weight_shapes()
        ]
        for bucket in bucketize(named, bucket_bytes):
            yield bucket

    async def save_checkpoint(self, path: str) -> None:
        target = self._checkpoint_file(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        record = {"engine": "SimTrainEngine", "model": self.cost.model, "version": self._version}
        target.write_text(json.dumps(record))

    async def load_checkpoint(self, path: str) -> None:
        target = self._checkpoint_file(path)
        try:
            record: dict[str, Any] = json.loads(target.read_text())
            version = int(record["version"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise EngineError(
                f"{self.name}: no readable simulated checkpoint at {target} ({exc}); pass a "
                "path written by SimTrainEngine.save_checkpoint"
            ) from exc
        self._version = version

    @staticmethod
    def _checkpoint_file(path: str) -> Path:
        p = Path(path)
        return p / "sim_checkpoint.json" if p.is_dir() else p


# --------------------------------------------------------------------------------------------
# Weight transport
# --------------------------------------------------------------------------------------------
class SimWeightTransport:
    """A ``WeightSync`` whose ``update(bucket)`` takes ``bucket.nbytes / bandwidth`` virtual
    seconds (default ``cost.network_bytes_per_s``: one broadcast from the trainer reaches every
    target at once, so the time does not grow with the number of targets), staging the
    (meta) tensors; ``finish(version)`` loads the whole set into every target concurrently
    (``SupportsLoadWeights``: a ``SimInferenceEngine``, which stalls for its host-to-device
    swap, or a ``HostBuffer`` for the staged update). Phases: ``init`` once, then per sync
    ``start``, ``update`` x N, ``finish``; out of order -> ``WeightSyncError``.
    Counters: ``transfer_s``, ``bytes_sent``, ``syncs``."""

    def __init__(
        self,
        targets: Sequence[SupportsLoadWeights],
        cost: CostModel,
        *,
        bandwidth: float | None = None,
    ) -> None:
        self.targets = list(targets)
        self.cost = cost
        self.bandwidth = cost.network_bytes_per_s if bandwidth is None else bandwidth
        if not self.bandwidth > 0:
            raise ConfigError(f"SimWeightTransport bandwidth must be > 0, got {self.bandwidth!r}")
        self.transfer_s = 0.0
        self.bytes_sent = 0
        self.syncs = 0
        self._state: Literal["new", "ready", "open"] = "new"
        self._staged: list[tuple[str, torch.Tensor]] = []
        self._seen: set[str] = set()

    _NEXT: ClassVar[dict[str, str]] = {
        "new": "init()",
        "ready": "start()",
        "open": "update() or finish()",
    }

    def _expect(self, phase: str, *states: str) -> None:
        if self._state not in states:
            raise WeightSyncError(
                f"SimWeightTransport: {phase}() called out of order; the next call must be "
                f"{self._NEXT[self._state]} (phases: init -> start -> update x N -> finish)"
            )

    async def init(self) -> None:
        self._expect("init", "new")
        self._state = "ready"

    async def start(self) -> None:
        self._expect("start", "ready")
        self._staged, self._seen = [], set()
        self._state = "open"

    async def update(self, bucket: WeightBucket) -> None:
        self._expect("update", "open")
        if not isinstance(bucket, WeightBucket):
            raise WeightSyncError(
                f"SimWeightTransport: update() takes a WeightBucket, got {bucket!r:.80}"
            )
        seen = set(self._seen)  # checked whole before anything is kept
        for name in bucket.names:
            if name in seen:
                raise WeightSyncError(
                    f"SimWeightTransport: parameter {name!r} was sent twice in one sync; "
                    "send each once"
                )
            seen.add(name)
        seconds = self.cost.transfer_s(bucket.nbytes, self.bandwidth)
        await asyncio.sleep(seconds)
        self._seen.update(bucket.names)
        self._staged += [(n, t.detach().clone()) for n, t in bucket]
        self.transfer_s += seconds
        self.bytes_sent += bucket.nbytes

    async def finish(self, version: Version) -> None:
        self._expect("finish", "open")
        weights, self._staged = self._staged, []
        try:
            await asyncio.gather(*(t.load_weights(weights, version) for t in self.targets))
        finally:
            self._state = "ready"
        self.syncs += 1


# --------------------------------------------------------------------------------------------
# The Ray runtime's per-call costs
# --------------------------------------------------------------------------------------------
RAY_COSTS_FILE = Path(__file__).with_name("ray_costs.json")


@dataclass(frozen=True, slots=True)
class RayCosts:
    """What the Ray runtime adds to each engine call, measured by ``benchmarks/ray_calls.py``
    with engines that do no work behind the real proxies (``RAY_COSTS_FILE`` holds the dev
    box's figures and the command). Fits: a batch of ``k`` generate requests of ``T`` tokens
    takes ``generate_call_s + k·(generate_request_s + T·generate_token_s)`` of wall time, of
    which the driver's CPU is ``driver_call_cpu_s + k·(driver_request_cpu_s +
    T·driver_token_cpu_s)``; a ``train_step`` (or ``compute_logprobs``) of ``B`` bytes takes
    ``train_call_s + B / train_bytes_per_s`` (driver CPU ``driver_train_call_cpu_s +
    B·driver_train_byte_cpu_s``); a control call (pause, resume, load, swap) takes
    ``control_call_s`` (driver CPU ``driver_control_cpu_s``).

    ``train_bytes_per_token`` is an assumption, not a measurement: the update batch's bytes
    per token (an int64 token id, float32 behaviour and proximal log-probs, an int64
    version: 24), crossing unpadded."""

    generate_call_s: float
    generate_request_s: float
    generate_token_s: float
    driver_call_cpu_s: float
    driver_request_cpu_s: float
    driver_token_cpu_s: float
    train_call_s: float
    train_bytes_per_s: float
    driver_train_call_cpu_s: float
    driver_train_byte_cpu_s: float
    control_call_s: float
    driver_control_cpu_s: float
    train_bytes_per_token: int = 24
    measured: str = ""

    @classmethod
    def load(cls, path: str | Path | None = None) -> RayCosts:
        """The figures in ``path`` (default ``RAY_COSTS_FILE``); ``ConfigError`` naming a
        missing or bad field."""
        target = RAY_COSTS_FILE if path is None else Path(path)
        try:
            raw = json.loads(target.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"RayCosts: cannot read {target}: {e}") from e
        names = [f.name for f in dataclasses.fields(cls)]
        values: dict[str, Any] = {}
        for name in names:
            if name not in raw:
                if name in ("train_bytes_per_token", "measured"):
                    continue
                raise ConfigError(
                    f"RayCosts: {target} has no {name!r}; measure it with "
                    "python benchmarks/ray_calls.py --write PATH"
                )
            value = raw[name]
            if name == "measured":
                values[name] = str(value)
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ConfigError(
                    f"RayCosts: {target}: {name} must be a number >= 0, got {value!r}"
                )
            values[name] = value
        return cls(**values)

    def generate_s(self, requests: int, tokens: float) -> tuple[float, float]:
        """(wall seconds, driver CPU seconds) of one request of ``tokens`` response tokens
        sent with ``requests - 1`` others in one call (the call's share included)."""
        wall = self.generate_call_s / requests + self.generate_request_s
        cpu = self.driver_call_cpu_s / requests + self.driver_request_cpu_s
        return wall + tokens * self.generate_token_s, cpu + tokens * self.driver_token_cpu_s

    def train_s(self, tokens: int) -> tuple[float, float]:
        """(wall seconds, driver CPU seconds) of a train call whose batch has ``tokens``."""
        nbytes = tokens * self.train_bytes_per_token
        wall = self.train_call_s + nbytes / self.train_bytes_per_s
        return wall, self.driver_train_call_cpu_s + nbytes * self.driver_train_byte_cpu_s


class VirtualDriver:
    """The one driver process every Ray call of a job goes through: the CPU seconds the calls
    cost there serialize (first come, first served), whatever the number of engines.
    ``busy_s``: the seconds charged."""

    def __init__(self) -> None:
        self.busy_s = 0.0
        self._free_at = 0.0

    async def work(self, seconds: float) -> None:
        """Take ``seconds`` of the driver's CPU, after the work queued before."""
        if seconds <= 0:
            return
        now = asyncio.get_running_loop().time()
        self._free_at = max(now, self._free_at) + seconds
        self.busy_s += seconds
        await asyncio.sleep(self._free_at - now)


class RaySimInferenceEngine:
    """A ``SimInferenceEngine`` as ``--runtime ray`` would see it: behind an actor call. Each
    request's result comes back after the call's latency beyond the engine's own time (its
    wall cost less its driver CPU) and after its driver CPU share on the ``VirtualDriver``
    (``RayCosts.generate_s``; ``group``: requests sent per call, a group's samples); every
    control call (pause, resume, load, abort, sleep) adds ``control_call_s``."""

    sync_verification_refusal: ClassVar[str] = SimInferenceEngine.sync_verification_refusal
    """As the simulated engine's: a job's sync verification is skipped."""

    def __init__(
        self, engine: SimInferenceEngine, costs: RayCosts, driver: VirtualDriver, *, group: int
    ) -> None:
        self.engine = engine
        self.costs = costs
        self.driver = driver
        self.group = max(1, group)
        self.name = engine.name

    @property
    def weight_version(self) -> Version:
        return self.engine.weight_version

    @property
    def busy_s(self) -> float:
        return self.engine.busy_s

    async def _control(self) -> None:
        await self.driver.work(self.costs.driver_control_cpu_s)
        await asyncio.sleep(max(0.0, self.costs.control_call_s - self.costs.driver_control_cpu_s))

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        result = await self.engine.generate(request)
        wall, cpu = self.costs.generate_s(self.group, len(result.tokens))
        await asyncio.sleep(max(0.0, wall - cpu))
        await self.driver.work(cpu)
        return result

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self._control()
        await self.engine.abort(request_ids)

    async def pause(self, mode: Literal["abort", "keep"] = "abort") -> None:
        await self._control()
        await self.engine.pause(mode)

    async def resume(self) -> None:
        await self._control()
        await self.engine.resume()

    async def load_weights(
        self, weights: Sequence[tuple[str, torch.Tensor]], version: Version
    ) -> None:
        await self._control()
        await self.engine.load_weights(weights, version)

    async def sleep(self, level: int = 1) -> None:
        await self._control()
        await self.engine.sleep(level)

    async def wake_up(self) -> None:
        await self._control()
        await self.engine.wake_up()

    async def close(self) -> None:
        await self.engine.close()


class RaySimTrainEngine:
    """A ``SimTrainEngine`` behind an actor call: ``train_step`` and ``compute_logprobs``
    first ship the batch (``RayCosts.train_s`` of its tokens: latency, and the driver CPU on
    the ``VirtualDriver``). Weights go trainer to rollout directly (the sync's transport
    charges them), never through the driver."""

    batch_layout: ClassVar[Literal["list"]] = "list"

    sync_verification_refusal: ClassVar[str] = SimTrainEngine.sync_verification_refusal
    """As the simulated trainer's: a job's sync verification is skipped."""

    def __init__(self, trainer: SimTrainEngine, costs: RayCosts, driver: VirtualDriver) -> None:
        self.trainer = trainer
        self.costs = costs
        self.driver = driver
        self.name = trainer.name

    @property
    def weight_version(self) -> Version:
        return self.trainer.weight_version

    @property
    def busy_s(self) -> float:
        return self.trainer.busy_s

    async def _ship(self, batch: Batch) -> None:
        wall, cpu = self.costs.train_s(self.trainer.batch_tokens(batch))
        await self.driver.work(cpu)
        await asyncio.sleep(max(0.0, wall - cpu))

    async def train_step(self, batch: Batch, loss_fn: LossFn) -> TrainMetrics:
        await self._ship(batch)
        return await self.trainer.train_step(batch, loss_fn)

    async def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        await self._ship(batch)
        return await self.trainer.compute_logprobs(batch)

    def export_weights(self, bucket_bytes: int) -> AsyncIterator[WeightBucket]:
        return self.trainer.export_weights(bucket_bytes)

    async def save_checkpoint(self, path: str) -> None:
        await self.trainer.save_checkpoint(path)

    async def load_checkpoint(self, path: str) -> None:
        await self.trainer.load_checkpoint(path)


__all__ = [
    "RAY_COSTS_FILE",
    "SOURCES",
    "CostModel",
    "RayCosts",
    "RaySimInferenceEngine",
    "RaySimTrainEngine",
    "SimInferenceEngine",
    "SimTrainEngine",
    "SimWeightTransport",
    "VirtualDriver",
    "qwen2_param_count",
]
