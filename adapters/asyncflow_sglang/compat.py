"""Which SGLang this adapter is written and tested against, and the errors when it is missing
or another version is installed (or served)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from asyncflow_core.engines.enginekit import check_version, require_module

TESTED = ("0.5.23", "0.6")
"""The adapter follows SGLang's API in ``[TESTED[0], TESTED[1])`` (the extras' pin)."""

GREEDY_BELOW = 1e-6
"""SGLang decodes any temperature below this greedily, as temperature 1 with top_k 1
(``sglang/srt/sampling/sampling_params.py``: ``_SAMPLING_EPS``,
``SamplingParams.__post_init__``)."""

SAMPLING_MASK_MAX_TOKENS = 4096
"""SGLang's default ``--sampling-mask-max-tokens`` (``sglang/srt/arg_groups/fields/exec_.py``):
the largest ``top_k`` for which it returns ``return_sampling_mask`` log-probs
(``sglang/srt/managers/scheduler.py``, ``Scheduler._handle_generate_request``)."""

INSTALL = "pip install 'asyncflow[sglang]' on a machine with a CUDA GPU"
INSTALL_CLIENT = "pip install 'asyncflow[sglang-client]'"

NO_INFLIGHT_LOAD = (
    "SGLang takes update_weights_from_distributed while not paused only under its model-update "
    "writer lock, which waits for every running request to finish "
    "(srt/managers/tokenizer_control_mixin.py, update_weights_from_distributed): the update "
    "drains generation, it never runs beside it"
)
"""Why SGLang cannot load weights while it generates (``inflight_weight_load_refusal``)."""


def check_sglang_version(version: str) -> None:
    """``ConfigError`` unless ``version`` (installed, or reported by a server's
    ``/server_info`` ``"version"``) is in ``TESTED``."""
    check_version("sglang", version, TESTED, INSTALL)


def require_sglang(*, check: bool = True) -> ModuleType:
    """The ``sglang`` module at a tested version (``check=False``: any version), or
    ``MissingExtraError`` naming the extra."""
    sglang = require_module("sglang", who="asyncflow_sglang.SGLangEngine", install=INSTALL)
    if check:
        check_sglang_version(str(getattr(sglang, "__version__", "0")))
    return sglang


SEEDS_IGNORED = (
    "this SGLang server ignores sampling_seed: it builds per-request seeds only with "
    "--enable-deterministic-inference (srt/sampling/sampling_batch_info.py, "
    "SamplingBatchInfo.from_schedule_batch); restart it with that flag, or send no seed"
)
"""Why a seeded request is refused by a server without ``--enable-deterministic-inference``."""


DETERMINISTIC_SEED = 42
"""The seed SGLang gives every request without ``sampling_seed`` when it runs with
``--enable-deterministic-inference`` (``srt/sampling/sampling_batch_info.py``,
``SamplingBatchInfo.from_schedule_batch``). Its seeded sampler is a pure function of seed and
position (``srt/layers/sampler.py``, ``multinomial_with_seed``), so every unseeded sample of
one prompt would be the same: the adapters send each unseeded request a seed of its own
(``request_seed``)."""


def request_seed(salt: bytes, request_id: str) -> int:
    """A seed for an unseeded request to a deterministic SGLang: a hash of the engine's
    random ``salt`` and the request id, so requests differ (the samples of one group, and the
    same request ids on two engines or in two runs) while a resumed request (same id, same
    engine) keeps its seed. 62 bits: SGLang holds seeds as int64."""
    digest = hashlib.blake2b(request_id.encode(), key=salt, digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2


STALE_SESSION = "a weight-update session is already open"
"""The start of SGLang's answer to ``begin_weight_update`` while a session is open
(``srt/managers/scheduler_components/weight_updater.py``, ``WeightUpdater.begin_weight_update``):
a trainer that died mid-sync leaves one open, and every later begin is refused until it is
ended. The adapters end it and begin once more (the sync that follows reloads every tensor,
so what the dead sync half-loaded is overwritten)."""


def data_parallel_refusal(who: str, dp_size: object) -> str | None:
    """Why an SGLang with ``dp_size`` > 1 cannot join a weight group, or None: every
    distributed-update route asserts ``dp_size == 1`` ("data-parallel replicas are not
    supported for update weights from distributed": ``srt/managers/
    tokenizer_control_mixin.py``, ``init_weights_update_group`` and
    ``update_weights_from_distributed``); no ``weight_group_ranks`` helps."""
    if dp_size in (None, 1):
        return None
    return (
        f"{who}: the server runs dp_size={dp_size!r}, and SGLang asserts dp_size == 1 on "
        "every distributed weight-update route (srt/managers/tokenizer_control_mixin.py): it "
        "cannot receive weights from the trainer's group. Start one server per replica "
        "(--dp-size 1, one SGLangHTTPEngine each), or reload weights from a checkpoint with "
        "update_weights_from_disk"
    )


NEUTRAL_SAMPLING: dict[str, Any] = {
    "stop": None,
    "stop_token_ids": None,
    "stop_regex": None,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "beam_width": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "ignore_eos": False,
    "logit_bias": None,
    "custom_params": None,
}
"""``SamplingParams`` fields (``srt/sampling/sampling_params.py``) that change which tokens are
drawn or their log-probs, with the value that leaves sampling as the protocol defines it. A
server's ``--preferred-sampling-params`` are merged under every request's own
(``srt/managers/tokenizer_manager.py``: ``{**preferred_sampling_params,
**obj.sampling_params}``), so the adapters send these values for the keys the server
prefers: a preferred repetition penalty would otherwise make SGLang's log-probs differ from
the trainer's."""

