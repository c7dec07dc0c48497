"""Usage read from model answers: JSON and SSE, OpenAI's and Anthropic's shapes, bounded."""

from __future__ import annotations

import json

import pytest

from addon.core.usage import HEAD, TAIL, Reading, UsageReader, charge


def _sse(*events: dict[str, object], done: bool = False) -> bytes:
    out = b"".join(
        (f"event: {e['type']}\n" if "type" in e else "").encode()
        + b"data: "
        + json.dumps(e).encode()
        + b"\n\n"
        for e in events
    )
    return out + (b"data: [DONE]\n\n" if done else b"")


OPENAI_JSON = json.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "gpt-4o-mini",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15},
    }
).encode()
ANTHROPIC_JSON = json.dumps(
    {
        "id": "msg_1",
        "type": "message",
        "model": "claude-sonnet-4-5",
        "content": [{"type": "text", "text": "hi"}],
        "usage": {
            "input_tokens": 20,
            "cache_creation_input_tokens": 5,
            "cache_read_input_tokens": 7,
            "output_tokens": 9,
        },
    }
).encode()
CONVERSE_JSON = json.dumps(
    {
        "output": {"message": {"role": "assistant", "content": [{"text": "hi"}]}},
        "stopReason": "end_turn",
        "usage": {
            "inputTokens": 20,
            "outputTokens": 9,
            "totalTokens": 41,
            "cacheReadInputTokens": 7,
            "cacheWriteInputTokens": 5,
        },
        "metrics": {"latencyMs": 120},
    }
).encode()
OPENAI_STREAM = _sse(
    {"model": "gpt-4o-mini", "choices": [{"delta": {"content": "h"}}], "usage": None},
    {"model": "gpt-4o-mini", "choices": [{"delta": {"content": "i"}}], "usage": None},
    {"model": "gpt-4o-mini", "choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 2}},
    done=True,
)
ANTHROPIC_STREAM = _sse(
    {
        "type": "message_start",
        "message": {"model": "claude-haiku-4-5", "usage": {"input_tokens": 40, "output_tokens": 1}},
    },
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "x"}},
    {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 15}},
    {"type": "message_stop"},
)
RESPONSES_STREAM = _sse(
    {"type": "response.output_text.delta", "delta": "x"},
    {
        "type": "response.completed",
        "response": {"model": "gpt-5", "usage": {"input_tokens": 8, "output_tokens": 4}},
    },
)


def _read(body: bytes, sse: bool, piece: int = 7) -> Reading:
    reader = UsageReader(sse)
    for at in range(0, len(body), piece):
        reader.feed(body[at : at + piece])
    return reader.finish()


@pytest.mark.parametrize(
    ("body", "sse", "expected"),
    [
        pytest.param(OPENAI_JSON, False, ("gpt-4o-mini", 12, 3), id="OpenAI chat completion JSON"),
        pytest.param(
            ANTHROPIC_JSON, False, ("claude-sonnet-4-5", 32, 9), id="Anthropic message, cache in"
        ),
        pytest.param(
            CONVERSE_JSON, False, (None, 32, 9), id="Bedrock Converse, cache in, model by path"
        ),
        pytest.param(OPENAI_STREAM, True, ("gpt-4o-mini", 30, 2), id="OpenAI stream, usage chunk"),
        pytest.param(
            ANTHROPIC_STREAM, True, ("claude-haiku-4-5", 40, 15), id="Anthropic stream, delta wins"
        ),
        pytest.param(RESPONSES_STREAM, True, ("gpt-5", 8, 4), id="OpenAI responses stream"),
        pytest.param(
            OPENAI_STREAM.replace(b"\n", b"\r\n"), True, ("gpt-4o-mini", 30, 2), id="CRLF lines"
        ),
        pytest.param(
            _sse({"model": "m", "choices": []}, done=True), True, ("m", None, None), id="no usage"
        ),
        pytest.param(b"<html>502</html>", False, (None, None, None), id="not JSON"),
        pytest.param(
            json.dumps({"usage": {"prompt_tokens": True, "completion_tokens": -1}}).encode(),
            False,
            (None, None, None),
            id="counts that are no counts are not believed",
        ),
    ],
)
def test_usage_is_read_whatever_the_chunking(body: bytes, sse: bool, expected: tuple) -> None:
    for piece in (1, 7, 4096):
        reading = _read(body, sse, piece)
        assert (reading.model, reading.input_tokens, reading.output_tokens) == expected


def test_a_long_json_answer_is_read_from_its_head_and_tail() -> None:
    content = "x" * (5 * (HEAD + TAIL))
    body = json.dumps(
        {
            "model": "gpt-4o",
            "choices": [{"message": {"content": content + '"usage": {"prompt_tokens": 999}'}}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 70000},
        }
    ).encode()
    reader = UsageReader(sse=False)
    reader.feed(body)
    assert (reader.finish().input_tokens, reader.finish().output_tokens) == (7, 70000)
    assert len(reader._text.head) <= HEAD and len(reader._text.tail) <= TAIL


def test_a_huge_sse_line_is_bounded_and_the_stream_still_read() -> None:
    huge = (
        b"data: " + b'{"choices":[{"delta":{"content":"' + b"y" * (4 * (HEAD + TAIL)) + b'"}}]}\n'
    )
    body = huge + OPENAI_STREAM
    reader = UsageReader(sse=True)
    for at in range(0, len(body), 65536):
        reader.feed(body[at : at + 65536])
        assert len(reader._line.head) <= HEAD and len(reader._line.tail) <= TAIL
    assert reader.finish().input_tokens == 30


def test_text_that_mentions_usage_inside_a_string_is_not_read_as_usage() -> None:
    body = _sse({"choices": [{"delta": {"content": '"usage": {"prompt_tokens": 5}'}}]})
    assert _read(body, True).input_tokens is None


@pytest.mark.parametrize(
    ("reading", "expected"),
    [
        pytest.param(Reading("m", 10, 5), (10, 5, False), id="reported: charged as reported"),
        pytest.param(Reading(None, None, None), (25, 3, True), id="none: both sides estimated"),
        pytest.param(Reading("m", 10, None), (10, 3, True), id="a cut stream: input kept"),
    ],
)
def test_the_charge_estimates_only_what_was_not_reported(reading: Reading, expected: tuple) -> None:
    cost = charge(reading, request_bytes=100, answer_bytes=9)
    assert (cost.input_tokens, cost.output_tokens, cost.estimated) == expected
