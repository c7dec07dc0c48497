"""Two proxy replicas on one PostgreSQL store (the real server on 127.0.0.1:5432).

The replicas reach PostgreSQL through a TCP relay the tests cut and hang for real.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import trustme

from store.crypto import MasterKey, Secret
from store.rules import validation
from tests.e2e.conftest import CREDPROXY, NAMES, Proxy, start_proxy, stop_proxy
from tests.e2e.raw import connect, exchange, proxy_auth, tunnel
from tests.e2e.relay import Relay, pg_database
from tests.e2e.upstream import Answer, Received, Upstream
from tests.proxy.test_sources import Kubelet

pytestmark = pytest.mark.e2e

MAX_STALE = 3.0


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    with pg_database("credproxy_rep_", required_in_ci=True) as url:
        yield url


@pytest.fixture(scope="module")
def relay() -> Iterator[Relay]:
    r = Relay(("127.0.0.1", 5432))
    yield r
    r.close()


@pytest.fixture(scope="module")
def replicas(
    tmp_path_factory: pytest.TempPathFactory,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
    pg_url: str,
    relay: Relay,
) -> Iterator[list[Proxy]]:
    shared = tmp_path_factory.mktemp("shared")
    shutil.copy2(initialised_home / "credproxy.key", shared / "credproxy.key")
    via_relay = pg_url.replace(":5432/", f":{relay.port}/")
    env = {
        **os.environ,
        "CREDPROXY_DB": pg_url,
        "CREDPROXY_KEY_FILE": str(shared / "credproxy.key"),
    }
    subprocess.run([*CREDPROXY, "init"], env=env, cwd=shared, check=True, capture_output=True)
    resolve = [f"{n}=127.0.0.1:{shared_upstream.port}" for n in NAMES if n != "localhost"]
    extra = [
        "--key-file",
        str(shared / "credproxy.key"),
        "--max-stale",
        str(MAX_STALE),
        "--admin",
        "127.0.0.1:0",
    ]
    running = []
    for label in ("a", "b"):
        home = tmp_path_factory.mktemp(f"replica-{label}")
        running.append(
            start_proxy(
                home,
                upstream_ca,
                resolve,
                extra=extra,
                template=initialised_home,
                db=via_relay,
                store_db=pg_url,
            )
        )
    yield running
    for proxy in running:
        stop_proxy(proxy)


@pytest.fixture
def grant(replicas: list[Proxy], names) -> Callable[..., tuple[str, str, str, int]]:
    store = replicas[0].store
    calls = iter(range(100))

    def make(**kw) -> tuple[str, str, str, int]:
        n = next(calls)
        agent, cred = names(f"agent{n}"), names(f"cred{n}")
        token = store.add_principal(agent)
        store.add_credential(cred, "bearer", ["api.test"], Secret(b"replica-secret"))
        grant_id = store.add_grant(agent, ["GET"], credential=cred, **kw)
        for proxy in replicas:
            # Generous: a replica may still be leaving an outage an earlier test caused.
            proxy.wait_reload(timeout=12)
        return agent, token, cred, grant_id

    return make


def get(proxy: Proxy, agent: str, token: str, path: str = "/v1/x") -> httpx.Response:
    with proxy.client(agent, token, timeout=15) as client:
        return client.get(f"https://api.test{path}")


def eventually(check: Callable[[], bool], within: float = 1.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def test_a_once_grant_is_used_once_across_replicas(replicas, upstream: Upstream, grant):
    agent, token, _, _ = grant(once=True)
    barrier = threading.Barrier(32)

    def one(i: int) -> int:
        proxy = replicas[i % 2]
        with proxy.client(agent, token, timeout=15) as client:
            barrier.wait()
            return client.get("https://api.test/v1/once").status_code

    with ThreadPoolExecutor(32) as pool:
        statuses = list(pool.map(one, range(32)))
    assert statuses.count(200) == 1
    assert statuses.count(403) == 31
    assert len(upstream.log.requests) == 1


def test_max_uses_is_exact_across_replicas(replicas, upstream: Upstream, grant):
    agent, token, _, grant_id = grant(limits=validation.limits(None, None, 5))
    barrier = threading.Barrier(32)

    def one(i: int) -> int:
        proxy = replicas[i % 2]
        with proxy.client(agent, token, timeout=15) as client:
            barrier.wait()
            return client.get("https://api.test/v1/counted").status_code

    with ThreadPoolExecutor(32) as pool:
        statuses = list(pool.map(one, range(32)))
    assert statuses.count(200) == 5
    assert statuses.count(403) == 27
    (entry,) = [g for g in replicas[0].store.list_grants() if g.id == grant_id]
    assert (entry.uses, entry.state) == (5, "consumed")


def test_changes_reach_every_replica_within_a_second(replicas, upstream: Upstream, grant, names):
    store = replicas[0].store
    agent, token, cred, grant_id = grant(paths=["/v1/"])
    assert all(get(p, agent, token).status_code == 200 for p in replicas)

    store.rotate_credential(cred, Secret(b"rotated-secret"))

    def every_replica_stamps_the_rotated_secret() -> bool:
        upstream.log.clear()
        served = all(get(p, agent, token).status_code == 200 for p in replicas)
        stamped = [r.header("authorization") for r in upstream.log.requests]
        return served and stamped == [["Bearer rotated-secret"]] * len(replicas)

    # Every replica's request in one round, not only the last one's.
    assert eventually(every_replica_stamps_the_rotated_secret)
    upstream.log.clear()
    assert all(get(p, agent, token).status_code == 200 for p in replicas)
    assert {r.header("authorization")[0] for r in upstream.log.requests} == {
        "Bearer rotated-secret"
    }

    second = store.add_grant(agent, ["GET"], credential=cred, paths=["/v2/"])
    assert eventually(
        lambda: all(get(p, agent, token, "/v2/x").status_code == 200 for p in replicas)
    )

    store.revoke_grant(second)
    assert eventually(
        lambda: all(get(p, agent, token, "/v2/x").status_code == 403 for p in replicas)
    )

    store.remove_principal(agent)
    assert eventually(lambda: all(get_status(p, agent, token) == 407 for p in replicas))


def test_a_principal_added_again_under_its_name_is_another_on_every_replica(
    replicas, upstream: Upstream, grant
):
    """Tunnels the removed principal opened, one on each replica, end with it: the new
    principal of the same name and its grants are not theirs."""
    store = replicas[0].store
    agent, old, cred, _ = grant(paths=["/v1/"])
    request = b"GET /v1/x HTTP/1.1\r\nHost: api.test\r\n\r\n"
    auth = proxy_auth(agent, old)
    tunnels = [tunnel(p.port, "api.test:443", auth, "api.test", p.ca_file) for p in replicas]
    try:
        for tls in tunnels:
            tls.settimeout(10)
            assert exchange(tls, request).status == 200
        store.remove_principal(agent)
        new = store.add_principal(agent)
        store.add_grant(agent, ["GET"], credential=cred, paths=["/v1/"])
        for proxy in replicas:
            proxy.wait_reload(timeout=3)
        replies = [exchange(tls, request) for tls in tunnels]
    finally:
        for tls in tunnels:
            tls.close()
    assert [(r.status, r.reason) for r in replies] == [(407, "auth-required")] * 2
    assert all(get_status(p, agent, old) == 407 for p in replicas)
    assert all(get(p, agent, new).status_code == 200 for p in replicas)


def readyz(proxy: Proxy) -> int:
    started = next(line for line in proxy.audit() if line["event"] == "proxy.started")
    url = f"http://{started['admin'][0]}/readyz"
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as e:
        return e.code


def get_status(proxy: Proxy, agent: str, token: str) -> int:
    try:
        return get(proxy, agent, token).status_code
    except httpx.ProxyError as e:
        return int(str(e).split()[0]) if str(e)[:3].isdigit() else 0


def test_store_outage_serves_the_snapshot_then_refuses_then_recovers(
    replicas, upstream: Upstream, grant, relay: Relay
):
    proxy = replicas[0]
    agent, token, _, _ = grant()
    once_agent, once_token, _, _ = grant(once=True)
    relay.cut()
    try:
        assert eventually(lambda: any(e["event"] == "store.unavailable" for e in proxy.audit()), 3)
        assert readyz(proxy) == 200  # still within --max-stale
        assert get(proxy, agent, token).status_code == 200
        once = get(proxy, once_agent, once_token)
        assert (once.status_code, once.headers["x-credproxy-reason"]) == (503, "store-unavailable")
        time.sleep(MAX_STALE + 0.5)
        # Past --max-stale even the CONNECT is refused, with the reason.
        sock, stale = connect(proxy.port, "api.test:443", proxy_auth(agent, token))
        sock.close()
        assert (stale.status, stale.reason) == (503, "store-unavailable")
        assert any(e["event"] == "store.stale" for e in proxy.audit())
        assert readyz(proxy) == 503
    finally:
        relay.restore()
    assert eventually(lambda: get_status(proxy, agent, token) == 200, 8)
    assert any(e["event"] == "store.recovered" for e in proxy.audit())
    assert readyz(proxy) == 200
    assert get(proxy, once_agent, once_token).status_code == 200


def test_a_hung_database_does_not_stall_standing_grants(replicas, upstream: Upstream, grant, relay):
    agent, token, _, _ = grant()
    relay.hang()
    try:
        time.sleep(0.6)  # at least one poll is now stuck in the database pool
        for _ in range(5):
            # The client's own timeout would raise if the proxy stalled the request.
            assert get(replicas[1], agent, token).status_code == 200
    finally:
        relay.restore()
    assert eventually(lambda: get_status(replicas[1], agent, token) == 200, 10)


def test_kill_9_under_load_never_reuses_a_once_grant(
    replicas,
    upstream: Upstream,
    grant,
    tmp_path: Path,
    upstream_ca,
    initialised_home,
    pg_url,
    relay,
):
    victim = replicas[0]
    agent, token, _, grant_id = grant(once=True)
    stop = threading.Event()

    def hammer(_: int) -> list[int]:
        seen = []
        while not stop.is_set():
            try:
                with victim.client(agent, token, timeout=5) as client:
                    seen.append(client.get("https://api.test/v1/once").status_code)
            except httpx.HTTPError:
                seen.append(0)
        return seen

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(hammer, i) for i in range(8)]
        time.sleep(0.3)
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait(10)
        stop.set()
        statuses = [s for f in futures for s in f.result()]
    assert statuses.count(200) <= 1
    assert len([r for r in upstream.log.requests if r.target == "/v1/once"]) <= 1
    [row] = [g for g in victim.store.list_grants(agent) if g.id == grant_id]
    assert row.state in ("active", "consumed")

    # The restarted replica serves correctly from the same store.
    restarted = start_proxy(
        victim.home,
        upstream_ca,
        [f"api.test=127.0.0.1:{upstream.port}"],
        extra=["--key-file", str(victim.env.get("CREDPROXY_KEY_FILE", ""))]
        if False
        else victim.process.args[victim.process.args.index("--key-file") :][:2],
        db=victim.env["CREDPROXY_DB"],
        store_db=pg_url,
    )
    replicas[0] = restarted
    try:
        upstream.log.clear()
        reply = get(restarted, agent, token)
        assert reply.status_code == (200 if row.state == "active" else 403)
        assert len(upstream.log.requests) == (1 if row.state == "active" else 0)
    finally:
        victim.store.close()


def test_master_key_rotation_reaches_every_replica(replicas, upstream: Upstream, grant, pg_url):
    agent, token, _, _ = grant()
    key_file = replicas[0].process.args[replicas[0].process.args.index("--key-file") + 1]
    env = {**os.environ, "CREDPROXY_DB": pg_url, "CREDPROXY_KEY_FILE": key_file}
    env.pop("CREDPROXY_MASTER_KEY", None)
    subprocess.run([*CREDPROXY, "key", "rotate"], env=env, check=True, capture_output=True)
    time.sleep(1.0)
    upstream.log.clear()
    assert all(get(p, agent, token).status_code == 200 for p in replicas)
    assert {r.header("authorization")[0] for r in upstream.log.requests} == {
        "Bearer replica-secret"
    }


def test_a_key_file_that_reaches_the_replicas_after_the_rotation_is_picked_up(
    replicas, upstream: Upstream, grant
):
    """The store re-sealed under a new key before the replicas' key file holds it (a mounted
    secret propagates late): they serve nothing stamped meanwhile, then pick the key file up
    without waiting for another store change."""
    from store.crypto import load_master_key, write_key_file

    key_file = Path(replicas[0].process.args[replicas[0].process.args.index("--key-file") + 1])
    store = replicas[0].store
    store.key = load_master_key(key_file, {})  # as it stands after the tests before
    agent, token, _, _ = grant()
    new = MasterKey.generate("late")
    store.rotate_key(new)
    store.key = new
    for proxy in replicas:
        proxy.wait_reload(timeout=3)
    upstream.log.clear()
    assert [get_status(p, agent, token) for p in replicas] == [403, 403]
    counter = store.change_counter()
    write_key_file(key_file, new, replace=True)
    assert eventually(lambda: all(get_status(p, agent, token) == 200 for p in replicas), 3)
    assert store.change_counter() == counter  # no store change brought it
    assert {r.header("authorization")[0] for r in upstream.log.requests} == {
        "Bearer replica-secret"
    }


def test_two_replicas_stamp_a_rotated_mounted_secret_and_redact_it(
    replicas: list[Proxy], upstream: Upstream, names, tmp_path: Path
) -> None:
    """One Secret mounted into both replicas (one file here), rotated once as kubelet does:
    each replica reads it for itself and stamps the new value within about a second."""
    (tmp_path / "gh").mkdir()
    mounted = Kubelet(tmp_path / "gh")  # holds gh-secret-one
    store = replicas[0].store
    agent, cred = names("refagent"), names("refcred")
    token = store.add_principal(agent)
    store.add_credential(cred, "bearer", ["api.test"], None, secret_ref=f"file:{mounted.path}")
    store.add_grant(agent, ["GET"], credential=cred)
    for proxy in replicas:
        proxy.wait_reload(timeout=12)

    def stamped(proxy: Proxy) -> str | None:
        upstream.log.clear()
        reply = get(proxy, agent, token, "/echo-auth")
        assert reply.status_code == 200
        assert "gh-secret" not in reply.text  # the echo is redacted on every replica
        sent = [r.header("authorization") for r in upstream.log.requests]
        return sent[-1][0] if sent and sent[-1] else None

    for proxy in replicas:
        assert eventually(lambda p=proxy: stamped(p) == "Bearer gh-secret-one", within=6)
    mounted.write(b"gh-secret-two\n")
    for proxy in replicas:
        assert eventually(lambda p=proxy: stamped(p) == "Bearer gh-secret-two", within=4)

    def echo_old(received: Received) -> Answer | None:
        if not received.target.startswith("/echo-old"):
            return None
        return 200, [("x-echo", "gh-secret-one")], b'{"late": "gh-secret-one"}'

    # A late echo of the old value, after the rotation: redacted by both replicas (grace).
    before, upstream.server.app = upstream.server.app, echo_old
    try:
        for proxy in replicas:
            reply = get(proxy, agent, token, "/echo-old")
            assert reply.status_code == 200 and "late" in reply.text
            assert "gh-secret-one" not in reply.text + str(reply.headers)
    finally:
        upstream.server.app = before
    for proxy in replicas:
        assert "gh-secret" not in proxy.output()
