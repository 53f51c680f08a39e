"""A small JSON-over-HTTP client for adapters that reach an engine server (``vllm serve``, the
SGLang server), on aiohttp (the ``[vllm-client]`` / ``[sglang-client]`` extras; imported when
the first client is built, so core does not depend on it).

Every failure is an ``EngineError`` naming the engine, the route and what to do: a server that
cannot be reached or does not answer in time is ``EngineUnavailableError``; an HTTP error
status quotes the server's message; a body that is not the JSON the route promises is
"a malformed response". Nothing waits without a bound: each call has a timeout.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping
from typing import Any

from asyncflow_core.contracts.errors import EngineError, EngineUnavailableError, MissingExtraError

__all__ = ["JsonClient"]

_NO_BODY = object()


class JsonClient:
    """``JsonClient(base_url, who=..., timeout_s=..., connect_timeout_s=..., install=...)``.

    ``await client.call(method, path, json=..., params=..., timeout_s=...)`` returns the
    decoded JSON body (None for an empty one). ``hints`` maps a status code to a sentence
    appended to that status's error (e.g. 404 -> "start the server with ..."). The session
    is made on first use, on the running loop; ``close()`` releases it (safe to repeat)."""

    def __init__(
        self,
        base_url: str,
        *,
        who: str,
        timeout_s: float = 300.0,
        connect_timeout_s: float = 10.0,
        install: str = "pip install 'asyncflow[vllm-client]'",
        hints: Mapping[int, str] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise EngineError(
                f"{who}: base_url must be an http(s) URL such as 'http://127.0.0.1:8000', "
                f"got {base_url!r}"
            )
        for name, value in (("timeout_s", timeout_s), ("connect_timeout_s", connect_timeout_s)):
            if not isinstance(value, int | float) or not 0 < value < math.inf:
                raise EngineError(f"{who}: {name} must be a number > 0, got {value!r}")
        try:
            import aiohttp  # noqa: F401
        except ImportError as exc:
            raise MissingExtraError(
                f"{who} talks HTTP through aiohttp, which is not installed ({exc}); install "
                f"it: {install}"
            ) from exc
        self.base_url = base_url.rstrip("/")
        self.who = who
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.hints = dict(hints or {})
        self.headers = dict(headers or {})
        self._session: Any = None
        self._closed = False

    async def call(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = _NO_BODY,
        params: Mapping[str, Any] | list[tuple[str, Any]] | None = None,
        timeout_s: float | None = None,
        expect_json: bool = True,
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        """One request; the decoded JSON answer (None when the body is empty), or with
        ``expect_json=False`` the body as text (routes that answer plain text). ``headers``
        add to (or replace) the client's own for this request; none of them is ever put in
        an error message (they may hold secrets)."""
        import aiohttp

        if self._closed:
            raise EngineError(f"{self.who}: the client is closed; build a new engine")
        session = self._session_now()
        url = f"{self.base_url}{path}"
        limit = self.timeout_s if timeout_s is None else timeout_s
        timeout = aiohttp.ClientTimeout(total=limit, sock_connect=self.connect_timeout_s)
        kwargs: dict[str, Any] = {"timeout": timeout}
        if json_body is not _NO_BODY:
            kwargs["json"] = json_body
        if params is not None:
            kwargs["params"] = [(k, _param(v)) for k, v in _pairs(params)]
        if headers:
            kwargs["headers"] = dict(headers)
        where = f"{method} {url}"
        try:
            async with session.request(method, url, **kwargs) as response:
                body = await response.read()
                status = response.status
        except TimeoutError as exc:
            raise EngineUnavailableError(
                f"{self.who}: {where} got no answer within {limit:g} s; the server is "
                "overloaded or stuck (raise timeout_s for long calls)"
            ) from exc
        except aiohttp.ClientConnectionError as exc:
            raise EngineUnavailableError(
                f"{self.who}: cannot reach {where} ({exc}); check that the server is running "
                f"at {self.base_url} and reachable from here"
            ) from exc
        except aiohttp.ClientError as exc:
            raise EngineError(f"{self.who}: {where} failed: {exc}") from exc
        text = body.decode("utf-8", errors="replace")
        if status >= 400:
            hint = self.hints.get(status, "")
            detail = _message(text)
            raise EngineError(
                f"{self.who}: {where} answered HTTP {status}: {detail}"
                + (f"; {hint}" if hint else "")
            )
        if not expect_json:
            return text
        if not text.strip():
            return None
        try:
            return json.loads(text)
        except (ValueError, RecursionError) as exc:  # RecursionError: nesting too deep
            raise EngineError(
                f"{self.who}: {where} answered HTTP {status} with a body that is not JSON "
                f"({text[:200]!r}); a malformed response — is {self.base_url} the engine's "
                "server?"
            ) from exc

    async def close(self) -> None:
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def _session_now(self) -> Any:
        import aiohttp

        loop = asyncio.get_running_loop()
        session = self._session
        if session is not None and (session.closed or getattr(session, "_loop", loop) is not loop):
            session = None
        if session is None:
            session = aiohttp.ClientSession(
                headers=self.headers, connector=aiohttp.TCPConnector(limit=0)
            )
            self._session = session
        return session


def _pairs(params: Mapping[str, Any] | list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    return list(params.items()) if isinstance(params, Mapping) else list(params)


def _param(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _message(text: str) -> str:
    """The server's error message: FastAPI's ``{"detail": ...}``, OpenAI's ``{"error":
    {"message": ...}}``, SGLang's ``{"message": ...}``, or the start of the body."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return text[:300] or "(empty body)"
    if isinstance(data, dict):
        for key in ("detail", "message", "error"):
            value = data.get(key)
            if isinstance(value, dict) and "message" in value:
                value = value["message"]
            if value:
                return str(value)[:300]
    return text[:300]
