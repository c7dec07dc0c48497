"""Security checks that no other test pinned: found by mutation-testing the addon.

Each test names the check it holds in place: removing or inverting that check turns the test
red, and the real code keeps it green. Most call the hooks directly, like tests/test_proxy.py;
the e2e ones need the real runner (it registers the proxy's own listeners with the guard).

Tests marked xfail(strict=True) reproduce holes found on the way that are still open. They
report "xfailed" while the hole is open and fail (XPASS) once it is closed: then drop the marker.
"""

from __future__ import annotations

import base64
import gzip
import hmac
import ipaddress
import socket
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
import trustme
from mitmproxy import connection, http, tls
from mitmproxy.options import Options
from mitmproxy.proxy import context, server_hooks
from mitmproxy.test import taddons, tflow

import addon.policy as policy_module
from addon import responses
from addon.guard import DestinationGuard, is_public
from addon.hosts import ResolveMap
from addon.policy import STATUS, Policy, Reason, Request, Rule
from addon.redact import MARK, Redactor
from addon.verdict import Tunnel
from store.crypto import Secret, hash_token
from store.grammar import parse_host
from store.records import Snapshot
from tests.e2e.conftest import Proxy, start_proxy, stop_proxy
from tests.e2e.raw import Reply, proxy_auth, read_reply
from tests.e2e.upstream import Upstream
from tests.fakes import CRED, NOW, Chain, StaticLive, grant, https_flow, policy, reason

# Long enough to be redacted (forms shorter than 4 bytes are not); a test value, not a secret.
LONG_SECRET = b"sk-test-0123456789abcdef"
LONG_CRED = replace(CRED, secret=Secret(LONG_SECRET))
RESOLVE = ["api.test=127.0.0.1:9443", "plain.test=127.0.0.1:9080", "x.wild.test=127.0.0.1:9443"]


def snapshot_policy(*grants: Any, tokens: dict[str, str] | None = None, cred: Any = CRED) -> Policy:
    return Policy(
        Snapshot(
            counter=1,
            key_id="k",
            token_hashes={n: hash_token(t) for n, t in (tokens or {"a": "tok-a"}).items()},
            credentials={"gh": cred},
            grants=tuple(grants),
            unreadable=(),
        )
    )


def req(
    host: str = "api.test", port: int = 443, scheme: str = "https", path: str = "/v1/x"
) -> Request:
    return Request(host, port, scheme, "GET", path)


class SpyLive(StaticLive):
    """StaticLive that records which once-grants were consumed."""

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.consumed: list[int] = []

    async def consume_once(self, grant_id: int) -> bool:
        self.consumed.append(grant_id)
        return True


def assert_refused_unstamped(flow: Any, code: str) -> None:
    """Denied with `code` and its status, and no credential was written onto the request."""
    assert reason(flow) == code
    assert flow.response.status_code == STATUS.get(Reason(code), 403)
    assert flow.request.headers.get("authorization") is None


def make_addon(live: Any, resolve: list[str] | None = None) -> Chain:
    return Chain(live, ResolveMap.parse(RESOLVE if resolve is None else resolve))


def basic(user: str, token: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{token}".encode()).decode()


def connect_flow(*auth: str) -> Any:
    flow = tflow.tflow()
    flow.request.method = "CONNECT"
    flow.request.host, flow.request.port = "api.test", 443
    flow.request.headers.fields = tuple((b"Proxy-Authorization", value.encode()) for value in auth)
    return flow


def plain_flow(host: str = "plain.test", port: int = 80, auth: str | None = None) -> Any:
    """An absolute-form plain-http request to the proxy (no tunnel)."""
    flow = tflow.tflow()
    flow.request.scheme = "http"
    flow.request.host, flow.request.port = host, port
    flow.request.data.path = b"/v1/x"
    flow.request.host_header = host if port == 80 else f"{host}:{port}"
    flow.request.headers["proxy-authorization"] = auth or basic("a", "tok-a")
    flow.client_conn.tls = False
    return flow


# -- authentication ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "auth",
    [
        pytest.param((basic("a", "tok-a"), basic("a", "wrong")), id="valid first, then another"),
        pytest.param(("Bearer " + basic("a", "tok-a")[6:],), id="right token, not Basic"),
        pytest.param(("Basic YTp0b2st*YQ==",), id="base64 with a non-alphabet character"),
    ],
)
async def test_connect_needs_exactly_one_valid_basic_proxy_authorization(
    auth: tuple[str, ...],
) -> None:
    addon = make_addon(StaticLive(snapshot_policy(grant(1))))
    with taddons.context(addon):
        flow = connect_flow(*auth)
        await addon.http_connect(flow)  # type: ignore[misc]  # the fail-closed wrapper is async
    assert flow.response.status_code == 407
    assert reason(flow) == "auth-required"
    assert addon.tunnel(flow.client_conn) is None


