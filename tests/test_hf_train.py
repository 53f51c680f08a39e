"""``asyncflow_hf.HFTrainEngine`` on random-init tiny Qwen2 (tied embeddings) and Llama
(untied), on the CPU, never the hub.

* The ``TrainEngine`` conformance suite on both, in fp32; the parameters it must export are
  the ones transformers' own ``save_pretrained`` writes (an oracle not written by us).
* Log-probs equal transformers' own forward + log-softmax of each row alone (so padding
  changes nothing), also when the model ignores ``logits_to_keep``.
* bf16 (fp32 master weights, autocast forward) runs and stays close to fp32; gradient
  checkpointing recomputes each layer and gives the same step.
* Tied weights exported once, untied both; ``save_pretrained`` -> ``from_pretrained`` gives
  the trained weights (still tied), the tokenizer and the generation config.
* Checkpoints resume the optimizer in another engine; one of another model, or unreadable,
  is refused and changes nothing.
* Every bad constructor argument raises ``ConfigError`` naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import tempfile
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
import safetensors
import torch
from asyncflow_conformance import TrainEngineConformance
from asyncflow_conformance.engines import padded_batch

from asyncflow_core.contracts.errors import ConfigError, EngineError
from asyncflow_core.contracts.protocols import Batch, SamplingParams, TrainEngine
from asyncflow_core.training.rl import policy_gradient_loss
from asyncflow_core.training.sampling import sampling_columns

transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from asyncflow_hf import load_causal_lm, tiny_config  # noqa: E402
from asyncflow_hf.train import HFTrainEngine  # noqa: E402

VOCAB = 64
ARCHS = ("tiny-qwen2", "tiny-llama")


@functools.cache
def base_model(arch: str) -> Any:
    """The random-init model every engine of ``arch`` copies (built once: building is the
    slow part)."""
    return load_causal_lm(tiny_config(arch, vocab_size=VOCAB), who="test", seed=0)


@functools.cache
def saved_by_transformers(arch: str) -> dict[str, list[int]]:
    """Names and shapes of the tensors transformers' ``save_pretrained`` writes for ``arch``
    (a tied LM head is not among them)."""
    with tempfile.TemporaryDirectory() as tmp:
        base_model(arch).save_pretrained(tmp)
        with safetensors.safe_open(str(Path(tmp) / "model.safetensors"), "pt") as f:
            return {n: list(f.get_slice(n).get_shape()) for n in f.keys()}  # noqa: SIM118


def engine(arch: str = "tiny-qwen2", **kwargs: Any) -> HFTrainEngine:
    options: dict[str, Any] = {"lr": 1e-2, "micro_batch_size": 2, "threads": 1}
    return HFTrainEngine(base_model(arch), **{**options, **kwargs})


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@contextlib.asynccontextmanager
async def closing(*trainers: HFTrainEngine) -> AsyncIterator[Any]:
    """The trainers (one, or a tuple of several), closed on the way out."""
    try:
        yield trainers[0] if len(trainers) == 1 else trainers
    finally:
        for trainer in trainers:
            await trainer.close()


PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11], [12]]
RESPONSES = [[13, 14, 15, 16], [17], [18, 19, 20], [21, 22]]


def batch(advantages: tuple[float, ...] = (1.0, -1.0, 0.5, -0.5)) -> Batch:
    return padded_batch(prompts=PROMPTS, responses=RESPONSES, advantages=list(advantages))


async def weights(trainer: TrainEngine) -> dict[str, torch.Tensor]:
    return {n: t for b in [b async for b in trainer.export_weights(1 << 30)] for n, t in b}


# --------------------------------------------------------------------------------------------
# Conformance
# --------------------------------------------------------------------------------------------
class _HFSuite(TrainEngineConformance):
    arch: ClassVar[str]
    vocab_size = VOCAB
    required_fields = ("prompt", "response", "advantage")
    logprob_atol = 0.0  # the same weights and batch give the same log-probs, bit for bit
    real_timeout_s = 120.0

    def make_engine(self) -> TrainEngine:
        return engine(self.arch)

    def close_engine(self, engine: Any) -> Any:
        return engine.close()

    def expected_parameters(self, engine: Any) -> Mapping[str, list[int]]:
        return saved_by_transformers(self.arch)

    def make_other_engine(self) -> TrainEngine:
        # the other architecture: Qwen2 has q/k/v biases, Llama none, so neither checkpoint fits
        return engine("tiny-llama" if self.arch == "tiny-qwen2" else "tiny-qwen2")


class TestQwen2Conformance(_HFSuite):
    arch = "tiny-qwen2"


class TestLlamaConformance(_HFSuite):
    arch = "tiny-llama"


# --------------------------------------------------------------------------------------------
# Log-probs
# --------------------------------------------------------------------------------------------
def transformers_logprobs(model: Any, prompt: list[int], response: list[int], temp: float) -> Any:
    """transformers' own forward of one unpadded row, log-softmax at ``temp``, read at the
    response tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].double()
    logp = torch.log_softmax(logits / temp, dim=-1)
    return torch.stack([logp[len(prompt) - 1 + k, tok] for k, tok in enumerate(response)])


