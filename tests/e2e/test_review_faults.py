"""Hostile review B: the proxy fails closed and keeps serving everyone else.

Tests under a "Was broken" comment reproduce a finding that has been fixed; a finding not
fixed yet is a test marked `xfail(strict=True)`: it fails on the code it was written
against, and passes once the finding is fixed. The other tests are attacks that held.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme
import wsproto.events as ev
from wsproto import ConnectionType, WSConnection
from wsproto.extensions import PerMessageDeflate

from addon.proxy.live import DB_TIMEOUT
from tests.e2e.conftest import CREDPROXY, NAMES, Proxy, _env, start_proxy, stop_proxy
from tests.e2e.memory import MEMORY_BOUND, MIB, Peak
from tests.e2e.misbehaving import H2Upstream, RawUpstream, head
from tests.e2e.raw import (
    Reply,
    closed_by_peer,
    connect,
    get,
    h2_get,
    h2_streams,
    h2_tunnel,
    proxy_auth,
    read_reply,
    tunnel,
)
from tests.e2e.relay import Relay, pg_database
from tests.e2e.servers import Tarpit, Upgrade, WsUpstream, big_answer
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e

SHORT = ["--head-timeout", "1", "--idle-timeout", "2", "--connect-timeout", "1"]
SHORT += ["--upstream-timeout", "2"]


# -- upstreams that send or swallow huge messages, bombs and drips -------------------------


def _flood_or_sink(count: int) -> Upgrade:
    """By the last path segment: `flood`: one message that never ends, 1 MiB fragments,
    `count` of them; `sink`: reads and drops everything the client sends."""

    def upgrade(sock: ssl.SSLSocket, ws: WSConnection, request: ev.Request) -> None:
        offered = ",".join(request.extensions or [])  # type: ignore[arg-type]
        exts = [PerMessageDeflate()] if "permessage-deflate" in offered else []
        sock.sendall(ws.send(ev.AcceptConnection(extensions=exts)))
        if request.target.endswith("/flood"):
            chunk = b"u" * MIB
            for _ in range(count):
                sock.sendall(ws.send(ev.BytesMessage(chunk, message_finished=False)))

    return upgrade


@pytest.fixture(scope="module")
def ws_upstream(upstream_ca: trustme.CA) -> Iterator[WsUpstream]:
    with WsUpstream(upstream_ca, "ws.test", _flood_or_sink(48), timeout=20) as server:
        yield server


@pytest.fixture(scope="module")
def big_pit(upstream_ca: trustme.CA) -> Iterator[Tarpit]:
    """big.test: answers each request with a 64 MiB body, as fast as it is read."""
    with Tarpit(upstream_ca, answer=big_answer()) as pit:
        yield pit


def _drip(secret: bytes) -> Iterator[bytes]:
    """A 40-byte body of known length, one byte every 0.25 s (10 s in all)."""
    yield b"HTTP/1.1 200 OK\r\nContent-Length: 40\r\n\r\n"
    for _ in range(40):
        time.sleep(0.25)
        yield b"d"


def _h2_drip(conn: Any, stream_id: int, secret: bytes) -> Iterator[None]:
    """_drip over HTTP/2: one DATA frame of one byte every 0.25 s."""
    conn.send_headers(stream_id, [(":status", "200"), ("content-length", "40")])
    for n in range(40):
        yield
        time.sleep(0.25)
        conn.send_data(stream_id, b"d", end_stream=n == 39)
    yield


@pytest.fixture(scope="module")
def drip(upstream_ca: trustme.CA) -> Iterator[RawUpstream]:
    """drip.test: see _drip."""
    with RawUpstream(upstream_ca, ["drip.test"], {"/v1/x": _drip}, linger=1) as server:
        yield server


@pytest.fixture(scope="module")
def h2_drip(upstream_ca: trustme.CA) -> Iterator[H2Upstream]:
    """drip2.test: see _h2_drip."""
    with H2Upstream(upstream_ca, ["drip2.test"], {"/v1/x": _h2_drip}) as server:
        yield server


@pytest.fixture(scope="module")
def bomb_body() -> bytes:
    import gzip

    return gzip.compress(b"\0" * (96 * MIB), 9)


@pytest.fixture(scope="module")
def bomb(upstream_ca: trustme.CA, bomb_body: bytes) -> Iterator[RawUpstream]:
    """bomb.test: every response is the bomb with `Content-Encoding: gzip`, despite the
    proxy's Accept-Encoding: identity (an object stored with that encoding)."""
    answer = head(
        b"HTTP/1.1 200 OK",
        b"Content-Type: application/octet-stream",
        b"Content-Encoding: gzip",
        b"Content-Length: %d" % len(bomb_body),
    )
    scripts = {"/v1/object": lambda s: answer + bomb_body}
    with RawUpstream(upstream_ca, ["bomb.test"], scripts, linger=1) as server:
        yield server


@pytest.fixture(scope="module")
def proxy_b(
    tmp_path_factory: pytest.TempPathFactory,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
    ws_upstream: WsUpstream,
    big_pit: Tarpit,
    bomb: RawUpstream,
    drip: RawUpstream,
    h2_drip: H2Upstream,
) -> Iterator[Proxy]:
    """One proxy with second-long deadlines for the attacks that need nothing else."""
    resolve = [f"{name}=127.0.0.1:{shared_upstream.port}" for name in NAMES if name != "localhost"]
    resolve += [f"ws.test=127.0.0.1:{ws_upstream.port}", f"big.test=127.0.0.1:{big_pit.port}"]
    resolve += [f"bomb.test=127.0.0.1:{bomb.port}", f"drip.test=127.0.0.1:{drip.port}"]
    resolve += [f"drip2.test=127.0.0.1:{h2_drip.port}"]
    home = tmp_path_factory.mktemp("review-b")
    running = start_proxy(home, upstream_ca, resolve, extra=SHORT, template=initialised_home)
    yield running
    stop_proxy(running)


