"""The schema, as typed SQLAlchemy 2 models. Alembic migrations in store/migrations create it."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    false,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from store.records import utcnow as utcnow  # the store's clock, where the store imports it


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes on every backend (SQLite keeps no zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        assert isinstance(value, datetime)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    pass


class StoreState(Base):
    """One row: the change counter the proxy polls, and the master key's check value."""

    __tablename__ = "store_state"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    change_counter: Mapped[int] = mapped_column(Integer, default=0)
    key_id: Mapped[str | None] = mapped_column(String(32))
    key_check: Mapped[str | None] = mapped_column(String(64))


class ChangeLog(Base):
    """What each change touched: (counter, kind, row id), so a replica reads only that."""

    __tablename__ = "change_log"
    counter: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), primary_key=True)
    row_id: Mapped[int] = mapped_column(Integer, primary_key=True)


class Principal(Base):
    __tablename__ = "principals"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(63))
    token_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    disabled_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # The principal's own limit over all its grants, as written (`600/m`), and its burst.
    rate: Mapped[str | None] = mapped_column(String(16))
    burst: Mapped[int | None] = mapped_column(Integer)

    __table_args__ = (
        Index(
            "uq_principals_live_name",
            "name",
            unique=True,
            sqlite_where=text("disabled_at IS NULL"),
            postgresql_where=text("disabled_at IS NULL"),
        ),
    )


class PrincipalToken(Base):
    """A principal's further tokens (sessions), beside the long-lived one in principals."""

    __tablename__ = "principal_tokens"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    principal_id: Mapped[int] = mapped_column(ForeignKey("principals.id"), index=True)
    token_hash: Mapped[str] = mapped_column(String(64))
    note: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class ConsoleToken(Base):
    """A token of an approvers' console operator (`credproxy console token add`), hashed."""

    __tablename__ = "console_tokens"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    operator: Mapped[str] = mapped_column(String(63), index=True)
    token_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class Credential(Base):
    __tablename__ = "credentials"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(63))
    scheme: Mapped[str] = mapped_column(String(32))
    # Settings of schemes that need more than a header or parameter name (region, token URL, ...).
    options: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    header_name: Mapped[str | None] = mapped_column(String(64))
    param_name: Mapped[str | None] = mapped_column(String(64))
    hosts: Mapped[list[str]] = mapped_column(JSON)
    key_id: Mapped[str | None] = mapped_column(String(32))
    nonce: Mapped[bytes | None] = mapped_column(LargeBinary)
    ciphertext: Mapped[bytes | None] = mapped_column(LargeBinary)
    fingerprint: Mapped[str] = mapped_column(String(32))
    # Where the secret is held when it is not sealed here (store/rules/secretref.py): then
    # key_id, nonce and ciphertext are NULL and fingerprint is empty.
    secret_ref: Mapped[str | None] = mapped_column(String(2048))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    rotated_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    removed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    __table_args__ = (
        Index(
            "uq_credentials_live_name",
            "name",
            unique=True,
            sqlite_where=text("removed_at IS NULL"),
            postgresql_where=text("removed_at IS NULL"),
        ),
    )


