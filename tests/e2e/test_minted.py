"""Minted tokens end to end: a real credproxy, a fake OAuth 2 / Google / GitHub provider on
loopback (tests/e2e/fakeoauth.py), real clients. Secrets are only asserted with `not in`.
"""

from __future__ import annotations

import base64
import json
import secrets
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme

from tests.e2e.conftest import CREDPROXY, Proxy, start_proxy, stop_proxy
from tests.e2e.fakeoauth import (
    API,
    AUTH,
    BODY_MARK,
    GH,
    GITHUB_API,
    GOOGLE_TOKEN_URL,
    TOKEN_URL,
    Provider,
    rsa_pem,
)
from tests.e2e.memory import BIG, MEMORY_BOUND, MIB, Peak
from tests.e2e.raw import connect, proxy_auth, push, read_reply
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e

DOWN = "down.mint.test"  # --resolve'd to a port nothing listens on


class Sandbox:
    def __init__(self, proxy: Proxy, provider: Provider, home: Path) -> None:
        self.proxy, self.provider, self.home = proxy, provider, home
        self.secrets: list[str] = []

    def client_credential(self, name: str, *extra: str, via_cli: bool = True) -> str:
        """An oauth2-client credential for api.mint.test and a grant on it for a new agent;
        returns the agent's token."""
        client_secret = "cs-" + secrets.token_urlsafe(24)
        self.provider.clients[name] = client_secret
        self.secrets.append(client_secret)
        secret = json.dumps({"client_id": name, "client_secret": client_secret})
        self.cli(
            "credential", "add", name, "--scheme", "oauth2-client", "--host", API,
            "--token-url", TOKEN_URL, *extra, stdin=secret.encode(),
        )  # fmt: skip
        store = self.proxy.store
        token = store.add_principal(name)
        store.add_grant(name, ["GET"], credential=name, paths=["/v1/"])
        self.proxy.wait_reload()
        return token

    def cli(self, *args: str, stdin: bytes = b"", check: bool = True) -> str:
        done = subprocess.run(
            [*CREDPROXY, *args], input=stdin, env=self.proxy.env, cwd=self.home,
            capture_output=True, check=False,
        )  # fmt: skip
        text = done.stdout.decode() + done.stderr.decode()
        if check:
            assert done.returncode == 0, text
        return text

    def client(self, name: str, token: str) -> httpx.Client:
        return self.proxy.client(name, token, timeout=30)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def sandbox(
    tmp_path_factory: pytest.TempPathFactory, upstream_ca: trustme.CA, initialised_home: Path
) -> Iterator[Sandbox]:
    provider = Provider()
    with Upstream(upstream_ca, [AUTH, GH, API, DOWN], app=provider) as server:
        home = tmp_path_factory.mktemp("minted")
        resolve = [f"{name}=127.0.0.1:{server.port}" for name in (AUTH, GH, API)]
        resolve.append(f"{DOWN}=127.0.0.1:{_closed_port()}")
        proxy = start_proxy(home, upstream_ca, resolve, template=initialised_home)
        try:
            yield Sandbox(proxy, provider, home)
        finally:
            stop_proxy(proxy)


@pytest.fixture
def provider(sandbox: Sandbox) -> Iterator[Provider]:
    p = sandbox.provider
    p.lifetime, p.delay, p.mode = 3600.0, 0.0, None
    yield p
    p.lifetime, p.delay, p.mode = 3600.0, 0.0, None


def _no_secret_anywhere(sandbox: Sandbox, *seen: str) -> None:
    """Neither the long-lived secrets nor any minted token in the proxy's output (audit lines
    and logs) or in what the agent saw."""
    text = sandbox.proxy.output()
    minted = list(sandbox.provider.issued)
    assert minted
    for value in [*sandbox.secrets, *minted, *sandbox.provider.refresh, BODY_MARK]:
        assert value not in text
        for answer in seen:
            assert value not in answer


# -- oauth2-client ---------------------------------------------------------------------


def test_client_credentials_mint_on_first_use_and_stamp_a_bearer(
    sandbox: Sandbox, provider: Provider
):
    token = sandbox.client_credential("cc", "--scope", "read", "--scope", "write")
    assert provider.count("cc") == 0  # nothing minted before a request needs it
    with sandbox.client("cc", token) as client:
        first = client.get(f"https://{API}/v1/items")
        assert first.status_code == 200 and first.json()["who"] == "cc"
        echoed = client.get(f"https://{API}/v1/echo", headers={"Authorization": "Bearer agent"})
    assert provider.count("cc") == 1
    [(value, issued)] = [(v, i) for v, i in provider.issued.items() if i.who == "cc"]
    assert issued.scope == "read write"
    # The agent's own Authorization was replaced; the token it would see is redacted.
    assert value not in echoed.text and "[REDACTED]" in echoed.json()["authorization"]
    lines = [r for r in sandbox.proxy.requests("cc") if r["path"].startswith("/v1/")]
    assert [line["decision"] for line in lines] == ["allow", "allow"]
    assert lines[0]["credential"] == "cc" and lines[0]["credential_fp"].startswith("fp-")
    assert lines[0]["token_fp"] == lines[1]["token_fp"] and lines[0]["token_fp"].startswith("tok-")
    assert "token_ms" in lines[0] and "token_ms" not in lines[1]
    events = [e for e in sandbox.proxy.audit() if e.get("event") == "token.minted"]
    assert any(e["credential"] == "cc" for e in events)
    _no_secret_anywhere(sandbox, first.text, echoed.text)


