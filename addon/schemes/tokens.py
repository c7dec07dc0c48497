"""What every minted token shares: the token and its timing, the errors, the minter's shape."""

from __future__ import annotations

import hashlib
import time
from typing import NamedTuple, Protocol

from addon.schemes.https import Post

REFRESH_AT = 0.75
MARGIN_SHARE = 0.1
MAX_MARGIN = 60.0
DEFAULT_LIFETIME = 3600.0  # an answer without expires_in
MIN_LIFETIME = 1.0
BACKOFF = 0.5
MAX_BACKOFF = 60.0
COOLDOWN = 30.0
IDLE = 900.0  # a token nobody stamped for this long is not refreshed in the background



CHANGED = "the credential changed while its token was minted"


class Unavailable(Exception):
    """No token that is still valid; `detail` says why, in words safe to show the agent."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


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
