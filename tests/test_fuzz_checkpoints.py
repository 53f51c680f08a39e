"""Fuzzing checkpoint folders (Hypothesis): the reference trainer's (``lmtrain``'s
``write_checkpoint`` files, which ``HFTrainEngine`` writes too) and the DeepSpeed trainer's.

Each example copies a genuine checkpoint and spoils it: a file cut short, bytes flipped, a
file deleted or added, tensors of other shapes, dtypes or values (NaN), an optimizer state
that does not fit, a manifest with another format tag, version, model or layout (for
DeepSpeed, edited as is, or re-signed with this user's key as if our own writer had written
it). Loading must either succeed or raise ``CheckpointError`` (``asyncflow_core.contracts.errors``;
``CheckpointRefusedError`` for DeepSpeed's unsigned changes), and a refused load leaves the
engine's weights and version as they were.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from asyncflow_conformance.engines import padded_batch
from asyncflow_reference.engines import TorchTrainEngine
from asyncflow_reference.model import ModelConfig
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from asyncflow_core.contracts.errors import CheckpointError
from asyncflow_core.engines.lmtrain import (
    CHECKPOINT_KEY_ENV,
    CHECKPOINT_META,
    CHECKPOINT_OPTIMIZER,
    CHECKPOINT_WEIGHTS,
    checkpoint_key,
    sign_manifest,
)
from asyncflow_core.training.rl import policy_gradient_loss

CONFIG = ModelConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_seq_len=8)
FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def batch() -> Any:
    return padded_batch(prompts=[[1, 2], [3]], responses=[[4, 5], [6, 7]], advantages=[1.0, -1.0])


async def weights(engine: Any) -> dict[str, torch.Tensor]:
    return {n: t for b in [b async for b in engine.export_weights(1 << 20)] for n, t in b}


class Loader:
    """An engine on its own event loop, with what it holds before each load."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.loop = asyncio.new_event_loop()
        self.engine = self.run(_made(make))
        self.outcomes: dict[str, int] = {}

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, 120))

    def state(self) -> tuple[int, dict[str, torch.Tensor]]:
        return self.engine.weight_version, self.run(weights(self.engine))

    def load(self, folder: Path, reset: Path) -> None:
        """Load ``folder``: refused, nothing changed; accepted, back to ``reset``."""
        version, before = self.state()
        try:
            self.run(self.engine.load_checkpoint(str(folder)))
        except CheckpointError as exc:
            kind = type(exc).__name__
            after_version, after = self.state()
            assert after_version == version, "a refused load changed the version"
            assert all(torch.equal(before[n], after[n]) for n in before), "weights changed"
        else:
            kind = "accepted"
            self.run(self.engine.load_checkpoint(str(reset)))
        event(kind)
        self.outcomes[kind] = self.outcomes.get(kind, 0) + 1

    def close(self) -> None:
        self.run(self.engine.close())
        self.loop.close()


async def _made(make: Callable[[], Any]) -> Any:
    return make()


