"""The built-in agentic tasks and the small text tokenizer the reference models chat with
(``PieceTokenizer``, over the minimal chat template of ``asyncflow_core.flow.chat``).

**``clock``** (``ClockTask``; ``asyncflow run --set task=clock``, the one that learns in
minutes). A model cannot know what time it is: every sample has its own random time, which
only the ``clock()`` tool (``Clock``, a ``Tool`` with a JSON schema) tells. Solving it takes
two assistant turns::

    system     tools: clock()
    user       time now?
    assistant  <tool_call>{"name": "clock", "arguments": {}}</tool_call>
    tool       <tool_response>14:07</tool_response>
    assistant  14:07

Reward (in [0, 1], verifiable): the fraction of the four digits in the right place, counted
when the final answer is ``HH:MM`` (else 0). Without the tool the best a model can do is the
prior of valid times (a first digit of 0-2, minutes of 00-59): about 0.2. With it, the model
has to learn from the reward alone to call the tool (instead of answering at once) and to copy
its answer.

**``lookup``** (``LookupTask``; ``--set task=lookup``, harder). Every sample has its own phone
book (``NAMES`` with random numbers); the user asks for one person's number; ``lookup(person)``
answers for any name. The model must learn to write the name asked for into the call *and* to
copy the answer, and each pays only once the other is there: from a syntax-only warm-up, the
name the model writes drifts to one favourite while nothing pays (one name in 81% of the calls
after 70 steps, measured), and neither skill was learnt in 200-400 steps, with or without an
easier first level, nor, with the learning-rate warm-up, in 300 (the model gave the tool up:
README, agentic RL). The tests, the conformance suite and the
``openai`` example use it for its argument-carrying tool.

**The warm-ups** (``warmup_examples``) teach the *syntax* only: final answers are random
(random times, random digits), tool arguments random names. Some examples list no tool and
answer directly, so a prompt without tools is one the model has seen ("tools disabled"
evaluations ask that way); of those that list the tool, some answer directly and the others
call it first (clock: three in four, lookup: two in three). After the warm-up the model calls
the tool that often, and answers at chance. The RL trainer then needs a learning-rate warm-up
(the main job's ``train.lr_warmup_steps``, 20 steps for these tasks): without it, the first
step of a fresh AdamW took the clock task's rate of calling from 75% to 1%, on every seed
tried, and the model never came back to its tool.

**PieceTokenizer**: greedy longest-match over a fixed list of pieces. Every printable ASCII
character and ``\\n`` is a piece, so any such text encodes; the chat template's markers
(``<|im_start|>assistant\\n``, ``<|im_end|>``, ...), the text of a call up to its argument,
the tools' and arguments' names and the ``NAMES`` are pieces of their own, as a trained BPE
would merge them, so a whole trajectory of either task is ~30 tokens (a generated call 2-4).
"""

from __future__ import annotations

import abc
import asyncio
import json
import random
import re
import string
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from asyncflow_core.contracts.errors import BadRequestError, ConfigError
from asyncflow_core.contracts.protocols import InferenceEngine, SamplingParams
from asyncflow_core.data.scheduling import RequestRouter
from asyncflow_core.flow.agent import (
    GenerationClient,
    ToolAgentLoop,
    Trajectory,
    TrajectoryLimits,
)
from asyncflow_core.flow.chat import AssistantMessage, MinimalChatFormat
from asyncflow_core.flow.tools import Tool, ToolRunner, tool_schema

NAMES: tuple[str, ...] = ("Ann", "Ben", "Cal", "Dan", "Eve", "Fay", "Gus", "Hal")
TOOL = "lookup"
ARGUMENT = "person"
CLOCK = "clock"

