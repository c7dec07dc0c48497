"""Every addon fails closed: an exception in any of its hooks denies the request (internal-error)
or kills the flow, never lets it through (mitmproxy would log it and carry on)."""

from __future__ import annotations

import base64
from types import SimpleNamespace
from typing import Any

import pytest
from mitmproxy import connection, http, tls
from mitmproxy import flow as mflow
from mitmproxy.options import Options
from mitmproxy.proxy import context, server_hooks
from mitmproxy.test import taddons, tflow

from addon.core.hosts import ResolveMap
from addon.mitm import wire
from addon.proxy import access, auth, forward, gate, pinning, responses, trail
from addon.proxy.limits import Limits
from addon.redaction import wsredact
from tests.fakes import (
    Chain,
    StaticLive,
    assert_refused_unstamped,
    grant,
    https_flow,
    make_addon,
    make_policy,
    plain_flow,
    reason,
    snapshot_policy,
)

KILLED = "Connection killed."


def boom(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("injected fault")


@pytest.fixture
def chain() -> Chain:
    return Chain(StaticLive(make_policy()), ResolveMap.parse(["api.test=127.0.0.1:9443"]))


def connect_flow() -> Any:
    flow = tflow.tflow()
    flow.request.method = "CONNECT"
    flow.request.host, flow.request.port = "api.test", 443
    auth_value = base64.b64encode(b"a:tok-a").decode()
    flow.request.headers["proxy-authorization"] = f"Basic {auth_value}"
    return flow


def assert_denied_unstamped(flow: Any) -> None:
    assert flow.response is not None and flow.response.status_code == 500
    assert reason(flow) == "internal-error"
    assert flow.request.headers.get("authorization") is None
    assert flow.request.host == "api.test"  # never pointed at the upstream address


def assert_killed(flow: Any) -> None:
    assert flow.error is not None and flow.error.msg == KILLED


# -- the request side: denied ------------------------------------------------------------------


async def test_auth_http_connect(chain: Chain, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth, "normalize_host", boom)
    with taddons.context(chain):
        flow = connect_flow()
        await chain.http_connect(flow)
    assert reason(flow) == "internal-error"
    assert chain.tunnel(flow.client_conn) is None


async def test_auth_requestheaders(chain: Chain, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth.HeaderScan, "scan", boom)
    with taddons.context(chain):
        flow = https_flow(chain)
        await chain.requestheaders(flow)
    assert_denied_unstamped(flow)


async def test_gate_requestheaders(chain: Chain, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gate, "verdict", boom)
    with taddons.context(chain):
        flow = https_flow(chain)
        await chain.requestheaders(flow)
    assert_denied_unstamped(flow)


async def test_forward_requestheaders(chain: Chain, monkeypatch: pytest.MonkeyPatch) -> None:
    # The last step after stamping: the credential's redaction set for the response.
    monkeypatch.setattr(forward, "SETS", SimpleNamespace(redactor=boom))
    with taddons.context(chain):
        flow = https_flow(chain)
        await chain.requestheaders(flow)
    assert_denied_unstamped(flow)
    assert flow not in wsredact.REDACTORS


async def test_access_endpoint_request(chain: Chain, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(access, "record", boom)
    with taddons.context(chain):
        flow = https_flow(chain)
        await chain.request(flow)
    assert reason(flow) == "internal-error"


async def test_limits_http_connect(chain: Chain, monkeypatch: pytest.MonkeyPatch) -> None:
    with taddons.context(chain):
        flow = connect_flow()
        monkeypatch.setattr(chain.limits, "conns", None)  # its lookup raises
        await chain.http_connect(flow)
    assert_killed(flow)
    assert chain.tunnel(flow.client_conn) is None, "no tunnel left open unchecked"


# -- TLS and upstream connections: the connection is broken or not made --------------------


def hello_data(chain: Chain, flow: Any) -> Any:
    ctx = context.Context(flow.client_conn, Options())
    ctx.server = connection.Server(address=("api.test", 443))

    class Hello:
        sni = "api.test"

    return tls.ClientHelloData(ctx, Hello())  # type: ignore[arg-type]


async def test_pinning_tls_clienthello(chain: Chain, monkeypatch: pytest.MonkeyPatch) -> None:
    with taddons.context(chain):
        flow = https_flow(chain)
        monkeypatch.setattr(pinning, "normalize_host", boom)
        chain.tls_clienthello(hello_data(chain, flow))
        await chain.requestheaders(flow)
    assert_denied_unstamped(flow)


async def test_pinning_tls_start_client(chain: Chain, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pinning, "_is_tls_to_the_proxy", boom)
    with taddons.context(chain):
        flow = https_flow(chain)
        ctx = context.Context(flow.client_conn, Options())
        chain.tls_start_client(tls.TlsData(flow.client_conn, ctx))
        await chain.requestheaders(flow)
    assert_denied_unstamped(flow)


def test_pinning_server_connect(chain: Chain, monkeypatch: pytest.MonkeyPatch) -> None:
    client = connection.Client(peername=("127.0.0.1", 5), sockname=("127.0.0.1", 8080))
    server = connection.Server(address=("127.0.0.1", 9443))
    chain.clients.state(client).upstream[("127.0.0.1", 9443)] = "api.test"
    monkeypatch.setattr(chain.clients, "get", boom)
    with taddons.context(chain):
        chain.server_connect(server_hooks.ServerConnectionHookData(server, client))
    assert server.error == "credproxy: internal error"


# -- the response side: killed -----------------------------------------------------------------


async def allowed(chain: Chain) -> Any:
    flow = https_flow(chain)
    await chain.requestheaders(flow)
    assert flow.response is None
    flow.response = http.Response.make(200, b"{}", {"content-length": "2"})
    return flow


async def test_responses_responseheaders(chain: Chain, monkeypatch: pytest.MonkeyPatch) -> None:
    with taddons.context(chain):
        flow = await allowed(chain)
        monkeypatch.setattr(wire, "foreign_coding", boom)
        chain.responseheaders(flow)
    assert_killed(flow)


async def test_responses_response(chain: Chain, monkeypatch: pytest.MonkeyPatch) -> None:
    with taddons.context(chain):
        flow = await allowed(chain)
        chain.responseheaders(flow)
        monkeypatch.setattr(wsredact.REDACTORS[flow], "whole", boom)
        chain.response(flow)
    assert_killed(flow)


def test_responses_websocket_message(chain: Chain, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wsredact, "on_message", boom)
    flow = tflow.twebsocketflow()
    chain.websocket_message(flow)
    assert flow.websocket.messages[-1].dropped and wsredact.killed(flow)


async def test_trail_response(chain: Chain, monkeypatch: pytest.MonkeyPatch) -> None:
    with taddons.context(chain):
        flow = await allowed(chain)
        chain.responseheaders(flow)
        monkeypatch.setattr(chain.trail, "write", boom)
        chain.response(flow)
    assert_killed(flow)


async def test_trail_error_still_writes_a_fixed_line(
    chain: Chain, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines: list[dict[str, Any]] = []
    with taddons.context(chain):
        flow = await allowed(chain)
        flow.error = tflow.terr()
        monkeypatch.setattr(trail.wire, "classify", boom)
        monkeypatch.setattr(chain.trail, "write", lambda _, d, **f: lines.append({"d": d, **f}))
        chain.error(flow)
    assert lines == [
        {"d": "error", "status": 500, "error": "unclassified", "reason": "internal-error"}
    ]


def test_every_request_side_hook_of_every_addon_is_wrapped(chain: Chain) -> None:
    """A new hook without a wrapper would fail open: each one is listed here. (Pinning and
    Limits.http_connect catch inside the hook; the tests above hold them.)"""
    wrapped = {
        (type(a).__name__, name)
        for a in chain.entry.parts
        for name in ("http_connect", "requestheaders", "request", "responseheaders", "response")
        if getattr(getattr(a, name, None), "__wrapped__", None) is not None
    }
    assert wrapped == {
        ("Auth", "http_connect"),
        ("Auth", "requestheaders"),
        ("Gate", "requestheaders"),
        ("BodyGate", "requestheaders"),
        ("BodyGate", "request"),
        ("Forward", "requestheaders"),
        ("Forward", "responseheaders"),  # a minted token's 401 drop: kill_on_error
        ("AccessEndpoint", "request"),
        ("Signing", "request"),
        ("Responses", "responseheaders"),
        ("Responses", "response"),
        ("Trail", "response"),
    }


# -- broken hooks, a broken deny ----------------------------------------------------------


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


def test_server_connect_refuses_when_its_hook_fails() -> None:
    addon = make_addon(StaticLive(snapshot_policy(grant(1))))
    client = connection.Client(peername=("127.0.0.1", 5), sockname=("127.0.0.1", 8080))
    server = connection.Server(address=None)  # the hook's own check raises
    with taddons.context(addon):
        addon.server_connect(server_hooks.ServerConnectionHookData(server, client))
    assert server.error is not None


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


async def test_a_flow_killed_in_the_response_hook_still_gets_its_audit_line(
    chain: Chain, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines: list[tuple[str, dict[str, Any]]] = []
    write = chain.trail.write
    monkeypatch.setattr(
        chain.trail,
        "write",
        lambda rec, decision, **f: (lines.append((decision, f)), write(rec, decision, **f)),
    )
    with taddons.context(chain):
        flow = await allowed(chain)
        chain.responseheaders(flow)
        monkeypatch.setattr(wsredact.REDACTORS[flow], "whole", boom)
        chain.response(flow)
    assert_killed(flow)
    assert lines == [("error", {"status": None, "reason": "internal-error", "error": "killed"})]


async def test_an_exception_in_the_error_line_still_lets_limits_see_the_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[Any] = []
    original = Limits.error
    monkeypatch.setattr(Limits, "error", lambda self, f: (seen.append(f), original(self, f)))
    chain = Chain(StaticLive(make_policy()), ResolveMap.parse(["api.test=127.0.0.1:9443"]))
    monkeypatch.setattr(chain.trail, "write", boom)
    with taddons.context(chain):
        flow = await allowed(chain)
        flow.error = mflow.Error("connection refused")
        chain.error(flow)
    assert seen == [flow]