def test_tokens_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    p = snapshot_policy()
    assert p.authenticate("a", "tok-a")
    assert calls, "the token was not compared with hmac.compare_digest"
    calls.clear()
    assert not p.authenticate("nobody", "tok-a")
    assert calls, "an unknown name must cost a comparison too (no timing oracle on names)"


def test_an_unknown_name_never_authenticates_whatever_the_comparison_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(policy_module, "token_matches", lambda token, token_hash: True)
    assert not snapshot_policy().authenticate("nobody", "anything")


# -- Proxy-Authorization never goes upstream -----------------------------------------------


async def test_proxy_authorization_is_removed_from_a_forwarded_plain_http_request() -> None:
    live = StaticLive(snapshot_policy(grant(1, cred=False, hosts=("plain.test",), paths=("/",))))
    addon = make_addon(live)
    with taddons.context(addon):
        flow = plain_flow()
        await addon.requestheaders(flow)
    assert flow.response is None, "the pass-through request should be forwarded"
    assert "proxy-authorization" not in flow.request.headers


# -- principal, broken tunnels -------------------------------------------------------------


async def test_a_removed_principal_is_refused_inside_its_open_tunnel() -> None:
    # The tunnel was opened while "a" existed; its token is gone from the policy now.
    addon = make_addon(StaticLive(snapshot_policy(grant(1), tokens={"b": "tok-b"})))
    with taddons.context(addon):
        flow = https_flow(addon)
        await addon.requestheaders(flow)
    assert_refused_unstamped(flow, "auth-required")


async def test_a_tunnel_whose_client_hello_hook_failed_is_refused() -> None:
    addon = make_addon(StaticLive(snapshot_policy(grant(1))))
    flow = https_flow(addon)
    ctx = context.Context(flow.client_conn, Options())
    ctx.server = connection.Server(address=("api.test", 443))

    class BrokenHello:
        @property
        def sni(self) -> str:
            raise RuntimeError("injected fault")

    with taddons.context(addon):
        addon.tls_clienthello(tls.ClientHelloData(ctx, BrokenHello()))  # type: ignore[arg-type]
        await addon.requestheaders(flow)
    assert_refused_unstamped(flow, "internal-error")


# -- destination binding -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "port", "grants"),
    [
        pytest.param(
            "x.wild.test",
            443,
            (grant(1, hosts=("api.test", "*.wild.test")),),
            id="another granted host",
        ),
        pytest.param(
            "api.test",
            8443,
            (grant(1), grant(2, cred=False, hosts=("api.test:8443",))),
            id="another granted port",
        ),
    ],
)
async def test_a_request_inside_a_tunnel_goes_only_to_the_connect_authority(
    host: str, port: int, grants: tuple[Any, ...]
) -> None:
    # Absolute-form inside the tunnel, Host header agreeing with it, both granted: still
    # refused, because the tunnel (and its SNI) was bound to api.test:443.
    addon = make_addon(StaticLive(snapshot_policy(*grants)))
    with taddons.context(addon):
        flow = https_flow(addon)
        flow.request.host, flow.request.port = host, port
        flow.request.host_header = host if port == 443 else f"{host}:{port}"
        await addon.requestheaders(flow)
    assert_refused_unstamped(flow, "host-mismatch")


async def test_tls_to_the_proxy_without_connect_is_refused() -> None:
    addon = make_addon(StaticLive(snapshot_policy(grant(1))))
    with taddons.context(addon):
        flow = https_flow(addon)
        addon.clients.state(flow.client_conn).tunnel = None
        flow.client_conn.sni = "api.test"
        flow.request.headers["proxy-authorization"] = basic("a", "tok-a")
        await addon.requestheaders(flow)
    assert_refused_unstamped(flow, "host-mismatch")


