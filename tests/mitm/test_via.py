"""The corporate proxy's URL, bypass list, CONNECT and answers, without a network but loopback."""

from __future__ import annotations

import asyncio
import ssl

import pytest

from addon.core.reasons import Reason
from addon.mitm import wire
from addon.mitm.via import (
    ANSWER_LIMIT,
    ERRORS,
    Bypass,
    ProxyFailed,
    Route,
    UpstreamProxy,
    basic,
    connect_head,
    refusal,
)


@pytest.mark.parametrize(
    ("host", "address", "direct"),
    [
        pytest.param("example.com", "93.184.216.34", True, id="the name itself"),
        pytest.param("api.example.com", "93.184.216.34", True, id="a name under it"),
        pytest.param("badexample.com", "93.184.216.34", False, id="not a suffix of another label"),
        pytest.param("x.corp.internal", "1.1.1.1", True, id="a .domain entry"),
        pytest.param("corp.internal", "1.1.1.1", True, id="a .domain entry covers the domain"),
        pytest.param("github.com", "10.2.3.4", True, id="a name vetted inside a bypassed CIDR"),
        pytest.param("github.com", "140.82.1.1", False, id="a public name elsewhere"),
        pytest.param("10.9.9.9", "10.9.9.9", True, id="an IP literal inside a CIDR"),
        pytest.param("::1", "::1", True, id="a bracketed IPv6 entry"),
    ],
)
def test_bypass_matches_names_and_networks(host: str, address: str, direct: bool) -> None:
    bypass = Bypass.parse(["example.com, .corp.internal", "10.0.0.0/8 [::1]"])
    assert bypass.matches(host, address) is direct


def test_bypass_star_matches_everything() -> None:
    assert Bypass.parse(["*"]).matches("anything.example", "8.8.8.8")


def test_an_empty_bypass_matches_nothing() -> None:
    assert not Bypass.parse([]).matches("localhost", "127.0.0.1")


@pytest.mark.parametrize("entry", ["exa mple..com", "host:8080", "a_b!"])
def test_a_bad_bypass_entry_is_refused_at_start(entry: str) -> None:
    with pytest.raises(ValueError, match="--upstream-proxy-bypass"):
        Bypass.parse([entry.replace(" ", "")])


def test_the_proxy_url_is_parsed_once() -> None:
    proxy = UpstreamProxy.parse("http://Proxy.Corp:3128/", ["localhost"], "corp")
    assert (proxy.host, proxy.port, proxy.credential) == ("proxy.corp", 3128, "corp")
    assert proxy.bypass.matches("localhost", "127.0.0.1")


@pytest.mark.parametrize(
    "url",
    [
        pytest.param("http://proxy.corp", id="no port"),
        pytest.param("socks5://proxy.corp:1080", id="another scheme"),
        pytest.param("http://proxy.corp:3128/path", id="a path"),
        pytest.param("http://proxy.corp:3128/?q", id="a query"),
        pytest.param("https://proxy.corp:3128", id="https, not yet"),
    ],
)
def test_a_bad_proxy_url_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="--upstream-proxy"):
        UpstreamProxy.parse(url)


def test_a_password_in_the_url_is_refused_and_never_quoted() -> None:
    with pytest.raises(ValueError) as raised:
        UpstreamProxy.parse("http://corp:hunter2@proxy.corp:3128")
    assert "hunter2" not in str(raised.value)
    assert "--upstream-proxy-credential" in str(raised.value)


def test_connect_names_the_host_and_port() -> None:
    assert connect_head("api.example.com", 443, None) == (
        b"CONNECT api.example.com:443 HTTP/1.1\r\nHost: api.example.com:443\r\n\r\n"
    )
    assert connect_head("::1", 8443, None).startswith(b"CONNECT [::1]:8443 HTTP/1.1\r\n")
    assert b"Proxy-Authorization: Basic dTpw\r\n" in connect_head("h", 1, basic(b"u:p"))