def test_a_body_pushed_while_its_token_is_minted_waits_in_the_socket(
    sandbox: Sandbox, provider: Provider
):
    """The proxy does not read a request's body while the request waits for its token: the
    body stays in the socket's buffers instead of piling up in the proxy."""
    token = sandbox.client_credential("mint-push")
    sandbox.proxy.store.add_grant("mint-push", ["POST"], credential="mint-push", paths=["/v1/"])
    sandbox.proxy.wait_reload()
    provider.delay = 2.0
    with Peak(sandbox.proxy.process.pid) as peak:
        sock, reply = connect(sandbox.proxy.port, f"{API}:443", proxy_auth("mint-push", token))
        assert reply.status == 200
        context = ssl.create_default_context(cafile=str(sandbox.proxy.ca_file))
        context.set_alpn_protocols(["http/1.1"])
        with context.wrap_socket(sock, server_hostname=API) as tls:
            head = f"POST /v1/upload HTTP/1.1\r\nHost: {API}\r\nContent-Length: {BIG}\r\n\r\n"
            answer = push(tls, head.encode(), BIG)
    assert answer is not None and answer.status == 200
    assert provider.count("mint-push") == 1
    assert peak.growth < MEMORY_BOUND, peak.growth // MIB


def test_an_echoed_client_secret_is_redacted(sandbox: Sandbox, provider: Provider):
    token = sandbox.client_credential("echoing")
    with sandbox.client("echoing", token) as client:
        answer = client.get(f"https://{API}/v1/echo-client")
    assert answer.status_code == 200 and answer.json()["client_secret"] == "[REDACTED]"
    _no_secret_anywhere(sandbox, answer.text)


def test_an_api_echoing_the_minted_token_in_any_form_is_redacted(
    sandbox: Sandbox, provider: Provider
):
    token = sandbox.client_credential("echo-forms")
    with sandbox.client("echo-forms", token) as client:
        answer = client.get(f"https://{API}/v1/echo-forms")
    assert answer.status_code == 302
    [value] = [v for v, i in provider.issued.items() if i.who == "echo-forms"]
    seen = answer.text + "\n".join(f"{k}: {v}" for k, v in answer.headers.multi_items())
    raw = value.encode()
    for form in (
        value,
        base64.b64encode(raw).decode(),
        base64.urlsafe_b64encode(raw).decode().rstrip("="),
        "".join(f"%{b:02X}" for b in raw),
        "".join(f"\\u{b:04x}" for b in raw),
    ):
        leaked = form in seen
        assert not leaked, "a form of the minted token reached the agent"
    assert seen.count("[REDACTED]") >= 7
    _no_secret_anywhere(sandbox, seen)


def test_a_custom_header_and_prefix(sandbox: Sandbox, provider: Provider):
    token = sandbox.client_credential("prefixed", "--token-prefix", "token ")
    with sandbox.client("prefixed", token) as client:
        echoed = client.get(f"https://{API}/v1/echo")
    assert echoed.status_code == 200 and echoed.json()["prefix"] == "token"


def test_short_lived_tokens_are_refreshed_ahead_never_stamped_expired(
    sandbox: Sandbox, provider: Provider
):
    """Tokens living 3 s for 12 s of steady requests: every request succeeds, none carries an
    expired token, and only the first one waited for the token endpoint."""
    provider.lifetime = 3.0
    token = sandbox.client_credential("short")
    statuses = []
    with sandbox.client("short", token) as client:
        deadline = time.monotonic() + 12
        while time.monotonic() < deadline:
            statuses.append(client.get(f"https://{API}/v1/tick").status_code)
            time.sleep(0.05)
    assert set(statuses) == {200}
    assert provider.expired_uses == 0
    assert provider.count("short") >= 4
    lines = [r for r in sandbox.proxy.requests("short") if r["path"] == "/v1/tick"]
    assert len(lines) == len(statuses)
    assert ["token_ms" in line for line in lines] == [True] + [False] * (len(lines) - 1)
    assert len({line["token_fp"] for line in lines}) >= 4


def test_a_token_whose_refresh_fails_serves_until_its_margin_then_denies(
    sandbox: Sandbox, provider: Provider
):
    """The endpoint fails after the first token: that token serves while it is usable, then
    requests are refused 502; none ever reaches the API with an expired token."""
    provider.lifetime = 3.0
    token = sandbox.client_credential("expiring")
    statuses = []
    with sandbox.client("expiring", token) as client:
        statuses.append(client.get(f"https://{API}/v1/e").status_code)
        provider.mode = "unavailable"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            statuses.append(client.get(f"https://{API}/v1/e").status_code)
            time.sleep(0.05)
    assert statuses[0] == 200 and statuses[-1] == 502
    assert set(statuses) == {200, 502}
    assert statuses.index(502) > 1 and 200 not in statuses[statuses.index(502) :]
    assert provider.expired_uses == 0 and provider.count("expiring") == 1


