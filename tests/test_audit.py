"""The audit writer: order, batching after the response, and failing closed when it cannot write."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator

import pytest
import structlog
from mitmproxy.test import taddons

from addon import audit
from addon.hosts import ResolveMap
from addon.proxy import Credproxy
from tests.test_proxy import StaticLive, https_flow, make_policy, reason


class CountingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0
        self.fail = False

    def write(self, text: str) -> int:
        if self.fail:
            raise OSError(32, "Broken pipe")
        self.writes += 1
        return super().write(text)


@pytest.fixture
def stream() -> Iterator[CountingStream]:
    stream = CountingStream()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    audit.configure(stream)
    yield stream
    audit._writer = None
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_outside_the_event_loop_a_line_is_written_at_once(stream: CountingStream) -> None:
    audit.emit("request", {"decision": "allow"})
    assert [line["event"] for line in lines(stream)] == ["request"]


async def test_in_the_loop_lines_go_out_together_after_the_current_step_in_order(
    stream: CountingStream,
) -> None:
    audit.emit("request", {"n": 1})
    audit.logger().warning("something", n=2)
    assert stream.getvalue() == ""  # nothing yet: the response goes out first
    logging.getLogger("mitmproxy.proxy").warning("foreign ?key=secret n=3")  # flushes
    audit.emit("request", {"n": 4})
    await asyncio.sleep(0)
    got = lines(stream)
    assert [line.get("n") for line in got[:2]] == [1, 2]
    assert got[2]["event"] == "foreign ?[query] n=3"
    assert got[3]["n"] == 4
    # Lines 1-3 in one write (the stdlib handler flushes its record), line 4 in another.
    assert stream.writes == 2
    assert all("ts" in line for line in got)


async def test_a_stream_that_cannot_be_written_refuses_requests_until_it_can(
    stream: CountingStream,
) -> None:
    addon = Credproxy(StaticLive(make_policy()), ResolveMap.parse(["api.test=127.0.0.1:1"]))
    stream.fail = True
    audit.emit("request", {"n": 1})
    await asyncio.sleep(0)
    assert not audit.writable()
    with taddons.context(addon):
        flow = https_flow(addon)
        await addon.requestheaders(flow)
        assert reason(flow) == "internal-error"
        stream.fail = False
        await asyncio.sleep(0)  # the deny line is written: the stream works again
        assert audit.writable()
        flow = https_flow(addon)
        await addon.requestheaders(flow)
        assert flow.response is None  # allowed
    # Nothing was lost: the line from before the failure went out with the deny line.
    got = [line for line in stream.getvalue().splitlines() if line]
    assert json.loads(got[0])["n"] == 1
    assert json.loads(got[1])["reason"] == "internal-error"


async def test_a_line_that_cannot_be_rendered_is_still_a_line(stream: CountingStream) -> None:
    audit.emit("request", {("not", "a", "str"): 1})  # type: ignore[dict-item]
    audit.emit("request", {"n": 2})
    await asyncio.sleep(0)
    got = lines(stream)
    assert got[0] == {"event": "audit.unrenderable", "error_type": "TypeError"}
    assert got[1]["n"] == 2
    assert audit.writable()