SPECIAL_PIECES: tuple[str, ...] = (
    "<|im_end|>",
    "<|im_start|>",
    "<|im_start|>system\n",
    "<|im_start|>user\n",
    "<|im_start|>assistant\n",
    "<|im_start|>tool\n",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
WORD_PIECES: tuple[str, ...] = (
    f'<tool_call>{{"name": "{TOOL}", "arguments": {{"{ARGUMENT}": "',
    '"}}</tool_call>',
    f'<tool_call>{{"name": "{CLOCK}", "arguments": {{}}}}</tool_call>',
    '{"name": "',
    '", "arguments": {"',
    '": "',
    '"}}',
    "tools: ",
    "number of ",
    "time now",
    "error: ",
    TOOL,
    ARGUMENT,
    CLOCK,
    "calculator",
    "expression",
    *NAMES,
)
CHAR_PIECES: tuple[str, ...] = tuple(sorted(set(string.printable) - set("\t\r\x0b\x0c")))
PIECES: tuple[str, ...] = SPECIAL_PIECES + WORD_PIECES + CHAR_PIECES


class PieceTokenizer:
    """Greedy longest-match tokenizer over ``pieces`` (ids in order; duplicates refused).
    ``encode`` refuses a character no piece covers, naming it; ``decode`` joins the pieces."""

    def __init__(self, pieces: Sequence[str] = PIECES) -> None:
        if len(set(pieces)) != len(pieces) or any(not p for p in pieces):
            raise ConfigError("PieceTokenizer: pieces must be distinct non-empty strings")
        self.pieces = tuple(pieces)
        self._ids = {p: i for i, p in enumerate(self.pieces)}
        self._longest = max(len(p) for p in self.pieces)

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def token_to_id(self, piece: str) -> int:
        return self._ids[piece]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        i = 0
        while i < len(text):
            for width in range(min(self._longest, len(text) - i), 0, -1):
                piece = self._ids.get(text[i : i + width])
                if piece is not None:
                    ids.append(piece)
                    i += width
                    break
            else:
                raise BadRequestError(
                    f"PieceTokenizer: {text[i]!r} (at {i} of {text[:40]!r}...) is not in the "
                    "vocabulary; use printable ASCII"
                )
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        try:
            return "".join(self.pieces[i] for i in ids)
        except (IndexError, TypeError) as exc:
            raise BadRequestError(
                f"PieceTokenizer: token ids must be ints in [0, {self.vocab_size}), got "
                f"{list(ids)[:12]}"
            ) from exc


class AgentTask(Protocol):
    """What the agent workload and ``evaluate`` need of a task."""

    def samples(self, seed: int = 0) -> Iterator[dict[str, Any]]: ...

    def tools(self, sample: Mapping[str, Any]) -> Sequence[Tool]: ...

    def score(self, sample: Mapping[str, Any], answer: str | None) -> tuple[float, bool]: ...

    def reward(
        self, sample: Mapping[str, Any], final: AssistantMessage | None, trajectory: Trajectory
    ) -> float: ...

    def warmup_examples(
        self, chat: MinimalChatFormat, rng: random.Random, n: int
    ) -> list[tuple[list[int], list[int]]]: ...


class _Task(abc.ABC):
    """What the tasks share: an endless sample stream and the loop's reward, from each
    task's ``sample`` and ``score``."""

    @abc.abstractmethod
    def sample(self, rng: random.Random) -> dict[str, Any]: ...

    @abc.abstractmethod
    def score(self, sample: Mapping[str, Any], answer: str | None) -> tuple[float, bool]: ...

    def samples(self, seed: int = 0) -> Iterator[dict[str, Any]]:
        """Endless samples from ``seed``."""
        rng = random.Random(seed)
        while True:
            yield self.sample(rng)

    def reward(
        self, sample: Mapping[str, Any], final: AssistantMessage | None, trajectory: Trajectory
    ) -> float:
        """The ``ToolAgentLoop`` reward: ``score`` of the final answer's text."""
        return self.score(sample, None if final is None else final.content)[0]


def _digit_score(want: str, got: str | None, shape: str) -> tuple[float, bool]:
    """The fraction of ``want``'s digits ``got`` has in place, when ``got`` matches the
    regex ``shape`` (else 0), and whether all are right."""
    text = (got or "").strip()
    if not re.fullmatch(shape, text) or len(text) != len(want):
        return 0.0, False
    places = [i for i, c in enumerate(want) if c.isdigit()]
    right = sum(1 for i in places if text[i] == want[i])
    return right / len(places), right == len(places)


def _warmup_example(
    chat: MinimalChatFormat,
    sample: Mapping[str, Any],
    tool: Tool | None,
    call: Mapping[str, Any] | None,
    tool_answer: str,
    answer: str,
) -> tuple[list[int], list[int]]:
    """One supervised example ``(tokens, loss_mask)``: the prompt (``tool`` listed, if any),
    optionally ``call`` with the tool's ``tool_answer``, then ``answer``; mask 1 on the
    assistant turns."""
    stop = chat.stop_token_ids[0]
    tokens = chat.prompt(sample["messages"], None if tool is None else [tool_schema(tool)])
    mask = [0] * len(tokens)

    def say(text: str) -> None:
        ids = [*chat.tokenizer.encode(text), stop]
        tokens.extend(ids)
        mask.extend([1] * len(ids))

    if call is not None:
        say(f"<tool_call>{json.dumps(call)}</tool_call>")
        follow = chat.followup([{"role": "tool", "content": tool_answer}])
        tokens.extend(follow)
        mask.extend([0] * len(follow))
    say(answer)
    return tokens, mask


# --------------------------------------------------------------------------------------------
# clock
# --------------------------------------------------------------------------------------------
class Clock:
    """The ``clock()`` tool of one sample: its time, ``HH:MM``."""

    name = CLOCK
    description = "The current time, HH:MM."
    parameters: Mapping[str, Any] = {
        "type": "object",
        "properties": {},
        "additionalProperties": False,
    }

    def __init__(self, now: str) -> None:
        self.now = now

    async def call(self, arguments: Mapping[str, Any]) -> str:  # async: no thread hop
        return self.now


class ClockTask(_Task):
    """The ``clock`` task (module docstring)."""

    def sample(self, rng: random.Random) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": "time now?"}], "now": _time(rng)}

    def tools(self, sample: Mapping[str, Any]) -> list[Clock]:
        return [Clock(sample["now"])]

    def score(self, sample: Mapping[str, Any], answer: str | None) -> tuple[float, bool]:
        """``(reward, exact)`` of a final answer (None: the model never answered)."""
        return _digit_score(sample["now"], answer, r"\d\d:\d\d")

    def warmup_examples(
        self, chat: MinimalChatFormat, rng: random.Random, n: int
    ) -> list[tuple[list[int], list[int]]]:
        """``n`` examples teaching the syntax only (module docstring): in turn, no tool
        listed and a direct answer; the tool listed and a direct answer; three that call
        ``clock()`` first. Every final answer is a random time."""
        out = []
        for i in range(n):
            kind = i % 5
            sample = self.sample(rng)
            tool = None if kind == 0 else Clock(sample["now"])
            call = {"name": CLOCK, "arguments": {}} if kind >= 2 else None
            out.append(_warmup_example(chat, sample, tool, call, sample["now"], _time(rng)))
        return out


def _time(rng: random.Random) -> str:
    return f"{rng.randrange(24):02d}:{rng.randrange(60):02d}"


# --------------------------------------------------------------------------------------------
# lookup
# --------------------------------------------------------------------------------------------
class PhoneBook:
    """The ``lookup(person)`` tool over one sample's phone book (``{name: number}``)."""

    name = TOOL
    description = "Look up a person's phone number."
    parameters: Mapping[str, Any] = {
        "type": "object",
        "properties": {ARGUMENT: {"type": "string"}},
        "required": [ARGUMENT],
        "additionalProperties": False,
    }

    def __init__(self, book: Mapping[str, str]) -> None:
        self.book = dict(book)

    async def call(self, arguments: Mapping[str, Any]) -> str:  # async: no thread hop
        person = str(arguments[ARGUMENT])
        if person not in self.book:
            raise KeyError(f"no person named {person!r}")
        return self.book[person]


@dataclass(frozen=True, slots=True)
class LookupTask(_Task):
    """The ``lookup`` task (module docstring): ``digits`` digits per number (1-6)."""

    digits: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.digits, bool) or not isinstance(self.digits, int):
            raise ConfigError(f"lookup task digits must be an int, got {self.digits!r}")
        if not 1 <= self.digits <= 6:
            raise ConfigError(f"lookup task digits must be in 1..6, got {self.digits}")

    def sample(self, rng: random.Random) -> dict[str, Any]:
        """A fresh sample: the question's messages, the person asked for and the book."""
        book = {name: self._number(rng) for name in NAMES}
        person = rng.choice(NAMES)
        return {
            "messages": [{"role": "user", "content": f"number of {person}?"}],
            "person": person,
            "book": book,
        }

    def _number(self, rng: random.Random) -> str:
        return "".join(rng.choice("0123456789") for _ in range(self.digits))

    def tools(self, sample: Mapping[str, Any]) -> list[PhoneBook]:
        return [PhoneBook(sample["book"])]

    def score(self, sample: Mapping[str, Any], answer: str | None) -> tuple[float, bool]:
        """``(reward, exact)`` of a final answer (None: the model never answered)."""
        return _digit_score(sample["book"][sample["person"]], answer, r"\d+")

    def warmup_examples(
        self, chat: MinimalChatFormat, rng: random.Random, n: int
    ) -> list[tuple[list[int], list[int]]]:
        """``n`` examples teaching the syntax only (module docstring): in turn, no tool
        listed and a direct answer; the tool listed and a direct answer; two that call
        ``lookup`` with a random name first. Every final answer is random digits."""
        out = []
        for i in range(n):
            kind = i % 4
            sample = self.sample(rng)
            tool = None if kind == 0 else PhoneBook(sample["book"])
            person = rng.choice(NAMES)
            call = {"name": TOOL, "arguments": {ARGUMENT: person}} if kind >= 2 else None
            answer = sample["book"][person]
            out.append(_warmup_example(chat, sample, tool, call, answer, self._number(rng)))
        return out