@pytest.mark.parametrize(
    ("delay", "status"),
    [
        pytest.param(8.5, 200, id="the token comes after the head deadline: 200"),
        pytest.param(12.0, 502, id="the token endpoint takes too long: 502"),
    ],
)
def test_a_request_waiting_for_its_token_is_not_cut_by_the_head_deadline(
    sandbox: Sandbox, provider: Provider, delay: float, status: int
):
    """Issue 34, item 6: a CONNECT, then a complete GET head 2 s later, for a token that
    takes `delay` s to mint. The head deadline (10 s from the CONNECT) passes while the
    request waits on credproxy, not on the client: it ends in its answer, never a close."""
    name = f"slow-mint-{int(delay)}"
    token = sandbox.client_credential(name)
    provider.delay = delay
    sock, reply = connect(sandbox.proxy.port, f"{API}:443", proxy_auth(name, token))
    assert reply.status == 200
    client = f"127.0.0.1:{sock.getsockname()[1]}"
    context = ssl.create_default_context(cafile=str(sandbox.proxy.ca_file))
    with context.wrap_socket(sock, server_hostname=API) as tls:
        time.sleep(2)
        tls.settimeout(30)
        tls.sendall(f"GET /v1/x HTTP/1.1\r\nHost: {API}\r\n\r\n".encode())
        answer = read_reply(tls)
    assert answer.status == status
    line = sandbox.proxy.requests(name)[-1]
    if status == 200:
        assert line["decision"] == "allow" and line["token_ms"] > 8000
    else:
        assert (answer.reason, line["error"]) == ("credentials-unavailable", "token-unavailable")
        assert json.loads(answer.body)["detail"] == "the token endpoint did not answer in time"
    timeouts = [r for r in sandbox.proxy.requests() if r.get("reason") == "request-timeout"]
    assert client not in [r["client"] for r in timeouts]
    # Its session would keep minting in the background, into the next tests' provider settings.
    sandbox.cli("credential", "remove", name)
    sandbox.proxy.wait_reload()


def test_a_hundred_parallel_first_requests_share_one_mint(sandbox: Sandbox, provider: Provider):
    provider.delay = 1.0  # a slow endpoint: every request arrives while the mint runs
    token = sandbox.client_credential("parallel")
    barrier = threading.Barrier(100)

    def one(_: int) -> int:
        with sandbox.client("parallel", token) as client:
            barrier.wait(timeout=30)
            return client.get(f"https://{API}/v1/p").status_code

    with ThreadPoolExecutor(100) as pool:
        statuses = list(pool.map(one, range(100)))
    assert statuses == [200] * 100
    assert provider.count("parallel") == 1


def test_an_upstream_401_drops_the_token_once_per_cooldown(sandbox: Sandbox, provider: Provider):
    token = sandbox.client_credential("rejected")
    with sandbox.client("rejected", token) as client:
        assert client.get(f"https://{API}/v1/ok").status_code == 200
        assert client.get(f"https://{API}/v1/reject").status_code == 401
        assert client.get(f"https://{API}/v1/ok").status_code == 200  # a fresh token
        for _ in range(5):  # a provider that keeps refusing is not hammered
            assert client.get(f"https://{API}/v1/reject").status_code == 401
    assert provider.count("rejected") == 2
    fps = [r["token_fp"] for r in sandbox.proxy.requests("rejected") if "token_fp" in r]
    assert fps[0] == fps[1] != fps[2] == fps[-1]
    dropped = [e for e in sandbox.proxy.audit() if e.get("event") == "token.dropped"]
    assert [e["cause"] for e in dropped if e["credential"] == "rejected"] == ["upstream-401"]


@pytest.mark.parametrize(
    ("mode", "detail"),
    [
        pytest.param(
            "invalid_grant", "the token endpoint answered 400 (invalid_grant)",
            id="a 400 invalid_grant denies 502 naming the status and code",
        ),
        pytest.param(
            "unavailable", "the token endpoint answered 503 (temporarily_unavailable)",
            id="a 503 denies 502 naming the status and code",
        ),
        pytest.param(
            "huge", "the token endpoint's answer exceeds 65536 bytes",
            id="an answer over 64 KiB is not read past the limit",
        ),
    ],
)  # fmt: skip
def test_a_failing_endpoint_denies_cleanly_and_recovers(
    sandbox: Sandbox, provider: Provider, mode: str, detail: str
):
    name = f"failing-{mode.replace('_', '-')}"
    token = sandbox.client_credential(name)
    provider.mode = mode
    with sandbox.client(name, token) as client:
        refused = client.get(f"https://{API}/v1/x")
        again = client.get(f"https://{API}/v1/x")  # backing off: refused without asking
        assert provider.count(name) == 0
        provider.mode = None
        deadline = time.monotonic() + 10
        answer = client.get(f"https://{API}/v1/x")
        while answer.status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
            answer = client.get(f"https://{API}/v1/x")
    for denied in (refused, again):
        assert denied.status_code == 502
        assert denied.headers["x-credproxy-reason"] == "credentials-unavailable"
        assert denied.json()["detail"] == detail
    assert answer.status_code == 200
    line = sandbox.proxy.requests(name)[0]
    assert (line["decision"], line["error"]) == ("error", "token-unavailable")
    assert line["detail"] == detail
    failures = [e for e in sandbox.proxy.audit() if e.get("event") == "token.mint_failed"]
    assert any(e["credential"] == name for e in failures)
    _no_secret_anywhere(sandbox, refused.text, again.text)


