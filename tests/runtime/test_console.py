"""The console's server alone, with a store that fails: it answers, and changes nothing."""

from __future__ import annotations

import asyncio
from typing import Any

from structlog.testing import capture_logs

from addon.observe.recent import Recent
from addon.runtime.console import MAX_CONNECTIONS, Console
from addon.runtime.consoleauth import Operators, Sessions
from store.errors import StoreUnavailable

TOKEN = "t" * 32  # noqa: S105 - a test's own


class _AnyStore:
    def __getattr__(self, name: str) -> Any:
        return lambda *args: None


class _BrokenLive:
    store = _AnyStore()

    async def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")


async def _ask(port: int, raw: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    reply = await reader.read()
    writer.close()
    return reply


def test_an_unexpected_failure_is_a_500_and_a_log_line() -> None:
    async def run() -> tuple[bytes, list[dict[str, Any]]]:
        sessions = Sessions()
        cookie, session = sessions.open("alice")
        operators = Operators((("alice", b"x" * 32),))
        console = Console("127.0.0.1", 0, operators, _BrokenLive(), Recent(), sessions)  # type: ignore[arg-type]
        _, port = await console.start()
        try:
            with capture_logs() as logs:
                body = f"csrf={session.csrf}&decision=approve".encode()
                reply = await _ask(
                    port,
                    b"POST /requests/7 HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n" % port
                    + b"Origin: http://127.0.0.1:%d\r\n" % port
                    + f"Cookie: credproxy_console={cookie}\r\n".encode()
                    + b"Content-Length: %d\r\n\r\n" % len(body)
                    + body,
                )
        finally:
            await console.close()
        return reply, logs

    reply, logs = asyncio.run(run())
    assert reply.startswith(b"HTTP/1.1 500 ")
    assert b"content-security-policy: default-src 'none'" in reply
    assert b"a bug" not in reply
    assert [e["event"] for e in logs] == ["hook.failed"]
    assert logs[0]["error_type"] == "RuntimeError"


def test_a_request_line_that_is_not_http_is_a_400() -> None:
    async def run() -> bytes:
        console = Console("127.0.0.1", 0, Operators((("a", b"x" * 32),)), _BrokenLive(), Recent())  # type: ignore[arg-type]
        _, port = await console.start()
        try:
            return await _ask(port, b"GET /\r\n\r\n")
        finally:
            await console.close()

    assert asyncio.run(run()).startswith(b"HTTP/1.1 400 ")


def test_connections_past_the_cap_are_closed_unanswered() -> None:
    async def run() -> tuple[bytes, bytes]:
        operators = Operators((("a", b"x" * 32),))
        console = Console("127.0.0.1", 0, operators, _BrokenLive(), Recent())  # type: ignore[arg-type]
        _, port = await console.start()
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(MAX_CONNECTIONS)]
        try:
            for _ in range(50):  # until the server has taken them all
                if console._open == MAX_CONNECTIONS:
                    break
                await asyncio.sleep(0.02)
            try:
                over = await asyncio.wait_for(_ask(port, b"GET / HTTP/1.1\r\n\r\n"), 5)
            except ConnectionResetError:  # closed with the request unread
                over = b""
            # One of those held still gets its answer.
            reader, writer = held.pop()
            writer.write(b"GET /console.css HTTP/1.1\r\nHost: x\r\n\r\n")
            answered = await asyncio.wait_for(reader.read(), 5)
        finally:
            for _, writer in held:
                writer.close()
            await console.close()
        return over, answered

    over, answered = asyncio.run(run())
    assert over == b""
    assert answered.startswith(b"HTTP/1.1 200 ")


class _StoreDownLive:
    store = _AnyStore()

    async def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("the store did not answer within 5 s")


def test_a_session_of_a_store_token_is_refused_while_the_store_is_down() -> None:
    async def run() -> list[bytes]:
        sessions = Sessions()
        cookie, _ = sessions.open("alice", token_id=1)
        console = Console("127.0.0.1", 0, None, _StoreDownLive(), Recent(), sessions)  # type: ignore[arg-type]
        _, port = await console.start()
        head = f"Host: x\r\nCookie: credproxy_console={cookie}\r\n\r\n".encode()
        try:
            return [await _ask(port, b"GET %s HTTP/1.1\r\n" % path + head) for path in paths]
        finally:
            await console.close()

    paths = (b"/panel", b"/", b"/grants")
    for reply in asyncio.run(run()):
        assert reply.startswith(b"HTTP/1.1 503 ")
        assert b"alice" not in reply
