"""Response redaction: headers, body, trailers and WebSocket messages of a stamped request.

A response of known length up to BUFFER_LIMIT is held whole and redacted in one piece;
anything longer, chunked or compressed is streamed, decoded and redacted chunk by chunk and
re-framed. What cannot be decoded or redacted kills the flow: never passed on unread.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from mitmproxy import http

from addon.core.reasons import Reason
from addon.mitm import hop, wire
from addon.observe import audit
from addon.observe.problem import problem
from addon.proxy import mcpanswers
from addon.proxy.failclosed import kill_on_error
from addon.proxy.state import Record, record
from addon.redaction import wsredact
from addon.redaction.redact import Decoder, Redactor

BUFFER_LIMIT = 64 * 1024
# Fields of AWS answers that hold keys (STS, IAM, Cognito and SSO spell them each their way).
MINTED_KEYS = re.compile(rb"secret_?access_?key|session_?token|[\"<]secret_?key[\">]", re.I)
MINTED = wire.Failure(Reason.CREDENTIALS_IN_RESPONSE, "minted-credentials")
# An answer to a grant's MCP requests that cannot be read with certainty, so not filtered.
UNFILTERABLE = wire.Failure(Reason.UPSTREAM_PROTOCOL_ERROR, "unfilterable-mcp-answer")


class Responses:
    @kill_on_error
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        rec = record(flow)
        response = flow.response
        if rec is None or not rec.allowed or response is None:
            return
        hop.for_agent(response)
        redactor = wsredact.REDACTORS.get(flow)
        mcp = mcpanswers.FILTERS.get(flow)
        rewrites = redactor is not None or mcp is not None
        if response.status_code == 101 and "sec-websocket-extensions" in response.headers:
            # The request went without it: no permessage-deflate, whatever the upstream says.
            response.headers.pop("sec-websocket-extensions")
        fields = response.headers.fields
        if wire.foreign_coding(fields):
            # addon.wire refuses these first (a 502 problem); never pass one undecoded.
            rec.failure = wire.Failure(Reason.UPSTREAM_PROTOCOL_ERROR, "bad-transfer-coding")
            flow.kill()
            return
        lengths = [v for n, v in fields if n.lower() == b"content-length"]
        # Every Content-Encoding field and list item: a second header must not hide gzip.
        codings = [
            coding.strip().lower()
            for n, v in fields
            if n.lower() == b"content-encoding"
            for coding in v.split(b",")
        ]
        codings = [c for c in codings if c not in (b"", b"identity")]
        encoding = b", ".join(codings)
        drop = set()
        decoder = None
        if flow.request.method == "HEAD" or response.status_code in (204, 304):
            # No body follows, whatever Content-Length announces: keep the head as it is.
            rec.buffered = True
        elif rewrites and encoding:
            # Compressed anyway, despite Accept-Encoding: identity. Decode so redaction (and
            # the MCP filter) sees the plaintext; an encoding we cannot decode kills the flow.
            decoder = Decoder(encoding.decode("latin-1"))
            drop.add(b"content-encoding")
        elif len(lengths) == 1 and lengths[0].isdigit() and int(lengths[0]) <= BUFFER_LIMIT:
            # Small and of known length: mitmproxy holds it whole, `response` redacts it, and
            # it goes out as one write, as it would through bare mitmproxy.
            rec.buffered = True
        if rewrites:
            if not rec.buffered and (decoder is not None or lengths):
                # Redaction may change the length: re-frame instead of sending a wrong one.
                drop.update((b"content-length", b"transfer-encoding"))
            if drop:
                fields = tuple(f for f in fields if f[0].lower() not in drop)
            if redactor is not None:
                fields = redactor.headers(fields)
                if response.data.reason:  # the HTTP/1 reason phrase, sent with the headers
                    response.data.reason = redactor.whole(response.data.reason)
            if b"content-length" in drop and _chunked(flow.request):
                fields += ((b"transfer-encoding", b"chunked"),)
            response.headers.fields = fields
        if not rec.buffered:
            tools = mcpanswers.stream(mcp, response) if mcp is not None else None
            response.stream = _response_stream(rec, redactor, decoder, tools)
            rec.streamed = True

    @kill_on_error
    def response(self, flow: http.HTTPFlow) -> None:
        rec = record(flow)
        response = flow.response
        if rec is None or response is None:
            return
        redactor = wsredact.REDACTORS.get(flow)
        if rec.buffered:
            body = response.raw_content or b""
            rec.bytes_in = len(body)
            if rec.minting and MINTED_KEYS.search(body):
                rec.failure, rec.replaced = MINTED, True
                refused = problem(Reason.CREDENTIALS_IN_RESPONSE, MINTED.detail, request_id=flow.id)
                flow.response = refused.response()
                return
            if redactor is not None and body:
                redacted = redactor.whole(body)
                if redacted != body:
                    response.raw_content = redacted
                    response.headers["content-length"] = str(len(redacted))
            mcp = mcpanswers.FILTERS.get(flow)
            if mcp is not None:
                try:
                    listed = mcpanswers.whole(mcp, response, response.raw_content or b"")
                except mcpanswers.Unfilterable:
                    rec.failure, rec.replaced = UNFILTERABLE, True
                    refused = problem(
                        UNFILTERABLE.reason or Reason.UPSTREAM_PROTOCOL_ERROR,
                        UNFILTERABLE.detail,
                        request_id=flow.id,
                    )
                    flow.response = refused.response()
                    return
                if listed is not None:
                    response.raw_content = listed
                    response.headers["content-length"] = str(len(listed))
        if rec.failure is not None and not rec.buffered:
            # A streamed body that could not be decoded or redacted: cut, never completed.
            flow.kill()
            return
        if redactor is not None and response.trailers is not None:
            # mitmproxy sends the trailers (h2, e.g. grpc-message) after this hook returns.
            if rec.buffered:
                body = response.raw_content or b""
                redactor.flushed = body[len(body) - redactor.partial(body) :]
            response.trailers.fields = redactor.trailers(response.trailers.fields)
        rec.redactions = redactor.count if redactor is not None else 0

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        try:
            wsredact.on_message(flow)
        except Exception as e:  # noqa: BLE001 - fail closed: the message is dropped, the flow dies
            audit.logger().error(
                "hook.failed", hook="websocket_message", error_type=type(e).__name__
            )
            wsredact.kill(flow)


def _response_stream(
    rec: Record,
    redactor: Redactor | None,
    decoder: Decoder | None,
    tools: Callable[[bytes], bytes] | None = None,
) -> Callable[[bytes], bytes | list[bytes]]:
    def decoded(chunk: bytes) -> bytes:
        if decoder is None:
            return chunk
        if chunk:
            return decoder.feed(chunk)
        return decoder.feed(b"")

    def redacted(chunk: bytes) -> bytes:
        if redactor is None:
            return decoded(chunk)
        if decoder is None:
            return redactor.feed(chunk)
        if chunk:
            plain = decoder.feed(chunk)
            return redactor.feed(plain) if plain else b""
        rest = decoder.feed(b"")
        return (redactor.feed(rest) if rest else b"") + redactor.feed(b"")

    def rewritten(chunk: bytes) -> bytes:
        out = redacted(chunk)
        if tools is None:
            return out
        if chunk:
            return tools(out) if out else b""
        return (tools(out) if out else b"") + tools(b"")

    seen = b""

    def stream(chunk: bytes) -> bytes | list[bytes]:
        nonlocal seen
        rec.bytes_in += len(chunk)
        if redactor is None and tools is None:
            return chunk
        if rec.failure is not None:
            return []  # the flow dies in `response`; nothing more reaches the agent
        try:
            out = rewritten(chunk)
        except Exception as e:  # noqa: BLE001 - fail closed: the rest is dropped, the flow killed
            audit.logger().error("hook.failed", hook="response_stream", error_type=type(e).__name__)
            rec.failure = wire.Failure(Reason.UPSTREAM_PROTOCOL_ERROR, "undecodable-body")
            return []
        if rec.minting:
            # Decoded text, with the tail of the last piece: a field name split over two
            # chunks is found too.
            seen = seen[-32:] + out
            if MINTED_KEYS.search(seen):
                rec.failure = MINTED
                return []
        # b"" mid-stream would end a chunked HTTP/1 response: send nothing instead.
        return out if out or not chunk else []

    return stream


def _chunked(request: http.Request) -> bool:
    """May the response to this request be re-framed with chunked encoding?"""
    return not request.is_http2 and request.http_version == "HTTP/1.1"
