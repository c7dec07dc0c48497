"""Which Stamp a credential gets: one class per scheme, chosen once per credential version
and policy, never per request."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from addon.core.reasons import Reason
from addon.schemes.minted import MintedStamp, RefreshStamp
from addon.schemes.mtls import MtlsStamp
from addon.schemes.path import PathStamp
from addon.schemes.sigv4 import SigV4Stamp
from addon.schemes.stamp import Refused, Stamp, Stamping
from addon.schemes.static import HeaderStamp, QueryStamp

if TYPE_CHECKING:
    from addon.core.policy import Policy
    from store.records import CredentialRecord

KINDS: dict[str, type[Stamp]] = {
    "bearer": HeaderStamp,
    "basic": HeaderStamp,
    "header": HeaderStamp,
    "query": QueryStamp,
    "path": PathStamp,
    "sigv4": SigV4Stamp,
    "oauth2-client": MintedStamp,
    "google-service-account": MintedStamp,
    "github-app": MintedStamp,
    "oauth2-refresh": RefreshStamp,
    "mtls": MtlsStamp,
}


class Unresolved(Stamp):
    """A credential whose secret is held elsewhere and cannot be had (addon/proxy/sources.py):
    every request is refused before anything is spent, and nothing is written."""

    __slots__ = ()

    def __init__(self, credential: CredentialRecord) -> None:
        self.secret, self.redacts, self.fields, self.names = b"", (), (), frozenset()

    def prepare(self, verdict: Any, request: Any, headers: Any, limit: int) -> Stamping:
        raise Refused(
            Reason.CREDENTIALS_UNAVAILABLE, "the credential's secret source cannot be read"
        )


def stamp_of(credential: CredentialRecord) -> Stamp:
    """A new Stamp for the credential. Raises KeyError for a scheme without one."""
    if not credential.available:
        return Unresolved(credential)
    return KINDS[credential.scheme](credential)


def redacted(credential: CredentialRecord) -> tuple[bytes, ...]:
    """What redaction looks for of a credential as the store holds it now: its secret, or
    the parts of one (a sigv4 key pair; a minted scheme's client secret, private key, refresh
    token, and the access token sealed beside it for the replicas)."""
    if not credential.available:
        return ()
    kind = KINDS.get(credential.scheme, Stamp)
    try:
        return kind.stored(credential)
    except (ValueError, KeyError, TypeError):  # no scheme could stamp it: looked for whole
        return (credential.secret.reveal(),)


_STAMPS: weakref.WeakKeyDictionary[Policy, dict[str, tuple[CredentialRecord, Stamp]]] = (
    weakref.WeakKeyDictionary()
)


def stamp_for(policy: Policy, credential: CredentialRecord) -> Stamp:
    """The credential's Stamp, built on first use of each version of it under this policy."""
    stamps = _STAMPS.get(policy)
    if stamps is None:
        stamps = _STAMPS[policy] = {}
    found = stamps.get(credential.name)
    if found is not None and found[0] is credential:
        return found[1]
    stamp = stamp_of(credential)
    # A request still holding a rotated credential's old record gets its own Stamp.
    if policy.current(credential):
        stamps[credential.name] = (credential, stamp)
    return stamp
