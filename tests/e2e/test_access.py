"""Access requests through the running proxy: recorded on denial or asked for, decided by
the owner from the CLI, never by the agent."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from store.crypto import Secret
from tests.e2e.conftest import CREDPROXY, Proxy
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e

INTERNAL = "http://credproxy.internal/access-requests"


def cli(proxy: Proxy, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CREDPROXY, *args], env=proxy.env, cwd=proxy.home, capture_output=True, text=True
    )


def test_a_refused_request_is_recorded_once_and_named_in_the_403(
    proxy: Proxy, upstream: Upstream, names
):
    agent = names("agent")
    token = proxy.store.add_principal(agent)
    proxy.store.add_credential(names("c"), "bearer", ["api.test"], Secret(b"acc-secret"))
    proxy.store.add_grant(agent, ["GET"], credential=names("c"), paths=["/v1/"])
    proxy.wait_reload()
    with proxy.client(agent, token) as client:
        first = client.get("https://api.test/v2/items")
        second = client.get("https://api.test/v2/items")
    assert first.status_code == second.status_code == 403
    asked = first.json()["access_request"]
    assert asked["state"] == "pending"
    assert second.json()["access_request"]["id"] == asked["id"]
    assert "POST http://credproxy.internal/access-requests" in first.json()["how_to_ask"]
    pending = json.loads(cli(proxy, "request", "list", "--state", "pending", "--json").stdout)
    [row] = [r for r in pending if r["id"] == asked["id"]]
    assert (row["principal"], row["host"], row["method"], row["path"]) == (
        agent,
        "api.test",
        "GET",
        "/v2/items",
    )
    assert upstream.log.connections == 0


def test_an_agent_asks_and_the_owner_approves_into_a_working_grant(
    proxy: Proxy, upstream: Upstream, names
):
    agent = names("agent")
    token = proxy.store.add_principal(agent)
    cred = names("c")
    proxy.store.add_credential(cred, "bearer", ["api.test"], Secret(b"approved-secret"))
    proxy.wait_reload()
    with httpx.Client(proxy=proxy.url(agent, token)) as client:
        reply = client.post(
            INTERNAL,
            json={"host": "api.test", "method": "GET", "path": "/v3/", "purpose": "read v3"},
        )
        assert reply.status_code == 202
        request_id = reply.json()["id"]
        assert client.get(f"{INTERNAL}/{request_id}").json()["state"] == "pending"
        # An agent cannot approve anything: there is no such endpoint.
        assert client.post(f"{INTERNAL}/{request_id}/approve").status_code == 404
    assert upstream.log.connections == 0

    approved = cli(proxy, "request", "approve", str(request_id), "--credential", cred, "--json")
    assert approved.returncode == 0, approved.stderr
    proxy.wait_reload()
    with proxy.client(agent, token) as client:
        reply = client.get("https://api.test/v3/things")
    assert reply.status_code == 200
    assert upstream.log.requests[-1].header("authorization") == ["Bearer approved-secret"]
    with httpx.Client(proxy=proxy.url(agent, token)) as client:
        state = client.get(f"{INTERNAL}/{request_id}").json()
    assert state["state"] == "approved"
    assert state["grant_id"] == json.loads(approved.stdout)["grant_id"]
    assert [
        e["grant_id"]
        for e in proxy.audit()
        if e["event"] == "access_request.approved" and e["id"] == request_id
    ] == [state["grant_id"]]


def test_the_owner_denies_and_others_cannot_see_the_request(proxy: Proxy, names):
    agent, other = names("agent"), names("other")
    token = proxy.store.add_principal(agent)
    other_token = proxy.store.add_principal(other)
    proxy.wait_reload()
    with httpx.Client(proxy=proxy.url(agent, token)) as client:
        request_id = client.post(
            INTERNAL, json={"host": "api.test", "method": "DELETE", "path": "/v1/x"}
        ).json()["id"]
    with httpx.Client(proxy=proxy.url(other, other_token)) as client:
        assert client.get(f"{INTERNAL}/{request_id}").status_code == 404
    denied = cli(proxy, "request", "deny", str(request_id), "--reason", "not needed")
    assert denied.returncode == 0, denied.stderr
    with httpx.Client(proxy=proxy.url(agent, token)) as client:
        assert client.get(f"{INTERNAL}/{request_id}").json()["state"] == "denied"
    proxy.wait_reload()
    assert any(
        e["event"] == "access_request.denied" and e["id"] == request_id for e in proxy.audit()
    )


def test_bad_access_requests_are_refused(proxy: Proxy, names):
    agent = names("agent")
    token = proxy.store.add_principal(agent)
    proxy.wait_reload()
    with httpx.Client(proxy=proxy.url(agent, token)) as client:
        assert client.post(INTERNAL, content=b"not json").status_code == 400
        assert client.post(INTERNAL, json={"host": "api.test"}).status_code == 400
        assert (
            client.post(INTERNAL, json={"host": "*.com", "method": "GET", "path": "/"}).status_code
            == 400
        )
    with httpx.Client(proxy=proxy.url(agent, "wrong-token")) as client:
        assert client.post(INTERNAL, json={}).status_code == 407
