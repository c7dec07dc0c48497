"""The hooks called directly (mitmproxy's taddons/tflow): fail-closed wrappers and pins.

The live policy here is a stand-in holding a Policy built from a hand-made snapshot; the
e2e suite runs the same hooks against the real store.
"""

from __future__ import annotations

import base64
import json
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mitmproxy import connection
from mitmproxy.proxy import context, server_hooks
from mitmproxy.test import taddons, tflow

from addon.core.hosts import ResolveMap
from addon.core.verdict import Tunnel
from addon.proxy import responses
from store.rules.grammar import BadPath, canonicalize, path_matches
from tests.fakes import (
    Chain,
    SpyLive,
    StaticLive,
    assert_refused_unstamped,
    basic,
    grant,
    https_flow,
    make_addon,
    make_policy,
    plain_flow,
    reason,
    snapshot_policy,
)


async def test_an_allowed_request_is_stamped():
    resolve = ResolveMap.parse(["api.test=127.0.0.1:9443"])
    addon = Chain(StaticLive(make_policy()), resolve)
    with taddons.context(addon):
        flow = https_flow(addon)
        flow.request.headers["authorization"] = "Bearer placeholder"
        await addon.requestheaders(flow)
    assert flow.response is None
    assert flow.request.headers.get_all("authorization") == ["Bearer s"]
    assert (flow.request.host, flow.request.port) == ("127.0.0.1", 9443)
    assert flow.request.host_header == "api.test"


async def test_an_exception_in_requestheaders_denies():
    addon = Chain(StaticLive(make_policy(), fail=True))
    with taddons.context(addon):
        flow = https_flow(addon)
        await addon.requestheaders(flow)
    assert flow.response.status_code == 500
    assert reason(flow) == "internal-error"
    assert "authorization" not in flow.request.headers


async def test_an_exception_in_the_decision_denies(monkeypatch: pytest.MonkeyPatch):
    policy = make_policy()

    def broken(*args: Any) -> Any:
        raise KeyError("boom")

    monkeypatch.setattr(policy, "decide", broken)
    addon = Chain(StaticLive(policy))
    with taddons.context(addon):
        flow = https_flow(addon)
        await addon.requestheaders(flow)
    assert reason(flow) == "internal-error"


async def test_an_exception_in_http_connect_denies():
    addon = Chain(StaticLive(make_policy(), fail=True))
    with taddons.context(addon):
        flow = tflow.tflow()
        flow.request.method = "CONNECT"
        auth = base64.b64encode(b"a:tok-a").decode()
        flow.request.headers["proxy-authorization"] = f"Basic {auth}"
        await addon.http_connect(flow)
    assert reason(flow) == "internal-error"
    assert addon.tunnel(flow.client_conn) is None


async def test_a_stale_policy_denies_with_store_unavailable():
    addon = Chain(StaticLive(None))
    with taddons.context(addon):
        flow = https_flow(addon)
        await addon.requestheaders(flow)
    assert flow.response.status_code == 503
    assert reason(flow) == "store-unavailable"


def test_an_exception_in_responseheaders_kills_the_flow(monkeypatch: pytest.MonkeyPatch):
    addon = Chain(StaticLive(make_policy()))

    def broken(flow: Any) -> Any:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(responses, "record", broken)
    with taddons.context(addon):
        flow = tflow.tflow(resp=True)
        addon.responseheaders(flow)
    assert flow.error is not None and flow.error.msg == "Connection killed."


def test_server_connect_refuses_a_connection_no_request_asked_for():
    addon = Chain(StaticLive(make_policy()))
    client = connection.Client(peername=("127.0.0.1", 5), sockname=("127.0.0.1", 8080))
    server = connection.Server(address=("api.test", 443))
    with taddons.context(addon):
        addon.server_connect(server_hooks.ServerConnectionHookData(server, client))
    assert server.error is not None


def test_server_connect_pins_sni_to_the_granted_name():
    addon = Chain(StaticLive(make_policy()))
    client = connection.Client(peername=("127.0.0.1", 5), sockname=("127.0.0.1", 8080))
    server = connection.Server(address=("127.0.0.1", 9443))
    server.sni = "127.0.0.1"
    addon.clients.state(client).upstream[("127.0.0.1", 9443)] = "api.test"
    with taddons.context(addon):
        addon.server_connect(server_hooks.ServerConnectionHookData(server, client))
    assert server.error is None
    assert server.sni == "api.test"


def test_tls_clienthello_pins_upstream_sni_and_flags_a_mismatch():
    from mitmproxy import tls
    from mitmproxy.options import Options

    addon = Chain(StaticLive(make_policy()))
    client = connection.Client(peername=("127.0.0.1", 5), sockname=("127.0.0.1", 8080))
    addon.bind(client, Tunnel("a", "api.test", 443))
    ctx = context.Context(client, Options())
    ctx.server = connection.Server(address=("api.test", 443))

    class Hello:
        sni = "evil.test"

    data = tls.ClientHelloData(ctx, Hello())
    with taddons.context(addon):
        addon.tls_clienthello(data)
    assert ctx.server.sni == "api.test"
    assert addon.tunnel(client).sni_mismatch
    assert not data.ignore_connection


