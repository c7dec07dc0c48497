"""The approvers' console (`--console HOST:PORT`): held requests, access requests and the
last decisions in a browser, approved or denied there. Off by default, on a listener of its
own that the destination guard keeps out of the proxy's reach.

A small HTTP/1.1 responder like the admin listener's: one request per connection, heads and
bodies bounded, every answer with a strict Content-Security-Policy. Sign-in is by an
operator token: one the CLI issued (`console token add`, looked up in the store, whose
session ends at its next request once the token is revoked or expired) or one of
`--console-token-file` (`consoleauth.py`); every change is a POST from the console's own origin
carrying the session's CSRF token, and is audited with the operator's name.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from urllib.parse import parse_qs

from addon.observe import audit
from addon.observe.recent import Recent
from addon.proxy.live import LivePolicy
from addon.runtime import consolepage as page
from addon.runtime.consoleauth import Operators, Session, Sessions, csrf_ok, same_origin
from store.errors import CredproxyError, InvalidInput, NotFound
from store.records import BUDGET, PENDING

MAX_HEAD = 16 * 1024
MAX_BODY = 8 * 1024
MAX_CONNECTIONS = 32  # console connections served at once; more are closed unanswered
MAX_NOTE = 200
SHOWN = 100  # recent decisions on the page
READ_SECONDS = 10.0
COOKIE = "credproxy_console"
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
_HEADERS = (
    ("content-security-policy", CSP),
    ("x-content-type-options", "nosniff"),
    ("x-frame-options", "DENY"),
    # Not no-referrer: Chromium then sends `Origin: null` with a form post, which same_origin
    # must refuse. same-origin sends nothing to anyone else.
    ("referrer-policy", "same-origin"),
    ("cache-control", "no-store"),
    ("cross-origin-opener-policy", "same-origin"),
    ("cross-origin-resource-policy", "same-origin"),
)
_HTML = "text/html; charset=utf-8"
_SINGLE = ("host", "origin", "cookie", "content-length", "sec-fetch-site", "content-type")
_DECIDE = re.compile(r"/requests/([1-9][0-9]{0,17})")
_REVOKE = re.compile(r"/grants/([1-9][0-9]{0,17})/revoke")
MAX_LISTED = 500  # grants and principals on the grants page


class BadRequest(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    form: dict[str, str] = field(default_factory=dict)

    @property
    def cookie(self) -> str | None:
        found = [
            value
            for name, _, value in (
                part.strip().partition("=") for part in self.headers.get("cookie", "").split(";")
            )
            if name == COOKIE
        ]
        return found[0] if len(found) == 1 else None


@dataclass
class Response:
    status: int
    body: str | bytes
    kind: str = _HTML
    extra: list[tuple[str, str]] = field(default_factory=list)


def _redirect(extra: list[tuple[str, str]] | None = None) -> Response:
    return Response(303, "", extra=[("location", "/"), *(extra or [])])


def _fields(text: str) -> dict[str, str]:
    try:
        parsed = parse_qs(text, keep_blank_values=True, max_num_fields=16, strict_parsing=False)
    except ValueError as e:
        raise BadRequest(400, "too many fields") from e
    if any(len(values) != 1 for values in parsed.values()):
        raise BadRequest(400, "a field given twice")
    return {name: values[0] for name, values in parsed.items()}


class Console:
    def __init__(
        self,
        host: str,
        port: int,
        operators: Operators | None,
        live: LivePolicy,
        recent: Recent,
        sessions: Sessions | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.operators = operators
        self.live = live
        self.recent = recent
        self.sessions = sessions or Sessions()
        self.log = audit.logger()
        self._server: asyncio.Server | None = None
        self._open = 0

    async def start(self) -> tuple[str, int]:
        self._server = await asyncio.start_server(
            self._handle, self.host, self.port, limit=MAX_HEAD
        )
        host, port = self._server.sockets[0].getsockname()[:2]
        return str(host), int(port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    # -- the wire ----------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= MAX_CONNECTIONS:
            writer.close()
            return
        self._open += 1
        try:
            try:
                request = await asyncio.wait_for(self._read(reader), READ_SECONDS)
                response = await self._route(request)
            except BadRequest as e:
                response = Response(e.status, page.message("Bad request", str(e)))
            except CredproxyError:  # the store, asked who is signed in: nobody, for now
                response = Response(503, page.message("Store unavailable", "try again"))
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
                response = Response(400, page.message("Bad request", "incomplete or too large"))
            except Exception as e:  # noqa: BLE001 - fail closed: an answer that changed nothing
                self.log.error("hook.failed", hook="console", error_type=type(e).__name__)
                response = Response(500, page.message("Error", "the console failed; see the log"))
            writer.write(self._render(response))
            try:
                await writer.drain()
            except ConnectionError:
                pass  # the browser left; nothing to answer
        finally:
            self._open -= 1
            writer.close()

    async def _read(self, reader: asyncio.StreamReader) -> Request:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        lines = head.split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise BadRequest(400, "not an HTTP/1.1 request line")
        method, target = parts[0], parts[1]
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(":")
            name = name.strip().lower()
            if not sep or not name:
                raise BadRequest(400, "a malformed header")
            if name in headers and name in _SINGLE:
                raise BadRequest(400, f"{name} given twice")
            headers[name] = value.strip()
        path, _, query = target.partition("?")
        request = Request(method, path, _fields(query) if query else {}, headers)
        if method == "POST":
            if "transfer-encoding" in headers:
                raise BadRequest(411, "send a content-length")
            length = headers.get("content-length", "")
            if not length.isascii() or not length.isdigit():
                raise BadRequest(411, "send a content-length")
            if int(length) > MAX_BODY:
                raise BadRequest(413, f"a form is at most {MAX_BODY} bytes")
            body = await reader.readexactly(int(length))
            try:
                request.form = _fields(body.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise BadRequest(400, "not UTF-8") from e
        return request

    @staticmethod
    def _render(response: Response) -> bytes:
        body = response.body.encode() if isinstance(response.body, str) else response.body
        lines = [f"HTTP/1.1 {response.status} {'OK' if response.status < 400 else 'Error'}"]
        lines += [f"{k}: {v}" for k, v in (*_HEADERS, *response.extra)]
        lines += [f"content-type: {response.kind}", f"content-length: {len(body)}"]
        lines.append("connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

    # -- the pages ---------------------------------------------------------------------

    async def _route(self, request: Request) -> Response:
        path, method = request.path, request.method
        if path == "/console.js":
            return Response(200, page.SCRIPT, "text/javascript; charset=utf-8")
        if path == "/console.css":
            return Response(200, page.STYLE, "text/css; charset=utf-8")
        if method == "GET" and path == "/grants":
            session = await self._signed_in(request)
            if session is None:
                return Response(200, page.login())
            return await self._grants(session)
        if method == "GET" and path in ("/", "/panel"):
            session = await self._signed_in(request)
            if session is None:
                if path == "/panel":
                    return Response(401, "", "text/plain")
                return Response(200, page.login())
            panel = await self._panel(session, request.query)
            if path == "/panel":
                return Response(200, panel)
            return Response(200, page.console(session.operator, session.csrf, request.query, panel))
        if method != "POST":
            changes = path in ("/login", "/logout") or _DECIDE.fullmatch(path)
            changes = changes or _REVOKE.fullmatch(path)
            return Response(405 if changes else 404, page.message("Not here", "no such page"))
        # Every change: from the console's own pages only (a cross-site form or script is
        # refused before anything else is looked at).
        if not same_origin(request.headers):
            self.log.warning("console.refused", why="cross-origin", path=path)
            return Response(403, page.message("Refused", "a change must come from this console"))
        if path == "/login":
            return await self._sign_in(request)
        session = await self._signed_in(request)
        if session is None:
            return Response(401, page.login("Sign in first."))
        if not csrf_ok(session, request.form.get("csrf", "")):
            self.log.warning("console.refused", why="csrf", path=path, operator=session.operator)
            return Response(403, page.message("Refused", "the form is stale: load the page again"))
        if path == "/logout":
            self.sessions.close(request.cookie)
            self.log.info("console.signed_out", operator=session.operator)
            return _redirect(
                [("set-cookie", f"{COOKIE}=; Max-Age=0; Path=/; HttpOnly; SameSite=Strict")]
            )
        revoked = _REVOKE.fullmatch(path)
        if revoked is not None:
            return await self._revoke(session, int(revoked.group(1)))
        decided = _DECIDE.fullmatch(path)
        if decided is None:
            return Response(404, page.message("Not here", "no such page"))
        return await self._decide(session, int(decided.group(1)), request.form)

    async def _signed_in(self, request: Request) -> Session | None:
        """The request's session; one opened with a store token only while that token is
        live (asked at every request, so a revocation signs it out at its next)."""
        session = self.sessions.find(request.cookie)
        if session is None or session.token_id is None:
            return session
        if await self.live.call(self.live.store.console_token_live, session.token_id):
            return session
        self.sessions.close(request.cookie)
        self.log.info("console.signed_out", operator=session.operator, why="token-ended")
        return None

    async def _sign_in(self, request: Request) -> Response:
        token = request.form.get("token", "")
        found = None if self.operators is None else self.operators.operator(token)
        operator, token_id, via = found, None, "file"
        if operator is None and token:
            try:
                stored = await self.live.call(self.live.store.console_operator, token)
            except CredproxyError:
                return Response(503, page.login("The store did not answer; try again."))
            if stored is not None:
                (operator, token_id), via = stored, "store"
        if operator is None:
            self.log.warning("console.sign_in_refused")
            return Response(401, page.login("That token opens nothing."))
        cookie, _ = self.sessions.open(operator, token_id)
        self.log.info("console.signed_in", operator=operator, via=via, sessions=len(self.sessions))
        return _redirect([("set-cookie", f"{COOKIE}={cookie}; Path=/; HttpOnly; SameSite=Strict")])

    async def _panel(self, session: Session, query: dict[str, str]) -> str:
        try:
            pending = await self.live.call(self.live.store.list_access_requests, PENDING)
        except CredproxyError:
            return page.message("Store unavailable", "the store did not answer; retrying")
        decisions = self.recent.latest(
            SHOWN,
            principal=query.get("principal", ""),
            decision=query.get("decision", ""),
            reason=query.get("reason", ""),
        )
        return page.panel(session.csrf, pending, decisions, datetime.now(UTC))

    async def _decide(self, session: Session, request_id: int, form: dict[str, str]) -> Response:
        decision = form.get("decision")
        note = form.get("note", "").strip()
        if decision not in ("approve", "deny"):
            raise BadRequest(400, "approve or deny")
        if len(note) > MAX_NOTE or not note.isprintable():
            raise BadRequest(400, f"a note is one line of at most {MAX_NOTE} characters")
        fields: dict[str, object] = {"operator": session.operator, "id": request_id}
        if note:
            fields["note"] = note
        budget = form.get("budget", "").strip()
        if len(budget) > MAX_NOTE or not budget.isprintable():
            raise BadRequest(400, f"a budget is one line of at most {MAX_NOTE} characters")
        who = f"console:{session.operator}"
        try:
            if decision == "approve" and budget:
                specs = budget.replace(",", " ").split()
                grant_id, was, now = await self.live.call(
                    self.live.store.approve_budget_request, request_id, specs, who
                )
                fields |= {"kind": BUDGET, "grant_id": grant_id, "budget_was": was, "budget": now}
            elif decision == "approve":
                approve = partial(self.live.store.approve_request, decided_by=who)
                kind, granted = await self.live.call(approve, request_id)
                fields |= {"kind": kind, "grant_id": granted}
            else:
                await self.live.call(
                    self.live.store.deny_access_request, request_id, note or None, who
                )
        except (InvalidInput, NotFound) as e:
            return Response(409, page.message("Not done", str(e)))
        except CredproxyError:
            return Response(503, page.message("Not done", "the store did not answer"))
        self.log.info(f"console.{'approved' if decision == 'approve' else 'denied'}", **fields)
        return _redirect()

    async def _grants(self, session: Session) -> Response:
        try:
            listed = await self.live.call(self.live.store.list_grants)
            principals = await self.live.call(self.live.store.list_principals)
        except CredproxyError:
            return Response(503, page.message("Store unavailable", "the store did not answer"))
        active = [g for g in listed if g.state == "active"]
        return Response(
            200, page.grants(session.operator, session.csrf, active, principals, MAX_LISTED)
        )

    async def _revoke(self, session: Session, grant_id: int) -> Response:
        try:
            revoked = await self.live.call(self.live.store.revoke_grant, grant_id)
        except NotFound as e:
            return Response(409, page.message("Not done", str(e)))
        except CredproxyError:
            return Response(503, page.message("Not done", "the store did not answer"))
        self.log.info(
            "console.revoked", operator=session.operator, grant_id=grant_id, already=not revoked
        )
        return Response(303, "", extra=[("location", "/grants")])
