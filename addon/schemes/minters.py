"""How each minted-token scheme asks for a token, and reads the answer.

oauth2-client (RFC 6749 .4.4), oauth2-refresh (.6), google-service-account (a JWT assertion,
RS256, RFC 7523) and github-app (an app JWT, then an installation token). Each `mint` runs in
a thread and raises MintFailed with a detail naming the endpoint's status and OAuth error
code, never its body.
"""

from __future__ import annotations

import base64
import json
import math
import re
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode, urlsplit

from addon.schemes.https import Answer, MintFailed, Post
from addon.schemes.tokens import Token, token
from store.rules.mintspec import GITHUB_API

if TYPE_CHECKING:
    from store.records import CredentialRecord

# What may go into a header after the prefix, as the endpoint gave it: long enough for the
# redactor to find it (it ignores secrets under 4 bytes), no space or control character.
_TOKEN = re.compile(r"[\x21-\x7e]{8,8192}")
_SECONDS = re.compile(r"[0-9]{1,12}")
MAX_LIFETIME = 86400.0  # a longer lifetime is read as a day: the token is minted again daily
# OAuth error codes named in a refusal's detail: the registered ones (RFC 6749 .4.1.2.1, .5.2,
# RFC 6750, RFC 8628, RFC 8693, RFC 8707, RFC 9449), never other text of the endpoint's,
# which could echo what it was sent.
ERROR_CODES = frozenset(
    {
        "invalid_request",
        "invalid_client",
        "invalid_grant",
        "unauthorized_client",
        "unsupported_grant_type",
        "invalid_scope",
        "access_denied",
        "server_error",
        "temporarily_unavailable",
        "invalid_token",
        "insufficient_scope",
        "authorization_pending",
        "slow_down",
        "expired_token",
        "invalid_target",
        "unsupported_token_type",
        "invalid_dpop_proof",
        "use_dpop_nonce",
    }
)
JWT_LIFETIME = 600  # GitHub refuses app JWTs living longer than 10 minutes
GOOGLE_GRANT = "urn:ietf:params:oauth:grant-type:jwt-bearer"


class Endpoint:
    """Where tokens come from: https host, port and target of a URL."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        assert parts.scheme == "https" and parts.hostname is not None
        self.host = parts.hostname
        self.port = parts.port or 443
        self.target = parts.path or "/"


def failed(answer: Answer, what: str = "the token endpoint") -> MintFailed:
    """A refusal, worded from the status and the OAuth `error` code alone."""
    code = None
    try:
        data = json.loads(answer.data)
        found = data.get("error") if isinstance(data, dict) else None
        if isinstance(found, str) and found in ERROR_CODES:
            code = found
    except (ValueError, UnicodeDecodeError, RecursionError):
        pass
    detail = f"{what} answered {answer.status}" + (f" ({code})" if code else "")
    return MintFailed(detail, answer.status, code)


def json_answer(answer: Answer, ok: int = 200) -> dict[str, Any]:
    if answer.status != ok:
        raise failed(answer)
    try:
        data = json.loads(answer.data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise MintFailed("the token endpoint's answer is not JSON", answer.status) from None
    if not isinstance(data, dict):
        raise MintFailed("the token endpoint's answer is not a JSON object", answer.status)
    return data


def _value(data: dict[str, Any], name: str) -> str:
    found = data.get(name)
    if not isinstance(found, str) or not _TOKEN.fullmatch(found):
        raise MintFailed(f"the token endpoint's answer has no usable {name}")
    return found


def bearer(data: dict[str, Any]) -> Token:
    """An OAuth 2 token answer (RFC 6749 .5.1) as a Token."""
    value = _value(data, "access_token")
    kind = data.get("token_type", "bearer")
    if not isinstance(kind, str) or kind.lower() != "bearer":
        raise MintFailed("the token endpoint's answer is not a bearer token")
    return token(value, _lifetime(data.get("expires_in")))


def _lifetime(given: Any) -> float | None:
    """expires_in as seconds: a positive finite number, or digits; at most MAX_LIFETIME.
    Python's json reads NaN and Infinity: a NaN lifetime never expired, and re-minted at
    once, forever."""
    if given is None:
        return None
    if isinstance(given, str) and _SECONDS.fullmatch(given):
        given = int(given)
    if isinstance(given, bool) or not isinstance(given, int | float):
        raise MintFailed("the token endpoint's answer has no usable expires_in")
    if (isinstance(given, float) and not math.isfinite(given)) or given <= 0:
        raise MintFailed("the token endpoint's answer has no usable expires_in")
    return float(min(given, MAX_LIFETIME))


def form_body(fields: dict[str, str]) -> bytes:
    return urlencode(fields).encode("ascii")


FORM = {"Content-Type": "application/x-www-form-urlencoded", "Accept": "application/json"}


def client_auth(
    method: str, client_id: str, client_secret: str | None, form: dict[str, str]
) -> dict[str, str]:
    """The client's authentication (RFC 6749 .2.3.1): headers to add; a `post` one goes into
    the form."""
    if method == "basic":
        assert client_secret is not None
        pair = f"{quote(client_id, safe='')}:{quote(client_secret or '', safe='')}"
        return {"Authorization": "Basic " + base64.b64encode(pair.encode()).decode("ascii")}
    form["client_id"] = client_id
    if method == "post":
        assert client_secret is not None
        form["client_secret"] = client_secret
    return {}


class OAuth2Client:
    """Client credentials (RFC 6749 .4.4)."""

    def __init__(self, credential: CredentialRecord) -> None:
        keys = json.loads(credential.secret.reveal())
        options = credential.options
        self._endpoint = Endpoint(options["token_url"])
        self.host, self.port = self._endpoint.host, self._endpoint.port
        self._id: str = keys["client_id"]
        self._secret: str = keys["client_secret"]
        self._auth: str = options.get("client_auth", "basic")
        self._scope = " ".join(options.get("scope", ()))
        self._audience: str | None = options.get("audience")

    def __repr__(self) -> str:
        return "OAuth2Client([secure])"

    def refused(self, token: Token) -> None:
        pass  # each mint asks the endpoint

    def secrets(self) -> tuple[bytes, ...]:
        return (self._secret.encode(),)

    def mint(self, post: Post) -> Token:
        form = {"grant_type": "client_credentials"}
        if self._scope:
            form["scope"] = self._scope
        if self._audience is not None:
            form["audience"] = self._audience
        headers = FORM | client_auth(self._auth, self._id, self._secret, form)
        return bearer(json_answer(post(self._endpoint.target, form_body(form), headers)))


class GoogleServiceAccount:
    """A service account's JWT assertion (RS256, RFC 7523), exchanged at its token_uri."""

    def __init__(self, credential: CredentialRecord) -> None:
        key = json.loads(credential.secret.reveal())
        self._endpoint = Endpoint(key["token_uri"])
        self.host, self.port = self._endpoint.host, self._endpoint.port
        self._audience: str = key["token_uri"]
        self._email: str = key["client_email"]
        self._key_id: str | None = key.get("private_key_id")
        self._pem: str = key["private_key"]
        self._scope = " ".join(credential.options["scope"])
        self._subject: str | None = credential.options.get("subject")

    def __repr__(self) -> str:
        return "GoogleServiceAccount([secure])"

    def refused(self, token: Token) -> None:
        pass  # each mint asks the endpoint

    def secrets(self) -> tuple[bytes, ...]:
        return (self._pem.encode(), json.dumps(self._pem)[1:-1].encode())

    def mint(self, post: Post) -> Token:
        import jwt  # on first use: 15 ms of start-up that most proxies never need

        now = int(time.time())
        claims = {
            "iss": self._email,
            "scope": self._scope,
            "aud": self._audience,
            "iat": now,
            "exp": now + 3600,
        }
        if self._subject is not None:
            claims["sub"] = self._subject
        headers = {"kid": self._key_id} if self._key_id else None
        assertion = jwt.encode(claims, self._pem, algorithm="RS256", headers=headers)
        form = {"grant_type": GOOGLE_GRANT, "assertion": assertion}
        return bearer(json_answer(post(self._endpoint.target, form_body(form), FORM)))


