"""What forwarding asks of a credential's scheme: one Stamp class per scheme, one interface.

A Stamp is built once per credential version and policy (stamping.stamp_for). For each
request, `prepare` returns the request's Stamping: what that request needs (the path with
the secret in its place, a signing plan, the minted token it will carry). A scheme whose
requests all look alike is its own Stamping, so nothing is made per request. In the order
proxy/forward.py calls them:

    stamp.prepare(verdict, request, headers, limit)  checks that refuse (Refused), first
    stamping.pending()      keys or a token to wait for before anything is spent
    stamping.redacted()     what redaction looks for (a minted token is taken here)
    stamping.apply(flow, path, query)   the credential's bytes on the request
    stamping.sign(flow, signing)        a signature over what leaves (sigv4)
    stamping.answered(status)           the upstream's status (WATCHED: a minted token's 401)
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from addon.core.reasons import Reason

if TYPE_CHECKING:
    from mitmproxy import http

    from addon.core.verdict import HeaderScan, Verdict
    from addon.schemes.renewal import Renewal
    from store.records import CredentialRecord

# Always among a stamp's fields: redaction must see the response body as sent.
IDENTITY = (b"accept-encoding", b"identity")


class Refused(Exception):
    """A request the scheme cannot serve as it is; the deny's reason and detail (no secret)."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(reason.value)
        self.reason = reason
        self.detail = detail


class Signs(Protocol):
    """Where a signature over the request as it leaves is made (proxy/signing.py, which may
    hold the body for it first)."""

    def apply(self, flow: http.HTTPFlow, signer: Any, plan: Any) -> None: ...


class Stamping:
    """One request's stamp. Its secrets never show in a repr."""

    __slots__ = ()

    # Signed for a service whose answers can hold new AWS keys: such an answer is refused.
    minting: bool = False
    token_fp: str | None = None  # the minted token it carries, for the audit line

    def __repr__(self) -> str:
        return f"{type(self).__name__}([secure])"

    def __reduce__(self) -> NoReturn:
        raise TypeError(f"a {type(self).__name__} cannot be pickled")

    def pending(self) -> Renewal[Any] | None:
        """Keys or a token not usable now, to be awaited before anything is spent."""
        return None

    def redacted(self) -> tuple[bytes, ...]:
        """What redaction looks for in this request's answer.

        Raises: Unavailable, for a minted token that expired while the request waited.
        """
        raise NotImplementedError

    def apply(self, flow: http.HTTPFlow, path: str, query: bytes | None) -> None:
        """Write the credential onto the request, and the target: `path` and `query` as
        matched."""
        raise NotImplementedError

    def sign(self, flow: http.HTTPFlow, signing: Signs) -> None:
        """Last, once the request is as it leaves."""
        return None

    def answered(self, status: int) -> None:
        """The upstream's status, for a stamping that put itself in WATCHED."""
        return None


class Stamp(Stamping):
    """One credential's way onto requests. The base writes `fields`, replacing every field
    that lands in a slot of `names` (lower-case, `_` as `-`), and the target as matched:
    subclasses add what their scheme writes. `secret` is the stored secret; `redacts` what
    redaction looks for."""

    __slots__ = ("secret", "redacts", "fields", "names")

    def __init__(
        self,
        credential: CredentialRecord,
        fields: tuple[tuple[bytes, bytes], ...] = (),
        removed: frozenset[bytes] = frozenset(),
    ) -> None:
        self.secret = credential.secret.reveal()
        self.redacts: tuple[bytes, ...] = (self.secret,)
        self.fields = (IDENTITY, *fields)
        # Lower-case, `_` as `-`: backends behind CGI or WSGI read X_Api_Key as X-Api-Key.
        self.names = frozenset(slot(name) for name, _ in self.fields) | removed

    @classmethod
    def stored(cls, credential: CredentialRecord) -> tuple[bytes, ...]:
        """What redaction looks for of the credential as the store holds it now.

        Raises: ValueError, KeyError or TypeError if the secret has not the scheme's shape.
        """
        return (credential.secret.reveal(),)

    def prepare(
        self, verdict: Verdict, request: http.Request, headers: HeaderScan, limit: int
    ) -> Stamping:
        """This request's stamping; `limit` is the largest body held for a signature.

        Raises: Refused, before anything is spent.
        """
        return self

    def scrubbed(self, path: str) -> str:
        """The audit line's path of a request this stamp refused."""
        return path

    def redacted(self) -> tuple[bytes, ...]:
        return self.redacts

    def apply(self, flow: http.HTTPFlow, path: str, query: bytes | None) -> None:
        write(flow.request, self.names, self.fields, path, query)


def slot(name: bytes) -> bytes:
    """The header a field name lands in at the upstream: case and `_` / `-` ignored."""
    return name.lower().replace(b"_", b"-")


def target(path: str, query: bytes | None) -> bytes:
    """The request target as it leaves: exactly the path that was matched."""
    return path.encode("ascii") + (b"?" + query if query is not None else b"")


def write(
    request: http.Request,
    names: frozenset[bytes],
    fields: tuple[tuple[bytes, bytes], ...],
    path: str,
    query: bytes | None,
) -> None:
    """`fields` in place of every field in the slots of `names`, and the target."""
    # Replace, never append: a second value would let the upstream pick the agent's.
    request.headers.fields = (
        *[f for f in request.headers.fields if slot(f[0]) not in names],
        *fields,
    )
    request.data.path = target(path, query)


# Stampings that want the upstream's status (a minted token dropped on a 401), beside the
# flow and keyed weakly: one holds a token, which flow.metadata must never hold.
WATCHED: weakref.WeakKeyDictionary[http.HTTPFlow, Stamping] = weakref.WeakKeyDictionary()
