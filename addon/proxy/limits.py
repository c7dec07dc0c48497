"""Limits a sandbox can push against: deadlines, connection caps, upstream timeouts.

The `Limits` addon counts connections and tunnels, keeps the deadlines of connections, flows
and upstream connections, and closes what is overdue from one sweeper task. Which connection
may wait to authenticate is addon/proxy/admission.py's decision. What no hook can see (head sizes,
h2 queues, the answer of a stream cut off, a response body's reads) is bounded in
addon/mitm/bounds.py.

One module, about 520 lines: every deadline and cap is kept by one sweeper over one table of
connections, so that no limit can be forgotten by another.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import fcntl
import gc
import math
import sys
import termios
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from addon.core.argtypes import count, seconds
from addon.core.reasons import Reason
from addon.mitm.bounds import (
    TIMEOUT_PREFIX,
    audit_refusal,
    on_head_read,
    on_head_started,
    on_response_data,
    timed_out_flows,
    timed_out_servers,
)
from addon.observe import audit
from addon.proxy import reading
from addon.proxy.admission import DISPLACED, MAX_CONNECTIONS, REFUSED, Admission, Refused, peer_key
from store.errors import InvalidInput

if TYPE_CHECKING:
    from mitmproxy import connection, http, tls
    from mitmproxy.proxy import server_hooks

    from addon.proxy.state import Clients
    from addon.proxy.trail import Trail

SWEEP_INTERVAL = 0.5
# Memory freed by closed connections goes back to the system (glibc's malloc_trim, in a
# thread) once TRIM_AFTER closed since the last trim and none closed for TRIM_QUIET seconds
# (by then their parked upstream connections, addon/mitm/reuse.py's IDLE, are closed too),
# or TRIM_EVERY seconds after the first of them closed: glibc otherwise keeps a heap at its
# peak, so RSS after a burst of connections stayed at the burst's (`python -m bench.memory`).
# A trim runs a full collection on the loop (a few ms: start-up's objects are frozen), then
# malloc_trim off it.
TRIM_AFTER = 64
TRIM_QUIET = 5.0
TRIM_EVERY = 60.0
# Seconds a connection whose head began to arrive is not displaced for a newer one: the head
# may still be on its way through the hooks, under load, before it authenticates. One second
# was passed on a loaded two-core machine by a burst of 40 CONNECTs (CI); a head still arriving
# is bounded by --head-timeout whatever this is, so a longer grace lets no peer hold more.
READ_GRACE = 3.0


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
    max_unauthenticated: int | None = None  # None: a quarter of max_connections
    max_unauthenticated_per_address: int = 256

    @cached_property
    def unauthenticated_cap(self) -> int:
        if self.max_unauthenticated is not None:
            return self.max_unauthenticated
        return max(1, self.max_connections // 4)

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
            if value is None:
                continue
            if not math.isfinite(value) or value <= 0:
                raise InvalidInput(f"{flag} must be a positive number, not {value}")
            values[dest] = value
        settings = cls(**values)
        if settings.max_unauthenticated is not None:
            if settings.max_unauthenticated >= settings.max_connections:
                raise InvalidInput(
                    "--max-unauthenticated must be below --max-connections: the rest is "
                    "kept for authenticated connections"
                )
        return settings


LIMIT_FLAGS: dict[str, tuple[str, str, float | None, str]] = {  # dest: flag, metavar, default, help
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
    "max_unauthenticated": (
        "--max-unauthenticated",
        "N",
        None,
        "client connections not authenticated yet, in total (default: a quarter of "
        "--max-connections)",
    ),
    "max_unauthenticated_per_address": (
        "--max-unauthenticated-per-address",
        "N",
        256,
        "of them from one source address (IPv6: one /64)",
    ),
}


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    for dest, (flag, metavar, default, text) in LIMIT_FLAGS.items():
        parser.add_argument(
            flag,
            dest=dest,
            type=count(1) if metavar == "N" else seconds(),
            default=default,
            metavar=metavar,
            help=text if default is None else f"{text} (default {default:g})",
        )


# -- the addon ---------------------------------------------------------------------------


@dataclass(slots=True)
class _Conn:
    """A client connection's deadline and what keeps it open."""

    deadline: float
    head: bool  # the deadline is for a request head (else: idle)
    flows: set[str] = field(default_factory=set)
    principal: str | None = None  # whose tunnel this connection carries
    source: str = ""  # the peer's address it counts against until it authenticates
    read_at: float = -READ_GRACE  # when its last head began to arrive (time.monotonic())


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
        self.admission = Admission(
            settings.unauthenticated_cap,
            settings.max_unauthenticated_per_address,
            self._authenticated,
            self._taking,
        )
        if trail is not None:
            trail.metrics.connections = self.admission
        self._sweeper: asyncio.Task[None] | None = None
        self.closed_since_trim = 0
        # When the last connection closed, and the first since the last trim.
        self._closed_at = self._first_closed_at = -math.inf

    # -- lifecycle -------------------------------------------------------------------

    def running(self) -> None:
        on_head_started[:] = [self.head_started]
        on_head_read[:] = [self.head_read]
        on_response_data[:] = [self.response_data]
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    def done(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()

    def client_connected(self, client: connection.Client) -> None:
        try:
            self._admit(client)
        except Exception as e:  # noqa: BLE001 - fail closed: an unaccounted connection is refused
            self.log.error(
                "hook.failed", hook="limits.client_connected", error_type=type(e).__name__
            )
            client.error = "internal error"

    def _admit(self, client: connection.Client) -> None:
        source = peer_key(client)
        try:
            room = self.admission.make_room(source)
            if room is None and len(self.conns) >= self.settings.max_connections:
                raise Refused(MAX_CONNECTIONS)
        except Refused as e:
            self.admission.refused[e.bound] += 1
            client.error = "too many connections"  # mitmproxy closes it before reading
            audit_refusal(client, Reason.TOO_MANY_CONNECTIONS, REFUSED[e.bound])
            return
        if room is not None:
            self._displace(*room)
        self.conns[client] = _Conn(
            time.monotonic() + self.settings.head_timeout, head=True, source=source
        )
        self.admission.add(client, source)

    def _displace(self, client: connection.Client, bound: str) -> None:
        """Close an unauthenticated connection to make room for a newer one."""
        conn = self.conns.get(client)
        self.admission.remove(client, conn.source if conn is not None else peer_key(client))
        self.admission.displaced[bound] += 1
        detail = DISPLACED[bound]
        audit_refusal(client, Reason.TOO_MANY_CONNECTIONS, detail)
        # Closed at the socket, not by cancelling mitmproxy's task as the sweeper does: a
        # task cancelled before it first ran never closes its socket.
        found = reading.transport(client)
        if found is not None:
            found.close()
        else:  # not set up yet: mitmproxy closes it before reading
            client.error = detail

    def _taking(self, client: connection.Client) -> bool:
        """Bytes of this connection wait unread, or were read just now and their head may still
        be on its way through the hooks (a burst accepted together): not to be displaced."""
        conn = self.conns.get(client)
        recent = conn is not None and time.monotonic() - conn.read_at < READ_GRACE
        return recent or _unread(client)

    def _authenticated(self, client: connection.Client) -> bool:
        """Has a CONNECT or a proxy request on this connection named a valid token?"""
        state = self.clients.get(client)
        return state is not None and (state.tunnel is not None or state.principal is not None)

    def client_disconnected(self, client: connection.Client) -> None:
        self._closed_at = time.monotonic()
        if not self.closed_since_trim:
            self._first_closed_at = self._closed_at
        self.closed_since_trim += 1
        conn = self.conns.pop(client, None)
        if conn is not None:
            self.admission.remove(client, conn.source)
        principal = conn.principal if conn is not None else None
        held = self.tunnels.get(principal) if principal is not None else None
        if principal is not None and held is not None:
            held.discard(client)
            if not held:
                del self.tunnels[principal]

    def head_read(self, client: connection.Client) -> None:
        conn = self.conns.get(client)
        if conn is not None:
            conn.read_at = time.monotonic()

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
            self.admission.remove(client, conn.source)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        client = flow.client_conn
        self._busy(client, flow.id)
        conn = self.conns.get(client)
        if conn is not None and self.admission.is_pending(client) and self._authenticated(client):
            self.admission.remove(client, conn.source)
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
        timer.deadline = time.monotonic() + self.settings.upstream_timeout
        timer.message = self.settings.response_stalled

    def response_data(self, flow: http.HTTPFlow) -> None:
        """A piece of the response body arrived, held whole or streamed: no stall yet."""
        timer = self.flows.get(flow)
        if timer is not None:
            timer.deadline = time.monotonic() + self.settings.upstream_timeout

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
                wait = self.settings.idle_timeout
                if self.admission.is_pending(client):  # answered, never authenticated
                    wait = min(wait, self.settings.head_timeout)
                conn.deadline = time.monotonic() + wait

    # -- upstream connections --------------------------------------------------------

    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        if data.server.error is None:
            wait = self.settings.connect_timeout
            message = f"{TIMEOUT_PREFIX}: no connection in {wait:g} s"
            self.upstream[data.server] = _Timer(time.monotonic() + wait, message, data.client.id)

    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        # addon/mitm/reuse.py's connections are TLS from the start: their handshake is done.
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
                await self.trim(time.monotonic())
            except Exception as e:  # noqa: BLE001 - the sweeper must outlive one bad round
                self.log.error("limits.sweep_failed", error_type=type(e).__name__)

    async def trim(self, now: float) -> bool:
        """Give freed memory back once enough connections closed; True if it did."""
        if self.closed_since_trim < TRIM_AFTER:
            return False
        if now - self._closed_at < TRIM_QUIET and now - self._first_closed_at < TRIM_EVERY:
            return False
        trim = _malloc_trim()
        if trim is None:
            return False
        self.closed_since_trim = 0
        # A closed connection's objects hold each other (transports, protocols, layers): only
        # the cycle collector frees them, and nothing allocates enough to run it when quiet.
        gc.collect()
        await asyncio.to_thread(trim, 0)
        return True

    def sweep(self, now: float) -> None:
        """Close every connection and flow past its deadline."""
        for client, conn in list(self.conns.items()):
            if conn.deadline <= now:
                if reading.paused(client):
                    # Not read while one of its requests waits on credproxy (a token mint, a
                    # lookup, a rate bucket, an approval): that wait's own bound ends it.
                    continue
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
    # mitmproxy's ctx holds the running master: bound once it runs, read when used.
    from mitmproxy import ctx

    proxyserver = ctx.master.addons.get("proxyserver")
    return proxyserver.connections.get(client_id) if proxyserver is not None else None


def _unread(client: connection.Client) -> bool:
    """Do bytes wait on this connection that the proxy has not read yet (in the socket, or
    read by asyncio and not yet by mitmproxy)? False without a proxy server."""
    handler = _handler(client.id)
    io = handler.transports.get(client) if handler is not None else None
    if io is None:
        return False
    if getattr(io.reader, "_buffer", None):  # asyncio.StreamReader's, read ahead
        return True
    found = reading.transport(client)
    sock = found.get_extra_info("socket") if found is not None else None
    if sock is None:
        return False
    try:
        waiting = fcntl.ioctl(sock.fileno(), termios.FIONREAD, bytes(4))
    except OSError:
        return False
    return int.from_bytes(waiting, sys.byteorder) > 0


def _close(client_id: str, conn: connection.Connection, why: str) -> bool:
    """End `conn` the way mitmproxy's own inactivity watchdog does: cancel its task."""
    handler = _handler(client_id)
    io = handler.transports.get(conn) if handler is not None else None
    if io is None or io.handler is None:
        return False
    io.handler.cancel(why)
    return True


_TRIM: list[Callable[[int], int] | None] = []


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    if not _TRIM:
        try:
            _TRIM.append(ctypes.CDLL("libc.so.6").malloc_trim)
        except (OSError, AttributeError):
            _TRIM.append(None)
    return _TRIM[0]
