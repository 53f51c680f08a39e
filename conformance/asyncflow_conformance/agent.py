"""Laws of agent loops (``AgentLoopConformance``): a multi-turn rollout (an
``asyncflow_core.flow.agent.AgentLoop``: ``ToolAgentLoop``, ``EnvironmentLoop``, an
``asyncflow_serve.EndpointLoop`` around an agent program, your own) must hand the trainer
exactly what the policy generated, under the log-probs and versions the engine reported, and
must neither lose nor duplicate a sample when a tool fails.

Usage::

    from asyncflow_conformance import AgentLoopConformance

    class TestMyLoop(AgentLoopConformance):
        stop_token_ids = my_chat.stop_token_ids

        def make_loop(self, tool_failure):  # None or one of TOOL_FAILURES
            return ToolAgentLoop(my_chat, ToolRunner([], timeout_s=0.5),
                                 tools=lambda s: my_tools(s, failing=tool_failure))

        def make_inference(self):
            return MyEngine()

        def make_trainer(self):
            return MyTrainer()

        def sample(self, index):  # distinct prompts per index
            return {"messages": [{"role": "user", "content": f"question {index}"}]}

        # optional: an engine whose turns call the tools (a scripted policy), for the laws
        # about tool turns when the model cannot write a tool call yet
        def make_tool_policy(self, tool_failure):
            return ScriptedEngine(...)

The suite runs each law on fresh engines and a fresh loop, giving the loop one
``GenerationClient`` per sample (the suite's sampling settings, ``limits``, partial rollout
on) over a recording proxy of the engine: every request and result is evidence the laws hold
the trajectories against. The laws:

1. **The mask covers exactly the generated tokens** (``test_the_mask_covers_exactly_the_
   generated_tokens[model|tools]``): each assistant turn is exactly the engine's final result
   of the request it names (a resumed request counted once, with its prefix), with the
   engine's log-probs and versions, generated for this sample's own client; every request
   the engine answered for that client is a turn; each request's prompt is exactly the
   trajectory's tokens before its turn (token in, token out: no re-tokenisation between
   turns); every other token is masked out with log-prob 0 and ``NO_VERSION``; ``validate()``
   passes. ``[model]`` runs on the engine of ``make_inference``, ``[tools]`` on the tool
   policy (skipped without one).
2. **The trainer's log-probs of the generated tokens equal the engine's**
   (``test_trainer_logprobs_of_generated_tokens_equal_the_engines``): train one step, sync
   into the engine, run the loop, build the rows exactly as ``RLJob`` does (``prompt`` =
   ``tokens[:prompt_length]``, ``response`` the rest, ``loss_mask``, the engine's
   ``logprobs``, the job's sampling fields; ``trajectory_batch``) and compare
   ``compute_logprobs`` on ``loss_mask == 1`` (``logprob_atol`` on the mean,
   ``logprob_max_atol`` on the largest difference, as ``EnginePairConformance``).
3. **Tool output is never trained on** (``test_tool_output_is_never_trained_on``): on the
   rows of trajectories with tool turns, every token the engine did not generate (by the
   recorded evidence, not by the trajectory's own labels) has ``loss_mask`` 0, the job's loss
   (``make_loss``, default ``policy_gradient_loss``) has an exactly zero gradient with
   respect to its log-prob, and changing those log-probs leaves the loss bit for bit the same;
   then through the trainer: from one checkpoint, ``train_step`` reports the same loss and
   grad norm (``mask_rtol``) when the behaviour, proximal and reference log-probs of those
   tokens move (under ``importance_weighted_loss``, which reads them), and other ones when
   those of generated tokens move.
4. **An interrupted trajectory resumes with its versions intact**
   (``test_an_interrupted_trajectory_resumes_with_versions_intact``): after
   ``interrupt_after_tokens`` tokens of its first turn (``SupportsProgress.wait_for_tokens``)
   the engine is paused with ``"abort"``, the trainer's next weights (version v+1) are synced
   in and the engine resumed: the run still returns one trajectory, whose interrupted turn
   starts with the aborted tokens at version v (not regenerated) and whose later tokens report
   versions >= v+1. Needs ``SupportsPause`` and ``SupportsProgress`` (skipped naming what is
   missing).
5. **A failing tool cannot lose or duplicate a trajectory**
   (``test_a_failing_tool_cannot_lose_or_duplicate_a_trajectory[raises|times_out|
   malformed|unknown_tool|bad_arguments]``): ``failure_samples`` samples run concurrently with
   the loop's tools failing that way (the last three: the tool policy writes a call that does
   not parse, names a tool the loop does not have, or passes arguments its schema refuses);
   every sample returns its own trajectory (law 1's evidence: no turn of another sample's),
   the failure shows in it (``tool_errors``) and the model read it (a masked-out turn follows
   the failing call). And through ``RLJob`` (``test_a_job_trains_each_
   trajectory_exactly_once[...]``): for ``job_steps`` steps every trained row is a trajectory
   the loop returned for its own sample, matched one to one (none trained twice), each
   trained sample exactly ``job_n`` times.
6. **A job never trains a trajectory staler than η**
   (``test_a_job_never_trains_a_trajectory_staler_than_eta[0|1]``, ``job_staleness``): an
   ``RLJob`` with staleness η, ``weight_sync="staged"``, partial rollout and
   ``staleness_steps`` steps, the tools working; with η >= 1 the first trajectory is made a
   straggler (each of its turns is answered only once the trainer has stepped past the version
   the turn started at and the engine holds those weights), so it ages past η while the other
   groups go on, the way a long-tailed trajectory does. Every trained row that is a
   trajectory the loop returned is at most η versions older than the trainer before the step,
   counted by its oldest generated token (the law's own count, from the trajectory, not the
   row's tags), and holds no token newer than the trainer; no turn started while its
   trajectory was already staler than η (a lower bound of the trainer's version at the start:
   the last step that had returned); and the job regenerated no more trajectories than the
   loop ended ``"stale"`` (a sample runs again only when it became too stale to be trained,
   never once it finished).

``ChatFormatConformance`` holds a ``ChatFormat`` (``asyncflow_core.flow.chat``; hook
``make_chat()``) to its continuation law (``test_followup_continues_the_template``): for a
conversation user -> assistant (text) -> user -> assistant (a tool call) -> tool -> user,
``prompt(first messages, tools)`` + each assistant turn's tokens (as the template renders it,
up to and with its first stop token: what an engine generating it ends with) +
``followup(the messages up to the next assistant turn)`` ... equals ``prompt(all messages,
tools)`` token for token, so a loop that appends generated and followup tokens trains on
exactly what the template renders.

A random model rarely writes a tool call, so laws 3, 5 and 6 (and law 1's ``[tools]`` case) run
on ``make_tool_policy`` when given: an engine whose turns call the tools, e.g. a scripted one;
laws 1 ``[model]``, 2 and 4 need the real model (its log-probs, pause and weight loads). A
failure kind the backend cannot produce is listed in ``unsupported_failures`` (skipped with
that reason). Nothing waits on the clock: the interruption waits for the engine's evidence,
tools that hang are timed out by the loop's own timeout, and ``timeout_s`` (every await) and
``real_timeout_s`` (every law) are safety nets only. ``describe_backend()`` and
``report_lines()`` describe what a class declares and what its laws saw.

The job law builds its ``RLJob`` on the recording proxies with ``RLEngines.make_transport``
calling ``make_sync`` (on the engines behind the proxies), so ``make_sync`` must build its
transport synchronously for that law. ``check_token_accounting``, ``check_ownership``,
``trajectory_batch`` and ``trajectory_agreement`` are public so that other tests can hold
trajectories against a recorded engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import itertools
import math
import tempfile
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, cast

import pytest
import torch

from asyncflow_conformance.engines import (
    ProgressHook,
    _close,
    _resolve,
    _Suite,
    metrics_apart,
)
from asyncflow_conformance.pair import Agreement
from asyncflow_conformance.workflow import (
    GenerateCall,
    Recorder,
    RecordingInferenceEngine,
    RecordingTrainEngine,
)
from asyncflow_core.contracts.errors import AsyncFlowError, BadRequestError
from asyncflow_core.contracts.protocols import (
    Batch,
    GenerationRequest,
    GenerationResult,
    InferenceEngine,
    LossFn,
    SamplingParams,
    SupportsPause,
    SupportsProgress,
    TrainEngine,
    TrainMetrics,
    Version,
    WeightSync,
)
from asyncflow_core.data.scheduling import RequestRouter
from asyncflow_core.data.store import InProcessDataStore
from asyncflow_core.flow.agent import (
    NO_VERSION,
    AgentLoop,
    GenerationClient,
    Trajectory,
    TrajectoryLimits,
)
from asyncflow_core.flow.chat import ChatFormat
from asyncflow_core.flow.rlflow import RLConfig, RLEngines, RLJob, RLResult
from asyncflow_core.sync.transports import InProcessWeightSync
from asyncflow_core.training.rl import (
    BEHAVIOUR_LOGPROBS,
    LOSS_MASK,
    PROX_LOGPROBS,
    REF_LOGPROBS,
    policy_gradient_loss,
    response_mask,
)
from asyncflow_core.training.sampling import SAMPLING_FIELDS, sampling_columns

__all__ = [
    "POLICIES",
    "TOOL_FAILURES",
    "AgentLoopConformance",
    "AgentRecorder",
    "ChatFormatConformance",
    "LoopRaised",
    "RecordingAgentEngine",
    "ScriptedPolicy",
    "ServedTurn",
    "ToolFailure",
    "check_ownership",
    "check_token_accounting",
    "served_turns",
    "trajectory_agreement",
    "trajectory_batch",
]

ToolFailure = Literal["raises", "times_out", "malformed", "unknown_tool", "bad_arguments"]
TOOL_FAILURES: tuple[ToolFailure, ...] = (
    "raises", "times_out", "malformed", "unknown_tool", "bad_arguments"
)  # fmt: skip
"""How the failure law makes the loop's tools fail: a tool that raises, a tool that hangs past
the loop's timeout, a tool call the model wrote that does not parse, a call of a tool the loop
does not have, a call whose arguments violate the tool's schema."""

Policy = Literal["model", "tools"]
POLICIES: tuple[Policy, ...] = ("model", "tools")
"""Law 1's cases: the model's engine (``make_inference``), the tool policy
(``make_tool_policy``)."""

REPORT: dict[str, list[str]] = {}
"""What each conformance class's laws saw, by class name (``report_lines``)."""


