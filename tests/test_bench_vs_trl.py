"""Smoke test of the peer benchmark: ``benchmarks/vs_trl.py --quick`` (a tiny model, a few
steps of each framework) runs to the end and its last stdout line is one JSON object with the
headline keys. Skipped when TRL (the ``bench-trl`` extra) is not installed.

The figures themselves are measured by the benchmark (docs/vs-trl.md), never asserted here."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "vs_trl.py"
REQUIRED = ("samples_per_s_ratio", "time_to_threshold_ratio", "reward_asyncflow", "reward_trl")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("trl") is None or importlib.util.find_spec("transformers") is None,
    reason="trl is not installed: the peer benchmark needs the bench-trl extra "
    "(pip install 'trl>=1.16,<1.17' 'torch==2.13.0')",
)


@pytest.mark.slow
def test_vs_trl_quick_emits_json(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path / "out")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, f"benchmark failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = proc.stdout.strip().splitlines()
    assert lines, "benchmark printed nothing"
    result = json.loads(lines[-1])
    for key in REQUIRED:
        assert key in result, f"missing {key!r} in {sorted(result)}"
        value = result[key]
        assert isinstance(value, int | float) and not isinstance(value, bool), f"{key} = {value!r}"
        assert math.isfinite(value) and value >= 0, f"{key} = {value!r}"
    assert result["samples_per_s_ratio"] > 0
    frameworks = result["frameworks"]
    assert set(frameworks) == {"trl", "af_async", "af_colocated"}
    for name, row in frameworks.items():
        assert row["samples_per_s"] > 0, name
    config = result["config"]
    steps = config["steps"]
    batch = config["prompts"] * config["n"]
    for name, counts in result["response_length_histogram"].items():
        if name != "edges":  # every framework scored at least the samples it trained on
            assert sum(counts) >= steps * batch, (name, counts)
    assert (tmp_path / "out" / "results.json").is_file()


# --------------------------------------------------------------------------------------------
# --task reverse: the default `asyncflow run` against TRL on the main job's own task
# --------------------------------------------------------------------------------------------
def _reverse_module() -> Any:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import vs_trl_reverse
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return vs_trl_reverse


def test_wrapped_reference_model_gives_the_reference_logits_and_logprobs() -> None:
    import torch
    from asyncflow_reference.model import ModelConfig, TransformerLM
    from trl.trainer.utils import add_fused_lm_head

    v = _reverse_module()
    lm = TransformerLM(ModelConfig(vocab_size=14, max_seq_len=9, init_std=0.1), seed=7)
    model = v.wrap(lm)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 14, (6, 9), generator=gen)
    mask = torch.ones_like(tokens)
    mask[2, 6:] = 0  # right padding: the real positions are unchanged
    with torch.no_grad():
        want = lm(tokens)
        got = model(input_ids=tokens, attention_mask=mask).logits
        assert torch.equal(got, want)
        assert torch.equal(model(input_ids=tokens, logits_to_keep=4).logits, want[:, -4:])
        # the per-token log-probs TRL's GRPOTrainer computes (its fused LM head) are the
        # reference model's log-softmax at the next token
        add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
        labels = tokens.clone()
        labels[:, :5] = -100
        fused = model(input_ids=tokens, attention_mask=mask, labels=labels, fused_lm_head=True)
        ref = torch.log_softmax(want[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    lp = fused.log_probs
    assert lp.shape == ref.shape
    assert torch.allclose(lp[:, 4:], ref[:, 4:], atol=1e-5), (lp[:, 4:] - ref[:, 4:]).abs().max()
    # and the wrapper shares the reference model's tensors (TRL trains the very weights)
    assert model.get_output_embeddings().weight is lm.lm_head.weight


def test_wrapped_model_refuses_left_padding_and_generates_after_the_prompt() -> None:
    import torch
    from asyncflow_reference.model import ModelConfig, TransformerLM

    v = _reverse_module()
    lm = TransformerLM(ModelConfig(vocab_size=14, max_seq_len=9), seed=1)
    model = v.wrap(lm)
    tokens = torch.tensor([[10, 1, 2, 3, 11], [12, 10, 4, 5, 11]])
    left = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="left padding"):
        model(input_ids=tokens, attention_mask=left)
    out = model.generate(
        input_ids=tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=4,
        do_sample=True, top_k=0, use_cache=False, pad_token_id=12, eos_token_id=12,
    )  # fmt: skip
    assert torch.equal(out[:, :5], tokens)
    assert out.shape[1] <= 9


@pytest.mark.parametrize("name", ["reverse", "sort", "add"])
def test_digits_tokenizer_round_trips_the_task_prompts(name: str) -> None:
    from asyncflow_reference.tasks import VOCAB, DigitTask

    v = _reverse_module()
    tok = v.digits_tokenizer()
    assert [tok.convert_ids_to_tokens(i) for i in range(len(VOCAB))] == list(VOCAB)
    assert tok.eos_token_id == VOCAB.index("<eos>") and tok.bos_token_id == VOCAB.index("<bos>")
    task = DigitTask(name, 3)  # type: ignore[arg-type]
    stream = task.prompts(0)
    for _ in range(50):
        prompt = next(stream)
        text = task.render(prompt)
        assert tok(text)["input_ids"] == list(prompt), text
        assert tok.decode(list(prompt)) == text
        answer = (*task.answer(prompt), VOCAB.index("<eos>"))
        assert tok(task.render(answer))["input_ids"] == list(answer)


def test_reverse_sizes_override_only_what_they_name() -> None:
    from asyncflow_reference.workloads import ReferenceRunConfig

    from asyncflow_core.contracts.errors import ConfigError

    v = _reverse_module()
    assert v.ReverseSizes().sets() == []
    assert v.ReverseSizes().run_config() == ReferenceRunConfig()  # the main job's defaults
    cfg = v.ReverseSizes(steps=7).run_config()
    assert cfg.rl.steps == 7 and cfg.rl.n == ReferenceRunConfig().rl.n
    with pytest.raises(ConfigError, match=r"\bn must be an int"):
        v.ReverseSizes(n=0).run_config()


@pytest.mark.slow
def test_vs_trl_reverse_quick_emits_json(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--task", "reverse", "--quick", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, f"benchmark failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    row = result["default_vs_trl_reverse"]
    for key in ("samples_per_s_ratio", "samples_per_s_asyncflow", "samples_per_s_trl"):
        assert isinstance(row[key], float) and math.isfinite(row[key]) and row[key] > 0, key
    for key in ("reward_asyncflow", "reward_trl"):
        assert 0.0 <= row[key] <= 1.0, key
    quick = row["config"]
    for side in ("trl-2t", "af_default"):
        runs = row["sides"][side]["runs"]
        assert [r["steps"] for r in runs] == [quick["steps"]], side
        # both sides trained every step's samples, from the one warmed-up model
        assert runs[0]["samples"] == quick["steps"] * quick["prompts_per_step"] * quick["n"]
        assert runs[0]["start_sha256"] == row["warm"]["sha256"]
    assert row["sides"]["trl-2t"]["runs"][0]["profile"]["first_batch_prompt_ids_equal_main_job"]
    assert (tmp_path / "reverse" / "results.json").is_file()