async def test_https_without_connect_is_refused() -> None:
    # Absolute-form `GET https://...` on a plain proxy connection: mitmproxy would dial TLS
    # itself and reuse that connection by address for the next host named (see the e2e
    # two-host test below), so it is refused before any credential is stamped.
    addon = make_addon(StaticLive(snapshot_policy(grant(1))))
    with taddons.context(addon):
        flow = plain_flow(host="api.test", port=443)
        flow.request.scheme = "https"
        flow.request.host_header = "api.test"
        await addon.requestheaders(flow)
    assert_refused_unstamped(flow, "bad-request")


async def test_an_unsupported_scheme_is_refused() -> None:
    addon = make_addon(StaticLive(snapshot_policy(grant(1, cred=False, hosts=("plain.test:21",)))))
    with taddons.context(addon):
        flow = plain_flow(port=21)
        flow.request.scheme = "ftp"
        await addon.requestheaders(flow)
    assert flow.response.status_code == 400
    assert reason(flow) == "bad-request"


def test_server_connect_refuses_when_its_hook_fails() -> None:
    addon = make_addon(StaticLive(snapshot_policy(grant(1))))
    client = connection.Client(peername=("127.0.0.1", 5), sockname=("127.0.0.1", 8080))
    server = connection.Server(address=None)  # the hook's own check raises
    with taddons.context(addon):
        addon.server_connect(server_hooks.ServerConnectionHookData(server, client))
    assert server.error is not None


# -- request framing and the method --------------------------------------------------------


async def test_an_invalid_header_name_is_refused() -> None:
    addon = make_addon(StaticLive(snapshot_policy(grant(1))))
    with taddons.context(addon):
        flow = https_flow(addon)
        flow.request.headers.fields += ((b"X-A(b)", b"1"),)
        await addon.requestheaders(flow)
    assert reason(flow) == "bad-request"


@pytest.mark.parametrize(
    "method",
    [
        pytest.param(b"G(T", id="a separator in the method"),
        pytest.param(b"GET /v1/x HTTP/1.1\r\nX:", id="CRLF injection through the method"),
    ],
)
async def test_a_method_that_is_not_a_token_is_refused_even_under_a_star_grant(
    method: bytes,
) -> None:
    addon = make_addon(StaticLive(snapshot_policy(grant(1, methods=("*",)))))
    with taddons.context(addon):
        flow = https_flow(addon)
        flow.request.data.method = method
        await addon.requestheaders(flow)
    assert flow.response.status_code == 400
    assert reason(flow) == "bad-request"


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param(
            ((b"Content-Length", b"4"), (b"Transfer-Encoding", b"chunked")),
            id="Content-Length and Transfer-Encoding",
        ),
        pytest.param(
            ((b"Content-Length", b"1"), (b"Content-Length", b"2")),
            id="conflicting Content-Lengths",
        ),
    ],
)
async def test_ambiguous_request_framing_is_refused(
    fields: tuple[tuple[bytes, bytes], ...],
) -> None:
    # mitmproxy's HTTP/1 parser refuses these first (tests/e2e/test_hostile.py); the hook
    # refuses them too, whatever the front end lets through.
    addon = make_addon(StaticLive(snapshot_policy(grant(1, methods=("POST",)))))
    with taddons.context(addon):
        flow = https_flow(addon)
        flow.request.data.method = b"POST"
        del flow.request.headers["content-length"]  # tflow's own
        flow.request.headers.fields += fields
        await addon.requestheaders(flow)
    assert_refused_unstamped(flow, "bad-request")


# -- stamping ------------------------------------------------------------------------------


async def test_a_stamped_request_asks_for_an_identity_encoded_response() -> None:
    addon = make_addon(StaticLive(snapshot_policy(grant(1))))
    with taddons.context(addon):
        flow = https_flow(addon)
        flow.request.headers["Accept-Encoding"] = "gzip, br"
        await addon.requestheaders(flow)
    assert flow.response is None
    assert flow.request.headers.get_all("accept-encoding") == ["identity"]


# -- once-grants: consumed last, and only when everything else passed ----------------------


async def test_a_refused_method_override_does_not_burn_a_once_grant() -> None:
    live = SpyLive(snapshot_policy(grant(1, once=True)))
    addon = make_addon(live)
    with taddons.context(addon):
        flow = https_flow(addon)
        flow.request.headers["X-HTTP-Method-Override"] = "DELETE"
        await addon.requestheaders(flow)
    assert reason(flow) == "method-not-allowed"
    assert live.consumed == []