class ScriptedPolicy:
    """An ``InferenceEngine`` whose turns are written by ``turn(request)`` (token ids, the
    stop token included), for ``make_tool_policy``: a policy that calls the loop's tools when
    the model cannot write a call yet. It is a script, not a model: every token gets log-prob
    ``logprob`` and the engine's ``weight_version``; a turn longer than ``max_tokens`` is cut
    (``"length"``); a resumed request keeps its prefix; ``load_weights`` only sets the
    version (so ``RLJob`` can sync it)."""

    def __init__(
        self, turn: Callable[[GenerationRequest], Sequence[int]], *, logprob: float = -0.5
    ) -> None:
        self.turn = turn
        self.logprob = logprob
        self.weight_version: Version = 0
        self.requests: list[GenerationRequest] = []

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.requests.append(request)
        k = len(request.resume_tokens)
        ids = [*request.resume_tokens, *list(self.turn(request))[k:]]
        cap = request.params.max_tokens
        finish: Literal["stop", "length"] = "stop" if len(ids) <= cap else "length"
        ids = ids[:cap]
        new = len(ids) - k
        return GenerationResult(
            request.request_id, request.prompt_tokens, tuple(ids),
            (*request.resume_logprobs, *(self.logprob,) * new),
            (*request.resume_versions, *(self.weight_version,) * new), finish,
        )  # fmt: skip

    async def abort(self, request_ids: Sequence[str]) -> None:
        return None

    async def load_weights(self, weights: Sequence[tuple[str, torch.Tensor]], version: int) -> None:
        self.weight_version = version


class LoopRaised(AssertionError):
    """A law's ``loop.run`` raised (the original exception is the ``__cause__``)."""


# --------------------------------------------------------------------------------------------
# Evidence: what the engine was asked and answered
# --------------------------------------------------------------------------------------------
@dataclass
class AgentRecorder(Recorder):
    """A workflow ``Recorder`` that also notes each ``generate`` as it starts (``started``)
    and wakes ``wait_for`` on every start and end."""

    started: list[GenerationRequest] = field(default_factory=list)
    on_start: Callable[[GenerationRequest], None] | None = None
    """Called (synchronously) as each ``generate`` starts, e.g. to note what else was true then."""
    hold: Callable[[GenerationRequest], Awaitable[None]] | None = None
    """Awaited after the engine answered a ``generate``, before the answer is returned (a law
    making a straggler)."""
    _changed: asyncio.Event | None = None

    def notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def wait_for(self, found: Callable[[], Any]) -> Any:
        """Return ``found()`` once it is truthy, re-checking after every start and end of a
        ``generate`` (bound the wait with a timeout)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        while True:
            value = found()
            if value:
                return value
            self._changed.clear()
            await self._changed.wait()


class RecordingAgentEngine(RecordingInferenceEngine):
    """``RecordingInferenceEngine`` for an ``AgentRecorder``: notes a ``generate`` when it
    starts. Build it with ``RecordingAgentEngine.wrap(engine, AgentRecorder(), name)``; it
    claims exactly the wrapped engine's abilities."""

    _classes: ClassVar[dict[tuple[bool, bool, bool], type[RecordingInferenceEngine]]] = {}

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        recorder = cast(AgentRecorder, self._recorder)
        recorder.started.append(request)
        if recorder.on_start is not None:
            recorder.on_start(request)
        recorder.notify()
        try:
            result = await super().generate(request)
            if recorder.hold is not None:
                await recorder.hold(request)
            return result
        finally:
            recorder.notify()


@dataclass(frozen=True, slots=True)
class ServedTurn:
    """What the engine did for one request id: the request as first submitted (its prompt and
    group), the final result (the last call's: a resumed request's starts with its prefix)
    and every call's result in order (aborted ones first)."""

    request: GenerationRequest
    result: GenerationResult
    results: tuple[GenerationResult, ...]

    @property
    def aborted(self) -> tuple[GenerationResult, ...]:
        return tuple(r for r in self.results[:-1] if r.finish_reason == "abort")


def served_turns(calls: Sequence[GenerateCall]) -> dict[str, ServedTurn]:
    """Every request id the engine answered (calls that raised are left out), in order."""
    out: dict[str, ServedTurn] = {}
    for call in calls:
        if call.result is None:
            continue
        rid = call.request.request_id
        prior = out.get(rid)
        if prior is None:
            out[rid] = ServedTurn(call.request, call.result, (call.result,))
        else:
            out[rid] = ServedTurn(prior.request, call.result, (*prior.results, call.result))
    return out


def _in_family(group: object, trajectory_id: str) -> bool:
    """A request of the client ``trajectory_id`` or of a segment it spawned
    (``client.spawn(f"{trajectory_id}.<suffix>")``)."""
    return isinstance(group, str) and (
        group == trajectory_id or group.startswith(trajectory_id + ".")
    )


def _validated(trajectory: Trajectory, where: str) -> None:
    if not isinstance(trajectory, Trajectory):
        raise AssertionError(
            f"{where}: the loop returned {type(trajectory).__name__}, not a Trajectory (return "
            "client.trajectory())"
        )
    try:
        trajectory.validate()
    except BadRequestError as exc:
        raise AssertionError(f"{where}: the trajectory is invalid: {exc}") from exc


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def check_ownership(
    trajectory: Trajectory, served: Mapping[str, ServedTurn], trajectory_id: str, *, where: str
) -> str | None:
    """Each assistant turn names a request the engine answered for client ``trajectory_id``
    (or a segment it spawned), each request once. Returns the group (client) the turns came
    from (None: no assistant turn)."""
    groups: set[str] = set()
    seen: set[str] = set()
    for i, turn in enumerate(trajectory.assistant_turns()):
        rid = turn.request_id
        span = f"[{turn.start}, {turn.end})"
        evidence = served.get(rid) if rid is not None else None
        if evidence is None:
            raise AssertionError(
                f"{where}: assistant turn {i} (tokens {span}) names request {rid!r}, which the "
                "engine never answered: tokens marked as generated (loss_mask 1) that the policy "
                "did not generate — a tool's, the environment's or a user's text would be "
                "trained on. Only GenerationClient.generate() appends assistant turns"
            )
        assert rid is not None
        if rid in seen:
            raise AssertionError(
                f"{where}: request {rid!r} is in the trajectory twice (assistant turn {i} "
                "again): a request aborted and resumed is one turn, its final result"
            )
        seen.add(rid)
        group = evidence.request.group
        if not _in_family(group, trajectory_id):
            raise AssertionError(
                f"{where}: assistant turn {i} was generated for another trajectory (request "
                f"{rid!r}, client {group!r}), not for this sample's client {trajectory_id!r}: "
                "the loop returned another sample's trajectory (a cache, shared state); every "
                "sample's trajectory must be its own, or one sample is trained twice and another "
                "never"
            )
        groups.add(str(group))
    if len(groups) > 1:
        raise AssertionError(
            f"{where}: the assistant turns come from {len(groups)} clients {sorted(groups)}: "
            "a trajectory is one conversation, generated through one GenerationClient"
        )
    return next(iter(groups), None)


def check_token_accounting(
    trajectory: Trajectory,
    served: Mapping[str, ServedTurn],
    trajectory_id: str,
    *,
    where: str = "",
) -> tuple[tuple[int, int], ...]:
    """Law 1 on one trajectory run through client ``trajectory_id``, against ``served``
    (``served_turns`` of the engine's recorded calls): see the module docstring. Returns the
    spans ``[start, end)`` of the generated tokens."""
    where = where or f"trajectory {trajectory_id!r}"
    _validated(trajectory, where)
    group = check_ownership(trajectory, served, trajectory_id, where=where)
    tokens = trajectory.tokens
    spans: list[tuple[int, int]] = []
    for i, turn in enumerate(trajectory.assistant_turns()):
        evidence = served[cast(str, turn.request_id)]
        prompt = tuple(evidence.request.prompt_tokens)
        context = tokens[: turn.start]
        if prompt != context:
            j = _first_difference(prompt, context)
            saw = prompt[j] if j < len(prompt) else "the end"
            has = context[j] if j < len(context) else "the end"
            raise AssertionError(
                f"{where}: the engine generated assistant turn {i} from a context of "
                f"{len(prompt)} tokens, but the trajectory holds {len(context)} tokens before "
                f"that turn, first different at position {j} (the engine saw {saw}, the "
                f"trajectory has {has}): re-tokenised or edited history. Token in, token out: "
                "the trajectory holds exactly the tokens the engine saw and produced, never a "
                "re-tokenisation of their text"
            )
        result = evidence.result
        got = tokens[turn.start : turn.end]
        if got != tuple(result.tokens):
            j = _first_difference(got, result.tokens)
            raise AssertionError(
                f"{where}: assistant turn {i} holds {len(got)} tokens, but the engine generated "
                f"{len(result.tokens)} for request {turn.request_id!r} (first different at "
                f"token {j} of the turn): the masked-in tokens must be exactly the engine's "
                "(a resumed request once, with its prefix), never their text tokenised again"
            )
        lps = trajectory.logprobs[turn.start : turn.end]
        bad = [
            k
            for k, (a, b) in enumerate(zip(lps, result.logprobs, strict=True))
            if not math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)
        ]
        if bad:
            k = bad[0]
            raise AssertionError(
                f"{where}: assistant turn {i}'s log-prob at token {k} is {lps[k]}, the engine "
                f"reported {result.logprobs[k]} ({len(bad)} differ): the trajectory carries the "
                "engine's log-probs of its tokens unchanged"
            )
        versions = trajectory.versions[turn.start : turn.end]
        if tuple(versions) != tuple(result.versions):
            raise AssertionError(
                f"{where}: assistant turn {i} reports versions {sorted(set(versions))}, the "
                f"engine {sorted(set(result.versions))}: each generated token keeps the version "
                "of the weights that sampled it"
            )
        spans.append((turn.start, turn.end))
    if group is not None:
        held = {t.request_id for t in trajectory.assistant_turns()}
        lost = [rid for rid, s in served.items() if s.request.group == group and rid not in held]
        if lost:
            raise AssertionError(
                f"{where}: the engine generated request(s) {lost} for this trajectory's client "
                f"{group!r}, which the trajectory does not hold: generated turns dropped or "
                "generated again; every turn the policy generated is in its trajectory"
            )
    generated = {j for start, end in spans for j in range(start, end)}
    for j in range(len(tokens)):
        if j in generated:
            continue
        if trajectory.loss_mask[j] != 0:
            raise AssertionError(
                f"{where}: token {j} has loss_mask 1 but the engine did not generate it"
            )
        if trajectory.logprobs[j] != 0.0 or trajectory.versions[j] != NO_VERSION:
            raise AssertionError(
                f"{where}: token {j}, which the policy did not generate, has log-prob "
                f"{trajectory.logprobs[j]} and version {trajectory.versions[j]}; such tokens "
                f"carry 0.0 and NO_VERSION ({NO_VERSION})"
            )
    return tuple(spans)


