"""What the Ascend platform needs, and how to say so when it is missing.

``torch_npu`` is Huawei's PyTorch extension for Ascend NPUs (``import torch_npu`` adds
``torch.npu``, the ``npu`` device and the ``hccl`` collective backend); it loads the CANN
toolkit's shared libraries (``libhccl.so``, ``libascendcl.so``, ...) at import, so an
installed ``torch_npu`` without CANN fails to import. Its release must match torch's
(torch-npu 2.13.x for torch 2.13.x).
"""

from __future__ import annotations

import re

CANN = (
    "install Ascend's CANN toolkit (with the NPU driver) and load it in this shell: "
    "source /usr/local/Ascend/ascend-toolkit/set_env.sh (or your install's set_env.sh)"
)
INSTALL = (
    "pip install 'asyncflow[ascend]' with the torch-npu release matching your torch "
    "(torch-npu 2.13.x for torch 2.13.x), on a machine with Ascend NPUs; torch_npu needs "
    f"CANN: {CANN}"
)
_CANN_LIBS = ("libhccl", "libascend", "libacl", "libge_runner", "libgraph", "libruntime")

VLLM_ASCEND = ("0.26.0rc1", "0.27")
"""The vllm-ascend releases the vLLM adapter's NPU wiring follows: 0.26.0rc1, which runs vLLM
0.26.0 with torch 2.10.0 and torch-npu 2.10.0.post4 (its own pins). Later lines (0.27.1rc1 to
0.30.0rc2) were release candidates only on PyPI in 2026-11, and are not followed yet."""


def release(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a torch / torch-npu version string (``2.13.0+cpu``,
    ``2.10.0.post4``), or ``None`` when it is not one."""
    m = re.match(r"^(\d+)\.(\d+)", version.strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


def explain_load_failure(error: str) -> str:
    """The reason a ``torch_npu`` import failed: CANN's libraries when one is named."""
    if any(lib in error for lib in _CANN_LIBS):
        return f"{error}: the CANN toolkit's libraries are not loadable here"
    return error


def check_release(torch_version: str, npu_version: str) -> str | None:
    """Why this torch-npu cannot run with this torch, or ``None`` when their releases match."""
    t, n = release(torch_version), release(npu_version)
    if t is None or n is None or t == n:
        return None
    return (
        f"torch-npu {npu_version} is built for torch {n[0]}.{n[1]}, but torch {torch_version} "
        f"is installed; install torch-npu {t[0]}.{t[1]}.x (or the torch torch-npu was built "
        "for)"
    )