@pytest.mark.parametrize(
    ("mode", "detail"),
    [
        ("leak-description", "the token endpoint answered 400 (invalid_client)"),
        ("leak-code", "the token endpoint answered 400"),
        ("leak-headers", "the token endpoint answered 401 (invalid_client)"),
        ("leak-redirect", "the token endpoint answered 302"),
        ("leak-html", "the token endpoint answered 500"),
        ("leak-token-crlf", "the token endpoint's answer has no usable access_token"),
        ("leak-200-error", "the token endpoint's answer has no usable access_token"),
    ],
)
@pytest.mark.parametrize("scheme", ["oauth2-client", "oauth2-refresh"])
def test_a_token_endpoint_echoing_what_it_was_sent_never_reaches_the_agent(
    sandbox: Sandbox, provider: Provider, mode: str, detail: str, scheme: str
):
    """The client secret, refresh token and whole form, echoed by the token endpoint in its
    error text, its code, its headers, a redirect, an HTML page, a token with CR LF: the
    agent reads only the status and a registered code, the audit stream likewise."""
    name = f"{mode}-{scheme}"
    if scheme == "oauth2-client":
        token = sandbox.client_credential(name)
    else:
        token = refresh_credential(sandbox, name)
    provider.mode = mode
    with sandbox.client(name, token) as client:
        answer = client.get(f"https://{API}/v1/x")
    assert answer.status_code == 502
    assert answer.headers["x-credproxy-reason"] == "credentials-unavailable"
    assert answer.json()["detail"] == detail
    assert "x-leak" not in answer.headers and "x-debug" not in answer.headers
    seen = answer.text + "\n".join(f"{k}: {v}" for k, v in answer.headers.multi_items())
    text = sandbox.proxy.output()
    for value in [*sandbox.secrets, *provider.refresh, BODY_MARK]:
        leaked = value in seen or value in text
        assert not leaked, "something the token endpoint echoed reached the agent or the log"


def test_an_unreachable_endpoint_denies_502(sandbox: Sandbox, provider: Provider):
    provider.clients["unreachable"] = "whatever"
    secret = json.dumps({"client_id": "unreachable", "client_secret": "whatever-secret-1"})
    sandbox.cli(
        "credential", "add", "unreachable", "--scheme", "oauth2-client", "--host", API,
        "--token-url", f"https://{DOWN}/token", stdin=secret.encode(),
    )  # fmt: skip
    store = sandbox.proxy.store
    token = store.add_principal("unreachable")
    store.add_grant("unreachable", ["GET"], credential="unreachable", paths=["/v1/"])
    sandbox.proxy.wait_reload()
    with sandbox.client("unreachable", token) as client:
        answer = client.get(f"https://{API}/v1/x")
    assert answer.status_code == 502
    assert answer.json()["detail"] == "the token endpoint could not be reached"


