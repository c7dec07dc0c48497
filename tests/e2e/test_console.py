"""The approvers' console (`--console`), over HTTP: sign-in, the same-origin and CSRF checks,
escaping, and approvals and denials of real held requests of a real proxy; then in a real
browser, Debian's Chromium driven by Playwright."""

from __future__ import annotations

import http.server
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme

from store.crypto import Secret
from store.rules import validation
from tests.e2e.conftest import NAMES, Proxy, start_proxy, stop_proxy
from tests.e2e.raw import connect, exchange, proxy_auth
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e

TOKEN = "console-operator-token-0123456789abcdef"  # noqa: S105 - a test's own
OTHER = "second-operator-token-0123456789abcdefgh"  # noqa: S105
SECRET = b"sk-console-e2e-secret"


@pytest.fixture(scope="module")
def console_proxy(
    tmp_path_factory: pytest.TempPathFactory,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
) -> Iterator[Proxy]:
    resolve = [f"{name}=127.0.0.1:{shared_upstream.port}" for name in NAMES if name != "localhost"]
    home = tmp_path_factory.mktemp("console")
    tokens = home / "operators"
    tokens.write_text(f"# the console's operators\nalice:{TOKEN}\nbob:{OTHER}\n")
    extra = [
        "--console",
        "127.0.0.1:0",
        "--console-token-file",
        str(tokens),
        # Loopback opened: only the guard's own-listener check keeps the console out of reach.
        "--allow-private",
        "127.0.0.0/8",
    ]
    running = start_proxy(home, upstream_ca, resolve, extra, template=initialised_home)
    yield running
    stop_proxy(running)


def console_port(proxy: Proxy) -> int:
    started = next(line for line in proxy.audit() if line["event"] == "proxy.started")
    return int(started["console"][0].rsplit(":", 1)[1])


def browser(proxy: Proxy, origin: str | None = "same") -> httpx.Client:
    """What a browser on the console's own page sends: its Origin."""
    base = f"http://127.0.0.1:{console_port(proxy)}"
    headers = {"origin": base if origin == "same" else origin} if origin else {}
    return httpx.Client(base_url=base, headers=headers, trust_env=False, timeout=10)


@contextmanager
def signed_in(proxy: Proxy, token: str = TOKEN) -> Iterator[tuple[httpx.Client, str]]:
    """A signed-in client and its session's CSRF token."""
    with browser(proxy) as client:
        reply = client.post("/login", data={"token": token})
        assert reply.status_code == 303, reply.text
        page = client.get("/")
        found = re.search(r'name=csrf value="([^"]+)"', page.text)
        assert found is not None
        yield client, found.group(1)


def _held(proxy: Proxy, names: Callable[[str], str]) -> tuple[str, str, int]:
    agent, cred = names("agent"), names("cred")
    token = proxy.store.add_principal(agent)
    proxy.store.add_credential(cred, "bearer", ["api.test"], Secret(SECRET))
    limits = validation.limits(None, None, approval="each", hold="30s")
    grant_id = proxy.store.add_grant(agent, ["GET"], credential=cred, paths=["/v1/"], limits=limits)
    proxy.wait_reload()
    return agent, token, grant_id


def _send(proxy: Proxy, agent: str, token: str, url: str) -> Future[httpx.Response]:
    pool = ThreadPoolExecutor(1)

    def one() -> httpx.Response:
        with proxy.client(agent, token, timeout=60) as client:
            return client.get(url)

    future = pool.submit(one)
    pool.shutdown(wait=False)
    return future


