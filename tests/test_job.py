"""The main job (`asyncflow run`): config handling, the run folder and its summary, on a few
steps of the real reference engines."""

from __future__ import annotations

import asyncio
import io
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from asyncflow_reference.workloads import ReferenceRunConfig, TaskSection

from asyncflow_core.cli import main as cli_main
from asyncflow_core.contracts.errors import ConfigError, PlatformError, PlatformUnavailableError
from asyncflow_core.contracts.protocols import TrainMetrics
from asyncflow_core.flow.config import apply_override
from asyncflow_core.flow.rlflow import StepRecord
from asyncflow_core.infra.platform import CpuPlatform, register_platform
from asyncflow_core.job import RLSection, RunConfig, StepProgress, load_run_config, run

QUICK = [
    "rl.steps=4", "rl.prompts_per_step=4", "rl.n=4", "task.warmup_steps=2", "eval_prompts=8",
]  # fmt: skip

SUMMARY_KEYS = {
    "mode", "staleness", "steps", "samples", "tokens", "wall_s", "samples_per_s",
    "reward_first", "reward_last", "bubble_ratio", "staleness_hist", "sync_exposed_s",
    "sync_hidden_s",
}  # fmt: skip


def _run_cli(tmp_path: Path, *extra: str) -> tuple[int, dict[str, object]]:
    out = tmp_path / "run"
    args = ["run", "--out", str(out), "--quiet"]
    for item in [*QUICK, *extra]:
        args += ["--set", item]
    code = cli_main(args)
    return code, json.loads((out / "summary.json").read_text())


def test_run_writes_the_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, summary = _run_cli(tmp_path)
    assert code == 0
    out = tmp_path / "run"
    for name in ("config.toml", "metrics.jsonl", "trace.json", "summary.json"):
        assert (out / name).stat().st_size > 0, name
    assert set(summary) >= SUMMARY_KEYS
    assert summary["mode"] == "async" and summary["staleness"] == 1 and summary["steps"] == 4
    assert summary["samples"] == 4 * 16
    for key in ("reward_first", "reward_last", "eval_reward"):
        value = summary[key]
        assert isinstance(value, float) and 0.0 <= value <= 1.0, key
    assert {"rollout", "trainer"} <= set(summary["bubble_ratio"])  # type: ignore[arg-type]
    hist = summary["staleness_hist"]
    assert isinstance(hist, dict) and sum(hist.values()) == 4 * 16
    assert set(hist) <= {"0", "1"}  # η = 1: never staler than one version
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]
    # rl.verify_sync = "first": the first sync was proven, on the rollout engine in its process
    (verified,) = summary["extra"]["sync_verified"]  # type: ignore[index]
    assert verified["version"] == 1 and verified["kind"] in ("fingerprint", "probe")
    assert verified["checked"] > 0
    # the written config reproduces the run's config
    again = load_run_config(out / "config.toml")
    assert again.rl.steps == 4 and again.task.warmup_steps == 2
    printed = capsys.readouterr().out
    assert "reward first → last 10%" in printed and "run folder:" in printed


def test_colocated_mode_runs_on_one_resource(tmp_path: Path) -> None:
    code, summary = _run_cli(tmp_path, "rl.mode=colocated", "train.loss=pg")
    assert code == 0
    assert summary["mode"] == "colocated" and summary["staleness"] == 0
    assert "devices" in summary["bubble_ratio"]  # type: ignore[operator]
    assert summary["staleness_hist"] == {"0": 4 * 16}


def test_decoupled_ppo_gets_proximal_logprobs(tmp_path: Path) -> None:
    code, summary = _run_cli(tmp_path, "train.loss=decoupled-ppo", "rl.staleness=2")
    assert code == 0 and summary["loss"] == "decoupled-ppo"
    assert math.isfinite(float(summary["reward_last"]))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rl.mode=sync", "rl.mode must be one of 'async', 'colocated', got 'sync'"),
        ("train.loss=sft", "train.loss must be one of 'pg', 'ppo', 'decoupled-ppo'"),
        ("rl.stalenes=2", "unknown key 'rl.stalenes' (did you mean 'rl.staleness'?)"),
        (
            "task.name=mul",
            "task.name must be one of 'reverse', 'sort', 'add', 'clock', 'lookup', got 'mul'",
        ),
        ("task.digits=9", "task digits must be in 1..8, got 9"),
        ("rl.sync_every=3", "raise staleness to >= 2 or lower sync_every"),
        ("rollout.temperature=0", "rollout.temperature must be > 0"),
        ("train.minibatches=0", "train.minibatches must be an int >= 1, got 0"),
    ],
)
def test_bad_config_is_a_clear_error_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], override: str, message: str
) -> None:
    code = cli_main(["run", "--out", str(tmp_path / "x"), "--set", override])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # nothing was written
    with pytest.raises(ConfigError):
        load_run_config(None, [override]).validate()


