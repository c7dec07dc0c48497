"""Limits against a real proxy: hostile heads, half-open lines, connection caps, tarpits, memory."""

from __future__ import annotations

import json
import os
import socket
import ssl
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trustme

from tests.e2e.conftest import NAMES, Proxy, start_proxy, stop_proxy
from tests.e2e.memory import MEMORY_BOUND, Peak
from tests.e2e.raw import closed_by_peer, connect, get, h2_tunnel, proxy_auth, read_reply
from tests.e2e.servers import Tarpit, big_answer
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e

SHORT = ["--head-timeout", "1", "--idle-timeout", "2", "--connect-timeout", "1"]
SHORT += ["--upstream-timeout", "2", "--max-tunnels", "4"]


@pytest.fixture(scope="module")
def blackhole() -> Iterator[int]:
    """A port whose TCP connect never completes: backlog 0, filled by one connection."""
    server = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = server.getsockname()[1]
    filler = socket.create_connection(("127.0.0.1", port))
    yield port
    filler.close()
    server.close()


@pytest.fixture(scope="module")
def pits(upstream_ca: trustme.CA) -> Iterator[tuple[Tarpit, ...]]:
    """A TCP tarpit, a TLS tarpit, one answering with a 1 MiB response head, and one with a
    64 MiB body as fast as it is read."""
    huge = b"HTTP/1.1 200 OK\r\nX-Huge: " + b"h" * (1024 * 1024)
    pits = (
        Tarpit(),
        Tarpit(upstream_ca),
        Tarpit(upstream_ca, answer=huge),
        Tarpit(upstream_ca, answer=big_answer()),
    )
    yield pits
    for pit in pits:
        pit.close()


@pytest.fixture(scope="module")
def limited(
    tmp_path_factory: pytest.TempPathFactory,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
    pits: tuple[Tarpit, ...],
    blackhole: int,
) -> Iterator[Proxy]:
    """A proxy with second-long deadlines and four tunnels per principal."""
    tcp, tls, huge, big = pits
    resolve = [f"{name}=127.0.0.1:{shared_upstream.port}" for name in NAMES if name != "localhost"]
    resolve += [f"tarpit.test=127.0.0.1:{tcp.port}", f"tlspit.test=127.0.0.1:{tls.port}"]
    resolve += [f"hugehead.test=127.0.0.1:{huge.port}", f"big.test=127.0.0.1:{big.port}"]
    resolve += [f"blackhole.test=127.0.0.1:{blackhole}"]
    home = tmp_path_factory.mktemp("limited")
    running = start_proxy(home, upstream_ca, resolve, extra=SHORT, template=initialised_home)
    yield running
    stop_proxy(running)


@pytest.fixture(scope="module")
def agent(limited: Proxy) -> tuple[str, str]:
    name = "limits-" + os.urandom(3).hex()
    token = limited.store.add_principal(name)
    limited.store.add_grant(
        name,
        ["GET"],
        hosts=[
            "api.test",
            "tarpit.test",
            "tlspit.test",
            "hugehead.test",
            "big.test",
            "blackhole.test",
        ],
    )
    limited.wait_reload()
    return name, token


@pytest.fixture
def principal(limited: Proxy, names: Callable[[str], str]) -> tuple[str, str]:
    """A fresh principal with a grant for api.test, so tunnel counts start at zero."""
    name = names("lim")
    token = limited.store.add_principal(name)
    limited.store.add_grant(name, ["GET"], hosts=["api.test"])
    limited.wait_reload()
    return name, token


