"""The verdict: the facts of one request + its tunnel + the policy + the clock -> allow or deny.

Pure: imports neither mitmproxy nor SQLAlchemy. Destination binding, framing, the method,
the canonical path, the internal endpoint, the grant decision and method/path overrides are
checked here, in this order; the first check that fails names the reason.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

from addon.core.policy import DEFAULT_PORTS, Policy, Request, Rule
from addon.core.reasons import Reason
from store.rules.grammar import BadAuthority, BadPath, canonicalize, normalize_host, parse_authority

INTERNAL_HOST = "credproxy.internal"
# The largest body the internal endpoint holds (it reads bodies whole).
MAX_BODY = 16 * 1024
METHOD_OVERRIDES = frozenset((b"x-http-method-override", b"x-http-method", b"x-method-override"))
# Headers some frameworks take as the real target (IIS, Symfony, Zend): never forwarded.
PATH_OVERRIDES = frozenset((b"x-original-url", b"x-rewrite-url"))
_OVERRIDES = METHOD_OVERRIDES | PATH_OVERRIDES
_TOKEN_RE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_CONTROL_RE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


@dataclass(slots=True)
class Tunnel:
    """What a CONNECT bound to its client connection."""

    principal: str
    host: str
    port: int
    sni_mismatch: bool = False


@dataclass(slots=True)
class HeaderScan:
    """One pass over a request's header fields: indexed by lower-case name, and checked."""

    index: dict[bytes, list[bytes]]
    problem: str | None = None

    @classmethod
    def scan(cls, fields: tuple[tuple[bytes, bytes], ...]) -> HeaderScan:
        index: dict[bytes, list[bytes]] = {}
        for name, value in fields:
            index.setdefault(name.lower(), []).append(value)
        problem = None
        # One regex call for all the names and one for all the values: non-empty tokens
        # joined are one token, and tab (the separator) is allowed in values. Field by field
        # only when something is wrong, to name the first problem.
        names, values = zip(*fields, strict=True) if fields else ((), ())
        if fields and (
            not all(names)
            or not _TOKEN_RE.fullmatch(b"".join(names))
            or _CONTROL_RE.search(b"\t".join(values))
        ):
            problem = next((p for n, v in fields if (p := _field_problem(n, v))), None)
        return cls(index, problem)

    def get_all(self, name: bytes) -> list[bytes]:
        return self.index.get(name, [])

    def joined(self, name: bytes) -> str | None:
        """The field's values as one text, the way mitmproxy's `Headers.get` reads them."""
        values = self.index.get(name)
        if not values:
            return None
        return ", ".join(v.decode("utf-8", "surrogateescape") for v in values)

    def overrides(self) -> list[tuple[bytes, bytes]]:
        """Method- and path-override fields, `_` read as `-` as CGI and WSGI backends do."""
        return [
            (key, value)
            for name, values in self.index.items()
            if name.startswith(b"x") and (key := name.replace(b"_", b"-")) in _OVERRIDES
            for value in values
        ]


class Facts(NamedTuple):
    """What a request says and where mitmproxy will send it, as plain values."""

    scheme: str
    host: str  # where mitmproxy will connect: the CONNECT or absolute-form authority, or Host
    port: int
    authority: str  # the h2 :authority or the absolute-form authority, "" if none
    method: bytes  # as sent, not upper-cased
    target: bytes  # the raw request target (path and query)
    headers: HeaderScan
    is_http2: bool
    client_tls: bool  # the client connection to the proxy is TLS
    client_sni: str | None


class Verdict(NamedTuple):
    """Allowed (a rule), internal (the agent's own endpoint) or denied (a reason).

    `host`, `port`, `path` and `method` are set as far as the checks got: the audit line
    names what was known when the request was refused.
    """

    reason: Reason | None = None
    detail: str = ""
    host: str | None = None
    port: int | None = None
    path: str | None = None
    query: bytes | None = None
    method: str | None = None
    rule: Rule | None = None
    internal: bool = False
    decided: bool = False  # refused by the grant decision itself (an access request may follow)
    # Allowed but for the body: the rules its body chooses between (Decision.pending).
    pending: tuple[Rule, ...] = ()

    @property
    def allowed(self) -> bool:
        return self.rule is not None


class _Refused(Exception):
    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(reason.value)
        self.reason = reason
        self.detail = detail


def verdict(
    facts: Facts, principal: str, tunnel: Tunnel | None, policy: Policy, now: datetime
) -> Verdict:
    """Judge one request of `principal`, inside `tunnel` (None: a plain-proxy request)."""
    known: dict[str, object] = {}
    try:
        return _judge(facts, principal, tunnel, policy, now, known)
    except _Refused as r:
        return Verdict(r.reason, r.detail, **known)  # type: ignore[arg-type]


def _judge(
    facts: Facts,
    principal: str,
    tunnel: Tunnel | None,
    policy: Policy,
    now: datetime,
    known: dict[str, object],
) -> Verdict:
    host, port, scheme = _bind_destination(facts, tunnel, known)
    method = _method(facts.method)
    try:
        path, query = canonicalize(facts.target)
    except BadPath as e:
        raise _Refused(Reason.BAD_REQUEST, e.detail) from e
    known["path"] = path
    _check_framing(facts.headers)
    if tunnel is None and host == INTERNAL_HOST:
        _check_internal_body(facts.headers)
        return Verdict(None, "", host, port, path, None, method, None, True)
    request = Request(host, port, scheme, method, path, upgrade=b"upgrade" in facts.headers.index)
    decision = policy.decide(principal, request, now)
    if not decision.allowed:
        assert decision.reason is not None
        return Verdict(
            decision.reason, decision.detail, host, port, path, method=method, decided=True
        )
    rule = decision.rule
    assert rule is not None
    for name, value in facts.headers.overrides():
        if name in PATH_OVERRIDES:
            raise _Refused(Reason.BAD_REQUEST, "path-override headers are not allowed")
        # The grant whose credential is stamped (and whose once-use is spent) must allow
        # the override itself: another grant allowing it would lend this one's credential.
        # When the body chooses the grant, every grant it may choose must.
        overridden = _method(value.strip())
        if not all(r.allows_method(overridden) for r in decision.pending or (rule,)):
            raise _Refused(Reason.METHOD_NOT_ALLOWED, "the method override is not granted")
    return Verdict(None, "", host, port, path, query, method, rule, pending=decision.pending)