@pytest.mark.parametrize("arch", ARCHS)
def test_compute_logprobs_is_transformers_forward_and_padding_free(arch: str) -> None:
    temps = (1.0, 0.7, 1.0, 1.3)
    rows = padded_batch(prompts=PROMPTS, responses=RESPONSES, advantages=[0.0] * 4)
    columns = sampling_columns([SamplingParams(temperature=t) for t in temps])
    rows = Batch(
        rows.rows,
        {**rows.data, **{k: torch.stack(v) for k, v in columns.items()}},
        rows.lengths,
    )

    async def main() -> None:
        # all four rows padded into one forward
        async with closing(engine(arch, micro_batch_size=4)) as trainer:
            together = await trainer.compute_logprobs(rows)
            assert together.shape == (4, max(map(len, RESPONSES)))
            assert together.dtype == torch.float32
            for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
                oracle = transformers_logprobs(base_model(arch), p, r, temps[i])
                got = together[i, : len(r)].double()
                assert torch.allclose(got, oracle, atol=2e-5, rtol=0), (i, got, oracle)
                assert bool((together[i, len(r) :] == 0).all())
                alone = await trainer.compute_logprobs(rows.slice(i, i + 1))
                assert torch.allclose(alone[0, : len(r)], together[i, : len(r)], atol=1e-5)
            # a model that ignores logits_to_keep: the engine picks the positions itself
            trainer._keeps_logits = False
            assert torch.allclose(await trainer.compute_logprobs(rows), together, atol=1e-6)

    run(main())


@pytest.mark.parametrize("arch", ARCHS)
def test_a_response_padded_to_the_sequence_length_keeps_its_logprobs(arch: str) -> None:
    """A response tensor padded wider than its rows (a micro-batch sliced from a wider batch)
    can make the kept logits [b, r, V] the shape of all of them [b, t, V]; they were then
    gathered a second time, from the wrong positions (found by the conformance suite's
    loss-mask law, issue #42)."""
    tight = padded_batch(prompts=[[1, 2, 3], [4, 5]], responses=[[11], [15]], advantages=[0, 0])
    wide = padded_batch([[1, 2, 3], [4, 5]], [[11, 12, 13, 14], [15]], advantages=[0, 0])
    wide = Batch(wide.rows, dict(wide.data), {**wide.lengths, "response": torch.tensor([1, 1])})

    async def main() -> None:
        async with closing(engine(arch, micro_batch_size=4)) as trainer:
            want = await trainer.compute_logprobs(tight)
            got = await trainer.compute_logprobs(wide)
            assert got.shape == (2, 4)  # r == t == 4: the shape that was ambiguous
            assert torch.allclose(got[:, :1], want, atol=1e-6), (got, want)

    run(main())