# --- spoilers shared by both formats ---------------------------------------------------------
def files_of(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


@st.composite
def byte_damage(draw: st.DrawFn, folder: Path) -> Callable[[Path], None]:
    """Cut a file short, flip a byte of it, delete it, or add a stray file."""
    name = draw(st.sampled_from(files_of(folder)))
    how = draw(st.sampled_from(["truncate", "flip", "delete", "add", "empty"]))
    fraction = draw(st.floats(0.0, 0.999))

    def spoil(target: Path) -> None:
        path = target / name
        data = path.read_bytes()
        at = int(len(data) * fraction)
        if how == "truncate":
            path.write_bytes(data[:at])
        elif how == "flip" and data:
            path.write_bytes(data[:at] + bytes([data[at] ^ 0x5A]) + data[at + 1 :])
        elif how == "delete":
            path.unlink()
        elif how == "empty":
            path.write_bytes(b"")
        else:
            (path.parent / f"stray-{at}.pt").write_bytes(data[:at])

    event(f"bytes: {how}")
    return spoil


odd_values = st.sampled_from(
    [None, -1, 2**70, 1.5, math.nan, "x", "", [], {}, True, "asyncflow-torch-trainer/2"]
)


# --- lmtrain checkpoints ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def torch_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """A checkpoint after one step, and one of a fresh engine (the loader's own state)."""
    root = tmp_path_factory.mktemp("torch-ckpt")

    async def write() -> None:
        engine = TorchTrainEngine(CONFIG, lr=1e-2, threads=1)
        await engine.save_checkpoint(str(root / "fresh"))
        await engine.train_step(batch(), policy_gradient_loss)
        await engine.save_checkpoint(str(root / "trained"))
        await engine.close()

    asyncio.run(write())
    yield root / "trained", root / "fresh"


@pytest.fixture(scope="module")
def torch_loader() -> Iterator[Loader]:
    loader = Loader(lambda: TorchTrainEngine(CONFIG, lr=1e-2, threads=1))
    yield loader
    loader.close()


@st.composite
def torch_damage(draw: st.DrawFn, folder: Path) -> Callable[[Path], None]:
    """Byte damage, or content that parses but does not fit: meta fields, tensors, state."""
    kind = draw(st.sampled_from(["bytes", "meta", "tensors", "optimizer"]))
    if kind == "bytes":
        return draw(byte_damage(folder))
    event(f"content: {kind}")
    meta = json.loads((folder / CHECKPOINT_META).read_text())
    if kind == "meta":
        key = draw(st.sampled_from(["format", "version", "model_config", "optimizer", "extra"]))
        value = draw(
            odd_values
            | st.just({**meta["model_config"], "d_model": 16})
            | st.just({**meta["model_config"], "vocab_size": -3})
            | st.just({**meta["model_config"], "n_heads": "2"})
            | st.just({"bogus": 1})
            | st.integers(0, 5)
        )

        def spoil_meta(target: Path) -> None:
            (target / CHECKPOINT_META).write_text(json.dumps({**meta, key: value}))

        return spoil_meta
    if kind == "tensors":
        tensors = safetensors.torch.load_file(str(folder / CHECKPOINT_WEIGHTS))
        name = draw(st.sampled_from(sorted(tensors)))
        how = draw(st.sampled_from(["shape", "dtype", "nan", "missing", "extra", "inf"]))
        t = tensors[name]
        if how == "shape":
            tensors[name] = torch.zeros(t.numel() + 1)
        elif how == "dtype":
            tensors[name] = t.to(torch.float64)
        elif how in ("nan", "inf"):
            t = t.clone()
            t.view(-1)[0] = math.nan if how == "nan" else math.inf
            tensors[name] = t
        elif how == "missing":
            del tensors[name]
        else:
            tensors["not.a.parameter"] = t.clone()

        def spoil_tensors(target: Path) -> None:
            safetensors.torch.save_file(tensors, str(target / CHECKPOINT_WEIGHTS))

        return spoil_tensors
    state = torch.load(folder / CHECKPOINT_OPTIMIZER, weights_only=True)
    how = draw(st.sampled_from(["shape", "nan", "groups", "params", "unknown", "type", "junk"]))
    pid = draw(st.sampled_from(sorted(state["state"])))
    if how == "shape":
        state["state"][pid]["exp_avg"] = torch.zeros(3, 3, 3)
    elif how == "nan":
        state["state"][pid]["exp_avg_sq"] = torch.full_like(
            state["state"][pid]["exp_avg_sq"], math.nan
        )
    elif how == "groups":
        state["param_groups"] = state["param_groups"] * 2
    elif how == "params":
        state["param_groups"][0]["params"] = state["param_groups"][0]["params"][:-1]
    elif how == "unknown":
        state["state"][10_000] = state["state"][pid]
    elif how == "type":
        state["state"][pid]["exp_avg"] = [1.0, 2.0]
    else:
        state = draw(st.sampled_from([[1, 2], {"state": 1}, {"param_groups": "x", "state": {}}]))

    def spoil_optimizer(target: Path) -> None:
        torch.save(state, target / CHECKPOINT_OPTIMIZER)

    return spoil_optimizer


def test_torch_trainer_checkpoints(
    torch_checkpoints: tuple[Path, Path], torch_loader: Loader, tmp_path: Path
) -> None:
    trained, fresh = torch_checkpoints

    @settings(FUZZ, max_examples=120)
    @given(spoil=torch_damage(trained))
    def one(spoil: Callable[[Path], None]) -> None:
        target = tmp_path / "case"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(trained, target)
        spoil(target)
        torch_loader.load(target, fresh)

    one()
    assert torch_loader.outcomes.get("CheckpointError", 0) > 0, torch_loader.outcomes
    torch_loader.run(torch_loader.engine.load_checkpoint(str(trained)))  # the genuine one loads
    assert torch_loader.engine.weight_version == 1


# --- DeepSpeed checkpoints -------------------------------------------------------------------
@pytest.fixture(scope="module")
def deepspeed_rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Loader, Path, Path]]:
    pytest.importorskip("deepspeed", reason="the [deepspeed] extra is not installed")
    from asyncflow_deepspeed import DeepSpeedTrainEngine

    mp = pytest.MonkeyPatch()
    mp.delenv(CHECKPOINT_KEY_ENV, raising=False)
    mp.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("xdg")))
    root = tmp_path_factory.mktemp("ds-ckpt")
    loader = Loader(lambda: DeepSpeedTrainEngine(CONFIG, zero_stage=1, lr=1e-2, threads=1))
    writer = Loader(lambda: DeepSpeedTrainEngine(CONFIG, zero_stage=1, lr=1e-2, threads=1))
    loader.run(loader.engine.save_checkpoint(str(root / "fresh")))
    writer.run(writer.engine.train_step(batch(), policy_gradient_loss))
    writer.run(writer.engine.save_checkpoint(str(root / "trained")))
    writer.close()
    yield loader, root / "trained", root / "fresh"
    loader.close()
    mp.undo()


