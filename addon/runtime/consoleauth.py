"""Who may use the approvers' console: operator tokens from a file or stdin (read once,
kept as digests; the store's own are store/tables/console_tokens.py), sessions, and the
same-origin and CSRF checks every change passes."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from store.errors import InvalidInput

MAX_TOKEN_FILE = 64 * 1024
MAX_OPERATORS = 100
MIN_TOKEN = 32  # characters: a token is a password nobody types, `openssl rand -hex 32`
MAX_SESSIONS = 64  # signed-in sessions kept at once; the oldest is signed out first
SESSION_SECONDS = 8 * 3600
_NAME = re.compile(r"[A-Za-z0-9._@-]{1,64}")
_TOKEN = re.compile(r"[\x21-\x7e]{" + str(MIN_TOKEN) + ",512}")


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode()).digest()


@dataclass(frozen=True)
class Operators:
    """The operators who may sign in: each name with its token's SHA-256, never the token."""

    digests: tuple[tuple[str, bytes], ...]

    @classmethod
    def read(cls, where: str) -> Operators:
        """`--console-token-file`: a file (or `-`, stdin) of `NAME:TOKEN` lines."""
        flag = "--console-token-file"
        try:
            if where == "-":
                raw = sys.stdin.buffer.read(MAX_TOKEN_FILE + 1)
            else:
                with Path(where).open("rb") as f:
                    raw = f.read(MAX_TOKEN_FILE + 1)
        except OSError as e:
            raise InvalidInput(f"cannot read {flag} {where}: {e.strerror}") from e
        if len(raw) > MAX_TOKEN_FILE:
            raise InvalidInput(f"{flag}: larger than {MAX_TOKEN_FILE} bytes")
        try:
            text = raw.decode("ascii")
        except UnicodeDecodeError as e:
            raise InvalidInput(f"{flag}: not ASCII text") from e
        found: dict[str, bytes] = {}
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, sep, token = line.partition(":")
            # The line itself is never quoted: it holds a token.
            if not sep or not _NAME.fullmatch(name) or not _TOKEN.fullmatch(token):
                raise InvalidInput(
                    f"{flag}: line {number} is not NAME:TOKEN (a token of at least "
                    f"{MIN_TOKEN} printable characters, no spaces)"
                )
            if name in found:
                raise InvalidInput(f"{flag}: operator {name} is named twice")
            found[name] = _digest(token)
        if not found:
            raise InvalidInput(f"{flag}: no NAME:TOKEN line")
        if len(found) > MAX_OPERATORS:
            raise InvalidInput(f"{flag}: more than {MAX_OPERATORS} operators")
        return cls(tuple(found.items()))

    def operator(self, token: str) -> str | None:
        """The operator whose token this is; every digest is compared, in constant time."""
        given = _digest(token)
        who = None
        for name, digest in self.digests:
            if hmac.compare_digest(given, digest):
                who = name
        return who


@dataclass
class Session:
    operator: str
    csrf: str
    expires: float
    token_id: int | None = None  # the store's console token it was opened with, if any


class Sessions:
    """Signed-in sessions, by the SHA-256 of their cookie; bounded, oldest out first."""

    def __init__(self, limit: int = MAX_SESSIONS, lifetime: float = SESSION_SECONDS) -> None:
        self.limit = limit
        self.lifetime = lifetime
        self._by_digest: OrderedDict[bytes, Session] = OrderedDict()

    def open(self, operator: str, token_id: int | None = None) -> tuple[str, Session]:
        """A new session: its cookie value (returned once, kept only as a digest)."""
        while len(self._by_digest) >= self.limit:
            self._by_digest.popitem(last=False)
        cookie = secrets.token_urlsafe(32)
        expires = time.monotonic() + self.lifetime
        session = Session(operator, secrets.token_urlsafe(32), expires, token_id)
        self._by_digest[_digest(cookie)] = session
        return cookie, session

    def find(self, cookie: str | None) -> Session | None:
        if not cookie:
            return None
        key = _digest(cookie)
        session = self._by_digest.get(key)
        if session is None:
            return None
        if session.expires <= time.monotonic():
            del self._by_digest[key]
            return None
        return session

    def close(self, cookie: str | None) -> None:
        if cookie:
            self._by_digest.pop(_digest(cookie), None)

    def __len__(self) -> int:
        return len(self._by_digest)


def same_origin(headers: dict[str, str]) -> bool:
    """A change must come from a page of the console itself: the browser's Origin names this
    very host (which Host names), and Sec-Fetch-Site, where sent, says same-origin."""
    fetch_site = headers.get("sec-fetch-site")
    if fetch_site is not None and fetch_site != "same-origin":
        return False
    origin, host = headers.get("origin"), headers.get("host")
    if not origin or not host:
        return False
    return origin in (f"http://{host}", f"https://{host}")


def csrf_ok(session: Session, given: str) -> bool:
    return hmac.compare_digest(session.csrf.encode(), given.encode())