async def test_a_forbidden_destination_does_not_burn_a_once_grant() -> None:
    # No --resolve entry: localhost is resolved and refused by the destination guard.
    once = grant(1, cred=False, hosts=("localhost",), once=True)
    live = SpyLive(snapshot_policy(once))
    addon = make_addon(live, resolve=[])
    with taddons.context(addon):
        flow = https_flow(addon)
        addon.bind(flow.client_conn, Tunnel("a", "localhost", 443))
        flow.request.host = "localhost"
        flow.request.host_header = "localhost"
        flow.client_conn.sni = "localhost"
        await addon.requestheaders(flow)
    assert reason(flow) == "destination-forbidden"
    assert live.consumed == []


async def test_a_once_grant_is_refused_without_asking_while_the_store_is_down() -> None:
    live = SpyLive(snapshot_policy(grant(1, once=True)))
    live.store_up = False
    addon = make_addon(live)
    with taddons.context(addon):
        flow = https_flow(addon)
        await addon.requestheaders(flow)
    assert flow.response.status_code == 503
    assert reason(flow) == "store-unavailable"
    assert live.consumed == []


# -- no credential over cleartext ----------------------------------------------------------


async def test_cleartext_inside_a_tunnel_never_carries_a_credential() -> None:
    # Plain HTTP sent into a CONNECT tunnel to a grant naming port 443 explicitly: host and
    # credential both match 443, so only the scheme check stands between the secret and
    # the cleartext wire.
    addon = make_addon(StaticLive(snapshot_policy(grant(1, hosts=("api.test:443",)))))
    with taddons.context(addon):
        flow = https_flow(addon)
        flow.request.scheme = "http"
        flow.client_conn.tls = False
        flow.client_conn.sni = None
        flow.request.host_header = "api.test:443"
        await addon.requestheaders(flow)
    assert_refused_unstamped(flow, "insecure-scheme")


def test_decide_never_stamps_onto_cleartext_even_when_the_port_matches() -> None:
    decision = policy(grant(1, hosts=("api.test:443",))).decide(
        "a", req(scheme="http", port=443), NOW
    )
    assert not decision.allowed and decision.reason is Reason.INSECURE_SCHEME


def test_a_credentials_bare_host_means_port_443_even_for_http() -> None:
    # The grant's bare host means port 80 for http; the credential's bare host is 443 only.
    rule = Rule(
        grant_id=1,
        credential=CRED,
        hosts=(parse_host("api.test"),),
        methods=None,
        paths=("/",),
        once=False,
        websocket=False,
        expires_at=None,
    )
    assert rule.allows_host("api.test", 443, "https")
    assert not rule.allows_host("api.test", 80, "http")


# -- the pure decision ---------------------------------------------------------------------


def test_a_consumed_once_grant_is_refused_from_the_snapshot() -> None:
    decision = policy(replace(grant(1, once=True), consumed=True)).decide("a", req(), NOW)
    assert not decision.allowed and decision.reason is Reason.GRANT_CONSUMED


def test_a_grant_expiring_now_is_expired() -> None:
    decision = policy(grant(1, expires=NOW)).decide("a", req(), NOW)
    assert not decision.allowed and decision.reason is Reason.GRANT_EXPIRED
    later = policy(grant(1, expires=NOW + timedelta(microseconds=1))).decide("a", req(), NOW)
    assert later.allowed


def test_the_longest_matching_pattern_of_a_grant_ranks_it() -> None:
    # Grant 1's best match (/v1/x, 5 chars) beats grant 2's /v1/ (4); ranking by any other
    # pattern of grant 1 (its "/") would pick grant 2.
    p = policy(grant(1, paths=("/", "/v1/x")), grant(2, paths=("/v1/",)))
    decision = p.decide("a", req(path="/v1/x"), NOW)
    assert decision.allowed and decision.rule is not None and decision.rule.grant_id == 1


