"""OpenAI-compatible chat completions served by the rollout engines, recording exact tokens.

An agent program written for the ``openai`` client (or LangChain, LangGraph, ...) talks to this
endpoint as it would to any OpenAI-compatible server, and trains unchanged under ``RLJob``.

**URLs and sessions.** ``ChatEndpoint(chat)`` is an aiohttp server (``await endpoint.start()``;
``endpoint.url`` is ``http://127.0.0.1:PORT``). Each trajectory is a *session*:
``endpoint.open(client)`` ties one ``GenerationClient`` (one trajectory) to a fresh key and
returns a ``Session`` whose ``base_url`` (``{url}/t/{key}/v1``) and ``api_key`` an agent hands
to its framework unchanged::

    POST {url}/t/{key}/v1/chat/completions     one assistant turn of the session
    GET  {url}/t/{key}/v1/models, {url}/v1/models   the one model name (``model=``)

``endpoint.close_session(key)`` ends the session and returns its ``SessionRecord``: the
segments (``Trajectory`` s), counts of requests, mismatches and malformed tool calls, and the
last generated turn parsed. ``EndpointLoop(endpoint, agent, reward=...)`` is the ``AgentLoop``
that does all of that per sample, so ``RLJob(..., agent=EndpointLoop(...))`` trains any agent
program.

**Token in, token out across stateless requests.** Clients resend the whole conversation as
text with every request; re-tokenising it would train the policy on tokens it never produced.
A session therefore keeps the conversation it has seen and answered, aligned with the token
record of its ``GenerationClient``:

* the first request renders its messages and tools with ``chat.prompt`` (the prompt, masked
  out), then generates;
* a later request whose messages *start with exactly the recorded conversation* (role; content,
  ``None`` == ``""``, text parts joined; tool calls by name and parsed JSON arguments — not by
  the argument string or the call id, which frameworks re-serialise; other keys ignored), with
  the same tools, continues the record: the recorded messages, our assistant turns included,
  *are* their recorded token ids, and only the new messages are tokenised, with
  ``chat.followup(new)`` (role ``"tool"`` when they are all tool messages, else ``"user"``);
* a request repeating exactly a conversation whose turn failed (an engine error, a limit) is
  a retry: the turn is generated again on the context already recorded;
* **the split rule**: anything else — an edited or dropped message, a new assistant message we
  did not generate, changed tools (or ``tool_choice``), a continuation after a turn that ended
  without a stop token (cut by ``max_tokens``: ``followup`` needs the stop token) — counts a
  *mismatch* and starts a new segment: a ``client.spawn(...)`` whose prompt is the whole
  request rendered afresh. The segment before becomes a finished ``Trajectory`` of the record
  (``ended="split"``), unless it holds no generated token (then it is dropped: nothing in it
  could be trained).

A generated turn is parsed with ``chat.parse``: its text is ``message.content`` (None when
empty and there are tool calls), its Hermes calls are ``message.tool_calls`` (ids
``call_...``, ``arguments`` the JSON of the parsed arguments) and ``finish_reason`` is
``"tool_calls"``, ``"stop"`` or ``"length"`` (a turn cut by its token cap, or aborted while
the job stops). Tool calls are returned only for a turn that ended with a stop token and
whose blocks all parsed; a turn holding a malformed block (counted), or any block under
``tool_choice="none"``, is returned as its raw text (the model wrote it). ``usage``:
``prompt_tokens`` is the turn's whole context, ``completion_tokens`` what it generated. A turn
that cannot start (``TrajectoryLimitReached``: turns, total tokens, a too stale trajectory,
the job stopping) answers HTTP 400 with code ``context_length_exceeded`` naming the limit; what
was recorded is kept. One request at a time per session: a second one meanwhile gets 409.

**Request fields.** Honoured: ``messages`` (roles system, developer (as system), user,
assistant, tool; content a string, null or text parts), ``model`` (any string, echoed),
``tools`` (function tools), ``tool_choice`` ``"auto"``/absent, and ``"none"`` (the tools are
not rendered), ``parallel_tool_calls`` true/absent (every call of a turn is returned), ``n``
1, ``stream`` (the whole turn arrives as one ``chat.completion.chunk`` delta once generated,
then a finish chunk, ``stream_options.include_usage``'s usage chunk, ``data: [DONE]``),
``max_tokens`` / ``max_completion_tokens`` (lower the turn's cap, never above the session's
limits), ``seed`` (this turn's sampling seed; the client adds the turn index as it does for
every seed — do not send a fixed seed under ``RLJob``: a group's samples would be alike),
``logprobs`` (the engine's per-token log-probs, ``top_logprobs`` 0), ``temperature`` /
``top_p`` / ``top_k`` equal to the session's sampling, ``response_format`` text.
Refused with HTTP 400 naming the field and what to send: ``tool_choice`` ``"required"`` or a
named function and ``parallel_tool_calls=false`` (a sampled policy cannot be held to them
without constrained decoding), ``n`` > 1, ``stop`` (a turn ends at the chat format's stop
tokens), ``temperature`` / ``top_p`` / ``top_k`` other than the session's (the trainer scores
the tokens under exactly the job's sampling; the message names the session's value),
``top_logprobs`` > 0, ``response_format`` other than text, non-zero ``frequency_penalty`` /
``presence_penalty``, a ``logit_bias``, vLLM's ``repetition_penalty`` / ``min_p`` /
``min_tokens`` / ``ignore_eos`` / ``stop_token_ids`` / ``best_of`` / ``use_beam_search`` when
not neutral, ``functions`` / ``function_call`` (use ``tools``), audio output. Any other key is
ignored (frameworks send many: ``user``, ``metadata``, ``store``, ``reasoning_effort``, ...).

**Security defaults.** The server binds to ``127.0.0.1`` (any other host must be passed
explicitly, and a non-loopback one is logged as a warning). Every route needs the run token
(``token=``, default ``secrets.token_urlsafe(32)``) as ``Authorization: Bearer ...``, compared
with ``hmac.compare_digest``: 401 otherwise. The token is never logged, echoed in an error or
shown in a ``repr``. An unknown session key is 404, a body above ``max_body_bytes`` 413,
invalid JSON 400, and so is a body, or a tool call's arguments string, nesting arrays and
objects deeper than ``asyncflow_core.flow.tools.MAX_JSON_DEPTH`` (100) levels. Every error is in
OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` with
``x-should-retry: false``, so the ``openai`` client raises its own exception class at once
instead of retrying (it would retry a 409 or a 5xx otherwise).

**Connection timeouts.** A connection must deliver a complete request header within
``header_timeout_s`` (10 s by default) of opening, and of the first byte of each later
request on it; one that sends nothing between requests is closed after ``idle_timeout_s``
(60 s; aiohttp's keep-alive timeout, whose own default is an hour); a 401 closes its
connection. So a client without the token holds a connection for ``header_timeout_s`` at
most (and the body of a request refused with 401 is drained for 10 s at most, aiohttp's
lingering time), and cannot pile up idle or half-sent connections until the process runs out
of descriptors. A request being answered is never cut, however long its turn takes.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import logging
import math
import secrets
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from asyncflow_core.contracts.errors import BadRequestError, ConfigError, MissingExtraError
from asyncflow_core.contracts.protocols import GenerationResult, SamplingParams
from asyncflow_core.flow.agent import (
    GenerationClient,
    SampleReward,
    Trajectory,
    TrajectoryLimitReached,
)
from asyncflow_core.flow.chat import AssistantMessage, ChatFormat, message_tool_calls
from asyncflow_core.flow.tools import load_json
from asyncflow_core.infra.platform import is_loopback_literal

try:
    from aiohttp import web
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    raise MissingExtraError(
        f"asyncflow_serve serves HTTP through aiohttp, which is not installed ({_exc}); install "
        "it: pip install 'asyncflow[serve]'"
    ) from _exc

__all__ = [
    "DEFAULT_HEADER_TIMEOUT_S",
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_MAX_BODY_BYTES",
    "AgentProgram",
    "ChatEndpoint",
    "EndpointLoop",
    "Session",
    "SessionRecord",
]

log = logging.getLogger("asyncflow_serve")

DEFAULT_MAX_BODY_BYTES = 16 << 20
"""Request bodies above this many bytes are refused with 413 (a long agent history is a few
hundred KiB)."""

DEFAULT_HEADER_TIMEOUT_S = 10.0
"""A request's header must arrive whole within this many seconds (module docstring)."""

