"""The supervisor's parts without processes: the worker's role, the relay of audit lines."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from structlog.testing import capture_logs

from addon.observe import audit
from addon.runtime.workerrole import Role
from addon.runtime.workers import Supervisor, Worker, reserve
from store.errors import InvalidInput


def test_reserve_holds_one_port_for_every_worker() -> None:
    holders, port = reserve("127.0.0.1", 0)
    try:
        assert port > 0
        with pytest.raises(InvalidInput, match="already in use"):
            _plain_bind(port)
    finally:
        for holder in holders:
            holder.close()


def _plain_bind(port: int) -> None:
    """What a foreign process without SO_REUSEPORT gets: the port is taken."""
    from addon.runtime.config import check_listen

    check_listen("127.0.0.1", port)


class Lines:
    """audit.relay, captured."""

    def __init__(self) -> None:
        self.lines: list[str] = []


@pytest.fixture
def relayed(monkeypatch: pytest.MonkeyPatch) -> Any:
    captured = Lines()
    monkeypatch.setattr(audit, "relay", captured.lines.append)
    monkeypatch.setattr(audit, "writable", lambda: True)
    return captured


async def _relay(chunks: list[bytes]) -> tuple[Supervisor, Worker]:
    supervisor = Supervisor(None, [], 0, "")  # type: ignore[arg-type]
    supervisor.announced = True
    supervisor.holding = False
    worker = Worker(3, Role(3, 0, "", ()))
    reader = asyncio.StreamReader()
    for chunk in chunks:
        reader.feed_data(chunk)
    reader.feed_eof()
    await supervisor.relay(worker, reader)
    return supervisor, worker


def test_lines_split_across_reads_arrive_whole_with_the_worker(relayed: Lines) -> None:
    first = json.dumps({"event": "request", "path": "/v1/" + "a" * 300_000}).encode()
    second = json.dumps({"event": "request", "path": "/v1/b"}).encode()
    data = first + b"\n" + second + b"\n"
    asyncio.run(_relay([data[:1000], data[1000:300_005], data[300_005:]]))
    lines = [json.loads(line) for line in relayed.lines]
    assert [(line["worker"], line["path"][:5]) for line in lines] == [(3, "/v1/a"), (3, "/v1/b")]
    assert all(line.endswith("\n") and line.count("\n") == 1 for line in relayed.lines)


def test_half_a_line_from_a_killed_worker_is_counted_never_written(relayed: Lines) -> None:
    with capture_logs() as logs:
        asyncio.run(_relay([b'{"event": "request", "path": "/a"}\n{"event": "req']))
    assert [json.loads(line)["path"] for line in relayed.lines] == ["/a"]
    assert [(log["event"], log["count"]) for log in logs] == [("audit.lines_lost", 1)]


def test_a_line_that_is_not_json_is_described_not_copied(relayed: Lines) -> None:
    asyncio.run(_relay([b"sk-live-secret printed by accident\n"]))
    (line,) = (json.loads(text) for text in relayed.lines)
    assert line == {"worker": 3, "event": "worker.output", "bytes": 35}


@pytest.mark.parametrize(
    "raw",
    [
        b"{'token': 'sk-live-secret'}\n",  # a dict's repr, printed by accident
        b'{"event": "request", "path": "/sk-live-secret\n',  # a fragment
        b"{\n",
        b'{"event": "request"}\rsk-live-secret\n',  # a CR ends no line
        b"{" * 200_000 + b"\n",  # nesting past the parser's recursion
    ],
)
def test_a_line_that_opens_a_brace_but_is_no_json_object_is_described(
    relayed: Lines, raw: bytes
) -> None:
    asyncio.run(_relay([raw]))
    (line,) = (json.loads(text) for text in relayed.lines)  # every relayed line is JSON
    assert line == {"worker": 3, "event": "worker.output", "bytes": len(raw)}


def test_the_rest_of_an_over_long_line_is_dropped_with_it(
    relayed: Lines, monkeypatch: pytest.MonkeyPatch
) -> None:
    import addon.runtime.workers

    monkeypatch.setattr(addon.runtime.workers, "LINE_LIMIT", 1000)
    monkeypatch.setattr(addon.runtime.workers, "READ_CHUNK", 600)
    long = b'{"event": "request", "path": "/' + b"x" * 1500 + b'", "secret": "sk-tail"}\n'
    after = b'{"event": "request", "path": "/after"}\n'
    with capture_logs() as logs:
        asyncio.run(_relay([long[:600], long[600:1200], long[1200:] + after]))
    assert [json.loads(line)["path"] for line in relayed.lines] == ["/after"]
    assert [(log["event"], log["count"]) for log in logs] == [("audit.lines_lost", 1)]