SEGMENT = st.text(alphabet="abcXYZ019-._~%2eF!$&'()*+,=:@", min_size=1, max_size=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    segments=st.lists(SEGMENT, min_size=1, max_size=5),
    query=st.one_of(st.none(), st.text(alphabet="a=&b1%20", max_size=10)),
)
async def test_what_is_forwarded_is_what_was_matched(segments, query):
    """Whatever the agent sends, the upstream gets the canonical path the policy matched."""
    target = ("/v1/" + "/".join(segments)).encode() + (
        b"?" + query.encode() if query is not None else b""
    )
    addon = Chain(StaticLive(make_policy()), ResolveMap.parse(["api.test=127.0.0.1:9"]))
    with taddons.context(addon):
        flow = https_flow(addon, target)
        await addon.requestheaders(flow)
    try:
        path, raw_query = canonicalize(target)
    except BadPath:
        assert flow.response is not None and reason(flow) == "bad-request"
        return
    if not path_matches("/v1/", path):
        assert flow.response is not None and reason(flow) == "path-not-allowed"
        return
    assert flow.response is None
    expected = path.encode() + (b"?" + raw_query if raw_query is not None else b"")
    assert flow.request.data.path == expected


@pytest.mark.parametrize(
    ("authority", "host_header"),
    [
        pytest.param("api.test", "evil.test", id="h2 :authority granted, Host another"),
        pytest.param("evil.test", "api.test", id="h2 Host granted, :authority another"),
    ],
)
async def test_h2_authority_and_host_header_must_both_name_the_host(
    authority: str, host_header: str
):
    # mitmproxy's host_header prefers :authority on h2; a Host header that names another
    # host would still reach an h1 upstream (domain fronting) with the credential on it.
    addon = Chain(StaticLive(make_policy()))
    with taddons.context(addon):
        flow = https_flow(addon)
        flow.request.http_version = "HTTP/2.0"
        flow.request.authority = authority
        flow.request.headers["host"] = host_header
        await addon.requestheaders(flow)
    assert reason(flow) == "host-mismatch"
    assert flow.request.headers.get("authorization") is None


def connect_flow() -> Any:
    flow = tflow.tflow()
    flow.request.method = "CONNECT"
    flow.request.host, flow.request.port = "api.test", 443
    auth = base64.b64encode(b"a:tok-a").decode()
    flow.request.headers["proxy-authorization"] = f"Basic {auth}"
    return flow


async def test_a_connect_over_h2_to_the_proxy_is_refused():
    addon = Chain(StaticLive(make_policy()))
    with taddons.context(addon):
        flow = connect_flow()
        flow.request.http_version = "HTTP/2.0"
        await addon.http_connect(flow)
    assert reason(flow) == "bad-request"
    assert addon.tunnel(flow.client_conn) is None


async def test_a_second_connect_on_a_tunnelled_connection_is_refused():
    addon = Chain(StaticLive(make_policy()))
    with taddons.context(addon):
        flow = connect_flow()
        addon.bind(flow.client_conn, Tunnel("a", "other.test", 443))
        await addon.http_connect(flow)
    assert reason(flow) == "bad-request"
    assert addon.tunnel(flow.client_conn).host == "other.test"


async def test_an_h2_request_to_the_proxy_itself_is_refused():
    addon = Chain(StaticLive(make_policy()))
    with taddons.context(addon):
        flow = tflow.tflow()
        flow.request.http_version = "HTTP/2.0"
        auth = base64.b64encode(b"a:tok-a").decode()
        flow.request.headers["proxy-authorization"] = f"Basic {auth}"
        await addon.requestheaders(flow)
    assert reason(flow) == "bad-request"
    assert json.loads(flow.response.content)["detail"] == "HTTP/2 to the proxy is not supported"


# -- destination binding ------------------------------------------------------------------


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


# -- request framing and the method -------------------------------------------------------


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


# -- stamping -----------------------------------------------------------------------------


async def test_a_stamped_request_asks_for_an_identity_encoded_response() -> None:
    addon = make_addon(StaticLive(snapshot_policy(grant(1))))
    with taddons.context(addon):
        flow = https_flow(addon)
        flow.request.headers["Accept-Encoding"] = "gzip, br"
        await addon.requestheaders(flow)
    assert flow.response is None
    assert flow.request.headers.get_all("accept-encoding") == ["identity"]


# -- once-grants: consumed last, and only when everything else passed ---------------------


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


# -- no credential over cleartext ---------------------------------------------------------


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


async def test_a_once_grant_already_used_elsewhere_is_refused_unstamped() -> None:
    """Losing the once-grant race (another request or replica used it first) denies."""
    live = SpyLive(snapshot_policy(grant(1, once=True)))

    async def lost(grant_id: int) -> bool:
        live.consumed.append(grant_id)
        return False

    live.consume_once = lost  # type: ignore[method-assign]
    addon = make_addon(live)
    with taddons.context(addon):
        flow = https_flow(addon)
        await addon.requestheaders(flow)
    assert_refused_unstamped(flow, "grant-consumed")
    assert live.consumed == [1]


async def test_a_request_mitmproxy_already_refused_is_neither_stamped_nor_spends_a_once_grant() -> (
    None
):
    """mitmproxy still calls requestheaders for a head it refuses (e.g. Content-Length: abc)."""
    from mitmproxy import flow as mflow

    live = SpyLive(snapshot_policy(grant(1, once=True)))
    addon = make_addon(live)
    with taddons.context(addon):
        flow = https_flow(addon)
        flow.error = mflow.Error("Invalid content-length header")
        await addon.requestheaders(flow)
    assert live.consumed == []
    assert flow.request.headers.get("authorization") is None