TASKS: dict[str, type[ClockTask] | type[LookupTask]] = {"clock": ClockTask, "lookup": LookupTask}
"""The agentic tasks by name (``task.name`` of the main job)."""


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------
async def evaluate(
    task: AgentTask,
    engine: InferenceEngine,
    count: int,
    seed: int,
    *,
    tools: bool = True,
    limits: TrajectoryLimits | None = None,
    max_tokens: int = 16,
) -> dict[str, float]:
    """Greedy decoding on ``count`` fresh samples of the task itself (``seed`` apart from
    training's): mean ``reward``, ``exact`` rate, ``tool_use`` (trajectories with at least one
    tool call), mean ``turns`` and ``tool_calls``. ``tools=False``: no tool is listed in the
    prompt and none can be called (a call is answered "no tool named ..."): how well the model
    does without its tool."""
    chat = chat_format()
    loop = ToolAgentLoop(chat, ToolRunner([]), tools=task.tools if tools else lambda s: [])
    router = RequestRouter(["0"])
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                            stop_token_ids=chat.stop_token_ids)  # fmt: skip
    stream = task.samples(seed)
    samples = [next(stream) for _ in range(count)]

    async def one(i: int, sample: dict[str, Any]) -> tuple[float, bool, dict[str, Any]]:
        bounds = limits or TrajectoryLimits(max_turns=3, max_total_tokens=96)
        client = GenerationClient([engine], router, f"eval-{i}", sampling=greedy, limits=bounds)
        trajectory = await loop.run(sample, client)
        final = _final_answer(chat, trajectory)
        reward, exact = task.score(sample, final)
        return reward, exact, trajectory.stats()

    results = await asyncio.gather(*(one(i, s) for i, s in enumerate(samples)))
    n = max(len(results), 1)
    return {
        "reward": sum(r for r, _, _ in results) / n,
        "exact": sum(1.0 for _, e, _ in results if e) / n,
        "tool_use": sum(1.0 for _, _, st in results if st["tool_calls"]) / n,
        "turns": sum(st["turns"] for _, _, st in results) / n,
        "tool_calls": sum(st["tool_calls"] for _, _, st in results) / n,
    }


def _final_answer(chat: MinimalChatFormat, trajectory: Trajectory) -> str | None:
    """The last assistant turn's text when the trajectory ended with an answer."""
    turns = trajectory.assistant_turns()
    if trajectory.ended != "answer" or not turns:
        return None
    last = turns[-1]
    return chat.parse(trajectory.tokens[last.start : last.end]).content


def chat_format() -> MinimalChatFormat:
    """The minimal chat template over the tasks' ``PieceTokenizer``."""
    return MinimalChatFormat(PieceTokenizer())


__all__ = [
    "NAMES",
    "PIECES",
    "TASKS",
    "AgentTask",
    "Clock",
    "ClockTask",
    "LookupTask",
    "PhoneBook",
    "PieceTokenizer",
    "chat_format",
    "evaluate",
]
