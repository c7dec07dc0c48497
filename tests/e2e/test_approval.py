"""Requests held for an owner's approval, end to end: a real proxy, a real upstream that
counts what reaches it, and the owner's decision from the CLI in a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme

from store.crypto import Secret
from store.rules import validation
from tests.e2e import raw
from tests.e2e.conftest import CREDPROXY, NAMES, Proxy, start_proxy, stop_proxy
from tests.e2e.relay import pg_database
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e

SECRET = b"sk-held-e2e-secret"
# Shorter than the holds below: a held request must outlive the head deadline.
HEAD_TIMEOUT = "2"


@pytest.fixture(scope="module")
def held_proxy(
    tmp_path_factory: pytest.TempPathFactory,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
) -> Iterator[Proxy]:
    resolve = [f"{name}=127.0.0.1:{shared_upstream.port}" for name in NAMES if name != "localhost"]
    home = tmp_path_factory.mktemp("held")
    extra = ["--head-timeout", HEAD_TIMEOUT, "--max-held", "2", "--admin", "127.0.0.1:0"]
    running = start_proxy(home, upstream_ca, resolve, extra, template=initialised_home)
    yield running
    stop_proxy(running)


def cli(proxy: Proxy, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CREDPROXY, *args], env=proxy.env, cwd=proxy.home, capture_output=True, text=True
    )


def _granted(proxy: Proxy, names: Callable[[str], str], approval: str, hold: str = "20s") -> Any:
    agent, cred = names("agent"), names("cred")
    token = proxy.store.add_principal(agent)
    proxy.store.add_credential(cred, "bearer", ["api.test"], Secret(SECRET))
    limits = validation.limits(None, None, approval=approval, hold=hold)
    grant_id = proxy.store.add_grant(agent, ["GET"], credential=cred, paths=["/v1/"], limits=limits)
    proxy.wait_reload()
    return agent, token, grant_id


def _pending(proxy: Proxy, agent: str, count: int = 1, timeout: float = 10.0) -> list[dict]:
    """The approval.pending events of `agent`, once there are `count` of them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [
            line
            for line in proxy.audit()
            if line.get("event") == "approval.pending" and line.get("principal") == agent
        ]
        if len(found) >= count:
            return found
        time.sleep(0.05)
    raise AssertionError("no approval.pending event")


def _reached(upstream: Upstream, path: str) -> int:
    return sum(1 for r in upstream.log.requests if r.target.startswith(path))


def _send(proxy: Proxy, agent: str, token: str, url: str) -> Future[httpx.Response]:
    pool = ThreadPoolExecutor(1)

    def one() -> httpx.Response:
        with proxy.client(agent, token, timeout=60) as client:
            return client.get(url)

    future = pool.submit(one)
    pool.shutdown(wait=False)
    return future


def test_a_held_request_approved_from_the_cli_completes_stamped(
    held_proxy: Proxy, upstream: Upstream, names
) -> None:
    agent, token, grant_id = _granted(held_proxy, names, "each")
    path = f"/v1/{agent}/held"
    answer = _send(held_proxy, agent, token, f"https://api.test{path}")
    (event,) = _pending(held_proxy, agent)
    assert (event["grant_id"], event["method"], event["path"]) == (grant_id, "GET", path)
    # Held past the head deadline, and nothing has gone upstream.
    time.sleep(float(HEAD_TIMEOUT) + 1)
    assert not answer.done()
    assert _reached(upstream, path) == 0
    listed = json.loads(cli(held_proxy, "request", "list", "--state", "pending", "--json").stdout)
    [row] = [r for r in listed if r["id"] == event["id"]]
    assert (row["kind"], row["grant_id"], row["path"]) == ("hold", grant_id, path)
    approved = cli(held_proxy, "request", "approve", str(event["id"]))
    assert approved.returncode == 0, approved.stderr
    response = answer.result(timeout=10)
    assert response.status_code == 200
    assert _reached(upstream, path) == 1
    [received] = [r for r in upstream.log.requests if r.target.startswith(path)]
    assert received.header("authorization") == [f"Bearer {SECRET.decode()}"]
    [line] = held_proxy.requests(agent)
    assert (line["decision"], line["grant_id"], line["approval"]) == (
        "allow",
        grant_id,
        event["id"],
    )
    # `each`: the next request is held again.
    again = _send(held_proxy, agent, token, f"https://api.test{path}")
    _pending(held_proxy, agent, 2)
    assert not again.done()
    cli(held_proxy, "request", "deny", str(_pending(held_proxy, agent, 2)[1]["id"]))
    assert again.result(timeout=10).status_code == 403