def test_rows_the_model_cannot_read_are_refused() -> None:
    config = tiny_config("tiny-llama", vocab_size=VOCAB)
    config.max_position_embeddings = 8
    short = load_causal_lm(config, who="test")

    async def main() -> None:
        async with closing(HFTrainEngine(short, threads=1)) as trainer:
            too_long = padded_batch(prompts=[[1] * 6], responses=[[2] * 3], advantages=[1.0])
            with pytest.raises(EngineError, match="9 tokens > max_seq_len=8"):
                await trainer.compute_logprobs(too_long)
            off_vocab = padded_batch(prompts=[[1]], responses=[[VOCAB]], advantages=[1.0])
            with pytest.raises(EngineError, match=rf"response\[0, 0\]={VOCAB} is not a token"):
                await trainer.train_step(off_vocab, policy_gradient_loss)
            assert trainer.weight_version == 0

    run(main())


# --------------------------------------------------------------------------------------------
# Precision and gradient checkpointing
# --------------------------------------------------------------------------------------------
def test_bf16_keeps_fp32_master_weights_and_stays_close_to_fp32() -> None:
    async def main() -> None:
        async with closing(engine(), engine(dtype="bf16")) as (full, mixed):
            a, b = await full.compute_logprobs(batch()), await mixed.compute_logprobs(batch())
            assert a.dtype == b.dtype == torch.float32
            gap = float((a - b).abs().max())
            assert 0 < gap < 2e-2, gap  # bf16 arithmetic: not identical, but close
            fm = await full.train_step(batch(), policy_gradient_loss)
            mm = await mixed.train_step(batch(), policy_gradient_loss)
            assert math.isclose(fm.loss, mm.loss, rel_tol=2e-2)
            assert math.isclose(fm.grad_norm, mm.grad_norm, rel_tol=2e-2)
            assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
            moments = mixed._optimizer.state_dict()["state"].values()
            assert moments and all(s["exp_avg"].dtype == torch.float32 for s in moments)
            exported = await weights(mixed)
            assert all(t.dtype == torch.float32 for t in exported.values())

    run(main())


@pytest.mark.parametrize("arch", ARCHS)
def test_gradient_checkpointing_recomputes_layers_and_gives_the_same_step(arch: str) -> None:
    def forwards_of(trainer: HFTrainEngine) -> list[int]:
        """A counter of forwards through layer 0's attention: a checkpointed layer's replay
        runs what is inside it (its own hooks stay outside) up to the last tensor the
        backward needs, past the attention."""
        count = [0]
        attention = trainer.model.model.layers[0].self_attn
        attention.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
        return count

    async def main() -> None:
        plain, checkpointed = engine(arch), engine(arch, gradient_checkpointing=True)
        async with closing(plain, checkpointed):
            plain_calls, checkpointed_calls = forwards_of(plain), forwards_of(checkpointed)
            a = await plain.train_step(batch(), policy_gradient_loss)
            b = await checkpointed.train_step(batch(), policy_gradient_loss)
            micro_batches = 2  # 4 rows, micro_batch_size 2
            assert plain_calls == [micro_batches]
            assert checkpointed_calls == [2 * micro_batches]  # forward, and again in backward
            assert math.isclose(a.loss, b.loss, rel_tol=1e-6)
            assert math.isclose(a.grad_norm, b.grad_norm, rel_tol=1e-5)
            wa, wb = await weights(plain), await weights(checkpointed)
            assert all(torch.allclose(wa[n], wb[n], atol=1e-6) for n in wa)
            # compute_logprobs runs no backward: nothing is recomputed
            await checkpointed.compute_logprobs(batch())
            assert checkpointed_calls == [3 * micro_batches]

    run(main())