_HARMLESS_PREFERRED = frozenset(
    {
        "max_new_tokens",  # always sent
        "temperature",  # always sent
        "top_p",  # always sent
        "top_k",  # always sent
        "sampling_seed",  # sent by a deterministic server's adapter, ignored by others
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "stream_interval",
    }
)


def neutralizing(who: str, preferred: object) -> dict[str, Any]:
    """What every request must send to undo a server's ``--preferred-sampling-params``
    (``/model_info``'s ``"preferred_sampling_params"``: None, a dict, or its JSON text):
    ``NEUTRAL_SAMPLING``'s value for each preferred key. A key that is neither neutralised
    nor harmless raises ``ValueError`` naming it."""
    if preferred in (None, "", {}):
        return {}
    if isinstance(preferred, str):
        try:
            preferred = json.loads(preferred)
        except ValueError:
            raise ValueError(
                f"{who}: the server's preferred_sampling_params are not JSON: {preferred!r}"
            ) from None
    if not isinstance(preferred, dict):
        raise ValueError(
            f"{who}: the server's preferred_sampling_params are {preferred!r}, not an object"
        )
    unknown = sorted(
        k for k in preferred if k not in NEUTRAL_SAMPLING and k not in _HARMLESS_PREFERRED
    )
    if unknown:
        raise ValueError(
            f"{who}: the server runs --preferred-sampling-params with {unknown}, which SGLang "
            "merges into every request (srt/managers/tokenizer_manager.py) and the adapter "
            "cannot undo; restart it without them (or with only "
            f"{sorted(NEUTRAL_SAMPLING)})"
        )
    return {k: NEUTRAL_SAMPLING[k] for k in preferred if k in NEUTRAL_SAMPLING}


NO_TENSOR_LOADS = (
    "SGLang takes new weights over its weight group (update_weights_from_distributed) or from "
    "disk, not as tensors through load_weights"
)
"""Why SGLang engines refuse tensors in ``load_weights`` (``tensor_load_refusal``); the RL
job's default syncs then go through their own transport (``SGLangWeightSync``)."""


def same_group_settings(who: str, engines: Sequence[Any]) -> str | None:
    """Why one ``SGLangWeightSync`` cannot serve ``engines`` (their ``group_name`` or
    ``weight_backend`` differ), or None."""
    names = {getattr(e, "group_name", None) for e in engines}
    backends = {getattr(e, "weight_backend", None) for e in engines}
    if len(names) > 1 or len(backends) > 1:
        return (
            f"{who}: the engines join weight groups with different settings (group_name "
            f"{sorted(map(str, names))}, weight_backend {sorted(map(str, backends))}); one "
            "sync cannot serve them all: build them alike"
        )
    return None


STALE_GROUP = ("already been created", "already registered")
"""Parts of SGLang's answer to ``init_weights_update_group`` when a group of that name exists
in its workers ("Failed to initialize custom process group: The specified group name has
already been created, ...": torch's refusal, passed on by ``model_executor/
model_runner_components/weight_updater.py``, ``init_weights_update_group``): a trainer that
died left its group there. The adapters destroy it and join once more."""