def test_keys_lists_every_setting(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["run", "--keys"]) == 0
    out = capsys.readouterr().out
    for key in ("rl.staleness = 1", "train.loss = 'ppo'", "task.name = 'reverse'", "seed = 0"):
        assert key in out


def test_config_file_and_set_compose(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[rl]\nstaleness = 3\n[train]\nloss = "decoupled-ppo"\n')
    cfg = load_run_config(path, ["rl.staleness=2"])
    assert cfg.rl.staleness == 2 and cfg.train.loss == "decoupled-ppo"
    assert cfg.rl_config().proximal_logprobs


def test_asyncflow_run_help_as_a_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "asyncflow_core.cli", "run", "--help"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and "--set KEY=VALUE" in done.stdout


def test_trainer_in_its_own_process_learns_like_the_in_process_one() -> None:
    """``train.process = true`` hosts the trainer in a child process (``auto``, the default,
    does so for this trainer): same job, same figures as ``false``, one process."""
    cfg = ReferenceRunConfig(
        eval_prompts=0, task=TaskSection(warmup_steps=5),
        rl=RLSection(steps=4, prompts_per_step=4, n=4, mode="colocated", staleness=0),
    )  # fmt: skip
    assert cfg.train_process() and not apply_override(cfg, "train.process=false").train_process()
    here = asyncio.run(run(apply_override(cfg, "train.process=false"))).result.steps
    there = asyncio.run(run(apply_override(cfg, "train.process=true"))).result.steps
    assert [s.metrics.loss for s in there] == [s.metrics.loss for s in here]
    assert [s.reward_mean for s in there] == [s.reward_mean for s in here]


@pytest.mark.slow
def test_the_deepspeed_trainer_learns_like_the_reference_one() -> None:
    """``train.engine = "deepspeed"`` (ZeRO-0, fp32, in this process) runs the main job end to
    end with the same micro-batching, AdamW and clipping as the reference trainer: in
    colocated mode (deterministic) the per-step losses and rewards agree to rounding."""
    pytest.importorskip("deepspeed", reason="the [deepspeed] extra is not installed")
    cfg = ReferenceRunConfig(
        eval_prompts=0, task=TaskSection(warmup_steps=5),
        rl=RLSection(steps=4, prompts_per_step=4, n=4, mode="colocated", staleness=0),
    )  # fmt: skip
    here = asyncio.run(run(cfg))
    there = asyncio.run(run(apply_override(cfg, "train.engine=deepspeed")))
    assert there.summary.trainer == "deepspeed ZeRO-0 fp32, thread"
    assert there.summary.platform == here.summary.platform == "cpu"
    for a, b in zip(there.result.steps, here.result.steps, strict=True):
        assert a.metrics.loss == pytest.approx(b.metrics.loss, rel=1e-4, abs=1e-6)
        assert a.reward_mean == pytest.approx(b.reward_mean, abs=0.07)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("train.zero_stage=2", "apply to train.engine = 'deepspeed'"),
        ("train.ranks=0", "train.ranks must be >= 1"),
        ("train.kl_coef=0.1", "needs a reference policy, which the main job does not run"),
    ],
)
def test_bad_trainer_choices_are_refused(override: str, match: str) -> None:
    cfg = RunConfig()
    if override.startswith("train.ranks"):
        cfg = apply_override(cfg, "train.engine=deepspeed")
    with pytest.raises(ConfigError, match=match):
        apply_override(cfg, override).validate()