def test_the_candidates_cache_keeps_hosts_ports_schemes_and_principals_apart() -> None:
    p = policy(
        grant(1, hosts=("api.test",)),
        grant(2, cred=False, hosts=("plain.test",), paths=("/",), principal="b"),
    )
    # Warm the cache with one decision, then ask what must differ from it.
    assert p.decide("a", req(), NOW).allowed
    assert p.decide("a", req(host="other.test"), NOW).reason is Reason.NO_GRANT
    assert p.decide("a", req(port=8443), NOW).reason is Reason.NO_GRANT
    assert p.decide("a", req(scheme="http", port=443), NOW).reason is Reason.INSECURE_SCHEME
    assert p.decide("b", req(host="plain.test", scheme="http", port=80), NOW).allowed
    assert p.decide("b", req(host="plain.test", port=443), NOW).allowed
    # plain.test means port 443 for https but port 80 for http: the cached https answer
    # must not let cleartext through on 443.
    assert not p.decide("b", req(host="plain.test", scheme="http", port=443), NOW).allowed
    assert p.decide("a", req(host="plain.test", port=443), NOW).reason is Reason.NO_GRANT
    assert not p.may_connect("a", "plain.test", 443)
    assert p.may_connect("b", "plain.test", 443)
    assert not p.may_connect("b", "api.test", 443)


# -- the destination guard -----------------------------------------------------------------


def ip(text: str) -> Any:
    return ipaddress.ip_address(text)


@pytest.mark.parametrize(
    "address",
    [
        pytest.param("224.0.0.251", id="IPv4 multicast"),
        pytest.param("ff0e::1", id="IPv6 global-scope multicast"),
        pytest.param("64:ff9b::7f00:1", id="NAT64 of loopback"),
        pytest.param("64:ff9b::a00:1", id="NAT64 of 10/8"),
        pytest.param("2002:7f00:1::1", id="6to4 of loopback"),
        pytest.param("::127.0.0.1", id="IPv4-compatible loopback"),
        pytest.param("::8.8.8.8", id="IPv4-compatible, even of a public address"),
        pytest.param("::ffff:0:127.0.0.1", id="IPv4-translated loopback"),
        pytest.param("fec0::1", id="site-local"),
    ],
)
def test_non_public_addresses_python_calls_global_are_refused(address: str) -> None:
    assert not is_public(ip(address))
    assert DestinationGuard().vet([address], 443) is None


def test_public_addresses_pass_the_guard() -> None:
    assert DestinationGuard().vet(["93.184.216.34", "2606:2800:220:1::1"], 443) == ip(
        "93.184.216.34"
    )


@pytest.mark.parametrize(
    "answers",
    [
        pytest.param(["93.184.216.34", "127.0.0.1"], id="a private answer after a public one"),
        pytest.param(["93.184.216.34", "fd00::1"], id="a ULA answer after a public one"),
        pytest.param(["93.184.216.34", "not-an-address"], id="an unparsable answer"),
    ],
)
def test_every_dns_answer_must_pass_the_guard(answers: list[str]) -> None:
    assert DestinationGuard().vet(answers, 443) is None


@pytest.mark.parametrize(
    ("listener", "address"),
    [
        pytest.param(("127.0.0.1", 8080), "127.0.0.1", id="a listener on one address"),
        pytest.param(("0.0.0.0", 8080), "127.0.0.1", id="a listener on every address"),
        pytest.param(("::", 8080), "::1", id="a listener on every IPv6 address"),
    ],
)
def test_the_proxys_own_listeners_are_refused_even_in_an_opened_range(
    listener: tuple[str, int], address: str
) -> None:
    guard = DestinationGuard.parse(["127.0.0.0/8", "::1/128"]).listening_on([listener])
    assert not guard.permits(ip(address), 8080)
    assert guard.vet([address], 8080) is None
    assert guard.permits(ip(address), 8081), "another port in the opened range stays open"


# -- response redaction ---------------------------------------------------------------------


async def allowed_flow(addon: Chain) -> Any:
    flow = https_flow(addon)
    await addon.requestheaders(flow)
    assert flow.response is None
    return flow


def give_response(flow: Any, fields: list[tuple[bytes, bytes]], body: bytes) -> None:
    flow.response = http.Response.make(200, b"")
    flow.response.headers.fields = (*fields, (b"content-length", str(len(body)).encode()))
    flow.response.raw_content = body


async def test_a_response_in_an_encoding_that_cannot_be_decoded_is_killed() -> None:
    addon = make_addon(StaticLive(snapshot_policy(grant(1), cred=LONG_CRED)))
    with taddons.context(addon):
        flow = await allowed_flow(addon)
        body = gzip.compress(gzip.compress(b"Bearer " + LONG_SECRET))
        give_response(flow, [(b"content-encoding", b"gzip, gzip")], body)
        addon.responseheaders(flow)
    assert flow.error is not None and flow.error.msg == "Connection killed."