def test_requests_of_one_kind_held_together_go_on_with_one_approval(
    held_proxy: Proxy, upstream: Upstream, names
) -> None:
    agent, token, _ = _granted(held_proxy, names, "first")
    path = f"/v1/{agent}/together"
    answers = [_send(held_proxy, agent, token, f"https://api.test{path}") for _ in range(2)]
    events = _pending(held_proxy, agent, 2)
    assert len({e["id"] for e in events}) == 1  # one kind, one decision
    cli(held_proxy, "request", "approve", str(events[0]["id"]))
    assert [a.result(timeout=10).status_code for a in answers] == [200, 200]
    assert _reached(upstream, path) == 2


def test_a_denied_request_never_reaches_the_upstream(
    held_proxy: Proxy, upstream: Upstream, names
) -> None:
    agent, token, grant_id = _granted(held_proxy, names, "each")
    path = f"/v1/{agent}/denied"
    answer = _send(held_proxy, agent, token, f"https://api.test{path}")
    (event,) = _pending(held_proxy, agent)
    denied = cli(held_proxy, "request", "deny", str(event["id"]), "--reason", "not today")
    assert denied.returncode == 0, denied.stderr
    response = answer.result(timeout=10)
    assert response.status_code == 403
    assert response.headers["x-credproxy-reason"] == "approval-denied"
    assert response.json()["access_request"] == {"id": event["id"], "state": "denied"}
    assert _reached(upstream, path) == 0
    assert SECRET not in response.content
    [line] = held_proxy.requests(agent)
    assert (line["decision"], line["reason"], line["approval"]) == (
        "deny",
        "approval-denied",
        event["id"],
    )
    metrics = _metrics(held_proxy)
    assert 'credproxy_holds_total{outcome="denied"}' in metrics
    assert "credproxy_hold_duration_seconds_count" in metrics
    assert "credproxy_holds_pending 0.0" in metrics


def _metrics(proxy: Proxy) -> str:
    [started] = [line for line in proxy.audit() if line.get("event") == "proxy.started"]
    return httpx.get(f"http://{started['admin'][0]}/metrics").text


def test_a_request_no_one_decides_on_times_out_and_never_reaches_the_upstream(
    held_proxy: Proxy, upstream: Upstream, names
) -> None:
    agent, token, _ = _granted(held_proxy, names, "each", hold="3s")
    path = f"/v1/{agent}/timeout"
    started = time.monotonic()
    with held_proxy.client(agent, token, timeout=30) as client:
        response = client.get(f"https://api.test{path}")
    assert time.monotonic() - started >= 2.5
    assert response.status_code == 403
    assert response.headers["x-credproxy-reason"] == "approval-timeout"
    assert _reached(upstream, path) == 0
    (event,) = _pending(held_proxy, agent)
    listed = json.loads(cli(held_proxy, "request", "list", "--json").stdout)
    [row] = [r for r in listed if r["id"] == event["id"]]
    assert row["state"] == "expired"
    late = cli(held_proxy, "request", "approve", str(event["id"]))
    assert late.returncode == 2 and "expired, not pending" in late.stderr


def test_beyond_the_cap_a_principals_requests_are_refused_at_once(
    held_proxy: Proxy, upstream: Upstream, names
) -> None:
    agent, token, _ = _granted(held_proxy, names, "each")
    path = f"/v1/{agent}/cap"
    held = [_send(held_proxy, agent, token, f"https://api.test{path}/{i}") for i in range(2)]
    events = _pending(held_proxy, agent, 2)
    with held_proxy.client(agent, token) as client:
        third = client.get(f"https://api.test{path}/3")
    assert third.status_code == 429
    assert third.headers["x-credproxy-reason"] == "too-many-holds"
    assert len(_pending(held_proxy, agent, 2)) == 2  # the third was never recorded
    assert "credproxy_holds_pending 2.0" in _metrics(held_proxy)
    for event in events:
        cli(held_proxy, "request", "deny", str(event["id"]))
    assert [f.result(timeout=10).status_code for f in held] == [403, 403]
    assert _reached(upstream, path) == 0


