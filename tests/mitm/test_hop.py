"""Hop-by-hop fields: what each side's fields become, and the head the agent reads."""

from __future__ import annotations

import pytest
from mitmproxy.test import tutils

from addon.mitm import hop

AUTH = (b"Authorization", b"Bearer placeholder")


@pytest.mark.parametrize(
    ("fields", "kept", "close"),
    [
        pytest.param(
            ((b"Connection", b"close, X-Private"), (b"X-Private", b"1"), (b"Accept", b"*/*")),
            ((b"Accept", b"*/*"),),
            True,
            id="Connection and the field it names go, its close is reported",
        ),
        pytest.param(
            ((b"CONNECTION", b"AUTHORIZATION"), AUTH),
            (),
            False,
            id="upper case names a field in any case",
        ),
        pytest.param(
            ((b"connection", b"x-a"), (b"Connection", b" X-B ,, "), (b"X-A", b"1"), (b"x-b", b"2")),
            (),
            False,
            id="every Connection line counts, with spaces and empty items",
        ),
        pytest.param(
            (
                (b"cOnNeCtIoN", b"kEeP-AlIvE"),
                (b"Keep-Alive", b"timeout=5"),
                (b"Proxy-Connection", b"x"),
            ),
            (),
            False,
            id="mixed case, Keep-Alive and Proxy-Connection",
        ),
        pytest.param(
            ((b"Proxy-Connection", b"keep-alive"), (b"Keep-Alive", b"timeout=5")),
            (),
            False,
            id="hop-by-hop fields go without being named",
        ),
        pytest.param(
            (
                (b"Connection", b"Host, Content-Length, Transfer-Encoding"),
                (b"Host", b"a.test"),
                (b"Content-Length", b"3"),
            ),
            ((b"Host", b"a.test"), (b"Content-Length", b"3")),
            False,
            id="Host and the framing are never removed by being named",
        ),
        pytest.param(
            ((b"TE", b"gzip, trailers"), (b"Upgrade", b"websocket")),
            (),
            False,
            id="TE and Upgrade go when nothing keeps them",
        ),
        pytest.param(((b"x", b"1"),), ((b"x", b"1"),), False, id="other fields are untouched"),
    ],
)
def test_strip(fields, kept, close):
    assert hop.strip(fields) == (kept, close)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        pytest.param(((b"TE", b"gzip, trailers"),), ((b"te", b"trailers"),), id="trailers kept"),
        pytest.param(((b"te", b"gzip;q=1"),), (), id="a coding alone is dropped"),
        pytest.param(
            ((b"te", b"trailers;q=1"), (b"te", b"gzip")), ((b"te", b"trailers"),), id="two"
        ),
    ],
)
def test_te_keeps_only_trailers_where_trailers_are_forwarded(fields, expected):
    assert hop.strip(fields, trailers=True)[0] == expected


def test_an_http2_agent_keeps_te_trailers_and_an_http1_agent_does_not():
    for version, expected in (("HTTP/2.0", ((b"te", b"trailers"),)), ("HTTP/1.1", ())):
        request = tutils.treq(http_version=version, headers=((b"TE", b"trailers"),))
        hop.for_upstream(request, websocket=False)
        assert request.headers.fields == expected, version


def test_a_granted_upgrade_keeps_upgrade_and_one_connection_upgrade():
    fields = (
        (b"Connection", b"keep-alive, Upgrade, X-A"),
        (b"Upgrade", b"websocket"),
        (b"X-A", b"1"),
    )
    assert hop.strip(fields, upgrade=True)[0] == (
        (b"Upgrade", b"websocket"),
        (b"connection", b"Upgrade"),
    )
    # An Upgrade field the Connection does not name asks for nothing: it goes.
    assert hop.strip(((b"Upgrade", b"websocket"),), upgrade=True)[0] == ()


def test_the_agents_close_is_remembered_for_its_own_connection_only():
    request = tutils.treq(headers=((b"Connection", b"close, Authorization"), AUTH, (b"Host", b"a")))
    hop.for_upstream(request, websocket=False)
    assert request.headers.fields == ((b"Host", b"a"),)
    response = tutils.tresp(headers=((b"Content-Length", b"0"),))
    head = hop.agent_head(request, response)
    assert head is not response, "the flow's response stays as the upstream hop reads it"
    assert response.headers.fields == ((b"Content-Length", b"0"),)
    assert head.headers.fields == ((b"Content-Length", b"0"), (b"connection", b"close"))


def test_the_upstreams_close_stays_for_its_hop_and_never_reaches_the_agent():
    response = tutils.tresp(
        headers=(
            (b"Connection", b"close, X-Foo"),
            (b"X-Foo", b"1"),
            (b"Keep-Alive", b"timeout=5"),
            (b"Proxy-Authenticate", b"Basic"),
            (b"Content-Length", b"0"),
        )
    )
    hop.for_agent(response)
    assert response.headers.fields == ((b"Content-Length", b"0"), (b"connection", b"close"))
    head = hop.agent_head(tutils.treq(), response)
    assert head.headers.fields == ((b"Content-Length", b"0"),)


def test_a_keep_alive_exchange_sends_the_response_as_it_is():
    request = tutils.treq(headers=((b"Connection", b"keep-alive"),))
    hop.for_upstream(request, websocket=False)
    response = tutils.tresp(headers=((b"Connection", b"keep-alive"), (b"Content-Length", b"0")))
    hop.for_agent(response)
    assert response.headers.fields == ((b"Content-Length", b"0"),)
    assert hop.agent_head(request, response) is response


def test_a_switching_response_keeps_its_upgrade():
    response = tutils.tresp(
        status_code=101,
        headers=((b"Connection", b"Upgrade, X-Foo"), (b"Upgrade", b"websocket"), (b"X-Foo", b"1")),
    )
    hop.for_agent(response)
    assert response.headers.fields == ((b"Upgrade", b"websocket"), (b"connection", b"Upgrade"))
    request = tutils.treq(headers=((b"Connection", b"close, Upgrade"), (b"Upgrade", b"websocket")))
    hop.for_upstream(request, websocket=True)
    assert hop.agent_head(request, response) is response, "a 101 is never told to close"


def test_install_wraps_mitmproxys_http1_server_once():
    from mitmproxy.proxy.layers.http._http1 import Http1Server

    hop.install()
    wrapped = Http1Server.send
    hop.install()
    assert Http1Server.send is wrapped
    assert wrapped.__qualname__.startswith("_own_connection")