@pytest.fixture
def bystander(proxy_b: Proxy, names: Callable[[str], str]) -> tuple[str, str]:
    """Another principal, with a GET grant on api.test: it must keep being served."""
    name = names("bystander")
    token = proxy_b.store.add_principal(name)
    proxy_b.store.add_grant(name, ["GET"], hosts=["api.test"])
    proxy_b.wait_reload()
    return name, token


@pytest.fixture
def ws_agent(proxy_b: Proxy, names: Callable[[str], str]) -> tuple[str, str]:
    name = names("ws")
    token = proxy_b.store.add_principal(name)
    proxy_b.store.add_grant(name, ["GET"], hosts=["ws.test"], websocket=True)
    proxy_b.wait_reload()
    return name, token


@pytest.fixture
def poster(proxy_b: Proxy, names: Callable[[str], str]) -> tuple[str, str]:
    name = names("poster")
    token = proxy_b.store.add_principal(name)
    proxy_b.store.add_grant(name, ["GET", "POST"], hosts=["api.test"])
    proxy_b.wait_reload()
    return name, token


def ws_open(
    proxy: Proxy, who: tuple[str, str], target: str, deflate: bool = False
) -> tuple[ssl.SSLSocket, WSConnection]:
    sock = tunnel(proxy.port, "ws.test:443", proxy_auth(*who), "ws.test", proxy.ca_file)
    ws = WSConnection(ConnectionType.CLIENT)
    exts = [PerMessageDeflate()] if deflate else []
    sock.sendall(ws.send(ev.Request(host="ws.test", target=target, extensions=exts)))
    sock.settimeout(5)
    while True:
        data = sock.recv(65536)
        assert data, "no handshake answer"
        ws.receive_data(data)
        for event in ws.events():
            if isinstance(event, ev.AcceptConnection):
                return sock, ws
            raise AssertionError(f"handshake refused: {event}")


# -- WebSocket messages ---------------------------------------------------------------------


# Was broken (hostile review): mitmproxy reassembles a WebSocket message in memory without any
# size bound
def test_a_never_ending_websocket_message_from_the_upstream_stays_within_the_memory_bound(
    proxy_b: Proxy, ws_agent, bystander, ws_upstream: WsUpstream
):
    assert get(proxy_b, bystander).status == 200
    with Peak(proxy_b.process.pid) as peak:
        sock, _ = ws_open(proxy_b, ws_agent, "/v1/flood")
        with sock:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and peak.peak - peak.start < 2 * MEMORY_BOUND:
                time.sleep(0.2)
            statuses = [get(proxy_b, bystander).status for _ in range(3)]
    assert statuses == [200] * 3
    assert peak.growth < MEMORY_BOUND, f"grew {peak.growth / MIB:.1f} MiB"


# Was broken (hostile review): an agent's WebSocket message is held whole in the proxy, however
# large
def test_a_never_ending_websocket_message_from_the_agent_stays_within_the_memory_bound(
    proxy_b: Proxy, ws_agent, bystander
):
    assert get(proxy_b, bystander).status == 200
    with Peak(proxy_b.process.pid) as peak:
        sock, ws = ws_open(proxy_b, ws_agent, "/v1/sink")
        with sock:
            chunk = b"a" * MIB
            try:
                for _ in range(48):
                    sock.sendall(ws.send(ev.BytesMessage(chunk, message_finished=False)))
            except OSError:
                pass  # the proxy ended it: what a bound would do
            time.sleep(0.5)
            statuses = [get(proxy_b, bystander).status for _ in range(3)]
    assert statuses == [200] * 3
    assert peak.growth < MEMORY_BOUND, f"grew {peak.growth / MIB:.1f} MiB"


# Was broken: permessage-deflate let 50 KB on the wire inflate to 48 MiB held in the proxy.
# Now the extension is never negotiated, and a compressed frame sent anyway ends the connection.
def test_a_compressed_websocket_bomb_from_the_agent_stays_within_the_memory_bound(
    proxy_b: Proxy, ws_agent, bystander
):
    import struct
    import zlib

    assert get(proxy_b, bystander).status == 200
    sock = tunnel(proxy_b.port, "ws.test:443", proxy_auth(*ws_agent), "ws.test", proxy_b.ca_file)
    ws = WSConnection(ConnectionType.CLIENT)
    request = ev.Request(host="ws.test", target="/v1/sink", extensions=[PerMessageDeflate()])
    with Peak(proxy_b.process.pid) as peak, sock:
        sock.sendall(ws.send(request))
        sock.settimeout(5)
        accepted = None
        while accepted is None:
            data = sock.recv(65536)
            assert data, "no handshake answer"
            ws.receive_data(data)
            accepted = next((e for e in ws.events() if isinstance(e, ev.AcceptConnection)), None)
        assert accepted.extensions == []
        squeeze = zlib.compressobj(9, zlib.DEFLATED, -15)
        payload = squeeze.compress(b"\0" * (48 * MIB)) + squeeze.flush(zlib.Z_SYNC_FLUSH)[:-4]
        assert len(payload) < 200_000
        mask = os.urandom(4)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        frame = b"\xc2\xff" + struct.pack("!Q", len(payload)) + mask + masked  # FIN, RSV1
        try:
            sock.sendall(frame)
            time.sleep(1)
        except OSError:
            pass
        statuses = [get(proxy_b, bystander).status for _ in range(3)]
    assert statuses == [200] * 3
    assert peak.growth < MEMORY_BOUND, f"grew {peak.growth / MIB:.1f} MiB"