class Grant(Base):
    __tablename__ = "grants"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # The id a policy file gives the grant (`[[grant]] id = ...`); NULL for the CLI's grants.
    key: Mapped[str | None] = mapped_column(String(63))
    principal_id: Mapped[int] = mapped_column(ForeignKey("principals.id"), index=True)
    credential_id: Mapped[int | None] = mapped_column(ForeignKey("credentials.id"), index=True)
    # NULL: the credential's hosts.
    hosts: Mapped[list[str] | None] = mapped_column(JSON)
    methods: Mapped[list[str]] = mapped_column(JSON)
    paths: Mapped[list[str]] = mapped_column(JSON)
    once: Mapped[bool] = mapped_column(Boolean, default=False)
    websocket: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # Whether a `*` in the grant's paths may match a segment that holds an encoded slash.
    encoded_slash: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    purpose: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    consumed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    rate: Mapped[str | None] = mapped_column(String(16))  # as written: `60/m`
    burst: Mapped[int | None] = mapped_column(Integer)
    # With max_uses, `uses` counts the requests let through; the last one marks it consumed.
    max_uses: Mapped[int | None] = mapped_column(Integer)
    uses: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    # Requests wait for an owner's decision: "each" one, or the "first" of each kind; at most
    # `hold` seconds.
    approval: Mapped[str | None] = mapped_column(String(8))
    hold: Mapped[int | None] = mapped_column(Integer)
    # What the request's body may ask (store.rules.bodyrules, canonical JSON); NULL: anything.
    body: Mapped[str | None] = mapped_column(Text)
    # Token budgets (store.rules.budgets, canonical JSON); NULL: none. Usage: BudgetUsage.
    budget: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        Index(
            "uq_grants_live_key",
            "key",
            unique=True,
            sqlite_where=text("revoked_at IS NULL AND key IS NOT NULL"),
            postgresql_where=text("revoked_at IS NULL AND key IS NOT NULL"),
        ),
    )


class RateBucket(Base):
    """A token bucket shared by every replica (`run --shared-rates`): its level at `at`."""

    __tablename__ = "rate_buckets"
    key: Mapped[str] = mapped_column(String(160), primary_key=True)
    tokens: Mapped[float] = mapped_column(Float)
    at: Mapped[float] = mapped_column(Float)  # Unix time of the last take


class BudgetUsage(Base):
    """The tokens charged to a grant's budget in one window (`day:2026-12-07`), by every
    replica: each answer adds to the row in one statement."""

    __tablename__ = "budget_usage"
    grant_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    window: Mapped[str] = mapped_column(String(24), primary_key=True)
    input_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    requests: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    # Answers that carried no usage, charged by the estimate (addon/core/usage.py).
    estimated: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    # Micro-US dollars by the proxy's price table (`run --prices`), for spend limits.
    spend_micros: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))


class AccessRequest(Base):
    """An agent's request for access, recorded on a denial or asked for; the owner decides."""

    __tablename__ = "access_requests"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    principal_id: Mapped[int] = mapped_column(ForeignKey("principals.id"))
    host: Mapped[str] = mapped_column(String(253))
    port: Mapped[int] = mapped_column(Integer)
    method: Mapped[str] = mapped_column(String(32))
    path: Mapped[str] = mapped_column(String(2048))
    purpose: Mapped[str | None] = mapped_column(Text)
    source: Mapped[str] = mapped_column(String(8))
    state: Mapped[str] = mapped_column(String(8))
    count: Mapped[int] = mapped_column(Integer, default=1)
    first_seen: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    decided_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    decision_reason: Mapped[str | None] = mapped_column(Text)
    grant_id: Mapped[int | None] = mapped_column(ForeignKey("grants.id"))
    # "access" (asked for, or recorded on a denial) or "hold" (a request held for approval
    # under grant_id, until hold_until). An approved hold of a "first" grant covers later
    # requests of its kind until cover_until, or for cover_uses of them (covered counts).
    kind: Mapped[str] = mapped_column(String(8), default="access", server_default="access")
    hold_until: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cover_until: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cover_uses: Mapped[int | None] = mapped_column(Integer)
    covered: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    # What the held request's body asked, as a grant's body rule decided it: shown to the owner
    # and part of the kind a `first` approval covers. NULL: a request without a body rule.
    operation: Mapped[str | None] = mapped_column(Text)
    # kind "budget": the spent limits of grant_id's budget (`total=200000/day`), and once
    # approved the budget it had and the one it was given; who decided (any kind).
    budget_spent: Mapped[str | None] = mapped_column(Text)
    budget_was: Mapped[str | None] = mapped_column(Text)
    budget_set: Mapped[str | None] = mapped_column(Text)
    decided_by: Mapped[str | None] = mapped_column(String(80))

    __table_args__ = (Index("ix_access_requests_principal_state", "principal_id", "state"),)
