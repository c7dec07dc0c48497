"""Responses (addon/proxy/responses.py): an echoed secret is redacted from the body whatever its
Content-Encoding headers say, from trailers and from the reason phrase; what cannot be decoded is
killed."""

from __future__ import annotations

import gzip
from typing import Any

from mitmproxy import http
from mitmproxy.test import taddons

from tests.fakes import (
    LONG_CRED,
    LONG_SECRET,
    Chain,
    StaticLive,
    grant,
    https_flow,
    make_addon,
    snapshot_policy,
)


async def allowed_flow(addon: Chain) -> Any:
    flow = https_flow(addon)
    await addon.requestheaders(flow)
    assert flow.response is None
    return flow


def give_response(flow: Any, fields: list[tuple[bytes, bytes]], body: bytes) -> None:
    flow.response = http.Response.make(200, b"")
    flow.response.headers.fields = (*fields, (b"content-length", str(len(body)).encode()))
    flow.response.raw_content = body


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


async def test_a_response_in_an_encoding_that_cannot_be_decoded_is_killed() -> None:
    addon = make_addon(StaticLive(snapshot_policy(grant(1), cred=LONG_CRED)))
    with taddons.context(addon):
        flow = await allowed_flow(addon)
        body = gzip.compress(gzip.compress(b"Bearer " + LONG_SECRET))
        give_response(flow, [(b"content-encoding", b"gzip, gzip")], body)
        addon.responseheaders(flow)
    assert flow.error is not None and flow.error.msg == "Connection killed."


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


async def test_an_echoed_secret_in_a_response_header_is_redacted() -> None:
    addon = make_addon(StaticLive(snapshot_policy(grant(1), cred=LONG_CRED)))
    with taddons.context(addon):
        flow = await allowed_flow(addon)
        give_response(flow, [(b"x-echo", b"Bearer " + LONG_SECRET)], b"{}")
        addon.responseheaders(flow)
        addon.response(flow)
    values = [value for _, value in flow.response.headers.fields]
    assert not any(LONG_SECRET in value for value in values), "the secret reached a header"
    assert b"Bearer [REDACTED]" in values


def test_a_streamed_answer_holding_minted_keys_is_cut_even_across_chunks() -> None:
    """A credential-issuing service's answer (STS, IAM, ...) is cut where a key field shows,
    however the upstream splits it; what came before it is all the agent gets."""
    from addon.proxy import responses
    from addon.proxy.state import Record
    from addon.redaction.redact import Redactor

    rec = Record(start=0.0, request_id="r", client="")
    rec.minting = True
    stream = responses._response_stream(rec, Redactor((b"real-secret-key",)), None)
    stream(b"<Credentials><AccessKeyId>ASIA</AccessKeyId><Secret")
    out = stream(b"AccessKey>temp/abc</SecretAccessKey>")
    assert out == []
    assert rec.failure is responses.MINTED
    assert stream(b"<SessionToken>tok</SessionToken>") == []
