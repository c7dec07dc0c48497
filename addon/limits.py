"""Limits a sandbox can push against: deadlines, connection caps, upstream timeouts.

The `Limits` addon counts connections and tunnels, keeps the deadlines of connections, flows
and upstream connections, and closes what is overdue from one sweeper task. What no hook can
see (head sizes, h2 queues, the answer of a stream cut off) is bounded in addon/bounds.py.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from addon import audit
from addon.argtypes import count, seconds
from addon.bounds import (
    TIMEOUT_PREFIX,
    audit_refusal,
    on_head_started,
    timed_out_flows,
    timed_out_servers,
)
from addon.policy import Reason
from store.errors import InvalidInput

if TYPE_CHECKING:
    from mitmproxy import connection, http, tls
    from mitmproxy.proxy import server_hooks

    from addon.state import Clients
    from addon.trail import Trail

SWEEP_INTERVAL = 0.5


@dataclass(frozen=True)
class LimitSettings:
    """The numbers `credproxy run` was given (seconds and counts)."""

    head_timeout: float = 10.0
    idle_timeout: float = 60.0
    connect_timeout: float = 10.0
    upstream_timeout: float = 30.0
    max_connections: int = 4096
    max_tunnels: int = 256  # per principal
    max_holds: int = 256  # requests held for approval at once
    max_held: int = 8  # of them per principal

    # The timers' messages, made once: a float formatted per request is not free.
    @cached_property
    def body_stalled(self) -> str:
        return f"{TIMEOUT_PREFIX}: the request body stalled for {self.upstream_timeout:g} s"

    @cached_property
    def body_not_sent(self) -> str:
        return f"request timeout: the body was not sent in {self.head_timeout:g} s"

    @cached_property
    def no_response(self) -> str:
        return f"{TIMEOUT_PREFIX}: no response in {self.upstream_timeout:g} s"

    @cached_property
    def response_stalled(self) -> str:
        return f"{TIMEOUT_PREFIX}: the response stalled for {self.upstream_timeout:g} s"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LimitSettings:
        """Raises: InvalidInput for NaN, an infinity, zero or a negative number."""
        values: dict[str, Any] = {}
        for dest, (flag, _, default, _) in LIMIT_FLAGS.items():
            value = getattr(args, dest, default)
            if not math.isfinite(value) or value <= 0:
                raise InvalidInput(f"{flag} must be a positive number, not {value}")
            values[dest] = value
        return cls(**values)


LIMIT_FLAGS: dict[str, tuple[str, str, float, str]] = {  # dest: flag, metavar, default, help
    "head_timeout": ("--head-timeout", "S", 10.0, "seconds to send a complete request head"),
    "idle_timeout": ("--idle-timeout", "S", 60.0, "seconds a connection may sit idle"),
    "connect_timeout": ("--connect-timeout", "S", 10.0, "seconds for upstream TCP and TLS"),
    "upstream_timeout": (
        "--upstream-timeout",
        "S",
        30.0,
        "seconds the upstream may take to answer, or stall mid-response",
    ),
    "max_connections": ("--max-connections", "N", 4096, "client connections in total"),
    "max_tunnels": ("--max-tunnels", "N", 256, "open CONNECT tunnels per principal"),
    "max_holds": ("--max-holds", "N", 256, "requests held for approval at once"),
    "max_held": ("--max-held", "N", 8, "requests held for approval at once, per principal"),
}


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    for dest, (flag, metavar, default, text) in LIMIT_FLAGS.items():
        parser.add_argument(
            flag,
            dest=dest,
            type=count(1) if isinstance(default, int) else seconds(),
            default=default,
            metavar=metavar,
            help=f"{text} (default {default:g})",
        )


# -- the addon ---------------------------------------------------------------------------


@dataclass(slots=True)
class _Conn:
    """A client connection's deadline and what keeps it open."""

    deadline: float
    head: bool  # the deadline is for a request head (else: idle)
    flows: set[str] = field(default_factory=set)
    principal: str | None = None  # whose tunnel this connection carries


@dataclass(slots=True)
class _Timer:
    deadline: float
    message: str
    client_id: str = ""


