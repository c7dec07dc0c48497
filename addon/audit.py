"""The audit stream: one JSON line per event on stdout, mitmproxy's own log lines included."""

from __future__ import annotations

import asyncio
import atexit
import logging
import re
import sys
import threading
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

EVENT = "event"
TS = "ts"
REQUEST_ID = "request_id"
PRINCIPAL = "principal"
CLIENT = "client"
METHOD = "method"
HOST = "host"
PORT = "port"
PATH = "path"
DECISION = "decision"
REASON = "reason"
DETAIL = "detail"
GRANT_ID = "grant_id"
CREDENTIAL = "credential"
CREDENTIAL_FP = "credential_fp"
STATUS = "status"
BYTES_IN = "bytes_in"
BYTES_OUT = "bytes_out"
DURATION_MS = "duration_ms"
ERROR = "error"

REQUEST_EVENT = "request"

# Queued text kept for the next write while the stream fails; beyond this it is dropped and
# counted (an audit.lines_lost line once writes work again).
RETRY_LIMIT = 64 * 1024 * 1024

# Foreign log lines (mitmproxy's) may quote a request line; a query string can carry a key.
_QUERY_RE = re.compile(r"\?[^\s'\"]*")


def _scrub_foreign(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    message = event_dict.get(EVENT)
    if isinstance(message, str):
        event_dict[EVENT] = _QUERY_RE.sub("?[query]", message)
    return event_dict


class AuditWriter:
    """The audit stream's one writer: structlog events, mitmproxy's log records and request
    lines all go through it, in order.

    Inside the event loop, lines queue and go out in one write at the loop's next iteration,
    after the response a request line describes has been handed to the socket: neither the
    JSON encoding nor the write is on the request's path, and requests that finish in the
    same iteration share one write. Outside a running loop (the CLI, start-up, shutdown) a
    line is written at once, after anything still queued.

    A write that fails marks the stream broken until a later write succeeds; the proxy
    refuses requests meanwhile (`writable`), and the lines are kept and written with the
    next successful write (beyond RETRY_LIMIT they are counted instead).
    """

    def __init__(self, stream: TextIO, render: Processor) -> None:
        self._stream = stream
        self._render = render
        self._pending: list[str | dict[str, Any]] = []
        self._scheduled: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._lost = 0
        self.writable = True

    def add(self, item: str | dict[str, Any]) -> None:
        """Queue a line: text ending in a newline, or an event dict that is rendered later."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._lock:
            self._pending.append(item)
            if loop is None:
                self._drain()
                return
            if self._scheduled is loop:
                return
            self._scheduled = loop
        loop.call_soon(self.drain)

    def drain(self) -> None:
        """Write everything queued, now."""
        with self._lock:
            self._drain()

    def _drain(self) -> None:
        self._scheduled = None
        if not self._pending:
            return
        items, self._pending = self._pending, []
        text = "".join(map(self._line, items))
        try:
            self._stream.write(text)
            self._stream.flush()
        except Exception:  # noqa: BLE001 - any failure: keep the lines, refuse requests
            self.writable = False
            if len(text) <= RETRY_LIMIT:
                # Kept for the next write; the newline ends whatever part already went out.
                self._pending.insert(0, text if text.startswith("\n") else "\n" + text)
            else:
                self._lost += text.count("\n")
            return
        self.writable = True
        if self._lost:
            lost, self._lost = self._lost, 0
            self._pending.append({EVENT: "audit.lines_lost", "count": lost})
            self._drain()

    def _line(self, item: str | dict[str, Any]) -> str:
        if isinstance(item, str):
            return item
        try:
            return f"{self._render(self, 'info', item)!s}\n"
        except Exception as e:  # noqa: BLE001 - a line is still written, without the values
            fallback = {EVENT: "audit.unrenderable", "error_type": type(e).__name__}
            return f"{self._render(self, 'info', fallback)!s}\n"

    # structlog's logger interface: the rendered event, without its newline.
    def msg(self, message: str) -> None:
        self.add(message + "\n")

    debug = info = warning = warn = error = critical = exception = fatal = log = msg

    # A text stream, for logging.StreamHandler: records arrive with their newline.
    def write(self, text: str) -> int:
        self.add(text)
        return len(text)

    def flush(self) -> None:
        self.drain()


_writer: AuditWriter | None = None
_pre_processors: list[Processor] = []


def emit(event: str, fields: dict[str, Any]) -> None:
    """Log `fields` (taken over, not copied) as `event` at info level, on the hot path.

    structlog's configured processors run here, except the JSON renderer, which the writer
    runs when it writes; a bound-logger call would add a lazy proxy, `bind` and
    `_process_event` around the same processors (the benchmark's profile: 2.8 % of the
    proxy's CPU).
    """
    if _writer is None:
        logger().info(event, **fields)  # not configured (unit tests): structlog's defaults
        return
    fields[EVENT] = event
    event_dict: Any = fields
    for processor in _pre_processors:
        event_dict = processor(_writer, "info", event_dict)
    _writer.add(event_dict)


def writable() -> bool:
    """False while the audit stream cannot be written: requests must then be refused."""
    return _writer is None or _writer.writable


def drain() -> None:
    """Write every queued line now (shutdown)."""
    if _writer is not None:
        _writer.drain()


def configure(stream: TextIO | None = None, level: int = logging.WARNING) -> None:
    """Render structlog events and stdlib logging (mitmproxy) as JSON lines on `stream`."""
    global _writer, _pre_processors
    stream = stream or sys.stdout
    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True, key=TS)
    renderer = structlog.processors.JSONRenderer()
    _pre_processors = [timestamper, structlog.processors.format_exc_info]
    if _writer is not None:
        _writer.drain()
    writer = _writer = AuditWriter(stream, renderer)
    atexit.register(writer.drain)
    structlog.configure(
        processors=[*_pre_processors, renderer],
        logger_factory=lambda *args: writer,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(writer)  # type: ignore[arg-type]
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processor=structlog.processors.JSONRenderer(),
            foreign_pre_chain=[
                structlog.stdlib.add_log_level,
                structlog.stdlib.add_logger_name,
                timestamper,
                _scrub_foreign,
            ],
        )
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        if isinstance(old, logging.StreamHandler):
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


def logger() -> Any:
    return structlog.get_logger("credproxy")