def test_rotation_and_removal_drop_the_cached_token(sandbox: Sandbox, provider: Provider):
    token = sandbox.client_credential("rotated")
    with sandbox.client("rotated", token) as client:
        assert client.get(f"https://{API}/v1/a").status_code == 200
        new_secret = "cs2-" + secrets.token_urlsafe(24)
        provider.clients["rotated"] = new_secret
        sandbox.secrets.append(new_secret)
        secret = json.dumps({"client_id": "rotated", "client_secret": new_secret})
        sandbox.cli("credential", "rotate", "rotated", stdin=secret.encode())
        sandbox.proxy.wait_reload()
        assert client.get(f"https://{API}/v1/b").status_code == 200
        sandbox.cli("credential", "remove", "rotated")
        sandbox.proxy.wait_reload()
    assert provider.count("rotated") == 2
    fps = [r["token_fp"] for r in sandbox.proxy.requests("rotated") if "token_fp" in r]
    assert len(set(fps)) == 2
    dropped = [e for e in sandbox.proxy.audit() if e.get("event") == "token.dropped"]
    causes = [e["cause"] for e in dropped if e["credential"] == "rotated"]
    assert causes == ["credential-changed", "credential-changed"]


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        pytest.param(
            ["--token-url", "http://auth.mint.test/t"], '{"client_id":"a","client_secret":"b"}',
            "the --token-url must be an https:// URL", id="a token URL that is not https",
        ),
        pytest.param(
            ["--token-url", TOKEN_URL], '{"client_id":"a"',
            "the secret is not valid JSON", id="malformed JSON",
        ),
        pytest.param(
            ["--token-url", TOKEN_URL], '{"client_id":"a"}',
            "the secret lacks client_secret", id="a missing field",
        ),
        pytest.param(
            ["--token-url", TOKEN_URL], '{"client_id":"a","client_secret":"b","x":1}',
            "the secret has a field other than", id="an unknown field",
        ),
        pytest.param(
            [], '{"client_id":"a","client_secret":"b"}',
            "--scheme oauth2-client needs a --token-url", id="no token URL",
        ),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_exit_2_nothing_stored(
    sandbox: Sandbox, args: list[str], stdin: str, message: str
):
    done = subprocess.run(
        [*CREDPROXY, "credential", "add", "bad", "--scheme", "oauth2-client", "--host", API,
         *args],
        input=stdin.encode(), env=sandbox.proxy.env, cwd=sandbox.home, capture_output=True,
        check=False,
    )  # fmt: skip
    err = done.stderr.decode()
    assert done.returncode == 2 and err.count("\n") == 1 and message in err, err
    assert "Traceback" not in err and 'b"' not in err
    assert "bad" not in [c.name for c in sandbox.proxy.store.list_credentials()]


# -- oauth2-refresh --------------------------------------------------------------------


def refresh_credential(sandbox: Sandbox, name: str, *extra: str) -> str:
    """An oauth2-refresh credential for api.mint.test with a live refresh token, a grant for
    a new agent; returns the agent's token."""
    client_secret = "rs-" + secrets.token_urlsafe(24)
    refresh = "refresh-" + secrets.token_urlsafe(24)
    sandbox.provider.clients[name] = client_secret
    sandbox.provider.refresh[refresh] = name
    sandbox.secrets += [client_secret, refresh]
    secret = {"client_id": name, "client_secret": client_secret, "refresh_token": refresh}
    sandbox.cli(
        "credential", "add", name, "--scheme", "oauth2-refresh", "--host", API,
        "--token-url", TOKEN_URL, *extra, stdin=json.dumps(secret).encode(),
    )  # fmt: skip
    store = sandbox.proxy.store
    token = store.add_principal(name)
    store.add_grant(name, ["GET"], credential=name, paths=["/v1/"])
    sandbox.proxy.wait_reload()
    return token


def _sealed(sandbox: Sandbox, name: str) -> dict[str, Any]:
    return json.loads(sandbox.proxy.store.snapshot().credentials[name].secret.reveal())


def test_rotated_refresh_tokens_are_sealed_back_and_never_reused(
    sandbox: Sandbox, provider: Provider
):
    """Access tokens living 4 s for 10 s, each refresh rotating the refresh token: every
    request succeeds with a live token, no refresh token is presented twice, and the store
    holds the live one. (3 s left a refresh one second to finish before requests waited for
    it: a busy CI machine took longer once.)"""
    provider.lifetime = 4.0
    token = refresh_credential(sandbox, "refreshed", "--client-auth", "post")
    statuses = []
    with sandbox.client("refreshed", token) as client:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            statuses.append(client.get(f"https://{API}/v1/r").status_code)
            time.sleep(0.05)
    assert set(statuses) == {200}
    assert provider.expired_uses == 0 and provider.stale_refresh == 0
    assert provider.count("refreshed") >= 3
    live = [r for r, who in provider.refresh.items() if who == "refreshed"]
    assert _sealed(sandbox, "refreshed")["refresh_token"] == live[0]
    lines = [r for r in sandbox.proxy.requests("refreshed") if r["path"] == "/v1/r"]
    assert ["token_ms" in line for line in lines] == [True] + [False] * (len(lines) - 1)
    # The rotated refresh tokens never reach an audit line, a log or the agent.
    sandbox.secrets += list(provider.spent)
    _no_secret_anywhere(sandbox)


def test_a_refused_refresh_token_denies_and_leaves_the_store_as_it_was(
    sandbox: Sandbox, provider: Provider
):
    token = refresh_credential(sandbox, "refused")
    before = _sealed(sandbox, "refused")
    provider.mode = "invalid_grant"
    with sandbox.client("refused", token) as client:
        answer = client.get(f"https://{API}/v1/x")
        assert answer.status_code == 502
        assert answer.json()["detail"] == "the token endpoint answered 400 (invalid_grant)"
        assert _sealed(sandbox, "refused") == before
        provider.mode = None
        deadline = time.monotonic() + 10
        while client.get(f"https://{API}/v1/x").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert _sealed(sandbox, "refused")["refresh_token"] != before["refresh_token"]
    _no_secret_anywhere(sandbox, answer.text)


