"""The webhook notifier: its URL checked once, its payloads, retries, a bounded queue."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator

import pytest
import trustme

from addon.observe.metrics import Metrics
from addon.proxy.dns import FORBIDDEN, LookupFailed
from addon.proxy.notify import Notifier, Webhook, payload
from store.errors import InvalidInput
from tests.e2e.upstream import Received, Upstream

HELD = {
    "id": 7,
    "principal": "agent",
    "grant_id": 3,
    "host": "api.test",
    "port": 443,
    "method": "POST",
    "path": "/v1/issues",
    "hold_s": 120,
}


@pytest.mark.parametrize(
    ("url", "parsed"),
    [
        pytest.param("https://hooks.test/T0/B1/tok", ("hooks.test", 443, "/T0/B1/tok"), id="slack"),
        pytest.param("https://Hooks.Test:8443", ("hooks.test", 8443, "/"), id="port, no path"),
        pytest.param("https://hooks.test/h?k=v", ("hooks.test", 443, "/h?k=v"), id="query kept"),
    ],
)
def test_a_webhook_url_is_parsed_once(url: str, parsed: tuple[str, int, str]) -> None:
    hook = Webhook.parse(url)
    assert (hook.host, hook.port, hook.target) == parsed


@pytest.mark.parametrize(
    "url",
    [
        pytest.param("http://hooks.test/secret-token", id="not https"),
        pytest.param("https://user:secret-token@hooks.test/", id="userinfo"),
        pytest.param("https://hooks.test/secret-token#frag", id="fragment"),
        pytest.param("https:///secret-token", id="no host"),
        pytest.param("https://hooks.test:99999/secret-token", id="bad port"),
        pytest.param("https://hooks.test/secret token", id="a space in the path"),
    ],
)
def test_a_bad_webhook_url_is_refused_without_quoting_it(url: str) -> None:
    with pytest.raises(InvalidInput) as info:
        Webhook.parse(url)
    assert "secret-token" not in str(info.value)
    assert str(info.value) == "invalid --notify URL: use https://HOST[:PORT]/PATH"


def test_a_payload_is_slack_compatible_and_carries_the_fields() -> None:
    body = payload("approval.pending", HELD)
    assert body["event"] == "approval.pending"
    assert "credproxy request approve 7" in body["text"]
    assert "POST api.test:443/v1/issues" in body["text"]
    assert {k: body[k] for k in HELD} == HELD


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def cafile(ca: trustme.CA, tmp_path) -> str:  # type: ignore[no-untyped-def]
    path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


def _metrics() -> Metrics:
    return Metrics(snapshot_age=lambda: 0.0, store_up=lambda: True)


def _count(metrics: Metrics, outcome: str) -> float:
    value = metrics.registry.get_sample_value("credproxy_notifications_total", {"outcome": outcome})
    return value or 0.0


async def _drain(notifier: Notifier, done, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    notifier.running()
    try:
        deadline = asyncio.get_running_loop().time() + timeout
        while not done() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
    finally:
        notifier.done()


def test_a_receiver_gets_the_event_over_verified_tls(ca: trustme.CA, cafile: str) -> None:
    with Upstream(ca, ["hooks.test"]) as receiver:

        async def dial(host: str, port: int) -> tuple[str, int]:
            return ("127.0.0.1", receiver.port)

        metrics = _metrics()
        notifier = Notifier(Webhook.parse("https://hooks.test/hook"), dial, metrics, cafile)

        async def run() -> None:
            notifier.post("approval.pending", HELD)
            await _drain(notifier, lambda: _count(metrics, "sent") == 1)

        asyncio.run(run())
        [received] = receiver.log.requests
    assert (received.method, received.target, received.sni) == ("POST", "/hook", "hooks.test")
    assert received.header("content-type") == ["application/json"]
    assert json.loads(received.body)["id"] == 7


def test_a_receiver_whose_certificate_does_not_verify_gets_nothing(cafile: str) -> None:
    other = trustme.CA()  # not the one the notifier trusts
    with Upstream(other, ["hooks.test"]) as receiver:

        async def dial(host: str, port: int) -> tuple[str, int]:
            return ("127.0.0.1", receiver.port)

        metrics = _metrics()
        notifier = Notifier(
            Webhook.parse("https://hooks.test/hook"), dial, metrics, cafile, backoff=0.01
        )

        async def run() -> None:
            notifier.post("approval.pending", HELD)
            await _drain(notifier, lambda: _count(metrics, "failed") == 1)

        asyncio.run(run())
        assert receiver.log.requests == []


def test_a_failing_receiver_is_tried_again_then_given_up(ca: trustme.CA, cafile: str) -> None:
    def refuse(_: Received) -> tuple[int, list[tuple[str, str]], bytes]:
        return 500, [], b"no"

    with Upstream(ca, ["hooks.test"], refuse) as receiver:

        async def dial(host: str, port: int) -> tuple[str, int]:
            return ("127.0.0.1", receiver.port)

        metrics = _metrics()
        notifier = Notifier(
            Webhook.parse("https://hooks.test/hook"), dial, metrics, cafile, backoff=0.01
        )

        async def run() -> None:
            notifier.post("approval.pending", HELD)
            await _drain(notifier, lambda: _count(metrics, "failed") == 1)

        asyncio.run(run())
        assert len(receiver.log.requests) == 3


def test_a_destination_the_guard_refuses_is_never_dialled(cafile: str) -> None:
    dialled = []

    async def dial(host: str, port: int) -> tuple[str, int]:
        dialled.append(host)
        raise LookupFailed(FORBIDDEN)

    metrics = _metrics()
    notifier = Notifier(
        Webhook.parse("https://hooks.test/hook"), dial, metrics, cafile, backoff=0.01
    )

    async def run() -> None:
        notifier.post("approval.pending", HELD)
        await _drain(notifier, lambda: _count(metrics, "failed") == 1)

    asyncio.run(run())
    assert dialled == ["hooks.test"] * 3


@pytest.fixture
def hanging() -> Iterator[int]:
    """A server that accepts and never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()