def test_a_held_body_ending_in_the_start_of_a_secret_is_sent_whole() -> None:
    # A held (buffered) body has no next chunk: nothing may be kept back as a possible
    # secret prefix, or the body is cut short under a corrected Content-Length.
    body = b"token " + LONG_SECRET + b" then " + LONG_SECRET[:6]
    assert Redactor([LONG_SECRET]).whole(body) == b"token " + MARK + b" then " + LONG_SECRET[:6]


def client_view(addon: Chain, flow: Any, body: bytes) -> bytes:
    """The body as a client honouring every Content-Encoding header would read it."""
    stream = flow.response.stream
    if callable(stream):
        parts = [stream(body), stream(b"")]
        sent = b"".join(p if isinstance(p, bytes) else b"".join(p) for p in parts)
    else:
        addon.response(flow)
        sent = flow.response.raw_content
    codings = [
        c.strip().lower()
        for value in flow.response.headers.get_all("content-encoding")
        for c in value.split(",")
    ]
    for coding in reversed(codings):
        if coding == "gzip":
            sent = gzip.decompress(sent)
    return sent


async def test_a_second_content_encoding_header_cannot_hide_an_echoed_secret() -> None:
    addon = make_addon(StaticLive(snapshot_policy(grant(1), cred=LONG_CRED)))
    with taddons.context(addon):
        flow = await allowed_flow(addon)
        body = gzip.compress(b'{"echo": "Bearer ' + LONG_SECRET + b'"}')
        codings = [(b"content-encoding", b"identity"), (b"content-encoding", b"gzip")]
        give_response(flow, codings, body)
        addon.responseheaders(flow)
        if flow.error is not None:
            return  # killed: nothing reached the client
        leaked = LONG_SECRET in client_view(addon, flow, body)
    assert not leaked, "the echoed secret reached the client unredacted"


async def test_an_echoed_secret_in_response_trailers_is_redacted() -> None:
    addon = make_addon(StaticLive(snapshot_policy(grant(1), cred=LONG_CRED)))
    with taddons.context(addon):
        flow = await allowed_flow(addon)
        give_response(flow, [], b"{}")
        flow.response.trailers = http.Headers([(b"grpc-message", b"invalid key " + LONG_SECRET)])
        addon.responseheaders(flow)
        addon.response(flow)  # mitmproxy sends the trailers after this hook returns
    assert flow.error is None
    trailers = flow.response.trailers or http.Headers()
    leaked = any(LONG_SECRET in value for _, value in trailers.fields)
    assert not leaked, "the echoed secret reached the client in a trailer"


async def test_an_echoed_secret_in_the_reason_phrase_is_redacted() -> None:
    addon = make_addon(StaticLive(snapshot_policy(grant(1), cred=LONG_CRED)))
    with taddons.context(addon):
        flow = await allowed_flow(addon)
        give_response(flow, [], b"{}")
        flow.response.reason = "Bad key " + LONG_SECRET.decode()
        addon.responseheaders(flow)
        addon.response(flow)
    assert LONG_SECRET not in flow.response.data.reason
    assert flow.response.data.reason.startswith(b"Bad key ")


# -- fail closed -----------------------------------------------------------------------------


