"""The admin listener over a real socket on 127.0.0.1: /healthz, /readyz, /metrics, and refusals."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from addon.observe.admin import PROMETHEUS, AdminServer

METRICS = b"# TYPE credproxy_requests_total counter\ncredproxy_requests_total 3\n"


@dataclass
class Probe:
    """What the admin server is told: readiness and the metrics text, changeable by a test."""

    ready: bool = True
    detail: dict[str, object] = field(default_factory=lambda: {"counter": 7})
    scrapes: int = 0

    def readiness(self) -> tuple[bool, dict[str, object]]:
        return self.ready, self.detail

    def metrics(self) -> bytes:
        self.scrapes += 1
        return METRICS


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> object:
        return json.loads(self.body)


@pytest.fixture
def probe() -> Probe:
    return Probe()


@pytest.fixture
async def admin(probe: Probe) -> AsyncIterator[tuple[str, int]]:
    server = AdminServer("127.0.0.1", 0, probe.readiness, probe.metrics)
    address = await server.start()
    yield address
    await server.close()


async def send(address: tuple[str, int], raw: bytes) -> Answer:
    """Write `raw`, read until the server closes, parse the answer."""
    reader, writer = await asyncio.open_connection(*address)
    writer.write(raw)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return Answer(int(status_line.split()[1]), headers, body)


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: admin\r\n\r\n".encode()


async def test_start_answers_the_address_it_listens_on(admin: tuple[str, int]) -> None:
    host, port = admin
    assert host == "127.0.0.1" and port > 0


async def test_healthz_is_ok(admin: tuple[str, int]) -> None:
    answer = await send(admin, get("/healthz"))
    assert answer.status == 200
    assert answer.headers["content-type"] == "application/json"
    assert answer.json() == {"status": "ok"}


async def test_readyz_reports_ready_with_its_detail(admin: tuple[str, int]) -> None:
    answer = await send(admin, get("/readyz"))
    assert answer.status == 200
    assert answer.json() == {"status": "ready", "counter": 7}


async def test_readyz_is_503_while_not_ready(admin: tuple[str, int], probe: Probe) -> None:
    probe.ready, probe.detail = False, {"reason": "store-unavailable"}
    answer = await send(admin, get("/readyz"))
    assert answer.status == 503
    assert answer.json() == {"status": "not ready", "reason": "store-unavailable"}


async def test_readiness_is_asked_at_each_request(admin: tuple[str, int], probe: Probe) -> None:
    assert (await send(admin, get("/readyz"))).status == 200
    probe.ready = False
    assert (await send(admin, get("/readyz"))).status == 503
    probe.ready = True
    assert (await send(admin, get("/readyz"))).status == 200


async def test_metrics_are_served_as_prometheus_text(admin: tuple[str, int], probe: Probe) -> None:
    answer = await send(admin, get("/metrics"))
    assert answer.status == 200
    assert answer.headers["content-type"] == PROMETHEUS
    assert answer.body == METRICS
    assert answer.headers["content-length"] == str(len(METRICS))
    assert probe.scrapes == 1


async def test_a_query_string_is_ignored(admin: tuple[str, int]) -> None:
    assert (await send(admin, get("/healthz?verbose=1"))).json() == {"status": "ok"}
    assert (await send(admin, get("/metrics?x=1"))).body == METRICS


async def test_every_answer_closes_the_connection(admin: tuple[str, int]) -> None:
    for path in ("/healthz", "/readyz", "/metrics", "/nowhere"):
        assert (await send(admin, get(path))).headers["connection"] == "close"


@pytest.mark.parametrize(
    ("raw", "status", "body"),
    [
        pytest.param(get("/nowhere"), 404, {"error": "not found"}, id="an unknown path is 404"),
        pytest.param(get("/"), 404, {"error": "not found"}, id="the root is 404"),
        pytest.param(
            b"POST /healthz HTTP/1.1\r\nHost: admin\r\nContent-Length: 0\r\n\r\n",
            405,
            {"error": "method not allowed"},
            id="POST to /healthz is 405",
        ),
        pytest.param(
            b"DELETE /readyz HTTP/1.1\r\nHost: admin\r\n\r\n",
            405,
            {"error": "method not allowed"},
            id="DELETE to /readyz is 405",
        ),
        pytest.param(
            b"GARBAGE\r\n\r\n", 400, {"error": "bad request"}, id="a request line of one word"
        ),
    ],
)
async def test_what_it_does_not_serve_is_refused(
    admin: tuple[str, int], raw: bytes, status: int, body: dict[str, str]
) -> None:
    answer = await send(admin, raw)
    assert answer.status == status
    assert answer.headers["content-type"] == "application/json"
    assert answer.json() == body


async def test_a_post_to_metrics_is_refused_without_a_scrape(
    admin: tuple[str, int], probe: Probe
) -> None:
    answer = await send(admin, b"POST /metrics HTTP/1.1\r\nHost: admin\r\n\r\n")
    assert answer.status == 405
    assert probe.scrapes == 0


async def test_a_head_cut_short_is_a_400(admin: tuple[str, int]) -> None:
    reader, writer = await asyncio.open_connection(*admin)
    writer.write(b"GET /healthz HTTP/1.1\r\n")
    writer.write_eof()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert data.startswith(b"HTTP/1.1 400 ")


async def test_close_stops_listening(probe: Probe) -> None:
    server = AdminServer("127.0.0.1", 0, probe.readiness, probe.metrics)
    address = await server.start()
    assert (await send(address, get("/healthz"))).status == 200
    await server.close()
    with pytest.raises(OSError):
        await asyncio.open_connection(*address)


async def test_close_before_start_is_harmless(probe: Probe) -> None:
    await AdminServer("127.0.0.1", 0, probe.readiness, probe.metrics).close()
