"""The Ascend wiring of the engine adapters, checked here without Ascend hardware, and the
``live_ascend`` suites that run on NPUs.

* DeepSpeed: the engine runs on the platform's DeepSpeed accelerator (``DS_ACCELERATOR``),
  refuses a mismatch naming both, and fails fast on ``platform="npu"`` without torch_npu,
  before DeepSpeed is touched.
* Live (``-m live_ascend``; skipped unless torch_npu loads with CANN and an NPU is visible):
  the ``TrainEngine`` conformance suite on DeepSpeed with ``DS_ACCELERATOR=npu`` and hccl, a
  bucketed broadcast over an hccl ``WeightSyncGroup`` between two NPUs, and the
  ``InferenceEngine`` suite on vLLM + vllm-ascend (``ASYNCFLOW_VLLM_MODEL``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from asyncflow_ascend import NPUPlatform
from asyncflow_conformance import InferenceEngineConformance, TrainEngineConformance
from asyncflow_reference.model import ModelConfig

import asyncflow_core.infra.platform as plat
from asyncflow_core.contracts.errors import ConfigError, PlatformUnavailableError
from asyncflow_core.infra.platform import register_platform

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
NPU_RUNS = NPUPlatform().is_available()
live_ascend = pytest.mark.skipif(
    not NPU_RUNS,
    reason=f"no usable Ascend NPU here: {NPUPlatform().unavailable_reason()}",
)


@pytest.fixture(autouse=True)
def registry() -> Iterator[None]:
    """Every test leaves the process's platform registry as it found it."""
    with plat.preserved_registry():
        yield


# --------------------------------------------------------------------------------------------
# DeepSpeed on the platform's accelerator
# --------------------------------------------------------------------------------------------
deepspeed_installed = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True).returncode,
    reason="the [deepspeed] extra is not installed",
)


@deepspeed_installed
@pytest.mark.skipif(NPU_RUNS, reason="torch_npu runs here")
def test_deepspeed_on_npu_without_torch_npu_fails_before_deepspeed_is_touched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from asyncflow_deepspeed import DeepSpeedTrainEngine

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    threads = {t.name for t in __import__("threading").enumerate()}
    with pytest.raises(PlatformUnavailableError, match=r"'npu' cannot run here.*asyncflow\[ascend"):
        DeepSpeedTrainEngine(CONFIG, platform="npu", name="npu-trainer")
    assert "DS_ACCELERATOR" not in os.environ
    # nothing was started (threads of earlier tests may end meanwhile: only new ones count)
    assert {t.name for t in __import__("threading").enumerate()} - threads == set()


@deepspeed_installed
def test_a_ds_accelerator_other_than_the_platforms_is_refused_naming_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from asyncflow_deepspeed import DeepSpeedTrainEngine

    monkeypatch.setenv("DS_ACCELERATOR", "npu")
    with pytest.raises(ConfigError, match=r"DS_ACCELERATOR='npu', but the platform is 'cpu'"):
        DeepSpeedTrainEngine(CONFIG, platform="cpu")
    assert os.environ["DS_ACCELERATOR"] == "npu"


class HostAsNPU(NPUPlatform):
    """The npu platform's attributes, reported available (its library is not loaded)."""

    def _probe(self) -> str | None:
        return None


@deepspeed_installed
def test_deepspeed_already_on_another_accelerator_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import deepspeed  # noqa: F401  (DeepSpeed chooses its accelerator, cpu here, at import)
    from asyncflow_deepspeed import DeepSpeedTrainEngine

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    register_platform(HostAsNPU, replace=True)
    with pytest.raises(ConfigError, match=r"already runs on accelerator 'cpu'.*DS_ACCELERATOR=npu"):
        DeepSpeedTrainEngine(CONFIG, platform="npu")


