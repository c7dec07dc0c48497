"""The admin listener (`--admin HOST:PORT`): /healthz, /readyz and /metrics, off the proxy port."""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Awaitable, Callable

PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"


class AdminServer:
    """A deliberately small HTTP/1.1 responder: GET only, no keep-alive, no bodies read."""

    def __init__(
        self,
        host: str,
        port: int,
        ready: Callable[[], tuple[bool, dict[str, object]]]
        | Callable[[], Awaitable[tuple[bool, dict[str, object]]]],
        metrics: Callable[[], bytes] | Callable[[], Awaitable[bytes]],
        path: str | None = None,
    ):
        self.host = host
        self.port = port
        self.path = path  # a Unix socket instead: a worker's, for its supervisor only
        self._ready = ready
        self._metrics = metrics
        self._server: asyncio.Server | None = None

    async def start(self) -> tuple[str, int]:
        if self.path is not None:
            self._server = await asyncio.start_unix_server(self._handle, self.path)
            return self.path, 0
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        host, port = self._server.sockets[0].getsockname()[:2]
        return str(host), int(port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            method, target = head.split(b"\r\n", 1)[0].split(b" ")[:2]
            path = target.split(b"?", 1)[0]
            if method == b"GET" and path == b"/metrics":
                metrics = self._metrics()
                payload = await metrics if inspect.isawaitable(metrics) else metrics
                status, kind = 200, PROMETHEUS
            else:
                status, body = await self._route(method, path)
                payload, kind = json.dumps(body).encode(), "application/json"
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError):
            status, payload, kind = 400, b'{"error": "bad request"}', "application/json"
        writer.write(
            f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}\r\n"
            f"content-type: {kind}\r\ncontent-length: {len(payload)}\r\n"
            "connection: close\r\n\r\n".encode()
            + payload
        )
        try:
            await writer.drain()
        finally:
            writer.close()

    async def _route(self, method: bytes, path: bytes) -> tuple[int, dict[str, object]]:
        if method != b"GET":
            return 405, {"error": "method not allowed"}
        if path == b"/healthz":
            return 200, {"status": "ok"}
        if path == b"/readyz":
            answer = self._ready()
            ready, detail = await answer if inspect.isawaitable(answer) else answer
            return (200 if ready else 503), {"status": "ready" if ready else "not ready", **detail}
        return 404, {"error": "not found"}
