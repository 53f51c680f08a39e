"""Which SGLang this adapter is written and tested against, and the errors when it is missing
or another version is installed (or served)."""

from __future__ import annotations

from types import ModuleType

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
