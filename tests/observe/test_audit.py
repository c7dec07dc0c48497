"""The audit writer: order, batching after the response, one rule for every write failure,
and an event loop that a stalled reader never blocks."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import structlog
from mitmproxy.test import taddons

from addon.core.hosts import ResolveMap
from addon.observe import audit
from addon.observe.metrics import Metrics
from tests.fakes import Chain, StaticLive, https_flow, make_policy, reason


class Sink:
    """A stand-in for `os.write` on stdout: fails with `error`, or takes at most `most` bytes."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.error: int | None = None
        self.most: int | None = None
        self.calls = 0
        self.lock = threading.Lock()

    def write(self, fd: int, chunk: bytes) -> int:
        with self.lock:
            self.calls += 1
            if self.error is not None:
                raise OSError(self.error, os.strerror(self.error))
            taken = chunk[: self.most] if self.most is not None else chunk
            self.data += taken
            return len(taken)

    def lines(self) -> list[dict[str, object]]:
        with self.lock:
            return [json.loads(line) for line in self.data.decode().splitlines()]


@pytest.fixture
def setup(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., audit.AuditWriter]]:
    monkeypatch.setattr(audit, "RETRY_SECONDS", 0.02)
    monkeypatch.setattr(audit, "DRAIN_SECONDS", 5.0)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level

    def make(fd: int = -1, write: audit.Write = os.write, limit: int | None = None):
        if limit is not None:
            monkeypatch.setattr(audit, "QUEUE_LIMIT", limit)
        return audit.configure(fd, write=write)

    yield make
    if audit._writer is not None:
        audit._writer.close()
    audit._writer = None
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def sink(setup: Callable[..., audit.AuditWriter]) -> Sink:
    sink = Sink()
    setup(write=sink.write)
    return sink


