"""The audit stream: one JSON line per event on stdout, mitmproxy's own log lines included."""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import re
import select
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

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
DNS_MS = "dns_ms"
APPROVAL = "approval"
TOKEN_MS = "token_ms"  # noqa: S105 - a field name
TOKEN_FP = "token_fp"  # noqa: S105 - a field name
# A model call on a grant with a budget: the model and token counts its answer reported (or,
# with tokens_estimated, what the estimate charged); never prompts or completions.
MODEL = "model"
INPUT_TOKENS = "input_tokens"  # noqa: S105 - a field name
OUTPUT_TOKENS = "output_tokens"  # noqa: S105 - a field name
TOKENS_ESTIMATED = "tokens_estimated"  # noqa: S105 - a field name
COST_USD = "cost_usd"  # by the operator's price table (`run --prices`)
MAX_TOKENS = "max_tokens"  # noqa: S105 - the output limit forwarded, on a capping grant
BODY = "body"  # what a grant's body rule decided: {"graphql"|"mcp"|"jsonrpc": [...]}

REQUEST_EVENT = "request"

# Values of DECISION. ERROR: the grant allowed the request but it did not complete (the
# upstream failed, credproxy failed, or the agent left); REASON and the `error` class say which.
ALLOW = "allow"
DENY = "deny"
CHALLENGE = "challenge"  # a 407 to a request that offered no credentials: not a denial
ERROR = "error"
INTERNAL = "internal"  # credproxy.internal answered it

# Bytes waiting for stdout beyond which requests are refused (the reader has stalled).
QUEUE_LIMIT = 1024 * 1024
# Beyond this, lines are dropped and counted (an audit.lines_lost line once writes work).
LOST_LIMIT = 64 * 1024 * 1024
# After a write error, the next attempt with the same bytes.
RETRY_SECONDS = 1.0
# Shutdown waits at most this long, in total, for stdout to take what is queued.
DRAIN_SECONDS = 5.0
# One write hands the kernel at most this much.
CHUNK = 256 * 1024

OK, BACKLOG, FAILING = "ok", "backlog", "failing"

# Foreign log lines (mitmproxy's) may quote a request line; a query string can carry a key.
_QUERY_RE = re.compile(r"\?[^\s'\"]*")
# ... and peer bytes: a hex dump ("Cannot parse ClientHello: 160301..."), a bytes repr.
_BYTES_RE = re.compile(
    r"\b[0-9a-fA-F]{16,}\b|(?:bytearray\()?b(?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")\)?"
)

Write = Callable[[int, bytes], int]
# The line as written, whatever its form (addon/observe/ocsf.py reshapes request lines).
Shape = Callable[[dict[str, Any]], dict[str, Any]]
# Sees each line this process writes, once (addon/observe/otlp.py): an event dict, or text
# rendered by structlog or logging. Must never raise, wait, or write to the audit stream.
Tap = Callable[[dict[str, Any] | str], None]
# Takes what it can of the bytes without ever waiting: raises BlockingIOError, or writes less.
NoWait = Callable[[bytes], int]


