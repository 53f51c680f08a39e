"""The pair suite (asyncflow_conformance.pair) on engine pairs that must agree: the reference
engines (untied and tied embeddings, trainer in this process and in a child process), and the
tests' tiny bigram pair."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from asyncflow_conformance import EnginePairConformance
from asyncflow_reference.engines import TorchInferenceEngine, TorchTrainEngine
from asyncflow_reference.model import ModelConfig
from test_engine_conformance import VOCAB, TinyInferenceEngine, TinyTrainEngine, tiny_weights

from asyncflow_core.engines.process import ProcessTrainEngine

# Peaky enough (init_std 0.5) that temperature and the filters change the log-probs a lot:
# a distribution close to uniform would hide a semantics bug below the tolerance.
PAIR_MODEL = ModelConfig(
    vocab_size=24, d_model=32, n_layers=2, n_heads=2, max_seq_len=64, init_std=0.5
)
TIED_MODEL = ModelConfig(
    vocab_size=24, d_model=32, n_layers=1, n_heads=2, max_seq_len=64, init_std=0.5,
    tie_embeddings=True,
)  # fmt: skip


class TestTorchPair(EnginePairConformance):
    vocab_size = PAIR_MODEL.vocab_size
    real_timeout_s = 120.0

    def make_inference(self) -> TorchInferenceEngine:
        return TorchInferenceEngine(PAIR_MODEL, max_batch=16, seed=0)

    def make_trainer(self) -> TorchTrainEngine:
        return TorchTrainEngine(PAIR_MODEL, seed=1, micro_batch_size=5, lr=1e-2)

    async def close_engine(self, engine: Any) -> None:
        await engine.close()


class TestTorchPairTied(TestTorchPair):
    vocab_size = TIED_MODEL.vocab_size

    def make_inference(self) -> TorchInferenceEngine:
        return TorchInferenceEngine(TIED_MODEL, max_batch=16, seed=0)

    def make_trainer(self) -> TorchTrainEngine:
        return TorchTrainEngine(TIED_MODEL, seed=1, micro_batch_size=5, lr=1e-2)


class TestProcessTrainerPair(TestTorchPair):
    """The reference trainer in a child process: the loss runs there."""

    pair_settings = TestTorchPair.pair_settings[-1:]
    real_timeout_s = 180.0

    def make_trainer(self) -> ProcessTrainEngine:
        return ProcessTrainEngine(
            functools.partial(TorchTrainEngine, PAIR_MODEL, seed=1, lr=1e-2, threads=1)
        )


class TestTinyPair(EnginePairConformance):
    vocab_size = VOCAB

    def make_inference(self) -> TinyInferenceEngine:
        return TinyInferenceEngine(tiny_weights(0), token_s=0.0)

    def make_trainer(self) -> TinyTrainEngine:
        return TinyTrainEngine(tiny_weights(1))

    def prompt_tokens(self, index: int) -> Sequence[int]:
        return tuple(1 + (3 * index + k) % (VOCAB - 1) for k in range(index + 1))


README = Path(__file__).resolve().parent.parent / "conformance" / "README.md"


def test_the_readme_pair_snippet_passes_from_outside(tmp_path: Path) -> None:
    """The conformance README's pair snippet runs as written, every law passing."""
    text = README.read_text()
    start = text.index("## Test an inference engine and its trainer together")
    snippet = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert snippet is not None
    path = tmp_path / "test_pair_snippet.py"
    path.write_text(snippet.group(1))
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "asyncflow_conformance", "-p", "no:cacheprovider",
         "-q", str(path)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    laws = len(EnginePairConformance.pair_settings) + 4  # + resume, loss, verified, in-flight
    assert proc.returncode == 0 and f"{laws} passed" in out, out[-3000:]


class KeepsStaleKVAtALoad(TorchInferenceEngine):
    """Mutant (issue #42): an in-flight load copies the weights in but keeps the running
    sequences' KV cache of the old weights, so their next tokens, labelled with the new
    version, come from a mixed state."""

    def _apply_weights(self, staged: Any, version: int) -> None:
        refill = self._refill.clone()
        super()._apply_weights(staged, version)
        self._refill.copy_(refill)


def test_the_inflight_pair_law_fails_a_stale_kv_cache_and_passes_its_fix() -> None:
    class Stale(TestTorchPair):
        def make_inference(self) -> TorchInferenceEngine:
            return KeepsStaleKVAtALoad(PAIR_MODEL, max_batch=16, seed=0)

    with pytest.raises(AssertionError, match=r"while .* requests were generating"):
        Stale().test_logprobs_agree_across_an_inflight_load()
    TestTorchPair().test_logprobs_agree_across_an_inflight_load()  # the same engine, refilled