def _bind_destination(
    facts: Facts, tunnel: Tunnel | None, known: dict[str, object]
) -> tuple[str, int, str]:
    """Where mitmproxy will connect, the Host header and the SNI must name one host."""
    scheme = facts.scheme
    if scheme not in DEFAULT_PORTS:
        raise _Refused(Reason.BAD_REQUEST, "unsupported scheme")
    host, port = facts.host, facts.port
    if tunnel is None or host != tunnel.host:  # the tunnel's host is already normal
        try:
            host = normalize_host(host)
        except BadAuthority as e:
            raise _Refused(Reason.BAD_REQUEST, "invalid host") from e
    known["host"], known["port"] = host, port
    host_headers = facts.headers.get_all(b"host")
    if len(host_headers) > 1:
        raise _Refused(Reason.BAD_REQUEST, "duplicate Host header")
    if tunnel is not None and (host, port) != (tunnel.host, tunnel.port):
        raise _Refused(Reason.HOST_MISMATCH, "request does not go to the CONNECT authority")
    # Every name the request carries: the Host header and the h2 :authority (or the
    # absolute-form authority) alike. On h2 mitmproxy's host_header prefers :authority,
    # but a Host header naming another host would still reach an HTTP/1 upstream.
    authorities = [value.decode("utf-8", "surrogateescape") for value in host_headers]
    if facts.authority:
        authorities.append(facts.authority)
    if not authorities or not (host_headers or facts.is_http2):
        raise _Refused(Reason.BAD_REQUEST, "missing Host header")
    for authority in authorities:
        try:
            a_host, a_port = _parse_authority(authority)
        except BadAuthority as e:
            raise _Refused(Reason.BAD_REQUEST, "invalid Host header or authority") from e
        if (a_host, a_port or DEFAULT_PORTS[scheme]) != (host, port):
            raise _Refused(Reason.HOST_MISMATCH, "Host header or authority names another host")
    if tunnel is not None and tunnel.sni_mismatch:
        raise _Refused(Reason.HOST_MISMATCH, "TLS SNI names another host")
    if facts.client_tls and tunnel is None and facts.client_sni is not None:
        raise _Refused(Reason.HOST_MISMATCH, "TLS to the proxy without CONNECT")
    if tunnel is None and scheme == "https":
        # mitmproxy would dial TLS itself and reuse that connection by address for the
        # next absolute-form request, whatever host it names: a credential could ride a
        # connection whose certificate was verified for another host. Clients use CONNECT.
        raise _Refused(Reason.BAD_REQUEST, "https requests must use CONNECT")
    return host, port, scheme


def _check_framing(headers: HeaderScan) -> None:
    """Refuse what a front end and a back end could read two ways (smuggling, injection)."""
    lengths = headers.get_all(b"content-length")
    if lengths and b"transfer-encoding" in headers.index:
        raise _Refused(Reason.BAD_REQUEST, "both Content-Length and Transfer-Encoding")
    if len(set(lengths)) > 1:
        raise _Refused(Reason.BAD_REQUEST, "conflicting Content-Length headers")
    if headers.problem is not None:
        raise _Refused(Reason.BAD_REQUEST, headers.problem)


def _check_internal_body(headers: HeaderScan) -> None:
    """The internal endpoint holds a body whole: only a declared length within its limit,
    never compressed (a few bytes of brotli decode to hundreds of MiB)."""
    coding = headers.joined(b"content-encoding")
    if coding is not None and coding.strip().lower() != "identity":
        raise _Refused(Reason.BAD_REQUEST, "credproxy.internal takes no Content-Encoding")
    if b"transfer-encoding" in headers.index:
        raise _Refused(Reason.BODY_TOO_LARGE, "send a Content-Length to credproxy.internal")
    length = headers.joined(b"content-length")
    length = "0" if length is None else length
    if not length.isdigit() or int(length) > MAX_BODY:
        raise _Refused(
            Reason.BODY_TOO_LARGE, f"bodies to credproxy.internal are {MAX_BODY} bytes at most"
        )


def _method(raw: bytes) -> str:
    if not _TOKEN_RE.fullmatch(raw):
        raise _Refused(Reason.BAD_REQUEST, "invalid method")
    return raw.decode("ascii")


@functools.lru_cache(maxsize=64)
def _parsed_authority(text: str) -> tuple[str, int | None]:
    return parse_authority(text)


def _parse_authority(text: str) -> tuple[str, int | None]:
    """parse_authority, remembered for the few Host values a proxy sees again and again."""
    return _parsed_authority(text) if len(text) <= 300 else parse_authority(text)


def _field_problem(name: bytes, value: bytes) -> str | None:
    if not _TOKEN_RE.fullmatch(name):
        return "invalid header name"
    if _CONTROL_RE.search(value):
        return "control character in a header value"
    return None