def test_first_holds_the_first_of_a_kind_and_next_n_covers_that_many(
    held_proxy: Proxy, upstream: Upstream, names
) -> None:
    agent, token, grant_id = _granted(held_proxy, names, "first")
    path = f"/v1/{agent}/first"
    answer = _send(held_proxy, agent, token, f"https://api.test{path}")
    (event,) = _pending(held_proxy, agent)
    approved = cli(held_proxy, "request", "approve", str(event["id"]), "--next", "2")
    assert approved.returncode == 0, approved.stderr
    assert answer.result(timeout=10).status_code == 200
    held_proxy.wait_reload()
    with held_proxy.client(agent, token) as client:
        covered = [client.get(f"https://api.test{path}").status_code for _ in range(2)]
    assert covered == [200, 200]
    # Spent: the next one is held again.
    fourth = _send(held_proxy, agent, token, f"https://api.test{path}")
    (_, second) = _pending(held_proxy, agent, 2)
    assert not fourth.done()
    cli(held_proxy, "request", "deny", str(second["id"]))
    assert fourth.result(timeout=10).status_code == 403
    assert _reached(upstream, path) == 3
    lines = [line for line in held_proxy.requests(agent) if line["decision"] == "allow"]
    assert {line["approval"] for line in lines} == {event["id"]}


def test_a_denied_hold_never_spends_a_use(held_proxy: Proxy, upstream: Upstream, names) -> None:
    agent, cred = names("agent"), names("cred")
    token = held_proxy.store.add_principal(agent)
    held_proxy.store.add_credential(cred, "bearer", ["api.test"], Secret(SECRET))
    limits = validation.limits(None, None, 1, approval="each")
    grant_id = held_proxy.store.add_grant(
        agent, ["GET"], credential=cred, paths=["/v1/"], limits=limits
    )
    held_proxy.wait_reload()
    answer = _send(held_proxy, agent, token, f"https://api.test/v1/{agent}")
    (event,) = _pending(held_proxy, agent)
    cli(held_proxy, "request", "deny", str(event["id"]))
    assert answer.result(timeout=10).status_code == 403
    (entry,) = [g for g in held_proxy.store.list_grants() if g.id == grant_id]
    assert entry.uses == 0


def test_a_grant_revoked_while_its_request_is_held_serves_nothing_on_approval(
    held_proxy: Proxy, upstream: Upstream, names
) -> None:
    agent, token, grant_id = _granted(held_proxy, names, "each")
    path = f"/v1/{agent}/revoked"
    answer = _send(held_proxy, agent, token, f"https://api.test{path}")
    (event,) = _pending(held_proxy, agent)
    held_proxy.store.revoke_grant(grant_id)
    held_proxy.wait_reload()
    cli(held_proxy, "request", "approve", str(event["id"]))
    response = answer.result(timeout=10)
    assert (response.status_code, response.headers["x-credproxy-reason"]) == (403, "no-grant")
    assert _reached(upstream, path) == 0


def test_a_request_body_waits_in_the_client_while_held(
    held_proxy: Proxy, upstream: Upstream, names
) -> None:
    agent, cred = names("agent"), names("cred")
    token = held_proxy.store.add_principal(agent)
    held_proxy.store.add_credential(cred, "bearer", ["api.test"], Secret(SECRET))
    limits = validation.limits(None, None, approval="each")
    held_proxy.store.add_grant(agent, ["POST"], credential=cred, paths=["/v1/"], limits=limits)
    held_proxy.wait_reload()
    body = b"x" * (64 * 1024 * 1024)
    sent = threading.Event()

    def upload() -> httpx.Response:
        def chunks() -> Iterator[bytes]:
            for i in range(0, len(body), 65536):
                yield body[i : i + 65536]
            sent.set()

        with held_proxy.client(agent, token, timeout=60) as client:
            return client.post(f"https://api.test/v1/{agent}/upload", content=chunks())

    pool = ThreadPoolExecutor(1)
    answer = pool.submit(upload)
    (event,) = _pending(held_proxy, agent)
    time.sleep(1.0)
    # The proxy does not read a held request's connection: the body cannot all be sent.
    assert not sent.is_set()
    cli(held_proxy, "request", "approve", str(event["id"]))
    response = answer.result(timeout=20)
    pool.shutdown()
    assert response.status_code == 200
    [received] = [r for r in upstream.log.requests if r.target.endswith("/upload")]
    assert received.body == body