def _pending_id(proxy: Proxy, agent: str, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in proxy.store.list_access_requests("pending"):
            if r.principal == agent:
                return r.id
        time.sleep(0.05)
    raise AssertionError("nothing held")


def _events(proxy: Proxy, event: str) -> list[dict[str, Any]]:
    return [line for line in proxy.audit() if line.get("event") == event]


# -- pages, headers, sign-in -----------------------------------------------------------


def test_the_sign_in_page_has_a_strict_policy_and_no_inline_script(console_proxy: Proxy) -> None:
    with browser(console_proxy) as client:
        page = client.get("/")
        script = client.get("/console.js")
        style = client.get("/console.css")
    assert page.status_code == 200
    assert "name=token" in page.text
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp
    assert "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
    assert page.headers["x-frame-options"] == "DENY"
    assert page.headers["x-content-type-options"] == "nosniff"
    assert page.headers["cache-control"] == "no-store"
    # Every script has a src of the console's own; no inline handler.
    assert re.findall(r"<script[^>]*>", page.text) == ['<script src="/console.js" defer>']
    assert not re.search(r"<[^>]+\son[a-z]+=", page.text)
    assert script.headers["content-type"].startswith("text/javascript")
    assert "fetch(" in script.text and "http" not in script.text  # nothing from elsewhere
    assert style.headers["content-type"].startswith("text/css")
    assert "@import" not in style.text and "url(" not in style.text


def test_an_operator_token_signs_in_with_a_strict_cookie(console_proxy: Proxy) -> None:
    with browser(console_proxy) as client:
        reply = client.post("/login", data={"token": TOKEN})
        assert reply.status_code == 303
        cookie = reply.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie
        page = client.get("/")
    assert "signed in as <b>alice</b>" in page.text
    signed = _events(console_proxy, "console.signed_in")
    assert signed and signed[-1]["operator"] == "alice"
    assert TOKEN not in console_proxy.output()


@pytest.mark.parametrize(
    "token",
    [
        pytest.param(TOKEN[:-1], id="a token one character short"),
        pytest.param(TOKEN + "x", id="a token one character long"),
        pytest.param("", id="no token"),
    ],
)
def test_a_wrong_token_opens_nothing(console_proxy: Proxy, token: str) -> None:
    with browser(console_proxy) as client:
        reply = client.post("/login", data={"token": token})
        assert reply.status_code == 401
        assert "set-cookie" not in reply.headers
        assert client.get("/panel").status_code == 401


def test_an_agents_principal_token_never_opens_the_console(console_proxy: Proxy, names) -> None:
    agent = names("agent")
    token = console_proxy.store.add_principal(agent)
    with browser(console_proxy) as client:
        assert client.post("/login", data={"token": token}).status_code == 401
        assert client.post("/login", data={"token": f"{agent}:{token}"}).status_code == 401
    assert token not in console_proxy.output()


@pytest.mark.parametrize(
    ("origin", "fetch_site"),
    [
        pytest.param("http://evil.example", None, id="another origin"),
        pytest.param(None, None, id="no origin at all"),
        pytest.param("null", None, id="an opaque origin"),
        pytest.param("same", "cross-site", id="a cross-site fetch with a forged origin"),
        pytest.param("same", "same-site", id="a sibling site"),
    ],
)
def test_a_sign_in_from_elsewhere_is_refused(
    console_proxy: Proxy, origin: str | None, fetch_site: str | None
) -> None:
    with browser(console_proxy, origin) as client:
        headers = {"sec-fetch-site": fetch_site} if fetch_site else {}
        reply = client.post("/login", data={"token": TOKEN}, headers=headers)
    assert reply.status_code == 403
    assert "set-cookie" not in reply.headers


def test_signing_out_ends_the_session(console_proxy: Proxy) -> None:
    with signed_in(console_proxy) as (client, csrf):
        cookie = client.cookies["credproxy_console"]
        assert client.get("/panel").status_code == 200
        assert client.post("/logout", data={"csrf": csrf}).status_code == 303
        assert client.get("/panel").status_code == 401
    # The old cookie, kept by a client that ignores the sign-out, opens nothing either.
    with browser(console_proxy) as again:
        reply = again.get("/panel", headers={"cookie": f"credproxy_console={cookie}"})
        assert reply.status_code == 401


def test_every_change_needs_a_session(console_proxy: Proxy) -> None:
    with browser(console_proxy) as client:
        reply = client.post("/requests/1", data={"csrf": "x", "decision": "approve"})
        assert reply.status_code == 401
        assert client.post("/logout", data={"csrf": "x"}).status_code == 401
        assert client.get("/panel").status_code == 401
        assert client.get("/nowhere").status_code == 404
        assert client.get("/requests/1").status_code == 405
        assert client.post("/grants/1/revoke", data={"csrf": "x"}).status_code == 401
        assert client.get("/grants/1/revoke").status_code == 405


def test_oversized_input_is_refused(console_proxy: Proxy) -> None:
    with browser(console_proxy) as client:
        big = client.post(
            "/login",
            content=b"token=" + b"a" * 9000,
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
        assert big.status_code == 413
        head = client.get("/", headers={"x-pad": "a" * 20000})
        assert head.status_code == 400


# -- held requests, approved and denied --------------------------------------------------


def test_a_held_request_approved_in_the_console_completes(
    console_proxy: Proxy, upstream: Upstream, names
) -> None:
    agent, token, grant_id = _held(console_proxy, names)
    path = f"/v1/{agent}/held"
    answer = _send(console_proxy, agent, token, f"https://api.test{path}")
    request_id = _pending_id(console_proxy, agent)
    with signed_in(console_proxy) as (client, csrf):
        panel = client.get("/panel").text
        assert f"<tr data-id={request_id}>" in panel
        assert f"GET api.test{path}" in panel and agent in panel
        assert SECRET.decode() not in panel and token not in panel
        reply = client.post(
            f"/requests/{request_id}",
            data={"csrf": csrf, "decision": "approve", "note": "looks right"},
        )
        assert reply.status_code == 303
    response = answer.result(timeout=15)
    assert response.status_code == 200
    assert [r for r in upstream.log.requests if r.target == path]
    approved = [e for e in _events(console_proxy, "console.approved") if e["id"] == request_id]
    assert approved and approved[0]["operator"] == "alice"
    assert (approved[0]["note"], approved[0]["grant_id"]) == ("looks right", grant_id)


def test_a_held_request_denied_in_the_console_is_refused(
    console_proxy: Proxy, upstream: Upstream, names
) -> None:
    agent, token, _ = _held(console_proxy, names)
    path = f"/v1/{agent}/denied"
    answer = _send(console_proxy, agent, token, f"https://api.test{path}")
    request_id = _pending_id(console_proxy, agent)
    with signed_in(console_proxy, OTHER) as (client, csrf):
        reply = client.post(
            f"/requests/{request_id}", data={"csrf": csrf, "decision": "deny", "note": "not now"}
        )
        assert reply.status_code == 303
        again = client.post(f"/requests/{request_id}", data={"csrf": csrf, "decision": "approve"})
        assert again.status_code == 409
        assert "denied, not pending" in again.text
    response = answer.result(timeout=15)
    assert response.status_code == 403
    assert response.headers["x-credproxy-reason"] == "approval-denied"
    assert not [r for r in upstream.log.requests if r.target == path]
    denied = [e for e in _events(console_proxy, "console.denied") if e["id"] == request_id]
    assert denied and denied[0]["operator"] == "bob" and denied[0]["note"] == "not now"


@pytest.mark.parametrize(
    ("csrf", "origin"),
    [
        pytest.param("wrong", "same", id="a wrong CSRF token"),
        pytest.param("", "same", id="no CSRF token"),
        pytest.param(None, "http://evil.example", id="the right token from another origin"),
        pytest.param(None, None, id="the right token and no origin"),
    ],
)
def test_a_forged_decision_changes_nothing(
    console_proxy: Proxy, names, csrf: str | None, origin: str | None
) -> None:
    agent, token, _ = _held(console_proxy, names)
    answer = _send(console_proxy, agent, token, f"https://api.test/v1/{agent}/forged")
    request_id = _pending_id(console_proxy, agent)
    with signed_in(console_proxy) as (client, right):
        headers = {"origin": origin} if origin not in (None, "same") else {}
        if origin is None:
            del client.headers["origin"]
        reply = client.post(
            f"/requests/{request_id}",
            data={"csrf": right if csrf is None else csrf, "decision": "approve"},
            headers=headers,
        )
        assert reply.status_code == 403
        [row] = [r for r in console_proxy.store.list_access_requests() if r.id == request_id]
        assert row.state == "pending"
        # The real decision still works: the agent is not left waiting.
        client.headers["origin"] = str(client.base_url).rstrip("/")
        client.post(f"/requests/{request_id}", data={"csrf": right, "decision": "deny"})
    assert answer.result(timeout=15).status_code == 403


# -- access requests, escaping, recent decisions ------------------------------------------


def test_an_access_request_approved_becomes_the_narrow_grant(console_proxy: Proxy, names) -> None:
    agent = names("agent")
    console_proxy.store.add_principal(agent)
    recorded = console_proxy.store.record_access_request(
        agent, "api.test", 443, "GET", f"/v1/{agent}/report", "<script>alert(1)</script>", True
    )
    assert recorded is not None
    request_id = recorded[0]
    with signed_in(console_proxy) as (client, csrf):
        panel = client.get("/panel").text
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in panel
        assert "<script>alert" not in panel
        reply = client.post(f"/requests/{request_id}", data={"csrf": csrf, "decision": "approve"})
        assert reply.status_code == 303
    [grant] = console_proxy.store.list_grants(agent)
    assert grant.methods == ["GET"] and grant.paths == [f"/v1/{agent}/report"]


def test_a_spent_budget_is_raised_in_the_console_with_its_form(console_proxy: Proxy, names) -> None:
    agent = names("agent")
    console_proxy.store.add_principal(agent)
    limits = validation.limits(None, None, budget=("total=250/day",))
    grant_id = console_proxy.store.add_grant(agent, ["POST"], hosts=["api.test"], limits=limits)
    request_id, _ = console_proxy.store.record_budget_request(
        agent, grant_id, "api.test", 443, "POST", "/v1/chat", "total=250/day"
    )

    def budget() -> str | None:
        (grant,) = console_proxy.store.list_grants(agent)
        return grant.budget

    with signed_in(console_proxy) as (client, csrf):
        panel = client.get("/panel").text
        section = panel[panel.index("<section id=budgets>") :]
        assert f"<tr data-id={request_id}>" in section and "total=250/day" in section
        assert "name=budget" in section
        url = f"/requests/{request_id}"
        plain = client.post(url, data={"csrf": csrf, "decision": "approve"})
        assert plain.status_code == 409 and "approve it with a budget" in plain.text
        bad = client.post(url, data={"csrf": csrf, "decision": "approve", "budget": "lots"})
        assert bad.status_code == 409 and "invalid budget" in bad.text
        long = client.post(url, data={"csrf": csrf, "decision": "approve", "budget": "x" * 201})
        assert long.status_code == 400
        forged = client.post(
            url, data={"csrf": "0" * len(csrf), "decision": "approve", "budget": "total=9/day"}
        )
        assert forged.status_code == 403
        assert budget() == "total=250/day"
        raised = client.post(
            url,
            data={"csrf": csrf, "decision": "approve", "budget": "total=400/day, output=50/hour"},
        )
        assert raised.status_code == 303
    assert budget() == "output=50/hour, total=400/day"
    (line,) = [e for e in _events(console_proxy, "console.approved") if e["id"] == request_id]
    assert (line["operator"], line["kind"], line["grant_id"]) == ("alice", "budget", grant_id)
    assert (line["budget_was"], line["budget"]) == (
        "total=250/day",
        "output=50/hour, total=400/day",
    )
    [row] = [r for r in console_proxy.store.list_access_requests() if r.id == request_id]
    assert (row.state, row.decided_by) == ("approved", "console:alice")


def test_a_note_that_is_not_one_printable_line_is_refused(console_proxy: Proxy, names) -> None:
    agent = names("agent")
    console_proxy.store.add_principal(agent)
    recorded = console_proxy.store.record_access_request(agent, "api.test", 443, "GET", "/v1/n")
    assert recorded is not None
    with signed_in(console_proxy) as (client, csrf):
        for note in ("two\nlines", "x" * 201):
            reply = client.post(
                f"/requests/{recorded[0]}", data={"csrf": csrf, "decision": "deny", "note": note}
            )
            assert reply.status_code == 400
        bad = client.post(f"/requests/{recorded[0]}", data={"csrf": csrf, "decision": "maybe"})
        assert bad.status_code == 400


def test_recent_decisions_are_listed_filtered_and_hold_no_secret(
    console_proxy: Proxy, upstream: Upstream, names
) -> None:
    agent, cred = names("agent"), names("cred")
    token = console_proxy.store.add_principal(agent)
    console_proxy.store.add_credential(cred, "bearer", ["api.test"], Secret(SECRET))
    console_proxy.store.add_grant(agent, ["GET"], credential=cred, paths=["/v1/"])
    console_proxy.wait_reload()
    with console_proxy.client(agent, token) as proxied:
        assert proxied.get("https://api.test/v1/ok?key=query-secret").status_code == 200
        assert proxied.get("https://api.test/v2/no").status_code == 403
    with signed_in(console_proxy) as (client, _):
        deadline = time.monotonic() + 5
        while agent not in (panel := client.get("/panel").text) and time.monotonic() < deadline:
            time.sleep(0.1)
        denied = client.get("/panel", params={"principal": agent, "decision": "deny"}).text
        by_reason = client.get("/panel", params={"reason": "path-not-allowed"}).text
        page = client.get("/", params={"principal": f'"><b>{agent}'}).text
    recent = panel.split("<section id=recent>")[1]
    assert "api.test/v1/ok" in recent and "api.test/v2/no" in recent
    assert "query-secret" not in panel and SECRET.decode() not in panel and token not in panel
    denied_rows = denied.split("<section id=recent>")[1]
    assert "/v2/no" in denied_rows and "/v1/ok" not in denied_rows
    assert "/v2/no" in by_reason.split("<section id=recent>")[1]
    assert f'value="&quot;&gt;&lt;b&gt;{agent}"' in page


# -- grants and principals -----------------------------------------------------------------


def test_grants_are_listed_and_one_is_revoked(
    console_proxy: Proxy, upstream: Upstream, names
) -> None:
    agent, cred = names("agent"), names("cred")
    token = console_proxy.store.add_principal(agent)
    console_proxy.store.add_credential(cred, "bearer", ["api.test"], Secret(SECRET))
    grant_id = console_proxy.store.add_grant(
        agent, ["GET"], credential=cred, paths=["/v1/"], purpose="<i>nightly</i>"
    )
    console_proxy.wait_reload()
    with console_proxy.client(agent, token) as proxied:
        assert proxied.get(f"https://api.test/v1/{agent}").status_code == 200
    with browser(console_proxy) as anonymous:
        assert "name=token" in anonymous.get("/grants").text
        forged = anonymous.post(f"/grants/{grant_id}/revoke", data={"csrf": "x"})
        assert forged.status_code == 401
    with signed_in(console_proxy) as (client, csrf):
        listing = client.get("/grants").text
        assert f"<tr data-id={grant_id}>" in listing and agent in listing
        assert "&lt;i&gt;nightly&lt;/i&gt;" in listing
        assert SECRET.decode() not in listing and token not in listing
        stale = client.post(f"/grants/{grant_id}/revoke", data={"csrf": "stale"})
        assert stale.status_code == 403
        assert [g.state for g in console_proxy.store.list_grants(agent)] == ["active"]
        reply = client.post(f"/grants/{grant_id}/revoke", data={"csrf": csrf})
        assert (reply.status_code, reply.headers["location"]) == (303, "/grants")
        assert f"<tr data-id={grant_id}>" not in client.get("/grants").text
        missing = client.post("/grants/999999/revoke", data={"csrf": csrf})
        assert missing.status_code == 409
    assert [g.state for g in console_proxy.store.list_grants(agent)] == ["revoked"]
    console_proxy.wait_reload()
    # With no grant left for the host, its CONNECT is refused.
    with (
        console_proxy.client(agent, token) as proxied,
        pytest.raises(httpx.ProxyError, match="403"),
    ):
        proxied.get(f"https://api.test/v1/{agent}")
    revoked = [e for e in _events(console_proxy, "console.revoked") if e["grant_id"] == grant_id]
    assert revoked and revoked[0]["operator"] == "alice"


# -- never through the proxy ---------------------------------------------------------------


def test_the_console_is_never_reachable_through_the_proxy(console_proxy: Proxy, names) -> None:
    port = console_port(console_proxy)
    agent = names("agent")
    token = console_proxy.store.add_principal(agent)
    console_proxy.store.add_grant(agent, ["*"], hosts=[f"localhost:{port}", f"127.0.0.1:{port}"])
    console_proxy.wait_reload()
    with console_proxy.client(agent, token) as client:
        reply = client.get(f"http://localhost:{port}/")
    assert reply.status_code == 403
    assert reply.headers["x-credproxy-reason"] == "destination-forbidden"
    # A tunnel opens to a granted address; what goes through it is vetted request by request.
    sock, tunnel = connect(console_proxy.port, f"127.0.0.1:{port}", proxy_auth(agent, token))
    with sock:
        assert tunnel.status == 200
        inside = exchange(sock, f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    assert (inside.status, inside.reason) == (403, "destination-forbidden")
    assert b"credproxy console" not in inside.body


# -- in a real browser ----------------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# CREDPROXY_SCREENSHOTS=DIR keeps the pages' screenshots there (docs/img for the docs).
SHOTS = os.environ.get("CREDPROXY_SCREENSHOTS")


@pytest.fixture(scope="module")
def chromium() -> Iterator[object]:
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed; CI must install it (apt-get install chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        # Root in a container has no user namespace for Chromium's sandbox; the page is ours.
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--no-proxy-server"]
        )
        yield browser
        browser.close()


class _Attacker(http.server.BaseHTTPRequestHandler):
    """Another origin on the same host (so the same site: the cookie goes along), whose page
    posts a decision to the console as soon as it loads."""

    target = ""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = (
            "<!doctype html><form method=post action='" + self.target + "'>"
            "<input name=decision value=approve><input name=csrf value=guessed></form>"
            "<script>document.forms[0].submit()</script>"
        ).encode()
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _shot(page: object, name: str, tmp_path: Path) -> None:
    folder = Path(SHOTS) if SHOTS else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(folder / f"console-{name}.png"), full_page=True)  # type: ignore[attr-defined]


@pytest.mark.slow  # about 10 s, and Chromium's start
def test_an_approver_decides_in_a_browser(
    chromium: object, console_proxy: Proxy, upstream: Upstream, names, tmp_path: Path
) -> None:
    base = f"http://127.0.0.1:{console_port(console_proxy)}"
    context = chromium.new_context(viewport={"width": 1100, "height": 700})  # type: ignore[attr-defined]
    page = context.new_page()
    page.goto(base + "/")
    _shot(page, "sign-in", tmp_path)
    page.fill("input[name=token]", TOKEN)
    page.click("text=Sign in")
    page.wait_for_selector("text=signed in as")

    # A held request appears on the page while its agent waits.
    agent, token, _ = _held(console_proxy, names)
    path = f"/v1/{agent}/from-the-browser"
    waiting = _send(console_proxy, agent, token, f"https://api.test{path}")
    request_id = _pending_id(console_proxy, agent)
    row = f"#held tr[data-id='{request_id}']"
    page.wait_for_selector(row, timeout=10_000)
    assert not waiting.done()
    _shot(page, "held", tmp_path)
    page.fill(f"{row} input[name=note]", "expected: the nightly report")
    page.click(f"{row} button.approve")
    assert waiting.result(timeout=15).status_code == 200
    assert [r for r in upstream.log.requests if r.target == path]

    # Another is denied: its agent gets 403 approval-denied.
    other, other_token, _ = _held(console_proxy, lambda base: names(f"{base}-denied"))
    refused = _send(console_proxy, other, other_token, f"https://api.test/v1/{other}/no")
    other_id = _pending_id(console_proxy, other)
    row = f"#held tr[data-id='{other_id}']"
    page.wait_for_selector(row, timeout=10_000)
    page.click(f"{row} button.deny")
    answer = refused.result(timeout=15)
    assert answer.status_code == 403
    assert answer.headers["x-credproxy-reason"] == "approval-denied"
    page.wait_for_selector("#recent >> text=approval-denied", timeout=10_000)
    _shot(page, "decided", tmp_path)

    # A page of another origin posts a decision with the operator's cookie: refused.
    third, third_token, _ = _held(console_proxy, lambda base: names(f"{base}-forged"))
    held = _send(console_proxy, third, third_token, f"https://api.test/v1/{third}/forged")
    third_id = _pending_id(console_proxy, third)
    _Attacker.target = f"{base}/requests/{third_id}"
    attacker = http.server.HTTPServer(("127.0.0.1", 0), _Attacker)
    threading.Thread(target=attacker.serve_forever, daemon=True).start()
    try:
        page.goto(f"http://127.0.0.1:{attacker.server_address[1]}/")
        page.wait_for_selector("text=a change must come from this console", timeout=10_000)
    finally:
        attacker.shutdown()
    [row_state] = [r.state for r in console_proxy.store.list_access_requests() if r.id == third_id]
    assert row_state == "pending"
    assert not held.done()
    page.goto(base + "/grants")
    page.wait_for_selector("#grants")
    _shot(page, "grants", tmp_path)
    context.close()
    console_proxy.store.deny_access_request(third_id)
    assert held.result(timeout=15).status_code == 403