@st.composite
def deepspeed_damage(draw: st.DrawFn, folder: Path) -> Callable[[Path], None]:
    """Byte damage (refused as unsigned), or the manifest edited, signed or not."""
    if draw(st.booleans()):
        return draw(byte_damage(folder))
    meta = json.loads((folder / "asyncflow.json").read_text())
    key = draw(st.sampled_from(["format", "version", "zero_stage", "dtype", "world_size",
                                "shapes", "files", "hmac_sha256", "extra"]))  # fmt: skip
    value = draw(
        odd_values
        | st.just({n: [1, *s] for n, s in meta["shapes"].items()})
        | st.just("asyncflow-deepspeed-trainer/2")
        | st.integers(0, 3)
        | st.sampled_from(["fp32", "bf16"])
    )
    signed = key not in ("files", "hmac_sha256") and draw(st.booleans())
    event(f"manifest: {key}, {'re-signed' if signed else 'as is'}")

    def spoil(target: Path) -> None:
        edited = {**meta, key: value}
        if signed:  # as if our own writer had written it
            body = {k: v for k, v in edited.items() if k not in ("files", "hmac_sha256")}
            (target / "asyncflow.json").unlink()
            key_bytes = checkpoint_key(who="test", create=False)
            assert key_bytes is not None
            edited = sign_manifest(target, body, key_bytes, manifest="asyncflow.json")
        (target / "asyncflow.json").write_text(json.dumps(edited))

    return spoil


def test_deepspeed_checkpoints(deepspeed_rig: tuple[Loader, Path, Path], tmp_path: Path) -> None:
    loader, trained, fresh = deepspeed_rig

    @settings(FUZZ, max_examples=60)
    @given(spoil=deepspeed_damage(trained))
    def one(spoil: Callable[[Path], None]) -> None:
        target = tmp_path / "case"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(trained, target)
        spoil(target)
        loader.load(target, fresh)

    one()
    refused = loader.outcomes.get("CheckpointRefusedError", 0)
    assert refused > 0 and loader.outcomes.get("CheckpointError", 0) > 0, loader.outcomes
    loader.run(loader.engine.load_checkpoint(str(trained)))
    assert loader.engine.weight_version == 1
