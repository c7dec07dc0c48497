"""What the agent reads when credproxy answers itself, and how a 407 challenge is audited.

Every answer the proxy writes is an RFC 9457 problem document with a reason; a client that
asks without credentials first (curl --proxy-anyauth, git) is challenged, not denied.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme

from store.crypto import Secret
from tests.e2e.conftest import NAMES, Proxy, start_proxy, stop_proxy
from tests.e2e.raw import Reply, connect, exchange, h2_get, h2_tunnel, proxy_auth, tunnel
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e

SECRET = b"sk-answers-" + os.urandom(8).hex().encode()
INTERNAL = "http://credproxy.internal/access-requests"
PROBLEM = "application/problem+json"


@pytest.fixture(scope="module")
def answering(
    tmp_path_factory: pytest.TempPathFactory,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
) -> Iterator[Proxy]:
    resolve = [f"{name}=127.0.0.1:{shared_upstream.port}" for name in NAMES if name != "localhost"]
    home = tmp_path_factory.mktemp("answers")
    extra = ["--admin", "127.0.0.1:0"]
    running = start_proxy(home, upstream_ca, resolve, extra, template=initialised_home)
    yield running
    stop_proxy(running)


@pytest.fixture(scope="module")
def agent(answering: Proxy) -> tuple[str, str]:
    name = "answers-" + os.urandom(3).hex()
    token = answering.store.add_principal(name)
    answering.store.add_credential(name + "-c", "bearer", ["api.test"], Secret(SECRET))
    answering.store.add_grant(
        name, ["GET"], credential=name + "-c", paths=["/v1/", "/echo-auth", "/repo.git/"]
    )
    answering.wait_reload()
    return name, token


def metrics(proxy: Proxy) -> dict[str, float]:
    started = next(line for line in proxy.audit() if line["event"] == "proxy.started")
    url = f"http://{started['admin'][0]}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith("credproxy_requests_total{"):
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


def requests_key(decision: str, reason: str) -> str:
    return f'credproxy_requests_total{{decision="{decision}",reason="{reason}"}}'


def new_lines(proxy: Proxy, before: int) -> list[dict[str, Any]]:
    return proxy.requests()[before:]


def problem(reply: Reply, status: int, reason: str, error: str = "denied") -> dict[str, Any]:
    assert reply.status == status
    assert reply.headers["content-type"] == PROBLEM
    assert reply.headers["x-credproxy-reason"] == reason
    body: dict[str, Any] = json.loads(reply.body)
    assert (body["type"], body["status"], body["reason"], body["error"]) == (
        "urn:credproxy:reason:" + reason,
        status,
        reason,
        error,
    )
    assert body["title"] and body["detail"]
    return body


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env["HOME"] = env.get("TMPDIR", "/tmp")  # no ~/.gitconfig or ~/.curlrc of the machine
    return env


# -- item 6: the challenge ------------------------------------------------------------------


def test_curl_anyauth_is_challenged_then_served_and_only_the_challenge_is_audited_so(
    answering: Proxy, agent: tuple[str, str]
):
    before, counted = len(answering.requests()), metrics(answering)
    result = subprocess.run(
        [
            "curl",
            "-sS",
            "--proxy-anyauth",
            "-x",
            answering.url(*agent),
            "--cacert",
            str(answering.ca_file),
            "-w",
            "\n%{http_code}",
            "https://api.test/echo-auth",
        ],
        capture_output=True,
        env=clean_env(),
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith(b"\n200")
    assert SECRET not in result.stdout + result.stderr
    lines = new_lines(answering, before)
    assert [(r["method"], r["decision"], r["status"]) for r in lines] == [
        ("CONNECT", "challenge", 407),
        ("GET", "allow", 200),
    ]
    challenge = lines[0]
    assert (challenge["reason"], challenge["principal"]) == ("auth-required", None)
    after = metrics(answering)
    challenges = requests_key("challenge", "auth-required")
    assert after[challenges] - counted.get(challenges, 0) == 1
    denials = requests_key("deny", "auth-required")
    assert after.get(denials, 0) == counted.get(denials, 0)
    assert SECRET.decode() not in answering.output()


def test_git_is_challenged_not_denied(answering: Proxy, agent: tuple[str, str], tmp_path: Path):
    before = len(answering.requests())
    result = subprocess.run(
        [
            "git",
            "-c",
            f"http.proxy={answering.url(*agent)}",
            "ls-remote",
            "https://api.test/repo.git",
        ],
        capture_output=True,
        env=clean_env() | {"GIT_TERMINAL_PROMPT": "0", "GIT_SSL_CAINFO": str(answering.ca_file)},
        cwd=tmp_path,
        timeout=60,
    )
    # The upstream is no git server: git fails after the answer, which is all this needs.
    lines = new_lines(answering, before)
    decisions = [(r["method"], r["decision"]) for r in lines]
    assert decisions[:2] == [("CONNECT", "challenge"), ("GET", "allow")], (decisions, result)
    assert all(r["decision"] != "deny" for r in lines)
    assert SECRET not in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("auth", "decision", "error"),
    [
        pytest.param(None, "challenge", "challenge", id="no credentials: a challenge"),
        pytest.param(proxy_auth("nobody", "x"), "deny", "denied", id="unknown principal: deny"),
        pytest.param("Basic !!!", "deny", "denied", id="malformed: deny"),
    ],
)
def test_a_407_always_carries_proxy_authenticate_and_says_which_it_is(
    answering: Proxy, auth: str | None, decision: str, error: str
):
    before = len(answering.requests())
    sock, reply = connect(answering.port, "api.test:443", auth)
    sock.close()
    body = problem(reply, 407, "auth-required", error)
    assert reply.headers["proxy-authenticate"] == 'Basic realm="credproxy"'
    [line] = new_lines(answering, before)
    assert (line["decision"], line["reason"], line["request_id"]) == (
        decision,
        "auth-required",
        body["request_id"],
    )


def test_a_plain_http_request_without_credentials_is_challenged(answering: Proxy):
    before = len(answering.requests())
    reply = httpx.get(INTERNAL, proxy=f"http://127.0.0.1:{answering.port}")
    assert reply.status_code == 407
    assert reply.headers["content-type"] == PROBLEM
    assert reply.json()["error"] == "challenge"
    [line] = new_lines(answering, before)
    assert (line["decision"], line["reason"]) == ("challenge", "auth-required")


# -- item 3: one shape for every answer ------------------------------------------------------


def test_a_refused_connect_names_its_request_id(answering: Proxy, agent: tuple[str, str]):
    before = len(answering.requests())
    sock, reply = connect(answering.port, "other.test:443", proxy_auth(*agent))
    sock.close()
    body = problem(reply, 403, "no-grant")
    [line] = new_lines(answering, before)
    assert (line["decision"], line["request_id"]) == ("deny", body["request_id"])


@pytest.mark.parametrize("http2", [False, True], ids=["agent over HTTP/1", "agent over HTTP/2"])
def test_a_path_denial_carries_the_access_request_and_how_to_ask(
    answering: Proxy, agent: tuple[str, str], http2: bool
):
    before = len(answering.requests())
    if http2:
        with h2_tunnel(answering, proxy_auth(*agent), "api.test") as tls:
            answer = h2_get(tls, "api.test", "/v2/items")
        reply = Reply(answer.status or 0, answer.headers, answer.body)
    else:
        with tunnel(
            answering.port, "api.test:443", proxy_auth(*agent), "api.test", answering.ca_file
        ) as sock:
            reply = exchange(sock, b"GET /v2/items HTTP/1.1\r\nHost: api.test\r\n\r\n")
    body = problem(reply, 403, "path-not-allowed")
    assert body["access_request"]["state"] == "pending"
    assert "credproxy.internal/access-requests" in body["how_to_ask"]
    [line] = new_lines(answering, before)
    assert (line["decision"], line["request_id"]) == ("deny", body["request_id"])


def test_credproxy_internal_answers_its_errors_as_problems(
    answering: Proxy, agent: tuple[str, str]
):
    before = len(answering.requests())
    with httpx.Client(proxy=answering.url(*agent)) as client:
        missing = client.get(f"{INTERNAL}/999999")
        nowhere = client.get("http://credproxy.internal/nowhere")
        bad = client.post(INTERNAL, content=b"not json", headers={"content-type": "text/plain"})
    for reply, status, reason in [
        (missing, 404, "not-found"),
        (nowhere, 404, "not-found"),
        (bad, 400, "bad-request"),
    ]:
        as_reply = Reply(reply.status_code, dict(reply.headers), reply.content)
        problem(as_reply, status, reason)
    lines = new_lines(answering, before)
    assert [(r["decision"], r["status"], r.get("reason")) for r in lines] == [
        ("internal", 404, "not-found"),
        ("internal", 404, "not-found"),
        ("internal", 400, "bad-request"),
    ]
    assert [r["request_id"] for r in lines] == [
        missing.json()["request_id"],
        nowhere.json()["request_id"],
        bad.json()["request_id"],
    ]