DEFAULT_IDLE_TIMEOUT_S = 60.0
"""A kept-alive connection that sends nothing for this many seconds is closed."""

_Key = tuple[str, str, tuple[tuple[str, str], ...]]
"""What a message is compared by: role, content text, tool calls as (name, canonical JSON)."""

_ROLES = ("system", "developer", "user", "assistant", "tool")

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# --------------------------------------------------------------------------------------------
# Public records
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Session:
    """One open session: give ``base_url`` and ``api_key`` to the agent's client
    (``openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key)``). ``key``
    names it in ``ChatEndpoint.close_session``. The repr never shows the key's token."""

    key: str
    base_url: str
    api_key: str = field(repr=False)
    trajectory_id: str = ""


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """What a closed session recorded. ``segments``: its trajectories in order (more than one
    when a request did not match the record and the conversation was split; see the module
    docstring), the last one the conversation's end; ``requests``: requests answered with a
    generated turn; ``mismatches``: requests that did not match the record (each started a
    segment); ``malformed``: turns whose tool-call blocks did not parse (returned as text);
    ``errors``: requests answered with an error status (refused fields, limits, 409, ...),
    ``last_error`` the last one's message; ``last``: the last generated turn of the last
    segment, parsed; ``final``: that turn when
    it was an answer (it ended with a stop token and no tool calls were returned), else
    None — what a ``SampleReward`` gets."""

    key: str
    segments: tuple[Trajectory, ...]
    requests: int = 0
    mismatches: int = 0
    malformed: int = 0
    errors: int = 0
    last_error: str | None = None
    last: AssistantMessage | None = None
    final: AssistantMessage | None = None

    @property
    def splits(self) -> int:
        """Segments after the first."""
        return max(len(self.segments) - 1, 0)


