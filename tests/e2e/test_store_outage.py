"""A PostgreSQL store that goes away under a running proxy, through a relay that can cut or
blackhole its connections: access requests answer store-unavailable, a flood of denials
cannot take the store down for others, and silently dead connections neither stall the proxy
nor keep it from exiting."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trustme

from addon.proxy.live import DB_TIMEOUT
from tests.e2e.conftest import (
    CREDPROXY,
    NAMES,
    Proxy,
    _internal,
    _wait_for,
    start_proxy,
    stop_proxy,
)
from tests.e2e.raw import Reply, get, proxy_auth, read_reply
from tests.e2e.relay import Relay, pg_database
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e


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


def live_store(proxy: Proxy) -> bool:
    """Is the store answering the proxy (no outage open in its audit stream)?"""
    events = [line["event"] for line in proxy.audit() if line["event"].startswith("store.")]
    return not events or events[-1] == "store.recovered"


@pytest.fixture
def pg_agent(pg_proxy: Proxy, names: Callable[[str], str]) -> tuple[str, str]:
    name = names("pg")
    token = pg_proxy.store.add_principal(name)
    pg_proxy.store.add_grant(name, ["GET"], hosts=["api.test"])
    pg_proxy.wait_reload()
    return name, token


# Store down: an explicit ask and a lookup both answer 503 store-unavailable, never a
# 400 bad-request quoting the database or a 500.
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


# Store calls on silently dead database connections time out, so the 4 database threads are
# never all stuck and the proxy recovers.
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


# With database threads stuck on dead connections, SIGTERM still ends the process after
# proxy.stopped (the executor's threads are not joined at exit).
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