def test_a_rotated_refresh_token_is_sealed_back_even_when_its_access_token_is_refused(
    sandbox: Sandbox, provider: Provider
):
    """The endpoint spends the refresh token, answers a new one, and an access token
    credproxy cannot use (not a bearer): the request is refused, but the new refresh token
    is sealed, so the next refresh works (it used to be dropped: invalid_grant for good)."""
    token = refresh_credential(sandbox, "rotated-unusable")
    before = _sealed(sandbox, "rotated-unusable")
    provider.mode = "rotate-unusable"
    with sandbox.client("rotated-unusable", token) as client:
        answer = client.get(f"https://{API}/v1/x")
        assert answer.status_code == 502
        assert answer.json()["detail"] == "the token endpoint's answer is not a bearer token"
        live = [r for r, who in provider.refresh.items() if who == "rotated-unusable"]
        sealed = _sealed(sandbox, "rotated-unusable")
        # Compared as booleans: pytest would print the values.
        kept = sealed["refresh_token"] == live[0] and live[0] != before["refresh_token"]
        assert kept, "the rotated refresh token was not sealed back"
        assert "access_token" not in sealed  # the refused one is not offered to replicas
        provider.mode = None
        deadline = time.monotonic() + 10
        while (again := client.get(f"https://{API}/v1/x")).status_code != 200:
            assert time.monotonic() < deadline, again.text
            time.sleep(0.1)
    assert provider.stale_refresh == 0
    sandbox.secrets += list(provider.spent)
    _no_secret_anywhere(sandbox, answer.text, again.text)


def test_an_upstream_401_drops_a_refreshed_token_for_good(sandbox: Sandbox, provider: Provider):
    """oauth2-refresh keeps the access token beside the refresh token in the store, for the
    other replicas. A 401 must not be answered by taking the refused token back from there:
    the next request gets a freshly refreshed one."""
    token = refresh_credential(sandbox, "refresh-rejected")
    with sandbox.client("refresh-rejected", token) as client:
        assert client.get(f"https://{API}/v1/ok").status_code == 200
        assert client.get(f"https://{API}/v1/reject").status_code == 401
        assert client.get(f"https://{API}/v1/ok").status_code == 200
    mints = provider.count("refresh-rejected")
    assert mints == 2
    fps = [r["token_fp"] for r in sandbox.proxy.requests("refresh-rejected") if "token_fp" in r]
    assert fps[0] == fps[1] != fps[2]


def test_a_narrowed_scope_is_never_served_the_wider_token_kept_in_the_store(
    sandbox: Sandbox, provider: Provider
):
    """`apply` narrows a refresh credential's scope, its secret untouched. The access token
    sealed beside the refresh token for the other replicas was minted for the wider scope:
    it must not be stamped again (it was, for up to 75 % of its lifetime)."""
    import hashlib

    token = refresh_credential(sandbox, "narrowed", "--scope", "read", "--scope", "write")
    policy = sandbox.home / "narrowed.toml"
    policy.write_text(
        "[[credential]]\n"
        'name = "narrowed"\nscheme = "oauth2-refresh"\n'
        f'hosts = ["{API}"]\ntoken_url = "{TOKEN_URL}"\nscope = ["read"]\n'
    )
    with sandbox.client("narrowed", token) as client:
        assert client.get(f"https://{API}/v1/wide").status_code == 200
        sandbox.cli("apply", str(policy), "--yes")
        sandbox.proxy.wait_reload()
        assert client.get(f"https://{API}/v1/narrow").status_code == 200
    by_fp = {
        "tok-" + hashlib.sha256(v.encode()).hexdigest()[:12]: i for v, i in provider.issued.items()
    }
    lines = [r for r in sandbox.proxy.requests("narrowed") if r["path"].startswith("/v1/")]
    scopes = [by_fp[line["token_fp"]].scope for line in lines]
    assert scopes == ["read write", "read"]


def test_an_operator_cannot_seal_an_access_token_in_a_refresh_secret(sandbox: Sandbox):
    secret = {"client_id": "x", "refresh_token": "r", "access_token": "t"}
    text = sandbox.cli(
        "credential", "add", "injected", "--scheme", "oauth2-refresh", "--host", API,
        "--token-url", TOKEN_URL, "--client-auth", "none",
        stdin=json.dumps(secret).encode(), check=False,
    )  # fmt: skip
    assert "the secret has a field other than client_id, refresh_token, client_secret" in text


# -- google-service-account ------------------------------------------------------------


def _google_key(email: str, token_uri: str = GOOGLE_TOKEN_URL) -> tuple[dict[str, str], Any]:
    pem, public = rsa_pem()
    key = {
        "type": "service_account",
        "project_id": "proj",
        "private_key_id": secrets.token_hex(20),
        "private_key": pem,
        "client_email": email,
        "client_id": "1234567890",
        "auth_uri": "https://accounts.google.com/o/oauth2/auth",
        "token_uri": token_uri,
        "universe_domain": "googleapis.com",
    }
    return key, public


def _agent_for(sandbox: Sandbox, name: str) -> str:
    store = sandbox.proxy.store
    token = store.add_principal(name)
    store.add_grant(name, ["GET"], credential=name, paths=["/v1/"])
    sandbox.proxy.wait_reload()
    return token