# --------------------------------------------------------------------------------------------
# Weights out: export and save_pretrained
# --------------------------------------------------------------------------------------------
def test_tied_embedding_exported_once_untied_head_exported() -> None:
    async def main() -> None:
        async with closing(engine("tiny-qwen2"), engine("tiny-llama")) as (tied, untied):
            tw, uw = await weights(tied), await weights(untied)
            assert "model.embed_tokens.weight" in tw and "lm_head.weight" not in tw
            assert tied.model.lm_head.weight is tied.model.model.embed_tokens.weight
            assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(uw)
            assert not torch.equal(uw["model.embed_tokens.weight"], uw["lm_head.weight"])
            assert "model.layers.0.self_attn.q_proj.weight" in tw

    run(main())


def tiny_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="w0", eos_token="w1"
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_save_pretrained_loads_back_with_from_pretrained(arch: str, tmp_path: Path) -> None:
    async def main() -> None:
        async with closing(engine(arch)) as trainer:
            await trainer.train_step(batch(), policy_gradient_loss)
            trained = await weights(trainer)
            await trainer.save_pretrained(
                tmp_path / "policy",
                tokenizer=tiny_tokenizer(),
                generation_config={"max_new_tokens": 7, "eos_token_id": 1},
            )
        folder = tmp_path / "policy"
        assert not list(folder.glob("*.bin")) and list(folder.glob("*.safetensors"))
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
        state = loaded.state_dict()
        for name, tensor in trained.items():
            assert torch.equal(state[name], tensor), name
        if arch == "tiny-qwen2":
            assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
            assert "lm_head.weight" not in trained
        else:
            assert torch.equal(state["lm_head.weight"], trained["lm_head.weight"])
        # (AutoTokenizer would not do here: for a qwen2 folder transformers 5.24 builds a
        # Qwen2Tokenizer, whose byte-level pre-tokenizer replaces this word-level one's)
        tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
        assert tokenizer("w5 w9")["input_ids"] == [5, 9]
        generation = json.loads((folder / "generation_config.json").read_text())
        assert generation["max_new_tokens"] == 7

    run(main())


def test_save_pretrained_refuses_bad_arguments(tmp_path: Path) -> None:
    async def main() -> None:
        async with closing(engine()) as trainer:
            with pytest.raises(ConfigError, match="tokenizer must have save_pretrained"):
                await trainer.save_pretrained(tmp_path / "a", tokenizer=object())
            with pytest.raises(ConfigError, match="generation_config must be"):
                await trainer.save_pretrained(tmp_path / "a", generation_config=3)
            assert not (tmp_path / "a").exists()

    run(main())


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------
def test_checkpoint_resumes_the_optimizer_in_another_engine(tmp_path: Path) -> None:
    async def main() -> None:
        other_init = HFTrainEngine(
            tiny_config("tiny-llama", vocab_size=VOCAB), seed=5, lr=1e-2, micro_batch_size=2
        )
        async with closing(engine("tiny-llama"), other_init) as (first, other_init):
            await first.train_step(batch(), policy_gradient_loss)
            await first.save_checkpoint(str(tmp_path / "ckpt"))
            flipped = batch((-1.0, 1.0, -0.5, 0.5))
            expected = await first.train_step(flipped, policy_gradient_loss)
            assert not torch.equal(
                (await weights(other_init))["lm_head.weight"],
                (await weights(first))["lm_head.weight"],
            )
            await other_init.load_checkpoint(str(tmp_path / "ckpt"))
            assert other_init.weight_version == 1
            resumed = await other_init.train_step(flipped, policy_gradient_loss)
            assert (resumed.loss, resumed.grad_norm, resumed.version) == (
                expected.loss,
                expected.grad_norm,
                expected.version,
            )
            a, b = await weights(first), await weights(other_init)
            assert all(torch.equal(a[n], b[n]) for n in a)

    run(main())


