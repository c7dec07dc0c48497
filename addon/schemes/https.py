"""The outbound HTTPS client of credproxy's own calls (token endpoints, STS): the dialled
address, verified TLS for the name, a bounded answer and a deadline for the whole call."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import NamedTuple

import certifi

TIMEOUT = 10.0
MAX_ANSWER = 64 * 1024


class MintFailed(Exception):
    """The token endpoint did not give a token. The detail names its status and OAuth error
    code, never its body."""

    def __init__(self, detail: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(detail)
        self.detail, self.status, self.code = detail, status, code


Dial = Callable[[str, int], Awaitable[tuple[str, int]]]
# In the call's thread: a plain tunnel to (name, port) through a corporate proxy for the vetted
# address, or None to dial the address directly (addon/mitm/via.py's Route.tunnel).
Tunnel = Callable[[str, int, tuple[str, int]], "socket.socket | None"]


class Answer(NamedTuple):
    status: int
    headers: Mapping[str, str]
    data: bytes


Post = Callable[[str, bytes, dict[str, str]], Answer]


class _Deadline:
    """Shuts the call's connection down when TIMEOUT has passed since it began, TLS
    handshake included: urllib3's timeouts bound each read, so an endpoint that drips its
    answer a byte at a time would otherwise hold the call (and every request waiting on the
    mint, and an oauth2-refresh row lock) for as long as it likes."""

    def __init__(self) -> None:
        self.sockets: list[socket.socket] = []
        self.passed = False
        self._lock = threading.Lock()
        self._timer = threading.Timer(TIMEOUT, self._cut)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self.sockets.append(sock)
            if not self.passed:
                return
        _shut(sock)

    def _cut(self) -> None:
        with self._lock:
            self.passed = True
            found = list(self.sockets)
        for sock in found:
            _shut(sock)

    def cancel(self) -> None:
        self._timer.cancel()
        with self._lock:
            found, self.sockets = self.sockets, []
        for sock in found:
            sock.close()


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def https_call(
    address: tuple[str, int],
    host: str,
    port: int,
    cafile: str | None,
    method: str,
    target: str,
    body: bytes,
    headers: dict[str, str],
    tunnel: Tunnel | None = None,
) -> Answer:
    """One request to a credproxy-side endpoint (in a thread): the dialled address (or a
    tunnel through the corporate proxy), the name for SNI and certificate, at most MAX_ANSWER
    bytes read, TIMEOUT for the whole call. Raises on any failure (TimeoutError when the time
    ran out)."""
    # Here, not at the top: a proxy that mints no token and assumes no role never loads it.
    import urllib3
    import urllib3.connection

    context = ssl.create_default_context(cafile=cafile or certifi.where())
    deadline = _Deadline()

    class Connection(urllib3.connection.HTTPSConnection):
        def _new_conn(self) -> socket.socket:
            tunnelled = tunnel(host, port, address) if tunnel is not None else None
            sock = tunnelled if tunnelled is not None else super()._new_conn()
            # A duplicate of its descriptor: shutting it down ends the connection however
            # it is wrapped (TLS takes the socket over), and it is ours to close.
            deadline.watch(sock.dup())
            return sock

    pool = urllib3.HTTPSConnectionPool(
        address[0],
        address[1],
        server_hostname=host,
        assert_hostname=host,
        ssl_context=context,
        timeout=urllib3.Timeout(TIMEOUT),
        retries=False,
    )
    pool.ConnectionCls = Connection
    name = f"[{host}]" if ":" in host else host  # an IPv6 address, bracketed
    sent = {
        "Host": name if port == 443 else f"{name}:{port}",
        "Accept-Encoding": "identity",
        **headers,
    }
    try:
        answer = pool.urlopen(
            method, target, body=body, headers=sent, preload_content=False, redirect=False
        )
        encoding = answer.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("identity", ""):
            # Never inflated: urllib3 before 2.6 inflated a whole read at once.
            raise MintFailed("the token endpoint's answer is compressed, which was not asked")
        data = answer.read(MAX_ANSWER + 1, decode_content=False)
        if len(data) > MAX_ANSWER:
            raise MintFailed(f"the token endpoint's answer exceeds {MAX_ANSWER} bytes")
        if deadline.passed:
            raise TimeoutError
        return Answer(answer.status, dict(answer.headers.items()), data)
    except Exception:  # noqa: BLE001 - re-raised: only renamed when the deadline cut it
        if deadline.passed:
            raise TimeoutError from None
        raise
    finally:
        deadline.cancel()
        pool.close()