def send_endless_header(port: int, limit: int = 64 * 1024 * 1024) -> tuple[int, bytes]:
    """Send one header line that never ends, up to `limit` bytes; (bytes sent, reply)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sent = 0
    with sock:
        sock.sendall(b"GET http://api.test/ HTTP/1.1\r\nX-Long: ")
        chunk = b"a" * 65536
        try:
            while sent < limit:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass
        sock.settimeout(2)
        reply = b""
        try:
            while data := sock.recv(65536):
                reply += data
        except OSError:
            pass
    return sent, reply


# -- request heads -------------------------------------------------------------------------


def test_an_endless_header_line_gets_431_and_the_connection_closes(limited: Proxy):
    sent, reply = send_endless_header(limited.port)
    assert sent < 8 * 1024 * 1024, "the proxy kept reading"
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 ")
    assert b"x-credproxy-reason: request-too-large" in head.lower()
    assert b"content-type: application/problem+json" in head.lower()
    assert json.loads(body)["reason"] == "request-too-large"
    line = [r for r in limited.requests() if r.get("reason") == "request-too-large"][-1]
    assert line["decision"] == "deny"


def test_a_flood_of_empty_lines_is_bounded_too(limited: Proxy):
    sock = socket.create_connection(("127.0.0.1", limited.port), timeout=5)
    sent = 0
    with sock:
        try:
            while sent < 8 * 1024 * 1024:
                sock.sendall(b"\r\n" * 32768)
                sent += 65536
        except OSError:
            pass
    assert sent < 8 * 1024 * 1024


def test_a_large_head_within_the_limit_passes(limited: Proxy, agent):
    sock, reply = connect(limited.port, "api.test:443", proxy_auth(*agent))
    context = ssl.create_default_context(cafile=str(limited.ca_file))
    with context.wrap_socket(sock, server_hostname="api.test") as tls:
        padding = "".join(f"X-Pad-{i}: {'p' * 900}\r\n" for i in range(60))  # ~55 KiB
        tls.sendall(f"GET /v1/x HTTP/1.1\r\nHost: api.test\r\n{padding}\r\n".encode())
        assert read_reply(tls).status == 200


def test_a_half_open_connect_line_is_closed_after_the_head_deadline(limited: Proxy):
    sock = socket.create_connection(("127.0.0.1", limited.port))
    with sock:
        sock.sendall(b"CONNECT api.test:443 HTTP/1.1\r\n")
        assert closed_by_peer(sock, within=5)


def test_a_silent_connection_is_closed_after_the_head_deadline(limited: Proxy):
    with socket.create_connection(("127.0.0.1", limited.port)) as sock:
        assert closed_by_peer(sock, within=5)


def test_an_idle_keep_alive_connection_is_closed(limited: Proxy, agent):
    sock, reply = connect(limited.port, "api.test:443", proxy_auth(*agent))
    context = ssl.create_default_context(cafile=str(limited.ca_file))
    with context.wrap_socket(sock, server_hostname="api.test") as tls:
        tls.sendall(b"GET /v1/x HTTP/1.1\r\nHost: api.test\r\n\r\n")
        assert read_reply(tls).status == 200
        # Idle (2 s), not the head deadline (1 s): still open after 1.5 s.
        assert not closed_by_peer(tls, within=1.5)  # type: ignore[arg-type]
        assert closed_by_peer(tls, within=3)  # type: ignore[arg-type]


# -- connection caps -----------------------------------------------------------------------


def test_a_principal_over_its_tunnel_cap_gets_429(limited: Proxy, principal):
    held = []
    try:
        for _ in range(4):
            sock, reply = connect(limited.port, "api.test:443", proxy_auth(*principal))
            held.append(sock)
            assert reply.status == 200
        sock, reply = connect(limited.port, "api.test:443", proxy_auth(*principal))
        held.append(sock)
        assert (reply.status, reply.reason) == (429, "too-many-connections")
        assert reply.headers["content-type"] == "application/problem+json"
        line = limited.requests(principal[0])[-1]
        assert (line["reason"], line["method"]) == ("too-many-connections", "CONNECT")
        # The refused connection is not a tunnel: a request on it is authenticated afresh.
        sock.sendall(b"GET http://api.test/v1/x HTTP/1.1\r\nHost: api.test\r\n\r\n")
        assert read_reply(sock).reason == "auth-required"
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)  # the proxy notices the closes
    assert get(limited, principal).status == 200


@pytest.fixture(scope="module")
def capped(
    tmp_path_factory: pytest.TempPathFactory,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
) -> Iterator[Proxy]:
    resolve = [f"api.test=127.0.0.1:{shared_upstream.port}"]
    home = tmp_path_factory.mktemp("capped")
    extra = ["--max-connections", "10"]
    running = start_proxy(home, upstream_ca, resolve, extra=extra, template=initialised_home)
    yield running
    stop_proxy(running)


def test_connections_over_the_total_cap_are_closed_at_accept(capped: Proxy):
    """Ten tunnels fill the cap of ten: the eleventh connection is closed at accept. (Silent
    connections cannot fill it: they have a pool of their own, see below.)"""
    name = "capped-" + os.urandom(3).hex()
    token = capped.store.add_principal(name)
    capped.store.add_grant(name, ["GET"], hosts=["api.test"])
    capped.wait_reload()
    held = []
    try:
        for _ in range(10):
            sock, reply = connect(capped.port, "api.test:443", proxy_auth(name, token))
            held.append(sock)
            assert reply.status == 200
        with socket.create_connection(("127.0.0.1", capped.port)) as extra:
            assert closed_by_peer(extra, within=2)
        lines = [r for r in capped.requests() if r.get("reason") == "too-many-connections"]
        assert lines[-1]["detail"] == "the proxy is at its connection cap"
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)
    assert get(capped, (name, token)).status == 200


SOURCES = [f"127.0.0.{n}" for n in range(2, 10)]  # the silent peers' addresses


@pytest.fixture(scope="module")
def crowded(
    tmp_path_factory: pytest.TempPathFactory,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
) -> Iterator[Proxy]:
    """Room for 64 connections, 32 of them unauthenticated, 8 per address; silent connections
    are not closed by the head deadline while the test runs."""
    resolve = [f"api.test=127.0.0.1:{shared_upstream.port}"]
    home = tmp_path_factory.mktemp("crowded")
    extra = ["--max-connections", "64", "--max-unauthenticated", "32"]
    extra += ["--max-unauthenticated-per-address", "8", "--head-timeout", "30"]
    extra += ["--admin", "127.0.0.1:0"]
    running = start_proxy(home, upstream_ca, resolve, extra=extra, template=initialised_home)
    yield running
    stop_proxy(running)


def _silent(port: int, source: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), source_address=(source, 0))
    sock.setblocking(False)
    return sock


def _gone(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _connection_metrics(proxy: Proxy) -> dict[str, float]:
    started = next(line for line in proxy.audit() if line["event"] == "proxy.started")
    with urllib.request.urlopen(f"http://{started['admin'][0]}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        name: float(value)
        for name, _, value in (line.rpartition(" ") for line in text.splitlines())
        if "connections" in name and not name.startswith("#")
    }


def test_an_address_holds_at_most_its_cap_of_silent_connections(crowded: Proxy):
    """20 silent connections from one address: the proxy keeps the newest 8."""
    key = 'credproxy_connections_displaced_total{reason="max-unauthenticated-per-address"}'
    before = _connection_metrics(crowded).get(key, 0.0)
    silent = [_silent(crowded.port, "127.0.0.10") for _ in range(20)]
    try:
        deadline = time.monotonic() + 5
        while sum(map(_gone, silent)) < 12 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        gone = [_gone(sock) for sock in silent]
        after = _connection_metrics(crowded)[key]
    finally:
        for sock in silent:
            sock.close()
    assert gone == [True] * 12 + [False] * 8
    assert after - before == 12


def test_a_burst_of_connects_from_one_address_past_its_caps_is_served(
    crowded: Proxy, names: Callable[[str], str]
):
    """40 tunnels opened at once from one address, each CONNECT sent as soon as its
    connection is: more than the address's 8 and the pool's 32 unauthenticated places, but a
    connection whose bytes wait unread is never closed to make room."""
    name = names("burst")
    token = crowded.store.add_principal(name)
    crowded.store.add_grant(name, ["GET"], hosts=["api.test"])
    crowded.wait_reload()
    head = "CONNECT api.test:443 HTTP/1.1\r\nHost: api.test:443\r\n"
    head += f"Proxy-Authorization: {proxy_auth(name, token)}\r\n\r\n"
    burst = []
    try:
        for _ in range(40):
            sock = socket.create_connection(("127.0.0.1", crowded.port), timeout=10)
            sock.sendall(head.encode())
            burst.append(sock)
        statuses = [read_reply(sock).status for sock in burst]
    finally:
        for sock in burst:
            sock.close()
    assert statuses == [200] * 40


def test_two_hundred_silent_connections_leave_two_principals_served(
    crowded: Proxy, names: Callable[[str], str]
):
    """Issue 46: 200 connections that never send a byte, 25 from each of eight addresses (an
    address fills its own cap first, then the pool fills), each reopened
    as soon as the proxy closes it, for as long as two principals make requests (on new
    connections and on a kept tunnel). Every request is answered, the silent ones hold at
    most their pool, and the proxy grows less than 32 MiB."""
    who = []
    for n in range(2):
        name = names(f"crowd{n}")
        token = crowded.store.add_principal(name)
        crowded.store.add_grant(name, ["GET"], hosts=["api.test"])
        who.append((name, token))
    crowded.wait_reload()
    assert [get(crowded, w).status for w in who] == [200, 200]  # warm
    statuses: list[int] = []
    stop = threading.Event()
    reopened = [0]

    def silent_peer(silent: list[socket.socket]) -> None:
        while not stop.is_set():
            for i, sock in enumerate(silent):
                if _gone(sock):
                    sock.close()
                    silent[i] = _silent(crowded.port, SOURCES[i // 25])
                    reopened[0] += 1
            time.sleep(0.01)

    def principal(w: tuple[str, str]) -> None:
        sock, reply = connect(crowded.port, "api.test:443", proxy_auth(*w))
        context = ssl.create_default_context(cafile=str(crowded.ca_file))
        with context.wrap_socket(sock, server_hostname="api.test") as kept:
            kept.settimeout(10)
            for _ in range(15):
                statuses.append(get(crowded, w).status)  # a new connection each time
                kept.sendall(b"GET /v1/x HTTP/1.1\r\nHost: api.test\r\n\r\n")
                statuses.append(read_reply(kept).status)

    with Peak(crowded.process.pid) as peak:
        silent = [_silent(crowded.port, SOURCES[i // 25]) for i in range(200)]
        peer = threading.Thread(target=silent_peer, args=(silent,))
        peer.start()
        try:
            time.sleep(0.5)
            workers = [threading.Thread(target=principal, args=(w,)) for w in who]
            for thread in workers:
                thread.start()
            for thread in workers:
                thread.join(120)
            during = _connection_metrics(crowded)
        finally:
            stop.set()
            peer.join(10)
            for sock in silent:
                sock.close()
    assert statuses == [200] * 60
    assert reopened[0] > 168  # the proxy kept closing them, and they kept coming back
    assert during["credproxy_unauthenticated_connections"] <= 32
    displaced = 'credproxy_connections_displaced_total{reason="max-unauthenticated"}'
    per_address = 'credproxy_connections_displaced_total{reason="max-unauthenticated-per-address"}'
    assert during[displaced] > 0 and during[per_address] > 0
    assert peak.growth < MEMORY_BOUND, f"grew {peak.growth / 2**20:.1f} MiB"


def open_h2_streams(proxy: Proxy, who: tuple[str, str], count: int) -> bool:
    """Open `count` h2 streams, none ended, in one tunnel; True if the proxy ended it."""
    import h2.config
    import h2.connection
    import h2.events

    with h2_tunnel(proxy, proxy_auth(*who), "api.test") as tls:
        assert tls.selected_alpn_protocol() == "h2"
        conn = h2.connection.H2Connection(h2.config.H2Configuration())
        conn.initiate_connection()
        request = [(":method", "POST"), (":scheme", "https"), (":authority", "api.test")]
        for n in range(count):  # before the proxy's SETTINGS arrive: nothing stops us here
            conn.send_headers(2 * n + 1, [*request, (":path", "/v1/x")])
        tls.sendall(conn.data_to_send())
        tls.settimeout(1.5)
        try:
            while data := tls.recv(65536):
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.ConnectionTerminated):
                        return True
                tls.sendall(conn.data_to_send())
        except TimeoutError:
            return False
    return True


def test_a_101st_concurrent_h2_stream_ends_the_connection(limited: Proxy, agent):
    assert not open_h2_streams(limited, agent, 100)
    assert open_h2_streams(limited, agent, 101)


# -- upstream timeouts ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "phase"),
    [
        pytest.param("blackhole.test", "connect-timeout", id="TCP connect never completes"),
        pytest.param("tarpit.test", "connect-timeout", id="TCP tarpit: TLS never completes"),
        pytest.param("tlspit.test", "response-timeout", id="TLS tarpit: no response head"),
    ],
)
def test_a_tarpit_upstream_gets_504_upstream_timeout(limited: Proxy, agent, host, phase):
    started = time.monotonic()
    sock, reply = connect(limited.port, f"{host}:443", proxy_auth(*agent))
    assert reply.status == 200
    context = ssl.create_default_context(cafile=str(limited.ca_file))
    with context.wrap_socket(sock, server_hostname=host) as tls:
        tls.settimeout(10)
        tls.sendall(f"GET /v1/x HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        reply = read_reply(tls)
    assert (reply.status, reply.reason) == (504, "upstream-timeout")
    assert reply.headers["content-type"] == "application/problem+json"
    assert time.monotonic() - started < 8
    line = [r for r in limited.requests(agent[0]) if r.get("host") == host][-1]
    assert (line["decision"], line["reason"], line["error"]) == ("error", "upstream-timeout", phase)


def test_a_huge_upstream_response_head_is_cut_off(limited: Proxy, agent):
    sock, reply = connect(limited.port, "hugehead.test:443", proxy_auth(*agent))
    context = ssl.create_default_context(cafile=str(limited.ca_file))
    with context.wrap_socket(sock, server_hostname="hugehead.test") as tls:
        tls.settimeout(5)
        tls.sendall(b"GET /v1/x HTTP/1.1\r\nHost: hugehead.test\r\n\r\n")
        reply = read_reply(tls)
    assert reply.status == 502
    assert b"hhhh" not in reply.body
    line = [r for r in limited.requests(agent[0]) if r.get("host") == "hugehead.test"][-1]
    # Our fixed phrase, or the error class addon/mitm/wire.py makes of it.
    assert "head exceeds 64 KiB" in line["error"] or "bad-response-head" in line["error"]


# -- memory --------------------------------------------------------------------------------


def test_hostile_clients_stay_within_the_memory_bound(limited: Proxy, principal):
    """64 MiB of one header line, 500 half-open CONNECT lines and the connections they hold,
    while another principal's requests keep succeeding; the proxy grows less than 32 MiB."""
    assert get(limited, principal).status == 200  # warm: TLS contexts, certificates
    sent: list[int] = []

    def endless() -> None:
        sent.append(send_endless_header(limited.port)[0])

    with Peak(limited.process.pid) as peak:
        half_open = []
        for _ in range(500):
            sock = socket.create_connection(("127.0.0.1", limited.port))
            sock.sendall(b"CONNECT api.test:443 HTTP/1.1\r\nHost: api.test:443\r\n")
            half_open.append(sock)
        hostile = [threading.Thread(target=endless) for _ in range(4)]
        for thread in hostile:
            thread.start()
        statuses = [get(limited, principal).status for _ in range(10)]
        for thread in hostile:
            thread.join(30)
        deadline = time.monotonic() + 4  # the head deadline is 1 s
        closed = sum(
            closed_by_peer(sock, within=max(0.01, deadline - time.monotonic()))
            for sock in half_open
        )
        for sock in half_open:
            sock.close()
    assert statuses == [200] * 10
    assert closed == 500
    assert peak.growth < MEMORY_BOUND, f"grew {peak.growth / 2**20:.1f} MiB"
    assert len(sent) == 4 and max(sent) < 8 * 1024 * 1024