@deepspeed_installed
def test_in_a_fresh_process_the_engine_sets_ds_accelerator_from_the_platform() -> None:
    code = textwrap.dedent(
        """
        import os
        from asyncflow_deepspeed import DeepSpeedTrainEngine
        from asyncflow_reference.model import ModelConfig
        cfg = ModelConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=1, max_seq_len=8)
        engine = DeepSpeedTrainEngine(cfg, platform="cpu")
        import deepspeed.accelerator as acc
        print(os.environ["DS_ACCELERATOR"], acc.get_accelerator().device_name(),
              engine.platform.name, engine.device)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-4:] == ["cpu", "cpu", "cpu", "cpu"]


# --------------------------------------------------------------------------------------------
# Live on Ascend
# --------------------------------------------------------------------------------------------
@pytest.mark.live_ascend
@live_ascend
def test_live_npu_platform_reports_devices_and_memory() -> None:
    npu = NPUPlatform()
    npu.load()
    assert npu.device_count() >= 1
    stats = npu.memory_stats(0)
    assert stats.total_bytes and stats.free_bytes is not None and stats.device == "npu:0"
    x = torch.ones(1024, device=npu.device(0))
    npu.synchronize()
    assert float(x.sum().cpu()) == 1024.0


@pytest.mark.live_ascend
@live_ascend
class TestLiveDeepSpeedOnNPU(TrainEngineConformance):
    """The TrainEngine laws on DeepSpeed with DS_ACCELERATOR=npu and hccl (ZeRO-2)."""

    async def make_engine(self) -> Any:
        from asyncflow_deepspeed import DeepSpeedTrainEngine

        return DeepSpeedTrainEngine(CONFIG, platform="npu", zero_stage=2)

    async def close_engine(self, engine: Any) -> None:
        await engine.close()


RECEIVER = textwrap.dedent(
    """
    import asyncio, sys, torch
    from asyncflow_core.sync.transports import DistributedWeightReceiver, WeightSyncGroup

    class Target:
        async def load_weights(self, weights, version):
            for name, t in weights:
                torch.save(t.cpu(), f"{sys.argv[2]}/{name}.pt")

    async def main():
        with WeightSyncGroup("127.0.0.1", int(sys.argv[1]), 1, 2, backend="hccl") as group:
            print(await DistributedWeightReceiver(Target(), group=group).receive_one())

    asyncio.run(main())
    """
)


@pytest.mark.live_ascend
@live_ascend
def test_live_hccl_weight_sync_between_two_npus(tmp_path: Path) -> None:
    """The trainer on NPU 0 broadcasts buckets over an hccl ``WeightSyncGroup`` to a receiver
    process on NPU 1; the receiver's tensors equal the sender's byte for byte."""
    from asyncflow_core.engines.process import free_port
    from asyncflow_core.sync.transports import DistributedWeightSync, WeightSyncGroup, bucketize

    npu = NPUPlatform()
    if npu.device_count() < 2:
        pytest.skip("needs two NPUs")
    import asyncio

    port = free_port()
    env = {**os.environ, "ASCEND_RT_VISIBLE_DEVICES": "1"}
    child = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, str(port), str(tmp_path)], env=env, text=True,
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        npu.set_device(0)
        weights = [("w", torch.randn(1000, 64)), ("b", torch.arange(10, dtype=torch.int64))]
        on_npu = [(n, t.to(npu.device(0))) for n, t in weights]

        async def send() -> None:
            with WeightSyncGroup("127.0.0.1", port, 0, 2, backend="hccl") as group:
                sync = DistributedWeightSync(group=group)
                await sync.init()
                await sync.start()
                for bucket in bucketize(on_npu, 64 * 1024):
                    await sync.update(bucket)
                await sync.finish(5)

        asyncio.run(send())
        out, _ = child.communicate(timeout=300)
        assert child.returncode == 0 and out.strip().splitlines()[-1] == "5"
        for name, tensor in weights:
            assert torch.equal(torch.load(tmp_path / f"{name}.pt"), tensor)
    finally:
        child.kill()


LIVE_MODEL = os.environ.get("ASYNCFLOW_VLLM_MODEL")


@pytest.mark.live_ascend
@pytest.mark.skipif(
    not (NPU_RUNS and LIVE_MODEL),
    reason="live vLLM-on-Ascend test: needs a usable NPU (here: "
    f"{NPUPlatform().unavailable_reason() or 'yes'}), vllm 0.26.0 + vllm-ascend 0.26.0rc1 and "
    "ASYNCFLOW_VLLM_MODEL set to a model path",
)
class TestLiveVLLMOnAscend(InferenceEngineConformance):
    """The InferenceEngine laws on ``VLLMEngine.create(platform="npu")``: vllm-ascend's
    platform, the hccl weight-transfer backend, ``VLLM_ASCEND_ENABLE_NZ=0``."""

    long_max_tokens = 2048
    supports_seed_determinism = True
    timeout_s = 120.0
    real_timeout_s = 600.0

    async def make_engine(self) -> Any:
        from asyncflow_vllm import VLLMEngine

        return await VLLMEngine.create(
            str(LIVE_MODEL),
            platform="npu",
            enable_sleep_mode=True,
            gpu_memory_utilization=0.3,
            enforce_eager=True,
        )

    async def close_engine(self, engine: Any) -> None:
        await engine.close()