def _evidence_generated(trajectory: Trajectory, served: Mapping[str, ServedTurn]) -> set[int]:
    """Positions the engine generated, by the evidence: the assistant turns whose tokens are
    exactly the final result of the request they name (other positions: not generated)."""
    out: set[int] = set()
    for turn in trajectory.assistant_turns():
        evidence = served.get(turn.request_id) if turn.request_id is not None else None
        if evidence is not None and trajectory.tokens[turn.start : turn.end] == tuple(
            evidence.result.tokens
        ):
            out.update(range(turn.start, turn.end))
    return out


# --------------------------------------------------------------------------------------------
# Rows as RLJob builds them
# --------------------------------------------------------------------------------------------
async def trajectory_batch(
    trajectories: Sequence[Trajectory],
    sampling: SamplingParams | Sequence[SamplingParams],
    advantages: Sequence[float] | None = None,
) -> Batch:
    """The batch an ``RLJob`` agent update reads for these trajectories, through the real store
    (``InProcessDataStore``, layout "padded"): ``prompt`` (``tokens[:prompt_length]``),
    ``response`` (the rest, tool and user tokens included), ``logprobs`` (0 where not
    generated), ``loss_mask``, ``advantage`` (default 0) and the sampling fields of
    ``sampling`` (one for all rows, or one per row)."""
    store = InProcessDataStore()
    fields = ["prompt", "response", "logprobs", LOSS_MASK, "advantage", *SAMPLING_FIELDS]
    await store.create_partition("agent", fields, tasks=["trainer"])
    n = len(trajectories)
    params = [sampling] * n if isinstance(sampling, SamplingParams) else list(sampling)
    adv = [0.0] * n if advantages is None else list(advantages)
    data: dict[str, Any] = {
        "prompt": [],
        "response": [],
        "logprobs": [],
        LOSS_MASK: [],
        "advantage": [torch.tensor(a, dtype=torch.float32) for a in adv],
        **sampling_columns(params),
    }
    for t in trajectories:  # as RLJob._rollout_agents stores them
        p = t.prompt_length
        data["prompt"].append(torch.tensor(t.tokens[:p], dtype=torch.long))
        data["response"].append(torch.tensor(t.tokens[p:], dtype=torch.long))
        data["logprobs"].append(torch.tensor(t.logprobs[p:], dtype=torch.float32))
        data[LOSS_MASK].append(torch.tensor(t.loss_mask[p:], dtype=torch.uint8))
    await store.put("agent", data)
    meta = await store.get_meta("agent", "trainer", fields, n, timeout=60)
    return await store.get_data(meta, layout="padded")


def trajectory_agreement(
    trajectories: Sequence[Trajectory],
    trainer: torch.Tensor,
    *,
    turns: Literal["all", "first", "later"] = "all",
) -> Agreement:
    """Compare each trajectory's generated tokens' log-probs with the trainer's
    ``trainer[i, j]`` (``j`` a response position, ``loss_mask == 1``); ``turns`` keeps the
    first assistant turn's tokens only, or the later turns' only."""
    diffs: list[torch.Tensor] = []
    rows: list[float] = []
    for i, t in enumerate(trajectories):
        p = t.prompt_length
        first = t.assistant_turns()[0].end if t.assistant_turns() else p
        keep = [
            j - p
            for j in range(p, len(t.tokens))
            if t.loss_mask[j] and (turns == "all" or (turns == "first") == (j < first))
        ]
        n = len(t.tokens) - p
        if trainer.shape[1] < n:
            raise AssertionError(
                f"compute_logprobs returned {trainer.shape[1]} columns for row {i}, whose "
                f"response has {n} tokens; it returns [B, T] with T >= the longest response"
            )
        reported = torch.tensor([t.logprobs[p + j] for j in keep], dtype=torch.float64)
        mine = trainer[i, keep].detach().to("cpu", torch.float64)
        diff = (mine - reported).abs()
        diffs.append(diff)
        rows.append(float(diff.mean()) if diff.numel() else math.nan)
    every = torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)
    if not every.numel():
        return Agreement(0, math.nan, math.nan, tuple(rows))
    if bool((~torch.isfinite(every)).any()):
        return Agreement(int(every.numel()), math.inf, math.inf, tuple(rows))
    return Agreement(int(every.numel()), float(every.mean()), float(every.max()), tuple(rows))


def importance_weighted_loss(
    logprobs: torch.Tensor, batch: Batch
) -> tuple[torch.Tensor, Mapping[str, float]]:
    """``-mean(advantage · exp(logprob - behaviour logprob))`` over the ``loss_mask == 1``
    response tokens (``response_mask``): a loss whose value moves with the behaviour log-probs
    of every token it counts, so a trainer that lets masked tokens in shows it (law 3)."""
    adv = torch.as_tensor(batch["advantage"], dtype=logprobs.dtype).reshape(-1, 1)
    behaviour = torch.as_tensor(batch[BEHAVIOUR_LOGPROBS], dtype=logprobs.dtype)
    behaviour = behaviour[:, : logprobs.shape[1]].to(logprobs.device)
    mask = response_mask(logprobs, batch).to(logprobs.dtype)
    ratio = torch.exp(logprobs - behaviour) * mask
    loss = -(adv.to(logprobs.device) * ratio).sum() / mask.sum().clamp(min=1.0)
    return loss, {"iw_loss": float(loss.detach())}


def _with_fields(batch: Batch, extra: Mapping[str, torch.Tensor], like: str) -> Batch:
    lengths = dict(batch.lengths)
    for name in extra:
        if like in lengths:
            lengths[name] = lengths[like]
    return Batch(batch.rows, {**batch.data, **extra}, lengths, batch.tags)


def _row_values(batch: Batch, name: str, i: int) -> list[Any]:
    """Row ``i`` of field ``name`` (padded or list layout), its real length only."""
    value = batch[name]
    if isinstance(value, torch.Tensor):
        row = value[i]
        if name in batch.lengths:
            row = row[: int(batch.lengths[name][i])]
        elif name == LOSS_MASK and "response" in batch.lengths:
            row = row[: int(batch.lengths["response"][i])]
        out: list[Any] = row.tolist()
        return out
    listed: list[Any] = torch.as_tensor(value[i]).tolist()
    return listed


# --------------------------------------------------------------------------------------------
# The suite
# --------------------------------------------------------------------------------------------
@dataclass
class _Law:
    """One law's objects: the raw engine, its recording proxy, the loop, the trainer and the
    sync (when the law trains)."""

    engine: Any
    proxy: InferenceEngine
    recorder: AgentRecorder
    router: RequestRouter
    loop: Any
    policy: str
    trainer: Any = None
    sync: Any = None
    synced: bool = False

    def served(self) -> dict[str, ServedTurn]:
        return served_turns(self.recorder.generates)


@dataclass(frozen=True, slots=True)
class _LoggedRun:
    trajectory_id: str
    index: int
    trajectory: Trajectory | None
    error: BaseException | None = None


class _LoggedLoop:
    """An ``AgentLoop`` around the backend's, noting each run's client, sample and outcome (the
    job law); the sample's index is found by equality among the samples the job was fed."""

    def __init__(self, inner: Any, fed: list[Mapping[str, Any]]) -> None:
        self.inner = inner
        self.fed = fed
        self.runs: list[_LoggedRun] = []

    async def run(self, sample: Mapping[str, Any], client: GenerationClient) -> Trajectory:
        index = next((i for i, s in enumerate(self.fed) if s == sample), -1)
        try:
            trajectory: Trajectory = await self.inner.run(sample, client)
        except BaseException as exc:
            self.runs.append(_LoggedRun(client.trajectory_id, index, None, exc))
            raise
        self.runs.append(_LoggedRun(client.trajectory_id, index, trajectory))
        return trajectory


class _BatchSpy(RecordingTrainEngine):
    """A ``RecordingTrainEngine`` keeping every batch ``train_step`` receives, the trainer's
    version before each step (``befores``) and the version of the last step that returned
    (``completed``: a lower bound of the trainer's version from then on)."""

    def __init__(self, inner: TrainEngine, recorder: Recorder) -> None:
        super().__init__(inner, recorder, "trainer")
        self.batches: list[Batch] = []
        self.befores: list[Version] = []
        self.completed: Version = inner.weight_version

    async def train_step(self, batch: Batch, loss_fn: LossFn) -> Any:
        self.batches.append(batch)
        self.befores.append(self.weight_version)
        metrics = await super().train_step(batch, loss_fn)
        self.completed = max(self.completed, self.weight_version)
        if isinstance(self._recorder, AgentRecorder):
            self._recorder.notify()
        return metrics