def test_checkpoint_of_another_model_or_unreadable_is_refused(tmp_path: Path) -> None:
    config = tiny_config("tiny-qwen2", vocab_size=VOCAB)
    config.intermediate_size = 96

    async def main() -> None:
        async with closing(engine("tiny-qwen2"), HFTrainEngine(config, threads=1)) as (
            trainer,
            other,
        ):
            await trainer.train_step(batch(), policy_gradient_loss)
            before = await weights(trainer)
            moments = {
                k: v["exp_avg"].clone() for k, v in trainer._optimizer.state_dict()["state"].items()
            }
            await other.save_checkpoint(str(tmp_path / "other"))
            differ = r"another model .*intermediate_size: checkpoint 96, this model 128"
            with pytest.raises(EngineError, match=differ):
                await trainer.load_checkpoint(str(tmp_path / "other"))
            damage = [
                ("optimizer.pt", b"not a torch file"),
                ("optimizer.pt", b""),
                ("trainer.json", b"{"),
                ("model.safetensors", b"\x08" + bytes(7)),  # a header longer than the file
            ]
            for i, (file, junk) in enumerate(damage):
                await trainer.save_checkpoint(str(tmp_path / f"mine{i}"))
                (tmp_path / f"mine{i}" / file).write_bytes(junk)
                with pytest.raises(EngineError, match="is not readable"):
                    await trainer.load_checkpoint(str(tmp_path / f"mine{i}"))
            with pytest.raises(EngineError, match="is not readable"):
                await trainer.load_checkpoint(str(tmp_path / "never-saved"))
            assert trainer.weight_version == 1
            after = await weights(trainer)
            assert all(torch.equal(before[n], after[n]) for n in before)
            state = trainer._optimizer.state_dict()["state"]
            assert all(torch.equal(state[k]["exp_avg"], v) for k, v in moments.items())

    run(main())


def test_a_checkpoint_loads_into_the_same_model_read_from_a_folder(tmp_path: Path) -> None:
    """Fields saying where a model came from (``_name_or_path``) do not make it another."""

    async def main() -> None:
        async with closing(engine("tiny-qwen2")) as trainer:
            await trainer.train_step(batch(), policy_gradient_loss)
            await trainer.save_checkpoint(str(tmp_path / "ckpt"))
            await trainer.save_pretrained(tmp_path / "folder")
            expected = await weights(trainer)
        async with closing(HFTrainEngine(str(tmp_path / "folder"), threads=1)) as from_folder:
            assert from_folder.model.config._name_or_path == str(tmp_path / "folder")
            await from_folder.load_checkpoint(str(tmp_path / "ckpt"))
            got = await weights(from_folder)
            assert all(torch.equal(got[n], expected[n]) for n in expected)

    run(main())


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------
BAD_ARGS = [
    ("lr", 0.0),
    ("lr", float("nan")),
    ("betas", (0.9, 1.0)),
    ("weight_decay", -0.1),
    ("max_grad_norm", 0),
    ("micro_batch_size", 0),
    ("micro_batch_size", 2.0),
    ("temperature", 0.0),
    ("dtype", "fp16"),
    ("gradient_checkpointing", "yes"),
    ("seed", -1),
    ("trust_remote_code", 1),
    ("threads", 0),
    ("name", ""),
]


@pytest.mark.parametrize(("field", "value"), BAD_ARGS, ids=[f"{f}={v!r}" for f, v in BAD_ARGS])
def test_bad_arguments_raise_config_error_naming_them(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=rf"\b{field} must be"):
        HFTrainEngine(base_model("tiny-qwen2"), **{field: value})


def test_bad_models_raise_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model must be a PreTrainedModel"):
        HFTrainEngine(42)
    with pytest.raises(ConfigError, match="does not exist"):
        HFTrainEngine(str(tmp_path / "nowhere"))


def test_calls_after_close_raise_engine_error() -> None:
    async def main() -> None:
        trainer = engine()
        await trainer.close()
        with pytest.raises(EngineError, match="after close"):
            await trainer.compute_logprobs(batch())

    run(main())
