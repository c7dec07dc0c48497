"""Authentication (addon/proxy/auth.py): one valid Basic Proxy-Authorization, removed before
forwarding,
and checked again inside an open tunnel."""

from __future__ import annotations

from typing import Any

import pytest
from mitmproxy.test import taddons, tflow

from tests.fakes import (
    StaticLive,
    assert_refused_unstamped,
    basic,
    grant,
    https_flow,
    make_addon,
    plain_flow,
    reason,
    snapshot_policy,
)


def connect_flow(*auth: str) -> Any:
    flow = tflow.tflow()
    flow.request.method = "CONNECT"
    flow.request.host, flow.request.port = "api.test", 443
    flow.request.headers.fields = tuple((b"Proxy-Authorization", value.encode()) for value in auth)
    return flow


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


async def test_proxy_authorization_is_removed_from_a_forwarded_plain_http_request() -> None:
    live = StaticLive(snapshot_policy(grant(1, cred=False, hosts=("plain.test",), paths=("/",))))
    addon = make_addon(live)
    with taddons.context(addon):
        flow = plain_flow()
        await addon.requestheaders(flow)
    assert flow.response is None, "the pass-through request should be forwarded"
    assert "proxy-authorization" not in flow.request.headers


async def test_a_removed_principal_is_refused_inside_its_open_tunnel() -> None:
    # The tunnel was opened while "a" existed; its token is gone from the policy now.
    addon = make_addon(StaticLive(snapshot_policy(grant(1), tokens={"b": "tok-b"})))
    with taddons.context(addon):
        flow = https_flow(addon)
        await addon.requestheaders(flow)
    assert_refused_unstamped(flow, "auth-required")


def _lines(addon: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    lines: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(addon.trail, "write", lambda _, d, **f: lines.append((d, f)))
    return lines


@pytest.mark.parametrize("kind", ["CONNECT", "plain-http"])
async def test_no_credentials_at_all_is_a_challenge_not_a_denial(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    addon = make_addon(StaticLive(snapshot_policy(grant(1))))
    lines = _lines(addon, monkeypatch)
    with taddons.context(addon):
        if kind == "CONNECT":
            flow = connect_flow()
            await addon.http_connect(flow)  # type: ignore[misc]
        else:
            flow = plain_flow()
            flow.request.headers.pop("proxy-authorization")
            await addon.requestheaders(flow)
    assert flow.response.status_code == 407
    assert flow.response.headers["proxy-authenticate"] == 'Basic realm="credproxy"'
    assert flow.response.json()["error"] == "challenge"
    assert [(d, f["reason"]) for d, f in lines] == [("challenge", "auth-required")]


@pytest.mark.parametrize(
    "auth",
    [
        pytest.param(basic("a", "wrong"), id="a wrong token"),
        pytest.param(basic("nobody", "tok-a"), id="an unknown principal"),
        pytest.param("Basic !!!", id="a value that is not base64"),
    ],
)
async def test_wrong_credentials_remain_a_denial(
    auth: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    addon = make_addon(StaticLive(snapshot_policy(grant(1))))
    lines = _lines(addon, monkeypatch)
    with taddons.context(addon):
        flow = connect_flow(auth)
        await addon.http_connect(flow)  # type: ignore[misc]
    assert flow.response.status_code == 407
    assert flow.response.headers["proxy-authenticate"] == 'Basic realm="credproxy"'
    assert flow.response.json()["error"] == "denied"
    assert [(d, f["reason"]) for d, f in lines] == [("deny", "auth-required")]
