"""What the store hands out: plain frozen records, no database types.

The proxy reads a Snapshot (CredentialRecord, GrantRecord); the operator's listings and the
agent's access requests read as the *Entry records.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from store.crypto import Secret
from store.rules.bodyrules import BodyRule
from store.rules.budgets import Budget
from store.rules.grammar import HostPattern, Rate

# An expired grant stays in the snapshot this long, so that it answers grant-expired rather
# than reading as never granted; then every replica forgets it alike.
TOMBSTONE_RETENTION = timedelta(days=7)
PENDING, APPROVED, DENIED = "pending", "approved", "denied"
EXPIRED = "expired"  # a held request no owner decided on in time
REQUEST_STATES = (PENDING, APPROVED, DENIED, EXPIRED)
ACCESS, HOLD = "access", "hold"  # access_requests.kind
BUDGET = "budget"  # access_requests.kind: a spent budget, to be raised by an owner
# The secret of a credential record whose secret is held elsewhere and not resolved: random,
# so that it matches nothing (a path secret that is empty would be found in every target).
NO_SECRET = Secret(b"credproxy-unresolved-" + secrets.token_hex(16).encode())


def utcnow() -> datetime:
    return datetime.now(UTC)


def grant_state(
    revoked_at: datetime | None,
    consumed_at: datetime | None,
    expires_at: datetime | None,
    now: datetime,
) -> str:
    """How a grant is listed: revoked, consumed, expired or active, in that order."""
    if revoked_at is not None:
        return "revoked"
    if consumed_at is not None:
        return "consumed"
    if expires_at is not None and expires_at <= now:
        return "expired"
    return "active"


@dataclass(frozen=True)
class CredentialRecord:
    name: str
    scheme: str
    header_name: str | None
    param_name: str | None
    hosts: tuple[HostPattern, ...]
    secret: Secret
    fingerprint: str
    # The scheme's own settings (region, token URL, ...); never a secret.
    options: dict[str, Any] = field(default_factory=dict, hash=False)
    # Where the secret is held when the store does not seal it (store/rules/secretref.py).
    # The store's record of such a credential has no secret (`available` False): the proxy
    # puts the resolved value in (addon/proxy/sources.py), and stamps nothing without one.
    secret_ref: str | None = None
    available: bool = True


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
    encoded_slash: bool = False  # a `*` in paths may match a segment holding %2F
    rate: Rate | None = None
    burst: int | None = None
    max_uses: int | None = None
    approval: str | None = None  # each or first
    hold: int | None = None  # seconds
    body: BodyRule | None = None  # what the body may ask; None: the body is not decided
    budget: Budget | None = None  # token budgets, checked and charged in the store


@dataclass(frozen=True)
class Coverage:
    """An owner's approval of a `first` grant's request: later ones of its kind pass."""

    id: int  # the approved held request
    method: str
    host: str
    port: int
    path: str
    until: datetime | None
    counted: bool  # limited to a number of requests, spent in the store
    operation: str | None = None  # what the body asked, for a grant with a body rule


@dataclass(frozen=True)
class SessionToken:
    """One of a principal's further tokens, as the proxy checks it."""

    id: int
    token_hash: str
    expires_at: datetime | None


@dataclass(frozen=True)
class Snapshot:
    """What the proxy needs, read in one transaction: live principals, credentials, grants."""

    counter: int
    key_id: str | None
    token_hashes: dict[str, str]
    credentials: dict[str, CredentialRecord]
    grants: tuple[GrantRecord, ...]
    unreadable: tuple[str, ...]
    # principal -> its live further tokens, beside the long-lived one in token_hashes
    sessions: dict[str, tuple[SessionToken, ...]] = field(default_factory=dict)
    # Principals with a rate of their own: name -> (rate, burst).
    principal_limits: dict[str, tuple[Rate, int | None]] = field(default_factory=dict)
    # grant id -> the approvals that cover its requests (grants with approval "first")
    coverage: dict[int, tuple[Coverage, ...]] = field(default_factory=dict)
    # Row ids of the live principals and credentials (unreadable ones too): id -> name, so
    # that a Delta naming a row by id finds what it replaces.
    principal_ids: dict[int, str] = field(default_factory=dict)
    credential_ids: dict[int, str] = field(default_factory=dict)
    # The random mark of the change at `counter` (engine.MARK): a store restored in place
    # to the same counter has another.
    mark: int | None = None


@dataclass(frozen=True)
class PrincipalRecord:
    """A live principal as a Delta carries it."""

    name: str
    token_hash: str
    limit: tuple[Rate, int | None] | None


