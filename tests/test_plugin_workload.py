"""A third party's workload package runs under ``asyncflow run`` with no change to AsyncFlow
(issue #26): ``examples/plugin_workload`` is found through its entry points (a dist-info folder
written here from its ``pyproject.toml``, as ``pip install`` would), its config class adds its
own keys (read, checked, listed, written to ``config.toml`` and read back on ``--resume``), and
its rollout engine factory is built by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "examples" / "plugin_workload"
SMALL = [
    "rl.steps=3", "rl.prompts_per_step=8", "rl.n=4", "eval_prompts=16", "rollout.max_batch=32",
    "train.micro_batch_size=32",
]  # fmt: skip


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the plugin's distribution metadata, its entry points taken from its
    ``pyproject.toml``."""
    project = tomllib.loads((PLUGIN / "pyproject.toml").read_text())["project"]
    folder = tmp_path_factory.mktemp("site")
    info = folder / "parity_workload-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    groups = {g: dict(e) for g, e in project["entry-points"].items()}
    # and two that do not import (a missing dependency): skipped when auto picks a workload,
    # refused with the reason when named
    groups["asyncflow.workloads"]["broken"] = "no_such_module_here:Workload"
    groups["asyncflow.runtimes"] = {"broken": "no_such_module_here:runtime"}
    # and CLI commands that cannot be added: a taken name, a missing module, a misnamed parser
    groups["asyncflow.commands"] = {
        "run": "badcommands:add", "gone": "no_such_module_here:add", "misnamed": "badcommands:add",
    }  # fmt: skip
    (folder / "badcommands.py").write_text(
        "def add(subparsers):\n    subparsers.add_parser('elsewhere')\n    return lambda args: 0\n"
    )
    lines = []
    for group, entries in groups.items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in entries.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return folder


def asyncflow(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PLUGIN), str(site), env.get("PYTHONPATH", "")])
    code = "import sys; from asyncflow_core.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=ROOT,
        timeout=600,
    )  # fmt: skip


def sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def test_a_plugin_workload_trains_resumes_and_reports(site: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = asyncflow(
        site, "run", *sets("parity.digits=3", *SMALL), "--out", str(run_dir), "--quiet"
    )
    assert done.returncode == 0, done.stderr
    assert "parity-3 with async RL" in done.stderr  # the config class's describe()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["task"] == "parity-3" and summary["steps"] == 3
    assert summary["extra"]["answer_tokens"] == {"even": 10, "odd": 11}  # the workload's finish
    saved = tomllib.loads((run_dir / "config.toml").read_text())
    assert saved["parity"] == {"digits": 3, "d_model": 32} and saved["workload"] == "auto"
    # --resume reads config.toml back into the plugin's class (auto: its keys claim it)
    more = asyncflow(site, "run", "--resume", str(run_dir), *sets("rl.steps=5"), "--quiet")
    assert more.returncode == 0, more.stderr
    assert "3 of 5 steps done" in more.stderr
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 5


def test_a_plugin_workloads_keys_are_listed_and_checked(site: Path, tmp_path: Path) -> None:
    listed = asyncflow(site, "run", "--keys", *sets("workload=parity"))
    assert listed.returncode == 0, listed.stderr
    assert "# workload parity (ParityRunConfig)" in listed.stdout
    assert "parity.digits = 3" in listed.stdout and "rl.steps = 120" in listed.stdout
    assert "task.name" not in listed.stdout  # the reference workload's keys are not its
    out = tmp_path / "bad"
    bad = asyncflow(site, "run", *sets("parity.digits=99"), "--out", str(out))
    assert bad.returncode == 2
    assert "parity.digits must be in [1, 16], got 99" in bad.stderr
    assert not out.exists()  # refused before anything was written
    unknown = asyncflow(site, "run", *sets("parity.digts=4"))
    assert unknown.returncode == 2 and "parity.digts" in unknown.stderr
    assert "digits" in unknown.stderr  # the keys of its table, with a guess
    broken = asyncflow(site, "run", *sets("parity.digits=4", "runtime.kind=broken"))
    assert broken.returncode == 2
    assert "runtime.kind = 'broken' needs a package that does not import here" in broken.stderr
    assert "no_such_module_here" in broken.stderr and "install parity-workload" in broken.stderr
    wrong = asyncflow(site, "run", *sets("parity.digits=4", "rollout.engine=hf"))
    assert wrong.returncode == 2, wrong.stderr
    assert "rollout.engine" in wrong.stderr


def test_broken_plugin_commands_are_left_out_and_the_cli_works(site: Path) -> None:
    done = asyncflow(site, "platforms")
    assert done.returncode == 0, done.stderr
    assert "command 'run' (badcommands:add) is left out: the name is taken" in done.stderr
    assert "command 'gone' (no_such_module_here:add) is unavailable" in done.stderr
    assert "command 'misnamed' (badcommands:add) is left out" in done.stderr
    other = asyncflow(site, "elsewhere")  # the parser it added under another name
    assert other.returncode == 2 and "has no handler" in other.stderr
    sim = asyncflow(site, "simulate", "--list")  # a working plugin command still runs
    assert sim.returncode == 0 and "qwen2.5-7b-grpo" in sim.stdout
