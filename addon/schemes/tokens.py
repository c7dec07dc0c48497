"""A minted token, its timing, the minter's shape, and the session that keeps one usable.

One TokenSession per credential (mint.Tokens keys it by the credential's fingerprint and
settings, so a rotated or changed credential gets a new one and the old token is dropped).
The renewal loop (renewal.py) mints on first use, single flight, and refreshes in the
background at REFRESH_AT of the lifetime; a token is never stamped within its margin of
expiry (MARGIN_SHARE of the lifetime, at most MAX_MARGIN): tokens living a few seconds work
as tokens living an hour do. A failed mint backs off (BACKOFF doubling up to MAX_BACKOFF);
meanwhile requests that need a token are refused at once. An upstream 401 on a stamped
token drops it, at most once per COOLDOWN.

The token endpoint is dialled as an upstream is (--resolve, or the destination guard's
vetted lookup) over verified TLS (--upstream-ca honoured); the call carries nothing of the
agent's request.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from addon.observe import audit
from addon.redaction.redactset import MINTED, SETS
from addon.schemes.https import Answer, Dial, MintFailed, Post, Tunnel, https_call
from addon.schemes.renewal import Renewal

REFRESH_AT = 0.75
MARGIN_SHARE = 0.1
MAX_MARGIN = 60.0
DEFAULT_LIFETIME = 3600.0  # an answer without expires_in
MIN_LIFETIME = 1.0
BACKOFF = 0.5
MAX_BACKOFF = 60.0
COOLDOWN = 30.0

CHANGED = "the credential changed while its token was minted"
UNAVAILABLE = "token-unavailable"  # the audit's error class: no usable token


class Token(NamedTuple):
    value: bytes
    usable_until: float  # time.monotonic()
    refresh_at: float  # time.monotonic()
    lifetime: float
    fingerprint: str

    def __repr__(self) -> str:
        return f"Token({self.fingerprint})"


def token(value: str, lifetime: float | None) -> Token:
    """A token received now that lives `lifetime` seconds (DEFAULT_LIFETIME if not said)."""
    life = DEFAULT_LIFETIME if lifetime is None else max(float(lifetime), MIN_LIFETIME)
    now = time.monotonic()
    margin = min(life * MARGIN_SHARE, MAX_MARGIN)
    refresh = min(life * REFRESH_AT, life - 2 * margin)
    raw = value.encode("ascii")
    return Token(raw, now + life - margin, now + refresh, life, fingerprint(raw))


def fingerprint(value: bytes) -> str:
    """What audit lines show of a minted token."""
    return "tok-" + hashlib.sha256(value).hexdigest()[:12]


class Minter(Protocol):
    """How one scheme gets a token. `mint` runs in a thread and raises MintFailed."""

    host: str
    port: int

    def secrets(self) -> tuple[bytes, ...]: ...

    def mint(self, post: Post) -> Token: ...

    def refused(self, token: Token) -> None:
        """The upstream refused `token`: a later mint must not hand it back."""


class Context(Protocol):
    """What a session reads from its registry (mint.Tokens) at each mint, as wired then."""

    dial: Dial
    tunnel: Tunnel | None  # through the corporate proxy, when there is one
    cafile: str | None
    count: Callable[[str, str], None]  # (credential, outcome): the token_mints metric


class TokenSession(Renewal[Token]):
    """One credential's current token and the task refreshing it."""

    error = UNAVAILABLE
    changed = CHANGED
    timed = True

    def __init__(self, name: str, minter: Minter, tokens: Context) -> None:
        super().__init__(name)
        self.minter = minter
        self._tokens = tokens
        self._failures = 0
        self._failure = "no token yet"
        self._dropped_at = -COOLDOWN
        self.mints = 0

    def drop(self, stamped: Token) -> None:
        """The upstream refused `stamped` (401): the next request mints a fresh token, unless
        a token was dropped within COOLDOWN (a provider that keeps refusing is not hammered)."""
        now = time.monotonic()
        if self.current is not stamped or now - self._dropped_at < COOLDOWN:
            return
        self._dropped_at = now
        self.current = None
        self.minter.refused(stamped)
        audit.logger().warning(
            "token.dropped",
            credential=self.name,
            token_fp=stamped.fingerprint,
            cause="upstream-401",
        )

    def close(self) -> None:
        """Rotated or removed: never mints again, and its token is never stamped."""
        self.closed = True
        super().close()
        self.current = None

    def _usable(self, value: Token) -> bool:
        return time.monotonic() < value.usable_until

    async def _obtain(self) -> Token:
        minter = self.minter
        address = await self._tokens.dial(minter.host, minter.port)
        cafile, tunnel = self._tokens.cafile, self._tokens.tunnel

        def post(target: str, body: bytes, headers: dict[str, str]) -> Answer:
            return https_call(
                address, minter.host, minter.port, cafile, "POST", target, body, headers, tunnel
            )

        return await asyncio.to_thread(self._mint, post)

    def _mint(self, post: Post) -> Token:
        """In a thread: the token, in the redaction set (compiled here) before it is stamped."""
        fresh = self.minter.mint(post)
        SETS.hold(self.name, MINTED, (*self.minter.secrets(), fresh.value), build=True)
        return fresh

    def _renewed(self, fresh: Token) -> float:
        self.mints += 1
        self._failures = 0
        self._retry_at = 0.0
        self._tokens.count(self.name, "minted")
        audit.logger().info(
            "token.minted",
            credential=self.name,
            token_fp=fresh.fingerprint,
            expires_in_s=round(fresh.lifetime, 1),
        )
        return max(fresh.refresh_at - time.monotonic(), 0.0)

    def _failed(self, e: Exception) -> float:
        import urllib3.exceptions  # loaded by the call that failed (https.py), if it got so far

        self._failures += 1
        delay: float = min(BACKOFF * 2 ** (self._failures - 1), MAX_BACKOFF)
        self._retry_at = time.monotonic() + delay
        fields: dict[str, Any] = {"error_type": type(e).__name__}
        if isinstance(e, MintFailed):
            self._failure = e.detail
            fields |= {"status": e.status, "error_code": e.code}
        elif isinstance(e, urllib3.exceptions.NewConnectionError):  # a ConnectTimeoutError too
            self._failure = "the token endpoint could not be reached"
        elif isinstance(e, TimeoutError | urllib3.exceptions.TimeoutError):
            self._failure = "the token endpoint did not answer in time"
        else:
            self._failure = "the token endpoint could not be reached"
        self._tokens.count(self.name, "failed")
        audit.logger().warning(
            "token.mint_failed",
            credential=self.name,
            detail=self._failure,
            retry_in_s=delay,
            valid=self.now() is not None,
            **fields,
        )
        return delay