@dataclass(frozen=True)
class Delta:
    """The rows changed since a counter, as they stand at `counter`; None means gone.

    A credential reads as its name alone when its secret cannot be opened.
    """

    counter: int
    key_id: str | None
    changes: int  # rows of change_log it covers
    principals: dict[int, PrincipalRecord | None]
    tokens: dict[int, tuple[str, SessionToken] | None]
    credentials: dict[int, CredentialRecord | str | None]
    grants: dict[int, GrantRecord | None]
    decisions: bool = False  # an access request was decided: the proxy audits it
    # Every approval that covers a `first` grant's requests, read again whenever an access
    # request or a grant changed; None: unchanged.
    coverage: dict[int, tuple[Coverage, ...]] | None = None
    mark: int | None = None  # of the change at `counter`, as Snapshot.mark


@dataclass(frozen=True)
class PrincipalEntry:
    name: str
    created_at: datetime
    rate: str | None = None
    burst: int | None = None


@dataclass(frozen=True)
class TokenEntry:
    """A further token as listed: never the token, only what it is for and its state."""

    id: int
    principal: str
    note: str | None
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    state: str  # active, expired or revoked


@dataclass(frozen=True)
class ConsoleTokenEntry:
    """An approvers' console token as listed: whose, its times and state, never the token."""

    id: int
    operator: str
    created_at: datetime
    expires_at: datetime
    revoked_at: datetime | None
    state: str  # active, expired or revoked


@dataclass(frozen=True)
class CredentialEntry:
    """A live credential as listed: its sealed secret stays in the store."""

    name: str
    scheme: str
    header_name: str | None
    param_name: str | None
    hosts: list[str]
    fingerprint: str
    created_at: datetime
    rotated_at: datetime | None
    options: dict[str, Any] = field(default_factory=dict)
    secret_ref: str | None = None  # where the secret is held, when the store does not seal it
    # A referenced row's keyed mark (store/rules/secretref.py mark): its `fingerprint` is blank,
    # the mark being no value's fingerprint.
    ref_mark: str | None = None


@dataclass(frozen=True)
class GrantEntry:
    """A grant as listed, in any state; hosts None means the credential's."""

    id: int
    principal: str
    credential: str | None
    hosts: list[str] | None
    methods: list[str]
    paths: list[str]
    once: bool
    websocket: bool
    expires_at: datetime | None
    purpose: str | None
    created_at: datetime
    state: str  # active, expired, consumed or revoked
    encoded_slash: bool = False
    key: str | None = None  # the policy file's id for it
    rate: str | None = None
    burst: int | None = None
    max_uses: int | None = None
    uses: int = 0
    approval: str | None = None
    hold: int | None = None
    body: str | None = None  # BodyRule.describe()
    budget: str | None = None  # Budget.describe()
    cap_max_tokens: bool = False  # the budget caps a model call's max_tokens to what is left


@dataclass(frozen=True)
class Usage:
    """Tokens charged in one window of a grant's budget."""

    input_tokens: int = 0
    output_tokens: int = 0
    requests: int = 0
    estimated: int = 0  # of the requests, those charged by the estimate
    spend_micros: int = 0  # micro-US dollars, by the proxy's price table

    def of(self, kind: str) -> int:
        if kind == "spend":
            return self.spend_micros
        if kind == "input":
            return self.input_tokens
        if kind == "output":
            return self.output_tokens
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True)
class BudgetEntry:
    """One limit of a grant's budget as `credproxy usage` shows it."""

    grant_id: int
    principal: str
    state: str
    kind: str
    window: str
    limit: int
    used: int
    remaining: int
    resets_at: datetime
    requests: int
    estimated: int


@dataclass(frozen=True)
class AccessRequestEntry:
    id: int
    principal: str
    host: str
    port: int
    method: str
    path: str
    purpose: str | None
    source: str  # auto (recorded on a denial) or explicit (asked for)
    state: str  # one of REQUEST_STATES
    count: int
    first_seen: datetime
    last_seen: datetime
    decided_at: datetime | None
    decision_reason: str | None
    grant_id: int | None
    kind: str = ACCESS  # or HOLD: a request held for approval under grant_id
    hold_until: datetime | None = None
    cover_until: datetime | None = None
    cover_uses: int | None = None
    covered: int = 0
    operation: str | None = None  # what a held request's body asked (a grant's body rule)
    # A budget request: the limits found spent when it was (last) recorded, and at its
    # approval the grant's budget before and after (canonical descriptions, never usage).
    budget_spent: str | None = None
    budget_was: str | None = None
    budget_set: str | None = None
    decided_by: str | None = None  # the console operator, or `cli:USER`