class AgentLoopConformance(_Suite):
    """The agent-loop laws (module docstring); subclass it (as ``Test...``) and implement
    ``make_loop``, ``make_inference``, ``make_trainer`` and ``sample``; optionally
    ``make_tool_policy``, ``make_sync``, ``make_loss``, ``tool_errors`` and ``close_loop``."""

    # -- sampling of every turn (the job's settings; rows carry them) ------------------------
    temperature: ClassVar[float] = 1.0
    top_k: ClassVar[int] = 0
    top_p: ClassVar[float] = 1.0
    max_tokens: ClassVar[int] = 16
    """Tokens per turn (the turn cap of ``SamplingParams``)."""
    stop_token_ids: ClassVar[tuple[int, ...]] = ()
    """The tokens that end a turn (the chat format's ``stop_token_ids``)."""
    seed: ClassVar[int | None] = 1234
    """Sample ``i``'s client samples with ``seed + 1009 * i`` (and the turn index added by the
    client); None: unseeded."""
    limits: ClassVar[TrajectoryLimits] = TrajectoryLimits(max_turns=4, max_total_tokens=256)
    """The clients' ``TrajectoryLimits`` (keep ``max_total_tokens`` within the model's
    context)."""
    # -- sizes -------------------------------------------------------------------------------
    samples_per_law: ClassVar[int] = 4
    """Samples run (concurrently) by laws 1-3."""
    failure_samples: ClassVar[int] = 4
    """Samples run concurrently by the failure law, per failure kind."""
    interrupt_after_tokens: ClassVar[int] = 2
    """The interruption law aborts the first turn once it has this many tokens."""
    max_attempts: ClassVar[int] = 6
    """Samples the interruption law tries before giving up (a turn that ends before
    ``interrupt_after_tokens`` cannot be interrupted)."""
    logprob_atol: ClassVar[float] = 1e-3
    """Bound on the mean |trainer - engine| log-prob over the generated tokens."""
    logprob_max_atol: ClassVar[float] = 1e-2
    """Bound on the largest |trainer - engine| log-prob of one generated token."""
    mask_rtol: ClassVar[float] = 1e-3
    """How far (relatively) ``train_step``'s loss and grad norm may move when only the
    log-prob fields of tokens the policy did not generate change (law 3)."""
    bucket_bytes: ClassVar[int] = 1 << 30
    # -- failures ----------------------------------------------------------------------------
    tool_failures: ClassVar[tuple[ToolFailure, ...]] = TOOL_FAILURES
    """The failure law's kinds, one test each."""
    unsupported_failures: ClassVar[Mapping[str, str]] = {}
    """Failure kinds the backend cannot produce -> why (those tests are skipped with it)."""
    job_failures: ClassVar[tuple[ToolFailure, ...]] = TOOL_FAILURES
    """The failure kinds the job law runs an ``RLJob`` under, one test each."""
    job_steps: ClassVar[int] = 2
    job_verify_sync: ClassVar[str] = "off"
    """The job law's ``RLConfig.verify_sync``: off (sync verification has its own law in
    ``EnginePairConformance``, and a scripted policy's log-probs are not a model's)."""
    job_prompts_per_step: ClassVar[int] = 2
    job_n: ClassVar[int] = 2
    job_timeout_s: ClassVar[float] = 120.0
    """Seconds (loop clock) the job law's ``RLJob.run`` may take."""
    job_staleness: ClassVar[tuple[int, ...]] = (0, 1)
    """The staleness bounds η the staleness law (law 6) runs an ``RLJob`` under, one test
    each; () skips it."""
    staleness_steps: ClassVar[int] = 4
    """Steps of the staleness law's ``RLJob`` (enough for its straggler to age past η)."""

    # -- hooks for the backend author --------------------------------------------------------
    def make_loop(self, tool_failure: ToolFailure | None) -> AgentLoop | Awaitable[AgentLoop]:
        """A fresh agent loop (sync or async factory; called on the law's event loop) whose
        tools fail as ``tool_failure`` says on every call: ``"raises"`` (the tool raises),
        ``"times_out"`` (it hangs past the loop's tool timeout), ``"malformed"``,
        ``"unknown_tool"``, ``"bad_arguments"`` (the tools work: the tool policy writes a call
        that does not parse, calls a tool the loop does not have, or passes arguments that
        violate the tool's schema), None (the tools work)."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement make_loop(self, tool_failure) -> AgentLoop"
        )

    def make_inference(self) -> InferenceEngine | Awaitable[InferenceEngine]:
        """A fresh inference engine of the model (that the sync can load weights into)."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement make_inference(self) -> InferenceEngine"
        )

    def make_trainer(self) -> TrainEngine | Awaitable[TrainEngine]:
        """A fresh trainer of the same model (it must accept the tool policy's tokens too:
        the job law trains on them)."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement make_trainer(self) -> TrainEngine"
        )

    def make_tool_policy(
        self, tool_failure: ToolFailure | None
    ) -> InferenceEngine | Awaitable[InferenceEngine] | None:
        """An engine whose turns call the loop's tools (a scripted policy: a random model does
        not write tool calls), writing a call that does not parse when ``tool_failure`` is
        ``"malformed"``, one naming a tool the loop does not have for ``"unknown_tool"``, one
        whose arguments violate the tool's schema (a required argument missing, an unknown one,
        a wrong type) for ``"bad_arguments"``; it serves laws 1 ``[tools]``, 3, 5 and 6. None
        (default): the model's engine serves them (a model that calls tools by itself)."""
        return None

    def make_sync(self, targets: Sequence[Any]) -> WeightSync | Awaitable[WeightSync]:
        """A fresh ``WeightSync`` from the trainer into ``targets`` (default
        ``InProcessWeightSync``)."""
        return InProcessWeightSync(targets)

    def make_loss(self) -> LossFn:
        """The job's loss (law 3; default ``policy_gradient_loss``)."""
        return policy_gradient_loss

    def sample(self, index: int) -> Mapping[str, Any]:
        """The ``index``-th sample the loop accepts; samples of different indices differ and
        so do their prompts (the job law tells samples apart by them)."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement sample(self, index) -> dict, distinct per index"
        )

    def tool_errors(self, trajectory: Trajectory) -> int:
        """How many tool failures the trajectory shows (default: ``Trajectory.stats()
        ["tool_errors"]``, from the turns' ``tool_errors`` meta); override when the loop
        reports them otherwise (e.g. an agent program writing ``error: ...`` tool messages)."""
        return int(trajectory.stats()["tool_errors"])

    async def close_loop(self, loop: Any) -> None:
        """Release a loop after a law (default: its ``close()``, if it has one)."""
        await _close(loop)

    def progress(self, engine: Any) -> ProgressHook | None:
        """How the interruption law sees a turn's tokens (default: the engine's
        ``SupportsProgress.wait_for_tokens``)."""
        return engine.wait_for_tokens if isinstance(engine, SupportsProgress) else None

    # -- description -------------------------------------------------------------------------
    @classmethod
    def describe_backend(cls) -> str:
        """One line: what the class declares and the abilities its laws need."""
        own = cls.make_tool_policy is not AgentLoopConformance.make_tool_policy
        policy = "make_tool_policy (laws 1[tools], 3, 5, 6)" if own else "the model's engine"
        kinds = [k for k in cls.tool_failures if k not in cls.unsupported_failures]
        skipped = "; ".join(f"{k}: {why}" for k, why in cls.unsupported_failures.items())
        loss = getattr(cls.make_loss, "__qualname__", "make_loss")
        if cls.make_loss is AgentLoopConformance.make_loss:
            loss = "policy_gradient_loss"
        return (
            f"{cls.__qualname__} [{cls.__module__}]: tool turns from {policy}; tool failures "
            f"{kinds}{f' (skipped: {skipped})' if skipped else ''}; job law under "
            f"{list(cls.job_failures)}; staleness law at eta {list(cls.job_staleness)}; loss "
            f"{loss}; sampling temperature={cls.temperature} "
            f"top_k={cls.top_k} top_p={cls.top_p} max_tokens={cls.max_tokens}; the "
            "interruption law needs SupportsPause and SupportsProgress on the model's engine"
        )

    @classmethod
    def report_lines(cls) -> list[str]:
        """What this class's laws saw so far in this process (one line per law run)."""
        return [cls.describe_backend(), *REPORT.get(cls.__qualname__, [])]

    def _note(self, law: str, text: str) -> None:
        REPORT.setdefault(type(self).__qualname__, []).append(f"{law}: {text}")

    # -- pytest plumbing ---------------------------------------------------------------------
    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "agent_policy" in metafunc.fixturenames:
            metafunc.parametrize("agent_policy", POLICIES)
        if "tool_failure" in metafunc.fixturenames:
            metafunc.parametrize("tool_failure", list(self.tool_failures))
        if "job_failure" in metafunc.fixturenames:
            metafunc.parametrize("job_failure", list(self.job_failures))
        if "job_eta" in metafunc.fixturenames:
            metafunc.parametrize("job_eta", list(self.job_staleness))

    def job_sampling(self) -> SamplingParams:
        """The sampling of every turn (the job's ``RLConfig.sampling``; rows carry it)."""
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            stop_token_ids=tuple(self.stop_token_ids),
            seed=self.seed,
        )

    def _client_sampling(self, index: int) -> SamplingParams:
        base = self.job_sampling()
        if base.seed is None:
            return base
        return dataclasses.replace(base, seed=base.seed + 1009 * index)

    def _skip_failure(self, kind: ToolFailure | None) -> None:
        if kind is not None and kind in self.unsupported_failures:
            pytest.skip(f"tool failure {kind!r}: {self.unsupported_failures[kind]}")

    async def _engine(
        self, policy: Policy, failure: ToolFailure | None, *, fallback: bool
    ) -> tuple[Any, str]:
        if policy == "tools":
            made = await self._wait(
                _resolve(self.make_tool_policy(failure)), f"make_tool_policy({failure!r})"
            )
            if made is not None:
                label = "the tool policy"
                engine: Any = made
            elif fallback:
                engine, label = await self._engine("model", failure, fallback=False)
            else:
                pytest.skip(
                    "make_tool_policy() is not provided: case 'model' runs this law on the "
                    "model's own turns (tool calls included)"
                )
        else:
            engine = await self._wait(_resolve(self.make_inference()), "make_inference()")
            label = "the model"
        assert isinstance(engine, InferenceEngine), (
            f"{label}'s engine is a {type(engine).__name__}, not an InferenceEngine"
        )
        return engine, label

    def _law(
        self,
        name: str,
        body: Callable[[_Law], Coroutine[Any, Any, None]],
        *,
        policy: Policy,
        failure: ToolFailure | None = None,
        fallback: bool = True,
        trainer: bool = False,
    ) -> None:
        self._skip_failure(failure)

        async def main() -> None:
            owned: list[Any] = []
            loop: Any = None
            try:
                engine, label = await self._engine(policy, failure, fallback=fallback)
                owned.append(engine)
                law = _Law(engine, engine, AgentRecorder(), RequestRouter(["0"]), None, label)
                if trainer:
                    made = await self._wait(_resolve(self.make_trainer()), "make_trainer()")
                    assert isinstance(made, TrainEngine), (
                        f"make_trainer() returned {type(made).__name__}, not a TrainEngine"
                    )
                    owned.append(made)
                    law.trainer = made
                loop = await self._wait(
                    _resolve(self.make_loop(failure)), f"make_loop({failure!r})"
                )
                assert isinstance(loop, AgentLoop), (
                    f"make_loop() returned {type(loop).__name__}, not an AgentLoop (an object "
                    "with async run(sample, client) -> Trajectory)"
                )
                law.loop = loop
                law.proxy = RecordingAgentEngine.wrap(engine, law.recorder, "engine")
                await body(law)
            finally:
                if loop is not None:
                    with contextlib.suppress(Exception):
                        await self._wait(self.close_loop(loop), "close_loop()")
                for obj in reversed(owned):
                    with contextlib.suppress(Exception):
                        await self._wait(self.close_engine(obj), "close_engine()")

        self._run(name, main)

    def _client(self, law: _Law, tid: str, index: int) -> GenerationClient:
        return GenerationClient(
            [law.proxy], law.router, tid, sampling=self._client_sampling(index),
            limits=self.limits, partial_rollout=True,
        )  # fmt: skip

    async def _run_sample(self, law: _Law, tag: str, index: int) -> tuple[str, Trajectory]:
        tid = f"{tag}{index}"
        loop = law.loop
        what = f"{type(loop).__name__}.run(sample {index})"
        try:
            trajectory = await self._wait(
                loop.run(self.sample(index), self._client(law, tid, index)), what
            )
        except AssertionError:
            raise
        except Exception as exc:
            raise LoopRaised(f"{what} raised {type(exc).__name__}: {exc}") from exc
        _validated(trajectory, f"{what} ({law.policy})")
        return tid, trajectory

    async def _run_samples(
        self, law: _Law, tag: str, indices: Sequence[int]
    ) -> list[tuple[str, Trajectory]]:
        return list(await asyncio.gather(*(self._run_sample(law, tag, i) for i in indices)))

    async def _train(self, law: _Law, trajectories: Sequence[Trajectory]) -> Version:
        """One train step on the trajectories' rows (advantages ±1: the weights move)."""
        useful = [t for t in trajectories if t.generated]
        assert useful, "no trajectory generated a token: nothing to train the trainer on"
        advantages = [1.0 if i % 2 == 0 else -1.0 for i in range(len(useful))]
        batch = await trajectory_batch(useful, self.job_sampling(), advantages)
        before = law.trainer.weight_version
        await self._wait(law.trainer.train_step(batch, policy_gradient_loss), "train_step()")
        version: Version = law.trainer.weight_version
        assert version == before + 1, f"train_step took the version from {before} to {version}"
        return version

    async def _sync(self, law: _Law, version: Version) -> None:
        """The trainer's weights into the engine, as ``version``."""
        if law.sync is None:
            law.sync = await self._wait(
                _resolve(self.make_sync([law.engine])), "make_sync([engine])"
            )
            assert isinstance(law.sync, WeightSync), (
                f"make_sync() returned {type(law.sync).__name__}, not a WeightSync"
            )
        await self._transfer(law.sync, law.trainer, version, self.bucket_bytes, init=not law.synced)
        law.synced = True
        assert law.engine.weight_version == version, (
            f"after the sync to version {version} the engine reports {law.engine.weight_version}"
        )

    def _job_transport(self, targets: Sequence[Any]) -> WeightSync:
        """``make_sync`` on the engines behind the job's recording proxies (it must build the
        transport synchronously: ``RLEngines.make_transport`` is a plain callable)."""
        engines = [t.inner if isinstance(t, RecordingInferenceEngine) else t for t in targets]
        made = self.make_sync(engines)
        if inspect.isawaitable(made):
            close = getattr(made, "close", None)
            if callable(close):
                close()
            raise AssertionError(
                "make_sync returned an awaitable: the job law hands it to RLEngines."
                "make_transport, which builds the transport synchronously"
            )
        return made

    async def _run_job(
        self, law: _Law, spy: _BatchSpy, setting: str, hint: str, **config: Any
    ) -> tuple[RLJob, RLResult, _LoggedLoop]:
        """An ``RLJob`` (the job sizes, ``config`` on top) on the law's recording proxy and
        ``spy`` (around the law's trainer), fed ``sample(1000)``, ``sample(1001)``, ...; run
        within ``job_timeout_s``. A job that fails is an ``AssertionError`` naming
        ``setting``, the loop's own error (if it raised) and ``hint``."""
        fed: list[Mapping[str, Any]] = []

        def samples() -> Iterator[Mapping[str, Any]]:
            for i in itertools.count(1000):
                sample = self.sample(i)
                fed.append(sample)
                yield sample

        logged = _LoggedLoop(law.loop, fed)
        sizes: dict[str, Any] = {
            "steps": self.job_steps, "prompts_per_step": self.job_prompts_per_step,
            "n": self.job_n, "sampling": self.job_sampling(),
            "trajectory_limits": self.limits, "verify_sync": self.job_verify_sync,
        }  # fmt: skip
        settings = RLConfig(**{**sizes, **config})
        engines = RLEngines([law.proxy], spy, make_transport=self._job_transport)
        job = RLJob(settings, engines, samples(), agent=logged, reward_fn=_length_reward)
        try:
            result: RLResult = await bounded_job(job.run(), self.job_timeout_s)
        except AssertionError:
            raise
        except Exception as exc:
            raised = next((r for r in logged.runs if r.error is not None), None)
            detail = (
                f"; the loop raised {type(raised.error).__name__}: {raised.error} on sample "
                f"{raised.index}"
                if raised is not None
                else ""
            )
            raise AssertionError(
                f"RLJob failed {setting}: {type(exc).__name__}: {exc}{detail}. {hint}"
            ) from exc
        return job, result, logged

    # -- law 1 -------------------------------------------------------------------------------
    def test_the_mask_covers_exactly_the_generated_tokens(self, agent_policy: Policy) -> None:
        """Law 1 (module docstring) on ``samples_per_law`` concurrent samples. ``[model]``:
        the model's engine; ``[tools]``: the tool policy, whose trajectories must hold tool
        turns (skipped without ``make_tool_policy``)."""
        name = f"test_the_mask_covers_exactly_the_generated_tokens[{agent_policy}]"

        async def body(law: _Law) -> None:
            runs = await self._run_samples(
                law, f"mask-{agent_policy}-", range(self.samples_per_law)
            )
            served = law.served()
            between = 0
            for tid, t in runs:
                check_token_accounting(t, served, tid, where=f"{law.policy}, sample {tid!r}")
                between += _context_between_turns(t)
            if agent_policy == "tools":
                assert between, (
                    f"the tool policy's {len(runs)} trajectories hold no tool, environment or "
                    "user turn after a generated one: make_tool_policy must give an engine "
                    "whose turns call the loop's tools"
                )
            self._note(name, _summary(runs))

        self._law(name, body, policy=agent_policy, fallback=False)

    # -- law 2 -------------------------------------------------------------------------------
    def test_trainer_logprobs_of_generated_tokens_equal_the_engines(self) -> None:
        """Law 2 (module docstring): train one step on a first round of trajectories, sync,
        run the loop on other samples; the trainer's log-probs of their generated tokens
        (rows built as ``RLJob`` does) equal the engine's."""
        name = "test_trainer_logprobs_of_generated_tokens_equal_the_engines"
        n = self.samples_per_law

        async def body(law: _Law) -> None:
            warm = await self._run_samples(law, "warm-", range(n))
            version = await self._train(law, [t for _, t in warm])
            await self._sync(law, version)
            runs = await self._run_samples(law, "after-", range(n, 2 * n))
            trajectories = [t for _, t in runs if t.generated]
            assert trajectories, "no trajectory generated a token after the sync"
            stale = sorted(
                {
                    v
                    for t in trajectories
                    for v, m in zip(t.versions, t.loss_mask, strict=True)
                    if m and v != version
                }
            )
            assert not stale, (
                f"tokens generated after the sync to version {version} report versions {stale}"
            )
            batch = await trajectory_batch(trajectories, self.job_sampling())
            lp = await self._wait(law.trainer.compute_logprobs(batch), "compute_logprobs()")
            agreement = trajectory_agreement(trajectories, lp)
            self._note(name, f"{_summary(runs)}; {agreement.describe()}")
            if agreement.within(self.logprob_atol, self.logprob_max_atol):
                return
            first = trajectory_agreement(trajectories, lp, turns="first")
            later = trajectory_agreement(trajectories, lp, turns="later")
            hints = [f"first turns: {first.describe()}; later turns: {later.describe()}"]
            if later.tokens and first.within(self.logprob_atol, self.logprob_max_atol):
                hints.append(
                    "only the turns after the first disagree: the trajectory's context between "
                    "turns is not the one the engine saw (edited or re-tokenised history)"
                )
            job = self.job_sampling()
            sampled = {
                (s.request.params.temperature, s.request.params.top_k, s.request.params.top_p)
                for s in law.served().values()
                if s.request.request_id.startswith("after-")
            }
            wanted = (job.temperature, job.top_k, job.top_p)
            other = sorted(x for x in sampled if x != wanted)
            if other:
                hints.append(
                    f"the engine was asked to sample with (temperature, top_k, top_p) {other}, "
                    f"but the job's rows say {wanted}: the loop changed the client's sampling, "
                    "so the trainer scores the tokens under another distribution than the one "
                    "they were drawn from"
                )
            raise AssertionError(
                f"after a sync to version {version}, the trainer's log-probs of the generated "
                f"tokens (rows built as RLJob builds them: prompt = tokens[:prompt_length], "
                f"response = the rest, loss_mask) differ from the engine's: "
                f"{agreement.describe()} (tolerance: mean {self.logprob_atol}, max "
                f"{self.logprob_max_atol}). " + "; ".join(hints)
            )

        self._law(name, body, policy="model", trainer=True)

    # -- law 3 -------------------------------------------------------------------------------
    async def _through_train_step(
        self,
        trainer: Any,
        batch: Batch,
        outside: Sequence[Sequence[int]],
        generated: Sequence[set[int]],
        trajectories: Sequence[Trajectory],
    ) -> None:
        """Law 3 through the trainer: from one checkpoint, ``train_step`` on the trajectory
        batch and on the same batch with the behaviour, proximal and reference log-probs of
        the tokens the policy did not generate moved report the same loss and grad norm
        (``mask_rtol``), under ``importance_weighted_loss`` (which reads those fields); moving
        those of generated tokens changes them. Catches a trainer that drops the
        ``loss_mask`` before the loss or slices it wrongly into micro-batches."""
        behaviour = batch[BEHAVIOUR_LOGPROBS].float()

        def moved(rows: Sequence[Iterable[int]]) -> Batch:
            values = behaviour.clone()
            for i, cols in enumerate(rows):
                for j in cols:
                    values[i, j] -= 2.5 + 0.01 * j
            fields = {BEHAVIOUR_LOGPROBS: values, PROX_LOGPROBS: values, REF_LOGPROBS: values}
            return _with_fields(batch, fields, "response")

        tool = moved(outside)
        pairs = zip(trajectories, generated, strict=True)
        own = moved([{g - t.prompt_length for g in gen} for t, gen in pairs])
        loss_fn = importance_weighted_loss
        metrics: dict[str, TrainMetrics] = {}
        with tempfile.TemporaryDirectory(prefix="asyncflow-agent-mask-") as tmp:
            path = str(Path(tmp) / "checkpoint")
            await self._wait(trainer.save_checkpoint(path), "save_checkpoint()")
            for label, rows in (("as is", batch), ("tool moved", tool), ("own moved", own)):
                await self._wait(trainer.load_checkpoint(path), "load_checkpoint()")
                metrics[label] = await self._wait(trainer.train_step(rows, loss_fn), "train_step()")

        a, b, c = metrics["as is"], metrics["tool moved"], metrics["own moved"]
        assert metrics_apart(a, b) <= self.mask_rtol, (
            f"train_step on the trajectories reported loss {a.loss:.6g} and grad norm "
            f"{a.grad_norm:.6g}; with the behaviour/proximal/reference log-probs of the tokens "
            f"the policy did not generate moved: {b.loss:.6g}, {b.grad_norm:.6g}. Tool output "
            "reaches the loss through train_step: the trainer must hand the loss each "
            "micro-batch's loss_mask rows"
        )
        assert metrics_apart(a, c) > 10 * self.mask_rtol, (
            f"moving the behaviour log-probs of the generated tokens left train_step's loss "
            f"({a.loss:.6g} -> {c.loss:.6g}) and grad norm unchanged: the law cannot see the "
            "mask through train_step"
        )

    def test_tool_output_is_never_trained_on(self) -> None:
        """Law 3 (module docstring) on ``samples_per_law`` trajectories of the tool policy
        (the model's engine without one; skipped if no trajectory holds a turn between
        generated ones)."""
        name = "test_tool_output_is_never_trained_on"
        n = self.samples_per_law

        async def body(law: _Law) -> None:
            runs = await self._run_samples(law, "loss-", range(n))
            trajectories = [t for _, t in runs]
            served = law.served()
            generated = [_evidence_generated(t, served) for t in trajectories]
            outside = [
                [j - t.prompt_length for j in range(t.prompt_length, len(t.tokens)) if j not in g]
                for t, g in zip(trajectories, generated, strict=True)
            ]
            if not any(outside):
                pytest.skip(
                    f"none of {n} trajectories of {law.policy} holds a token between generated "
                    "turns (a tool's, an environment's or a user's): nothing to check; give "
                    "make_tool_policy an engine that calls the tools"
                )
            advantages = [1.0 if i % 2 == 0 else -1.0 for i in range(n)]
            batch = await trajectory_batch(trajectories, self.job_sampling(), advantages)
            behaviour = batch["logprobs"].float()
            batch = _with_fields(
                batch,
                {PROX_LOGPROBS: behaviour.clone(), REF_LOGPROBS: behaviour.clone()},
                "response",
            )
            for i, (t, cols) in enumerate(zip(trajectories, outside, strict=True)):
                mask = _row_values(batch, LOSS_MASK, i)
                trained = [j for j in cols if mask[j]]
                if trained:
                    j = trained[0]
                    role = _role_at(t, t.prompt_length + j)
                    raise AssertionError(
                        f"sample {runs[i][0]!r}: response token {j} (in a turn the trajectory "
                        f"labels {role!r}; the engine did not generate it) has loss_mask 1 in "
                        f"the row, as do "
                        f"{len(trained) - 1} more: tool output would be trained on. loss_mask "
                        "is 1 exactly on the tokens the policy generated"
                    )
            loss_fn = self.make_loss()
            width = behaviour.shape[1]
            offsets = 0.05 * (torch.arange(width, dtype=torch.float32) % 3)
            point = (behaviour - offsets).detach().requires_grad_(True)
            loss, _ = loss_fn(point, batch)
            (grad,) = torch.autograd.grad(loss, point, allow_unused=True)
            grad = torch.zeros_like(point) if grad is None else grad
            for i, (t, cols) in enumerate(zip(trajectories, outside, strict=True)):
                hit = [j for j in cols if float(grad[i, j]) != 0.0]
                if hit:
                    j = hit[0]
                    role = _role_at(t, t.prompt_length + j)
                    raise AssertionError(
                        f"sample {runs[i][0]!r}: the loss's gradient with respect to the "
                        f"log-prob of response token {j} (in a {role} turn, not generated) "
                        f"is {float(grad[i, j]):.3g} ({len(hit)} such "
                        "tokens): tool output is trained on. The loss must count only the "
                        "loss_mask == 1 tokens (asyncflow_core.training.rl.response_mask)"
                    )
            moved = point.detach().clone()
            for i, cols in enumerate(outside):
                for j in cols:
                    moved[i, j] -= 2.5 + 0.01 * j
            again, _ = loss_fn(moved, batch)
            assert torch.equal(loss.detach(), again.detach()), (
                f"changing the log-probs of the tokens the policy did not generate changed the "
                f"loss from {float(loss):.6g} to {float(again):.6g}: tool output reaches the "
                "loss. The loss must count only the loss_mask == 1 tokens"
            )
            kept = torch.zeros_like(grad, dtype=torch.bool)
            for i, (t, g) in enumerate(zip(trajectories, generated, strict=True)):
                for j in g:
                    kept[i, j - t.prompt_length] = True
            assert bool((grad[kept] != 0).any()), (
                "the loss has a zero gradient at every generated token too: the law cannot tell "
                "a masked loss from a constant one (make_loss must train the generated tokens)"
            )
            await self._through_train_step(law.trainer, batch, outside, generated, trajectories)
            self._note(
                name,
                f"{_summary(runs)}; {sum(len(c) for c in outside)} response tokens not "
                "generated: mask 0, gradient 0, loss unchanged, also through train_step",
            )

        self._law(name, body, policy="tools", trainer=True)

    # -- law 4 -------------------------------------------------------------------------------
    def test_an_interrupted_trajectory_resumes_with_versions_intact(self) -> None:
        """Law 4 (module docstring): the first turn of a sample is aborted after
        ``interrupt_after_tokens`` tokens (pause ``"abort"``), the trainer's next weights are
        synced in, the engine resumes; tried on up to ``max_attempts`` samples until a first
        turn lasts long enough."""
        name = "test_an_interrupted_trajectory_resumes_with_versions_intact"
        k = self.interrupt_after_tokens

        async def body(law: _Law) -> None:
            engine = law.engine
            missing = [
                ability
                for ability, has in (
                    ("SupportsPause (pause('abort') / resume)", isinstance(engine, SupportsPause)),
                    ("SupportsProgress (wait_for_tokens)", self.progress(engine) is not None),
                )
                if not has
            ]
            if missing:
                pytest.skip(
                    f"{type(engine).__name__} lacks {' and '.join(missing)}: the law cannot "
                    "interrupt a turn at a known token count (optional abilities)"
                )
            hook = self.progress(engine)
            assert hook is not None
            warm = await self._run_samples(law, "warm-", range(2))
            tried: list[str] = []
            for attempt in range(self.max_attempts):
                if law.trainer.weight_version <= engine.weight_version:
                    await self._train(law, [t for _, t in warm])
                version = law.trainer.weight_version
                before = engine.weight_version
                index = 100 + attempt
                tid = f"interrupt-{index}"
                client = self._client(law, tid, index)
                run = asyncio.ensure_future(law.loop.run(self.sample(index), client))
                try:
                    rid, have = await self._interrupt(law, run, tid, hook, version)
                    try:
                        trajectory = await self._wait(
                            run, f"{type(law.loop).__name__}.run(sample {index})"
                        )
                    except AssertionError:
                        raise
                    except Exception as exc:
                        raise AssertionError(
                            f"sample {index}: interrupted by a weight sync, the loop raised "
                            f"{type(exc).__name__}: {exc}; an aborted turn is resumed (partial "
                            "rollout), the trajectory goes on"
                        ) from exc
                finally:
                    if not run.done():
                        run.cancel()
                        await asyncio.gather(run, return_exceptions=True)
                served = law.served()
                evidence = served.get(rid)
                if evidence is None or not evidence.aborted:
                    tried.append(f"sample {index}: the first turn ended with {have} token(s)")
                    continue
                self._check_interrupted(trajectory, served, tid, rid, evidence, before, version)
                self._note(
                    name,
                    f"sample {index}: turn {rid!r} aborted after "
                    f"{len(evidence.aborted[-1].tokens)} tokens at version {before}, resumed at "
                    f"{version}; {_summary([(tid, trajectory)])}",
                )
                return
            raise AssertionError(
                f"no first turn lasted {k} tokens in {self.max_attempts} samples "
                f"({'; '.join(tried)}): raise max_tokens or lower interrupt_after_tokens"
            )

        self._law(name, body, policy="model", trainer=True)

    async def _interrupt(
        self,
        law: _Law,
        run: asyncio.Future[Trajectory],
        tid: str,
        hook: ProgressHook,
        version: Version,
    ) -> tuple[str, int]:
        """Wait for the first turn of client ``tid`` to start; once it has
        ``interrupt_after_tokens`` tokens, pause the engine ("abort"), sync the trainer's
        ``version`` in and resume. Returns the turn's request id and its token count when the
        engine said so (fewer: it ended first, and nothing was done)."""
        k = self.interrupt_after_tokens

        def first_turn() -> GenerationRequest | bool:
            found = (r for r in law.recorder.started if _in_family(r.group, tid))
            return next(found, None) or run.done()

        started = await self._wait(law.recorder.wait_for(first_turn), f"the first turn of {tid!r}")
        if not isinstance(started, GenerationRequest):
            await run  # the loop's error, if it raised
            raise AssertionError(f"{tid!r}: the loop returned without generating a turn")
        rid = started.request_id
        await asyncio.sleep(0)  # the generate reached its first await: in flight
        try:
            have: int = await self._wait(hook(rid, k), f"wait_for_tokens({rid!r}, {k})")
        except AsyncFlowError:
            return rid, -1  # it ended meanwhile
        if have >= k:
            engine = law.engine
            await self._wait(engine.pause("abort"), "pause('abort')")
            await self._sync(law, version)
            await self._wait(engine.resume(), "resume()")
        return rid, have

    def _check_interrupted(
        self,
        trajectory: Trajectory,
        served: Mapping[str, ServedTurn],
        tid: str,
        rid: str,
        evidence: ServedTurn,
        before: Version,
        after: Version,
    ) -> None:
        where = f"sample {tid!r}, interrupted by a sync to version {after}"
        _validated(trajectory, where)
        check_token_accounting(trajectory, served, tid, where=where)
        turn = next((t for t in trajectory.assistant_turns() if t.request_id == rid), None)
        assert turn is not None, (
            f"{where}: the interrupted turn (request {rid!r}) is not in the trajectory: it is "
            "one turn, resumed after the sync, of the same trajectory"
        )
        aborted = evidence.aborted[0]
        a = len(aborted.tokens)
        head = trajectory.tokens[turn.start : turn.start + a]
        head_versions = trajectory.versions[turn.start : turn.start + a]
        assert head == tuple(aborted.tokens) and head_versions == tuple(aborted.versions), (
            f"{where}: the {a} tokens generated before the interruption (version {before}) are "
            f"not the turn's first tokens (versions there: {sorted(set(head_versions))}): the "
            "turn was regenerated instead of resumed from its prefix; a turn aborted by a sync "
            "resumes with resume_tokens (partial rollout), keeping each token's version"
        )
        assert set(head_versions) <= {before}, (
            f"{where}: the tokens before the interruption report versions "
            f"{sorted(set(head_versions))}, not {before}"
        )
        late = [
            v
            for j, (v, m) in enumerate(zip(trajectory.versions, trajectory.loss_mask, strict=True))
            if m and j >= turn.start + a and v < after
        ]
        assert not late, (
            f"{where}: tokens generated after the sync report versions {sorted(set(late))}, "
            f"older than {after}"
        )

    # -- law 5 -------------------------------------------------------------------------------
    def test_a_failing_tool_cannot_lose_or_duplicate_a_trajectory(
        self, tool_failure: ToolFailure
    ) -> None:
        """Law 5 (module docstring): ``failure_samples`` samples run concurrently while the
        tools fail as ``tool_failure``; each returns its own, valid trajectory showing the
        failure, read by the model in a masked-out turn."""
        name = f"test_a_failing_tool_cannot_lose_or_duplicate_a_trajectory[{tool_failure}]"
        n = self.failure_samples

        async def body(law: _Law) -> None:
            tag = f"fail-{tool_failure}-"
            outcomes = await asyncio.gather(
                *(self._run_sample(law, tag, i) for i in range(n)), return_exceptions=True
            )
            for outcome in outcomes:
                if isinstance(outcome, BaseException) and not isinstance(outcome, LoopRaised):
                    raise outcome
            lost = [(i, o) for i, o in enumerate(outcomes) if isinstance(o, LoopRaised)]
            if lost:
                i, error = lost[0]
                cause = error.__cause__ or error
                what = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
                raise AssertionError(
                    f"{len(lost)} of {n} trajectories were lost when the loop's tools failed "
                    f"({tool_failure}): sample {i}: {what}. A failing "
                    "tool must become a tool message the model reads, never an exception out "
                    "of run(): the sample would be lost (and RLJob would stop)"
                )
            runs = [cast(tuple[str, Trajectory], o) for o in outcomes]
            served = law.served()
            for tid, t in runs:
                where = f"sample {tid!r}, tools failing ({tool_failure})"
                check_token_accounting(t, served, tid, where=where)
                errors = self.tool_errors(t)
                assert errors >= 1, (
                    f"{where}: the trajectory shows no tool error (tool_errors() == 0; it ended "
                    f"{t.ended!r} after {t.stats()['turns']} turn(s)): the failure must reach "
                    "the model as a (masked-out) tool message, and be counted"
                )
                assert _context_between_turns(t) or _ends_with_context(t), (
                    f"{where}: nothing follows the failing call in the trajectory (it ended "
                    f"{t.ended!r}): the model never read the failure; a failed call is answered "
                    "with a tool message"
                )
            self._note(name, _summary(runs))

        self._law(name, body, policy="tools", failure=tool_failure)

    def test_a_job_trains_each_trajectory_exactly_once(self, job_failure: ToolFailure) -> None:
        """Law 5 through ``RLJob`` (``job_steps`` steps, ``job_prompts_per_step`` samples of
        ``job_n`` trajectories each, the tools failing as ``job_failure``): the job finishes,
        every trajectory the loop returned is its sample's own, and every trained row is one
        of them, matched one to one, each trained sample exactly ``job_n`` times."""
        name = f"test_a_job_trains_each_trajectory_exactly_once[{job_failure}]"

        async def body(law: _Law) -> None:
            spy = _BatchSpy(law.trainer, law.recorder)
            _, _, logged = await self._run_job(
                law, spy, f"with its tools failing ({job_failure})",
                "A failing tool must become a tool message, never an exception that loses the "
                "trajectory and stops the job",
            )  # fmt: skip
            served = law.served()
            returned = [r for r in logged.runs if r.trajectory is not None]
            for r in returned:
                assert r.trajectory is not None
                check_ownership(
                    r.trajectory, served, r.trajectory_id,
                    where=f"RLJob, sample {r.index} (client {r.trajectory_id!r})",
                )  # fmt: skip
            prompts: dict[tuple[int, ...], int] = {}
            for r in returned:
                assert r.trajectory is not None
                assert r.index >= 0, (
                    f"the loop got a sample the job was not fed (client {r.trajectory_id!r}): "
                    "RLJob hands each sample to the loop as it was yielded"
                )
                p = tuple(r.trajectory.tokens[: r.trajectory.prompt_length])
                other = prompts.setdefault(p, r.index)
                assert other == r.index, (
                    f"samples {other} and {r.index} have the same prompt: the job law tells "
                    "samples apart by their prompts; make sample(index) differ per index"
                )
            used: set[int] = set()
            per_sample: Counter[int] = Counter()
            rows = 0
            for step, batch in enumerate(spy.batches, start=1):
                for i in range(len(batch.rows)):
                    rows += 1
                    key = (
                        tuple(_row_values(batch, "prompt", i)),
                        tuple(_row_values(batch, "response", i)),
                        tuple(_row_values(batch, LOSS_MASK, i)) if LOSS_MASK in batch else None,
                    )
                    candidates = [
                        k
                        for k, r in enumerate(returned)
                        if r.trajectory is not None
                        and _row_key(r.trajectory) == key[:2]
                        and (key[2] is None or _mask_key(r.trajectory) == key[2])
                    ]
                    assert candidates, (
                        f"RLJob step {step} trained a row (prompt of {len(key[0])} tokens, "
                        f"response of {len(key[1])}) that is no trajectory the loop returned"
                    )
                    free = [k for k in candidates if k not in used]
                    assert free, (
                        f"RLJob step {step} trained the trajectory of sample "
                        f"{returned[candidates[0]].index} again: each trajectory reaches the "
                        "update at most once"
                    )
                    used.add(free[0])
                    per_sample[returned[free[0]].index] += 1
            assert rows == self.job_steps * self.job_prompts_per_step * self.job_n, (
                f"RLJob trained {rows} rows in {len(spy.batches)} steps, not steps x "
                f"batch_size = {self.job_steps * self.job_prompts_per_step * self.job_n}"
            )
            wrong = {i: c for i, c in per_sample.items() if c != self.job_n}
            assert not wrong, (
                f"trained rows per sample (sample index: rows) {wrong}: each trained sample is "
                f"trained exactly n={self.job_n} times (its group), none twice, none lost"
            )
            errors = sum(
                self.tool_errors(t) for k in used if (t := returned[k].trajectory) is not None
            )
            self._note(
                name,
                f"{len(logged.runs)} runs, {rows} rows trained once each over "
                f"{len(per_sample)} samples; {errors} tool errors in the trained trajectories",
            )

        self._law(name, body, policy="tools", failure=job_failure, trainer=True)

    # -- law 6 -------------------------------------------------------------------------------
    def test_a_job_never_trains_a_trajectory_staler_than_eta(self, job_eta: int) -> None:
        """Law 6 (module docstring): an ``RLJob`` with staleness ``job_eta``, staged weight
        syncs and partial rollout, the tools working; trained rows, turn starts and
        regenerations are held against the trajectories the loop returned."""
        name = f"test_a_job_never_trains_a_trajectory_staler_than_eta[{job_eta}]"
        eta = job_eta

        async def body(law: _Law) -> None:
            spy = _BatchSpy(law.trainer, law.recorder)
            starts: dict[str, Version] = {}
            straggler: list[object] = []
            steps = self.staleness_steps

            def on_start(request: GenerationRequest) -> None:
                # a lower bound of the trainer's version when the client decided to start
                # this turn (synchronously before): the last step that returned
                starts.setdefault(request.request_id, spy.completed)
                if eta >= 1 and not straggler:
                    straggler.append(request.group)

            async def hold(request: GenerationRequest) -> None:
                """The first trajectory is a straggler: each of its turns is answered only
                once the trainer has stepped past the version it started at and the engine
                has loaded those weights (or the job's last step began), so it ages a version
                per turn while the other groups go on (needs η >= 1: with η = 0 the job
                cannot step without it)."""
                if not straggler or request.group != straggler[0]:
                    return
                target = starts[request.request_id] + 1

                def aged() -> bool:
                    synced = law.engine.weight_version >= target
                    return len(spy.befores) >= steps or (spy.completed >= target and synced)

                await self._wait(
                    law.recorder.wait_for(aged),
                    f"the straggler's turn {request.request_id!r}: the trainer's step to "
                    f"version {target} and its sync",
                )

            law.recorder.on_start = on_start
            law.recorder.hold = hold
            job, result, logged = await self._run_job(
                law, spy, f"with staleness {eta} (staged syncs, partial rollout)",
                "The job must finish with every trajectory trained, regenerated or dropped",
                staleness=eta, weight_sync="staged", partial_rollout=True, steps=steps,
            )  # fmt: skip
            returned = [r for r in logged.runs if r.trajectory is not None]
            for r in returned:
                assert r.trajectory is not None
                _check_turn_starts(r.trajectory, r.trajectory_id, starts, eta)
            trained_ages: list[int] = []
            for step, (before, batch) in enumerate(zip(spy.befores, spy.batches, strict=True), 1):
                for i in range(len(batch.rows)):
                    key = (
                        tuple(_row_values(batch, "prompt", i)),
                        tuple(_row_values(batch, "response", i)),
                    )
                    ages = [
                        (before - min(seen), max(seen), r)
                        for r in returned
                        if r.trajectory is not None
                        and _row_key(r.trajectory) == key
                        and (seen := _generated_versions(r.trajectory))
                    ]
                    if not ages:
                        continue  # not a trajectory the loop returned: the job law's to catch
                    age, newest, run = min(ages, key=lambda x: x[0])
                    assert run.trajectory is not None
                    assert newest <= before, (
                        f"RLJob step {step} trained the trajectory of sample {run.index} (client "
                        f"{run.trajectory_id!r}) holding tokens of version {newest}, newer than "
                        f"the trainer's {before}: versions are the trainer's, synced; a token "
                        "cannot come from weights the trainer has not made"
                    )
                    assert age <= eta, (
                        f"RLJob step {step} trained the trajectory of sample {run.index} (client "
                        f"{run.trajectory_id!r}, ended {run.trajectory.ended!r}) whose oldest "
                        f"generated token is version {before - age}, while the "
                        f"trainer was at version {before}: {age} versions stale, more than "
                        f"staleness η = {eta}. A trajectory counts by its oldest generated "
                        "token: one staler than η is regenerated (ended 'stale') or dropped by "
                        "the update (counted), never trained"
                    )
                    trained_ages.append(age)
            stale = [
                r for r in logged.runs if r.trajectory is not None and r.trajectory.ended == "stale"
            ]
            assert job.restarts <= len(stale), (
                f"RLJob regenerated {job.restarts} trajectories, but the loop ended only "
                f"{len(stale)} of its {len(logged.runs)} runs 'stale' (ended: "
                f"{dict(Counter(str(r.trajectory.ended) for r in returned if r.trajectory))}): a "
                "sample is run again only when its trajectory became too stale to be trained "
                "(TrajectoryLimitReached('stale')), never when it finished"
            )
            dropped = result.dropped
            self._note(
                name,
                f"{len(logged.runs)} runs ({len(stale)} ended 'stale', {job.restarts} "
                f"regenerated), {len(trained_ages)} rows trained at staleness "
                f"{dict(sorted(Counter(trained_ages).items()))}, {dropped} dropped as stale; "
                f"{len(starts)} turn starts held against the trainer's version",
            )

        self._law(name, body, policy="tools", trainer=True)


