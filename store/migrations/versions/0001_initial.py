"""principals, credentials, grants and the store state

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

from store.db.models import UTCDateTime

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "store_state",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("change_counter", sa.Integer, nullable=False),
        sa.Column("key_id", sa.String(32)),
        sa.Column("key_check", sa.String(64)),
    )
    op.create_table(
        "principals",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("disabled_at", UTCDateTime),
    )
    op.create_index(
        "uq_principals_live_name",
        "principals",
        ["name"],
        unique=True,
        sqlite_where=sa.text("disabled_at IS NULL"),
        postgresql_where=sa.text("disabled_at IS NULL"),
    )
    op.create_table(
        "credentials",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("scheme", sa.String(16), nullable=False),
        sa.Column("header_name", sa.String(64)),
        sa.Column("param_name", sa.String(64)),
        sa.Column("hosts", sa.JSON, nullable=False),
        sa.Column("key_id", sa.String(32)),
        sa.Column("nonce", sa.LargeBinary),
        sa.Column("ciphertext", sa.LargeBinary),
        sa.Column("fingerprint", sa.String(32), nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("rotated_at", UTCDateTime),
        sa.Column("removed_at", UTCDateTime),
    )
    op.create_index(
        "uq_credentials_live_name",
        "credentials",
        ["name"],
        unique=True,
        sqlite_where=sa.text("removed_at IS NULL"),
        postgresql_where=sa.text("removed_at IS NULL"),
    )
    op.create_table(
        "grants",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("principal_id", sa.Integer, sa.ForeignKey("principals.id"), nullable=False),
        sa.Column("credential_id", sa.Integer, sa.ForeignKey("credentials.id")),
        sa.Column("hosts", sa.JSON),
        sa.Column("methods", sa.JSON, nullable=False),
        sa.Column("paths", sa.JSON, nullable=False),
        sa.Column("once", sa.Boolean, nullable=False),
        sa.Column("expires_at", UTCDateTime),
        sa.Column("purpose", sa.Text),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("revoked_at", UTCDateTime),
        sa.Column("consumed_at", UTCDateTime),
    )
    op.create_index("ix_grants_principal_id", "grants", ["principal_id"])
    op.create_index("ix_grants_credential_id", "grants", ["credential_id"])
    op.execute("INSERT INTO store_state (id, change_counter) VALUES (1, 0)")


def downgrade() -> None:
    op.drop_table("grants")
    op.drop_table("credentials")
    op.drop_table("principals")
    op.drop_table("store_state")
