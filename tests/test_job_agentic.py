"""The agentic tasks in the main job (`asyncflow run --set task=clock`): they run end to end on
the reference engines, the summary reports turns, tool calls and the evaluations, and the
config is checked. Whether the task *learns* is measured by `benchmarks/agentic_job.py`
(README)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncflow_core.cli import main as cli_main
from asyncflow_core.contracts.errors import ConfigError
from asyncflow_core.job import load_run_config

QUICK = [
    "task=clock", "rl.steps=3", "rl.prompts_per_step=4", "rl.n=4", "task.warmup_steps=2",
    "eval_prompts=8",
]  # fmt: skip


def test_the_clock_task_runs_as_a_multi_turn_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    args = ["run", "--out", str(out), "--quiet"]
    for item in QUICK:
        args += ["--set", item]
    assert cli_main(args) == 0
    printed = capsys.readouterr().out
    for row in ("turns / tool calls per traj", "greedy eval before RL", "after, tools off"):
        assert row in printed, printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "clock" and summary["steps"] == 3
    agent = summary["extra"]["agent"]
    assert set(agent) == {"turns", "tool_calls", "tool_errors", "restarts"}
    assert all(1.0 <= t <= 3.0 for t in agent["turns"])  # max_turns = 3
    evals = summary["extra"]["eval"]
    assert set(evals) == {"before", "after", "no_tools"}
    assert evals["no_tools"]["tool_use"] == 0.0 or evals["no_tools"]["tool_calls"] > 0
    assert "rollout" in summary["bubble_ratio"] and "tools" in summary["bubble_ratio"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("step") is not None]
    assert all("agent_turns" in r and "agent_tool_calls" in r for r in steps)
    # the trace shows generated turns on the rollout and tool calls on their own resource
    trace = json.loads((out / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert {"turn", "tools"} <= names
    assert (out / "config.toml").read_text().count('name = "clock"') == 1


def test_the_lookup_task_runs_too(tmp_path: Path) -> None:
    args = ["run", "--out", str(tmp_path / "run"), "--quiet"]
    for item in [*QUICK, "task=lookup", "task.digits=2"]:
        args += ["--set", item]
    assert cli_main(args) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["task"] == "lookup-2" and summary["extra"]["eval"]["after"]["turns"] >= 1


def test_task_shorthand_and_agent_keys_are_checked() -> None:
    cfg = load_run_config(None, ["task=clock"])
    assert cfg.task.name == "clock" and cfg.workload_name() == "agent"
    assert cfg.rl_config().trajectory_limits.max_turns == cfg.agent.max_turns
    with pytest.raises(ConfigError, match=r"agent\.\* apply to agentic workloads"):
        load_run_config(None, ["agent.max_turns=5"])
    with pytest.raises(ConfigError, match=r"agent\.max_turns must be >= 1"):
        load_run_config(None, ["task=clock", "agent.max_turns=0"])
    with pytest.raises(ConfigError, match=r"lookup task digits must be in 1\.\.6"):
        load_run_config(None, ["task=lookup", "task.digits=7"])
    with pytest.raises(ConfigError, match=r"task\.name"):
        load_run_config(None, ["task=nope"])
    with pytest.raises(ConfigError, match="has not been tried on 'ray'"):
        load_run_config(None, ["task=clock", "runtime.kind=ray"])
    with pytest.raises(ConfigError, match=r"task is a table.*read as HFRunConfig"):
        load_run_config(None, ["task=clock", "model.name=tiny-qwen2"])  # hf has no task.name
    with pytest.raises(ConfigError, match="do not go together"):
        load_run_config(None, ["task=clock", "workload=digits"])


def test_the_agentic_tasks_warm_the_learning_rate_up() -> None:
    from asyncflow_core.engines import registry

    clock = load_run_config(None, ["task=clock"])
    assert clock.lr_warmup_steps() == 20
    assert registry.trainer_options(clock)["lr_warmup_steps"] == 20
    digits = load_run_config(None, [])
    assert digits.lr_warmup_steps() == 0 and "lr_warmup_steps" not in registry.trainer_options(
        digits
    )
    assert load_run_config(None, ["task=clock", "train.lr_warmup_steps=0"]).lr_warmup_steps() == 0
    with pytest.raises(ConfigError, match="lr_warmup_steps applies to the torch and hf"):
        load_run_config(None, ["task=clock", "train.engine=deepspeed"])
