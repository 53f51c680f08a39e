"""``ChatEndpoint``'s connection timeouts, over raw sockets: a connection that sends nothing, or
only part of a request header, is closed after its timeout, and so is one refused for its
token; a connection that keeps sending requests, or whose request takes longer than both
timeouts to answer, is not.

The timeouts are set to half a second; nothing waits on the clock: each test waits for the
evidence (the server closing the connection: a read returns end of file, or a response), and
its time limit is only a safety net."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("openai")

from asyncflow_serve import ChatEndpoint
from test_serve import ANSWER, CHAT, USER, aclient, rig

from asyncflow_core.contracts.errors import ConfigError

SAFETY_S = 30.0  # a safety net only
SHORT_S = 0.5  # the timeout under test
LONG_S = 3600.0  # the other timeout: it cannot be what closes a connection here
TOKEN = "t" * 32

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def run(coro: Any) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, SAFETY_S)

    return asyncio.run(bounded())


@contextlib.asynccontextmanager
async def serving(**kw: Any) -> AsyncIterator[ChatEndpoint]:
    endpoint = ChatEndpoint(CHAT, token=TOKEN, **kw)
    await endpoint.start()
    try:
        yield endpoint
    finally:
        await endpoint.close()


async def connect(endpoint: ChatEndpoint) -> Stream:
    host, port = endpoint.addresses[0]
    return await asyncio.open_connection(host, port)


def models_request(token: str | None = TOKEN) -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return f"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n{auth}\r\n".encode()


async def response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP response: status, headers (lower-case names), body."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    status_line, *lines = head.strip().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(status_line.split()[1]), headers, body


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """Waits for the server to close the connection; True when it did without a word."""
    return await reader.read() == b""


def test_a_silent_connection_is_closed_after_the_idle_timeout() -> None:
    async def main() -> None:
        async with serving(header_timeout_s=LONG_S, idle_timeout_s=SHORT_S) as endpoint:
            reader, writer = await connect(endpoint)
            assert await closed_by_server(reader)
            writer.close()

    run(main())


@pytest.mark.parametrize("sent", [b"", b"GET /v1/models HTTP/1.1\r\nHost: loc"])
def test_a_connection_without_a_whole_header_is_closed_after_the_header_timeout(
    sent: bytes,
) -> None:
    """Nothing at all, or a header cut short: closed ``header_timeout_s`` after it opened."""

    async def main() -> None:
        async with serving(header_timeout_s=SHORT_S, idle_timeout_s=LONG_S) as endpoint:
            reader, writer = await connect(endpoint)
            writer.write(sent)
            await writer.drain()
            assert await closed_by_server(reader)
            writer.close()

    run(main())


def test_a_header_trickled_byte_by_byte_is_closed_after_the_header_timeout() -> None:
    """Bytes that keep coming do not keep a header's clock from running (a slow-loris
    client): the header is far too long to be finished before the timeout."""

    async def main() -> None:
        async with serving(header_timeout_s=SHORT_S, idle_timeout_s=LONG_S) as endpoint:
            reader, writer = await connect(endpoint)
            header = b"GET /v1/models HTTP/1.1\r\nX-Pad: " + b"x" * 4000 + b"\r\n\r\n"
            for byte in header:
                writer.write(bytes([byte]))
                await writer.drain()
                # the pace: a byte every 20 ms, unless the server closed meanwhile
                with contextlib.suppress(TimeoutError):
                    assert await asyncio.wait_for(reader.read(), 0.02) == b""
                    break
            else:
                pytest.fail("the server read the whole trickled header")
            writer.close()

    run(main())


def test_a_kept_alive_connection_is_closed_after_the_idle_timeout_once_answered() -> None:
    async def main() -> None:
        async with serving(header_timeout_s=LONG_S, idle_timeout_s=SHORT_S) as endpoint:
            reader, writer = await connect(endpoint)
            writer.write(models_request())
            status, headers, _ = await response(reader)
            assert status == 200 and headers.get("connection", "").lower() != "close"
            assert await closed_by_server(reader)
            writer.close()

    run(main())


def test_a_request_without_the_token_closes_its_connection() -> None:
    async def main() -> None:
        async with serving(header_timeout_s=LONG_S, idle_timeout_s=LONG_S) as endpoint:
            reader, writer = await connect(endpoint)
            writer.write(models_request(token=None))
            status, headers, _ = await response(reader)
            assert status == 401 and headers["connection"].lower() == "close"
            assert await closed_by_server(reader)
            writer.close()

    run(main())


def test_a_connection_that_keeps_sending_requests_is_not_cut() -> None:
    """One connection sends request after request while another, opened with it, sits silent
    until the server closes it (so both timeouts have passed); the busy one still answers."""

    async def main() -> None:
        async with serving(header_timeout_s=SHORT_S, idle_timeout_s=SHORT_S) as endpoint:
            silent, silent_writer = await connect(endpoint)
            reader, writer = await connect(endpoint)
            silent_closed = asyncio.ensure_future(closed_by_server(silent))
            while not silent_closed.done():
                writer.write(models_request())
                assert (await response(reader))[0] == 200
            assert await silent_closed
            writer.write(models_request())  # both timeouts have passed since it opened
            assert (await response(reader))[0] == 200
            silent_writer.close()
            writer.close()

    run(main())


def test_a_request_answered_after_both_timeouts_is_not_cut() -> None:
    """A turn that takes longer to generate than both timeouts is answered whole (a silent
    connection opened once the turn started is closed before the turn is let go)."""

    async def main() -> None:
        async with rig(token=TOKEN, header_timeout_s=SHORT_S, idle_timeout_s=SHORT_S) as r:
            _, session = r.open()
            r.engine.gate = asyncio.Event()
            r.engine.script = [ANSWER]
            async with aclient(session, max_retries=0) as oa:
                turn = asyncio.ensure_future(oa.chat.completions.create(model="m", messages=[USER]))
                await r.engine.arrived.wait()  # the turn is generating
                silent, silent_writer = await connect(r.endpoint)
                assert await closed_by_server(silent)
                r.engine.gate.set()
                assert (await turn).choices[0].message.content == "407"
                silent_writer.close()

    run(main())


def test_the_timeouts_default_to_10_and_60_s_and_bad_ones_are_refused() -> None:
    endpoint = ChatEndpoint(CHAT)
    assert (endpoint.header_timeout_s, endpoint.idle_timeout_s) == (10.0, 60.0)
    for name in ("header_timeout_s", "idle_timeout_s"):
        for bad in (0, -1.0, math.inf, math.nan, True, "5"):
            with pytest.raises(ConfigError, match=name):
                ChatEndpoint(CHAT, **{name: bad})