# --------------------------------------------------------------------------------------------
# Internal state
# --------------------------------------------------------------------------------------------
class _Refusal(Exception):
    """An HTTP error answer in OpenAI's shape; never carries the token."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or ("server_error" if status >= 500 else "invalid_request_error")


@dataclass
class _Segment:
    """The current segment of a session: its client (the token record) and the conversation
    those tokens hold. ``state``: ``empty`` (no tokens), ``open`` (context added, its turn not
    generated: a failed turn), ``answered`` (ends with our turn, closed by a stop token),
    ``cut`` (ends with our turn, cut without a stop token)."""

    client: GenerationClient
    seen: list[_Key] = field(default_factory=list)
    tools_key: str = ""
    state: Literal["empty", "open", "answered", "cut"] = "empty"
    last: AssistantMessage | None = None
    answer: bool = False

    def generated(self) -> bool:
        return self.client.turns > 0


@dataclass
class _Session:
    key: str
    root: str
    segment: _Segment
    archived: list[Trajectory] = field(default_factory=list)
    busy: bool = False
    spawned: int = 0
    requests: int = 0
    mismatches: int = 0
    malformed: int = 0
    errors: int = 0
    last_error: str | None = None


@dataclass(frozen=True, slots=True)
class _Request:
    """A checked chat-completions body."""

    messages: list[dict[str, Any]]
    keys: list[_Key]
    tools: list[dict[str, Any]] | None
    tools_key: str
    tool_choice_none: bool
    model: str
    stream: bool
    include_usage: bool
    logprobs: bool
    max_tokens: int | None
    seed: int | None


class _Connection(asyncio.Protocol):
    """One client connection: aiohttp's protocol (``inner``), given the header deadline that
    aiohttp lacks. The clock starts when the connection opens, and when a byte arrives while
    no request is being answered (a next request's header); a request reaching the app (its
    header is whole) stops it (``request_started``, from the middleware); at the deadline
    the connection is closed. Silence between requests is aiohttp's ``keepalive_timeout``."""

    def __init__(
        self,
        inner: asyncio.Protocol,
        timeout_s: float,
        live: dict[asyncio.BaseTransport, _Connection],
    ) -> None:
        self.inner = inner
        self.timeout_s = timeout_s
        self.live = live
        self.transport: asyncio.BaseTransport | None = None
        self.deadline: asyncio.TimerHandle | None = None
        self.answering = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.live[transport] = self
        self.inner.connection_made(transport)
        self._start_clock()

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)
        if not self.answering and self.deadline is None:
            self._start_clock()

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_clock()
        if self.transport is not None:
            self.live.pop(self.transport, None)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def request_started(self) -> None:
        self.answering += 1
        self._stop_clock()

    def request_ended(self) -> None:
        self.answering -= 1

    def _start_clock(self) -> None:
        loop = asyncio.get_running_loop()
        self.deadline = loop.call_later(self.timeout_s, self._expire)

    def _stop_clock(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _expire(self) -> None:
        self.deadline = None
        if self.answering or self.transport is None or self.transport.is_closing():
            return
        log.debug(
            "ChatEndpoint: closing a connection whose request header did not arrive whole "
            "within header_timeout_s=%s",
            self.timeout_s,
        )
        self.transport.close()


# --------------------------------------------------------------------------------------------
# The endpoint
# --------------------------------------------------------------------------------------------
class ChatEndpoint:
    """The OpenAI-compatible chat-completions server (module docstring).

    ``ChatEndpoint(chat, *, host="127.0.0.1", port=0, token=None, model="asyncflow-policy",
    max_body_bytes=16 MiB, header_timeout_s=10.0, idle_timeout_s=60.0)``: ``chat`` renders and
    parses turns (the format the policy was trained with); ``port=0`` picks a free port;
    ``token``: the run token every request must carry (default: a fresh
    ``secrets.token_urlsafe(32)``; at least 16 characters, no whitespace);
    ``header_timeout_s`` / ``idle_timeout_s``: how long a connection may take to send a
    request's header, and may stay silent between requests (module docstring). ``await
    start()`` binds (``url``, ``addresses``), ``open(client)`` / ``close_session(key)``
    bracket one trajectory, ``await close()`` stops serving. Use it on the event loop the
    ``RLJob`` runs on (its handlers call the clients' ``generate``)."""

    def __init__(
        self,
        chat: ChatFormat,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        model: str = "asyncflow-policy",
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    ) -> None:
        if not isinstance(chat, ChatFormat):
            raise ConfigError(
                f"ChatEndpoint: chat must be a ChatFormat (prompt, followup, parse, decode, "
                f"stop_token_ids), got {type(chat).__name__}"
            )
        if not isinstance(host, str) or not host:
            raise ConfigError(f"ChatEndpoint: host must be a non-empty string, got {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError(f"ChatEndpoint: port must be an int in [0, 65535], got {port!r}")
        if token is None:
            token = secrets.token_urlsafe(32)
        elif not isinstance(token, str) or len(token) < 16 or not _header_safe(token):
            # never echo the value: it is a secret
            kind = type(token).__name__
            size = f"{len(token)}-character " if isinstance(token, str) else ""
            raise ConfigError(
                f"ChatEndpoint: token must be a string of at least 16 printable ASCII "
                f"characters without whitespace, got a {size}{kind}; leave it out for a "
                "random one (secrets.token_urlsafe(32))"
            )
        if not isinstance(model, str) or not model:
            raise ConfigError(f"ChatEndpoint: model must be a non-empty string, got {model!r}")
        if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int):
            raise ConfigError(
                f"ChatEndpoint: max_body_bytes must be an int, got {max_body_bytes!r}"
            )
        if max_body_bytes < 1024:
            raise ConfigError(f"ChatEndpoint: max_body_bytes must be >= 1024, got {max_body_bytes}")
        for name, value in (
            ("header_timeout_s", header_timeout_s),
            ("idle_timeout_s", idle_timeout_s),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"ChatEndpoint: {name} must be a number, got {value!r}")
            if not 0 < value < math.inf:
                raise ConfigError(f"ChatEndpoint: {name} must be > 0 and finite, got {value!r}")
        self.chat = chat
        self.host = host
        self.port = port
        self.model = model
        self.max_body_bytes = max_body_bytes
        self.header_timeout_s = float(header_timeout_s)
        self.idle_timeout_s = float(idle_timeout_s)
        self._token = token
        self._sessions: dict[str, _Session] = {}
        self._runner: web.AppRunner | None = None
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.BaseTransport, _Connection] = {}
        self._url: str | None = None
        self._addresses: list[tuple[str, int]] = []
        self._created = int(time.time())

    def __repr__(self) -> str:
        where = self._url or f"{self.host}:{self.port} (not started)"
        return f"ChatEndpoint({where}, model={self.model!r}, sessions={len(self._sessions)})"

    # ---- lifecycle ----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """``http://HOST:PORT`` once started."""
        if self._url is None:
            raise ConfigError("ChatEndpoint: not started; await endpoint.start() first")
        return self._url

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """The ``(host, port)`` of every socket the server listens on."""
        return list(self._addresses)

    async def start(self) -> str:
        """Bind and serve; returns ``url``. Starting twice is refused."""
        if self._runner is not None:
            raise ConfigError("ChatEndpoint: already started")
        if not is_loopback_literal(self.host):
            log.warning(
                "ChatEndpoint listens on %s, not loopback: anyone who can reach it and holds "
                "the run token can generate with the policy",
                self.host,
            )

        @web.middleware
        async def guard(request: web.Request, handler: _Handler) -> web.StreamResponse:
            transport = request.transport
            connection = None if transport is None else self._connections.get(transport)
            if connection is not None:
                connection.request_started()
            try:
                return await self._guard(request, handler)
            finally:
                if connection is not None:
                    connection.request_ended()

        app = web.Application(middlewares=[guard], client_max_size=self.max_body_bytes)
        app.router.add_post("/t/{key}/v1/chat/completions", self._chat_completions)
        app.router.add_get("/t/{key}/v1/models", self._models)
        app.router.add_get("/v1/models", self._models)
        runner = web.AppRunner(
            app, access_log=None, handle_signals=False, keepalive_timeout=self.idle_timeout_s
        )
        await runner.setup()
        protocol = runner.server
        assert protocol is not None  # set up

        def connection() -> _Connection:
            return _Connection(protocol(), self.header_timeout_s, self._connections)

        try:
            # not web.TCPSite: each connection is wrapped to give it the header deadline
            server = await asyncio.get_running_loop().create_server(
                connection, self.host, self.port
            )
        except BaseException:
            await runner.cleanup()
            raise
        self._runner, self._server = runner, server
        self._addresses = [
            (str(s.getsockname()[0]), int(s.getsockname()[1])) for s in server.sockets
        ]
        port = self._addresses[0][1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self._url = f"http://{host}:{port}"
        log.info("ChatEndpoint serving on %s", self._url)
        return self._url

    async def close(self) -> None:
        """Stop serving (safe to repeat); open sessions are dropped."""
        runner, self._runner = self._runner, None
        server, self._server = self._server, None
        self._sessions.clear()
        if server is not None:
            server.close()  # stop accepting; the runner closes the open connections
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> ChatEndpoint:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- sessions -----------------------------------------------------------------------------
    def open(self, client: GenerationClient) -> Session:
        """A new session recording into ``client`` (one trajectory)."""
        if not isinstance(client, GenerationClient):
            raise ConfigError(
                f"ChatEndpoint.open: client must be a GenerationClient, got {type(client).__name__}"
            )
        url = self.url
        key = secrets.token_hex(8)
        while key in self._sessions:  # pragma: no cover - 64 random bits
            key = secrets.token_hex(8)
        self._sessions[key] = _Session(key, client.trajectory_id, _Segment(client))
        return Session(key, f"{url}/t/{key}/v1", self._token, client.trajectory_id)

    def close_session(self, key: str) -> SessionRecord:
        """End session ``key`` and return its record (later requests to it get 404; a turn
        still generating when it closes is not in the record)."""
        session = self._sessions.pop(key, None)
        if session is None:
            raise BadRequestError(
                f"ChatEndpoint.close_session: no open session {key!r} (closed already?)"
            )
        return _record(session)

    def record(self, key: str) -> SessionRecord:
        """A snapshot of open session ``key``'s record (it stays open)."""
        session = self._sessions.get(key)
        if session is None:
            raise BadRequestError(f"ChatEndpoint.record: no open session {key!r}")
        return _record(session)

    # ---- HTTP ---------------------------------------------------------------------------------
    async def _guard(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """Authorise every route, and answer every error in OpenAI's shape."""
        try:
            self._authorize(request)
            return await handler(request)
        except _Refusal as exc:
            log.debug("%s %s -> %d: %s", request.method, request.path, exc.status, exc.message)
            return _error(exc)
        except web.HTTPException as exc:  # aiohttp's own: no such route, method not allowed
            if exc.status == 413:
                return _error(self._too_large())
            message = f"{request.method} {request.path}: {exc.reason}"
            if exc.status == 404:
                message += "; routes: POST /t/{key}/v1/chat/completions, GET /v1/models"
            return _error(_Refusal(exc.status, message))
        except Exception as exc:
            log.exception("ChatEndpoint: %s %s failed", request.method, request.path)
            return _error(_Refusal(500, f"internal error: {type(exc).__name__}: {exc}"))

    def _authorize(self, request: web.Request) -> None:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        expected = self._token.encode()
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode("utf-8", "replace"), expected
        ):
            raise _Refusal(
                401,
                "missing or wrong API key: send the endpoint's run token (Session.api_key) as "
                "'Authorization: Bearer <token>'",
                code="invalid_api_key",
            )

    def _too_large(self) -> _Refusal:
        return _Refusal(
            413,
            f"the request body is larger than max_body_bytes={self.max_body_bytes}; raise "
            "ChatEndpoint(max_body_bytes=...) or send a shorter conversation",
            code="request_too_large",
        )

    def _session(self, request: web.Request) -> _Session:
        key = request.match_info.get("key", "")
        session = self._sessions.get(key)
        if session is None:
            raise _Refusal(
                404,
                f"no open session {key!r}: use the base_url of a session opened with "
                "ChatEndpoint.open (sessions end when their trajectory is recorded)",
                code="session_not_found",
            )
        return session

    async def _models(self, request: web.Request) -> web.StreamResponse:
        if "key" in request.match_info:
            self._session(request)
        model = {
            "id": self.model,
            "object": "model",
            "created": self._created,
            "owned_by": "asyncflow",
        }
        return web.json_response({"object": "list", "data": [model]})

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        if session.busy:
            busy = _Refusal(
                409,
                f"session {session.key} is already generating a turn: send one request at a "
                "time per session (a trajectory is one conversation)",
                code="concurrent_request",
            )
            session.errors += 1
            session.last_error = busy.message
            raise busy
        session.busy = True  # no await between the check and this
        try:
            body = await self._body(request)
            req = _parse(body, session.segment.client.sampling, self.model)
            return await self._turn(request, session, req)
        except Exception as exc:
            session.errors += 1
            session.last_error = (
                exc.message if isinstance(exc, _Refusal) else f"{type(exc).__name__}: {exc}"
            )
            raise
        finally:
            session.busy = False

    async def _body(self, request: web.Request) -> dict[str, Any]:
        size = request.content_length
        if size is not None and size > self.max_body_bytes:
            raise self._too_large()
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise self._too_large() from exc
        try:
            body = load_json(raw)  # nesting past MAX_JSON_DEPTH is refused here, not a 500 later
        except ValueError as exc:  # UnicodeDecodeError included
            raise _Refusal(400, f"the request body is not JSON ({exc})") from exc
        if not isinstance(body, dict):
            raise _Refusal(
                400, f"the request body must be a JSON object, got {type(body).__name__}"
            )
        return body

    # ---- one turn -----------------------------------------------------------------------------
    async def _turn(
        self, request: web.Request, session: _Session, req: _Request
    ) -> web.StreamResponse:
        chat = self.chat
        seg = session.segment
        plan = _plan(seg, req)
        try:
            if plan == "prompt":
                ids = chat.prompt(req.messages, req.tools)
                seg.client.add(ids, role="prompt")
                seg.tools_key = req.tools_key
            elif plan == "followup":
                new = req.messages[len(seg.seen) :]
                ids = chat.followup(new)
                seg.client.add(
                    ids, role="tool" if all(m["role"] == "tool" for m in new) else "user"
                )
            elif plan == "split":
                ids = chat.prompt(req.messages, req.tools)
                client = seg.client.spawn(f"{session.root}.s{session.spawned + 1}")
                client.add(ids, role="prompt")
                # nothing failed: the session moves to the new segment
                session.spawned += 1
                session.mismatches += 1
                if seg.generated():
                    session.archived.append(seg.client.trajectory(ended="split"))
                log.debug(
                    "session %s: mismatch, split into segment %d", session.key, session.spawned
                )
                seg = session.segment = _Segment(client, tools_key=req.tools_key)
        except TrajectoryLimitReached as exc:
            raise _limit(exc) from exc
        except BadRequestError as exc:
            raise _Refusal(
                400, f"the messages cannot be rendered: {exc}", param="messages"
            ) from exc
        seg.seen = list(req.keys)
        seg.state = "open"
        try:
            result = await seg.client.generate(max_tokens=req.max_tokens, seed=req.seed)
        except TrajectoryLimitReached as exc:
            raise _limit(exc) from exc
        seg.state = "cut"  # our turn is recorded: until it is parsed, nothing can follow it
        message, finish, key, answer = self._reply(seg, req, result)
        session.requests += 1
        if seg.last is not None and seg.last.malformed:
            session.malformed += 1
        seg.seen.append(key)
        seg.state = "answered" if result.finish_reason == "stop" else "cut"
        seg.answer = answer
        lp = self._logprobs(result) if req.logprobs else None
        usage = {
            "prompt_tokens": len(result.prompt_tokens),
            "completion_tokens": len(result.tokens),
            "total_tokens": len(result.prompt_tokens) + len(result.tokens),
        }
        head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": req.model,
        }
        if req.stream:
            return await _stream(
                request, head, message, finish, lp, usage if req.include_usage else None
            )
        choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": lp}
        return web.json_response(
            {**head, "object": "chat.completion", "choices": [choice], "usage": usage}
        )

    def _reply(
        self, seg: _Segment, req: _Request, result: GenerationResult
    ) -> tuple[dict[str, Any], str, _Key, bool]:
        """The OpenAI message of a generated turn, its finish reason, its comparison key, and
        whether it is an answer."""
        parsed = self.chat.parse(result.tokens)
        blocks = len(parsed.tool_calls) + len(parsed.malformed)
        meta: dict[str, Any] = {"tool_calls": blocks}
        if parsed.malformed:
            meta["tool_errors"] = len(parsed.malformed)
        seg.client.annotate(**meta)
        seg.last = parsed
        stopped = result.finish_reason == "stop"
        calls = (
            parsed.tool_calls
            if stopped and not parsed.malformed and not req.tool_choice_none
            else ()
        )
        content = parsed.text if blocks and not calls else parsed.content
        message: dict[str, Any] = {
            "role": "assistant",
            "content": (content or None) if calls else content,
        }
        if calls:
            message["tool_calls"] = [
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(dict(c.arguments))},
                }
                for c in calls
            ]
        finish = ("tool_calls" if calls else "stop") if stopped else "length"
        key: _Key = ("assistant", content, tuple((c.name, _canonical(c.arguments)) for c in calls))
        return message, finish, key, stopped and not calls

    def _logprobs(self, result: GenerationResult) -> dict[str, Any]:
        content = []
        for token, logprob in zip(result.tokens, result.logprobs, strict=True):
            text = self.chat.decode([token])
            content.append(
                {
                    "token": text,
                    "logprob": float(logprob),
                    "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [],
                }
            )
        return {"content": content, "refusal": None}


