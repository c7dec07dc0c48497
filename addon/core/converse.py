"""Bedrock Runtime: the model a request names in its path, usage read from ConverseStream.

Converse and InvokeModel name their model only in the path (`POST /model/{modelId}/converse`).
Converse answers JSON, which addon/core/usage.py reads; ConverseStream (`/converse-stream`)
answers AWS event-stream frames, whose `metadata` event carries `usage`. Frames are decoded
by botocore's own EventStreamBuffer, one at a time, and one at most MAX_FRAME bytes long is
held: past that, or at a frame botocore refuses, the answer is no longer read and is charged
the estimate.
"""

from __future__ import annotations

import functools
import json
import re
import struct
from typing import Any
from urllib.parse import unquote

from addon.core.usage import MAX_MODEL, Reading, counts, model_name

MAX_FRAME = 64 * 1024  # an event larger than this is not held: the answer is estimated
_PRELUDE = 12  # total length, headers length, prelude CRC
_SMALLEST = _PRELUDE + 4  # and the message CRC
# The modelId: a model, an inference profile or an ARN, percent-encoded as one segment.
_CONVERSE = re.compile(
    r"/model/([^/]+)/(?:converse|converse-stream|invoke|invoke-with-response-stream)"
)


def bedrock_model(path: str) -> str | None:
    """The model a Converse or InvokeModel request (streamed or not) names in its path, or None."""
    found = _CONVERSE.fullmatch(path)
    if found is None:
        return None
    # Each %XX stands for one character at most: this much text holds MAX_MODEL of them.
    return model_name(unquote(found.group(1)[: MAX_MODEL * 3], errors="replace"))


@functools.cache
def _eventstream() -> tuple[Any, type[Exception]]:
    """botocore's EventStreamBuffer and ParserError, imported at the first Bedrock stream read
    for usage (botocore is not imported at start: addon/schemes/awssdk.py)."""
    from botocore.eventstream import EventStreamBuffer, ParserError

    return EventStreamBuffer, ParserError


class EventStreamReader:
    """Fed a ConverseStream answer's bytes as they pass; holds one frame at most."""

    def __init__(self) -> None:
        self.reading = Reading()
        self.size = 0
        self._frame = bytearray()
        self._length = 0  # of the frame being gathered, once its prelude is in
        self._spoiled = False

    def feed(self, chunk: bytes) -> None:
        self.size += len(chunk)
        rest = memoryview(chunk)
        while rest and not self._spoiled:
            if not self._length:
                taken = _PRELUDE - len(self._frame)
                self._frame += rest[:taken]
                rest = rest[taken:]
                if len(self._frame) < _PRELUDE:
                    return
                length = int.from_bytes(self._frame[:4], "big")
                if not _SMALLEST <= length <= MAX_FRAME:
                    self._spoil()
                    return
                self._length = length
            taken = self._length - len(self._frame)
            self._frame += rest[:taken]
            rest = rest[taken:]
            if len(self._frame) == self._length:
                frame = bytes(self._frame)
                self._frame.clear()
                self._length = 0
                self._read(frame)

    def finish(self) -> Reading:
        return self.reading

    def _read(self, frame: bytes) -> None:
        buffer, parser_error = _eventstream()
        decoder = buffer()
        decoder.add_data(frame)
        try:
            message = next(decoder)
        except (parser_error, StopIteration, struct.error, LookupError, ValueError):
            self._spoil()  # a bad CRC or header: nothing after it can be trusted
            return
        headers = message.headers
        if headers.get(":message-type") != "event" or headers.get(":event-type") != "metadata":
            return  # content, or an exception event: no usage
        try:
            payload = json.loads(message.payload)
        except ValueError:
            return
        if isinstance(payload, dict):
            self.reading.merge(Reading(None, *counts(payload.get("usage"))))

    def _spoil(self) -> None:
        self._spoiled = True
        self._frame = bytearray()
        self._length = 0
        self.reading = Reading()
