"""Answers to a grant's MCP requests, filtered to the tools it names (addon/core/mcplist.py).

BodyGate marks a flow whose chosen grant has an MCP rule; Responses then passes its answer
through `whole` (held bodies) or `stream` (streamed ones), after redaction. An answer that
cannot be read with certainty is never passed on as it came: the caller refuses or cuts it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from mitmproxy import http

from addon.core import mcplist
from addon.core.bodies import MAX_DECIDED_BODY
from store.rules.bodyrules import McpRule

# Flows whose answer is filtered, with the rule that says which tools the agent may see.
FILTERS: weakref.WeakKeyDictionary[http.HTTPFlow, McpRule] = weakref.WeakKeyDictionary()
Unfilterable = mcplist.Unfilterable


def _is_sse(response: http.Response) -> bool:
    media = (response.headers.get("content-type") or "").split(";", 1)[0].strip().lower()
    return media == "text/event-stream"


def whole(rule: McpRule, response: http.Response, body: bytes) -> bytes | None:
    """The held answer filtered, or None when nothing changed. Raises Unfilterable."""
    if not body:
        return None
    if _is_sse(response):
        sse = mcplist.SseFilter(rule)
        out = sse.feed(body) + sse.end()
        return None if out == body else out
    if _json_like(response):
        return mcplist.filter_json(rule, body)
    return None  # no JSON-RPC in it: an error page, an empty 202


def stream(rule: McpRule, response: http.Response) -> Callable[[bytes], bytes]:
    """A chunk transform for a streamed answer; b"" ends it. Raises Unfilterable."""
    if _is_sse(response):
        sse = mcplist.SseFilter(rule)
        return lambda chunk: sse.feed(chunk) if chunk else sse.end()
    if not _json_like(response):
        return lambda chunk: chunk
    held = bytearray()

    def json_body(chunk: bytes) -> bytes:
        if chunk:
            held.extend(chunk)
            if len(held) > MAX_DECIDED_BODY:
                raise Unfilterable(f"a JSON answer over {MAX_DECIDED_BODY} bytes")
            return b""
        body = bytes(held)
        held.clear()
        filtered = mcplist.filter_json(rule, body) if body else None
        return body if filtered is None else filtered

    return json_body


def _json_like(response: http.Response) -> bool:
    media = (response.headers.get("content-type") or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")