class GitHubApp:
    """An installation token, narrowed to the credential's repositories and permissions."""

    def __init__(self, credential: CredentialRecord) -> None:
        keys = json.loads(credential.secret.reveal())
        options = credential.options
        api = options.get("api_url", GITHUB_API)
        self._endpoint = Endpoint(
            f"{api}/app/installations/{options['installation']}/access_tokens"
        )
        self.host, self.port = self._endpoint.host, self._endpoint.port
        self._app_id: str = keys["app_id"]
        self._pem: str = keys["private_key"]
        narrowing: dict[str, Any] = {}
        if options.get("repository"):
            narrowing["repositories"] = list(options["repository"])
        if options.get("permission"):
            narrowing["permissions"] = dict(p.split("=", 1) for p in options["permission"])
        self._body = json.dumps(narrowing, separators=(",", ":")).encode()

    def __repr__(self) -> str:
        return "GitHubApp([secure])"

    def refused(self, token: Token) -> None:
        pass  # each mint asks the endpoint

    def secrets(self) -> tuple[bytes, ...]:
        return (self._pem.encode(), json.dumps(self._pem)[1:-1].encode())

    def mint(self, post: Post) -> Token:
        import jwt  # on first use: 15 ms of start-up that most proxies never need

        now = int(time.time())
        # iat a minute back: GitHub's clock may be behind ours.
        claims = {"iss": self._app_id, "iat": now - 60, "exp": now - 60 + JWT_LIFETIME}
        app_jwt = jwt.encode(claims, self._pem, algorithm="RS256")
        headers = {
            "Authorization": "Bearer " + app_jwt,
            "Accept": "application/vnd.github+json",
            "Content-Type": "application/json",
            "User-Agent": "credproxy",
            "X-GitHub-Api-Version": "2022-11-28",
        }
        answer = post(self._endpoint.target, self._body, headers)
        if answer.status != 201:
            raise failed(answer, "the GitHub API")
        data = json_answer(answer._replace(status=200))
        value = _value(data, "token")
        expires = data.get("expires_at")
        try:
            lifetime = datetime.fromisoformat(str(expires).replace("Z", "+00:00")).timestamp()
        except ValueError:
            raise MintFailed("the GitHub API's answer has no usable expires_at") from None
        if lifetime <= time.time():
            raise MintFailed("the GitHub API's token has expired already")
        return token(value, min(lifetime - time.time(), MAX_LIFETIME))
