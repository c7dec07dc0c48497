"""MCP answers filtered on the way to the agent: held whole and streamed, JSON and SSE."""

from __future__ import annotations

import json

import pytest
from mitmproxy.test import tutils

from addon.core.bodies import MAX_DECIDED_BODY
from addon.proxy import mcpanswers
from store.rules.bodyrules import McpRule

RULE = McpRule(tools=frozenset({"search"}))
LISTED = {
    "jsonrpc": "2.0",
    "id": 1,
    "result": {"tools": [{"name": "search"}, {"name": "delete_repository"}]},
}


def _response(content_type: str) -> object:
    return tutils.tresp(headers=[(b"content-type", content_type.encode())], content=b"")


def _names(body: bytes) -> list[str]:
    return [t["name"] for t in json.loads(body)["result"]["tools"]]


def test_a_held_json_answer_keeps_only_the_granted_tools():
    body = json.dumps(LISTED).encode()
    assert _names(mcpanswers.whole(RULE, _response("application/json"), body)) == ["search"]


def test_a_streamed_json_answer_is_held_to_its_end_then_filtered():
    stream = mcpanswers.stream(RULE, _response("application/json; charset=utf-8"))
    body = json.dumps(LISTED).encode()
    out = b"".join(stream(body[i : i + 7]) for i in range(0, len(body), 7)) + stream(b"")
    assert _names(out) == ["search"]


def test_a_streamed_json_answer_past_the_bound_is_unfilterable():
    stream = mcpanswers.stream(RULE, _response("application/json"))
    with pytest.raises(mcpanswers.Unfilterable):
        stream(b" " * (MAX_DECIDED_BODY + 1))


def test_a_streamed_sse_answer_is_filtered_event_by_event():
    stream = mcpanswers.stream(RULE, _response("text/event-stream"))
    event = b"event: message\ndata: " + json.dumps(LISTED).encode() + b"\n\n"
    out = b"".join(stream(event[i : i + 5]) for i in range(0, len(event), 5)) + stream(b"")
    assert out.startswith(b"event: message\ndata: ")
    assert _names(out.split(b"data: ", 1)[1].strip()) == ["search"]


def test_an_answer_that_is_not_strict_json_is_unfilterable():
    duplicate = b'{"jsonrpc":"2.0","id":1,"result":{"tools":[]},"result":{"tools":[]}}'
    with pytest.raises(mcpanswers.Unfilterable):
        mcpanswers.whole(RULE, _response("application/json"), duplicate)


def test_other_answers_pass_as_they_came():
    assert mcpanswers.whole(RULE, _response("text/html"), b"<p>hi</p>") is None
    assert mcpanswers.stream(RULE, _response("text/plain"))(b"as is") == b"as is"