@pytest.fixture(scope="module")
def replicas(
    tmp_path_factory: pytest.TempPathFactory,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
) -> Iterator[list[Proxy]]:
    with pg_database("credproxy_held_", required_in_ci=True) as pg_url:
        shared = tmp_path_factory.mktemp("held-shared")
        shutil.copy2(initialised_home / "credproxy.key", shared / "credproxy.key")
        key_file = str(shared / "credproxy.key")
        env = {**os.environ, "CREDPROXY_DB": pg_url, "CREDPROXY_KEY_FILE": key_file}
        subprocess.run([*CREDPROXY, "init"], env=env, cwd=shared, check=True, capture_output=True)
        resolve = [f"{n}=127.0.0.1:{shared_upstream.port}" for n in NAMES if n != "localhost"]
        extra = ["--key-file", key_file, "--shared-rates"]
        running = []
        for label in ("a", "b"):
            home = tmp_path_factory.mktemp(f"held-replica-{label}")
            running.append(
                start_proxy(home, upstream_ca, resolve, extra, template=initialised_home, db=pg_url)
            )
        yield running
        for proxy in running:
            stop_proxy(proxy)


def test_held_on_one_replica_approved_from_the_cli_goes_on_within_a_second(
    replicas: list[Proxy], upstream: Upstream, names
) -> None:
    a, b = replicas
    agent, token, grant_id = _granted(a, names, "each", hold="60s")
    b.wait_reload()
    path = f"/v1/{agent}/replicas"
    answer = _send(a, agent, token, f"https://api.test{path}")
    (event,) = _pending(a, agent)
    assert _pending(b, agent, 0) == []  # held on A only
    # The owner's CLI talks to the store, as it would from another machine.
    approved = cli(b, "request", "approve", str(event["id"]))
    assert approved.returncode == 0, approved.stderr
    # Long before the 60 s hold ends: the decision came through the store.
    response = answer.result(timeout=10)
    assert response.status_code == 200
    assert _reached(upstream, path) == 1
    [line] = a.requests(agent)
    assert (line["grant_id"], line["approval"]) == (grant_id, event["id"])


@pytest.fixture(scope="module")
def receiver(upstream_ca: trustme.CA) -> Iterator[Upstream]:
    with Upstream(upstream_ca, ["hooks.test"]) as hook:
        yield hook


def _notifying_proxy(
    tmp_path_factory: pytest.TempPathFactory,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
    hook_port: int,
) -> Proxy:
    resolve = [f"{name}=127.0.0.1:{shared_upstream.port}" for name in NAMES if name != "localhost"]
    resolve.append(f"hooks.test=127.0.0.1:{hook_port}")
    home = tmp_path_factory.mktemp("notify")
    extra = ["--notify", f"https://hooks.test/hook/{HOOK_TOKEN}"]
    return start_proxy(home, upstream_ca, resolve, extra, template=initialised_home)


HOOK_TOKEN = "T000-hook-token-in-the-url"


@pytest.fixture(scope="module")
def notifying(
    tmp_path_factory: pytest.TempPathFactory,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
    receiver: Upstream,
) -> Iterator[Proxy]:
    running = _notifying_proxy(
        tmp_path_factory, shared_upstream, upstream_ca, initialised_home, receiver.port
    )
    yield running
    stop_proxy(running)


def _events(receiver: Upstream, agent: str, count: int, timeout: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [json.loads(r.body) for r in receiver.log.requests]
        mine = [e for e in found if e.get("principal") == agent]
        if len(mine) >= count:
            return mine
        time.sleep(0.05)
    raise AssertionError(f"the webhook got {len(mine)} events of {agent}, not {count}")


def test_a_webhook_on_loopback_gets_held_and_access_requests(
    notifying: Proxy, receiver: Upstream, upstream: Upstream, names
) -> None:
    agent, token, grant_id = _granted(notifying, names, "each")
    answer = _send(notifying, agent, token, f"https://api.test/v1/{agent}/notified")
    (event,) = _pending(notifying, agent)
    with notifying.client(agent, token) as client:
        assert client.get(f"https://api.test/v2/{agent}?key=query-value").status_code == 403
    held, asked = _events(receiver, agent, 2)
    assert held["event"] == "approval.pending" and held["id"] == event["id"]
    assert (held["grant_id"], held["path"]) == (grant_id, f"/v1/{agent}/notified")
    assert f"credproxy request approve {event['id']}" in held["text"]
    assert asked["event"] == "access_request.recorded"
    assert asked["path"] == f"/v2/{agent}"
    for r in receiver.log.requests:
        assert r.target == f"/hook/{HOOK_TOKEN}" and r.sni == "hooks.test"
        for secret in (SECRET.decode(), token, "query-value"):
            assert secret not in r.body.decode()
    assert HOOK_TOKEN not in notifying.output()
    cli(notifying, "request", "approve", str(event["id"]))
    assert answer.result(timeout=10).status_code == 200


@pytest.fixture
def dead_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])  # closed again: nothing listens there