def test_an_h2_client_that_stops_reading_gets_its_stream_reset(limited: Proxy, agent, principal):
    """The client never sends WINDOW_UPDATE; the upstream sends 64 MiB as fast as it can."""
    import h2.connection
    import h2.events

    with Peak(limited.process.pid) as peak:
        sock, reply = connect(limited.port, "big.test:443", proxy_auth(*agent))
        context = ssl.create_default_context(cafile=str(limited.ca_file))
        context.set_alpn_protocols(["h2"])
        ended = None
        with context.wrap_socket(sock, server_hostname="big.test") as tls:
            conn = h2.connection.H2Connection()
            conn.initiate_connection()
            request = [(":method", "GET"), (":scheme", "https"), (":authority", "big.test")]
            conn.send_headers(1, [*request, (":path", "/v1/big")], end_stream=True)
            tls.sendall(conn.data_to_send())
            tls.settimeout(0.5)
            deadline = time.monotonic() + 8
            while ended is None and time.monotonic() < deadline:
                try:
                    data = tls.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    break
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.StreamReset | h2.events.ConnectionTerminated):
                        ended = event
        assert get(limited, principal).status == 200
    assert peak.growth < MEMORY_BOUND, f"grew {peak.growth / 2**20:.1f} MiB"
    assert isinstance(ended, h2.events.StreamReset)