def test_a_modest_websocket_message_still_goes_through(proxy_b: Proxy, ws_agent, ws_upstream):
    before = ws_upstream.received
    sock, ws = ws_open(proxy_b, ws_agent, "/v1/sink")
    with sock:
        sock.sendall(ws.send(ev.BytesMessage(b"m" * 100_000)))
        deadline = time.monotonic() + 5
        while ws_upstream.received < before + 100_000 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert ws_upstream.received >= before + 100_000


# -- slow writers ---------------------------------------------------------------------------


def _internal_head(who: tuple[str, str], method: str, path: str, length: int, *extra: str) -> bytes:
    """A request head to credproxy.internal with a JSON body of `length` bytes."""
    return (
        f"{method} http://credproxy.internal{path} HTTP/1.1\r\n"
        "Host: credproxy.internal\r\n"
        f"Proxy-Authorization: {proxy_auth(*who)}\r\n"
        "Content-Type: application/json\r\n"
        + "".join(f"{line}\r\n" for line in extra)
        + f"Content-Length: {length}\r\n\r\n"
    ).encode()


def _trickle(sock: socket.socket | ssl.SSLSocket, seconds: float, gap: float) -> bool:
    """Send one byte every `gap` s for `seconds`; True if the proxy closed the connection."""
    deadline = time.monotonic() + seconds
    sock.settimeout(gap)
    while time.monotonic() < deadline:
        try:
            sock.sendall(b" ")
        except OSError:
            return True
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            continue
        except OSError:
            return True
    return False


# Was broken (hostile review): a body to credproxy.internal trickled a byte at a time has no
# deadline at all
def test_a_body_trickled_to_credproxy_internal_is_cut_off(proxy_b: Proxy, bystander):
    """16 KiB announced, one byte every 0.4 s: the head (1 s), idle (2 s) and upstream (2 s)
    deadlines are all long past after 8 s, yet the proxy holds the connection and its buffer."""
    with socket.create_connection(("127.0.0.1", proxy_b.port)) as sock:
        sock.sendall(_internal_head(bystander, "POST", "/access-requests", 16000) + b"{")
        assert _trickle(sock, seconds=8, gap=0.4)


# Was broken (hostile review): a request body that stops mid-way holds client and upstream
# connection 10 min
def test_a_request_body_that_stalls_midway_is_cut_off(proxy_b: Proxy, poster):
    """Half of an announced body, then silence: nothing of head, idle or upstream timeout
    applies (the request hook, which starts the upstream timer, waits for the body's end)."""
    sock, reply = connect(proxy_b.port, "api.test:443", proxy_auth(*poster))
    assert reply.status == 200
    context = ssl.create_default_context(cafile=str(proxy_b.ca_file))
    with context.wrap_socket(sock, server_hostname="api.test") as tls:
        head = b"POST /v1/upload HTTP/1.1\r\nHost: api.test\r\nContent-Length: 1000\r\n\r\n"
        tls.sendall(head + b"x" * 500)
        assert closed_by_peer(tls, within=8)  # type: ignore[arg-type]


def test_a_request_head_trickled_inside_a_tunnel_is_cut_off(proxy_b: Proxy, bystander):
    """The head deadline (1 s) counts from the first byte of a later head in a tunnel."""
    sock, reply = connect(proxy_b.port, "api.test:443", proxy_auth(*bystander))
    assert reply.status == 200
    context = ssl.create_default_context(cafile=str(proxy_b.ca_file))
    with context.wrap_socket(sock, server_hostname="api.test") as tls:
        tls.sendall(b"GET /v1/x HTTP/1.1\r\nHost: api.test\r\n\r\n")
        assert read_reply(tls).status == 200
        tls.sendall(b"GET /v1/x HTTP/1.1\r\n")
        assert _trickle(tls, seconds=5, gap=0.2)


def test_a_refused_body_trickled_forever_is_cut_off_by_the_idle_deadline(proxy_b: Proxy, bystander):
    """A body to an ungranted path: answered at once, the body dropped, the connection closed
    within the idle deadline however slowly the client keeps sending."""
    sock, reply = connect(proxy_b.port, "api.test:443", proxy_auth(*bystander))
    context = ssl.create_default_context(cafile=str(proxy_b.ca_file))
    with context.wrap_socket(sock, server_hostname="api.test") as tls:
        tls.sendall(b"POST /v1/x HTTP/1.1\r\nHost: api.test\r\nContent-Length: 100000\r\n\r\n")
        assert read_reply(tls).reason == "method-not-allowed"
        assert _trickle(tls, seconds=6, gap=0.3)


# -- the store: PostgreSQL through a relay that can lose its connections -----------------


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    with pg_database("credproxy_rb_") as url:
        yield url


@pytest.fixture(scope="module")
def pg_relay() -> Iterator[Relay]:
    relay = Relay(("127.0.0.1", 5432))
    yield relay
    relay.close()


def _start_pg_proxy(
    home: Path,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
    pg_url: str,
    relay: Relay,
) -> Proxy:
    import shutil
    import subprocess

    shutil.copytree(initialised_home, home, dirs_exist_ok=True)
    env = {**os.environ, "CREDPROXY_DB": pg_url, "CREDPROXY_KEY_FILE": str(home / "credproxy.key")}
    subprocess.run([*CREDPROXY, "init"], env=env, cwd=home, check=True, capture_output=True)
    resolve = [f"{n}=127.0.0.1:{shared_upstream.port}" for n in NAMES if n != "localhost"]
    return start_proxy(
        home,
        upstream_ca,
        resolve,
        extra=["--max-stale", "2", "--drain-timeout", "2"],
        db=pg_url.replace(":5432/", f":{relay.port}/"),
        store_db=pg_url,
    )