class Limits:
    """Connection caps and deadlines; runs after the request addons in the chain."""

    def __init__(self, settings: LimitSettings, clients: Clients, trail: Trail) -> None:
        self.settings = settings
        self.clients = clients
        self.trail = trail
        self.log = audit.logger()
        # All keyed weakly: mitmproxy's lifecycle releases them, whatever hook is missed.
        self.conns: weakref.WeakKeyDictionary[connection.Client, _Conn] = (
            weakref.WeakKeyDictionary()
        )
        self.tunnels: dict[str, weakref.WeakSet[connection.Client]] = {}
        self.flows: weakref.WeakKeyDictionary[http.HTTPFlow, _Timer] = weakref.WeakKeyDictionary()
        self.upstream: weakref.WeakKeyDictionary[connection.Connection, _Timer] = (
            weakref.WeakKeyDictionary()
        )
        self._sweeper: asyncio.Task[None] | None = None

    # -- lifecycle -------------------------------------------------------------------

    def running(self) -> None:
        on_head_started[:] = [self.head_started]
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    def done(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()

    def client_connected(self, client: connection.Client) -> None:
        if len(self.conns) >= self.settings.max_connections:
            client.error = "too many connections"  # mitmproxy closes it before reading
            audit_refusal(client, Reason.TOO_MANY_CONNECTIONS, "the proxy is at its connection cap")
            return
        self.conns[client] = _Conn(time.monotonic() + self.settings.head_timeout, head=True)

    def client_disconnected(self, client: connection.Client) -> None:
        conn = self.conns.pop(client, None)
        principal = conn.principal if conn is not None else None
        held = self.tunnels.get(principal) if principal is not None else None
        if principal is not None and held is not None:
            held.discard(client)
            if not held:
                del self.tunnels[principal]

    def head_started(self, client: connection.Client) -> None:
        conn = self.conns.get(client)
        if conn is not None and not conn.head:
            conn.deadline = min(conn.deadline, time.monotonic() + self.settings.head_timeout)
            conn.head = True

    # -- client side -----------------------------------------------------------------

    def http_connect(self, flow: http.HTTPFlow) -> None:
        try:
            self._connect(flow)
        except Exception as e:  # noqa: BLE001 - fail closed: no tunnel opens unchecked
            self.log.error("hook.failed", hook="limits.http_connect", error_type=type(e).__name__)
            state = self.clients.get(flow.client_conn)
            if state is not None:
                state.tunnel = None
            flow.kill()

    def _connect(self, flow: http.HTTPFlow) -> None:
        client = flow.client_conn
        conn = self.conns.get(client)
        if conn is not None:  # the TLS handshake and the first request inside, in time
            conn.deadline, conn.head = time.monotonic() + self.settings.head_timeout, True
        if flow.response is not None:
            return
        state = self.clients.get(client)
        tunnel = state.tunnel if state is not None else None
        if state is None or tunnel is None:
            return
        held = self.tunnels.setdefault(tunnel.principal, weakref.WeakSet())
        if client in held:
            return
        if len(held) >= self.settings.max_tunnels:
            # Unbind first: a tunnel left behind would vouch for later requests.
            state.tunnel = None
            rec = self.trail.begin(flow)
            rec.method, rec.principal = "CONNECT", tunnel.principal
            rec.host, rec.port = tunnel.host, tunnel.port
            detail = f"this principal has {self.settings.max_tunnels} tunnels open"
            self.trail.deny(flow, Reason.TOO_MANY_CONNECTIONS, detail)
            return
        held.add(client)
        if conn is not None:
            conn.principal = tunnel.principal

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        self._busy(flow.client_conn, flow.id)
        request = flow.request
        if flow.response is not None:
            return  # refused: its body is dropped, and the idle deadline ends a silent one
        now = time.monotonic()
        if callable(request.stream):
            # Streamed upstream: the body may not stall longer than the upstream may.
            wait = self.settings.upstream_timeout
            timer = self.flows[flow] = _Timer(now + wait, self.settings.body_stalled)
            request.stream = _touching(request.stream, timer, wait)
        else:
            # Held whole (credproxy.internal, 16 KiB at most): within the head deadline.
            wait = self.settings.head_timeout
            self.flows[flow] = _Timer(now + wait, self.settings.body_not_sent)

    def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is None:  # it goes upstream
            wait = self.settings.upstream_timeout
            self.flows[flow] = _Timer(time.monotonic() + wait, self.settings.no_response)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        timer = self.flows.get(flow)
        response = flow.response
        if timer is None or response is None:
            return
        wait = self.settings.upstream_timeout
        timer.deadline = time.monotonic() + wait
        timer.message = self.settings.response_stalled
        stream = response.stream
        if callable(stream):
            response.stream = _touching(stream, timer, wait)

    def response(self, flow: http.HTTPFlow) -> None:
        self.flows.pop(flow, None)
        self._idle(flow.client_conn, flow.id)

    def error(self, flow: http.HTTPFlow) -> None:
        self.flows.pop(flow, None)
        self._idle(flow.client_conn, flow.id)

    def websocket_start(self, flow: http.HTTPFlow) -> None:
        self._busy(flow.client_conn, "ws:" + flow.id)

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        self._idle(flow.client_conn, "ws:" + flow.id)

    def hold(self, flow: http.HTTPFlow) -> None:
        """A request held for approval: no head deadline while it waits."""
        self._busy(flow.client_conn, flow.id)

    def _busy(self, client: connection.Client, key: str) -> None:
        conn = self.conns.get(client)
        if conn is not None:
            conn.flows.add(key)
            conn.deadline, conn.head = math.inf, False

    def _idle(self, client: connection.Client, key: str) -> None:
        conn = self.conns.get(client)
        if conn is not None and key in conn.flows:
            conn.flows.discard(key)
            if not conn.flows:
                conn.deadline = time.monotonic() + self.settings.idle_timeout

    # -- upstream connections --------------------------------------------------------

    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        if data.server.error is None:
            wait = self.settings.connect_timeout
            message = f"{TIMEOUT_PREFIX}: no connection in {wait:g} s"
            self.upstream[data.server] = _Timer(time.monotonic() + wait, message, data.client.id)

    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        # addon/reuse.py's connections are TLS from the start: their handshake is done.
        if not data.server.tls or data.server.tls_established:
            self.upstream.pop(data.server, None)

    def tls_established_server(self, data: tls.TlsData) -> None:
        self.upstream.pop(data.conn, None)

    def tls_failed_server(self, data: tls.TlsData) -> None:
        self.upstream.pop(data.conn, None)

    def server_disconnected(self, data: server_hooks.ServerConnectionHookData) -> None:
        self.upstream.pop(data.server, None)

    # -- the sweeper -----------------------------------------------------------------

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL)
            try:
                self.sweep(time.monotonic())
            except Exception as e:  # noqa: BLE001 - the sweeper must outlive one bad round
                self.log.error("limits.sweep_failed", error_type=type(e).__name__)

    def sweep(self, now: float) -> None:
        """Close every connection and flow past its deadline."""
        for client, conn in list(self.conns.items()):
            if conn.deadline <= now:
                conn.deadline = math.inf  # once
                if conn.head:
                    detail = "no complete request head in time"
                    audit_refusal(client, Reason.REQUEST_TIMEOUT, detail)
                _close(client.id, client, "request head or idle timeout")
        for server, timer in list(self.upstream.items()):
            # Not yet started: waiting for mitmproxy's per-address semaphore; cancelling
            # there would leave the stream without an answer.
            if timer.deadline <= now and server.timestamp_start is not None:
                del self.upstream[server]
                timed_out_servers[server] = timer.message
                _close(timer.client_id, server, timer.message)
        for flow, timer in list(self.flows.items()):
            if timer.deadline <= now:
                del self.flows[flow]
                timed_out_flows[flow] = timer.message
                self._cut_upstream(flow, timer.message)

    def _cut_upstream(self, flow: http.HTTPFlow, message: str) -> None:
        client = flow.client_conn
        handler = _handler(client.id)
        if handler is None:
            return
        server: connection.Connection | None = flow.server_conn
        if server not in handler.transports:
            address = (flow.request.host, flow.request.port)
            server = next(
                (c for c in handler.transports if c is not client and c.address == address),
                None,
            )
        if server is None or not _close(client.id, server, message):
            _close(client.id, client, message)  # nothing upstream to cut: end it all


def _touching(stream: Callable[[bytes], Any], timer: _Timer, wait: float) -> Callable[[bytes], Any]:
    def touched(chunk: bytes) -> Any:
        timer.deadline = time.monotonic() + wait
        return stream(chunk)

    return touched


def _handler(client_id: str) -> Any:
    from mitmproxy import ctx

    proxyserver = ctx.master.addons.get("proxyserver")
    return proxyserver.connections.get(client_id) if proxyserver is not None else None


def _close(client_id: str, conn: connection.Connection, why: str) -> bool:
    """End `conn` the way mitmproxy's own inactivity watchdog does: cancel its task."""
    handler = _handler(client_id)
    io = handler.transports.get(conn) if handler is not None else None
    if io is None or io.handler is None:
        return False
    io.handler.cancel(why)
    return True
