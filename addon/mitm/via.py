"""The corporate proxy between credproxy and the internet (`run --upstream-proxy`).

Not a patch: the dial of addon/mitm/reuse.py calls it. Through the corporate proxy an
upstream connection is a `CONNECT name:port` (the name the request was vetted and pinned
for, never the address credproxy's own lookup found), then TLS end to end with the origin,
verified for that name: the corporate proxy relays bytes it cannot read. A host on the
bypass list, or a name --resolve maps, is dialled directly at its vetted address.

The corporate proxy's answer never reaches the agent: a refusal, a close or an answer that
cannot be parsed raises ProxyFailed, whose message is one of credproxy's fixed phrases
(addon/mitm/wire.py maps it to a reason). Its credential (a stored `basic` credential)
is fetched for each CONNECT and goes into that CONNECT only.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import re
import socket
import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from addon.core.reasons import Reason
from store.rules.grammar import BadAuthority, is_ip, normalize_host, parse_authority

PREFIX = "credproxy upstream proxy:"
_AUTH, _REFUSED = Reason.UPSTREAM_PROXY_AUTH, Reason.UPSTREAM_PROXY_REFUSED
# error class -> reason, and the fixed detail the agent reads
ERRORS: dict[str, tuple[Reason, str]] = {
    "proxy-auth-required": (_AUTH, "the upstream proxy refused credproxy's credentials for it"),
    "proxy-credential-unavailable": (
        _AUTH,
        "the upstream proxy's credential is missing, unreadable or not bound to the proxy",
    ),
    "proxy-denied": (_REFUSED, "the upstream proxy refused the connection to this host"),
    "proxy-upstream-failed": (_REFUSED, "the upstream proxy could not reach this host"),
    "proxy-closed": (_REFUSED, "the upstream proxy closed the connection without an answer"),
    "proxy-bad-answer": (_REFUSED, "the upstream proxy's answer could not be parsed"),
    "proxy-unreachable": (_REFUSED, "the upstream proxy could not be reached"),
}
_STATUS_RE = re.compile(rb"HTTP/1\.[01] ([0-9]{3})(?:[ \t][^\r\n]*)?\r\n")
_NAME_RE = re.compile(r"[A-Za-z0-9._:-]{1,253}")

Authorization = Callable[[], bytes]  # the Proxy-Authorization value; raises ProxyFailed


class ProxyFailed(Exception):
    """The CONNECT did not open a tunnel; the message is fixed: `PREFIX error`."""

    def __init__(self, error: str) -> None:
        assert error in ERRORS
        super().__init__(f"{PREFIX} {error}")
        self.error = error


@dataclass(frozen=True)
class Bypass:
    """`--upstream-proxy-bypass`: hosts and networks dialled directly, NO_PROXY's forms.

    `example.com`, `.example.com` and `*.example.com` each stand for the name and every name
    under it; an address or a CIDR matches an IP-literal host and the address credproxy's
    own lookup vetted for a name; `*` matches every host.
    """

    everything: bool = False
    names: frozenset[str] = frozenset()
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    @classmethod
    def parse(cls, specs: Iterable[str]) -> Bypass:
        """Each spec a comma- or space-separated list. Raises: ValueError naming the entry."""
        everything, names, networks = False, set(), []
        for spec in specs:
            for item in spec.replace(",", " ").split():
                if item == "*":
                    everything = True
                    continue
                try:
                    networks.append(ipaddress.ip_network(item.strip("[]"), strict=False))
                    continue
                except ValueError:
                    pass
                name = item.removeprefix("*.").removeprefix(".")
                try:
                    normal = normalize_host(name)
                except BadAuthority as e:
                    raise ValueError(
                        f"invalid --upstream-proxy-bypass entry {item!r}: "
                        "use a host name, .domain, an address or a CIDR"
                    ) from e
                names.add(normal)
        return cls(everything, frozenset(names), tuple(networks))

    def matches(self, host: str, address: str) -> bool:
        """Is `host` (normalised), which credproxy vetted at `address`, dialled directly?"""
        if self.everything:
            return True
        if self.names:
            labels = host.split(".")
            if any(".".join(labels[i:]) in self.names for i in range(len(labels))):
                return True
        if self.networks:
            for text in (host, address) if is_ip(host) else (address,):
                try:
                    ip = ipaddress.ip_address(text.split("%", 1)[0])
                except ValueError:
                    continue
                if any(ip in network for network in self.networks):
                    return True
        return False


@dataclass(frozen=True)
class UpstreamProxy:
    """`--upstream-proxy http://HOST:PORT`, parsed once at start."""

    host: str
    port: int
    bypass: Bypass = Bypass()
    credential: str | None = None  # the stored `basic` credential it is sent, by name
    resolved: frozenset[str] = frozenset()  # the names --resolve maps: dialled directly

    @classmethod
    def parse(
        cls, url: str, bypass: Iterable[str] = (), credential: str | None = None
    ) -> UpstreamProxy:
        """Raises: ValueError, never quoting the URL (it might hold a password)."""
        usage = "invalid --upstream-proxy URL: use http://HOST:PORT"
        if "@" in url:
            raise ValueError(
                "invalid --upstream-proxy URL: credentials never go on the command line; "
                "store them as a basic credential and name it with --upstream-proxy-credential"
            )
        try:
            parts = urlsplit(url)
            host, port = parse_authority(parts.netloc)
        except (ValueError, BadAuthority) as e:
            raise ValueError(usage) from e
        if parts.scheme == "https":
            raise ValueError(
                "--upstream-proxy: https:// proxies are not supported yet; use http://"
            )
        if parts.scheme != "http" or port is None or parts.path not in ("", "/"):
            raise ValueError(usage)
        if parts.query or parts.fragment:
            raise ValueError(usage)
        return cls(host, port, Bypass.parse(bypass), credential)


class Route:
    """Where an upstream connection goes: straight to its address, or through the proxy."""

    def __init__(self, proxy: UpstreamProxy, authorization: Authorization | None = None) -> None:
        self.proxy = proxy
        self.authorization = authorization

    def direct(self, name: str, address: tuple[str, int]) -> bool:
        proxy = self.proxy
        return name in proxy.resolved or proxy.bypass.matches(name, address[0])

    async def open(
        self,
        name: str,
        port: int,
        context: ssl.SSLContext | None,
        handshake_timeout: float,
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A tunnel to name:port, with TLS for `name` inside it when `context` is given.

        Raises: ProxyFailed for anything the corporate proxy did, OSError or TimeoutError
        for the TLS handshake with the origin.
        """
        head = connect_head(name, port, self.authorization() if self.authorization else None)
        try:
            reader, writer = await asyncio.open_connection(
                self.proxy.host, self.proxy.port, limit=ANSWER_LIMIT
            )
        except OSError as e:
            raise ProxyFailed("proxy-unreachable") from e
        try:
            writer.write(head)
            del head  # the credential goes into this one write only
            await writer.drain()
            answer = await reader.readuntil(b"\r\n\r\n")
            error = refusal(answer)
            if error is None and len(getattr(reader, "_buffer", b"x")) > 0:
                error = "proxy-bad-answer"  # the origin speaks after the client: nothing yet
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            writer.transport.abort()
            raise ProxyFailed("proxy-closed") from e
        except asyncio.LimitOverrunError as e:
            writer.transport.abort()
            raise ProxyFailed("proxy-bad-answer") from e
        except BaseException:
            writer.transport.abort()
            raise
        if error is not None:
            writer.transport.abort()
            raise ProxyFailed(error)
        if context is not None:
            try:
                await writer.start_tls(
                    context, server_hostname=name, ssl_handshake_timeout=handshake_timeout
                )
            except BaseException:
                writer.transport.abort()
                raise
        return reader, writer

    def tunnel(
        self, name: str, port: int, address: tuple[str, int], timeout: float
    ) -> socket.socket | None:
        """In a thread, for credproxy's own calls (token endpoints, STS): a plain tunnel to
        name:port through the proxy, its TLS left to the caller; None when `address` is
        dialled directly. Raises: ProxyFailed.
        """
        if self.direct(name, address):
            return None
        head = connect_head(name, port, self.authorization() if self.authorization else None)
        try:
            sock = socket.create_connection((self.proxy.host, self.proxy.port), timeout=timeout)
        except OSError as e:
            raise ProxyFailed("proxy-unreachable") from e
        try:
            sock.sendall(head)
            del head  # the credential goes into this one write only
            answer = b""
            while b"\r\n\r\n" not in answer:
                chunk = sock.recv(4096)
                if not chunk:
                    raise ProxyFailed("proxy-closed")
                answer += chunk
                if len(answer) > ANSWER_LIMIT:
                    raise ProxyFailed("proxy-bad-answer")
            error = refusal(answer)
            if error is None and not answer.endswith(b"\r\n\r\n"):
                error = "proxy-bad-answer"  # the origin speaks after the client: nothing yet
            if error is not None:
                raise ProxyFailed(error)
        except OSError as e:
            sock.close()
            raise ProxyFailed("proxy-closed") from e
        except BaseException:
            sock.close()
            raise
        return sock