@pytest.mark.parametrize("name", ["a b", "a\r\nX: y", "", "a/b"])
def test_connect_refuses_what_no_vetted_name_looks_like(name: str) -> None:
    with pytest.raises(ValueError):
        connect_head(name, 443, None)


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"HTTP/1.1 200 Connection established\r\n\r\n", None),
        (b"HTTP/1.0 200\r\n\r\n", None),
        (b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n", "proxy-auth-required"),
        (b"HTTP/1.1 403 Forbidden\r\n\r\n", "proxy-denied"),
        (b"HTTP/1.1 302 Found\r\n\r\n", "proxy-denied"),
        (b"HTTP/1.1 502 Bad Gateway\r\n\r\n", "proxy-upstream-failed"),
        (b"HTTP/1.1 503 Service Unavailable\r\n\r\n", "proxy-upstream-failed"),
        (b"HTTP/1.1 100 Continue\r\n\r\n", "proxy-bad-answer"),
        (b"SSH-2.0-OpenSSH\r\n\r\n", "proxy-bad-answer"),
        (b"HTTP/1.1 2000 OK\r\n\r\n", "proxy-bad-answer"),
    ],
)
def test_the_proxys_answer_is_classified(answer: bytes, error: str | None) -> None:
    assert refusal(answer) == error


@pytest.mark.parametrize("error", sorted(ERRORS))
def test_each_failure_is_a_fixed_reason_with_a_fixed_detail(error: str) -> None:
    failure = wire.classify(str(ProxyFailed(error)))
    reason, detail = ERRORS[error]
    assert (failure.reason, failure.error, failure.detail) == (reason, error, detail)
    assert failure.reason in (Reason.UPSTREAM_PROXY_AUTH, Reason.UPSTREAM_PROXY_REFUSED)
    assert failure.status == 502


# -- against a scripted proxy on 127.0.0.1 ---------------------------------------------------


async def _scripted(answer: bytes) -> tuple[asyncio.Server, list[bytes]]:
    """A proxy that reads one CONNECT head and writes `answer`."""
    heads: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(answer)
        await writer.drain()
        if not answer:
            writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0), heads


def _route(server: asyncio.Server, authorization: bytes | None = None) -> Route:
    port = server.sockets[0].getsockname()[1]
    return Route(
        UpstreamProxy("127.0.0.1", port, credential="corp" if authorization else None),
        (lambda: authorization) if authorization is not None else None,
    )


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        pytest.param(
            b"HTTP/1.1 407 Auth\r\nProxy-Authenticate: Basic\r\n\r\n", "proxy-auth-required"
        ),
        pytest.param(b"HTTP/1.1 403 Forbidden\r\n\r\n<html>", "proxy-denied"),
        pytest.param(b"", "proxy-closed", id="closed without an answer"),
        pytest.param(b"HTTP/1.1 200 OK\r\n\r\nearly", "proxy-bad-answer", id="bytes before TLS"),
    ],
)
async def test_a_refused_connect_raises_its_fixed_failure(answer: bytes, error: str) -> None:
    server, heads = await _scripted(answer)
    async with server:
        with pytest.raises(ProxyFailed) as raised:
            await _route(server, b"Basic c2VjcmV0").open("api.example.com", 443, None, 5)
    assert raised.value.error == error
    assert str(raised.value) == f"credproxy upstream proxy: {error}"
    assert heads[0].startswith(b"CONNECT api.example.com:443 HTTP/1.1\r\n")
    assert b"Proxy-Authorization: Basic c2VjcmV0\r\n" in heads[0]


async def test_a_proxy_that_cannot_be_reached_is_a_refusal() -> None:
    server, _ = await _scripted(b"")
    route = _route(server)
    server.close()
    await server.wait_closed()
    with pytest.raises(ProxyFailed, match="proxy-unreachable"):
        await route.open("api.example.com", 443, None, 5)


async def test_tls_through_the_tunnel_is_verified_for_the_name() -> None:
    """The proxy opens the tunnel, then answers TLS with a certificate of another name: the
    handshake fails and nothing is sent (the credential would be stamped after it)."""
    import trustme

    ca = trustme.CA()
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("evil.example").configure_cert(served)
    received: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await writer.drain()
        try:
            await writer.start_tls(served)
            received.append(await reader.read(100))
        except (ssl.SSLError, OSError):
            pass

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    trusted = ssl.create_default_context()
    ca.configure_trust(trusted)
    async with server:
        with pytest.raises(ssl.SSLCertVerificationError):
            await _route(server).open("api.example.com", 443, trusted, 5)
    assert received == []


