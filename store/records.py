"""What the proxy reads from the store: plain frozen records, no database types."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from store.crypto import Secret
from store.grammar import HostPattern

# An expired grant stays in the snapshot this long, so that it answers grant-expired rather
# than reading as never granted; then every replica forgets it alike.
TOMBSTONE_RETENTION = timedelta(days=7)


@dataclass(frozen=True)
class CredentialRecord:
    name: str
    scheme: str
    header_name: str | None
    param_name: str | None
    hosts: tuple[HostPattern, ...]
    secret: Secret
    fingerprint: str


@dataclass(frozen=True)
class GrantRecord:
    id: int
    principal: str
    credential: str | None
    hosts: tuple[HostPattern, ...]
    methods: frozenset[str]
    paths: tuple[str, ...]
    once: bool
    websocket: bool
    expires_at: datetime | None
    consumed: bool = False


@dataclass(frozen=True)
class Snapshot:
    """What the proxy needs, read in one transaction: live principals, credentials, grants."""

    counter: int
    key_id: str | None
    token_hashes: dict[str, str]
    credentials: dict[str, CredentialRecord]
    grants: tuple[GrantRecord, ...]
    unreadable: tuple[str, ...]