async def test_when_even_the_deny_fails_the_connection_is_killed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    addon = make_addon(StaticLive(snapshot_policy(grant(1)), fail=True))

    def broken_deny(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(addon.trail, "deny", broken_deny)
    with taddons.context(addon):
        flow = https_flow(addon)
        await addon.requestheaders(flow)
    assert flow.error is not None and flow.error.msg == "Connection killed."


async def test_an_exception_in_the_request_hook_denies(monkeypatch: pytest.MonkeyPatch) -> None:
    addon = make_addon(StaticLive(snapshot_policy(grant(1))))

    async def broken_handle(*args: Any) -> Any:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(addon.access, "handle", broken_handle)
    with taddons.context(addon):
        flow = plain_flow(host="credproxy.internal")
        flow.request.data.path = b"/access-requests"
        await addon.requestheaders(flow)
        assert flow.response is None, "the internal endpoint is answered in the request hook"
        await addon.request(flow)
    assert flow.response is not None and flow.response.status_code == 500
    assert reason(flow) == "internal-error"


def test_an_exception_in_the_response_hook_kills_the_flow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    addon = make_addon(StaticLive(snapshot_policy(grant(1))))

    def broken(flow: Any) -> Any:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(responses, "record", broken)
    with taddons.context(addon):
        flow = tflow.tflow(resp=True)
        addon.response(flow)
    assert flow.error is not None and flow.error.msg == "Connection killed."


# -- end to end: the real runner -----------------------------------------------------------

TWO_HOSTS = ["api.test", "other.test"]


@pytest.fixture(scope="module")
def loopback_proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proxy, Upstream]]:
    """A real proxy with loopback opened by --allow-private, and an upstream for two names."""
    ca = trustme.CA()
    with Upstream(ca, TWO_HOSTS) as upstream:
        home = tmp_path_factory.mktemp("gaps")
        resolve = [f"{name}=127.0.0.1:{upstream.port}" for name in TWO_HOSTS]
        proxy = start_proxy(home, ca, resolve, extra=["--allow-private", "127.0.0.0/8"])
        try:
            yield proxy, upstream
        finally:
            stop_proxy(proxy)


def absolute_form(proxy: Proxy, auth: str, targets: list[tuple[str, str]]) -> list[Reply]:
    """Plain-proxy requests `GET URL` with `Host: HOST`, one after another on one connection."""
    replies = []
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        for url, host in targets:
            sock.sendall(
                f"GET {url} HTTP/1.1\r\nHost: {host}\r\n"
                f"Proxy-Authorization: {auth}\r\n\r\n".encode()
            )
            replies.append(read_reply(sock))
    return replies


@pytest.mark.e2e
def test_the_proxy_never_dials_its_own_listener(loopback_proxy: tuple[Proxy, Upstream]) -> None:
    # --allow-private opens loopback, so only the registration of the proxy's own listening
    # socket with the guard (in the runner) stops it from forwarding a request to itself.
    proxy, _ = loopback_proxy
    target = f"127.0.0.1:{proxy.port}"
    token = proxy.store.add_principal("self-dial")
    proxy.store.add_grant("self-dial", ["*"], hosts=[target])
    proxy.wait_reload()
    [reply] = absolute_form(proxy, proxy_auth("self-dial", token), [(f"http://{target}/", target)])
    assert (reply.status, reply.reason) == (403, "destination-forbidden")


@pytest.mark.e2e
def test_a_credential_never_rides_a_tls_connection_verified_for_another_host(
    loopback_proxy: tuple[Proxy, Upstream],
) -> None:
    proxy, upstream = loopback_proxy
    token = proxy.store.add_principal("two-hosts")
    for name in TWO_HOSTS:
        cred = "cred-" + name.split(".")[0]
        secret = Secret(("test-value-for-" + cred).encode())
        proxy.store.add_credential(cred, "bearer", [name], secret)
        proxy.store.add_grant("two-hosts", ["GET"], credential=cred)
    proxy.wait_reload()
    upstream.log.clear()
    targets = [(f"https://{name}/v1/x", name) for name in TWO_HOSTS]
    replies = absolute_form(proxy, proxy_auth("two-hosts", token), targets)
    # https without CONNECT is refused: mitmproxy would reuse its own TLS connection by
    # address for the next host (found by mutation review; fixed in _bind_destination).
    assert [(r.status, r.reason) for r in replies] == [(400, "bad-request")] * len(targets)
    # Every request that reached the upstream came on a TLS connection whose SNI (and so
    # the certificate the proxy verified) names the request's own host.
    pairs = [(r.sni, r.header("host")) for r in upstream.log.requests]
    assert all([sni] == host for sni, host in pairs), pairs


async def test_a_method_override_must_be_allowed_by_the_grant_that_is_stamped() -> None:
    # GET is granted with the credential, DELETE only by a pass-through grant: an override
    # to DELETE would carry the GET grant's credential, so it is refused.
    passthrough = replace(grant(2), credential=None, methods=frozenset({"DELETE"}))
    addon = make_addon(SpyLive(snapshot_policy(grant(1), passthrough)))
    with taddons.context(addon):
        flow = https_flow(addon)
        flow.request.headers["X_HTTP_Method_Override"] = "DELETE"
        await addon.requestheaders(flow)
    assert_refused_unstamped(flow, "method-not-allowed")
