"""MCP tools/list answers filtered to the granted tools, as JSON and as an SSE stream."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from addon.core.mcplist import EventTooLarge, SseFilter, Unfilterable, filter_json
from store.rules.bodyrules import McpRule, parse

RULE = parse("mcp", {"tools": ["search", "read_file"]}).mcp
assert RULE is not None
SEARCH = {"name": "search", "description": "Sucht \u00fcberall", "inputSchema": {"type": "object"}}
DROP = {"name": "drop_repo", "description": "gone", "inputSchema": {"type": "object"}}


def listing(*tools: Any, id_: int = 1, cursor: str | None = None) -> dict[str, Any]:
    result: dict[str, Any] = {"tools": list(tools)}
    if cursor is not None:
        result["nextCursor"] = cursor
    return {"jsonrpc": "2.0", "id": id_, "result": result}


def j(value: Any) -> bytes:
    return json.dumps(value).encode()


def compact(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


# JSON answers


def test_ungranted_tools_are_removed_and_the_rest_kept() -> None:
    found = filter_json(RULE, j(listing(SEARCH, DROP, cursor="c2")))
    assert found is not None
    assert json.loads(found) == listing(SEARCH, cursor="c2")


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(j(listing(SEARCH)), id="every tool granted"),
        pytest.param(j(listing()), id="no tools"),
        pytest.param(j({"jsonrpc": "2.0", "id": 1, "result": {}}), id="another result"),
        pytest.param(j({"jsonrpc": "2.0", "id": 1, "error": {"code": 1}}), id="an error"),
        pytest.param(j({"jsonrpc": "2.0", "id": 1, "result": {"tools": "x"}}), id="tools no list"),
        pytest.param(j([listing(SEARCH), {"jsonrpc": "2.0", "id": 2, "result": {}}]), id="batch"),
    ],
)
def test_nothing_to_remove_is_none(body: bytes) -> None:
    assert filter_json(RULE, body) is None


def test_a_batch_is_filtered_message_by_message() -> None:
    found = filter_json(RULE, j([listing(DROP, id_=1), listing(SEARCH, DROP, id_=2)]))
    assert found is not None
    assert json.loads(found) == [listing(id_=1), listing(SEARCH, id_=2)]


def test_tools_without_a_granted_name_are_removed() -> None:
    odd = [SEARCH, "search", {"name": ["search"]}, {"title": "search"}, {"name": "Search"}]
    found = filter_json(RULE, j(listing(*odd)))
    assert found is not None
    assert json.loads(found) == listing(SEARCH)


def test_a_lone_surrogate_stays_escaped() -> None:
    found = filter_json(RULE, b'{"jsonrpc":"2.0","id":1,"result":{"tools":[],"x":"\\ud800"}}')
    assert found is None
    found = filter_json(
        RULE, b'{"jsonrpc":"2.0","id":1,"result":{"tools":[{"name":"drop"}],"x":"\\ud800"}}'
    )
    assert found is not None and b"\\ud800" in found
    assert json.loads(found)["result"] == {"tools": [], "x": "\ud800"}


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"not json", id="not JSON"),
        pytest.param(j(listing(DROP)).decode().encode("utf-16"), id="UTF-16"),
        pytest.param(b"\xef\xbb\xbf" + j(listing(DROP)), id="a BOM"),
        pytest.param(
            b'{"jsonrpc":"2.0","id":1,"result":{"tools":[],"tools":[{"name":"drop"}]}}',
            id="duplicate keys",
        ),
        pytest.param(b'{"jsonrpc":"2.0","id":NaN,"result":{"tools":[]}}', id="NaN"),
        pytest.param(
            b'{"jsonrpc":"2.0","id":1e400,"result":{"tools":[]}}', id="an infinite number"
        ),
        pytest.param(b"[" * 100_000 + b"]" * 100_000, id="nested too deeply"),
    ],
)
def test_what_cannot_be_read_strictly_is_unfilterable(body: bytes) -> None:
    with pytest.raises(Unfilterable):
        filter_json(RULE, body)


# SSE answers


def sse(filter_: SseFilter, *chunks: bytes) -> bytes:
    return b"".join(filter_.feed(c) for c in chunks) + filter_.end()


def event(data: bytes, eol: bytes = b"\n", extra: bytes = b"") -> bytes:
    return extra + b"data: " + data + eol + eol


KEPT = event(compact(listing(SEARCH, id_=3)))
STREAM = b"".join(
    [
        b": keep-alive\r\n\r\n",
        b"event: message\nid: 41\ndata: " + j(listing(SEARCH, DROP)) + b"\nretry: 10\n\n",
        event(j({"jsonrpc": "2.0", "method": "notifications/progress", "params": {}})),
        b"id: 42\r\ndata: " + j(listing(DROP, id_=2))[:18] + b"\r\n",
        b"data:" + j(listing(DROP, id_=2))[18:] + b"\r\n\r\n",
        b"data: " + j(listing(SEARCH, DROP, id_=3)) + b"\r\r",
        b"event: endpoint\ndata: /messages?sessionId=abc\n\n",
    ]
)
EXPECTED = b"".join(
    [
        b": keep-alive\r\n\r\n",
        b"event: message\nid: 41\ndata: " + compact(listing(SEARCH)) + b"\nretry: 10\n\n",
        event(j({"jsonrpc": "2.0", "method": "notifications/progress", "params": {}})),
        b"id: 42\r\ndata: " + compact(listing(id_=2)) + b"\r\n\r\n",
        b"data: " + compact(listing(SEARCH, id_=3)) + b"\r\r",
        b"event: endpoint\ndata: /messages?sessionId=abc\n\n",
    ]
)


def test_an_sse_stream_is_filtered_event_by_event() -> None:
    assert sse(SseFilter(RULE), STREAM) == EXPECTED


def test_each_event_is_forwarded_once_complete() -> None:
    filter_ = SseFilter(RULE)
    first = b": keep-alive\r\n\r\n"
    assert filter_.feed(first + b"data: {") == first
    assert filter_.feed(b'"x": 1}\n') == b""
    assert filter_.feed(b"\n") == b'data: {"x": 1}\n\n'


def test_events_without_tools_pass_byte_for_byte() -> None:
    untouched = STREAM.replace(b"drop_repo", b"read_file")
    assert sse(SseFilter(RULE), untouched) == untouched


@pytest.mark.parametrize("at", range(len(STREAM) + 1))
def test_a_split_at_any_byte_changes_nothing(at: int) -> None:
    assert sse(SseFilter(RULE), STREAM[:at], STREAM[at:]) == EXPECTED


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(STREAM)), max_size=30))
def test_any_chunking_changes_nothing(cuts: list[int]) -> None:
    points = [0, *sorted(cuts), len(STREAM)]
    chunks = [STREAM[a:b] for a, b in zip(points, points[1:], strict=False)]
    assert sse(SseFilter(RULE), *chunks) == EXPECTED


def test_an_empty_chunk_between_a_cr_and_its_lf_changes_nothing() -> None:
    # Hypothesis' cuts may repeat a point: an empty chunk. It must not forget the CR.
    # The cut falls in the CR LF that ends the first of an event's two data lines.
    cut = STREAM.index(b"\r\n", STREAM.index(b"id: 42") + 8) + 1
    assert sse(SseFilter(RULE), STREAM[:cut], b"", STREAM[cut:]) == EXPECTED
    assert SseFilter(RULE).feed(b"") == b""


def test_a_cr_at_a_chunk_end_is_one_line_end_with_the_lf_after_it() -> None:
    body = j(listing(SEARCH, DROP))
    assert sse(SseFilter(RULE), b"data: " + body + b"\r", b"\n\r", b"\n") == (
        b"data: " + compact(listing(SEARCH)) + b"\r\n\r\n"
    )
    # Had the CR and LF been read as two line ends, the event would have ended early.
    assert sse(SseFilter(RULE), b"id: 1\r", b"\ndata: " + body + b"\r\n\r\n") == (
        b"id: 1\r\ndata: " + compact(listing(SEARCH)) + b"\r\n\r\n"
    )


def test_a_bom_first_in_the_stream_is_not_part_of_the_field_name() -> None:
    body = j(listing(SEARCH, DROP))
    assert sse(SseFilter(RULE), b"\xef\xbb", b"\xbfdata: " + body + b"\n\n") == (
        b"\xef\xbb\xbfdata: " + compact(listing(SEARCH)) + b"\n\n"
    )
    # Later, a client reads it as part of an unknown field's name: nothing to filter.
    later = b"\n\xef\xbb\xbfdata: " + body + b"\n\n"
    assert sse(SseFilter(RULE), later) == later


def test_multi_line_data_is_joined_then_rewritten_on_one_line() -> None:
    text = json.dumps(listing(SEARCH, DROP), indent=1).encode()
    stream = b"event: message\n" + b"".join(b"data: " + line + b"\n" for line in text.split(b"\n"))
    assert sse(SseFilter(RULE), stream + b"\n") == (
        b"event: message\ndata: " + compact(listing(SEARCH)) + b"\n\n"
    )


def test_an_unfinished_event_is_filtered_at_the_end() -> None:
    body = j(listing(SEARCH, DROP))
    filter_ = SseFilter(RULE)
    assert filter_.feed(b"data: " + body) == b""
    assert filter_.end() == b"data: " + compact(listing(SEARCH))


def test_an_event_over_the_limit_is_refused() -> None:
    filter_ = SseFilter(RULE, limit=100)
    assert filter_.feed(b"data: " + b"x" * 50 + b"\n\n") == b"data: " + b"x" * 50 + b"\n\n"
    filter_.feed(b"data: " + b"x" * 40 + b"\n")
    with pytest.raises(EventTooLarge):
        filter_.feed(b"data: " + b"x" * 60)


def test_a_line_over_the_limit_is_refused_before_it_ends() -> None:
    filter_ = SseFilter(RULE, limit=100)
    filter_.feed(b"data: " + b"x" * 90)
    with pytest.raises(EventTooLarge):
        filter_.feed(b"x" * 10)


def test_json_data_that_is_not_strict_is_unfilterable() -> None:
    data = b'{"jsonrpc":"2.0","id":1,"result":{"tools":[],"tools":[{"name":"drop"}]}}'
    with pytest.raises(Unfilterable):
        SseFilter(RULE).feed(b"data: " + data + b"\n\n")


def test_an_empty_rule_shows_no_tools() -> None:
    found = filter_json(McpRule(), j(listing(SEARCH, DROP)))
    assert found is not None and json.loads(found) == listing()
