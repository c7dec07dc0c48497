"""Bedrock's Converse: the model named by the path, usage read from ConverseStream's frames."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from addon.core.converse import MAX_FRAME, EventStreamReader, bedrock_model
from addon.core.usage import MAX_MODEL, Reading, charge
from tests.e2e.fakeaws import BEDROCK_INPUT, BEDROCK_OUTPUT, USAGE, event

START = event("messageStart", {"role": "assistant"})
DELTA = event("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": "hello"}})
STOP = event("messageStop", {"stopReason": "end_turn"})
METADATA = event("metadata", {"usage": USAGE, "metrics": {"latencyMs": 412}})
STREAM = START + DELTA + DELTA + STOP + METADATA


def _read(*chunks: bytes) -> EventStreamReader:
    reader = EventStreamReader()
    for chunk in chunks:
        reader.feed(chunk)
    return reader


def _counts(reading: Reading) -> tuple[int | None, int | None]:
    return reading.input_tokens, reading.output_tokens


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        pytest.param(
            "/model/anthropic.claude-3-haiku-20240307-v1%3A0/converse",
            "anthropic.claude-3-haiku-20240307-v1:0",
            id="a model id, URL-decoded",
        ),
        pytest.param(
            "/model/us.amazon.nova-pro-v1%3A0/converse-stream",
            "us.amazon.nova-pro-v1:0",
            id="an inference profile, streamed",
        ),
        pytest.param(
            "/model/arn%3Aaws%3Abedrock%3Aus-east-1%3A123456789012%3Aapplication-inference-"
            "profile%2Fa1b2c3/converse",
            "arn:aws:bedrock:us-east-1:123456789012:application-inference-profile/a1b2c3",
            id="an ARN, its slash encoded",
        ),
        pytest.param("/model/m.v1%3A0/invoke", "m.v1:0", id="InvokeModel names it likewise"),
        pytest.param("/model/m/invoke-with-response-stream", "m", id="and its stream"),
        pytest.param("/model/m/count-tokens", None, id="no model call"),
        pytest.param("/model/a/b/converse", None, id="a second segment is no model id"),
        pytest.param("/v1/model/m/converse", None, id="not at the root"),
        pytest.param("/model/%0Aevil%1B/converse", "evil", id="control characters dropped"),
        pytest.param("/model/%FF%FE/converse", "\ufffd\ufffd", id="bytes that are no UTF-8"),
    ],
)
def test_the_model_is_read_from_the_path(path: str, expected: str | None) -> None:
    assert bedrock_model(path) == expected


def test_a_long_model_id_is_bounded_like_other_model_names() -> None:
    found = bedrock_model("/model/" + "%41" * 10_000 + "/converse")
    assert found == "A" * MAX_MODEL


def test_a_stream_is_charged_from_its_metadata_event_input_with_cache() -> None:
    reading = _read(STREAM).finish()
    assert _counts(reading) == (BEDROCK_INPUT, BEDROCK_OUTPUT)
    assert reading.model is None  # named by the path, not the answer


def test_a_stream_split_at_every_byte_boundary_reads_the_same() -> None:
    for at in range(len(STREAM) + 1):
        reader = _read(STREAM[:at], STREAM[at:])
        assert _counts(reader.finish()) == (BEDROCK_INPUT, BEDROCK_OUTPUT), at
        assert reader.size == len(STREAM)
    one_by_one = _read(*(STREAM[i : i + 1] for i in range(len(STREAM))))
    assert _counts(one_by_one.finish()) == (BEDROCK_INPUT, BEDROCK_OUTPUT)


@pytest.mark.parametrize(
    "stream",
    [
        pytest.param(START + DELTA + STOP, id="no metadata event"),
        pytest.param(
            START + event("metadata", {"metrics": {"latencyMs": 1}}), id="metadata without usage"
        ),
        pytest.param(
            START + event("metadata", {"usage": {"inputTokens": -1, "outputTokens": True}}),
            id="counts that are no counts",
        ),
        pytest.param(START + event("metadata", b"{not json"), id="metadata that is not JSON"),
        pytest.param(
            START + event("throttlingException", {"message": "slow down"}, "exception"),
            id="an exception event",
        ),
        pytest.param(
            START + event("contentBlockDelta", {"delta": {"text": '"usage": {"inputTokens": 5}'}}),
            id="usage in the text is not usage",
        ),
        pytest.param(METADATA[:-1], id="cut inside its last frame"),
    ],
)
def test_a_stream_without_usage_is_charged_the_estimate(stream: bytes) -> None:
    reader = _read(stream)
    reading = reader.finish()
    assert _counts(reading) == (None, None)
    cost = charge(reading, request_bytes=400, answer_bytes=reader.size)
    assert (cost.input_tokens, cost.output_tokens, cost.estimated) == (
        100,
        -(-len(stream) // 4),
        True,
    )


def _corrupt(frame: bytes, at: int) -> bytes:
    return frame[:at] + bytes([frame[at] ^ 0x01]) + frame[at + 1 :]


@pytest.mark.parametrize(
    "stream",
    [
        pytest.param(_corrupt(DELTA, len(DELTA) - 10) + METADATA, id="a payload byte flipped"),
        pytest.param(_corrupt(DELTA, 9) + METADATA, id="the prelude's CRC wrong"),
        pytest.param(METADATA[:-4] + b"\0\0\0\0", id="the message CRC wrong"),
        pytest.param(struct.pack(">I", 8) + bytes(8) + METADATA, id="shorter than any frame"),
        pytest.param(b"<html>502 Bad Gateway</html>" + METADATA, id="not an event stream"),
    ],
)
def test_a_malformed_frame_stops_the_reading_and_the_answer_is_estimated(stream: bytes) -> None:
    reader = _read(stream)
    assert _counts(reader.finish()) == (None, None)
    assert len(reader._frame) == 0


def test_a_malformed_frame_after_the_usage_still_means_the_estimate() -> None:
    assert _counts(_read(METADATA + _corrupt(STOP, 20)).finish()) == (None, None)


def test_a_frame_over_the_bound_is_never_held_and_the_answer_is_estimated() -> None:
    big = event("contentBlockDelta", {"delta": {"text": "x" * MAX_FRAME}})
    stream = START + big + METADATA
    reader = EventStreamReader()
    for at in range(0, len(stream), 4096):
        reader.feed(stream[at : at + 4096])
        assert len(reader._frame) <= MAX_FRAME
    assert len(reader._frame) == 0
    assert _counts(reader.finish()) == (None, None)
    assert reader.size == len(stream)


def test_a_frame_just_under_the_bound_is_read() -> None:
    overhead = len(event("contentBlockDelta", {"delta": {"text": ""}}))
    fits = event("contentBlockDelta", {"delta": {"text": "x" * (MAX_FRAME - overhead)}})
    assert len(fits) == MAX_FRAME
    assert _counts(_read(START + fits + METADATA).finish()) == (BEDROCK_INPUT, BEDROCK_OUTPUT)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, len(STREAM) - 1), max_size=8),
    st.binary(max_size=64),
    st.integers(0, len(STREAM)),
)
def test_no_bytes_whatever_raise_or_grow_the_reader_past_one_frame(
    flips: list[int], noise: bytes, at: int
) -> None:
    stream = bytearray(STREAM)
    for i in flips:
        stream[i] ^= 0xFF
    stream[at:at] = noise
    reader = EventStreamReader()
    for i in range(0, len(stream), 13):
        reader.feed(bytes(stream[i : i + 13]))
        assert len(reader._frame) <= MAX_FRAME
    reading = reader.finish()
    assert reading.input_tokens in (None, BEDROCK_INPUT)
