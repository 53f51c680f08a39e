"""What the main job shows: the run's headline figures (``RunSummary``, ``summary.json``) and
their table (``format_summary``), the reward curve (``plot_rewards``) and the live progress
(``StepProgress``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from asyncflow_core.contracts.errors import ConfigError
from asyncflow_core.flow.rlflow import RLResult, StepRecord


@dataclass(frozen=True)
class RunSummary:
    """The headline figures of a run (``summary.json``). Rewards: means over the first and
    last 10% of steps (at least one step each); ``eval_*``: greedy decoding on
    ``eval_prompts`` fresh prompts after training. ``bubble_ratio``: idle fraction per
    resource over the RL phase; ``staleness_hist``: trained samples per weight-version lag."""

    mode: str
    staleness: int
    loss: str
    task: str
    steps: int
    samples: int
    tokens: int
    dropped: int
    wall_s: float
    warmup_s: float
    samples_per_s: float
    tokens_per_s: float
    reward_first: float
    reward_last: float
    eval_reward: float | None
    eval_exact: float | None
    bubble_ratio: dict[str, float]
    staleness_hist: dict[str, int]
    sync_exposed_s: float
    sync_hidden_s: float
    threads: int
    trainer: str = "thread"
    """Where the trainer ran: ``thread`` (this process) or ``process`` (``train.process``);
    for ``train.engine = "deepspeed"``, the stage, precision and ranks as well."""
    platform: str = "cpu"
    """The trainer's platform (``RunConfig.trainer_platform()``)."""
    runtime: str = "local"
    """``local``, or ``ray`` with the cluster's nodes and the store's units."""
    extra: dict[str, Any] = field(default_factory=dict)
    """What the workload reported at the end (hf: where the policy was saved, failed
    rewards)."""

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def plot_rewards(result: RLResult, path: str | Path, *, title: str = "") -> Path:
    """The per-step mean reward against the step, as a PNG (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s.version for s in result.steps]
    rewards = [s.reward_mean for s in result.steps]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, rewards, lw=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


_TRAINER_WORDS = {
    "process": "its own process",
    "thread": "a thread of this process",
    "ray actor": "a Ray actor of its own",
}


def format_summary(s: RunSummary) -> str:
    rows = [
        ("task / mode", f"{s.task}, {s.mode} (η={s.staleness}), loss {s.loss}"),
        ("trainer", f"{_TRAINER_WORDS.get(s.trainer, s.trainer)}, on {s.platform}"),
        ("runtime", s.runtime),
        ("steps / samples", f"{s.steps} / {s.samples} ({s.dropped} dropped as stale)"),
        ("wall (RL) / warm-up", f"{s.wall_s:.1f} s / {s.warmup_s:.1f} s"),
        ("samples/s, tokens/s", f"{s.samples_per_s:.1f}, {s.tokens_per_s:.0f}"),
        ("reward first → last 10%", f"{s.reward_first:.3f} → {s.reward_last:.3f}"),
    ]
    before = s.extra.get("eval_before")
    if before:
        rows.append(
            ("greedy eval before RL", f"reward {before['reward']:.3f}, exact {before['exact']:.1%}")
        )
    if s.eval_reward is not None and s.eval_exact is not None:
        label = "greedy eval after RL" if before else "greedy eval"
        rows.append((label, f"reward {s.eval_reward:.3f}, exact {s.eval_exact:.1%}"))
    if s.extra.get("lost_engines"):
        lost = s.extra["lost_engines"]
        rows.append(("lost rollout engines", f"{len(lost)} ({', '.join(sorted(lost))}), survived"))
    if s.extra.get("restarted_engines"):
        back = s.extra["restarted_engines"]
        text = ", ".join(f"{n} ({k}×)" for n, k in sorted(back.items()))
        rows.append(("restarted rollout engines", f"{text}, rejoined"))
    rows += _agent_rows(s.extra)
    rows += [
        ("bubble ratio", ", ".join(f"{k} {v:.2f}" for k, v in s.bubble_ratio.items())),
        ("staleness histogram", ", ".join(f"{k}: {v}" for k, v in s.staleness_hist.items())),
        ("sync exposed / hidden", f"{s.sync_exposed_s:.2f} s / {s.sync_hidden_s:.2f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _agent_rows(extra: dict[str, Any]) -> list[tuple[str, str]]:
    """Summary rows of an agent job: turns and tool calls per trajectory during training,
    greedy evaluations before and after RL and without tools, the curriculum."""
    rows: list[tuple[str, str]] = []
    agent = extra.get("agent")
    if agent:
        (t0, t1), (c0, c1), (e0, e1) = agent["turns"], agent["tool_calls"], agent["tool_errors"]
        rows.append(
            ("turns / tool calls per traj", f"{t0:.2f} / {c0:.2f} → {t1:.2f} / {c1:.2f} "
             f"(tool errors {e0:.2f} → {e1:.2f}, restarts {agent['restarts']})")
        )  # fmt: skip
    evals = extra.get("eval") or {}

    def show(e: dict[str, float]) -> str:
        return (
            f"reward {e['reward']:.3f}, exact {e['exact']:.1%}, tool use {e['tool_use']:.0%}, "
            f"turns {e['turns']:.2f}"
        )

    for key, label in (("before", "greedy eval before RL"), ("no_tools", "after, tools off")):
        if key in evals:
            rows.append((label, show(evals[key])))
    if "after" in evals:
        rows.insert(
            len(rows) - ("no_tools" in evals), ("greedy eval after RL", show(evals["after"]))
        )
    return rows


class StepProgress:
    """The main job's progress, fed one ``StepRecord`` per optimizer step (``on_step``). On a
    terminal it is a live tqdm bar. Anywhere else (CI, ``nohup``, a pipe) a bar's
    carriage-return redraws pile up into one huge line of the log, so it prints a plain line
    (step, reward, samples/s, elapsed) at most every ``every_s`` seconds, and one for the last
    step. Time is the steps' own ``end_s`` (seconds since the RL job started; warm-up
    excluded), so the lines follow the run and samples/s is the RL phase's throughput."""

    def __init__(
        self, total: int, stream: TextIO, *, quiet: bool = False, every_s: float = 10.0
    ) -> None:
        if not every_s > 0:
            raise ConfigError(f"StepProgress: every_s must be > 0 seconds, got {every_s!r}")
        self.total = total
        self.stream = stream
        self.quiet = quiet
        self.every_s = every_s
        self.steps = 0
        self.samples = 0
        self._last_line_s = 0.0
        self._bar: Any = None
        if not quiet and _is_terminal(stream):
            from tqdm import tqdm  # type: ignore[import-untyped]  # no stubs shipped

            self._bar = tqdm(total=total, desc="RL", unit="step", file=stream)

    def __call__(self, record: StepRecord) -> None:
        self.steps += 1
        self.samples += record.samples
        rate = self.samples / record.end_s if record.end_s > 0 else 0.0
        if self._bar is not None:
            self._bar.set_postfix(reward=f"{record.reward_mean:.3f}", samples_s=f"{rate:.0f}")
            self._bar.update(1)
            return
        due = record.end_s - self._last_line_s >= self.every_s or self.steps >= self.total
        if self.quiet or not due:
            return
        self._last_line_s = record.end_s
        print(
            f"RL step {self.steps}/{self.total}  reward {record.reward_mean:.3f}  "
            f"samples/s {rate:.0f}  elapsed {record.end_s:.1f} s",
            file=self.stream,
            flush=True,  # a log read while the job runs (tail -f) sees each line at once
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
