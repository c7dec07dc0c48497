"""Local fake token providers over TLS (an Upstream app): an OAuth 2 server (client
credentials and refresh tokens, with rotation), a Google-style token endpoint that verifies
the RS256 assertion, a GitHub-style endpoint that verifies the app JWT and answers 201, and
an API that accepts only live tokens it issued.

Hosts: auth.mint.test (/oauth/token, /google/token), gh.mint.test (/api/v3/app/...),
api.mint.test (/v1/...: /v1/echo echoes the Authorization header, /v1/reject answers 401).
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl, unquote

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.e2e.upstream import Answer, Received

AUTH, GH, API = "auth.mint.test", "gh.mint.test", "api.mint.test"
TOKEN_URL = f"https://{AUTH}/oauth/token"
GOOGLE_TOKEN_URL = f"https://{AUTH}/google/token"
GITHUB_API = f"https://{GH}/api/v3"
# Put into every error answer: the proxy must never pass a token endpoint's body on.
BODY_MARK = "provider-body-" + secrets.token_hex(8)
_INSTALL = re.compile(r"/api/v3/app/installations/(\d+)/access_tokens")


def rsa_pem() -> tuple[str, Any]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    return pem, key.public_key()


@dataclass
class Issued:
    who: str
    expires: float  # time.time()
    scope: str | None = None
    narrowing: dict[str, Any] | None = None


@dataclass(repr=False)  # its fields hold client secrets and tokens: never in test output
class Provider:
    lifetime: float = 3600.0
    delay: float = 0.0
    mode: str | None = None  # "invalid_grant", "unavailable", "huge", "rotate-unusable"
    rotate: bool = True  # refresh tokens are single use and replaced
    clients: dict[str, str] = field(default_factory=dict)  # client_id -> secret
    refresh: dict[str, str] = field(default_factory=dict)  # live refresh token -> client_id
    spent: set[str] = field(default_factory=set)
    google: dict[str, Any] = field(default_factory=dict)  # client_email -> public key
    apps: dict[str, Any] = field(default_factory=dict)  # app id -> public key
    issued: dict[str, Issued] = field(default_factory=dict)
    mints: list[tuple[str, float]] = field(default_factory=list)  # (who, time.time())
    refused: list[str] = field(default_factory=list)  # why token requests were refused
    used: list[tuple[str, str]] = field(default_factory=list)  # (who, path) of API calls
    expired_uses: int = 0
    stale_refresh: int = 0
    arrived: int = 0  # token requests received (counted before `delay`)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, who: str) -> int:
        with self.lock:
            return sum(1 for w, _ in self.mints if w == who)

    def __call__(self, received: Received) -> Answer | None:
        host = (received.header("host") or [""])[0].split(":")[0]
        if host == AUTH and received.target == "/oauth/token":
            return self._guarded(received, self._oauth)
        if host == AUTH and received.target == "/google/token":
            return self._guarded(received, self._google)
        if host == GH and (m := _INSTALL.fullmatch(received.target)):
            return self._guarded(received, lambda r: self._github(r, m[1]))
        if host == API:
            return self._api(received)
        return None

    # -- token endpoints ---------------------------------------------------------------

    def _guarded(self, received: Received, handler: Any) -> Answer:
        with self.lock:
            self.arrived += 1
        if self.delay:
            time.sleep(self.delay)
        if self.mode == "unavailable":
            return _json(503, {"error": "temporarily_unavailable", "note": BODY_MARK})
        if self.mode == "huge":
            return _json(200, {"access_token": "x", "pad": "x" * 70_000, "note": BODY_MARK})
        if self.mode == "invalid_grant":
            return _json(400, {"error": "invalid_grant", "error_description": BODY_MARK})
        if self.mode is not None and self.mode.startswith("leak-"):
            return _leak(self.mode, received)
        answer: Answer = handler(received)
        return answer

    def _refuse(self, why: str, status: int = 400, error: str = "invalid_request") -> Answer:
        with self.lock:
            self.refused.append(why)
        return _json(status, {"error": error, "error_description": BODY_MARK})

    def _issue(self, who: str, **extra: Any) -> tuple[str, float]:
        value = "minted-" + secrets.token_urlsafe(24)
        expires = time.time() + self.lifetime
        with self.lock:
            self.issued[value] = Issued(who, expires, **extra)
            self.mints.append((who, time.time()))
        return value, expires

    def _oauth(self, received: Received) -> Answer:
        form = dict(parse_qsl(received.body.decode()))
        client_id, client_secret = form.get("client_id"), form.get("client_secret")
        auth = received.header("authorization")
        if auth:
            if not auth[0].startswith("Basic "):
                return self._refuse("auth scheme", 401, "invalid_client")
            pair = base64.b64decode(auth[0][6:]).decode()
            client_id, client_secret = (unquote(p) for p in pair.split(":", 1))
        if client_id not in self.clients:
            return self._refuse("unknown client", 401, "invalid_client")
        expected = self.clients[client_id]
        if expected and client_secret != expected:
            return self._refuse("bad client secret", 401, "invalid_client")
        grant = form.get("grant_type")
        if grant == "client_credentials":
            value, _ = self._issue(client_id, scope=form.get("scope"))
            return _json(200, _bearer(value, self.lifetime, form.get("scope")))
        if grant == "refresh_token":
            given = form.get("refresh_token", "")
            with self.lock:
                if given in self.spent:
                    self.stale_refresh += 1
                owner = self.refresh.get(given)
                if owner != client_id:
                    self.refused.append("refresh token not live")
                    return _json(400, {"error": "invalid_grant", "error_description": BODY_MARK})
                answer = _bearer("", self.lifetime, form.get("scope"))
                if self.rotate:
                    del self.refresh[given]
                    self.spent.add(given)
                    new = "refresh-" + secrets.token_urlsafe(24)
                    self.refresh[new] = client_id
                    answer["refresh_token"] = new
            value, _ = self._issue(client_id, scope=form.get("scope"))
            answer["access_token"] = value
            if self.mode == "rotate-unusable":  # rotated, with an access token of no use
                answer["token_type"] = "DPoP"
            return _json(200, answer)
        return self._refuse("grant type", 400, "unsupported_grant_type")

    def _google(self, received: Received) -> Answer:
        form = dict(parse_qsl(received.body.decode()))
        if form.get("grant_type") != "urn:ietf:params:oauth:grant-type:jwt-bearer":
            return self._refuse("grant type", 400, "unsupported_grant_type")
        assertion = form.get("assertion", "")
        try:
            claims = jwt.decode(assertion, options={"verify_signature": False})
            email = claims["iss"]
            key = self.google[email]
            claims = jwt.decode(
                assertion,
                key,
                algorithms=["RS256"],
                audience=GOOGLE_TOKEN_URL,
                issuer=email,
                options={"require": ["exp", "iat", "iss", "aud", "scope"]},
            )
        except (jwt.PyJWTError, KeyError) as e:
            return self._refuse(f"assertion: {type(e).__name__}", 400, "invalid_grant")
        if claims["exp"] - claims["iat"] > 3600:
            return self._refuse("assertion lives too long", 400, "invalid_grant")
        value, _ = self._issue(email, scope=claims["scope"])
        if "sub" in claims:
            with self.lock:
                self.issued[value].narrowing = {"sub": claims["sub"]}
        return _json(200, _bearer(value, self.lifetime, None))

    def _github(self, received: Received, installation: str) -> Answer:
        auth = received.header("authorization")
        if not auth or not auth[0].startswith("Bearer "):
            return self._refuse("no app JWT", 401, "bad_credentials")
        app_jwt = auth[0][7:]
        try:
            app_id = str(jwt.decode(app_jwt, options={"verify_signature": False})["iss"])
            claims = jwt.decode(
                app_jwt,
                self.apps[app_id],
                algorithms=["RS256"],
                options={"require": ["exp", "iat", "iss"]},
            )
        except (jwt.PyJWTError, KeyError) as e:
            return self._refuse(f"app JWT: {type(e).__name__}", 401, "bad_credentials")
        if claims["exp"] - claims["iat"] > 600:
            return self._refuse("app JWT lives too long", 401, "bad_credentials")
        if (received.header("accept") or [""])[0] != "application/vnd.github+json":
            return self._refuse("accept", 415)
        narrowing = json.loads(received.body or b"{}")
        value, expires = self._issue(f"app-{app_id}/{installation}", narrowing=narrowing)
        body = {
            "token": value,
            "expires_at": datetime.fromtimestamp(expires, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "permissions": narrowing.get("permissions", {"contents": "write"}),
            "repository_selection": "selected" if "repositories" in narrowing else "all",
        }
        return _json(201, body)

    # -- the API ---------------------------------------------------------------------

    def _api(self, received: Received) -> Answer:
        auth = received.header("authorization")
        if len(auth) != 1 or " " not in auth[0]:
            return _json(401, {"message": "no token"})
        prefix, value = auth[0].split(" ", 1)
        with self.lock:
            found = self.issued.get(value)
            if found is None:
                return _json(401, {"message": "unknown token"})
            if time.time() >= found.expires:
                self.expired_uses += 1
                return _json(401, {"message": "expired token"})
            self.used.append((found.who, received.target))
        if received.target.startswith("/v1/reject"):
            return _json(401, {"message": "refused"})
        if received.target.startswith("/v1/echo-client"):  # a careless API's error page
            return _json(200, {"client_secret": self.clients.get(found.who)})
        if received.target.startswith("/v1/echo-forms"):  # a redirect that echoes it all
            return _forms(value)
        if received.target.startswith("/v1/echo"):
            return _json(200, {"authorization": auth[0], "prefix": prefix})
        return _json(200, {"ok": True, "who": found.who, "narrowing": found.narrowing})


def _bearer(value: str, lifetime: float, scope: str | None) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "access_token": value,
        "token_type": "Bearer",
        "expires_in": lifetime,
    }
    if scope:
        answer["scope"] = scope
    return answer


def _json(status: int, body: dict[str, Any]) -> Answer:
    return status, [("content-type", "application/json")], json.dumps(body).encode()


def _forms(value: str) -> Answer:
    """The token in the forms a careless API might send back: headers, a redirect, base64
    (both alphabets, unpadded), percent-encoding (upper case, every byte), JSON escapes."""
    raw = value.encode()
    b64 = base64.b64encode(raw).decode()
    b64url = base64.urlsafe_b64encode(raw).decode().rstrip("=")
    percent = "".join(f"%{b:02X}" for b in raw)
    escaped = "".join(f"\\u{b:04x}" for b in raw)
    fields = [
        ("location", f"https://elsewhere.test/cb?access_token={percent}"),
        ("www-authenticate", f'Bearer error="invalid_token", token="{value}"'),
        ("set-cookie", f"t={b64}; Path=/"),
        ("x-echo", b64url),
        ("content-type", "application/json"),
    ]
    body = f'{{"raw": "{value}", "escaped": "{escaped}", "b64": "{b64url}"}}'
    return 302, fields, body.encode()


def _leak(mode: str, received: Received) -> Answer:
    """A token endpoint that hands back what it was sent (the client's Authorization and the
    form: client secret, refresh token, assertion), each mode in another place."""
    sent = " ".join([*received.header("authorization"), received.body.decode()])
    plain = unquote(sent)
    text = f"{sent} {plain} {BODY_MARK}"
    j = [("content-type", "application/json")]
    if mode == "leak-description":
        return 400, j, json.dumps({"error": "invalid_client", "error_description": text}).encode()
    if mode == "leak-code":  # the echo where the registered code should be
        return 400, j, json.dumps({"error": text}).encode()
    if mode == "leak-headers":
        fields = [("www-authenticate", f'Basic realm="{plain}"'), ("x-debug", sent), *j]
        return 401, fields, json.dumps({"error": "invalid_client"}).encode()
    if mode == "leak-redirect":
        return 302, [("location", f"https://elsewhere.test/?{sent}")], text.encode()
    if mode == "leak-html":
        return 500, [("content-type", "text/html")], f"<pre>{text}</pre>".encode()
    if mode == "leak-token-crlf":  # a token that would add a header carrying the secret
        value = "tok\r\nX-Leak: " + plain.replace("\r", " ").replace("\n", " ")
        return 200, j, json.dumps({"access_token": value, "token_type": "Bearer"}).encode()
    if mode == "leak-200-error":
        return 200, j, json.dumps({"error": "invalid_grant", "error_description": text}).encode()
    raise AssertionError(mode)