def test_a_hanging_receiver_never_blocks_a_post_and_beyond_the_queue_events_drop(
    hanging: int, cafile: str
) -> None:
    async def dial(host: str, port: int) -> tuple[str, int]:
        return ("127.0.0.1", hanging)

    metrics = _metrics()
    notifier = Notifier(
        Webhook.parse("https://hooks.test/hook"),
        dial,
        metrics,
        cafile,
        queue_size=4,
        timeout=0.2,
        backoff=0.01,
    )

    async def run() -> None:
        notifier.running()
        notifier.post("approval.pending", HELD)
        await asyncio.sleep(0.05)  # the sender took it, and waits on the receiver
        for _ in range(9):
            notifier.post("approval.pending", HELD)  # returns at once, whatever the receiver does
        await asyncio.sleep(0.05)
        notifier.done()

    asyncio.run(run())
    # One is being sent, four wait: the other five were dropped and counted.
    assert _count(metrics, "dropped") == 5


def test_run_refuses_a_bad_notify_url_in_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "addon.cli.cli",
            "run",
            "--notify",
            "http://hooks.test/secret-token",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr == "credproxy: error: invalid --notify URL: use https://HOST[:PORT]/PATH\n"
    assert list(tmp_path.iterdir()) == []


def test_a_redirecting_receiver_is_never_followed(ca: trustme.CA, cafile: str) -> None:
    def redirect(_: Received) -> tuple[int, list[tuple[str, str]], bytes]:
        return 307, [("Location", "https://elsewhere.test/steal")], b""

    with Upstream(ca, ["hooks.test"], redirect) as receiver:
        dialled: list[str] = []

        async def dial(host: str, port: int) -> tuple[str, int]:
            dialled.append(host)
            return ("127.0.0.1", receiver.port)

        metrics = _metrics()
        notifier = Notifier(
            Webhook.parse("https://hooks.test/hook"), dial, metrics, cafile, backoff=0.01
        )

        async def run() -> None:
            notifier.post("approval.pending", HELD)
            await _drain(notifier, lambda: _count(metrics, "failed") == 1)

        asyncio.run(run())
    assert dialled == ["hooks.test"] * 3  # tried again, never where it pointed
    assert all(r.target == "/hook" for r in receiver.log.requests)


@pytest.fixture
def endless(ca: trustme.CA) -> Iterator[int]:
    """A TLS receiver whose status line never ends: it writes until the peer goes."""
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("hooks.test").configure_cert(context)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            sent = 0
            try:
                with context.wrap_socket(conn, server_side=True) as tls:
                    tls.settimeout(2)
                    tls.recv(65536)
                    tls.sendall(b"HTTP/1.1 200 ")
                    while not stop.is_set() and sent < 64 * 1024 * 1024:
                        tls.sendall(b"A" * 65536)
                        sent += 65536
            except OSError:
                pass

    thread = threading.Thread(target=serve)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join()
    listener.close()


def test_a_receiver_answering_without_end_is_given_up(endless: int, cafile: str) -> None:
    port = endless

    async def dial(host: str, p: int) -> tuple[str, int]:
        return ("127.0.0.1", port)

    metrics = _metrics()
    notifier = Notifier(Webhook.parse("https://hooks.test/hook"), dial, metrics, cafile, attempts=1)

    async def run() -> None:
        notifier.post("approval.pending", HELD)
        await _drain(notifier, lambda: _count(metrics, "failed") == 1)

    asyncio.run(run())
    assert _count(metrics, "failed") == 1 and _count(metrics, "sent") == 0
