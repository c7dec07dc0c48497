"""The load generator: asyncio keep-alive connections through CONNECT + TLS, or one per request.

The default client speaks HTTP/1.1 on raw asyncio streams, so that the client costs little
next to the proxy; `httpx` is kept for comparison (keep-alive only).
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

CONNECT_TIMEOUT = 30.0
READ_SIZE = 256 * 1024


@dataclass(frozen=True)
class Target:
    """Where requests go: `name:port` over TLS, straight or through an HTTP proxy."""

    name: str
    port: int
    path: str
    context: ssl.SSLContext
    proxy: tuple[str, int] | None = None
    # One (principal, token) per connection slot, round-robin; empty for no proxy auth.
    credentials: tuple[tuple[str, str], ...] = ()
    close: bool = False  # every request says `Connection: close`
    body: bytes | None = None  # sent with POST as application/json

    @property
    def authority(self) -> str:
        return self.name if self.port == 443 else f"{self.name}:{self.port}"

    def proxy_auth(self, slot: int) -> str | None:
        if not self.credentials:
            return None
        name, token = self.credentials[slot % len(self.credentials)]
        return "Basic " + base64.b64encode(f"{name}:{token}".encode()).decode()


@dataclass
class Outcome:
    """One cell's raw figures: latencies in seconds of the successful requests."""

    requests: int = 0
    errors: int = 0
    elapsed: float = 0.0
    # What `probe` counted over the timed part (the proxy's CPU seconds), if given.
    probed: float | None = None
    # Of `probed`, what the supervisor of `--workers` spent itself (its own process only).
    supervisor_s: float | None = None
    latencies: list[float] = field(default_factory=list)
    error_kinds: dict[str, int] = field(default_factory=dict)

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


class BadResponse(Exception):
    pass


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.open = True

    @classmethod
    async def dial(cls, target: Target, slot: int) -> _Connection:
        hostname = target.name
        if target.proxy is None:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", target.port, ssl=target.context, server_hostname=hostname
            )
            return cls(reader, writer)
        reader, writer = await asyncio.open_connection(*target.proxy)
        lines = [
            f"CONNECT {target.name}:{target.port} HTTP/1.1",
            f"Host: {target.name}:{target.port}",
        ]
        auth = target.proxy_auth(slot)
        if auth is not None:
            lines.append(f"Proxy-Authorization: {auth}")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        head = await reader.readuntil(b"\r\n\r\n")
        if head[9:12] != b"200":
            writer.close()
            raise BadResponse(f"CONNECT {head[9:12].decode(errors='replace')}")
        await writer.start_tls(target.context, server_hostname=hostname)
        return cls(reader, writer)

    async def get(self, request: bytes) -> int:
        """Send one request and read the whole response; returns the status code."""
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lowered = head.lower()
        if b"transfer-encoding: chunked" in lowered:
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                await self._skip(size + 2)
                if size == 0:
                    break
        else:
            start = lowered.find(b"content-length:")
            if start >= 0:
                end = lowered.index(b"\r\n", start)
                await self._skip(int(lowered[start + 15 : end]))
        if b"connection: close" in lowered:
            self.open = False
        return int(head[9:12])

    async def _skip(self, size: int) -> None:
        """Read and drop `size` bytes, a piece at a time: a download is never held whole."""
        while size > 0:
            piece = await self.reader.read(min(size, READ_SIZE))
            if not piece:
                raise asyncio.IncompleteReadError(b"", size)
            size -= len(piece)

    async def close(self) -> None:
        self.writer.close()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), 1.0)
        except (OSError, ssl.SSLError, TimeoutError):
            pass


def request_bytes(target: Target) -> bytes:
    close = "Connection: close\r\n" if target.close else ""
    if target.body is not None:
        return (
            f"POST {target.path} HTTP/1.1\r\nHost: {target.authority}\r\n"
            f"User-Agent: credproxy-bench\r\nAccept: */*\r\n{close}"
            f"Content-Type: application/json\r\nContent-Length: {len(target.body)}\r\n\r\n"
        ).encode() + target.body
    return (
        f"GET {target.path} HTTP/1.1\r\nHost: {target.authority}\r\n"
        f"User-Agent: credproxy-bench\r\nAccept: */*\r\n{close}\r\n"
    ).encode()


