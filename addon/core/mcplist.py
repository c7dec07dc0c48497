"""The answer to MCP's `tools/list`, filtered to the tools a grant names, as JSON or as SSE.

Pure. The agent is not shown what it may not call (decide() still refuses such a call). Only
the `tools` list of a JSON-RPC result is changed; every other byte passes as it came:

    filter_json(rule, body) -> None        nothing to remove: forward the body unchanged
                            -> bytes       the body with ungranted tools removed
                            raises Unfilterable   not strict JSON: refuse the answer
    SseFilter.feed(chunk) / .end() -> bytes to forward now; raise Unfilterable (EventTooLarge
                            for an event over the limit): cut the answer

Unfilterable
 └── EventTooLarge
"""

from __future__ import annotations

import json
import re
from typing import Any

from addon.core.bodies import MAX_DECIDED_BODY, strict_json
from store.rules.bodyrules import McpRule

_EOL = re.compile(rb"\r\n|\r|\n")
_BOM = b"\xef\xbb\xbf"


class Unfilterable(Exception):
    """The answer cannot be read with certainty, so it cannot be filtered: refuse it."""


class EventTooLarge(Unfilterable):
    pass


def _filtered(rule: McpRule, message: Any) -> bool:
    """Remove the ungranted tools of one JSON-RPC response in place; whether any were."""
    result = message.get("result") if isinstance(message, dict) else None
    if not isinstance(result, dict) or not isinstance(result.get("tools"), list):
        return False
    tools = result["tools"]
    kept = [t for t in tools if isinstance(t, dict) and _granted(rule, t.get("name"))]
    if len(kept) == len(tools):
        return False
    result["tools"] = kept
    return True


def _granted(rule: McpRule, name: Any) -> bool:
    return isinstance(name, str) and name in rule.tools


def _rewrite(rule: McpRule, text: bytes) -> bytes | None:
    try:
        found = strict_json(text)
    except ValueError as e:
        raise Unfilterable(str(e)) from None
    messages = found if isinstance(found, list) else [found]
    if not any([_filtered(rule, m) for m in messages]):
        return None
    try:
        return json.dumps(found, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate escaped in the original: keep it escaped
        return json.dumps(found, separators=(",", ":")).encode("ascii")


def filter_json(rule: McpRule, body: bytes) -> bytes | None:
    """The body without ungranted tools, or None when it has none to remove.

    Raises Unfilterable when the body is not strict JSON (UTF-8 without BOM, no duplicate keys,
    no NaN or infinite numbers, not too deep).
    """
    return _rewrite(rule, body)


class SseFilter:
    """A text/event-stream answer, event by event: an event whose data is a JSON-RPC response
    listing ungranted tools has its data rewritten; every other byte passes unchanged."""

    def __init__(self, rule: McpRule, limit: int = MAX_DECIDED_BODY) -> None:
        self._rule = rule
        self._limit = limit
        self._lines: list[tuple[bytes, bytes]] = []  # the event so far: (line, terminator)
        self._size = 0
        self._partial = bytearray()  # a line without its terminator yet
        self._cr = False  # the last chunk ended in CR: a LF first in the next one ends that line
        self._first = True  # the stream's first line, whose BOM a client strips

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to forward now: the events this chunk completed. Raises Unfilterable.
        An empty chunk changes nothing (the end is `end()`): a CR that ended the last chunk
        still waits for the LF that may begin the next."""
        if not chunk:
            return b""
        out = bytearray()
        start = 0
        if self._cr and chunk[:1] == b"\n":
            if self._lines:
                line, end = self._lines[-1]
                self._lines[-1] = (line, end + b"\n")
            else:
                out += b"\n"  # the CR ended an event, already forwarded
            start = 1
        self._cr = False
        for match in _EOL.finditer(chunk, start):
            line = bytes(self._partial) + chunk[start : match.start()]
            self._partial.clear()
            start = match.end()
            if self._first:
                self._first = False
                if line.startswith(_BOM):  # forwarded at once: nothing precedes it
                    out += _BOM
                    line = line[len(_BOM) :]
            self._lines.append((line, match.group()))
            self._size += len(line) + len(match.group())
            if not line:
                out += self._event()
        self._partial += chunk[start:]
        self._cr = chunk.endswith(b"\r")
        if self._size + len(self._partial) > self._limit:
            raise EventTooLarge(f"an event of the answer is over {self._limit} bytes")
        return bytes(out)

    def end(self) -> bytes:
        """What is left when the answer ends: an unfinished event, filtered as a whole one."""
        if self._partial:
            self._lines.append((bytes(self._partial), b""))
            self._partial.clear()
        return self._event() if self._lines else b""

    def _event(self) -> bytes:
        lines, self._lines, self._size = self._lines, [], 0
        data = [i for i, (line, _) in enumerate(lines) if _field(line)[0] == b"data"]
        if data:
            text = b"\n".join(_field(lines[i][0])[1] for i in data)
            new = _rewrite_data(self._rule, text) if text.strip() else None
            if new is not None:
                first = data[0]
                lines = [
                    (b"data: " + new, end) if i == first else (line, end)
                    for i, (line, end) in enumerate(lines)
                    if i == first or i not in data
                ]
        return b"".join(line + end for line, end in lines)


def _field(line: bytes) -> tuple[bytes, bytes]:
    """An SSE line's field name and value (one space after the colon is not part of it)."""
    name, colon, value = line.partition(b":")
    return name, value.removeprefix(b" ") if colon else b""


def _rewrite_data(rule: McpRule, text: bytes) -> bytes | None:
    """An event's data: JSON is filtered; what no JSON reader takes (the old transport's
    `endpoint` event) passes."""
    try:
        return _rewrite(rule, text)
    except Unfilterable:
        try:
            json.loads(text.decode("utf-8", "replace"))
        except (ValueError, RecursionError):
            return None
        raise