async def settle(check: Callable[[], bool], timeout: float = 5.0) -> None:
    """Let the loop and the writer thread run until `check` holds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def request_ids(data: bytes) -> list[object]:
    return [json.loads(line).get("n") for line in data.decode().splitlines()]


async def refused_with(addon: Chain) -> str | None:
    with taddons.context(addon):
        flow = https_flow(addon)
        await addon.requestheaders(flow)
        return reason(flow) if flow.response is not None else None


def test_outside_the_event_loop_a_line_goes_out_without_waiting_for_a_loop(sink: Sink) -> None:
    audit.emit("request", {"decision": "allow"})
    audit.drain()
    assert [line["event"] for line in sink.lines()] == ["request"]


async def test_in_the_loop_lines_go_out_after_the_current_step_in_order(sink: Sink) -> None:
    audit.emit("request", {"n": 1})
    audit.logger().warning("something", n=2)
    assert audit.queued_bytes() == 0  # not even rendered yet: the response goes out first
    logging.getLogger("mitmproxy.proxy").warning("foreign ?key=secret n=3")  # flushes
    audit.emit("request", {"n": 4})
    await settle(lambda: len(sink.lines()) == 4)
    got = sink.lines()
    assert [line.get("n") for line in got[:2]] == [1, 2]
    assert got[2]["event"] == "foreign ?[query] n=3"
    assert got[3]["n"] == 4
    assert all("ts" in line for line in got)


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(errno.EPIPE, id="the reader is gone (EPIPE)"),
        pytest.param(errno.ENOSPC, id="the disk is full (ENOSPC)"),
        pytest.param(errno.EIO, id="the device fails (EIO)"),
        pytest.param(errno.EBADF, id="any other error (EBADF)"),
    ],
)
async def test_every_write_error_refuses_requests_until_a_write_succeeds(
    sink: Sink, error: int
) -> None:
    addon = Chain(StaticLive(make_policy()), ResolveMap.parse(["api.test=127.0.0.1:1"]))
    sink.error = error
    audit.emit("request", {"n": 1})
    await settle(lambda: not audit.writable())
    assert audit.state() == audit.FAILING
    assert await refused_with(addon) == "audit-unavailable"
    await settle(lambda: audit.write_failures() >= 2)  # retried, the same bytes
    scrape = addon.metrics.render().decode()
    assert f"credproxy_audit_write_failures_total {float(audit.write_failures())}" in scrape
    assert "credproxy_audit_writable 0.0" in scrape
    sink.error = None
    await settle(audit.writable)
    assert await refused_with(addon) is None  # allowed again
    await settle(lambda: audit.queued_bytes() == 0)
    # Each line exactly once, in order: the one from before the failure, then the refusal.
    got = sink.lines()
    assert [line.get("n") for line in got] == [1, None]
    assert got[1]["reason"] == "audit-unavailable"


async def test_short_writes_lose_and_repeat_nothing(sink: Sink) -> None:
    sink.most = 7
    for n in range(50):
        audit.emit("request", {"n": n})
    await settle(lambda: bytes(sink.data).count(b"\n") == 50)
    assert request_ids(bytes(sink.data)) == list(range(50))
    assert audit.write_failures() == 0


async def test_eagain_is_a_stall_not_an_error_until_the_queue_is_over_its_bound(
    setup: Callable[..., audit.AuditWriter],
) -> None:
    """A real pipe, non-blocking as another process may have left it."""
    read_end, write_end = os.pipe()
    for end in (read_end, write_end):
        fcntl.fcntl(end, fcntl.F_SETFL, fcntl.fcntl(end, fcntl.F_GETFL) | os.O_NONBLOCK)
    filler = 0
    with contextlib.suppress(BlockingIOError):
        while True:  # full before the writer starts: the queue can only grow
            filler += os.write(write_end, b"#" * 4096)
    writer = setup(write_end, limit=64 * 1024)
    addon = Chain(StaticLive(make_policy()), ResolveMap.parse(["api.test=127.0.0.1:1"]))
    received = bytearray()
    try:
        n = 0
        while audit.writable():  # the pipe fills (EAGAIN), then the queue grows
            audit.emit("request", {"n": n, "pad": "x" * 200})
            n += 1
            await asyncio.sleep(0)
            assert n < 10_000
        assert audit.state() == audit.BACKLOG
        assert audit.write_failures() == 0
        assert await refused_with(addon) == "audit-unavailable"
        assert "credproxy_audit_queue_bytes" in addon.metrics.render().decode()
        deadline = time.monotonic() + 5
        while received.count(b"\n") < n + 1:  # the filler, every line, the refusal's
            assert time.monotonic() < deadline, "the lines did not arrive"
            try:
                received += os.read(read_end, 1 << 16)
            except BlockingIOError:
                pass
            await asyncio.sleep(0.001)
        assert audit.writable()
    finally:
        writer.close()
        os.close(write_end)
    os.close(read_end)
    assert received[:filler] == b"#" * filler
    ids = request_ids(bytes(received[filler:]))
    assert ids[:n] == list(range(n))  # then the refusal's line
    assert len(ids) == n + 1


async def test_a_stalled_reader_never_blocks_the_event_loop(
    setup: Callable[..., audit.AuditWriter],
) -> None:
    """A real blocking pipe nobody reads: the write blocks the writer thread only."""
    read_end, write_end = os.pipe()
    writer = setup(write_end, limit=256 * 1024)
    try:
        for n in range(3_000):  # ~800 KB: far more than the pipe holds
            audit.emit("request", {"n": n, "pad": "x" * 200})
            await asyncio.sleep(0)  # each iteration renders and hands over without waiting
        logging.getLogger("mitmproxy.proxy").warning("stalled")  # its flush does not wait
        assert audit.queued_bytes() > 64 * 1024
        assert audit.state() == audit.BACKLOG
        received = bytearray()
        while len(received.splitlines()) < 3_001:
            received += await asyncio.get_running_loop().run_in_executor(
                None, os.read, read_end, 1 << 16
            )
        assert request_ids(bytes(received)) == [*range(3_000), None]
        assert json.loads(received.splitlines()[-1])["event"] == "stalled"
        await settle(audit.writable)
    finally:
        writer.close()
        os.close(write_end)
        os.close(read_end)


def test_drain_at_shutdown_gives_up_after_its_deadline_once(
    setup: Callable[..., audit.AuditWriter], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(audit, "DRAIN_SECONDS", 0.2)
    sink = Sink()
    sink.error = errno.EPIPE
    writer = setup(write=sink.write)
    audit.emit("request", {"n": 1})
    results: list[bool] = []

    def shutdown() -> None:
        results.append(writer.drain())
        results.append(writer.drain())  # the budget is spent: no second wait

    thread = threading.Thread(target=shutdown, daemon=True)
    thread.start()
    thread.join(3.0)
    assert not thread.is_alive(), "shutdown hangs on a stream that cannot be written"
    assert results == [False, False]


async def test_over_the_hard_limit_lines_are_counted_then_reported(
    setup: Callable[..., audit.AuditWriter], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(audit, "LOST_LIMIT", 4096)
    sink = Sink()
    setup(write=sink.write, limit=2048)
    sink.error = errno.ENOSPC
    for n in range(100):
        audit.emit("request", {"n": n, "pad": "x" * 200})
        await asyncio.sleep(0)
    kept = audit.queued_bytes()
    assert 0 < kept <= 4096
    sink.error = None
    await settle(lambda: audit.queued_bytes() == 0)
    audit.emit("request", {"n": "after"})
    await settle(lambda: sink.lines()[-1].get("n") == "after")
    got = sink.lines()
    lost = [line for line in got if line["event"] == "audit.lines_lost"]
    assert len(lost) == 1
    assert len(got) - 2 + lost[0]["count"] == 100  # the kept, the lost: every line accounted


async def test_a_line_that_cannot_be_rendered_is_still_a_line(sink: Sink) -> None:
    audit.emit("request", {("not", "a", "str"): 1})  # type: ignore[dict-item]
    audit.emit("request", {"n": 2})
    await settle(lambda: len(sink.lines()) == 2)
    got = sink.lines()
    assert got[0] == {"event": "audit.unrenderable", "error_type": "TypeError"}
    assert got[1]["n"] == 2
    assert audit.writable()


def test_metrics_show_the_queue_and_the_failures(sink: Sink) -> None:
    text = Metrics(lambda: 0.0, lambda: True).render().decode()
    assert "credproxy_audit_queue_bytes 0.0" in text
    assert "credproxy_audit_write_failures_total 0.0" in text
    assert "credproxy_audit_writable 1.0" in text


@pytest.mark.parametrize(
    ("message", "kept"),
    [
        pytest.param(
            "Cannot parse ClientHello: 1603010200aabbccddeeff0011",
            "Cannot parse ClientHello: [bytes]",
            id="a hex dump of the client's bytes is scrubbed",
        ),
        pytest.param(
            "Bad line: b'Authorization: x'", "Bad line: [bytes]", id="a bytes repr is scrubbed"
        ),
        pytest.param(
            "GET /a?key=v HTTP/1.1", "GET /a?[query] HTTP/1.1", id="a query string is scrubbed"
        ),
    ],
)
def test_foreign_log_lines_carry_no_peer_bytes(sink: Sink, message: str, kept: str) -> None:
    logging.getLogger("mitmproxy.proxy.server").warning(message)
    audit.drain()
    [line] = sink.lines()
    assert line["event"] == kept


def test_a_foreign_traceback_is_reduced_to_its_type(sink: Sink) -> None:
    try:
        raise ValueError("text-from-a-peer")
    except ValueError:
        logging.getLogger("mitmproxy.proxy.server").error("crashed", exc_info=True)
    audit.drain()
    [line] = sink.lines()
    assert line["error_type"] == "ValueError"
    assert "text-from-a-peer" not in json.dumps(line)


async def _read_lines(fd: int, count: int) -> bytes:
    received = bytearray()
    while len(received.splitlines()) < count:
        received += await asyncio.get_running_loop().run_in_executor(None, os.read, fd, 1 << 16)
    return bytes(received)


async def test_a_pipe_that_is_read_takes_lines_from_the_event_loop_not_the_thread(
    setup: Callable[..., audit.AuditWriter],
) -> None:
    """No thread wake-up per request: the loop writes through a non-blocking second open of
    the pipe, and stdout's own description stays blocking for everyone who shares it."""
    read_end, write_end = os.pipe()
    thread_writes: list[int] = []

    def counted(fd: int, data: bytes) -> int:
        thread_writes.append(len(data))
        return os.write(fd, data)

    writer = setup(write_end, write=counted)
    try:
        for n in range(200):
            audit.emit("request", {"n": n})
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        received = await _read_lines(read_end, 200)
        assert request_ids(received) == list(range(200))
        assert thread_writes == []
        assert writer.direct_writes >= 100
        assert not fcntl.fcntl(write_end, fcntl.F_GETFL) & os.O_NONBLOCK
    finally:
        writer.close()
        os.close(write_end)
        os.close(read_end)


async def test_a_stream_socket_takes_lines_from_the_event_loop_and_keeps_their_order(
    setup: Callable[..., audit.AuditWriter],
) -> None:
    """systemd gives stdout as a socket: MSG_DONTWAIT per send, the rest to the thread."""
    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    writer = setup(ours.fileno(), limit=1 << 20)
    try:
        for n in range(2_000):  # far more than the buffers hold: some go by the thread
            audit.emit("request", {"n": n, "pad": "x" * 100})
            await asyncio.sleep(0)
        assert writer.direct_writes > 0
        received = await _read_lines(theirs.fileno(), 2_000)
        assert request_ids(received) == list(range(2_000))
        assert ours.getblocking()
    finally:
        writer.close()
        ours.close()
        theirs.close()


def test_no_second_writer_for_a_regular_file_or_a_closed_descriptor(tmp_path) -> None:
    with open(tmp_path / "audit.log", "wb") as f:
        assert audit.nonblocking(f.fileno()) is None
    assert audit.nonblocking(-1) is None