async def run_cell(
    target: Target,
    concurrency: int,
    requests: int | None,
    duration: float | None = None,
    *,
    per_connection: int | None = None,
    probe: Callable[[], float] | None = None,
) -> Outcome:
    """`requests` in total (or for `duration` s) over `concurrency` workers.

    `per_connection=1` opens a new connection (CONNECT + TLS) per request and times it
    whole; `None` keeps each connection for the whole cell, set up before the clock starts.
    """
    outcome = Outcome()
    request = request_bytes(target)
    tickets = iter(range(requests)) if requests is not None else None
    ready = asyncio.Barrier(concurrency + 1)
    go = asyncio.Event()
    deadline = [float("inf")]

    def take() -> bool:
        if time.monotonic() >= deadline[0]:
            return False
        return tickets is None or next(tickets, None) is not None

    async def worker(slot: int) -> None:
        conn: _Connection | None = await _warm(target, slot, request)
        served = 0
        if per_connection == 1:
            await conn.close()
            conn = None
        await ready.wait()
        await go.wait()
        while take():
            start = time.perf_counter()
            try:
                if conn is None or not conn.open:
                    conn = await asyncio.wait_for(_Connection.dial(target, slot), CONNECT_TIMEOUT)
                    served = 0
                status = await asyncio.wait_for(conn.get(request), CONNECT_TIMEOUT)
            except (
                OSError,
                ssl.SSLError,
                TimeoutError,
                BadResponse,
                ValueError,
                asyncio.IncompleteReadError,
                asyncio.LimitOverrunError,
            ) as e:
                outcome.error(type(e).__name__)
                if conn is not None:
                    await conn.close()
                conn = None
                continue
            served += 1
            if status != 200:
                outcome.error(f"status {status}")
            else:
                outcome.latencies.append(time.perf_counter() - start)
                outcome.requests += 1
            if per_connection is not None and served >= per_connection:
                await conn.close()
                conn = None
        if conn is not None:
            await conn.close()

    tasks = [asyncio.create_task(worker(slot)) for slot in range(concurrency)]
    await _start(ready, tasks)
    return await _timed(outcome, go, tasks, probe, duration, deadline)


async def _timed(
    outcome: Outcome,
    go: asyncio.Event,
    tasks: list[asyncio.Task[None]],
    probe: Callable[[], float] | None,
    duration: float | None = None,
    deadline: list[float] | None = None,
) -> Outcome:
    """Release the connected workers and time them until the last one is done."""
    probed = probe() if probe is not None else 0.0
    started = time.perf_counter()
    if duration is not None and deadline is not None:
        deadline[0] = time.monotonic() + duration
    go.set()
    await asyncio.gather(*tasks)
    outcome.elapsed = time.perf_counter() - started
    if probe is not None:
        outcome.probed = probe() - probed
    return outcome


async def _warm(target: Target, slot: int, request: bytes) -> _Connection:
    """Connect and send one untimed request, so the clock measures requests only."""
    conn = await asyncio.wait_for(_Connection.dial(target, slot), CONNECT_TIMEOUT)
    status = await asyncio.wait_for(conn.get(request), CONNECT_TIMEOUT)
    if status != 200:
        raise BadResponse(f"warm-up request answered {status}")
    return conn


async def _start(ready: asyncio.Barrier, tasks: list[asyncio.Task[Any]]) -> None:
    """Wait until every worker is connected; a worker that fails to connect fails the cell."""
    waiter = asyncio.create_task(ready.wait())
    done, _ = await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
    if waiter not in done:
        waiter.cancel()
        for task in tasks:
            task.cancel()
        for task in done:
            task.result()  # raises the worker's error
        raise BadResponse("a worker ended before the start")


async def run_cell_httpx(
    target: Target, concurrency: int, requests: int, probe: Callable[[], float] | None = None
) -> Outcome:
    """The same keep-alive cell with one httpx.AsyncClient (one connection) per worker."""
    import httpx

    outcome = Outcome()
    url = f"https://{target.authority}{target.path}"
    clients = []
    for slot in range(concurrency):
        proxy = None
        if target.proxy is not None:
            userinfo = ""
            if target.credentials:
                name, token = target.credentials[slot % len(target.credentials)]
                userinfo = f"{name}:{token}@"
            proxy = f"http://{userinfo}{target.proxy[0]}:{target.proxy[1]}"
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        clients.append(httpx.AsyncClient(proxy=proxy, verify=target.context, limits=limits))
    tickets = iter(range(requests))

    async def worker(client: httpx.AsyncClient) -> None:
        (await client.get(url)).raise_for_status()
        await ready.wait()
        await go.wait()
        while next(tickets, None) is not None:
            start = time.perf_counter()
            try:
                response = await client.get(url)
            except httpx.HTTPError as e:
                outcome.error(type(e).__name__)
                continue
            if response.status_code != 200:
                outcome.error(f"status {response.status_code}")
                continue
            outcome.latencies.append(time.perf_counter() - start)
            outcome.requests += 1

    ready = asyncio.Barrier(concurrency + 1)
    go = asyncio.Event()
    tasks = [asyncio.create_task(worker(c)) for c in clients]
    await _start(ready, tasks)
    await _timed(outcome, go, tasks, probe)
    for client in clients:
        await client.aclose()
    return outcome