# -- Route.tunnel: the same answers, for credproxy's own calls (in a thread) -----------------


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        pytest.param(
            b"HTTP/1.1 407 Auth\r\nProxy-Authenticate: Basic\r\n\r\n", "proxy-auth-required"
        ),
        pytest.param(b"HTTP/1.1 403 Forbidden\r\n\r\n<html>", "proxy-denied"),
        pytest.param(b"", "proxy-closed", id="closed without an answer"),
        pytest.param(b"HTTP/1.1 200 OK\r\n\r\nearly", "proxy-bad-answer", id="bytes before TLS"),
    ],
)
async def test_a_refused_tunnel_for_a_token_endpoint_raises_its_fixed_failure(
    answer: bytes, error: str
) -> None:
    server, heads = await _scripted(answer)
    route = _route(server, b"Basic c2VjcmV0")
    async with server:
        with pytest.raises(ProxyFailed) as raised:
            await asyncio.to_thread(route.tunnel, "auth.example.com", 443, ("192.0.2.1", 443), 5)
    assert raised.value.error == error
    assert heads[0].startswith(b"CONNECT auth.example.com:443 HTTP/1.1\r\n")
    assert b"Proxy-Authorization: Basic c2VjcmV0\r\n" in heads[0]


# -- the corporate proxy's answer is bounded (ANSWER_LIMIT, in the limits table) ------------

_LONG = b"HTTP/1.1 200 Connection established\r\nX-Pad: " + b"a" * ANSWER_LIMIT + b"\r\n\r\n"
_ENDLESS = b"HTTP/1.1 200 Connection established\r\nX-Pad: " + b"a" * (ANSWER_LIMIT + 4096)
_UNDER = b"HTTP/1.1 200 Connection established\r\nX-Pad: " + b"a" * 60_000 + b"\r\n\r\n"


@pytest.mark.parametrize(
    "answer",
    [pytest.param(_LONG, id="a whole answer over 64 KiB"), pytest.param(_ENDLESS, id="no end")],
)
async def test_an_answer_over_64_kib_is_a_bad_answer_in_open_and_tunnel(answer: bytes) -> None:
    assert ANSWER_LIMIT == 64 * 1024
    server, _ = await _scripted(answer)
    route = _route(server)
    async with server:
        with pytest.raises(ProxyFailed) as opened:
            await asyncio.wait_for(route.open("api.example.com", 443, None, 5), 10)
        with pytest.raises(ProxyFailed) as tunnelled:
            await asyncio.wait_for(
                asyncio.to_thread(route.tunnel, "auth.example.com", 443, ("192.0.2.1", 443), 5),
                10,
            )
    assert (opened.value.error, tunnelled.value.error) == ("proxy-bad-answer", "proxy-bad-answer")


async def test_an_answer_under_the_limit_opens_the_tunnel() -> None:
    server, _ = await _scripted(_UNDER)
    route = _route(server)
    async with server:
        _, writer = await route.open("api.example.com", 443, None, 5)
        writer.close()
        sock = await asyncio.to_thread(route.tunnel, "auth.example.com", 443, ("192.0.2.1", 443), 5)
        assert sock is not None
        sock.close()


async def test_a_tunnel_is_opened_by_name_and_a_bypassed_address_is_dialled_directly() -> None:
    server, heads = await _scripted(b"HTTP/1.1 200 Connection established\r\n\r\n")
    port = server.sockets[0].getsockname()[1]
    route = Route(UpstreamProxy("127.0.0.1", port, Bypass.parse(["10.0.0.0/8"])), None)
    async with server:
        sock = await asyncio.to_thread(route.tunnel, "auth.example.com", 443, ("192.0.2.1", 443), 5)
        assert sock is not None
        sock.close()
        direct = await asyncio.to_thread(
            route.tunnel, "auth.example.com", 443, ("10.1.2.3", 443), 5
        )
    assert direct is None
    assert len(heads) == 1 and b"Proxy-Authorization" not in heads[0]
