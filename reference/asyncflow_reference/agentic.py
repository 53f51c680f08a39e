"""The built-in agentic task (``lookup``) and the small text tokenizer the reference models chat
with (``PieceTokenizer``, over the minimal chat template of ``asyncflow_core.chat``).

**The task.** Every sample comes with its own private phone book: ``NAMES`` each get a random
``digits``-digit number, drawn afresh for each sample, so no model can know them. The user
asks for one person's number; the ``lookup`` tool (``PhoneBook``, a ``Tool`` with a JSON
schema) answers for any name in the book. Solving it takes two assistant turns:

    user       number of Eve?
    assistant  <tool_call>{"name": "lookup", "arguments": {"person": "Eve"}}</tool_call>
    tool       <tool_response>407</tool_response>
    assistant  407

Reward (in [0, 1], verifiable): the fraction of the answer's digits in the right place, counted
when the final answer is exactly ``digits`` digits (else 0). Answering directly, without the
tool, scores 1/10 per digit on average: chance. The model has to learn two things from the
reward alone: to call the tool with the name asked for (copying it out of the question), and
to copy the tool's answer into its own.

**The warm-up** (``warmup_examples``) teaches the *syntax* only, with random arguments: half
the examples answer the question directly with random digits; the other half call ``lookup``
with a random name, get that name's number from the book, and then answer with random digits
unrelated to it. Some examples list no tools and answer directly (so a prompt without tools
is one the model has seen: "tools disabled" evaluations ask that way). After the warm-up the
model uses the tool about half the time, with a random name, and answers at chance.

**PieceTokenizer**: greedy longest-match over a fixed list of pieces. Every printable ASCII
character and ``\\n`` is a piece, so any such text encodes; the chat template's markers
(``<|im_start|>assistant\\n``, ``<|im_end|>``, ``<tool_call>``, ...), the JSON around a tool call,
the tool and argument names and the ``NAMES`` are pieces of their own, so a whole trajectory
of the task is ~40 tokens (a generated call is 10).
"""

from __future__ import annotations

import random
import string
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncflow_core.agent import Trajectory
from asyncflow_core.chat import AssistantMessage, MinimalChatFormat
from asyncflow_core.errors import BadRequestError, ConfigError

NAMES: tuple[str, ...] = ("Ann", "Ben", "Cal", "Dan", "Eve", "Fay", "Gus", "Hal")
TOOL = "lookup"
ARGUMENT = "person"

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
    '{"name": "',
    '", "arguments": {"',
    '": "',
    '"}}',
    "tools: ",
    "number of ",
    "error: ",
    TOOL,
    ARGUMENT,
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


class PhoneBook:
    """The ``lookup`` tool over one sample's phone book (``{name: number}``)."""

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
class LookupTask:
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

    def samples(self, seed: int = 0) -> Iterator[dict[str, Any]]:
        rng = random.Random(seed)
        while True:
            yield self.sample(rng)

    def _number(self, rng: random.Random) -> str:
        return "".join(rng.choice("0123456789") for _ in range(self.digits))

    def tools(self, sample: Mapping[str, Any]) -> list[PhoneBook]:
        return [PhoneBook(sample["book"])]

    def score(self, sample: Mapping[str, Any], answer: str | None) -> tuple[float, bool]:
        """``(reward, exact)`` of a final answer (None: the model never answered)."""
        want = sample["book"][sample["person"]]
        got = (answer or "").strip()
        if len(got) != len(want) or not got.isdigit():
            return 0.0, False
        right = sum(1 for a, b in zip(got, want, strict=True) if a == b)
        return right / len(want), right == len(want)

    def reward(
        self, sample: Mapping[str, Any], final: AssistantMessage | None, trajectory: Trajectory
    ) -> float:
        """The ``ToolAgentLoop`` reward: ``score`` of the final answer's text."""
        return self.score(sample, None if final is None else final.content)[0]

    # -- the warm-up ---------------------------------------------------------------------------
    def warmup_examples(
        self, chat: MinimalChatFormat, rng: random.Random, n: int
    ) -> list[tuple[list[int], list[int]]]:
        """``n`` supervised examples ``(tokens, loss_mask)`` teaching the syntax only (module
        docstring): a direct random answer (a quarter of them without tools listed), or a
        call with a random name followed by a random answer. The mask is 1 on the assistant
        turns."""
        schemas = [
            {"type": "function", "function": {"name": TOOL, "parameters": PhoneBook.parameters}}
        ]
        stop = chat.stop_token_ids[0]
        out = []
        for i in range(n):
            sample = self.sample(rng)
            kind = i % 4  # 0: no tools listed, direct; 1: direct; 2, 3: one call then an answer
            tokens = chat.prompt(sample["messages"], None if kind == 0 else schemas)
            mask = [0] * len(tokens)

            def say(text: str, tokens: list[int] = tokens, mask: list[int] = mask) -> None:
                ids = [*chat.tokenizer.encode(text), stop]
                tokens.extend(ids)
                mask.extend([1] * len(ids))

            if kind >= 2:
                person = rng.choice(NAMES)
                call = {"name": TOOL, "arguments": {ARGUMENT: person}}
                say(_hermes(call))
                answer = [{"role": "tool", "content": sample["book"][person]}]
                follow = chat.followup(answer)
                tokens.extend(follow)
                mask.extend([0] * len(follow))
            say(self._number(rng))
            out.append((tokens, mask))
        return out


def _hermes(call: Mapping[str, Any]) -> str:
    import json

    return f"<tool_call>{json.dumps(call)}</tool_call>"


def chat_format() -> MinimalChatFormat:
    """The minimal chat template over the task's ``PieceTokenizer``."""
    return MinimalChatFormat(PieceTokenizer())


__all__ = [
    "NAMES",
    "PIECES",
    "LookupTask",
    "PhoneBook",
    "PieceTokenizer",
    "chat_format",
]