# --------------------------------------------------------------------------------------------
# The agent loop
# --------------------------------------------------------------------------------------------
AgentProgram = Callable[[Mapping[str, Any], Session], Any]
"""``agent(sample, session)``: user code driving its framework against ``session.base_url``
(sync: run in a worker thread; async: awaited). What it returns is ignored."""


class EndpointLoop:
    """An ``AgentLoop`` running an agent program against a ``ChatEndpoint``: ``run(sample,
    client)`` opens a session on ``client``, calls ``agent(sample, session)`` (a coroutine
    function is awaited; a plain function runs in a worker thread, ``asyncio.to_thread``, so
    blocking clients such as ``openai.OpenAI`` work — the default executor bounds how many run
    at once), closes the session and returns its **last segment** as the trajectory, scored
    by ``reward(sample, final, trajectory)`` (``SampleReward``; ``final``: the last turn when
    it was an answer, see ``SessionRecord.final``; None leaves the reward to the job's
    ``reward_fn``).

    Earlier segments of a split conversation are not returned: a GRPO group needs exactly one
    row per sample, and an earlier segment is not a complete attempt at the sample. They are
    counted instead: the last turn's ``meta["endpoint"]`` holds ``requests``, ``mismatches``,
    ``splits``, ``malformed``, ``errors`` and ``agent_error`` (the exception's type and
    message, or None), and ``metrics`` sums them over the loop's sessions. Agents whose
    conversations split often are re-tokenising or editing their history: see the module
    docstring.

    ``ended``: the limit that ended the last segment (``max_turns``, ``max_total_tokens``,
    ``stale`` — which ``RLJob`` regenerates —, ``closed``) if any; else ``"agent_error"`` when
    the agent raised (counted, and what was recorded is kept); else ``"answer"`` when the last
    turn was an answer, ``"length"`` when it was cut, ``"done"`` otherwise (the agent stopped
    after a tool-call turn or a failed one).

    An agent that made no request at all (or only refused ones) raises ``BadRequestError``
    naming the sample, and the last refusal (a trajectory needs at least its prompt, and
    inventing one would train on a conversation that never happened); the agent's own
    exception, if any, is its cause. That stops the job: an agent that cannot reach the
    endpoint is a bug to fix, not a sample to skip."""

    def __init__(
        self,
        endpoint: ChatEndpoint,
        agent: AgentProgram,
        *,
        reward: SampleReward | None = None,
    ) -> None:
        if not isinstance(endpoint, ChatEndpoint):
            raise ConfigError(
                f"EndpointLoop: endpoint must be a ChatEndpoint, got {type(endpoint).__name__}"
            )
        if not callable(agent):
            raise ConfigError(
                f"EndpointLoop: agent must be a callable agent(sample, session), got "
                f"{type(agent).__name__}"
            )
        if reward is not None and not callable(reward):
            raise ConfigError(f"EndpointLoop: reward must be callable, got {type(reward).__name__}")
        self.endpoint = endpoint
        self.agent = agent
        self.reward = reward
        self.metrics: Counter[str] = Counter()
        """Sums over the sessions run: ``sessions``, ``requests``, ``mismatches``,
        ``splits``, ``malformed``, ``errors``, ``agent_errors``."""

    async def run(self, sample: Mapping[str, Any], client: GenerationClient) -> Trajectory:
        session = self.endpoint.open(client)
        error: Exception | None = None
        try:
            await _call(self.agent, dict(sample), session)
        except Exception as exc:  # the agent's failure: counted, the record is kept
            error = exc
            log.warning(
                "EndpointLoop: the agent raised %s: %s (trajectory %s)",
                type(exc).__name__,
                exc,
                client.trajectory_id,
            )
        finally:
            record = self.endpoint.close_session(session.key)
        counts = {
            "requests": record.requests,
            "mismatches": record.mismatches,
            "splits": record.splits,
            "malformed": record.malformed,
            "errors": record.errors,
        }
        self.metrics.update(sessions=1, agent_errors=int(error is not None), **counts)
        if not record.segments:
            refused = (
                f"; its {record.errors} request(s) were all refused, the last with: "
                f"{record.last_error}"
                if record.errors
                else ""
            )
            raised = f"; it raised {type(error).__name__}: {error}" if error else ""
            raise BadRequestError(
                f"EndpointLoop: the agent {_name(self.agent)} made no chat-completion request "
                f"that was answered for sample {_describe(sample)}; it must call the model at "
                f"{session.base_url} at least once{refused}{raised}"
            ) from error
        last = record.segments[-1]
        meta = {
            **counts,
            "agent_error": None if error is None else f"{type(error).__name__}: {error}",
        }
        end = last.turns[-1]
        turns = (*last.turns[:-1], replace(end, meta={**end.meta, "endpoint": meta}))
        if last.ended is not None:
            ended = last.ended
        elif error is not None:
            ended = "agent_error"
        elif record.final is not None:
            ended = "answer"
        elif any(t.finish_reason in ("length", "abort") for t in last.assistant_turns()[-1:]):
            ended = "length"
        else:
            ended = "done"
        unscored = replace(last, turns=turns, ended=ended).validate()
        reward: float | None = None
        if self.reward is not None:
            value = self.reward(sample, record.final, unscored)
            reward = float(await value) if inspect.isawaitable(value) else float(value)
        return replace(unscored, reward=reward)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------
