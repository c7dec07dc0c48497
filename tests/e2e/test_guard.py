"""The destination guard and the admin listener, on a proxy that opens 127.0.0.0/8."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trustme

from store.crypto import Secret
from tests.e2e.conftest import Proxy, start_proxy, stop_proxy
from tests.e2e.raw import absolute_form, connect, exchange, proxy_auth
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def open_proxy(
    tmp_path_factory: pytest.TempPathFactory,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
) -> Iterator[Proxy]:
    home = tmp_path_factory.mktemp("open")
    extra = [
        "--allow-private",
        "127.0.0.0/8",
        "--allow-private",
        "::1/128",
        "--allow-private",
        "::ffff:0:0/96",
        "--admin",
        "127.0.0.1:0",
        "--alert-streak",
        "5",
    ]
    running = start_proxy(home, upstream_ca, [], extra=extra, template=initialised_home)
    yield running
    stop_proxy(running)


def admin_port(proxy: Proxy) -> int:
    started = next(line for line in proxy.audit() if line["event"] == "proxy.started")
    return int(started["admin"][0].rsplit(":", 1)[1])


def test_health_endpoints(open_proxy: Proxy):
    base = f"http://127.0.0.1:{admin_port(open_proxy)}"
    with urllib.request.urlopen(base + "/healthz", timeout=5) as reply:
        assert json.load(reply)["status"] == "ok"
    with urllib.request.urlopen(base + "/readyz", timeout=5) as reply:
        assert json.load(reply)["status"] == "ready"


def test_allow_private_opens_loopback_by_name(open_proxy: Proxy, upstream: Upstream, names):
    agent = names("agent")
    token = open_proxy.store.add_principal(agent)
    open_proxy.store.add_credential(
        names("c"), "bearer", [f"localhost:{upstream.port}"], Secret(b"loop-secret")
    )
    open_proxy.store.add_grant(agent, ["GET"], credential=names("c"))
    open_proxy.wait_reload()
    with open_proxy.client(agent, token) as client:
        reply = client.get(f"https://localhost:{upstream.port}/v1/x")
    assert reply.status_code == 200
    assert upstream.log.requests[0].header("authorization") == ["Bearer loop-secret"]
    assert upstream.log.snis == ["localhost"]


def test_the_admin_listener_is_never_reachable_through_the_proxy(
    open_proxy: Proxy, upstream: Upstream, names
):
    port = admin_port(open_proxy)
    agent = names("agent")
    token = open_proxy.store.add_principal(agent)
    open_proxy.store.add_grant(agent, ["*"], hosts=[f"localhost:{port}"])
    open_proxy.wait_reload()
    with open_proxy.client(agent, token) as client:
        reply = client.get(f"http://localhost:{port}/healthz")
    assert reply.status_code == 403
    assert reply.headers["x-credproxy-reason"] == "destination-forbidden"
    sock, connect_reply = connect(open_proxy.port, f"127.0.0.1:{port}", proxy_auth(agent, token))
    sock.close()
    assert connect_reply.status == 403


@pytest.mark.parametrize(
    "spelling",
    [
        pytest.param("[::ffff:127.0.0.1]", id="IPv4-mapped, dotted"),
        pytest.param("[::ffff:7f00:1]", id="IPv4-mapped, hex"),
    ],
)
def test_no_spelling_of_the_admin_address_is_reachable_through_the_proxy(
    open_proxy: Proxy, names, spelling: str
):
    port = admin_port(open_proxy)
    agent = names("agent")
    token = open_proxy.store.add_principal(agent)
    open_proxy.store.add_grant(agent, ["*"], hosts=[f"{spelling}:{port}"])
    open_proxy.wait_reload()
    sock, tunnel = connect(open_proxy.port, f"{spelling}:{port}", proxy_auth(agent, token))
    with sock:
        assert tunnel.status == 200
        reply = exchange(sock, f"GET /metrics HTTP/1.1\r\nHost: {spelling}:{port}\r\n\r\n".encode())
    assert (reply.status, reply.reason) == (403, "destination-forbidden")
    assert b"credproxy_requests_total" not in reply.body


def scrape(proxy: Proxy) -> str:
    url = f"http://127.0.0.1:{admin_port(proxy)}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        return reply.read().decode()


def metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_count_real_traffic(open_proxy: Proxy, upstream: Upstream, names):
    agent = names("agent")
    token = open_proxy.store.add_principal(agent)
    open_proxy.store.add_credential(
        names("c"), "bearer", [f"localhost:{upstream.port}"], Secret(b"metric-secret")
    )
    open_proxy.store.add_grant(agent, ["GET"], credential=names("c"), paths=["/echo-auth"])
    open_proxy.wait_reload()
    before = scrape(open_proxy)
    with open_proxy.client(agent, token) as client:
        assert client.get(f"https://localhost:{upstream.port}/echo-auth").status_code == 200
        assert client.get(f"https://localhost:{upstream.port}/nope").status_code == 403
    after = scrape(open_proxy)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("credproxy_requests_total", decision="allow", reason="") == 1
    assert delta("credproxy_requests_total", decision="deny", reason="path-not-allowed") == 1
    assert delta("credproxy_principal_requests_total", decision="allow", principal=agent) == 1
    assert delta("credproxy_redactions_total") == 2
    assert delta("credproxy_request_duration_seconds_count") == 2
    assert metric(after, "credproxy_store_up") == 1
    assert metric(after, "credproxy_policy_reloads_total") >= 1
    assert "/nope" not in after and "metric-secret" not in after


def test_a_denial_streak_alerts_once_per_streak(open_proxy: Proxy, upstream: Upstream, names):
    agent = names("agent")
    token = open_proxy.store.add_principal(agent)
    open_proxy.store.add_grant(agent, ["GET"], hosts=[f"localhost:{upstream.port}"], paths=["/ok"])
    open_proxy.wait_reload()

    def alerts() -> list[dict]:
        return [
            line
            for line in open_proxy.audit()
            if line["event"] == "alert.denial_streak" and line["principal"] == agent
        ]

    with httpx.Client(proxy=open_proxy.url(agent, token)) as client:
        for _ in range(7):
            assert client.get(f"http://localhost:{upstream.port}/no").status_code == 403
        assert len(alerts()) == 1
        assert alerts()[0]["count"] == 5
        assert alerts()[0]["last_reasons"] == ["path-not-allowed"] * 5
        client.get(f"http://localhost:{upstream.port}/ok")
        for _ in range(5):
            client.get(f"http://localhost:{upstream.port}/no")
    assert len(alerts()) == 2


def _metric(proxy: Proxy, name: str) -> float:
    url = f"http://127.0.0.1:{admin_port(proxy)}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name)))


def test_fifty_requests_by_name_cost_at_most_one_lookup(
    open_proxy: Proxy, upstream: Upstream, names
):
    """The system resolver is asked once; the vetted answer serves the requests after it."""
    agent = names("agent")
    token = open_proxy.store.add_principal(agent)
    open_proxy.store.add_grant(agent, ["GET"], hosts=[f"localhost:{upstream.port}"])
    open_proxy.wait_reload()
    lookups = _metric(open_proxy, "credproxy_dns_lookups_total")
    hits = _metric(open_proxy, "credproxy_dns_cache_hits_total")
    with open_proxy.client(agent, token) as client:
        for _ in range(50):
            assert client.get(f"https://localhost:{upstream.port}/v1/x").status_code == 200
    assert _metric(open_proxy, "credproxy_dns_lookups_total") - lookups <= 1
    assert _metric(open_proxy, "credproxy_dns_cache_hits_total") - hits >= 49
    lines = open_proxy.requests(agent)
    assert len(lines) == 50
    assert sum(1 for line in lines if "dns_ms" in line) <= 1


@pytest.mark.e2e
def test_the_proxy_never_dials_its_own_listener(loopback_proxy: tuple[Proxy, Upstream]) -> None:
    # --allow-private opens loopback, so only the registration of the proxy's own listening
    # socket with the guard (in the runner) stops it from forwarding a request to itself.
    proxy, _ = loopback_proxy
    target = f"127.0.0.1:{proxy.port}"
    token = proxy.store.add_principal("self-dial")
    proxy.store.add_grant("self-dial", ["*"], hosts=[target])
    proxy.wait_reload()
    [reply] = absolute_form(proxy, proxy_auth("self-dial", token), [(f"http://{target}/", target)])
    assert (reply.status, reply.reason) == (403, "destination-forbidden")
