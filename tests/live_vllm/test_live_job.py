"""The main job on a real vLLM: ``asyncflow run`` with ``rollout.engine=vllm``, in process (an
``AsyncLLM`` of the job's own, the policy saved to a folder for it) and against the shared
``vllm serve`` (``rollout.url``), a few steps each, as a user runs it; and the sync modes that
cannot work refused before anything runs. Whether it *learns* is measured by
``benchmarks/vllm_job.py`` (docs/vllm.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import live
import pytest

JOB_S = 900.0
"""Safety net on one job (a start of vLLM included)."""

SHORT = [
    "--set", "rl.steps=3", "--set", "rl.prompts_per_step=4", "--set", "rl.n=4",
    "--set", "task.warmup_steps=2", "--set", "task.warmup_batch=8", "--set", "eval_prompts=4",
    "--set", "checkpoint.every=0", "--set", "data.max_tokens=8",
]  # fmt: skip


def run_job(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "asyncflow_core.cli", "run", "--out", str(out), *args]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=JOB_S, stdin=subprocess.DEVNULL
    )


def summary(out: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return data


def check_run(done: subprocess.CompletedProcess[str], out: Path) -> dict[str, Any]:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    s = summary(out)
    assert s["steps"] == 3 and s["samples"] == 3 * 16, s
    assert (out / "policy" / "config.json").is_file()
    return s


def test_the_job_runs_on_vllm_in_process(tmp_path: Path) -> None:
    """``rollout.engine=vllm``: the job's own AsyncLLM serves the (warmed-up) policy; the
    staged sync (the default) swaps the trainer's weights in through the worker extension."""
    out = tmp_path / "run"
    done = run_job(
        out, "--set", f"model.path={live.model_folder('qwen2')}", "--set", "rollout.engine=vllm",
        *SHORT,
    )  # fmt: skip
    s = check_run(done, out)
    assert s["sync_exposed_s"] > 0  # the swaps happened
    # vLLM's own engine-config line: it computes in the trainer's dtype (its "auto" would
    # serve this float32 checkpoint in 16 bits)
    assert "dtype=torch.float32," in done.stdout + done.stderr, done.stderr[-3000:]
    # the job's AsyncLLM was let go at close, not left to its __del__ at interpreter exit
    # (which fails there: "TypeError: 'NoneType' object is not callable")
    assert "AsyncLLM.__del__" not in done.stderr, done.stderr[-3000:]


def test_the_job_runs_against_a_vllm_server(tmp_path: Path) -> None:
    """``rollout.url``: the job generates on the shared ``vllm serve`` and loads its weights
    there over dev-mode ``/collective_rpc`` (loopback)."""
    url = live.server("qwen2").url
    out = tmp_path / "run"
    done = run_job(
        out, "--set", f"model.path={live.model_folder('qwen2')}", "--set", "rollout.engine=vllm",
        "--set", f"rollout.url={url}", "--set", "rl.weight_sync=blocking", *SHORT,
    )  # fmt: skip
    check_run(done, out)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--set", "rl.weight_sync=inflight"], "cannot load weights while it generates"),
        (["--set", "rollout.process=true"], "leave rollout.process off"),
        (["--set", "rollout.url=http://127.0.0.1:1,http://127.0.0.1:2"], "one URL per rollout"),
    ],
    ids=["inflight", "process", "urls"],
)
def test_what_cannot_work_is_refused_before_anything_runs(
    tmp_path: Path, args: list[str], words: str
) -> None:
    url = live.server("qwen2").url
    out = tmp_path / "run"
    server = [] if any("rollout.url" in a for a in args) else ["--set", f"rollout.url={url}"]
    done = run_job(
        out, "--set", f"model.path={live.model_folder('qwen2')}", "--set", "rollout.engine=vllm",
        *server, *args, *SHORT,
    )  # fmt: skip
    assert done.returncode != 0
    assert words in done.stderr, done.stderr[-2000:]
    assert not (out / "summary.json").exists()
