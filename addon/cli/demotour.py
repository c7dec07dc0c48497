"""`credproxy demo`: five requests through a real proxy, each shown as what the agent sent,
what the upstream received and what the agent got back."""

from __future__ import annotations

import base64
import http.client
import json
import shutil
import ssl
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from addon.cli.demostage import DemoFailed, Stage, run_argv
from addon.cli.demoupstream import HOST, Seen, Upstream
from store.ca import PUBLIC_CERT

AUDIT_TIMEOUT = 5.0


@dataclass
class Exchange:
    """One request of the tour: the three columns shown, and what its check reads."""

    title: str
    sent: list[str]
    received: list[str]
    got: list[str]
    audit: str
    status: int = 0
    reason: str | None = None
    body: bytes = b""
    seen: list[Seen] = field(default_factory=list)


class Tour(Stage):
    """The store set up as an operator would, then five requests, each checked: DemoFailed
    if one was not answered as shown, or if the secret reached the agent."""

    def run(self) -> None:
        with self.upstream() as (upstream, upstream_ca):
            self.say(f"credproxy demo, in {self.root} (removed at the end)")
            self.say(f"the fake secret {self.secret[:8]}… is shown masked, the token not at all")
            self.say(f"upstream: https://{HOST} on 127.0.0.1:{upstream.server_address[1]}")
            self.say()
            self.setup()
            argv = run_argv("127.0.0.1:0", upstream_ca, upstream.server_address[1])
            self.say(f"$ credproxy {' '.join(argv)}")
            with self.proxy(argv):
                self.say(f"  listening on 127.0.0.1:{self.proxy_port}")
                self.say()
                self.show(upstream)

    def setup(self) -> None:
        self.cli("init")
        self.token = json.loads(self.cli("principal", "add", "agent", "--json"))["token"]
        self.cli(
            "credential",
            "add",
            "demo",
            "--scheme",
            "bearer",
            "--host",
            HOST,
            stdin=self.secret.encode(),
        )
        self.cli(
            "grant", "add", "agent", "--credential", "demo", "--method", "GET", "--path", "/v1/"
        )
        self.cli(
            "grant",
            "add",
            "agent",
            "--credential",
            "demo",
            "--method",
            "POST",
            "--path",
            "/v1/messages",
            "--once",
        )
        for line in self.cli("grant", "list").splitlines():
            self.say(f"  {line}")
        self.say()

    def send(self, upstream: Upstream, title: str, method: str, path: str) -> Exchange:
        context = ssl.create_default_context(cafile=str(self.root / "certs" / PUBLIC_CERT))
        conn = http.client.HTTPSConnection(
            "127.0.0.1", self.proxy_port, context=context, timeout=10
        )
        auth = base64.b64encode(f"agent:{self.token}".encode()).decode()
        conn.set_tunnel(HOST, 443, headers={"Proxy-Authorization": f"Basic {auth}"})
        before_seen, before_audit = len(upstream.seen), len(self._requests())
        body = b'{"text": "hello"}' if method == "POST" else None
        conn.request(method, path, body=body, headers={"Authorization": "Bearer placeholder"})
        response = conn.getresponse()
        data = response.read()
        conn.close()
        line = self._next_request(before_audit)
        seen = upstream.seen[before_seen:]
        reason = response.getheader("x-credproxy-reason")
        received = [
            part
            for s in seen
            for part in (f"{s.method} {s.path}", f"Authorization: {s.authorization}")
        ] or ["(nothing)"]
        got = [f"{response.status} {response.reason}"]
        if reason:
            got.append(f"X-Credproxy-Reason: {reason}")
        got.append(_summary(data))
        audit = " ".join(
            f"{k}={line[k]}" for k in ("decision", "reason", "grant_id", "status") if line.get(k)
        )
        return Exchange(
            title,
            [f"{method} https://{HOST}{path}", "Authorization: Bearer placeholder"],
            received,
            got,
            audit,
            response.status,
            reason,
            data,
            seen,
        )

    def _requests(self) -> list[dict[str, Any]]:
        return [e for e in self._audit() if e.get("event") == "request"]

    def _next_request(self, before: int) -> dict[str, Any]:
        """The audit line of the request just sent: written just after its response."""
        deadline = time.monotonic() + AUDIT_TIMEOUT
        while time.monotonic() < deadline:
            lines = self._requests()
            if len(lines) > before:
                return lines[before]
            time.sleep(0.05)
        raise DemoFailed("no audit line for the request in time")

    def show(self, upstream: Upstream) -> None:
        stamped = f"Bearer {self.secret}"
        checks: list[tuple[Exchange, bool]] = []

        def step(title: str, method: str, path: str, expect: Any) -> None:
            exchange = self.send(upstream, title, method, path)
            self.table(exchange)
            checks.append((exchange, bool(expect(exchange))))

        step(
            "1. a stamped request (grant 1: GET /v1/)",
            "GET",
            "/v1/models",
            lambda x: x.status == 200 and [s.authorization for s in x.seen] == [stamped],
        )
        step(
            "2. a path no grant allows: refused, the upstream sees nothing",
            "GET",
            "/admin/users",
            lambda x: x.status == 403 and x.reason == "path-not-allowed" and not x.seen,
        )
        step(
            "3. an upstream that echoes the secret: redacted on the way back",
            "GET",
            "/v1/echo",
            lambda x: x.status == 200 and b"[REDACTED]" in x.body and x.seen,
        )
        step(
            "4. a once-grant (grant 2: POST /v1/messages), first use",
            "POST",
            "/v1/messages",
            lambda x: x.status == 200 and len(x.seen) == 1,
        )
        step(
            "5. the same once-grant, used again",
            "POST",
            "/v1/messages",
            lambda x: x.status == 403 and x.reason == "grant-consumed" and not x.seen,
        )
        leaked = [x.title for x, _ in checks if self.secret.encode() in x.body]
        if leaked:
            raise DemoFailed(f"the secret reached the agent in: {', '.join(leaked)}")
        failed = [x.title for x, ok in checks if not ok]
        if failed:
            raise DemoFailed(f"unexpected answers in: {', '.join(failed)}")
        self.say("The agent never held the secret; every request is one audit line.")

    def table(self, x: Exchange) -> None:
        width = max(24, min(44, (shutil.get_terminal_size((110, 24)).columns - 4) // 3))
        columns = [
            ["agent sent", *x.sent],
            ["upstream received", *x.received],
            ["agent got back", *x.got],
        ]
        wrapped = [
            [part for text in column for part in _wrap(self.mask(text), width)]
            for column in columns
        ]
        self.say(f"── {x.title}")
        for row in range(max(len(c) for c in wrapped)):
            cells = [c[row] if row < len(c) else "" for c in wrapped]
            self.say("  ".join(cell.ljust(width) for cell in cells).rstrip())
        self.say(f"audit: {x.audit}")
        self.say()


def _wrap(text: str, width: int) -> Sequence[str]:
    return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=True) or [""]


def _summary(body: bytes) -> str:
    """A refusal's reason and detail (its other fields elided), any other body as it came."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode(errors="replace")
    if isinstance(data, dict) and "reason" in data:
        shown = {k: data[k] for k in ("reason", "detail") if k in data}
        return json.dumps(shown)[:-1] + (", …}" if len(shown) < len(data) else "}")
    return json.dumps(data)