# The corporate proxy's answer to a CONNECT, read by `Route.tunnel` and (as its stream
# reader's limit) by `Route.open`: a longer answer is `proxy-bad-answer`.
ANSWER_LIMIT = 64 * 1024


def connect_head(name: str, port: int, authorization: bytes | None) -> bytes:
    """The CONNECT request for name:port. Raises: ValueError for a name no grammar allows."""
    if not _NAME_RE.fullmatch(name) or not 0 < port < 65536:
        raise ValueError("not a host name credproxy could have vetted")
    authority = f"[{name}]:{port}" if ":" in name else f"{name}:{port}"
    head = f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n".encode("ascii")
    if authorization is not None:
        head += b"Proxy-Authorization: " + authorization + b"\r\n"
    return head + b"\r\n"


def refusal(answer: bytes) -> str | None:
    """The error class of the corporate proxy's answer to a CONNECT; None for a tunnel."""
    found = _STATUS_RE.match(answer)
    if found is None:
        return "proxy-bad-answer"
    status = int(found.group(1))
    if 200 <= status < 300:
        return None
    if status == 407:
        return "proxy-auth-required"
    if status >= 500:
        return "proxy-upstream-failed"
    if status < 200:
        return "proxy-bad-answer"
    return "proxy-denied"


def basic(secret: bytes) -> bytes:
    """The Proxy-Authorization value for a `user:password` secret."""
    return b"Basic " + base64.b64encode(secret)