@pytest.mark.skipif(
    __import__("asyncflow_ascend").NPUPlatform().is_available(), reason="torch_npu runs here"
)
def test_platform_npu_without_torch_npu_fails_fast_and_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's bar: ``platform = "npu"`` on a machine without torch_npu stops before the
    run starts (exit 2, nothing written) with one message naming the extra and CANN."""
    for extra in ([], ["--set", "train.engine=deepspeed"]):
        code = cli_main(["run", "--out", str(tmp_path / "x"), "--set", "platform=npu", *extra])
        err = capsys.readouterr().err
        assert code == 2 and not (tmp_path / "x").exists()
        assert "platform 'npu' cannot run here: torch_npu is not installed" in err
        assert "asyncflow[ascend]" in err and "CANN" in err
    with pytest.raises(PlatformUnavailableError):
        load_run_config(None, ["platform=npu"]).validate()


def test_a_named_accelerator_needs_a_trainer_that_uses_it() -> None:
    class Lab(CpuPlatform):  # an "accelerator" that runs anywhere
        name = "lab-accel"

    import asyncflow_core.infra.platform as plat

    with plat.preserved_registry():
        register_platform(Lab)
        with pytest.raises(ConfigError, match=r"platform = 'lab-accel' applies to train\.engine"):
            apply_override(RunConfig(), "platform=lab-accel").validate()
        ds = apply_override(RunConfig(), "train.engine=deepspeed")
        ds = apply_override(ds, "platform=lab-accel")
        assert ds.trainer_platform().name == "lab-accel"
        assert RunConfig().trainer_platform().name == "cpu"
        with pytest.raises(PlatformError, match="unknown platform 'gpu'"):
            apply_override(RunConfig(), "platform=gpu").validate()


# --- progress output --------------------------------------------------------------------------
class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def step_record(step: int, end_s: float) -> StepRecord:
    metrics = TrainMetrics(step, 0.5, 1.0, 16, 100)
    return StepRecord(step, end_s, 16, 100, 0, metrics, reward_mean=0.25)


PROGRESS_LINE = re.compile(
    r"RL step (\d+)/(\d+)  reward (\d\.\d{3})  samples/s (\d+)  elapsed (\d+\.\d) s"
)


def test_progress_off_a_terminal_is_a_plain_line_every_10_s_and_the_last_step() -> None:
    """Steps every 0.5 s of the run for 50 s: a line at 10, 20, 30, 40 and 50 s (the last step);
    no carriage returns. Time is the records' ``end_s``, so no real clock is involved."""
    out = io.StringIO()
    progress = StepProgress(100, out)
    for step in range(1, 101):
        progress(step_record(step, end_s=0.5 * step))
    progress.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    parsed = [PROGRESS_LINE.fullmatch(line) for line in lines]
    assert all(parsed), lines
    steps = [int(m.group(1)) for m in parsed if m]
    assert steps == [20, 40, 60, 80, 100]
    assert lines[-1] == "RL step 100/100  reward 0.250  samples/s 32  elapsed 50.0 s"


def test_progress_off_a_terminal_prints_the_last_step_of_a_short_run() -> None:
    out = io.StringIO()
    progress = StepProgress(3, out)
    for step in (1, 2, 3):
        progress(step_record(step, end_s=0.1 * step))
    assert out.getvalue().splitlines() == [
        "RL step 3/3  reward 0.250  samples/s 160  elapsed 0.3 s"
    ]


def test_progress_on_a_terminal_is_a_live_bar() -> None:
    tty = FakeTerminal()
    progress = StepProgress(5, tty)
    for step in range(1, 6):
        progress(step_record(step, end_s=float(step)))
    progress.close()
    text = tty.getvalue()
    assert "\r" in text and "5/5" in text and "reward=0.250" in text
    assert not PROGRESS_LINE.search(text)


def test_quiet_progress_prints_nothing() -> None:
    for stream in (io.StringIO(), FakeTerminal()):
        progress = StepProgress(2, stream, quiet=True)
        progress(step_record(1, 20.0))
        progress(step_record(2, 40.0))
        progress.close()
        assert stream.getvalue() == ""
    with pytest.raises(ConfigError, match="every_s must be > 0"):
        StepProgress(2, io.StringIO(), every_s=0)


def test_asyncflow_run_into_a_log_writes_plain_progress_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under pytest stderr is no terminal, as under CI or nohup: the run's progress is lines."""
    args = ["run", "--out", str(tmp_path / "run")]
    for item in QUICK:
        args += ["--set", item]
    assert cli_main(args) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [m for m in map(PROGRESS_LINE.fullmatch, err.splitlines()) if m]
    assert lines and lines[-1].group(1, 2) == ("4", "4")
