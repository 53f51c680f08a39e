"""Direct weight sync on Ray (``asyncflow_ray.weightsync.RayDirectWeightSync``): the trainer's
actor sends its weights to the rollout actors over a gloo group of their own, the driver never
pulling a bucket (its export is made to fail here); staged weights stay out of the engines
until ``apply``; the group is reused, rebuilt over the engines left when one is taken out,
and a rollout actor killed between syncs does not stop the next one."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray", reason="the Ray runtime needs the [ray] extra (ray 2.60)")

from asyncflow_conformance.engines import padded_batch, same_bytes  # noqa: E402
from asyncflow_ray.engines import RayInferenceEngine, RayTrainEngine  # noqa: E402
from asyncflow_ray.weightsync import RayDirectWeightSync  # noqa: E402
from asyncflow_reference.engines import TorchInferenceEngine, TorchTrainEngine  # noqa: E402
from asyncflow_reference.model import ModelConfig  # noqa: E402

from asyncflow_core.contracts.protocols import GenerationRequest, SamplingParams  # noqa: E402
from asyncflow_core.training.rl import policy_gradient_loss  # noqa: E402

MODEL = ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, max_seq_len=64)
TRAINER = functools.partial(TorchTrainEngine, MODEL, seed=1, threads=1)
ROLLOUT = functools.partial(TorchInferenceEngine, MODEL, max_batch=8, seed=0, threads=1)
DEVICES = 0.5


pytestmark = pytest.mark.usefixtures("module_by_value")  # its functions run in actors


def weights(engine: Any) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in engine.model.state_dict().items()}


async def holds(rollout: RayInferenceEngine, source: dict[str, torch.Tensor]) -> bool:
    held = await rollout.run(weights)
    return all(same_bytes(held[n], t) for n, t in source.items())


async def step(trainer: RayTrainEngine) -> dict[str, torch.Tensor]:
    batch = padded_batch([[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10]], [1.0, -1.0])
    await trainer.train_step(batch, policy_gradient_loss)
    source: dict[str, torch.Tensor] = await trainer.run(weights)
    return source


def test_direct_sync_stages_then_applies_without_the_driver_holding_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_export(self: Any, bucket_bytes: int) -> Any:
        raise AssertionError("the driver pulled the trainer's weights")

    monkeypatch.setattr(RayTrainEngine, "export_weights", no_export)

    async def body() -> None:
        trainer, r0, r1 = await asyncio.gather(
            RayTrainEngine.create_async(TRAINER, devices=DEVICES, name="ws-trainer"),
            RayInferenceEngine.create_async(ROLLOUT, devices=DEVICES, name="ws-rollout-0"),
            RayInferenceEngine.create_async(ROLLOUT, devices=DEVICES, name="ws-rollout-1"),
        )
        try:
            direct = RayDirectWeightSync(trainer, [r0, r1], bucket_bytes=16 << 10)
            source = await step(trainer)
            assert not await holds(r0, source), "the rollouts hold the trainer's weights already"
            await direct.sync(None, 1)
            assert direct.pending_version == 1 and direct.groups_built == 1
            # staged, not applied: the engines still generate with their own weights
            assert (r0.weight_version, r1.weight_version) == (0, 0)
            assert not await holds(r0, source)
            timing = await direct.apply()
            assert timing is not None and timing.version == 1 and direct.pending_version is None
            for r in (r0, r1):
                assert r.weight_version == 1 and await holds(r, source)
                req = GenerationRequest(f"after-{r.name}", (1, 2), SamplingParams(max_tokens=3))
                assert set((await r.generate(req)).versions) == {1}
            assert await direct.apply() is None  # nothing staged

            source = await step(trainer)  # the group is reused
            await direct.sync(None, 2)
            await direct.apply()
            assert direct.groups_built == 1
            assert all([await holds(r, source) for r in (r0, r1)])

            direct.engines = [r0]  # r1 taken out (as RLJob does with a lost engine): rebuilt
            source = await step(trainer)
            await direct.sync(None, 3)
            await direct.apply()
            assert direct.groups_built == 2
            assert r0.weight_version == 3 and await holds(r0, source)
            assert await r1.refresh_version() == 2  # left out

            direct.engines = [r0, r1]  # both again; then r1's actor dies between syncs
            await direct.sync(None, 3)
            await direct.apply()
            ray.kill(r1.handle)
            source = await step(trainer)
            await direct.sync(None, 4)  # r1 is found dead before the send: rebuilt over r0
            await direct.apply()
            assert direct.engines == [r0] and r0.weight_version == 4
            assert await holds(r0, source)
            await direct.close()
        finally:
            for engine in (trainer, r0, r1):
                await engine.close()

    asyncio.run(body())


def test_dropping_lost_engines_survives_the_job_taking_one_out_meanwhile() -> None:
    """Found in a fresh CI run (a rollout actor killed while the job verified a sync): the job
    takes a lost engine out of the sync (``engines = ...``) while ``_drop_lost`` is asking
    the actors whether they live; the answers are matched with the engines asked (no
    ``zip(strict=True)`` error) and the dead one is dropped."""
    from asyncflow_core.contracts.errors import EngineLostError

    release = asyncio.Event()
    asked: list[str] = []
    all_asked = asyncio.Event()

    class Stub:
        def __init__(self, name: str, dead: bool) -> None:
            self.name, self.dead = name, dead

        async def refresh_version(self) -> int:
            asked.append(self.name)
            if len(asked) == 3:
                all_asked.set()
            await release.wait()
            if self.dead:
                raise EngineLostError(f"{self.name} is gone")
            return 0

    async def main() -> None:
        live, dead, other = Stub("r0", False), Stub("r1", True), Stub("r2", False)
        sync = object.__new__(RayDirectWeightSync)
        sync._engines = [live, dead, other]  # type: ignore[list-item]
        asking = asyncio.ensure_future(sync._drop_lost())
        await all_asked.wait()  # the actors are being asked
        sync.engines = [live, dead]  # the job took r2 out meanwhile
        release.set()
        assert await asking is True
        assert sync.engines == [live]

    asyncio.run(main())