@pytest.fixture(scope="module")
def pg_proxy(
    tmp_path_factory: pytest.TempPathFactory,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
    pg_url: str,
    pg_relay: Relay,
) -> Iterator[Proxy]:
    home = tmp_path_factory.mktemp("pg-b")
    running = _start_pg_proxy(
        home, shared_upstream, upstream_ca, initialised_home, pg_url, pg_relay
    )
    yield running
    stop_proxy(running)


@pytest.fixture
def stuck_pg_proxy(
    tmp_path: Path,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
    pg_url: str,
) -> Iterator[tuple[Proxy, Relay, tuple[str, str]]]:
    """A proxy of its own whose database connections are about to die silently."""
    relay = Relay(("127.0.0.1", 5432))
    running = _start_pg_proxy(
        tmp_path, shared_upstream, upstream_ca, initialised_home, pg_url, relay
    )
    name = "stuck-" + os.urandom(3).hex()
    token = running.store.add_principal(name)
    running.store.add_grant(name, ["GET"], hosts=["api.test"])
    running.wait_reload()
    yield running, relay, (name, token)
    if running.process.poll() is None:
        running.process.kill()
        running.process.wait(5)
    running.store.close()
    relay.close()


def _kill_db_connections_silently(proxy: Proxy, relay: Relay, who: tuple[str, str]) -> None:
    # Store calls that overlap, so that the pool holds several connections.
    relay.delay = 0.3
    _denied_burst(proxy, who, "warm", 8)
    relay.delay = 0.0
    relay.blackhole()
    # Four more store calls: each takes a pooled (now dead) connection.
    _denied_burst(proxy, who, "stuck", 8)


def _internal(proxy: Proxy, who: tuple[str, str], method: str, path: str, body: bytes) -> Reply:
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=15) as sock:
        sock.sendall(_internal_head(who, method, path, len(body)) + body)
        return read_reply(sock)


def live_store(proxy: Proxy) -> bool:
    """Is the store answering the proxy (no outage open in its audit stream)?"""
    events = [line["event"] for line in proxy.audit() if line["event"].startswith("store.")]
    return not events or events[-1] == "store.recovered"


def _wait_for(check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


@pytest.fixture
def pg_agent(pg_proxy: Proxy, names: Callable[[str], str]) -> tuple[str, str]:
    name = names("pg")
    token = pg_proxy.store.add_principal(name)
    pg_proxy.store.add_grant(name, ["GET"], hosts=["api.test"])
    pg_proxy.wait_reload()
    return name, token


# Was broken (hostile review): store down: an explicit ask gets 400 bad-request quoting the DB,
# a lookup 500
def test_access_requests_during_a_store_outage_answer_store_unavailable(
    pg_proxy: Proxy, pg_relay: Relay, pg_agent
):
    ask = json.dumps({"host": "api.test", "method": "POST", "path": "/v1/new"}).encode()
    first = _internal(pg_proxy, pg_agent, "POST", "/access-requests", ask)
    assert first.status == 202
    request_id = json.loads(first.body)["id"]
    pg_relay.cut()
    try:
        assert _wait_for(lambda: "store.unavailable" in pg_proxy.output(), 8)
        # Within --max-stale: the policy is still served, the store is not.
        other = json.dumps({"host": "api.test", "method": "PUT", "path": "/v1/new"}).encode()
        asked = _internal(pg_proxy, pg_agent, "POST", "/access-requests", other)
        looked = _internal(pg_proxy, pg_agent, "GET", f"/access-requests/{request_id}", b"")
    finally:
        pg_relay.restore()
    results = [(asked.status, asked.reason), (looked.status, looked.reason)]
    assert results == [(503, "store-unavailable")] * 2
    assert b"postgresql" not in asked.body


def _flood_denials(proxy: Proxy, who: tuple[str, str], seconds: float, workers: int) -> int:
    """Keep-alive plain-http requests to an ungranted host, each on a new path."""
    sent = [0]
    stop = time.monotonic() + seconds

    def worker(w: int) -> None:
        auth = proxy_auth(*who)
        n = 0
        while time.monotonic() < stop:
            try:
                with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
                    while time.monotonic() < stop:
                        n += 1
                        head = (
                            f"GET http://other.test/flood/{w}/{n} HTTP/1.1\r\n"
                            f"Host: other.test\r\nProxy-Authorization: {auth}\r\n\r\n"
                        )
                        sock.sendall(head.encode())
                        read_reply(sock)
                        sent[0] += 1
            except (OSError, ConnectionError):
                time.sleep(0.05)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 15)
    return sent[0]


def test_a_denial_flood_from_one_principal_keeps_the_store_up_for_everyone(
    pg_proxy: Proxy, pg_relay: Relay, pg_agent, names
):
    """Every refused request on a new path is a store call (the pending cap is checked in the
    store), in the same 4-thread pool as the poll and the once-grants."""
    flooder = names("flooder")
    token = pg_proxy.store.add_principal(flooder)
    pg_proxy.wait_reload()
    before = pg_proxy.output().count("store.unavailable")
    results: list[int] = []

    def victim() -> None:
        end = time.monotonic() + 8
        while time.monotonic() < end:
            results.append(get(pg_proxy, pg_agent).status)
            time.sleep(0.5)

    watcher = threading.Thread(target=victim)
    watcher.start()
    try:
        sent = _flood_denials(pg_proxy, (flooder, token), seconds=8, workers=12)
    finally:
        watcher.join(20)
    assert sent > 100
    assert pg_proxy.output().count("store.unavailable") == before
    assert set(results) == {200}