def test_a_service_account_key_mints_with_a_verified_rs256_assertion(
    sandbox: Sandbox, provider: Provider
):
    email = "agent@proj.iam.gserviceaccount.com"
    key, public = _google_key(email)
    provider.google[email] = public
    sandbox.secrets.append(key["private_key"].split("\n")[1])  # a line of the PEM's body
    sandbox.cli(
        "credential", "add", "gsa", "--scheme", "google-service-account", "--host", API,
        "--scope", "https://www.googleapis.com/auth/cloud-platform",
        "--subject", "user@example.com", stdin=json.dumps(key, indent=2).encode(),
    )  # fmt: skip
    listed = sandbox.cli("credential", "list")
    assert GOOGLE_TOKEN_URL in listed and key["private_key_id"] not in listed
    token = _agent_for(sandbox, "gsa")
    with sandbox.client("gsa", token) as client:
        answer = client.get(f"https://{API}/v1/g")
    assert answer.status_code == 200 and answer.json()["who"] == email
    assert answer.json()["narrowing"] == {"sub": "user@example.com"}
    [issued] = [i for i in provider.issued.values() if i.who == email]
    assert issued.scope == "https://www.googleapis.com/auth/cloud-platform"
    assert not [r for r in provider.refused if r.startswith("assertion")]
    _no_secret_anywhere(sandbox, answer.text)


def test_a_key_the_provider_does_not_know_is_refused_502(sandbox: Sandbox, provider: Provider):
    email = "stranger@proj.iam.gserviceaccount.com"
    key, _ = _google_key(email)
    provider.google[email] = rsa_pem()[1]  # another key's public half
    sandbox.cli(
        "credential", "add", "stranger", "--scheme", "google-service-account", "--host", API,
        "--scope", "s", stdin=json.dumps(key).encode(),
    )  # fmt: skip
    with sandbox.client("stranger", _agent_for(sandbox, "stranger")) as client:
        answer = client.get(f"https://{API}/v1/g")
    assert answer.status_code == 502
    assert answer.json()["detail"] == "the token endpoint answered 400 (invalid_grant)"
    assert "assertion: InvalidSignatureError" in provider.refused


@pytest.mark.parametrize(
    ("change", "message"),
    [
        pytest.param(
            {"private_key": "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"},
            "the secret's private_key is not a PEM private key", id="a key that does not parse",
        ),
        pytest.param(
            {"token_uri": "http://oauth2.googleapis.com/token"},
            "the key file's token_uri must be an https:// URL", id="a token_uri not https",
        ),
        pytest.param({"extra": "x"}, "the secret has a field other than", id="an unknown field"),
        pytest.param({"type": "user"}, "the secret's type must be service_account",
                     id="not a service account"),
    ],
)  # fmt: skip
def test_a_bad_key_file_is_refused_one_line_exit_2(
    sandbox: Sandbox, change: dict[str, str], message: str
):
    key, _ = _google_key("bad@proj.iam.gserviceaccount.com")
    key |= change
    done = subprocess.run(
        [*CREDPROXY, "credential", "add", "badkey", "--scheme", "google-service-account",
         "--host", API, "--scope", "s"],
        input=json.dumps(key).encode(), env=sandbox.proxy.env, cwd=sandbox.home,
        capture_output=True, check=False,
    )  # fmt: skip
    err = done.stderr.decode()
    assert done.returncode == 2 and err.count("\n") == 1 and message in err, err
    assert "AAAA" not in err and "PRIVATE" not in err


# -- github-app ------------------------------------------------------------------------


def _github_app(sandbox: Sandbox, name: str, app_id: str, *extra: str, known: bool = True) -> str:
    pem, public = rsa_pem()
    if known:
        sandbox.provider.apps[app_id] = public
    sandbox.secrets.append(pem.split("\n")[1])
    sandbox.cli(
        "credential", "add", name, "--scheme", "github-app", "--host", API,
        "--api-url", GITHUB_API, *extra,
        stdin=json.dumps({"app_id": int(app_id), "private_key": pem}).encode(),
    )  # fmt: skip
    return _agent_for(sandbox, name)


def test_a_github_app_mints_narrowed_installation_tokens(sandbox: Sandbox, provider: Provider):
    """Each narrowing its own token: the endpoint verifies the app JWT, answers 201 with a
    token restricted to what was asked."""
    narrow = _github_app(
        sandbox, "gh-narrow", "1001", "--installation", "42", "--repository", "repo1",
        "--permission", "contents=read", "--permission", "issues=write",
        "--token-prefix", "token ",
    )  # fmt: skip
    wide = _github_app(sandbox, "gh-wide", "1002", "--installation", "43")
    with sandbox.client("gh-narrow", narrow) as client:
        first = client.get(f"https://{API}/v1/repo")
        echoed = client.get(f"https://{API}/v1/echo")
    with sandbox.client("gh-wide", wide) as client:
        other = client.get(f"https://{API}/v1/repo")
    assert first.status_code == other.status_code == 200
    assert first.json()["who"] == "app-1001/42" and other.json()["who"] == "app-1002/43"
    assert first.json()["narrowing"] == {
        "repositories": ["repo1"],
        "permissions": {"contents": "read", "issues": "write"},
    }
    assert other.json()["narrowing"] == {}
    assert echoed.json()["prefix"] == "token"
    assert provider.count("app-1001/42") == provider.count("app-1002/43") == 1
    _no_secret_anywhere(sandbox, first.text, echoed.text, other.text)


