"""The main job on Hugging Face models, data and rewards (``workload = "hf"``): a local model
folder or a tiny config, a local dataset file, a reward named ``module:function``; the policy
leaves the run folder as ``save_pretrained`` output; bad inputs fail before anything is
written; a reward failing on some rows fails only them."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from asyncflow_hf.assets import make_model_folder, write_gsm8k_jsonl
from asyncflow_hf.models import load_causal_lm

from asyncflow_core.cli import main as cli_main
from asyncflow_core.contracts.errors import ConfigError
from asyncflow_core.job import RunConfig, load_run_config, run

SMALL = [
    "rl.steps=2", "rl.prompts_per_step=2", "rl.n=4", "eval_prompts=8", "task.warmup_steps=2",
    "task.warmup_batch=8", "train.micro_batch_size=8", "rollout.max_batch=16",
    "data.max_tokens=6",
]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_folder(tmp_path_factory.mktemp("hf") / "model", model="tiny-qwen2", seed=0)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gsm8k_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", 120, seed=1)


def config(*sets: str) -> RunConfig:
    return load_run_config(None, [*SMALL, *sets])


def run_cli(out: Path, *sets: str) -> int:
    args = ["run", "--quiet", "--out", str(out)]
    for item in (*SMALL, *sets):
        args += ["--set", item]
    return cli_main(args)


def test_a_model_folder_trains_on_a_data_file_and_leaves_a_loadable_policy(
    tmp_path: Path, model_dir: Path, data_file: Path
) -> None:
    import asyncio

    out = tmp_path / "run"
    output = asyncio.run(run(config(f"model.path={model_dir}", f"data.path={data_file}"), out))
    s = output.summary
    assert s.steps == 2 and s.samples == 16 and s.task == f"model on {data_file.name}"
    assert s.eval_reward is not None and 0.0 <= s.eval_reward <= 1.0
    policy = out / "policy"
    assert s.extra["policy"] == str(policy) and s.extra["reward_failed"] == 0
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (policy / name).is_file(), name
    assert not (out / "data.jsonl").exists()  # a user's file is not copied
    trained = transformers.AutoModelForCausalLM.from_pretrained(str(policy))
    start = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))
    moved = [
        n for n, p in trained.state_dict().items() if not torch.equal(p, start.state_dict()[n])
    ]
    assert moved, "the saved policy equals the initial model: nothing was trained"
    tok = transformers.AutoTokenizer.from_pretrained(str(policy))
    assert tok.chat_template and tok.eos_token_id == trained.generation_config.eos_token_id


def test_a_tiny_config_with_the_shipped_data_and_a_user_reward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``model.name`` + no data file: the shipped problems, generated into the run folder; a
    reward from a user module, async, receiving the decoded completion and the whole row."""
    module = tmp_path / "my_rewards.py"
    module.write_text(
        textwrap.dedent(
            """
            seen = []

            async def length_bonus(completion, row):
                seen.append((completion, dict(row)))
                return min(len(completion), 10) / 10
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    assert run_cli(out, "model.name=tiny-llama", "reward=my_rewards:length_bonus") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["extra"]["reward_failed"] == 0
    rows = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    assert len(rows) > 1000 and {"question", "answer"} <= set(rows[0])
    import my_rewards  # type: ignore[import-not-found]

    assert my_rewards.seen and all("answer" in row for _, row in my_rewards.seen)
    assert all(isinstance(c, str) for c, _ in my_rewards.seen)


def test_a_reward_failing_on_some_rows_fails_only_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "flaky_reward.py").write_text(
        textwrap.dedent(
            """
            import itertools
            calls = itertools.count()

            def every_third_raises(completion, row):
                if next(calls) % 3 == 0:
                    raise ValueError("cannot score this one")
                return 1.0
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    assert run_cli(out, "model.name=tiny-qwen2", "reward=flaky_reward:every_third_raises") == 0
    summary = json.loads((out / "summary.json").read_text())
    failed = summary["extra"]["reward_failed"]
    assert failed >= 16 // 3
    errors = [json.loads(x) for x in (out / "reward_errors.jsonl").read_text().splitlines()]
    assert errors and "ValueError: cannot score this one" in errors[0]["error"]
    assert "flaky_reward" in errors[0]["error"]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "reward_failed" in m]
    assert steps and all(m["reward_mean"] == 1.0 for m in steps)  # the failed rows left out


@pytest.mark.parametrize("bad", ["raises", "not-a-number"])
def test_a_reward_failing_on_every_row_stops_the_run_and_writes_nothing(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    bad: str,
) -> None:
    (tmp_path / "broken_reward.py").write_text(
        textwrap.dedent(
            """
            def raises(completion, row):
                raise KeyError("solution")

            def not_a_number(completion, row):
                return "ten"
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    fn = bad.replace("-", "_")
    assert run_cli(out, "model.name=tiny-qwen2", f"reward=broken_reward:{fn}") == 1
    err = capsys.readouterr().err
    assert "the reward failed on every one of the first 8 rows" in err
    assert ("KeyError" in err) if bad == "raises" else ("'ten'" in err)
    assert not out.exists()


def _no_tokenizer(model_dir: Path, tmp: Path) -> Path:
    bare = tmp / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (bare / name).write_bytes((model_dir / name).read_bytes())
    return bare


def _bad_field(data_file: Path, tmp: Path) -> Path:
    rows = [json.loads(x) for x in data_file.read_text().splitlines()]
    path = tmp / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": r["question"], **r}) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no-tokenizer", "has no tokenizer transformers can load"),
        ("missing-field", "no field 'problem'"),
        ("both-models", "exactly one of model.path"),
        ("no-such-reward", "my_missing_rewards"),
        ("no-data-file", "does not exist"),
        ("data-without-model", "needs exactly one of model.path"),
        ("digits-with-data", "(read as ReferenceRunConfig, the keys of workload = 'digits'"),
        ("pickle-only-folder", "has no *.safetensors weights"),
    ],
)
def test_bad_inputs_fail_clearly_and_write_nothing(
    tmp_path: Path,
    model_dir: Path,
    data_file: Path,
    capsys: pytest.CaptureFixture[str],
    case: str,
    message: str,
) -> None:
    sets: dict[str, list[str]] = {
        "no-tokenizer": [f"model.path={_no_tokenizer(model_dir, tmp_path)}"],
        "missing-field": [
            f"model.path={model_dir}",
            f"data.path={data_file}",
            "data.prompt_field=problem",
        ],
        "both-models": [f"model.path={model_dir}", "model.name=tiny-qwen2"],
        "no-such-reward": ["model.name=tiny-qwen2", "reward=my_missing_rewards:score"],
        "no-data-file": ["model.name=tiny-qwen2", f"data.path={tmp_path / 'nope.jsonl'}"],
        "data-without-model": [f"data.path={data_file}"],  # data.* picks hf, which needs a model
        "digits-with-data": ["workload=digits", f"data.path={data_file}"],
        "pickle-only-folder": [f"model.path={_pickled(model_dir, tmp_path)}"],
    }
    out = tmp_path / "run"
    assert run_cli(out, *sets[case]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not out.exists()


def _pickled(model_dir: Path, tmp: Path) -> Path:
    folder = tmp / "pickled"
    folder.mkdir()
    (folder / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    torch.save({}, folder / "pytorch_model.bin")
    return folder


def test_the_missing_field_error_lists_the_columns(model_dir: Path, data_file: Path) -> None:
    from asyncflow_core.job import make_workload

    cfg = config(f"model.path={model_dir}", f"data.path={data_file}", "data.prompt_field=q")
    with pytest.raises(ConfigError, match=r"\['question', 'answer'\]"):
        make_workload(cfg)


def test_engines_refuse_a_model_they_cannot_serve() -> None:
    from asyncflow_core.engines import registry

    cfg: Any = config("model.name=tiny-qwen2")
    with pytest.raises(ConfigError, match=r"rollout\.engine = 'torch' serves the reference"):
        registry.get("rollout", "torch")(
            load_causal_lm("tiny-qwen2", who="test"), cfg=cfg, index=0, threads=1
        )
    with pytest.raises(ConfigError, match=r"rollout\.engine = 'nope' is not a registered"):
        config("rollout.engine=nope").validate()


def test_deepspeed_trains_an_hf_model_in_the_main_job(tmp_path: Path) -> None:
    """``train.engine=deepspeed`` on an HF model: DeepSpeed trains it, and the policy is
    saved from its exported weights (tied embeddings stay tied)."""
    out = tmp_path / "run"
    assert run_cli(out, "model.name=tiny-qwen2", "train.engine=deepspeed") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trainer"].startswith("deepspeed ZeRO-0")
    policy = transformers.AutoModelForCausalLM.from_pretrained(str(out / "policy"))
    assert policy.lm_head.weight is policy.model.embed_tokens.weight


def test_settings_that_depend_on_each_other_come_in_any_order() -> None:
    """``--set`` overrides are each checked in their section, and the whole config once at
    the end: a data key before the model key that makes the workload 'hf' is fine."""
    early = load_run_config(None, ["data.max_tokens=6", "model.name=tiny-qwen2"])
    late = load_run_config(None, ["model.name=tiny-qwen2", "data.max_tokens=6"])
    assert early == late and early.workload_name() == "hf"
    with pytest.raises(ConfigError, match=r"needs exactly one of model\.path"):
        load_run_config(None, ["data.max_tokens=6"])  # a data key picks hf
    with pytest.raises(ConfigError, match="the hf workload runs on 'local' so far"):
        load_run_config(None, ["model.name=tiny-qwen2", "runtime.kind=ray"])