def _denied_burst(proxy: Proxy, who: tuple[str, str], tag: str, count: int) -> list[Reply]:
    """`count` concurrent refused requests on distinct paths: each is a store write."""
    replies: list[Reply] = []

    def one(n: int) -> None:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=15) as sock:
            head = (
                f"GET http://other.test/{tag}/{n} HTTP/1.1\r\nHost: other.test\r\n"
                f"Proxy-Authorization: {proxy_auth(*who)}\r\n\r\n"
            )
            sock.sendall(head.encode())
            try:
                replies.append(read_reply(sock))
            except OSError:
                pass

    threads = [threading.Thread(target=one, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    return replies


# Was broken (hostile review): store calls on silently dead DB connections never time out: the 4
# DB threads stay stuck and the proxy never recovers
def test_the_proxy_recovers_when_old_database_connections_die_silently(stuck_pg_proxy):
    """PostgreSQL fails over (or a NAT entry is lost): the proxy's open connections go
    silent without a reset while new connections reach the database. README: 'Recovery is
    automatic'; 'every store call the proxy makes has a 5-second deadline'."""
    proxy, relay, who = stuck_pg_proxy
    assert get(proxy, who).status == 200
    _kill_db_connections_silently(proxy, relay, who)
    time.sleep(DB_TIMEOUT + 1)  # the calls stuck on dead connections pass their deadline
    # New connections work all along: the proxy serves, or is back within a few polls.
    assert _wait_for(lambda: get(proxy, who).status == 200, 8)
    assert _wait_for(lambda: get(proxy, who).status == 200 and live_store(proxy), 8)


# Was broken (hostile review): with DB threads stuck on dead connections, SIGTERM writes
# proxy.stopped but the process never exits (the executor's threads are joined at exit)
def test_sigterm_exits_even_with_database_calls_stuck_on_dead_connections(stuck_pg_proxy):
    proxy, relay, who = stuck_pg_proxy
    _kill_db_connections_silently(proxy, relay, who)
    time.sleep(DB_TIMEOUT + 1)  # the calls stuck on dead connections pass their deadline
    proxy.process.terminate()
    began = time.monotonic()
    try:
        rc = proxy.process.wait(2 + 5 + 2)  # drain timeout, audit drain, closing
    except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: the finding
        rc = None
    assert "proxy.stopped" in proxy.output()
    assert rc == 0, f"still running {time.monotonic() - began:.1f} s after SIGTERM"


# -- the CLI --------------------------------------------------------------------------------


@pytest.fixture
def cli_home(tmp_path: Path, initialised_home: Path) -> Path:
    import shutil

    shutil.copytree(initialised_home, tmp_path, dirs_exist_ok=True)
    return tmp_path


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        pytest.param(
            "--max-tunnels",
            "\u0663",
            id="--max-tunnels takes an Arabic-Indic digit",
        ),
        pytest.param(
            "--max-stale",
            "\u0661",
            id="--max-stale takes an Arabic-Indic digit",
        ),
        pytest.param(
            "--head-timeout",
            "1_0",
            id="--head-timeout takes 1_0 for ten",
        ),
        pytest.param(
            "--drain-timeout",
            "\uff15",
            id="--drain-timeout takes a fullwidth digit",
        ),
        pytest.param("--alert-streak", "\u0663", id="--alert-streak refuses a Unicode digit"),
        pytest.param("--idle-timeout", "nan", id="--idle-timeout refuses nan"),
        pytest.param("--max-connections", "0", id="--max-connections refuses zero"),
    ],
)
def test_run_refuses_a_number_that_is_not_plain_ascii(cli_home: Path, flag: str, value: str):
    """README: every numeric option is refused with one line and status 2 when it is not a
    plain ASCII number."""
    import subprocess

    args = [*CREDPROXY, "run", "--listen", "127.0.0.1:0", flag, value]
    process = subprocess.Popen(
        args, env=_env(cli_home), cwd=cli_home, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        out, err = process.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        process.terminate()
        out, err = process.communicate(timeout=10)
        pytest.fail(f"{flag} {value!r} was accepted: the proxy ran")
    assert process.returncode == 2
    assert len(err.decode().strip().splitlines()) == 1 and b"Traceback" not in err


# Was broken (hostile review): the 64 KiB check counts the trailing newline that is then
# stripped
def test_a_64_kib_secret_with_its_trailing_newline_is_accepted(cli_home: Path):
    """README: one trailing newline is stripped; a secret may be at most 64 KiB."""
    import subprocess

    secret = b"s" * (64 * 1024) + b"\n"
    args = [*CREDPROXY, "credential", "add", "big", "--scheme", "bearer", "--host", "x.test"]
    done = subprocess.run(
        args, env=_env(cli_home), cwd=cli_home, input=secret, capture_output=True, timeout=20
    )
    assert done.returncode == 0, done.stderr.decode()


# The key cases use a command that needs the key: list commands read none.
@pytest.mark.parametrize(
    ("env", "args"),
    [
        pytest.param(
            {"CREDPROXY_MASTER_KEY": "!!!"}, ["principal", "add", "eve"], id="garbage key"
        ),
        pytest.param({"CREDPROXY_MASTER_KEY": "AAAA"}, ["principal", "add", "eve"], id="short key"),
        pytest.param(
            {"CREDPROXY_KEY_FILE": "/tmp"}, ["principal", "add", "eve"], id="key is a dir"
        ),
        pytest.param({"CREDPROXY_DB": "mysql://x/y"}, ["principal", "list"], id="foreign db"),
        pytest.param(
            {"CREDPROXY_DB": "postgresql://u:sekrit@127.0.0.1:1/db"},
            ["principal", "list"],
            id="unreachable pg, password not shown",
        ),
        pytest.param(
            {"CREDPROXY_DB": "sqlite:////nonexistent/dir/x.db"}, ["init"], id="db in no dir"
        ),
        pytest.param({}, ["grant", "revoke", "99999999999999999999"], id="id past BIGINT"),
        pytest.param(
            {}, ["grant", "add", "p", "--method", "GET", "--expires", "1e999s"], id="huge expiry"
        ),
    ],
)
def test_hostile_cli_input_gets_one_line_and_status_2(cli_home: Path, env, args):
    import subprocess

    before = sorted(p.name for p in cli_home.iterdir())
    done = subprocess.run(
        [*CREDPROXY, *args],
        env={**_env(cli_home), **env},
        cwd=cli_home,
        capture_output=True,
        timeout=20,
        stdin=subprocess.DEVNULL,
    )
    err = done.stderr.decode()
    assert done.returncode == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "sekrit" not in err
    assert sorted(p.name for p in cli_home.iterdir()) == before


# -- signals --------------------------------------------------------------------------------


@pytest.fixture
def own_proxy(
    tmp_path: Path, shared_upstream: Upstream, upstream_ca: trustme.CA, initialised_home: Path
) -> Iterator[Proxy]:
    """A proxy of this test's own, to be signalled."""
    resolve = [f"{name}=127.0.0.1:{shared_upstream.port}" for name in NAMES if name != "localhost"]
    running = start_proxy(
        tmp_path, upstream_ca, resolve, extra=["--drain-timeout", "2"], template=initialised_home
    )
    yield running
    if running.process.poll() is None:
        running.process.kill()
        running.process.wait(5)
    running.store.close()


def _hold_in_flight(proxy: Proxy, who: tuple[str, str]) -> ssl.SSLSocket:
    """A POST whose body stops half-way: in flight until something cuts it."""
    sock, reply = connect(proxy.port, "api.test:443", proxy_auth(*who))
    assert reply.status == 200
    context = ssl.create_default_context(cafile=str(proxy.ca_file))
    tls = context.wrap_socket(sock, server_hostname="api.test")
    tls.sendall(b"POST /v1/up HTTP/1.1\r\nHost: api.test\r\nContent-Length: 100\r\n\r\nxx")
    return tls


@pytest.mark.parametrize(
    "signals",
    [
        pytest.param(["SIGTERM", "SIGHUP", "SIGHUP", "SIGHUP"], id="SIGHUP during the drain"),
        pytest.param(["SIGINT", "SIGINT"], id="a second SIGINT"),
        pytest.param(["SIGHUP", "SIGTERM"], id="SIGTERM right after SIGHUP"),
    ],
)
def test_signals_during_traffic_end_with_proxy_stopped_and_exit_0(own_proxy: Proxy, signals):
    import signal as signal_module

    name = "sig-" + os.urandom(3).hex()
    token = own_proxy.store.add_principal(name)
    own_proxy.store.add_grant(name, ["GET", "POST"], hosts=["api.test"])
    own_proxy.wait_reload()
    held = [_hold_in_flight(own_proxy, (name, token)) for _ in range(3)]
    assert get(own_proxy, (name, token)).status == 200
    try:
        for sig in signals:
            own_proxy.process.send_signal(getattr(signal_module, sig))
            time.sleep(0.3)
        rc = own_proxy.process.wait(15)
    finally:
        for tls in held:
            tls.close()
    lines = own_proxy.output().splitlines()
    events = [json.loads(line).get("event") for line in lines]  # every line is JSON
    assert rc == 0
    assert events[-1] == "proxy.stopped"
    assert "proxy.stopping" in events


# -- many tunnels, each within its own bound -----------------------------------------------


def _h2_never_read(proxy: Proxy, who: tuple[str, str], streams: int) -> ssl.SSLSocket:
    """A tunnel to big.test over h2 with `streams` downloads whose window never opens."""
    import h2.connection

    tls = h2_tunnel(proxy, proxy_auth(*who), "big.test")
    conn = h2.connection.H2Connection()
    conn.initiate_connection()
    conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    request = [(":method", "GET"), (":scheme", "https"), (":authority", "big.test")]
    for n in range(streams):
        conn.send_headers(2 * n + 1, [*request, (":path", f"/v1/big/{n}")], end_stream=True)
    tls.sendall(conn.data_to_send())
    return tls


def test_one_principal_with_many_h2_tunnels_that_never_read_stays_within_the_memory_bound(
    proxy_b: Proxy, names, bystander
):
    """12 tunnels, 5 never-read downloads each (mitmproxy's 5 upstream connections per
    client connection): each stream is reset at its 1 MiB bound and memory is given back."""

    import h2.settings  # noqa: F401 - used by _h2_never_read

    name = names("h2many")
    token = proxy_b.store.add_principal(name)
    proxy_b.store.add_grant(name, ["GET"], hosts=["big.test"])
    proxy_b.wait_reload()
    assert get(proxy_b, bystander).status == 200
    with Peak(proxy_b.process.pid) as peak:
        held = [_h2_never_read(proxy_b, (name, token), streams=5) for _ in range(12)]
        time.sleep(4)
        statuses = [get(proxy_b, bystander).status for _ in range(3)]
        for tls in held:
            tls.close()
    assert statuses == [200] * 3
    assert peak.growth < MEMORY_BOUND, f"grew {peak.growth / MIB:.1f} MiB"


# Was broken (hostile review): an h2 stream reset because its client stopped reading is audited
# as bad-request / bad-request-head
def test_a_slow_h2_reader_is_audited_with_a_reason_that_says_so(proxy_b: Proxy, names):
    import h2.settings  # noqa: F401 - used by _h2_never_read

    name = names("h2slow")
    token = proxy_b.store.add_principal(name)
    proxy_b.store.add_grant(name, ["GET"], hosts=["big.test"])
    proxy_b.wait_reload()
    tls = _h2_never_read(proxy_b, (name, token), streams=1)
    with tls:
        assert _wait_for(lambda: bool(proxy_b.requests(name)), 8)
    [line] = proxy_b.requests(name)
    assert line["decision"] == "error" and line.get("error")
    # The request head was fine: the client stopped reading.
    assert line.get("reason") != "bad-request"
    assert "request-head" not in line["error"]


# -- the SQLite file removed ----------------------------------------------------------------


# Was broken (hostile review): after the store file is deleted, an explicit ask is still written
# to the unlinked file and answered 202
def test_an_access_request_after_the_store_file_is_deleted_is_not_written_to_it(
    own_proxy: Proxy,
):
    name = "gone-" + os.urandom(3).hex()
    token = own_proxy.store.add_principal(name)
    own_proxy.wait_reload()
    database = own_proxy.home / "credproxy.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{database}{suffix}").unlink(missing_ok=True)
    assert _wait_for(lambda: "store.unavailable" in own_proxy.output(), 5)
    ask = json.dumps({"host": "api.test", "method": "GET", "path": "/v1/lost"}).encode()
    reply = _internal(own_proxy, (name, token), "POST", "/access-requests", ask)
    # README: "credproxy never serves on from an unlinked file"; the ask is lost with it.
    assert (reply.status, reply.reason) == (503, "store-unavailable")


