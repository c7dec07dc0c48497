"""The signing addon in the chain: the agent's signature out, ours over what is forwarded,
a held body signed once whole, refusals before anything is spent, and failures that deny."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from mitmproxy.test import taddons

from addon.core.hosts import ResolveMap
from addon.mitm import installed
from addon.proxy import signing
from addon.schemes.stamping import stamp_for
from store.crypto import Secret
from tests.e2e.fakeaws import Keys, verify
from tests.fakes import CRED, Chain, SpyLive, StaticLive, grant, https_flow, reason, snapshot_policy

KEYS = Keys("AKIAREALKEYREALKEY00", "real-secret-access-key", "real-session-token")
AWS = replace(
    CRED,
    scheme="sigv4",
    secret=Secret(KEYS.json()),
    options={"service": "sqs", "region": "eu-west-1"},
)


def chain(*grants: Any, live: Any = None) -> Chain:
    policy = snapshot_policy(*(grants or (grant(1, methods=("GET", "POST")),)), cred=AWS)
    return Chain(live or StaticLive(policy), ResolveMap.parse(["api.test=127.0.0.1:9443"]))


def agent_flow(c: Chain, body: bytes = b"", **extra: str) -> Any:
    flow = https_flow(c, b"/v1/./q?X-Amz-Signature=dummy&Action=Send")
    flow.request.method = "POST"
    flow.request.headers["authorization"] = "AWS4-HMAC-SHA256 Credential=AKIADUMMY/x"
    flow.request.headers["x-amz-date"] = "20200101T000000Z"
    flow.request.headers["X_Amz_Security_Token"] = "dummy"
    flow.request.headers["content-length"] = str(len(body))
    for name, value in extra.items():
        flow.request.headers[name] = value
    flow.request.raw_content = body
    return flow


def forwarded(flow: Any) -> tuple[str, list[tuple[str, str]]]:
    request = flow.request
    fields = [(k.decode(), v.decode()) for k, v in request.headers.fields]
    return request.data.path.decode(), fields


async def test_a_held_body_is_signed_once_whole_over_what_is_forwarded() -> None:
    c = chain()
    with taddons.context(c.entry):
        flow = agent_flow(c, b"Action=SendMessage")
        await c.requestheaders(flow)
        assert flow.response is None and flow.request.stream is False
        assert "authorization" not in flow.request.headers  # nothing signed before the body
        await c.request(flow)
    target, fields = forwarded(flow)
    assert target == "/v1/q?Action=Send"
    assert verify(KEYS, "POST", target, fields, b"Action=SendMessage") == (
        None,
        ("eu-west-1", "sqs"),
    )
    names = [k.lower() for k, _ in fields]
    assert names.count("authorization") == 1 and names.count("x-amz-date") == 1
    assert "x_amz_security_token" not in names
    assert dict((k.lower(), v) for k, v in fields)["x-amz-security-token"] == KEYS.session_token


async def test_a_body_over_the_limit_is_refused_before_a_once_grant_is_spent() -> None:
    live = SpyLive(snapshot_policy(grant(1, methods=("POST",), once=True), cred=AWS))
    c = chain(live=live)
    with taddons.context(c.entry):
        flow = agent_flow(c, b"x" * 10)
        flow.request.headers["content-length"] = str(9 * 1024 * 1024)
        await c.requestheaders(flow)
    assert reason(flow) == "body-too-large" and flow.response.status_code == 413
    assert live.consumed == []


async def test_a_failing_signature_denies(monkeypatch: pytest.MonkeyPatch) -> None:
    c = chain()
    with taddons.context(c.entry):
        flow = agent_flow(c, b"Action=SendMessage")
        await c.requestheaders(flow)
        monkeypatch.setattr(signing.Signer, "sign", _boom)
        await c.request(flow)
    assert reason(flow) == "internal-error" and flow.response.status_code == 500


def test_the_held_body_bound_is_installed() -> None:
    from mitmproxy.proxy.layers.http import HttpStream

    signing.install()
    wrapped = HttpStream.state_consume_request_body
    signing.install()
    assert HttpStream.state_consume_request_body is wrapped
    assert "addon.proxy.signing" in installed()


def _boom(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("injected fault")


def test_bodies_held_for_signing_share_one_ceiling_and_give_their_bytes_back() -> None:
    import gc

    from addon.proxy import signing

    budget = signing.Budget()
    budget.ceiling = 100
    assert budget.take(60) and not budget.take(41) and budget.take(40)
    budget.give(100)
    assert budget.held == 0
    before = signing.BUDGET.held
    held = signing._Held(None, None, 10, lambda flow: None)  # type: ignore[arg-type]
    assert signing.BUDGET.take(5)
    held.counted = 5
    del held
    gc.collect()
    assert signing.BUDGET.held == before


async def test_keys_renewed_while_a_body_arrives_are_the_ones_redacted() -> None:
    """The redactor is made when the head is forwarded; a role renewed before the held body
    is whole signs with new keys, and the redactor must look for those."""
    import time

    from botocore.credentials import Credentials

    from addon.redaction.wsredact import REDACTORS
    from addon.schemes.assume import Temporary

    role_cred = replace(AWS, options={**AWS.options, "assume_role": "arn:aws:iam::1:role/r"})
    policy = snapshot_policy(grant(1, methods=("POST",)), cred=role_cred)
    c = Chain(StaticLive(policy), ResolveMap.parse(["api.test=127.0.0.1:9443"]))

    def temporary(n: int) -> Temporary:
        key, secret, token = f"ASIAOLDNEW{n:010d}", f"temp-secret-{n}", f"temp-token-{n}"
        creds = Credentials(key, secret, token)
        return Temporary(creds, time.time() + 3600, (secret.encode(), token.encode()))

    signer = stamp_for(policy, role_cred).signer
    assert signer is not None and signer.role is not None
    signer.role.current = temporary(1)
    with taddons.context(c.entry):
        flow = agent_flow(c, b"Action=SendMessage")
        await c.requestheaders(flow)
        assert flow.request.stream is False  # held: signed in the request hook
        signer.role.current = temporary(2)  # renewed while the body arrived
        await c.request(flow)
    sent = dict((k.lower(), v) for k, v in forwarded(flow)[1])
    assert sent["x-amz-security-token"] == "temp-token-2"
    redacted = REDACTORS[flow].whole(b"echo temp-token-2 temp-secret-2")
    assert b"temp-token-2" not in redacted and b"temp-secret-2" not in redacted