def _record(session: _Session) -> SessionRecord:
    seg = session.segment
    segments = list(session.archived)
    if seg.client.tokens:
        segments.append(seg.client.trajectory())
    return SessionRecord(
        session.key,
        tuple(segments),
        session.requests,
        session.mismatches,
        session.malformed,
        session.errors,
        session.last_error,
        seg.last,
        seg.last if seg.answer else None,
    )


def _plan(seg: _Segment, req: _Request) -> Literal["prompt", "followup", "retry", "split"]:
    """How a request continues the segment (the split rule of the module docstring)."""
    if seg.state == "empty":
        return "prompt"
    if req.tools_key != seg.tools_key:
        return "split"
    n = len(seg.seen)
    if seg.state == "open":
        return "retry" if req.keys == seg.seen else "split"
    new = req.keys[n:]
    if seg.state == "answered" and len(req.keys) > n and req.keys[:n] == seg.seen and new:
        return "followup" if all(k[0] != "assistant" for k in new) else "split"
    return "split"


def _limit(exc: TrajectoryLimitReached) -> _Refusal:
    return _Refusal(
        400,
        f"the trajectory cannot take another turn ({exc.reason}): {exc}; its record is kept — "
        "end the conversation",
        param="messages",
        code="context_length_exceeded",
    )