def test_a_once_grant_after_the_store_file_is_deleted_is_refused(own_proxy: Proxy):
    name = "gone1-" + os.urandom(3).hex()
    token = own_proxy.store.add_principal(name)
    own_proxy.store.add_grant(name, ["GET"], hosts=["api.test"], once=True)
    own_proxy.wait_reload()
    database = own_proxy.home / "credproxy.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{database}{suffix}").unlink(missing_ok=True)
    assert _wait_for(lambda: "store.unavailable" in own_proxy.output(), 5)
    reply = get(own_proxy, (name, token))
    assert (reply.status, reply.reason) == (503, "store-unavailable")


# -- once-grants under concurrency ----------------------------------------------------------


def test_a_once_grant_raced_by_h2_streams_of_one_tunnel_serves_one(
    proxy_b: Proxy, names, upstream: Upstream
):
    """Twelve concurrent h2 streams in one tunnel, one once-grant: one 200, the rest
    grant-consumed, one request upstream."""
    name = names("once-h2")
    token = proxy_b.store.add_principal(name)
    proxy_b.store.add_grant(name, ["GET"], hosts=["api.test"], paths=["/v1/once"], once=True)
    proxy_b.wait_reload()
    request = [(":method", "GET"), (":scheme", "https"), (":authority", "api.test")]
    with h2_tunnel(proxy_b, proxy_auth(name, token), "api.test") as tls:
        tls.settimeout(5)
        replies = h2_streams(tls, [[*request, (":path", "/v1/once")]] * 12)
    statuses = {n: fields[":status"] for n, (_, fields) in replies.items()}
    reasons = {n: fields.get("x-credproxy-reason", "") for n, (_, fields) in replies.items()}
    assert sorted(statuses.values()) == ["200"] + ["403"] * 11
    assert sorted(reasons.values()) == [""] + ["grant-consumed"] * 11
    assert [r.target for r in upstream.log.requests] == ["/v1/once"]


