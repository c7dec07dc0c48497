"""The audit stream: one JSON line per event on stdout, mitmproxy's own log lines included."""

from __future__ import annotations

import logging
import re
import sys
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

# Foreign log lines (mitmproxy's) may quote a request line; a query string can carry a key.
_QUERY_RE = re.compile(r"\?[^\s'\"]*")


def _scrub_foreign(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    message = event_dict.get(EVENT)
    if isinstance(message, str):
        event_dict[EVENT] = _QUERY_RE.sub("?[query]", message)
    return event_dict


class _Direct:
    """The configured processors and writer, called without a bound logger in between.

    For the one event every request writes: a bound-logger call runs these same processors
    through a lazy proxy, `bind` and `_process_event`, which cost more than the JSON itself
    (the benchmark's profile: 2.8 % of the proxy's CPU). Same processors, same lock, same bytes.
    """

    def __init__(self, processors: list[Processor], stream: TextIO) -> None:
        self.processors = processors
        self.writer = structlog.WriteLogger(stream)

    def __call__(self, event: str, fields: dict[str, Any]) -> None:
        fields[EVENT] = event
        rendered: Any = fields
        for processor in self.processors:
            rendered = processor(self.writer, "info", rendered)
        self.writer.msg(rendered)


_direct: _Direct | None = None


def emit(event: str, fields: dict[str, Any]) -> None:
    """Log `fields` (taken over, not copied) as `event` at info level, on the hot path."""
    if _direct is None:
        logger().info(event, **fields)  # not configured (unit tests): structlog's defaults
    else:
        _direct(event, fields)


def configure(stream: TextIO | None = None, level: int = logging.WARNING) -> None:
    """Render structlog events and stdlib logging (mitmproxy) as JSON lines on `stream`."""
    global _direct
    stream = stream or sys.stdout
    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True, key=TS)
    processors: list[Processor] = [
        timestamper,
        structlog.processors.format_exc_info,
        structlog.processors.JSONRenderer(),
    ]
    _direct = _Direct(processors, stream)
    structlog.configure(
        processors=processors,
        # One write per line: the audit stream is on the hot path.
        logger_factory=structlog.WriteLoggerFactory(stream),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(stream)
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