def test_an_app_the_api_does_not_know_is_refused_502(sandbox: Sandbox, provider: Provider):
    token = _github_app(sandbox, "gh-unknown", "1003", "--installation", "44", known=False)
    with sandbox.client("gh-unknown", token) as client:
        answer = client.get(f"https://{API}/v1/repo")
    assert answer.status_code == 502
    assert answer.json()["detail"] == "the GitHub API answered 401"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param([], "--scheme github-app needs an --installation id", id="no installation"),
        pytest.param(["--installation", "1", "--permission", "contents=all"],
                     "invalid --permission", id="a permission level other than read or write"),
        pytest.param(["--installation", "1", "--api-url", "http://gh/api"],
                     "the --api-url must be an https:// URL", id="an API URL that is not https"),
    ],
)  # fmt: skip
def test_bad_github_app_input_is_one_line_exit_2(sandbox: Sandbox, args: list[str], message: str):
    pem, _ = rsa_pem()
    done = subprocess.run(
        [*CREDPROXY, "credential", "add", "badgh", "--scheme", "github-app", "--host", API,
         *args],
        input=json.dumps({"app_id": 1, "private_key": pem}).encode(), env=sandbox.proxy.env,
        cwd=sandbox.home, capture_output=True, check=False,
    )  # fmt: skip
    err = done.stderr.decode()
    assert done.returncode == 2 and err.count("\n") == 1 and message in err, err


# -- the token endpoint's reach ----------------------------------------------------------


@pytest.mark.parametrize(
    "host", ["localhost", "127.0.0.1", "127.1.2.3", "[::1]", "[::ffff:127.0.0.1]"]
)
def test_a_token_endpoint_on_a_private_address_is_never_dialled(
    sandbox: Sandbox, provider: Provider, upstream_ca: trustme.CA, host: str
):
    """Without --allow-private the token URL's host goes through the destination guard as an
    upstream's does: a loopback name or literal is refused before any connection (the local
    server would answer: its certificate covers the name)."""
    bare = host.strip("[]")
    name = "private-" + secrets.token_hex(3)
    with Upstream(upstream_ca, [bare, "localhost"], app=provider) as local:
        sandbox.secrets.append(f"{name}-secret-value")
        secret = json.dumps({"client_id": name, "client_secret": f"{name}-secret-value"})
        sandbox.cli(
            "credential", "add", name, "--scheme", "oauth2-client", "--host", API,
            "--token-url", f"https://{host}:{local.port}/oauth/token", stdin=secret.encode(),
        )  # fmt: skip
        with sandbox.client(name, _agent_for(sandbox, name)) as client:
            answer = client.get(f"https://{API}/v1/x")
        assert answer.status_code == 502
        assert answer.headers["x-credproxy-reason"] == "credentials-unavailable"
        assert local.log.snis == [] and local.log.requests == []
    assert f"{name}-secret-value" not in answer.text


def test_a_principal_never_gets_another_principals_minted_token(
    sandbox: Sandbox, provider: Provider
):
    """Two principals, each granted its own oauth2-client credential on the same API and
    paths: each request carries its own credential's token, a 401 to one drops only that
    one, and a principal without a grant on a credential never makes it mint."""
    alice = sandbox.client_credential("cross-a")
    bob = sandbox.client_credential("cross-b")
    carol = sandbox.proxy.store.add_principal("cross-c")  # no grant at all
    sandbox.proxy.wait_reload()
    with sandbox.client("cross-c", carol) as c, pytest.raises(httpx.ProxyError, match="403"):
        c.get(f"https://{API}/v1/who")  # refused at CONNECT: no grant on the host
    assert provider.count("cross-a") == 0
    with sandbox.client("cross-a", alice) as a, sandbox.client("cross-b", bob) as b:
        assert a.get(f"https://{API}/v1/who").json()["who"] == "cross-a"
        assert b.get(f"https://{API}/v1/who").json()["who"] == "cross-b"
        assert b.get(f"https://{API}/v1/reject").status_code == 401
        assert a.get(f"https://{API}/v1/who").json()["who"] == "cross-a"
        assert b.get(f"https://{API}/v1/who").json()["who"] == "cross-b"
    assert (provider.count("cross-a"), provider.count("cross-b")) == (1, 2)
    fps_a = {r["token_fp"] for r in sandbox.proxy.requests("cross-a") if "token_fp" in r}
    fps_b = {r["token_fp"] for r in sandbox.proxy.requests("cross-b") if "token_fp" in r}
    assert len(fps_a) == 1 and len(fps_b) == 2 and not fps_a & fps_b
