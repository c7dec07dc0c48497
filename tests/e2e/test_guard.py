"""The destination guard and the admin listener, on a proxy that opens 127.0.0.0/8."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from store.crypto import Secret
from tests.e2e.conftest import Proxy, start_proxy, stop_proxy
from tests.e2e.raw import connect, proxy_auth
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
        "--admin",
        "127.0.0.1:0",
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
