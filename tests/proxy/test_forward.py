"""The forwarding addon in the chain: each scheme's bytes on the request as it leaves, the
refusals a scheme makes before anything is spent, and what a minted token's 401 does. The
wire itself is tested end to end (tests/e2e/test_proxy.py, test_path_scheme.py,
test_sigv4.py, test_minted.py)."""

from __future__ import annotations

import base64
import json
import time
from dataclasses import replace
from typing import Any

import pytest
from mitmproxy import http
from mitmproxy.test import taddons

from addon.core.hosts import ResolveMap
from addon.proxy.state import KEY
from addon.schemes.stamping import stamp_for
from addon.schemes.tokens import token
from store.crypto import Secret
from store.records import CredentialRecord
from tests.fakes import CRED, Chain, StaticLive, grant, https_flow, reason, snapshot_policy

SECRET = "sk-forward-0123456789"
IDENTITY = ("accept-encoding", "identity")
# What the agent sent: its own credential in every slot a scheme writes, and a field of its own.
AGENT = (
    ("Host", "api.test"),
    ("Authorization", "Bearer agent-dummy"),
    ("X_Api_Key", "agent-dummy"),
    ("Accept-Encoding", "gzip"),
    ("X-Other", "kept"),
)


def chain_for(cred: CredentialRecord, paths: tuple[str, ...] = ("/v1/",)) -> tuple[Chain, Any]:
    policy = snapshot_policy(grant(1, paths=paths), cred=cred)
    return Chain(StaticLive(policy), ResolveMap.parse(["api.test=127.0.0.1:9443"])), policy


async def forwarded(cred: CredentialRecord, target: bytes, *fields: tuple[str, str]) -> Any:
    c, _ = chain_for(cred, ("/",))
    with taddons.context(c.entry):
        flow = https_flow(c, target)
        flow.request.headers.fields = tuple(
            (n.encode(), v.encode()) for n, v in (("Host", "api.test"), *fields)
        )
        await c.requestheaders(flow)
    return flow


def sent(flow: Any) -> tuple[str, list[tuple[str, str]]]:
    request = flow.request
    return request.data.path.decode(), [(k.decode(), v.decode()) for k, v in request.headers.fields]


def cred(scheme: str, **more: Any) -> CredentialRecord:
    return replace(CRED, scheme=scheme, secret=Secret(SECRET.encode()), **more)


BASIC = base64.b64encode(SECRET.encode()).decode()
TG = {"placeholder": "CREDPROXY_TG", "positions": ["/bot{}"]}


@pytest.mark.parametrize(
    ("record", "target", "path", "added"),
    [
        pytest.param(
            cred("bearer"),
            b"/v1/x?a=1",
            "/v1/x?a=1",
            [("Authorization", "Bearer " + SECRET)],
            id="bearer replaces every Authorization",
        ),
        pytest.param(
            cred("basic"),
            b"/v1/x",
            "/v1/x",
            [("Authorization", "Basic " + BASIC)],
            id="basic replaces every Authorization, base64-encoded",
        ),
        pytest.param(
            cred("header", header_name="X-Api-Key"),
            b"/v1/x",
            "/v1/x",
            [("X-Api-Key", SECRET)],
            id="header replaces the agent's X_Api_Key: one slot",
        ),
        pytest.param(
            cred("query", param_name="key"),
            b"/v1/x?key=agent&a=1",
            f"/v1/x?a=1&key={SECRET}",
            [],
            id="query replaces the agent's parameter",
        ),
        pytest.param(
            cred("path", options=TG),
            b"/botCREDPROXY_TG/getMe?a=1",
            f"/bot{SECRET}/getMe?a=1",
            [],
            id="path puts the secret in the placeholder's place",
        ),
    ],
)
async def test_each_scheme_writes_its_bytes_and_only_those(
    record: CredentialRecord, target: bytes, path: str, added: list[tuple[str, str]]
) -> None:
    flow = await forwarded(record, target, *AGENT[1:])
    assert flow.response is None
    slots = {name.lower().replace("_", "-") for name, _ in added} | {"accept-encoding"}
    kept = [f for f in AGENT if f[0].lower().replace("_", "-") not in slots]
    assert sent(flow) == (path, [*kept, IDENTITY, *added])
    assert flow.metadata[KEY].credential == "gh"


@pytest.mark.parametrize(
    "target",
    [
        pytest.param(b"/botCREDPROXY_TG/CREDPROXY_TG", id="the placeholder twice"),
        pytest.param(b"/v1/botCREDPROXY_TG/getMe", id="the placeholder off its position"),
    ],
)
async def test_a_misplaced_path_placeholder_is_refused_and_nothing_written(target: bytes) -> None:
    flow = await forwarded(cred("path", options=TG), target)
    assert reason(flow) == "bad-request"
    assert flow.request.data.path == target
    assert SECRET.encode() not in b"".join(v for _, v in flow.request.headers.fields)


async def test_an_s3_acl_header_is_refused_before_anything_is_signed() -> None:
    keys = {"access_key_id": "AKIAREALKEYREALKEY00", "secret_access_key": "real-secret-key"}
    aws = replace(
        CRED,
        scheme="sigv4",
        secret=Secret(json.dumps(keys).encode()),
        options={"service": "s3", "region": "eu-west-1"},
    )
    flow = await forwarded(aws, b"/v1/x", ("x-amz-acl", "public-read"))
    assert reason(flow) == "bad-request"
    assert "authorization" not in flow.request.headers


MINTED = replace(
    CRED,
    scheme="oauth2-client",
    secret=Secret(json.dumps({"client_id": "id", "client_secret": "cs-long-secret"}).encode()),
    options={"token_url": "https://auth.test/token"},
)


async def test_a_minted_token_is_stamped_and_an_upstream_401_drops_it() -> None:
    c, policy = chain_for(MINTED)
    session = stamp_for(policy, MINTED).session  # type: ignore[attr-defined]
    current = session.current = token("minted-token-value", 60)
    try:
        with taddons.context(c.entry):
            flow = https_flow(c)
            await c.requestheaders(flow)
            assert flow.request.headers["authorization"] == "Bearer minted-token-value"
            assert flow.metadata[KEY].token_fp == current.fingerprint
            flow.response = http.Response.make(200)
            c.responseheaders(flow)
            assert session.current is current  # a 200 keeps it
            again = https_flow(c)
            await c.requestheaders(again)
            again.response = http.Response.make(401)
            c.responseheaders(again)
        assert session.current is None
    finally:
        session.close()


async def test_a_minted_credential_whose_mint_backs_off_is_refused_502_at_once() -> None:
    c, policy = chain_for(MINTED)
    session = stamp_for(policy, MINTED).session  # type: ignore[attr-defined]
    session._retry_at = time.monotonic() + 60
    session._failure = "the token endpoint answered 400"
    try:
        with taddons.context(c.entry):
            flow = https_flow(c)
            await c.requestheaders(flow)
        assert reason(flow) == "credentials-unavailable"
        assert flow.response.status_code == 502
        assert "authorization" not in flow.request.headers
    finally:
        session.close()
