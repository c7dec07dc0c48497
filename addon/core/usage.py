"""Token usage read from a model API's answer as it passes, in bounded memory.

Reads what the providers report themselves: OpenAI-compatible chat/completions and responses
(`usage.prompt_tokens` / `completion_tokens`, `input_tokens` / `output_tokens`; in a stream,
the chunk that carries `usage`, e.g. with `stream_options.include_usage`, or the
`response.completed` event), Anthropic messages (`usage.input_tokens`, its cache fields,
`output_tokens`; in a stream, `message_start` and the cumulative `message_delta`) and Bedrock's
Converse JSON (`usage.inputTokens`, its cache fields, `outputTokens`; its event stream is read
by addon/core/converse.py). The answer itself is never held: a JSON body keeps its first HEAD
and last TAIL bytes, an SSE stream one line of at most the same. What the answer does not say
is estimated from bytes (`estimate`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Protocol

HEAD = 16 * 1024  # of a JSON text: where `model` is
TAIL = 64 * 1024  # of a JSON text: where `usage` is, after the content
BYTES_PER_TOKEN = 4  # the estimate of an answer without usage: one token per 4 bytes
MAX_COUNT = 10**12  # a reported count above this is not believed
# Characters of a model's name kept for the audit line: Bedrock's inference-profile ARNs run
# past 100.
MAX_MODEL = 256
_INPUT = ("prompt_tokens", "input_tokens", "inputTokens")  # OpenAI's, Anthropic's, Bedrock's
_OUTPUT = ("completion_tokens", "output_tokens", "outputTokens")
# Cached input, counted beside the input count (Anthropic's, then Bedrock's)
_CACHE_FIELDS = (
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
    "cacheReadInputTokens",
    "cacheWriteInputTokens",
)


@dataclass(slots=True)
class Reading:
    """What the answer reported; None where it said nothing."""

    model: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None

    def merge(self, other: Reading) -> None:
        """A later event's counts replace earlier ones: Anthropic's are cumulative."""
        self.model = self.model or other.model
        if other.input_tokens is not None:
            self.input_tokens = other.input_tokens
        if other.output_tokens is not None:
            self.output_tokens = other.output_tokens


@dataclass(frozen=True, slots=True)
class Charge:
    model: str | None
    input_tokens: int
    output_tokens: int
    estimated: bool  # some count was not reported and was estimated from bytes


class Reader(Protocol):
    """Fed an answer's bytes as they pass; `size` of them so far."""

    size: int

    def feed(self, chunk: bytes) -> None: ...

    def finish(self) -> Reading: ...


def estimate(size: int) -> int:
    return math.ceil(size / BYTES_PER_TOKEN)


def charge(
    reading: Reading, request_bytes: int, answer_bytes: int, complete: bool = True
) -> Charge:
    """What one answer costs: the counts it reported, and for each it left out, the bytes
    of its side (the request's body for input, the answer's for output) by BYTES_PER_TOKEN.
    An answer cut short is charged at least the estimate of the output that did pass: a
    stream's early count (Anthropic's message_start) says nothing of what followed."""
    given = estimate(request_bytes) if reading.input_tokens is None else reading.input_tokens
    taken = estimate(answer_bytes) if reading.output_tokens is None else reading.output_tokens
    if not complete:
        taken = max(taken, estimate(answer_bytes))
    estimated = not complete or reading.input_tokens is None or reading.output_tokens is None
    return Charge(reading.model, given, taken, estimated)


class _Text:
    """A JSON text seen in pieces: whole up to HEAD + TAIL bytes, else its head and tail."""

    __slots__ = ("head", "size", "tail")

    def __init__(self) -> None:
        self.head = bytearray()
        self.tail = bytearray()
        self.size = 0

    def feed(self, piece: bytes) -> None:
        self.size += len(piece)
        room = HEAD - len(self.head)
        if room > 0:
            self.head += piece[:room]
            piece = piece[room:]
        if piece:
            self.tail += piece
            if len(self.tail) > TAIL:
                del self.tail[: len(self.tail) - TAIL]

    def read(self) -> Reading:
        if self.size <= HEAD + TAIL:
            try:
                return _from_object(json.loads(bytes(self.head + self.tail)))
            except ValueError:
                return Reading()
        # Too long to keep: `"usage":` with both quotes bare is a key (inside a string its
        # quotes are escaped), and the providers put it after the content.
        return Reading(
            _scan_model(bytes(self.head)), *counts(_value_after(bytes(self.tail), b'"usage"'))
        )


class UsageReader:
    """Fed the answer's bytes as they pass (decoded, as the agent gets them)."""

    def __init__(self, sse: bool) -> None:
        self.sse = sse
        self.reading = Reading()
        self.size = 0
        self._text = _Text()
        self._line = _Text()

    def feed(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if not self.sse:
            self._text.feed(chunk)
            return
        *done, rest = chunk.split(b"\n")
        for piece in done:
            self._line.feed(piece)
            self._end_line()
        if rest:
            self._line.feed(rest)

    def finish(self) -> Reading:
        if self.sse:
            self._end_line()
        else:
            self.reading.merge(self._text.read())
        return self.reading

    def _end_line(self) -> None:
        line, self._line = self._line, _Text()
        head = bytes(line.head[:8])
        if not head.startswith(b"data:"):
            return  # event:, id:, comments and blank lines carry no usage
        text = line.head + line.tail
        if b'"usage"' not in text and (self.reading.model or b'"model"' not in text):
            return  # most of a stream: content deltas
        del line.head[:5]  # `data:`; a leading space is JSON whitespace
        line.size -= 5
        self.reading.merge(line.read())


def _from_object(value: object) -> Reading:
    if not isinstance(value, dict):
        return Reading()
    reading = Reading(model_name(value.get("model")), *counts(value.get("usage")))
    for inner in ("message", "response"):  # Anthropic's message_start, OpenAI's responses
        nested = value.get(inner)
        if isinstance(nested, dict):
            reading.merge(_from_object(nested))
    return reading


def counts(usage: object) -> tuple[int | None, int | None]:
    if not isinstance(usage, dict):
        return None, None
    given = next((usage[name] for name in _INPUT if name in usage), None)
    taken = next((usage[name] for name in _OUTPUT if name in usage), None)
    input_tokens = _count(given)
    if input_tokens is not None:
        for name in _CACHE_FIELDS:  # Anthropic and Bedrock count cached input beside it
            extra = _count(usage.get(name))
            input_tokens += extra or 0
    return input_tokens, _count(taken)


def _count(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT:
        return value
    return None


def model_name(value: object) -> str | None:
    if not isinstance(value, str) or not value:
        return None
    kept = "".join(ch for ch in value[:MAX_MODEL] if ch.isprintable())
    return kept or None


def _value_after(text: bytes, key: bytes) -> object:
    """The JSON value after the last `key:` in `text`, or None."""
    at = text.rfind(key)
    while at >= 0:
        rest = text[at + len(key) :].lstrip()
        if rest.startswith(b":"):
            try:
                value, _ = json.JSONDecoder().raw_decode(
                    rest[1:].lstrip().decode("utf-8", "replace")
                )
            except ValueError:
                return None
            return value
        at = text.rfind(key, 0, at)
    return None


def _scan_model(head: bytes) -> str | None:
    at = head.find(b'"model"')
    if at < 0:
        return None
    value = _value_after(head[: at + 7 + MAX_MODEL * 6 + 8], b'"model"')
    return model_name(value)