# -- a stalled stdout at shutdown ------------------------------------------------------------


@pytest.mark.parametrize("reader", ["stalled", "gone"])
def test_sigterm_with_stdout_that_cannot_take_lines_still_exits_promptly(
    tmp_path: Path, upstream_ca: trustme.CA, initialised_home: Path, reader: str
):
    """stdout a pipe that nobody reads (or whose reader has gone), the proxy refusing with
    audit-unavailable; SIGTERM still ends it within the drain timeout plus the 5 s drain."""
    import shutil
    import subprocess

    shutil.copytree(initialised_home, tmp_path, dirs_exist_ok=True)
    env = _env(tmp_path)
    args = [*CREDPROXY, "run", "--listen", "127.0.0.1:0", "--drain-timeout", "1"]
    process = subprocess.Popen(
        args, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        started = json.loads(process.stdout.readline())
        port = int(started["listen"][0].rsplit(":", 1)[1])
        if reader == "gone":
            process.stdout.close()
        refused = None
        for _ in range(3000):  # unauthenticated CONNECTs: one deny line each
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(b"CONNECT api.test:443 HTTP/1.1\r\nHost: api.test:443\r\n\r\n")
                reply = read_reply(sock)
            if reply.reason == "audit-unavailable":
                refused = reply
                break
        assert refused is not None and refused.status == 503
        began = time.monotonic()
        process.terminate()
        rc = process.wait(15)
        took = time.monotonic() - began
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(5)
    assert rc == 0
    assert took < 1 + 5 + 2 + 1
    assert process.stderr is not None and process.stderr.read() == b""


# -- the connection cap ------------------------------------------------------------------------


@pytest.fixture
def capped_proxy(
    tmp_path: Path, shared_upstream: Upstream, upstream_ca: trustme.CA, initialised_home: Path
) -> Iterator[Proxy]:
    resolve = [f"api.test=127.0.0.1:{shared_upstream.port}"]
    extra = ["--max-connections", "8", "--head-timeout", "1"]
    running = start_proxy(tmp_path, upstream_ca, resolve, extra=extra, template=initialised_home)
    yield running
    stop_proxy(running)


# Was broken: --max-connections was one pool for everyone, so a client without a token that
# kept it full shut every principal out. Now connections that have not authenticated have a
# pool of their own (here a quarter of 8) and a newcomer displaces the oldest of the address
# holding the most. The hog is a neighbour on another address (127.0.0.2), as a sandbox on a
# shared network is; one on the principal's own address is in tests/e2e/test_limits.py.
def test_an_unauthenticated_client_cannot_shut_every_principal_out(capped_proxy: Proxy):
    name = "capv-" + os.urandom(3).hex()
    token = capped_proxy.store.add_principal(name)
    capped_proxy.store.add_grant(name, ["GET"], hosts=["api.test"])
    capped_proxy.wait_reload()
    assert get(capped_proxy, (name, token)).status == 200
    stop = time.monotonic() + 6

    def hog() -> None:  # no token, never a byte: each connection lives for the head deadline
        while time.monotonic() < stop:
            try:
                with socket.create_connection(
                    ("127.0.0.1", capped_proxy.port), timeout=3, source_address=("127.0.0.2", 0)
                ) as s:
                    s.settimeout(max(0.01, stop - time.monotonic()))
                    s.recv(1)
            except OSError:
                pass

    hogs = [threading.Thread(target=hog) for _ in range(12)]
    for thread in hogs:
        thread.start()
    time.sleep(0.5)
    served = 0
    for _ in range(5):
        try:
            served += get(capped_proxy, (name, token)).status == 200
        except (OSError, ConnectionError):
            pass
        time.sleep(0.3)
    for thread in hogs:
        thread.join(10)
    assert served >= 4, f"served {served} of 5"


# -- compressed responses to a stamped request ------------------------------------------------


# Was broken: a compressed response to a stamped request was inflated without an output bound.
# Now a chunk that decodes past 8 MiB ends the response: cut, never completed.
def test_a_gzip_bomb_in_a_stamped_response_stays_within_the_memory_bound(
    proxy_b: Proxy, names, bystander, bomb_body: bytes
):
    """An agent stores an object with Content-Encoding: gzip (S3 allows it) and fetches it
    with the stamped credential: 100 KB on the wire, 96 MiB of zeros once inflated."""
    from store.crypto import Secret

    name, cred = names("bomb"), names("bomb-cred")
    token = proxy_b.store.add_principal(name)
    proxy_b.store.add_credential(cred, "bearer", ["bomb.test"], Secret(b"bomb-secret-123"))
    proxy_b.store.add_grant(name, ["GET"], credential=cred)
    proxy_b.wait_reload()
    assert len(bomb_body) < 200_000
    assert get(proxy_b, bystander).status == 200
    received = 0
    with Peak(proxy_b.process.pid) as peak:
        sock, reply = connect(proxy_b.port, "bomb.test:443", proxy_auth(name, token))
        assert reply.status == 200
        context = ssl.create_default_context(cafile=str(proxy_b.ca_file))
        with context.wrap_socket(sock, server_hostname="bomb.test") as tls:
            tls.settimeout(10)
            tls.sendall(b"GET /v1/object HTTP/1.1\r\nHost: bomb.test\r\nConnection: close\r\n\r\n")
            try:
                while data := tls.recv(1 << 20):  # a reader that keeps up
                    received += len(data)
            except (OSError, ssl.SSLError):
                pass
        statuses = [get(proxy_b, bystander).status for _ in range(3)]
    assert statuses == [200] * 3
    assert received < 96 * MIB  # cut: never delivered whole
    assert peak.growth < MEMORY_BOUND, f"grew {peak.growth / MIB:.1f} MiB"


# Was broken (hostile review): credproxy.internal decodes Content-Encoding: a 200-byte brotli
# body inflates to 128 MiB in the proxy (the 16 KiB check is on the wire size)
def test_a_brotli_bomb_to_credproxy_internal_stays_within_the_memory_bound(
    proxy_b: Proxy, bystander
):
    import brotli

    body = brotli.compress(b"\0" * (128 * MIB), quality=5)
    assert len(body) < 1024
    head = _internal_head(bystander, "POST", "/access-requests", len(body), "Content-Encoding: br")
    with Peak(proxy_b.process.pid) as peak:
        with socket.create_connection(("127.0.0.1", proxy_b.port), timeout=15) as sock:
            sock.sendall(head + body)
            reply = read_reply(sock)
        statuses = [get(proxy_b, bystander).status for _ in range(3)]
    assert statuses == [200] * 3
    assert reply.status in (400, 413)
    assert peak.growth < MEMORY_BOUND, f"grew {peak.growth / MIB:.1f} MiB"


# Was broken: a small response of known length was cut by --upstream-timeout while its bytes
# still flowed (the stall timer was only touched for streamed bodies).
@pytest.mark.parametrize("http2", [False, True], ids=["HTTP/1", "HTTP/2"])
def test_a_small_response_that_keeps_flowing_is_not_cut_as_a_stall(
    proxy_b: Proxy, names, http2: bool
):
    """README: 'Upstream stall mid-response (no data for) 30 s'. Here --upstream-timeout is
    2 s and a byte arrives every 0.25 s, for 10 s; held whole, it reaches the client at the
    end, so the client waits longer than `get`'s 10 s."""
    host = "drip2.test" if http2 else "drip.test"
    name = names("drip")
    token = proxy_b.store.add_principal(name)
    proxy_b.store.add_grant(name, ["GET"], hosts=[host])
    proxy_b.wait_reload()
    if http2:
        with h2_tunnel(proxy_b, proxy_auth(name, token), host) as tls:
            tls.settimeout(20)
            answer = h2_get(tls, host, "/v1/x")
        status, body = answer.status, answer.body
    else:
        sock, connected = connect(proxy_b.port, f"{host}:443", proxy_auth(name, token))
        assert connected.status == 200
        context = ssl.create_default_context(cafile=str(proxy_b.ca_file))
        with context.wrap_socket(sock, server_hostname=host) as tls:
            tls.settimeout(20)
            tls.sendall(f"GET /v1/x HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            reply = read_reply(tls)
        status, body = reply.status, reply.body
    assert (status, body) == (200, b"d" * 40)
    line = [r for r in proxy_b.requests(name) if r.get("host") == host][-1]
    assert (line["decision"], line.get("error")) == ("allow", None)