def _error(exc: _Refusal) -> web.Response:
    body = {
        "error": {"message": exc.message, "type": exc.kind, "param": exc.param, "code": exc.code}
    }
    headers = {"x-should-retry": "false"}
    if exc.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    response = web.json_response(body, status=exc.status, headers=headers)
    if exc.status == 401:  # no keep-alive for a client without the token
        response.force_close()
    return response


async def _stream(
    request: web.Request,
    head: Mapping[str, Any],
    message: Mapping[str, Any],
    finish: str,
    logprobs: Mapping[str, Any] | None,
    usage: Mapping[str, Any] | None,
) -> web.StreamResponse:
    """The turn as server-sent ``chat.completion.chunk`` events."""
    base: dict[str, Any] = {**head, "object": "chat.completion.chunk"}
    if usage is not None:
        base["usage"] = None
    delta: dict[str, Any] = {"role": "assistant", "content": message["content"]}
    if "tool_calls" in message:
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
    chunks: list[dict[str, Any]] = [
        {
            **base,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": None}],
        },
        {**base, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}]},
    ]
    if usage is not None:
        chunks.append({**base, "choices": [], "usage": dict(usage)})
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    try:
        for chunk in chunks:
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionError:  # the client went away; the turn is recorded all the same
        log.debug("stream to %s ended early: the client disconnected", request.path)
    return response