def test_a_dead_webhook_changes_nothing_for_requests(
    tmp_path_factory: pytest.TempPathFactory,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
    upstream: Upstream,
    dead_port: int,
    names,
) -> None:
    proxy = _notifying_proxy(
        tmp_path_factory, shared_upstream, upstream_ca, initialised_home, dead_port
    )
    try:
        agent, token, _ = _granted(proxy, names, "each")
        with proxy.client(agent, token, timeout=10) as client:
            denied = [client.get(f"https://api.test/v2/{agent}/{i}") for i in range(5)]
        assert [r.status_code for r in denied] == [403] * 5
        assert all("access_request" in r.json() for r in denied)
        answer = _send(proxy, agent, token, f"https://api.test/v1/{agent}/dead")
        (event,) = _pending(proxy, agent)
        cli(proxy, "request", "approve", str(event["id"]))
        assert answer.result(timeout=10).status_code == 200
    finally:
        stop_proxy(proxy)


def test_shared_rates_hold_exactly_across_replicas(
    replicas: list[Proxy], upstream: Upstream, names
) -> None:
    a, b = replicas
    agent, cred = names("agent"), names("cred")
    token = a.store.add_principal(agent)
    a.store.add_credential(cred, "bearer", ["api.test"], Secret(SECRET))
    limits = validation.limits("4/h", None)
    a.store.add_grant(agent, ["GET"], credential=cred, paths=["/v1/"], limits=limits)
    a.wait_reload()
    b.wait_reload()
    path = f"/v1/{agent}/shared"
    barrier = threading.Barrier(16)

    def one(i: int) -> int:
        with (a if i % 2 else b).client(agent, token) as client:
            barrier.wait()
            return client.get(f"https://api.test{path}").status_code

    with ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(one, range(16)))
    assert statuses.count(200) == 4
    assert statuses.count(429) == 12
    assert _reached(upstream, path) == 4


def _held_raw(proxy: Proxy, agent: str, token: str, path: str) -> ssl.SSLSocket:
    """A raw TLS tunnel with one GET of `path` sent on it (the proxy holds it)."""
    tls = raw.tunnel(
        proxy.port, "api.test:443", raw.proxy_auth(agent, token), "api.test", proxy.ca_file
    )
    tls.sendall(f"GET {path} HTTP/1.1\r\nHost: api.test\r\n\r\n".encode())
    return tls


def _never_reached(upstream: Upstream, path: str, connections: int) -> bool:
    """Nothing of `path` reached the upstream, nor did any connection since `connections`
    (the upstream may still be reading what was sent: give it a moment)."""
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        if _reached(upstream, path) or upstream.log.connections != connections:
            return False
        time.sleep(0.05)
    return True