async def bounded_job(awaitable: Awaitable[Any], timeout_s: float) -> Any:
    """``awaitable`` within ``timeout_s`` seconds, else an ``AssertionError`` (a hung job)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await awaitable
    except TimeoutError:
        raise AssertionError(
            f"RLJob.run did not finish within {timeout_s} s: a hang (or raise job_timeout_s)"
        ) from None


def _length_reward(prompt: Sequence[int], response: Sequence[int]) -> float:
    return float(len(response) % 3)


def _row_key(t: Trajectory) -> tuple[tuple[int, ...], tuple[int, ...]]:
    p = t.prompt_length
    return tuple(t.tokens[:p]), tuple(t.tokens[p:])


def _mask_key(t: Trajectory) -> tuple[int, ...]:
    return tuple(t.loss_mask[t.prompt_length :])


def _context_between_turns(t: Trajectory) -> int:
    """Tokens of non-assistant turns after the first assistant turn and before the last."""
    turns = list(t.turns)
    idx = [i for i, turn in enumerate(turns) if turn.role == "assistant"]
    if len(idx) < 2:
        return 0
    return sum(
        turn.end - turn.start for turn in turns[idx[0] + 1 : idx[-1]] if turn.role != "assistant"
    )


def _ends_with_context(t: Trajectory) -> bool:
    """The trajectory ends with a non-assistant turn after a generated one (the model was told
    something, then a limit ended it)."""
    return bool(t.turns) and t.turns[-1].role != "assistant" and bool(t.assistant_turns())


def _generated_versions(trajectory: Trajectory, end: int | None = None) -> list[Version]:
    """The versions of the generated tokens (``loss_mask`` 1) before position ``end`` (the law's
    own count: not ``Trajectory.min_version``, which is under test)."""
    stop = len(trajectory.tokens) if end is None else end
    pairs = zip(trajectory.versions[:stop], trajectory.loss_mask[:stop], strict=True)
    return [v for v, m in pairs if m]


def _check_turn_starts(
    trajectory: Trajectory, trajectory_id: str, starts: Mapping[str, Version], eta: int
) -> None:
    """No assistant turn of ``trajectory`` started while the trajectory was already more than
    ``eta`` versions behind the trainer, counted by its oldest generated token before that turn
    (``starts``: request id -> a lower bound of the trainer's version when it started)."""
    for turn in trajectory.assistant_turns()[1:]:
        at = starts.get(cast(str, turn.request_id))
        seen = _generated_versions(trajectory, turn.start)
        if at is None or not seen:
            continue
        oldest, newest = min(seen), max(seen)
        assert at - oldest <= eta, (
            f"client {trajectory_id!r}: turn {turn.request_id!r} started while the trainer was "
            f"at version {at} or later and the trajectory's oldest generated token at version "
            f"{oldest} (its newest at {newest}): {at - oldest} versions stale, more than η = "
            f"{eta}. A trajectory counts by its oldest generated token: no turn starts on one "
            "that can no longer be trained (the client ends it 'stale' and the job regenerates "
            "it)"
        )


def _role_at(t: Trajectory, position: int) -> str:
    return next((x.role for x in t.turns if x.start <= position < x.end), "unknown")


def _summary(runs: Sequence[tuple[str, Trajectory]]) -> str:
    trajectories = [t for _, t in runs]
    ended = Counter(str(t.ended) for t in trajectories)
    turns = sum(t.stats()["turns"] for t in trajectories)
    errors = sum(t.stats()["tool_errors"] for t in trajectories)
    between = sum(_context_between_turns(t) for t in trajectories)
    return (
        f"{len(trajectories)} trajectories, {turns} assistant turns, {between} tokens between "
        f"turns, {errors} tool errors (stats), ended {dict(ended)}"
    )


# --------------------------------------------------------------------------------------------
# Chat formats
# --------------------------------------------------------------------------------------------
LOOKUP_TOOL: Mapping[str, Any] = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up a person's phone number.",
        "parameters": {
            "type": "object",
            "properties": {"person": {"type": "string"}},
            "required": ["person"],
        },
    },
}
"""The tool schema ``ChatFormatConformance`` renders by default."""