def test_an_http1_client_that_stops_reading_holds_the_upstream_back(limited: Proxy, agent):
    """mitmproxy drains the client's socket before reading on: memory stays flat."""
    with Peak(limited.process.pid) as peak:
        sock, reply = connect(limited.port, "big.test:443", proxy_auth(*agent))
        context = ssl.create_default_context(cafile=str(limited.ca_file))
        with context.wrap_socket(sock, server_hostname="big.test") as tls:
            tls.sendall(b"GET /v1/big HTTP/1.1\r\nHost: big.test\r\n\r\n")
            time.sleep(2)
    assert peak.growth < MEMORY_BOUND, f"grew {peak.growth / 2**20:.1f} MiB"


# -- a client without a token on another address -------------------------------------------


@pytest.fixture
def capped_proxy(
    tmp_path: Path, shared_upstream: Upstream, upstream_ca: trustme.CA, initialised_home: Path
) -> Iterator[Proxy]:
    resolve = [f"api.test=127.0.0.1:{shared_upstream.port}"]
    extra = ["--max-connections", "8", "--head-timeout", "1"]
    running = start_proxy(tmp_path, upstream_ca, resolve, extra=extra, template=initialised_home)
    yield running
    stop_proxy(running)


# --max-connections gives connections that have not authenticated a pool of their own (here a
# quarter of 8), and a newcomer displaces the oldest of the address holding the most, so a
# client without a token that keeps it full cannot shut every principal out. The hog is a
# neighbour on another address (127.0.0.2), as a sandbox on a shared network is; hogs on the
# principal's own address are the connection-cap tests above.
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