# ---- request parsing -------------------------------------------------------------------------
def _parse(body: Mapping[str, Any], sampling: SamplingParams, default_model: str) -> _Request:
    """The checked request, or a ``_Refusal`` naming the first bad field."""
    model = body.get("model")
    if model is None:
        model = default_model
    if not isinstance(model, str):
        raise _Refusal(400, f"model must be a string, got {type(model).__name__}", param="model")
    messages, keys = _messages(body.get("messages"))
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        what = "a named function" if isinstance(choice, Mapping) else repr(choice)
        raise _Refusal(
            400,
            f"tool_choice={what} is not supported: forcing a tool call needs constrained "
            "decoding, which a sampled policy being trained does not do; send 'auto' (or "
            "leave it out) or 'none'",
            param="tool_choice",
        )
    if body.get("parallel_tool_calls") is False:
        raise _Refusal(
            400,
            "parallel_tool_calls=false is not supported: a sampled policy cannot be held to one "
            "call per turn; leave it out (every call of a turn is returned)",
            param="parallel_tool_calls",
        )
    choice_none = choice == "none"
    effective = None if choice_none or not tools else tools
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise _Refusal(
            400, f"n={n!r} is not supported: one choice per request (send n=1 or leave it out)",
            param="n",
        )  # fmt: skip
    stop = body.get("stop")
    if stop is not None and stop != []:
        raise _Refusal(
            400,
            "stop is not supported: a turn ends at the chat format's stop tokens (the policy "
            "is trained on exactly the turns it ends itself); leave stop out",
            param="stop",
        )
    _same_as_session("temperature", body.get("temperature"), sampling.temperature)
    _same_as_session("top_p", body.get("top_p"), sampling.top_p)
    top_k = body.get("top_k")
    if top_k == -1 and sampling.top_k == 0:  # vLLM spells "off" -1
        top_k = 0
    _same_as_session("top_k", top_k, sampling.top_k)
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and value != neutral:
            raise _Refusal(
                400,
                f"{name}={value!r} is not supported: it would change the distribution the "
                f"tokens are sampled from, which the trainer must score exactly; leave it out "
                f"(or send {neutral!r})",
                param=name,
            )
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise _Refusal(
                400, f"{name} (the legacy function API) is not supported; use tools", param=name
            )
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, Mapping):
        raise _Refusal(400, "stream_options must be an object", param="stream_options")
    include_usage = bool(stream and options and options.get("include_usage"))
    logprobs = _flag(body, "logprobs")
    top = body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top != 0):
        raise _Refusal(
            400,
            f"top_logprobs={top!r} is not supported: the engines report the sampled token's "
            "log-prob only; send logprobs=true without top_logprobs",
            param="top_logprobs",
        )
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, Mapping) and fmt.get("type") == "text"):
        raise _Refusal(
            400,
            "response_format other than {'type': 'text'} is not supported: structured output "
            "needs constrained decoding; leave it out and parse the text",
            param="response_format",
        )
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise _Refusal(
            400, "only text output is supported; leave modalities out", param="modalities"
        )
    if body.get("audio") is not None:
        raise _Refusal(400, "audio output is not supported; leave audio out", param="audio")
    cap = None
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _Refusal(400, f"{name} must be an integer >= 1, got {value!r}", param=name)
        cap = value if cap is None else min(cap, value)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise _Refusal(400, f"seed must be an integer >= 0, got {seed!r}", param="seed")
    return _Request(
        messages,
        keys,
        effective,
        _canonical(effective or []),
        choice_none,
        model,
        stream,
        include_usage,
        logprobs,
        cap,
        seed,
    )