CONVERSATION: tuple[Mapping[str, Any], ...] = (
    {"role": "user", "content": "What is the number of Ann?"},
    {"role": "assistant", "content": "Let me look it up."},
    {"role": "user", "content": "Go on."},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "lookup", "arguments": '{"person": "Ann"}'}}
        ],
    },
    {"role": "tool", "name": "lookup", "content": "042"},
    {"role": "user", "content": "And Ben?"},
)
"""The continuation law's default conversation: user -> assistant (text) -> user -> assistant
(a tool call) -> tool -> user."""


class ChatFormatConformance(_Suite):
    """The chat-format law (module docstring); subclass it (as ``Test...``) and implement
    ``make_chat``; optionally ``tools`` and ``conversation``."""

    def make_chat(self) -> Any:
        """A ``ChatFormat`` (``asyncflow_core.flow.chat``) to test."""
        raise NotImplementedError(f"{type(self).__name__} must implement make_chat(self)")

    def tools(self) -> Sequence[Mapping[str, Any]] | None:
        """The tool schemas rendered into every prompt (default: ``LOOKUP_TOOL``)."""
        return [LOOKUP_TOOL]

    def conversation(self) -> Sequence[Mapping[str, Any]]:
        """The conversation held to the law: it starts with a non-assistant message and holds
        at least one assistant turn followed by other messages (default: ``CONVERSATION``)."""
        return CONVERSATION

    @classmethod
    def describe_backend(cls) -> str:
        return f"{cls.__qualname__} [{cls.__module__}]: make_chat() of a ChatFormat"

    def test_followup_continues_the_template(self) -> None:
        """The chat-format law (module docstring)."""
        name = "test_followup_continues_the_template"

        async def body() -> None:
            chat = self.make_chat()
            if not isinstance(chat, ChatFormat):
                raise AssertionError(
                    f"make_chat() returned {type(chat).__name__}, not a ChatFormat "
                    "(stop_token_ids, prompt, followup, parse, decode)"
                )
            messages, tools = list(self.conversation()), self.tools()
            stops = set(chat.stop_token_ids)
            assert stops, f"{type(chat).__name__}.stop_token_ids is empty: no turn could end"
            cut = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            assert cut and cut[0] > 0 and cut[-1] < len(messages) - 1, (
                "conversation() must start with a non-assistant message and follow each "
                "assistant turn with other messages"
            )
            stream = list(chat.prompt(messages[: cut[0]], tools))
            for k, i in enumerate(cut):
                end = cut[k + 1] if k + 1 < len(cut) else len(messages)
                whole = list(chat.prompt(messages[:end], tools))
                where = (
                    f"{type(chat).__name__}, after assistant turn {k} (message {i}: "
                    f"{'a tool call' if messages[i].get('tool_calls') else 'text'})"
                )
                j = _first_difference(stream, whole)
                assert j == len(stream), (
                    f"{where}: prompt(the first {i} messages) + the turns and followups so far "
                    f"is not a prefix of prompt(the first {end} messages): they differ at token "
                    f"{j} of {len(stream)} ({chat.decode(stream[j : j + 8])!r} vs "
                    f"{chat.decode(whole[j : j + 8])!r}); a prompt must render earlier "
                    "messages the same whatever follows them"
                )
                stop = next((p for p in range(j, len(whole)) if whole[p] in stops), None)
                assert stop is not None, (
                    f"{where}: the template renders the assistant turn without any of "
                    f"stop_token_ids {sorted(stops)}: an engine could not end that turn where "
                    "the template does; list the template's end-of-turn token in stop_token_ids"
                )
                turn = whole[j : stop + 1]
                follow = list(chat.followup(messages[i + 1 : end]))
                stream += turn + follow
                if stream != whole:
                    d = _first_difference(stream, whole)
                    raise AssertionError(
                        f"{where}: prompt + turn ({len(turn)} tokens, ending with the stop "
                        f"token) + followup(messages {i + 1}..{end - 1}) gives {len(stream)} "
                        f"tokens, prompt(the first {end} messages) {len(whole)}; first "
                        f"different at token {d}: followup gives "
                        f"{chat.decode(stream[d : d + 12])!r}, the template "
                        f"{chat.decode(whole[d : d + 12])!r}. followup(messages) must be exactly "
                        "what the template renders after a finished assistant turn (its stop "
                        "token) up to the next opened assistant turn, or the trajectory trains on "
                        "a conversation the template never renders"
                    )
            self._note(name, f"{len(cut)} assistant turns continued, {len(stream)} tokens")

        self._run(name, body)

    def _note(self, law: str, text: str) -> None:
        REPORT.setdefault(type(self).__qualname__, []).append(f"{law}: {text}")

    @classmethod
    def report_lines(cls) -> list[str]:
        return [cls.describe_backend(), *REPORT.get(cls.__qualname__, [])]