def _request_line(proxy: Proxy, agent: str, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = proxy.requests(agent)
        if lines:
            return lines[0]
        time.sleep(0.05)
    raise AssertionError("no request audit line")


def test_a_held_request_whose_client_left_is_never_sent_on_approval(
    held_proxy: Proxy, upstream: Upstream, names
) -> None:
    agent, token, _ = _granted(held_proxy, names, "each")
    path = f"/v1/{agent}/gone"
    tls = _held_raw(held_proxy, agent, token, path)
    (event,) = _pending(held_proxy, agent)
    connections = upstream.log.connections
    tls.close()  # the agent goes away while its request waits
    cli(held_proxy, "request", "approve", str(event["id"]))  # whether or not it was noticed
    line = _request_line(held_proxy, agent)
    assert _never_reached(upstream, path, connections)
    assert (line["decision"], line["reason"]) == ("deny", "client-gone")


@pytest.mark.parametrize("how", ["close", "reset"])
def test_a_client_leaving_ends_its_hold_at_once(
    held_proxy: Proxy, upstream: Upstream, names, how: str
) -> None:
    agent, token, _ = _granted(held_proxy, names, "each")
    path = f"/v1/{agent}/left"
    tls = _held_raw(held_proxy, agent, token, path)
    (event,) = _pending(held_proxy, agent)
    connections = upstream.log.connections
    if how == "reset":
        tls.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    tls.close()
    # Noticed long before the 20 s hold ends: the request is refused and its hold expired.
    line = _request_line(held_proxy, agent)
    assert (line["decision"], line["reason"]) == ("deny", "client-gone")
    assert line["approval"] == event["id"]
    late = cli(held_proxy, "request", "approve", str(event["id"]))
    assert late.returncode == 2 and "not pending" in late.stderr
    assert _never_reached(upstream, path, connections)
    # Its place stays taken to the hold's end (--max-held 2): leaving and coming back
    # records no more holds than staying would.
    again = _send(held_proxy, agent, token, f"https://api.test{path}/again")
    (_, second) = _pending(held_proxy, agent, 2)
    with held_proxy.client(agent, token) as client:
        third = client.get(f"https://api.test{path}/third")
    assert (third.status_code, third.headers["x-credproxy-reason"]) == (429, "too-many-holds")
    cli(held_proxy, "request", "deny", str(second["id"]))
    assert again.result(timeout=10).status_code == 403


def _apply(proxy: Proxy, tmp_path: Path, text: str) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text(text)
    applied = cli(proxy, "apply", str(policy), "--yes")
    assert applied.returncode == 0, applied.stderr
    proxy.wait_reload()


def _grant_file(grant_id: int, principal: str, cred: str, paths: str, approval: str) -> str:
    return (
        f'[[grant]]\nid = "grant-{grant_id}"\nprincipal = "{principal}"\ncredential = "{cred}"\n'
        f'methods = ["GET"]\npaths = [{paths}]\napproval = "{approval}"\nhold = "20s"\n'
    )


@pytest.mark.parametrize(
    ("change", "reason"), [("path", "path-not-allowed"), ("principal", "no-grant")]
)
def test_a_grant_changed_while_its_request_is_held_serves_nothing_on_approval(
    held_proxy: Proxy, upstream: Upstream, names, tmp_path: Path, change: str, reason: str
) -> None:
    agent, token, grant_id = _granted(held_proxy, names, "each")
    path = f"/v1/{agent}/changed"
    answer = _send(held_proxy, agent, token, f"https://api.test{path}")
    (event,) = _pending(held_proxy, agent)
    # The same grant, updated in place: it no longer serves this request.
    owner, paths = agent, '"/v1/"'
    if change == "path":
        paths = '"/v2/"'
    else:
        owner = names("other")
        held_proxy.store.add_principal(owner)
    _apply(held_proxy, tmp_path, _grant_file(grant_id, owner, names("cred"), paths, "each"))
    cli(held_proxy, "request", "approve", str(event["id"]))
    response = answer.result(timeout=10)
    assert (response.status_code, response.headers["x-credproxy-reason"]) == (403, reason)
    assert _reached(upstream, path) == 0


def test_an_approval_of_first_never_covers_the_principal_a_grant_moved_to(
    held_proxy: Proxy, upstream: Upstream, names, tmp_path: Path
) -> None:
    agent, token, grant_id = _granted(held_proxy, names, "first")
    path = f"/v1/{agent}/moved"
    answer = _send(held_proxy, agent, token, f"https://api.test{path}")
    (event,) = _pending(held_proxy, agent)
    cli(held_proxy, "request", "approve", str(event["id"]))  # covers the kind for good
    assert answer.result(timeout=10).status_code == 200
    other = names("other")
    other_token = held_proxy.store.add_principal(other)
    _apply(held_proxy, tmp_path, _grant_file(grant_id, other, names("cred"), '"/v1/"', "first"))
    # The other principal's first request of that kind waits for its own approval.
    moved = _send(held_proxy, other, other_token, f"https://api.test{path}")
    (second,) = _pending(held_proxy, other)
    assert second["grant_id"] == grant_id and not moved.done()
    cli(held_proxy, "request", "deny", str(second["id"]))
    assert moved.result(timeout=10).status_code == 403
    assert _reached(upstream, path) == 1


@pytest.mark.parametrize("how", ["reset-stream", "close"])
def test_a_held_h2_stream_its_client_gave_up_is_never_sent_on_approval(
    held_proxy: Proxy, upstream: Upstream, names, how: str
) -> None:
    import h2.connection
    import h2.errors

    agent, token, _ = _granted(held_proxy, names, "each")
    path = f"/v1/{agent}/h2-{how}"
    tls = raw.h2_tunnel(held_proxy, raw.proxy_auth(agent, token), "api.test")
    assert tls.selected_alpn_protocol() == "h2"
    conn = h2.connection.H2Connection()
    conn.initiate_connection()
    fields = [(":method", "GET"), (":scheme", "https"), (":authority", "api.test"), (":path", path)]
    conn.send_headers(1, fields, end_stream=True)
    tls.sendall(conn.data_to_send())
    (event,) = _pending(held_proxy, agent)
    connections = upstream.log.connections
    if how == "reset-stream":
        conn.reset_stream(1, h2.errors.ErrorCodes.CANCEL)  # the agent cancels; the connection stays
        tls.sendall(conn.data_to_send())
    else:
        tls.close()
    cli(held_proxy, "request", "approve", str(event["id"]))
    line = _request_line(held_proxy, agent)
    assert _never_reached(upstream, path, connections)
    # Refused before anything was spent or dialled, with the reason.
    assert (line["decision"], line["reason"]) == ("deny", "client-gone")
    tls.close()


@pytest.mark.parametrize("guess", ["2147483648", "9223372036854775808", "9" * 5000])
def test_an_agent_guessing_a_huge_request_id_gets_not_found(
    held_proxy: Proxy, names, guess: str
) -> None:
    agent = names("agent")
    token = held_proxy.store.add_principal(agent)
    held_proxy.wait_reload()
    with httpx.Client(proxy=held_proxy.url(agent, token)) as client:
        found = client.get(f"http://credproxy.internal/access-requests/{guess}")
    assert (found.status_code, found.headers["x-credproxy-reason"]) == (404, "not-found")


@pytest.mark.parametrize(
    ("where", "allowed"), [("localhost", False), ("127.0.0.1", False), ("127.0.0.1", True)]
)
def test_a_webhook_on_loopback_without_allow_private_is_never_dialled(
    tmp_path_factory: pytest.TempPathFactory,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
    upstream: Upstream,
    names,
    where: str,
    allowed: bool,
) -> None:
    with Upstream(upstream_ca, ["localhost", "127.0.0.1"]) as hook:
        resolve = [f"{n}=127.0.0.1:{shared_upstream.port}" for n in NAMES if n != "localhost"]
        home = tmp_path_factory.mktemp("notify-private")
        extra = ["--notify", f"https://{where}:{hook.port}/hook", "--admin", "127.0.0.1:0"]
        if allowed:  # the control: the same webhook, its range opened, gets both events
            extra += ["--allow-private", "127.0.0.0/8"]
        proxy = start_proxy(home, upstream_ca, resolve, extra, template=initialised_home)
        try:
            agent, token, _ = _granted(proxy, names, "each", hold="3s")
            with proxy.client(agent, token, timeout=30) as client:
                held = client.get(f"https://api.test/v1/{agent}/private-hook")
                asked = client.get(f"https://api.test/v2/{agent}")
            assert (held.status_code, asked.status_code) == (403, 403)
            metrics = _metrics_of(proxy)
            deadline = time.monotonic() + 15
            outcome = "sent" if allowed else "failed"
            while f'credproxy_notifications_total{{outcome="{outcome}"}} 2.0' not in metrics:
                assert time.monotonic() < deadline, metrics
                time.sleep(0.2)
                metrics = _metrics_of(proxy)
            assert len(hook.log.requests) == (2 if allowed else 0)
            assert bool(hook.log.connections) == allowed
        finally:
            stop_proxy(proxy)


def _metrics_of(proxy: Proxy) -> str:
    [started] = [line for line in proxy.audit() if line.get("event") == "proxy.started"]
    return httpx.get(f"http://{started['admin'][0]}/metrics").text


def test_max_uses_of_an_approved_grant_hold_exactly_across_replicas(
    replicas: list[Proxy], upstream: Upstream, names
) -> None:
    a, b = replicas
    agent, cred = names("agent"), names("cred")
    token = a.store.add_principal(agent)
    a.store.add_credential(cred, "bearer", ["api.test"], Secret(SECRET))
    limits = validation.limits(None, None, 3, approval="first", hold="30s")
    grant_id = a.store.add_grant(agent, ["GET"], credential=cred, paths=["/v1/"], limits=limits)
    a.wait_reload()
    b.wait_reload()
    path = f"/v1/{agent}/uses"
    first = _send(a, agent, token, f"https://api.test{path}")
    (event,) = _pending(a, agent)
    (entry,) = [g for g in a.store.list_grants() if g.id == grant_id]
    assert entry.uses == 0  # nothing spent while held
    cli(b, "request", "approve", str(event["id"]))  # covers the kind for good
    assert first.result(timeout=10).status_code == 200
    a.wait_reload()
    b.wait_reload()
    barrier = threading.Barrier(12)

    def one(i: int) -> int:
        with (a if i % 2 else b).client(agent, token, timeout=30) as client:
            barrier.wait()
            return client.get(f"https://api.test{path}").status_code

    with ThreadPoolExecutor(12) as pool:
        statuses = list(pool.map(one, range(12)))
    assert sorted(statuses) == [200, 200] + [403] * 10
    assert _reached(upstream, path) == 3


def test_a_shared_hold_one_replicas_client_left_still_serves_the_other(
    replicas: list[Proxy], upstream: Upstream, names
) -> None:
    a, b = replicas
    agent, token, _ = _granted(a, names, "first", hold="60s")
    b.wait_reload()
    path = f"/v1/{agent}/shared-left"
    tls = _held_raw(a, agent, token, path)
    (event,) = _pending(a, agent)
    waiting = _send(b, agent, token, f"https://api.test{path}")
    (joined,) = _pending(b, agent)
    assert joined["id"] == event["id"]  # one kind, one decision, across replicas
    tls.close()  # A's agent leaves: B's request still waits on the decision
    line = _request_line(a, agent)
    assert (line["decision"], line["reason"]) == ("deny", "client-gone")
    assert not waiting.done()
    approved = cli(a, "request", "approve", str(event["id"]))
    assert approved.returncode == 0, approved.stderr
    assert waiting.result(timeout=10).status_code == 200
    assert _reached(upstream, path) == 1


def test_an_approval_of_first_ends_when_a_policy_file_changes_the_grants_credential(
    held_proxy: Proxy, upstream: Upstream, names, tmp_path: Path
) -> None:
    agent, token, grant_id = _granted(held_proxy, names, "first")
    path = f"/v1/{agent}/recredentialed"
    answer = _send(held_proxy, agent, token, f"https://api.test{path}")
    (event,) = _pending(held_proxy, agent)
    cli(held_proxy, "request", "approve", str(event["id"]))  # covers the kind for good
    assert answer.result(timeout=10).status_code == 200
    other = names("admin-cred")
    held_proxy.store.add_credential(other, "bearer", ["api.test"], Secret(b"sk-admin-other"))
    _apply(held_proxy, tmp_path, _grant_file(grant_id, agent, other, '"/v1/"', "first"))
    # The owner approved requests sent with the old credential: the new one asks again.
    again = _send(held_proxy, agent, token, f"https://api.test{path}")
    (_, second) = _pending(held_proxy, agent, 2)
    assert not again.done()
    cli(held_proxy, "request", "deny", str(second["id"]))
    assert again.result(timeout=10).status_code == 403
    assert _reached(upstream, path) == 1


def test_a_session_token_revoked_while_its_request_is_held_sends_nothing_on_approval(
    held_proxy: Proxy, upstream: Upstream, names
) -> None:
    agent, _, _ = _granted(held_proxy, names, "each")
    token_id, session = held_proxy.store.add_token(agent, None)
    held_proxy.wait_reload()
    path = f"/v1/{agent}/revoked-token"
    answer = _send(held_proxy, agent, session, f"https://api.test{path}")
    (event,) = _pending(held_proxy, agent)
    held_proxy.store.revoke_token(token_id)
    held_proxy.wait_reload()
    cli(held_proxy, "request", "approve", str(event["id"]))
    response = answer.result(timeout=10)
    assert (response.status_code, response.headers["x-credproxy-reason"]) == (
        407,
        "auth-required",
    )
    assert _reached(upstream, path) == 0


def test_a_request_whose_token_is_revoked_while_it_is_held_never_goes_on(
    held_proxy: Proxy, upstream: Upstream, names
) -> None:
    """Approved after its session token was revoked: refused, as a new request with that
    token would be, and nothing reaches the upstream."""
    agent, _, _ = _granted(held_proxy, names, "each")
    token_id, token = held_proxy.store.add_token(agent, None)
    held_proxy.wait_reload()
    path = f"/v1/{agent}/revoked"
    answer = _send(held_proxy, agent, token, f"https://api.test{path}")
    (event,) = _pending(held_proxy, agent)
    held_proxy.store.revoke_token(token_id)
    held_proxy.wait_reload()
    approved = cli(held_proxy, "request", "approve", str(event["id"]))
    assert approved.returncode == 0, approved.stderr
    response = answer.result(timeout=10)
    assert (response.status_code, response.headers.get("x-credproxy-reason")) == (
        407,
        "auth-required",
    )
    assert _reached(upstream, path) == 0