def _scrub_foreign(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    message = event_dict.get(EVENT)
    if isinstance(message, str):
        event_dict[EVENT] = _BYTES_RE.sub("[bytes]", _QUERY_RE.sub("?[query]", message))
    # A foreign traceback quotes whatever the exception held: keep only its type.
    record = event_dict.get("_record")
    exc_info = event_dict.pop("exc_info", None) or getattr(record, "exc_info", None)
    if isinstance(exc_info, tuple) and exc_info[0] is not None:
        event_dict["error_type"] = exc_info[0].__name__
    if record is not None:
        record.exc_info, record.exc_text = None, None
    event_dict.pop("exception", None)
    return event_dict


class AuditWriter:
    """The audit stream's one writer: structlog events, mitmproxy's log records and request
    lines all go through it, in order.

    Inside the event loop, lines queue and are rendered at the loop's next iteration, after
    the response a request line describes has been handed to the socket. Rendered bytes go
    to a bounded buffer that a thread of its own writes to the file descriptor with
    `os.write`: a reader that stalls blocks that thread, never the event loop.

    When stdout is a pipe or a socket (a container runtime, systemd), the event loop first
    offers rendered bytes to `nowait`, a write that never waits: a second, non-blocking open
    of the same pipe, or `send(MSG_DONTWAIT)` on the socket. What it takes is written without
    waking the thread; whatever it does not take, and everything while the thread has bytes
    queued, goes to the thread as before, so the order holds and a stalled reader still
    blocks only the thread.

    One rule for every way a write can go wrong: a short write, EAGAIN or a blocked write
    keeps the rest queued, byte for byte; any error (EPIPE, ENOSPC, EIO, ...) keeps it too and
    is retried every RETRY_SECONDS. Requests are refused (`writable`) from the first error
    until a write succeeds, and while more than QUEUE_LIMIT bytes wait.
    """

    def __init__(
        self,
        fd: int,
        render: Processor,
        write: Write = os.write,
        limit: int | None = None,
        retry: float | None = None,
        nowait: NoWait | None = None,
        close_nowait: Callable[[], None] = lambda: None,
        shape: Shape | None = None,
    ) -> None:
        self._fd = fd
        self._shape = shape
        self.tap: Tap | None = None
        self._write = write
        self._nowait = nowait
        self._close_nowait = close_nowait
        self._render = render
        self._limit = QUEUE_LIMIT if limit is None else limit
        self._retry = RETRY_SECONDS if retry is None else retry
        self._pending: list[str | dict[str, Any]] = []
        self._scheduled: asyncio.AbstractEventLoop | None = None
        self._out = bytearray()
        self._cond = threading.Condition()
        self._failing = False
        self._closing = False
        self._lost = 0
        self._drain_budget = DRAIN_SECONDS
        self.write_failures = 0
        self.direct_writes = 0
        self._thread = threading.Thread(target=self._run, name="audit-writer", daemon=True)
        self._thread.start()

    @property
    def writable(self) -> bool:
        return not self._failing and len(self._out) <= self._limit

    @property
    def state(self) -> str:
        if self._failing:
            return FAILING
        return OK if len(self._out) <= self._limit else BACKLOG

    @property
    def queued(self) -> int:
        """Bytes rendered and not yet taken by the file descriptor."""
        return len(self._out)

    def add(self, item: str | dict[str, Any]) -> None:
        """Queue a line: text ending in a newline, or an event dict that is rendered later."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._cond:
            self._pending.append(item)
            if loop is None:
                self._flush()
                return
            if self._scheduled is loop:
                return
            self._scheduled = loop
        loop.call_soon(self.flush)

    def flush(self) -> None:
        """Hand everything queued to the writer thread; never waits for the descriptor."""
        with self._cond:
            self._flush()

    def drain(self) -> bool:
        """Flush, then wait for the descriptor to take it all (shutdown); False if it did not.

        Every drain shares one DRAIN_SECONDS budget, so a stalled reader delays shutdown once.
        """
        with self._cond:
            self._flush()
            if self._lost:
                self._report_lost()
                self._cond.notify_all()
            start = time.monotonic()
            done = self._cond.wait_for(lambda: not self._out, max(self._drain_budget, 0.0))
            self._drain_budget -= time.monotonic() - start
            return done

    def close(self) -> None:
        """Stop the writer thread, leaving whatever is still queued (tests)."""
        with self._cond:
            self._closing = True
            self._drain_budget = 0.0  # nothing writes any more: atexit must not wait
            self._cond.notify_all()
        self._thread.join(self._retry + 1)
        close, self._close_nowait = self._close_nowait, lambda: None
        self._nowait = None
        close()  # once: a second close could hit a descriptor number reused since

    def _flush(self) -> None:
        self._scheduled = None
        if not self._pending:
            return
        if self._lost and self.writable:
            self._report_lost()
        items, self._pending = self._pending, []
        data = "".join(map(self._line, items)).encode("utf-8", "backslashreplace")
        if self._nowait is not None and not self._out and not self._failing:
            # Nothing queued, so nothing in flight: the bytes may go first, straight away.
            try:
                taken = self._nowait(data)
            except OSError:  # EAGAIN included: the thread writes it, and reports a failure
                taken = 0
            if taken:
                self.direct_writes += 1
                data = data[taken:]
                if not data:
                    return
        if len(self._out) + len(data) > LOST_LIMIT:
            self._lost += data.count(b"\n")
            return
        self._out += data
        self._cond.notify_all()

    def _report_lost(self) -> None:
        """The count of dropped lines, as a line of its own: never dropped itself."""
        lost, self._lost = self._lost, 0
        self._out += self._line({EVENT: "audit.lines_lost", "count": lost}).encode()

    def _line(self, item: str | dict[str, Any]) -> str:
        tap = self.tap
        if isinstance(item, str):
            if tap is not None and type(item) is str:  # not _Relayed: its process tapped it
                tap(item)
            return item
        try:
            if self._shape is not None:
                item = self._shape(item)
            text = f"{self._render(self, 'info', item)!s}\n"
        except Exception as e:  # noqa: BLE001 - a line is still written, without the values
            item = {EVENT: "audit.unrenderable", "error_type": type(e).__name__}
            text = f"{self._render(self, 'info', item)!s}\n"
        if tap is not None:
            tap(item)
        return text

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._out or self._closing)
                if self._closing:
                    return
                chunk = bytes(self._out[:CHUNK])
            try:
                written = self._write(self._fd, chunk)
            except BlockingIOError:
                written = 0  # the reader is behind: not an error, wait below
            except OSError:
                self._failed()
                continue
            with self._cond:
                del self._out[:written]
                if written:
                    self._failing = False
                self._cond.notify_all()
            if not written:  # a short write just tries again: the next one blocks or says EAGAIN
                self._wait_writable()

    def _failed(self) -> None:
        with self._cond:
            self._failing = True
            self.write_failures += 1
            self._cond.wait_for(lambda: self._closing, self._retry)

    def _wait_writable(self) -> None:
        try:
            select.select([], [self._fd], [], self._retry)
        except (OSError, ValueError):  # not a pollable descriptor: wait the retry interval
            with self._cond:
                self._cond.wait_for(lambda: self._closing, self._retry)

    # structlog's logger interface: the rendered event, without its newline.
    def msg(self, message: str) -> None:
        self.add(message + "\n")

    debug = info = warning = warn = error = critical = exception = fatal = log = msg

    # A text stream, for logging.StreamHandler: records arrive with their newline.
    def write(self, text: str) -> int:
        self.add(text)
        return len(text)


class _Relayed(str):
    """A line another process rendered (a worker's), and exported itself."""

    __slots__ = ()


_writer: AuditWriter | None = None
_tap: Tap | None = None
_pre_processors: list[Processor] = []
# A worker of `run --workers N`: the supervisor's own stream state, which it relays to us.
_relay = OK


def emit(event: str, fields: dict[str, Any]) -> None:
    """Log `fields` (taken over, not copied) as `event` at info level, on the hot path.

    structlog's configured processors run here, except the JSON renderer, which the writer
    runs when it writes: a bound-logger call would add a lazy proxy, `bind` and
    `_process_event` around the same processors.
    """
    if _writer is None:
        logger().info(event, **fields)  # not configured (unit tests): structlog's defaults
        return
    fields[EVENT] = event
    if "exc_info" not in fields and "exception" not in fields:
        # What the two processors do to a line without an exception, in one step: the
        # timestamper's own format (ISO 8601, UTC as Z), no exception to format.
        fields[TS] = datetime.now(UTC).isoformat().replace("+00:00", "Z")
        _writer.add(fields)
        return
    event_dict: Any = fields
    for processor in _pre_processors:
        event_dict = processor(_writer, "info", event_dict)
    _writer.add(event_dict)


def writable() -> bool:
    """False while the audit stream cannot take lines: requests must then be refused."""
    return _relay == OK and (_writer is None or _writer.writable)


def state() -> str:
    """`ok`, `backlog` (over QUEUE_LIMIT waiting) or `failing` (the last write failed)."""
    if _relay != OK:
        return _relay
    return OK if _writer is None else _writer.state


def relay(line: str) -> None:
    """Queue a line already rendered elsewhere (a worker's), ending in a newline."""
    if _writer is not None:
        _writer.add(_Relayed(line))


def set_tap(tap: Tap | None) -> None:
    """Show every line this process writes from now on to `tap` too (the OTLP export)."""
    global _tap
    _tap = tap
    if _writer is not None:
        _writer.tap = tap


def relay_state(value: str) -> None:
    """A worker's audit stream ends at the supervisor's: its state counts as ours."""
    global _relay
    _relay = value if value in (OK, BACKLOG, FAILING) else FAILING


def queued_bytes() -> int:
    return 0 if _writer is None else _writer.queued


def write_failures() -> int:
    return 0 if _writer is None else _writer.write_failures


def drain() -> None:
    """Write every queued line now, waiting at most DRAIN_SECONDS in all (shutdown)."""
    if _writer is not None:
        _writer.drain()


def nonblocking(fd: int) -> tuple[NoWait, Callable[[], None]] | None:
    """A write to `fd` that never waits, and how to close it; None where there is none.

    A pipe is opened a second time, non-blocking, through /proc: a description of its own, so
    the flags of the one stdout shares with other processes stay untouched. A socket is sent to
    with MSG_DONTWAIT, which is per call. Regular files and terminals have none: the thread
    writes them.
    """
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISFIFO(mode):
            pipe = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            if not stat.S_ISFIFO(os.fstat(pipe).st_mode):
                os.close(pipe)
                return None
            return (lambda data: os.write(pipe, data)), (lambda: os.close(pipe))
        if stat.S_ISSOCK(mode):
            sock = socket.socket(fileno=os.dup(fd))
            if sock.type != socket.SOCK_STREAM:
                sock.close()  # a datagram socket would cut lines apart or drop them
                return None
            return (lambda data: sock.send(data, socket.MSG_DONTWAIT)), sock.close
    except OSError:
        return None
    return None


def configure(
    fd: int | None = None,
    level: int = logging.WARNING,
    write: Write = os.write,
    nowait: bool = True,
    shape: Shape | None = None,
) -> AuditWriter:
    """Render structlog events and stdlib logging (mitmproxy) as JSON lines on `fd` (stdout)."""
    global _writer, _pre_processors
    if fd is None:
        sys.stdout.flush()  # anything printed before goes first
        fd = sys.stdout.fileno()
    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True, key=TS)
    renderer = structlog.processors.JSONRenderer()
    _pre_processors = [timestamper, structlog.processors.format_exc_info]
    if _writer is not None:
        _writer.drain()
        _writer.close()
    direct = nonblocking(fd) if nowait else None
    writer = _writer = AuditWriter(
        fd,
        renderer,
        write,
        nowait=direct[0] if direct else None,
        close_nowait=direct[1] if direct else lambda: None,
        shape=shape,
    )
    writer.tap = _tap
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
    return writer


def logger() -> Any:
    return structlog.get_logger("credproxy")