_NEUTRAL: dict[str, Any] = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": {},
    "repetition_penalty": 1,
    "min_p": 0,
    "min_tokens": 0,
    "ignore_eos": False,
    "stop_token_ids": [],
    "best_of": 1,
    "use_beam_search": False,
}
"""Sampling knobs (OpenAI's, and vLLM's extensions) accepted only at their neutral value."""


def _same_as_session(name: str, value: Any, session: float) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Refusal(400, f"{name} must be a number, got {value!r}", param=name)
    # an int beyond float (JSON allows 4300 digits) is no sampling value: OverflowError
    close = abs(value) < 1e300 and math.isclose(
        float(value), float(session), rel_tol=1e-9, abs_tol=1e-12
    )
    if not close:
        raise _Refusal(
            400,
            f"{name}={value!r} differs from the session's sampling {name}={session!r}: the "
            f"trainer scores the tokens under the job's sampling settings; send "
            f"{name}={session!r} or leave it out",
            param=name,
        )


def _flag(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _Refusal(400, f"{name} must be true or false, got {value!r}", param=name)
    return value


def _messages(raw: Any) -> tuple[list[dict[str, Any]], list[_Key]]:
    """The chat format's copies of the request's messages and their comparison keys."""
    if not isinstance(raw, list) or not raw:
        raise _Refusal(400, "messages must be a non-empty list of chat messages", param="messages")
    messages: list[dict[str, Any]] = []
    keys: list[_Key] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping) or m.get("role") not in _ROLES:
            role = m.get("role") if isinstance(m, Mapping) else None
            raise _Refusal(
                400,
                f"{where} must be an object whose role is one of {list(_ROLES)}, got role {role!r}",
                param=where,
            )
        role = "system" if m["role"] == "developer" else str(m["role"])
        text = _text(m.get("content"), where)
        out: dict[str, Any] = {"role": role, "content": text}
        calls: tuple[tuple[str, str], ...] = ()
        if role == "assistant" and m.get("tool_calls"):
            try:
                parsed = message_tool_calls(m, where)
            except (BadRequestError, AttributeError, TypeError) as exc:
                raise _Refusal(400, str(exc), param=f"{where}.tool_calls") from exc
            calls = tuple((c.name, _canonical(c.arguments)) for c in parsed)
            out["tool_calls"] = [
                {
                    "id": str(raw_call.get("id") or f"call_{i}_{j}"),
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(dict(c.arguments))},
                }
                for j, (c, raw_call) in enumerate(zip(parsed, m["tool_calls"], strict=True))
            ]
        if role == "tool":
            for name in ("tool_call_id", "name"):
                if isinstance(m.get(name), str):
                    out[name] = m[name]
        messages.append(out)
        keys.append((role, text, calls))
    return messages, keys


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for j, part in enumerate(content):
            text = part.get("text") if isinstance(part, Mapping) else None
            if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(text, str):
                parts.append(text)
                continue
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise _Refusal(
                400,
                f"{where}.content[{j}] is a {kind!r} part: only text parts are supported (the "
                "policy reads text)",
                param=f"{where}.content",
            )
        return "".join(parts)
    raise _Refusal(
        400,
        f"{where}.content must be a string, null or a list of text parts, got "
        f"{type(content).__name__}",
        param=f"{where}.content",
    )


def _tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _Refusal(400, f"tools must be a list, got {type(raw).__name__}", param="tools")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(raw):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not name:
            raise _Refusal(
                400,
                f"tools[{i}] must be a function tool {{'type': 'function', 'function': "
                f"{{'name': ..., 'parameters': ...}}}}; other tool types are not supported",
                param=f"tools[{i}]",
            )
        out.append(dict(tool))
    return out


def _canonical(value: Any) -> str:
    """JSON with sorted keys: equal for equal parsed values, whatever their serialisation."""
    if isinstance(value, Mapping):
        value = dict(value)
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


async def _call(agent: AgentProgram, sample: dict[str, Any], session: Session) -> None:
    method = None if inspect.isroutine(agent) else type(agent).__dict__.get("__call__")
    if inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(method):
        await agent(sample, session)
        return
    out = await asyncio.to_thread(agent, sample, session)
    if inspect.isawaitable(out):
        await out


def _header_safe(token: str) -> bool:
    return all(33 <= ord(c) <= 126 for c in token)


def _name(agent: object) -> str:
    return str(getattr(agent, "__qualname__", None) or type(agent).__name__)


def _describe(sample: Mapping[str, Any]) -> str:
    messages = sample.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], Mapping):
        return f"with last message {str(messages[-1].get('content'))[:80]!r}"
    if isinstance(sample.get("prompt"), str):
        return f"with prompt {sample['prompt'][:80]!r}"
    return f"with keys {sorted(sample)}"
